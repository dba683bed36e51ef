"""A parallel (block) drafter of the DFlash kind, in the speculators layout (``speculators_model_type:
"dflash"``): one forward drafts a whole block instead of one token per forward.

Context: the target's states at its auxiliary layers (``aux_hidden_state_layer_ids``) at every position it
computes, c_p = RMSNorm(fc([h_p^(1) | ... | h_p^(n)]); hidden_norm), written as keys/values of every draft
layer (that layer's k_proj/k_norm/RoPE and v_proj; ``write_context``), in the draft's paged cache.
Block: after the target has computed positions < P and chosen token x_P, the rows at positions P .. P + B - 1
hold the embeddings of [x_P, m, m, ..., m] (m: ``mask_token_id``); each of ``num_hidden_layers`` Qwen3-style
layers (pre-norm, q/k norms, RoPE, SiLU MLP) attends over the context and, non-causally, the whole block;
logits = lm_head(RMSNorm(r; norm)) at block row j >= 1 draft x_{P + j}. So B - 1 drafts per forward.
The embedding and (for a full-vocabulary draft) the LM head are the target's (shared at load, not stored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kimik3.distributed import ParallelContext
from kimik3.model.draft_attention import DraftAttention, DraftBatch
from kimik3.model.eagle3 import GatedMLP, VocabHead
from kimik3.model.layers import RMSNorm, linear


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    block_size: int                  # rows of one draft block: block_size - 1 drafts
    mask_token_id: int

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        return 2, self.num_key_value_heads, self.head_dim


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, parallel: ParallelContext | None = None):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps)
        self.self_attn = DraftAttention(D, D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                        cfg.rope_theta, qk_norm_eps=eps, parallel=parallel)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.mlp = GatedMLP(D, cfg.intermediate_size, parallel)

    def forward(self, x: torch.Tensor, batch: DraftBatch, cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """Under tensor parallelism the layers and the LM head are split as Eagle3's are (``eagle3.py``)."""

    def __init__(self, cfg: DFlashConfig, parallel: ParallelContext | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, parallel) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = VocabHead(cfg.hidden_size, cfg.draft_vocab_size, parallel)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.aux_layer_ids

    def write_context(self, aux: list[torch.Tensor], positions: torch.Tensor, slot_mapping: torch.Tensor,
                      caches: torch.Tensor, max_position: int | None = None) -> None:
        """The target's states at rows (``positions``) -> every layer's cached keys/values at ``slot_mapping``;
        caches [num_layers, num_blocks, bs, 2, KVH, hd]. ``max_position``: a host bound of ``positions`` (else read
        from the device)."""
        c = self.hidden_norm(self.fc(torch.cat(aux, dim=-1).to(self.fc.weight.dtype)))
        for i, layer in enumerate(self.layers):
            layer.self_attn.write(c, positions, slot_mapping, caches[i], max_position)

    def forward(self, anchor_ids: torch.Tensor, batch: DraftBatch, caches: torch.Tensor) -> torch.Tensor:
        """anchor_ids [N] (each sequence's x_P), ``batch``: B rows per sequence at P .. P + B - 1, non-causal,
        not written -> draft-vocabulary logits [N, B - 1, V_d] of rows 1 .. B - 1 (fp32 or wider)."""
        N, B = anchor_ids.shape[0], self.cfg.block_size
        ids = torch.full((N, B), self.cfg.mask_token_id, dtype=torch.int64, device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        x = self.embed_tokens(ids.view(-1))
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, caches[i])
        logits = self.lm_head(self.norm(x.view(N, B, -1)[:, 1:]))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy tokens (the target's ids) of logits rows of this rank's vocabulary share."""
        return self.to_target(self.lm_head.argmax(logits))
