#!/usr/bin/env bash
# Builds libkimik3_flash_kda.so: MoonshotAI's FlashKDA forward (its csrc/smxx/fwd_launch.cu, CUTLASS) with
# kimik3's C entry point (kimik3/ops/cuda/flash_kda_shim.cu), for Hopper (sm_90a). Needs nvcc (CUDA 12.9+)
# and a FlashKDA checkout with its cutlass submodule; no GPU and no PyTorch build. Then run kimik3 with
#   KIMIK3_FLASH_KDA=/path/to/libkimik3_flash_kda.so
#
#   git clone https://github.com/MoonshotAI/FlashKDA && git -C FlashKDA submodule update --init cutlass
#   scripts/build_flash_kda.sh FlashKDA [out.so] [arch, default 90a]
#
# Tested with FlashKDA 1ce47ea (cutlass 5c149f52) and nvcc 13.0 (about a minute on one core).
set -euo pipefail
SRC=${1:?usage: build_flash_kda.sh FLASHKDA_DIR [OUT.so] [ARCH]}
OUT=${2:-libkimik3_flash_kda.so}
ARCH=${3:-90a}
HERE=$(cd "$(dirname "$0")/.." && pwd)
for f in "$SRC/csrc/fwd.h" "$SRC/csrc/smxx/fwd_launch.cu" "$SRC/cutlass/include/cute/tensor.hpp"; do
  [ -f "$f" ] || { echo "build_flash_kda.sh: $f not found (a FlashKDA checkout with its cutlass submodule?)" >&2; exit 1; }
done
nvcc -shared -Xcompiler -fPIC -O3 -std=c++17 -gencode "arch=compute_$ARCH,code=sm_$ARCH" \
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__ \
  -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math -lineinfo \
  -I"$SRC/cutlass/include" -I"$SRC/cutlass/tools/util/include" -I"$SRC/cutlass/examples/common" -I"$SRC/csrc" \
  "$HERE/kimik3/ops/cuda/flash_kda_shim.cu" "$SRC/csrc/smxx/fwd_launch.cu" -o "$OUT"
echo "built $OUT"
