"""The prefill cost of prefix caching's KDA checkpoints (#57 item 0): the same prefill with and without the state
snapshots prefix caching takes in it, timed in one run.

Layer mode (default): one ``KimiDeltaAttention`` layer (a slice config's dims, ``--heads`` to shrink it) over
``--seqs`` fresh prompts of ``--tokens`` tokens in one eager step, with a checkpoint every ``--every`` tokens of
each (as the scheduler asks: at block boundaries, the last one at the prompt's end when it falls there) against
none. Engine mode (``--engine``): ``LLM`` over the embedded default model (4 KDA + 2 MLA layers), prefill of one
``--tokens``-token prompt with prefix caching (checkpoints every ``--every`` tokens) against a second ``LLM``
without it. Prints the median times of ``--repeats`` and their ratio (the target: at most 1.05).

What a checkpoint adds to the plain step (one conv pass in the pool, one chunked KDA call, the states gathered
from and scattered to their slots): the conv window at each checkpoint (W - 1 rows of 3P channels, gathered
from the raw inputs), and, for a checkpoint inside a chunk, one more round of the chunked kernel: the
sequences are cut there, round r runs every sequence's r-th segment from the states round r - 1 left (a round
of one sequence reads its rows in place; of several, q, k, v, f, b are gathered: 2 x (3P + P + H) values a
token and the output scattered back, ~10% of the kernel's own bytes), and the state after it is copied to
the checkpoint's slot (H V K fp32). The kernel's work is the same (its chunks, the same tokens); a round costs
its launches, and a segment that ends mid-64-token chunk one partial chunk. A checkpoint at a chunk's last row
is the final state, copied after the plain pass. (Until this change the checkpoint step ran the torch
reference conv: on CUDA [T, 3P, W] windows in fp32, ~1.6 GB a layer at Kimi-Linear's width and 8k tokens;
``--legacy`` times that step instead.)

    python benchmarks/kda_checkpoints.py [--tokens=2048] [--heads=8] [--every=1024] [--seqs=1] [--repeats=5] [--legacy]
        [--config=benchmarks/gpu/kimi-linear-slice4.config.json] [--device=cpu|cuda] [--dtype=float32|bfloat16]
    python benchmarks/kda_checkpoints.py --engine [--tokens=4096] [--every=1024]
    PYTHONPATH=. python benchmarks/kda_checkpoints.py --device=cuda --dtype=bfloat16 --heads=32 --tokens=8192 \\
        --every=5648          # the Kimi-Linear slice's layer at its default interval (353 blocks)
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import arg, commit_id  # noqa: E402

FLAGS = ("--tokens=", "--heads=", "--every=", "--seqs=", "--repeats=", "--config=", "--device=", "--dtype=", "--engine",
         "--legacy")
BLOCK = 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def legacy_attend_with_checkpoints(self, raw, weight, f, b, has_state, batch, conv_pool, state_pool):
    """The checkpoint step before ``d0fb3ef`` (reference conv, every sequence's segments gathered, fp32 output),
    kept here to time the change in the same run (``--legacy``)."""
    import itertools

    from kimik3.ops.conv import causal_conv1d, conv_windows_at
    from kimik3.ops.kda import dense, kda_attention
    T, H, K = raw.shape[0], self.num_heads, self.head_dim
    slots = batch.state_slots
    f = dense(f, H)
    conv0 = conv_pool[slots].masked_fill(~has_state.view(-1, 1, 1), 0)
    state0 = state_pool[slots].masked_fill(~has_state.view(-1, 1, 1, 1), 0)
    mixed, conv1 = causal_conv1d(raw, weight, conv0, batch.query_lens_cpu)
    q, k, v = (t.view(T, H, K) for t in mixed.chunk(3, dim=-1))
    starts = [0, *itertools.accumulate(batch.query_lens_cpu)]
    cuts: dict[int, dict[int, list[int]]] = {}
    for c in batch.checkpoints:
        cuts.setdefault(c.seq, {}).setdefault(c.num_tokens, []).append(c.slot)
    seq, rows, dst = (torch.tensor(v, device=raw.device) for v in zip(*[(c.seq, c.num_tokens, c.slot)
                                                                         for c in batch.checkpoints]))
    conv_pool[dst] = conv_windows_at(raw, conv0, batch.cu_seqlens, seq, rows)
    bounds = []
    for n, ql in enumerate(batch.query_lens_cpu):
        edges = sorted({0, ql, *(o for o in cuts.get(n, {}) if 0 < o <= ql)})
        bounds.append(list(zip(edges[:-1], edges[1:])))
    state = state0.clone()
    o = q.new_empty(q.shape[0], H, K, dtype=torch.promote_types(q.dtype, torch.float32))
    for r in range(max(len(s) for s in bounds)):
        seqs = [n for n in range(len(bounds)) if r < len(bounds[n])]
        rows = torch.cat([torch.arange(starts[n] + bounds[n][r][0], starts[n] + bounds[n][r][1], device=raw.device)
                          for n in seqs])
        lens = [bounds[n][r][1] - bounds[n][r][0] for n in seqs]
        out, fin = kda_attention(q[rows], k[rows], v[rows], f[rows], b[rows], self.A_log, self.dt_bias,
                                 self.lower_bound, state[seqs], lens)
        o[rows] = out.to(o.dtype)
        state[seqs] = fin
        for j, n in enumerate(seqs):
            for slot in cuts.get(n, {}).get(bounds[n][r][1], []):
                state_pool[slot] = fin[j]
    conv_pool[slots] = conv1
    state_pool[slots] = state
    return o


def layer_times(device: torch.device, dtype: torch.dtype, tokens: int, every: int, seqs: int,
                repeats: int) -> tuple[float, float, int, int]:
    """Median seconds of the layer's step without and with checkpoints, the checkpoints taken, the heads."""
    from kimik3.config import parse_config
    from kimik3.model.batch import ForwardBatch, StateCheckpoint
    from kimik3.model.kda import KimiDeltaAttention
    cfg = parse_config(json.loads(Path(arg("config", str(ROOT / "benchmarks/gpu/kimi-linear-slice4.config.json")))
                                  .read_text())).text
    k = cfg.kda
    heads = int(arg("heads", str(k.num_heads) if device.type == "cuda" else "8"))
    g = torch.Generator().manual_seed(0)
    layer = KimiDeltaAttention(cfg.hidden_size, heads, k.head_dim, k.conv_size, k.use_full_rank_gate,
                               k.gate_lower_bound, cfg.rms_norm_eps)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        layer.A_log.uniform_(0, 1.5, generator=g)
    layer = layer.to(device)
    if "--legacy" in sys.argv:
        import types
        layer._attend_with_checkpoints = types.MethodType(legacy_attend_with_checkpoints, layer)
    for name, p in layer.named_parameters():        # fp32 A_log, dt_bias, conv, o_norm (as the model keeps them)
        if not any(s in name for s in ("A_log", "dt_bias", "conv1d", "o_norm")):
            p.data = p.data.to(dtype)
    x = torch.randn(seqs * tokens, cfg.hidden_size, generator=g).to(device, dtype)
    P = heads * k.head_dim
    slots = 2 * seqs + tokens // every * seqs + 2
    conv = torch.zeros(slots, 3 * P, k.conv_size - 1, dtype=dtype, device=device)
    state = torch.zeros(slots, heads, k.head_dim, k.head_dim, dtype=torch.promote_types(dtype, torch.float32),
                        device=device)
    per_seq = -(-tokens // BLOCK)
    tables = [list(range(1 + n * per_seq, 1 + (n + 1) * per_seq)) for n in range(seqs)]
    cks = tuple(StateCheckpoint(n, off, 1 + seqs + i * seqs + n) for n in range(seqs)
                for i, off in enumerate(range(every, tokens + 1, every)))

    def run(checkpoints) -> float:
        batch = ForwardBatch.build([tokens] * seqs, [0] * seqs, list(range(1, seqs + 1)), tables, BLOCK,
                                   device=device, checkpoints=checkpoints)
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            layer(x, batch, conv, state)
        sync(device)
        return time.perf_counter() - t0

    run(()), run(cks)                                                  # warm-up (and compiles)
    plain, ckpt = [], []
    for _ in range(repeats):                                           # alternated: the box drifts
        plain.append(run(()))
        ckpt.append(run(cks))
    return statistics.median(plain), statistics.median(ckpt), len(cks), heads


def engine_times(tokens: int, every: int, repeats: int) -> tuple[float, float, int]:
    """Median seconds of ``LLM.generate`` with one token on a fresh ``tokens``-token prompt, prefix caching on
    (checkpoints every ``every`` tokens) and off."""
    import random

    from kimik3 import LLM, SamplingParams
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = []
    for caching in (True, False):
        llm = LLM(max_model_len=tokens + 16, max_num_batched_tokens=tokens, enable_prefix_caching=caching,
                  kda_checkpoint_interval=every // BLOCK, max_num_seqs=1)
        vocab = llm.engine.vocab_size

        def once() -> float:
            ids = [rng.randrange(vocab // 16, vocab - vocab // 16) for _ in range(tokens)]
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
            return time.perf_counter() - t0
        once()
        out.append(statistics.median(once() for _ in range(repeats)))
        llm.shutdown()
    return out[1], out[0], tokens // every


def main() -> None:
    unknown = [a for a in sys.argv[1:] if not any(a == f or (f.endswith("=") and a.startswith(f)) for f in FLAGS)]
    if unknown:
        raise SystemExit(f"kda_checkpoints.py: unknown arguments {unknown}; known: {' '.join(FLAGS)}")
    device = torch.device(arg("device", "cpu"))
    dtype = getattr(torch, arg("dtype", "float32"))
    repeats = int(arg("repeats", "5"))
    if device.type == "cpu":
        torch.set_num_threads(1)        # a shared box: one core each, steadier
    if "--engine" in sys.argv:
        tokens, every = int(arg("tokens", "4096")), int(arg("every", "1024"))
        plain, ckpt, n = engine_times(tokens, every, repeats)
        what = f"LLM prefill of {tokens} tokens (default model), prefix caching off / on ({n} checkpoints)"
    else:
        tokens, every, seqs = int(arg("tokens", "2048")), int(arg("every", "1024")), int(arg("seqs", "1"))
        plain, ckpt, n, heads = layer_times(device, dtype, tokens, every, seqs, repeats)
        what = (f"KDA layer step, {seqs} x {tokens} tokens, {heads} heads, {dtype}, "
                f"without / with {n} checkpoints{' (the checkpoint step before d0fb3ef)' if '--legacy' in sys.argv else ''}")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{what}: {plain * 1e3:.1f} / {ckpt * 1e3:.1f} ms, ratio {ckpt / plain:.3f} "
          f"({name}, {commit_id()}, {datetime.date.today().isoformat()}, medians of {repeats})", flush=True)


if __name__ == "__main__":
    main()
