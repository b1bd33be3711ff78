#!/usr/bin/env bash
# The one entry for runs on the GPU machine, by mode. Logs and reports go to $OUT (the
# device tool brings back what is there: few files, so each mode appends to one or two).
#   bash tools/device.sh MODE [ARGS...]      DRY=1: print the commands, run nothing
#
# suite [SHARD] [PYTEST ARGS]  The GPU tests (-m gpu). The whole suite takes over the
#     10 minutes a device command may run, so it runs in shards, one call each:
#       1  decode, varlen, interop and prepared-call tests
#       2  the rest, then the smoke rows (rows smoke: decode, compile, cache-ops, overhead)
#       3  the serving loop and the framework integrations (engine, model, e2e, torch.ops,
#          transformers), their host tests too (CI lacks torch), and FlashInfer's CLI row
#          where .flashinfer is carried
#       4  MLA (both kernel families on a Hopper GPU)
#       5  the Hopper prefill kernel and wgmma probes, the variants, the README's examples
#       6  fp8, the KV cache and merge
#       kernels  shards 1, 2, 4, 5 and 6's tests in one call, without the rows: with
#          WORKERS=N, which spreads them over N pytest-xdist processes (a cold run is
#          mostly NVRTC, one CPU core per compile; the kernel cache is shared on disk)
#       kernels-a, kernels-b, kernels-c  the kernels shard in three calls (its files
#          test_a* to test_l*, test_m* to test_u*, then the rest: test_validation,
#          test_variants, test_varlen*): on an H200 machine with 15 workers kernels-a takes
#          about 280 s from a cold kernel cache, kernels-b and kernels-c about 300 and 170
#       head512  the tests that reach head sizes above 256
#       all (or no SHARD)  everything, then the smoke rows
#     On a cold kernel cache shard 2's tests alone take about 7 minutes. LIMIT=SECONDS ends
#     the tests there (timeout); either way the log ends with the tests that had started
#     but not finished and the 12 slowest (test-times).
# test-times FILE...  That summary, from the per-test start and finish logs the suite has
#     pytest write (CUPAGED_TEST_TIMES=PREFIX in tests/conftest.py: PREFIX.<worker>).
# sanitize [TARGET...]  compute-sanitizer's memcheck, racecheck and synccheck (TOOLS= some),
#     instrumenting the library's kernels only. TARGET tests (the default): positive
#     controls first (tools/sanitize_control.py: a planted out-of-bounds write near and far
#     and a race, which each tool must report, or the run fails), racecheck over a
#     race-free bar.arrive / bar.sync hand-off (what it reports there is not evidence of a
#     race), then each tool over GPU tests that reach the kernels' edges (TESTS= other
#     pytest arguments; LIMIT= seconds per tool, default 170), without memory pools so an
#     overrun of an array's end leaves its allocation. TARGET mla: one mla_attention launch
#     per case of CASES (split:kv_cache_dtype:family, default 0:auto:mma 2:auto:mma
#     2:fp8_e4m3:mma 0:auto:sm90 2:auto:sm90 0:fp8_e4m3:sm90 2:fp8_e4m3:sm90). TARGET sm90:
#     one paged_prefill_sm90 launch per case of CASES (layout:kv_cache_dtype[:head size],
#     default NHD:auto NHD:auto:512; kv_cache_dtype with "-q", such as HND:fp8_e4m3-q: an
#     8-bit query too).
# mutants [NAME...]  Each mutant of tools/mutants.py (a check or fix taken out of a copy of
#     the source; default all) must fail its tests, which must pass on the source.
# regress TEST_ID...  Each test (a pytest node id, or pytest arguments split on spaces such
#     as "tests/test_decode.py -k stale", one run per TEST_ID) against the library as it
#     was before a fix (OLD=.regress/old: a copy of an earlier cupaged/ and cuda_src/, made
#     by `git archive BASE cupaged cuda_src | tar -x -C .regress/old`, carried) with the
#     current tests and cupaged/testing.py: a regression test must fail there.
# rows NAME[:SECTION,...]... [-- BENCH ARGS]  Named sets of cupaged-bench rows (`rows list`
#     names them and their sections; the default sections where none are given); BENCH
#     ARGS are added to every command of the sets. FlashInfer's rows join where
#     .flashinfer is carried.
# ab NAME[:SECTION,...]... [-- BENCH ARGS] | ab -- BENCH COMMAND  The same row sets (or one
#     cupaged-bench command) in several library trees in turn, one process per command,
#     ROUNDS=2 interleaved rounds (a drifting clock shows as rounds that disagree).
#     TREES=".ab/base ." (the default): copies of earlier cupaged/ and cuda_src/ (`git
#     archive REV cupaged cuda_src | tar -x -C .ab/base`, carried), "." this tree. For a
#     few percent, prefer one process: cupaged-bench ab decode / ab host / ab tuning.
#     LIMIT=SECONDS ends each command there (timeout): a tree whose kernel hangs costs
#     that much of the call, and its rounds show as failed.
# profile [--set counters|opcodes|full|source] [--kernel REGEX] [--launch-count N] [--tag T]
#         BENCH COMMAND
#     Nsight Compute over a cupaged-bench command: with CUPAGED_BENCH_NVTX=1 every timed
#     row runs one call (after its warm-up) in the NVTX range "timed", and only that call's
#     kernels are profiled (--kernel narrows them to names matching REGEX). counters (the
#     default): duration, DRAM and L2, tensor pipes, issue slots, occupancy and its limits,
#     stall reasons; opcodes: pipe use and executed instructions per opcode; full: ncu's
#     full section set; source: the warp samples per SASS instruction (first profiled
#     kernel), as CSV, summarized by tools/kernel_report.py source. Reports:
#     $OUT/ncu-T.txt (and ncu-src-T.csv); --reps 3 keeps the command short.
# report ARGS  tools/kernel_report.py (resources, SASS mix, the kernel cache's cubins, ncu
#     source CSVs; the device machine has cuobjdump).
# e2e NAME [E2E ARGS]  The end-to-end runs of docs/PERFORMANCE.md, one device call each:
#     quick, main, main-fi, main-concat, compiled (HF=1 adds transformers' generate),
#     prefix, fp8. JSON and console per run in $OUT/e2e-NAME*.
# tp [ARGS]  tools/tp_generate.py under torchrun on NPROC=2 GPUs (transformers' tensor
#     parallelism through cupaged's attention against one GPU's tokens).
# bench ARGS  cupaged-bench in this environment, e.g. `bench ab host --tree .regress/old`
#     (CORE=N pins it to core N, as host timings want).
# cache-pack  The machine's kernel cache, xz-compressed, as $OUT/kc.part.* (15 MB pieces):
#     copy them into .kcache/ and carry it, and device_env.sh unpacks them on the next
#     machine (run it last in a call, after the suite compiled what the tests use). After a
#     change to the sources, `tools/kernel_report.py refill FOLDER` rebuilds the unpacked
#     cache's specializations from the new sources on the CPU machine (NVRTC for sm_90
#     there as here), to pack and carry again.
source "$(dirname "$0")/device_env.sh"

DRY=${DRY:-}
# quote ARGS...: the arguments as one shell line (quoted where they need it)
quote() {
  local out="" a
  for a in "$@"; do
    if [[ $a =~ ^[][A-Za-z0-9_./:=@,+%-]+$ ]]; then out+=" $a"; else out+=" $(printf '%q' "$a")"; fi
  done
  echo "${out# }"
}
# run CMD...: run it (with DRY=1: print it)
run() { if [ -n "$DRY" ]; then echo "+ $(quote "$@")"; return 0; fi; "$@"; }
# logged FILE CMD...: run CMD, its output to the console and appended to FILE; CMD's status
logged() {
  local f=$1; shift
  if [ -n "$DRY" ]; then
    if [ "$1" = in_tree ]; then "$@"; else echo "+ $(quote "$@") >> $f"; fi
    return 0
  fi
  "$@" 2>&1 | tee -a "$f"
  return "${PIPESTATUS[0]}"
}
# quiet FILE CMD...: run CMD, its output appended to FILE only; CMD's status
quiet() {
  local f=$1; shift
  if [ -n "$DRY" ]; then echo "+ $(quote "$@") >> $f"; return 0; fi
  { echo "==== $(quote "$@")"; "$@"; } >>"$f" 2>&1
}
BENCH=(python3 -m cupaged.bench)
status=0
fail() { status=1; }

# ---- suite ------------------------------------------------------------------------------

SHARD1="tests/test_decode.py tests/test_varlen.py tests/test_interop.py tests/test_prepared.py"
# FlashInfer's CLI rows compile FlashInfer's modules (minutes): with the serving loop's.
SERVING="tests/test_engine.py tests/test_llama.py tests/test_bench_e2e.py tests/test_torch_ops.py
  tests/test_transformers.py"
SHARD4="tests/test_mla.py"
SHARD5="tests/test_prefill_sm90.py tests/test_sm90.py tests/test_variants.py tests/test_readme.py"
SHARD6="tests/test_fp8.py tests/test_kv_cache.py tests/test_merge.py"
FI_CLI=tests/test_cli.py::test_compare_flashinfer_rows_check_and_plan
HEAD512_K="hs272 or hs288 or hs304 or hs320 or hs336 or hs352 or hs368 or hs384 or hs400
  or hs416 or hs432 or hs448 or hs464 or hs480 or hs496 or hs512 or 512 or 384 or large_float32"

suite() {
  local shard=all
  case "${1:-}" in
    1|2|3|4|5|6|kernels|kernels-a|kernels-b|kernels-c|head512|all) shard=$1; shift ;;
  esac
  local sel=() f
  case $shard in
    1) sel=($SHARD1) ;;
    2) for f in $SHARD1 $SERVING $SHARD4 $SHARD5 $SHARD6; do sel+=("--ignore=$f"); done
       sel+=("--deselect=$FI_CLI") ;;
    3) sel=($SERVING $FI_CLI) ;;
    4) sel=($SHARD4) ;;
    5) sel=($SHARD5) ;;
    6) sel=($SHARD6) ;;
    kernels) for f in $SERVING; do sel+=("--ignore=$f"); done; sel+=("--deselect=$FI_CLI") ;;
    kernels-a|kernels-b|kernels-c)  # the kernels shard's files by name
      local pat='tests/test_[a-l]*.py'
      [ "$shard" = kernels-b ] && pat='tests/test_[m-u]*.py'
      [ "$shard" = kernels-c ] && pat='tests/test_[v-z]*.py'
      local serving=" $(echo $SERVING) "  # (one space between its names)
      for f in $pat; do [[ $serving == *" $f "* ]] || sel+=("$f"); done
      sel+=("--deselect=$FI_CLI") ;;
    head512) sel=(tests/test_varlen.py tests/test_fp8.py tests/test_decode.py -k
                  "$(echo $HEAD512_K)") ;;
  esac
  local marker=(-m gpu)
  [ "$shard" = 3 ] && marker=()  # its files' host tests need torch and transformers
  [ "${WORKERS:-1}" -gt 1 ] && sel=(-n "$WORKERS" "${sel[@]}")
  run rm -f "$OUT/info.txt"
  logged "$OUT/info.txt" "${BENCH[@]}" info
  # LIMIT=SECONDS ends the tests there; either way the log ends with the slowest tests
  # and any unfinished (each test's start and finish, CUPAGED_TEST_TIMES in conftest.py).
  local limit=()
  [ -n "${LIMIT:-}" ] && limit=(timeout -k 5 "$LIMIT")
  if [ -n "$DRY" ]; then
    echo "+ $(quote "${limit[@]}" python3 -m pytest "${marker[@]}" -q -p no:cacheprovider "${sel[@]}" "$@") > $OUT/gpu-tests-$shard.txt"
  else
    rm -f "$LOGS"/times.*
    CUPAGED_TEST_TIMES="$LOGS/times" "${limit[@]}" python3 -m pytest "${marker[@]}" -q \
      -p no:cacheprovider "${sel[@]}" "$@" 2>&1 | tee "$OUT/gpu-tests-$shard.txt" | tail -25
    status=${PIPESTATUS[0]}
    test_times "$LOGS"/times.* | tee -a "$OUT/gpu-tests-$shard.txt"
  fi
  if [ "$shard" = 2 ] || [ "$shard" = all ]; then
    local tests_status=$status
    rows_mode smoke
    status=$tests_status  # the suite's status is its tests'
  fi
  echo "gpu suite ($shard) exit status: $status"
}

# test_times FILE...: from CUPAGED_TEST_TIMES' logs, the tests started and not finished
# (a run its limit ended) and the 12 that took longest.
test_times() {
  [ $# -gt 0 ] && [ -e "$1" ] || return 0
  cat "$@" | python3 -c '
import sys
start, took = {}, {}
for line in sys.stdin:
    kind, t, node = line.rstrip("\n").split(" ", 2)
    if kind == "S":
        start[node] = float(t)
    elif node in start:
        took[node] = float(t) - start[node]
t0 = min(start.values(), default=0.0)
print(f"tests started {len(start)}, finished {len(took)}")
for node in sorted(set(start) - set(took), key=start.get):
    print(f"unfinished (started at {start[node] - t0:.0f} s): {node}")
for node, s in sorted(took.items(), key=lambda kv: -kv[1])[:12]:
    print(f"{s:8.1f} s  {node}")
'
}

# ---- sanitize ---------------------------------------------------------------------------

SAN_TESTS="tests/test_decode.py tests/test_variants.py tests/test_fp8.py tests/test_varlen.py tests/test_cache_ops.py -k 'stale_slots or slots_before_the_window or window_edges or variants_over_fp8 or bad_block or split_kv_merged or written_cache_reads_back or copy_blocks_all or undercount'"
LOGS=/tmp/cupaged-logs
mkdir -p "$LOGS"

# sanitized LOG TOOL KERNEL-SUBSTRING CMD...: one compute-sanitizer run (at most 180 s),
# instrumenting the kernels whose names hold the substring, its full output appended to
# LOG; SUMMARY: its exit status, test or error line and summary lines; returns the status
sanitized() {
  local log=$1 tool=$2 kns=$3; shift 3
  local tmp="$LOGS/san.txt" rc
  local cmd=(timeout 180 compute-sanitizer --tool "$tool" --kernel-name "kns=$kns"
             --error-exitcode 99 "$@")
  if [ -n "$DRY" ]; then echo "+ $(quote "${cmd[@]}") >> $log"; return 0; fi
  "${cmd[@]}" >"$tmp" 2>&1
  rc=$?
  { echo "==== $tool $kns: $(quote "$@") (exit $rc)"; cat "$tmp"; } >>"$log"
  SUMMARY=$(summary "$tmp" $rc)
  return $rc
}

# summary LOG RC: "exit RC; <the tests' or the check's last line>; <each distinct summary
# line of the sanitizer with its count>"
summary() {
  local line sums
  line=$(grep -E '[0-9]+ (passed|failed)|max abs error' "$1" | tail -1 | tr -s ' ')
  sums=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$1" | sed 's/^=* *//' | sort | uniq -c |
         sed 's/^ *//' | paste -sd';' -)
  echo "exit $2${line:+; $line}; ${sums:-no summary line}"
}

sanitize_tests() {
  local tools=${TOOLS:-memcheck racecheck synccheck} tests=${TESTS:-$SAN_TESTS}
  local log="$OUT/sanitize-tests.txt" tool fault line
  # Warm the kernel cache first: compiling is host work the sanitizers only slow down.
  if [ -n "$DRY" ]; then echo "+ python3 -m pytest -m gpu -q -p no:cacheprovider -x $tests"
  else
    eval "python3 -m pytest -m gpu -q -p no:cacheprovider -x $tests" >"$LOGS/warm.txt" 2>&1
    echo "warm-up: $(tail -1 "$LOGS/warm.txt")"
  fi
  # oob-far lies outside any allocation; oob-near one element past an array's end, which
  # memcheck sees only where the array is its own allocation (hence no pools).
  export CUPAGED_TEST_NO_POOL=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1
  for line in "memcheck oob-far" "memcheck oob-near" "racecheck race"; do
    read -r tool fault <<<"$line"
    case " $tools " in *" $tool "*) ;; *) continue ;; esac
    sanitized "$log" "$tool" cupaged python3 tools/sanitize_control.py "$fault"
    [ -n "$DRY" ] && continue
    case "$SUMMARY" in
      *" 0 errors"*|*"(0 errors"*|*"no summary line") echo "control $fault: NOT REPORTED ($SUMMARY): the runs below would miss faults"; fail ;;
      *) echo "control $fault: reported ($SUMMARY)" ;;
    esac
  done
  # racecheck over a race-free hand-off through bar.arrive / bar.sync: on the device's
  # compute-sanitizer (CUDA 13) it reports hazards there, so its reports on kernels that
  # hand data over by bar.arrive (mla_attention_sm90's 16-bit producer) are not evidence
  # of a race; synccheck and the tests' exact checks are.
  case " $tools " in *" racecheck "*)
    sanitized "$log" racecheck cupaged python3 tools/sanitize_control.py arrive
    if [ -z "$DRY" ]; then echo "racecheck over a race-free bar.arrive hand-off: $SUMMARY"; fi ;;
  esac
  for tool in $tools; do
    if [ -n "$DRY" ]; then
      echo "+ timeout ${LIMIT:-170} compute-sanitizer --tool $tool --error-exitcode 99 --kernel-name kns=cupaged --print-limit 20 python3 -m pytest -m gpu -q -p no:cacheprovider $tests >> $log"
      continue
    fi
    # --kernel-name kns=<substring> limits instrumentation to matching kernels.
    eval "timeout ${LIMIT:-170} compute-sanitizer --tool $tool --error-exitcode 99 \
      --kernel-name kns=cupaged --print-limit 20 \
      python3 -m pytest -m gpu -q -p no:cacheprovider $tests" >"$LOGS/san.txt" 2>&1
    local rc=$?
    { echo "==== $tool over the tests (exit $rc)"; cat "$LOGS/san.txt"; } >>"$log"
    echo "$tool: $(summary "$LOGS/san.txt" $rc)"
    [ $rc -eq 0 ] || fail
  done
}

# sanitize_launches TARGET KERNEL-SUBSTRING DEFAULT-CASES: one sanitized launch per case
sanitize_launches() {
  local target=$1 kns=$2 case tool
  for case in ${CASES:-$3}; do
    for tool in ${TOOLS:-memcheck racecheck synccheck}; do
      sanitized "$OUT/sanitize-$target.txt" "$tool" "$kns" \
        python3 tools/sanitize_control.py "$target" ${case//:/ } || fail
      if [ -z "$DRY" ]; then echo "$target $case $tool: $SUMMARY"; fi
    done
  done
}

sanitize() {
  local t
  for t in "${@:-tests}"; do
    case $t in
      tests) sanitize_tests ;;
      mla) sanitize_launches mla mla_attention \
             "0:auto:mma 2:auto:mma 2:fp8_e4m3:mma 0:auto:sm90 2:auto:sm90 0:fp8_e4m3:sm90 2:fp8_e4m3:sm90" ;;
      sm90) sanitize_launches sm90 paged_prefill_sm90 "NHD:auto NHD:auto:512" ;;
      *) echo "sanitize: unknown target $t (tests, mla, sm90)" >&2; return 2 ;;
    esac
  done
}

# ---- mutants and old trees --------------------------------------------------------------

# outcome LABEL TREE PYTEST-ARGS...: one line, "passes" or "FAILS", the run's log appended
# to $OUT/mutants.txt. Each run in its own process: a misaligned access poisons the CUDA
# context.
outcome() {
  local label=$1 tree=$2; shift 2
  if [ -n "$DRY" ]; then echo "+ (cd $tree) $(quote python3 -m pytest -q -p no:cacheprovider -x "$@")"; return; fi
  (cd "$tree" && PYTHONPATH="$tree" timeout 300 python3 -m pytest -q -p no:cacheprovider -x "$@") \
    >"$LOGS/run.txt" 2>&1
  local rc=$?
  { echo "==== $label (exit $rc)"; cat "$LOGS/run.txt"; } >>"$OUT/mutants.txt"
  printf '%-70s %s (%s)\n' "$label" "$([ $rc = 0 ] && echo passes || echo FAILS)" \
    "$(grep -E "passed|failed|error" "$LOGS/run.txt" | tail -n 1)"
}

mutants() {
  local name mut args
  echo "== mutants (must fail) and the real source (must pass)"
  for name in ${@:-$(python3 tools/mutants.py list)}; do
    mut=/tmp/cupaged-mutant-$name
    run rm -rf "$mut"
    run mkdir -p "$mut"
    run cp -r tests cupaged cuda_src tools pyproject.toml "$mut"/
    run python3 tools/mutants.py apply "$name" "$mut" || { fail; continue; }
    mapfile -t args < <(python3 tools/mutants.py tests "$name")
    outcome "mutant $name" "$mut" "${args[@]}"
    outcome "real $name" "$PWD" "${args[@]}"
  done
}

regress() {
  local old=${OLD:-.regress/old} tree=/tmp/cupaged-old t
  [ $# -gt 0 ] || { echo "regress: name the tests (pytest node ids or -k expressions)" >&2; return 2; }
  [ -n "$DRY" ] || [ -d "$old/cupaged" ] || { echo "regress: no $old/cupaged (carry it)" >&2; return 2; }
  run rm -rf "$tree"
  run mkdir -p "$tree"
  run cp -r tests pyproject.toml "$tree"/
  run cp -r "$old/cupaged" "$old/cuda_src" "$tree"/
  run cp cupaged/testing.py "$tree/cupaged/testing.py"  # the current test helpers
  echo "== before the fixes (library from $old, current tests)"
  # shellcheck disable=SC2086  # each TEST_ID split on spaces: "tests/test_x.py -k name"
  for t in "$@"; do outcome "old: $t" "$tree" $t; done
}

# ---- row sets ---------------------------------------------------------------------------

# Each set: a function rowset_NAME calling B (bench in the current mode) once per command,
# sections chosen by want; ROWSETS: name -> its sections (those marked + run only when
# named after ':'), and a line of help.
declare -A ROWSETS=(
  [smoke]="-|the device suite's rows: decode 32/8 batch 64 x 2048, compile, cache-ops, overhead"
  [decode]="f16 bf16|the eight decode rows through compare: cupaged on vLLM, NHD, HND beside FlashInfer's decode, tensor-core decode, XQA and dense SDPA"
  [fp8-decode]="fp8_e4m3 auto|decode over an fp8 e4m3 cache and over the query's type: cupaged (vLLM, HND) and FlashInfer's decode wrappers"
  [sweep]="llama-3-8b llama-3-70b-tp8|compare over batch 1..256 x context 512..32768 beside FlashInfer and SDPA, --summary (JSON and CSV in \$OUT)"
  [variants]="window decode prefill cascade|each attention variant against plain attention: a window against a plain context of its size, soft-cap / sinks / ALiBi, decode and prefill, the cascade"
  [variants-fi]="window cap sinks|the variants beside FlashInfer's decode and XQA"
  [sm90]="presets sizes variants fp8|the Hopper kernel's rows: presets beside fa3 and cuDNN, head sizes and groups beside fa3, variants, a window, fp8"
  [sm90-quick]="plain hs64 fp8 vllm cap|the Hopper kernel's quick rows (cupaged only): presets, head size 64, fp8 against bf16, vLLM's layout, soft-cap"
  [prefill-families]="-|prefill's presets on both multi-token kernel families (cupaged, cupaged-mma)"
  [trees]="decode plain cap +alibi|one decode row and prefill's two presets, plain, soft-capped (50, 1), with ALiBi"
  [mla]="bf16 fp8|mla_attention's presets beside FlashInfer's MLA wrapper, and over an fp8 cache on both kernel families"
  [head512]="decode prefill +peers|head sizes 128, 256, 512: decode bytes against the copy, prefill TFLOP/s on both multi-token families (and 384; peers: FlashInfer at 512, carry .flashinfer)"
  [prefill-tiles]="mma sm90|prefill's presets under each multi-token tile (paged_prefill's nine, paged_prefill_sm90's five)"
  [few-rows]="shapes tiles +split|few query rows per (sequence, KV head), fp16 over 2048 keys (verify's 4 x 4 = 16, 2 x 4, 8 x 4; 4 x 4 over 32768) beside FlashInfer fa2, verify under the few-rows tiles, and (split) under split-KV partitions"
  [mla-tiles]="-|mla_attention under every tile its shared memory holds (16 and 128 heads)"
  [dsa]="-|sparse_mla_attention's presets over bf16 and fp8_ds_mla rows, beside FlashMLA's Hopper kernels where .flashmla is carried (its build kit: built once a machine)"
  [decode-tiles]="-|ab tuning: the decode rows under several decode tiles (vLLM layout)"
  [split]="-|ab tuning: partition auto against never and always over batch 1..256 x context 128..131072 (vLLM layout)"
  [fp8]="accuracy prefill|fp8's error against a float16 cache, and prefill over fp8 against bf16 (HND)"
)
SECTIONS=""
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
# fi_impls IMPL...: --impl flags for FlashInfer's implementations, where it set up
fi_impls() { [ -n "${FLASHINFER:-}" ] && printf -- '--impl\n%s\n' "$@"; }
DECODE_ROWS=(--row 32/8/64/2048 --row 32/32/64/2048 --row 32/8/8/32768 --row 32/8/1/1024
             --row 32/8/128/uniform:128:4096 --row 32/8/256/512 --row 8/1/64/4096
             --row 32/8/1/131072)

rowset_smoke() {
  B decode --batch 64 --context 2048 --heads 32 --kv-heads 8 --head-size 128 --block-size 16 \
    --dtype float16
  B compile --head-size 128 --block-size 16
  B cache-ops
  B overhead
}
rowset_decode() {
  local dt fi
  mapfile -t fi < <(fi_impls flashinfer-decode flashinfer-decode-tc flashinfer-xqa)
  for dt in float16 bfloat16; do
    want "$([ $dt = float16 ] && echo f16 || echo bf16)" || continue
    B compare "${DECODE_ROWS[@]}" --dtype "$dt" --reps 20 --impl cupaged --impl cupaged-nhd \
      --impl cupaged-hnd "${fi[@]}" --impl torch-sdpa-dense --csv "$OUT/rows-decode-$dt.csv"
  done
}
rowset_fp8_decode() {
  local kv fi
  mapfile -t fi < <(fi_impls flashinfer-decode flashinfer-decode-tc)
  for kv in fp8_e4m3 auto; do
    want $kv && B compare --row 32/8/64/2048 --row 32/32/64/2048 --row 32/8/8/32768 \
      --kv-cache-dtype "$kv" --impl cupaged --impl cupaged-hnd "${fi[@]}"
  done
}
rowset_sweep() {
  local p fi plot=()
  mapfile -t fi < <(fi_impls flashinfer-decode flashinfer-decode-tc flashinfer-xqa)
  for p in llama-3-8b llama-3-70b-tp8; do
    want $p || continue
    python3 -c "import matplotlib" 2>/dev/null && plot=(--plot "$OUT/sweep-$p.png")
    B compare --preset "$p" --impl cupaged "${fi[@]}" --impl torch-sdpa-dense \
      --batch 1,8,64,256 --context 512,2048,8192,32768 --reps 20 --summary \
      --json "$OUT/sweep-$p.json" --csv "$OUT/sweep-$p.csv" "${plot[@]}"
  done
}
rowset_variants() {
  local kv v
  if want window; then
    B decode --batch 8 --context 32768 --heads 32 --kv-heads 8 --window 512
    B decode --batch 8 --context 512 --heads 32 --kv-heads 8
  fi
  if want decode; then
    for kv in 8 32; do
      for v in "" "--soft-cap 50" "--sinks" "--alibi"; do
        B decode --batch 64 --context 2048 --heads 32 --kv-heads $kv $v
      done
    done
  fi
  if want prefill; then
    for v in "" "--soft-cap 50" "--soft-cap 1" "--sinks" "--window 4096"; do
      B prefill --preset prompt-4096 --preset 8x2048 --impl cupaged $v
    done
  fi
  want cascade && B cascade
}
rowset_variants_fi() {
  local kv
  want window && B compare --batch 8 --context 32768 --heads 32 --kv-heads 8 --window 512 \
    --impl cupaged --impl cupaged-hnd --impl flashinfer-decode --impl flashinfer-decode-tc \
    --impl flashinfer-xqa
  want cap && B compare --batch 64 --context 2048 --heads 32 --kv-heads 8 --soft-cap 50 \
    --impl cupaged --impl cupaged-hnd --impl flashinfer-decode --impl flashinfer-decode-tc
  # Sinks: FlashInfer's XQA takes them (its decode wrappers are not given them here).
  if want sinks; then
    for kv in 8 32; do
      B compare --batch 64 --context 2048 --heads 32 --kv-heads $kv --sinks \
        --impl cupaged --impl cupaged-hnd --impl flashinfer-xqa
    done
  fi
}
rowset_sm90() {
  local fa3 hs kvh v
  mapfile -t fa3 < <(fi_impls flashinfer-fa3)
  want presets && B prefill --preset prompt-4096 --preset prompt-16384 --preset 8x2048 \
    --preset 4x4096-mha --preset chunk-512-of-8192 --impl cupaged --impl cupaged-mma "${fa3[@]}" \
    --impl torch-sdpa-cudnn
  if want sizes; then
    for hs in 64 192 256; do B prefill --batch 8 --query-len 2048 --head-size $hs --impl cupaged "${fa3[@]}"; done
    for kvh in 32 4; do B prefill --batch 8 --query-len 2048 --kv-heads $kvh --impl cupaged "${fa3[@]}"; done
  fi
  if want variants; then
    for v in "" "--soft-cap 50" "--alibi" "--sinks" "--window 1024"; do
      B prefill --preset prompt-4096 --preset 8x2048 --preset chunk-512-of-8192 $v --impl cupaged
    done
    # float16: soft-cap under a running maximum (bfloat16's fixed offset needs P's range)
    for v in "" "--soft-cap 50"; do
      B prefill --batch 8 --query-len 2048 --dtype float16 $v --impl cupaged
    done
    B prefill --batch 1 --query-len 32768 --window 512 --impl cupaged
    B prefill --batch 64 --query-len 512 --impl cupaged
  fi
  want fp8 && B prefill --preset prompt-4096 --preset 8x2048 --kv-cache-dtype fp8 --impl cupaged
}
rowset_sm90_quick() {
  local kv
  want plain && B prefill --preset prompt-4096 --preset 8x2048 --preset chunk-512-of-8192 \
    --impl cupaged
  want hs64 && B prefill --batch 8 --query-len 2048 --head-size 64 --impl cupaged
  if want fp8; then
    B prefill --preset prompt-4096 --preset 8x2048 --kv-cache-dtype fp8 --impl cupaged
    for kv in auto fp8; do
      B prefill --batch 8 --query-len 2048 --head-size 192 --kv-cache-dtype $kv --impl cupaged
    done
  fi
  want vllm && B prefill --preset prompt-4096 --preset 8x2048 --kv-layout vllm --impl cupaged \
    --impl cupaged-mma
  want cap && B prefill --preset prompt-4096 --preset 8x2048 --soft-cap 50 --impl cupaged
}
rowset_prefill_families() { B prefill --impl cupaged --impl cupaged-mma; }
rowset_trees() {
  local v
  want decode && B compare --heads 32 --kv-heads 8 --batch 64 --context 2048 --impl cupaged \
    --impl cupaged-hnd
  # Soft-cap 50 keeps most logits within the cap; 1 saturates most of them.
  want plain && B prefill --preset prompt-4096 --preset 8x2048 --impl cupaged --dtype bfloat16
  if want cap; then
    for v in 50 1; do
      B prefill --preset prompt-4096 --preset 8x2048 --impl cupaged --dtype bfloat16 --soft-cap $v
    done
  fi
  want alibi && B prefill --preset prompt-4096 --preset 8x2048 --impl cupaged --dtype bfloat16 \
    --alibi
}
MLA_PRESETS=(--preset dsv3-16h-4k --preset dsv3-16h-32k --preset dsv3-128h-4k --preset dsv3-128h-4k-q2)
rowset_mla() {
  local fi
  mapfile -t fi < <(fi_impls flashinfer-fa2 flashinfer-fa3)
  want bf16 && B mla "${MLA_PRESETS[@]}" --impl cupaged "${fi[@]}"
  # fp8: the planner's choice and both families (16 heads: the mma.sync kernel's two CTAs
  # an SM against the wgmma kernel's 64-row tiles)
  want fp8 && B mla "${MLA_PRESETS[@]}" --kv-cache-dtype fp8_e4m3 --impl cupaged \
    --impl cupaged-mma --impl cupaged-sm90
}
rowset_head512() {
  local hs
  if want decode; then
    for hs in 128 256 512; do
      B decode --batch 64 --context 4096 --heads 32 --kv-heads 8 --head-size $hs \
        --block-size 16 --dtype bfloat16 --reps 20
    done
  fi
  if want prefill; then
    for hs in 128 256 384 512; do
      B prefill --batch 4 --query-len 4096 --heads 16 --kv-heads 4 --head-size $hs \
        --impl cupaged --impl cupaged-mma --reps 10
    done
  fi
  if want peers; then  # FlashInfer's large-head fa2 modules compile first (minutes)
    B compare --batch 64 --context 4096 --heads 32 --kv-heads 8 --head-size 512 \
      --block-size 16 --dtype bfloat16 --reps 20
    B prefill --batch 4 --query-len 4096 --heads 16 --kv-heads 4 --head-size 512 \
      --impl cupaged --impl flashinfer-fa2 --reps 10
  fi
}
PREFILL_PRESETS=(--preset prompt-4096 --preset 8x2048 --preset chunk-512-of-8192 --preset verify-64x4x2048)
rowset_prefill_tiles() {
  want mma && B prefill "${PREFILL_PRESETS[@]}" --impl cupaged --reps 10 --tile 8,1,32,2 \
    --tile 4,2,64,2 --tile 8,1,64,2 --tile 4,1,64,2 --tile 4,2,32,2 --tile 4,1,32,2 \
    --tile 8,1,32,3 --tile 4,1,64,3 --tile 2,1,128,2
  want sm90 && B prefill "${PREFILL_PRESETS[@]}" --impl cupaged --reps 10 --tile 128,3 \
    --tile 128,2 --tile 64,3 --tile 64,2 --tile 64,4
}
rowset_few_rows() {
  local fi shape
  mapfile -t fi < <(fi_impls flashinfer-fa2)
  if want shapes; then
    for shape in "--preset verify-64x4x2048" "--batch 64 --query-len 2 --context 2048" \
                 "--batch 64 --query-len 8 --context 2048" \
                 "--batch 8 --query-len 4 --context 32768"; do
      # shellcheck disable=SC2086  # the shape's options, split on spaces
      B prefill $shape --dtype float16 --impl cupaged "${fi[@]}" --reps 20
    done
  fi
  want tiles && B prefill --preset verify-64x4x2048 --impl cupaged --reps 20 --tile 4,1,64,2,1 \
    --tile 4,1,64,2,2 --tile 4,1,64,3,2 --tile 4,1,64,2,4 --tile 4,1,64,3,4 --tile 2,1,64,2,2
  want tiles && B prefill --batch 64 --query-len 8 --context 2048 --dtype float16 \
    --impl cupaged --reps 20 --tile 4,1,64,2,1 --tile 4,1,64,2,2 --tile 4,1,64,3,2
  want split && B prefill --preset verify-64x4x2048 --impl cupaged --reps 20 --split auto \
    --split 0 --split 1024 --split 512 --split 256
}
rowset_mla_tiles() { B mla --preset dsv3-16h-4k --preset dsv3-128h-4k --impl cupaged --reps 10 --tile all; }
rowset_dsa() {
  local fm=()
  flashmla_setup
  [ -n "${FLASHMLA:-}" ] && fm=(--impl flashmla)
  B sparse-mla --impl cupaged "${fm[@]}" --kv-cache-dtype auto --kv-cache-dtype fp8_ds_mla \
    --reps 10
}
rowset_decode_tiles() {
  B ab tuning --layout vllm --settings=-,-@auto@32x2,-@auto@32x3,-@auto@32x4,-@auto@64x3,-@auto@128x2 \
    --row 32/8/64/2048 --row 32/32/64/2048 --row 32/8/8/32768 --row 32/8/128/uniform:128:4096 \
    --row 32/8/256/512 --row 32/8/1/131072 --row 8/1/64/4096
}
rowset_split() {
  B ab tuning --layout vllm --settings=-,-@never,-@always --heads 32/8 --batch 1,8,64,256 \
    --context 128,1024,8192,32768,131072 --max-gib 40
}
rowset_fp8() {
  local kv
  want accuracy && B fp8-error
  if want prefill; then
    for kv in auto fp8; do
      B prefill --preset prompt-4096 --preset 8x2048 --kv-layout HND --kv-cache-dtype $kv \
        --impl cupaged
    done
  fi
}

# each_rowset SPEC...: run every NAME[:SECTION,...] through B
each_rowset() {
  local spec name entry
  for spec in "$@"; do
    name=${spec%%:*}
    entry=${ROWSETS[$name]:-}
    [ -n "$entry" ] || { echo "no row set $name (rows list)" >&2; status=2; continue; }
    SECTIONS=""
    local s
    for s in ${entry%%|*}; do [[ $s == [-+]* ]] || SECTIONS+=" $s"; done
    [[ $spec == *:* ]] && SECTIONS=${spec#*:} && SECTIONS=${SECTIONS//,/ }
    SECTIONS=${SECTIONS# }
    echo "==== $name${SECTIONS:+: $SECTIONS}"
    "rowset_${name//-/_}" || true  # (a last `want X && B` that is not wanted; B keeps status)
  done
}

rows_list() {
  local n
  for n in $(printf '%s\n' "${!ROWSETS[@]}" | sort); do
    printf '%-17s %s\n' "$n" "${ROWSETS[$n]#*|}"
    case ${ROWSETS[$n]%%|*} in
      -) ;;
      *+*) printf '    sections: %s (+: only when named)\n' "${ROWSETS[$n]%%|*}" ;;
      *) printf '    sections: %s\n' "${ROWSETS[$n]%%|*}" ;;
    esac
  done
}

# split_args "$@": SPECS (before --) and EXTRA (after it)
split_args() {
  SPECS=(); EXTRA=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do SPECS+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  EXTRA=("$@")
}

rows_mode() {
  [ "${1:-list}" = list ] && { rows_list; return; }
  split_args "$@"
  B() { logged "$OUT/rows.txt" "${BENCH[@]}" "$@" "${EXTRA[@]}" || fail; }
  each_rowset "${SPECS[@]}"
}

# in_tree TREE ARGS...: cupaged-bench from inside TREE (`python -m` puts the working folder
# first on sys.path; FlashInfer's site, where it was set up, stays after it)
PATHS=$PYTHONPATH
in_tree() {
  local tree=$1; shift
  local mod=cupaged.bench lim=()
  [ -f "$tree/cupaged/bench/__main__.py" ] || mod=cupaged.cli  # older trees
  # LIMIT=SECONDS: each command ends there (a kernel that hangs costs that, not the call)
  [ -n "${LIMIT:-}" ] && lim=(timeout -k 5 "$LIMIT")
  if [ -n "$DRY" ]; then echo "+ (cd $tree) $(quote "${lim[@]}" python3 -m $mod "$@")"; return 0; fi
  (cd "$tree" && PYTHONPATH="$PWD:$PATHS" "${lim[@]}" python3 -m "$mod" "$@")
}

ab_mode() {
  local round tree trees=${TREES:-.ab/base .}
  split_args "$@"
  [ ${#SPECS[@]} -gt 0 ] || [ ${#EXTRA[@]} -gt 0 ] || {
    echo "ab: name row sets, or give a bench command after --" >&2; return 2; }
  for tree in $trees; do
    [ -n "$DRY" ] || [ -d "$tree/cupaged" ] || { echo "ab: no $tree/cupaged (carry it)" >&2; return 2; }
  done
  for round in $(seq "${ROUNDS:-2}"); do
    for tree in $trees; do
      echo "== round $round: $([ "$tree" = . ] && echo "this tree" || echo "$tree")" | tee -a "$OUT/ab.txt"
      if [ ${#SPECS[@]} -eq 0 ]; then  # ab -- BENCH COMMAND
        logged "$OUT/ab.txt" in_tree "$tree" "${EXTRA[@]}" || fail
      else
        B() { logged "$OUT/ab.txt" in_tree "$tree" "$@" "${EXTRA[@]}" || fail; }
        each_rowset "${SPECS[@]}"
      fi
    done
  done
}

# ---- profile ----------------------------------------------------------------------------

COUNTERS=(
  "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
  gpu__time_duration.sum dram__bytes_read.sum dram__throughput.avg.pct_of_peak_sustained_elapsed
  lts__t_sector_hit_rate.pct lts__throughput.avg.pct_of_peak_sustained_elapsed
  sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
  smsp__issue_active.avg.pct_of_peak_sustained_active sm__warps_active.avg.pct_of_peak_sustained_active
  sm__maximum_warps_per_active_cycle_pct smsp__inst_executed.sum smsp__inst_executed_op_ldsm.sum
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
  l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed
  l1tex__throughput.avg.pct_of_peak_sustained_active sm__memory_throughput.avg.pct_of_peak_sustained_active
  sm__sass_l1tex_m_xbar2l1tex_read_bytes_mem_global_op_ldgsts_cache_bypass.sum
  "regex:sm__inst_executed_pipe_(alu|fma|fmaheavy|xu|lsu|uniform|tensor_op_hmma)\.avg\.pct_of_peak_sustained_active"
  launch__grid_size launch__block_size launch__registers_per_thread
  launch__shared_mem_per_block_dynamic launch__occupancy_limit_registers
  launch__occupancy_limit_shared_mem launch__waves_per_multiprocessor
  sm__cycles_active.avg sm__cycles_elapsed.max
)
OPCODES=(
  "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
  "regex:sm__pipe_(tensor_op_hmma|alu|fma|fmaheavy|fp16|xu|lsu|shared)_cycles_active\.avg\.pct_of_peak_sustained_active"
  "regex:sm__inst_executed_pipe_(alu|fma|lsu|xu|uniform|tensor_op_hmma)\.avg\.pct_of_peak_sustained_active"
  sass__inst_executed_per_opcode smsp__inst_executed.sum sm__warps_active.avg.pct_of_peak_sustained_active
  smsp__issue_active.avg.pct_of_peak_sustained_active launch__registers_per_thread
  launch__occupancy_limit_registers launch__occupancy_limit_shared_mem gpu__time_duration.sum
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum smsp__sass_inst_executed_op_ldsm.sum
)

profile() {
  local set=counters kernel="" count="" tag=bench what=()
  while [ $# -gt 0 ]; do
    case $1 in
      --set) set=$2; shift 2 ;;
      --kernel) kernel=$2; shift 2 ;;
      --launch-count) count=$2; shift 2 ;;
      --tag) tag=$2; shift 2 ;;
      *) break ;;
    esac
  done
  [ $# -gt 0 ] || { echo "profile: give a cupaged-bench command" >&2; return 2; }
  case $set in
    counters) what=(--metrics "$(IFS=,; echo "${COUNTERS[*]}")") ;;
    opcodes) what=(--metrics "$(IFS=,; echo "${OPCODES[*]}")" --print-metric-instances values) ;;
    full) what=(--set full --print-details all) ;;
    source) what=(--section SourceCounters --section WarpStateStats -o "$LOGS/ncu-src")
            count=${count:-1}; run rm -f "$LOGS/ncu-src.ncu-rep" ;;
    *) echo "profile: --set counters, opcodes, full or source" >&2; return 2 ;;
  esac
  [ -n "$kernel" ] && what+=(--kernel-name "regex:$kernel")
  [ -n "$count" ] && what+=(--launch-count "$count")
  local report="$OUT/ncu-$tag.txt"
  quiet "$report" env CUPAGED_BENCH_NVTX=1 ncu "${what[@]}" --nvtx --nvtx-include "timed/" \
    python3 -m cupaged.bench "$@"
  echo "== ncu $set: $(quote "$@") (exit $?; report $report)"
  [ -n "$DRY" ] && return
  if [ "$set" = source ]; then
    [ -f "$LOGS/ncu-src.ncu-rep" ] || { echo "no report: see $report"; return 1; }
    ncu -i "$LOGS/ncu-src.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu-src-$tag.csv" 2>&1
    python3 tools/kernel_report.py source "$OUT/ncu-src-$tag.csv"
    return
  fi
  grep -E "^  [A-Za-z_].*\(|^[a-z0-9x-]+ +cupaged|WRONG|gpu__time|dram__|lts__|l1tex__|sm__memory|hmma|gmma|xbar2l1tex|grid_size|block_size|registers_per|occupancy_limit|shared_mem_per|waves|issue_active|warps_active|inst_executed|stalled|conflicts|wavefronts|cycles_|sass__inst" \
    "$report" | sed 's/  */ /g' | head -150
}

# ---- e2e --------------------------------------------------------------------------------

E2E_MAIN=(--preset llama-3-8b --num-requests 256 --prompt-len 128 2048 --output-len 256)
e2e_run() { local tag=$1; shift; logged "$OUT/e2e-$tag.txt" "${BENCH[@]}" e2e "$@" --json "$OUT/e2e-$tag.json" || fail; }
e2e() {
  local name=${1:-} own pc kv fi=()
  [ $# -gt 0 ] && shift
  case "$name" in
    quick) e2e_run quick --preset llama-3.2-1b --num-requests 64 --prompt-len 128 1024 \
             --output-len 64 --systems cupaged --systems cupaged-eager --systems concat "$@" ;;
    main) e2e_run main "${E2E_MAIN[@]}" --systems cupaged --systems cupaged-eager --systems hf "$@" ;;
    main-fi) e2e_run main-fi "${E2E_MAIN[@]}" --systems flashinfer "$@" ;;
    main-concat) e2e_run main-concat "${E2E_MAIN[@]}" --systems concat --no-breakdown "$@" ;;
    compiled) [ -n "${FLASHINFER:-}" ] && fi=(--systems flashinfer)
      [ "${HF:-}" = 1 ] && fi+=(--systems hf)
      e2e_run compiled "${E2E_MAIN[@]}" --systems cupaged --systems cupaged-compiled "${fi[@]}" \
        --no-breakdown "$@" ;;
    prefix)
      for own in "2176 4096" "2176 2560"; do
        for pc in --no-prefix-caching --prefix-caching; do
          e2e_run "prefix-${own// /-}$pc" --preset llama-3-8b --num-requests 256 --prompt-len $own \
            --shared-prefix 2048 --output-len 1 $pc --systems cupaged --no-breakdown "$@"
        done
      done ;;
    fp8)
      for kv in auto fp8; do
        e2e_run "fp8-$kv" "${E2E_MAIN[@]}" --kv-cache-dtype $kv --memory-fraction 0.2 \
          --systems cupaged --no-breakdown "$@"
      done ;;
    *) echo "e2e: unknown run '$name' (quick, main, main-fi, main-concat, compiled, prefix, fp8)" >&2
       return 2 ;;
  esac
}

# ---- dispatch ---------------------------------------------------------------------------

mode=${1:-}
[ $# -gt 0 ] && shift
case "$mode" in
  suite) suite "$@" ;;
  sanitize) sanitize "$@" || status=$? ;;
  mutants) mutants "$@" ;;
  regress) regress "$@" || status=$? ;;
  rows) rows_mode "$@" ;;
  ab) ab_mode "$@" || status=$? ;;
  profile) profile "$@" || status=$? ;;
  report) run python3 tools/kernel_report.py "$@" || status=$? ;;
  test-times) test_times "$@" ;;
  e2e) e2e "$@" || status=$? ;;
  tp) run env NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node "${NPROC:-2}" tools/tp_generate.py \
        --out "$OUT" "$@" || status=$? ;;
  cache-pack)
    if [ -n "$DRY" ]; then
      echo "+ tar -C $CUPAGED_CACHE_DIR -cf - . | xz -T0 -2 | split -b 15M - $OUT/kc.part."
    else
      rm -f "$OUT"/kc.part.*
      tar -C "$CUPAGED_CACHE_DIR" -cf - . | xz -T0 -2 | split -b 15M - "$OUT/kc.part." \
        || status=1
      ls -l "$OUT"/kc.part.*
    fi ;;
  bench) pin=(); [ -n "${CORE:-}" ] && pin=(taskset -c "$CORE")
         logged "$OUT/bench.txt" "${pin[@]}" python3 -m cupaged.bench "$@" || status=$? ;;
  *) sed -n '2,/^source/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
exit "$status"
