"""The floors of ``benchmarks/gpu/bench_spec_slice.py`` against hand counts from the shapes: an Eagle3 draft step's
bytes and FLOPs, and what a verify step of L rows a sequence adds to a decode step's bytes (``bench_slice.counts``).
(The bench's ``--cpu`` run covers the path; these check the arithmetic.)"""

from __future__ import annotations

import torch

from benchmarks.gpu.bench_slice import counts
from benchmarks.gpu.bench_spec_slice import CATCH_UP, eagle3_counts
from kimik3.config import parse_config
from kimik3.model.eagle3 import Eagle3Config, Eagle3Draft
from kimik3.model.kimi_k3 import KimiForCausalLM
from kimik3.testing import tiny_kimi_linear_config


def test_eagle3_floor_is_the_hand_count():
    D, H, KVH, hd, I, V, Vd, Dt = 32, 4, 2, 8, 40, 96, 64, 24
    draft = Eagle3Draft(Eagle3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=KVH, head_dim=hd,
                                     intermediate_size=I, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=V,
                                     draft_vocab_size=Vd, target_hidden_size=Dt, aux_layer_ids=(1, 2, 3)))
    N, k, head = 3, 4, 50
    R = N * CATCH_UP
    fc, kv = 3 * Dt * D, 2 * (2 * D) * (KVH * hd)                      # fc; k and v read [e | h], 2D wide
    layer = (2 * D) * (H * hd) + kv + (H * hd) * D + 3 * D * I + 3 * D   # q, k, v, o, gate/up/down, three norms
    per_position = layer + D + Vd * D                                    # the final norm and the draft LM head
    keys = sum(N * (head + j) for j in range(1, k + 1))                  # draft j's row attends to head + j keys
    kv_row = 2 * KVH * hd * 4                                            # float32
    want_bytes = 4 * (fc + kv + 2 * D) + R * 3 * Dt * 4 + R * kv_row + k * 4 * per_position + keys * kv_row
    want_flops = 2 * R * (fc + kv) + 2 * k * N * (layer + Vd * D) + 4 * keys * H * hd
    assert eagle3_counts(draft, N, k, head) == (want_bytes, want_flops)


def test_verify_rows_add_their_activations_state_writes_and_new_keys():
    """L rows a sequence: the weights and the cache once, each row's activations and KDA state write, L - 1 more
    latent rows; FLOPs L times the decode step's but attention over L more keys."""
    model = KimiForCausalLM(parse_config(tiny_kimi_linear_config(), "tiny"))
    cfg = model.config.text
    N, L, ctx = 3, 5, 40
    one, flops_one = counts(model, N, 0, "decode", 4.0, ctx)
    many, flops_many = counts(model, N, 0, "decode", 4.0, ctx, rows=L)
    H, K = cfg.kda.num_heads, cfg.kda.head_dim
    state = H * K * K * 4 + 3 * H * K * (cfg.kda.conv_size - 1) * 2
    kda, mla = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)
    assert many - one == ((L - 1) * N * cfg.hidden_size * 2 + (L - 1) * N * kda * state
                          + (L - 1) * N * cfg.mla_cache_dim * 2 * mla)
    attn = mla * cfg.num_attention_heads * 2 * (cfg.mla_cache_dim + cfg.kv_lora_rank)
    assert flops_many - L * flops_one == N * L * attn * (L - 1)
    assert torch.get_default_dtype() == torch.float32
