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
residuals (ordinary pre-norm residual): an MLA block, or, where L + j is in ``linear_attn_config.kda_layers``, a
KDA block (K3's own KimiDeltaAttention) whose recurrent state lives in the draft's state pool.

The draft's cache is a ``HybridCache`` of its own (``MTPDraft.allocate_cache``): an MLA layer's latents by the
target's block tables, a KDA layer's conv window and state per state slot (the target's slot numbers: the
engine mirrors the target's state copies, resets and prefix checkpoints on it, ``model/draft_step.py``).

Under tensor parallelism (``parallel``) every rank holds its share of each MTP layer, split as the target's decoder
layers are, by the target's own modules: the MLA / KDA heads, the MoE's expert slices (or experts, under expert
parallelism) and shared-expert intermediate, the dense MLP's intermediate, and the embedding and shared head by
vocabulary (``VocabHead.argmax``: the greedy ids over all ranks); eh_proj and the norms are replicated. The draft's
MLA latents are whole on every rank (no decode-context striping: ``draft_parallel``), its KDA states hold the rank's
heads.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kimik3.config import TextConfig
from kimik3.distributed import ParallelContext
from kimik3.model.batch import ForwardBatch, HybridCache
from kimik3.model.eagle3 import VocabHead
from kimik3.model.kimi_k3 import token_mixer
from kimik3.model.layers import MLP, Embedding, GLUActivation, RMSNorm, linear
from kimik3.model.moe import build_moe


def draft_parallel(parallel: ParallelContext | None) -> ParallelContext | None:
    """The target's tensor-parallel context as the MTP layers use it: the same ranks, heads and expert placement,
    but the latent cache whole on every rank (the draft's one or two MLA layers keep no decode-context stripes)
    and the routed experts evenly placed (EPLB's redundant slots are the target's layers')."""
    if parallel is None or not parallel.enabled:
        return None
    return dataclasses.replace(parallel, dcp_size=1, dcp_group=None, eplb=False, num_redundant_experts=0)


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, parallel: ParallelContext | None = None):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = VocabHead(hidden_size, vocab_size, parallel)


class MTPLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int, parallel: ParallelContext | None = None):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_id = layer_id
        self.is_kda = cfg.is_kda_layer(layer_id)
        act = GLUActivation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        self.embed_tokens = Embedding(cfg.vocab_size, D, parallel)
        self.enorm = RMSNorm(D, eps)
        self.hnorm = RMSNorm(D, eps)
        self.eh_proj = linear(2 * D, D)
        self.input_layernorm = RMSNorm(D, eps)
        self.self_attn = token_mixer(cfg, self.is_kda, parallel)
        self.post_attention_layernorm = RMSNorm(D, eps)
        if cfg.is_moe_layer(layer_id):
            self.block_sparse_moe = build_moe(cfg, act, parallel)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, act, parallel)
        self.shared_head = SharedHead(D, cfg.vocab_size, eps, parallel)

    def _fused(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(next_ids).masked_fill((positions == 0)[:, None], 0.0)
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(e.dtype))], dim=-1))

    def write(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              batch: ForwardBatch | None, cache: HybridCache) -> None:
        """Catch-up: what ``forward`` leaves in the cache for the rows, alone: an MLA layer's latents (into cache
        rows ``slots``); a KDA layer's state advanced over the rows of ``batch`` (its output, the MoE and the
        head are not needed)."""
        x = self.input_layernorm(self._fused(next_ids, hidden, positions))
        row = cache.layer_index[self.layer_id]
        if self.is_kda:
            self.self_attn(x, batch, cache.kda_conv[row], cache.kda_state[row])
        else:
            self.self_attn.write_latent(x, slots, cache.mla_latent[row])

    def mix(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        """The token mixer over rows x (MLA over the latent cache, or KDA from and into the state slots)."""
        row = cache.layer_index[self.layer_id]
        if self.is_kda:
            return self.self_attn(x, batch, cache.kda_conv[row], cache.kda_state[row])
        return self.self_attn(x, batch, cache.mla_latent[row])

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                cache: HybridCache) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [T, V] fp32 or wider, r [T, D]); leaves the rows in ``cache`` (``MTPDraft.allocate_cache``)."""
        r = self._fused(next_ids, hidden, positions)
        r = r + self.mix(self.input_layernorm(r), batch, cache)
        x = self.post_attention_layernorm(r)
        r = r + (self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x))
        logits = self.shared_head.head(self.shared_head.norm(r))
        return logits.to(torch.promote_types(logits.dtype, torch.float32)), r


class MTPDraft(nn.Module):
    """The MTP layers of a K3 checkpoint; ``model.layers[str(L + j)]`` so module names equal the
    checkpoint's. A chain longer than the layers reuses them cyclically (step i runs layer i mod n). ``parallel``:
    the target's tensor-parallel context (module docstring; ``draft_parallel`` derives the draft's)."""

    def __init__(self, cfg: TextConfig, num_layers: int, parallel: ParallelContext | None = None):
        super().__init__()
        if num_layers < 1:
            raise ValueError("an MTP draft needs num_nextn_predict_layers >= 1")
        self.cfg = cfg
        self.first_layer = L = cfg.num_hidden_layers
        par = draft_parallel(parallel)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(L + j): MTPLayer(cfg, L + j, par) for j in range(num_layers)})

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return (self.cfg.num_hidden_layers,)           # h_final before the final norm

    def layer(self, step: int) -> MTPLayer:
        return self.model.layers[str(self.first_layer + step % self.num_layers)]

    @property
    def kda_layer_ids(self) -> list[int]:
        return [int(i) for i, layer in self.model.layers.items() if layer.is_kda]

    def allocate_cache(self, num_slots: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device=None) -> HybridCache:
        """The draft's own cache: latents [n_mla, num_blocks, block_size, D_c] and KDA conv / state pools
        [n_kda, num_slots, ...] (shapes as the target's ``HybridCache``)."""
        cfg, layers = self.cfg, self.model.layers
        kda = [int(i) for i, lay in layers.items() if lay.is_kda]
        mla = [int(i) for i, lay in layers.items() if not lay.is_kda]
        k = cfg.kda
        H = layers[str(kda[0])].self_attn.num_heads if kda else k.num_heads      # this rank's heads
        as_dtype = dict(dtype=dtype, device=device)
        conv = torch.zeros(len(kda), num_slots, 3 * H * k.head_dim, k.conv_size - 1, **as_dtype)
        state = torch.zeros(len(kda), num_slots, H, k.head_dim, k.head_dim, device=device,
                            dtype=torch.promote_types(dtype, torch.float32))
        latent = torch.zeros(len(mla), num_blocks, block_size, cfg.mla_cache_dim, **as_dtype)
        index = {lid: i for i, lid in enumerate(kda)} | {lid: i for i, lid in enumerate(mla)}
        return HybridCache(conv, state, latent, block_size, index)

    def forward(self, step: int, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch, cache: HybridCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain step ``step`` (its layer) over rows (``MTPLayer.forward``); logits of this rank's vocabulary share."""
        return self.layer(step)(next_ids, hidden, positions, batch, cache)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy tokens of logits rows of this rank's vocabulary share (every layer's head is split alike)."""
        return self.layer(0).shared_head.head.argmax(logits)
