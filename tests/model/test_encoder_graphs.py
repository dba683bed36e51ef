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
