"""The Kimi text model (K3 and Kimi-Linear): decoder layers, final norm, LM head.

Module names equal the checkpoint's tensor names (after the ``language_model.`` prefix of the
multimodal K3 layout), except the routed experts, which are stacked (see ``moe.Experts``).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from kimik3.config import ModelConfig, TextConfig
from kimik3.distributed import ParallelContext, PipelineContext
from kimik3.model.attn_res import ResidualStream
from kimik3.model.batch import ForwardBatch, HybridCache
from kimik3.model.kda import KimiDeltaAttention
from kimik3.model.layers import MLP, Embedding, GLUActivation, MergedWeight, RMSNorm, linear
from kimik3.model.mla import MLAAttention
from kimik3.model.eplb import identity_slots, imbalance, plan_slots
from kimik3.model.moe import MoE, build_moe
from kimik3.model.vision import KimiVisionModel
from kimik3.ops.linear import linear as ops_linear
from kimik3.ops.norm import rms_norm

# Parameters kept in fp32 (or wider) whatever the model dtype (spec D4, text-backbone 5.1).
_ALWAYS_FP32 = re.compile(r"\.(A_log|dt_bias)$")
_CHECKPOINT_FP32 = re.compile(r"\.(conv1d\.weight|o_norm\.weight|gate\.e_score_correction_bias)$")


def keeps_fp32(name: str, policy: str) -> bool:
    """Whether parameter ``name`` stays fp32 (or wider) in a narrower model dtype (``f32_param_policy``)."""
    return bool(_ALWAYS_FP32.search(name) or (policy == "checkpoint" and _CHECKPOINT_FP32.search(name)))
# one routed expert's matrix as the checkpoint names it: (layer, expert, w1|w2|w3); the loader reads it too
EXPERT_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_STACKED = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(w13|w2)$")


def token_mixer(cfg: TextConfig, is_kda: bool, parallel: ParallelContext) -> nn.Module:
    """A layer's token mixer: Kimi Delta Attention where ``linear_attn_config.kda_layers`` lists the layer, else
    gated NoPE MLA (the decoder layers' and the MTP layers' alike)."""
    D, eps = cfg.hidden_size, cfg.rms_norm_eps
    if is_kda:
        k = cfg.kda
        return KimiDeltaAttention(D, k.num_heads, k.head_dim, k.conv_size, k.use_full_rank_gate, k.gate_lower_bound,
                                  eps, parallel)
    return MLAAttention(D, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                        cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.mla_use_output_gate,
                        cfg.numerics.mla_latent_norm_eps, parallel)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int, act: GLUActivation, parallel: ParallelContext):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_id = layer_id
        self.is_kda = cfg.is_kda_layer(layer_id)
        self.self_attn = token_mixer(cfg, self.is_kda, parallel)
        if cfg.is_moe_layer(layer_id):
            self.block_sparse_moe = build_moe(cfg, act, parallel)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, act, parallel)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        if cfg.attn_res_block_size is not None:
            self.self_attention_res_norm = RMSNorm(D, eps)
            self.self_attention_res_proj = linear(D, 1)
            self.mlp_res_norm = RMSNorm(D, eps)
            self.mlp_res_proj = linear(D, 1)

    def forward(self, stream: ResidualStream, batch: ForwardBatch, cache: HybridCache, plans: dict) -> None:
        """``plans``: work the forward step's attention layers share (``ops.mla.mla_decode_attention``)."""
        x = stream.attn_input(self.layer_id, self)
        row = cache.layer_index[self.layer_id]
        if self.is_kda:
            a = self.self_attn(x, batch, cache.kda_conv[row], cache.kda_state[row])
        else:
            a = self.self_attn(x, batch, cache.mla_latent[row], plans, cache.latent_scale(row))
        stream.add(a)
        x = stream.mlp_input(self)
        if hasattr(self, "block_sparse_moe"):
            stream.add(*self.block_sparse_moe.forward_parts(x))     # routed and shared outputs, added by the stream
        else:
            stream.add(self.mlp(x))


class PipelineHole(nn.Module):
    """Stands for a decoder layer another pipeline stage holds (keeps the layers' indices and names)."""


class KimiModel(nn.Module):
    """Under pipeline parallelism (spec parallelism §4.3) a stage builds only what it runs: its decoder layers;
    the embedding on the first stage; the final norm and the output AttnRes mixer on the last."""

    def __init__(self, cfg: TextConfig, parallel: ParallelContext, pipeline: PipelineContext | None = None):
        super().__init__()
        self.cfg = cfg
        self.pipeline = pipe = pipeline or PipelineContext()
        act = GLUActivation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        if pipe.is_first:
            self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, act, parallel) if pipe.holds(i) else PipelineHole()
                                    for i in range(cfg.num_hidden_layers))
        if pipe.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if cfg.attn_res_block_size is not None:
                self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
                self.output_attn_res_proj = linear(cfg.hidden_size, 1)

    @property
    def anchor(self) -> torch.Tensor:
        """A parameter in the model dtype, on the model's device, that every stage holds: the embedding, or on a
        later pipeline stage its first decoder layer's input norm."""
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens.weight
        return self.layers[self.pipeline.ranges[self.pipeline.stage][0]].input_layernorm.weight

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: HybridCache,
                aux_layers: tuple[int, ...] = (), stream_in: list[torch.Tensor] | None = None
                ) -> torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """-> final-normed hidden [T, D]; with ``aux_layers`` also the stream at the entry of each
        listed layer (``ResidualStream.state``; layer id ``num_hidden_layers``: h_final before the final
        norm), in the listed order: what a draft model reads. Nothing is kept when none is asked for.
        Pipeline stage: ``stream_in`` is the previous stage's exported stream (every stage but the first), and a
        stage before the last returns its own export (``ResidualStream.export``) for the next."""
        cfg, pipe = self.cfg, self.pipeline
        if pipe.is_first:
            h = self.embed_tokens(input_ids)
            if batch.embed_rows is not None:
                h = h.index_copy(0, batch.embed_rows, batch.embeds.to(h.dtype))
            stream = ResidualStream(h, cfg.attn_res_block_size, cfg.rms_norm_eps, cfg.numerics.attn_res_fused_norm)
        elif stream_in is None:
            raise ValueError(f"pipeline stage {pipe.stage} starts from the previous stage's stream: pass stream_in "
                             f"(kimik3.parallel.pipeline.run_stage receives it)")
        else:                        # pipeline: the previous stage's stream (spec parallelism §4.3)
            stream = ResidualStream.restore(stream_in, cfg.attn_res_block_size, cfg.rms_norm_eps,
                                            cfg.numerics.attn_res_fused_norm)
        plans: dict = {}            # this forward's alone: a graph capture after a warm-up run computes its own
        taken: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            if isinstance(layer, PipelineHole):
                continue
            if aux_layers and layer.layer_id in aux_layers:
                taken[layer.layer_id] = stream.state()
            layer(stream, batch, cache, plans)
        if not pipe.is_last:
            return stream.export()
        res = () if cfg.attn_res_block_size is None else (self.output_attn_res_norm.weight,
                                                         self.output_attn_res_proj.weight)
        if not aux_layers:
            return stream.output(self.norm.weight, *res)
        final = stream.final(*res)
        taken[cfg.num_hidden_layers] = final
        return rms_norm(final, self.norm.weight, cfg.rms_norm_eps), [taken[i] for i in aux_layers]


class KimiForCausalLM(nn.Module):
    """Text model. ``model(ids)`` gives logits of one fresh sequence; ``forward_step`` runs a
    packed varlen batch against a ``HybridCache`` (the engine's entry point).

    ``parallel``: this rank's place in a tensor/expert-parallel group (spec parallelism.md); the
    module then holds only its shards, and ``compute_logits`` gathers the vocab-parallel LM head
    to TP rank 0 (None on the other ranks)."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext | None = None,
                 pipeline: PipelineContext | None = None):
        super().__init__()
        self.config = config
        self.parallel = par = parallel or ParallelContext()
        self.pipeline = pipeline or PipelineContext()
        if par.enabled:
            check_parallel_degrees(config, par)
        self.model = KimiModel(config.text, par, self.pipeline)
        _, vocab = par.split(config.text.vocab_size, "vocab size") if par.enabled else (0, config.text.vocab_size)
        self.tp_shards = {}
        if self.pipeline.is_last:           # pipeline: the LM head on the last stage only
            self.lm_head = linear(config.text.hidden_size, vocab)
            self.tp_shards = {"lm_head.weight": (0, par.tp_rank, par.tp_size)} if par.enabled else {}
        self.expert_offload = None          # an ExpertOffload when routed experts live in host memory
        if config.vision is not None and self.pipeline.is_first:
            # checkpoint names ``vision_tower.*`` / ``mm_projector.*`` live under ``vision.`` (first stage only)
            self.vision = KimiVisionModel(config.vision)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.anchor.dtype

    @property
    def device(self) -> torch.device:
        return self.model.anchor.device

    def holds_weight(self, name: str) -> bool:
        """Whether this pipeline stage holds checkpoint tensor ``name`` (text-model name, vision under ``vision.``):
        a stage holds its decoder layers, the first also the embedding and vision tower, the last the final norm,
        output AttnRes mixer and LM head (spec parallelism §4.3). Everything, without pipeline stages."""
        pipe = self.pipeline
        if not pipe.enabled:
            return True
        layer = re.match(r"^model\.layers\.(\d+)\.", name)
        if layer:
            return pipe.holds(int(layer[1]))
        if name.startswith(("model.embed_tokens.", "vision.")):
            return pipe.is_first
        if name.startswith(("lm_head.", "model.norm.", "model.output_attn_res_")):
            return pipe.is_last
        return True

    def cast(self, dtype: torch.dtype) -> KimiForCausalLM:
        """Move every parameter to ``dtype``, keeping the fp32 ones (per ``f32_param_policy``) at
        fp32 or wider."""
        policy = self.config.text.numerics.f32_param_policy
        wide = torch.promote_types(dtype, torch.float32)
        for name, p in self.named_parameters():
            p.data = p.data.to(wide if keeps_fp32(name, policy) else dtype)
        return self

    def offload_experts(self, config) -> None:
        """Keep ``config.cpu_offload_bytes`` of the routed experts in host memory (``expert_offload.py``): the
        ``Experts`` modules must already live there (the loader places them); the GPU pool is built here."""
        from kimik3.model.expert_offload import ExpertOffload
        moes = self.moe_blocks(config)
        if not moes:                # a pipeline stage without MoE layers: nothing to offload here
            return
        routed = {id(p) for m in moes for p in m.experts.parameters()}
        dense = sum(p.numel() * p.element_size() for p in self.model.layers.parameters() if id(p) not in routed)
        held = sum(not isinstance(layer, PipelineHole) for layer in self.model.layers)
        self.expert_offload = ExpertOffload(moes, config, self.device, self.dtype, dense / held)

    def moe_blocks(self, offload_config=None) -> list:
        """This rank's MoE blocks (its pipeline stage's), first to last; with ``offload_config``, checked to be
        offloadable: the budget is per rank (per GPU, as vLLM's ``--cpu-offload-gb``), taken from the experts or
        expert slices this rank holds under tensor / expert parallelism."""
        moes = [layer.block_sparse_moe for layer in self.model.layers if hasattr(layer, "block_sparse_moe")]
        if offload_config is not None and (moes or not self.pipeline.enabled):   # a stage may hold no MoE layer
            from kimik3.model.expert_offload import check_budget
            if self.parallel.eplb:
                raise ValueError("cpu_offload_gb with expert load balancing (--enable-eplb) is not supported yet: "
                                 "EPLB moves experts between ranks' GPUs, offloaded ones live in host memory; "
                                 "leave one of them off")
            check_budget(moes, offload_config)
        return moes

    def use_side_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Give every MoE layer a second CUDA stream for its small-batch overlap (None: serial)."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.side_stream = stream

    # ---- weights -------------------------------------------------------------------------
    def expected_weights(self) -> set[str]:
        """Names this model needs (text names without the multimodal prefix, vision names under
        ``vision.``), experts and merged projections one by one."""
        return {name for name, _ in self.checkpoint_weights()}

    def _checkpoint_tensor(self, name: str) -> torch.Tensor | None:
        """Where dense checkpoint tensor ``name`` goes: its parameter, or its rows of a merged
        projection's weight; None for a name the checkpoint cannot hold (no such parameter, the
        stacked experts, a merged weight's own name)."""
        owner, _, leaf = name.rpartition(".")
        try:
            module = self.get_submodule(owner)
        except AttributeError:
            module = None
        if module is None and leaf == "weight":               # "<owner>.<part>.weight" of a merged projection
            parent, _, part = owner.rpartition(".")
            try:
                merged = [c for c in self.get_submodule(parent).children() if isinstance(c, MergedWeight) and part in c.parts]
            except AttributeError:
                merged = []
            return merged[0].part(part) if merged else None
        if module is None or isinstance(module, MergedWeight) or _STACKED.match(name):
            return None
        param = getattr(module, leaf, None)
        return param if isinstance(param, nn.Parameter) else None

    def shard_table(self) -> dict[str, tuple[int, int, int]]:
        """Checkpoint (text) name -> (dim, rank, size) of every TP-split tensor: the loader reads
        only that slice. Routed experts and ``A_log`` are handled by their modules."""
        table = {}
        for prefix, module in self.named_modules():
            for pname, rule in getattr(module, "tp_shards", {}).items():
                name = f"{prefix}.{pname}" if prefix else pname
                if self._checkpoint_tensor(name) is not None:
                    table[name] = rule
        return table

    def load_weight(self, name: str, tensor: torch.Tensor, source: str = "") -> None:
        """Copy one checkpoint tensor (text-model name, dense) into its parameter."""
        where = f" (in {source})" if source else ""
        if name.startswith("vision.") and hasattr(self, "vision"):
            param = dict(self.vision.named_parameters()).get(name[len("vision."):])
            if param is None:
                raise ValueError(f"unexpected tensor '{name[len('vision.'):]}'{where}: the vision model has no such parameter")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"tensor '{name[len('vision.'):]}'{where} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(param.shape)}")
            param.data.copy_(tensor)
            return
        m = EXPERT_WEIGHT.match(name)
        if m:
            layer = self.model.layers[int(m[1])] if int(m[1]) < len(self.model.layers) else None
            if layer is None or not hasattr(layer, "block_sparse_moe"):
                raise ValueError(f"unexpected tensor '{name}'{where}: layer {m[1]} has no routed experts")
            layer.block_sparse_moe.experts.load_expert(int(m[2]), m[3], tensor, name + where)
            return
        param = self._checkpoint_tensor(name)
        if param is None:
            raise ValueError(f"unexpected tensor '{name}'{where}: the model has no such parameter")
        if name.endswith(".A_log"):
            self.model.layers[int(name.split(".")[2])].self_attn.load_A_log(tensor, name + where)
            return
        if re.search(r"[qkv]_conv1d\.weight$", name) and tensor.dim() == 2:
            tensor = tensor.unsqueeze(1)       # [P, W] is accepted for [P, 1, W]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"tensor '{name}'{where} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(param.shape)}")
        param.data.copy_(tensor)

    def checkpoint_weights(self):
        """Yield (text-model checkpoint name, tensor) pairs, experts one by one (for writers)."""
        for name, p in self.named_parameters():
            m = _STACKED.match(name)
            owner = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
            if m:           # w13: w1 and w3, the halves of one parameter
                parts = {"w1": owner.w1, "w3": owner.w3} if m[2] == "w13" else {"w2": p}
                for e in range(p.shape[0]):
                    for which, t in parts.items():
                        yield (f"model.layers.{m[1]}.block_sparse_moe.experts.{owner.slot_experts[e]}.{which}.weight",
                               t.data[e])
            elif isinstance(owner, MergedWeight):
                parent = name.rsplit(".", 2)[0]
                for part in owner.parts:
                    yield f"{parent}.{part}.weight", owner.part(part)
            else:
                yield name, p.data

    # ---- expert load balancing (EPLB, model/eplb.py) -------------------------------------------
    def moe_layers(self) -> dict[int, MoE]:
        return {i: layer.block_sparse_moe for i, layer in enumerate(self.model.layers)
                if hasattr(layer, "block_sparse_moe")}

    def place_experts(self, loads: dict[int, list[float]] | None = None) -> dict[int, list[int]]:
        """EPLB: every MoE layer's slots from its recorded load (``loads``; a layer without one: even), before
        the routed experts' weights are (re)loaded. Returns the slots' logical experts per layer."""
        par, out = self.parallel, {}
        for i, moe in self.moe_layers().items():
            load = (loads or {}).get(i)
            slots = plan_slots(load, moe.num_slots, par.ep_size) if load is not None else \
                identity_slots(self.config.text.num_experts, moe.num_slots, par.ep_size)
            moe.set_placement(slots)
            out[i] = slots
        return out

    def rebalance_experts(self) -> tuple[dict[int, tuple[float, float]], bool]:
        """EPLB, live (every rank of the group at once, between two steps): each MoE layer re-placed from the
        logical loads recorded since its last placement (summed over the TP group when the MoE runs token-sharded)
        and its experts moved (``MoE.move_experts``). Returns per layer the max/mean of the EP ranks' measured
        loads since the last placement and the max/mean those loads give under the new placement, and whether a
        layer's MXFP4 scale range changed. A layer that recorded no token keeps its placement."""
        par, report, flipped = self.parallel, {}, False
        for i, moe in self.moe_layers().items():
            load, ran = moe.expert_load.clone(), moe.slot_load.clone()
            if par.tokens_sharded:                   # each rank routed its own tokens
                par.all_reduce(load)
                par.all_reduce(ran)
            if int(load.sum()) == 0:
                continue
            slots = plan_slots(load.tolist(), moe.num_slots, par.ep_size)
            per_rank = ran.view(par.ep_size, -1).sum(dim=1).tolist()
            report[i] = (max(per_rank) * par.ep_size / sum(per_rank), imbalance(load.tolist(), slots, par.ep_size))
            flipped |= moe.move_experts(slots)
        return report, flipped

    def expert_loads(self) -> dict[int, list[int]]:
        """EPLB: tokens routed to each logical expert per MoE layer since the placement (this rank's tokens:
        all of them unless the MoE runs token-sharded)."""
        return {i: moe.expert_load.tolist() for i, moe in self.moe_layers().items() if moe.expert_load is not None}

    @torch.inference_mode()
    def forward_step(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: HybridCache,
                     aux_layers: tuple[int, ...] = (), stream: list[torch.Tensor] | None = None
                     ) -> torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [T] -> final-normed hidden states [T, D]; advances ``cache`` in place. ``aux_layers``:
        also return the hidden states a draft model reads (``KimiModel.forward``). Pipeline parallelism (the
        transfers: ``kimik3.parallel.pipeline``): a stage after the first starts from ``stream``, the previous
        stage's; a stage before the last returns its own stream (a list of tensors), not hidden states."""
        if input_ids.dim() != 1 or input_ids.shape[0] != batch.num_tokens:
            raise ValueError(f"input_ids must be 1-D with {batch.num_tokens} tokens, got shape {tuple(input_ids.shape)}")
        if aux_layers and self.pipeline.enabled:
            raise ValueError("draft models' aux layers are not supported with pipeline parallelism")
        bad = [i for i in aux_layers if not 0 <= i <= self.config.text.num_hidden_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} outside [0, {self.config.text.num_hidden_layers}] "
                             f"(the model has {self.config.text.num_hidden_layers} layers)")
        if self.expert_offload is not None:      # how this step serves its uncached experts (may prefetch)
            self.expert_offload.begin_step(batch.num_tokens)
        return self.model(input_ids, batch, cache, tuple(aux_layers), stream)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [n, D] -> logits [n, vocab] in float32 (float64 for a float64 model). Under TP
        each rank computes its vocabulary slice; the full rows exist on TP rank 0 only (None
        is returned elsewhere)."""
        if not self.pipeline.is_last:
            raise ValueError(f"pipeline stage {self.pipeline.stage} holds no LM head: the last stage computes logits")
        logits = ops_linear(hidden, self.lm_head.weight, out_dtype=torch.promote_types(self.dtype, torch.float32))
        return self.parallel.gather_columns_to_first(logits)

    @property
    def cache_text_config(self) -> TextConfig:
        """The text config that sizes this rank's cache: its local KDA heads; the MLA latent is
        replicated, so whole, or striped over the decode context parallel ranks (``mla_cache_stripes``).
        Used for both memory planning and allocation."""
        text = self.config.text
        if self.parallel.enabled:
            text = dataclasses.replace(text, kda=dataclasses.replace(text.kda, num_heads=text.kda.num_heads
                                                                    // self.parallel.tp_size),
                                       mla_cache_stripes=self.parallel.dcp_size)
        if self.pipeline.enabled:        # this stage's layers only
            text = dataclasses.replace(text, cache_layers=tuple(range(*self.pipeline.ranges[self.pipeline.stage])))
        return text

    @property
    def cache_plan_text_config(self) -> TextConfig:
        """The text config rank 0 plans every rank's cache with: ``cache_text_config``, except that under
        pipeline parallelism it holds as many KDA and MLA layers as the stages holding the most of each (the
        other ranks allocate the same slot and block counts for their own layers)."""
        text = self.cache_text_config
        if not self.pipeline.enabled:
            return text
        stages = [set(range(lo, hi)) for lo, hi in self.pipeline.ranges]
        most = {kind: max(stages, key=lambda s: len([i for i in ids if i in s]))
                for kind, ids in (("kda", text.kda_layer_ids), ("mla", text.mla_layer_ids))}
        layers = {i for i in text.kda_layer_ids if i in most["kda"]} | {i for i in text.mla_layer_ids if i in most["mla"]}
        return dataclasses.replace(text, cache_layers=tuple(sorted(layers)))

    def allocate_cache(self, num_slots: int, num_blocks: int, block_size: int,
                       latent_dtype: torch.dtype | None = None) -> HybridCache:
        """The cache of this rank: KDA state of its local heads, the whole (replicated) MLA latent, or its
        stripe under decode context parallelism (``block_size``: the engine's, positions per block); the latent
        in ``latent_dtype`` (None: the model dtype; float8_e4m3fn stores FP8 rows with scales)."""
        return HybridCache.allocate(self.cache_text_config, num_slots, num_blocks, block_size, self.dtype, self.device,
                                    latent_dtype)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor, encode=None) -> torch.Tensor:
        """pixel_values [P, 3, p, p], grid_thws [n, 3] -> image embeddings [sum_i N_i, D]; ``encode``:
        the tower's per-patch part (``KimiVisionModel.encode_images``)."""
        if not hasattr(self, "vision"):
            raise ValueError("this checkpoint has no vision tower (config.json has no vision_config)")
        return self.vision.encode_images(pixel_values.to(self.device), grid_thws, encode)

    def image_rows(self, input_ids: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        """Packed rows of the media pad tokens; their count must equal the embedding rows."""
        rows = (input_ids == self.config.media_placeholder_token_id).nonzero().view(-1)
        if rows.numel() != image_embeds.shape[0]:
            raise ValueError(f"prompt holds {rows.numel()} media pad token(s) but the images give "
                             f"{image_embeds.shape[0]} embedding rows")
        return rows

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                grid_thws: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] (one sequence, no history) -> logits [T, vocab] (float32; float64 for a
        float64 model). With images, their embeddings replace the media pad tokens' rows."""
        input_ids = _as_token_ids(input_ids, self.config.text.vocab_size).to(self.device)
        T = input_ids.shape[0]
        # slot 0 / block 0 are the reserved null entries, as in the engine
        cache = self.allocate_cache(num_slots=2, num_blocks=2, block_size=T)
        batch = ForwardBatch.build([T], [0], [1], [[1]], block_size=T, device=self.device)
        if pixel_values is not None:
            batch.embeds = self.encode_images(pixel_values, grid_thws)
            batch.embed_rows = self.image_rows(input_ids, batch.embeds)
        return self.compute_logits(self.forward_step(input_ids, batch, cache))


def layer_weight_bytes(text: TextConfig) -> list[int]:
    """Weight bytes of each decoder layer as the model builds it (one process, on the meta device): what the
    pipeline planner balances (``distributed.plan_stages``)."""
    act = GLUActivation(text.hidden_act, text.situ_beta, text.situ_linear_beta)
    out = []
    with torch.device("meta"):
        for i in range(text.num_hidden_layers):
            layer = DecoderLayer(text, i, act, ParallelContext())
            out.append(sum(p.numel() * p.element_size() for p in layer.parameters()))
    return out


def check_parallel_degrees(config: ModelConfig, par: ParallelContext) -> None:
    """Reject a TP/EP layout the model cannot be cut into, naming the constraint (spec §1.1)."""
    t, text = par.tp_size, config.text
    checks = [("KDA heads", text.kda.num_heads if text.kda_layer_ids else t),
              ("MLA heads", text.num_attention_heads if text.mla_layer_ids else t),
              ("vocab size", text.vocab_size)]
    if any(text.is_moe_layer(i) for i in range(text.num_hidden_layers)):
        checks.append(("shared experts' intermediate size", text.moe_intermediate_size * text.num_shared_experts or t))
    if not all(text.is_moe_layer(i) for i in range(text.num_hidden_layers)):
        checks.append(("dense MLP intermediate size", text.intermediate_size))
    for what, n in checks:
        if n % t:
            raise ValueError(f"tensor parallel size {t} must divide the {what} ({n}); choose a divisor of {n}")
    if text.num_experts % par.ep_size:
        raise ValueError(f"expert parallel size {par.ep_size} must divide the number of routed experts "
                         f"({text.num_experts})")
    if text.moe_intermediate_size % par.expert_tp_size:
        raise ValueError(f"the expert intermediate size ({text.moe_intermediate_size}) must be divisible by "
                         f"tensor/expert parallel = {par.expert_tp_size}; enable expert parallelism")


def _as_token_ids(input_ids, vocab_size: int) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"expected a non-empty 1-D tensor of token ids, got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"token ids must be integers, got {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]")
    return ids.long()
