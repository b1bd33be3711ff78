// DeepSeek-V3.2's lightning indexer (DSA): the logits of each query token over its
// sequence's cached keys, read from the indexer's fp8 paged cache (cache_ops.cuh's
// indexer_k_quant_and_cache writes it), on tensor cores (mma.sync, sm_80+). DeepGEMM's
// fp8_paged_mqa_logits; cupaged.reference.indexer_logits is the statement of the result:
//
//   logits[row, j] = sum_h weights[row, h] * relu(q[row, h] . key_j),  key_j = e4m3 * scale_j
//
// for the keys j <= pos(row) (pos = seq_len - next_n + row % next_n, the row's place in its
// sequence seq = row / next_n), -inf for every other column of [0, width).
//
//   q        [rows, HEADS, 128] of T (an fp8 query is passed as its values, its scale in
//            the weights, as the model does); weights [rows, HEADS] float32
//   cache    [num_blocks, BLOCK_SIZE, 132] bytes: a block's e4m3 values token-major, then
//            its float32 scales, one a token (quant_block_size 128)
//   out      [rows, width] float32
//
// Work split: one CTA per (group of up to ROWS rows of one sequence, chunk of kChunk
// columns); HEADS / 16 warps, warp w the heads 16 w .. 16 w + 15 of S^T = K Q^T over
// 64-token tiles, keys as the mma's M (16 a fragment) and heads as its N (its Q
// fragments, every row's, loaded once). The rows of a group share each tile's copy,
// widening and key fragments (a sequence's next_n query tokens read the same keys).
// The products run in float16 whatever T is: a tile's keys land by cp.async in a ring of
// two raw stages and are widened to float16 (one conversion a pair; exact: e4m3 values
// are all representable), and a bfloat16 query is scaled by a power of two into
// float16's range (exact but for values below 2^-31 of the warp's largest, far below
// the fp32 sums' rounding, when that largest is 2^-86 or more: float16_range_shift
// scales by 2^100 at most), its inverse joining the weights. A thread's accumulators
// hold two keys and two heads of each 8, so a column's sum over the warp's heads is two
// shuffles; over the warps it goes through shared memory, then is scaled by the key's
// scale (positive, so relu commutes with it). A block id outside the cache is never
// dereferenced: its columns come back NaN.
#pragma once
#include "common.cuh"
#include "fp8.cuh"
#include "mma.cuh"

namespace cupaged {

constexpr int kIndexerDim = 128;   // the indexer's head_dim (DeepSeek-V3.2's)
constexpr int kIndexerTile = 64;   // keys a tile
constexpr int kIndexerChunk = 1024; // columns a CTA

template <typename T, int HEADS, int ROWS>
struct IndexerGeometry {
  static constexpr int kWarps = HEADS / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRow = kIndexerDim + 8;  // T elements: rows padded by 16 bytes
  static constexpr int kOffQ = 0;  // ROWS query rows of HEADS heads
  static constexpr int kOffWide = kOffQ + ROWS * HEADS * kRow * 2;
  static constexpr int kOffRaw = kOffWide + kIndexerTile * kRow * 2;  // two raw stages
  static constexpr int kOffScale = kOffRaw + 2 * kIndexerTile * kIndexerDim;
  static constexpr int kOffFlag = kOffScale + 2 * kIndexerTile * 4;   // per key: 0/1/2
  static constexpr int kOffRed = kOffFlag + 2 * kIndexerTile * 4;
  static constexpr int kSmemBytes = kOffRed + ROWS * kWarps * kIndexerTile * 4;
  static_assert(HEADS % 16 == 0 && HEADS >= 16 && HEADS <= 64, "HEADS: 16 to 64");
  static_assert(ROWS == 1 || ROWS == 2, "ROWS: 1 or 2 query rows a CTA");
  static_assert(sizeof(T) == 2, "16-bit queries");
};

// f(register, its two values) for each register of a row's query fragments (pairs of T).
template <typename T, int K, typename F>
__device__ __forceinline__ void each_pair(unsigned (&frag)[K][4], F&& f) {
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float lo, hi;
      unpack2(frag[kk][i], lo, hi, T{});
      f(frag[kk][i], lo, hi);
    }
  }
}

template <typename T, int HEADS, int BLOCK_SIZE, int ROWS>
__global__ void __launch_bounds__(IndexerGeometry<T, HEADS, ROWS>::kThreads)
    indexer_logits(float* __restrict__ out, long long out_stride, int width,
                   const T* __restrict__ q, long long q_row_stride, long long q_head_stride,
                   const float* __restrict__ weights, long long w_stride,
                   const unsigned char* __restrict__ cache, long long block_stride,
                   int num_blocks, const int* __restrict__ block_tables, long long bt_stride,
                   int max_blocks, const int* __restrict__ seq_lens, int next_n) {
  using Geo = IndexerGeometry<T, HEADS, ROWS>;
  constexpr int TILE = kIndexerTile;
  constexpr int D = kIndexerDim;
  constexpr int ROW = Geo::kRow;
  static_assert(BLOCK_SIZE >= 4 && BLOCK_SIZE <= 256 && (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0,
                "BLOCK_SIZE: a power of two from 4 to 256");

  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem + Geo::kOffQ);
  T* wide_s = reinterpret_cast<T*>(smem + Geo::kOffWide);
  float* scale_s = reinterpret_cast<float*>(smem + Geo::kOffScale);
  int* flag_s = reinterpret_cast<int*>(smem + Geo::kOffFlag);
  float* red_s = reinterpret_cast<float*>(smem + Geo::kOffRed);
  const unsigned raw_addr = static_cast<unsigned>(__cvta_generic_to_shared(smem + Geo::kOffRaw));

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  if (tid == 0 && dynamic_smem_bytes() < static_cast<unsigned>(Geo::kSmemBytes)) __trap();
  // this CTA's rows: row0 .. row0 + nrows - 1, tokens t0 .. of sequence seq
  const int groups = (next_n + ROWS - 1) / ROWS;
  const int seq = blockIdx.x / groups;
  const int t0 = (blockIdx.x % groups) * ROWS;
  const int nrows = ROWS == 1 ? 1 : min(ROWS, next_n - t0);
  const int row0 = seq * next_n + t0;
  const int seq_len = max(0, min(seq_lens[seq], max_blocks * BLOCK_SIZE));
  // the keys row r of the group sees (its last row sees the most)
  auto reach = [&](int r) { return max(0, min(seq_len, seq_len - next_n + t0 + r + 1)); };
  const int col0 = blockIdx.y * kIndexerChunk;
  const int col_end = min(width, col0 + kIndexerChunk);
  const int key_end = min(reach(nrows - 1), col_end);  // keys this CTA reads
  // Columns no key of the rows fills: -inf (those of a row's reach below key_end are
  // written with the tiles).
  for (int r = 0; r < nrows; ++r) {
    float* out_row = out + (row0 + r) * out_stride;
    for (int c = max(col0, key_end) + tid; c < col_end; c += Geo::kThreads) out_row[c] = neg_inf();
  }
  if (key_end <= col0) return;
  const int n_tiles = (key_end - col0 + TILE - 1) / TILE;
  const int* bt_row = block_tables + seq * bt_stride;

  // The rows' queries (HEADS x 128 each) into shared memory (a group's missing second
  // row, zeros), a copy group ahead of the first tile's.
  for (int u = tid; u < ROWS * HEADS * (D / 8); u += Geo::kThreads) {
    const int r = u / (HEADS * (D / 8)), h = u / (D / 8) % HEADS, c = u % (D / 8);
    const bool real = r < nrows;
    cp_async16_or_zero(
        static_cast<unsigned>(__cvta_generic_to_shared(q_s + (r * HEADS + h) * ROW + c * 8)),
        q + (real ? (row0 + r) * q_row_stride + h * q_head_stride + c * 8 : 0), real);
  }
  // A tile: threads 2 k and 2 k + 1 copy key k's 128 bytes (four 16-byte chunks each); the
  // even one its scale and flag (0: past the row's keys, 1: copied, 2: a bad block id).
  auto load_tile = [&](int tile, int stage) {
    for (int k = tid / 2; k < TILE; k += Geo::kThreads / 2) {
      const int key = col0 + tile * TILE + k;
      int flag = 0;
      const unsigned char* src = cache;
      if (key < key_end) {
        const int block = __ldg(bt_row + key / BLOCK_SIZE);
        flag = static_cast<unsigned>(block) < static_cast<unsigned>(num_blocks) ? 1 : 2;
        if (flag == 1) src = cache + block * block_stride;
      }
      const int within = key % BLOCK_SIZE;
      const unsigned dst = raw_addr + (stage * TILE + k) * D;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = (tid % 2) * 4 + j;
        cp_async16_or_zero(dst + c * 16, src + within * D + c * 16, flag == 1);
      }
      if (tid % 2 == 0) {
        flag_s[stage * TILE + k] = flag;
        if (flag == 1) cp_async4(scale_s + stage * TILE + k, src + BLOCK_SIZE * D + within * 4);
      }
    }
  };

  cp_async_commit();
  load_tile(0, 0);
  cp_async_commit();
  // This lane's weights, each row's: heads 16 w + 8 nt + 2 (lane % 4) + j of the N tiles
  // nt (times the inverse of the row's query scale, below).
  float wt[ROWS][2][2];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int wr = row0 + min(r, nrows - 1);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        wt[r][nt][j] = weights[wr * w_stride + 16 * warp + 8 * nt + 2 * (lane & 3) + j];
      }
    }
  }
  // Q^T as the B operand, float16: qb[r][kk] holds both N tiles' registers of k-step kk.
  unsigned qb[ROWS][D / 16][4];
  cp_async_wait<1>();
  __syncthreads();  // the query landed (the first tile may still be in flight)
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      ldmatrix_x4(qb[r][kk], q_s + (r * HEADS + 16 * warp + (lane & 7) + (lane >> 4) * 8) *
                                      ROW + kk * 16 + ((lane >> 3) & 1) * 8);
    }
    if constexpr (!is_same<T, half_t>::value) {
      // 2^s takes the warp's largest finite magnitude into [2^14, 2^15); none (all
      // zeros, or no finite value) keeps s = 0
      float amax = 0.f;
      each_pair<T>(qb[r], [&](unsigned, float lo, float hi) {
        amax = finite_amax(finite_amax(amax, lo), hi);
      });
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
      const int sh = float16_range_shift(amax);  // in [-113, 100]
      const float mul = __int_as_float((127 + sh) << 23);  // 2^sh and 2^-sh: normal
      const float inv = __int_as_float((127 - sh) << 23);
      each_pair<T>(qb[r], [&](unsigned& w, float lo, float hi) {
        w = pack2<half_t>(lo * mul, hi * mul);
      });
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) wt[r][nt][j] *= inv;
      }
    }
  }
  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile it landed; every read of tile it - 1 is done
    // the next tile flies during this one's work (its stage's flags and scales were last
    // read before the barrier above)
    if (it + 1 < n_tiles) load_tile(it + 1, stage ^ 1);
    cp_async_commit();
    // widen the tile to float16: 8 e4m3 values a thread a step (8 threads write 128
    // contiguous bytes: no bank conflict), zeros staying zeros
    const unsigned char* raw = smem + Geo::kOffRaw + stage * TILE * D;
    for (int u = tid; u < TILE * (D / 8); u += Geo::kThreads) {
      const int k = u / (D / 8), c = u % (D / 8);
      const uint2 v = *reinterpret_cast<const uint2*>(raw + k * D + c * 8);
      uint4 w;
      w.x = fp8x2_to<half_t, fp8_e4m3_t>(v.x & 0xffffu);
      w.y = fp8x2_to<half_t, fp8_e4m3_t>(v.x >> 16);
      w.z = fp8x2_to<half_t, fp8_e4m3_t>(v.y & 0xffffu);
      w.w = fp8x2_to<half_t, fp8_e4m3_t>(v.y >> 16);
      *reinterpret_cast<uint4*>(wide_s + k * ROW + c * 8) = w;
    }
    __syncthreads();  // the widened tile is complete

    // relu keeps a NaN, as the reference's and torch's do: fmaxf would drop it, and top-k
    // could then pick its column
    auto relu = [](float x) { return x < 0.f ? 0.f : x; };
#pragma unroll 1
    for (int mt = 0; mt < TILE / 16; ++mt) {
      // S^T for 16 keys x this warp's 16 heads, each row's
      float s[ROWS][2][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        unsigned ka[4];
        ldmatrix_x4(ka, wide_s + (mt * 16 + (lane & 15)) * ROW + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r >= nrows) break;  // (the same for the whole CTA)
          const unsigned b0[2] = {qb[r][kk][0], qb[r][kk][1]};
          const unsigned b1[2] = {qb[r][kk][2], qb[r][kk][3]};
          mma_16816<half_t>(s[r][0], ka, b0);
          mma_16816<half_t>(s[r][1], ka, b1);
        }
      }
      // keys mt * 16 + lane / 4 (accumulators 0, 1) and that + 8 (2, 3): w * relu(s) over
      // the lane's heads, then over the four lanes that share its keys
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r >= nrows) break;
        float ca = 0.f, cb = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          ca += wt[r][nt][0] * relu(s[r][nt][0]) + wt[r][nt][1] * relu(s[r][nt][1]);
          cb += wt[r][nt][0] * relu(s[r][nt][2]) + wt[r][nt][1] * relu(s[r][nt][3]);
        }
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
          ca += __shfl_xor_sync(~0u, ca, o);
          cb += __shfl_xor_sync(~0u, cb, o);
        }
        if ((lane & 3) == 0) {
          float* red = red_s + (r * Geo::kWarps + warp) * TILE + mt * 16 + (lane >> 2);
          red[0] = ca;
          red[8] = cb;
        }
      }
    }
    __syncthreads();  // every warp's column sums
    for (int u = tid; u < nrows * TILE; u += Geo::kThreads) {
      const int r = ROWS == 1 ? 0 : u / TILE, k = ROWS == 1 ? u : u % TILE;
      const int col = col0 + it * TILE + k;
      if (col >= col_end) continue;
      const int flag = col < reach(r) ? flag_s[stage * TILE + k] : 0;
      float v = neg_inf();  // a key past this row's reach, or past every row's
      if (flag == 1) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < Geo::kWarps; ++w) sum += red_s[(r * Geo::kWarps + w) * TILE + k];
        v = sum * scale_s[stage * TILE + k];
      } else if (flag == 2) {
        v = __int_as_float(0x7fc00000);  // a bad block id: NaN
      }
      out[(row0 + r) * out_stride + col] = v;
    }
  }
  cp_async_wait<0>();
}

// ---- the top-k of each row's logits -----------------------------------------------------------
//
// indexer_topk: out[row, :] = the columns of the row's topk largest finite logits, largest
// first, ties by the lower column, -1 after the finite ones run out
// (cupaged.reference.indexer_topk). One CTA of kTopkThreads per row:
//   1. each logit as an order-preserving 32-bit key (finite ones from 1 up, -0 as +0;
//      -inf, +inf and NaN 0: never picked);
//   2. the k-th largest key by radix select from the top. The first digit is the key's
//      top 12 bits (about the sign, the exponent and 3 mantissa bits: a float's top byte
//      is mostly its exponent, which logits of one magnitude share), counted over every
//      finite key in one pass over the row, which also counts them, so k = min(topk,
//      that count). A second pass
//      takes the keys above the k-th's bin and, when that bin holds at most
//      kTopkCandidates keys, keeps them in shared memory, counting their next digit; the
//      other digits (8, 8 and 4 bits) are then counted there. A bin larger than that is
//      counted in passes over the row instead (many keys of one first digit);
//   3. the keys above the k-th, and of those equal to it the lowest columns, into shared
//      memory. When the row holds exactly as many keys equal to it as are taken (no
//      tie is cut: the common case), they join the keys above it in the same pass;
//      otherwise the lowest columns come from a scan of the row in column order;
//   4. a bitonic sort of (key, ~column) descending, then the columns out.
// A CTA a row leaves one CTA on an SM, so each pass over the row is bound by load latency:
// a thread issues kTopkUnroll loads before it uses any, and the passes over the row are
// two where the k-th's first-digit bin fits in shared memory, five otherwise.
constexpr int kTopkThreads = 512;
constexpr int kTopkMax = 2048;  // the largest topk (DeepSeek-V3.2's)
constexpr int kTopkUnroll = 8;
constexpr int kTopkStep = kTopkThreads * kTopkUnroll;  // columns a CTA-wide step
constexpr int kTopkTopBits = 12;                       // the first radix digit
constexpr int kTopkTopBins = 1 << kTopkTopBits;
// Keys of the k-th's first-digit bin kept in shared memory, (key, ~column), in the room
// the first digit's histogram used: as many as keep the CTA's static shared memory under
// 48 KB (a long row's bin can exceed 2048: every row of a launch must fit, or the launch
// takes the slowest row's five passes)
constexpr int kTopkCandidates = 3840;
static_assert(kTopkTopBins % kTopkThreads == 0, "a CTA's threads split the first digit's bins");

__device__ __forceinline__ unsigned topk_key(float x) {
  if (!(fabsf(x) <= 3.402823466e38f)) return 0u;  // -inf, +inf, NaN
  const unsigned b = x == 0.f ? 0u : __float_as_uint(x);
  return ((b & 0x80000000u) ? ~b : (b | 0x80000000u)) + 1u;  // finite ones: 1 and up
}

// The keys of columns c0 + j * kTopkThreads + tid, j < kTopkUnroll (0 past the width).
__device__ __forceinline__ void topk_keys(unsigned (&key)[kTopkUnroll],
                                          const float* __restrict__ row, int c0, int width,
                                          int tid) {
  float x[kTopkUnroll];
#pragma unroll
  for (int j = 0; j < kTopkUnroll; ++j) {
    const int c = c0 + j * kTopkThreads + tid;
    x[j] = c < width ? __ldg(row + c) : __int_as_float(0x7fc00000);  // NaN: key 0
  }
#pragma unroll
  for (int j = 0; j < kTopkUnroll; ++j) key[j] = topk_key(x[j]);
}

// Of PER bins v (v[0] the top one) holding keys `above`+1 .. `above`+sum from the top, the
// one that holds the want-th largest (above < want <= above + sum): its index in v, the
// keys in the bins above it (before) and in it (in_bin).
template <int PER>
__device__ __forceinline__ int topk_bin_of(const int (&v)[PER], int above, int want,
                                           int& before, int& in_bin) {
  int i = 0;
  before = above;
  in_bin = v[0];
#pragma unroll
  for (int j = 0; j < PER - 1; ++j) {  // (a fixed loop: v stays in registers)
    if (i == j && before + v[j] < want) {
      before += v[j];
      i = j + 1;
      in_bin = v[j + 1];
    }
  }
  return i;
}

// One warp: the bin, from the top, of a 256-bin histogram that holds the counters[3]-th
// largest key among those it counts, into bin_s, and counters[3] less the keys in the bins
// above it; ``last``: counters[4] = the keys in that bin (those equal to the k-th). Each
// lane sums 8 bins, a shuffle scan the lanes.
__device__ __forceinline__ void topk_find_bin(const int* hist, int* counters, int& bin_s,
                                              bool last, int lane) {
  const int want = counters[3];  // read by every lane, then written by one (after __syncwarp)
  int v[8], mine = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = hist[255 - lane * 8 - i];  // lane 0 holds the top bins
    mine += v[i];
  }
  int upto = mine;  // keys in this lane's bins and the lanes' above
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(~0u, upto, o);
    if (lane >= o) upto += y;
  }
  const int above = upto - mine;
  __syncwarp();  // every lane's read of counters[3] before one lane writes it
  if (want > 0 && above < want && want <= upto) {  // exactly one lane
    int before, in_bin;
    const int i = topk_bin_of(v, above, want, before, in_bin);
    bin_s = 255 - lane * 8 - i;
    counters[3] = want - before;
    if (last) counters[4] = in_bin;
  }
}

// The whole CTA: the first digit's bin (of kTopkTopBins) that holds the k-th largest key,
// k = counters[0] = min(topk, the finite keys counted), into bin_s; counters[3] = k less
// the keys in the bins above it, counters[4] = the keys in it. Each thread sums PER bins,
// a scan over the CTA (scan_s: a warp's total). Ends with a barrier.
__device__ __forceinline__ void topk_find_top_bin(const int* hist, int* counters, int& bin_s,
                                                  int* scan_s, int topk, int tid) {
  constexpr int PER = kTopkTopBins / kTopkThreads;
  const int lane = tid & 31, warp = tid >> 5;
  int v[PER], mine = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    v[i] = hist[kTopkTopBins - 1 - tid * PER - i];  // thread 0 holds the top bins
    mine += v[i];
  }
  int upto = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(~0u, upto, o);
    if (lane >= o) upto += y;
  }
  if (lane == 31) scan_s[warp] = upto;
  __syncthreads();
  int total = 0;
#pragma unroll
  for (int w = 0; w < kTopkThreads / 32; ++w) {
    const int t = scan_s[w];
    if (w < warp) upto += t;
    total += t;
  }
  const int want = min(topk, total);
  const int above = upto - mine;
  if (want > 0 && above < want && want <= upto) {  // exactly one thread
    int before, in_bin;
    const int i = topk_bin_of(v, above, want, before, in_bin);
    bin_s = kTopkTopBins - 1 - tid * PER - i;
    counters[3] = want - before;
    counters[4] = in_bin;
  }
  if (tid == 0) counters[0] = want;
  __syncthreads();
}

// With tables (next_n > 0; 0: columns out) each column c picked for row r goes out as its
// global slot table[c / block_size] * block_size + c % block_size, table the row of
// sequence r / next_n (indexer_logits' rows): what sparse_mla_attention's decode takes; -1
// stays -1. A column past the table's max_blocks (an empty table's every column: its
// address may be null), or a slot outside [0, 2^31), goes out as kTopkFault, which
// sparse_mla_attention's decode treats as a fault (its token's rows NaN), never as a slot.
constexpr int kTopkFault = -0x7fffffff - 1;  // INT32_MIN
template <typename T>
__global__ void __launch_bounds__(kTopkThreads)
    indexer_topk(int* __restrict__ out, long long out_stride, const T* __restrict__ logits,
                 long long stride, int width, int topk, const int* __restrict__ block_tables,
                 long long bt_stride, int max_blocks, int block_size, int next_n) {
  static_assert(is_same<T, float>::value, "float32 logits");
  // the first digit's histogram, then (once it is read) the keys of the k-th's bin
  __shared__ union {
    int hist[kTopkTopBins];
    unsigned long long cand[kTopkCandidates];
  } first;
  int* hist = first.hist;
  static_assert(sizeof(first) + 256 * sizeof(int) + kTopkMax * sizeof(unsigned long long) +
                    1024 <= 48 * 1024, "static shared memory");
  __shared__ int hist2[256];  // the other digits' histograms
  __shared__ unsigned long long sel[kTopkMax];
  // keys taken (k), keys above the k-th, equals seen, equals left to take, equals in the
  // row, keys of the k-th's first-digit bin kept
  __shared__ int counters[6];
  __shared__ int bin_s;        // a radix pass's chosen bin
  __shared__ int scan_s[kTopkThreads / 32];
  unsigned long long* cand = first.cand;
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const T* row = logits + static_cast<long long>(blockIdx.x) * stride;
  int* out_row = out + static_cast<long long>(blockIdx.x) * out_stride;
  if (tid < 6) counters[tid] = 0;
  if (tid == 0) bin_s = 0;
  for (int b = tid; b < kTopkTopBins; b += kTopkThreads) hist[b] = 0;
  for (int b = tid; b < 256; b += kTopkThreads) hist2[b] = 0;
  __syncthreads();
  // pass 1 over the row: the first digit of every finite key
  constexpr int kTopShift = 32 - kTopkTopBits;
  for (int c0 = 0; c0 < width; c0 += kTopkStep) {
    unsigned key[kTopkUnroll];
    topk_keys(key, row, c0, width, tid);
#pragma unroll
    for (int j = 0; j < kTopkUnroll; ++j) {
      if (key[j] != 0u) atomicAdd(&hist[key[j] >> kTopShift], 1);
    }
  }
  __syncthreads();
  topk_find_top_bin(hist, counters, bin_s, scan_s, topk, tid);
  const int k = counters[0];
  const unsigned top = static_cast<unsigned>(bin_s);
  unsigned prefix = top << kTopShift, mask = ~0u << kTopShift;
  int remaining = counters[3];
  // the k-th's bin in shared memory (topk_find_top_bin's last barrier: hist read)
  const bool staged = k > 0 && counters[4] <= kTopkCandidates;
  if (staged) {
    // pass 2 over the row: the keys above the bin taken, the bin's kept, their next digit
    for (int c0 = 0; c0 < width; c0 += kTopkStep) {
      unsigned key[kTopkUnroll];
      topk_keys(key, row, c0, width, tid);
#pragma unroll
      for (int j = 0; j < kTopkUnroll; ++j) {
        const unsigned d = key[j] >> kTopShift;
        if (key[j] == 0u || d < top) continue;
        const unsigned c = static_cast<unsigned>(c0 + j * kTopkThreads + tid);
        const unsigned long long e = (static_cast<unsigned long long>(key[j]) << 32) | ~c;
        if (d > top) {
          sel[atomicAdd(&counters[1], 1)] = e;
        } else {
          cand[atomicAdd(&counters[5], 1)] = e;
          atomicAdd(&hist2[(key[j] >> 12) & 255u], 1);
        }
      }
    }
    __syncthreads();
  }
  const int ncand = counters[5];
  // the other digits, 8 bits at 12 and 4 and 4 bits at 0: over the kept keys, or the row
#pragma unroll 1
  for (int pass = 0; k > 0 && pass < 3; ++pass) {
    const int shift = pass == 0 ? 12 : pass == 1 ? 4 : 0;
    const unsigned bins = pass == 2 ? 15u : 255u;
    if (!(staged && pass == 0)) {  // (the second pass over the row counted the first)
      if (staged) {
        for (int i = tid; i < ncand; i += kTopkThreads) {
          const unsigned key = static_cast<unsigned>(cand[i] >> 32);
          if ((key & mask) == prefix) atomicAdd(&hist2[(key >> shift) & bins], 1);
        }
      } else {
        for (int c0 = 0; c0 < width; c0 += kTopkStep) {
          unsigned key[kTopkUnroll];
          topk_keys(key, row, c0, width, tid);
#pragma unroll
          for (int j = 0; j < kTopkUnroll; ++j) {
            if (key[j] != 0u && (key[j] & mask) == prefix) {
              atomicAdd(&hist2[(key[j] >> shift) & bins], 1);
            }
          }
        }
      }
      __syncthreads();
    }
    if (warp == 0) topk_find_bin(hist2, counters, bin_s, pass == 2, lane);
    __syncthreads();
    prefix |= static_cast<unsigned>(bin_s) << shift;
    mask |= bins << shift;
    remaining = counters[3];
    for (int b = tid; b < 256; b += kTopkThreads) hist2[b] = 0;
    __syncthreads();  // hist2 cleared and bin_s read before the next pass
  }
  const unsigned kth = prefix;  // the k-th largest key; `remaining` of its equals are taken
  // no tie cut: every equal is taken, with the keys above it
  const bool all_equals = k > 0 && counters[4] == remaining;
  const unsigned lowest = all_equals ? kth : kth + 1u;  // (kth + 1: kth < 2^32 - 1)
  // the keys taken in any order (those above it, and its equals when all are taken)
  if (staged) {
    for (int i = tid; i < ncand; i += kTopkThreads) {
      const unsigned long long e = cand[i];
      if (static_cast<unsigned>(e >> 32) >= lowest) sel[atomicAdd(&counters[1], 1)] = e;
    }
  } else {
    for (int c0 = 0; k > 0 && c0 < width; c0 += kTopkStep) {
      unsigned key[kTopkUnroll];
      topk_keys(key, row, c0, width, tid);
#pragma unroll
      for (int j = 0; j < kTopkUnroll; ++j) {
        if (key[j] >= lowest) {
          const int at = atomicAdd(&counters[1], 1);
          const unsigned c = static_cast<unsigned>(c0 + j * kTopkThreads + tid);
          sel[at] = (static_cast<unsigned long long>(key[j]) << 32) | ~c;
        }
      }
    }
  }
  __syncthreads();
  const int above = counters[1];
  // otherwise the first `remaining` columns whose key equals it: a scan in column order
  for (int c0 = 0; k > 0 && !all_equals && c0 < width; c0 += kTopkThreads) {
    const int c = c0 + tid;
    const bool eq = c < width && topk_key(row[c]) == kth;
    const unsigned ballot = __ballot_sync(~0u, eq);
    if (lane == 0) scan_s[warp] = __popc(ballot);
    __syncthreads();
    int before = counters[2];
    for (int w = 0; w < warp; ++w) before += scan_s[w];
    before += __popc(ballot & ((1u << lane) - 1u));
    if (eq && before < remaining) {
      sel[above + before] = (static_cast<unsigned long long>(kth) << 32) | (~static_cast<unsigned>(c));
    }
    __syncthreads();
    if (tid == 0) {
      int total = 0;
      for (int w = 0; w < kTopkThreads / 32; ++w) total += scan_s[w];
      counters[2] += total;
    }
    __syncthreads();
  }
  // bitonic sort of the k entries, descending (padded with zeros: below every entry)
  int n = 1;
  while (n < k) n <<= 1;
  for (int i = k + tid; i < n; i += kTopkThreads) sel[i] = 0ull;
  __syncthreads();
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride2 = size >> 1; stride2 > 0; stride2 >>= 1) {
      for (int i = tid; i < n; i += kTopkThreads) {
        const int j = i ^ stride2;
        if (j > i) {
          const unsigned long long a = sel[i], b = sel[j];
          const bool desc = (i & size) == 0;
          if (desc ? a < b : a > b) {
            sel[i] = b;
            sel[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  const int* table = next_n > 0 ? block_tables + (blockIdx.x / next_n) * bt_stride : nullptr;
  for (int i = tid; i < topk; i += kTopkThreads) {
    int c = i < k ? static_cast<int>(~static_cast<unsigned>(sel[i] & 0xffffffffull)) : -1;
    if (next_n > 0 && c >= 0) {
      const int b = c / block_size;
      const long long slot = b < max_blocks ? static_cast<long long>(table[b]) * block_size +
                                                  c % block_size
                                            : -1ll;
      c = slot >= 0 && slot <= 0x7fffffffll ? static_cast<int>(slot) : kTopkFault;
    }
    out_row[i] = c;
  }
}

}  // namespace cupaged
