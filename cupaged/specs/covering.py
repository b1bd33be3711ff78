"""Pairwise covering arrays: few rows in which every pair of values of any two axes occurs.

The compile check in CI uses one per kernel instead of the full product of its axes: every
value of every axis and every pair of values is compiled at least once, and the row count
grows with the product of the two largest axes rather than of all of them.

The construction is IPOG (Lei et al., 2007): start from every pair of the two largest
axes, then add one axis at a time, first choosing each existing row's new value to cover
the most uncovered pairs, then adding rows for the pairs still missing. It is
deterministic: the same axes always give the same rows.
"""

from __future__ import annotations

from itertools import product
from typing import Mapping, Sequence

_FREE = object()  # a cell no pair needs yet


def pairwise(axes: Mapping[str, Sequence]) -> list[dict]:
    """Rows (``{axis: value}``) covering every pair of values of any two axes."""
    names = sorted(axes, key=lambda n: -len(axes[n]))  # largest first: fewest rows
    values = [list(axes[n]) for n in names]
    if any(not v for v in values):
        return []
    if len(names) == 1:
        return [{names[0]: v} for v in values[0]]
    rows = [list(r) for r in product(values[0], values[1])]
    for k in range(2, len(names)):
        # Pairs (earlier axis j, its value index, this axis' value index) still uncovered.
        missing = {(j, a, b) for j in range(k) for a in range(len(values[j]))
                   for b in range(len(values[k]))}
        index = [{v: i for i, v in enumerate(vs)} for vs in values]

        def gain(row, b):
            return sum((j, index[j][row[j]], b) in missing
                       for j in range(k) if row[j] is not _FREE)

        for row in rows:  # horizontal growth
            best = max(range(len(values[k])), key=lambda b: (gain(row, b), -b))
            row.append(values[k][best])
            for j in range(k):
                if row[j] is not _FREE:
                    missing.discard((j, index[j][row[j]], best))
        for j, a, b in sorted(missing):  # vertical growth
            for row in rows:
                if row[k] == values[k][b] and row[j] is _FREE:
                    row[j] = values[j][a]
                    break
            else:
                row = [_FREE] * (k + 1)
                row[j], row[k] = values[j][a], values[k][b]
                rows.append(row)
    for i, row in enumerate(rows):  # cells no pair needed: any value, spread evenly
        for j, v in enumerate(row):
            if v is _FREE:
                row[j] = values[j][i % len(values[j])]
    return [dict(zip(names, r)) for r in rows]


def covers_all_pairs(axes: Mapping[str, Sequence], rows: Sequence[Mapping]) -> bool:
    """Does every pair of values of any two axes occur in some row?"""
    names = list(axes)
    for x, n1 in enumerate(names):
        for n2 in names[x + 1:]:
            seen = {(r[n1], r[n2]) for r in rows}
            if any((a, b) not in seen for a in axes[n1] for b in axes[n2]):
                return False
    return True
