// Cache maintenance: writing new tokens into the paged cache, and copying whole blocks
// (copy-on-write inside a device cache, swapping between a device and a host cache).
#pragma once
#include "common.cuh"

namespace cupaged {

constexpr int kCacheThreads = 128;

// Write each token's K and V into its slot (slot = block * block_size + offset) of vLLM's
// layouts. key/value: [num_tokens, num_kv_heads, head_size], token and head strides free,
// dims contiguous. A negative slot marks a padding token: nothing is written. One CTA per
// token. Slots at or past num_slots are skipped too, so a bad slot never writes outside
// the cache (CUPAGED_DEBUG=1 reports it on the host).
template <typename T, typename SlotT>
__global__ void __launch_bounds__(kCacheThreads)
    reshape_and_cache(const T* __restrict__ key, long long k_tok_stride, long long k_head_stride,
                      const T* __restrict__ value, long long v_tok_stride, long long v_head_stride,
                      T* __restrict__ key_cache, long long kc_block_stride, long long kc_head_stride,
                      T* __restrict__ value_cache, long long vc_block_stride,
                      long long vc_head_stride, const SlotT* __restrict__ slot_mapping,
                      int num_kv_heads, int head_size, int block_size, long long num_slots) {
  constexpr int X = 16 / static_cast<int>(sizeof(T));
  const long long tok = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[tok]);
  if (slot < 0 || slot >= num_slots) return;
  const long long block = slot / block_size;
  const int offset = static_cast<int>(slot % block_size);
  const int chunks = head_size / X;

  // Key: one 16-byte chunk of x elements per (head, chunk) -> [chunk][offset][x]. The
  // source is read element by element, so it needs no 16-byte alignment.
  for (int i = threadIdx.x; i < num_kv_heads * chunks; i += kCacheThreads) {
    const int h = i / chunks;
    const int c = i % chunks;
    const T* src = key + tok * k_tok_stride + h * k_head_stride + c * X;
    union {
      uint4 v;
      T e[X];
    } u;
#pragma unroll
    for (int j = 0; j < X; ++j) u.e[j] = src[j];
    *reinterpret_cast<uint4*>(key_cache + block * kc_block_stride + h * kc_head_stride +
                              (static_cast<long long>(c) * block_size + offset) * X) = u.v;
  }
  // Value: [dim][offset], one element per dim.
  for (int i = threadIdx.x; i < num_kv_heads * head_size; i += kCacheThreads) {
    const int h = i / head_size;
    const int d = i % head_size;
    value_cache[block * vc_block_stride + h * vc_head_stride +
                static_cast<long long>(d) * block_size + offset] =
        value[tok * v_tok_stride + h * v_head_stride + d];
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
