"""Chunked KDA of a prefill step alone (#18 item 2): fla-core's ``chunk_kda`` (our default) against
MoonshotAI's FlashKDA (``KIMIK3_FLASH_KDA``, opt-in), same process, same inputs, at the K3 slice's 96
heads and Kimi-Linear's 32 (bounded gate: FlashKDA takes only that), one sequence and a ragged batch
with initial states. Floor: the bytes every path must move (q, k, v, f, o bf16, b, the states fp32 in
and out) at the measured copy rate; the state products (6 K V FLOPs a token and head) at the matmul
rate are far below it. Then each path's error against the fp32 reference on a small case.

    KIMIK3_FLASH_KDA=.../libkimik3_flash_kda.so PYTHONPATH=. python benchmarks/gpu/bench_kda_prefill.py
                                                               (writes $OUT/bench_kda_prefill.json)
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, copy_rate, cuda_time, library_path, log, named_or_not, rel_err, save_results  # noqa: E402
from kimik3.ops import kda as ops_kda  # noqa: E402
from kimik3.ops.backend import reference_ops  # noqa: E402
from kimik3.ops.cuda.flash_kda import ENV  # noqa: E402

K = 128
LOWER_BOUND = -5.0


def inputs(lens: list[int], H: int, g: torch.Generator):
    T = sum(lens)
    q, k, v, f = (torch.randn(T, H, K, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4))
    b = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    A_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=g))
    dt_bias = 0.5 * torch.randn(H * K, device="cuda", generator=g)
    state0 = 0.1 * torch.randn(len(lens), H, K, K, device="cuda", generator=g)
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0)
    return q, k, v, f, b, A_log, dt_bias, state0, cu


def run(args, flash: bool, lib: str):
    """``_chunk_kda_cuda`` with the FlashKDA library named or not."""
    return named_or_not(ENV, lib, flash, lambda: ops_kda._chunk_kda_cuda(*args[:7], LOWER_BOUND, args[7], args[8]))


def main():
    lib = library_path(ENV, "kimik3 build-kernels")
    bw = copy_rate()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for H, lens in ((96, [8192]), (96, [2048, 1, 3000, 3143]), (96, [32768]), (32, [8192]), (32, [512] * 16)):
        args = inputs(lens, H, g)
        T, N = sum(lens), len(lens)
        byts = T * H * (5 * K * 2 + 2) + 2 * N * H * K * K * 4
        floor = byts / bw
        t_fla = cuda_time(lambda: run(args, False, lib), warmup=3, iters=10)
        t_flash = cuda_time(lambda: run(args, True, lib), warmup=3, iters=10)
        o_fla, s_fla = run(args, False, lib)
        o_flash, s_flash = run(args, True, lib)
        rows.append({"heads": H, "lens": lens if N <= 4 else f"{N} x {lens[0]}", "tokens": T,
                     "fla_ms": t_fla * 1e3, "flash_kda_ms": t_flash * 1e3, "fla_over_flash_kda": t_fla / t_flash,
                     "floor_ms": floor * 1e3, "fla_over_floor": t_fla / floor, "flash_kda_over_floor": t_flash / floor,
                     "o_rel_diff": rel_err(o_flash, o_fla), "state_rel_diff": rel_err(s_flash, s_fla)})
        log(rows[-1])
        del args
        torch.cuda.empty_cache()
    # error against the fp32 reference (chunked form in torch) on a small ragged case
    lens = [300, 1, 129, 500]
    args = inputs(lens, 4, g)
    with reference_ops():
        ref_o, ref_s = ops_kda.kda_attention(*(t.float() for t in args[:5]), args[5], args[6], LOWER_BOUND,
                                             args[7], lens)
    errors = {}
    for name, flash in (("fla", False), ("flash_kda", True)):
        o, s = run(args, flash, lib)
        errors[name] = {"o": rel_err(o, ref_o), "state": rel_err(s, ref_s)}
    log(errors)
    log("| heads | tokens (sequences) | fla ms | FlashKDA ms | fla / FlashKDA | floor ms | FlashKDA / floor |")
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['heads']} | {r['tokens']} ({r['lens']}) | {r['fla_ms']:.3f} | {r['flash_kda_ms']:.3f} | "
            f"{r['fla_over_flash_kda']:.2f} | {r['floor_ms']:.3f} | {r['flash_kda_over_floor']:.2f} |")
    save_results("bench_kda_prefill.json", {
        "gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit_id(),
        "torch": torch.__version__, "copy_rate_Bps": bw, "rows": rows, "errors_vs_fp32_reference": errors})


if __name__ == "__main__":
    main()
