"""Time paged_prefill's tile shapes (warps, m_atoms, tile_tokens, stages) on the prefill
presets: which default to pick. Device only; prints one line per (tile, shape).
    [SOFT_CAP=50] [TILES="4,2,64,2 8,1,32,2"] python3 tools/prefill_tiles.py [preset ...]
    FAMILY=sm90 TILES="128,3 128,2 64,3" python3 tools/prefill_tiles.py [preset ...]
(SOFT_CAP: time the soft-cap variant instead of plain attention; TILES: only these;
FAMILY=sm90: paged_prefill_sm90's (tile_tokens, stages) on a Hopper GPU.)"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupaged import planning  # noqa: E402
from cupaged.bench import timing
from cupaged.bench import workloads
from cupaged.bench import prefill as bench_prefill

TILES = [(8, 1, 32, 2), (4, 2, 64, 2), (8, 1, 64, 2), (4, 1, 64, 2), (4, 2, 32, 2),
         (4, 1, 32, 2), (8, 1, 32, 3), (4, 1, 64, 3), (2, 1, 128, 2)]
sm90 = os.environ.get("FAMILY") == "sm90"
if sm90:
    TILES = [(128, 3), (128, 2), (64, 3), (64, 2), (64, 4)]
if os.environ.get("TILES"):
    TILES = [tuple(int(x) for x in t.split(",")) for t in os.environ["TILES"].split()]
names = sys.argv[1:] or ["prompt-4096", "8x2048", "chunk-512-of-8192", "verify-64x4x2048"]
cap = float(os.environ["SOFT_CAP"]) if os.environ.get("SOFT_CAP") else None
variants = workloads.Variants(soft_cap=cap) if cap else workloads.PLAIN
cases = [bench_prefill.PrefillCase(n, **bench_prefill.PRESETS[n], variants=variants)
         for n in names]
bw = timing.copy_bandwidth()
for tile in TILES:
    (planning.set_sm90_tile if sm90 else planning.set_prefill_tile)(tile)
    label = ("n{}x{}" if sm90 else "w{}m{}n{}x{}").format(*tile)
    for r in bench_prefill.measure(cases, ["cupaged"], reps=10, copy_bw=bw):
        print(f"{label} {r.case:20s} {r.median_us:9.1f} us "
              f"{r.tflops:6.1f} TF {r.pct_copy:5.1f}% copy err {r.error:.1e} {r.note}", flush=True)
planning.set_prefill_tile(None)
planning.set_sm90_tile(None)
