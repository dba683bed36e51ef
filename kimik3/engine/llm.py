"""Offline API shaped like vLLM's: ``LLM(path).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import time

import torch
from tqdm import tqdm

from kimik3.engine.config import EngineConfig
from kimik3.engine.llm_engine import LLMEngine
from kimik3.engine.request import CompletionOutput, RequestOutput
from kimik3.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model_path: str, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 8192,
                 max_model_len: int = 8192, enable_prefix_caching: bool = True, block_size: int = 16,
                 kda_checkpoint_interval: int | None = None, cache_memory_bytes: int | None = None,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None, seed: int = 0,
                 tokenizer=None, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 num_speculative_tokens: int = 0, speculative_ngram_min: int = 2, speculative_ngram_max: int = 4):
        """``tensor_parallel_size`` N > 1: this process becomes rank 0 and spawns N-1 workers, one
        per GPU (``kimik3.parallel``); ``enable_expert_parallel`` splits whole experts over them.
        ``num_speculative_tokens`` k > 0: greedy requests verify up to k n-gram draft tokens per
        step (``kimik3.engine.speculative``)."""
        import kimik3   # the package re-exports LLM, so load_model is looked up at call time
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
                              block_size=block_size, kda_checkpoint_interval=kda_checkpoint_interval,
                              cache_memory_bytes=cache_memory_bytes, seed=seed,
                              num_speculative_tokens=num_speculative_tokens, speculative_ngram_min=speculative_ngram_min,
                              speculative_ngram_max=speculative_ngram_max)
        self.parallel_group = None
        if tensor_parallel_size > 1 or enable_expert_parallel:
            from kimik3.parallel.launch import ParallelConfig, start_group
            layout = ParallelConfig(tensor_parallel_size, enable_expert_parallel)
            model, self.parallel_group = start_group(model_path, layout, dtype, device.type)
            self.engine = LLMEngine(model, config, tokenizer=tokenizer, tokenizer_path=str(model_path),
                                    runner_factory=self.parallel_group.runner_factory)
        else:
            model = kimik3.load_model(model_path, device=device, dtype=dtype)
            self.engine = LLMEngine(model, config, tokenizer=tokenizer, tokenizer_path=str(model_path))
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

    def get_tokenizer(self):
        return self.engine.get_tokenizer(required=True)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one or one each")
        for prompt, p in zip(prompts, params):   # all or nothing: a bad prompt leaves the engine untouched
            self.engine.check_request(prompt, p)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params):
            self.engine.add_request(rid, prompt, p)
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        start, n_out = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if delta.request_id not in wanted:
                    continue
                acc = results.get(delta.request_id)
                if acc is None:
                    acc = results[delta.request_id] = RequestOutput(
                        delta.request_id, delta.prompt, delta.prompt_token_ids, [], False)
                _merge(acc, delta)
                n_out += sum(len(c.token_ids) for c in delta.outputs)
                if delta.finished:
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{n_out / (time.perf_counter() - start):.0f}")
        bar.close()
        return [results[rid] for rid in ids]


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
    acc.finished = delta.finished
    acc.metrics = delta.metrics or acc.metrics
