#!/usr/bin/env bash
# mla_attention's checks in one device call: its GPU tests against the float64 reference,
# compute-sanitizer's memcheck, racecheck and synccheck on a single-pass and a split-KV
# launch, the kernels' resource use, and (BENCH=1, the default) cupaged-bench mla beside
# FlashInfer's MLA wrapper where .flashinfer is carried.
#   bash tools/mla_check.sh [pytest args...]   TESTS=0, SAN=0, BENCH=0 skip a part
source "$(dirname "$0")/device_env.sh"
status=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_mla.py "$@" 2>&1 \
    | tee "$OUT/mla-tests.txt" | tail -25
  status=${PIPESTATUS[0]}
fi
if [ "${SAN:-1}" != 0 ]; then
  for split in 0 2; do
  for tool in memcheck racecheck synccheck; do
    f="$OUT/sanitize-mla-split$split-$tool.txt"
    timeout 180 compute-sanitizer --tool "$tool" --error-exitcode 99 \
      --kernel-name kns=mla_attention python3 - "$split" <<'PY' > "$f" 2>&1
import sys
import numpy as np, cupy, cupaged
from cupaged import planning, reference
sys.path.insert(0, "tests")
from test_mla import make_mla, device, ref_of, SCALE
planning.set_mla_split(int(sys.argv[1]))
rng = np.random.default_rng(0)
host = make_mla(rng, [1, 3, 20], [100, 260, 90], heads=16, block_size=16)
got = cupy.asnumpy(cupaged.mla_attention(**device(host), scale=SCALE)).astype(np.float64)
err = np.abs(got - ref_of(host)).max()
print("max abs error", err)
assert err < 0.05
PY
    echo "mla split=$split $tool: exit $? ($(grep -E 'ERROR SUMMARY|max abs' "$f" | tr '\n' ' '))" | tee -a "$OUT/sanitize-mla.txt"
  done
  done
fi
if [ "${BENCH:-1}" != 0 ] && python3 -c "import cupaged.bench.mla" 2>/dev/null; then
  FI=()
  [ -f .flashinfer/setup.sh ] && FI=(--impl flashinfer-fa2 --impl flashinfer-fa3)
  python3 -m cupaged.bench mla --preset dsv3-16h-4k --preset dsv3-16h-32k --preset dsv3-128h-4k \
    --preset dsv3-128h-4k-q2 --impl cupaged "${FI[@]}" 2>&1 | grep -v INFO | tee "$OUT/mla-bench.txt"
fi
echo "mla suite exit status: $status"
exit "$status"
