"""The engine's host work per decode step (#57 item 0: at batch 128 a user's step spent ~2.4 ms outside the
decode graph): ``LLM.generate`` over a model whose forward costs nothing (``NullModel``: zero hidden states,
logits that put the next token at (last + 1) mod V), so the whole step time is the engine's own Python work:
scheduling, batch building, sampling's host side, token commits (stop checks, detokenising), outputs.

    python benchmarks/host_step.py [--batches=1,32,128] [--steps=64] [--prompt=256] [--profile] [--eager]

Decode steps take the CUDA-graph path's host work, as on a GPU (``HostGraphs`` stands in for the captured
graphs); ``--eager``: the eager path's (``ForwardBatch.build``), as ``enforce_eager`` runs.

Prints per batch: host ms per decode step = (generate 1 + STEPS tokens - generate 1 token) / STEPS on fresh
prompts; ``--profile``: the top functions by own time at the largest batch (cProfile).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimik3.model.batch import ForwardBatch, HybridCache  # noqa: E402

FLAGS = ("--batches=", "--steps=", "--profile", "--prompt=", "--eager")


class NullModel:
    """No arithmetic: hidden state = the input token, logits peaked at (token + 1) mod V."""
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, vocab_size: int = 256):
        text = SimpleNamespace(vocab_size=vocab_size, eos_token_id=None, kda_layer_ids=(0,), mla_layer_ids=(1,),
                               kda=SimpleNamespace(num_heads=1, head_dim=2, conv_size=2), mla_cache_dim=2,
                               mla_cache_stripes=1)
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

    def run(self, meta: torch.Tensor, tables: torch.Tensor, num_seqs: int, input_ids=None) -> torch.Tensor:
        ids = meta[0, :meta.shape[1]].clone()
        if input_ids is not None:
            ids[:input_ids.shape[0]] = input_ids
        return self.model.compute_logits(ids.to(torch.float32)[:, None])


def arg(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)


def main() -> None:
    unknown = [a for a in sys.argv[1:] if not any(a == f or (f.endswith("=") and a.startswith(f)) for f in FLAGS)]
    if unknown:
        raise SystemExit(f"host_step.py: unknown arguments {unknown}; known: {' '.join(FLAGS)}")
    from kimik3.engine.config import EngineConfig
    from kimik3.engine.core.llm_engine import LLMEngine
    from kimik3.engine.sample.sampling_params import SamplingParams

    batches = [int(b) for b in arg("batches", "1,32,128").split(",")]
    steps, prompt = int(arg("steps", "64")), int(arg("prompt", "256"))
    rng = random.Random(0)
    model = NullModel()
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max(batches), max_model_len=4096,
                                           max_num_batched_tokens=max(batches) * prompt,
                                           cache_memory_bytes=64 << 20))
    if "--eager" not in sys.argv:
        engine.runner.graphs = HostGraphs(model, max(batches))

    def run(n: int, tokens: int) -> float:
        for i in range(n):
            ids = [rng.randrange(10, model.vocab_size) for _ in range(prompt)]
            engine.add_request(f"r{rng.random()}", {"prompt_token_ids": ids},
                               SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t0

    run(max(batches), 8)                                                  # warm-up
    for n in batches:
        t1 = min(run(n, 1) for _ in range(2))
        tn = min(run(n, steps + 1) for _ in range(2))
        print(f"batch {n:4d}: host {(tn - t1) / steps * 1e3:7.3f} ms per decode step "
              f"({(tn - t1) / steps / n * 1e6:6.1f} us per sequence)", flush=True)
    if "--profile" in sys.argv:
        prof = cProfile.Profile()
        prof.enable()
        run(max(batches), steps + 1)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
        print(s.getvalue())


if __name__ == "__main__":
    main()
