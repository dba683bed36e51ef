"""Where a decode step's device time goes, by module and op: one eager step of a slice under
torch.profiler with every module's forward as a named range, each kernel charged to the innermost
module that launched it (Triton's kernels through Triton's launch hook: the profiler links them to no
CPU op). Beside it the step as a CUDA graph, its floor (bytes at the copy rate), and
the kernel count, so the overhead of small launches can be read off (#13, #18).

    PYTHONPATH=. python benchmarks/gpu/profile_step.py [--config=PATH] [--batches=1,32] [--prefill=8192] [--pdl]
    (writes $OUT/profile_step_<config>.json; --prefill adds one fresh prompt of that many tokens, eager)

The profiled step launches our kernels without programmatic dependent launch unless ``--pdl``: under PDL a kernel
starts before its predecessor ends and waits inside, so its measured duration holds part of the kernel before it
(the seventeenth to nineteenth sessions' profiles, taken under PDL, summed to more than the graph's time). The
step's graph time beside it is with PDL, as the engine runs.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, copy_rate, cuda_time, log, save_results  # noqa: E402
from benchmarks.gpu import bench_slice  # noqa: E402
from kimik3.ops.options import kernel_options, use_kernel_options  # noqa: E402


def module_ranges(model, labels: list[str]):
    """Forward hooks that open a profiler range per module call ("mod:<path>", layer index -> kind) and
    keep ``labels`` as the stack of the modules being run."""
    from torch.autograd.profiler import record_function
    stack, handles = [], []
    kinds = {i: ("kda" if layer.is_kda else "mla") for i, layer in enumerate(model.model.layers)}
    for name, m in model.named_modules():
        label = re.sub(r"layers\.(\d+)", lambda g: f"layers.{kinds[int(g.group(1))]}", name) or "(root)"

        def pre(_m, _a, label=label):
            rf = record_function("mod:" + label)
            rf.__enter__()
            stack.append(rf)
            labels.append(label)

        def post(_m, _a, _o):
            stack.pop().__exit__(None, None, None)
            labels.pop()
        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    return handles


def record_triton_launches(labels: list[str]):
    """Triton's launch hook noting (kernel name -> innermost module, in launch order) for every launch
    (Triton and fla kernels go through the driver, so the profiler links them to no CPU op). Returns the
    record and an undo; both empty-handed (nothing recorded) where this Triton has no such hook."""
    launches = collections.defaultdict(collections.deque)

    def enter(metadata):
        try:
            launches[metadata.data["name"]].append(labels[-1] if labels else "(outside)")
        except Exception:            # a Triton whose metadata differs: those kernels stay "(driver launch)"
            pass
    try:
        from triton import knobs
        hook = knobs.runtime.launch_enter_hook
        if hasattr(hook, "add"):                       # a chain of hooks (newer Triton)
            hook.add(enter)
            return launches, lambda: hook.remove(enter)
        if hook is None:                               # one hook slot (older Triton)
            knobs.runtime.launch_enter_hook = enter
            return launches, lambda: setattr(knobs.runtime, "launch_enter_hook", None)
    except Exception as exc:
        log(f"  no Triton launch hook ({exc!r}): Triton kernels charged to '(driver launch)'")
    return launches, lambda: None


def charge(prof, launches) -> list[dict]:
    """Rows (module, op, kernel) -> count and device us, from the profiler's CPU events; the kernels that
    ``launches`` saw (Triton's, in launch order per name) charged to the module that launched them."""
    from torch.autograd import DeviceType
    rows = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if not e.kernels:
            continue
        p, mod = e, "(outside)"
        while p is not None:
            if p.name.startswith("mod:"):
                mod = p.name[4:]
                break
            p = p.cpu_parent
        op = e.name if not e.name.startswith("mod:") else "(launch)"
        for k in e.kernels:
            if k.name in launches:
                continue
            r = rows[(mod, op, k.name[:70])]
            r[0] += 1
            r[1] += k.duration
    device = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith("mod:")),
                    key=lambda e: e.time_range.start)           # not the ranges' GPU spans; one stream: launch order
    # the other kernels launched through the driver (fla's, when Triton has no hook) link to no CPU op: by name
    unlinked = collections.defaultdict(lambda: [0, 0.0])
    for e in device:
        t = e.time_range.end - e.time_range.start
        if e.name in launches:
            queue = launches[e.name]
            r = rows[(queue.popleft() if queue else "(driver launch)", "triton", e.name[:70])]
            r[0] += 1
            r[1] += t
        else:
            unlinked[e.name[:70]][0] += 1
            unlinked[e.name[:70]][1] += t
    linked = collections.defaultdict(lambda: [0, 0.0])
    for (_, _, k), (c, t) in rows.items():
        linked[k][0] += c
        linked[k][1] += t
    for k, (c, t) in unlinked.items():
        if c > linked[k][0]:
            rows[("(driver launch)", "-", k)] = [c - linked[k][0], t - linked[k][1]]
    return sorted(({"module": m, "op": o, "kernel": k, "count": c, "us": round(t, 2)}
                   for (m, o, k), (c, t) in rows.items()), key=lambda r: -r["us"])


def profiled(model, fn) -> tuple[list[dict], collections.Counter]:
    """One run of ``fn`` under the profiler with module ranges: (rows, device us by module)."""
    from torch.profiler import ProfilerActivity, profile
    labels: list[str] = []
    handles = module_ranges(model, labels)
    scope = use_kernel_options(dataclasses.replace(kernel_options(), pdl=kernel_options().pdl and "--pdl" in sys.argv))
    scope.__enter__()
    undo = lambda: None                                                      # noqa: E731
    try:
        fn()                              # the kernel variants of this setting compile outside the profile
        torch.cuda.synchronize()
        launches, undo = record_triton_launches(labels)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    finally:
        scope.__exit__(None, None, None)
        undo()
        for h in handles:
            h.remove()
    rows = charge(prof, launches)
    by_module = collections.Counter()
    for r in rows:
        by_module[r["module"]] += r["us"]
    return rows, by_module


def main():
    cfg_path = bench_slice.config_path()
    batches = [int(b) for b in next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--batches=")),
                                    "1,32").split(",")]
    results = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
               "commit": commit_id(), "torch": torch.__version__, "config": cfg_path.name,
               "pdl_in_profile": kernel_options().pdl and "--pdl" in sys.argv, "cases": []}
    name = f"profile_step_{cfg_path.stem.split('.')[0]}.json"
    bw = copy_rate()
    model = bench_slice.build_slice(__import__("json").loads(cfg_path.read_text()), str(cfg_path))
    for N in batches:
        cache, batch, ids = bench_slice.decode_setup(model, N)
        fn = bench_slice.step_fn(model, ids, batch, cache)
        t_eager = cuda_time(fn, iters=10)
        model.use_side_stream(torch.cuda.Stream())
        t_graph = bench_slice.graph_time(fn)
        model.use_side_stream(None)
        active = bench_slice.touched_experts(fn)
        byts, _ = bench_slice.counts(model, N, 0, "decode", active)
        rows, by_module = profiled(model, fn)
        total = sum(r["us"] for r in rows)
        kernels = sum(r["count"] for r in rows)
        case = {"batch": N, "t_eager_ms": t_eager * 1e3, "t_graph_ms": t_graph and t_graph * 1e3,
                "floor_ms": byts / bw * 1e3, "kernel_us": round(total, 1), "kernels": kernels,
                "small_kernels": sum(r["count"] for r in rows if r["us"] / r["count"] < 4.0),
                "small_kernel_us": round(sum(r["us"] for r in rows if r["us"] / r["count"] < 4.0), 1),
                "by_module": {m: round(t, 1) for m, t in by_module.most_common()}, "rows": rows}
        results["cases"].append(case)
        log(f"# batch {N}: graph {case['t_graph_ms']:.3f} ms, floor {case['floor_ms']:.3f} ms, kernels "
            f"{kernels} summing to {total:.0f} us ({case['small_kernels']} under 4 us: {case['small_kernel_us']:.0f} us)")
        for m, t in by_module.most_common():
            log(f"#   {t:8.1f} us  {m}")
        for r in rows[:60]:
            log(f"  {r['us']:8.1f} us {r['count']:4d}x  {r['module'][:40]:40s} {r['op'][:28]:28s} {r['kernel']}")
        save_results(name, results)
        del cache, batch
        torch.cuda.empty_cache()
    prefill = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--prefill=")), None)
    if prefill:
        from kimik3.model.batch import ForwardBatch, HybridCache
        cfg = model.config.text
        B = bench_slice.BLOCK
        cache = HybridCache.allocate(cfg, num_slots=2, num_blocks=prefill // B + 1, block_size=B,
                                     dtype=torch.bfloat16, device="cuda")
        batch = ForwardBatch.build([prefill], [0], [1], [list(range(1, prefill // B + 1))], B, device="cuda")
        ids = torch.randint(0, cfg.vocab_size, (prefill,), device="cuda")
        fn = bench_slice.step_fn(model, ids, batch, cache, last_only=True)
        t = cuda_time(fn, warmup=2, iters=5)
        rows, by_module = profiled(model, fn)
        results["prefill"] = {"tokens": prefill, "t_eager_ms": t * 1e3, "by_module": dict(by_module.most_common()),
                              "rows": rows}
        log(f"# prefill {prefill}: {t * 1e3:.2f} ms eager")
        for m, us in by_module.most_common(25):
            log(f"#   {us:9.1f} us  {m}")
        for r in rows[:40]:
            log(f"  {r['us']:9.1f} us {r['count']:4d}x  {r['module'][:40]:40s} {r['op'][:28]:28s} {r['kernel']}")
        save_results(name, results)


if __name__ == "__main__":
    main()
