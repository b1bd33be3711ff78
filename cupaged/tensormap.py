"""Tensor maps for Hopper's tensor copies (TMA): cuda.h's ``CUtensorMap``, 128 opaque bytes
that the driver's ``cuTensorMapEncodeTiled`` makes and a kernel takes by value
(``cuda_src/sm90.cuh``'s ``TensorMap``, a ``__grid_constant__`` parameter). A map holds
the tensor's address, so a kernel reading another array needs another map: callers keep
the maps they made by address (``launch.MlaTmaMaps``).

Without the driver (no ``libcuda``), or where it refuses a tensor (an address or stride
that is not a multiple of 16 bytes, a stride below its dimension's extent, sizes past its
limits), :func:`encode_tiled` returns None and the caller copies another way."""

from __future__ import annotations

import ctypes
import functools

SIZE = 128  # bytes of a CUtensorMap
_ALIGN = 64  # its alignment (cuda.h: alignas(64))

# CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion (cuda.h)
_DATA_TYPES = {"f16": 6, "bf16": 9}
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3


@functools.lru_cache(maxsize=1)
def _encode():
    """cuTensorMapEncodeTiled from the driver, or None where there is none."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                   u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def encode_tiled(dtype: str, address: int, dims: tuple, strides: tuple, box: tuple) -> bytes | None:
    """The map of a ``dtype`` ("f16" or "bf16") tensor at device ``address``: ``dims`` its
    sizes in elements, innermost first, ``strides`` the bytes between consecutive
    elements of each outer dimension (one fewer than ``dims``), ``box`` the elements a
    copy takes along each dimension; boxes land in shared memory with the 128-byte
    swizzle (the box's innermost extent at most 128 bytes), every element strided 1.
    None where the driver is missing or refuses the tensor."""
    fn = _encode()
    if fn is None or dtype not in _DATA_TYPES or len(strides) != len(dims) - 1:
        return None
    rank = len(dims)
    raw = (ctypes.c_uint8 * (SIZE + _ALIGN))()
    at = (ctypes.addressof(raw) + _ALIGN - 1) // _ALIGN * _ALIGN
    status = fn(ctypes.c_void_p(at), _DATA_TYPES[dtype], rank, ctypes.c_void_p(address),
                (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * max(rank - 1, 1))(*strides),
                (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)), 0,
                _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    return ctypes.string_at(at, SIZE) if status == 0 else None
