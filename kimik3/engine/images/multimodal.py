"""A request's images as the engine sees them: validated against the prompt, content-hashed, mapped to rows.

Image item i owns the media pad tokens ``pad_positions[row_offsets[i]:row_offsets[i+1]]`` of the
prompt (pads are matched to items in prompt order, as the model's masked scatter does, spec
vision-multimodal §4.3); row r of the item's encoder output replaces the pad at
``pad_positions[row_offsets[i] + r]``. Only prompt positions count: a media pad id that the model
generates later is an ordinary token.

Prefix caching: a block's hash takes an extra key naming every item whose rows fall in the block
(content hash + first row in the block), so equal token ids with different pixels never share cache.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import torch

from kimik3.ops import ceil_div
from kimik3.vision.preprocess import VisionInputs


@dataclass(frozen=True)
class MultiModalInput:
    pixel_values: torch.Tensor       # [P, 3, p, p] host copy, items in order (kept for recompute)
    grid_thws: torch.Tensor          # [n, 3] int64 rows (t, gh, gw)
    patch_offsets: tuple[int, ...]   # [n+1]: item i's patches are pixel_values[patch_offsets[i]:patch_offsets[i+1]]
    row_offsets: tuple[int, ...]     # [n+1]: item i's rows are pad_positions[row_offsets[i]:row_offsets[i+1]]
    pad_positions: tuple[int, ...]   # [sum N_i] prompt positions of the media pad tokens, ascending
    hashes: tuple[bytes, ...]        # [n] sha256 of each item's grid + pixels (encoder cache and prefix keys)

    def pixels(self, i: int) -> torch.Tensor:
        """Item i's patches [t*gh*gw, 3, p, p]."""
        return self.pixel_values[self.patch_offsets[i]:self.patch_offsets[i + 1]]

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """Rows (indices into the concatenated embeddings) whose pads lie at positions [start, end)."""
        return bisect_left(self.pad_positions, start), bisect_left(self.pad_positions, end)

    def items_in(self, start: int, end: int) -> range:
        """Items with at least one pad at positions [start, end)."""
        lo, hi = self.rows_in(start, end)
        if lo == hi:
            return range(0)
        return range(bisect_right(self.row_offsets, lo) - 1, bisect_right(self.row_offsets, hi - 1))

    def last_position(self, i: int) -> int:
        """Prompt position of item i's last pad: once it is computed the item's embeddings are done."""
        return self.pad_positions[self.row_offsets[i + 1] - 1]

    def block_extra_keys(self, num_prompt_tokens: int, block_size: int) -> list[bytes | None]:
        """Per prompt block: the extra hash key of the items whose rows fall in it (None if none)."""
        keys: list[bytes | None] = []
        for b in range(ceil_div(num_prompt_tokens, block_size)):
            lo, _ = self.rows_in(b * block_size, (b + 1) * block_size)
            key = b"".join(self.hashes[i] + struct.pack("<q", max(lo, self.row_offsets[i]) - self.row_offsets[i])
                           for i in self.items_in(b * block_size, (b + 1) * block_size))
            keys.append(key or None)
        return keys


def check_vision_inputs(data, prompt_ids: list[int], pad_id: int, patch_size: int, merge: int) -> list[int]:
    """Validate ``multi_modal_data`` against the prompt; returns the pad positions, or raises ValueError."""
    if not isinstance(data, VisionInputs):   # ValueError: a bad request (a server's 400), like every check here
        raise ValueError(  # noqa: TRY004
            f"multi_modal_data must be a VisionInputs (kimik3.vision.preprocess.preprocess_images), "
            f"got {type(data).__name__}")
    n = len(data.num_tokens)
    if n == 0:
        raise ValueError("multi_modal_data holds no images; leave it out for a text-only prompt")
    grid = data.grid_thws
    if not isinstance(grid, torch.Tensor) or tuple(grid.shape) != (n, 3) or grid.dtype.is_floating_point:
        raise ValueError(f"multi_modal_data.grid_thws must be an integer tensor [{n}, 3] (one row per image), "
                         f"got {getattr(grid, 'shape', type(grid).__name__)}")
    patches = 0
    for i, ((t, gh, gw), tokens) in enumerate(zip(grid.tolist(), data.num_tokens)):
        if t < 1 or gh < merge or gw < merge or gh % merge or gw % merge:
            raise ValueError(f"image {i}: grid (t, h, w) = ({t}, {gh}, {gw}) is not a positive multiple of the "
                             f"merge kernel {merge}")
        if tokens != (gh // merge) * (gw // merge):
            raise ValueError(f"image {i}: num_tokens={tokens} but its {gh}x{gw} patch grid gives "
                             f"{(gh // merge) * (gw // merge)}")
        patches += t * gh * gw
    pv = data.pixel_values
    want = (patches, 3, patch_size, patch_size)
    if not isinstance(pv, torch.Tensor) or tuple(pv.shape) != want or not pv.dtype.is_floating_point:
        raise ValueError(f"multi_modal_data.pixel_values must be a float tensor of shape {list(want)}, got "
                         f"{list(pv.shape) if isinstance(pv, torch.Tensor) else type(pv).__name__}")
    positions = [p for p, t in enumerate(prompt_ids) if t == pad_id]
    if len(positions) != sum(data.num_tokens):
        raise ValueError(f"the prompt holds {len(positions)} media pad token(s) (id {pad_id}) but its {n} image(s) "
                         f"need {sum(data.num_tokens)} ({list(data.num_tokens)} per image); render the prompt "
                         f"with apply_chat_template(..., images=[ImagePrompt(W, H, num_tokens), ...])")
    return positions


def build_multi_modal_input(data: VisionInputs, pad_positions: list[int]) -> MultiModalInput:
    """Hash each item (grid + pixel bytes) and lay out its patches and rows; ``data`` is checked already."""
    pixels = data.pixel_values.detach().to("cpu").contiguous()
    grid = data.grid_thws.to(device="cpu", dtype=torch.int64)
    patch_offsets, row_offsets, hashes = [0], [0], []
    for (t, gh, gw), tokens in zip(grid.tolist(), data.num_tokens):
        patch_offsets.append(patch_offsets[-1] + t * gh * gw)
        row_offsets.append(row_offsets[-1] + tokens)
        h = hashlib.sha256(struct.pack("<3q", t, gh, gw) + str(pixels.dtype).encode())
        h.update(pixels[patch_offsets[-2]:patch_offsets[-1]].reshape(-1).view(torch.uint8).numpy())
        hashes.append(h.digest())
    return MultiModalInput(pixels, grid, tuple(patch_offsets), tuple(row_offsets), tuple(pad_positions),
                           tuple(hashes))


def expand_media_pads(input_ids: list[int], num_tokens: list[int], pad_id: int) -> list[int]:
    """The HF processor's prompt form (one media pad per image / video chunk) -> ours: the k-th pad
    becomes ``num_tokens[k]`` pads, one per embedding row."""
    positions = [i for i, t in enumerate(input_ids) if t == pad_id]
    if len(positions) != len(num_tokens):
        raise ValueError(f"prompt holds {len(positions)} media pad token(s) (id {pad_id}) but "
                         f"{len(num_tokens)} image(s) were given; each image needs exactly one pad to expand")
    out: list[int] = []
    pads = iter(num_tokens)
    for t in input_ids:
        out.extend([pad_id] * next(pads) if t == pad_id else [t])
    return out
