"""One EP rank's share of a K3 MoE layer at decode / draft sizes, one device call (a few minutes): K3 release's
routed experts (896, top-16, latent 3584, intermediate 3072, MXFP4) over e = 8 or 16 EP ranks (rank 0: 112 or 56
whole experts), random routings over all 896 experts, T = 1 .. 256 tokens. Three ways:

- eager: ``MoE.local_experts`` by the local pairs alone (``nonzero``: their count comes to the host; what every
  eager step under expert parallelism runs, and why no CUDA graph could hold it);
- fixed: the fixed-shape share (``MoE.local_pairs``: every pair, other ranks' at weight 0 on an expert the rank reads
  anyway) as a CUDA graph replay: what the decode and draft graphs now hold;
- known: the local pairs gathered on the host beforehand and their kernels captured (the count fixed for this one
  routing): the work a capture would hold if it knew the count, so fixed - known is what the fixed shapes cost.

fixed is checked against eager (rel err <= 1e-2: the same products, the combine rounded once instead of per pair).

    PYTHONPATH=. python benchmarks/gpu/bench_ep_share.py [--ep=8,16] [--tokens=1,4,32]   (writes $OUT/bench_ep_share.json)
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import arg, capture_graph, commit_id, cuda_time, log, rel_err, save_results  # noqa: E402

from kimik3.distributed import ParallelContext                        # noqa: E402
from kimik3.model.layers import GLUActivation                         # noqa: E402
from kimik3.model.moe import MoE, MoEConfig, fixed_shape_experts      # noqa: E402

E, K, L, I = 896, 16, 3584, 3072
CFG = MoEConfig(hidden_size=7168, num_experts=E, top_k=K, intermediate_size=I, num_shared_experts=0, latent_size=L,
                latent_norm=True, rms_norm_eps=1e-6, router_activation="sigmoid", num_expert_group=1, topk_group=1,
                renormalize=True, routed_scaling_factor=2.5, router_renorm_eps=1e-20, combine_fp32=True)


def rank_experts(ep: int) -> MoE:
    """EP rank 0's layer of ``ep`` ranks, its experts MXFP4 with random codes and scales near 1 / sqrt(2 K)."""
    with torch.device("meta"):
        moe = MoE(CFG, GLUActivation("silu", 1.0, None), ParallelContext(0, ep, None, ep))
        moe.experts.use_mxfp4_storage()
    moe.to_empty(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(ep)
    e = moe.experts
    for which in ("w13", "w2"):
        packed, scale = e.packed(which)
        packed.data.copy_(torch.randint(0, 256, packed.shape, generator=g, device="cuda", dtype=torch.uint8))
        base = 127 - round(math.log2(2 * math.sqrt(packed.shape[-1] * 2)))
        scale.copy_((base + torch.randint(-1, 2, scale.shape, generator=g, device="cuda")).to(torch.uint8))
    e.scale_max = max(int(e.w13_scale.max()), int(e.w2_scale.max()))
    return moe


def routing(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z [T, L] bf16, fp32 weights and K distinct experts of all E per token."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(T, L, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g, device="cuda").topk(K, dim=1).indices
    return z, torch.rand(T, K, generator=g, device="cuda"), ids


def case(moe: MoE, T: int) -> dict:
    z, weights, ids = routing(T, T)
    eager = moe.local_experts(z, weights, ids)
    torch.cuda.synchronize()

    def fixed():
        with fixed_shape_experts([moe]):
            return moe.local_experts(z, weights, ids)
    g_fixed, out = capture_graph(fixed)
    g_fixed.replay()
    torch.cuda.synchronize()
    local = ids - moe.experts.first_expert
    tok, slot = ((local >= 0) & (local < moe.experts.w1.shape[0])).nonzero(as_tuple=True)    # on the host, once
    row = {"tokens": T, "local_pairs": int(tok.numel()), "pairs": T * K}
    if tok.numel():
        w, lid = weights[tok, slot].unsqueeze(-1), local[tok, slot].unsqueeze(-1)
        g_known, _ = capture_graph(lambda: moe.combine(T, tok, moe.run_experts(z[tok], w, lid)))
        row["known_ms"] = cuda_time(g_known.replay, iters=50) * 1e3
    row["eager_ms"] = cuda_time(lambda: moe.local_experts(z, weights, ids), iters=50) * 1e3
    row["fixed_ms"] = cuda_time(g_fixed.replay, iters=50) * 1e3
    row["rel_err_fixed_vs_eager"] = rel_err(out, eager) if eager.any() else 0.0
    if row["rel_err_fixed_vs_eager"] > 1e-2:
        raise AssertionError(f"T={T}: the fixed-shape share differs from the local pairs' by {row}")
    return row


def main() -> None:
    eps = [int(v) for v in arg("ep", "8,16").split(",")]
    tokens = [int(v) for v in arg("tokens", "1,2,4,8,16,32,64,128,256").split(",")]
    results = {"commit": commit_id(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "device": torch.cuda.get_device_name(), "rows": []}
    for ep in eps:
        moe = rank_experts(ep)
        log(f"EP{ep}: {moe.experts.w1.shape[0]} experts on rank 0 (MXFP4), top-{K} of {E}")
        log(f"{'T':>4} {'pairs':>6} {'local':>6} {'eager ms':>9} {'fixed ms':>9} {'known ms':>9} {'rel err':>8}")
        with torch.inference_mode():
            for T in tokens:
                row = {"ep": ep, **case(moe, T)}
                results["rows"].append(row)
                log(f"{T:>4} {row['pairs']:>6} {row['local_pairs']:>6} {row['eager_ms']:>9.3f} {row['fixed_ms']:>9.3f} "
                    f"{row.get('known_ms', float('nan')):>9.3f} {row['rel_err_fixed_vs_eager']:>8.1e}")
        del moe
        torch.cuda.empty_cache()
    log(f"wrote {save_results('bench_ep_share.json', results)}")


if __name__ == "__main__":
    main()
