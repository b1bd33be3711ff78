// Entry file for absorbed MLA over a paged latent cache (mla_attention.cuh), and its sparse
// form (mla_sparse_attention: DeepSeek's DSA over top-k indices). cupaged's JIT
// compiles it with NVRTC and instantiates the template by name expression, e.g.
//   cupaged::mla_attention<cupaged::bfloat16_t, cupaged::bfloat16_t, 512, 64, 64, 16, 32, 3>
// (query type, cache type, kv_lora_rank, rope dims, block size, rows per CTA, tile tokens,
// stages; the sparse kernel then its variant)
//
// It also compiles on its own, for resource reports and SASS reading:
//   nvcc -gencode=arch=compute_90,code=sm_90 -cubin -std=c++17 -Xptxas -v \
//        -DCUPAGED_INSTANTIATE -DCUPAGED_ROWS=64 cuda_src/mla_attention.cu -o mla.cubin
// (-DCUPAGED_C=cupaged::fp8_ds_mla_t for V3.2's rows; -DCUPAGED_C=cupaged::v4_fp8_t or
// cupaged::v4_fp4_t with -DCUPAGED_ROPE=0 for V4's: the sparse kernel alone reads them)
#include "mla_attention.cuh"

#ifdef CUPAGED_INSTANTIATE
#ifndef CUPAGED_T
#define CUPAGED_T cupaged::bfloat16_t
#endif
#ifndef CUPAGED_C
#define CUPAGED_C CUPAGED_T
#endif
#ifndef CUPAGED_BS
#define CUPAGED_BS 64
#endif
#ifndef CUPAGED_ROWS
#define CUPAGED_ROWS 16
#endif
#ifndef CUPAGED_TILE
#define CUPAGED_TILE 32
#endif
#ifndef CUPAGED_STAGES
#define CUPAGED_STAGES 3
#endif
#ifndef CUPAGED_ROPE
#define CUPAGED_ROPE 64
#endif
#ifndef CUPAGED_VARIANT  // the sparse kernel's: 64 (kVarSecondCache) reads a second cache
#define CUPAGED_VARIANT 0
#endif
void cupaged_instantiate_mla() {
#if CUPAGED_ROPE != 0  // (the paged kernel reads no V4 rows)
  (void)&cupaged::mla_attention<CUPAGED_T, CUPAGED_C, 512, CUPAGED_ROPE, CUPAGED_BS,
                                CUPAGED_ROWS, CUPAGED_TILE, CUPAGED_STAGES>;
#endif
  (void)&cupaged::mla_sparse_attention<CUPAGED_T, CUPAGED_C, 512, CUPAGED_ROPE, CUPAGED_BS,
                                       CUPAGED_ROWS, CUPAGED_TILE, CUPAGED_STAGES,
                                       CUPAGED_VARIANT>;
}
#endif
