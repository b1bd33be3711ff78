#!/usr/bin/env bash
# cupaged beside FlashInfer on the same data: FlashInfer's batch decode on CUDA cores and
# on tensor cores, its plan-free XQA kernel, and torch SDPA over dense K/V; llama-3-8b
# (GQA 32/8) and llama-3-70b-tp8 (8/1), fp16, batch 1..256 x context 512..32768.
# The full table, JSON, CSV, plot and stderr go to $OUT; the console gets a summary.
#
# Needs FlashInfer's wheels and setup.sh in .flashinfer/ at the repository root (git-ignored:
# a copy of shared/anchors/flashinfer/, carried to the device with the working tree); this
# script copies nothing. Each FlashInfer module compiles with nvcc on first use (decode
# ~10 s, tensor cores ~16 s, XQA ~6 s per group size), outside every timing.
#   bash tools/compare_sweep.sh [compare options...]
# Options given here come last, so they override --batch, --context, --reps; --preset and
# --impl add to the defaults, which PRESETS="..." and IMPLS="..." replace. TAG names files.
source "$(dirname "$0")/device_env.sh"
tag=${TAG:-now}
base="$OUT/flashinfer-$tag"

if [ ! -f .flashinfer/setup.sh ]; then
  echo "no .flashinfer/setup.sh: copy shared/anchors/flashinfer/ (wheels + setup.sh) to" \
       ".flashinfer/ in the repository root first" >&2
  exit 2
fi
source .flashinfer/setup.sh || { echo "FlashInfer setup failed" >&2; exit 2; }
python3 -c "import flashinfer as f, torch as t; print('flashinfer', f.__version__, '| torch',
  t.__version__, '| CUDA', t.version.cuda, '|', t.cuda.get_device_name())" || exit 2

args=()
for p in ${PRESETS:-llama-3-8b llama-3-70b-tp8}; do args+=(--preset "$p"); done
for i in ${IMPLS:-cupaged flashinfer-decode flashinfer-decode-tc flashinfer-xqa torch-sdpa-dense}; do
  args+=(--impl "$i")
done
python3 -c "import matplotlib" 2>/dev/null && args+=(--plot "$base.png")
rm -f "$base.json"  # its presence below means this run wrote it
python3 -m cupaged.bench compare "${args[@]}" --batch 1,8,64,256 --context 512,2048,8192,32768 \
  --reps 20 --json "$base.json" --csv "$base.csv" "$@" >"$base.txt" 2>"$base.stderr.txt"
status=$?

if [ ! -f "$base.json" ]; then  # compare stopped early: show why
  tail -n 20 "$base.txt" "$base.stderr.txt"
  echo "compare exit status: $status"
  exit "$status"
fi
grep -m1 "^copy bandwidth" "$base.txt"
# One line per workload: cupaged's time, then each peer as time / cupaged's time, then
# plan() host times; then the notes of rows that did not run or failed their check.
python3 - "$base.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
short = lambda i: i.replace("flashinfer-", "fi-").replace("torch-sdpa-", "sdpa-")
impls = list(dict.fromkeys(r["impl"] for r in rows))
peers = [i for i in impls if i != "cupaged"]
planned = [i for i in impls if any(r["plan_us"] == r["plan_us"] for r in rows if r["impl"] == i)]
print(f"{'preset':16s} {'batch':>5s} {'context':>7s} {'cupaged us':>10s} {'%copy':>6s} |"
      + "".join(f" {short(i):>12s}" for i in peers) + " | plan us:"
      + "".join(f" {short(i):>12s}" for i in planned))
work = {}
for r in rows:
    work.setdefault((r["preset"], r["batch"], r["context"]), {})[r["impl"]] = r
cell = lambda r, key, fmt: ("-" if r is None else format(r[key], fmt) if r["status"] == "ok"
                           else r["status"][:4].upper())
for (preset, b, c), by in work.items():
    cp = by.get("cupaged")
    print(f"{preset:16s} {b:5d} {c:>7s} {cell(cp, 'median_us', '.1f'):>10s} "
          f"{cell(cp, 'pct_copy', '.1f'):>6s} |"
          + "".join(f" {cell(by.get(i), 'ratio_to_cupaged', '.2f'):>12s}" for i in peers)
          + " |         "
          + "".join(f" {cell(by.get(i), 'plan_us', '.0f'):>12s}" for i in planned))
print("peer columns: time / cupaged's time (above 1: cupaged is faster)")
notes = {}
for r in rows:
    if r["status"] != "ok":
        key = (r["impl"], r["status"], r["note"][:150])
        notes[key] = notes.get(key, 0) + 1
for (impl, status, note), n in list(notes.items())[:15]:
    print(f"{n:3d} x {impl} {status}: {note}")
EOF
tail -n 1 "$base.txt" | grep "rows skipped"
echo "compare exit status: $status (full table: $base.txt)"
exit "$status"
