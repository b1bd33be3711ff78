// 8-bit float KV caches: OCP's E4M3 (fp8_e4m3fn: no infinities, one NaN pattern per sign,
// largest finite 448) and E5M2 (IEEE-like, largest finite 57344), as bit patterns.
//
// Widening is exact: every fp8 value is a float16, bfloat16 and float32 value. A cache
// stores value / scale and is read as value * scale in fp32: K's scales multiply the fp32
// scores and a per-tensor V scale the output, so nothing is rounded on the way; per-token
// V scales multiply the fp32 probabilities on the FMA paths, and on the tensor-core paths
// the values as they are widened (one rounding to T, as a 16-bit cache would hold them).
//
// Narrowing (the cache write) rounds to nearest even and saturates to the largest finite
// value (NaN becomes 0x7F, a NaN in both formats): cvt.rn.satfinite on sm_89 and newer, the
// same in integer arithmetic below that (or with CUPAGED_FP8_SOFTWARE defined: the
// environment variable CUPAGED_FP8_SOFTWARE=1 adds it to the NVRTC options, and
// tests/test_fp8.py checks that both paths give the same bits).
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(CUPAGED_FP8_SOFTWARE)
#define CUPAGED_FP8_HW 1
#else
#define CUPAGED_FP8_HW 0
#endif

namespace cupaged {

struct fp8_e4m3_t {
  unsigned char bits;
};
struct fp8_e5m2_t {
  unsigned char bits;
};

template <typename C>
struct Fp8Format;
template <>
struct Fp8Format<fp8_e4m3_t> {
  static constexpr int kMantissa = 3;
  static constexpr int kMinExp = -6;      // smallest normal exponent
  static constexpr float kMax = 448.f;    // largest finite
  static constexpr unsigned kMaxBits = 0x7e;
  static constexpr unsigned kNaN = 0x7f;
};
template <>
struct Fp8Format<fp8_e5m2_t> {
  static constexpr int kMantissa = 2;
  static constexpr int kMinExp = -14;
  static constexpr float kMax = 57344.f;
  static constexpr unsigned kMaxBits = 0x7b;
  static constexpr unsigned kNaN = 0x7f;
};

// ---- widening ----------------------------------------------------------------------------

// Two fp8 values (the low byte first) -> two float16 (the low half first).
__device__ __forceinline__ unsigned fp8x2_to_f16x2(unsigned v, fp8_e5m2_t) {
  // E5M2 is float16 with the low mantissa byte cut off.
  return __byte_perm(v, 0u, 0x1404);
}

__device__ __forceinline__ unsigned fp8x2_to_f16x2(unsigned v, fp8_e4m3_t) {
#if CUPAGED_FP8_HW
  unsigned r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(static_cast<unsigned short>(v)));
  return r;
#else
  // Place sign, exponent and mantissa in float16's fields (bias 15 instead of 7: the
  // value is 2^-8 times too small, subnormals included), then multiply by 2^8, exact.
  const unsigned x = __byte_perm(v, 0u, 0x1404);  // each byte in the high byte of a half
  unsigned r = ((x >> 1) & 0x3f803f80u) | (x & 0x80008000u);
  asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(r) : "r"(0x5c005c00u));  // 256.0 twice
  // The NaN pattern S.1111.111 would read as 480.
  if ((x & 0x7f00u) == 0x7f00u) r |= 0x7e00u;
  if ((x & 0x7f000000u) == 0x7f000000u) r |= 0x7e000000u;
  return r;
#endif
}

__device__ __forceinline__ void f16x2_to_floats(unsigned h, float& lo, float& hi) {
  unpack2(h, lo, hi, half_t{});
}

// Four fp8 values (a 32-bit word, the low byte first) -> four floats.
template <typename C>
__device__ __forceinline__ void unpack4(unsigned w, float* f, C) {
  f16x2_to_floats(fp8x2_to_f16x2(w & 0xffffu, C{}), f[0], f[1]);
  f16x2_to_floats(fp8x2_to_f16x2(w >> 16, C{}), f[2], f[3]);
}

__device__ __forceinline__ float to_float(fp8_e4m3_t v) {
  float f[4];
  unpack4(v.bits, f, fp8_e4m3_t{});
  return f[0];
}
__device__ __forceinline__ float to_float(fp8_e5m2_t v) {
  float f[4];
  unpack4(v.bits, f, fp8_e5m2_t{});
  return f[0];
}

// Two fp8 values -> two T (float16 or bfloat16) packed as an mma operand register.
template <typename T, typename C>
__device__ __forceinline__ unsigned fp8x2_to(unsigned v) {
  const unsigned h = fp8x2_to_f16x2(v, C{});
  if constexpr (is_same<T, half_t>::value) {
    return h;
  } else {
    float lo, hi;
    f16x2_to_floats(h, lo, hi);
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
}

// 16 fp8 values (16 bytes) -> 16 T (32 bytes), for tiles widened in shared memory.
template <typename T, typename C>
__device__ __forceinline__ void widen16(const uint4 raw, uint4& lo, uint4& hi) {
  lo.x = fp8x2_to<T, C>(raw.x & 0xffffu);
  lo.y = fp8x2_to<T, C>(raw.x >> 16);
  lo.z = fp8x2_to<T, C>(raw.y & 0xffffu);
  lo.w = fp8x2_to<T, C>(raw.y >> 16);
  hi.x = fp8x2_to<T, C>(raw.z & 0xffffu);
  hi.y = fp8x2_to<T, C>(raw.z >> 16);
  hi.z = fp8x2_to<T, C>(raw.w & 0xffffu);
  hi.w = fp8x2_to<T, C>(raw.w >> 16);
}

// The same, each value times its scale in fp32 and rounded to T: an fp8 cache's
// per-token V scales on the tensor-core paths, whose P operand is T (scaling P instead
// would push small probabilities into float16's subnormals). Value j's scale is
// scale[j * stride] (stride 0: one for all 16).
template <typename T, typename C>
__device__ __forceinline__ void widen16_scaled(const uint4 raw, const float* scale, int stride,
                                               uint4& lo, uint4& hi) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
  unsigned r[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float f[4];
    unpack4(w[i], f, C{});
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float a = f[2 * j] * scale[(4 * i + 2 * j) * stride];
      const float b = f[2 * j + 1] * scale[(4 * i + 2 * j + 1) * stride];
      if constexpr (is_same<T, half_t>::value) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r[2 * i + j]) : "f"(b), "f"(a));
      } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r[2 * i + j]) : "f"(b), "f"(a));
      }
    }
  }
  lo = make_uint4(r[0], r[1], r[2], r[3]);
  hi = make_uint4(r[4], r[5], r[6], r[7]);
}

// ---- narrowing -----------------------------------------------------------------------------

// Round to nearest even, saturating to +-kMax; NaN of either sign -> 0x7F, the canonical NaN
// cvt.rn.satfinite stores (the sign is dropped, as the instruction drops it). Integer
// arithmetic on the float's bits (sm_80/86, and the reference for the hardware path in
// tests).
template <typename C>
__device__ __forceinline__ unsigned quantize_fp8_software(float x) {
  using F = Fp8Format<C>;
  const unsigned u = __float_as_uint(x);
  const unsigned sign = (u >> 24) & 0x80u;
  const float a = fabsf(x);
  if (a != a) return F::kNaN;
  if (a >= F::kMax) return sign | F::kMaxBits;
  // Below the smallest normal the step is 2^(kMinExp - kMantissa): round a / step. The
  // result (0 .. 2^kMantissa) is the code itself; 2^kMantissa is the smallest normal.
  const float step_inv = __uint_as_float(static_cast<unsigned>(127 - F::kMinExp + F::kMantissa) << 23);
  if (a < __uint_as_float(static_cast<unsigned>(127 + F::kMinExp) << 23)) {
    return sign | static_cast<unsigned>(rintf(a * step_inv));
  }
  // Normal: a = 2^e * 1.m; keep kMantissa bits, rounding half to even.
  const int e = static_cast<int>((__float_as_uint(a) >> 23) & 0xff) - 127;
  const float scaled = a * __uint_as_float(static_cast<unsigned>(127 + F::kMantissa - e) << 23);
  unsigned m = static_cast<unsigned>(rintf(scaled));  // in [2^kM, 2^(kM + 1)]
  int ee = e;
  if (m == (2u << F::kMantissa)) {
    m >>= 1;
    ++ee;
  }
  const unsigned code = (static_cast<unsigned>(ee - F::kMinExp + 1) << F::kMantissa) |
                        (m - (1u << F::kMantissa));
  return sign | (code > F::kMaxBits ? F::kMaxBits : code);
}

// Two floats -> two fp8 bytes (the first in the low byte).
template <typename C>
__device__ __forceinline__ unsigned quantize2(float lo, float hi, C) {
#if CUPAGED_FP8_HW
  unsigned short r;
  if constexpr (is_same<C, fp8_e4m3_t>::value) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return r;
#else
  return quantize_fp8_software<C>(lo) | (quantize_fp8_software<C>(hi) << 8);
#endif
}

}  // namespace cupaged
