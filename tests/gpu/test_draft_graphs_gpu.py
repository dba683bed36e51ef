"""Draft-model speculation with CUDA graphs (#55 item 5) on the trained default model and its shipped Eagle3
draft (bf16): the target's decode and verify steps replay graphs that also write the states the draft reads
into one fixed buffer (``DecodeGraphs.aux_states``).

1. One padded verify graph step (2 sequences in the 4-row graph, 3 tokens each): its logits and its states
   against the eager ``forward_step(aux_layers=...)`` of the same tokens from the same cache.
2. Greedy generation, graphs on vs eager (sync and async scheduling): the same tokens up to bf16 near-ties
   (``assert_same_greedy``), verify graphs and the draft's own graphs (``model/draft_graphs.py``) replayed,
   verify steps launched on drafts still on the device, drafts accepted. The drafts themselves may differ where
   the draft's states differ by rounding, so the runs may verify different drafts with different kernels: the
   cross-kernel bound ``SLICE_CROSS_NOISE`` applies.
3. The draft's own steps captured for real (small float32 Eagle3 and DFlash drafts): steps of mixed depths,
   padded rows and heads and several key spans give the eager executor's drafts and cache rows (``tests/model/
   test_draft_graphs.py``'s steps, there on emulated graphs).
4. The same for K3's MTP layers (small drafts of tiny K3 layers: MLA or KDA mixer, MoE or dense MLP, one layer or
   two chained; ``tests/model/test_mtp_draft_graphs.py``'s steps, there on emulated graphs): dense ones in float32,
   the eager executor's drafts, latents and KDA states, live and scratch; MoE ones in bf16 (float32 experts run the
   reference expert loop, whose host syncs no graph holds), and a KDA first layer (whose graphs catch up in decode
   rounds, the eager executor in one chunked pass), most drafts the eager executor's (near-ties aside) and the
   committed latents and live states within rounding.
5. K3's MTP draft through the engine on one GPU (a tiny bf16 K3 checkpoint with two MTP layers, KDA then MLA and
   MLA then KDA, MoE blocks): with CUDA graphs the draft's steps replay its own graphs and greedy output is plain
   decoding's (up to near-ties: ``assert_same_greedy``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kimik3
from kimik3.engine import EngineConfig, LLMEngine, SamplingParams
from kimik3.model.batch import ForwardBatch, StateCheckpoint
from kimik3.model.cuda_graphs import DecodeGraphs, pack_decode_inputs
from tests.gpu.test_engine_graphs import LOGIT_BOUND, SLICE_CROSS_NOISE, TOP_K, assert_same_greedy, generate
from tests.helpers import worst_rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HELD_OUT = (Path(__file__).resolve().parents[1] / "data" / "default_model_heldout.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def model():
    return kimik3.load_model(kimik3.DEFAULT_MODEL, device="cuda", dtype=torch.bfloat16)


def test_padded_verify_graph_states_match_eager(model):
    from kimik3.engine.spec.draft_model import load_draft
    aux = tuple(load_draft("eagle3", "default", model).aux_layer_ids)
    block = 16
    cache, ref = model.allocate_cache(8, 12, block), model.allocate_cache(8, 12, block)
    graphs = DecodeGraphs(model, cache, 4, 96, 3, aux_layers=aux)
    graphs.capture()
    prompts, tables = [list(range(100, 120)), list(range(300, 309))], [[1, 2, 3], [4, 5, 6]]
    for c in (cache, ref):                         # the prompts' prefill, eager, into both caches
        model.forward_step(torch.tensor(prompts[0] + prompts[1], device="cuda"),
                           ForwardBatch.build([20, 9], [0, 0], [1, 2], tables, block, "cuda"), c)
    rows = [[500, 501, 502], [600, 601, 602]]
    meta, tbl = pack_decode_inputs(rows, [20, 9], [1, 2], tables, block, 4, row_state_slots=[[3, 4, 1], [5, 6, 2]])
    logits = graphs.run(meta, tbl, 2).clone()
    states = graphs.states(2, 3).clone()
    snapshots = tuple(StateCheckpoint(s, j + 1, slot) for s, slots in enumerate([[3, 4], [5, 6]])
                      for j, slot in enumerate(slots))
    batch = ForwardBatch.build([3, 3], [20, 9], [1, 2], tables, block, "cuda", checkpoints=snapshots)
    hidden, want = model.forward_step(torch.tensor(rows[0] + rows[1], device="cuda"), batch, ref, aux)
    assert worst_rel_err(states, torch.cat(want, -1)) < LOGIT_BOUND
    assert worst_rel_err(logits, model.compute_logits(hidden)) < LOGIT_BOUND


@pytest.mark.parametrize("n, async_scheduling", [(1, False), (6, False), (6, True)])
def test_eagle3_graphs_match_eager(model, n, async_scheduling):
    """(Verify steps whose requests carry different numbers of drafts run eagerly: with one request every
    verify step is a graph.)"""
    tok = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
    ids = tok.encode(HELD_OUT)
    reqs = {f"p{i}": (ids[40 * i:40 * i + 32], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                               logprobs=TOP_K)) for i in range(n)}
    kw = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=192, enable_prefix_caching=False,
              cache_memory_bytes=1 << 30, num_speculative_tokens=4, speculative_method="eagle3",
              speculative_model="default", async_scheduling=async_scheduling)
    eager = generate(LLMEngine(model, EngineConfig(enforce_eager=True, **kw)), reqs)
    engine = LLMEngine(model, EngineConfig(enforce_eager=False, **kw))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.max_query_len == 5 and graphs.aux_states is not None
    draft_graphs = engine.scheduler.drafter.executor.graphs
    assert draft_graphs is not None and draft_graphs.graphs
    on_device, pending_drafts = [], engine.scheduler.drafter.pending_drafts

    def counting():                 # verify steps scheduled on drafts still on the device (spec/device_drafts.py)
        source = pending_drafts()
        on_device.append(source is not None)
        return source
    engine.scheduler.drafter.pending_drafts = counting
    replayed = []
    run = graphs.run

    def counting(meta, tables, num_seqs, *args, **kwargs):
        replayed.append(meta.shape[1] // tables.shape[0])
        return run(meta, tables, num_seqs, *args, **kwargs)
    graphs.run = counting
    graphed = generate(engine, reqs)
    assert 1 in replayed and (n > 1 or any(L > 1 for L in replayed)), replayed
    assert engine.num_accepted_tokens > 0 and draft_graphs.num_replays > 0 and any(on_device)
    print(f"draft graph steps {draft_graphs.num_replays}; "
          f"graph steps {engine.runner.num_graph_steps} of {engine.runner.num_steps}, verify graphs "
          f"{sum(L > 1 for L in replayed)}, accepted {engine.num_accepted_tokens} of {engine.num_draft_tokens}")
    assert_same_greedy(eager, graphed, reqs, noise=SLICE_CROSS_NOISE)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_captured_draft_steps_match_the_eager_executor(method):
    from kimik3.model.draft_graphs import capture_draft_or_none
    from tests.model.test_draft_graphs import STEPS, check_steps, executors, small_dflash, small_draft
    draft = (small_draft() if method == "eagle3" else small_dflash()).cuda()
    eager, graphed, num_blocks = executors(draft, capture=capture_draft_or_none)
    assert graphed.graphs is not None and graphed.graphs.graphs
    check_steps(draft, eager, graphed, num_blocks, rtol=1e-4, atol=1e-4)
    assert graphed.graphs.num_replays == len(STEPS)


@pytest.mark.parametrize("layout", ["mla-dense", "kda-dense", "mla-moe", "kda-moe", "mla+kda"])
def test_captured_mtp_steps_match_the_eager_executor(layout):
    from kimik3.model.draft_graphs import capture_draft_or_none
    from tests.model.test_mtp_draft_graphs import LAYOUTS, STEPS, check_mtp_steps, mtp_draft, mtp_executors
    kinds, dense = LAYOUTS[layout]
    draft = mtp_draft(kinds, dense).cuda()
    if not dense:                       # bf16 but the tensors K3 keeps fp32, as the loader casts it
        from kimik3.loader.drafts import cast_mtp
        draft = cast_mtp(draft, torch.bfloat16)
    eager, graphed, num_blocks = mtp_executors(draft, capture=capture_draft_or_none)
    assert graphed.graphs is not None and graphed.graphs.graphs, "the MTP draft's steps did not capture (log above)"
    # a KDA first layer's catch-up: decode rounds in the graphs, one chunked pass eagerly (fla's chunk kernel takes
    # its fp32 products as tf32): the committed states within 1e-2, the drafts mostly alike
    exact = dense and not kinds[0]
    tol = 1e-4 if exact else 1e-2 if dense else 5e-2
    agree = check_mtp_steps(draft, eager, graphed, num_blocks, rtol=tol, atol=tol, exact=exact)
    print(f"{layout}: {agree:.0%} of the drafts the eager executor's")
    assert agree >= (1.0 if exact else 0.75), agree
    assert graphed.graphs.num_replays == len(STEPS)


@pytest.mark.parametrize("kinds", [(True, False), (False, True)], ids=["kda+mla", "mla+kda"])
def test_mtp_draft_engine_on_graphs_gives_plain_greedy(tmp_path, kinds):
    from kimik3.config import load_config
    from kimik3.engine import LLM
    from tests.gpu.test_engine_graphs import requests
    from tests.parallel.test_tensor_parallel import mtp_checkpoint
    ckpt = mtp_checkpoint(tmp_path / "k3", kinds)
    kw = dict(dtype=torch.bfloat16, device="cuda", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
              kv_cache_memory_bytes=1 << 28)
    reqs = requests(load_config(ckpt).text.vocab_size)
    with LLM(ckpt, **kw) as llm:
        want = generate(llm.engine, reqs)
    with LLM(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, enforce_eager=False,
             **kw) as llm:
        got = generate(llm.engine, reqs)
        graphs = llm.engine.scheduler.drafter.executor.graphs
        drafts, accepted = llm.engine.num_draft_tokens, llm.engine.num_accepted_tokens
    assert graphs is not None and graphs.num_replays > 0 and drafts > 0, (graphs, drafts)
    print(f"MTP {kinds}: draft graph steps {graphs.num_replays}, accepted {accepted} of {drafts}")
    assert_same_greedy(want, got, reqs)
