"""Positive controls for tools/sanitize.sh: two deliberately faulty kernels in namespace
cupaged, so a sanitizer run that reports nothing is known to have instrumented the library's
kernels (its --kernel-name filter matched) and not to have skipped them.
    compute-sanitizer --tool memcheck  --kernel-name kns=cupaged python3 tools/sanitize_control.py oob-near
    compute-sanitizer --tool racecheck --kernel-name kns=cupaged python3 tools/sanitize_control.py race
Each must end with a non-zero error count.
    ... python3 tools/sanitize_control.py arrive
is a correct kernel instead: a hand-off through bar.arrive / bar.sync (mla_attention_sm90's
pattern for P and its factors), whose racecheck report says whether the tool orders a
thread's accesses before its bar.arrive against the waiting threads' accesses after their
bar.sync."""
import sys

import cupy

SOURCE = r"""
namespace cupaged {
// Writes `past` elements past the end of an n-element buffer.
__global__ void control_oob(float* p, int n, int past) { p[n - 1 + past] = 1.f; }
// Thread t reads the slot thread t + 1 writes, with no barrier between.
__global__ void control_race(float* out) {
  __shared__ float s[64];
  s[threadIdx.x] = threadIdx.x;
  out[threadIdx.x] = s[(threadIdx.x + 1) % 64];
}
// 256 threads, two passes of four rounds: threads 0-127 write s, threads 128-255 read it
// after named barrier 2 (both sync), then only arrive on barrier 1, which the writers sync
// on before the next round's writes; after each pass the writers publish m through
// __syncthreads and every thread reads it. Race-free (mla_attention_sm90's row tiles).
__global__ void control_arrive(float* out) {
  __shared__ float s[128], m[128];
  const int t = threadIdx.x;
  float acc = 0.f;
  for (int pass = 0; pass < 2; ++pass) {
    __syncthreads();  // the previous pass's reads of m are done
    for (int it = 0; it < 4; ++it) {
      if (t < 128) {
        if (it > 0) asm volatile("bar.sync 1, 256;" ::: "memory");
        s[t] = t + it;
      }
      asm volatile("bar.sync 2, 256;" ::: "memory");
      if (t >= 128) {
        acc += s[t - 128];
        if (it + 1 < 4) asm volatile("bar.arrive 1, 256;" ::: "memory");
      }
    }
    if (t < 128) m[t] = pass;
    __syncthreads();
    acc += m[t % 128];
  }
  out[t] = acc;
}
}
"""

which = sys.argv[1]
cupy.cuda.set_allocator(None)  # the buffer its own allocation, as CUPAGED_TEST_NO_POOL does
mod = cupy.RawModule(code=SOURCE, name_expressions=["cupaged::control_oob", "cupaged::control_race",
                                                    "cupaged::control_arrive"])
if which.startswith("oob"):
    # oob-near: one element past the end; oob-far: 1 GiB past it.
    buf = cupy.zeros(32, cupy.float32)
    past = 1 if which == "oob-near" else 1 << 28
    mod.get_function("cupaged::control_oob")((1,), (1,), (buf, cupy.int32(32), cupy.int32(past)))
elif which == "arrive":
    buf = cupy.zeros(256, cupy.float32)
    mod.get_function("cupaged::control_arrive")((1,), (256,), (buf,))
    want = [2 * sum(t - 128 + it for it in range(4)) * (t >= 128) + 1 for t in range(256)]
    assert buf.get().tolist() == want, "the hand-off kernel computed a wrong sum"
else:
    buf = cupy.zeros(64, cupy.float32)
    mod.get_function("cupaged::control_race")((1,), (64,), (buf,))
try:
    cupy.cuda.runtime.deviceSynchronize()
except Exception as e:  # memcheck turns the launch's fault into an error here
    print(f"launch error (expected under memcheck): {e}")
print(f"control {which} ran")
