"""kimik3/vision/prompt.py: image prompt ids, pad expansion, embedding merge."""

from __future__ import annotations

import logging

import pytest
import torch

from kimik3.vision.prompt import MediaTokenIds, expand_media_pads, image_prompt_ids, merge_image_embeddings

# K3 ids (spec §5.1); passed in explicitly, as a tokenizer would supply them
VOCAB = {"<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604, "<|media_pad|>": 163605}
IDS = MediaTokenIds(begin=163602, content=163603, end=163604, pad=163605)


def fake_bpe(text: str) -> list[int]:
    return [1000 + ord(c) for c in text]


def test_image_prompt_ids_layout():
    ids = image_prompt_ids(640, 480, 3, IDS, fake_bpe)
    assert ids == [163602, *fake_bpe("image 640x480"), 163603, 163605, 163605, 163605, 163604]


def test_448_image_has_256_pads():
    ids = image_prompt_ids(448, 448, 256, IDS, fake_bpe)
    assert ids.count(163605) == 256 and ids[-1] == 163604 and ids[0] == 163602


def test_ids_come_from_the_tokenizer_not_constants(caplog):
    other = {k: v - 1000 for k, v in VOCAB.items()}
    ids = MediaTokenIds.from_tokenizer(other.get)
    assert image_prompt_ids(1, 1, 1, ids, fake_bpe) == [162602, *fake_bpe("image 1x1"), 162603, 162605, 162604]
    with caplog.at_level(logging.WARNING, logger="kimik3.vision.prompt"):
        assert MediaTokenIds.from_tokenizer(VOCAB.get, media_placeholder_token_id=7).pad == 163605
    assert "differs" in caplog.text
    no_pad = {k: v for k, v in VOCAB.items() if k != "<|media_pad|>"}
    assert MediaTokenIds.from_tokenizer(no_pad.get, media_placeholder_token_id=163605) == IDS
    with pytest.raises(ValueError, match="does not define the media token"):
        MediaTokenIds.from_tokenizer({}.get)
    with pytest.raises(ValueError, match="no media_placeholder_token_id"):
        MediaTokenIds.from_tokenizer(no_pad.get)


def test_prompt_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one pad token"):
        image_prompt_ids(10, 10, 0, IDS, fake_bpe)
    with pytest.raises(ValueError, match="must be positive"):
        image_prompt_ids(0, 10, 1, IDS, fake_bpe)


def test_expand_single_pads():
    ids = [5, 163605, 6, 163605, 7]
    assert expand_media_pads(ids, [2, 3], 163605) == [5, 163605, 163605, 6, 163605, 163605, 163605, 7]
    with pytest.raises(ValueError, match="2 media pad token.*3 image"):
        expand_media_pads(ids, [1, 1, 1], 163605)


def test_merge_scatters_rows_in_order():
    pad = 163605
    input_ids = torch.tensor([1, pad, pad, 2, pad, 3])
    text = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    image = -torch.arange(1, 3 * 4 + 1, dtype=torch.float64).reshape(3, 4)
    out = merge_image_embeddings(input_ids, text, image, pad)
    assert out.dtype == torch.float32
    assert torch.equal(out[[1, 2, 4]], image.float())
    assert torch.equal(out[[0, 3, 5]], text[[0, 3, 5]])
    assert torch.equal(text, torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4))   # input untouched


def test_merge_count_mismatch_is_a_clear_error():
    pad = 163605
    input_ids = torch.tensor([1, pad, pad, 2])
    text = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"2 media pad token\(s\) \(id 163605\).*returned 3 embedding rows"):
        merge_image_embeddings(input_ids, text, torch.zeros(3, 8), pad)
    with pytest.raises(ValueError, match="returned 1 embedding rows"):
        merge_image_embeddings(input_ids, text, torch.zeros(1, 8), pad)
    with pytest.raises(ValueError, match="6 wide but text embeddings 8"):
        merge_image_embeddings(input_ids, text, torch.zeros(2, 6), pad)


def test_end_to_end_pads_equal_encoder_rows():
    import numpy as np
    from PIL import Image

    from kimik3.config import VisionConfig
    from kimik3.model.vision import KimiVisionModel
    from kimik3.vision.preprocess import preprocess_images

    cfg = VisionConfig(patch_size=14, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       qkv_hidden_size=16, intermediate_size=32, init_pos_emb_height=4, init_pos_emb_width=4,
                       init_pos_emb_time=4, merge_kernel_size=(2, 2), pos_emb_interpolation_mode="bilinear",
                       projector_ln_eps=1e-5, text_hidden_size=12)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in ((30, 16), (60, 90), (10, 10))]
    inputs = preprocess_images(images)
    assert inputs.num_tokens == [2, 12, 1]      # 16x30 -> grid (4, 2); 90x60 -> (6, 8); 10x10 -> (2, 2)
    torch.manual_seed(0)
    model = KimiVisionModel(cfg)
    with torch.no_grad():          # the position table is torch.empty until a checkpoint fills it
        for name, p in model.named_parameters():
            if name.endswith("pos_emb.weight"):
                p.normal_(0, 0.5)
    embeds = model.encode_images(inputs.pixel_values, inputs.grid_thws)
    assert embeds.shape == (sum(inputs.num_tokens), 12) and torch.isfinite(embeds).all()
    ids = [7, 8]
    for (w, h), n in zip(inputs.sizes, inputs.num_tokens):
        ids += image_prompt_ids(w, h, n, IDS, fake_bpe) + [9]
    input_ids = torch.tensor(ids)
    text = torch.zeros(len(ids), 12)
    out = merge_image_embeddings(input_ids, text, embeds, IDS.pad)
    assert torch.equal(out[input_ids == IDS.pad], embeds)
