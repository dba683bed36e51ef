#!/usr/bin/env bash
# One device call: the GPU test files side by side (correctness only, so they may share the GPU), then
# the timing benchmarks one at a time, each under its own time limit; logs into $OUT/logs.tgz.
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#     PYTHONPATH=/tmp/site:$PWD KIMIK3_COMMIT=<commit> bash benchmarks/gpu/device_call.sh [tests] [benches] [serve]
#
# Sections (default: tests benches serve, in this order): tests = tests/gpu/*.py in parallel (or the
# files / node ids in TESTS; PER_TEST: pytest's per-test limit; FILE_CAP: each file's); benches = the constrained decode step
# (#19) sync and async; trace = its device time per step at batch 32 (torch.profiler); serve = served vs
# offline (#18 item 5) sync and async; slice = bench_slice.py on both slices (no reference, no checks; SLICES=kl or k3
# for one, SLICE_ARGS=--pdl-ab adds each case without programmatic dependent launch); profile = one decode step's kernels by module (profile_step.py; PROFILE_PREFILL=8192 adds a prefill); mladecode = the MLA decode config sweep (first, alone on the GPU; MLA_SWEEP= for the defaults only); decodeops = bench_decode_ops.py (KDA step, conv decode); vision = bench_vision.py (the tower eager vs graphs); moe = bench_moe.py --decode-only (expert kernels at 1-128 tokens; MOE_ARGS=--compare=FILE adds another moe.py's kernels); moeprefill = bench_moe.py --prefill-only; moefp8 = bench_moe_fp8.py (FP8 experts and W4A8 against the bf16 paths; MOE_FP8_ARGS=--skip-k3 / --skip-kimi-linear); router = bench_router_align.py (ROUTER_ARGS=--split-only: the split-K routing alone); long = the decode graph replayed at 8k-1M contexts; stacks = the same, with stack samples per pass; spec = n-gram speculation vs plain at batch 1 (SPEC_ASYNC=1: also both async; =only: async alone); engine =
# bench_engine.py (host share); hostprof = cProfile of the constrained async step at batch 32; userpath = #57's
# checks: the KDA checkpoint GPU test, kda_checkpoints.py before/after (--legacy), bench_user_path.py's Kimi-Linear
# prefill A/B and the K3 slice's decode through LLM at batch 1 / 32 / 64 / 128 (max_num_seqs 128).
# FLASH=1: name the carried FlashMLA / FlashKDA libraries (.whl/libkimik3_flash_{mla,kda}.so, built here by
# kimik3 build-kernels) for every section; full = the whole Kimi-Linear-48B (bench_full_model.py, needs an
# H200; FULL_ARGS: its flags, e.g. --layers=14 on an 80 GB GPU); flashops = bench_flash_mla.py and bench_kda_prefill.py
# (FLASH=1); gemv = bench_gemv.py --experts (one token's expert launches; GEMV_ARGS replaces the flags);
# draftgraphs = the draft-graph GPU tests, bench_draft_graphs.py and bench_spec.py --eager-draft-engine (#55);
# spec_slice = bench_spec_slice.py: plain, draft (Eagle3; MTP on K3) and verify steps vs floor on both slices (#55;
# SPEC_SLICE_ARGS: its flags, e.g. --k=3 or --no-mtp).
# A fresh machine spends its first 90-110 s compiling kernels; the parallel tests pay that once each.
set -u
START=$(date +%s)
BUDGET=${BUDGET:-560}                     # seconds this script may run (the device allows 600 per call)
L=/tmp/logs; mkdir -p "$L"
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
sections=${*:-tests benches serve}
if [ "${FLASH:-}" = 1 ]; then
  export KIMIK3_FLASH_MLA=$PWD/.whl/libkimik3_flash_mla.so KIMIK3_FLASH_KDA=$PWD/.whl/libkimik3_flash_kda.so
  BLOCK_ARG=--block-size=64
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$L/gpu.txt" 2>&1
if ! python3 -c "import fastapi, uvicorn, prometheus_client" 2>/dev/null && ls .whl/serve/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/serve/*.whl
fi

run() {  # name cap command...: run with a limit of min(cap, time left - 10 s)
  local name=$1 cap=$2; shift 2
  local t=$(( $(left) - 10 )); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 20 ]; then echo "skip $name (time)"; return; fi
  timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - START )) s"
}

if [[ " $sections " == *" full "* ]]; then            # the whole Kimi-Linear-48B through LLMEngine (#13; ~92 GiB)
  run full 300 python3 benchmarks/gpu/bench_full_model.py ${FULL_ARGS:-}     # FULL_ARGS=--async-scheduling
  cp bench_out/bench_full_kimi_linear*.json "$L"/ 2>/dev/null
  grep -hE "decode|prefill|peak|plan" "$L"/full.log | tail -12
fi
if [[ " $sections " == *" flashops "* ]]; then        # FlashMLA decode and FlashKDA prefill against our kernels (FLASH=1)
  run flash_mla 150 python3 benchmarks/gpu/bench_flash_mla.py
  run kda_prefill 150 python3 benchmarks/gpu/bench_kda_prefill.py
  cp bench_out/bench_flash_mla.json bench_out/bench_kda_prefill.json "$L"/ 2>/dev/null
  grep -h "^|" "$L"/flash_mla.log "$L"/kda_prefill.log
fi
if [[ " $sections " == *" mladecode "* ]]; then       # MLA decode launch configs (#14, #18), before the tests share the GPU
  run mla_decode_sweep 300 python3 benchmarks/gpu/bench_mla_prefill.py --decode-only ${MLA_SWEEP---decode-sweep} \
      --decode-cases ${MLA_CASES:-96/1/32768 96/1/131072 96/1/1048576 96/128/4096 32/1/1048576 32/8/131072} \
      --out "$L/mla_decode_sweep.json"
  grep -h "decode best" "$L"/mla_decode_sweep.log
fi
if [[ " $sections " == *" decodeops "* ]]; then       # KDA step and conv decode kernels vs fla / the general pair
  run decode_ops 200 python3 benchmarks/gpu/bench_decode_ops.py
  cp bench_out/bench_decode_ops.json "$L"/ 2>/dev/null
  grep -h "^|" "$L"/decode_ops.log
fi
if [[ " $sections " == *" moe "* ]]; then             # expert kernels at decode sizes, the default tiles (#18, #13)
  run moe 300 python3 benchmarks/gpu/bench_moe.py --decode-only --no-model ${MOE_ARGS:-}
  cp bench_out/bench_moe.json "$L"/ 2>/dev/null
  grep -h "^T=\|^dense" "$L"/moe.log | sort -t' ' -k1,1 | head -120
fi
if [[ " $sections " == *" gemv "* ]]; then            # one token's expert launches swept (GEMV_ARGS: e.g. --sweep --rows=1 instead)
  run gemv 200 python3 benchmarks/gpu/bench_gemv.py ${GEMV_ARGS:---experts}
  cp bench_out/bench_gemv*.json "$L"/ 2>/dev/null
  grep -h "^[|#]" "$L"/gemv.log | head -80
fi
if [[ " $sections " == *" moeprefill "* ]]; then      # MXFP4 experts at 512-8192 tokens: fused kernels vs dequantize + grouped GEMMs
  run moe_prefill 200 python3 benchmarks/gpu/bench_moe.py --prefill-only
  grep -h "^|" "$L"/moe_prefill.log
fi
if [[ " $sections " == *" moefp8 "* ]]; then          # FP8 experts (Kimi-Linear, -q fp8) and W4A8 (K3) vs the bf16 paths
  run moe_fp8 400 python3 benchmarks/gpu/bench_moe_fp8.py ${MOE_FP8_ARGS:-}
  cp bench_out/bench_moe_fp8.json "$L"/ 2>/dev/null
  grep -h "case" "$L"/moe_fp8.log | head -60
fi
if [[ " $sections " == *" router "* ]]; then          # router logits (decode kernel, prefill TF32x3 GEMM) and the align
  run router 150 python3 benchmarks/gpu/bench_router_align.py ${ROUTER_ARGS:-}
  cp bench_out/bench_router_align.json "$L"/ 2>/dev/null
  grep -h "^|" "$L"/router.log
fi
if [[ " $sections " == *" vision "* ]]; then          # the K3 vision tower: eager vs its CUDA graphs per image size (#18)
  run vision 240 python3 benchmarks/gpu/bench_vision.py
  cp bench_out/bench_vision.json "$L"/ 2>/dev/null
  grep -h "^[|#]" "$L"/vision.log
fi
if [[ " $sections " == *" profile "* ]]; then         # one eager decode step by module and op, both slices (#13, #18)
  run profile_kl 150 python3 benchmarks/gpu/profile_step.py --config=benchmarks/gpu/kimi-linear-slice4.config.json \
      --batches=${PROFILE_BATCHES:-1,32} ${PROFILE_PREFILL:+--prefill=$PROFILE_PREFILL}
  run profile_k3 150 python3 benchmarks/gpu/profile_step.py --batches=${PROFILE_BATCHES:-1,32,128} \
      ${PROFILE_PREFILL:+--prefill=$PROFILE_PREFILL}
  grep -h "^#" "$L"/profile_*.log
fi
if [[ " $sections " == *" slice "* ]]; then           # bench_slice: decode b1-128 and prefill vs floor (SLICES: kl k3)
  [[ " ${SLICES:-kl k3} " == *" kl "* ]] && run slice_kl 200 python3 benchmarks/gpu/bench_slice.py \
      --config=benchmarks/gpu/kimi-linear-slice4.config.json --skip-checks --no-ref --no-experts ${SLICE_ARGS:-}
  [[ " ${SLICES:-kl k3} " == *" k3 "* ]] && run slice_k3 200 python3 benchmarks/gpu/bench_slice.py --skip-checks --no-ref \
      ${SLICE_ARGS:-}
  cp bench_out/bench_slice*.json "$L"/ 2>/dev/null
  grep -h "^|" "$L"/slice_*.log
fi
if [[ " $sections " == *" long "* ]]; then            # the batch-1 decode graph at 8k-1M contexts, both slices (#14)
  run long_replay_k3 240 python3 benchmarks/gpu/bench_long_context.py --replay-only ${BLOCK_ARG:-}
  run long_replay_kl 200 python3 benchmarks/gpu/bench_long_context.py --replay-only ${BLOCK_ARG:-} \
      --config=benchmarks/gpu/kimi-linear-slice4.config.json
  grep -h "^|" "$L"/long_replay_*.log
fi
if [[ " $sections " == *" tests "* ]]; then
  export KIMIK3_INSTAFAIL=1                           # failures are logged as they happen (tests/conftest.py)
  for f in ${TESTS:-tests/gpu/test_*.py}; do         # TESTS: test files or node ids, each its own process
    n=$(basename "${f%%::*}" .py); [[ "$f" == *::* ]] && n="$n-${f##*::}"   # node ids of one file: one log each
    run "$n" "${FILE_CAP:-400}" python3 -m pytest -v -p no:cacheprovider --timeout="${PER_TEST:-380}" --durations=0 -rA "$f" &
  done
  wait
  grep -hE "^(PASSED|FAILED|ERROR) " "$L"/test_*.log | cut -c1-300
fi
if [[ " $sections " == *" benches "* ]]; then
  run structured_sync 150 python3 benchmarks/structured.py engine --slice --device cuda --no-enforce-eager --profile
  run structured_async 150 python3 benchmarks/structured.py engine --slice --device cuda --no-enforce-eager \
      --async-scheduling --profile
  grep -h "^|" "$L"/structured_*.log
fi
if [[ " $sections " == *" trace "* ]]; then           # device time per step, constrained vs not, async
  run structured_trace 150 python3 benchmarks/structured.py engine --slice --device cuda --no-enforce-eager \
      --async-scheduling --profile --trace 32
  grep -hE "^(\||#   (batch|trace)|#     )" "$L"/structured_trace.log
fi
if [[ " $sections " == *" serve "* ]]; then
  run serve_sync 150 python3 benchmarks/serve_vs_offline.py --slice --device cuda
  run serve_async 150 python3 benchmarks/serve_vs_offline.py --slice --device cuda --async-scheduling
  grep -hE "^(#|\||offline)" "$L"/serve_*.log
fi
if [[ " $sections " == *" stacks "* ]]; then          # served, async then sync, with the engine's stacks sampled
  run serve_stacks_async 200 python3 benchmarks/serve_vs_offline.py --slice --device cuda --async-scheduling --sample-stacks 12
  run serve_stacks_sync 200 python3 benchmarks/serve_vs_offline.py --slice --device cuda --sample-stacks 12
  grep -hE "^(#|\||offline)" "$L"/serve_stacks_*.log | cut -c1-260
fi
if [[ " $sections " == *" spec "* ]]; then            # n-gram speculation vs plain at batch 1 (#18)
  [ "${SPEC_ASYNC:-}" != only ] && run bench_speculative 240 python3 benchmarks/gpu/bench_speculative.py --profile
  [ -n "${SPEC_ASYNC:-}" ] && run bench_speculative_async 240 python3 benchmarks/gpu/bench_speculative.py --async-scheduling
  grep -h "^|" "$L"/bench_speculative*.log
fi
if [[ " $sections " == *" draftgraphs "* ]]; then     # #55 item 5: the draft's own steps as CUDA graphs
  run draft_graphs_test 200 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_draft_graphs_gpu.py
  run bench_draft_graphs 120 python3 benchmarks/gpu/bench_draft_graphs.py
  run bench_spec_graphs 200 python3 benchmarks/bench_spec.py --device cuda --dtype bfloat16 --eager-draft-engine \
      --out "$L"/bench_spec_graphs.json
  grep -hE "passed|failed|eager_us|graphs_vs_eager|^ +(heldout|random)" "$L"/draft_graphs_test.log \
      "$L"/bench_draft_graphs.log "$L"/bench_spec_graphs.log | cut -c1-260
fi
if [[ " $sections " == *" spec_slice "* ]]; then     # #55: draft + verify steps against their floors, both slices
  run spec_slice 240 python3 benchmarks/gpu/bench_spec_slice.py ${SPEC_SLICE_ARGS:-}
  cp bench_out/bench_spec_slice.json "$L"/ 2>/dev/null
  grep -hE "^(\||#)|built|captured|done in|Error" "$L"/spec_slice.log | cut -c1-260
fi
if [[ " $sections " == *" engine "* ]]; then          # host share of a step, sync / graphs / async (#18)
  run bench_engine 300 python3 benchmarks/gpu/bench_engine.py
  tail -30 "$L"/bench_engine.log
fi
if [[ " $sections " == *" hostprof "* ]]; then        # where the constrained async step's host time goes
  run structured_hostprof 120 python3 benchmarks/structured.py engine --slice --device cuda --no-enforce-eager \
      --async-scheduling --host-profile 32
fi
if [[ " $sections " == *" userpath "* ]]; then        # #57: LLM's decode (K3) and prefix caching's prefill cost (KL, KDA layer)
  run kda_ckpt_test 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kda_checkpoints_gpu.py
  for e in 5648 1024; do for v in --legacy ""; do
    run "kda_ckpt_${e}${v}" 60 python3 benchmarks/kda_checkpoints.py --device=cuda --dtype=bfloat16 --tokens=8192 --every=$e $v
  done; done
  run user_path_kl 240 python3 benchmarks/gpu/bench_user_path.py --config=benchmarks/gpu/kimi-linear-slice4.config.json \
      --prefill-only --prefill-profile
  run user_path_k3 300 python3 benchmarks/gpu/bench_user_path.py --batches=1,32,64,128
  cp bench_out/bench_user_path*.json "$L"/ 2>/dev/null
  grep -hE "passed|failed|ratio|LLM b|^b[0-9]|prefill" "$L"/kda_ckpt*.log "$L"/user_path_*.log | cut -c1-220
fi
cd /tmp && tar czf "${OUT:-/tmp}/logs.tgz" logs && echo "done at $(( $(date +%s) - START )) s"
