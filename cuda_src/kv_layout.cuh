// A paged K/V cache as pointers plus strides, so NHD, HND, vLLM's legacy layout and views
// of fused allocations are one code path.
//
// Token-major caches (FORMAT kFormatTokenMajor) hold each (token, KV head) row of head_size
// elements contiguously, anywhere: NHD [blocks, block_size, kv_heads, head_size], HND
// [blocks, kv_heads, block_size, head_size], K and V as halves of FlashInfer's
// [blocks, 2, ...] or vLLM's packed [blocks, kv_heads, block_size, 2 * head_size] are all
// (block, head, token) strides. vLLM's legacy layout (FORMAT kFormatVllm) splits the key by
// 16-byte chunks, [blocks, kv_heads, head_size / x, block_size, x], and stores the value
// dimension-major, [blocks, kv_heads, head_size, block_size]; both are contiguous within
// a (block, head), so only those two strides are free.
#pragma once
#include "common.cuh"

namespace cupaged {

enum KVFormat : int { kFormatTokenMajor = 0, kFormatVllm = 1 };

// How an fp8 cache's scales are given (KV_SCALE template parameter). A cache of the
// query's own type has none.
enum KVScale : int {
  kScaleTensor = 0,    // one k and one v scale for the whole cache
  kScaleTokenHead = 1  // float32 [num_blocks, num_kv_heads, block_size] for K and for V
};

// Passed by value as a kernel parameter (128 bytes); element strides.
struct PagedKV {
  const void* k;
  const void* v;
  long long k_block, k_head, k_token;  // k_token: token-major only
  long long v_block, v_head, v_token;  // v_token: token-major only
  const int* block_tables;             // [num_seqs, bt_stride], int32 block ids
  long long bt_stride;
  int max_blocks;  // entries per table row: lengths are clamped to max_blocks * block_size
  int num_blocks;  // ids outside [0, num_blocks) are never dereferenced
  // fp8 caches. kScaleTensor: a device float each (read in the kernel, so the caller
  // never syncs), or null for the host values below. kScaleTokenHead: the scale arrays,
  // strided (block, head) with tokens contiguous.
  const float* k_scale;
  const float* v_scale;
  long long scale_block, scale_head;
  float k_scale_value, v_scale_value;
};

// Per-tensor scales, as the kernels apply them (1 for 16-bit caches).
__device__ __forceinline__ float tensor_k_scale(const PagedKV& kv) {
  return kv.k_scale != nullptr ? __ldg(kv.k_scale) : kv.k_scale_value;
}
__device__ __forceinline__ float tensor_v_scale(const PagedKV& kv) {
  return kv.v_scale != nullptr ? __ldg(kv.v_scale) : kv.v_scale_value;
}

// Offset of (block, head, token-in-block) in the per-token-head scale arrays.
__device__ __forceinline__ long long scale_offset(const PagedKV& kv, int phys, int head,
                                                  int within) {
  return phys * kv.scale_block + head * kv.scale_head + within;
}

template <typename T, int FORMAT, int BLOCK_SIZE>
struct KVAccess {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16 bytes

  // A KV head's base pointers; kernels that copy many chunks of one head hoist them.
  static __device__ __forceinline__ const T* key_head(const PagedKV& kv, int head) {
    return static_cast<const T*>(kv.k) + head * kv.k_head;
  }
  static __device__ __forceinline__ const T* value_head(const PagedKV& kv, int head) {
    return static_cast<const T*>(kv.v) + head * kv.v_head;
  }

  // A KV head's base pointers and the cache's strides in 32 bits, as the copy loops use
  // them: the host checks that a block's stride is below 2^32 elements and that offsets
  // within a block stay below 2^31 (_checks.check_block_strides).
  struct Head {
    const T* k;
    const T* v;
    unsigned k_block, v_block, k_token, v_token;
  };
  static __device__ __forceinline__ Head head(const PagedKV& kv, int h) {
    return {key_head(kv, h), value_head(kv, h), static_cast<unsigned>(kv.k_block),
            static_cast<unsigned>(kv.v_block), static_cast<unsigned>(kv.k_token),
            static_cast<unsigned>(kv.v_token)};
  }

  // The 16-byte chunk `c` (dims [c * kVec, c * kVec + kVec)) of the key of token `within`
  // of block `phys`, from the head's base pointer.
  static __device__ __forceinline__ const T* key_chunk_at(const PagedKV& kv, const T* head_base,
                                                          int phys, int within, int c) {
    const T* base = head_base + phys * kv.k_block;
    if constexpr (FORMAT == kFormatTokenMajor) {
      return base + within * kv.k_token + c * kVec;
    } else {
      return base + (c * BLOCK_SIZE + within) * kVec;
    }
  }

  // Token-major: chunk `c` of the value of token `within`.
  // vLLM: dim `c` of tokens [within, within + kVec) (a 16-byte run when blocks hold at
  // least kVec tokens).
  static __device__ __forceinline__ const T* value_chunk_at(const PagedKV& kv,
                                                            const T* head_base, int phys,
                                                            int within, int c) {
    const T* base = head_base + phys * kv.v_block;
    if constexpr (FORMAT == kFormatTokenMajor) {
      return base + within * kv.v_token + c * kVec;
    } else {
      return base + c * BLOCK_SIZE + within;
    }
  }

  static __device__ __forceinline__ const T* key_chunk(const PagedKV& kv, int phys, int head,
                                                       int within, int c) {
    return key_chunk_at(kv, key_head(kv, head), phys, within, c);
  }
  static __device__ __forceinline__ const T* value_chunk(const PagedKV& kv, int phys, int head,
                                                         int within, int c) {
    return value_chunk_at(kv, value_head(kv, head), phys, within, c);
  }
};

// The physical block holding logical token `token` of a sequence's table row, or -1 when
// the table names a block outside the cache (the caller then reads nothing and reports
// NaN). `token` must be below the clamped length, so the row is never overrun.
__device__ __forceinline__ int physical_block(const PagedKV& kv, const int* bt_row, int token,
                                              int block_size) {
  const int phys = __ldg(bt_row + token / block_size);
  return static_cast<unsigned>(phys) < static_cast<unsigned>(kv.num_blocks) ? phys : -1;
}

}  // namespace cupaged
