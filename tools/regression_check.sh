#!/usr/bin/env bash
# Evidence that regression tests fail without their fixes, on the GPU machine.
#   bash tools/regression_check.sh TEST_ID...
# 1. Each TEST_ID (pytest node id or -k expression under tests/) runs against the library
#    as it was before the fixes (.regress/old/{cupaged,cuda_src}, made on the dev machine by
#    `git archive BASE cupaged cuda_src | tar -x -C .regress/old`, and carried), with the
#    current tests and test helpers (cupaged/testing.py). Each in its own process: a
#    misaligned access poisons the whole CUDA context.
# 2. The stale-slot tests run against the current kernels with the V masking removed
#    (0 * NaN then reaches the output): they must fail there and pass on the real source.
# One line per run: "fails" is what a regression test must show before its fix.
source "$(dirname "$0")/device_env.sh"
repo=$PWD

run() {  # run LABEL TREE PYTEST-ARGS...: one line with the outcome
  local label=$1 tree=$2; shift 2
  local log="$OUT/regress-$(echo "$label" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-80).txt"
  (cd "$tree" && PYTHONPATH="$tree" CUPAGED_CACHE_DIR="$tree/.kcache" \
     timeout 300 python3 -m pytest -q -p no:cacheprovider -x "$@") >"$log" 2>&1
  local rc=$? summary
  summary=$(grep -E "passed|failed|error" "$log" | tail -n 1)
  printf '%-70s %s (%s)\n' "$label" "$([ $rc = 0 ] && echo passes || echo FAILS)" "$summary"
}

if [ -d .regress/old/cupaged ]; then
  old=/tmp/cupaged-old
  rm -rf "$old" && mkdir -p "$old" && cp -r "$repo"/tests "$repo"/cupaged "$old"/
  cp "$repo/cupaged/testing.py" /tmp/testing.py
  rm -rf "$old/cupaged" && cp -r .regress/old/cupaged "$old/cupaged" && cp -r .regress/old/cuda_src "$old/"
  cp /tmp/testing.py "$old/cupaged/testing.py"
  cp "$repo/pyproject.toml" "$old/"
  echo "== before the fixes (library from .regress/old, current tests)"
  for t in "$@"; do run "old: $t" "$old" "$t"; done
fi

mut=/tmp/cupaged-mutant
rm -rf "$mut" && mkdir -p "$mut" && cp -r "$repo"/tests "$repo"/cupaged "$repo"/cuda_src "$repo"/pyproject.toml "$mut"/
python3 - "$mut/cuda_src/paged_decode.cuh" <<'PY'
import re, sys
p = sys.argv[1]
s = open(p).read()
n0 = len(s)
# tensor-core path: zeroing V's columns past the context end
s, a = re.subn(r"\n      if \(valid < TT\) \{\n        T\* vz = .*?\n      \}\n", "\n", s, flags=re.S)
# FMA path: zeroing V values past the context end
s, b = re.subn(r"\n          if \(tt \+ X > valid\) \{.*?\n          \}\n", "\n", s, flags=re.S)
assert (a, b) == (1, 1), (a, b)
open(p, "w").write(s)
print(f"mutant: removed the V masking ({n0 - len(s)} characters, 2 places)")
PY
echo "== current kernels without the V masking (must fail) and with it (must pass)"
run "mutant: stale slots" "$mut" tests/test_decode.py -k stale --maxfail=1000
run "real: stale slots" "$repo" tests/test_decode.py -k stale
grep -h -E "^FAILED" "$OUT"/regress-mutant* | sed 's/ - .*//' | sort | uniq -c | head -30
