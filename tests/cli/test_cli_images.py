"""``kimik3 generate --image`` and ``/image`` in ``kimik3 chat`` (on the embedded model, and on a random
tiny K3 where the output must depend on the pixels), as subprocesses;
bad image files end in one error line and exit code 2 (before the model loads)."""

import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

from tests.cli.test_cli import ENV, run


def start(*args) -> subprocess.Popen:
    """Start ``kimik3 ARGS`` (the box has few cores and each start imports torch: run a few at once)."""
    return subprocess.Popen([sys.executable, "-m", "kimik3.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = {}
    for name, (w, h) in {"wide": (90, 60), "tall": (16, 30)}.items():
        paths[name] = d / f"{name}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[name])
    # the same size as "wide" but all white: noise images of one size share their statistics, and a random
    # model's greedy tokens seldom tell two of them apart (the logits differ in the third decimal)
    paths["wide2"] = d / "wide2.png"
    Image.new("RGB", (90, 60), (255, 255, 255)).save(paths["wide2"])
    paths["corrupt"] = d / "corrupt.png"
    paths["corrupt"].write_bytes(paths["wide"].read_bytes()[:60])
    paths["bmp"] = d / "image.bmp"
    Image.new("RGB", (20, 20)).save(paths["bmp"])
    paths["thin"] = d / "thin.png"
    Image.new("RGB", (1, 100000)).save(paths["thin"])
    paths["zero"] = d / "zero.png"          # a PNG header claiming 0x5 pixels

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    paths["zero"].write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 5, 8, 2, 0, 0, 0))
                              + chunk(b"IEND", b""))
    return paths


@pytest.fixture(scope="module")
def random_vision_ckpt(tmp_path_factory):
    """A random tiny K3 with a vision tower and its own tokenizer. The embedded model is trained on
    text only (its vision tower is untrained) and its peaked predictions seldom change with the pixels
    of same-sized images, so the pixels-reach-the-model check runs on random weights."""
    import shutil

    import kimik3
    from kimik3.testing import make_tiny_checkpoint
    from kimik3.tokenizer_build import build_tiny_tokenizer, model_token_ids

    path = tmp_path_factory.mktemp("vision_ckpt")
    ids = model_token_ids(512)
    make_tiny_checkpoint(path, "kimi_k3", seed=3, vocab_size=ids["vocab_size"], bos=ids["bos_token_id"],
                         eos=ids["eos_token_id"], pad=ids["pad_token_id"], media=ids["media_placeholder_token_id"])
    build_tiny_tokenizer(path, base_vocab_size=512, seed=1)
    shutil.copyfile(kimik3.DEFAULT_MODEL / "preprocessor_config.json", path / "preprocessor_config.json")
    # loud image rows (projector output norm x 20): a random text model then follows the pixels, so
    # different images give different greedy tokens rather than the same ones by chance
    from safetensors.torch import load_file, save_file
    for f in path.glob("*.safetensors"):
        tensors = load_file(str(f))
        if any(k.endswith("mm_projector.post_norm.weight") for k in tensors):
            save_file({k: v * 20 if k.endswith("mm_projector.post_norm.weight") else v for k, v in tensors.items()},
                      str(f), metadata={"format": "pt"})
    return path


def test_generate_with_two_images(pictures, random_vision_ckpt):
    args = ["generate", "What differs between these?", "--max-tokens", "8", "--no-thinking",
            "--model", random_vision_ckpt]
    a = start(*args, "--image", pictures["wide"], "--image", pictures["tall"])
    other = start(*args, "--image", pictures["wide2"], "--image", pictures["tall"])
    (a_out, a_err), (o_out, o_err) = a.communicate(timeout=180), other.communicate(timeout=180)
    assert a.returncode == 0, a_err
    assert other.returncode == 0, o_err
    assert a_out.strip() and "[8 tokens in" in a_err
    assert o_out != a_out                           # the pixels reach the model (same sizes, same prompt ids)


def test_chat_attaches_images_and_survives_a_bad_one(pictures):
    script = (f"/image {pictures['wide']}\nwhat is it?\nand this one?\n/image {pictures['thin']}\n"
              f"/image {pictures['tall']}\nthird\n/exit\n")
    r = run("chat", "--max-tokens", "4", "--no-thinking", stdin=script)
    assert r.returncode == 0, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("kimik3: error:")]
    assert len(errors) == 1 and str(pictures["thin"]) in errors[0] and "extreme aspect ratio" in errors[0]
    assert len([line for line in r.stdout.splitlines() if line.strip()]) >= 1


BAD = {"corrupt": "corrupt or truncated PNG", "bmp": "unsupported image format BMP",
       "thin": "extreme aspect ratio", "zero": "cannot identify an image"}


def test_bad_image_files_give_one_line_and_exit_2(pictures):
    procs = {name: start("generate", "--image", pictures[name], "q") for name in BAD}
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, (name, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kimik3: error: image"), (name, err)
        assert str(pictures[name]) in lines[0] and BAD[name] in lines[0], (name, err)
        assert out == ""
