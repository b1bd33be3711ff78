#!/usr/bin/env bash
# The attention variants' rows through cupaged-bench, one run on the GPU machine: a window
# against a plain context of its size, soft-cap / sinks / ALiBi against plain decode and
# prefill, the cascade case. FI=1 adds FlashInfer (carry .flashinfer) with window and cap.
source "$(dirname "$0")/device_env.sh"
b() { python3 -m cupaged.bench "$@"; }
if [ "${FI:-0}" = 1 ]; then
  source .flashinfer/setup.sh >/dev/null 2>&1
  b compare --batch 8 --context 32768 --heads 32 --kv-heads 8 --window 512 \
    --impl cupaged --impl cupaged-hnd --impl flashinfer-decode --impl flashinfer-decode-tc \
    --impl flashinfer-xqa 2>&1 | tail -7
  b compare --batch 64 --context 2048 --heads 32 --kv-heads 8 --soft-cap 50 \
    --impl cupaged --impl cupaged-hnd --impl flashinfer-decode --impl flashinfer-decode-tc 2>&1 | tail -6
  # Sinks: FlashInfer's XQA takes them (its decode wrappers are not given them here).
  for kv in 8 32; do
    b compare --batch 64 --context 2048 --heads 32 --kv-heads $kv --sinks \
      --impl cupaged --impl cupaged-hnd --impl flashinfer-xqa 2>&1 | tail -5
  done
  exit 0
fi
echo "== window 512 over 32768 vs plain 512 (batch 8, 32/8)"
b decode --batch 8 --context 32768 --heads 32 --kv-heads 8 --window 512 --json "$OUT/w512.json" 2>&1 | tail -2
b decode --batch 8 --context 512 --heads 32 --kv-heads 8 --json "$OUT/plain512.json" 2>&1 | tail -2
echo "== decode variants (batch 64, ctx 2048, 32/8 and 32/32)"
for kv in 8 32; do
  for v in "" "--soft-cap 50" "--sinks" "--alibi"; do
    echo "-- kv $kv $v"; b decode --batch 64 --context 2048 --heads 32 --kv-heads $kv $v 2>&1 | tail -1
  done
done
echo "== prefill variants"
for v in "" "--soft-cap 50" "--soft-cap 1" "--sinks" "--window 4096"; do
  echo "-- $v"; b prefill --preset prompt-4096 --preset 8x2048 --impl cupaged $v 2>&1 | tail -2
done
echo "== cascade"
b cascade --json "$OUT/cascade.json" 2>&1 | tail -8
