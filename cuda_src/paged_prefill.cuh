// Paged attention for several query tokens per sequence (prefill, chunked prefill,
// speculative verify, mixed batches), on tensor cores, for 16-bit caches.
//
//   query  [total_q, num_heads, HEAD_SIZE] (token and head strides free, 16-byte aligned)
//          rows query_start_loc[s] .. query_start_loc[s + 1] belong to sequence s
//   cache  any PagedKV layout (kv_layout.cuh)
//   out    [total_q, num_heads, HEAD_SIZE] contiguous
//
// The q_len query tokens of a sequence are the last q_len of its seq_len cached tokens, so
// token i sits at position seq_len - q_len + i. Causal: it sees keys at positions up to its
// own (bottom-right alignment); otherwise all seq_len keys.
//
// Work split: one CTA per (sequence, tile of query rows, KV head). A sequence's rows are
// its tokens times the query heads of the KV head's group, packed token-major
// (row = token * group + head), so every K/V tile the CTA loads serves the whole group:
// four verify tokens of a 4-head group fill one 16-row mma tile. Each warp owns
// 16 * M_ATOMS rows (FlashAttention-2's split: no cross-warp reduction), walking the
// sequence's keys in tiles of TILE_N tokens streamed by cp.async, STAGES deep:
//   S = Q K^T (mma.m16n8k16, fp32 sums), scaled into the log2 domain, ALiBi, masks;
//   online softmax on the rows' registers;
//   O += P V with P rounded to T straight from the S fragments (no shared-memory trip).
// Grid y strides over query tiles, so a host bound that undercounts the longest query
// costs parallelism, never rows.
#pragma once
#include "common.cuh"
#include "kv_layout.cuh"
#include "mma.cuh"
#include "softmax.cuh"

namespace cupaged {

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int KV_FORMAT, int WARPS, int M_ATOMS,
          int TILE_N, int STAGES>
struct PrefillGeometry {
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kVec = 8;                              // 16-bit elements per 16 bytes
  static constexpr int kHSP = (HEAD_SIZE + 15) / 16 * 16;     // head size padded for mma's k
  static constexpr int kChunks = HEAD_SIZE / kVec;            // 16-byte chunks per row
  static constexpr int kWarpRows = 16 * M_ATOMS;
  static constexpr int kRows = WARPS * kWarpRows;             // query rows per CTA
  // Shared rows of kHSP elements are padded by 16 bytes: eight consecutive rows then start
  // in distinct 16-byte bank groups, so ldmatrix and the cp.async stores are conflict-free.
  static constexpr int kRow = kHSP + kVec;
  static constexpr bool kVDimMajor = KV_FORMAT == kFormatVllm;      // V stored [dim][token]
  static constexpr int kVRow = TILE_N + kVec;                 // its row, padded likewise
  static constexpr int kQBytes = kRows * kRow * 2;
  static constexpr int kKStage = TILE_N * kRow * 2;
  static constexpr int kVStage = kVDimMajor ? kHSP * kVRow * 2 : TILE_N * kRow * 2;
  static constexpr int kOffK = kQBytes;
  static constexpr int kOffV = kOffK + STAGES * kKStage;
  static constexpr int kOffFlag = kOffV + STAGES * kVStage;
  static constexpr int kSmemBytes = kOffFlag + 16;
  static constexpr int kNTiles = TILE_N / 8;  // n8 tiles of S per m16 atom
  static constexpr int kDTiles = kHSP / 8;    // n8 tiles of O per m16 atom

  static_assert(sizeof(T) == 2, "tensor cores take 16-bit operands");
  static_assert(HEAD_SIZE % 8 == 0 && HEAD_SIZE >= 32 && HEAD_SIZE <= 256, "HEAD_SIZE");
  static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && BLOCK_SIZE <= 256, "BLOCK_SIZE");
  static_assert(KV_FORMAT == kFormatTokenMajor || BLOCK_SIZE >= kVec,
                "vLLM's value layout is copied in runs of 8 tokens of one block");
  static_assert(TILE_N == 16 || TILE_N == 32 || TILE_N == 64 || TILE_N == 128, "TILE_N");
  static_assert(WARPS >= 1 && WARPS <= 8 && (M_ATOMS == 1 || M_ATOMS == 2), "WARPS, M_ATOMS");
  static_assert(STAGES >= 2, "STAGES");
};

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int KV_FORMAT, int WARPS, int M_ATOMS,
          int TILE_N, int STAGES>
__global__ void __launch_bounds__(WARPS * 32)
    paged_prefill(T* __restrict__ out, const T* __restrict__ query, long long q_token_stride,
                  long long q_head_stride, const __grid_constant__ PagedKV kv,
                  const int* __restrict__ seq_lens,
                  const int* __restrict__ query_start_loc,  // [num_seqs + 1], or null: one each
                  const float* __restrict__ alibi_slopes,   // [num_heads], or null
                  int num_heads, int group_size, int causal, float scale_log2) {
  using Geo = PrefillGeometry<T, HEAD_SIZE, BLOCK_SIZE, KV_FORMAT, WARPS, M_ATOMS, TILE_N, STAGES>;
  using KV = KVAccess<T, KV_FORMAT, BLOCK_SIZE>;
  constexpr int X = Geo::kVec;
  constexpr int NT = Geo::kThreads;
  constexpr int ROW = Geo::kRow;
  constexpr int MA = M_ATOMS;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* k_s = reinterpret_cast<T*>(smem + Geo::kOffK);
  T* v_s = reinterpret_cast<T*>(smem + Geo::kOffV);
  int* bad_block_s = reinterpret_cast<int*>(smem + Geo::kOffFlag);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int seq = blockIdx.x;
  const int kv_head = blockIdx.z;

  if (tid == 0 && dynamic_smem_bytes() < static_cast<unsigned>(Geo::kSmemBytes)) __trap();

  const int q_begin = query_start_loc != nullptr ? query_start_loc[seq] : seq;
  const int q_len = query_start_loc != nullptr ? query_start_loc[seq + 1] - q_begin : 1;
  // Lengths past the table's width are clamped so the row is never overrun; negative
  // lengths count as empty (cupaged.check_block_tables and CUPAGED_DEBUG report both).
  const int seq_len = max(0, min(seq_lens[seq], kv.max_blocks * BLOCK_SIZE));
  const int packed = q_len * group_size;  // validation keeps total_q * group below 2^31
  if (q_len <= 0 || static_cast<int>(blockIdx.y) * Geo::kRows >= packed) return;
  const int q_shift = seq_len - q_len;  // position of query token i is q_shift + i
  const int* bt_row = kv.block_tables + seq * kv.bt_stride;

  // Head-size padding (kHSP > HEAD_SIZE) must read as zeros in K: the padded query columns
  // are zero, and 0 * garbage may be NaN. cp.async never writes it, so clear it once.
  if constexpr (Geo::kHSP != HEAD_SIZE) {
    for (int r = tid; r < STAGES * TILE_N; r += NT) {
      *reinterpret_cast<uint4*>(k_s + r * ROW + HEAD_SIZE) = make_uint4(0, 0, 0, 0);
    }
  }

  // This thread's rows: atom a, half h (C-fragment rows lane / 4 and lane / 4 + 8).
  const int frag_row = lane >> 2;
  const int frag_col = (lane & 3) * 2;

  for (int qt = blockIdx.y; qt * Geo::kRows < packed; qt += gridDim.y) {
    const int row0 = qt * Geo::kRows;
    const int rows_here = min(Geo::kRows, packed - row0);
    // Keys any row of this tile may see: causal rows stop at their own position.
    const int last_pos = q_shift + (row0 + rows_here - 1) / group_size;
    const int kv_end = causal ? max(0, min(seq_len, last_pos + 1)) : seq_len;
    const int n_tiles = (kv_end + TILE_N - 1) / TILE_N;

    __syncthreads();  // the previous query tile is done with shared memory
    if (tid == 0) *bad_block_s = 0;

    // ---- the query tile: rows past the sequence's are zeros ------------------------------
    for (int u = tid; u < Geo::kRows * (Geo::kHSP / X); u += NT) {
      const int r = u / (Geo::kHSP / X);
      const int c = u % (Geo::kHSP / X);
      T* dst = q_s + r * ROW + c * X;
      if (r < rows_here && c < Geo::kChunks) {
        const int p = row0 + r;
        const int head = kv_head * group_size + p % group_size;
        cp_async16(dst, query + (q_begin + p / group_size) * q_token_stride +
                            head * q_head_stride + c * X);
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
    }

    // Per-row constants of this thread's rows.
    int q_pos[MA][2];
    int limit[MA][2];  // keys at positions < limit are seen
    float slope[MA][2];
#pragma unroll
    for (int a = 0; a < MA; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = row0 + warp * Geo::kWarpRows + a * 16 + frag_row + h * 8;
        q_pos[a][h] = q_shift + p / group_size;
        limit[a][h] = p >= packed ? 0 : causal ? max(0, min(seq_len, q_pos[a][h] + 1)) : seq_len;
        const int head = kv_head * group_size + p % group_size;
        slope[a][h] = (alibi_slopes != nullptr && p < packed) ? alibi_slopes[head] * kLog2e : 0.f;
      }
    }

    auto load_tile = [&](int tile, int stage) {
      const int t0 = tile * TILE_N;
      T* ks = k_s + stage * (TILE_N * ROW);
      T* vs = v_s + stage * (Geo::kVStage / 2);
      // Keys: consecutive threads take consecutive 16-byte runs of the cache.
      for (int u = tid; u < TILE_N * Geo::kChunks; u += NT) {
        int t, c;
        if constexpr (KV_FORMAT == kFormatTokenMajor) {
          t = u / Geo::kChunks;
          c = u % Geo::kChunks;
        } else {
          t = u % TILE_N;
          c = u / TILE_N;
        }
        const int tok = t0 + t;
        if (tok >= kv_end) continue;
        const int phys = physical_block(kv, bt_row, tok, BLOCK_SIZE);
        if (phys < 0) {
          *bad_block_s = 1;
          continue;
        }
        cp_async16(ks + t * ROW + c * X,
                   KV::key_chunk(kv, phys, kv_head, tok % BLOCK_SIZE, c));
      }
      if constexpr (Geo::kVDimMajor) {
        // vLLM's [dim][token] value: runs of X tokens of one dim, kept dim-major.
        for (int u = tid; u < HEAD_SIZE * (TILE_N / X); u += NT) {
          const int d = u / (TILE_N / X);
          const int t = (u % (TILE_N / X)) * X;
          const int tok = t0 + t;
          if (tok >= kv_end) continue;
          const int phys = physical_block(kv, bt_row, tok, BLOCK_SIZE);
          if (phys < 0) {
            *bad_block_s = 1;
            continue;
          }
          cp_async16(vs + d * Geo::kVRow + t, KV::value_chunk(kv, phys, kv_head, tok % BLOCK_SIZE, d));
        }
      } else {
        for (int u = tid; u < TILE_N * Geo::kChunks; u += NT) {
          const int t = u / Geo::kChunks;
          const int c = u % Geo::kChunks;
          const int tok = t0 + t;
          if (tok >= kv_end) continue;
          const int phys = physical_block(kv, bt_row, tok, BLOCK_SIZE);
          if (phys < 0) {
            *bad_block_s = 1;
            continue;
          }
          cp_async16(vs + t * ROW + c * X,
                     KV::value_chunk(kv, phys, kv_head, tok % BLOCK_SIZE, c));
        }
      }
    };

    float m_run[MA][2], l_run[MA][2];
    float acc[MA][Geo::kDTiles][4];
#pragma unroll
    for (int a = 0; a < MA; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m_run[a][h] = neg_inf();
        l_run[a][h] = 0.f;
      }
#pragma unroll
      for (int d = 0; d < Geo::kDTiles; ++d) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[a][d][i] = 0.f;
      }
    }

    // Prologue: the query travels in the first tile's copy group.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < n_tiles) load_tile(s, s);
      cp_async_commit();
    }

    const T* q_warp = q_s + warp * Geo::kWarpRows * ROW;
    for (int it = 0; it < n_tiles; ++it) {
      const int t0 = it * TILE_N;
      const int stage = it % STAGES;
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile `it` is visible and everyone is done with tile it - 1
      const int next = it + STAGES - 1;
      if (next < n_tiles) load_tile(next, next % STAGES);
      cp_async_commit();

      const T* ks = k_s + stage * (TILE_N * ROW);
      T* vs = v_s + stage * (Geo::kVStage / 2);
      const int valid = min(TILE_N, kv_end - t0);
      if (valid < TILE_N) {
        // Slots at or past kv_end were not copied (or hold tokens past the sequence,
        // possibly NaN); P is 0 there, and 0 * NaN is NaN, so V must read as zeros.
        if constexpr (Geo::kVDimMajor) {
          const int cols = TILE_N - valid;
          for (int i = tid; i < HEAD_SIZE * cols; i += NT) {
            vs[(i / cols) * Geo::kVRow + valid + i % cols] = T{};
          }
        } else {
          for (int i = tid; i < (TILE_N - valid) * (Geo::kHSP / 2); i += NT) {
            reinterpret_cast<unsigned*>(vs + (valid + i / (Geo::kHSP / 2)) * ROW)[i % (Geo::kHSP / 2)] = 0u;
          }
        }
        __syncthreads();
      }

      // ---- S = Q K^T --------------------------------------------------------------------
      float s[MA][Geo::kNTiles][4];
#pragma unroll
      for (int a = 0; a < MA; ++a) {
#pragma unroll
        for (int n = 0; n < Geo::kNTiles; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[a][n][i] = 0.f;
        }
      }
#pragma unroll
      for (int kk = 0; kk < Geo::kHSP / 16; ++kk) {
        unsigned qa[MA][4];
#pragma unroll
        for (int a = 0; a < MA; ++a) {
          // A: matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15), lanes 8m..8m+7 address matrix m.
          ldmatrix_x4(qa[a], q_warp + (a * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW +
                                 kk * 16 + (lane >> 4) * 8);
        }
#pragma unroll
        for (int np = 0; np < Geo::kNTiles / 2; ++np) {
          // B = K^T for two n8 tiles: rows of K are tokens, 16 bytes of dims each.
          unsigned kb[4];
          ldmatrix_x4(kb, ks + (np * 16 + (lane & 7) + (lane >> 4) * 8) * ROW + kk * 16 +
                              ((lane >> 3) & 1) * 8);
          const unsigned b0[2] = {kb[0], kb[1]};
          const unsigned b1[2] = {kb[2], kb[3]};
#pragma unroll
          for (int a = 0; a < MA; ++a) {
            mma_16816<T>(s[a][2 * np], qa[a], b0);
            mma_16816<T>(s[a][2 * np + 1], qa[a], b1);
          }
        }
      }

      // ---- scale, ALiBi, masks; online softmax ------------------------------------------
      float alpha[MA][2];
      unsigned pa[MA][TILE_N / 16][4];  // P as A fragments of the P V product
#pragma unroll
      for (int a = 0; a < MA; ++a) {
        float tmax[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < Geo::kNTiles; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {  // C fragment: row frag_row + 8 (i / 2), key n * 8 + frag_col + i % 2
            const int h = i >> 1;
            const int key = t0 + n * 8 + frag_col + (i & 1);
            const float v = fmaf(slope[a][h], static_cast<float>(key - q_pos[a][h]),
                                 s[a][n][i] * scale_log2);
            s[a][n][i] = key < limit[a][h] ? v : neg_inf();
            tmax[h] = fmaxf(tmax[h], s[a][n][i]);
          }
        }
        float sub[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(~0u, tmax[h], 1));
          tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(~0u, tmax[h], 2));
          alpha[a][h] = softmax_advance(m_run[a][h], tmax[h], sub[h]);
          l_run[a][h] *= alpha[a][h];
        }
#pragma unroll
        for (int n = 0; n < Geo::kNTiles; ++n) {
          const float p0 = exp2f(s[a][n][0] - sub[0]);
          const float p1 = exp2f(s[a][n][1] - sub[0]);
          const float p2 = exp2f(s[a][n][2] - sub[1]);
          const float p3 = exp2f(s[a][n][3] - sub[1]);
          const unsigned lo = pack2<T>(p0, p1);
          const unsigned hi = pack2<T>(p2, p3);
          // The sums add the rounded values the P V product uses: the output is then an
          // exact convex combination of the V rows.
          float r0, r1, r2, r3;
          unpack2(lo, r0, r1, T{});
          unpack2(hi, r2, r3, T{});
          l_run[a][0] += r0 + r1;
          l_run[a][1] += r2 + r3;
          // A fragment of k-step n / 2: regs 0,1 from n8 tile 2j (rows, rows + 8), 2,3 from 2j + 1.
          pa[a][n / 2][(n & 1) * 2 + 0] = lo;
          pa[a][n / 2][(n & 1) * 2 + 1] = hi;
        }
#pragma unroll
        for (int d = 0; d < Geo::kDTiles; ++d) {
          acc[a][d][0] *= alpha[a][0];
          acc[a][d][1] *= alpha[a][0];
          acc[a][d][2] *= alpha[a][1];
          acc[a][d][3] *= alpha[a][1];
        }
      }

      // ---- O += P V ---------------------------------------------------------------------
#pragma unroll
      for (int kk = 0; kk < TILE_N / 16; ++kk) {
        if (kk * 16 >= valid) break;
#pragma unroll
        for (int dp = 0; dp < Geo::kHSP / 16; ++dp) {
          unsigned vb[4];
          if constexpr (Geo::kVDimMajor) {
            ldmatrix_x4(vb, vs + (dp * 16 + (lane & 7) + (lane >> 4) * 8) * Geo::kVRow +
                                kk * 16 + ((lane >> 3) & 1) * 8);
          } else {
            // V rows are tokens: transposed loads give B's (token, dim) pairs.
            ldmatrix_x4_trans(vb, vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW +
                                      dp * 16 + (lane >> 4) * 8);
          }
          const unsigned b0[2] = {vb[0], vb[1]};
          const unsigned b1[2] = {vb[2], vb[3]};
#pragma unroll
          for (int a = 0; a < MA; ++a) {
            mma_16816<T>(acc[a][2 * dp], pa[a][kk], b0);
            mma_16816<T>(acc[a][2 * dp + 1], pa[a][kk], b1);
          }
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the bad-block flag is final

    // ---- normalize and store -------------------------------------------------------------
    const bool bad = *bad_block_s != 0;
#pragma unroll
    for (int a = 0; a < MA; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float l = l_run[a][h];
        l += __shfl_xor_sync(~0u, l, 1);
        l += __shfl_xor_sync(~0u, l, 2);
        const int p = row0 + warp * Geo::kWarpRows + a * 16 + frag_row + h * 8;
        if (p >= packed) continue;
        // A row that saw no key (an empty sequence's, or one before every cached token)
        // gets zeros, never 0 / 0.
        const float inv = bad ? quiet_nan() : (l > 0.f ? 1.f / l : 0.f);
        const int head = kv_head * group_size + p % group_size;
        T* o = out + (static_cast<long long>(q_begin + p / group_size) * num_heads + head) * HEAD_SIZE;
#pragma unroll
        for (int d = 0; d < Geo::kDTiles; ++d) {
          if (d * 8 >= HEAD_SIZE) continue;
          *reinterpret_cast<unsigned*>(o + d * 8 + frag_col) =
              pack2<T>(acc[a][d][2 * h] * inv, acc[a][d][2 * h + 1] * inv);
        }
      }
    }
  }
}

}  // namespace cupaged
