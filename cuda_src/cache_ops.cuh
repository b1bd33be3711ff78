// Cache maintenance: writing new tokens into the paged cache, copying whole blocks
// (copy-on-write inside a device cache, swapping between a device and a host cache), and
// widening a sparse cache's token rows to 16-bit keys.
#pragma once
#include "common.cuh"
#include "ds_mla.cuh"
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

// DeepSeek's sparse-attention cache rows (fp8_ds_mla_t, v4_fp8_t, v4_fp4_t: ds_mla.cuh) are
// cache types of concat_and_cache_mla, written one warp per token: lane l holds the token's
// values [16l, 16l + 16), so a group of 16 g values is g lanes and its amax their shuffles.

// Eight float16 values (16 bytes) -> eight bfloat16 (16 bytes), rounded to nearest even in
// integer arithmetic on the exact float32 value (every float16 is in bfloat16's range), NaN
// as 0x7FC0 with the float16's sign (read from its bits: a conversion may drop a NaN's
// sign): what ml_dtypes' conversion (the reference) gives, on every target.
__device__ __forceinline__ uint4 chunk_to_bf16(const uint4 c, half_t) {
  float f[8];
  chunk_floats<half_t>(c, f);
  const unsigned w[4] = {c.x, c.y, c.z, c.w};
  unsigned h[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const unsigned bits = (w[i / 2] >> (16 * (i % 2))) & 0xffffu;  // the float16's
    const unsigned u = __float_as_uint(f[i]);
    h[i] = (bits & 0x7fffu) > 0x7c00u ? (bits & 0x8000u) | 0x7fc0u
                                      : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  }
  return make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16),
                    h[6] | (h[7] << 16));
}
__device__ __forceinline__ uint4 chunk_to_bf16(const uint4 c, bfloat16_t) { return c; }

// Lane `lane`'s 16 values [16 lane, 16 lane + 16) of a token whose values are src_c's
// `rank` then src_r's, as floats; rank is a multiple of 8, so no 8-value chunk straddles the
// two (16-byte loads where `vec`, see load_chunk).
template <typename T>
__device__ __forceinline__ void lane_values16(const T* __restrict__ src_c,
                                              const T* __restrict__ src_r, int rank, int lane,
                                              bool vec, float (&f)[2][8]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int d = 16 * lane + 8 * h;
    chunk_floats<T>(load_chunk(d < rank ? src_c + d : src_r + (d - rank), vec), f[h]);
  }
}

// The amax (max |x|) of a group of LANES lanes' 16 values each: fmaxf skips NaN, so a group
// of NaN only (or of zeros) gives 0. Every lane of the warp takes part in the shuffles.
template <int LANES>
__device__ __forceinline__ float group_amax(const float (&f)[2][8]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i / 8][i % 8]));
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  }
  return amax;
}

// A lane's 16 values divided by `scale` (an IEEE division) in e4m3, rounded to nearest even
// and saturated (quantize2: an infinity becomes +-448, NaN 0x7F), as 16 consecutive bytes.
__device__ __forceinline__ uint4 e4m3_bytes16(const float (&f)[2][8], float scale) {
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float* x = f[i / 2] + 4 * (i % 2);
    w[i] = quantize2(x[0] / scale, x[1] / scale, fp8_e4m3_t{}) |
           (quantize2(x[2] / scale, x[3] / scale, fp8_e4m3_t{}) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// One token into an fp8_ds_mla row, lane `lane` holding kv_c's values f (its 16, loaded by
// the caller), a group of 128 values 8 lanes and its amax three shuffles; lanes 0-7 load
// k_pe's 16-byte chunk l. Each group's scale is max(amax / 448, FLT_MIN) in float32 (a
// group of NaN gets FLT_MIN), each value x / scale (an IEEE division, as vLLM's kernel
// divides) in e4m3 (e4m3_bytes16; an infinite value makes its group's scale infinite, so
// the group holds 0 and the infinity's NaN). The row is written in 16-byte stores (lanes'
// e4m3 bytes: 512 consecutive bytes), four 4-byte scale stores and k_pe's eight 16-byte
// stores.
template <typename T>
__device__ __forceinline__ void ds_mla_token(const float (&f)[2][8], int lane,
                                             const T* __restrict__ src_r,
                                             unsigned char* __restrict__ dst, bool vec) {
  uint4 pe = make_uint4(0, 0, 0, 0);
  if (lane < kDsMlaRope / 8) pe = load_chunk(src_r + 8 * lane, vec);
  const float amax = group_amax<kDsMlaGroup / 16>(f);
  const float flt_min = __uint_as_float(0x00800000u);  // the smallest normal float32
  const float scale = fmaxf(amax / 448.f, flt_min);
  *reinterpret_cast<uint4*>(dst + 16 * lane) = e4m3_bytes16(f, scale);
  if (lane % 8 == 0) *reinterpret_cast<float*>(dst + kDsMlaScales + lane / 2) = scale;
  if (lane < kDsMlaRope / 8) {
    *reinterpret_cast<uint4*>(dst + kDsMlaRopeBytes + 16 * lane) = chunk_to_bf16(pe, T{});
  }
}

// ceil(log2(q)) of a v4_fp8 group's q = amax / 448 (q >= 0, never NaN), clamped to [-126,
// 127], from q's bits as the reference takes it through frexp: 0 and any q up to 2^-126
// (subnormals included) give -126; an infinite q (a group holding an infinity) gives 0,
// frexp's exponent of an infinity as the reference takes it.
__device__ __forceinline__ int ue8m0_exponent(float q) {
  const unsigned bits = __float_as_uint(q);
  const int biased = static_cast<int>(bits >> 23);
  if (biased == 0xff) return 0;
  if (biased == 0) return -126;
  return min(biased - 127 + ((bits & 0x7fffffu) != 0u ? 1 : 0), 127);
}

// One token into a v4_fp8 row, lane `lane` holding its 16 values f: a group of 32 values
// is 2 lanes (one shuffle). Its scale is 2^e, e = ue8m0_exponent(amax / 448) (the power of
// two rounded up, so nothing saturates; 2^-126 for a group of zeros or NaN only; 2^0 for a
// group holding an infinity, whose values are then stored as they are, saturated: the
// infinity as +-448), each value x / 2^e in e4m3 (NaN 0x7F). Each lane stores its 16 e4m3
// bytes, each even lane its group's scale byte e + 127.
__device__ __forceinline__ void v4_fp8_token(const float (&f)[2][8], int lane,
                                             unsigned char* __restrict__ dst) {
  const int e = ue8m0_exponent(group_amax<kV4Fp8Group / 16>(f) / 448.f);
  const float scale = __uint_as_float(static_cast<unsigned>(e + 127) << 23);
  *reinterpret_cast<uint4*>(dst + 16 * lane) = e4m3_bytes16(f, scale);
  if (lane % 2 == 0) dst[kV4Values + lane / 2] = static_cast<unsigned char>(e + 127);
}

// float y as an e2m1 code (bit 3 the sign, bits 0-2 the index of |value| in {0, 0.5, 1,
// 1.5, 2, 3, 4, 6}): |y| rounded to nearest even (ties to the even index: 0.25 -> 0, 0.75
// -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) and saturated to 6, the sign kept
// (a negative value that rounds to 0 is -0, code 8, as the reference's conversion gives).
// The format has no NaN: NaN becomes code 0, +0.
__device__ __forceinline__ unsigned e2m1_code(float y) {
  const float a = fabsf(y);
  const unsigned m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                     (a >= 3.5f) + (a > 5.f);
  return a == a ? ((__float_as_uint(y) >> 28) & 8u) | m : 0u;
}

// One token into a v4_fp4 row, lane `lane` holding its 16 values f: a group of 16 values
// is one lane. Its scale is the smallest e4m3 value at least amax / 6 (amax / 6 in e4m3
// rounded to nearest even, one step up where that fell below it, but for 448, the
// largest; at least 2^-9, byte 0x01), each value x / scale (an IEEE division) in e2m1
// (e2m1_code: saturated to +-6; a group holding an infinity gets scale 448 and the
// infinity +-6). NaN, which the format cannot hold, is skipped by the amax and stored as
// 0: the row is the reference's for the token with its NaN replaced by 0 (the reference
// refuses NaN). Each lane stores its 8 bytes of codes and its scale byte.
__device__ __forceinline__ void v4_fp4_token(const float (&f)[2][8], int lane,
                                             unsigned char* __restrict__ dst) {
  static_assert(kV4Fp4Group == 16, "a group is one lane");
  const float q = group_amax<1>(f) / 6.f;
  unsigned sb = quantize2(q, 0.f, fp8_e4m3_t{}) & 0xffu;  // q >= 0: a byte up to 0x7E
  if (to_float(fp8_e4m3_t{static_cast<unsigned char>(sb)}) < q && sb < 0x7eu) ++sb;
  sb = max(sb, 1u);
  const float scale = to_float(fp8_e4m3_t{static_cast<unsigned char>(sb)});
  unsigned w[2] = {0u, 0u};  // value 16 lane + i at byte 8 lane + i / 2, the odd ones high
#pragma unroll
  for (int i = 0; i < 16; ++i) w[i / 8] |= e2m1_code(f[i / 8][i % 8] / scale) << (4 * (i % 8));
  *reinterpret_cast<uint2*>(dst + 8 * lane) = make_uint2(w[0], w[1]);
  dst[kV4Values / 2 + lane] = static_cast<unsigned char>(sb);
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
//
// C a sparse cache's token rows (is_sparse_row: fp8_ds_mla_t's 656 bytes, ds_mla_token;
// v4_fp8_t's 528, v4_fp8_token; v4_fp4_t's 288, v4_fp4_token): one warp per token
// (kCacheThreads / 32 tokens per CTA, grid ceil(num_tokens / 4)); latent_cache the rows'
// bytes, strides in bytes and multiples of 16, rope_cache and the scale unused (the
// formats compute their own scales). fp8_ds_mla: kv_lora_rank 512 and rope_dim 64; V4's:
// the token's 512 values are kv_c's kv_lora_rank then k_pe's rope_dim (checked on the
// host: both multiples of 8).
template <typename T, typename C, typename SlotT>
__global__ void __launch_bounds__(kCacheThreads)
    concat_and_cache_mla(const T* __restrict__ kv_c, long long kv_c_stride,
                         const T* __restrict__ k_pe, long long k_pe_stride,
                         C* __restrict__ latent_cache, long long lc_block, long long lc_token,
                         C* __restrict__ rope_cache, long long rc_block, long long rc_token,
                         const SlotT* __restrict__ slot_mapping, int num_tokens,
                         int kv_lora_rank, int rope_dim, int block_size, long long num_slots,
                         int vec_src, const float* __restrict__ scale, float scale_value) {
  static_assert(sizeof(T) == 2, "float16 or bfloat16 sources: eight values a chunk");
  if constexpr (is_sparse_row<C>::value) {
    const long long tok =
        static_cast<long long>(blockIdx.x) * (kCacheThreads / 32) + threadIdx.x / 32;
    if (tok >= num_tokens) return;  // whole warps: the shuffles see every lane
    const long long slot = static_cast<long long>(slot_mapping[tok]);
    if (slot < 0 || slot >= num_slots) return;
    unsigned char* dst = &latent_cache->bits + (slot / block_size) * lc_block +
                         (slot % block_size) * lc_token;
    const T* src_c = kv_c + tok * kv_c_stride;
    const T* src_r = k_pe + tok * k_pe_stride;
    constexpr bool ds = is_same<C, fp8_ds_mla_t>::value;
    const int lane = threadIdx.x & 31;
    float f[2][8];  // fp8_ds_mla: kv_c's 512 values (k_pe is a bfloat16 part of its own)
    lane_values16<T>(src_c, src_r, ds ? kDsMlaRank : kv_lora_rank, lane, vec_src != 0, f);
    if constexpr (ds) {
      ds_mla_token<T>(f, lane, src_r, dst, vec_src != 0);
    } else if constexpr (is_same<C, v4_fp8_t>::value) {
      v4_fp8_token(f, lane, dst);
    } else {
      v4_fp4_token(f, lane, dst);
    }
    return;
  } else {
    const long long tok = blockIdx.x;
    const long long slot = static_cast<long long>(slot_mapping[tok]);
    if (slot < 0 || slot >= num_slots) return;
    const long long block = slot / block_size;
    const long long offset = slot % block_size;
    const T* src_c = kv_c + tok * kv_c_stride;
    const T* src_r = k_pe + tok * k_pe_stride;
    C* dst_c = latent_cache + block * lc_block + offset * lc_token;
    C* dst_r = rope_cache + block * rc_block + offset * rc_token;
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
}

// A sparse cache's token rows widened to T (bfloat16) keys, all of them: row r of `rows`
// (C a token-row format, is_sparse_row; `row_stride` bytes apart, a multiple of 16 where
// there are two rows or more) into out + r * out_stride as its key's RANK + ROPE values
// (fp8_ds_mla: kv_c's 512 then k_pe's 64), each value exactly as the sparse readers widen
// it in shared memory (SparseRow's widen: the same bits). A prefill call whose query
// tokens select each cached token many times widens them once this way and reads the
// 16-bit rows (sparse_mla's rule). One thread a 16-byte unit of a row (SparseRow::kUnits
// a row), so a warp reads a row's consecutive chunks.
template <typename T, typename C>
__global__ void __launch_bounds__(kCacheThreads)
    widen_sparse_rows(const C* __restrict__ rows, long long row_stride, T* __restrict__ out,
                      long long out_stride, long long num_rows) {
  static_assert(is_sparse_row<C>::value && is_same<T, bfloat16_t>::value,
                "token rows widen to bfloat16");
  using Row = SparseRow<C>;
  const long long i = static_cast<long long>(blockIdx.x) * kCacheThreads + threadIdx.x;
  const long long r = i / Row::kUnits;
  if (r >= num_rows) return;
  const int u = static_cast<int>(i - r * Row::kUnits);
  uint4 v[2];
  int dim = 0;
  const int n = Row::widen(&rows->bits + r * row_stride, u, v, dim);
  T* dst = out + r * out_stride + dim;
  for (int k = 0; k < n; ++k) reinterpret_cast<uint4*>(dst)[k] = v[k];
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

// The lightning indexer's key cache (DeepSeek-V3.2's DSA; vLLM's indexer_k_quant_and_cache):
// a block of block_size tokens holds their e4m3 values token-major (block_size * head_dim
// bytes), then their float32 scales (head_dim / quant_block_size a token). Token tok of k
// [num_tokens, head_dim] goes to slot slot_mapping[tok] (block slot / block_size, offset
// o): its values at byte o * head_dim of the block, each group of quant_block_size
// divided by its scale max(amax, 1e-4) / 448 (amax of the group's |k|, NaN skipped; with
// ue8m0 rounded up to a power of two), its scales at byte block_size * head_dim + 4 * o *
// groups. A negative slot or one at or past num_slots writes nothing.
//
// One warp per token (kCacheThreads / 32 tokens a CTA): lane l holds the V = head_dim / 32
// values [V l, V l + V), so a group is quant_block_size / V lanes (a power of two, checked
// on the host) and its amax their shuffles. head_dim a multiple of 32 up to 512; k's rows
// read element by element (any alignment), the block base and stride 4-byte aligned.
template <typename T, typename SlotT>
__global__ void __launch_bounds__(kCacheThreads)
    indexer_k_quant_and_cache(const T* __restrict__ k, long long k_stride,
                              unsigned char* __restrict__ cache, long long block_stride,
                              const SlotT* __restrict__ slot_mapping, int num_tokens,
                              int head_dim, int quant_block_size, int block_size,
                              long long num_slots, int ue8m0) {
  constexpr int kMaxV = 16;  // head_dim 512
  const long long tok =
      static_cast<long long>(blockIdx.x) * (kCacheThreads / 32) + threadIdx.x / 32;
  if (tok >= num_tokens) return;  // whole warps: the shuffles see every lane
  const long long slot = static_cast<long long>(slot_mapping[tok]);
  if (slot < 0 || slot >= num_slots) return;  // the warp's lanes agree
  const int lane = threadIdx.x & 31;
  const int v = head_dim / 32;
  const T* src = k + tok * k_stride + lane * v;
  float f[kMaxV];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxV; ++i) {
    f[i] = i < v ? to_float(src[i]) : 0.f;
    amax = fmaxf(amax, fabsf(f[i]));  // fmaxf skips NaN
  }
  for (int o = quant_block_size / v / 2; o > 0; o >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  }
  float scale = fmaxf(amax, 1e-4f) / 448.f;
  if (ue8m0) {  // 2^ceil(log2(scale)), from its bits (a finite normal number here, or inf)
    const unsigned bits = __float_as_uint(scale);
    if ((bits & 0x7fffffu) != 0u && (bits >> 23) < 0xffu) {
      scale = __uint_as_float((bits & 0xff800000u) + 0x00800000u);
    }
  }
  const long long block = slot / block_size;
  const int offset = static_cast<int>(slot % block_size);
  unsigned char* base = cache + block * block_stride;
  unsigned char* dst = base + static_cast<long long>(offset) * head_dim + lane * v;
  // divided, not multiplied by the inverse: as the reference's x / scale rounds
#pragma unroll
  for (int i = 0; i < kMaxV; i += 4) {
    if (i < v) {
      const unsigned w = quantize2(f[i] / scale, f[i + 1] / scale, fp8_e4m3_t{}) |
                         (quantize2(f[i + 2] / scale, f[i + 3] / scale, fp8_e4m3_t{}) << 16);
      if (v % 4 == 0) {
        *reinterpret_cast<unsigned*>(dst + i) = w;
      } else {  // v 1 or 2 (head_dim 32 or 64): the bytes this lane owns
        for (int j = 0; j < v - i && j < 4; ++j) dst[i + j] = (w >> (8 * j)) & 0xffu;
      }
    }
  }
  if ((lane * v) % quant_block_size == 0) {
    const int groups = head_dim / quant_block_size;
    float* scales = reinterpret_cast<float*>(
        base + static_cast<long long>(block_size) * head_dim + 4LL * offset * groups);
    scales[lane * v / quant_block_size] = scale;
  }
}

}  // namespace cupaged
