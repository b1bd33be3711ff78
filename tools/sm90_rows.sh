#!/usr/bin/env bash
# The Hopper kernel's benchmark rows for issue 35's targets, one device call (needs
# .flashinfer carried for FlashInfer fa3; its modules compile first, about 80 s each):
# the presets beside fa3 and cuDNN, head sizes 64/128/192/256 and groups 1/4/8 beside fa3,
# the variants against plain attention, a 512-token window over 32k against 512-token
# prompts, and an fp8 cache against bf16.   bash tools/sm90_rows.sh   (logs in $OUT)
# SECTIONS picks some of: presets sizes variants fp8 (default: all; only the first two
# run FlashInfer).
source "$(dirname "$0")/device_env.sh"
B() { python3 -m cupaged.bench prefill "$@" 2>&1 | grep -v "INFO"; }
FA3=(--impl cupaged --impl flashinfer-fa3)
want() { [[ " ${SECTIONS:-presets sizes variants fp8} " == *" $1 "* ]]; }
{
  want presets && B --preset prompt-4096 --preset prompt-16384 --preset 8x2048 --preset 4x4096-mha \
    --preset chunk-512-of-8192 --impl cupaged --impl cupaged-mma --impl flashinfer-fa3 \
    --impl torch-sdpa-cudnn
  want sizes && for hs in 64 192 256; do B --batch 8 --query-len 2048 --head-size "$hs" "${FA3[@]}"; done
  want sizes && for kvh in 32 4; do B --batch 8 --query-len 2048 --kv-heads "$kvh" "${FA3[@]}"; done
  if want variants; then
    for v in "" "--soft-cap 50" "--alibi" "--sinks" "--window 1024"; do
      B --preset prompt-4096 --preset 8x2048 --preset chunk-512-of-8192 $v --impl cupaged
    done
    # float16: soft-cap under a running maximum (bfloat16's fixed offset needs P's range)
    for v in "" "--soft-cap 50"; do
      B --batch 8 --query-len 2048 --dtype float16 $v --impl cupaged
    done
    B --batch 1 --query-len 32768 --window 512 --impl cupaged
    B --batch 64 --query-len 512 --impl cupaged
  fi
  want fp8 && B --preset prompt-4096 --preset 8x2048 --kv-cache-dtype fp8 --impl cupaged
} 2>&1 | tee "$OUT/sm90-rows.txt"
