#!/usr/bin/env python3
"""Tuning: the roofline shapes (32/8 and 32/32 heads at batch 64, context 2048, and
others) under several decode tiles (tokens x pipeline stages), in one
process and one run, so the rows are comparable. Each row is checked, then timed, by
cupaged.bench (the same code as `cupaged-bench decode --tile`).

    python3 tools/tile_sweep.py [--tiles default,32x3,64x2] [--dtype float16]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupaged import planning  # noqa: E402
from cupaged.bench import decode as bench_decode
from cupaged.bench import timing
from cupaged.bench import workloads

SHAPES = [  # (heads, kv_heads, batch, context)
    (32, 8, 64, 2048), (32, 32, 64, 2048), (32, 8, 8, 32768), (32, 8, 128, (128, 4096)),
    (32, 8, 256, 512), (32, 8, 1, 131072), (8, 1, 64, 4096),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="default,32x2,32x3,32x4,64x3,128x2")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--partition", default="auto")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=None, help="indices into SHAPES, e.g. 0,1")
    a = ap.parse_args()
    shapes = SHAPES if a.shapes is None else [SHAPES[int(i)] for i in a.shapes.split(",")]
    tiles = [None if t == "default" else tuple(int(v) for v in t.split("x"))
             for t in a.tiles.split(",")]
    bw = timing.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; {a.dtype} hs{a.head_size} bs{a.block_size} "
          f"partition={a.partition}")
    print(f"{'shape':9s} {'batch':>5s} {'context':>10s} " + " ".join(f"{str(t or 'default'):>16s}" for t in tiles))
    for heads, kv, batch, ctx in shapes:
        w = workloads.Workload(batch, ctx, heads, kv, a.head_size, a.block_size, a.dtype)
        cells = []
        for t in tiles:
            planning.set_tuning(tile=t)
            try:
                (r,) = bench_decode.measure(w, ["cupaged"], a.partition, a.reps, 0, bw)
            except ValueError as e:  # e.g. the tile needs more shared memory than the device has
                cells.append(f"{'n/a':>16s}")
                print(f"  {t}: {e}", file=sys.stderr)
                continue
            cells.append(f"{r.pct_copy:5.1f}% {r.median_us:8.1f}us" if r.status == "ok"
                         else f"{r.status:>16s}")
        print(f"{heads}/{kv:<6d} {batch:5d} {w.context_label:>10s} " + " ".join(cells), flush=True)
    planning.set_tuning()


if __name__ == "__main__":
    main()
