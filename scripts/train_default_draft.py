"""Train the Eagle3 draft shipped beside the embedded default model (``kimik3/default_model/eagle3/``).

The draft learns from the target's own hidden states on the default model's corpus (``scripts/prepare_corpus.py``,
``--corpus``): each step runs the frozen target over windows of the training split, takes the stream at its
auxiliary layers (``AUX_LAYERS``) and its next-token distributions, and fits the draft (``kimik3.model.eagle3``)
to those distributions (soft cross-entropy over the draft vocabulary) with training-time test: ``--ttt`` chained
steps, step j feeding the draft's own features of step j - 1 with the attention a chain sees at inference (the
cached target-fed rows up to the chain's start, then the chain's own rows). The target's embedding is shared (not
stored); the LM head starts from the target's rows of the draft vocabulary (the ``--draft-vocab`` most frequent
training tokens, mapped by d2t / t2d). Output: a speculators-layout checkpoint (``config.json`` + bf16
``model.safetensors``) and ``train_log.json`` beside it.

    nice -n 10 python scripts/train_default_draft.py --threads 1 --minutes 15        # CPU, the shipped draft
    python scripts/train_default_draft.py --device cuda --minutes 10 --out /tmp/eagle3   # GPU, longer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import kimik3
from kimik3.loader import DEFAULT_MODEL
from kimik3.loader.drafts import DEFAULT_DRAFT
from kimik3.model.batch import ForwardBatch, HybridCache
from kimik3.model.draft_attention import rope
from kimik3.model.eagle3 import Eagle3Config, Eagle3Draft
from kimik3.ops.activation import silu_and_mul
from kimik3.ops.backend import reference_ops

logger = logging.getLogger("train_default_draft")
ROOT = Path(__file__).resolve().parents[1]
AUX_LAYERS = (1, 3, 5)          # entries of layers 2, 4 and 6 (1-based) of the 6-layer default model


def draft_config(target, draft_vocab: int) -> Eagle3Config:
    text = target.config.text
    return Eagle3Config(hidden_size=text.hidden_size, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        intermediate_size=768, rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=text.vocab_size,
                        draft_vocab_size=draft_vocab, target_hidden_size=text.hidden_size, aux_layer_ids=AUX_LAYERS)


def speculators_config(cfg: Eagle3Config, k: int) -> dict:
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "vocab_size": cfg.vocab_size, "hidden_act": "silu", "num_hidden_layers": 1, "torch_dtype": "bfloat16"},
        "draft_vocab_size": cfg.draft_vocab_size, "norm_before_residual": cfg.norm_before_residual,
        "target_hidden_size": cfg.target_hidden_size, "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                               "verifier": {"name_or_path": "kimik3/default_model",
                                            "architectures": ["KimiK3ForConditionalGeneration"]}},
    }


@torch.no_grad()
def target_states(target, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """windows [B, T] -> (aux states concatenated [B, T, 3D], next-token log-probs [B, T, V])."""
    B, T = windows.shape
    batch = ForwardBatch.build([T] * B, [0] * B, list(range(1, B + 1)), [[b + 1] for b in range(B)], block_size=T)
    cache = HybridCache.allocate(target.config.text, B + 1, B + 1, T, target.dtype)
    hidden, aux = target.forward_step(windows.reshape(-1), batch, cache, AUX_LAYERS)
    logp = target.compute_logits(hidden).log_softmax(-1)
    return torch.cat(aux, -1).view(B, T, -1), logp.view(B, T, -1)


def chain_forward(draft: Eagle3Draft, feats: torch.Tensor, next_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test. feats [B, T, D] (fc of the target's states at rows 0..T-1), next_ids [B, T] (token
    after each row) -> draft logits [B, T, V_d] of each of ``steps`` chained steps. Step j's row q (position q)
    reads the draft's own feature of step j - 1 at row q - 1 and attends to step 1's keys at positions
    <= q - j + 1 and to its chain's keys of steps 2..j at positions q - j + 2 .. q (the inference cache)."""
    layer = draft.layers[0]
    att = layer.self_attn
    B, T, _ = feats.shape
    H, KVH, hd = att.num_heads, att.num_kv_heads, att.head_dim
    pos = torch.arange(T, device=feats.device)
    e = layer.input_layernorm(draft.embed_tokens(next_ids))
    keys, vals, out, hidden = [], [], [], feats
    for j in range(1, steps + 1):
        h = layer.hidden_norm(hidden)
        x = torch.cat([e, h], -1)
        q = rope(att.q_proj(x).view(B * T, H, hd), pos.repeat(B), att.rope_theta).view(B, T, H, hd)
        k = rope(att.k_proj(x).view(B * T, KVH, hd), pos.repeat(B), att.rope_theta).view(B, T, KVH, hd)
        v = att.v_proj(x).view(B, T, KVH, hd)
        keys.append(k.repeat_interleave(H // KVH, 2))
        vals.append(v.repeat_interleave(H // KVH, 2))
        s1 = torch.einsum("bqhd,bkhd->bhqk", q, keys[0]) * hd ** -0.5
        s1 = s1.masked_fill(pos[None, :] > pos[:, None] - (j - 1), float("-inf"))
        diag = [(q * torch.roll(keys[i - 1], j - i, dims=1)).sum(-1).permute(0, 2, 1)[..., None] * hd ** -0.5
                for i in range(2, j + 1)]                                                      # [B, H, T, 1] each
        p = torch.cat([s1, *diag], -1).softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", p[..., :T], vals[0])
        for n, i in enumerate(range(2, j + 1)):
            o = o + p[..., T + n].permute(0, 2, 1)[..., None] * torch.roll(vals[i - 1], j - i, dims=1)
        r = (h if layer.norm_before_residual else hidden) + att.o_proj(o.reshape(B, T, H * hd))
        r = r + layer.mlp.down_proj(silu_and_mul(layer.mlp.gate_proj(layer.post_attention_layernorm(r)),
                                                 layer.mlp.up_proj(layer.post_attention_layernorm(r))))
        out.append(draft.lm_head(draft.norm(r)))
        hidden = torch.roll(r, 1, dims=1)          # row q of the next step reads row q - 1 of this one
    return out


def losses(draft: Eagle3Draft, target, windows: torch.Tensor, steps: int, decay: float = 0.8):
    """(loss, per-step top-1 agreement with the target's greedy token) of one batch of windows [B, T + 1]."""
    aux, logp = target_states(target, windows[:, :-1])
    feats = draft.combine([aux])
    outs = chain_forward(draft, feats, windows[:, 1:], steps)
    T = aux.shape[1] - 1
    p_draft_vocab = logp[:, 1:, torch.arange(draft.cfg.draft_vocab_size, device=logp.device) + draft.d2t].exp()
    want = logp[:, 1:].argmax(-1)
    total, agree = 0.0, []
    for j, logits in enumerate(outs, start=1):
        lg = logits[:, :T].float().log_softmax(-1)
        valid = torch.arange(T, device=lg.device) >= j - 1
        ce = -(p_draft_vocab * lg).sum(-1)[:, valid].mean()
        total = total + decay ** (j - 1) * ce
        got = draft.to_target(lg.argmax(-1))
        agree.append((got == want)[:, valid].float().mean().item())
    return total, agree


def generated_windows(train: torch.Tensor, n: int, prompt_len: int, length: int, seed: int) -> torch.Tensor:
    """[n, length] windows: ``prompt_len`` training tokens then the target's greedy continuation (what the draft
    meets when it drafts for greedy decoding), generated by the engine in one batch."""
    from kimik3 import LLM, SamplingParams
    g = torch.Generator().manual_seed(seed + 7)
    starts = torch.randint(0, train.numel() - prompt_len, (n,), generator=g).tolist()
    prompts = [train[s:s + prompt_len].tolist() for s in starts]
    llm = LLM(str(DEFAULT_MODEL), dtype="float32", device=str(train.device), max_model_len=length + 8,
              max_num_seqs=n, enable_prefix_caching=False, language_model_only=True)
    params = SamplingParams(temperature=0, max_tokens=length - prompt_len, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)], device=train.device)


def draft_vocabulary(train: np.ndarray, vocab: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent training tokens (ascending ids) -> (d2t offsets, t2d mask)."""
    counts = np.bincount(train, minlength=vocab)
    ids = np.sort(np.argsort(-counts, kind="stable")[:size])
    d2t = torch.from_numpy(ids - np.arange(size)).long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.from_numpy(ids)] = True
    return d2t, t2d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--minutes", type=float, default=15.0, help="training budget (wall clock)")
    ap.add_argument("--corpus", type=Path, default=ROOT / ".corpus")
    ap.add_argument("--out", type=Path, default=DEFAULT_DRAFT)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=96)
    ap.add_argument("--ttt", type=int, default=3, help="chained steps trained (training-time test)")
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--self-distill", type=int, default=0, metavar="N",
                    help="also train on N windows of the target's own greedy continuations (half of each batch)")
    ap.add_argument("--init", type=Path, default=None, help="continue from this draft checkpoint (its config)")
    ap.add_argument("--eval-windows", type=int, default=16, help="held-out windows scored at the end")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    data = np.load(args.corpus / "tokens.npz")
    train_np = data["train"].astype(np.int64)
    train, val = torch.from_numpy(train_np).to(device), torch.from_numpy(data["val"].astype(np.int64)).to(device)
    target = kimik3.load_model(DEFAULT_MODEL, device=device, dtype=torch.float32, language_model_only=True)
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = draft_config(target, args.draft_vocab)
    draft = Eagle3Draft(cfg).to(device)
    d2t, t2d = draft_vocabulary(train_np, cfg.vocab_size, cfg.draft_vocab_size)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight[torch.arange(cfg.draft_vocab_size) + d2t])
        draft.norm.weight.copy_(target.model.norm.weight)
        for name, p in draft.named_parameters():
            if p.dim() == 2 and not name.startswith(("embed_tokens", "lm_head")):
                p.normal_(0, p.shape[1] ** -0.5)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(0.5)
    if args.init is not None:                  # continue an earlier run (same widths and vocabulary map)
        from kimik3.loader.drafts import load_eagle3
        draft = load_eagle3(args.init, target, device=device, dtype=torch.float32).train()
        logger.info("continuing from %s", args.init)
    draft.embed_tokens.weight.requires_grad_(False)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    B, T = args.batch, args.seq_len
    gen = torch.Generator().manual_seed(args.seed)
    own = None
    if args.self_distill:
        t_gen = time.time()
        own = generated_windows(train, args.self_distill, 24, T + 1, args.seed)
        logger.info("generated %d greedy continuations in %.0fs", len(own), time.time() - t_gen)
    t0, step, history = time.time(), 0, []
    budget = args.minutes * 60
    ops = reference_ops() if device.type == "cuda" else contextlib.nullcontext()   # the fast kernels have no backward
    ops.__enter__()
    while (progress := (time.time() - t0) / budget) < 1.0:
        lr = args.lr * min(1.0, progress / 0.03 + 1e-3) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train.numel() - T - 2, (B,), generator=gen).tolist()
        windows = torch.stack([train[s:s + T + 1] for s in starts])
        if own is not None:                    # half the batch: the target's own continuations
            pick = torch.randint(0, len(own), (B // 2,), generator=gen).to(own.device)
            windows = torch.cat([windows[:B - B // 2], own[pick]])
        loss, agree = losses(draft, target, windows, args.ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        if step % 20 == 0 or step == 1:
            history.append({"step": step, "time_s": round(time.time() - t0, 1), "loss": round(loss.item(), 4),
                            "agree": [round(a, 3) for a in agree]})
            logger.info("step %d %.0fs loss %.3f lr %.1e top-1 agreement per chained step %s", step, time.time() - t0,
                        loss.item(), lr, [f"{a:.3f}" for a in agree])
    draft.eval()
    with torch.no_grad():
        n = (val.numel() - 1) // (T + 1)
        windows = torch.stack([val[i * (T + 1):(i + 1) * (T + 1)] for i in range(min(n, args.eval_windows))])
        agree = np.mean([losses(draft, target, windows[i:i + B], args.ttt)[1] for i in range(0, len(windows), B)], 0)
    logger.info("held-out top-1 agreement per chained step (teacher-forced): %s", np.round(agree, 3).tolist())
    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().to(torch.bfloat16 if t.is_floating_point() else t.dtype).contiguous().cpu()
               for n, t in draft.state_dict().items() if n != "embed_tokens.weight"}
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(speculators_config(cfg, 4), indent=2) + "\n")
    log = {"steps": step, "self_distill_windows": args.self_distill, "batch": B, "seq_len": T, "ttt_steps": args.ttt, "train_seconds": round(time.time() - t0, 1),
           "device": str(device), "threads": torch.get_num_threads(), "draft_vocab": cfg.draft_vocab_size,
           "aux_layers": list(AUX_LAYERS), "heldout_top1_agreement_per_step": np.round(agree, 4).tolist(),
           "bytes": sum(f.stat().st_size for f in args.out.iterdir() if f.suffix != ".json"), "history": history}
    (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    logger.info("wrote %s (%d bytes of weights)", args.out, log["bytes"])


if __name__ == "__main__":
    main()
