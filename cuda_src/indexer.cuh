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
// Work split: one CTA per (row, chunk of kChunk columns); HEADS / 16 warps, warp w the
// heads 16 w .. 16 w + 15 of S = Q K^T over 64-token tiles (its Q fragments loaded once).
// A tile's keys land by cp.async in a ring of two raw stages and are widened to T (exact:
// e4m3 values are all representable) before the products; each column's sum over heads
// is reduced in the warp, then over the warps in shared memory, and scaled by the key's
// scale (positive, so relu commutes with it). A block id outside the cache is never
// dereferenced: its columns come back NaN.
#pragma once
#include "common.cuh"
#include "fp8.cuh"
#include "mma.cuh"

namespace cupaged {

constexpr int kIndexerDim = 128;   // the indexer's head_dim (DeepSeek-V3.2's)
constexpr int kIndexerTile = 64;   // keys a tile
constexpr int kIndexerChunk = 512; // columns a CTA

template <typename T, int HEADS>
struct IndexerGeometry {
  static constexpr int kWarps = HEADS / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRow = kIndexerDim + 8;  // T elements: rows padded by 16 bytes
  static constexpr int kOffQ = 0;
  static constexpr int kOffWide = kOffQ + HEADS * kRow * 2;
  static constexpr int kOffRaw = kOffWide + kIndexerTile * kRow * 2;  // two raw stages
  static constexpr int kOffScale = kOffRaw + 2 * kIndexerTile * kIndexerDim;
  static constexpr int kOffFlag = kOffScale + 2 * kIndexerTile * 4;   // per key: 0/1/2
  static constexpr int kOffRed = kOffFlag + 2 * kIndexerTile * 4;
  static constexpr int kSmemBytes = kOffRed + kWarps * kIndexerTile * 4;
  static_assert(HEADS % 16 == 0 && HEADS >= 16 && HEADS <= 64, "HEADS: 16 to 64");
  static_assert(sizeof(T) == 2, "16-bit queries");
};

template <typename T, int HEADS, int BLOCK_SIZE>
__global__ void __launch_bounds__(IndexerGeometry<T, HEADS>::kThreads)
    indexer_logits(float* __restrict__ out, long long out_stride, int width,
                   const T* __restrict__ q, long long q_row_stride, long long q_head_stride,
                   const float* __restrict__ weights, long long w_stride,
                   const unsigned char* __restrict__ cache, long long block_stride,
                   int num_blocks, const int* __restrict__ block_tables, long long bt_stride,
                   int max_blocks, const int* __restrict__ seq_lens, int next_n) {
  using Geo = IndexerGeometry<T, HEADS>;
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
  const int row = blockIdx.x;
  const int seq = row / next_n;
  const int seq_len = max(0, min(seq_lens[seq], max_blocks * BLOCK_SIZE));
  const int count = max(0, min(seq_len, seq_len - next_n + row % next_n + 1));  // keys seen
  const int col0 = blockIdx.y * kIndexerChunk;
  const int col_end = min(width, col0 + kIndexerChunk);
  const int key_end = min(count, col_end);  // keys this CTA reads
  float* out_row = out + row * out_stride;
  // Columns no key of this row fills: -inf.
  for (int c = max(col0, key_end) + tid; c < col_end; c += Geo::kThreads) out_row[c] = neg_inf();
  if (key_end <= col0) return;
  const int n_tiles = (key_end - col0 + TILE - 1) / TILE;
  const int* bt_row = block_tables + seq * bt_stride;

  // The query's rows (HEADS x 128) into shared memory, with the first tile's copies.
  const T* q_row = q + row * q_row_stride;
  for (int u = tid; u < HEADS * (D / 8); u += Geo::kThreads) {
    const int h = u / (D / 8), c = u % (D / 8);
    cp_async16_or_zero(static_cast<unsigned>(__cvta_generic_to_shared(q_s + h * ROW + c * 8)),
                       q_row + h * q_head_stride + c * 8, true);
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

  load_tile(0, 0);
  cp_async_commit();
  const float w0 = weights[row * w_stride + 16 * warp + (lane >> 2)];
  const float w1 = weights[row * w_stride + 16 * warp + (lane >> 2) + 8];
  unsigned qa[D / 16][4];
  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile it (and the query) landed; every read of tile it - 1 is done
    // the next tile flies during this one's work (its stage's flags and scales were last
    // read before the barrier above)
    if (it + 1 < n_tiles) load_tile(it + 1, stage ^ 1);
    cp_async_commit();
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        ldmatrix_x4(qa[kk], q_s + (16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW +
                                kk * 16 + (lane >> 4) * 8);
      }
    }
    // widen the tile to T: 16 e4m3 values a chunk, zeros staying zeros
    const unsigned char* raw = smem + Geo::kOffRaw + stage * TILE * D;
    for (int u = tid; u < TILE * (D / 16); u += Geo::kThreads) {
      const int k = u / (D / 16), c = u % (D / 16);
      uint4 lo, hi;
      widen16<T, fp8_e4m3_t>(*reinterpret_cast<const uint4*>(raw + k * D + c * 16), lo, hi);
      *reinterpret_cast<uint4*>(wide_s + k * ROW + c * 16) = lo;
      *reinterpret_cast<uint4*>(wide_s + k * ROW + c * 16 + 8) = hi;
    }
    __syncthreads();  // the widened tile is complete

    // S for this warp's 16 heads x 64 keys
    float s[TILE / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < TILE / 16; ++np) {
        unsigned kb[4];
        ldmatrix_x4(kb, wide_s + (np * 16 + (lane & 7) + (lane >> 4) * 8) * ROW + kk * 16 +
                            ((lane >> 3) & 1) * 8);
        const unsigned b0[2] = {kb[0], kb[1]};
        const unsigned b1[2] = {kb[2], kb[3]};
        mma_16816<T>(s[2 * np], qa[kk], b0);
        mma_16816<T>(s[2 * np + 1], qa[kk], b1);
      }
    }
    // each column's sum over this warp's heads: w * relu(s) over the lane's two rows, then
    // over the eight lanes that share its columns (relu keeps a NaN, as the reference's
    // and torch's do: fmaxf would drop it, and top-k could then pick its column)
    auto relu = [](float x) { return x < 0.f ? 0.f : x; };
#pragma unroll
    for (int n = 0; n < TILE / 8; ++n) {
      float c0 = w0 * relu(s[n][0]) + w1 * relu(s[n][2]);
      float c1 = w0 * relu(s[n][1]) + w1 * relu(s[n][3]);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        c0 += __shfl_xor_sync(~0u, c0, o);
        c1 += __shfl_xor_sync(~0u, c1, o);
      }
      if (lane < 4) {
        red_s[warp * TILE + n * 8 + 2 * lane] = c0;
        red_s[warp * TILE + n * 8 + 2 * lane + 1] = c1;
      }
    }
    __syncthreads();  // every warp's column sums
    for (int k = tid; k < TILE; k += Geo::kThreads) {
      const int col = col0 + it * TILE + k;
      if (col >= col_end) continue;
      const int flag = flag_s[stage * TILE + k];
      float v = neg_inf();
      if (flag == 1) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < Geo::kWarps; ++w) sum += red_s[w * TILE + k];
        v = sum * scale_s[stage * TILE + k];
      } else if (flag == 2) {
        v = __int_as_float(0x7fc00000);  // a bad block id: NaN
      }
      out_row[col] = v;
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
//   2. the k-th largest key by radix select, 8 bits a pass from the top: a histogram of
//      the keys that match the prefix so far (its first pass, over every finite key,
//      also counts them, so k = min(topk, that count)), then one warp's scan of its bins
//      from the top (topk_find_bin);
//   3. the keys above it, and of those equal to it the lowest columns, into shared
//      memory. When the row holds exactly as many keys equal to it as are taken (no
//      tie is cut: the common case), they join the keys above it in the same pass;
//      otherwise the lowest columns come from a scan in column order;
//   4. a bitonic sort of (key, ~column) descending, then the columns out.
// A CTA a row leaves one CTA on an SM, so each pass over the row is bound by load latency:
// a thread issues kTopkUnroll loads before it uses any.
constexpr int kTopkThreads = 512;
constexpr int kTopkMax = 2048;  // the largest topk (DeepSeek-V3.2's)
constexpr int kTopkUnroll = 8;
constexpr int kTopkStep = kTopkThreads * kTopkUnroll;  // columns a CTA-wide step

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

// One warp: the bin, from the top, of a radix pass's histogram that holds the
// counters[3]-th largest key, into bin_s, and counters[3] less the keys in the bins above
// it. ``first``: the histogram counts every finite key, so k = counters[0] =
// counters[3] = min(topk, their count) first. ``last``: counters[4] = the keys in that
// bin (those equal to the k-th). Each lane sums 8 bins, a shuffle scan the lanes.
__device__ __forceinline__ void topk_find_bin(const int* hist, int* counters, int& bin_s,
                                              int topk, bool first, bool last, int lane) {
  int want = counters[3];  // read by every lane, then written by one (after __syncwarp)
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
  if (first) want = min(topk, __shfl_sync(~0u, upto, 31));
  const int above = upto - mine;
  __syncwarp();  // every lane's read of counters[3] before one lane writes it
  if (want > 0 && above < want && want <= upto) {  // exactly one lane
    int before = above, i = 0, in_bin = v[0];
#pragma unroll
    for (int j = 0; j < 7; ++j) {  // (a fixed loop: v stays in registers)
      if (i == j && before + v[j] < want) {
        before += v[j];
        i = j + 1;
        in_bin = v[j + 1];
      }
    }
    bin_s = 255 - lane * 8 - i;
    counters[3] = want - before;
    if (first) counters[0] = want;
    if (last) counters[4] = in_bin;
  }
  if (first && want == 0 && lane == 0) counters[0] = counters[3] = 0;
}

template <typename T>
__global__ void __launch_bounds__(kTopkThreads)
    indexer_topk(int* __restrict__ out, long long out_stride, const T* __restrict__ logits,
                 long long stride, int width, int topk) {
  static_assert(is_same<T, float>::value, "float32 logits");
  __shared__ int hist[256];
  __shared__ unsigned long long sel[kTopkMax];
  // keys taken (k), keys above the k-th, equals seen, equals left to take, equals in the row
  __shared__ int counters[5];
  __shared__ int bin_s;        // a radix pass's chosen bin
  __shared__ int scan_s[kTopkThreads / 32];
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const T* row = logits + static_cast<long long>(blockIdx.x) * stride;
  int* out_row = out + static_cast<long long>(blockIdx.x) * out_stride;
  if (tid < 5) counters[tid] = 0;
  // radix select: the k-th largest key
  unsigned prefix = 0u, mask = 0u;
  int k = 0, remaining = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kTopkThreads) hist[b] = 0;
    __syncthreads();
    for (int c0 = 0; c0 < width; c0 += kTopkStep) {
      unsigned key[kTopkUnroll];
      topk_keys(key, row, c0, width, tid);
#pragma unroll
      for (int j = 0; j < kTopkUnroll; ++j) {
        if (key[j] != 0u && (key[j] & mask) == prefix) {
          atomicAdd(&hist[(key[j] >> shift) & 255u], 1);
        }
      }
    }
    __syncthreads();
    if (warp == 0) topk_find_bin(hist, counters, bin_s, topk, shift == 24, shift == 0, lane);
    __syncthreads();
    k = counters[0];
    if (k == 0) break;  // no finite key: every column -1
    prefix |= static_cast<unsigned>(bin_s) << shift;
    mask |= 255u << shift;
    remaining = counters[3];
    __syncthreads();  // hist and bin_s are rewritten by the next pass
  }
  const unsigned kth = prefix;  // the k-th largest key; `remaining` of its equals are taken
  // no tie cut: every equal is taken, with the keys above it
  const bool all_equals = k > 0 && counters[4] == remaining;
  const unsigned lowest = all_equals ? kth : kth + 1u;  // (kth + 1: kth < 2^32 - 1)
  // the keys taken in any order (those above it, and its equals when all are taken)
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
  for (int i = tid; i < topk; i += kTopkThreads) {
    out_row[i] = i < k ? static_cast<int>(~static_cast<unsigned>(sel[i] & 0xffffffffull)) : -1;
  }
}

}  // namespace cupaged
