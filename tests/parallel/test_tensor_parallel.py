"""Tensor and expert parallelism on CPU (gloo, float64): every layout and MoE tail gives the
single-process logits; the engine's greedy outputs do not depend on the layout (spec
parallelism.md §7.4). Ranks are spawned processes; rank bodies live in ``ranks.py``."""


import pytest
import torch

from kimik3.distributed import ParallelContext
from kimik3.engine import EngineConfig, LLMEngine
from kimik3.loader.load import load_model
from kimik3.testing import make_tiny_checkpoint
from tests.helpers import rel_err
from tests.parallel.ranks import (DRAFT_ENGINE_CONFIG, ENGINE_CONFIG, SPEC_ENGINE_CONFIG, draft_engine_rank,
                                  engine_prompts, engine_rank, image_prompts, logits_rank, record_drafts, run_engine, run_steps, spawn,
                                  spec_engine_rank, spec_prompts)

ARCHS = ("kimi_k3", "kimi_linear")
# name: (expert parallel size, MoE mode, tail[, decode context parallel size[, EPLB redundant slots]]);
# world = TP size. EPLB layouts place their slots by tests.parallel.ranks.skewed_loads.
LAYOUTS = {
    2: {"tp2": (1, "tep", "concat"), "tp2-sliced": (1, "tep", "sliced"), "ep2": (2, "tep", "concat"),
        "ep2-sliced": (2, "tep", "sliced"), "ep2-a2a": (2, "a2a", "auto"), "ep2-agrs": (2, "agrs", "auto"),
        "tp2-dcp2": (1, "tep", "auto", 2), "ep2-eplb": (2, "tep", "auto", 1, 2), "ep2-a2a-eplb": (2, "a2a", "auto", 1, 4)},
    4: {"tp4": (1, "tep", "auto"), "tp4xep2": (2, "tep", "sliced"), "ep4-a2a": (4, "a2a", "auto"),
        "ep4": (4, "tep", "concat"), "tp4-dcp2": (1, "tep", "auto", 2)},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints with 4 KDA/MLA heads (so that t = 4 divides them)."""
    d = tmp_path_factory.mktemp("tp")
    return {arch: make_tiny_checkpoint(d / arch, arch, seed=1, num_heads=4) for arch in ARCHS}


@pytest.fixture(scope="module")
def reference(ckpts):
    out = {}
    for arch, path in ckpts.items():
        logits, emb, cache = run_steps(load_model(path, dtype=torch.float64))
        out[arch] = (logits, emb, cache)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_one_process(ckpts, reference, tmp_path, world):
    out = tmp_path / "out.pt"
    spawn(logits_rank, world, {a: str(p) for a, p in ckpts.items()}, LAYOUTS[world], str(out))
    results = torch.load(out, weights_only=False)
    for arch in ARCHS:
        ref_logits, ref_emb, ref_cache = reference[arch]
        for name in LAYOUTS[world]:
            logits, emb, kda_state, kda_conv, latent = results[arch, name]
            assert torch.equal(emb, ref_emb), f"{arch} {name}: vocab-parallel embedding not bit-exact"
            for step, (a, b) in enumerate(zip(logits, ref_logits)):
                assert rel_err(a, b) <= 1e-12, f"{arch} {name} step {step}: rel err {rel_err(a, b):.2e}"
            # rank 0's KDA state is the head slice of the one-process state; the latent is whole
            heads = kda_state.shape[2]
            assert rel_err(kda_state, ref_cache.kda_state[:, :, :heads]) <= 1e-12, f"{arch} {name}: KDA state"
            channels = kda_conv.shape[2] // 3
            ref_conv = torch.cat([c[:, :, :channels] for c in ref_cache.kda_conv.chunk(3, dim=2)], dim=2)
            assert rel_err(kda_conv, ref_conv) <= 1e-12, f"{arch} {name}: KDA conv window"
            dcp = (*LAYOUTS[world][name][3:], 1)[0]
            # under DCP rank 0 holds positions p % dcp == 0 of each block, in order (null block 0 skipped)
            want = ref_cache.mla_latent[:, 1:, ::dcp]
            assert latent.shape[2] * dcp == ref_cache.mla_latent.shape[2], f"{arch} {name}: stripe rows per block"
            assert rel_err(latent[:, 1:], want) <= 1e-12, f"{arch} {name}: MLA latent cache"


@pytest.mark.parametrize("ep,mode,dcp,eplb", [(1, "tep", 1, None), (2, "a2a", 1, None), (1, "tep", 2, None),
                                              (2, "tep", 1, 2)],
                         ids=["tp2-images", "ep2-a2a", "tp2-dcp2", "ep2-eplb"])
def test_engine_greedy_outputs_match_one_process(ckpts, tmp_path, ep, mode, dcp, eplb):
    """Chunked prefill (8-token budget), prefix-cache hits with KDA checkpoints, decode. With decode
    context parallelism the plan's latent bytes per block (and so per rank) are the one-process ones / dcp.
    TP2 also serves image prompts: both ranks run the vision tower on their share of the images. EP2 with
    EPLB (2 redundant slots placed by a skewed load) records every routed (token, expert) pair."""
    path = ckpts["kimi_k3"]
    engine = LLMEngine(load_model(path, dtype=torch.float64), EngineConfig(**ENGINE_CONFIG))
    first, second = engine_prompts(engine.vocab_size)
    (a, _), (b, hits) = run_engine(engine, first), run_engine(engine, second)
    images = image_prompts(engine.model) if dcp == 1 and ep == 1 else None
    c = run_engine(engine, images)[0] if images else []
    assert hits > 0
    spawn(engine_rank, 2, str(path), ep, mode, str(tmp_path / "out.pt"), False, None, dcp, images, eplb)
    outs, par_hits, _, _, plan, encoded, loads = torch.load(tmp_path / "out.pt", weights_only=False)
    assert outs == a + b + c
    assert par_hits == hits
    assert plan.bytes_per_block * dcp == engine.plan.bytes_per_block
    assert plan.num_blocks >= engine.plan.num_blocks
    if eplb:
        text = engine.model.config.text
        routed = sum(len(p) for p in first + second) + 2 * 3 * 6      # prompt tokens + decode steps, upper bound
        assert sorted(loads) == [i for i in range(text.num_hidden_layers) if text.is_moe_layer(i)]
        assert all(0 < sum(v) <= routed * text.num_experts_per_token for v in loads.values())
        assert len({sum(v) for v in loads.values()}) == 1            # every layer saw the same tokens
    if images:
        worker = torch.load(tmp_path / "out.pt.rank1", weights_only=False)
        assert encoded[0] > 0 and worker[0] > 0 and encoded[0] + worker[0] == 4, (encoded, worker)


def test_async_scheduling_under_tensor_parallel(ckpts, tmp_path):
    """Async scheduling with TP2: the ahead steps' input ids (rank 0's device samples) reach the
    worker on the model's group, and the outputs are the one-process greedy outputs."""
    path = ckpts["kimi_linear"]
    engine = LLMEngine(load_model(path, dtype=torch.float64), EngineConfig(**ENGINE_CONFIG))
    first, second = engine_prompts(engine.vocab_size)
    (a, _), (b, hits) = run_engine(engine, first), run_engine(engine, second)
    spawn(engine_rank, 2, str(path), 1, "tep", str(tmp_path / "out.pt"), True)
    outs, par_hits, ahead, _, _, _, _ = torch.load(tmp_path / "out.pt", weights_only=False)
    assert ahead > 5, "no step was launched ahead"
    assert outs == a + b and par_hits == hits


@pytest.mark.parametrize("graphs,async_scheduling", [("all", False), ("all", True), ("rank1-fails", False)])
def test_decode_graphs_under_tensor_parallel(ckpts, tmp_path, graphs, async_scheduling):
    """Decode graphs with TP2 (eager stand-ins for the captured graphs on every rank, their
    collectives inside): graph steps reach the worker, which replays its own (with async
    scheduling's device ids too), and the outputs are the one-process greedy outputs. A rank whose
    capture fails makes every rank run eagerly."""
    path = ckpts["kimi_k3"]
    engine = LLMEngine(load_model(path, dtype=torch.float64), EngineConfig(**ENGINE_CONFIG))
    first, second = engine_prompts(engine.vocab_size)
    (a, _), (b, hits) = run_engine(engine, first), run_engine(engine, second)
    spawn(engine_rank, 2, str(path), 1, "tep", str(tmp_path / "out.pt"), async_scheduling, graphs)
    outs, par_hits, ahead, graph_steps, _, _, _ = torch.load(tmp_path / "out.pt", weights_only=False)
    assert outs == a + b and par_hits == hits
    assert (graph_steps > 0) == (graphs == "all"), graph_steps
    assert (ahead > 0) == async_scheduling


@pytest.mark.parametrize("graphs,dcp", [(False, 2), (True, 1)], ids=["eager-dcp2", "graphs"])
def test_speculative_decoding_under_tensor_parallel(ckpts, tmp_path, graphs, dcp):
    """The snapshot and rollback copies reach every rank: TP2 with n-gram drafts gives the
    one-process outputs, which equal plain greedy decoding; eagerly with the latent cache striped over both ranks
    (DCP2: verify chunks attend over both stripes); with graphs, verify steps replay the
    workers' verify graphs too (their (size, L) key travels in the replayed inputs' shape)."""
    path = ckpts["kimi_k3"]
    model = load_model(path, dtype=torch.float64)
    vocab = model.config.text.vocab_size
    prompts = spec_prompts(vocab)
    plain, _ = run_engine(LLMEngine(model, EngineConfig(max_model_len=vocab + 16, **{
        **SPEC_ENGINE_CONFIG, "num_speculative_tokens": 0})), prompts)
    spawn(spec_engine_rank, 2, str(path), str(tmp_path / "out.pt"), graphs, dcp)
    outs, drafts, accepted, verify_replays = torch.load(tmp_path / "out.pt", weights_only=False)
    assert outs == plain
    assert drafts > 0 and (verify_replays > 0) == graphs, verify_replays


def _draft_engine(model, method: str, draft_path: str, rounds: list, monkeypatch) -> tuple[list, list, list, int]:
    """One process: (plain greedy outputs of each round, the draft engine's, its drafts at every draft step with every
    request drafting all it may, the draft's parameter elements)."""
    plain_cfg = EngineConfig(**{**DRAFT_ENGINE_CONFIG, "num_speculative_tokens": 0, "speculative_method": "ngram"})
    plain_engine = LLMEngine(model, plain_cfg)
    plain = [run_engine(plain_engine, prompts)[0] for prompts in rounds]
    alone: list = []
    held: dict = {}
    with monkeypatch.context() as m:
        from kimik3.engine.spec.controller import DraftController
        from kimik3.model.draft_step import DraftExecutor
        m.setattr(DraftExecutor, "launch", DraftExecutor.launch)   # restored after recording
        m.setattr(DraftController, "plan", DraftController.plan)
        record_drafts(alone, held)
        engine = LLMEngine(model, EngineConfig(**{**DRAFT_ENGINE_CONFIG, "speculative_method": method},
                                               speculative_model=draft_path))
        engine.scheduler.drafter.may_lag = False     # as under TP: every step's rows caught up (step for step drafts)
        outs = [run_engine(engine, prompts)[0] for prompts in rounds]
    return plain, outs, alone, held["elements"]


def _check_draft_ranks(out_path, world: int, cases: dict, alone: dict) -> None:
    """Each case under TP: plain decoding's outputs, verify steps ran, every worker computed rank 0's drafts, which
    are the one-process drafts (``alone``: name -> (plain outputs, drafts, the whole draft's parameter elements)),
    and each rank held a share of the draft (fewer parameter elements than the whole draft: not a replica). A case
    on graphs (``draft_engine_rank``): the drafts' own steps (Eagle3, DFlash, MTP) replayed graphs on every rank (all
    but the draft step after a round's prefill: its many rows), and verify steps were fed drafts still on rank 0's
    device (graph steps; eager ones too where prefix checkpoints make them eager), every worker's graph replays had
    rank 0's inputs; every rank drafts eagerly where rank 1 could not capture the draft's graphs (drafts on the
    host)."""
    results = torch.load(out_path, weights_only=False)
    workers = [torch.load(f"{out_path}.rank{r}", weights_only=False) for r in range(1, world)]
    for name, case in cases.items():
        outs, verify_chunks, drafts, elements, replays, fed, graph_steps, graph_ids = results[name]
        plain, want, whole = alone[name]
        assert outs == plain and verify_chunks > 0, name
        for r, worker in enumerate(workers, 1):
            assert worker[name][0] == drafts, (name, r)
        assert drafts == want and any(drafts), name
        for r, held in enumerate([elements] + [w[name][1] for w in workers]):
            assert held < whole, (name, r, held, whole)
        ranks_replays = [replays] + [w[name][2] for w in workers]
        assert (graph_steps > 0) == (len(case) == 6) and len(graph_ids) == graph_steps, (name, graph_steps)
        for r, worker in enumerate(workers, 1):      # the workers replayed the same inputs (device drafts too)
            assert worker[name][3] == graph_ids, (name, r)
        if len(case) < 6 or "rank1-fails" in case[5]:
            assert ranks_replays == [0] * world and fed == [], (name, ranks_replays, fed)
        else:           # verify steps with a prefix checkpoint run eagerly
            assert len(set(ranks_replays)) == 1 and len(drafts) - len(case[3]) == replays, (name, ranks_replays)
            assert True in fed and (False in fed) == ("prefix-caching" in case[5]), (name, fed)


@pytest.mark.parametrize("world", [2, 4])
def test_draft_model_runs_on_every_rank(ckpts, tmp_path, monkeypatch, world):
    """Speculative decoding with an Eagle3 draft under TP (its heads, intermediate and vocabulary split over the
    ranks; with 4 ranks its 2 key/value heads replicated): the greedy outputs are plain decoding's, every rank ran
    every draft step, and the drafts are the one-process drafts of the same draft."""
    from tests.loader.test_drafts import eagle3_files
    path = ckpts["kimi_k3"]
    model = load_model(path, dtype=torch.float64)
    eagle3_files(tmp_path / "eagle3", model)
    rounds = [engine_prompts(model.config.text.vocab_size)[0]]
    plain, one, alone, whole = _draft_engine(model, "eagle3", str(tmp_path / "eagle3"), rounds, monkeypatch)
    assert one == plain
    cases = {"eagle3": (str(path), "eagle3", str(tmp_path / "eagle3"), rounds)}
    if world == 2:          # on graphs (eager stand-ins) too, in the same spawn
        for graphs in ("sync", "async", "rank1-fails"):
            cases[f"eagle3-graphs-{graphs}"] = (*cases["eagle3"], None, graphs)
    spawn(draft_engine_rank, world, cases, str(tmp_path / "out.pt"))
    _check_draft_ranks(tmp_path / "out.pt", world, cases, dict.fromkeys(cases, (plain, alone, whole)))


def mtp_checkpoint(path, kinds: tuple[bool, ...]) -> str:
    """A tiny K3 checkpoint (4 heads) with MTP layers L + j, KDA where ``kinds[j]`` (MoE blocks, MXFP4 experts)."""
    from kimik3.config import parse_config
    from kimik3.model.kimi_k3 import KimiForCausalLM
    from kimik3.model.mtp import MTPDraft
    from kimik3.testing import random_weights, tiny_k3_config
    from tests.loader.test_drafts import _mtp_checkpoint, random_weights_like
    config = tiny_k3_config(vision=False, num_heads=4)
    text = config["text_config"]
    L = text["num_hidden_layers"]
    text["num_nextn_predict_layers"] = len(kinds)
    text["linear_attn_config"]["kda_layers"] += [L + 1 + j for j, kda in enumerate(kinds) if kda]
    model = KimiForCausalLM(parse_config(config))
    random_weights(model, 0)
    mtp = MTPDraft(model.config.text, len(kinds))
    random_weights_like(mtp)
    _mtp_checkpoint(path, config, mtp, model)
    return str(path)


def test_mtp_and_dflash_drafts_run_on_every_rank(tmp_path, monkeypatch):
    """K3's MTP layers (a KDA first layer then an MLA one, and the other way round; MoE blocks; the latter also under
    EP2 all-to-all with DCP2, and on graphs under EP2) and a DFlash block drafter under TP2, in one spawn: each split as the target's layers are (MTP: by the target's own MLA / KDA / MoE
    modules and a vocabulary-split head), two rounds of prompts (the second hits the prefix cache: a KDA draft layer's
    checkpoints and restores on every rank); greedy outputs are plain decoding's, every rank computed every draft
    step, and the drafts are the one-process drafts; also on graphs (``_check_draft_ranks``)."""
    from tests.loader.test_drafts import dflash_files
    cases, alone = {}, {}
    for name, kinds in (("mtp-kda+mla", (True, False)), ("mtp-mla+kda", (False, True))):
        path = mtp_checkpoint(tmp_path / name, kinds)
        model = load_model(path, dtype=torch.float64)
        rounds = list(engine_prompts(model.config.text.vocab_size))
        plain, one, *drafts = _draft_engine(model, "mtp", path, rounds, monkeypatch)
        assert one == plain, name
        cases[name], alone[name] = (path, "mtp", path, rounds), (plain, *drafts)
    # the same draft with the target's experts over 2 EP ranks (all-to-all MoE: each rank routes half the rows, the
    # draft's MoE too) and its latents striped (DCP2: the draft's own latents stay whole)
    cases["mtp-ep2-a2a-dcp2"], alone["mtp-ep2-a2a-dcp2"] = (*cases[name], (2, "a2a", 2)), alone[name]
    dflash_files(tmp_path / "dflash", model)
    plain, one, *drafts = _draft_engine(model, "dflash", str(tmp_path / "dflash"), rounds[:1], monkeypatch)
    assert one == plain
    cases["dflash"], alone["dflash"] = (path, "dflash", str(tmp_path / "dflash"), rounds[:1]), (plain, *drafts)
    # on graphs (eager stand-ins): the target's on every rank keep the states the draft reads; the draft's own steps
    # replay graphs on every rank (MTP's KDA first layer: its catch-up in rounds or eagerly), DFlash's with the
    # target under EP2 and DCP2; MTP under EP2 with tokens replicated: the target's and the draft's MoE blocks in
    # the graphs' fixed shapes (every pair, other ranks' at weight 0: ``MoE.local_pairs``)
    for name, base, layout, graphs in (("mtp-kda+mla-graphs", "mtp-kda+mla", None, "sync"),
                                       ("mtp-mla+kda-graphs-ep2", "mtp-mla+kda", (2, "tep", 1), "sync"),
                                       ("dflash-graphs-ep2-dcp2", "dflash", (2, "tep", 2), "sync prefix-caching")):
        cases[name], alone[name] = (*cases[base], layout, graphs), alone[base]
    spawn(draft_engine_rank, 2, cases, str(tmp_path / "out.pt"))
    _check_draft_ranks(tmp_path / "out.pt", 2, cases, alone)


# ---- bad degrees ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(tp_size=3), "KDA heads"),
    (dict(tp_size=4, ep_size=3), "must divide the tensor parallel size"),
    (dict(tp_size=2, ep_size=1, moe_mode="a2a"), "needs expert parallel size = tensor parallel size"),
    (dict(tp_size=2, moe_tail="fast"), "moe_tail"),
])
def test_bad_degrees_give_clear_errors(ckpts, kwargs, match):
    from kimik3.config import load_config
    from kimik3.model.kimi_k3 import KimiForCausalLM
    with pytest.raises(ValueError, match=match):
        par = ParallelContext(tp_rank=0, **kwargs)
        with torch.device("meta"):
            KimiForCausalLM(load_config(ckpts["kimi_k3"]), par)


def test_expert_parallel_must_divide_the_experts(tmp_path):
    from kimik3.config import parse_config
    from kimik3.model.kimi_k3 import KimiForCausalLM
    from kimik3.testing import tiny_k3_config
    cfg = parse_config(tiny_k3_config(num_experts=6, num_heads=4, vision=False), "tiny")
    with pytest.raises(ValueError, match="must divide the number of routed experts"), torch.device("meta"):
        KimiForCausalLM(cfg, ParallelContext(0, 4, None, 4))


def test_nvls_variables_are_set_when_unset(monkeypatch):
    from kimik3.parallel.launch import NVLS_SAFE_ENV, set_safe_nvls_env
    for k in NVLS_SAFE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert set_safe_nvls_env() == ["TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"]
    import os
    assert all(os.environ[k] == v for k, v in NVLS_SAFE_ENV.items())
