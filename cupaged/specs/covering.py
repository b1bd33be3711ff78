"""Pairwise covering sets: few rows in which every pair of values of any two axes occurs.

The compile check in CI uses one per kernel instead of every specialization: each value
of every axis and each pair of values is compiled at least once, and the row count grows
with the product of the two largest axes rather than of all of them.

The rows are chosen among the supported ones (``cover_pairs``), so combinations that do
not exist (an fp8 cache under float32 queries, say) never cost a row: greedily, the row
that covers the most pairs still missing first. The two largest axes' pairs are a lower
bound on any such set, and the greedy choice meets it on the catalog's kernels
(tests/test_geometry.py). It is deterministic: the same rows always give the same choice.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


def _pair_ids(rows: Sequence[Sequence]) -> tuple[np.ndarray, int]:
    """Each row's pairs of (axis, value) as integers, ``[len(rows), pairs per row]``, and
    how many integers there are (a single axis: its values stand for the pairs)."""
    n_axes = len(rows[0])
    codes = np.empty((len(rows), n_axes), np.int64)
    sizes = []
    for a in range(n_axes):
        ids: dict = {}
        codes[:, a] = [ids.setdefault(r[a], len(ids)) for r in rows]
        sizes.append(len(ids))
    if n_axes == 1:
        return codes, sizes[0]
    cols, offset = [], 0
    for a in range(n_axes):
        for b in range(a + 1, n_axes):
            cols.append(offset + codes[:, a] * sizes[b] + codes[:, b])
            offset += sizes[a] * sizes[b]
    return np.stack(cols, axis=1), offset


def cover_pairs(rows: Sequence[Sequence], keys: Sequence | None = None) -> list[int]:
    """Indices (ascending) of a few of ``rows``, tuples of axis values all of one length,
    in which every pair of values of any two axes that some row has occurs, and with
    ``keys`` (one hashable per row) every key too: the row with the most pairs and keys
    still missing first (of equals, the earliest at the time)."""
    if not rows:
        return []
    if len({len(r) for r in rows}) != 1 or not rows[0]:
        raise ValueError(f"rows must be tuples of one length, at least 1; got lengths "
                         f"{sorted({len(r) for r in rows})}")
    pids, n_ids = _pair_ids(rows)
    if keys is not None:  # each distinct key one more id to cover
        ids: dict = {}
        key_ids = [n_ids + ids.setdefault(k, len(ids)) for k in keys]
        pids = np.concatenate([pids, np.asarray(key_ids, np.int64)[:, None]], axis=1)
        n_ids += len(ids)
    missing = np.zeros(n_ids, bool)
    missing[pids.ravel()] = True
    left = int(missing.sum())
    # Gains only fall as rows are chosen. Level by level from the most a row can cover:
    # recount every row that may still reach the level, then take in order those whose
    # count, checked again just before, still does.
    bound = np.full(len(rows), pids.shape[1])
    chosen = []
    for level in range(pids.shape[1], 0, -1):
        if not left:
            break
        cand = np.flatnonzero(bound >= level)
        gains = missing[pids[cand]].sum(axis=1)
        bound[cand] = gains
        for i in cand[gains == level].tolist():
            gain = int(missing[pids[i]].sum())
            if gain == level:
                chosen.append(i)
                missing[pids[i]] = False
                left -= gain
            bound[i] = gain if gain < level else 0
    return sorted(chosen)


def cover_sets(sets: Sequence[frozenset]) -> list[int]:
    """Indices (ascending) of a few of ``sets`` whose union is the union of all: the set
    with the most elements still missing first, the earliest of equals."""
    left = set().union(*sets)
    chosen = []
    while left:
        best = max(range(len(sets)), key=lambda i: (len(sets[i] & left), -i))
        chosen.append(best)
        left -= sets[best]
    return sorted(chosen)


def covers_all_pairs(axes: Mapping[str, Sequence], rows: Sequence[Mapping]) -> bool:
    """Does every pair of values of any two axes occur in some row?"""
    names = list(axes)
    for x, n1 in enumerate(names):
        for n2 in names[x + 1:]:
            seen = {(r[n1], r[n2]) for r in rows}
            if any((a, b) not in seen for a in axes[n1] for b in axes[n2]):
                return False
    return True
