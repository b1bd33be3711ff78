"""Positive controls for tools/sanitize.sh: two deliberately faulty kernels in namespace
cupaged, so a sanitizer run that reports nothing is known to have instrumented the library's
kernels (its --kernel-name filter matched) and not to have skipped them.
    compute-sanitizer --tool memcheck  --kernel-name kns=cupaged python3 tools/sanitize_control.py oob-near
    compute-sanitizer --tool racecheck --kernel-name kns=cupaged python3 tools/sanitize_control.py race
Each must end with a non-zero error count."""
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
}
"""

which = sys.argv[1]
cupy.cuda.set_allocator(None)  # the buffer its own allocation, as CUPAGED_TEST_NO_POOL does
mod = cupy.RawModule(code=SOURCE, name_expressions=["cupaged::control_oob", "cupaged::control_race"])
if which.startswith("oob"):
    # oob-near: one element past the end; oob-far: 1 GiB past it.
    buf = cupy.zeros(32, cupy.float32)
    past = 1 if which == "oob-near" else 1 << 28
    mod.get_function("cupaged::control_oob")((1,), (1,), (buf, cupy.int32(32), cupy.int32(past)))
else:
    buf = cupy.zeros(64, cupy.float32)
    mod.get_function("cupaged::control_race")((1,), (64,), (buf,))
try:
    cupy.cuda.runtime.deviceSynchronize()
except Exception as e:  # memcheck turns the launch's fault into an error here
    print(f"launch error (expected under memcheck): {e}")
print(f"control {which} ran")
