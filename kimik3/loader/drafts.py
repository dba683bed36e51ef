"""Load speculative-decoding draft models in the layouts they are published in, checked against the target.

* Eagle3 (``load_eagle3``): a speculators checkpoint (``config.json`` with ``speculators_model_type: "eagle3"``
  and ``transformer_layer_config``) or EAGLE's own export (Llama keys at the top level, ``midlayer.*``).
* MTP (``load_mtp``): the MTP layers ``model.layers.{L + j}.*`` of a K3 checkpoint (``num_nextn_predict_layers``).
* DFlash (``load_dflash``): a speculators checkpoint with ``speculators_model_type: "dflash"`` (or "dspark" without
  its Markov and confidence heads, which are refused by name).

A draft whose config or tensors do not fit the target (hidden size, vocabulary, layer ids, a tensor's shape, a
missing or unexpected tensor) is a ``DraftError`` naming the mismatch. Tensors the draft shares with the target
(its embedding; DFlash's full-vocabulary LM head) are taken from the target when the checkpoint has none.
``DEFAULT_DRAFT``: the Eagle3 draft trained for the embedded default model (``scripts/train_default_draft.py``).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from kimik3.distributed import ParallelContext
from kimik3.loader.safetensors_files import CheckpointError, checkpoint_files, iter_slices
from kimik3.model.dflash import DFlashConfig, DFlashDraft
from kimik3.model.eagle3 import Eagle3Config, Eagle3Draft
from kimik3.model.layers import MergedWeight
from kimik3.model.kimi_k3 import keeps_fp32
from kimik3.model.mtp import MTPDraft
from kimik3.ops import mxfp4

logger = logging.getLogger(__name__)

DEFAULT_DRAFT = Path(__file__).resolve().parent.parent / "default_model" / "eagle3"


class DraftError(CheckpointError):
    """A draft checkpoint that is malformed or does not fit its target."""


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise DraftError(f"no config.json in draft directory {path}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise DraftError(f"{file}: not valid JSON ({e})") from None


def _get(d: dict, key: str, kind, where: str, default=None):
    if key not in d:
        if default is not None:
            return default
        raise DraftError(f"{where}: missing '{key}'")
    v = d[key]
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise DraftError(f"{where}: '{key}' must be {getattr(kind, '__name__', kind)}, got {v!r}")
    return v


def _layer_config(data: dict, where: str) -> dict:
    """The decoder-layer keys: speculators' ``transformer_layer_config`` or, EAGLE's export, the top level."""
    layer = data.get("transformer_layer_config", data)
    if not isinstance(layer, dict):
        raise DraftError(f"{where}: 'transformer_layer_config' must be an object")
    return layer


def _rope_theta(layer: dict, where: str) -> float:
    params = layer.get("rope_parameters") or layer.get("rope_scaling")
    if isinstance(params, dict) and params.get("rope_type", params.get("type", "default")) != "default":
        raise DraftError(f"{where}: rope scaling {params.get('rope_type', params.get('type'))!r} is not supported "
                         "(plain RoPE only)")
    theta = layer.get("rope_theta", params.get("rope_theta") if isinstance(params, dict) else None)
    return float(theta if theta is not None else 10000.0)


def _check_fits(where: str, target, hidden: int, vocab: int, aux: tuple[int, ...]) -> None:
    text = target.config.text
    if hidden != text.hidden_size:
        raise DraftError(f"{where}: the draft reads target states of width {hidden}, the target's hidden_size "
                         f"is {text.hidden_size}")
    if vocab != text.vocab_size:
        raise DraftError(f"{where}: the draft's vocab_size {vocab} differs from the target's {text.vocab_size}")
    bad = [i for i in aux if not 0 <= i <= text.num_hidden_layers]
    if not aux or bad:
        raise DraftError(f"{where}: auxiliary layer ids {list(aux)} must be non-empty and in "
                         f"[0, {text.num_hidden_layers}] (the target has {text.num_hidden_layers} layers)")


def _attention_dims(layer: dict, where: str) -> dict:
    D = _get(layer, "hidden_size", int, where)
    H = _get(layer, "num_attention_heads", int, where)
    return dict(hidden_size=D, num_attention_heads=H,
                num_key_value_heads=_get(layer, "num_key_value_heads", int, where, H),
                head_dim=layer.get("head_dim") or D // H,
                intermediate_size=_get(layer, "intermediate_size", int, where),
                rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(layer, where))


def eagle3_config(data: dict, target, where: str) -> Eagle3Config:
    layer = _layer_config(data, where)
    if layer.get("hidden_act", "silu") != "silu":
        raise DraftError(f"{where}: hidden_act {layer.get('hidden_act')!r} is not supported (silu)")
    if layer.get("num_hidden_layers", 1) != 1:
        raise DraftError(f"{where}: an Eagle3 draft has one decoder layer, config says {layer['num_hidden_layers']}")
    text = target.config.text
    L = text.num_hidden_layers
    aux = data.get("eagle_aux_hidden_state_layer_ids") or (data.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]        # vLLM's default
    dims = _attention_dims(layer, where)
    vocab = _get(layer, "vocab_size", int, where)
    target_hidden = data.get("target_hidden_size") or dims["hidden_size"]
    _check_fits(where, target, target_hidden, vocab, tuple(aux))
    return Eagle3Config(**dims, vocab_size=vocab, draft_vocab_size=int(data.get("draft_vocab_size") or vocab),
                        target_hidden_size=target_hidden, aux_layer_ids=tuple(int(i) for i in aux),
                        norm_before_residual=bool(data.get("norm_before_residual", False)))


def dflash_config(data: dict, target, where: str) -> DFlashConfig:
    layer = _layer_config(data, where)
    dims = _attention_dims(layer, where)
    vocab = _get(layer, "vocab_size", int, where)
    aux = tuple(int(i) for i in _get(data, "aux_hidden_state_layer_ids", list, where))
    target_hidden = data.get("target_hidden_size") or dims["hidden_size"]
    _check_fits(where, target, target_hidden, vocab, aux)
    if data.get("sample_from_anchor"):
        raise DraftError(f"{where}: sample_from_anchor drafts are not supported (the anchor is the target's token)")
    block = _get(data, "block_size", int, where)
    if block < 2:
        raise DraftError(f"{where}: block_size must be >= 2 (it drafts block_size - 1 tokens), got {block}")
    mask = _get(data, "mask_token_id", int, where)
    if not 0 <= mask < vocab:
        raise DraftError(f"{where}: mask_token_id {mask} outside the vocabulary [0, {vocab})")
    return DFlashConfig(**dims, num_hidden_layers=_get(layer, "num_hidden_layers", int, where), vocab_size=vocab,
                        draft_vocab_size=int(data.get("draft_vocab_size") or vocab), target_hidden_size=target_hidden,
                        aux_layer_ids=aux, block_size=block, mask_token_id=mask)


def _param(root: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter/buffer (or merged-weight rows) checkpoint name ``name`` fills in ``root``."""
    owner, _, leaf = name.rpartition(".")
    try:
        module = root.get_submodule(owner) if owner else root
    except AttributeError:
        parent, _, part = owner.rpartition(".")
        try:
            merged = [c for c in root.get_submodule(parent).children() if isinstance(c, MergedWeight) and part in c.parts]
        except AttributeError:
            return None
        return merged[0].part(part) if merged and leaf == "weight" else None
    t = getattr(module, leaf, None)
    return t if isinstance(t, torch.Tensor) else None


def _expected(root: nn.Module) -> set[str]:
    names = set()
    for prefix, module in root.named_modules():
        for leaf, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if isinstance(module, MergedWeight):
                names.update(f"{prefix.rpartition('.')[0]}.{p}.weight" for p in module.parts)
            elif hasattr(module, "load_expert") and leaf in ("w13", "w2"):
                continue                      # routed experts: one tensor per expert, checked by the module
            else:
                names.add(f"{prefix}.{leaf}" if prefix else leaf)
    return names


def _tp_slice(root: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's share of checkpoint tensor ``name`` under tensor parallelism: the slice its owning module
    names in ``tp_slices`` (dim, start, length: the draft's own modules), or in ``tp_shards`` (dim, rank, ranks: the
    target's modules, which MTP layers are made of, as the target's loader reads them), else the whole tensor."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        try:
            module = root.get_submodule(".".join(parts[:i]))
        except AttributeError:
            continue
        leaf = ".".join(parts[i:])
        rule = getattr(module, "tp_slices", {}).get(leaf)
        shard = getattr(module, "tp_shards", {}).get(leaf)
        if rule is None and shard is not None and tensor.dim() > shard[0]:
            dim, rank, ranks = shard
            rule = (dim, rank * (tensor.shape[dim] // ranks), tensor.shape[dim] // ranks)
        if rule is not None:
            dim, start, length = rule
            if tensor.dim() <= dim or tensor.shape[dim] < start + length:
                return tensor             # the shape check names the mismatch
            return tensor.narrow(dim, start, length)
    return tensor


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str, where: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise DraftError(f"{where}: tensor '{name}' has shape {tuple(tensor.shape)}, the draft expects "
                         f"{tuple(param.shape)}")
    param.data.copy_(tensor)


def _load_tensors(root: nn.Module, tensors: dict[str, torch.Tensor], where: str, shared: dict[str, torch.Tensor]) -> None:
    """Fill ``root`` from checkpoint-named ``tensors``; names in ``shared`` missing from the checkpoint are
    copied from the target. Unexpected, mis-shaped and missing tensors are errors."""
    expected = _expected(root)
    for name, t in tensors.items():
        param = _param(root, name)
        if param is None:
            raise DraftError(f"{where}: unexpected tensor '{name}': the draft has no such parameter")
        _copy(param, _tp_slice(root, name, t), name, where)
    for name, t in shared.items():
        if name not in tensors:
            _copy(_param(root, name), t, name, where + " (shared from the target)")
    missing = sorted(expected - set(tensors) - set(shared))
    if missing:
        raise DraftError(f"{where}: missing tensor(s) {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))


def _read_all(path: Path, rename=lambda n: n) -> dict[str, torch.Tensor]:
    out = {}
    for file in checkpoint_files(path):
        for raw, read in iter_slices(file):
            name = rename(raw)
            if name is not None:
                out[name] = read(None)
    return out


def _eagle3_name(name: str) -> str:
    name = name[len("model."):] if name.startswith("model.") else name
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _check_vocab_map(model, where: str) -> None:
    d2t = model.d2t
    target = torch.arange(d2t.numel(), device=d2t.device) + d2t
    if d2t.numel() and (target.min() < 0 or target.max() >= model.cfg.vocab_size):
        raise DraftError(f"{where}: d2t maps draft ids outside the target vocabulary [0, {model.cfg.vocab_size})")


def _parallel(target) -> ParallelContext | None:
    """The target's tensor-parallel context (the draft is split over the same ranks), or None."""
    par = getattr(target, "parallel", None)
    if par is not None and par.enabled and getattr(target, "pipeline", None) is not None and target.pipeline.enabled:
        raise DraftError("draft models are not supported with pipeline parallelism (the draft reads states of "
                         "layers on other stages)")
    return par if par is not None and par.enabled else None


def _build(where: str, make, target):
    """The draft module ``make(parallel)`` on the meta device, split over the target's tensor-parallel ranks; a size
    that the ranks do not divide is a ``DraftError`` naming it and the fix."""
    par = _parallel(target)
    try:
        with torch.device("meta"):
            return make(par)
    except ValueError as e:
        if par is None:
            raise DraftError(f"{where}: {e}") from None
        raise DraftError(f"{where}: {e}; under tensor parallelism the draft is split over the target's "
                         f"{par.tp_size} ranks: use a tensor_parallel_size that divides it (1 runs it whole)") from None


def _share_embedding(model: nn.Module, target, tensors: dict) -> dict[str, torch.Tensor]:
    """A draft without its own embedding reads the target's: the target's module itself (vocabulary-parallel
    under tensor parallelism, where this rank holds a share of the rows). The loader's ``shared`` entry for it."""
    if "embed_tokens.weight" in tensors:
        return {}
    model.embed_tokens = target.model.embed_tokens
    return {"embed_tokens.weight": target.model.embed_tokens.weight.data}


def load_eagle3(path: str | Path, target, device=None, dtype: torch.dtype | None = None) -> Eagle3Draft:
    path = Path(path)
    where = f"Eagle3 draft {path}"
    data = _read_config(path)
    kind = data.get("speculators_model_type", "eagle3")
    if kind != "eagle3":
        raise DraftError(f"{where}: speculators_model_type is {kind!r}, not 'eagle3' (use method {kind!r})")
    cfg = eagle3_config(data, target, where)
    model = _build(where, lambda par: Eagle3Draft(cfg, par), target)
    model.to_empty(device=device or target.device)
    tensors = _read_all(path, _eagle3_name)
    if cfg.hidden_size != target.config.text.hidden_size and "embed_tokens.weight" not in tensors:
        raise DraftError(f"{where}: no embed_tokens and the draft width {cfg.hidden_size} differs from the "
                         f"target's {target.config.text.hidden_size}: the embedding cannot be shared")
    shared = _share_embedding(model, target, tensors)
    if cfg.draft_vocab_size == cfg.vocab_size:      # full vocabulary: identity maps unless stored
        model.d2t.zero_()
        model.t2d.fill_(True)
        shared |= {"d2t": model.d2t.clone(), "t2d": model.t2d.clone()}
    _load_tensors(model, tensors, where, shared)
    _check_vocab_map(model, where)
    return model.to(dtype or target.dtype).eval()


def load_dflash(path: str | Path, target, device=None, dtype: torch.dtype | None = None) -> DFlashDraft:
    path = Path(path)
    where = f"DFlash draft {path}"
    data = _read_config(path)
    kind = data.get("speculators_model_type")
    if kind not in ("dflash", "dspark"):
        raise DraftError(f"{where}: speculators_model_type is {kind!r}, not 'dflash' or 'dspark'")
    if kind == "dspark" and (data.get("markov_rank") or data.get("enable_confidence_head")):
        raise DraftError(f"{where}: DSpark's Markov head (markov_rank {data.get('markov_rank')}) and confidence head "
                         "are not supported; only the DFlash-shaped block drafter (markov_rank 0, no confidence head)")
    cfg = dflash_config(data, target, where)
    model = _build(where, lambda par: DFlashDraft(cfg, par), target)
    model.to_empty(device=device or target.device)
    tensors = _read_all(path, lambda n: n[len("model."):] if n.startswith("model.") else n)
    tensors.pop("t2d", None)                 # the target-side mask is not needed to draft
    shared = _share_embedding(model, target, tensors)
    if cfg.draft_vocab_size == cfg.vocab_size:
        shared |= {"lm_head.weight": target.lm_head.weight.data, "d2t": torch.zeros_like(model.d2t)}
    _load_tensors(model, tensors, where, shared)
    _check_vocab_map(model, where)
    return model.to(dtype or target.dtype).eval()


_MTP_LAYER = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight(_packed|_scale)?$")


def load_mtp(path: str | Path, target, device=None, dtype: torch.dtype | None = None) -> MTPDraft:
    """The MTP layers of the checkpoint at ``path`` (normally the target's own directory)."""
    path = Path(path)
    where = f"MTP layers of {path}"
    data = _read_config(path)
    text_data = data.get("text_config", data)
    n = int(text_data.get("num_nextn_predict_layers") or 0)
    if n < 1:
        raise DraftError(f"{where}: num_nextn_predict_layers is {n}: the checkpoint has no MTP layers "
                         "(the K3 release ships none; use an Eagle3 or DFlash draft)")
    text = target.config.text
    model = _build(where, lambda par: MTPDraft(text, n, par), target)    # under TP: split as the target's layers
    model.to_empty(device=device or target.device)
    L = text.num_hidden_layers
    tensors, experts = {}, {}
    for file in checkpoint_files(path):
        for raw, read in iter_slices(file):
            m = _MTP_LAYER.match(raw)
            if not m or int(m[1]) < L:
                continue
            if int(m[1]) >= L + n:
                raise DraftError(f"{where}: tensor '{raw}' belongs to layer {m[1]}, past the {n} MTP layer(s) "
                                 f"{L}..{L + n - 1} of num_nextn_predict_layers")
            e = _EXPERT.match(m[2])
            if e:
                experts.setdefault((int(m[1]), int(e[1]), e[2]), {})[e[3] or ""] = read(None)
            else:
                tensors[f"model.layers.{m[1]}.{m[2]}"] = read(None)
    _check_mixers(model, tensors, where)
    _kda_shapes(model, tensors, where)
    _load_tensors(model, tensors, where, {})
    for (layer, expert, which), parts in experts.items():
        _load_expert(model, layer, expert, which, parts, where)
    expected = {(int(k), e, w) for k, layer in model.model.layers.items() if hasattr(layer, "block_sparse_moe")
                for e in range(text.num_experts) for w in ("w1", "w2", "w3")}
    missing = sorted(expected - set(experts))
    if missing:
        raise DraftError(f"{where}: missing routed expert tensors, e.g. layer {missing[0][0]} expert {missing[0][1]} "
                         f"{missing[0][2]}")
    return cast_mtp(model, dtype or target.dtype).eval()


def cast_mtp(model: MTPDraft, dtype: torch.dtype) -> MTPDraft:
    """The MTP layers' parameters in ``dtype``, but the fp32 tensors K3 keeps wide (text-backbone 5.1), as the
    target's."""
    wide, policy = torch.promote_types(dtype, torch.float32), model.cfg.numerics.f32_param_policy
    for name, p in model.named_parameters():
        keep = keeps_fp32(name, policy) or name.endswith("e_score_correction_bias")
        p.data = p.data.to(wide if keep else dtype)
    return model


def _load_expert(model: MTPDraft, layer: int, expert: int, which: str, parts: dict[str, torch.Tensor],
                 where: str) -> None:
    """One routed expert's matrix (dense, or an MXFP4 pair dequantized) into MTP layer ``layer``; under expert
    parallelism only where this rank holds the expert, under expert-tensor parallelism its intermediate slice (w1 /
    w3 rows, w2 columns), as the target's loader places the target's experts."""
    w = parts.get("")
    if w is None:
        if set(parts) != {"_packed", "_scale"}:
            raise DraftError(f"{where}: layer {layer} expert {expert} {which} lacks its MXFP4 packed/scale pair")
        w = mxfp4.dequantize(parts["_packed"], parts["_scale"], torch.float32)
    mtp_layer = model.model.layers[str(layer)]
    if not hasattr(mtp_layer, "block_sparse_moe"):
        raise DraftError(f"{where}: layer {layer} is dense but the checkpoint has routed experts")
    experts = mtp_layer.block_sparse_moe.experts
    if not experts.holds(expert):
        return                                   # another expert-parallel rank's
    index, count = experts.intermediate_shard
    if count > 1:
        dim = 1 if which == "w2" else 0
        n = w.shape[dim] // count
        w = w.narrow(dim, index * n, n)
    experts.load_expert(expert, which, w.to(mtp_layer.eh_proj.weight.device), f"layer {layer} expert {expert} {which}")


_KDA_ONLY = ("A_log", "dt_bias", "f_a_proj", "f_b_proj", "q_conv1d", "k_conv1d", "v_conv1d")
_MLA_ONLY = ("kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm", "q_a_proj", "q_b_proj", "q_a_layernorm")
_CONV = re.compile(r"[qkv]_conv1d\.weight$")


def _kda_shapes(model: MTPDraft, tensors: dict[str, torch.Tensor], where: str) -> None:
    """A KDA layer's tensors in the shapes the target's loader accepts too: A_log [H], [1, 1, H, 1] or longer
    (``KimiDeltaAttention.load_A_log``), the short convs [P, W] for [P, 1, W]."""
    for name in [n for n in tensors if n.endswith(".self_attn.A_log")]:
        attn = model.get_submodule(name.rpartition(".")[0])
        try:
            attn.load_A_log(tensors[name], f"{where}: {name}")
        except ValueError as e:
            raise DraftError(str(e)) from None
        tensors[name] = attn.A_log.data.clone()
    for name in [n for n in tensors if _CONV.search(n) and tensors[n].dim() == 2]:
        tensors[name] = tensors[name].unsqueeze(1)


def _check_mixers(model: MTPDraft, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Each MTP layer's token mixer in the checkpoint is the one the config makes it (KDA where
    ``linear_attn_config.kda_layers`` lists it, else MLA): a mismatch names the layer and the fix."""
    for lid, layer in model.model.layers.items():
        prefix = f"model.layers.{lid}.self_attn."
        leaves = {n[len(prefix):].split(".")[0] for n in tensors if n.startswith(prefix)}
        kda, mla = sorted(leaves.intersection(_KDA_ONLY)), sorted(leaves.intersection(_MLA_ONLY))
        n = int(lid) + 1
        if layer.is_kda and mla and not kda:
            raise DraftError(f"{where}: MTP layer {lid} is a KDA layer ({n} is in linear_attn_config.kda_layers) but "
                             f"the checkpoint holds MLA attention tensors for it ({', '.join(mla[:3])}); remove {n} "
                             "from kda_layers")
        if not layer.is_kda and kda and not mla:
            raise DraftError(f"{where}: MTP layer {lid} is an MLA layer ({n} is not in linear_attn_config.kda_layers) "
                             f"but the checkpoint holds KDA tensors for it ({', '.join(kda[:3])}); add {n} to "
                             "kda_layers")


LOADERS = {"eagle3": load_eagle3, "mtp": load_mtp, "dflash": load_dflash, "dspark": load_dflash}
METHODS = ("eagle3", "mtp", "dflash", "dspark")


def resolve_draft_path(method: str, path: str | Path) -> Path:
    """``path``, or for "default" the Eagle3 draft shipped with the embedded default model."""
    if method not in METHODS:
        raise ValueError(f"speculative method {method!r} is not one of {METHODS + ('ngram',)}")
    if str(path) == "default":
        if method != "eagle3":
            raise ValueError(f"the shipped default draft is an Eagle3 draft; use method 'eagle3', not {method!r}")
        return DEFAULT_DRAFT
    return Path(path)


def load_draft(method: str, path: str | Path, target):
    """The draft model of ``method`` at ``path`` ("default": the draft shipped for the embedded default model),
    checked against ``target`` (and split as the target is, under tensor parallelism)."""
    where = resolve_draft_path(method, path)
    draft = LOADERS[method](where, target)
    logger.info("%s draft from %s (auxiliary layers %s)", method, path, list(draft.aux_layer_ids))
    return draft
