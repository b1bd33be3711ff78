#!/usr/bin/env bash
# Eight decode rows through cupaged-bench compare, one run: cupaged on the
# vLLM, NHD and HND layouts beside FlashInfer's decode, tensor-core decode and XQA and
# dense torch SDPA, on the same data, fp16 and bf16 (head size 128, block size 16).
# Tables in $OUT/decode-rows-<dtype>.txt, CSVs beside them.
#   [DTYPES="float16 bfloat16"] [REPS=20] bash tools/decode_rows.sh
# Needs .flashinfer/ (a copy of shared/anchors/flashinfer/) for the FlashInfer columns.
source "$(dirname "$0")/device_env.sh"
[ -f .flashinfer/setup.sh ] && source .flashinfer/setup.sh >/dev/null 2>&1
rows=(  # heads kv_heads batch context
  "32 8 64 2048" "32 32 64 2048" "32 8 8 32768" "32 8 1 1024"
  "32 8 128 uniform:128:4096" "32 8 256 512" "8 1 64 4096" "32 8 1 131072")
impls=(cupaged cupaged-nhd cupaged-hnd flashinfer-decode flashinfer-decode-tc flashinfer-xqa
       torch-sdpa-dense)
for dt in ${DTYPES:-float16 bfloat16}; do
  for r in "${rows[@]}"; do
    set -- $r
    case "$4" in uniform:*) ctx=(--context-dist "$4") ;; *) ctx=(--context "$4") ;; esac
    tag="$dt-$1_$2_$3_${4//:/-}"
    python3 -m cupaged.bench compare --heads "$1" --kv-heads "$2" --batch "$3" "${ctx[@]}" \
      --dtype "$dt" --reps "${REPS:-20}" ${impls[@]/#/--impl } --csv "$OUT/decode-rows-$tag.csv" \
      2>>"$OUT/decode-rows-stderr.txt" | grep -v "^#" | tee -a "$OUT/decode-rows-$dt.txt"
  done
done
