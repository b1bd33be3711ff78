"""Host time of AttentionPlan.run and of a repeated attention() call WITHOUT a GPU: real
cupy.ndarray objects over unowned (fake) addresses, the device queries, the kernel loads
and the driver's launch call replaced by no-ops. What is left is cupaged's own Python
(and CuPy's attribute reads), which is what a host-time change can move.

    python tools/host_cpu.py [--calls N] [--profile] [--pieces] [--case single|split|ws]

Stubs (see install()): runtime.getDevice -> 0, cupy.cuda.get_current_stream -> a fixed
stream object, planning.device_info -> an H200-like sm_90 (132 SMs), resident_ctas ->
computed, jit.load -> a real jit.Launcher over a fake function, driver.launchKernel -> a
no-op (jit._driver replaced), _arrays.scratch -> a fixed address (no allocation)."""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import io
import pstats
import statistics
import sys
import time
import types

import os

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy  # noqa: E402
import numpy as np  # noqa: E402
from cupy.cuda import memory  # noqa: E402

_next = [0x7F00_0000_0000]
_KEEP = []


def fake(shape, dtype, strides=None):
    """A real cupy.ndarray at a fresh fake device address (nothing allocated)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    ptr = _next[0]
    _next[0] += (n + 0xFFFF) & ~0xFFFF
    mem = memory.UnownedMemory(ptr, max(n, 1), None, 0)
    _KEEP.append(mem)
    return cupy.ndarray(shape, dtype, memptr=memory.MemoryPointer(mem, 0), strides=strides)


class _Stream:
    ptr = 0x5151


_STREAM = _Stream()
RECORD = None  # a list: launches are recorded (verify)


def install():
    """Replace every call that needs a GPU (see the module's docstring)."""
    from cupy_backends.cuda.api import runtime

    from cupaged import _arrays, jit, launch, planning

    runtime.getDevice = lambda: 0
    cupy.cuda.runtime.getDevice = runtime.getDevice
    cupy.cuda.get_current_stream = lambda device_id=-1: _STREAM
    dev = planning.DeviceInfo(0, "sm_90", 132, 232448, 233472)
    planning.device_info = lambda device_id: dev
    planning.resident_ctas = lambda device_id, kernel, threads, smem: 132 * max(
        1, min(16, 233472 // (smem + 1024)))

    class _Fn:
        ptr = 0xF00D

    def load(spec, device_id, dynamic_smem=0):
        return jit.Launcher(_Fn(), jit.ARG_FORMATS[spec.kernel], spec.name)

    jit.load = load
    drv = jit._driver

    def launchKernel(*args):  # noqa: N802 - the driver's name
        if RECORD is not None:
            f, gx, gy, gz, bx, by, bz, smem, stream, params, extra = args
            first = ctypes.c_void_p.from_address(params).value
            RECORD.append((f, gx, gy, gz, bx, by, bz, smem, stream,
                           ctypes.string_at(first, 300)))

    jit._driver = types.SimpleNamespace(launchKernel=launchKernel,
                                        **{k: getattr(drv, k) for k in dir(drv)
                                           if k.startswith("CU_")})
    _arrays.scratch = lambda ctx, nbytes: (0x7E00_0000_0000, None)
    def memset_async(*a):
        if RECORD is not None:
            RECORD.append(("memsetAsync",) + a + (b"",))

    runtime.memsetAsync = memset_async
    cupy.cuda.runtime.memsetAsync = runtime.memsetAsync
    return launch


def fake_workspace(rows, head_size):
    from cupaged import launch

    ws = object.__new__(launch.DecodeWorkspace)
    ws.device, ws.rows, ws.head_size = 0, rows, head_size
    ws._num_counters = rows // 2
    ws._counters_offset = rows * (head_size + 2) * 4
    ws._buf = fake((ws._counters_offset + ws._num_counters * 4,), np.uint8)
    ws._by_head_size = {}
    ws._base = ws._buf.data.ptr
    return ws


def build_case(case):
    """The brief's decode call: query [64, 32, 128] fp16, NHD caches [nb, 16, 8, 128],
    block tables [64, 128] int32, seq_lens [64]."""
    if case == "scratch8":  # batch 8 x 2048 without a workspace: a scratch per call
        (q, kc, vc, bt, sl), out, kw = build_case("ws8")
        return (q, kc, vc, bt, sl), out, dict(max_seq_len=2048)
    if case == "ws8":  # batch 8 x 2048: split-KV into a workspace, merged in the kernel
        q = fake((8, 32, 128), np.float16)
        kc, vc = (fake((8 * 128 + 8, 16, 8, 128), np.float16) for _ in "kv")
        bt, sl, out = fake((8, 128), np.int32), fake((8,), np.int32), fake(q.shape, q.dtype)
        return (q, kc, vc, bt, sl), out, dict(max_seq_len=2048,
                                               workspace=fake_workspace(8 * 32 * 64, 128))
    if case in ("prefill", "rows"):  # with query_start_loc: 64 x 32 tokens, or 64 x 1
        n = 32 if case == "prefill" else 1
        seqs = 64
        q = fake((seqs * n, 32, 128), np.float16)
        kc, vc = (fake((seqs * 128 + 8, 16, 8, 128), np.float16) for _ in "kv")
        bt, sl, out = fake((seqs, 128), np.int32), fake((seqs,), np.int32), fake(q.shape, q.dtype)
        qsl = fake((seqs + 1,), np.int32)
        return (q, kc, vc, bt, sl, qsl), out, dict(max_seq_len=256 if n > 1 else 2048,
                                                   max_query_len=n)
    if case == "lse":  # decode with a window and lse= (the VariantParams carry both)
        (q, kc, vc, bt, sl), out, kw = build_case("single")
        return (q, kc, vc, bt, sl), out, dict(kw, window=128, lse=fake((64, 32), np.float32))
    q = fake((64, 32, 128), np.float16)
    nb = 64 * 128 + 8
    kc = fake((nb, 16, 8, 128), np.float16)
    vc = fake((nb, 16, 8, 128), np.float16)
    bt = fake((64, 128), np.int32)
    sl = fake((64,), np.int32)
    out = fake((64, 32, 128), np.float16)
    kw = {"single": dict(max_seq_len=256), "split": dict(max_seq_len=2048),
          "ws": dict(max_seq_len=2048, workspace=fake_workspace(2 * 64 * 32 * 8, 128))}[case]
    return (q, kc, vc, bt, sl), out, kw


def per_call_ns(fn, calls, batches=10):
    """Median over ``batches`` loops of ``calls // batches`` calls, ns per call."""
    n = max(1, calls // batches)
    res = []
    gc.disable()
    try:
        for _ in range(batches):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            res.append((time.perf_counter_ns() - t0) / n)
    finally:
        gc.enable()
    return statistics.median(res), min(res)


def profile(fn, calls, top=25):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(top)
    return st, s.getvalue()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--case", default="single", choices=("single", "split", "ws", "ws8", "scratch8", "prefill", "rows", "lse"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--pieces", action="store_true")
    a = ap.parse_args(argv)
    install()
    import cupaged
    from cupaged import _prepared

    (q, kc, vc, bt, sl), out, kw = build_case(a.case)
    plan = cupaged.AttentionPlan(q, kc, vc, bt, sl, out=out, **kw)
    la = plan._prepared.launch
    print(f"cupaged from {cupaged.__file__}")
    print(f"case {a.case}: {plan!r}; grid {la.grid} smem {la.smem} split {la.split} "
          f"combine {la.combine is not None} partials {la.partials is not None}")
    run = lambda: plan.run(q, kc, vc, out=out)  # noqa: E731
    att = lambda: cupaged.attention(q, kc, vc, bt, sl, out=out, **kw)  # noqa: E731
    assert run() is out and att() is out
    assert _prepared.lookup(_prepared.key(
        "attention", (q, kc, vc, bt, sl, None, out, None), (None, None, None, None),
        ("NHD", True, None, None, kw["max_seq_len"], "auto", None, None, None, False),
        cupaged.launch.workspace_key(kw.get("workspace")))[0]) is not None, "not memoized"
    for _ in range(2000):
        run(), att()
    gauge = lambda: sum(i * i for i in range(50))  # noqa: E731
    for name, fn in (("python gauge (sum of 50 squares)", gauge),
                     ("AttentionPlan.run", run), ("attention (memo)", att)):
        med, lo = per_call_ns(fn, a.calls)
        print(f"{name:34s} {med / 1000:7.2f} us/call median ({lo / 1000:.2f} min)")
    if a.profile:
        for name, fn in (("AttentionPlan.run", run), ("attention (memo)", att)):
            _, text = profile(fn, a.calls)
            print(f"==== cProfile {name}, {a.calls} calls")
            print("\n".join(text.splitlines()[4:40]))
    if a.pieces:
        pieces(plan, q, kc, vc, bt, sl, out, kw)


def pieces(plan, q, kc, vc, bt, sl, out, kw):
    from cupaged import _arrays, _checks, _prepared

    prep = plan._prepared
    shared = plan._shared
    m, ptrs = _prepared.metas((q, kc, vc, *shared, out, None))
    ctx = _arrays.context(0, "cupy", None)
    la = prep.launch
    k = _prepared.key("attention", (q, kc, vc, bt, sl, None, out, None), (None,) * 4,
                      ("NHD", True, None, None, kw["max_seq_len"], "auto", None, None, None,
                       False), cupaged_launch().workspace_key(kw.get("workspace")))[0]
    ps = {
        "metas (8 arrays)": lambda: _prepared.metas((q, kc, vc, *shared, out, None)),
        "one cupy array's (shape,strides,dtype,ptr&15,dev)": lambda: (
            q.shape, q.strides, q.dtype, q.data.ptr & 15, q.data.device_id),
        "  q.shape": lambda: q.shape,
        "  q.strides": lambda: q.strides,
        "  q.dtype": lambda: q.dtype,
        "  q.data": lambda: q.data,
        "  q.data.ptr": lambda: q.data.ptr,
        "m != plan._metas": lambda: m != plan._metas,
        "ptrs[3:6] != shared_ptrs": lambda: ptrs[3:6] != plan._shared_ptrs,
        "_checks.debug()": _checks.debug,
        "clashes": lambda: _prepared.clashes(prep, ptrs),
        "_prepared.run": lambda: _prepared.run(prep, ptrs, None, out, None),
        "launching(0) enter+exit": lambda: _with(_arrays.launching(0)),
        "context(0,'cupy',None)": lambda: _arrays.context(0, "cupy", None),
        "Launch.run": lambda: la.run(ctx, *ptrs[6:7], *ptrs[:6], 0),
        "attention: _prepared.key": lambda: _prepared.key(
            "attention", (q, kc, vc, bt, sl, None, out, None), (None,) * 4,
            ("NHD", True, None, None, kw["max_seq_len"], "auto", None, None, None, False),
            cupaged_launch().workspace_key(kw.get("workspace"))),
        "attention: lookup": lambda: _prepared.lookup(k),
        "attention: variant_args": lambda: cupaged_validation().variant_args(
            None, None, None, None, False, None),
    }
    for name, fn in ps.items():
        for _ in range(1000):
            fn()
        med, lo = per_call_ns(fn, 100_000)
        print(f"  {name:50s} {med / 1000:6.3f} us ({lo / 1000:.3f} min)")


def _with(cm):
    with cm:
        pass


def cupaged_launch():
    from cupaged import launch
    return launch


def cupaged_validation():
    from cupaged import validation
    return validation


if __name__ == "__main__":
    sys.exit(main())
