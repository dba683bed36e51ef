"""The K3 vision tower (27 layers, 1024 wide, 12 heads x 128; random bf16 weights from the release
config's ``vision_config``) on one image, per image size: eager with the old per-item attention (fp32
SDPA, the reference path), eager with the varlen flash kernel, and as a CUDA graph of its patch budget
(``model/encoder_graphs.py``); against its floor max(weight bytes / copy rate, FLOPs / matmul rate),
FLOPs from the shapes: per patch and layer 2 x (1024 x 4608 + 1536 x 1024 + 2 x 1024 x 4096) for the
projections and 4 x L x 1536 for attention over the item's L patches. Plus the attention op alone
(varlen flash) against torch's SDPA on the same item (one item: SDPA takes its cuDNN or flash kernel), and the whole image path (tower, merge,
projector) through the graphs.

    PYTHONPATH=. python benchmarks/gpu/bench_vision.py     (writes $OUT/bench_vision.json)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, copy_rate, cuda_time, log, matmul_rate, rel_err, save_results  # noqa: E402
from kimik3.config import parse_vision_config  # noqa: E402
from kimik3.model.encoder_graphs import EncoderGraphs, capture_encoder_or_none  # noqa: E402
from kimik3.model.vision import KimiVisionModel  # noqa: E402
from kimik3.ops import attention  # noqa: E402
from kimik3.ops.backend import reference_ops  # noqa: E402

RELEASE = ROOT / "tests" / "data" / "kimi-k3-release.config.json"
# (h, w) in patches: budget-filling squares and sizes just above a budget (the padding's cost)
GRIDS = [(16, 16), (20, 20), (32, 32), (34, 34), (48, 48), (64, 64), (90, 90), (128, 128)]


def tower_flops(cfg, L: int) -> float:
    D, Q, M = cfg.hidden_size, cfg.qkv_hidden_size, cfg.intermediate_size
    per_layer = 2 * L * (D * 3 * Q + Q * D + 2 * D * M) + 4 * L * L * Q
    return cfg.num_hidden_layers * per_layer + 2 * L * 3 * cfg.patch_size ** 2 * D


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grids", default=",".join(f"{h}x{w}" for h, w in GRIDS))
    args = ap.parse_args()
    grids = [tuple(int(v) for v in g.split("x")) for g in args.grids.split(",")]
    data = json.loads(RELEASE.read_text())
    cfg = parse_vision_config(data["vision_config"], str(RELEASE), data["text_config"]["hidden_size"])
    bw, mm = copy_rate(), matmul_rate()
    torch.manual_seed(0)
    model = KimiVisionModel(cfg, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * p[0].numel() ** -0.5)
    tower = model.vision_tower
    tower_bytes = sum(p.numel() * p.element_size() for p in tower.parameters())
    t0 = datetime.datetime.now()
    graphs = capture_encoder_or_none(EncoderGraphs(tower))
    capture_s = (datetime.datetime.now() - t0).total_seconds()
    log(f"# copy {bw / 1e12:.2f} TB/s, matmul {mm / 1e12:.0f} TFLOP/s; tower {tower_bytes / 1e9:.2f} GB; "
        f"graphs captured in {capture_s:.1f} s; pool {torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved")
    log("| grid | patches | budget | floor ms | reference ms | eager ms | graph ms | graph/floor | eager/graph "
        "| attn op us | SDPA us |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for h, w in grids:
        shape, L = (1, h, w), h * w
        pv = (torch.rand(L, 3, 14, 14, generator=g, device="cuda") * 2 - 1).to(torch.bfloat16)
        floor = max(tower_bytes / bw, tower_flops(cfg, L) / mm) * 1e3
        with torch.inference_mode():
            eager = cuda_time(lambda: tower.encode(pv, [shape]), iters=5) * 1e3
            graph = cuda_time(lambda: graphs.encode(pv, [shape]), iters=5) * 1e3 if graphs else None
            with reference_ops():                                  # attention: the per-item fp32 SDPA loop
                reference = cuda_time(lambda: tower.encode(pv, [shape]), warmup=1, iters=3) * 1e3
                ref_out = tower.encode(pv, [shape])
            err = rel_err(graphs.encode(pv, [shape]) if graphs else tower.encode(pv, [shape]), ref_out)
            H, dh = cfg.num_attention_heads, cfg.qkv_hidden_size // cfg.num_attention_heads
            q, k, v = (torch.randn(L, H, dh, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
            cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
            op = cuda_time(lambda: attention.varlen_attention(q, k, v, cu, L, dh ** -0.5), iters=10) * 1e6
            qt, kt, vt = (z.transpose(0, 1).unsqueeze(0) for z in (q, k, v))
            sdpa = cuda_time(lambda: F.scaled_dot_product_attention(qt, kt, vt, scale=dh ** -0.5), iters=10) * 1e6
        budget = graphs.budget_for(L) if graphs else None
        row = {"grid": [h, w], "patches": L, "budget": budget, "floor_ms": floor, "reference_ms": reference,
               "eager_ms": eager, "graph_ms": graph, "attn_op_us": op, "sdpa_us": sdpa,
               "rel_err_graph_vs_reference": err}
        rows.append(row)
        log(f"| {h}x{w} | {L} | {budget} | {floor:.3f} | {reference:.2f} | {eager:.2f} | "
            f"{graph if graph is None else f'{graph:.2f}'} | {'-' if graph is None else f'{graph / floor:.2f}'} | "
            f"{'-' if graph is None else f'{eager / graph:.2f}'} | {op:.0f} | {sdpa:.0f} |")
    with torch.inference_mode():
        many = [(1, 16, 16), (1, 32, 32), (1, 24, 40)]
        pv = (torch.rand(sum(a * b * c for a, b, c in many), 3, 14, 14, generator=g, device="cuda") * 2 - 1)
        grid_t = torch.tensor(many)
        image_eager = cuda_time(lambda: model.encode_images(pv, grid_t), iters=5) * 1e3
        image_graph = cuda_time(lambda: model.encode_images(pv, grid_t, graphs.encode), iters=5) * 1e3 if graphs else None
    log(f"# three images {many} through encode_images: eager {image_eager:.2f} ms, graphs "
        f"{image_graph if image_graph is None else f'{image_graph:.2f}'} ms")
    path = save_results("bench_vision.json", {
        "commit": commit_id(), "gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
        "copy_rate": bw, "matmul_rate": mm, "tower_bytes": tower_bytes, "capture_s": capture_s,
        "budgets": list(graphs.budgets) if graphs else None, "rows": rows,
        "three_images": {"grids": many, "eager_ms": image_eager, "graph_ms": image_graph}})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
