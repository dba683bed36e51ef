"""Instructions in the K loop of the MXFP4 expert kernels, from their Hopper (sm_90) compile on this
machine (no GPU: Triton's compiler, the ptxas and nvdisasm it ships). The loops are issue-bound at
decode sizes (benchmarks/RESULTS.md: the integer expansion alone is half the measured time), so the
count per K step is a proxy for their time, which only a GPU run measures (``bench_moe.py``).

Per tile configuration of ``kimik3.ops.triton.moe._tiles`` (rows an expert -> BM, BN, BKH, warps,
stages): the gate/up and down kernels' loop bodies, total and by opcode class; ``--compare FILE``
also compiles the kernels of another copy of ``moe.py`` (e.g. ``git show HEAD~1:kimik3/ops/triton/moe.py``)
for the before / after columns. Run with the Triton the GPU has (3.6: ``pip install --target DIR
triton==3.6.0`` and ``PYTHONPATH=DIR:.``); other versions compile other loops.

    PYTHONPATH=. python benchmarks/kernel_loops.py [--compare OLD_MOE_PY]   (writes $OUT/kernel_loops.json)
    ... --wgmma [--compare OLD_MOE_WGMMA_PY]: ``moe_wgmma``'s kernels at ``moe._wgmma_tiles``'s default tiles
        instead: instructions and barriers of two macro steps, registers (kernel_loops_wgmma.json)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton                                                           # noqa: E402
from triton.backends.compiler import GPUTarget                          # noqa: E402
from triton.compiler import ASTSource                                   # noqa: E402
from triton.tools.disasm import get_sass                                # noqa: E402

from benchmarks.common import commit_id, load_module, log, save_results  # noqa: E402

TYPES = {"x": "*bf16", "h": "*bf16", "y": "*bf16", "sorted_rows": "*i64", "block_expert": "*i64",
         "beta": "fp32", "linear_beta": "fp32", **{f"w{i}{k}": "*u8" for i in (1, 2, 3) for k in "ps"}}
# integer arguments Triton specialises as multiples of 16 at run time (the K3 shapes are)
DIVISIBLE = {"I", "KH", "L", "stride_x", "stride_wp_e", "stride_wp_n", "stride_ws_e", "stride_ws_n", "stride_h",
             "stride_y"}
ROWS_PER_EXPERT = (8, 32, 128, 512)          # K3 slice decode at 32 / 128 tokens, then prefill-sized


def compile_kernel(kernel, constexprs: dict, warps: int, stages: int):
    params = list(kernel.arg_names)
    sig = {p: "constexpr" if p in constexprs else TYPES.get(p, "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if p not in constexprs and (sig[p].startswith("*") or p in DIVISIBLE)}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the K loop)."""
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.match(r"^\S+:$", line) and not line.startswith("Function")}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA (\S+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            best = max(best or (0, 0, 0), (i - labels[m.group(1)], labels[m.group(1)], i))
    _, start, end = best
    return [line.split("\t", 1)[1].strip() for line in lines[start + 1:end + 1] if "\t" in line]


def opcodes(body: list[str]) -> collections.Counter:
    """Instructions of a loop body by opcode (predicate and modifiers dropped)."""
    return collections.Counter(re.sub(r"^@!?U?P\w+ ", "", b).split()[0].rstrip(";").split(".")[0] for b in body)


def count(module, name: str, BM: int, BN: int, BKH: int, warps: int, stages: int) -> dict:
    # the MXFP4 format: FMT 1 (moe.py since the FP8 formats), or an older moe.py's MXFP4 flag (--compare)
    fmt = dict(FMT=1, ACT_Q=False, EMULATE=False) if "FMT" in inspect.signature(module._gate_up_kernel.fn).parameters \
        else {"MXFP4": True}
    common = dict(BM=BM, BN=BN, BKH=BKH, UPCAST=False, ASM=True, HIGH_SCALES=False, ONE_TOKEN=False, PDL=False, **fmt)
    if name == "gate_up":
        k = compile_kernel(module._gate_up_kernel, dict(common, TOP_K=16, ACT_SITU=True, CLIP_UP=True), warps, stages)
    else:
        k = compile_kernel(module._down_kernel, common, warps, stages)
    body = loop_body(get_sass(k.asm["cubin"]))
    return {"instructions": len(body), "by_opcode": dict(opcodes(body).most_common()),
            "convert_layouts": k.asm["ttgir"].count("ttg.convert_layout")}


def compile_wgmma(module, name: str, BT: int, warps: int, two: bool = False, high_scales: bool = False):
    """``moe_wgmma``'s gate/up or down kernel compiled for sm_90 (Gluon; K3's widths and strides as multiples of 16,
    as the run time specialises them)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    kernel = module._gate_up_wgmma_kernel if name == "gate_up" else module._down_wgmma_kernel
    constexprs = dict(BT=BT, HIGH_SCALES=high_scales, WARPS=warps, TWO=two, PDL=True)
    if name == "gate_up":
        constexprs.update(TOP_K=16, ACT_SITU=True, CLIP_UP=True)
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {p: "constexpr" if p in constexprs else dict(TYPES, **{f"w{i}{k}": "*i32" for i in (1, 2, 3) for k in "ps"})
           .get(p, "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if sig[p].startswith("*") or p == "K" or p.startswith("stride")}
    src = GluonASTSource(fn=kernel, signature=sig, attrs=attrs,
                         constexprs={(params.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def count_wgmma(module, name: str, BT: int, warps: int, two: bool = False) -> dict:
    """The K loop (two macro steps: the loop is unrolled by two) of ``moe_wgmma``'s kernels (Gluon)."""
    k = compile_wgmma(module, name, BT, warps, two)
    sass = get_sass(k.asm["cubin"])
    body = loop_body(sass)
    ops = opcodes(body)
    return {"instructions": len(body), "barriers": ops.get("BAR", 0), "by_opcode": dict(ops.most_common()),
            "shared_bytes": k.metadata.shared, "registers": registers(k.asm["ptx"]),
            "local_memory": bool(re.search(r"\b(LDL|STL)\b", sass))}


def registers(ptx: str) -> int:
    """Registers a thread of the kernel takes (ptxas -v of Triton's own ptxas, sm_90a)."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(ptx)
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", str(Path(d, "k.ptx")), "-o",
                              str(Path(d, "k.o"))], capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Used (\d+) registers", out).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", help="another moe.py (with --wgmma: moe_wgmma.py) whose kernels to count beside")
    ap.add_argument("--wgmma", action="store_true", help="moe_wgmma's kernels at their default tiles instead")
    args = ap.parse_args()
    from kimik3.ops.triton import moe
    if args.wgmma:
        from kimik3.ops.triton import moe_wgmma as module
        if not module.GLUON_API:
            raise SystemExit(f"the wgmma kernels are written against Triton 3.6's Gluon; this is {triton.__version__}")
        counter, out = count_wgmma, "kernel_loops_wgmma.json"
        tiles_header, cell_header = "BT, warps, two", "instructions / barriers, two macro steps"
        cases = [(rows, name, (t["BT"], t["warps"], t.get("two", False)))
                 for rows, t in ((r, moe._wgmma_tiles(r)) for r in (0.25, 2, 8, 32))   # 1 / 8 / 32 / 128 tokens
                 for name in ("gate_up", "down")]

        def cell(c):
            return f"{c['instructions']} / {c['barriers']} ({c['registers']} registers)"
    else:
        module, counter, out = moe, count, "kernel_loops.json"
        tiles_header, cell_header = "BM, BN, BKH, warps, stages", "instructions a K step"
        cases = [(rows, name, (t["BM"], BN, t["BKH"], t["warps"], t["stages"]))
                 for rows, t in ((r, moe._tiles(r, True)) for r in ROWS_PER_EXPERT)
                 for name, BN in (("gate_up", t["BN1"]), ("down", t["BN2"]))]

        def cell(c):
            return str(c["instructions"])
    modules = {"this": module, **({"compared": load_module(args.compare)} if args.compare else {})}
    results = {"commit": commit_id(), "date": datetime.date.today().isoformat(), "triton": triton.__version__,
               "target": "sm_90", "rows": []}
    log(f"| rows an expert | kernel | {tiles_header} | " + " | ".join(f"{m}: {cell_header}" for m in modules) + " |")
    log("|---|---|---|" + "---|" * len(modules))
    for rows, name, cfg in cases:
        row = {"rows_per_expert": rows, "kernel": name, "tiles": cfg,
               **{m: counter(mod, name, *cfg) for m, mod in modules.items()}}
        results["rows"].append(row)
        log(f"| {rows} | {name} | {', '.join(map(str, cfg))} | " + " | ".join(cell(row[m]) for m in modules) + " |")
    log(f"# wrote {save_results(out, results)}")


if __name__ == "__main__":
    main()
