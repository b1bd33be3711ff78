"""``cupaged-bench ab``: A/B measurements in ONE process with the two sides' runs
interleaved, so both see the same clocks and the same CPU phases.

Why one process: on the GPU machine the CPU runs in phases of seconds up to 1.7x apart
(every row of ``cupaged-bench overhead`` moves together) and the GPU's clocks drift, so
timings from separate processes, or from separate stretches of one process, cannot
resolve a few percent. Rounds alternate the sides; the median of each side (host: of the
per-round ratios) is the figure to quote.

- ``decode``: decode kernel time, another library tree (imported under another name)
  against this one, on the same data, three cache layouts.
- ``host``: host time per call of the entry points, another tree against this one.
- ``tuning``: decode under planner overrides (CTAs per SM, split-KV partitioning, the
  decode tile) side by side on the same data, FlashInfer's tensor-core decode beside
  them where it imports.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import cupy
import numpy as np

# heads, kv heads, batch, context (tokens or (lo, hi)): the eight decode rows of
# docs/PERFORMANCE.md (tools/device.sh rows decode).
DECODE_ROWS = [
    (32, 8, 64, 2048), (32, 32, 64, 2048), (32, 8, 8, 32768), (32, 8, 1, 1024),
    (32, 8, 128, (128, 4096)), (32, 8, 256, 512), (8, 1, 64, 4096), (32, 8, 1, 131072),
]
# ab tuning's default shapes.
TUNING_ROWS = [
    (32, 8, 64, 2048), (32, 32, 64, 2048), (32, 8, 8, 32768), (32, 8, 256, 512),
    (32, 8, 128, (128, 4096)), (8, 1, 64, 4096),
]


def context_label(context) -> str:
    return str(context) if isinstance(context, int) else f"uniform:{context[0]}:{context[1]}"


def load_tree(path: str, alias: str = "cupaged_other"):
    """The library in ``path`` (a folder holding ``cupaged/`` and ``cuda_src/``, e.g. made
    by ``git archive BASE cupaged cuda_src | tar -x -C .ab/base``) imported as the package
    ``alias``: its modules import each other relatively, and its kernels compile from its
    own ``cuda_src`` (the kernel cache's key hashes the source, so the two trees' kernels
    never mix)."""
    root = Path(path).resolve()
    init = root / "cupaged" / "__init__.py"
    if not init.is_file() or not (root / "cuda_src").is_dir():
        raise FileNotFoundError(f"{path} holds no cupaged/__init__.py and cuda_src/: expected a "
                                f"copy of a checkout's cupaged/ and cuda_src/")
    if alias in sys.modules:
        return sys.modules[alias]
    spec = importlib.util.spec_from_file_location(
        alias, init, submodule_search_locations=[str(root / "cupaged")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[alias]
        raise
    return module


# ---- decode kernel time, two trees -----------------------------------------------------------


def _decode_call(lib, case, layout: str, k, v, out, starts: bool):
    """One decode call: paged_attention over vLLM's layout, else attention; with
    ``starts``, attention given query_start_loc and max_query_len=1 (as vLLM's backends
    call it), every layout."""
    a = case.arrays
    max_len = int(case.context_lens.max(initial=0))
    if starts:
        qsl = cupy.arange(len(case.context_lens) + 1, dtype=cupy.int32)
        return lambda: lib.attention(a["query"], k, v, a["block_tables"], a["context_lens"],
                                     qsl, kv_layout=layout, max_query_len=1,
                                     max_seq_len=max_len, out=out)
    if layout == "vllm":
        return lambda: lib.paged_attention(a["query"], k, v, a["block_tables"],
                                           a["context_lens"], out=out, max_context_len=max_len)
    return lambda: lib.attention(a["query"], k, v, a["block_tables"], a["context_lens"],
                                 kv_layout=layout, max_seq_len=max_len, out=out)


def decode_ab(other, rows, layouts, dtype: str = "float16", rounds: int = 3, reps: int = 10,
              starts: bool = False, echo=print) -> bool:
    """Print one line per (row, layout): both trees' median device times, new/old, this
    tree's share of the copy bandwidth and both errors against the float64 reference
    (checked before timing). Returns False when a check failed."""
    import cupaged

    from .decode import cache_in_layout
    from .timing import copy_bandwidth, time_us
    from .workloads import DecodeCase, Workload

    bw = copy_bandwidth()
    echo(f"copy bandwidth {bw / 1e9:.0f} GB/s; {dtype} hs128 bs16; device time, median of "
         f"{rounds} rounds x {reps} runs each; new/old < 1: this tree is faster")
    echo(f"{'heads':>6s} {'batch':>5s} {'context':>16s} {'layout':>6s} {'old us':>9s} "
         f"{'new us':>9s} {'new/old':>8s} {'new %copy':>9s} {'err old':>8s} {'err new':>8s}")
    ok = True
    for heads, kvh, batch, ctx in rows:
        lens = Workload(batch, ctx, 1, 1, 128, 16, dtype).lengths(seed=0)
        case = DecodeCase(batch, lens, heads, kvh, 128, 16, np.dtype(dtype)).build()
        tol = case.tolerance()
        for layout in layouts:
            k, v = cache_in_layout(case.arrays["key_cache"], case.arrays["value_cache"], layout)
            calls, errs = {}, {}
            for name, lib in (("old", other), ("new", cupaged)):
                out = cupy.full(case.arrays["query"].shape, np.nan, case.arrays["query"].dtype)
                calls[name] = _decode_call(lib, case, layout, k, v, out, starts)
                calls[name]()
                errs[name] = case.check(out)
            times = {"old": [], "new": []}
            for _ in range(rounds):
                for name in ("old", "new"):
                    times[name].append(time_us(calls[name], reps=reps).median_us)
            old, new = (statistics.median(times[n]) for n in ("old", "new"))
            pct = case.bytes_moved / (new * 1e-6) / bw * 100
            good = max(errs.values()) <= tol
            ok &= good
            echo(f"{heads:>3d}/{kvh:<2d} {batch:5d} {context_label(ctx):>16s} {layout:>6s} "
                 f"{old:9.1f} {new:9.1f} {new / old:8.3f} {pct:8.1f}% {errs['old']:8.1e} "
                 f"{errs['new']:8.1e}" + ("" if good else "  CHECK FAILED"))
            del k, v, calls
        del case
        cupy.get_default_memory_pool().free_all_blocks()
    return ok


# ---- host time per call, two trees --------------------------------------------------------------


def _python_work():
    s = 0
    for i in range(200):
        s += i * i
    return s


def host_cases(lib, a: dict, torch) -> dict:
    """name -> zero-argument call, for one library (the same arrays for both)."""
    q, kc, vc, bt, cl, out = (a[k] for k in ("query", "key_cache", "value_cache",
                                              "block_tables", "context_lens", "out"))
    hk, hv, q4, out4, starts4 = (a[k] for k in ("nhd_k", "nhd_v", "q4", "out4", "starts4"))
    wq, wk, wv, wbt, wcl, wout = (a[k] for k in ("wq", "wk", "wv", "wbt", "wcl", "wout"))
    ws = lib.DecodeWorkspace(8, 32, 128)
    mws = lib.DecodeWorkspace(8, 16, 512)
    c = {
        "python reference work (phase gauge)": _python_work,
        "paged_attention cupy single pass": lambda: lib.paged_attention(
            q, kc, vc, bt, cl, out=out, partition="never", max_context_len=1024),
        "paged_attention cupy split-KV": lambda: lib.paged_attention(
            q, kc, vc, bt, cl, out=out, partition="always", max_context_len=1024),
        "paged_attention cupy split-KV + workspace": lambda: lib.paged_attention(
            q, kc, vc, bt, cl, out=out, partition="always", workspace=ws,
            max_context_len=1024),
        "attention NHD cupy decode": lambda: lib.attention(
            q, hk, hv, bt, cl, max_seq_len=1024, out=out),
        "attention NHD cupy decode 64 x 256 (1 pass)": lambda: lib.attention(
            wq, wk, wv, wbt, wcl, max_seq_len=256, out=wout),
        "attention NHD cupy verify 8 x 4": lambda: lib.attention(
            q4, hk, hv, bt, cl, starts4, max_query_len=4, max_seq_len=1024, out=out4),
        # mla_attention over DeepSeek's combined latent cache (8 x 1024, blocks of 64): 128
        # heads, and 16 heads with a workspace for their split.
        "mla_attention cupy 128 heads": lambda: lib.mla_attention(
            a["mq128"], a["mcache"], a["mbt"], cl, scale=0.072, max_seq_len=1024,
            out=a["mout128"]),
        "mla_attention cupy 16 heads + workspace": lambda: lib.mla_attention(
            a["mq16"], a["mcache"], a["mbt"], cl, scale=0.072, max_seq_len=1024,
            out=a["mout16"], workspace=mws),
    }
    if torch is not None:
        tq, tkc, tvc, tbt, tcl, tout, thk, thv = (torch.from_dlpack(x) for x in (
            q, kc, vc, bt, cl, out, hk, hv))
        c["paged_attention torch single pass"] = lambda: lib.paged_attention(
            tq, tkc, tvc, tbt, tcl, out=tout, partition="never", max_context_len=1024)
        c["paged_attention torch split-KV + workspace"] = lambda: lib.paged_attention(
            tq, tkc, tvc, tbt, tcl, out=tout, partition="always", workspace=ws,
            max_context_len=1024)
        c["attention NHD torch decode"] = lambda: lib.attention(
            tq, thk, thv, tbt, tcl, max_seq_len=1024, out=tout)
    plan = getattr(lib, "AttentionPlan", None)
    if plan is not None:
        p = plan(q, hk, hv, bt, cl, max_seq_len=1024, out=out)
        c["AttentionPlan.run cupy decode"] = lambda: p.run(q, hk, hv, out=out)
        pw = plan(q, hk, hv, bt, cl, max_seq_len=1024, out=out, workspace=ws)
        c["AttentionPlan.run cupy decode + workspace"] = lambda: pw.run(q, hk, hv, out=out)
        pw1 = plan(wq, wk, wv, wbt, wcl, max_seq_len=256, out=wout)
        c["AttentionPlan.run cupy decode 64 x 256 (1 pass)"] = lambda: pw1.run(wq, wk, wv,
                                                                               out=wout)
        p4 = plan(q4, hk, hv, bt, cl, starts4, max_query_len=4, max_seq_len=1024, out=out4)
        c["AttentionPlan.run cupy verify 8 x 4"] = lambda: p4.run(q4, hk, hv, out=out4)
        if torch is not None:
            tp = plan(tq, thk, thv, tbt, tcl, max_seq_len=1024, out=tout)
            c["AttentionPlan.run torch decode"] = lambda: tp.run(tq, thk, thv, out=tout)
            twq, twk, twv, twbt, twcl, twout = (torch.from_dlpack(x) for x in (
                wq, wk, wv, wbt, wcl, wout))
            tpw1 = plan(twq, twk, twv, twbt, twcl, max_seq_len=256, out=twout)
            c["AttentionPlan.run torch decode 64 x 256 (1 pass)"] = lambda: tpw1.run(
                twq, twk, twv, out=twout)
            tpw = plan(tq, thk, thv, tbt, tcl, max_seq_len=1024, out=tout, workspace=ws)
            c["AttentionPlan.run torch decode + workspace"] = lambda: tpw.run(tq, thk, thv,
                                                                              out=tout)
    return c


def host_arrays() -> dict:
    """The arrays every host case reads (batch 8 x 1024 tokens, 32/8 heads, fp16)."""
    from .overhead import nhd_copy
    from .workloads import DecodeCase

    case = DecodeCase(8, np.full(8, 1024, np.int32), 32, 8, 128, 16,
                      np.dtype(np.float16)).build()
    a = dict(case.arrays)
    a["out"] = cupy.empty(a["query"].shape, a["query"].dtype)
    a["nhd_k"], a["nhd_v"] = nhd_copy(a)  # for attention's default layout
    a["q4"] = cupy.asarray(np.random.default_rng(0).standard_normal((32, 32, 128)), np.float16)
    a["out4"] = cupy.empty_like(a["q4"])
    a["starts4"] = cupy.arange(0, 36, 4, dtype=np.int32)
    # The same bytes as 64 sequences of 256 tokens: 512 CTAs, served in a single pass.
    wide = DecodeCase(64, np.full(64, 256, np.int32), 32, 8, 128, 16, np.dtype(np.float16),
                      seed=1).build().arrays
    a["wk"], a["wv"] = nhd_copy(wide)
    a["wq"], a["wbt"], a["wcl"] = wide["query"], wide["block_tables"], wide["context_lens"]
    a["wout"] = cupy.empty_like(a["wq"])
    a["mcache"] = cupy.ones((128, 64, 576), np.float16)
    a["mbt"] = cupy.arange(128, dtype=np.int32).reshape(8, 16)
    for h in (128, 16):
        a[f"mq{h}"] = cupy.ones((8, h, 576), np.float16)
        a[f"mout{h}"] = cupy.empty((8, h, 512), np.float16)
    return a


def host_ab(other, rounds: int = 15, calls: int = 100, torch=None, echo=print) -> None:
    """Print one line per case: min and median host µs per call of both trees and the
    median of the per-round ratios new/old (the rounds alternate which side goes first);
    a case the other tree lacks is timed on this one alone."""
    import cupaged

    from .timing import run_us

    a = host_arrays()
    old, new = host_cases(other, a, torch), host_cases(cupaged, a, torch)
    echo(f"{'case':46s} {'old min':>8s} {'old med':>8s} {'new min':>8s} {'new med':>8s} "
         f"{'new/old':>8s}  (us per call; {rounds} interleaved rounds of {calls} calls)")
    for name, fn_new in new.items():
        fn_old = old.get(name)
        for fn in (fn_old, fn_new):
            if fn is not None:
                for _ in range(20):
                    fn()
        o, n, r = [], [], []
        for i in range(rounds):
            if fn_old is None:
                n.append(run_us(fn_new, calls))
                continue
            if i % 2:
                tn, to = run_us(fn_new, calls), run_us(fn_old, calls)
            else:
                to, tn = run_us(fn_old, calls), run_us(fn_new, calls)
            o.append(to), n.append(tn), r.append(tn / to)
        cupy.cuda.runtime.deviceSynchronize()
        if o:
            echo(f"{name:46s} {min(o):8.1f} {statistics.median(o):8.1f} {min(n):8.1f} "
                 f"{statistics.median(n):8.1f} {statistics.median(r):8.2f}")
        else:
            echo(f"{name:46s} {'-':>8s} {'-':>8s} {min(n):8.1f} {statistics.median(n):8.1f} "
                 f"{'-':>8s}")


# ---- decode under tuning overrides --------------------------------------------------------------


def parse_setting(setting: str) -> tuple:
    """``ctas[@partition[@TOKENSxSTAGES]]`` -> (tile or None, CTAs per SM or None,
    partition): "-" (or nothing) leaves a field at its default; partition is auto, never,
    always or tokens per partition. E.g. "-", "2@never", "-@auto@64x3"."""
    parts = setting.split("@")
    if len(parts) > 3 or not setting:
        raise ValueError(f"setting {setting!r}: expected ctas[@partition[@TOKENSxSTAGES]]")
    ctas, partition, tile = (parts + ["auto", ""][len(parts) - 1:])[:3]
    try:
        n = None if ctas in ("", "-") else int(ctas)
        tile_t = None if tile in ("", "-") else tuple(int(x) for x in tile.lower().split("x"))
    except ValueError:
        raise ValueError(f"setting {setting!r}: CTAs an integer or '-', the tile "
                         f"TOKENSxSTAGES (e.g. 64x3)") from None
    if tile_t is not None and len(tile_t) != 2:
        raise ValueError(f"setting {setting!r}: the tile is TOKENSxSTAGES (e.g. 64x3)")
    if n is not None and not 1 <= n <= 32:
        raise ValueError(f"setting {setting!r}: CTAs per SM between 1 and 32")
    partition = partition or "auto"
    if partition.isdigit():
        partition = int(partition)
    elif partition not in ("auto", "never", "always"):
        raise ValueError(f"setting {setting!r}: partition auto, never, always or tokens")
    return tile_t, n, partition


class _Partition:
    """attention() has no partition argument: while active, planning.plan_decode is
    called with this partition instead of attention's "auto" (the probe's lever)."""

    def __init__(self):
        from .. import planning

        self.planning = planning
        self.real = planning.plan_decode
        self.value = "auto"

    def _plan(self, p, max_ctx, partition, *args, **kw):
        return self.real(p, max_ctx, self.value, *args, **kw)

    def set(self, tile, ctas, partition) -> None:
        self.value = partition
        self.planning.set_tuning(tile, ctas)  # also drops the prepared calls planned before

    def __enter__(self):
        self.planning.plan_decode = self._plan
        return self

    def __exit__(self, *exc):
        self.planning.plan_decode = self.real
        self.planning.set_tuning()


def tuning_ab(rows, settings: list, layout: str = "HND", dtype: str = "float16",
              head_size: int = 128, kv_cache_dtype: str = "auto", rounds: int = 3,
              reps: int = 10, max_gib: float = 20.0, peer: bool = True, echo=print) -> bool:
    """Print one line per row: each setting's median device time (and its share of the
    copy bandwidth), FlashInfer's tensor-core decode where it imports (and ``peer``), and
    the first setting's time over the best of the others; then the worst of those.
    Every setting is checked against the float64 reference before it is timed; returns
    False when a check failed."""
    from . import decode as bench_decode
    from . import timing

    tunings = [parse_setting(s) for s in settings]  # bad settings fail before GPU work
    fi = bench_decode.IMPLEMENTATIONS.get("flashinfer-decode-tc") if peer else None
    fi = fi if fi is not None and fi[1]() else None
    bw = timing.copy_bandwidth()
    names = list(settings) + (["fi-tc"] if fi else [])
    echo(f"copy bandwidth {bw / 1e9:.0f} GB/s; {dtype} (cache {kv_cache_dtype}) hs{head_size} "
         f"bs16 {layout}; device time (us), median of {rounds} rounds x {reps}; % of copy in "
         f"brackets")
    echo(f"{'heads':>6s} {'batch':>5s} {'context':>16s} " + " ".join(f"{n:>17s}" for n in names)
         + f" {'first/best':>10s}")
    worst, ok = 0.0, True
    with _Partition() as lever:
        for row in rows:
            ratio, good = _tuning_row(row, settings, tunings, names, fi, bw, lever, layout,
                                      dtype, head_size, kv_cache_dtype, rounds, reps, max_gib,
                                      echo)
            worst, ok = max(worst, ratio), ok and good
            cupy.get_default_memory_pool().free_all_blocks()  # the row's arrays are gone
    echo(f"worst first/best: {worst:.3f}")
    return ok


def _tuning_row(row, settings, tunings, names, fi, bw, lever, layout, dtype, hs, kv, rounds,
                reps, max_gib, echo) -> tuple:
    import cupaged

    from . import decode as bench_decode
    from . import timing, workloads

    heads, kvh, batch, ctx = row
    lens = workloads.Workload(batch, ctx, 1, 1, hs, 16, dtype).lengths(seed=0)
    item = 1 if kv != "auto" else np.dtype(dtype).itemsize
    gib = int(lens.sum()) * kvh * hs * 2 * item / 2**30
    label = f"{heads:>3d}/{kvh:<2d} {batch:5d} {context_label(ctx):>16s}"
    if gib > max_gib:
        echo(f"{label} skipped ({gib:.0f} GiB of cache)")
        return 0.0, True
    case = workloads.DecodeCase(batch, lens, heads, kvh, hs, 16, np.dtype(dtype),
                                kv_cache_dtype=kv).build()
    arr = case.arrays
    k, v = bench_decode.cache_in_layout(arr["key_cache"], arr["value_cache"], layout)
    max_len = int(case.context_lens.max(initial=0))
    bad, calls, unfit = [], {}, {}
    for s, tuning in zip(settings, tunings):
        out = cupy.full(arr["query"].shape, np.nan, arr["query"].dtype)

        def call(out=out):
            return cupaged.attention(arr["query"], k, v, arr["block_tables"],
                                     arr["context_lens"], kv_layout=layout,
                                     max_seq_len=max_len, out=out, **case.kv_args)
        lever.set(*tuning)
        try:
            call()
        except (ValueError, NotImplementedError) as e:  # e.g. a tile that does not fit
            unfit[s] = " ".join(str(e).split())[:160]
            continue
        if not case.check(out) <= case.tolerance():
            bad.append(s)
        calls[s] = (call, tuning)
    if fi is not None:
        calls["fi-tc"] = (fi[0](case, "auto"), (None, None, "auto"))
    times = {n: [] for n in calls}
    for _ in range(rounds):
        for n in calls:
            fn, tuning = calls[n]
            lever.set(*tuning)
            times[n].append(timing.time_us(fn, reps=reps).median_us)
    lever.set(None, None, "auto")
    med = {n: statistics.median(times[n]) for n in calls}
    cells = [f"{med[n]:8.1f} ({case.bytes_moved / (med[n] * 1e-6) / bw * 100:5.1f}%)"
             if n in med else "n/a" for n in names]
    others = [med[n] for n in settings[1:] if n in med]
    ratio = (float("nan") if settings[0] not in med else
             med[settings[0]] / min(others) if others else 1.0)
    echo(f"{label} " + " ".join(f"{c:>17s}" for c in cells) + f" {ratio:10.3f}"
         + (f"  CHECK FAILED: {bad}" if bad else ""))
    for s, why in unfit.items():
        echo(f"    {s}: {why}")
    return (0.0 if ratio != ratio else ratio), not bad
