"""Decode kernel time, the library as it was (.regress/old, imported as ``cupaged_old``)
against the working tree, on the same data in one process, runs interleaved.

Each case (the eight decode rows of tools/decode_rows.sh: heads/kv heads, batch, context) runs on vLLM's legacy
layout, NHD and HND, both libraries' outputs checked against the float64 reference before
timing. Rounds alternate old and new (``timing.time_us``: L2 flushed, a GPU busy-wait before
each run, device time), so both see the same clocks; the ratio new/old is the figure.

    python3 tools/decode_ab.py [--rounds 3] [--reps 10] [--dtype float16] [--layouts vllm,NHD,HND]
                               [--starts]
    (GPU machine; tools/decode_ab.sh sets up the old library)
"""

from __future__ import annotations

import argparse
import statistics

import cupy
import numpy as np

import cupaged
import cupaged_old
from cupaged.bench.decode import cache_in_layout
from cupaged.bench.timing import copy_bandwidth, time_us
from cupaged.bench.workloads import DecodeCase, Workload, parse_context_dist

CASES = [  # heads, kv heads, batch, context
    (32, 8, 64, "2048"), (32, 32, 64, "2048"), (32, 8, 8, "32768"), (32, 8, 1, "1024"),
    (32, 8, 128, "uniform:128:4096"), (32, 8, 256, "512"), (8, 1, 64, "4096"),
    (32, 8, 1, "131072"),
]


def _lens(batch: int, ctx: str) -> np.ndarray:
    context = parse_context_dist(ctx) if ctx.startswith("uniform:") else int(ctx)
    return Workload(batch, context, 1, 1, 128, 16, "float16").lengths(seed=0)


def _call(lib, case: DecodeCase, layout: str, k, v, out, starts=False):
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
        return lambda: lib.paged_attention(a["query"], k, v, a["block_tables"], a["context_lens"],
                                           out=out, max_context_len=max_len)
    return lambda: lib.attention(a["query"], k, v, a["block_tables"], a["context_lens"],
                                 kv_layout=layout, max_seq_len=max_len, out=out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--layouts", default="vllm,NHD,HND")
    ap.add_argument("--cases", default="", help="indices into CASES, comma-separated")
    ap.add_argument("--starts", action="store_true",
                    help="call attention with query_start_loc and max_query_len=1")
    ap.add_argument("--shapes", default="",
                    help="instead of CASES: heads/kv_heads/batch/context, comma-separated "
                         "(e.g. 32/4/64/1024,32/8/8/uniform:128:4096)")
    a = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; {a.dtype} hs128 bs16; device time, median of "
          f"{a.rounds} rounds x {a.reps} runs each; new/old < 1: the working tree is faster")
    print(f"{'heads':>6s} {'batch':>5s} {'context':>16s} {'layout':>6s} {'old us':>9s} "
          f"{'new us':>9s} {'new/old':>8s} {'new %copy':>9s} {'err old':>8s} {'err new':>8s}")
    picked = [CASES[int(i)] for i in a.cases.split(",")] if a.cases else CASES
    if a.shapes:
        picked = [(int(h), int(kv), int(b), c) for h, kv, b, c in
                  (s.split("/", 3) for s in a.shapes.split(","))]
    for heads, kvh, batch, ctx in picked:
        case = DecodeCase(batch, _lens(batch, ctx), heads, kvh, 128, 16,
                          np.dtype(a.dtype)).build()
        tol = case.tolerance()
        for layout in a.layouts.split(","):
            k, v = cache_in_layout(case.arrays["key_cache"], case.arrays["value_cache"], layout)
            outs, calls, errs = {}, {}, {}
            for name, lib in (("old", cupaged_old), ("new", cupaged)):
                out = cupy.full(case.arrays["query"].shape, np.nan, case.arrays["query"].dtype)
                calls[name] = _call(lib, case, layout, k, v, out, a.starts)
                calls[name]()
                errs[name] = case.check(out)
                outs[name] = out
            times = {"old": [], "new": []}
            for _ in range(a.rounds):
                for name in ("old", "new"):
                    times[name].append(time_us(calls[name], reps=a.reps).median_us)
            old, new = (statistics.median(times[n]) for n in ("old", "new"))
            pct = case.bytes_moved / (new * 1e-6) / bw * 100
            flag = "" if max(errs.values()) <= tol else "  CHECK FAILED"
            print(f"{heads:>3d}/{kvh:<2d} {batch:5d} {ctx:>16s} {layout:>6s} {old:9.1f} "
                  f"{new:9.1f} {new / old:8.3f} {pct:8.1f}% {errs['old']:8.1e} "
                  f"{errs['new']:8.1e}{flag}", flush=True)
            del k, v, outs
        del case
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
