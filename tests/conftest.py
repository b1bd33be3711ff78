"""Shared fixtures: fresh random data per test (its seed is printed on failure), random
paged problems on host and device, and skipping of GPU tests where there is no GPU."""

from __future__ import annotations

import builtins
import contextlib
import os
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from cupaged import testing


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAVE_GPU = _gpu_available()

# JAX takes 75% of the GPU's memory when it first touches it unless told otherwise; the
# suite runs in parallel processes on one GPU, and a worker that imports JAX would leave
# the others out of memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if HAVE_GPU and os.environ.get("CUPAGED_TEST_NO_POOL"):
    # Under compute-sanitizer's memcheck (tools/device.sh sanitize): each array its own
    # cudaMalloc, so an overrun past an array's end leaves its allocation and is reported,
    # not hidden inside a pool chunk. (torch: PYTORCH_NO_CUDA_MEMORY_CACHING=1.)
    import cupy

    cupy.cuda.set_allocator(None)


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_SUMMARY: list = []


@pytest.fixture
def compile_summary():
    """Lines a test wants in the run's closing summary (the compile check's count and time)."""
    return _SUMMARY


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY:
        terminalreporter.write_line(line)


def on_cuda(t):
    """A CPU torch tensor as one that says it is on CUDA device 0 (is_cuda, get_device):
    what the library reads of a device tensor, for host-side tests with the stub driver."""
    import torch

    global _OnCuda
    if _OnCuda is None:
        class _OnCuda(torch.Tensor):
            @property
            def is_cuda(self):
                return True

            def get_device(self):
                return 0
    return t.as_subclass(_OnCuda)


_OnCuda = None


# ---- the stubbed driver (cupaged.bench.stub): host paths compared launch for launch ------------


@pytest.fixture
def stub():
    """The device's calls stood in for while the test runs (cupaged.bench.stub), launches
    and memsets recorded."""
    from cupaged.bench.stub import stubbed_driver

    with stubbed_driver(record=True) as s:
        yield s


@pytest.fixture
def generic_runs(monkeypatch):
    """How many calls went through the generic path (_prepared.run) so far."""
    from cupaged import _prepared

    count = [0]
    real = _prepared.run

    def counting(*a, **k):
        count[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(_prepared, "run", counting)
    return count


def outcome(stub, fn, at=0x7E00_0000_0000):
    """What a call did: ("launched", the returned arrays, the launches and memsets) or
    (the error's type, its message). Allocations start at ``at``, so that two calls that
    allocate alike (a scratch, an output) get the same addresses."""
    del stub.launches[:]
    stub.next_address = at
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - the kind of failure is what is compared
        return type(e).__name__, str(e)
    returned = tuple(id(x) for x in r) if isinstance(r, tuple) else (id(r),)
    return "launched", returned, list(stub.launches)


@pytest.fixture
def prefill_split():
    """Set paged_prefill's split-KV partition in tokens (0: never) instead of the cost
    model's choice, for the rest of the test."""
    from cupaged import planning

    yield planning.set_prefill_split
    planning.set_prefill_split(None)


@pytest.fixture
def flat_split(monkeypatch):
    """Have "auto" take decode's flat split wherever it can run (decode without
    query_start_loc), whatever the units and the context, for the rest of the test."""
    from cupaged import _prepared, planning

    monkeypatch.setattr(planning, "flat_pays", lambda *a: True)
    monkeypatch.setattr(planning, "flat_keeps_residency", lambda *a: True)
    _prepared.clear()  # calls remembered with the grid split's plan
    yield
    _prepared.clear()


@pytest.fixture
def device_arch(monkeypatch):
    """Have the planner see a device of the given target (``"sm_80"``, ``"sm_90"``) with an
    H100's multiprocessors and shared memory (or ``max_smem`` bytes a block), so its rules
    run on the CPU."""
    from cupaged import planning

    def set_arch(arch: str, max_smem: int = 232448):
        dev = planning.DeviceInfo(0, arch, 132, max_smem, 233472)
        monkeypatch.setattr(planning, "device_info", lambda device_id: dev)

    set_arch("sm_80")
    return set_arch


@pytest.fixture
def mla_planned(monkeypatch, device_arch):
    """``mla_planned(arch)``: plan_mla on a device of ``arch`` records what it builds in the
    list returned, the mma.sync kernel's spec, or "sm90" for the wgmma one ("sm90x": its
    second-cache variant); nothing is compiled or loaded."""
    from cupaged import jit, planning
    from cupaged.specs import geometry

    def on(arch: str) -> list:
        device_arch(arch)
        built = []

        def mma(device, dtype, cache_dtype, rank, rope, block_size, tile, sparse=False,
                variant=""):
            spec = jit.KernelSpec("mla_sparse_attention" if sparse else "mla_attention",
                                  dtype, rank, block_size, rope_dim=rope, rows=tile[0],
                                  tile_tokens=tile[1], stages=tile[2],
                                  cache_dtype=cache_dtype, variant=variant, arch=arch)
            built.append(spec)
            return planning.MlaKernel(None, spec, geometry.MlaGeometry.of(spec).smem_bytes,
                                      132)

        def sm90(device, dtype, cache_dtype, rank, rope, block_size, sparse=False,
                 variant=""):
            built.append("sm90" + variant)
            spec = jit.KernelSpec("mla_sparse_attention_sm90" if sparse else "mla_attention_sm90",
                                  dtype, rank, block_size, rope_dim=rope,
                                  cache_dtype=cache_dtype, variant=variant, arch=arch)
            return planning.MlaKernel(None, spec, 0, 132)

        monkeypatch.setattr(planning, "mla_kernel", mma)
        monkeypatch.setattr(planning, "mla_sm90_kernel", sm90)
        return built

    return on


@pytest.fixture
def no_flashinfer(monkeypatch):
    """``import flashinfer`` fails as it does where FlashInfer is not installed."""
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "flashinfer" or name.startswith("flashinfer."):
            raise ModuleNotFoundError("No module named 'flashinfer'", name="flashinfer")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)


# CUPAGED_TEST_TIMES=PREFIX: each test's start and finish ("S|F <time> <node id>") appended
# to PREFIX.<xdist worker>, so a run cut short still shows what ran longest and what had
# not finished (tools/device.sh suite summarizes them).
_TIMES = os.environ.get("CUPAGED_TEST_TIMES")
_times_file = None


def _time_mark(kind: str, nodeid: str) -> None:
    global _times_file
    if _times_file is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _times_file = open(f"{_TIMES}.{worker}", "a", buffering=1)
    _times_file.write(f"{kind} {time.time():.2f} {nodeid}\n")


if _TIMES:
    def pytest_runtest_logstart(nodeid, location):
        _time_mark("S", nodeid)

    def pytest_runtest_logfinish(nodeid, location):
        _time_mark("F", nodeid)


@pytest.fixture
def rng(request):
    """A generator with a fresh seed each run; the seed is reported if the test fails, and
    ``CUPAGED_TEST_SEED=<seed>`` replays it."""
    replay = os.environ.get("CUPAGED_TEST_SEED")
    seed = int(replay) if replay else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        for k, v in item.user_properties:
            if k == "seed":
                report.sections.append(("random seed", str(v)))


@dataclass
class Problem:
    """A random decode problem on the host (NumPy); ``.device()`` copies it to the GPU."""

    query: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    alibi_slopes: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    def host_args(self):
        return dict(query=self.query, key_cache=self.key_cache, value_cache=self.value_cache,
                    block_tables=self.block_tables, context_lens=self.context_lens,
                    alibi_slopes=self.alibi_slopes)

    def device_args(self):
        import cupy

        return {k: (None if v is None else cupy.asarray(v)) for k, v in self.host_args().items()}

    def reference(self, **kw):
        from cupaged import reference

        return reference.paged_attention(**self.host_args(), **kw)


def make_problem(rng, *, dtype=np.float16, lens=(5, 17), heads=4, kv_heads=2, head_size=64,
                 block_size=16, alibi=False, share=False, spare_blocks=3, extra_columns=0,
                 stale=float("nan")):
    """A random problem; cache slots no sequence uses hold ``stale`` (NaN by default, as a
    recycled block may: the kernels must never let them into the output)."""
    lens = np.asarray(lens, dtype=np.int32)
    bt, nb = testing.random_block_tables(lens, block_size, rng, spare_blocks=spare_blocks,
                                         share=share, extra_columns=extra_columns)
    kc, vc = testing.random_cache(nb, kv_heads, head_size, block_size, dtype, rng)
    if stale is not None:
        testing.poison_unused_slots(kc, vc, bt, lens, stale)
    q = testing.random_normal((len(lens), heads, head_size), dtype, rng)
    # ALiBi slopes are positive: the bias slope * (pos - len + 1) is <= 0 and grows with distance.
    slopes = rng.uniform(0.0, 0.5, heads).astype(np.float32) if alibi else None
    return Problem(q, kc, vc, bt, lens, slopes)


@pytest.fixture
def problem(rng):
    """Factory: ``problem(dtype=..., lens=..., heads=..., ...)`` -> Problem."""
    return lambda **kw: make_problem(rng, **kw)


def rel_err(got, ref) -> float:
    got = np.asarray(got, dtype=np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (den if den > 0 else 1.0))


def assert_close(got, ref, tol: float, what="", row_floor: float = 0.0) -> None:
    """``got`` matches ``ref`` (float64): ||got - ref|| / ||ref|| <= tol over the whole
    array, and every row (the last axis: one head's output vector) within
    ``testing.ROW_FACTOR * tol`` of its own norm, so one bad head among thousands of good
    ones cannot hide in the global norm. NaN fails both.

    ``row_floor``: a row is held to ``max(its norm, row_floor)`` instead: an absolute
    floor, the data's typical row norm, for rows so short (a head size of 1) that
    cancellation can bring one near zero while the kernel's rounding scales with its
    inputs."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.1e}"
    if got.size == 0:
        return
    den = np.maximum(np.linalg.norm(ref, axis=-1), row_floor)
    rows = np.linalg.norm(got - ref, axis=-1) / np.where(den > 0, den, 1.0)
    rows = np.where(np.isnan(rows), np.inf, rows)
    worst = np.unravel_index(int(np.argmax(rows)), rows.shape)
    assert rows[worst] <= testing.ROW_FACTOR * tol, (
        f"{what}: row {tuple(int(i) for i in worst)} is off by {rows[worst]:.2e} of its norm "
        f"(> {testing.ROW_FACTOR} x {tol:.1e}); whole array {err:.2e}")


def state_is_read_on_each_call(stub, generic_runs, monkeypatch, fast, generic) -> None:
    """What a fast run reads at each call, not when it was made: ``fast()`` and
    ``generic()`` make one call through its entry point and through the generic path
    alone. Another current stream is taken (every launch on it); another current device,
    CUPAGED_DEBUG and a DLPack import still to be held send the call to the generic path,
    which it then matches."""
    from cupaged import _arrays, _checks

    def same(declines=True, setup=lambda: None):
        setup()
        want = outcome(stub, generic)
        before = generic_runs[0]
        setup()
        got = outcome(stub, fast)
        assert got == want and got[0] == "launched"
        assert generic_runs[0] == before + declines
        return got

    with stub.Stream(0x999):  # another current stream: taken, and launched on
        assert {x[4] for x in same(declines=False)[2]} == {0x999}
    stub.device = 1  # another device current: the generic path switches to the arrays'
    got = same()
    stub.device = 0
    assert {x[5] for x in got[2]} == {0}  # launched with device 0 current
    monkeypatch.setattr(_checks, "DEBUG", True)  # its checks read the device
    want = outcome(stub, generic)
    assert outcome(stub, fast) == want
    monkeypatch.setattr(_checks, "DEBUG", False)
    # A DLPack import of this thread's, which the launch stream must order and hold
    same(setup=lambda: _arrays.HOLDS.pending.append(stub.fake((4,), np.float32)))
    assert not _arrays.HOLDS.pending and not _arrays.HOLDS.stamped
    same(declines=False)


@contextlib.contextmanager
def no_fast_runs():
    """While inside, attention() and mla_attention() neither take nor make a fast run: the
    generic path alone, to compare a fast run with."""
    from cupaged import _prepared

    saved = _prepared.fast_attention, _prepared.fast_mla, _prepared.use_fast
    _prepared.fast_attention, _prepared.fast_mla, _prepared.use_fast = {}, {}, lambda *x: None
    try:
        yield
    finally:
        _prepared.fast_attention, _prepared.fast_mla, _prepared.use_fast = saved
