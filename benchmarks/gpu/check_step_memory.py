"""Does the cache plan's step workspace cover the measured peak? (#52: ``LLM(model=K3 slice,
max_model_len=1048576)`` at the default gpu_memory_utilization 0.9 ran out of memory on a 131,072-token prompt.)

For each slice config (default: the K3 and the Kimi-Linear slice beside this file), random weights are written in
the release layout and loaded with ``LLM(model=dir, max_model_len=1048576)``, every other argument at its default.
Then one prompt of each length (default 131072; ``--largest`` adds max_model_len - 1, the longest the plan admits)
is generated with ``max_tokens=1``, and the transient peak (``torch.cuda.max_memory_allocated()`` during the
generate, less what was allocated before it: weights and cache) is compared with ``cache_budget.step_workspace``.
Exit status 1 if any prompt fails or its peak exceeds the estimate; the table goes to $OUT/check_step_memory.json.

    PYTHONPATH=. python benchmarks/gpu/check_step_memory.py [--config=A.json,B.json] [--lengths=131072] [--largest]
"""

from __future__ import annotations

import datetime
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, log, save_results  # noqa: E402

HERE = Path(__file__).parent
CONFIGS = [HERE / "kimi-k3-slice4.config.json", HERE / "kimi-linear-slice4.config.json"]
FLAGS = ("--config=", "--lengths=", "--largest")


def arg(name: str, default: str | None = None) -> str | None:
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)


def check(cfg_path: Path, lengths: list[int], largest: bool) -> dict:
    from benchmarks.gpu.bench_slice import build_slice
    from benchmarks.gpu.bench_user_path import write_release
    from benchmarks.structured import synthetic_tokenizer
    from kimik3 import LLM, SamplingParams
    from kimik3.engine.core.cache_budget import step_workspace
    cfg = json.loads(cfg_path.read_text())
    tmp = Path(tempfile.mkdtemp(prefix="kimik3_step_memory_"))
    model = build_slice(cfg, str(cfg_path))
    path = write_release(model, cfg, tmp / "model")
    vocab = model.config.text.vocab_size
    del model
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(model=str(path), tokenizer=synthetic_tokenizer(), max_model_len=1048576)
    engine = llm.engine
    ws = step_workspace(engine.model.cache_text_config, engine.config, engine.model.dtype)
    total = torch.cuda.mem_get_info()[1]
    row = {"config": cfg_path.name, "workspace_estimate": ws.parts, "workspace_estimate_total": ws.total,
           "cache_bytes": engine.plan.total_bytes, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
           "gpu_total": total, "runs": []}
    log(f"{cfg_path.name}: workspace estimate {ws.total / 2**30:.2f} GiB ({ws.describe()}); cache "
        f"{engine.plan.total_bytes / 2**30:.2f} GiB")
    rng = random.Random(0)
    for n in lengths + ([engine.config.max_model_len - 1] if largest else []):
        ids = [rng.randrange(vocab // 16, vocab - vocab // 16) for _ in range(n)]
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            ok, error = len(out[0].outputs[0].token_ids) == 1, None
        except torch.OutOfMemoryError as e:
            ok, error = False, f"CUDA out of memory: {str(e)[:300]}"
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        run = {"prompt_tokens": n, "ok": ok, "error": error, "seconds": time.perf_counter() - t0,
               "peak_transient": peak, "peak_over_estimate": peak / ws.total,
               "max_reserved_over_gpu": torch.cuda.max_memory_reserved() / total}
        row["runs"].append(run)
        log(f"  {n} tokens: {'ok' if ok else error} in {run['seconds']:.1f} s; transient peak {peak / 2**30:.2f} GiB = "
            f"{peak / ws.total:.2f} x the estimate; reserved peak {run['max_reserved_over_gpu']:.3f} of the GPU")
    llm.shutdown()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    unknown = [a for a in sys.argv[1:] if not any(a == f or (f.endswith("=") and a.startswith(f)) for f in FLAGS)]
    if unknown:
        raise SystemExit(f"check_step_memory.py: unknown arguments {unknown}; known: {' '.join(FLAGS)}")
    configs = [Path(p) for p in arg("config", "").split(",") if p] or CONFIGS
    lengths = [int(x) for x in arg("lengths", "131072").split(",")]
    results = {"commit": commit_id(), "date": datetime.date.today().isoformat(),
               "device": torch.cuda.get_device_name(), "rows": []}
    for cfg in configs:
        results["rows"].append(check(cfg, lengths, "--largest" in sys.argv))
        save_results("check_step_memory.json", results)
    bad = [(r["config"], x["prompt_tokens"]) for r in results["rows"] for x in r["runs"]
           if not x["ok"] or x["peak_over_estimate"] > 1.0]
    log("every prompt fit within the estimate" if not bad else f"over the estimate or failed: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
