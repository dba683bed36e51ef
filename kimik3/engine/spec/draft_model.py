"""Drafts from a draft model (Eagle3, K3's MTP, a DFlash block drafter) for speculative decoding.

The target's forward keeps the hidden states the draft reads (``aux_layers``: Eagle3's / DFlash's auxiliary
layers, MTP's pre-norm h_final) for every row of the step (``ModelRunner``). After the step is committed
(drafts settled, tokens appended), ``observe``:

1. catches the draft's cache up with the positions the target computed and kept: every prompt row and, in a
   verify chunk, the input row and the accepted drafts. The draft's row at position p reads the target's states
   at p and the token p + 1 (Eagle3, MTP: known once the step sampled it; DFlash writes the states at p as its
   context). Rows of rejected drafts are rewritten by the next catch-up, as the target's MLA latents are: the
   draft cache shares the target's block tables (``model/draft_attention.py``), so prefix hits, preemption and
   freeing need nothing of their own; the draft has no recurrent state to roll back.
2. drafts for each request that decodes next: Eagle3 / MTP chain their own features, one forward per draft
   token (positions past the request's blocks go to scratch blocks after the target's); DFlash drafts a block
   in one forward. Drafts are the draft's greedy tokens (a one-token draft distribution): ``verify.verify``
   accepts exactly as the target's sampler would, greedy and sampled alike.

The number of drafts adapts per request (``ModelState``, the request's ``Request.spec``): ``limit`` (m + 1
after m accepted of a rejected draft, one more after a fully accepted one, ``settle``), and a verify step that
accepts none pauses drafting for 1, 4, 16, 64, then 128 decode steps (``drafter.watch_pause``), after which one
draft probes again: on text the draft cannot predict (adversarial, very long context) the steps run plain.
While paused the draft's cache is still caught up (one draft row per decoded token). Its drafts need the
previous step's committed tokens, so its requests' steps are never scheduled ahead (``drafts_ahead`` False).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kimik3.engine.config import EngineConfig
from kimik3.engine.spec.drafter import Drafter, watch_pause
from kimik3.model.batch import ForwardBatch
from kimik3.model.dflash import DFlashDraft
from kimik3.model.draft_attention import DraftBatch, extend_tables
from kimik3.model.eagle3 import Eagle3Draft
from kimik3.model.mtp import MTPDraft

logger = logging.getLogger(__name__)

METHODS = ("eagle3", "mtp", "dflash", "dspark")


@dataclass
class ModelState:
    """One request's draft-model drafting state (``Request.spec``)."""

    misses: int = 0                 # verify steps in a row that accepted no draft
    pause: int = 0                  # decode steps left without drafts
    limit: int = 1 << 30            # most drafts its next step carries (``settle``)
    proposal: list[int] = field(default_factory=list)   # the draft's drafts for its next step (``observe``)


class ModelDrafter(Drafter):
    """Drafts from a draft model (module docstring); ``observe`` runs it after each committed step."""

    drafts_ahead = False

    def __init__(self, config: EngineConfig, draft, num_blocks: int):
        super().__init__(config)
        num_speculative_tokens, block_size, max_num_seqs = config.num_speculative_tokens, config.block_size, \
            config.max_num_seqs
        self.draft = draft
        self.k = num_speculative_tokens
        if isinstance(draft, DFlashDraft) and num_speculative_tokens > draft.cfg.block_size - 1:
            raise ValueError(f"num_speculative_tokens {num_speculative_tokens} exceeds what the DFlash draft's blocks "
                             f"give (block_size - 1 = {draft.cfg.block_size - 1}); lower it")
        self.block_size = block_size
        self.aux_layers = tuple(draft.aux_layer_ids)
        self.scratch_per_seq = -(-(num_speculative_tokens + 1) // block_size) + 1
        self.first_scratch = num_blocks
        total = num_blocks + max_num_seqs * self.scratch_per_seq
        p = next(draft.parameters())
        if isinstance(draft, MTPDraft):
            shape = (draft.num_layers, total, block_size, draft.cfg.mla_cache_dim)
        elif isinstance(draft, DFlashDraft):
            shape = (draft.cfg.num_hidden_layers, total, block_size, *draft.cfg.cache_shape)
        else:
            shape = (total, block_size, *draft.cfg.cache_shape)
        self.cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.device = p.device

    @staticmethod
    def bytes_per_block(draft, block_size: int) -> int:
        """Bytes of the draft's cache per block of ``block_size`` tokens (all its layers)."""
        p = next(draft.parameters())
        if isinstance(draft, MTPDraft):
            per_token = draft.num_layers * draft.cfg.mla_cache_dim
        elif isinstance(draft, DFlashDraft):
            per_token = draft.cfg.num_hidden_layers * 2 * draft.cfg.num_key_value_heads * draft.cfg.head_dim
        else:
            per_token = 2 * draft.cfg.num_key_value_heads * draft.cfg.head_dim
        return per_token * block_size * p.element_size()

    @property
    def cache_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def _scratch(self, n: int) -> list[list[int]]:
        return [list(range(self.first_scratch + i * self.scratch_per_seq,
                           self.first_scratch + (i + 1) * self.scratch_per_seq)) for i in range(n)]

    @staticmethod
    def state(req) -> ModelState:
        if req.spec is None:
            req.spec = ModelState()
        return req.spec

    def propose(self, req, room: int) -> list[int]:
        """The draft's proposal from the last step (``observe``), within ``room`` and the grammar."""
        s = self.state(req)
        if s.pause:
            s.pause -= 1
            return []
        draft, s.proposal = s.proposal[:min(room, s.limit)], []
        return draft[:req.matcher.valid_prefix(draft)] if draft and req.matcher is not None else draft

    def settle(self, req, draft: list[int], num_accepted: int) -> None:
        """The next step carries at most m + 1 drafts after m accepted of a rejected draft (one more after all
        were accepted); a verify that accepted none pauses its drafts (``watch_pause`` of its misses in a row)."""
        s, m = self.state(req), num_accepted
        s.misses = 0 if m else s.misses + 1
        s.limit = m + 1 if m < len(draft) else max(s.limit, m + 1)
        if m == 0:
            s.pause = watch_pause(s.misses)

    @torch.inference_mode()
    def observe(self, out, states: torch.Tensor | None) -> None:
        """Catch up with a committed step and set the proposal of each request that drafts next.
        ``states``: the target's aux states of the step's packed rows [T, n * D] (None: nothing to read)."""
        if states is None:
            return
        rows, pos, nxt, seqs = [], [], [], []          # catch-up: packed rows, positions, next tokens; per chunk
        offset = 0
        for c in out.chunks:
            req, n_real = c.req, c.num_tokens - len(c.draft) + c.num_accepted
            if self.may_draft(req) and not req.is_finished and req.num_tokens > c.start + n_real:
                rows.extend(range(offset, offset + n_real))
                pos.extend(range(c.start, c.start + n_real))
                nxt.extend(req.token_ids[c.start + 1:c.start + n_real + 1])
                seqs.append((c, n_real))
            offset += c.num_tokens
        if not seqs:
            return
        dev = self.device
        feats = states[torch.tensor(rows, device=states.device)]
        tables = [c.req.cache.block_ids for c, _ in seqs]
        starts, lens = [c.start for c, _ in seqs], [n for _, n in seqs]
        drafting = [i for i, (c, n) in enumerate(seqs) if c.samples and self._room(c.req) > 0]
        if isinstance(self.draft, DFlashDraft):
            self._dflash(feats, pos, starts, lens, tables, seqs, drafting)
            return
        ids = torch.tensor(nxt, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        logits, hidden = self._run(0, ids, feats, positions, lens, starts, tables, None, first=True)
        if not drafting:
            return
        last = torch.tensor([sum(lens[:i + 1]) - 1 for i in drafting], device=dev)
        self._chain([seqs[i][0].req for i in drafting], logits[last], hidden[last],
                    [starts[i] + lens[i] for i in drafting], [tables[i] for i in drafting])

    def _room(self, req) -> int:
        """Drafts ``req`` takes next (0 while paused; the scheduler trims them to its budget too)."""
        s = self.state(req)
        if s.pause or req.is_finished:
            return 0
        return max(0, min(self.k, s.limit, req.params.max_tokens - req.num_output_tokens - 1))

    def _run(self, step: int, ids, feats, positions, lens, starts, tables, scratch, first: bool = False):
        """One draft forward over rows (``lens`` per sequence from ``starts``): (logits, features)."""
        if isinstance(self.draft, MTPDraft):
            full = extend_tables(lens, starts, tables, self.block_size, scratch)
            batch = ForwardBatch.build(lens, starts, [0] * len(lens), full, self.block_size, self.device)
            return self.draft(step, ids, feats, positions, batch, self.cache)
        batch = DraftBatch.build(lens, starts, tables, self.block_size, scratch, self.device)
        if first:
            feats = self.draft.combine([feats])
        return self.draft(ids, feats, batch, self.cache)

    def _to_target(self, logits: torch.Tensor) -> torch.Tensor:
        ids = logits.argmax(-1)
        return self.draft.to_target(ids) if hasattr(self.draft, "to_target") else ids

    def _chain(self, reqs, logits, hidden, next_pos: list[int], tables) -> None:
        """Drafts 1..k of each request: draft 1 from its last caught-up row, draft j + 1 from a row at position
        P + j - 1 (P = ``next_pos``) that reads draft j and the draft's own feature of the row before."""
        room = [self._room(r) for r in reqs]
        scratch = self._scratch(len(reqs))
        tokens = [self._to_target(logits)]
        for j in range(1, max(room)):
            live = [i for i, r in enumerate(room) if r > j]
            sel = torch.tensor(live, device=self.device)
            pos = [next_pos[i] + j - 1 for i in live]
            logits, h = self._run(j, tokens[-1][sel], hidden[sel], torch.tensor(pos, device=self.device),
                                  [1] * len(live), pos, [tables[i] for i in live], [scratch[i] for i in live])
            t = torch.zeros_like(tokens[-1])
            t[sel] = self._to_target(logits)
            hidden = hidden.clone()
            hidden[sel] = h
            tokens.append(t)
        drafts = torch.stack(tokens, 1).tolist()
        for req, r, d in zip(reqs, room, drafts):
            self.state(req).proposal = d[:r]

    def _dflash(self, feats, pos, starts, lens, tables, seqs, drafting) -> None:
        ctx = DraftBatch.build(lens, starts, tables, self.block_size, None, self.device)
        self.draft.write_context([feats], ctx.positions, ctx.slot_mapping, self.cache)
        if not drafting:
            return
        reqs = [seqs[i][0].req for i in drafting]
        P = [starts[i] + lens[i] for i in drafting]
        B = self.draft.cfg.block_size
        block = DraftBatch.build([B] * len(reqs), P, [tables[i] for i in drafting], self.block_size,
                                 self._scratch(len(reqs)), self.device, causal=False, write=False)
        anchors = torch.tensor([r.token_ids[p] for r, p in zip(reqs, P)], device=self.device)
        drafts = self._to_target(self.draft(anchors, block, self.cache)).tolist()
        for req, d in zip(reqs, drafts):
            self.state(req).proposal = d[:self._room(req)]


def load_draft(method: str, path: str, target):
    """The draft model of ``method`` at ``path`` ("default": the draft shipped for the embedded default model),
    checked against ``target``."""
    from kimik3.loader.drafts import DEFAULT_DRAFT, load_dflash, load_eagle3, load_mtp
    if method not in METHODS:
        raise ValueError(f"speculative method {method!r} is not one of {METHODS + ('ngram',)}")
    if path == "default":
        if method != "eagle3":
            raise ValueError(f"the shipped default draft is an Eagle3 draft; use method 'eagle3', not {method!r}")
        path = DEFAULT_DRAFT
    loader = {"eagle3": load_eagle3, "mtp": load_mtp, "dflash": load_dflash, "dspark": load_dflash}[method]
    draft = loader(path, target)
    logger.info("%s draft from %s (auxiliary layers %s)", method, path, list(draft.aux_layer_ids))
    return draft
