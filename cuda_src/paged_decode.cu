// Entry file for the decode kernels. cupaged's JIT compiles this file with NVRTC (its
// quoted includes inlined) and instantiates the templates by name expression, e.g.
//   cupaged::paged_decode<cupaged::half_t, cupaged::half_t, 128, 16, 1, 0, 4, 64, 2, 0>
// (query type, cache type, head size, block size, KVFormat, KVScale, group tile, tile
// tokens, stages, variant bits of variants.cuh)
//
// It also compiles on its own, for resource reports and SASS reading:
//   nvcc -arch=sm_90 -cubin -std=c++17 -Xptxas -v -DCUPAGED_INSTANTIATE \
//        -DCUPAGED_T=cupaged::half_t -DCUPAGED_C=cupaged::fp8_e4m3_t -DCUPAGED_HS=128 \
//        -DCUPAGED_BS=16 -DCUPAGED_FORMAT=1 -DCUPAGED_SCALE=0 -DCUPAGED_GT=4 -DCUPAGED_TILE=64 \
//        -DCUPAGED_STAGES=2 -DCUPAGED_VARIANT=0 cuda_src/paged_decode.cu -o decode.cubin
// (tools/kernel_report.py spec reports the same specialization as NVRTC builds it.)
#include "paged_decode.cuh"

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
#define CUPAGED_FORMAT 1
#endif
#ifndef CUPAGED_GT
#define CUPAGED_GT 4
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
// Taking the kernels' addresses in host code makes nvcc instantiate them.
void cupaged_instantiate_decode() {
  (void)&cupaged::paged_decode<CUPAGED_T, CUPAGED_C, CUPAGED_HS, CUPAGED_BS, CUPAGED_FORMAT,
                               CUPAGED_SCALE, CUPAGED_GT, CUPAGED_TILE, CUPAGED_STAGES,
                               CUPAGED_VARIANT>;
  (void)&cupaged::paged_decode_combine<CUPAGED_T, CUPAGED_HS>;
}
#endif
