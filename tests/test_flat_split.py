"""paged_decode's flat split (cuda_src/paged_decode.cuh, "the flat split") on the host: a
mirror of its arithmetic, statement by statement (the runs, the block-wide scan that finds
where a CTA's run starts, the walk of the run unit by unit, each piece's keys, partial slot
and counter, the merger's rows), checked over random batches: the runs partition the
tiles, every unit's tiles and keys are covered once, no slot is written twice in a launch,
and each cut unit's merger reads exactly the slots its pieces wrote. No GPU needed."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cupaged import _variants, launch, planning
from test_validation import KS, args, validate

NT = 128  # kDecodeThreads: the scan takes NT sequences a round
WARP = 32
I64 = 2**63


def _i64(x: int) -> int:
    """A long long of the kernel's: asserts it fits."""
    assert -I64 <= x < I64, x
    return x


def _i32(x: int) -> int:
    """static_cast<int> of a value below 2^32 (two's complement)."""
    x &= 0xFFFFFFFF
    return x - 2**32 if x >= 2**31 else x


def first_key(q_pos: int, window: int) -> int:
    """Variant::first_key (window 0: none)."""
    return max(0, q_pos - window + 1) if window else 0


def key_span(length: int, max_len: int, tt: int, window: int) -> tuple[int, int]:
    """The unit loop's (base, ctx) of a decode row: keys [lo, ctx) seen, tiles from base."""
    ctx = max(0, min(length, max_len))
    lo = min(first_key(ctx - 1, window), ctx)
    assert lo >= 0  # (C++ division truncates; Python's floors: the same from here on)
    return (lo // tt * tt if window else 0), ctx


def flat_tiles(length: int, max_len: int, tt: int, window: int) -> int:
    """flat_tiles: a sequence's key tiles in the flat split, at least one."""
    ctx = max(0, min(length, max_len))
    lo = min(first_key(ctx - 1, window), ctx)
    base = lo // tt * tt if window else 0
    assert ctx - base >= 0
    return max(1, (ctx - base) // tt + (1 if (ctx - base) % tt else 0))


class FlatRuns(NamedTuple):
    """FlatRuns: T = q G + r tiles, runs of q + 1 then of q."""

    q: int
    r: int

    def start(self, c: int) -> int:
        return _i64(_i64(c * self.q) + min(c, self.r))

    def owner(self, t: int) -> int:
        big = _i64(self.r * (self.q + 1))
        return t // (self.q + 1) if t < big else self.r + (t - big) // self.q


class Piece(NamedTuple):
    """One pass of a CTA: its unit (sequence, head tile) and what it writes."""

    cta: int
    seq: int
    y_tile: int
    f_lo: int  # the unit's tiles [f_lo, f_hi) done here
    f_hi: int
    f_unit: int  # the unit's first flat tile
    f_tiles: int
    begin: int  # its keys [begin, end)
    end: int
    n_tiles: int  # key tiles the pass loads
    parts: int  # the unit's pieces
    c0: int  # the CTA holding the unit's first tile, and its slot's k
    k0: int
    slot: int | None  # partial slot (None: written whole)
    counter: int | None  # counters[] index (None: never counts)

    def rows_read(self) -> list[int]:
        """The merger's row_of(p) over the pieces, in slots (rows slot * GT + g)."""
        return [2 * self.c0 + self.k0 if p == 0 else 2 * (self.c0 + p) for p in range(self.parts)]


def run_start(tiles: list[int], n_y: int, runs: FlatRuns, c: int):
    """The prologue of CTA c: its run [w_t, w_end) and the sequence it starts in
    (w_seq, whose units start at flat tile w_seq0, w_tiles tiles each); None when empty."""
    w_t, w_end = runs.start(c), runs.start(c + 1)
    if w_t >= w_end:
        return None
    target = w_t // n_y
    carry, q0, found = 0, 0, []
    num_seqs = len(tiles)
    while True:
        v = [tiles[q0 + i] if q0 + i < num_seqs else 0 for i in range(NT)]
        incl = list(v)  # the warps' inclusive scans by __shfl_up_sync
        o = 1
        while o < WARP:
            incl = [incl[i] + (incl[i - o] if i % WARP >= o else 0) for i in range(NT)]
            o <<= 1
        sums = [incl[w * WARP + WARP - 1] for w in range(NT // WARP)]  # sum_s
        for i in range(NT):
            excl = _i64(carry + sum(sums[: i // WARP]) + incl[i] - v[i])
            if q0 + i < num_seqs and excl <= target < excl + v[i]:
                found.append((q0 + i, _i32(excl >> 32), _i32(excl & 0xFFFFFFFF), v[i]))
        carry = _i64(carry + sum(sums))
        if carry > target or q0 + NT >= num_seqs:  # the same in every thread
            break
        q0 += NT
    assert len(found) == 1, f"CTA {c}: {len(found)} threads write found_s"
    w_seq, hi, lo, w_tiles = found[0]
    return w_t, w_end, w_seq, _i64(((hi << 32) | (lo & 0xFFFFFFFF)) * n_y), w_tiles


def flat_launch(lengths: list[int], max_len: int, tt: int, window: int, n_y: int,
                grid: int) -> tuple[FlatRuns, list[Piece]]:
    """Every CTA's walk of its run (the kernel's `for (int pass ...)` loop), as pieces."""
    tiles = [flat_tiles(n, max_len, tt, window) for n in lengths]
    total = _i64(sum(tiles) * n_y)
    runs = FlatRuns(total // grid, total % grid)
    pieces = []
    for c in range(grid):
        got = run_start(tiles, n_y, runs, c)
        if got is None:
            continue
        w_t, w_end, w_seq, w_seq0, w_tiles = got
        while w_t < w_end:
            in_seq = w_t - w_seq0
            assert 0 <= in_seq < n_y * w_tiles
            seq, y_tile = w_seq, in_seq // w_tiles
            f_lo = in_seq % w_tiles
            f_hi = min(w_tiles, f_lo + (w_end - w_t))
            f_unit, f_tiles = _i64(w_seq0 + y_tile * w_tiles), w_tiles
            w_t += f_hi - f_lo
            if f_hi == w_tiles and y_tile == n_y - 1 and w_t < w_end:  # the next sequence
                w_seq0 = _i64(w_seq0 + n_y * w_tiles)
                w_seq += 1
                w_tiles = flat_tiles(lengths[w_seq], max_len, tt, window)
            base, ctx = key_span(lengths[seq], max_len, tt, window)
            begin = base + f_lo * tt
            end = ctx if f_hi == f_tiles else base + f_hi * tt
            assert end - begin >= 0
            c0 = runs.owner(f_unit)
            k0 = 0 if runs.start(c0) == f_unit else 1
            parts = runs.owner(f_unit + f_tiles - 1) - c0 + 1
            whole = parts == 1
            pieces.append(Piece(
                c, seq, y_tile, f_lo, f_hi, f_unit, f_tiles, begin, end,
                (end - begin + tt - 1) // tt, parts, c0, k0,
                None if whole else 2 * c + (k0 if c0 == c else 0),
                None if whole else seq * n_y + y_tile))
    return runs, pieces


def check_flat_launch(lengths: list[int], max_len: int, tt: int, window: int, n_y: int,
                      grid: int, gt: int = 1, partial_rows: int | None = None,
                      counters: int | None = None) -> list[Piece]:
    """Run the mirror and assert what the kernel relies on; ``partial_rows``, ``counters``:
    the host's sizes (default plan_flat's: 2 G GT rows, a counter a unit)."""
    runs, pieces = flat_launch(lengths, max_len, tt, window, n_y, grid)
    tiles = [flat_tiles(n, max_len, tt, window) for n in lengths]
    total = sum(tiles) * n_y
    units = len(lengths) * n_y
    partial_rows = 2 * grid * gt if partial_rows is None else partial_rows
    counters = units if counters is None else counters

    # The runs partition [0, T): the first r one tile longer, owner() inverts start().
    starts = [runs.start(c) for c in range(grid + 1)]
    assert starts[0] == 0 and starts[grid] == total
    assert [b - a for a, b in zip(starts, starts[1:])] == \
        [runs.q + 1] * runs.r + [runs.q] * (grid - runs.r)
    for c in range(grid):
        if starts[c] < starts[c + 1]:
            assert runs.owner(starts[c]) == c and runs.owner(starts[c + 1] - 1) == c

    # Each CTA's pieces tile its run, in order.
    by_cta = defaultdict(list)
    for pc in pieces:
        by_cta[pc.cta].append(pc)
    for c in range(grid):
        spans = [(pc.f_unit + pc.f_lo, pc.f_unit + pc.f_hi) for pc in by_cta.get(c, [])]
        assert all(a < b for a, b in spans)
        flat = [t for a, b in spans for t in (a, b)]
        assert flat == sorted(flat)
        if spans:
            assert spans[0][0] == starts[c] and spans[-1][1] == starts[c + 1]
            assert all(b == a2 for (_, b), (a2, _) in zip(spans, spans[1:]))
        else:
            assert starts[c] == starts[c + 1]  # only an empty run has no piece

    # Each unit: where the lay-out puts it, its tiles and keys covered once, in pieces held
    # by consecutive CTAs that agree on c0, k0 and parts.
    by_unit = defaultdict(list)
    for pc in pieces:
        by_unit[pc.seq, pc.y_tile].append(pc)
    assert sorted(by_unit) == [(s, y) for s in range(len(lengths)) for y in range(n_y)]
    for (s, y), ps in by_unit.items():
        ps.sort(key=lambda pc: pc.f_lo)
        first = ps[0]
        assert first.f_unit == sum(tiles[:s]) * n_y + y * tiles[s] and first.f_tiles == tiles[s]
        assert {(pc.f_unit, pc.f_tiles, pc.c0, pc.k0, pc.parts) for pc in ps} == \
            {(first.f_unit, first.f_tiles, first.c0, first.k0, first.parts)}
        assert len(ps) == first.parts
        assert [pc.cta for pc in ps] == list(range(first.c0, first.c0 + first.parts))
        assert ps[0].f_lo == 0 and ps[-1].f_hi == first.f_tiles
        assert all(a.f_hi == b.f_lo for a, b in zip(ps, ps[1:]))
        base, ctx = key_span(lengths[s], max_len, tt, window)
        assert ps[0].begin == base and ps[-1].end == ctx and 0 <= base <= ctx <= max_len
        assert all(a.end == b.begin for a, b in zip(ps, ps[1:]))
        for pc in ps:  # the pass loads the tiles the count gave it (none for an empty row)
            assert pc.n_tiles == (0 if ctx == 0 else pc.f_hi - pc.f_lo)
        assert (first.parts == 1) == (first.slot is None)
        if first.parts == 1:
            assert all(pc.counter is None for pc in ps)
            continue
        # A cut unit: one counter, the merger's rows are its pieces' slots, piece by piece.
        assert {pc.counter for pc in ps} == {s * n_y + y} and s * n_y + y < counters
        for pc in ps:
            assert pc.rows_read() == [p.slot for p in ps]

    # Slots: each written at most once a launch, within the partial rows; the piece a
    # CTA's run starts with takes 2c, any other cut piece 2c + 1 and ends the run.
    slots = [pc.slot for pc in pieces if pc.slot is not None]
    assert len(slots) == len(set(slots))
    assert all(0 <= sl and sl * gt + gt - 1 < partial_rows for sl in slots)
    for pc in pieces:
        if pc.slot is None:
            continue
        if pc.f_unit + pc.f_lo == starts[pc.cta]:
            assert pc.slot == 2 * pc.cta
        else:
            assert pc.slot == 2 * pc.cta + 1 and pc.f_unit + pc.f_hi == starts[pc.cta + 1]
    assert all(pc.parts < 2**31 and pc.f_hi < 2**31 for pc in pieces)
    return pieces


# ---- random batches ---------------------------------------------------------------------------


@st.composite
def flat_batches(draw):
    tt = draw(st.sampled_from([32, 64, 128, 256]))
    bs = draw(st.sampled_from([1, 8, 16, 64, 256]))
    max_len = bs * draw(st.integers(1, 4 * tt // bs + 8))
    edges = st.sampled_from([0, 1, tt - 1, tt, tt + 1, max_len, max_len + 1, -1])
    n = draw(st.sampled_from([1, 2, 5, 40, NT + 1, 2 * NT + 44]))  # scan rounds: 1 to 3
    lengths = draw(st.lists(st.one_of(edges, st.integers(-3, max_len + tt)),
                            min_size=n, max_size=n))
    window = draw(st.one_of(st.just(0), st.integers(1, 2 * max_len + tt)))
    n_y = draw(st.integers(1, 6))
    grid = draw(st.integers(1, 80))
    gt = draw(st.sampled_from([1, 2, 4, 8]))
    return lengths, max_len, tt, window, n_y, grid, gt


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flat_batches())
@example(([1, 5, 0, 64], 256, 64, 0, 4, 396, 4))  # fewer tiles than CTAs: q = 0
@example(([100_000], 1 << 17, 64, 0, 1, 50, 1))  # each run inside one unit
@example(([64] * 300, 64, 64, 0, 2, 7, 2))  # units of one tile, three scan rounds
@example(([129] * 130, 256, 64, 0, 1, 131, 1))  # a unit's last tile alone in a run
def test_the_flat_split_writes_each_slot_once_and_merges_what_it_wrote(batch):
    """Random lengths (negative, zero, past the table, tile edges), windows, head tiles,
    grids (idle CTAs included) and tile sizes, up to three rounds of the scan."""
    lengths, max_len, tt, window, n_y, grid, gt = batch
    check_flat_launch(lengths, max_len, tt, window, n_y, grid, gt)


def test_the_checks_catch_a_slot_written_twice(monkeypatch):
    """A piece that ends a run given its CTA's start slot (2c) lands on the run's first
    piece's: the checks say so."""
    real = flat_launch

    def start_slots(*a):
        runs, pieces = real(*a)
        return runs, [pc if pc.slot is None else pc._replace(slot=pc.slot - pc.slot % 2)
                      for pc in pieces]

    monkeypatch.setitem(globals(), "flat_launch", start_slots)
    with pytest.raises(AssertionError):
        check_flat_launch([300, 300, 300], 512, 64, 0, 2, 4)


def test_flat_runs_stay_within_64_bits():
    """plan_flat's bound (tiles times CTAs below 2^62): start() and owner() at every run's
    ends, the largest products included, stay below 2^63."""
    for total in (2**62 // 3, 2**61 + 12345, 2**40 - 1):
        for grid in (1, 3, 1000, 2**20 + 7):
            runs = FlatRuns(total // grid, total % grid)
            for c in (0, 1, runs.r - 1, runs.r, runs.r + 1, grid - 1):
                if 0 <= c < grid:
                    a, b = runs.start(c), runs.start(c + 1)
                    assert runs.owner(a) == c == runs.owner(b - 1)
            assert runs.start(grid) == total


def test_found_s_holds_a_start_past_2_to_the_32():
    """The scan hands the run's first unit start through two int32 halves."""
    longest = 2**31 - 1025  # _checks.MAX_TOKENS
    pieces = check_flat_launch([longest] * 4, longest, 64, 0, 64, 3)
    assert max(pc.f_unit for pc in pieces) > 2**32


def test_plan_flat_sizes_hold_the_launch(monkeypatch):
    """The host's flat plan (partial rows, counters, grid) against the mirror of its
    launch: 32/8 heads at group tile 4 (two head tiles a KV head), 64 sequences."""
    ks = SimpleNamespace(**vars(KS), decode=None, combine=None, name="fake")
    monkeypatch.setattr(planning, "decode_kernels", lambda *a, **k: ks)
    p = validate(**args(seqs=64, heads=32, kv_heads=8, hs=128, bs=16, width=128))
    plan = planning.plan_decode(p, 2048, "flat", None)
    built = launch.build(None, None, p, plan, 0.1, True, 0, _variants.PLAIN, None)
    gt = planning.group_tile(4)
    n_y = 8 * -(-4 // gt)
    assert plan.grid[1:] == (1, 1) and plan.split_tokens == -64 and not built.takes_starts
    lengths = [(37 * s) % 2049 for s in range(64)]
    check_flat_launch(lengths, p.max_blocks * p.block_size, ks.tile_tokens, 0, n_y,
                      plan.grid[0], gt, built.scratch_rows, built.counters)


def _fake_kernels(monkeypatch):
    ks = SimpleNamespace(**vars(KS), decode=None, combine=None, name="fake")
    monkeypatch.setattr(planning, "decode_kernels", lambda *a, **k: ks)
    return ks


def test_a_workspace_of_the_rows_a_flat_launch_asks_for_keeps_it(monkeypatch):
    """cupaged.jax plans a call without a workspace, then again with a shared one of the
    rows its launch asks for (launch.workspace_rows), and a workspace holds rows // 2
    merge counters: the flat split counts in one a unit, so 32/32 heads at batch 64 (2048
    units, 396 CTAs' 792 partial rows) asks for the rows of its counters, and the second
    plan is the flat split again."""
    _fake_kernels(monkeypatch)
    for seqs, heads, kv_heads in ((64, 32, 32), (512, 8, 8), (64, 32, 8)):
        p = validate(**args(seqs=seqs, heads=heads, kv_heads=kv_heads, hs=128, bs=16,
                            width=128))
        plan = planning.plan_decode(p, 2048, "auto", None)
        assert plan.split_tokens == -seqs
        built = launch.build(None, None, p, plan, 0.1, True, 0, _variants.PLAIN, None)
        rows = launch.workspace_rows(built)
        assert rows >= built.scratch_rows and rows // 2 >= plan.counters
        ws = launch.Partials(1, 2, 3, max_rows=rows, counters=4, max_counters=rows // 2)
        assert planning.plan_decode(p, 2048, "auto", ws) == plan
    # The grid split's rows hold twice its counters already; no split asks for none.
    p = validate(**args(seqs=2, heads=8, kv_heads=2, hs=128, bs=16, width=128))
    plan = planning.plan_decode(p, 2048, "always", None)
    built = launch.build(None, None, p, plan, 0.1, True, 0, _variants.PLAIN, None)
    assert plan.split_tokens > 0 and launch.workspace_rows(built) == built.scratch_rows
    plan = planning.plan_decode(p, 2048, "never", None)
    assert launch.workspace_rows(launch.build(None, None, p, plan, 0.1, True, 0,
                                              _variants.PLAIN, None)) == 0


def test_flat_in_row_mode_runs_over_the_rows(monkeypatch):
    """Row mode (each row finds its sequence in query_start_loc) takes the flat split as
    decode does: its units are (row, head tile), the kernel's partition_tokens minus the
    row count, and the launch reads query_start_loc."""
    _fake_kernels(monkeypatch)
    p = validate(**args(seqs=64, heads=32, kv_heads=32, hs=128, bs=16, width=128))
    rows = planning.plan_decode(p, 2048, "flat", None, rows=True)
    assert rows == planning.plan_decode(p, 2048, "auto", None, rows=True)
    assert (rows.kind, rows.grid, rows.split_tokens, rows.counters) == \
        ("rows", (396, 1, 1), -64, 64 * 32)
    assert launch.build(None, None, p, rows, 0.1, True, 0, _variants.PLAIN, None).takes_starts
