#!/usr/bin/env bash
# Builds libkimik3_flash_mla.so: DeepSeek's FlashMLA dense decode for Hopper (its sm90 split-KV kernel, the
# decode scheduler and the combine kernel; CUTLASS) with kimik3's C entry point
# (kimik3/ops/cuda/flash_mla_shim.cu), for sm_90a. Needs nvcc (CUDA 12.9+) and a FlashMLA checkout with its
# cutlass submodule; no GPU and no PyTorch build. Then run kimik3 with a 64-token cache block and
#   KIMIK3_FLASH_MLA=/path/to/libkimik3_flash_mla.so   (e.g. kimik3 serve ... --block-size 64)
#
#   git clone https://github.com/deepseek-ai/FlashMLA && git -C FlashMLA submodule update --init csrc/cutlass
#   scripts/build_flash_mla.sh FlashMLA [out.so]
#
# Tested with FlashMLA 9241ae3 (cutlass 147f5673) and nvcc 13.0 (about 80 s on one core).
set -euo pipefail
SRC=${1:?usage: build_flash_mla.sh FLASHMLA_DIR [OUT.so]}
OUT=${2:-libkimik3_flash_mla.so}
HERE=$(cd "$(dirname "$0")/.." && pwd)
C="$SRC/csrc"
for f in "$C/params.h" "$C/sm90/decode/dense/instantiations/bf16.cu" "$C/cutlass/include/cute/tensor.hpp"; do
  [ -f "$f" ] || { echo "build_flash_mla.sh: $f not found (a FlashMLA checkout with its cutlass submodule?)" >&2; exit 1; }
done
nvcc -shared -Xcompiler -fPIC -O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -DFLASH_MLA_DISABLE_FP16 \
  -gencode arch=compute_90a,code=sm_90a -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ \
  -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda \
  --use_fast_math -lineinfo -I"$C/cutlass/include" -I"$C/cutlass/tools/util/include" -I"$C/kerutils/include" \
  -I"$C" -I"$C/sm90" \
  "$HERE/kimik3/ops/cuda/flash_mla_shim.cu" "$C/sm90/decode/dense/instantiations/bf16.cu" \
  "$C/smxx/decode/combine/combine.cu" "$C/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu" -o "$OUT"
echo "built $OUT"
