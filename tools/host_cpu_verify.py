"""The fast run launches exactly what the generic path launches (same kernel, grid,
stream and parameter bytes), and falls back where it must (driver stubbed, no GPU)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_cpu  # noqa: E402

host_cpu.install()
import numpy as np  # noqa: E402

import cupaged  # noqa: E402
from cupaged import _fastrun, _prepared  # noqa: E402

# HOST_CPU_STEPS="fused_metas=0,contig_strides=1": verify another combination of steps
for item in filter(None, os.environ.get("HOST_CPU_STEPS", "").split(",")):
    name, value = item.split("=")
    _fastrun.STEPS[name] = bool(int(value))


def launches(fn):
    host_cpu.RECORD = []
    r = fn()
    rec, host_cpu.RECORD = host_cpu.RECORD, None
    return r, [x[:-1] + (x[-1][:SIZE[0]],) for x in rec]


SIZE = [0]


def check(case):
    (q, kc, vc, *shared), out, kw = host_cpu.build_case(case)
    bt = shared[0]
    L = {'lse': kw['lse']} if 'lse' in kw else {}
    plan = cupaged.AttentionPlan(q, kc, vc, *shared, out=out, **kw)
    assert plan.run is not plan._run_generic and "make" in plan.run.__qualname__, case
    import struct
    SIZE[0] = struct.calcsize(plan._prepared.launch.kernel._fmt)
    n = 0
    print(case, plan._prepared.launch.grid, "split", plan._prepared.launch.split)
    for _ in range(3):  # other addresses, same metadata
        q2, out2 = host_cpu.fake(q.shape, q.dtype), host_cpu.fake(out.shape, out.dtype)
        k2, v2 = host_cpu.fake(kc.shape, kc.dtype), host_cpu.fake(vc.shape, vc.dtype)
        for args in ((q2, k2, v2, out2), (q2, k2, v2, q2)):  # apart, in place
            a, ra = launches(lambda: plan._run_generic(args[0], args[1], args[2], out=args[3], **L))
            b, rb = launches(lambda: plan.run(args[0], args[1], args[2], out=args[3], **L))
            assert (a is b is args[3]) or (a == b and a[0] is args[3])
            assert ra == rb and len(ra) == (2 if case == "scratch8" else 1), (case, ra, rb)
            n += 1
    # What must leave the fast path (the generic one then decides: a plain call).
    calls = {
        "query another shape": lambda: plan.run(host_cpu.fake((32, 32, 128), np.float16), kc,
                                                vc, out=host_cpu.fake((32, 32, 128), np.float16)),
        "cache strided": lambda: plan.run(q, host_cpu.fake(kc.shape, kc.dtype, strides=tuple(
            s * 2 if i == 0 else s for i, s in enumerate(kc.strides))), vc, out=out),
        "query misaligned": lambda: plan.run(_shift(q, 8), kc, vc, out=out),
    }
    for name, fn in calls.items():
        try:
            _, r = launches(fn)
            print(f"  {case}: {name}: generic path launched {len(r)}")
        except Exception as e:
            print(f"  {case}: {name}: {type(e).__name__}: {str(e)[:90]}")
    # out over the value cache: the generic path's error, not a launch.
    over = host_cpu.cupy.ndarray(out.shape, out.dtype, memptr=vc.data)
    for fast in (plan.run, plan._run_generic):
        try:
            launches(lambda: fast(q, kc, vc, out=over))
            raise AssertionError("out over the value cache launched")
        except ValueError as e:
            assert "overlap" in str(e), e
    # a table reshaped in place: the plan re-reads it (the generic path then runs)
    _, r1 = launches(lambda: plan.run(q, kc, vc, out=out))
    shape = bt.shape
    bt.shape = (shape[1], shape[0])
    try:
        _, r2 = launches(lambda: plan.run(q, kc, vc, out=out))
        print(f"  {case}: table reshaped in place: launched {len(r2)}, same bytes "
              f"{r2 == r1}")
    except Exception as e:
        print(f"  {case}: table reshaped in place: {type(e).__name__}: {str(e)[:90]}")
    bt.shape = shape
    print(f"{case}: {n} launches identical to the generic path's")


def _shift(a, nbytes):
    from cupy.cuda import memory
    return host_cpu.cupy.ndarray(a.shape, a.dtype, memptr=a.data + nbytes)


for case in ("single", "ws8", "scratch8", "prefill", "rows", "lse"):
    check(case)
print("ok")


# ---- overlaps at the edges, plan and attention: fast and generic paths agree ----------
from cupy.cuda import memory  # noqa: E402

cupy = host_cpu.cupy
_prep = _prepared


def at(ptr, shape, dtype):
    mem = memory.UnownedMemory(ptr, 1 << 40, None, 0)
    host_cpu._KEEP.append(mem)
    return cupy.ndarray(shape, dtype, memptr=memory.MemoryPointer(mem, 0))


def outcome(fn):
    try:
        r, rec = launches(fn)
        return ("launch", rec)
    except Exception as e:
        return (type(e).__name__, str(e)[:60])


def generic_attention(*a, **k):
    saved = _prep.use_fast
    _prep.use_fast = lambda *x: None
    _prep.fast_attention = None
    try:
        return cupaged.attention(*a, **k)
    finally:
        _prep.use_fast = saved


def edges(case):
    (q, kc, vc, *shared), out, kw = host_cpu.build_case(case)
    bt = shared[0]
    L = {'lse': kw['lse']} if 'lse' in kw else {}
    SIZE[0] = 4096
    plan = cupaged.AttentionPlan(q, kc, vc, *shared, out=out, **kw)
    SIZE[0] = __import__("struct").calcsize(plan._prepared.launch.kernel._fmt)
    for _ in range(3):  # warm attention's memo and fast run
        cupaged.attention(q, kc, vc, *shared, out=out, **kw)
    assert _prep.fast_attention is not None
    ob = out.nbytes
    n = agree = 0
    kinds = {}
    for target in (q, kc, vc, *shared):
        lo, hi = target.data.ptr, target.data.ptr + target.nbytes
        for base in (lo - ob, lo, hi - 16, hi):
            for d in range(-48, 49, 16):
                o = at(base + d, out.shape, out.dtype)
                a = outcome(lambda: plan._run_generic(q, kc, vc, out=o, **L))
                b = outcome(lambda: plan.run(q, kc, vc, out=o, **L))
                c = outcome(lambda: generic_attention(q, kc, vc, *shared, out=o, **kw))
                # the fast attention run for this key again (a generic call took it off)
                cupaged.attention(q, kc, vc, *shared, out=out, **kw)
                cupaged.attention(q, kc, vc, *shared, out=out, **kw)
                assert _prep.fast_attention is not None
                e = outcome(lambda: cupaged.attention(q, kc, vc, *shared, out=o, **kw))
                n += 1
                assert a == b, (case, base - lo, d, a, b)
                assert c == e, (case, base - lo, d, c, e)
                kinds[a[0]] = kinds.get(a[0], 0) + 1
                agree += 1
    if L:  # lse moved over the query, out and the caches
        lb = L["lse"].nbytes
        for target in (q, out, kc, *shared):
            lo, hi = target.data.ptr, target.data.ptr + target.nbytes
            for base in (lo - lb, lo, hi - 16, hi):
                for d in range(-32, 33, 16):
                    ls = at(base + d, L["lse"].shape, L["lse"].dtype)
                    a = outcome(lambda: plan._run_generic(q, kc, vc, out=out, lse=ls))
                    b = outcome(lambda: plan.run(q, kc, vc, out=out, lse=ls))
                    kw3 = dict(kw, lse=ls)
                    c = outcome(lambda: generic_attention(q, kc, vc, *shared, out=out, **kw3))
                    cupaged.attention(q, kc, vc, *shared, out=out, **kw)
                    cupaged.attention(q, kc, vc, *shared, out=out, **kw)
                    e = outcome(lambda: cupaged.attention(q, kc, vc, *shared, out=out, **kw3))
                    assert a == b and c == e, (base - lo, d, a, b, c, e)
                    kinds["lse " + a[0]] = kinds.get("lse " + a[0], 0) + 1
    # in place (out is the query): launched by both
    a = outcome(lambda: plan._run_generic(q, kc, vc, out=q, **L))
    b = outcome(lambda: plan.run(q, kc, vc, out=q, **L))
    assert a == b and a[0] == "launch"
    # attention with other keywords of the same value but another type: generic path
    r1 = outcome(lambda: cupaged.attention(q, kc, vc, *shared, out=out, **kw))
    kw2 = dict(kw, max_seq_len=float(kw["max_seq_len"]))
    r2 = outcome(lambda: cupaged.attention(q, kc, vc, *shared, out=out, **kw2))
    print(f"{case}: edges {n} outs, fast == generic for plan and attention ({kinds}); "
          f"max_seq_len as float: {r2[0]} {r2[1] if r2[0] != 'launch' else ''}")


for case in ("single", "ws8", "scratch8", "prefill", "rows", "lse"):
    edges(case)
print("edges ok")
