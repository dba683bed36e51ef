"""An independent float64 implementation of the Kimi text model, written straight from the spec
(text-backbone §2-§4, token-mixers §2/§4) and reading the raw checkpoint files itself.

It shares no code with kimik3: its own safetensors reading, MXFP4 decoding, layer schedule and
math (token-by-token loops). Tests compare kimik3's logits against it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

F64 = torch.float64
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def read_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    raw = json.loads((path / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    # decode MXFP4 pairs element by element from the format's definition
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        base = name[: -len(".weight_packed")]
        packed, scale = tensors.pop(name), tensors.pop(base + ".weight_scale")
        rows, half = packed.shape
        out = torch.empty(rows, 2 * half, dtype=F64)
        lut = torch.tensor([v if c < 8 else -v for c in range(16) for v in [E2M1[c % 8]]], dtype=F64)
        lo, hi = (packed & 15).long(), (packed >> 4).long()
        out[:, 0::2], out[:, 1::2] = lut[lo], lut[hi]
        expo = scale.to(F64) - 127
        out *= torch.pow(2.0, expo).repeat_interleave(32, dim=1)
        tensors[base + ".weight"] = out
    text = raw["text_config"] if raw["model_type"] == "kimi_k3" else raw
    prefix = "language_model." if raw["model_type"] == "kimi_k3" else ""
    w = {k[len(prefix):]: v.to(F64) for k, v in tensors.items() if k.startswith(prefix)}
    return text, w


def rmsnorm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def situ(g, u, beta, lin):
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (u if lin is None else lin * torch.tanh(u / lin))


class Reference:
    def __init__(self, path: Path, mla_latent_eps: float = 1e-6):
        self.c, self.w = read_checkpoint(Path(path))
        self.mla_eps = mla_latent_eps

    def act(self, g, u):
        c = self.c
        if c["hidden_act"] == "situ":
            return situ(g, u, c.get("activation_situ_beta") or 1.0, c.get("activation_situ_linear_beta"))
        return g * torch.sigmoid(g) * u

    def mlp(self, p, x):
        w = self.w
        return self.act(x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T) @ w[p + "down_proj.weight"].T

    # ---- KDA: token-by-token recurrence, key-major state ------------------------------------
    def kda(self, p, x):
        c, w = self.c, self.w
        la = c["linear_attn_config"]
        H, K, W = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
        T = x.shape[0]
        streams = []
        for s in "qkv":
            raw = x @ w[p + f"{s}_proj.weight"].T                       # [T, P]
            cw = w[p + f"{s}_conv1d.weight"].reshape(H * K, W)
            padded = torch.cat([torch.zeros(W - 1, H * K, dtype=F64), raw])
            conv = torch.stack([(padded[t:t + W].T * cw).sum(-1) for t in range(T)])
            streams.append(conv * torch.sigmoid(conv))
        q, k, v = (s.view(T, H, K) for s in streams)
        f = ((x @ w[p + "f_a_proj.weight"].T) @ w[p + "f_b_proj.weight"].T).view(T, H, K)
        beta = torch.sigmoid(x @ w[p + "b_proj.weight"].T)
        gate = (x @ w[p + "g_proj.weight"].T if p + "g_proj.weight" in w
                else (x @ w[p + "g_a_proj.weight"].T) @ w[p + "g_b_proj.weight"].T).view(T, H, K)
        A = w[p + "A_log"].reshape(-1)[:H]
        dt = w[p + "dt_bias"].view(H, K)
        lb = la.get("gate_lower_bound")
        out = torch.zeros(T, H, K, dtype=F64)
        for h in range(H):
            S = torch.zeros(K, K, dtype=F64)
            for t in range(T):
                qh = q[t, h] / torch.sqrt((q[t, h] ** 2).sum() + 1e-6) / math.sqrt(K)
                kh = k[t, h] / torch.sqrt((k[t, h] ** 2).sum() + 1e-6)
                z = f[t, h] + dt[h]
                if lb is not None:                   # K3: bounded gate
                    g = lb * torch.sigmoid(math.exp(A[h]) * z)
                else:                                # Kimi-Linear: softplus gate
                    g = -math.exp(A[h]) * torch.where(z > 20, z, torch.log1p(torch.exp(z)))
                S = torch.diag(torch.exp(g)) @ S
                delta = beta[t, h] * (v[t, h] - S.T @ kh)
                S = S + torch.outer(kh, delta)
                o = S.T @ qh
                y = o / torch.sqrt((o ** 2).mean() + c["rms_norm_eps"]) * w[p + "o_norm.weight"]
                out[t, h] = y * torch.sigmoid(gate[t, h])
        return out.reshape(T, H * K) @ w[p + "o_proj.weight"].T

    # ---- MLA: per-head keys/values expanded, explicit causal softmax --------------------------
    def mla(self, p, x):
        c, w = self.c, self.w
        H, dn, dr, dv, r = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                            c["v_head_dim"], c["kv_lora_rank"])
        T = x.shape[0]
        if c.get("q_lora_rank"):
            q = rmsnorm(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], self.mla_eps)
            q = q @ w[p + "q_b_proj.weight"].T
        else:
            q = x @ w[p + "q_proj.weight"].T
        q = q.view(T, H, dn + dr)
        ckv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
        lat = rmsnorm(ckv[:, :r], w[p + "kv_a_layernorm.weight"], self.mla_eps)
        kpe = ckv[:, r:]
        kv = (lat @ w[p + "kv_b_proj.weight"].T).view(T, H, dn + dv)
        out = torch.zeros(T, H, dv, dtype=F64)
        for h in range(H):
            keys = torch.cat([kv[:, h, :dn], kpe], dim=-1)
            for t in range(T):
                s = (keys[: t + 1] @ q[t, h]) / math.sqrt(dn + dr)
                out[t, h] = torch.softmax(s, 0) @ kv[: t + 1, h, dn:]
        o = out.reshape(T, H * dv)
        if p + "g_proj.weight" in w:
            o = o * torch.sigmoid(x @ w[p + "g_proj.weight"].T)
        return o @ w[p + "o_proj.weight"].T

    # ---- MoE: per token ------------------------------------------------------------------------
    def moe(self, p, x):
        c, w = self.c, self.w
        E, k = c["num_experts"], c["num_experts_per_token"]
        logits = x @ w[p + "gate.weight"].T
        scores = torch.sigmoid(logits) if c["moe_router_activation_func"] == "sigmoid" else torch.softmax(logits, -1)
        latent = p + "routed_expert_down_proj.weight" in w
        z = x @ w[p + "routed_expert_down_proj.weight"].T if latent else x
        out = torch.zeros_like(z)
        for t in range(x.shape[0]):
            sel = scores[t] + w[p + "gate.e_score_correction_bias"]
            G = c.get("num_expert_group", 1)
            if G > 1 and G > c.get("topk_group", 1):
                grp = sel.view(G, -1).topk(2, -1).values.sum(-1)
                keep = set(grp.topk(c["topk_group"]).indices.tolist())
                sel = torch.tensor([sel[e] if e // (E // G) in keep else -math.inf for e in range(E)], dtype=F64)
            ids = sel.topk(k).indices.tolist()
            wts = scores[t, ids]
            if c["moe_renormalize"]:
                wts = wts / (wts.sum() + 1e-20)
            wts = wts * c["routed_scaling_factor"]
            for e, a in zip(ids, wts):
                q = p + f"experts.{e}."
                h = self.act(z[t] @ w[q + "w1.weight"].T, z[t] @ w[q + "w3.weight"].T)
                out[t] += a * (h @ w[q + "w2.weight"].T)
        if p + "routed_expert_norm.weight" in w:
            out = rmsnorm(out, w[p + "routed_expert_norm.weight"], c["rms_norm_eps"])
        y = out @ w[p + "routed_expert_up_proj.weight"].T if latent else out
        if c.get("num_shared_experts"):
            y = y + self.mlp(p + "shared_experts.", x)
        return y

    def attn_res(self, sources, gamma, proj):
        eps = self.c["rms_norm_eps"]
        scores = torch.stack([(rmsnorm(s, gamma, eps) * proj.reshape(-1)).sum(-1) for s in sources])
        alpha = torch.softmax(scores, 0)
        return sum(alpha[i].unsqueeze(-1) * s for i, s in enumerate(sources))

    def logits(self, ids: list[int], embeds: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """``embeds``: position -> input row that replaces the token's embedding (an image row)."""
        c, w = self.c, self.w
        eps = c["rms_norm_eps"]
        kda_layers = set(c["linear_attn_config"]["kda_layers"])
        h0 = w["model.embed_tokens.weight"][torch.tensor(ids)]
        for pos, row in (embeds or {}).items():
            h0[pos] = row.to(F64)
        B = c.get("attn_res_block_size")
        blocks, partial, resid = [], h0, h0
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            mixer = self.kda if (i + 1) in kda_layers else self.mla
            moe = c.get("num_experts") is not None and i >= c["first_k_dense_replace"]
            mlp = (lambda x: self.moe(p + "block_sparse_moe.", x)) if moe else (lambda x: self.mlp(p + "mlp.", x))
            if B is None:
                resid = resid + mixer(p + "self_attn.", rmsnorm(resid, w[p + "input_layernorm.weight"], eps))
                resid = resid + mlp(rmsnorm(resid, w[p + "post_attention_layernorm.weight"], eps))
                continue
            if i % B == 0:
                blocks.append(partial)
                srcs = list(blocks)
            else:
                srcs = blocks + [partial]
            mix = self.attn_res(srcs, w[p + "self_attention_res_norm.weight"], w[p + "self_attention_res_proj.weight"])
            a = mixer(p + "self_attn.", rmsnorm(mix, w[p + "input_layernorm.weight"], eps))
            partial = a if i % B == 0 else partial + a
            mix = self.attn_res(blocks + [partial], w[p + "mlp_res_norm.weight"], w[p + "mlp_res_proj.weight"])
            partial = partial + mlp(rmsnorm(mix, w[p + "post_attention_layernorm.weight"], eps))
        if B is None:
            final = resid
        else:
            final = self.attn_res(blocks + [partial], w["model.output_attn_res_norm.weight"],
                                  w["model.output_attn_res_proj.weight"])
        return rmsnorm(final, w["model.norm.weight"], eps) @ w["lm_head.weight"].T
