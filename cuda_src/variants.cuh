// Attention variants: what a call changes about plain softmax attention, as small pieces
// the kernels compose. Features that touch the inner loop (which keys a query sees, how a
// score is transformed) are compile-time bits of VARIANT, so a call that does not use them
// compiles without their registers and branches. Features that only touch the epilogue
// (attention sinks, the log-sum-exp output) are null pointers at run time: they cost a
// test per output row, nothing per key.
//
// Conventions (cupaged.reference.attend is the float64 statement of them):
//   window W     a query at position p sees keys at positions > p - W (with causal: the W
//                positions (p - W, p], its own included). FlashInfer's window_left = W - 1.
//   soft-cap c   logits become c * tanh(logit / c), logit = scale * q.k; ALiBi is added
//                after the cap (the order of FlashInfer and vLLM's Triton backend).
//   sinks        float32 [num_heads], natural-log units: each head's softmax denominator
//                gains exp(sink); no value is attached (gpt-oss).
//   lse          float32 [rows, num_heads]: natural log of the softmax denominator, the
//                sink included; -inf for a row that saw no key and has no sink.
//   blocksparse  vLLM's pattern (paged_attention_v1/v2, decode only): a key in sparse block
//                sb = (key / BLOCK_SIZE * BLOCK_SIZE) / sparse_block is kept when
//                sb > q_sb - local_blocks or (sb + head_offset) % vert_stride == 0, with
//                q_sb the query's own sparse block.
#pragma once
#include "common.cuh"

namespace cupaged {

enum VariantBits : int {
  kVarWindow = 1,       // sliding window: keys before it are skipped, never read
  kVarSoftCap = 2,      // logits soft-cap
  kVarBlockSparse = 4,  // vLLM's blocksparse pattern (paged_decode only)
  kVarAlibi = 8,        // ALiBi slopes given (paged_prefill only: its tiles without masks
                        // add the bias as a ramp; paged_decode tests the pointer at run time)
  kVarFixedOffset = 16,  // with kVarSoftCap, bfloat16, no ALiBi (paged_prefill only): the
                         // softmax against a fixed offset instead of a running maximum
  kVarFlat = 32,  // paged_decode only: the flat split (paged_decode.cuh), decided by the
                  // planner, not by the call
  kVarSecondCache = 64,  // the sparse MLA kernels only: they read a second cache
                         // (DeepSeek-V4's extra_k_cache, mla_common.cuh's MlaSparseExtra)
  kVarTanhApprox = 128,  // with kVarSoftCap: the cap's tanh in one tanh.approx (the caller's
                         // cupaged.SoftCap(c, approx=True)) instead of exp2 and rcp
};

// kVarFixedOffset: soft-capped logits lie in [-C, C] (log2 units, C = c log2(e)), so the
// weights 2^(logit - o) with o = C - 64 lie in [2^(64 - 2C), 2^64], within [2^-92, 2^64]
// for C <= kMaxFixedCap. The softmax then needs no running maximum: no row maximum per
// tile (its shuffles, and the chain of dependent steps through it) and no rescaling.
// Within these limits nothing underflows or overflows:
//   - every weight is a normal fp32 (and bfloat16) number, whose relative precision is the
//     same at every exponent;
//   - sums of up to 2^31 weights stay below 2^95, and weights times values below fp32's
//     2^128 while the keys' count times max |v| stays below 2^64;
//   - the products p v stay normal for |v| >= 2^-34 (nothing relies on what the tensor
//     cores do with subnormal sums);
//   - a sink more than ~2^7 above o in log2 units flushes the keys' share, which is then
//     below 2^-60 of the row's denominator, to 0.
// (A top exponent of max(0, 2C - 92) instead of 64 would keep fp32's full headroom for
// C <= 46, but as a per-CTA value it measured 0.5-2% slower: docs/PERFORMANCE.md.)
// One rounding more than under a maximum: no weight is exactly 1, so each carries its
// bfloat16 rounding (2^-9) into P V; float16 P lacks the range altogether.
constexpr float kMaxFixedCap = 78.f;  // C; c <= 54.06 (Gemma 2's is 50). _variants.py too.
constexpr float kFixedTop = 64.f;     // the weights' top exponent

// The run-time values of the variants, passed by value to every attention kernel
// (mirrored by cupaged/_variants.py; 56 bytes).
struct VariantParams {
  const float* sinks;  // [num_heads] or null
  float* lse;          // [rows, num_heads] or null (split-KV decode: written by the combine)
  int window;          // kVarWindow: W >= 1
  float cap_in;        // kVarSoftCap: 2 / c, the factor of exp2's argument (below)
  float cap_out;       // kVarSoftCap: c * log2(e), the cap in the kernels' log2 units
  int sparse_local;    // kVarBlockSparse: local_blocks
  int sparse_vert;     //   vert_stride (>= 1)
  int sparse_block;    //   sparse block size in tokens
  int sparse_step;     //   head_sliding_step
  int sparse_tp_rank;  //   tp_rank: heads are numbered across the ranks
  int lse_keys;        // with sinks: 1 the lse is the keys' alone (FlashMLA's attn_sink rule),
                       // 0 it counts the sink (exp(lse) = the softmax's whole denominator)
};
static_assert(sizeof(VariantParams) == 56, "cupaged/_variants.py packs 56 bytes");

template <int VARIANT>
struct Variant {
  static constexpr bool kWindow = (VARIANT & kVarWindow) != 0;
  static constexpr bool kSoftCap = (VARIANT & kVarSoftCap) != 0;
  static constexpr bool kFlat = (VARIANT & kVarFlat) != 0;
  static constexpr bool kBlockSparse = (VARIANT & kVarBlockSparse) != 0;
  static constexpr bool kAlibi = (VARIANT & kVarAlibi) != 0;
  static constexpr bool kFixedOffset = (VARIANT & kVarFixedOffset) != 0;
  static constexpr bool kTanhApprox = (VARIANT & kVarTanhApprox) != 0;
  static_assert(VARIANT >= 0 && (VARIANT & ~(63 | kVarTanhApprox)) == 0, "VARIANT");
  static_assert(!kFixedOffset || (kSoftCap && !kAlibi),
                "a fixed offset needs logits bounded by the cap: soft-cap, no ALiBi");
  static_assert(!kTanhApprox || kSoftCap, "tanh.approx is the soft-cap's");

  // kFixedOffset (see kMaxFixedCap): the offset o = C - 64.
  __device__ __forceinline__ static float fixed_offset(const VariantParams& vp) {
    return vp.cap_out - kFixedTop;
  }

  // kFixedOffset: exp2's argument logit - o = 64 - 2C / (e^{2y} + 1) for a score s with
  // scale factors sk (the cap's steps with the constant 64, not C + (64 - C)).
  __device__ __forceinline__ static float fixed_exponent(const VariantParams& vp, float s,
                                                         float sk) {
    return cap_minus(vp, s, sk, kFixedTop);
  }

  // The logits transform of a score x = s * sk already in log2 units
  // (x = log2(e) * scale * q.k, sk the scale factors of s): c * tanh(logit / c) is
  // C * tanh(x / C) with C = c * log2(e), and tanh(y) = 1 - 2 / (e^{2y} + 1),
  // e^{2y} = 2^{2x / c}: two MUFU operations, accurate to about 1e-7 of C absolute. The
  // scale factors fold into the exponent's (s * (sk * 2 / c), sk * 2 / c loop-invariant
  // for per-tensor scales): one multiply per score fewer, as the multi-token kernel's
  // softmax is short of FMA-pipe issue slots (docs/PERFORMANCE.md). kTanhApprox: C tanh(y),
  // y = x ln2 / c, in one MUFU (tanh.approx.f32, FlashInfer's and FlashAttention's form),
  // off by up to about 2^-11 of C. Saturates to +-C, keeps NaN.
  __device__ __forceinline__ static float logits(const VariantParams& vp, float s, float sk) {
    if constexpr (kTanhApprox) {
      return vp.cap_out * fast_tanh(s * tanh_factor(vp, sk));
    } else if constexpr (kSoftCap) {
      const float e = fast_exp2(s * (sk * vp.cap_in));
      return vp.cap_out - __fdividef(2.f * vp.cap_out, e + 1.f);  // e = inf: C
    } else {
      return s * sk;
    }
  }

  // logits(s, sk) + add in the fewest instructions: the add joins the transform's last
  // step (plain: s * sk + add in one FFMA; soft-cap: C + add is loop-invariant).
  __device__ __forceinline__ static float logits_plus(const VariantParams& vp, float s, float sk,
                                                      float add) {
    if constexpr (kSoftCap) {
      return cap_minus(vp, s, sk, vp.cap_out + add);
    } else {
      return fmaf(s, sk, add);
    }
  }

  // top - 2C / (e^{2y} + 1), e^{2y} = 2^{2 s sk / c}: the soft-cap's steps ending at `top`
  // (C for the logit itself; a loop-invariant top folds an addition into the last FFMA).
  // (kTanhApprox: top - C + C tanh(y), top - C loop-invariant where top is.)
  __device__ __forceinline__ static float cap_minus(const VariantParams& vp, float s, float sk,
                                                    float top) {
    if constexpr (kTanhApprox) {
      return fmaf(vp.cap_out, fast_tanh(s * tanh_factor(vp, sk)), top - vp.cap_out);
    } else {
      const float e = fast_exp2(s * (sk * vp.cap_in));
      return fmaf(fast_rcp(e + 1.f), -2.f * vp.cap_out, top);
    }
  }

  // kTanhApprox: y = s sk ln2 / c = s * (sk * cap_in * ln2 / 2), the factor loop-invariant
  // for per-tensor scales.
  __device__ __forceinline__ static float tanh_factor(const VariantParams& vp, float sk) {
    return sk * (vp.cap_in * 0.34657359027997264f);
  }

  // The first key a query at q_pos sees: 0 without a window. (q_pos - W + 1 may be
  // negative; the callers clamp it to the keys they have.)
  __device__ __forceinline__ static int first_key(const VariantParams& vp, int q_pos) {
    if constexpr (kWindow) {
      return max(0, q_pos - vp.window + 1);
    } else {
      return 0;
    }
  }

  // vLLM's head offset of query head `head` (of KV head kv_head; this rank has num_heads
  // and num_kv_heads), reduced modulo vert_stride so the per-key test stays in 32 bits: a
  // step >= 0 slides over query heads, a negative one over KV heads.
  __device__ __forceinline__ static int sparse_offset(const VariantParams& vp, int head,
                                                      int kv_head, int num_heads,
                                                      int num_kv_heads) {
    if constexpr (kBlockSparse) {
      const long long rank = vp.sparse_tp_rank;
      const long long idx = vp.sparse_step >= 0 ? rank * num_heads + head
                                                : rank * num_kv_heads + kv_head;
      const long long step = vp.sparse_step >= 0 ? vp.sparse_step
                                                 : -static_cast<long long>(vp.sparse_step);
      return static_cast<int>((idx * step + 1) % vp.sparse_vert);
    } else {
      return 0;
    }
  }

  // The query's sparse block (its position q_pos is the sequence's last).
  __device__ __forceinline__ static int sparse_query_block(const VariantParams& vp, int q_pos) {
    if constexpr (kBlockSparse) {
      return max(q_pos, 0) / vp.sparse_block;
    } else {
      return 0;
    }
  }

  // Does the blocksparse pattern keep `key` for a head with offset `off`? (The window and
  // the causal limit are checked by the callers, with the bounds they already hold.)
  template <int BLOCK_SIZE>
  __device__ __forceinline__ static bool sparse_keep(const VariantParams& vp, int key, int q_sb,
                                                     int off) {
    if constexpr (kBlockSparse) {
      const int sb = (key / BLOCK_SIZE * BLOCK_SIZE) / vp.sparse_block;
      return sb > q_sb - vp.sparse_local || (sb + off) % vp.sparse_vert == 0;
    } else {
      return true;
    }
  }
};

// The end of a softmax row: running maximum m (log2 units) and sum l = sum 2^(s - m), plus
// an optional sink (log2 units; -inf for none). `mul` turns the accumulated sum of p * v
// into the output, `lse` is the natural log of the denominator. A row with no key and no
// sink gives mul 0 (zeros, never 0/0) and lse -inf, a sink of +inf zeros and lse +inf; a
// NaN sum stays NaN in both.
struct RowEnd {
  float mul;
  float lse;
};

__device__ __forceinline__ RowEnd finish_row(float m, float l, float sink) {
  constexpr float kLn2 = 0.6931471805599453f;
  if (sink == -neg_inf()) return l == l ? RowEnd{0.f, sink} : RowEnd{l, l};
  const float top = fmaxf(m, sink);
  if (top == neg_inf()) {  // no key, no sink: zeros; a NaN sum (a bad block) stays NaN
    return l == l ? RowEnd{0.f, neg_inf()} : RowEnd{l, l};
  }
  const float keys = m == neg_inf() ? 0.f : fast_exp2(m - top);  // l's factor under `top`
  const float den = l * keys + (sink == neg_inf() ? 0.f : fast_exp2(sink - top));
  if (den == 0.f) return {0.f, neg_inf()};
  return {keys / den, (top + log2f(den)) * kLn2};  // a NaN sum stays NaN in both
}

// The lse a row reports: finish_row's, or with vp.lse_keys the keys' alone (the sink left
// out, as FlashMLA reports it with attn_sink).
__device__ __forceinline__ float row_lse(const VariantParams& vp, RowEnd e, float m, float l) {
  return vp.lse_keys ? finish_row(m, l, neg_inf()).lse : e.lse;
}

// The end of one packed row of the multi-token kernels, once its sum `l` is reduced over
// the quad: the factor of its accumulators, with its scalars written by the quad's
// `writer`. NaN throughout for a bad block (`bad`). A split-KV partial (end_partial_row)
// is normalized by its own sum and leaves its maximum and sum in part_max / part_sum at
// `prow` (the combine adds the sink and writes the lse); a whole row (end_whole_row) gets
// finish_row's factor and writes its lse at `orow` when asked (row_lse: which one).
__device__ __forceinline__ float end_partial_row(float m, float l, bool bad, float out_scale,
                                                 long long prow, float* part_max,
                                                 float* part_sum, bool writer) {
  if (writer) {
    part_max[prow] = bad ? quiet_nan() : m;
    part_sum[prow] = bad ? quiet_nan() : l;
  }
  return bad ? quiet_nan() : l > 0.f ? out_scale / l : 0.f;
}

__device__ __forceinline__ float end_whole_row(const VariantParams& vp, float m, float l,
                                               bool bad, float out_scale, float sink,
                                               long long orow, bool writer) {
  const RowEnd e = finish_row(m, l, sink);
  const float inv = bad ? quiet_nan() : e.mul * out_scale;
  if (vp.lse != nullptr && writer) vp.lse[orow] = bad ? quiet_nan() : row_lse(vp, e, m, l);
  return inv;
}

// A head's sink in log2 units, or -inf without sinks.
__device__ __forceinline__ float sink_log2(const VariantParams& vp, int head) {
  constexpr float kLog2e = 1.4426950408889634f;
  return vp.sinks != nullptr ? __ldg(vp.sinks + head) * kLog2e : neg_inf();
}

}  // namespace cupaged
