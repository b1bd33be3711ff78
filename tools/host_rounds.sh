#!/usr/bin/env bash
# Host time per call, measured so that few-µs changes show: each process pinned to one
# core (taskset), several processes per library, old (.regress/old) and new alternating,
# min and median over processes per row (tools/host_rounds_summary.py).
#   ROUNDS=5 CORE=3 bash tools/host_rounds.sh
source "$(dirname "$0")/device_env.sh"
ROUNDS=${ROUNDS:-5}
CORE=${CORE:-3}
old=/tmp/cupaged-old-lib
rm -rf "$old" && mkdir -p "$old" && cp -r .regress/old/cupaged .regress/old/cuda_src "$old"/
cp cupaged/bench*.py cupaged/cli.py "$old/cupaged/"
PYTHONPATH="$old" CUPAGED_CACHE_DIR=/tmp/kc-old python3 -m cupaged.cli overhead >/dev/null 2>&1
python3 -m cupaged.cli overhead >/dev/null 2>&1  # compiled once, outside the rounds
for round in $(seq "$ROUNDS"); do
  PYTHONPATH="$old" CUPAGED_CACHE_DIR=/tmp/kc-old taskset -c "$CORE" python3 -m cupaged.cli overhead \
    > "$OUT/host-old-$round.txt" 2>&1
  taskset -c "$CORE" python3 -m cupaged.cli overhead > "$OUT/host-new-$round.txt" 2>&1
done
python3 tools/host_rounds_summary.py "$OUT"/host-old-*.txt -- "$OUT"/host-new-*.txt | tee "$OUT/host-rounds.txt"
