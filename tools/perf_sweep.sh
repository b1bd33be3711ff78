#!/usr/bin/env bash
# The compare sweeps quoted in docs/PERFORMANCE.md: llama-3-8b (GQA 32/8) and llama-2-7b
# (MHA 32/32), fp16, batch 1..256 x context 512..32768. Results and plots go to $OUT.
source "$(dirname "$0")/device_env.sh"
tag=${1:-now}
for preset in llama-3-8b llama-2-7b; do
  python3 -m cupaged.cli compare --preset "$preset" --batch 1,8,64,256 \
    --context 512,2048,8192,32768 --reps 20 --json "$OUT/compare-$preset-$tag.json" \
    --plot "$OUT/compare-$preset-$tag.png" 2>/dev/null | tee "$OUT/compare-$preset-$tag.txt"
done
