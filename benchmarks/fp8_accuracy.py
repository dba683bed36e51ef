"""FP8 accuracy on the trained default model (``kimik3/default_model``) over held-out text
(``tests/data/default_model_heldout.txt``, never trained on): the model in bf16 scores every next token of the
text in one pass, then with its MLA latents in an FP8 cache (``--kv-cache-dtype fp8``), then with FP8 weights
(``--quantization fp8``); each against bf16: greedy agreement (same argmax) and the mean per-token
KL(bf16 || mode) in nats. Targets (issue #56): agreement >= 97%, KL <= 0.01.

    PYTHONPATH=. python benchmarks/fp8_accuracy.py [--device cuda]    (writes $OUT/fp8_accuracy.json)

On the CPU the FP8 paths are the e4m3 round trips of the references; on CUDA the kernels.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kimik3                                                           # noqa: E402
from kimik3.loader.fp8 import quantize_fp8                              # noqa: E402
from kimik3.model.batch import ForwardBatch, HybridCache                 # noqa: E402
from kimik3.ops.fp8 import FP8                                          # noqa: E402

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


@torch.inference_mode()
def measure(device: str = "cpu", max_tokens: int | None = None) -> dict:
    """The three modes against bf16 over the held-out text (its first ``max_tokens`` tokens if given)."""
    tok = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
    ids = tok.encode(HELD_OUT.read_text(encoding="utf-8"))[:max_tokens]
    model = kimik3.load_model(kimik3.DEFAULT_MODEL, device=device, dtype=torch.bfloat16)
    ref = next_token_logits(model, ids)
    out = {"fp8_kv_cache": compare(ref, next_token_logits(model, ids, FP8))}
    quantize_fp8(model)
    out["fp8_weights"] = compare(ref, next_token_logits(model, ids))
    out["fp8_weights_and_kv_cache"] = compare(ref, next_token_logits(model, ids, FP8))
    return out


def main() -> None:
    from benchmarks.common import commit_id, log, save_results
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    results = measure(device)
    card = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    results.update(device=card, commit=commit_id(), date=datetime.date.today().isoformat())
    for mode in ("fp8_kv_cache", "fp8_weights", "fp8_weights_and_kv_cache"):
        r = results[mode]
        log(f"{mode:26s} agreement {r['agreement']:.4f} (target >= {TARGET_AGREEMENT})  mean KL "
            f"{r['mean_kl_nats']:.5f} nats (target <= {TARGET_KL})  max KL {r['max_kl_nats']:.4f}  over {r['tokens']} tokens")
    log("saved", save_results("fp8_accuracy.json", results))


if __name__ == "__main__":
    main()
