"""Cache maintenance: write new tokens into a paged cache, copy blocks, swap blocks.

All three launch one kernel on the device the caches live on, without synchronizing: on
``stream`` when given, else torch's current stream when the caches are torch tensors,
else CuPy's current stream.
"""

from __future__ import annotations

import ctypes
import math
import struct
from typing import NamedTuple

import cupy
import numpy as np
from cupy_backends.cuda.api import runtime

from . import _arrays, _checks, _dtypes, _kvquant, _prepared, jit, planning
from .specs.geometry import CACHE_THREADS
from ._arrays import as_device_array

__all__ = ["concat_and_cache_mla", "copy_blocks", "copy_blocks_mla", "empty_pinned",
           "indexer_k_quant_and_cache", "reshape_and_cache",
           "reshape_and_cache_flash", "swap_blocks"]

_INDEX = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}
_fail = _checks.fail


@jit.launcher_cache
def _kernel(device_id: int, kernel: str, dtype: str, index_dtype: str, kv_format: str = "",
            cache_dtype: str = "", kv_scale: str = ""):
    spec = jit.KernelSpec(kernel, dtype, index_dtype=index_dtype, kv_format=kv_format,
                          cache_dtype=cache_dtype, kv_scale=kv_scale,
                          arch=planning.device_info(device_id).arch)
    return jit.load(spec, device_id)


def _check_index_array(a, name: str, shape) -> str:
    _checks.check_int(a, name, (np.int32, np.int64))
    if a.shape != shape or not (_checks.is_empty(a) or a.flags.c_contiguous):
        _fail(f"{name} must be a contiguous array of shape {shape}, got shape {a.shape} "
              f"with strides {a.strides}")
    return _INDEX[a.dtype]


def _check_slots(sm, sources) -> tuple[int, str]:
    """A cache write's ``slot_mapping`` (1-D int32/int64: the tokens written) against its
    ``sources`` ((name, array) pairs): (num_tokens, index type). The sources may hold more
    rows (an engine pads them to a CUDA graph's batch), which are not read."""
    if sm.ndim != 1:
        _fail(f"slot_mapping must be 1-D [num_tokens], got shape {sm.shape}")
    num_tokens = sm.shape[0]
    for name, a in sources:
        if a.shape[0] < num_tokens:
            _fail(f"{name} has {a.shape[0]} tokens but slot_mapping has {num_tokens}: the "
                  f"sources need a row for every slot")
    return num_tokens, _check_index_array(sm, "slot_mapping", (num_tokens,))


def _debug_check_slots(sm, num_slots: int, ctx) -> None:
    """With CUPAGED_DEBUG=1, a slot past the cache raises (a device sync) instead of being
    skipped."""
    if _checks.debug():
        s = _arrays.to_host(sm, ctx)
        bad = np.flatnonzero(s >= num_slots)
        if bad.size:
            _fail(f"slot_mapping[{bad[0]}] = {s[bad[0]]} is past the cache ({num_slots} slots)")


# ---- reshape_and_cache ----------------------------------------------------------------------


class _Write(NamedTuple):
    """A validated reshape_and_cache call."""

    cache: _checks.CacheView  # its dtype is the cache's element type
    num_tokens: int
    index: str  # slot_mapping's element type: "i32" | "i64"
    device: int
    vec_src: bool  # every key and value row is 16-byte aligned: vector loads
    source: _dtypes.DType  # key's and value's element type
    quant: _kvquant.KVQuant


def _rows_aligned(a) -> bool:
    """Does every ``[token, head]`` row of a source start on a 16-byte boundary? (The
    stride of a dimension of size 1 is never used.)"""
    return a.data.ptr % 16 == 0 and all(
        st % 16 == 0 for n, st in zip(a.shape[:2], a.strides[:2]) if n > 1)


def validate_write(k, v, kc, vc, sm, kv_layout, kv_cache_dtype="auto", k_scale=None,
                    v_scale=None) -> _Write:
    """Every check of reshape_and_cache, on array metadata only (no device sync)."""
    src = _checks.check_dtype(k, "key")
    dt = _kvquant.cache_dtype(kv_cache_dtype, kc, vc, src, source="keys and values")
    if dt is src:  # a float cache: key and value must have its dtype
        src = dt = _checks.check_dtype(kc, "key_cache")
    if not isinstance(kv_layout, str):
        _fail(f"kv_layout must be one of {_checks.KV_LAYOUTS}, got {kv_layout!r}", TypeError)
    if kv_layout == "vllm" and kc.ndim == 4:
        _fail(f"key_cache is 4-D (shape {kc.shape}) but kv_layout='vllm' (the default) takes "
              f"vLLM's 5-D key cache [num_blocks, num_kv_heads, head_size/x, block_size, x]: "
              f"for an NHD or HND cache pass kv_layout=\"NHD\" or kv_layout=\"HND\"")
    cache = _checks.check_kv_layout(kc, vc, dt, kv_layout, ref="key_cache")
    want = (cache.num_kv_heads, cache.head_size)
    for name, a in (("key", k), ("value", v)):
        if a.dtype != src.numpy:
            _fail(f"{name} dtype {a.dtype} does not match "
                  + (f"key dtype {src.numpy}" if dt is not src else f"the cache dtype {dt.numpy}"),
                  TypeError)
        if a.ndim != 3 or a.shape[1:] != want:
            _fail(f"{name} must be [num_tokens, {want[0]}, {want[1]}] (num_tokens, num_kv_heads, "
                  f"head_size), got shape {a.shape}")
        if not _checks.is_empty(a) and (
                (a.shape[2] > 1 and a.strides[2] != src.itemsize) or min(a.strides) < 0):
            _fail(f"{name}'s last dimension must be contiguous and its strides non-negative "
                  f"(strides {a.strides})")
        _checks.check_element_strides(a, name, src.itemsize)
    num_tokens, index = _check_slots(sm, (("key", k), ("value", v)))
    # What the launch writes: each slot's bytes its own, and apart from what it reads (K
    # and V may be halves of one allocation, whose extents overlap, but not one array).
    _checks.check_own_bytes(kc, "key_cache")
    _checks.check_own_bytes(vc, "value_cache")
    _checks.check_apart((("key_cache", kc), ("value_cache", vc)),
                        (("key", k), ("value", v), ("slot_mapping", sm)), written_apart=False)
    if kc.data.ptr == vc.data.ptr and not _checks.is_empty(kc):
        _fail("key_cache and value_cache are the same memory: each token's K and V need "
              "slots of their own")
    device = kc.data.device_id
    _checks.check_same_device(device, "key_cache", (("value_cache", vc), ("key", k),
                                                    ("value", v), ("slot_mapping", sm)))
    quant = _kvquant.scales(k_scale, v_scale, None if dt is src else dt, cache, device,
                            "key_cache")
    if quant.mode == "th":  # written by the kernel: no overlap with what it reads
        _checks.check_disjoint((("k_scale", quant.keep[0]), ("v_scale", quant.keep[1]),
                                ("key", k), ("value", v), ("slot_mapping", sm)))
    return _Write(cache, num_tokens, index, device, _rows_aligned(k) and _rows_aligned(v),
                  src, quant)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                      k_scale=None, v_scale=None, *, kv_layout="vllm", stream=None) -> None:
    """Write each token's K and V into its cache slot, in any cache layout.

    Args:
        key, value: ``[n, num_kv_heads, head_size]`` with ``n >= num_tokens`` (rows past
            ``num_tokens``, such as a CUDA graph's padding, are not read), the caches'
            dtype (float16, bfloat16 or float32); token and head strides are free (slices
            of a fused QKV work), the last dimension contiguous. Rows that are 16-byte aligned (pointer,
            token and head strides) are read in 16-byte vectors, others element by element.
        key_cache, value_cache: the paged cache in ``kv_layout``, as for
            :func:`cupaged.attention`:
            ``"vllm"`` (default; vLLM's ``reshape_and_cache``): key ``[num_blocks,
            num_kv_heads, head_size // x, block_size, x]`` with ``x = 16 // itemsize``,
            value ``[num_blocks, num_kv_heads, head_size, block_size]``;
            ``"NHD"``: ``[num_blocks, block_size, num_kv_heads, head_size]``;
            ``"HND"``: ``[num_blocks, num_kv_heads, block_size, head_size]`` (vLLM's flash
            caches are ``"NHD"`` in either of vLLM's layouts: see
            :func:`reshape_and_cache_flash`). NHD/HND caches may be views with any
            strides (K and V halves of ``[num_blocks, 2, ...]`` or of ``[..., 2 *
            head_size]``) whose last dimension is contiguous and whose pointer and other
            strides are multiples of 16 bytes; they are written in place.
        slot_mapping: int32 or int64 ``[num_tokens]`` on the device, ``slot = block *
            block_size + offset``: one per token written (the first ``num_tokens`` rows of
            key and value); a negative slot marks a padding token that is skipped.
        kv_cache_dtype: ``"auto"`` (the caches hold key's dtype, or the fp8 format their
            float8 dtype names), ``"fp8"``/``"fp8_e4m3"`` or ``"fp8_e5m2"`` (any 1-byte
            storage), as vLLM's. An fp8 cache stores ``value / scale``: each value widened
            to float32, divided by the scale's float32 value (an IEEE division, not a
            product with its reciprocal), rounded to nearest even and saturated to the
            format's largest finite value (448 for e4m3, 57344 for e5m2; NaN stays NaN).
            Bit for bit torch's ``(x.float() / s).clamp(-max, max).to(float8)`` with
            ``s`` a float32 CUDA tensor, whatever form the scale takes here (torch's
            ``x.float() / number`` multiplies by the reciprocal on CUDA and can round one
            step apart). Sources must be float16 or bfloat16.
        k_scale, v_scale: per tensor, in the forms every entry point takes (docs/API.md,
            "fp8 scale forms"): a positive finite number (rounded to float32), a
            one-element CPU torch tensor or a one-element float32 device array (default
            1); per token and head, float32 ``[num_blocks, num_kv_heads, block_size]``
            arrays into which each written (token, head) gets ``amax(|row|) / max`` (1 for
            a row of zeros) before its row is divided by it (a row holding an infinity
            gets an infinite scale, and reads back as NaN throughout). Per-tensor scales
            are ignored (unchecked) for 16-bit caches; per-token arrays are refused there.
        kv_layout: ``"vllm"`` (default), ``"NHD"`` or ``"HND"``.
        stream: as for :func:`cupaged.paged_attention` (torch's current stream when
            ``key_cache`` is a torch tensor).

    Slots past the cache are skipped too (never written outside it); ``CUPAGED_DEBUG=1``
    raises for them instead (with a device sync). Arrays may be CuPy arrays, torch CUDA
    tensors or any ``__dlpack__`` producer on one device.

    A write whose arrays' metadata (shapes, strides, dtypes, device, 16-byte alignment),
    scales and keywords match an earlier successful write's skips validation; whether the
    caches overlap what the write reads is still checked at every call's addresses.
    """
    mk, ptrs = _prepared.key("reshape_and_cache",
                             (key, value, key_cache, value_cache, slot_mapping),
                             (k_scale, v_scale), (kv_layout, kv_cache_dtype))
    prep = _prepared.lookup(mk)
    # (the same array as both caches passes the overlap pairs, which leave K's and V's
    # caches apart: repeated here)
    if prep is None or ptrs[2] == ptrs[3] or _prepared.any_overlap(prep.disjoint, ptrs):
        prep, ptrs = _prepare_write(key, value, key_cache, value_cache, slot_mapping,
                                    kv_layout, kv_cache_dtype, k_scale, v_scale, stream)
        _prepared.remember(mk, prep)
    if prep.kernel is None:
        return
    with _arrays.launching(prep.device):
        ctx = _arrays.context(prep.device, prep.kind, stream)
        _launch(prep.kernel, prep.write, ctx.stream, ptrs, prep.source_strides)


class _PreparedWrite(NamedTuple):
    """A remembered reshape_and_cache call: what a repeat with the same metadata still
    does is check its addresses (``disjoint``, _prepared.any_overlap) and launch."""

    kernel: object  # None: no token to write
    write: _Write
    device: int
    kind: str  # _arrays.stream_framework of the arrays: whose current stream
    source_strides: tuple  # key's and value's token and head strides, in elements
    disjoint: tuple


def _prepare_write(key, value, key_cache, value_cache, slot_mapping, kv_layout,
                   kv_cache_dtype, k_scale, v_scale, stream) -> tuple:
    """``(prepared write, addresses of key, value, the caches and slot_mapping)``: every
    check (CUPAGED_DEBUG's slot read too), then the launcher."""
    k = as_device_array(key, "key")
    v = as_device_array(value, "value")
    kc = as_device_array(key_cache, "key_cache")
    vc = as_device_array(value_cache, "value_cache")
    sm = as_device_array(slot_mapping, "slot_mapping")
    w = validate_write(k, v, kc, vc, sm, kv_layout, kv_cache_dtype, k_scale, v_scale)
    kind = _arrays.stream_framework(key_cache, value_cache, key, value)
    ptrs = _prepared.addresses(k, v, kc, vc, sm)
    # validate_write's checks that read addresses, to repeat at each call's (an empty
    # write's too, which validation holds to them): each cache apart from the three
    # arrays read (not from the other cache: halves of one array), and per-token scale
    # arrays (keyed at their addresses) apart from those and each other.
    read = ((0, k), (1, v), (4, sm))
    disjoint = (_prepared.disjoint_spans(((2, kc),), read)
                + _prepared.disjoint_spans(((3, vc),), read))
    if w.quant.mode == "th":
        disjoint += (_prepared.disjoint_spans(tuple((None, a) for a in w.quant.keep), read)
                     + _prepared.disjoint_spans(((0, k),), ((1, v), (4, sm)))
                     + _prepared.disjoint_spans(((1, v),), ((4, sm),)))
    if w.num_tokens == 0:
        return _PreparedWrite(None, w, w.device, kind, (), disjoint), ptrs
    if _checks.debug():  # (the imports are stamped and held by the launch's own context)
        with _arrays.on_device(w.device):
            ctx = _arrays.check_context(w.device, kind, stream)
            _debug_check_slots(sm, w.cache.num_blocks * w.cache.block_size, ctx)
    return _PreparedWrite(write_kernel(w), w, w.device, kind, _source_strides(w, k, v),
                          disjoint), ptrs


def write_kernel(w: _Write):
    """reshape_and_cache's launcher for a validated write (loaded on first use)."""
    return _kernel(w.device, "reshape_and_cache", w.source.name, w.index, w.cache.kv_format,
                   w.cache.dtype.name, w.quant.mode)


def _source_strides(w: _Write, k, v) -> tuple:
    it = w.source.itemsize
    return k.strides[0] // it, k.strides[1] // it, v.strides[0] // it, v.strides[1] // it


def launch_write(kern, w: _Write, stream: int, k, v, kc, vc, sm) -> None:
    """Launch a validated write on ``stream`` (a handle) for adapted arrays with the
    metadata ``w`` was validated with (their addresses are free)."""
    _launch(kern, w, stream, (k.data.ptr, v.data.ptr, kc.data.ptr, vc.data.ptr, sm.data.ptr),
            _source_strides(w, k, v))


def _launch(kern, w: _Write, stream: int, ptrs, source_strides) -> None:
    """The write's launch: ``ptrs`` the addresses of key, value, the caches and
    slot_mapping, ``source_strides`` key's and value's token and head strides (elements)."""
    cache, q = w.cache, w.quant
    kp, vp, kcp, vcp, smp = ptrs
    ks0, ks1, vs0, vs1 = source_strides
    kern((w.num_tokens, 1, 1), CACHE_THREADS, 0, stream,
         kp, ks0, ks1, vp, vs0, vs1, kcp, *cache.k_strides, vcp, *cache.v_strides,
         smp, cache.num_kv_heads, cache.head_size, cache.block_size,
         cache.num_blocks * cache.block_size, int(w.vec_src), q.k_ptr, q.v_ptr,
         q.block_stride, q.head_stride, q.k_value, q.v_value)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                            kv_cache_dtype="auto", k_scale=None, v_scale=None, *,
                            stream=None) -> None:
    """vLLM's ``reshape_and_cache_flash``, with its argument order and its convention: the
    caches have the shape ``[num_blocks, block_size, num_kv_heads, head_size]`` whatever
    their memory order (vLLM's ``VLLM_KV_CACHE_LAYOUT`` NHD, or HND as a permuted view,
    or K and V halves of one packed ``[num_blocks, num_kv_heads, block_size, 2 *
    head_size]`` allocation). That is cupaged's ``kv_layout="NHD"``, which reads any
    strides: the same as ``reshape_and_cache(..., kv_layout="NHD")``; read the caches
    back with ``attention(..., kv_layout="NHD")``. Arguments as for
    :func:`reshape_and_cache`."""
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                      k_scale, v_scale, kv_layout="NHD", stream=stream)


# ---- block copies -----------------------------------------------------------------------------

_COPY_TENSORS = 96  # kMaxCopyTensors in cuda_src/cache_ops.cuh
_COPY_TABLE = struct.Struct(f"{4 * _COPY_TENSORS}q")  # CopyTable: 4 int64 per tensor
_COPY_PAD = (0,) * (4 * _COPY_TENSORS)


# ---- concat_and_cache_mla --------------------------------------------------------------------


class _MlaWrite(NamedTuple):
    """A validated concat_and_cache_mla call: the two destinations' element strides."""

    num_tokens: int
    index: str
    device: int
    source: _dtypes.DType
    cache: _dtypes.DType  # the source's type, or an fp8 format
    rank: int
    rope: int
    block_size: int
    num_blocks: int
    latent: tuple  # (pointer, block stride, token stride), elements
    rope_dst: tuple
    vec_src: bool


def _check_mla_sources(kv_c, k_pe) -> _dtypes.DType:
    """kv_c's and k_pe's dtype (float16 or bfloat16, one for both) and form (2-D, the last
    dimension contiguous, strides non-negative); returns their type."""
    src = _checks.check_dtype(kv_c, "kv_c")
    if src.itemsize != 2:
        _fail(f"kv_c must be float16 or bfloat16, got {src.numpy}", TypeError)
    for name, a in (("kv_c", kv_c), ("k_pe", k_pe)):
        if a.dtype != src.numpy:
            _fail(f"{name} dtype {a.dtype} does not match kv_c's {src.numpy}", TypeError)
        if a.ndim != 2:
            _fail(f"{name} must be 2-D [num_tokens, dims], got shape {a.shape}")
        if not _checks.is_empty(a) and ((a.shape[1] > 1 and a.strides[1] != 2)
                                        or min(a.strides) < 0):
            _fail(f"{name}'s last dimension must be contiguous and its strides non-negative "
                  f"(strides {a.strides})")
        _checks.check_element_strides(a, name, 2)
    return src


def _source_rows_aligned(kv_c, k_pe) -> bool:
    """Does every kv_c and k_pe row start on a 16-byte boundary (vector loads)?"""
    return all(a.data.ptr % 16 == 0 and (a.shape[0] <= 1 or a.strides[0] % 16 == 0)
               for a in (kv_c, k_pe))


def _validate_sparse_write(kv_c, k_pe, kc, pc, sm, kv_cache_dtype: str) -> _MlaWrite:
    """concat_and_cache_mla's checks for a sparse cache's rows (``kv_cache_dtype``
    ``"fp8_ds_mla"``, ``"v4_fp8"`` or ``"v4_fp4"``): kv_c and k_pe float16 or bfloat16
    (fp8_ds_mla: [n, 512] and [n, 64]; V4's: [n, r] and [n, 512 - r], r and 512 - r
    positive multiples of 8), one cache of 1-byte rows ``[num_blocks, block_size, (1,)
    bytes]`` 16-byte aligned with strides in multiples of 16 bytes."""
    fmt = _dtypes.SPARSE_KV_CACHE_DTYPES[kv_cache_dtype]
    src = _check_mla_sources(kv_c, k_pe)
    nbytes = fmt.nbytes
    rank, rope = kv_c.shape[1], k_pe.shape[1]
    if fmt.dtype is _dtypes.DS_MLA:
        for name, a, n in (("kv_c", kv_c, 512), ("k_pe", k_pe, 64)):
            if a.shape[1] != n:
                _fail(f"fp8_ds_mla holds kv_lora_rank 512 and rope_dim 64: {name} must be "
                      f"[num_tokens, {n}], got shape {a.shape}")
    elif rank + rope != fmt.values or not rank or not rope or rank % 8:
        _fail(f"{kv_cache_dtype} holds {fmt.values} values a token, kv_c's then k_pe's: kv_c "
              f"must be [num_tokens, r] and k_pe [num_tokens, {fmt.values} - r], r and "
              f"{fmt.values} - r positive multiples of 8 (DeepSeek-V4's {fmt.values - 64} "
              f"latent and 64 rotary values), got shapes {kv_c.shape} and {k_pe.shape}")
    if pc is not None:
        _fail(f"{kv_cache_dtype} keeps k_pe in each token's {nbytes}-byte row of kv_cache: "
              f"pass k_pe_cache=None")
    owner = f"{'an' if kv_cache_dtype[0] == 'f' else 'a'} {kv_cache_dtype} "
    num_blocks, block_size = _checks.check_row_cache(kc, nbytes, owner)
    if not (kc.dtype.kind in "ui" or _dtypes.fp8_of(kc.dtype) is _dtypes.E4M3):
        _fail(f"{owner}kv_cache is uint8, int8 or float8_e4m3fn storage (what "
              f"sparse_mla_attention reads), got {kc.dtype}", TypeError)
    if not _checks.is_empty(kc) and kc.strides[-1] != 1:
        _fail(f"{owner}kv_cache must have its rows contiguous, got strides {kc.strides}")
    if block_size == 0:
        _fail("kv_cache has blocks of 0 tokens")
    if not _checks.is_empty(kc):
        _checks.check_aligned(kc.data.ptr, "kv_cache")
        if any(n > 1 and (st % 16 or st < 0) for n, st in zip(kc.shape[:2], kc.strides[:2])):
            _fail(f"kv_cache's block and token strides must be non-negative multiples of 16 "
                  f"bytes (its rows are written 16 bytes at a time), got {kc.strides}")
    _checks.check_own_bytes(kc, "kv_cache")
    num_tokens, index = _check_slots(sm, (("kv_c", kv_c), ("k_pe", k_pe)))
    device = kc.data.device_id
    _checks.check_same_device(device, "kv_cache", (("kv_c", kv_c), ("k_pe", k_pe),
                                                   ("slot_mapping", sm)))
    rows = (kc.data.ptr, kc.strides[0], kc.strides[1])  # bytes
    return _MlaWrite(num_tokens, index, device, src, fmt.dtype, rank, rope, block_size,
                     num_blocks, rows, rows, _source_rows_aligned(kv_c, k_pe))


def validate_mla_write(kv_c, k_pe, kc, pc, sm, kv_cache_dtype) -> _MlaWrite:
    """Every check of concat_and_cache_mla, on array metadata only (no device sync)."""
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in _dtypes.SPARSE_KV_CACHE_DTYPES:
        return _validate_sparse_write(kv_c, k_pe, kc, pc, sm, kv_cache_dtype)
    if kv_cache_dtype in ("auto", None) and kc.dtype.itemsize == 1 and kc.ndim in (3, 4):
        for name, fmt in _dtypes.SPARSE_KV_CACHE_DTYPES.items():
            # a float8 cache as wide as V4's rows may be a dense fp8 latent cache, which
            # "auto" takes; fp8_ds_mla's width is always refused
            if kc.shape[-1] == fmt.nbytes and (fmt.dtype is _dtypes.DS_MLA
                                               or _dtypes.fp8_of(kc.dtype) is None):
                _fail(f"kv_cache is {kc.dtype} with {fmt.nbytes}-byte rows: for {fmt.what} "
                      f"pass kv_cache_dtype={name!r} (for an fp8 latent cache, 'fp8_e4m3' or "
                      f"'fp8_e5m2')", TypeError)
    src = _check_mla_sources(kv_c, k_pe)
    rank, rope = kv_c.shape[1], k_pe.shape[1]
    for name, n in (("kv_c", rank), ("k_pe", rope)):
        if n == 0 or n % 8:
            _fail(f"{name}'s width must be a positive multiple of 8, got {n}")
    dt = _kvquant.cache_dtype(kv_cache_dtype, kc, kc if pc is None else pc, src,
                              ("kv_cache", "kv_cache" if pc is None else "k_pe_cache"),
                              "kv_c and k_pe")
    for name, a in (("kv_cache", kc), ("k_pe_cache", pc)):
        if a is None:
            continue
        if dt is src and a.dtype != src.numpy:
            _fail(f"{name} dtype {a.dtype} does not match kv_c's {src.numpy} (or name an fp8 "
                  f"format with kv_cache_dtype)", TypeError)
        if a.ndim != 3 or (a.shape[2] > 1 and a.strides[2] != a.dtype.itemsize):
            _fail(f"{name} must be [num_blocks, block_size, dims] with its last dimension "
                  f"contiguous, got shape {a.shape} with strides {a.strides}")
    want = rank + rope if pc is None else rank
    if kc.shape[2] != want:
        _fail("kv_cache's last dimension must be " + (
            f"kv_lora_rank + rope_dim = {rank} + {rope} (vLLM's combined cache)" if pc is None
            else f"kv_lora_rank = {rank} (k_pe_cache holds the rotary part)")
            + f", got shape {kc.shape}")
    if pc is not None and pc.shape != (kc.shape[0], kc.shape[1], rope):
        _fail(f"k_pe_cache must be [num_blocks, block_size, rope_dim] = "
              f"{(kc.shape[0], kc.shape[1], rope)}, got {pc.shape}")
    num_blocks, block_size = kc.shape[0], kc.shape[1]
    if block_size == 0:
        _fail("kv_cache has blocks of 0 tokens")
    it = kc.dtype.itemsize
    # The kernel stores eight values at a time (8 bytes for fp8), but mla_attention reads
    # a cache 16 bytes at a time: fp8 caches too are held to 16 bytes, so a cache written
    # here is never refused by mla_attention for its pointer or strides.
    for name, a in (("kv_cache", kc), ("k_pe_cache", pc)):
        if a is None or _checks.is_empty(a):
            continue
        _checks.check_aligned(a.data.ptr, name)
        if any(st % 16 or st < 0 for st in a.strides[:2]):
            _fail(f"{name}'s block and token strides must be non-negative multiples of "
                  f"16 bytes (mla_attention reads the cache 16 bytes at a time), got "
                  f"{a.strides}")
        _checks.check_own_bytes(a, name)
    num_tokens, index = _check_slots(sm, (("kv_c", kv_c), ("k_pe", k_pe)))
    device = kc.data.device_id
    _checks.check_same_device(device, "kv_cache", (("k_pe_cache", pc), ("kv_c", kv_c),
                                                   ("k_pe", k_pe), ("slot_mapping", sm)))
    latent = (kc.data.ptr, kc.strides[0] // it, kc.strides[1] // it)
    rope_dst = ((kc.data.ptr + rank * it, *latent[1:]) if pc is None  # the same rows
                else (pc.data.ptr, pc.strides[0] // it, pc.strides[1] // it))
    return _MlaWrite(num_tokens, index, device, src, dt, rank, rope, block_size, num_blocks,
                     latent, rope_dst, _source_rows_aligned(kv_c, k_pe))


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype="auto", scale=None,
                         *, k_pe_cache=None, stream=None) -> None:
    """Write each token's MLA latent vector into its cache slot (vLLM's
    ``concat_and_cache_mla``, with its argument order).

    Args:
        kv_c: ``[n, kv_lora_rank]``, the compressed K and V (512 in DeepSeek-V3), float16
            or bfloat16; ``n >= num_tokens`` (rows past ``num_tokens`` are not read); the
            token stride is free, the last dimension contiguous.
        k_pe: ``[n, rope_dim]`` (64), the rotary key part, kv_c's dtype. Both widths are
            multiples of 8.
        kv_cache: vLLM's combined ``[num_blocks, block_size, kv_lora_rank + rope_dim]``
            (token t's ``[kv_c, k_pe]`` in one row), or with ``k_pe_cache`` the latent part
            ``[num_blocks, block_size, kv_lora_rank]`` (FlashInfer's ``ckv_cache``). Views
            with any block and token strides that are non-negative multiples of 16 bytes
            from a 16-byte aligned pointer, fp8 caches included (what
            :func:`cupaged.mla_attention` reads), the last dimension contiguous; written in
            place. Any block size and widths are written; mla_attention reads
            kv_lora_rank 512 with rope_dim 64 and power-of-two block sizes up to 256.
        slot_mapping: int32 or int64 ``[num_tokens]`` on the device, ``slot = block *
            block_size + offset``; a negative slot marks a padding token that is skipped,
            and a slot past the cache is skipped too (``CUPAGED_DEBUG=1`` raises for it).
        kv_cache_dtype: ``"auto"`` (the cache holds kv_c's dtype, or the fp8 format its
            float8 dtype names), ``"fp8"``/``"fp8_e4m3"`` or ``"fp8_e5m2"`` (any 1-byte
            storage). An fp8 cache stores ``x / scale`` divided, rounded to nearest even
            and saturated exactly as :func:`reshape_and_cache` does. ``"fp8_ds_mla"``:
            DeepSeek-V3.2's sparse-attention cache; ``"v4_fp8"``, ``"v4_fp4"``:
            DeepSeek-V4's (below).
        scale: the fp8 cache's one scale, per tensor, in the forms every entry point
            takes (a positive finite number, a one-element CPU torch tensor or a
            one-element float32 device array; default 1). MLA's latent cache has no
            per-token scales: an array of more than one element raises ValueError.
            Ignored (unchecked) for 16-bit caches and for the sparse formats.
        k_pe_cache: ``[num_blocks, block_size, rope_dim]`` (FlashInfer's ``kpe_cache``),
            the rotary part's own cache, of kv_cache's dtype; None for vLLM's combined
            cache (and for the sparse formats).
        stream: as for :func:`reshape_and_cache`.

    ``kv_cache_dtype="fp8_ds_mla"`` (vLLM's name) writes DeepSeek-V3.2's 656-byte token
    rows: kv_c ``[n, 512]`` in e4m3 (bytes 0-511), each group of 128 values divided by its
    own scale ``max(amax / 448, FLT_MIN)`` (amax of the group's ``|kv_c|``, NaN skipped),
    the four scales as float32 (bytes 512-527), then k_pe ``[n, 64]`` as bfloat16 (bytes
    528-655; a float16 k_pe is rounded to bfloat16). kv_cache is 1-byte storage (uint8,
    int8 or a float8 type) ``[num_blocks, block_size, 656]`` or ``[num_blocks,
    block_size, 1, 656]`` (FlashMLA's), 16-byte aligned with block and token strides in
    multiples of 16 bytes. ``scale`` is ignored, as vLLM's kernel ignores it: the format
    computes its scales. ``cupaged.reference.concat_and_cache_sparse_mla`` is the statement
    of the bytes (bit for bit vLLM's for bfloat16 sources). :func:`cupaged.sparse_mla_attention`
    reads the format (uint8, int8 or float8_e4m3fn storage, page sizes that are powers of
    two up to 256); :func:`copy_blocks_mla` and :func:`swap_blocks` copy its blocks.

    ``kv_cache_dtype="v4_fp8"`` and ``"v4_fp4"`` write DeepSeek-V4's token rows of 512
    values (d_qk 512, the 64 rotary dims inside): kv_c's values then k_pe's, so ``kv_c
    [n, r]`` and ``k_pe [n, 512 - r]`` with r and 512 - r positive multiples of 8 (the
    model's split, 448 and 64; a caller holding the whole ``x [n, 512]`` passes the views
    ``x[:, :448], x[:, 448:]``), one dtype, float16 or bfloat16. ``"v4_fp8"``: 528 bytes,
    the values in e4m3 (bytes 0-511), each group of 32 divided by its scale, a power of two
    rounded up from ``amax / 448`` (at least 2^-126), stored as its biased exponent (16
    ue8m0 bytes, 512-527); NaN is stored as ``0x7F``, and a group holding an infinity gets
    the scale 2^0 (its values stored as they are, saturated: the infinity as ±448).
    ``"v4_fp4"``: 288 bytes, the values in e2m1 (bytes 0-255, value 2i in the low nibble of
    byte i), each group of 16 divided by its scale, the smallest e4m3 value at least ``amax
    / 6`` (at least 2^-9; 32 e4m3 bytes, 256-287), rounded to nearest even and saturated to
    ±6 (an infinity makes its group's scale 448 and is stored as ±6). e2m1 has no NaN: a
    NaN value is skipped by its group's amax and stored as 0 (code 0), the bytes the
    reference gives for the token with 0 in its place (the reference refuses NaN). kv_cache
    is 1-byte storage ``[num_blocks, block_size, (1,) 528]`` (resp. 288), as for
    ``"fp8_ds_mla"``; ``scale`` is ignored. ``cupaged.reference.concat_and_cache_sparse_mla``
    states the bytes; :func:`cupaged.sparse_mla_attention` reads these formats (bfloat16 q
    of 512 dims); :func:`copy_blocks_mla` and :func:`swap_blocks` copy their blocks.

    Arrays may be CuPy arrays, torch CUDA tensors or any ``__dlpack__`` producer on one
    device. ``cupaged.reference.concat_and_cache_mla`` is the statement of what is stored.
    """
    a = as_device_array(kv_c, "kv_c")
    b = as_device_array(k_pe, "k_pe")
    kc = as_device_array(kv_cache, "kv_cache")
    pc = None if k_pe_cache is None else as_device_array(k_pe_cache, "k_pe_cache")
    sm = as_device_array(slot_mapping, "slot_mapping")
    w = validate_mla_write(a, b, kc, pc, sm, kv_cache_dtype)
    # the sparse formats compute their own scales: the argument is ignored, as vLLM's
    # kernel ignores it for fp8_ds_mla
    sp, sv, sa = _kvquant.tensor_scale(scale if takes_scale(w) and scale is not None else 1.0,
                                       "scale", per_token=False)
    _checks.check_same_device(w.device, "kv_cache", (("scale", sa),))
    if w.num_tokens == 0:
        return
    with _arrays.launching(w.device):
        ctx = _arrays.context(w.device, _arrays.stream_framework(kv_cache, kv_c, k_pe), stream)
        _debug_check_slots(sm, w.num_blocks * w.block_size, ctx)
        launch_mla_write(mla_write_kernel(w), w, ctx.stream, a, b, kc, pc, sm, sp, sv)


def takes_scale(w: _MlaWrite) -> bool:
    """Does the write use its ``scale`` (an fp8 latent cache; not 16-bit caches nor the
    sparse formats, which compute their own scales)?"""
    return w.cache is not w.source and w.cache.name not in _dtypes.SPARSE_MLA


def mla_write_kernel(w: _MlaWrite):
    """concat_and_cache_mla's launcher for a validated write (loaded on first use)."""
    return _kernel(w.device, "concat_and_cache_mla", w.source.name, w.index,
                   cache_dtype=w.cache.name)


def launch_mla_write(kern, w: _MlaWrite, stream: int, a, b, kc, pc, sm, scale_ptr: int,
                      scale_value: float) -> None:
    """Launch a validated MLA write on ``stream`` (a handle) for adapted arrays with the
    metadata ``w`` was validated with (``pc``: None for a combined cache; the addresses
    are free: the destinations' are taken from ``kc`` and ``pc``, not from ``w``)."""
    latent = (kc.data.ptr, *w.latent[1:])
    # a combined cache's rope part: at the validated offset from the latent part's start
    rope = ((kc.data.ptr + (w.rope_dst[0] - w.latent[0]), *w.rope_dst[1:]) if pc is None
            else (pc.data.ptr, *w.rope_dst[1:]))
    # the sparse formats' rows: a warp per token; the others: a CTA per token
    sparse = w.cache.name in _dtypes.SPARSE_MLA
    grid = -(-w.num_tokens // (CACHE_THREADS // 32)) if sparse else w.num_tokens
    kern((grid, 1, 1), CACHE_THREADS, 0, stream,
         a.data.ptr, a.strides[0] // 2, b.data.ptr, b.strides[0] // 2, *latent, *rope,
         sm.data.ptr, w.num_tokens, w.rank, w.rope, w.block_size, w.num_blocks * w.block_size,
         int(w.vec_src), scale_ptr, scale_value)


# ---- DSA's lightning indexer: its keys' fp8 cache ----------------------------------------------

INDEXER_SCALE_FORMATS = (None, "", "ue8m0")  # vLLM's scale_fmt: a float32 scale, or ue8m0


class _IndexerWrite(NamedTuple):
    """A validated indexer_k_quant_and_cache call."""

    num_tokens: int
    index: str
    device: int
    source: _dtypes.DType
    head_dim: int
    quant_block_size: int
    block_size: int
    num_blocks: int
    block_stride: int  # bytes
    ue8m0: bool


def validate_indexer_write(k, kc, sm, quant_block_size, scale_fmt) -> _IndexerWrite:
    """Every check of indexer_k_quant_and_cache, on array metadata only (no device sync)."""
    src = _checks.check_dtype(k, "k")
    if src.itemsize != 2:
        _fail(f"k must be float16 or bfloat16, got {src.numpy}", TypeError)
    if k.ndim != 2:
        _fail(f"k must be 2-D [num_tokens, head_dim], got shape {k.shape}")
    if not _checks.is_empty(k) and min(k.strides) < 0:
        _fail(f"k's strides must be non-negative, got {k.strides}")
    if not _checks.is_empty(k) and k.shape[1] > 1 and k.strides[1] != 2:
        _fail(f"k's last dimension must be contiguous (strides {k.strides})")
    head_dim = k.shape[1]
    if head_dim % 32 or not 32 <= head_dim <= 512:
        _fail(f"k's head_dim must be a multiple of 32 from 32 to 512 (DeepSeek-V3.2's is "
              f"128), got {head_dim}")
    if isinstance(quant_block_size, bool) or not isinstance(quant_block_size, (int, np.integer)):
        _fail(f"quant_block_size must be an int, got {type(quant_block_size).__name__}",
              TypeError)
    per_lane = head_dim // 32  # the kernel's values a lane: a group is a power-of-two of lanes
    lanes = quant_block_size // per_lane if quant_block_size > 0 else 0
    if quant_block_size <= 0 or head_dim % quant_block_size or quant_block_size % per_lane \
            or lanes & (lanes - 1):
        _fail(f"quant_block_size must divide head_dim ({head_dim}) and be a power-of-two "
              f"multiple of head_dim / 32, got {quant_block_size}")
    if scale_fmt not in INDEXER_SCALE_FORMATS:
        _fail(f"scale_fmt must be None (a float32 scale) or 'ue8m0', got {scale_fmt!r}")
    width = head_dim + 4 * (head_dim // quant_block_size)
    # a token's row: head_dim e4m3 bytes, then its float32 scales
    num_blocks, block_size = _checks.check_row_cache(kc, width, "the indexer's ")
    if block_size == 0:
        _fail("kv_cache has blocks of 0 tokens")
    # A block's bytes are its tokens' values, then their scales: each block one run.
    if not _checks.is_empty(kc):
        inner = (kc.strides[-1], kc.strides[1]) if block_size > 1 else (kc.strides[-1], width)
        if inner != (1, width) or min(kc.strides) < 0:
            _fail(f"each block of kv_cache must be one contiguous run of block_size * {width} "
                  f"bytes (token stride {width}, byte stride 1), got strides {kc.strides}")
        if kc.data.ptr % 4 or (num_blocks > 1 and kc.strides[0] % 4):
            _fail(f"kv_cache's blocks must start at 4-byte boundaries (their scales are "
                  f"float32), got address {kc.data.ptr:#x} and block stride {kc.strides[0]}")
        if num_blocks > 1 and kc.strides[0] < block_size * width:
            _fail(f"kv_cache's blocks overlap: block stride {kc.strides[0]} < block_size * "
                  f"{width}")
    num_tokens, index = _check_slots(sm, (("k", k),))
    device = kc.data.device_id
    _checks.check_same_device(device, "kv_cache", (("k", k), ("slot_mapping", sm)))
    return _IndexerWrite(num_tokens, index, device, src, head_dim, int(quant_block_size),
                         block_size, num_blocks, kc.strides[0] if num_blocks > 1 else 0,
                         scale_fmt == "ue8m0")


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size=128, scale_fmt=None,
                              *, stream=None) -> None:
    """Write the lightning indexer's keys into their fp8 paged cache (DeepSeek-V3.2's DSA;
    vLLM's ``indexer_k_quant_and_cache``, with its argument order).

    Args:
        k: ``[n, head_dim]`` float16 or bfloat16 (``n >= num_tokens``; rows past
            ``num_tokens`` are not read), the last dimension contiguous, the token stride
            free; head_dim a multiple of 32 up to 512 (DeepSeek-V3.2's is 128).
        kv_cache: 1-byte storage (uint8 as vLLM allocates it, int8 or a float8 type)
            ``[num_blocks, block_size, head_dim + 4 * head_dim / quant_block_size]`` (or
            with a 1 before the last dimension), each block one contiguous run starting at
            a 4-byte boundary, in vLLM's layout: a block holds its tokens' e4m3 values
            token-major (``block_size * head_dim`` bytes), then their float32 scales
            (``head_dim / quant_block_size`` a token). Written in place.
        slot_mapping: int32 or int64 ``[num_tokens]`` on the device, ``slot = block *
            block_size + offset``; a negative slot (padding) is skipped, and so is a slot
            past the cache (``CUPAGED_DEBUG=1`` raises for it).
        quant_block_size: values per scale (128 for DeepSeek-V3.2: one scale a token); it
            divides head_dim and is a power-of-two multiple of ``head_dim / 32``.
        scale_fmt: None (or ``""``): each group's scale is ``max(amax, 1e-4) / 448``
            (amax of the group's ``|k|``, NaN skipped), in float32; ``"ue8m0"``: that
            rounded up to a power of two.
        stream: as for :func:`reshape_and_cache`.

    Each value is ``k / scale`` (divided in float32) rounded to nearest even and saturated
    to +-448, NaN stored as 0x7F. ``cupaged.reference.indexer_k_quant_and_cache`` is the
    statement of the bytes. Arrays may be CuPy arrays, torch CUDA tensors or any
    ``__dlpack__`` producer on one device. One warp a token; never synchronizes (but under
    ``CUPAGED_DEBUG=1``), capturable in a CUDA graph.
    """
    a = as_device_array(k, "k")
    kc = as_device_array(kv_cache, "kv_cache")
    sm = as_device_array(slot_mapping, "slot_mapping")
    w = validate_indexer_write(a, kc, sm, quant_block_size, scale_fmt)
    if w.num_tokens == 0:
        return
    with _arrays.launching(w.device):
        ctx = _arrays.context(w.device, _arrays.stream_framework(kv_cache, k), stream)
        _debug_check_slots(sm, w.num_blocks * w.block_size, ctx)
        kern = _kernel(w.device, "indexer_k_quant_and_cache", w.source.name, w.index)
        kern((-(-w.num_tokens // (CACHE_THREADS // 32)), 1, 1), CACHE_THREADS, 0, ctx.stream,
             a.data.ptr, a.strides[0] // 2 if a.shape[0] > 1 else 0, kc.data.ptr,
             w.block_stride, sm.data.ptr, w.num_tokens, w.head_dim, w.quant_block_size,
             w.block_size, w.num_blocks * w.block_size, int(w.ue8m0))


def _block_bytes(a, name: str) -> int:
    """Bytes per block of a cache (blocks along the first dimension) that the copy kernel
    moves in 16-byte vectors: each block one contiguous run, base and block stride 16-byte
    aligned. Any layout (vLLM's, NHD, HND) qualifies, and so does a K or V half of a fused
    allocation split along a leading dimension (``[num_blocks, 2, ...]``: a block stride
    larger than the block). Checked for every array a copy touches, before anything
    launches."""
    itemsize = a.dtype.itemsize
    if a.ndim < 2 or not _checks.dense_tail(a.shape, a.strides, a.ndim - 1, itemsize):
        _fail(f"{name} must be contiguous within each block (shape {a.shape}, strides "
              f"{a.strides}): blocks move as one run of bytes each, so the K or V half of a "
              f"cache fused within its rows (such as [num_blocks, num_kv_heads, block_size, "
              f"2 * head_size]) cannot be copied alone (swap_blocks takes the fused cache "
              f"itself); halves of one fused along a leading dimension ([num_blocks, 2, ...]) "
              f"can")
    nbytes = math.prod(a.shape[1:]) * itemsize
    if a.shape[0] > 1 and a.strides[0] < 0:
        _fail(f"{name}'s block stride is negative ({a.strides[0]} bytes): blocks must be in "
              f"ascending order")
    if a.shape[0] > 1 and a.strides[0] < nbytes:
        _fail(f"{name}'s blocks overlap: its block stride ({a.strides[0]} bytes) is less than "
              f"a block ({nbytes} bytes)")
    if nbytes % 16 or (a.shape[0] > 1 and a.strides[0] % 16):
        _fail(f"{name}'s blocks must be multiples of 16 bytes apart and long (shape {a.shape}, "
              f"strides {a.strides})")
    return nbytes


def _launch_copy(ctx: _arrays.Context, tensors: list, mapping, index: str, num_pairs: int,
                 block_bytes: int, src_blocks: int, dst_blocks: int) -> None:
    """Copy ``num_pairs`` blocks of every tensor, given as (src, dst, src block stride,
    dst block stride) in bytes. The table travels in the launch's parameters, so there is
    nothing to upload, to keep alive or to order. With ``ctx.device`` current."""
    if num_pairs == 0 or not tensors:
        return
    kern = _kernel(ctx.device, "copy_blocks", "", index)
    for i in range(0, len(tensors), _COPY_TENSORS):
        chunk = tensors[i:i + _COPY_TENSORS]
        flat = [v for t in chunk for v in t]
        table = _COPY_TABLE.pack(*flat, *_COPY_PAD[len(flat):])
        kern((num_pairs, len(chunk), 1), CACHE_THREADS, 0, ctx.stream, table, mapping.data.ptr,
             block_bytes, src_blocks, dst_blocks)


def _check_mapping_range(mapping, num_src: int, num_dst: int, ctx: _arrays.Context) -> None:
    """CUPAGED_DEBUG: every pair names existing blocks (reads the mapping on the launch
    stream, so work queued before the call that writes it is seen; synchronizes)."""
    m = mapping if isinstance(mapping, np.ndarray) else _arrays.to_host(mapping, ctx)
    for col, n, side in ((0, num_src, "source"), (1, num_dst, "destination")):
        bad = np.flatnonzero((m[:, col] < 0) | (m[:, col] >= n))
        if bad.size:
            _fail(f"block_mapping[{bad[0]}] has {side} block {m[bad[0], col]}, outside [0, {n})")


def copy_blocks(key_caches, value_caches, block_mapping, *, stream=None) -> None:
    """Copy blocks within each layer's caches (copy-on-write after a fork), in one launch
    for up to 48 layers and any number of pairs (more layers take more launches).

    Args:
        key_caches, value_caches: lists with one cache per layer (empty lists: nothing
            to copy), blocks along the first dimension, in any layout whose blocks are contiguous (vLLM's, NHD, HND, and K
            and V halves of a ``[num_blocks, 2, ...]`` allocation, whose block stride is
            twice the block); all key caches of one shape and dtype, likewise all value
            caches, with blocks of the same byte size; on one device; 16-byte aligned.
        block_mapping: int32 or int64 ``[num_pairs, 2]`` on the device: (src, dst) block ids.
            The pairs are copied at once, in no order: a block that is one pair's
            destination and another's source, or two pairs' destination, ends up with
            either's bytes or a mix of them.
        stream: as for :func:`cupaged.paged_attention` (torch's current stream when the
            caches are torch tensors).
    """
    if not isinstance(key_caches, (list, tuple)) or not isinstance(value_caches, (list, tuple)):
        _fail("key_caches and value_caches must be lists of per-layer caches", TypeError)
    if len(key_caches) != len(value_caches):
        _fail(f"key_caches and value_caches must be lists of one length, got "
              f"{len(key_caches)} and {len(value_caches)}")
    mapping = as_device_array(block_mapping, "block_mapping")
    if mapping.ndim != 2 or mapping.shape[1:] != (2,):
        _fail(f"block_mapping must be [num_pairs, 2] (src, dst), got shape {mapping.shape}")
    index = _check_index_array(mapping, "block_mapping", mapping.shape)
    if not key_caches:  # no layers: nothing to copy (as vLLM's copy_blocks)
        return
    ks = [as_device_array(a, f"key_caches[{i}]") for i, a in enumerate(key_caches)]
    vs = [as_device_array(a, f"value_caches[{i}]") for i, a in enumerate(value_caches)]
    nbytes = _block_bytes(ks[0], "key_caches[0]")
    if _block_bytes(vs[0], "value_caches[0]") != nbytes:
        _fail(f"value_caches[0] has {_block_bytes(vs[0], 'value_caches[0]')} bytes per block and "
              f"key_caches[0] {nbytes}: key and value blocks must be the same size")
    num_blocks = ks[0].shape[0]
    if vs[0].shape[0] != num_blocks:
        _fail(f"key_caches have {num_blocks} blocks but value_caches {vs[0].shape[0]}")
    device = ks[0].data.device_id
    tensors = (_layer_tensors("key_caches", ks, device, "key_caches[0]")
               + _layer_tensors("value_caches", vs, device, "key_caches[0]"))
    _copy_within(tensors, mapping, index, nbytes, num_blocks, device, "key_caches[0]",
                 key_caches[0], stream)


def _layer_tensors(name: str, layers, device: int, ref: str) -> list:
    """copy_blocks' view of per-layer caches: (src, dst, src stride, dst stride) each.
    Every layer is checked, cheaply: a layer laid out as layer 0 (the usual case) shares
    its verdict, so only its own address and device are left to check."""
    first = layers[0]
    layout = (first.shape, first.strides, first.dtype)
    tensors = []
    for i, a in enumerate(layers):
        data = a.data
        if (a.shape, a.strides, a.dtype) != layout:
            if a.shape != first.shape or a.dtype != first.dtype:
                _fail(f"{name}[{i}] ({a.shape}, {a.dtype}) differs from {name}[0] "
                      f"({first.shape}, {first.dtype}): every layer's caches must match")
            _block_bytes(a, f"{name}[{i}]")  # the same shape: the same bytes per block
        if data.ptr % 16:
            _checks.check_aligned(data.ptr, f"{name}[{i}]")
        if data.device_id != device:
            _fail(f"{name}[{i}] is on device {data.device_id} but {ref} is on device {device}")
        tensors.append((data.ptr, data.ptr, a.strides[0], a.strides[0]))
    return tensors


def _copy_within(tensors, mapping, index: str, nbytes: int, num_blocks: int, device: int,
                 ref: str, framework_of, stream) -> None:
    """Copy the mapped blocks within each of ``tensors`` (caches of ``num_blocks`` blocks
    of ``nbytes`` on ``device``, ``ref``'s)."""
    _checks.check_same_device(device, ref, (("block_mapping", mapping),))
    if mapping.shape[0] == 0:
        return
    with _arrays.launching(device):
        ctx = _arrays.context(device, _arrays.framework(framework_of), stream)
        if _checks.debug():
            _check_mapping_range(mapping, num_blocks, num_blocks, ctx)
        _launch_copy(ctx, tensors, mapping, index, mapping.shape[0], nbytes, num_blocks,
                     num_blocks)


def copy_blocks_mla(kv_caches, block_mapping, *, stream=None) -> None:
    """vLLM's ``copy_blocks_mla``: copy blocks within each layer's MLA latent cache (one
    cache per layer, :func:`concat_and_cache_mla`'s ``kv_cache``), in one launch for up to
    96 layers. With FlashInfer's pair, call it once for the ``kv_c`` caches and once for the
    ``k_pe`` caches.

    Args:
        kv_caches: a list with one cache per layer (empty: nothing to copy), blocks along
            the first dimension and contiguous; all of one shape and dtype, on one device,
            16-byte aligned.
        block_mapping: int32 or int64 ``[num_pairs, 2]`` on the device: (src, dst) block ids.
        stream: as for :func:`copy_blocks`.
    """
    if not isinstance(kv_caches, (list, tuple)):
        _fail("kv_caches must be a list of per-layer caches", TypeError)
    mapping = as_device_array(block_mapping, "block_mapping")
    if mapping.ndim != 2 or mapping.shape[1:] != (2,):
        _fail(f"block_mapping must be [num_pairs, 2] (src, dst), got shape {mapping.shape}")
    index = _check_index_array(mapping, "block_mapping", mapping.shape)
    if not kv_caches:
        return
    cs = [as_device_array(a, f"kv_caches[{i}]") for i, a in enumerate(kv_caches)]
    nbytes = _block_bytes(cs[0], "kv_caches[0]")
    device = cs[0].data.device_id
    _copy_within(_layer_tensors("kv_caches", cs, device, "kv_caches[0]"), mapping, index,
                 nbytes, cs[0].shape[0], device, "kv_caches[0]", kv_caches[0], stream)


# ---- swapping between device and pinned host memory --------------------------------------------


def empty_pinned(shape, dtype) -> np.ndarray:
    """A NumPy array in pinned (page-locked) host memory, which the GPU reaches directly:
    the host side of :func:`swap_blocks`."""
    import cupyx

    return cupyx.empty_pinned(shape, dtype=dtype)


class _Side(NamedTuple):
    """One side of a swap: the array as cupaged reads it, its device (None: host memory),
    the address the GPU uses, and for host memory its host address and whether it is
    pageable (which the GPU cannot reach)."""

    array: object
    device: int | None
    gpu_ptr: int
    host_ptr: int = 0
    pageable: bool = False
    writeable: bool = True


def _side(a, name: str) -> _Side:
    host = a if isinstance(a, np.ndarray) else None
    if _arrays.is_torch(a) and a.device.type == "cpu":
        if a.requires_grad:
            _fail(f"{name} requires grad; pass {name}.detach()", TypeError)
        host = a
    if host is None:
        try:
            arr = as_device_array(a, name)
        except TypeError:
            _fail(f"{name} must be a device array or host memory (a NumPy array or a torch "
                  f"CPU tensor; pinned for asynchronous swaps: cupaged.empty_pinned or "
                  f"pin_memory=True), got {type(a).__name__}", TypeError)
        return _Side(arr, arr.data.device_id, arr.data.ptr)
    if isinstance(host, np.ndarray):
        ptr, arr, writeable = host.ctypes.data, host, host.flags.writeable
    else:  # a torch CPU tensor: its metadata, NumPy-style
        ptr, arr, writeable = host.data_ptr(), _arrays.HostTorchArray(host), True
    try:
        attrs = runtime.pointerGetAttributes(ptr)
    except runtime.CUDARuntimeError:
        attrs = None
    if attrs is None or attrs.type != runtime.memoryTypeHost:
        return _Side(arr, None, 0, ptr, True, writeable)  # staged, synchronously
    return _Side(arr, None, attrs.devicePointer, ptr, False, writeable)


def _host_blocks(side: _Side, block_bytes: int) -> np.ndarray:
    """A host cache's blocks as a NumPy ``uint8 [num_blocks, block_bytes]`` view of its
    own memory (each block is one run of bytes: _block_bytes checked it)."""
    a = side.array
    n = a.shape[0]
    span = (n - 1) * a.strides[0] + block_bytes if n else 0
    base = np.frombuffer((ctypes.c_uint8 * span).from_address(side.host_ptr), np.uint8)
    return np.lib.stride_tricks.as_strided(base, (n, block_bytes), (a.strides[0], 1))


def _swap_staged(ctx: _arrays.Context, src: _Side, dst: _Side, mapping: np.ndarray,
                 block_bytes: int) -> None:
    """A swap with a pageable host side, which the GPU cannot reach: its blocks go
    through a pinned staging buffer, one kernel between it and the device cache, and a
    NumPy gather or scatter on the host; the stream is synchronized, so the copy is
    complete on return."""
    to_host = dst.device is None
    host, dev, host_col = (dst, src, 1) if to_host else (src, dst, 0)
    if to_host and not host.writeable:
        _fail("dst is a read-only NumPy array")
    pairs = mapping.astype(np.int64, copy=False)
    for col, side, what in ((0, src, "source"), (1, dst, "destination")):
        bad = np.flatnonzero((pairs[:, col] < 0) | (pairs[:, col] >= side.array.shape[0]))
        if bad.size:  # read on the host anyway: checked always, not only in debug mode
            _fail(f"block_mapping[{bad[0]}] has {what} block {pairs[bad[0], col]}, outside "
                  f"[0, {side.array.shape[0]})")
    n = len(pairs)
    stage = empty_pinned((n, block_bytes), np.uint8)
    stage_ptr = runtime.pointerGetAttributes(stage.ctypes.data).devicePointer
    blocks = _host_blocks(host, block_bytes)
    staged = np.stack([pairs[:, 1 - host_col], np.arange(n)], 1)
    if to_host:
        tensors = [(dev.gpu_ptr, stage_ptr, dev.array.strides[0], block_bytes)]
        src_blocks, dst_blocks = dev.array.shape[0], n
    else:
        stage[...] = blocks[pairs[:, 0]]
        staged = staged[:, ::-1]
        tensors = [(stage_ptr, dev.gpu_ptr, block_bytes, dev.array.strides[0])]
        src_blocks, dst_blocks = n, dev.array.shape[0]
    with _arrays.cupy_on_launch_stream(ctx):
        index = cupy.asarray(np.ascontiguousarray(staged))
    _launch_copy(ctx, tensors, index, _INDEX[index.dtype], n, block_bytes, src_blocks,
                 dst_blocks)
    runtime.streamSynchronize(ctx.stream)
    if to_host:
        blocks[pairs[:, 1]] = stage


def swap_blocks(src, dst, block_mapping, *, stream=None) -> None:
    """Copy blocks between a device cache and a host cache (either direction), or within
    one device. With pinned host memory it is one asynchronous launch whatever the
    mapping: the kernel reads or writes the pinned memory directly over the bus, so
    scattered blocks cost no per-block copy calls. Pageable host memory (a plain NumPy
    array or torch CPU tensor), which the GPU cannot reach, is staged through a pinned
    buffer: that call synchronizes the stream and has finished the copy when it returns
    (as vLLM's ``swap_blocks`` does), and is slower than pinned memory.

    Args:
        src, dst: caches (fp8 ones and their scale arrays included: any dtype cupaged's
            caches use) with the same dtype and per-block shape (``shape[1:]``), each
            contiguous within a block (any layout, or a K or V half of a ``[num_blocks, 2,
            ...]`` allocation); one on the device (CuPy, torch or DLPack), the
            other in host memory (pinned: :func:`empty_pinned`, or a torch tensor with
            ``pin_memory=True``; or pageable), or both on one device.
        block_mapping: ``[num_pairs, 2]`` (src, dst) block ids, int32 or int64, on the
            host (NumPy or a list) or on the device. A host mapping is uploaded from
            pageable memory, which waits until the launch stream has drained; pass a
            device mapping to keep the call free of any wait.
        stream: as for :func:`cupaged.paged_attention` (torch's current stream when the
            device side is a torch tensor).

    With pinned memory, asynchronous like the other kernels: synchronize the stream
    before the host reads a host-side destination. A pageable side's block ids are
    checked on the host (ValueError for one outside its cache). Two host arrays raise
    ValueError (one side must be a device array), as do device arrays on two devices; an
    object that is neither raises TypeError.
    """
    src_s, dst_s = _side(src, "src"), _side(dst, "dst")
    src_a, src_dev, src_ptr = src_s.array, src_s.device, src_s.gpu_ptr
    dst_a, dst_dev, dst_ptr = dst_s.array, dst_s.device, dst_s.gpu_ptr
    if src_dev is None and dst_dev is None:
        _fail("src and dst are both host arrays: one side must be a device array")
    if src_dev is not None and dst_dev is not None and src_dev != dst_dev:
        _fail(f"src is on device {src_dev} and dst on device {dst_dev}: use one device")
    device = src_dev if src_dev is not None else dst_dev
    if src_a.dtype != dst_a.dtype or src_a.shape[1:] != dst_a.shape[1:]:
        _fail(f"src {src_a.shape} {src_a.dtype} and dst {dst_a.shape} {dst_a.dtype} must have "
              f"the same dtype and block shape")
    if _dtypes.lookup(src_a.dtype) is None and _dtypes.fp8_of(src_a.dtype) is None \
            and src_a.dtype not in (np.dtype(np.uint8), np.dtype(np.int8)):
        _fail(f"src dtype {src_a.dtype} is not supported: expected {_dtypes.supported_names()}, "
              f"float8 (e4m3fn, e5m2) or 1-byte storage of an fp8 cache (uint8, int8)",
              TypeError)
    nbytes = _block_bytes(src_a, "src")
    _block_bytes(dst_a, "dst")
    pageable = src_s.pageable or dst_s.pageable
    if not pageable:
        _checks.check_aligned(src_ptr, "src")
        _checks.check_aligned(dst_ptr, "dst")
    else:
        dev_side, name = (dst_s, "dst") if src_dev is None else (src_s, "src")
        _checks.check_aligned(dev_side.gpu_ptr, name)
    on_host = isinstance(block_mapping, (np.ndarray, list, tuple)) or (
        _arrays.is_torch(block_mapping) and block_mapping.device.type == "cpu")
    if on_host:
        mapping = np.asarray(block_mapping)
        if mapping.size == 0:
            mapping = mapping.reshape(0, 2).astype(np.int64)
    else:
        mapping = as_device_array(block_mapping, "block_mapping")
        _checks.check_same_device(device, "the device cache", (("block_mapping", mapping),))
    if mapping.ndim != 2 or mapping.shape[1:] != (2,):
        _fail(f"block_mapping must be [num_pairs, 2] (src, dst), got shape {mapping.shape}")
    if on_host:
        _checks.check_int(mapping, "block_mapping", (np.int32, np.int64))
    else:
        _check_index_array(mapping, "block_mapping", mapping.shape)
    if mapping.shape[0] == 0:
        return
    kind = _arrays.framework(src if src_dev is not None else dst)
    with _arrays.launching(device):
        ctx = _arrays.context(device, kind, stream)
        if pageable:
            host_pairs = mapping if on_host else _arrays.to_host(mapping, ctx)
            _swap_staged(ctx, src_s, dst_s, host_pairs, nbytes)
            return
        if _checks.debug():
            _check_mapping_range(mapping, src_a.shape[0], dst_a.shape[0], ctx)
        if on_host:  # uploaded in the launch stream's order
            with _arrays.cupy_on_launch_stream(ctx):
                mapping = cupy.asarray(np.ascontiguousarray(mapping))
        index = _check_index_array(mapping, "block_mapping", mapping.shape)
        _launch_copy(ctx, [(src_ptr, dst_ptr, src_a.strides[0], dst_a.strides[0])], mapping,
                     index, mapping.shape[0], nbytes, src_a.shape[0], dst_a.shape[0])
