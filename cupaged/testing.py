"""Random paged KV caches, for tests and benchmarks (NumPy on the host or CuPy on a device)."""

from __future__ import annotations

import ctypes
import weakref

import numpy as np

from . import _dtypes

__all__ = ["convert_layout", "guarded", "poison_unused_slots", "random_block_tables",
           "random_cache", "random_normal", "ROW_FACTOR", "TOLERANCE"]

# ||out - ref|| / ||ref|| accepted against the float64 reference, by element type.
TOLERANCE = {"f32": 1e-5, "f16": 1e-3, "bf16": 8e-3}
# Any one output row (a head's vector) may be off by this many times TOLERANCE of its own
# norm: rounding to the element type alone costs about half of TOLERANCE per row, and a
# row 5% off fails it for every type.
ROW_FACTOR = 4


def random_block_tables(context_lens, block_size: int, rng: np.random.Generator, *,
                        spare_blocks: int = 0, share: bool = False, extra_columns: int = 0):
    """Block tables with each sequence's blocks scattered at random over the cache.

    Returns ``(block_tables int32 [num_seqs, max_blocks], num_blocks)``. Entries past a
    sequence's last block hold out-of-range garbage (they must never be read). With
    ``share``, about half of the sequences reuse a prefix of another sequence's blocks,
    as forks and shared prompts do.
    """
    lens = np.asarray(context_lens, dtype=np.int64)
    need = -(-lens // block_size)
    width = int(need.max(initial=0)) + extra_columns
    num_blocks = int(need.sum()) + spare_blocks
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = rng.integers(num_blocks, num_blocks + 1000, size=(len(lens), max(width, 1)))
    tables = tables.astype(np.int32)[:, :width]
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[used:used + n]
        used += n
        if share and s > 0 and rng.random() < 0.5:
            donor = int(rng.integers(0, s))
            k = int(min(n, need[donor], rng.integers(0, n + 1)))
            tables[s, :k] = tables[donor, :k]
    return tables, num_blocks


def random_normal(shape, dtype, rng, xp=np):
    """Standard-normal values of ``dtype`` (a NumPy dtype, bfloat16 included); ``xp`` is
    numpy or cupy (generated on that side)."""
    if xp is np:
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    return xp.random.default_rng(int(rng.integers(2**31))).standard_normal(
        shape, dtype=np.float32).astype(dtype)


def random_cache(num_blocks: int, num_kv_heads: int, head_size: int, block_size: int, dtype,
                 rng: np.random.Generator, xp=np):
    """``(key_cache, value_cache)`` in vLLM's layouts, random normal values."""
    x = 16 // _dtypes.lookup(dtype).itemsize
    k = random_normal((num_blocks, num_kv_heads, head_size // x, block_size, x), dtype, rng, xp)
    v = random_normal((num_blocks, num_kv_heads, head_size, block_size), dtype, rng, xp)
    return k, v


def poison_unused_slots(key_cache, value_cache, block_tables, context_lens, value=float("nan")):
    """Fill every cache slot that holds no token of any sequence (the tail of each partly
    filled last block, and whole unused blocks) with ``value`` (NaN, +-Inf), in place, on
    host arrays in vLLM's layouts: stale slots a kernel must never let into its output
    (0 * NaN is NaN, so masking scores alone is not enough). Returns the [num_blocks,
    block_size] mask of used slots."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[3]
    used = np.zeros((num_blocks, block_size), dtype=bool)
    tables = np.asarray(block_tables)
    for s, n in enumerate(np.asarray(context_lens)):
        t = np.arange(int(n))
        used[tables[s, t // block_size], t % block_size] = True
    np.moveaxis(key_cache, 3, 1)[~used] = value  # [blocks, slot, kv_heads, hs/x, x]
    np.moveaxis(value_cache, 3, 1)[~used] = value  # [blocks, slot, kv_heads, hs]
    return used


def convert_layout(key_cache, value_cache, src: str, dst: str):
    """Host caches from one layout to another (``"NHD"``, ``"HND"``, ``"vllm"``; see
    :mod:`cupaged.reference`), as new C-contiguous NumPy arrays with the same values."""
    from .reference import token_major_views

    k = token_major_views(key_cache, src, True)  # [blocks, block_size, kv_heads, head_size] views
    v = token_major_views(value_cache, src, False)
    if dst == "NHD":
        pass
    elif dst == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    elif dst == "vllm":
        nb, bs, kvh, hs = k.shape
        x = 16 // k.dtype.itemsize
        k = k.reshape(nb, bs, kvh, hs // x, x).transpose(0, 2, 3, 1, 4)
        v = v.transpose(0, 2, 3, 1)
    else:
        raise ValueError(f"unknown layout {dst!r}")
    return np.ascontiguousarray(k), np.ascontiguousarray(v)


# ---- device arrays against unmapped memory -----------------------------------------------
# The driver's virtual memory management (cuda.h, CUDA 10.2 on): a reserved address range of
# which only the middle is mapped. ctypes mirrors of its structs (test_testing.py checks
# their layout against cuda.h's).


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):  # CUmemAllocationProp's allocFlags
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


# CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3


def guard_layout(nbytes: int, granularity: int, side: str, align: int) -> tuple[int, int]:
    """Where :func:`guarded` puts an array of ``nbytes``: ``(mapped, offset)``, the bytes
    mapped (whole granules, at least one) and the array's offset in them: 0 on ``"before"``
    (its first byte is the mapping's), else the largest multiple of ``align`` that ends it
    within ``align - 1`` bytes of the mapping's end (exactly there when ``nbytes`` is a
    multiple of ``align``)."""
    if side not in ("before", "after"):
        raise ValueError(f"side must be 'before' or 'after', got {side!r}")
    if granularity <= 0 or align <= 0 or granularity % align:
        raise ValueError(f"granularity {granularity} must be a positive multiple of align {align}")
    mapped = max(1, -(-nbytes // granularity)) * granularity
    return mapped, 0 if side == "before" else (mapped - nbytes) // align * align


class _Mapping:
    """A reserved range, one granule of guard on each side of ``size`` mapped bytes."""

    def __init__(self, lib, prop: CUmemAllocationProp, size: int, granularity: int):
        u64, sz = ctypes.c_ulonglong, ctypes.c_size_t
        handle, base = u64(), u64()
        reserve = size + 2 * granularity
        _vmm_call(lib, "cuMemAddressReserve", ctypes.byref(base), sz(reserve), sz(granularity),
                  u64(0), u64(0))
        done = [("cuMemAddressFree", u64(base.value), sz(reserve))]
        try:
            _vmm_call(lib, "cuMemCreate", ctypes.byref(handle), sz(size), ctypes.byref(prop),
                      u64(0))
            done.append(("cuMemRelease", u64(handle.value)))
            self.ptr = base.value + granularity
            _vmm_call(lib, "cuMemMap", u64(self.ptr), sz(size), sz(0), u64(handle.value), u64(0))
            done.append(("cuMemUnmap", u64(self.ptr), sz(size)))
            access = CUmemAccessDesc(location=prop.location, flags=_READ_WRITE)
            _vmm_call(lib, "cuMemSetAccess", u64(self.ptr), sz(size), ctypes.byref(access),
                      sz(1))
        except BaseException:
            _vmm_release(lib, done)
            raise
        self._release = weakref.finalize(self, _vmm_release, lib, done)


def _vmm_call(lib, name: str, *args) -> None:
    rc = getattr(lib, name)(*args)
    if rc != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(text))
        raise RuntimeError(f"{name} failed: {(text.value or b'?').decode()} ({rc})")


def _vmm_release(lib, done) -> None:
    # Kernels still reading the array finish first (its last owner may go before a launch
    # on it does); then unmap, release the handle, free the range: the reverse of their
    # making. (At exit the context may be gone: the calls then fail, harmlessly.)
    lib.cuCtxSynchronize()
    for name, *args in reversed(done):
        getattr(lib, name)(*args)


def guarded(array, side: str = "before", align: int | None = None):
    """A CuPy copy of ``array`` (NumPy or CuPy, any strides; the copy is C-contiguous) whose
    ``side`` (``"before"`` or ``"after"``) borders unmapped memory: on ``"before"`` its first
    byte is the first of a mapping, on ``"after"`` it ends within ``align - 1`` bytes of a
    mapping's end (``align``: its start's alignment, the itemsize by default, so an array
    whose bytes are a multiple of it ends exactly there). A kernel that reads or writes
    across that edge faults at once (CUDA's illegal address error), deterministically,
    where compute-sanitizer's memcheck needs the array alone in its allocation and a small
    overrun into a neighbour or a pool's chunk goes unseen. The fault ends the process's
    CUDA context, so use it where any such access is a defect. On the current device,
    through the CUDA driver's virtual memory management (``libcuda``'s ``cuMemCreate``,
    ``cuMemMap``, ...)."""
    import cupy

    src = cupy.ascontiguousarray(cupy.asarray(array))
    device = cupy.cuda.Device().id
    lib = ctypes.CDLL("libcuda.so.1")
    prop = CUmemAllocationProp(type=_PINNED, location=CUmemLocation(type=_ON_DEVICE, id=device))
    gran = ctypes.c_size_t()
    _vmm_call(lib, "cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 0)
    mapped, offset = guard_layout(src.nbytes, gran.value, side, align or src.itemsize)
    mapping = _Mapping(lib, prop, mapped, gran.value)
    mem = cupy.cuda.UnownedMemory(mapping.ptr, mapped, mapping, device)
    out = cupy.ndarray(src.shape, src.dtype, cupy.cuda.MemoryPointer(mem, offset))
    out[...] = src
    return out
