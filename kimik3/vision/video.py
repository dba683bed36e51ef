"""Video input for MoonViT: container check, frame sampling, chunks and their timestamps (spec
vision-multimodal §1.3, §2.9, §7-Q6).

K3's own processor is image-only, but its ``media_proc_cfg`` carries the video keys of Moonshot's
Kimi-K2.5 processor, and vLLM's K3 video branch follows that processor. kimik3 does too:

- sampling: rate ``r = min(fps, video fps)`` with ``fps`` the request's or the checkpoint's
  ``sample_fps`` (8); ``n_s = max(round(n * r / video_fps), 1)`` frames of the ``n``, at most
  ``max_num_frames_each_video``; then a multiple of ``temporal_merge_kernel_size`` T (4), rounded down.
  Frame indices ``round(linspace(0, n - 1, n_s))``.
- chunks: T consecutive sampled frames make one tower item (t = T, the frames pooled in time), whose
  prompt is ``{timestamp}<|media_begin|>video<|media_content|>`` + its pads + ``<|media_end|>``;
  a video's chunk prompts follow one another with nothing between them. ``timestamp`` is the chunk's
  first frame index / the video's average fps, written in ``timestamp_mode`` (``hh:mm:ss.fff``).
- size: every frame of a video follows one resize plan (§2.2) under the per-frame patch budget
  ``min(in_patch_limit_each_frame, round(in_patch_limit_video / n_s))``: ``in_patch_limit_video`` is
  the whole video's budget (vLLM's K3 video branch reads it so; Moonshot's K2.5 code applies it per
  chunk, which bounds nothing for a long video).

Where kimik3 departs (documented in docs/serving.md): fewer than T sampled frames make one shorter chunk
(the official rounding down would leave a short video without frames); timestamp hours do not wrap at 24;
a ``num_frames`` request samples that many frames uniformly (vLLM's video option); frames rotated by
the container's display matrix are turned upright, as EXIF orientation is for images.

Decoding uses PyAV (``pip install 'kimik3[video]'``), from bytes in memory, with the container format
fixed from its magic bytes (MP4/MOV, WebM/Matroska, AVI) and every nested open refused (a playlist
cannot make FFmpeg read other files). Costs are bounded by ``VideoLimits``: bytes, decoded pixels per
frame, sampled frames, and the wall time of the decode.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from PIL import Image

from kimik3.vision.preprocess import (
    MediaProcessorConfig,
    _TIMESTAMP_MODES,
    ResizePlan,
    VisionInputs,
    _b64decode,
    normalize,
    patchify,
    plan_resize,
    resize_and_pad,
)

VideoSource = Union[bytes, bytearray, memoryview, str, Path]
TIMESTAMP_MODES = _TIMESTAMP_MODES
VIDEO_EXTRA = "pip install 'kimik3[video]'"
_CONTAINERS = {"mov": "MP4/MOV", "matroska": "WebM/Matroska", "avi": "AVI"}


@dataclass(frozen=True)
class VideoLimits:
    """What one video may cost: its size in bytes, the pixels of one decoded frame, the frames sampled
    from it, and the seconds its decode may take."""

    max_bytes: int = 256 * 2**20
    max_pixels: int = 4096 * 4096
    max_frames: int = 256
    max_decode_seconds: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_frames"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"VideoLimits.{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.max_decode_seconds, (int, float)) and self.max_decode_seconds > 0):
            raise ValueError(f"VideoLimits.max_decode_seconds must be positive, got {self.max_decode_seconds!r}")


@dataclass(frozen=True)
class VideoSampling:
    """How frames are taken from a video: ``fps`` (None: the checkpoint's ``sample_fps``) and/or
    ``num_frames`` (that many frames, uniformly; with ``fps``, the most). vLLM's ``media_io_kwargs``
    video keys."""

    fps: float | None = None
    num_frames: int | None = None

    def __post_init__(self) -> None:
        if self.fps is not None and (isinstance(self.fps, bool) or not isinstance(self.fps, (int, float))
                                     or not math.isfinite(self.fps) or self.fps <= 0):
            raise ValueError(f"video fps must be a positive number, got {self.fps!r}")
        if self.num_frames is not None and (isinstance(self.num_frames, bool) or not isinstance(self.num_frames, int)
                                            or self.num_frames < 1):
            raise ValueError(f"video num_frames must be a positive integer, got {self.num_frames!r}")

    @property
    def explicit(self) -> bool:
        return self.fps is not None or self.num_frames is not None

    @classmethod
    def from_kwargs(cls, kwargs: Any, where: str = "media_io_kwargs.video") -> VideoSampling:
        """From vLLM's ``{"fps": F, "num_frames": N}``; another key is an error naming it."""
        if kwargs is None:
            return cls()
        if not isinstance(kwargs, dict):
            raise ValueError(f"{where} must be an object such as {{\"fps\": 2}}, got {type(kwargs).__name__}")
        unknown = sorted(set(kwargs) - {"fps", "num_frames"})
        if unknown:
            raise ValueError(f"{where}: unsupported key(s) {unknown}; kimik3 takes 'fps' and 'num_frames'")
        return cls(kwargs.get("fps"), kwargs.get("num_frames"))

    def merged(self, runtime: VideoSampling) -> VideoSampling:
        """``runtime`` over these defaults, as vLLM merges media_io_kwargs: a request that sets one of
        fps / num_frames drops the default of the other."""
        if runtime.fps is not None and runtime.num_frames is not None:
            return runtime
        if runtime.fps is not None:
            return VideoSampling(runtime.fps, None)
        if runtime.num_frames is not None:
            return VideoSampling(None, runtime.num_frames)
        return self


def media_io_sampling(value: Any, where: str = "media_io_kwargs") -> VideoSampling:
    """vLLM's ``media_io_kwargs``: ``{"video": {"fps", "num_frames"}}``; other keys are errors naming them."""
    if value is None:
        return VideoSampling()
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object such as {{\"video\": {{\"fps\": 2}}}}")
    unknown = sorted(set(value) - {"video"})
    if unknown:
        raise ValueError(f"{where}: unsupported key(s) {unknown}; kimik3 takes 'video' (fps, num_frames): image "
                         f"loading follows the checkpoint's preprocessor_config.json")
    return VideoSampling.from_kwargs(value.get("video"), f"{where}.video")


@dataclass(frozen=True)
class VideoInfo:
    """A video's header: frame size, frame count and average frame rate."""

    width: int
    height: int
    num_frames: int
    fps: float
    container: str


@dataclass(frozen=True)
class VideoPlan:
    """Which frames are sampled, how they form chunks, and what each chunk costs."""

    frame_indices: tuple[int, ...]   # into the video's frames, ascending
    chunk_frames: int                # T: sampled frames per chunk (the last may hold fewer)
    timestamps: tuple[str, ...]      # per chunk: its first frame's time, in timestamp_mode
    patch_limit: int                 # patches per frame before padding
    resize: ResizePlan               # from the header's size (rotation keeps the token count)

    @property
    def num_chunks(self) -> int:
        return len(self.timestamps)

    @property
    def num_tokens(self) -> int:
        return self.num_chunks * self.resize.num_tokens


@dataclass
class LoadedVideo:
    vision: VisionInputs             # one item per chunk, t = frames of the chunk
    timestamps: list[str]            # per chunk


# ---------------------------------------------------------------------------------------
# timestamps and sampling (pure)

def timestamp_text(seconds: float, mode: str = "hh:mm:ss.fff") -> str:
    """The time of a chunk as the video prompt writes it: ``hh:mm:ss.fff`` (``3661.5`` ->
    ``01:01:01.500``), ``mm:ss.fff`` or ``mm:ss``, with the official arithmetic: the second as
    ``datetime`` rounds it (to the microsecond), the millisecond truncated from the float's fraction
    (``2.8`` -> ``.799``), minutes wrapping at 60 in the ``mm`` modes; only hours do not wrap at 24."""
    if mode not in TIMESTAMP_MODES:
        raise ValueError(f"timestamp_mode must be one of {TIMESTAMP_MODES}, got {mode!r}")
    seconds = max(seconds, 0.0)
    frac, whole = math.modf(seconds)
    secs = int(whole) + (round(frac * 1e6) >= 1_000_000)
    hours, rest = divmod(secs, 3600)
    minutes, sec = divmod(rest, 60)
    ms = int((seconds % 1) * 1000)
    if mode == "hh:mm:ss.fff":
        return f"{hours:02d}:{minutes:02d}:{sec:02d}.{ms:03d}"
    if mode == "mm:ss.fff":
        return f"{minutes:02d}:{sec:02d}.{ms:03d}"
    return f"{minutes:02d}:{sec:02d}"


def sample_count(num_frames: int, video_fps: float, cfg: MediaProcessorConfig, sampling: VideoSampling,
                 max_frames: int) -> int:
    """How many frames are sampled (module docstring). Over ``max_frames``: the default rate is lowered
    to fit; a rate or count the request asked for is an error naming the most that fits."""
    if sampling.fps is None and sampling.num_frames is not None:
        n = min(sampling.num_frames, num_frames)
    else:
        rate = min(sampling.fps if sampling.fps is not None else float(cfg.sample_fps), video_fps)
        n = max(round(num_frames * rate / video_fps), 1)
        if sampling.num_frames is not None:
            n = min(n, sampling.num_frames)
    if cfg.max_num_frames_each_video is not None:
        n = min(n, cfg.max_num_frames_each_video)
    if n > max_frames:
        if sampling.explicit:
            fits = max_frames * video_fps / num_frames
            raise ValueError(f"sampling this video ({num_frames} frames at {video_fps:g} fps) as asked takes {n} "
                             f"frames, more than this server's limit of {max_frames} (--max-video-frames); ask for "
                             f"fps <= {math.floor(fits * 1000) / 1000:g} or num_frames <= {max_frames}")
        n = max_frames
    t = cfg.temporal_merge_kernel_size
    return n // t * t if n >= t else n


def plan_video(info: VideoInfo, cfg: MediaProcessorConfig, sampling: VideoSampling = VideoSampling(),
               limits: VideoLimits = VideoLimits()) -> VideoPlan:
    """Sampled frames, chunks, timestamps and the resize plan of a video, from its header alone."""
    n = sample_count(info.num_frames, info.fps, cfg, sampling, limits.max_frames)
    indices = tuple(int(i) for i in np.linspace(0, info.num_frames - 1, n).round().astype(np.int64))
    t = cfg.temporal_merge_kernel_size
    stamps = tuple(timestamp_text(indices[k] / info.fps, cfg.timestamp_mode) for k in range(0, n, t))
    limit = min(cfg.in_patch_limit_each_frame, max(1, round(cfg.in_patch_limit_video / n)))
    return VideoPlan(indices, t, stamps, limit, plan_resize(info.width, info.height, cfg, patch_limit=limit))


# ---------------------------------------------------------------------------------------
# sources and decoding

def _av():
    try:
        import av
    except ImportError:
        raise ValueError(f"video input needs PyAV, which is not installed: {VIDEO_EXTRA}") from None
    return av


def video_bytes(source: VideoSource, *, allow_paths: bool = True, max_bytes: int = VideoLimits.max_bytes) -> bytes:
    """The encoded video: raw bytes, a ``data:`` URL, base64 text, or a file path (``allow_paths``).
    More than ``max_bytes`` is refused before it is read (files) or kept (inline data)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, Path)) and allow_paths and len(str(source)) < 4096 and Path(source).is_file():
        size = Path(source).stat().st_size
        if size > max_bytes:
            raise ValueError(f"video file {source} is {size} bytes, more than the {max_bytes} allowed "
                             f"(--max-video-bytes)")
        try:
            data = Path(source).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read video file {source}: {e}") from None
    elif isinstance(source, Path):
        raise ValueError(f"video file not found: {source}" if allow_paths else
                         "video file paths are not accepted here; send the bytes or a data: URL")
    elif isinstance(source, str):
        header, sep, payload = source.partition(",")
        if source.startswith("data:") and not sep:
            raise ValueError("malformed data: URL (no ',' separating the header from the data)")
        if source.startswith("data:") and not header.endswith(";base64"):
            raise ValueError("a video data: URL must be base64 (data:video/mp4;base64,...)")
        data = _b64decode(payload if source.startswith("data:") else source, "video data")
    else:
        raise TypeError(f"a video must be bytes, a data: URL, base64 text or a file path, got {type(source).__name__}")
    if not data:
        raise ValueError("the video is empty (0 bytes)")
    if len(data) > max_bytes:
        raise ValueError(f"the video is {len(data)} bytes, more than the {max_bytes} allowed (--max-video-bytes)")
    return data


def container_format(data: bytes) -> str:
    """FFmpeg's demuxer for the container the magic bytes name; only these are opened."""
    if data[4:8] == b"ftyp" or data[4:8] in (b"moov", b"mdat", b"wide", b"free"):
        return "mov"
    if data[:4] == b"\x1aE\xdf\xa3":
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    raise ValueError(f"unsupported video container (starts with {data[:12]!r}); send MP4/MOV, WebM/MKV or AVI")


def _refuse_nested(url, flags, options):
    raise PermissionError(f"the video refers to another file or URL ({url!r}); send a self-contained video")


def _open(data: bytes):
    av = _av()
    fmt = container_format(data)
    try:
        container = av.open(io.BytesIO(data), format=fmt, io_open=_refuse_nested, metadata_errors="ignore")
    except Exception as e:          # FFmpeg's errors, and ours from _refuse_nested
        raise ValueError(f"cannot read the {_CONTAINERS[fmt]} video: {e}") from None
    if not container.streams.video:
        container.close()
        raise ValueError(f"the {_CONTAINERS[fmt]} file holds no video stream")
    return container, container.streams.video[0], fmt


def _header(container, stream, fmt: str, limits: VideoLimits, deadline: float) -> VideoInfo:
    ctx = stream.codec_context
    width, height = ctx.width, ctx.height
    if width < 1 or height < 1:
        raise ValueError("the video stream does not give its frame size")
    if width * height > limits.max_pixels:
        raise ValueError(f"video frames are {width}x{height} = {width * height} pixels, more than the "
                         f"{limits.max_pixels} allowed (--max-video-pixels); downscale the video")
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    if not fps > 0:
        raise ValueError("the video stream gives no frame rate")
    frames = stream.frames
    if frames <= 0:                 # WebM and others: count the stream's packets (no decoding)
        frames = _count_packets(container, stream, limits, deadline)
    if frames <= 0:
        raise ValueError("the video holds no frames")
    return VideoInfo(width, height, frames, fps, _CONTAINERS[fmt])


def _count_packets(container, stream, limits: VideoLimits, deadline: float) -> int:
    count = 0
    try:
        for packet in container.demux(stream):
            count += packet.size > 0
            if time.monotonic() > deadline:
                raise ValueError(_too_slow(limits))
    except ValueError:
        raise
    except Exception as e:          # FFmpeg's demux errors
        raise ValueError(f"corrupt video data ({type(e).__name__}: {e})") from None
    return count


def _too_slow(limits: VideoLimits) -> str:
    return (f"decoding the video took more than {limits.max_decode_seconds:g} s (--max-video-decode-seconds); "
            f"send a shorter or smaller video")


def probe_video(data: bytes, limits: VideoLimits = VideoLimits()) -> VideoInfo:
    """The header of an encoded video (no frame is decoded); ValueError for what is not a usable video."""
    container, stream, fmt = _open(data)
    try:
        return _header(container, stream, fmt, limits, time.monotonic() + limits.max_decode_seconds)
    finally:
        container.close()


def _upright(frame, limits: VideoLimits) -> Image.Image:
    if frame.width * frame.height > limits.max_pixels:
        raise ValueError(f"a video frame is {frame.width}x{frame.height} pixels, more than the {limits.max_pixels} "
                         f"allowed (--max-video-pixels)")
    img = frame.to_image()
    turn = round(getattr(frame, "rotation", 0) or 0) % 360     # counterclockwise, FFmpeg's display matrix
    return img.rotate(turn, expand=True) if turn in (90, 180, 270) else img


def _decode(container, stream, plan: VideoPlan, cfg: MediaProcessorConfig, limits: VideoLimits,
            deadline: float) -> list[np.ndarray]:
    """The sampled frames, resized and padded (uint8 [H, W, 3]) as they are decoded; a stream with fewer
    frames than its header says repeats its last frame for the missing ones."""
    wanted: dict[int, list[int]] = {}
    for slot, idx in enumerate(plan.frame_indices):
        wanted.setdefault(idx, []).append(slot)
    out: list[np.ndarray | None] = [None] * len(plan.frame_indices)
    resize, last = None, None
    stream.thread_type = "AUTO"
    try:
        for idx, frame in enumerate(container.decode(stream)):
            if time.monotonic() > deadline:
                raise ValueError(_too_slow(limits))
            last = frame
            if idx in wanted:
                img = _upright(frame, limits)
                resize = resize or plan_resize(img.width, img.height, cfg, patch_limit=plan.patch_limit)
                arr = resize_and_pad(img, resize, cfg)
                for slot in wanted[idx]:
                    out[slot] = arr
            if idx >= plan.frame_indices[-1]:
                break
    except ValueError:
        raise
    except Exception as e:          # FFmpeg's decode errors
        raise ValueError(f"corrupt video data ({type(e).__name__}: {e})") from None
    if last is None:
        raise ValueError("no frame of the video could be decoded")
    missing = [s for s, a in enumerate(out) if a is None]
    if missing:
        img = _upright(last, limits)
        resize = resize or plan_resize(img.width, img.height, cfg, patch_limit=plan.patch_limit)
        arr = resize_and_pad(img, resize, cfg)
        for s in missing:
            out[s] = arr
    return out                      # type: ignore[return-value]


def load_video(source: VideoSource, cfg: MediaProcessorConfig | None = None,
               sampling: VideoSampling = VideoSampling(), limits: VideoLimits = VideoLimits(), *,
               allow_paths: bool = True) -> LoadedVideo:
    """Decode, sample and preprocess one video into its chunks (one tower item each) and their timestamps."""
    cfg = cfg or MediaProcessorConfig()
    data = video_bytes(source, allow_paths=allow_paths, max_bytes=limits.max_bytes)
    deadline = time.monotonic() + limits.max_decode_seconds
    container, stream, fmt = _open(data)
    try:
        info = _header(container, stream, fmt, limits, deadline)
        plan = plan_video(info, cfg, sampling, limits)
        if stream.frames <= 0:      # the packets were counted: start again for the decode
            container.close()
            container, stream, fmt = _open(data)
        frames = _decode(container, stream, plan, cfg, limits, deadline)
    finally:
        container.close()
    t = plan.chunk_frames
    patches, grids = [], []
    for k in range(0, len(frames), t):
        chunk = np.stack(frames[k:k + t])
        patches.append(patchify(normalize(chunk, cfg.image_mean, cfg.image_std), cfg.patch_size))
        grids.append([len(chunk), chunk.shape[1] // cfg.patch_size, chunk.shape[2] // cfg.patch_size])
    k = cfg.merge_kernel_size
    tokens = [(g[1] // k) * (g[2] // k) for g in grids]
    vision = VisionInputs(torch.from_numpy(np.concatenate(patches)), torch.tensor(grids, dtype=torch.int64),
                          tokens, [(info.width, info.height)] * len(grids))
    return LoadedVideo(vision, list(plan.timestamps))
