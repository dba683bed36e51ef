"""Draft models (Eagle3, DFlash, MTP) against float64 computations written straight from their formulas, through
the paged draft cache in several chunks (shuffled blocks, scratch blocks); the target's auxiliary states."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kimik3.config import parse_config
from kimik3.model.batch import ForwardBatch, HybridCache
from kimik3.model.dflash import DFlashConfig, DFlashDraft
from kimik3.model.draft_attention import DraftBatch
from kimik3.model.eagle3 import Eagle3Config, Eagle3Draft
from kimik3.model.kimi_k3 import KimiForCausalLM
from kimik3.model.mtp import MTPDraft
from kimik3.testing import random_weights, tiny_k3_config, tiny_kimi_linear_config
from tests.helpers import rel_err

F64 = torch.float64


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if p.dim() == 1:
            p.data.copy_(1 + 0.2 * torch.randn(p.shape, generator=g, dtype=F64))
        else:
            p.data.copy_(torch.randn(p.shape, generator=g, dtype=F64) / math.sqrt(p.shape[-1]))


def norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rot(x, pos, theta):
    """RoPE as complex rotation of the pairs (i, i + d/2) (NeoX halves)."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=F64) / d)
    z = torch.complex(x[..., :d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(freq), pos[:, None] * freq)[:, None]
    return torch.cat([z.real, z.imag], -1)


def attention_ref(q, k, v, mask):
    """q [T, H, d], k/v [S, KVH, d], mask [T, S] True = visible."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hts,shd->thd", s.masked_fill(~mask, -math.inf).softmax(-1), v)


def silu_mlp(mlp, x):
    g, u = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    return (g * torch.sigmoid(g) * u) @ mlp.down_proj.weight.T


def eagle3_cfg(**kw) -> Eagle3Config:
    base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                rms_norm_eps=1e-6, rope_theta=1000.0, vocab_size=50, draft_vocab_size=20, target_hidden_size=24,
                aux_layer_ids=(0, 2, 3))
    return Eagle3Config(**(base | kw))


def eagle3_ref(m: Eagle3Draft, ids, hidden, pos):
    """One sequence's rows (causal over themselves), float64, from the formulas."""
    c, lay = m.cfg, m.layers[0]
    a = lay.self_attn
    e = norm(m.embed_tokens.weight[ids], lay.input_layernorm.weight, c.rms_norm_eps)
    h = norm(hidden, lay.hidden_norm.weight, c.rms_norm_eps)
    x = torch.cat([e, h], -1)
    T = x.shape[0]
    q = rot((x @ a.q_proj.weight.T).view(T, -1, c.head_dim), pos, c.rope_theta)
    k = rot((x @ a.k_proj.weight.T).view(T, -1, c.head_dim), pos, c.rope_theta)
    v = (x @ a.v_proj.weight.T).view(T, -1, c.head_dim)
    o = attention_ref(q, k, v, torch.ones(T, T, dtype=torch.bool).tril()).reshape(T, -1) @ a.o_proj.weight.T
    r = (h if c.norm_before_residual else hidden) + o
    r = r + silu_mlp(lay.mlp, norm(r, lay.post_attention_layernorm.weight, c.rms_norm_eps))
    return norm(r, m.norm.weight, c.rms_norm_eps) @ m.lm_head.weight.T, r


@pytest.mark.parametrize("norm_before_residual, inference", [(False, False), (True, False), (False, True)])
def test_eagle3_forward_matches_float64_reference_in_chunks(norm_before_residual, inference):
    """Also under inference mode, where the draft's q/k/v and gate/up projections run as one GEMM each."""
    with torch.inference_mode(inference):
        eagle3_forward_in_chunks(norm_before_residual)


def eagle3_forward_in_chunks(norm_before_residual: bool) -> None:
    cfg = eagle3_cfg(norm_before_residual=norm_before_residual)
    m = Eagle3Draft(cfg).to(F64)
    randomize(m, 0)
    T, bs = 11, 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    aux = [torch.randn(T, cfg.target_hidden_size, generator=g, dtype=F64) for _ in cfg.aux_layer_ids]
    feat = m.combine(aux)
    ref_feat = torch.cat(aux, -1) @ m.fc.weight.T
    assert rel_err(feat, ref_feat) < 1e-12
    ref_logits, ref_r = eagle3_ref(m, ids, ref_feat, torch.arange(T, dtype=F64))
    cache = torch.full((8, bs, 2, cfg.num_key_value_heads, cfg.head_dim), float("nan"), dtype=F64)
    table = [5, 2, 7]                       # blocks out of order; rows past them go to a scratch block
    outs = []
    for a, b in ((0, 6), (6, 7), (7, 11)):
        batch = DraftBatch.build([b - a], [a], [table[:2]], bs, scratch=[[6]])
        outs.append(m(ids[a:b], feat[a:b], batch, cache))
    logits, r = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
    assert rel_err(logits, ref_logits) < 1e-12 and rel_err(r, ref_r) < 1e-12


def test_eagle3_batch_of_sequences_is_each_alone():
    cfg = eagle3_cfg()
    m = Eagle3Draft(cfg).to(F64)
    randomize(m, 3)
    g = torch.Generator().manual_seed(4)
    lens, ctx = [3, 1, 5], [4, 7, 0]
    cache = torch.randn(12, 4, 2, 2, 16, generator=g, dtype=F64)
    tables = [[0, 1], [2, 3], [4, 5]]
    ids = torch.randint(0, 50, (sum(lens),), generator=g)
    hid = torch.randn(sum(lens), 32, generator=g, dtype=F64)
    together = m(ids, hid, DraftBatch.build(lens, ctx, tables, 4), cache.clone())[0]
    alone, a = [], 0
    for n, (q, c) in enumerate(zip(lens, ctx)):
        alone.append(m(ids[a:a + q], hid[a:a + q], DraftBatch.build([q], [c], [tables[n]], 4), cache.clone())[0])
        a += q
    assert rel_err(together, torch.cat(alone)) < 1e-13
    assert torch.equal(m.to_target(torch.tensor([0, 5])), torch.tensor([0, 5]) + m.d2t[torch.tensor([0, 5])])


def test_draft_batch_without_room_names_the_row():
    with pytest.raises(ValueError, match="past its 1 block"):
        DraftBatch.build([3], [3], [[0]], 4)


def dflash_cfg() -> DFlashConfig:
    return DFlashConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=40, rms_norm_eps=1e-6, rope_theta=500.0, vocab_size=50, draft_vocab_size=50,
                        target_hidden_size=32, aux_layer_ids=(1, 2), block_size=4, mask_token_id=49)


@pytest.mark.parametrize("inference", [False, True])
def test_dflash_block_matches_float64_reference(inference):
    with torch.inference_mode(inference):
        dflash_block()


def dflash_block() -> None:
    cfg = dflash_cfg()
    m = DFlashDraft(cfg).to(F64)
    randomize(m, 5)
    P, B, bs = 7, cfg.block_size, 4
    g = torch.Generator().manual_seed(6)
    aux = [torch.randn(P, 32, generator=g, dtype=F64) for _ in cfg.aux_layer_ids]
    anchor = torch.tensor([11])
    caches = torch.full((2, 6, bs, 2, 2, 8), float("nan"), dtype=F64)
    table = [3, 1]
    for a, b in ((0, 5), (5, 7)):                 # the context arrives in two target steps
        ctx = DraftBatch.build([b - a], [a], [table], bs)
        m.write_context([x[a:b] for x in aux], ctx.positions, ctx.slot_mapping, caches)
    block = DraftBatch.build([B], [P], [table], bs, scratch=[[4]], causal=False, write=False)
    out = m(anchor, block, caches)[0]
    # reference: context c, block x; every block row sees all context and all block rows
    c = norm(torch.cat(aux, -1) @ m.fc.weight.T, m.hidden_norm.weight, cfg.rms_norm_eps)
    x = m.embed_tokens.weight[torch.tensor([11, 49, 49, 49])]
    pc, pb = torch.arange(P, dtype=F64), torch.arange(P, P + B, dtype=F64)
    for lay in m.layers:
        a = lay.self_attn
        y = norm(x, lay.input_layernorm.weight, 1e-6)
        q = rot(norm((y @ a.q_proj.weight.T).view(B, 4, 8), a.q_norm.weight, 1e-6), pb, 500.0)
        kk = lambda z, p: rot(norm((z @ a.k_proj.weight.T).view(len(z), 2, 8), a.k_norm.weight, 1e-6), p, 500.0)  # noqa: E731
        k = torch.cat([kk(c, pc), kk(y, pb)])
        v = torch.cat([c @ a.v_proj.weight.T, y @ a.v_proj.weight.T]).view(-1, 2, 8)
        x = x + attention_ref(q, k, v, torch.ones(B, P + B, dtype=torch.bool)).reshape(B, -1) @ a.o_proj.weight.T
        x = x + silu_mlp(lay.mlp, norm(x, lay.post_attention_layernorm.weight, 1e-6))
    ref = norm(x, m.norm.weight, 1e-6)[1:] @ m.lm_head.weight.T
    assert out.shape == (B - 1, 50)
    assert rel_err(out, ref) < 1e-12


@pytest.mark.parametrize("kda", [False, True], ids=["mla", "kda"])
def test_mtp_layer_matches_k3_decoder_block_without_attn_res(kda):
    """An MTP step = eh_proj of the normed inputs, then K3's own decoder layer (run here through the target's
    ``DecoderLayer`` with a plain residual stream) and the shared head; over two chunks through the draft's own
    cache: MLA latents by block, or (layer L in kda_layers) the KDA state and conv window by slot."""
    from kimik3.model.attn_res import ResidualStream
    from kimik3.model.kimi_k3 import DecoderLayer
    from kimik3.model.layers import GLUActivation

    cfg = parse_config(tiny_k3_config(vocab_size=64, vision=False)).text
    L, T, bs = cfg.num_hidden_layers, 6, 4
    if kda:
        cfg = dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, kda_layers=cfg.kda.kda_layers + (L + 1,)))
    mtp = MTPDraft(cfg, 1).to(F64)
    randomize(mtp, 7)
    lay = mtp.layer(0)
    assert lay.is_kda == kda
    plain = dataclasses.replace(cfg, attn_res_block_size=None)
    block = DecoderLayer(plain, L, GLUActivation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta), None).to(F64)
    block.load_state_dict({k: v for k, v in lay.state_dict().items() if not k.startswith(
        ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head"))})
    g = torch.Generator().manual_seed(8)
    ids, h = torch.randint(0, 64, (T,), generator=g), torch.randn(T, cfg.hidden_size, generator=g, dtype=F64)
    pos = torch.arange(T)
    e = lay.embed_tokens.weight[ids] * (pos != 0)[:, None]
    u = torch.cat([norm(e, lay.enorm.weight, cfg.rms_norm_eps), norm(h, lay.hnorm.weight, cfg.rms_norm_eps)], -1)
    u = u @ lay.eh_proj.weight.T
    one = ForwardBatch.build([T], [0], [1], [[1, 2]], bs)
    ref_cache = mtp.allocate_cache(3, 3, bs, F64)
    stream = ResidualStream(u, None, cfg.rms_norm_eps, False)
    block(stream, one, ref_cache, {})
    r_ref = stream.state()
    ref = norm(r_ref, lay.shared_head.norm.weight, cfg.rms_norm_eps) @ lay.shared_head.head.weight.T
    cache = mtp.allocate_cache(3, 4, bs, F64)
    outs = []
    for a, b in ((0, 4), (4, 6)):
        batch = ForwardBatch.build([b - a], [a], [2], [[2, 3]], bs)
        outs.append(mtp(0, ids[a:b], h[a:b], pos[a:b], batch, cache))
    assert rel_err(torch.cat([o[0] for o in outs]), ref) < 1e-10
    assert rel_err(torch.cat([o[1] for o in outs]), r_ref) < 1e-10
    if kda:                       # the state after the six rows, in slot 2 (the reference's in slot 1)
        assert rel_err(cache.kda_state[0, 2], ref_cache.kda_state[0, 1]) < 1e-10
        assert rel_err(cache.kda_conv[0, 2], ref_cache.kda_conv[0, 1]) < 1e-10


def test_mtp_write_leaves_what_forward_leaves():
    """The catch-up's ``write`` (no head, no MoE) leaves the cache as ``forward`` over the same rows: latents of an
    MLA layer, the state and conv window of a KDA layer."""
    base = parse_config(tiny_k3_config(vocab_size=64, vision=False)).text
    L = base.num_hidden_layers
    for cfg in (base, dataclasses.replace(base, kda=dataclasses.replace(base.kda, kda_layers=base.kda.kda_layers + (L + 1,)))):
        mtp = MTPDraft(cfg, 1).to(F64)
        randomize(mtp, 9)
        g = torch.Generator().manual_seed(10)
        ids, h = torch.randint(0, 64, (5,), generator=g), torch.randn(5, cfg.hidden_size, generator=g, dtype=F64)
        caches = [mtp.allocate_cache(2, 3, 4, F64) for _ in range(2)]
        batch = ForwardBatch.build([5], [0], [1], [[1, 2]], 4)
        mtp(0, ids, h, torch.arange(5), batch, caches[0])
        mtp.layer(0).write(ids, h, torch.arange(5), batch.slot_mapping, batch, caches[1])
        for x, y in zip((caches[0].kda_state, caches[0].kda_conv, caches[0].mla_latent),
                        (caches[1].kda_state, caches[1].kda_conv, caches[1].mla_latent)):
            assert torch.equal(x, y)


def _model(config: dict, seed: int) -> KimiForCausalLM:
    m = KimiForCausalLM(parse_config(config))
    random_weights(m, seed)
    return m.to(F64)


@pytest.mark.parametrize("arch", ["kimi_linear", "kimi_k3"])
def test_aux_states_leave_the_output_alone_and_are_the_stream(arch):
    cfg = tiny_kimi_linear_config(vocab_size=64) if arch == "kimi_linear" else tiny_k3_config(vocab_size=64, vision=False)
    m = _model(cfg, 2)
    L, T = m.config.text.num_hidden_layers, 5
    ids = torch.randint(0, 64, (T,), generator=torch.Generator().manual_seed(0))

    def run(model, aux=()):
        cache = model.allocate_cache(2, 2, T)
        return model.forward_step(ids, ForwardBatch.build([T], [0], [1], [[1]], T), cache, aux)

    plain = run(m)
    hidden, aux = run(m, (0, 2, L))
    assert torch.equal(hidden, plain)
    assert torch.equal(aux[0], m.model.embed_tokens(ids))            # layer 0's entry: the embedding
    text = m.config.text
    assert rel_err(norm(aux[2], m.model.norm.weight, text.rms_norm_eps), hidden) < 1e-12   # h_final before the norm
    if arch == "kimi_linear":     # plain stream: the entry of layer 2 is the output of a 2-layer model
        short = dict(cfg, num_hidden_layers=2)
        short["linear_attn_config"] = dict(cfg["linear_attn_config"],
                                           kda_layers=[i for i in cfg["linear_attn_config"]["kda_layers"] if i <= 2])
        s = KimiForCausalLM(parse_config(short)).to(F64)
        s.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("model.layers.")
                           or int(k.split(".")[2]) < 2}, strict=True)
        assert rel_err(run(s, (2,))[1][0], aux[1]) < 1e-12
    with pytest.raises(ValueError, match="outside"):
        run(m, (L + 1,))
