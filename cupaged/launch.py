"""Launch: a planned call as its kernel launches (:class:`Launch`: grids, split-KV,
every constant argument, so a repeated call adds only its arrays' addresses), the
split-KV partials (a :class:`DecodeWorkspace` or a scratch buffer per call), and the
prepared call the memo keeps (``_prepared``)."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, NamedTuple

import cupy
import numpy as np

from . import _arrays, _checks, _prepared, _variants, jit, tensormap
from .specs import geometry
from .validation import Problem, VariantArgs

if TYPE_CHECKING:
    from .planning import KernelPlan, SparseWidening

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
    prefill: bool  # multi-token: its combine takes the query starts (no lengths)
    # Between the partials and the query: paged_prefill's split_tiles (paged_prefill_sm90's
    # split_tiles, num_seqs, ranks); paged_decode's counters, null unless it merges its own
    # split (then the call's: see run).
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
    combine_tail: tuple = ()  # after its lengths and query starts
    partials: Partials | None = None  # the workspace's; None: a scratch buffer per call
    scratch_rows: int = 0
    head_size: int = 0
    counters: int = 0  # merge counters paged_decode counts in when it merges its split
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
            parts, keep = scratch_partials(ctx, *self.scratch_need())
        po, pm, ps = parts.part_out, parts.part_max, parts.part_sum
        self.kernel(self.grid, self.threads, self.smem, ctx.stream, out, po, pm, ps,
                    *((parts.counters,) if merges_here else self.head), q, *self.q_strides,
                    k, v, *self.kv_strides, bt, *self.kv_tail, lens, starts, *self.tail, vp)
        if not merges_here:
            # The multi-token kernels write every partial row of a sequence, so their
            # combine takes all (no lengths) but the rows outside the query starts.
            self.combine(self.combine_grid, COMBINE_THREADS, 0, ctx.stream, out, po, pm, ps,
                         *((0, starts) if self.prefill else (lens, 0)), *self.combine_tail,
                         vp)
        del keep  # the scratch is freed in the stream's order, after the launches

    def scratch_need(self) -> tuple | None:
        """scratch_partials' ``(rows, width, counters)`` of the scratch each call allocates
        (a split without a workspace; counters where paged_decode merges its split
        itself), or None where a call allocates none."""
        if not self.split or self.partials is not None:
            return None
        return self.scratch_rows, self.head_size, self.counters if self.combine is None else 0


def kv_args(p: Problem) -> tuple:
    """PagedKV's constant fields (cuda_src/kv_layout.cuh): the caches' strides, then what
    follows the table pointer (its row stride, sizes, an fp8 cache's scales)."""
    c, q = p.cache, p.quant
    return (*c.k_strides, *c.v_strides), (p.bt_stride, p.max_blocks, p.num_blocks, q.k_ptr,
                                          q.v_ptr, q.block_stride, q.head_stride, q.k_value,
                                          q.v_value)


def scratch_layout(rows: int, head_size: int, counters: int = 0) -> tuple:
    """scratch_partials' one allocation: ``(bytes, part_max, part_sum, counters)``, the
    last three as offsets from its base (part_out is at the base)."""
    nbytes = rows * (head_size + 2) * 4
    return (nbytes + counters * 4, rows * head_size * 4, rows * (head_size + 1) * 4,
            nbytes)


def scratch_partials(ctx: _arrays.Context, rows: int, head_size: int,
                     counters: int = 0) -> tuple:
    """``(partials, owner)``: a scratch buffer for ``rows`` partial rows and ``counters``
    zeroed merge counters (one allocation carved by address: slicing costs microseconds),
    and its owner to keep alive until the launches are enqueued."""
    nbytes, at_max, at_sum, at_counters = scratch_layout(rows, head_size, counters)
    base, keep = _arrays.scratch(ctx, nbytes)
    if counters:
        cupy.cuda.runtime.memsetAsync(base + at_counters, 0, counters * 4, ctx.stream)
    return Partials(base, base + at_max, base + at_sum, rows,
                    base + at_counters if counters else 0, counters), keep


def workspace_rows(ln: Launch) -> int:
    """The ``rows`` of a DecodeWorkspace that holds a launch's split-KV partials and, where
    paged_decode merges them itself, its merge counters (a workspace has ``rows // 2``: a
    grid split's partial rows are at least twice its counters, while the flat split counts
    in one a unit, more than its rows' half where the units outnumber its CTAs' head
    tiles); 0 for a launch that does not split."""
    if not ln.split:
        return 0
    return max(ln.scratch_rows, 2 * ln.counters if ln.combine is None else 0)


def mla_workspace_partials(workspace, device: int, rank: int) -> Partials | None:
    """An MLA call's ``workspace=`` argument: None, or a DecodeWorkspace's partials
    ``rank`` wide on ``device`` (a TypeError for anything else)."""
    if workspace is None:
        return None
    if not isinstance(workspace, DecodeWorkspace):
        _fail(f"workspace must be a cupaged.DecodeWorkspace, got {type(workspace).__name__}",
              TypeError)
    return workspace.partials(device, rank)


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
                  lse, kind: str, disjoint: tuple) -> _prepared.Prepared:
    """A validated call as the memo keeps it (``q``, ``o``, ``lse``: the adapted query,
    out and lse arrays, or None; ``kind``: the caller's framework; ``disjoint``:
    validation.outputs_apart's pairs)."""
    return _prepared.Prepared(
        launch, p.device, kind, q.shape, q.dtype, _prepared.span(q),
        q.shape[0] * q.shape[1] * q.shape[2] * p.dtype.itemsize,  # out's bytes (its type)
        o is not None and o.strides == q.strides, va.wants_lse,
        (p.num_rows, p.num_heads) if va.wants_lse and lse is None else (), disjoint)


class DecodeWorkspace:
    """Scratch memory for split-KV, allocated once. Passed as ``workspace=``, it makes
    :func:`cupaged.paged_attention`, :func:`cupaged.attention` (and an ``AttentionPlan``),
    :func:`cupaged.mla_attention` and :func:`cupaged.sparse_mla_attention` allocate
    nothing when ``out=`` (and ``lse=`` where
    the lse is asked for) is given too: what CUDA graph capture needs, and a saving for
    any loop.

    Its partials are per query row and head. It holds ``rows`` of them (float32,
    ``head_size + 2`` each) and ``rows // 2`` int32 counters with which the decode kernel
    merges its own partitions (zero between calls; a call leaves them zero, so graph
    replays start clean). A call with ``R`` query rows (``num_seqs`` for
    ``paged_attention``; ``total_q`` for ``attention`` and ``mla_attention``) of
    ``num_heads`` heads splits each row and head into at most ``rows // (R * num_heads)``
    partitions (more rows fit at a smaller head size than its own): fewer than the
    planner (``partition="auto"``) would pick means larger partitions: the same attention,
    summed in longer passes (past planning.MAX_PASS_TOKENS keys, with more rounding); an
    explicit partition size that does not fit raises. The default ``rows``,
    ``max(2 * max_num_seqs * num_heads, 288 * SMs)``, covers what ``"auto"`` picks in
    decode on this device (it splits into at most about 8 waves of CTAs, each serving up
    to 8 heads) and ``"always"`` at ``max_num_seqs`` rows.

    Args:
        max_num_seqs: the most query rows a call will have: sequences for
            ``paged_attention`` and decode steps (one row each), ``total_q`` (every
            sequence's query tokens together) for multi-token ``attention`` steps and
            for :func:`cupaged.mla_attention`, the query tokens (``batch * s_q``) for
            :func:`cupaged.sparse_mla_attention`.
        num_heads, head_size: the call's query heads, and the head size the workspace
            will serve (512 for :func:`cupaged.mla_attention` and
            :func:`cupaged.sparse_mla_attention`, whose partials are kv_lora_rank wide).
        rows: capacity in partial rows, instead of the default.
        device: CUDA device id; default the current CuPy device.

    A workspace serves one call at a time: calls on different streams need their own.
    """

    def __init__(self, max_num_seqs: int, num_heads: int, head_size: int, *, rows=None,
                 device=None):
        for name, v in (("max_num_seqs", max_num_seqs), ("num_heads", num_heads)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                _fail(f"{name} must be a positive int, got {v!r}")
        if head_size != MLA_PARTIAL_WIDTH or not isinstance(head_size, (int, np.integer)):
            _checks.check_head_size(head_size)
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        if rows is None:
            sms = cupy.cuda.runtime.getDeviceProperties(self.device)["multiProcessorCount"]
            rows = max(2 * max_num_seqs * num_heads, 9 * 4 * sms * 8)
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows <= 0:
            _fail(f"rows must be a positive int, got {rows!r}")
        self.rows, self.head_size = int(rows), head_size
        # A grid split has at least two partitions per head, so rows // 2 counters cover
        # every (sequence, head tile) of one that fits; the flat split needs one a unit
        # whatever its rows (plan_flat checks both, workspace_rows asks for both).
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
            # Zeroed before any launch can read them, whichever stream it is on (a memset:
            # no kernel to compile).
            stream = cupy.cuda.get_current_stream()
            cupy.cuda.runtime.memsetAsync(self._buf.data.ptr + self._counters_offset, 0,
                                          self._num_counters * 4, stream.ptr)
            stream.synchronize()
        self._by_head_size = {}
        self._base = self._buf.data.ptr
        self._counters = self._buf[self._counters_offset:].view(np.int32)  # (a view, for tests)

    @property
    def nbytes(self) -> int:
        return self._buf.nbytes

    def _partials(self, p: Problem) -> Partials:
        return self.partials(p.device, p.head_size)

    def partials(self, device: int, head_size: int) -> Partials:
        """Its memory as partial rows ``head_size`` wide, for a call on ``device``."""
        if device != self.device:
            _fail(f"the workspace is on device {self.device} but query is on device {device}")
        if head_size > self.head_size:
            _fail(f"the workspace was made for head_size {self.head_size}, got {head_size}")
        got = self._by_head_size.get(head_size)
        if got is None:  # part_out first, then max and sum, as the kernels index them
            rows = self.rows * (self.head_size + 2) // (head_size + 2)
            b = self._base
            got = Partials(b, b + rows * head_size * 4, b + rows * (head_size + 1) * 4, rows,
                           b + self._counters_offset, self._num_counters)
            self._by_head_size[head_size] = got
        return got

    def __repr__(self) -> str:
        return (f"DecodeWorkspace(rows={self.rows}, head_size={self.head_size}, "
                f"device={self.device}, {self.nbytes / 2**20:.1f} MiB)")


def build(q, o, p: Problem, plan: KernelPlan | None, scale: float, causal: bool, alibi: int,
          variants: _variants.Variants, workspace: Partials | None) -> Launch | None:
    """The launches of a planned call: the kernel's arguments packed, every one but the
    arrays' addresses (None: nothing to launch). ``q``, ``o``: the adapted query and out
    (or None), whose alignment the multi-token kernel needs; ``alibi``: the slopes'
    address or 0; ``workspace``: where split-KV partials go (None: a scratch buffer per
    call)."""
    if plan is None:
        return None
    group = p.num_heads // p.num_kv_heads
    if plan.kind == "prefill":
        if q.data.ptr % 16 or q.strides[0] % 16 or q.strides[1] % 16:
            _fail(f"query must be 16-byte aligned with token and head strides that are "
                  f"multiples of 16 bytes for multi-token {q.dtype} attention (pointer "
                  f"{q.data.ptr:#x}, strides {q.strides})")
        if o is not None and o.data.ptr % 4:
            _fail(f"out must be 4-byte aligned (pointer {o.data.ptr:#x})")
        tail = (alibi, p.num_heads, group, int(causal), scale * _checks.LOG2E)
    else:
        tail = (alibi, p.num_heads, group, p.num_seqs, int(causal), plan.split_tokens,
                scale * _checks.LOG2E)
    vp = _variants.PLAIN_BYTES if variants is _variants.PLAIN else variants.pack()
    kv_strides, kv_tail = kv_args(p)
    split = bool(plan.split_tokens)
    # The plan's combine is None (and its grid and tail empty) for a single pass, and for a
    # split paged_decode merges itself.
    return Launch(plan.kernel, plan.grid, plan.threads, plan.smem, plan.kind == "prefill",
                  plan.head, p.q_strides, kv_strides, kv_tail, tail, variants, vp,
                  split=split, combine=plan.combine, combine_grid=plan.combine_grid,
                  combine_tail=plan.combine_tail, partials=workspace if split else None,
                  scratch_rows=(plan.partial_rows or p.num_rows * p.num_heads * plan.partitions)
                  if split else 0, head_size=p.head_size if split else 0,
                  counters=plan.counters or plan.grid[0] * plan.grid[1],
                  takes_starts=plan.kind != "decode")


MLA_PARTIAL_WIDTH = 512  # mla_attention's partial rows: kv_lora_rank wide


# The sparse kernels' second cache as they take it (mla_common.cuh's
# MlaSparseExtra): its latent and rotary base addresses, its indices' and lengths'
# addresses (0: none), its block and token strides and its indices' row stride (elements),
# topk, slots and log2 of its block size; all zeros without a second cache.
SPARSE_EXTRA = struct.Struct("<QQQQqqqiii4x")
NO_SPARSE_EXTRA = bytes(SPARSE_EXTRA.size)


# mla_attention_sm90's tensor maps as it takes them (mla_attention_sm90.cuh's MlaTma): the
# latent part's map, the rotary part's, then `use` (int32), padded to the struct's 64-byte
# alignment; all zeros: no maps (every tile copied by cp.async).
MLA_TMA = struct.Struct(f"<{tensormap.SIZE}s{tensormap.SIZE}si60x")
NO_MLA_TMA = bytes(MLA_TMA.size)


class MlaTmaMaps:
    """The MlaTma bytes of the caches an MlaLaunch reads, made once an address pair
    (``tensormap.encode_tiled``; a pair the driver refuses, or whose addresses or strides
    are not multiples of 128 bytes, gets NO_MLA_TMA, and the kernel copies by cp.async):
    each part a tensor of [num_blocks][block_size][its dims] with
    boxes of 64 dims x min(block_size, 64) tokens x 1 block. ``c_strides``: the parts'
    block and token strides in elements, as MlaProblem's."""

    _KEEP = 1024  # address pairs kept (a serving loop reads one cache a layer, each its own)

    def __init__(self, dtype: str, itemsize: int, dims: tuple, block_size: int,
                 num_blocks: int, c_strides: tuple):
        self._args = (dtype, itemsize, dims, block_size, num_blocks, c_strides)
        self._made: dict = {}

    def __call__(self, lat: int, rope: int) -> bytes:
        made = self._made.get((lat, rope))
        if made is None:
            if len(self._made) >= self._KEEP:
                self._made.clear()
            made = self._made[(lat, rope)] = self._encode(lat, rope)
        return made

    def _encode(self, lat: int, rope: int) -> bytes:
        dtype, isz, dims, bs, nb, st = self._args
        # The 128-byte swizzle wants the tensor's base and strides 128-byte aligned (the
        # CUDA programming guide's TMA swizzle rules; the driver checks 16): others copy
        # by cp.async.
        if (lat | rope) % 128 or any(x * isz % 128 for x in st):
            return NO_MLA_TMA
        maps = []
        for i, addr in enumerate((lat, rope)):
            block, token = st[2 * i] * isz, st[2 * i + 1] * isz
            maps.append(tensormap.encode_tiled(dtype, addr, (dims[i], bs, nb), (token, block),
                                               (64, min(bs, 64), 1)))
        if None in maps:
            return NO_MLA_TMA
        return MLA_TMA.pack(maps[0], maps[1], 1)


class MlaLaunch(NamedTuple):
    """An mla_attention call's launches with every constant argument packed: ``run``
    adds the addresses (a repeated call's only work), taking them as :meth:`Launch.run`
    does (``_prepared.run`` calls either)."""

    kernel: jit.Launcher
    grid: tuple
    smem: int
    split_tiles: int
    row_tiles: int  # grid x is num_seqs * row_tiles
    q_strides: tuple  # latent token / head, rope token / head (elements)
    q_offsets: tuple  # bytes from each query array's pointer to its part
    c_strides: tuple  # latent block / token, rope block / token (elements)
    c_offsets: tuple
    table: tuple  # block_tables' row stride, max_blocks, num_blocks, the fp8 scale (pointer,
    #               value)
    tail: tuple  # num_heads, causal, scale * log2(e) (sparse: then lengths_per, strict)
    combine: jit.Launcher | None
    combine_grid: tuple
    combine_tail: tuple
    scratch_rows: int  # split-KV partial rows (total_q * num_heads * partitions)
    rank: int
    partials: Partials | None = None  # a workspace's; None: a scratch buffer per call
    variants: _variants.Variants = _variants.PLAIN  # sparse: attn_sink
    vp: bytes = _variants.PLAIN_BYTES  # their VariantParams with no lse
    # the arguments between the tail and VariantParams: (NO_SPARSE_EXTRA,) for a sparse
    # kernel without a second cache, () for the kernels that take none
    extra: tuple = ()
    # a sparse kernel's second cache, when it reads one: its constants (block and token
    # strides, indices' row stride, topk, slots, log2 of the block size), packed with its
    # addresses at each call
    extra_consts: tuple = ()
    # mla_attention_sm90's tensor maps: MlaTmaMaps where the kernel copies tiles by TMA,
    # NO_MLA_TMA where it takes the parameter but not maps, None where it takes none
    tma: MlaTmaMaps | bytes | None = None

    def run(self, ctx: _arrays.Context, out: int, q: tuple, c_lat: int, c_rope: int, bt: int,
            lens: int, starts: int, lse: int = 0, extra: tuple = ()) -> None:
        """Launch on ``ctx.stream``: ``q`` the query's (latent, rope) base addresses, and
        ``c_lat``, ``c_rope`` the caches' (a single q's or combined cache's twice: the
        offsets find its parts); ``starts``, ``lse``: 0 for none; ``extra``: the sparse
        second cache's, its indices' and its lengths' addresses (the cache's parts at the
        first cache's offsets)."""
        q_lat, q_rope = q
        vp = self.vp if not lse else self.variants.pack(lse)
        qo, co = self.q_offsets, self.c_offsets
        ex = self.extra
        if self.extra_consts:
            e, e_idx, e_lens = extra
            ex = (SPARSE_EXTRA.pack(e + co[0], e + co[1], e_idx, e_lens, *self.extra_consts),)
        tma = self.tma
        if tma is not None:
            ex = (*ex, vp, tma if tma.__class__ is bytes else tma(c_lat + co[0], c_rope + co[1]))
        else:
            ex = (*ex, vp)
        rest = (q_lat + qo[0], q_rope + qo[1], *self.q_strides, c_lat + co[0], c_rope + co[1],
                *self.c_strides, bt, *self.table, lens, starts, *self.tail, *ex)
        if not self.split_tiles:
            self.kernel(self.grid, geometry.MLA_THREADS, self.smem, ctx.stream, out, 0, 0, 0, 0,
                        self.row_tiles, *rest)
            return
        parts, keep = self.partials, None
        if parts is None:
            parts, keep = scratch_partials(ctx, *self.scratch_need())
        self.kernel(self.grid, geometry.MLA_THREADS, self.smem, ctx.stream, out,
                    parts.part_out, parts.part_max, parts.part_sum, self.split_tiles,
                    self.row_tiles, *rest)
        self.combine(self.combine_grid, COMBINE_THREADS, 0, ctx.stream, out, parts.part_out,
                     parts.part_max, parts.part_sum, 0, starts, *self.combine_tail, vp)
        del keep  # the scratch is freed in the stream's order, after the launches

    def scratch_need(self) -> tuple | None:
        """scratch_partials' ``(rows, width, counters)`` of the scratch each call allocates
        (a split without a workspace; the combine kernel merges, so no counters), or None
        where a call allocates none."""
        if not self.split_tiles or self.partials is not None:
            return None
        return self.scratch_rows, self.rank, 0

    def at_scale(self, ptr: int) -> MlaLaunch:
        """This launch reading its fp8 scale from the float32 device scalar at ``ptr``: the
        launch of a call that differs from this one's only in its k_scale array's
        address."""
        bt_stride, max_blocks, num_blocks, _, value = self.table
        return self._replace(table=(bt_stride, max_blocks, num_blocks, ptr, value))


class WidenedMlaLaunch(NamedTuple):
    """A sparse call that widens its cache's token rows once into a 16-bit scratch
    (planning.sparse_widening) and runs ``inner``, an MlaLaunch planned over those rows
    (``[num_rows, 1, 1, width]`` of q's dtype): ``run`` takes MlaLaunch.run's arguments,
    ``c_lat`` the token rows' address."""

    widening: SparseWidening
    row_stride: int  # the token rows', in bytes
    inner: MlaLaunch

    def run(self, ctx: _arrays.Context, out: int, q: tuple, c_lat: int, c_rope: int, bt: int,
            lens: int, starts: int, lse: int = 0, extra: tuple = ()) -> None:
        w = self.widening
        base, keep = _arrays.scratch(ctx, w.num_rows * w.width * 2)
        w.kernel(w.grid, geometry.CACHE_THREADS, 0, ctx.stream, c_lat, self.row_stride, base,
                 w.width, w.num_rows)
        self.inner.run(ctx, out, q, base, base, bt, lens, starts, lse, extra)
        del keep  # freed in the stream's order, after the launches


def mla_run_addresses(ptrs, pair: bool, rope_cache: bool) -> tuple:
    """An mla_attention call's addresses (q or q_nope, q_pe, kv_cache, k_pe_cache,
    block_tables, seq_lens, query_start_loc, out, lse: 0 for none) in the order
    ``_prepared.run`` hands them to :meth:`MlaLaunch.run`: the query's and the caches'
    (latent, rope) pairs, where a single q's and a combined cache's rope part lies at the
    latent part's address (the launch's offsets find it)."""
    ql, qr, cl, cr, bt, lens, starts, o, lse = ptrs[:9]
    return ((ql, qr if pair else ql), cl, cr if rope_cache else cl, bt, lens, starts, o, lse)


def build_mla(p, plan, scale: float, causal: bool, k_scale: tuple = (0, 1.0),
              partials: Partials | None = None, sparse: tuple = (),
              variants: _variants.Variants = _variants.PLAIN,
              extra: tuple = ()) -> MlaLaunch:
    """The launches of a planned MLA call (``p``: validation.MlaProblem, ``plan``:
    planning.MlaPlan, ``k_scale``: an fp8 cache's scale as (device pointer or 0, value),
    ``partials``: a workspace's, None for a scratch buffer per split call; ``sparse``:
    the sparse kernels' (lengths_per, strict); ``variants``: their attn_sink; ``extra``:
    its second cache's constants, MlaLaunch.extra_consts, () for none), every argument but
    the arrays' addresses."""
    isz, csz = p.dtype.itemsize, p.cache_dtype.itemsize
    spec = plan.kernel.spec
    takes_extra = spec.kernel in jit.SPARSE_MLA_READERS
    tma = None
    if spec.kernel in jit.MLA_TMA_READERS:
        tma = NO_MLA_TMA
        if geometry.mla_sm90_tma(p.block_size, csz, sparse=False):
            tma = MlaTmaMaps(p.dtype.name, csz, (p.rank, p.rope), p.block_size, p.num_blocks,
                             p.c_strides)
    if bool(extra) != (takes_extra and "x" in plan.kernel.spec.variant):
        raise ValueError(f"{plan.kernel.spec.kernel} (variant "
                         f"{plan.kernel.spec.variant!r}) planned for "
                         f"{'a' if extra else 'no'} second cache")
    return MlaLaunch(plan.kernel.launch, plan.grid, plan.kernel.smem, plan.split_tiles,
                     plan.row_tiles,
                     p.q_strides, tuple(o * isz for o in p.q_offsets), p.c_strides,
                     tuple(o * csz for o in p.c_offsets),
                     (p.bt_stride, p.max_blocks, p.num_blocks, *k_scale),
                     (p.num_heads, int(causal), scale * _checks.LOG2E, *sparse), plan.combine,
                     plan.combine_grid, plan.combine_tail,
                     p.num_rows * p.num_heads * plan.partitions, p.rank, partials, variants,
                     _variants.PLAIN_BYTES if variants is _variants.PLAIN else variants.pack(),
                     (NO_SPARSE_EXTRA,) if takes_extra and not extra else (), tuple(extra),
                     tma)
