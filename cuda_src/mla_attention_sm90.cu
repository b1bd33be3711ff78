// Entry file for absorbed MLA on Hopper's wgmma (mla_attention_sm90.cuh), paged and sparse
// (mla_sparse_attention_sm90: DeepSeek's DSA over top-k indices). cupaged's JIT
// compiles it with NVRTC for sm_90a and instantiates the template by name expression, e.g.
//   cupaged::mla_attention_sm90<cupaged::bfloat16_t, cupaged::fp8_e4m3_t, 512, 64, 64>
// (query type, cache type: the query's or fp8, kv_lora_rank, rope dims, block size; the
// sparse kernel then its variant: 0, or 64 for a second cache)
//
// It also compiles on its own, for resource reports and SASS reading:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -cubin -std=c++17 -Xptxas -v \
//        -DCUPAGED_INSTANTIATE cuda_src/mla_attention_sm90.cu -o mla_sm90.cubin
#include "mla_attention_sm90.cuh"

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
#ifndef CUPAGED_VARIANT  // the sparse kernel's: 0, or kVarSecondCache (64)
#define CUPAGED_VARIANT 0
#endif
void cupaged_instantiate_mla_sm90() {
  (void)&cupaged::mla_attention_sm90<CUPAGED_T, CUPAGED_C, 512, 64, CUPAGED_BS>;
  (void)&cupaged::mla_sparse_attention_sm90<CUPAGED_T, CUPAGED_C, 512, 64, CUPAGED_BS,
                                            CUPAGED_VARIANT>;
#ifdef CUPAGED_DS_MLA  // DeepSeek's token rows: V3.2's, then V4's (512 dims, rope inside)
  (void)&cupaged::mla_sparse_attention_sm90<cupaged::bfloat16_t, cupaged::fp8_ds_mla_t, 512, 64,
                                            CUPAGED_BS, CUPAGED_VARIANT>;
  (void)&cupaged::mla_sparse_attention_sm90<cupaged::bfloat16_t, cupaged::v4_fp8_t, 512, 0,
                                            CUPAGED_BS, CUPAGED_VARIANT>;
  (void)&cupaged::mla_sparse_attention_sm90<cupaged::bfloat16_t, cupaged::v4_fp4_t, 512, 0,
                                            CUPAGED_BS, CUPAGED_VARIANT>;
#endif
}
#endif
