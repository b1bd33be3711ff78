"""_fastrun without a GPU: real cupy.ndarray objects over unowned addresses, the device
queries, kernel loads and cuLaunchKernel replaced (recorded). The fast run of a plan and
of a remembered attention call must launch byte for byte what the generic path launches,
and leave to it every call it does not stand for."""

from __future__ import annotations

import ctypes
import struct
import threading
import types

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import cupaged  # noqa: E402
from cupaged import _arrays, _checks, _fastrun, _prepared, jit, planning  # noqa: E402


@pytest.fixture
def fake_gpu(monkeypatch):
    from cupy.cuda import memory
    from cupy_backends.cuda.api import runtime

    launched = []
    keep = []
    state = {"next": 0x7F00_0000_0000, "device": 0}

    def fake(shape, dtype, ptr=None):
        dtype = np.dtype(dtype)
        n = max(int(np.prod(shape)) * dtype.itemsize, 1)
        if ptr is None:
            ptr = state["next"]
            state["next"] += (n + 0xFFFF) & ~0xFFFF
        mem = memory.UnownedMemory(ptr, 1 << 40, None, 0)
        keep.append(mem)
        return cupy.ndarray(shape, dtype, memptr=memory.MemoryPointer(mem, 0))

    class Stream:
        ptr = 0x5151

    monkeypatch.setattr(runtime, "getDevice", lambda: state["device"])
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device_id=-1: Stream)
    dev = planning.DeviceInfo(0, "sm_90", 132, 232448, 233472)
    monkeypatch.setattr(planning, "device_info", lambda device_id: dev)
    monkeypatch.setattr(planning, "resident_ctas", lambda d, k, t, smem: 132 * max(
        1, min(16, 233472 // (smem + 1024))))

    class Fn:
        ptr = 0xF00D

    monkeypatch.setattr(jit, "load", lambda spec, device_id, dynamic_smem=0: jit.Launcher(
        Fn(), jit.ARG_FORMATS[spec.kernel], spec.name))
    size = [0]

    def launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        first = ctypes.c_void_p.from_address(params).value
        launched.append((f, gx, gy, gz, bx, smem, stream, ctypes.string_at(first, size[0])))

    monkeypatch.setattr(jit, "_driver", types.SimpleNamespace(launchKernel=launch_kernel))
    scratch = iter(range(0x7E00_0000_0000, 0x7E00_0000_0000 + (1 << 40), 1 << 24))
    monkeypatch.setattr(_arrays, "scratch", lambda ctx, nbytes: (next(scratch), None))
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync",
                        lambda *a: launched.append(("memsetAsync",) + a))
    jit.clear_memory_caches()
    _prepared.clear()
    yield types.SimpleNamespace(fake=fake, launched=launched, size=size, state=state)
    jit.clear_memory_caches()
    _prepared.clear()


def _case(g, lse=False, seqs=64, max_seq_len=256):
    q = g.fake((seqs, 32, 128), np.float16)
    kc, vc = (g.fake((seqs * 128 + 8, 16, 8, 128), np.float16) for _ in "kv")
    bt, sl, out = g.fake((seqs, 128), np.int32), g.fake((seqs,), np.int32), g.fake(q.shape, q.dtype)
    kw = dict(max_seq_len=max_seq_len)
    if lse:
        kw.update(window=128, lse=g.fake((64, 32), np.float32))
    return q, kc, vc, bt, sl, out, kw


def _outcome(g, fn):
    del g.launched[:]
    try:
        r = fn()
    except ValueError as e:
        return "refused", str(e)[:40]
    returned = [id(x) for x in r] if isinstance(r, tuple) else [id(r)]
    return "launched", returned, list(g.launched)


@pytest.mark.parametrize("lse,scratch", [(False, False), (True, False), (False, True)],
                         ids=["plain", "window-lse", "split-scratch"])
def test_plan_fast_run_launches_what_the_generic_path_does(fake_gpu, lse, scratch):
    g = fake_gpu
    q, kc, vc, bt, sl, out, kw = _case(g, lse, *((8, 2048) if scratch else ()))
    plan = cupaged.AttentionPlan(q, kc, vc, bt, sl, out=out, **kw)
    assert plan.run.__qualname__.startswith("make."), "no fast run"
    assert plan._prepared.launch.split == scratch and plan._prepared.launch.partials is None
    g.size[0] = struct.calcsize(plan._prepared.launch.kernel._fmt)
    extra = {"lse": kw["lse"]} if lse else {}
    for _ in range(3):
        q2, k2, v2, o2 = (g.fake(a.shape, a.dtype) for a in (q, kc, vc, out))
        for o in (o2, q2):  # apart, and in place
            a = _outcome(g, lambda: plan._run_generic(q2, k2, v2, out=o, **extra))
            b = _outcome(g, lambda: plan.run(q2, k2, v2, out=o, **extra))
            if scratch:  # each call its own scratch: the same offsets from it
                base = [x[1] for x in a[2] + b[2] if x[0] == "memsetAsync"]
                assert len(base) == 2 and base[1] != base[0]
                a = (a[0], a[1], [_rebase(x, base[0]) for x in a[2]])
                b = (b[0], b[1], [_rebase(x, base[1]) for x in b[2]])
            assert a == b and len(a[2]) == (2 if scratch else 1) and a[1][0] == id(o)


def _rebase(record, base):
    """A launch or memset record with the scratch's addresses made relative to it."""
    if record[0] == "memsetAsync":
        return record[:1] + (record[1] - base,) + record[2:]
    raw = bytearray(record[-1])
    for off in range(0, len(raw) - 7, 8):
        v = int.from_bytes(raw[off:off + 8], "little")
        if base - (1 << 24) < v < base + (1 << 24):
            raw[off:off + 8] = (v - base + (1 << 50)).to_bytes(8, "little")
    return record[:-1] + (bytes(raw),)


def test_plan_fast_run_refuses_overlaps_as_the_generic_path_does(fake_gpu):
    g = fake_gpu
    q, kc, vc, bt, sl, out, kw = _case(g)
    plan = cupaged.AttentionPlan(q, kc, vc, bt, sl, out=out, **kw)
    g.size[0] = struct.calcsize(plan._prepared.launch.kernel._fmt)
    seen = set()
    for target in (q, kc, vc, bt, sl):
        lo, hi = target.data.ptr, target.data.ptr + target.nbytes
        for at in (lo - out.nbytes - 16, lo - out.nbytes, lo - 16, lo, hi - 16, hi):
            o = g.fake(out.shape, out.dtype, at)
            a = _outcome(g, lambda: plan._run_generic(q, kc, vc, out=o))
            b = _outcome(g, lambda: plan.run(q, kc, vc, out=o))
            assert a == b
            seen.add(a[0])
    assert seen == {"refused", "launched"}


def test_plan_fast_run_leaves_other_calls_to_the_generic_path(fake_gpu, monkeypatch):
    g = fake_gpu
    q, kc, vc, bt, sl, out, kw = _case(g)
    plan = cupaged.AttentionPlan(q, kc, vc, bt, sl, out=out, **kw)
    generic = []
    real = plan._run_generic

    def counting(*a, **k):
        generic.append(1)
        return real(*a, **k)

    plan = cupaged.AttentionPlan(q, kc, vc, bt, sl, out=out, **kw)
    monkeypatch.setattr(plan, "run", _fastrun.build(
        "plan", plan._prepared, plan._metas, [0, 1, 2, 6], [3, 4], {3: bt, 4: sl}, counting))
    plan.run(q, kc, vc, out=out)
    assert not generic
    shifted = cupy.ndarray(q.shape, q.dtype, memptr=q.data + 8)
    strided = g.fake((kc.shape[0] // 2,) + kc.shape[1:], kc.dtype)
    strided = cupy.ndarray(kc.shape, kc.dtype, memptr=strided.data,
                           strides=(kc.strides[0] * 2,) + kc.strides[1:])
    calls = [
        lambda: plan.run(q, kc, vc, out=out, stream=0x77),
        lambda: plan.run(q, kc, vc, out=shifted),  # another alignment
        lambda: plan.run(q, strided, vc, out=out),  # other strides
        lambda: plan.run(q, kc, vc, out=out, k_scale=1.0),
    ]
    for n, call in enumerate(calls, 1):
        try:
            call()
        except (ValueError, TypeError):
            pass
        assert len(generic) == n
    monkeypatch.setattr(_checks, "DEBUG", True)
    monkeypatch.setattr(_checks, "debug", lambda: False)  # (its device reads: not here)
    plan.run(q, kc, vc, out=out)
    assert len(generic) == 5
    monkeypatch.setattr(_checks, "DEBUG", False)
    g.state["device"] = 1  # another device current: the generic path switches (no GPU here)
    with pytest.raises(Exception):
        plan.run(q, kc, vc, out=out)
    assert len(generic) == 6
    g.state["device"] = 0
    _arrays._HOLDS.pending.append(object())  # a DLPack import waits for its stream
    try:
        with pytest.raises(Exception):
            plan.run(q, kc, vc, out=out)  # (the generic path stamps it: no real stream)
    finally:
        _arrays._HOLDS.pending.clear()
        _arrays._HOLDS.stamped.clear()
    assert len(generic) == 7
    bt.shape = (128, 64)  # a bound table changed in place: re-read, so refused
    with pytest.raises(ValueError):
        plan.run(q, kc, vc, out=out)
    bt.shape = (64, 128)


def test_each_thread_launches_from_its_own_buffer(fake_gpu):
    g = fake_gpu
    q, kc, vc, bt, sl, out, kw = _case(g)
    plan = cupaged.AttentionPlan(q, kc, vc, bt, sl, out=out, **kw)
    g.size[0] = struct.calcsize(plan._prepared.launch.kernel._fmt)
    outs = [g.fake(out.shape, out.dtype) for _ in range(4)]
    want = [_outcome(g, lambda: plan._run_generic(q, kc, vc, out=o))[2] for o in outs]
    got = {}

    def work(i):
        for _ in range(200):
            plan.run(q, kc, vc, out=outs[i])
        got[i] = True

    del g.launched[:]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4
    # every launch any thread made is one of the four right ones
    right = {w[0] for w in want}
    assert len(g.launched) == 4 * 200 and set(g.launched) <= right


def test_attention_fast_run(fake_gpu):
    g = fake_gpu
    q, kc, vc, bt, sl, out, kw = _case(g)
    g.size[0] = 4096
    cupaged.attention(q, kc, vc, bt, sl, out=out, **kw)
    assert _prepared.fast_attention is None  # remembered on the first call...
    la = _prepared.lookup(_prepared.key(
        "attention", (q, kc, vc, bt, sl, None, out, None), (None,) * 4,
        ("NHD", True, None, None, 256, "auto", None, None, None, False), None)[0]).launch
    g.size[0] = struct.calcsize(la.kernel._fmt)
    cupaged.attention(q, kc, vc, bt, sl, out=out, **kw)
    fast = _prepared.fast_attention
    assert fast is not None  # ...and its fast run taken on the first hit
    q2, k2, v2, b2, s2, o2 = (g.fake(a.shape, a.dtype) for a in (q, kc, vc, bt, sl, out))
    b = _outcome(g, lambda: cupaged.attention(q2, k2, v2, b2, s2, out=o2, **kw))
    _prepared.fast_attention = None
    saved = _prepared.use_fast
    _prepared.use_fast = lambda *a: None
    try:
        a = _outcome(g, lambda: cupaged.attention(q2, k2, v2, b2, s2, out=o2, **kw))
    finally:
        _prepared.use_fast = saved
    assert a == b and len(a[2]) == 1
    _prepared.fast_attention = fast
    # the same keyword of another type, or another value: the generic path decides
    from cupaged import _fastrun as f

    args = (q, kc, vc, bt, sl, None, "NHD", True, None, None, None, 256, out, None, None,
            "auto", None, None, None, None, None, None, False, None)
    assert fast(*args) is out
    for n, other in ((11, 256.0), (11, 512), (7, 1), (6, "HND"), (8, 0.1), (14, object())):
        changed = list(args)
        changed[n] = other
        assert fast(*changed) is f.MISS
    _prepared.clear()
    assert _prepared.fast_attention is None
