#!/usr/bin/env bash
# A whole device check in one call: environment, the GPU test suite, and the decode
# benchmark of the core issue. Logs go to $OUT (the device tool brings them back).
#   bash tools/device_check.sh [pytest args...]     e.g. -k long_context
source "$(dirname "$0")/device_env.sh"
bench() { python3 -m cupaged.cli "$@"; }

bench info 2>&1 | tee "$OUT/info.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu-tests.txt" | tail -25
status=${PIPESTATUS[0]}
bench decode --batch 64 --context 2048 --heads 32 --kv-heads 8 --head-size 128 \
  --block-size 16 --dtype float16 2>&1 | tee "$OUT/bench-decode.txt"
bench compile --head-size 128 --block-size 16 2>&1 | tee "$OUT/bench-compile.txt"
bench cache-ops 2>&1 | tee "$OUT/bench-cache-ops.txt"
bench overhead 2>&1 | tee "$OUT/bench-overhead.txt"
echo "gpu suite exit status: $status"
exit "$status"
