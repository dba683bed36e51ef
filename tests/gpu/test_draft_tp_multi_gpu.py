"""Draft models under tensor parallelism on 2 GPUs (NCCL), bf16, tiny K3 with two MTP layers (a KDA then an MLA
block, MoE): K3's MTP draft and a DFlash draft split over both ranks (``docs/speculative.md``) give plain one-GPU
greedy decoding (up to near-ties: ``assert_same_greedy``) through ``LLM(tensor_parallel_size=2,
speculative_config=...)``; with CUDA graphs (``enforce_eager=False``) every rank captures the target's decode /
verify graphs and the draft's own (Eagle3, DFlash, MTP), collectives inside,
and rank 0's draft steps replay them (a worker that did not would leave rank 0 in a collective: the test would hang,
not pass); MTP under EP2 too (the MoE blocks' share in fixed shapes in the graphs). Skipped with fewer than 2 GPUs; the same drafts run in float64 on CPU ranks in
tests/parallel/test_tensor_parallel.py (the graphs as eager stand-ins), where their drafts equal the one-process
drafts exactly."""

from __future__ import annotations

import pytest
import torch

from kimik3.config import load_config
from kimik3.engine import LLM
from tests.gpu.test_engine_graphs import assert_same_greedy, generate, requests
from tests.gpu.test_layouts_multi_gpu import KW, pytestmark       # noqa: F401 (2 GPUs, bf16, the same engine sizes)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.parallel.test_tensor_parallel import mtp_checkpoint
    return mtp_checkpoint(tmp_path_factory.mktemp("draft-tp") / "k3", (True, False))


def plain_and_tp2_drafts(ckpt: str, tmp_path, method: str, kw: dict, **tp_kw) -> tuple[dict, dict, dict, int, tuple]:
    """(requests, one-device plain greedy outputs, TP2 outputs with the ``method`` draft, its draft tokens, (target
    graph steps, draft steps on the draft's graphs: None without them))."""
    import kimik3
    from tests.loader.test_drafts import dflash_files, eagle3_files
    reqs = requests(load_config(ckpt).text.vocab_size)
    with LLM(ckpt, **kw) as llm:
        want = generate(llm.engine, reqs)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method in ("dflash", "eagle3"):
        files = {"dflash": dflash_files, "eagle3": eagle3_files}[method]
        files(tmp_path / method, kimik3.load_model(ckpt, dtype=torch.float32, language_model_only=True))
        spec["model"] = str(tmp_path / method)
    with LLM(ckpt, tensor_parallel_size=2, speculative_config=spec, **kw, **tp_kw) as llm:
        got = generate(llm.engine, reqs)
        drafts = llm.engine.num_draft_tokens
        graphs = llm.engine.scheduler.drafter.executor.graphs
        stats = (llm.engine.runner.num_graph_steps, None if graphs is None else graphs.num_replays)
    return reqs, want, got, drafts, stats


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_drafts_under_tp2_give_plain_greedy(ckpt, tmp_path, method):
    reqs, want, got, drafts, _ = plain_and_tp2_drafts(ckpt, tmp_path, method, KW)
    assert drafts > 0
    assert_same_greedy(want, got, reqs)


@pytest.mark.parametrize("method", ["eagle3", "dflash", "mtp"])
def test_draft_graphs_under_tp2_give_plain_greedy(ckpt, tmp_path, method):
    reqs, want, got, drafts, (graph_steps, draft_replays) = plain_and_tp2_drafts(ckpt, tmp_path, method, KW,
                                                                                enforce_eager=False)
    assert drafts > 0 and graph_steps > 0, (drafts, graph_steps)
    assert draft_replays is not None and draft_replays > 0, draft_replays
    assert_same_greedy(want, got, reqs)


def test_mtp_graphs_under_ep2_give_plain_greedy(ckpt, tmp_path):
    """Expert parallelism with tokens replicated (EP2, "tep"): the target's decode / verify graphs and the MTP draft's
    capture on both ranks, their MoE blocks in fixed shapes (``MoE.local_pairs``: the local pairs alone need a host
    synchronisation, which failed the capture and left both eager), and give plain greedy decoding."""
    reqs, want, got, drafts, (graph_steps, draft_replays) = plain_and_tp2_drafts(
        ckpt, tmp_path, "mtp", KW, enforce_eager=False, enable_expert_parallel=True)
    assert drafts > 0 and graph_steps > 0, (drafts, graph_steps)
    assert draft_replays is not None and draft_replays > 0, draft_replays
    assert_same_greedy(want, got, reqs)
