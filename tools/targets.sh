#!/usr/bin/env bash
# Issue 5's roofline targets: each shape with partition auto, never and always, fp16,
# head size 128, block size 16. Rows go to $OUT/targets-<tag>.txt.
source "$(dirname "$0")/device_env.sh"
tag=${1:-now}
run() { python3 -m cupaged.cli decode --reps 20 "$@" 2>/dev/null | grep -v "^copy bandwidth\|^implementation"; }
{
  python3 -m cupaged.cli decode --batch 1 --context 16 --reps 3 2>/dev/null | head -2
  for part in auto never always; do
    echo "# partition=$part"
    run --partition $part --heads 32 --kv-heads 8 --batch 64 --context 2048
    run --partition $part --heads 32 --kv-heads 32 --batch 64 --context 2048
    run --partition $part --heads 32 --kv-heads 8 --batch 8 --context 32768
    run --partition $part --heads 32 --kv-heads 8 --batch 128 --context-dist uniform:128:4096
    run --partition $part --heads 32 --kv-heads 8 --batch 256 --context 512
    run --partition $part --heads 32 --kv-heads 8 --batch 1 --context 1024
    run --partition $part --heads 32 --kv-heads 8 --batch 1 --context 131072
    run --partition $part --heads 8 --kv-heads 1 --batch 64 --context 4096
  done
} | tee "$OUT/targets-$tag.txt"
