#!/usr/bin/env bash
# Static SASS instruction mix of paged_prefill specializations (nvcc + cuobjdump on the
# device machine, which has them): opcode counts per kernel, and the registers ptxas used.
#   CFGS="8 1 32,4 2 64" HS=128 BS=16 FMT=0 [VARIANT=2] [TREE=.regress/old] bash tools/sass_mix.sh
# (TREE: the cuda_src of another checkout, e.g. the library before a change; VARIANT: the
# variant bits of cuda_src/variants.cuh, 2 = soft-cap.)
source "$(dirname "$0")/device_env.sh"
TREE=${TREE:-.}
tag=$(basename "$(cd "$TREE" && pwd)")_v${VARIANT:-0}
IFS=, read -ra cfgs <<< "${CFGS:-8 1 32,4 2 64}"
for cfg in "${cfgs[@]}"; do
  set -- $cfg
  cubin="$OUT/prefill_${tag}_w$1_m$2_n$3.cubin"
  nvcc -arch=sm_90 -cubin -std=c++17 -Xptxas -v -DCUPAGED_INSTANTIATE \
    -DCUPAGED_T=cupaged::bfloat16_t -DCUPAGED_HS=${HS:-128} -DCUPAGED_BS=${BS:-16} \
    -DCUPAGED_FORMAT=${FMT:-0} -DCUPAGED_WARPS=$1 -DCUPAGED_MATOMS=$2 -DCUPAGED_TILE=$3 \
    -DCUPAGED_VARIANT=${VARIANT:-0} "$TREE/cuda_src/paged_prefill.cu" -o "$cubin" 2>&1 | grep -E "registers|spill" | tr -s ' ' | tr '\n' ' '
  echo
  cuobjdump -sass "$cubin" > "${cubin%.cubin}.sass"
  echo "== $tag w$1 m$2 n$3: $(grep -cE '^\s+/\*[0-9a-f]{4}\*/' "${cubin%.cubin}.sass") instructions"
  grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9_]+' "${cubin%.cubin}.sass" |
    awk '{print $NF}' | sort | uniq -c | sort -rn | head -25 | tr '\n' ' '
  echo
done
