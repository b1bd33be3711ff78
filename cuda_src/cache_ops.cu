// Entry file for the cache kernels (see paged_decode.cu for how entry files are used).
//   nvcc -arch=sm_90 -cubin -std=c++17 -Xptxas -v -DCUPAGED_INSTANTIATE cuda_src/cache_ops.cu
#include "cache_ops.cuh"

#ifdef CUPAGED_INSTANTIATE
void cupaged_instantiate_cache_ops() {
  using cupaged::bfloat16_t;
  using cupaged::half_t;
  (void)&cupaged::reshape_and_cache<half_t, half_t, cupaged::kFormatTokenMajor, 0, long long>;
  (void)&cupaged::reshape_and_cache<half_t, half_t, cupaged::kFormatVllm, 0, int>;
  (void)&cupaged::reshape_and_cache<half_t, cupaged::fp8_e4m3_t, cupaged::kFormatVllm, 0, int>;
  (void)&cupaged::reshape_and_cache<bfloat16_t, cupaged::fp8_e5m2_t, cupaged::kFormatTokenMajor,
                                    1, long long>;
  (void)&cupaged::copy_blocks<long long>;
  (void)&cupaged::concat_and_cache_mla<bfloat16_t, bfloat16_t, long long>;
  (void)&cupaged::concat_and_cache_mla<half_t, cupaged::fp8_e4m3_t, int>;
  (void)&cupaged::concat_and_cache_mla<bfloat16_t, cupaged::fp8_ds_mla_t, long long>;
  (void)&cupaged::concat_and_cache_mla<half_t, cupaged::fp8_ds_mla_t, int>;
  (void)&cupaged::concat_and_cache_mla<bfloat16_t, cupaged::v4_fp8_t, long long>;
  (void)&cupaged::concat_and_cache_mla<half_t, cupaged::v4_fp8_t, int>;
  (void)&cupaged::concat_and_cache_mla<bfloat16_t, cupaged::v4_fp4_t, int>;
  (void)&cupaged::concat_and_cache_mla<half_t, cupaged::v4_fp4_t, long long>;
  (void)&cupaged::indexer_k_quant_and_cache<bfloat16_t, long long>;
  (void)&cupaged::widen_sparse_rows<bfloat16_t, cupaged::fp8_ds_mla_t>;
  (void)&cupaged::indexer_k_quant_and_cache<half_t, int>;
}
#endif
