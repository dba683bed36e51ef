"""Build the embedded default model ``kimik3/default_model/`` (deterministic).

A tiny Kimi-K3 in the exact release layout: ``config.json`` (top-level ``kimi_k3``, every K3
feature on, a tiny vision tower), sharded safetensors with MXFP4 experts and an index,
``tiktoken.model`` + ``tokenizer_config.json`` (a small BPE with K3's special-token table) and
``preprocessor_config.json``. Weights are random: it exercises every code path, it does not
produce meaningful text.

    python scripts/make_default_model.py [OUT_DIR]
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from kimik3.testing import make_tiny_checkpoint, tiny_k3_config
from kimik3.tokenizer_build import build_tiny_tokenizer, model_token_ids
from kimik3.vision.preprocess import MediaProcessorConfig

BASE_VOCAB = 2048


def build(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*"):
        f.unlink()
    ids = model_token_ids(BASE_VOCAB, "k3")
    config = tiny_k3_config(vocab_size=ids["vocab_size"], num_layers=6, hidden=64, block_size=2, num_experts=8,
                            top_k=2, bos=ids["bos_token_id"], eos=ids["eos_token_id"], pad=ids["pad_token_id"],
                            media=ids["media_placeholder_token_id"])
    make_tiny_checkpoint(out, config=config, seed=0, dtype=torch.bfloat16, max_shard_bytes=1 << 20)
    build_tiny_tokenizer(out, base_vocab_size=BASE_VOCAB, seed=0, chat_format="k3")
    media = dataclasses.asdict(MediaProcessorConfig())
    media["merge_kernel_size"] = [media["merge_kernel_size"]] * 2
    media["image_mean"], media["image_std"] = list(media["image_mean"]), list(media["image_std"])
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media}, indent=2) + "\n")
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "kimik3" / "default_model"
    print(build(target))
