"""Summary of tools/host_rounds.sh: per `cupaged-bench overhead` row, the min and median
over processes of the old and the new library, and new/old of the medians.
   python3 tools/host_rounds_summary.py OLD_FILES... -- NEW_FILES..."""

from __future__ import annotations

import re
import statistics
import sys

_ROW = re.compile(r"^(.*?)\s+(\d+\.\d+)\s*$")


def read(paths):
    rows: dict = {}
    for path in paths:
        for line in open(path):
            m = _ROW.match(line.rstrip())
            if m:
                rows.setdefault(m.group(1).strip(), []).append(float(m.group(2)))
    return rows


def main(argv):
    cut = argv.index("--")
    old, new = read(argv[:cut]), read(argv[cut + 1:])
    print(f"{'row':60s} {'old min':>8s} {'old med':>8s} {'new min':>8s} {'new med':>8s} "
          f"{'new/old':>8s}")
    for name in new:
        n = new[name]
        o = old.get(name)
        line = f"{name[:60]:60s} "
        line += (f"{min(o):8.1f} {statistics.median(o):8.1f} " if o else f"{'-':>8s} {'-':>8s} ")
        line += f"{min(n):8.1f} {statistics.median(n):8.1f} "
        line += f"{statistics.median(n) / statistics.median(o):8.2f}" if o else f"{'-':>8s}"
        print(line)
    print(f"({len(argv[:cut])} old and {len(argv[cut + 1:])} new processes, each pinned to one core)")


if __name__ == "__main__":
    main(sys.argv[1:])
