#!/usr/bin/env bash
# Nsight Compute on mla_attention: one launch per (preset, kernel family) after warm-up,
# its counters (duration, tensor-pipe use, DRAM and L2, issue slots, stall reasons) in
# $OUT/ncu-mla-<preset>-<family>.txt; with SOURCE=1 instead the warp samples per SASS
# instruction as CSV, $OUT/ncu-src-mla-<preset>-<family>.csv (tools/ncu_source_summary.py
# reads it). The family "fa3" is FlashInfer's Hopper MLA kernel (.flashinfer carried).
#   PRESETS="dsv3-128h-4k" FAMILIES="sm90 mma fa3" [SOURCE=1] [KV=fp8_e4m3] bash tools/mla_profile.sh
source "$(dirname "$0")/device_env.sh"
metrics=(
  "regex:smsp__average_warps_issue_stalled_(long_scoreboard|short_scoreboard|wait|barrier|membar|math_pipe_throttle|mio_throttle|not_selected|dispatch_stall|no_instruction|lg_throttle|branch_resolving|selected|sleeping)_per_issue_active\.ratio"
  gpu__time_duration.sum dram__bytes_read.sum dram__throughput.avg.pct_of_peak_sustained_elapsed
  lts__t_sector_hit_rate.pct sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
  smsp__issue_active.avg.pct_of_peak_sustained_active sm__warps_active.avg.pct_of_peak_sustained_active
  smsp__inst_executed.sum l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
  l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed
  "regex:sm__inst_executed_pipe_(alu|fma|xu|lsu|uniform)\.avg\.pct_of_peak_sustained_active"
  launch__grid_size launch__registers_per_thread launch__waves_per_multiprocessor
  l1tex__throughput.avg.pct_of_peak_sustained_active lts__throughput.avg.pct_of_peak_sustained_elapsed
  sm__memory_throughput.avg.pct_of_peak_sustained_active
)
if [ -n "${SOURCE:-}" ]; then
  what=(--section SourceCounters --section WarpStateStats -o /tmp/ncu-src)
else
  what=(--metrics "$(IFS=,; echo "${metrics[*]}")")
fi
for preset in ${PRESETS:-dsv3-128h-4k}; do
  for family in ${FAMILIES:-sm90}; do
    tag="mla-$preset-$family${KV:+-$KV}"
    log="$OUT/ncu-$tag.txt"
    [ -n "${SOURCE:-}" ] && log="$OUT/ncu-src-log-$tag.txt"
    rm -f /tmp/ncu-src.ncu-rep
    kernel=regex:mla_attention
    [ "$family" = fa3 ] && kernel=regex:BatchMLAPageAttentionHopper
    ncu "${what[@]}" --kernel-name "$kernel" --launch-skip 2 --launch-count 1 \
      python3 - "$preset" "$family" "${KV:-auto}" > "$log" 2>&1 <<'PY'
import sys
from cupaged import planning
from cupaged.bench import mla as bench_mla
impl = "flashinfer-fa3" if sys.argv[2] == "fa3" else "cupaged"
if impl == "cupaged":
    planning.set_mla_family(sys.argv[2])
case = bench_mla.preset_case(sys.argv[1], kv_cache_dtype=sys.argv[3])
for r in bench_mla.measure([case], [impl], reps=3, copy_bw=1.0):
    print(r.case, r.impl, r.median_us, r.error, r.note)
PY
    echo "== $preset $family (exit $?)"
    if [ -n "${SOURCE:-}" ]; then
      [ -f /tmp/ncu-src.ncu-rep ] || { echo "no report: see $log"; continue; }
      ncu -i /tmp/ncu-src.ncu-rep --page source --csv --print-source sass \
        > "$OUT/ncu-src-$tag.csv" 2>&1
      continue
    fi
    grep -E "gpu__time|dram__|lts__|l1tex__|sm__memory|hmma|gmma|grid|registers_per|waves|issue_active|warps_active|inst_executed|stalled|conflicts|wavefronts" \
      "$OUT/ncu-$tag.txt" | sed 's/  */ /g'
  done
done
