# Sourced by tools/device.sh (and by hand: `source tools/device_env.sh`): run from the
# repository root, results under $OUT, the package from the working tree, and a kernel
# cache that lives with the machine.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/cupaged-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export CUPAGED_CACHE_DIR=${CUPAGED_CACHE_DIR:-/tmp/cupaged-cache}
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
