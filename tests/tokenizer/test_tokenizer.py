import json
import shutil

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from kimik3.tokenizer import (
    PAT_STR,
    IncrementalDetokenizer,
    KimiTokenizer,
    TokenizerFileError,
    TooManyTokens,
    _split_long_runs,
    detect_chat_format,
    load_tokenizer,
)
from kimik3.tokenizer_build import model_token_ids, special_token_ids

BASE = 2048
PRETOK = regex.compile("(?V1)" + PAT_STR)


# ---- special tokens come from the files -----------------------------------------------------------


def test_special_ids_follow_the_base_vocab(tok):
    # offsets hand-copied from the release table (spec vision-multimodal §5.1): id - 163584
    assert tok.special_tokens["[BOS]"] == BASE + 0
    assert tok.special_tokens["[EOS]"] == BASE + 1
    assert tok.special_tokens["<|end_of_msg|>"] == BASE + 2
    assert tok.special_tokens["<|open|>"] == BASE + 3
    assert tok.special_tokens["<|close|>"] == BASE + 4
    assert tok.special_tokens["<|sep|>"] == BASE + 5
    assert tok.special_tokens["<|media_begin|>"] == BASE + 18
    assert tok.special_tokens["<|media_pad|>"] == BASE + 21
    assert tok.special_tokens["[UNK]"] == BASE + 254
    assert tok.special_tokens["[PAD]"] == BASE + 255
    assert tok.special_tokens[f"<|reserved_token_{BASE + 8}|>"] == BASE + 8
    assert tok.vocab_size == BASE + 256 == len(tok)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (BASE, BASE + 1, BASE + 255, BASE + 254)
    assert tok.stop_token_ids == [BASE + 2]
    assert tok.chat_format == "k3"


def test_release_id_map():
    # values written by hand from spec README §2 "tokens" row
    ids = special_token_ids(163584)
    assert ids["[BOS]"] == 163584 and ids["<|end_of_msg|>"] == 163586
    assert (ids["<|open|>"], ids["<|close|>"], ids["<|sep|>"]) == (163587, 163588, 163589)
    assert [ids[t] for t in ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")] == [
        163602, 163603, 163604, 163605]
    assert ids["<osagent_mode>"] == 163649 and ids["[UNK]"] == 163838 and ids["[PAD]"] == 163839
    assert model_token_ids(163584) == {
        "vocab_size": 163840, "bos_token_id": 163584, "eos_token_id": 163586,
        "pad_token_id": 163839, "media_placeholder_token_id": 163605}
    lin = special_token_ids(163584, "kimi_linear")
    assert (lin["<|im_end|>"], lin["<|im_user|>"], lin["<|im_assistant|>"], lin["<|im_middle|>"]) == (
        163586, 163587, 163588, 163601)
    assert lin["<|im_system|>"] == 163594


def test_special_text_is_plain_unless_allowed(tok):
    open_id = tok.special_tokens["<|open|>"]
    ids = tok.encode("say <|open|> and <|end_of_msg|> and [BOS]")
    assert all(i < BASE for i in ids)
    assert tok.decode(ids) == "say <|open|> and <|end_of_msg|> and [BOS]"
    assert tok.encode("<|open|>x", allow_special=True)[0] == open_id
    assert tok.encode("<|open|>", allow_special=True) == [open_id]
    # "[BOS]" is a special token too, so allow_special turns it into its id
    assert tok.encode("[BOS]", allow_special=True) == [tok.bos_token_id]


def test_convert_tokens(tok):
    assert tok.convert_tokens_to_ids("<|media_pad|>") == BASE + 21
    assert tok.convert_tokens_to_ids(["<|open|>", "a"]) == [BASE + 3, ord("a")]
    assert tok.convert_tokens_to_ids("no such token surely") == tok.unk_token_id
    assert tok.convert_ids_to_tokens([BASE + 4, ord("z")]) == ["<|close|>", "z"]
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TypeError, match="must be int"):
        tok.decode(["a"])
    with pytest.raises(TypeError, match="takes a str"):
        tok.encode(b"bytes")


def test_skip_special_tokens_keeps_xtml_markers(tok):
    ids = [tok.bos_token_id] + tok.encode("<|open|>hi<|sep|><|end_of_msg|>", allow_special=True)
    # <|open|>/<|sep|> are special: false in the release config; [BOS] and <|end_of_msg|> are special
    assert tok.decode(ids, skip_special_tokens=True) == "<|open|>hi<|sep|>"
    assert tok.decode(ids) == "[BOS]<|open|>hi<|sep|><|end_of_msg|>"


# ---- pre-tokenisation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, pieces",
    [
        ("Hello world", ["Hello", " world"]),
        ("你好世界abc", ["你好世界", "abc"]),
        ("I'm here", ["I'm", " here"]),
        ("12345", ["123", "45"]),
        ("x  = 1;\n\n", ["x", " ", " =", " ", "1", ";\n\n"]),
        ("HTTPServer", ["HTTPServer"]),
        ("a\n\n  b", ["a", "\n\n", " ", " b"]),
    ],
    ids=["words", "han", "contraction", "digits", "punct-newlines", "camel", "newline-space"],
)
def test_pretokeniser(text, pieces):
    assert PRETOK.findall(text) == pieces


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_tokens_never_cross_pretokeniser_pieces(tok, text):
    # tiktoken must split with the same regex: every token lies inside one piece
    bounds = {0}
    pos = 0
    for piece in PRETOK.findall(text):
        pos += len(piece.encode("utf-8"))
        bounds.add(pos)
    pos = 0
    for i in tok.encode(text):
        start, pos = pos, pos + len(tok.token_bytes(i))
        inner = {b for b in bounds if start < b < pos}
        assert not inner, (text, i)


# ---- round trips and streaming --------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, allow_special=True)) == text


def _stream(tok, ids, chunks):
    det = tok.detokenizer()
    deltas = []
    k = 0
    for n in chunks:
        deltas.append(det.feed(ids[k : k + n]))
        k += n
    deltas.append(det.feed(ids[k:]))
    deltas.append(det.finish())
    return deltas


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60), st.lists(st.integers(0, 4), max_size=30))
def test_streaming_matches_decode(tok, text, chunks):
    ids = tok.encode(text)
    deltas = _stream(tok, ids, chunks)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_emoji_split_across_tokens_is_held_back(tok):
    text = "ok \U0001F9EA\U0001FAE0 done"  # two emoji the tiny corpus never saw: byte tokens only
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # the emoji are spread over several byte tokens
    det = tok.detokenizer()
    deltas = [det.feed(i) for i in ids] + [det.finish()]
    assert "".join(deltas) == text
    assert "" in deltas  # at least one id produced no text yet (incomplete character)
    assert all(d in text for d in deltas)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, BASE + 255), max_size=40))
def test_streaming_arbitrary_ids_equals_decode(tok, ids):
    # arbitrary ids may form invalid UTF-8: streaming must still equal decode() exactly
    det = IncrementalDetokenizer(tok)
    out = "".join(det.feed(i) for i in ids) + det.finish()
    assert out == tok.decode(ids)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, BASE + 255), max_size=40), st.lists(st.integers(0, 5), max_size=12), st.booleans())
def test_streaming_arbitrary_ids_in_chunks_equals_decode(tok, ids, chunks, skip):
    # ids fed a list at a time (the engine decodes a delta's tokens in one call), special ids skipped or not
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    k, out = 0, []
    for n in chunks:
        out.append(det.feed(ids[k:k + n]))
        k += n
    out += [det.feed(ids[k:]), det.finish()]
    assert "".join(out) == tok.decode(ids, skip_special_tokens=skip)


def test_streaming_rejects_bad_ids(tok):
    det = tok.detokenizer()
    for bad, err in (([1, BASE + 256], ValueError), ([1, -1], ValueError), ([True], TypeError), ([1.0], TypeError)):
        with pytest.raises(err):
            det.feed(bad)


def test_streaming_skip_special(tok):
    ids = tok.encode("[BOS]<|open|>a", allow_special=True)
    det = tok.detokenizer(skip_special_tokens=True)
    assert det.feed(ids) + det.finish() == "<|open|>a"


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=" ab\n", max_size=200), st.integers(1, 9))
def test_split_long_runs(text, max_run):
    pieces = list(_split_long_runs(text, max_run))
    assert "".join(pieces) == text
    for p in pieces:
        for run in regex.findall(r"\s+|\S+", p):
            assert len(run) <= max_run


# ---- chat format choice ---------------------------------------------------------------------------


def test_detect_chat_format():
    k3 = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
    lin = ["<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "<|im_system|>"]
    assert detect_chat_format(k3) == "k3"
    assert detect_chat_format(lin) == "kimi_linear"
    assert detect_chat_format(["[BOS]"]) is None
    assert detect_chat_format(["[BOS]"], "kimi_linear") == "kimi_linear"
    assert detect_chat_format(k3, "kimi_k3") == "k3"
    assert detect_chat_format(k3, "kimi_linear") == "k3"      # the tokenizer's names decide (K3 text-only)
    assert detect_chat_format(lin, "kimi_k3") == "kimi_linear"


def test_tokenizer_names_decide_over_config_model_type(tiny_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, d)
    (d / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    assert load_tokenizer(d).chat_format == "k3"        # a K3 text-only checkpoint beside the K3 tokenizer
    (d / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    assert load_tokenizer(d).chat_format == "k3"


def test_no_chat_format_means_no_template():
    ranks = {bytes([b]): b for b in range(256)}
    t = KimiTokenizer(ranks, bos_token=None, eos_token=None)
    assert t.chat_format is None and t.vocab_size == 512
    with pytest.raises(ValueError, match="no chat format"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- bad files ------------------------------------------------------------------------------------


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, d)
    return d


def test_missing_files(ckpt, tmp_path):
    with pytest.raises(TokenizerFileError, match="not a checkpoint directory"):
        load_tokenizer(tmp_path / "nowhere")
    (ckpt / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerFileError, match=r"tokenizer_config\.json: tokenizer config file not found"):
        load_tokenizer(ckpt)
    (ckpt / "tiktoken.model").unlink()
    with pytest.raises(TokenizerFileError, match=r"tiktoken\.model: tokenizer vocabulary file not found"):
        load_tokenizer(ckpt)


def _edit_lines(path, fn):
    lines = path.read_text().splitlines()
    path.write_text("\n".join(fn(lines)) + "\n")


def test_corrupt_vocab(ckpt):
    vocab = ckpt / "tiktoken.model"
    _edit_lines(vocab, lambda ls: ls[:2] + ["!!notbase64 2"] + ls[3:])
    with pytest.raises(TokenizerFileError, match=r"tiktoken\.model:3: bad base64"):
        load_tokenizer(ckpt)


def test_vocab_rank_gap(ckpt):
    _edit_lines(ckpt / "tiktoken.model", lambda ls: ls[:-2] + ls[-1:])
    with pytest.raises(TokenizerFileError, match="ranks must be exactly"):
        load_tokenizer(ckpt)


def test_vocab_bad_line(ckpt):
    _edit_lines(ckpt / "tiktoken.model", lambda ls: ls + ["QQ== 5 extra"])
    with pytest.raises(TokenizerFileError, match=r"tiktoken\.model:\d+: expected"):
        load_tokenizer(ckpt)


def test_corrupt_config(ckpt):
    (ckpt / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerFileError, match=r"tokenizer_config\.json: not a readable JSON"):
        load_tokenizer(ckpt)


def test_config_added_token_out_of_range(ckpt):
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["5"] = {"content": "<|weird|>", "special": True}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerFileError, match=r"tokenizer_config\.json: added token '<\|weird\|>' has id 5"):
        load_tokenizer(ckpt)


def test_config_unknown_bos(ckpt):
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["bos_token"] = {"content": "<s>"}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerFileError, match=r"bos_token '<s>' is not one of the special tokens"):
        load_tokenizer(ckpt)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<|open|>", "<|sep|>", "[BOS]", "<|media_pad|>", "<|", "|>", "ab", " ", "é", "\n"]),
                max_size=30).map("".join))
def test_allow_special_matches_tiktoken(tok, text):
    assert tok.encode(text, allow_special=True) == tok._encoding.encode(text, allowed_special="all")


# ---- a limit: a text too long for a context costs little ----------------------------------------------


def test_max_token_chars_bounds_every_token(tok):
    longest = max(len(tok._encoding.decode_single_token_bytes(i)) for i in range(tok.num_base_tokens))
    assert tok.max_token_chars >= longest
    assert tok.max_token_chars >= max(len(name) for name in tok.special_tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<|open|>", "<|sep|>", "ab", "abc ", " ", "é", "\n", "x" * 40]), max_size=40).map("".join),
       st.booleans(), st.integers(0, 60))
def test_encode_with_a_limit(tok, text, special, limit):
    """Within the limit: the same ids as without one; beyond it: TooManyTokens, never a shortened list."""
    full = tok.encode(text, allow_special=special)
    if len(full) <= limit:
        assert tok.encode(text, allow_special=special, limit=limit) == full
    else:
        with pytest.raises(TooManyTokens):
            tok.encode(text, allow_special=special, limit=limit)


def test_a_huge_text_is_refused_early(tok, monkeypatch):
    """A text that cannot fit is refused before it is encoded to its end: by its length alone when it is longer
    than limit x the longest token, else after the first piece past the limit (a 57 MiB prompt took a server's
    tokenizer ~2 minutes)."""
    import kimik3.tokenizer as T
    calls = []
    encode = tok._encoding.encode
    monkeypatch.setattr(tok._encoding, "encode", lambda piece, **kw: calls.append(len(piece)) or encode(piece, **kw))
    with pytest.raises(TooManyTokens, match="more than 100 tokens"):
        tok.encode("ab" * (100 * tok.max_token_chars), limit=100)
    assert calls == []
    monkeypatch.setattr(T, "_MAX_ENCODE_CHARS", 1000)
    text = "ab " * 30_000                            # 90 pieces of 1000 characters
    assert len(text) <= 20_000 * tok.max_token_chars    # within the length bound: encoded until past the limit
    with pytest.raises(TooManyTokens):
        tok.encode(text, limit=20_000)
    assert 1 < len(calls) < 90                       # stopped before its end
