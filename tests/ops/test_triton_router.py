"""The routing kernel against the torch reference, on CPU through TRITON_INTERPRET=1."""

import pytest
import torch

pytest.importorskip("triton")

from kimik3.ops.router import route                                     # noqa: E402


@pytest.mark.parametrize("E,k,groups,topk_group,act,renorm,scale", [
    (64, 16, 1, 1, "sigmoid", True, 1.0),          # the K3 shape of the slice model
    (896, 16, 1, 1, "sigmoid", True, 1.0),         # K3 release: 896 experts, top-16
    (32, 4, 4, 2, "sigmoid", True, 2.5),           # grouped top-k
    (24, 3, 1, 1, "softmax", False, 1.0),
    (8, 1, 1, 1, "sigmoid", True, 2.446),           # top-1: no renormalisation
    (256, 8, 1, 1, "sigmoid", True, 2.446),         # Kimi-Linear-48B: 256 experts, top-8, one group
], ids=["slice", "release", "grouped", "softmax", "top1", "kimi_linear"])
def test_route_kernel_matches_reference(E, k, groups, topk_group, act, renorm, scale):
    from kimik3.ops.triton.router import route_triton
    g = torch.Generator().manual_seed(E + k)
    logits = torch.randn(7, E, generator=g) * 3
    bias = torch.randn(E, generator=g) * 0.3
    for b in (bias, None):
        args = (k, act, groups, topk_group, renorm, scale, 1e-20)
        w_ref, i_ref = route(logits, b, *args)
        w, i = route_triton(logits, b, *args)
        assert torch.equal(i, i_ref)
        assert torch.allclose(w, w_ref, rtol=1e-6, atol=1e-7)


def test_kimi_linear_routing_matches_float64():
    """Kimi-Linear's router parameters (sigmoid, 256 experts, top-8, one group, renormalised,
    routed_scaling_factor 2.446) against the math in float64: top-8 of sigmoid + bias, weights
    from the unbiased scores, renormalised, scaled."""
    from kimik3.ops.triton.router import route_triton
    g = torch.Generator().manual_seed(48)
    logits = torch.randn(9, 256, generator=g) * 3
    bias = torch.randn(256, generator=g) * 0.3
    s = torch.sigmoid(logits.double())
    ids64 = torch.argsort(s + bias.double(), dim=-1, descending=True)[:, :8]
    w64 = s.gather(1, ids64)
    w64 = w64 / w64.sum(-1, keepdim=True) * 2.446
    for fn in (route, route_triton):
        w, i = fn(logits, bias, 8, "sigmoid", 1, 1, True, 2.446, 1e-20)
        assert torch.equal(i, ids64)
        assert torch.allclose(w.double(), w64, rtol=1e-6, atol=0)
