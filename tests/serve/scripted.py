"""A runner wrapper that forces scripted outputs: after the real (fake-model) step, the token sampled
for a request whose prompt holds a script key is replaced by the script's next token. A prompt
holding ``POISON`` makes the step raise, like a model bug on one input."""

from __future__ import annotations

import time


class ScriptedRunner:
    def __init__(self, runner, tokenizer, scripts: dict[str, list[int]] | None = None, step_delay: float = 0.0):
        self.runner = runner
        self.tokenizer = tokenizer
        self.scripts = dict(scripts or {})
        self.step_delay = step_delay
        self.failed_steps: list[list] = []     # per step that raised: each chunk's script (None: unscripted)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _script(self, req):
        if not hasattr(req, "_script"):
            text = self.tokenizer.decode(req.prompt_token_ids)
            hit = "POISON" if "POISON" in text else None
            for k, script in self.scripts.items():
                if k in text:
                    hit = script
            req._script = hit
        return req._script

    def execute(self, out):
        if self.step_delay:
            time.sleep(self.step_delay)
        scripts = [self._script(c.req) for c in out.chunks]
        if "POISON" in scripts:
            self.failed_steps.append(scripts)
            raise RuntimeError("scripted model failure (POISON in the prompt)")
        result = self.runner.execute(out)
        reqs = [c.req for c in out.chunks if c.samples]
        for i, req in enumerate(reqs):
            script = self._script(req)
            if isinstance(script, list):
                k = len(req.output_token_ids)
                result.token_ids[i] = script[k] if k < len(script) else script[-1]
        return result
