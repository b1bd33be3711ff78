// Shared device helpers: storage types, conversions, vector loads, cp.async, reductions.
//
// The kernels deliberately avoid cuda_fp16.h / cuda_bf16.h: without them NVRTC needs no
// include path (nothing to locate in the user's CUDA install or wheels) and compiles a
// specialization several times faster. 16-bit values are plain bit patterns converted
// with single PTX instructions.
#pragma once

// cp.async, bf16 conversions and mma.m16n8k16 with bf16 need sm_80; the host refuses
// older devices before compiling anything (cupaged.planning.MIN_COMPUTE_CAPABILITY).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "cupaged's kernels need compute capability 8.0 or newer"
#endif

namespace cupaged {

struct half_t {
  unsigned short bits;
};
struct bfloat16_t {
  unsigned short bits;
};

template <typename A, typename B>
struct is_same {
  static constexpr bool value = false;
};
template <typename A>
struct is_same<A, A> {
  static constexpr bool value = true;
};

// conditional<B, X, Y>::type: X if B, else Y (NVRTC has no <type_traits>).
template <bool B, typename X, typename Y>
struct conditional {
  using type = X;
};
template <typename X, typename Y>
struct conditional<false, X, Y> {
  using type = Y;
};

// A bool as a type, to pick a generic lambda's body at compile time (std::bool_constant).
template <bool B>
struct BoolConstant {
  static constexpr bool value = B;
};

// ---- scalar conversions -------------------------------------------------------------

__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ float to_float(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}

__device__ __forceinline__ float to_float(bfloat16_t v) {
  return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float f);

template <>
__device__ __forceinline__ float from_float<float>(float f) {
  return f;
}

template <>
__device__ __forceinline__ half_t from_float<half_t>(float f) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}

template <>
__device__ __forceinline__ bfloat16_t from_float<bfloat16_t>(float f) {
  bfloat16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));
  return b;
}

// Two packed 16-bit values (low half first) -> two floats.
__device__ __forceinline__ void unpack2(unsigned w, float& lo, float& hi, half_t) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi)
      : "r"(w));
}

__device__ __forceinline__ void unpack2(unsigned w, float& lo, float& hi, bfloat16_t) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

// ---- vector loads: N consecutive elements (2, 4, 8 or 16 bytes) -> N floats ----------

template <int BYTES>
struct RawVec;
template <>
struct RawVec<1> {
  using type = unsigned char;
};
template <>
struct RawVec<2> {
  using type = unsigned short;
};
template <>
struct RawVec<4> {
  using type = unsigned;
};
template <>
struct RawVec<8> {
  using type = uint2;
};
template <>
struct RawVec<16> {
  using type = uint4;
};

template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* p, float (&f)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  static_assert(kBytes == 1 || kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16,
                "vector width");
  using V = typename RawVec<kBytes>::type;
  const V v = *reinterpret_cast<const V*>(p);
  if constexpr (sizeof(T) == 1) {  // fp8 (fp8.cuh): four values per 32-bit word
    if constexpr (kBytes < 4) {
      float g[4];
      unpack4(static_cast<unsigned>(v), g, T{});
#pragma unroll
      for (int i = 0; i < N; ++i) f[i] = g[i];
    } else {
      unsigned w[kBytes / 4];
      *reinterpret_cast<V*>(w) = v;
#pragma unroll
      for (int i = 0; i < N / 4; ++i) unpack4(w[i], f + 4 * i, T{});
    }
  } else if constexpr (kBytes == 2) {
    f[0] = to_float(*reinterpret_cast<const T*>(&v));
  } else {
    unsigned w[kBytes / 4];
    *reinterpret_cast<V*>(w) = v;
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int i = 0; i < N; ++i) f[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) unpack2(w[i], f[2 * i], f[2 * i + 1], T{});
    }
  }
}

// ---- asynchronous global -> shared copies ---------------------------------------------

// cp.async lets a whole tile be in flight while the previous one is computed.
// a * b as 64 bits in one instruction (mul.wide.u32): block offsets, whose factors the
// host keeps below 2^32 (left to the compiler, a zero-extended product stays 64 x 64).
__device__ __forceinline__ unsigned long long mul_wide(unsigned a, unsigned b) {
  unsigned long long r;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(r) : "r"(a), "r"(b));
  return r;
}

// .L2::128B: the L2 hint of the request's 128-byte line (docs/PERFORMANCE.md: measured
// with and without, the KV-streaming kernels' L2 -> SM traffic and DRAM rate).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

// The same with the destination as a shared-window address (__cvta_generic_to_shared),
// for loops that step it by constants instead of converting every pointer.
__device__ __forceinline__ void cp_async16_shared(unsigned smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}

// 16 bytes, or 16 zero bytes when `copy` is false (src-size 0: nothing is read, so `gmem`
// may be any address): slots past a sequence's keys, whose stale bytes could be NaN.
__device__ __forceinline__ void cp_async16_or_zero(unsigned smem, const void* gmem, bool copy) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem),
               "l"(gmem), "r"(copy ? 16 : 0));
}

// 4 bytes (per-token scales of an fp8 cache): .ca, the only form that copies fewer than 16.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// ---- warp reductions -------------------------------------------------------------------

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Over the quad of lanes (lane / 4 alike) that hold one row of an mma / wgmma accumulator.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Named barrier `id` (1 to 15: 0 is __syncthreads') over COUNT threads, a multiple of 32:
// sync waits until all have arrived, arrive counts the caller without waiting (a producer
// signalling a consumer that syncs).
template <int COUNT>
__device__ __forceinline__ void named_bar_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory");
}
template <int COUNT>
__device__ __forceinline__ void named_bar_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory");
}

// 2^x in one MUFU.EX2 (ex2.approx.ftz: 2 ulp, subnormal results flush to 0, 2^-inf = 0).
// exp2f without fast-math adds range fix-ups around it; softmax weights need neither.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x to about 1 ulp in one MUFU operation (rcp(inf) = 0, NaN stays NaN; results below
// 2^-126, for x above 2^126, flush to 0).
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) in one MUFU operation (tanh.approx.f32: relative error at most about 2^-11,
// PTX ISA; tanh(+-inf) = +-1, NaN stays NaN).
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The larger of m and |x| when x is finite; m when x is Inf or NaN (the largest finite
// magnitude of a query, which an Inf in one head must not set for the others).
__device__ __forceinline__ float finite_amax(float m, float x) {
  x = fabsf(x);
  return x < __int_as_float(0x7f800000) ? fmaxf(m, x) : m;
}

// s such that 2^s takes amax, a largest finite magnitude, into [2^14, 2^15): a 16-bit
// query's place in float16's range for float16 products (0 for amax 0; at most 100, so
// amax's below 2^-59 are scaled by 2^100 only; at least -113).
__device__ __forceinline__ int float16_range_shift(float amax) {
  const int biased = static_cast<int>(__float_as_uint(amax) >> 23);  // amax >= 0, finite
  return amax > 0.f ? min(141 - biased, 100) : 0;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

}  // namespace cupaged
