"""Chat formats: K3 XTML (``k3``), Kimi-Linear's K2-style ``<|im_*|>`` (``kimi_linear``), and the K3
output parser (``parsers``)."""

from kimik3.chat.k3 import render_k3
from kimik3.chat.kimi_linear import render_kimi_linear
from kimik3.chat.parsers import (
    K3OutputParser,
    ParseDelta,
    ParsedOutput,
    ToolCall,
    parse_k3_output,
)
from kimik3.chat.segments import ImagePrompt, Segment, VideoPrompt

__all__ = [
    "ImagePrompt",
    "K3OutputParser",
    "ParseDelta",
    "ParsedOutput",
    "Segment",
    "ToolCall",
    "VideoPrompt",
    "parse_k3_output",
    "render_k3",
    "render_kimi_linear",
]
