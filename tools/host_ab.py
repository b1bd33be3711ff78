"""Host time per call of the library as it was (.regress/old, imported as ``cupaged_old``)
against the working tree, in ONE process with their runs interleaved.

Why: on the GPU machine the CPU runs in phases of seconds up to 1.7x apart (every row of
`cupaged-bench overhead` moves together), so timings from separate processes, or even
from separate stretches of one process, cannot resolve a few microseconds. Interleaving
short runs of old and new puts both in the same phases; the median of the per-round
ratios new/old is the figure to quote.

    python3 tools/host_ab.py [rounds] [calls]    (GPU machine; tools/host_ab.sh sets it up)
"""

from __future__ import annotations

import statistics
import sys

import cupy
import numpy as np

import cupaged
import cupaged_old
from cupaged.bench.workloads import DecodeCase
from cupaged.bench.overhead import nhd_copy
from cupaged.bench.timing import run_us


def _python_work():
    s = 0
    for i in range(200):
        s += i * i
    return s


def cases(lib, a, torch):
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


def main(argv):
    rounds = int(argv[0]) if argv else 15
    calls = int(argv[1]) if len(argv) > 1 else 100
    try:
        import torch
    except ImportError:
        torch = None
    case = DecodeCase(8, np.full(8, 1024, np.int32), 32, 8, 128, 16, np.dtype(np.float16)).build()
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
    old, new = cases(cupaged_old, a, torch), cases(cupaged, a, torch)
    print(f"{'case':46s} {'old min':>8s} {'old med':>8s} {'new min':>8s} {'new med':>8s} "
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
            print(f"{name:46s} {min(o):8.1f} {statistics.median(o):8.1f} {min(n):8.1f} "
                  f"{statistics.median(n):8.1f} {statistics.median(r):8.2f}")
        else:
            print(f"{name:46s} {'-':>8s} {'-':>8s} {min(n):8.1f} {statistics.median(n):8.1f} "
                  f"{'-':>8s}")


if __name__ == "__main__":
    main(sys.argv[1:])
