"""Where the host time of an eager call goes (issue 14): per-piece timings of
paged_attention and attention with CuPy and torch inputs (kernels cached, out given), and
a cProfile of each call. Run on the GPU machine: python3 tools/overhead_profile.py"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import cupy
import numpy as np

import cupaged
from cupaged import _arrays, _checks, decode, varlen
from cupaged.bench import DecodeCase


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    cupy.cuda.runtime.deviceSynchronize()
    return us


def profile(name, fn, n=3000):
    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    cupy.cuda.runtime.deviceSynchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(f"==== cProfile: {name} ({n} calls)")
    print("\n".join(s.getvalue().splitlines()[6:34]))


def main():
    case = DecodeCase(8, np.full(8, 1024, np.int32), 32, 8, 128, 16, np.dtype(np.float16)).build()
    a = case.arrays
    q, kc, vc, bt, cl = a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["context_lens"]
    out = cupy.empty(q.shape, q.dtype)
    calls = {
        "paged_attention cupy single": lambda: cupaged.paged_attention(
            q, kc, vc, bt, cl, out=out, partition="never", max_context_len=1024),
        "paged_attention cupy split": lambda: cupaged.paged_attention(
            q, kc, vc, bt, cl, out=out, partition="always", max_context_len=1024),
    }
    import torch

    tq, tkc, tvc, tbt, tcl = (torch.from_dlpack(x) for x in (q, kc, vc, bt, cl))
    tout = torch.empty_like(tq)
    calls["paged_attention torch single"] = lambda: cupaged.paged_attention(
        tq, tkc, tvc, tbt, tcl, out=tout, partition="never", max_context_len=1024)
    hk, hv = (cupy.asarray(np.ascontiguousarray(np.swapaxes(np.zeros((64 * 8 + 8, 8, 16, 128),
                                                                    np.float16), 1, 2))) for _ in "kv")
    calls["attention NHD cupy decode"] = lambda: cupaged.attention(
        q, hk, hv, bt, cl, kv_layout="NHD", max_seq_len=1024, out=out)
    for name, fn in calls.items():
        print(f"{name:40s} {per_call_us(fn):7.1f} us/call")

    # Pieces of the CuPy single-pass call.
    pieces = {
        "as_device_array x6": lambda: [_arrays.as_device_array(x, "x") for x in (q, kc, vc, bt, cl, out)],
        "decode._validate": lambda: decode._validate(q, kc, vc, bt, cl, None, out),
        "on_device": lambda: _arrays.on_device(0),
        "context (cupy)": lambda: _arrays.context(0, False, None),
        "context (torch)": lambda: _arrays.context(0, True, None),
        "runtime.getDevice": lambda: cupy.cuda.runtime.getDevice(),
        "cupy get_current_stream": lambda: cupy.cuda.get_current_stream().ptr,
        "TorchArray": lambda: _arrays.TorchArray(tq, "q"),
        "torch data_ptr": lambda: tq.data_ptr(),
    }
    p = decode._validate(q, kc, vc, bt, cl, None, out)
    key = (p.device, p.dtype.name, p.head_size, p.block_size, decode._group_tile(4),
           p.cache.kv_format, p.cache.dtype.name, p.quant.mode, "")
    ks = decode._kernels(*key)
    pieces["_kernels lookup"] = lambda: decode._kernels(*key)
    pieces["_paged_kv pack"] = lambda: decode._paged_kv(kc, vc, bt, p)
    stream = cupy.cuda.get_current_stream().ptr
    args = (out.data.ptr, 0, 0, 0, q.data.ptr, q.strides[0] // 2, q.strides[1] // 2,
            decode._paged_kv(kc, vc, bt, p), cl.data.ptr, 0, 0, 32, 4, 8, 1, 0, 0.1,
            cupaged._variants.PLAIN_BYTES)
    pieces["launch only (Launcher)"] = lambda: ks.decode((8, 8, 1), 128, ks.smem, stream, *args)
    for name, fn in pieces.items():
        print(f"  {name:38s} {per_call_us(fn):7.2f} us")
    for name, fn in calls.items():
        profile(name, fn)


if __name__ == "__main__":
    sys.exit(main())
