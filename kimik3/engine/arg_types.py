"""The engine flags' value types (argparse ``type=``) and the checks of the same values given to ``LLM(...)``;
the default sampling settings read from a checkpoint's ``generation_config.json``. ``args.py`` builds the flags."""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from kimik3.engine.config import batch_size_table

logger = logging.getLogger(__name__)

# vLLM's --dtype names (plus float64, kimik3's exact-reference dtype).
DTYPES: dict[str, torch.dtype | None] = {"auto": None, "half": torch.float16, "float16": torch.float16,
                                        "bfloat16": torch.bfloat16, "float": torch.float32,
                                        "float32": torch.float32, "float64": torch.float64}

# generation_config.json keys used as default sampling settings, and their SamplingParams names (vLLM's map).
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
MM_KINDS = ("image", "video")

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """``'32k'`` -> 32000, ``'32K'`` -> 32768, ``'25.6k'`` -> 25600, ``'4096'`` -> 4096 (vLLM's rule)."""
    value = str(text).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m:
        number, suffix = m.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(f"decimals are not allowed with the binary suffix {suffix} in {text!r}; "
                                             f"did you mean {number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer such as 8192, 32k (32000) or 32K (32768), "
                                         f"got {text!r}") from None


def number(parse, ok, what: str):
    """An argparse type: ``parse`` the text, then require ``ok(value)``; errors say ``expected {what}``."""
    def check(text: str):
        try:
            value = parse(text)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    check.__name__ = what                 # argparse names the type in its messages
    return check


def positive_size(text: str) -> int:
    """A positive ``human_readable_int`` (whose own messages explain malformed suffixes and decimals)."""
    value = human_readable_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


positive_int = number(int, lambda v: v >= 1, "a positive integer")
non_negative_int = number(int, lambda v: v >= 0, "an integer >= 0")
fraction = number(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
non_negative_gib = number(float, lambda v: 0.0 <= v < float("inf"), "a number of GiB >= 0")
positive_seconds = number(float, lambda v: v > 0, "a number of seconds > 0")


def _json_arg(text: str, example: str, check):
    """A command-line JSON value, parsed and given to ``check``: malformed JSON and ``check``'s ValueError both
    reach the user as argparse errors with their own message (argparse hides a type function's ValueError
    behind "invalid ... value")."""
    try:
        return check(json.loads(text))
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected JSON such as '{example}', got {text!r}") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def mm_limits_arg(text: str) -> dict[str, int]:
    return _json_arg(text, '{"image": 4, "video": 1}', check_mm_limits)


SPEC_METHODS = ("ngram", "eagle3", "mtp", "dflash", "dspark")
_SPEC_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "num_speculative_tokens_per_batch_size"}


def speculative_config_arg(text: str) -> dict[str, Any]:
    return _json_arg(text, '{"method": "eagle3", "model": "default", "num_speculative_tokens": 4}',
                     check_speculative_config)


def check_speculative_config(value: Any) -> dict[str, Any]:
    """vLLM's ``speculative_config``: method, model (a draft directory; "default": the default model's shipped
    Eagle3 draft; MTP: the target's own directory when absent), num_speculative_tokens (required), and for
    n-gram prompt_lookup_min / prompt_lookup_max. Any other key is an error naming it."""
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - _SPEC_KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; kimik3 takes {sorted(_SPEC_KEYS)}")
    method = value.get("method", "ngram" if "model" not in value else None)
    if method not in SPEC_METHODS:
        raise ValueError(f"speculative_config: method must be one of {list(SPEC_METHODS)}, got {method!r}")
    k = value.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config: num_speculative_tokens must be a positive integer, got {k!r}")
    model = value.get("model")
    if method == "ngram" and model is not None:
        raise ValueError("speculative_config: method 'ngram' takes no model")
    if method in ("eagle3", "dflash", "dspark") and not isinstance(model, str):
        hint = ', or "default" for the default model' if method == "eagle3" else ""
        raise ValueError(f"speculative_config: method {method!r} needs 'model' (the draft's directory{hint})")
    table = value.get("num_speculative_tokens_per_batch_size")
    if table is not None:
        if method == "ngram":
            raise ValueError("speculative_config: num_speculative_tokens_per_batch_size is implemented for draft "
                             "models (eagle3, mtp, dflash, dspark), not for 'ngram'")
        batch_size_table(table)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in value and (method != "ngram" or not isinstance(value[key], int) or value[key] < 1):
            raise ValueError(f"speculative_config: {key} is a positive integer of method 'ngram', got {value[key]!r} "
                             f"with method {method!r}")
    return dict(value, method=method)


def check_mm_limits(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must map 'image'/'video' to counts, got {value!r}")
    for k, v in value.items():
        if k not in MM_KINDS:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {k!r}; kimik3 takes {list(MM_KINDS)}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"limit_mm_per_prompt[{k!r}] must be an integer >= 0, got {v!r}")
    return dict(value)


def read_generation_config(path: Path, setting: str) -> dict[str, Any]:
    """``setting``: 'auto' (the model folder's file, if any), 'vllm' (none), or a folder holding the file."""
    if setting == "vllm":
        return {}
    folder = Path(path) if setting == "auto" else Path(setting)
    file = folder / "generation_config.json"
    if setting != "auto" and not file.is_file():
        raise ValueError(f"generation_config {setting}: no generation_config.json there")
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: must hold a JSON object")
    out = {}
    for key, name in GENERATION_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{file}: {key} must be a number, got {value!r}")
        out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    if out:
        logger.info("default sampling settings from %s: %s", file, out)
    return out


def speculative_settings(args) -> dict[str, Any]:
    """The EngineConfig speculation fields from ``speculative_config`` or the n-gram flags."""
    sc = args.speculative_config
    if sc is None:
        return dict(num_speculative_tokens=args.num_speculative_tokens, speculative_ngram_min=args.speculative_ngram_min,
                    speculative_ngram_max=args.speculative_ngram_max)
    model = sc.get("model")
    if sc["method"] == "mtp" and model is None:
        model = str(args.model_path())        # K3's MTP layers live in the target's checkpoint
    return dict(num_speculative_tokens=sc["num_speculative_tokens"], speculative_method=sc["method"],
                speculative_model=model, speculative_ngram_min=sc.get("prompt_lookup_min", args.speculative_ngram_min),
                speculative_ngram_max=sc.get("prompt_lookup_max", args.speculative_ngram_max),
                num_speculative_tokens_per_batch_size=sc.get("num_speculative_tokens_per_batch_size"))
