"""Paged-attention decode: the public entry points and their launch.

Each call goes through four layers: array adaptation (``_arrays``), validation (every
check that needs no device sync, before anything launches), the choice of a specialization
and of split-KV, and the launch on the current CuPy stream of the arrays' device.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache
from typing import NamedTuple

import cupy
import numpy as np
from cupy_backends.cuda.api import driver as _driver

from . import _arrays, _catalog, _checks, _dtypes, _geometry, _kvquant, _prepared, _variants, jit
from ._arrays import as_device_array, optional_device_array, optional_output_array

__all__ = [
    "BLOCK_SIZES",
    "DecodeWorkspace",
    "HEAD_SIZES",
    "check_block_tables",
    "paged_attention",
    "paged_attention_v1",
    "paged_attention_v2",
]

HEAD_SIZES = _checks.HEAD_SIZES
BLOCK_SIZES = _checks.BLOCK_SIZES
GROUP_TILES = _catalog.GROUP_TILES
_THREADS = _geometry.DECODE_THREADS
_COMBINE_THREADS = 32  # kCombineThreads: one warp per (row, head)
_SATURATING_BYTES = 64 * 1024  # copies in flight per SM that keep its memory share busy
_MAX_GRID_YZ = 65535
# Token positions are int32 in the kernel, which computes some up to a tile past the end.
_MAX_TOKENS = _checks.INT32_MAX - 1024
_fail = _checks.fail
_LOG2E = math.log2(math.e)
_FLT_MAX = 3.4028234663852886e38
MIN_COMPUTE_CAPABILITY = (8, 0)  # cp.async, mma.m16n8k16 with bf16
_OUT_OVER_QUERY = frozenset({("query", "out")})


# ---- specializations --------------------------------------------------------------------


def _group_tile(group_size: int) -> int:
    """Query heads per CTA: the whole group up to 8 (one K/V read serves all of them)."""
    for gt in GROUP_TILES:
        if group_size <= gt:
            return gt
    return GROUP_TILES[-1]


def _decode_smem_bytes(spec: jit.KernelSpec) -> int:
    """Dynamic shared memory of paged_decode (DecodeGeometry::kSmemBytes)."""
    return _geometry.DecodeGeometry.of(spec).smem_bytes


class _Tuning(NamedTuple):
    """Overrides for tuning experiments (cupaged-bench decode --tile, --ctas-per-sm):
    ``tile`` (tile_tokens, stages) for every decode specialization instead of the
    default; ``ctas_per_sm`` at most this many decode CTAs per SM (the launch asks for
    enough dynamic shared memory that no more fit, and the split model plans with the
    slots that leaves). None: the default."""

    tile: tuple[int, int] | None = None
    ctas_per_sm: int | None = None


_tuning = _Tuning()


def _set_tuning(tile: tuple[int, int] | None = None, ctas_per_sm: int | None = None) -> None:
    """Set every override at once (those not given back to the default) and drop the
    kernels and prepared calls built under the old ones."""
    global _tuning
    _tuning = _Tuning(tile, ctas_per_sm)
    _kernels.cache_clear()
    _prepared.clear()


def _decode_spec(arch: str, dtype: str, head_size: int, block_size: int, group_tile: int,
                 kv_format: str = "vllm", cache_dtype: str = "", kv_scale: str = "",
                 variant: str = "") -> jit.KernelSpec:
    tt, st = _tuning.tile or (0, 0)
    return jit.KernelSpec("paged_decode", dtype, head_size, block_size, group_tile, tt, st,
                          kv_format=kv_format, cache_dtype=cache_dtype, kv_scale=kv_scale,
                          variant=variant, arch=arch)


class _Device(NamedTuple):
    id: int
    arch: str
    sm_count: int
    max_smem: int  # opt-in dynamic shared memory per block
    sm_smem: int  # shared memory per SM


@lru_cache(maxsize=None)
def _device(device_id: int) -> _Device:
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    cc = (props["major"], props["minor"])
    if cc < MIN_COMPUTE_CAPABILITY:
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        raise RuntimeError(
            f"device {device_id} ({name}) has compute capability {cc[0]}.{cc[1]}; cupaged's "
            f"kernels need {MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} or newer "
            f"(Ampere, Ada, Hopper, Blackwell): they use cp.async and bf16 tensor cores")
    arch = jit.target_for(cc)
    return _Device(device_id, arch, props["multiProcessorCount"], props["sharedMemPerBlockOptin"],
                   props["sharedMemPerMultiprocessor"])


class _Occupancy(NamedTuple):
    """A decode launch's residency: at most ``per_sm`` CTAs on an SM (``slots`` on the
    device), held there by asking for ``smem`` bytes of dynamic shared memory per CTA."""

    per_sm: int
    slots: int
    smem: int


class _Kernels(NamedTuple):
    decode: jit.Launcher
    combine: jit.Launcher
    smem: int
    tile_tokens: int
    name: str
    slots: int  # decode CTAs resident at once on the whole device
    sms: int  # the device's SMs
    saturate: float  # CTAs per SM whose copies in flight keep its share of DRAM busy
    # Lower residencies the split model may choose instead (fewest CTAs per SM first),
    # down to `saturate`: fewer, longer CTAs fill the waves of a small grid better.
    fewer: tuple = ()


@jit.launcher_cache
def _kernels(device_id: int, dtype: str, head_size: int, block_size: int, group_tile: int,
             kv_format: str = "vllm", cache_dtype: str = "", kv_scale: str = "",
             variant: str = "") -> _Kernels:
    dev = _device(device_id)
    spec = _decode_spec(dev.arch, dtype, head_size, block_size, group_tile, kv_format,
                        cache_dtype, kv_scale, variant)
    smem = _decode_smem_bytes(spec)
    if smem > dev.max_smem:
        raise ValueError(
            f"{spec.name} needs {smem} bytes of shared memory per block; device {device_id} "
            f"allows {dev.max_smem} (use a smaller head size or a 16-bit dtype)"
        )
    if _tuning.ctas_per_sm:
        smem = max(smem, _smem_for(dev, _tuning.ctas_per_sm))
    # A CTA keeps STAGES - 1 tiles of K and V in flight; about 64 KiB in flight per SM keep
    # its share of the memory bandwidth busy (fitted, then checked on the auto sweep:
    # docs/PERFORMANCE.md, issue 14), so fewer CTAs than the SM holds may saturate it.
    geo = _geometry.DecodeGeometry.of(spec)
    in_flight = (geo.stages - 1) * 2 * geo.tile_tokens * head_size * geo.cit
    saturate = _SATURATING_BYTES / in_flight
    decode = jit.load(spec, device_id, smem)
    slots = _resident_ctas(device_id, decode, _THREADS, smem)
    fewer = []
    if not _tuning.ctas_per_sm:
        for per_sm in range(max(1, math.ceil(saturate)), slots // dev.sm_count):
            smem_n = max(smem, _smem_for(dev, per_sm))
            decode = jit.load(spec, device_id, smem_n)  # raises the kernel's limit
            slots_n = _resident_ctas(device_id, decode, _THREADS, smem_n)
            if slots_n // dev.sm_count == per_sm:
                fewer.append(_Occupancy(per_sm, slots_n, smem_n))
    return _Kernels(decode, _combine(device_id, dtype, head_size), smem, spec.tile_tokens,
                    spec.name, slots, dev.sm_count, saturate, tuple(fewer))


def _smem_for(dev: "_Device", per_sm: int) -> int:
    """Dynamic shared memory per CTA that lets at most ``per_sm`` CTAs share an SM (1 KiB
    per block is the driver's own reservation)."""
    return min(dev.max_smem, dev.sm_smem // per_sm - 1024)


@jit.launcher_cache
def _combine(device_id: int, dtype: str, head_size: int) -> jit.Launcher:
    """paged_decode_combine: merges the split-KV partials of paged_decode and of
    paged_prefill."""
    spec = jit.KernelSpec("paged_decode_combine", dtype, head_size, arch=_device(device_id).arch)
    return jit.load(spec, device_id)


def _resident_ctas(device_id: int, kernel: jit.Launcher, threads: int, smem: int) -> int:
    """CTAs of ``kernel`` resident at once on the whole device (at least one per SM)."""
    with cupy.cuda.Device(device_id):
        per_sm = _driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads, smem)
    return max(1, per_sm) * _device(device_id).sm_count


# ---- validation ---------------------------------------------------------------------------


class _Problem(NamedTuple):
    device: int
    dtype: _dtypes.DType
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    max_blocks: int
    cache: _checks.CacheView  # its dtype is the cache's element type (fp8 or the query's)
    num_rows: int  # query rows: num_seqs for decode, total_q for attention()
    quant: _kvquant.KVQuant = _kvquant.NONE  # an fp8 cache's scales
    q_strides: tuple = (0, 0)  # the query's token (sequence) and head strides, in elements
    bt_stride: int = 0  # block_tables' row stride, in entries


# PagedKV (cuda_src/kv_layout.cuh), passed by value as the launch formats' braced fields
# (_kv_args gives its constant ones).
_PAGED_KV = struct.Struct("@" + jit.PAGED_KV_FORMAT.strip("{}"))
assert _PAGED_KV.size == 128


def _validate(query, key_cache, value_cache, block_tables, context_lens, alibi_slopes,
              out, kv_cache_dtype="auto", k_scale=None, v_scale=None) -> _Problem:
    dt = _checks.check_dtype(query, "query")
    cdt = _kvquant.cache_dtype(kv_cache_dtype, key_cache, value_cache, dt)
    if cdt is dt:
        for name, a in (("key_cache", key_cache), ("value_cache", value_cache)):
            if a.dtype != query.dtype:
                _fail(f"{name} dtype {a.dtype} does not match query dtype {query.dtype}",
                      TypeError)
    if query.ndim != 3:
        _fail(f"query must be 3-D [num_seqs, num_heads, head_size], got shape {query.shape}")
    num_seqs, num_heads, head_size = query.shape
    _checks.check_head_size(head_size)
    x = 16 // cdt.itemsize
    if key_cache.ndim == 5 and key_cache.shape[2] * x != head_size:
        _fail(f"key_cache.shape[2] is {key_cache.shape[2]}, expected head_size/{x} = {head_size // x}")
    cache = _checks.check_kv_layout(key_cache, value_cache, cdt, "vllm")
    if num_heads == 0 or num_heads % cache.num_kv_heads:
        _fail(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
              f"({cache.num_kv_heads})")
    if num_heads > _MAX_GRID_YZ:
        _fail(f"num_heads is {num_heads}; at most {_MAX_GRID_YZ} are supported")
    # Strides of an empty batch are free: nothing is read through them.
    empty = num_seqs == 0
    if not empty and (query.strides[2] != dt.itemsize or min(query.strides) < 0):
        _fail(f"query's last dimension must be contiguous (strides {query.strides})")
    _checks.check_element_strides(query, "query", dt.itemsize)

    max_blocks = _checks.check_tables(block_tables, context_lens, "context_lens", num_seqs,
                                      cache.block_size, _MAX_TOKENS)
    _checks.check_alibi_and_out(alibi_slopes, out, query, num_heads)
    if out is not None:
        # Written in place over the query is fine (each CTA reads its rows before it writes
        # them); a partial overlap would let one CTA's output clobber another's query.
        # (Byte ranges inline: this runs on every call.)
        q_lo, o_lo, qs = query.data.ptr, out.data.ptr, query.strides
        q_hi = q_lo + (num_seqs - 1) * qs[0] + (num_heads - 1) * qs[1] + head_size * dt.itemsize
        o_hi = o_lo + num_seqs * num_heads * head_size * dt.itemsize
        if not empty and q_lo < o_hi and o_lo < q_hi and not (q_lo == o_lo and out.strides == qs):
            _checks.check_disjoint((("query", query), ("out", out)), may_alias=_OUT_OVER_QUERY)

    device = query.data.device_id  # (not .device: that builds a Device object per call)
    _checks.check_same_device(device, "query", (
        ("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables),
        ("context_lens", context_lens), ("alibi_slopes", alibi_slopes), ("out", out)))
    quant = _kvquant.scales(k_scale, v_scale, None if cdt is dt else cdt, cache, device)
    return _Problem(device, dt, num_seqs, num_heads, cache.num_kv_heads, head_size,
                    cache.block_size, cache.num_blocks, max_blocks, cache, num_seqs, quant,
                    (query.strides[0] // dt.itemsize, query.strides[1] // dt.itemsize),
                    block_tables.strides[0] // 4)


def _scale(scale, head_size: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_size)
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        _fail(f"scale must be a number, got {type(scale).__name__}", TypeError)
    # The kernels take scale * log2(e) as a float32.
    if not math.isfinite(scale) or abs(scale) * _LOG2E > _FLT_MAX:
        _fail(f"scale must be finite in float32 (|scale| < {_FLT_MAX / _LOG2E:.3g}), got {scale}")
    return scale


def _max_context(max_context_len, p: _Problem) -> int:
    """A host-side bound on the context lengths, used only to size split-KV work."""
    return _checks.host_bound(max_context_len, "max_context_len", p.max_blocks * p.block_size)


# ---- split-KV choice --------------------------------------------------------------------------


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _parts(max_ctx: int, size: int) -> int:
    """Split-KV partitions of ``size`` tokens over ``max_ctx``: 1 for a single pass (0)."""
    return -(-max_ctx // size) if size else 1


def _partition_tokens(partition, p: _Problem, max_ctx: int, ctas: int,
                      ks: "_Kernels") -> tuple[int, int]:
    """``(tokens per split-KV partition, 0 for a single pass; dynamic shared memory per
    CTA)``: the split, and the residency it runs at (``ks.smem`` or one of ``ks.fewer``)."""
    if partition == "never" or max_ctx == 0:
        size = 0
    elif isinstance(partition, (int, np.integer)) and not isinstance(partition, bool):
        if partition <= 0 or partition % p.block_size or partition > _checks.INT32_MAX:
            _fail(f"partition must be a positive multiple of block_size ({p.block_size}) "
                  f"below 2^31, got {partition}")
        size = int(partition)
    elif partition in ("auto", "always"):
        size, occ = _split_and_residency(ctas, max_ctx, ks, max(ks.tile_tokens, p.block_size),
                                         partition == "always")
        return _check_parts(size, max_ctx), occ.smem
    else:
        _fail(f"partition must be 'auto', 'never', 'always' or an int, got {partition!r}")
    size = _check_parts(size, max_ctx)
    return size, _residency(ctas * _parts(max_ctx, size), ks).smem


def _check_parts(size: int, max_ctx: int) -> int:
    if _parts(max_ctx, size) > _MAX_GRID_YZ:
        _fail(f"partition of {size} tokens gives more than {_MAX_GRID_YZ} partitions for "
              f"{max_ctx} tokens; use a larger partition")
    return size


def _natural(ks: "_Kernels") -> _Occupancy:
    return _Occupancy(ks.slots // ks.sms if ks.sms else 0, ks.slots, ks.smem)


def _residency(grid: int, ks: "_Kernels") -> _Occupancy:
    """The residency for ``grid`` CTAs of a plan already chosen. A lower one (``ks.fewer``)
    only for a grid that overfills one wave at the natural residency and fits in two of
    the lower one's, when its whole waves (_grid_cost) cost 3% less: 512 CTAs on 132 SMs
    are two waves either way, but waves of two CTAs' work per SM instead of three. Larger
    grids start their CTAs staggered, and measured faster at the natural residency."""
    best = _natural(ks)
    if not ks.sms or grid <= best.slots:
        return best
    cost = _grid_cost(grid, 1, best.per_sm, best.slots, ks.sms, ks.saturate)
    for occ in ks.fewer:
        if grid <= 2 * occ.slots:
            c = _grid_cost(grid, 1, occ.per_sm, occ.slots, ks.sms, ks.saturate)
            if c * 1.03 < cost:
                best, cost = occ, c
    return best


def _split_and_residency(ctas: int, max_ctx: int, ks: "_Kernels", quantum: int,
                         at_least_two: bool) -> tuple[int, _Occupancy]:
    """The split at the natural residency, or at a lower one (``ks.fewer``) when that
    residency's own best split costs 3% less and its grid, as in _residency, overfills
    one natural wave and fits in two of the lower one's. (Its best split only: a lower
    residency whose best grid is larger is not taken, even where a smaller split at it
    would win. That is the rule measured in PERFORMANCE.md.)"""
    nat = best = _natural(ks)
    cost, size = _split_cost(ctas, max_ctx, nat.slots, ks.tile_tokens, quantum, at_least_two,
                             ks.sms, ks.saturate)
    if not ks.sms:
        return size, best
    for occ in ks.fewer:
        c, s = _split_cost(ctas, max_ctx, occ.slots, ks.tile_tokens, quantum, at_least_two,
                           ks.sms, ks.saturate)
        grid = ctas * _parts(max_ctx, s)
        if nat.slots < grid <= 2 * occ.slots and c * 1.03 < cost:
            best, cost, size = occ, c, s
    return size, best


def _grid_cost(grid: int, work: int, per_sm: int, slots: int, sms: int,
               saturate: float) -> float:
    """Time for ``grid`` CTAs of ``work`` tokens each, in tokens streamed by one CTA that
    has an SM to itself: waves of ``slots`` CTAs (``per_sm`` to an SM, sharing its
    bandwidth, so a full wave lasts ``per_sm`` CTAs' work). A grid that fits in one wave,
    all of its CTAs starting at once, puts at most j = ceil(grid / sms) on an SM; while j
    is below ``saturate`` (the CTAs whose copies in flight keep an SM's share of the
    memory bandwidth busy) the SM is not full and the wave is shorter: max(j, saturate)
    CTAs' work. So 256 CTAs on 132 SMs of 3 slots are not split into 768 to fill the
    wave. Grids of several waves start their CTAs staggered and are priced in whole
    waves. ``sms = 0`` prices every grid in whole waves of unit length."""
    if not sms:
        return -(-grid // slots) * work
    if grid <= slots:
        return min(per_sm, max(-(-grid // sms), saturate)) * work
    return -(-grid // slots) * per_sm * work


def _split(ctas: int, max_ctx: int, slots: int, tile: int, quantum: int, at_least_two: bool,
           sms: int = 0, saturate: float = 0.0) -> int:
    """Split-KV partition size (0: single pass) minimizing _split_cost."""
    return _split_cost(ctas, max_ctx, slots, tile, quantum, at_least_two, sms, saturate)[1]


@lru_cache(maxsize=4096)
def _split_cost(ctas: int, max_ctx: int, slots: int, tile: int, quantum: int,
                at_least_two: bool, sms: int = 0, saturate: float = 0.0) -> tuple[float, int]:
    """``(cost, partition size)``: the split-KV partition (0: single pass) of ``ctas``
    CTAs over ``max_ctx`` tokens that minimizes a simple cost model, and its cost.

    A CTA's work is its partition rounded up to tiles, plus about one tile of fixed cost
    (filling the pipeline, the epilogue); _grid_cost prices the grid. Splitting adds the
    merge (two tiles of a full wave) and must win by 3% (the partials' traffic). A single
    pass over few long sequences leaves SMs idle or a last wave mostly empty; many tiny
    partitions pay the fixed costs over and over. One residency's choices are those of
    the wave model before residencies were chosen (PERFORMANCE.md, issue 14)."""
    per_sm = max(1, slots // sms) if sms else 1
    max_parts = min(-(-max_ctx // quantum), _MAX_GRID_YZ)
    # Worth trying: one partition, the most that fit in w whole waves, and the most that
    # put j CTAs on each SM of a single wave.
    candidates = {1, max_parts} | {min(max_parts, max(1, w * slots // ctas)) for w in range(1, 9)}
    if sms:
        candidates |= {min(max_parts, max(1, j * sms // ctas)) for j in range(1, per_sm)}
    best = (math.inf, 1, 0)
    for n in sorted(candidates):
        size = _round_up(-(-max_ctx // n), quantum)
        n = -(-max_ctx // size)
        if at_least_two and n < 2 and max_parts >= 2:
            continue
        work = _round_up(size, tile) + tile
        cost = _grid_cost(ctas * n, work, per_sm, slots, sms, saturate)
        if n > 1:
            cost = 1.03 * (cost + 2 * tile * per_sm)
        if cost < best[0]:
            best = (cost, n, size)
    cost, n, size = best
    return cost, (size if (n > 1 or at_least_two) else 0)


# ---- launch -----------------------------------------------------------------------------------


class _Partials(NamedTuple):
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


def _fit_partitions(size: int, partition, p: _Problem, max_ctx: int, max_rows: int,
                    quantum: int) -> int:
    """The partition size again, made large enough for the partials to fit ``max_rows``."""
    cap = max_rows // (p.num_rows * p.num_heads)
    if -(-max_ctx // size) <= cap:
        return size
    if isinstance(partition, str) and cap >= 2:
        return _round_up(-(-max_ctx // cap), quantum)
    if partition == "auto":
        return 0  # no room for two partitions: a single pass
    _fail(f"the workspace holds {cap} partitions per head for {p.num_rows} query rows; "
          f"partition={partition!r} needs {-(-max_ctx // size)} (use a larger DecodeWorkspace)")


class _Launch(NamedTuple):
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
    partials: _Partials | None = None  # the workspace's; None: a scratch buffer per call
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
            parts, keep = _scratch_partials(ctx, self.scratch_rows, self.head_size,
                                            self.grid[0] * self.grid[1] if merges_here else 0)
        po, pm, ps = parts.part_out, parts.part_max, parts.part_sum
        self.kernel(self.grid, self.threads, self.smem, ctx.stream, out, po, pm, ps,
                    *((parts.counters,) if merges_here else self.head), q, *self.q_strides,
                    k, v, *self.kv_strides, bt, *self.kv_tail, lens, starts, *self.tail, vp)
        if not merges_here:
            # paged_prefill writes every partial row, so its combine takes all (no lengths).
            self.combine(self.combine_grid, _COMBINE_THREADS, 0, ctx.stream, out, po, pm, ps,
                         0 if self.prefill else lens, *self.combine_tail, vp)
        del keep  # the scratch is freed in the stream's order, after the launches


def _kv_args(p: _Problem) -> tuple:
    """PagedKV's constant fields (cuda_src/kv_layout.cuh): the caches' strides, then what
    follows the table pointer (its row stride, sizes, an fp8 cache's scales)."""
    c, q = p.cache, p.quant
    return (*c.k_strides, *c.v_strides), (p.bt_stride, p.max_blocks, p.num_blocks, q.k_ptr,
                                          q.v_ptr, q.block_stride, q.head_stride, q.k_value,
                                          q.v_value)


def _prepare(p: _Problem, scale: float, max_ctx: int, partition, alibi: int,
             workspace: _Partials | None = None, rows: bool = False, causal: bool = True,
             variants: _variants.Variants = _variants.PLAIN) -> _Launch | None:
    """The launches of paged_decode (and its combine) for a validated problem; None when
    there is nothing to launch. ``rows``: one CTA per query row, each finding its sequence
    in ``query_start_loc`` (attention's row mode). ``workspace``: where split-KV partials
    go, else a scratch buffer per call. ``alibi``: the slopes' address or 0."""
    if p.num_seqs == 0 or p.num_rows == 0:
        return None
    group = p.num_heads // p.num_kv_heads
    gt = _group_tile(group)
    ks = _kernels(p.device, p.dtype.name, p.head_size, p.block_size, gt, p.cache.kv_format,
                  p.cache.dtype.name, p.quant.mode, variants.letters)
    vp = _variants.PLAIN_BYTES if variants is _variants.PLAIN else variants.pack()
    if variants.window:  # the partitions cover the window (from a tile before it) only
        max_ctx = min(max_ctx, variants.window + ks.tile_tokens)
    grid_y = p.num_kv_heads * -(-group // gt)
    if grid_y > _MAX_GRID_YZ:
        _fail(f"num_kv_heads * head tiles = {grid_y} exceeds the grid limit {_MAX_GRID_YZ}")
    size, smem = _partition_tokens(partition, p, max_ctx, p.num_rows * grid_y, ks)
    # Partials without counters (vLLM's v2 buffers) are merged by the combine kernel,
    # which takes a row per sequence: row mode then runs a single pass.
    if size and rows and workspace is not None and workspace.max_counters < p.num_rows * grid_y:
        size, smem = 0, _residency(p.num_rows * grid_y, ks).smem
    if size and workspace is not None:
        fitted = _fit_partitions(size, partition, p, max_ctx, workspace.max_rows,
                                 max(ks.tile_tokens, p.block_size))
        if fitted != size:  # fewer partitions: a smaller grid, perhaps another residency
            size = fitted
            smem = _residency(p.num_rows * grid_y * _parts(max_ctx, size), ks).smem
    n_parts = _parts(max_ctx, size)
    kv_strides, kv_tail = _kv_args(p)
    launch = _Launch(ks.decode, (p.num_rows, grid_y, n_parts), _THREADS, smem, False, (0,),
                     p.q_strides, kv_strides, kv_tail,
                     (alibi, p.num_heads, group, p.num_seqs, int(causal), size,
                      scale * _LOG2E), variants, vp, takes_starts=rows)
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


def _scratch_partials(ctx: _arrays.Context, rows: int, head_size: int,
                      counters: int = 0) -> tuple:
    """``(partials, owner)``: a scratch buffer for ``rows`` partial rows and ``counters``
    zeroed merge counters (one allocation carved by address: slicing costs microseconds),
    and its owner to keep alive until the launches are enqueued."""
    nbytes = rows * (head_size + 2) * 4
    base, keep = _arrays.scratch(ctx, nbytes + counters * 4)
    if counters:
        cupy.cuda.runtime.memsetAsync(base + nbytes, 0, counters * 4, ctx.stream)
    return _Partials(base, base + rows * head_size * 4, base + rows * (head_size + 1) * 4,
                     rows, base + nbytes if counters else 0, counters), keep


def _workspace_partials(workspace, p: _Problem) -> _Partials | None:
    """The split-KV scratch of a ``workspace=`` argument: a DecodeWorkspace's, sized for
    ``p``; partials the vLLM v2 entry point built from its own buffers; or None."""
    if isinstance(workspace, DecodeWorkspace):
        return workspace._partials(p)
    if workspace is not None and not isinstance(workspace, _Partials):
        _fail(f"workspace must be a cupaged.DecodeWorkspace, got {type(workspace).__name__}",
              TypeError)
    return workspace


def _workspace_key(workspace):
    """The memo key of a ``workspace=`` argument: what its partials' addresses follow
    from (an unknown kind: not keyed, so the validating path names it)."""
    if workspace is None or isinstance(workspace, _Partials):
        return workspace
    if isinstance(workspace, DecodeWorkspace):
        return ("DecodeWorkspace", workspace._base, workspace.rows, workspace.head_size,
                workspace.device)
    return _prepared.UNKEYED


class _VariantArgs(NamedTuple):
    """A call's variant arguments, as given (validated by _variant_setup)."""

    window: object = None
    window_left: object = None
    logits_soft_cap: object = None
    sinks: object = None
    return_lse: bool = False
    lse: object = None
    sparse: tuple = ()  # blocksparse, already checked by _variants.blocksparse


    @property
    def wants_lse(self) -> bool:
        return bool(self.return_lse) or self.lse is not None


_NO_VARIANTS = _VariantArgs()


def _variant_args(window, window_left, logits_soft_cap, sinks, return_lse, lse) -> _VariantArgs:
    """The public keywords as one value; the shared constant when none is given (the
    common call then skips every variant check)."""
    if (window is None and window_left is None and logits_soft_cap is None and sinks is None
            and return_lse is False and lse is None):
        return _NO_VARIANTS
    return _VariantArgs(window, window_left, logits_soft_cap, sinks, return_lse, lse)


def _variant_setup(va: _VariantArgs, p: _Problem):
    """Validate the variant arguments of a call (no launch, no allocation): the variants
    with their sinks adapted, and the caller's ``lse=`` array (adapted) or None."""
    if va is _NO_VARIANTS:
        return _variants.PLAIN, None
    window = _variants.window_size(va.window, va.window_left)
    cap = _variants.soft_cap(va.logits_soft_cap)
    sinks = _variants.check_sinks(optional_device_array(va.sinks, "sinks"), p.num_heads,
                                  p.device)
    lse = optional_output_array(va.lse, "lse")
    if lse is not None:
        _variants.check_lse(lse, p.num_rows, p.num_heads, p.device)
    elif not isinstance(va.return_lse, (bool, np.bool_)):
        _fail(f"return_lse must be a bool, got {type(va.return_lse).__name__}", TypeError)
    if not (window or cap or sinks is not None or va.sparse):
        return _variants.PLAIN, lse
    return _variants.Variants(_variants.letters(window, cap, va.sparse), window, cap, sinks,
                              va.sparse), lse


def _run(query, key_cache, value_cache, block_tables, context_lens, scale, alibi_slopes,
         max_context_len, out, partition, stream=None, workspace=None, kv_cache_dtype="auto",
         k_scale=None, v_scale=None, va: _VariantArgs = _NO_VARIANTS):
    """One decode call: its prepared launches when the same call (by metadata) passed
    validation before, else validation and planning first."""
    k, ptrs = _prepared.key(
        "decode", (query, key_cache, value_cache, block_tables, context_lens, None, out, va.lse),
        (alibi_slopes, va.sinks, k_scale, v_scale),
        (scale, max_context_len, partition, kv_cache_dtype, va.window, va.window_left,
         va.logits_soft_cap, va.return_lse, va.sparse), _workspace_key(workspace))
    prep = _prepared.lookup(k)
    if prep is None or _prepared.overlaps(prep, ptrs[0], ptrs[6]):
        prep, ptrs = _validate_and_prepare(query, key_cache, value_cache, block_tables,
                                           context_lens, scale, alibi_slopes, max_context_len,
                                           out, partition, stream, workspace, kv_cache_dtype,
                                           k_scale, v_scale, va)
        _prepared.remember(k, prep)
    return _prepared.run(prep, ptrs, stream, out, va.lse)


def _validate_and_prepare(query, key_cache, value_cache, block_tables, context_lens, scale,
                          alibi_slopes, max_context_len, out, partition, stream, workspace,
                          kv_cache_dtype, k_scale, v_scale, va: _VariantArgs) -> tuple:
    """``(prepared call, addresses)``: every check (CUPAGED_DEBUG's device reads too),
    then the launches' plan."""
    q = as_device_array(query, "query")
    kc = as_device_array(key_cache, "key_cache")
    vc = as_device_array(value_cache, "value_cache")
    bt = as_device_array(block_tables, "block_tables")
    cl = as_device_array(context_lens, "context_lens")
    alibi = optional_device_array(alibi_slopes, "alibi_slopes")
    o = optional_output_array(out, "out")
    p = _validate(q, kc, vc, bt, cl, alibi, o, kv_cache_dtype, k_scale, v_scale)
    scale = _scale(scale, p.head_size)
    max_ctx = _max_context(max_context_len, p)
    workspace = _workspace_partials(workspace, p)
    variants, lse = _variant_setup(va, p)
    if _checks.DEBUG:
        with _arrays.on_device(p.device):
            _check_tables(bt, cl, p.num_blocks, p.block_size,
                          _arrays.context(p.device, _arrays.framework(query), stream))
    with _arrays.on_device(p.device):
        launch = _prepare(p, scale, max_ctx, partition, 0 if alibi is None else alibi.data.ptr,
                          workspace, variants=variants)
    return (_prepared_call(launch, p, q, o, va, lse, _arrays.framework(query)),
            _prepared.addresses(q, kc, vc, bt, cl, None, o, lse))


def _prepared_call(launch: _Launch | None, p: _Problem, q, o, va: _VariantArgs,
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
    makes :func:`paged_attention` allocate nothing when ``out=`` is given too: what CUDA
    graph capture needs, and a saving for any loop.

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
            sms = _device(self.device).sm_count
            rows = max(2 * max_num_seqs * num_heads, 9 * 4 * sms * 8)
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows <= 0:
            _fail(f"rows must be a positive int, got {rows!r}")
        self.rows, self.head_size = int(rows), head_size
        # A split has at least two partitions per head, so rows // 2 counters cover every
        # (sequence, head tile) of a split that fits.
        self._num_counters = self.rows // 2
        # One allocation, partial rows then counters: every address a prepared call embeds
        # follows from its base, which is what the memo keys a workspace by
        # (_workspace_key). Two allocations could come back from the pool as a recycled
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

    def _partials(self, p: _Problem) -> _Partials:
        if p.device != self.device:
            _fail(f"the workspace is on device {self.device} but query is on device {p.device}")
        if p.head_size > self.head_size:
            _fail(f"the workspace was made for head_size {self.head_size}, got {p.head_size}")
        got = self._by_head_size.get(p.head_size)
        if got is None:  # part_out first, then max and sum, as the kernels index them
            rows = self.rows * (self.head_size + 2) // (p.head_size + 2)
            b = self._base
            got = _Partials(b, b + rows * p.head_size * 4, b + rows * (p.head_size + 1) * 4, rows,
                            b + self._counters_offset, self._num_counters)
            self._by_head_size[p.head_size] = got
        return got

    def __repr__(self) -> str:
        return (f"DecodeWorkspace(rows={self.rows}, head_size={self.head_size}, "
                f"device={self.device}, {self.nbytes / 2**20:.1f} MiB)")


# ---- public entry points ------------------------------------------------------------------------


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, *, scale=None,
                    alibi_slopes=None, max_context_len=None, out=None, partition="auto",
                    stream=None, workspace=None, kv_cache_dtype="auto", k_scale=None,
                    v_scale=None, window=None, window_left=None, logits_soft_cap=None,
                    sinks=None, return_lse=False, lse=None):
    """Decode attention of one query token per sequence over a paged KV cache.

    Args:
        query: ``[num_seqs, num_heads, head_size]``, float32, float16 or bfloat16. The
            sequence and head strides are free (a slice of a fused QKV works); the last
            dimension must be contiguous.
        key_cache: ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` with
            ``x = 16 // itemsize`` of the cache (vLLM's layout; 16 for fp8), the query's
            dtype or fp8 (``kv_cache_dtype``).
        value_cache: ``[num_blocks, num_kv_heads, head_size, block_size]``.
            Both caches must be contiguous within a block; their block and head strides
            are free (multiples of 16 bytes).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``: the physical block of each
            logical block. Entries past a sequence's last block are never read.
        context_lens: int32 ``[num_seqs]``: tokens in each sequence's cache.
        scale: softmax scale; default ``1 / sqrt(head_size)``.
        alibi_slopes: optional float32 ``[num_heads]``; adds ``slope * (pos - len + 1)``.
        max_context_len: a host-side bound on ``context_lens``, used only to size the
            split-KV work; default ``max_blocks_per_seq * block_size`` (no device sync).
            An undercount costs parallelism, never correctness.
        out: optional ``[num_seqs, num_heads, head_size]`` C-contiguous output.
        partition: ``"auto"`` (split-KV when it fills the GPU better), ``"never"``,
            ``"always"``, or a partition size in tokens (a multiple of block_size).
        stream: where the kernels run (a CuPy or torch stream, anything with
            ``__cuda_stream__``, or a handle); default torch's current stream of the
            arrays' device when ``query`` is a torch tensor, else CuPy's.
        workspace: a :class:`DecodeWorkspace` for the split-KV partials; with ``out``
            given, the call then allocates nothing (CUDA graph capture).
        kv_cache_dtype: ``"auto"``: the caches hold the query's dtype, or an fp8 format
            their dtype names (torch's ``float8_e4m3fn``/``float8_e5m2``, ml_dtypes');
            ``"fp8"``/``"fp8_e4m3"`` or ``"fp8_e5m2"``: fp8 in any 1-byte storage (uint8,
            int8 or the float8 types). fp8 needs float16/bfloat16 queries and head sizes
            that are multiples of 16.
        k_scale, v_scale: an fp8 cache's scales: it holds ``value / scale`` and is read
            as ``stored * scale`` (fp32). Per tensor: a number, or a float32 device scalar
            (read in the kernel: no sync, graph-safe; vLLM's ``layer._k_scale``); default
            1. Per token and head: float32 ``[num_blocks, num_kv_heads, block_size]``
            arrays (tokens contiguous), as :func:`reshape_and_cache` writes them. Ignored
            for caches of the query's dtype.
        window, window_left, logits_soft_cap, sinks, return_lse, lse: attention variants,
            as for :func:`attention` (a window here: the last ``window`` tokens).

    Arrays may be CuPy arrays, torch CUDA tensors or any ``__dlpack__`` producer on one
    device, mixed freely; none is copied.

    Returns:
        ``out``: ``[num_seqs, num_heads, head_size]``, the query's dtype; a new torch
        tensor when ``query`` is one, else a CuPy array. A sequence of length 0 gets
        zeros. With ``return_lse`` (or ``lse=``): ``(out, lse)``, lse float32
        ``[num_seqs, num_heads]``. head_size: any multiple of 8 from 32 to 256; block_size: a power of two
        from 1 to 256; ``num_heads`` a multiple of ``num_kv_heads``.

    Never synchronizes. Block ids are not range-checked on the host (that needs a sync):
    a sequence whose table points outside the cache gets NaN, never an out-of-bounds
    read; use :func:`check_block_tables` or ``CUPAGED_DEBUG=1`` to find it.
    """
    va = _variant_args(window, window_left, logits_soft_cap, sinks, return_lse, lse)
    return _run(query, key_cache, value_cache, block_tables, context_lens, scale,
                alibi_slopes, max_context_len, out, partition, stream, workspace,
                kv_cache_dtype, k_scale, v_scale, va)


def _check_vllm_args(key_cache, num_kv_heads, block_size) -> None:
    kc = as_device_array(key_cache, "key_cache")
    if kc.ndim >= 4 and (kc.shape[1] != num_kv_heads or kc.shape[3] != block_size):
        _fail(f"num_kv_heads={num_kv_heads} and block_size={block_size} do not match "
              f"key_cache of shape {kc.shape}")


def _blocksparse(tp_rank, local_blocks, vert_stride, block_size,
                 head_sliding_step) -> _VariantArgs:
    """vLLM's blocksparse arguments as the call's variants: dense attention (no variant)
    unless ``blocksparse_vert_stride > 1``, as in vLLM."""
    sparse = _variants.blocksparse(tp_rank, local_blocks, vert_stride, block_size,
                                   head_sliding_step)
    return _VariantArgs(sparse=sparse) if sparse else _NO_VARIANTS


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                       context_lens, block_size, max_context_len, alibi_slopes=None,
                       kv_cache_dtype="auto", k_scale=None, v_scale=None, tp_rank=0,
                       blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                       blocksparse_block_size=64, blocksparse_head_sliding_step=0, *,
                       stream=None):
    """vLLM's ``paged_attention_v1``, with its full positional argument list: single-pass
    decode into ``out``. ``kv_cache_dtype``, ``k_scale`` and ``v_scale`` are as for
    :func:`paged_attention`. With ``blocksparse_vert_stride > 1`` (vLLM's switch) a key in
    sparse block ``sb = (key // block_size * block_size) // blocksparse_block_size`` is
    seen when ``sb > q_sb - blocksparse_local_blocks`` (``q_sb`` the query's own) or
    ``(sb + offset) % blocksparse_vert_stride == 0``, with ``offset = (tp_rank * num_heads
    + head) * step + 1`` for ``step = blocksparse_head_sliding_step >= 0``, else
    ``(tp_rank * num_kv_heads + kv_head) * -step + 1`` (vLLM's pattern;
    :func:`cupaged.reference.blocksparse_mask`)."""
    va = _blocksparse(tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                      blocksparse_block_size, blocksparse_head_sliding_step)
    _check_vllm_args(key_cache, num_kv_heads, block_size)
    if out is None:
        _fail("out is required by paged_attention_v1")
    return _run(query, key_cache, value_cache, block_tables, context_lens, scale, alibi_slopes,
                max_context_len, out, "never", stream, None, kv_cache_dtype, k_scale, v_scale,
                va)


def paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache,
                       num_kv_heads, scale, block_tables, context_lens, block_size,
                       max_context_len, alibi_slopes=None, kv_cache_dtype="auto", k_scale=None,
                       v_scale=None, tp_rank=0, blocksparse_local_blocks=0,
                       blocksparse_vert_stride=0, blocksparse_block_size=64,
                       blocksparse_head_sliding_step=0, *, stream=None):
    """vLLM's ``paged_attention_v2``, with its full positional argument list: split-KV
    decode into ``out`` (fp8 and blocksparse arguments as for :func:`paged_attention_v1`).

    ``exp_sums``/``max_logits``: float32 ``[num_seqs, num_heads, P]``; ``tmp_out``:
    ``[num_seqs, num_heads, P, head_size]``, float32 or the query's dtype, all contiguous.
    They are scratch space; cupaged picks a partition size so its (float32) partials fit
    in them, which for a 16-bit ``tmp_out`` means at most P // 2 partitions.
    """
    va = _blocksparse(tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                      blocksparse_block_size, blocksparse_head_sliding_step)
    _check_vllm_args(key_cache, num_kv_heads, block_size)
    if out is None:
        _fail("out is required by paged_attention_v2")
    q = as_device_array(query, "query")
    es = as_device_array(exp_sums, "exp_sums")
    ml = as_device_array(max_logits, "max_logits")
    tmp = as_device_array(tmp_out, "tmp_out")
    if q.ndim != 3:
        _fail(f"query must be 3-D [num_seqs, num_heads, head_size], got shape {q.shape}")
    s, h, hs = q.shape
    for name, a in (("exp_sums", es), ("max_logits", ml)):
        if (a.dtype != np.float32 or a.ndim != 3 or a.shape[:2] != (s, h)
                or not (s == 0 or a.flags.c_contiguous)):
            _fail(f"{name} must be a contiguous float32 [{s}, {h}, max_num_partitions] array, "
                  f"got {a.dtype} {a.shape}")
    for name, a in (("exp_sums", es), ("max_logits", ml), ("tmp_out", tmp)):
        if a.data.device_id != q.data.device_id:
            _fail(f"{name} is on device {a.data.device_id} but query is on device {q.data.device_id}")
    n_user = es.shape[2]
    if ml.shape != es.shape or tmp.shape != (s, h, n_user, hs) or not (s == 0 or tmp.flags.c_contiguous):
        _fail(f"max_logits and tmp_out must match exp_sums: expected {(s, h, n_user)} and "
              f"{(s, h, n_user, hs)}, got {ml.shape} and {tmp.shape}")
    if tmp.dtype == np.float32:
        capacity = n_user
    elif tmp.dtype == q.dtype:
        capacity = n_user // 2  # float32 partials in a 16-bit buffer
    else:
        _fail(f"tmp_out must be float32 or the query's dtype, got {tmp.dtype}", TypeError)
    # vLLM sizes P as ceil(max_len / 512); past 65535 partitions (33.5M tokens) the grid
    # cannot hold them, so use fewer, larger ones.
    capacity = min(capacity, _MAX_GRID_YZ)
    # The kernels write float32 partials into all three, whatever tmp_out's dtype.
    for name, a in (("exp_sums", es), ("max_logits", ml), ("tmp_out", tmp)):
        _checks.check_aligned(a.data.ptr, name, 4)
    _checks.check_disjoint((("exp_sums", es), ("max_logits", ml), ("tmp_out", tmp), ("query", q),
                            ("out", as_device_array(out, "out"))), may_alias=_OUT_OVER_QUERY)
    bt = as_device_array(block_tables, "block_tables")
    max_ctx = bt.shape[-1] * block_size
    if isinstance(max_context_len, (int, np.integer)) and not isinstance(max_context_len, bool):
        max_ctx = min(max_ctx, int(max_context_len))  # (other values: _run names them)
    if capacity == 0 or max_ctx <= 0:
        partition, workspace = "never", None
    else:
        partition = _round_up(-(-int(max_ctx) // capacity), max(block_size, 256))
        # The partials are float32 rows carved from the caller's buffers (sizes checked above).
        workspace = _Partials(tmp.data.ptr, ml.data.ptr, es.data.ptr, s * h * capacity)
    return _run(query, key_cache, value_cache, block_tables, context_lens, scale, alibi_slopes,
                max_context_len, out, partition, stream, workspace, kv_cache_dtype, k_scale,
                v_scale, va)


def check_block_tables(block_tables, context_lens, num_blocks: int, block_size: int, *,
                       stream=None) -> None:
    """Check, with a device sync, that every sequence's blocks exist: its length fits its
    row of ``block_tables`` and each of its first ``ceil(len / block_size)`` entries is in
    ``[0, num_blocks)``. Raises ValueError naming the first bad sequence. The arrays are
    read in the order of ``stream`` (default as for :func:`paged_attention`)."""
    bt = as_device_array(block_tables, "block_tables")
    cl = as_device_array(context_lens, "context_lens")
    device = bt.data.device_id
    with _arrays.on_device(device):
        ctx = _arrays.context(device, _arrays.framework(block_tables), stream)
        _check_tables(bt, cl, num_blocks, block_size, ctx)


def _check_tables(bt, cl, num_blocks: int, block_size: int, ctx: _arrays.Context) -> None:
    bt = _arrays.to_host(bt, ctx)
    cl = _arrays.to_host(cl, ctx)
    if bt.ndim != 2 or cl.shape != (bt.shape[0],):
        _fail(f"block_tables {bt.shape} and context_lens {cl.shape} disagree on num_seqs")
    lens = cl.astype(np.int64)
    bad_len = (lens < 0) | (lens > bt.shape[1] * block_size)
    if bad_len.any():
        i = int(np.flatnonzero(bad_len)[0])
        _fail(f"sequence {i}: context length {lens[i]} is outside [0, {bt.shape[1] * block_size}] "
              f"(block_tables has {bt.shape[1]} blocks of {block_size} tokens per sequence)")
    used = np.arange(bt.shape[1])[None, :] < -(-lens // block_size)[:, None]
    bad = used & ((bt < 0) | (bt >= num_blocks))
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        _fail(f"sequence {i}: block_tables[{i}, {j}] = {bt[i, j]} is outside [0, {num_blocks})")
