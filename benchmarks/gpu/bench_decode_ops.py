"""The KDA layer's decode-step ops alone, each replayed as a CUDA graph, against their floor (bytes at
the measured copy rate) and the alternatives: our one-kernel KDA step (``ops/triton/kda.py``) over
value-block widths and warp counts beside fla-core's ``fused_recurrent_kda_fwd`` (the kernel it
replaces), and the one-pass conv decode kernel beside the general varlen pair (conv + window
update). Shapes: Kimi-Linear (32 heads) and K3 (96 heads) x 128, batch 1/8/32/128, scattered slots.
Then the prefill conv over 8192 tokens across tile shapes (``conv_prefill_sweep``).

    PYTHONPATH=. python benchmarks/gpu/bench_decode_ops.py     (writes $OUT/bench_decode_ops.json)
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import capture_graph, commit_id, copy_rate, cuda_time, log, rel_err, save_results  # noqa: E402
from kimik3.ops.backend import import_fla_kda  # noqa: E402
from kimik3.ops.triton.conv import causal_conv1d_pool_triton  # noqa: E402
from kimik3.ops.norm import gated_rms_norm  # noqa: E402
from kimik3.ops.triton.kda import kda_decode_triton  # noqa: E402

K = 128
W = 4
# the fused step+norm's (value rows a step of its walk over the head, warps): the default, then the whole row at
# once (one program a multiprocessor at 8 warps), then smaller steps. At fc693bd (H100) the whole row on 8 warps
# capped at 128 registers (two programs a multiprocessor, 13 spilled) ran as fast as blocks of 64 on 8 warps.
NORM_TILES = ((None, None), (128, 8), (32, 8), (32, 4), (16, 8))


def graph_us(fn) -> float:
    graph, _ = capture_graph(fn)
    return cuda_time(graph.replay, warmup=3, iters=20) * 1e6


def inputs(N: int, H: int, g: torch.Generator):
    P = H * K
    wide = torch.randn(N, 3 * P + K + H + P, device="cuda", generator=g).to(torch.bfloat16)  # a merged projection
    q, k, v = (wide[:, i * P:(i + 1) * P].view(N, H, K) for i in range(3))
    b = wide[:, 3 * P + K:3 * P + K + H]
    f = torch.randn(N, H, K, device="cuda", generator=g).to(torch.bfloat16)
    A_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=g))
    dt_bias = 0.5 * torch.randn(P, device="cuda", generator=g)
    slots = torch.randperm(2 * N + 1, device="cuda", generator=g)[:N] + 1
    return wide, q, k, v, b, f, A_log, dt_bias, slots


def main():
    bw = copy_rate()
    g = torch.Generator(device="cuda").manual_seed(0)
    _, fla_recurrent = import_fla_kda()
    rows = []
    for H, lower_bound in ((32, None), (96, -5.0)):
        for N in (1, 8, 32, 128):
            wide, q, k, v, b, f, A_log, dt_bias, slots = inputs(N, H, g)
            pool = 0.1 * torch.randn(2 * N + 2, H, K, K, device="cuda", generator=g)
            floor = (2 * N * H * K * K * 4 + 4 * N * H * K * 2) / bw * 1e6          # state read + write, q k v o
            b32, qc, kc, vc = b.float().contiguous(), q.contiguous(), k.contiguous(), v.contiguous()

            def fla():
                return fla_recurrent(q.contiguous().view(N, 1, H, K), k.contiguous().view(N, 1, H, K),
                                     v.contiguous().view(N, 1, H, K), f.view(N, 1, H, K), b.float().view(N, 1, H),
                                     A_log=A_log, dt_bias=dt_bias, initial_state=pool, inplace_final_state=True,
                                     state_v_first=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
                                     use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                     lower_bound=lower_bound)[0].view(N, H, K)

            def fla_kernel_only():                   # operands prepared outside (its launch alone)
                return fla_recurrent(qc.view(N, 1, H, K), kc.view(N, 1, H, K), vc.view(N, 1, H, K), f.view(N, 1, H, K),
                                     b32.view(N, 1, H), A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                     inplace_final_state=True, state_v_first=True, ssm_state_indices=slots,
                                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)[0].view(N, H, K)
            saved = pool.clone()
            ref = fla().double()
            pool.copy_(saved)
            cases = {"fla (as called before: b cast)": fla, "fla kernel alone": fla_kernel_only}
            for bv, warps in ((16, 4), (32, 4), (32, 8), (64, 8)):
                cases[f"ours BV={bv} warps={warps}"] = (lambda bv=bv, warps=warps: kda_decode_triton(
                    q, k, v, f, b, A_log, dt_bias, lower_bound, pool, slots, block_v=bv, num_warps=warps))
            # the layer's output norm: the default step then the norm kernel, against the step that does both
            out_gate = torch.randn(N, H, K, device="cuda", generator=g).to(torch.bfloat16)
            norm_w = 1 + 0.1 * torch.randn(K, device="cuda", generator=g)
            pool.copy_(saved)
            normed_ref = gated_rms_norm(ref, norm_w, out_gate, 1e-5, torch.float64)
            normed = {"ours + separate norm": lambda: gated_rms_norm(kda_decode_triton(
                          q, k, v, f, b, A_log, dt_bias, lower_bound, pool, slots), norm_w, out_gate, 1e-5, torch.bfloat16)}
            for bv, warps in NORM_TILES:                   # the default first
                normed["ours, norm fused" + (f", BV={bv} warps={warps}" if bv else "")] = (
                    lambda bv=bv, warps=warps: kda_decode_triton(
                        q, k, v, f, b, A_log, dt_bias, lower_bound, pool, slots, block_v=bv, num_warps=warps,
                        norm=(norm_w, out_gate, 1e-5, torch.bfloat16)))
            for name, fn in normed.items():
                pool.copy_(saved)
                err = rel_err(fn().double(), normed_ref)
                t = graph_us(fn)
                rows.append({"op": "kda+norm", "heads": H, "batch": N, "case": name, "us": t, "floor_us": floor,
                             "over_floor": t / floor, "rel_diff_vs_fla": err})
                log(f"kda+norm H={H} b{N} {name}: {t:.1f} us = {t / floor:.2f} x floor, rel diff {err:.1e}")
            for name, fn in cases.items():
                pool.copy_(saved)
                out = fn().double()
                assert out.shape == ref.shape, (name, out.shape, ref.shape)
                err = rel_err(out, ref)
                t = graph_us(fn)
                rows.append({"op": "kda", "heads": H, "batch": N, "case": name, "us": t, "floor_us": floor,
                             "over_floor": t / floor, "rel_diff_vs_fla": err})
                log(f"kda H={H} b{N} {name}: {t:.1f} us = {t / floor:.2f} x floor, rel diff {err:.1e}")
            # conv: raw q|k|v columns of the merged projection, pool [slots, 3P, W-1] bf16
            C = 3 * H * K
            x = wide[:, :C]
            weight = torch.randn(C, W, device="cuda", generator=g)
            cpool = torch.randn(2 * N + 2, C, W - 1, device="cuda", generator=g).to(torch.bfloat16)
            cu = torch.arange(N + 1, device="cuda")
            has = torch.ones(N, dtype=torch.bool, device="cuda")
            cfloor = (2 * N * C * (W - 1) * 2 + 2 * N * C * 2) / bw * 1e6
            csaved = cpool.clone()
            outs = {}
            for name, fn in (("general pair", lambda: causal_conv1d_pool_triton(x, weight, cpool, slots, has, cu, 3)),
                             ("decode kernel", lambda: causal_conv1d_pool_triton(x, weight, cpool, slots, None, cu, 3))):
                cpool.copy_(csaved)
                outs[name] = (fn().double(), cpool[slots].clone())
                t = graph_us(fn)
                rows.append({"op": "conv", "heads": H, "batch": N, "case": name, "us": t, "floor_us": cfloor,
                             "over_floor": t / cfloor})
                log(f"conv H={H} b{N} {name}: {t:.1f} us = {t / cfloor:.2f} x floor")
            same = torch.equal(outs["general pair"][1], outs["decode kernel"][1])
            log(f"conv H={H} b{N}: outputs rel diff {rel_err(*[o[0] for o in outs.values()]):.1e}, windows equal {same}")
    rows += conv_prefill_sweep(bw, g)
    print("| op | heads | batch | case | us | floor us | time/floor |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['heads']} | {r['batch']} | {r['case']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
              f"{r['over_floor']:.2f} |")
    save_results("bench_decode_ops", {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                                      "commit": commit_id(), "torch": torch.__version__, "copy_bytes_per_s": bw,
                                      "rows": rows})


# prefill conv tiles (tokens, channels, warps): the default first
CONV_TILES = ((64, 128, 1), (32, 128, 1), (128, 128, 1), (256, 128, 1), (64, 64, 1), (64, 256, 2), (64, 128, 2))   # (BT, BC, warps)


def conv_prefill_sweep(bw: float, g: torch.Generator) -> list[dict]:
    """The prefill conv (8192 tokens: one fresh prompt, or 4 continuing ones) over ``CONV_TILES``:
    floor = the raw q|k|v columns read once + the output written once (+ the windows)."""
    rows = []
    for H in (32, 96):
        C, T = 3 * H * K, 8192
        wide = torch.randn(T, C + 512, device="cuda", generator=g).to(torch.bfloat16)
        x = wide[:, :C]                                          # a merged projection's columns
        weight = torch.randn(C, W, device="cuda", generator=g)
        for name, lens, ctx in (("1 x 8192 fresh", [T], [0]), ("4 x 2048 continued", [T // 4] * 4, [1] * 4)):
            N = len(lens)
            pool = torch.randn(N + 1, C, W - 1, device="cuda", generator=g).to(torch.bfloat16)
            slots = torch.arange(1, N + 1, device="cuda")
            cu = torch.tensor([0, *lens], device="cuda").cumsum(0)
            has = torch.tensor(ctx, device="cuda") > 0
            floor = (2 * T * C * 2 + 2 * N * C * (W - 1) * 2) / bw * 1e6
            saved = pool.clone()
            ref = None
            for tile in CONV_TILES:
                pool.copy_(saved)
                out = causal_conv1d_pool_triton(x, weight, pool, slots, has, cu, 3, tile=tile)
                same = "" if ref is None else f", equal to the default's: {torch.equal(out, ref)}"
                ref = out.clone() if ref is None else ref
                t = cuda_time(lambda: causal_conv1d_pool_triton(x, weight, pool, slots, has, cu, 3, tile=tile),
                              iters=10) * 1e6
                rows.append({"op": "conv prefill", "heads": H, "batch": N, "case": f"{name} tile {tile}", "us": t,
                             "floor_us": floor, "over_floor": t / floor})
                log(f"conv prefill H={H} {name} tile {tile}: {t:.1f} us = {t / floor:.2f} x floor{same}")
    return rows


if __name__ == "__main__":
    main()
