"""Mutants for `bash tools/device.sh mutants [NAME...]`: copies of the library with one
check or fix taken out, each with the tests that must fail on it (and pass on the real
source): evidence that those tests guard the check. tests/test_tools.py applies each to a
copy on the CPU, so a mutant whose pattern no longer matches the source fails there.

    python3 tools/mutants.py list
    python3 tools/mutants.py apply NAME TREE     # edit the copy of the repository at TREE
    python3 tools/mutants.py tests NAME          # its pytest arguments, one per line
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# name -> (file, [(pattern, replacement), ...] each of which must match exactly once,
#          pytest arguments)
MUTANTS = {
    # The V masking past a context's end: 0 * stale NaN reaches the output without it.
    "stale-slots": ("cuda_src/paged_decode.cuh", [
        (r"\n      if \(valid < TT\) \{\n        C\* vz = .*?\n      \}\n", "\n"),
        (r"\n          if \(tt \+ X > valid\) \{.*?\n          \}\n", "\n"),
    ], ["tests/test_decode.py", "-k", "stale", "--maxfail=1000"]),
    # vLLM's v2 with a 16-bit tmp_out: float32 partials take two of its elements each.
    "v2-half-capacity": ("cupaged/validation.py", [
        (r"capacity = n_user // 2  # float32 partials in a 16-bit buffer",
         "capacity = n_user"),
    ], ["tests/test_decode.py", "-k", "half_precision_tmp_out"]),
    # Warps sharing rows: their merged states cover K's zero padding, which the next query
    # tile must clear again (a 72-dim head then reads NaN scores without it).
    "key-warps-padding": ("cuda_src/paged_prefill.cuh", [
        (r"\n    if constexpr \(KEY_WARPS > 1\) clear_k_padding\(\);\n", "\n"),
    ], ["tests/test_varlen.py", "-k", "undercount"]),
    # Head sizes over 256 on the wgmma kernel: each consumer's S is a partial over its half
    # of the dims; without the other's (here, for one score of every four) the scores are
    # wrong, which the 384/512 reference comparisons must catch.
    "split-o-partials": ("cuda_src/paged_prefill_sm90.cuh", [
        (r"s\[4 \* i\] \+= v\.x;", "(void)v.x;"),
    ], ["tests/test_prefill_sm90.py", "-k", "512 and matches_reference"]),
    # SoftCap(c, approx=True): tanh.approx's argument x ln2 / c; with x / c instead (the
    # ln2 / 2 of cap_in = 2 / c left out as 1 / 2) every curved logit moves, which the
    # bound test must see on every path.
    "tanh-approx-factor": ("cuda_src/variants.cuh", [
        (r"vp\.cap_in \* 0\.34657359027997264f", "vp.cap_in * 0.5f"),
    ], ["tests/test_variants.py", "-k", "tanh_approx", "--maxfail=1000"]),
    # A repeat's overlap check over out's bytes: an 8-bit query's out is twice its size.
    "out-bytes-of-the-query": ("cupaged/launch.py", [
        (r"\* p\.dtype\.itemsize,  # out's bytes \(its type\)", "* q.dtype.itemsize,"),
    ], ["tests/test_varlen_validation.py", "-k", "memo_spans"]),
}


def apply(name: str, tree: str) -> None:
    path, edits, _ = MUTANTS[name]
    p = Path(tree) / path
    s = p.read_text()
    for pattern, repl in edits:
        s, n = re.subn(pattern, repl, s, flags=re.S)
        if n != 1:
            raise SystemExit(f"mutant {name}: {pattern!r} matched {n} times in {path}")
    p.write_text(s)


if __name__ == "__main__":
    cmd = sys.argv[1:2]
    if cmd in (["-h"], ["--help"]):
        print(__doc__)
    elif cmd == ["list"]:
        print("\n".join(MUTANTS))
    elif cmd == ["apply"]:
        apply(sys.argv[2], sys.argv[3])
    elif cmd == ["tests"]:
        print("\n".join(MUTANTS[sys.argv[2]][2]))
    else:
        raise SystemExit(__doc__)
