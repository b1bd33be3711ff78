// Entry file for the multi-token kernel. cupaged's JIT compiles this file with NVRTC (its
// quoted includes inlined) and instantiates the template by name expression, e.g.
//   cupaged::paged_prefill<cupaged::half_t, cupaged::half_t, 128, 16, 0, 0, 4, 1, 1, 64, 2, 0>
// (query type, cache type, head size, block size, KVFormat, KVScale, warps, m-atoms per
// warp, warps sharing each row (splitting a tile's keys), tile tokens, stages, variant bits
// of variants.cuh)
//
// It also compiles on its own, for resource reports and SASS reading:
//   nvcc -arch=sm_90 -cubin -std=c++17 -Xptxas -v -DCUPAGED_INSTANTIATE \
//        -DCUPAGED_T=cupaged::half_t -DCUPAGED_C=cupaged::fp8_e4m3_t -DCUPAGED_SCALE=0 \
//        -DCUPAGED_HS=128 -DCUPAGED_BS=16 -DCUPAGED_FORMAT=0 \
//        -DCUPAGED_WARPS=4 -DCUPAGED_MATOMS=1 -DCUPAGED_KEYWARPS=1 -DCUPAGED_TILE=64 \
//        -DCUPAGED_STAGES=2 -DCUPAGED_VARIANT=0 \
//        cuda_src/paged_prefill.cu -o prefill.cubin
#include "paged_prefill.cuh"

#ifdef CUPAGED_INSTANTIATE
#ifndef CUPAGED_T
#define CUPAGED_T cupaged::half_t
#endif
#ifndef CUPAGED_C
#define CUPAGED_C CUPAGED_T
#endif
#ifndef CUPAGED_SCALE
#define CUPAGED_SCALE 0
#endif
#ifndef CUPAGED_HS
#define CUPAGED_HS 128
#endif
#ifndef CUPAGED_BS
#define CUPAGED_BS 16
#endif
#ifndef CUPAGED_FORMAT
#define CUPAGED_FORMAT 0
#endif
#ifndef CUPAGED_WARPS
#define CUPAGED_WARPS 4
#endif
#ifndef CUPAGED_MATOMS
#define CUPAGED_MATOMS 1
#endif
#ifndef CUPAGED_KEYWARPS
#define CUPAGED_KEYWARPS 1
#endif
#ifndef CUPAGED_TILE
#define CUPAGED_TILE 64
#endif
#ifndef CUPAGED_STAGES
#define CUPAGED_STAGES 2
#endif
#ifndef CUPAGED_VARIANT
#define CUPAGED_VARIANT 0
#endif
void cupaged_instantiate_prefill() {
  (void)&cupaged::paged_prefill<CUPAGED_T, CUPAGED_C, CUPAGED_HS, CUPAGED_BS, CUPAGED_FORMAT,
                                CUPAGED_SCALE, CUPAGED_WARPS, CUPAGED_MATOMS, CUPAGED_KEYWARPS,
                                CUPAGED_TILE, CUPAGED_STAGES, CUPAGED_VARIANT>;
}
#endif
