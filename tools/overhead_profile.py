"""Where the host time of an eager call goes: per-piece timings of
paged_attention and attention with CuPy and torch inputs (kernels cached, out given), and
a cProfile of each call. Run on the GPU machine: python3 tools/overhead_profile.py"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import cupy
import numpy as np

import cupaged
from cupaged import _arrays, planning, validation
from cupaged.bench.workloads import DecodeCase
from cupaged.bench.timing import host_us


def per_call_us(fn):
    """Median of 7 runs of 200 calls (few enough that the launch queue never fills)."""
    return host_us(fn, 200, 7)


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


def kw20(a=None, b=None, c=None, d=None, e=None, f=None, g=None, h=None, i=None, j=None,
         k=None, l=None, m=None, n=None, o=None, p=None, q=None, r=None, s=None, t=None):
    return a


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
        "validation.validate_decode": lambda: validation.validate_decode(q, kc, vc, bt, cl, None, out),
        "on_device": lambda: _arrays.on_device(0),
        "context (cupy)": lambda: _arrays.context(0, "cupy", None),
        "context (torch)": lambda: _arrays.context(0, "torch", None),
        "runtime.getDevice": lambda: cupy.cuda.runtime.getDevice(),
        "cupy get_current_stream": lambda: cupy.cuda.get_current_stream().ptr,
        "TorchArray": lambda: _arrays.TorchArray(tq, "q"),
        "torch data_ptr": lambda: tq.data_ptr(),
        # The primitives a metadata-keyed fast path would need.
        "cupy (shape, strides, dtype, ptr)": lambda: (q.shape, q.strides, q.dtype, q.data.ptr),
        "torch (shape, stride(), dtype, data_ptr)": lambda: (tq.shape, tq.stride(), tq.dtype,
                                                              tq.data_ptr()),
        "torch get_device": lambda: tq.get_device(),
        "torch is_cuda + requires_grad": lambda: (tq.is_cuda, tq.requires_grad),
        "dict get, 8-tuple key": lambda: memo.get((1, 2, 3, 4, 5, 6, 7, key)),
        "cupy.empty(8 x 32 x 128)": lambda: cupy.empty((8, 32, 128), np.float16),
        "torch.empty(8 x 32 x 128)": lambda: torch.empty((8, 32, 128), dtype=torch.float16,
                                                         device="cuda"),
        "python call, 20 kwargs": lambda: kw20(a=1, b=2, c=3, d=4, e=5, f=6, g=7, h=8, i=9,
                                              j=10, k=11, l=12, m=13, n=14, o=15, p=16,
                                              q=17, r=18, s=19, t=20),
    }
    p = validation.validate_decode(q, kc, vc, bt, cl, None, out)
    memo = {}
    key = (p.device, p.dtype.name, p.head_size, p.block_size, planning.group_tile(4),
           p.cache.kv_format, p.cache.dtype.name, p.quant.mode, "")
    ks = planning.decode_kernels(*key)
    pieces["planning.decode_kernels lookup"] = lambda: planning.decode_kernels(*key)
    # The prepared (memoized) path's pieces.
    from cupaged import _prepared

    main_arrays = (q, kc, vc, bt, cl, None, out, None)
    scalars = (None, 1024, "never", "auto", None, None, None, False, ())
    pieces["_prepared.key (cupy decode)"] = lambda: _prepared.key(
        "decode", main_arrays, (None, None, None, None), scalars, None)
    t_main = (tq, tkc, tvc, tbt, tcl, None, tout, None)
    pieces["_prepared.key (torch decode)"] = lambda: _prepared.key(
        "decode", t_main, (None, None, None, None), scalars, None)
    mk, ptrs = _prepared.key("decode", main_arrays, (None, None, None, None), scalars, None)
    cupaged.paged_attention(q, kc, vc, bt, cl, out=out, partition="never", max_context_len=1024)
    prep = _prepared.lookup(mk)
    assert prep is not None, "the bench call was not memoized"
    pieces["_prepared.lookup"] = lambda: _prepared.lookup(mk)
    pieces["_prepared.run (context + launch)"] = lambda: _prepared.run(prep, ptrs, None, out, None)
    ctx = _arrays.context(0, "cupy", None)
    pieces["launch.Launch.run (launch)"] = lambda: prep.launch.run(ctx, ptrs[6], *ptrs[:6])
    pieces["_prepared.metas (4 cupy arrays)"] = lambda: _prepared.metas((q, kc, vc, out))
    pieces["_prepared.metas (4 torch tensors)"] = lambda: _prepared.metas((tq, tkc, tvc, tout))
    plan = cupaged.AttentionPlan(q, hk, hv, bt, cl, max_seq_len=1024, out=out,
                                 workspace=cupaged.DecodeWorkspace(8, 32, 128))
    pieces["AttentionPlan.run cupy NHD decode + workspace"] = lambda: plan.run(q, hk, hv, out=out)
    stream = ctx.stream
    la = prep.launch
    args = (out.data.ptr, 0, 0, 0, q.data.ptr, *la.q_strides, kc.data.ptr, vc.data.ptr,
            *la.kv_strides, bt.data.ptr, *la.kv_tail, cl.data.ptr, 0, *la.tail, la.vp)
    pieces["launch only (Launcher)"] = lambda: ks.decode((8, 8, 1), 128, ks.smem, stream, *args)
    import struct

    from cupy_backends.cuda.api import driver

    buf, params = ks.decode._buffers()
    fmt = ks.decode.fmt
    pieces["  of which struct.pack_into"] = lambda: struct.pack_into(fmt, buf, 0, *args)
    pieces["  of which cuLaunchKernel"] = lambda: driver.launchKernel(
        ks.decode.ptr, 8, 8, 1, 128, 1, 1, ks.smem, stream, params, 0)
    for name, fn in pieces.items():
        print(f"  {name:38s} {per_call_us(fn):7.2f} us")
    for name, fn in calls.items():
        profile(name, fn)


if __name__ == "__main__":
    sys.exit(main())
