"""The vision tower's graph steps (kimik3/model/encoder_graphs.py) on the CPU: each item padded to its
patch budget, the padding rows an item of their own, must give the rows of the unpadded tower, and
the whole image path the float64 reference written from the spec (tests/vision). The captures and
replays themselves run in tests/gpu/test_encoder_graphs_gpu.py."""

import numpy as np
import pytest
import torch

from kimik3.model.encoder_graphs import ENCODER_GRAPH_BUDGETS, EncoderGraphs
from tests.vision.test_vision_tower import _model, _pixels, reference

# (1,2,2) pads 4 -> 8 rows, (1,4,4) fills its budget of 16, (2,2,4) a 2-frame video of 16,
# (1,4,6) pads 24 -> 40, (1,8,8) is above the ladder (eager)
GRIDS = [(1, 2, 2), (1, 4, 4), (2, 2, 4), (1, 4, 6), (1, 8, 8)]
BUDGETS = (8, 16, 40)


def test_padded_items_give_the_unpadded_rows():
    m = _model()
    tower = m.vision_tower
    graphs = EncoderGraphs(tower, BUDGETS)
    pv = _pixels(GRIDS).double()
    out = graphs.encode(pv, GRIDS)
    start = 0
    for shape in GRIDS:
        L = shape[0] * shape[1] * shape[2]
        alone = tower.encode(pv[start:start + L], [shape])
        assert (out[start:start + L] - alone).abs().max() < 1e-12, shape
        start += L
    assert start == out.shape[0] and graphs.num_replays == 0      # nothing captured on the CPU


def test_image_path_through_the_graph_steps_matches_float64_reference():
    m = _model(seed=4)
    graphs = EncoderGraphs(m.vision_tower, BUDGETS)
    pv = _pixels(GRIDS, seed=5)
    out = m.encode_images(pv, torch.tensor(GRIDS), graphs.encode)
    ref = reference(m.state_dict(), pv, GRIDS)
    # 1e-7: the video item's time table is float32 (official), rounded once from float64 in the reference
    assert np.abs(out.numpy() - ref).max() < 1e-7


def test_stale_padding_never_reaches_the_next_item():
    """A large item leaves its rows in the buffers; a smaller one after it must not see them."""
    m = _model(seed=6)
    graphs = EncoderGraphs(m.vision_tower, BUDGETS)
    big, small = (1, 4, 6), (1, 2, 2)
    pv = _pixels([big, small], seed=7).double()
    graphs.encode(pv[:24], [big])
    out = graphs.encode(pv[24:], [small])
    assert (out - m.vision_tower.encode(pv[24:], [small])).abs().max() < 1e-12


def test_budgets():
    graphs = EncoderGraphs(_model().vision_tower, BUDGETS)
    assert [graphs.budget_for(n) for n in (1, 8, 9, 16, 40, 41)] == [8, 8, 16, 16, 40, None]
    for bad in ((), (16, 8), (8, 8), (0, 8)):
        with pytest.raises(ValueError, match="increasing positive"):
            EncoderGraphs(_model().vision_tower, bad)
    # the default ladder: rising by at most 1.6x, to K3's per-frame patch limit
    assert ENCODER_GRAPH_BUDGETS[-1] == 16384
    assert all(b / a <= 1.6 for a, b in zip(ENCODER_GRAPH_BUDGETS, ENCODER_GRAPH_BUDGETS[1:]))


def test_padded_items_on_the_kernel_path_track_float64(monkeypatch):
    """The CUDA branch of the tower's RMSNorm and RoPE kernels on CPU tensors through Triton's
    interpreter (the attention's flash kernel has no CPU form: the reference runs it), a bf16 tower of
    head dim 32, each item padded to its budget, within the bf16 bound of float64."""
    from kimik3.config import VisionConfig
    from kimik3.model.vision import KimiVisionModel
    from kimik3.ops import attention, norm, rope
    from tests.helpers import worst_rel_err
    cfg = VisionConfig(patch_size=14, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, qkv_hidden_size=64,
                       intermediate_size=128, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=4,
                       merge_kernel_size=(2, 2), pos_emb_interpolation_mode="bilinear", projector_ln_eps=1e-5,
                       text_hidden_size=48)
    torch.manual_seed(0)
    m64 = KimiVisionModel(cfg, dtype=torch.float64)
    with torch.no_grad():
        for name, p in m64.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * p[0].numel() ** -0.5)
    m16 = KimiVisionModel(cfg, dtype=torch.bfloat16)
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m64.state_dict().items()})
    grids = [(1, 2, 2), (1, 4, 6), (2, 2, 4)]
    pv = _pixels(grids, seed=8).double()
    ref = torch.cat([m64.vision_tower.encode(pv[a:a + n], [g]) for a, n, g in
                     zip([0, 4, 28], [4, 24, 16], grids)])
    for module in (attention, norm, rope):
        monkeypatch.setattr(module, "use_fast_path" if module is attention else "use_fast_kernel", lambda *a: True)
    graphs = EncoderGraphs(m16.vision_tower, BUDGETS)
    out = graphs.encode(pv.to(torch.bfloat16), grids)
    assert out.dtype == torch.bfloat16
    assert worst_rel_err(out, ref, [4, 24, 16]) < 3e-2           # bf16 weights and activations, truncating roundings
