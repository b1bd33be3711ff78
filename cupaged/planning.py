"""Planning: which kernel serves a validated call, its specialization (tiles, group
tile), its split of the keys into partitions and the residency it runs at, from host
facts only: the problem's shapes, the device's properties and the kernels' occupancy.

A new kernel family adds its spec, its kernel loader and one rule in
:func:`plan_attention` here (docs/DESIGN.md, "Adding a kernel family")."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import cupy
import numpy as np
from cupy_backends.cuda.api import driver as _driver

from . import _checks, _dtypes, _prepared, _variants, jit
from .specs import catalog, geometry
from .validation import Problem

_fail = _checks.fail


GROUP_TILES = catalog.GROUP_TILES


_SATURATING_BYTES = 64 * 1024  # copies in flight per SM that keep its memory share busy


MIN_COMPUTE_CAPABILITY = (8, 0)  # cp.async, mma.m16n8k16 with bf16


def group_tile(group_size: int) -> int:
    """Query heads per CTA: the whole group up to 8 (one K/V read serves all of them)."""
    for gt in GROUP_TILES:
        if group_size <= gt:
            return gt
    return GROUP_TILES[-1]


def decode_smem_bytes(spec: jit.KernelSpec) -> int:
    """Dynamic shared memory of paged_decode (DecodeGeometry::kSmemBytes)."""
    return geometry.DecodeGeometry.of(spec).smem_bytes


class Tuning(NamedTuple):
    """Overrides for tuning experiments (cupaged-bench decode --tile, --ctas-per-sm):
    ``tile`` (tile_tokens, stages) for every decode specialization instead of the
    default; ``ctas_per_sm`` at most this many decode CTAs per SM (the launch asks for
    enough dynamic shared memory that no more fit, and the split model plans with the
    slots that leaves). None: the default."""

    tile: tuple[int, int] | None = None
    ctas_per_sm: int | None = None


_tuning = Tuning()


def set_tuning(tile: tuple[int, int] | None = None, ctas_per_sm: int | None = None) -> None:
    """Set every override at once (those not given back to the default) and drop the
    kernels and prepared calls built under the old ones."""
    global _tuning
    _tuning = Tuning(tile, ctas_per_sm)
    decode_kernels.cache_clear()
    _prepared.clear()


def decode_spec(arch: str, dtype: str, head_size: int, block_size: int, group_tile: int,
                kv_format: str = "vllm", cache_dtype: str = "", kv_scale: str = "",
                 variant: str = "") -> jit.KernelSpec:
    tt, st = _tuning.tile or (0, 0)
    spec = jit.KernelSpec("paged_decode", dtype, head_size, block_size, group_tile, tt, st,
                          kv_format=kv_format, cache_dtype=cache_dtype, kv_scale=kv_scale,
                          variant=variant, arch=arch)
    return spec if _tuning.tile else catalog.fitting_decode_stages(spec)


class DeviceInfo(NamedTuple):
    id: int
    arch: str
    sm_count: int
    max_smem: int  # opt-in dynamic shared memory per block
    sm_smem: int  # shared memory per SM


@lru_cache(maxsize=None)
def device_info(device_id: int) -> DeviceInfo:
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    cc = (props["major"], props["minor"])
    if cc < MIN_COMPUTE_CAPABILITY:
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        raise RuntimeError(
            f"device {device_id} ({name}) has compute capability {cc[0]}.{cc[1]}; cupaged's "
            f"kernels need {MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} or newer "
            f"(Ampere, Ada, Hopper, Blackwell): they use cp.async and bf16 tensor cores")
    arch = jit.target_for(cc)
    return DeviceInfo(device_id, arch, props["multiProcessorCount"],
                      props["sharedMemPerBlockOptin"], props["sharedMemPerMultiprocessor"])


class Occupancy(NamedTuple):
    """A decode launch's residency: at most ``per_sm`` CTAs on an SM (``slots`` on the
    device), held there by asking for ``smem`` bytes of dynamic shared memory per CTA."""

    per_sm: int
    slots: int
    smem: int


class DecodeKernels(NamedTuple):
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
def decode_kernels(device_id: int, dtype: str, head_size: int, block_size: int, group_tile: int,
                   kv_format: str = "vllm", cache_dtype: str = "", kv_scale: str = "",
             variant: str = "") -> DecodeKernels:
    dev = device_info(device_id)
    spec = decode_spec(dev.arch, dtype, head_size, block_size, group_tile, kv_format,
                       cache_dtype, kv_scale, variant)
    smem = decode_smem_bytes(spec)
    if smem > dev.max_smem:
        raise ValueError(
            f"{spec.name} needs {smem} bytes of shared memory per block; device {device_id} "
            f"allows {dev.max_smem} (use a smaller head size"
            f"{' or a 16-bit dtype' if dtype == 'f32' else ''})"
        )
    if _tuning.ctas_per_sm:
        smem = max(smem, smem_for(dev, _tuning.ctas_per_sm))
    # A CTA keeps STAGES - 1 tiles of K and V in flight; about 64 KiB in flight per SM keep
    # its share of the memory bandwidth busy (fitted, then checked on the auto sweep:
    # docs/PERFORMANCE.md, split-KV and residency model), so fewer CTAs than the SM holds
    # may saturate it.
    geo = geometry.DecodeGeometry.of(spec)
    in_flight = (geo.stages - 1) * 2 * geo.tile_tokens * head_size * geo.cit
    saturate = _SATURATING_BYTES / in_flight
    decode = jit.load(spec, device_id, smem)
    slots = resident_ctas(device_id, decode, geometry.DECODE_THREADS, smem)
    fewer = []
    if not _tuning.ctas_per_sm:
        for per_sm in range(max(1, math.ceil(saturate)), slots // dev.sm_count):
            smem_n = max(smem, smem_for(dev, per_sm))
            decode = jit.load(spec, device_id, smem_n)  # raises the kernel's limit
            slots_n = resident_ctas(device_id, decode, geometry.DECODE_THREADS, smem_n)
            if slots_n // dev.sm_count == per_sm:
                fewer.append(Occupancy(per_sm, slots_n, smem_n))
    return DecodeKernels(decode, combine_kernel(device_id, dtype, head_size), smem,
                         spec.tile_tokens, spec.name, slots, dev.sm_count, saturate, tuple(fewer))


def smem_for(dev: "DeviceInfo", per_sm: int) -> int:
    """Dynamic shared memory per CTA that lets at most ``per_sm`` CTAs share an SM (1 KiB
    per block is the driver's own reservation)."""
    return min(dev.max_smem, dev.sm_smem // per_sm - 1024)


@jit.launcher_cache
def combine_kernel(device_id: int, dtype: str, head_size: int) -> jit.Launcher:
    """paged_decode_combine: merges the split-KV partials of paged_decode and of
    paged_prefill."""
    spec = jit.KernelSpec("paged_decode_combine", dtype, head_size,
                          arch=device_info(device_id).arch)
    return jit.load(spec, device_id)


def resident_ctas(device_id: int, kernel: jit.Launcher, threads: int, smem: int) -> int:
    """CTAs of ``kernel`` resident at once on the whole device (at least one per SM)."""
    with cupy.cuda.Device(device_id):
        per_sm = _driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads, smem)
    return max(1, per_sm) * device_info(device_id).sm_count


def round_up(a: int, b: int) -> int:
    return -(-a // b) * b


# The most keys one CTA sums in one pass where the planner picks the split ("auto"): a
# pass's float32 sums lose accuracy with its length (H200, one GPU's chunked prefill over
# a 16-million-token sequence, worst row against the float64 reference: 2.0e-2 in one
# pass, 4.8e-3 in partitions of 4M keys, 2.9e-3 of 1M, 2.0e-3, the floor the 16-bit
# roundings set, of 256K; docs/PERFORMANCE.md), so longer contexts get more partitions
# than the grid model alone asks for, within CAP_SCRATCH_BYTES of partials.
MAX_PASS_TOKENS = 1 << 18
# float32 partials a call may take for the partitions the pass cap adds (without a
# workspace they are scratch allocated by the call; a workspace's room bounds them too).
CAP_SCRATCH_BYTES = 1 << 30


def slot_count(n: int, slots: int, most: int) -> int:
    """The least partition count from ``n`` up to ``most`` that divides ``slots`` or is a
    multiple of it (a persistent grid gives each partition ``slots // count`` CTAs, so
    another count leaves resident slots idle); ``n`` when there is none."""
    fits = [d for d in range(n, min(slots, most) + 1) if slots % d == 0]
    whole = -(-n // slots) * slots
    if whole <= most:
        fits.append(whole)
    return min(fits) if fits else n


def cap_pass(size: int, max_ctx: int, quantum: int, partial_rows: int, head_size: int,
             slots: int = 0) -> int:
    """A planner-chosen partition size (0: one pass) over ``max_ctx`` keys, made smaller
    so that a pass holds at most MAX_PASS_TOKENS keys, as far as ``partial_rows`` float32
    partials of ``head_size + 2`` a partition fit CAP_SCRATCH_BYTES; ``slots``: a
    persistent grid's resident CTAs, which the count is chosen to fill (slot_count)."""
    if max_ctx <= MAX_PASS_TOKENS or (size and size <= MAX_PASS_TOKENS):
        return size
    most = max(1, CAP_SCRATCH_BYTES // (partial_rows * (head_size + 2) * 4))
    n = min(-(-max_ctx // MAX_PASS_TOKENS), most)
    if slots:
        n = slot_count(n, slots, most)
    if n <= partition_count(max_ctx, size):
        return size
    return round_up(-(-max_ctx // n), quantum)


def partition_count(max_ctx: int, size: int) -> int:
    """Split-KV partitions of ``size`` tokens over ``max_ctx``: 1 for a single pass (0)."""
    return -(-max_ctx // size) if size else 1


def partition_tokens(partition, p: Problem, max_ctx: int, ctas: int,
                     ks: "DecodeKernels", room: int | None = None) -> tuple[int, int]:
    """``(tokens per split-KV partition, 0 for a single pass; dynamic shared memory per
    CTA)``: the split, and the residency it runs at (``ks.smem`` or one of ``ks.fewer``).
    ``room``: the partitions a workspace holds per row and head (None: no bound)."""
    if partition == "never" or max_ctx == 0:
        size = 0
    elif isinstance(partition, (int, np.integer)) and not isinstance(partition, bool):
        if partition <= 0 or partition % p.block_size or partition > _checks.INT32_MAX:
            _fail(f"partition must be a positive multiple of block_size ({p.block_size}) "
                  f"below 2^31, got {partition}")
        size = int(partition)
    elif partition in ("auto", "always"):
        quantum = max(ks.tile_tokens, p.block_size)
        size, occ = split_and_residency(ctas, max_ctx, ks, quantum, partition == "always")
        chosen = cap_pass(skew_split(size, p.num_rows, ctas, max_ctx, ks, quantum, room),
                          max_ctx, quantum, p.num_rows * p.num_heads, p.head_size)
        if chosen != size:  # more partitions: a larger grid, perhaps another residency
            return (check_partition_count(chosen, max_ctx),
                    residency(ctas * partition_count(max_ctx, chosen), ks).smem)
        return check_partition_count(size, max_ctx), occ.smem
    else:
        _fail(f"partition must be 'auto', 'never', 'always', 'flat' or an int, got {partition!r}")
    size = check_partition_count(size, max_ctx)
    return size, residency(ctas * partition_count(max_ctx, size), ks).smem


def check_partition_count(size: int, max_ctx: int) -> int:
    if partition_count(max_ctx, size) > _checks.MAX_GRID_YZ:
        _fail(f"partition of {size} tokens gives more than {_checks.MAX_GRID_YZ} partitions for "
              f"{max_ctx} tokens; use a larger partition")
    return size


def natural_residency(ks: "DecodeKernels") -> Occupancy:
    return Occupancy(ks.slots // ks.sms if ks.sms else 0, ks.slots, ks.smem)


def residency(grid: int, ks: "DecodeKernels") -> Occupancy:
    """The residency for ``grid`` CTAs of a plan already chosen. A lower one (``ks.fewer``)
    only for a grid that overfills one wave at the natural residency and fits in two of
    the lower one's, when its whole waves (grid_cost) cost 3% less: 512 CTAs on 132 SMs
    are two waves either way, but waves of two CTAs' work per SM instead of three. Larger
    grids start their CTAs staggered, and measured faster at the natural residency."""
    best = natural_residency(ks)
    if not ks.sms or grid <= best.slots:
        return best
    cost = grid_cost(grid, 1, best.per_sm, best.slots, ks.sms, ks.saturate)
    for occ in ks.fewer:
        if grid <= 2 * occ.slots:
            c = grid_cost(grid, 1, occ.per_sm, occ.slots, ks.sms, ks.saturate)
            if c * 1.03 < cost:
                best, cost = occ, c
    return best


def split_and_residency(ctas: int, max_ctx: int, ks: "DecodeKernels", quantum: int,
                        at_least_two: bool) -> tuple[int, Occupancy]:
    """The split at the natural residency, or at a lower one (``ks.fewer``) when that
    residency's own best split costs 3% less and its grid, as in residency, overfills
    one natural wave and fits in two of the lower one's. (Its best split only: a lower
    residency whose best grid is larger is not taken, even where a smaller split at it
    would win. That is the rule measured in PERFORMANCE.md.)"""
    nat = best = natural_residency(ks)
    cost, size = split_cost(ctas, max_ctx, nat.slots, ks.tile_tokens, quantum, at_least_two,
                            ks.sms, ks.saturate)
    if not ks.sms:
        return size, best
    for occ in ks.fewer:
        c, s = split_cost(ctas, max_ctx, occ.slots, ks.tile_tokens, quantum, at_least_two,
                          ks.sms, ks.saturate)
        grid = ctas * partition_count(max_ctx, s)
        if nat.slots < grid <= 2 * occ.slots and c * 1.03 < cost:
            best, cost, size = occ, c, s
    return size, best


def grid_cost(grid: int, work: int, per_sm: int, slots: int, sms: int,
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


def split_tokens(ctas: int, max_ctx: int, slots: int, tile: int, quantum: int, at_least_two: bool,
                 sms: int = 0, saturate: float = 0.0) -> int:
    """Split-KV partition size (0: single pass) minimizing split_cost."""
    return split_cost(ctas, max_ctx, slots, tile, quantum, at_least_two, sms, saturate)[1]


@lru_cache(maxsize=4096)
def split_cost(ctas: int, max_ctx: int, slots: int, tile: int, quantum: int,
               at_least_two: bool, sms: int = 0, saturate: float = 0.0) -> tuple[float, int]:
    """``(cost, partition size)``: the split-KV partition (0: single pass) of ``ctas``
    CTAs over ``max_ctx`` tokens that minimizes a simple cost model, and its cost.

    A CTA's work is its partition rounded up to tiles, plus about one tile of fixed cost
    (filling the pipeline, the epilogue); grid_cost prices the grid. Splitting adds the
    merge (two tiles of a full wave) and must win by 3% (the partials' traffic). A single
    pass over few long sequences leaves SMs idle or a last wave mostly empty; many tiny
    partitions pay the fixed costs over and over. One residency's choices are those of
    the wave model before residencies were chosen (docs/PERFORMANCE.md)."""
    per_sm = max(1, slots // sms) if sms else 1
    max_parts = min(-(-max_ctx // quantum), _checks.MAX_GRID_YZ)
    # Worth trying: one partition, the most that fit in w whole waves, and the most that
    # put j CTAs on each SM of a single wave.
    candidates = {1, max_parts} | {min(max_parts, max(1, w * slots // ctas)) for w in range(1, 9)}
    if sms:
        candidates |= {min(max_parts, max(1, j * sms // ctas)) for j in range(1, per_sm)}
    best = (math.inf, 1, 0)
    for n in sorted(candidates):
        size = round_up(-(-max_ctx // n), quantum)
        n = -(-max_ctx // size)
        if at_least_two and n < 2 and max_parts >= 2:
            continue
        cost = split_cost_of(ctas, max_ctx, size, slots, tile, sms, saturate)
        if cost < best[0]:
            best = (cost, n, size)
    cost, n, size = best
    return cost, (size if (n > 1 or at_least_two) else 0)


def split_cost_of(ctas: int, max_ctx: int, size: int, slots: int, tile: int, sms: int = 0,
                  saturate: float = 0.0) -> float:
    """split_cost's price of one partition size (0: a single pass)."""
    per_sm = max(1, slots // sms) if sms else 1
    n = partition_count(max_ctx, size)
    work = round_up(size or max_ctx, tile) + tile
    cost = grid_cost(ctas * n, work, per_sm, slots, sms, saturate)
    return 1.03 * (cost + 2 * tile * per_sm) if n > 1 else cost


# How much more a batch may be priced (split_cost, every row at the longest context) for a
# split that also serves one long row among short ones: the model alone gives such a
# batch the few partitions its whole grid needs, and the long row runs on a few CTAs
# (one H200, a 100,000-token row among three short ones, 64/8 heads: 25.7% of copy).
# Small, as every batch of rows all that long pays it when the rule fires.
SKEW_SLACK = 1.02
# Contexts from which that applies: below it a long row's few CTAs cost a few µs at most.
SKEW_MIN_CTX = 16384


def skew_split(size: int, rows: int, ctas: int, max_ctx: int, ks: "DecodeKernels",
               quantum: int, room: int | None = None) -> int:
    """The partition size for ``rows`` rows of ``ctas // rows`` CTAs each over up to
    ``max_ctx`` (SKEW_MIN_CTX or more) keys. Where one row's CTAs at ``size`` are fewer
    than keep the SMs' bandwidth busy (``ks.saturate`` a SM; a wave's slots without an
    SM count), the most partitions, among the counts that fill whole waves or put whole
    CTAs on each SM, up to that many (and ``room``, a workspace's partitions), whose
    price for the batch at the residency it would run at is at most SKEW_SLACK times
    ``size``'s; else ``size``."""
    if rows < 2 or ctas < rows or max_ctx < SKEW_MIN_CTX:
        return size
    per_row = ctas // rows
    nat = natural_residency(ks)
    need = -(-int(ks.saturate * ks.sms) // per_row) if ks.sms else -(-nat.slots // per_row)
    need = min(need, -(-max_ctx // quantum), _checks.MAX_GRID_YZ, room or _checks.MAX_GRID_YZ)
    n0 = partition_count(max_ctx, size)
    if n0 >= need:
        return size

    def price(s):
        occ = residency(ctas * partition_count(max_ctx, s), ks)
        return split_cost_of(ctas, max_ctx, s, occ.slots, ks.tile_tokens, ks.sms, ks.saturate)

    limit = SKEW_SLACK * price(size)
    counts = {need} | {w * nat.slots // ctas for w in range(1, 9)}
    if ks.sms:
        counts |= {j * ks.sms // ctas for j in range(1, nat.per_sm + 1)}
    for n in sorted((c for c in counts if n0 < c <= need), reverse=True):
        s = round_up(-(-max_ctx // n), quantum)
        if partition_count(max_ctx, s) > n0 and price(s) <= limit:
            return s
    return size


def v2_partition(capacity: int, table_tokens: int, max_context_len, block_size: int):
    """vLLM's v2: the partition size whose float32 partials fit ``capacity`` partitions
    per head (over at most ``max_context_len`` tokens, when it is an int), in multiples
    of 256 tokens; ``"never"`` when none fit or there is nothing to split."""
    max_ctx = table_tokens
    if isinstance(max_context_len, (int, np.integer)) and not isinstance(max_context_len, bool):
        max_ctx = min(max_ctx, int(max_context_len))  # (other values: validation names them)
    if capacity == 0 or max_ctx <= 0:
        return "never"
    return round_up(-(-max_ctx // capacity), max(block_size, 256))


def fit_partitions(size: int, partition, p: Problem, max_ctx: int, max_rows: int,
                   quantum: int) -> int:
    """The partition size again, made large enough for the partials to fit ``max_rows``."""
    cap = max_rows // (p.num_rows * p.num_heads)
    if -(-max_ctx // size) <= cap:
        return size
    if isinstance(partition, str) and cap >= 2:
        return round_up(-(-max_ctx // cap), quantum)
    if partition == "auto":
        return 0  # no room for two partitions: a single pass
    _fail(f"the workspace holds {cap} partitions per head for {p.num_rows} query rows; "
          f"partition={partition!r} needs {-(-max_ctx // size)} (use a larger DecodeWorkspace)")


class PrefillKernel(NamedTuple):
    launch: jit.Launcher
    smem: int
    threads: int
    tile_tokens: int
    slots: int  # CTAs resident at once on the whole device


# A paged_prefill tile (jit.PREFILL_TILE's fields) for every prefill specialization instead
# of the planner's, for tuning experiments (cupaged-bench prefill --tile W,M,N,S[,K]); set
# through set_prefill_tile.
_tile_override: tuple | None = None


def set_prefill_tile(tile: tuple | None) -> None:
    global _tile_override
    _tile_override = tile
    prefill_kernel.cache_clear()
    _prepared.clear()


# Split-KV of the multi-token kernels instead of the cost model's choice, for tests and
# experiments: None (the model), 0 (never) or tokens per partition (rounded up to a
# multiple of the kernel's tile: the same override serves both kernel families).
_split_override: int | None = None


def set_prefill_split(tokens: int | None) -> None:
    global _split_override
    _split_override = tokens
    _prepared.clear()


# Which multi-token kernel family serves Hopper: None (the planner's rule), "mma" (always
# paged_prefill's mma.sync kernel) or "sm90" (paged_prefill_sm90 wherever it applies,
# whatever the rows), for tests and A/B measurements; set through set_prefill_family.
_family_override: str | None = None


def set_prefill_family(family: str | None) -> None:
    global _family_override
    if family not in (None, "mma", "sm90"):
        raise ValueError(f"family must be None, 'mma' or 'sm90', got {family!r}")
    _family_override = family
    _prepared.clear()


# On Hopper, paged_prefill_sm90 from this many packed query rows per (sequence, KV head):
# at 64 (16 tokens x 4 heads) its 128-row tile is half padding and still beats the mma.sync
# kernel's few-rows tile (H200, 64 x 16 tokens over 2,048: 166.4 against 191.2 us), at 32 it
# does not (175.0 against 172.3; docs/PERFORMANCE.md). (Measured at head size 128; at 384
# and 512 its tiles are 64 rows, and the threshold is the same, not measured there.)
SM90_MIN_ROWS = 64


def prefill_tile(p: Problem, rows_needed: int) -> tuple:
    """paged_prefill's tile (``jit.PREFILL_TILE``) for a call whose longest (sequence, KV
    head) has ``rows_needed`` packed query rows: the default, few-rows or fewest-rows
    shape (up to ``jit.FEW_ROWS`` and ``jit.FEWEST_ROWS`` rows: verify's 4 tokens x 4
    heads fill 16, where the default's 128-row tile would be mostly padding), or a smaller
    one where the GPU's shared memory needs it (``catalog.fitting_prefill_tile``); a
    ValueError naming the limit where none fits."""
    if _tile_override is not None:
        return _tile_override
    dev = device_info(p.device)
    rows = (jit.FEWEST_ROWS if rows_needed <= jit.FEWEST_ROWS
            else jit.FEW_ROWS if rows_needed <= jit.FEW_ROWS else 0)
    return _fitting_prefill_tile(dev.arch, dev.max_smem, p.dtype.name, p.head_size,
                                 p.block_size, p.cache.kv_format, p.cache.dtype.name,
                                 p.quant.mode, rows)


@lru_cache(maxsize=None)
def _fitting_prefill_tile(arch: str, max_smem: int, dtype: str, head_size: int,
                          block_size: int, kv_format: str, cache_dtype: str, kv_scale: str,
                          rows: int) -> tuple:
    spec = prefill_spec(arch, dtype, head_size, block_size, kv_format, (0, 0, 0, 0, 0),
                        cache_dtype, kv_scale)
    tile = catalog.fitting_prefill_tile(spec, rows, max_smem)
    if tile is None:
        least = (geometry.prefill_dim_split(head_size), 1, 16, 2, 1)  # the last one tried
        smem = geometry.PrefillGeometry.of(prefill_spec(arch, dtype, head_size, block_size,
                                                        kv_format, least, cache_dtype,
                                                        kv_scale)).smem_bytes
        _fail(f"multi-token attention at head_size {head_size} ({kv_format} layout, "
              f"{cache_dtype} cache, blocks of {block_size}) needs {smem} bytes of shared "
              f"memory per block in its smallest tile; the device ({arch}) allows "
              f"{max_smem}: a smaller head size, or a token-major layout (NHD, HND), needs "
              f"less")
    return tile


def prefill_spec(arch: str, dtype: str, head_size: int, block_size: int,
                 kv_format: str, tile: tuple, cache_dtype: str = "",
                  kv_scale: str = "", variant: str = "") -> jit.KernelSpec:
    return jit.KernelSpec("paged_prefill", dtype, head_size, block_size, kv_format=kv_format,
                          cache_dtype=cache_dtype, kv_scale=kv_scale, variant=variant,
                          arch=arch, **dict(zip(jit.PREFILL_TILE, tile)))


@jit.launcher_cache
def prefill_kernel(device_id: int, dtype: str, head_size: int, block_size: int,
                   kv_format: str, tile: tuple, cache_dtype: str = "",
                    kv_scale: str = "", variant: str = "") -> PrefillKernel:
    spec = prefill_spec(device_info(device_id).arch, dtype, head_size, block_size, kv_format,
                        tile, cache_dtype, kv_scale, variant)
    return _load_prefill(spec, geometry.PrefillGeometry.of(spec), device_id)


def _load_prefill(spec: jit.KernelSpec, g, device_id: int) -> PrefillKernel:
    """A multi-token kernel loaded with its geometry ``g``'s shared memory (a ValueError
    naming the spec where the geometry breaks one of the kernel's rules or the device has
    less: only a tile override asks for that)."""
    bad = g.violations()
    if bad:
        raise ValueError(f"{spec.name} is not a shape the kernel takes: {', '.join(bad)}")
    dev = device_info(device_id)
    if g.smem_bytes > dev.max_smem:
        raise ValueError(f"{spec.name} needs {g.smem_bytes} bytes of shared memory per block; "
                         f"device {device_id} allows {dev.max_smem}")
    kernel = jit.load(spec, device_id, g.smem_bytes)
    return PrefillKernel(kernel, g.smem_bytes, g.threads, spec.tile_tokens,
                         resident_ctas(device_id, kernel, g.threads, g.smem_bytes))


# (tile_tokens, stages) of paged_prefill_sm90 instead of the default, for tuning
# experiments (cupaged-bench prefill --tile N,S); set through set_sm90_tile.
_sm90_tile_override: tuple | None = None


def set_sm90_tile(tile: tuple | None) -> None:
    global _sm90_tile_override
    _sm90_tile_override = tile
    _prepared.clear()


def sm90_tile(head_size: int, fp8: bool, fp8_query: bool = False) -> tuple:
    if fp8_query:  # (its one shape: 128-key tiles, which a tuning override cannot change)
        return jit.default_sm90_prefill_tile(head_size, fp8, fp8_query)
    return _sm90_tile_override or jit.default_sm90_prefill_tile(head_size, fp8)


@jit.launcher_cache
def prefill_sm90_kernel(device_id: int, dtype: str, head_size: int, block_size: int,
                        variant: str = "", tile: tuple = (), cache_dtype: str = "",
                        kv_format: str = "tok", query_dtype: str = "") -> PrefillKernel:
    """paged_prefill_sm90 (Hopper's wgmma kernel) in ``tile`` (tile_tokens, stages; ()
    the default); ``query_dtype``: an 8-bit query's format (8-bit products)."""
    tt, st = tile or (0, 0)
    spec = jit.KernelSpec("paged_prefill_sm90", dtype, head_size, block_size, tile_tokens=tt,
                          stages=st, variant=variant, cache_dtype=cache_dtype,
                          kv_format=kv_format, arch=device_info(device_id).arch,
                          query_dtype=query_dtype)
    return _load_prefill(spec, geometry.Sm90PrefillGeometry.of(spec), device_id)


def sm90_applies(p: Problem, rows_needed: int) -> bool:
    """Does paged_prefill_sm90 serve this call? On Hopper (sm_90), for token-major caches
    of the query's own type (or fp8 with per-tensor scales, head sizes up to 192) and
    vLLM's layout (16-bit, blocks of 8 tokens or more), head sizes that are multiples of
    64 up to 256, and 384 and 512 over token-major caches of the query's type, when some
    (sequence, KV head) has SM90_MIN_ROWS packed query rows or more (its 128-row tiles,
    64 over 256 dims, would be mostly padding below that). A ``set_prefill_tile``
    override (paged_prefill's tiles) keeps the mma.sync kernel."""
    if _family_override == "mma" or _tile_override is not None:
        return False
    fp8 = p.cache.dtype != p.dtype
    # (over 256 dims its consumers split them: token-major caches; fp8 stops at 192)
    vllm_ok = not fp8 and p.block_size >= 8 and p.head_size <= 256
    return ((p.cache.kv_format == "tok" or vllm_ok) and p.head_size in catalog.SM90_HEAD_SIZES
            and (not fp8 or (p.quant.mode == "" and p.head_size <= 192))
            and (rows_needed >= SM90_MIN_ROWS or _family_override == "sm90")
            and device_info(p.device).arch == "sm_90")


class KernelPlan(NamedTuple):
    """What planning decides of a call's launches, all from host facts: the kernel, its
    grid and shared memory, the split-KV partition and how the partials are merged.
    ``launch.build`` packs it with the call's constants."""

    kind: str  # "decode" (one token per sequence), "rows" (decode's row mode), "prefill"
    kernel: jit.Launcher
    grid: tuple
    threads: int
    smem: int
    head: tuple  # the kernel's arguments after its partials: paged_prefill's split_tiles
    #              (paged_prefill_sm90's split_tiles, num_seqs and ranks), or paged_decode's
    #              counters (filled in per call when it merges its split)
    split_tokens: int = 0  # tokens per split-KV partition; 0: a single pass; -1: the flat
    #                        split (paged_decode's header), grid (CTAs, 1, 1)
    partitions: int = 1
    # The flat split's partial rows (two slots a CTA, a head tile each) and merge counters
    # (one a unit); 0 for the grid split's (rows x heads x partitions, and grid x * y).
    partial_rows: int = 0
    counters: int = 0
    combine: jit.Launcher | None = None  # merges the partials when the kernel does not
    combine_grid: tuple = ()
    combine_tail: tuple = ()  # the combine's arguments after the lengths and query starts


class Choice(NamedTuple):
    """Which kernel serves an attention call (and, for paged_prefill, its tile)."""

    kind: str  # "decode" | "prefill" | "rows"
    q_tiles: int = 0  # prefill: grid y
    tile: tuple = ()  # paged_prefill's (jit.PREFILL_TILE: warps, m_atoms, tile_tokens,
    #                   stages, key_warps); with sm90, paged_prefill_sm90's (tile_tokens,
    #                   stages)
    sm90: bool = False  # prefill: paged_prefill_sm90 instead of paged_prefill


def choose_kernel(p: Problem, has_starts: bool, max_q: int) -> Choice:
    """Which kernel serves an attention call, from host facts only (no device sync): the
    rules a new kernel family adds to. The host bounds may undercount, so they choose
    only among kernels that read ``query_start_loc`` whenever it is given."""
    fp8_query = p.query_dtype is not None
    if fp8_query:  # only the wgmma kernel multiplies 8-bit values, whatever the rows
        refuse_fp8_query(p, has_starts)
    elif not has_starts:
        return Choice("decode")  # one token per sequence, by the call's contract
    elif max_q <= 1 and p.num_rows == p.num_seqs:
        # Most likely a decode step: the decode kernel's row mode (split-KV included)
        # finds row r in sequence r at once, and any other split of the rows correctly.
        return Choice("rows")
    # vLLM's value layout is copied in 16-byte runs of one block: 8 tokens, 16 for fp8.
    if p.dtype.itemsize == 2 and (p.cache.kv_format == "tok"
                                  or p.block_size * p.cache.dtype.itemsize >= 16):
        packed = max_q * (p.num_heads // p.num_kv_heads)  # the longest sequence's rows
        if fp8_query or sm90_applies(p, packed):
            rows = geometry.sm90_prefill_rows(p.head_size)
            return Choice("prefill", _query_tiles(packed, rows),
                          sm90_tile(p.head_size, p.cache.dtype != p.dtype, fp8_query),
                          sm90=True)
        tile = prefill_tile(p, packed)
        rows = geometry.prefill_rows(p.head_size, tile[0], tile[1], tile[4])
        return Choice("prefill", _query_tiles(packed, rows), tile)
    return Choice("rows")


def _query_tiles(packed: int, rows: int) -> int:
    """The prefill grid's y: tiles of ``rows`` over the longest sequence's ``packed``
    query rows (at least one, at most the grid's limit)."""
    return max(1, min(_checks.MAX_GRID_YZ, -(-packed // rows)))


def refuse_fp8_query(p: Problem, has_starts: bool) -> None:
    """An 8-bit query runs on paged_prefill_sm90's 8-bit products alone: a clear error
    where that kernel does not apply."""
    why = []
    if device_info(p.device).arch != "sm_90":
        why.append(f"a Hopper GPU (device {p.device} is {device_info(p.device).arch})")
    if not has_starts:
        why.append("query_start_loc (the multi-token form; the decode form has none)")
    if p.head_size not in (64, 128):
        why.append(f"head size 64 or 128 (got {p.head_size})")
    if p.cache.kv_format != "tok":
        why.append("a token-major cache (NHD or HND), not vLLM's layout")
    if why:
        _fail("an 8-bit query needs " + ", ".join(why))


def prefill_split(k: PrefillKernel, p: Problem, plan: Choice, max_q: int, max_ctx: int,
                  variants: _variants.Variants, workspace) -> tuple:
    """``(tokens per split-KV partition, partitions)`` of paged_prefill; ``(0, 1)`` for a
    single pass. Each query tile splits its own keys (from its window's first tile, if
    any) into partitions, the last running to the end: few CTAs over long contexts (a
    shared prefix's queries, a chunk of a long prompt) would leave most SMs idle."""
    tn = k.tile_tokens
    # The keys of a query tile: at most its window plus its rows' positions (and a tile
    # of alignment), else the context. An undercount costs parallelism, never keys.
    span = max_ctx if not variants.window else min(max_ctx, variants.window + max_q + tn)
    if _split_override is not None:
        size = round_up(_split_override, tn)
    else:
        ctas = p.num_seqs * p.num_kv_heads * plan.q_tiles
        size = split_tokens(ctas, span, k.slots, tn, tn, False) if span > tn else 0
        size = cap_pass(size, span, tn, p.num_rows * p.num_heads, p.head_size,
                        k.slots if plan.sm90 else 0)
    if size and workspace is not None:
        size = fit_partitions(size, "auto", p, span, workspace.max_rows, tn)
    n_parts = min(partition_count(span, size), _checks.MAX_GRID_YZ)
    return (size, n_parts) if n_parts > 1 else (0, 1)


def plan_attention(p: Problem, has_starts: bool, max_q: int, max_ctx: int,
                   variants: _variants.Variants, alibi: bool,
                   workspace) -> KernelPlan | None:
    """The launches of an attention call (None: nothing to launch): the kernel
    choose_kernel picks, planned by its family's rule."""
    if not (p.num_seqs and p.num_rows):
        return None
    choice = choose_kernel(p, has_starts, max_q)
    if choice.kind == "prefill":
        return plan_prefill(p, choice, max_q, max_ctx, variants, alibi, workspace)
    return plan_decode(p, max_ctx, "auto", workspace, variants, rows=choice.kind == "rows")


def plan_decode(p: Problem, max_ctx: int, partition, workspace,
                variants: _variants.Variants = _variants.PLAIN,
                rows: bool = False) -> KernelPlan | None:
    """paged_decode's launch (and its combine) for a validated problem; None when there is
    nothing to launch. ``rows``: one CTA per query row, each finding its sequence in
    ``query_start_loc`` (attention's row mode). ``workspace``: the ``launch.Partials``
    where split-KV partials go (None: a scratch buffer per call), whose room caps the
    partitions."""
    if p.num_seqs == 0 or p.num_rows == 0:
        return None
    group = p.num_heads // p.num_kv_heads
    gt = group_tile(group)
    ks = decode_kernels(p.device, p.dtype.name, p.head_size, p.block_size, gt,
                        p.cache.kv_format, p.cache.dtype.name, p.quant.mode, variants.letters)
    if variants.window:  # the partitions cover the window (from a tile before it) only
        max_ctx = min(max_ctx, variants.window + ks.tile_tokens)
    grid_y = p.num_kv_heads * -(-group // gt)
    if grid_y > _checks.MAX_GRID_YZ:
        _fail(f"num_kv_heads * head tiles = {grid_y} exceeds the grid limit "
              f"{_checks.MAX_GRID_YZ}")
    ctas = p.num_rows * grid_y
    # Keys and values read, for a scratch's worth (FLAT_SCRATCH_MIN_BYTES); a workspace
    # needs none, and neither does the rule where the grid split would split too (its
    # partials are then a scratch of the call's own as well: nothing is saved).
    kv_bytes = (None if workspace is not None else
                2 * p.num_rows * p.num_kv_heads * max_ctx * p.head_size * p.cache.dtype.itemsize)
    if (partition == "auto" and kv_bytes is not None and kv_bytes < FLAT_SCRATCH_MIN_BYTES
            and partition_tokens("auto", p, max_ctx, ctas, ks)[0]):
        kv_bytes = None
    if partition == "flat" or partition == "auto" and flat_pays(ctas, max_ctx, ks, p.num_rows,
                                                                 kv_bytes):
        # (the flat split is its own specialization: variant letter "r")
        flat = decode_kernels(p.device, p.dtype.name, p.head_size, p.block_size, gt,
                              p.cache.kv_format, p.cache.dtype.name, p.quant.mode,
                              variants.letters + "r")
        if partition == "flat" or flat_keeps_residency(flat, ks):
            plan = plan_flat(p, flat, grid_y, gt, workspace, rows)
            if plan is not None:
                return plan
    if partition == "flat":  # where it cannot run: a workspace without the room
        partition = "auto"
    room = None if workspace is None else workspace.max_rows // (p.num_rows * p.num_heads)
    size, smem = partition_tokens(partition, p, max_ctx, ctas, ks, room)
    # Partials without counters (vLLM's v2 buffers) are merged by the combine kernel,
    # which takes a row per sequence: row mode then runs a single pass.
    counted = workspace is None or workspace.max_counters >= ctas
    if size and rows and not counted:
        size, smem = 0, residency(ctas, ks).smem
    if size and workspace is not None:
        fitted = fit_partitions(size, partition, p, max_ctx, workspace.max_rows,
                                max(ks.tile_tokens, p.block_size))
        if fitted != size:  # fewer partitions: a smaller grid, perhaps another residency
            size = fitted
            smem = residency(ctas * partition_count(max_ctx, size), ks).smem
    n_parts = partition_count(max_ctx, size)
    plan = KernelPlan("rows" if rows else "decode", ks.decode, (p.num_rows, grid_y, n_parts),
                      geometry.DECODE_THREADS, smem, (0,), size, n_parts)
    # The last partition of each (sequence, head tile) merges, counting in the workspace's
    # counters or the scratch's; partials without counters go through the combine kernel.
    if not size or counted:
        return plan
    return plan._replace(combine=ks.combine, combine_grid=(p.num_seqs, p.num_heads, 1),
                         combine_tail=(p.max_blocks * p.block_size, 0, size, n_parts,
                                       ks.tile_tokens))


# The most query rows "auto" gives the flat split: each of its CTAs first reads every
# row's length and scans them, 128 a round (the kernel's prologue), a cost measured small
# up to 256 rows (two rounds) and not measured beyond.
FLAT_MAX_ROWS = 512
# The least bytes of keys and values a call reads for "auto" to give it the flat split
# with a scratch of the call's own (no workspace): the scratch's allocation and memset
# cost about 8 us of host time a call (H200 machine, `cupaged-bench ab host`: 18.8 against
# 10.9 us with a workspace) where a single pass needs none, and the flat split's gain is
# a few percent of the kernel's time; 128 MiB take about 32 us at 4.2 TB/s.
FLAT_SCRATCH_MIN_BYTES = 128 << 20


def flat_pays(units: int, max_ctx: int, ks: "DecodeKernels", num_rows: int = 1,
              kv_bytes: int | None = None) -> bool:
    """Does "auto" take the flat split? Where there are at least as many (sequence, head
    tile) units as CTAs resident at once, each of two tiles or more: the grid's waves of
    whole units then leave a last wave the flat split does not have (H200, 32/32 batch
    64: 508 against 546 µs), while fewer units would be cut into many short pieces, each
    merged (docs/PERFORMANCE.md, the flat split). Not where a CTA's run would pass
    MAX_PASS_TOKENS (a pass's float32 sums lose accuracy with its length), nor past
    FLAT_MAX_ROWS query rows, nor, with a scratch of the call's own (``kv_bytes``, the
    bytes the call reads; None with a workspace), under FLAT_SCRATCH_MIN_BYTES."""
    if not ks.slots or units < ks.slots or max_ctx <= ks.tile_tokens:
        return False
    if num_rows > FLAT_MAX_ROWS:
        return False
    if kv_bytes is not None and kv_bytes < FLAT_SCRATCH_MIN_BYTES:
        return False
    run_tiles = -(-units * -(-max_ctx // ks.tile_tokens) // ks.slots)
    return run_tiles * ks.tile_tokens <= MAX_PASS_TOKENS


def flat_keeps_residency(flat: "DecodeKernels", ks: "DecodeKernels") -> bool:
    """Does the flat specialization hold as many CTAs at once as the grid one? Where its
    registers (about 128 a thread) allow fewer CTAs an SM than the grid kernel's shared
    memory does (fp8 caches: 4 against 6), "auto" keeps the grid split: the flat split
    was not measured at a lower residency."""
    return flat.slots >= ks.slots


def plan_flat(p: Problem, ks: "DecodeKernels", grid_y: int, gt: int, workspace,
              rows: bool = False) -> KernelPlan | None:
    """paged_decode's flat split (its header; ``ks``: the specialization with variant
    "r") over the query rows (decode's sequences, or ``rows``: the row mode's rows, each
    finding its sequence in ``query_start_loc``): one wave of CTAs at the natural
    residency, each taking an equal run of all the (row, head tile) units' key tiles; the
    kernel's partition_tokens is minus the row count. None where it cannot run: a
    workspace without room for its partials and counters, or runs whose flat tile
    arithmetic could pass 2^63 (never for a block table that fits in memory)."""
    occ = natural_residency(ks)
    ctas = max(1, occ.slots)
    units = p.num_rows * grid_y
    slots = 2 * ctas * gt  # partial rows: two slots a CTA, a head tile each
    if workspace is not None and (workspace.max_rows < slots or workspace.max_counters < units):
        return None
    most_tiles = units * (p.max_blocks * p.block_size // ks.tile_tokens + 2)
    if most_tiles * ctas >= 2**62:
        return None
    return KernelPlan("rows" if rows else "decode", ks.decode, (ctas, 1, 1),
                      geometry.DECODE_THREADS, occ.smem, (0,), -p.num_rows, 1,
                      partial_rows=slots, counters=units)


def plan_prefill(p: Problem, choice: Choice, max_q: int, max_ctx: int,
                 variants: _variants.Variants, alibi: bool,
                 workspace) -> KernelPlan:
    """The multi-token launch (and the combine of its split-KV). paged_prefill: grid x is
    (sequence, KV head), y the query tiles, heaviest first (the kernel's header), z the
    partitions. paged_prefill_sm90: persistent, about one CTA per SM over all partitions
    (z), each taking its share of the jobs (the kernel's header)."""
    # ALiBi and the soft-cap's fixed offset are compile-time variants of this kernel only.
    fp8_query = p.query_dtype is not None  # (8-bit P: no fixed offset, bfloat16's)
    letters = _variants.prefill_letters(variants, "" if fp8_query else p.dtype.name, alibi)
    if choice.sm90:
        k = prefill_sm90_kernel(p.device, p.dtype.name, p.head_size, p.block_size, letters,
                                choice.tile, p.cache.dtype.name, p.cache.kv_format,
                                p.query_dtype.name if fp8_query else "")
    else:
        k = prefill_kernel(p.device, p.dtype.name, p.head_size, p.block_size,
                           p.cache.kv_format, choice.tile, p.cache.dtype.name, p.quant.mode,
                           letters)
    size, n_parts = prefill_split(k, p, choice, max_q, max_ctx, variants, workspace)
    jobs = p.num_seqs * p.num_kv_heads
    if choice.sm90:
        # Persistent: as many CTAs as are resident at once (over the partitions), each
        # walking its share of the jobs (a pair of query tiles of one sequence and KV head).
        grid = (max(1, min(jobs * -(-choice.q_tiles // 2), k.slots // n_parts)), 1, n_parts)
        head = (size // k.tile_tokens, p.num_seqs, choice.q_tiles)
    else:
        grid = (jobs, choice.q_tiles, n_parts)
        head = (size // k.tile_tokens,)
    plan = KernelPlan("prefill", k.launch, grid, k.threads, k.smem, head, size, n_parts)
    if n_parts == 1:
        return plan
    # (The combine is loaded here, not with the kernel: most multi-token calls never split.)
    return plan._replace(combine=combine_kernel(p.device, p.dtype.name, p.head_size),
                         combine_grid=(p.num_rows, p.num_heads, 1),
                         combine_tail=(0, p.num_seqs, size, n_parts, k.tile_tokens))


# ---- absorbed MLA (mla_attention) ------------------------------------------------------------


# (rows, tile_tokens, stages) of mla_attention instead of the rule's, for tests of the
# shapes other GPUs get and for tuning; set through set_mla_tile.
_mla_tile_override: tuple | None = None


def set_mla_tile(tile: tuple | None) -> None:
    global _mla_tile_override
    _mla_tile_override = tile
    _prepared.clear()  # remembered MLA calls were planned under the old choice


def mla_tile(arch: str, rows_needed: int, cache_itemsize: int = 2,
             token_bytes: int = 0, rope: int = 64) -> tuple[int, int, int]:
    """(rows, tile_tokens, stages) of mla_attention: the fewest rows of 16, 32 and 64 that
    hold a sequence's packed rows (64 at most: a warp's O is 64 x 64 fp32), 32-token
    tiles where two stages fit (else 16), and as many stages up to four as fit (three
    tiles in flight keep a bandwidth-bound decode's copies busy). Where 64 rows do not
    fit even at 16 tokens (sm_86/89's 99 KiB), 32. 16 rows take two stages where that
    lets two CTAs share an SM (MlaGeometry.min_blocks). ``token_bytes``, ``rope``: as
    MlaGeometry's (656 and 64 for fp8_ds_mla rows; 528 or 288 and 0 for V4's)."""
    if _mla_tile_override is not None:
        return _mla_tile_override
    return _mla_tile(arch, 16 if rows_needed <= 16 else 32 if rows_needed <= 32 else 64,
                     cache_itemsize, token_bytes, rope)


@lru_cache(maxsize=None)  # (per call: a handful of keys)
def _mla_tile(arch: str, rows: int, cache_itemsize: int, token_bytes: int,
              rope: int = 64) -> tuple[int, int, int]:
    def fits(r, t, s):
        return geometry.MlaGeometry(512, rope, r, t, s, cache_itemsize, token_bytes).fits(arch)

    while rows > 16 and not fits(rows, 16, 2):
        rows //= 2
    tile = 32 if fits(rows, 32, 2) else 16
    stages = max(s for s in (2, 3, 4) if fits(rows, tile, s))
    if geometry.MlaGeometry(512, rope, rows, tile, 2, cache_itemsize,
                            token_bytes).min_blocks(arch) == 2:
        # Two CTAs an SM with two stages each overlap one's chain of phases (copy wait, S,
        # softmax, P V) with the other's, where one CTA's chain is slower than its bytes:
        # 16-head decode ran 1.19-1.32x faster than one CTA with four stages over bf16 on
        # an H200 (level on an H100), 1.2x over fp8 on an H100 (docs/PERFORMANCE.md).
        stages = 2
    return rows, tile, stages


class MlaKernel(NamedTuple):
    launch: jit.Launcher
    spec: jit.KernelSpec
    smem: int
    slots: int  # CTAs resident at once on the whole device


@jit.launcher_cache
def mla_kernel(device_id: int, dtype: str, cache_dtype: str, rank: int, rope: int,
               block_size: int, tile: tuple, sparse: bool = False,
               variant: str = "") -> MlaKernel:
    """mla_attention (or its sparse form, mla_sparse_attention, with ``variant`` "x": its
    second cache) in ``tile`` (rows, tile_tokens, stages)."""
    rows, tt, st = tile
    name = "mla_sparse_attention" if sparse else "mla_attention"
    spec = jit.KernelSpec(name, dtype, rank, block_size, rope_dim=rope, rows=rows,
                          tile_tokens=tt, stages=st, cache_dtype=cache_dtype, variant=variant,
                          arch=device_info(device_id).arch)
    g = geometry.MlaGeometry.of(spec)
    kernel = jit.load(spec, device_id, g.smem_bytes)
    return MlaKernel(kernel, spec, g.smem_bytes,
                     resident_ctas(device_id, kernel, g.threads, g.smem_bytes))


@jit.launcher_cache
def mla_sm90_kernel(device_id: int, dtype: str, cache_dtype: str, rank: int, rope: int,
                    block_size: int, sparse: bool = False, variant: str = "") -> MlaKernel:
    """mla_attention_sm90 (Hopper's wgmma kernel: 64 rows, 64-token tiles), or its sparse
    form mla_sparse_attention_sm90 (``variant`` "x": its second cache)."""
    name = "mla_sparse_attention_sm90" if sparse else "mla_attention_sm90"
    spec = jit.KernelSpec(name, dtype, rank, block_size, rope_dim=rope,
                          cache_dtype=cache_dtype, variant=variant,
                          arch=device_info(device_id).arch)
    g = geometry.MlaSm90Geometry.of(spec)
    kernel = jit.load(spec, device_id, g.smem_bytes)
    return MlaKernel(kernel, spec, g.smem_bytes,
                     resident_ctas(device_id, kernel, g.threads, g.smem_bytes))


# Which MLA kernel serves Hopper: None (the rule: the wgmma kernel where a sequence has 64
# packed rows or more, or 16 over pages of 16 tokens or more: PRODUCER_MIN_ROWS), "mma"
# (always mla_attention) or "sm90" (the wgmma
# kernel wherever it applies), for tests and A/B measurements; set through set_mla_family.
_mla_family: str | None = None


def set_mla_family(family: str | None) -> None:
    global _mla_family
    if family not in (None, "mma", "sm90"):
        raise ValueError(f"family must be None, 'mma' or 'sm90', got {family!r}")
    _mla_family = family
    _prepared.clear()  # remembered MLA calls were planned under the old choice


# fp8_ds_mla's rows take the wgmma kernel at every head count: its 256 threads widen a
# tile's 656-byte rows where the mma.sync kernel's one CTA an SM (their stages' size) has
# the widening on its chain. 16 heads on an H200 (cupaged-bench sparse-mla --preset dsa-16h
# --kv-cache-dtype fp8_ds_mla): 38.3 / 98.9 / 184.2 µs against mma.sync's 43.1 / 109.3 /
# 232.8 at batch 16 / 48 / 128. Not so 16-bit caches (37.3 against 32.8 at batch 16) nor
# V4's rows (169.0 against 131.5 at batch 128: two mma.sync CTAs an SM), whose 16 rows
# wgmma pads to 64.
WGMMA_EVERY_HEAD_COUNT = (_dtypes.DS_MLA.name,)

# Where warpgroup 1 copies alone (geometry.mla_sm90_producer: paged, pages of 16 tokens or
# more), by TMA over 16-bit caches and by bulk copies over dense fp8 ones, the wgmma kernel
# also takes 16 to 63 packed rows, padded to 64: on an H200 it ran 16 and 32 heads 0.99x
# to 1.65x the mma.sync kernel's speed (PERFORMANCE.md, MLA kernel step 19). Fewer rows
# are not measured.
PRODUCER_MIN_ROWS = 16


def mla_sm90_applies(arch: str, rows_needed: int, cache_dtype: str = "",
                     producer: bool = False) -> bool:
    """Whether the wgmma kernel serves an MLA call on ``arch``; ``producer``: the call's
    kernel would copy with warpgroup 1 alone (geometry.mla_sm90_producer)."""
    return (_mla_family != "mma" and arch == "sm_90"
            and (rows_needed >= 64 or _mla_family == "sm90"
                 or cache_dtype in WGMMA_EVERY_HEAD_COUNT
                 or (producer and rows_needed >= PRODUCER_MIN_ROWS))
            and _mla_tile_override is None)


# Split-KV of mla_attention instead of the cost model's choice, for tests and experiments:
# None (the model), 0 (never) or tiles per partition; set through set_mla_split.
_mla_split_override: int | None = None


def set_mla_split(tiles: int | None) -> None:
    global _mla_split_override
    _mla_split_override = tiles
    _prepared.clear()  # remembered MLA calls were planned under the old choice


MLA_MAX_PARTITIONS = 32


def mla_split(ctas: int, max_tiles: int, slots: int) -> int:
    """Tiles per split-KV partition of mla_attention (0: a single pass). A decode batch
    gives a CTA per (sequence, row tile): 128 sequences of 16 heads fill one CTA per SM
    once, and the SMs left over, or a batch of 8, idle. Splitting each row tile's keys
    into n partitions multiplies the CTAs; n is the one whose waves are fullest
    (ceil(ctas * n / slots) / n, each partition costing a little more for its combine),
    with at least 4 tiles a partition and at most MLA_MAX_PARTITIONS."""
    if _mla_split_override is not None:
        return _mla_split_override
    best, best_cost = 1, -(-ctas // slots)
    for n in range(2, min(MLA_MAX_PARTITIONS, max_tiles // 4) + 1):
        cost = -(-ctas * n // slots) / n * (1 + 0.02 * n)
        if cost < best_cost * 0.97:
            best, best_cost = n, cost
    return 0 if best == 1 else -(-max_tiles // best)


class MlaPlan(NamedTuple):
    """mla_attention's launch: kernel, grid (sequences x row tiles, 1, partitions), shared
    memory, tiles per partition (0: a single pass) and the combine of a split."""

    kernel: MlaKernel
    grid: tuple
    row_tiles: int
    split_tiles: int
    partitions: int
    combine: jit.Launcher | None = None
    combine_grid: tuple = ()
    combine_tail: tuple = ()


def plan_mla(device: int, dtype: str, cache_dtype: str, rank: int, rope: int,
             block_size: int, num_seqs: int, num_rows: int, num_heads: int, max_q: int,
             max_ctx: int, workspace_rows: int | None = None,
             sparse: bool = False, second_cache: bool = False) -> MlaPlan | None:
    """The launches of an MLA call (None: nothing to launch), from host facts only:
    ``max_q`` and ``max_ctx`` bound the query tokens and keys of a sequence (an undercount
    costs parallelism, never rows or keys); ``workspace_rows`` caps the split's partial
    rows (None: a scratch buffer per call). ``sparse``: mla_sparse_attention, whose
    "sequences" are query tokens (one each: ``max_q`` 1) and whose keys are a token's
    top-k entries (``max_ctx``: topk); on Hopper its wgmma form where a token has 64 heads
    or more (the paged kernels' rule) and over fp8_ds_mla rows at every head count
    (WGMMA_EVERY_HEAD_COUNT), the mma.sync kernel elsewhere. ``second_cache``: a sparse
    call with a second cache, read by either kernel in its variant "x" (``max_ctx`` then
    both topks' sum)."""
    if not (num_seqs and num_rows):
        return None
    rows_needed = max_q * num_heads
    arch = device_info(device).arch
    csize = _dtypes.CACHE_BY_NAME[cache_dtype].itemsize
    token_rows = _dtypes.SPARSE_BY_CACHE.get(cache_dtype)
    token_bytes = 0 if token_rows is None else token_rows.nbytes
    variant = "x" if second_cache else ""
    producer = geometry.mla_sm90_producer(block_size, sparse, token_rows is not None)
    if mla_sm90_applies(arch, rows_needed, cache_dtype, producer):
        k = mla_sm90_kernel(device, dtype, cache_dtype, rank, rope, block_size, sparse, variant)
        rows, tt = geometry.MlaSm90Geometry.rows, geometry.MlaSm90Geometry.tile_tokens
    else:
        tile = mla_tile(arch, rows_needed, csize, token_bytes, rope)
        k = mla_kernel(device, dtype, cache_dtype, rank, rope, block_size, tile, sparse,
                       variant)
        rows, tt = tile[0], tile[1]
    # Grid x is (sequence, row tile), at most 2^31 - 1 CTAs; the kernel strides over row
    # tiles past the bound's.
    row_tiles = max(1, min(_checks.INT32_MAX // max(1, num_seqs), -(-rows_needed // rows)))
    max_tiles = max(1, -(-max_ctx // tt))
    split = mla_split(num_seqs * row_tiles, max_tiles, k.slots)
    parts = -(-max_tiles // split) if split else 1
    if parts > 1 and workspace_rows is not None:
        parts = min(parts, workspace_rows // (num_rows * num_heads))
        split = -(-max_tiles // parts) if parts > 1 else 0
        parts = -(-max_tiles // split) if split else 1
    parts = min(parts, _checks.MAX_GRID_YZ)
    if parts <= 1:
        return MlaPlan(k, (num_seqs * row_tiles, 1, 1), row_tiles, 0, 1)
    return MlaPlan(k, (num_seqs * row_tiles, 1, parts), row_tiles, split, parts,
                   combine_kernel(device, dtype, rank), (num_rows, num_heads, 1),
                   (0, num_seqs, split * tt, parts, tt))


# A sparse prefill call over token rows widens each selected row in every CTA that reads
# it (a query token's row tiles each); from this many widenings a cached token, widening
# every row once into a 16-bit scratch (widen_sparse_rows: 656 bytes read, 1,152 written
# a row) and reading the 16-bit rows costs less.
WIDEN_ONCE_FACTOR = 4
# The scratch's rows at most (2^19: 604 MB of bfloat16 keys): a longer cache keeps the
# direct kernel rather than allocate more than its own size again per call.
WIDEN_MAX_ROWS = 1 << 19
# widen_sparse_rows' threads a row: fp8_ds_mla's 16-byte chunks (SparseRow's units)
_WIDEN_UNITS = {"dsmla": 41}


class SparseWidening(NamedTuple):
    """widen_sparse_rows' launch: every row of a sparse cache's rows into 16-bit keys."""

    kernel: jit.Launcher
    grid: tuple
    num_rows: int
    width: int  # the keys' values a row (fp8_ds_mla: 576)


def sparse_widening(device: int, dtype: str, cache_dtype: str, num_rows: int,
                    widened_rows: int) -> SparseWidening | None:
    """The widening of a sparse cache's ``num_rows`` token rows (``cache_dtype``, fp8_ds_mla)
    into ``dtype`` keys, where the direct kernel would widen ``widened_rows`` (its query
    tokens times topk times the wgmma kernel's row tiles of 64 heads: a host estimate) at
    least WIDEN_ONCE_FACTOR times as many, for at most WIDEN_MAX_ROWS rows; None where it
    would not (or for a format the 16-bit kernels cannot read in its place: V4's 512-dim
    rows)."""
    rows = _dtypes.SPARSE_BY_CACHE.get(cache_dtype)
    if cache_dtype not in _WIDEN_UNITS or not 0 < num_rows <= WIDEN_MAX_ROWS or \
            widened_rows < WIDEN_ONCE_FACTOR * num_rows:
        return None
    spec = jit.KernelSpec("widen_sparse_rows", dtype, cache_dtype=cache_dtype,
                          arch=device_info(device).arch)
    units = num_rows * _WIDEN_UNITS[cache_dtype]
    return SparseWidening(jit.load(spec, device), (-(-units // geometry.CACHE_THREADS), 1, 1),
                          num_rows, rows.values)
