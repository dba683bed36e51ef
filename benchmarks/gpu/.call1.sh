#!/usr/bin/env bash
set -u
START=$(date +%s); L=/tmp/logs; mkdir -p $L
t() { local name=$1 cap=$2; shift 2; local left=$(( 585 - ($(date +%s) - START) - 8 )); [ $left -lt $cap ] && cap=$left
  [ $cap -lt 20 ] && { echo "skip $name"; return; }
  timeout $cap "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s) - START )) s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $L/gpu.txt; cat $L/gpu.txt
t slice_kl 140 python3 benchmarks/gpu/bench_slice.py --config=benchmarks/gpu/kimi-linear-slice4.config.json --skip-checks --no-ref --no-experts --side-ab
grep -h "^|" $L/slice_kl.log
t profile_kl 70 python3 benchmarks/gpu/profile_step.py --config=benchmarks/gpu/kimi-linear-slice4.config.json --batches=1
grep -h "^#" $L/profile_kl.log | head -60
t full 300 python3 benchmarks/gpu/bench_full_model.py
grep -h "^|\|plan\|peak" $L/full.log | cut -c1-300
t slice_k3 170 python3 benchmarks/gpu/bench_slice.py --skip-checks --no-ref
grep -h "^|" $L/slice_k3.log
cp bench_out/*.json $L/ 2>/dev/null
cd /tmp && tar czf $OUT/logs.tgz logs; echo done $(( $(date +%s) - START ))
