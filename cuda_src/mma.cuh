// Tensor-core pieces: ldmatrix loads of 8x8 16-bit matrices from shared memory and
// mma.m16n8k16 with fp32 sums, in PTX's fragment layouts. A thread's fragment element
// coordinates are spelled out where each kernel uses them.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

namespace cupaged {

// D = A (16x16, row) * B (16x8, col) + D, 16-bit inputs, fp32 sums.
// Fragment layouts are PTX's for mma.m16n8k16; ldmatrix loads them from shared memory
// (lane l gives the address of row l % 8 of matrix l / 8). The loads are volatile, so they
// stay on their side of barriers and cp.async waits, but clobber no memory: a clobber
// would make the compiler reload every cached value (kernel parameters, addresses) after
// each one. The mma is pure register arithmetic, free to be scheduled.

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(s));
}

// The same, each 8x8 matrix transposed on the way: for a B operand whose shared copy has
// the reduction dimension as its rows (V stored [token][dim] in P V).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(s));
}

// ---- fp8 tiles as float16 operands, widened in registers ---------------------------------
// ldmatrix moves 16-bit elements, so on a tile of bytes a thread's register holds four fp8
// values: with the plain load, bytes 4c .. 4c + 3 of row r (r = lane / 4, c = lane % 4);
// transposed, bytes 2r, 2r + 1 of rows 2c and 2c + 1. An mma fragment register pairs two
// values that are adjacent along the reduction dimension, so the kernels pick the order
// in which they feed the reduction to match (see paged_decode's fp8 path): what the mma
// sums over is permuted consistently in both operands, never the result.

// Bytes (0, 1) and (2, 3) of w as two float16 pairs: plain loads along the reduction.
template <typename C>
__device__ __forceinline__ void fp8x4_to_f16_halves(unsigned w, unsigned& lo, unsigned& hi) {
  lo = fp8x2_to_f16x2(w & 0xffffu, C{});
  hi = fp8x2_to_f16x2(w >> 16, C{});
}

// Bytes (0, 2) and (1, 3) of w as two float16 pairs: transposed loads, where bytes 0 and 2
// are one column of two adjacent rows and bytes 1 and 3 the next column.
template <typename C>
__device__ __forceinline__ void fp8x4_to_f16_columns(unsigned w, unsigned& even, unsigned& odd) {
  if constexpr (is_same<C, fp8_e5m2_t>::value) {  // each byte into the high byte of a half
    even = __byte_perm(w, 0u, 0x2404);
    odd = __byte_perm(w, 0u, 0x3414);
  } else {
    const unsigned p = __byte_perm(w, 0u, 0x3120);
    even = fp8x2_to_f16x2(p & 0xffffu, C{});
    odd = fp8x2_to_f16x2(p >> 16, C{});
  }
}

// Two floats rounded to T and packed (the first in the low half): an A or B fragment
// register built from fp32 values, such as probabilities held in C fragments. One
// cvt.rn.{f16,bf16}x2.f32 (sm_80+), which takes the high half first.
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);

template <>
__device__ __forceinline__ unsigned pack2<half_t>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <>
__device__ __forceinline__ unsigned pack2<bfloat16_t>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// A float16 pair times two fp32 scales, rounded to T (per-token V scales of fp8 tiles).
template <typename T>
__device__ __forceinline__ unsigned scale_f16x2(unsigned h, float s_lo, float s_hi) {
  float lo, hi;
  unpack2(h, lo, hi, half_t{});
  return pack2<T>(lo * s_lo, hi * s_hi);
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4],
                                          const unsigned (&b)[2]);

#define CUPAGED_MMA_16816(T, PTX_TYPE)                                                        \
  template <>                                                                                 \
  __device__ __forceinline__ void mma_16816<T>(float (&d)[4], const unsigned (&a)[4],         \
                                               const unsigned (&b)[2]) {                      \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE               \
                 ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"     \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));         \
  }
CUPAGED_MMA_16816(half_t, "f16")
CUPAGED_MMA_16816(bfloat16_t, "bf16")
#undef CUPAGED_MMA_16816

}  // namespace cupaged
