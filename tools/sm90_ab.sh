#!/usr/bin/env bash
# The Hopper kernel's quick rows after a change, one device call (cupaged only, no peers):
# plain presets, head size 64, an fp8 cache against bf16 (head sizes 128 and 192), and
# vLLM's layout against NHD on both multi-token kernels, soft-cap. SECTIONS picks some of:
# plain hs64 fp8 vllm cap (default: all). With BASE=<dir> (a copy of an earlier cupaged/ and
# cuda_src/, e.g. `git archive <rev> cupaged cuda_src | tar -x -C .ab/base`, carried) each
# row runs there too, in the same run on the same card: an A/B of two versions of the code
# (several: BASE=".ab/a .ab/b").   [BASE=.ab/base] bash tools/sm90_ab.sh
source "$(dirname "$0")/device_env.sh"
paths=$PYTHONPATH  # FlashInfer's site where it was set up; each tree goes first
want() { [[ " ${SECTIONS:-plain hs64 fp8 vllm cap} " == *" $1 "* ]]; }
B() {
  for tree in . ${BASE:-}; do
    echo "-- $( [ "$tree" = . ] && echo current || echo "$tree" ): $*"
    # from inside the tree: `python -m` puts the working directory first on sys.path
    (cd "$tree" && PYTHONPATH="$PWD:$paths" python3 -m cupaged.bench prefill "$@" 2>&1 \
      | grep -vE "INFO|^copy bandwidth|^shape")
  done
}
{
  want plain && B --preset prompt-4096 --preset 8x2048 --preset chunk-512-of-8192 --impl cupaged
  want hs64 && B --batch 8 --query-len 2048 --head-size 64 --impl cupaged
  if want fp8; then
    B --preset prompt-4096 --preset 8x2048 --kv-cache-dtype fp8 --impl cupaged
    for kv in auto fp8; do
      B --batch 8 --query-len 2048 --head-size 192 --kv-cache-dtype "$kv" --impl cupaged
    done
  fi
  want vllm && B --preset prompt-4096 --preset 8x2048 --kv-layout vllm --impl cupaged \
    --impl cupaged-mma
  want cap && B --preset prompt-4096 --preset 8x2048 --soft-cap 50 --impl cupaged
} 2>&1 | tee "$OUT/sm90-ab.txt"
