"""kimik3/model/vision.py against an independent float64 numpy transcription of spec §3."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kimik3.config import VisionConfig, load_config
from kimik3.model.vision import (KimiVisionModel, VisionRMSNorm, rope_2d, sincos_time_table,
                                 tokens_per_item, tpool_merge)
from kimik3.ops.rope import rotate_pairs

TINY = VisionConfig(patch_size=14, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, qkv_hidden_size=48,
                    intermediate_size=64, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=4,
                    merge_kernel_size=(2, 2), pos_emb_interpolation_mode="bilinear", projector_ln_eps=1e-5,
                    text_hidden_size=40)
EPS = 1.1920929e-07


def _model(dtype=torch.float64, seed=0) -> KimiVisionModel:
    torch.manual_seed(seed)
    m = KimiVisionModel(TINY, dtype=dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm0.weight") or name.endswith("norm1.weight") or "layernorm" in name \
                    or "post_norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("pos_emb.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn_like(p) * 1.5 / math.sqrt(fan_in))
    return m


def _pixels(grids, seed=1) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, 14, 14, generator=g) * 2 - 1).to(torch.float32)   # float32 numbers, as preprocessed


# ---------------------------------------------------------------------------------------
# float64 reference, written from the spec text (no kimik3 code)

_erf = np.vectorize(math.erf)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _axis(r, n):
    src = np.clip((np.arange(n) + 0.5) * (r / n) - 0.5, 0, r - 1)
    i0 = np.floor(src).astype(int)
    return i0, np.minimum(i0 + 1, r - 1), src - i0


def _pos2d(e, h, w):
    rh, rw, d = e.shape
    if (h, w) == (rh, rw):
        return e.reshape(-1, d)
    y0, y1, ly = _axis(rh, h)
    x0, x1, lx = _axis(rw, w)
    ly, lx = ly[:, None, None], lx[None, :, None]
    out = ((1 - ly) * (1 - lx) * e[y0][:, x0] + (1 - ly) * lx * e[y0][:, x1]
           + ly * (1 - lx) * e[y1][:, x0] + ly * lx * e[y1][:, x1])
    return out.reshape(h * w, d)


def _time_row(tau, d):
    om = 10000.0 ** (-np.arange(d // 2) / (d / 2))
    return np.concatenate([np.sin(tau * om), np.cos(tau * om)]).astype(np.float32).astype(np.float64)


def _angles(h, w, dh):
    f = 10000.0 ** (-4 * np.arange(dh // 4) / dh)
    out = np.empty((h * w, dh // 2))
    for y in range(h):
        for x in range(w):
            out[y * w + x, 0::2] = x * f        # even pairs: column
            out[y * w + x, 1::2] = y * f        # odd pairs: row
    return out


def _rotate(q, ang):                             # q [L, H, dh], ang [L, dh/2]
    a, b = q[..., 0::2], q[..., 1::2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty_like(q)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def reference(sd: dict, pixel_values: torch.Tensor, grids) -> np.ndarray:
    W = {k: v.detach().double().numpy() for k, v in sd.items()}
    t_ = "vision_tower."
    D, H = TINY.hidden_size, TINY.num_attention_heads
    dh = TINY.qkv_hidden_size // H
    pv = pixel_values.double().numpy()
    x = pv.reshape(len(pv), -1) @ W[t_ + "patch_embed.proj.weight"].reshape(D, -1).T
    pos, ang = [], []
    for t, h, w in grids:
        p2 = _pos2d(W[t_ + "patch_embed.pos_emb.weight"], h, w)
        pos += [p2 + (_time_row(tau, D) if t > 1 else 0) for tau in range(t)]
        ang += [_angles(h, w, dh)] * t
    x = x + np.concatenate(pos)
    ang = np.concatenate(ang)
    for i in range(TINY.num_hidden_layers):
        b = f"{t_}encoder.blocks.{i}."
        u = _rms(x, W[b + "norm0.weight"], EPS)
        qkv = (u @ W[b + "wqkv.weight"].T).reshape(len(x), 3, H, dh)
        q, k, v = _rotate(qkv[:, 0], ang), _rotate(qkv[:, 1], ang), qkv[:, 2]
        att = np.empty((len(x), H, dh))
        start = 0
        for t, h, w in grids:
            sl = slice(start, start + t * h * w)
            for hd in range(H):
                s = q[sl, hd] @ k[sl, hd].T / math.sqrt(dh)
                p = np.exp(s - s.max(-1, keepdims=True))
                att[sl, hd] = (p / p.sum(-1, keepdims=True)) @ v[sl, hd]
            start += t * h * w
        x = x + att.reshape(len(x), H * dh) @ W[b + "wo.weight"].T
        u = _rms(x, W[b + "norm1.weight"], EPS)
        z = u @ W[b + "mlp.fc0.weight"].T
        z = 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
        x = x + z @ W[b + "mlp.fc1.weight"].T
    x = _rms(x, W[t_ + "encoder.final_layernorm.weight"], EPS)
    rows, start = [], 0
    for t, h, w in grids:
        frames = x[start:start + t * h * w].reshape(t, h * w, D)
        for r in range(h // 2):
            for c in range(w // 2):
                rows.append(np.concatenate([frames[:, (2 * r + a) * w + 2 * c + bb].mean(0)
                                            for a in (0, 1) for bb in (0, 1)]))
        start += t * h * w
    z = np.stack(rows) @ W["mm_projector.proj.0.weight"].T
    z = 0.5 * z * (1 + _erf(z / math.sqrt(2)))
    z = z @ W["mm_projector.proj.2.weight"].T
    return _rms(z, W["mm_projector.post_norm.weight"], TINY.projector_ln_eps)


# ---------------------------------------------------------------------------------------

def test_images_match_float64_reference():
    grids = [(1, 4, 4), (1, 2, 6), (1, 6, 2)]     # table size (no resample), then resampled both ways
    m = _model()
    pv = _pixels(grids)
    out = m.encode_images(pv, torch.tensor(grids))
    ref = reference(m.state_dict(), pv, grids)
    assert out.shape == (4 + 3 + 3, TINY.text_hidden_size) and out.dtype == torch.float64
    assert np.abs(out.numpy() - ref).max() < 1e-10


def test_video_items_match_float64_reference():
    grids = [(3, 4, 2), (1, 2, 2), (4, 2, 4)]
    m = _model(seed=2)
    pv = _pixels(grids, seed=3)
    out = m.encode_images(pv, torch.tensor(grids))
    ref = reference(m.state_dict(), pv, grids)
    assert out.shape[0] == 2 + 1 + 2 == sum(tokens_per_item(torch.tensor(grids)))
    # the time table is float32 (official); the reference rounds its float64 sin/cos once
    assert np.abs(out.numpy() - ref).max() < 1e-7


def test_time_embedding_only_for_video():
    m = _model(seed=4)
    one = _pixels([(1, 2, 2)], seed=5)
    two = torch.cat([one, one])
    a = m.encode_images(one, torch.tensor([[1, 2, 2]]))
    b = m.encode_images(two, torch.tensor([[2, 2, 2]]))
    assert a.shape == b.shape == (1, TINY.text_hidden_size)
    assert (a - b).abs().max() > 1e-3                  # identical frames differ only by the time rows


def test_time_table_values():
    t = sincos_time_table(4, 32)
    assert t.dtype == torch.float32 and t.shape == (4, 32)
    assert t[0].tolist() == [0.0] * 16 + [1.0] * 16
    tau = np.arange(4)[:, None]
    om = 10000.0 ** (-np.arange(16) / 16)
    ref = np.concatenate([np.sin(tau * om), np.cos(tau * om)], 1)
    assert np.abs(t.numpy() - ref).max() < 5e-7


def test_batch_equals_each_item_alone():
    grids = [(1, 4, 4), (2, 2, 6), (1, 6, 4)]
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        m = _model(dtype, seed=6)
        pv = _pixels(grids, seed=7)
        batch = m.encode_images(pv, torch.tensor(grids))
        alone, start = [], 0
        for g in grids:
            n = g[0] * g[1] * g[2]
            alone.append(m.encode_images(pv[start:start + n], torch.tensor([g])))
            start += n
        assert (batch - torch.cat(alone)).abs().max() < tol, dtype


def test_bf16_tower_tracks_float64():
    grids = [(1, 4, 4), (1, 2, 6)]
    m64, m16 = _model(), _model()
    m16.to(torch.bfloat16)
    pv = _pixels(grids, seed=8)
    a = m64.encode_images(pv, torch.tensor(grids))
    b = m16.encode_images(pv, torch.tensor(grids))
    assert b.dtype == torch.bfloat16
    rel = (b.double() - a).norm() / a.norm()
    assert rel < 0.05


# ---------------------------------------------------------------------------------------
# pieces

def test_rope_layout_x_in_even_pairs():
    dh = 24
    cos, sin = rope_2d(3, 5, dh, torch.float64)
    f = [10000.0 ** (-4 * j / dh) for j in range(dh // 4)]
    n = 2 * 5 + 3                                           # row y = 2, column x = 3
    for j in range(dh // 4):
        assert cos[n, 2 * j].item() == pytest.approx(math.cos(3 * f[j]), abs=1e-15)
        assert cos[n, 2 * j + 1].item() == pytest.approx(math.cos(2 * f[j]), abs=1e-15)
        assert sin[n, 2 * j].item() == pytest.approx(math.sin(3 * f[j]), abs=1e-15)
    q = torch.zeros(15, 1, dh, dtype=torch.float64)
    q[:, 0, 2] = 1.0                                        # dims 2,3 = pair 1 -> row angle y*f_0
    out = rotate_pairs(q, cos, sin)
    assert out[n, 0, 2].item() == pytest.approx(math.cos(2.0)) and out[n, 0, 3].item() == pytest.approx(math.sin(2.0))
    assert out[n, 0, [0, 1]].abs().max() == 0


def test_merge_order_tl_tr_bl_br_and_temporal_mean():
    x = torch.arange(2 * 16, dtype=torch.float64).reshape(32, 1)      # D = 1, value = patch index
    out = tpool_merge(x, [(2, 4, 4)], (2, 2))
    # frame 0 patches 0..15, frame 1 = 16..31 -> mean adds 8
    assert out.tolist() == [[8, 9, 12, 13], [10, 11, 14, 15], [16, 17, 20, 21], [18, 19, 22, 23]]


def test_rmsnorm_eps_is_a_model_constant_and_bf16_rounds_once():
    norm = VisionRMSNorm(8, EPS, dtype=torch.float64)
    x = torch.full((1, 8), 1e-4, dtype=torch.float64)
    assert norm(x)[0, 0].item() == pytest.approx(1e-4 / math.sqrt(1e-8 + EPS), rel=1e-12)
    g = torch.Generator().manual_seed(0)
    norm16 = VisionRMSNorm(256, EPS, dtype=torch.bfloat16)
    with torch.no_grad():
        norm16.weight.copy_(1 + torch.randn(256, generator=g))
    x16 = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    xf = x16.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    once = (normed * norm16.weight.float()).to(torch.bfloat16)
    twice = normed.to(torch.bfloat16) * norm16.weight
    assert torch.equal(norm16(x16), once)
    assert not torch.equal(once, twice)


def test_state_dict_names_equal_checkpoint_names():
    m = _model()
    expected = {"vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
                "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight",
                "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"}
    for i in range(2):
        expected |= {f"vision_tower.encoder.blocks.{i}.{n}.weight" for n in
                     ("norm0", "wqkv", "wo", "norm1", "mlp.fc0", "mlp.fc1")}
    assert set(m.state_dict()) == expected
    assert set(m.vision_tower.state_dict()) == {k[len("vision_tower."):] for k in expected
                                                if k.startswith("vision_tower.")}


def test_k3_shapes_match_spec_table():
    cfg = load_config(Path(__file__).resolve().parents[1] / "data" / "kimi-k3-release.config.json").vision
    with torch.device("meta"):
        m = KimiVisionModel(cfg, dtype=torch.bfloat16)
    shapes = {k: list(v.shape) for k, v in m.state_dict().items()}
    assert shapes["vision_tower.patch_embed.proj.weight"] == [1024, 3, 14, 14]
    assert shapes["vision_tower.patch_embed.pos_emb.weight"] == [64, 64, 1024]
    assert shapes["vision_tower.encoder.blocks.26.wqkv.weight"] == [4608, 1024]
    assert shapes["vision_tower.encoder.blocks.26.wo.weight"] == [1024, 1536]
    assert shapes["vision_tower.encoder.blocks.0.mlp.fc0.weight"] == [4096, 1024]
    assert shapes["mm_projector.proj.0.weight"] == [4096, 4096]
    assert shapes["mm_projector.proj.2.weight"] == [7168, 4096]
    assert shapes["mm_projector.post_norm.weight"] == [7168]
    assert len(shapes) == 2 + 27 * 6 + 1 + 3


BAD_INPUTS = [
    ("count", (10, 14), [[1, 2, 2]], "describes 4 patches but pixel_values has 10"),
    ("odd-grid", (6, 14), [[1, 2, 3]], "multiples of the merge kernel"),
    ("too-many-frames", (20, 14), [[5, 2, 2]], r"t=5 frames, the tower takes 1..4"),
    ("patch-size", (4, 16), [[1, 2, 2]], r"pixel_values must be \[P, 3, 14, 14\]"),
    ("float-grid", (4, 14), [[1.0, 2.0, 2.0]], "integer"),
]


@pytest.mark.parametrize("pv_shape,grid,match", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs(pv_shape, grid, match):
    m = _model()
    n, p = pv_shape
    with pytest.raises(ValueError, match=match):
        m.encode_images(torch.zeros(n, 3, p, p), torch.tensor(grid))
