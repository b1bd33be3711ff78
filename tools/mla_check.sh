#!/usr/bin/env bash
# mla_attention's checks in one device call: its GPU tests against the float64 reference,
# compute-sanitizer's memcheck, racecheck and synccheck on single-pass, split-KV and fp8
# launches (SAN_CASES="split:kv_cache_dtype ..."), and (BENCH=1, the default)
# cupaged-bench mla beside FlashInfer's MLA wrapper where .flashinfer is carried, and over
# an fp8 latent cache.
#   bash tools/mla_check.sh [pytest args...]   TESTS=0, SAN=0, BENCH=0 skip a part
source "$(dirname "$0")/device_env.sh"
status=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_mla.py "$@" 2>&1 \
    | tee "$OUT/mla-tests.txt" | tail -25
  status=${PIPESTATUS[0]}
fi
if [ "${SAN:-1}" != 0 ]; then
  # (split-KV tiles a partition : the cache's dtype : kernel family) of each sanitized launch
  for case in ${SAN_CASES:-0:auto:mma 2:auto:mma 2:fp8_e4m3:mma 0:auto:sm90 2:auto:sm90 0:fp8_e4m3:sm90 2:fp8_e4m3:sm90}; do
  for tool in memcheck racecheck synccheck; do
    f="$OUT/sanitize-mla-${case//:/-}-$tool.txt"
    timeout 180 compute-sanitizer --tool "$tool" --error-exitcode 99 \
      --kernel-name kns=mla_attention python3 - ${case//:/ } <<'PY' > "$f" 2>&1
import sys
import numpy as np, cupy, cupaged
from cupaged import planning, reference
sys.path.insert(0, "tests")
from test_mla import make_mla, device, ref_of, to_fp8, SCALE
planning.set_mla_split(int(sys.argv[1]))
fmt = sys.argv[2]
planning.set_mla_family(sys.argv[3] if len(sys.argv) > 3 else None)
rng = np.random.default_rng(0)
host = make_mla(rng, [1, 3, 20], [100, 260, 90], heads=16, block_size=16)
kw, ref = {}, ref_of(host)
if fmt != "auto":
    host["kv_cache"] = to_fp8(host["kv_cache"], fmt, 0.05)
    kw = dict(kv_cache_dtype=fmt, k_scale=0.05)
    ref = reference.mla_attention(host["q"], host["kv_cache"], host["block_tables"],
                                  host["seq_lens"], host["query_start_loc"], scale=SCALE,
                                  kv_cache_dtype=fmt, k_scale=0.05)
got = cupy.asnumpy(cupaged.mla_attention(**device(host), scale=SCALE, **kw)).astype(np.float64)
err = np.abs(got - ref).max()
print("max abs error", err)
assert err < 0.05
PY
    echo "mla $case $tool: exit $? ($(grep -E 'ERROR SUMMARY|max abs' "$f" | tr '\n' ' '))" | tee -a "$OUT/sanitize-mla.txt"
  done
  done
fi
if [ "${BENCH:-1}" != 0 ] && python3 -c "import cupaged.bench.mla" 2>/dev/null; then
  FI=()
  [ -f .flashinfer/setup.sh ] && FI=(--impl flashinfer-fa2 --impl flashinfer-fa3)
  python3 -m cupaged.bench mla --preset dsv3-16h-4k --preset dsv3-16h-32k --preset dsv3-128h-4k \
    --preset dsv3-128h-4k-q2 --impl cupaged "${FI[@]}" 2>&1 | grep -v INFO | tee "$OUT/mla-bench.txt"
  # fp8: the planner's choice and, where it differs, the other family (16 heads: the
  # mma.sync kernel's two CTAs an SM against the wgmma kernel's 64-row tiles)
  python3 -m cupaged.bench mla --preset dsv3-16h-4k --preset dsv3-16h-32k --preset dsv3-128h-4k \
    --preset dsv3-128h-4k-q2 --kv-cache-dtype fp8_e4m3 --impl cupaged --impl cupaged-mma \
    --impl cupaged-sm90 2>&1 | grep -v INFO | tee -a "$OUT/mla-bench.txt"
fi
echo "mla suite exit status: $status"
exit "$status"
