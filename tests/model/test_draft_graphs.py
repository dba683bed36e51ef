"""Draft-step graphs (``model/draft_graphs.py``) without CUDA: each "graph" is its captured function run eagerly
over the same fixed buffers (``EagerDraftGraphs``), so what is tested is what the graphs replay: the padded
catch-up rows, the heads' inputs, the fixed key spans and masks, padded heads, mixed depths, a chain of
position steps. Against the eager ``DraftExecutor`` on a copy of the same cache: the same drafts, the same cache
rows, step after step from reused buffers; steps that fit no graph run eagerly."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kimik3.model.dflash import DFlashConfig, DFlashDraft
from kimik3.model.draft_attention import extend_tables
from kimik3.model.draft_graphs import DraftGraphs, span_ladder
from kimik3.model.draft_step import DraftExecutor, DraftWork, draft_cache_shape
from kimik3.model.eagle3 import Eagle3Config, Eagle3Draft

BS = 4


class _Replay:
    def __init__(self, graphs, key, fn):
        self.graphs, self.key, self.fn = graphs, key, fn

    def replay(self):
        self.graphs.replayed.append(self.key)
        self.fn()


class EagerDraftGraphs(DraftGraphs):
    """DraftGraphs whose capture runs each function once (the warm-up) and records it (CPU): a replay runs it
    eagerly."""

    def record(self, fn):
        fn()                # the warm-up run before a capture, as on CUDA (it must stay within the buffers)
        return _Replay(self, None, fn)

    def capture(self) -> None:
        self.replayed: list = []          # the key of each replay: ("rows", R) or ("step", heads, span)
        super().capture()
        for key, replay in self.graphs.items():
            replay.key = key


def emulate(graphs: DraftGraphs) -> EagerDraftGraphs:
    graphs.__class__ = EagerDraftGraphs
    graphs.capture()
    return graphs


def small_draft(seed: int = 0, vocab: int = 96, target_hidden: int = 24) -> Eagle3Draft:
    cfg = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40,
                       rms_norm_eps=1e-6, rope_theta=1000.0, vocab_size=vocab, draft_vocab_size=64,
                       target_hidden_size=target_hidden, aux_layer_ids=(1, 2))
    return randomized(Eagle3Draft(cfg), seed, vocab)


def randomized(m, seed: int, vocab: int):
    """Random weights (norms 1) and a random map of the 64 draft tokens into the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) if p.dim() > 1 else torch.ones(p.shape))
    m.d2t.copy_(torch.randint(0, vocab - 64, (64,), generator=g))
    return m.eval()


def random_work(rng: random.Random, num_blocks: int, scratch_from: int, seqs: list[tuple[int, int, int | None]],
                vocab: int, reach: int | None = None) -> tuple[DraftWork, int]:
    """A step of sequences (caught-up position start, rows, depth or None: not drafting), each owning its own
    blocks, its table extended for its depth (``reach``: a DFlash block's rows); -> (work, packed rows of the
    target's step (a few more than caught up)). Its sequences' rows and tables are ``seq_lens`` and ``seq_tables``."""
    rows, ids, pos, slots, heads, offset, seq_tables = [], [], [], [], [], 0, []
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    for i, (start, n, depth) in enumerate(seqs):
        table = [free.pop() for _ in range(-(-(start + n) // BS))]
        seq_tables.append(table)
        offset += rng.randrange(0, 2)                   # a rejected draft's row, not caught up
        rows.extend(range(offset, offset + n))
        pos.extend(range(start, start + n))
        slots.extend(table[p // BS] * BS + p % BS for p in range(start, start + n))
        ids.extend(rng.randrange(vocab) for _ in range(n))
        if depth is not None:
            heads.append((depth, len(rows) - 1, table))
        offset += n
    heads.sort(key=lambda h: -h[0])
    scratch = [[scratch_from + 3 * i + j for j in range(3)] for i in range(len(heads))]
    tables = extend_tables([reach or d for d, _, _ in heads], [pos[r] + 1 for _, r, _ in heads],
                           [t for _, _, t in heads], BS,
                           scratch)
    work = DraftWork(rows, ids, pos, slots, [r for _, r, _ in heads], [d for d, _, _ in heads], tables,
                     seq_lens=[n for _, n, _ in seqs], seq_tables=seq_tables)
    return work, offset + 2


def small_dflash(seed: int = 0, vocab: int = 96, target_hidden: int = 24) -> DFlashDraft:
    cfg = DFlashConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=40, rms_norm_eps=1e-6, rope_theta=500.0, vocab_size=vocab, draft_vocab_size=64,
                       target_hidden_size=target_hidden, aux_layer_ids=(1, 2), block_size=4, mask_token_id=vocab - 1)
    return randomized(DFlashDraft(cfg), seed, vocab)


@pytest.fixture(scope="module")
def draft():
    return small_draft()


def executors(draft, max_num_seqs: int = 4, k: int = 3, max_model_len: int = 40, capture=emulate):
    """An eager executor and one with graphs (``capture``: emulated, or ``DraftGraphs.capture`` on CUDA) over
    two copies of one random cache (every position's context keys), on the draft's device."""
    num_blocks = -(-max_model_len // BS) * max_num_seqs + 1
    total = num_blocks + 3 * max(max_num_seqs, 3)
    g = torch.Generator().manual_seed(1)
    device = next(draft.parameters()).device
    cache = torch.randn(draft_cache_shape(draft, total, BS), generator=g).to(device)
    eager = DraftExecutor(draft, cache.clone(), BS)
    graphed = DraftExecutor(draft, cache.clone(), BS)
    graphed.graphs = capture(DraftGraphs(draft, graphed.cache, BS, max_num_seqs, max_model_len, k, torch.float32,
                                         min_span=8))
    return eager, graphed, num_blocks


# steps of (caught-up position start, rows, depth or None) per sequence
STEPS = [[(30, 1, 2), (12, 2, 2), (6, 1, 1), (18, 2, 1)],        # 4 heads
         [(9, 3, 3), (2, 1, 1), (20, 4, 2), (5, 2, None)],       # 3 heads (padded to 4), 10 rows (16)
         [(30, 1, 2), (12, 2, 2)],
         [(3, 1, 1)],                                            # a short span
         [(9, 3, 3), (1, 2, None)],
         [(0, 6, None), (14, 1, 3)],                             # a prompt's rows and one head
         [(4, 5, None)]]                                         # catch-up alone


def by_row(cache: torch.Tensor) -> torch.Tensor:
    """The cache by row (block * BS + offset): [rows, (layers,) 2, KVH, hd]."""
    if cache.dim() == 5:
        return cache.view(-1, *cache.shape[2:])
    return cache.view(cache.shape[0], -1, *cache.shape[3:]).transpose(0, 1)


def check_steps(draft, eager: DraftExecutor, graphed: DraftExecutor, num_blocks: int, rtol: float = 1e-5,
                atol: float = 1e-5) -> None:
    """``STEPS`` one after another on both executors: the same drafts, the same rows written."""
    rng = random.Random(3)
    dflash = isinstance(draft, DFlashDraft)
    for i, seqs in enumerate(STEPS):
        work, T = random_work(rng, num_blocks, num_blocks, seqs, draft.cfg.vocab_size,
                              draft.cfg.block_size if dflash else None)
        states = torch.randn(T, 2 * draft.cfg.target_hidden_size, generator=torch.Generator().manual_seed(i))
        states = states.to(eager.cache.device)
        assert graphed.graphs.plan(work) is not None, i
        want, got = eager.run(work, states), graphed.run(work, states)
        assert got == want, (i, got, want)
        assert len(got) == len(work.heads) and [len(d) for d in got] == work.depths
        # every row the eager step wrote holds the same keys/values; the graphs' other writes went to the null
        # block or to rows past a shallower head's drafts (rewritten when caught up, as a rejected draft's are)
        written = set(work.slots)             # (a DFlash block's keys are not kept)
        for h, d, t in zip(work.heads, work.depths, work.tables):
            written |= set() if dflash else {t[p // BS] * BS + p % BS for p in range(work.positions[h],
                                                                                     work.positions[h] + d)}
        flat_e, flat_g = by_row(eager.cache), by_row(graphed.cache)
        idx = torch.tensor(sorted(written), device=flat_e.device)
        torch.testing.assert_close(flat_g[idx], flat_e[idx], rtol=rtol, atol=atol)
        deeper = 0 if dflash else max(work.depths, default=0)
        spare = set()
        for h, d, t in zip(work.heads, work.depths, work.tables):
            spare |= {t[p // BS] * BS + p % BS for p in range(work.positions[h] + d, work.positions[h] + deeper)
                      if p // BS < len(t)}
        keep = torch.tensor(sorted(set(range(BS, flat_e.shape[0])) - written - spare), device=flat_e.device)
        torch.testing.assert_close(flat_g[keep], flat_e[keep])
        eager.cache.copy_(graphed.cache)            # the next step starts from the same cache in both


def test_span_ladder():
    assert span_ladder(43, 4, 8) == [8, 16, 32, 44]
    assert span_ladder(40, 16, 256) == [48]
    assert span_ladder(512, 16) == [256, 512]


def test_graph_steps_equal_the_eager_executor(draft):
    """Steps of mixed depths (3, 2, 1 and a row that does not draft), padded rows and heads, several key spans,
    one after another from the same buffers: drafts and cache rows equal the eager executor's."""
    eager, graphed, num_blocks = executors(draft)
    g = graphed.graphs
    assert g.sizes == [1, 2, 4] and g.row_sizes == [1, 2, 4, 8, 16] and g.spans == [8, 16, 32, 44]
    check_steps(draft, eager, graphed, num_blocks)
    steps = sum(max((d for _, _, d in seqs if d), default=0) for seqs in STEPS)
    assert len(g.replayed) == len(STEPS) + steps       # one catch-up a step, one replay per draft position
    assert {key[2] for key in g.replayed if key[0] == "step"} == {8, 16, 32}, g.replayed     # three spans
    assert {("rows", 16), ("step", 4, 32), ("step", 2, 32), ("step", 1, 32)} <= set(g.replayed), g.replayed


def test_steps_no_graph_fits_run_eagerly(draft):
    """More rows than the largest catch-up graph, more heads than the largest step graph: the eager executor."""
    eager, graphed, num_blocks = executors(draft, max_num_seqs=2, k=2)
    g = graphed.graphs
    assert g.row_sizes[-1] == 6 and g.sizes[-1] == 2
    rng = random.Random(5)
    for seqs in ([(0, 7, 1)], [(2, 1, 1), (5, 1, 1), (8, 1, 2)]):
        work, T = random_work(rng, num_blocks, num_blocks, seqs, draft.cfg.vocab_size)
        states = torch.randn(T, 2 * draft.cfg.target_hidden_size)
        assert g.plan(work) is None
        assert graphed.run(work, states) == eager.run(work, states)
        eager.cache.copy_(graphed.cache)
    assert g.replayed == []


def test_dflash_blocks_equal_the_eager_executor():
    """A DFlash draft: one block graph a step (padded heads, several context spans), its context written by the
    catch-up graph: the eager executor's drafts and cache rows."""
    dflash = small_dflash()
    eager, graphed, num_blocks = executors(dflash)
    g = graphed.graphs
    assert g.spans == [8, 16, 32, 40] and g.tokens.shape[0] == 3
    check_steps(dflash, eager, graphed, num_blocks)
    assert len(g.replayed) == len(STEPS) + sum(any(d for _, _, d in seqs) for seqs in STEPS)
    assert {key[2] for key in g.replayed if key[0] == "step"} == {8, 16, 32}, g.replayed


def test_eagle3_and_dflash_drafts_capture_whole_or_split(draft):
    """Eagle3 and DFlash drafts capture, also split over tensor-parallel ranks (every rank captures its own:
    tests/parallel/test_tensor_parallel.py); a draft whose layers are not the plain ones does not (MTP drafts:
    tests/model/test_mtp_draft_graphs.py)."""
    from kimik3.distributed import ParallelContext
    from kimik3.model.eagle3 import Eagle3Layer
    assert DraftGraphs.can_capture(draft) and DraftGraphs.can_capture(small_dflash())
    split = small_draft()
    split.lm_head.par = ParallelContext(tp_rank=0, tp_size=2)
    assert split.lm_head.par.enabled and DraftGraphs.can_capture(split)
    other = small_draft()
    other.layers[0].__class__ = type("OtherLayer", (Eagle3Layer,), {})
    assert not DraftGraphs.can_capture(other) and not DraftGraphs.can_capture(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Eagle3, DFlash and MTP drafts, not Linear"):
        DraftGraphs(torch.nn.Linear(2, 2), torch.zeros(1), BS, 2, 16, 2, torch.float32)
