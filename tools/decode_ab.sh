#!/usr/bin/env bash
# Decode kernel time, old library (.regress/old) against the working tree, interleaved in
# one process (tools/decode_ab.py). Carry .regress.   bash tools/decode_ab.sh [options]
source "$(dirname "$0")/device_env.sh"
old=/tmp/cupaged-ab
rm -rf "$old" && mkdir -p "$old"
base=${OLD:-.regress/old}  # OLD=: another carried tree
cp -r "$base/cupaged" "$old/cupaged_old" && cp -r "$base/cuda_src" "$old/cuda_src"
PYTHONPATH="$PWD:$old" python3 tools/decode_ab.py "$@" 2>&1 | tee -a "$OUT/decode-ab.txt"
