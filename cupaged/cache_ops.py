"""Cache maintenance: write new tokens into a paged cache, copy blocks, swap blocks.

All three launch one kernel on the current CuPy stream of the device the caches live on,
without synchronizing.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from functools import lru_cache

import cupy
import numpy as np
from cupy_backends.cuda.api import runtime

from . import _checks, _dtypes, jit
from ._arrays import as_device_array

__all__ = ["copy_blocks", "empty_pinned", "reshape_and_cache", "swap_blocks"]

_THREADS = 128  # kCacheThreads in cuda_src/cache_ops.cuh
_INDEX = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}
_DEBUG = os.environ.get("CUPAGED_DEBUG", "") not in ("", "0")
_NO_SWITCH = contextlib.nullcontext()
_fail = _checks.fail


@lru_cache(maxsize=None)
def _kernel(device_id: int, kernel: str, dtype: str, index_dtype: str):
    from .attention import _device

    spec = jit.KernelSpec(kernel, dtype, index_dtype=index_dtype, arch=_device(device_id).arch)
    return jit.load(spec, device_id)


def _on(device: int):
    return _NO_SWITCH if runtime.getDevice() == device else cupy.cuda.Device(device)


def _check_index_array(a, name: str, shape) -> str:
    _checks.check_int(a, name, (np.int32, np.int64))
    if a.shape != shape or not a.flags.c_contiguous:
        _fail(f"{name} must be a contiguous array of shape {shape}, got shape {a.shape} "
              f"with strides {a.strides}")
    return _INDEX[a.dtype]


# ---- reshape_and_cache ----------------------------------------------------------------------


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write each token's K and V into its cache slot.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, the caches' dtype; token and
            head strides are free (slices of a fused QKV work), dims contiguous.
        key_cache, value_cache: vLLM's layouts, as for :func:`cupaged.paged_attention`.
        slot_mapping: int32 or int64 ``[num_tokens]`` on the device, ``slot = block *
            block_size + offset``; a negative slot marks a padding token that is skipped.

    Slots past the cache are skipped too (never written outside it); ``CUPAGED_DEBUG=1``
    raises for them instead (with a device sync).
    """
    k = as_device_array(key, "key")
    v = as_device_array(value, "value")
    kc = as_device_array(key_cache, "key_cache")
    vc = as_device_array(value_cache, "value_cache")
    sm = as_device_array(slot_mapping, "slot_mapping")
    dt = _checks.check_dtype(kc, "key_cache")
    cache = _checks.check_caches(kc, vc, dt, ref="key_cache")
    want = (cache.num_kv_heads, cache.head_size)
    for name, a in (("key", k), ("value", v)):
        if a.dtype != dt.numpy:
            _fail(f"{name} dtype {a.dtype} does not match the cache dtype {dt.numpy}", TypeError)
        if a.ndim != 3 or a.shape[1:] != want:
            _fail(f"{name} must be [num_tokens, {want[0]}, {want[1]}] (num_tokens, num_kv_heads, "
                  f"head_size), got shape {a.shape}")
        if (a.shape[2] > 1 and a.strides[2] != dt.itemsize) or min(a.strides) < 0:
            _fail(f"{name}'s last dimension must be contiguous (strides {a.strides})")
    num_tokens = k.shape[0]
    if v.shape[0] != num_tokens:
        _fail(f"key has {num_tokens} tokens but value has {v.shape[0]}")
    index = _check_index_array(sm, "slot_mapping", (num_tokens,))
    device = kc.data.device_id
    _checks.check_same_device(device, "key_cache", (("value_cache", vc), ("key", k),
                                                    ("value", v), ("slot_mapping", sm)))
    num_slots = cache.num_blocks * cache.block_size
    if num_tokens == 0:
        return
    it = dt.itemsize
    with _on(device):
        if _DEBUG:
            s = cupy.asnumpy(sm)
            bad = np.flatnonzero(s >= num_slots)
            if bad.size:
                _fail(f"slot_mapping[{bad[0]}] = {s[bad[0]]} is past the cache ({num_slots} slots)")
        kern = _kernel(device, "reshape_and_cache", dt.name, index)
        kern((num_tokens, 1, 1), _THREADS, 0, cupy.cuda.get_current_stream().ptr,
             k.data.ptr, k.strides[0] // it, k.strides[1] // it,
             v.data.ptr, v.strides[0] // it, v.strides[1] // it,
             kc.data.ptr, kc.strides[0] // it, kc.strides[1] // it,
             vc.data.ptr, vc.strides[0] // it, vc.strides[1] // it,
             sm.data.ptr, cache.num_kv_heads, cache.head_size, cache.block_size, num_slots)


# ---- block copies -----------------------------------------------------------------------------

# Descriptor arrays (CopyTensor[] in cache_ops.cuh) already on the device, by content, so
# repeated calls on the same caches cost no host-to-device copy.
_descriptors: OrderedDict = OrderedDict()
_DESCRIPTOR_COLUMNS = 6


def _descriptor_array(device: int, rows: tuple):
    key = (device, rows)
    arr = _descriptors.get(key)
    if arr is None:
        arr = cupy.asarray(np.array(rows, dtype=np.int64).reshape(-1, _DESCRIPTOR_COLUMNS))
        _descriptors[key] = arr
        if len(_descriptors) > 256:
            _descriptors.popitem(last=False)
    return arr


def _block_bytes(a, name: str) -> int:
    """Bytes per block of a cache whose blocks are contiguous runs of 16-byte multiples."""
    itemsize = a.dtype.itemsize
    if a.ndim < 2 or not _checks.dense_tail(a.shape, a.strides, a.ndim - 1, itemsize):
        _fail(f"{name} must be contiguous within each block (shape {a.shape}, strides {a.strides})")
    nbytes = int(np.prod(a.shape[1:])) * itemsize
    if nbytes % 16 or (a.shape[0] > 1 and a.strides[0] % 16) or a.strides[0] < 0:
        _fail(f"{name}'s blocks must be multiples of 16 bytes apart and long (shape {a.shape}, "
              f"strides {a.strides})")
    return nbytes


def _launch_copy(device: int, rows: tuple, mapping, index: str, num_pairs: int,
                 block_bytes: int) -> None:
    if num_pairs == 0 or not rows:
        return
    with _on(device):
        desc = _descriptor_array(device, rows)
        kern = _kernel(device, "copy_blocks", "", index)
        kern((num_pairs, len(rows) // _DESCRIPTOR_COLUMNS, 1), _THREADS, 0,
             cupy.cuda.get_current_stream().ptr, desc.data.ptr, mapping.data.ptr, block_bytes)


def _check_mapping_range(mapping, num_src: int, num_dst: int) -> None:
    m = cupy.asnumpy(mapping) if isinstance(mapping, cupy.ndarray) else mapping
    for col, n, side in ((0, num_src, "source"), (1, num_dst, "destination")):
        bad = np.flatnonzero((m[:, col] < 0) | (m[:, col] >= n))
        if bad.size:
            _fail(f"block_mapping[{bad[0]}] has {side} block {m[bad[0], col]}, outside [0, {n})")


def copy_blocks(key_caches, value_caches, block_mapping) -> None:
    """Copy blocks within each layer's caches (copy-on-write after a fork), in one launch
    for all layers and pairs.

    Args:
        key_caches, value_caches: lists with one cache per layer, all of one shape and
            dtype, on one device, each contiguous within a block.
        block_mapping: int32 or int64 ``[num_pairs, 2]`` on the device: (src, dst) block ids.
    """
    if not isinstance(key_caches, (list, tuple)) or not isinstance(value_caches, (list, tuple)):
        _fail("key_caches and value_caches must be lists of per-layer caches", TypeError)
    if len(key_caches) != len(value_caches) or not key_caches:
        _fail(f"key_caches and value_caches must be non-empty lists of one length, got "
              f"{len(key_caches)} and {len(value_caches)}")
    ks = [as_device_array(a, f"key_caches[{i}]") for i, a in enumerate(key_caches)]
    vs = [as_device_array(a, f"value_caches[{i}]") for i, a in enumerate(value_caches)]
    dt = _checks.check_dtype(ks[0], "key_caches[0]")
    shape = _checks.check_caches(ks[0], vs[0], dt, ref="key_caches[0]")
    for i, (k, v) in enumerate(zip(ks, vs)):
        if k.shape != ks[0].shape or v.shape != vs[0].shape or k.dtype != ks[0].dtype or v.dtype != ks[0].dtype:
            _fail(f"layer {i}'s caches {k.shape}/{v.shape} {k.dtype} differ from layer 0's "
                  f"{ks[0].shape}/{vs[0].shape} {ks[0].dtype}")
    mapping = as_device_array(block_mapping, "block_mapping")
    if mapping.ndim != 2 or mapping.shape[1:] != (2,):
        _fail(f"block_mapping must be [num_pairs, 2] (src, dst), got shape {mapping.shape}")
    index = _check_index_array(mapping, "block_mapping", mapping.shape)
    device = ks[0].data.device_id
    _checks.check_same_device(device, "key_caches[0]", [(f"key_caches[{i}]", a) for i, a in enumerate(ks)]
                              + [(f"value_caches[{i}]", a) for i, a in enumerate(vs)]
                              + [("block_mapping", mapping)])
    nbytes = _block_bytes(ks[0], "key_caches[0]")
    if _block_bytes(vs[0], "value_caches[0]") != nbytes:
        _fail("key and value blocks differ in size")  # cannot happen for vLLM's layouts
    if _DEBUG:
        _check_mapping_range(mapping, shape.num_blocks, shape.num_blocks)
    rows = []
    for a in (*ks, *vs):
        rows += [a.data.ptr, a.data.ptr, a.strides[0], a.strides[0], a.shape[0], a.shape[0]]
    _launch_copy(device, tuple(rows), mapping, index, mapping.shape[0], nbytes)


# ---- swapping between device and pinned host memory --------------------------------------------


def empty_pinned(shape, dtype) -> np.ndarray:
    """A NumPy array in pinned (page-locked) host memory, which the GPU reaches directly:
    the host side of :func:`swap_blocks`."""
    import cupyx

    return cupyx.empty_pinned(shape, dtype=dtype)


def _side(a, name: str):
    """(device id or None for host, address the GPU uses) of one side of a swap."""
    if isinstance(a, cupy.ndarray):
        return a.data.device_id, a.data.ptr
    if isinstance(a, np.ndarray):
        ptr = a.ctypes.data
        try:
            attrs = runtime.pointerGetAttributes(ptr)
        except runtime.CUDARuntimeError:
            attrs = None
        if attrs is None or attrs.type != runtime.memoryTypeHost:
            _fail(f"{name} is pageable host memory, which the GPU cannot reach: allocate it "
                  f"with cupaged.empty_pinned(shape, dtype)", TypeError)
        return None, attrs.devicePointer
    _fail(f"{name} must be a cupy.ndarray or a pinned numpy.ndarray, got {type(a).__name__}",
          TypeError)


def swap_blocks(src, dst, block_mapping) -> None:
    """Copy blocks between a device cache and a host cache in pinned memory (either
    direction), in one launch whatever the mapping: the kernel reads or writes the pinned
    host memory directly over the bus, so scattered blocks cost no per-block copy calls.

    Args:
        src, dst: caches with the same dtype and per-block shape (``shape[1:]``), each
            contiguous within a block; one a ``cupy.ndarray``, the other a NumPy array from
            :func:`empty_pinned` (or two device arrays on one device).
        block_mapping: ``[num_pairs, 2]`` (src, dst) block ids, int32 or int64, on the
            host (NumPy or a list) or on the device.

    Asynchronous like the other kernels: synchronize the stream before the host reads a
    host-side destination.
    """
    src_dev, src_ptr = _side(src, "src")
    dst_dev, dst_ptr = _side(dst, "dst")
    if src_dev is None and dst_dev is None:
        _fail("src and dst are both host arrays: one side must be a device array")
    if src_dev is not None and dst_dev is not None and src_dev != dst_dev:
        _fail(f"src is on device {src_dev} and dst on device {dst_dev}: use one device")
    device = src_dev if src_dev is not None else dst_dev
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        _fail(f"src {src.shape} {src.dtype} and dst {dst.shape} {dst.dtype} must have the same "
              f"dtype and block shape")
    if _dtypes.lookup(src.dtype) is None:
        _fail(f"src dtype {src.dtype} is not supported: expected {_dtypes.supported_names()}", TypeError)
    nbytes = _block_bytes(src, "src")
    _block_bytes(dst, "dst")
    if isinstance(block_mapping, cupy.ndarray):
        mapping = block_mapping
        _checks.check_same_device(device, "the device cache", (("block_mapping", mapping),))
    else:
        mapping = np.asarray(block_mapping)
        if mapping.size == 0:
            mapping = mapping.reshape(0, 2).astype(np.int64)
    if mapping.ndim != 2 or mapping.shape[1:] != (2,):
        _fail(f"block_mapping must be [num_pairs, 2] (src, dst), got shape {mapping.shape}")
    if isinstance(mapping, np.ndarray):
        _checks.check_int(mapping, "block_mapping", (np.int32, np.int64))
        if _DEBUG:
            _check_mapping_range(mapping, src.shape[0], dst.shape[0])
        with _on(device):
            mapping = cupy.asarray(np.ascontiguousarray(mapping))
    elif _DEBUG:
        _check_mapping_range(mapping, src.shape[0], dst.shape[0])
    index = _check_index_array(mapping, "block_mapping", mapping.shape)
    rows = (src_ptr, dst_ptr, src.strides[0], dst.strides[0], src.shape[0], dst.shape[0])
    _launch_copy(device, rows, mapping, index, mapping.shape[0], nbytes)
