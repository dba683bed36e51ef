"""Block hashes, the prefix cache's keys: a full block's hash covers its tokens, any image content
in it (``multimodal.MultiModalInput.block_extra_keys``) and, through its parent's hash, every block
before it, so equal hashes mean equal prefixes."""

from __future__ import annotations

import hashlib
from array import array


def block_hash(parent: bytes | None, token_ids: list[int], extra_key: bytes | None = None) -> bytes:
    """Hash of a full block: the whole prefix up to it (parent hash) + its tokens (+ image content key)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(b"extra")
        h.update(extra_key)
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int,
                        extra_keys: list[bytes | None] | None) -> None:
    """Append to ``hashes`` those of the full blocks of ``token_ids`` it lacks (``extra_keys``: per block)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        extra = extra_keys[i] if extra_keys and i < len(extra_keys) else None
        hashes.append(block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
