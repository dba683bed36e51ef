"""Kimi tiktoken tokenizer, loaded from a checkpoint directory.

A checkpoint ships two files:
  ``tiktoken.model``         one ``<base64 token bytes> <rank>`` pair per line; ranks 0..n-1 are the
                             n base (BPE) tokens.
  ``tokenizer_config.json``  ``added_tokens_decoder`` names some of the 256 reserved special ids
                             n..n+255; ``bos_token``/``eos_token``/``pad_token``/``unk_token`` name
                             the tokenizer-level special tokens.

Special ids always come from these files: the release has n = 163584 (specials 163584..163839); a
tiny test tokenizer (``kimik3.tokenizer_build``) has a small n and the same names right after it.
Unnamed reserved ids are called ``<|reserved_token_{id}|>``.

Plain text never produces special ids unless ``allow_special=True``; chat prompts are encoded
segment by segment (``encode_segments``) so only the renderer's control segments may.

Which chat format ``apply_chat_template`` renders is chosen from the checkpoint, see
``detect_chat_format``.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tiktoken

logger = logging.getLogger(__name__)

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
NUM_RESERVED_SPECIAL_TOKENS = 256

# Kimi's pre-tokenisation regex (alternatives in order): Han runs; two letter-word forms (lower-led and
# upper-led, Han excluded, optional leading non-letter/digit char, optional English contraction);
# 1-3 digits; optional space + punctuation run + trailing newlines; newline runs; trailing spaces;
# other whitespace. Class intersection (&&) is understood by tiktoken's regex engine and by the
# ``regex`` module in V1 mode (the tiny-tokenizer builder uses the latter).
PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        (
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
            r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        ),
        (
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
            r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        ),
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# tiktoken panics on very long inputs and gets quadratic on long runs of (non-)whitespace, so text is
# cut into pieces first; the cut points can only change tokens of pathological inputs.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000

# Chat formats, told apart by the names the tokenizer gives its special ids (spec README §7).
K3_MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
KIMI_LINEAR_MARKERS = ("<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "<|im_system|>")
_MODEL_TYPE_FORMAT = {"kimi_k3": "k3", "kimi_linear": "kimi_linear"}


class TokenizerFileError(ValueError):
    """A tokenizer file is missing or unreadable; the message names the file."""


class TooManyTokens(ValueError):
    """``encode(text, limit=N)``: the text has more than N tokens (it was not encoded to the end)."""

    def __init__(self, limit: int):
        super().__init__(f"the text has more than {limit} tokens")
        self.limit = limit


@dataclass(frozen=True)
class AddedToken:
    id: int
    content: str
    special: bool  # HF's flag: True tokens are dropped by decode(skip_special_tokens=True)


def read_tiktoken_model(path: Path) -> dict[bytes, int]:
    """Parse a ``tiktoken.model`` file into {token bytes: rank}; ranks must be exactly 0..n-1."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TokenizerFileError(f"{path}: tokenizer vocabulary file not found") from None
    except OSError as e:
        raise TokenizerFileError(f"{path}: cannot read tokenizer vocabulary ({e})") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise TokenizerFileError(f"{path}:{lineno}: expected '<base64 token> <rank>', got {line[:80]!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (binascii.Error, ValueError):
            raise TokenizerFileError(f"{path}:{lineno}: bad base64 token or rank in {line[:80]!r}") from None
        if token in ranks:
            raise TokenizerFileError(f"{path}:{lineno}: token {token!r} listed twice")
        ranks[token] = rank
    if not ranks:
        raise TokenizerFileError(f"{path}: tokenizer vocabulary is empty")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerFileError(f"{path}: ranks must be exactly 0..{len(ranks) - 1} with no gaps or repeats")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerFileError(f"{path}: byte-level BPE needs all 256 single bytes; missing {missing[:8]}")
    return ranks


def _token_name(value: Any, key: str, path: Path) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):  # HF serialises AddedToken objects as {"content": ...}
        value = value.get("content")
    if not isinstance(value, str):
        raise TokenizerFileError(f"{path}: '{key}' must be a token string, got {value!r}")
    return value


def read_json_object(path: Path, what: str = "tokenizer config") -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TokenizerFileError(f"{path}: {what} file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerFileError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerFileError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


def _added_tokens(config: dict[str, Any], path: Path) -> list[AddedToken]:
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise TokenizerFileError(f"{path}: 'added_tokens_decoder' must be an object of id -> token")
    out = []
    for key, entry in decoder.items():
        try:
            token_id = int(key)
        except ValueError:
            raise TokenizerFileError(f"{path}: added_tokens_decoder key {key!r} is not an integer id") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise TokenizerFileError(f"{path}: added_tokens_decoder[{key}] needs a string 'content'")
        out.append(AddedToken(token_id, entry["content"], bool(entry.get("special", True))))
    return out


def detect_chat_format(special_names: Iterable[str], model_type: str | None = None) -> str | None:
    """Choose the chat format of a checkpoint.

    Rule: the tokenizer decides (both models use the same special ids under different names).
    All of ``K3_MARKERS`` named -> ``"k3"`` (XTML); else all of ``KIMI_LINEAR_MARKERS`` named ->
    ``"kimi_linear"`` (K2-style ``<|im_*|>``); else the top-level ``config.json`` ``model_type``
    (``kimi_k3`` -> k3, ``kimi_linear`` -> kimi_linear); else None (no chat template).
    The tokenizer's names win over ``model_type``: a K3 text-only checkpoint (``model_type``
    ``kimi_linear`` with the K3 fields, as the official K3 text config class writes it) beside the K3
    tokenizer chats in the K3 format.
    """
    names = set(special_names)
    by_tokens = None
    if all(m in names for m in K3_MARKERS):
        by_tokens = "k3"
    elif all(m in names for m in KIMI_LINEAR_MARKERS):
        by_tokens = "kimi_linear"
    by_config = _MODEL_TYPE_FORMAT.get(model_type) if model_type else None
    if by_tokens and by_config and by_tokens != by_config:
        logger.info("config.json model_type %r would mean chat format %r; the tokenizer's special tokens say %r, "
                    "which is used", model_type, by_config, by_tokens)
    return by_tokens or by_config


class KimiTokenizer:
    """Kimi tiktoken tokenizer with an HF-shaped surface (``encode``, ``decode``,
    ``apply_chat_template``, ``convert_tokens_to_ids``, ``*_token_id``)."""

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        added_tokens: Sequence[AddedToken] = (),
        *,
        bos_token: str | None = "[BOS]",
        eos_token: str | None = "[EOS]",
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_format: str | None = None,
        name: str = "kimi",
        source: str = "<memory>",
    ):
        n_base = len(mergeable_ranks)
        self.num_base_tokens = n_base
        self.source = source
        named: dict[int, AddedToken] = {}
        for tok in added_tokens:
            if not n_base <= tok.id < n_base + NUM_RESERVED_SPECIAL_TOKENS:
                raise TokenizerFileError(
                    f"{source}: added token {tok.content!r} has id {tok.id}, outside the reserved "
                    f"special range {n_base}..{n_base + NUM_RESERVED_SPECIAL_TOKENS - 1} that follows "
                    f"the {n_base} base tokens"
                )
            named[tok.id] = tok
        self.special_tokens: dict[str, int] = {}
        self._special_flag: dict[int, bool] = {}
        for i in range(n_base, n_base + NUM_RESERVED_SPECIAL_TOKENS):
            tok = named.get(i)
            token_name = tok.content if tok else f"<|reserved_token_{i}|>"
            if token_name in self.special_tokens:
                raise TokenizerFileError(f"{source}: special token {token_name!r} is used for two ids")
            self.special_tokens[token_name] = i
            self._special_flag[i] = tok.special if tok else True
        self._special_names = {i: s for s, i in self.special_tokens.items()}
        self._encoding = tiktoken.Encoding(
            name=name, pat_str=PAT_STR, mergeable_ranks=mergeable_ranks, special_tokens=self.special_tokens
        )
        self._ranks = mergeable_ranks
        # the most text one id stands for: a text of c characters has at least c / this many tokens
        self.max_token_chars = max([len(b) for b in mergeable_ranks] + [len(n) for n in self.special_tokens])
        # longest name first, so a name that is a prefix of another never wins
        names = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(n) for n in names))

        def lookup(role: str, token: str | None) -> int | None:
            if token is None:
                return None
            if token not in self.special_tokens:
                raise TokenizerFileError(f"{source}: {role} {token!r} is not one of the special tokens")
            return self.special_tokens[token]

        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.bos_token_id = lookup("bos_token", bos_token)
        self.eos_token_id = lookup("eos_token", eos_token)
        self.pad_token_id = lookup("pad_token", pad_token)
        self.unk_token_id = lookup("unk_token", unk_token)
        if chat_format not in (None, "k3", "kimi_linear"):
            raise ValueError(f"chat_format must be 'k3', 'kimi_linear' or None, got {chat_format!r}")
        self.chat_format = chat_format

    # ---- sizes and ids -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Base tokens + 256 reserved special ids (163840 for the release)."""
        return self.num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def stop_token_ids(self) -> list[int]:
        """Token(s) that end an assistant turn in this checkpoint's chat format.

        Differs from ``eos_token_id`` (the tokenizer's ``[EOS]``): K3 stops on ``<|end_of_msg|>``,
        Kimi-Linear on ``<|im_end|>`` (both id n+2, the model config's ``eos_token_id``).
        """
        from kimik3.chat import k3, kimi_linear

        stop = {"k3": k3.STOP_TOKEN, "kimi_linear": kimi_linear.STOP_TOKEN}.get(self.chat_format or "")
        if stop is None or stop not in self.special_tokens:
            return [] if self.eos_token_id is None else [self.eos_token_id]
        return [self.special_tokens[stop]]

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._special_names)

    def is_special_id(self, token_id: int) -> bool:
        return token_id in self._special_names

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Special-token names -> ids; other strings -> the id of that exact base token (its UTF-8
        bytes), else ``unk_token_id`` (None when the tokenizer has no unk token)."""
        if isinstance(tokens, str):
            return self._token_to_id(tokens)
        return [self._token_to_id(t) for t in tokens]

    def _token_to_id(self, token: str) -> int | None:
        if not isinstance(token, str):
            raise TypeError(f"tokens must be str, got {type(token).__name__}")
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self._ranks.get(token.encode("utf-8"), self.unk_token_id)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Ids -> special names, or the token's text (bytes decoded with replacement)."""
        if isinstance(ids, int):
            return self._id_to_token(ids)
        return [self._id_to_token(i) for i in ids]

    def _id_to_token(self, token_id: int) -> str:
        self._check_id(token_id)
        if token_id in self._special_names:
            return self._special_names[token_id]
        return self._encoding.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")

    def _check_id(self, token_id: int) -> None:
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise TypeError(f"token ids must be int, got {type(token_id).__name__}")
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")

    # ---- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = False, limit: int | None = None) -> list[int]:
        """BPE-encode ``text``. Special-token strings in it are ordinary text unless
        ``allow_special`` (then every special-token name becomes its id). With ``limit``, a text of more than
        ``limit`` tokens raises ``TooManyTokens`` soon after the limit is passed, not at its end, so a huge
        prompt that cannot fit a context costs little (one of more than ``limit * max_token_chars`` characters
        is refused before any of it is encoded)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if limit is not None and len(text) > limit * self.max_token_chars:
            raise TooManyTokens(limit)
        if not allow_special:
            return self._encode_plain(text, limit)
        # Cut at special-token names first so the length cuts below never split one (an image prompt
        # holds thousands of <|media_pad|> in one run); tiktoken splits there anyway.
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(self._encode_plain(text[pos : m.start()], limit))
            ids.append(self.special_tokens[m.group()])
            pos = m.end()
            if limit is not None and len(ids) > limit:
                raise TooManyTokens(limit)
        ids.extend(self._encode_plain(text[pos:], None if limit is None else limit - len(ids)))
        return ids

    def _encode_plain(self, text: str, limit: int | None = None) -> list[int]:
        ids: list[int] = []
        for start in range(0, len(text), _MAX_ENCODE_CHARS):
            for piece in _split_long_runs(text[start : start + _MAX_ENCODE_CHARS], _MAX_RUN_CHARS):
                ids.extend(self._encoding.encode(piece, allowed_special=set(), disallowed_special=()))
            if limit is not None and len(ids) > limit:
                raise TooManyTokens(limit)
        return ids

    def encode_segments(self, segments: Iterable[Any], limit: int | None = None) -> list[int]:
        """Encode chat segments (objects with ``text`` and ``special``) one at a time: only segments
        flagged ``special`` may yield special ids, and BPE never merges across a segment boundary.
        ``limit``: as ``encode``'s, over all the segments."""
        ids: list[int] = []
        for seg in segments:
            try:
                ids.extend(self.encode(seg.text, allow_special=seg.special,
                                       limit=None if limit is None else limit - len(ids)))
            except TooManyTokens:
                raise TooManyTokens(limit) from None
        return ids

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text; invalid UTF-8 becomes U+FFFD. ``skip_special_tokens`` drops ids whose
        ``added_tokens_decoder`` entry is ``special: true`` (and unnamed reserved ids); the K3 XTML
        markers are ``special: false`` and stay, as the output parser needs them."""
        if isinstance(ids, int):
            ids = [ids]
        ids = list(ids)
        for i in ids:
            self._check_id(i)
        if skip_special_tokens:
            ids = [i for i in ids if not self._special_flag.get(i, False)]
        return self._encoding.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        return self._encoding.decode_single_token_bytes(token_id)

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------------

    def render_chat(self, conversation: Any, **kwargs: Any) -> list[Any]:
        """The chat segments for ``conversation`` in this checkpoint's format (see apply_chat_template)."""
        if self.chat_format == "k3":
            from kimik3.chat.k3 import render_k3

            return render_k3(conversation, **kwargs)
        if self.chat_format == "kimi_linear":
            from kimik3.chat.kimi_linear import render_kimi_linear

            return render_kimi_linear(conversation, **kwargs)
        raise ValueError(
            f"{self.source}: this tokenizer has no chat format (its special tokens name neither the K3 "
            f"XTML markers nor Kimi-Linear's <|im_*|> tokens, and no config.json model_type says which)"
        )

    def apply_chat_template(
        self,
        conversation: Any,
        tools: list[dict] | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        thinking: bool = True,
        thinking_effort: str | None = "max",
        tool_choice: Any = None,
        response_format: Any = None,
        images: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        limit: int | None = None,
    ) -> str | list[int]:
        """Render a conversation in the checkpoint's chat format.

        Returns the prompt text (special tokens as literal strings) or, with ``tokenize=True``, the
        ids encoded segment by segment, so text from messages never becomes special ids.
        ``images``: one ``kimik3.chat.ImagePrompt`` (original width, height, number of
        ``<|media_pad|>`` ids) per image content part, in order (K3 only); ``videos``: one
        ``kimik3.chat.VideoPrompt`` per video part; see ``kimik3.chat.k3``. ``limit`` (with ``tokenize``): a
        prompt of more ids raises ``TooManyTokens`` soon after the limit (``encode``).
        Invalid conversations raise ValueError/TypeError.
        """
        if not isinstance(tokenize, bool):
            raise TypeError(f"tokenize must be a bool, got {type(tokenize).__name__}")
        segments = self.render_chat(
            conversation,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            thinking_effort=thinking_effort,
            tool_choice=tool_choice,
            response_format=response_format,
            images=images,
            videos=videos,
        )
        if tokenize:
            return self.encode_segments(segments, limit)
        return "".join(seg.text for seg in segments)


def _split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """Cut ``text`` so no piece holds more than ``max_run`` consecutive whitespace or
    non-whitespace characters."""
    if len(text) <= max_run:
        yield text
        return
    start = 0
    run = 0
    prev_space = text[0].isspace()
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if is_space != prev_space:
            run = 1
            prev_space = is_space
        else:
            run += 1
            if run > max_run:
                yield text[start:i]
                start = i
                run = 1
    yield text[start:]


class IncrementalDetokenizer:
    """Turns a stream of ids into text deltas without ever emitting a partial UTF-8 character.

    Bytes of a character split across tokens (e.g. a 4-byte emoji) are held until complete; bytes
    that can never form valid UTF-8 become U+FFFD exactly as ``decode`` would, so
    ``"".join(feed(...) for chunk) + finish() == tokenizer.decode(all ids)``.
    """

    def __init__(self, tokenizer: KimiTokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._held = b""       # the bytes of a character not complete yet

    def feed(self, ids: int | Sequence[int]) -> str:
        """The text the ids complete (their bytes in one call to the encoding, then UTF-8 decoding that keeps
        an incomplete last character for the next call, as an incremental decoder does)."""
        if isinstance(ids, int):
            ids = [ids]
        tok = self.tokenizer
        if not ids:
            return ""
        top = max(ids) if set(map(type, ids)) == {int} else None
        if top is None or top >= tok.vocab_size or min(ids) < 0:
            for i in ids:       # the error naming the first bad id
                tok._check_id(i)
        if self.skip_special_tokens and top >= tok.num_base_tokens:      # special ids follow the base tokens
            ids = [i for i in ids if not tok._special_flag.get(i, False)]
        data = self._held + tok._encoding.decode_bytes(ids)
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._held = data[used:]
        return text

    def finish(self) -> str:
        """Flush: an incomplete trailing character becomes U+FFFD."""
        text, self._held = codecs.utf_8_decode(self._held, "replace", True)[0], b""
        return text


def load_tokenizer(path: str | Path) -> KimiTokenizer:
    """Load the tokenizer of a checkpoint directory (``tiktoken.model`` + ``tokenizer_config.json``;
    ``config.json``'s top-level ``model_type`` is read, if present, to confirm the chat format)."""
    root = Path(path)
    if not root.is_dir():
        raise TokenizerFileError(f"{root}: not a checkpoint directory")
    ranks = read_tiktoken_model(root / TIKTOKEN_FILE)
    cfg_path = root / CONFIG_FILE
    cfg = read_json_object(cfg_path)
    added = _added_tokens(cfg, cfg_path)
    model_type = None
    model_cfg_path = root / "config.json"
    if model_cfg_path.is_file():
        model_cfg = read_json_object(model_cfg_path, "model config")
        model_type = model_cfg.get("model_type")
    chat_format = detect_chat_format((t.content for t in added), model_type if isinstance(model_type, str) else None)
    tok = KimiTokenizer(
        ranks,
        added,
        bos_token=_token_name(cfg.get("bos_token"), "bos_token", cfg_path),
        eos_token=_token_name(cfg.get("eos_token"), "eos_token", cfg_path),
        pad_token=_token_name(cfg.get("pad_token"), "pad_token", cfg_path),
        unk_token=_token_name(cfg.get("unk_token"), "unk_token", cfg_path),
        chat_format=chat_format,
        name=str(root),
        source=str(cfg_path),
    )
    logger.info(
        "tokenizer %s: %d base tokens, vocab %d, chat format %s", root, tok.num_base_tokens, tok.vocab_size, chat_format
    )
    return tok
