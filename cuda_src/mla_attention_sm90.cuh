// Absorbed MLA over a paged latent cache on Hopper's wgmma (sm_90a): mla_attention.cuh's
// problem, arguments and conventions (its header), for 64 packed rows a CTA.
//
// Two warpgroups share the 64 rows; O (64 x 512, fp32) is split by columns: warpgroup 0
// holds O_L (value dims 0-255), warpgroup 1 O_R (256-511), 128 registers a thread each.
// Keys come in tiles of 64 tokens, taken in pairs (A, B): tile A in buffer 0, tile B in
// buffer 1, each stored once in the 128-byte-swizzled layout (nine 64-dim blocks of
// [64 tokens][128 bytes]) that is K's K-major B operand of S = Q K^T and, over its first
// eight blocks, V's MN-major B operand of P V: no copy or transpose.
//
// Each warpgroup computes S for one tile of the pair and its softmax, and both products
// for its half of O, so that one's exponentials run while the other's products do
// (a "seesaw", the schedule of DeepSeek's FlashMLA). A pair, with m the running maximum
// (shared memory) and tile A's S already in warpgroup 0's registers, tile B's in 1's:
//   wg0: m_A = max(m, rowmax S_A); O_L, l_0 *= 2^(m - m_A); P_A = 2^(S_A - m_A)   [scale0]
//        O_L += P_A V_A,L (P from registers)
//   wg1: m_B = max(m_A, rowmax S_B); O_R, l_1 *= 2^(m - m_B); P_B = 2^(S_B - m_B) [m_B]
//        P_B to shared memory                                                     [p1]
//        O_R += P_B V_B,R (registers), then O_R += P_A' V_A,R once P_A' is there
//   wg0: P_A' = P_A 2^(m_A - m_B) to shared memory (tile A's rotary block: S_A is done
//        with it)                                                                [p0]
//        O_L, l_0 *= 2^(m_A - m_B); O_L += P_B V_B,L
//   both: S of the next pair's tile (wg0: A, wg1: B), as its halves land.
// [..]: the named barrier that publishes the step to the other warpgroup.
//
// Copies: cp.async, every thread a token's 64-byte half of each 128-byte row, completion
// counted by mbarriers (cp.async.mbarrier.arrive), one per 64-dim block of a buffer, so
// that S starts on a block as soon as it lands. A buffer's halves, the latent dims 0-255
// (L: blocks 0-3) and the rest (R: blocks 4-8), are refilled with the next pair's tile by
// the warpgroup that read them last, as soon as its product is done:
//   buffer 0 L: wg0 after P_A V_A,L      buffer 0 R: wg1 after P_A' V_A,R
//   buffer 1 L: wg0 after P_B V_B,L      buffer 1 R: wg1 after P_B V_B,R (before P_A')
// A tile past the partition (an odd count) is read as zeros and masked.
#pragma once
#include "common.cuh"
#include "mla_common.cuh"
#include "mma.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "variants.cuh"

namespace cupaged {

constexpr int kMlaSm90Threads = 256;


template <typename T, int RANK, int ROPE>
struct MlaSm90Geometry {
  static constexpr int kRows = 64;
  static constexpr int kTileN = 64;
  static constexpr int kDims = RANK + ROPE;
  static constexpr int kBlocks = kDims / 64;       // 64-dim blocks of a key row (9)
  static constexpr int kHalfL = RANK / 2 / 64;     // blocks of a buffer's L half (4)
  static constexpr int kBlockBytes = 64 * 128;     // [64 rows or tokens][64 dims] of T
  static constexpr int kTileBytes = kBlocks * kBlockBytes;  // Q, or one buffer: 73,728
  static constexpr int kOffQ = 0;
  static constexpr int kOffBuf = kTileBytes;                       // buffers 0 and 1
  static constexpr int kOffPB = kOffBuf + 2 * kTileBytes;          // P_B [64 rows][64 keys]
  static constexpr int kOffRowState = kOffPB + kBlockBytes;        // m, scale0, l0, l1
  static constexpr int kOffBars = kOffRowState + 4 * kRows * 4;  // mbarriers: Q, 2 x kBlocks
  static constexpr int kOffFlag = kOffBars + (1 + 2 * kBlocks) * 8;
  // Tiles need 1024-byte alignment (the swizzle's phase): the base is rounded up.
  static constexpr int kSmemBytes = kOffFlag + 8 + 1024;

  static_assert(sizeof(T) == 2, "wgmma takes 16-bit operands here");
  static_assert(RANK == 512 && ROPE % 64 == 0 && ROPE > 0,
                "two warpgroups of N = 256; 64-dim blocks, the rotary ones in R");
  static_assert(kSmemBytes <= 232448, "sm_90's 227 KB of shared memory a CTA");
};

// S = Q K^T of one 64 x 64 tile (36 k-steps of m64n64k16, Q and K from shared memory) into
// s, committed as one wgmma group. Each 64-dim block is waited for (its mbarrier, at
// bars + 8 b, reaching phase `phase`) just before its four k-steps, in the order the
// buffer's halves were refilled: L (blocks 0 .. kHalfL - 1) then R, or R first when
// R_FIRST. The order is a constant: wgmma under a condition the compiler cannot resolve,
// or past a wait loop without a fence of its own, is serialized.
template <typename T, typename Geo, int R_FIRST>
__device__ __forceinline__ void mla_sm90_s(float (&s)[32], unsigned q_s, unsigned buf,
                                           unsigned bars, unsigned phase) {
  using namespace sm90;
#pragma unroll
  for (int i = 0; i < Geo::kBlocks; ++i) {
    const int b = R_FIRST ? (i + Geo::kHalfL) % Geo::kBlocks : i;
    mbar_wait(bars + 8u * b, phase);
    fence_async_smem();  // cp.async's writes, read next by wgmma
    fence_regs(s);
    wgmma_fence();
#pragma unroll
    for (int k = 4 * b; k < 4 * b + 4; ++k) {
      Wgmma<T, 64, 0>::ss(s, kmajor_desc(q_s, 16 * k, Geo::kRows),
                          kmajor_desc(buf, 16 * k, Geo::kTileN), i > 0 || k > 4 * b ? 1 : 0);
    }
  }
  wgmma_commit();
}

template <typename T, int RANK, int ROPE, int BLOCK_SIZE>
__global__ void __launch_bounds__(kMlaSm90Threads, 1)
    mla_attention_sm90(T* __restrict__ out, float* __restrict__ part_out,
                       float* __restrict__ part_max, float* __restrict__ part_sum,
                       int split_tiles, int row_tiles,
                       const T* __restrict__ q_lat, const T* __restrict__ q_rope,
                       long long q_lat_token_stride, long long q_lat_head_stride,
                       long long q_rope_token_stride, long long q_rope_head_stride,
                       const T* __restrict__ c_lat, const T* __restrict__ c_rope,
                       long long c_lat_block_stride, long long c_lat_token_stride,
                       long long c_rope_block_stride, long long c_rope_token_stride,
                       const int* __restrict__ block_tables, long long bt_stride,
                       int max_blocks, int num_blocks,
                       const float* __restrict__ k_scale_ptr, float k_scale,
                       const int* __restrict__ seq_lens,
                       const int* __restrict__ query_start_loc, int num_heads, int causal,
                       float scale_log2, const __grid_constant__ VariantParams vp) {
  using Geo = MlaSm90Geometry<T, RANK, ROPE>;
  using namespace sm90;
  constexpr int ROWS = Geo::kRows;
  constexpr int TILE_N = Geo::kTileN;
  // Named barriers (0 is __syncthreads'), one producer warpgroup and one consumer each.
  constexpr int kScale0 = 1, kScale1 = 2, kP0 = 3, kP1 = 4;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  const unsigned base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const unsigned q_s = base + Geo::kOffQ;
  auto buf_s = [&](int b) { return base + Geo::kOffBuf + b * Geo::kTileBytes; };
  const unsigned pa_s = buf_s(0) + (Geo::kBlocks - 1) * Geo::kBlockBytes;  // A's rotary block
  const unsigned pb_s = base + Geo::kOffPB;
  float* m_s = reinterpret_cast<float*>(smem + Geo::kOffRowState);
  float* scale0_s = m_s + ROWS;
  float* l_s = scale0_s + ROWS;  // [2][ROWS]: each warpgroup's row sums at the end
  const unsigned q_bar = base + Geo::kOffBars;
  // the mbarrier of 64-dim block b of buffer buf
  auto block_bar = [&](int buf, int b) { return q_bar + 8u * (1 + Geo::kBlocks * buf + b); };
  int* bad_s = reinterpret_cast<int*>(smem + Geo::kOffFlag);

  const int tid = threadIdx.x;
  // warpgroup (warp-uniform to the compiler: a value it cannot prove uniform around wgmma
  // makes ptxas serialize them); wg 0 also holds the row maxima's first update of a pair
  const int wg = __shfl_sync(~0u, tid / 128, 0);
  const int wtid = tid % 128;
  const int lane = tid & 31;
  const int frag_row = 16 * (wtid / 32) + (lane >> 2);  // this thread's rows: frag_row, + 8
  if (tid == 0 && dynamic_smem_bytes() < static_cast<unsigned>(Geo::kSmemBytes)) __trap();
  (void)k_scale_ptr;  // 16-bit caches only (the host passes no scale): fp8 stays on
  (void)k_scale;      // mla_attention

  if (tid == 0) {
    mbar_init(q_bar, kMlaSm90Threads);
    for (int b = 0; b < 2 * Geo::kBlocks; ++b) mbar_init(q_bar + 8u * (1 + b), 128);
  }

  const MlaSeq sq = mla_seq<BLOCK_SIZE>(blockIdx.x / row_tiles, seq_lens, query_start_loc,
                                        num_heads, block_tables, bt_stride, max_blocks);
  // This thread copies half (64 bytes) of each 128-byte row of token copy_token of a tile.
  const int copy_token = wtid / 2;
  const int copy_half = wtid % 2;
  int fills = 0;  // pairs loaded before this row tile: the buffer barriers' phase
  int rounds = 0;  // row tiles before this one: the query barrier's phase

  for (int row0 = (blockIdx.x % row_tiles) * ROWS; row0 < sq.packed;
       row0 += row_tiles * ROWS, ++rounds) {
    const int rows_here = min(ROWS, sq.packed - row0);
    const MlaTiles tl = mla_tiles<TILE_N>(sq, row0, rows_here, num_heads, causal, split_tiles);
    const int kv_end = tl.kv_end, tile_lo = tl.tile_lo, n_tiles = tl.n_tiles;
    const int n_pairs = (n_tiles + 1) / 2;

    __syncthreads();  // the barriers' init; the previous row tile is done with shared memory
    if (tid < ROWS) m_s[tid] = neg_inf();
    if (tid == 0) *bad_s = 0;
    __syncthreads();

    // ---- the query tile, swizzled (rows past the sequence's are zeros) ---------------------
    mla_copy_query<T, RANK, ROPE, ROWS, kMlaSm90Threads>(
        q_lat, q_rope, q_lat_token_stride, q_lat_head_stride, q_rope_token_stride,
        q_rope_head_stride, sq, row0, rows_here, num_heads,
        [&](int r, int c) { return q_s + sw128_offset(r, c * 8, ROWS); });
    cp_async_mbar_arrive(q_bar);

    // Block id of this thread's token of tile `tile` (-1: past the partition's keys, not
    // copied; -2: outside the cache, never dereferenced).
    auto tile_id = [&](int tile) -> int {
      if (tile >= n_tiles) return -1;
      return mla_block_id<BLOCK_SIZE>(sq, (tile_lo + tile) * TILE_N + copy_token, kv_end,
                                      num_blocks);
    };
    // One half of tile `tile` into buffer `buf`: blocks [b0, b1), each block's completion
    // on its barrier.
    auto load_half = [&](int tile, int buf, int half, int phys) {
      if (phys == -2) *bad_s = 1;
      const bool copy = phys >= 0;
      const MlaToken<T, BLOCK_SIZE> tok(c_lat, c_rope, c_lat_block_stride, c_lat_token_stride,
                                        c_rope_block_stride, c_rope_token_stride, phys,
                                        (tile_lo + tile) * TILE_N + copy_token);
      const int b0 = half == 0 ? 0 : Geo::kHalfL;
      const int b1 = half == 0 ? Geo::kHalfL : Geo::kBlocks;
#pragma unroll
      for (int b = 0; b < Geo::kBlocks; ++b) {
        if (b < b0 || b >= b1) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = 8 * b + 4 * copy_half + j;
          cp_async16_or_zero(buf_s(buf) + sw128_offset(copy_token, c * 8, TILE_N),
                             copy ? tok.template chunk<RANK>(c) : c_lat, copy);
        }
        cp_async_mbar_arrive(block_bar(buf, b));
      }
    };

    // S of this warpgroup's tile of pair `pair` (buffer wg) into s.
    auto compute_s = [&](float (&s)[32], int pair) {
      const unsigned phase = static_cast<unsigned>(fills + pair) & 1u;
      if (wg == 0) {
        mla_sm90_s<T, Geo, 0>(s, q_s, buf_s(0), block_bar(0, 0), phase);
      } else {
        mla_sm90_s<T, Geo, 1>(s, q_s, buf_s(1), block_bar(1, 0), phase);
      }
    };

    // P V over one tile for this warpgroup's half of O: P from registers (this warpgroup's
    // own tile) or from shared memory at p_addr (the other's).
    auto pv_regs = [&](float (&o)[128], const float (&p)[32], int buf) {
      unsigned a[TILE_N / 16][4];  // packed before the fence: wgmma reads them
#pragma unroll
      for (int kk = 0; kk < TILE_N / 16; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[kk][r] = pack2<T>(p[8 * kk + 2 * r], p[8 * kk + 2 * r + 1]);
      }
      fence_regs(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < TILE_N / 16; ++kk) {
        Wgmma<T, 256, 1>::rs(o, a[kk], mnmajor_desc(buf_s(buf), 16 * kk, 256 * wg, TILE_N), 1);
      }
      wgmma_commit();
    };
    auto pv_smem = [&](float (&o)[128], unsigned p_addr, int buf) {
      fence_regs(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < TILE_N / 16; ++kk) {
        Wgmma<T, 256, 1>::ss(o, kmajor_desc(p_addr, 16 * kk, ROWS),
                             mnmajor_desc(buf_s(buf), 16 * kk, 256 * wg, TILE_N), 1);
      }
      wgmma_commit();
    };
    // P (fp32, the S accumulator's layout) as T into a [64 rows][64 keys] swizzled tile.
    auto store_p = [&](unsigned p_addr, const float (&p)[32], float f0, float f1) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float f = h == 0 ? f0 : f1;
          st_shared_u32(p_addr + sw128_offset(frag_row + 8 * h, 8 * j + 2 * (lane & 3), ROWS),
                        pack2<T>(p[4 * j + 2 * h] * f, p[4 * j + 2 * h + 1] * f));
        }
      }
      fence_async_smem();  // P, for the other warpgroup's wgmma
    };

    // Keys below limit[h] are seen by row frag_row + 8h: its own bound, and the partition's
    // end (the pair's second tile may lie past it).
    const int part_end = (tile_lo + n_tiles) * TILE_N;
    const int limit[2] = {
        min(part_end, mla_key_limit(sq, row0 + frag_row, num_heads, causal)),
        min(part_end, mla_key_limit(sq, row0 + frag_row + 8, num_heads, causal))};
    // Mask and scale a tile's S (tile index `tile`) in place; its row maxima.
    auto mask_scale = [&](float (&s)[32], int tile, float (&tmax)[2]) {
      const int t0 = (tile_lo + tile) * TILE_N;
      tmax[0] = tmax[1] = neg_inf();
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = i >> 1;
          const int key = t0 + 8 * j + 2 * (lane & 3) + (i & 1);
          s[4 * j + i] = key < limit[h] ? s[4 * j + i] * scale_log2 : neg_inf();
          tmax[h] = fmaxf(tmax[h], s[4 * j + i]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(~0u, tmax[h], 1));
        tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(~0u, tmax[h], 2));
      }
    };
    // P = 2^(S - sub) in place; its row sums added to l.
    auto exponentiate = [&](float (&s)[32], const float (&sub)[2], float (&l)[2]) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = i >> 1;
          s[4 * j + i] = fast_exp2(s[4 * j + i] - sub[h]);
          l[h] += s[4 * j + i];
        }
      }
    };
    auto scale_o = [&](float (&o)[128], float f0, float f1) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j + 0] *= f0;
        o[4 * j + 1] *= f0;
        o[4 * j + 2] *= f1;
        o[4 * j + 3] *= f1;
      }
    };

    // ---- the first pair's tiles: wg0 copies the L halves, wg1 the R halves -----------------
    if (n_pairs > 0) {
      load_half(0, 0, wg, tile_id(0));
      load_half(1, 1, wg, tile_id(1));
    }
    // Block ids of the next pair's tiles, read a pair ahead of their copies.
    int id_a = tile_id(2), id_b = tile_id(3);
    mbar_wait(q_bar, static_cast<unsigned>(rounds) & 1u);  // all of Q: every thread's copies

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float s[32];
    float l[2] = {0.f, 0.f};
    if (n_pairs > 0) {
      compute_s(s, 0);
      wgmma_wait<0>();
      fence_regs(s);
    }

    if (wg == 0) {
      // the running maximum of this thread's rows, as of the last pair's tile B (wg0 reads it
      // from wg1 once a pair)
      float m_prev[2] = {neg_inf(), neg_inf()};
      for (int pair = 0; pair < n_pairs; ++pair) {
        const bool more = pair + 1 < n_pairs;
        const int next_a = tile_id(2 * pair + 4), next_b = tile_id(2 * pair + 5);
        // ---- softmax of tile A against the running maximum -----------------------------------
        float tmax[2], sub[2], alpha[2];
        mask_scale(s, 2 * pair, tmax);
        float m_run[2] = {m_prev[0], m_prev[1]};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          alpha[h] = softmax_advance(m_run[h], tmax[h], sub[h]);
          l[h] *= alpha[h];
        }
        if ((lane & 3) == 0) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            m_s[frag_row + 8 * h] = m_run[h];
            scale0_s[frag_row + 8 * h] = alpha[h];
          }
        }
        named_bar_arrive(kScale0, 256);
        exponentiate(s, sub, l);
        fence_regs(o);
        scale_o(o, alpha[0], alpha[1]);
        // ---- O_L += P_A V_A,L, then buffer 0's L half is free ----------------------------------
        pv_regs(o, s, 0);
        wgmma_wait<0>();
        fence_regs(o);
        if (more) load_half(2 * pair + 2, 0, 0, id_a);
        // ---- P_A in tile B's maximum, for wg1 ------------------------------------------------
        named_bar_sync(kScale1, 256);
        // tile B's factor, 2^(m_A - m_B), from m_B as wg1 computed it (softmax_advance's
        // arithmetic on the same values: the same factor to the bit)
        float beta[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          m_prev[h] = m_s[frag_row + 8 * h];
          beta[h] = exp2f(m_run[h] - (m_prev[h] == neg_inf() ? 0.f : m_prev[h]));
        }
        store_p(pa_s, s, beta[0], beta[1]);
        named_bar_arrive(kP0, 256);
        l[0] *= beta[0];
        l[1] *= beta[1];
        scale_o(o, beta[0], beta[1]);
        // ---- O_L += P_B V_B,L; the next pair's S_A meanwhile ---------------------------------
        named_bar_sync(kP1, 256);
        pv_smem(o, pb_s, 1);
        if (more) compute_s(s, pair + 1);
        wgmma_wait<1>();  // (with more) P_B V_B,L: buffer 1's L half is free
        if (more) load_half(2 * pair + 3, 1, 0, id_b);
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(s);
        id_a = next_a;
        id_b = next_b;
      }
    } else {
      for (int pair = 0; pair < n_pairs; ++pair) {
        const bool more = pair + 1 < n_pairs;
        const int next_a = tile_id(2 * pair + 4), next_b = tile_id(2 * pair + 5);
        // ---- softmax of tile B against tile A's maximum ------------------------------------
        float tmax[2], sub[2], alpha[2];
        mask_scale(s, 2 * pair + 1, tmax);
        named_bar_sync(kScale0, 256);
        float m_run[2] = {m_s[frag_row], m_s[frag_row + 8]};
        const float scale_a[2] = {scale0_s[frag_row], scale0_s[frag_row + 8]};
        __syncwarp();  // the quad's reads of m before its writer updates it
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          alpha[h] = softmax_advance(m_run[h], tmax[h], sub[h]);
        }
        if ((lane & 3) == 0) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            m_s[frag_row + 8 * h] = m_run[h];
          }
        }
        named_bar_arrive(kScale1, 256);
        const float f[2] = {scale_a[0] * alpha[0], scale_a[1] * alpha[1]};
        l[0] *= f[0];
        l[1] *= f[1];
        exponentiate(s, sub, l);
        store_p(pb_s, s, 1.f, 1.f);
        named_bar_arrive(kP1, 256);
        fence_regs(o);
        scale_o(o, f[0], f[1]);
        // ---- O_R += P_B V_B,R, then O_R += P_A' V_A,R -------------------------------------------
        pv_regs(o, s, 1);
        wgmma_wait<0>();  // P_B V_B,R: buffer 1's R half is free, refilled before P_A' comes
        fence_regs(o);
        if (more) load_half(2 * pair + 3, 1, 1, id_b);
        named_bar_sync(kP0, 256);
        pv_smem(o, pa_s, 0);
        wgmma_wait<0>();  // P_A' V_A,R: buffer 0's R half (and P_A') is free
        fence_regs(o);
        if (more) {
          load_half(2 * pair + 2, 0, 1, id_a);
          compute_s(s, pair + 1);
        }
        // (outside the branch: a wait the compiler sees as conditional makes it serialize)
        wgmma_wait<0>();
        fence_regs(s);
        id_a = next_a;
        id_b = next_b;
      }
    }
    fills += n_pairs;

    // ---- each row's maximum and sum (both warpgroups' sums), normalize, store -------------------
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(~0u, l[h], 1);
      l[h] += __shfl_xor_sync(~0u, l[h], 2);
      if ((lane & 3) == 0) l_s[wg * ROWS + frag_row + 8 * h] = l[h];
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
      const float m = m_s[r];
      const float lsum = l_s[r] + l_s[ROWS + r];
      if (split_tiles > 0) {
        const long long prow = orow * gridDim.z + blockIdx.z;
        const float inv = end_partial_row(m, lsum, bad, 1.f, prow, part_max, part_sum, writer);
        float* dst = part_out + prow * RANK + col;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          *reinterpret_cast<float2*>(dst + 8 * j) =
              make_float2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
        }
        continue;
      }
      const float inv = end_whole_row(vp, m, lsum, bad, 1.f, neg_inf(), orow, writer);
      T* dst = out + orow * RANK + col;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<unsigned*>(dst + 8 * j) =
            pack2<T>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
      }
    }
  }
}

}  // namespace cupaged
