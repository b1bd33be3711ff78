"""Per-function breakdown of AttentionPlan.run and attention() on this tree (no GPU: see
host_cpu.py): the median per call, and cProfile tottime shares scaled to it.

    python tools/host_cpu_breakdown.py [case]"""
import cProfile, io, os, pstats, sys, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_cpu
host_cpu.install()
import cupaged
from cupaged import _prepared, _arrays, _checks, launch, validation
(q, kc, vc, bt, sl), out, kw = host_cpu.build_case(sys.argv[1] if len(sys.argv) > 1 else "single")
print("cupaged from", cupaged.__file__)
plan = cupaged.AttentionPlan(q, kc, vc, bt, sl, out=out, **kw)
run = lambda: plan.run(q, kc, vc, out=out)
att = lambda: cupaged.attention(q, kc, vc, bt, sl, out=out, **kw)
for _ in range(3000): run(); att()
N = 100_000
for name, fn in (("AttentionPlan.run", run), ("attention (memo)", att)):
    med, lo = host_cpu.per_call_ns(fn, N, batches=20)
    total = med / 1000
    pr = cProfile.Profile(); pr.enable()
    for _ in range(N): fn()
    pr.disable()
    st = pstats.Stats(pr)
    rows = [(v[2], k) for k, v in st.stats.items()]  # tottime
    tt = sum(r[0] for r in rows)
    print(f"==== {name}: {total:.2f} us/call (median of 20 x {N//20}); cProfile tottime shares scaled to it")
    for t, k in sorted(rows, reverse=True)[:16]:
        fname = f"{os.path.basename(k[0])}:{k[1]}({k[2]})"
        print(f"  {fname:55s} {100*t/tt:5.1f}%  {total*t/tt:5.2f} us")
