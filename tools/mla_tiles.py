"""Time mla_attention's tile shapes (rows, tile_tokens, stages) and split-KV sizes on the
MLA presets: which the planner should pick. Device only; one line per (shape, split, case).
    [TILES="16,32,4 16,32,2"] [SPLITS="auto 0 16"] [KV=fp8_e4m3] python3 tools/mla_tiles.py [preset ...]
(TILES: only these shapes, default every one this GPU's shared memory holds for the rows a
case needs; SPLITS: tiles per split-KV partition, "auto" the planner's; KV: the cache's
dtype.) Each line says how many CTAs of its shape an SM holds ("x2": two)."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupaged import planning  # noqa: E402
from cupaged.bench import mla as bench_mla  # noqa: E402
from cupaged.bench import timing  # noqa: E402
from cupaged.specs import geometry  # noqa: E402

names = sys.argv[1:] or ["dsv3-16h-4k", "dsv3-128h-4k"]
kv = os.environ.get("KV", "auto")
splits = [None if s == "auto" else int(s) for s in os.environ.get("SPLITS", "auto").split()]
dev = planning.device_info(0)
bw = timing.copy_bandwidth()
for name in names:
    rows_needed = bench_mla.PRESETS[name]["heads"] * bench_mla.PRESETS[name]["q_len"]
    if os.environ.get("TILES"):
        tiles = [tuple(int(x) for x in t.split(",")) for t in os.environ["TILES"].split()]
    else:
        rows = min(64, max(16, 1 << (rows_needed - 1).bit_length()))
        tiles = [(rows, t, s) for t in (16, 32) for s in (2, 3, 4)]
    csz = 1 if kv != "auto" else 2
    for tile in tiles:
        g = geometry.MlaGeometry(512, 64, *tile, csz)
        if not g.fits(dev.arch):
            continue
        # CTAs an SM holds (shared memory and registers: the occupancy API)
        k = planning.mla_kernel(0, "bf16", "bf16" if kv == "auto" else kv.split("_")[1], 512,
                                64, 64, tile)
        two = f"x{k.slots // dev.sm_count}"
        for split in splits:
            planning.set_mla_tile(tile)
            planning.set_mla_split(split)
            case = bench_mla.preset_case(name, kv_cache_dtype=kv)
            for r in bench_mla.measure([case], ["cupaged"], reps=10, copy_bw=bw):
                print(f"r{tile[0]}t{tile[1]}x{tile[2]} {two} split={split} {r.case:16s} "
                      f"{r.median_us:9.1f} us {r.tflops:6.1f} TF {r.pct_copy:5.1f}% copy "
                      f"err {r.error:.1e} {r.note}", flush=True)
planning.set_mla_tile(None)
planning.set_mla_split(None)
