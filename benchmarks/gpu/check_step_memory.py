"""Does the cache plan's step workspace cover the measured peak? (#52: ``LLM(model=K3 slice,
max_model_len=1048576)`` at the default gpu_memory_utilization 0.9 ran out of memory on a 131,072-token prompt.)

For each slice config (default: the K3 and the Kimi-Linear slice beside this file), random weights are written in
the release layout, with a tokenizer (the synthetic 163,840-id vocabulary of ``benchmarks/structured.py``), into a
checkpoint directory (under /dev/shm when it has room: no disk I/O), which is loaded exactly as the issue's user did:
``LLM(model=dir, max_model_len=1048576)``, every other argument at its default. Then one prompt of each length
(default: 131072 and ``max``, max_model_len - 1 = 1,048,575, the longest the plan admits: an engine whose cache
cannot hold one max_model_len sequence refuses to start) is generated with ``max_tokens=1``, and the transient peak
(``torch.cuda.max_memory_allocated()`` during the generate, less what was allocated before it: weights and cache) is
compared with ``cache_budget.step_workspace``. Exit status 1 if any prompt fails or its peak exceeds the estimate;
the table goes to $OUT/check_step_memory.json.

    PYTHONPATH=. python benchmarks/gpu/check_step_memory.py [--config=A.json,B.json] [--lengths=131072,max]
"""

from __future__ import annotations

import datetime
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import arg, commit_id, log, save_results  # noqa: E402

HERE = Path(__file__).parent
CONFIGS = [HERE / "kimi-k3-slice4.config.json", HERE / "kimi-linear-slice4.config.json"]
FLAGS = ("--config=", "--lengths=")


def write_tokenizer(path: Path, chat_format: str) -> None:
    """``tiktoken.model`` and ``tokenizer_config.json`` of the synthetic K3-sized vocabulary (163,584 base tokens and
    the release's special-token table), so the checkpoint loads with no ``tokenizer=`` argument."""
    import base64

    from benchmarks.structured import synthetic_vocab
    from kimik3.tokenizer import CONFIG_FILE, TIKTOKEN_FILE
    from kimik3.tokenizer_build import tokenizer_config
    vocab = synthetic_vocab()
    (path / TIKTOKEN_FILE).write_text("".join(f"{base64.b64encode(b).decode()} {i}\n" for i, b in enumerate(vocab)))
    (path / CONFIG_FILE).write_text(json.dumps(tokenizer_config(len(vocab), chat_format), indent=1))


def scratch_dir(need_bytes: int) -> Path:
    """A fresh directory on /dev/shm when it has ``need_bytes`` free (a 25 GB slice is written and read at memory
    speed), else under the system's temporary directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > need_bytes else None
    return Path(tempfile.mkdtemp(prefix="kimik3_step_memory_", dir=base))


def check(cfg_path: Path, lengths: list[str]) -> dict:
    from benchmarks.gpu.bench_slice import build_slice
    from benchmarks.gpu.bench_user_path import write_release
    from kimik3 import LLM, SamplingParams
    from kimik3.engine.core.cache_budget import step_workspace
    t_start = time.perf_counter()
    cfg = json.loads(cfg_path.read_text())
    model = build_slice(cfg, str(cfg_path))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    tmp = scratch_dir(2 * size)
    path = write_release(model, cfg, tmp / "model")
    write_tokenizer(path, "kimi_linear" if cfg.get("model_type") == "kimi_linear" else "k3")
    vocab = model.config.text.vocab_size
    del model
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(model=str(path), max_model_len=1048576)          # the call: every other argument at its default
    engine = llm.engine
    ws = step_workspace(engine.model.cache_text_config, engine.config, engine.model.dtype)
    total = torch.cuda.mem_get_info()[1]
    row = {"config": cfg_path.name, "workspace_estimate": ws.parts, "workspace_estimate_total": ws.total,
           "cache_bytes": engine.plan.total_bytes, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
           "gpu_total": total, "setup_seconds": time.perf_counter() - t_start, "runs": []}
    log(f"{cfg_path.name}: workspace estimate {ws.total / 2**30:.2f} GiB ({ws.describe()}); cache "
        f"{engine.plan.total_bytes / 2**30:.2f} GiB; set up in {row['setup_seconds']:.0f} s ({tmp})")
    rng = random.Random(0)
    for n in [engine.config.max_model_len - 1 if x == "max" else int(x) for x in lengths]:
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
    shutil.rmtree(tmp, ignore_errors=True)
    return row


T0 = time.perf_counter()


def main() -> int:
    unknown = [a for a in sys.argv[1:] if not any(a == f or (f.endswith("=") and a.startswith(f)) for f in FLAGS)]
    if unknown:
        raise SystemExit(f"check_step_memory.py: unknown arguments {unknown}; known: {' '.join(FLAGS)}")
    configs = [Path(p) for p in arg("config", "").split(",") if p] or CONFIGS
    lengths = [x.strip() for x in arg("lengths", "131072,max").split(",")]
    if not all(x == "max" or x.isdigit() for x in lengths):
        raise SystemExit(f"--lengths takes token counts and 'max' (max_model_len - 1), got {lengths}")
    results = {"commit": commit_id(), "date": datetime.date.today().isoformat(),
               "device": torch.cuda.get_device_name(), "rows": []}
    for cfg in configs:
        results["rows"].append(check(cfg, lengths))
        save_results("check_step_memory.json", results)
    bad = [(r["config"], x["prompt_tokens"]) for r in results["rows"] for x in r["runs"]
           if not x["ok"] or x["peak_over_estimate"] > 1.0]
    log(f"{time.perf_counter() - T0:.0f} s in all; " + ("every prompt fit within the estimate" if not bad else
                                                         f"over the estimate or failed: {bad}"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
