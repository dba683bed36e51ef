"""``kimik3 inspect --layouts``: per-GPU bytes of TP / PP / EP / DCP layouts for K3 (release config), checked
against the plain sizing (TP1 numbers divided by hand), and the proposals for the three machines."""

import json
from pathlib import Path

import pytest

from kimik3.config import parse_config
from kimik3.layouts import B300, MACHINES, format_layouts, layout_bytes, propose
from kimik3.sizing import GIB, GPUS, compute_sizing

K3 = parse_config(json.loads((Path(__file__).parent / "data" / "kimi-k3-release.config.json").read_text()), "k3")


@pytest.fixture(scope="module")
def base():
    return compute_sizing(K3, 16, 16)


def test_dcp_divides_the_latent_and_pp_the_layers(base):
    one = layout_bytes(K3, GPUS["H200"], 16, 1, 16, 1)
    striped = layout_bytes(K3, GPUS["H200"], 16, 1, 16, 16)
    # 1M tokens x 27,648 B (24 MLA layers x 576 x 2): 27 GiB replicated on every TP rank, / 16 under DCP16
    assert one.latent_1m == (1 << 20) * 24 * 576 * 2 == pytest.approx(27 * GIB)
    assert striped.latent_1m * 16 == one.latent_1m and striped.weights == one.weights
    staged = layout_bytes(K3, GPUS["H200"], 8, 2, 8, 1)
    tp8 = compute_sizing(K3, 8, 8)
    ends = tp8.embedding_bytes / 8 * 2                    # embedding + LM head (same shape), on each stage
    assert staged.weights == pytest.approx(ends + tp8.weights_replicated
                                           + (tp8.weights_sharded / 8 - ends + tp8.experts_per_gpu) / 2)
    assert staged.latent_1m * 2 == one.latent_1m and staged.state_1m * 2 == tp8.state_bytes_per_seq


def test_proposals_fit_and_rank_by_long_sequences():
    for machine, (gpu, n, per_node) in MACHINES.items():
        layouts = propose(K3, gpu, n, per_node)
        assert layouts and all(x.tp * x.pp == n for x in layouts)
        assert all(x.tp <= per_node or x.tp % per_node == 0 for x in layouts)
        best = layouts[0]
        assert best.fits and best.dcp == best.tp > 1, (machine, best)
        assert [x.sequences_1m for x in layouts if x.fits] == sorted((x.sequences_1m for x in layouts if x.fits),
                                                                     reverse=True)
    # without DCP a 1M sequence's 27 GiB latent sits on every GPU: at most a few fit on 16 x H200
    plain = [x for x in propose(K3, GPUS["H200"], 16, 8) if x.dcp == 1 and x.pp == 1]
    assert plain and plain[0].sequences_1m <= plain[0].cache_budget / (27 * GIB) + 1
    assert B300.memory > GPUS["H200"].memory


def test_format_names_each_machine():
    text = format_layouts(K3)
    assert all(m in text for m in MACHINES) and "DCP" in text and "1M seqs" in text
