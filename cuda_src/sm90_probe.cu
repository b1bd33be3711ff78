// Probes of sm90.cuh on the GPU (tests/test_sm90.py): one warpgroup stores A [64 x 16]
// (8-bit: [64 x 32]) and B in the 128-byte-swizzled shared layouts, issues one wgmma and
// writes D [64 x N] from its accumulator fragments, which the test compares with NumPy;
// and bulk copies counted on an mbarrier over two of its phases (probe_bulk_copy). Not part
// of the library's kernels.
#include "sm90_fp8.cuh"

namespace cupaged {
namespace sm90 {

// D [64][N] from the accumulator's C layout (Wgmma's comment), by each thread of warp w.
template <int N>
__device__ void store_d(const float (&d)[N / 2], float* d_out, int warp, int lane) {
  const int r = 16 * warp + (lane >> 2), c = 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    d_out[r * N + 8 * j + c] = d[4 * j];
    d_out[r * N + 8 * j + c + 1] = d[4 * j + 1];
    d_out[(r + 8) * N + 8 * j + c] = d[4 * j + 2];
    d_out[(r + 8) * N + 8 * j + c + 1] = d[4 * j + 3];
  }
}

// A: [64][16] row-major; B: [N][16] (K-major) or [16][N] (MN_MAJOR), row-major; D: [64][N].
// A_REGS: A from registers (rs) instead of shared memory (ss). lbo/sbo: for MN-major B,
// its descriptor's offsets in bytes (0: mnmajor_desc's).
template <typename T, int N, int MN_MAJOR, int A_REGS>
__device__ void probe(const T* a, const T* b, float* d_out, unsigned lbo, unsigned sbo) {
  __shared__ __align__(1024) unsigned char a_s[64 * 128];
  __shared__ __align__(1024) unsigned char b_s[(N > 64 ? N : 64) * 128 > 16 * 128 * (N / 64 + 1)
                                                   ? (N > 64 ? N : 64) * 128
                                                   : 16 * 128 * (N / 64 + 1)];
  const int tid = threadIdx.x;
  for (int i = tid; i < 64 * 16; i += 128) {
    const int r = i / 16, k = i % 16;
    *reinterpret_cast<T*>(a_s + sw128_offset(r, k, 64)) = a[i];
  }
  for (int i = tid; i < N * 16; i += 128) {
    if (MN_MAJOR) {
      const int k = i / N, n = i % N;
      *reinterpret_cast<T*>(b_s + sw128_offset(k, n, 16)) = b[i];
    } else {
      const int n = i / 16, k = i % 16;
      *reinterpret_cast<T*>(b_s + sw128_offset(n, k, N)) = b[i];
    }
  }
  fence_async_smem();
  __syncthreads();
  const unsigned a_addr = static_cast<unsigned>(__cvta_generic_to_shared(a_s));
  const unsigned b_addr = static_cast<unsigned>(__cvta_generic_to_shared(b_s));
  unsigned long long bd = MN_MAJOR ? mnmajor_desc(b_addr, 0, 0, 16) : kmajor_desc(b_addr, 0, N);
  if (MN_MAJOR && (lbo || sbo)) bd = sw128_desc(b_addr, lbo, sbo);
  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  const int warp = tid >> 5, lane = tid & 31;
  wgmma_fence();
  if (A_REGS) {
    // mma.m16n8k16's A fragment of rows 16w .. 16w + 15.
    const int r = 16 * warp + (lane >> 2), k = 2 * (lane & 3);
    unsigned af[4];
    const unsigned short* a16 = reinterpret_cast<const unsigned short*>(a);
    auto pack = [&](int rr, int kk) {
      return static_cast<unsigned>(a16[rr * 16 + kk]) |
             (static_cast<unsigned>(a16[rr * 16 + kk + 1]) << 16);
    };
    af[0] = pack(r, k);
    af[1] = pack(r + 8, k);
    af[2] = pack(r, k + 8);
    af[3] = pack(r + 8, k + 8);
    Wgmma<T, N, MN_MAJOR>::rs(d, af, bd, 1);
  } else {
    Wgmma<T, N, MN_MAJOR>::ss(d, kmajor_desc(a_addr, 0, 64), bd, 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  store_d<N>(d, d_out, warp, lane);
}

// One 8-bit k32 wgmma: A [64][32] and B [N][32] (K-major, both), row-major bytes of C;
// D [64][N]. A_REGS: A from registers instead, made by fp8_a_fragment from `a_f32` [64][32]
// placed in an accumulator's C layout (so it is rounded to C there), and B's K rows
// stored in the order fp8_k_column gives (position p holds B's row fp8_k_column(p)).
template <typename C, int N, int A_REGS>
__device__ void probe8(const unsigned char* a, const float* a_f32, const unsigned char* b,
                       float* d_out) {
  __shared__ __align__(1024) unsigned char a_s[64 * 128];
  __shared__ __align__(1024) unsigned char b_s[(N > 64 ? N : 64) * 128];
  const int tid = threadIdx.x;
  for (int i = tid; i < 64 * 32; i += 128) a_s[sw128_offset8(i / 32, i % 32, 64)] = a[i];
  for (int i = tid; i < N * 32; i += 128) {
    const int n = i / 32, p = i % 32;
    b_s[sw128_offset8(n, p, N)] = b[n * 32 + (A_REGS ? fp8_k_column(p) : p)];
  }
  fence_async_smem();
  __syncthreads();
  const unsigned a_addr = static_cast<unsigned>(__cvta_generic_to_shared(a_s));
  const unsigned b_addr = static_cast<unsigned>(__cvta_generic_to_shared(b_s));
  const int warp = tid >> 5, lane = tid & 31;
  const int r = 16 * warp + (lane >> 2), c = 2 * (lane & 3);
  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  wgmma_fence();
  if (A_REGS) {
    float acc[16];  // a_f32's 32 columns in the accumulator layout
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[4 * j] = a_f32[r * 32 + 8 * j + c];
      acc[4 * j + 1] = a_f32[r * 32 + 8 * j + c + 1];
      acc[4 * j + 2] = a_f32[(r + 8) * 32 + 8 * j + c];
      acc[4 * j + 3] = a_f32[(r + 8) * 32 + 8 * j + c + 1];
    }
    unsigned af[4];
    fp8_a_fragment<C>(acc, 0, af);
    Wgmma<C, N, 0>::rs(d, af, kmajor_desc(b_addr, 0, N), 1);
  } else {
    Wgmma<C, N, 0>::ss(d, kmajor_desc(a_addr, 0, 64), kmajor_desc(b_addr, 0, N), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  store_d<N>(d, d_out, warp, lane);
}

// fp8_transpose_v over one tile: `src` [TILE_N][HEAD_SIZE] bytes into shared memory
// densely, transposed by THREADS threads, the destination tile's bytes copied out as they
// lie (`out`, TILE_N * HEAD_SIZE bytes, swizzle and all).
template <int HEAD_SIZE, int TILE_N, int THREADS>
__device__ void probe_transpose(const unsigned char* src, unsigned char* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* raw = smem;
  unsigned char* vt = smem + TILE_N * HEAD_SIZE;  // a multiple of 1024 bytes on
  for (int i = threadIdx.x; i < TILE_N * HEAD_SIZE; i += THREADS) raw[i] = src[i];
  __syncthreads();
  fp8_transpose_v<HEAD_SIZE, TILE_N, THREADS>(
      static_cast<unsigned>(__cvta_generic_to_shared(raw)),
      static_cast<unsigned>(__cvta_generic_to_shared(vt)), threadIdx.x);
  __syncthreads();
  for (int i = threadIdx.x; i < TILE_N * HEAD_SIZE; i += THREADS) out[i] = vt[i];
}

// fp8 attention of one warpgroup, the chain an fp8-query prefill runs a tile at a time:
// 64 query rows of HEAD_SIZE (q [64][HEAD_SIZE] bytes of C) over TILES tiles of 128 keys
// (k, v [TILES * 128][HEAD_SIZE] bytes, token-major): S = Q K^T by 8-bit wgmma from shared
// memory; an online softmax in base 2 whose weights carry an offset of 2^8 (P =
// exp2(S * scale_log2 - m + 8), in [0, 256], so e4m3 keeps weights normal down to 2^-14 of
// a row's maximum and nonzero down to 2^-17); P rounded to C by fp8_a_fragment; V
// transposed by
// fp8_transpose_v; O += P V^T by 8-bit wgmma with P from registers. Out: O / l * v_scale
// [64][HEAD_SIZE] fp32, each row's m (log2 units, the offset left out) and l (the fp32
// weights' sum, offset included), and each tile's S as the wgmma summed it (s_out
// [TILES][64][128]: 8-bit products are summed with fewer bits than fp32, so the test
// emulates the rest from these). Dynamic shared memory: (64 + 128) x HEAD_SIZE
// rounded up to 128 a row, 2 x 128 x HEAD_SIZE, and 1024 bytes for the alignment.
template <typename C, int HEAD_SIZE, int TILES>
__device__ void probe_fp8_attention(const unsigned char* q, const unsigned char* k,
                                    const unsigned char* v, float scale_log2, float v_scale,
                                    float* o_out, float* m_out, float* l_out, float* s_out) {
  constexpr int TN = 128, TILE_BYTES = TN * HEAD_SIZE;
  // Q's and K's rows take whole 128-byte blocks of the swizzled layout (half used at 64)
  constexpr int ROW_BYTES = (HEAD_SIZE + 127) / 128 * 128;
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  const unsigned base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const unsigned q_s = base, k_s = base + 64 * ROW_BYTES, vraw_s = k_s + TN * ROW_BYTES,
                 vt_s = vraw_s + TILE_BYTES;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < 64 * HEAD_SIZE; i += 128) {
    smem[sw128_offset8(i / HEAD_SIZE, i % HEAD_SIZE, 64)] = q[i];
  }
  float o[HEAD_SIZE / 2];
#pragma unroll
  for (int i = 0; i < HEAD_SIZE / 2; ++i) o[i] = 0.f;
  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
  for (int tile = 0; tile < TILES; ++tile) {
    __syncthreads();  // the last tile's products are done with K, V and V^T
    for (int i = tid; i < TILE_BYTES; i += 128) {
      const unsigned char key_byte = k[tile * TILE_BYTES + i];
      smem[k_s - base + sw128_offset8(i / HEAD_SIZE, i % HEAD_SIZE, TN)] = key_byte;
      smem[vraw_s - base + i] = v[tile * TILE_BYTES + i];
    }
    __syncthreads();
    fp8_transpose_v<HEAD_SIZE, TN, 128>(vraw_s, vt_s, tid);
    fence_async_smem();
    __syncthreads();
    float s[TN / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_SIZE / 32; ++kk) {
      Wgmma<C, TN, 0>::ss(s, kmajor_desc(q_s, 16 * kk, 64), kmajor_desc(k_s, 16 * kk, TN), kk);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
    store_d<TN>(s, s_out + tile * 64 * TN, warp, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows 16w + lane/4 (h 0) and + 8 (h 1)
      float mx = neg_inf();
#pragma unroll
      for (int j = 0; j < TN / 8; ++j) {
        mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, 2));
      const float m_new = fmaxf(m[h], mx * scale_log2);
      const float alpha = fast_exp2(m[h] - m_new);  // 0 for the first tile (m = -inf)
      const float shift = m_new - 8.f;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < TN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = fast_exp2(fmaf(x, scale_log2, -shift));
          sum += x;
        }
      }
      l[h] = l[h] * alpha + sum;
#pragma unroll
      for (int j = 0; j < HEAD_SIZE / 8; ++j) {
        o[4 * j + 2 * h] *= alpha;
        o[4 * j + 2 * h + 1] *= alpha;
      }
      m[h] = m_new;
    }
    unsigned pa[TN / 32][4];
#pragma unroll
    for (int c = 0; c < TN / 32; ++c) fp8_a_fragment<C>(s, c, pa[c]);
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < TN / 32; ++c) {
      Wgmma<C, HEAD_SIZE, 0>::rs(o, pa[c], kmajor_desc(vt_s, 16 * c, HEAD_SIZE), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(~0u, l[h], 1);
    l[h] += __shfl_xor_sync(~0u, l[h], 2);
    const float f = v_scale / l[h];
#pragma unroll
    for (int j = 0; j < HEAD_SIZE / 8; ++j) {
      o[4 * j + 2 * h] *= f;
      o[4 * j + 2 * h + 1] *= f;
    }
    if ((lane & 3) == 0) {
      const int r = 16 * warp + (lane >> 2) + 8 * h;
      m_out[r] = m[h];
      l_out[r] = l[h];
    }
  }
  store_d<HEAD_SIZE>(o, o_out, warp, lane);
}

// Bulk copies as paged_prefill_sm90's fp8 producer issues them: over two phases of one
// mbarrier (parities 0 and 1), `runs` runs of `bytes` bytes each from src + offsets[phase
// * runs + r] into shared memory, run r by one elected lane of warp r % 4 (warp-uniform
// code), which announces its bytes first; then every thread copies the shared buffer to
// out[phase] and, before the next phase refills it, the block syncs and fences the
// proxies. flags[phase]: whether mbar_try_wait saw phase `phase` complete (1) and the
// next one not yet (0) right after the wait.
__device__ void probe_bulk(const unsigned char* src, const int* offsets, int runs, int bytes,
                           unsigned char* out, int* flags) {
  __shared__ __align__(128) unsigned char buf[8192];
  __shared__ __align__(8) unsigned long long bar;
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(buf));
  const int tid = threadIdx.x;
  if (tid == 0) {
    mbar_init(b, runs);
    fence_mbarrier_init();
  }
  __syncthreads();
  const int warp = __shfl_sync(~0u, tid >> 5, 0);
  for (int phase = 0; phase < 2; ++phase) {
    for (int r = warp; r < runs; r += 4) {
      if (elect_one()) {
        mbar_arrive_expect_tx(b, bytes);
        bulk_copy_g2s(s + r * bytes, src + offsets[phase * runs + r], bytes, b);
      }
    }
    mbar_wait(b, phase);
    if (tid == 0) {
      flags[2 * phase] = mbar_try_wait(b, phase);
      flags[2 * phase + 1] = mbar_try_wait(b, phase ^ 1);
    }
    for (int i = tid; i < runs * bytes; i += blockDim.x) out[phase * runs * bytes + i] = buf[i];
    __syncthreads();
    fence_async_smem();
  }
}

}  // namespace sm90
}  // namespace cupaged

extern "C" __global__ void __launch_bounds__(128)
    probe_bulk_copy(const unsigned char* src, const int* offsets, int runs, int bytes,
                    unsigned char* out, int* flags) {
  cupaged::sm90::probe_bulk(src, offsets, runs, bytes, out, flags);
}

#define CUPAGED_PROBE(NAME, T, N, MN, AR)                                                  \
  extern "C" __global__ void __launch_bounds__(128) NAME(const T* a, const T* b, float* d, \
                                                          unsigned lbo, unsigned sbo) {   \
    cupaged::sm90::probe<T, N, MN, AR>(a, b, d, lbo, sbo);                                \
  }

CUPAGED_PROBE(probe_bf16_n64_k_ss, cupaged::bfloat16_t, 64, 0, 0)
CUPAGED_PROBE(probe_bf16_n64_mn_ss, cupaged::bfloat16_t, 64, 1, 0)
CUPAGED_PROBE(probe_bf16_n128_k_ss, cupaged::bfloat16_t, 128, 0, 0)
CUPAGED_PROBE(probe_bf16_n128_mn_ss, cupaged::bfloat16_t, 128, 1, 0)
CUPAGED_PROBE(probe_bf16_n128_mn_rs, cupaged::bfloat16_t, 128, 1, 1)
CUPAGED_PROBE(probe_f16_n64_k_ss, cupaged::half_t, 64, 0, 0)
CUPAGED_PROBE(probe_f16_n64_mn_rs, cupaged::half_t, 64, 1, 1)
// N = 256: an MLA output half (256 of kv_lora_rank's 512 dims) in one instruction.
CUPAGED_PROBE(probe_bf16_n256_mn_rs, cupaged::bfloat16_t, 256, 1, 1)
CUPAGED_PROBE(probe_bf16_n256_mn_ss, cupaged::bfloat16_t, 256, 1, 0)
CUPAGED_PROBE(probe_f16_n256_k_ss, cupaged::half_t, 256, 0, 0)

#define CUPAGED_PROBE8(NAME, C, N, AR)                                                       \
  extern "C" __global__ void __launch_bounds__(128) NAME(const unsigned char* a,             \
                                                          const float* a_f32,                \
                                                          const unsigned char* b, float* d) { \
    cupaged::sm90::probe8<C, N, AR>(a, a_f32, b, d);                                         \
  }

CUPAGED_PROBE8(probe_e4m3_n64_ss, cupaged::fp8_e4m3_t, 64, 0)
CUPAGED_PROBE8(probe_e4m3_n128_rs, cupaged::fp8_e4m3_t, 128, 1)
CUPAGED_PROBE8(probe_e4m3_n256_ss, cupaged::fp8_e4m3_t, 256, 0)
CUPAGED_PROBE8(probe_e5m2_n64_rs, cupaged::fp8_e5m2_t, 64, 1)

#define CUPAGED_PROBE_T(NAME, HS, TN, TH)                                                      \
  extern "C" __global__ void __launch_bounds__(TH) NAME(const unsigned char* src,             \
                                                         unsigned char* out) {                \
    cupaged::sm90::probe_transpose<HS, TN, TH>(src, out);                                     \
  }

CUPAGED_PROBE_T(probe_transpose_h128_n128, 128, 128, 128)
CUPAGED_PROBE_T(probe_transpose_h64_n256, 64, 256, 128)
CUPAGED_PROBE_T(probe_transpose_h256_n128, 256, 128, 256)

#define CUPAGED_PROBE_ATT(NAME, C, HS, TILES)                                                   \
  extern "C" __global__ void __launch_bounds__(128)                                             \
      NAME(const unsigned char* q, const unsigned char* k, const unsigned char* v,              \
           float scale_log2, float v_scale, float* o, float* m, float* l, float* s) {           \
    cupaged::sm90::probe_fp8_attention<C, HS, TILES>(q, k, v, scale_log2, v_scale, o, m, l,   \
                                                     s);                                        \
  }

CUPAGED_PROBE_ATT(probe_fp8_attention_h128, cupaged::fp8_e4m3_t, 128, 2)
CUPAGED_PROBE_ATT(probe_fp8_attention_h64, cupaged::fp8_e4m3_t, 64, 3)
