"""fp8 KV caches on the host: which element type a call's cache has, and how its scales
reach the kernels. Metadata only: nothing here reads device data or synchronizes.

A cache's type is the query's (``kv_cache_dtype="auto"``, or a float8 array dtype saying
which fp8 format it holds) or fp8 named explicitly (``"fp8"``/``"fp8_e4m3"``,
``"fp8_e5m2"``) over 1-byte storage of any kind (torch's float8 types, ml_dtypes',
uint8, int8). An fp8 cache holds ``value / scale``; attention reads ``stored * scale``.
Scales are per tensor (a number, a one-element CPU torch tensor, or a float32 device
scalar the kernel reads, as vLLM passes them: :func:`tensor_scale`, shared by every entry
point) or per (token, KV head): float32 arrays ``[num_blocks, num_kv_heads, block_size]``
beside the cache (not for MLA's latent cache).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import _checks, _dtypes
from ._arrays import as_device_array

_fail = _checks.fail
ONE_BYTE = (np.dtype(np.uint8), np.dtype(np.int8))  # storage of fp8 values
_FLT_MAX = 3.4028234663852886e38


class KVQuant(NamedTuple):
    """How a call's cache is stored: its element type and, for fp8, its scales."""

    cache: _dtypes.DType | None  # None: the query's own type (no scales)
    mode: str = ""  # jit.KV_SCALES key: "" per tensor, "th" per (token, KV head)
    k_ptr: int = 0  # per tensor: a device float (0: use k_value); "th": the K scale array
    v_ptr: int = 0
    k_value: float = 1.0
    v_value: float = 1.0
    block_stride: int = 0  # "th": the scale arrays' strides, in floats
    head_stride: int = 0
    keep: tuple = ()  # the adapted scale arrays, alive for the launch


NONE = KVQuant(None)


def cache_dtype(kv_cache_dtype, key_cache, value_cache, query_dt: _dtypes.DType,
                names=("key_cache", "value_cache"), source="queries") -> _dtypes.DType:
    """The caches' element type for ``kv_cache_dtype``, checked against the arrays'
    (``names``: theirs in errors; ``source``: what ``query_dt`` is the type of, in them)."""
    if kv_cache_dtype == "auto" or kv_cache_dtype is None:
        fmt = _dtypes.fp8_of(key_cache.dtype)
        if fmt is None:
            if key_cache.dtype in ONE_BYTE:
                _fail(f"{names[0]} is {key_cache.dtype}: name its fp8 format with "
                      f"kv_cache_dtype='fp8_e4m3' or 'fp8_e5m2'", TypeError)
            return query_dt  # the existing checks compare the arrays with the query
    elif isinstance(kv_cache_dtype, str) and kv_cache_dtype in _dtypes.SPARSE_KV_CACHE_DTYPES:
        _dtypes.refuse_sparse_mla(kv_cache_dtype)  # concat_and_cache_mla takes them before here
    elif isinstance(kv_cache_dtype, str) and kv_cache_dtype in _dtypes.KV_CACHE_DTYPES:
        fmt = _dtypes.KV_CACHE_DTYPES[kv_cache_dtype]
    else:
        _fail(f"kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', got "
              f"{kv_cache_dtype!r}")
    for name, a in zip(names, (key_cache, value_cache)):
        named = _dtypes.fp8_of(a.dtype)
        if a.dtype not in ONE_BYTE and named is None:
            _fail(f"{name} dtype {a.dtype} cannot hold fp8 {fmt.name}: expected a 1-byte "
                  f"dtype (float8_{'e4m3fn' if fmt.name == 'e4m3' else 'e5m2'}, uint8 or int8)",
                  TypeError)
        if named is not None and named is not fmt:
            _fail(f"{name} dtype {a.dtype} holds fp8 {named.name}, but kv_cache_dtype says "
                  f"{fmt.name}", TypeError)
    if query_dt.itemsize != 2:
        _fail(f"fp8 caches take float16 or bfloat16 {source}, got {query_dt.numpy}", TypeError)
    return fmt


def tensor_scale(x, name: str, per_token: bool = True):
    """A per-tensor scale, in the forms every entry point takes (docs/API.md, "fp8 scale
    forms"): a number (Python or NumPy, not bool), a one-element CPU torch tensor (its
    value, read on the host) or a one-element float32 device array (its address: the
    kernel reads it). Returns (device pointer or 0, host value, the device array or None).
    A host value must be positive and finite in float32, which the kernels receive it as
    (a number that rounds to 0 there is refused); a device scalar's value is the caller's.
    ``per_token``: the caller also takes per-token arrays (the error for another shape
    names them; without them it says that only per-tensor scales are taken)."""
    one = "one float (per tensor)" + (
        " or [num_blocks, num_kv_heads, block_size] (per token and head)" if per_token else "")
    only = "" if per_token else ": MLA's latent cache takes a per-tensor scale only"
    if isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool):
        v = float(x)
    elif hasattr(x, "is_cuda") and not x.is_cuda:  # a CPU torch tensor: its value
        if x.numel() != 1:
            _fail(f"{name} must be {one}, got a CPU tensor of shape {tuple(x.shape)}{only}")
        v = float(x.item())
    else:
        try:
            a = as_device_array(x, name)
        except TypeError:
            if not isinstance(x, np.ndarray) and (hasattr(x, "__dlpack__")
                                                  or hasattr(x, "is_cuda")):
                raise  # an array cupaged cannot read: its own reason
            got = ("a NumPy array (host memory: pass its value as a number)"
                   if isinstance(x, np.ndarray) else type(x).__name__)
            _fail(f"{name} must be a number, a one-element CPU torch tensor or a float32 "
                  f"device scalar, got {got}", TypeError)
        if a.dtype != np.float32:
            _fail(f"{name} must be float32 on the device, got {a.dtype}", TypeError)
        if int(np.prod(a.shape)) != 1:
            _fail(f"{name} must be {one}, got shape {a.shape}{only}")
        _checks.check_aligned(a.data.ptr, name, 4)
        return a.data.ptr, 1.0, a
    if not (math.isfinite(v) and 0 < v <= _FLT_MAX) or np.float32(v) == 0:
        _fail(f"{name} must be a positive finite float32, got {v}")
    return 0, v, None


def _is_array(x) -> bool:
    return hasattr(x, "shape") and len(getattr(x, "shape")) == 3


def scales(k_scale, v_scale, fmt: _dtypes.DType | None, cache, device: int,
           ref: str = "query") -> KVQuant:
    """The scales of a validated cache (``cache``: a ``_checks.CacheView``). A cache of
    the query's type ignores per-tensor scales (vLLM passes 1.0 whatever the cache).
    ``ref``: the array whose device the scales' is compared with, in errors."""
    if fmt is None:
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x is not None and _is_array(x):
                _fail(f"{name} is a per-token scale array, but the cache is not fp8")
        return NONE
    if _is_array(k_scale) or _is_array(v_scale):
        kept, ptrs = [], []
        expected = (cache.num_blocks, cache.num_kv_heads, cache.block_size)
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x is None or not _is_array(x):
                _fail(f"k_scale and v_scale must both be per-token-head arrays "
                      f"{list(expected)}, or both per tensor; {name} is {type(x).__name__}")
            a = as_device_array(x, name)
            if a.dtype != np.float32:
                _fail(f"{name} must be float32, got {a.dtype}", TypeError)
            st = a.strides
            if tuple(a.shape) != expected or (cache.block_size > 1 and st[2] != 4) \
                    or min(st) < 0 or st[0] % 4 or st[1] % 4 or a.data.ptr % 4:
                _fail(f"{name} must be float32 {list(expected)} (num_blocks, num_kv_heads, "
                      f"block_size) with tokens contiguous, got shape {a.shape} strides {st}")
            if a.data.device_id != device:
                _fail(f"{name} is on device {a.data.device_id} but {ref} is on device {device}")
            kept.append(a)
            ptrs.append(a.data.ptr)
        k, v = kept
        if k.strides != v.strides:
            _fail(f"k_scale and v_scale must have the same strides, got {k.strides} and "
                  f"{v.strides}")
        return KVQuant(fmt, "th", ptrs[0], ptrs[1], 1.0, 1.0, k.strides[0] // 4,
                       k.strides[1] // 4, tuple(kept))
    kp, kv, ka = tensor_scale(1.0 if k_scale is None else k_scale, "k_scale")
    vp, vv, va = tensor_scale(1.0 if v_scale is None else v_scale, "v_scale")
    for name, a in (("k_scale", ka), ("v_scale", va)):
        if a is not None and a.data.device_id != device:
            _fail(f"{name} is on device {a.data.device_id} but {ref} is on device {device}")
    return KVQuant(fmt, "", kp, vp, kv, vv, 0, 0, (ka, va))
