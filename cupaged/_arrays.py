"""Array adaptation: what the caller passed (CuPy arrays, PyTorch tensors, any DLPack
producer) seen through one small interface, plus the stream, device and allocator each
call uses. Nothing here copies data or synchronizes.

Adapted arrays expose what the checks and launches read: ``shape``, ``strides`` (bytes),
``ndim``, ``dtype`` (a NumPy dtype; bfloat16 is ml_dtypes'), ``data.ptr``,
``data.device_id`` and ``flags.c_contiguous``. CuPy arrays already do; PyTorch tensors
get a light view (reading their metadata costs about a microsecond, where a DLPack
round trip costs ten); other producers go through ``cupy.from_dlpack``.

torch is never imported here unless the caller passed torch objects (it is then already
in ``sys.modules``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import NamedTuple

import cupy
import numpy as np
from cupy_backends.cuda.api import runtime

from . import _dtypes

_KDL_CUDA = 2  # DLPack device types
_DLPACK_DEVICES = {1: "CPU", 2: "CUDA", 3: "CUDA host (pinned)", 4: "OpenCL", 7: "Vulkan",
                   8: "Metal", 10: "ROCm", 13: "CUDA managed", 14: "oneAPI"}
_NO_SWITCH = contextlib.nullcontext()


def _torch():
    return sys.modules.get("torch")


def is_torch(x) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def framework(x) -> str:
    """Whose arrays a call given ``x`` hands back: "torch" for a torch tensor, "jax" for a
    JAX array (recognized by its type's module: JAX is never imported here), else "cupy"
    (CuPy arrays and any other DLPack producer)."""
    if is_torch(x):
        return "torch"
    if type(x).__module__.partition(".")[0] in ("jax", "jaxlib"):
        return "jax"
    return "cupy"


# ---- torch tensors ----------------------------------------------------------------------------


class Data(NamedTuple):
    ptr: int
    device_id: int


class _Flags(NamedTuple):
    c_contiguous: bool


_TORCH_TO_NUMPY: dict = {}
_NUMPY_TO_TORCH: dict = {}


def _dtype_tables():
    if not _TORCH_TO_NUMPY:
        t = _torch()
        pairs = [("float32", np.float32), ("float16", np.float16), ("float64", np.float64),
                 ("int32", np.int32), ("int64", np.int64), ("int16", np.int16),
                 ("int8", np.int8), ("uint8", np.uint8), ("bool", np.bool_)]
        for name, np_dtype in pairs:
            _TORCH_TO_NUMPY[getattr(t, name)] = np.dtype(np_dtype)
        if _dtypes.BF16.numpy is not None:
            _TORCH_TO_NUMPY[t.bfloat16] = _dtypes.BF16.numpy
        for name, d in (("float8_e4m3fn", _dtypes.E4M3), ("float8_e5m2", _dtypes.E5M2)):
            if d.numpy is not None and hasattr(t, name):  # fp8 KV caches
                _TORCH_TO_NUMPY[getattr(t, name)] = d.numpy
        _NUMPY_TO_TORCH.update((v, k) for k, v in _TORCH_TO_NUMPY.items())
    return _TORCH_TO_NUMPY, _NUMPY_TO_TORCH


def numpy_dtype(torch_dtype):
    """NumPy dtype for a torch dtype; the torch dtype itself when NumPy has none (the
    dtype checks then reject it by name)."""
    return _dtype_tables()[0].get(torch_dtype, torch_dtype)


def torch_dtype(np_dtype):
    return _dtype_tables()[1][np.dtype(np_dtype)]


# torch dtype -> (NumPy dtype, itemsize): one lookup per tensor instead of two calls.
_TORCH_META: dict = {}


class TorchArray:
    """A PyTorch CUDA tensor seen as cupaged reads arrays (no copy; ``tensor`` is kept)."""

    __slots__ = ("tensor", "shape", "strides", "ndim", "dtype", "data")

    def __init__(self, tensor, name: str):
        # (is_cuda and get_device() are the cheap accessors; .device builds an object)
        if not tensor.is_cuda:
            raise TypeError(f"{name} is a torch tensor on {tensor.device}; cupaged needs CUDA "
                            f"tensors (e.g. {name}.cuda())")
        if tensor.requires_grad:
            raise TypeError(f"{name} requires grad, but cupaged's kernels are not "
                            f"differentiable: call under torch.no_grad() or pass {name}.detach()")
        self.tensor = tensor
        self.shape = shape = tuple(tensor.shape)
        self.ndim = len(shape)
        meta = _TORCH_META.get(tensor.dtype)
        if meta is None:
            meta = _TORCH_META[tensor.dtype] = (numpy_dtype(tensor.dtype), tensor.element_size())
        self.dtype, itemsize = meta
        self.strides = tuple([s * itemsize for s in tensor.stride()])
        self.data = Data(tensor.data_ptr(), tensor.get_device())

    @property
    def flags(self) -> _Flags:
        return _Flags(self.tensor.is_contiguous())


class HostTorchArray:
    """A torch CPU tensor's metadata, NumPy-style (the host side of a swap)."""

    __slots__ = ("shape", "strides", "ndim", "dtype")

    def __init__(self, tensor):
        self.shape = tuple(tensor.shape)
        self.ndim = len(self.shape)
        self.dtype = numpy_dtype(tensor.dtype)
        self.strides = tuple(s * tensor.element_size() for s in tensor.stride())


class DeviceView:
    """A dense (C-contiguous) device array known by its metadata and address alone: what
    :mod:`cupaged.jax` hands the checks for XLA's buffers (a stand-in address while
    tracing, the buffer's own at run time). Taken as it is by :func:`as_device_array`."""

    __slots__ = ("shape", "strides", "ndim", "dtype", "data")

    def __init__(self, shape, dtype, ptr: int, device: int):
        self.shape = shape = tuple(int(n) for n in shape)
        self.ndim = len(shape)
        self.dtype = dt = np.dtype(dtype)
        strides, step = [], dt.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        self.strides = tuple(reversed(strides))
        self.data = Data(int(ptr), int(device))

    @property
    def flags(self) -> _Flags:
        return _Flags(True)

    def at(self, ptr: int) -> "DeviceView":
        """The same array at another address (of the same device)."""
        v = object.__new__(DeviceView)
        v.shape, v.strides, v.ndim, v.dtype = self.shape, self.strides, self.ndim, self.dtype
        v.data = Data(ptr, self.data.device_id)
        return v


# ---- any array -------------------------------------------------------------------------------


def as_device_array(x, name: str):
    """``x`` seen as a device array without copying, or a TypeError naming ``name``."""
    if isinstance(x, (cupy.ndarray, DeviceView)):
        return x
    if is_torch(x):
        return TorchArray(x, name)
    if isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} is a NumPy array (host memory); cupaged needs a CUDA array, "
            f"e.g. cupy.asarray({name})"
        )
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        kind, device = x.__dlpack_device__()
        if int(kind) != _KDL_CUDA:
            where = _DLPACK_DEVICES.get(int(kind), f"DLPack device type {int(kind)}")
            raise TypeError(f"{name} lives in {where} memory (device {device}); cupaged needs "
                            f"CUDA device memory")
        return cupy.from_dlpack(x)
    raise TypeError(f"{name} must be a CUDA array (cupy.ndarray, torch.Tensor or any "
                    f"__dlpack__ producer), got {type(x).__name__}")


def optional_device_array(x, name: str):
    return None if x is None else as_device_array(x, name)


def optional_output_array(x, name: str):
    """An array the call writes (``out=``, ``lse=``), adapted; a JAX array is refused, as
    JAX treats its buffers as constant."""
    if x is not None and framework(x) == "jax":
        raise TypeError(f"{name} is a JAX array, which is immutable: cupaged would write into "
                        f"memory JAX treats as constant. Leave {name}= out and use the JAX "
                        f"array cupaged returns")
    return optional_device_array(x, name)


def to_host(a, ctx: "Context | None" = None) -> np.ndarray:
    """A NumPy copy (synchronizes: only for checks and debugging), read in the order of
    ``ctx.stream`` when given (so work queued there before the call is seen), else of the
    current stream of the array's framework."""
    if ctx is None:
        return a.tensor.cpu().numpy() if isinstance(a, TorchArray) else cupy.asnumpy(a)
    if isinstance(a, TorchArray):
        t = _torch()
        with t.cuda.stream(t.cuda.ExternalStream(ctx.stream, device=ctx.device)):
            return a.tensor.cpu().numpy()
    return a.get(stream=_cupy_stream(ctx.stream))


# ---- devices, streams, allocation --------------------------------------------------------------


def on_device(device: int):
    """A context making ``device`` current; free when it already is (a switch costs
    microseconds, and this runs on every call)."""
    return _NO_SWITCH if runtime.getDevice() == device else cupy.cuda.Device(device)


def stream_pointer(stream, name: str = "stream") -> int:
    """The CUDA stream handle of a CuPy stream, a torch stream, anything implementing
    ``__cuda_stream__``, or a raw handle (int)."""
    proto = getattr(stream, "__cuda_stream__", None)  # CuPy's streams implement it
    if proto is not None:
        v = proto() if callable(proto) else proto
        return int(v[1]) if isinstance(v, tuple) else int(v)
    t = _torch()
    if t is not None and isinstance(stream, t.cuda.Stream):
        return stream.cuda_stream
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool) and stream >= 0:
        return int(stream)
    raise TypeError(f"{name} must be a CuPy stream, a torch stream, an object with "
                    f"__cuda_stream__, or a stream handle (int), got {type(stream).__name__}")


class Context(NamedTuple):
    """Where one call runs: its device, its stream, and whose arrays it hands back."""

    device: int
    stream: int  # CUDA stream handle
    kind: str  # framework(): "torch", "jax" or "cupy", whose arrays to allocate and return
    explicit: bool  # the stream came from the caller's stream= argument

    @property
    def torch(self) -> bool:
        return self.kind == "torch"


def _torch_current_stream(device: int) -> int:
    t = _torch()
    raw = getattr(t._C, "_cuda_getCurrentRawStream", None)  # no Stream object: ~10x faster
    return raw(device) if raw is not None else t.cuda.current_stream(device).cuda_stream


def context(device: int, kind: str, stream=None) -> Context:
    """The stream: ``stream`` when given, else torch's current stream for the device
    when the caller passed torch tensors (``kind`` "torch"), else CuPy's current stream
    (which is per device: call with ``device`` current). JAX has no stream to share:
    arrays handed back to it carry CuPy's through DLPack, which makes JAX wait for it."""
    if stream is not None:
        return Context(device, stream_pointer(stream), kind, True)
    if kind == "torch":
        return Context(device, _torch_current_stream(device), kind, False)
    return Context(device, cupy.cuda.get_current_stream().ptr, kind, False)


def _allocating_on(ctx: Context):
    """Make the allocator's stream the launch stream, so memory freed after the call is
    reused only in that stream's order (both CuPy's pool and torch's are stream-ordered)."""
    if not ctx.explicit:
        return _NO_SWITCH
    if ctx.torch:
        t = _torch()
        return t.cuda.stream(t.cuda.ExternalStream(ctx.stream, device=ctx.device))
    return _cupy_stream(ctx.stream)


class _Handle:
    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


def _cupy_stream(ptr: int):
    """A CuPy stream object for a raw handle (CuPy >= 14 prefers Stream.from_external)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_Handle(ptr))
    return cupy.cuda.ExternalStream(ptr)


def cupy_on_launch_stream(ctx: Context):
    """Make CuPy's current stream the launch stream (for CuPy work a call does itself,
    such as uploading a small index array, so that the kernels see it in order)."""
    if ctx.stream == cupy.cuda.get_current_stream().ptr:
        return _NO_SWITCH
    return _cupy_stream(ctx.stream)


def empty(ctx: Context, shape, dtype):
    """A new device array on ``ctx.device`` for a call's kernels to write: ``(adapted,
    owner)``, the owner a torch tensor for torch callers, else a CuPy array. Give the
    caller ``hand_over(ctx, owner)`` once the kernels that write it are launched."""
    with _allocating_on(ctx):
        if ctx.torch:
            t = _torch()
            tensor = t.empty(shape, dtype=torch_dtype(dtype),
                             device=t.device("cuda", ctx.device))
            return TorchArray(tensor, "out"), tensor
        a = cupy.empty(shape, dtype=dtype)
        return a, a


def hand_over(ctx: Context, owner):
    """What the caller gets for an array made by :func:`empty`, after the launches that
    write it: the owner itself, or for JAX a JAX array over the same memory. JAX orders
    its own stream after the work enqueued on the launch stream by the time it takes the
    buffer (DLPack's stream exchange), so taking it before the launches would let JAX read
    it unwritten."""
    if ctx.kind != "jax":
        return owner
    with cupy_on_launch_stream(ctx):
        return sys.modules["jax"].dlpack.from_dlpack(owner)


def scratch(ctx: Context, nbytes: int):
    """A temporary device buffer for one call's kernels, freed in the launch stream's
    order: (address, owner to keep alive until the launches are enqueued)."""
    with _allocating_on(ctx):
        if ctx.torch:
            t = _torch()
            buf = t.empty(nbytes, dtype=t.uint8, device=t.device("cuda", ctx.device))
            return buf.data_ptr(), buf
        buf = cupy.empty(nbytes, dtype=np.uint8)
        return buf.data.ptr, buf
