// Entry file for the Hopper multi-token kernel (paged_prefill_sm90.cuh). cupaged's JIT
// compiles it with NVRTC for sm_90a and instantiates the template by name expression, e.g.
//   cupaged::paged_prefill_sm90<cupaged::bfloat16_t, cupaged::bfloat16_t, 128, 16, 0, 128, 3, 0>
// (output and query type, cache type, head size, block size, KVFormat, tile tokens, stages,
// variant bits, and for an 8-bit query its type, the cache's: 8-bit products)
//
// It also compiles on its own, for resource reports and SASS reading:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -cubin -std=c++17 -Xptxas -v \
//        -DCUPAGED_INSTANTIATE -DCUPAGED_T=cupaged::bfloat16_t -DCUPAGED_C=cupaged::fp8_e4m3_t \
//        -DCUPAGED_HS=128 -DCUPAGED_BS=16 -DCUPAGED_FORMAT=0 -DCUPAGED_TILE=64 -DCUPAGED_STAGES=3 \
//        -DCUPAGED_VARIANT=0 \
//        cuda_src/paged_prefill_sm90.cu -o prefill_sm90.cubin
#include "paged_prefill_sm90.cuh"

#ifdef CUPAGED_INSTANTIATE
#ifndef CUPAGED_T
#define CUPAGED_T cupaged::bfloat16_t
#endif
#ifndef CUPAGED_C
#define CUPAGED_C CUPAGED_T
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
#ifndef CUPAGED_TILE
#define CUPAGED_TILE 128
#endif
#ifndef CUPAGED_STAGES
#define CUPAGED_STAGES 3
#endif
#ifndef CUPAGED_VARIANT
#define CUPAGED_VARIANT 0
#endif
#ifndef CUPAGED_Q
#define CUPAGED_Q CUPAGED_T
#endif
void cupaged_instantiate_prefill_sm90() {
  (void)&cupaged::paged_prefill_sm90<CUPAGED_T, CUPAGED_C, CUPAGED_HS, CUPAGED_BS,
                                     CUPAGED_FORMAT, CUPAGED_TILE, CUPAGED_STAGES,
                                     CUPAGED_VARIANT, CUPAGED_Q>;
}
#endif
