"""Varlen bidirectional attention (kimik3/ops/attention.py) against float64 softmax attention written
from the math, item by item; the CUDA branch (the MLA prefill kernel with its bound past every key)
runs on CPU tensors through Triton's interpreter at tiny sizes."""

import pytest
import torch

from kimik3.ops import attention
from kimik3.ops.attention import varlen_attention
from tests.helpers import LaunchRecorder, rel_errs

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


@pytest.mark.parametrize("split", [False, True], ids=["one_split", "split_k"])
@pytest.mark.parametrize("case", CASES)
def test_kernel_path_matches_the_math(case, split, monkeypatch):
    """bf16 operands, the kernel's tiles (16 rows, 16 keys) smaller than the items; with 64 "SMs" the
    keys of each item are split over programs and merged."""
    from kimik3.ops.triton import mla_prefill
    monkeypatch.setattr(attention, "use_fast_path", lambda t: True)
    monkeypatch.setattr(mla_prefill, "config_for", lambda da, dv: mla_prefill.PrefillConfig(16, 16, 4, 2))
    monkeypatch.setattr(mla_prefill, "_num_sms", lambda device: 64 if split else 1)
    monkeypatch.setattr(mla_prefill, "SPLIT_MIN_TILES", 1)
    merges = []
    kernel = mla_prefill._merge_splits_kernel
    monkeypatch.setattr(mla_prefill, "_merge_splits_kernel", LaunchRecorder(kernel, merges))
    lengths = CASES[case]
    q, k, v, cu = _inputs(lengths, 2, 32, BF16, seed=7)
    out = varlen_attention(q, k, v, cu, max(lengths), 32 ** -0.5)
    ref = attention_from_math(q, k, v, lengths, 32 ** -0.5)
    errs = [e for e, n in zip(rel_errs(out, ref, lengths), lengths) if n]
    assert out.dtype == BF16 and max(errs) < 1e-2, errs
    assert bool(merges) == (split and max(lengths) >= 32)      # two key tiles or more can split


def test_kernel_path_reads_strided_operands(monkeypatch):
    """q, k, v as the slots of one [P, 3, H, dh] projection (the tower's layout), not copies."""
    monkeypatch.setattr(attention, "use_fast_path", lambda t: True)
    lengths = [9, 4]
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(13, 3, 2, 32, generator=g).to(BF16)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 9, 13], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, 9, 0.2)
    assert max(rel_errs(out, attention_from_math(q, k, v, lengths, 0.2), lengths)) < 1e-2


def test_which_operands_take_the_kernel():
    """K3's tower (bf16, head dim 128) does; toy widths and float32 run the reference."""
    assert attention.kernel_takes(BF16, 128) and attention.kernel_takes(torch.float16, 64)
    assert not any([attention.kernel_takes(BF16, 24), attention.kernel_takes(BF16, 72),
                    attention.kernel_takes(torch.float32, 128), attention.kernel_takes(BF16, 16)])


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
