#!/usr/bin/env bash
# A whole device check: environment, the GPU test suite, and the decode, compile,
# cache-ops and overhead benchmarks. Logs go to $OUT (the device tool brings them back).
#   bash tools/device_check.sh [pytest args...]     e.g. -k long_context
# The suite takes over 10 minutes, the most a device command may run, so it runs in six
# shards, one device call each (their summary lines together are the suite's):
#   SHARD=1  decode, varlen, interop and prepared-call tests
#   SHARD=2  the rest, then the decode, compile, cache-ops and overhead benchmarks
#   SHARD=3  the serving loop and the framework integrations (engine, model, e2e, torch.ops,
#            transformers); FlashInfer's modules compile there when .flashinfer is carried
#   SHARD=4  MLA (both kernel families on a Hopper GPU)
#   SHARD=5  the Hopper prefill kernel, the variants, the README's examples
#   SHARD=6  fp8, the KV cache and merge
#   SHARD=kernels  shards 1, 2, 4, 5 and 6's tests in one call, without the benchmarks: for
#            WORKERS=N, which spreads the tests over N pytest-xdist processes (a cold run is
#            mostly NVRTC, one CPU core per compile; the kernel cache is shared on disk)
# On a machine whose kernel cache is cold, SHARD=2's tests alone take about 7 minutes (most
# of it NVRTC): SHARD=6's files would take it past the limit.
source "$(dirname "$0")/device_env.sh"
bench() { python3 -m cupaged.bench "$@"; }
SHARD1="tests/test_decode.py tests/test_varlen.py tests/test_interop.py tests/test_prepared.py"
# FlashInfer's CLI rows compile FlashInfer's modules (minutes): with the serving loop's,
# where .flashinfer is carried.
SERVING="tests/test_engine.py tests/test_llama.py tests/test_bench_e2e.py tests/test_torch_ops.py
  tests/test_transformers.py"
SHARD4="tests/test_mla.py"
SHARD5="tests/test_prefill_sm90.py tests/test_sm90.py tests/test_variants.py tests/test_readme.py"
SHARD6="tests/test_fp8.py tests/test_kv_cache.py tests/test_merge.py"
FI_CLI=tests/test_cli.py::test_compare_flashinfer_rows_check_and_plan
case "${SHARD:-}" in
  1) set -- $SHARD1 "$@" ;;
  2) for f in $SHARD1 $SERVING $SHARD4 $SHARD5 $SHARD6; do set -- "--ignore=$f" "$@"; done
     set -- "--deselect=$FI_CLI" "$@" ;;
  3) set -- $SERVING $FI_CLI "$@" ;;
  4) set -- $SHARD4 "$@" ;;
  5) set -- $SHARD5 "$@" ;;
  6) set -- $SHARD6 "$@" ;;
  kernels) for f in $SERVING; do set -- "--ignore=$f" "$@"; done
     set -- "--deselect=$FI_CLI" "$@" ;;
  "") ;;
  *) echo "SHARD must be 1 to 6, kernels or unset" >&2; exit 2 ;;
esac

bench info 2>&1 | tee "$OUT/info.txt"
# SHARD=3 runs its files' host tests too: those need torch and transformers, which CI lacks.
marker=(-m gpu)
[ "${SHARD:-}" = 3 ] && marker=()
[ "${WORKERS:-1}" -gt 1 ] && set -- -n "$WORKERS" "$@"
python3 -m pytest "${marker[@]}" -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu-tests${SHARD:-}.txt" | tail -25
status=${PIPESTATUS[0]}
if [ "${SHARD:-}" = 2 ] || [ -z "${SHARD:-}" ]; then
  bench decode --batch 64 --context 2048 --heads 32 --kv-heads 8 --head-size 128 \
    --block-size 16 --dtype float16 2>&1 | tee "$OUT/bench-decode.txt"
  bench compile --head-size 128 --block-size 16 2>&1 | tee "$OUT/bench-compile.txt"
  bench cache-ops 2>&1 | tee "$OUT/bench-cache-ops.txt"
  bench overhead 2>&1 | tee "$OUT/bench-overhead.txt"
fi
echo "gpu suite exit status: $status"
exit "$status"
