"""The engine's host work per decode step (#57 item 0: at batch 128 a user's step spent ~2.4 ms outside the
decode graph): ``LLM.generate`` over a model whose forward costs nothing (``NullModel``: zero hidden states,
logits that put the next token at (last + 1) mod V), so the whole step time is the engine's own Python work:
scheduling, batch building, sampling's host side, token commits (stop checks, detokenising), outputs, and
``LLM.generate``'s merging of the deltas.

    python benchmarks/host_step.py [--batches=1,32,128] [--steps=64] [--prompt=256] [--repeats=3] [--profile]
        [--eager] [--sync] [--no-tokenizer]

As on one GPU by default: async scheduling, the decode steps on the CUDA-graph path's host work (``HostGraphs``
stands in for the captured graphs), outputs detokenised (the embedded default model's tokenizer; the null model's
tokens are its byte tokens). ``--sync``: the synchronous step; ``--eager``: the eager path's host work
(``ForwardBatch.build``), as ``enforce_eager`` runs; ``--no-tokenizer``: token ids only; ``--stream``: the engine
driven as the server drives it (``LLMEngine.step`` with a delta a request a step, each delta's text read) instead
of ``LLM.generate`` (one output a request, when it finishes).

Prints per batch: host ms per decode step = (generate 1 + STEPS tokens - generate 1 token) / STEPS on fresh
prompts (the best of two each), the median (min-max) of REPEATS such figures; ``--profile``: the top functions by
own time over the decode steps alone at the largest batch (cProfile; its own overhead inflates small calls).
Process CPU time per step (the same difference of ``time.process_time``) is printed beside the wall time: on a
loaded box it leaves out the time spent waiting for a core. Torch runs on one thread here, as nothing is computed.
The box these run on is shared: the figures are noisy; compare runs made together.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import arg  # noqa: E402
from kimik3.model.batch import ForwardBatch, HybridCache  # noqa: E402

FLAGS = ("--batches=", "--steps=", "--profile", "--prompt=", "--eager", "--sync", "--no-tokenizer", "--repeats=",
         "--stream")


class NullModel:
    """No arithmetic: hidden state = the input token, logits peaked at (token + 1) mod V."""
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, vocab_size: int = 256):
        text = SimpleNamespace(vocab_size=vocab_size, eos_token_id=None, kda_layer_ids=(0,), mla_layer_ids=(1,),
                               kda=SimpleNamespace(num_heads=1, head_dim=2, conv_size=2), mla_cache_dim=2,
                               mla_cache_stripes=1,
                               cached_layer_ids=lambda kind: (0,) if kind == "kda" else (1,))
        self.config = SimpleNamespace(text=text, architecture="null", vision=None, media_placeholder_token_id=None)
        self.vocab_size = vocab_size
        self._eye = None

    @property
    def cache_text_config(self):
        return self.config.text

    def allocate_cache(self, num_slots: int, num_blocks: int, block_size: int, latent_dtype=None) -> HybridCache:
        return HybridCache.allocate(self.config.text, num_slots, num_blocks, block_size, self.dtype, self.device,
                                    latent_dtype)

    def forward_step(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        return input_ids.to(torch.float32)[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        logits[torch.arange(hidden.shape[0]), (hidden[:, 0].long() + 1) % self.vocab_size] = 1.0
        return logits


class HostGraphs:
    """Stands in for ``DecodeGraphs`` on the CPU, so decode steps take the graph path's host work
    (``graph_size``, ``build_decode``: the padded meta and block tables) and "replay" by reading the
    input ids back from the packed meta."""
    max_query_len = 1

    def __init__(self, model: NullModel, max_num_seqs: int):
        from kimik3.model.cuda_graphs import graph_batch_sizes
        self.model = model
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.batches = {(size, 1): None for size in self.sizes}

    def size_for(self, n: int) -> int | None:
        from kimik3.model.cuda_graphs import padded_batch_size
        return padded_batch_size(n, self.sizes)

    def states(self, num_seqs: int, L: int) -> None:
        """The states a draft model reads (``DecodeGraphs.states``): none, no draft here."""
        return None

    def run(self, meta: torch.Tensor, tables: torch.Tensor, num_seqs: int, input_ids=None, drafts=None) -> torch.Tensor:
        assert drafts is None, "no draft model here: no drafts on the device"
        ids = meta[0, :meta.shape[1]].clone()
        if input_ids is not None:
            ids[:input_ids.shape[0]] = input_ids
        return self.model.compute_logits(ids.to(torch.float32)[:, None])


def make_llm(batch: int, prompt: int, eager: bool, sync: bool, tokenizer: bool):
    """An ``LLM`` over the null model with the engine a GPU would build (async scheduling, graph path)."""
    from kimik3.engine.config import EngineConfig
    from kimik3.engine.core.llm_engine import LLMEngine
    from kimik3.engine.llm import LLM
    model = NullModel()
    tok = None
    if tokenizer:
        from kimik3.tokenizer import load_tokenizer
        tok = load_tokenizer(Path(__file__).resolve().parents[1] / "kimik3" / "default_model")
    # KDA checkpoints as far apart as the Kimi-Linear slice's default (353 blocks; the K3 slice's: 1,060): the null
    # model's tiny state would give one a block, and a step that takes one runs eagerly
    engine = LLMEngine(model, EngineConfig(max_num_seqs=batch, max_model_len=8192, max_num_batched_tokens=batch * prompt,
                                           cache_memory_bytes=64 << 20, async_scheduling=not sync,
                                           kda_checkpoint_interval=353), tokenizer=tok)
    if not eager:
        engine.runner.graphs = HostGraphs(model, batch)
    import kimik3.engine.llm as llm_module
    build = llm_module.build_engine     # an LLM (the embedded model's settings) around this engine: no weights loaded
    llm_module.build_engine = lambda args, tokenizer=None: (engine, None)
    try:
        return LLM()
    finally:
        llm_module.build_engine = build


def main() -> None:
    unknown = [a for a in sys.argv[1:] if not any(a == f or (f.endswith("=") and a.startswith(f)) for f in FLAGS)]
    if unknown:
        raise SystemExit(f"host_step.py: unknown arguments {unknown}; known: {' '.join(FLAGS)}")
    from kimik3.engine.sample.sampling_params import SamplingParams

    batches = [int(b) for b in arg("batches", "1,32,128").split(",")]
    steps, prompt, repeats = int(arg("steps", "64")), int(arg("prompt", "256")), int(arg("repeats", "3"))
    sync = "--sync" in sys.argv
    torch.set_num_threads(1)
    llm = make_llm(max(batches), prompt, "--eager" in sys.argv, sync, "--no-tokenizer" not in sys.argv)
    vocab = llm.engine.vocab_size
    rng = random.Random(0)

    def prompts(n: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(prompt)]} for _ in range(n)]

    stream = "--stream" in sys.argv

    def run(n: int, tokens: int) -> tuple[float, float]:
        ps = prompts(n)
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        t0, c0 = time.perf_counter(), time.process_time()
        if stream:
            got = streamed(llm.engine, ps, params)
        else:
            got = [len(o.outputs[0].token_ids) for o in llm.generate(ps, params, use_tqdm=False)]
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        assert got == [tokens] * n, got
        return dt, dc

    print(f"host_step.py: {'sync' if sync else 'async'} scheduling, {'eager' if '--eager' in sys.argv else 'graph'} "
          f"path, {'no tokenizer' if '--no-tokenizer' in sys.argv else 'detokenised'}, "
          f"{'streamed deltas' if stream else 'LLM.generate'}, prompt {prompt}, {steps} steps, "
          f"{repeats} repeats", flush=True)
    run(max(batches), 8)                                                  # warm-up
    for n in batches:
        per_step, cpu = [], []
        for _ in range(repeats):
            (t1, c1), (tn, cn) = (min(run(n, k) for _ in range(2)) for k in (1, steps + 1))
            per_step.append((tn - t1) / steps)
            cpu.append((cn - c1) / steps)
        med = statistics.median(per_step)
        print(f"batch {n:4d}: host {med * 1e3:7.3f} ms per decode step ({min(per_step) * 1e3:.3f}-"
              f"{max(per_step) * 1e3:.3f}; {med / n * 1e6:6.1f} us per sequence; process CPU time "
              f"{statistics.median(cpu) * 1e3:.3f} ms)", flush=True)
    if "--profile" in sys.argv:
        profile(llm, max(batches), steps, prompts)


_ids = iter(range(1 << 62))


def streamed(engine, prompts: list[dict], params) -> list[int]:
    """The requests through ``LLMEngine.step`` as a server takes them: a delta a step, its text read; the
    tokens each got."""
    ids = [f"s{next(_ids)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    got = dict.fromkeys(ids, 0)
    text = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for c in delta.outputs:
                got[delta.request_id] += len(c.token_ids)
                text += len(c.text)
    return list(got.values())


def profile(llm, n: int, steps: int, prompts) -> None:
    """cProfile of the decode steps of one batch of ``n`` requests (their prefill step excluded), added as
    ``LLM.generate`` adds them (``--stream``: as the server does)."""
    from kimik3.engine.sample.sampling_params import SamplingParams
    engine = llm.engine
    for i, p in enumerate(prompts(n)):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True),
                           **({} if "--stream" in sys.argv else {"final_only": True}))
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    while engine.has_unfinished_requests():
        engine.step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())


if __name__ == "__main__":
    main()
