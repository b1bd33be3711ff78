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
// Work split: one CTA per (sequence, KV head, tile of query rows). A sequence's rows are
// its tokens times the query heads of the KV head's group, packed token-major
// (row = token * group + head), so every K/V tile the CTA loads serves the whole group:
// four verify tokens of a 4-head group fill one 16-row mma tile. Each warp owns
// 16 * M_ATOMS rows (FlashAttention-2's split: no cross-warp reduction in the loop),
// walking the sequence's keys in tiles of TILE_N tokens streamed by cp.async, STAGES deep.
// With KEY_WARPS > 1 (few rows: verify's 16) that many warps share the same rows and each
// takes its own TILE_N / KEY_WARPS keys of every tile, with a softmax state of its own;
// the states merge through shared memory at the end, so no warp idles on padding rows:
//   S = Q K^T (mma.m16n8k16, fp32 sums), scaled into the log2 domain; masks only on
//   tiles that need them (a causal diagonal, a sequence's last tile, a window's edge),
//   ALiBi per key there and as a per-tile ramp elsewhere (variant bit kVarAlibi);
//   online softmax on the rows' registers, the output rescaled only when a maximum moved
//   (a bfloat16 soft-cap, whose logits are bounded, needs no maximum: kVarFixedOffset);
//   O += P V with P rounded to T straight from the S fragments (no shared-memory trip).
// Block ids reach shared memory a tile ahead of the copies that use them, so a copy's
// address never waits on a table read. Grid y strides over query tiles, so a host bound
// that undercounts the longest query costs parallelism, never rows.
#pragma once
#include "common.cuh"
#include "fp8.cuh"
#include "kv_layout.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "variants.cuh"

namespace cupaged {

// T is the query's and output's type; C the cache's: T itself, or fp8 (fp8.cuh), whose
// tiles are widened to T in shared memory before the mma reads them.
template <typename T, typename C, int HEAD_SIZE, int BLOCK_SIZE, int KV_FORMAT, int KV_SCALE,
          int WARPS, int M_ATOMS, int KEY_WARPS, int TILE_N, int STAGES>
struct PrefillGeometry {
  static constexpr int kThreads = WARPS * 32;
  static constexpr bool kQuant = !is_same<T, C>::value;  // an fp8 cache, with scales
  static constexpr bool kTokenScales = kQuant && KV_SCALE == kScaleTokenHead;
  static constexpr int kVec = 8;                              // 16-bit elements per 16 bytes
  static constexpr int kCVec = 16 / static_cast<int>(sizeof(C));  // cache elements per 16 bytes
  static constexpr int kHSP = (HEAD_SIZE + 15) / 16 * 16;     // head size padded for mma's k
  static constexpr int kChunks = HEAD_SIZE / kCVec;           // 16-byte chunks per cached row
  static constexpr int kWarpRows = 16 * M_ATOMS;
  // Heads over 256 dims split each row's work over a pair of warps: each computes Q K^T
  // over half the dims (the pair adds its partial scores through shared memory, so both
  // hold the same S and the same softmax) and accumulates half of O's columns. A thread
  // then keeps a 256-dim head's accumulators, which fit its registers; 512 would not.
  static constexpr int kDimSplit = kHSP > 256 ? 2 : 1;
  static constexpr int kRowWarps = WARPS / kDimSplit / KEY_WARPS;
  static constexpr int kRows = kRowWarps * kWarpRows;         // query rows per CTA
  static constexpr int kWarpKeys = TILE_N / KEY_WARPS;        // keys of a tile per warp
  static constexpr int kK16 = kHSP / 16;                      // 16-dim steps of a head
  static constexpr int kSliceK16 = (kK16 + kDimSplit - 1) / kDimSplit;  // a warp's, at most
  static constexpr int kNTiles = kWarpKeys / 8;  // n8 tiles of S per m16 atom
  static constexpr int kDTiles = kSliceK16 * 2;  // n8 tiles of O per m16 atom
  // Shared rows of kHSP elements are padded by 16 bytes: eight consecutive rows then start
  // in distinct 16-byte bank groups, so ldmatrix and the cp.async stores are conflict-free.
  static constexpr int kRow = kHSP + kVec;
  static constexpr bool kVDimMajor = KV_FORMAT == kFormatVllm;      // V stored [dim][token]
  static constexpr int kVRow = TILE_N + kVec;                 // its row, padded likewise
  static constexpr int kQBytes = kRows * kRow * 2;
  // Stages hold the cache's bytes in the same layouts, rows padded by 16 bytes: kCRow
  // (K, token-major V) and kCVRow (vLLM's V) elements of C.
  static constexpr int kCRow = kQuant ? HEAD_SIZE + kCVec : kRow;
  static constexpr int kCVRow = kQuant ? TILE_N + kCVec : kVRow;
  static constexpr int kKStage = TILE_N * kCRow * static_cast<int>(sizeof(C));
  static constexpr int kVStage =
      (kVDimMajor ? kHSP * kCVRow : TILE_N * kCRow) * static_cast<int>(sizeof(C));
  static constexpr int kOffK = kQBytes;
  static constexpr int kOffV = kOffK + STAGES * kKStage;
  // fp8: the tile being computed, widened to T (one K and one V tile).
  static constexpr int kKWide = TILE_N * kRow * 2;
  static constexpr int kVWide = kVDimMajor ? kHSP * kVRow * 2 : TILE_N * kRow * 2;
  static constexpr int kOffWide = kOffV + STAGES * kVStage;
  // Block ids of the tiles in flight, one slot per stage: ids of tile i sit in slot
  // i % STAGES from a barrier before its copies until a barrier after them.
  static constexpr int kIds = TILE_N > BLOCK_SIZE ? TILE_N / BLOCK_SIZE : 1;
  static constexpr int kOffIds = kOffWide + (kQuant ? kKWide + kVWide : 0);
  static constexpr int kOffFlag = kOffIds + (STAGES * kIds * 4 + 15) / 16 * 16;
  // Per-token scales (kTokenScales): [STAGES][TILE_N] floats for K, then for V.
  static constexpr int kOffScales = kOffFlag + 16;
  // kDimSplit 2: each warp's partial scores, [kRowWarps][2][M_ATOMS][kNTiles][4][32 lanes].
  static constexpr int kOffX = kOffScales + (kTokenScales ? 2 * STAGES * TILE_N * 4 : 0);
  static constexpr int kXFloats = kDimSplit > 1 ? WARPS * M_ATOMS * kNTiles * 4 * 32 : 0;
  static constexpr int kSmemBytes = kOffX + kXFloats * 4;
  // KEY_WARPS > 1: after the last tile, each warp but the first of its rows leaves its
  // rows' state (per lane: maximum and sum of both rows, then O's fragments, per m-atom)
  // in the K/V stages, which no copy writes any more; the first merges them. (The states
  // cover K's zero padding too: the next query tile clears it again.)
  static constexpr int kStateFloats = M_ATOMS * (4 + kDTiles * 4);
  static constexpr int kMergeBytes = (KEY_WARPS - 1) * kRowWarps * kStateFloats * 32 * 4;
  // Registers: with one m-atom a warp, two CTAs an SM (ptxas caps a thread at 65536 / (2 x
  // threads): 255 for four warps, whose accumulators at head size 256, or a pair's half
  // of 512, need about 245; 128 for eight warps, enough up to head size 128); eight warps
  // of pairs and two m-atoms need all 255, one CTA. (Three CTAs of four warps sharing 16
  // rows, at 168 registers, ran slower than two: docs/PERFORMANCE.md.)
  static constexpr int kMinBlocks = M_ATOMS == 1 && (kDimSplit == 1 || WARPS <= 4) ? 2 : 1;

  static_assert(sizeof(T) == 2, "tensor cores take 16-bit operands");
  static_assert(HEAD_SIZE % 8 == 0 && HEAD_SIZE >= 32 && HEAD_SIZE <= 512, "HEAD_SIZE");
  static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && BLOCK_SIZE <= 256, "BLOCK_SIZE");
  static_assert(KV_FORMAT == kFormatTokenMajor || BLOCK_SIZE >= kCVec,
                "vLLM's value layout is copied in runs of 16 bytes of one block");
  static_assert(!kQuant || (sizeof(C) == 1 && HEAD_SIZE % 16 == 0),
                "fp8 caches: head sizes that are multiples of 16");
  static_assert(KV_SCALE == kScaleTensor || KV_SCALE == kScaleTokenHead, "KV_SCALE");
  static_assert(TILE_N == 16 || TILE_N == 32 || TILE_N == 64 || TILE_N == 128, "TILE_N");
  static_assert(WARPS >= 1 && WARPS <= 8 && (M_ATOMS == 1 || M_ATOMS == 2), "WARPS, M_ATOMS");
  static_assert(WARPS % kDimSplit == 0, "heads over 256 dims take warps in pairs");
  static_assert(KEY_WARPS == 1 ||
                    (KEY_WARPS > 1 && kDimSplit == 1 && WARPS % KEY_WARPS == 0 &&
                     TILE_N % (16 * KEY_WARPS) == 0 && kMergeBytes <= kOffWide - kOffK),
                "KEY_WARPS: warps that divide WARPS, whole 16-key steps of a tile each, heads "
                "of 256 dims or fewer, their states within the stages");
  static_assert(STAGES >= 2, "STAGES");
};


template <typename T, typename C, int HEAD_SIZE, int BLOCK_SIZE, int KV_FORMAT, int KV_SCALE,
          int WARPS, int M_ATOMS, int KEY_WARPS, int TILE_N, int STAGES, int VARIANT>
__global__ void __launch_bounds__(
    WARPS * 32, (PrefillGeometry<T, C, HEAD_SIZE, BLOCK_SIZE, KV_FORMAT, KV_SCALE, WARPS,
                                 M_ATOMS, KEY_WARPS, TILE_N, STAGES>::kMinBlocks))
    paged_prefill(T* __restrict__ out,
                  // Split-KV (split_tiles > 0: grid z partitions each query tile's keys into
                  // runs of split_tiles tiles, the last running to the end): float32
                  // [rows * num_heads, gridDim.z] partials for paged_decode_combine instead
                  // of `out`. Rows of a partition with no key get max -inf and sum 0.
                  float* __restrict__ part_out, float* __restrict__ part_max,
                  float* __restrict__ part_sum, int split_tiles,
                  const T* __restrict__ query, long long q_token_stride,
                  long long q_head_stride, const __grid_constant__ PagedKV kv,
                  const int* __restrict__ seq_lens,
                  const int* __restrict__ query_start_loc,  // [num_seqs + 1], or null: one each
                  const float* __restrict__ alibi_slopes,   // [num_heads], or null
                  int num_heads, int group_size, int causal, float scale_log2,
                  const __grid_constant__ VariantParams vp) {
  using Geo = PrefillGeometry<T, C, HEAD_SIZE, BLOCK_SIZE, KV_FORMAT, KV_SCALE, WARPS, M_ATOMS,
                              KEY_WARPS, TILE_N, STAGES>;
  using KV = KVAccess<C, KV_FORMAT, BLOCK_SIZE>;
  using Var = Variant<VARIANT>;
  static_assert(!Var::kBlockSparse, "blocksparse is a decode variant");
  static_assert(!Var::kFixedOffset || is_same<T, bfloat16_t>::value,
                "a fixed softmax offset needs P in bfloat16 (fp32's exponent range)");
  constexpr int X = Geo::kVec;
  constexpr int CX = Geo::kCVec;  // cache elements per 16-byte copy
  constexpr int CB = static_cast<int>(sizeof(C));
  constexpr int CROW = Geo::kCRow;
  constexpr int NT = Geo::kThreads;
  constexpr int ROW = Geo::kRow;
  constexpr int MA = M_ATOMS;
  constexpr int CH = Geo::kChunks;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  C* k_s = reinterpret_cast<C*>(smem + Geo::kOffK);
  C* v_s = reinterpret_cast<C*>(smem + Geo::kOffV);
  float* ksc_s = reinterpret_cast<float*>(smem + Geo::kOffScales);  // [STAGES][TILE_N]
  float* vsc_s = ksc_s + STAGES * TILE_N;
  int* ids_s = reinterpret_cast<int*>(smem + Geo::kOffIds);
  int* bad_block_s = reinterpret_cast<int*>(smem + Geo::kOffFlag);
  float* xs = reinterpret_cast<float*>(smem + Geo::kOffX);  // kDimSplit 2: partial scores

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // The warp's rows, and its half of the head's dims when they are split over a pair, or
  // its share of each tile's keys (KEY_WARPS).
  const int row_warp = Geo::kDimSplit > 1 || KEY_WARPS > 1 ? warp % Geo::kRowWarps : warp;
  const int dslice = Geo::kDimSplit > 1 ? warp / Geo::kRowWarps : 0;
  const int kslice = KEY_WARPS > 1 ? warp / Geo::kRowWarps : 0;
  const int key0 = kslice * Geo::kWarpKeys;  // the warp's first key within a tile
  const int k16_0 = dslice * Geo::kSliceK16;  // the slice's first 16-dim step
  // Grid x is (sequence, KV head) and y counts query tiles from each sequence's last: the
  // hardware starts CTAs in order, so the longest causal tiles of every sequence go first
  // and the short ones fill the last wave.
  const int num_kv_heads = num_heads / group_size;
  const int seq = blockIdx.x / num_kv_heads;
  const int kv_head = blockIdx.x - seq * num_kv_heads;

  if (tid == 0 && dynamic_smem_bytes() < static_cast<unsigned>(Geo::kSmemBytes)) __trap();

  const int q_begin = query_start_loc != nullptr ? query_start_loc[seq] : seq;
  const int q_len = query_start_loc != nullptr ? query_start_loc[seq + 1] - q_begin : 1;
  // Lengths past the table's width are clamped so the row is never overrun; negative
  // lengths count as empty (cupaged.check_block_tables and CUPAGED_DEBUG report both).
  const int seq_len = max(0, min(seq_lens[seq], kv.max_blocks * BLOCK_SIZE));
  const int packed = q_len * group_size;  // validation keeps total_q * group below 2^31
  const int q_tiles = q_len > 0 ? (packed + Geo::kRows - 1) / Geo::kRows : 0;
  const int q_shift = seq_len - q_len;  // position of query token i is q_shift + i
  const int* bt_row = kv.block_tables + seq * kv.bt_stride;
  const typename KV::Head hd = KV::head(kv, kv_head);
  // An fp8 cache's per-tensor scales: k's multiplies the scores, v's the output.
  float score_scale = scale_log2;
  float out_scale = 1.f;
  if constexpr (Geo::kQuant && !Geo::kTokenScales) {
    score_scale *= tensor_k_scale(kv);
    out_scale = tensor_v_scale(kv);
  }
  const unsigned k_s_addr = static_cast<unsigned>(__cvta_generic_to_shared(k_s));
  const unsigned v_s_addr = static_cast<unsigned>(__cvta_generic_to_shared(v_s));

  // Head-size padding (kHSP > HEAD_SIZE) must read as zeros in K: the padded query columns
  // are zero, and 0 * garbage may be NaN. cp.async never writes it, so clear it once; with
  // KEY_WARPS once a query tile, as the merge's states write over it.
  auto clear_k_padding = [&] {
    if constexpr (Geo::kHSP != HEAD_SIZE) {
      for (int r = tid; r < STAGES * TILE_N; r += NT) {
        *reinterpret_cast<uint4*>(k_s + r * ROW + HEAD_SIZE) = make_uint4(0, 0, 0, 0);
      }
    }
  };
  if constexpr (KEY_WARPS == 1) clear_k_padding();

  // This thread's rows: atom a, half h (C-fragment rows lane / 4 and lane / 4 + 8).
  const int frag_row = lane >> 2;
  const int frag_col = (lane & 3) * 2;

  for (int qt = q_tiles - 1 - static_cast<int>(blockIdx.y); qt >= 0; qt -= gridDim.y) {
    const int row0 = qt * Geo::kRows;
    const int rows_here = min(Geo::kRows, packed - row0);
    // Keys any row of this tile may see: causal rows stop at their own position.
    const int last_pos = q_shift + (row0 + rows_here - 1) / group_size;
    const int kv_end = causal ? max(0, min(seq_len, last_pos + 1)) : seq_len;
    // A window's first key for the tile's first (earliest) row: tiles from there on, the
    // blocks before it never read.
    int kv_lo = min(Var::first_key(vp, q_shift + row0 / group_size), kv_end);
    int tile_base = kv_lo / TILE_N;
    int tile_end = (kv_end + TILE_N - 1) / TILE_N;
    if (split_tiles > 0) {
      // This CTA's run of the tile's tiles; its first key starts a tile, so nothing before
      // it needs a mask (kv_lo only moves for the window's tests).
      const long long first = tile_base + static_cast<long long>(blockIdx.z) * split_tiles;
      const int b = static_cast<int>(min(first, static_cast<long long>(tile_end)));
      if (blockIdx.z + 1 < gridDim.z) tile_end = min(tile_end, b + split_tiles);
      if (b > tile_base) kv_lo = b * TILE_N;
      tile_base = b;
    }
    const int n_tiles = kv_lo < kv_end ? tile_end - tile_base : 0;

    // Entry i of tile `tile`'s block ids (-1: outside the cache, reported as NaN rows).
    // Entries past kv_end are never used and never read. Thread tid owns entries
    // tid + k * NT.
    auto tile_id = [&](int tile, int i) -> int {
      const int logical = (tile_base + tile) * TILE_N / BLOCK_SIZE + i;
      if (i >= Geo::kIds || tile >= n_tiles || logical * BLOCK_SIZE >= kv_end) return 0;
      if (Var::kWindow && (logical + 1) * BLOCK_SIZE <= kv_lo) return 0;  // before the window
      const int phys = __ldg(bt_row + logical);
      return static_cast<unsigned>(phys) < static_cast<unsigned>(kv.num_blocks) ? phys : -1;
    };
    constexpr int kIdsPer = (Geo::kIds + NT - 1) / NT;
    auto store_ids = [&](int tile, const int (&ids)[kIdsPer]) {
#pragma unroll
      for (int k = 0; k < kIdsPer; ++k) {
        const int i = tid + k * NT;
        if (i < Geo::kIds) ids_s[(tile % STAGES) * Geo::kIds + i] = ids[k];
      }
    };
    auto fetch_ids = [&](int tile, int (&ids)[kIdsPer]) {
#pragma unroll
      for (int k = 0; k < kIdsPer; ++k) ids[k] = tile_id(tile, tid + k * NT);
    };

    __syncthreads();  // the previous query tile is done with shared memory
    if constexpr (KEY_WARPS > 1) clear_k_padding();
    if (tid == 0) *bad_block_s = 0;
    // Ids of the prologue's tiles and of the first tile the loop copies; the next tile's
    // are stored at the loop's first iteration.
    int id_ahead[kIdsPer];
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      fetch_ids(s, id_ahead);
      store_ids(s, id_ahead);
    }
    fetch_ids(STAGES, id_ahead);

    // ---- the query tile: rows past the sequence's are zeros ------------------------------
    for (int u = tid; u < Geo::kRows * (Geo::kHSP / X); u += NT) {
      const int r = u / (Geo::kHSP / X);
      const int c = u % (Geo::kHSP / X);
      T* dst = q_s + r * ROW + c * X;
      if (r < rows_here && c < HEAD_SIZE / X) {
        const int p = row0 + r;
        const int head = kv_head * group_size + p % group_size;
        cp_async16(dst, query + (q_begin + p / group_size) * q_token_stride +
                            head * q_head_stride + c * X);
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
    }

    // Per-row constants of this thread's rows, and the warp's range of limits: tiles below
    // the smallest need no mask, tiles from the largest on contribute nothing.
    int q_pos[MA][2];
    int limit[MA][2];  // keys at positions < limit are seen
    int first[MA][2];  // and at positions >= first (a window; else 0)
    float slope[MA][2];
    int lim_lo = 0x7fffffff, lim_hi = 0;
    int first_lo = 0x7fffffff, first_hi = 0;  // over the warp's real rows
#pragma unroll
    for (int a = 0; a < MA; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = row0 + row_warp * Geo::kWarpRows + a * 16 + frag_row + h * 8;
        q_pos[a][h] = q_shift + p / group_size;
        limit[a][h] = p >= packed ? 0 : causal ? max(0, min(seq_len, q_pos[a][h] + 1)) : seq_len;
        first[a][h] = Var::first_key(vp, q_pos[a][h]);
        const int head = kv_head * group_size + p % group_size;
        slope[a][h] = (alibi_slopes != nullptr && p < packed) ? alibi_slopes[head] * kLog2e : 0.f;
        lim_lo = min(lim_lo, limit[a][h]);
        lim_hi = max(lim_hi, limit[a][h]);
        if (p < packed) {
          first_lo = min(first_lo, first[a][h]);
          first_hi = max(first_hi, first[a][h]);
        }
      }
    }
    lim_lo = __reduce_min_sync(~0u, lim_lo);
    lim_hi = __reduce_max_sync(~0u, lim_hi);
    if constexpr (Var::kWindow) {
      first_lo = __reduce_min_sync(~0u, first_lo);
      first_hi = __reduce_max_sync(~0u, first_hi);
    }
    // Tiles without masks need no per-key work: no ALiBi, or ALiBi as a ramp (kAlibi, the
    // host's spelling of "slopes given"; slopes without it take the per-key path).
    const bool plain = Var::kAlibi || alibi_slopes == nullptr;

    // One tile's K and V into a stage. Each thread owns token slots at fixed tile
    // positions and, per slot, chunks at a fixed stride: the block id, the in-block
    // offset and the 64-bit address are computed once per slot, and its copies differ by
    // compile-time offsets. Offsets within a block are 32-bit (the host checks strides).
    auto load_tile = [&](int tile, int stage) {
      const unsigned t0 = (tile_base + tile) * TILE_N;
      const int* ids = ids_s + stage * Geo::kIds;
      const unsigned ks = k_s_addr + stage * Geo::kKStage;
      const unsigned vs = v_s_addr + stage * Geo::kVStage;
      // Block id and offset of token t0 + t, or false: past the keys, before the window
      // (the whole run of `span` tokens from t), or a bad id.
      auto slot = [&](unsigned t, int& phys, unsigned& within, unsigned span = 1) {
        if (t0 + t >= static_cast<unsigned>(kv_end)) return false;
        if (Var::kWindow && t0 + t + span <= static_cast<unsigned>(kv_lo)) return false;
        phys = ids[TILE_N > BLOCK_SIZE ? t / BLOCK_SIZE : 0];  // tiles hold whole blocks,
        within = (t0 + t) % BLOCK_SIZE;                         // or lie within one
        if (phys < 0) {
          *bad_block_s = 1;
          return false;
        }
        return true;
      };
      if constexpr (Geo::kTokenScales) {
        // Slots not copied get scale 0: their probabilities are 0, and 0 * a stale scale
        // could be NaN.
        for (int t = tid; t < TILE_N; t += NT) {
          float* kd = ksc_s + stage * TILE_N + t;
          float* vd = vsc_s + stage * TILE_N + t;
          int phys;
          unsigned within;
          if (!slot(t, phys, within)) {
            *kd = 0.f;
            *vd = 0.f;
            continue;
          }
          const long long o = scale_offset(kv, phys, kv_head, within);
          cp_async4(kd, kv.k_scale + o);
          cp_async4(vd, kv.v_scale + o);
        }
      }
      if constexpr (KV_FORMAT == kFormatTokenMajor) {
        // Eight (four) threads per token row: a warp's copies are whole 128-byte lines.
        constexpr int kTPR = CH >= 8 ? 8 : 4;
        constexpr int kTokPerPass = NT / kTPR;
        constexpr int kPasses = (TILE_N + kTokPerPass - 1) / kTokPerPass;
        constexpr int kCPer = (CH + kTPR - 1) / kTPR;
        const unsigned c0 = tid % kTPR;
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
          const unsigned t = pass * kTokPerPass + tid / kTPR;
          int phys;
          unsigned within;
          if ((kTokPerPass * kPasses > TILE_N && t >= TILE_N) || !slot(t, phys, within)) continue;
          const unsigned long long pb = static_cast<unsigned long long>(phys);
          const C* gk = hd.k + pb * hd.k_block + within * hd.k_token + c0 * CX;
          const C* gv = hd.v + pb * hd.v_block + within * hd.v_token + c0 * CX;
          const unsigned sk = ks + (t * CROW + c0 * CX) * CB;
          const unsigned sv = vs + (t * CROW + c0 * CX) * CB;
#pragma unroll
          for (int i = 0; i < kCPer; ++i) {
            if (CH % kTPR != 0 && c0 + i * kTPR >= CH) break;
            cp_async16_shared(sk + i * kTPR * 16, gk + i * kTPR * CX);
          }
#pragma unroll
          for (int i = 0; i < kCPer; ++i) {
            if (CH % kTPR != 0 && c0 + i * kTPR >= CH) break;
            cp_async16_shared(sv + i * kTPR * 16, gv + i * kTPR * CX);
          }
        }
      } else {
        // vLLM's key, [chunk][token][x]: consecutive threads take consecutive tokens of one
        // chunk (contiguous within a block); a thread's chunks are kCStep apart.
        constexpr int kKSlots = NT >= TILE_N ? 1 : TILE_N / NT;
        constexpr int kCStep = NT >= TILE_N ? NT / TILE_N : 1;
        constexpr int kCPer = (CH + kCStep - 1) / kCStep;
        const unsigned c0 = NT >= TILE_N ? tid / TILE_N : 0;
#pragma unroll
        for (int k = 0; k < kKSlots; ++k) {
          const unsigned t = tid % TILE_N + k * NT;
          int phys;
          unsigned within;
          if (!slot(t, phys, within)) continue;
          const C* g = hd.k + static_cast<unsigned long long>(phys) * hd.k_block +
                       (c0 * BLOCK_SIZE + within) * CX;
          const unsigned sk = ks + (t * CROW + c0 * CX) * CB;
#pragma unroll
          for (int i = 0; i < kCPer; ++i) {
            if (CH % kCStep != 0 && c0 + i * kCStep >= CH) break;
            cp_async16_shared(sk + i * kCStep * 16, g + i * kCStep * BLOCK_SIZE * CX);
          }
        }
        // vLLM's value, [dim][token]: runs of 16 bytes (CX tokens) of one dim, kept
        // dim-major; a thread's dims are kDStep apart.
        constexpr int kRuns = TILE_N / CX;
        constexpr int kDStep = NT / kRuns;
        constexpr int kDPer = (HEAD_SIZE + kDStep - 1) / kDStep;
        const unsigned t = (tid % kRuns) * CX;
        const unsigned d0 = tid / kRuns;
        int phys;
        unsigned within;
        if (slot(t, phys, within, CX)) {
          const C* g = hd.v + static_cast<unsigned long long>(phys) * hd.v_block +
                       d0 * BLOCK_SIZE + within;
          const unsigned sv = vs + (d0 * Geo::kCVRow + t) * CB;
#pragma unroll
          for (int i = 0; i < kDPer; ++i) {
            if (HEAD_SIZE % kDStep != 0 && d0 + i * kDStep >= HEAD_SIZE) break;
            cp_async16_shared(sv + i * kDStep * Geo::kCVRow * CB, g + i * kDStep * BLOCK_SIZE);
          }
        }
      }
    };

    // fp8: the stage's K and V widened to T, exactly, in the layouts of 16-bit stages.
    auto widen_tile = [&](const C* ks, const C* vs, const float* vsc, T* kw, T* vw) {
      if constexpr (Geo::kQuant) {
        for (int u = tid; u < TILE_N * HEAD_SIZE / 16; u += NT) {
          uint4 lo, hi;
          const int t = u / (HEAD_SIZE / 16);
          const int c = u % (HEAD_SIZE / 16);
          widen16<T, C>(*reinterpret_cast<const uint4*>(ks + t * CROW + c * 16), lo, hi);
          *reinterpret_cast<uint4*>(kw + t * ROW + c * 16) = lo;
          *reinterpret_cast<uint4*>(kw + t * ROW + c * 16 + 8) = hi;
          int vsrc = t * CROW + c * 16, vdst = t * ROW + c * 16;
          const float* sc = vsc + t;  // V's per-token scales (fp8.cuh), one per token
          int sc_stride = 0;
          if constexpr (Geo::kVDimMajor) {  // [dim][token]
            const int d = u / (TILE_N / 16);
            const int r = u % (TILE_N / 16);
            vsrc = d * Geo::kCVRow + r * 16;
            vdst = d * Geo::kVRow + r * 16;
            sc = vsc + r * 16;
            sc_stride = 1;
          }
          if constexpr (Geo::kTokenScales) {
            widen16_scaled<T, C>(*reinterpret_cast<const uint4*>(vs + vsrc), sc, sc_stride, lo, hi);
          } else {
            widen16<T, C>(*reinterpret_cast<const uint4*>(vs + vsrc), lo, hi);
          }
          *reinterpret_cast<uint4*>(vw + vdst) = lo;
          *reinterpret_cast<uint4*>(vw + vdst + 8) = hi;
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

    __syncthreads();  // the prologue's ids are visible
    // Prologue: the query travels in the first tile's copy group.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < n_tiles) load_tile(s, s);
      cp_async_commit();
    }

    const T* q_warp = q_s + row_warp * Geo::kWarpRows * ROW;
    for (int it = 0; it < n_tiles; ++it) {
      const int t0 = (tile_base + it) * TILE_N;
      const int stage = it % STAGES;
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile `it` is visible and everyone is done with tile it - 1
      const int next = it + STAGES - 1;
      if (next < n_tiles) load_tile(next, next % STAGES);
      cp_async_commit();
      // Ids of tile it + STAGES go into tile it's slot (all its copies were issued before
      // the barrier above; they are first read after the next); the load for the tile
      // after that flies through this tile's arithmetic.
      store_ids(it + STAGES, id_ahead);
      fetch_ids(it + STAGES + 1, id_ahead);

      const int valid = min(TILE_N, kv_end - t0);
      const float* ksc = ksc_s + stage * TILE_N;  // per-token scales (kTokenScales)
      const float* vsc = vsc_s + stage * TILE_N;
      const T* ks = reinterpret_cast<const T*>(k_s + stage * (Geo::kKStage / CB));
      T* vs = reinterpret_cast<T*>(v_s + stage * (Geo::kVStage / CB));
      if constexpr (Geo::kQuant) {
        T* kw = reinterpret_cast<T*>(smem + Geo::kOffWide);
        T* vw = reinterpret_cast<T*>(smem + Geo::kOffWide + Geo::kKWide);
        widen_tile(k_s + stage * (Geo::kKStage / CB), v_s + stage * (Geo::kVStage / CB), vsc, kw,
                   vw);
        __syncthreads();
        ks = kw;
        vs = vw;
      }
      // Slots before a window's first key (the first tile only) were not copied either.
      const int skipped = Var::kWindow ? min(TILE_N, max(0, kv_lo - t0)) : 0;
      if (valid < TILE_N || skipped > 0) {
        // Slots at or past kv_end were not copied (or hold tokens past the sequence,
        // possibly NaN); P is 0 there, and 0 * NaN is NaN, so V must read as zeros.
        if constexpr (Geo::kVDimMajor) {
          const int cols = TILE_N - valid;
          for (int i = tid; i < HEAD_SIZE * cols; i += NT) {
            vs[(i / cols) * Geo::kVRow + valid + i % cols] = T{};
          }
          for (int i = tid; i < HEAD_SIZE * skipped; i += NT) {
            vs[(i / skipped) * Geo::kVRow + i % skipped] = T{};
          }
        } else {
          for (int i = tid; i < (TILE_N - valid) * (Geo::kHSP / 2); i += NT) {
            reinterpret_cast<unsigned*>(vs + (valid + i / (Geo::kHSP / 2)) * ROW)[i % (Geo::kHSP / 2)] = 0u;
          }
          for (int i = tid; i < skipped * (Geo::kHSP / 2); i += NT) {
            reinterpret_cast<unsigned*>(vs + (i / (Geo::kHSP / 2)) * ROW)[i % (Geo::kHSP / 2)] = 0u;
          }
        }
        __syncthreads();
      }
      // Every row of this warp is past its keys of this tile (a causal diagonal), or they
      // lie before every row's window: nothing to add.
      const int w0 = t0 + key0;  // the warp's first key
      if (w0 >= lim_hi || (Var::kWindow && w0 + Geo::kWarpKeys <= first_lo)) continue;

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
      for (int kk = 0; kk < Geo::kSliceK16; ++kk) {
        const int k16 = k16_0 + kk;  // this warp's dims of the head
        if (Geo::kK16 % Geo::kDimSplit != 0 && k16 >= Geo::kK16) break;
        unsigned qa[MA][4];
#pragma unroll
        for (int a = 0; a < MA; ++a) {
          // A: matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15), lanes 8m..8m+7 address matrix m.
          ldmatrix_x4(qa[a], q_warp + (a * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW +
                                 k16 * 16 + (lane >> 4) * 8);
        }
#pragma unroll
        for (int np = 0; np < Geo::kNTiles / 2; ++np) {
          // B = K^T for two n8 tiles: rows of K are tokens, 16 bytes of dims each.
          unsigned kb[4];
          ldmatrix_x4(kb, ks + (key0 + np * 16 + (lane & 7) + (lane >> 4) * 8) * ROW + k16 * 16 +
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

      if constexpr (Geo::kDimSplit > 1) {
        // The pair's partial scores: each adds the other's to its own (a + b == b + a
        // exactly, so both warps go on with the same S). The slot is rewritten only after
        // the next tile's __syncthreads, which the partner reaches once it has read it.
        constexpr int kPer = MA * Geo::kNTiles * 4;
        float* mine = xs + (row_warp * 2 + dslice) * kPer * 32 + lane;
        const float* theirs = xs + (row_warp * 2 + 1 - dslice) * kPer * 32 + lane;
#pragma unroll
        for (int a = 0; a < MA; ++a) {
#pragma unroll
          for (int n = 0; n < Geo::kNTiles; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) mine[((a * Geo::kNTiles + n) * 4 + i) * 32] = s[a][n][i];
          }
        }
        named_bar_sync<64>(1 + row_warp);
#pragma unroll
        for (int a = 0; a < MA; ++a) {
#pragma unroll
          for (int n = 0; n < Geo::kNTiles; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) s[a][n][i] += theirs[((a * Geo::kNTiles + n) * 4 + i) * 32];
          }
        }
      }

      // ---- scale (ALiBi, masks where needed); online softmax ----------------------------
      const bool masked =
          !plain || w0 + Geo::kWarpKeys > lim_lo || (Var::kWindow && w0 < first_hi);
      unsigned pa[MA][Geo::kWarpKeys / 16][4];  // P as A fragments of the P V product
#pragma unroll
      for (int a = 0; a < MA; ++a) {
        float tmax[2] = {neg_inf(), neg_inf()};
        // kFixedOffset: exp2's argument (logit - o) straight from the cap's last step, and
        // no maximum. The sums stay fp32 sums of the unrounded weights, as with a maximum,
        // but no weight is exactly 1 here: a row of few keys has its weights' bfloat16
        // rounding (2^-9) in its output as well as the output's own (sums of the rounded P
        // on the tensor cores would remove it, and cost 1.6% and the lse's accuracy:
        // docs/PERFORMANCE.md).
        if (masked) {
#pragma unroll
          for (int n = 0; n < Geo::kNTiles; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // C fragment: row frag_row + 8 (i / 2), key n * 8 + frag_col + i % 2
              const int h = i >> 1;
              const int key = w0 + n * 8 + frag_col + (i & 1);
              const float sk = Geo::kTokenScales ? score_scale * ksc[key - t0] : score_scale;
              const float v = Var::kFixedOffset
                                  ? Var::fixed_exponent(vp, s[a][n][i], sk)
                                  : fmaf(slope[a][h], static_cast<float>(key - q_pos[a][h]),
                                         Var::logits(vp, s[a][n][i], sk));
              const bool seen = key < limit[a][h] && (!Var::kWindow || key >= first[a][h]);
              s[a][n][i] = seen ? v : neg_inf();
              tmax[h] = fmaxf(tmax[h], s[a][n][i]);
            }
          }
        } else if constexpr (Var::kAlibi) {
          // slope * (key - q_pos) with key = w0 + frag_col + n * 8 + (i & 1): a per-row base
          // for the tile plus the slope times a constant, one FFMA per score.
          float base[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            base[h] = slope[a][h] * static_cast<float>(w0 + frag_col - q_pos[a][h]);
          }
#pragma unroll
          for (int n = 0; n < Geo::kNTiles; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int h = i >> 1;
              const float sk = Geo::kTokenScales
                                   ? score_scale * ksc[key0 + n * 8 + frag_col + (i & 1)]
                                   : score_scale;
              s[a][n][i] = fmaf(slope[a][h], static_cast<float>(n * 8 + (i & 1)),
                                Var::logits_plus(vp, s[a][n][i], sk, base[h]));
              tmax[h] = fmaxf(tmax[h], s[a][n][i]);
            }
          }
        } else {
#pragma unroll
          for (int n = 0; n < Geo::kNTiles; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float sk = Geo::kTokenScales
                                   ? score_scale * ksc[key0 + n * 8 + frag_col + (i & 1)]
                                   : score_scale;
              s[a][n][i] = Var::kFixedOffset
                               ? Var::fixed_exponent(vp, s[a][n][i], sk)
                               : Var::logits(vp, s[a][n][i], sk);
              tmax[i >> 1] = fmaxf(tmax[i >> 1], s[a][n][i]);
            }
          }
        }
        float sub[2] = {0.f, 0.f}, alpha[2] = {1.f, 1.f};
        if constexpr (!Var::kFixedOffset) {
          advance_fragment_rows(tmax, m_run[a], l_run[a], sub, alpha);
        }
#pragma unroll
        for (int n = 0; n < Geo::kNTiles; ++n) {
          const float p0 = fast_exp2(s[a][n][0] - sub[0]);
          const float p1 = fast_exp2(s[a][n][1] - sub[0]);
          const float p2 = fast_exp2(s[a][n][2] - sub[1]);
          const float p3 = fast_exp2(s[a][n][3] - sub[1]);
          l_run[a][0] += p0 + p1;
          l_run[a][1] += p2 + p3;
          // A fragment of k-step n / 2: regs 0,1 from n8 tile 2j (rows, rows + 8), 2,3 from 2j + 1.
          pa[a][n / 2][(n & 1) * 2 + 0] = pack2<T>(p0, p1);
          pa[a][n / 2][(n & 1) * 2 + 1] = pack2<T>(p2, p3);
        }
        // Once the running maxima settle most tiles leave them unchanged (alpha = 1).
        if (!Var::kFixedOffset && __any_sync(~0u, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
          for (int d = 0; d < Geo::kDTiles; ++d) {
            acc[a][d][0] *= alpha[0];
            acc[a][d][1] *= alpha[0];
            acc[a][d][2] *= alpha[1];
            acc[a][d][3] *= alpha[1];
          }
        }
      }

      // ---- O += P V ---------------------------------------------------------------------
#pragma unroll
      for (int kk = 0; kk < Geo::kWarpKeys / 16; ++kk) {
        if (key0 + kk * 16 >= valid) break;
#pragma unroll
        for (int dp = 0; dp < Geo::kSliceK16; ++dp) {
          const int d16 = k16_0 + dp;  // this warp's columns of O
          if (Geo::kK16 % Geo::kDimSplit != 0 && d16 >= Geo::kK16) break;
          unsigned vb[4];
          if constexpr (Geo::kVDimMajor) {
            ldmatrix_x4(vb, vs + (d16 * 16 + (lane & 7) + (lane >> 4) * 8) * Geo::kVRow +
                                key0 + kk * 16 + ((lane >> 3) & 1) * 8);
          } else {
            // V rows are tokens: transposed loads give B's (token, dim) pairs.
            ldmatrix_x4_trans(vb, vs + (key0 + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) *
                                           ROW + d16 * 16 + (lane >> 4) * 8);
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

    if constexpr (KEY_WARPS > 1) {
      // The warps of the same rows merged (softmax.cuh's rule): each but the first leaves
      // its state in the stages, lane by lane; the first rescales every state to the
      // rows' common maximum and adds them (a state that saw no key weighs 0).
      constexpr int kPer = Geo::kStateFloats;
      constexpr int kAtom = kPer / MA;  // an m-atom's: m and l of both rows, then O's
      float* states = reinterpret_cast<float*>(smem + Geo::kOffK) + lane;
      if (kslice > 0) {
        float* mine = states + ((kslice - 1) * Geo::kRowWarps + row_warp) * kPer * 32;
#pragma unroll
        for (int a = 0; a < MA; ++a) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            mine[(a * kAtom + 2 * h) * 32] = m_run[a][h];
            mine[(a * kAtom + 2 * h + 1) * 32] = l_run[a][h];
          }
#pragma unroll
          for (int d = 0; d < Geo::kDTiles; ++d) {
#pragma unroll
            for (int i = 0; i < 4; ++i) mine[(a * kAtom + 4 + d * 4 + i) * 32] = acc[a][d][i];
          }
        }
      }
      __syncthreads();
      if (kslice > 0) continue;  // the first warp of the rows writes them
#pragma unroll 1
      for (int k = 1; k < KEY_WARPS; ++k) {
        const float* theirs = states + ((k - 1) * Geo::kRowWarps + row_warp) * kPer * 32;
#pragma unroll
        for (int a = 0; a < MA; ++a) {
          float mine_w[2], their_w[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float m_o = theirs[(a * kAtom + 2 * h) * 32];
            const float l_o = theirs[(a * kAtom + 2 * h + 1) * 32];
            mine_w[h] = 1.f;
            their_w[h] = 1.f;
            if constexpr (!Var::kFixedOffset) {  // else both are sums against one offset
              const float m = fmaxf(m_run[a][h], m_o);
              mine_w[h] = m_run[a][h] == neg_inf() ? 0.f : exp2f(m_run[a][h] - m);
              their_w[h] = m_o == neg_inf() ? 0.f : exp2f(m_o - m);
              m_run[a][h] = m;
            }
            l_run[a][h] = l_run[a][h] * mine_w[h] + l_o * their_w[h];
          }
#pragma unroll
          for (int d = 0; d < Geo::kDTiles; ++d) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              acc[a][d][i] = acc[a][d][i] * mine_w[i >> 1] +
                             theirs[(a * kAtom + 4 + d * 4 + i) * 32] * their_w[i >> 1];
            }
          }
        }
      }
    }

    // ---- normalize and store -------------------------------------------------------------
    const bool bad = *bad_block_s != 0;
    const int col0 = k16_0 * 16;  // the warp's first column of O
    // One thread of each row's quad writes its max, sum or lse: of the pair, the first.
    const bool row_writer = (lane & 3) == 0 && dslice == 0;
#pragma unroll
    for (int a = 0; a < MA; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float l = quad_sum(l_run[a][h]);
        const int p = row0 + row_warp * Geo::kWarpRows + a * 16 + frag_row + h * 8;
        if (p >= packed) continue;
        // A row that saw no key (an empty sequence's, or one before every cached token)
        // gets zeros, never 0 / 0; a sink joins the denominator.
        const int head = kv_head * group_size + p % group_size;
        const long long orow = static_cast<long long>(q_begin + p / group_size) * num_heads + head;
        // The row's maximum, or the fixed offset once a key was seen (every seen key's
        // weight is positive there: kMaxFixedCap).
        const float m = !Var::kFixedOffset ? m_run[a][h]
                        : l == 0.f         ? neg_inf()
                                           : Var::fixed_offset(vp);
        if (split_tiles > 0) {
          // A partial: its normalized output, max and sum (the combine adds the sink and
          // writes the lse); NaN throughout for a bad block.
          const long long prow = orow * gridDim.z + blockIdx.z;
          const float inv = end_partial_row(m, l, bad, out_scale, prow, part_max, part_sum,
                                            row_writer);
          float* o = part_out + prow * HEAD_SIZE + col0;
#pragma unroll
          for (int d = 0; d < Geo::kDTiles; ++d) {
            if (col0 + d * 8 >= HEAD_SIZE) continue;
            *reinterpret_cast<float2*>(o + d * 8 + frag_col) =
                make_float2(acc[a][d][2 * h] * inv, acc[a][d][2 * h + 1] * inv);
          }
          continue;
        }
        const float inv = end_whole_row(vp, m, l, bad, out_scale, sink_log2(vp, head), orow,
                                        row_writer);
        T* o = out + orow * HEAD_SIZE + col0;
#pragma unroll
        for (int d = 0; d < Geo::kDTiles; ++d) {
          if (col0 + d * 8 >= HEAD_SIZE) continue;
          *reinterpret_cast<unsigned*>(o + d * 8 + frag_col) =
              pack2<T>(acc[a][d][2 * h] * inv, acc[a][d][2 * h + 1] * inv);
        }
      }
    }
  }
}

}  // namespace cupaged
