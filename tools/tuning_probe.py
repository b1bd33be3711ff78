#!/usr/bin/env python3
"""Decode under tuning overrides, side by side on the same data in one process: each
setting is ``ctas[@partition[@TOKENSxSTAGES]]`` ("-" for the default, e.g. ``-``,
``2@never``, ``2@auto@128x2``), run through ``cupaged.attention`` on a token-major layout
and checked against the float64 reference before it is timed. FlashInfer's tensor-core
decode joins the rounds when it is importable (carry .flashinfer). Rounds alternate the
settings (``timing.time_us``: L2 flushed, device time), so all see the same clocks.

    python3 tools/tuning_probe.py --settings=-,2@never,2@auto [--layout HND]
        [--shapes 32/8/64/2048,32/32/64/2048 | --heads 32/8,32/32 --batch 8,64 --context 2048]
        [--rounds 3] [--reps 10]

The last column is the first setting's time over the best of the others ("auto" against
every fixed choice, when the first is the default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy  # noqa: E402
import numpy as np  # noqa: E402

import cupaged  # noqa: E402
from cupaged import planning  # noqa: E402
from cupaged.bench import decode as bench_decode
from cupaged.bench import timing
from cupaged.bench import workloads

SHAPES = "32/8/64/2048,32/32/64/2048,32/8/8/32768,32/8/256/512,32/8/128/uniform:128:4096,8/1/64/4096"


_partition = "auto"
_plan_decode = planning.plan_decode


def _plan_with(p, max_ctx, partition, *args, **kw):
    """planning.plan_decode with the probe's partition instead of attention's "auto"."""
    return _plan_decode(p, max_ctx, _partition, *args, **kw)


planning.plan_decode = _plan_with  # attention() has no partition argument: the probe's lever


def _set(tile, ctas, partition) -> None:
    global _partition
    _partition = partition
    planning.set_tuning(tile, ctas)  # also drops the prepared calls planned before


def _tuning(setting: str):
    """(tile, ctas per SM, partition) of a setting; "-" fields are the defaults."""
    parts = setting.split("@")
    if len(parts) > 3:
        raise SystemExit(f"setting {setting!r}: ctas[@partition[@TOKENSxSTAGES]]")
    ctas, partition, tile = parts + ["auto", ""][len(parts) - 1:]
    tile_t = tuple(int(x) for x in tile.split("x")) if tile else None
    return (tile_t, int(ctas) if ctas and ctas != "-" else None,
            int(partition) if partition.isdigit() else partition)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="-,2@never,2@auto")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--heads", default="", help="with --batch and --context: their product")
    ap.add_argument("--batch", default="")
    ap.add_argument("--context", default="")
    ap.add_argument("--max-gib", type=float, default=20.0,
                    help="skip caches larger than this (the layout's copy doubles it)")
    ap.add_argument("--layout", default="HND")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8_e4m3 or fp8_e5m2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    shapes = a.shapes.split(",")
    if a.heads:
        if not (a.batch and a.context):
            raise SystemExit("--heads needs --batch and --context")
        shapes = [f"{h}/{b}/{c}" for h in a.heads.split(",") for b in a.batch.split(",")
                  for c in a.context.split(",")]
    settings = a.settings.split(",")
    tunings = [_tuning(x) for x in settings]  # bad settings fail here, before any GPU work
    fi = bench_decode.IMPLEMENTATIONS.get("flashinfer-decode-tc")
    fi_ok = fi is not None and fi[1]()
    bw = timing.copy_bandwidth()
    names = settings + (["fi-tc"] if fi_ok else [])
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; {a.dtype} (cache {a.kv_cache_dtype}) "
          f"hs{a.head_size} bs16 {a.layout}; device time "
          f"(µs), median of {a.rounds} rounds x {a.reps}; % of copy in brackets")
    print(f"{'heads':>6s} {'batch':>5s} {'context':>16s} " + " ".join(f"{n:>17s}" for n in names)
          + f" {'first/best':>10s}")
    worst = 0.0
    for shape in shapes:
        worst = max(worst, _row(a, shape, settings, tunings, names, fi if fi_ok else None, bw))
        cupy.get_default_memory_pool().free_all_blocks()  # the shape's arrays are gone
    print(f"worst first/best: {worst:.3f}")


def _row(a, shape: str, settings: list, tunings: list, names: list, fi, bw: float) -> float:
    """Check and time one shape under every setting; print its line; return the first
    setting's time over the best of the others (0 when skipped)."""
    h, kv, b, ctx = shape.split("/", 3)
    heads, kvh, batch = int(h), int(kv), int(b)
    context = workloads.parse_context_dist(ctx) if ctx.startswith("uniform:") else int(ctx)
    hs = a.head_size
    lens = workloads.Workload(batch, context, 1, 1, hs, 16, a.dtype).lengths(seed=0)
    item = 1 if a.kv_cache_dtype != "auto" else np.dtype(a.dtype).itemsize
    gib = int(lens.sum()) * kvh * hs * 2 * item / 2**30
    if gib > a.max_gib:
        print(f"{heads:>3d}/{kvh:<2d} {batch:5d} {ctx:>16s} skipped ({gib:.0f} GiB of cache)")
        return 0.0
    case = workloads.DecodeCase(batch, lens, heads, kvh, hs, 16, np.dtype(a.dtype),
                            kv_cache_dtype=a.kv_cache_dtype).build()
    arr = case.arrays
    k, v = bench_decode.cache_in_layout(arr["key_cache"], arr["value_cache"], a.layout)
    max_len = int(case.context_lens.max(initial=0))
    bad, calls = [], {}
    for s, tuning in zip(settings, tunings):
        out = cupy.full(arr["query"].shape, np.nan, arr["query"].dtype)

        def call(out=out):
            return cupaged.attention(arr["query"], k, v, arr["block_tables"],
                                     arr["context_lens"], kv_layout=a.layout,
                                     max_seq_len=max_len, out=out, **case.kv_args)
        _set(*tuning)
        call()
        if not case.check(out) <= case.tolerance():
            bad.append(s)
        calls[s] = (call, tuning)
    if fi is not None:
        calls["fi-tc"] = (fi[0](case, "auto"), (None, None, "auto"))
    times = {n: [] for n in names}
    for _ in range(a.rounds):
        for n in names:
            fn, tuning = calls[n]
            _set(*tuning)
            times[n].append(timing.time_us(fn, reps=a.reps).median_us)
    _set(None, None, "auto")
    med = {n: statistics.median(times[n]) for n in names}
    cells = [f"{med[n]:8.1f} ({case.bytes_moved / (med[n] * 1e-6) / bw * 100:5.1f}%)"
             for n in names]
    ratio = med[settings[0]] / min(med[n] for n in settings[1:]) if len(settings) > 1 else 1.0
    flag = f"  CHECK FAILED: {bad}" if bad else ""
    print(f"{heads:>3d}/{kvh:<2d} {batch:5d} {ctx:>16s} " + " ".join(f"{c:>17s}" for c in cells)
          + f" {ratio:10.3f}" + flag, flush=True)
    return ratio


if __name__ == "__main__":
    main()
