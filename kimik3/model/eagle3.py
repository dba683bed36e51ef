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

from kimik3.distributed import ParallelContext
from kimik3.model.draft_attention import DraftAttention, DraftBatch, FusedWeight
from kimik3.model.layers import RMSNorm, linear
from kimik3.ops.activation import silu_and_mul
from kimik3.ops.linear import linear as linear_op


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
    def __init__(self, cfg: Eagle3Config, parallel: ParallelContext | None = None):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(D, eps)
        self.hidden_norm = RMSNorm(D, eps)
        self.self_attn = DraftAttention(2 * D, D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                        cfg.rope_theta, parallel=parallel)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.mlp = GatedMLP(D, cfg.intermediate_size, parallel)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: DraftBatch, cache: torch.Tensor) -> torch.Tensor:
        e = self.input_layernorm(embeds)
        h = self.hidden_norm(hidden)
        r = h if self.norm_before_residual else hidden
        r = r + self.self_attn(torch.cat([e, h], dim=-1), batch, cache)
        return r + self.mlp(self.post_attention_layernorm(r))

    def write(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              cache: torch.Tensor, max_position: int | None = None) -> None:
        """The rows' keys/values alone (they read only the rows' own inputs), written to cache rows ``slots``."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        self.self_attn.write(x, positions, slots, cache, max_position)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the Llama/Qwen MLP of draft layers. Under tensor parallelism a rank holds
    1/t of the intermediate (gate/up rows, down columns) and the partial sums are all-reduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelContext | None = None):
        super().__init__()
        self.par = par = parallel or ParallelContext()
        start, inter = par.split(intermediate_size, "the draft's intermediate_size") if par.enabled \
            else (0, intermediate_size)
        self.gate_proj = linear(hidden_size, inter)
        self.up_proj = linear(hidden_size, inter)
        self.down_proj = linear(inter, hidden_size)
        self.fused = FusedWeight()
        self.tp_slices = {} if not par.enabled else {
            "gate_proj.weight": (0, start, inter), "up_proj.weight": (0, start, inter),
            "down_proj.weight": (1, start, inter)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fused(self.gate_proj, self.up_proj)         # one GEMM for both (inference)
        gate, up = linear_op(x, w).chunk(2, dim=-1) if w is not None else (self.gate_proj(x), self.up_proj(x))
        return self.par.all_reduce(self.down_proj(silu_and_mul(gate, up)))


class Eagle3Draft(nn.Module):
    """Under tensor parallelism (``parallel``) the layer is split as ``DraftAttention`` and ``GatedMLP`` say, the LM
    head by vocabulary (``VocabHead``); fc, the norms and the vocabulary maps are replicated."""

    def __init__(self, cfg: Eagle3Config, parallel: ParallelContext | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, parallel)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = VocabHead(cfg.hidden_size, cfg.draft_vocab_size, parallel)
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

    def write(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              cache: torch.Tensor, max_position: int | None = None) -> None:
        """Catch-up: the keys/values of rows (as ``forward`` writes them) without attending or the LM head."""
        self.layers[0].write(self.embed_tokens(next_ids), hidden, positions, slots, cache, max_position)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's."""
        return draft_ids + self.d2t[draft_ids]

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's greedy tokens (the target's ids) of its logits rows (this rank's vocabulary share)."""
        return self.to_target(self.lm_head.argmax(logits))


class VocabHead(nn.Module):
    """A bias-free LM head [V, D] split by vocabulary under tensor parallelism (a rank holds rows
    [r V / t, (r + 1) V / t)); ``argmax`` finds the greedy ids over all ranks (one all-gather of each rank's best
    (logit, id); ties go to the lowest id, as torch.argmax's)."""

    def __init__(self, hidden_size: int, vocab_size: int, parallel: ParallelContext | None = None):
        super().__init__()
        self.par = par = parallel or ParallelContext()
        self.start, rows = par.split(vocab_size, "the draft's vocabulary") if par.enabled else (0, vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.register_buffer("weight_scale", None)
        self.tp_slices = {"weight": (0, self.start, rows)} if par.enabled else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_op(x, self.weight, weight_scale=self.weight_scale)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        best, ids = logits.max(-1)
        if not self.par.enabled:
            return ids
        both = self.par.all_gather_rows(torch.stack([best.to(torch.float64), (ids + self.start).to(torch.float64)])[None])
        best_all, ids_all = both[:, 0], both[:, 1]                          # [t, T]
        top = best_all.max(0).values
        first = torch.where(best_all == top, ids_all, torch.inf).min(0).values
        return first.to(torch.int64)
