"""Each step of the fast run measured against the generic path in ONE process, their
rounds interleaved (this VM's CPU, like the GPU machine's, runs in phases): per variant
the median us/call over rounds, and the median per-round difference to the one before.

    python tools/host_cpu_steps.py [--case single|ws8] [--rounds 50] [--calls 2000]"""
import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_cpu  # noqa: E402

host_cpu.install()
import cupaged  # noqa: E402
from cupaged import _fastrun, _prepared  # noqa: E402

use_fast = _prepared.use_fast
DEFAULT = dict(_fastrun.STEPS)

STEPS = [
    ("generic (before)", None),
    ("+ fused metas", dict(fused_metas=True)),
    ("+ folded clashes", dict(folded_clashes=True)),
    ("+ inline device/stream/holds", dict(inline_run=True)),
    ("+ prepacked params", dict(prepacked=True)),
    ("+ option: _c_contiguous for strides", dict(contig_strides=True)),
    ("+ option: bound tables shape/strides only", dict(bound_shape_only=True)),
    ("+ option: bound tables not re-read", dict(trust_bound=True)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="single")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    (q, kc, vc, bt, sl), out, kw = host_cpu.build_case(a.case)
    steps = {k: False for k in _fastrun.STEPS}
    steps["scratch"] = True  # (a form, not a step: without it no fast run at all)
    fns = []
    for name, change in STEPS:
        if change is None:
            plan = cupaged.AttentionPlan(q, kc, vc, bt, sl, out=out, **kw)
            fn = plan._run_generic
            fns.append((name, lambda fn=fn: fn(q, kc, vc, out=out)))
            continue
        steps.update(change)
        _fastrun.STEPS.update(steps)
        plan = cupaged.AttentionPlan(q, kc, vc, bt, sl, out=out, **kw)
        assert "make" in plan.run.__qualname__
        fn = plan.run
        fns.append((name, lambda fn=fn: fn(q, kc, vc, out=out)))
    att = lambda: cupaged.attention(q, kc, vc, bt, sl, out=out, **kw)  # noqa: E731
    fns.append(("attention() memo path (before)", att))
    fast = {}
    for name, change in (("attention() fast run (default steps)", {}),
                         ("attention() fast run + contig", dict(contig_strides=True))):
        _fastrun.STEPS.clear()
        _fastrun.STEPS.update(DEFAULT, **change)
        _prepared.clear()
        for _ in range(3):
            att()
        fast[name] = _prepared.fast_attention
        assert fast[name] is not None
        fns.append((name, att))
    _fastrun.STEPS.clear()
    _fastrun.STEPS.update(DEFAULT)
    gauge = lambda: sum(i * i for i in range(50))  # noqa: E731
    fns.insert(0, ("python gauge", gauge))
    for name, fn in fns:
        if name.startswith("attention() memo"):
            _prepared.use_fast, _prepared.fast_attention = (lambda *x: None), None
        elif name.startswith("attention() fast"):
            _prepared.use_fast, _prepared.fast_attention = use_fast, fast[name]
        for _ in range(2000):
            fn()
    res = {name: [] for name, _ in fns}
    gc.disable()
    for r in range(a.rounds):
        order = fns if r % 2 == 0 else fns[::-1]
        for name, fn in order:
            generic = name.startswith("attention() memo")
            if generic:
                _prepared.use_fast, _prepared.fast_attention = (lambda *x: None), None
            elif name.startswith("attention() fast"):
                _prepared.use_fast = use_fast
                _prepared.fast_attention = fast[name]
            t0 = time.perf_counter_ns()
            for _ in range(a.calls):
                fn()
            res[name].append((time.perf_counter_ns() - t0) / a.calls / 1000)
    gc.enable()
    print(f"case {a.case}, {a.rounds} interleaved rounds of {a.calls} calls "
          f"({a.rounds * a.calls} calls each); us/call")
    print(f"{'variant':42s} {'median':>7s} {'min':>7s} {'step gain (median of per-round diff)':>38s}")
    prev = None
    for name, _ in fns:
        v = res[name]
        gain = ""
        if prev is not None and (name.startswith("+") or "fast run" in name):
            if name.startswith("attention() fast"):
                prev = "attention() memo path (before)"
            gain = f"{statistics.median([p - x for p, x in zip(res[prev], v)]):7.2f}"
        print(f"{name:42s} {statistics.median(v):7.2f} {min(v):7.2f} {gain:>20s}")
        if name != "python gauge":
            prev = name


main()
