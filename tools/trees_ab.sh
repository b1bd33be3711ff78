#!/usr/bin/env bash
# Several library trees timed in turn on the same decode and prefill rows (the library
# before a change: .regress/old, made with `git archive BASE cupaged cuda_src | tar -x -C
# .regress/old`, and carried), after the GPU tests a change touches.
#   [TESTS="tests/test_variants.py ..."] [BENCH=1] [ROUNDS=2] [TREES=".regress/old ."] \
#     bash tools/trees_ab.sh
# (TREES: the library trees to time, each a checkout's cupaged and cuda_src, in turn;
# PREFILL: the prefill rows' variant flags, |-separated, "" for plain; PRESETS: the
# prefill presets, default "prompt-4096 8x2048"; DECODE=0 skips the decode row.)
source "$(dirname "$0")/device_env.sh"
# cupaged-bench's module in a tree (older trees have it as cupaged.cli).
cli() { [ -f cupaged/bench/__main__.py ] && echo cupaged.bench || echo cupaged.cli; }
# (TESTS="" runs none.)
if [ -n "${TESTS-tests/test_variants.py}" ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS-tests/test_variants.py} 2>&1 \
    | tee "$OUT/tree-tests.txt" | grep -E "^(FAILED|ERROR)|passed|failed" | head -40
fi
[ "${BENCH:-0}" = 1 ] || exit 0
# ROUNDS alternations of the trees (run-to-run noise is about +-2%).
for round in $(seq "${ROUNDS:-1}"); do
  for tree in ${TREES:-.regress/old .}; do
    echo "== round $round: $tree"
    [ "${DECODE:-1}" = 1 ] && (cd "$tree" && PYTHONPATH=$PWD CUPAGED_CACHE_DIR=$PWD/.kc python3 -m "$(cli)" compare \
       --heads 32 --kv-heads 8 --batch 64 --context 2048 --impl cupaged --impl cupaged-hnd \
       2>&1 | tail -3)
    # Soft-cap 50 keeps most logits within the cap; 1 saturates most of them.
    # (PREFILL="" set: the plain row alone.)
    pv=${PREFILL-|--soft-cap 50|--soft-cap 1}
    if [ -z "$pv" ]; then prefill_variants=(""); else IFS='|' read -ra prefill_variants <<< "$pv"; fi
    for v in "${prefill_variants[@]}"; do
      echo "-- prefill $v"
      (cd "$tree" && PYTHONPATH=$PWD CUPAGED_CACHE_DIR=$PWD/.kc python3 -m "$(cli)" prefill \
         $(printf -- '--preset %s ' ${PRESETS:-prompt-4096 8x2048}) --impl cupaged --dtype bfloat16 $v \
         2>&1 | grep -E "^(shape|[a-z0-9x-]+ +cupaged)")
    done
  done
done
