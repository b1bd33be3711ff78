// Online softmax in the log2 domain (scores pre-multiplied by log2(e), so exp2 is one
// instruction), and the merge of partial results computed over disjoint key ranges.
//
// A row's state is its running maximum m and its sum l = sum 2^(s - m) over the keys seen
// so far; the output accumulated so far is scaled by the same 2^(-m). Rows that have seen
// no key yet (m = -inf) must not produce -inf - -inf = NaN.
#pragma once
#include "common.cuh"

namespace cupaged {

// Advance a running maximum by a tile's maximum. Returns the factor that rescales what
// was accumulated under the old maximum; `sub` is what this tile's scores subtract before
// exp2 (0 while every score seen is -inf, so exp2 gives 0, never NaN).
__device__ __forceinline__ float softmax_advance(float& m_run, float tile_max, float& sub) {
  const float m_new = fmaxf(m_run, tile_max);
  sub = m_new == neg_inf() ? 0.f : m_new;
  const float alpha = exp2f(m_run - sub);
  m_run = m_new;
  return alpha;
}

// The two rows a thread holds of an m16 accumulator fragment (rows lane / 4 and + 8, each
// spread over a quad of lanes): each row's tile maximum taken over its quad, its running
// maximum advanced (softmax_advance: `sub` and the rescale factor `alpha`), its running
// sum rescaled.
__device__ __forceinline__ void advance_fragment_rows(float (&tmax)[2], float (&m_run)[2],
                                                      float (&l_run)[2], float (&sub)[2],
                                                      float (&alpha)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tmax[h] = quad_max(tmax[h]);
    alpha[h] = softmax_advance(m_run[h], tmax[h], sub[h]);
    l_run[h] *= alpha[h];
  }
}

// Weight of a partial result (max m_p, sum l_p) in a merge whose overall maximum is m:
// out = sum_p w_p o_p / sum_p w_p with o_p the partial's normalized output. A partial that
// saw no key (m_p = -inf) weighs 0, also when every partial is empty (m = -inf); a NaN
// partial (a bad block) stays NaN.
__device__ __forceinline__ float merge_weight(float m_p, float l_p, float m) {
  return m_p == neg_inf() ? 0.f : l_p * exp2f(m_p - m);
}

}  // namespace cupaged
