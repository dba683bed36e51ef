"""What a user gets (#57 item 0): decode steps and prefill through ``kimik3.LLM`` with its defaults, beside
the graph-only figure of the same model on the same card in the same run.

A slice (``kimi-k3-slice4.config.json`` or ``--config=``) is built with random weights, its decode graph
timed at batch 1 / 32 / 128 over ``CONTEXT``-token histories (bench_slice's floor: bytes over the measured
copy rate), then written in the release layout (MXFP4 experts as ``weight_packed`` + ``weight_scale``) and
loaded with ``LLM(model=dir, tokenizer=<synthetic 163,840-token tokenizer>)``, every engine argument at its
default but ``max_num_seqs``, set to the largest batch (``--max-num-seqs=N`` to choose; the default, 64, runs a
batch of 128 prompts as two waves of 64, so its "batch-128 step" is two batch-64 steps: the first
measurement through ``LLM``, at ``a0e7607``, took that for 1.80x of the batch-128 floor). Through ``LLM``:

- decode step = (generate with 1 + STEPS tokens - generate with 1 token) / STEPS, on fresh random
  ``CONTEXT``-token prompts (no prefix hits), greedy, ``ignore_eos``;
- the host's share at the largest batch: a cProfile of one such generate (top functions by own time);
- prefill of ``PREFILL`` tokens (``max_tokens=1``), prefix caching on (the default) and off (a second ``LLM``).

    PYTHONPATH=. python benchmarks/gpu/bench_user_path.py [--config=PATH] [--batches=1,32,128]
        [--no-prefill-ab] [--no-profile] [--prefill-profile] [--prefill-only] [--max-num-seqs=N]
                                                                (writes $OUT/bench_user_path[_NAME].json)
``--prefill-profile``: the prefill's kernels (torch.profiler, by device time) with and without prefix caching.
``--prefill-only``: the prefill A/B alone (no decode graphs, no decode through ``LLM``). The A/B reports
``prefix_caching_over_plain`` (the target: at most 1.05) and the KDA checkpoints one such prefill takes.
    PYTHONPATH=. python benchmarks/gpu/bench_user_path.py --cpu-smoke    # tiny model on the CPU: the flow only
"""

from __future__ import annotations

import cProfile
import datetime
import gc
import io
import json
import pstats
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import arg, commit_id, log, save_results  # noqa: E402

CONFIG = Path(__file__).with_name("kimi-k3-slice4.config.json")
CONTEXT = 1024
STEPS = 64
PREFILL = 8192
_EXPERT = re.compile(r"experts\.(\d+)\.(w[123])\.weight$")


def release_tensors(model):
    """The model's weights under their release names; MXFP4 experts as their packed codes and scales."""
    from kimik3.model.moe import Experts
    from kimik3.testing import checkpoint_names
    scales = {}
    for name, m in model.named_modules():
        if isinstance(m, Experts) and m.mxfp4:
            layer = int(re.search(r"layers\.(\d+)\.", name)[1])
            scales[layer] = m
    for name, t in checkpoint_names(model):
        hit = _EXPERT.search(name)
        if hit and t.dtype == torch.uint8:
            layer = int(re.search(r"layers\.(\d+)\.", name)[1])
            m, e, which = scales[layer], int(hit[1]) - scales[layer].first_expert, hit[2]
            base = name[: -len(".weight")]
            yield base + ".weight_packed", t
            yield base + ".weight_scale", getattr(m, f"{which}_scale")[e]
        else:
            yield name, t


def write_release(model, cfg: dict, out: Path) -> Path:
    from kimik3.loader.writer import save_checkpoint
    t0 = time.time()
    save_checkpoint(out, cfg, release_tensors(model), mxfp4_experts=False)
    log(f"release layout written to {out} in {time.time() - t0:.1f}s")
    return out


def graph_figures(model, batches, bw, mm) -> dict:
    """bench_slice's decode graph at each batch over CONTEXT-token histories, with its floor."""
    from benchmarks.gpu import bench_slice as bs
    bs.CONTEXT = CONTEXT
    rows = {}
    for N in batches:
        cache, batch, ids = bs.decode_setup(model, N)
        fast = bs.step_fn(model, ids, batch, cache)
        model.use_side_stream(torch.cuda.Stream())
        t_graph = bs.graph_time(fast)
        model.use_side_stream(None)
        active = bs.touched_experts(fast)
        byts, flops = bs.counts(model, N, 0, "decode", active)
        floor = max(byts / bw, flops / mm)
        rows[N] = {"graph_ms": t_graph * 1e3, "floor_ms": floor * 1e3, "graph_over_floor": t_graph / floor,
                   "experts_touched_per_layer": active}
        log(f"graph b{N}: {t_graph * 1e3:.3f} ms, floor {floor * 1e3:.3f} ms ({t_graph / floor:.2f}x)")
        del cache, batch
        torch.cuda.empty_cache()
    return rows


def prompts(vocab: int, n: int, length: int, rng: random.Random) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(vocab // 16, vocab - vocab // 16) for _ in range(length)]} for _ in range(n)]


def timed_generate(llm, ps, max_tokens: int) -> float:
    from kimik3 import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs), "a request stopped early"
    return dt


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def user_decode(llm, vocab: int, batches, steps: int, context: int, rng: random.Random) -> dict:
    rows = {}
    timed_generate(llm, prompts(vocab, max(batches), context, rng), steps + 1)      # warm-up
    for N in batches:
        t1 = min(timed_generate(llm, prompts(vocab, N, context, rng), 1) for _ in range(2))
        tn = min(timed_generate(llm, prompts(vocab, N, context, rng), steps + 1) for _ in range(2))
        step = (tn - t1) / steps
        rows[N] = {"generate_1_s": t1, f"generate_{steps + 1}_s": tn, "step_ms": step * 1e3}
        log(f"LLM b{N}: step {step * 1e3:.3f} ms (generate 1: {t1:.3f}s, {steps + 1}: {tn:.3f}s)")
    return rows


def host_profile(llm, vocab: int, N: int, steps: int, context: int, rng: random.Random) -> str:
    ps = prompts(vocab, N, context, rng)
    prof = cProfile.Profile()
    prof.enable()
    timed_generate(llm, ps, steps + 1)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    return s.getvalue()


def prefill_time(llm, vocab: int, length: int, rng: random.Random, tag: str, results: dict) -> float:
    timed_generate(llm, prompts(vocab, 1, length, rng), 1)                           # warm-up at this length
    best = min(timed_generate(llm, prompts(vocab, 1, length, rng), 1) for _ in range(3))
    if "--prefill-profile" in sys.argv and torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timed_generate(llm, prompts(vocab, 1, length, rng), 1)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
        results[f"prefill_profile_{tag}"] = table
        log(f"prefill {length} ({tag}) kernels:\n{table}")
    return best


def free(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


FLAGS = ("--config=", "--batches=", "--no-prefill-ab", "--no-profile", "--prefill-profile", "--cpu-smoke",
         "--prefill-only", "--max-num-seqs=")


def main():
    unknown = [a for a in sys.argv[1:] if not any(a == f or (f.endswith("=") and a.startswith(f)) for f in FLAGS)]
    if unknown:
        raise SystemExit(f"bench_user_path.py: unknown arguments {unknown}; known: {' '.join(FLAGS)}")
    from kimik3 import LLM
    results: dict = {"commit": commit_id(), "date": datetime.date.today().isoformat()}
    rng = random.Random(0)
    smoke = "--cpu-smoke" in sys.argv
    batches = [int(b) for b in arg("batches", "2,4" if smoke else "1,32,128").split(",")]
    steps, context, prefill = (4, 16, 64) if smoke else (STEPS, CONTEXT, PREFILL)
    tmp = Path(tempfile.mkdtemp(prefix="kimik3_user_path_"))
    if smoke:
        from kimik3.testing import make_tiny_checkpoint
        path, vocab = make_tiny_checkpoint(tmp / "model"), 256
        tok = None
        results["device"] = "cpu"
    else:
        from benchmarks.common import copy_rate, matmul_rate
        from benchmarks.gpu.bench_slice import build_slice
        from benchmarks.structured import synthetic_tokenizer
        cfg_path = Path(arg("config", str(CONFIG)))
        cfg = json.loads(cfg_path.read_text())
        results["device"] = torch.cuda.get_device_name()
        results["config"] = cfg_path.name
        bw, mm = copy_rate(), matmul_rate()
        results["ceilings"] = {"copy_bytes_per_s": bw, "bf16_matmul_flops": mm}
        model = build_slice(cfg, str(cfg_path))
        if "--prefill-only" not in sys.argv:
            results["graph"] = graph_figures(model, batches, bw, mm)
        path = write_release(model, cfg, tmp / "model")
        vocab = model.config.text.vocab_size
        del model
        gc.collect()
        torch.cuda.empty_cache()
        tok = synthetic_tokenizer()
    name = "bench_user_path" + ("" if smoke or cfg_path == CONFIG else f"_{cfg_path.stem.split('.')[0]}")
    t0 = time.time()
    max_seqs = int(arg("max-num-seqs", str(max(batches))))
    results["max_num_seqs"] = max_seqs
    llm = LLM(model=str(path), tokenizer=tok, max_num_seqs=max_seqs)
    results["llm_ready_s"] = time.time() - t0
    results["engine_config"] = {k: str(v) for k, v in vars(llm.engine.config).items()} if hasattr(llm.engine, "config") else {}
    plan = llm.engine.plan
    results["kda_checkpoints_per_prefill"] = (prefill // (plan.checkpoint_interval * plan.block_size)
                                              if plan.checkpoint_interval else 0)
    results["user"] = {} if "--prefill-only" in sys.argv else user_decode(llm, vocab, batches, steps, context, rng)
    for N, row in results["user"].items():
        g = results.get("graph", {}).get(N)
        if g:
            row["user_over_floor"] = row["step_ms"] / g["floor_ms"]
            row["user_minus_graph_ms"] = row["step_ms"] - g["graph_ms"]
            log(f"b{N}: user {row['step_ms']:.3f} ms = {row['user_over_floor']:.2f}x floor; graph "
                f"{g['graph_ms']:.3f} ms = {g['graph_over_floor']:.2f}x; outside the graph {row['user_minus_graph_ms']:.3f} ms")
    save_results(name + ".json", results)
    if "--no-profile" not in sys.argv and "--prefill-only" not in sys.argv:
        results["host_profile"] = host_profile(llm, vocab, max(batches), steps, context, rng)
        log(results["host_profile"][:6000])
        save_results(name + ".json", results)
    results["prefill_prefix_caching_s"] = prefill_time(llm, vocab, prefill, rng, "prefix_caching", results)
    log(f"prefill {prefill} with prefix caching: {results['prefill_prefix_caching_s'] * 1e3:.1f} ms")
    free(llm)
    save_results(name + ".json", results)
    if "--no-prefill-ab" not in sys.argv:
        llm = LLM(model=str(path), tokenizer=tok, enable_prefix_caching=False, max_num_seqs=max_seqs)
        results["prefill_no_prefix_caching_s"] = prefill_time(llm, vocab, prefill, rng, "no_prefix_caching", results)
        ratio = results["prefill_prefix_caching_s"] / results["prefill_no_prefix_caching_s"]
        results["prefix_caching_over_plain"] = ratio
        log(f"prefill {prefill} without prefix caching: {results['prefill_no_prefix_caching_s'] * 1e3:.1f} ms "
            f"(with / without: {ratio:.3f}; {results['kda_checkpoints_per_prefill']} KDA checkpoints a prefill)")
        free(llm)
    save_results(name + ".json", results)


if __name__ == "__main__":
    main()
