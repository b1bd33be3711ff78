#!/usr/bin/env bash
# Evidence that regression tests fail without their fixes, on the GPU machine.
#   bash tools/regression_check.sh TEST_ID...
# 1. Each TEST_ID (pytest node id or -k expression under tests/) runs against the library
#    as it was before the fixes (.regress/old/{cupaged,cuda_src}, made on the dev machine by
#    `git archive BASE cupaged cuda_src | tar -x -C .regress/old`, and carried), with the
#    current tests and test helpers (cupaged/testing.py). Each in its own process: a
#    misaligned access poisons the whole CUDA context.
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

# 2. Each mutant (tools/mutants.py: a check or fix taken out of the current source; all of
#    them, or those named in MUTANTS="a b") must fail its tests, which pass on the source.
echo "== mutants (must fail) and the real source (must pass)"
for name in ${MUTANTS:-$(python3 tools/mutants.py list)}; do
  mut=/tmp/cupaged-mutant-$name
  rm -rf "$mut" && mkdir -p "$mut"
  cp -r "$repo"/tests "$repo"/cupaged "$repo"/cuda_src "$repo"/tools "$repo"/pyproject.toml "$mut"/
  python3 tools/mutants.py apply "$name" "$mut" || continue
  mapfile -t args < <(python3 tools/mutants.py tests "$name")
  run "mutant $name" "$mut" "${args[@]}"
  run "real $name" "$repo" "${args[@]}"
done
