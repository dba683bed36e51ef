// A C entry point to MoonshotAI's FlashKDA forward (https://github.com/MoonshotAI/FlashKDA), for
// kimik3.ops.flash_kda through ctypes: no Python or PyTorch ABI in the library, so one build serves
// any interpreter and torch on the machine. Built by `kimik3 build-kernels` (kimik3/kernels.py) beside FlashKDA's
// csrc/smxx/fwd_launch.cu; only the variant kimik3 runs is called: K = V = 128, varlen (cu_seqlens),
// fp32 initial and final states, V-first [N, H, V, K].
#include <cstdint>
#include <cuda_runtime.h>

#include "fwd.h"

namespace {
constexpr int64_t kChunk = 16;   // FlashKDA's token tile
constexpr int64_t kDim = 128;
}

// Bytes of scratch the forward needs: per (head, tile) three bf16 [chunk, D] tiles, an fp32 [D] gate
// total and two bf16 [chunk, chunk] matrices; a tile may be partial per sequence (one extra each);
// then an int32 tile prefix of N + 1 entries, 128-byte aligned.
extern "C" int64_t kimik3_flash_kda_workspace_bytes(int64_t tokens, int64_t heads, int64_t seqs) {
    int64_t tiles = (tokens + kChunk - 1) / kChunk + seqs;
    int64_t per_tile = 3 * kChunk * kDim * 2 + kDim * 4 + 2 * kChunk * kChunk * 2;
    int64_t prefix = ((seqs + 1) * 4 + 127) / 128 * 128;
    return heads * tiles * per_tile + prefix;
}

// q, k, v, g (raw gate logits), out: bf16 [tokens, heads, 128]; beta_ht: bf16 raw beta logits [heads, tokens];
// initial_state / final_state: fp32 [seqs, heads, 128, 128]; cu_seqlens: int64 [seqs + 1] on the device;
// A_log fp32 [heads]; dt_bias fp32 [heads, 128]. Enqueued on ``stream`` of GPU ``device``; returns the CUDA
// error code. (This library links its own CUDA runtime, whose current device is set here: the caller's
// runtime may be on another GPU of the process.)
extern "C" int kimik3_flash_kda_fwd(const void* q, const void* k, const void* v, const void* g, const void* beta_ht,
                                    const void* initial_state, void* final_state, void* out, void* workspace,
                                    int64_t tokens, int heads, int seqs, const int64_t* cu_seqlens,
                                    const float* A_log, const float* dt_bias, float scale, float lower_bound,
                                    int device, void* stream) {
    cudaError_t set = cudaSetDevice(device);
    if (set != cudaSuccess) return static_cast<int>(set);
    using BF16 = cutlass::bfloat16_t;
    int tiles = static_cast<int>((tokens + kChunk - 1) / kChunk + seqs);
    float gate_scale = lower_bound * 1.4426950408889634f;      // the kernel's gate works in base 2
    launch_fwd<128, true, true, true, true>(
        static_cast<const BF16*>(q), static_cast<const BF16*>(k), static_cast<const BF16*>(v),
        static_cast<const BF16*>(g), static_cast<const BF16*>(beta_ht), initial_state, scale, final_state,
        static_cast<BF16*>(out), workspace, tiles, static_cast<int>(tokens), heads, seqs, cu_seqlens, A_log,
        dt_bias, gate_scale, static_cast<cudaStream_t>(stream));
    return static_cast<int>(cudaGetLastError());
}
