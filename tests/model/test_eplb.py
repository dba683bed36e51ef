"""EPLB placement (model/eplb.py) without ranks: the planner's slots, the load it leaves per rank on a
skewed recorded load (max/mean reported), the logical -> physical routing, load files."""

import json

import pytest
import torch

from kimik3.model.eplb import (Placement, identity_slots, imbalance, plan_moves, plan_slots, rank_loads, read_loads,
                              save_loads)

SKEWED = [5000.0, 3000.0, 800.0, 400.0, 200.0, 100.0, 50.0, 50.0, 40.0, 30.0, 20.0, 10.0, 10.0, 10.0, 5.0, 5.0]


def test_slots_hold_every_expert_and_split_evenly_over_ranks():
    slots = plan_slots(SKEWED, 20, 4)
    assert len(slots) == 20 and set(slots) == set(range(16))
    copies = [slots.count(x) for x in range(16)]
    assert copies[0] >= copies[1] >= 2 and sum(copies) == 20          # the hot experts get the spare slots
    for r in range(4):
        mine = slots[r * 5:(r + 1) * 5]
        assert len(set(mine)) == len(mine), f"rank {r} holds two copies of one expert: {mine}"


def test_skewed_load_max_over_mean_falls(capsys):
    """Contiguous placement (plain EP: experts 0-3 on rank 0) against EPLB with 0, 4 and 8 spare slots
    over 4 ranks; the max/mean of the ranks' expected loads, printed for the report."""
    contiguous = imbalance(SKEWED, list(range(16)), 4)
    # contiguous: rank 0 holds 5000+3000+800+400 of 9740 in all -> 9200 / 2435
    assert contiguous == pytest.approx(9200 / (sum(SKEWED) / 4))
    placed = {R: imbalance(SKEWED, plan_slots(SKEWED, 16 + R, 4), 4) for R in (0, 4, 8)}
    print(f"EPLB max/mean over 4 ranks: contiguous {contiguous:.3f}, "
          + ", ".join(f"R={R} {v:.3f}" for R, v in placed.items()))
    assert placed[0] < contiguous and placed[4] < placed[0] and placed[8] <= placed[4]
    assert placed[8] < 1.15
    total = sum(rank_loads(SKEWED, plan_slots(SKEWED, 24, 4), 4))
    assert total == pytest.approx(sum(SKEWED))                           # copies share their expert's load


def test_even_placement_without_a_load():
    assert identity_slots(8, 8, 2) == plan_slots([1.0] * 8, 8, 2)
    assert sorted(identity_slots(8, 10, 2)) == [0, 0, 1, 1, 2, 3, 4, 5, 6, 7]


def test_bad_slot_counts_name_the_constraint():
    with pytest.raises(ValueError, match="multiple of the EP size"):
        plan_slots([1.0] * 8, 9, 2)
    with pytest.raises(ValueError, match="must hold the 8 experts"):
        plan_slots([1.0] * 8, 6, 2)


def test_physical_routing_spreads_tokens_over_the_copies():
    slots = [0, 3, 1, 0, 2, 1]                 # expert 0 in slots 0 and 3, expert 1 in 2 and 5
    p = Placement.build(slots, 4)
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]])
    phys = p.physical(ids)
    assert all(slots[s] == x for s, x in zip(phys.reshape(-1).tolist(), ids.reshape(-1).tolist()))
    assert phys[:, 0].tolist() == [0, 3, 0, 3]              # token t takes copy t mod 2
    with pytest.raises(ValueError, match="without a slot"):
        Placement.build([0, 1, 1], 3)


def test_load_files_round_trip_and_bad_files_fail_clearly(tmp_path):
    f = tmp_path / "loads.json"
    save_loads(f, {3: [1, 2, 3, 4], 1: [0, 0, 5, 5]}, 4)
    assert read_loads(f, 4, [1, 2, 3]) == {1: [0, 0, 5, 5], 3: [1, 2, 3, 4]}
    with pytest.raises(ValueError, match="not a MoE layer"):
        read_loads(f, 4, [1, 2])
    f.write_text(json.dumps({"num_experts": 4, "layers": {"1": [1, 2]}}))
    with pytest.raises(ValueError, match="needs 4 non-negative counts"):
        read_loads(f, 4, [1])
    f.write_text("{")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        read_loads(f, 4, [1])


def _apply(moves, old: list[int], ranks: int) -> list[int]:
    """The slots after ``moves``, every copy reading the old placement (as the ranks do: they move into clones)."""
    per = len(old) // ranks
    new = list(old)
    for m in moves:
        new[m.dst_rank * per + m.dst] = old[m.src_rank * per + m.src]
    return new


def test_moves_take_the_ranks_from_one_placement_to_the_next():
    load = [10.0, 20.0, 900.0, 30.0, 700.0, 40.0, 50.0, 60.0]            # experts 2 and 4 hot
    old = identity_slots(8, 10, 2)
    new = plan_slots(load, 10, 2)
    moves = plan_moves(old, new, 2)
    assert _apply(moves, old, 2) == new
    per = 5
    assert all(old[m.dst_rank * per + m.dst] != new[m.dst_rank * per + m.dst] for m in moves)    # kept slots untouched
    for m in moves:                   # a copy within the rank whenever the rank already held the expert
        held = old[m.dst_rank * per:(m.dst_rank + 1) * per]
        assert (m.src_rank == m.dst_rank) == (new[m.dst_rank * per + m.dst] in held)
    assert imbalance(load, new, 2) < imbalance(load, old, 2)
    assert plan_moves(new, new, 2) == []
    # experts two ranks hold: the ranks share the sends
    old4, new4 = [0, 1, 0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 0, 1, 0, 1]
    moves = plan_moves(old4, new4, 4)
    assert _apply(moves, old4, 4) == new4
    assert sorted(m.src_rank for m in moves if old4[m.src_rank * 2 + m.src] in (0, 1)) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="experts of the old one"):
        plan_moves([0, 1, 2, 3], [0, 1, 2, 2], 2)


def test_a_placement_changes_in_place():
    p = Placement.build(identity_slots(4, 6, 2), 4)
    replicas, copies = p.replicas, p.copies
    slots = [2, 2, 0, 1, 2, 3]
    p.update(slots)
    assert p.replicas is replicas and p.copies is copies and p.slots == slots     # a captured graph reads these
    ids = torch.tensor([[2, 0], [2, 1], [2, 3]])
    phys = p.physical(ids)
    assert all(slots[s] == x for s, x in zip(phys.reshape(-1).tolist(), ids.reshape(-1).tolist()))
    assert phys[:, 0].tolist() == [0, 1, 4]                 # expert 2's three copies, token t takes copy t mod 3
