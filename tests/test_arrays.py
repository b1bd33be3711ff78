"""The array adapter's logic that needs no device: DLPack devices, torch metadata and
dtypes (through a stand-in ``torch`` module, so CI needs no torch), stream handles."""

from __future__ import annotations

import collections
import contextlib
import sys
import types

import numpy as np
import pytest

import cupaged
from cupaged import _arrays, _dtypes


class _DType:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __repr__(self):
        return f"torch.{self.name}"


class _Device:
    def __init__(self, type_, index=None):
        self.type, self.index = type_, index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


@pytest.fixture
def fake_torch(monkeypatch):
    """A minimal stand-in for the torch module: dtypes, Tensor metadata, cuda.Stream."""
    t = types.ModuleType("torch")
    for name, size in (("float32", 4), ("float16", 2), ("bfloat16", 2), ("float64", 8),
                       ("int32", 4), ("int64", 8), ("int16", 2), ("int8", 1), ("uint8", 1),
                       ("bool", 1), ("complex64", 8)):
        setattr(t, name, _DType(name, size))

    class Tensor:
        def __init__(self, shape, dtype, device=("cuda", 0), requires_grad=False, ptr=1 << 20):
            self.shape, self.dtype, self.requires_grad = tuple(shape), dtype, requires_grad
            self.device = _Device(*device)
            self._ptr = ptr
            st, acc = [], 1
            for n in reversed(self.shape):
                st.append(acc)
                acc *= n
            self._strides = tuple(reversed(st))

        def stride(self):
            return self._strides

        def element_size(self):
            return self.dtype.itemsize

        def data_ptr(self):
            return self._ptr

        @property
        def is_cuda(self):
            return self.device.type == "cuda"

        def get_device(self):
            return self.device.index if self.is_cuda else -1

        def is_contiguous(self):
            return True

        def numel(self):
            return int(np.prod(self.shape))

    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

    t.Tensor = Tensor
    t.cuda = types.SimpleNamespace(Stream=Stream)
    monkeypatch.setitem(sys.modules, "torch", t)
    monkeypatch.setattr(_arrays, "_TORCH_TO_NUMPY", {})
    monkeypatch.setattr(_arrays, "_NUMPY_TO_TORCH", {})
    return t


def test_the_dtype_tables_are_whole_when_another_thread_reads_them(fake_torch, monkeypatch):
    """Two threads' first torch calls at once (a thread a GPU): one builds the dtype
    tables while the other reads them; the reader sees them whole or not at all (a half
    table mapped bfloat16 to itself, and every later bfloat16 tensor was refused)."""
    import threading
    import time

    t = fake_torch
    building = threading.Event()

    class Slow(types.ModuleType):  # the builder pauses inside the table loop
        def __getattr__(self, name):
            if name == "int64" and threading.current_thread() is not threading.main_thread():
                building.set()
                time.sleep(0.2)
            return getattr(t, name)

    monkeypatch.setitem(sys.modules, "torch", Slow("torch"))
    builder = threading.Thread(target=lambda: _arrays.numpy_dtype(t.float32))
    builder.start()
    assert building.wait(5)
    try:
        assert _arrays.numpy_dtype(t.bfloat16) == _dtypes.BF16.numpy
        assert _arrays.torch_dtype(np.float32) is t.float32
    finally:
        builder.join()


def test_torch_dtypes_map_to_numpy_bfloat16_included(fake_torch):
    t = fake_torch
    for td, want in ((t.float32, np.float32), (t.float16, np.float16), (t.int32, np.int32),
                     (t.int64, np.int64)):
        a = _arrays.as_device_array(t.Tensor((2, 3), td), "x")
        assert a.dtype == np.dtype(want)
    bf = _arrays.as_device_array(t.Tensor((2, 3), t.bfloat16), "x")
    assert bf.dtype == _dtypes.BF16.numpy and _dtypes.lookup(bf.dtype) is _dtypes.BF16
    assert _arrays.torch_dtype(_dtypes.BF16.numpy) is t.bfloat16
    assert _arrays.torch_dtype(np.float16) is t.float16


def test_torch_metadata_is_read_without_copies(fake_torch):
    x = fake_torch.Tensor((4, 3, 8), fake_torch.float16, device=("cuda", 1), ptr=123456)
    a = _arrays.as_device_array(x, "q")
    assert a.shape == (4, 3, 8) and a.ndim == 3
    assert a.strides == (48, 16, 2)  # bytes, as NumPy and CuPy give them
    assert a.data.ptr == 123456 and a.data.device_id == 1
    assert a.flags.c_contiguous and a.tensor is x


def test_cpu_tensors_are_refused_with_a_hint(fake_torch):
    x = fake_torch.Tensor((2, 2), fake_torch.float16, device=("cpu",))
    with pytest.raises(TypeError, match=r"query is a torch tensor on cpu; cupaged needs CUDA "
                                        r"tensors \(e.g. query.cuda\(\)\)"):
        _arrays.as_device_array(x, "query")


def test_tensors_that_require_grad_are_refused(fake_torch):
    x = fake_torch.Tensor((2, 2), fake_torch.float16, requires_grad=True)
    with pytest.raises(TypeError, match=r"query requires grad.*not differentiable.*"
                                        r"torch.no_grad\(\).*query.detach\(\)"):
        _arrays.as_device_array(x, "query")


def test_unsupported_torch_dtypes_are_named(fake_torch):
    t = fake_torch
    q = t.Tensor((2, 4, 64), t.complex64)
    with pytest.raises(TypeError, match=r"query dtype torch.complex64 is not supported: "
                                        r"expected float32, float16, bfloat16"):
        cupaged.paged_attention(q, q, q, t.Tensor((2, 1), t.int32), t.Tensor((2,), t.int32))
    q = t.Tensor((2, 4, 64), t.float64)
    with pytest.raises(TypeError, match="query dtype float64 is not supported"):
        cupaged.paged_attention(q, q, q, t.Tensor((2, 1), t.int32), t.Tensor((2,), t.int32))


def test_torch_int64_tables_get_the_usual_error(fake_torch):
    t = fake_torch
    q = t.Tensor((2, 4, 64), t.float16)
    kc = t.Tensor((3, 2, 8, 16, 8), t.float16)
    vc = t.Tensor((3, 2, 64, 16), t.float16)
    with pytest.raises(TypeError, match=r"block_tables must be int32, got int64"):
        cupaged.paged_attention(q, kc, vc, t.Tensor((2, 1), t.int64), t.Tensor((2,), t.int32))


class _Capsule:
    """A DLPack producer that is not a CUDA array."""

    def __init__(self, device_type, device_id=0):
        self._dev = (device_type, device_id)

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be consumed")

    def __dlpack_device__(self):
        return self._dev


@pytest.mark.parametrize("kind, where", [(1, "CPU"), (3, r"CUDA host \(pinned\)"),
                                         (13, "CUDA managed"), (10, "ROCm"),
                                         (99, "DLPack device type 99")])
def test_non_cuda_dlpack_devices_are_refused(kind, where):
    with pytest.raises(TypeError, match=rf"key_cache lives in {where} memory \(device 0\); "
                                        r"cupaged needs CUDA device memory"):
        _arrays.as_device_array(_Capsule(kind), "key_cache")


def test_numpy_and_other_objects_are_refused():
    with pytest.raises(TypeError, match=r"out is a NumPy array \(host memory\)"):
        _arrays.as_device_array(np.zeros(3), "out")
    with pytest.raises(TypeError, match=r"out must be a CUDA array \(cupy.ndarray, torch.Tensor "
                                        r"or any __dlpack__ producer\), got dict"):
        _arrays.as_device_array({}, "out")


class _ProtocolStream:
    def __init__(self, handle, as_method=True):
        if as_method:
            self.__cuda_stream__ = lambda: (0, handle)
        else:
            self.__cuda_stream__ = (0, handle)


def test_stream_handles():
    assert _arrays.stream_pointer(_ProtocolStream(0xABC)) == 0xABC
    assert _arrays.stream_pointer(_ProtocolStream(0xABD, as_method=False)) == 0xABD
    assert _arrays.stream_pointer(0) == 0
    assert _arrays.stream_pointer(np.int64(7)) == 7
    for bad in (True, -1, "default", 1.5):
        with pytest.raises(TypeError, match="stream must be a CuPy stream, a torch stream, an "
                                            "object with __cuda_stream__, or a stream handle"):
            _arrays.stream_pointer(bad)


def test_torch_streams(fake_torch):
    assert _arrays.stream_pointer(fake_torch.cuda.Stream(0x1234)) == 0x1234


def test_torch_is_never_imported_for_cupy_users():
    import subprocess

    code = ("import sys, cupaged, cupaged.decode, cupaged.cache_ops, cupaged.kv_cache, "
            "cupaged._arrays as a; a.is_torch(1); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_framework_recognizes_jax_arrays_without_importing_jax():
    """A JAX array is told apart by its type's module, so the outputs a call allocates can
    follow it, and nothing imports JAX for the other callers."""
    jax_like = type("ArrayImpl", (), {"__module__": "jaxlib.xla_extension"})()
    jax_new = type("ArrayImpl", (), {"__module__": "jaxlib._jax"})()
    lookalike = type("Array", (), {"__module__": "jaxtyping_not_jax"})()
    assert _arrays.framework(jax_like) == "jax"
    assert _arrays.framework(jax_new) == "jax"
    assert _arrays.framework(lookalike) == "cupy"
    assert _arrays.framework(np.zeros(1)) == "cupy"
    before = set(sys.modules)
    _arrays.framework(jax_like)
    assert not any(m.partition(".")[0] in ("jax", "jaxlib") for m in set(sys.modules) - before)


@pytest.mark.parametrize("name", ["out", "lse", "lse_out"])
def test_jax_arrays_are_refused_as_outputs(name):
    jax_like = type("ArrayImpl", (), {"__module__": "jaxlib._jax"})()
    with pytest.raises(TypeError, match=f"{name} is a JAX array, which is immutable"):
        _arrays.optional_output_array(jax_like, name)


class _FakeEvent:
    def __init__(self, done=False):
        self.done, self.recorded_on = done, None

    def record(self, stream):
        self.recorded_on = stream


def test_held_imports_are_released_oldest_first_once_their_events_complete(monkeypatch):
    """The imports held past their calls (see _arrays' foreign_import) go when their
    launch-stream events have completed, oldest first, stopping at the first pending one:
    an import behind it waits longer, never less."""
    monkeypatch.setattr(_arrays, "_DEFERRED", collections.deque())
    done, pending = _FakeEvent(True), _FakeEvent(False)
    _arrays._DEFERRED.extend([(done, "a"), (done, "b"), (pending, "c"), (done, "d")])
    assert _arrays.release_completed() == 2
    assert [x for _, x in _arrays._DEFERRED] == ["c", "d"]
    pending.done = True
    assert _arrays.release_completed() == 0


def _fake_launch_world(monkeypatch, current=1234):
    """_arrays' imports and events without a GPU: imports are tagged tuples, events fakes,
    streams their handles, CuPy's current stream ``current``, device 0 current."""
    monkeypatch.setattr(_arrays, "HOLDS", _arrays._Holds())
    monkeypatch.setattr(_arrays, "_DEFERRED", collections.deque())
    monkeypatch.setattr(_arrays.cupy, "from_dlpack", lambda x: ("imported", x))
    monkeypatch.setattr(_arrays.cupy.cuda, "Event", lambda **kw: _FakeEvent())
    monkeypatch.setattr(_arrays.cupy.cuda, "Device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_arrays, "_cupy_stream", lambda ptr: ptr)
    monkeypatch.setattr(_arrays.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(_arrays, "capturing", lambda ptr: False)
    monkeypatch.setattr(_arrays.cupy.cuda, "get_current_stream",
                        lambda: types.SimpleNamespace(ptr=current))


def test_imports_are_held_from_adaptation_past_the_launches(monkeypatch):
    """A call's imports wait unstamped while it adapts, take its context's stream, and
    when its launching scope exits (before the call returns: the caller may then destroy
    the stream) join the held imports behind one event per stream; none is let go before
    its event completes."""
    _fake_launch_world(monkeypatch)
    a, b = _arrays.foreign_import("a"), _arrays.foreign_import("b")
    assert _arrays.HOLDS.pending == [a, b] and not _arrays._DEFERRED
    with _arrays.launching(0):
        _arrays.stamp_holds(_arrays.Context(0, 1234, "jax", True))
        assert _arrays.HOLDS.stamped == [(1234, 0, a), (1234, 0, b)]
        assert not _arrays.HOLDS.pending and not _arrays._DEFERRED  # launches to come
    assert not _arrays.HOLDS.stamped  # recorded on the way out
    (e1, x1), (e2, x2) = _arrays._DEFERRED
    assert e1 is e2 and e1.recorded_on == 1234 and (x1, x2) == (a, b)
    c = _arrays.foreign_import("c")  # the next call's
    assert _arrays.HOLDS.pending == [c] and len(_arrays._DEFERRED) == 2
    assert _arrays.release_completed() == 2  # the event has not completed
    e1.done = True
    assert _arrays.release_completed() == 0


def test_a_call_that_raises_still_records_its_imports_events(monkeypatch):
    """A call that raises after making its context (and perhaps after some launches)
    records the events on the way out like one that returns, so nothing is left to
    record on a stream the caller may have destroyed since."""
    _fake_launch_world(monkeypatch)
    x = _arrays.foreign_import("x")
    with pytest.raises(ValueError, match="after the context"):
        with _arrays.launching(0):
            ctx = _arrays.context(0, "jax", 1234)
            raise ValueError("after the context")
    assert ctx.stream == 1234 and not _arrays.HOLDS.stamped
    assert [(e.recorded_on, i) for e, i in _arrays._DEFERRED] == [(1234, x)]


def test_a_checks_context_leaves_the_imports_to_the_launches(monkeypatch):
    """CUPAGED_DEBUG's checks read before the launches, on a stream ordered after the
    producers' writes; the imports stay pending for the launches' context, so their
    event is recorded after the launches and not after the checks."""
    _fake_launch_world(monkeypatch, current=1)
    launch = _FakeStream(2)
    monkeypatch.setattr(_arrays, "_cupy_stream", lambda ptr: {1: 1, 2: launch}[ptr])
    x = _arrays.foreign_import("x")
    with _arrays.launching(0):
        check = _arrays.check_context(0, "jax", 2)
    assert check.stream == 2 and len(launch.waited) == 1  # ordered after CuPy's stream
    assert _arrays.HOLDS.pending == [x] and not _arrays._DEFERRED
    with _arrays.launching(0):
        _arrays.context(0, "jax", 2)
    assert [(e.recorded_on, i) for e, i in _arrays._DEFERRED] == [(launch, x)]


def test_a_captured_call_holds_nothing(monkeypatch):
    """A call captured into a CUDA graph launches nothing now (its replays read the inputs,
    which the caller keeps alive as for any graph): no event is recorded on the capturing
    stream, whose event could never be queried afterwards and would hold every import
    queued behind it for good."""
    _fake_launch_world(monkeypatch)
    monkeypatch.setattr(_arrays, "capturing", lambda ptr: ptr == 1234)
    _arrays.foreign_import("x")
    with _arrays.launching(0):
        _arrays.context(0, "jax", 1234)
    assert not _arrays.HOLDS.stamped and not _arrays._DEFERRED


class _BrokenEvent(_FakeEvent):
    def record(self, stream):
        raise RuntimeError("cudaErrorInvalidResourceHandle")


def test_an_event_that_cannot_be_recorded_leaves_nothing_behind(monkeypatch):
    """An event that fails to record (a stream of another device, a bad handle) raises
    from the call that launched, once: the thread's later calls do not try that stream
    again, and a call that failed on its own keeps its own error."""
    _fake_launch_world(monkeypatch)
    monkeypatch.setattr(_arrays.cupy.cuda, "Event", lambda **kw: _BrokenEvent())
    _arrays.foreign_import("x")
    with pytest.raises(RuntimeError, match="InvalidResourceHandle"):
        with _arrays.launching(0):
            _arrays.context(0, "jax", 1234)
    assert not _arrays.HOLDS.stamped
    with _arrays.launching(0):  # a later call: nothing left to record
        _arrays.context(0, "jax", 1234)
    _arrays.foreign_import("y")
    with pytest.raises(ValueError, match="the call's own"):
        with _arrays.launching(0):
            _arrays.context(0, "jax", 1234)
            raise ValueError("the call's own")
    assert not _arrays.HOLDS.stamped


def test_launching_switches_to_the_device_and_back(monkeypatch):
    """launching makes the call's device current like on_device, and switches back."""
    _fake_launch_world(monkeypatch)
    entered = []

    class Switch:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            entered.append(("in", self.d))

        def __exit__(self, *exc):
            entered.append(("out", self.d))

    monkeypatch.setattr(_arrays.cupy.cuda, "Device", Switch)
    with _arrays.launching(0):
        pass
    assert entered == []
    with _arrays.launching(3):
        assert entered == [("in", 3)]
    assert entered == [("in", 3), ("out", 3)]


class _FakeStream:
    def __init__(self, ptr):
        self.ptr, self.waited = ptr, []

    def wait_event(self, event):
        self.waited.append(event)


def test_a_launch_stream_other_than_cupys_waits_for_it(monkeypatch):
    """JAX orders its writes before CuPy's current stream (cupy.from_dlpack's): a call that
    launches on another stream (stream=, torch's) makes it wait for CuPy's; on CuPy's own,
    nothing is added."""
    monkeypatch.setattr(_arrays, "HOLDS", _arrays._Holds())
    current, launch = _FakeStream(1), _FakeStream(2)
    events = []

    def event(**kw):
        e = _FakeEvent()
        events.append(e)
        return e

    monkeypatch.setattr(_arrays.cupy.cuda, "Event", event)
    monkeypatch.setattr(_arrays.cupy.cuda, "get_current_stream", lambda: current)
    monkeypatch.setattr(_arrays, "_cupy_stream", lambda ptr: {1: current, 2: launch}[ptr])
    captured = set()
    monkeypatch.setattr(_arrays, "capturing", lambda ptr: ptr in captured)
    _arrays.HOLDS.pending.append("imported")
    _arrays.stamp_holds(_arrays.Context(0, 2, "torch", True))
    assert events[0].recorded_on is current and launch.waited == events
    for stream in (2, 1):  # no wait across a capture's boundary, either way
        captured.add(stream)
        _arrays.HOLDS.pending.append("imported")
        _arrays.stamp_holds(_arrays.Context(0, 2, "torch", True))
        assert len(events) == 1 and len(launch.waited) == 1
        captured.clear()
    _arrays.HOLDS.pending.append("imported")
    _arrays.stamp_holds(_arrays.Context(0, 1, "jax", False))
    assert len(events) == 1 and current.waited == []
    _arrays.HOLDS.stamped.clear()


class _RefusingEvent:
    @property
    def done(self):
        raise _arrays.cupy.cuda.runtime.CUDARuntimeError(900)  # not permitted while capturing


def test_an_event_that_cannot_be_queried_keeps_its_import_held(monkeypatch):
    """Querying an event fails while a stream capture is under way: the imports stay held
    (later imports look again), and the call goes on."""
    monkeypatch.setattr(_arrays, "_DEFERRED", collections.deque())
    _arrays._DEFERRED.extend([(_RefusingEvent(), "a"), (_FakeEvent(True), "b")])
    assert _arrays.release_completed() == 2


def _calls_of(tree, attr):
    """(call node, its enclosing with-items' callee names) for each ``_arrays.<attr>(...)``
    call in a module's syntax tree."""
    import ast

    found = []

    def visit(node, withs):
        if isinstance(node, ast.With):
            withs = withs + [ast.unparse(item.context_expr.func)
                             for item in node.items if isinstance(item.context_expr, ast.Call)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == attr and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "_arrays"):
            found.append((node, withs))
        for child in ast.iter_child_nodes(node):
            visit(child, withs)

    visit(tree, [])
    return found


def test_every_launch_context_is_made_inside_a_launching_scope():
    """A call's context stamps its imports with the launch stream, and only the exit of
    ``_arrays.launching`` records their events before the call returns (a caller may
    destroy the stream then): every ``_arrays.context(...)`` in the package sits in a
    ``with _arrays.launching(...)`` block, so no module records late or not at all."""
    import ast
    import pathlib

    root = pathlib.Path(cupaged.__file__).parent
    sites = 0
    for path in sorted(root.rglob("*.py")):
        for node, withs in _calls_of(ast.parse(path.read_text()), "context"):
            sites += 1
            assert "_arrays.launching" in withs, f"{path.relative_to(root)}:{node.lineno}"
    assert sites >= 10  # the entry points' sites were found


def test_no_event_is_queried_while_this_thread_captures(monkeypatch):
    """A DLPack import lets go of earlier imports whose events completed, by querying the
    events: not while this thread captures a CUDA graph (on CuPy's current stream or
    torch's), where the query would invalidate the capture."""
    queried = []
    monkeypatch.setattr(_arrays, "release_completed", lambda: queried.append(1))
    monkeypatch.setattr(_arrays.cupy, "from_dlpack", lambda x: x)
    monkeypatch.setattr(_arrays, "_DEFERRED", collections.deque([("event", "import")]))
    monkeypatch.setattr(_arrays.cupy.cuda, "get_current_stream",
                        lambda: types.SimpleNamespace(ptr=0x1234))
    monkeypatch.setattr(_arrays.HOLDS, "pending", [])
    for captured, want in (({0x1234}, 0), (set(), 1)):
        monkeypatch.setattr(_arrays, "capturing", lambda s, c=captured: s in c)
        queried.clear()
        _arrays.foreign_import(object())
        assert len(queried) == want, captured


def test_imports_whose_event_failed_to_record_stay_held(monkeypatch):
    """An event that fails to record (raising from this call) leaves its stream's imports,
    and those after it, held rather than let go while their kernels may still read them."""
    monkeypatch.setattr(_arrays, "capturing", lambda s: False)
    monkeypatch.setattr(_arrays, "_DEFERRED", collections.deque())

    def event_on(stream, device):
        if stream == 2:
            raise RuntimeError("cannot record")
        return ("event", stream)

    monkeypatch.setattr(_arrays, "_event_on", event_on)
    held = [object() for _ in range(3)]
    monkeypatch.setattr(_arrays.HOLDS, "stamped", [(1, 0, held[0]), (2, 0, held[1]),
                                                    (3, 0, held[2])])
    monkeypatch.setattr(_arrays, "_UNRECORDED", [], raising=False)
    with pytest.raises(RuntimeError, match="cannot record"):
        _arrays.record_launched()
    assert [i for _, i in _arrays._DEFERRED] == [held[0]]
    assert [i for i in _arrays._UNRECORDED] == held[1:]
    assert _arrays.HOLDS.stamped == []

