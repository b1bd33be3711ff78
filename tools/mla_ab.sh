#!/usr/bin/env bash
# mla_attention's bench rows (or sparse_mla_attention's: BENCH=sparse-mla) in this tree and
# in earlier versions of the code, in one run on one card: an A/B. BASE: copies of an
# earlier cupaged/ and cuda_src/ (carried), e.g.
#   rm -rf .ab/base && mkdir -p .ab/base && git archive <rev> cupaged cuda_src | tar -x -C .ab/base
# PRESETS: the bench's presets; IMPL: the implementation both trees run (default cupaged);
# IMPLS: also in this tree (flashinfer-fa3 where .flashinfer is carried).
# ARGS: more arguments for both trees (e.g. --kv-cache-dtype fp8_e4m3).
#   BASE=".ab/base" [BENCH=mla|sparse-mla] [PRESETS="dsv3-128h-4k dsv3-128h-4k-q2"] [IMPL=cupaged-sm90] [IMPLS=flashinfer-fa3] [ARGS=...] bash tools/mla_ab.sh
source "$(dirname "$0")/device_env.sh"
# PYTHONPATH holds FlashInfer's site where it was set up: kept, with each tree put first
paths=$PYTHONPATH
bench=${BENCH:-mla}
default_presets="dsv3-128h-4k dsv3-128h-4k-q2"
[ "$bench" = sparse-mla ] && default_presets="dsa-64h dsa-128h-q2 dsa-prefill-128h"
presets=()
for p in ${PRESETS:-$default_presets}; do presets+=(--preset "$p"); done
for round in 1 2; do  # twice, interleaved: a drifting clock shows as rounds that disagree
  for tree in . ${BASE:-}; do
    impls=(--impl "${IMPL:-cupaged}")
    if [ "$tree" = . ] && [ -f .flashinfer/setup.sh ]; then
      for i in ${IMPLS:-}; do impls+=(--impl "$i"); done
    fi
    echo "-- round $round, $( [ "$tree" = . ] && echo current || echo "$tree" )"
    (cd "$tree" && PYTHONPATH="$PWD:$paths" python3 -m cupaged.bench "$bench" "${presets[@]}" "${impls[@]}" ${ARGS:-} 2>&1 \
      | grep -vE "INFO|^copy bandwidth|^shape")
  done
done | tee -a "$OUT/mla-ab.txt"
