"""``LLM.chat``'s image and video parts -> the renderer's prompts and the engine's vision inputs, in part order.

Images: ``{"type": "image_pil", "image_pil": PIL}`` / ``{"type": "image", "image": PIL}``, or
``{"type": "image_url", "image_url": {"url": "data:..."}}``. Videos: ``{"type": "video_url", "video_url":
{"url": "data:video/mp4;base64,..."}}``, or ``{"type": "video", "video": bytes | path}`` (the caller's own
file), sampled as ``media_io_kwargs={"video": {"fps": F, "num_frames": N}}`` says (default: the checkpoint's
``sample_fps``), each chunk rendered with its timestamp (``kimik3.vision.video``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

_IMAGE_PARTS = ("image", "image_pil", "image_url")
_VIDEO_PARTS = ("video", "video_url")


@dataclass
class ChatMedia:
    messages: list                   # the conversation with each media part reduced to its type
    vision: Any                      # VisionInputs (items in part order) or None
    images: list | None              # ImagePrompt per image part
    videos: list | None              # VideoPrompt per video part


def _source(part: dict, kind: str, where: str, is_video: bool):
    source = part.get(kind)
    if kind.endswith("_url"):
        source = source.get("url") if isinstance(source, dict) else source
        if not isinstance(source, str) or not source.startswith("data:"):
            alt = "a video part with the bytes or a file path" if is_video else "an image_pil part"
            raise ValueError(f"{where}: {kind} must be a data: URL (or pass {alt})")
    if source is None:
        raise ValueError(f"{where}: a {kind} part needs its {'video' if is_video else 'image'} under {kind!r}")
    return source


def chat_media(conversation: list, cfg, media_io_kwargs: Any, check_limit: Callable[[str, int], None]) -> ChatMedia:
    """Collect, check (``check_limit(kind, count)``) and preprocess the media parts of one conversation."""
    found: list[tuple[str, Any, str]] = []
    rendered = []
    for i, m in enumerate(conversation):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _IMAGE_PARTS or kind in _VIDEO_PARTS:
                    video = kind in _VIDEO_PARTS
                    found.append(("video" if video else "image", _source(part, kind, f"messages[{i}].content[{k}]",
                                                                         video), f"messages[{i}].content[{k}]"))
                    part = {"type": "video" if video else "image"}
                parts.append(part)
            m = {**m, "content": parts}
        rendered.append(m)
    if not found:
        return ChatMedia(rendered, None, None, None)
    for kind in ("image", "video"):
        check_limit(kind, sum(f[0] == kind for f in found))
    return _load(found, rendered, cfg, media_io_kwargs)


def _load(found, rendered, cfg, media_io_kwargs) -> ChatMedia:
    from kimik3.chat import ImagePrompt, VideoPrompt
    from kimik3.vision.preprocess import concat_vision_inputs, preprocess_images
    from kimik3.vision.video import load_video, media_io_sampling
    sampling = media_io_sampling(media_io_kwargs)
    parts, images, videos = [], [], []
    for kind, source, where in found:
        try:
            if kind == "image":
                v = preprocess_images([source], cfg, allow_paths=False)
                images.append(ImagePrompt(*v.sizes[0], v.num_tokens[0]))
            else:
                loaded = load_video(source, cfg, sampling)
                v = loaded.vision
                videos.append(VideoPrompt(tuple(zip(loaded.timestamps, v.num_tokens))))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        parts.append(v)
    return ChatMedia(rendered, concat_vision_inputs(parts), images or None, videos or None)
