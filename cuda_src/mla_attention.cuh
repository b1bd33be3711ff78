// Absorbed multi-head latent attention (DeepSeek's MLA) over a paged latent cache, on
// tensor cores (mma.sync, sm_80+), for decode, multi-token prediction, verify and chunked
// prefill in one varlen batch.
//
//   q      a latent part [total_q, num_heads, RANK] and a rotary part [.., ROPE] (two
//          pointers with their own token and head strides: one [.., RANK + ROPE] array
//          is the pair at offsets 0 and RANK)
//   cache  a latent part [num_blocks, BLOCK_SIZE, RANK] and a rotary part [.., ROPE] of C,
//          T itself or fp8 read as stored * k_scale, or (the sparse kernel's) DeepSeek's
//          token rows, ds_mla.cuh: V3.2's fp8_ds_mla, V4's v4_fp8 and v4_fp4 (RANK 512,
//          ROPE 0: the key is the whole 512-dim vector, and so is the value) (vLLM's
//          combined [.., RANK + ROPE] cache is the pair at offsets 0 and RANK;
//          FlashInfer's kv_c / k_pe caches are two arrays), block and token strides free
//   out    [total_q, num_heads, RANK] contiguous
//
// A token's key is its whole cached vector [kv_c, k_pe], its value the latent kv_c: one KV
// head that every query head shares (multi-query attention with keys of RANK + ROPE and
// values of RANK dims). The q_len query tokens of a sequence are the last q_len of its
// seq_len cached tokens; causal: token i sees keys at positions up to seq_len - q_len + i.
//
// Work split: a sequence's rows are its tokens times the heads, packed token-major
// (row = token * num_heads + head), in tiles of ROWS rows, one CTA per (sequence, row tile,
// split-KV partition). Each K/V tile of TILE_N tokens is copied once into shared memory
// and serves as K (all RANK + ROPE dims) and V (its first RANK dims). Eight warps:
//   S = Q K^T: ROWS x TILE_N scores, the warps spread over blocks of up to 32 x 32 of
//     them and, where there are fewer blocks than warps, over slices of the 576-dim
//     reduction; partial sums meet in shared memory (fp32);
//   softmax: ROWS rows over the CTA's threads (256 / ROWS a row), online in the log2
//     domain; P (rounded to T) and each row's rescale factor go to shared memory;
//   O += P V: each warp owns RANK / 8 output dims of every row (an O of 64 x 512 fp32 is
//     too large for one warp's registers, so the value dims are what the warps split).
// Block ids come through the read-only cache; a bad one (outside the cache) is never
// dereferenced and gives NaN to every row of each CTA whose keys include it (all rows of
// its sequence that see the block, and others sharing their row tile).
#pragma once
#include "common.cuh"
#include "ds_mla.cuh"
#include "fp8.cuh"
#include "mla_common.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "variants.cuh"

namespace cupaged {

constexpr int kMlaWarps = 8;
constexpr int kMlaThreads = kMlaWarps * 32;

// Shared-memory layout of one specialization, mirrored on the host (specs/geometry.py).
// C is the cache's element type: T, or fp8 (its tiles widened to T before the products), or
// a token row format (fp8_ds_mla_t: DeepSeek-V3.2's 656-byte rows; v4_fp8_t, v4_fp4_t:
// V4's 528- and 288-byte rows; ds_mla.cuh's SparseRow: widened with their scales).
template <typename T, typename C, int RANK, int ROPE, int ROWS, int TILE_N, int STAGES>
struct MlaGeometry {
  static constexpr bool kQuant = !is_same<T, C>::value;
  static constexpr bool kRows = is_sparse_row<C>::value;  // token rows (SparseRow<C>)
  static constexpr int kDims = RANK + ROPE;       // a key's length
  static constexpr int kRow = kDims + 8;          // shared rows of T padded by 16 bytes: eight
  //                                                 consecutive rows start in distinct bank
  //                                                 groups (conflict-free ldmatrix)
  static constexpr int kChunks = kDims / 8;       // 16-byte chunks of a query row
  static constexpr int kRankChunks = RANK / 8;
  static constexpr int kCVec = 16 / static_cast<int>(sizeof(C));  // cache values a chunk
  static constexpr int kCTokenBytes =
      kRows ? SparseRow<C>::kBytes : kDims * static_cast<int>(sizeof(C));
  static constexpr int kCChunks = kCTokenBytes / 16;  // 16-byte chunks of a cached row
  static constexpr int kCRow = kCTokenBytes + 16;  // a stage row's bytes, padded as kRow
  static constexpr int kAtoms = ROWS / 16;        // m16 tiles of O
  // S = Q K^T in blocks of up to 32 x 32 a warp (each k-step's Q and K fragments then
  // serve twice as many mma as 16 x 16 blocks would: Q K^T reads both operands from
  // shared memory, whose bandwidth bounds it), the k-steps split over kKSplit warps
  // where there are fewer blocks than warps.
  static constexpr int kBlockRows = ROWS >= 32 ? 32 : 16;
  static constexpr int kBlockCols = TILE_N >= 32 ? 32 : 16;
  static constexpr int kRowBlocks = ROWS / kBlockRows;
  static constexpr int kBlocks = kRowBlocks * (TILE_N / kBlockCols);
  static constexpr int kKSplit = kBlocks >= kMlaWarps ? 1 : kMlaWarps / kBlocks;
  static constexpr int kKSteps = kDims / 16;      // k16 steps of Q K^T
  static constexpr int kSRow = TILE_N + 4;        // fp32 score rows, padded
  static constexpr int kPRow = TILE_N + 8;        // P rows (T), padded by 16 bytes
  static constexpr int kRowThreads = kMlaThreads / ROWS;  // softmax threads per row
  static constexpr int kRowCols = TILE_N / kRowThreads;   // and columns per thread
  static constexpr int kWarpDims = RANK / kMlaWarps;      // O dims per warp
  // Copies of a K/V tile: kCopyThreads threads a token, kCopySteps chunks each.
  static constexpr int kCopyThreads = kMlaThreads / TILE_N;
  static constexpr int kCopySteps = (kCChunks + kCopyThreads - 1) / kCopyThreads;
  static __device__ __forceinline__ int copy_token(int tid) { return tid / kCopyThreads; }
  static __device__ __forceinline__ int copy_lane(int tid) { return tid % kCopyThreads; }
  static constexpr int kDTiles = kWarpDims / 8;           // its n8 tiles

  static constexpr int kQBytes = ROWS * kRow * 2;
  static constexpr int kStageBytes = TILE_N * kCRow;
  static constexpr int kOffStages = kQBytes;
  // fp8: the tile being computed, widened to T (a stage's layout at 16 bits).
  static constexpr int kOffWide = kOffStages + STAGES * kStageBytes;
  static constexpr int kWideBytes = kQuant ? TILE_N * kRow * 2 : 0;
  static constexpr int kOffS = kOffWide + kWideBytes;
  static constexpr int kOffP = kOffS + kKSplit * ROWS * kSRow * 4;
  static constexpr int kOffRowState = kOffP + ROWS * kPRow * 2;  // alpha, max, sum per row
  static constexpr int kOffFlag = kOffRowState + 3 * ROWS * 4;
  // The sparse kernel's: whether each key of a stage's tile counts (a byte a key).
  static constexpr int kOffValid = kOffFlag + 16;
  static constexpr int kSmemBytes = kOffValid + STAGES * TILE_N;

  // Two CTAs an SM where the target's shared memory holds two of this shape (one's copies
  // and barriers then overlap the other's products): 16 rows, whose registers then fit
  // 128 a thread. Elsewhere one CTA takes the whole register budget (a cap would only
  // make it spill).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870)
  static constexpr int kSmSmem = 164 * 1024;
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000)
  static constexpr int kSmSmem = 228 * 1024;
#else
  static constexpr int kSmSmem = 100 * 1024;
#endif
  static constexpr int kMinBlocks = ROWS == 16 && 2 * (kSmemBytes + 1024) <= kSmSmem ? 2 : 1;

  static_assert(sizeof(T) == 2, "tensor cores take 16-bit operands");
  static_assert(!kQuant || sizeof(C) == 1, "caches of T or fp8");
  static_assert(!kRows || (RANK == SparseRow<C>::kRank && ROPE == SparseRow<C>::kRope &&
                           is_same<T, bfloat16_t>::value),
                "token rows: their RANK and ROPE (fp8_ds_mla 512 and 64, V4's 512 and 0), "
                "bfloat16 queries");
  static_assert(RANK % (8 * kMlaWarps * 2) == 0 && ROPE % 16 == 0, "RANK, ROPE");
  static_assert(ROWS == 16 || ROWS == 32 || ROWS == 64, "ROWS");
  static_assert(TILE_N == 16 || TILE_N == 32 || TILE_N == 64, "TILE_N");
  static_assert(kBlocks <= kMlaWarps || kBlocks % kMlaWarps == 0, "S blocks over warps");
  static_assert(kRowCols >= 1 && kRowThreads <= 32, "softmax threads per row");
  static_assert(STAGES >= 2, "STAGES");
};

// The kernel's body, for both entry points below: paged (SPARSE false) and sparse, with a
// second cache (EXTRA: the sparse kernel's kVarSecondCache) or without.
template <typename T, typename C, int RANK, int ROPE, int BLOCK_SIZE, int ROWS, int TILE_N,
          int STAGES, bool SPARSE, bool EXTRA = false>
__device__ __forceinline__ void mla_attention_body(
    CUPAGED_MLA_PARAMS, int lengths_per, int strict, const MlaSparseExtra& extra,
    const VariantParams& vp) {  // vp.lse; the sparse kernel also vp.sinks, vp.lse_keys
  using Geo = MlaGeometry<T, C, RANK, ROPE, ROWS, TILE_N, STAGES>;
  constexpr int ROW = Geo::kRow;
  constexpr int MA = Geo::kAtoms;
  constexpr int KS = Geo::kKSplit;
  constexpr int RT = Geo::kRowThreads;
  constexpr int RC = Geo::kRowCols;

  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* wide_s = reinterpret_cast<T*>(smem + Geo::kOffWide);  // fp8: the widened tile
  float* s_s = reinterpret_cast<float*>(smem + Geo::kOffS);    // [KS][ROWS][kSRow]
  T* p_s = reinterpret_cast<T*>(smem + Geo::kOffP);            // [ROWS][kPRow]
  float* alpha_s = reinterpret_cast<float*>(smem + Geo::kOffRowState);
  float* max_s = alpha_s + ROWS;
  float* sum_s = max_s + ROWS;
  int* bad_s = reinterpret_cast<int*>(smem + Geo::kOffFlag);
  unsigned char* valid_s = smem + Geo::kOffValid;  // sparse: [STAGES][TILE_N] key flags
  const unsigned q_s_addr = static_cast<unsigned>(__cvta_generic_to_shared(q_s));
  const unsigned kv_s_addr = static_cast<unsigned>(__cvta_generic_to_shared(smem + Geo::kOffStages));

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  if (tid == 0 && dynamic_smem_bytes() < static_cast<unsigned>(Geo::kSmemBytes)) __trap();
  // The cache's scale multiplies every score and every output (K and V are both kv_c).
  const float cache_scale = k_scale_ptr != nullptr ? *k_scale_ptr : k_scale;
  scale_log2 *= cache_scale;
  // (CUPAGED_DEBUG reports lengths past the table or negative, which mla_seq clamps.)
  MlaSeq sq = mla_seq<BLOCK_SIZE, SPARSE>(blockIdx.x / row_tiles, seq_lens, query_start_loc,
                                          num_heads, block_tables, bt_stride, max_blocks,
                                          lengths_per);
  // Sparse with a second cache: its first first_len keys are the first cache's.
  const int first_len = sq.seq_len;
  const int* extra_row = nullptr;
  if constexpr (EXTRA) extra_row = mla_extra_row(sq, extra, blockIdx.x / row_tiles, lengths_per);

  // Softmax role: row sm_row, columns sm_col .. sm_col + RC - 1 of each S tile.
  const int sm_row = tid / RT;
  const int sm_col = (tid % RT) * RC;
  // S role: warps w < kBlocks * KS own the block (w % kBlocks) of S over k-slice
  // w / kBlocks; with more blocks than warps, a warp walks blocks w, w + 8, ...
  // P V role: output dims warp * kWarpDims .. + kWarpDims of every row.

  // A CTA strides over row tiles (by row_tiles), so a host bound that undercounts q_len
  // costs parallelism, never rows.
  for (int row0 = (blockIdx.x % row_tiles) * ROWS; row0 < sq.packed; row0 += row_tiles * ROWS) {
    const int rows_here = min(ROWS, sq.packed - row0);
    const MlaTiles tl = mla_tiles<TILE_N>(sq, row0, rows_here, num_heads, SPARSE ? 0 : causal,
                                          split_tiles);
    const int kv_end = tl.kv_end, tile_lo = tl.tile_lo, n_tiles = tl.n_tiles;

    begin_row_tile(bad_s);

    // ---- the query tile: rows past the sequence's are zeros ----------------------------
    mla_copy_query<T, RANK, ROPE, ROWS, kMlaThreads>(
        q_lat, q_rope, q_lat_token_stride, q_lat_head_stride, q_rope_token_stride,
        q_rope_head_stride, sq, row0, rows_here, num_heads,
        [&](int r, int c) { return q_s_addr + (r * ROW + c * 8) * 2; });

    // One K/V tile into a stage. Thread tid copies token copy_token(tid) of each tile (its
    // chunks copy_lane(tid), + kCopyThreads, ...), so it needs one block id a tile: the id of
    // the tile after next is read while this one is computed (tile_id), and its copies
    // wait for no table read. Slots past kv_end are zeros (P is 0 there, and 0 * a stale
    // NaN would be NaN); a bad block id is never dereferenced and raises the flag.
    // (Sparse: the id is the key's slot, its block slot / BLOCK_SIZE and its offset in the
    // block slot's, which MlaToken takes as the key; -1 also for an entry that does not
    // count, whose zeros the softmax masks.)
    auto tile_id = [&](int tile) -> int {  // -1: past the keys (or no such tile); -2: bad
      if (tile >= n_tiles) return -1;
      const int key = (tile_lo + tile) * TILE_N + Geo::copy_token(tid);
      return mla_key_id<BLOCK_SIZE, SPARSE, EXTRA>(sq, key, kv_end, num_blocks, strict, extra,
                                                  extra_row, first_len);
    };
    auto load_tile = [&](int tile, int stage, int id) {
      const bool copy = mla_copied<EXTRA>(id);
      if (id == -2) *bad_s = 1;
      // Sparse: the softmax masks the keys whose entries do not count (their zeros) by
      // these flags, read after the barrier that shows the tile landed.
      if (SPARSE && Geo::copy_lane(tid) == 0) valid_s[stage * TILE_N + Geo::copy_token(tid)] = copy;
      const MlaToken<C, BLOCK_SIZE> tok = mla_kv_token<C, BLOCK_SIZE, SPARSE, EXTRA>(
          id, (tile_lo + tile) * TILE_N + Geo::copy_token(tid), c_lat, c_rope,
          c_lat_block_stride, c_lat_token_stride, c_rope_block_stride, c_rope_token_stride,
          extra);
      const unsigned dst = kv_s_addr + stage * Geo::kStageBytes +
                           Geo::copy_token(tid) * Geo::kCRow;
#pragma unroll
      for (int j = 0; j < Geo::kCopySteps; ++j) {
        const int c = Geo::copy_lane(tid) + j * Geo::kCopyThreads;
        if (Geo::kCChunks % Geo::kCopyThreads == 0 || c < Geo::kCChunks) {
          cp_async16_or_zero(dst + c * 16, copy ? tok.template chunk<RANK>(c) : c_lat, copy);
        }
      }
    };

    // Per-row constants of the softmax role: keys at positions < limit are seen.
    const int limit = mla_key_limit(sq, row0 + sm_row, num_heads, SPARSE ? 0 : causal);
    float m_run = neg_inf(), l_run = 0.f;  // redundant over the row's RT threads; l partial

    float acc[MA][Geo::kDTiles][4];
#pragma unroll
    for (int a = 0; a < MA; ++a) {
#pragma unroll
      for (int d = 0; d < Geo::kDTiles; ++d) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[a][d][i] = 0.f;
      }
    }

    // Prologue: the query travels in the first tile's copy group.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < n_tiles) load_tile(s, s, tile_id(s));
      cp_async_commit();
    }
    int id_ahead = tile_id(STAGES - 1);

    for (int it = 0; it < n_tiles; ++it) {
      const int t0 = (tile_lo + it) * TILE_N;
      const int stage = it % STAGES;
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile `it` has landed; everyone is done with tile it - 1
      const int next = it + STAGES - 1;
      if (next < n_tiles) load_tile(next, next % STAGES, id_ahead);
      cp_async_commit();
      id_ahead = tile_id(next + 1);
      const unsigned char* stage_s = smem + Geo::kOffStages + stage * Geo::kStageBytes;
      const T* ks = reinterpret_cast<const T*>(stage_s);
      if constexpr (Geo::kRows) {
        // Widen the landed tile's rows with their scales (SparseRow<C>::widen, a warp over
        // consecutive units of a row); zeros stay zeros. The previous tile's products are
        // done with wide_s (the barrier).
        using R = SparseRow<C>;
        for (int u = tid; u < TILE_N * R::kUnits; u += kMlaThreads) {
          const int t = u / R::kUnits;
          uint4 v[2];
          int dim;
          const int n = R::widen(stage_s + t * Geo::kCRow, u % R::kUnits, v, dim);
          for (int k = 0; k < n; ++k) *reinterpret_cast<uint4*>(wide_s + t * ROW + dim + 8 * k) = v[k];
        }
        __syncthreads();  // the widened tile is complete
        ks = wide_s;
      } else if constexpr (Geo::kQuant) {
        // Widen the landed tile to T (exact: fp8 values are all representable); zeros
        // stay zeros. The previous tile's products are done with wide_s (the barrier).
        for (int u = tid; u < TILE_N * Geo::kCChunks; u += kMlaThreads) {
          const int t = u / Geo::kCChunks;
          const int c = u % Geo::kCChunks;
          uint4 lo, hi;
          widen16<T, C>(*reinterpret_cast<const uint4*>(stage_s + t * Geo::kCRow + c * 16), lo,
                        hi);
          *reinterpret_cast<uint4*>(wide_s + t * ROW + c * 16) = lo;
          *reinterpret_cast<uint4*>(wide_s + t * ROW + c * 16 + 8) = hi;
        }
        __syncthreads();  // the widened tile is complete
        ks = wide_s;
      }

      // ---- S = Q K^T, partial over this warp's k-slice -----------------------------------
      for (int blk = warp; blk < Geo::kBlocks * KS; blk += kMlaWarps) {
        constexpr int BA = Geo::kBlockRows / 16;  // m16 atoms of a block
        constexpr int BP = Geo::kBlockCols / 16;  // pairs of n8 tiles
        const int b = blk % Geo::kBlocks;
        const int ksl = blk / Geo::kBlocks;
        const int r0 = (b % Geo::kRowBlocks) * Geo::kBlockRows;
        const int c0 = (b / Geo::kRowBlocks) * Geo::kBlockCols;
        const int k_lo = ksl * Geo::kKSteps / KS;
        const int k_hi = (ksl + 1) * Geo::kKSteps / KS;
        float s[BA][2 * BP][4] = {};
        const T* qa_base = q_s + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW + (lane >> 4) * 8;
        const T* kb_base = ks + (c0 + (lane & 7) + (lane >> 4) * 8) * ROW + ((lane >> 3) & 1) * 8;
#pragma unroll 2
        for (int kk = k_lo; kk < k_hi; ++kk) {
          unsigned qa[BA][4];
#pragma unroll
          for (int a = 0; a < BA; ++a) ldmatrix_x4(qa[a], qa_base + a * 16 * ROW + kk * 16);
#pragma unroll
          for (int np = 0; np < BP; ++np) {
            unsigned kb[4];
            ldmatrix_x4(kb, kb_base + np * 16 * ROW + kk * 16);
            const unsigned b0[2] = {kb[0], kb[1]};
            const unsigned b1[2] = {kb[2], kb[3]};
#pragma unroll
            for (int a = 0; a < BA; ++a) {
              mma_16816<T>(s[a][2 * np], qa[a], b0);
              mma_16816<T>(s[a][2 * np + 1], qa[a], b1);
            }
          }
        }
#pragma unroll
        for (int a = 0; a < BA; ++a) {
          float* srow = s_s + (ksl * ROWS + r0 + a * 16 + (lane >> 2)) * Geo::kSRow + c0 +
                        (lane & 3) * 2;
#pragma unroll
          for (int n = 0; n < 2 * BP; ++n) {
            *reinterpret_cast<float2*>(srow + n * 8) = make_float2(s[a][n][0], s[a][n][1]);
            *reinterpret_cast<float2*>(srow + 8 * Geo::kSRow + n * 8) =
                make_float2(s[a][n][2], s[a][n][3]);
          }
        }
      }
      __syncthreads();  // S is complete

      // ---- online softmax, a row over RT threads -------------------------------------------
      {
        float v[RC];
        float tile_max = neg_inf();
#pragma unroll
        for (int j = 0; j < RC; ++j) {
          float x = 0.f;
#pragma unroll
          for (int k = 0; k < KS; ++k) x += s_s[(k * ROWS + sm_row) * Geo::kSRow + sm_col + j];
          const int key = t0 + sm_col + j;
          bool seen = key < limit;
          if constexpr (SPARSE) {  // an entry that does not count reads as zeros: masked
            seen = seen && valid_s[stage * TILE_N + sm_col + j] != 0;
          }
          v[j] = seen ? x * scale_log2 : neg_inf();
          tile_max = fmaxf(tile_max, v[j]);
        }
#pragma unroll
        for (int o = RT / 2; o > 0; o >>= 1) {
          tile_max = fmaxf(tile_max, __shfl_xor_sync(~0u, tile_max, o));
        }
        float sub;
        const float alpha = softmax_advance(m_run, tile_max, sub);
        float sum = 0.f;
        T* prow = p_s + sm_row * Geo::kPRow + sm_col;
        if constexpr (RC == 1) {
          const float p0 = fast_exp2(v[0] - sub);
          sum = p0;
          prow[0] = from_float<T>(p0);
        } else {
#pragma unroll
          for (int j = 0; j < RC; j += 2) {
            const float p0 = fast_exp2(v[j] - sub);
            const float p1 = fast_exp2(v[j + 1] - sub);
            sum += p0 + p1;
            *reinterpret_cast<unsigned*>(prow + j) = pack2<T>(p0, p1);
          }
        }
        l_run = l_run * alpha + sum;
        if (tid % RT == 0) alpha_s[sm_row] = alpha;
      }
      __syncthreads();  // P and the factors are complete

      // ---- O = O * alpha + P V over this warp's dims ---------------------------------------
#pragma unroll
      for (int a = 0; a < MA; ++a) {
        const float a0 = alpha_s[a * 16 + (lane >> 2)];
        const float a1 = alpha_s[a * 16 + (lane >> 2) + 8];
#pragma unroll
        for (int d = 0; d < Geo::kDTiles; ++d) {
          acc[a][d][0] *= a0;
          acc[a][d][1] *= a0;
          acc[a][d][2] *= a1;
          acc[a][d][3] *= a1;
        }
      }
#pragma unroll
      for (int kk = 0; kk < TILE_N / 16; ++kk) {
        unsigned pa[MA][4];
#pragma unroll
        for (int a = 0; a < MA; ++a) {
          ldmatrix_x4(pa[a], p_s + (a * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * Geo::kPRow +
                                 kk * 16 + (lane >> 4) * 8);
        }
#pragma unroll
        for (int dp = 0; dp < Geo::kDTiles / 2; ++dp) {
          // V rows are tokens: transposed loads give B's (token, dim) pairs.
          unsigned vb[4];
          ldmatrix_x4_trans(vb, ks + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW +
                                    warp * Geo::kWarpDims + dp * 16 + (lane >> 4) * 8);
          const unsigned b0[2] = {vb[0], vb[1]};
          const unsigned b1[2] = {vb[2], vb[3]};
#pragma unroll
          for (int a = 0; a < MA; ++a) {
            mma_16816<T>(acc[a][2 * dp], pa[a], b0);
            mma_16816<T>(acc[a][2 * dp + 1], pa[a], b1);
          }
        }
      }
    }
    cp_async_wait<0>();

    // ---- each row's maximum and sum, then normalize and store --------------------------------
#pragma unroll
    for (int o = RT / 2; o > 0; o >>= 1) l_run += __shfl_xor_sync(~0u, l_run, o);
    if (tid % RT == 0) {
      max_s[sm_row] = m_run;
      sum_s[sm_row] = l_run;
    }
    __syncthreads();  // the row state and the bad-block flag are final
    const bool bad = *bad_s != 0;
#pragma unroll
    for (int a = 0; a < MA; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = a * 16 + (lane >> 2) + h * 8;
        if (r >= rows_here) continue;
        const int p = row0 + r;
        const long long orow = static_cast<long long>(sq.q_begin + p / num_heads) * num_heads +
                               p % num_heads;
        const bool writer = warp == 0 && (lane & 3) == 0;
        const int col = warp * Geo::kWarpDims + (lane & 3) * 2;
        if (split_tiles > 0) {
          const long long prow = orow * gridDim.z + blockIdx.z;
          const float inv = end_partial_row(max_s[r], sum_s[r], bad, cache_scale, prow, part_max,
                                            part_sum, writer);
          float* o = part_out + prow * RANK + col;
#pragma unroll
          for (int d = 0; d < Geo::kDTiles; ++d) {
            *reinterpret_cast<float2*>(o + d * 8) =
                make_float2(acc[a][d][2 * h] * inv, acc[a][d][2 * h + 1] * inv);
          }
          continue;
        }
        // (Sparse: attn_sink as vp.sinks; the paged kernel takes none.)
        const float sink = SPARSE ? sink_log2(vp, p % num_heads) : neg_inf();
        const float inv = end_whole_row(vp, max_s[r], sum_s[r], bad, cache_scale, sink, orow,
                                        writer);
        T* o = out + orow * RANK + col;
#pragma unroll
        for (int d = 0; d < Geo::kDTiles; ++d) {
          *reinterpret_cast<unsigned*>(o + d * 8) =
              pack2<T>(acc[a][d][2 * h] * inv, acc[a][d][2 * h + 1] * inv);
        }
      }
    }
  }
}

// Parameters: CUPAGED_MLA_PARAMS (mla_common.cuh).
template <typename T, typename C, int RANK, int ROPE, int BLOCK_SIZE, int ROWS, int TILE_N,
          int STAGES>
__global__ void __launch_bounds__(
    kMlaThreads, (MlaGeometry<T, C, RANK, ROPE, ROWS, TILE_N, STAGES>::kMinBlocks))
    mla_attention(CUPAGED_MLA_PARAMS, const __grid_constant__ VariantParams vp) {
  mla_attention_body<T, C, RANK, ROPE, BLOCK_SIZE, ROWS, TILE_N, STAGES, false>(
      CUPAGED_MLA_ARGS, 1, 0, MlaSparseExtra{}, vp);
}

// DeepSeek's sparse attention (DSA) over the same cache: each query token attends to the
// cached tokens its top-k indices name (FlashMLA's sparse interface). Parameters as
// mla_attention's, read as: block_tables the indices, int32 [num_tokens, bt_stride], a
// token's first max_blocks (topk) of them global slots (block * BLOCK_SIZE + offset) or -1;
// num_blocks the slots (a slot counts when in [0, num_blocks)); seq_lens topk_length,
// entry token / lengths_per (or null: all topk count); query_start_loc null and causal 0
// (a token's rows are its heads; there is no order among its keys). strict: an index
// outside [0, num_blocks) other than -1 is a fault that turns its token's rows NaN
// (FlashMLA's decode), else it does not count (its prefill). A repeated index counts each
// time. VARIANT kVarSecondCache: the second cache (`extra`; its indices null for none),
// whose counted entries follow the first's in each token's softmax under the same rules;
// without it `extra` is not read (zeros), and the kernel is the one without the feature.
template <typename T, typename C, int RANK, int ROPE, int BLOCK_SIZE, int ROWS, int TILE_N,
          int STAGES, int VARIANT>
__global__ void __launch_bounds__(
    kMlaThreads, (MlaGeometry<T, C, RANK, ROPE, ROWS, TILE_N, STAGES>::kMinBlocks))
    mla_sparse_attention(CUPAGED_MLA_PARAMS, int lengths_per, int strict,
                         const __grid_constant__ MlaSparseExtra extra,
                         const __grid_constant__ VariantParams vp) {
  static_assert((VARIANT & ~kVarSecondCache) == 0, "the sparse kernel's variant: a second cache");
  mla_attention_body<T, C, RANK, ROPE, BLOCK_SIZE, ROWS, TILE_N, STAGES, true,
                     (VARIANT & kVarSecondCache) != 0>(CUPAGED_MLA_ARGS, lengths_per, strict,
                                                       extra, vp);
}

}  // namespace cupaged
