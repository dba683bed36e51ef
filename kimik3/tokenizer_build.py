"""Build a tiny Kimi tokenizer in the release file format, for tests and the embedded toy model.

``build_tiny_tokenizer(out_dir, base_vocab_size, seed)`` trains a byte-level BPE (256 byte tokens +
merges up to ``base_vocab_size``) on a corpus generated here from a small word list (no network, no
external text), pre-tokenised with Kimi's regex, and writes

  ``tiktoken.model``         ``<base64> <rank>`` lines, ranks 0..base_vocab_size-1
  ``tokenizer_config.json``  the release's special-token table (same names and ``special`` flags at the
                             same offsets after the base vocabulary), bos/eos/pad/unk names.

The release's ``tokenizer_config.json`` has no ``chat_template`` (K3 renders chat in Python), so none is
written. Output is byte-identical for equal arguments. ``chat_format="kimi_linear"`` writes the
K2-style names (``<|im_end|>`` ...) at the same offsets instead.

Special ids are ``base_vocab_size + offset``; ``special_token_ids`` / ``model_token_ids`` give them.
"""

from __future__ import annotations

import base64
import json
import random
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path

import regex

from kimik3.tokenizer import (
    CONFIG_FILE,
    NUM_RESERVED_SPECIAL_TOKENS,
    PAT_STR,
    TIKTOKEN_FILE,
)

# (offset after the base vocabulary, name, HF "special" flag): K3 release table.
K3_SPECIAL_TOKENS = (
    (0, "[BOS]", True),
    (1, "[EOS]", True),
    (2, "<|end_of_msg|>", True),
    (3, "<|open|>", False),
    (4, "<|close|>", False),
    (5, "<|sep|>", False),
    (6, "[start_header_id]", True),
    (7, "[end_header_id]", True),
    (9, "[EOT]", True),
    (18, "<|media_begin|>", True),
    (19, "<|media_content|>", True),
    (20, "<|media_end|>", True),
    (21, "<|media_pad|>", True),
    (65, "<osagent_mode>", True),
    (254, "[UNK]", True),
    (255, "[PAD]", True),
)

# Kimi-Linear / K2 names of the same block.
KIMI_LINEAR_SPECIAL_TOKENS = (
    (0, "[BOS]", True),
    (1, "[EOS]", True),
    (2, "<|im_end|>", True),
    (3, "<|im_user|>", True),
    (4, "<|im_assistant|>", True),
    (6, "<|start_header_id|>", True),
    (7, "<|end_header_id|>", True),
    (9, "[EOT]", True),
    (10, "<|im_system|>", True),
    (11, "<|tool_calls_section_begin|>", True),
    (12, "<|tool_calls_section_end|>", True),
    (13, "<|tool_call_begin|>", True),
    (14, "<|tool_call_argument_begin|>", True),
    (15, "<|tool_call_end|>", True),
    (17, "<|im_middle|>", True),
    (18, "<|media_begin|>", True),
    (19, "<|media_content|>", True),
    (20, "<|media_end|>", True),
    (21, "<|media_pad|>", True),
    (22, "<think>", True),
    (23, "</think>", True),
    (254, "[UNK]", True),
    (255, "[PAD]", True),
)

_TABLES = {"k3": K3_SPECIAL_TOKENS, "kimi_linear": KIMI_LINEAR_SPECIAL_TOKENS}

# Small vocabulary for the generated corpus: everyday words, the chat format's tag and attribute words,
# JSON-ish tool words, a few Chinese characters and emoji so multi-byte merges exist.
_WORDS = ["the", "a", "an", "and", "or", "but", "not", "of", "to", "in", "on", "at", "for", "with", "from", "by", "as", "is", "are", "was", "were", "be", "been", "have", "has", "had", "do", "does", "did", "will", "would", "can", "could", "should", "may", "might", "must", "this", "that", "these", "those", "it", "its", "he", "she", "they", "we", "you", "i", "me", "my", "your", "our", "their", "what", "which", "who", "when", "where", "why", "how", "all", "any", "each", "every", "some", "many", "much", "more", "most", "other", "such", "only", "own", "same", "so", "than", "too", "very", "just", "also", "now", "then", "here", "there", "up", "down", "out", "over", "under", "again", "once", "about", "after", "before", "between", "into", "through", "during", "without", "within", "along", "across", "behind", "beyond", "near", "far", "time", "year", "day", "week", "month", "hour", "minute", "second", "people", "person", "man", "woman", "child", "world", "life", "hand", "part", "place", "case", "point", "group", "number", "way", "thing", "fact", "water", "food", "city", "country", "house", "room", "door", "window", "road", "car", "book", "page", "word", "line", "name", "story", "question", "answer", "problem", "reason", "idea", "result", "change", "system", "program", "code", "data", "file", "value", "list", "table", "image", "picture", "color", "light", "sound", "music", "game", "team", "work", "job", "money", "market", "price", "cost", "rate", "level", "model", "test", "check", "build", "run", "start", "stop", "open", "close", "read", "write", "send", "call", "find", "make", "take", "give", "get", "see", "look", "know", "think", "feel", "want", "need", "use", "try", "help", "show", "tell", "ask", "keep", "move", "play", "turn", "bring", "begin", "seem", "leave", "put", "mean", "good", "new", "first", "last", "long", "great", "little", "old", "right", "big", "high", "different", "small", "large", "next", "early", "young", "important", "public", "bad", "able", "free", "full", "sure", "clear", "true", "false", "null", "hot", "cold", "warm", "cool", "dark", "bright", "fast", "slow", "happy", "sad", "message", "role", "user", "assistant", "system", "tool", "tools", "think", "response", "argument", "key", "type", "string", "number", "boolean", "object", "array", "json", "function", "arguments", "content", "reasoning", "index", "weather", "location", "unit", "celsius", "query", "result", "search", "date", "temperature", "city", "image", "width", "height", "hello", "world", "yes", "no", "please", "thanks", "sorry", "okay"]
_NAMES = ["Alice", "Bob", "Carol", "Dave", "Paris", "London", "Tokyo", "Berlin", "Monday", "Friday", "January", "July", "Python", "Kimi"]
_HAN = "你好世界中国人大小天地日月山水火木金土上下左右今明年我他她们的是不了在有和"
_EMOJI = ["\U0001F600", "\U0001F680", "\u2764\ufe0f", "\U0001F44D\U0001F3FD", "\U0001F1EF\U0001F1F5", "\u2728"]
_PUNCT = [".", ",", "!", "?", ":", ";", "-", "(", ")", '"', "'", "...", " -", " (", "/"]


def _sentence(rng: random.Random) -> str:
    words = []
    for k in range(rng.randint(3, 14)):
        r = rng.random()
        if r < 0.75:
            w = rng.choice(_WORDS)
        elif r < 0.83:
            w = rng.choice(_NAMES)
        elif r < 0.9:
            w = str(rng.randint(0, 2100))
        elif r < 0.95:
            w = "".join(rng.choice(_HAN) for _ in range(rng.randint(1, 4)))
        else:
            w = rng.choice(_EMOJI)
        if k == 0 or rng.random() < 0.05:
            w = w[:1].upper() + w[1:]
        words.append(w)
        if rng.random() < 0.08:
            words[-1] += rng.choice(_PUNCT)
    return " ".join(words) + rng.choice([".", ".", ".", "?", "!", ":\n", "\n\n"])


def _snippet(rng: random.Random) -> str:
    """Structured text: JSON objects, key=value pairs, code-like lines."""
    keys = rng.sample(_WORDS, 3)
    r = rng.random()
    if r < 0.4:
        return json.dumps({k: rng.choice([rng.choice(_WORDS), rng.randint(0, 999), True, None]) for k in keys}) + "\n"
    if r < 0.7:
        return " ".join(f'{k}="{rng.choice(_WORDS)}"' for k in keys) + "\n"
    return f"    {keys[0]} = {keys[1]}({keys[2]}, {rng.randint(0, 99)})\n"


def generate_corpus(seed: int = 0, num_pieces: int = 6000) -> str:
    rng = random.Random(seed)
    parts = [_sentence(rng) if rng.random() < 0.8 else _snippet(rng) for _ in range(num_pieces)]
    return "".join(parts)


def train_bpe(corpus: str, vocab_size: int) -> dict[bytes, int]:
    """Byte-level BPE: ranks 0..255 are the single bytes; each merge adds the most frequent adjacent
    pair (ties broken by the smaller byte strings), until ``vocab_size`` distinct tokens exist."""
    if vocab_size < 256:
        raise ValueError(f"base_vocab_size must be at least 256 (the byte tokens), got {vocab_size}")
    pattern = regex.compile("(?V1)" + PAT_STR)
    word_counts = Counter(pattern.findall(corpus))
    words: list[list[bytes]] = []
    counts: list[int] = []
    for w, c in sorted(word_counts.items()):
        words.append([bytes([b]) for b in w.encode("utf-8")])
        counts.append(c)

    pair_counts: Counter = Counter()
    where: dict[tuple[bytes, bytes], set[int]] = defaultdict(set)
    for wi, toks in enumerate(words):
        for a, b in pairwise(toks):
            pair_counts[(a, b)] += counts[wi]
            where[(a, b)].add(wi)

    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < vocab_size:
        best = None
        for pair, c in pair_counts.items():
            if c > 0 and (best is None or c > best[1] or (c == best[1] and pair < best[0])):
                best = (pair, c)
        if best is None:
            raise ValueError(
                f"the corpus has too few distinct pairs for base_vocab_size={vocab_size} "
                f"(stopped at {len(ranks)}); use a smaller size"
            )
        (a, b), _ = best
        merged = a + b
        if merged not in ranks:
            ranks[merged] = len(ranks)
        for wi in sorted(where.pop((a, b), ())):
            toks, c = words[wi], counts[wi]
            for x, y in pairwise(toks):
                pair_counts[(x, y)] -= c
                if pair_counts[(x, y)] <= 0:
                    del pair_counts[(x, y)]
            new: list[bytes] = []
            j = 0
            while j < len(toks):
                if j + 1 < len(toks) and toks[j] == a and toks[j + 1] == b:
                    new.append(merged)
                    j += 2
                else:
                    new.append(toks[j])
                    j += 1
            words[wi] = new
            for x, y in pairwise(new):
                pair_counts[(x, y)] += c
                where[(x, y)].add(wi)
        pair_counts.pop((a, b), None)
    return ranks


def special_token_ids(base_vocab_size: int, chat_format: str = "k3") -> dict[str, int]:
    """Name -> id of every named special token for a tokenizer with ``base_vocab_size`` base tokens."""
    if chat_format not in _TABLES:
        raise ValueError(f"chat_format must be one of {sorted(_TABLES)}, got {chat_format!r}")
    return {name: base_vocab_size + off for off, name, _ in _TABLES[chat_format]}


def model_token_ids(base_vocab_size: int, chat_format: str = "k3") -> dict[str, int]:
    """The ids a model ``config.json`` needs for this tokenizer (release: 163584 / 163586 / 163839 /
    163605, vocab 163840). ``eos_token_id`` is the chat stop token, as in the release config."""
    ids = special_token_ids(base_vocab_size, chat_format)
    stop = "<|end_of_msg|>" if chat_format == "k3" else "<|im_end|>"
    return {
        "vocab_size": base_vocab_size + NUM_RESERVED_SPECIAL_TOKENS,
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids[stop],
        "pad_token_id": ids["[PAD]"],
        "media_placeholder_token_id": ids["<|media_pad|>"],
    }


def tokenizer_config(base_vocab_size: int, chat_format: str = "k3") -> dict:
    table = _TABLES[chat_format]
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {
        "added_tokens_decoder": {
            str(base_vocab_size + off): {"content": name, **entry, "special": special} for off, name, special in table
        },
        "additional_special_tokens": [name for off, name, special in table if special and off not in (0, 1, 254, 255)],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def build_tiny_tokenizer(out_dir: Path, base_vocab_size: int = 2048, seed: int = 0, chat_format: str = "k3") -> None:
    """Write ``tiktoken.model`` and ``tokenizer_config.json`` for a tiny tokenizer into ``out_dir``."""
    write_tokenizer(out_dir, generate_corpus(seed), base_vocab_size, chat_format)


def write_tokenizer(out_dir: Path, corpus: str, base_vocab_size: int, chat_format: str = "k3") -> None:
    """Train a byte-level BPE of ``base_vocab_size`` tokens on ``corpus`` and write ``tiktoken.model``
    and ``tokenizer_config.json`` (the release special-token table after the base vocabulary)."""
    if not isinstance(base_vocab_size, int) or not 256 <= base_vocab_size <= 8192:
        raise ValueError(f"base_vocab_size must be an int in [256, 8192], got {base_vocab_size!r}")
    if chat_format not in _TABLES:
        raise ValueError(f"chat_format must be one of {sorted(_TABLES)}, got {chat_format!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = train_bpe(corpus, base_vocab_size)
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda x: x[1])]
    (out_dir / TIKTOKEN_FILE).write_text("".join(lines), encoding="ascii")
    cfg = tokenizer_config(base_vocab_size, chat_format)
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
