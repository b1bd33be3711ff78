"""Input checks shared by the entry points: they read array metadata only (shape, dtype,
strides, pointer, device), never the data, so they cost no device sync."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from typing import NamedTuple

import numpy as np

from . import _dtypes

# Every multiple of 8 up to 256, then of 16 up to 512 (Gemma's global layers): above 256
# the multi-token kernel splits a head's dimensions over two warps, 16 at a time.
HEAD_SIZES = tuple(range(32, 257, 8)) + tuple(range(272, 513, 16))
BLOCK_SIZES = tuple(1 << i for i in range(9))  # 1 .. 256
INT32_MAX = 2**31 - 1
# Token positions are int32 in the kernels, which compute some up to a tile past the end.
MAX_TOKENS = INT32_MAX - 1024
MAX_GRID_YZ = 65535  # a launch grid's y and z
LOG2E = math.log2(math.e)
FLT_MAX = 3.4028234663852886e38

# CUPAGED_DEBUG=1 adds the checks that read device data (and so synchronize) to every call.
# Read through debug(), which a thread checking stand-in arrays turns off for itself.
DEBUG = os.environ.get("CUPAGED_DEBUG", "") not in ("", "0")
_local = threading.local()


def debug() -> bool:
    """Do this call's checks read device data? CUPAGED_DEBUG, unless this thread is inside
    :func:`metadata_only`."""
    return DEBUG and not getattr(_local, "metadata_only", False)


@contextlib.contextmanager
def metadata_only():
    """The checks on metadata alone, in this thread only: cupaged.jax validates and plans
    over stand-in arrays at trace time, whose device data cannot be read. Other threads
    (eager calls, other traces) keep CUPAGED_DEBUG as it is."""
    before = getattr(_local, "metadata_only", False)
    _local.metadata_only = True
    try:
        yield
    finally:
        _local.metadata_only = before


def fail(msg: str, exc=ValueError):
    raise exc(msg)


def check_dtype(a, name: str) -> _dtypes.DType:
    dt = _dtypes.lookup(a.dtype)
    if dt is None:
        fail(f"{name} dtype {a.dtype} is not supported: expected {_dtypes.supported_names()}",
             TypeError)
    return dt


def check_int(a, name: str, allowed=(np.int32,)) -> None:
    if a.dtype not in allowed:
        names = " or ".join(np.dtype(t).name for t in allowed)
        hint = f"{name}.astype(cupy.{np.dtype(allowed[0]).name})"
        fail(f"{name} must be {names}, got {a.dtype} (cupaged does not convert it: use {hint})",
             TypeError)


def is_real_number(x) -> bool:
    """A Python or NumPy integer or float, not a bool (what a scale or cap may be)."""
    return not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating))


def is_empty(a) -> bool:
    """No elements: every stride is then as good as any other."""
    return 0 in a.shape


def dense_tail(shape, strides, ndims: int, itemsize: int) -> bool:
    """Are the last ``ndims`` dimensions C-contiguous? (Strides of size-1 dims are free,
    and so are all strides of an empty array.)"""
    if 0 in shape:
        return True
    step = itemsize
    for n, st in zip(reversed(shape[-ndims:]), reversed(strides[-ndims:])):
        if n > 1 and st != step:
            return False
        step *= n
    return True


def check_head_size(head_size: int) -> None:
    if head_size not in HEAD_SIZES:
        fail(f"head_size {head_size} is not supported: expected a multiple of 8 from 32 to 256, or of 16 from 256 to 512")


def check_fp8_head_size(dt: _dtypes.DType, head_size: int) -> None:
    if dt.itemsize == 1 and head_size % 16:
        fail(f"head_size {head_size} is not supported with an fp8 cache: expected a multiple "
             f"of 16 (a cache row is copied in 16-byte pieces)")


class CacheShape(NamedTuple):
    dtype: _dtypes.DType
    num_blocks: int
    num_kv_heads: int
    head_size: int
    block_size: int


def _check_cache_dtype(name: str, a, dt: _dtypes.DType, ref: str) -> None:
    # fp8 (1-byte) storage was matched with its format by _kvquant.cache_dtype.
    if (a.dtype.itemsize != 1) if dt.itemsize == 1 else (a.dtype != dt.numpy):
        fail(f"{name} dtype {a.dtype} does not match {ref} dtype {dt.numpy}", TypeError)


def check_caches(key_cache, value_cache, dt: _dtypes.DType, ref: str = "query") -> CacheShape:
    """vLLM's cache layouts, of element type ``dt`` (that of ``ref``, or an fp8 format): key
    ``[num_blocks, num_kv_heads, head_size/x, block_size, x]``, value
    ``[num_blocks, num_kv_heads, head_size, block_size]``, each contiguous within a block,
    16-byte aligned with free block and head strides."""
    for name, a in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cache_dtype(name, a, dt, ref)
    x = 16 // dt.itemsize
    if key_cache.ndim != 5 or key_cache.shape[4] != x:
        fail(f"key_cache must be 5-D [num_blocks, num_kv_heads, head_size/{x}, block_size, {x}] "
             f"for {dt.numpy}, got shape {key_cache.shape}")
    if value_cache.ndim != 4:
        fail(f"value_cache must be 4-D [num_blocks, num_kv_heads, head_size, block_size], "
             f"got shape {value_cache.shape}")
    num_blocks, num_kv_heads, chunks, block_size, _ = key_cache.shape
    head_size = chunks * x
    check_head_size(head_size)
    check_fp8_head_size(dt, head_size)
    if value_cache.shape != (num_blocks, num_kv_heads, head_size, block_size):
        fail(f"value_cache shape {value_cache.shape} does not match the key cache: expected "
             f"{(num_blocks, num_kv_heads, head_size, block_size)}")
    if block_size not in BLOCK_SIZES:
        fail(f"block_size {block_size} is not supported: expected a power of two from 1 to 256")
    if num_kv_heads == 0:
        fail("the caches have no KV heads")
    if num_blocks > INT32_MAX:
        fail(f"key_cache has {num_blocks} blocks; at most {INT32_MAX} are supported")
    for name, a, inner in (("key_cache", key_cache, 3), ("value_cache", value_cache, 2)):
        if not dense_tail(a.shape, a.strides, inner, dt.itemsize):
            fail(f"{name} must be contiguous within a block (strides {a.strides})")
        outer = [st for n, st in zip(a.shape[:2], a.strides[:2]) if n > 1]
        if a.data.ptr % 16 or any(st % 16 or st < 0 for st in outer):
            fail(f"{name} must be 16-byte aligned with block and head strides that are "
                 f"multiples of 16 bytes (pointer {a.data.ptr:#x}, strides {a.strides})")
    return CacheShape(dt, num_blocks, num_kv_heads, head_size, block_size)


KV_LAYOUTS = ("NHD", "HND", "vllm")
# Where block_size and num_kv_heads sit in a token-major cache's 4-D shape.
_TOKEN_MAJOR_AXES = {"NHD": (1, 2), "HND": (2, 1)}


class CacheView(NamedTuple):
    """A validated K/V cache pair: its shape and the element strides the kernels use
    (``PagedKV`` in cuda_src/kv_layout.cuh)."""

    dtype: _dtypes.DType
    num_blocks: int
    num_kv_heads: int
    head_size: int
    block_size: int
    kv_format: str  # "tok" | "vllm"
    k_strides: tuple  # (block, head, token) in elements; token is 0 for vLLM's layout
    v_strides: tuple


def check_kv_layout(key_cache, value_cache, dt: _dtypes.DType, kv_layout: str,
                    ref: str = "query") -> CacheView:
    """The caches of ``kv_layout``: ``"NHD"`` ``[num_blocks, block_size, num_kv_heads,
    head_size]``, ``"HND"`` ``[num_blocks, num_kv_heads, block_size, head_size]`` (any
    strides, views of fused allocations included, with the last dimension contiguous, the
    pointer and every other stride a multiple of 16 bytes), or ``"vllm"`` (see
    :func:`check_caches`); block strides as :func:`check_block_strides` demands."""
    if type(kv_layout) is not str:
        fail(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    # A serving loop passes caches of the same shapes every call (each layer its own
    # pointers), and these checks read shapes, strides, dtypes and 16-byte alignment only:
    # a pass is remembered by exactly those (a failure is not), which saves about a third
    # of a call's validation (docs/PERFORMANCE.md, host time).
    k, v = key_cache, value_cache
    key = (k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype,
           (k.data.ptr | v.data.ptr) & 15, dt.name, kv_layout, ref)
    view = _LAYOUT_PASSED.get(key)
    if view is None:
        view = _kv_view(key_cache, value_cache, dt, kv_layout, ref)
        check_block_strides(view)
        if len(_LAYOUT_PASSED) >= _LAYOUT_PASSED_MAX:
            _LAYOUT_PASSED.clear()
        _LAYOUT_PASSED[key] = view
    return view


_LAYOUT_PASSED: dict = {}
_LAYOUT_PASSED_MAX = 256


def _kv_view(key_cache, value_cache, dt: _dtypes.DType, kv_layout: str, ref: str) -> CacheView:
    if kv_layout == "vllm":
        c = check_caches(key_cache, value_cache, dt, ref)
        it = dt.itemsize
        return CacheView(dt, c.num_blocks, c.num_kv_heads, c.head_size, c.block_size, "vllm",
                         (key_cache.strides[0] // it, key_cache.strides[1] // it, 0),
                         (value_cache.strides[0] // it, value_cache.strides[1] // it, 0))
    if kv_layout not in _TOKEN_MAJOR_AXES:
        fail(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    tok_axis, head_axis = _TOKEN_MAJOR_AXES[kv_layout]
    dims = ("[num_blocks, block_size, num_kv_heads, head_size]" if kv_layout == "NHD"
            else "[num_blocks, num_kv_heads, block_size, head_size]")
    for name, a in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cache_dtype(name, a, dt, ref)
        if a.ndim != 4:
            fail(f"{name} must be 4-D {dims} for kv_layout={kv_layout!r}, got shape {a.shape}")
    if value_cache.shape != key_cache.shape:
        fail(f"value_cache shape {value_cache.shape} does not match key_cache shape "
             f"{key_cache.shape}")
    shape = key_cache.shape
    if kv_layout == "HND":
        _check_not_vllm_hnd(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_size = (
        shape[0], shape[tok_axis], shape[head_axis], shape[3])
    check_head_size(head_size)
    check_fp8_head_size(dt, head_size)
    if block_size not in BLOCK_SIZES:
        fail(f"block_size {block_size} (key_cache.shape[{tok_axis}] for {kv_layout}) is not "
             f"supported: expected a power of two from 1 to 256")
    if num_kv_heads == 0:
        fail("the caches have no KV heads")
    if num_blocks > INT32_MAX:
        fail(f"key_cache has {num_blocks} blocks; at most {INT32_MAX} are supported")
    it = dt.itemsize
    views = []
    for name, a in (("key_cache", key_cache), ("value_cache", value_cache)):
        st = a.strides
        if st[3] != it:
            fail(f"{name}'s last dimension (head_size) must be contiguous, got strides {st}")
        outer = [x for n, x in zip(shape[:3], st[:3]) if n > 1]
        if a.data.ptr % 16 or any(x % 16 or x < 0 for x in outer):
            fail(f"{name} must be 16-byte aligned with block, head and token strides that "
                 f"are non-negative multiples of 16 bytes (pointer {a.data.ptr:#x}, strides "
                 f"{st})")
        views.append((st[0] // it, st[head_axis] // it, st[tok_axis] // it))
    return CacheView(dt, num_blocks, num_kv_heads, head_size, block_size, "tok", *views)


def _check_not_vllm_hnd(key_cache, value_cache) -> None:
    """cupaged's kv_layout names the order of a cache's shape (its strides are free);
    vLLM's flash caches always have the shape ``[num_blocks, block_size, num_kv_heads,
    head_size]`` and its "HND" names their memory order (a permuted view). Such a cache
    passed as "HND" has dimension 2 outside dimension 1 in memory, as has an HND-shaped
    view of token-major memory: which one it is cannot be told (when num_kv_heads ==
    block_size not even from the shape), so it is refused rather than read either way."""
    for name, a in (("key_cache", key_cache), ("value_cache", value_cache)):
        sh, st = a.shape, a.strides
        if sh[1] > 1 and sh[2] > 1 and st[1] < st[2]:
            fail(f"{name} of shape {sh} has strides {st}: its dimension 2 lies outside "
                 f"dimension 1 in memory. kv_layout='HND' takes the shape [num_blocks, "
                 f"num_kv_heads, block_size, head_size] (cupaged's layout names the shape's "
                 f"order, with any strides). A vLLM cache with VLLM_KV_CACHE_LAYOUT=HND has "
                 f"the shape [num_blocks, block_size, num_kv_heads, head_size] over head-major "
                 f"memory: pass it as kv_layout='NHD' (or write it with "
                 f"reshape_and_cache_flash); an HND-shaped view of token-major memory likewise "
                 f"goes as its NHD-shaped tensor")


def check_block_strides(view: CacheView) -> None:
    """The attention kernels compute a block's offset as one 32x32->64-bit product and
    offsets within a block in 32 bits: block strides below 2^32 elements, a block's rows
    within 2^31 (any real cache: a block of 256 tokens x 256 heads x 256 dims is 2^24)."""
    for name, (block, _, token) in (("key_cache", view.k_strides),
                                    ("value_cache", view.v_strides)):
        within = ((view.block_size - 1) * token + view.head_size if view.kv_format == "tok"
                  else view.block_size * view.head_size)
        if block >= 2**32 or within >= 2**31:
            fail(f"{name}'s block stride ({block} elements) or a block's extent ({within}) is "
                 f"too large: at most 2^32 and 2^31 elements")


def host_bound(value, name: str, cap: int) -> int:
    """A host-side upper bound given by the caller (max_context_len, max_query_len,
    max_seq_len), used only to size work: None means ``cap``, larger values are capped."""
    if value is None:
        return cap
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        fail(f"{name} must be an int, got {type(value).__name__}", TypeError)
    if value < 0:
        fail(f"{name} must be >= 0, got {value}")
    return min(int(value), cap)


def check_table_rows(block_tables, num_seqs: int, shape: str) -> int:
    """int32 ``block_tables [num_seqs, max_blocks]`` (``shape``: the expected shape's words
    for the error) with contiguous rows a whole number of entries apart; returns
    max_blocks."""
    check_int(block_tables, "block_tables")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        fail(f"block_tables must be {shape}, got shape {block_tables.shape}")
    max_blocks = block_tables.shape[1]
    st = block_tables.strides
    if num_seqs and ((max_blocks > 1 and st[1] != 4) or st[0] < 0 or st[0] % 4):
        # (empty: strides free) The kernels index rows in entries: bytes / 4.
        fail(f"block_tables' rows must be contiguous, a whole number of entries apart "
             f"(strides {st})")
    return max_blocks


def check_tables(block_tables, lens, lens_name: str, num_seqs: int, block_size: int,
                 max_tokens: int) -> int:
    """int32 ``block_tables [num_seqs, max_blocks]`` with contiguous rows and int32 ``lens
    [num_seqs]`` (contiguous); returns max_blocks. A row may hold at most ``max_tokens``."""
    max_blocks = check_table_rows(block_tables, num_seqs,
                                  f"[num_seqs={num_seqs}, max_blocks_per_seq]")
    check_int(lens, lens_name)
    if max_blocks * block_size > max_tokens:
        fail(f"block_tables allows {max_blocks * block_size} tokens per sequence; at most "
             f"{max_tokens} are supported")
    if lens.shape != (num_seqs,) or (num_seqs > 1 and lens.strides[0] != 4):
        fail(f"{lens_name} must be a contiguous [num_seqs={num_seqs}] array, got shape "
             f"{lens.shape} (num_seqs: the rows of block_tables {block_tables.shape})")
    return max_blocks


def check_alibi_and_out(alibi, out, query, num_heads: int, same_dtype: bool = True) -> None:
    """Optional ``alibi_slopes`` (float32 ``[num_heads]``, contiguous) and ``out`` (the
    query's shape, C-contiguous, and its dtype unless ``same_dtype`` is False: an 8-bit
    query's output, whose type the caller checked) of an attention entry point."""
    if alibi is not None:
        if alibi.dtype != np.float32:
            fail(f"alibi_slopes must be float32, got {alibi.dtype}", TypeError)
        if alibi.shape != (num_heads,) or alibi.strides[0] != 4:
            fail(f"alibi_slopes must be a contiguous [num_heads={num_heads}] array, "
                 f"got shape {alibi.shape}")
    if out is not None:
        if same_dtype and out.dtype != query.dtype:
            fail(f"out dtype {out.dtype} does not match query dtype {query.dtype}", TypeError)
        if out.shape != query.shape or not (is_empty(query) or out.flags.c_contiguous):
            fail(f"out must be a C-contiguous array of shape {query.shape}, got shape "
                 f"{out.shape} with strides {out.strides}")


def check_element_strides(a, name: str, itemsize: int) -> None:
    """The kernels take ``a``'s strides in elements: each must be a whole number of them
    (a view made with byte strides, such as ``as_strided``, may not be)."""
    if not is_empty(a) and any(st % itemsize for st in a.strides):
        fail(f"{name}'s strides must be multiples of its itemsize ({itemsize} bytes), got "
             f"{a.strides}")


def check_own_bytes(a, name: str) -> None:
    """Each element of ``a`` has bytes of its own, as an array a kernel writes needs (two
    elements on the same bytes would be written by two threads of one launch, in either
    order). Checked by the rule that holds for every cache layout: ordered by stride, each
    dimension of more than one element steps past the extent of those below it."""
    if not is_empty(a) and not _own_bytes(a.shape, a.strides, a.dtype.itemsize):
        fail(f"{name}'s elements overlap (shape {a.shape}, strides {a.strides}): an "
             f"array written here needs bytes of its own for each element")


@functools.lru_cache(maxsize=256)
def _own_bytes(shape: tuple, strides: tuple, itemsize: int) -> bool:
    """check_own_bytes' rule, by layout (a cache's is the same every call)."""
    reach = itemsize
    for st, n in sorted((st, n) for n, st in zip(shape, strides) if n > 1):
        if st < reach:
            return False
        reach += st * (n - 1)
    return True


def check_same_device(device: int, ref: str, arrays) -> None:
    """``arrays``: (name, array or None) pairs that must all live on ``device``."""
    for name, a in arrays:
        if a is not None and a.data.device_id != device:
            fail(f"{name} is on device {a.data.device_id} but {ref} is on device {device}")


def extent(a) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` an array's elements lie in (empty for no elements)."""
    p = a.data.ptr
    lo, hi = _extent_offsets(a.shape, a.strides, a.dtype.itemsize)
    return p + lo, p + hi


@functools.lru_cache(maxsize=1024)
def _extent_offsets(shape: tuple, strides: tuple, itemsize: int) -> tuple[int, int]:
    """extent's range relative to the array's address, by layout (the same every call)."""
    if 0 in shape:
        return 0, 0
    lo = hi = 0
    for n, st in zip(shape, strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + itemsize


def _spans(arrays) -> list:
    """(name, array, extent) of each non-empty array among (name, array or None) pairs."""
    return [(name, a, extent(a)) for name, a in arrays if a is not None and not is_empty(a)]


def _refuse_overlap(first, second, may_alias) -> None:
    """Fail where the spans ``first`` and ``second`` (of _spans) overlap, unless
    ``may_alias`` lets them be the very same array."""
    (n1, a1, (lo1, hi1)), (n2, a2, (lo2, hi2)) = first, second
    if lo1 >= hi2 or lo2 >= hi1:
        return
    aliasable = (n1, n2) in may_alias or (n2, n1) in may_alias
    if aliasable and (a1.data.ptr, a1.shape, a1.strides, a1.dtype) == (
            a2.data.ptr, a2.shape, a2.strides, a2.dtype):
        return
    fail(f"{n1} and {n2} overlap in memory (bytes {lo1:#x}-{hi1:#x} and "
         f"{lo2:#x}-{hi2:#x}): they must be separate arrays"
         + (f", or {n2} exactly {n1}" if aliasable else ""))


def check_disjoint(arrays, may_alias=()) -> None:
    """``arrays``: (name, array or None) pairs whose memory must not overlap, judged by
    their byte ranges. ``may_alias``: name pairs allowed to be the very same array (same
    address, shape and strides), as an output written in place over its input."""
    spans = _spans(arrays)
    for i, first in enumerate(spans):
        for second in spans[i + 1:]:
            _refuse_overlap(first, second, may_alias)


def check_apart(written, read, may_alias=(), written_apart: bool = True) -> None:
    """Each written ``(name, array or None)`` overlaps no read one and, with
    ``written_apart``, no other written one (``may_alias`` as for :func:`check_disjoint`);
    read arrays may share memory. Each array's extent is computed once."""
    w, r = _spans(written), _spans(read)
    for i, first in enumerate(w):
        for second in (*r, *w[i + 1:]) if written_apart else r:
            _refuse_overlap(first, second, may_alias)


def check_row_cache(kc, width: int, owner: str = "") -> tuple[int, int]:
    """A paged cache of ``width``-byte token rows: 1-byte storage ``[num_blocks, block_size,
    width]``, or ``[num_blocks, block_size, 1, width]`` (FlashMLA's). Returns ``(num_blocks,
    block_size)``; errors name kv_cache, ``owner`` before it (e.g. "an fp8_ds_mla ")."""
    if kc.dtype.itemsize != 1:
        fail(f"{owner}kv_cache is 1-byte storage (uint8, int8 or a float8 type) "
             f"[num_blocks, block_size, {width}], got {kc.dtype}", TypeError)
    if not (kc.ndim == 3 or (kc.ndim == 4 and kc.shape[2] == 1)) or kc.shape[-1] != width:
        fail(f"{owner}kv_cache must be [num_blocks, block_size, {width}] (or [num_blocks, "
             f"block_size, 1, {width}], FlashMLA's), got shape {kc.shape}")
    return kc.shape[0], kc.shape[1]


def check_new_out(o, dtype, shape: tuple, name: str = "out") -> None:
    """A caller's output array for a result of ``dtype`` and ``shape``, C-contiguous (None
    passes: the call allocates one)."""
    if o is not None and (o.dtype != dtype or o.shape != shape or not (
            is_empty(o) or o.flags.c_contiguous)):
        fail(f"{name} must be a C-contiguous {np.dtype(dtype).name} array of shape {shape}, "
             f"got {o.dtype} {o.shape} with strides {o.strides}")


def check_aligned(ptr: int, name: str, alignment: int = 16) -> None:
    """The kernels load and store this pointer ``alignment`` bytes at a time."""
    if ptr % alignment:
        fail(f"{name} must start on a {alignment}-byte boundary (address {ptr:#x} is "
             f"{ptr % alignment} bytes past one)")
