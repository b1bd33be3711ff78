"""cupaged's host path on a machine without a GPU: CuPy arrays at made-up device addresses,
and what needs a device (the current device and its stream, streams, events, device
properties, allocation, kernel loading, ``cuLaunchKernel``, ``cudaMemsetAsync``) replaced by
stand-ins that record what the library asked of them. What runs is cupaged's own Python
and CuPy's attribute reads: the host time a change to the call path can move
(``cupaged-bench overhead --stub-driver``), and the launches the tests compare.
"""

from __future__ import annotations

import contextlib
import types

import cupy
import numpy as np
from cupy.cuda import memory
from cupy_backends.cuda.api import runtime

from .. import _arrays, _prepared, jit, planning

# An H200's: sm_90, 132 SMs, 227 KiB of shared memory a block, 228 a multiprocessor.
DEVICE = planning.DeviceInfo(0, "sm_90", 132, 232448, 233472)
STREAM = 0x5151  # device d's current stream is STREAM + 0x100 * d


class Stub:
    """The stand-ins' state. ``device``: the current device; ``next_address``: where the
    next allocation goes (a test may set it to give two calls' allocations the same
    address); ``launches``: when recording, each kernel launch as ``(kernel name, grid,
    block, smem, stream, current device, parameter bytes)`` and each memset as
    ``("memset", address, value, bytes, stream)``."""

    def __init__(self, record: bool):
        self.device = 0
        self.next_address = 0x7F00_0000_0000
        self.launches = [] if record else None
        self._kernels = {}  # function address: its Launcher
        self._streams = {}  # device: its current stream
        self.Stream = self._stream_class()

    def fake(self, shape, dtype, ptr=None, strides=None, device=None):
        """A CuPy array of ``shape`` and ``dtype`` at ``ptr`` (default: a fresh address),
        on ``device`` (default: the current one); nothing is allocated."""
        dtype = np.dtype(dtype)
        if ptr is None:
            ptr = self._take(max(int(np.prod(shape)) * dtype.itemsize, 1))
        mem = memory.UnownedMemory(ptr, 1 << 40, None, self.device if device is None else device)
        return cupy.ndarray(shape, dtype, memptr=memory.MemoryPointer(mem, 0), strides=strides)

    def _take(self, nbytes: int) -> int:
        ptr = self.next_address
        self.next_address += (nbytes + 0xFFFF) & ~0xFFFF
        return ptr

    def alloc(self, nbytes: int):
        return memory.MemoryPointer(memory.UnownedMemory(self._take(max(nbytes, 1)), nbytes,
                                                         None, self.device), 0)

    def stream(self, device_id=-1):
        """cupy.cuda.get_current_stream's stand-in."""
        d = self.device if device_id == -1 else device_id
        s = self._streams.get(d)
        if s is None:
            s = self._streams[d] = self.Stream(STREAM + 0x100 * d)
        return s

    def use_stream(self, s) -> None:
        """Make ``s`` the current device's current stream (a Stream's ``with``)."""
        self._streams[self.device] = s

    def _stream_class(self):
        stub = self

        class Stream:
            """cupy.cuda.Stream for a handle (``from_external``, ``ExternalStream``): the
            current stream of the current device while inside ``with``."""

            def __init__(self, ptr):
                self.ptr = ptr

            @classmethod
            def from_external(cls, handle):
                return cls(handle.__cuda_stream__()[1])

            def synchronize(self):
                pass

            def __enter__(self):
                self._before = stub.stream()
                stub.use_stream(self)
                return self

            def __exit__(self, *exc):
                stub.use_stream(self._before)

        return Stream

    def load(self, spec, device_id, dynamic_smem=0):
        fn = types.SimpleNamespace(ptr=0xF000 + 0x10 * len(self._kernels))
        kernel = jit.Launcher(fn, jit.ARG_FORMATS[spec.kernel], spec.name)
        self._kernels[fn.ptr] = kernel
        return kernel

    def launch(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        if self.launches is not None:
            kernel = self._kernels[f]
            self.launches.append((kernel.name, (gx, gy, gz), (bx, by, bz), smem, stream,
                                  self.device, kernel.packed(params)))

    def memset(self, ptr, value, nbytes, stream):
        if self.launches is not None:
            self.launches.append(("memset", ptr, value, nbytes, stream))

    @staticmethod
    def event_class():
        class Event:
            """cupy.cuda.Event: recorded, and complete at once."""

            done = True

            def __init__(self, block=False, disable_timing=False, interprocess=False):
                pass

            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

        return Event

    def device_class(self):
        stub = self

        class Device:
            """cupy.cuda.Device as a context: the stub's current device while inside."""

            def __init__(self, device=None):
                self.id = stub.device if device is None else int(device)

            def __enter__(self):
                self._before, stub.device = stub.device, self.id
                return self

            def __exit__(self, *exc):
                stub.device = self._before

        return Device


@contextlib.contextmanager
def stubbed_driver(record: bool = False):
    """Replace what needs a device (see the module) while inside; yields the
    :class:`Stub`. The kernel and prepared-call caches are emptied on the way in and out,
    so nothing made under the stand-ins outlives them."""
    stub = Stub(record)
    patches = [
        (runtime, "getDevice", lambda: stub.device),
        (runtime, "memsetAsync", stub.memset),
        (cupy.cuda, "get_current_stream", stub.stream),
        (cupy.cuda, "Device", stub.device_class()),
        (cupy.cuda, "Stream", stub.Stream),
        (cupy.cuda, "ExternalStream", stub.Stream),
        (cupy.cuda, "Event", stub.event_class()),
        (runtime, "streamIsCapturing", lambda stream: runtime.streamCaptureStatusNone),
        (planning, "device_info", lambda device_id: DEVICE._replace(id=device_id)),
        (planning, "resident_ctas", lambda device_id, kernel, threads, smem:
            DEVICE.sm_count * max(1, min(16, DEVICE.sm_smem // (smem + 1024)))),
        (jit, "load", stub.load),
        (jit, "driver", types.SimpleNamespace(launchKernel=stub.launch)),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    allocator = cupy.cuda.get_allocator()
    jit.clear_memory_caches()
    _prepared.clear()
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        cupy.cuda.set_allocator(stub.alloc)
        yield stub
    finally:
        _arrays.release_completed()  # (imports held past stand-in events: complete)
        cupy.cuda.set_allocator(allocator)
        for obj, name, value in saved:
            setattr(obj, name, value)
        jit.clear_memory_caches()
        _prepared.clear()
