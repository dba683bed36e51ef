"""FP8 accuracy on the trained default model (``kimik3/default_model``) over held-out text
(``tests/data/default_model_heldout.txt``, never trained on): the model in bf16 scores every next token of the
text in one pass, then with its MLA latents in an FP8 cache (``--kv-cache-dtype fp8``), then with FP8 weights
(``--quantization fp8``); each against bf16: greedy agreement (same argmax) and the mean per-token
KL(bf16 || mode) in nats. Targets (issue #56): agreement >= 97%, KL <= 0.01.

The default model is K3-shaped: its routed experts are MXFP4, which ``--quantization fp8`` leaves alone. Two
expert modes measure the expert FP8 paths on it:
  * ``fp8_experts``: its experts as a bf16 checkpoint holds them (the MXFP4 values), stored FP8 with channel
    scales as ``--quantization fp8`` stores Kimi-Linear's (``Experts.to_fp8``); one pass over the text is a
    prefill, so the activations are quantised per 128 columns (``fp8_experts_weight_only``: the decode form,
    the weights alone); ``fp8_weights_and_experts``: with the dense projections too (the whole of
    ``--quantization fp8`` on a bf16-expert model);
  * ``w4a8_experts``: the MXFP4 experts kept packed, activations MXFP8 (``--enable-w4a8-moe``).
``kimi_linear_random``: a random-weight tiny Kimi-Linear checkpoint (hidden 256, 4 layers, 8 experts top-2)
with FP8 experts against bf16, beside the same model in bf16 against float32: random weights are no language
model (their argmax flips at small changes), so that pair calibrates the figure; no target.

    PYTHONPATH=. python benchmarks/fp8_accuracy.py [--device cuda]    (writes $OUT/fp8_accuracy.json)

On the CPU the FP8 paths are the e4m3 round trips of the references; on CUDA the kernels.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kimik3                                                           # noqa: E402
from kimik3.loader.fp8 import quantize_fp8                              # noqa: E402
from kimik3.model.batch import ForwardBatch, HybridCache                 # noqa: E402
from kimik3.model.moe import Experts                                    # noqa: E402
from kimik3.ops.fp8 import FP8                                          # noqa: E402
from kimik3.ops.options import kernel_options, use_kernel_options       # noqa: E402

HELD_OUT = ROOT / "tests" / "data" / "default_model_heldout.txt"
TARGET_AGREEMENT, TARGET_KL = 0.97, 0.01


def next_token_logits(model, ids: list[int], latent_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits [T, vocab] (float64) of one prefill over ``ids``, its latents through a cache in ``latent_dtype``."""
    T = len(ids)
    cache = HybridCache.allocate(model.cache_text_config, 2, 2, T, model.dtype, model.device, latent_dtype)
    batch = ForwardBatch.build([T], [0], [1], [[1]], block_size=T, device=model.device)
    hidden = model.forward_step(torch.tensor(ids, device=model.device), batch, cache)
    return model.compute_logits(hidden).double().cpu()


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    """Greedy agreement and mean per-token KL(ref || other) in nats."""
    logp, logq = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return {"agreement": float((ref.argmax(-1) == other.argmax(-1)).double().mean()),
            "mean_kl_nats": float(kl.mean()), "max_kl_nats": float(kl.max()), "tokens": ref.shape[0]}


MODES = ("fp8_kv_cache", "fp8_weights", "fp8_weights_and_kv_cache", "fp8_experts", "fp8_experts_weight_only",
         "fp8_weights_and_experts", "w4a8_experts")


@torch.inference_mode()
def measure(device: str = "cpu", max_tokens: int | None = None, random_kimi_linear: bool = True) -> dict:
    """The modes against bf16 over the held-out text (its first ``max_tokens`` tokens if given)."""
    tok = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
    ids = tok.encode(HELD_OUT.read_text(encoding="utf-8"))[:max_tokens]
    model = kimik3.load_model(kimik3.DEFAULT_MODEL, device=device, dtype=torch.bfloat16, packed_experts=False)
    ref = next_token_logits(model, ids)
    out = {"fp8_kv_cache": compare(ref, next_token_logits(model, ids, FP8))}
    for m in model.modules():
        if isinstance(m, Experts):
            m.to_fp8()
    out["fp8_experts"] = compare(ref, next_token_logits(model, ids))
    with use_kernel_options(kernel_options().tuned(fp8_experts_quant_rows_per_expert=1 << 62)):
        out["fp8_experts_weight_only"] = compare(ref, next_token_logits(model, ids))
    quantize_fp8(model)
    out["fp8_weights_and_experts"] = compare(ref, next_token_logits(model, ids))
    del model
    model = kimik3.load_model(kimik3.DEFAULT_MODEL, device=device, dtype=torch.bfloat16, packed_experts=True)
    with use_kernel_options(dataclasses.replace(kernel_options(), w4a8_moe=True)):
        out["w4a8_experts"] = compare(ref, next_token_logits(model, ids))
    quantize_fp8(model)
    out["fp8_weights"] = compare(ref, next_token_logits(model, ids))
    out["fp8_weights_and_kv_cache"] = compare(ref, next_token_logits(model, ids, FP8))
    if random_kimi_linear:
        out["kimi_linear_random"] = random_kimi_linear_figures(device)
    return out


def random_kimi_linear_figures(device: str) -> dict:
    """A random tiny Kimi-Linear checkpoint over 256 token ids: FP8 experts against bf16, and bf16 against
    float32 (how far a rounding moves this model)."""
    import tempfile

    from kimik3.testing import make_tiny_checkpoint
    ids = [i * 37 % 250 for i in range(256)]
    with tempfile.TemporaryDirectory() as path:
        make_tiny_checkpoint(path, "kimi_linear", hidden=256, num_layers=4)
        f32 = next_token_logits(kimik3.load_model(path, device=device, dtype=torch.float32), ids)
        model = kimik3.load_model(path, device=device, dtype=torch.bfloat16)
        ref = next_token_logits(model, ids)
        fp8 = next_token_logits(kimik3.load_model(path, device=device, dtype=torch.bfloat16, quantization="fp8"), ids)
        for m in model.modules():
            if isinstance(m, Experts):
                m.to_fp8()
        experts = next_token_logits(model, ids)
    return {"fp8_experts": compare(ref, experts), "quantization_fp8": compare(ref, fp8),
            "bf16_against_float32": compare(f32, ref)}


def main() -> None:
    from benchmarks.common import commit_id, log, save_results
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    results = measure(device)
    card = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    results.update(device=card, commit=commit_id(), date=datetime.date.today().isoformat())
    rows = [(mode, results[mode], True) for mode in MODES]
    rows += [(f"kimi_linear_random {k}", r, False) for k, r in results["kimi_linear_random"].items()]
    for mode, r, target in rows:
        log(f"{mode:40s} agreement {r['agreement']:.4f}{f' (target >= {TARGET_AGREEMENT})' if target else ''}  "
            f"mean KL {r['mean_kl_nats']:.5f} nats{f' (target <= {TARGET_KL})' if target else ''}  max KL "
            f"{r['max_kl_nats']:.4f}  over {r['tokens']} tokens")
    log("saved", save_results("fp8_accuracy.json", results))


if __name__ == "__main__":
    main()
