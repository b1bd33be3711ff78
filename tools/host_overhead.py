#!/usr/bin/env python3
"""Host time per paged_attention call with the kernel cached (validation + launch), no
sync inside the loop. Not a test: run it on the device machine."""

import sys
import time
from pathlib import Path

import cProfile
import pstats

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy  # noqa: E402

from cupaged import bench  # noqa: E402

case = bench.DecodeCase(1, np.array([1024], np.int32), 32, 8, 128, 16, np.dtype(np.float16)).build()
out = cupy.empty(case.arrays["query"].shape, case.arrays["query"].dtype)
for partition in ("never", "always"):
    for _ in range(50):
        case.run(out, partition)
    cupy.cuda.Device().synchronize()
    n = 200  # few enough that the launch queue never fills and throttles the host
    t0 = time.perf_counter()
    for _ in range(n):
        case.run(out, partition)
    host = (time.perf_counter() - t0) / n * 1e6
    cupy.cuda.Device().synchronize()
    print(f"host time per call, partition={partition}: {host:.1f} us")

prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    case.run(out, "always")
prof.disable()
cupy.cuda.Device().synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(12)
