"""Varlen bidirectional attention (kimik3/ops/attention.py) against float64 softmax attention written
from the math, item by item. Its CUDA branch, torch's varlen flash kernel, has no CPU form: it is
checked against float64 in tests/gpu/test_encoder_graphs_gpu.py."""

import pytest
import torch

from kimik3.ops import attention
from kimik3.ops.attention import varlen_attention
from tests.helpers import rel_errs

F64, BF16 = torch.float64, torch.bfloat16
# items with one, none, many and a few rows; the last case is a graph's layout: one item, then padding
CASES = {"ragged": [5, 0, 17, 3], "one": [1], "padded": [11, 21], "long": [45, 2, 33]}


def attention_from_math(q, k, v, lengths, scale):
    """o[r] = sum_j softmax_j(scale q[r].k[j]) v[j] over the rows j of r's item, in float64."""
    out, start = torch.zeros(q.shape, dtype=F64), 0
    for n in lengths:
        for h in range(q.shape[1]):
            qi, ki, vi = (z[start:start + n, h].double() for z in (q, k, v))
            out[start:start + n, h] = torch.softmax(qi @ ki.T * scale, dim=-1) @ vi
        start += n
    return out


def _inputs(lengths, H, dh, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    P = sum(lengths)
    q, k, v = (torch.randn(P, H, dh, generator=g, dtype=F64).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_the_math_in_float64(case):
    lengths = CASES[case]
    q, k, v, cu = _inputs(lengths, 3, 8, F64, seed=len(lengths))
    out = varlen_attention(q, k, v, cu, max(lengths), 8 ** -0.5)
    ref = attention_from_math(q, k, v, lengths, 8 ** -0.5)
    assert out.dtype == F64 and max(rel_errs(out, ref, lengths) + [0.0]) < 1e-12


def test_which_operands_take_the_kernel(monkeypatch):
    """Half types on an sm80+ GPU with head dims such as K3's 128 do (capability faked: no GPU here);
    float32, head dims off the multiples of 8 or past 256, older GPUs and the CPU run the reference."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert all(attention.kernel_takes(d, h, cuda) for d, h in ((BF16, 128), (torch.float16, 64), (BF16, 24), (BF16, 256)))
    assert not any([attention.kernel_takes(BF16, 20, cuda), attention.kernel_takes(BF16, 264, cuda),
                    attention.kernel_takes(torch.float32, 128, cuda), attention.kernel_takes(BF16, 128, "cpu")])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 5))
    assert not attention.kernel_takes(BF16, 128, cuda)


def test_bad_inputs_name_what_is_wrong():
    q = torch.zeros(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="one shape"):
        varlen_attention(q, q[:5], q, cu, 6, 1.0)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, q, q, cu.long(), 6, 1.0)
    with pytest.raises(ValueError, match="rise from 0 to the 6 rows"):
        varlen_attention(q, q, q, torch.tensor([0, 5], dtype=torch.int32), 6, 1.0)
    with pytest.raises(ValueError, match="max_len=3"):
        varlen_attention(q, q, q, cu, 3, 1.0)
