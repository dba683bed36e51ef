"""Our Triton kernels compile for Hopper (sm_90) on this CPU machine: Triton's compiler and the
ptxas it ships need no GPU. The interpreter tests (test_triton_kernels.py) run the kernels'
arithmetic but not the compiler, which rejects some programs the interpreter runs (e.g. a
function whose returns differ in type, or inline PTX). The package's conftest turns the
interpreter on, so each compilation runs in a child process without it."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def in_compiler_process(case: str) -> None:
    """Run ``case`` (a function of this module) in a child process with the interpreter off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = f"import tests.ops.test_triton_compile as t\n{case}"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]


def compile_for_hopper(kernel, pointer_types: dict[str, str], constexprs: dict, num_warps=4, num_stages=3,
                       divisible: set[str] | None = None):
    """(In the child process.) Compile ``kernel`` with the given pointer element types; other non-constexpr arguments are i32
    (fp32 where ``pointer_types`` says "fp32"). ``divisible``: integer arguments known to be multiples of 16,
    and then every pointer 16-byte aligned, as Triton specialises them at run time (which lets it pipeline
    loads with cp.async); None compiles the unspecialised variant."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    params = list(inspect.signature(kernel.fn).parameters)
    constexprs = {"PDL": False, **constexprs} if "PDL" in params else constexprs   # launched without PDL unless asked
    defaults = {p.name: p.default for p in inspect.signature(kernel.fn).parameters.values()
                if p.default is not inspect.Parameter.empty}                     # constexprs with defaults, unless given
    constexprs = {**defaults, **constexprs}
    unknown = set(constexprs) - set(params)
    assert not unknown, f"not parameters of {kernel.fn.__name__}: {unknown}"
    sig = {p: "constexpr" if p in constexprs else pointer_types.get(p, "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if divisible is not None and p not in constexprs and (sig[p].startswith("*") or p in divisible)}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if constexprs.get("PDL"):
        options["launch_pdl"] = True
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.parametrize("variants", ["[(True, True, 'bf16'), (True, False, 'bf16')]",
                                      "[(False, False, 'bf16'), (False, False, 'fp16')]"], ids=["mxfp4", "dense"])
def test_moe_kernels_compile_for_hopper(variants):
    in_compiler_process(f"for v in {variants}: t.compile_moe(*v)")


def compile_moe(mxfp4, high_scales, dtype):
    from kimik3.ops.triton import moe
    weight = "*u8" if mxfp4 else f"*{dtype}"
    types = {"x": f"*{dtype}", "h": f"*{dtype}", "y": f"*{dtype}", "sorted_rows": "*i64", "block_expert": "*i64",
             "beta": "fp32", "linear_beta": "fp32", **{f"w{i}{k}": weight for i in (1, 2, 3) for k in "ps"}}
    sizes = {"I", "KH", "L", "stride_x", "stride_wp_e", "stride_wp_n", "stride_ws_e", "stride_ws_n", "stride_h",
             "stride_y"}
    for divisible, one_token in ((None, False), (sizes, False), (sizes, True)):
        common = dict(BM=16, BKH=64, UPCAST=False, FMT=int(mxfp4), ASM=True, HIGH_SCALES=high_scales,
                      ONE_TOKEN=one_token)
        kernels = [compile_for_hopper(moe._gate_up_kernel, types, dict(common, BN=64, TOP_K=8, ACT_SITU=mxfp4,
                                                                       CLIP_UP=mxfp4), divisible=divisible),
                   compile_for_hopper(moe._down_kernel, types, dict(common, BN=128), num_warps=8, divisible=divisible)]
        ptx = [k.asm["ptx"] for k in kernels]
        if divisible:   # with the run time's alignment the K loops stream their tiles by cp.async
            assert all("cp.async.cg" in p or "cp.async.ca" in p for p in ptx)
    if mxfp4:
        compile_for_hopper(moe._dequant_kernel, {"packed": "*u8", "scale": "*u8", "out": "*bf16"},
                           dict(BN=32, BKH=64, ASM=True, HIGH_SCALES=high_scales))
    compile_for_hopper(moe._align_kernel, {"ids": "*i64", "sorted_rows": "*i64", "block_expert": "*i64"},
                       dict(BM=16, BR=256, BE=128, BCAP=2048))
    for has_pos in (False, True):
        compile_for_hopper(moe._combine_kernel, {"y": f"*{dtype}", "weights": "*fp32", "pos": "*i64", "out": f"*{dtype}"},
                           dict(TOP_K=8, BL=1024, HAS_POS=has_pos))


@pytest.mark.parametrize("fmt", ["fp8", "w4a8"])
def test_fp8_expert_kernels_compile_for_hopper(fmt):
    in_compiler_process(f"t.compile_fp8_experts({fmt!r})")


def compile_fp8_experts(fmt):
    """The expert kernels with FP8 products: FP8 experts (E4M3 weights with channel scales) widened for bf16 / fp16
    activations (decode) and, with the activations quantised per 128 columns, on the FP8 tensor cores
    (prefill); MXFP4 experts expanded to E4M3 under MXFP8 activations (W4A8, 32 a K step). At the tiles
    ``moe._fp8_tile_choice`` picks: the quantised forms multiply E4M3 by E4M3 on wgmma (64 / 128-row tiles)
    and stream the weights by cp.async."""
    from kimik3.ops.triton import moe
    weight = "*fp8e4nv" if fmt == "fp8" else "*u8"
    scale = "*fp32" if fmt == "fp8" else "*u8"
    sizes = {"I", "KH", "L", "stride_x", "stride_wp_e", "stride_wp_n", "stride_ws_e", "stride_ws_n", "stride_h",
             "stride_y"}
    cases = [(dtype, None) for dtype in ("bf16", "fp16")] if fmt == "fp8" else []
    cases += [("bf16", moe.FP8_ACT_GROUP if fmt == "fp8" else moe.MX_ACT_GROUP)]
    for dtype, group in cases:
        types = {"x": f"*{dtype}", "h": f"*{dtype}", "y": f"*{dtype}", "sorted_rows": "*i64", "block_expert": "*i64",
                 "beta": "fp32", "linear_beta": "fp32", **{f"w{i}p": weight for i in (1, 2, 3)},
                 **{f"w{i}s": scale for i in (1, 2, 3)}}
        fmt_code = moe.FP8.value if fmt == "fp8" else moe.MXFP4_FP8.value
        for rows in ((2, 200) if group else (2,)):
            cfg = moe._fp8_tile_choice(rows, fmt_code, group, None)
            common = dict(BM=cfg["BM"], BKH=cfg["BKH"], UPCAST=False, FMT=fmt_code, ASM=True, HIGH_SCALES=True,
                          ONE_TOKEN=False, ACT_Q=group is not None, EMULATE=False)
            ptx = [compile_for_hopper(moe._gate_up_kernel, types, dict(common, BN=cfg["BN1"], TOP_K=8, ACT_SITU=True,
                                                                       CLIP_UP=True), cfg["warps"], cfg["stages"],
                                      divisible=sizes).asm["ptx"],
                   compile_for_hopper(moe._down_kernel, types, dict(common, BN=cfg["BN2"]), cfg["warps"], cfg["stages"],
                                      divisible=sizes).asm["ptx"]]
            for p in ptx:
                assert "cp.async" in p, (fmt, dtype, group, rows)
                if group:                    # E4M3 x E4M3 on the tensor cores
                    assert "wgmma" in p and "e4m3" in p, (fmt, dtype, group, rows)


def test_wgmma_expert_kernels_compile_for_hopper():
    """The register-operand MXFP4 expert kernels (Gluon) for every tile ``moe._wgmma_tiles`` picks, both
    dequantizations: the fragment's layout is checked at compile time (``convert_layout(..., assert_trivial)``:
    the expanded bytes are the wgmma operand without data movement), and the loop multiplies with wgmma and
    streams the weights with cp.async. Gluon's API moves between Triton releases; the kernels are written
    against 3.6 (the GPU machines'), so other versions skip (and the engine runs the block kernels there)."""
    from kimik3.ops.triton import moe_wgmma
    if not moe_wgmma.GLUON_API:
        pytest.skip(f"Triton {triton.__version__} lacks the Gluon API of 3.6 the kernels are written against")
    in_compiler_process("t.compile_wgmma_experts()")


def compile_wgmma_experts():
    from benchmarks.kernel_loops import compile_wgmma
    from kimik3.ops.triton import moe, moe_wgmma
    tiles = {(t["BT"], t["warps"], t.get("two", False)) for t in map(moe._wgmma_tiles, (0.25, 2, 8, 32))}
    for (bt, warps, two), high in [(t, h) for t in sorted(tiles) for h in (False, True)]:
        for name in ("gate_up", "down"):
            ptx = compile_wgmma(moe_wgmma, name, bt, warps, two, high).asm["ptx"]
            assert "wgmma.mma_async" in ptx and "cp.async.cg.shared.global" in ptx, name


def test_mla_prefill_kernels_compile_for_hopper():
    in_compiler_process("t.compile_mla_prefill()")


def compile_mla_prefill():
    from kimik3.ops.triton import mla_prefill as m
    types = {p: "*bf16" for p in ("qa_ptr", "qb_ptr", "ka_ptr", "kb_ptr", "v_ptr", "o_ptr")}
    types.update(lse_ptr="*fp32", cu_q="*i32", cu_k="*i32", q_pos0="*i32", k_pos0="*i32", sm_scale_log2="fp32")
    for (da, dv), cfg in m.CONFIGS.items():
        for out in ("*bf16", "*fp32"):                  # one pass, or split-K partials
            compile_for_hopper(m._mla_prefill_kernel, dict(types, o_ptr=out),
                               dict(DA=da, DB=64, DV=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, V_IS_K=da == dv == 512,
                                    UPCAST=False), cfg.num_warps, cfg.num_stages)
    compile_for_hopper(m._merge_splits_kernel, {"part_o": "*fp32", "part_lse": "*fp32", "o_ptr": "*bf16", "lse_ptr": "*fp32"},
                       dict(DV=128, BS=16), num_warps=2, num_stages=1)


def test_mla_decode_kernels_compile_for_hopper():
    in_compiler_process("t.compile_mla_decode()")


def compile_mla_decode():
    from kimik3.ops.triton import mla_decode as m
    types = {"q_lat": "*bf16", "q_pe": "*bf16", "cache": "*bf16", "cache_scale": "*fp32", "block_tables": "*i32",
             "seq_lens": "*i32", "part_o": "*fp32", "part_lse": "*fp32", "sm_scale_log2": "fp32"}
    cases = {(m.config_for(H, block_size, max_len, batch), block_size) for block_size in (16, 4) for H in (96, 32, 8)
             for batch in (1, 8, 32) for max_len in (4096, 1 << 20)}          # every launch the defaults pick
    # an FP8 cache: the transposed and plain gathered launches, and the paged form
    fp8_cases = {(m.config_for(96, 16, 4096, 1), 16), (m.config_for(32, 16, 4096, 32), 16),
                 (m.DecodeConfig(form="paged", bh=16), 16)}
    for (cfg, block_size), fp8 in [(c, False) for c in cases] + [(c, True) for c in fp8_cases]:
        common = dict(BLOCK_SIZE=block_size, BH=cfg.bh, BR=512, BP=64, UPCAST=False, SCALED=fp8)
        tile = block_size if cfg.form == "paged" else cfg.bn
        compile_for_hopper(m._mla_decode_split_kernel, dict(types, cache="*fp8e4nv" if fp8 else "*bf16"),
                           dict(common, BN=tile, BV=cfg.bv or 512, TRANS=cfg.trans, PAGED=cfg.form == "paged"),
                           cfg.num_warps, cfg.num_stages)
    from triton.tools.disasm import get_sass
    merge = compile_for_hopper(m._mla_decode_merge_kernel, {"part_o": "*fp32", "part_lse": "*fp32", "out": "*bf16",
                                                                  "out_lse": "*fp32"},
                               dict(BR=512, BS=m.MERGE_SPLITS, LSE=False), num_warps=4, num_stages=1)
    sass = get_sass(merge.asm["cubin"])
    assert " STL" not in sass and " LDL" not in sass         # the merge's tile stays in registers (no spills)


def test_l2norm_kernel_compiles_for_hopper():
    in_compiler_process("t.compile_l2norm()")


def compile_l2norm():
    from kimik3.ops.triton import l2norm
    for dtype in ("bf16", "fp32"):
        compile_for_hopper(l2norm._l2norm_kernel, {"x": f"*{dtype}", "y": f"*{dtype}", "eps": "fp32"},
                           dict(D=128, BR=32), num_warps=4, num_stages=1)


def test_rms_norm_kernel_compiles_for_hopper():
    in_compiler_process("t.compile_rms_norm()")


def compile_rms_norm():
    from kimik3.ops.triton import norm
    for form, (x, w, y), res, res2 in ((norm.KIMI, ("bf16", "fp32", "bf16"), False, False),
                                       (norm.KIMI, ("bf16", "fp32", "bf16"), True, False),
                                       (norm.KIMI, ("bf16", "bf16", "bf16"), True, True),
                                       (norm.KIMI, ("fp32", "fp32", "bf16"), False, False),
                                       (norm.FP32_WEIGHT, ("fp32", "fp32", "bf16"), False, False),
                                       (norm.GATED, ("fp32", "fp32", "bf16"), False, False)):
        for BD, BR in ((8192, 1), (128, 16)):
            compile_for_hopper(norm._rms_norm_kernel, {"x": f"*{x}", "w": f"*{w}", "g": "*bf16", "r": f"*{x}", "r2": f"*{x}",
                                                       "s": f"*{x}", "y": f"*{y}", "eps": "fp32"},
                               dict(FORM=form, HAS_RES=res, HAS_RES2=res2, BR=BR, BD=BD), num_warps=8 if BD >= 4096 else 4,
                               num_stages=1)
    for w, fp8 in (("bf16", False), ("fp32", False), ("bf16", True)):   # MLA's cache rows (FP8: with their scales)
        compile_for_hopper(norm._cache_latent_kernel, {"x": "*bf16", "w": f"*{w}", "slots": "*i64",
                                                       "cache": "*fp8e4nv" if fp8 else "*bf16", "cache_scale": "*fp32",
                                                       "eps": "fp32"}, dict(BD=512, BP=64, FP8=fp8), num_stages=1)


def test_glu_kernel_compiles_for_hopper():
    in_compiler_process("t.compile_glu()")


def compile_glu():
    from kimik3.ops.triton import activation
    for situ, clip in ((False, False), (True, True), (True, False)):
        compile_for_hopper(activation._glu_kernel, {"g_ptr": "*bf16", "u_ptr": "*bf16", "y_ptr": "*bf16", "beta": "fp32",
                                                    "linear_beta": "fp32"},
                           dict(SITU=situ, CLIP_UP=clip, BR=2, BI=1024), num_warps=4, num_stages=1)


def test_conv_kernels_compile_for_hopper():
    in_compiler_process("t.compile_conv()")


def compile_conv():
    from kimik3.ops.triton import conv
    types = {"x": "*bf16", "weight": "*fp32", "pool": "*bf16", "slots": "*i64", "has_state": "*i32", "cu_seqlens": "*i32",
             "tok_seq": "*i64", "y": "*bf16"}
    for BT, BC, warps in ((16, 128, 4), (64, 256, 8)):
        compile_for_hopper(conv._conv_fwd_kernel, types, dict(W=4, BT=BT, BC=BC), num_warps=warps)
    compile_for_hopper(conv._conv_state_kernel, types, dict(W=4, WP=4, BC=256))
    compile_for_hopper(conv._conv_decode_kernel, types, dict(W=4, WP=4, BC=256))


def test_kda_decode_kernel_compiles_for_hopper():
    in_compiler_process("t.compile_kda_decode()")


def compile_kda_decode():
    from kimik3.ops.triton import kda
    types = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "f": "*bf16", "b": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32",
             "pool": "*fp32", "slots": "*i64", "o": "*bf16", "lower_bound": "fp32", "scale": "fp32"}
    types.update(norm_w="*fp32", gate="*bf16", eps="fp32", f_w="*bf16", gate_w="*bf16")
    for bounded, norm in ((True, False), (False, False), (True, True)):          # the blocks and warps as launched
        BV = kda.default_block_v(128, norm)
        compile_for_hopper(kda._kda_decode_kernel, types, dict(H=32, K=128, V=128, BV=BV, BOUNDED=bounded, NORM=norm,
                                                               PREFETCH=False), num_warps=kda.default_warps(BV, 128))
    # the fused program at its default block and warps, with f and gate read, K3's f_b, Kimi-Linear's f_b and g_b
    # in the kernel (as launched: run-time alignment): no local memory, and at most 128 registers a thread, so
    # two programs share a multiprocessor (one program's loads run while the other computes and stores)
    from benchmarks.kernel_loops import registers
    BV = kda.default_block_v(128, norm=True)
    for f_lr, g_lr in ((False, False), (True, False), (True, True)):
        k = compile_for_hopper(kda._kda_decode_kernel, types, dict(H=32, K=128, V=128, BV=BV, BOUNDED=True, NORM=True,
                                                                   PREFETCH=False, F_LR=f_lr, G_LR=g_lr, R=128),
                               num_warps=kda.default_warps(BV, 128),
                               divisible={"stride_q", "stride_k", "stride_v", "stride_f", "stride_b", "stride_o",
                                          "stride_slot", "stride_gate"})
        assert k.asm["sass"].count("STL") + k.asm["sass"].count("LDL") == 0, (f_lr, g_lr)
        assert registers(k.asm["ptx"]) <= 128, (f_lr, g_lr, registers(k.asm["ptx"]))
    BV = kda.default_block_v(16, True)                                  # the tiny checkpoints' 16-wide heads
    compile_for_hopper(kda._kda_decode_kernel, types, dict(H=4, K=16, V=16, BV=BV, BOUNDED=False, NORM=True,
                                                           PREFETCH=False, F_LR=True, G_LR=True, R=16, RC=16),
                       num_warps=kda.default_warps(BV, 16))
    for K in (128, 4):                  # under PDL: the state rows asked of L2 before the wait (none under 32 values)
        body = compile_for_hopper(kda._kda_decode_kernel, types, dict(H=2, K=K, V=K, BV=K, BOUNDED=True, NORM=True,
                                                                      PREFETCH=True, PDL=True), num_warps=8).asm["ptx"]
        body = body[body.index(".entry"):]
        assert ("prefetch.global.L2" in body) == (K == 128)
        if K == 128:
            assert body.index("prefetch.global.L2") < body.index("griddepcontrol.wait")


def test_rope_kernel_compiles_for_hopper():
    in_compiler_process("t.compile_rope()")


def compile_rope():
    from kimik3.ops.triton import rope
    for dtype in ("bf16", "fp32"):
        compile_for_hopper(rope._rotate_pairs_kernel, {"x": f"*{dtype}", "c": "*fp32", "s": "*fp32", "y": f"*{dtype}"},
                           dict(HALF=64, BR=64, BH=64), num_warps=4, num_stages=1)


def test_attn_res_kernel_compiles_for_hopper():
    in_compiler_process("t.compile_attn_res()")


def compile_attn_res():
    from kimik3.ops.triton import attn_res
    for norm, out in ((attn_res.NO_NORM, "fp32"), (attn_res.KIMI_NORM, "bf16"), (attn_res.FP32_WEIGHT_NORM, "bf16")):
        compile_for_hopper(attn_res._attn_res_kernel, {"src": "*bf16", "g": "*bf16", "p": "*bf16", "cw": "*fp32",
                                                       "out": f"*{out}", "eps": "fp32", "norm_eps": "fp32"},
                           dict(N_SRC=5, BD=8192, NORM=norm), num_warps=8, num_stages=1)


def test_router_logits_gemm_kernel_compiles_to_wgmma():
    in_compiler_process("t.compile_router_gemm()")


def compile_router_gemm():
    """fp32 weight: TF32 wgmma (x3); the checkpoint's bf16 weight: bf16 wgmma with fp32 accumulation
    at each of ``gemm_tiles``' tiles (a 64-token tile still a wgmma), and bf16 tensor-core products at each
    of ``split_tiles``' decode tiles (16-32 token tiles: mma.sync)."""
    from kimik3.ops.triton import router
    sizes = {"D", "E", "KS", "stride_xt", "stride_we"}
    k = compile_for_hopper(router._logits_gemm_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32"},
                           dict(BM=128, BN=64, BK=32, WIDE_W=True, UPCAST=False), divisible=sizes)
    assert "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32" in k.asm["ptx"]
    for BM, BN, BK, warps in ((64, 16, 128, 4), (64, 64, 64, 4), (128, 128, 64, 8)):      # gemm_tiles' choices
        k = compile_for_hopper(router._logits_gemm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32"},
                               dict(BM=BM, BN=BN, BK=BK, WIDE_W=False, UPCAST=False), num_warps=warps, divisible=sizes)
        assert f"wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.bf16.bf16" in k.asm["ptx"], (BM, BN, BK)
    from kimik3.ops.triton.router import split_tiles
    shapes = {split_tiles(T, E, D)[:4] for T in (8, 16, 32, 128, 256) for E, D in ((64, 7168), (256, 2304), (896, 7168))}
    for BM, BN, BK, warps in sorted(shapes):         # split-K decode tiles: bf16 tensor-core products either way
        k = compile_for_hopper(router._logits_gemm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32"},
                               dict(BM=BM, BN=BN, BK=BK, WIDE_W=False, UPCAST=False), num_warps=warps, divisible=sizes)
        ptx = k.asm["ptx"]
        assert "wgmma.mma_async.sync.aligned" in ptx or "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16" in ptx, \
            (BM, BN, BK)


def test_every_kernel_waits_first_under_pdl():
    in_compiler_process("t.compile_with_pdl()")


def compile_with_pdl():
    """Every kernel of ours takes ``PDL``; compiled with it the PTX waits on the previous grid
    (griddepcontrol.wait) before its first global load and then lets the next one launch; without it,
    neither instruction is there."""
    import re

    from kimik3.ops.triton import moe, norm, router
    kernels = [k for mod in _kernel_modules() for k in vars(mod).values()
               if isinstance(k, triton.runtime.JITFunction) and "PDL" in inspect.signature(k.fn).parameters]
    assert len(kernels) >= 20, [k.fn.__name__ for k in kernels]
    from kimik3.ops.triton import moe_wgmma        # its Gluon kernels are launched from moe
    for mod in _kernel_modules():          # every launch of a kernel passes pdl(...)
        src = inspect.getsource(mod)
        launched = re.findall(r"(_\w+_kernel)\[", src)
        assert all("PDL" in inspect.signature((getattr(mod, name, None) or getattr(moe_wgmma, name)).fn).parameters
                   for name in launched), mod.__name__
        assert len(launched) == src.count("**pdl("), mod.__name__
    cases = [(norm._rms_norm_kernel, {"x": "*bf16", "w": "*bf16", "g": "*bf16", "r": "*bf16", "r2": "*bf16", "s": "*bf16",
                                      "y": "*bf16", "eps": "fp32"}, dict(FORM=0, HAS_RES=True, HAS_RES2=True, BR=1, BD=4096)),
             (router._route_kernel, {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                                     "scaling": "fp32", "eps": "fp32"},
              dict(HAS_BIAS=True, SIGMOID=True, RENORM=True, TOP_K=8, BLOCK_K=8, GROUPS=1, TOPK_GROUP=1, BLOCK_G=1,
                   BLOCK_E=256, SPLITS=4)),
             (moe._combine_kernel, {"y": "*bf16", "weights": "*fp32", "pos": "*i64", "out": "*bf16"},
              dict(TOP_K=8, BL=1024, HAS_POS=False))]
    for kernel, types, constexprs in cases:
        for on in (False, True):
            ptx = compile_for_hopper(kernel, types, dict(constexprs, PDL=on)).asm["ptx"]
            body = ptx[ptx.index(".entry"):]
            if on:
                wait, launch = body.index("griddepcontrol.wait"), body.index("griddepcontrol.launch_dependents")
                assert wait < launch < body.index("ld.global"), kernel.fn.__name__
            else:
                assert "griddepcontrol" not in body, kernel.fn.__name__


def _kernel_modules():
    from kimik3.ops.triton import (activation, attn_res, conv, kda, l2norm, mla_decode, mla_prefill, moe, moe_wgmma,
                                   norm, rope, router)
    return [activation, attn_res, conv, kda, l2norm, mla_decode, mla_prefill, moe, moe_wgmma, norm, rope, router]


def test_gemv_kernel_compiles_for_hopper():
    in_compiler_process("t.compile_gemv()")


def compile_gemv():
    """The decode projection kernel at 1-8 rows, even and masked, with the K loop pipelined
    (cp.async needs the run time's 16-byte alignment specialisation, as launched); one token's experts:
    the gate/up rows located by expert id, and the down-and-combine kernel's inner K loop."""
    from kimik3.ops.triton import gemv
    types = {"x": "*bf16", "w": "*bf16", "w_up": "*bf16", "y": "*bf16", "ids": "*i64", "beta": "fp32",
             "linear_beta": "fp32"}
    for BM, even, act, experts in ((1, True, None, False), (8, False, None, False), (1, True, "silu", False),
                                   (2, False, "situ", False), (1, True, "silu", True), (1, False, "situ", True)):
        consts = dict(BM=BM, BN=8, BK=512 // BM, EVEN=even, GLU=act is not None, SITU=act == "situ",
                      CLIP_UP=act == "situ", EXPERTS=experts, STAGES=3, PREFETCH=0)
        k = compile_for_hopper(gemv._gemv_kernel, types, consts, divisible={"K", "stride_x", "stride_w", "stride_we"})
        assert "cp.async" in k.asm["ptx"], f"BM={BM} {act} experts={experts}: the weight loads are not pipelined"
    k = compile_for_hopper(gemv._gemv_kernel, dict(types, y="*fp32"),                 # the LM head's fp32 logits
                           dict(BM=1, BN=8, BK=512, EVEN=True, GLU=False, SITU=False, CLIP_UP=False, EXPERTS=False,
                                STAGES=3, PREFETCH=0), divisible={"K", "stride_x", "stride_w", "stride_we"})
    assert "cp.async" in k.asm["ptx"]
    for act in (None, "silu"):          # under PDL: the weight rows' first K step asked of L2 before the wait
        k = compile_for_hopper(gemv._gemv_kernel, types, dict(BM=1, BN=8, BK=512, EVEN=True, GLU=act is not None,
                                                              SITU=False, CLIP_UP=False, EXPERTS=False, STAGES=3,
                                                              PREFETCH=8, PDL=True),
                               divisible={"K", "stride_x", "stride_w", "stride_we"})
        body = k.asm["ptx"][k.asm["ptx"].index(".entry"):]
        assert body.count("prefetch.global.L2") >= (2 if act else 1), act
        assert body.index("prefetch.global.L2") < body.index("griddepcontrol.wait"), act
    for even in (True, False):
        k = compile_for_hopper(gemv._gemv_combine_kernel, {"h": "*bf16", "w": "*bf16", "ids": "*i64", "weights": "*fp32",
                                                           "y": "*bf16"},
                               dict(TOP_K=8, BN=4, BK=512, EVEN=even, STAGES=3), divisible={"K", "stride_h", "stride_w",
                                                                                          "stride_we"})
        assert "cp.async" in k.asm["ptx"], f"even={even}: the down-projection loads are not pipelined"
    # the default down-and-combine launch at Kimi-Linear's shapes (combine_config: 8 experts x 2 K steps unrolled,
    # 8 warps): straight-line loads, no loop left
    k = compile_for_hopper(gemv._gemv_combine_kernel, {"h": "*bf16", "w": "*bf16", "ids": "*i64", "weights": "*fp32",
                                                       "y": "*bf16"},
                           dict(TOP_K=8, BN=4, BK=512, EVEN=True, **gemv.combine_config(2304, 1024).loop(1024)),
                           divisible={"K", "stride_h", "stride_w", "stride_we"}, num_warps=8)
    body = k.asm["ptx"][k.asm["ptx"].index(".entry"):]
    assert body.count("ld.global") >= 8 * 2 and "bra" not in body.replace("bra.uni", ""), "down-and-combine not unrolled"

def test_fp8_matmul_kernel_compiles_for_hopper():
    in_compiler_process("t.compile_fp8_matmul()")


def compile_fp8_matmul():
    """FP8 weights: the decode form (bf16 activations, the weight widened) and the prefill form (E4M3 x E4M3 on
    the FP8 tensor cores), per-channel and 128 x 128 block scales, at their default tiles."""
    from kimik3.ops.triton import fp8_linear as m
    for quant_a, blocked in ((False, False), (False, True), (True, True), (True, False)):
        t = m.tiles_for(1 if not quant_a else 4096, quant_a)
        k = compile_for_hopper(m._fp8_matmul_kernel, {"a": "*fp8e4nv" if quant_a else "*bf16", "sa": "*fp32",
                                                      "b": "*fp8e4nv", "sb": "*fp32", "c": "*bf16"},
                               dict(BM=t.bm, BN=t.bn, BK=t.bk, QUANT_A=quant_a, BLOCKED=blocked, UPCAST=False),
                               t.num_warps, t.num_stages, divisible={"K", "stride_am", "stride_bn", "stride_cm"})
        if quant_a:                      # both operands E4M3 on the tensor cores
            assert "wgmma" in k.asm["ptx"] and "e4m3" in k.asm["ptx"]
