"""Prepare the training corpus of the embedded default model (CPU, about a minute).

Source: Jane Austen's six novels (public domain; Project Gutenberg transcriptions) as shipped by
the Debian package ``r-cran-janeaustenr`` (package code MIT, Julia Silge). The ``.deb`` is
fetched with ``apt-get download`` (or given with ``--deb``) and unpacked with ``dpkg-deb``; R is not
needed: the novels are read straight from the package's lazy-load database
(``data/Rdata.rdb`` / ``Rdata.rdx``: zlib-compressed R serializations of character vectors).

Output (``--out``, default ``.corpus/`` at the repository root, git-ignored):

  ``tokenizer/tiktoken.model``, ``tokenizer/tokenizer_config.json``  BPE trained on the train split
  ``tokens.npz``   ``train`` / ``val`` uint16 token ids (val: the last 2% of each novel's paragraphs)
  ``val.txt``      the validation text
  ``meta.json``    source package, sha256, sizes

    python scripts/prepare_corpus.py [--deb PATH] [--out DIR] [--base-vocab 4096]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import re
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import numpy as np

from kimik3.tokenizer import load_tokenizer
from kimik3.tokenizer_build import write_tokenizer

logger = logging.getLogger("prepare_corpus")

PACKAGE = "r-cran-janeaustenr"
DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"
VAL_FRACTION = 0.02
ROOT = Path(__file__).resolve().parents[1]


class _RReader:
    """Just enough of R's XDR serialization (format version 2 or 3) for a character vector."""

    def __init__(self, raw: bytes):
        if raw[:2] != b"X\n":
            raise ValueError("not an XDR R serialization (expected 'X\\n')")
        self.raw, self.pos = raw, 2
        version = self.int()
        self.int(), self.int()                         # writer / minimal reader versions
        if version == 3:
            n = self.int()                             # native encoding name
            self.pos += n
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.raw, self.pos)
        self.pos += 4
        return v

    def strings(self) -> list[str]:
        flags = self.int()
        if flags & 0xFF != 16:                         # STRSXP
            raise ValueError(f"expected a character vector (STRSXP), got SEXP type {flags & 0xFF}")
        out = []
        for _ in range(self.int()):
            f = self.int()
            if f & 0xFF != 9:                          # CHARSXP
                raise ValueError(f"expected CHARSXP, got SEXP type {f & 0xFF}")
            n = self.int()
            if n < 0:                                  # NA_character_
                out.append("")
                continue
            data = self.raw[self.pos:self.pos + n]
            self.pos += n
            out.append(data.decode("latin-1" if f & (1 << 14) else "utf-8"))
        return out


def read_novels(data_dir: Path) -> dict[str, list[str]]:
    """name -> lines of each novel, from the package's lazy-load database."""
    index = gzip.decompress((data_dir / "Rdata.rdx").read_bytes())
    names = re.findall(rb"\x00\x04\x00\x09\x00\x00\x00.([a-z]+)", index, re.DOTALL)
    # the index is a list (variables, references, compressed); the variables' names are its CHARSXPs
    # before those three; the database holds one compressed object per variable, in that order
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    novels, pos = {}, 0
    wanted = [n.decode() for n in names if n.decode() not in ("names", "variables", "references", "compressed")]
    for name in wanted:
        (ulen,) = struct.unpack_from(">I", rdb, pos)
        obj = zlib.decompressobj()
        raw = obj.decompress(rdb[pos + 4:])
        if len(raw) != ulen:
            raise ValueError(f"{name}: decompressed {len(raw)} bytes, the header says {ulen}")
        novels[name] = _RReader(raw).strings()
        pos = len(rdb) - len(obj.unused_data)
    if pos != len(rdb):
        raise ValueError(f"Rdata.rdb: {len(rdb) - pos} trailing bytes not read")
    return novels


def paragraphs(lines: list[str]) -> list[str]:
    """Join wrapped lines into paragraphs; drop headings (VOLUME/CHAPTER lines, the title page)
    and the underscores that mark italics."""
    out, cur = [], []
    for line in [*lines, ""]:
        line = line.strip()
        if line:
            cur.append(line)
            continue
        if cur:
            text = " ".join(cur).replace("_", "")
            text = re.sub(r"\s+", " ", text)
            if not re.fullmatch(r"(CHAPTER|VOLUME|Chapter)\b.*|[A-Z0-9 .,:;'-]+|By Jane Austen", text):
                out.append(text)
            cur = []
    return out


def fetch_deb(workdir: Path) -> Path:
    subprocess.run(["apt-get", "download", PACKAGE], cwd=workdir, check=True, capture_output=True)
    debs = sorted(workdir.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise FileNotFoundError(f"apt-get download {PACKAGE} wrote no .deb in {workdir}")
    return debs[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deb", type=Path, help=f"the {PACKAGE} .deb (default: apt-get download it)")
    ap.add_argument("--out", type=Path, default=ROOT / ".corpus")
    ap.add_argument("--base-vocab", type=int, default=4096, help="BPE base tokens (the 256 K3 specials follow)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        deb = args.deb or fetch_deb(Path(tmp))
        sha = hashlib.sha256(deb.read_bytes()).hexdigest()
        subprocess.run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "x")], check=True)
        novels = read_novels(Path(tmp) / "x" / DATA_DIR)
    train_parts, val_parts = [], []
    for name, lines in novels.items():
        paras = paragraphs(lines)
        cut = len(paras) - max(1, round(VAL_FRACTION * len(paras)))
        train_parts.append("\n\n".join(paras[:cut]))
        val_parts.append("\n\n".join(paras[cut:]))
        logger.info("%s: %d paragraphs (%d held out)", name, len(paras), len(paras) - cut)
    train_text, val_text = "\n\n".join(train_parts) + "\n\n", "\n\n".join(val_parts) + "\n\n"
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    logger.info("training the BPE (%d base tokens) on %d characters ...", args.base_vocab, len(train_text))
    write_tokenizer(out / "tokenizer", train_text, args.base_vocab, "k3")
    tok = load_tokenizer(out / "tokenizer")
    train, val = (np.asarray(tok.encode(t), dtype=np.uint16) for t in (train_text, val_text))
    np.savez(out / "tokens.npz", train=train, val=val)
    (out / "val.txt").write_text(val_text, encoding="utf-8")
    meta = {"package": deb.name, "sha256": sha, "novels": sorted(novels), "train_chars": len(train_text),
            "val_chars": len(val_text), "train_tokens": int(train.size), "val_tokens": int(val.size),
            "base_vocab": args.base_vocab, "vocab_size": tok.vocab_size}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    logger.info("%s", json.dumps(meta))


if __name__ == "__main__":
    main()
