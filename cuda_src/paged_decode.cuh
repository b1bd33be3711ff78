// Paged-attention decode: one query token per sequence against its paged KV cache.
//
// Layouts:
//   query       [num_rows, num_heads, HEAD_SIZE]         (any row / head stride, dims contiguous)
//   cache       any PagedKV layout (kv_layout.cuh): token-major (NHD, HND, fused views) or
//               vLLM's [num_blocks, num_kv_heads, HEAD_SIZE/X, BLOCK_SIZE, X] key and
//               [num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE] value, X = 16 / sizeof(T)
//   block_tables int32 [num_seqs, max_blocks_per_seq], context_lens int32 [num_seqs]
//   out         [num_rows, num_heads, HEAD_SIZE] contiguous
//
// Decode (query_start_loc null): row s is sequence s's one token, at the end of its
// context. Row mode (query_start_loc [num_seqs + 1]): row r is token r - query_start_loc[s]
// of the sequence s whose rows hold it, at position len - q_len + i, seeing the keys up to
// its own position (causal) or all of them. It serves decode steps given with their
// query_start_loc (which it honours whatever the host bounds claim) and the multi-token
// queries paged_prefill does not take (float32 caches, tiny vLLM blocks); split-KV
// partials and merge counters are per row.
//
// Work split: one CTA per (sequence, KV head, tile of GROUP_TILE query heads of that KV head,
// partition). All query heads of the tile share every K/V byte the CTA loads, so a GQA
// group reads its KV head once instead of once per query head.
//
// Per tile of TILE_TOKENS tokens the CTA
//   1. streams K and V into shared memory with cp.async, STAGES tiles deep (the next tile
//      loads while this one is computed), reordered so the compute loops read conflict-free;
//   2. computes scores for every (query head, token), in the log2 domain (the query is
//      pre-scaled by scale * log2(e)), masked past the context end, plus optional ALiBi;
//   3. updates the running max / sum (online softmax: nothing grows with the context);
//   4. accumulates P @ V in fp32 registers.
// Steps 2 and 4 run on tensor cores (mma.m16n8k16 with fp32 sums, P rounded to T as its
// operand) for 16-bit queries, whatever the query heads a CTA serves (1 to 8), on
// token-major caches and on vLLM's with blocks of 8 tokens or more (DecodeGeometry::kMma);
// otherwise on FMAs.
// Single pass (partition_tokens == 0) writes the normalized output. Split-KV writes each
// partition's normalized output with its max and sum; paged_decode_combine merges them.
#pragma once
#include "common.cuh"
#include "fp8.cuh"
#include "kv_layout.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "variants.cuh"

namespace cupaged {

constexpr int kDecodeThreads = 128;

// Compile-time geometry of one specialization. The shared-memory size is mirrored on the
// host by cupaged/specs/geometry.py (DecodeGeometry); the kernel traps if launched with less.
// T is the query's and output's type, C the cache's: T itself, or fp8 (fp8.cuh) with
// KV_SCALE saying how its scales are given.
template <typename T, typename C, int HEAD_SIZE, int BLOCK_SIZE, int KV_FORMAT, int KV_SCALE,
          int GROUP_TILE, int TILE_TOKENS, int STAGES>
struct DecodeGeometry {
  static constexpr int kThreads = kDecodeThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr bool kQuant = !is_same<T, C>::value;  // an fp8 cache, with scales
  static constexpr bool kTokenScales = kQuant && KV_SCALE == kScaleTokenHead;
  static constexpr int kVec = 16 / static_cast<int>(sizeof(C));  // "x" of the key layout
  static constexpr int kChunks = HEAD_SIZE / kVec;                // 16-byte chunks per key row
  // Tokens per copied piece: a whole cache block, or a slice of one when blocks are larger
  // than a tile. Pieces are contiguous runs in the cache.
  static constexpr int kSub = BLOCK_SIZE < TILE_TOKENS ? BLOCK_SIZE : TILE_TOKENS;
  static constexpr int kUnitsPerSub = HEAD_SIZE * kSub / kVec;    // 16-byte copies per piece
  static constexpr int kUnits = TILE_TOKENS * HEAD_SIZE / kVec;   // per tile, for K and for V
  static constexpr int kPieces = TILE_TOKENS / kSub;              // block-table entries per tile

  // Shared K is stored [kChunks][TILE_TOKENS][kVec]: lane t of a warp reads token t, so a
  // warp reads 512 contiguous bytes whatever the block size. Shared V is stored
  // [HEAD_SIZE][kVRow] (tokens contiguous, rows padded by 16 bytes so lanes reading
  // consecutive dims hit distinct banks) when pieces hold at least kVec tokens; for tiny
  // blocks a 16-byte copy spans several dims, so V keeps the cache's own piece layout.
  static constexpr bool kVTransposed = KV_FORMAT == kFormatVllm && kSub >= kVec;
  static constexpr int kVRow = TILE_TOKENS + kVec;
  static constexpr bool kTokenMajor = KV_FORMAT == kFormatTokenMajor;

  // Scores: each token is owned by kScoreThreads threads' worth of lanes; when the tile is
  // narrower than the CTA, kSplitsQK threads share a token (split over key chunks).
  static constexpr int kScoreThreads = TILE_TOKENS < kThreads ? TILE_TOKENS : kThreads;
  static constexpr int kSplitsQK = kThreads / kScoreThreads;
  static constexpr int kTokensPerThread = TILE_TOKENS / kScoreThreads;
  // P @ V: lane = output dim (plus multiples of 32), warp = a quarter of the tile's tokens.
  static constexpr int kDimsPerThread = (HEAD_SIZE + 31) / 32;
  static constexpr int kTokensPerWarpPV = TILE_TOKENS / kWarps;

  // Tensor cores (mma.m16n8k16, fp32 sums) do Q K^T and P V for 16-bit queries, whatever
  // the query heads a CTA serves (1 to 8; columns past them are padding): fewer
  // instructions a tile than the FMA path, and the swizzled token rows below. Scores are
  // S^T = K Q^T (16 tokens x 8 heads per mma), the output O^T = V^T P^T (16 dims x 8
  // heads), so the cache tiles are the A operands straight from shared memory.
  // An fp8 tile (kConvert) is widened to float16 in registers as its fragments load, and
  // the products run in float16 whatever T is (MmaT; a bfloat16 query is scaled by a power
  // of two into float16's range), but for P V under per-token V scales (PvT).
  static constexpr bool kMma = sizeof(T) == 2 && HEAD_SIZE % 16 == 0 &&
                               (kVTransposed || kTokenMajor);
  static constexpr bool kConvert = kMma && kQuant;
  // Token-major caches are copied token-major: shared K and V are [TILE_TOKENS][kTokRow],
  // arranged so that eight consecutive rows' chunk c lie in distinct 16-byte bank groups
  // (a warp reading 32 tokens' chunks, or ldmatrix reading eight token rows, is
  // conflict-free):
  // - swizzled (the tensor-core path, rows of whole groups of eight chunks): rows unpadded,
  //   chunk c of row t stored at chunk c ^ (t % 8). Every 32-byte sector of the cache then
  //   lands in one aligned 32 bytes of shared memory;
  // - padded (otherwise): rows padded to an odd number of chunks. Every other row then
  //   starts 16 bytes into a 32-byte sector, and the copies bring those rows' sectors from
  //   L2 twice: 1.5x the L2 -> SM bytes of the swizzled copy (docs/PERFORMANCE.md).
  static constexpr bool kSwizzle = kTokenMajor && kMma && kChunks % 8 == 0;
  static constexpr int kTokRow = kSwizzle ? HEAD_SIZE : HEAD_SIZE + kVec * (kChunks % 2 == 0 ? 1 : 2);
  // The element offset of chunk c (kVec elements) of token row t in a K or V stage.
  __device__ static constexpr int tok_chunk(int t, int c) {
    return t * kTokRow + (kSwizzle ? c ^ (t & 7) : c) * kVec;
  }
  using MmaT = typename conditional<kConvert, half_t, T>::type;
  // P V's operand type: MmaT, except with per-token V scales, where V * scale (which may
  // lie anywhere in the query type's range) is rounded to T, as a 16-bit cache holds it.
  using PvT = typename conditional<kConvert && !kTokenScales, half_t, T>::type;
  static constexpr int kTokenTilesPerWarp = (TILE_TOKENS / 16 + kWarps - 1) / kWarps;
  static constexpr int kDimTilesPerWarp = (HEAD_SIZE / 16 + kWarps - 1) / kWarps;
  static constexpr int kPRow = TILE_TOKENS + 8;  // mma path: P as PvT [GROUP_TILE][kPRow]
  // Warps whose partial maxima / sums are combined, and output partials summed.
  static constexpr int kStatWarps = kMma ? kWarps : kScoreThreads / 32;
  static constexpr int kAccSlots = kMma ? 1 : kWarps;

  // Shared-memory carve-up in bytes (every offset a multiple of 16).
  static constexpr int kKStage =
      TILE_TOKENS * (kTokenMajor ? kTokRow : HEAD_SIZE) * static_cast<int>(sizeof(C));
  static constexpr int kVStage =
      (kTokenMajor ? TILE_TOKENS * kTokRow : HEAD_SIZE * kVRow) * static_cast<int>(sizeof(C));
  static constexpr int kOffV = STAGES * kKStage;
  static constexpr int kOffQ = kOffV + STAGES * kVStage;
  // The mma path keeps the query in registers and needs only GROUP_TILE floats of the
  // reduction space (its running maxima, for part_max): 8 KiB less at 8 heads, which is
  // the difference between two and three CTAs per SM.
  static constexpr int kQBytes = kMma ? 0 : GROUP_TILE * HEAD_SIZE * 4;
  static constexpr int kRedBytes = kMma ? (GROUP_TILE * 4 + 15) / 16 * 16 : kThreads * GROUP_TILE * 4;
  static constexpr int kOffP = kOffQ + kQBytes;
  static constexpr int kOffRed = kOffP + TILE_TOKENS * GROUP_TILE * 4;
  static constexpr int kOffWarp = kOffRed + kRedBytes;
  static constexpr int kOffFlag = kOffWarp + kWarps * GROUP_TILE * 4;
  static constexpr int kOffIds = kOffFlag + 16;  // [2][kPieces] block ids, double-buffered
  // Per-token scales (kTokenScales): [STAGES][TILE_TOKENS] floats for K, then for V.
  static constexpr int kOffScales = kOffIds + (2 * kPieces * 4 + 15) / 16 * 16;
  static constexpr int kSmemBytes = kOffScales + (kTokenScales ? 2 * STAGES * TILE_TOKENS * 4 : 0);

  static_assert(HEAD_SIZE % 8 == 0 && HEAD_SIZE >= 32 && HEAD_SIZE <= 512, "HEAD_SIZE");
  static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && BLOCK_SIZE <= 256, "BLOCK_SIZE");
  static_assert((TILE_TOKENS & (TILE_TOKENS - 1)) == 0 && TILE_TOKENS >= 32 &&
                    TILE_TOKENS <= 256, "TILE_TOKENS");
  static_assert(GROUP_TILE == 1 || GROUP_TILE == 2 || GROUP_TILE == 4 || GROUP_TILE == 8,
                "GROUP_TILE");
  static_assert(KV_FORMAT == kFormatTokenMajor || KV_FORMAT == kFormatVllm, "KV_FORMAT");
  static_assert(STAGES >= 2, "STAGES");
  static_assert(!kQuant || (sizeof(C) == 1 && sizeof(T) == 2 && HEAD_SIZE % 16 == 0),
                "fp8 caches: 16-bit queries, head sizes that are multiples of 16");
  static_assert(KV_SCALE == kScaleTensor || KV_SCALE == kScaleTokenHead, "KV_SCALE");
  static_assert(kMma || kTokensPerWarpPV % kVec == 0, "P @ V walks whole 16-byte vectors");
  // The final cross-warp reduction of the output reuses the K stages.
  static_assert(kWarps * GROUP_TILE * HEAD_SIZE * 4 <= STAGES * kKStage, "reduction space");
  static_assert(!kMma || GROUP_TILE * kPRow * 2 <= TILE_TOKENS * GROUP_TILE * 4, "P space");
};

// Split-KV partitions of `partition_tokens` that hold keys when `span` keys are seen, out
// of `launched`: ceil(span / partition_tokens) without forming span + partition_tokens,
// which overflows int for spans near 2^31. The decode kernel and the combine must agree.
__device__ __forceinline__ int live_partitions(int span, int partition_tokens, int launched) {
  return min(launched, span / partition_tokens + (span % partition_tokens != 0 ? 1 : 0));
}

// Merge one head's split-KV partials with one warp: out = sum_p w_p o_p / (sum_p w_p + sink)
// with w_p = sum_p * 2^(max_p - max), a partition that saw no key weighing 0 and a NaN one
// (a bad block) making the row NaN. Partial p is row row_of(p) of po [][HEAD_SIZE] (each
// normalized by its own sum), pm and ps [] (log2 units). The loads bypass L1: other CTAs
// of the same launch may have written them. `lse`: null, or where the row's goes
// (row_lse's, for vp.lse_keys).
template <typename T, int HEAD_SIZE, typename RowOf>
__device__ void merge_partitions(T* __restrict__ out, float* __restrict__ lse,
                                 const float* po, const float* pm, const float* ps, int parts,
                                 RowOf row_of, float sink, const VariantParams& vp) {
  constexpr int DPT = (HEAD_SIZE + 31) / 32;
  const int lane = threadIdx.x & 31;
  float m = neg_inf();
  for (int p = lane; p < parts; p += 32) m = fmaxf(m, __ldcg(pm + row_of(p)));
  m = warp_max(m);
  float acc[DPT];
#pragma unroll
  for (int k = 0; k < DPT; ++k) acc[k] = 0.f;
  float l = 0.f;
  for (int p0 = 0; p0 < parts; p0 += 32) {
    const int p = p0 + lane;
    const long long r = p < parts ? row_of(p) : 0;
    const float w = p < parts ? merge_weight(__ldcg(pm + r), __ldcg(ps + r), m) : 0.f;
    l += w;
    const int n = min(32, parts - p0);
    for (int j = 0; j < n; ++j) {
      const float wj = __shfl_sync(~0u, w, j);
      const float* row = po + row_of(p0 + j) * HEAD_SIZE;
#pragma unroll
      for (int k = 0; k < DPT; ++k) {
        const int d = lane + 32 * k;
        if (HEAD_SIZE % 32 == 0 || d < HEAD_SIZE) acc[k] = fmaf(wj, __ldcg(row + d), acc[k]);
      }
    }
  }
  l = warp_sum(l);
  const RowEnd e = finish_row(m, l, sink);
  if (lane == 0 && lse != nullptr) *lse = row_lse(vp, e, m, l);
#pragma unroll
  for (int k = 0; k < DPT; ++k) {
    const int d = lane + 32 * k;
    if (HEAD_SIZE % 32 == 0 || d < HEAD_SIZE) out[d] = from_float<T>(acc[k] * e.mul);
  }
}

// What query row `qrow` sees: its sequence, the keys [0, ctx) and its own position q_pos
// (ALiBi distances are key - q_pos). Lengths past the block table's width (max_len) are
// clamped so the table row is never overrun; negative lengths count as empty.
struct RowSpan {
  int seq, ctx, q_pos;
};

__device__ __forceinline__ RowSpan row_span(const int* __restrict__ context_lens,
                                            const int* __restrict__ query_start_loc,
                                            int num_seqs, int causal, int max_len, int qrow) {
  if (query_start_loc == nullptr) {  // decode: row s is sequence s's token, at its end
    const int ctx = max(0, min(context_lens[qrow], max_len));
    return RowSpan{qrow, ctx, ctx - 1};
  }
  // The sequence holding this row: the last s with query_start_loc[s] <= row. A decode
  // batch (one token per sequence) has row r in sequence r, which is tried first, its
  // length loaded alongside: one round trip, as without query_start_loc, instead of a
  // binary search. Any sequence whose range holds the row is the one the search finds
  // (the starts are non-decreasing).
  int seq = qrow;
  const bool guess = qrow < num_seqs;
  int qb = guess ? query_start_loc[qrow] : 0;
  int qe = guess ? query_start_loc[qrow + 1] : 0;
  int seq_len = guess ? context_lens[qrow] : 0;
  if (!(guess && qb <= qrow && qrow < qe)) {
    int lo = 0, hi = num_seqs;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (query_start_loc[mid] <= qrow) lo = mid; else hi = mid;
    }
    seq = lo;
    qb = query_start_loc[seq];
    qe = query_start_loc[seq + 1];
    seq_len = context_lens[seq];
  }
  const int len = max(0, min(seq_len, max_len));
  const int q_pos = len - (qe - qb) + (qrow - qb);
  int ctx = causal ? max(0, min(len, q_pos + 1)) : len;
  if (qrow < qb || qrow >= qe) ctx = 0;  // a row no sequence claims gets zeros
  return RowSpan{seq, ctx, q_pos};
}

// ---- the flat split (variant kVarFlat, partition_tokens = -rows) ------------------------
// The (query row, head tile) units' key tiles laid end to end, row by row (decode's rows
// are its sequences) and, within one, head tile by head tile; the grid's G CTAs take equal runs of them (the first
// T % G one tile more). A CTA walks its run unit by unit: a unit it holds whole is written
// as a single pass; a unit cut by a run's end goes out as partials, merged by whichever CTA
// holding a piece of it finishes last. No CTA runs in step with another, so the grid has
// no last wave of whole units: the work ends within a tile of the same time everywhere.
// Each CTA has two partial slots: 2c for the piece its run starts with, 2c + 1 for the one
// it ends with (rows [slot][GROUP_TILE] of the partials).
struct FlatRuns {
  long long q, r;  // T = q G + r: runs of q + 1 tiles, then of q

  __device__ __forceinline__ long long start(long long c) const { return c * q + min(c, r); }
  // The CTA whose run holds flat tile t.
  __device__ __forceinline__ long long owner(long long t) const {
    const long long big = r * (q + 1);
    return t < big ? t / (q + 1) : r + (t - big) / q;
  }
};

// Key tiles of query row `qrow` in the flat split: those from its window's first tile (a
// tile before it, as the kernel's loop) to its last key, at least one (a row without keys
// is still written, as zeros).
template <int BLOCK_SIZE, int TT, typename Var>
__device__ __forceinline__ int flat_tiles(const PagedKV& kv, const int* context_lens,
                                          const int* query_start_loc, int num_seqs, int causal,
                                          int qrow, const VariantParams& vp) {
  const RowSpan r = row_span(context_lens, query_start_loc, num_seqs, causal,
                             kv.max_blocks * BLOCK_SIZE, qrow);
  const int lo = min(Var::first_key(vp, r.q_pos), r.ctx);
  const int base = Var::kWindow ? lo / TT * TT : 0;
  return max(1, (r.ctx - base) / TT + ((r.ctx - base) % TT != 0 ? 1 : 0));
}

template <typename T, typename C, int HEAD_SIZE, int BLOCK_SIZE, int KV_FORMAT, int KV_SCALE,
          int GROUP_TILE, int TILE_TOKENS, int STAGES, int VARIANT>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode(T* __restrict__ out,             // single pass: [num_rows, num_heads, HEAD_SIZE]
                 float* __restrict__ part_out,    // split: [num_seqs, num_heads, P, HEAD_SIZE]
                 float* __restrict__ part_max,    // split: [num_seqs, num_heads, P], log2 units
                 float* __restrict__ part_sum,    // split: [num_seqs, num_heads, P]
                 int* __restrict__ counters,      // split, merged here: [num_seqs, head tiles],
                                                  // zeros (left zero again); else null
                 const T* __restrict__ query, long long q_seq_stride, long long q_head_stride,
                 const __grid_constant__ PagedKV kv,
                 const int* __restrict__ context_lens,
                 const int* __restrict__ query_start_loc,  // row mode: [num_seqs + 1]; else null
                 const float* __restrict__ alibi_slopes,   // [num_heads] or null
                 int num_heads, int group_size, int num_seqs, int causal,
                 int partition_tokens,  // 0: single pass; > 0: tokens per partition
                                        // (gridDim.z); with kVarFlat, minus the query rows:
                                        // the flat split (above) over the rows (decode's,
                                        // or row mode's), grid (G, 1, 1)
                 float scale_log2, const __grid_constant__ VariantParams vp) {
  using Geo = DecodeGeometry<T, C, HEAD_SIZE, BLOCK_SIZE, KV_FORMAT, KV_SCALE, GROUP_TILE,
                             TILE_TOKENS, STAGES>;
  using KV = KVAccess<C, KV_FORMAT, BLOCK_SIZE>;
  using Var = Variant<VARIANT>;
  static_assert(!Var::kAlibi, "decode takes ALiBi's slopes at run time");
  constexpr int KROW = Geo::kTokRow;
  constexpr int HS = HEAD_SIZE;
  constexpr int GT = GROUP_TILE;
  constexpr int TT = TILE_TOKENS;
  constexpr int X = Geo::kVec;
  constexpr int NT = Geo::kThreads;
  constexpr int DPT = Geo::kDimsPerThread;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(16) unsigned char smem[];
  C* k_s = reinterpret_cast<C*>(smem);
  C* v_s = reinterpret_cast<C*>(smem + Geo::kOffV);
  float* ksc_s = reinterpret_cast<float*>(smem + Geo::kOffScales);  // [STAGES][TT] (kTokenScales)
  float* vsc_s = ksc_s + STAGES * TT;
  float* q_s = reinterpret_cast<float*>(smem + Geo::kOffQ);     // [GT][HS], pre-scaled
  float* p_s = reinterpret_cast<float*>(smem + Geo::kOffP);     // [TT][GT] probabilities
  float* red_s = reinterpret_cast<float*>(smem + Geo::kOffRed); // [kSplitsQK][GT][TT]
  float* warp_s = reinterpret_cast<float*>(smem + Geo::kOffWarp);  // [kWarps][GT]
  int* bad_block_s = reinterpret_cast<int*>(smem + Geo::kOffFlag);
  int* ids_s = reinterpret_cast<int*>(smem + Geo::kOffIds);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int tiles_per_kv = (group_size + GT - 1) / GT;
  constexpr bool flat = Var::kFlat;  // the flat split (partition_tokens = -rows)
  const int n_y = flat ? num_heads / group_size * tiles_per_kv : static_cast<int>(gridDim.y);
  const int n_rows = flat ? -partition_tokens : 0;  // (flat) the query rows
  auto row_tiles = [&](int qrow) {
    return flat_tiles<BLOCK_SIZE, TT, Var>(kv, context_lens, query_start_loc, num_seqs, causal,
                                           qrow, vp);
  };

  if (tid == 0 && dynamic_smem_bytes() < static_cast<unsigned>(Geo::kSmemBytes)) __trap();

  // The flat split: this CTA's run [w_t, w_end) of the flat tiles, and where it starts: the
  // query row w_row, whose units start at flat tile w_row0 and have w_tiles tiles each.
  FlatRuns runs{0, 0};
  long long w_t = 0, w_end = 0, w_row0 = 0;
  int w_row = 0, w_tiles = 0;
  if constexpr (flat) {
    // Every row's tiles, summed (each thread over its rows, then the block).
    long long* sum_s = reinterpret_cast<long long*>(smem);  // [kWarps]; the stages are free
    int* found_s = reinterpret_cast<int*>(smem + 8 * Geo::kWarps);  // [row, its start, tiles]
    long long mine = 0;
    for (int q = tid; q < n_rows; q += NT) mine += row_tiles(q);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(~0u, mine, o);
    if (lane == 0) sum_s[warp] = mine;
    __syncthreads();
    long long total = 0;
#pragma unroll
    for (int w = 0; w < Geo::kWarps; ++w) total += sum_s[w];
    total *= n_y;
    runs = FlatRuns{total / gridDim.x, total % gridDim.x};
    w_t = runs.start(blockIdx.x);
    w_end = runs.start(blockIdx.x + 1ll);
    if (w_t >= w_end) return;  // fewer tiles than CTAs
    // The row holding flat tile w_t: the last whose units start at or before it, by a
    // block-wide running sum of the tiles, NT rows at a time.
    const long long target = w_t / n_y;  // in tiles of one head tile's units
    long long carry = 0;
    for (int q0 = 0;; q0 += NT) {
      const int q = q0 + tid;
      const int v = q < n_rows ? row_tiles(q) : 0;
      long long incl = v;  // inclusive prefix within the warp
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const long long n = __shfl_up_sync(~0u, incl, o);
        if (lane >= o) incl += n;
      }
      __syncthreads();  // the last round's sums are read
      if (lane == 31) sum_s[warp] = incl;
      __syncthreads();
      long long before = carry, chunk = 0;
#pragma unroll
      for (int w = 0; w < Geo::kWarps; ++w) {
        before += w < warp ? sum_s[w] : 0;
        chunk += sum_s[w];
      }
      const long long excl = before + incl - v;
      if (q < n_rows && excl <= target && target < excl + v) {
        found_s[0] = q;
        found_s[1] = static_cast<int>(excl >> 32);
        found_s[2] = static_cast<int>(excl & 0xffffffffll);
        found_s[3] = v;
      }
      carry += chunk;
      if (carry > target || q0 + NT >= n_rows) break;  // (the same in every thread)
    }
    __syncthreads();
    w_row = found_s[0];
    w_row0 = ((static_cast<long long>(found_s[1]) << 32) |
              static_cast<unsigned>(found_s[2])) * n_y;
    w_tiles = found_s[3];
    __syncthreads();  // read before the stages are written
  }

  // One unit (a sequence's row, a head tile, a range of its keys) per pass: the grid's
  // (x, y, z) in the grid modes (one pass); the flat split's run, unit by unit.
  for (int pass = 0; flat || pass == 0; ++pass) {
  int qrow, y_tile, f_lo = 0, f_hi = 0;  // (flat) the unit's tiles [f_lo, f_hi) done here
  long long f_unit = 0;                  // (flat) the unit's first flat tile
  int f_tiles = 0;                       // (flat) the unit's tiles
  if constexpr (!flat) {
    qrow = blockIdx.x;
    y_tile = blockIdx.y;
  } else {
    if (w_t >= w_end) break;
    if (pass > 0) __syncthreads();  // the last unit is done with shared memory
    const long long in_row = w_t - w_row0;
    qrow = w_row;
    y_tile = static_cast<int>(in_row / w_tiles);
    f_lo = static_cast<int>(in_row % w_tiles);
    f_hi = static_cast<int>(min(static_cast<long long>(w_tiles), f_lo + (w_end - w_t)));
    f_unit = w_row0 + static_cast<long long>(y_tile) * w_tiles;
    f_tiles = w_tiles;
    w_t += f_hi - f_lo;
    if (f_hi == w_tiles && y_tile == n_y - 1 && w_t < w_end) {  // on to the next row
      w_row0 += static_cast<long long>(n_y) * w_tiles;
      ++w_row;
      w_tiles = row_tiles(w_row);
    }
  }
  const int kv_head = y_tile / tiles_per_kv;
  const int g0 = (y_tile % tiles_per_kv) * GT;
  const int head0 = kv_head * group_size + g0;  // first query head of this CTA
  const int heads_here = min(GT, group_size - g0);

  // Lengths past the block table's width are clamped (row_span) so the table row is never
  // overrun (cupaged.check_block_tables reports them); negative lengths count as empty.
  const int max_len = kv.max_blocks * BLOCK_SIZE;
  const RowSpan span = row_span(context_lens, query_start_loc, num_seqs, causal, max_len, qrow);
  const int seq = span.seq;
  const int ctx = span.ctx;      // keys this row sees: [0, ctx)
  const int q_pos = span.q_pos;  // the row's own position
  // Keys [lo, ctx) are seen. A window's keys start at lo, its tiles at lo rounded down to a
  // tile (copies and block ids are tile-aligned; the slots before lo are masked), and
  // split-KV partitions cover the window only (the combine counts them alike).
  const int lo = min(Var::first_key(vp, q_pos), ctx);
  const int base = Var::kWindow ? lo / TT * TT : 0;
  int begin = base;
  int end = ctx;
  // Split-KV: the partitions the merge counts. At least one: a row with no key at all is
  // merged (to zeros) from partition 0 alone.
  int parts = 1;
  // Flat: the pieces of this unit, the CTAs c0.. holding them, and c0's slot for it.
  long long f_c0 = 0;
  int f_k0 = 0;
  if constexpr (flat) {
    begin = base + f_lo * TT;
    end = f_hi == f_tiles ? ctx : base + f_hi * TT;
    f_c0 = runs.owner(f_unit);
    f_k0 = runs.start(f_c0) == f_unit ? 0 : 1;
    parts = static_cast<int>(runs.owner(f_unit + f_tiles - 1) - f_c0) + 1;
  } else if (partition_tokens > 0) {
    // The last partition runs to the end, so a host bound that undercounts the lengths
    // costs parallelism, never tokens.
    parts = max(1, live_partitions(ctx - base, partition_tokens, gridDim.z));
    const long long b = base + static_cast<long long>(blockIdx.z) * partition_tokens;
    // Past this sequence's keys: nothing to do, the merge skips it (but partition 0 of a
    // row without keys, when the merge is here).
    if (b >= end && (counters == nullptr || blockIdx.z > 0)) continue;
    begin = static_cast<int>(min(b, static_cast<long long>(end)));
    end = blockIdx.z + 1 == gridDim.z ? ctx : min(ctx, begin + partition_tokens);
  }

  const int* bt_row = kv.block_tables + seq * kv.bt_stride;

  const int n_tiles = (end - begin + TT - 1) / TT;
  // A tile's block ids are read from the table one tile before its copies are issued
  // (thread i holds piece i's id in a register across a tile of compute, then publishes
  // it in shared memory), so no copy waits on a dependent global load.
  constexpr int kIdsPerThread = (Geo::kPieces + NT - 1) / NT;
  int id_next[kIdsPerThread];
  auto fetch_ids = [&](int tile) {
#pragma unroll
    for (int j = 0; j < kIdsPerThread; ++j) {
      const int piece = tid + j * NT;
      // Pieces at or past `end` are skipped: their table entries may be garbage. Checking
      // the tile first keeps the token arithmetic below 2^31.
      const bool live = tile < n_tiles && piece < Geo::kPieces &&
                        begin + tile * TT + piece * Geo::kSub < end &&
                        (!Var::kWindow || begin + tile * TT + (piece + 1) * Geo::kSub > lo);
      id_next[j] = live ? __ldg(bt_row + (begin + tile * TT + piece * Geo::kSub) / BLOCK_SIZE)
                        : 0;
    }
  };
  auto publish_ids = [&](int tile) {
#pragma unroll
    for (int j = 0; j < kIdsPerThread; ++j) {
      const int piece = tid + j * NT;
      if (piece < Geo::kPieces) ids_s[(tile & 1) * Geo::kPieces + piece] = id_next[j];
    }
  };

  const typename KV::Head hd = KV::head(kv, kv_head);  // as load_tile uses them

  // Issue the cp.async copies of tile `tile` (tokens [t0, t0 + TT)) into stage `stage`,
  // once its ids are published and a barrier has passed.
  auto load_tile = [&](int tile, int stage) {
    const int t0 = begin + tile * TT;
    const int* ids = ids_s + (tile & 1) * Geo::kPieces;
    C* ks = k_s + stage * (Geo::kKStage / static_cast<int>(sizeof(C)));
    C* vs = v_s + stage * (Geo::kVStage / static_cast<int>(sizeof(C)));
    if constexpr (Geo::kTokenScales) {
      // Slots past the end (or in a bad block) get scale 0: their probabilities are 0, and
      // 0 * a stale scale could be NaN.
      for (int t = tid; t < TT; t += NT) {
        float* kd = ksc_s + stage * TT + t;
        float* vd = vsc_s + stage * TT + t;
        const int tok = t0 + t;
        const int phys = tok < end && (!Var::kWindow || tok >= lo) ? ids[t / Geo::kSub] : -1;
        if (static_cast<unsigned>(phys) >= static_cast<unsigned>(kv.num_blocks)) {
          *kd = 0.f;
          *vd = 0.f;
          continue;
        }
        const long long o = scale_offset(kv, phys, kv_head, tok % BLOCK_SIZE);
        cp_async4(kd, kv.k_scale + o);
        cp_async4(vd, kv.v_scale + o);
      }
    }
    // Per unit, one 32x32->64-bit product places the block (the host checks that block
    // strides fit 32 bits and a block's extent 31) and the rest is 32-bit. Unrolled by two:
    // fully unrolled, the addresses of every unit stay live (up to 122 registers).
#pragma unroll 2
    for (int i = 0; i < (Geo::kUnits + NT - 1) / NT; ++i) {
      // Unsigned: a unit's parts (u / kChunks, u % kUnitsPerSub, ...) are then shifts and
      // masks, and the per-thread ones are hoisted out of the loop.
      const unsigned u = tid + i * NT;
      if (Geo::kUnits % NT != 0 && u >= Geo::kUnits) break;
      // Token-major caches: consecutive threads take consecutive 16-byte chunks of a
      // token's row. vLLM's: consecutive 16-byte runs of a piece, in cache order.
      unsigned t, sub;
      if constexpr (Geo::kTokenMajor) {
        t = u / Geo::kChunks;
        sub = t / Geo::kSub;
      } else {
        sub = u / Geo::kUnitsPerSub;
        t = sub * Geo::kSub;
      }
      const int tok = t0 + t;
      // Not seen, not read: past the end, or (a whole piece, for vLLM's layout, whose
      // units start at their piece's first token) before the window.
      if (tok >= end || (Var::kWindow && tok + (Geo::kTokenMajor ? 1 : Geo::kSub) <= lo)) continue;
      const int phys = ids[sub];
      if (static_cast<unsigned>(phys) >= static_cast<unsigned>(kv.num_blocks)) {
        *bad_block_s = 1;  // never read outside the cache; the output becomes NaN instead
        continue;
      }
      const unsigned within = static_cast<unsigned>(tok) % BLOCK_SIZE;
      const C* kb = hd.k + mul_wide(phys, hd.k_block);  // phys >= 0 here
      const C* vb = hd.v + mul_wide(phys, hd.v_block);
      // Parts fixed per thread are written from tid, so they are hoisted out of the loop.
      if constexpr (Geo::kTokenMajor) {
        const unsigned c = (NT % Geo::kChunks == 0 ? static_cast<unsigned>(tid) : u) % Geo::kChunks;
        // Where chunk c of row t goes; when NT is a multiple of 8 rows, t % 8 is the same
        // in every iteration (written from tid, so it is hoisted).
        const unsigned dst = Geo::kSwizzle && NT % (8 * Geo::kChunks) == 0
            ? t * KROW + (c ^ ((static_cast<unsigned>(tid) / Geo::kChunks) & 7)) * X
            : Geo::tok_chunk(t, c);
        cp_async16(ks + dst, kb + (within * hd.k_token + c * X));
        cp_async16(vs + dst, vb + (within * hd.v_token + c * X));
      } else {
        // The element offset in the piece, in cache order.
        const unsigned e =
            ((NT % Geo::kUnitsPerSub == 0 ? static_cast<unsigned>(tid) : u) % Geo::kUnitsPerSub) * X;
        {  // key piece: [kChunks][kSub][X] out of the block's [kChunks][BLOCK_SIZE][X]
          const unsigned c = e / (Geo::kSub * X);
          const unsigned r = e % (Geo::kSub * X);
          cp_async16(ks + (c * TT + sub * Geo::kSub) * X + r,
                     kb + ((c * BLOCK_SIZE + within) * X + r));
        }
        {  // value piece: [HS][kSub] out of the block's [HS][BLOCK_SIZE]
          const unsigned d = e / Geo::kSub;
          const unsigned r = e % Geo::kSub;
          C* dst;
          if constexpr (Geo::kVTransposed) {
            dst = vs + d * Geo::kVRow + sub * Geo::kSub + r;
          } else {
            dst = vs + sub * HS * Geo::kSub + e;
          }
          cp_async16(dst, vb + (d * BLOCK_SIZE + within + r));
        }
      }
    }
  };

  fetch_ids(0);  // in flight while the query loads

  // An fp8 cache's per-tensor scales: k's multiplies the scores, v's the output.
  float score_scale = scale_log2;
  float out_scale = 1.f;
  if constexpr (Geo::kQuant && !Geo::kTokenScales) {
    score_scale *= tensor_k_scale(kv);
    out_scale = tensor_v_scale(kv);
  }

  float slope[GT];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    slope[g] = (alibi_slopes != nullptr && g < heads_here) ? alibi_slopes[head0 + g] * kLog2e
                                                           : 0.f;
  }
  // Blocksparse: the query's sparse block and each head's offset in the pattern.
  const int q_sb = Var::sparse_query_block(vp, q_pos);
  int sp_off[GT];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    sp_off[g] = Var::sparse_offset(vp, head0 + g, kv_head, num_heads, num_heads / group_size);
  }
  // Does a head with blocksparse offset `off` see `key` (a key before the end)? Not
  // before the window, not where the pattern drops it.
  auto key_seen = [&](int key, int off) {
    return (!Var::kWindow || key >= lo) &&
           Var::template sparse_keep<BLOCK_SIZE>(vp, key, q_sb, off);
  };
  // mma path: the query as B fragments (head = lane / 4) of MmaT; the scale is applied to
  // the fp32 scores. Each thread's accumulators hold heads hq and hq + 1.
  const int hq = (lane & 3) * 2;
  unsigned q_frag[Geo::kMma ? HS / 16 : 1][2];
  float my_slope[2] = {0.f, 0.f};
  int my_off[2] = {0, 0};                   // blocksparse offsets of heads hq, hq + 1
  float m_own[2] = {neg_inf(), neg_inf()};  // running maxima of heads hq, hq + 1
  if constexpr (Geo::kMma) {
    const int h = lane >> 2;
    const T* qh = query + qrow * q_seq_stride + (head0 + h) * q_head_stride;
    // Fragment register r of k-step kk holds dims d, d + 1 of the 16: PTX's order for
    // 16-bit tiles, and for fp8 tiles the order a thread's bytes arrive in (mma.cuh): the
    // dims 4c .. 4c + 3 its ldmatrix register of K holds.
    auto dim_of = [&](int kk, int r) {
      return Geo::kConvert ? kk * 16 + (lane & 3) * 4 + r * 2 : kk * 16 + r * 8 + hq;
    };
    float q_mul = 1.f;
    if constexpr (Geo::kConvert && !is_same<T, half_t>::value) {
      // A bfloat16 query in float16: scaled by 2^s so its largest magnitude lands in
      // [2^14, 2^15). Exact but for values below 2^-24 of that largest, whose products
      // are far below the scores' fp32 rounding; 2^-s joins the score scale.
      float amax = 0.f;
#pragma unroll
      for (int kk = 0; kk < HS / 16; ++kk) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int d = dim_of(kk, r);
          if (h < heads_here) {
            amax = finite_amax(finite_amax(amax, to_float(qh[d])), to_float(qh[d + 1]));
          }
        }
      }
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
      // amax = 1.m * 2^(E - 127): 2^(141 - E) takes it into [2^14, 2^15). All zeros (or
      // no finite value) keep s = 0.
      const int sh = float16_range_shift(amax);
      q_mul = ldexpf(1.f, sh);
      score_scale = ldexpf(score_scale, -sh);
    }
#pragma unroll
    for (int kk = 0; kk < HS / 16; ++kk) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int d = dim_of(kk, r);
        if constexpr (is_same<typename Geo::MmaT, T>::value) {
          const unsigned lo = h < heads_here ? qh[d].bits : 0u;
          const unsigned hi = h < heads_here ? qh[d + 1].bits : 0u;
          q_frag[kk][r] = lo | (hi << 16);
        } else {
          const float lo = h < heads_here ? to_float(qh[d]) * q_mul : 0.f;
          const float hi = h < heads_here ? to_float(qh[d + 1]) * q_mul : 0.f;
          q_frag[kk][r] = pack2<half_t>(lo, hi);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      my_slope[e] = (alibi_slopes != nullptr && hq + e < heads_here)
                        ? alibi_slopes[head0 + hq + e] * kLog2e : 0.f;
      my_off[e] = Var::sparse_offset(vp, head0 + hq + e, kv_head, num_heads,
                                     num_heads / group_size);
    }
  } else {
    for (int i = tid; i < GT * HS; i += NT) {
      const int g = i / HS;
      const int d = i % HS;
      float v = 0.f;
      if (g < heads_here) {
        v = to_float(query[qrow * q_seq_stride + (head0 + g) * q_head_stride + d]) * score_scale;
      }
      q_s[i] = v;
    }
  }
  if (tid == 0) *bad_block_s = 0;
  __syncthreads();

  float m_run[GT];  // running max (log2 units), identical in every thread
  float l_run[GT];  // running sum of this thread's own probabilities (score owners only)
  float acc[DPT][GT];
  // mma path: O^T fragments of this warp's 16-dim tiles, and the sums for heads hq, hq + 1.
  float acc_mma[Geo::kMma ? Geo::kDimTilesPerWarp : 1][4];
  float l_mma[2] = {0.f, 0.f};
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m_run[g] = neg_inf();
    l_run[g] = 0.f;
#pragma unroll
    for (int k = 0; k < DPT; ++k) acc[k][g] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < (Geo::kMma ? Geo::kDimTilesPerWarp : 1); ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_mma[j][i] = 0.f;
  }

  // Prologue: the first STAGES - 1 tiles' ids are waited for here (nothing to hide
  // them behind yet), one barrier per tile since the id buffer is double.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s > 0) fetch_ids(s);
    publish_ids(s);
    __syncthreads();
    if (s < n_tiles) load_tile(s, s);
    cp_async_commit();  // always commit: keeps the group count in step with the tiles
  }
  fetch_ids(STAGES - 1);

  for (int it = 0; it < n_tiles; ++it) {
    const int t0 = begin + it * TT;
    const int stage = it % STAGES;
    const int next = it + STAGES - 1;
    publish_ids(next);
    cp_async_wait<STAGES - 2>();
    // Tile `it` is visible, everyone is done with tile it - 1, and tile next's ids are out.
    __syncthreads();
    if (next < n_tiles) load_tile(next, next % STAGES);
    cp_async_commit();
    fetch_ids(next + 1);  // in flight during this tile's compute
    const C* ks = k_s + stage * (Geo::kKStage / static_cast<int>(sizeof(C)));
    const C* vs = v_s + stage * (Geo::kVStage / static_cast<int>(sizeof(C)));
    const float* ksc = ksc_s + stage * TT;  // per-token scales (kTokenScales)
    const float* vsc = vsc_s + stage * TT;
    const int valid = min(TT, end - t0);

    if constexpr (Geo::kMma) {
      using MT = typename Geo::MmaT;
      using PT = typename Geo::PvT;
      PT* pt = reinterpret_cast<PT*>(p_s);  // [GT][kPRow]
      // Cache slots past the context end may hold anything, NaN included, and 0 * NaN is
      // NaN: clear V's columns there, up to the next 16-token step of the P V product.
      if (valid < TT) {
        C* vz = const_cast<C*>(vs);
        const int cols = min(TT, (valid + 15) / 16 * 16) - valid;
        if constexpr (Geo::kTokenMajor) {
          // Whole rows (a swizzle permutes chunks within a row only).
          for (int i = tid; i < HS * cols; i += NT) vz[(valid + i / HS) * KROW + i % HS] = C{};
        } else {
          for (int i = tid; i < HS * cols; i += NT) vz[(i / cols) * Geo::kVRow + valid + i % cols] = C{};
        }
      }
      if constexpr (Var::kWindow) {  // and the slots before the window (first tile only)
        C* vz = const_cast<C*>(vs);
        const int cols = min(TT, max(0, lo - t0));
        if constexpr (Geo::kTokenMajor) {
          for (int i = tid; i < HS * cols; i += NT) vz[(i / HS) * KROW + i % HS] = C{};
        } else {
          for (int i = tid; i < HS * cols; i += NT) vz[(i / cols) * Geo::kVRow + i % cols] = C{};
        }
      }

      // ---- scores: S^T = K Q^T, token tiles of 16 spread over the warps ----------------
      const int mi = lane >> 3;  // which 8x8 matrix this lane addresses for ldmatrix
      float sc[Geo::kTokenTilesPerWarp][4];
      float tmax[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int j = 0; j < Geo::kTokenTilesPerWarp; ++j) {
        const int mt = warp + j * Geo::kWarps;
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[j][i] = neg_inf();
        if ((TT / 16) % Geo::kWarps != 0 && mt >= TT / 16) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[j][i] = 0.f;
        // This lane's ldmatrix row (token) and where its chunk c (X elements) starts: the
        // row plus c chunks, or (swizzled) plus chunk c ^ (row % 8), row % 8 == lane % 8.
        // Chunks are c0 + m with c0 even (or, for fp8, a multiple of 2 by the loop) and m
        // in {0, 1}, so c ^ s == c0 ^ (m ^ s): one XOR with a constant per chunk.
        const int a_tok = mt * 16 + (lane & 7) + (mi & 1) * 8;
        const C* a_row = ks + (Geo::kTokenMajor ? a_tok * KROW : a_tok * X);
        const int kstep = Geo::kTokenMajor ? X : TT * X;  // to the next chunk
        const int m_sw = (mi >> 1) ^ (Geo::kSwizzle ? lane & 7 : 0);
        auto k_chunk = [&](int c0) {  // chunk c0 + (mi >> 1) of this lane's row
          return Geo::kSwizzle ? a_row + (c0 ^ m_sw) * X : a_row + (c0 + (mi >> 1)) * kstep;
        };
        if constexpr (!Geo::kConvert) {
          // A = K [token][dim]: matrix mi covers tokens + 8 (mi & 1), dims + 8 (mi >> 1).
#pragma unroll
          for (int kk = 0; kk < HS / 16; ++kk) {
            unsigned a[4];
            ldmatrix_x4(a, k_chunk(2 * kk));
            mma_16816<MT>(sc[j], a, q_frag[kk]);
          }
        } else {
          // fp8: a 16-byte chunk is one k-step. Matrix mi covers tokens + 8 (mi & 1) of
          // chunk kk + (mi >> 1); a register holds dims 4c .. 4c + 3 of one token, the low
          // pair A's column pair c, the high pair column pair c + 4 (q_frag's order).
#pragma unroll
          for (int kk = 0; kk + 1 < HS / 16; kk += 2) {
            unsigned r[4], a[4];
            ldmatrix_x4(r, k_chunk(kk));
            fp8x4_to_f16_halves<C>(r[0], a[0], a[2]);
            fp8x4_to_f16_halves<C>(r[1], a[1], a[3]);
            mma_16816<MT>(sc[j], a, q_frag[kk]);
            fp8x4_to_f16_halves<C>(r[2], a[0], a[2]);
            fp8x4_to_f16_halves<C>(r[3], a[1], a[3]);
            mma_16816<MT>(sc[j], a, q_frag[kk + 1]);
          }
          if constexpr ((HS / 16) % 2 != 0) {  // the last chunk alone (lanes 0-15 address it)
            constexpr int kk = HS / 16 - 1;
            unsigned r[2], a[4];
            ldmatrix_x2(r, Geo::kSwizzle ? a_row + (kk ^ (lane & 7)) * X : a_row + kk * kstep);
            fp8x4_to_f16_halves<C>(r[0], a[0], a[2]);
            fp8x4_to_f16_halves<C>(r[1], a[1], a[3]);
            mma_16816<MT>(sc[j], a, q_frag[kk]);
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // C fragment: token (lane / 4) + 8 (i / 2), head hq + i % 2
          const int t = mt * 16 + (lane >> 2) + (i >> 1) * 8;
          const float rel = static_cast<float>(t0 + t - q_pos);  // ALiBi distance
          const float sk = Geo::kTokenScales ? score_scale * ksc[t] : score_scale;
          const float v = fmaf(my_slope[i & 1], rel, Var::logits(vp, sc[j][i], sk));
          sc[j][i] = t < valid && key_seen(t0 + t, my_off[i & 1]) ? v : neg_inf();
          tmax[i & 1] = fmaxf(tmax[i & 1], sc[j][i]);
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) tmax[e] = fmaxf(tmax[e], __shfl_xor_sync(~0u, tmax[e], o));
        if (lane < 4 && hq + e < GT) warp_s[warp * GT + hq + e] = tmax[e];
      }
      __syncthreads();
      // Only this thread's two heads (heads past the tile mirror the last; never output).
      float alpha_own[2], sub_own[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int h = min(hq + e, GT - 1);
        float mx = warp_s[h];
#pragma unroll
        for (int w = 1; w < Geo::kWarps; ++w) mx = fmaxf(mx, warp_s[w * GT + h]);
        alpha_own[e] = softmax_advance(m_own[e], mx, sub_own[e]);
      }

      // ---- P, rounded to PT; the sums add the rounded values the P V product uses ------
      // P's column of token t: t itself, except over a dims-major fp8 V tile, whose
      // registers hold tokens 4c .. 4c + 3 of each 16 (see the P V step): stored where
      // ldmatrix hands B's rows 2c, 2c + 1 and 2c + 8, 2c + 9 to that thread.
      auto p_col = [](int t) {
        if constexpr (Geo::kConvert && !Geo::kTokenMajor) {
          const int u = t & 15;
          return (t & ~15) + ((u & 2) << 2) + ((u >> 2) << 1) + (u & 1);
        } else {
          return t;
        }
      };
#pragma unroll
      for (int e = 0; e < 2; ++e) l_mma[e] *= alpha_own[e];
#pragma unroll
      for (int j = 0; j < Geo::kTokenTilesPerWarp; ++j) {
        const int mt = warp + j * Geo::kWarps;
        if ((TT / 16) % Geo::kWarps != 0 && mt >= TT / 16) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = hq + (i & 1);
          const int t = mt * 16 + (lane >> 2) + (i >> 1) * 8;
          const PT p = from_float<PT>(exp2f(sc[j][i] - sub_own[i & 1]));
          if (h < GT) {
            pt[h * Geo::kPRow + p_col(t)] = p;
            l_mma[i & 1] += to_float(p);
          }
        }
      }
      __syncthreads();

      // ---- O^T += V^T P^T, dim tiles of 16 spread over the warps ---------------------------
      // The tile's product goes into fresh sums, then joins the running ones by FFMA: the
      // tensor cores' float32 additions truncate, so accumulating a whole pass in them
      // drifts low with its length (V rows of 1 over 131,072 keys gave 0.99951); one tile's
      // 4 steps per product and round-to-nearest between tiles keep the sums unbiased.
      float tile_acc[Geo::kDimTilesPerWarp][4];
#pragma unroll
      for (int j = 0; j < Geo::kDimTilesPerWarp; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) tile_acc[j][i] = 0.f;
      }
      // B rows are heads; lanes of heads the tile lacks read row 0 (their columns are dropped).
      const PT* b_row = pt + ((lane & 7) < GT ? (lane & 7) : 0) * Geo::kPRow + (mi & 1) * 8;
      const int steps = (valid + 15) / 16;
      for (int kk = 0; kk < TT / 16; ++kk) {
        if (kk >= steps) break;
        unsigned b[2];
        ldmatrix_x2(b, b_row + kk * 16);
#pragma unroll
        for (int j = 0; j < Geo::kDimTilesPerWarp; ++j) {
          const int mt = warp + j * Geo::kWarps;
          if ((HS / 16) % Geo::kWarps != 0 && mt >= HS / 16) continue;
          unsigned a[4];
          if constexpr (!Geo::kConvert) {
            // A = V^T [dim][token]: matrix mi covers dims + 8 (mi & 1), tokens + 8 (mi >> 1).
            if constexpr (Geo::kTokenMajor) {
              // Row kk * 16 + (mi >> 1) * 8 + lane % 8, so row % 8 == lane % 8.
              ldmatrix_x4_trans(a, vs + (kk * 16 + (mi >> 1) * 8 + (lane & 7)) * KROW +
                                       (Geo::kSwizzle ? ((2 * mt + (mi & 1)) ^ (lane & 7)) * X
                                                      : mt * 16 + (mi & 1) * 8));
            } else {
              ldmatrix_x4(a, vs + (mt * 16 + (lane & 7) + (mi & 1) * 8) * Geo::kVRow +
                                 (mi >> 1) * 8 + kk * 16);
            }
          } else if constexpr (Geo::kTokenMajor) {
            // fp8 [token][dim], transposed: matrix mi (lanes 0-15) covers tokens + 8 (mi & 1);
            // a register holds tokens 2c, 2c + 1 of dims 2r, 2r + 1 (r = lane / 4). A's row r
            // is dim 2r of the tile, row r + 8 dim 2r + 1 (the output's order, undone below).
            unsigned r[2];
            ldmatrix_x2_trans(r, vs + (kk * 16 + (mi & 1) * 8 + (lane & 7)) * KROW +
                                     (Geo::kSwizzle ? (mt ^ (lane & 7)) * X : mt * 16));
            fp8x4_to_f16_columns<C>(r[0], a[0], a[1]);
            fp8x4_to_f16_columns<C>(r[1], a[2], a[3]);
          } else {
            // fp8 [dim][token]: matrix mi (lanes 0-15) covers dims + 8 (mi & 1); a register
            // holds tokens 4c .. 4c + 3 of one dim, which p_col placed as B's rows.
            unsigned r[2];
            ldmatrix_x2(r, vs + (mt * 16 + (mi & 1) * 8 + (lane & 7)) * Geo::kVRow + kk * 16);
            fp8x4_to_f16_halves<C>(r[0], a[0], a[2]);
            fp8x4_to_f16_halves<C>(r[1], a[1], a[3]);
          }
          if constexpr (Geo::kConvert && Geo::kTokenScales) {
            // Per-token V scales, in fp32 before the one rounding (to T: PvT): a[0], a[1]
            // hold tokens u, u + 1 and a[2], a[3] tokens u + du, u + du + 1 of this step.
            const int c = lane & 3;
            const int u = kk * 16 + (Geo::kTokenMajor ? 2 * c : 4 * c);
            const int du = Geo::kTokenMajor ? 8 : 2;
            const float s0 = vsc[u], s1 = vsc[u + 1], s2 = vsc[u + du], s3 = vsc[u + du + 1];
            a[0] = scale_f16x2<PT>(a[0], s0, s1);
            a[1] = scale_f16x2<PT>(a[1], s0, s1);
            a[2] = scale_f16x2<PT>(a[2], s2, s3);
            a[3] = scale_f16x2<PT>(a[3], s2, s3);
          }
          mma_16816<PT>(tile_acc[j], a, b);
        }
      }
#pragma unroll
      for (int j = 0; j < Geo::kDimTilesPerWarp; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc_mma[j][i] = fmaf(acc_mma[j][i], alpha_own[i & 1], tile_acc[j][i]);
        }
      }
    } else {
      // ---- scores: s[j][g] = q_g . k_t for this thread's tokens t -------------------------
      const int split = tid / Geo::kScoreThreads;
      const int tq = tid % Geo::kScoreThreads;
      float s[Geo::kTokensPerThread][GT];
  #pragma unroll
      for (int j = 0; j < Geo::kTokensPerThread; ++j) {
        const int t = tq + j * NT;
  #pragma unroll
        for (int g = 0; g < GT; ++g) s[j][g] = 0.f;
        for (int c = split; c < Geo::kChunks; c += Geo::kSplitsQK) {
          float kf[X];
          load_floats<C, X>(Geo::kTokenMajor ? ks + Geo::tok_chunk(t, c) : ks + (c * TT + t) * X, kf);
  #pragma unroll
          for (int g = 0; g < GT; ++g) {
            const float4* q4 = reinterpret_cast<const float4*>(q_s + g * HS + c * X);
  #pragma unroll
            for (int i = 0; i < X / 4; ++i) {
              const float4 q = q4[i];
              s[j][g] = fmaf(q.x, kf[4 * i + 0], s[j][g]);
              s[j][g] = fmaf(q.y, kf[4 * i + 1], s[j][g]);
              s[j][g] = fmaf(q.z, kf[4 * i + 2], s[j][g]);
              s[j][g] = fmaf(q.w, kf[4 * i + 3], s[j][g]);
            }
          }
        }
      }
      if constexpr (Geo::kSplitsQK > 1) {
  #pragma unroll
        for (int g = 0; g < GT; ++g) red_s[(split * GT + g) * TT + tq] = s[0][g];
        __syncthreads();
        if (split == 0) {
  #pragma unroll
          for (int g = 0; g < GT; ++g) {
            float v = 0.f;
  #pragma unroll
            for (int sp = 0; sp < Geo::kSplitsQK; ++sp) v += red_s[(sp * GT + g) * TT + tq];
            s[0][g] = v;
          }
        }
      }

      // ---- mask, ALiBi, tile max ----------------------------------------------------------
      const bool owner = tid < Geo::kScoreThreads;
      if (owner) {
        float tmax[GT];
  #pragma unroll
        for (int g = 0; g < GT; ++g) tmax[g] = neg_inf();
  #pragma unroll
        for (int j = 0; j < Geo::kTokensPerThread; ++j) {
          const int t = tq + j * NT;
          const float rel = static_cast<float>(t0 + t - q_pos);  // ALiBi distance
  #pragma unroll
          for (int g = 0; g < GT; ++g) {
            const float sv = Var::logits(vp, s[j][g], Geo::kTokenScales ? ksc[t] : 1.f);
            s[j][g] = t < valid && key_seen(t0 + t, sp_off[g]) ? fmaf(slope[g], rel, sv) : neg_inf();
            tmax[g] = fmaxf(tmax[g], s[j][g]);
          }
        }
  #pragma unroll
        for (int g = 0; g < GT; ++g) {
          tmax[g] = warp_max(tmax[g]);
          if (lane == 0) warp_s[warp * GT + g] = tmax[g];
        }
      }
      __syncthreads();
      float alpha[GT];  // rescales what was accumulated under the old running maxima
      float sub[GT];    // what this tile's scores subtract (0 while a head has seen no key)
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float mx = warp_s[g];
#pragma unroll
        for (int w = 1; w < Geo::kStatWarps; ++w) mx = fmaxf(mx, warp_s[w * GT + g]);
        alpha[g] = softmax_advance(m_run[g], mx, sub[g]);
      }
      if (owner) {
  #pragma unroll
        for (int j = 0; j < Geo::kTokensPerThread; ++j) {
          const int t = tq + j * NT;
  #pragma unroll
          for (int g = 0; g < GT; ++g) {
            const float p = exp2f(s[j][g] - sub[g]);
            // Per-token V scales weigh P V's operand; the sum keeps the plain probability.
            p_s[t * GT + g] = Geo::kTokenScales ? p * vsc[t] : p;
            l_run[g] = (j == 0 ? l_run[g] * alpha[g] : l_run[g]) + p;
          }
        }
      }
      __syncthreads();

      // ---- P @ V ----------------------------------------------------------------------------
  #pragma unroll
      for (int k = 0; k < DPT; ++k) {
  #pragma unroll
        for (int g = 0; g < GT; ++g) acc[k][g] *= alpha[g];
      }
      const int pv_begin = warp * Geo::kTokensPerWarpPV;
      for (int tt = pv_begin; tt < pv_begin + Geo::kTokensPerWarpPV; tt += X) {
        if (tt >= valid) break;
        float p[X][GT];
  #pragma unroll
        for (int i = 0; i < X; ++i) {
  #pragma unroll
          for (int g = 0; g < GT; ++g) p[i][g] = p_s[(tt + i) * GT + g];
        }
  #pragma unroll
        for (int k = 0; k < DPT; ++k) {
          const int d = lane + 32 * k;
          if (HS % 32 != 0 && d >= HS) continue;
          float vf[X];
          if constexpr (Geo::kTokenMajor) {
  #pragma unroll
            for (int i = 0; i < X; ++i) vf[i] = to_float(vs[Geo::tok_chunk(tt + i, d / X) + d % X]);
          } else if constexpr (Geo::kVTransposed) {
            load_floats<C, X>(vs + d * Geo::kVRow + tt, vf);
          } else {
            constexpr int kSub = Geo::kSub;
  #pragma unroll
            for (int j = 0; j < X / kSub; ++j) {
              float part[kSub];
              load_floats<C, kSub>(vs + ((tt / kSub + j) * HS + d) * kSub, part);
  #pragma unroll
              for (int i = 0; i < kSub; ++i) vf[j * kSub + i] = part[i];
            }
          }
          if (tt + X > valid) {  // cache slots past the end may hold anything, NaN included
  #pragma unroll
            for (int i = 0; i < X; ++i) vf[i] = tt + i < valid ? vf[i] : 0.f;
          }
          if (Var::kWindow && t0 + tt < lo) {  // and so may the slots before the window
  #pragma unroll
            for (int i = 0; i < X; ++i) vf[i] = t0 + tt + i >= lo ? vf[i] : 0.f;
          }
  #pragma unroll
          for (int i = 0; i < X; ++i) {
  #pragma unroll
            for (int g = 0; g < GT; ++g) acc[k][g] = fmaf(p[i][g], vf[i], acc[k][g]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // all tiles consumed: the K stages are free for the reduction below

  // ---- reduce: the sum over score owners, the output over the PV warps -------------------
  float* acc_s = reinterpret_cast<float*>(smem);  // [kAccSlots][GT][HS]
  if constexpr (Geo::kMma) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) l_mma[e] += __shfl_xor_sync(~0u, l_mma[e], o);
      if (lane < 4 && hq + e < GT) warp_s[warp * GT + hq + e] = l_mma[e];
      if (warp == 0 && lane < 4 && hq + e < GT) red_s[hq + e] = m_own[e];  // for part_max
    }
#pragma unroll
    for (int j = 0; j < Geo::kDimTilesPerWarp; ++j) {
      const int mt = warp + j * Geo::kWarps;
      if ((HS / 16) % Geo::kWarps != 0 && mt >= HS / 16) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // C fragment: dim (lane / 4) + 8 (i / 2), head hq + i % 2
        const int h = hq + (i & 1);
        // fp8 token-major: the rows r, r + 8 of dim tile mt are its dims 2r, 2r + 1.
        const int d = Geo::kConvert && Geo::kTokenMajor ? mt * 16 + 2 * (lane >> 2) + (i >> 1)
                                                        : mt * 16 + (lane >> 2) + (i >> 1) * 8;
        if (h < GT) acc_s[h * HS + d] = acc_mma[j][i];
      }
    }
  } else {
    if (tid < Geo::kScoreThreads) {
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        const float v = warp_sum(l_run[g]);
        if (lane == 0) warp_s[warp * GT + g] = v;
      }
    }
#pragma unroll
    for (int k = 0; k < DPT; ++k) {
      const int d = lane + 32 * k;
      if (HS % 32 != 0 && d >= HS) continue;
#pragma unroll
      for (int g = 0; g < GT; ++g) acc_s[(warp * GT + g) * HS + d] = acc[k][g];
    }
  }
  __syncthreads();

  const bool bad = *bad_block_s != 0;
  // Output rows follow the query's; split-KV partials (decode only) the sequences'.
  const long long row0 = static_cast<long long>(qrow) * num_heads + head0;
  // A single pass writes the output; a piece of a split unit its partials, at rows
  // part_row(g): the grid split's [row][partition], the flat split's [slot][head].
  const bool whole = flat ? parts == 1 : partition_tokens == 0;
  const long long f_slot = 2ll * blockIdx.x + (f_c0 == blockIdx.x ? f_k0 : 0);
  auto part_row = [&](int g) {
    return flat ? f_slot * GT + g : (row0 + g) * gridDim.z + blockIdx.z;
  };
  // Each head's end, once: its factor from the summed P V to the output (the sink in the
  // denominator, zeros for a head that saw no key), and the lse or the partial's max/sum.
  float mul = 0.f;
  if (tid < heads_here) {
    const int g = tid;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < Geo::kStatWarps; ++w) l += warp_s[w * GT + g];
    float m;  // the head's running maximum (log2 units; -inf if it saw no key)
    if constexpr (Geo::kMma) {
      m = red_s[g];
    } else {
      m = m_run[0];
#pragma unroll
      for (int gg = 1; gg < GT; ++gg) m = gg == g ? m_run[gg] : m;
    }
    if (whole) {
      const RowEnd e = finish_row(m, l, sink_log2(vp, head0 + g));
      mul = bad ? quiet_nan() : e.mul * out_scale;
      if (vp.lse != nullptr) vp.lse[row0 + g] = bad ? quiet_nan() : row_lse(vp, e, m, l);
    } else {
      // A partition whose keys were all masked has l = 0: zeros, and no weight in the merge.
      mul = bad ? quiet_nan() : (l > 0.f ? out_scale / l : 0.f);
      const long long row = part_row(g);
      part_max[row] = bad ? quiet_nan() : m;
      part_sum[row] = l;
    }
  }
  __syncthreads();  // every l is read before warp_s holds the factors
  if (tid < heads_here) warp_s[tid] = mul;
  __syncthreads();
  for (int i = tid; i < GT * HS; i += NT) {
    const int g = i / HS;
    const int d = i % HS;
    if (g >= heads_here) continue;
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < Geo::kAccSlots; ++w) a += acc_s[(w * GT + g) * HS + d];
    if (whole) {
      out[(row0 + g) * HS + d] = from_float<T>(a * warp_s[g]);
    } else {
      part_out[part_row(g) * HS + d] = a * warp_s[g];
    }
  }
  if (whole || counters == nullptr) continue;

  // ---- split-KV merged here: the row's last partition to finish merges them all -------
  // Each CTA publishes its partials, then counts itself in; the one that brings the count
  // to `parts` sees everyone's partials (the fences order the writes before the count, and
  // the count before its reads), merges, and leaves the counter at zero for the next
  // launch (graph replays included).
  int* last_s = bad_block_s + 1;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* counter = counters + static_cast<long long>(qrow) * n_y + y_tile;
    const bool last = atomicAdd(counter, 1) == parts - 1;
    if (last) *counter = 0;
    *last_s = last;
  }
  __syncthreads();
  if (*last_s == 0) continue;
  __threadfence();
  for (int g = warp; g < heads_here; g += Geo::kWarps) {
    // The grid split's partitions are consecutive rows; the flat split's pieces are c0's
    // slot, then the start slots of the CTAs after it.
    auto row_of = [&](int p) {
      if (!flat) return (row0 + g) * gridDim.z + p;
      return (p == 0 ? 2 * f_c0 + f_k0 : 2 * (f_c0 + p)) * GT + g;
    };
    merge_partitions<T, HS>(out + (row0 + g) * HS, vp.lse != nullptr ? vp.lse + row0 + g : nullptr,
                            part_out, part_max, part_sum, parts, row_of,
                            sink_log2(vp, head0 + g), vp);
  }
  }  // the units
}

// Merge the partitions of split-KV decode that paged_decode does not merge itself (vLLM's
// v2 entry point, whose partials live in the caller's buffers) and of the multi-token
// kernels (paged_prefill, paged_prefill_sm90, mla_attention, mla_attention_sm90): one warp
// per (row, head), grid (num_seqs, num_heads), or (total_q, num_heads) for the multi-token
// kernels' partials. Sinks and the lse output come in `vp`, and its window (with the
// decode kernel's tile_tokens) says where the partitions start.
// `query_start_loc` (the multi-token kernels' query starts, or null): rows outside
// [query_start_loc[0], query_start_loc[num_seqs]) are no sequence's, so no partial of
// theirs was written; they are left as they are, as the kernels leave them without a
// split (the JAX operations zero them first for padded batches).
constexpr int kCombineThreads = 32;

template <typename T, int HEAD_SIZE>
__global__ void __launch_bounds__(kCombineThreads)
    paged_decode_combine(T* __restrict__ out, const float* __restrict__ part_out,
                         const float* __restrict__ part_max, const float* __restrict__ part_sum,
                         const int* __restrict__ context_lens,
                         const int* __restrict__ query_start_loc, int max_context,
                         int num_seqs, int partition_tokens, int num_partitions,
                         int tile_tokens, const __grid_constant__ VariantParams vp) {
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  if (query_start_loc != nullptr &&
      (seq < __ldg(query_start_loc) || seq >= __ldg(query_start_loc + num_seqs))) {
    return;
  }
  const long long row = static_cast<long long>(seq) * gridDim.y + head;
  // The same clamp and window start as paged_decode, so both agree on which partitions
  // exist; paged_prefill's partials (context_lens null, a row per query token and head)
  // are all written.
  int parts = num_partitions;
  if (context_lens != nullptr) {
    const int ctx = max(0, min(context_lens[seq], max_context));
    const int base = vp.window > 0 ? max(0, ctx - vp.window) / tile_tokens * tile_tokens : 0;
    parts = live_partitions(ctx - base, partition_tokens, num_partitions);
  }
  merge_partitions<T, HEAD_SIZE>(out + row * HEAD_SIZE, vp.lse != nullptr ? vp.lse + row : nullptr,
                                 part_out + row * num_partitions * HEAD_SIZE,
                                 part_max + row * num_partitions, part_sum + row * num_partitions,
                                 parts, [](int p) { return static_cast<long long>(p); },
                                 sink_log2(vp, head), vp);
}

}  // namespace cupaged
