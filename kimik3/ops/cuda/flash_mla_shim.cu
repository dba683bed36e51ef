// A C entry point to DeepSeek's FlashMLA dense decode for Hopper (https://github.com/deepseek-ai/FlashMLA),
// for kimik3.ops.cuda.flash_mla through ctypes: no Python or PyTorch ABI in the library. Built by
// `kimik3 build-kernels` (kimik3/kernels.py) beside FlashMLA's sm90 dense decode, scheduler and combine kernels.
// kimik3's MLA decode is one query token per sequence over one shared latent "head" (h_k = 1) of
// 576 = 512 latent + 64 rope columns, the output the first 512: FlashMLA's dense decode shape, with
// the latent cache in pages of 64 tokens.
#include <cstdint>
#include <exception>
#include <cuda_runtime.h>

#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {
constexpr int kDimQK = 576;
constexpr int kDimV = 512;
constexpr int kPage = 64;
constexpr int kRowsPerTile = 64;        // query rows (heads) a program holds
}

// How many SM parts the scheduler splits the work into for `heads` query heads on `num_sms` SMs; sizes the
// metadata [parts, 8] int32 and the partial results [batch + parts, heads, ...].
extern "C" int kimik3_flash_mla_sm_parts(int heads, int num_sms) {
    int tiles = (heads + kRowsPerTile - 1) / kRowsPerTile;
    int parts = num_sms / tiles;
    return parts > 1 ? parts : 1;
}

extern "C" int kimik3_flash_mla_meta_ints() { return static_cast<int>(sizeof(DecodingSchedMeta) / sizeof(int)); }

// The split schedule of one decode over sequence lengths `seqlens` int32 [b] (the new token included): meta int32
// [parts, meta_ints], splits int32 [b + 1]. One launch on `stream` of GPU `device`; every decode over the same
// lengths (each MLA layer of one forward step) can share it. Returns 0, a CUDA error code, or -1 when FlashMLA raised.
extern "C" int kimik3_flash_mla_schedule(int* seqlens, void* meta, int* splits, int batch, int parts, int device,
                                         void* stream) {
    try {
        cudaError_t set = cudaSetDevice(device);
        if (set != cudaSuccess) return static_cast<int>(set);
        // fields by name (not by position), so a FlashMLA that reorders them fails to compile instead of misreading
        GetDecodeSchedMetaParams m = {};
        m.b = batch;
        m.s_q = 1;
        m.block_size_n = kPage;
        m.fixed_overhead_num_blocks = 5;       // FlashMLA's own dense-decode setting
        m.topk = -1;                           // dense attention
        m.extra_topk = -1;
        m.topk_length = nullptr;
        m.extra_topk_length = nullptr;
        m.seqlens_k_ptr = seqlens;
        m.tile_scheduler_metadata_ptr = static_cast<DecodingSchedMeta*>(meta);
        m.num_splits_ptr = splits;
        m.num_sm_parts = parts;
        m.stream = static_cast<cudaStream_t>(stream);
        smxx::decode::run_get_decoding_sched_meta_kernel(m);
        return static_cast<int>(cudaGetLastError());
    } catch (const std::exception&) {
        return -1;
    }
}

// q [b, heads, 576] bf16 (contiguous); cache [num_blocks, 64, 576] bf16; block_table int32 rows of
// `table_stride`; seqlens int32 [b] (the new token included); out [b, heads, 512] bf16; lse fp32 [b, heads];
// meta, splits: the schedule of these lengths (kimik3_flash_mla_schedule); lse_accum fp32 [b + parts, heads];
// o_accum fp32 [b + parts, heads, 512]. Two launches on `stream` of GPU `device` (split attention, combine);
// returns 0, a CUDA error code, or -1 when FlashMLA raised. (This library links its own CUDA runtime, whose
// current device is set here: the caller's runtime may be on another GPU of the process.)
extern "C" int kimik3_flash_mla_decode(void* q, void* cache, int* block_table, int64_t table_stride, int* seqlens,
                                       void* out, float* lse, void* meta, int* splits, float* lse_accum,
                                       float* o_accum, int batch, int heads, int num_blocks, int parts, float scale,
                                       int device, void* stream) {
    try {
        cudaError_t set = cudaSetDevice(device);
        if (set != cudaSuccess) return static_cast<int>(set);
        auto s = static_cast<cudaStream_t>(stream);
        auto* sched = static_cast<DecodingSchedMeta*>(meta);

        DenseAttnDecodeParams p = {};
        p.b = batch;
        p.s_q = 1;
        p.q_seq_per_hk = heads;
        p.d = kDimQK;
        p.d_v = kDimV;
        p.h_q = heads;
        p.h_k = 1;
        p.num_blocks = num_blocks;
        p.q_head_per_hk = heads;
        p.is_causal = false;
        p.scale_softmax = scale;
        p.scale_softmax_log2 = scale * 1.4426950408889634f;
        p.q_ptr = q;
        p.k_ptr = cache;
        p.o_ptr = out;
        p.softmax_lse_ptr = lse;
        p.q_batch_stride = static_cast<int64_t>(heads) * kDimQK;
        p.k_batch_stride = static_cast<int64_t>(kPage) * kDimQK;
        p.o_batch_stride = static_cast<int64_t>(heads) * kDimV;
        p.q_row_stride = kDimQK;
        p.k_row_stride = kDimQK;
        p.o_row_stride = kDimV;
        p.q_head_stride = kDimQK;
        p.k_head_stride = kDimQK;
        p.o_head_stride = static_cast<int64_t>(heads) * kDimV;
        p.block_table = block_table;
        p.block_table_batch_stride = table_stride;
        p.page_block_size = kPage;
        p.seqlens_k_ptr = seqlens;
        p.tile_scheduler_metadata_ptr = sched;
        p.num_sm_parts = parts;
        p.num_splits_ptr = splits;
        p.total_num_splits = batch + parts;
        p.softmax_lseaccum_ptr = lse_accum;
        p.oaccum_ptr = o_accum;
        p.stream = s;
        sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(p);

        // lse [b, 1, heads] and out [b, 1, heads, 512]; the partials [b + parts, heads(, 512)] alike
        CombineParams c = {};
        c.b = batch;
        c.s_q = 1;
        c.h_q = heads;
        c.d_v = kDimV;
        c.lse = lse;
        c.out = out;
        c.stride_lse_b = heads;
        c.stride_lse_s_q = heads;
        c.stride_o_b = heads * kDimV;
        c.stride_o_s_q = heads * kDimV;
        c.stride_o_h_q = kDimV;
        c.lse_accum = lse_accum;
        c.o_accum = o_accum;
        c.stride_lse_accum_split = heads;
        c.stride_lse_accum_s_q = heads;
        c.stride_o_accum_split = heads * kDimV;
        c.stride_o_accum_s_q = heads * kDimV;
        c.stride_o_accum_h_q = kDimV;
        c.tile_scheduler_metadata_ptr = sched;
        c.num_splits_ptr = splits;
        c.num_sm_parts = parts;
        c.attn_sink = nullptr;
        c.stream = s;
        smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
        return static_cast<int>(cudaGetLastError());
    } catch (const std::exception&) {
        return -1;
    }
}
