"""Image preprocessing for MoonViT (spec vision-multimodal §1.3, §2).

One image goes: decode (PNG / JPEG / WebP / GIF first frame, EXIF orientation applied, mode kept)
-> resize plan (patch budget, per-side cap, never upscale) -> Pillow bicubic resize in the original
mode -> alpha composited onto a chessboard (after the resize by default) -> zero pad bottom/right to
a multiple of patch*merge -> normalise with the float32 rounding steps of D23 -> patchify.

Outputs use the tower's layout: ``pixel_values`` [P, 3, p, p] float32 with P = sum_i t_i*gh_i*gw_i
(items in order, patches row-major, frame-major for t > 1) and ``grid_thws`` [n_items, 3] int64
rows (t, gh, gw). Item i becomes (gh_i/2)*(gw_i/2) image tokens.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import logging
import math
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from kimik3.config import ConfigError

logger = logging.getLogger(__name__)

ImageSource = Union[Image.Image, bytes, bytearray, memoryview, str, Path]

# JPEG files written by phones often open as MPO (JPEG + extra frames); treat them as JPEG.
_ACCEPTED_FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "MPO": "JPEG", "WEBP": "WebP", "GIF": "GIF"}
_EXIF_ORIENTATION = 0x0112
_BG_PATTERNS = ("chessboard", "white", "black", "gray")
_FILL_STAGES = ("before_resize", "after_resize")
_TIMESTAMP_MODES = ("hh:mm:ss.fff", "mm:ss.fff", "mm:ss")    # the video prompt's time formats (vision/video.py)
# Largest image decoded (width x height of its first frame): its pixels are held in memory, in the
# file's mode, before the resize. 50 MP covers 8K photos; larger files are refused from the header.
MAX_DECODE_PIXELS = 50_000_000


# ---------------------------------------------------------------------------------------
# configuration

@dataclass(frozen=True)
class TransparentBgConfig:
    """Background that transparent pixels are composited onto (spec §2.4)."""

    pattern: str = "chessboard"
    chessboard_square_size: int = 8
    chessboard_square_on_top_left: bool = True   # top-left square is white
    chessboard_white_value: int = 255
    chessboard_gray_value: int = 180

    def __post_init__(self) -> None:
        if self.pattern not in _BG_PATTERNS:
            raise ConfigError(f"transparent_bg_config.pattern must be one of {_BG_PATTERNS}, got {self.pattern!r}")
        if self.chessboard_square_size < 1:
            raise ConfigError(
                f"transparent_bg_config.chessboard_square_size must be >= 1, got {self.chessboard_square_size}")
        for name in ("chessboard_white_value", "chessboard_gray_value"):
            if not 0 <= getattr(self, name) <= 255:
                raise ConfigError(f"transparent_bg_config.{name} must lie in 0..255, got {getattr(self, name)}")


@dataclass(frozen=True)
class MediaProcessorConfig:
    """``media_proc_cfg`` of the checkpoint's ``preprocessor_config.json``; defaults = K3 release."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536              # patch budget before padding (floor patches)
    patch_limit_on_one_side: int = 512       # max patches per side
    fixed_output_tokens: int | None = None   # only None is supported (see __post_init__)
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    transparent_bg_config: TransparentBgConfig | None = field(default_factory=TransparentBgConfig)
    transparent_bg_fill_stage: str = "after_resize"
    # video keys (D16): sampling, chunks, budgets and timestamps of kimik3/vision/video.py
    in_patch_limit_each_frame: int = 16384
    sample_fps: float = 8.0
    temporal_merge_kernel_size: int = 4      # frames per video chunk (one tower item)
    in_patch_limit_video: int = 655360
    max_num_frames_each_video: int | None = None
    timestamp_mode: str = "hh:mm:ss.fff"

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                     "in_patch_limit_each_frame", "temporal_merge_kernel_size", "in_patch_limit_video"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"media_proc_cfg.{name} must be a positive integer, got {value!r}")
        if self.fixed_output_tokens is not None:
            # The tower always emits (gh/2)*(gw/2) rows; a forced count would desynchronise
            # the prompt's pad tokens from the encoder output.
            raise ConfigError("media_proc_cfg.fixed_output_tokens must be null: kimik3 derives the token "
                              f"count from the grid, got {self.fixed_output_tokens!r}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if len(value) != 3:
                raise ConfigError(f"media_proc_cfg.{name} needs 3 values (R, G, B), got {list(value)}")
        if any(s == 0 for s in self.image_std):
            raise ConfigError(f"media_proc_cfg.image_std must be non-zero, got {list(self.image_std)}")
        if self.timestamp_mode not in _TIMESTAMP_MODES:
            raise ConfigError(f"media_proc_cfg.timestamp_mode must be one of {_TIMESTAMP_MODES}, "
                              f"got {self.timestamp_mode!r}")
        if isinstance(self.sample_fps, bool) or not isinstance(self.sample_fps, (int, float)) or not self.sample_fps > 0:
            raise ConfigError(f"media_proc_cfg.sample_fps must be a positive number, got {self.sample_fps!r}")
        frames = self.max_num_frames_each_video
        if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
            raise ConfigError(f"media_proc_cfg.max_num_frames_each_video must be null or a positive integer, "
                              f"got {frames!r}")
        if self.transparent_bg_fill_stage not in _FILL_STAGES:
            raise ConfigError(f"media_proc_cfg.transparent_bg_fill_stage must be one of {_FILL_STAGES}, "
                              f"got {self.transparent_bg_fill_stage!r}")

    @property
    def merge_factor(self) -> int:
        """Side of one output token in pixels (K3: 28)."""
        return self.patch_size * self.merge_kernel_size


_REQUIRED_KEYS = ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                  "fixed_output_tokens", "image_mean", "image_std")
_OPTIONAL_KEYS = ("in_patch_limit_each_frame", "sample_fps", "temporal_merge_kernel_size",
                  "in_patch_limit_video", "max_num_frames_each_video", "timestamp_mode")


def parse_media_processor_config(data: dict[str, Any], source: str = "preprocessor_config.json"
                                 ) -> MediaProcessorConfig:
    """Build the config from a ``media_proc_cfg`` object.

    Keys the official processor indexes directly are required. When the file omits
    ``transparent_bg_config`` there is no compositing (plain RGB conversion) and an omitted
    ``transparent_bg_fill_stage`` means ``before_resize``: both are the processor's own defaults.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: media_proc_cfg must be a JSON object, got {type(data).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in data]
    if missing:
        raise ConfigError(f"{source}: media_proc_cfg is missing required key(s) {missing}")
    kw: dict[str, Any] = {k: data[k] for k in _REQUIRED_KEYS}
    merge = kw["merge_kernel_size"]
    if isinstance(merge, list):
        if not merge or any(m != merge[0] for m in merge):
            raise ConfigError(f"{source}: media_proc_cfg.merge_kernel_size must be square, got {merge}")
        kw["merge_kernel_size"] = merge[0]
    kw["image_mean"] = tuple(float(v) for v in kw["image_mean"])
    kw["image_std"] = tuple(float(v) for v in kw["image_std"])
    for key in _OPTIONAL_KEYS:
        if key in data:
            kw[key] = data[key]
    bg = data.get("transparent_bg_config")
    if bg is None:
        kw["transparent_bg_config"] = None
    else:
        names = [f.name for f in dataclasses.fields(TransparentBgConfig)]
        absent = [n for n in names if n not in bg]
        if absent:
            raise ConfigError(f"{source}: media_proc_cfg.transparent_bg_config is missing {absent}")
        kw["transparent_bg_config"] = TransparentBgConfig(**{n: bg[n] for n in names})
    kw["transparent_bg_fill_stage"] = data.get("transparent_bg_fill_stage", "before_resize")
    known = set(_REQUIRED_KEYS) | set(_OPTIONAL_KEYS) | {"transparent_bg_config", "transparent_bg_fill_stage",
                                                        "config_type"}
    for key in sorted(set(data) - known):
        logger.info("%s: ignoring unknown media_proc_cfg key '%s'", source, key)
    return MediaProcessorConfig(**kw)


def load_media_processor_config(path: str | Path | None) -> MediaProcessorConfig:
    """Read ``preprocessor_config.json`` from a checkpoint directory (or the file itself).

    A missing file gives the K3 release defaults (logged); a present but malformed file raises
    ``ConfigError``.
    """
    if path is None:
        logger.info("no checkpoint given: using the Kimi-K3 release media_proc_cfg defaults")
        return MediaProcessorConfig()
    path = Path(path)
    file = path / "preprocessor_config.json" if path.is_dir() else path
    if not file.is_file():
        logger.warning("no preprocessor_config.json at %s: using the Kimi-K3 release media_proc_cfg defaults", file)
        return MediaProcessorConfig()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or "media_proc_cfg" not in data:
        raise ConfigError(f"{file}: key 'media_proc_cfg' is required but missing")
    return parse_media_processor_config(data["media_proc_cfg"], str(file))


# ---------------------------------------------------------------------------------------
# decoding

def load_image(source: ImageSource, *, allow_paths: bool = True) -> Image.Image:
    """Decode one image, keeping its mode (alpha and palette survive until after the resize).

    ``source``: a PIL image, raw bytes, a ``data:`` URL, a base64 string, or a file path
    (``allow_paths=False`` refuses paths: a server must not read local files named by clients).
    Only the first frame of animated files is used; EXIF orientation is applied.
    Raises ``ValueError`` naming the problem for anything that is not a usable image.
    """
    if isinstance(source, Image.Image):
        img = source
        what = "PIL image"
    elif isinstance(source, (bytes, bytearray, memoryview)):
        img = _decode(bytes(source), "image bytes")
        what = "image bytes"
    elif isinstance(source, Path):
        if not allow_paths:
            raise ValueError("image file paths are not accepted here; send the bytes or a data: URL")
        img = _decode(_read_file(source), f"image file {source}")
        what = f"image file {source}"
    elif isinstance(source, str):
        data, what = _bytes_from_string(source, allow_paths)
        img = _decode(data, what)
    else:
        raise TypeError(f"image must be a PIL image, bytes, a data: URL, base64 text or a file path, "
                        f"got {type(source).__name__}")
    w, h = img.size
    if w < 1 or h < 1:
        raise ValueError(f"{what} has zero size ({w}x{h}); an image needs at least 1x1 pixels")
    if img.getexif().get(_EXIF_ORIENTATION, 1) in range(2, 9):
        img = ImageOps.exif_transpose(img)
    return img


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"image file not found: {path}") from None
    except OSError as e:
        raise ValueError(f"cannot read image file {path}: {e}") from None


def _bytes_from_string(text: str, allow_paths: bool) -> tuple[bytes, str]:
    if text.startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep:
            raise ValueError("malformed data: URL (no ',' separating the header from the data)")
        if header.endswith(";base64"):
            return _b64decode(payload, "data: URL"), "data: URL image"
        return urllib.parse.unquote_to_bytes(payload), "data: URL image"
    if allow_paths and len(text) < 4096 and Path(text).is_file():
        return _read_file(Path(text)), f"image file {text}"
    try:
        return _b64decode(text, "base64 image"), "base64 image"
    except ValueError:
        kinds = "an existing file, a data: URL, nor base64 data" if allow_paths else \
            "a data: URL nor base64 data (file paths are not accepted here)"
        raise ValueError(f"image string is neither {kinds} (starts with {text[:40]!r})") from None


def _b64decode(payload: str, what: str) -> bytes:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{what}: invalid base64 payload ({e})") from None


def probe_image(source: ImageSource, *, allow_paths: bool = True) -> tuple[int, int, int]:
    """(width, height, frames) of an image from its header alone (no pixel is decoded); ValueError like
    ``load_image`` for what is not a usable image, or one above ``MAX_DECODE_PIXELS``."""
    if isinstance(source, Image.Image):
        return source.width, source.height, getattr(source, "n_frames", 1)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data, what = bytes(source), "image bytes"
    elif isinstance(source, Path):
        if not allow_paths:
            raise ValueError("image file paths are not accepted here; send the bytes or a data: URL")
        data, what = _read_file(source), f"image file {source}"
    elif isinstance(source, str):
        head = _header_of_data_url(source)
        if head is not None:
            return head
        data, what = _bytes_from_string(source, allow_paths)
    else:
        raise TypeError(f"image must be a PIL image, bytes, a data: URL, base64 text or a file path, "
                        f"got {type(source).__name__}")
    img = _open(data, what)
    return img.width, img.height, getattr(img, "n_frames", 1)


_PROBE_CHARS = 1 << 16      # base64 characters decoded to read a large data: URL's PNG or JPEG header


def _header_of_data_url(text: str) -> tuple[int, int, int] | None:
    """(width, height, frames) of a large base64 PNG or JPEG ``data:`` URL from its first ``_PROBE_CHARS``
    characters alone (the header; the 900 KB of a 50-megapixel PNG took ~5 ms of held interpreter to decode and
    split, ten of them a request); None when that does not tell (another format, a header further in, a size
    over the limit: the whole is then decoded and checked as before)."""
    comma = text.find(",", 0, 256) if len(text) > 4 * _PROBE_CHARS and text.startswith("data:") else -1
    if comma < 0 or not text[:comma].endswith(";base64"):
        return None
    head = "".join(text[comma + 1:comma + 1 + _PROBE_CHARS].split())
    try:
        data = base64.b64decode(head[:len(head) // 4 * 4], validate=True)
        if not data.startswith((b"\x89PNG\r\n\x1a\n", b"\xff\xd8")):
            return None
        img = _open(data, "data: URL image")
        return img.width, img.height, getattr(img, "n_frames", 1)
    except (binascii.Error, ValueError, OSError, EOFError):
        return None


def image_token_counts(images: Sequence[ImageSource], cfg: MediaProcessorConfig | None = None, *,
                       allow_paths: bool = True) -> list[int]:
    """``<|media_pad|>`` tokens per image, from the headers (the cost of a request before any decoding)."""
    cfg = cfg or MediaProcessorConfig()
    out = []
    for idx, source in enumerate(images):
        try:
            w, h, _ = probe_image(source, allow_paths=allow_paths)
            out.append(plan_resize(w, h, cfg).num_tokens)
        except ValueError as e:
            raise ValueError(f"image {idx}: {e}") from None
    return out


def _open(data: bytes, what: str) -> Image.Image:
    """The lazily opened image (header parsed, no pixels), checked for format and size."""
    if not data:
        raise ValueError(f"{what} is empty (0 bytes)")
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ValueError(f"{what} is too large to decode safely: {e}") from None
    except UnidentifiedImageError:
        raise ValueError(f"{what}: cannot identify an image (corrupt data or not PNG, JPEG, WebP or GIF)") from None
    except Exception as e:  # Pillow raises many exception types on malformed headers
        raise ValueError(f"{what}: corrupt image header ({type(e).__name__}: {e})") from None
    fmt = img.format
    if fmt not in _ACCEPTED_FORMATS:
        raise ValueError(f"{what}: unsupported image format {fmt}; accepted formats are PNG, JPEG, WebP and GIF")
    w, h = img.size
    if w * h > MAX_DECODE_PIXELS:
        raise ValueError(f"{what} is {w}x{h} = {w * h} pixels, more than the {MAX_DECODE_PIXELS} decoded here "
                         f"(the model sees it scaled down anyway); downscale it before sending")
    return img


def _decode(data: bytes, what: str) -> Image.Image:
    img = _open(data, what)
    fmt = img.format
    try:
        img.seek(0)
        img.load()
    except Exception as e:
        raise ValueError(f"{what}: corrupt or truncated {_ACCEPTED_FORMATS[fmt]} data "
                         f"({type(e).__name__}: {e})") from None
    return img


# ---------------------------------------------------------------------------------------
# resize plan

@dataclass(frozen=True)
class ResizePlan:
    """Where an image of ``width`` x ``height`` pixels ends up (spec §2.2)."""

    width: int        # W' after resize
    height: int       # H'
    pad_width: int    # zero columns added on the right
    pad_height: int   # zero rows added at the bottom
    grid_h: int       # patches per column, (H' + pad_height) / p
    grid_w: int       # patches per row
    num_tokens: int   # (grid_h / k) * (grid_w / k)


def plan_resize(width: int, height: int, cfg: MediaProcessorConfig, *,
                patch_limit: int | None = None) -> ResizePlan:
    """Resize plan for an image of ``width`` x ``height`` pixels; ``patch_limit`` overrides
    ``cfg.in_patch_limit`` (video frames use ``in_patch_limit_each_frame``)."""
    if width < 1 or height < 1:
        raise ValueError(f"image has zero size ({width}x{height})")
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    limit = cfg.in_patch_limit if patch_limit is None else patch_limit
    s1 = math.sqrt(limit / (max(1, width // p) * max(1, height // p)))
    scale = min(1.0, s1, side * p / width, side * p / height)
    if width * scale < 1 or height * scale < 1:
        # Deliberate departure from the official processor, which clamps the side to one pixel:
        # such an image carries no visible content, so the request is refused with a reason.
        raise ValueError(f"image {width}x{height} has an extreme aspect ratio: fitting it into "
                         f"{side}x{side} patches would shrink its short side below one pixel")
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    f = cfg.merge_factor
    pad_w, pad_h = (f - new_w % f) % f, (f - new_h % f) % f
    grid_h, grid_w = (new_h + pad_h) // p, (new_w + pad_w) // p
    if grid_h > side or grid_w > side:
        # Only reachable when patch_limit_on_one_side * patch_size is not a multiple of p*k.
        raise ValueError(f"{width}x{height} image needs a {grid_h}x{grid_w} patch grid, above "
                         f"patch_limit_on_one_side={side}; use an even patch_limit_on_one_side")
    k = cfg.merge_kernel_size
    return ResizePlan(new_w, new_h, pad_w, pad_h, grid_h, grid_w, (grid_h // k) * (grid_w // k))


def count_image_tokens(width: int, height: int, cfg: MediaProcessorConfig | None = None) -> int:
    """Number of ``<|media_pad|>`` tokens (= encoder output rows) for a ``width`` x ``height`` image."""
    return plan_resize(width, height, cfg or MediaProcessorConfig()).num_tokens


# ---------------------------------------------------------------------------------------
# pixels

def to_rgb(img: Image.Image, bg: TransparentBgConfig | None) -> Image.Image:
    """8-bit RGB; pixels with alpha (or a ``transparency`` key) are composited onto ``bg``."""
    if bg is None:
        return img.convert("RGB")
    if img.mode == "RGB":
        return img
    if "A" not in img.getbands() and "transparency" not in img.info:
        return img.convert("RGB")
    rgba = np.asarray(img.convert("RGBA"))
    h, w = rgba.shape[:2]
    background = _background(h, w, bg).astype(np.float32)
    alpha = rgba[:, :, 3:4].astype(np.float32) / np.float32(255.0)
    # float32 blend, truncated to uint8 (the reference casts without rounding)
    out = alpha * rgba[:, :, :3].astype(np.float32) + (np.float32(1.0) - alpha) * background
    return Image.fromarray(out.astype(np.uint8), mode="RGB")


def _background(h: int, w: int, bg: TransparentBgConfig) -> np.ndarray:
    if bg.pattern != "chessboard":
        value = {"white": 255, "black": 0, "gray": 128}[bg.pattern]
        return np.full((h, w, 3), value, dtype=np.uint8)
    s = bg.chessboard_square_size
    odd = (np.arange(h)[:, None] // s + np.arange(w)[None, :] // s) % 2 == 1
    gray = odd if bg.chessboard_square_on_top_left else ~odd
    plane = np.where(gray, bg.chessboard_gray_value, bg.chessboard_white_value).astype(np.uint8)
    return np.repeat(plane[:, :, None], 3, axis=2)


def resize_and_pad(img: Image.Image, plan: ResizePlan, cfg: MediaProcessorConfig) -> np.ndarray:
    """Resized, RGB-converted, zero-padded pixels: uint8 [H'+pad_h, W'+pad_w, 3]."""
    before = cfg.transparent_bg_fill_stage == "before_resize"
    if before:
        img = to_rgb(img, cfg.transparent_bg_config)
    # Pillow bicubic (antialiased, a = -0.5) in the image's own mode: premultiplied for
    # RGBA/LA, nearest for P and 1; an unchanged size is a plain copy.
    img = img.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC)
    if not before:
        img = to_rgb(img, cfg.transparent_bg_config)
    arr = np.asarray(img, dtype=np.uint8)
    return np.pad(arr, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)), mode="constant", constant_values=0)


def normalize(pixels: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 [..., 3] -> float32 (v/255 - mean) / std with the D23 rounding: v/255, the
    subtraction and the product by 1/std are each rounded to float32."""
    if pixels.dtype != np.uint8 or pixels.shape[-1] != 3:
        raise ValueError(f"normalize expects uint8 [..., 3] pixels, got {pixels.dtype} {list(pixels.shape)}")
    scaled = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32).astype(np.float64)
    lut = np.stack([((scaled - float(m)).astype(np.float32).astype(np.float64) * (1.0 / float(s))).astype(np.float32)
                    for m, s in zip(mean, std)])                      # [3, 256]
    return np.stack([lut[c][pixels[..., c]] for c in range(3)], axis=-1)


def patchify(frames: np.ndarray, patch_size: int) -> np.ndarray:
    """[t, H, W, 3] -> [t*(H/p)*(W/p), 3, p, p]; patch n = tau*gh*gw + i*gw + j."""
    t, h, w, c = frames.shape
    p = patch_size
    x = frames.reshape(t, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 2, 4)
    return np.ascontiguousarray(x.reshape(-1, c, p, p))


# ---------------------------------------------------------------------------------------
# public entry points

@dataclass
class VisionInputs:
    """Tower input for the media items of one prompt, in prompt order."""

    pixel_values: torch.Tensor          # [P, 3, p, p] float32, P = sum_i t_i*gh_i*gw_i
    grid_thws: torch.Tensor             # [n_items, 3] int64 rows (t, gh, gw)
    num_tokens: list[int]               # per item: (gh/k)*(gw/k) pad tokens / encoder rows
    sizes: list[tuple[int, int]]        # per item: original (W, H) after EXIF, for "image WxH"

    def __len__(self) -> int:
        return len(self.num_tokens)


def concat_vision_inputs(parts: Sequence[VisionInputs]) -> VisionInputs:
    """Join items (e.g. images and video chunks of one prompt) keeping their order."""
    if not parts:
        raise ValueError("concat_vision_inputs needs at least one VisionInputs")
    return VisionInputs(
        pixel_values=torch.cat([x.pixel_values for x in parts]),
        grid_thws=torch.cat([x.grid_thws for x in parts]),
        num_tokens=[n for x in parts for n in x.num_tokens],
        sizes=[s for x in parts for s in x.sizes],
    )


def _frames_to_item(frames: list[Image.Image], plan: ResizePlan, cfg: MediaProcessorConfig
                    ) -> tuple[np.ndarray, list[int]]:
    stacked = np.stack([resize_and_pad(f, plan, cfg) for f in frames])   # [t, H, W, 3] uint8
    patches = patchify(normalize(stacked, cfg.image_mean, cfg.image_std), cfg.patch_size)
    return patches, [len(frames), plan.grid_h, plan.grid_w]


def preprocess_images(images: Sequence[ImageSource], cfg: MediaProcessorConfig | None = None, *,
                      allow_paths: bool = True) -> VisionInputs:
    """Decode and preprocess still images; each becomes one item with t = 1."""
    cfg = cfg or MediaProcessorConfig()
    if isinstance(images, (Image.Image, bytes, bytearray, memoryview, str, Path)):
        images = [images]
    if len(images) == 0:
        raise ValueError("preprocess_images needs at least one image")
    patches, grids, tokens, sizes = [], [], [], []
    for idx, source in enumerate(images):
        try:
            img = load_image(source, allow_paths=allow_paths)
        except ValueError as e:
            raise ValueError(f"image {idx}: {e}") from None
        plan = plan_resize(img.width, img.height, cfg)
        item, grid = _frames_to_item([img], plan, cfg)
        patches.append(item)
        grids.append(grid)
        tokens.append(plan.num_tokens)
        sizes.append(img.size)
    return VisionInputs(torch.from_numpy(np.concatenate(patches)), torch.tensor(grids, dtype=torch.int64),
                        tokens, sizes)


def preprocess_video(frames: Sequence[ImageSource], cfg: MediaProcessorConfig | None = None, *,
                     allow_paths: bool = True) -> VisionInputs:
    """Preprocess one video chunk (a list of 1..``temporal_merge_kernel_size`` frames) into a
    single item with t = len(frames). All frames follow the first frame's resize plan under the
    per-frame budget ``in_patch_limit_each_frame``; the token count is that of one frame."""
    cfg = cfg or MediaProcessorConfig()
    if not 1 <= len(frames) <= cfg.temporal_merge_kernel_size:
        raise ValueError(f"a video chunk holds 1..{cfg.temporal_merge_kernel_size} frames "
                         f"(temporal_merge_kernel_size), got {len(frames)}; split longer videos into chunks")
    decoded = []
    for idx, source in enumerate(frames):
        try:
            decoded.append(load_image(source, allow_paths=allow_paths))
        except ValueError as e:
            raise ValueError(f"video frame {idx}: {e}") from None
    first = decoded[0]
    plan = plan_resize(first.width, first.height, cfg, patch_limit=cfg.in_patch_limit_each_frame)
    item, grid = _frames_to_item(decoded, plan, cfg)
    return VisionInputs(torch.from_numpy(item), torch.tensor([grid], dtype=torch.int64),
                        [plan.num_tokens], [first.size])
