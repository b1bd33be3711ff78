#!/usr/bin/env bash
# Nsight Compute counters of cupaged's multi-token kernel beside FlashInfer's fa2 prefill
# on the same preset (in its dtype: bf16 but for the verify preset): grid, registers,
# occupancy, memory traffic, tensor pipe, issue activity and stall reasons, one launch of
# each after warm-up (the NVTX range "timed"). Needs .flashinfer/ carried for fa2's rows.
#   PRESETS="8x2048 prompt-4096" IMPLS="cupaged flashinfer-fa2" [SOFT_CAP=50] [ALIBI=1] [HEAD_SIZE=64]
#   [KV_DTYPE=fp8] [TAG=name] bash tools/prefill_peer_profile.sh
# Reports: $OUT/ncu-pp-<impl>-<preset><TAG>.txt. SET=full: Nsight Compute's full section set.
# SOURCE=1: instead, the warp-state samples per SASS instruction (SourceCounters), as CSV
# in $OUT/ncu-src-<impl>-<preset><TAG>.csv (tools/ncu_source_summary.py reads it).
source "$(dirname "$0")/device_env.sh"
metrics=(
  "regex:smsp__average_warps_issue_stalled_(long_scoreboard|short_scoreboard|wait|barrier|math_pipe_throttle|mio_throttle|not_selected|dispatch_stall|no_instruction|lg_throttle|tex_throttle|branch_resolving|selected)_per_issue_active\.ratio"
  gpu__time_duration.sum dram__bytes_read.sum dram__throughput.avg.pct_of_peak_sustained_elapsed
  lts__t_sector_hit_rate.pct sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  smsp__issue_active.avg.pct_of_peak_sustained_active sm__warps_active.avg.pct_of_peak_sustained_active
  smsp__inst_executed.sum smsp__inst_executed_op_ldsm.sum l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
  "regex:sm__inst_executed_pipe_(alu|fma|fmaheavy|xu|lsu|uniform|tensor_op_hmma)\.avg\.pct_of_peak_sustained_active"
  launch__grid_size launch__block_size launch__registers_per_thread
  launch__shared_mem_per_block_dynamic launch__occupancy_limit_registers
  launch__occupancy_limit_shared_mem launch__waves_per_multiprocessor
  sm__cycles_active.avg sm__cycles_elapsed.max
)
if [ -n "${SOURCE:-}" ]; then
  what=(--section SourceCounters --section WarpStateStats -o /tmp/ncu-src)
elif [ -n "${SET:-}" ]; then
  what=(--set "$SET" --print-details all)
else
  what=(--metrics "$(IFS=,; echo "${metrics[*]}")")
fi
for preset in ${PRESETS:-8x2048}; do
  for impl in ${IMPLS:-cupaged flashinfer-fa2}; do
    f="$OUT/ncu-pp-$impl-$preset${TAG:-}.txt"
    rm -f /tmp/ncu-src.ncu-rep  # (a run that profiles nothing must not export the last one)
    ncu "${what[@]}" --nvtx --nvtx-include "timed/" python3 - "$impl" "$preset" \
      "${SOFT_CAP:-}" "${HEAD_SIZE:-128}" "${KV_DTYPE:-auto}" "${ALIBI:-}" > "$f" 2>&1 <<'PY'
import sys
from cupaged.bench import timing
from cupaged.bench import workloads
from cupaged.bench import prefill as bench_prefill
impl, preset, cap, hs, kv = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
variants = workloads.Variants(soft_cap=float(cap) if cap else None,
                              alibi=sys.argv[6] not in ("", "0"))
case = bench_prefill.PrefillCase(preset, **bench_prefill.PRESETS[preset], head_size=hs,
                                 kv_cache_dtype=kv, variants=variants).build()
run = bench_prefill.IMPLEMENTATIONS[impl](case)
print("max error", case.check(run()))
timing.call_in_nvtx_range(run)
PY
    echo "== $impl $preset ${SOFT_CAP:+soft-cap $SOFT_CAP }${TAG:-} (exit $?)"
    if [ -n "${SOURCE:-}" ]; then
      [ -f /tmp/ncu-src.ncu-rep ] || { echo "no report: see $f"; continue; }
      ncu -i /tmp/ncu-src.ncu-rep --page source --csv --print-source sass \
        > "$OUT/ncu-src-$impl-$preset${TAG:-}.csv" 2>&1
      head -c 600 "$OUT/ncu-src-$impl-$preset${TAG:-}.csv"; echo
      continue
    fi
    grep -E "max error|^  [A-Za-z_].*\(|gpu__time|dram__|lts__|hmma|grid_size|block_size|registers_per|occupancy_limit|shared_mem_per|waves|issue_active|warps_active|inst_executed|stalled|conflicts|cycles_" "$f" | sed 's/  */ /g' | head -70
  done
done
