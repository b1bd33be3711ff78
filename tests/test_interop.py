"""PyTorch and DLPack inputs, streams, CUDA graphs and several GPUs (GPU tests).

Torch tests skip where torch does not import; the two-GPU tests where one GPU is seen."""

from __future__ import annotations

import threading

import cupy
import numpy as np
import pytest

import cupaged
from cupaged import _dtypes, planning, reference, testing
from cupaged.bench.timing import Spin
from conftest import assert_close, make_problem

pytestmark = pytest.mark.gpu

DTYPES = [np.float32, np.float16, _dtypes.BF16.numpy]
SLEEP_US = 100_000  # long enough that a wrong stream or a hidden sync is visible


def _torch():
    return pytest.importorskip("torch")


def to_torch(a, device="cuda"):
    torch = _torch()
    a = np.ascontiguousarray(a)
    if a.dtype == _dtypes.BF16.numpy:
        return torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16)
    return torch.from_numpy(a).to(device)


def to_numpy(t):
    torch = _torch()
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return t.float().cpu().numpy()
    return t.cpu().numpy()


def torch_args(p):
    return {k: (None if v is None else to_torch(v)) for k, v in p.host_args().items()}


def _tol(dtype):
    return testing.TOLERANCE[_dtypes.lookup(dtype).name]


def _two_gpus():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")


# ---- every entry point with torch tensors ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: _dtypes.lookup(d).name)
@pytest.mark.parametrize("partition", ["never", "always"])
def test_paged_attention_torch_in_torch_out(rng, dtype, partition):
    torch = _torch()
    p = make_problem(rng, dtype=dtype, lens=(1, 17, 40, 0, 33), heads=8, kv_heads=2,
                     head_size=64, block_size=16, alibi=True)
    args = torch_args(p)
    out = cupaged.paged_attention(**args, partition=partition)
    assert isinstance(out, torch.Tensor) and out.dtype == args["query"].dtype
    assert out.device == args["query"].device and out.shape == args["query"].shape
    ref = p.reference()
    assert_close(to_numpy(out), ref, _tol(dtype))

    # out= is written in place: a slice in the middle of a poisoned buffer.
    n = p.query.shape[0]
    big = torch.full((n + 2, *p.query.shape[1:]), float("nan"), dtype=out.dtype, device="cuda")
    got = cupaged.paged_attention(**args, partition=partition, out=big[1:n + 1])
    assert got.data_ptr() == big[1].data_ptr()
    assert torch.isnan(big[0]).all() and torch.isnan(big[n + 1]).all()
    assert_close(to_numpy(big[1:n + 1]), ref, _tol(dtype))


def test_inputs_are_read_in_place(rng):
    """A strided query slice of a fused QKV tensor, changed between calls: each call reads
    the tensor's memory as it is then (no copy, no cache of inputs)."""
    torch = _torch()
    p = make_problem(rng, dtype=np.float16, lens=(9, 30), heads=4, kv_heads=2, head_size=64)
    args = torch_args(p)
    qkv = torch.zeros((2, 12, 64), dtype=torch.float16, device="cuda")
    qkv[:, 4:8] = args["query"]
    args["query"] = qkv[:, 4:8]
    first = cupaged.paged_attention(**args)
    assert_close(to_numpy(first), p.reference(), _tol(np.float16))
    new_q = testing.random_normal(p.query.shape, np.float16, rng)
    qkv[:, 4:8] = to_torch(new_q)
    second = cupaged.paged_attention(**args)
    p.query = new_q
    assert_close(to_numpy(second), p.reference(), _tol(np.float16))


def test_mixed_and_generic_dlpack_inputs(rng):
    """CuPy query with torch caches (the query decides: CuPy out), and a producer that
    only speaks the DLPack protocol."""
    _torch()

    class Producer:
        def __init__(self, t):
            self._t = t

        def __dlpack__(self, stream=None, **kw):
            return self._t.__dlpack__(stream=stream, **kw)

        def __dlpack_device__(self):
            return self._t.__dlpack_device__()

    p = make_problem(rng, dtype=np.float16, lens=(12, 3), heads=4, kv_heads=2, head_size=64)
    args = torch_args(p)
    args["query"] = cupy.asarray(p.query)
    out = cupaged.paged_attention(**args)
    assert isinstance(out, cupy.ndarray)
    assert_close(cupy.asnumpy(out).astype(np.float64), p.reference(), _tol(np.float16))
    args = {k: Producer(v) for k, v in torch_args(p).items() if v is not None}
    out = cupaged.paged_attention(**args)
    assert isinstance(out, cupy.ndarray)
    assert_close(cupy.asnumpy(out).astype(np.float64), p.reference(), _tol(np.float16))


def _jax():
    # (conftest keeps JAX from reserving most of the GPU's memory.)
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    return jax


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: _dtypes.lookup(d).name)
@pytest.mark.parametrize("partition", ["never", "always"])
def test_jax_in_jax_out(rng, dtype, partition):
    """JAX arrays go in without copies and what cupaged allocates comes back as JAX arrays
    (paged_attention, attention with its lse, merge_state), holding the right values."""
    jax = _jax()
    jnp = jax.numpy
    p = make_problem(rng, dtype=dtype, lens=(1, 17, 40, 0, 33), heads=8, kv_heads=2,
                     head_size=64, block_size=16)
    args = {k: jnp.asarray(v) for k, v in p.host_args().items() if v is not None}
    out = cupaged.paged_attention(**args, partition=partition)
    assert isinstance(out, jax.Array) and out.dtype == args["query"].dtype
    assert out.shape == args["query"].shape
    ref = p.reference()
    assert_close(np.asarray(out, dtype=np.float64), ref, _tol(dtype))
    with pytest.raises(TypeError, match="out is a JAX array, which is immutable"):
        cupaged.paged_attention(**args, partition=partition, out=out)

    out2, lse = cupaged.attention(args["query"], args["key_cache"], args["value_cache"],
                                  args["block_tables"], args["context_lens"], kv_layout="vllm",
                                  return_lse=True)
    assert isinstance(out2, jax.Array) and isinstance(lse, jax.Array)
    assert lse.dtype == jnp.float32 and lse.shape == out2.shape[:2]
    assert_close(np.asarray(out2, dtype=np.float64), ref, _tol(dtype))
    merged, mlse = cupaged.merge_state(out2, lse, out2, lse)  # a state merged with itself
    assert isinstance(merged, jax.Array) and isinstance(mlse, jax.Array)
    assert_close(np.asarray(merged, dtype=np.float64), ref, _tol(dtype))
    got = np.asarray(mlse)
    want = np.asarray(lse) + np.log(2.0)
    live = np.isfinite(want)
    np.testing.assert_allclose(got[live], want[live], rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.isfinite(got), live)


def _pool_holds_nan(*shapes_dtypes):
    """Free NaN-filled buffers of these shapes into CuPy's pool, so the next arrays of the
    same sizes start as NaN, not as whatever the device held."""
    for shape, dtype in shapes_dtypes:
        cupy.full(shape, np.nan, dtype=dtype)


@pytest.mark.parametrize("partition", ["never", "always"])
def test_jax_waits_for_the_kernel_that_writes_its_output(rng, partition):
    """8 sequences of 131,072 tokens, every V row 1, so the right output is 1: a JAX read
    right after the call must see the kernel's result, not the buffer before it (NaN: JAX
    orders its stream after what was enqueued when it took the buffer); a stale read is
    NaN."""
    jax = _jax()
    jnp = jax.numpy
    seqs, ctx, heads, kv_heads, hs, bs = 8, 131_072, 8, 8, 128, 16
    nb = 256  # the tables cycle over these blocks: long contexts in little memory
    kc = testing.random_normal((nb, kv_heads, hs // 8, bs, 8), np.float16, rng)
    args = dict(query=jnp.asarray(testing.random_normal((seqs, heads, hs), np.float16, rng)),
                key_cache=jnp.asarray(kc),
                value_cache=jnp.ones((nb, kv_heads, hs, bs), jnp.float16),
                block_tables=jnp.asarray(
                    (np.arange(seqs * ctx // bs) % nb).reshape(seqs, -1).astype(np.int32)),
                context_lens=jnp.full((seqs,), ctx, jnp.int32))
    for _ in range(3):
        _pool_holds_nan(((seqs, heads, hs), np.float16))
        out = cupaged.paged_attention(**args, partition=partition)
        got = np.asarray(out)
        assert not np.isnan(got).any(), f"{np.isnan(got).mean():.0%} of the output read unwritten"
        assert (got == 1).all(), np.unique(got)


def test_jax_takes_attention_and_merge_outputs_after_their_launches(rng, monkeypatch):
    """attention's out and lse and merge_state's outputs: a busy-wait of 100 ms queued
    ahead of each launch makes any JAX read that does not wait for the launch see NaN."""
    jax = _jax()
    jnp = jax.numpy
    from cupaged import launch, merge

    spin = Spin(SLEEP_US)
    real_run, real_merge = launch.Launch.run, merge.launch_merge

    def late_run(self, *a, **k):
        spin()
        return real_run(self, *a, **k)

    def late_merge(*a, **k):
        spin()
        return real_merge(*a, **k)

    monkeypatch.setattr(launch.Launch, "run", late_run)
    monkeypatch.setattr(merge, "launch_merge", late_merge)
    p = make_problem(rng, lens=(1, 17, 40, 33), heads=8, kv_heads=2, head_size=64)
    args = {k: jnp.asarray(v) for k, v in p.host_args().items() if v is not None}
    shape = (4, 8, 64)
    _pool_holds_nan((shape, np.float16), (shape[:2], np.float32))
    out, lse = cupaged.attention(args["query"], args["key_cache"], args["value_cache"],
                                 args["block_tables"], args["context_lens"], kv_layout="vllm",
                                 return_lse=True)
    got, got_lse = np.asarray(out), np.asarray(lse)
    assert_close(got.astype(np.float64), p.reference(), _tol(np.float16))
    assert np.isfinite(got_lse).all()
    _pool_holds_nan((shape, np.float16), (shape[:2], np.float32))
    merged, mlse = cupaged.merge_state(out, lse, out, lse)
    got, got_mlse = np.asarray(merged), np.asarray(mlse)
    assert_close(got.astype(np.float64), p.reference(), _tol(np.float16))
    np.testing.assert_allclose(got_mlse, got_lse + np.log(2.0), rtol=1e-5, atol=1e-5)


def _jax_reuses_freed_buffers(jnp, shapes_dtypes, copies: int = 4):
    """New JAX arrays of these shapes, NaN (or -1 for integers), ready: JAX hands them the
    buffers of arrays it freed just before, as its allocator reuses them."""
    made = []
    for shape, dtype in shapes_dtypes:
        fill = np.nan if np.issubdtype(dtype, np.floating) else -1
        made += [jnp.full(shape, fill, dtype) for _ in range(copies)]
    for a in made:
        a.block_until_ready()
    return made


class _JaxWrite:
    """reshape_and_cache of JAX temporaries (6 tokens' keys, values and slots) into CuPy
    caches of 4 blocks of 16, compiled and loaded on construction, the caches then
    zeroed; ``check`` asserts the written slots hold the keys and values and no other
    slot was touched."""

    def __init__(self, jnp, rng, n=6, kvh=2, hs=64, bs=16):
        self.jnp, self.shape = jnp, (n, kvh, hs)
        self.k = testing.random_normal((n, kvh, hs), np.float16, rng)
        self.v = testing.random_normal((n, kvh, hs), np.float16, rng)
        self.slots = rng.permutation(4 * bs)[:n].astype(np.int32)
        self.kc = cupy.zeros((4, bs, kvh, hs), np.float16)
        self.vc = cupy.zeros((4, bs, kvh, hs), np.float16)
        self()
        self.kc[...] = 0
        self.vc[...] = 0
        cupy.cuda.get_current_stream().synchronize()

    def __call__(self):
        jnp = self.jnp
        cupaged.reshape_and_cache(jnp.asarray(self.k), jnp.asarray(self.v), self.kc, self.vc,
                                  jnp.asarray(self.slots), kv_layout="NHD")

    def freed(self):
        return [(self.k.shape, self.k.dtype), (self.slots.shape, self.slots.dtype)]

    def check(self):
        _, kvh, hs = self.shape
        got_k = cupy.asnumpy(self.kc).reshape(-1, kvh, hs)
        got_v = cupy.asnumpy(self.vc).reshape(-1, kvh, hs)
        np.testing.assert_array_equal(got_k[self.slots], self.k)
        np.testing.assert_array_equal(got_v[self.slots], self.v)
        untouched = np.setdiff1d(np.arange(len(got_k)), self.slots)
        assert not got_k[untouched].any() and not got_v[untouched].any()


def test_jax_inputs_dropped_after_the_call_are_read_as_they_were(rng):
    """JAX temporaries passed straight to a call are freed when it returns, while its
    kernels wait behind 100 ms of queued work: JAX must not hand their memory to new
    arrays (NaN here) before the kernels have read them. attention reads its inputs;
    reshape_and_cache reads its keys, values and slots into a CuPy cache."""
    jax = _jax()
    jnp = jax.numpy
    spin = Spin(SLEEP_US)
    p = make_problem(rng, lens=(1, 17, 40, 33), heads=8, kv_heads=2, head_size=64)
    host = {k: v for k, v in p.host_args().items() if v is not None}
    names = ("query", "key_cache", "value_cache", "block_tables", "context_lens")

    def call():
        return cupaged.attention(*(jnp.asarray(host[n]) for n in names), kv_layout="vllm")

    call()  # compiled and loaded first
    cupy.cuda.get_current_stream().synchronize()
    spin()  # the launch stream (CuPy's current, for JAX callers) is busy for 100 ms
    out = call()
    refill = _jax_reuses_freed_buffers(jnp, [(host[n].shape, host[n].dtype) for n in names])
    assert_close(np.asarray(out).astype(np.float64), p.reference(), _tol(np.float16))
    del refill

    write = _JaxWrite(jnp, rng)
    spin()
    write()
    refill = _jax_reuses_freed_buffers(jnp, write.freed())
    write.check()
    del refill


def test_jax_inputs_of_a_thread_that_ends_are_held_past_it(rng):
    """A worker thread writes JAX temporaries into a CuPy cache behind 100 ms of queued
    work and ends before the write runs; JAX's freed buffers are then filled with -1 and
    NaN. The write must still read the keys, values and slots it was given."""
    jax = _jax()
    jnp = jax.numpy
    write = _JaxWrite(jnp, rng)
    Spin(SLEEP_US)()  # on the null stream, which the thread's calls use too
    worker = threading.Thread(target=write)
    worker.start()
    worker.join()
    refill = _jax_reuses_freed_buffers(jnp, write.freed())
    write.check()
    del refill


class _LateProducer:
    """A DLPack producer that, asked for its array, orders its last write before the
    consumer's stream as the protocol says: 100 ms of work on that stream, then the write
    (``fresh`` over ``array``), so a reader not ordered after that stream sees the old
    values."""

    def __init__(self, array, fresh):
        self.array, self.fresh = array, fresh

    def __dlpack__(self, stream=None, **kw):
        s = cupy.cuda.Stream.null if stream in (None, 1) else cupy.cuda.ExternalStream(stream)
        with s:
            Spin(SLEEP_US)()
            self.array[...] = self.fresh
        return self.array.__dlpack__(stream=stream, **kw)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_a_producers_write_precedes_a_call_on_another_stream(rng):
    """A query from a producer that writes it on CuPy's current stream (the stream
    cupy.from_dlpack names): a call on another stream (stream=) waits for that write,
    and returns without synchronizing."""
    p, new_q = _two_problems(rng)
    args = p.device_args()
    cupaged.paged_attention(**args)  # kernels loaded beforehand
    cupy.cuda.get_current_stream().synchronize()
    query = cupy.asarray(p.query)
    side = cupy.cuda.Stream(non_blocking=True)
    args["query"] = _LateProducer(query, cupy.asarray(new_q))
    out = cupaged.paged_attention(**args, stream=side)
    busy = not side.done
    side.synchronize()
    assert busy, "cupaged synchronized the stream"
    p.query = new_q
    assert_close(cupy.asnumpy(out).astype(np.float64), p.reference(), _tol(np.float16))


class _Foreign:
    """A CUDA array from a producer cupaged knows nothing of (neither CuPy nor torch): it
    comes in through DLPack and is held past the call, as a JAX array is."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kw):
        return self.array.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


@pytest.mark.gpu
def test_a_callers_stream_may_go_as_soon_as_the_call_returns(rng):
    """Calls given imported arrays and a stream of their own (stream=) that return a CuPy
    array or nothing: the events that hold the imports are recorded on that stream before
    each call returns, since the caller may destroy the stream then. An event recorded
    later, at the thread's next import, hit a destroyed stream and crashed the process."""
    from cupaged import _arrays

    p, _ = _two_problems(rng)
    args = p.device_args()
    n, kvh, hs = 5, 2, 64
    kc, vc = (cupy.zeros((4, 16, kvh, hs), np.float16) for _ in range(2))
    key, val = (cupy.asarray(testing.random_normal((n, kvh, hs), np.float16, rng))
                for _ in range(2))
    slots = cupy.asarray(rng.permutation(64)[:n].astype(np.int32))
    o = [cupy.asarray(testing.random_normal((4, 8, 64), np.float16, rng)) for _ in range(2)]
    lse = [cupy.asarray(rng.standard_normal((4, 8)).astype(np.float32)) for _ in range(2)]
    calls = {
        "paged_attention": lambda s: cupaged.paged_attention(
            **dict(args, query=_Foreign(args["query"])), stream=s),
        "reshape_and_cache": lambda s: cupaged.reshape_and_cache(
            _Foreign(key), _Foreign(val), kc, vc, _Foreign(slots), kv_layout="NHD", stream=s),
        "merge_state": lambda s: cupaged.merge_state(
            _Foreign(o[0]), _Foreign(lse[0]), _Foreign(o[1]), _Foreign(lse[1]), stream=s),
    }
    want = cupy.asnumpy(cupaged.paged_attention(**args))
    for name, call in calls.items():
        side = cupy.cuda.Stream(non_blocking=True)
        call(side)
        assert not _arrays.HOLDS.stamped, name  # recorded, nothing left for later
        side.synchronize()
        del side
    out = cupaged.paged_attention(**dict(args, query=_Foreign(args["query"])))
    np.testing.assert_array_equal(cupy.asnumpy(out), want)
    np.testing.assert_array_equal(cupy.asnumpy(kc).reshape(-1, kvh, hs)[cupy.asnumpy(slots)],
                                  cupy.asnumpy(key))


@pytest.mark.parametrize("how", ["jax-out", "torch-current", "debug"])
def test_held_imports_are_recorded_before_each_kind_of_call_returns(rng, monkeypatch, how):
    """Imported inputs on a stream the caller then destroys, three more ways: JAX arrays
    in and out with stream= (the outputs handed over after the launches); torch's current
    stream inside a ``with torch.cuda.stream(s)`` block (no stream=); CUPAGED_DEBUG, whose
    checks read the tables before the launches. Nothing is left to record after the call,
    the results are right, and the stream may go."""
    from cupaged import _arrays, _checks

    p, _ = _two_problems(rng)
    want = p.reference()
    if how == "jax-out":
        jnp = _jax().numpy
        args = {k: jnp.asarray(v) for k, v in p.host_args().items() if v is not None}
        side = cupy.cuda.Stream(non_blocking=True)
        out = cupaged.paged_attention(**args, stream=side)
        assert not _arrays.HOLDS.stamped
        got = np.asarray(out)  # JAX waits for the launch stream it was handed over on
        side.synchronize()
        del side
    elif how == "torch-current":
        torch = _torch()
        args = torch_args(p)  # a torch query: the call runs on torch's current stream
        args["block_tables"] = _Foreign(cupy.asarray(p.block_tables))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = cupaged.paged_attention(**args)
        assert not _arrays.HOLDS.stamped
        side.synchronize()
        del side
        got = to_numpy(out)
    else:
        monkeypatch.setattr(_checks, "DEBUG", True)
        args = {k: _Foreign(v) for k, v in p.device_args().items() if v is not None}
        side = cupy.cuda.Stream(non_blocking=True)
        out = cupaged.paged_attention(**args, stream=side)
        assert not _arrays.HOLDS.stamped and not _arrays.HOLDS.pending
        side.synchronize()
        del side
        got = cupy.asnumpy(out)
    assert_close(got.astype(np.float64), want, _tol(np.float16))
    again = cupaged.paged_attention(**p.device_args())  # the thread's next call
    assert_close(cupy.asnumpy(again).astype(np.float64), want, _tol(np.float16))


def test_a_captured_call_with_imported_inputs_holds_nothing_past_it(rng):
    """A call with imported inputs captured into a CUDA graph: no event is recorded in the
    capture (one could never be queried, and every import held behind it would stay held
    for good); the graph replays right, and after the capture held imports still go."""
    from cupaged import _arrays

    p, _ = _two_problems(rng)
    args = p.device_args()
    out = cupy.empty_like(args["query"])
    cupaged.paged_attention(**args, out=out, partition="never")  # loaded beforehand
    cupy.cuda.get_current_stream().synchronize()
    _arrays.release_completed()
    held_before = len(_arrays._DEFERRED)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        cupaged.paged_attention(**dict(args, query=_Foreign(args["query"])), out=out,
                                partition="never", stream=stream)
        graph = stream.end_capture()
    assert not _arrays.HOLDS.stamped and len(_arrays._DEFERRED) == held_before
    out[...] = cupy.nan
    graph.launch(stream)
    stream.synchronize()
    assert_close(cupy.asnumpy(out).astype(np.float64), p.reference(), _tol(np.float16))
    cupaged.paged_attention(**dict(args, query=_Foreign(args["query"])))  # held, eagerly
    cupy.cuda.Device().synchronize()
    assert _arrays.release_completed() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: _dtypes.lookup(d).name)
def test_cache_ops_with_torch_match_cupy(rng, dtype):
    torch = _torch()
    kv, hs, bs, nb = 2, 64, 16, 12
    kc, vc = testing.random_cache(nb, kv, hs, bs, dtype, rng)
    key = testing.random_normal((5, kv, hs), dtype, rng)
    val = testing.random_normal((5, kv, hs), dtype, rng)
    slots = np.array([3, 17, -1, 40, 191], np.int64)
    # reshape_and_cache
    c_kc, c_vc = cupy.asarray(kc), cupy.asarray(vc)
    cupaged.reshape_and_cache(cupy.asarray(key), cupy.asarray(val), c_kc, c_vc, cupy.asarray(slots))
    t_kc, t_vc = to_torch(kc), to_torch(vc)
    cupaged.reshape_and_cache(to_torch(key), to_torch(val), t_kc, t_vc, to_torch(slots))
    np.testing.assert_array_equal(to_numpy(t_kc), cupy.asnumpy(c_kc).astype(np.float32))
    np.testing.assert_array_equal(to_numpy(t_vc), cupy.asnumpy(c_vc).astype(np.float32))
    # copy_blocks, two layers
    pairs = np.array([[0, 5], [7, 2]], np.int32)
    t_layers = [to_torch(kc), to_torch(kc)], [to_torch(vc), to_torch(vc)]
    cupaged.copy_blocks(*t_layers, to_torch(pairs))
    for layer in (*t_layers[0], *t_layers[1]):
        host = to_numpy(layer)
        np.testing.assert_array_equal(host[5], host[0])
        np.testing.assert_array_equal(host[2], host[7])
    # swap_blocks through a pinned torch host tensor, both directions
    dev = to_torch(vc)
    host = torch.zeros(dev.shape, dtype=dev.dtype, pin_memory=True)
    cupaged.swap_blocks(dev, host, [[1, 4], [9, 0]])
    torch.cuda.synchronize()
    np.testing.assert_array_equal(host[4].float().numpy(), to_numpy(dev[1]))
    np.testing.assert_array_equal(host[0].float().numpy(), to_numpy(dev[9]))
    back = torch.zeros_like(dev)
    cupaged.swap_blocks(host, back, torch.tensor([[4, 11]], dtype=torch.int64))
    np.testing.assert_array_equal(to_numpy(back[11]), to_numpy(dev[1]))


def test_paged_kv_cache_torch(rng):
    """PagedKVCache(framework="torch"): torch caches and step arrays, a short decode loop
    checked against the reference over each sequence's history."""
    torch = _torch()
    cache = cupaged.PagedKVCache(1, 64, 2, 64, 16, "bfloat16", framework="torch")
    assert isinstance(cache.key_caches[0], torch.Tensor)
    assert cache.key_caches[0].dtype == torch.bfloat16
    bf16 = _dtypes.BF16.numpy
    hist_k, hist_v = {}, {}
    prompt = {"a": 20, "b": 5}
    for sid, n in prompt.items():
        slots = cache.add(sid, n)
        assert isinstance(slots, torch.Tensor) and slots.dtype == torch.int32
        k = testing.random_normal((n, 2, 64), bf16, rng)
        v = testing.random_normal((n, 2, 64), bf16, rng)
        cupaged.reshape_and_cache(to_torch(k), to_torch(v), cache.key_caches[0],
                                  cache.value_caches[0], slots)
        hist_k[sid], hist_v[sid] = [k], [v]
    cache.fork("a", "c")
    hist_k["c"], hist_v["c"] = list(hist_k["a"]), list(hist_v["a"])
    seqs = ["a", "b", "c"]
    for _ in range(3):
        step = cache.step(seqs)
        assert all(isinstance(x, torch.Tensor) for x in step)
        k = testing.random_normal((3, 2, 64), bf16, rng)
        v = testing.random_normal((3, 2, 64), bf16, rng)
        q = testing.random_normal((3, 4, 64), bf16, rng)
        cupaged.reshape_and_cache(to_torch(k), to_torch(v), cache.key_caches[0],
                                  cache.value_caches[0], step.slot_mapping)
        out = cupaged.paged_attention(to_torch(q), cache.key_caches[0], cache.value_caches[0],
                                      step.block_tables, step.context_lens)
        for i, sid in enumerate(seqs):
            hist_k[sid].append(k[i:i + 1])
            hist_v[sid].append(v[i:i + 1])
            ref = reference.attend(q[i].astype(np.float64),
                                   np.concatenate(hist_k[sid]).astype(np.float64),
                                   np.concatenate(hist_v[sid]).astype(np.float64),
                                   1 / 8.0)
            assert_close(to_numpy(out[i]), ref, _tol(bf16))


# ---- streams ----------------------------------------------------------------------------------


def _two_problems(rng):
    p = make_problem(rng, dtype=np.float16, lens=(70, 3, 200), heads=8, kv_heads=2,
                     head_size=64, block_size=16)
    return p, testing.random_normal(p.query.shape, np.float16, rng)


@pytest.mark.parametrize("how", ["current", "explicit"])
def test_torch_side_stream_ordering(rng, how):
    """Work the caller queued on a busy side stream (a long sleep, then new query values)
    is seen by cupaged, and cupaged returns while the stream is still busy (no sync)."""
    torch = _torch()
    p, new_q = _two_problems(rng)
    args = torch_args(p)
    fresh = to_torch(new_q)
    # compiled and loaded first: a cold kernel cache's compile under a loaded machine can
    # outlast the sleep, and the check below would blame cupaged for the time it took
    cupaged.paged_attention(**args, partition="always")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(SLEEP_US * 2e3))  # cycles: about SLEEP_US at 2 GHz
        args["query"].copy_(fresh)
        out = torch.empty_like(args["query"])
    if how == "current":
        with torch.cuda.stream(side):
            cupaged.paged_attention(**args, out=out, partition="always")
    else:
        cupaged.paged_attention(**args, out=out, partition="always", stream=side)
    busy = not side.query()
    side.synchronize()
    assert busy, "cupaged synchronized the stream"
    p.query = new_q
    assert_close(to_numpy(out), p.reference(), _tol(np.float16))


@pytest.mark.parametrize("how", ["current", "explicit"])
def test_cupy_side_stream_ordering(rng, how):
    p, new_q = _two_problems(rng)
    args = p.device_args()
    fresh = cupy.asarray(new_q)  # inputs made before the stream is busy: a copy from
    zeros = cupy.zeros((1, 2, 64), np.float16)  # pageable memory would sync it
    slot = cupy.asarray([int(p.block_tables[1, 0]) * 16 + 2], np.int32)  # seq 1's last token
    cupaged.paged_attention(**args, partition="always")  # kernels loaded beforehand
    cupaged.reshape_and_cache(zeros, zeros, cupy.empty_like(args["key_cache"]),
                              cupy.empty_like(args["value_cache"]), slot)
    side = cupy.cuda.Stream(non_blocking=True)
    spin = Spin(SLEEP_US)
    cupy.cuda.Device().synchronize()
    with side:
        spin()
        args["query"][...] = fresh
    if how == "current":
        with side:
            out = cupaged.paged_attention(**args, partition="always")
            # reshape_and_cache too: overwrite sequence 1's last token's V with zeros
            cupaged.reshape_and_cache(zeros, zeros, args["key_cache"], args["value_cache"], slot)
    else:
        out = cupaged.paged_attention(**args, partition="always", stream=side)
    busy = not side.done
    side.synchronize()
    assert busy, "cupaged synchronized the stream"
    p.query = new_q
    assert_close(cupy.asnumpy(out).astype(np.float64), p.reference(), _tol(np.float16))
    if how == "current":  # the cache write ran after the attention, in stream order
        assert float(abs(args["value_cache"][int(p.block_tables[1, 0]), :, :, 2]).max()) == 0


# ---- CUDA graphs ------------------------------------------------------------------------------


class _DecodeState:
    """A few layers of paged caches and one decode step's inputs, on the host, updated
    between captures and replays; ``device(xp)`` mirrors it in CuPy or torch arrays."""

    def __init__(self, rng, dtype, layers=3, lens=(5, 40, 1, 130), heads=8, kv_heads=2,
                 hs=64, bs=16, grow=4):
        self.rng, self.dtype, self.layers, self.bs = rng, dtype, layers, bs
        self.lens = np.asarray(lens, np.int32)
        self.bt, self.nb = testing.random_block_tables(self.lens + grow, bs, rng)
        self.kc, self.vc = zip(*(testing.random_cache(self.nb, kv_heads, hs, bs, dtype, rng)
                                 for _ in range(layers)))
        self.kc, self.vc = list(self.kc), list(self.vc)
        self.shape_q = (len(lens), heads, hs)
        self.shape_kv = (len(lens), kv_heads, hs)
        self.new_token()

    def new_token(self):
        """Next step's query, K/V and slots; the context grows by one."""
        rn = lambda s: testing.random_normal(s, self.dtype, self.rng)  # noqa: E731
        self.q = [rn(self.shape_q) for _ in range(self.layers)]
        self.k = [rn(self.shape_kv) for _ in range(self.layers)]
        self.v = [rn(self.shape_kv) for _ in range(self.layers)]
        pos = self.lens
        self.slots = (self.bt[np.arange(len(pos)), pos // self.bs] * self.bs + pos % self.bs
                      ).astype(np.int32)
        self.lens = self.lens + 1

    def remap_blocks(self):
        """Move every block elsewhere (block tables change in place, data moves with them)."""
        perm = self.rng.permutation(self.nb)
        used = (self.bt >= 0) & (self.bt < self.nb)
        self.bt = np.where(used, perm[np.clip(self.bt, 0, self.nb - 1)], self.bt).astype(np.int32)
        inv = np.argsort(perm)
        for layer in range(self.layers):
            self.kc[layer] = self.kc[layer][inv]
            self.vc[layer] = self.vc[layer][inv]

    def reference(self, layer):
        kc, vc = self.kc[layer].copy(), self.vc[layer].copy()
        x = kc.shape[-1]
        for i, s in enumerate(self.slots):  # the step writes the new token first
            b, o = divmod(int(s), self.bs)
            kc[b, :, :, o, :] = self.k[layer][i].reshape(kc.shape[1], kc.shape[2], x)
            vc[b, :, :, o] = self.v[layer][i]
        return reference.paged_attention(self.q[layer], kc, vc, self.bt, self.lens)


def _run_graph_case(state, arrays, capture, replay, partition, assign, to_host):
    """Capture one decode step (every layer: reshape_and_cache + paged_attention) with
    ``capture``, update all inputs in place (new token, longer contexts, moved blocks),
    replay, and compare with the reference and with the same step run eagerly."""
    ws = cupaged.DecodeWorkspace(len(state.lens), state.shape_q[1], state.shape_q[2])
    a = arrays
    max_ctx = int(state.bt.shape[1] * state.bs)

    def step():
        for layer in range(state.layers):
            cupaged.reshape_and_cache(a["k"][layer], a["v"][layer], a["kc"][layer],
                                      a["vc"][layer], a["slots"])
            cupaged.paged_attention(a["q"][layer], a["kc"][layer], a["vc"][layer], a["bt"],
                                    a["lens"], out=a["out"][layer], workspace=ws,
                                    partition=partition, max_context_len=max_ctx)

    graph = capture(step)
    for _ in range(2):  # replays see in-place updates of every input
        state.new_token()
        state.remap_blocks()
        for layer in range(state.layers):
            for name in ("q", "k", "v", "kc", "vc"):
                assign(a[name][layer], getattr(state, name)[layer])
        for name, v in (("slots", state.slots), ("bt", state.bt), ("lens", state.lens)):
            assign(a[name], v)
        replay(graph)
        got = [to_host(o) for o in a["out"]]
        for layer in range(state.layers):
            assert_close(got[layer], state.reference(layer), _tol(state.dtype))
        step()  # eager: the same kernels, partitions and inputs give the same bits
        for layer in range(state.layers):
            np.testing.assert_array_equal(to_host(a["out"][layer]), got[layer])


@pytest.mark.parametrize("dtype", [np.float16, _dtypes.BF16.numpy], ids=["f16", "bf16"])
@pytest.mark.parametrize("partition", ["auto", "always"])
def test_torch_cuda_graph_decode_step(rng, dtype, partition):
    torch = _torch()
    state = _DecodeState(rng, dtype)
    t = lambda v: to_torch(v)  # noqa: E731
    arrays = {n: [t(x) for x in getattr(state, n)] for n in ("q", "k", "v", "kc", "vc")}
    arrays.update(slots=t(state.slots), bt=t(state.bt), lens=t(state.lens),
                  out=[torch.empty_like(q) for q in arrays["q"]])

    def capture(step):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up: kernels compiled and loaded before capture
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        return g

    def replay(g):
        g.replay()
        torch.cuda.synchronize()

    _run_graph_case(state, arrays, capture, replay, partition,
                    lambda dst, v: dst.copy_(to_torch(v)), to_numpy)


@pytest.mark.parametrize("partition", ["auto", "always"])
def test_cupy_graph_decode_step(rng, partition):
    state = _DecodeState(rng, np.float16)
    arrays = {n: [cupy.asarray(x) for x in getattr(state, n)] for n in ("q", "k", "v", "kc", "vc")}
    arrays.update(slots=cupy.asarray(state.slots), bt=cupy.asarray(state.bt),
                  lens=cupy.asarray(state.lens), out=[cupy.empty_like(q) for q in arrays["q"]])
    stream = cupy.cuda.Stream(non_blocking=True)

    def capture(step):
        with stream:
            step()
            stream.begin_capture()
            step()
            return stream.end_capture()

    def replay(g):
        g.launch(stream)
        stream.synchronize()

    def assign(dst, v):
        # on the replay's stream: a non-blocking stream is not ordered after the null
        # stream's copies, whose DMA can still be in flight when set() returns
        dst.set(np.ascontiguousarray(v).astype(dst.dtype), stream=stream)

    _run_graph_case(state, arrays, capture, replay, partition, assign,
                    lambda o: cupy.asnumpy(o).astype(np.float64))


def test_workspace_capacity(rng):
    p = make_problem(rng, dtype=np.float16, lens=(300, 1000), heads=4, kv_heads=2, head_size=64)
    args = p.device_args()
    small = cupaged.DecodeWorkspace(2, 4, 64, rows=2 * 4 * 3)  # three partitions per head
    out = cupaged.paged_attention(**args, workspace=small, partition="always")
    assert_close(cupy.asnumpy(out).astype(np.float64), p.reference(), _tol(np.float16))
    with pytest.raises(ValueError, match="the workspace holds 3 partitions per head"):
        cupaged.paged_attention(**args, workspace=small, partition=64)
    with pytest.raises(ValueError, match="the workspace was made for head_size 32"):
        cupaged.paged_attention(**args, workspace=cupaged.DecodeWorkspace(2, 4, 32))
    with pytest.raises(TypeError, match="workspace must be a cupaged.DecodeWorkspace"):
        cupaged.paged_attention(**args, workspace=cupy.empty(100, np.float32))


# ---- several GPUs -----------------------------------------------------------------------------


def test_arrays_on_device_1(rng):
    _two_gpus()
    p = make_problem(rng, dtype=np.float16, lens=(50, 7), heads=8, kv_heads=2, head_size=64)
    with cupy.cuda.Device(1):
        args = p.device_args()
    with cupy.cuda.Device(0):
        out = cupaged.paged_attention(**args, partition="always")
        assert cupy.cuda.runtime.getDevice() == 0  # the caller's device is restored
    assert out.device.id == 1
    assert_close(cupy.asnumpy(out).astype(np.float64), p.reference(), _tol(np.float16))
    k0 = planning.decode_kernels(0, "f16", 64, 16, 4)
    k1 = planning.decode_kernels(1, "f16", 64, 16, 4)
    assert k0 is not k1 and k0.decode.ptr != k1.decode.ptr
    with pytest.raises(ValueError, match="the workspace is on device 0 but query is on device 1"):
        cupaged.paged_attention(**args, workspace=cupaged.DecodeWorkspace(2, 8, 64, device=0))


def test_torch_stream_of_device_1(rng):
    """Tensors on device 1 run on torch's current stream for device 1, whatever device
    is current."""
    _two_gpus()
    torch = _torch()
    p, new_q = _two_problems(rng)
    args = {k: (None if v is None else to_torch(v, "cuda:1")) for k, v in p.host_args().items()}
    cupaged.paged_attention(**args)  # device 1's kernels loaded before the timed part
    fresh = to_torch(new_q, "cuda:1")  # (a copy from pageable memory syncs its stream)
    side = torch.cuda.Stream(device=1)
    with torch.cuda.device(1):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(SLEEP_US * 2e3))
            args["query"].copy_(fresh)
    with torch.cuda.device(0), torch.cuda.stream(side):  # stream(side) sets device 1's current
        out = cupaged.paged_attention(**args)
    busy = not side.query()
    side.synchronize()
    assert busy and out.device == torch.device("cuda", 1)
    p.query = new_q
    assert_close(to_numpy(out), p.reference(), _tol(np.float16))


def test_tensor_parallel_heads_across_gpus(rng):
    """Heads split over the GPUs, one thread per GPU, match one GPU doing all heads."""
    _two_gpus()
    n = min(cupy.cuda.runtime.getDeviceCount(), 4)
    kv = 2 * n
    p = make_problem(rng, dtype=np.float16, lens=(300, 17, 1, 900), heads=4 * kv, kv_heads=kv,
                     head_size=128, block_size=16)
    whole = cupaged.paged_attention(**p.device_args())
    parts = [None] * n

    def worker(i):
        with cupy.cuda.Device(i):
            h = slice(i * kv // n, (i + 1) * kv // n)
            qh = slice(h.start * 4, h.stop * 4)
            args = p.device_args()
            args["query"] = args["query"][:, qh]
            args["key_cache"] = cupy.ascontiguousarray(args["key_cache"][:, h])
            args["value_cache"] = cupy.ascontiguousarray(args["value_cache"][:, h])
            parts[i] = cupy.asnumpy(cupaged.paged_attention(**args))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tp = np.concatenate(parts, axis=1).astype(np.float64)
    ref = p.reference()
    assert_close(tp, ref, _tol(np.float16))
    assert_close(tp, cupy.asnumpy(whole).astype(np.float64), _tol(np.float16))
