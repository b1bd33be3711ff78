#!/usr/bin/env bash
# Nsight Compute counters of paged_decode over an fp8 or 16-bit cache (HND, head size 128,
# block 16; LAYOUTS: HND and/or vllm): DRAM throughput, occupancy, issue activity and stall reasons of one launch
# after warm-up (the fifth paged_decode* launch: a decode kernel whether or not split-KV
# adds paged_decode_combine launches between). Full reports in
# $OUT/ncu-decode-<shape>-<cache>-<layout>.txt.
#   SHAPES="32,8,64,2048 32,8,8,32768" CACHES="e4m3 f16" LAYOUTS="HND vllm" bash tools/decode_profile.sh
source "$(dirname "$0")/device_env.sh"
metrics=(
  "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
  gpu__time_duration.sum dram__throughput.avg.pct_of_peak_sustained_elapsed
  sm__warps_active.avg.pct_of_peak_sustained_active smsp__issue_active.avg.pct_of_peak_sustained_active
  launch__registers_per_thread launch__occupancy_limit_registers launch__occupancy_limit_shared_mem
  launch__grid_size launch__waves_per_multiprocessor smsp__inst_executed.sum
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum lts__t_sector_hit_rate.pct dram__bytes_read.sum sm__maximum_warps_per_active_cycle_pct
)
args=(--metrics "$(IFS=,; echo "${metrics[*]}")")
for shape in ${SHAPES:-32,8,64,2048}; do
  for cache in ${CACHES:-e4m3 f16}; do
   for layout in ${LAYOUTS:-HND}; do
    f="$OUT/ncu-decode-${shape//,/_}-$cache-$layout.txt"
    ncu "${args[@]}" --kernel-name regex:paged_decode --launch-skip 4 --launch-count 1 \
      python3 - "$shape" "$cache" "$layout" > "$f" 2>&1 <<'PY'
import sys
import cupy
import numpy as np
import cupaged
heads, kvh, batch, ctx = (int(x) for x in sys.argv[1].split(","))
fp8 = sys.argv[2] != "f16"
layout = sys.argv[3]
rng = np.random.default_rng(0)
blocks = batch * ctx // 16
if layout == "vllm":
    x = 16 if fp8 else 8
    shapes = (blocks, kvh, 128 // x, 16, x), (blocks, kvh, 128, 16)
else:
    shapes = (blocks, kvh, 16, 128), (blocks, kvh, 16, 128)
if fp8:  # finite e4m3 values
    k, v = (cupy.asarray(rng.integers(0, 0x60, size=s, dtype=np.uint8)) for s in shapes)
    kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=0.05, v_scale=0.05)
else:
    k, v = (cupy.asarray(rng.standard_normal(s, dtype=np.float32)).astype(np.float16)
            for s in shapes)
    kw = {}
bt = cupy.asarray(rng.permutation(blocks).astype(np.int32).reshape(batch, -1))
lens = cupy.full(batch, ctx, np.int32)
q = cupy.asarray(rng.standard_normal((batch, heads, 128), dtype=np.float32)).astype(np.float16)
for _ in range(5):
    cupaged.attention(q, k, v, bt, lens, kv_layout=layout, max_seq_len=ctx, **kw)
cupy.cuda.Device().synchronize()
PY
    echo "== $shape $cache $layout (exit $?)"
    grep -E "gpu__time_duration|sector_hit|dram__bytes|maximum_warps|inst_executed.sum|dram__throughput|issue_active|warps_active|registers_per|occupancy_limit|grid_size|waves_per|bank_conflicts|stalled_(barrier|long_scoreboard|short_scoreboard|math_pipe|mio|wait|not_selected|dispatch|lg_throttle|no_instruction|branch|membar|sleeping)" "$f" | sed 's/  */ /g'
   done
  done
done
