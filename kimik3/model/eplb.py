"""Expert-parallel load balancing (EPLB, spec parallelism §2.6): the E logical experts of a MoE layer
live in P = E + R physical slots, P / e on each of the e EP ranks (rank r: slots [r P/e, (r+1) P/e));
hot experts get redundant copies, and the copies are packed onto ranks to even out their load.

* ``plan_slots(load, P, e)``: which logical expert each slot holds, from a per-expert load (token
  counts): replicas go one at a time to the expert with the largest load per copy; the copies, each
  carrying load / copies, are then packed heaviest first onto the least-loaded rank with a free slot,
  two copies of one expert on different ranks where possible.
* ``Placement``: the device tables the router's logical ids go through: a token's pair (t, expert x)
  goes to x's replica number t mod copies(x) (the routing math is unchanged; only where it runs).
* ``plan_moves``: a live rebalance (``LLM.rebalance_experts``): the expert copies from one placement to the next,
  run as point-to-point transfers between EP ranks (``moe.MoE.move_experts``) between two steps.
* Load files (``save_loads`` / ``read_loads``): JSON ``{"num_experts": E, "layers": {"3": [counts], ...}}``,
  as the engine records them (``KimiForCausalLM.expert_loads``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


def plan_slots(load: list[float], num_slots: int, ranks: int) -> list[int]:
    """Logical expert of each of the ``num_slots`` physical slots (rank r holds slots r*P/e ..)."""
    E = len(load)
    if num_slots < E or num_slots % ranks:
        raise ValueError(f"{num_slots} expert slots must hold the {E} experts and divide over {ranks} EP ranks "
                         f"(num_experts + num_redundant_experts must be a multiple of the EP size)")
    load = [max(float(x), 0.0) for x in load]
    copies = [1] * E
    for _ in range(num_slots - E):
        x = max(range(E), key=lambda i: (load[i] / copies[i], -i))
        copies[x] += 1
    items = sorted(((load[x] / copies[x], x) for x in range(E) for _ in range(copies[x])), key=lambda t: (-t[0], t[1]))
    per_rank = num_slots // ranks
    rank_load, held = [0.0] * ranks, [[] for _ in range(ranks)]
    for weight, x in items:
        free = [r for r in range(ranks) if len(held[r]) < per_rank]
        apart = [r for r in free if x not in held[r]] or free
        r = min(apart, key=lambda r: (rank_load[r], r))
        held[r].append(x)
        rank_load[r] += weight
    return [x for r in range(ranks) for x in sorted(held[r])]


def identity_slots(num_experts: int, num_slots: int, ranks: int) -> list[int]:
    """The placement without a recorded load (every expert equally loaded)."""
    return plan_slots([1.0] * num_experts, num_slots, ranks)


def rank_loads(load: list[float], slots: list[int], ranks: int) -> list[float]:
    """Expected load of each rank: each copy of expert x takes load[x] / copies(x)."""
    copies = [slots.count(x) for x in range(len(load))]
    per_rank = len(slots) // ranks
    return [sum(load[x] / copies[x] for x in slots[r * per_rank:(r + 1) * per_rank]) for r in range(ranks)]


def imbalance(load: list[float], slots: list[int], ranks: int) -> float:
    """max / mean of the ranks' expected loads (1.0: perfectly even)."""
    per = rank_loads(load, slots, ranks)
    mean = sum(per) / ranks
    return max(per) / mean if mean > 0 else 1.0


@dataclass
class Placement:
    """Device tables of one layer's placement: replicas [E, P - E + 1] (slot ids, padded with the first
    copy: as wide as one expert's most copies, so a new placement fits the same tables) and their count [E]."""

    slots: list[int]
    replicas: torch.Tensor
    copies: torch.Tensor

    @staticmethod
    def build(slots: list[int], num_experts: int, device=None) -> Placement:
        where = [[s for s, x in enumerate(slots) if x == e] for e in range(num_experts)]
        if any(not w for w in where):
            raise ValueError(f"the placement leaves expert(s) {[e for e, w in enumerate(where) if not w]} without a slot")
        width = len(slots) - num_experts + 1
        table = torch.tensor([w + [w[0]] * (width - len(w)) for w in where], dtype=torch.int64, device=device)
        return Placement(list(slots), table, torch.tensor([len(w) for w in where], dtype=torch.int64, device=device))

    def update(self, slots: list[int]) -> None:
        """Switch to placement ``slots`` in place (same tables: a CUDA graph that reads them stays valid)."""
        new = Placement.build(slots, self.copies.shape[0], self.replicas.device)
        self.replicas.copy_(new.replicas)
        self.copies.copy_(new.copies)
        self.slots = list(slots)

    def physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical ids [T, k] -> slot ids [T, k]: pair (t, x) takes x's copy t mod copies(x)."""
        tok = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        return self.replicas[ids, tok % self.copies[ids]]


@dataclass(frozen=True)
class Move:
    """One expert copy a live rebalance makes: the weights in ``src_rank``'s local slot ``src`` go to ``dst_rank``'s
    local slot ``dst`` (ranks are EP ranks; the same rank: a copy within it)."""

    src_rank: int
    src: int
    dst_rank: int
    dst: int


def plan_moves(old: list[int], new: list[int], ranks: int) -> list[Move]:
    """The copies that take the slots from placement ``old`` to ``new`` (logical expert per slot, rank r holding
    slots r*P/e ..): a slot whose expert stays needs none; one whose expert its rank already holds copies it
    locally; otherwise a rank holding the expert under ``old`` sends it, the one with the fewest sends so far."""
    per = len(old) // ranks
    if len(new) != len(old) or sorted(set(new)) != sorted(set(old)):
        raise ValueError(f"the new placement must have the {len(old)} slots and the experts of the old one")
    sends = [0] * ranks
    moves = []
    for s, x in enumerate(new):
        if old[s] == x:
            continue
        dst_rank = s // per
        here = [j for j in range(per) if old[dst_rank * per + j] == x]
        if here:
            moves.append(Move(dst_rank, here[0], dst_rank, s % per))
            continue
        holders = sorted({t // per for t, y in enumerate(old) if y == x}, key=lambda r: (sends[r], r))
        src_rank = holders[0]
        sends[src_rank] += 1
        moves.append(Move(src_rank, old.index(x, src_rank * per) - src_rank * per, dst_rank, s % per))
    return moves


def save_loads(path: str | Path, loads: dict[int, list[int]], num_experts: int) -> None:
    Path(path).write_text(json.dumps({"num_experts": num_experts,
                                      "layers": {str(k): list(map(int, v)) for k, v in sorted(loads.items())}}))


def read_loads(path: str | Path, num_experts: int, moe_layers: list[int]) -> dict[int, list[float]]:
    """Per-layer expert loads of a load file, checked against the model (ValueError naming the problem)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"expert load file {path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or data.get("num_experts") != num_experts or not isinstance(data.get("layers"), dict):
        raise ValueError(f"expert load file {path}: want {{\"num_experts\": {num_experts}, \"layers\": "
                         f"{{\"<layer>\": [{num_experts} counts], ...}}}}")
    out = {}
    for key, counts in data["layers"].items():
        if not key.isdigit() or int(key) not in moe_layers:
            raise ValueError(f"expert load file {path}: layer {key!r} is not a MoE layer of this model ({moe_layers})")
        if not isinstance(counts, list) or len(counts) != num_experts or \
                not all(isinstance(c, (int, float)) and c >= 0 for c in counts):
            raise ValueError(f"expert load file {path}: layer {key} needs {num_experts} non-negative counts")
        out[int(key)] = [float(c) for c in counts]
    return out
