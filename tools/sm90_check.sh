#!/usr/bin/env bash
# The Hopper kernel's checks in one device call: the wgmma operand probes (and, if one
# fails, the descriptor scan), paged_prefill_sm90 against the reference, its SASS mix
# (HGMMA and local-memory instructions of the specializations the tests built),
# compute-sanitizer's memcheck, racecheck and synccheck on one launch, and cupaged-bench
# prefill with both multi-token families (and the peers named in PEERS).
#   bash tools/sm90_check.sh [pytest args...]   BENCH=0: no benchmark; SAN=0: no sanitizer;
#   TESTS=0: no tests; SAN_CASES="NHD:auto vllm:auto NHD:fp8" (layout:kv_cache_dtype) the
#   sanitized launches (default NHD:auto)
source "$(dirname "$0")/device_env.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_sm90.py 2>&1 | tee "$OUT/sm90-probe.txt" | tail -5
if grep -q failed "$OUT/sm90-probe.txt"; then
  python3 tools/sm90_layout_scan.py 2>&1 | tee "$OUT/sm90-scan.txt" | tail -20
fi
status=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_prefill_sm90.py "$@" 2>&1 \
    | tee "$OUT/sm90-tests.txt" | tail -25
  status=${PIPESTATUS[0]}
fi
if command -v cuobjdump >/dev/null; then
  for f in $(find "$CUPAGED_CACHE_DIR" -name '*prefill_sm90*.cubin' | head -4); do
    sass=$(cuobjdump -sass "$f" 2>&1)
    echo "$(basename "$f"): $(grep -c HGMMA <<<"$sass") HGMMA," \
      "$(grep -cE 'LDL|STL' <<<"$sass") local loads/stores"
  done | tee "$OUT/sm90-sass.txt"
else
  echo "no cuobjdump: SASS not read" | tee "$OUT/sm90-sass.txt"
fi
if [ "${SAN:-1}" != 0 ]; then
  for case in ${SAN_CASES:-NHD:auto}; do
  for tool in memcheck racecheck synccheck; do
    f="$OUT/sanitize-sm90-${case/:/-}-$tool.txt"
    timeout 180 compute-sanitizer --tool "$tool" --error-exitcode 99 \
      --kernel-name kns=paged_prefill_sm90 python3 - "${case%%:*}" "${case##*:}" <<'PY' > "$f" 2>&1
import sys
import numpy as np, cupy, cupaged
from cupaged import testing
layout, kv = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
q_lens, seq = [300, 5, 130], [300, 900, 2000]
bt, nb = testing.random_block_tables(np.array(seq, np.int32), 16, rng, spare_blocks=2)
kc, vc = testing.random_cache(nb, 2, 128, 16, np.float16, rng)
fp8 = {}
if kv != "auto":  # the same values' fp8 bytes, per-tensor scales
    from cupaged import reference
    kc, vc = (reference.quantize_fp8(c, kv, 0.01).view(np.uint8) for c in (kc, vc))
    fp8 = dict(kv_cache_dtype=kv, k_scale=0.01, v_scale=0.01)
kc, vc = testing.convert_layout(kc, vc, "vllm", layout)
qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
q = testing.random_normal((int(qsl[-1]), 8, 128), np.float16, rng)
d = {k: cupy.asarray(v) for k, v in dict(query=q, key_cache=kc, value_cache=vc, block_tables=bt,
                                         seq_lens=np.array(seq, np.int32), query_start_loc=qsl).items()}
from cupaged import planning
planning.set_prefill_family("sm90")
served = []  # the Hopper kernel must serve it, or the sanitizer would watch nothing
real = planning.prefill_sm90_kernel
planning.prefill_sm90_kernel = lambda *a, **k: served.append(a) or real(*a, **k)
cupaged.attention(**d, kv_layout=layout, **fp8)
assert served, f"paged_prefill_sm90 does not serve {layout}:{kv}"
cupy.cuda.Device().synchronize()
print("done")
PY
    echo "$case $tool: exit ${PIPESTATUS[0]}"; tail -3 "$f"
  done
  done
fi
if [ "${BENCH:-1}" != 0 ]; then
  python3 -m cupaged.bench prefill --impl cupaged --impl cupaged-mma ${PEERS:-} 2>&1 \
    | tee "$OUT/bench-prefill.txt"
fi
echo "sm90 tests exit status: $status"
exit "$status"
