"""Launch: a planned call as its kernel launches (:class:`Launch`: grids, split-KV,
every constant argument, so a repeated call adds only its arrays' addresses), the
split-KV partials (a :class:`DecodeWorkspace` or a scratch buffer per call), and the
prepared call the memo keeps (``_prepared``)."""

from __future__ import annotations

import struct
from typing import NamedTuple

import cupy
import numpy as np

from . import _arrays, _checks, _prepared, _variants, jit, planning
from .specs import geometry
from .validation import Problem, VariantArgs

_fail = _checks.fail


COMBINE_THREADS = 32  # kCombineThreads: one warp per (row, head)


# PagedKV (cuda_src/kv_layout.cuh), passed by value as the launch formats' braced fields
# (kv_args gives its constant ones).
_PAGED_KV = struct.Struct("@" + jit.PAGED_KV_FORMAT.strip("{}"))


assert _PAGED_KV.size == 128


class Partials(NamedTuple):
    """Where split-KV partials go: float32 part_out [rows, head_size], part_max [rows],
    part_sum [rows], rows = num_seqs * num_heads * partitions <= max_rows; and int32
    counters [max_counters], zeros that paged_decode leaves zero, with which the last
    partition of a (sequence, head tile) merges the others (0: none, the combine kernel
    merges)."""

    part_out: int
    part_max: int
    part_sum: int
    max_rows: int
    counters: int = 0
    max_counters: int = 0


class Launch(NamedTuple):
    """A call's kernel launches with everything but the arrays' addresses decided: the
    kernels, grids, split-KV and every constant argument, from metadata alone. ``run``
    adds the addresses; a repeated call reuses the rest (``_prepared``)."""

    kernel: jit.Launcher
    grid: tuple
    threads: int
    smem: int
    prefill: bool  # paged_prefill: its combine takes every partial row (no lengths)
    # Between the partials and the query: paged_prefill's split_tiles; paged_decode's
    # counters, null unless it merges its own split (then the call's: see run).
    head: tuple
    q_strides: tuple  # the query's token (sequence) and head strides, in elements
    kv_strides: tuple  # PagedKV between the cache pointers and the table: their strides
    kv_tail: tuple  # PagedKV after the table pointer
    tail: tuple  # after the lengths and query starts: ALiBi, the ints, the scale
    variants: _variants.Variants
    vp: bytes  # VariantParams with no lse (packed per call when there is one)
    split: bool = False  # split-KV: partials, merged by paged_decode itself or by `combine`
    combine: jit.Launcher | None = None  # merges the partials when the kernel does not
    combine_grid: tuple = ()
    combine_tail: tuple = ()  # after its lengths
    partials: Partials | None = None  # the workspace's; None: a scratch buffer per call
    scratch_rows: int = 0
    head_size: int = 0
    # Reads query_start_loc: paged_prefill, and paged_decode's row mode. paged_decode's
    # one-token-per-sequence mode gets null (a caller's starts are then not its business).
    takes_starts: bool = True

    def run(self, ctx: _arrays.Context, out: int, q: int, k: int, v: int, bt: int,
            lens: int, starts: int, lse: int = 0) -> None:
        """Launch on ``ctx.stream`` (``starts``, ``lse``: 0 for none)."""
        vp = self.vp if not lse else self.variants.pack(lse)
        if not self.takes_starts:
            starts = 0
        if not self.split:
            self.kernel(self.grid, self.threads, self.smem, ctx.stream, out, 0, 0, 0,
                        *self.head, q, *self.q_strides, k, v, *self.kv_strides, bt,
                        *self.kv_tail, lens, starts, *self.tail, vp)
            return
        # Without a combine kernel, paged_decode merges its partitions itself, counting in
        # the workspace's counters or in the scratch's.
        merges_here = self.combine is None
        parts, keep = self.partials, None
        if parts is None:
            parts, keep = scratch_partials(ctx, self.scratch_rows, self.head_size,
                                           self.grid[0] * self.grid[1] if merges_here else 0)
        po, pm, ps = parts.part_out, parts.part_max, parts.part_sum
        self.kernel(self.grid, self.threads, self.smem, ctx.stream, out, po, pm, ps,
                    *((parts.counters,) if merges_here else self.head), q, *self.q_strides,
                    k, v, *self.kv_strides, bt, *self.kv_tail, lens, starts, *self.tail, vp)
        if not merges_here:
            # paged_prefill writes every partial row, so its combine takes all (no lengths).
            self.combine(self.combine_grid, COMBINE_THREADS, 0, ctx.stream, out, po, pm, ps,
                         0 if self.prefill else lens, *self.combine_tail, vp)
        del keep  # the scratch is freed in the stream's order, after the launches


def kv_args(p: Problem) -> tuple:
    """PagedKV's constant fields (cuda_src/kv_layout.cuh): the caches' strides, then what
    follows the table pointer (its row stride, sizes, an fp8 cache's scales)."""
    c, q = p.cache, p.quant
    return (*c.k_strides, *c.v_strides), (p.bt_stride, p.max_blocks, p.num_blocks, q.k_ptr,
                                          q.v_ptr, q.block_stride, q.head_stride, q.k_value,
                                          q.v_value)


def decode_launch(p: Problem, scale: float, max_ctx: int, partition, alibi: int,
                  workspace: Partials | None = None, rows: bool = False, causal: bool = True,
             variants: _variants.Variants = _variants.PLAIN) -> Launch | None:
    """The launches of paged_decode (and its combine) for a validated problem; None when
    there is nothing to launch. ``rows``: one CTA per query row, each finding its sequence
    in ``query_start_loc`` (attention's row mode). ``workspace``: where split-KV partials
    go, else a scratch buffer per call. ``alibi``: the slopes' address or 0."""
    if p.num_seqs == 0 or p.num_rows == 0:
        return None
    group = p.num_heads // p.num_kv_heads
    gt = planning.group_tile(group)
    ks = planning.decode_kernels(p.device, p.dtype.name, p.head_size, p.block_size, gt,
                                 p.cache.kv_format, p.cache.dtype.name, p.quant.mode,
                                 variants.letters)
    vp = _variants.PLAIN_BYTES if variants is _variants.PLAIN else variants.pack()
    if variants.window:  # the partitions cover the window (from a tile before it) only
        max_ctx = min(max_ctx, variants.window + ks.tile_tokens)
    grid_y = p.num_kv_heads * -(-group // gt)
    if grid_y > _checks.MAX_GRID_YZ:
        _fail(f"num_kv_heads * head tiles = {grid_y} exceeds the grid limit {_checks.MAX_GRID_YZ}")
    size, smem = planning.partition_tokens(partition, p, max_ctx, p.num_rows * grid_y, ks)
    # Partials without counters (vLLM's v2 buffers) are merged by the combine kernel,
    # which takes a row per sequence: row mode then runs a single pass.
    if size and rows and workspace is not None and workspace.max_counters < p.num_rows * grid_y:
        size, smem = 0, planning.residency(p.num_rows * grid_y, ks).smem
    if size and workspace is not None:
        fitted = planning.fit_partitions(size, partition, p, max_ctx, workspace.max_rows,
                                         max(ks.tile_tokens, p.block_size))
        if fitted != size:  # fewer partitions: a smaller grid, perhaps another residency
            size = fitted
            grid = p.num_rows * grid_y * planning.partition_count(max_ctx, size)
            smem = planning.residency(grid, ks).smem
    n_parts = planning.partition_count(max_ctx, size)
    kv_strides, kv_tail = kv_args(p)
    launch = Launch(ks.decode, (p.num_rows, grid_y, n_parts), geometry.DECODE_THREADS, smem,
                    False, (0,), p.q_strides, kv_strides, kv_tail,
                    (alibi, p.num_heads, group, p.num_seqs, int(causal), size,
                     scale * _checks.LOG2E), variants, vp, takes_starts=rows)
    if not size:
        return launch
    launch = launch._replace(split=True, partials=workspace,
                             scratch_rows=p.num_rows * p.num_heads * n_parts,
                             head_size=p.head_size)
    # The last partition of each (sequence, head tile) merges, counting in the workspace's
    # counters or the scratch's; partials without counters (vLLM's v2 buffers) go through
    # the combine kernel.
    if workspace is None or workspace.max_counters >= p.num_rows * grid_y:
        return launch
    return launch._replace(combine=ks.combine, combine_grid=(p.num_seqs, p.num_heads, 1),
                           combine_tail=(p.max_blocks * p.block_size, size, n_parts,
                                         ks.tile_tokens))


def scratch_partials(ctx: _arrays.Context, rows: int, head_size: int,
                     counters: int = 0) -> tuple:
    """``(partials, owner)``: a scratch buffer for ``rows`` partial rows and ``counters``
    zeroed merge counters (one allocation carved by address: slicing costs microseconds),
    and its owner to keep alive until the launches are enqueued."""
    nbytes = rows * (head_size + 2) * 4
    base, keep = _arrays.scratch(ctx, nbytes + counters * 4)
    if counters:
        cupy.cuda.runtime.memsetAsync(base + nbytes, 0, counters * 4, ctx.stream)
    return Partials(base, base + rows * head_size * 4, base + rows * (head_size + 1) * 4,
                    rows, base + nbytes if counters else 0, counters), keep


def workspace_partials(workspace, p: Problem) -> Partials | None:
    """The split-KV scratch of a ``workspace=`` argument: a DecodeWorkspace's, sized for
    ``p``; partials the vLLM v2 entry point built from its own buffers; or None."""
    if isinstance(workspace, DecodeWorkspace):
        return workspace._partials(p)
    if workspace is not None and not isinstance(workspace, Partials):
        _fail(f"workspace must be a cupaged.DecodeWorkspace, got {type(workspace).__name__}",
              TypeError)
    return workspace


def workspace_key(workspace):
    """The memo key of a ``workspace=`` argument: what its partials' addresses follow
    from (an unknown kind: not keyed, so the validating path names it)."""
    if workspace is None or isinstance(workspace, Partials):
        return workspace
    if isinstance(workspace, DecodeWorkspace):
        return ("DecodeWorkspace", workspace._base, workspace.rows, workspace.head_size,
                workspace.device)
    return _prepared.UNKEYED


def prepared_call(launch: Launch | None, p: Problem, q, o, va: VariantArgs,
                  lse, kind: str) -> _prepared.Prepared:
    """A validated call as the memo keeps it (``q``, ``o``, ``lse``: the adapted query,
    out and lse arrays, or None; ``kind``: the caller's framework)."""
    return _prepared.Prepared(
        launch, p.device, kind, q.shape, q.dtype, _prepared.span(q),
        q.shape[0] * q.shape[1] * q.shape[2] * p.dtype.itemsize,
        o is not None and o.strides == q.strides, va.wants_lse,
        (p.num_rows, p.num_heads) if va.wants_lse and lse is None else ())


class DecodeWorkspace:
    """Scratch memory for split-KV decode, allocated once. Passed as ``workspace=``, it
    makes :func:`cupaged.paged_attention` and :func:`cupaged.attention` allocate nothing when
    ``out=`` is given too: what CUDA graph capture needs, and a saving for any loop.

    It holds ``rows`` partial results (float32, ``head_size + 2`` each) and ``rows // 2``
    int32 counters with which the kernel merges its own partitions (zero between calls;
    a call leaves them zero, so graph replays start clean). A call with
    ``num_seqs`` sequences of ``num_heads`` heads splits each into at most
    ``rows // (num_seqs * num_heads)`` partitions: fewer than ``partition="auto"`` would
    pick means larger partitions, never a different result; an explicit partition size
    that does not fit raises. The default ``rows`` covers what ``"auto"`` picks on this
    device (it splits into at most about 8 waves of CTAs, each serving up to 8 heads) and
    ``"always"`` at ``max_num_seqs``.

    Args:
        max_num_seqs, num_heads, head_size: the largest batch, the query heads and the
            head size the workspace will serve.
        rows: capacity in partial rows, instead of the default.
        device: CUDA device id; default the current CuPy device.

    A workspace serves one call at a time: calls on different streams need their own.
    """

    def __init__(self, max_num_seqs: int, num_heads: int, head_size: int, *, rows=None,
                 device=None):
        for name, v in (("max_num_seqs", max_num_seqs), ("num_heads", num_heads)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                _fail(f"{name} must be a positive int, got {v!r}")
        _checks.check_head_size(head_size)
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        if rows is None:
            sms = planning.device_info(self.device).sm_count
            rows = max(2 * max_num_seqs * num_heads, 9 * 4 * sms * 8)
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows <= 0:
            _fail(f"rows must be a positive int, got {rows!r}")
        self.rows, self.head_size = int(rows), head_size
        # A split has at least two partitions per head, so rows // 2 counters cover every
        # (sequence, head tile) of a split that fits.
        self._num_counters = self.rows // 2
        # One allocation, partial rows then counters: every address a prepared call embeds
        # follows from its base, which is what the memo keys a workspace by
        # (workspace_key). Two allocations could come back from the pool as a recycled
        # partial buffer beside a new counter array, and a remembered launch would then
        # count in freed memory.
        self._counters_offset = self.rows * (head_size + 2) * 4
        with _arrays.on_device(self.device):
            self._buf = cupy.empty(self._counters_offset + self._num_counters * 4,
                                   dtype=np.uint8)
            self._buf[self._counters_offset:].fill(0)
            # Zeroed before any launch can read them, whichever stream it is on.
            cupy.cuda.get_current_stream().synchronize()
        self._by_head_size = {}
        self._base = self._buf.data.ptr
        self._counters = self._buf[self._counters_offset:].view(np.int32)  # (a view, for tests)

    @property
    def nbytes(self) -> int:
        return self._buf.nbytes

    def _partials(self, p: Problem) -> Partials:
        if p.device != self.device:
            _fail(f"the workspace is on device {self.device} but query is on device {p.device}")
        if p.head_size > self.head_size:
            _fail(f"the workspace was made for head_size {self.head_size}, got {p.head_size}")
        got = self._by_head_size.get(p.head_size)
        if got is None:  # part_out first, then max and sum, as the kernels index them
            rows = self.rows * (self.head_size + 2) // (p.head_size + 2)
            b = self._base
            got = Partials(b, b + rows * p.head_size * 4, b + rows * (p.head_size + 1) * 4, rows,
                           b + self._counters_offset, self._num_counters)
            self._by_head_size[p.head_size] = got
        return got

    def __repr__(self) -> str:
        return (f"DecodeWorkspace(rows={self.rows}, head_size={self.head_size}, "
                f"device={self.device}, {self.nbytes / 2**20:.1f} MiB)")


def prefill_launch(q, o, p: Problem, plan: planning.Plan, scale: float, causal: bool,
                   alibi: int, variants: _variants.Variants = _variants.PLAIN,
                     max_q: int = 0, max_ctx: int = 0,
                     workspace: Partials | None = None) -> Launch:
    """paged_prefill's launches (and the combine of its split-KV) for a validated call
    (``q``, ``o``: the adapted query and out, or None for a new out)."""
    if q.data.ptr % 16 or q.strides[0] % 16 or q.strides[1] % 16:
        _fail(f"query must be 16-byte aligned with token and head strides that are multiples "
              f"of 16 bytes for multi-token {p.dtype.name} attention (pointer "
              f"{q.data.ptr:#x}, strides {q.strides})")
    if o is not None and o.data.ptr % 4:
        _fail(f"out must be 4-byte aligned (pointer {o.data.ptr:#x})")
    # ALiBi and the soft-cap's fixed offset are compile-time variants of this kernel only.
    letters = _variants.prefill_letters(variants, p.dtype.name, bool(alibi))
    k = planning.prefill_kernel(p.device, p.dtype.name, p.head_size, p.block_size,
                                p.cache.kv_format, plan.tile, p.cache.dtype.name, p.quant.mode,
                                letters)
    vp = _variants.PLAIN_BYTES if variants is _variants.PLAIN else variants.pack()
    size, n_parts = planning.prefill_split(k, p, plan, max_q, max_ctx, variants, workspace)
    kv_strides, kv_tail = kv_args(p)
    # Grid x is (sequence, KV head), y the query tiles, heaviest first (the kernel's
    # header), z the split-KV partitions.
    launch = Launch(
        k.launch, (p.num_seqs * p.num_kv_heads, plan.q_tiles, n_parts), k.threads, k.smem,
        True, (size // k.tile_tokens,), p.q_strides, kv_strides, kv_tail,
        (alibi, p.num_heads, p.num_heads // p.num_kv_heads, int(causal),
         scale * _checks.LOG2E), variants, vp)
    if n_parts == 1:
        return launch
    # (The combine is loaded here, not with the kernel: most multi-token calls never split.)
    return launch._replace(
        split=True, combine=planning.combine_kernel(p.device, p.dtype.name, p.head_size),
        combine_grid=(p.num_rows, p.num_heads, 1), combine_tail=(0, size, n_parts, k.tile_tokens),
        partials=workspace, scratch_rows=p.num_rows * p.num_heads * n_parts,
        head_size=p.head_size)


def attention_launch(q, o, p: Problem, plan: planning.Plan, scale: float, causal: bool,
                     alibi: int, variants: _variants.Variants, max_q: int, max_ctx: int,
                     workspace: Partials | None) -> Launch | None:
    """The launches of a planned :func:`cupaged.attention` call (None: nothing to launch):
    the builder of the kernel ``plan.kind`` names."""
    if not (p.num_seqs and p.num_rows):
        return None
    if plan.kind == "prefill":
        return prefill_launch(q, o, p, plan, scale, causal, alibi, variants, max_q, max_ctx,
                              workspace)
    return decode_launch(p, scale, max_ctx, "auto", alibi, workspace, rows=plan.kind == "rows",
                         causal=causal, variants=variants)
