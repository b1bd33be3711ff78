// Hopper (sm_90a) pieces for products of 8-bit (fp8) operands: wgmma's 8-bit forms are
// sm90.cuh's Wgmma<fp8_e4m3_t or fp8_e5m2_t, N, 0> (k32 a step, both operands K-major);
// here P's fp32 accumulator becomes their register A operand, and a token-major V tile
// becomes the K-major V^T their B operand must be, in the same order of keys.
#pragma once
#include "fp8.cuh"
#include "sm90.cuh"

namespace cupaged {
namespace sm90 {

// An 8-bit A fragment from registers (rs, k32), per thread of warp w of the warpgroup:
// a[0] holds row 16w + lane/4 at k 4(lane%4) .. 4(lane%4) + 3 (the lowest k in the low
// byte), a[1] row + 8, a[2] k + 16, a[3] row + 8 and k + 16.
//
// fp8_a_fragment: the 32 columns 32c .. 32c + 31 of an fp32 accumulator (d[16c .. 16c +
// 15] in sm90.cuh's C layout) as such a fragment, each value rounded to C (cvt.rn.satfinite:
// nearest even, saturated). A thread holds columns 2t, 2t + 1, 8 + 2t and 9 + 2t of each
// 16 (t = lane % 4), not the 4t .. 4t + 3 the fragment's k positions name, so instead of
// exchanging values across the quad the columns go to the k positions in a fixed order:
// position 16h + 4t + i holds column 16h + 2t + i (i < 2) or 16h + 8 + 2t + i - 2 (i >= 2),
// fp8_k_column below. The product is the same when B's K rows are taken in that order
// (the column of P a position holds is the key B's row at that position must be).
__host__ __device__ constexpr int fp8_k_column(int position) {
  return (position & ~15) + 2 * ((position >> 2) & 3) + (position & 1) +
         ((position & 2) ? 8 : 0);
}
template <typename C, int N>
__device__ __forceinline__ void fp8_a_fragment(const float (&d)[N], int c, unsigned (&a)[4]) {
  static_assert(sizeof(C) == 1 && N % 16 == 0, "an 8-bit type, whole k32 blocks");
  const float* x = d + 16 * c;
  a[0] = quantize2(x[0], x[1], C{}) | (quantize2(x[4], x[5], C{}) << 16);
  a[1] = quantize2(x[2], x[3], C{}) | (quantize2(x[6], x[7], C{}) << 16);
  a[2] = quantize2(x[8], x[9], C{}) | (quantize2(x[12], x[13], C{}) << 16);
  a[3] = quantize2(x[10], x[11], C{}) | (quantize2(x[14], x[15], C{}) << 16);
}

// V^T for an 8-bit P V: wgmma's 8-bit B must be K-major, and V lies token-major. From
// `src` (shared-window address: TILE_N tokens of HEAD_SIZE bytes, token t at t *
// HEAD_SIZE, dense, as a raw stage holds them) into `dst`, a K-major [HEAD_SIZE rows (value
// dims)][TILE_N positions] tile (sw128_offset8 with HEAD_SIZE rows a block, 128 positions a
// block; 1024-byte aligned), position p holding token fp8_k_column(p), the order
// fp8_a_fragment gives P's columns. THREADS threads (ids 0 .. THREADS - 1 in `tid`) share
// the work: a unit is 16 tokens x 4 dims, read as 16 32-bit words (lanes take consecutive
// dims, so a warp reads whole token rows) and written, byte-transposed by PRMT, as four
// 16-byte chunks (one a dim). The caller orders the reads after the bytes landed and the
// writes before wgmma reads them (fence_async_smem and a barrier).
template <int HEAD_SIZE, int TILE_N, int THREADS>
__device__ __forceinline__ void fp8_transpose_v(unsigned src, unsigned dst, int tid) {
  static_assert(HEAD_SIZE % 4 == 0 && TILE_N % 128 == 0, "4-dim groups, whole 128-byte rows");
  constexpr int kGroups = HEAD_SIZE / 4;         // 4-dim groups a token row
  constexpr int kUnits = kGroups * (TILE_N / 16);
  static_assert(kUnits % THREADS == 0, "units shared evenly");
#pragma unroll
  for (int u0 = 0; u0 < kUnits; u0 += THREADS) {
    const int u = u0 + tid;
    const int m = u % kGroups, g = u / kGroups;  // dims 4m .. 4m + 3, positions 16g ..
    unsigned c[4][4];                            // [quad t][dim j]: positions 4t .. 4t + 3
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      unsigned r[4];  // the tokens at positions 16g + 4t + i, dims 4m .. 4m + 3
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        r[i] = ld_shared_u32(src + static_cast<unsigned>(fp8_k_column(16 * g + 4 * t + i) *
                                                         HEAD_SIZE + 4 * m));
      }
      const unsigned t0 = __byte_perm(r[0], r[1], 0x5140), t1 = __byte_perm(r[0], r[1], 0x7362);
      const unsigned t2 = __byte_perm(r[2], r[3], 0x5140), t3 = __byte_perm(r[2], r[3], 0x7362);
      c[t][0] = __byte_perm(t0, t2, 0x5410);
      c[t][1] = __byte_perm(t0, t2, 0x7632);
      c[t][2] = __byte_perm(t1, t3, 0x5410);
      c[t][3] = __byte_perm(t1, t3, 0x7632);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      st_shared_v4(dst + sw128_offset8(4 * m + j, 16 * g, HEAD_SIZE), c[0][j], c[1][j], c[2][j],
                   c[3][j]);
    }
  }
}

}  // namespace sm90
}  // namespace cupaged
