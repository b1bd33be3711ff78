#!/usr/bin/env bash
# Host time, old library (.regress/old) against the working tree, interleaved in one
# process (tools/host_ab.py says why). Carry .regress.   bash tools/host_ab.sh [rounds] [calls]
source "$(dirname "$0")/device_env.sh"
old=/tmp/cupaged-ab
rm -rf "$old" && mkdir -p "$old"
base=${OLD:-.regress/old}  # OLD=: another carried tree
cp -r "$base/cupaged" "$old/cupaged_old" && cp -r "$base/cuda_src" "$old/cuda_src"
PYTHONPATH="$PWD:$old" taskset -c "${CORE:-5}" python3 tools/host_ab.py "$@" 2>&1 | tee "$OUT/host-ab.txt"
