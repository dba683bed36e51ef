"""KDA state checkpoints of an eager CUDA step (prefix caching; ``KimiDeltaAttention._attend_with_checkpoints``)
on tiny checkpoints of both architectures in bf16: the step's logits equal those of the same step without
checkpoints, and each snapshot (mid-chunk in a multi-sequence round, mid-chunk in a one-sequence round, at a
chunk's last row) equals the state a step over that prefix alone leaves, every KDA layer's conv window and
recurrent state. The exact orchestration is tested on the CPU in float64 (tests/model/test_model.py)."""

from __future__ import annotations

import pytest
import torch

from kimik3.model import ForwardBatch, StateCheckpoint
from tests.helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BOUND = 2e-2            # bf16 model: the same kernels on other segmentations of the same tokens
BLOCK = 16


def step(model, cache, seqs: dict[int, list[int]], checkpoints=()):
    """One eager step: sequence n (fresh) in slot n + 1, blocks of its own."""
    per_seq = 1 + max(map(len, seqs.values())) // BLOCK
    tables = {n: list(range(1 + n * per_seq, 1 + (n + 1) * per_seq)) for n in seqs}
    batch = ForwardBatch.build([len(s) for s in seqs.values()], [0] * len(seqs), [n + 1 for n in seqs],
                               [tables[n] for n in seqs], BLOCK, device="cuda", checkpoints=tuple(checkpoints))
    ids = torch.tensor([t for s in seqs.values() for t in s], device="cuda")
    with torch.inference_mode():
        return model.compute_logits(model.forward_step(ids, batch, cache)).float()


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_checkpoint_states_and_logits_match_plain_steps(arch, tmp_path):
    import kimik3
    from kimik3.testing import make_tiny_checkpoint
    model = kimik3.load_model(make_tiny_checkpoint(tmp_path / arch, arch, seed=3), device="cuda", dtype=torch.bfloat16)
    vocab = model.config.text.vocab_size
    g = torch.Generator().manual_seed(0)
    seqs = {n: torch.randint(0, vocab, (length,), generator=g).tolist() for n, length in enumerate((160, 37, 96))}

    def cache():
        return model.allocate_cache(num_slots=16, num_blocks=64, block_size=BLOCK)

    plain = step(model, cache(), seqs)
    cks = [StateCheckpoint(0, 64, 8), StateCheckpoint(0, 128, 9), StateCheckpoint(0, 144, 13),
           StateCheckpoint(0, 160, 10), StateCheckpoint(2, 32, 11), StateCheckpoint(2, 64, 12)]   # round 4: seq 0 alone
    ours = cache()
    got = step(model, ours, seqs, cks)
    assert rel_err(got, plain) <= BOUND
    for c in cks:
        alone = cache()
        step(model, alone, {c.seq: seqs[c.seq][:c.num_tokens]})
        for name, pool in (("conv", "kda_conv"), ("state", "kda_state")):
            want, have = getattr(alone, pool)[:, c.seq + 1].float(), getattr(ours, pool)[:, c.slot].float()
            assert rel_err(have, want) <= BOUND, (arch, c, name)
    for n, s in seqs.items():            # the live states: the whole chunks'
        alone = cache()
        step(model, alone, {n: s})
        assert rel_err(ours.kda_state[:, n + 1].float(), alone.kda_state[:, n + 1].float()) <= BOUND
