"""Small videos made on the fly with PyAV for the video tests: frame i is a flat gray of level ``LEVEL * i``
(mod 256) with a white 4x4 marker in the top-left corner, so a decoded frame tells its index and its
orientation."""

from __future__ import annotations

import base64
import io

import numpy as np

LEVEL = 9


def frame_pixels(i: int, w: int, h: int) -> np.ndarray:
    arr = np.full((h, w, 3), LEVEL * i % 256, np.uint8)
    arr[:4, :4] = 255
    return arr


def make_video(n: int = 12, fps: float = 4, w: int = 64, h: int = 48, codec: str = "mpeg4", fmt: str = "mp4",
               rotation: int | None = None) -> bytes:
    import av
    from fractions import Fraction
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        if codec == "mpeg4":
            s.options = {"qscale": "1"}             # near lossless: levels survive within a few units
        if rotation is not None:
            s.set_display_rotation(rotation)
        for i in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(frame_pixels(i, w, h), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def decode_all(data: bytes) -> list[np.ndarray]:
    """Every frame as RGB, straight from PyAV (no sampling, no rotation)."""
    import av
    with av.open(io.BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
