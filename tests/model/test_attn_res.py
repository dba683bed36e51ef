"""The block-residual stream (spec text-backbone §2.4): source counts per layer, identities, and the
official vs vLLM-fused rounding of the consuming RMSNorm (README §6 item 5)."""

import math
from types import SimpleNamespace

import torch

from kimik3.model.attn_res import ResidualStream
from kimik3.ops.norm import rms_norm


def layer(D, g):
    w = lambda: 1 + 0.1 * torch.randn(D, generator=g)                      # noqa: E731
    return SimpleNamespace(input_layernorm=SimpleNamespace(weight=w()), post_attention_layernorm=SimpleNamespace(weight=w()),
                           self_attention_res_norm=SimpleNamespace(weight=w()), mlp_res_norm=SimpleNamespace(weight=w()),
                           self_attention_res_proj=SimpleNamespace(weight=torch.randn(1, D, generator=g) / math.sqrt(D)),
                           mlp_res_proj=SimpleNamespace(weight=torch.randn(1, D, generator=g) / math.sqrt(D)))


def test_source_counts_follow_the_block_schedule():
    """Pre-attention: k+1 sources at a boundary (k = i // B), else k+2; pre-MLP: k+2; final: blocks + 1."""
    D, B, L = 16, 3, 8
    g = torch.Generator().manual_seed(0)
    stream = ResidualStream(torch.randn(5, D, dtype=torch.float64, generator=g), B, 1e-5, False)
    lay = layer(D, g)
    for i in range(L):
        stream.attn_input(i, lay)
        k = i // B
        assert len(stream.blocks) + (stream.partial is not None) == (k + 1 if i % B == 0 else k + 2)
        stream.add(torch.randn(5, D, dtype=torch.float64, generator=g))
        assert len(stream.blocks) + 1 == k + 2                         # pre-MLP sources
        stream.add(torch.randn(5, D, dtype=torch.float64, generator=g))
    assert len(stream.blocks) + 1 == math.ceil(L / B) + 1


def test_first_layer_sees_exactly_the_normed_embedding():
    g = torch.Generator().manual_seed(1)
    h0 = torch.randn(4, 32, dtype=torch.float64, generator=g)
    lay = layer(32, g)
    x = ResidualStream(h0, 12, 1e-5, False).attn_input(0, lay)
    assert torch.equal(x, rms_norm(h0, lay.input_layernorm.weight.double(), 1e-5))


def test_fused_norm_switch_is_within_one_bf16_ulp_of_the_official_rounding():
    g = torch.Generator().manual_seed(2)
    D = 256
    lay = layer(D, g)
    outs = []
    for fused in (False, True):
        stream = ResidualStream(torch.randn(64, D, generator=g.manual_seed(3)).bfloat16(), 4, 1e-5, fused)
        stream.attn_input(0, lay)
        stream.add(torch.randn(64, D, generator=g).bfloat16())
        outs.append(stream.mlp_input(lay).float())
    official, fused = outs
    assert not torch.equal(official, fused)                           # the switch does change the rounding
    ulp = torch.finfo(torch.bfloat16).eps * official.abs().clamp_min(2 ** -20)
    assert ((official - fused).abs() <= 2 * ulp + 1e-6).float().mean() > 0.99


def test_plain_stream_adds_an_output_in_two_parts_as_their_sum():
    """The plain pre-norm stream (Kimi-Linear) given a MoE layer's routed and shared outputs apart: the next
    norm's input and the final residual are x + (routed + shared) in bf16, the same bits as the sum added
    whole; the block stream sums the two parts first as well."""
    g = torch.Generator().manual_seed(4)
    D = 64
    lay = layer(D, g)
    h0 = torch.randn(6, D, generator=g).bfloat16()
    a, routed, shared = (torch.randn(6, D, generator=g).bfloat16() for _ in range(3))
    for block in (None, 4):
        got, want = ResidualStream(h0, block, 1e-5, False), ResidualStream(h0, block, 1e-5, False)
        for stream, parts in ((got, (routed, shared)), (want, (routed + shared,))):
            stream.attn_input(0, lay)
            stream.add(a)
            stream.mlp_input(lay)
            stream.add(*parts)
        assert torch.equal(got.attn_input(1, lay), want.attn_input(1, lay))
        got.add(a)
        want.add(a)
        assert torch.equal(got.mlp_input(lay), want.mlp_input(lay))
        got.add(routed, shared)
        want.add(routed + shared)
        final = {} if block is None else dict(res_norm_weight=lay.mlp_res_norm.weight,
                                              res_proj_weight=lay.mlp_res_proj.weight)
        w = lay.input_layernorm.weight
        assert torch.equal(got.output(w, **final), want.output(w, **final))


def test_plain_stream_output_is_the_final_norm_of_the_residual():
    """The plain stream's output (the last layer's add fused into the final norm) against the residual
    sum and the RMSNorm written out in float64."""
    g = torch.Generator().manual_seed(5)
    D, eps = 48, 1e-6
    h0, a, routed, shared = (torch.randn(3, D, generator=g, dtype=torch.float64) for _ in range(4))
    w = torch.rand(D, generator=g, dtype=torch.float64) + 0.5
    lay = layer(D, g)
    lay.post_attention_layernorm.weight = torch.ones(D, dtype=torch.float64)
    stream = ResidualStream(h0, None, eps, False)
    stream.add(a)
    stream.mlp_input(lay)              # a is added here, in the post-attention norm
    stream.add(routed, shared)         # pending until the final norm
    h = h0 + a + (routed + shared)
    want = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps) * w
    torch.testing.assert_close(stream.output(w), want, rtol=1e-12, atol=1e-12)
