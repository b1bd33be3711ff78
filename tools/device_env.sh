# Sourced by tools/device.sh (and by hand: `source tools/device_env.sh`): run from the
# repository root, results under $OUT, the package from the working tree, and a kernel
# cache that lives with the machine.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/cupaged-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export CUPAGED_CACHE_DIR=${CUPAGED_CACHE_DIR:-/tmp/cupaged-cache}
# A kernel cache from an earlier machine, carried as .kcache/kc.part.* (what
# `tools/device.sh cache-pack` leaves under $OUT; .kcache/ is git-ignored): unpacked once
# into a fresh machine's cache, it spares a cold GPU suite most of its NVRTC time. Its
# entries are keyed by source, options, NVRTC version and arch and verified by size and
# digest before use, so stale ones are only not found.
# (.unpacked records the pieces' checksum: other pieces, carried later, unpack too.)
if [ -z "${DRY:-}" ] && compgen -G ".kcache/kc.part.*" >/dev/null; then
  kc_sum=$(cat .kcache/kc.part.* | cksum)
  if [ "$(cat "$CUPAGED_CACHE_DIR/.unpacked" 2>/dev/null)" != "$kc_sum" ]; then
    mkdir -p "$CUPAGED_CACHE_DIR"
    if cat .kcache/kc.part.* | xz -d | tar -x -C "$CUPAGED_CACHE_DIR"; then
      echo "$kc_sum" > "$CUPAGED_CACHE_DIR/.unpacked"
    else
      echo "the carried kernel cache did not unpack" >&2
    fi
  fi
fi
# flashmla_setup: FlashMLA, where its build kit was carried (.flashmla, git-ignored: its
# Hopper sparse kernels' sources, CUTLASS's headers, .flashmla/build.sh), built once a
# machine into /tmp/flashmla-build (about a minute on 16 cores; the log under $OUT) and
# importable after; FLASHMLA=1 once it is (the dsa row set calls it and adds its rows:
# cupaged-bench sparse-mla --impl flashmla). Only what asks for it builds it.
FLASHMLA=
flashmla_setup() {
  [ -z "${DRY:-}" ] && [ -f .flashmla/build.sh ] || return 0
  if { [ -d /tmp/flashmla-build ] &&
       PYTHONPATH=/tmp/flashmla-build python3 -c "import flash_mla" 2>/dev/null; } ||
     bash .flashmla/build.sh >"$OUT/flashmla-build.txt" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:/tmp/flashmla-build"
    PATHS="${PATHS-}${PATHS:+:}/tmp/flashmla-build"  # (device.sh's in_tree: the ab trees')
    FLASHMLA=1
  else
    echo "FlashMLA did not build (its log: flashmla-build.txt)" >&2
  fi
}
# FlashInfer, where its anchor was carried (.flashinfer): importable, its JIT set up.
# FLASHINFER=1 once it is: the device scripts add FlashInfer's rows then.
FLASHINFER=
if [ -f .flashinfer/setup.sh ]; then
  # Its one argument given: it would take the caller's first argument for its target.
  if source .flashinfer/setup.sh /tmp/flashinfer-site >/dev/null 2>&1; then
    FLASHINFER=1
  else
    echo "FlashInfer did not set up" >&2
  fi
fi
