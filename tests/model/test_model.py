"""Whole-model tests: kimik3 vs the independent float64 reference, and the stateful
interface (prefill/decode, chunked prefill, varlen batches, state checkpoints) vs one forward."""

import pytest
import torch

from kimik3 import load_model
from kimik3.model import ForwardBatch, StateCheckpoint
from tests.helpers import rel_err
from tests.model.reference import Reference

ARCHS = ["kimi_k3", "kimi_linear"]


class Stepper:
    """Drives forward_step like an engine: one slot and a block table per sequence."""

    def __init__(self, model, num_seqs, max_len, block_size=3):
        self.model, self.bs = model, block_size
        per_seq = -(-max_len // block_size)
        self.cache = model.allocate_cache(num_slots=num_seqs + 8, num_blocks=1 + num_seqs * per_seq,
                                          block_size=block_size)
        self.tables = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(num_seqs)]
        self.done = [0] * num_seqs

    def step(self, chunks: dict[int, list[int]], checkpoints=()):
        seqs = list(chunks)
        batch = ForwardBatch.build([len(chunks[s]) for s in seqs], [self.done[s] for s in seqs],
                                   [s + 1 for s in seqs], [self.tables[s] for s in seqs], self.bs,
                                   checkpoints=checkpoints)
        ids = torch.tensor([t for s in seqs for t in chunks[s]])
        logits = self.model.compute_logits(self.model.forward_step(ids, batch, self.cache))
        for s in seqs:
            self.done[s] += len(chunks[s])
        out, start = {}, 0
        for s in seqs:
            out[s] = logits[start:start + len(chunks[s])]
            start += len(chunks[s])
        return out


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_independent_float64_reference(tiny_ckpt, arch):
    model = load_model(tiny_ckpt[arch], dtype=torch.float64)
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(0))
    ours = model(ids)
    ref = Reference(tiny_ckpt[arch]).logits(ids.tolist())
    assert rel_err(ours, ref) <= 1e-10


def test_mla_latent_norm_eps_switch_reproduces_vllm(tiny_ckpt):
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(1))
    official = load_model(tiny_ckpt["kimi_k3"], dtype=torch.float64)(ids)
    vllm = load_model(tiny_ckpt["kimi_k3"], dtype=torch.float64, mla_latent_norm_eps=1e-5)(ids)
    ref = Reference(tiny_ckpt["kimi_k3"], mla_latent_eps=1e-5).logits(ids.tolist())
    assert rel_err(vllm, ref) <= 1e-10
    assert rel_err(official, vllm) > 1e-9          # the switch really changes the numbers


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_prefill_then_decode_equals_full_forward(tiny_ckpt, arch, dtype, tol):
    model = load_model(tiny_ckpt[arch], dtype=dtype)
    ids = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(2)).tolist()
    full = model(torch.tensor(ids))
    st = Stepper(model, 1, len(ids))
    got = [st.step({0: ids[:8]})[0]]
    for t in ids[8:]:                                  # decode: recurrent KDA, absorbed MLA
        got.append(st.step({0: [t]})[0])
    assert rel_err(torch.cat(got), full) <= tol


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_at_any_split_equals_single_prefill(tiny_ckpt, arch):
    model = load_model(tiny_ckpt[arch], dtype=torch.float64)
    ids = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    full = model(torch.tensor(ids))
    for splits in ([1, 9], [4, 6], [3, 3, 4], [2, 1, 5, 2]):
        st = Stepper(model, 1, len(ids))
        got, pos = [], 0
        for n in splits:
            got.append(st.step({0: ids[pos:pos + n]})[0])
            pos += n
        assert rel_err(torch.cat(got), full) <= 1e-10, splits


@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_batch_of_mixed_prefill_and_decode_equals_each_alone(tiny_ckpt, arch):
    model = load_model(tiny_ckpt[arch], dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 12, 5)]
    alone = [model(torch.tensor(s)) for s in seqs]
    st = Stepper(model, 3, 12)
    out = st.step({0: seqs[0][:6], 1: seqs[1][:4]})            # two prefills
    got = {0: [out[0]], 1: [out[1]], 2: []}
    out = st.step({0: seqs[0][6:7], 1: seqs[1][4:9], 2: seqs[2]})   # decode + chunk + new prompt
    for s in out:
        got[s].append(out[s])
    out = st.step({1: seqs[1][9:]})
    got[1].append(out[1])
    for s in range(3):
        assert rel_err(torch.cat(got[s]), alone[s]) <= 1e-10, s


@pytest.mark.parametrize("arch", ARCHS)
def test_state_checkpoint_restores_the_prefix_state(tiny_ckpt, arch):
    """A checkpoint taken mid-chunk, copied into a fresh sequence's slot (with the MLA blocks of
    the prefix shared), continues exactly like the original sequence."""
    model = load_model(tiny_ckpt[arch], dtype=torch.float64)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    full = model(torch.tensor(ids))
    st = Stepper(model, 2, 12, block_size=3)
    st.step({0: ids[:8]}, checkpoints=(StateCheckpoint(seq=0, num_tokens=6, slot=5),
                                       StateCheckpoint(seq=0, num_tokens=3, slot=6)))
    # sequence 1 reuses sequence 0's first two blocks (6 tokens) and the checkpoint at 6
    st.tables[1][:2] = st.tables[0][:2]
    st.cache.copy_state(5, 2)
    st.done[1] = 6
    got = st.step({1: ids[6:]})[1]
    assert rel_err(got, full[6:]) <= 1e-10


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoints_in_a_short_step_with_history_restore_each_prefix(tiny_ckpt, arch):
    """A verify-like step (history, four new tokens, checkpoints after 1 (two: a prefix checkpoint
    and a speculative snapshot can share a row), 3 and all 4 of them: the one-pass recurrent path):
    each snapshot, copied into a fresh sequence's slot with the MLA blocks
    of its prefix, continues exactly like the whole sequence."""
    model = load_model(tiny_ckpt[arch], dtype=torch.float64)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    full = model(torch.tensor(ids))
    st = Stepper(model, 2, 12, block_size=3)
    st.step({0: ids[:5]})
    cks = (StateCheckpoint(seq=0, num_tokens=1, slot=5), StateCheckpoint(seq=0, num_tokens=3, slot=6),
           StateCheckpoint(seq=0, num_tokens=4, slot=7), StateCheckpoint(seq=0, num_tokens=1, slot=8))   # two at row 1
    batch = ForwardBatch.build([4], [5], [1], [st.tables[0]], 3, checkpoints=cks)
    assert batch.row_state_slots is not None
    assert rel_err(st.step({0: ids[5:9]}, checkpoints=cks)[0], full[5:9]) <= 1e-10
    for c in cks:
        done = 5 + c.num_tokens
        st.tables[1] = list(st.tables[0])          # the latents of rows past ``done`` are rewritten below
        st.cache.copy_state(c.slot, 2)
        st.done[1] = done
        assert rel_err(st.step({1: ids[done:]})[1], full[done:]) <= 1e-10, c


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoints_in_a_varlen_prefill_step_restore_each_prefix(tiny_ckpt, arch):
    """An eager step of three sequences (fresh with checkpoints mid-chunk, two at one row and one at its last
    row; one with history and a checkpoint; fresh without any): each output row equals the whole-sequence
    forward, and each snapshot, copied into a spare sequence's slot with its prefix's latents, continues
    exactly like the whole sequence (the rounds, the in-place single-sequence round and the end-of-chunk copy)."""
    model = load_model(tiny_ckpt[arch], dtype=torch.float64)
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (12, 15, 6)]
    full = [model(torch.tensor(s)) for s in seqs]
    st = Stepper(model, 4, 15, block_size=3)
    st.step({1: seqs[1][:5]})                                       # history for sequence 1
    cks = (StateCheckpoint(0, 3, 5), StateCheckpoint(0, 7, 6), StateCheckpoint(0, 7, 7), StateCheckpoint(0, 10, 8),
           StateCheckpoint(1, 4, 9), StateCheckpoint(1, 8, 10))     # seq 0: 10 new tokens; seq 1: 8
    out = st.step({0: seqs[0][:10], 1: seqs[1][5:13], 2: seqs[2]}, checkpoints=cks)
    assert rel_err(out[0], full[0][:10]) <= 1e-10 and rel_err(out[1], full[1][5:13]) <= 1e-10
    assert rel_err(out[2], full[2]) <= 1e-10
    for c in cks:
        done = c.num_tokens + (5 if c.seq == 1 else 0)
        st.tables[3] = list(st.tables[c.seq])          # the latents of rows past ``done`` are rewritten below
        st.cache.copy_state(c.slot, 4)
        st.done[3] = done
        assert rel_err(st.step({3: seqs[c.seq][done:]})[3], full[c.seq][done:]) <= 1e-10, c


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_token_mixers_are_within_the_bf16_band(tiny_ckpt, arch):
    """Each token mixer and the dense MLP in bf16 stay within ~1% of float32 on the same input
    (whole-model errors of a random tiny model are amplified by expert-choice flips)."""
    f32 = load_model(tiny_ckpt[arch], dtype=torch.float32)
    bf16 = load_model(tiny_ckpt[arch], dtype=torch.bfloat16)
    T = 16
    x = torch.randn(T, f32.config.text.hidden_size, generator=torch.Generator().manual_seed(6))
    for layer_id, (la, lb) in enumerate(zip(f32.model.layers, bf16.model.layers)):
        outs = []
        for model, layer, xin in ((f32, la, x), (bf16, lb, x.bfloat16())):
            cache = model.allocate_cache(2, 2, T)
            batch = ForwardBatch.build([T], [0], [1], [[1]], T)
            row = cache.layer_index[layer_id]
            state = (cache.kda_conv[row], cache.kda_state[row]) if layer.is_kda else (cache.mla_latent[row],)
            outs.append(layer.self_attn(xin, batch, *state).float())
        assert rel_err(outs[1], outs[0]) < 2e-2, layer_id
    assert rel_err(bf16.model.layers[0].mlp(x.bfloat16()), f32.model.layers[0].mlp(x)) < 2e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_whole_model_is_finite(tiny_ckpt, arch):
    ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(6))
    logits = load_model(tiny_ckpt[arch], dtype=torch.bfloat16)(ids)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_image_embeddings_replace_media_pad_rows(tiny_ckpt):
    model = load_model(tiny_ckpt["kimi_k3"], dtype=torch.float64)
    media = model.config.media_placeholder_token_id
    pixels = torch.randn(2 * 4 * 4, 3, 14, 14, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    grids = torch.tensor([[1, 4, 4], [1, 4, 4]])                   # two images, 4 merged tokens each
    ids = torch.tensor([9, 10] + [media] * 4 + [11] + [media] * 4 + [12])
    embeds = model.encode_images(pixels, grids)
    assert embeds.shape == (8, model.config.text.hidden_size)
    got = model(ids, pixels, grids)
    # independent: the float64 reference text model with the encoder rows put at the pads by hand
    rows = dict(zip([2, 3, 4, 5, 7, 8, 9, 10], embeds))
    want = Reference(tiny_ckpt["kimi_k3"]).logits(ids.tolist(), embeds=rows)
    assert rel_err(got, want) <= 1e-10
    text_only = model(ids)
    assert torch.allclose(got[:2], text_only[:2]) and not torch.allclose(got[2:], text_only[2:])
    with pytest.raises(ValueError, match=r"holds 8 media pad token\(s\) but the images give 4"):
        model(ids, pixels[:16], grids[:1])


def test_loaded_vision_tower_keeps_its_fixed_time_table(tiny_ckpt):
    """The sin/cos time rows are not in the checkpoint; building on the meta device and
    materialising the model must not leave them uninitialised (video items use them)."""
    from kimik3.model.vision import sincos_time_table

    model = load_model(tiny_ckpt["kimi_k3"], dtype=torch.float32)
    pos = model.vision.vision_tower.patch_embed.pos_emb
    assert torch.equal(pos.time_weight, sincos_time_table(pos.num_frames, pos.weight.shape[-1]))


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_parts_sum_to_the_layer_output(tiny_ckpt, arch):
    """Kimi-Linear's MoE layers hand the residual stream their routed and shared outputs apart (summed in
    the next norm's pass); K3's latent MoE (routed up-projection and norm after the sum) hands one output.
    Either way the parts sum to the layer's output."""
    from kimik3.model.moe import MoE
    model = load_model(tiny_ckpt[arch], dtype=torch.float64)
    x = torch.randn(5, model.config.text.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers
    for moe in layers:
        y, s = moe.forward_parts(x)
        assert (s is not None) == (arch == "kimi_linear")
        assert torch.equal(y if s is None else y + s, moe(x))
