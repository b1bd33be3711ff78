// DeepSeek's sparse-attention caches: one row of bytes a token, as cache types that name
// the format in a kernel's template arguments. cupaged.reference.quantize_sparse_kv is
// the statement of the bytes; the writer of all three is cache_ops.cuh's
// concat_and_cache_mla (a warp per token).
//
// DeepSeek-V3.2's ("fp8_ds_mla", vLLM's name): each token is one 656-byte row, kv_c's 512
// values in e4m3 (bytes 0-511), the four float32 scales of its groups of 128 values
// (512-527; value = fp8 * scale), then k_pe's 64 values as bfloat16 (528-655). Its readers
// are the sparse kernels mla_sparse_attention (mla_attention.cuh) and
// mla_sparse_attention_sm90 (mla_attention_sm90.cuh), through ds_mla_widen below.
//
// DeepSeek-V4's ("v4_fp8", "v4_fp4"): 512 values a token (d_qk 512, the 64 rotary dims
// inside), all quantized; no kernel reads them.
//   v4_fp8: 528 bytes: the values in e4m3 (bytes 0-511), then 16 ue8m0 scales, one per 32
//           values (512-527: a power of two stored as its biased exponent e + 127).
//   v4_fp4: 288 bytes: the values in e2m1 (bytes 0-255, value 2i in the low nibble of
//           byte i), then 32 e4m3 scales, one per 16 values (256-287).
#pragma once
#include "common.cuh"
#include "fp8.cuh"

namespace cupaged {

// The cache type that names the format in a kernel's template arguments.
struct fp8_ds_mla_t {
  unsigned char bits;
};
constexpr int kDsMlaRank = 512;   // kv_c's values
constexpr int kDsMlaRope = 64;    // k_pe's
constexpr int kDsMlaGroup = 128;  // values per scale
constexpr int kDsMlaScales = kDsMlaRank;                       // byte offsets in a row
constexpr int kDsMlaRopeBytes = kDsMlaScales + 4 * (kDsMlaRank / kDsMlaGroup);
constexpr int kDsMlaBytes = kDsMlaRopeBytes + 2 * kDsMlaRope;  // 656: 41 16-byte chunks
constexpr int kDsMlaChunks = kDsMlaBytes / 16;
static_assert(kDsMlaRopeBytes % 16 == 0 && kDsMlaBytes == 656, "16-byte aligned parts");

struct v4_fp8_t {
  unsigned char bits;
};
struct v4_fp4_t {
  unsigned char bits;
};
constexpr int kV4Values = 512;
constexpr int kV4Fp8Group = 32;  // values per ue8m0 scale
constexpr int kV4Fp8Bytes = kV4Values + kV4Values / kV4Fp8Group;      // 528
constexpr int kV4Fp4Group = 16;  // values per e4m3 scale
constexpr int kV4Fp4Bytes = kV4Values / 2 + kV4Values / kV4Fp4Group;  // 288
static_assert(kV4Fp8Bytes == 528 && kV4Fp4Bytes == 288 && kV4Fp8Bytes % 16 == 0 &&
                  kV4Fp4Bytes % 16 == 0,
              "rows of whole 16-byte chunks");

// The cache types of token rows (concat_and_cache_mla's warp-per-token writes).
template <typename C>
struct is_sparse_row {
  static constexpr bool value =
      is_same<C, fp8_ds_mla_t>::value || is_same<C, v4_fp8_t>::value || is_same<C, v4_fp4_t>::value;
};

template <typename C>
struct is_ds_mla {
  static constexpr bool value = false;
};
template <>
struct is_ds_mla<fp8_ds_mla_t> {
  static constexpr bool value = true;
};

// Chunk c (16 bytes) of a 656-byte row in shared memory (`row`) as the key's bfloat16
// values: chunks 0-31 are sixteen e4m3 values each, times their group's scale in float32
// and rounded to bfloat16 (FlashMLA's dequantization): two 8-value chunks v[0], v[1];
// chunk 32 holds the scales: none; chunks 33-40 are k_pe's bfloat16 values: one chunk,
// copied. Returns how many, and the key dim of v[0] in `dim`. A row of zeros (a slot not
// copied) widens to zeros.
__device__ __forceinline__ int ds_mla_widen(const unsigned char* row, int c, uint4 (&v)[2],
                                            int& dim) {
  constexpr int kLatChunks = kDsMlaRank / 16;
  if (c < kLatChunks) {
    const float scale =
        *reinterpret_cast<const float*>(row + kDsMlaScales + 4 * (c * 16 / kDsMlaGroup));
    widen16_scaled<bfloat16_t, fp8_e4m3_t>(*reinterpret_cast<const uint4*>(row + c * 16),
                                           &scale, 0, v[0], v[1]);
    dim = c * 16;
    return 2;
  }
  if (c >= kDsMlaRopeBytes / 16) {
    v[0] = *reinterpret_cast<const uint4*>(row + c * 16);
    dim = kDsMlaRank + (c - kDsMlaRopeBytes / 16) * 8;
    return 1;
  }
  return 0;
}

}  // namespace cupaged
