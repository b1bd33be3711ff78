// Hopper (sm_90a) device pieces: wgmma operands in shared memory (128-byte swizzled
// tiles and their matrix descriptors), wgmma.mma_async for 16-bit inputs with fp32 sums,
// and mbarriers for producer/consumer pipelines.
//
// Layouts, as the PTX ISA's "asynchronous warpgroup level matrix shared memory layout":
// a tile of 16-bit elements is stored in 128-byte rows of 64 elements, eight rows to a
// 1024-byte swizzle atom, 16-byte chunk c of row r at chunk c ^ (r % 8), so that any eight
// rows' chunk c fall in distinct bank groups. Wider tiles are blocks of 64 elements
// (along the contiguous dimension), one after the other.
//   K-major (the reduction dimension contiguous: Q [rows][head_size], K [tokens][head_size]):
//     element (r, k) at block k / 64, row r, chunk (k % 64) / 8.
//   MN-major (the other dimension contiguous: V [tokens][head_size] as B of P V):
//     element (k, n) at block n / 64, row k, chunk (n % 64) / 8.
// A tile's base must be 1024-byte aligned (the swizzle's phase is its address bits 7-9).
//
// Needs sm_90a: compile with -arch=sm_90a (NVRTC) or -gencode=arch=compute_90a,code=sm_90a.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#error "sm90.cuh needs sm_90a (wgmma, setmaxnreg)"
#endif

namespace cupaged {
struct fp8_e4m3_t;  // fp8.cuh: the 8-bit wgmma forms below name them (sm90_fp8.cuh uses them)
struct fp8_e5m2_t;
namespace sm90 {

// ---- shared-memory tiles and descriptors ----------------------------------------------

// Byte offset of element (row, col) of a 128-byte-swizzled tile whose contiguous dimension
// is `col` and which has `rows` rows per 64-column block.
__device__ __forceinline__ unsigned sw128_offset(int row, int col, int rows) {
  const unsigned chunk = static_cast<unsigned>((col & 63) >> 3) ^ static_cast<unsigned>(row & 7);
  return static_cast<unsigned>((col >> 6) * rows * 128 + row * 128) + (chunk << 4) +
         static_cast<unsigned>((col & 7) * 2);
}

// Shared-memory accesses by shared-window address (volatile, ordered as written: the callers
// order them against copies and tensor-core reads with barriers and proxy fences).
__device__ __forceinline__ unsigned ld_shared_u32(unsigned addr) {
  unsigned v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_v4(unsigned addr, unsigned a, unsigned b, unsigned c,
                                             unsigned d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b),
               "r"(c), "r"(d)
               : "memory");
}
__device__ __forceinline__ void st_shared_v4(unsigned addr, const uint4& v) {
  st_shared_v4(addr, v.x, v.y, v.z, v.w);
}
__device__ __forceinline__ void st_shared_zero16(unsigned addr) {
  st_shared_v4(addr, 0u, 0u, 0u, 0u);
}

// The same for a tile of 8-bit elements, `col` counted in bytes (128 a row): the 16-byte
// chunks fall where those of 16-bit elements do.
__device__ __forceinline__ unsigned sw128_offset8(int row, int col, int rows) {
  return sw128_offset(row, col >> 1, rows) + static_cast<unsigned>(col & 1);
}

// A wgmma matrix descriptor: start address, leading and stride byte offsets (16-byte
// units), 128-byte swizzle (mode 1, bits 62-63). `smem_addr`: a shared-window address.
__device__ __forceinline__ unsigned long long sw128_desc(unsigned smem_addr, unsigned lbo_bytes,
                                                        unsigned sbo_bytes) {
  unsigned long long d = 0;
  d |= static_cast<unsigned long long>((smem_addr & 0x3FFFF) >> 4);
  d |= static_cast<unsigned long long>((lbo_bytes & 0x3FFFF) >> 4) << 16;
  d |= static_cast<unsigned long long>((sbo_bytes & 0x3FFFF) >> 4) << 32;
  d |= 1ull << 62;
  return d;
}

// K-major operand, one k16 step at element column k0 (a multiple of 16) of a tile with
// `rows` rows per 64-column block (8-bit elements: the k32 step at byte column 2 * k0):
// the 1024-byte atoms of 8 rows follow one another (SBO 1024); the leading offset is
// unused by a swizzled K-major layout.
__device__ __forceinline__ unsigned long long kmajor_desc(unsigned tile, int k0, int rows) {
  return sw128_desc(tile + static_cast<unsigned>((k0 >> 6) * rows * 128 + (k0 & 63) * 2), 16,
                    1024);
}

// MN-major operand (B of P V: [K rows][N columns], N contiguous), the k16 step at row k0
// (a multiple of 16), N columns from column n0 (a multiple of 64) of a tile with `rows`
// rows per 64-column block: 8-row groups along K 1024 bytes apart (SBO), 64-column blocks
// along N rows * 128 bytes apart (LBO).
__device__ __forceinline__ unsigned long long mnmajor_desc(unsigned tile, int k0, int n0,
                                                          int rows) {
  return sw128_desc(tile + static_cast<unsigned>((n0 >> 6) * rows * 128 + k0 * 128),
                    static_cast<unsigned>(rows * 128), 1024);
}

// A descriptor built once for a tile whose k-steps (or column blocks) sit at constant byte
// offsets from its start: `at(off)` adds off / 16 to the low word's 14-bit address field
// (a shared-window address plus offset stays below 256 KB, the field's reach, since
// Hopper's window is 228 KB: nothing carries out of it), one add a wgmma instead of the
// masks and shifts of sw128_desc.
struct DescBase {
  unsigned lo, hi;
  __device__ __forceinline__ unsigned long long at(unsigned byte_off) const {
    return (static_cast<unsigned long long>(hi) << 32) | (lo + (byte_off >> 4));
  }
};
__device__ __forceinline__ DescBase desc_base(unsigned long long d) {
  return {static_cast<unsigned>(d), static_cast<unsigned>(d >> 32)};
}
// kmajor_desc(tile, k0, rows) == kmajor_base(tile).at(kmajor_off(k0, rows))
__device__ __forceinline__ DescBase kmajor_base(unsigned tile) {
  return desc_base(kmajor_desc(tile, 0, 64));
}
__host__ __device__ constexpr unsigned kmajor_off(int k0, int rows) {
  return static_cast<unsigned>((k0 >> 6) * rows * 128 + (k0 & 63) * 2);
}
// mnmajor_desc(tile, k0, n0, rows) == mnmajor_base(tile, rows).at(mnmajor_off(k0, n0, rows))
__device__ __forceinline__ DescBase mnmajor_base(unsigned tile, int rows) {
  return desc_base(mnmajor_desc(tile, 0, 0, rows));
}
__host__ __device__ constexpr unsigned mnmajor_off(int k0, int n0, int rows) {
  return static_cast<unsigned>((n0 >> 6) * rows * 128 + k0 * 128);
}

// Shared memory written by ordinary stores that wgmma (the async proxy) reads next: each
// writing thread fences before the barrier that publishes it.
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- wgmma --------------------------------------------------------------------------------

// Keeps the compiler from moving other register work on `r` across a wgmma fence or wait
// (an empty asm that reads and writes each one): accumulators must not be touched while
// an asynchronous wgmma owns them.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// (register A fragments: their registers stay untouched until the wgmma reading them is done)
template <int N>
__device__ __forceinline__ void fence_regs(unsigned (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int M, int N, typename R>
__device__ __forceinline__ void fence_regs(R (&r)[M][N]) {
#pragma unroll
  for (int m = 0; m < M; ++m) fence_regs(r[m]);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The fp32 accumulator of m64nNk16, per thread (warp w of the warpgroup owns rows
// 16w .. 16w + 15): d[4j + 0..3] are (16w + lane/4, 8j + 2(lane%4) + {0,1}) and
// (16w + lane/4 + 8, 8j + 2(lane%4) + {0,1}), as mma.m16n8's C fragment per 8 columns.
// The A fragment from registers (RS) is mma.m16n8k16's: a[0] (row lane/4, k 2(lane%4)),
// a[1] (row + 8), a[2] (k + 8), a[3] (row + 8, k + 8), two 16-bit values each.

// D (+)= A B with fp32 sums. 16-bit T (bfloat16_t, half_t): k16 a step; ss takes A
// [64 x 16] from shared memory (a descriptor), rs from registers (the fragment above); B
// [16 x N] is always in shared memory, MN-major when TRANS_B (N contiguous), else K-major.
// 8-bit T (fp8_e4m3_t, fp8_e5m2_t, fp8.cuh): k32 a step, both operands K-major (wgmma has
// no transposed form for 8-bit inputs, so TRANS_B must be 0), A from registers as
// sm90_fp8.cuh's fp8_a_fragment packs it. scale_d 0 overwrites D. One specialization per
// (T, N) the kernels use; another N is one line below.
template <typename T, int N, int TRANS_B>
struct Wgmma;

// The accumulator's operands (N / 2 fp32 registers a thread) as asm text and constraints,
// each list the one before it and the rest.
#define CUPAGED_WGMMA_D16_STR \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define CUPAGED_WGMMA_D16_OUT \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
  "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
  "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define CUPAGED_WGMMA_D32_STR CUPAGED_WGMMA_D16_STR ", " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define CUPAGED_WGMMA_D32_OUT CUPAGED_WGMMA_D16_OUT, \
  "+f"(d[16]), "+f"(d[17]), \
  "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
  "+f"(d[30]), "+f"(d[31])
#define CUPAGED_WGMMA_D64_STR CUPAGED_WGMMA_D32_STR ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CUPAGED_WGMMA_D64_OUT CUPAGED_WGMMA_D32_OUT, \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), \
  "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), \
  "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), \
  "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), \
  "+f"(d[62]), "+f"(d[63])
#define CUPAGED_WGMMA_D128_STR CUPAGED_WGMMA_D64_STR ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define CUPAGED_WGMMA_D128_OUT CUPAGED_WGMMA_D64_OUT, \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), \
  "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), \
  "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), \
  "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), \
  "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), \
  "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), \
  "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), \
  "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), \
  "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// The wgmma for one (T, N): SHAPE is "m64n<N>k16" or "m64n<N>k32"; R is N / 2, the first
// operand number after D, spelled out (R1 = R + 1, ...) since asm text cannot compute it.
// The 16-bit forms end with imm-trans-b, the operand TRANS_B (TRANS_IN passes it); the
// 8-bit forms end at imm-scale-b, having no transpose operands.
#define CUPAGED_WGMMA_FORMS(TY, PTX, N, SHAPE, DSTR, DOUT, SS_TAIL, SS_PRED, RS_TAIL,            \
                            RS_PRED, TRANS_IN)                                                    \
template <int TRANS_B>                                                                            \
struct Wgmma<TY, N, TRANS_B> {                                                                    \
  static_assert(TRANS_B == 0 || sizeof(TY) == 2, "8-bit wgmma operands are K-major only");       \
  __device__ __forceinline__ static void ss(float (&d)[N / 2], unsigned long long a,              \
                                            unsigned long long b, int scale_d) {                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_PRED ", 0;\n"                              \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." PTX "." PTX " {" DSTR "}, "         \
                 SS_TAIL ";\n}\n"                                                                 \
                 : DOUT                                                                           \
                 : "l"(a), "l"(b), "r"(scale_d) TRANS_IN);                                        \
  }                                                                                               \
  __device__ __forceinline__ static void rs(float (&d)[N / 2], const unsigned (&a)[4],            \
                                            unsigned long long b, int scale_d) {                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_PRED ", 0;\n"                              \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." PTX "." PTX " {" DSTR "}, "         \
                 RS_TAIL ";\n}\n"                                                                 \
                 : DOUT                                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d) TRANS_IN);    \
  }                                                                                               \
};

#define CUPAGED_WGMMA_TRANS_IN , "n"(TRANS_B)

// 16-bit: ss "%R, %R1, p, 1, 1, 0, %R3" (A not transposed), rs "{%R..%R3}, %R4, p, 1, 1,
// %R6"; the predicate from scale_d (%R2, %R5).
#define CUPAGED_WGMMA_16(TY, PTX, N, D, R, R1, R2, R3, R4, R5, R6)                                \
  CUPAGED_WGMMA_FORMS(TY, PTX, N, "m64n" #N "k16", CUPAGED_WGMMA_D##D##_STR,                      \
                      CUPAGED_WGMMA_D##D##_OUT, "%" #R ", %" #R1 ", p, 1, 1, 0, %" #R3, "%" #R2,  \
                      "{%" #R ", %" #R1 ", %" #R2 ", %" #R3 "}, %" #R4 ", p, 1, 1, %" #R6,        \
                      "%" #R5, CUPAGED_WGMMA_TRANS_IN)
// 8-bit: ss "%R, %R1, p, 1, 1", rs "{%R..%R3}, %R4, p, 1, 1".
#define CUPAGED_WGMMA_8(TY, PTX, N, D, R, R1, R2, R3, R4, R5)                                     \
  CUPAGED_WGMMA_FORMS(TY, PTX, N, "m64n" #N "k32", CUPAGED_WGMMA_D##D##_STR,                      \
                      CUPAGED_WGMMA_D##D##_OUT, "%" #R ", %" #R1 ", p, 1, 1", "%" #R2,            \
                      "{%" #R ", %" #R1 ", %" #R2 ", %" #R3 "}, %" #R4 ", p, 1, 1", "%" #R5, )

CUPAGED_WGMMA_16(bfloat16_t, "bf16", 32, 16, 16, 17, 18, 19, 20, 21, 22)
CUPAGED_WGMMA_16(bfloat16_t, "bf16", 64, 32, 32, 33, 34, 35, 36, 37, 38)
CUPAGED_WGMMA_16(bfloat16_t, "bf16", 128, 64, 64, 65, 66, 67, 68, 69, 70)
CUPAGED_WGMMA_16(bfloat16_t, "bf16", 256, 128, 128, 129, 130, 131, 132, 133, 134)
CUPAGED_WGMMA_16(half_t, "f16", 32, 16, 16, 17, 18, 19, 20, 21, 22)
CUPAGED_WGMMA_16(half_t, "f16", 64, 32, 32, 33, 34, 35, 36, 37, 38)
CUPAGED_WGMMA_16(half_t, "f16", 128, 64, 64, 65, 66, 67, 68, 69, 70)
CUPAGED_WGMMA_16(half_t, "f16", 256, 128, 128, 129, 130, 131, 132, 133, 134)
CUPAGED_WGMMA_8(fp8_e4m3_t, "e4m3", 64, 32, 32, 33, 34, 35, 36, 37)
CUPAGED_WGMMA_8(fp8_e4m3_t, "e4m3", 128, 64, 64, 65, 66, 67, 68, 69)
CUPAGED_WGMMA_8(fp8_e4m3_t, "e4m3", 256, 128, 128, 129, 130, 131, 132, 133)
CUPAGED_WGMMA_8(fp8_e5m2_t, "e5m2", 64, 32, 32, 33, 34, 35, 36, 37)
CUPAGED_WGMMA_8(fp8_e5m2_t, "e5m2", 128, 64, 64, 65, 66, 67, 68, 69)
CUPAGED_WGMMA_8(fp8_e5m2_t, "e5m2", 256, 128, 128, 129, 130, 131, 132, 133)
#undef CUPAGED_WGMMA_8
#undef CUPAGED_WGMMA_16
#undef CUPAGED_WGMMA_TRANS_IN
#undef CUPAGED_WGMMA_FORMS
#undef CUPAGED_WGMMA_D16_STR
#undef CUPAGED_WGMMA_D16_OUT
#undef CUPAGED_WGMMA_D32_STR
#undef CUPAGED_WGMMA_D32_OUT
#undef CUPAGED_WGMMA_D64_STR
#undef CUPAGED_WGMMA_D64_OUT
#undef CUPAGED_WGMMA_D128_STR
#undef CUPAGED_WGMMA_D128_OUT

// ---- mbarriers and register budgets ----------------------------------------------------

// A shared-memory mbarrier (`addr`: its shared-window address, 8-byte aligned) expecting
// `count` arrivals per phase; published to the CTA by a barrier after init.
__device__ __forceinline__ void mbar_init(unsigned addr, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}

// This thread's arrival on `addr` once all of its earlier cp.async copies have landed (the
// barrier's expected count includes it: noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned addr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(addr) : "memory");
}

// Wait until the phase of parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(unsigned addr, unsigned phase) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(addr),
      "r"(phase)
      : "memory");
}

// ---- bulk copies: global -> shared through the async proxy, counted on an mbarrier ------
//
// A bulk copy (cp.async.bulk, sm_90) moves a contiguous run of bytes by the copy engine,
// one instruction for the whole run, and reports completion as transactions (bytes) on an
// mbarrier. A phase of such a barrier completes when its expected arrivals have arrived
// and its transaction count is back at zero: each thread that issues copies first raises
// the count by their bytes (mbar_arrive_expect_tx, its arrival included), then issues
// them, so the count cannot reach zero before every copy of the phase was announced.
// Waiting on the phase (mbar_wait) then makes the copied bytes visible to ordinary loads.
// The other direction, re-filling shared memory that ordinary loads read before, needs
// those loads ordered before the copy: a barrier from the readers to the issuing thread
// (an mbarrier arrival and wait, or a named barrier), then fence_async_smem() by the
// issuing thread, as for any generic-proxy access before an async-proxy one.

// Publishes the mbarrier inits before them to the async proxy (the bulk copies'
// complete_tx): after the inits, before the barrier that publishes them to the CTA.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// This thread's arrival on `addr` (shared-window address), after raising the current
// phase's expected transaction count by `bytes` (0: a plain arrival).
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned addr, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr),
               "r"(bytes)
               : "memory");
}

// One probe of mbar_wait's: has the phase of parity `phase` completed?
__device__ __forceinline__ bool mbar_try_wait(unsigned addr, unsigned phase) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(addr), "r"(phase)
      : "memory");
  return done != 0;
}

// `bytes` from global `src` to shared `dst` (shared-window address), completed as
// `bytes` transactions on the mbarrier at `bar` (of this CTA). `src`, `dst` and `bytes`
// must be multiples of 16. One issuing thread per copy: the instruction takes its
// operands in uniform registers, so a warp whose lanes issue copies of their own runs
// them one lane at a time (ptxas loops over the active lanes).
__device__ __forceinline__ void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes,
                                              unsigned bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// ---- tensor copies (TMA): boxes of a tensor map, global -> shared ------------------------
//
// A tensor map (cuda.h's CUtensorMap: 128 opaque bytes, 64-byte aligned, made on the host
// by cuTensorMapEncodeTiled) describes a global tensor of up to five dimensions and a box;
// one instruction copies the box at given coordinates into shared memory, here with the
// 128-byte swizzle that sw128_offset mirrors (a box whose rows are 128 bytes lands as a
// [rows][128 bytes] tile of the layout, its base 1024-byte aligned or a multiple of eight
// rows on), and completes as transactions on an mbarrier, as bulk_copy_g2s does. The map
// is read through its address: a __grid_constant__ kernel parameter's.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

// The box of `map` at (c0, c1, c2) (innermost first) into `dst` (shared-window address),
// counted on the mbarrier at `bar`.
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TensorMap* map, int c0, int c1,
                                            int c2, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Named barrier `id` over COUNT threads that also ANDs a predicate over them: true in
// every thread when it was true in every thread.
template <int COUNT>
__device__ __forceinline__ bool named_bar_and(int id, bool pred) {
  unsigned all;
  asm volatile(
      "{\n.reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "bar.red.and.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(all)
      : "r"(static_cast<unsigned>(pred)), "r"(id), "n"(COUNT)
      : "memory");
  return all != 0;
}

// True in one lane of the (converged, whole) warp. Work under it whose operands are the
// same in every lane (warp-uniform) runs once, in uniform registers: a bulk copy issued so
// takes one instruction, where lanes of different operands take a loop over the lanes.
__device__ __forceinline__ bool elect_one() {
  unsigned elected;
  asm volatile(
      "{\n.reg .pred p;\n"
      "elect.sync _|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(elected));
  return elected != 0;
}

// Registers per thread of the calling warpgroup (a multiple of 8, 24 to 256): producers
// give theirs up (dec) so the consumers can take more (inc). Takes effect only in a kernel
// with a register cap at entry (__launch_bounds__(threads, 1)).
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

}  // namespace sm90
}  // namespace cupaged
