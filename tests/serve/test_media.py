"""Media through ``kimik3 serve`` (issue #54) on the embedded tiny K3, through the official ``openai`` client:
``video_url`` parts as data: URLs and as file:// URLs under ``--allowed-local-media-path``, frame sampling at
the request's fps (``media_io_kwargs``) with the chunk timestamps in the prompt, every limit a clear 400
before anything costly; and the raw ``<|kimi_image_placeholder|>`` prompt on /v1/completions."""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

import kimik3
from kimik3.chat import ImagePrompt, VideoPrompt
from kimik3.serve import add_serve_arguments, build_app
from tests.serve.conftest import MODEL, LiveServer, start_fake_server
from tests.serve.test_errors import png_data_url
from tests.vision.videos import data_url, make_video

pytest.importorskip("av")
TOK = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
PAD = TOK.convert_tokens_to_ids("<|media_pad|>")
VIDEO = make_video(n=16, fps=4)           # 4 s; at 2 fps: frames 0 2 4 6 | 9 11 13 15, chunks at 0 and 2.25 s


def video_msgs(url: str, *extra: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}, *extra,
                                         {"type": "text", "text": "What happens?"}]}]


def want_ids(videos: list[VideoPrompt], images=None, extra: int = 0) -> list[int]:
    content = [{"type": "video"}] + [{"type": "image"}] * extra + [{"type": "text", "text": "What happens?"}]
    return TOK.apply_chat_template([{"role": "user", "content": content}], tokenize=True, videos=videos,
                                   images=images)


TWO_CHUNKS = VideoPrompt((("00:00:00.000", 6), ("00:00:02.250", 6)))   # a 64x48 frame is 2x3 tokens


def serve(tmp_path, *flags: str) -> LiveServer:
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--max-model-len", "1024", "--max-num-seqs", "4", "--served-model-name", MODEL, *flags])
    return LiveServer(build_app(args))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "clip.mp4").write_bytes(VIDEO)
    (root / "outside.mp4").write_bytes(VIDEO)
    (root / "allowed" / "escape.mp4").symlink_to(root / "outside.mp4")
    return root


@pytest.fixture(scope="module")
def real(media_dir):
    s = serve(media_dir, "--allowed-local-media-path", str(media_dir / "allowed"), "--max-video-frames", "16",
              "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 1}))
    yield s
    s.stop()


def _post(s: LiveServer, body: dict) -> httpx.Response:
    return httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=120)


def _error(r: httpx.Response, code: str | None, *contains: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert code is None or err["code"] == code, err
    for c in contains:
        assert c in err["message"], err
    return err


def test_video_url_through_the_openai_client(real):
    c = real.client()
    msgs = video_msgs(data_url(VIDEO))
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                  extra_body={"media_io_kwargs": {"video": {"fps": 2}}})
    ids = want_ids([TWO_CHUNKS])
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].finish_reason in ("length", "stop")
    assert ids.count(PAD) == 12
    text = TOK.decode(ids)
    assert ("00:00:00.000<|media_begin|>video<|media_content|>" + "<|media_pad|>" * 6 + "<|media_end|>"
            "00:00:02.250<|media_begin|>video<|media_content|>") in text
    # streamed, the same prompt; the default rate (the checkpoint's 8 fps, above the video's 4) takes all 16
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    stamps = ("00:00:00.000", "00:00:01.000", "00:00:02.000", "00:00:03.000")
    assert chunks[-1].usage.prompt_tokens == len(want_ids([VideoPrompt(tuple((t, 6) for t in stamps))]))
    tok = httpx.post(real.url + "/tokenize", json={"model": MODEL, "messages": msgs}).json()
    assert tok["tokens"] == want_ids([VideoPrompt(tuple((t, 6) for t in stamps))])
    tok = httpx.post(real.url + "/tokenize", json={"model": MODEL, "messages": msgs,
                                                    "media_io_kwargs": {"video": {"fps": 2}}}).json()
    assert tok["tokens"] == ids and tok["count"] == r.usage.prompt_tokens


def test_video_and_images_keep_their_order(real):
    img = {"type": "image_url", "image_url": {"url": png_data_url()}}
    r = real.client().chat.completions.create(model=MODEL, messages=video_msgs(data_url(VIDEO), img), max_tokens=2,
                                              extra_body={"media_io_kwargs": {"video": {"num_frames": 8}}})
    assert r.usage.prompt_tokens == len(want_ids([TWO_CHUNKS], [ImagePrompt(30, 20, 2)], extra=1))


def test_local_files_only_under_the_allowed_folder(real, media_dir):
    c = real.client()
    good = c.chat.completions.create(model=MODEL, messages=video_msgs(f"file://{media_dir}/allowed/clip.mp4"),
                                     max_tokens=2, extra_body={"media_io_kwargs": {"video": {"fps": 2}}})
    assert good.usage.prompt_tokens == len(want_ids([TWO_CHUNKS]))
    for url, contains in ((f"file://{media_dir}/outside.mp4", "must lie under --allowed-local-media-path"),
                          (f"file://{media_dir}/allowed/escape.mp4", "must lie under"),   # a symlink out
                          (f"file://{media_dir}/allowed/../outside.mp4", "must lie under"),
                          (f"file://{media_dir}/allowed/none.mp4", "no such file"),
                          ("file://otherhost/x.mp4", "not on host 'otherhost'"),
                          (f"{media_dir}/allowed/clip.mp4", "file paths are refused"),
                          ("https://example.com/a.mp4", "no network")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=video_msgs(url), max_tokens=2)
        assert contains in e.value.body["message"] and e.value.body["param"] == "messages[0].content[0]", url


def test_sampling_and_size_limits(real, media_dir):
    long = make_video(n=80, fps=10)                        # 8 s: 64 frames at the default 8 fps
    ok = _post(real, {"messages": video_msgs(data_url(long))})   # the default rate is lowered to 16 frames
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == len(
        want_ids([VideoPrompt(tuple((t, 6) for t in ("00:00:00.000", "00:00:02.100", "00:00:04.200",
                                                     "00:00:06.300")))]))
    _error(_post(real, {"messages": video_msgs(data_url(long)), "media_io_kwargs": {"video": {"fps": 4}}}),
           "invalid_video", "takes 32 frames, more than this server's limit of 16 (--max-video-frames)",
           "fps <= 2")
    _error(_post(real, {"messages": video_msgs(data_url(VIDEO)), "media_io_kwargs": {"video": {"step": 1}}}),
           None, "unsupported key(s) ['step']")
    _error(_post(real, {"messages": video_msgs(data_url(VIDEO)), "media_io_kwargs": {"image": {}}}),
           None, "unsupported key(s) ['image']")
    two = video_msgs(data_url(VIDEO), {"type": "video_url", "video_url": {"url": data_url(VIDEO)}})
    _error(_post(real, {"messages": two}), "too_many_videos", "--limit-mm-per-prompt video=1")
    _error(_post(real, {"messages": video_msgs(data_url(b"\x00\x00\x00\x18ftypisom" + b"\x01" * 64))}),
           "invalid_video", "messages[0].content[0]: bad video")
    _error(_post(real, {"messages": video_msgs("data:video/mp4;base64,!!")}), "invalid_video", "base64")


def test_limits_from_flags(tmp_path, monkeypatch):
    s = serve(tmp_path, "--max-video-bytes", "30000", "--max-video-pixels", "3200", "--max-model-len", "64")
    try:
        big = make_video(n=200, w=128, h=96)
        assert len(big) > 30000
        _error(_post(s, {"messages": video_msgs(data_url(big))}), "invalid_video", "more than the 30000 allowed",
               "(--max-video-bytes)")
        _error(_post(s, {"messages": video_msgs(data_url(make_video(n=2, w=64, h=56)))}), "invalid_video",
               "64x56 = 3584 pixels", "(--max-video-pixels)")
        # a video that cannot fit the context is refused from its header, before any frame is decoded:
        # 300 frames at 30 fps -> 80 at 8 fps -> 20 chunks of a 56x56 frame's 2x2 tokens = 80 > 63
        import kimik3.vision.video as video
        monkeypatch.setattr(video, "_decode", lambda *a, **k: pytest.fail("decoded a video that cannot fit"))
        _error(_post(s, {"messages": video_msgs(data_url(make_video(n=300, fps=30, w=56, h=56)))}),
               "context_length_exceeded", "need 80 tokens ([80] per item)", "lower fps")
    finally:
        s.stop()


def test_media_io_kwargs_flag_sets_the_default(tmp_path):
    s = serve(tmp_path, "--media-io-kwargs", json.dumps({"video": {"num_frames": 4}}))
    try:
        r = _post(s, {"messages": video_msgs(data_url(VIDEO))})
        assert r.json()["usage"]["prompt_tokens"] == len(want_ids([VideoPrompt((("00:00:00.000", 6),))]))
        r = _post(s, {"messages": video_msgs(data_url(VIDEO)), "media_io_kwargs": {"video": {"fps": 2}}})
        assert r.json()["usage"]["prompt_tokens"] == len(want_ids([TWO_CHUNKS]))   # fps drops the default count
    finally:
        s.stop()
    with pytest.raises(SystemExit):
        add_serve_arguments(argparse.ArgumentParser()).parse_args(["--media-io-kwargs", '{"video": {"fp": 1}}'])


def test_missing_pyav_is_a_400_naming_the_extra(real, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    _error(_post(real, {"messages": video_msgs(data_url(VIDEO))}), "video_unsupported",
           "pip install 'kimik3[video]'")


def test_text_only_model_and_no_local_files():
    s = start_fake_server()
    try:
        _error(_post(s, {"messages": video_msgs(data_url(VIDEO))}), "images_unsupported", "no vision tower")
        _error(_post(s, {"messages": video_msgs("file:///etc/passwd")}), "unsupported_video_url",
               "--allowed-local-media-path")
        img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]
        _error(_post(s, {"messages": img}), "unsupported_image_url", "local files are not served")
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------
# the raw <|kimi_image_placeholder|> prompt on /v1/completions

def test_raw_placeholder_prompt_with_media_urls(real):
    c = real.client()
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    one_pad = TOK.apply_chat_template(msgs, tokenize=False, images=[ImagePrompt(60, 40, 1)], thinking=False)
    raw = one_pad.replace("<|media_begin|>image 60x40<|media_content|><|media_pad|><|media_end|>",
                          "<|kimi_image_placeholder|>")
    assert raw.count("<|kimi_image_placeholder|>") == 1 and "<|media_pad|>" not in raw
    expanded = TOK.apply_chat_template(msgs, tokenize=True, images=[ImagePrompt(60, 40, 6)], thinking=False)
    greedy = {"max_tokens": 4, "temperature": 0, "extra_body": {"media_urls": {"image": [url]}}}
    a = c.completions.create(model=MODEL, prompt=raw, **greedy)
    b = c.completions.create(model=MODEL, prompt=TOK.encode(one_pad, allow_special=True), **greedy)  # HF form
    d = c.completions.create(model=MODEL, prompt=expanded, **greedy)                                   # expanded
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == d.usage.prompt_tokens == len(expanded)
    assert a.choices[0].text == b.choices[0].text == d.choices[0].text
    echo = c.completions.create(model=MODEL, prompt=raw, echo=True, **greedy)
    assert echo.choices[0].text == raw + a.choices[0].text
    # refusals, each naming the fix
    cases = [({"prompt": raw}, "missing_images", "media_urls"),
             ({"prompt": raw + raw, "media_urls": {"image": [url]}}, None, "holds 2 <|kimi_image_placeholder|>"),
             ({"prompt": "no placeholder", "media_urls": {"image": [url]}}, None, "holds no <|kimi_image_placeholder|>"),
             ({"prompt": [raw, raw], "media_urls": {"image": [url]}}, None, "not a batch"),
             ({"prompt": raw, "media_urls": {"video": [url]}}, "unsupported_field", "/v1/chat/completions"),
             ({"prompt": raw, "media_urls": {"image": ["https://x.example/a.png"]}}, "unsupported_image_url",
              "no network"),
             ({"prompt": raw, "media_urls": {"image": [url] * 3}}, "too_many_images", "image=2")]
    for body, code, contains in cases:
        r = httpx.post(real.url + "/v1/completions", json={"model": MODEL, "max_tokens": 1, **body}, timeout=60)
        _error(r, code, contains)
    s = start_fake_server()
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": raw, "media_urls": {"image": [url]}})
        _error(r, "images_unsupported", "no vision tower")
    finally:
        s.stop()
