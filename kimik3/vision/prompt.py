"""Image prompt tokens and the merge of image embeddings into the text embeddings (spec §4).

Image i occupies ``[<|media_begin|>] + BPE("image {W}x{H}") + [<|media_content|>]
+ [<|media_pad|>] * N_i + [<|media_end|>]`` where W x H is the original image size and N_i its
token count; only the pad positions receive image embeddings (one encoder row each, in order).

These helpers take the tokenizer as plain callables and the special ids as values, so they do not
depend on any tokenizer class.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"


@dataclass(frozen=True)
class MediaTokenIds:
    """Ids of the four media tokens (K3: 163602, 163603, 163604, 163605)."""

    begin: int
    content: int
    end: int
    pad: int

    @classmethod
    def from_tokenizer(cls, token_to_id: Callable[[str], int | None], *,
                       media_placeholder_token_id: int | None = None, unk_id: int | None = None) -> MediaTokenIds:
        """Resolve the ids by token name. The pad id prefers the tokenizer's value and falls back
        to the config's ``media_placeholder_token_id`` when the tokenizer does not know the name."""

        def lookup(name: str) -> int | None:
            tid = token_to_id(name)
            return None if tid is None or tid < 0 or tid == unk_id else int(tid)

        ids = {name: lookup(name) for name in (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END)}
        missing = [name for name, tid in ids.items() if tid is None]
        if missing:
            raise ValueError(f"tokenizer does not define the media token(s) {missing}; "
                             "is this a Kimi-K3 tokenizer?")
        pad = lookup(MEDIA_PAD)
        if pad is None:
            if media_placeholder_token_id is None:
                raise ValueError(f"tokenizer does not define {MEDIA_PAD} and the config has no "
                                 "media_placeholder_token_id")
            pad = media_placeholder_token_id
        elif media_placeholder_token_id is not None and pad != media_placeholder_token_id:
            logger.warning("config media_placeholder_token_id %d differs from the tokenizer's %s id %d; "
                           "using the tokenizer's", media_placeholder_token_id, MEDIA_PAD, pad)
        return cls(ids[MEDIA_BEGIN], ids[MEDIA_CONTENT], ids[MEDIA_END], pad)


def image_header_text(width: int, height: int) -> str:
    """The plain-text part of an image prompt: ``image {W}x{H}`` (original size, before resize)."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    return f"image {width}x{height}"


def image_prompt_ids(width: int, height: int, num_tokens: int, ids: MediaTokenIds,
                     encode: Callable[[str], list[int]]) -> list[int]:
    """Token ids of one image prompt with ``num_tokens`` pad slots.

    ``encode`` is the ordinary-text BPE (no special tokens recognised); the header text is its
    own segment, so its tokens never merge with the wrapper tokens.
    """
    if num_tokens < 1:
        raise ValueError(f"an image needs at least one pad token, got num_tokens={num_tokens}")
    return [ids.begin, *encode(image_header_text(width, height)), ids.content, *([ids.pad] * num_tokens), ids.end]


def expand_media_pads(input_ids: Sequence[int], num_tokens: Sequence[int], pad_id: int) -> list[int]:
    """Turn the official one-pad-per-image prompt into the expanded one: the k-th pad token
    becomes ``num_tokens[k]`` pads."""
    positions = [i for i, t in enumerate(input_ids) if t == pad_id]
    if len(positions) != len(num_tokens):
        raise ValueError(f"prompt holds {len(positions)} media pad token(s) (id {pad_id}) but "
                         f"{len(num_tokens)} image(s) were given; each image needs exactly one pad to expand")
    out: list[int] = []
    k = 0
    for t in input_ids:
        if t == pad_id:
            out.extend([pad_id] * num_tokens[k])
            k += 1
        else:
            out.append(t)
    return out


def merge_image_embeddings(input_ids: torch.Tensor, inputs_embeds: torch.Tensor, image_embeds: torch.Tensor,
                           pad_id: int) -> torch.Tensor:
    """Overwrite the rows of ``inputs_embeds`` at media pad positions with ``image_embeds``.

    input_ids:     [T] token ids
    inputs_embeds: [T, D] text embeddings (pad rows are looked up, then replaced)
    image_embeds:  [R, D] encoder rows of the images present, in prompt order; R must equal the
                   number of pad tokens in ``input_ids``
    returns:       [T, D] new tensor in ``inputs_embeds``' dtype
    """
    if input_ids.ndim != 1 or inputs_embeds.ndim != 2 or inputs_embeds.shape[0] != input_ids.shape[0]:
        raise ValueError(f"expected input_ids [T] and inputs_embeds [T, D], got {list(input_ids.shape)} and "
                         f"{list(inputs_embeds.shape)}")
    mask = input_ids == pad_id
    n_pad = int(mask.sum())
    if image_embeds.ndim != 2:
        raise ValueError(f"image_embeds must be [R, D], got {list(image_embeds.shape)}")
    if image_embeds.shape[0] != n_pad:
        raise ValueError(f"prompt holds {n_pad} media pad token(s) (id {pad_id}) but the vision encoder "
                         f"returned {image_embeds.shape[0]} embedding rows; every image needs exactly as many "
                         "pad tokens as it has embeddings")
    if image_embeds.shape[1] != inputs_embeds.shape[1]:
        raise ValueError(f"image embeddings are {image_embeds.shape[1]} wide but text embeddings "
                         f"{inputs_embeds.shape[1]}; the projector must output the text hidden size")
    out = inputs_embeds.clone()
    out[mask] = image_embeds.to(device=out.device, dtype=out.dtype)
    return out
