// Entry file for merging partial attention results by their log-sum-exp (see
// paged_decode.cu for how entry files are used). cupaged's JIT instantiates
//   cupaged::merge_states<cupaged::half_t>
// (the outputs' element type: float, cupaged::half_t or cupaged::bfloat16_t).
//
// It also compiles on its own, for resource reports and SASS reading:
//   nvcc -arch=sm_90 -cubin -std=c++17 -Xptxas -v -DCUPAGED_INSTANTIATE \
//        -DCUPAGED_T=cupaged::bfloat16_t cuda_src/merge_states.cu -o merge_states.cubin
#include "merge_states.cuh"

#ifdef CUPAGED_INSTANTIATE
#ifndef CUPAGED_T
#define CUPAGED_T cupaged::half_t
#endif
// Taking the kernel's address in host code makes nvcc instantiate it.
void cupaged_instantiate_merge_states() { (void)&cupaged::merge_states<CUPAGED_T>; }
#endif
