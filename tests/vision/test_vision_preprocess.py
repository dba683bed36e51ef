"""kimik3/vision/preprocess.py against the spec's numbers and independent numpy computations."""

from __future__ import annotations

import base64
import io
import json
import logging
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from kimik3.config import ConfigError
from kimik3.vision.preprocess import (MediaProcessorConfig, TransparentBgConfig, count_image_tokens, load_image,
                                      load_media_processor_config, plan_resize, preprocess_images, preprocess_video)

K3 = MediaProcessorConfig()


# ---------------------------------------------------------------------------------------
# token counts

# spec vision-multimodal §2.2 worked examples / README §6 item 9: W, H, (W', H'), (padW, padH), (gh, gw), N
SPEC_TABLE = [
    (448, 448, (448, 448), (0, 0), (32, 32), 256),
    (896, 896, (896, 896), (0, 0), (64, 64), 1024),
    (640, 480, (640, 480), (4, 24), (36, 46), 414),
    (1024, 768, (1024, 768), (12, 16), (56, 74), 1036),
    (1920, 1080, (1920, 1080), (12, 12), (78, 138), 2691),
    (4000, 3000, (4000, 3000), (4, 24), (216, 286), 15444),
    (8000, 8000, (3586, 3586), (26, 26), (258, 258), 16641),
    (10000, 100, (7168, 71), (0, 13), (6, 512), 768),
    (1861, 7041, (1850, 7002), (26, 26), (502, 134), 16817),
    (100, 100, (100, 100), (12, 12), (8, 8), 16),
    (30, 16, (30, 16), (26, 12), (2, 4), 2),
    (10, 10, (10, 10), (18, 18), (2, 2), 1),
]


@pytest.mark.parametrize("w,h,resized,pad,grid,n", SPEC_TABLE, ids=[f"{r[0]}x{r[1]}" for r in SPEC_TABLE])
def test_spec_token_table(w, h, resized, pad, grid, n):
    plan = plan_resize(w, h, K3)
    assert (plan.width, plan.height) == resized
    assert (plan.pad_width, plan.pad_height) == pad
    assert (plan.grid_h, plan.grid_w) == grid
    assert plan.num_tokens == n == count_image_tokens(w, h)


# Extreme sizes worked by hand from spec §2.2 (p = 14, k = 2, L = 65536, S = 512, f = 28):
#   1x1        s1 = sqrt(65536/1) > 1 -> scale 1; 1x1 pads to 28x28 -> grid 2x2 -> N = 1
#   14x14      same: pads to 28x28 -> N = 1
#   28x56      no pad; grid (4, 2) -> N = 2*1 = 2
#   29x29      pad 27 -> 56x56 -> grid 4x4 -> N = 4
#   1x100000   s3 = 7168/100000 = 0.07168 is the minimum; the short side would be 0.07 px:
#              refused by kimik3 (see test_extreme_aspect_ratio_is_refused)
#   7168x7168  floor patches 512*512 -> s1 = sqrt(1/4) = 0.5 < s2 = 1 -> 3584x3584 = 128*28
#              -> grid 256x256 -> N = 16384
#   20000x300  floors 1428*21 = 29988 -> s1 = 1.478; s2 = 7168/20000 = 0.3584 is the minimum;
#              W' = 7168, H' = trunc(107.52) = 107 -> pad 5 -> 112 -> grid (8, 512) -> N = 4*256 = 1024
#   5000x5000  floors 357*357 = 127449 -> s1 = sqrt(0.514214) = 0.717086 -> W' = trunc(3585.43) = 3585
#              -> 3585 = 128*28 + 1 -> pad 27 -> 3612 -> grid 258x258 -> N = 129*129 = 16641
HAND = [(1, 1, (2, 2), 1), (14, 14, (2, 2), 1), (28, 56, (4, 2), 2), (29, 29, (4, 4), 4),
        (7168, 7168, (256, 256), 16384),
        (20000, 300, (8, 512), 1024), (5000, 5000, (258, 258), 16641)]


@pytest.mark.parametrize("w,h,grid,n", HAND, ids=[f"{r[0]}x{r[1]}" for r in HAND])
def test_extreme_sizes_by_hand(w, h, grid, n):
    plan = plan_resize(w, h, K3)
    assert (plan.grid_h, plan.grid_w) == grid
    assert plan.num_tokens == n
    assert plan.width <= w and plan.height <= h                        # never upscales


def test_max_token_count_is_16817_over_a_search():
    # spec: 16817 is the maximum for the K3 config; probe a band of sizes around the maximiser
    best = max(count_image_tokens(w, h) for w in range(1840, 1880, 3) for h in range(7020, 7060, 3))
    assert best <= 16817


# ---------------------------------------------------------------------------------------
# pixels: independent numpy computations

def _png(arr: np.ndarray, **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG", **save)
    return buf.getvalue()


def _reference_pixels(arr: np.ndarray, mean, std, p=14, f=28, once=False):
    """Spec §2.5-2.7 written out: zero pad bottom/right, D23 rounding per step, explicit patch loop."""
    h, w, _ = arr.shape
    ph, pw = (f - h % f) % f, (f - w % f) % f
    x = np.zeros((h + ph, w + pw, 3), dtype=np.uint8)
    x[:h, :w] = arr
    y = np.empty(x.shape, dtype=np.float32)
    for c in range(3):
        if once:   # float64 throughout, one rounding: NOT the spec's definition
            y[..., c] = ((x[..., c] / 255.0 - mean[c]) / std[c]).astype(np.float32)
            continue
        step1 = (x[..., c].astype(np.float64) / 255.0).astype(np.float32)
        step2 = (step1.astype(np.float64) - mean[c]).astype(np.float32)
        y[..., c] = (step2.astype(np.float64) * (1.0 / std[c])).astype(np.float32)
    gh, gw = y.shape[0] // p, y.shape[1] // p
    out = np.empty((gh * gw, 3, p, p), dtype=np.float32)
    for i in range(gh):
        for j in range(gw):
            for c in range(3):
                out[i * gw + j, c] = y[i * p:(i + 1) * p, j * p:(j + 1) * p, c]
    return out, (1, gh, gw)


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def test_no_resize_rgb_bit_exact():
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)
    arr[0, :, :] = np.arange(70)[:, None] * 3          # cover many byte values deterministically
    out = preprocess_images([_png(arr)])
    ref, grid = _reference_pixels(arr, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert out.grid_thws.tolist() == [list(grid)]
    assert out.pixel_values.dtype.is_floating_point and out.pixel_values.dtype.itemsize == 4
    assert np.array_equal(_bits(out.pixel_values.numpy()), _bits(ref))
    assert out.pixel_values.numpy()[-1, :, -1, -1].tolist() == [-1.0, -1.0, -1.0]   # padding is black


def test_normalisation_follows_d23_rounding_not_float64_once():
    # CLIP-like mean/std make the per-step rounding observable (spec §2.6)
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    idx = np.arange(256).reshape(16, 16)
    arr = np.stack([(idx + 85 * c) % 256 for c in range(3)], axis=-1).astype(np.uint8)   # every byte value
    out = preprocess_images([Image.fromarray(arr)], MediaProcessorConfig(image_mean=mean, image_std=std))
    ref, _ = _reference_pixels(arr, mean, std)
    assert np.array_equal(_bits(out.pixel_values.numpy()), _bits(ref))
    once, _ = _reference_pixels(arr, mean, std, once=True)
    assert not np.array_equal(_bits(ref), _bits(once))  # the two evaluations really differ here


def test_patch_order_row_major_channel_first():
    arr = np.zeros((28, 56, 3), dtype=np.uint8)
    arr[14:28, 28:42, 1] = 255                          # patch row 1, column 2, green only
    arr[0, 13, 2] = 255                                 # patch (0,0), blue, a=0, b=13
    pv = preprocess_images([Image.fromarray(arr)]).pixel_values
    assert pv.shape == (8, 3, 14, 14)
    assert (pv[1 * 4 + 2, 1] == 1.0).all() and (pv[1 * 4 + 2, 0] == -1.0).all()
    assert pv[0, 2, 0, 13] == 1.0 and pv[0, 2, 0, 12] == -1.0


def test_resize_is_pillow_bicubic_to_the_planned_size():
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, (90, 150, 3), dtype=np.uint8)
    cfg = MediaProcessorConfig(in_patch_limit=16)
    # floors 10*6 = 60 -> s1 = sqrt(16/60) = 0.516398 -> W' = trunc(77.46) = 77, H' = trunc(46.48) = 46
    img = Image.fromarray(arr)
    out = preprocess_images([img], cfg)
    expected = np.asarray(img.resize((77, 46), Image.Resampling.BICUBIC))
    ref, grid = _reference_pixels(expected, (0.5,) * 3, (0.5,) * 3)
    assert out.grid_thws.tolist() == [list(grid)] == [[1, 4, 6]]
    assert np.array_equal(_bits(out.pixel_values.numpy()), _bits(ref))
    assert out.sizes == [(150, 90)]


# ---------------------------------------------------------------------------------------
# alpha

def _chessboard(h, w, s=8, white=255, gray=180):
    bg = np.empty((h, w), dtype=np.uint8)
    for y in range(h):
        for x in range(w):
            bg[y, x] = gray if (y // s + x // s) % 2 == 1 else white
    return bg


def _blend(rgba: np.ndarray) -> np.ndarray:
    bg = _chessboard(*rgba.shape[:2]).astype(np.float32)[:, :, None]
    a = rgba[:, :, 3:].astype(np.float32) / np.float32(255)
    return (a * rgba[:, :, :3].astype(np.float32) + (np.float32(1) - a) * bg).astype(np.uint8)


def _pixels_back(pv, grid) -> np.ndarray:
    """Invert normalisation (exact for K3 mean/std) and patchify -> uint8 [H, W, 3]."""
    _, gh, gw = grid
    y = pv.numpy().reshape(gh, gw, 3, 14, 14).transpose(0, 3, 1, 4, 2).reshape(gh * 14, gw * 14, 3)
    return np.rint((y * 0.5 + 0.5) * 255).astype(np.uint8)


def test_alpha_over_chessboard_spec_example_and_whole_image():
    rng = np.random.default_rng(2)
    rgba = rng.integers(0, 256, (30, 40, 4), dtype=np.uint8)
    rgba[0, 0] = (40, 40, 40, 128)                      # white square: spec example -> 147
    rgba[0, 8] = (40, 40, 40, 0)                        # gray square, fully transparent -> 180
    out = preprocess_images([_png(rgba)])
    got = _pixels_back(out.pixel_values, out.grid_thws[0].tolist())
    assert got[0, 0].tolist() == [147, 147, 147]
    assert got[0, 8].tolist() == [180, 180, 180]
    assert np.array_equal(got[:30, :40], _blend(rgba))
    assert (got[30:] == 0).all() and (got[:, 40:] == 0).all()   # the padding is not chessboard


def test_palette_transparency_and_la_modes_composite():
    p = Image.new("P", (20, 12))
    p.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    p.paste(1, (0, 0, 10, 12))
    p.info["transparency"] = 0                          # index 0 (right half) transparent
    got = _pixels_back(*_one(p))
    assert got[0, 0].tolist() == [200, 10, 10]
    assert got[0, 10].tolist() == [180, 180, 180] and got[0, 16].tolist() == [255, 255, 255]
    la = Image.fromarray(np.dstack([np.full((12, 20), 90, np.uint8), np.full((12, 20), 0, np.uint8)]), "LA")
    got = _pixels_back(*_one(la))
    assert np.array_equal(got[:12, :20, 0], _chessboard(12, 20))


def _one(img):
    out = preprocess_images([img])
    return out.pixel_values, out.grid_thws[0].tolist()


def test_chessboard_is_drawn_after_resize():
    clear = np.zeros((100, 100, 4), dtype=np.uint8)     # fully transparent
    cfg = MediaProcessorConfig(in_patch_limit=4)        # floors 7*7 -> s1 = 2/7 -> 28x28
    out = preprocess_images([Image.fromarray(clear, "RGBA")], cfg)
    got = _pixels_back(out.pixel_values, out.grid_thws[0].tolist())
    assert got.shape[:2] == (28, 28)
    assert np.array_equal(got[..., 0], _chessboard(28, 28))
    before = preprocess_images([Image.fromarray(clear, "RGBA")],
                               MediaProcessorConfig(in_patch_limit=4, transparent_bg_fill_stage="before_resize"))
    assert not np.array_equal(_pixels_back(before.pixel_values, [1, 2, 2])[..., 0], _chessboard(28, 28))


# ---------------------------------------------------------------------------------------
# decoding

def test_exif_orientation_is_applied():
    arr = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 10
    exif = Image.Exif()
    exif[0x0112] = 6                                    # stored rotated: display = 90 deg clockwise
    img = load_image(_png(arr, exif=exif))
    assert img.size == (2, 3)
    assert np.array_equal(np.asarray(img), np.rot90(arr, -1))


def test_gif_first_frame_and_webp_and_jpeg():
    red, blue = Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 255))
    buf = io.BytesIO()
    red.save(buf, "GIF", save_all=True, append_images=[blue])
    got = np.asarray(load_image(buf.getvalue()).convert("RGB"))
    assert (got == [255, 0, 0]).all()
    arr = np.random.default_rng(3).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "WEBP", lossless=True)
    assert np.array_equal(np.asarray(load_image(buf.getvalue()).convert("RGB")), arr)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG")
    assert load_image(buf.getvalue()).size == (24, 20)


def test_sources_bytes_data_url_base64_path_agree(tmp_path):
    arr = np.random.default_rng(4).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    data = _png(arr)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    outs = [preprocess_images([s]).pixel_values for s in
            (data, f"data:image/png;base64,{b64}", b64, str(path), path, Image.fromarray(arr))]
    for o in outs[1:]:
        assert np.array_equal(o.numpy(), outs[0].numpy())


def test_paths_can_be_refused(tmp_path):
    path = tmp_path / "x.png"
    path.write_bytes(_png(np.zeros((4, 4, 3), np.uint8)))
    with pytest.raises(ValueError, match=r"file paths are not accepted here"):
        preprocess_images([str(path)], allow_paths=False)
    with pytest.raises(ValueError, match="paths are not accepted"):
        preprocess_images([path], allow_paths=False)


def _chunk(tag: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body) & 0xFFFFFFFF)


def _png_header(w: int, h: int) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + _chunk(b"IEND", b"")


def _bmp() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "BMP")
    return buf.getvalue()


def _truncated_png() -> bytes:
    data = _png(np.random.default_rng(5).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    return data[:len(data) // 2]


BAD = [
    ("corrupt", b"definitely not an image file", "cannot identify an image"),
    ("empty", b"", "empty"),
    ("truncated", _truncated_png(), "truncated PNG"),
    ("bmp", _bmp(), "unsupported image format BMP"),
    ("zero-size-object", Image.new("RGB", (0, 7)), r"zero size \(0x7\)"),
    ("zero-size-header", _png_header(0, 10), "cannot identify an image"),
    ("bomb", _png_header(100000, 100000), "too large to decode safely"),
    ("bad-base64", "data:image/png;base64,@@@@", "invalid base64"),
    ("missing-file", "/nonexistent/dir/img.png", "neither an existing file"),
]


@pytest.mark.parametrize("source,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_images_raise_clear_value_error(source, match):
    with pytest.raises(ValueError, match=match):
        preprocess_images([source])


def test_bad_image_error_names_its_index():
    good = Image.new("RGB", (10, 10))
    with pytest.raises(ValueError, match=r"^image 1: .*cannot identify"):
        preprocess_images([good, b"garbage bytes"])
    with pytest.raises(TypeError, match="got int"):
        preprocess_images([3])


# ---------------------------------------------------------------------------------------
# video chunks

def test_video_frames_share_plan_frame_major_order():
    rng = np.random.default_rng(6)
    frames = [rng.integers(0, 256, (30, 44, 3), dtype=np.uint8) for _ in range(3)]
    out = preprocess_video([Image.fromarray(f) for f in frames])
    assert out.grid_thws.tolist() == [[3, 4, 4]] and out.num_tokens == [4]
    per_frame = [preprocess_images([Image.fromarray(f)]).pixel_values for f in frames]
    assert np.array_equal(out.pixel_values.numpy(), np.concatenate([p.numpy() for p in per_frame]))


def test_video_uses_per_frame_budget_and_caps_frames():
    # 2000x2000 with L = 16384: floors 142*142 = 20164 -> s1 = sqrt(0.812537) = 0.901408 -> 1802
    # -> 1802 = 64*28 + 10 -> pad 18 -> 1820 -> grid 130x130 -> N = 65*65 = 4225
    big = Image.new("RGB", (2000, 2000), (9, 9, 9))
    out = preprocess_video([big, big])
    assert out.grid_thws.tolist() == [[2, 130, 130]] and out.num_tokens == [4225]
    with pytest.raises(ValueError, match="1..4 frames"):
        preprocess_video([Image.new("RGB", (8, 8))] * 5)


# ---------------------------------------------------------------------------------------
# config

RELEASE = {
    "media_proc_cfg": {
        "in_patch_limit": 65536, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 16384, "in_patch_limit_video": 655360, "sample_fps": 8.0,
        "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
        "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                                  "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                                  "chessboard_gray_value": 180},
        "transparent_bg_fill_stage": "after_resize",
        "config_type": "media_proc.processors.moonvit.MoonViTMediaProcessorConfig",
    },
}


def test_config_defaults_equal_release_file(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(RELEASE))
    assert load_media_processor_config(tmp_path) == K3
    assert K3.transparent_bg_config == TransparentBgConfig()


def test_config_missing_file_gives_defaults_and_logs(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kimik3.vision.preprocess"):
        assert load_media_processor_config(tmp_path) == K3
    assert "no preprocessor_config.json" in caplog.text


def test_config_processor_defaults_and_errors(tmp_path):
    cfg = dict(RELEASE["media_proc_cfg"])
    del cfg["transparent_bg_fill_stage"]
    file = tmp_path / "p.json"
    file.write_text(json.dumps({"media_proc_cfg": cfg}))
    assert load_media_processor_config(file).transparent_bg_fill_stage == "before_resize"
    cfg["fixed_output_tokens"] = 64
    file.write_text(json.dumps({"media_proc_cfg": cfg}))
    with pytest.raises(ConfigError, match="fixed_output_tokens must be null"):
        load_media_processor_config(file)
    file.write_text(json.dumps({"media_proc_cfg": {"patch_size": 14}}))
    with pytest.raises(ConfigError, match="missing required key"):
        load_media_processor_config(file)
    file.write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(ConfigError, match="'media_proc_cfg' is required"):
        load_media_processor_config(file)


@pytest.mark.parametrize("w,h", [(1, 100000), (100000, 1), (3, 100000)])
def test_extreme_aspect_ratio_is_refused(w, h):
    # 3 x 100000: scale 0.07168 -> short side 0.215 px (< 1): refused; 100:1 (10000x100) still works
    with pytest.raises(ValueError, match=rf"image {w}x{h} has an extreme aspect ratio"):
        count_image_tokens(w, h)
    assert count_image_tokens(10000, 100) == 768


def test_a_large_data_url_is_costed_from_its_first_bytes(monkeypatch):
    """A large base64 PNG or JPEG data: URL is probed from its first 64 KB of base64 (its header), not decoded whole
    (ten 900 KB PNGs held a server's interpreter ~50 ms a request); the answer is the full probe's; other formats,
    and a header that is not there, take the whole data as before."""
    import base64
    import io

    from PIL import Image

    import kimik3.vision.preprocess as pre

    def url(fmt: str, size) -> str:
        buf = io.BytesIO()
        Image.effect_noise(size, 64).convert("RGB").save(buf, format=fmt)
        return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()

    png, jpeg, gif = url("PNG", (1500, 1100)), url("JPEG", (2400, 1800)), url("GIF", (1200, 900))
    full = {u: pre.probe_image(u, allow_paths=False) for u in (png, jpeg, gif)}
    assert full[png] == (1500, 1100, 1) and full[jpeg] == (2400, 1800, 1) and full[gif] == (1200, 900, 1)
    decoded = []
    whole = pre._bytes_from_string
    monkeypatch.setattr(pre, "_bytes_from_string", lambda *a: decoded.append(1) or whole(*a))
    assert pre.probe_image(png, allow_paths=False) == full[png]
    assert pre.probe_image(jpeg, allow_paths=False) == full[jpeg]
    assert decoded == []
    assert pre.probe_image(gif, allow_paths=False) == full[gif] and decoded == [1]
    cut = png[:png.index(",") + 1] + "iVBORw0KGgo" + "A" * 300_000          # a PNG signature, then no header
    with pytest.raises(ValueError):
        pre.probe_image(cut, allow_paths=False)
    assert decoded == [1, 1]
