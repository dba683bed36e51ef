"""A pipeline-parallel step with micro-batches in flight (spec parallelism §4.3).

The step's packed rows are cut into m micro-batches (``micro_batch_bounds``: near-equal token counts; a decode
batch splits between sequences, a prefill chunk may be cut inside itself). Every rank of every stage runs them in
order (``run_stage``): it receives micro-batch k's residual stream from the previous stage, runs its layers and
hands the stream on with a send it does not wait for, so it starts on k + 1 while the next stage works on k (the
fill and drain of GPipe, inside one engine step). The last stage sends each micro-batch's logits rows to world rank
0 as they are ready; rank 0 (stage 0, which samples) receives them after its own micro-batches.

Why the split changes no result: each stage runs the micro-batches in the step's order, so whatever micro-batch k
reads of the caches (a sequence's earlier rows cut off into k - 1: its latent rows and KDA state) is written
first, as chunked prefill does; sequences are otherwise independent. With p stages of equal time t for the whole
batch a step takes (m + p - 1) t / m instead of p t when a stage's time grows with its tokens (prefill chunks,
large batches, long contexts); a small decode batch whose time is the weights' reads gains nothing from a split
(``--pp-micro-batches 1`` runs it whole). The alternative, several engine steps in flight with disjoint requests
(vLLM's batch queue), keeps the pipe full between steps but needs the scheduler and the workers' step protocol to
run ahead; not done.
"""

from __future__ import annotations

import time

import torch

from kimik3.model.batch import ForwardBatch


def micro_batch_bounds(batch: ForwardBatch, parts: int) -> list[int]:
    """Packed-row bounds [0, .., T] of at most ``parts`` micro-batches of near-equal token counts: each cut at its
    even share, between sequences or inside a chunk (the chunk's later rows then run as its continuation)."""
    if parts < 1:
        raise ValueError(f"micro-batch count must be >= 1, got {parts}")
    T = batch.num_tokens
    return sorted({0, T, *(round(k * T / parts) for k in range(1, parts))})


def run_stage(model, input_ids: torch.Tensor, batch: ForwardBatch, cache, rows: list[int],
              bounds: list[int]) -> torch.Tensor | None:
    """This rank's part of one pipelined step: each micro-batch [bounds[k], bounds[k+1]) through this stage's
    layers. Returns, on world rank 0, the logits of the packed ``rows`` (in their order; None without rows), and
    None on every other rank."""
    pipe, text = model.pipeline, model.config.text
    device, dtype = torch.device(model.device), model.dtype
    pending, received = [], []            # sends not yet waited for; rank 0: (positions in ``rows``, logits)
    spans = []
    if pipe.timeline is not None:
        pipe.timeline.append(spans)
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        part = batch.slice_rows(lo, hi) if (lo, hi) != (0, batch.num_tokens) else batch
        stream = None if pipe.is_first else pipe.recv((hi - lo, text.hidden_size), dtype, device)
        start = time.monotonic()
        out = model.forward_step(input_ids[lo:hi], part, cache, stream=stream)
        mine = [(i, r - lo) for i, r in enumerate(rows) if lo <= r < hi]
        if not pipe.is_last:
            pending += pipe.send(out)
        elif mine:
            logits = model.compute_logits(out[torch.tensor([r for _, r in mine], device=device)])
            if logits is not None:            # TP rank 0 of the last stage
                pending += pipe.send_logits(logits)
        spans.append((k, start, time.monotonic()))
        if mine and torch.distributed.get_rank() == 0:
            received.append([i for i, _ in mine])
    logits = None
    if received:
        logits_dtype = torch.promote_types(dtype, torch.float32)
        logits = torch.empty(len(rows), text.vocab_size, dtype=logits_dtype, device=device)
        for where in received:
            logits[torch.tensor(where, device=device)] = pipe.recv_logits(len(where), text.vocab_size,
                                                                          logits_dtype, device)
    pipe.wait_sent(pending)
    return logits
