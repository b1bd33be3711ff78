#!/usr/bin/env bash
# Host time per call (cupaged-bench overhead) of the library as it was (.regress/old, see
# tools/regression_check.sh) and as it is, in one run on one machine: host-time changes
# are only comparable that way.
source "$(dirname "$0")/device_env.sh"
old=/tmp/cupaged-old-lib
rm -rf "$old" && mkdir -p "$old" && cp -r .regress/old/cupaged .regress/old/cuda_src "$old"/
# The instrument is today's (the benchmark modules); the library under test is the old one.
# (Needs the old library to have what today's benchmark calls.)
cp cupaged/bench*.py cupaged/cli.py "$old/cupaged/"
for round in 1 2 3; do
  echo "== before (round $round)"; PYTHONPATH="$old" CUPAGED_CACHE_DIR=/tmp/kc-old python3 -m cupaged.cli overhead
  echo "== now (round $round)"; python3 -m cupaged.cli overhead
done 2>&1 | tee "$OUT/overhead-vs.txt"
