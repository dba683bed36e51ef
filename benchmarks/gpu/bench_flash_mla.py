"""The MLA decode op alone (#14 item 2): our Triton split-K kernel (``ops/triton/mla_decode.py``) against
DeepSeek's FlashMLA (``KIMIK3_FLASH_MLA``, opt-in), the same 64-token-block cache and queries, each launch
captured in a CUDA graph and replayed; cases of heads / batch / context as in the eighth session's table
(96 heads: K3; 32: Kimi-Linear; 16: K3 under tensor parallelism 8, 12 heads padded). Floor: max(the
latent bytes at the copy rate, the attention FLOPs 2 x heads x (576 + 512) a cached row at the matmul
rate). Then each path's error against the float64 reference on a small ragged batch.

    KIMIK3_FLASH_MLA=.../libkimik3_flash_mla.so PYTHONPATH=. python benchmarks/gpu/bench_flash_mla.py
                                                              (writes $OUT/bench_flash_mla.json)
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (capture_graph, commit_id, copy_rate, cuda_time, library_path, log, matmul_rate,  # noqa: E402
                               named_or_not, rel_err, save_results)
from kimik3.ops.backend import reference_ops  # noqa: E402
from kimik3.ops.cuda.flash_mla import ENV  # noqa: E402
from kimik3.ops.mla import mla_decode_attention  # noqa: E402

R, P, BS = 512, 64, 64
SCALE = 192 ** -0.5
CASES = [(96, 1, 32768), (96, 1, 131072), (96, 1, 1048576), (96, 8, 131072), (96, 128, 4096), (96, 32, 4096),
         (32, 1, 131072), (32, 1, 1048576), (32, 8, 131072), (32, 128, 4096), (16, 1, 1048576)]


def inputs(H: int, lens: list[int], g: torch.Generator):
    blocks = [-(-L // BS) for L in lens]
    cache = torch.randn(sum(blocks) + 1, BS, R + P, device="cuda", generator=g).to(torch.bfloat16)
    perm = torch.randperm(sum(blocks), device="cuda", generator=g) + 1
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for n, nb in enumerate(blocks):
        tables[n, :nb] = perm[used:used + nb].int()
        used += nb
    q_lat = torch.randn(len(lens), H, R, device="cuda", generator=g).to(torch.bfloat16)
    q_pe = torch.randn(len(lens), H, P, device="cuda", generator=g).to(torch.bfloat16)
    return q_lat, q_pe, cache, tables, torch.tensor(lens, dtype=torch.int32, device="cuda")


def op(args, max_len: int, flash: bool, lib: str):
    """The decode op with FlashMLA's library named or not."""
    return named_or_not(ENV, lib, flash, lambda: mla_decode_attention(*args[:4], args[4], R, SCALE, max_seq_len=max_len))


def main():
    lib = library_path(ENV, "kimik3 build-kernels")
    bw, mm = copy_rate(), matmul_rate()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for H, N, ctx in CASES:
        args = inputs(H, [ctx] * N, g)
        floor_bytes = N * ctx * (R + P) * 2 / bw
        floor_flops = N * ctx * 2 * H * (R + P + R) / mm
        floor = max(floor_bytes, floor_flops)
        times, outs = {}, {}
        for name, flash in (("triton", False), ("flash_mla", True)):
            graph, out = capture_graph(lambda: op(args, ctx, flash, lib))
            times[name] = cuda_time(graph.replay, warmup=3, iters=20)
            outs[name] = out.clone()
            del graph
        rows.append({"heads": H, "batch": N, "context": ctx, "triton_ms": times["triton"] * 1e3,
                     "flash_mla_ms": times["flash_mla"] * 1e3, "triton_over_flash_mla": times["triton"] / times["flash_mla"],
                     "floor_ms": floor * 1e3, "bound": "FLOPs" if floor_flops > floor_bytes else "bytes",
                     "triton_over_floor": times["triton"] / floor, "flash_mla_over_floor": times["flash_mla"] / floor,
                     "flash_mla_tflops": N * ctx * 2 * H * (R + P + R) / times["flash_mla"] / 1e12,
                     "rel_diff": rel_err(outs["flash_mla"], outs["triton"])})
        log(rows[-1])
        del args, outs
        torch.cuda.empty_cache()
    lens = [4096, 1, 333, 2050, 17]
    args = inputs(96, lens, g)
    with reference_ops():
        ref = mla_decode_attention(args[0].double(), args[1].double(), args[2].double(), args[3], lens, R, SCALE)
    errors = {name: rel_err(op(args, max(lens), flash, lib), ref) for name, flash in (("triton", False),
                                                                                     ("flash_mla", True))}
    log({"errors_vs_float64": errors})
    log("| heads / batch / context | Triton ms | FlashMLA ms | Triton / FlashMLA | floor ms (bound) | FlashMLA / floor |")
    log("|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['heads']} / {r['batch']} / {r['context']} | {r['triton_ms']:.3f} | {r['flash_mla_ms']:.3f} | "
            f"{r['triton_over_flash_mla']:.2f} | {r['floor_ms']:.3f} ({r['bound']}) | {r['flash_mla_over_floor']:.2f} |")
    save_results("bench_flash_mla.json", {
        "gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit_id(),
        "torch": torch.__version__, "copy_rate_Bps": bw, "matmul_flops": mm, "rows": rows,
        "errors_vs_float64": errors})


if __name__ == "__main__":
    main()
