#!/usr/bin/env bash
# fp8 decode rows through cupaged-bench compare: cupaged (vLLM layout and HND) and
# FlashInfer's decode wrappers, over an fp8 e4m3 cache and over the query's float16, one
# run. CSVs in $OUT/fp8-decode-rows-<cache>-<shape>.csv.
#   [CACHES="fp8_e4m3 auto"] bash tools/fp8_decode_rows.sh
source "$(dirname "$0")/device_env.sh"
[ -f .flashinfer/setup.sh ] && source .flashinfer/setup.sh >/dev/null 2>&1
shapes=("8 64 2048" "32 64 2048" "8 8 32768")  # kv heads, batch, context (32 query heads)
for kv in ${CACHES:-fp8_e4m3 auto}; do
  for s in "${shapes[@]}"; do
    set -- $s
    python3 -m cupaged.bench compare --heads 32 --kv-heads "$1" --batch "$2" --context "$3" \
      --kv-cache-dtype "$kv" --impl cupaged --impl cupaged-hnd --impl flashinfer-decode \
      --impl flashinfer-decode-tc --csv "$OUT/fp8-decode-rows-$kv-$1_$2_$3.csv" 2>&1 | tail -7
  done
done
