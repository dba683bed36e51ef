"""The Python API as a vLLM user writes it: LLM(model=..., vLLM keyword arguments), LLM.chat, vLLM's
multi_modal_data form (placeholders expanded), use_tqdm, generation_config.json defaults, K3 text-only."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import kimik3
from kimik3 import LLM, SamplingParams
from kimik3.chat import ImagePrompt
from kimik3.testing import make_tiny_checkpoint, tiny_k3_config
from kimik3.tokenizer_build import build_tiny_tokenizer, model_token_ids
from kimik3.vision.preprocess import count_image_tokens, load_media_processor_config, preprocess_images

GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(kimik3.DEFAULT_MODEL), dtype="float32", max_model_len="2k", max_num_seqs=4,
               enforce_eager=True, gpu_memory_utilization=0.5, kv_cache_dtype="auto", max_logprobs=3,
               limit_mm_per_prompt={"image": 2, "video": 1}, trust_remote_code=True, use_tqdm_on_load=False)


def pictures():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((60, 40), (28, 56))]


def test_keyword_arguments_reach_the_engine(llm):
    cfg = llm.engine.config
    assert cfg.max_model_len == 2000 and cfg.max_num_seqs == 4 and cfg.enforce_eager
    assert cfg.gpu_memory_utilization == 0.5 and cfg.max_logprobs == 3
    assert llm.engine.model.dtype == torch.float32
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['swap_space'\]"):
        LLM(str(kimik3.DEFAULT_MODEL), swap_space=4)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model="/no/such/checkpoint")


def test_max_logprobs_limits_requests(llm):
    with pytest.raises(ValueError, match="more than max_logprobs=3"):
        llm.generate("Hi", SamplingParams(max_tokens=2, logprobs=4))
    out = llm.generate("Hi", SamplingParams(max_tokens=2, logprobs=3, temperature=0), use_tqdm=False)
    assert all(len(lp) >= 3 for lp in out[0].outputs[0].logprobs)


def test_chat_renders_the_checkpoint_chat_format(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(msgs, tokenize=True)
    want = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    got = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    assert got.prompt_token_ids == ids and got.outputs[0].token_ids == want.outputs[0].token_ids
    # two conversations at once, thinking off through chat_template_kwargs
    off = tok.apply_chat_template(msgs, tokenize=True, thinking=False)
    both = llm.chat([msgs, msgs], GREEDY, use_tqdm=False, chat_template_kwargs={"thinking": False})
    assert [o.prompt_token_ids for o in both] == [off, off]
    with pytest.raises(ValueError, match="chat_template_kwargs.enable_magic"):
        llm.chat(msgs, GREEDY, chat_template_kwargs={"enable_magic": True})
    # the server's keys: enable_thinking, preserve_thinking, thinking_effort (medium as the prompt lists it)
    got = llm.chat(msgs, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert got.prompt_token_ids == off
    medium = llm.chat(msgs, GREEDY, use_tqdm=False, chat_template_kwargs={"thinking_effort": "medium"})[0]
    assert medium.prompt_token_ids == tok.apply_chat_template(msgs, tokenize=True, thinking_effort="medium")
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "reasoning_content": "old thought",
                                                  "content": "b"}, {"role": "user", "content": "c"}]
    dropped = [history[0], {"role": "assistant", "content": "b"}, history[2]]
    kept = llm.chat(history, GREEDY, use_tqdm=False, chat_template_kwargs={"preserve_thinking": True})[0]
    lost = llm.chat(history, GREEDY, use_tqdm=False, chat_template_kwargs={"preserve_thinking": False})[0]
    assert kept.prompt_token_ids == tok.apply_chat_template(history, tokenize=True)
    assert lost.prompt_token_ids == tok.apply_chat_template(dropped, tokenize=True) != kept.prompt_token_ids


def test_chat_with_a_pil_image(llm):
    img = pictures()[0]
    msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "Hi"}]}]
    out = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    cfg = load_media_processor_config(kimik3.DEFAULT_MODEL)
    n = count_image_tokens(60, 40, cfg)
    want = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}], tokenize=True,
        images=[ImagePrompt(60, 40, n)])
    assert out.prompt_token_ids == want


def test_chat_with_an_image_and_a_video(llm):
    pytest.importorskip("av")
    from kimik3.chat import VideoPrompt
    from kimik3.vision.preprocess import concat_vision_inputs
    from kimik3.vision.video import VideoSampling, load_video
    from tests.vision.videos import data_url, make_video
    img, video = pictures()[0], make_video(n=16, fps=4)
    content = [{"type": "image_pil", "image_pil": img}, {"type": "video_url", "video_url": {"url": data_url(video)}},
               {"type": "text", "text": "Hi"}]
    out = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False,
                   media_io_kwargs={"video": {"fps": 2}})[0]
    # 16 frames at 4 fps sampled at 2: 8 frames, indices 0 2 4 6 | 9 11 13 15 -> chunks at 0 s and 9/4 = 2.25 s;
    # a 64x48 frame is 2x3 tokens
    cfg = load_media_processor_config(kimik3.DEFAULT_MODEL)
    want = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Hi"}]}],
        tokenize=True, images=[ImagePrompt(60, 40, count_image_tokens(60, 40, cfg))],
        videos=[VideoPrompt((("00:00:00.000", 6), ("00:00:02.250", 6)))])
    assert out.prompt_token_ids == want
    vision = concat_vision_inputs([preprocess_images([img], cfg), load_video(video, cfg, VideoSampling(fps=2)).vision])
    ref = llm.generate({"prompt_token_ids": want, "multi_modal_data": vision}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    as_bytes = [{"type": "video", "video": video}, {"type": "text", "text": "Hi"}]
    one = llm.chat([{"role": "user", "content": as_bytes}], GREEDY, use_tqdm=False)[0]    # default: 8 fps -> all 16
    assert one.prompt_token_ids.count(llm.engine.model.config.media_placeholder_token_id) == 4 * 6
    with pytest.raises(ValueError, match=r"more than limit_mm_per_prompt\['video'\]=1"):
        llm.chat([{"role": "user", "content": as_bytes * 2}], GREEDY)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: video_url must be a data: URL"):
        llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "/tmp/x.mp4"}}]}], GREEDY)
    with pytest.raises(ValueError, match=r"media_io_kwargs.video: unsupported key\(s\) \['frames'\]"):
        llm.chat([{"role": "user", "content": as_bytes}], GREEDY, media_io_kwargs={"video": {"frames": 2}})


def test_vllm_multi_modal_data_with_one_pad_per_image(llm):
    imgs = pictures()
    tok = llm.get_tokenizer()
    cfg = load_media_processor_config(kimik3.DEFAULT_MODEL)
    pad = llm.engine.model.config.media_placeholder_token_id
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]
    msgs = [{"role": "user", "content": content}]
    one_pad = tok.apply_chat_template(msgs, tokenize=True, images=[ImagePrompt(*im.size, 1) for im in imgs])
    assert one_pad.count(pad) == 2                                   # the HF processor's form
    counts = [count_image_tokens(*im.size, cfg) for im in imgs]
    expanded = tok.apply_chat_template(msgs, tokenize=True, images=[ImagePrompt(*im.size, n)
                                                                     for im, n in zip(imgs, counts)])
    vision = preprocess_images(imgs, cfg)
    want = llm.generate({"prompt_token_ids": expanded, "multi_modal_data": vision}, GREEDY, use_tqdm=False)[0]
    got = llm.generate({"prompt_token_ids": one_pad, "multi_modal_data": {"image": imgs}}, GREEDY,
                       use_tqdm=False)[0]
    assert got.prompt_token_ids == expanded and got.outputs[0].token_ids == want.outputs[0].token_ids
    # already expanded pads are kept; a single image may come bare (not in a list)
    single = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=True,
                                     images=[ImagePrompt(*imgs[0].size, counts[0])])
    out = llm.generate({"prompt_token_ids": single, "multi_modal_data": {"image": imgs[0]}}, GREEDY, use_tqdm=False)
    assert out[0].prompt_token_ids == single
    # the prompt as text: its <|media_pad|> placeholders are read as the special token
    text = tok.apply_chat_template(msgs, tokenize=False, images=[ImagePrompt(*im.size, 1) for im in imgs])
    got = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, GREEDY, use_tqdm=False)[0]
    assert got.prompt_token_ids == expanded
    # vLLM's / TensorRT-LLM's raw form: <|kimi_image_placeholder|> where each image goes
    raw = text.replace(f"<|media_begin|>image {imgs[0].size[0]}x{imgs[0].size[1]}<|media_content|><|media_pad|>"
                       f"<|media_end|>", "<|kimi_image_placeholder|>", 1)
    raw = raw.replace(f"<|media_begin|>image {imgs[1].size[0]}x{imgs[1].size[1]}<|media_content|><|media_pad|>"
                      f"<|media_end|>", "<|kimi_image_placeholder|>", 1)
    assert raw.count("<|kimi_image_placeholder|>") == 2 and "<|media_pad|>" not in raw
    got = llm.generate({"prompt": raw, "multi_modal_data": {"image": imgs}}, GREEDY, use_tqdm=False)[0]
    assert got.prompt_token_ids == expanded and got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="holds 2 <\\|kimi_image_placeholder\\|> but multi_modal_data gives 1"):
        llm.generate({"prompt": raw, "multi_modal_data": {"image": imgs[:1]}}, GREEDY)
    with pytest.raises(ValueError, match="more than limit_mm_per_prompt\\['image'\\]=2"):
        llm.generate({"prompt_token_ids": one_pad, "multi_modal_data": {"image": imgs * 2}}, GREEDY)
    with pytest.raises(ValueError, match="media pad"):
        llm.generate({"prompt_token_ids": one_pad, "multi_modal_data": {"image": imgs[:1]}}, GREEDY)
    with pytest.raises(ValueError, match="multi_modal_data must be"):
        llm.generate({"prompt_token_ids": one_pad, "multi_modal_data": {"audio": [1]}}, GREEDY)


def test_vllm_multi_modal_video_frames(llm):
    frames = [pictures()[0]] * 2
    cfg = load_media_processor_config(kimik3.DEFAULT_MODEL)
    pad = llm.engine.model.config.media_placeholder_token_id
    prompt = [5, 6, pad, 7]
    out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"video": frames}}, GREEDY, use_tqdm=False)
    n = count_image_tokens(60, 40, cfg)      # a 2-frame chunk has one frame's tokens (temporal pooling)
    assert out[0].prompt_token_ids == [5, 6] + [pad] * n + [7]


def test_use_tqdm_shows_progress(llm, capfd):
    llm.generate(["a", "b"], GREEDY)                 # vLLM's default: a bar
    assert "generate" in capfd.readouterr().err
    llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert "generate" not in capfd.readouterr().err


def test_generation_config_supplies_default_sampling(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(kimik3.DEFAULT_MODEL, d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    llm = LLM(str(d), max_model_len=256, max_num_seqs=2, use_tqdm_on_load=False)
    p = llm.get_default_sampling_params()
    assert p.temperature == 0.0 and p.max_tokens == 3
    assert len(llm.generate("Hello", use_tqdm=False)[0].outputs[0].token_ids) == 3
    plain = LLM(str(d), max_model_len=256, max_num_seqs=2, generation_config="vllm", use_tqdm_on_load=False)
    assert plain.get_default_sampling_params().max_tokens == SamplingParams().max_tokens


def test_language_model_only_skips_the_vision_tower():
    llm = LLM(str(kimik3.DEFAULT_MODEL), max_model_len=256, max_num_seqs=2, language_model_only=True,
              use_tqdm_on_load=False)
    assert llm.engine.model.config.vision is None
    assert not any(n.startswith("vision.") for n, _ in llm.engine.model.named_parameters())
    with pytest.raises(ValueError, match="no vision tower"):
        llm.generate({"prompt_token_ids": [1, 2, llm.engine.model.config.media_placeholder_token_id],
                      "multi_modal_data": {"image": pictures()[0]}}, GREEDY)


def test_k3_text_only_checkpoint_chats_in_k3_format(tmp_path):
    """model_type kimi_linear with the K3 fields (the official K3 text config class) beside the K3 tokenizer."""
    ids = model_token_ids(512)
    cfg = tiny_k3_config(vocab_size=ids["vocab_size"], bos=ids["bos_token_id"], eos=ids["eos_token_id"],
                         pad=ids["pad_token_id"], media=ids["media_placeholder_token_id"], vision=False)["text_config"]
    assert cfg["model_type"] == "kimi_linear" and cfg["attn_res_block_size"]
    make_tiny_checkpoint(tmp_path, config=cfg)
    build_tiny_tokenizer(tmp_path, base_vocab_size=512, seed=1)
    llm = LLM(str(tmp_path), max_model_len=256, max_num_seqs=2, use_tqdm_on_load=False)
    tok = llm.get_tokenizer()
    assert tok.chat_format == "k3"
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    text = tok.decode(out.prompt_token_ids)
    assert "<|open|>" in text and "<|im_user|>" not in text


def test_vllm_logprob_shape_and_cumulative_logprob(llm):
    import math

    from kimik3.engine.core.output import Logprob
    tok = llm.get_tokenizer()
    out = llm.generate("Hi", SamplingParams(max_tokens=4, logprobs=3, temperature=0), use_tqdm=False)[0].outputs[0]
    total = []
    for tid, lp in zip(out.token_ids, out.logprobs):
        assert all(isinstance(v, Logprob) for v in lp.values())
        ranked = sorted(lp, key=lambda t: -lp[t].logprob)
        assert [lp[t].rank for t in ranked[:3]] == [1, 2, 3]
        assert lp[tid].rank == 1                                   # greedy: the sampled token is the most likely
        assert all(lp[t].decoded_token == tok.decode([t]) for t in lp)
        total.append(lp[tid].logprob)
    assert out.cumulative_logprob == pytest.approx(math.fsum(total), abs=1e-9)
    sampled = llm.generate("Hi", SamplingParams(max_tokens=6, logprobs=0, temperature=1.0, seed=3),
                           use_tqdm=False)[0].outputs[0]
    assert all(set(lp) == {t} and lp[t].rank is None for t, lp in zip(sampled.token_ids, sampled.logprobs))
    plain = llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_tokenizer_path_and_the_apis_kimik3_does_not_provide(llm):
    other = LLM(str(kimik3.DEFAULT_MODEL), tokenizer=str(kimik3.DEFAULT_MODEL), dtype="float32", max_model_len=256,
                max_num_seqs=2, enforce_eager=True, use_tqdm_on_load=False)
    assert other.get_tokenizer().encode("Hello world") == llm.get_tokenizer().encode("Hello world")
    for name in ("encode", "embed", "classify", "score", "reward", "beam_search"):
        with pytest.raises(NotImplementedError, match=f"LLM.{name} is not supported.*LLM.generate"):
            getattr(llm, name)("x")


def test_disable_log_stats_as_vllm(llm, caplog):
    """vLLM's LLM keyword: True by default (nothing logged); False logs serve's stats line while generate runs."""
    import logging
    noisy = LLM(str(kimik3.DEFAULT_MODEL), max_model_len=256, max_num_seqs=2, use_tqdm_on_load=False,
                disable_log_stats=False)
    with caplog.at_level(logging.INFO, logger="kimik3.engine.core.stats"):
        llm.generate(["Hi there"], GREEDY, use_tqdm=False)
        assert not [r for r in caplog.records if "throughput" in r.message]
        noisy.generate(["Hi there", "Hello"], GREEDY, use_tqdm=False)
    lines = [r.message for r in caplog.records if "Avg prompt throughput" in r.message]
    assert len(lines) == 1 and "Avg generation throughput" in lines[0] and "KV cache usage" in lines[0]
    assert float(lines[0].split("Avg prompt throughput: ")[1].split()[0]) > 0
