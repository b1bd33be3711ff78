#!/usr/bin/env bash
# Eight decode rows through cupaged-bench compare, one run (one process) a dtype: cupaged on
# the vLLM, NHD and HND layouts beside FlashInfer's decode, tensor-core decode and XQA and
# dense torch SDPA, on the same data, fp16 and bf16 (head size 128, block size 16).
# Tables in $OUT/decode-rows-<dtype>.txt, CSVs beside them.
#   [DTYPES="float16 bfloat16"] [REPS=20] bash tools/decode_rows.sh
# Needs .flashinfer/ (a copy of shared/anchors/flashinfer/) for the FlashInfer columns.
source "$(dirname "$0")/device_env.sh"
[ -f .flashinfer/setup.sh ] && source .flashinfer/setup.sh >/dev/null 2>&1
rows=(  # heads/kv_heads/batch/context
  32/8/64/2048 32/32/64/2048 32/8/8/32768 32/8/1/1024 32/8/128/uniform:128:4096 32/8/256/512
  8/1/64/4096 32/8/1/131072)
impls=(cupaged cupaged-nhd cupaged-hnd flashinfer-decode flashinfer-decode-tc flashinfer-xqa
       torch-sdpa-dense)
for dt in ${DTYPES:-float16 bfloat16}; do
  python3 -m cupaged.bench compare ${rows[@]/#/--row } --dtype "$dt" --reps "${REPS:-20}" \
    ${impls[@]/#/--impl } --csv "$OUT/decode-rows-$dt.csv" \
    2>>"$OUT/decode-rows-stderr.txt" | grep -v "^#" | tee -a "$OUT/decode-rows-$dt.txt"
done
