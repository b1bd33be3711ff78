#!/usr/bin/env bash
# Nsight Compute counters of paged_prefill: where its time goes (tensor-pipe use, issue
# slots, stall reasons, occupancy, executed instructions per opcode). One profiled launch
# per (preset, tile, cache) after warm-up; full reports in $OUT/ncu-<preset>-<tile>-<cache>.txt.
#   PRESETS="prompt-4096" TILES="8,1,32,2 4,2,64,2" KV="auto fp8_e4m3" bash tools/prefill_profile.sh
# TILES empty: the planner's choice. KV: the cache type (default auto, the query's).
source "$(dirname "$0")/device_env.sh"
metrics=(
  "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
  "regex:sm__pipe_(tensor_op_hmma|alu|fma|fmaheavy|fp16|xu|lsu|shared)_cycles_active\.avg\.pct_of_peak_sustained_active"
  "regex:sm__inst_executed_pipe_(alu|fma|lsu|xu|uniform|tensor_op_hmma)\.avg\.pct_of_peak_sustained_active"
  sass__inst_executed_per_opcode smsp__inst_executed.sum sm__warps_active.avg.pct_of_peak_sustained_active
  smsp__issue_active.avg.pct_of_peak_sustained_active launch__registers_per_thread
  launch__occupancy_limit_registers launch__occupancy_limit_shared_mem gpu__time_duration.sum
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum smsp__sass_inst_executed_op_ldsm.sum
)
args=(--metrics "$(IFS=,; echo "${metrics[*]}")")
for preset in ${PRESETS:-prompt-4096}; do
  for tile in ${TILES:-planner}; do
   for kv in ${KV:-auto}; do
    f="$OUT/ncu-$preset-${tile//,/_}-$kv.txt"
    ncu "${args[@]}" --print-metric-instances values --kernel-name regex:paged_prefill \
      --launch-skip 2 --launch-count 1 python3 - "$preset" "$tile" "$kv" > "$f" 2>&1 <<'PY'
import sys
from cupaged import planning
from cupaged.bench import prefill as bench_prefill
preset, tile, kv = sys.argv[1], sys.argv[2], sys.argv[3]
if tile != "planner":
    planning.set_prefill_tile(tuple(int(x) for x in tile.split(",")))
case = bench_prefill.PrefillCase(preset, **bench_prefill.PRESETS[preset], kv_cache_dtype=kv)
for r in bench_prefill.measure([case], ["cupaged"], reps=3, copy_bw=1.0):
    print(r.case, r.impl, r.median_us, r.error, r.note)
PY
    echo "== $preset $tile $kv (exit $?)"
    grep -E "gpu__time_duration|tensor_op_hmma|issue_active|inst_executed.sum|registers_per|warps_active|stalled_(barrier|long_scoreboard|short_scoreboard|math_pipe|mio|wait|not_selected|dispatch|lg_throttle|no_instruction|branch)" "$f" | sed 's/  */ /g'
   done
  done
done
