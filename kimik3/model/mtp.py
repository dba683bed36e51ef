"""K3's multi-token-prediction (MTP) layers, as vLLM's ``KimiK3MTP`` reads them from the K3 checkpoint
(spec token-mixers §5, text-backbone §6.2). The release ships none (``num_nextn_predict_layers: 0``); a
checkpoint that has them holds MTP layer j under ``model.layers.{L + j}.*`` (L = num_hidden_layers,
``language_model.`` prefix in the K3 layout).

For the row at position p (the target's pre-final-norm h_final at p, the token x_{p+1} after it):

    e = RMSNorm(embed(x_{p+1}) zeroed where p = 0; enorm)      h = RMSNorm(h_p; hnorm)
    r = eh_proj([e | h])                                       (2D -> D, no bias)
    r = r + MLA(RMSNorm(r; input_layernorm))                   (K3's gated NoPE MLA, its own latent cache)
    r = r + MoE(RMSNorm(r; post_attention_layernorm))          (or the dense MLP below first_k_dense_replace)
    logits = shared_head.head(RMSNorm(r; shared_head.norm))

r is the next chained step's h. The block is K3's decoder layer at index L + j without attention
residuals (ordinary pre-norm residual); layer L + j must be an MLA layer of the schedule.
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.config import TextConfig
from kimik3.model.batch import ForwardBatch
from kimik3.model.layers import MLP, Embedding, GLUActivation, RMSNorm, linear
from kimik3.model.mla import MLAAttention
from kimik3.model.moe import build_moe


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = linear(hidden_size, vocab_size)


class MTPLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int):
        super().__init__()
        if cfg.is_kda_layer(layer_id):
            raise ValueError(f"MTP layer {layer_id} is a KDA layer in kda_layers; MTP layers are MLA blocks "
                             f"(remove {layer_id + 1} from linear_attn_config.kda_layers)")
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        act = GLUActivation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        self.embed_tokens = Embedding(cfg.vocab_size, D)
        self.enorm = RMSNorm(D, eps)
        self.hnorm = RMSNorm(D, eps)
        self.eh_proj = linear(2 * D, D)
        self.input_layernorm = RMSNorm(D, eps)
        self.self_attn = MLAAttention(D, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                                      cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                      cfg.mla_use_output_gate, cfg.numerics.mla_latent_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        if cfg.is_moe_layer(layer_id):
            self.block_sparse_moe = build_moe(cfg, act)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, act)
        self.shared_head = SharedHead(D, cfg.vocab_size, eps)

    def _fused(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(next_ids).masked_fill((positions == 0)[:, None], 0.0)
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(e.dtype))], dim=-1))

    def write(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              cache: torch.Tensor) -> None:
        """Catch-up: the rows' latents alone (what ``forward`` caches for them) into cache rows ``slots``."""
        self.self_attn.write_latent(self.input_layernorm(self._fused(next_ids, hidden, positions)), slots, cache)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [T, V] fp32 or wider, r [T, D]); writes the rows' latents to ``cache`` (this layer's
        [num_blocks, block_size, D_c])."""
        r = self._fused(next_ids, hidden, positions)
        r = r + self.self_attn(self.input_layernorm(r), batch, cache)
        x = self.post_attention_layernorm(r)
        r = r + (self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x))
        logits = self.shared_head.head(self.shared_head.norm(r))
        return logits.to(torch.promote_types(logits.dtype, torch.float32)), r


class MTPDraft(nn.Module):
    """The MTP layers of a K3 checkpoint; ``model.layers[str(L + j)]`` so module names equal the
    checkpoint's. A chain longer than the layers reuses them cyclically (step i runs layer i mod n)."""

    def __init__(self, cfg: TextConfig, num_layers: int):
        super().__init__()
        if num_layers < 1:
            raise ValueError("an MTP draft needs num_nextn_predict_layers >= 1")
        self.cfg = cfg
        self.first_layer = L = cfg.num_hidden_layers
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(L + j): MTPLayer(cfg, L + j) for j in range(num_layers)})

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return (self.cfg.num_hidden_layers,)           # h_final before the final norm

    def layer(self, step: int) -> MTPLayer:
        return self.model.layers[str(self.first_layer + step % self.num_layers)]

    def forward(self, step: int, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch, caches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain step ``step`` (its layer) over rows (``MTPLayer.forward``); ``caches`` [n, num_blocks, bs, D_c]."""
        return self.layer(step)(next_ids, hidden, positions, batch, caches[step % self.num_layers])
