// Benchmark helper: keep the GPU busy for `ns` nanoseconds. Enqueued before a timed run,
// it lets the host finish enqueuing the run before the start event fires, so CUDA-event
// timings measure device time even for kernels shorter than their host-side launch.
extern "C" __global__ void cupaged_spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
