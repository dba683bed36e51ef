"""kimik3/vision/video.py: timestamps against Moonshot's formula, sampling against hand-worked numbers,
decoding against PyAV read directly and the image path, and every limit."""

from __future__ import annotations

import dataclasses
import sys
from datetime import datetime, timezone

import numpy as np
import pytest

from kimik3.chat import VideoPrompt
from kimik3.config import ConfigError
from kimik3.vision.preprocess import MediaProcessorConfig, preprocess_video
from kimik3.vision.video import (VideoInfo, VideoLimits, VideoSampling, container_format, load_video, plan_video,
                                 probe_video, sample_count, timestamp_text, video_bytes)
from tests.vision.videos import LEVEL, data_url, decode_all, make_video

K3 = MediaProcessorConfig()
pytest.importorskip("av")


def official_timestamp(ts: float) -> str:
    """Kimi-K2.5's timestamp_as_str, hh:mm:ss.fff (as its processor writes it)."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M:%S") + f".{int((ts % 1) * 1000):03d}"


# ---------------------------------------------------------------------------------------
# timestamps

def test_timestamp_text_matches_the_official_formula():
    assert timestamp_text(3661.5) == "01:01:01.500"
    assert timestamp_text(3661.5, "mm:ss.fff") == "01:01.500" and timestamp_text(75.25, "mm:ss") == "01:15"
    assert timestamp_text(90061.0) == "25:01:01.000"           # no wrap at 24 h (the official one wraps)
    assert timestamp_text(2.8) == "00:00:02.799"              # the float's fraction, truncated, as theirs
    for fps in (1, 2, 7.5, 8, 24, 25, 30000 / 1001, 30, 60):
        for idx in range(0, 20000, 7):
            assert timestamp_text(idx / fps) == official_timestamp(idx / fps), (idx, fps)
    for ts in (99.99999999, 0.9999996, 59.9999994, 3599.9999999):     # the second rounded, the ms truncated
        assert timestamp_text(ts) == official_timestamp(ts), ts
    with pytest.raises(ValueError, match="timestamp_mode"):
        timestamp_text(1.0, "ss")
    with pytest.raises(ConfigError, match="timestamp_mode"):
        MediaProcessorConfig(timestamp_mode="hh:mm")


# ---------------------------------------------------------------------------------------
# sampling

def test_sampling_follows_the_official_rule():
    # 30 frames at 10 fps, K3's sample_fps 8: round(30 * 8 / 10) = 24 frames (a multiple of 4), indices
    # round(linspace(0, 29, 24)) (step 29/23), 6 chunks starting at frames 0, 5, 10, 15, 20, 25
    plan = plan_video(VideoInfo(64, 48, 30, 10.0, "MP4/MOV"), K3)
    assert len(plan.frame_indices) == 24 and plan.frame_indices[:6] == (0, 1, 3, 4, 5, 6)   # 1.26, 2.52, 3.78 ...
    assert plan.frame_indices[4::4] == (5, 10, 15, 20, 25) and plan.frame_indices[-1] == 29
    assert plan.timestamps == ("00:00:00.000", "00:00:00.500", "00:00:01.000", "00:00:01.500", "00:00:02.000",
                               "00:00:02.500")
    # one frame 64x48 fits the per-frame budget: 4x3 floor patches -> 2x2 tokens (padded to 84x56)
    assert plan.resize.num_tokens == 6 and plan.num_tokens == 36
    assert plan.patch_limit == min(16384, round(655360 / 24))


def test_sampling_rate_count_and_short_videos():
    info = VideoInfo(64, 48, 100, 25.0, "MP4/MOV")
    assert sample_count(100, 25.0, K3, VideoSampling(fps=2), 256) == 8        # round(100*2/25) = 8
    assert sample_count(100, 25.0, K3, VideoSampling(fps=1000), 256) == 100   # the rate is at most the video's
    assert sample_count(100, 25.0, K3, VideoSampling(num_frames=10), 256) == 8    # 10 uniformly, then 8 (x4)
    assert sample_count(100, 25.0, K3, VideoSampling(fps=8, num_frames=12), 256) == 12
    assert sample_count(3, 25.0, K3, VideoSampling(), 256) == 1                 # round(3*8/25) = 1: one frame
    plan = plan_video(VideoInfo(64, 48, 5, 2.0, "MP4/MOV"), K3)                 # 5 frames at 2 fps: all 5 ...
    assert plan.frame_indices == (0, 1, 3, 4) and plan.timestamps == ("00:00:00.000",)   # ... then 4 (x4)
    plan = plan_video(VideoInfo(64, 48, 6, 4.0, "MP4/MOV"), K3, VideoSampling(num_frames=2))
    assert plan.frame_indices == (0, 5) and plan.num_chunks == 1                # < 4 frames: one short chunk
    capped = dataclasses.replace(K3, max_num_frames_each_video=8)
    assert sample_count(100, 25.0, capped, VideoSampling(), 256) == 8
    assert plan_video(info, K3, VideoSampling(fps=2)).patch_limit == 16384     # 655360 / 8 > 16384


def test_frame_limit_lowers_the_default_rate_and_refuses_an_asked_one():
    info = VideoInfo(64, 48, 3000, 30.0, "MP4/MOV")                          # 100 s: 800 frames at 8 fps
    plan = plan_video(info, K3, limits=VideoLimits(max_frames=64))
    assert len(plan.frame_indices) == 64 and plan.frame_indices[-1] == 2999   # spread over the whole video
    with pytest.raises(ValueError, match=r"takes 200 frames, more than this server's limit of 64 "
                                         r"\(--max-video-frames\); ask for fps <= 0\.64 or num_frames <= 64"):
        plan_video(info, K3, VideoSampling(fps=2), VideoLimits(max_frames=64))
    with pytest.raises(ValueError, match="num_frames <= 64"):
        plan_video(info, K3, VideoSampling(num_frames=65), VideoLimits(max_frames=64))


def test_sampling_options_are_checked_and_merged_as_vllm_does():
    with pytest.raises(ValueError, match=r"unsupported key\(s\) \['frames'\]"):
        VideoSampling.from_kwargs({"frames": 3})
    for bad in ({"fps": 0}, {"fps": float("nan")}, {"num_frames": 0}, {"num_frames": 2.5}, {"fps": True}):
        with pytest.raises(ValueError):
            VideoSampling.from_kwargs(bad)
    default = VideoSampling(fps=2, num_frames=40)
    assert default.merged(VideoSampling()) == default
    assert default.merged(VideoSampling(fps=1)) == VideoSampling(fps=1)
    assert default.merged(VideoSampling(num_frames=8)) == VideoSampling(num_frames=8)


# ---------------------------------------------------------------------------------------
# decoding

def _levels(vision) -> list[int]:
    """Frame index of each sampled frame, read back from its gray level (centre of the frame, un-normalised)."""
    out = []
    for (t, gh, gw), start in zip(vision.grid_thws.tolist(), np.cumsum([0] + [int(np.prod(g)) for g in
                                                                             vision.grid_thws.tolist()])):
        patches = vision.pixel_values[start:start + t * gh * gw].reshape(t, gh, gw, 3, 14, 14)
        for f in range(t):
            centre = patches[f, 1, 1].numpy()                   # a patch away from the marker and the padding
            out.append(round(float((centre.mean() * 0.5 + 0.5) * 255) / LEVEL))
    return out


@pytest.mark.parametrize("codec,fmt", [("mpeg4", "mp4"), ("libvpx", "webm"), ("mpeg4", "avi")])
def test_load_video_samples_the_planned_frames(codec, fmt):
    data = make_video(n=20, fps=10, codec=codec, fmt=fmt)
    info = probe_video(data)
    assert (info.width, info.height, info.num_frames, info.fps) == (64, 48, 20, 10.0)
    out = load_video(data, K3, VideoSampling(fps=4))         # round(20 * 4 / 10) = 8 frames, 2 chunks
    plan = plan_video(info, K3, VideoSampling(fps=4))
    assert plan.frame_indices == (0, 3, 5, 8, 11, 14, 16, 19)
    assert _levels(out.vision) == list(plan.frame_indices)
    assert out.timestamps == ["00:00:00.000", "00:00:01.100"] and out.vision.grid_thws.tolist() == [[4, 4, 6]] * 2
    assert out.vision.num_tokens == [6, 6]


def test_load_video_equals_the_image_path_on_the_same_frames():
    """The chunks hold exactly what preprocess_video makes of the frames PyAV decodes at the planned indices."""
    data = make_video(n=9, fps=3, w=70, h=50)
    out = load_video(data, K3, VideoSampling(num_frames=6))    # 6 uniformly -> 4 (a multiple of 4)
    frames = decode_all(data)
    idx = [0, 3, 5, 8]
    from PIL import Image
    want = preprocess_video([Image.fromarray(frames[i]) for i in idx], K3)
    assert out.vision.grid_thws.tolist() == want.grid_thws.tolist()
    assert np.array_equal(out.vision.pixel_values.numpy(), want.pixel_values.numpy())


def test_display_rotation_is_applied():
    plain = load_video(make_video(n=4, w=56, h=28), K3)
    turned = load_video(make_video(n=4, w=56, h=28, rotation=90), K3)
    # 90 degrees counterclockwise: a 56x28 frame shows as 28x56, its top-left marker at the bottom-left
    assert plain.vision.grid_thws.tolist() == [[4, 2, 4]] and turned.vision.grid_thws.tolist() == [[4, 4, 2]]
    p = plain.vision.pixel_values.reshape(4, 2, 4, 3, 14, 14)[0].permute(0, 3, 1, 4, 2).reshape(28, 56, 3)
    q = turned.vision.pixel_values.reshape(4, 4, 2, 3, 14, 14)[0].permute(0, 3, 1, 4, 2).reshape(56, 28, 3)
    assert np.array_equal(np.rot90(p.numpy(), 1), q.numpy())
    assert q[-2, 1].min() > 0.9 and q[1, 1].max() < 0.5           # marker bottom-left, not top-left


def test_sources_and_containers():
    data = make_video(n=4)
    assert video_bytes(data_url(data)) == data
    with pytest.raises(ValueError, match="must be base64"):
        video_bytes("data:video/mp4,abc")
    with pytest.raises(ValueError, match="not accepted here"):
        from pathlib import Path
        video_bytes(Path("/nonexistent.mp4"), allow_paths=False)
    with pytest.raises(ValueError, match="more than the 100 allowed"):
        video_bytes(data, max_bytes=100)
    assert container_format(data) == "mov"
    for bad in (b"\x89PNG\r\n\x1a\n" + b"0" * 20, b"#EXTM3U\n#EXT-X-VERSION:3\nfile:///etc/passwd\n"):
        with pytest.raises(ValueError, match="unsupported video container"):
            load_video(bad, K3)
    with pytest.raises(ValueError, match="cannot read|corrupt|no frame"):
        load_video(data[:200], K3)


def test_limits_are_enforced():
    data = make_video(n=8, w=64, h=48)
    with pytest.raises(ValueError, match=r"64x48 = 3072 pixels, more than the 3000 allowed \(--max-video-pixels\)"):
        load_video(data, K3, limits=VideoLimits(max_pixels=3000))
    with pytest.raises(ValueError, match="took more than 1e-09 s"):
        load_video(make_video(n=8, codec="libvpx", fmt="webm"), K3, limits=VideoLimits(max_decode_seconds=1e-9))
    with pytest.raises(ValueError, match="more than the 1000 allowed"):
        load_video(data, K3, limits=VideoLimits(max_bytes=1000))
    for bad in ({"max_frames": 0}, {"max_bytes": -1}, {"max_decode_seconds": 0}):
        with pytest.raises(ValueError):
            VideoLimits(**bad)


def test_missing_pyav_names_the_extra(monkeypatch):
    data = make_video(n=4)
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ValueError, match=r"pip install 'kimik3\[video\]'"):
        load_video(data, K3)


# ---------------------------------------------------------------------------------------
# the prompt

def test_video_parts_render_their_chunk_prompts(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Watch:"},
                                         {"type": "video_url", "video_url": {"url": "data:,"}},
                                         {"type": "text", "text": "What happens?"}]}]
    video = VideoPrompt((("00:00:00.000", 2), ("00:00:00.500", 3)))
    text = tok.apply_chat_template(msgs, videos=[video], thinking=False)
    assert ("Watch:00:00:00.000<|media_begin|>video<|media_content|><|media_pad|><|media_pad|><|media_end|>"
            "00:00:00.500<|media_begin|>video<|media_content|>" + "<|media_pad|>" * 3 + "<|media_end|>What happens?"
            ) in text
    ids = tok.apply_chat_template(msgs, videos=[video], thinking=False, tokenize=True)
    pad = tok.convert_tokens_to_ids("<|media_pad|>")
    assert ids.count(pad) == 5 and ids.count(tok.convert_tokens_to_ids("<|media_begin|>")) == 2
    with pytest.raises(ValueError, match="more video parts than the 0 videos"):
        tok.apply_chat_template(msgs, thinking=False)
    with pytest.raises(ValueError, match="2 videos given but the conversation has 1 video parts"):
        tok.apply_chat_template(msgs, videos=[video, video], thinking=False)
    with pytest.raises(ValueError, match="plain text"):
        VideoPrompt((("<|open|>", 1),))


@pytest.fixture(scope="module")
def tok():
    import kimik3
    return kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
