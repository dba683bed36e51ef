"""The block-residual stream of attention residuals (spec text-backbone §2.3-2.4).

K3 keeps, per token, completed block vectors b_0 (the embedding), b_1, ... (sums of the
sub-layer outputs of each block of ``block_size`` layers) and a running partial sum P of the
current block. Each sub-layer reads a softmax mix of [b_0 .. b_k, P], normed by its input norm
(``attn_res_mix_norm``: one pass on CUDA).
Without attention residuals the same interface is the ordinary pre-norm residual stream, whose
adds wait for the norm that reads them (``add_rms_norm``: one pass over both; a MoE layer's routed and
shared outputs come as two parts, summed in that same pass), the last layer's in the final norm.
"""

from __future__ import annotations

import torch

from kimik3.ops.attn_res import attn_res_mix, attn_res_mix_norm
from kimik3.ops.norm import add_rms_norm, rms_norm


class ResidualStream:
    def __init__(self, embedding: torch.Tensor, block_size: int | None, eps: float, fused_norm: bool):
        self.block_size, self.eps, self.fused_norm = block_size, eps, fused_norm
        self.dtype = embedding.dtype
        self.blocks: list[torch.Tensor] = []
        self.partial: torch.Tensor | None = embedding   # b_0 is written at layer 0's boundary
        self.pending: tuple[torch.Tensor, torch.Tensor | None] | None = None   # plain stream: the last output, not yet added

    def _mixed_input(self, norm_weight, proj_weight, consumer_weight) -> torch.Tensor:
        sources = self.blocks + ([self.partial] if self.partial is not None else [])
        # vLLM (fused_norm): norm the fp32 mix, fp32 weight, one rounding; official: bf16 mix, then norm
        return attn_res_mix_norm(sources, norm_weight, proj_weight, self.eps, consumer_weight, self.fused_norm,
                                 self.dtype)

    def _normed(self, weight) -> torch.Tensor:
        """The plain stream's norm, the pending add fused into it."""
        if self.pending is None:
            return rms_norm(self.partial, weight, self.eps)
        out, part = self.pending
        self.partial, y = add_rms_norm(self.partial, out, weight, self.eps, part)
        self.pending = None
        return y

    def attn_input(self, layer_id: int, layer) -> torch.Tensor:
        if self.block_size is None:
            return self._normed(layer.input_layernorm.weight)
        if layer_id % self.block_size == 0:       # block boundary: P becomes b_k, P restarts empty
            self.blocks.append(self.partial)
            self.partial = None
        return self._mixed_input(layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight,
                                 layer.input_layernorm.weight)

    def mlp_input(self, layer) -> torch.Tensor:
        if self.block_size is None:
            return self._normed(layer.post_attention_layernorm.weight)
        return self._mixed_input(layer.mlp_res_norm.weight, layer.mlp_res_proj.weight,
                                 layer.post_attention_layernorm.weight)

    def add(self, out: torch.Tensor, part: torch.Tensor | None = None) -> None:
        """Add a sub-layer output, out + part when it comes in two parts (their sum first; rounded to the
        model dtype after each add; in the plain stream when the next norm reads it)."""
        if part is not None and self.block_size is not None:
            out, part = out + part, None
        if self.block_size is None:
            self.pending = (out, part)
        else:
            self.partial = out if self.partial is None else self.partial + out

    def state(self) -> torch.Tensor:
        """The stream at the entry of the next layer, as a draft model reads it (Eagle3's auxiliary
        states): the residual (the pending output added as the next norm will add it) or, with attention
        residuals, the running block sum P including the last sub-layer output (before any block boundary
        the next layer may open). Reads only: the stream continues unchanged."""
        if self.pending is None:
            return self.partial
        out, part = self.pending
        return self.partial + (out if part is None else out + part)

    def final(self, res_norm_weight=None, res_proj_weight=None) -> torch.Tensor:
        """h_final before the final norm (what an MTP layer reads): the residual, or the output mix."""
        if self.block_size is None:
            return self.state()
        return attn_res_mix(self.blocks + [self.partial], res_norm_weight, res_proj_weight, self.eps).to(self.dtype)

    # ---- pipeline parallelism: the stream's state crosses a stage boundary as is ------------------------
    def export(self) -> list[torch.Tensor]:
        """The state after a layer, [T, D] each (spec parallelism §4.3): AttnRes, the completed blocks b_0 ..
        and the running partial; the plain stream, the residual and its pending (not yet added) output parts,
        so the next stage adds them in its first norm exactly as one process would."""
        if self.block_size is not None:
            return self.blocks + [self.partial]
        out, part = self.pending
        return [self.partial, out] + ([part] if part is not None else [])

    @staticmethod
    def restore(state: list[torch.Tensor], block_size: int | None, eps: float, fused_norm: bool) -> ResidualStream:
        """The stream ``export`` gave, on the next stage."""
        stream = ResidualStream(state[-1] if block_size is not None else state[0], block_size, eps, fused_norm)
        if block_size is not None:
            stream.blocks = list(state[:-1])
        else:
            stream.pending = (state[1], state[2] if len(state) > 2 else None)
        return stream

    def output(self, norm_weight, res_norm_weight=None, res_proj_weight=None) -> torch.Tensor:
        """The final norm (``norm_weight``) of h_final: the residual, the last layer's pending add fused into
        the norm, or (AttnRes) the output mix over [b_0 .. b_last, P] with ``res_norm_weight`` and
        ``res_proj_weight``, rounded to the model dtype."""
        if self.block_size is None:
            return self._normed(norm_weight)
        h_final = attn_res_mix(self.blocks + [self.partial], res_norm_weight, res_proj_weight, self.eps).to(self.dtype)
        return rms_norm(h_final, norm_weight, self.eps)
