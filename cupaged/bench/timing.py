"""Timing on the device: CUDA-event times with the L2 flushed and a busy-wait ahead of each
run, the device's copy bandwidth, host time per call, and an NVTX-ranged call for Nsight
Compute (``CUPAGED_BENCH_NVTX=1``: every timed call of a cupaged-bench row runs once more
inside the range "timed", which ``ncu --nvtx --nvtx-include timed/`` profiles alone;
``tools/device.sh profile`` runs a bench command so)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import cupy
import numpy as np



@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    runs: int


class _L2Flusher:
    """Writes a buffer twice the L2's size, so each timed run starts with a cold cache."""

    def __init__(self):
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.buf = cupy.empty(max(2 * props["l2CacheSize"], 1 << 20), dtype=np.uint8)

    def __call__(self):
        self.buf.fill(0)


class Spin:
    """Busy-waits the GPU (cuda_src/bench_spin.cu), so the host has enqueued a timed run
    before its start event fires: the events then bracket device time only, however
    long the call's host side takes."""

    def __init__(self, us: float):
        from .. import jit

        src = (jit.source_dir() / "bench_spin.cu").read_text()
        self.kernel = cupy.RawModule(code=src).get_function("cupaged_spin")
        self.ns = np.uint64(us * 1000)

    def __call__(self):
        self.kernel((1,), (1,), (self.ns,))


def nvtx_wanted() -> bool:
    """Whether timed calls also run once in the NVTX range "timed" (CUPAGED_BENCH_NVTX)."""
    return os.environ.get("CUPAGED_BENCH_NVTX", "").strip().lower() in ("1", "true", "yes", "on")


def time_us(fn, *, warmup: int = 3, reps: int = 30, flush_l2: bool = True,
            cover_host_us: float = 300.0, profiled: bool = True) -> Timing:
    """Time ``fn()`` (device work on the current stream) with CUDA events, one pair per
    run, the L2 flushed before each run outside the timed region. A GPU busy-wait of
    ``cover_host_us`` precedes each run (0: none), so host-side launch time stays
    outside the measurement as long as one call's host side takes less than that.
    ``profiled`` (the measured call, not a ceiling such as the copy bandwidth): under
    CUPAGED_BENCH_NVTX=1 one more call, after the warm-up and before the timed runs,
    inside the NVTX range "timed"."""
    flush = _L2Flusher() if flush_l2 else (lambda: None)
    spin = Spin(cover_host_us) if cover_host_us > 0 else (lambda: None)
    for _ in range(warmup):
        fn()
    if profiled and nvtx_wanted():
        call_in_nvtx_range(fn, warmup=0)
    starts = [cupy.cuda.Event() for _ in range(reps)]
    ends = [cupy.cuda.Event() for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush()
        spin()
        s.record()
        fn()
        e.record()
    ends[-1].synchronize()
    t = np.array([cupy.cuda.get_elapsed_time(s, e) * 1e3 for s, e in zip(starts, ends)])
    return Timing(float(np.median(t)), float(np.percentile(t, 10)), float(np.percentile(t, 90)),
                  reps)


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written
    (the roofline every memory-bound kernel is measured against)."""
    a = cupy.ones(nbytes // 4, dtype=np.float32)
    b = cupy.empty_like(a)
    t = time_us(lambda: b.__setitem__(Ellipsis, a), warmup=3, reps=reps, flush_l2=False,
                cover_host_us=0, profiled=False)
    return 2 * nbytes / (t.median_us * 1e-6)


def call_in_nvtx_range(fn, warmup: int = 3, name: str = "timed"):
    """Call ``fn`` ``warmup`` times, then once more inside the NVTX range ``name``, with
    the device idle on both sides: the one call Nsight Compute profiles under
    ``ncu --nvtx --nvtx-include timed/``."""
    for _ in range(warmup):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.nvtx.RangePush(name)
    fn()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.nvtx.RangePop()


def run_us(fn, calls: int) -> float:
    """Host microseconds per call over one run of ``calls`` calls of ``fn``, after a sync
    and with none inside."""
    import time

    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def host_us(fn, calls: int, repeats: int = 9) -> float:
    """Host microseconds per call of ``fn``: the median over ``repeats`` runs of ``calls``
    calls each (few enough calls that the launch queue never fills and throttles the
    host). One run alone moved by 40% between identical runs on the GPU machine's shared
    CPU; the median of nine holds still."""
    for _ in range(10):
        fn()
    runs = [run_us(fn, calls) for _ in range(repeats)]
    cupy.cuda.get_current_stream().synchronize()
    return float(np.median(runs))
