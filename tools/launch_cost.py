"""What one kernel launch costs the host on this machine, by what the launch carries: an
empty kernel, 36 eight-byte parameters, one 296-byte struct (the size of paged_decode's
parameters), through cupaged's Launcher (pack_into + cuLaunchKernel); and, for scale, a
small CuPy and torch elementwise op. Each: median over 7 runs of 200 launches, the GPU
idle between runs.   python3 tools/launch_cost.py   (GPU machine)"""

from __future__ import annotations


import cupy
import numpy as np

from cupaged import jit
from cupaged.bench import _host_us

_SRC = r"""
struct Big { long long v[37]; };
extern "C" __global__ void empty_kernel() {}
extern "C" __global__ void many_params(
    long long a0, long long a1, long long a2, long long a3, long long a4, long long a5,
    long long a6, long long a7, long long a8, long long a9, long long a10, long long a11,
    long long a12, long long a13, long long a14, long long a15, long long a16, long long a17,
    long long a18, long long a19, long long a20, long long a21, long long a22, long long a23,
    long long a24, long long a25, long long a26, long long a27, long long a28, long long a29,
    long long a30, long long a31, long long a32, long long a33, long long a34, long long a35) {
  if (a0 == 12345 && threadIdx.x == 0) printf("%lld\n", a35);
}
extern "C" __global__ void one_struct(const __grid_constant__ Big b) {
  if (b.v[0] == 12345 && threadIdx.x == 0) printf("%lld\n", b.v[36]);
}
"""


def main():
    mod = cupy.RawModule(code=_SRC)
    stream = cupy.cuda.get_current_stream().ptr
    empty = jit.Launcher(mod.get_function("empty_kernel").kernel, "", "empty")
    many = jit.Launcher(mod.get_function("many_params").kernel, "q" * 36, "many")
    one = jit.Launcher(mod.get_function("one_struct").kernel, "296s", "one")
    big = bytes(296)
    ints = tuple(range(36))
    rows = {
        "empty kernel, no parameters": lambda: empty((1, 1, 1), 32, 0, stream),
        "36 x 8-byte parameters": lambda: many((1, 1, 1), 32, 0, stream, *ints),
        "one 296-byte struct parameter": lambda: one((1, 1, 1), 32, 0, stream, big),
    }
    a = cupy.ones(1024, np.float32)
    c = cupy.empty_like(a)
    rows["cupy.add(a, a, out=c), 1024 floats"] = lambda: cupy.add(a, a, out=c)
    try:
        import torch

        ta = torch.ones(1024, device="cuda")
        tc = torch.empty_like(ta)
        rows["torch.add(a, a, out=c), 1024 floats"] = lambda: torch.add(ta, ta, out=tc)
    except ImportError:
        pass
    for name, fn in rows.items():
        print(f"{name:45s} {_host_us(fn, 200, 7):6.2f} us")


if __name__ == "__main__":
    main()
