#!/usr/bin/env bash
# Nsight Compute counters of FlashInfer's decode kernels beside cupaged's, on the same
# workload (fp16, hs 128, block 16; SHAPE=heads,kv_heads,batch,context): grid, registers,
# occupancy limits, DRAM throughput, issue activity and stall reasons of each library's
# main kernel, one launch after warm-up. Needs .flashinfer/ (see tools/compare_sweep.sh).
# Reports: $OUT/ncu-fi-<impl>-<shape>.txt.
#   SHAPE=32,8,64,2048 IMPLS="flashinfer-decode-tc flashinfer-decode cupaged-hnd" bash tools/flashinfer_profile.sh
# An impl may carry cupaged's tuning: cupaged-hnd@2@never runs at most 2 decode CTAs per SM
# with partition="never" (the decode command's --ctas-per-sm). SET=full takes Nsight
# Compute's full section set instead of the counters below (and prints every section).
source "$(dirname "$0")/device_env.sh"
source .flashinfer/setup.sh || { echo "FlashInfer setup failed" >&2; exit 2; }
shape=${SHAPE:-32,8,64,2048}
metrics=(
  "regex:smsp__average_warps_issue_stalled_(long_scoreboard|wait|barrier|short_scoreboard|not_selected)_per_issue_active\.ratio"
  gpu__time_duration.sum dram__throughput.avg.pct_of_peak_sustained_elapsed dram__bytes_read.sum
  sm__warps_active.avg.pct_of_peak_sustained_active smsp__issue_active.avg.pct_of_peak_sustained_active
  launch__registers_per_thread launch__occupancy_limit_registers launch__occupancy_limit_shared_mem
  launch__grid_size launch__block_size launch__shared_mem_per_block_dynamic
  launch__waves_per_multiprocessor smsp__inst_executed.sum
  lts__t_sector_hit_rate.pct sm__sass_l1tex_m_xbar2l1tex_read_bytes_mem_global_op_ldgsts_cache_bypass.sum
)
if [ -n "${SET:-}" ]; then
  what=(--set "$SET" --print-details all)
else
  what=(--metrics "$(IFS=,; echo "${metrics[*]}")")
fi
for impl in ${IMPLS:-flashinfer-decode-tc flashinfer-decode cupaged-hnd}; do
  f="$OUT/ncu-fi-${impl//@/-}-${shape//,/_}.txt"
  # Warm-up outside the profile (FlashInfer compiles its module on first use), then every
  # kernel of two more calls.
  ncu "${what[@]}" \
    --nvtx --nvtx-include "timed/" python3 - "$impl" "$shape" > "$f" 2>&1 <<'PY'
import sys
import numpy as np
from cupaged import decode, planning
from cupaged.bench import decode as bench_decode
from cupaged.bench import timing
from cupaged.bench import workloads
impl, shape = sys.argv[1], sys.argv[2]
impl, ctas, partition = (impl.split("@") + ["", ""])[:3]
planning.set_tuning(None, int(ctas) if ctas else None)
heads, kvh, batch, ctx = (int(x) for x in shape.split(","))
case = workloads.DecodeCase(batch, np.full(batch, ctx, np.int32), heads, kvh, 128, 16,
                        np.dtype(np.float16)).build()
fn = bench_decode.IMPLEMENTATIONS[impl][0](case, partition or "auto")
timing.call_in_nvtx_range(fn)
PY
  echo "== $impl $shape (exit $?)"
  grep -E "^  [A-Za-z_].*\(|gpu__time|dram__|lts__|xbar2l1tex|grid_size|block_size|registers_per|occupancy_limit|shared_mem_per|waves|issue_active|warps_active|inst_executed|stalled" "$f" | sed 's/  */ /g' | head -60
done
