"""Eagle3 draft model in the speculators / vLLM layout (``speculators_model_type: "eagle3"``).

The target exposes the stream at the entry of its auxiliary layers (``eagle_aux_hidden_state_layer_ids``,
``KimiModel.forward(aux_layers=...)``); ``fc`` maps their concatenation [T, n * D_target] to the draft
width D. One decoder layer then reads, for the row at position p, that feature h_p and the embedding of
token p + 1 (the token the target chose after p):

    e = RMSNorm(embed(x_{p+1}); input_layernorm)      h' = RMSNorm(h_p; hidden_norm)
    r = h' if norm_before_residual else h_p
    r = r + o_proj(attn([e | h']))                    (q/k/v read the 2D-wide concatenation; RoPE)
    r = r + mlp(RMSNorm(r; post_attention_layernorm)) (SiLU GLU)
    logits = lm_head(RMSNorm(r; norm))                 (over the draft vocabulary)

r (before the final norm) is the feature of the next chained step, in place of the target's. A draft
token d maps to the target's vocabulary as d + d2t[d]; ``t2d`` marks the target tokens the draft knows.
Checkpoint names: ``fc``, ``layers.0.*`` (``midlayer.*`` in EAGLE's own export), ``norm``, ``lm_head``,
``d2t``, ``t2d`` and optionally ``embed_tokens`` (else the target's embedding is shared).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kimik3.model.draft_attention import DraftAttention, DraftBatch
from kimik3.model.layers import RMSNorm, linear
from kimik3.ops.activation import silu_and_mul


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int                  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """Per cached token of the one layer: (2, KVH, hd)."""
        return 2, self.num_key_value_heads, self.head_dim


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(D, eps)
        self.hidden_norm = RMSNorm(D, eps)
        self.self_attn = DraftAttention(2 * D, D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                        cfg.rope_theta)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.mlp = GatedMLP(D, cfg.intermediate_size)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: DraftBatch, cache: torch.Tensor) -> torch.Tensor:
        e = self.input_layernorm(embeds)
        h = self.hidden_norm(hidden)
        r = h if self.norm_before_residual else hidden
        r = r + self.self_attn(torch.cat([e, h], dim=-1), batch, cache)
        return r + self.mlp(self.post_attention_layernorm(r))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the Llama/Qwen MLP of draft layers."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size)
        self.up_proj = linear(hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = linear(cfg.hidden_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.aux_layer_ids

    def combine(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """The target's auxiliary states [T, D_target] each -> the first step's feature [T, D]."""
        return self.fc(torch.cat(aux, dim=-1).to(self.fc.weight.dtype))

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: DraftBatch,
                cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """next_ids [T] (token p + 1 of each row), hidden [T, D] -> (draft-vocabulary logits [T, V_d] in
        fp32 or wider, the rows' features for a chained step [T, D]). Writes the rows' keys/values."""
        r = self.layers[0](self.embed_tokens(next_ids), hidden, batch, cache)
        logits = self.lm_head(self.norm(r))
        return logits.to(torch.promote_types(logits.dtype, torch.float32)), r

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's."""
        return draft_ids + self.d2t[draft_ids]
