"""An exact, fast stand-in for the model that checks the cache plumbing it is handed.

Each token t at position p folds into a KDA-like running state s <- (31 s + t + 1) mod 10007 kept in
``kda_state[.., 0]`` (with a token count in ``[.., 1]`` and the last token in ``kda_conv``), and is
written to the latent cache as (t + 1, p). The next token is a function of the state *and* of every
latent row read back through the block table, so any wrong block, lost state copy, missing reset or
bad checkpoint changes the output, and reading a row that holds the wrong position raises.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kimik3.model.batch import ForwardBatch, HybridCache

MOD = 10007


def fake_config(vocab_size: int = 61, eos_token_id: int | None = None) -> SimpleNamespace:
    text = SimpleNamespace(
        vocab_size=vocab_size, eos_token_id=eos_token_id, kda_layer_ids=(0,), mla_layer_ids=(1,),
        kda=SimpleNamespace(num_heads=1, head_dim=2, conv_size=2), mla_cache_dim=2, mla_cache_stripes=1,
        cached_layer_ids=lambda kind: (0,) if kind == "kda" else (1,))
    return SimpleNamespace(text=text, architecture="fake", vision=None, media_placeholder_token_id=None)


class FakeModel:
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, vocab_size: int = 61, eos_token_id: int | None = None, sharpness: float = 1.0,
                 next_from_last: bool = False):
        """``next_from_last``: the next token is 10 + (t mod 3) of the last token t alone, so outputs
        cycle through 10, 11, 12 and n-gram drafts get accepted (the cache plumbing is checked all
        the same)."""
        self.config = fake_config(vocab_size, eos_token_id)
        self.vocab_size = vocab_size
        self.sharpness = sharpness
        self.next_from_last = next_from_last
        self.num_steps = 0

    @property
    def cache_text_config(self) -> SimpleNamespace:
        return self.config.text

    def allocate_cache(self, num_slots: int, num_blocks: int, block_size: int, latent_dtype=None) -> HybridCache:
        return HybridCache.allocate(self.config.text, num_slots, num_blocks, block_size, self.dtype, self.device,
                                    latent_dtype)

    @staticmethod
    def _next(s: int, latent_sum: int, vocab: int) -> int:
        return (7 * s + latent_sum) % vocab

    def _hidden(self, s: int, latent_sum: int, t: int) -> list[float]:
        if self.next_from_last:
            return [0.0, float(10 + t % 3)]
        return [float(s), float(latent_sum % MOD)]

    def forward_step(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        self.num_steps += 1
        bs = cache.block_size
        latent = cache.mla_latent[0]
        ids = input_ids.tolist()
        cu = batch.cu_seqlens.tolist()
        tables = batch.block_tables.tolist()
        rows = batch.slot_mapping.tolist()
        hidden = []
        for n, (ctx, slot) in enumerate(zip(batch.context_lens_cpu, batch.state_slots.tolist())):
            assert slot > 0, "sequence got the null state slot 0"
            s, count = int(cache.kda_state[0, slot, 0, 0, 0]), int(cache.kda_state[0, slot, 0, 0, 1])
            if ctx == 0:
                assert s == 0 and count == 0, f"fresh sequence {n} starts from a dirty state slot {slot}"
            assert count == ctx, f"state of slot {slot} covers {count} tokens, the batch says {ctx}"
            latent_sum = 0
            for p in range(ctx):
                block = tables[n][p // bs]
                assert block > 0, f"position {p} maps to block {block}"
                tok1, pos = latent[block, p % bs].tolist()
                assert int(pos) == p, f"latent row of position {p} holds position {pos} (block {block})"
                latent_sum = (latent_sum + int(tok1) * (p + 1)) % MOD
            if ctx:
                assert int(cache.kda_conv[0, slot, 0, 0]) == int(latent[tables[n][(ctx - 1) // bs],
                                                                      (ctx - 1) % bs, 0]) - 1, "conv state lost"
            cks: dict[int, list[int]] = {}          # several snapshots may share an offset
            for c in batch.checkpoints:
                if c.seq == n:
                    cks.setdefault(c.num_tokens, []).append(c.slot)
            for i, row in enumerate(range(cu[n], cu[n + 1])):
                t, p = ids[row], ctx + i
                s, count = (31 * s + t + 1) % MOD, count + 1
                block = tables[n][p // bs]
                assert block > 0 and rows[row] == block * bs + p % bs
                latent.view(-1, 2)[rows[row]] = torch.tensor([t + 1.0, float(p)])
                latent_sum = (latent_sum + (t + 1) * (p + 1)) % MOD
                hidden.append(self._hidden(s, latent_sum, t))
                for ck_slot in cks.get(i + 1, []):
                    self._write_state(cache, ck_slot, s, count, t)
            self._write_state(cache, slot, s, count, ids[cu[n + 1] - 1])
        return torch.tensor(hidden, dtype=torch.float32)

    @staticmethod
    def _write_state(cache: HybridCache, slot: int, s: int, count: int, last: int) -> None:
        cache.kda_state[0, slot, 0, 0, 0] = s
        cache.kda_state[0, slot, 0, 0, 1] = count
        cache.kda_conv[0, slot, 0, 0] = last

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits peaked at the next token: -sharpness * cyclic distance, so sampling has a known spread."""
        v = torch.arange(self.vocab_size)
        nxt = ((7 * hidden[:, 0].long() + hidden[:, 1].long()) % self.vocab_size)[:, None]
        d = (v[None, :] - nxt).abs()
        d = torch.minimum(d, self.vocab_size - d)
        return -self.sharpness * d.float()

    def __call__(self, input_ids) -> torch.Tensor:
        """Reference: one fresh sequence, no cache."""
        s = latent_sum = 0
        hidden = []
        for p, t in enumerate(torch.as_tensor(input_ids).tolist()):
            s = (31 * s + t + 1) % MOD
            latent_sum = (latent_sum + (t + 1) * (p + 1)) % MOD
            hidden.append(self._hidden(s, latent_sum, t))
        return self.compute_logits(torch.tensor(hidden))


def reference_greedy(model, prompt: list[int], max_tokens: int, eos: int | None = None,
                     max_model_len: int | None = None) -> list[int]:
    """Greedy decoding by calling the model on the growing sequence (no cache)."""
    ids = list(prompt)
    out = []
    while len(out) < max_tokens and (max_model_len is None or len(ids) < max_model_len):
        t = int(model(torch.tensor(ids))[-1].argmax())
        ids.append(t)
        out.append(t)
        if t == eos:
            break
    return out
