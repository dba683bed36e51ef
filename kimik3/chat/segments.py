"""The unit both chat renderers produce: a piece of prompt text plus whether it may become special ids."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """One piece of a rendered prompt.

    ``special=True`` marks a control segment (XTML markers, role tokens, image prompts): it is
    encoded with special tokens recognised. Everything taken from messages is ``special=False`` and
    encoded as plain text, so a user typing ``<|open|>`` never yields the special id. Each segment is
    BPE-encoded on its own (no merges across a boundary).
    """

    text: str
    special: bool = False


@dataclass(frozen=True)
class ImagePrompt:
    """What the renderer needs to know about one image: its original size (pixels, before any resize)
    and how many ``<|media_pad|>`` ids to emit for it.

    ``num_pad_tokens`` is N from the vision processor's token count when the engine scatters one
    embedding row per pad (the vLLM layout), or 1 to reproduce the official processor's prompt (one pad,
    expanded inside the model).
    """

    width: int
    height: int
    num_pad_tokens: int

    def __post_init__(self) -> None:
        for key in ("width", "height", "num_pad_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ImagePrompt.{key} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class VideoPrompt:
    """What the renderer needs to know about one video part: per chunk (``temporal_merge_kernel_size``
    sampled frames, one tower item), its timestamp text and how many ``<|media_pad|>`` ids to emit
    (``kimik3.vision.video``)."""

    chunks: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError("VideoPrompt needs at least one chunk")
        for stamp, pads in self.chunks:
            if not isinstance(stamp, str) or "<|" in stamp:
                raise ValueError(f"VideoPrompt timestamps are plain text, got {stamp!r}")
            if not isinstance(pads, int) or isinstance(pads, bool) or pads < 1:
                raise ValueError(f"VideoPrompt pad counts must be positive ints, got {pads!r}")
