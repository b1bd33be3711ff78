"""Where a kernel's warps spend their time, from Nsight Compute's per-instruction warp
samples (tools/prefill_peer_profile.sh with SOURCE=1 writes the CSV): the samples of each
stretch of SASS between setmaxnreg instructions (a warp-specialized kernel's roles), its
stall reasons, and the instructions with the most samples.

    python tools/ncu_source_summary.py ncu-src-<impl>-<preset>.csv [top]
"""
from __future__ import annotations

import csv
import sys
from collections import Counter


def read(path: str):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"])
    names = rows[head]
    out = []
    for r in rows[head + 1:]:
        if len(r) != len(names):
            continue
        d = dict(zip(names, r))
        d["samples"] = int(d["Warp Stall Sampling (All Samples)"] or 0)
        out.append(d)
    return names, out


def stalls(d: dict, names) -> Counter:
    c = Counter()
    for n in names:
        if n.startswith("stall_") and "(Not Issued)" not in n:
            c[n[6:]] += int(d[n] or 0)
    return c


def main(path: str, top: int = 30) -> None:
    names, ins = read(path)
    total = sum(d["samples"] for d in ins) or 1
    # stretches: a new one at each setmaxnreg (USETMAXREG)
    parts, cur = [], {"from": ins[0]["Source"].strip() if ins else "", "samples": 0,
                      "stalls": Counter(), "n": 0}
    for d in ins:
        if "USETMAXREG" in d["Source"]:
            parts.append(cur)
            cur = {"from": d["Source"].strip(), "samples": 0, "stalls": Counter(), "n": 0}
        cur["samples"] += d["samples"]
        cur["stalls"] += stalls(d, names)
        cur["n"] += 1
    parts.append(cur)
    print(f"{total} samples, {len(ins)} instructions")
    for p in parts:
        reasons = ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in p["stalls"].most_common(6))
        print(f"- from '{p['from'][:40]}': {p['n']} instructions, "
              f"{100 * p['samples'] / total:.1f}% of samples ({reasons})")
    print(f"top {top} instructions:")
    for d in sorted(ins, key=lambda d: -d["samples"])[:top]:
        reasons = ", ".join(f"{k} {v}" for k, v in stalls(d, names).most_common(3) if v)
        print(f"  {d['Address'][-5:]} {100 * d['samples'] / total:5.2f}%  "
              f"{d['Source'].strip()[:60]:60s} {reasons}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
