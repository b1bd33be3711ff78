// Entry file for the cache kernels (see paged_decode.cu for how entry files are used).
//   nvcc -arch=sm_90 -cubin -std=c++17 -Xptxas -v -DCUPAGED_INSTANTIATE cuda_src/cache_ops.cu
#include "cache_ops.cuh"

#ifdef CUPAGED_INSTANTIATE
void cupaged_instantiate_cache_ops() {
  (void)&cupaged::reshape_and_cache<cupaged::half_t, cupaged::kFormatTokenMajor, long long>;
  (void)&cupaged::reshape_and_cache<cupaged::half_t, cupaged::kFormatVllm, int>;
  (void)&cupaged::copy_blocks<long long>;
}
#endif
