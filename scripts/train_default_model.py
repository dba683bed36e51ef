"""Train the embedded default model: a tiny Kimi-K3 on Jane Austen's novels (public domain).

The model is the exact K3 architecture at toy widths (KDA with the full-rank output gate and the
bounded decay gate, gated NoPE MLA, attention residuals whose last block is partial, latent MoE
with SITU, shared experts, MXFP4 routed experts, the tiny MoonViT tower), built from kimik3's own
modules and trained through the torch reference ops with autograd (``reference_ops()`` also on
CUDA: the fast kernels have no backward). Routed experts are trained quantisation-aware: from
``--qat-start`` (a fraction of the budget) on, every forward uses their MXFP4 round trip with a
straight-through gradient, so the checkpoint's MXFP4 experts are exactly the trained weights.
The router's ``e_score_correction_bias`` is not trained by gradient: it follows the aux-loss-free
balancing rule (bias += rate * sign(mean load - load) per step). The vision tower keeps its
random initialisation (text-only corpus); it is in the checkpoint so every code path runs.

Input: ``scripts/prepare_corpus.py``'s output (``--corpus``, default ``.corpus/``). Output
(``--out``): the release layout (``config.json``, two safetensors shards + index, tokenizer,
``preprocessor_config.json``) and, beside it, ``train_log.json`` (losses, tokens, time, sample).

    python scripts/train_default_model.py --device cuda --minutes 5 --out /tmp/default_model
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

import kimik3
from kimik3.config import parse_config
from kimik3.loader.writer import save_checkpoint
from kimik3.model.batch import ForwardBatch, HybridCache
from kimik3.model.kimi_k3 import KimiForCausalLM
from kimik3.model.moe import MoE
from kimik3.ops import mxfp4
from kimik3.ops.backend import reference_ops
from kimik3.testing import checkpoint_names, random_weights, tiny_k3_config
from kimik3.tokenizer import load_tokenizer
from kimik3.tokenizer_build import model_token_ids
from kimik3.vision.preprocess import MediaProcessorConfig

logger = logging.getLogger("train_default_model")
ROOT = Path(__file__).resolve().parents[1]

# Widths of the default model. Layers (1-based) 4 and 6 are MLA, the rest KDA; attention residual
# blocks of 4 layers, so the second block (layers 5-6) is partial, as K3's last (93 = 7*12 + 9).
SIZES = dict(num_layers=6, hidden=256, block_size=4, num_experts=8, top_k=2, num_heads=4)
TEXT_OVERRIDES = {
    "intermediate_size": 768, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "moe_intermediate_size": 256, "routed_expert_hidden_size": 128,
    "num_shared_experts": 1,
}
KDA_HEAD_DIM = 64
OUTPUT_PROJ = ("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight", "experts.w2")


def model_config(vocab_ids: dict[str, int]) -> dict:
    cfg = tiny_k3_config(vocab_size=vocab_ids["vocab_size"], bos=vocab_ids["bos_token_id"], eos=vocab_ids["eos_token_id"],
                         pad=vocab_ids["pad_token_id"], media=vocab_ids["media_placeholder_token_id"], **SIZES)
    cfg["text_config"].update(TEXT_OVERRIDES)
    cfg["text_config"]["linear_attn_config"]["head_dim"] = KDA_HEAD_DIM
    cfg["text_config"]["max_position_embeddings"] = 1048576
    return cfg


def init_weights(model: KimiForCausalLM, seed: int) -> None:
    """random_weights' special tensors (A_log, dt_bias, conv, vision tower) and, for training, unit
    norms, zero AttnRes queries and router bias, fan-in scaled matrices with damped output projections."""
    random_weights(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    depth = 2 * model.config.text.num_hidden_layers
    for name, p in model.named_parameters():
        if name.startswith("vision."):
            continue
        if name.endswith(("res_proj.weight", "e_score_correction_bias")):
            value = torch.zeros(p.shape)
        elif p.dim() == 1 and not name.endswith(("A_log", "dt_bias")):
            value = torch.ones(p.shape)
        elif name.endswith("embed_tokens.weight"):
            value = torch.randn(p.shape, generator=g)
        elif p.dim() >= 2 and "conv1d" not in name:
            value = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
            if name.endswith(OUTPUT_PROJ):
                value /= math.sqrt(depth)
            if name == "lm_head.weight":
                value *= 0.5
        else:
            continue
        p.data.copy_(value)


class FakeMXFP4(torch.nn.Module):
    """Parametrization of stacked experts [E, N, K]: the MXFP4 round trip forward, identity backward."""

    enabled = False

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return w
        return w + (mxfp4_round_trip(w) - w).detach()


def mxfp4_round_trip(w: torch.Tensor) -> torch.Tensor:
    E, N, K = w.shape
    with torch.no_grad():
        packed, scale = mxfp4.quantize(w.detach().reshape(E * N, K))
        return mxfp4.dequantize(packed, scale, w.dtype).view(E, N, K)


def set_quantized(fakes: list[FakeMXFP4], on: bool) -> None:
    for f in fakes:
        f.enabled = on


def step_batch(B: int, T: int, device) -> ForwardBatch:
    """B fresh sequences of T tokens: state slots 1..B, latent block b+1 (of T rows) for sequence b."""
    return ForwardBatch.build([T] * B, [0] * B, list(range(1, B + 1)), [[b + 1] for b in range(B)],
                              block_size=T, device=device)


def forward_logits(model: KimiForCausalLM, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Packed ids [B*T] -> logits [B*T, vocab] through the model's modules (autograd on)."""
    B, T = batch.num_seqs, batch.query_lens_cpu[0]
    cache = HybridCache.allocate(model.config.text, B + 1, B + 1, T, model.dtype, ids.device)
    hidden = model.model(ids, batch, cache)
    return model.lm_head(hidden).float()


@torch.no_grad()
def eval_loss(model: KimiForCausalLM, tokens: torch.Tensor, T: int, B: int) -> float:
    """Mean next-token loss over ``tokens`` cut into windows of T+1 (each scored on its T targets)."""
    n = (tokens.numel() - 1) // T
    total, count = 0.0, 0
    for s in range(0, n, B):
        b = min(B, n - s)
        rows = torch.stack([tokens[(s + i) * T:(s + i) * T + T + 1] for i in range(b)])
        logits = forward_logits(model, rows[:, :-1].reshape(-1), step_batch(b, T, tokens.device))
        total += F.cross_entropy(logits, rows[:, 1:].reshape(-1), reduction="sum").item()
        count += rows[:, 1:].numel()
    return total / count


def check_gradients(model: KimiForCausalLM, trainable: list[torch.nn.Parameter]) -> None:
    """Every trained tensor must be in the graph (a path cut by no_grad / inference mode / an op
    without backward would silently leave it at its initialisation). Zeros are legitimate at step
    0: the AttnRes queries start at zero, so their norms' gradients vanish until they move."""
    ids = {id(p) for p in trainable}
    dead = [n for n, p in model.named_parameters() if id(p) in ids and p.grad is None]
    if dead:
        raise RuntimeError(f"no gradient reaches {len(dead)} trained tensors: {dead[:8]}")
    logger.info("gradients reach all %d trained tensors", len(trainable))


class LoadBalancer:
    """Aux-loss-free balancing (DeepSeek-V3): after each step, raise the correction bias of the
    experts that got fewer tokens than the mean and lower it for those that got more."""

    def __init__(self, model: KimiForCausalLM, rate: float):
        self.rate, self.loads = rate, {}
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        for m in self.moes:
            route = m.route

            def counted(x, route=route, m=m):
                weights, ids = route(x)
                if torch.is_grad_enabled():
                    n = torch.bincount(ids.reshape(-1), minlength=m.cfg.num_experts)
                    self.loads[m] = self.loads.get(m, 0) + n
                return weights, ids
            m.route = counted

    @torch.no_grad()
    def update(self) -> float:
        """Apply the rule; return the worst max/mean load ratio of the step."""
        worst = 0.0
        for m, load in self.loads.items():
            load = load.float()
            m.gate.e_score_correction_bias.add_(self.rate * torch.sign(load.mean() - load))
            worst = max(worst, (load.max() / load.mean()).item())
        self.loads.clear()
        return worst


def greedy_sample(model: KimiForCausalLM, tok, prompt: str, n: int) -> str:
    """Greedy continuation, the whole sequence recomputed for every token (no cache reuse)."""
    ids = tok.encode(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor(ids))[-1].argmax()))
    return tok.decode(ids)


def write_release(model: KimiForCausalLM, config: dict, tokenizer_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*"):
        f.unlink()
    tensors = list(checkpoint_names(model))
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    save_checkpoint(out, config, tensors, mxfp4_experts=True, max_shard_bytes=total // 2 + 1)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    media = dataclasses.asdict(MediaProcessorConfig())
    media["merge_kernel_size"] = [media["merge_kernel_size"]] * 2
    media["image_mean"], media["image_std"] = list(media["image_mean"]), list(media["image_std"])
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=5.0, help="training time budget (wall clock)")
    ap.add_argument("--steps", type=int, default=None,
                    help="train exactly this many steps (schedule by step: reproducible) instead of by time")
    ap.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    ap.add_argument("--corpus", type=Path, default=ROOT / ".corpus")
    ap.add_argument("--log", type=Path, default=None, help="train log JSON (default: OUT/../train_log.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--qat-start", type=float, default=0.5, help="fraction of training after which the experts "
                    "run MXFP4 round-tripped (straight-through gradient)")
    ap.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens to score (default: all)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    t_start = time.time()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    data = np.load(args.corpus / "tokens.npz")
    train = torch.from_numpy(data["train"].astype(np.int64)).to(device)
    val = torch.from_numpy(data["val"].astype(np.int64)).to(device)
    if args.eval_tokens:
        val = val[:args.eval_tokens]
    tok = load_tokenizer(args.corpus / "tokenizer")
    config = model_config(model_token_ids(tok.num_base_tokens, "k3"))
    parsed = parse_config(config, "default model config")
    with torch.device("meta"):
        model = KimiForCausalLM(parsed)
    model.to_empty(device=device)
    init_weights(model, args.seed)
    model.cast(torch.float32)
    fakes = []
    for m in model.modules():
        if isinstance(m, MoE):
            for which in ("w1", "w2", "w3"):
                fakes.append(FakeMXFP4())
                parametrize.register_parametrization(m.experts, which, fakes[-1])
    balancer = LoadBalancer(model, rate=1e-3)
    n_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("vision."))
    n_vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith("vision."))
    n_expert = sum(p.numel() for n, p in model.named_parameters() if "experts.parametrizations" in n)
    logger.info("text parameters %.2fM (routed experts %.2fM), vision %.3fM; train %d tokens, val %d",
                n_params / 1e6, n_expert / 1e6, n_vision / 1e6, train.numel(), val.numel())

    # Not trained: the vision tower (no images in the corpus), the router bias (balancing rule) and
    # layer 0's attention AttnRes query and norm (its only source is the embedding: the mix is 1).
    frozen = ("vision.", "model.layers.0.self_attention_res_")
    trainable = [p for n, p in model.named_parameters()
                 if not n.startswith(frozen) and not n.endswith("e_score_correction_bias")]
    keep = {id(p) for p in trainable}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    B, T = args.batch, args.seq_len
    gen = torch.Generator().manual_seed(args.seed)
    batch = step_batch(B, T, device)
    budget = args.minutes * 60.0
    warmup = 0.03
    history, step, tokens_seen, skipped = [], 0, 0, 0
    random_loss = math.log(parsed.text.vocab_size)
    # the fast CUDA kernels have no backward: every op runs its torch reference (CPU does anyway)
    ops = reference_ops if device.type == "cuda" else contextlib.nullcontext
    with ops():
        with torch.no_grad():
            loss0 = eval_loss(model, val[:4 * T + 1], T, B)
        logger.info("initial held-out loss %.3f (ln vocab = %.3f)", loss0, random_loss)
        t0 = time.time()
        while True:
            elapsed = time.time() - t0
            progress = step / args.steps if args.steps else elapsed / budget
            if progress >= 1.0:
                break
            set_quantized(fakes, progress >= args.qat_start)
            lr = args.lr * min(1.0, progress / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
            for group in opt.param_groups:
                group["lr"] = lr
            starts = torch.randint(0, train.numel() - T - 1, (B,), generator=gen)
            rows = torch.stack([train[s:s + T + 1] for s in starts.tolist()])
            logits = forward_logits(model, rows[:, :-1].reshape(-1), batch)
            loss = F.cross_entropy(logits, rows[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if step == 0:
                check_gradients(model, trainable)
            gnorm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            if not torch.isfinite(gnorm):          # a bad batch must not end a one-shot run
                skipped += 1
                logger.warning("step %d: non-finite gradient norm, update skipped", step)
                opt.zero_grad(set_to_none=True)
            else:
                opt.step()
            imbalance = balancer.update()
            step += 1
            tokens_seen += B * T
            if step % 25 == 0 or step == 1:
                lv = loss.item()
                history.append({"step": step, "time_s": round(time.time() - t0, 1), "loss": round(lv, 4)})
                logger.info("step %d  %.0fs  loss %.3f  lr %.2e  |g| %.2f  load max/mean %.2f  qat %s  %.0f tok/s",
                            step, time.time() - t0, lv, lr, float(gnorm), imbalance, fakes[0].enabled,
                            tokens_seen / (time.time() - t0))
        train_s = time.time() - t0
        model.eval()
        set_quantized(fakes, False)
        loss_dense = eval_loss(model, val, T, B)
        set_quantized(fakes, True)
        loss_mxfp4 = eval_loss(model, val, T, B)
    logger.info("held-out loss: %.4f with the trained (latent) experts, %.4f with their MXFP4 round trip",
                loss_dense, loss_mxfp4)
    # Bake the MXFP4 values into the experts (so storage round-trips exactly), then bf16 like the release.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoE):
                for which in ("w1", "w2", "w3"):
                    parametrize.remove_parametrizations(m.experts, which, leave_parametrized=True)
    model.cast(torch.bfloat16)
    model.to("cpu")
    write_release(model, config, args.corpus / "tokenizer", args.out)
    # the written checkpoint as users get it (bf16 weights, MXFP4 experts), computed in fp32
    reloaded = kimik3.load_model(args.out, device=device, dtype=torch.float32)
    with ops():
        loss_ckpt = eval_loss(reloaded, val, T, B)
        sample = greedy_sample(reloaded, kimik3.load_tokenizer(args.out), "Once upon a time", 40)
    logger.info("checkpoint held-out loss %.4f; sample: %r", loss_ckpt, sample)
    log = {
        "text_parameters": n_params, "routed_expert_parameters": n_expert, "vision_parameters_untrained": n_vision,
        "vocab_size": parsed.text.vocab_size, "steps": step, "batch": B, "seq_len": T, "tokens_seen": tokens_seen,
        "train_seconds": round(train_s, 1), "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(),
        "torch": torch.__version__, "seed": args.seed, "lr": args.lr, "qat_start": args.qat_start,
        "val_tokens": int(val.numel()), "random_model_loss_ln_vocab": round(random_loss, 4),
        "initial_loss": round(loss0, 4), "val_loss_dense_experts": round(loss_dense, 4),
        "val_loss_mxfp4_experts": round(loss_mxfp4, 4), "val_loss_checkpoint_bf16": round(loss_ckpt, 4),
        "target_3_nats_below_random_met": loss_ckpt <= random_loss - 3.0, "skipped_steps": skipped,
        "checkpoint_bytes": sum(f.stat().st_size for f in args.out.iterdir()),
        "sample_once_upon_a_time": sample, "history": history, "total_seconds": round(time.time() - t_start, 1),
    }
    log_path = args.log or args.out.parent / "train_log.json"
    log_path.write_text(json.dumps(log, indent=2) + "\n")
    logger.info("%s", json.dumps({k: v for k, v in log.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
