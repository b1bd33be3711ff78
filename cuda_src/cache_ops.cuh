// Cache maintenance: writing new tokens into the paged cache, and copying whole blocks
// (copy-on-write inside a device cache, swapping between a device and a host cache).
#pragma once
#include "common.cuh"
#include "fp8.cuh"
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

// Eight 16-bit values (16 bytes) as floats.
template <typename T>
__device__ __forceinline__ void chunk_floats(const uint4 c, float (&f)[8]) {
  unpack2(c.x, f[0], f[1], T{});
  unpack2(c.y, f[2], f[3], T{});
  unpack2(c.z, f[4], f[5], T{});
  unpack2(c.w, f[6], f[7], T{});
}

// One token's K and V into an fp8 cache (see reshape_and_cache). A warp per head: lane l
// holds dims [8l, 8l + 8) and, for heads over 256 dims, [256 + 8l, 264 + 8l) (head sizes
// go to 512), so a per-token-head scale is one warp reduction.
constexpr int kQuantizePieces = 2;  // 8-dim pieces a lane holds: 512 dims a warp

template <typename T, typename C, int FORMAT, int KV_SCALE>
__device__ __forceinline__ void quantize_token(
    const T* key, long long k_head_stride, const T* value, long long v_head_stride,
    C* kc, long long kc_head, long long kc_token, C* vc, long long vc_head, long long vc_token,
    int num_kv_heads, int head_size, int block_size, int offset, bool vec, float* k_scale,
    float* v_scale, long long scale_base, long long scale_head, float k_scale_value,
    float v_scale_value) {
  constexpr float kMax = Fp8Format<C>::kMax;
  constexpr int P = kQuantizePieces;
  const int lane = threadIdx.x & 31;
  float ks = k_scale_value, vs = v_scale_value;
  if constexpr (KV_SCALE == kScaleTensor) {
    if (k_scale != nullptr) ks = __ldg(k_scale);
    if (v_scale != nullptr) vs = __ldg(v_scale);
  }
  for (int h = threadIdx.x / 32; h < num_kv_heads; h += kCacheThreads / 32) {
    float kf[P][8], vf[P][8];
    float kmax = 0.f, vmax = 0.f;
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int d0 = (lane + 32 * j) * 8;
      if (d0 >= head_size) continue;
      chunk_floats<T>(load_chunk(key + h * k_head_stride + d0, vec), kf[j]);
      chunk_floats<T>(load_chunk(value + h * v_head_stride + d0, vec), vf[j]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        kmax = fmaxf(kmax, fabsf(kf[j][i]));
        vmax = fmaxf(vmax, fabsf(vf[j][i]));
      }
    }
    if constexpr (KV_SCALE == kScaleTokenHead) {
      kmax = warp_max(kmax);
      vmax = warp_max(vmax);
      ks = kmax > 0.f ? kmax / kMax : 1.f;
      vs = vmax > 0.f ? vmax / kMax : 1.f;
      if (lane == 0) {
        k_scale[scale_base + h * scale_head] = ks;
        v_scale[scale_base + h * scale_head] = vs;
      }
    }
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int d0 = (lane + 32 * j) * 8;
      if (d0 >= head_size) continue;
      const float* k8 = kf[j];
      const float* v8 = vf[j];
      uint2 kq, vq;  // eight fp8 values each
      kq.x = quantize2(k8[0] / ks, k8[1] / ks, C{}) | (quantize2(k8[2] / ks, k8[3] / ks, C{}) << 16);
      kq.y = quantize2(k8[4] / ks, k8[5] / ks, C{}) | (quantize2(k8[6] / ks, k8[7] / ks, C{}) << 16);
      vq.x = quantize2(v8[0] / vs, v8[1] / vs, C{}) | (quantize2(v8[2] / vs, v8[3] / vs, C{}) << 16);
      vq.y = quantize2(v8[4] / vs, v8[5] / vs, C{}) | (quantize2(v8[6] / vs, v8[7] / vs, C{}) << 16);
      if constexpr (FORMAT == kFormatTokenMajor) {
        *reinterpret_cast<uint2*>(kc + h * kc_head + offset * kc_token + d0) = kq;
        *reinterpret_cast<uint2*>(vc + h * vc_head + offset * vc_token + d0) = vq;
      } else {
        // vLLM's key: [dims / 16][offset][16]; value: [dim][offset], one byte per dim.
        *reinterpret_cast<uint2*>(kc + h * kc_head +
                                  (static_cast<long long>(d0 / 16) * block_size + offset) * 16 +
                                  d0 % 16) = kq;
        C* v = vc + h * vc_head + static_cast<long long>(d0) * block_size + offset;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          v[i * block_size].bits = static_cast<unsigned char>(((i < 4 ? vq.x : vq.y) >> (8 * (i % 4))) & 0xff);
        }
      }
    }
  }
}

// Write each token's K and V into its slot (slot = block * block_size + offset) of a cache
// in FORMAT (KVFormat, cuda_src/kv_layout.cuh). key/value: [num_tokens, num_kv_heads,
// head_size], token and head strides free, dims contiguous. Cache strides (block, head,
// token) are in elements, as cupaged._checks.CacheView gives them; the token stride is
// unused by vLLM's layout (contiguous within a (block, head)). Every cache row and chunk is
// 16-byte aligned (checked on the host), so the cache side is always written in 16-byte
// stores, except vLLM's dimension-major value.
//
// An fp8 cache (C is fp8_e4m3_t or fp8_e5m2_t; T the 16-bit source) stores
// round-to-nearest-even(value / scale), saturated to the format's largest finite value.
// KV_SCALE kScaleTensor: one scale each for K and V (k_scale / v_scale point at a device
// float, or are null and the values are used). kScaleTokenHead: the scale of each written
// (token, head) is amax(|row|) / largest finite (1 for an all-zero row), stored in
// k_scale / v_scale [num_blocks, num_kv_heads, block_size] (strides scale_block,
// scale_head, tokens contiguous).
//
// One CTA per token. A negative slot marks a padding token: nothing is written. Slots at
// or past num_slots are skipped too, so a bad slot never writes outside the cache
// (CUPAGED_DEBUG=1 reports it on the host).
template <typename T, typename C, int FORMAT, int KV_SCALE, typename SlotT>
__global__ void __launch_bounds__(kCacheThreads)
    reshape_and_cache(const T* __restrict__ key, long long k_tok_stride, long long k_head_stride,
                      const T* __restrict__ value, long long v_tok_stride, long long v_head_stride,
                      C* __restrict__ key_cache, long long kc_block, long long kc_head,
                      long long kc_token, C* __restrict__ value_cache, long long vc_block,
                      long long vc_head, long long vc_token, const SlotT* __restrict__ slot_mapping,
                      int num_kv_heads, int head_size, int block_size, long long num_slots,
                      int vec_src, float* __restrict__ k_scale, float* __restrict__ v_scale,
                      long long scale_block, long long scale_head, float k_scale_value,
                      float v_scale_value) {
  const long long tok = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[tok]);
  if (slot < 0 || slot >= num_slots) return;
  const long long block = slot / block_size;
  const int offset = static_cast<int>(slot % block_size);
  if constexpr (!is_same<T, C>::value) {
    quantize_token<T, C, FORMAT, KV_SCALE>(
        key + tok * k_tok_stride, k_head_stride, value + tok * v_tok_stride, v_head_stride,
        key_cache + block * kc_block, kc_head, kc_token, value_cache + block * vc_block,
        vc_head, vc_token, num_kv_heads, head_size, block_size, offset, vec_src != 0,
        k_scale, v_scale, block * scale_block + offset, scale_head, k_scale_value,
        v_scale_value);
    return;
  } else {
  constexpr int X = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
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
}

// MLA's latent cache write (vLLM's concat_and_cache_mla): token `tok`'s kv_c
// [kv_lora_rank] and k_pe [rope_dim] (rows of stride kv_c_stride / k_pe_stride, dims
// contiguous) into its slot: the latent part at latent_cache + block * lc_block + offset *
// lc_token, the rotary part at rope_cache + block * rc_block + offset * rc_token (vLLM's
// combined [num_blocks, block_size, kv_lora_rank + rope_dim] cache: rope_cache is
// latent_cache + kv_lora_rank with the same strides). Both widths are multiples of 8, and
// every cache row is 16-byte aligned (8-byte for fp8; checked on the host).
//
// An fp8 cache (C fp8_e4m3_t or fp8_e5m2_t) stores round-to-nearest-even(x / scale),
// saturated to the format's largest finite value, with one scale for the tensor (`scale`
// points at a device float, or is null and `scale_value` is used).
//
// One CTA per token; 16-byte chunks of eight values, consecutive threads on consecutive
// chunks. A negative slot (padding) or one at or past num_slots writes nothing.
template <typename T, typename C, typename SlotT>
__global__ void __launch_bounds__(kCacheThreads)
    concat_and_cache_mla(const T* __restrict__ kv_c, long long kv_c_stride,
                         const T* __restrict__ k_pe, long long k_pe_stride,
                         C* __restrict__ latent_cache, long long lc_block, long long lc_token,
                         C* __restrict__ rope_cache, long long rc_block, long long rc_token,
                         const SlotT* __restrict__ slot_mapping, int kv_lora_rank, int rope_dim,
                         int block_size, long long num_slots, int vec_src,
                         const float* __restrict__ scale, float scale_value) {
  const long long tok = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[tok]);
  if (slot < 0 || slot >= num_slots) return;
  const long long block = slot / block_size;
  const long long offset = slot % block_size;
  const T* src_c = kv_c + tok * kv_c_stride;
  const T* src_r = k_pe + tok * k_pe_stride;
  C* dst_c = latent_cache + block * lc_block + offset * lc_token;
  C* dst_r = rope_cache + block * rc_block + offset * rc_token;
  static_assert(sizeof(T) == 2, "float16 or bfloat16 sources: eight values a chunk");
  const int chunks_c = kv_lora_rank / 8;
  const int chunks = chunks_c + rope_dim / 8;
  float s = 1.f;  // divided, not multiplied by its inverse: x / scale rounds as torch's does
  if constexpr (!is_same<T, C>::value) s = scale != nullptr ? __ldg(scale) : scale_value;
  for (int i = threadIdx.x; i < chunks; i += kCacheThreads) {
    const bool latent = i < chunks_c;
    const int d = (latent ? i : i - chunks_c) * 8;
    const T* src = (latent ? src_c : src_r) + d;
    C* dst = (latent ? dst_c : dst_r) + d;
    if constexpr (sizeof(T) == sizeof(C)) {
      static_assert(is_same<T, C>::value, "16-bit caches hold the source's type");
      *reinterpret_cast<uint4*>(dst) = load_chunk(src, vec_src != 0);
    } else {
      float f[8];
      chunk_floats<T>(load_chunk(src, vec_src != 0), f);
      uint2 q;
      q.x = quantize2(f[0] / s, f[1] / s, C{}) | (quantize2(f[2] / s, f[3] / s, C{}) << 16);
      q.y = quantize2(f[4] / s, f[5] / s, C{}) | (quantize2(f[6] / s, f[7] / s, C{}) << 16);
      *reinterpret_cast<uint2*>(dst) = q;
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
