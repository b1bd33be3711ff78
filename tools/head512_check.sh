#!/usr/bin/env bash
# Device: head sizes above 256 (every multiple of 16 to 512). The GPU tests that reach them
# (the multi-token kernel's pairs of warps, decode, fp8 caches, the cache write), then
# the rows their targets are read from: decode at batch 64, context 4096 against the copy
# bandwidth, and prefill TFLOP/s at head size 512 beside 256 and 128 in the same run.
#   bash tools/head512_check.sh            # tests + rows
#   ROWS_ONLY=1 bash tools/head512_check.sh
#   PEERS=1 bash tools/head512_check.sh    # FlashInfer's rows at 512 too (carry .flashinfer:
#                                          # its large-head fa2 modules compile, minutes)
source "$(dirname "$0")/device_env.sh"
bench() { python3 -m cupaged.bench "$@"; }
status=0
if [ -z "${ROWS_ONLY:-}" ]; then
  big="hs272 or hs288 or hs304 or hs320 or hs336 or hs352 or hs368 or hs384 or hs400"
  big="$big or hs416 or hs432 or hs448 or hs464 or hs480 or hs496 or hs512"
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen.py \
    "tests/test_fp8.py" "tests/test_decode.py" -k "$big or 512 or 384 or large_float32" \
    2>&1 | tee "$OUT/tests.txt" | tail -6
  status=${PIPESTATUS[0]}
fi
for hs in 128 256 512; do
  bench decode --batch 64 --context 4096 --heads 32 --kv-heads 8 --head-size $hs \
    --block-size 16 --dtype bfloat16 --reps 20 2>&1 | tail -2
done | tee "$OUT/decode-rows.txt"
for hs in 128 256 512; do
  bench prefill --batch 4 --query-len 4096 --heads 16 --kv-heads 4 --head-size $hs \
    --impl cupaged --impl cupaged-mma --reps 10 2>&1 | tail -3
done | tee "$OUT/prefill-rows.txt"
if [ -n "${PEERS:-}" ]; then
  bench compare --batch 64 --context 4096 --heads 32 --kv-heads 8 --head-size 512 \
    --block-size 16 --dtype bfloat16 --reps 20 2>&1 | tail -6 | tee "$OUT/decode-peers.txt"
  bench prefill --batch 4 --query-len 4096 --heads 16 --kv-heads 4 --head-size 512 \
    --impl cupaged --impl flashinfer-fa2 --reps 10 2>&1 | tail -4 | tee "$OUT/prefill-peers.txt"
fi
echo "tests exit status: $status"
exit "$status"
