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
// inside), all quantized; the key is the whole vector and so is the value. Their readers
// are mla_sparse_attention and mla_sparse_attention_sm90 (RANK 512, ROPE 0), through
// SparseRow below.
//   v4_fp8: 528 bytes: the values in e4m3 (bytes 0-511), then 16 ue8m0 scales, one per 32
//           values (512-527: a power of two stored as its biased exponent e + 127).
//   v4_fp4: 288 bytes: the values in e2m1 (bytes 0-255, value 2i in the low nibble of
//           byte i), then 32 e4m3 scales, one per 16 values (256-287).
//
// Every reader widens a value to bfloat16 the one way: the stored value times its scale,
// both widened exactly to float32, multiplied in float32 and rounded to bfloat16 (nearest
// even). (FlashMLA rounds an fp8_ds_mla scale to bfloat16 first and multiplies in
// bfloat16: the same keys where the scale is a bfloat16 value, as its power-of-two
// quantizer writes it, and within one bfloat16 step for vLLM's amax / 448 scales.)
// For V4's formats the float32 product is exact (e4m3 times a power of two, e2m1 times
// e4m3), so the key is the reference's value (reference.dequantize_sparse_kv) rounded
// once to bfloat16: exactly that value wherever bfloat16 holds it as a normal number,
// which every v4_fp4 value is (|value| in [2^-10, 2688] or 0) and every v4_fp8 value
// concat_and_cache_mla writes from 16-bit sources is; a v4_fp8 product of 2^128 or more
// (a scale byte near 254 on large values) is +-inf, one under 2^-126 rounds to bfloat16's
// subnormals (steps of 2^-133), a scale byte 0xFF (ue8m0's NaN) gives NaN and byte 0 the
// scale 2^-127, as the reference reads them.
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

// Chunk c (16 bytes) of a 656-byte row in shared memory (`row`) as the key's bfloat16
// values: chunks 0-31 are sixteen e4m3 values each, times their group's scale in float32
// and rounded to bfloat16 (the header's rule): two 8-value chunks v[0], v[1];
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

// ue8m0 byte b (a v4_fp8 scale) as the float32 2^(b - 127): byte 0 is 2^-127 (a float32
// subnormal, not the field's 0), byte 0xFF NaN (float8_e8m0fnu's, as the reference reads it).
__device__ __forceinline__ float ue8m0_to_float(unsigned b) {
  return __uint_as_float(b == 0u ? 0x00400000u : b == 0xffu ? 0x7fffffffu : b << 23);
}

// Two e2m1 codes (a byte b, the even value's code in the low nibble) as a float16 pair
// 2^-14 times their values (the low half the even value's): each code's sign (bit 3) and
// its exponent and mantissa (bits 0-2) placed in float16's sign and lowest exponent and
// top mantissa bits, so code 1 (0.5) is float16's subnormal 2^-15 and code 7 (6) is
// 1.5 * 2^-12. Both shifts are of b's 8 bits into disjoint places: the multiplications
// are the ORs of two shifts.
__device__ __forceinline__ unsigned e2m1x2_to_f16x2_scaled(unsigned b) {
  return ((b * 0x00200200u) & 0x0e000e00u) | ((b * 0x01001000u) & 0x80008000u);
}

// The readers' view of a token row format: its bytes, its key's latent dims (RANK: also
// the value's) and rotary dims (ROPE), and how a landed row widens to bfloat16 in shared
// memory: kUnits units a row, unit u giving n <= 2 chunks of eight values v[0 .. n-1] at
// key dims dim, dim + 8. A row of zeros (a slot not copied) widens to zeros.
template <typename C>
struct SparseRow {
  static constexpr int kBytes = 0, kRank = 0, kRope = 0, kUnits = 0;  // not a token row
};

template <>
struct SparseRow<fp8_ds_mla_t> {
  static constexpr int kBytes = kDsMlaBytes, kRank = kDsMlaRank, kRope = kDsMlaRope;
  static constexpr int kUnits = kDsMlaChunks;  // 16-byte chunks (ds_mla_widen)
  static __device__ __forceinline__ int widen(const unsigned char* row, int u, uint4 (&v)[2],
                                              int& dim) {
    return ds_mla_widen(row, u, v, dim);
  }
};

// V4's units: values 16u .. 16u + 15 of a row, widened into v[0], v[1].
// v4_fp8: bytes 16u.., half a group of 32: sixteen e4m3 values times 2^(scale byte
// 512 + u / 2 - 127).
__device__ __forceinline__ void v4_widen16(const unsigned char* row, int u, uint4 (&v)[2],
                                           v4_fp8_t) {
  static_assert(kV4Fp8Group % 16 == 0, "a unit in one group");
  const float scale = ue8m0_to_float(row[kV4Values + u * 16 / kV4Fp8Group]);
  widen16_scaled<bfloat16_t, fp8_e4m3_t>(*reinterpret_cast<const uint4*>(row + u * 16), &scale,
                                         0, v[0], v[1]);
}

// v4_fp4: bytes 8u.., one group: sixteen e2m1 values times the e4m3 scale at byte 256 + u.
// The scale times 2^14 undoes the codes' float16 placement (e2m1x2_to_f16x2_scaled) in
// the same float32 product, exactly.
__device__ __forceinline__ void v4_widen16(const unsigned char* row, int u, uint4 (&v)[2],
                                           v4_fp4_t) {
  static_assert(kV4Fp4Group == 16, "a unit is one group");
  const float scale = to_float(fp8_e4m3_t{row[kV4Values / 2 + u]}) * 16384.f;  // * 2^14
  const uint2 codes = *reinterpret_cast<const uint2*>(row + u * 8);
  unsigned r[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float lo, hi;
    unpack2(e2m1x2_to_f16x2_scaled(((i < 4 ? codes.x : codes.y) >> (8 * (i % 4))) & 0xffu), lo,
            hi, half_t{});
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r[i]) : "f"(hi * scale), "f"(lo * scale));
  }
  v[0] = make_uint4(r[0], r[1], r[2], r[3]);
  v[1] = make_uint4(r[4], r[5], r[6], r[7]);
}

// V4's rows: 512 values with the rotary dims inside (ROPE 0), in units of sixteen.
template <typename C, int BYTES>
struct V4Row {
  static constexpr int kBytes = BYTES, kRank = kV4Values, kRope = 0;
  static constexpr int kUnits = kV4Values / 16;
  static __device__ __forceinline__ int widen(const unsigned char* row, int u, uint4 (&v)[2],
                                              int& dim) {
    v4_widen16(row, u, v, C{});
    dim = u * 16;
    return 2;
  }
};
template <>
struct SparseRow<v4_fp8_t> : V4Row<v4_fp8_t, kV4Fp8Bytes> {};
template <>
struct SparseRow<v4_fp4_t> : V4Row<v4_fp4_t, kV4Fp4Bytes> {};

}  // namespace cupaged
