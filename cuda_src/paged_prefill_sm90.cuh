// Paged attention for several query tokens per sequence on Hopper (sm_90a): paged_prefill's
// contract and arguments (paged_prefill.cuh: query rows packed token-major within a KV
// head's group, bottom-right causal alignment, variants, split-KV partials, NaN rows for
// blocks outside the cache), on wgmma with warp specialization, for 16-bit token-major
// caches (NHD, HND, strided views) and head sizes that are multiples of 64.
//
// A CTA is three warpgroups over 128 packed query rows of one (sequence, KV head):
//   warpgroup 0, the producer, gathers each TILE_N-token K/V tile from the cache's pages
//   with cp.async into a ring of STAGES 128-byte-swizzled tiles (sm90.cuh); a stage's
//   `full` mbarrier completes when its copies have landed, its `empty` one when both
//   consumers are done with it. The producer gives up registers (setmaxnreg) so the
//   consumers can hold S, P and O at once.
//   warpgroups 1 and 2, the consumers, own 64 rows each: S = Q K^T (wgmma, Q and K from
//   shared memory, K K-major), scale, masks and online softmax on S's registers as
//   paged_prefill does, then O += P V (wgmma, P from registers, V MN-major: the same
//   swizzled [token][dim] tile as K). They run unsynchronized, so one's softmax overlaps
//   the other's matrix products.
// Grid and key ranges as paged_prefill's: grid x (sequence, KV head), grid y counts query
// tiles from each sequence's last (and strides over them), grid z the split-KV partitions.
#pragma once
#include "common.cuh"
#include "kv_layout.cuh"
#include "mma.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "variants.cuh"

namespace cupaged {

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int TILE_N, int STAGES>
struct Sm90PrefillGeometry {
  static constexpr int kThreads = 384;  // producer + two consumer warpgroups
  static constexpr int kWgRows = 64;    // query rows per consumer (wgmma's M)
  static constexpr int kRows = 2 * kWgRows;
  static constexpr int kChunks = HEAD_SIZE / 8;  // 16-byte chunks per row
  // O's wgmma N: 128 columns at a time where the head size allows, else 64.
  static constexpr int kOCols = HEAD_SIZE % 128 == 0 ? 128 : 64;
  static constexpr int kOChunks = HEAD_SIZE / kOCols;
  static constexpr int kQBytes = kRows * HEAD_SIZE * 2;
  static constexpr int kTileBytes = TILE_N * HEAD_SIZE * 2;  // one K or V stage
  static constexpr int kOffK = kQBytes;
  static constexpr int kOffV = kOffK + STAGES * kTileBytes;
  static constexpr int kOffBar = kOffV + STAGES * kTileBytes;  // full[STAGES], empty[STAGES]
  static constexpr int kOffFlag = kOffBar + 16 * STAGES;
  // Tiles need 1024-byte alignment (the swizzle's phase): the kernel rounds the dynamic
  // shared memory's base up, so it asks for 1024 bytes more.
  static constexpr int kSmemBytes = kOffFlag + 16 + 1024;
  // Registers per thread: the producer's copy loop needs few; the consumers take the rest
  // of the 64K (128 * (56 + 2 * 224) = 64512); 40 for the producer spills it.
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;

  static_assert(sizeof(T) == 2, "tensor cores take 16-bit operands");
  static_assert(HEAD_SIZE % 64 == 0 && HEAD_SIZE >= 64 && HEAD_SIZE <= 256, "HEAD_SIZE");
  static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && BLOCK_SIZE <= 256, "BLOCK_SIZE");
  static_assert(TILE_N == 64 || TILE_N == 128, "TILE_N: wgmma's N of S");
  static_assert(STAGES >= 2 && STAGES <= 4, "STAGES");
};

__device__ __forceinline__ void cta_sync() { asm volatile("bar.sync 0;\n" ::: "memory"); }

// The 128 threads of one warpgroup (named barrier 1 + wg).
__device__ __forceinline__ void warpgroup_sync(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(wg + 1) : "memory");
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int TILE_N, int STAGES, int VARIANT>
__global__ void __launch_bounds__(384, 1)
    paged_prefill_sm90(T* __restrict__ out, float* __restrict__ part_out,
                       float* __restrict__ part_max, float* __restrict__ part_sum,
                       int split_tiles, const T* __restrict__ query, long long q_token_stride,
                       long long q_head_stride, const __grid_constant__ PagedKV kv,
                       const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
                       const float* __restrict__ alibi_slopes, int num_heads, int group_size,
                       int causal, float scale_log2, const __grid_constant__ VariantParams vp) {
  using Geo = Sm90PrefillGeometry<T, HEAD_SIZE, BLOCK_SIZE, TILE_N, STAGES>;
  using KV = KVAccess<T, kFormatTokenMajor, BLOCK_SIZE>;
  using Var = Variant<VARIANT>;
  using namespace sm90;
  static_assert(!Var::kBlockSparse, "blocksparse is a decode variant");
  static_assert(!Var::kFixedOffset || is_same<T, bfloat16_t>::value,
                "a fixed softmax offset needs P in bfloat16 (fp32's exponent range)");
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int CH = Geo::kChunks;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  const unsigned base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const unsigned q_s = base;
  const unsigned k_s = base + Geo::kOffK;
  const unsigned v_s = base + Geo::kOffV;
  auto full_bar = [&](int s) { return base + Geo::kOffBar + 8u * s; };
  auto empty_bar = [&](int s) { return base + Geo::kOffBar + 8u * (STAGES + s); };
  volatile int* bad_block_s = reinterpret_cast<volatile int*>(smem + Geo::kOffFlag);

  const int tid = threadIdx.x;
  // Through a shuffle, so the compiler knows the warp (and its warpgroup) is uniform:
  // branches on them then keep wgmma out of divergent paths, which ptxas would serialize.
  const int warp = __shfl_sync(~0u, tid >> 5, 0);
  const int lane = tid & 31;
  const int num_kv_heads = num_heads / group_size;
  const int seq = blockIdx.x / num_kv_heads;
  const int kv_head = blockIdx.x - seq * num_kv_heads;

  if (tid == 0) {
    if (dynamic_smem_bytes() < static_cast<unsigned>(Geo::kSmemBytes)) __trap();
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar(s), 2 * 128);  // each producer thread: its copies, its stores
      mbar_init(empty_bar(s), 2 * 128);  // each consumer thread
    }
  }
  cta_sync();

  const int q_begin = query_start_loc != nullptr ? query_start_loc[seq] : seq;
  const int q_len = query_start_loc != nullptr ? query_start_loc[seq + 1] - q_begin : 1;
  const int seq_len = max(0, min(seq_lens[seq], kv.max_blocks * BLOCK_SIZE));
  const int packed = q_len * group_size;
  const int q_tiles = q_len > 0 ? (packed + Geo::kRows - 1) / Geo::kRows : 0;
  const int q_shift = seq_len - q_len;
  const int* bt_row = kv.block_tables + seq * kv.bt_stride;

  // The keys query tile qt reads, as paged_prefill computes them: [kv_lo, kv_end) in
  // n_tiles tiles from tile_base (this CTA's split-KV partition of them).
  struct Span {
    int kv_lo, kv_end, tile_base, n_tiles;
  };
  auto span_of = [&](int qt) {
    const int row0 = qt * Geo::kRows;
    const int rows_here = min(Geo::kRows, packed - row0);
    const int last_pos = q_shift + (row0 + rows_here - 1) / group_size;
    Span sp;
    sp.kv_end = causal ? max(0, min(seq_len, last_pos + 1)) : seq_len;
    sp.kv_lo = min(Var::first_key(vp, q_shift + row0 / group_size), sp.kv_end);
    sp.tile_base = sp.kv_lo / TILE_N;
    int tile_end = (sp.kv_end + TILE_N - 1) / TILE_N;
    if (split_tiles > 0) {
      const long long first = sp.tile_base + static_cast<long long>(blockIdx.z) * split_tiles;
      const int b = static_cast<int>(min(first, static_cast<long long>(tile_end)));
      if (blockIdx.z + 1 < gridDim.z) tile_end = min(tile_end, b + split_tiles);
      if (b > sp.tile_base) sp.kv_lo = b * TILE_N;
      sp.tile_base = b;
    }
    sp.n_tiles = sp.kv_lo < sp.kv_end ? tile_end - sp.tile_base : 0;
    return sp;
  };

  if (warp < 4) {
    // ---- producer ------------------------------------------------------------------------
    setmaxnreg_dec<Geo::kProducerRegs>();
    const typename KV::Head hd = KV::head(kv, kv_head);
    // Eight threads per token row (a warp's copies are whole 128-byte lines); thread tid
    // copies chunks c0, c0 + 8, ... of tokens tid / 8 + 16 k. The swizzled chunk of a
    // row depends on the row's index mod 8 only, which is this thread's for every token.
    constexpr int kTokPerPass = 128 / 8;
    constexpr int kPasses = TILE_N / kTokPerPass;
    constexpr int kCPer = CH / 8;
    const int c0 = tid & 7;
    const int trow = tid >> 3;
    const unsigned swz = static_cast<unsigned>((c0 ^ (trow & 7)) << 4);
    unsigned g = 0;  // tiles produced by this CTA: stage g % STAGES, its use g / STAGES
    for (int qt = q_tiles - 1 - static_cast<int>(blockIdx.y); qt >= 0; qt -= gridDim.y) {
      cta_sync();  // the previous query tile is finished
      if (tid == 0) *bad_block_s = 0;
      cta_sync();
      const Span sp = span_of(qt);
      for (int it = 0; it < sp.n_tiles; ++it, ++g) {
        const int stage = g % STAGES;
        mbar_wait(empty_bar(stage), ((g / STAGES) & 1) ^ 1);  // a fresh barrier passes
        const int t0 = (sp.tile_base + it) * TILE_N;
        const unsigned ks = k_s + stage * Geo::kTileBytes;
        const unsigned vs = v_s + stage * Geo::kTileBytes;
        int phys[kPasses];
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
          const int token = t0 + pass * kTokPerPass + trow;
          phys[pass] = -2;  // not copied: past the keys or before the window
          if (token < sp.kv_end && !(Var::kWindow && token < sp.kv_lo)) {
            phys[pass] = __ldg(bt_row + token / BLOCK_SIZE);
            if (static_cast<unsigned>(phys[pass]) >= static_cast<unsigned>(kv.num_blocks)) {
              phys[pass] = -1;
            }
          }
        }
        bool stored = false;
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
          const unsigned t = pass * kTokPerPass + trow;
          const unsigned row = t * 128 + swz;
          if (phys[pass] >= 0) {
            const unsigned within = static_cast<unsigned>(t0 + t) % BLOCK_SIZE;
            const unsigned long long pb = static_cast<unsigned long long>(phys[pass]);
            const T* gk = hd.k + pb * hd.k_block + within * hd.k_token + c0 * 8;
            const T* gv = hd.v + pb * hd.v_block + within * hd.v_token + c0 * 8;
#pragma unroll
            for (int i = 0; i < kCPer; ++i) {
              cp_async16_shared(ks + i * TILE_N * 128 + row, gk + i * 64);
            }
#pragma unroll
            for (int i = 0; i < kCPer; ++i) {
              cp_async16_shared(vs + i * TILE_N * 128 + row, gv + i * 64);
            }
          } else {
            // P is 0 on these keys, and 0 * a stale NaN would be NaN: V must read as
            // zeros (K need not: their scores are masked).
            if (phys[pass] == -1) *bad_block_s = 1;
#pragma unroll
            for (int i = 0; i < kCPer; ++i) {
              asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(
                               vs + i * TILE_N * 128 + row),
                           "r"(0)
                           : "memory");
            }
            stored = true;
          }
        }
        if (stored) fence_async_smem();  // ordinary stores that wgmma reads next
        cp_async_mbar_arrive(full_bar(stage));
        mbar_arrive(full_bar(stage));
      }
    }
    cp_async_wait<0>();
    return;
  }

  // ---- consumers --------------------------------------------------------------------------
  setmaxnreg_inc<Geo::kConsumerRegs>();
  const int wg = warp / 4 - 1;
  const int ctid = tid - 128 * (wg + 1);
  const int cwarp = ctid >> 5;
  const unsigned q_wg = q_s + wg * Geo::kWgRows * HEAD_SIZE * 2;
  const int frag_row = lane >> 2;
  const int frag_col = (lane & 3) * 2;
  float score_scale = scale_log2;
  constexpr float out_scale = 1.f;

  float s[TILE_N / 2];  // S of 64 rows x TILE_N keys: s[4n + i] is mma's C fragment i of n8 tile n
#pragma unroll
  for (int i = 0; i < TILE_N / 2; ++i) s[i] = 0.f;

  unsigned g = 0;
  for (int qt = q_tiles - 1 - static_cast<int>(blockIdx.y); qt >= 0; qt -= gridDim.y) {
    cta_sync();
    cta_sync();  // the producer has reset the bad-block flag
    const Span sp = span_of(qt);
    const int row0 = qt * Geo::kRows + wg * Geo::kWgRows;  // this warpgroup's first row

    // ---- the query rows: rows past the sequence's are zeros ------------------------------
    for (int u = ctid; u < Geo::kWgRows * CH; u += 128) {
      const int r = u / CH;
      const int c = u % CH;
      const unsigned dst = q_wg + sw128_offset(r, c * 8, Geo::kWgRows);
      const int p = row0 + r;
      if (p < packed) {
        const int head = kv_head * group_size + p % group_size;
        cp_async16_shared(dst, query + (q_begin + p / group_size) * q_token_stride +
                                   head * q_head_stride + c * 8);
      } else {
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0) : "memory");
      }
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_smem();
    warpgroup_sync(wg);

    // Per-row constants of this thread's two rows (h: C-fragment rows lane / 4 and + 8).
    int q_pos[2], limit[2], first[2];
    float slope[2];
    int lim_lo = 0x7fffffff, first_hi = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int p = row0 + cwarp * 16 + frag_row + h * 8;
      q_pos[h] = q_shift + p / group_size;
      limit[h] = p >= packed ? 0 : causal ? max(0, min(seq_len, q_pos[h] + 1)) : seq_len;
      first[h] = Var::first_key(vp, q_pos[h]);
      const int head = kv_head * group_size + p % group_size;
      slope[h] = (alibi_slopes != nullptr && p < packed) ? alibi_slopes[head] * kLog2e : 0.f;
      lim_lo = min(lim_lo, limit[h]);
      if (p < packed) first_hi = max(first_hi, first[h]);
    }
    lim_lo = __reduce_min_sync(~0u, lim_lo);  // this warp's tiles below it need no mask
    if constexpr (Var::kWindow) first_hi = __reduce_max_sync(~0u, first_hi);
    // The warpgroup's bounds (its rows' limits grow with the row): tiles from wg_hi on, or
    // before every row's window, hold nothing for it. Uniform over the warpgroup, as the
    // wgmma it skips must be.
    const int wg_last = min(row0 + Geo::kWgRows, packed) - 1;
    const int wg_hi = row0 >= packed ? 0
                      : causal       ? max(0, min(seq_len, q_shift + wg_last / group_size + 1))
                                     : seq_len;
    const int wg_first = Var::first_key(vp, q_shift + row0 / group_size);
    const bool plain = Var::kAlibi || alibi_slopes == nullptr;

    float m_run[2] = {neg_inf(), neg_inf()};
    float l_run[2] = {0.f, 0.f};
    float o[Geo::kOChunks][Geo::kOCols / 2];
#pragma unroll
    for (int c = 0; c < Geo::kOChunks; ++c) {
#pragma unroll
      for (int i = 0; i < Geo::kOCols / 2; ++i) o[c][i] = 0.f;
    }

    for (int it = 0; it < sp.n_tiles; ++it, ++g) {
      const int stage = g % STAGES;
      const int t0 = (sp.tile_base + it) * TILE_N;
      mbar_wait(full_bar(stage), (g / STAGES) & 1);
      fence_async_smem();  // cp.async's writes, read next by wgmma
      if (t0 < wg_hi && !(Var::kWindow && t0 + TILE_N <= wg_first)) {
        const unsigned ks = k_s + stage * Geo::kTileBytes;
        const unsigned vs = v_s + stage * Geo::kTileBytes;
        // ---- S = Q K^T ----------------------------------------------------------------
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_SIZE / 16; ++kk) {
          Wgmma<T, TILE_N, 0>::ss(s, kmajor_desc(q_wg, kk * 16, Geo::kWgRows),
                                  kmajor_desc(ks, kk * 16, TILE_N), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();

        // ---- scale (ALiBi, masks where needed); online softmax --------------------------
        const bool masked = !plain || t0 + TILE_N > lim_lo || (Var::kWindow && t0 < first_hi);
        float tmax[2] = {neg_inf(), neg_inf()};
        if (masked) {
#pragma unroll
          for (int n = 0; n < TILE_N / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int h = i >> 1;
              const int key = t0 + n * 8 + frag_col + (i & 1);
              float& x = s[4 * n + i];
              const float v = Var::kFixedOffset
                                  ? Var::fixed_exponent(vp, x, score_scale)
                                  : fmaf(slope[h], static_cast<float>(key - q_pos[h]),
                                         Var::logits(vp, x, score_scale));
              const bool seen = key < limit[h] && (!Var::kWindow || key >= first[h]);
              x = seen ? v : neg_inf();
              tmax[h] = fmaxf(tmax[h], x);
            }
          }
        } else if constexpr (Var::kAlibi) {
          float base_h[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            base_h[h] = slope[h] * static_cast<float>(t0 + frag_col - q_pos[h]);
          }
#pragma unroll
          for (int n = 0; n < TILE_N / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int h = i >> 1;
              float& x = s[4 * n + i];
              x = fmaf(slope[h], static_cast<float>(n * 8 + (i & 1)),
                       Var::logits_plus(vp, x, score_scale, base_h[h]));
              tmax[h] = fmaxf(tmax[h], x);
            }
          }
        } else {
#pragma unroll
          for (int n = 0; n < TILE_N / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              float& x = s[4 * n + i];
              x = Var::kFixedOffset ? Var::fixed_exponent(vp, x, score_scale)
                                    : Var::logits(vp, x, score_scale);
              tmax[i >> 1] = fmaxf(tmax[i >> 1], x);
            }
          }
        }
        float sub[2] = {0.f, 0.f}, alpha[2] = {1.f, 1.f};
        if constexpr (!Var::kFixedOffset) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(~0u, tmax[h], 1));
            tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(~0u, tmax[h], 2));
            alpha[h] = softmax_advance(m_run[h], tmax[h], sub[h]);
            l_run[h] *= alpha[h];
          }
        }
        unsigned pa[TILE_N / 16][4];  // P as wgmma's register A fragments, per k16 step
#pragma unroll
        for (int n = 0; n < TILE_N / 8; ++n) {
          const float p0 = fast_exp2(s[4 * n + 0] - sub[0]);
          const float p1 = fast_exp2(s[4 * n + 1] - sub[0]);
          const float p2 = fast_exp2(s[4 * n + 2] - sub[1]);
          const float p3 = fast_exp2(s[4 * n + 3] - sub[1]);
          l_run[0] += p0 + p1;
          l_run[1] += p2 + p3;
          pa[n / 2][(n & 1) * 2 + 0] = pack2<T>(p0, p1);
          pa[n / 2][(n & 1) * 2 + 1] = pack2<T>(p2, p3);
        }
        if (!Var::kFixedOffset && __any_sync(~0u, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
          for (int c = 0; c < Geo::kOChunks; ++c) {
#pragma unroll
            for (int j = 0; j < Geo::kOCols / 8; ++j) {
              o[c][4 * j + 0] *= alpha[0];
              o[c][4 * j + 1] *= alpha[0];
              o[c][4 * j + 2] *= alpha[1];
              o[c][4 * j + 3] *= alpha[1];
            }
          }
        }

        // ---- O += P V -------------------------------------------------------------------
        wgmma_fence();
        // Every k-step, also past the keys (V is zero there): a data-dependent exit from
        // this loop would make ptxas serialize every wgmma of the kernel.
#pragma unroll
        for (int kk = 0; kk < TILE_N / 16; ++kk) {
#pragma unroll
          for (int c = 0; c < Geo::kOChunks; ++c) {
            Wgmma<T, Geo::kOCols, 1>::rs(o[c], pa[kk],
                                         mnmajor_desc(vs, kk * 16, c * Geo::kOCols, TILE_N), 1);
          }
        }
        wgmma_commit();
        wgmma_wait<0>();
      }
      mbar_arrive(empty_bar(stage));
    }

    // ---- normalize and store (every tile's full barrier passed: the flag is final) -------
    const bool bad = *bad_block_s != 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(~0u, l, 1);
      l += __shfl_xor_sync(~0u, l, 2);
      const int p = row0 + cwarp * 16 + frag_row + h * 8;
      if (p >= packed) continue;
      const int head = kv_head * group_size + p % group_size;
      const long long orow = static_cast<long long>(q_begin + p / group_size) * num_heads + head;
      const float m = !Var::kFixedOffset ? m_run[h]
                      : l == 0.f         ? neg_inf()
                                         : Var::fixed_offset(vp);
      if (split_tiles > 0) {
        const long long prow = orow * gridDim.z + blockIdx.z;
        if ((lane & 3) == 0) {
          part_max[prow] = bad ? quiet_nan() : m;
          part_sum[prow] = bad ? quiet_nan() : l;
        }
        const float inv = bad ? quiet_nan() : l > 0.f ? out_scale / l : 0.f;
        float* dst = part_out + prow * HEAD_SIZE;
#pragma unroll
        for (int c = 0; c < Geo::kOChunks; ++c) {
#pragma unroll
          for (int j = 0; j < Geo::kOCols / 8; ++j) {
            *reinterpret_cast<float2*>(dst + c * Geo::kOCols + j * 8 + frag_col) =
                make_float2(o[c][4 * j + 2 * h] * inv, o[c][4 * j + 2 * h + 1] * inv);
          }
        }
        continue;
      }
      const RowEnd e = finish_row(m, l, sink_log2(vp, head));
      const float inv = bad ? quiet_nan() : e.mul * out_scale;
      if (vp.lse != nullptr && (lane & 3) == 0) vp.lse[orow] = bad ? quiet_nan() : e.lse;
      T* dst = out + orow * HEAD_SIZE;
#pragma unroll
      for (int c = 0; c < Geo::kOChunks; ++c) {
#pragma unroll
        for (int j = 0; j < Geo::kOCols / 8; ++j) {
          *reinterpret_cast<unsigned*>(dst + c * Geo::kOCols + j * 8 + frag_col) =
              pack2<T>(o[c][4 * j + 2 * h] * inv, o[c][4 * j + 2 * h + 1] * inv);
        }
      }
    }
  }
}

}  // namespace cupaged
