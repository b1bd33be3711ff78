#!/usr/bin/env bash
# Device: compute-sanitizer over GPU tests that reach every kernel pipeline's edges
# (partial last tiles and pieces, window starts inside a piece, fp8 per-token scales,
# split-KV merges, bad block ids, the multi-token kernel and the cache writes), one tool
# at a time:
#   memcheck   out-of-bounds and misaligned global / shared accesses
#   racecheck  shared-memory hazards: two threads' accesses to one address, one a write,
#              with no barrier between them
#   synccheck  barriers not reached by every thread
# Only kernels whose names hold "cupaged" (the namespace of every library kernel) are
# instrumented, not CuPy's or torch's; the tests are small, so the sanitizers' slowdown
# stays within a device call.
# Positive controls run first (tools/sanitize_control.py): planted faults each tool must
# report, or the run fails. The tests run without CuPy's and torch's memory pools, so an
# overrun of an array's end leaves its allocation and memcheck sees it.
#   bash tools/sanitize.sh                      # the three tools over the default tests
#   TOOLS=racecheck TESTS="tests/test_decode.py -k stale" bash tools/sanitize.sh
source "$(dirname "$0")/device_env.sh"
TOOLS=${TOOLS:-memcheck racecheck synccheck}
TESTS=${TESTS:-"tests/test_decode.py tests/test_variants.py tests/test_fp8.py tests/test_varlen.py tests/test_cache_ops.py -k 'stale_slots or slots_before_the_window or window_edges or variants_over_fp8 or bad_block or split_kv_merged or written_cache_reads_back or copy_blocks_all'"}
LIMIT=${LIMIT:-170}  # seconds per tool
# Warm the kernel cache first: compiling is host work the sanitizers only slow down.
eval "python3 -m pytest -m gpu -q -p no:cacheprovider -x $TESTS" >"$OUT/sanitize-warm.txt" 2>&1
tail -1 "$OUT/sanitize-warm.txt"
status=0
# oob-far lies outside any allocation; oob-near one element past an array's end, which
# memcheck sees only where the array is its own allocation (hence no pools).
export CUPAGED_TEST_NO_POOL=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1
for control in "memcheck oob-far" "memcheck oob-near" "racecheck race"; do
  read -r tool fault <<< "$control"
  case " $TOOLS " in *" $tool "*) ;; *) continue ;; esac
  log="$OUT/sanitize-control-$fault.txt"
  compute-sanitizer --tool "$tool" --kernel-name kns=cupaged python3 tools/sanitize_control.py \
    "$fault" >"$log" 2>&1
  line=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
  case "$line" in
    *" 0 errors"*|*"(0 errors"*|"") echo "control $fault: NOT REPORTED ($line): the runs below would miss faults"; status=1 ;;
    *) echo "control $fault: reported ($line)" ;;
  esac
done
# racecheck over a race-free hand-off through bar.arrive / bar.sync (sanitize_control.py
# arrive): on the device's compute-sanitizer (CUDA 13) it reports hazards there, so its
# reports on kernels that hand data over by bar.arrive (mla_attention_sm90's 16-bit
# producer) are not evidence of a race; synccheck and the tests' exact checks are.
case " $TOOLS " in *" racecheck "*)
  log="$OUT/sanitize-control-arrive.txt"
  compute-sanitizer --tool racecheck --kernel-name kns=cupaged python3 tools/sanitize_control.py \
    arrive >"$log" 2>&1
  echo "racecheck over a race-free bar.arrive hand-off: $(grep -E "RACECHECK SUMMARY" "$log" | tail -1)" ;;
esac
for tool in $TOOLS; do
  log="$OUT/sanitize-$tool.txt"
  # --kernel-name kns=<substring> limits instrumentation to matching kernels.
  eval "timeout $LIMIT compute-sanitizer --tool $tool --error-exitcode 99 \
    --kernel-name kns=cupaged --print-limit 20 \
    python3 -m pytest -m gpu -q -p no:cacheprovider $TESTS" >"$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | sort | uniq -c | tr '\n' ';')
  echo "$tool: exit $rc; $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1); ${summary:-no summary line}"
  [ $rc -eq 0 ] || status=1
done
exit $status
