// Cache maintenance: writing new tokens into the paged cache, and copying whole blocks
// (copy-on-write inside a device cache, swapping between a device and a host cache).
#pragma once
#include "common.cuh"
#include "kv_layout.cuh"

namespace cupaged {

constexpr int kCacheThreads = 128;

// 16 bytes of a source row. `vec`: the host checked that every source row (its pointer,
// token and head strides) is 16-byte aligned, so one vector load is safe; otherwise (a
// slice at any element offset) the row is read element by element. The flag is uniform
// over the grid, so the branch costs nothing.
template <typename T>
__device__ __forceinline__ uint4 load_chunk(const T* __restrict__ src, bool vec) {
  if (vec) return *reinterpret_cast<const uint4*>(src);
  union {
    uint4 v;
    T e[16 / sizeof(T)];
  } u;
#pragma unroll
  for (int j = 0; j < static_cast<int>(16 / sizeof(T)); ++j) u.e[j] = src[j];
  return u.v;
}

// Write each token's K and V into its slot (slot = block * block_size + offset) of a cache
// in FORMAT (KVFormat, cuda_src/kv_layout.cuh). key/value: [num_tokens, num_kv_heads,
// head_size], token and head strides free, dims contiguous. Cache strides (block, head,
// token) are in elements, as cupaged._checks.CacheView gives them; the token stride is
// unused by vLLM's layout (contiguous within a (block, head)). Every cache row and chunk is
// 16-byte aligned (checked on the host), so the cache side is always written in 16-byte
// stores, except vLLM's dimension-major value.
//
// One CTA per token. A negative slot marks a padding token: nothing is written. Slots at
// or past num_slots are skipped too, so a bad slot never writes outside the cache
// (CUPAGED_DEBUG=1 reports it on the host).
template <typename T, int FORMAT, typename SlotT>
__global__ void __launch_bounds__(kCacheThreads)
    reshape_and_cache(const T* __restrict__ key, long long k_tok_stride, long long k_head_stride,
                      const T* __restrict__ value, long long v_tok_stride, long long v_head_stride,
                      T* __restrict__ key_cache, long long kc_block, long long kc_head,
                      long long kc_token, T* __restrict__ value_cache, long long vc_block,
                      long long vc_head, long long vc_token, const SlotT* __restrict__ slot_mapping,
                      int num_kv_heads, int head_size, int block_size, long long num_slots,
                      int vec_src) {
  constexpr int X = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
  const long long tok = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[tok]);
  if (slot < 0 || slot >= num_slots) return;
  const long long block = slot / block_size;
  const int offset = static_cast<int>(slot % block_size);
  const int chunks = head_size / X;  // head sizes are multiples of 8: whole chunks
  key += tok * k_tok_stride;
  value += tok * v_tok_stride;
  key_cache += block * kc_block;
  value_cache += block * vc_block;

  // One (head, 16-byte chunk) per iteration; consecutive threads take consecutive chunks
  // of a row, so loads and stores coalesce.
  for (int i = threadIdx.x; i < num_kv_heads * chunks; i += kCacheThreads) {
    const int h = i / chunks;
    const int c = i % chunks;
    const uint4 k = load_chunk(key + h * k_head_stride + c * X, vec_src != 0);
    if constexpr (FORMAT == kFormatTokenMajor) {
      // K and V both land in the token's rows: load both before storing (two loads in
      // flight per thread).
      const uint4 v = load_chunk(value + h * v_head_stride + c * X, vec_src != 0);
      *reinterpret_cast<uint4*>(key_cache + h * kc_head + offset * kc_token + c * X) = k;
      *reinterpret_cast<uint4*>(value_cache + h * vc_head + offset * vc_token + c * X) = v;
    } else {
      // vLLM's key: [chunk][offset][x], one 16-byte chunk per (chunk, offset).
      *reinterpret_cast<uint4*>(key_cache + h * kc_head +
                                (static_cast<long long>(c) * block_size + offset) * X) = k;
    }
  }
  if constexpr (FORMAT == kFormatVllm) {
    // vLLM's value: [dim][offset], one element every block_size. One dim per thread:
    // consecutive threads read consecutive source elements (coalesced without vectors),
    // and with one-token blocks write consecutive ones.
    for (int i = threadIdx.x; i < num_kv_heads * head_size; i += kCacheThreads) {
      const int h = i / head_size;
      const int d = i % head_size;
      value_cache[h * vc_head + static_cast<long long>(d) * block_size + offset] =
          value[h * v_head_stride + d];
    }
  }
}

// One tensor of a block copy: source and destination base addresses (device memory, or
// pinned host memory reached through unified addressing) and block strides, in bytes.
struct CopyTensor {
  long long src;
  long long dst;
  long long src_block_stride;
  long long dst_block_stride;
};

// The tensors of one launch travel by value in the kernel parameters (3 KiB of the 4 KiB
// every supported GPU accepts): a launch owns its copy of the table, so nothing has to be
// uploaded before it or kept alive after it, and a captured CUDA graph holds its own.
// More tensors than this take several launches.
constexpr int kMaxCopyTensors = 96;
struct CopyTable {
  CopyTensor t[kMaxCopyTensors];
};

// Copy whole blocks for every (pair, tensor): grid (num_pairs, num_tensors). block_bytes
// is a multiple of 16 and every base and stride 16-byte aligned (checked on the host). One
// launch serves copy-on-write for many layers' K and V caches, and a swap between a device
// cache and a pinned host cache whatever the mapping's order. Block ids outside
// [0, src_blocks) or [0, dst_blocks) are skipped, never followed.
template <typename IdxT>
__global__ void __launch_bounds__(kCacheThreads)
    copy_blocks(const __grid_constant__ CopyTable table, const IdxT* __restrict__ mapping,
                long long block_bytes, long long src_blocks, long long dst_blocks) {
  const CopyTensor& t = table.t[blockIdx.y];
  const long long s = static_cast<long long>(mapping[2 * static_cast<long long>(blockIdx.x)]);
  const long long d = static_cast<long long>(mapping[2 * static_cast<long long>(blockIdx.x) + 1]);
  if (s < 0 || s >= src_blocks || d < 0 || d >= dst_blocks) return;
  const uint4* src = reinterpret_cast<const uint4*>(t.src + s * t.src_block_stride);
  uint4* dst = reinterpret_cast<uint4*>(t.dst + d * t.dst_block_stride);
  for (long long i = threadIdx.x; i < block_bytes / 16; i += kCacheThreads) dst[i] = src[i];
}

}  // namespace cupaged
