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

import collections
import contextlib
import sys
import threading
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


def stream_framework(*xs) -> str:
    """Whose current stream a call over ``xs`` launches on (``context``'s ``kind``):
    torch's when any of them is a torch tensor (a torch model writing its K and V into a
    CuPy cache made them on torch's stream, and reads the cache there next), else the
    first one's framework."""
    if any(is_torch(x) for x in xs):
        return "torch"
    return framework(xs[0])


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
    global _TORCH_TO_NUMPY, _NUMPY_TO_TORCH
    if not _TORCH_TO_NUMPY:
        # Built apart and published whole (the reverse table first, the one tested last):
        # another thread's first call may read them meanwhile.
        t = _torch()
        pairs = [("float32", np.float32), ("float16", np.float16), ("float64", np.float64),
                 ("int32", np.int32), ("int64", np.int64), ("int16", np.int16),
                 ("int8", np.int8), ("uint8", np.uint8), ("bool", np.bool_)]
        to_numpy = {getattr(t, name): np.dtype(np_dtype) for name, np_dtype in pairs}
        if _dtypes.BF16.numpy is not None:
            to_numpy[t.bfloat16] = _dtypes.BF16.numpy
        for name, d in (("float8_e4m3fn", _dtypes.E4M3), ("float8_e5m2", _dtypes.E5M2)):
            if d.numpy is not None and hasattr(t, name):  # fp8 KV caches
                to_numpy[getattr(t, name)] = d.numpy
        _NUMPY_TO_TORCH = {v: k for k, v in to_numpy.items()}
        _TORCH_TO_NUMPY = to_numpy
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


class StridedView:
    """An adapted array seen with other dimensions (``reshaped``): the same memory, its
    metadata alone. ``owner`` is kept (a torch tensor's wrapper keeps the tensor)."""

    __slots__ = ("shape", "strides", "ndim", "dtype", "data", "owner")

    def __init__(self, owner, shape, strides):
        self.owner = owner
        self.shape = tuple(int(n) for n in shape)
        self.strides = tuple(int(s) for s in strides)
        self.ndim = len(self.shape)
        self.dtype = owner.dtype
        self.data = owner.data

    @property
    def flags(self) -> _Flags:
        step, dense = self.dtype.itemsize, True
        for n, st in zip(reversed(self.shape), reversed(self.strides)):
            if n > 1 and st != step:
                dense = False
            step *= max(n, 1)
        return _Flags(dense)


def reshaped(a, groups, name: str, what: str):
    """Adapted array ``a`` with each group of consecutive dimensions merged into one
    (``groups``: their counts, in order; dimensions of size 1 may sit anywhere), as a
    view: a ValueError naming ``name`` when the memory does not allow it (``what``: the
    shape expected, for the message)."""
    if sum(groups) != a.ndim:
        raise ValueError(f"{name} must be {what}, got shape {a.shape}")
    shape, strides, at = [], [], 0
    for g in groups:
        dims = list(zip(a.shape[at:at + g], a.strides[at:at + g]))
        at += g
        kept = [(n, st) for n, st in dims if n != 1]
        for (_, outer), (n_in, inner) in zip(kept, kept[1:]):
            if outer != inner * n_in:
                raise ValueError(f"{name} ({what}) cannot be seen as one array of its merged "
                                 f"dimensions without a copy: shape {a.shape}, strides "
                                 f"{a.strides}")
        size = 1
        for n, _ in dims:
            size *= n
        shape.append(size)
        strides.append(kept[-1][1] if kept else a.dtype.itemsize)
    return StridedView(a, shape, strides)


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
        return foreign_import(x)
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


# ---- imports from producers with their own allocator ---------------------------------------
#
# A DLPack import from JAX (or any producer other than CuPy and torch) lends memory from an
# allocator that orders reuse by the producer's own streams only. Once the import is let
# go, the producer may hand that memory to new work at once (a temporary `jnp.asarray(...)`
# passed straight to a call is freed on return, and the next `jnp.asarray` of its size
# lands in it) while the call's kernels, queued on the launch stream, have not read it.
# So cupaged holds each import past the call:
#   - a call's imports wait in `pending` while it adapts its arguments;
#   - the context it makes inside `launching` stamps them with the launch stream
#     (`stamped`);
#   - after its launches (hand_over, or at the latest when `launching` exits, returned or
#     raised), an event is recorded on that stream and they join `_DEFERRED`;
#   - they are let go once the event has completed, as later imports find (queried,
#     never waited for; not at every call's context: querying an event is not allowed
#     while a stream capture is under way, and CuPy-only calls may be captured).
# The event is recorded before the call returns: once it has, the caller may destroy the
# stream (a `stream=` of its own, or the one current in a `with` block), and recording on
# a destroyed stream is undefined (it crashed the process). An import whose call failed
# before making a context launched nothing; the thread's next context stamps it.
# The producer ordered its writes before CuPy's current stream (the stream cupy.from_dlpack
# hands to __dlpack__); a call launching on another stream (stream=, or torch's) makes that
# stream wait for CuPy's first.


class _Holds(threading.local):
    def __init__(self):
        self.pending = []  # this thread's imports not yet stamped by a context
        self.stamped = []  # (stream, device, import): the current call's, until launched


HOLDS = _Holds()  # (a call that finds both lists empty has no import to hold: _fastrun)
_DEFERRED: collections.deque = collections.deque()  # (event, import) until the event completes
_DEFERRED_LOCK = threading.Lock()
_UNRECORDED: list = []  # imports whose event failed to record: held for the process's life


def foreign_import(x):
    """``x`` (a DLPack producer on a CUDA device) as a CuPy array, its import held until
    the kernels of the call it is passed to have run (see above)."""
    if _DEFERRED and not _capture_under_way():
        release_completed()
    imported = cupy.from_dlpack(x)
    HOLDS.pending.append(imported)
    return imported


def _capture_under_way() -> bool:
    """Is this thread capturing a CUDA graph, on CuPy's current stream or on torch's
    (torch.cuda.graph's)? An event query then would invalidate the capture."""
    if capturing(cupy.cuda.get_current_stream().ptr):
        return True
    initialized = getattr(getattr(_torch(), "cuda", None), "is_initialized", None)
    if initialized is not None and initialized():
        return capturing(_torch_current_stream(cupy.cuda.runtime.getDevice()))
    return False


def capturing(stream: int) -> bool:
    """Is ``stream`` being captured into a CUDA graph?"""
    rt = cupy.cuda.runtime
    query = getattr(rt, "streamIsCapturing", None)
    if query is None:  # pragma: no cover - CuPy without it: assume not
        return False
    return int(query(stream)) != int(getattr(rt, "streamCaptureStatusNone", 0))


def order_after_producers(ctx: "Context") -> None:
    """Order ``ctx``'s launch stream after CuPy's current one, which the producers' writes
    of this thread's pending imports precede (not while either stream is captured: a
    stream may not wait across a capture's boundary; a graph's replays are ordered by
    whoever launches them)."""
    current = cupy.cuda.get_current_stream()
    if current.ptr != ctx.stream and not (capturing(ctx.stream) or capturing(current.ptr)):
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(current)
        _cupy_stream(ctx.stream).wait_event(event)


def stamp_holds(ctx: "Context") -> None:
    """Give this thread's pending imports ``ctx``'s launch stream (they are the current
    call's: a call adapts its arguments before it makes its context), ordered after the
    producers' writes (order_after_producers)."""
    holds = HOLDS
    order_after_producers(ctx)
    holds.stamped += [(ctx.stream, ctx.device, a) for a in holds.pending]
    holds.pending.clear()


def record_launched() -> None:
    """After the launches of the call that stamped this thread's imports: an event on
    each of their streams, past which the imports may go. A stream being captured into a
    CUDA graph gets none and its imports go now: nothing ran on them (the graph's replays
    read the inputs, which the caller keeps alive for them), and an event recorded in a
    capture cannot be queried afterwards, so it would hold everything queued behind it.
    The list is taken first: an event that fails to record raises once, from this call,
    and the imports it would have held and those after it stay held for good
    (``_UNRECORDED``): their kernels may still read them."""
    stamped, HOLDS.stamped = HOLDS.stamped, []
    events = {}  # stream: its event, None while it is captured
    for n, (stream, device, imported) in enumerate(stamped):
        if stream not in events:
            try:
                events[stream] = None if capturing(stream) else _event_on(stream, device)
            except BaseException:
                with _DEFERRED_LOCK:
                    _UNRECORDED.extend(i for _, _, i in stamped[n:])
                raise
        if events[stream] is not None:
            with _DEFERRED_LOCK:
                _DEFERRED.append((events[stream], imported))


def _event_on(stream: int, device: int):
    """An event recorded on ``stream`` (a handle) of ``device``, now."""
    with cupy.cuda.Device(device):
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(_cupy_stream(stream))
    return event


def release_completed() -> int:
    """Let go of the held imports whose event has completed, oldest first, stopping at
    the first that has not (one behind it is held a little longer, never too little).
    Returns how many are still held."""
    with _DEFERRED_LOCK:
        try:
            while _DEFERRED and _DEFERRED[0][0].done:
                _DEFERRED.popleft()
        except cupy.cuda.runtime.CUDARuntimeError:  # not now (a capture under way): later
            pass
        return len(_DEFERRED)


# ---- devices, streams, allocation --------------------------------------------------------------


def on_device(device: int):
    """A context making ``device`` current; free when it already is (a switch costs
    microseconds, and this runs on every call)."""
    return _NO_SWITCH if runtime.getDevice() == device else cupy.cuda.Device(device)


class _Launching:
    """``launching``'s scope: on_device's switch (None: none), and the events at the end."""

    __slots__ = ("switch",)

    def __init__(self, switch):
        self.switch = switch

    def __enter__(self):
        if self.switch is not None:
            self.switch.__enter__()

    def __exit__(self, *exc):
        try:
            if HOLDS.stamped:
                record_launched()
        except Exception:
            if exc[0] is None:  # else the call's own error is the one to see
                raise
        finally:
            if self.switch is not None:
                self.switch.__exit__(*exc)


_LAUNCHING_HERE = _Launching(None)


def launching(device: int):
    """The scope of a call's context and launches: ``device`` current (as on_device), and
    on the way out, returned or raised, the events that hold the call's imports recorded
    on its launch stream, which the caller may destroy once the call has returned.
    ``context`` is made inside it; a context for reads before the launches (CUPAGED_DEBUG's
    checks) comes from ``check_context``."""
    switch = on_device(device)
    return _LAUNCHING_HERE if switch is _NO_SWITCH else _Launching(switch)


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
    return torch_stream_getter()(device)


def torch_stream_getter():
    """``f(device) -> handle`` of torch's current stream on a device (torch imported)."""
    t = _torch()
    raw = getattr(t._C, "_cuda_getCurrentRawStream", None)  # no Stream object: ~10x faster
    return raw if raw is not None else lambda device: t.cuda.current_stream(device).cuda_stream


def torch_tensor_type():
    """torch.Tensor (torch imported: a call passed a tensor)."""
    return _torch().Tensor


def context(device: int, kind: str, stream=None) -> Context:
    """The stream: ``stream`` when given, else torch's current stream for the device
    when the caller passed torch tensors (``kind`` "torch"), else CuPy's current stream
    (which is per device: call with ``device`` current). JAX has no stream to share:
    arrays handed back to it carry CuPy's through DLPack, which makes JAX wait for it.
    Made inside the call's ``launching`` scope, which records its imports' events after
    the launches."""
    if HOLDS.pending:
        ctx = _context(device, kind, stream)
        stamp_holds(ctx)
        return ctx
    return _context(device, kind, stream)


def check_context(device: int, kind: str, stream=None) -> Context:
    """``context``'s stream for reads that come before a call's launches (CUPAGED_DEBUG's
    checks, which synchronize): ordered after the producers' writes, the imports left to
    the launches' own context, whose ``launching`` scope records their events after the
    launches."""
    ctx = _context(device, kind, stream)
    if HOLDS.pending:
        order_after_producers(ctx)
    return ctx


def _context(device: int, kind: str, stream) -> Context:
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
    if HOLDS.stamped:  # the call's inputs from JAX: its launches are queued
        record_launched()
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
