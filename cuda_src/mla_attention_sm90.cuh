// Absorbed MLA over a paged latent cache on Hopper's wgmma (sm_90a): mla_attention.cuh's
// problem, arguments and conventions (its header), for 64 packed rows a CTA.
//
// Two warpgroups, 64 rows x the 512 output dims split between them (O is 64 x 256 fp32 a
// warpgroup: 128 registers a thread). K/V tiles of 64 tokens are copied with cp.async (by
// warpgroup 1 alone or by every thread: mla_sm90_producer), each stored once in the
// 128-byte-swizzled layout (nine 64-dim blocks of [64 tokens][128 bytes]) that is K's
// K-major B operand of S = Q K^T and, over its first eight blocks, V's MN-major B operand
// of P V: no copy or transpose. A 16-bit cache lands
// there directly, in a ring of two stages. An fp8 cache (C one byte, read as stored *
// scale) lands as bytes in a ring of two raw stages ([64 tokens][RANK + ROPE bytes]; the
// sparse kernel's token rows, V4's in two raw stages and fp8_ds_mla's in one, widened
// after a barrier), and every thread widens its share of a landed tile into one 16-bit
// stage before the tile's first barrier: the next tiles' bytes fly meanwhile, and a third
// 73,728-byte stage would not fit beside Q.
// A tile:
//   warpgroup 0: S = Q K^T (64 x 64, 36 k-steps of m64n64k16, Q and K from shared memory),
//     masks, the online softmax in registers, P (T) and each row's rescale factor to
//     shared memory;
//   warpgroup 1, where it is the producer (mla_sm90_producer), issues tile i + 2: over a
//     16-bit cache into this tile's stage once both warpgroups' P V of it is done (three
//     named barriers hand P over and free P and the stage), over fp8 into the raw stage
//     this tile was widened from; each (raw) stage's mbarrier counts the copies landed;
//   both: O_half = O_half * alpha + P V_half (4 k-steps of m64n256k16, P and V from
//     shared memory; warpgroup 0 rescales its half during the softmax, warpgroup 1 after
//     the P barrier).
// fp8: three CTA barriers a tile (token rows: four). The softmax is not overlapped with
// the products (FlashInfer's Hopper MLA kernel has this shape).
#pragma once
#include "common.cuh"
#include "ds_mla.cuh"
#include "fp8.cuh"
#include "mla_common.cuh"
#include "mma.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "variants.cuh"

namespace cupaged {

constexpr int kMlaSm90Threads = 256;

// C: the cache's element type, T or fp8, or a token row format (the sparse kernel's:
// DeepSeek-V3.2's 656-byte fp8_ds_mla rows, V4's 528-byte v4_fp8 and 288-byte v4_fp4 rows;
// ds_mla.cuh's SparseRow), which lands in raw stages of its rows. PRODUCER: warpgroup 1
// alone copies the tiles (mla_sm90_producer).
template <typename T, typename C, int RANK, int ROPE, bool PRODUCER = false>
struct MlaSm90Geometry {
  static constexpr bool kQuant = !is_same<T, C>::value;
  static constexpr bool kRowFmt = is_sparse_row<C>::value;
  static constexpr int kRows = 64;
  static constexpr int kTileN = 64;
  static constexpr int kStages = kQuant ? 1 : 2;  // 16-bit stages (fp8: the widened tile)
  static constexpr int kDims = RANK + ROPE;
  static constexpr int kBlocks = kDims / 64;  // 64-dim blocks of a key row (9; V4's 8)
  // 16-byte chunks of a cached row (72; fp8 36; fp8_ds_mla 41, v4_fp8 33, v4_fp4 18)
  static constexpr int kCChunks =
      kRowFmt ? SparseRow<C>::kBytes / 16 : kDims * static_cast<int>(sizeof(C)) / 16;
  static constexpr int kRawRow = kCChunks * 16;  // fp8: a raw token row's bytes
  static constexpr int kTileBytes = kBlocks * 64 * 128;  // Q, or one K/V stage: 73,728
  static constexpr int kRawTileBytes = kQuant ? kTileN * kRawRow : 0;  // fp8: a tile's bytes
  // What follows the raw stages: P ([64 rows][64 keys] T), alpha, max and sum a row, the
  // bad-block flag, the sparse kernel's key flags (a byte a key, two ring slots), the
  // producer's two mbarriers, and the 1024 bytes of the base's alignment.
  static constexpr int kTail = 64 * 128 + 3 * kRows * 4 + 16 + 2 * kTileN + 16 + 1024;
  // Two raw stages where they fit (fp8_ds_mla's 656-byte rows do not: one)
  static constexpr int kRawStages =
      kRowFmt && (1 + kStages) * kTileBytes + 2 * kRawTileBytes + kTail > 232448 ? 1 : 2;
  static constexpr int kOffQ = 0;
  static constexpr int kOffStages = kTileBytes;
  static constexpr int kOffRaw = kOffStages + kStages * kTileBytes;  // fp8: the raw stages
  static constexpr int kOffP = kOffRaw + kRawStages * kRawTileBytes;  // [64 rows][64 keys] T
  static constexpr int kOffRowState = kOffP + 64 * 128;            // alpha, max, sum a row
  static constexpr int kOffFlag = kOffRowState + 3 * kRows * 4;
  // The sparse kernel's: whether each key of a ring slot's tile counts (a byte a key).
  static constexpr int kOffValid = kOffFlag + 16;
  // The producer's two mbarriers, one a ring slot (16-bit stage, or fp8 raw stage): the
  // slot's tile landed.
  static constexpr int kOffBars = kOffValid + 2 * kTileN;
  // Tiles need 1024-byte alignment (the swizzle's phase): the base is rounded up.
  static constexpr int kSmemBytes = kOffBars + 16 + 1024;
  static constexpr bool kProducer = PRODUCER;
  static constexpr int kCopiers = kProducer ? kMlaSm90Threads / 2 : kMlaSm90Threads;
  static constexpr int kCopyThreads = kCopiers / kTileN;  // a token's copiers (4; producer 2)
  // Copies by rows over 16-bit caches, whose token rows are whole 128-byte lines (9):
  // eight lanes take 128 contiguous bytes of a row, so a warp's copy instruction reads four
  // whole lines; each copier kIds tokens a tile. The other rows (fp8's 576 bytes and the
  // token row formats, whose rows straddle lines; docs/PERFORMANCE.md, MLA step 14) take a
  // token a copier, kCopyThreads copiers a token.
  static constexpr bool kRowCopy = !kQuant;
  static constexpr int kIds = kRowCopy ? kTileN / (kCopiers / 8) : 1;  // (producer 4; 2)
  static constexpr int kCopyStride = kRowCopy ? 8 : kCopyThreads;  // a token's copiers
  static constexpr int kCopySteps = (kCChunks + kCopyStride - 1) / kCopyStride;  // chunks
  //          each (9; fp8 9, producer 18; fp8_ds_mla 11, v4_fp8 9, v4_fp4 5)
  // fp8: every thread widens a share of each raw tile, four threads a token
  static constexpr int kWidenThreads = kMlaSm90Threads / kTileN;
  static constexpr int kWidenSteps = kCChunks / kWidenThreads;  // chunks each (fp8 9)
  // A token row format: the units of a row (SparseRow::widen) each of its copiers widens
  // (fp8_ds_mla 11 of 41, V4's 8 of 32)
  static constexpr int kRowUnits = kRowFmt ? SparseRow<C>::kUnits : 0;
  static constexpr int kRowSteps = (kRowUnits + kCopyThreads - 1) / kCopyThreads;

  static_assert(sizeof(T) == 2, "wgmma takes 16-bit operands here");
  static_assert(!kQuant || sizeof(C) == 1, "caches of T or fp8");
  static_assert(RANK == 512 && ROPE % 64 == 0, "two warpgroups of N = 256; 64-dim blocks");
  static_assert(kRowFmt || kCChunks % kCopyThreads == 0, "copy mapping");
  static_assert(!kRowCopy || (kCopiers % 8 == 0 && kTileN % (kCopiers / 8) == 0),
                "row copies: a tile's tokens over the copiers' groups of eight");
  static_assert(!kProducer || !kRowFmt,
                "token rows are widened by the threads that copied them");
  static_assert(!kQuant || kRowFmt || kCChunks % kWidenThreads == 0, "widening mapping");
  // Without the producer an fp8 thread widens only chunks it copied itself (no barrier
  // between its cp.async.wait_group and the widening).
  static_assert(kProducer || !kQuant || kRowFmt || kWidenThreads == kCopyThreads,
                "widening mapping without the producer");
  static_assert(!kRowFmt || (RANK == SparseRow<C>::kRank && ROPE == SparseRow<C>::kRope &&
                             is_same<T, bfloat16_t>::value),
                "token rows: the format's rank and rope dims, bfloat16 queries");
  static_assert(kOffP + kTail - 1024 == kOffBars + 16, "kTail counts what follows P");
  static_assert(kSmemBytes <= 232448, "shared memory: Hopper's 227 KB a CTA");
  static_assert(kOffBars % 8 == 0, "mbarriers are 8-byte aligned");
  static_assert(kOffStages % 1024 == 0 && kOffP % 1024 == 0,
                "wgmma's swizzled operands start at multiples of 1024 bytes");
};

// Who copies the K/V tiles. A paged 16-bit or fp8 cache with pages of 16 tokens or more:
// warpgroup 1 alone, off warpgroup 0's chain of S and softmax, two tiles in flight, each
// stage's (fp8: raw stage's) mbarrier (cp.async.mbarrier.arrive) saying when its tile
// landed. 16-bit: tile i + 2 is issued as soon as both warpgroups' P V of tile i is done.
// fp8: every thread widens its share of tile i into the one 16-bit stage after that
// mbarrier, and tile i + 2's bytes are issued into the raw stage once the widening is done.
// Gathered rows (the sparse kernel, pages under 16 tokens) and token rows: every
// thread copies, tile i + 1 flying during tile i (on an H200 one warpgroup issuing a row
// address a token ran these at 0.70-0.75x the speed). docs/PERFORMANCE.md, MLA kernel
// steps 10 and 11.
template <typename C, typename T, int BLOCK_SIZE, bool SPARSE>
__host__ __device__ constexpr bool mla_sm90_producer() {
  return !is_sparse_row<C>::value && !SPARSE && BLOCK_SIZE >= 16;
}

// The producer's named barriers (0 is __syncthreads'), each over both warpgroups:
//   kMlaBarP      P and the factors of a tile written (both sync)
//   kMlaBarEmpty  warpgroup 0's P V of a tile done: its stage may take tile i + 2
//                 (warpgroup 0 arrives, warpgroup 1 syncs)
//   kMlaBarPFree  warpgroup 1's P V of a tile done: P and the factors may be rewritten
//                 (warpgroup 1 arrives, warpgroup 0 syncs)
//   kMlaBarTma    warpgroup 1 alone: does every copier's share of a tile allow TMA
constexpr int kMlaBarP = 1, kMlaBarEmpty = 2, kMlaBarPFree = 3, kMlaBarTma = 4;

// The paged kernel's tensor maps (TMA), made on the host (cupaged/launch.py, MLA_TMA)
// where the cache allows them: the latent and the rotary part, each a tensor of [blocks]
// [BLOCK_SIZE tokens][RANK or ROPE dims] with boxes of 64 dims x min(BLOCK_SIZE, 64) tokens
// x 1 block, 128-byte swizzle. `use` 0: none, every tile copied by cp.async.
struct MlaTma {
  sm90::TensorMap lat, rope;
  int use;
};

// Whether a 64-token tile is a whole number of runs of one block each (pages dividing 64
// or a multiple of it): what a tile's asynchronous copies, a box or a bulk copy a run,
// need.
template <int BLOCK_SIZE>
__host__ __device__ constexpr bool mla_tile_in_block_runs() {
  return BLOCK_SIZE % 64 == 0 || 64 % BLOCK_SIZE == 0;
}

// Whether the producer may copy a 16-bit paged tile by TMA (pages of 16 or 32 tokens, or
// a multiple of 64).
template <typename C, typename T, int BLOCK_SIZE, bool SPARSE>
__host__ __device__ constexpr bool mla_sm90_tma() {
  return mla_sm90_producer<C, T, BLOCK_SIZE, SPARSE>() && is_same<C, T>::value &&
         mla_tile_in_block_runs<BLOCK_SIZE>();
}

// The kernel's body, for both entry points below: paged (SPARSE false) and sparse
// (mla_attention.cuh's mla_sparse_attention, its parameters read the same way), with a
// second cache (EXTRA: the sparse kernel's kVarSecondCache) or without.
template <typename T, typename C, int RANK, int ROPE, int BLOCK_SIZE, bool SPARSE,
          bool EXTRA = false>
__device__ __forceinline__ void mla_attention_sm90_body(CUPAGED_MLA_PARAMS, int lengths_per,
                                                        int strict, const MlaSparseExtra& extra,
                                                        const VariantParams& vp,
                                                        const MlaTma* tma = nullptr) {
  using Geo =
      MlaSm90Geometry<T, C, RANK, ROPE, mla_sm90_producer<C, T, BLOCK_SIZE, SPARSE>()>;
  using namespace sm90;
  constexpr int ROWS = Geo::kRows;
  constexpr int TILE_N = Geo::kTileN;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  const unsigned base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const unsigned q_s = base + Geo::kOffQ;
  const unsigned p_s = base + Geo::kOffP;
  float* alpha_s = reinterpret_cast<float*>(smem + Geo::kOffRowState);
  float* max_s = alpha_s + ROWS;
  float* sum_s = max_s + ROWS;
  int* bad_s = reinterpret_cast<int*>(smem + Geo::kOffFlag);
  unsigned char* valid_s = smem + Geo::kOffValid;  // sparse: [2 ring slots][64 keys]
  auto stage_s = [&](int s) { return base + Geo::kOffStages + s * Geo::kTileBytes; };
  auto full_bar = [&](int s) { return base + Geo::kOffBars + 8 * s; };
  auto raw_s = [&](int s) { return base + Geo::kOffRaw + s * Geo::kRawTileBytes; };

  const int tid = threadIdx.x;
  // warpgroup: 0 computes S and the softmax (warp-uniform to the compiler: a value it
  // cannot prove uniform around wgmma makes ptxas serialize them)
  const int wg = __shfl_sync(~0u, tid / 128, 0);
  const int warp = (tid / 32) % 4;    // warp within its warpgroup: rows 16 warp ..
  const int lane = tid & 31;
  const int frag_row = 16 * warp + (lane >> 2);  // this thread's rows: frag_row, + 8
  if (tid == 0 && dynamic_smem_bytes() < static_cast<unsigned>(Geo::kSmemBytes)) __trap();
  // An fp8 cache's scale multiplies every score and every output (K and V are both kv_c);
  // a 16-bit cache has none.
  float cache_scale = 1.f;
  if constexpr (Geo::kQuant) {
    cache_scale = k_scale_ptr != nullptr ? *k_scale_ptr : k_scale;
    scale_log2 *= cache_scale;
  }

  MlaSeq sq = mla_seq<BLOCK_SIZE, SPARSE>(blockIdx.x / row_tiles, seq_lens, query_start_loc,
                                          num_heads, block_tables, bt_stride, max_blocks,
                                          lengths_per);
  if constexpr (SPARSE) causal = 0;  // a token's rows are its heads; its keys have no order
  // Sparse with a second cache: its first first_len keys are the first cache's.
  static_assert(!EXTRA || SPARSE, "a second cache is the sparse kernel's");
  const int first_len = sq.seq_len;
  const int* extra_row = nullptr;
  if constexpr (EXTRA) extra_row = mla_extra_row(sq, extra, blockIdx.x / row_tiles, lengths_per);
  // A copier's token and first chunk (the producer's threads counted from warpgroup 1's)
  const int copy_tid = Geo::kProducer ? tid - kMlaSm90Threads / 2 : tid;
  const bool copier = !Geo::kProducer || wg == 1;
  const int copy_token = copy_tid / Geo::kCopyThreads;
  const int copy_lane = copy_tid % Geo::kCopyThreads;
  // A stage's mbarrier counts each copier's cp.async arrival (cp_async_mbar_arrive after
  // its copies of the tile). Only paged tiles: the sparse kernel's key flags are plain
  // stores, which that arrival does not order.
  static_assert(!Geo::kProducer || !SPARSE, "the producer copies paged tiles");
  if (Geo::kProducer && tid == 0) {  // published by begin_row_tile's barrier
    mbar_init(full_bar(0), Geo::kCopiers);
    mbar_init(full_bar(1), Geo::kCopiers);
    fence_mbarrier_init();  // (and to the tensor copies' complete_tx)
  }
  constexpr bool kTma = mla_sm90_tma<C, T, BLOCK_SIZE, SPARSE>();
  const bool use_tma = kTma && tma != nullptr && tma->use != 0;
  // fp8 on the producer: bulk copies where the cache is dense and combined (a token's row
  // of RANK + ROPE bytes, the rotary part right after the latent, rows back to back)
  constexpr bool kBulk = Geo::kProducer && Geo::kQuant && !Geo::kRowFmt &&
                         mla_tile_in_block_runs<BLOCK_SIZE>();
  const bool dense = kBulk && c_lat_token_stride == Geo::kRawRow &&
                     c_rope == c_lat + RANK && c_rope_token_stride == Geo::kRawRow &&
                     c_rope_block_stride == c_lat_block_stride;
  // The producer's tiles before this row tile's: tile it's ring slot is (done + it) & 1,
  // the (done + it) / 2-th use of its stage's mbarrier.
  int done = 0;

  for (int row0 = (blockIdx.x % row_tiles) * ROWS; row0 < sq.packed; row0 += row_tiles * ROWS) {
    const int rows_here = min(ROWS, sq.packed - row0);
    const MlaTiles tl = mla_tiles<TILE_N>(sq, row0, rows_here, num_heads, causal, split_tiles);
    const int kv_end = tl.kv_end, tile_lo = tl.tile_lo, n_tiles = tl.n_tiles;

    begin_row_tile(bad_s);

    // ---- the query tile, swizzled: rows past the sequence's are zeros ------------------
    mla_copy_query<T, RANK, ROPE, ROWS, kMlaSm90Threads>(
        q_lat, q_rope, q_lat_token_stride, q_lat_head_stride, q_rope_token_stride,
        q_rope_head_stride, sq, row0, rows_here, num_heads,
        [&](int r, int c) { return q_s + sw128_offset(r, c * 8, ROWS); });

    // A K/V tile. A copier's token i is copy_row(i) (row copies: its eight lanes' group,
    // + kCopiers / 8, ...; otherwise copy_token), its chunks lane8, + 8, ... (otherwise
    // copy_lane, + kCopyThreads, ...), the tokens' block ids read a tile ahead (-1: past
    // the keys; -2: outside the cache). A 16-bit cache lands in the swizzled stage
    // `slot`; fp8 and token rows in raw stage `slot`, row-major, widened by widen_tile or
    // widen_row_tile. (Sparse: the id is the key's slot, as in mla_attention.cuh, and
    // with a second cache -3 - its slot there.)
    const int lane8 = copy_tid % 8;
    auto copy_row = [&](int i) {
      return Geo::kRowCopy ? copy_tid / 8 + (Geo::kCopiers / 8) * i : copy_token;
    };
    struct Ids {
      int v[Geo::kIds];
    };
    auto tile_id = [&](int tile) -> Ids {
      Ids ids;
      if constexpr (!SPARSE && Geo::kRowCopy) {
        // Paged row copies: mla_block_id's rule, the table read once a block (a copier's
        // tokens kCopiers / 8 apart, from a tile start, share one unless a multiple of
        // BLOCK_SIZE lies between them)
        constexpr int kStep = Geo::kCopiers / 8;
        static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && (kStep & (kStep - 1)) == 0,
                      "powers of two: a copier's tokens cross a block only at those steps");
        const int key0 = (tile_lo + tile) * TILE_N + copy_row(0);
        // Past the tiles every id is -1 and nothing is read: the bound is below every key,
        // a non-copier's too (its copy_row is negative, and with no keys at all its key0
        // is, so a bound of 0 would read the row's entry -1 in pages of 16)
        constexpr int kBelowEveryKey = -0x7fffffff - 1;
        const int end = tile >= n_tiles ? kBelowEveryKey : kv_end;
        int phys = -1;
#pragma unroll
        for (int i = 0; i < Geo::kIds; ++i) {
          const int key = key0 + kStep * i;
          if ((kStep * i) % BLOCK_SIZE == 0 && key < end) {
            phys = __ldg(sq.bt_row + key / BLOCK_SIZE);
          }
          ids.v[i] = key >= end ? -1
                     : static_cast<unsigned>(phys) < static_cast<unsigned>(num_blocks) ? phys
                                                                                        : -2;
        }
      } else {
#pragma unroll
        for (int i = 0; i < Geo::kIds; ++i) {
          ids.v[i] = tile >= n_tiles ? -1
                                     : mla_key_id<BLOCK_SIZE, SPARSE, EXTRA>(
                                           sq, (tile_lo + tile) * TILE_N + copy_row(i), kv_end,
                                           num_blocks, strict, extra, extra_row, first_len);
        }
      }
      return ids;
    };
    auto load_tile = [&](int tile, int slot, const Ids& ids) {
      const int raw = Geo::kRawStages == 1 ? 0 : slot;
      const int chunk0 = Geo::kRowCopy ? lane8 : copy_lane;  // this copier's first chunk
#pragma unroll
      for (int i = 0; i < Geo::kIds; ++i) {
        const int id = ids.v[i];
        const int token = copy_row(i);
        const bool copy = mla_copied<EXTRA>(id);
        if (id == -2) *bad_s = 1;
        // Sparse: the softmax masks the keys whose entries do not count (their zeros) by
        // these flags, read after the barrier that shows the tile landed.
        if (SPARSE && chunk0 == 0) valid_s[slot * TILE_N + token] = copy;
        const MlaToken<C, BLOCK_SIZE> tok = mla_kv_token<C, BLOCK_SIZE, SPARSE, EXTRA>(
            id, (tile_lo + tile) * TILE_N + token, c_lat, c_rope, c_lat_block_stride,
            c_lat_token_stride, c_rope_block_stride, c_rope_token_stride, extra);
#pragma unroll
        for (int j = 0; j < Geo::kCopySteps; ++j) {
          const int c = chunk0 + j * Geo::kCopyStride;
          if (Geo::kCChunks % Geo::kCopyStride != 0 && c >= Geo::kCChunks) continue;
          const unsigned dst = Geo::kQuant
                                   ? raw_s(raw) + token * Geo::kRawRow + c * 16
                                   : stage_s(slot) + sw128_offset(token, c * 8, TILE_N);
          cp_async16_or_zero(dst, copy ? tok.template chunk<RANK>(c) : c_lat, copy);
        }
      }
    };
    // The producer's copy of a tile into ring slot `slot`, completing its mbarrier: by TMA
    // where every copier's tokens are in the keys and in the cache (a whole tile of valid
    // blocks: one thread issues its 9 x 64 / min(BLOCK_SIZE, 64) boxes, the others
    // arrive), else by cp.async (load_tile; tokens past the keys read as zeros, a bad
    // block raises the flag). The choice is warpgroup 1's together (kMlaBarTma).
    // A tile copied asynchronously (TMA boxes or bulk runs) by copier 0 alone, on the
    // slot's mbarrier expecting their `bytes`: true in copier 0, which has fenced and set
    // the expectation and then issues the copies; the other copiers arrive and get false.
    // (The stage's last reads, by wgmma or the widening, are behind a barrier.)
    auto async_copier = [&](int slot, unsigned bytes) {
      if (copy_tid != 0) {
        mbar_arrive(full_bar(slot));
        return false;
      }
      fence_async_smem();
      mbar_arrive_expect_tx(full_bar(slot), bytes);
      return true;
    };
    constexpr int kRun = BLOCK_SIZE < TILE_N ? BLOCK_SIZE : TILE_N;  // a tile's tokens a block
    auto issue_tile = [&](int tile, int slot, const Ids& ids) {
      if constexpr (kTma) {
        bool mine = true;
#pragma unroll
        for (int i = 0; i < Geo::kIds; ++i) mine = mine && ids.v[i] >= 0;
        // (use_tma is the launch's: every copier takes the vote or none does)
        if (use_tma && named_bar_and<kMlaSm90Threads / 2>(kMlaBarTma, mine)) {
          static_assert(kRun % (Geo::kCopiers / 8) == 0, "a box's first token is copier 0's");
          if (async_copier(slot, Geo::kTileBytes)) {
            const int key0 = (tile_lo + tile) * TILE_N;
#pragma unroll
            for (int g = 0; g < TILE_N / kRun; ++g) {
              // copier 0's token i is token 16 i of the tile: box g's first
              const int blk = ids.v[g * kRun / (Geo::kCopiers / 8)];
              const int within = (key0 + g * kRun) % BLOCK_SIZE;
#pragma unroll
              for (int b = 0; b < Geo::kBlocks; ++b) {
                const unsigned dst = stage_s(slot) + b * TILE_N * 128 + g * kRun * 128;
                if (b < RANK / 64) {
                  tma_load_3d(dst, &tma->lat, 64 * b, within, blk, full_bar(slot));
                } else {
                  tma_load_3d(dst, &tma->rope, 64 * (b - RANK / 64), within, blk,
                              full_bar(slot));
                }
              }
            }
          }
          return;
        }
      }
      if constexpr (kBulk) {
        // fp8 over a dense combined cache (each token's RANK + ROPE bytes in one row, rows
        // next to each other within a block): a tile's raw rows are the cache's bytes as
        // they lie, one bulk copy a block's run of them.
        if (dense && named_bar_and<kMlaSm90Threads / 2>(kMlaBarTma, ids.v[0] >= 0)) {
          if (async_copier(slot, Geo::kRawTileBytes)) {
            const int key0 = (tile_lo + tile) * TILE_N;
#pragma unroll 1
            for (int g = 0; g < TILE_N / kRun; ++g) {
              // (copier 0 holds token 0's block; the vote says every token's is valid)
              const int blk = g == 0 ? ids.v[0]
                                     : mla_key_id<BLOCK_SIZE, false, false>(
                                           sq, key0 + g * kRun, kv_end, num_blocks, strict,
                                           extra, extra_row, first_len);
              const C* src = c_lat + static_cast<long long>(blk) * c_lat_block_stride +
                             static_cast<long long>((key0 + g * kRun) % BLOCK_SIZE) *
                                 Geo::kRawRow;
              bulk_copy_g2s(raw_s(slot) + g * kRun * Geo::kRawRow, src, kRun * Geo::kRawRow,
                            full_bar(slot));
            }
          }
          return;
        }
      }
      load_tile(tile, slot, ids);
      cp_async_mbar_arrive(full_bar(slot));
    };
    // Token rows: raw stage `raw`'s rows widened (SparseRow::widen: each value times its
    // group's scale, rounded to bfloat16) into the 16-bit stage, each thread the units of
    // the token it copied, after a barrier (a row's scales are another thread's copy).
    auto widen_row_tile = [&](int raw) {
      if constexpr (Geo::kRowFmt) {
        const unsigned char* row = smem + (raw_s(raw) - base) + copy_token * Geo::kRawRow;
#pragma unroll
        for (int j = 0; j < Geo::kRowSteps; ++j) {
          const int u = copy_lane + j * Geo::kCopyThreads;
          if (Geo::kRowUnits % Geo::kCopyThreads != 0 && u >= Geo::kRowUnits) continue;
          uint4 v[2];
          int dim;
          const int n = SparseRow<C>::widen(row, u, v, dim);
          for (int k = 0; k < n; ++k) {
            const unsigned d = stage_s(0) + sw128_offset(copy_token, dim + 8 * k, TILE_N);
            st_shared_v4(d, v[k]);
          }
        }
      } else {
        (void)raw;
      }
    };
    // fp8: this thread's share of raw stage `slot` (chunks widen_lane, + 4, ... of token
    // widen_token; landed: its stage's mbarrier, or without the producer the thread's own
    // copies) widened into the 16-bit stage, 16 values to two swizzled 16-byte chunks
    // (exact; zeros stay zeros).
    auto widen_tile = [&](int slot) {
      if constexpr (Geo::kQuant && !Geo::kRowFmt) {
        // The bytes are read by plain loads after the wait, whose asm may have no memory
        // clobber: keep the compiler from hoisting the loads above it.
        asm volatile("" ::: "memory");
        const int widen_token = tid / Geo::kWidenThreads;
        const int widen_lane = tid % Geo::kWidenThreads;
        const unsigned char* row = smem + (raw_s(slot) - base) + widen_token * Geo::kRawRow;
#pragma unroll
        for (int j = 0; j < Geo::kWidenSteps; ++j) {
          const int c = widen_lane + j * Geo::kWidenThreads;
          uint4 lo, hi;
          widen16<T, C>(*reinterpret_cast<const uint4*>(row + c * 16), lo, hi);
          const unsigned d0 = stage_s(0) + sw128_offset(widen_token, c * 16, TILE_N);
          const unsigned d1 = stage_s(0) + sw128_offset(widen_token, c * 16 + 8, TILE_N);
          st_shared_v4(d0, lo);
          st_shared_v4(d1, hi);
        }
      } else {
        (void)slot;
      }
    };

    // The softmax role's rows (warpgroup 0): keys at positions < limit are seen.
    const int limit[2] = {mla_key_limit(sq, row0 + frag_row, num_heads, causal),
                          mla_key_limit(sq, row0 + frag_row + 8, num_heads, causal)};
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    // This thread's rows of its half of O times their factors (rows frag_row, + 8)
    auto rescale_o = [&](float a0, float a1) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j + 0] *= a0;
        o[4 * j + 1] *= a0;
        o[4 * j + 2] *= a1;
        o[4 * j + 3] *= a1;
      }
    };
    float s[32] = {};  // S of a tile (warpgroup 0): its first k-step overwrites it

    if constexpr (Geo::kProducer) {
      cp_async_commit();  // the query, every thread's
      if (copier) {  // tiles 0 and 1, each completing its stage's mbarrier when landed
#pragma unroll 1
        for (int t = 0; t < 2 && t < n_tiles; ++t) {
          const int sl = (done + t) & 1;
          issue_tile(t, sl, tile_id(t));
        }
        cp_async_commit();
        cp_async_wait<1>();  // the query landed; the tiles may fly
      } else {
        cp_async_wait<0>();
      }
      fence_async_smem();  // the query, for wgmma's reads
      __syncthreads();
    } else {
      if (n_tiles > 0) load_tile(0, 0, tile_id(0));
      cp_async_commit();  // with the query
    }
    Ids id_ahead = tile_id(copier ? (Geo::kProducer ? 2 : 1) : n_tiles);

    for (int it = 0; it < n_tiles; ++it) {
      // The ring slot of tile it (16-bit: the stage its products read; fp8: the raw stage,
      // the products reading the one widened stage).
      const int slot = Geo::kProducer ? (done + it) & 1 : it & 1;
      const int stage = Geo::kQuant ? 0 : slot;
      // The tile's descriptors, built once (each wgmma then adds a constant offset): Q's,
      // this stage's as K (S) and as V from this warpgroup's first output column (P V),
      // and P's. (The stage broadcast from lane 0: warp-uniform to the compiler, so the
      // descriptors can stay in uniform registers.)
      const unsigned k_tile = stage_s(__shfl_sync(~0u, stage, 0));
      const DescBase q_desc = kmajor_base(q_s);
      const DescBase k_desc = kmajor_base(k_tile);
      const DescBase v_desc = mnmajor_base(k_tile + 4 * TILE_N * 128 * wg, TILE_N);
      const DescBase p_desc = kmajor_base(p_s);
      if constexpr (Geo::kRowFmt) {
        // Two raw stages (V4's rows): tile it + 1 is issued into the other one first and
        // flies during tile it's widening and products. One (fp8_ds_mla's): tile it + 1 is
        // issued once tile it is widened, and flies during its products.
        if constexpr (Geo::kRawStages == 2) {
          if (it + 1 < n_tiles) load_tile(it + 1, (it + 1) & 1, id_ahead);
          cp_async_commit();
          id_ahead = tile_id(it + 2);
          cp_async_wait<1>();  // tile it (and the query) landed; tile it + 1 may fly
        } else {
          cp_async_wait<0>();  // tile it (and the query) landed
        }
        __syncthreads();  // ... every thread's copies of it (the previous tile's products
        //                   are done with the 16-bit stage: the last barrier)
        widen_row_tile(Geo::kRawStages == 1 ? 0 : slot);
        fence_async_smem();  // the widened tile, for wgmma's reads
        __syncthreads();     // complete, and its raw stage free
        if constexpr (Geo::kRawStages == 1) {
          if (it + 1 < n_tiles) load_tile(it + 1, (it + 1) & 1, id_ahead);
          cp_async_commit();
          id_ahead = tile_id(it + 2);
        }
      } else if constexpr (Geo::kProducer) {
        if constexpr (Geo::kQuant) {
          mbar_wait(full_bar(slot), ((done + it) >> 1) & 1);  // every copier's tile it landed
          widen_tile(slot);    // (tile it - 1's products are done: the last barrier)
          fence_async_smem();  // the widened tile, for wgmma's reads
          __syncthreads();     // complete, and raw stage `slot` free
        } else if (wg == 0 || it == 0) {
          // (16-bit: the copying warpgroup waits for the tiles after the first at the end
          // of the tile before, ahead of its next copies: 2% faster at 128 heads with the
          // row copies, docs/PERFORMANCE.md, MLA step 14)
          mbar_wait(full_bar(slot), ((done + it) >> 1) & 1);  // every copier's tile it landed
          fence_async_smem();  // ... for wgmma's reads
        }
      } else {
        if (it + 1 < n_tiles) load_tile(it + 1, (it + 1) & 1, id_ahead);
        cp_async_commit();
        id_ahead = tile_id(it + 2);
        cp_async_wait<1>();  // tile it (and the query) landed; tile it + 1 may fly
        widen_tile(slot);    // fp8 (the previous tile's products are done: the last barrier)
        fence_async_smem();  // this thread's copies and stores, for wgmma's reads
        __syncthreads();
      }

      if (wg == 0) {
        // ---- S = Q K^T and the online softmax -------------------------------------------
        fence_regs(s);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < Geo::kDims / 16; ++k) {
          Wgmma<T, 64, 0>::ss(s, q_desc.at(kmajor_off(16 * k, ROWS)),
                              k_desc.at(kmajor_off(16 * k, TILE_N)), k > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(s);
        const int t0 = (tile_lo + it) * TILE_N;
        float tmax[2] = {neg_inf(), neg_inf()};
        // A tile whose every key both rows of this thread see (paged: every tile but a
        // row's last) needs no masks: only the scale.
        if (!SPARSE && t0 + TILE_N <= min(limit[0], limit[1])) {
#pragma unroll
          for (int i = 0; i < 32; ++i) {
            s[i] *= scale_log2;
            tmax[(i >> 1) & 1] = fmaxf(tmax[(i >> 1) & 1], s[i]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            // sparse: this thread's two keys' flags (an entry that does not count reads as
            // zeros: masked)
            unsigned pair = 0x0101u;
            if constexpr (SPARSE) {
              pair = *reinterpret_cast<const unsigned short*>(valid_s + slot * TILE_N + 8 * j +
                                                              2 * (lane & 3));
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int h = i >> 1;
              const int key = t0 + 8 * j + 2 * (lane & 3) + (i & 1);
              const bool seen = key < limit[h] && ((pair >> (8 * (i & 1))) & 1u);
              s[4 * j + i] = seen ? s[4 * j + i] * scale_log2 : neg_inf();
              tmax[h] = fmaxf(tmax[h], s[4 * j + i]);
            }
          }
        }
        float sub[2], alpha[2];
        advance_fragment_rows(tmax, m_run, l_run, sub, alpha);
        // This warpgroup's half of O rescaled now, beside the exponentials (its P V of the
        // tile before is done), not between the P barrier and its products
        rescale_o(alpha[0], alpha[1]);
        // The 16-bit producer: warpgroup 1's P V of tile it - 1 is done with P and the
        // factors (fp8: the last barrier said so)
        if (Geo::kProducer && !Geo::kQuant && it > 0) {
          named_bar_sync<kMlaSm90Threads>(kMlaBarPFree);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float p0 = fast_exp2(s[4 * j + 2 * h] - sub[h]);
            const float p1 = fast_exp2(s[4 * j + 2 * h + 1] - sub[h]);
            l_run[h] += p0 + p1;
            *reinterpret_cast<unsigned*>(smem + Geo::kOffP +
                                         sw128_offset(frag_row + 8 * h,
                                                      8 * j + 2 * (lane & 3), ROWS)) =
                pack2<T>(p0, p1);
          }
        }
        if ((lane & 3) == 0) {
          alpha_s[frag_row] = alpha[0];
          alpha_s[frag_row + 8] = alpha[1];
        }
        fence_async_smem();  // P, for wgmma's reads
      } else if constexpr (Geo::kProducer && Geo::kQuant) {
        // fp8: tile it + 2's bytes into the raw stage widened above
        if (it + 2 < n_tiles) {
          issue_tile(it + 2, slot, id_ahead);
          cp_async_commit();
          id_ahead = tile_id(it + 3);
        }
      }
      // P and the factors are complete
      if constexpr (Geo::kProducer && !Geo::kQuant) {
        named_bar_sync<kMlaSm90Threads>(kMlaBarP);
      } else {
        __syncthreads();
      }

      // ---- O_half = O_half * alpha + P V_half ------------------------------------------------
      {
        if (wg == 1) rescale_o(alpha_s[frag_row], alpha_s[frag_row + 8]);  // (0's: above)
        fence_regs(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < TILE_N / 16; ++kk) {
          Wgmma<T, 256, 1>::ss(o, p_desc.at(kmajor_off(16 * kk, ROWS)),
                               v_desc.at(mnmajor_off(16 * kk, 0, TILE_N)), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);
      }
      if constexpr (Geo::kProducer && !Geo::kQuant) {
        if (wg == 0) {
          if (it + 2 < n_tiles) named_bar_arrive<kMlaSm90Threads>(kMlaBarEmpty);
        } else {
          if (it + 1 < n_tiles) {
            named_bar_arrive<kMlaSm90Threads>(kMlaBarPFree);
            // Tile it + 1 landed, and visible to this warpgroup's wgmma, before any copy of
            // tile it + 2 is in flight (the tile's top skips both for this warpgroup)
            const unsigned next = done + it + 1;
            mbar_wait(full_bar(next & 1), (next >> 1) & 1);
            fence_async_smem();
          }
          if (it + 2 < n_tiles) {
            // Tile it + 2 into this tile's stage, once warpgroup 0's P V is done with it
            named_bar_sync<kMlaSm90Threads>(kMlaBarEmpty);
            issue_tile(it + 2, slot, id_ahead);
            cp_async_commit();
            id_ahead = tile_id(it + 3);
          }
        }
      } else {
        __syncthreads();  // stage `stage` and P are free for the next tile
      }
    }
    cp_async_wait<0>();
    done += n_tiles;

    // ---- each row's maximum and sum (warpgroup 0 holds them), normalize, store ---------------
    if (wg == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float l = quad_sum(l_run[h]);
        if ((lane & 3) == 0) {
          max_s[frag_row + 8 * h] = m_run[h];
          sum_s[frag_row + 8 * h] = l;
        }
      }
    }
    __syncthreads();  // the row state and the bad-block flag are final
    const bool bad = *bad_s != 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row + 8 * h;
      if (r >= rows_here) continue;
      const int p = row0 + r;
      const long long orow =
          static_cast<long long>(sq.q_begin + p / num_heads) * num_heads + p % num_heads;
      const bool writer = wg == 0 && (lane & 3) == 0;
      const int col = 256 * wg + 2 * (lane & 3);
      if (split_tiles > 0) {
        const long long prow = orow * gridDim.z + blockIdx.z;
        const float inv = end_partial_row(max_s[r], sum_s[r], bad, cache_scale, prow, part_max,
                                          part_sum, writer);
        float* dst = part_out + prow * RANK + col;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          *reinterpret_cast<float2*>(dst + 8 * j) =
              make_float2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
        }
        continue;
      }
      // (Sparse: attn_sink as vp.sinks; the paged kernel takes none.)
      const float sink = SPARSE ? sink_log2(vp, p % num_heads) : neg_inf();
      const float inv = end_whole_row(vp, max_s[r], sum_s[r], bad, cache_scale, sink, orow,
                                      writer);
      T* dst = out + orow * RANK + col;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<unsigned*>(dst + 8 * j) =
            pack2<T>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
      }
    }
  }
}

// Parameters: CUPAGED_MLA_PARAMS (mla_common.cuh), as mla_attention's.
template <typename T, typename C, int RANK, int ROPE, int BLOCK_SIZE>
__global__ void __launch_bounds__(kMlaSm90Threads, 1)
    mla_attention_sm90(CUPAGED_MLA_PARAMS, const __grid_constant__ VariantParams vp,
                       const __grid_constant__ MlaTma tma) {
  mla_attention_sm90_body<T, C, RANK, ROPE, BLOCK_SIZE, false>(CUPAGED_MLA_ARGS, 1, 0,
                                                              MlaSparseExtra{}, vp, &tma);
}

// DeepSeek's sparse attention on wgmma: parameters as mla_sparse_attention's
// (mla_attention.cuh), 16-bit caches and DeepSeek's token rows (V3.2's and V4's); VARIANT
// kVarSecondCache: the second cache, as there.
template <typename T, typename C, int RANK, int ROPE, int BLOCK_SIZE, int VARIANT>
__global__ void __launch_bounds__(kMlaSm90Threads, 1)
    mla_sparse_attention_sm90(CUPAGED_MLA_PARAMS, int lengths_per, int strict,
                              const __grid_constant__ MlaSparseExtra extra,
                              const __grid_constant__ VariantParams vp) {
  static_assert((VARIANT & ~kVarSecondCache) == 0, "the sparse kernel's variant: a second cache");
  mla_attention_sm90_body<T, C, RANK, ROPE, BLOCK_SIZE, true, (VARIANT & kVarSecondCache) != 0>(
      CUPAGED_MLA_ARGS, lengths_per, strict, extra, vp);
}

}  // namespace cupaged
