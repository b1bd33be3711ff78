"""merge_state / merge_states: on the GPU against the float64 reference (any number of
partials, lists and stacked arrays, -inf and NaN rows, in place, strided views, CuPy and
torch, the two halves of a real attention); without a GPU, their input checks and launch
plans on array metadata alone, and the kernel's compile and launch signature."""

import contextlib
import inspect
import math

import cupy
import numpy as np
import pytest

import cupaged
from cupaged import _arrays, _dtypes, jit, merge, reference, testing
from cupaged.specs import catalog
from conftest import assert_close
from test_decode import poisoned
from test_validation import Fake

gpu = pytest.mark.gpu

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), _dtypes.BF16.numpy]
COUNTS = (1, 2, 3, 8, 9, 17)


def _ids(d):
    return np.dtype(d).name


def _tol(dtype):
    return testing.TOLERANCE[_dtypes.lookup(dtype).name]


# ---- the kernel: compile, signature ----------------------------------------------------------


def test_every_specialization_compiles_for_sm80_and_sm90():
    specs = [s for s in catalog.all_specs(["sm_80", "sm_90"]) if s.kernel == "merge_states"]
    assert sorted(s.name for s in specs) == sorted(
        f"merge_states_{d}_{a}" for d in ("f32", "f16", "bf16") for a in ("sm80", "sm90"))
    assert jit.compile_check(specs)[0] == 6
    assert "merge_states" in catalog.SMALL_KERNELS
    assert set(catalog.covering_specs(["sm_80", "sm_90"])) >= set(specs)


def test_launch_format_and_struct_match_the_kernel(monkeypatch):
    """ARG_FORMATS against the mangled symbol, and MergeInputs' size and capacity against
    what the host packs (NVRTC, no GPU)."""
    import test_jit

    monkeypatch.setitem(test_jit.STRUCT_FORMATS, "MergeInputs", f"{merge._INPUTS.size}s")
    check = (f"static_assert(sizeof(cupaged::MergeInputs) == {merge._INPUTS.size}, \"size\");\n"
             f"static_assert(cupaged::kMaxMergeStates == {merge._MAX_STATES}, \"count\");\n"
             f"static_assert(cupaged::kMergeThreads == {merge._THREADS}, \"threads\");\n")
    source = jit.source
    monkeypatch.setattr(jit, "source", lambda entry: source(entry) + check)
    spec = jit.KernelSpec("merge_states", "bf16")
    assert spec.name_expression == "cupaged::merge_states<cupaged::bfloat16_t>"
    _, lowered = jit._compile(spec.source_file, spec.arch, [spec.name_expression], spec.name)
    mangled = test_jit._mangled_params(lowered[spec.name_expression])
    assert mangled == jit.ARG_FORMATS["merge_states"]


def test_outputs_and_stream_are_keyword_only():
    for fn, positional in ((cupaged.merge_state, ["out_a", "lse_a", "out_b", "lse_b"]),
                           (cupaged.merge_states, ["outs", "lses"])):
        p = inspect.signature(fn).parameters
        assert list(p)[:len(positional)] == positional
        for name in ("out", "lse_out", "stream"):
            assert p[name].kind is inspect.Parameter.KEYWORD_ONLY and p[name].default is None


# ---- validation and launch plans on metadata (no GPU) ------------------------------------------


def _fakes(n, rows=3, heads=4, hs=64, dtype=np.float16, base=1 << 24):
    """n partials at distinct 16-byte aligned addresses: (outs, lses) as Fakes."""
    out = np.zeros((rows, heads, hs), dtype)
    lse = np.zeros((rows, heads), np.float32)
    step = 1 << 20
    return ([Fake(out, ptr=base + 2 * i * step) for i in range(n)],
            [Fake(lse, ptr=base + (2 * i + 1) * step) for i in range(n)])


def _named(xs, name):
    return [(f"{name}[{i}]", x) for i, x in enumerate(xs)]


def validate(outs, lses, out=None, lse_out=None):
    return merge.validate_merge(_named(outs, "outs"), _named(lses, "lses"), out, lse_out)


@pytest.fixture
def fake_device(monkeypatch):
    """The entry points take Fake arrays as device arrays, allocate Fakes and record their
    launches instead of making them: [(grid, block, MergeInputs fields, tail args)]."""
    real = merge.as_device_array
    adapt = lambda x, name: x if isinstance(x, Fake) else real(x, name)  # noqa: E731
    monkeypatch.setattr(merge, "as_device_array", adapt)
    monkeypatch.setattr(merge, "optional_output_array",
                        lambda x, name: None if x is None else adapt(x, name))
    monkeypatch.setattr(_arrays, "on_device", lambda device: contextlib.nullcontext())
    for name in ("context", "check_context"):  # CUPAGED_DEBUG's checks take the latter
        monkeypatch.setattr(_arrays, name, lambda device, kind, stream=None:
                            _arrays.Context(device, 7, kind, stream is not None))
    next_ptr = [1 << 32]

    def empty(ctx, shape, dtype):
        a = Fake(np.zeros(shape, dtype), device=ctx.device, ptr=next_ptr[0])
        next_ptr[0] += 1 << 20
        return a, a

    monkeypatch.setattr(_arrays, "empty", empty)
    launches = []

    def kernel(device, dtype):
        def launch(grid, block, smem, stream, inputs, *tail):
            assert (block, smem, stream) == (merge._THREADS, 0, 7)
            launches.append((grid, dtype, merge._INPUTS.unpack(inputs), tail))
        return launch

    monkeypatch.setattr(merge, "merge_kernel", kernel)
    return launches


def _entries(fields):
    """The used entries of an unpacked MergeInputs: [(out, lse, strides...)]."""
    n = fields[-1]
    cols = [fields[k * merge._MAX_STATES:(k + 1) * merge._MAX_STATES] for k in range(6)]
    assert all(all(v == 0 for v in col[n:]) for col in cols)  # unused entries are zero
    return [tuple(col[i] for col in cols) for i in range(n)]


@pytest.mark.parametrize("n", COUNTS)
def test_more_than_eight_partials_merge_in_chunks(fake_device, n):
    """The first 8 partials in one launch, then the running result (out, lse_out) as the
    first input beside up to 7 more: every partial once, in order."""
    outs, lses = _fakes(n)
    out, lse = cupaged.merge_states(outs, lses)
    assert len(fake_device) == (1 if n <= 8 else 1 + math.ceil((n - 8) / 7))
    running = (out.data.ptr, lse.data.ptr, 4 * 64, 64, 4, 1)
    seen = []
    for i, (grid, dtype, fields, tail) in enumerate(fake_device):
        entries = _entries(fields)
        if i:
            assert entries[0] == running
            entries = entries[1:]
        seen += entries
        assert dtype == "f16" and tail == (out.data.ptr, 4 * 64, 64, lse.data.ptr, 4, 1,
                                           3, 4, 64, 3, 1)
        assert grid == (math.ceil(3 * 4 * 8 / 128), 1, 1)
    assert seen == [(o.data.ptr, l.data.ptr, 4 * 64, 64, 4, 1) for o, l in zip(outs, lses)]


def test_stacked_partials_are_views_of_one_array(fake_device):
    outs = Fake(np.zeros((9, 2, 3, 64), np.float32), ptr=1 << 24)
    lses = Fake(np.zeros((2, 3, 9), np.float32).transpose(2, 0, 1), ptr=1 << 28)  # states fastest
    out, lse = cupaged.merge_states(outs, lses)
    assert out.shape == (2, 3, 64) and lse.shape == (2, 3) and out.dtype == np.float32
    first, second = (_entries(f) for _, _, f, _ in fake_device)
    assert first == [((1 << 24) + i * 2 * 3 * 64 * 4, (1 << 28) + i * 4, 3 * 64, 64, 3 * 9, 9)
                     for i in range(8)]
    assert second[1] == ((1 << 24) + 8 * 2 * 3 * 64 * 4, (1 << 28) + 8 * 4, 3 * 64, 64, 27, 9)


@pytest.mark.parametrize("dtype, hs, shift, vec", [
    (np.float16, 128, 4, 1),   # 16 lanes of 8 values
    (np.float16, 64, 3, 1),
    (np.float32, 256, 5, 1),   # 64 vectors: a warp, two each
    (np.float16, 72, 4, 1),    # 9 vectors: 16 lanes, 7 idle
    (np.float16, 36, 5, 0),    # 72 bytes: not whole vectors, element by element
    (np.float32, 1, 0, 0),
    (np.float16, 0, 0, 1),     # no dims: only the lse is merged
])
def test_thread_groups_and_vector_loads(fake_device, dtype, hs, shift, vec):
    outs, lses = _fakes(2, hs=hs, dtype=dtype)
    cupaged.merge_states(outs, lses)
    (grid, _, _, tail), = fake_device
    assert tail[-3:] == (hs, shift, vec)
    assert grid == (math.ceil(3 * 4 * 2**shift / 128), 1, 1)


def test_vector_loads_only_when_every_row_is_16_byte_aligned(fake_device):
    outs, lses = _fakes(3)
    outs[2] = Fake(np.zeros((3, 4, 64), np.float16), ptr=(1 << 24) + 8)  # 8 bytes past
    padded = np.zeros((3, 4, 65), np.float16)[:, :, :64]  # head stride 130 bytes
    cases = [outs, [outs[0], Fake(padded, ptr=1 << 30), outs[1]]]
    for o in cases:
        cupaged.merge_states(o, lses)
    # a stride no element is reached through (one head) does not matter
    one_head = np.lib.stride_tricks.as_strided(np.zeros(1000, np.float16), (3, 1, 64),
                                               (256, 130, 2))
    cupaged.merge_states([Fake(one_head), Fake(one_head, ptr=1 << 22)], _fakes(2, heads=1)[1])
    strided_out = Fake(np.zeros((3, 4, 72), np.float16)[:, :, :64], ptr=1 << 31)  # 144-byte heads
    cupaged.merge_states(_fakes(2)[0], lses[:2], out=strided_out)
    assert [launch[3][-1] for launch in fake_device] == [0, 0, 1, 1]
    # an output whose head stride is not a multiple of 16 bytes: element by element
    cupaged.merge_states(_fakes(2)[0], lses[:2], out=Fake(padded, ptr=1 << 31))
    assert fake_device[-1][3][:3] == (1 << 31, 4 * 65, 65) and fake_device[-1][3][-1] == 0


def test_merge_state_is_merge_states_of_two(fake_device):
    (a, b), (la, lb) = _fakes(2)
    out, lse = cupaged.merge_state(a, la, b, lb)
    (_, _, fields, tail), = fake_device
    assert _entries(fields) == [(a.data.ptr, la.data.ptr, 256, 64, 4, 1),
                                (b.data.ptr, lb.data.ptr, 256, 64, 4, 1)]
    assert tail[0] == out.data.ptr and tail[3] == lse.data.ptr


def test_in_place_into_the_first_partial(fake_device):
    (a, b), (la, lb) = _fakes(2)
    out, lse = cupaged.merge_state(a, la, b, lb, out=a, lse_out=la)
    assert out is a and lse is la
    (_, _, fields, tail), = fake_device
    assert _entries(fields)[0][:2] == tail[0:4:3] == (a.data.ptr, la.data.ptr)
    # the first slice of stacked partials, with many of them
    stacked = np.zeros((17, 3, 4, 64), np.float16)
    outs = Fake(stacked, ptr=1 << 24)
    lses = Fake(np.zeros((17, 3, 4), np.float32), ptr=1 << 30)
    first = Fake(stacked[0], ptr=1 << 24)
    first_lse = Fake(np.zeros((3, 4), np.float32), ptr=1 << 30)
    cupaged.merge_states(outs, lses, out=first, lse_out=first_lse)
    assert len(fake_device) == 1 + 3


def test_no_partial_rows_launch_nothing(fake_device):
    for rows, heads in ((0, 4), (3, 0)):
        outs, lses = _fakes(9, rows=rows, heads=heads)
        out, lse = cupaged.merge_states(outs, lses)
        assert out.shape == (rows, heads, 64) and lse.shape == (rows, heads)
        given = Fake(np.zeros((rows, heads, 64), np.float16), ptr=1 << 33)
        assert cupaged.merge_states(outs, lses, out=given)[0] is given
    assert fake_device == []


def test_valid_merge_is_described():
    outs, lses = _fakes(3, hs=72)
    m = validate(outs, lses)
    assert (m.dtype.name, m.shape, m.device, m.vec) == ("f16", (3, 4, 72), 0, True)
    assert m.inputs[1] == (outs[1].data.ptr, lses[1].data.ptr, 4 * 72, 72, 4, 1)
    rev = np.zeros((3, 4, 64), np.float32)[::-1]  # negative row stride: read as it is
    m = validate([Fake(rev, ptr=1 << 24)], [Fake(np.zeros((4, 3), np.float32).T)])
    assert m.inputs[0][2:] == (-4 * 64, 64, 1, 3) and m.vec


def _f16(*shape):
    return np.zeros(shape, np.float16)


def _f32(*shape):
    return np.zeros(shape, np.float32)


def _bad_outs(i, a):
    outs, lses = _fakes(3)
    outs[i] = a if isinstance(a, Fake) else Fake(a, ptr=1 << 31)
    return outs, lses


def _bad_lses(i, a):
    outs, lses = _fakes(3)
    lses[i] = a if isinstance(a, Fake) else Fake(a, ptr=1 << 31)
    return outs, lses


def _with_out(out=None, lse_out=None):
    outs, lses = _fakes(3)
    wrap = lambda a: a if a is None or isinstance(a, Fake) else Fake(a, ptr=1 << 31)  # noqa: E731
    return outs, lses, wrap(out), wrap(lse_out)


_OUTS, _LSES = _fakes(3)
_OVERLAP_OUT = Fake(_f16(3, 4, 64), ptr=_OUTS[0].data.ptr + 128)


@pytest.mark.parametrize("case, exc, match", [
    (([], []), ValueError, "at least one partial result"),
    ((_fakes(3)[0], _fakes(2)[1]), ValueError, "3 partial outputs but 2 lse arrays"),
    (_bad_outs(0, np.zeros((3, 4, 64), np.float64)), TypeError,
     r"outs\[0\] dtype float64 is not supported"),
    (_bad_outs(2, _f32(3, 4, 64)), TypeError,
     r"outs\[2\] dtype float32 does not match outs\[0\] dtype float16"),
    (_bad_outs(0, _f16(3, 256)), ValueError,
     r"outs\[0\] must be \[rows, num_heads, head_size\], got shape \(3, 256\)"),
    (_bad_outs(1, _f16(3, 4, 32)), ValueError,
     r"outs\[1\] shape \(3, 4, 32\) does not match outs\[0\] shape \(3, 4, 64\)"),
    (_bad_outs(1, _f16(3, 4, 128)[:, :, ::2]), ValueError,
     r"outs\[1\]'s last dimension \(head_size\) must be contiguous"),
    (_bad_outs(1, Fake(_f16(3, 4, 64), ptr=(1 << 24) + 1)), ValueError,
     r"outs\[1\] must be aligned to its 2-byte elements"),
    (_bad_lses(0, _f16(3, 4)), TypeError,
     r"lses\[0\] must be float32 .*natural log.*, got float16"),
    (_bad_lses(2, _f32(3, 4, 1)), ValueError,
     r"lses\[2\] must be \[rows, num_heads\] = \(3, 4\), got shape \(3, 4, 1\)"),
    (_bad_lses(1, _f32(4, 3)), ValueError, r"lses\[1\] must be \[rows, num_heads\]"),
    (_bad_lses(1, Fake(_f32(3, 4), ptr=(1 << 24) + 2)), ValueError,
     r"lses\[1\] must be aligned to its 4-byte elements"),
    (_bad_outs(2, Fake(_f16(3, 4, 64), device=1)), ValueError,
     r"outs\[2\] is on device 1 but outs\[0\] is on device 0"),
    (_bad_lses(0, Fake(_f32(3, 4), device=1)), ValueError,
     r"lses\[0\] is on device 1 but outs\[0\] is on device 0"),
    (_with_out(out=_f32(3, 4, 64)), TypeError, "out dtype float32 does not match outs"),
    (_with_out(out=_f16(3, 4, 63)), ValueError, r"out shape \(3, 4, 63\) does not match"),
    (_with_out(out=_f16(3, 4, 128)[..., ::2]), ValueError, "out's last dimension"),
    (_with_out(out=np.broadcast_to(_f16(1, 4, 64), (3, 4, 64))), ValueError,
     r"out's elements overlap \(shape \(3, 4, 64\), strides \(0, 128, 2\)\)"),
    (_with_out(out=np.lib.stride_tricks.as_strided(_f16(900), (3, 4, 64), (128, 64, 2))),
     ValueError, "out's elements overlap"),
    (_with_out(lse_out=_f16(3, 4)), TypeError, "lse_out must be float32"),
    (_with_out(lse_out=_f32(3)), ValueError, r"lse_out must be \[rows, num_heads\]"),
    (_with_out(lse_out=np.broadcast_to(_f32(4), (3, 4))), ValueError, "lse_out's elements overlap"),
    (_with_out(out=Fake(_f16(3, 4, 64), device=2)), ValueError, "out is on device 2"),
    (_with_out(lse_out=Fake(_f32(3, 4), device=2)), ValueError, "lse_out is on device 2"),
    (_with_out(out=Fake(_f16(3, 4, 64), ptr=1 << 31), lse_out=Fake(_f32(3, 4), ptr=(1 << 31) + 64)),
     ValueError, "out and lse_out overlap in memory"),
    ((_OUTS, _LSES, _OUTS[1], None), ValueError,
     r"out overlaps outs\[1\]: outputs may be written in place only over the first partial "
     r"\(outs\[0\]\)"),
    ((_OUTS, _LSES, None, _LSES[2]), ValueError, r"lse_out overlaps lses\[2\]"),
    ((_OUTS, _LSES, Fake(_f16(3, 4, 64), ptr=_LSES[1].data.ptr), None), ValueError,
     r"out overlaps lses\[1\]"),
    ((_OUTS, _LSES, _OVERLAP_OUT, None), ValueError,
     r"out overlaps outs\[0\] without being exactly it"),
    ((_OUTS, _LSES, None, Fake(_f32(4, 3).T, ptr=_LSES[0].data.ptr)), ValueError,
     r"lse_out overlaps lses\[0\] without being exactly it"),
])
def test_merge_validation(case, exc, match):
    with pytest.raises(exc, match=match):
        validate(*case)


def test_in_place_over_the_first_partial_is_valid():
    outs, lses = _fakes(3)
    m = validate(outs, lses, outs[0], lses[0])
    assert m.inputs[0][:2] == (outs[0].data.ptr, lses[0].data.ptr)
    validate(outs, lses, outs[0], None)
    validate(outs, lses, None, lses[0])


def test_stacked_partials_need_their_dimensions(fake_device):
    outs, lses = _fakes(2)
    with pytest.raises(ValueError, match=r"outs must be a sequence of arrays or one stacked "
                                         r"\[num_states, rows, num_heads, head_size\] array, "
                                         r"got shape \(3, 4, 64\)"):
        cupaged.merge_states(outs[0], lses)
    with pytest.raises(ValueError, match=r"lses must be .* \[num_states, rows, num_heads\] "
                                         r"array, got shape \(3, 4\)"):
        cupaged.merge_states(outs, lses[0])
    with pytest.raises(ValueError, match="at least one partial"):
        cupaged.merge_states(Fake(_f16(0, 3, 4, 64)), Fake(_f32(0, 3, 4)))
    assert fake_device == []


def test_takes_device_arrays_only(fake_device):
    a, la = np.zeros((2, 4, 64), np.float16), np.zeros((2, 4), np.float32)
    with pytest.raises(TypeError, match=r"out_b is a NumPy array .* cupy.asarray\(out_b\)"):
        cupaged.merge_state(Fake(a), Fake(la), a, la)
    with pytest.raises(TypeError, match=r"lses\[1\] is a NumPy array"):
        cupaged.merge_states([Fake(a), Fake(a)], [Fake(la), la])


# ---- on the GPU --------------------------------------------------------------------------------


def random_partials(rng, n, rows, heads, hs, dtype, empty=0.1):
    """n partials on the host: random outputs, lses spread over several units of e (so the
    weights differ a lot) with about ``empty`` of them -inf, and (row 0, head 0) -inf in
    every partial (a row that saw no key anywhere)."""
    outs = [testing.random_normal((rows, heads, hs), dtype, rng) for _ in range(n)]
    lses = []
    for _ in range(n):
        lse = rng.normal(0.0, 4.0, (rows, heads)).astype(np.float32)
        lse[rng.random((rows, heads)) < empty] = -np.inf
        if rows and heads:
            lse[0, 0] = -np.inf
        lses.append(lse)
    return outs, lses


def check(out, lse, ref_out, ref_lse, dtype, what="", row_floor=0.0):
    """out within the dtype's tolerance of the float64 reference (per row too, each row
    held to at least ``row_floor``: see assert_close); lse -inf exactly where the
    reference's is, elsewhere within float32 rounding."""
    got = cupy.asnumpy(out).astype(np.float64) if isinstance(out, cupy.ndarray) else out
    got_lse = cupy.asnumpy(lse).astype(np.float64) if isinstance(lse, cupy.ndarray) else lse
    assert np.isfinite(got).all(), what
    assert_close(got, ref_out, _tol(dtype), what, row_floor=row_floor)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(got_lse), empty), what
    assert np.array_equal(got[empty], ref_out[empty]), what  # zeros (one partial: itself)
    np.testing.assert_allclose(got_lse[~empty], ref_lse[~empty], rtol=1e-6, atol=1e-5,
                               err_msg=what)


@gpu
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_merge_states_matches_reference(rng, dtype, n, stacked):
    rows, heads, hs = 37, 8, 128
    outs, lses = random_partials(rng, n, rows, heads, hs, dtype)
    ref_out, ref_lse = reference.merge_states(outs, lses)
    if stacked:
        d_outs, d_lses = cupy.asarray(np.stack(outs)), cupy.asarray(np.stack(lses))
    else:
        d_outs, d_lses = [cupy.asarray(o) for o in outs], [cupy.asarray(x) for x in lses]
    out, lse_out = poisoned((rows, heads, hs), dtype), poisoned((rows, heads), np.float32)
    got, got_lse = cupaged.merge_states(d_outs, d_lses, out=out, lse_out=lse_out)
    assert got is out and got_lse is lse_out
    check(out, lse_out, ref_out, ref_lse, dtype, f"{n} partials")
    # allocated outputs: the same values
    new, new_lse = cupaged.merge_states(d_outs, d_lses)
    assert new.dtype == dtype and new_lse.dtype == np.float32
    assert cupy.array_equal(new, out) and cupy.array_equal(new_lse, lse_out)


@gpu
@pytest.mark.parametrize("hs", [64, 128, 256, 72, 8, 1, 36])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_merge_state_head_sizes(rng, dtype, hs):
    rows, heads = 19, 5
    (a, b), (la, lb) = random_partials(rng, 2, rows, heads, hs, dtype)
    ref_out, ref_lse = reference.merge_state(a, la, b, lb)
    out, lse = poisoned((rows, heads, hs), dtype), poisoned((rows, heads), np.float32)
    cupaged.merge_state(*(cupy.asarray(x) for x in (a, la, b, lb)), out=out, lse_out=lse)
    # A row of head size 1 is one element: a merge of standard-normal partials can cancel
    # it to near zero, while the kernel's float32 rounding scales with the partials. Rows
    # are held to at least the typical row norm (without it, about 0.7% of float32 runs
    # failed in a host emulation of the kernel's arithmetic).
    floor = float(np.sqrt(np.mean(np.sum(ref_out ** 2, axis=-1))))
    check(out, lse, ref_out, ref_lse, dtype, f"head size {hs}", row_floor=floor)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_empty_partials_are_the_identity(rng, dtype):
    """lse = -inf has weight 0: merging it gives the other partial exactly; two of them
    give zeros and -inf (finite, never NaN)."""
    rows, heads, hs = 6, 3, 64
    (a, b), _ = random_partials(rng, 2, rows, heads, hs, dtype)
    la = rng.normal(0, 3, (rows, heads)).astype(np.float32)
    none = np.full((rows, heads), -np.inf, np.float32)
    d = lambda x: cupy.asarray(x)  # noqa: E731
    for args in ((a, la, b, none), (b, none, a, la)):
        out, lse = cupaged.merge_state(*map(d, args))
        assert np.array_equal(cupy.asnumpy(out), a) and np.array_equal(cupy.asnumpy(lse), la)
    out, lse = poisoned((rows, heads, hs), dtype), poisoned((rows, heads), np.float32)
    cupaged.merge_state(d(a), d(none), d(b), d(none), out=out, lse_out=lse)
    assert (cupy.asnumpy(out).astype(np.float64) == 0).all()
    assert np.isneginf(cupy.asnumpy(lse)).all()
    # one partial: itself, rows that saw no key included; several with none: zeros
    la[0] = -np.inf
    out, lse = cupaged.merge_states([d(a)], [d(la)])
    assert np.array_equal(cupy.asnumpy(out), a) and np.array_equal(cupy.asnumpy(lse), la)
    out, lse = cupaged.merge_states([d(a)] * 3, [d(none)] * 3)
    assert (cupy.asnumpy(out).astype(np.float64) == 0).all()
    assert np.isneginf(cupy.asnumpy(lse)).all()


@gpu
def test_nan_inputs_propagate(rng):
    rows, heads, hs = 4, 2, 64
    (a, b), (la, lb) = random_partials(rng, 2, rows, heads, hs, np.float16, empty=0.0)
    la[:] = lb[:] = 0.5
    a[1, 0, 7] = np.nan  # one element of a finite-weight partial
    lb[2, 1] = np.nan    # one lse: its whole row
    out, lse = cupaged.merge_state(*(cupy.asarray(x) for x in (a, la, b, lb)))
    out, lse = cupy.asnumpy(out).astype(np.float64), cupy.asnumpy(lse)
    bad = np.zeros(out.shape, bool)
    bad[1, 0, 7] = True
    bad[2, 1, :] = True
    assert np.array_equal(np.isnan(out), bad)
    assert np.array_equal(np.isnan(lse), bad.all(axis=2))  # only the NaN lse's row


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_in_place_merge(rng, dtype):
    rows, heads, hs = 33, 4, 128
    (a, b), (la, lb) = random_partials(rng, 2, rows, heads, hs, dtype)
    ref_out, ref_lse = reference.merge_state(a, la, b, lb)
    da, dla = cupy.asarray(a), cupy.asarray(la)
    out, lse = cupaged.merge_state(da, dla, cupy.asarray(b), cupy.asarray(lb), out=da, lse_out=dla)
    assert out is da and lse is dla
    check(da, dla, ref_out, ref_lse, dtype, "merge_state in place")
    # 17 stacked partials into the first slice: three launches, the running result in place
    outs, lses = random_partials(rng, 17, rows, heads, hs, dtype)
    ref_out, ref_lse = reference.merge_states(outs, lses)
    so, sl = cupy.asarray(np.stack(outs)), cupy.asarray(np.stack(lses))
    cupaged.merge_states(so, sl, out=so[0], lse_out=sl[0])
    check(so[0], sl[0], ref_out, ref_lse, dtype, "17 partials in place")
    assert np.array_equal(cupy.asnumpy(so[1:]), np.stack(outs[1:]))  # the others untouched


def _layout(x, kind):
    """A device copy of host ``x`` ``[rows, heads, ...]`` with other strides: "padded" (a
    slice of rows one element longer, one element in: no 16-byte rows), "heads_major"
    (stored ``[heads, rows, ...]``), "every_other" (a slice of every other head), or
    "dense"."""
    d = cupy.asarray(x)
    if kind == "padded" and d.ndim == 3:
        buf = cupy.zeros((*d.shape[:2], d.shape[2] + 1), d.dtype)
        buf[..., 1:] = d
        return buf[..., 1:]
    if kind == "heads_major":
        return cupy.ascontiguousarray(d.swapaxes(0, 1)).swapaxes(0, 1)
    if kind == "every_other":
        buf = cupy.zeros((d.shape[0], 2 * d.shape[1], *d.shape[2:]), d.dtype)
        buf[:, ::2] = d
        return buf[:, ::2]
    return d


LAYOUTS = ("padded", "heads_major", "every_other", "dense")


@gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(np.float32)], ids=_ids)
def test_strided_views(rng, dtype):
    """Partials of different layouts in one launch (each read with its own strides), 10 of
    them (two launches), and outputs in the middle of poisoned buffers."""
    rows, heads, hs, n = 21, 6, 64, 10
    outs, lses = random_partials(rng, n, rows, heads, hs, dtype)
    ref_out, ref_lse = reference.merge_states(outs, lses)
    d_outs = [_layout(o, LAYOUTS[i % 4]) for i, o in enumerate(outs)]
    d_lses = [_layout(x, LAYOUTS[(i + 1) % 4]) for i, x in enumerate(lses)]
    big = poisoned((rows + 2, heads, hs), dtype)
    big_lse = poisoned((heads, rows + 2), np.float32)
    cupaged.merge_states(d_outs, d_lses, out=big[1:-1], lse_out=big_lse[:, 1:-1].T)
    check(big[1:-1], big_lse[:, 1:-1].T, ref_out, ref_lse, dtype, "strided")
    assert cupy.isnan(big[0]).all() and cupy.isnan(big[-1]).all()
    assert cupy.isnan(big_lse[:, 0]).all() and cupy.isnan(big_lse[:, -1]).all()


@gpu
def test_on_a_given_stream(rng):
    (a, b), (la, lb) = random_partials(rng, 2, 50, 8, 128, np.float16)
    ref_out, ref_lse = reference.merge_state(a, la, b, lb)
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        args = [cupy.asarray(x) for x in (a, la, b, lb)]
    side.synchronize()
    out, lse = cupaged.merge_state(*args, stream=side)
    side.synchronize()
    check(out, lse, ref_out, ref_lse, np.float16, "stream")


@gpu
def test_no_rows(rng):
    outs = [cupy.empty((0, 8, 128), np.float16)] * 3
    lses = [cupy.empty((0, 8), np.float32)] * 3
    out, lse = cupaged.merge_states(outs, lses)
    assert out.shape == (0, 8, 128) and out.dtype == np.float16
    assert lse.shape == (0, 8) and lse.dtype == np.float32
    out, lse = cupaged.merge_state(outs[0], lses[0], outs[1], lses[1])
    assert out.shape == (0, 8, 128) and lse.shape == (0, 8)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_torch_in_torch_out(rng, dtype):
    from test_interop import _torch, to_numpy, to_torch

    torch = _torch()
    rows, heads, hs = 17, 4, 128
    outs, lses = random_partials(rng, 9, rows, heads, hs, dtype)
    ref_out, ref_lse = reference.merge_states(outs, lses)
    t_outs, t_lses = [to_torch(o) for o in outs], [to_torch(x) for x in lses]
    out, lse = cupaged.merge_states(t_outs, t_lses)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.dtype == t_outs[0].dtype and lse.dtype == torch.float32
    check(to_numpy(out).astype(np.float64), to_numpy(lse).astype(np.float64), ref_out, ref_lse,
          dtype, "torch list")
    stacked, stacked_lse = torch.stack(t_outs), torch.stack(t_lses)
    out, lse = cupaged.merge_states(stacked, stacked_lse, out=stacked[0], lse_out=stacked_lse[0])
    assert out.data_ptr() == stacked.data_ptr()
    check(to_numpy(stacked[0]).astype(np.float64), to_numpy(stacked_lse[0]).astype(np.float64),
          ref_out, ref_lse, dtype, "torch stacked, in place")
    a, b = t_outs[0], t_outs[1]
    out, lse = cupaged.merge_state(a, t_lses[0], b, t_lses[1])
    ref_out, ref_lse = reference.merge_state(outs[0], lses[0], outs[1], lses[1])
    check(to_numpy(out).astype(np.float64), to_numpy(lse).astype(np.float64), ref_out, ref_lse,
          dtype, "torch merge_state")


@gpu
@pytest.mark.parametrize("hs", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_two_halves_of_an_attention_merge_into_the_whole(rng, dtype, hs):
    """Attention over the first and the second half of the keys (float64, outputs cast to
    the dtype, lses to float32), merged by the kernel, is attention over all of them."""
    q_len, heads, kv_heads, n = 24, 8, 2, 300
    q = rng.standard_normal((q_len, heads, hs))
    k = rng.standard_normal((n, kv_heads, hs))
    v = rng.standard_normal((n, kv_heads, hs))
    scale = 1 / math.sqrt(hs)
    half = 117
    parts = [reference.attend(q, k[s], v[s], scale, causal=False, return_lse=True)
             for s in (slice(0, half), slice(half, n))]
    whole, whole_lse = reference.attend(q, k, v, scale, causal=False, return_lse=True)
    args = []
    for o, lse in parts:
        args += [cupy.asarray(o.astype(dtype)), cupy.asarray(lse.astype(np.float32))]
    out, lse = poisoned((q_len, heads, hs), dtype), poisoned((q_len, heads), np.float32)
    cupaged.merge_state(*args, out=out, lse_out=lse)
    check(out, lse, whole, whole_lse, dtype, "two halves")
