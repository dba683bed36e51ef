"""Offline API shaped like vLLM's: ``LLM(model=path).generate(prompts, SamplingParams(...))``, ``LLM.chat``."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Any

from tqdm import tqdm

from kimik3.engine.args import EngineArgs
from kimik3.engine.build import build_engine
from kimik3.engine.core.output import CompletionOutput, Logprob, RequestOutput
from kimik3.engine.core.stats import StatsLog
from kimik3.engine.sample.sampling_params import SamplingParams
from kimik3.vision.preprocess import VisionInputs

_ENGINE_ARGS = tuple(f.name for f in dataclasses.fields(EngineArgs) if f.name != "model")
_MM_KEYS = {"image", "video"}


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer=None, disable_log_stats: bool = True,
                 **engine_args: Any):
        """``model``: a checkpoint directory (None: the embedded tiny K3). ``engine_args``: the fields of
        ``kimik3.engine.EngineArgs``, named as vLLM names them (``dtype="bfloat16"``, ``max_model_len``,
        ``gpu_memory_utilization``, ``enforce_eager``, ``kv_cache_dtype``, ``max_logprobs``,
        ``limit_mm_per_prompt``, ``language_model_only``, ``tensor_parallel_size`` ...); the same
        settings as the ``kimik3`` flags, with the same defaults.

        ``tensor_parallel_size`` N > 1: this process becomes rank 0 and spawns N-1 workers, one per GPU
        (``kimik3.parallel``); ``enable_expert_parallel`` splits whole experts over them;
        ``decode_context_parallel_size`` stripes the MLA latent cache over them; ``enable_eplb`` places the experts
        by load (``save_expert_loads`` records one, ``eplb_load_file`` reads it, ``rebalance_experts`` re-places them
        live); ``pipeline_parallel_size`` splits the layers into stages (``pp_micro_batches`` per step).
        ``num_speculative_tokens`` k > 0: each step, requests (greedy or sampled, penalties too) verify
        up to k n-gram draft tokens (``kimik3.engine.spec.speculative``). ``disable_log_stats`` (vLLM's; True
        by default, as vLLM's LLM): False logs ``serve``'s stats line every 10 s while ``generate`` runs."""
        unknown = sorted(set(engine_args) - set(_ENGINE_ARGS))
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {unknown}; it takes model, tokenizer and "
                            f"{', '.join(_ENGINE_ARGS)}")
        self.args = EngineArgs(model=model, **engine_args)
        self.model_path = self.args.model_path()
        if isinstance(tokenizer, (str, os.PathLike)):      # vLLM's tokenizer=PATH: a tokenizer directory
            from kimik3.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(tokenizer)
        self.engine, self.parallel_group = build_engine(self.args, tokenizer)
        self.log_stats = not disable_log_stats
        self.generation_defaults = self.args.generation_defaults(self.model_path)   # SamplingParams names
        self._processor = None
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and destroy the process group (also done at exit), so another
        ``LLM`` can start in this process; this one is unusable afterwards. Idempotent."""
        if self.parallel_group is not None:
            self.parallel_group.close()

    close = shutdown

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def save_expert_loads(self, path: str) -> dict[int, tuple[float, float]]:
        """EPLB (``enable_eplb``): write the tokens each MoE layer (of every pipeline stage) routed to each expert
        since its last placement (start-up or ``rebalance_experts``): a load file ``eplb_load_file`` takes at the
        next start, which places the experts by it. Returns per layer the max/mean of the EP ranks' loads under the
        present placement and under the one the file would give."""
        from kimik3.model.eplb import imbalance, plan_slots, save_loads
        model = self.engine.model
        if not model.parallel.eplb:
            raise ValueError("no expert loads are recorded: start with enable_eplb=True (and expert parallelism)")
        layers = self.engine.runner.expert_loads()
        save_loads(path, {i: load for i, (load, _) in layers.items()}, model.config.text.num_experts)
        ranks, out = model.parallel.ep_size, {}
        for i, (load, slots) in layers.items():
            out[i] = (imbalance(load, slots, ranks), imbalance(load, plan_slots(load, len(slots), ranks), ranks))
        return out

    def rebalance_experts(self) -> dict[int, tuple[float, float]]:
        """EPLB (``enable_eplb``), live: re-place every MoE layer's experts now from the tokens each expert took since
        the last placement, moving their weights between the expert-parallel ranks (point-to-point, between two
        steps) and switching the routing tables with them; the recorded loads then start again. The routing math
        is unchanged, so outputs are too. Returns per layer the max/mean of the EP ranks' loads as measured since
        the last placement and as the same loads fall under the new one (a layer that took no token is left)."""
        if not self.engine.model.parallel.eplb:
            raise ValueError("rebalance_experts needs enable_eplb=True (with enable_expert_parallel)")
        return self.engine.runner.rebalance_experts()

    def get_tokenizer(self):
        return self.engine.get_tokenizer(required=True)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and KDA checkpoint; only possible (True) when no request holds blocks."""
        return self.engine.kv.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation_config.json (``generation_config="auto"``), else vLLM's."""
        return SamplingParams(**self.generation_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order.

        A prompt is a string, ``{"prompt_token_ids": ids}`` or ``{"prompt": text}``, optionally with vLLM's
        ``"multi_modal_data": {"image": PIL image or list, "video": list of frames (or a list of such lists)}``.
        The prompt may hold one ``<|media_pad|>`` per image / video chunk (the HF processor's form; it is
        expanded here to one pad per embedding row) or the expanded pads already. Images come first, then
        video chunks, in the order their pads appear. ``use_tqdm``: a progress bar on stderr."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = [self._engine_prompt(p) for p in prompts]
        params = sampling_params or self.get_default_sampling_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one or one each")
        for prompt, p in zip(prompts, params):   # all or nothing: a bad prompt leaves the engine untouched
            self.engine.check_request(prompt, p)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params):
            self.engine.add_request(rid, prompt, p, final_only=True)
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        start, n_out, n_prompt = time.perf_counter(), 0, 0
        stats = StatsLog(self.engine) if self.log_stats else None
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if delta.request_id not in wanted:
                    continue
                acc = results.get(delta.request_id)
                if acc is None:
                    acc = results[delta.request_id] = RequestOutput(
                        delta.request_id, delta.prompt, delta.prompt_token_ids, [], False)
                    n_prompt += len(delta.prompt_token_ids)
                _merge(acc, delta)
                n_out += sum(len(c.token_ids) for c in delta.outputs)
                if delta.finished:
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{n_out / (time.perf_counter() - start):.0f}")
            if stats is not None:
                stats.tick(n_prompt, n_out)
        if stats is not None:
            stats.tick(n_prompt, n_out, force=True)
        bar.close()
        tok = self.engine.get_tokenizer()
        for rid, p in zip(ids, params):
            for c in results[rid].outputs:
                _vllm_logprobs(c, p.logprobs, tok)
        return [results[rid] for rid in ids]

    # ---- what vLLM's LLM has and kimik3 does not -------------------------------------------------------
    def _unsupported(self, name: str):
        raise NotImplementedError(f"LLM.{name} is not supported: kimik3 runs Kimi-K3 / Kimi-Linear as generative "
                                  f"models only (no pooling, embedding, scoring or beam search); use LLM.generate "
                                  f"or LLM.chat")

    def encode(self, *args, **kwargs):
        self._unsupported("encode")

    def embed(self, *args, **kwargs):
        self._unsupported("embed")

    def classify(self, *args, **kwargs):
        self._unsupported("classify")

    def score(self, *args, **kwargs):
        self._unsupported("score")

    def reward(self, *args, **kwargs):
        self._unsupported("reward")

    def beam_search(self, *args, **kwargs):
        self._unsupported("beam_search")

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, media_io_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or a list of
        them, rendered in the checkpoint's chat format. Content parts may be text, images (PIL or a data:
        URL) and videos (a data: URL, bytes or a file path), sampled per ``media_io_kwargs={"video": {"fps":
        F, "num_frames": N}}`` (``kimik3.engine.images.chat_media``). ``chat_template_kwargs``: ``thinking`` /
        ``enable_thinking`` (bool), ``thinking_effort``, ``preserve_thinking`` (``kimik3.chat.options``; the
        server's reading). The text
        comes back raw (thinking included); ``kimik3.chat.parse_k3_output`` splits it."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages (or of conversations)")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = [self._chat_prompt(c, chat_template_kwargs or {}, add_generation_prompt, tools, media_io_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- prompts -------------------------------------------------------------------------------------
    def _processor_config(self):
        if self._processor is None:
            from kimik3.vision.preprocess import load_media_processor_config
            self._processor = load_media_processor_config(self.model_path)
        return self._processor

    def _chat_prompt(self, conversation: list, template_kwargs: dict, add_generation_prompt: bool, tools,
                     media_io_kwargs=None):
        from kimik3.chat.options import drop_past_reasoning, thinking_options
        from kimik3.engine.images.chat_media import chat_media
        opts = thinking_options(template_kwargs)        # ValueError naming a bad or unknown key
        media = chat_media(conversation, self._processor_config(), media_io_kwargs, self._check_mm_limit)
        rendered = media.messages
        tok = self.get_tokenizer()
        kw: dict[str, Any] = {"tools": tools, "tokenize": True, "add_generation_prompt": add_generation_prompt,
                              "images": media.images, "videos": media.videos}
        if not opts.preserve:
            rendered = drop_past_reasoning(rendered)
        if tok.chat_format == "k3":
            kw.update(thinking=opts.thinking, thinking_effort=opts.effort if opts.thinking else None)
        elif template_kwargs:
            raise ValueError(f"chat_template_kwargs {sorted(template_kwargs)} need the K3 chat format; this "
                             f"tokenizer renders {tok.chat_format!r}")
        else:
            kw.update(thinking_effort=None)
        ids = tok.apply_chat_template(rendered, **kw)
        if media.vision is None:
            return {"prompt_token_ids": ids}
        return {"prompt_token_ids": ids, "multi_modal_data": media.vision}

    def _check_mm_limit(self, kind: str, count: int) -> None:
        limits = self.args.limit_mm_per_prompt
        if limits is not None and kind in limits and count > limits[kind]:
            raise ValueError(f"the prompt has {count} {kind}(s), more than limit_mm_per_prompt[{kind!r}]="
                             f"{limits[kind]}")

    def _engine_prompt(self, prompt):
        """vLLM's prompt forms -> the engine's (token ids, VisionInputs with one pad per embedding row)."""
        if not isinstance(prompt, dict):
            return prompt
        mm = prompt.get("multi_modal_data")
        vision = self._vision(mm) if mm is not None and not isinstance(mm, VisionInputs) else mm
        if "prompt_token_ids" not in prompt and "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str) or not text:
                raise ValueError("a prompt's 'prompt' must be a non-empty string")
            if vision is not None:
                from kimik3.chat.k3 import fill_image_placeholders
                text = fill_image_placeholders(text, vision.sizes)
            ids = self.get_tokenizer().encode(text, allow_special=mm is not None)
            prompt = {**prompt, "prompt_token_ids": ids}
        if mm is None or isinstance(mm, VisionInputs):
            return prompt
        from kimik3.engine.images.multimodal import expand_media_pads
        pad = self.engine.model.config.media_placeholder_token_id
        ids = list(prompt["prompt_token_ids"])
        n_pads = sum(1 for t in ids if t == pad) if pad is not None else 0
        if pad is not None and n_pads == len(vision) and n_pads != sum(vision.num_tokens):
            ids = expand_media_pads(ids, vision.num_tokens, pad)
        return {**{k: v for k, v in prompt.items() if k != "multi_modal_data"}, "prompt_token_ids": ids,
                "multi_modal_data": vision}

    def _vision(self, mm) -> VisionInputs:
        if not isinstance(mm, dict) or not mm or set(mm) - _MM_KEYS:
            raise ValueError(f"multi_modal_data must be {{'image': PIL image or list, 'video': list of frames}} "
                             f"(or a kimik3 VisionInputs), got {mm if not isinstance(mm, dict) else sorted(mm)!r}")
        from kimik3.vision.preprocess import concat_vision_inputs, preprocess_images, preprocess_video
        cfg = self._processor_config()
        parts = []
        images = mm.get("image")
        if images is not None:
            images = images if isinstance(images, (list, tuple)) else [images]
            self._check_mm_limit("image", len(images))
            if images:
                parts.append(preprocess_images(images, cfg))
        videos = mm.get("video")
        if videos is not None:
            videos = list(videos) if isinstance(videos, (list, tuple)) else [videos]
            if videos and not isinstance(videos[0], (list, tuple)):
                videos = [videos]                        # one video given as its list of frames
            self._check_mm_limit("video", len(videos))
            chunk = cfg.temporal_merge_kernel_size
            for frames in videos:
                parts += [preprocess_video(frames[i:i + chunk], cfg) for i in range(0, len(frames), chunk)]
        if not parts:
            raise ValueError("multi_modal_data holds no images or video frames; leave it out for a text prompt")
        return concat_vision_inputs(parts)


def _vllm_logprobs(c, num_logprobs: int | None, tokenizer) -> None:
    """The sample's logprobs as vLLM's ``Logprob`` values (rank, decoded token) and its cumulative_logprob."""
    if c.logprobs is None:
        return
    out, total = [], 0.0
    for tid, lp in zip(c.token_ids, c.logprobs):
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])
        top = {t for t, _ in ranked[:num_logprobs or 0]}
        out.append({t: Logprob(v, k + 1 if t in top or t != tid else None,
                               tokenizer.decode([t]) if tokenizer is not None else None)
                    for k, (t, v) in enumerate(ranked)})
        total += lp.get(tid, float("-inf"))
    c.logprobs, c.cumulative_logprob = out, total


def _merge(acc: RequestOutput, delta: RequestOutput) -> None:
    by_index = {c.index: c for c in acc.outputs}
    for d in delta.outputs:
        c = by_index.get(d.index)
        if c is None:
            c = by_index[d.index] = CompletionOutput(d.index, "", [], [] if d.logprobs is not None else None)
            acc.outputs.append(c)
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            c.logprobs.extend(d.logprobs)
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    acc.outputs.sort(key=lambda c: c.index)
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs = delta.prompt_logprobs
    acc.finished = delta.finished
    acc.metrics = delta.metrics or acc.metrics
