// Merging partial attention results by their log-sum-exp.
//
// A partial result over some set of keys is a row of outputs o (normalized: sum of the
// softmax-weighted values) and its lse, the natural log of its softmax denominator
// (sum of exp(logit)). Partials over disjoint key sets merge exactly:
//   m = max_p lse_p,  w_p = exp(lse_p - m),  out = sum_p w_p o_p / sum_p w_p,
//   lse = m + log(sum_p w_p).
// A partial with lse = -inf (it saw no key) has weight 0: the identity. When every
// partial of a row has lse = -inf, the row comes out as zeros with lse = -inf, never NaN;
// a single partial comes out as it is. NaN in any input reaches the output (nothing is
// masked).
#pragma once
#include "common.cuh"

namespace cupaged {

constexpr int kMergeThreads = 128;
constexpr int kMaxMergeStates = 8;

// The partials of one launch, by value in the kernel parameters: nothing to upload, and a
// captured CUDA graph keeps its own copy. out[p]: T [rows, heads, head_size], dims
// contiguous; lse[p]: float [rows, heads]. Strides in elements, free (negative included).
struct MergeInputs {
  const void* out[kMaxMergeStates];
  const float* lse[kMaxMergeStates];
  long long out_row[kMaxMergeStates];
  long long out_head[kMaxMergeStates];
  long long lse_row[kMaxMergeStates];
  long long lse_head[kMaxMergeStates];
  int count;  // 1 .. kMaxMergeStates
};

// N floats to N consecutive elements in one store of N * sizeof(T) bytes.
template <typename T, int N>
__device__ __forceinline__ void store_floats(T* p, const float (&f)[N]) {
  using V = typename RawVec<N * static_cast<int>(sizeof(T))>::type;
  union {
    V v;
    T e[N];
  } u;
#pragma unroll
  for (int i = 0; i < N; ++i) u.e[i] = from_float<T>(f[i]);
  *reinterpret_cast<V*>(p) = u.v;
}

// out[d] = sum_p w_p in_p[d] for this thread's dims, N at a time. Each thread reads every
// input element it writes before writing it, so `out` may be the first partial's memory.
// (No __restrict__ and no read-only loads: the inputs may be written by this kernel.)
template <typename T, int N>
__device__ __forceinline__ void merge_dims(const MergeInputs& in,
                                           const long long (&offset)[kMaxMergeStates],
                                           const float (&w)[kMaxMergeStates], T* out, int d0,
                                           int step, int head_size) {
  for (int d = d0; d < head_size; d += step) {
    float acc[N];
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = 0.f;
#pragma unroll
    for (int p = 0; p < kMaxMergeStates; ++p) {
      if (p < in.count) {
        float x[N];
        load_floats<T, N>(static_cast<const T*>(in.out[p]) + offset[p] + d, x);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = fmaf(w[p], x[i], acc[i]);
      }
    }
    store_floats<T, N>(out + d, acc);
  }
}

// Merge in.count partials into out [rows, heads, head_size] (strides out_row, out_head;
// dims contiguous) and lse_out [rows, heads] (may be null: not written).
//
// A group of 2^group_shift consecutive threads (at most a warp) serves one (row, head).
// vec != 0: the host checked that every out pointer and used stride (inputs and output)
// is a multiple of 16 bytes and head_size * sizeof(T) is too, so each thread moves 16
// bytes at a time; otherwise one element at a time.
//
// In place: out and lse_out may be exactly the first partial's out and lse. Every thread
// of a group reads the lses into registers first; lse_out is written after __syncwarp,
// once all of them have (a group never spans warps).
template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    merge_states(const __grid_constant__ MergeInputs in, T* out, long long out_row,
                 long long out_head, float* lse_out, long long lse_row, long long lse_head,
                 long long num_rows, int num_heads, int head_size, int group_shift, int vec) {
  const long long t = static_cast<long long>(blockIdx.x) * kMergeThreads + threadIdx.x;
  const long long pair = t >> group_shift;
  const int lane = static_cast<int>(t & ((1 << group_shift) - 1));
  const bool active = pair < num_rows * num_heads;
  const long long row = active ? pair / num_heads : 0;
  const long long head = active ? pair % num_heads : 0;

  float lse[kMaxMergeStates];
  float m = neg_inf();
#pragma unroll
  for (int p = 0; p < kMaxMergeStates; ++p) {
    lse[p] = neg_inf();
    if (active && p < in.count) {
      lse[p] = in.lse[p][row * in.lse_row[p] + head * in.lse_head[p]];
      m = fmaxf(m, lse[p]);  // ignores NaN: a NaN lse's weight below is NaN
    }
  }
  // Every lse -inf: subtract 0 (not -inf - -inf = NaN), so every weight is exp(-inf) = 0.
  const float sub = m == neg_inf() ? 0.f : m;
  float w[kMaxMergeStates];
  float den = 0.f;
#pragma unroll
  for (int p = 0; p < kMaxMergeStates; ++p) {
    w[p] = expf(lse[p] - sub);
    den += w[p];
  }
  float lse_merged = den == 0.f ? neg_inf() : sub + logf(den);
  if (in.count == 1) {
    // One partial is itself, copied as it is (a row that saw no key, or NaN, included).
    w[0] = 1.f;
    lse_merged = lse[0];
  } else if (den != 0.f) {
    // Normalized weights. den = 0 only when every weight is 0: the row is sum 0 * o = 0.
#pragma unroll
    for (int p = 0; p < kMaxMergeStates; ++p) w[p] /= den;
  }

  if (active) {
    long long offset[kMaxMergeStates];
#pragma unroll
    for (int p = 0; p < kMaxMergeStates; ++p) {
      offset[p] = row * in.out_row[p] + head * in.out_head[p];
    }
    T* o = out + row * out_row + head * out_head;
    const int group = 1 << group_shift;
    if (vec) {
      constexpr int N = 16 / static_cast<int>(sizeof(T));
      merge_dims<T, N>(in, offset, w, o, lane * N, group * N, head_size);
    } else {
      merge_dims<T, 1>(in, offset, w, o, lane, group, head_size);
    }
  }
  __syncwarp();
  if (active && lane == 0 && lse_out != nullptr) {
    lse_out[row * lse_row + head * lse_head] = lse_merged;
  }
}

}  // namespace cupaged
