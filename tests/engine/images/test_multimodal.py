"""Image prompts through the engine on a tiny random K3 with a vision tower: greedy tokens equal the
model called directly (``model(ids, pixel_values, grid_thws)`` on the growing sequence) under chunked
prefill, tiny blocks, prefix caching and preemption; images are encoded once (content-hash cache);
prefix-cache keys follow image content; bad images and bad image inputs fail clearly and leave
running requests untouched."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

import kimik3
from kimik3.engine import SamplingParams
from kimik3.engine.images.encoder_cache import EncoderCache
from kimik3.engine.images.multimodal import expand_media_pads
from kimik3.vision.preprocess import VisionInputs, preprocess_images
from tests.engine.fake_model import reference_greedy
from tests.engine.helpers import check_invariants, make_engine

MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return kimik3.load_model(tiny_ckpt["kimi_k3"], device="cpu", dtype=torch.float32)


def picture(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def png(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def image_prompt(model, vis: VisionInputs, seed: int = 0) -> list[int]:
    """Text, then each image's pads with text between: [t t t | pads_0 | t t t t t | pads_1 | ... | t t t t]."""
    pad = model.config.media_placeholder_token_id
    rng = random.Random(seed)
    words = [t for t in range(5, model.config.text.vocab_size) if t != pad]
    ids = [rng.choice(words) for _ in range(3)]
    for n in vis.num_tokens:
        ids += [pad] * n + [rng.choice(words) for _ in range(5)]
    return ids[:-1]


def reference(model, ids: list[int], vis: VisionInputs, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy decoding with the direct multimodal forward, recomputing the whole sequence each token."""
    seq = list(ids)
    for _ in range(max_tokens):
        seq.append(int(model(torch.tensor(seq), vis.pixel_values, vis.grid_thws)[-1].argmax()))
    return seq[len(ids):]


def drive(engine, arrivals: dict[int, dict[str, dict]], check=None, params=GREEDY, metrics=None
          ) -> dict[str, list[int]]:
    """Add prompts at their steps, step to the end; returns the tokens of each request (``metrics``, a
    dict, receives each request's final metrics)."""
    out: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or step <= max(arrivals, default=-1):
        for rid, prompt in arrivals.get(step, {}).items():
            engine.add_request(rid, prompt, params)
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids if delta.outputs else [])
            if delta.finished and metrics is not None:
                metrics[delta.request_id] = delta.metrics
        if check is not None:
            check(engine)
        step += 1
        assert step < 1000
    return out


@pytest.fixture(scope="module")
def images():
    """Two images of different sizes (12 and 2 tokens), and a same-size variant of the first."""
    a, b, a2 = picture(90, 60, 1), picture(16, 30, 2), picture(90, 60, 3)
    return {"ab": preprocess_images([a, b]), "a2b": preprocess_images([a2, b])}


def test_images_through_the_engine_match_the_model_and_cache_by_content(model, images):
    ab, a2b = images["ab"], images["a2b"]
    assert ab.num_tokens == [12, 2] and a2b.num_tokens == [12, 2]
    ids = image_prompt(model, ab)
    ref_ab, ref_a2b = reference(model, ids, ab), reference(model, ids, a2b)
    assert ref_ab != ref_a2b, "the image must matter to the output"
    engine = make_engine(model, block_size=3, max_num_seqs=4, max_num_batched_tokens=7, max_model_len=40,
                         extra_blocks=40)
    steps = spy_image_steps(engine)

    def check(e):
        check_invariants(e.kv, e.scheduler.running)

    first = drive(engine, {0: {"ab": {"prompt_token_ids": ids, "multi_modal_data": ab}}}, check)
    assert first["ab"] == ref_ab
    assert engine.stats().num_encoded_images == 2
    # the same images again (fresh tensors, equal content) hit the prefix cache and are not encoded;
    # a different first image shares only the text blocks before it and is the one image encoded
    again = preprocess_images([picture(90, 60, 1), picture(16, 30, 2)])
    text = [5, 6, 7, 8, 9, 10, 11]
    metrics: dict[str, dict] = {}
    out = drive(engine, {0: {"same": {"prompt_token_ids": ids, "multi_modal_data": again},
                             "other": {"prompt_token_ids": ids, "multi_modal_data": a2b},
                             "text": {"prompt_token_ids": text}}}, check, metrics=metrics)
    assert out["same"] == ref_ab and out["other"] == ref_a2b
    first_pad = ids.index(model.config.media_placeholder_token_id)
    assert metrics["same"]["num_prefix_hit_tokens"] == (len(ids) - 1) // 3 * 3
    assert metrics["other"]["num_prefix_hit_tokens"] == first_pad // 3 * 3     # text before image 0 only
    assert out["text"] == reference_greedy(model, text, MAX_TOKENS)
    assert engine.stats().num_encoded_images == 3
    assert engine.kv.blocks.num_free == engine.plan.num_usable_blocks
    # the 12-row image was sliced over several chunks, and some step packed two image requests
    assert sum(1 for s in steps if "ab" in s) >= 2
    assert any(len(s) >= 2 and min(r for rows in s.values() for r in rows) > 0 for s in steps)


def spy_image_steps(engine) -> list[dict[str, list[int]]]:
    """Record, per step with image rows, each request's packed embed rows (checked against its pads)."""
    steps: list[dict[str, list[int]]] = []
    build = engine.runner.batches.build

    def spy(out):
        step = build(out)
        input_ids, batch = step.input_ids, step.batch
        if batch.embed_rows is not None:
            pad = engine.model.config.media_placeholder_token_id
            assert torch.equal(batch.embed_rows, (input_ids == pad).nonzero().view(-1))
            assert batch.embeds.shape == (batch.embed_rows.numel(), engine.model.config.text.hidden_size)
            starts = batch.cu_seqlens.tolist()
            steps.append({c.req.request_id: [r for r in batch.embed_rows.tolist() if starts[k] <= r < starts[k + 1]]
                          for k, c in enumerate(out.chunks) if c.req.mm is not None})
        return step
    engine.runner.batches.build = spy
    return steps


def test_prefix_hits_follow_image_content(model, images):
    ab, a2b = images["ab"], images["a2b"]
    ids = image_prompt(model, ab)
    engine = make_engine(model, block_size=3, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=40,
                         extra_blocks=40)
    hit = {}
    for rid, vis in (("ab", ab), ("a2b", a2b), ("ab-again", ab)):
        engine.add_request(rid, {"prompt_token_ids": ids, "multi_modal_data": vis}, GREEDY)
        req = engine.groups[rid].children[0]
        while engine.has_unfinished_requests():
            engine.step()
        hit[rid] = req.out.num_prefix_hit_tokens
    first_pad = ids.index(model.config.media_placeholder_token_id)
    assert hit["ab"] == 0
    assert 0 < hit["a2b"] <= first_pad                  # only the text before the changed image
    assert hit["ab-again"] == (len(ids) - 1) // 3 * 3   # everything but the block holding the last token


def test_preempted_requests_recompute_without_reencoding(model, images):
    ab, a2b = images["ab"], images["a2b"]
    ids = image_prompt(model, ab)
    engine = make_engine(model, block_size=2, max_num_seqs=3, max_num_batched_tokens=6, max_model_len=32,
                         extra_blocks=0, enable_prefix_caching=False)
    out = drive(engine, {0: {"x": {"prompt_token_ids": ids, "multi_modal_data": ab}},
                         2: {"y": {"prompt_token_ids": ids, "multi_modal_data": a2b}}})
    assert engine.scheduler.num_preemptions > 0
    assert out["x"] == reference(model, ids, ab) and out["y"] == reference(model, ids, a2b)
    assert engine.stats().num_encoded_images == 3       # a, b, a2: each once despite recomputes


def test_bad_images_and_image_inputs_fail_clearly_and_leave_running_requests_alone(model, images, tiny_ckpt):
    ab = images["ab"]
    ids = image_prompt(model, ab)
    engine = make_engine(model, block_size=3, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=40,
                         extra_blocks=20)
    engine.add_request("good", {"prompt_token_ids": ids, "multi_modal_data": ab}, GREEDY)
    engine.step()                                            # "good" is mid-prefill
    pad = model.config.media_placeholder_token_id
    bad_files = {
        "corrupt": (png(picture(20, 20, 0))[:40] + b"garbage", "image 1: image bytes: corrupt"),
        "zero size": (Image.new("RGB", (0, 4)), "zero size"),
        "unsupported": (png(picture(20, 20, 0), "BMP"), "unsupported image format BMP"),
        "extreme aspect": (Image.new("RGB", (1, 100000)), "extreme aspect ratio"),
        "not an image": (b"hello world", "cannot identify an image"),
    }
    for name, (src, match) in bad_files.items():
        with pytest.raises(ValueError, match=match):
            preprocess_images([picture(16, 16, 0), src])
    wrong = VisionInputs(ab.pixel_values, ab.grid_thws, [12, 3], ab.sizes)
    bad_requests = {
        "pad count": ({"prompt_token_ids": ids[:-9], "multi_modal_data": ab}, "holds 12 media pad token.*need 14"),
        "no images for pads?": ({"prompt_token_ids": ids + [pad], "multi_modal_data": ab}, "holds 15 media pad"),
        "unknown key": ({"prompt_token_ids": ids, "images": ab}, r"unknown prompt key\(s\) \['images'\]"),
        "not VisionInputs": ({"prompt_token_ids": ids, "multi_modal_data": [ab.pixel_values]}, "must be a VisionInputs"),
        "token count": ({"prompt_token_ids": ids, "multi_modal_data": wrong}, "num_tokens=3 but its 4x2 patch grid"),
        "pixels": ({"prompt_token_ids": ids, "multi_modal_data": VisionInputs(ab.pixel_values[:-1], ab.grid_thws,
                                                                               ab.num_tokens, ab.sizes)},
                   "pixel_values must be a float tensor of shape"),
        "too long": ({"prompt_token_ids": image_prompt(model, preprocess_images([picture(200, 150, 4)]))},
                     "more than max_model_len=40"),
    }
    for name, (prompt, match) in bad_requests.items():
        with pytest.raises(ValueError, match=match):
            engine.add_request(name, prompt, GREEDY)
    big = preprocess_images([picture(200, 150, 4)])
    with pytest.raises(ValueError, match=r"\(48 of them image tokens\).*fewer or smaller images"):
        engine.add_request("big", {"prompt_token_ids": image_prompt(model, big), "multi_modal_data": big}, GREEDY)
    with pytest.raises(ValueError, match="images given twice"):
        engine.add_request("twice", {"prompt_token_ids": ids, "multi_modal_data": ab}, GREEDY, multi_modal_data=ab)
    assert list(engine.groups) == ["good"] and len(engine.scheduler.waiting) + len(engine.scheduler.running) == 1
    out = drive(engine, {})
    assert out["good"] == reference(model, ids, ab)
    # a text-only model refuses images
    text_only = make_engine(kimik3.load_model(tiny_ckpt["kimi_linear"], device="cpu", dtype=torch.float32),
                            block_size=4, max_model_len=40, extra_blocks=4)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.add_request("img", {"prompt_token_ids": [5, 6]}, GREEDY, multi_modal_data=ab)


def test_block_keys_name_the_images_in_each_block(model, images):
    ab, a2b = images["ab"], images["a2b"]
    ids = image_prompt(model, ab)                 # 3 text, 12 pads (3..14), 5 text, 2 pads (20, 21), 4 text
    engine = make_engine(model, block_size=4, max_model_len=40, extra_blocks=4)
    engine.add_request("x", {"prompt_token_ids": ids, "multi_modal_data": ab}, GREEDY)
    engine.add_request("y", {"prompt_token_ids": ids, "multi_modal_data": a2b}, GREEDY)
    x, y = engine.groups["x"].children[0], engine.groups["y"].children[0]
    assert x.mm.pad_positions == tuple(range(3, 15)) + (20, 21) and x.mm.row_offsets == (0, 12, 14)
    assert list(x.mm.items_in(0, 3)) == [] and list(x.mm.items_in(12, 21)) == [0, 1]
    assert x.mm.rows_in(12, 21) == (9, 13)
    keys = [k is not None for k in x.extra_keys]
    assert keys == [True, True, True, True, False, True, False]    # blocks 0-3 hold image 0, block 5 image 1
    assert x.extra_keys[1] != x.extra_keys[2]                        # row offset 1 vs 5 within image 0
    assert x.extra_keys[5] == y.extra_keys[5] and x.extra_keys[0] != y.extra_keys[0]
    assert x.block_hashes[0] != y.block_hashes[0]                    # so no block is shared


def test_encoder_cache_is_a_bounded_lru():
    cache = EncoderCache(max_tokens=10)
    for name, n in (("a", 4), ("b", 4)):
        cache.put(name.encode(), torch.zeros(n, 2))
    assert cache.get(b"a") is not None          # a is now the most recent
    cache.put(b"c", torch.zeros(4, 2))         # evicts b, the least recently used
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.num_tokens == 8
    cache.put(b"huge", torch.zeros(11, 2))     # larger than the bound: not kept, nothing evicted
    assert cache.get(b"huge") is None and cache.num_tokens == 8


def test_prefix_hit_ending_inside_an_image_takes_the_rest_of_its_rows(model, images):
    """An aborted request leaves blocks cached up to the middle of image 0; the same prompt again resumes
    there, slicing image 0's cached embeddings from row 9 on, and encodes only image 1."""
    ab = images["ab"]
    ids = image_prompt(model, ab)                 # pads of image 0 at positions 3..14
    engine = make_engine(model, block_size=3, max_num_seqs=2, max_num_batched_tokens=7, max_model_len=40,
                         extra_blocks=20)
    engine.add_request("first", {"prompt_token_ids": ids, "multi_modal_data": ab}, GREEDY)
    engine.step()
    engine.step()                                 # 14 tokens computed: blocks 0-3 (12 tokens) are cached
    engine.abort_request("first")
    engine.step()
    assert engine.stats().num_encoded_images == 1
    steps = spy_image_steps(engine)
    engine.add_request("again", {"prompt_token_ids": ids, "multi_modal_data": ab}, GREEDY)
    req = engine.groups["again"].children[0]
    out = drive(engine, {})
    assert req.out.num_prefix_hit_tokens == 12
    assert out["again"] == reference(model, ids, ab)
    assert engine.stats().num_encoded_images == 2
    assert steps[0]["again"] == [0, 1, 2]        # positions 12..14: the last three rows of image 0


def test_expand_media_pads_one_pad_per_item():
    ids = [5, 163605, 6, 163605, 7]
    assert expand_media_pads(ids, [2, 3], 163605) == [5, 163605, 163605, 6, 163605, 163605, 163605, 7]
    with pytest.raises(ValueError, match="2 media pad token.*3 image"):
        expand_media_pads(ids, [1, 1, 1], 163605)
