"""Images and videos in requests: where each may come from, what each may cost, and how they become the
engine's vision inputs and the chat renderer's prompts.

Sources: ``data:`` URLs always; ``file://`` URLs only inside ``--allowed-local-media-path`` (vLLM's flag:
the path is resolved, symlinks included, and must lie under that folder); ``http(s)://`` never (the server
has no network). Parts: ``image_url`` / ``image`` and ``video_url`` / ``video`` (``{"url": ...}``), in
message order; images and video chunks reach the engine in that order, as the renderer places their pads.

Videos (``kimik3.vision.video``): frames sampled at the request's ``media_io_kwargs.video`` (``fps``,
``num_frames``; vLLM's field), else ``--media-io-kwargs``, else the checkpoint's ``sample_fps``. Each is
costed from its header (tokens against the context) before any frame is decoded; ``--max-video-bytes``,
``--max-video-pixels`` (per frame), ``--max-video-frames`` (sampled) and ``--max-video-decode-seconds``
bound the rest, each a 400 naming it.
"""

from __future__ import annotations

import argparse
import json
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimik3.chat import ImagePrompt, VideoPrompt
from kimik3.serve.protocol import APIError, bad_request
from kimik3.vision.video import VideoLimits, VideoSampling, media_io_sampling

_IMAGE_PARTS = ("image_url", "image")
_VIDEO_PARTS = ("video_url", "video")
MAX_IMAGE_FILE_BYTES = 64 * 2**20   # a local image file (inline ones are held to --max-body-bytes)


@dataclass(frozen=True)
class MediaOptions:
    allowed_local_media_path: Path | None = None     # file:// URLs are read only below this folder
    video_sampling: VideoSampling = field(default_factory=VideoSampling)   # --media-io-kwargs video defaults
    video_limits: VideoLimits = field(default_factory=VideoLimits)


@dataclass(frozen=True)
class MediaRef:
    kind: str                   # "image" or "video"
    source: str | Path          # a data: URL, or a local file inside the allowed folder
    where: str                  # the request path of its part, for errors


@dataclass
class LoadedMedia:
    vision: Any                              # VisionInputs, items in prompt order
    images: list[ImagePrompt] | None
    videos: list[VideoPrompt] | None


# ---- flags ------------------------------------------------------------------------------------------------

def _folder(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    return path.resolve()


def _media_io(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected JSON such as '{{\"video\": {{\"fps\": 2}}}}', got {text!r}")
    try:
        media_io_sampling(value, "--media-io-kwargs")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def add_media_arguments(g) -> None:
    d = VideoLimits()
    g.add_argument("--allowed-local-media-path", type=_folder, default=None,
                   help="folder whose files requests may name as file:// image and video URLs (vLLM's flag; "
                        "every client can then read them) (default: none, local files refused)")
    g.add_argument("--media-io-kwargs", type=_media_io, default=None,
                   help="default video sampling, as JSON: '{\"video\": {\"fps\": 2}}' or '{\"video\": "
                        "{\"num_frames\": 32}}'; a request's media_io_kwargs overrides it (default: the "
                        "checkpoint's sample_fps)")
    g.add_argument("--max-video-bytes", type=_positive(int), default=d.max_bytes,
                   help=f"largest video, in bytes (default: {d.max_bytes})")
    g.add_argument("--max-video-pixels", type=_positive(int), default=d.max_pixels,
                   help=f"most pixels in one decoded video frame (default: {d.max_pixels})")
    g.add_argument("--max-video-frames", type=_positive(int), default=d.max_frames,
                   help=f"most frames sampled from one video; the default rate is lowered to fit, a rate a "
                        f"request asks for is refused above it (default: {d.max_frames})")
    g.add_argument("--max-video-decode-seconds", type=_positive(float), default=d.max_decode_seconds,
                   help=f"longest decode of one video, in seconds (default: {d.max_decode_seconds:g})")


def media_options_from_args(args: argparse.Namespace) -> MediaOptions:
    limits = VideoLimits(max_bytes=args.max_video_bytes, max_pixels=args.max_video_pixels,
                         max_frames=args.max_video_frames, max_decode_seconds=args.max_video_decode_seconds)
    return MediaOptions(args.allowed_local_media_path, media_io_sampling(args.media_io_kwargs, "--media-io-kwargs"),
                        limits)


# ---- parts and sources ---------------------------------------------------------------------------------

def _local_file(url: str, where: str, root: Path | None, kind: str) -> Path:
    if root is None:
        raise bad_request(f"{where}: local files are not served; send the {kind} inline as a data: URL, or start "
                          f"the server with --allowed-local-media-path FOLDER", where, f"unsupported_{kind}_url")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise bad_request(f"{where}: a file:// URL names a file on this machine (file:///path), not on host "
                          f"{parsed.netloc!r}", where, f"unsupported_{kind}_url")
    try:
        path = Path(urllib.parse.unquote(parsed.path)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise bad_request(f"{where}: no such file under --allowed-local-media-path", where, f"invalid_{kind}") from None
    if not path.is_relative_to(root) or not path.is_file():
        raise bad_request(f"{where}: {kind} files must lie under --allowed-local-media-path ({root})", where,
                          f"unsupported_{kind}_url")
    if kind == "image" and path.stat().st_size > MAX_IMAGE_FILE_BYTES:
        raise bad_request(f"{where}: the image file is {path.stat().st_size} bytes, more than the "
                          f"{MAX_IMAGE_FILE_BYTES} read for an image", where, "invalid_image")
    return path


def _source(part: dict, kind: str, where: str, root: Path | None) -> str | Path:
    key = part.get("type")
    url = part.get(key) if key in part else part.get(f"{kind}_url", part.get(kind))
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: a {kind} part needs {kind}_url.url as a string", where)
    low = url[:16].lower()
    if low.startswith(("http://", "https://")):
        raise bad_request(f"{where}: remote {kind} URLs are not supported (this server has no network access); "
                          f"send the {kind} inline as a data: URL", where, f"unsupported_{kind}_url")
    if low.startswith("file://"):
        return _local_file(url, where, root, kind)
    if not low.startswith("data:"):
        raise bad_request(f"{where}: {kind}s must be data: URLs (data:{kind}/...;base64,...) or file:// URLs under "
                          f"--allowed-local-media-path; file paths are refused", where, f"unsupported_{kind}_url")
    return url


def collect_media(messages: list, options: MediaOptions | None = None) -> list[MediaRef]:
    """Every image and video part of the conversation, in order, with its checked source."""
    root = options.allowed_local_media_path if options is not None else None
    found = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _IMAGE_PARTS or kind in _VIDEO_PARTS:
                media = "image" if kind in _IMAGE_PARTS else "video"
                where = f"messages[{i}].content[{k}]"
                found.append(MediaRef(media, _source(part, media, where, root), where))
    return found


def check_media_counts(refs: list[MediaRef], limit_mm_per_prompt: dict | None, param: str = "messages") -> None:
    for kind in ("image", "video"):
        limit = (limit_mm_per_prompt or {}).get(kind)
        count = sum(r.kind == kind for r in refs)
        if limit is not None and count > limit:
            raise bad_request(f"the request holds {count} {kind}s, more than this server's "
                              f"--limit-mm-per-prompt {kind}={limit}", param, f"too_many_{kind}s")


# ---- loading --------------------------------------------------------------------------------------------

def _media_error(ref: MediaRef, e: Exception) -> APIError:
    msg = str(e)
    if ref.kind == "video" and "kimik3[video]" in msg:
        return bad_request(f"{ref.where}: {msg}", ref.where, "video_unsupported")
    return bad_request(f"{ref.where}: bad {ref.kind}: {msg}", ref.where, f"invalid_{ref.kind}")


def _costs(refs: list[MediaRef], cfg, sampling: VideoSampling, limits: VideoLimits) -> tuple[list[int], dict]:
    """Tokens per item from the headers (no pixel decoded), and each video's bytes."""
    from kimik3.vision.preprocess import image_token_counts
    from kimik3.vision.video import plan_video, probe_video, video_bytes
    tokens, data = [], {}
    for n, ref in enumerate(refs):
        try:
            if ref.kind == "image":
                tokens += image_token_counts([ref.source], cfg, allow_paths=isinstance(ref.source, Path))
            else:
                data[n] = video_bytes(ref.source, allow_paths=isinstance(ref.source, Path),
                                      max_bytes=limits.max_bytes)
                tokens.append(plan_video(probe_video(data[n], limits), cfg, sampling, limits).num_tokens)
        except ValueError as e:
            raise _media_error(ref, e) from None
    return tokens, data


def load_media(refs: list[MediaRef], cfg, options: MediaOptions | None, request_sampling: VideoSampling,
               max_tokens: int | None, has_vision: bool = True, param: str = "messages") -> LoadedMedia:
    """Cost every item from its header (a bad one is named even on a model without vision), refuse what
    cannot fit ``max_tokens``, then decode and preprocess them in order. ``request_sampling``: the request's
    ``media_io_kwargs.video`` (over the server's defaults); ``param``: the request field a refusal names."""
    from kimik3.vision.preprocess import MediaProcessorConfig, concat_vision_inputs, preprocess_images
    from kimik3.vision.video import load_video
    options = options or MediaOptions()
    cfg = cfg or MediaProcessorConfig()
    sampling = options.video_sampling.merged(request_sampling)
    limits = options.video_limits
    tokens, data = _costs(refs, cfg, sampling, limits)
    if not has_vision:
        raise bad_request("this model has no vision tower; remove the image and video parts", refs[0].where,
                          "images_unsupported")
    if max_tokens is not None and sum(tokens) > max_tokens:
        raise bad_request(f"the images and videos need {sum(tokens)} tokens ({tokens} per item), more than this "
                          f"model's context (max_model_len) leaves for them ({max_tokens}); send fewer or smaller "
                          f"ones, or sample videos at a lower fps", param, "context_length_exceeded")
    parts, images, videos = [], [], []
    for n, ref in enumerate(refs):
        try:
            if ref.kind == "image":
                v = preprocess_images([ref.source], cfg, allow_paths=isinstance(ref.source, Path))
                images.append(ImagePrompt(*v.sizes[0], v.num_tokens[0]))
            else:
                loaded = load_video(data[n], cfg, sampling, limits)
                v = loaded.vision
                videos.append(VideoPrompt(tuple(zip(loaded.timestamps, v.num_tokens))))
        except ValueError as e:
            raise _media_error(ref, e) from None
        parts.append(v)
    return LoadedMedia(concat_vision_inputs(parts), images if images else None, videos if videos else None)


# ---- raw completion prompts with images ---------------------------------------------------------------

def completion_images(prompt: Any, media_urls: Any, tokenizer, pad_id: int, cfg, options: MediaOptions | None,
                      has_vision: bool, limit_mm_per_prompt: dict | None, max_tokens: int | None):
    """A ``/v1/completions`` prompt with images, the raw K3 form ``LLM.generate`` takes: a string holding one
    ``<|kimi_image_placeholder|>`` per image (each becomes the image's K3 prompt; the rest of the string is
    read with its special-token names as tokens, as in ``LLM.generate``), or token ids holding one
    ``<|media_pad|>`` per image (the HF processor's form). The images come in ``media_urls: {"image": [url,
    ...]}`` (data: or allowed file:// URLs), the shape proposed to vLLM (PR #50648; vLLM's own /v1/completions
    takes no media). Returns (token ids with one pad per embedding row, the text to echo, VisionInputs)."""
    from kimik3.chat.k3 import IMAGE_PLACEHOLDER, fill_image_placeholders
    from kimik3.engine.images.multimodal import expand_media_pads
    if not isinstance(media_urls, dict) or not media_urls:
        raise bad_request("media_urls must be an object such as {\"image\": [\"data:image/png;base64,...\"]}",
                          "media_urls")
    if "video" in media_urls:
        raise bad_request("media_urls.video: K3 has no raw-prompt placeholder for video; send videos as video_url "
                          "parts to /v1/chat/completions", "media_urls.video", "unsupported_field")
    unknown = sorted(set(media_urls) - {"image"})
    if unknown:
        raise bad_request(f"media_urls: unsupported key(s) {unknown}; kimik3 takes 'image'", "media_urls",
                          "unsupported_field")
    urls = media_urls["image"]
    if not isinstance(urls, list) or not urls:
        raise bad_request("media_urls.image must be a non-empty list of URLs", "media_urls.image")
    if not isinstance(prompt, str) and not (isinstance(prompt, list) and prompt and
                                            all(isinstance(t, int) for t in prompt)):
        raise bad_request("media_urls goes with one prompt (a string or a list of token ids), not a batch", "prompt")
    root = options.allowed_local_media_path if options is not None else None
    refs = [MediaRef("image", _source({"type": "image_url", "image_url": u}, "image", f"media_urls.image[{k}]", root),
                     f"media_urls.image[{k}]") for k, u in enumerate(urls)]
    check_media_counts(refs, limit_mm_per_prompt, "media_urls")
    loaded = load_media(refs, cfg, options, VideoSampling(), max_tokens, has_vision, "media_urls")
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(fill_image_placeholders(prompt, [(p.width, p.height) for p in loaded.images],
                                                           "media_urls.image"), allow_special=True)
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
        if prompt.count(IMAGE_PLACEHOLDER) == 0 and ids.count(pad_id) == 0:
            raise bad_request(f"the prompt holds no {IMAGE_PLACEHOLDER} for the {len(urls)} image(s) in media_urls; "
                              f"put one where each image goes", "prompt")
        text = prompt
    else:
        ids, text = list(prompt), tokenizer.decode(prompt)
    if ids.count(pad_id) != sum(loaded.vision.num_tokens):
        try:
            ids = expand_media_pads(ids, loaded.vision.num_tokens, pad_id)
        except ValueError as e:
            raise bad_request(f"{e} (media_urls.image)", "prompt") from None
    return ids, text, loaded.vision
