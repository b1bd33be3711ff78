#!/usr/bin/env python3
"""The split model's rule for partition="auto": never more than 5% slower than the better
of "never" and "always". One case per (batch, context), built once; the three choices are
checked and timed on the same data in the same run (cupaged.bench.timing).

    python3 tools/split_check.py [--batch 1,8,64,256] [--context 128,1024,8192,32768,131072]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy  # noqa: E402
import numpy as np  # noqa: E402

from cupaged.bench import decode as bench_decode  # noqa: E402
from cupaged.bench import timing, workloads  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,64,256")
    ap.add_argument("--context", default="128,1024,8192,32768,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-gib", type=float, default=40.0, help="skip caches larger than this")
    a = ap.parse_args()
    print(f"{'batch':>5s} {'context':>7s} {'auto us':>9s} {'never us':>9s} {'always us':>9s} "
          f"{'auto/best':>9s}")
    worst = 0.0
    for b in (int(v) for v in a.batch.split(",")):
        for c in (int(v) for v in a.context.split(",")):
            gib = b * c * a.kv_heads * 128 * 2 * np.dtype(a.dtype).itemsize / 2**30
            if gib > a.max_gib:
                print(f"{b:5d} {c:7d} skipped ({gib:.0f} GiB of cache)")
                continue
            w = workloads.Workload(b, c, a.heads, a.kv_heads, 128, 16, a.dtype)
            case = w.case(0).build()
            t = {}
            for part in ("auto", "never", "always"):
                run = bench_decode.run_cupaged(case, part)
                err = case.check(run(), max_seqs=2)
                if not err <= case.tolerance():
                    sys.exit(f"batch {b} context {c} partition {part}: rel err {err:.2e}")
                t[part] = timing.time_us(run, reps=a.reps).median_us
            ratio = t["auto"] / min(t["never"], t["always"])
            worst = max(worst, ratio)
            print(f"{b:5d} {c:7d} {t['auto']:9.1f} {t['never']:9.1f} {t['always']:9.1f} "
                  f"{ratio:9.3f}", flush=True)
            case.arrays.clear()
            cupy.get_default_memory_pool().free_all_blocks()
    print(f"worst auto / best = {worst:.3f}")


if __name__ == "__main__":
    main()
