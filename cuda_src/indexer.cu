// Entry file for DSA's lightning indexer: its logits and their top-k (indexer.cuh). cupaged's JIT compiles it
// with NVRTC and instantiates the template by name expression, e.g.
//   cupaged::indexer_logits<cupaged::bfloat16_t, 64, 64>  (query type, heads, block size)
//
// It also compiles on its own, for resource reports and SASS reading:
//   nvcc -gencode=arch=compute_90,code=sm_90 -cubin -std=c++17 -Xptxas -v \
//        -DCUPAGED_INSTANTIATE cuda_src/indexer.cu -o indexer.cubin
#include "indexer.cuh"

#ifdef CUPAGED_INSTANTIATE
void cupaged_instantiate_indexer() {
  (void)&cupaged::indexer_logits<cupaged::bfloat16_t, 64, 64>;
  (void)&cupaged::indexer_logits<cupaged::half_t, 32, 16>;
  (void)&cupaged::indexer_topk<float>;
}
#endif
