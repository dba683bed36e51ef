"""Per-GPU sizing against the spec's tables (parallelism.md §6.2-6.5)."""

import json
from pathlib import Path

import pytest

from kimik3.config import load_config, parse_config
from kimik3.sizing import compute_sizing

RELEASE = Path(__file__).resolve().parent / "data" / "kimi-k3-release.config.json"
GIB = 1 << 30


@pytest.fixture(scope="module")
def text_only():
    data = json.loads(RELEASE.read_text())
    del data["vision_config"]             # the spec's tables count the text model only
    return parse_config(data, "release (text only)")


@pytest.mark.parametrize("tp,ep,gib,fits", [(8, 1, 191.0, False), (16, 16, 100.8, True), (32, 32, 55.8, True)])
def test_weights_per_gpu_match_the_spec_table(text_only, tp, ep, gib, fits):
    s = compute_sizing(text_only, tp, ep)
    assert s.weights_per_gpu / GIB == pytest.approx(gib, abs=0.15)
    assert s.fits is fits


def test_cache_budget_and_capacity_at_tp16_ep16(text_only):
    s = compute_sizing(text_only, 16, 16)
    assert s.cache_budget / GIB == pytest.approx(22.4, abs=0.15)
    assert s.kv_bytes_per_token == 27_648 and s.state_bytes_per_seq / (1 << 20) == pytest.approx(26.8, abs=0.05)
    assert (s.sequences(32768), s.sequences(131072), s.sequences(1 << 20)) == (25, 6, 0)


def test_degrees_must_divide_heads_and_experts(text_only):
    with pytest.raises(ValueError, match="must divide the KDA heads"):
        compute_sizing(text_only, 7, 1)
    with pytest.raises(ValueError, match="must divide num_experts"):
        compute_sizing(text_only, 8, 48)


def test_rank_cache_is_planned_with_local_kda_heads(text_only):
    """Under TP a KDA state slot holds only the rank's heads (the MLA latent stays whole): the
    engine plans with the rank's sizes, so K3 at TP16 is not limited by 16x too large states."""
    import torch

    from kimik3.model.batch import HybridCache
    from kimik3.model.kimi_k3 import KimiForCausalLM
    from kimik3.distributed import ParallelContext

    with torch.device("meta"):
        model = KimiForCausalLM(text_only, ParallelContext(tp_rank=3, tp_size=16))
    local = model.cache_text_config
    assert local.kda.num_heads == 6
    dt = torch.bfloat16
    assert HybridCache.bytes_per_slot(local, dt) * 16 == HybridCache.bytes_per_slot(text_only.text, dt)
    assert HybridCache.bytes_per_block(local, 16, dt) == HybridCache.bytes_per_block(text_only.text, 16, dt)


# ---- the deployment planner: --cpu-offload-gb, --kv-cache-dtype, --quantization, decode estimate --------
# K3's routed expert, hand-computed: gate, up and down, each 3072 x 3584 MXFP4 (half a byte an element and
# one scale byte per 32): 3 x 3072 x 3584 x (1/2 + 1/32) B; 896 experts in each of 92 MoE layers.
K3_EXPERT = 3 * 3072 * 3584 * 17 // 32          # 17,547,264 B
K3_EXPERTS = 896 * 92 * K3_EXPERT               # 1,446.5 GB = 1,347.1 GiB


def test_fp8_bytes_and_latent_bytes_by_hand(text_only):
    from kimik3.sizing import fp8_bytes, latent_bytes_per_token
    assert fp8_bytes((256, 300)) == 256 * 300 + 4 * 256            # one fp32 scale per output channel (row)
    assert fp8_bytes((2, 128, 128)) == 2 * (128 * 128 + 4 * 128)
    t = text_only.text
    import torch
    assert latent_bytes_per_token(t, torch.bfloat16) == 24 * 576 * 2 == 27_648
    assert latent_bytes_per_token(t, torch.bfloat16, "fp8") == 24 * (576 + 4) == 13_920   # 0.503 of bf16
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        latent_bytes_per_token(t, torch.bfloat16, "int8")


def test_offload_moves_expert_bytes_off_the_gpu(text_only):
    s0 = compute_sizing(text_only, 8, 1)
    assert s0.weights_experts == K3_EXPERTS and s0.experts_per_gpu == K3_EXPERTS / 8
    s = compute_sizing(text_only, 8, 1, cpu_offload_gb=80)
    assert s.weights_per_gpu == s0.weights_per_gpu                       # same model, fewer bytes resident
    # each GPU holds 1/8 of each expert (2,193,408 B); 80 GiB over 92 layers is 425.7 experts a layer: 426 in
    # host memory (whole experts), and the GPU keeps a staging area of 426 expert shares for them
    assert (s.moe_layers, s.num_experts, s.expert_share) == (92, 896, K3_EXPERT / 8)
    assert s.uncached_per_layer == 426 and s.staging_bytes == 426 * K3_EXPERT / 8
    # host memory holds what the engine moves there: 426 whole expert shares a layer (80.07 GiB, not 80)
    assert s.offloaded_bytes == 92 * 426 * K3_EXPERT / 8
    resident = s0.weights_per_gpu - 92 * 426 * K3_EXPERT / 8 + 426 * K3_EXPERT / 8
    assert s.resident_per_gpu == pytest.approx(resident)
    assert s.resident_expert_fraction == pytest.approx(1 - 426 / 896)
    u_mem = 0.92 * (143771 << 20)                                        # H200 as nvidia-smi reports it
    assert s.cache_budget == pytest.approx(u_mem - resident - 6 * GIB)
    assert not s0.fits and s.fits
    h100 = compute_sizing(text_only, 8, 1, gpu="H100", cpu_offload_gb=80)
    assert h100.cache_budget == pytest.approx(0.92 * (81559 << 20) - resident - 6 * GIB)


def test_offload_under_expert_parallelism_counts_whole_local_experts(text_only):
    """EP8: each GPU holds 112 whole experts a layer (17,547,264 B each); 80 GiB over 92 layers is 53.2 of them:
    54 a layer in host memory, a staging area of 54 whole experts; TP8 x EP4 (two ranks share each expert's
    intermediate): 224 experts a layer of half an expert each, 107 of them offloaded."""
    s = compute_sizing(text_only, 8, 8, cpu_offload_gb=80)
    assert (s.local_experts, s.expert_share, s.experts_per_gpu) == (112, K3_EXPERT, K3_EXPERTS / 8)
    assert s.uncached_per_layer == 54 and s.staging_bytes == 54 * K3_EXPERT
    assert s.offloaded_bytes == 92 * 54 * K3_EXPERT
    assert s.resident_expert_fraction == pytest.approx(1 - 54 / 112)
    assert s.resident_per_gpu == pytest.approx(s.weights_per_gpu - 92 * 54 * K3_EXPERT + 54 * K3_EXPERT)
    half = compute_sizing(text_only, 8, 4, cpu_offload_gb=80)
    assert (half.local_experts, half.expert_share, half.experts_per_gpu) == (224, K3_EXPERT / 2, K3_EXPERTS / 8)
    assert half.uncached_per_layer == 107


def test_fp8_weights_and_cache_change_the_fit(text_only):
    s0 = compute_sizing(text_only, 8, 1)
    q = compute_sizing(text_only, 8, 1, quantization="fp8", kv_cache_dtype="fp8")
    assert q.weights_experts == s0.weights_experts                       # MXFP4 experts stay as stored
    # one MLA layer's q_b_proj (18432 x 1536) alone: bf16 2 B/element -> 1 B + 18432 channel scales
    assert s0.weights_sharded - q.weights_sharded > 0
    # the dense MLP of layer 0 (gate, up 33792 x 7168; down 7168 x 33792; bf16) is TP-split: it shrinks by
    # (2 - 1) B/element less one 4-byte scale per output channel
    mlp_saving = 3 * 33792 * 7168 - 4 * (2 * 33792 + 7168)
    assert s0.weights_sharded - q.weights_sharded > mlp_saving
    assert q.kv_bytes_per_token == 13_920
    # with the cache budget B, a 128K sequence costs 131072 x 13,920 B + the KDA state share
    s = compute_sizing(text_only, 8, 1, quantization="fp8", kv_cache_dtype="fp8", cpu_offload_gb=80)
    per_seq = 131072 * 13_920 + s.state_bytes_per_seq
    assert s.sequences(131072) == int(s.cache_budget // per_seq) > 0


def test_fp8_quantises_kimi_linears_bf16_experts_offloaded_or_not():
    """Kimi-Linear-48B: 26 MoE layers x 256 experts of gate, up (1024 x 2304) and down (2304 x 1024), bf16 as
    stored; ``--quantization fp8`` stores them at 1 B an element plus a float32 scale per output channel, so
    the whole model fits one 80 GB GPU; offloaded (``--cpu-offload-gb``) they are FP8 too (the pool carries
    the scales): 10 GiB is 58.2 such experts a layer, 59 offloaded."""
    kl = load_config(Path(__file__).resolve().parent / "data" / "kimi-linear-48b-a3b.config.json")
    n = 26 * 256
    bf16 = n * 3 * 1024 * 2304 * 2
    fp8 = n * (2 * (1024 * 2304 + 4 * 1024) + (2304 * 1024 + 4 * 2304))
    assert compute_sizing(kl, 1, 1).weights_experts == bf16
    q = compute_sizing(kl, 1, 1, gpu="H100", quantization="fp8")
    assert q.weights_experts == fp8 and q.fits and not compute_sizing(kl, 1, 1, gpu="H100").fits
    off = compute_sizing(kl, 1, 1, gpu="H100", quantization="fp8", cpu_offload_gb=10)
    assert off.weights_experts == fp8 and off.expert_share == fp8 / n and off.uncached_per_layer == 59


@pytest.mark.parametrize("bad,match", [(-1, "must be >= 0"), (169, "more than the 168.4 GiB"),
                                       (float("nan"), "number of GiB")])
def test_bad_offload_budgets_are_clear_errors(text_only, bad, match):
    with pytest.raises(ValueError, match=match):
        compute_sizing(text_only, 8, 1, cpu_offload_gb=bad)


def test_distinct_experts_by_hand():
    from kimik3.sizing import distinct_experts
    assert distinct_experts(4, 2, 1) == pytest.approx(2.0)             # one token: its k experts
    assert distinct_experts(4, 2, 2) == pytest.approx(3.0)             # 4 (1 - (1/2)^2)
    assert distinct_experts(896, 16, 10**6) == pytest.approx(896.0)


def test_decode_estimate_by_hand(text_only):
    """TP8, 80 GiB offloaded (426 of 896 experts a layer in host memory), batch 1: the token touches 16 experts in
    each of 92 MoE layers; each GPU holds 1/8 of each expert; a 426/896 share of them are misses, served (in a
    CUDA graph) by the cheaper of copying after routing (at min(50, 400 / 8 GPUs) GB/s) and prefetching (the
    layer's GPU time hides part of the copies, the mispredicted half is copied after routing)."""
    from kimik3.sizing import Rates, predict_decode
    s = compute_sizing(text_only, 8, 1, cpu_offload_gb=80)
    rates = Rates(pcie=50e9, host_memory=400e9, host_flops=4e12, layer_overhead=10e-6, context=4096,
                  host_sync=50e-6, prefetch_accuracy=0.5)
    d = predict_decode(text_only, s, 1, rates)
    share, per = 426 / 896, K3_EXPERT / 8
    missed = 16 * 92 * share * per
    assert d.missed_bytes == pytest.approx(missed)
    assert d.copy_seconds == pytest.approx(missed / 50e9)
    assert s.vision_bytes == 0                                          # text only
    dense = s.weights_sharded / 8 + s.weights_replicated - s.embedding_bytes / 8
    gpu = (dense + 16 * 92 * (1 - share) * per + 4096 * 27_648 + s.state_bytes_per_seq) / 4.25e12
    assert d.gpu_seconds == pytest.approx(gpu + 93 * 10e-6)
    m, c, W = 426 * 16 / 896, per / 50e9, (gpu + 93 * 10e-6) / 93          # a layer: misses, copy, GPU time
    assert d.prefetch_seconds == pytest.approx(92 * (max(0.0, m * c - W) + 0.5 * m * c))
    # host compute instead: per layer a round trip, the node reads the 8 shares of each missed expert at 400 GB/s
    # and runs the missed pairs' FLOPs at 4 TFLOP/s
    pairs = 16 * 426 / 896
    assert d.host_seconds == pytest.approx(92 * (50e-6 + m * per * 8 / 400e9 + pairs * 6 * 3584 * 3072 / 4e12))
    assert d.strategy == "copy" and d.copy_seconds < d.prefetch_seconds
    assert d.tokens_per_second == pytest.approx(1 / (gpu + 93 * 10e-6 + missed / 50e9))
    # a prefetch that predicts every miss hides a layer's GPU time of copies: the policy takes it
    sure = predict_decode(text_only, s, 1, Rates(prefetch_accuracy=1.0))
    assert sure.strategy == "prefetch" and sure.prefetch_seconds == pytest.approx(92 * (m * c - W))
    assert predict_decode(text_only, s, 1, rates, policy="prefetch").step_seconds == pytest.approx(
        d.gpu_seconds + d.prefetch_seconds)
    resident = predict_decode(text_only, compute_sizing(text_only, 8, 1), 1, rates)
    assert resident.missed_bytes == 0 and resident.copy_seconds == 0 and resident.strategy == "none"


def test_k3_on_one_node_of_eight_h200s_with_offload_fits(text_only):
    from kimik3.sizing import PlanOptions, Rates, format_sizing
    out = format_sizing(RELEASE, 8, 1, PlanOptions(8, 1, "H200", 80, "fp8", "fp8"))
    assert "fits: yes" in out and "offloaded to pinned host memory 80.1 GiB per GPU" in out
    assert "batch 32" in out and "assumed rates: PCIe 50 GB/s" in out
    assert "prefetch accuracy 50%" in out and "misses by --expert-offload-policy auto" in out
    assert "by copy" in out and "staging area 0.87 GiB (426 experts" in out
    sure = format_sizing(RELEASE, 8, 1, PlanOptions(8, 1, "H200", 80, "fp8", "fp8", Rates(prefetch_accuracy=1.0)))
    assert "by prefetch" in sure
    assert "1,123.2 GiB in all" in out and "the model's weights 1,403.6 GiB" in out      # fp8 projections
    assert "the model's weights 1,453.7 GiB" in format_sizing(RELEASE, 8, 1)
    assert "fits with --cpu-offload-gb" in format_sizing(RELEASE, 8, 1)
