// Paged attention for several query tokens per sequence on Hopper (sm_90a): paged_prefill's
// contract and arguments (paged_prefill.cuh: query rows packed token-major within a KV
// head's group, bottom-right causal alignment, variants, split-KV partials, NaN rows for
// blocks outside the cache), on wgmma with warp specialization, for token-major caches
// (NHD, HND, strided views) of the query's type or fp8 with per-tensor scales, vLLM's
// layout of the query's type in blocks of 8 tokens or more, and head sizes that are
// multiples of 64 up to 256, or 384 and 512 (16-bit token-major caches; below).
//
// A CTA is three warpgroups working through query tiles of 128 packed rows of one
// (sequence, KV head) (64 over 256 dims, kSplitO below):
//   warpgroup 0, the producer, gathers each TILE_N-token K/V tile from the cache's pages
//   with cp.async into a ring of STAGES 128-byte-swizzled tiles (sm90.cuh), and each
//   consumer's query rows into its Q tile; a stage's `full` mbarrier completes when its
//   copies have landed (fp8: when they are widened), its `empty` one when both consumers
//   are done with it; each consumer's Q tile has a `q_full` and a `q_empty` of its own.
//   Over fp8 the producer first brings each tile's raw bytes into one of two raw stages
//   (while it widens the previous tile into the ring): with bulk copies, one a page's
//   tokens of K or of V, where they lie next to each other (HND, pages of 8 tokens or
//   more), counted on the raw stage's `raw_full` mbarrier, and a raw stage is refilled
//   once every producer thread arrived on its `raw_free`; else each thread copies its
//   chunks with cp.async.
//   The producer gives up registers (setmaxnreg) so the consumers can hold S, P and O at
//   once.
//   warpgroups 1 and 2, the consumers, own 64 rows each (kSplitO: the same 64 rows, half
//   the dims each): S = Q K^T (wgmma, Q and K from
//   shared memory, K K-major), scale, masks and online softmax on S's registers as
//   paged_prefill does, and O += P V (wgmma, P from registers; V MN-major, the same
//   swizzled [token][dim] tile as K, or from vLLM's layout a K-major [dim][token] tile).
//   Each issues tile j's S = Q K^T and tile j - 1's
//   P V together and runs tile j's softmax while the P V is on the tensor cores; the two
//   consumers take turns issuing (named barriers), so one's softmax also overlaps the
//   other's products (kSplitO: no turns, the consumers work in step).
// Over an fp8 cache the products run in float16 whatever the query's type (M below): e4m3
// and e5m2 widen to float16 exactly in one instruction a pair (bfloat16 takes four, and the
// producer's widening bounds the kernel), and a bfloat16 query is converted to float16
// once a query tile, in place, by its consumer with a power-of-two scale a row
// (query_rows_to_half), which the softmax multiplies back into that row's scores.
// An 8-bit query over a cache of its format (the template's last type, Q; T is then the
// output's type) runs the products on 8-bit wgmma (sm90_fp8.cuh): the producer copies each
// tile's K rows from the raw stage into the ring as they are and transposes its V rows
// into V^T, P V's K-major B, keys in the order the consumers' P fragments take them; the
// consumers' weights carry a factor of 2^8 so e4m3 keeps more of them normal. The
// query's scale is the caller's, folded into scale_log2. Head sizes 64 and 128, tiles of
// 128 keys, token-major caches.
// Head sizes over 256 (kSplitO): a warpgroup's O of 64 rows would need 192 or 256 fp32
// registers a thread, so both consumers take the same 64 rows and split the dims: each
// holds Q's and K's half of them for S and O's half of the columns. Each consumer's S is
// a partial over its dims; the two add them through shared memory (a named barrier a
// tile) and run the same softmax on the same sums (the adds commute: both see identical
// scores, maxima and sums), each then adding P V's columns of its half. The tile is 32
// keys (two stages of K and V and the partials fit 227 KiB at 512), and the consumers
// issue their S both before either issues a P V (a second named barrier) instead of
// taking turns, so the partials the exchange waits on come first.
// The grid is persistent: each CTA takes one job of every gridDim.x (jobs below), and its
// producer loads the next job's first tiles and query while the consumers finish the
// last one's. Grid z splits
// each job's keys into partitions as paged_prefill's does.
#pragma once
#include "common.cuh"
#include "fp8.cuh"
#include "kv_layout.cuh"
#include "mma.cuh"
#include "sm90.cuh"
#include "sm90_fp8.cuh"
#include "softmax.cuh"
#include "variants.cuh"

namespace cupaged {

template <typename T, typename C, int HEAD_SIZE, int BLOCK_SIZE, int TILE_N, int STAGES,
          typename Q = T>
struct Sm90PrefillGeometry {
  static constexpr int kThreads = 384;  // producer + two consumer warpgroups
  // An 8-bit query over a cache of the same format (Q = C, T the output's type): the
  // products run on 8-bit wgmma (sm90_fp8.cuh). Q and K tiles hold bytes, in rows of whole
  // 128-byte blocks; the producer copies each K tile from its raw stage into the ring and
  // transposes each V tile into V^T, P V's K-major B; S, P and O as over 16-bit caches.
  static constexpr bool kFp8Mma = sizeof(Q) == 1;
  // An fp8 cache (per-tensor scales): the producer copies each tile's bytes into one of
  // two raw stages and widens them to the products' type (float16, the kernel's M) into
  // the ring (fp8.cuh), while the next tile's bytes are in flight.
  static constexpr bool kQuant = !is_same<T, C>::value;
  static constexpr int kRawStages = kQuant ? 2 : 0;
  static constexpr int kRawTileBytes = TILE_N * HEAD_SIZE;  // one K or V tile of fp8
  static constexpr int kWgRows = 64;    // query rows per consumer (wgmma's M)
  // Over 256 dims both consumers take the same rows, each half the dims (the header).
  static constexpr bool kSplitO = HEAD_SIZE > 256;
  static constexpr int kRows = kSplitO ? kWgRows : 2 * kWgRows;  // a CTA's query tile
  static constexpr int kWgRowStep = kSplitO ? 0 : kWgRows;  // consumer wg's rows from wg * this
  // A consumer's dims: of Q (S's contraction) and of O's columns, from wg * kWgDimStep.
  static constexpr int kWgDims = kSplitO ? HEAD_SIZE / 2 : HEAD_SIZE;
  static constexpr int kWgDimStep = kSplitO ? kWgDims : 0;
  static constexpr int kChunks = HEAD_SIZE / 8;  // 16-byte chunks per row
  // O's wgmma N: 128 columns at a time where the head size allows, else 64.
  static constexpr int kOCols = kWgDims % 128 == 0 ? 128 : 64;
  static constexpr int kOChunks = kWgDims / kOCols;
  // Bytes of a Q or K tile's row: 16-bit elements, or bytes in whole 128-byte blocks.
  static constexpr int kRowBytes = kFp8Mma ? (HEAD_SIZE + 127) / 128 * 128 : HEAD_SIZE * 2;
  static constexpr int kWgQBytes = kWgRows * (kSplitO ? kRowBytes / 2 : kRowBytes);
  static constexpr int kQBytes = 2 * kWgQBytes;  // both consumers' Q tiles
  // One K or V stage (over 8-bit products V^T's HEAD_SIZE rows of TILE_N bytes, no more)
  static constexpr int kTileBytes = TILE_N * kRowBytes;
  static constexpr int kOffK = kQBytes;
  static constexpr int kOffV = kOffK + STAGES * kTileBytes;
  // kSplitO: the partial scores, [tile parity][consumer][TILE_N / 8][128 threads] float4s
  static constexpr int kXBytes = kSplitO ? 2 * 2 * TILE_N / 8 * 128 * 16 : 0;
  static constexpr int kOffX = kOffV + STAGES * kTileBytes;
  static constexpr int kOffRaw = kOffX + kXBytes;  // [kRawStages][K, V]
  // A raw stage's rows are dense, token t of the tile at t * HEAD_SIZE: a page's tokens
  // of one KV head that lie next to each other in the cache (HND) arrive by one bulk copy
  // (sm90.cuh), whose sizes and addresses are multiples of 16 bytes.
  static constexpr int kRawTokens = BLOCK_SIZE < TILE_N ? BLOCK_SIZE : TILE_N;  // a page's run
  static constexpr int kRawRuns = TILE_N / kRawTokens;  // runs (page segments) of a tile
  // Bulk copies where a page holds 8 tokens or more: below that a tile's 16 or more
  // segments cost the issuing warps more instructions than per-thread cp.async does
  // (docs/PERFORMANCE.md: SASS of the issue at 1 to 64 tokens a page).
  static constexpr bool kBulk = kQuant && kRawTokens >= 8;
  // mbarriers: full[STAGES], empty[STAGES], q_full[2], q_empty[2], and over fp8
  // raw_full[kRawStages] (a raw stage's bulk copies landed) and raw_free[kRawStages] (its
  // bytes widened); then bad-block flags, one per producer warp and stage.
  static constexpr int kBars = 2 * STAGES + 4 + 2 * kRawStages;
  static constexpr int kOffBar = kOffRaw + kRawStages * 2 * kRawTileBytes;
  static constexpr int kOffFlags = kOffBar + 8 * kBars;
  // Tiles need 1024-byte alignment (the swizzle's phase): the kernel rounds the dynamic
  // shared memory's base up, so it asks for 1024 bytes more.
  static constexpr int kSmemBytes = kOffFlags + 16 * STAGES + 1024;

  static_assert(sizeof(T) == 2, "16-bit outputs (and tensor-core operands, but 8-bit ones)");
  static_assert(!kQuant || sizeof(C) == 1, "caches of T or fp8");
  static_assert(!kFp8Mma || (is_same<Q, C>::value && TILE_N == 128 && HEAD_SIZE <= 128 &&
                              STAGES >= 3),
                "an 8-bit query over a cache of its format, in tiles of 128 keys (V^T's rows "
                "are whole 128-byte blocks), head sizes 64 and 128 (larger ones overflow "
                "shared memory with the raw stages), three stages or more (K is copied "
                "into a stage a tile ahead)");
  static_assert(HEAD_SIZE % 64 == 0 && HEAD_SIZE >= 64 &&
                    (HEAD_SIZE <= 256 || (HEAD_SIZE % 128 == 0 && HEAD_SIZE <= 512)),
                "HEAD_SIZE");
  static_assert(!kSplitO || (!kQuant && !kFp8Mma),
                "head sizes over 256: caches of the query's 16-bit type");
  static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && BLOCK_SIZE <= 256, "BLOCK_SIZE");
  static_assert(kSplitO ? TILE_N == 32 : (TILE_N == 64 || TILE_N == 128),
                "TILE_N: wgmma's N of S (32 over 256 dims)");
  static_assert(STAGES >= 2 && STAGES <= 4, "STAGES");
  static_assert(!kQuant || (HEAD_SIZE % 16 == 0 && kOffRaw % 16 == 0),
                "bulk copies: 16-byte multiples of sizes and shared addresses");
};

// Ping-pong between the consumers (FlashAttention-3's warp scheduling): each waits for
// its turn (named barrier 2 + wg) before issuing its matrix products and passes the turn
// (the other's barrier) after, so one's products run while the other does its softmax.
__device__ __forceinline__ void consumer_turn_wait(int wg) {
  named_bar_sync<256>(2 + wg);
}
__device__ __forceinline__ void consumer_turn_pass(int wg) {
  named_bar_arrive<256>(3 - wg);
}

// Named barrier 4 + wg: consumer wg's 128 threads, once its Q tile is converted (ids 2 and
// 3 are the consumers' turns, 0 __syncthreads').
constexpr int kBarQueryHalf = 4;
// Named barriers 7 and 8 (kSplitO): both consumers, once each has its partial scores in
// shared memory, and once both have issued S (before either issues P V).
constexpr int kBarScores = 7;
constexpr int kBarIssued = 8;
// Named barrier 6: the producer's 128 threads, between the raw V rows of a tile landing
// (and the empty ones zeroed) and their transposition by all of them, and by cp.async
// after it, before the next copies into the raw stage (8-bit products).
constexpr int kBarProducer = 6;

// A consumer's bfloat16 Q tile (64 rows of HEAD_SIZE at `tile`, 128-byte swizzled as
// sw128_offset lays them out) rewritten in place as float16 Q_r / p_r, p_r the power of
// two that puts row r's largest finite magnitude in [2^14, 2^15) (2^-126 for a row of
// zeros). Each thread converts a quarter of its two C-fragment rows (16 cwarp + lane / 4
// and + 8: a quad shares them) and ends with both rows' p (p[h]). A scale a row keeps rows
// independent, as bfloat16's own exponents do: a row's values below 2^-28 of its largest
// become float16 subnormals (below 2^-38, zero), far under bfloat16's rounding of that
// largest one. Infinities and NaN are left out of the maximum and stay what they are. The
// caller fences and syncs the warpgroup before wgmma reads the tile.
template <typename T, int HEAD_SIZE>
__device__ __forceinline__ void query_rows_to_half(unsigned tile, int cwarp, int lane,
                                                   float (&p)[2]) {
  static_assert(is_same<T, bfloat16_t>::value,
                "query_rows_to_half decodes bfloat16 bits (a float's high half)");
  constexpr int kPer = HEAD_SIZE / 8 / 4;  // 16-byte chunks a thread converts in a row
  // Chunk k of row r: 16-byte chunk part + 4 k', i.e. chunk part + 4 (k' % 2) of 64-column
  // block k / 2, as sw128_offset places it (the swizzle XORs the chunk with r % 8, so
  // k' % 2 flips address bit 6): one base address a thread, the rest immediate offsets.
  // k' = k ^ (r % 2): a 16-byte access is served 8 lanes at a time, and lanes 8i to 8i + 7
  // hold an even row and the next, whose chunks part for k' = k (the same 64 bytes of a
  // 128-byte row after swizzles by r % 8 and r % 8 ^ 1) would share banks; odd rows take
  // the other 64 bytes first, so the 8 lanes cover the 32 banks once (both passes).
  const int r0 = cwarp * 16 + (lane >> 2);
  const unsigned row_base =
      (tile + sm90::sw128_offset(r0, (lane & 3) * 8, 64))  // row r0, chunk lane % 4
      ^ (static_cast<unsigned>(r0 & 1) << 6);
  auto chunk = [&](int h, int k) {
    return (row_base ^ ((k & 1) << 6)) + static_cast<unsigned>((k >> 1) * 64 * 128 + h * 8 * 128);
  };
  // Volatile loads, read twice (for the maximum, then to convert): a chunk's registers
  // live only while it is worked on, beside the consumer's accumulators.
  auto load = [](unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
  };
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const uint4 v = load(chunk(h, k));
      const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // a bfloat16's magnitude, as a float (its bits in the high half)
        const unsigned lo = (w[i] << 16) & 0x7fff0000u, hi = w[i] & 0x7fff0000u;
        if (lo < 0x7f800000u) amax[h] = fmaxf(amax[h], __uint_as_float(lo));
        if (hi < 0x7f800000u) amax[h] = fmaxf(amax[h], __uint_as_float(hi));
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    amax[h] = fmaxf(amax[h], __shfl_xor_sync(~0u, amax[h], 1));
    amax[h] = fmaxf(amax[h], __shfl_xor_sync(~0u, amax[h], 2));
    // p = 2^(e - 14), e the largest magnitude's exponent, clamped to the normal floats
    const int e = static_cast<int>((__float_as_uint(amax[h]) >> 23) & 0xffu) - 127;
    const int field = min(max(e - 14 + 127, 1), 254);
    p[h] = __uint_as_float(static_cast<unsigned>(field) << 23);
    const float inv = __uint_as_float(static_cast<unsigned>(254 - field) << 23);  // 1 / p, exact
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const uint4 v = load(chunk(h, k));
      unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float lo = __uint_as_float(w[i] << 16) * inv;
        const float hi = __uint_as_float(w[i] & 0xffff0000u) * inv;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(hi), "f"(lo));
      }
      sm90::st_shared_v4(chunk(h, k), w[0], w[1], w[2], w[3]);
    }
  }
}

// Registers per thread of each role, set by setmaxnreg out of what the launch allocated
// (384 threads x 168, __launch_bounds__(384, 1)). The copy loop of a 16-bit token-major
// producer needs few, and the consumers take the rest: 128 * (56 + 2 * 224) = 64512. A
// producer with more work per tile runs faster with more, measured on an H200
// (docs/PERFORMANCE.md): fp8's widening 88 (+18-23% against 56; 104 and 120 lost 1-5%),
// vLLM's strided gathers 72 (+6-10%); their consumers fit in fewer (S of 64 keys for fp8),
// but for head size 256, whose O alone takes 128 registers.
template <bool QUANT, bool VLLM, int HEAD_SIZE>
struct Sm90Registers {
  static constexpr bool kVllmMore = VLLM && HEAD_SIZE <= 192;
  static constexpr int kProducer = QUANT ? 88 : kVllmMore ? 72 : 56;
  static constexpr int kConsumer = QUANT ? 208 : kVllmMore ? 216 : 224;
  // setmaxnreg.inc waits until the CTA's pool has the registers: asking for more than the
  // launch allocated never returns (jit.LAUNCH_REGS checks the compiled count).
  static_assert(128 * (kProducer + 2 * kConsumer) <= 384 * 168,
                "setmaxnreg: the warpgroups' registers exceed the launch's");
};

template <typename T, typename C, int HEAD_SIZE, int BLOCK_SIZE, int KV_FORMAT, int TILE_N,
          int STAGES, int VARIANT, typename Q = T>
__global__ void __launch_bounds__(384, 1)
    paged_prefill_sm90(T* __restrict__ out, float* __restrict__ part_out,
                       float* __restrict__ part_max, float* __restrict__ part_sum,
                       int split_tiles,
                       // `ranks` per (sequence, KV head) pair: rank r of a sequence is its
                       // query tiles q_tiles - 1 - r, q_tiles - 1 - r - ranks, ...
                       int num_seqs, int ranks, const Q* __restrict__ query,
                       long long q_token_stride, long long q_head_stride,
                       const __grid_constant__ PagedKV kv, const int* __restrict__ seq_lens,
                       const int* __restrict__ query_start_loc,
                       const float* __restrict__ alibi_slopes, int num_heads, int group_size,
                       int causal, float scale_log2, const __grid_constant__ VariantParams vp) {
  using Geo = Sm90PrefillGeometry<T, C, HEAD_SIZE, BLOCK_SIZE, TILE_N, STAGES, Q>;
  constexpr bool kFp8Mma = Geo::kFp8Mma;
  using KV = KVAccess<C, KV_FORMAT, BLOCK_SIZE>;
  // vLLM's layout: V [dim][token] within a block is copied in 16-byte runs of 8 tokens and
  // kept dim-major, wgmma's K-major B of P V.
  constexpr bool kVllm = KV_FORMAT == kFormatVllm;
  using Regs = Sm90Registers<Geo::kQuant, kVllm, HEAD_SIZE>;
  static_assert(!kVllm || (!Geo::kQuant && BLOCK_SIZE >= 8 && !Geo::kSplitO),
                "vLLM's layout: 16-bit caches in blocks of 8 tokens or more, head sizes to 256");
  using Var = Variant<VARIANT>;
  using namespace sm90;
  static_assert(!Var::kBlockSparse, "blocksparse is a decode variant");
  static_assert(!Var::kFixedOffset || (is_same<T, bfloat16_t>::value && !kFp8Mma),
                "a fixed softmax offset needs P in bfloat16 (fp32's exponent range)");
  static_assert(!kFp8Mma || !kVllm, "8-bit products over token-major caches");
  // M, the products' 16-bit type (K and V as widened, Q as the S wgmma reads it, P): T, or
  // float16 over an fp8 cache, to which e4m3 and e5m2 widen exactly in one instruction a
  // pair where bfloat16 takes four (docs/PERFORMANCE.md). P (weights in [0, 1] of the
  // row's running maximum) in float16 is as fine as in bfloat16 or finer only on
  // [2^-17, 1]: below 2^-14 float16's subnormals keep a fixed step of 2^-24, coarser than
  // bfloat16's below 2^-17, and weights of 2^-25 or less round to zero. l_run sums the fp32
  // weights while O gets the rounded ones, so a row whose mass sits in N keys each below
  // 2^-25 of its maximum loses up to N x 2^-25 of it (negligible unless N is in the
  // millions); float16 queries over fp8 always ran this way. A fixed offset keeps
  // bfloat16's range (weights up to 2^64).
  constexpr bool kHalfProducts = Geo::kQuant && !kFp8Mma && !Var::kFixedOffset;
  using M = typename conditional<kHalfProducts, half_t, T>::type;
  // a bfloat16 query over fp8: converted to float16 by its consumer (query_rows_to_half)
  constexpr bool kQueryToHalf = kHalfProducts && is_same<T, bfloat16_t>::value;
  static_assert(!kHalfProducts || kQueryToHalf || is_same<T, half_t>::value,
                "float16 products over fp8 take a float16 or bfloat16 query");
  static_assert(kFp8Mma || is_same<Q, T>::value, "a 16-bit query is of the output's type");
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int CH = Geo::kChunks;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  const unsigned base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const unsigned q_s = base;
  const unsigned k_s = base + Geo::kOffK;
  const unsigned v_s = base + Geo::kOffV;
  const unsigned raw_s = base + Geo::kOffRaw;
  auto full_bar = [&](int s) { return base + Geo::kOffBar + 8u * s; };
  auto empty_bar = [&](int s) { return base + Geo::kOffBar + 8u * (STAGES + s); };
  auto q_full_bar = [&](int wg) { return base + Geo::kOffBar + 8u * (2 * STAGES + wg); };
  auto q_empty_bar = [&](int wg) { return base + Geo::kOffBar + 8u * (2 * STAGES + 2 + wg); };
  // fp8: raw stage r's bulk copies landed / its bytes were widened (bulk mode below)
  auto raw_full_bar = [&](unsigned r) { return base + Geo::kOffBar + 8u * (2 * STAGES + 4 + r); };
  auto raw_free_bar = [&](unsigned r) {
    return base + Geo::kOffBar + 8u * (2 * STAGES + 4 + Geo::kRawStages + r);
  };
  // [STAGES][4]: producer warp w's flag of the tile in the stage.
  volatile int* bad_s = reinterpret_cast<volatile int*>(smem + Geo::kOffFlags);

  const int tid = threadIdx.x;
  // Through a shuffle, so the compiler knows the warp (and its warpgroup) is uniform:
  // branches on them then keep wgmma out of divergent paths, which ptxas would serialize.
  const int warp = __shfl_sync(~0u, tid >> 5, 0);
  const int lane = tid & 31;
  const int num_kv_heads = num_heads / group_size;
  // A job is ranks d and ranks - 1 - d of one pair: a causal prompt's longest query tile
  // with its shortest, and so on, so a prompt's jobs take the same time (the static
  // schedule balances) and the CTAs running at once stay on the same few pairs, whose
  // keys then come from L2.
  const int num_pairs = num_seqs * num_kv_heads;
  const int jobs_per_pair = (ranks + 1) / 2;
  const long long num_jobs = static_cast<long long>(num_pairs) * jobs_per_pair;

  if (tid == 0) {
    if (dynamic_smem_bytes() < static_cast<unsigned>(Geo::kSmemBytes)) __trap();
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      // Each producer thread: its copies and its stores (fp8: its widened stores).
      mbar_init(full_bar(s), Geo::kQuant ? 128 : 2 * 128);
      mbar_init(empty_bar(s), 2 * 128);  // each consumer thread
    }
#pragma unroll
    for (int wg = 0; wg < 2; ++wg) {
      mbar_init(q_full_bar(wg), 2 * 128);
      mbar_init(q_empty_bar(wg), 128);
    }
    if constexpr (Geo::kQuant) {
#pragma unroll
      for (int r = 0; r < Geo::kRawStages; ++r) {
        mbar_init(raw_full_bar(r), Geo::kRawRuns);  // each run's issuing thread
        mbar_init(raw_free_bar(r), 128);            // each producer thread
      }
      fence_mbarrier_init();  // the bulk copies' complete_tx comes from the async proxy
    }
  }
  __syncthreads();

  // Job w of this CTA's round k: rounds alternate direction over the CTAs, so uneven
  // jobs (a varlen batch's) balance better than in rows of the same order.
  auto job_index = [&](long long k) {
    return k * gridDim.x + ((k & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
  };
  // A job's sequence facts, the same in both roles.
  struct Job {
    int seq, kv_head, d, q_begin, packed, q_tiles, seq_len, q_shift;
  };
  auto job_of = [&](long long w) {
    Job jb;
    const int sk = static_cast<int>(w / jobs_per_pair);
    jb.d = static_cast<int>(w - static_cast<long long>(sk) * jobs_per_pair);
    jb.seq = sk / num_kv_heads;
    jb.kv_head = sk - jb.seq * num_kv_heads;
    jb.q_begin = query_start_loc != nullptr ? __ldg(query_start_loc + jb.seq) : jb.seq;
    const int q_len =
        query_start_loc != nullptr ? __ldg(query_start_loc + jb.seq + 1) - jb.q_begin : 1;
    // Both roles compute every job's tiles from the same metadata, so they agree on the
  // barrier phases (metadata changed by another stream during the launch, undefined for
  // any kernel, could hang this one).
  // Lengths past the table's width are clamped so the row is never overrun; negative
    // lengths count as empty (cupaged.check_block_tables and CUPAGED_DEBUG report both).
    jb.seq_len = max(0, min(__ldg(seq_lens + jb.seq), kv.max_blocks * BLOCK_SIZE));
    jb.packed = q_len * group_size;  // validation keeps total_q * group below 2^31
    jb.q_tiles = q_len > 0 ? (jb.packed + Geo::kRows - 1) / Geo::kRows : 0;
    jb.q_shift = jb.seq_len - q_len;
    return jb;
  };

  // The keys query tile qt reads, as paged_prefill computes them: [kv_lo, kv_end) in
  // n_tiles tiles from tile_base (this CTA's split-KV partition of them).
  struct Span {
    int kv_lo, kv_end, tile_base, n_tiles;
  };
  auto span_of = [&](const Job& jb, int qt) {
    const int row0 = qt * Geo::kRows;
    const int rows_here = min(Geo::kRows, jb.packed - row0);
    const int last_pos = jb.q_shift + (row0 + rows_here - 1) / group_size;
    Span sp;
    sp.kv_end = causal ? max(0, min(jb.seq_len, last_pos + 1)) : jb.seq_len;
    sp.kv_lo = min(Var::first_key(vp, jb.q_shift + row0 / group_size), sp.kv_end);
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
    setmaxnreg_dec<Regs::kProducer>();
    // Eight threads per row (a warp's copies are whole 128-byte lines); thread tid copies
    // chunks c0, c0 + 8, ... of rows tid / 8 + 16 k. The swizzled chunk of a row depends
    // on the row's index mod 8 only, which is this thread's for every row.
    constexpr int kRowsPerPass = 128 / 8;
    constexpr int kPasses = TILE_N / kRowsPerPass;
    constexpr int kCPer = CH / 8;
    // The query's 16-byte chunks (of 16 / sizeof(Q) elements): a row's, and this thread's
    // (c0, c0 + 8, ...; a row of 64 bytes has four, for threads c0 < 4).
    constexpr int kQE = 16 / static_cast<int>(sizeof(Q));
    constexpr int kQChunks = Geo::kWgDims / kQE;  // (of a consumer's Q tile)
    constexpr int kQPer = (kQChunks + 7) / 8;
    const int c0 = tid & 7;
    const int trow = tid >> 3;
    const unsigned swz = static_cast<unsigned>((c0 ^ (trow & 7)) << 4);
    unsigned g = 0;  // tiles produced: stage g % STAGES, its use g / STAGES
    unsigned j = 0;  // jobs produced: use j of the Q tiles
    for (long long k = 0, w = job_index(0); w < num_jobs; w = job_index(++k)) {
      const Job jb = job_of(w);
      const typename KV::Head hd = KV::head(kv, jb.kv_head);
      const int* bt_row = kv.block_tables + jb.seq * kv.bt_stride;
      for (int half = 0; half < 2; ++half) {
      const int rank = half == 0 ? jb.d : ranks - 1 - jb.d;
      if (half == 1 && rank == jb.d) break;
      for (int qt = jb.q_tiles - 1 - rank; qt >= 0; qt -= ranks, ++j) {
        const Span sp = span_of(jb, qt);
        // Each consumer's 64 query rows; rows past the sequence's are zeros.
        auto load_q = [&]() {
#pragma unroll
          for (int wg = 0; wg < 2; ++wg) {
            mbar_wait(q_empty_bar(wg), (j & 1) ^ 1);  // a fresh barrier passes
            const unsigned qs = q_s + wg * Geo::kWgQBytes;
            bool stored = false;
#pragma unroll
            for (int pass = 0; pass < Geo::kWgRows / kRowsPerPass; ++pass) {
              const int r = pass * kRowsPerPass + trow;
              const int p = qt * Geo::kRows + wg * Geo::kWgRowStep + r;
              const unsigned row = r * 128 + swz;
              if (p < jb.packed) {
                const int head = jb.kv_head * group_size + p % group_size;
                const Q* src = query + (jb.q_begin + p / group_size) * q_token_stride +
                               head * q_head_stride + wg * Geo::kWgDimStep + c0 * kQE;
#pragma unroll
                for (int i = 0; i < kQPer; ++i) {
                  if (kQChunks % 8 != 0 && c0 + 8 * i >= kQChunks) break;
                  cp_async16_shared(qs + i * Geo::kWgRows * 128 + row, src + i * 8 * kQE);
                }
              } else {
#pragma unroll
                for (int i = 0; i < kQPer; ++i) {
                  if (kQChunks % 8 != 0 && c0 + 8 * i >= kQChunks) break;
                  st_shared_zero16(qs + i * Geo::kWgRows * 128 + row);
                }
                stored = true;
              }
            }
            if (stored) fence_async_smem();  // ordinary stores that wgmma reads next
            cp_async_mbar_arrive(q_full_bar(wg));
            mbar_arrive(q_full_bar(wg));
          }
        };
        // Block ids of tile `it`'s rows of this thread (-1: not copied: past the keys,
        // before the window, or a bad id, which sets `bad`).
        auto tile_ids = [&](int it, int (&phys)[kPasses], bool& bad) {
          const int t0 = (sp.tile_base + it) * TILE_N;
#pragma unroll
          for (int pass = 0; pass < kPasses; ++pass) {
            const int token = t0 + pass * kRowsPerPass + trow;
            phys[pass] = -1;
            if (token < sp.kv_end && !(Var::kWindow && token < sp.kv_lo)) {
              phys[pass] = __ldg(bt_row + token / BLOCK_SIZE);
              if (static_cast<unsigned>(phys[pass]) >= static_cast<unsigned>(kv.num_blocks)) {
                phys[pass] = -1;
                bad = true;
              }
            }
          }
        };
        // The tile's bad-block flags, published with the tile (the consumers read them
        // after its full barrier and before its empty one); then its arrival.
        auto publish = [&](int stage, bool bad, bool stored) {
          if (stored) fence_async_smem();  // ordinary stores that wgmma reads next
          bad = __any_sync(~0u, bad);
          if (lane == 0) bad_s[stage * 4 + warp] = bad;
          if constexpr (!Geo::kQuant) cp_async_mbar_arrive(full_bar(stage));
          mbar_arrive(full_bar(stage));
        };
        if constexpr (!Geo::kQuant) {
          for (int it = 0; it < sp.n_tiles; ++it, ++g) {
            // The first K/V tile before the query: its stage frees up first, while the
            // consumers still hold their Q tiles for the previous job's last tile.
            if (it == 1) load_q();
            const int stage = g % STAGES;
            const int t0 = (sp.tile_base + it) * TILE_N;
            const unsigned ks = k_s + stage * Geo::kTileBytes;
            const unsigned vs = v_s + stage * Geo::kTileBytes;
            // The tile's block ids load while this warp waits for its stage.
            int phys[kPasses];
            bool bad = false;
            tile_ids(it, phys, bad);
            mbar_wait(empty_bar(stage), ((g / STAGES) & 1) ^ 1);
            bool stored = false;
            if constexpr (!kVllm) {
#pragma unroll
              for (int pass = 0; pass < kPasses; ++pass) {
                const unsigned t = pass * kRowsPerPass + trow;
                const unsigned row = t * 128 + swz;
                if (phys[pass] >= 0) {
                  const unsigned within = static_cast<unsigned>(t0 + t) % BLOCK_SIZE;
                  const unsigned long long pb = static_cast<unsigned long long>(phys[pass]);
                  const C* gk = hd.k + pb * hd.k_block + within * hd.k_token + c0 * 8;
                  const C* gv = hd.v + pb * hd.v_block + within * hd.v_token + c0 * 8;
#pragma unroll
                  for (int i = 0; i < kCPer; ++i) cp_async16_shared(ks + i * TILE_N * 128 + row, gk + i * 64);
#pragma unroll
                  for (int i = 0; i < kCPer; ++i) cp_async16_shared(vs + i * TILE_N * 128 + row, gv + i * 64);
                } else {
                  // P is 0 on these keys, and 0 * a stale NaN would be NaN: V must read as
                  // zeros (K need not: their scores are masked).
#pragma unroll
                  for (int i = 0; i < kCPer; ++i) st_shared_zero16(vs + i * TILE_N * 128 + row);
                  stored = true;
                }
              }
            } else {
              // vLLM's key, [chunk][token][8] within a block: this thread's rows and chunks
              // as above, from their strided places.
#pragma unroll
              for (int pass = 0; pass < kPasses; ++pass) {
                if (phys[pass] < 0) continue;
                const unsigned t = pass * kRowsPerPass + trow;
                const unsigned within = static_cast<unsigned>(t0 + t) % BLOCK_SIZE;
                const C* gk = hd.k + static_cast<unsigned long long>(phys[pass]) * hd.k_block +
                              (c0 * BLOCK_SIZE + within) * 8;
#pragma unroll
                for (int i = 0; i < kCPer; ++i) {
                  cp_async16_shared(ks + i * TILE_N * 128 + t * 128 + swz, gk + i * 8 * BLOCK_SIZE * 8);
                }
              }
              // vLLM's value, [dim][token] within a block: this thread's run of 8 tokens
              // (tile tokens r * 8 ..) of dims d0, d0 + kDimStep, ..., into the dim-major
              // swizzled tile (row d, 64 tokens to a 128-byte row). A run straddling the
              // keys' end or the window's start goes through registers, its outside
              // tokens zeroed; a run wholly outside, or of a bad block, is zeros.
              constexpr int kRuns = TILE_N / 8;
              constexpr int kDimStep = 128 / kRuns;
              const int r = tid % kRuns;
              const int d0 = tid / kRuns;
              const int first = t0 + r * 8;
              const int lo = Var::kWindow ? min(8, max(0, sp.kv_lo - first)) : 0;
              const int hi = min(8, max(0, sp.kv_end - first));
              int run_phys = -1;
              if (lo < hi) {
                run_phys = __ldg(bt_row + first / BLOCK_SIZE);
                if (static_cast<unsigned>(run_phys) >= static_cast<unsigned>(kv.num_blocks)) {
                  run_phys = -1;
                  bad = true;
                }
              }
              const unsigned dst0 = vs + (r >> 3) * HEAD_SIZE * 128 + ((r & 7) << 4);
              const C* gv = hd.v + static_cast<unsigned long long>(max(run_phys, 0)) * hd.v_block +
                            first % BLOCK_SIZE;
#pragma unroll 4
              for (int d = d0; d < HEAD_SIZE; d += kDimStep) {
                const unsigned dst = (dst0 ^ ((d & 7) << 4)) + d * 128;
                if (run_phys < 0) {
                  st_shared_zero16(dst);
                  stored = true;
                } else if (lo == 0 && hi == 8) {
                  cp_async16_shared(dst, gv + d * BLOCK_SIZE);
                } else {
                  uint4 x = __ldg(reinterpret_cast<const uint4*>(gv + d * BLOCK_SIZE));
                  unsigned w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                  for (int k = 0; k < 4; ++k) {
                    if (2 * k < lo || 2 * k >= hi) w[k] &= 0xffff0000u;
                    if (2 * k + 1 < lo || 2 * k + 1 >= hi) w[k] &= 0x0000ffffu;
                  }
                  st_shared_v4(dst, w[0], w[1], w[2], w[3]);
                  stored = true;
                }
              }
            }
            publish(stage, bad, stored);
          }
        } else {
          // fp8: each tile's raw bytes (rows of HEAD_SIZE, dense) land in raw stage g % 2
          // while the previous tile's are widened; thread tid widens the 16-byte chunks c0,
          // c0 + 8, ... of rows tid / 8 + 16 k into the ring. (vLLM's layout never comes
          // here: the kernel takes it over 16-bit caches only, static_assert above.)
          //
          // The bytes arrive one of two ways, chosen per launch (warp-uniform):
          //   bulk (Geo::kBulk: pages of 8 tokens or more, and a page's tokens of the KV
          //   head next to each other in the cache, token stride HEAD_SIZE bytes, as HND
          //   has): one bulk copy of K and one of V per page segment of the tile
          //   (kRawTokens tokens, fewer at the keys' ends), issued warp-uniformly by one
          //   elected lane; raw_full counts their bytes, and every producer thread arrives
          //   on raw_free once it has read the stage, before a copy refills it. A 64-token
          //   tile of 16-token pages costs each warp about 95 instructions of issue
          //   against about 190 of cp.async.
          //   per thread (strided token rows, NHD, and pages under 8 tokens): each thread
          //   copies the chunks it widens with cp.async (16 bytes an instruction), waited
          //   for by commit group. Bulk copies of single token rows would cost more: in
          //   uniform registers each costs about six instructions of address arithmetic,
          //   so a tile's 128 of them take each warp about 170 more instructions than
          //   the cp.async of its chunks (docs/PERFORMANCE.md).
          constexpr int kRawChunks = HEAD_SIZE / 16;
          constexpr int kRawPer = (kRawChunks + 7) / 8;
          auto raw_stage = [&](unsigned gi) { return raw_s + (gi & 1) * 2 * Geo::kRawTileBytes; };
          auto copy_raw = [&](int it, unsigned gi, const int (&phys)[kPasses]) {
            const int t0 = (sp.tile_base + it) * TILE_N;
            const unsigned rk = raw_stage(gi);
            const unsigned rv = rk + Geo::kRawTileBytes;
            // 8-bit products: K's bytes go straight into the tile's ring stage, swizzled,
            // once the consumers are done with it (three stages or more: the stage's last
            // tile is released before this one's predecessor is needed), no raw copy.
            const unsigned kring = k_s + (gi % STAGES) * Geo::kTileBytes;
            if constexpr (kFp8Mma) mbar_wait(empty_bar(gi % STAGES), ((gi / STAGES) & 1) ^ 1);
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
              if (phys[pass] < 0) continue;
              const unsigned t = pass * kRowsPerPass + trow;
              const unsigned within = static_cast<unsigned>(t0 + t) % BLOCK_SIZE;
              const unsigned long long pb = static_cast<unsigned long long>(phys[pass]);
              const C* gk = hd.k + pb * hd.k_block + within * hd.k_token;
              const C* gv = hd.v + pb * hd.v_block + within * hd.v_token;
#pragma unroll
              for (int i = 0; i < kRawPer; ++i) {
                const int c = c0 + 8 * i;
                if (kRawChunks % 8 != 0 && c >= kRawChunks) break;
                if constexpr (kFp8Mma) {
                  cp_async16_shared(kring + sw128_offset8(t, c * 16, TILE_N), gk + c * 16);
                } else {
                  cp_async16_shared(rk + t * HEAD_SIZE + c * 16, gk + c * 16);
                }
                cp_async16_shared(rv + t * HEAD_SIZE + c * 16, gv + c * 16);
              }
            }
            cp_async_commit();
          };
          // Bulk: warp w issues the tile's page segments w, w + 4, ... (kRawRuns in all),
          // warp-uniformly, each by one elected lane; lane i holds segment w + 4 i's
          // block id, loaded a tile ahead (its latency then overlaps a widening).
          constexpr int kWarpRuns = (Geo::kRawRuns + 3) / 4;
          const bool issuing = warp < Geo::kRawRuns;
          // Tile `it`'s keys in segment r: [lo, hi), empty past the keys or before the
          // window (never read, as tile_ids leaves them).
          auto run_span = [&](int it, int r, int& lo, int& hi) {
            const int first = (sp.tile_base + it) * TILE_N + r * Geo::kRawTokens;
            lo = Var::kWindow ? max(first, sp.kv_lo) : first;
            hi = min(first + Geo::kRawTokens, sp.kv_end);
          };
          // This lane's segment's block id for tile `it` (-1: none, its entry not read).
          auto run_ids = [&](int it) {
            const int r = warp + 4 * lane;
            int lo = 0, hi = 0;
            if (lane < kWarpRuns) run_span(it, r, lo, hi);
            return lo < hi ? __ldg(bt_row + static_cast<unsigned>(lo) / BLOCK_SIZE) : -1;
          };
          // Tile `it` into raw stage gi % 2 (an issuing warp, converged): each segment's K
          // and V bytes, or none (an empty segment, or a block id outside the cache, which
          // sets `bad`: nothing of it is read, the stale bytes where it would have landed
          // are widened like the rest, and the flag makes every row of the query tiles
          // that read it NaN).
          auto issue_bulk = [&](int it, unsigned gi, int ids, bool& bad) {
            const int t0 = (sp.tile_base + it) * TILE_N;
            // Every producer thread has read this stage's last tile (gi - 2) and arrived:
            // the wait orders those ordinary loads before this warp, the proxy fence
            // before the copies' writes, which the async proxy makes. (A fresh barrier
            // passes: parity 1.)
            mbar_wait(raw_free_bar(gi & 1), ((gi >> 1) & 1) ^ 1);
            fence_async_smem();
            const unsigned bar = raw_full_bar(gi & 1);
#pragma unroll
            for (int i = 0; i < kWarpRuns; ++i) {
              const int r = warp + 4 * i;
              const int id = __shfl_sync(~0u, ids, i);
              int lo, hi;
              run_span(it, r, lo, hi);
              unsigned bytes = 0;
              if (lo < hi) {
                if (static_cast<unsigned>(id) < static_cast<unsigned>(kv.num_blocks)) {
                  bytes = static_cast<unsigned>(hi - lo) * HEAD_SIZE;
                } else {
                  bad = true;
                }
              }
              if (elect_one()) {
                mbar_arrive_expect_tx(bar, 2 * bytes);  // the segment's arrival
                if (bytes != 0) {
                  // Addresses and sizes are multiples of 16 bytes: the cache's pointer
                  // and its block and head strides are (the host checks fp8 caches so:
                  // _checks.check_kv_layout), the token stride is HEAD_SIZE here, a
                  // multiple of 64, and so are the raw stage's rows.
                  const unsigned within = static_cast<unsigned>(lo) % BLOCK_SIZE;
                  const unsigned long long pb = static_cast<unsigned long long>(id);
                  const unsigned dst = raw_stage(gi) + static_cast<unsigned>(lo - t0) * HEAD_SIZE;
                  bulk_copy_g2s(dst, hd.k + pb * hd.k_block + within * HEAD_SIZE, bytes, bar);
                  bulk_copy_g2s(dst + Geo::kRawTileBytes,
                                hd.v + pb * hd.v_block + within * HEAD_SIZE, bytes, bar);
                }
              }
            }
          };
          // Bulk: which of this thread's rows of tile `it` hold keys (0) or not (-1), as
          // phys of tile_ids reads for the widening below.
          auto tile_rows = [&](int it, int (&phys)[kPasses]) {
            const int t0 = (sp.tile_base + it) * TILE_N;
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
              const int token = t0 + pass * kRowsPerPass + trow;
              phys[pass] = token < sp.kv_end && !(Var::kWindow && token < sp.kv_lo) ? 0 : -1;
            }
          };
          // The span's tiles, one body per way (a compile-time flag), chosen per launch:
          // the token strides are the call's, so every span of a launch takes the same
          // way and the raw barriers' phases (tile g: raw stage g % 2, its use g / 2) run
          // on across spans and jobs.
          auto span_tiles = [&](const bool bulk) {
            int phys[kPasses], phys_next[kPasses];
            bool bad = false, bad_next = false;
            int ids_next = -1;
            if (sp.n_tiles > 0) {
              if (bulk) {
                if (issuing) {
                  issue_bulk(0, g, run_ids(0), bad);
                  if (sp.n_tiles > 1) ids_next = run_ids(1);
                }
              } else {
                tile_ids(0, phys, bad);
                copy_raw(0, g, phys);
              }
            }
            for (int it = 0; it < sp.n_tiles; ++it, ++g) {
              if (it == 1) load_q();
              const bool more = it + 1 < sp.n_tiles;
              // the next tile's bytes fly while this one is widened
              if (bulk) {
                bad_next = false;
                if (more && issuing) {
                  issue_bulk(it + 1, g + 1, ids_next, bad_next);
                  if (it + 2 < sp.n_tiles) ids_next = run_ids(it + 2);
                }
                tile_rows(it, phys);
                mbar_wait(raw_full_bar(g & 1), (g >> 1) & 1);
              } else if (more) {
                bad_next = false;
                tile_ids(it + 1, phys_next, bad_next);
                copy_raw(it + 1, g + 1, phys_next);
                cp_async_wait<1>();
              } else {
                cp_async_wait<0>();
              }
              const int stage = g % STAGES;
              mbar_wait(empty_bar(stage), ((g / STAGES) & 1) ^ 1);
              const unsigned ks = k_s + stage * Geo::kTileBytes;
              const unsigned vs = v_s + stage * Geo::kTileBytes;
              const unsigned char* rk = smem + Geo::kOffRaw + (g & 1) * 2 * Geo::kRawTileBytes;
              const unsigned char* rv = rk + Geo::kRawTileBytes;
              // This thread's 16-byte chunks c0, c0 + 8, ... of rows trow + kRowsPerPass k:
              // widened to M into the ring (K and V) or, for 8-bit products, K's bytes as
              // they are into the ring (by bulk copies: cp.async put them there) and V's
              // rows that hold no key zeroed in the raw stage (P is 0 there and 0 * a stale
              // NaN would be NaN), for the transpose below.
              const unsigned rv_s =
                  raw_s + (g & 1) * 2 * Geo::kRawTileBytes + Geo::kRawTileBytes;
#pragma unroll
              for (int pass = 0; pass < kPasses; ++pass) {
                const unsigned t = pass * kRowsPerPass + trow;
#pragma unroll
                for (int i = 0; i < kRawPer; ++i) {
                  const int c = c0 + 8 * i;
                  if (kRawChunks % 8 != 0 && c >= kRawChunks) break;
                  if constexpr (kFp8Mma) {
                    if (phys[pass] >= 0) {
                      if (!bulk) continue;
                      const uint4 x = *reinterpret_cast<const uint4*>(rk + t * HEAD_SIZE + c * 16);
                      st_shared_v4(ks + sw128_offset8(t, c * 16, TILE_N), x);
                    } else {
                      st_shared_zero16(rv_s + t * HEAD_SIZE + c * 16);
                    }
                    continue;
                  }
                  // 16-bit chunks 2c and 2c + 1 of row t, swizzled (sm90.cuh)
                  const unsigned dk = sw128_offset(t, c * 16, TILE_N);
                  const unsigned dk2 = sw128_offset(t, c * 16 + 8, TILE_N);
                  if (phys[pass] >= 0) {
                    uint4 lo, hi;
                    widen16<M, C>(*reinterpret_cast<const uint4*>(rk + t * HEAD_SIZE + c * 16),
                                  lo, hi);
                    st_shared_v4(ks + dk, lo);
                    st_shared_v4(ks + dk2, hi);
                    widen16<M, C>(*reinterpret_cast<const uint4*>(rv + t * HEAD_SIZE + c * 16),
                                  lo, hi);
                    st_shared_v4(vs + dk, lo);
                    st_shared_v4(vs + dk2, hi);
                  } else {
                    // P is 0 on these keys and 0 * a stale NaN is NaN: V reads 0 there (K
                    // need not: their scores are masked). Their raw bytes are never read.
                    st_shared_zero16(vs + dk);
                    st_shared_zero16(vs + dk2);
                  }
                }
              }
              if constexpr (kFp8Mma) {
                // V^T once every producer thread's rows are in place (sm90_fp8.cuh)
                named_bar_sync<128>(kBarProducer);
                fp8_transpose_v<HEAD_SIZE, TILE_N, 128>(rv_s, vs, tid);
                // Each thread read every thread's rows: by cp.async, the next tile's copies
                // into this raw stage come after all have read it (bulk copies wait for
                // raw_free's 128 arrivals instead).
                if (!bulk) named_bar_sync<128>(kBarProducer);
              }
              // Bulk: this thread's reads of the raw stage are done (the loads' values are
              // stored above); a copy may refill the stage once all 128 have arrived.
              if (bulk) {
                // (8-bit products: this thread's zeroing stores into the raw stage come
                // before the bulk copies that refill it: the writer fences, then arrives.)
                if constexpr (kFp8Mma) fence_async_smem();
                mbar_arrive(raw_free_bar(g & 1));
              }
              publish(stage, bad, true);
              if (more) {
                if (!bulk) {
#pragma unroll
                  for (int pass = 0; pass < kPasses; ++pass) phys[pass] = phys_next[pass];
                }
                bad = bad_next;
              }
            }
          };
          if (Geo::kBulk && hd.k_token == static_cast<unsigned>(HEAD_SIZE) &&
              hd.v_token == static_cast<unsigned>(HEAD_SIZE)) {
            span_tiles(true);
          } else {
            span_tiles(false);
          }
        }
        if (sp.n_tiles <= 1) load_q();
      }
      }
    }
    cp_async_wait<0>();
    return;
  }

  // ---- consumers --------------------------------------------------------------------------
  setmaxnreg_inc<Regs::kConsumer>();
  const int wg = warp / 4 - 1;
  const int ctid = tid - 128 * (wg + 1);
  const int cwarp = ctid >> 5;
  const unsigned q_wg = q_s + wg * Geo::kWgQBytes;
  const int d0 = wg * Geo::kWgDimStep;  // this consumer's first dim (of K's, V's and O's)
  const int frag_row = lane >> 2;
  const int frag_col = (lane & 3) * 2;
  // An fp8 cache's per-tensor scales: k's multiplies the scores, v's the output. (A query
  // converted to float16 multiplies each row's scores by its row's p on top: sc below.)
  float score_scale = scale_log2;
  float out_scale = 1.f;
  if constexpr (Geo::kQuant) {
    score_scale *= tensor_k_scale(kv);
    out_scale = tensor_v_scale(kv);
  }

  float s[TILE_N / 2];  // S of 64 rows x TILE_N keys: s[4n + i] is mma's C fragment i of n8 tile n
#pragma unroll
  for (int i = 0; i < TILE_N / 2; ++i) s[i] = 0.f;
  // P as wgmma's register A fragments, per k16 step (8-bit products: per k32 step)
  unsigned pa[kFp8Mma ? TILE_N / 32 : TILE_N / 16][4];
  float o[Geo::kOChunks][Geo::kOCols / 2];

  unsigned g = 0;
  unsigned j = 0;
  // Turns at the tensor cores (kSplitO: none; the consumers work on the same tiles in step)
  auto turn_wait = [&]() {
    if constexpr (!Geo::kSplitO) consumer_turn_wait(wg);
  };
  auto turn_pass = [&]() {
    if constexpr (!Geo::kSplitO) consumer_turn_pass(wg);
  };
  if (wg == 1) turn_pass();  // the first turn is consumer 0's
  for (long long k = 0, w = job_index(0); w < num_jobs; w = job_index(++k)) {
    const Job jb = job_of(w);
    for (int half = 0; half < 2; ++half) {
    const int rank = half == 0 ? jb.d : ranks - 1 - jb.d;
    if (half == 1 && rank == jb.d) break;
    for (int qt = jb.q_tiles - 1 - rank; qt >= 0; qt -= ranks, ++j) {
      const Span sp = span_of(jb, qt);
      const int row0 = qt * Geo::kRows + wg * Geo::kWgRowStep;  // this warpgroup's first row
      // Both consumers compute every tile of the job (a tile past one's causal limits or
      // before its window is masked whole), so their turns at the tensor cores pair up.
      const int n = sp.n_tiles;
      // The factor of each row's raw scores (h: C-fragment rows lane / 4 and + 8):
      // score_scale, times the row's p where the query is converted to float16.
      float sc[2] = {score_scale, score_scale};
      if constexpr (kQueryToHalf) {
        // Once a Q tile load (the producer rewrites the tile only after q_empty), before
        // the job's other registers are live: to float16, each row's p into sc.
        mbar_wait(q_full_bar(wg), j & 1);
        if (n > 0) {
          float p[2];
          query_rows_to_half<T, HEAD_SIZE>(q_wg, cwarp, lane, p);
          sc[0] = score_scale * p[0];
          sc[1] = score_scale * p[1];
          fence_async_smem();  // ordinary stores that wgmma reads next
          named_bar_sync<128>(kBarQueryHalf + wg);
        }
      }

      // Per-row constants of this thread's two rows (h: C-fragment rows lane / 4 and + 8).
      int q_pos[2], limit[2], first[2];
      float slope[2];
      int lim_lo = 0x7fffffff, first_hi = 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = row0 + cwarp * 16 + frag_row + h * 8;
        q_pos[h] = jb.q_shift + p / group_size;
        limit[h] = p >= jb.packed ? 0
                   : causal       ? max(0, min(jb.seq_len, q_pos[h] + 1))
                                  : jb.seq_len;
        first[h] = Var::first_key(vp, q_pos[h]);
        const int head = jb.kv_head * group_size + p % group_size;
        slope[h] = (alibi_slopes != nullptr && p < jb.packed) ? alibi_slopes[head] * kLog2e : 0.f;
        lim_lo = min(lim_lo, limit[h]);
        if (p < jb.packed) first_hi = max(first_hi, first[h]);
      }
      lim_lo = __reduce_min_sync(~0u, lim_lo);  // this warp's tiles below it need no mask
      if constexpr (Var::kWindow) first_hi = __reduce_max_sync(~0u, first_hi);
      const bool plain = Var::kAlibi || alibi_slopes == nullptr;

      float m_run[2] = {neg_inf(), neg_inf()};
      float l_run[2] = {0.f, 0.f};
#pragma unroll
      for (int c = 0; c < Geo::kOChunks; ++c) {
#pragma unroll
        for (int i = 0; i < Geo::kOCols / 2; ++i) o[c][i] = 0.f;
      }
      bool bad = false;

      // Tile `it`'s stage once its copies landed (and the bad-block flag it carries).
      auto acquire = [&](int it) {
        const unsigned gi = g + it;
        mbar_wait(full_bar(gi % STAGES), (gi / STAGES) & 1);
        fence_async_smem();  // cp.async's writes, read next by wgmma
        // (An ordinary load: the mbarrier wait's memory clobber keeps it after the wait.)
        const int4 f = *reinterpret_cast<const int4*>(smem + Geo::kOffFlags + (gi % STAGES) * 16);
        bad |= (f.x | f.y | f.z | f.w) != 0;
      };
      auto release = [&](int it) { mbar_arrive(empty_bar((g + it) % STAGES)); };
      auto issue_s = [&](int it) {
        const unsigned ks = k_s + ((g + it) % STAGES) * Geo::kTileBytes;
        if constexpr (kFp8Mma) {  // k32 steps of bytes: descriptor columns of 16 bits
#pragma unroll
          for (int kk = 0; kk < HEAD_SIZE / 32; ++kk) {
            Wgmma<Q, TILE_N, 0>::ss(s, kmajor_desc(q_wg, kk * 16, Geo::kWgRows),
                                    kmajor_desc(ks, kk * 16, TILE_N), kk > 0);
          }
        } else {
#pragma unroll
          for (int kk = 0; kk < Geo::kWgDims / 16; ++kk) {
            Wgmma<M, TILE_N, 0>::ss(s, kmajor_desc(q_wg, kk * 16, Geo::kWgRows),
                                    kmajor_desc(ks, d0 + kk * 16, TILE_N), kk > 0);
          }
        }
        wgmma_commit();
      };
      // kSplitO: S over this consumer's dims plus the other's partial (through shared
      // memory, in the tile's parity slot: the barrier of the tile after it orders the
      // other's reads before this consumer's next write there); then both hold the sums.
      auto add_partials = [&](int it) {
        if constexpr (Geo::kSplitO) {
          constexpr int kX4 = TILE_N / 8;  // float4s of a thread's scores
          float4* x = reinterpret_cast<float4*>(smem + Geo::kOffX) +
                      ((g + it) & 1) * 2 * kX4 * 128;
#pragma unroll
          for (int i = 0; i < kX4; ++i) {
            x[(wg * kX4 + i) * 128 + ctid] =
                make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
          }
          named_bar_sync<256>(kBarScores);
#pragma unroll
          for (int i = 0; i < kX4; ++i) {
            const float4 v = x[((1 - wg) * kX4 + i) * 128 + ctid];
            s[4 * i] += v.x;
            s[4 * i + 1] += v.y;
            s[4 * i + 2] += v.z;
            s[4 * i + 3] += v.w;
          }
        }
      };
      auto both_issued_s = [&]() {
        if constexpr (Geo::kSplitO) named_bar_sync<256>(kBarIssued);
      };
      // O += P V over the whole tile (V is zero past the keys: a data-dependent exit from
      // this loop would make ptxas serialize every wgmma of the kernel).
      auto issue_pv = [&](int it) {
        const unsigned vs = v_s + ((g + it) % STAGES) * Geo::kTileBytes;
        if constexpr (kFp8Mma) {  // V^T (bytes, keys in fp8_k_column's order): K-major B
#pragma unroll
          for (int kk = 0; kk < TILE_N / 32; ++kk) {
#pragma unroll
            for (int c = 0; c < Geo::kOChunks; ++c) {
              Wgmma<Q, Geo::kOCols, 0>::rs(
                  o[c], pa[kk], kmajor_desc(vs + c * Geo::kOCols * 128, kk * 16, HEAD_SIZE), 1);
            }
          }
        } else {
#pragma unroll
          for (int kk = 0; kk < TILE_N / 16; ++kk) {
#pragma unroll
            for (int c = 0; c < Geo::kOChunks; ++c) {
              if constexpr (kVllm) {  // V dim-major: K-major B, rows = dims
                Wgmma<M, Geo::kOCols, 0>::rs(
                    o[c], pa[kk], kmajor_desc(vs + c * Geo::kOCols * 128, kk * 16, HEAD_SIZE), 1);
              } else {
                Wgmma<M, Geo::kOCols, 1>::rs(
                    o[c], pa[kk], mnmajor_desc(vs, kk * 16, d0 + c * Geo::kOCols, TILE_N), 1);
              }
            }
          }
        }
        wgmma_commit();
      };
      // Scale (ALiBi, masks where needed) and exponentiate tile t0's scores in place;
      // returns O's rescale factors (1, 1 when no maximum moved).
      auto softmax = [&](int t0, float (&alpha)[2]) {
        const bool masked = !plain || t0 + TILE_N > lim_lo || (Var::kWindow && t0 < first_hi);
        float tmax[2] = {neg_inf(), neg_inf()};
        float mul[2] = {1.f, 1.f};  // of each row's scores in exp2's argument: 1 once logits
        if (masked) {
#pragma unroll
          for (int n = 0; n < TILE_N / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int h = i >> 1;
              const int key = t0 + n * 8 + frag_col + (i & 1);
              float& x = s[4 * n + i];
              const float v = Var::kFixedOffset
                                  ? Var::fixed_exponent(vp, x, sc[h])
                                  : fmaf(slope[h], static_cast<float>(key - q_pos[h]),
                                         Var::logits(vp, x, sc[h]));
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
                       Var::logits_plus(vp, x, sc[h], base_h[h]));
              tmax[h] = fmaxf(tmax[h], x);
            }
          }
        } else if constexpr (!Var::kSoftCap && !Var::kFixedOffset) {
          // Plain scores: the maximum of the raw products (the minimum for a negative
          // scale) times the scale, and the scale folded into exp2's argument below (one
          // FFMA a score instead of a multiply and a subtraction). A row's p is positive:
          // sc[h] has score_scale's sign.
          mul[0] = sc[0];
          mul[1] = sc[1];
          if (score_scale >= 0.f) {
#pragma unroll
            for (int i = 0; i < TILE_N / 2; ++i) tmax[(i >> 1) & 1] = fmaxf(tmax[(i >> 1) & 1], s[i]);
          } else {
            tmax[0] = tmax[1] = __int_as_float(0x7f800000);
#pragma unroll
            for (int i = 0; i < TILE_N / 2; ++i) tmax[(i >> 1) & 1] = fminf(tmax[(i >> 1) & 1], s[i]);
          }
          tmax[0] *= sc[0];
          tmax[1] *= sc[1];
          // The folded FFMA subtracts the rounded maximum from exact products, so it errs
          // by up to half an ulp of the maximum: 2^-12 at 2^12 (log2 units), exp2 of
          // thousands (inf) past 2^31. A warp with a row that large (logits absurd in
          // practice, but finite) rounds its scores first, as the other paths do, so its
          // largest score gives exp2(0) = 1 exactly. A warp-uniform branch, as `masked`.
          if (__any_sync(~0u, fabsf(tmax[0]) >= 4096.f || fabsf(tmax[1]) >= 4096.f)) {
            tmax[0] = tmax[1] = neg_inf();
#pragma unroll
            for (int i = 0; i < TILE_N / 2; ++i) {
              s[i] *= sc[(i >> 1) & 1];
              tmax[(i >> 1) & 1] = fmaxf(tmax[(i >> 1) & 1], s[i]);
            }
            mul[0] = mul[1] = 1.f;
          }
        } else {
#pragma unroll
          for (int n = 0; n < TILE_N / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              float& x = s[4 * n + i];
              x = Var::kFixedOffset ? Var::fixed_exponent(vp, x, sc[i >> 1])
                                    : Var::logits(vp, x, sc[i >> 1]);
              tmax[i >> 1] = fmaxf(tmax[i >> 1], x);
            }
          }
        }
        float sub[2] = {0.f, 0.f};
        alpha[0] = alpha[1] = 1.f;
        if constexpr (!Var::kFixedOffset) advance_fragment_rows(tmax, m_run, l_run, sub, alpha);
        if constexpr (kFp8Mma) {
          // 8-bit P: weights of 2^8 exp2(x - m), in (0, 256] (e4m3 holds 448), so that
          // e4m3 keeps them normal down to 2^-14 of the maximum and nonzero down to 2^-17
          // (2^-6 and 2^-9 without); l_run carries the factor too, which the end removes
          // through the row's m.
          sub[0] -= 8.f;
          sub[1] -= 8.f;
        }
#pragma unroll
        for (int n = 0; n < TILE_N / 8; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            s[4 * n + i] = fast_exp2(fmaf(s[4 * n + i], mul[i >> 1], -sub[i >> 1]));
          }
          l_run[0] += s[4 * n + 0] + s[4 * n + 1];
          l_run[1] += s[4 * n + 2] + s[4 * n + 3];
        }
      };
      auto rescale_o = [&](const float (&alpha)[2]) {
        if (!Var::kFixedOffset && __any_sync(~0u, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
          for (int c = 0; c < Geo::kOChunks; ++c) {
#pragma unroll
            for (int jj = 0; jj < Geo::kOCols / 8; ++jj) {
              o[c][4 * jj + 0] *= alpha[0];
              o[c][4 * jj + 1] *= alpha[0];
              o[c][4 * jj + 2] *= alpha[1];
              o[c][4 * jj + 3] *= alpha[1];
            }
          }
        }
      };
      // P = the exponentiated S rounded to M, as register A fragments: k-step n / 2 takes
      // regs 0, 1 from n8 tile 2j (rows, rows + 8) and 2, 3 from tile 2j + 1.
      auto pack_p = [&]() {
        if constexpr (kFp8Mma) {  // rounded to Q, keys in fp8_k_column's order
#pragma unroll
          for (int c = 0; c < TILE_N / 32; ++c) fp8_a_fragment<Q>(s, c, pa[c]);
        } else {
#pragma unroll
          for (int n = 0; n < TILE_N / 8; ++n) {
            pa[n / 2][(n & 1) * 2 + 0] = pack2<M>(s[4 * n + 0], s[4 * n + 1]);
            pa[n / 2][(n & 1) * 2 + 1] = pack2<M>(s[4 * n + 2], s[4 * n + 3]);
          }
        }
      };

      if constexpr (!kQueryToHalf) {
        mbar_wait(q_full_bar(wg), j & 1);
        fence_async_smem();
      }
      // The fence_regs around each wgmma fence and wait tie the registers an asynchronous
      // wgmma owns (S and O as accumulators, P as the A operand) to those points, so no
      // other register work on them moves into its flight.
      if (n > 0) {
        acquire(0);
        turn_wait();
        fence_regs(s);
        fence_regs(o);
        wgmma_fence();
        issue_s(0);
        turn_pass();
        wgmma_wait<0>();
        fence_regs(s);
        if (n == 1) mbar_arrive(q_empty_bar(wg));  // its last read of Q
        add_partials(0);
        float alpha[2];
        softmax(sp.tile_base * TILE_N, alpha);
        pack_p();
        for (int it = 1; it < n; ++it) {
          acquire(it);
          turn_wait();
          fence_regs(s);
          fence_regs(o);
          fence_regs(pa);
          wgmma_fence();
          issue_s(it);
          both_issued_s();
          issue_pv(it - 1);
          turn_pass();
          wgmma_wait<1>();  // S of tile it; tile it - 1's P V still runs
          fence_regs(s);
          if (it + 1 == n) mbar_arrive(q_empty_bar(wg));
          add_partials(it);
          softmax((sp.tile_base + it) * TILE_N, alpha);
          wgmma_wait<0>();
          fence_regs(o);
          fence_regs(pa);
          release(it - 1);
          rescale_o(alpha);
          pack_p();
        }
        turn_wait();
        fence_regs(o);
        fence_regs(pa);
        wgmma_fence();
        issue_pv(n - 1);
        turn_pass();
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(pa);
        release(n - 1);
      } else {
        mbar_arrive(q_empty_bar(wg));
      }
      g += n;

      // ---- normalize and store ------------------------------------------------------------
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float l = quad_sum(l_run[h]);
        const int p = row0 + cwarp * 16 + frag_row + h * 8;
        if (p >= jb.packed) continue;
        // A row that saw no key (an empty sequence's, or one before every cached token)
        // gets zeros, never 0 / 0; a sink joins the denominator.
        const int head = jb.kv_head * group_size + p % group_size;
        const long long orow =
            static_cast<long long>(jb.q_begin + p / group_size) * num_heads + head;
        // (8-bit P: its weights carry 2^8, l with them; m - 8 is the maximum they are
        // relative to, for the lse, the sinks and the partials' merge.)
        const float m = !Var::kFixedOffset ? (kFp8Mma ? m_run[h] - 8.f : m_run[h])
                        : l == 0.f         ? neg_inf()
                                           : Var::fixed_offset(vp);
        // The row's lse or max and sum: one thread a row (kSplitO: of consumer 0; the
        // other holds the same)
        const bool row_writer = (lane & 3) == 0 && (!Geo::kSplitO || wg == 0);
        if (split_tiles > 0) {
          // A partial: its normalized output, max and sum (the combine adds the sink and
          // writes the lse); NaN throughout for a bad block.
          const long long prow = orow * gridDim.z + blockIdx.z;
          const float inv = end_partial_row(m, l, bad, out_scale, prow, part_max, part_sum,
                                            row_writer);
          float* dst = part_out + prow * HEAD_SIZE + d0;
#pragma unroll
          for (int c = 0; c < Geo::kOChunks; ++c) {
#pragma unroll
            for (int jj = 0; jj < Geo::kOCols / 8; ++jj) {
              *reinterpret_cast<float2*>(dst + c * Geo::kOCols + jj * 8 + frag_col) =
                  make_float2(o[c][4 * jj + 2 * h] * inv, o[c][4 * jj + 2 * h + 1] * inv);
            }
          }
          continue;
        }
        const float inv = end_whole_row(vp, m, l, bad, out_scale, sink_log2(vp, head), orow,
                                        row_writer);
        T* dst = out + orow * HEAD_SIZE + d0;
#pragma unroll
        for (int c = 0; c < Geo::kOChunks; ++c) {
#pragma unroll
          for (int jj = 0; jj < Geo::kOCols / 8; ++jj) {
            *reinterpret_cast<unsigned*>(dst + c * Geo::kOCols + jj * 8 + frag_col) =
                pack2<T>(o[c][4 * jj + 2 * h] * inv, o[c][4 * jj + 2 * h + 1] * inv);
          }
        }
      }
    }
    }
  }
}

}  // namespace cupaged
