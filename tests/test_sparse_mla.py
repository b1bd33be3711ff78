"""cupaged.sparse_mla_attention (DeepSeek's sparse attention, FlashMLA's decode interface):
its checks on array metadata alone (CPU), and on the GPU against the float64 reference
(reference.sparse_mla_attention) over -1 entries, repeated indices, block boundaries,
topk_length, topk not a multiple of a tile, split-KV, stale NaN in unselected slots, an
index outside the cache (its token's rows NaN, no other), rows with no entry; over 16-bit
caches, DeepSeek-V3.2's fp8_ds_mla rows and V4's v4_fp8 / v4_fp4 rows (512-dim keys)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import cupaged
from cupaged import _arrays, _dtypes, _prepared, planning, reference, sparse_mla, testing
from conftest import assert_close
from test_validation import Fake

D = 576
DS = 656  # an fp8_ds_mla token's bytes
D_V4 = 512  # DeepSeek-V4's d_qk (and d_v): the rotary dims inside
ROW_BYTES = {"fp8_ds_mla": DS, "v4_fp8": 528, "v4_fp4": 288}
FORMAT_OF_WIDTH = {n: f for f, n in ROW_BYTES.items()}
V4_FORMATS = ("v4_fp8", "v4_fp4")
SCALE = 1 / np.sqrt(192)


def host_problem(rng, batch, s_q, heads, topk, *, page=64, blocks=12, dtype="bf16",
                 flashmla_cache=True, topk_length=None, d=D):
    """Host arrays: q, a cache whose slots no counted index names hold NaN, indices with -1
    entries, a repeated index and both ends of the cache, and topk_length (random unless
    given; the NaN follows it, so change it only through this argument). ``d``: the
    tokens' and the query heads' dims."""
    dt = np.float16 if dtype == "f16" else _dtypes.BF16.numpy
    n = blocks * page
    q = testing.random_normal((batch, s_q, heads, d), dt, rng)
    cache = testing.random_normal((blocks, page, d), dt, rng)
    idx = rng.integers(0, n, (batch, s_q, topk)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.15] = -1
    idx[0, 0, :4] = [0, n - 1, page - 1, page][:min(topk, 4)]
    if topk > 5:
        idx[0, 0, 5] = idx[0, 0, 4] = 7  # a repeated index
    tl = rng.integers(0, topk + 3, batch).astype(np.int32)
    tl[0] = topk
    if topk_length is not None:
        tl[:] = topk_length
    named = np.zeros(n, bool)  # the slots a counted entry names: the others hold NaN
    counted = np.arange(topk)[None, None, :] < np.minimum(tl, topk)[:, None, None]
    named[idx[(idx >= 0) & counted]] = True
    cache.reshape(n, d)[~named] = np.nan  # never read: no NaN may leak
    if flashmla_cache:
        cache = cache[:, :, None]
    return dict(q=q, kv_cache=cache, indices=idx, topk_length=tl)


def ds_problem(rng, batch, s_q, heads, topk, *, page=64, blocks=12, flashmla_cache=True,
               topk_length=None):
    """host_problem over DeepSeek-V3.2's fp8_ds_mla cache (bfloat16 q): the tokens as the
    bytes vLLM's writer lays down (reference.quantize_sparse_kv), each group of 128 latent
    values 2^-6 to 1 in size (a scale of its own), and every byte of the slots no counted
    entry names 0xFF (NaN in the values, the scales and k_pe alike). (Groups of 2^6 would
    make the logits' spread ~50: then the bfloat16 rounding of the widened keys alone,
    which FlashMLA's dequantization has too, moves outputs by 1e-2 against the exact
    reference, rows by up to 0.17.)"""
    h = host_problem(rng, batch, s_q, heads, topk, page=page, blocks=blocks,
                     flashmla_cache=False, topk_length=topk_length)
    named = ~np.isnan(h["kv_cache"].astype(np.float32)).any(-1).reshape(-1)
    clean = testing.random_normal((blocks * page, D), np.float32, rng)
    clean[:, :512] *= np.repeat(2.0 ** rng.integers(-6, 1, (blocks * page, 4)), 128, 1)
    rows = reference.quantize_sparse_kv(clean, "fp8_ds_mla")
    rows[~named] = 0xFF
    rows = rows.reshape(blocks, page, DS)
    return dict(h, kv_cache=rows[:, :, None] if flashmla_cache else rows)


def v4_problem(rng, fmt, batch, s_q, heads, topk, *, page=64, blocks=12, flashmla_cache=True,
               topk_length=None):
    """host_problem over one of DeepSeek-V4's caches (bfloat16 q of 512 dims): the tokens as
    the bytes V4's writer lays down (reference.quantize_sparse_kv), each group of 32 values
    2^-6 to 1 in size (scales of their own), and the slots no counted entry names stale:
    every byte 0xFF (NaN scales; NaN e4m3 values in v4_fp8) or, every other such v4_fp8
    slot, +-448 under the scale 2^127 (+-inf once widened)."""
    h = host_problem(rng, batch, s_q, heads, topk, page=page, blocks=blocks,
                     flashmla_cache=False, topk_length=topk_length, d=D_V4)
    n = blocks * page
    named = ~np.isnan(h["kv_cache"].astype(np.float32)).any(-1).reshape(-1)
    clean = testing.random_normal((n, D_V4), np.float32, rng)
    clean *= np.repeat(2.0 ** rng.integers(-6, 1, (n, D_V4 // 32)), 32, 1)
    rows = reference.quantize_sparse_kv(clean, fmt)
    stale = np.flatnonzero(~named)
    rows[stale] = 0xFF
    if fmt == "v4_fp8":
        inf = stale[::2]
        rows[inf, :512] = rng.choice(np.array([0x7E, 0xFE], np.uint8), (len(inf), 512))
        rows[inf, 512:] = 0xFE
    rows = rows.reshape(blocks, page, ROW_BYTES[fmt])
    return dict(h, kv_cache=rows[:, :, None] if flashmla_cache else rows)


def problem(fmt, rng, *args, **kw):
    """host_problem over a cache of ``fmt``: "bf16" / "f16" (q's dtype), "fp8_ds_mla"
    (ds_problem) or one of V4's (v4_problem)."""
    if fmt in V4_FORMATS:
        return v4_problem(rng, fmt, *args, **kw)
    if fmt == "fp8_ds_mla":
        return ds_problem(rng, *args, **kw)
    return host_problem(rng, *args, dtype=fmt, **kw)


def second_problem(fmt, rng, batch, s_q, heads, topk, extra_topk, *, lengths=None,
                   extra_lengths=None, extra_page=16, extra_blocks=20):
    """problem() with a second cache of the same format: its own page size, blocks, indices
    (with -1 entries, a repeated index, both ends of it) and lengths; the slots no counted
    entry of either names are stale (NaN, 0xFF or inf bytes)."""
    h = problem(fmt, rng, batch, s_q, heads, topk, topk_length=lengths)
    e = problem(fmt, rng, batch, s_q, heads, extra_topk, page=extra_page, blocks=extra_blocks,
                topk_length=extra_lengths)
    return dict(h, extra_kv_cache=e["kv_cache"], extra_indices=e["indices"],
                extra_topk_length=e["topk_length"])


def kv_format(cache) -> str:
    """The reference's kv_format of a test cache: a 1-byte one's by its row width."""
    return FORMAT_OF_WIDTH[cache.shape[-1]] if cache.dtype == np.uint8 else "auto"


EXTRA = ("extra_kv_cache", "extra_indices", "extra_topk_length")


def reference_of(h, with_length=True, sink=None):
    return reference.sparse_mla_attention(h["q"], h["kv_cache"], h["indices"], scale=SCALE,
                                          topk_length=h["topk_length"] if with_length else None,
                                          kv_format=kv_format(h["kv_cache"]),
                                          attn_sink=sink, return_lse=True,
                                          **{k: h[k] for k in EXTRA if k in h})


@contextlib.contextmanager
def kernel_family(name):
    """Plans under set_mla_family(name) ("mma", "sm90", or None: the planner's rule) for
    the block; "sm90" skips off Hopper (the wgmma kernel runs there only)."""
    if name == "sm90":
        import cupy

        if planning.device_info(cupy.cuda.Device().id).arch != "sm_90":
            pytest.skip("the wgmma kernel runs on Hopper only")
    planning.set_mla_family(name)
    try:
        yield
    finally:
        planning.set_mla_family(None)


def run(h, with_length=True, pad=0, **kw):
    """The call on device copies, out and lse poisoned with NaN; ``pad``: the cache as a
    view of blocks ``pad`` token rows longer (its block stride not page * token stride)."""
    import cupy

    dev = {k: cupy.asarray(v) for k, v in h.items() if k != "kv_cache"}
    kc = h["kv_cache"]
    if pad:  # the padding NaN (0xFF bytes in an fp8_ds_mla cache)
        big = cupy.full((kc.shape[0], kc.shape[1] + pad, *kc.shape[2:]),
                        0xFF if kc.dtype == np.uint8 else np.nan, kc.dtype)
        big[:, :kc.shape[1]] = cupy.asarray(kc)
        dev["kv_cache"] = big[:, :kc.shape[1]]
    else:
        dev["kv_cache"] = cupy.asarray(kc)
    out = cupy.full(h["q"].shape[:3] + (512,), np.nan, h["q"].dtype)
    lse = cupy.full(h["q"].shape[:3], np.nan, np.float32)
    got, got_lse = cupaged.sparse_mla_attention(
        dev["q"], dev["kv_cache"], dev["indices"], scale=SCALE,
        topk_length=dev["topk_length"] if with_length else None, out=out, lse=lse,
        **{k: dev[k] for k in EXTRA if k in dev}, **kw)
    assert got is out and got_lse is lse
    return cupy.asnumpy(got).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)


def check_lse(got, want, what=""):
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), what
    f = np.isfinite(want)
    assert np.abs(got[f] - want[f]).max(initial=0) <= 2e-3 * max(1, np.abs(want[f]).max(initial=0)), what


# ---- CPU: the checks, on metadata -------------------------------------------------------------


def fakes(**over):
    base = dict(q=np.zeros((2, 3, 16, D), np.float16),
                kv_cache=np.zeros((10, 64, 1, D), np.float16),
                indices=np.zeros((2, 3, 32), np.int32), topk_length=None, out=None, lse=None)
    base.update(over)
    return {k: None if v is None else Fake(v, ptr=(i + 1) << 24)
            for i, (k, v) in enumerate(base.items())}


@pytest.fixture
def adapt(monkeypatch):
    real = _arrays.as_device_array
    one = lambda x, name: x if isinstance(x, Fake) else real(x, name)  # noqa: E731
    monkeypatch.setattr(sparse_mla, "as_device_array", one)
    monkeypatch.setattr(_arrays, "as_device_array", one)

    def check(attn_sink=None, kv_cache_dtype="auto", **over):
        f = fakes(**over)
        sink = None if attn_sink is None else Fake(attn_sink, ptr=1 << 30)
        return sparse_mla.validate_and_prepare(
            f["q"], f["kv_cache"], f["indices"], 0.1, f["topk_length"], f["out"], f["lse"],
            False, None, None, plan=False, attn_sink=sink, kv_cache_dtype=kv_cache_dtype,
            extra=tuple(f.get(f"extra_{k}") for k in ("kv_cache", "indices", "topk_length")))
    return check


def test_both_cache_forms_are_accepted(adapt):
    assert adapt() == (None, None)
    assert adapt(kv_cache=np.zeros((10, 64, D), np.float16)) == (None, None)
    assert adapt(attn_sink=np.zeros(16, np.float32)) == (None, None)


def test_broadcast_indices_and_an_out_past_their_bytes_are_accepted(adapt):
    """Indices broadcast over the batch (one entry's 4 bytes) and out 16 bytes past them:
    apart, whatever the decode form's views over the indices span."""
    from numpy.lib.stride_tricks import as_strided

    from test_validation import Fake

    f = fakes(indices=as_strided(np.zeros(1, np.int32), (2, 3, 1), (0, 0, 4)))
    out = Fake(np.zeros((2, 3, 16, 512), np.float16), ptr=f["indices"].data.ptr + 16)
    assert sparse_mla.validate_and_prepare(f["q"], f["kv_cache"], f["indices"], 0.1, None, out,
                                           None, False, None, None, plan=False) == (None, None)


@pytest.mark.parametrize("name", ["indices", "topk_length", "attn_sink", "extra_indices",
                                  "extra_topk_length"])
def test_index_arrays_and_the_sink_must_be_4_byte_aligned(adapt, name):
    """The kernels read them as 4-byte words: an array 2 bytes off is refused by name."""
    from test_validation import Fake

    f = fakes(topk_length=np.zeros(2, np.int32))
    sink = Fake(np.zeros(16, np.float32), ptr=1 << 30)
    extra = [Fake(np.zeros((4, 64, 1, D), np.float16), ptr=9 << 24),
             Fake(np.zeros((2, 3, 8), np.int32), ptr=10 << 24),
             Fake(np.zeros(2, np.int32), ptr=11 << 24)]
    target = {"attn_sink": sink, "extra_indices": extra[1], "extra_topk_length": extra[2]}.get(
        name) or f[name]
    target.data.ptr += 2
    with pytest.raises(ValueError, match=f"{name} must start on a 4-byte boundary"):
        sparse_mla.validate_and_prepare(f["q"], f["kv_cache"], f["indices"], 0.1,
                                        f["topk_length"], f["out"], f["lse"], False, None, None,
                                        plan=False, attn_sink=sink, extra=tuple(extra))


def test_a_topk_past_the_kernels_int32_count_is_refused(adapt):
    """A token's keys are counted in int32 with a tile's slack: topk past 2^31 - 64 is
    refused by name (without it the tile count overflowed to zeros)."""
    from numpy.lib.stride_tricks import as_strided

    big = as_strided(np.zeros(16, np.int32), (2, 3, 2**31 - 63), (0, 0, 4))
    with pytest.raises(ValueError, match="indices hold 2147483585 entries a token; at most "
                                         "2\\^31 - 64"):
        adapt(indices=big)


def test_fp8_ds_mla_caches_are_accepted(adapt):
    """Both cache forms, as uint8, int8 or float8_e4m3fn, named or found by their width; the
    prefill interface's kv too."""
    import ml_dtypes

    bf16 = _dtypes.BF16.numpy
    q = np.zeros((2, 3, 16, D), bf16)
    for dt in (np.uint8, np.int8, ml_dtypes.float8_e4m3fn):
        for shape in ((10, 64, 1, DS), (10, 64, DS)):
            for named in ("auto", "fp8_ds_mla"):
                assert adapt(q=q, kv_cache=np.zeros(shape, dt), kv_cache_dtype=named) == \
                    (None, None)
    assert adapt(q=np.zeros((6, 16, D), bf16), kv_cache=np.zeros((100, 1, DS), np.uint8),
                 indices=np.zeros((6, 1, 32), np.int32)) == (None, None)
    with pytest.raises(TypeError, match="kv_cache dtype float8_e5m2 must be q's"):
        adapt(q=q, kv_cache=np.zeros((10, 64, DS), ml_dtypes.float8_e5m2))
    assert adapt(topk_length=np.zeros(2, np.int32), out=np.zeros((2, 3, 16, 512), np.float16),
                 lse=np.zeros((2, 3, 16), np.float32)) == (None, None)


@pytest.mark.parametrize("fmt", V4_FORMATS)
def test_v4_caches_are_accepted(adapt, fmt):
    """DeepSeek-V4's rows under bfloat16 q of 512 dims, as uint8, int8 or float8_e4m3fn, in
    both cache forms, named or found by their width under "auto"; the prefill interface's
    kv too; out [.., 512] and lse."""
    import ml_dtypes

    bf16 = _dtypes.BF16.numpy
    w = ROW_BYTES[fmt]
    q = np.zeros((2, 3, 16, D_V4), bf16)
    for dt in (np.uint8, np.int8, ml_dtypes.float8_e4m3fn):
        for shape in ((10, 64, 1, w), (10, 64, w)):
            for named in ("auto", fmt):
                assert adapt(q=q, kv_cache=np.zeros(shape, dt), kv_cache_dtype=named) == \
                    (None, None)
    for kv in (np.zeros((100, 1, w), np.uint8), np.zeros((37, w), np.uint8)):
        assert adapt(q=np.zeros((6, 16, D_V4), bf16), kv_cache=kv,
                     indices=np.zeros((6, 1, 32), np.int32), topk_length=np.zeros(6, np.int32),
                     out=np.zeros((6, 16, 512), bf16), lse=np.zeros((6, 16), np.float32)) == \
            (None, None)
    assert adapt(q=q, kv_cache=np.zeros((10, 64, 1, w), np.uint8),
                 topk_length=np.zeros(2, np.int32), out=np.zeros((2, 3, 16, 512), bf16),
                 lse=np.zeros((2, 3, 16), np.float32)) == (None, None)


@pytest.mark.parametrize("fmt", V4_FORMATS)
@pytest.mark.parametrize("case, exc, match", [
    (dict(q=(2, 3, 16, D)), ValueError,
     "q must be \\[\\.\\., num_heads, 512\\] over {fmt} rows \\(d_qk 512: the 64 rotary dims "
     "inside the 512\\), got shape \\(2, 3, 16, 576\\)"),
    (dict(q_dtype=np.float16), TypeError,
     "{fmt} caches take bfloat16 queries \\(the kernel widens them to bfloat16\\), got float16"),
    (dict(other_width=True), ValueError,
     "kv_cache's {fmt} rows must be {w} bytes a token, got shape \\(10, 64, {other}\\)"),
    (dict(cache_dtype=_dtypes.BF16.numpy), TypeError,
     "kv_cache dtype bfloat16 cannot hold {fmt} rows: expected a 1-byte dtype"),
    (dict(cache_shape=(10, 64, 2)), ValueError,
     "kv_cache must be \\[num_blocks, page_size, 1, {w}\\] or \\[num_blocks, page_size, {w}\\]"),
    (dict(prefill=True), ValueError,
     "kv_cache must be \\[s_kv, 1, {w}\\] or \\[s_kv, {w}\\] for the prefill interface \\(q "
     "\\[s_q, num_heads, 512\\]\\)"),
    (dict(out=(2, 3, 16, D)), ValueError,
     "out must be a C-contiguous array of shape \\(2, 3, 16, 512\\)"),
    (dict(pad=8), ValueError, "kv_cache's strides must be multiples of 16 bytes"),
])
def test_v4_refusals_name_the_argument(adapt, fmt, case, exc, match):
    """A wrong q head size, q dtype, row width, cache dtype or shape, prefill kv, out: each
    refused before anything launches, naming the argument and the expected shape."""
    bf16 = _dtypes.BF16.numpy
    w = ROW_BYTES[fmt]
    other = ROW_BYTES["v4_fp4" if fmt == "v4_fp8" else "v4_fp8"]  # the other format's rows
    named = case.get("other_width") or case.get("cache_dtype") is not None
    width = other if case.get("other_width") else w
    shape = (*case.get("cache_shape", (10, 64, 1)), width)
    if case.get("prefill"):
        shape = (10, 64, 1, w)  # 4-D: a paged cache, not kv's [s_kv, (1,) width]
    root = np.zeros((*shape[:-1], width + case.get("pad", 0)), case.get("cache_dtype", np.uint8))
    over = dict(q=np.zeros(case.get("q", (6, 16, D_V4) if case.get("prefill")
                                     else (2, 3, 16, D_V4)), case.get("q_dtype", bf16)),
                kv_cache=root[..., :width],
                kv_cache_dtype=fmt if named else "auto")
    if case.get("prefill"):
        over["indices"] = np.zeros((6, 32), np.int32)
    if "out" in case:
        over["out"] = np.zeros(case["out"], bf16)
    with pytest.raises(exc, match=match.format(fmt=fmt, w=w, other=other)):
        adapt(**over)


def test_v4_specs_name_their_rows_and_refuse_a_rope():
    """The spec of a V4 reader (both kernels): rope 0 (the rotary dims inside the 512), its
    cache type in its name and name expression; a rope_dim of 64 refused, fp8_ds_mla's 64
    kept."""
    from cupaged import jit

    for fmt, name, cxx in (("v4_fp8", "v4fp8", "v4_fp8_t"), ("v4_fp4", "v4fp4", "v4_fp4_t")):
        s = jit.KernelSpec("mla_sparse_attention", "bf16", 512, 64, cache_dtype=name, arch="sm_80")
        assert s.rope_dim == 0
        assert s.name == f"mla_sparse_attention_bf16_{name}_hs512_rope0_bs64_r16t32x2_sm80"
        assert s.name_expression == (f"cupaged::mla_sparse_attention<cupaged::bfloat16_t, "
                                     f"cupaged::{cxx}, 512, 0, 64, 16, 32, 2, 0>")
        x = jit.KernelSpec("mla_sparse_attention", "bf16", 512, 64, cache_dtype=name,
                           variant="x", arch="sm_80")
        assert x.name == f"mla_sparse_attention_bf16_{name}_hs512_rope0_bs64_x_r16t32x2_sm80"
        assert x.name_expression.endswith(", 64>")
        with pytest.raises(ValueError, match=f"cache_dtype '{name}' holds the rotary dims inside "
                                             f"its 512: rope_dim must be 0"):
            jit.KernelSpec("mla_sparse_attention", "bf16", 512, 64, rope_dim=64, cache_dtype=name)
        w = jit.KernelSpec("mla_sparse_attention_sm90", "bf16", 512, 64, cache_dtype=name)
        assert w.rope_dim == 0 and w.arch == "sm_90a"
        assert w.name == f"mla_sparse_attention_sm90_bf16_{name}_hs512_rope0_bs64_sm90a"
        assert w.name_expression == (f"cupaged::mla_sparse_attention_sm90<cupaged::bfloat16_t, "
                                     f"cupaged::{cxx}, 512, 0, 64, 0>")
        wx = jit.KernelSpec("mla_sparse_attention_sm90", "bf16", 512, 64, cache_dtype=name,
                            variant="x")
        assert wx.name == f"mla_sparse_attention_sm90_bf16_{name}_hs512_rope0_bs64_x_sm90a"
        assert wx.name_expression.endswith(", 512, 0, 64, 64>")
        with pytest.raises(ValueError, match="rope_dim must be 0"):
            jit.KernelSpec("mla_sparse_attention_sm90", "bf16", 512, 64, rope_dim=64,
                           cache_dtype=name)
    assert jit.KernelSpec("mla_sparse_attention_sm90", "bf16", 512, 64,
                          cache_dtype="dsmla").rope_dim == 64
    assert jit.KernelSpec("mla_sparse_attention", "bf16", 512, 64, cache_dtype="dsmla").rope_dim == 64
    with pytest.raises(ValueError, match="cache_dtype 'dsmla' holds 64 rotary dims: rope_dim "
                                         "must be 64"):
        jit.KernelSpec("mla_sparse_attention", "bf16", 512, 64, rope_dim=32, cache_dtype="dsmla")


@pytest.mark.parametrize("family", [None, "sm90"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("fmt", V4_FORMATS)
def test_v4_rows_are_planned_by_the_heads_rule(mla_planned, fmt, arch, family):
    """V4's rows take the kernels fp8_ds_mla's take: on Hopper the wgmma kernel from 64
    heads (every head count under set_mla_family("sm90")), else mla_sparse_attention in the
    planner's tile for 512-dim keys and the format's row bytes (rope 0); with a second
    cache the mma.sync kernel always."""
    built = mla_planned(arch)
    name = _dtypes.SPARSE_KV_CACHE_DTYPES[fmt].dtype.name
    planning.set_mla_family(family)
    planning.set_mla_split(0)
    try:
        for heads in (16, 64, 128):
            wgmma = arch == "sm_90" and (heads >= 64 or family == "sm90")
            for second in (False, True):
                plan = planning.plan_mla(0, "bf16", name, 512, 0, 64, 4, 4, heads, 1, 2048,
                                         sparse=True, second_cache=second)
                assert built[-1] == ("sm90x" if second else "sm90") or not wgmma, (heads, second)
                assert not str(built[-1]).startswith("sm90") or wgmma, (heads, second)
            if wgmma:
                continue
            plan = planning.plan_mla(0, "bf16", name, 512, 0, 64, 4, 4, heads, 1, 2048,
                                     sparse=True)
            rows, tile, stages = planning.mla_tile(arch, heads, 1, ROW_BYTES[fmt], 0)
            assert built[-1].name == (f"mla_sparse_attention_bf16_{name}_hs512_rope0_bs64_"
                                      f"r{rows}t{tile}x{stages}_{arch.replace('_', '')}")
            assert plan.grid == (4 * -(-heads // rows), 1, 1) and plan.split_tiles == 0
        planning.plan_mla(0, "bf16", "dsmla", 512, 64, 64, 4, 4, 128, 1, 2048, sparse=True)
        assert (built[-1] == "sm90") == (arch == "sm_90")
    finally:
        planning.set_mla_family(None)
        planning.set_mla_split(None)


def test_v4_tiles_fit_more_than_fp8_ds_mla():
    """V4's smaller rows (528 and 288 bytes against 656) and keys (512 dims against 576) leave
    each target's shared memory room for as deep a ring as fp8_ds_mla's, or deeper."""
    from cupaged.specs import geometry

    for arch in ("sm_80", "sm_90"):
        for heads in (16, 64, 128):
            ds = planning.mla_tile(arch, heads, 1, DS, 64)
            for fmt in V4_FORMATS:
                t = planning.mla_tile(arch, heads, 1, ROW_BYTES[fmt], 0)
                g = geometry.MlaGeometry(512, 0, *t, 1, ROW_BYTES[fmt])
                assert g.fits(arch) and t[0] == ds[0], (arch, heads, fmt, t)
                assert t[1] * t[2] >= ds[1] * ds[2] or g.min_blocks(arch) == 2, (arch, fmt, t)


def test_v4_planned_specs_compile_for_sm80_and_sm90():
    """The planner's V4 specializations (16, 64 and 128 heads, both formats, with a second
    cache and without) through NVRTC and ptxas for sm_80 (the software e4m3 conversion) and
    sm_90 (the instruction), fast options; the launch packs what they take."""
    from cupaged import jit
    from test_jit import _mangled_params

    for arch in ("sm_80", "sm_90"):
        specs = list(dict.fromkeys(
            jit.KernelSpec("mla_sparse_attention", "bf16", 512, 64, rows=t[0], tile_tokens=t[1],
                           stages=t[2], cache_dtype=_dtypes.SPARSE_KV_CACHE_DTYPES[f].dtype.name,
                           variant=variant, arch=arch)
            for f in V4_FORMATS for h in (16, 64, 128) for variant in ("", "x")
            for t in [planning.mla_tile(arch, h, 1, ROW_BYTES[f], 0)]))
        binary, lowered = jit._compile("mla_attention.cu", arch,
                                       [s.name_expression for s in specs], f"v4 {arch}",
                                       jit.check_options())
        assert binary
        for s in specs:
            assert _mangled_params(lowered[s.name_expression]) == \
                jit.ARG_FORMATS["mla_sparse_attention"], s.name


@pytest.mark.parametrize("over, exc, match", [
    (dict(q=np.zeros((6, 16, D), np.float16)), ValueError,
     "kv_cache must be \\[s_kv, 1, 576\\] or \\[s_kv, 576\\] for the prefill interface"),
    (dict(q=np.zeros((2, 3, 16, 512), np.float16)), ValueError, "kv_lora_rank \\+ rope_dim"),
    (dict(kv_cache=np.zeros((10, 64, 2, D), np.float16)), ValueError,
     "kv_cache must be \\[num_blocks, page_size, 1, 576\\]"),
    (dict(indices=np.zeros((2, 3, 32), np.int64)), TypeError, "indices must be int32"),
    (dict(indices=np.zeros((2, 4, 32), np.int32)), ValueError,
     "indices must be \\[batch, s_q, topk\\] = \\[2, 3, topk >= 1\\]"),
    (dict(indices=np.zeros((2, 3, 32), np.int32)[:, :, ::2]), ValueError,
     "indices' last dimension must be contiguous"),
    (dict(topk_length=np.zeros(3, np.int32)), ValueError,
     "topk_length must be a contiguous int32 \\[batch\\] = \\[2\\]"),
    (dict(out=np.zeros((2, 3, 16, 576), np.float16)), ValueError,
     "out must be a C-contiguous array of shape \\(2, 3, 16, 512\\)"),
    (dict(out=np.zeros((2, 3, 16, 1024), np.float16)[..., ::2]), ValueError,
     "out must be a C-contiguous array of shape \\(2, 3, 16, 512\\), got shape "
     "\\(2, 3, 16, 512\\) with strides"),
    (dict(kv_cache=np.zeros((10, 64, 1, D), np.uint8)), TypeError,
     "kv_cache dtype uint8 must be q's \\(float16\\), or a 1-byte dtype of DeepSeek's "
     "sparse rows \\(656-byte fp8_ds_mla, 528-byte v4_fp8, 288-byte v4_fp4: name it"),
    (dict(kv_cache=np.zeros((10, 64, 1, DS), np.uint8)), TypeError,
     "fp8_ds_mla caches take bfloat16 queries"),
    (dict(kv_cache_dtype="fp8_ds_mla"), TypeError,
     "kv_cache dtype float16 cannot hold fp8_ds_mla rows"),
    (dict(kv_cache_dtype="fp8"), ValueError,
     "kv_cache_dtype must be 'auto' or one of DeepSeek's sparse caches \\('fp8_ds_mla', "
     "'v4_fp8', 'v4_fp4'\\), got 'fp8'"),
    (dict(kv_cache_dtype=None), ValueError, "kv_cache_dtype must be 'auto' or one of"),
    (dict(kv_cache=np.zeros((10, 64, 1, 512), np.float16), q=np.zeros((2, 3, 16, 512),
                                                                       np.float16)),
     ValueError, "kv_cache of float16 tokens of 512 dims \\(DeepSeek-V4's d_qk\\) is not "
                 "read: V4's tokens are read from 'v4_fp8' \\(528-byte\\) or 'v4_fp4'"),
    (dict(q=np.zeros((2, 3, 16, D), _dtypes.BF16.numpy), kv_cache_dtype="fp8_ds_mla",
          kv_cache=np.zeros((10, 64, 1, D), np.uint8)), ValueError,
     "kv_cache's fp8_ds_mla rows must be 656 bytes a token"),
    (dict(q=np.zeros((2, 3, 16, D), _dtypes.BF16.numpy),
          kv_cache=np.zeros((10, 64, DS + 8), np.uint8)[..., :DS]), ValueError,
     "kv_cache's strides must be multiples of 16 bytes"),
    (dict(attn_sink=np.zeros(15, np.float32)), ValueError,
     "attn_sink must be a contiguous float32 \\[num_heads = 16\\] array"),
    (dict(attn_sink=np.zeros(16, np.float16)), ValueError,
     "attn_sink must be a contiguous float32"),
    (dict(q=np.zeros((2, 4, 16, D), np.float16)[:, :3]), ValueError,
     "q .*cannot be seen as one array"),
])
def test_refusals_name_the_argument(adapt, over, exc, match):
    with pytest.raises(exc, match=match):
        adapt(**over)


def test_indices_are_named_in_their_own_errors(adapt):
    """Faults of the indices are reported as the indices', not as a block table's."""
    rows_130_bytes_apart = np.zeros((2, 3, 130), np.int8)[..., :128].view(np.int32)
    with pytest.raises(ValueError, match="indices' last dimension must be contiguous and its "
                                         "rows a whole number of entries apart"):
        adapt(indices=rows_130_bytes_apart)
    f = fakes()
    f["indices"].data.device_id = 1
    with pytest.raises(ValueError, match="indices is on device 1"):
        sparse_mla.validate_and_prepare(f["q"], f["kv_cache"], f["indices"], 0.1, None, None,
                                        None, False, None, None, plan=False)


def test_the_prefill_interface_is_accepted_and_checked(adapt):
    """q [s_q, heads, 576] over kv [s_kv, 1, 576] or [s_kv, 576], indices [s_q, 1, topk] or
    [s_q, topk], topk_length [s_q]; s_kv of any size (odd ones in blocks of one token)."""
    for s_kv in (100, 37, 256, 1024):
        for kv in (np.zeros((s_kv, 1, D), np.float16), np.zeros((s_kv, D), np.float16)):
            for ind in (np.zeros((6, 1, 32), np.int32), np.zeros((6, 32), np.int32)):
                assert adapt(q=np.zeros((6, 16, D), np.float16), kv_cache=kv, indices=ind,
                             topk_length=np.zeros(6, np.int32),
                             out=np.zeros((6, 16, 512), np.float16),
                             lse=np.zeros((6, 16), np.float32)) == (None, None)
    q, kv = np.zeros((6, 16, D), np.float16), np.zeros((100, 1, D), np.float16)
    with pytest.raises(ValueError, match="indices must be \\[s_q, 1, topk\\] or \\[s_q, topk\\] "
                                         "with s_q = 6"):
        adapt(q=q, kv_cache=kv, indices=np.zeros((5, 32), np.int32))
    with pytest.raises(ValueError, match="out must be of shape \\(6, 16, 512\\) for the prefill"):
        adapt(q=q, kv_cache=kv, indices=np.zeros((6, 32), np.int32),
              out=np.zeros((6, 1, 16, 512), np.float16))
    with pytest.raises(ValueError, match="topk_length must be a contiguous int32 \\[batch\\] "
                                         "= \\[6\\]"):
        adapt(q=q, kv_cache=kv, indices=np.zeros((6, 32), np.int32),
              topk_length=np.zeros(2, np.int32))


# (fmt, q's dtype, q's d_qk, the rows' width)
SECOND_FORMATS = [("f16", np.float16, D, D), ("fp8_ds_mla", _dtypes.BF16.numpy, D, DS),
                  ("v4_fp8", _dtypes.BF16.numpy, D_V4, 528),
                  ("v4_fp4", _dtypes.BF16.numpy, D_V4, 288)]


@pytest.mark.parametrize("fmt, qdt, d, w", SECOND_FORMATS, ids=[f[0] for f in SECOND_FORMATS])
def test_a_second_cache_is_accepted(adapt, fmt, qdt, d, w):
    """extra_kv_cache of the first cache's format with its own blocks and page size (1 to
    256, both cache forms), extra_indices with their own topk, extra_topk_length; the
    prefill interface's forms (kv [s_kv', 1, width] or [s_kv', width], indices [s_q, 1,
    k] or [s_q, k], lengths [s_q])."""
    cdt = np.float16 if fmt == "f16" else np.uint8
    q = np.zeros((2, 3, 16, d), qdt)
    first = np.zeros((10, 64, 1, w), cdt)
    for page in (1, 16, 64, 256):
        for shape in ((7, page, 1, w), (7, page, w)):
            assert adapt(q=q, kv_cache=first, extra_kv_cache=np.zeros(shape, cdt),
                         extra_indices=np.zeros((2, 3, 5), np.int32),
                         extra_topk_length=np.zeros(2, np.int32)) == (None, None)
    assert adapt(q=q, kv_cache=first, extra_kv_cache=np.zeros((7, 16, w), cdt),
                 extra_indices=np.zeros((2, 3, 40), np.int32)) == (None, None)
    for kv in (np.zeros((50, 1, w), cdt), np.zeros((37, w), cdt)):
        for ind in (np.zeros((6, 1, 9), np.int32), np.zeros((6, 9), np.int32)):
            assert adapt(q=np.zeros((6, 16, d), qdt), kv_cache=np.zeros((100, 1, w), cdt),
                         indices=np.zeros((6, 1, 32), np.int32), extra_kv_cache=kv,
                         extra_indices=ind, extra_topk_length=np.zeros(6, np.int32)) == \
                (None, None)


@pytest.mark.parametrize("over, exc, match", [
    (dict(extra_indices=None), TypeError, "extra_kv_cache and extra_indices come together"),
    (dict(extra_kv_cache=None), TypeError, "extra_kv_cache and extra_indices come together"),
    (dict(extra_kv_cache=None, extra_indices=None), TypeError,
     "extra_topk_length needs extra_kv_cache and extra_indices"),
    (dict(extra_kv_cache=np.zeros((7, 16, 1, 288), np.uint8)), ValueError,
     "extra_kv_cache must hold the first cache's format \\(v4_fp8\\), got uint8 of shape "
     "\\(7, 16, 1, 288\\)"),
    (dict(extra_kv_cache=np.zeros((7, 16, 1, 528), np.uint16)), TypeError,
     "extra_kv_cache dtype uint16 must be q's \\(bfloat16\\)"),
    (dict(extra_kv_cache=np.zeros((7, 48, 1, 528), np.uint8)), ValueError,
     "extra_kv_cache's page size must be a power of two from 1 to 256, got 48"),
    (dict(extra_kv_cache=np.zeros((7, 16, 2, 528), np.uint8)), ValueError,
     "extra_kv_cache must be \\[num_blocks, page_size, 1, 528\\] or \\[num_blocks, page_size, "
     "528\\]"),
    (dict(extra_kv_cache=np.zeros((7, 16, 536), np.uint8)[..., :528]), ValueError,
     "extra_kv_cache's tokens must be contiguous rows at a 16-byte aligned address"),
    (dict(extra_indices=np.zeros((2, 3, 5), np.int64)), TypeError,
     "extra_indices must be int32"),
    (dict(extra_indices=np.zeros((2, 4, 5), np.int32)), ValueError,
     "extra_indices must be \\[batch, s_q, extra_topk\\] = \\[2, 3, extra_topk >= 1\\]"),
    (dict(extra_indices=np.zeros((2, 3, 10), np.int32)[..., ::2]), ValueError,
     "extra_indices' last dimension must be contiguous"),
    (dict(extra_topk_length=np.zeros(3, np.int32)), ValueError,
     "extra_topk_length must be a contiguous int32 \\[batch\\] = \\[2\\]"),
    (dict(prefill=True, extra_kv_cache=np.zeros((7, 16, 1, 528), np.uint8)), ValueError,
     "extra_kv_cache must be \\[s_kv, 1, 528\\] or \\[s_kv, 528\\] for the prefill interface"),
    (dict(prefill=True, extra_kv_cache=np.zeros((40, 528), np.uint8),
          extra_indices=np.zeros((5, 9), np.int32)), ValueError,
     "extra_indices must be \\[s_q, 1, topk\\] or \\[s_q, topk\\] with s_q = 6"),
])
def test_second_cache_refusals_name_the_argument(adapt, over, exc, match):
    """A second cache without its indices (or the other way round), lengths without it,
    another format or dtype, a page size that is not a power of two, a wrong shape, padded
    rows, wrong indices or lengths, wrong prefill forms: each refused by name before
    anything launches."""
    bf16 = _dtypes.BF16.numpy
    over = dict(over)
    prefill = over.pop("prefill", False)
    base = dict(q=np.zeros((2, 3, 16, D_V4), bf16), kv_cache=np.zeros((10, 64, 1, 528), np.uint8),
                extra_kv_cache=np.zeros((7, 16, 1, 528), np.uint8),
                extra_indices=np.zeros((2, 3, 5), np.int32),
                extra_topk_length=np.zeros(2, np.int32))
    if prefill:
        base.update(q=np.zeros((6, 16, D_V4), bf16), kv_cache=np.zeros((100, 528), np.uint8),
                    indices=np.zeros((6, 32), np.int32),
                    extra_kv_cache=np.zeros((40, 528), np.uint8),
                    extra_indices=np.zeros((6, 9), np.int32),
                    extra_topk_length=np.zeros(6, np.int32))
    base.update(over)
    with pytest.raises(exc, match=match):
        adapt(**base)


def test_second_cache_bounds_and_size_one_strides(adapt):
    """Slots up to 2^31 - 3 (a second-cache slot travels as -3 - slot), both topks together
    under 2^31 - 64 (a token's keys), and strides of size-1 dimensions free (as the first
    cache's: never used)."""
    from numpy.lib.stride_tricks import as_strided

    bf16 = _dtypes.BF16.numpy
    base = dict(q=np.zeros((2, 3, 16, D_V4), bf16), kv_cache=np.zeros((10, 64, 1, 528), np.uint8),
                extra_indices=np.zeros((2, 3, 5), np.int32))
    row = np.zeros(528, np.uint8)
    huge = as_strided(row, (2 ** 31 - 2, 1, 528), (0, 0, 1))  # one row, seen 2^31 - 2 times
    with pytest.raises(ValueError, match="extra_kv_cache has 2147483646 token slots; at most "
                                         "2\\^31 - 3 are supported"):
        adapt(**base, extra_kv_cache=huge)
    assert adapt(**base, extra_kv_cache=as_strided(row, (2 ** 31 - 3, 1, 528), (0, 0, 1))) \
        == (None, None)
    entries = np.zeros(16, np.int32)
    many = as_strided(entries, (2, 3, 2 ** 30), (0, 0, 4))
    with pytest.raises(ValueError, match="indices and extra_indices hold 2147483648 entries a "
                                         "token together; at most 2\\^31 - 64"):
        adapt(**{**base, "indices": many, "extra_indices": many},
              extra_kv_cache=np.zeros((7, 16, 1, 528), np.uint8))
    one_block = as_strided(np.zeros(16 * 528 + 8, np.uint8), (1, 16, 528), (8, 528, 1))
    one_token = as_strided(np.zeros(7 * 528 + 8, np.uint8), (7, 1, 528), (528, 8, 1))
    for e in (one_block, one_token):
        assert adapt(**base, extra_kv_cache=e) == (None, None)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_a_second_cache_is_planned_in_the_variant_of_either_kernel(mla_planned, arch):
    """A second cache takes the kernel a call without one takes, in its variant "x" (the
    kernels without it are unchanged): the wgmma one at 128 heads on Hopper,
    mla_sparse_attention elsewhere and under set_mla_family("mma")."""
    built = mla_planned(arch)
    planning.set_mla_split(0)
    try:
        for cache in ("dsmla", "bf16"):
            planning.plan_mla(0, "bf16", cache, 512, 64, 64, 4, 4, 128, 1, 2048, sparse=True)
            assert (built[-1] == "sm90") == (arch == "sm_90")
            planning.plan_mla(0, "bf16", cache, 512, 64, 64, 4, 4, 128, 1, 2048 + 512,
                              sparse=True, second_cache=True)
            if arch == "sm_90":
                assert built[-1] == "sm90x"
                planning.set_mla_family("mma")
                planning.plan_mla(0, "bf16", cache, 512, 64, 64, 4, 4, 128, 1, 2048 + 512,
                                  sparse=True, second_cache=True)
                planning.set_mla_family(None)
            assert built[-1].kernel == "mla_sparse_attention"
            assert built[-1].variant == "x" and built[-1].name.split("_")[-3] == "x"
    finally:
        planning.set_mla_split(None)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fp8_ds_mla_takes_the_wgmma_kernel_at_every_head_count(mla_planned, arch):
    """On Hopper fp8_ds_mla's rows take the wgmma kernel at 16 and 20 heads too (its 256
    threads widen them), 16-bit caches and V4's rows the mma.sync one below 64 heads, with
    a second cache (the kernel's variant "x") as without; set_mla_family("mma") keeps
    every cache on mma.sync."""
    built = mla_planned(arch)
    planning.set_mla_split(0)
    try:
        for cache, rope in (("dsmla", 64), ("bf16", 64), ("v4fp8", 0), ("v4fp4", 0)):
            for heads in (16, 20, 64):
                planning.plan_mla(0, "bf16", cache, 512, rope, 64, 4, 4, heads, 1, 2048,
                                  sparse=True)
                wgmma = arch == "sm_90" and (heads >= 64 or cache == "dsmla")
                assert (built[-1] == "sm90") == wgmma, (cache, heads)
                planning.plan_mla(0, "bf16", cache, 512, rope, 64, 4, 4, heads, 1, 2560,
                                  sparse=True, second_cache=True)
                assert (built[-1] == "sm90x") == wgmma, (cache, heads)
        planning.set_mla_family("mma")
        planning.plan_mla(0, "bf16", "dsmla", 512, 64, 64, 4, 4, 16, 1, 2048, sparse=True)
        assert built[-1] != "sm90"
    finally:
        planning.set_mla_family(None)
        planning.set_mla_split(None)


@pytest.fixture
def widen_loads(monkeypatch):
    """planning.sparse_widening's kernel loads recorded (their specs), nothing compiled."""
    from cupaged import jit

    loaded = []
    monkeypatch.setattr(jit, "load", lambda spec, device, smem=0: loaded.append(spec) or spec)
    return loaded


def test_the_widening_rule(device_arch, widen_loads):
    """fp8_ds_mla's rows are widened once where the direct kernel would widen at least
    WIDEN_ONCE_FACTOR times as many rows as the cache holds, up to WIDEN_MAX_ROWS rows;
    never for V4's rows (no 16-bit kernel reads their 512-dim keys), 16-bit caches or an
    empty cache."""
    device_arch("sm_90")
    f = planning.WIDEN_ONCE_FACTOR
    w = planning.sparse_widening(0, "bf16", "dsmla", 1000, f * 1000)
    assert w is not None and (w.num_rows, w.width) == (1000, D)
    assert w.grid == (-(-1000 * 41 // 128), 1, 1)  # a thread a 16-byte chunk of 41
    assert widen_loads[-1].name == "widen_sparse_rows_bf16_dsmla_sm90"
    assert widen_loads[-1].name_expression == (
        "cupaged::widen_sparse_rows<cupaged::bfloat16_t, cupaged::fp8_ds_mla_t>")
    assert planning.sparse_widening(0, "bf16", "dsmla", 1000, f * 1000 - 1) is None
    assert planning.sparse_widening(0, "bf16", "dsmla", 0, 10 ** 6) is None
    most = planning.WIDEN_MAX_ROWS
    assert planning.sparse_widening(0, "bf16", "dsmla", most, f * most).num_rows == most
    assert planning.sparse_widening(0, "bf16", "dsmla", most + 1, f * most + f) is None
    for cache in ("v4fp8", "v4fp4", "bf16"):
        assert planning.sparse_widening(0, "bf16", cache, 1000, 10 ** 6) is None, cache
    assert len(widen_loads) == 2


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_a_prefill_over_many_selections_reads_widened_rows(adapt, mla_planned, widen_loads,
                                                           monkeypatch, arch, heads):
    """A prefill call over fp8_ds_mla rows whose query tokens select each cached token more
    than WIDEN_ONCE_FACTOR times widens the rows once and runs the launch a 16-bit cache of
    the same tokens gets (the same kernel, strides, offsets and constants), reading the
    token rows at their own stride; fewer selections, a second cache or V4's rows keep the
    direct kernel."""
    from cupaged import launch

    monkeypatch.setattr(_arrays, "on_device", lambda device: contextlib.nullcontext())
    built = mla_planned(arch)
    planned = []  # the cache dtype each plan is made for
    real_plan = planning.plan_mla
    monkeypatch.setattr(planning, "plan_mla",
                        lambda *a, **k: planned.append(a[2]) or real_plan(*a, **k))
    # a workspace's partials (a stand-in: nothing is launched)
    monkeypatch.setattr(launch, "mla_workspace_partials", lambda ws, device, rank: (
        None if ws is None else launch.Partials(1 << 32, 2 << 32, 3 << 32, 10 ** 9)))
    bf16 = _dtypes.BF16.numpy
    s_kv, topk = 5000, 2048
    s_q = -(-planning.WIDEN_ONCE_FACTOR * s_kv // (topk * -(-heads // 64)))

    def prepare(s_q, kv, q_dim=D, extra=(None, None, None), workspace=None):
        q = Fake(np.zeros((s_q, heads, q_dim), bf16), ptr=1 << 24)
        idx = Fake(np.zeros((s_q, 1, topk), np.int32), ptr=1 << 26)
        prep, _ = sparse_mla.validate_and_prepare(q, Fake(kv, ptr=1 << 30), idx, 0.1, None,
                                                  None, None, False, None, workspace,
                                                  extra=extra)
        return prep.launch

    padded = np.zeros((s_kv, 1, 672), np.uint8)[:, :, :DS]  # rows 672 bytes apart
    got = prepare(s_q, padded)
    assert isinstance(got, launch.WidenedMlaLaunch), (arch, heads)
    assert got.row_stride == 672 and got.widening.num_rows == s_kv
    assert planned[-1] == "bf16"  # the 16-bit rows' plan
    wgmma = arch == "sm_90" and heads >= 64  # the 16-bit cache's rule
    assert built[-1] == "sm90" if wgmma else built[-1].cache_dtype == "bf16"
    want = prepare(s_q, np.zeros((s_kv, 1, D), bf16))
    assert got.inner == want, [(f, a, b) for f, a, b in zip(want._fields, got.inner, want)
                               if a != b]
    # fewer selections: the direct kernel over the rows
    direct = prepare(s_q - 1, padded)
    assert isinstance(direct, launch.MlaLaunch) and planned[-1] == "dsmla"
    # with a workspace (its calls allocate nothing): the direct kernel
    assert isinstance(prepare(s_q, padded, workspace=object()), launch.MlaLaunch)
    assert planned[-1] == "dsmla"
    assert built[-1] == "sm90" if arch == "sm_90" else "_dsmla_" in built[-1].name
    extra = (Fake(np.zeros((64, 1, DS), np.uint8), ptr=1 << 31),
             Fake(np.zeros((s_q, 1, 8), np.int32), ptr=1 << 32), None)
    assert isinstance(prepare(s_q, padded, extra=extra), launch.MlaLaunch)
    for fmt, width in (("v4_fp8", 528), ("v4_fp4", 288)):
        kv = np.zeros((s_kv, 1, width), np.uint8)
        assert isinstance(prepare(s_q, kv, D_V4), launch.MlaLaunch), fmt
    assert [s.kernel for s in widen_loads].count("widen_sparse_rows") == 1


def test_an_empty_batch_is_accepted(adapt):
    assert adapt(q=np.zeros((0, 3, 16, D), np.float16),
                 indices=np.zeros((0, 3, 32), np.int32)) == (None, None)


def test_scale_is_required():
    with pytest.raises(TypeError, match="scale is required"):
        cupaged.sparse_mla_attention(None, None, None, scale=None)


# ---- GPU: against the float64 reference -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("heads, topk, page, pad", [(16, 100, 64, 0), (64, 37, 16, 8),
                                                    (128, 256, 64, 0), (16, 1, 32, 0),
                                                    (20, 70, 64, 16), (40, 33, 1, 0)])
@pytest.mark.parametrize("with_length", [True, False])
def test_decode_matches_reference(rng, dtype, heads, topk, page, pad, with_length):
    """Head counts that leave a partial row tile (20, 40), a cache whose blocks are padded
    (its block stride not page * token stride: block and offset computed apart), pages of
    one token."""
    # Without topk_length every entry counts: the NaN goes only where no entry points.
    h = host_problem(rng, 3, 2, heads, topk, page=page, dtype=dtype,
                     topk_length=None if with_length else topk)
    got, lse = run(h, with_length, pad=pad)
    want, want_lse = reference_of(h, with_length)
    assert_close(got, want, testing.TOLERANCE[dtype], f"{heads} heads topk {topk}")
    check_lse(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", *V4_FORMATS])
@pytest.mark.parametrize("split", [0, 1, 2, 3])
def test_split_kv_and_workspace(rng, split, fmt):
    """Forced partitions (tiles each) over two row tiles of 64 heads (128 heads), with a
    scratch buffer and with a workspace."""
    h = problem(fmt, rng, 2, 1, 128, 300, flashmla_cache=False)
    planning.set_mla_split(split)
    try:
        got, lse = run(h)
        ws = cupaged.DecodeWorkspace(2, 16, 512)
        again, lse2 = run(h, workspace=ws)
    finally:
        planning.set_mla_split(None)
    want, want_lse = reference_of(h)
    for g, l_ in ((got, lse), (again, lse2)):
        assert_close(g, want, testing.TOLERANCE["bf16"], f"{fmt} split {split}")
        check_lse(l_, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", *V4_FORMATS])
def test_an_index_outside_the_cache_gives_its_token_nan_only(rng, fmt):
    h = problem(fmt, rng, 2, 2, 16, 40, topk_length=[40, 30])
    n = h["kv_cache"].shape[0] * h["kv_cache"].shape[1]
    h["indices"][1, 0, 3] = n  # one past the cache
    h["indices"][0, 1, 7] = -2  # negative but not -1
    h["indices"][1, 1, 35] = n + 5  # past batch entry 1's topk_length: never read
    got, lse = run(h)
    assert np.isnan(got[1, 0]).all() and np.isnan(got[0, 1]).all()
    assert np.isnan(lse[1, 0]).all() and np.isnan(lse[0, 1]).all()
    keep = np.ones((2, 2), bool)
    keep[1, 0] = keep[0, 1] = False
    ok = dict(h, indices=np.where((h["indices"] >= n) | (h["indices"] < -1), -1, h["indices"]))
    want, _ = reference_of(ok)
    assert_close(got[keep], want[keep], testing.TOLERANCE["bf16"])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", *V4_FORMATS])
@pytest.mark.parametrize("family", ["mma", "sm90"])
def test_flags_and_bad_indices_in_later_tiles(rng, family, fmt):
    """Entries of -1 and an index outside the cache in the third and later 64-key tiles,
    whose key flags and copies reuse the ring's stages: the bad index's token alone is
    NaN, a stale flag would count a zero row or drop a key (V4's rows in two raw stages on
    the wgmma kernel: tile i + 1's copies and flags land while tile i is widened)."""
    h = problem(fmt, rng, 3, 2, 128, 333, topk_length=[333, 300, 131])
    n = h["kv_cache"].shape[0] * h["kv_cache"].shape[1]
    h["indices"][:, :, 130:200:3] = -1
    h["indices"][1, 1, 257] = n  # tile 4 of token (1, 1)
    with kernel_family(family):
        got, lse = run(h)
    assert np.isnan(got[1, 1]).all() and np.isnan(lse[1, 1]).all()
    keep = np.ones((3, 2), bool)
    keep[1, 1] = False
    ok = dict(h, indices=np.where(h["indices"] >= n, -1, h["indices"]))
    want, want_lse = reference_of(ok)
    assert_close(got[keep], want[keep], testing.TOLERANCE["bf16"], family)
    check_lse(lse[keep], want_lse[keep])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", *V4_FORMATS])
def test_rows_with_no_entry_are_zeros_and_minus_inf(rng, fmt):
    h = problem(fmt, rng, 3, 1, 16, 20, topk_length=[20, 20, 0])
    h["indices"][1] = -1
    got, lse = run(h)
    for b in (1, 2):
        assert (got[b] == 0).all() and np.isneginf(lse[b]).all()
    want, want_lse = reference_of(h)
    assert_close(got[0], want[0], testing.TOLERANCE["bf16"])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", *V4_FORMATS])
def test_torch_in_torch_out(rng, fmt):
    """torch in, torch out: bfloat16 q and cache, or V4's uint8 rows (vLLM's [num_blocks,
    page, width])."""
    torch = pytest.importorskip("torch")
    h = problem(fmt, rng, 2, 1, 16, 50, **({} if fmt == "bf16" else {"flashmla_cache": False}))
    t = {k: torch.from_numpy(v.view(np.int16) if v.dtype == _dtypes.BF16.numpy else v).cuda()
         for k, v in h.items()}
    for k in ("q", "kv_cache"):
        if h[k].dtype == _dtypes.BF16.numpy:
            t[k] = t[k].view(torch.bfloat16)
    out = cupaged.sparse_mla_attention(t["q"], t["kv_cache"], t["indices"], scale=SCALE,
                                       topk_length=t["topk_length"])
    assert isinstance(out, torch.Tensor) and out.shape == (2, 1, 16, 512)
    want, _ = reference_of(h)
    assert_close(out.float().cpu().numpy().astype(np.float64), want,
                 testing.TOLERANCE["bf16"])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", *V4_FORMATS])
@pytest.mark.parametrize("s_kv", [300, 37, 512])
@pytest.mark.parametrize("with_length", [True, False])
def test_prefill_matches_reference(rng, fmt, s_kv, with_length):
    """FlashMLA's sparse prefill: indices into kv's tokens, anything outside [0, s_kv)
    (-1, -5, s_kv and beyond) not counted; kv of a size no power of two divides (37: blocks
    of one token); unnamed tokens NaN (0xFF bytes in V4's rows); a repeated index. Over
    V4's rows (kv [s_kv, 1, 528 / 288], q [s_q, 128, 512], groups of 32 values 2^-6 to 1
    in size) the format found by its width ("auto") and named."""
    import cupy

    s_q, topk = 9, 80
    heads, d = (32, D) if fmt == "bf16" else (128, D_V4)
    dt = _dtypes.BF16.numpy
    q = testing.random_normal((s_q, heads, d), dt, rng)
    if fmt == "bf16":
        kv = testing.random_normal((s_kv, 1, D), dt, rng)
    else:
        clean = testing.random_normal((s_kv, D_V4), np.float32, rng)
        clean *= np.repeat(2.0 ** rng.integers(-6, 1, (s_kv, D_V4 // 32)), 32, 1)
        kv = reference.quantize_sparse_kv(clean, fmt)[:, None]
    idx = rng.integers(0, s_kv, (s_q, 1, topk)).astype(np.int32)
    bad = rng.random(idx.shape)
    idx[bad < 0.1] = -1
    idx[(bad >= 0.1) & (bad < 0.15)] = s_kv + 3
    idx[(bad >= 0.15) & (bad < 0.2)] = -5
    idx[0, 0, 5] = idx[0, 0, 6] = 4  # a repeated index
    tl = rng.integers(0, topk + 2, s_q).astype(np.int32)
    named = np.zeros(s_kv, bool)
    counted = np.arange(topk)[None, :] < np.minimum(tl, topk)[:, None]
    ok = (idx[:, 0] >= 0) & (idx[:, 0] < s_kv) & (counted if with_length else True)
    named[idx[:, 0][ok]] = True
    kv[~named] = 0xFF if kv.dtype == np.uint8 else np.nan
    want, want_lse = reference.sparse_mla_attention(
        q, kv, idx, scale=SCALE, kv_format=kv_format(kv),
        topk_length=tl if with_length else None, return_lse=True)
    d = {k: cupy.asarray(v) for k, v in dict(q=q, kv=kv, idx=idx, tl=tl).items()}
    for named_as in ("auto",) if fmt == "bf16" else ("auto", fmt):
        out = cupy.full((s_q, heads, 512), np.nan, dt)
        lse = cupy.full((s_q, heads), np.nan, np.float32)
        cupaged.sparse_mla_attention(d["q"], d["kv"], d["idx"], scale=SCALE,
                                     topk_length=d["tl"] if with_length else None, out=out,
                                     lse=lse, kv_cache_dtype=named_as)
        assert_close(cupy.asnumpy(out).astype(np.float64), want, testing.TOLERANCE["bf16"],
                     f"{fmt} s_kv {s_kv} {named_as}")
        check_lse(cupy.asnumpy(lse).astype(np.float64), want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["mma", "sm90"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla", *V4_FORMATS])
@pytest.mark.parametrize("heads, split", [(16, 0), (64, 0), (64, 2), (128, 3)])
def test_a_second_cache_matches_reference(rng, fmt, heads, split, kernels):
    """V4's second cache in the same softmax: its own page size (16 against 64), blocks,
    indices and lengths (a token counting only the first cache's entries, one only the
    second's, one some of each), stale slots in both; single pass and forced partitions
    (keys of both caches in one partition and across them); attn_sink on one row. The
    same call again over other data (the remembered call) too. Both kernel families (the
    wgmma one's tiles mix both caches' rows in its raw stages)."""
    h = second_problem(fmt, rng, 3, 2, heads, 100, 37, lengths=[100, 0, 60],
                       extra_lengths=[0, 37, 20])
    sink = None
    if heads == 64:
        sink = rng.normal(0, 1, heads).astype(np.float32)
    planning.set_mla_split(split)
    try:
        with kernel_family(kernels):
            import cupy

            extra = {} if sink is None else dict(attn_sink=cupy.asarray(sink))
            got, lse = run(h, **extra)
            want, want_lse = reference_of(h, sink=sink)
            assert_close(got, want, testing.TOLERANCE["bf16"],
                         f"{kernels} {fmt} {heads} heads split {split}")
            check_lse(lse, want_lse)
            h2 = second_problem(fmt, rng, 3, 2, heads, 100, 37, lengths=[30, 100, 0],
                                extra_lengths=[37, 3, 0])  # other data, the same metadata
            got2, lse2 = run(h2, **extra)
            want2, want_lse2 = reference_of(h2, sink=sink)
            assert_close(got2, want2, testing.TOLERANCE["bf16"], f"{fmt} again")
            check_lse(lse2, want_lse2)
    finally:
        planning.set_mla_split(None)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["mma", "sm90"])
@pytest.mark.parametrize("fmt", ["f16", "v4_fp4"])
@pytest.mark.parametrize("form", ["page1", "page256", "vllm3d", "padded", "strided_indices"])
def test_second_cache_forms(rng, fmt, form, kernels):
    """The second cache in each form validation takes: pages of 1 and 256 tokens, vLLM's
    3-D cache, blocks padded past their tokens (the padding stale), indices sliced from
    wider rows; lengths past extra_topk and negative (clamped)."""
    import cupy

    page = {"page1": 1, "page256": 256}.get(form, 16)
    blocks = {"page1": 300, "page256": 2}.get(form, 20)
    h = second_problem(fmt, rng, 3, 2, 16, 60, 37, lengths=[60, 20, 7],
                       extra_lengths=[99, -5, 20], extra_page=page, extra_blocks=blocks)
    want, want_lse = reference_of(h)
    e = h.pop("extra_kv_cache")
    if form == "vllm3d":
        e = e[:, :, 0]
    if form == "padded":  # 8 token rows of padding a block, stale
        big = cupy.full((e.shape[0], e.shape[1] + 8, *e.shape[2:]),
                        0xFF if e.dtype == np.uint8 else np.nan, e.dtype)
        big[:, :e.shape[1]] = cupy.asarray(e)
        h["extra_kv_cache"] = big[:, :e.shape[1]]
    else:
        h["extra_kv_cache"] = e
    if form == "strided_indices":
        idx = h["extra_indices"]
        wide = cupy.full(idx.shape[:2] + (idx.shape[2] + 5,), 2 ** 31 - 1, np.int32)
        wide[:, :, :idx.shape[2]] = cupy.asarray(idx)
        h["extra_indices"] = wide[:, :, :idx.shape[2]]  # (the stale entries never read)
    with kernel_family(kernels):
        got, lse = run(h)
    assert_close(got, want, testing.TOLERANCE["bf16"], f"{kernels} {fmt} {form}")
    check_lse(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["mma", "sm90"])
def test_an_empty_second_cache_counts_nothing(rng, kernels):
    """A second cache of no blocks (address possibly 0) with -1 entries: the result of the
    first cache alone."""
    import cupy

    h = problem("bf16", rng, 2, 2, 16, 50)
    want, want_lse = reference_of(h)
    h.update(extra_kv_cache=cupy.zeros((0, 16, 1, D), _dtypes.BF16.numpy),
             extra_indices=np.full((2, 2, 8), -1, np.int32))
    with kernel_family(kernels):
        got, lse = run(h)
    assert_close(got, want, testing.TOLERANCE["bf16"])
    check_lse(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["mma", "sm90"])
@pytest.mark.parametrize("fmt", ["bf16", "v4_fp8"])
def test_an_index_outside_the_second_cache_gives_its_token_nan_only(rng, fmt, kernels):
    """An index of the second cache outside its slots (one past it, a negative other than
    -1) turns its token's rows NaN, decode's rule, whichever cache it is in; one past its
    token's extra_topk_length is never read."""
    h = second_problem(fmt, rng, 2, 2, 16, 40, 24, lengths=[40, 40], extra_lengths=[24, 10])
    n = h["extra_kv_cache"].shape[0] * h["extra_kv_cache"].shape[1]
    h["extra_indices"][1, 0, 3] = n
    h["extra_indices"][0, 1, 7] = -2
    h["extra_indices"][1, 1, 20] = n + 5  # past batch entry 1's extra_topk_length
    with kernel_family(kernels):
        got, lse = run(h)
    assert np.isnan(got[1, 0]).all() and np.isnan(got[0, 1]).all()
    assert np.isnan(lse[1, 0]).all() and np.isnan(lse[0, 1]).all()
    keep = np.ones((2, 2), bool)
    keep[1, 0] = keep[0, 1] = False
    e = h["extra_indices"]
    want, _ = reference_of(dict(h, extra_indices=np.where((e >= n) | (e < -1), -1, e)))
    assert_close(got[keep], want[keep], testing.TOLERANCE["bf16"])


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["mma", "sm90"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla", *V4_FORMATS])
def test_a_second_cache_through_the_prefill_interface(rng, fmt, kernels):
    """FlashMLA's prefill forms with a second cache: q [s_q, heads, d], kv [s_kv, 1, width]
    and extra kv [s_kv', width], indices [s_q, 1, k] and [s_q, k'], lengths [s_q]; an index
    outside either cache does not count (prefill's rule). (The index replaces a counted
    entry: a length raised after the problem is made would count entries that name its
    stale slots.)"""
    import cupy

    h = second_problem(fmt, rng, 5, 1, 32, 50, 30, extra_lengths=[30, 25, 20, 12, 0])
    q = h["q"][:, 0]
    kv = h["kv_cache"].reshape(-1, 1, h["kv_cache"].shape[-1])
    ekv = h["extra_kv_cache"].reshape(-1, h["extra_kv_cache"].shape[-1])
    idx, eidx = h["indices"], h["extra_indices"][:, 0]
    eidx[2, 4] = ekv.shape[0] + 1  # outside, in token 2's 20 counted: does not count
    tl, etl = h["topk_length"], h["extra_topk_length"]
    want, want_lse = reference.sparse_mla_attention(
        q, kv, idx, scale=SCALE, kv_format=kv_format(kv), topk_length=tl,
        extra_kv_cache=ekv[:, None], extra_indices=eidx[:, None], extra_topk_length=etl,
        return_lse=True)
    d = {k: cupy.asarray(v) for k, v in dict(q=q, kv=kv, ekv=ekv, idx=idx, eidx=eidx, tl=tl,
                                              etl=etl).items()}
    with kernel_family(kernels):
        out, lse = cupaged.sparse_mla_attention(
            d["q"], d["kv"], d["idx"], scale=SCALE, topk_length=d["tl"],
            extra_kv_cache=d["ekv"], extra_indices=d["eidx"], extra_topk_length=d["etl"],
            return_lse=True)
    assert_close(cupy.asnumpy(out).astype(np.float64), want, testing.TOLERANCE["bf16"], fmt)
    check_lse(cupy.asnumpy(lse).astype(np.float64), want_lse)


# ---- GPU: DeepSeek-V3.2's fp8_ds_mla cache, attention sinks ------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads, topk, page, pad", [(16, 100, 64, 0), (64, 37, 16, 8),
                                                    (128, 256, 64, 0), (20, 70, 64, 16),
                                                    (40, 33, 1, 0)])
@pytest.mark.parametrize("with_length", [True, False])
def test_fp8_ds_mla_decode_matches_reference(rng, heads, topk, page, pad, with_length):
    """The fp8_ds_mla rows widened with their own scales (groups 2^-6 to 1 in size): the
    reference reads them exactly; unnamed slots are 0xFF bytes (NaN) and must not leak."""
    h = ds_problem(rng, 3, 2, heads, topk, page=page,
                   topk_length=None if with_length else topk)
    got, lse = run(h, with_length, pad=pad)
    want, want_lse = reference_of(h, with_length)
    assert_close(got, want, testing.TOLERANCE["bf16"], f"{heads} heads topk {topk}")
    check_lse(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 2])
def test_fp8_ds_mla_split_and_prefill(rng, split):
    """Forced partitions over 128 heads, and the prefill interface over fp8_ds_mla tokens."""
    import cupy

    h = ds_problem(rng, 2, 1, 128, 300, flashmla_cache=False)
    planning.set_mla_split(split)
    try:
        got, lse = run(h)
    finally:
        planning.set_mla_split(None)
    want, want_lse = reference_of(h)
    assert_close(got, want, testing.TOLERANCE["bf16"], f"split {split}")
    check_lse(lse, want_lse)
    # prefill: q [s_q, heads, 576] over the cache's tokens as kv [s_kv, 1, 656]
    kv = h["kv_cache"].reshape(-1, 1, DS)
    q = h["q"][:, 0]
    idx = h["indices"][:, 0, None]
    idx = np.where(idx == -1, -7, idx)  # any index outside [0, s_kv) does not count
    want, want_lse = reference.sparse_mla_attention(q, kv, idx, scale=SCALE,
                                                    kv_format="fp8_ds_mla",
                                                    topk_length=h["topk_length"],
                                                    return_lse=True)
    out, lse = cupaged.sparse_mla_attention(cupy.asarray(q), cupy.asarray(kv),
                                            cupy.asarray(idx), scale=SCALE,
                                            topk_length=cupy.asarray(h["topk_length"]),
                                            return_lse=True)
    assert_close(cupy.asnumpy(out).astype(np.float64), want, testing.TOLERANCE["bf16"])
    check_lse(cupy.asnumpy(lse).astype(np.float64), want_lse)


@pytest.mark.gpu
def test_widen_sparse_rows_gives_the_readers_keys(rng):
    """widen_sparse_rows: each row's kv_c as the readers widen it (each e4m3 value times its
    group's float32 scale, rounded once to bfloat16), k_pe's bytes in place, over rows 672
    bytes apart holding every e4m3 code (NaN, subnormals, zeros) and scales of any float32
    (vLLM's amax / 448, subnormal, NaN); the poisoned row past the last one untouched."""
    import cupy
    import ml_dtypes

    from cupaged.specs.geometry import CACHE_THREADS

    n = 333
    rows = reference.quantize_sparse_kv(testing.random_normal((n, D), np.float32, rng),
                                        "fp8_ds_mla")
    rows[:256, :512] = np.arange(256, dtype=np.uint8)[:, None] ^ rows[:256, :512] % 7
    scales = rows[:, 512:528].view("<f4")
    scales[::5, 0] = 1.7e-40  # a subnormal scale
    scales[7, 3] = np.nan
    scales[9, 1] = 3.0e38 / 448
    big = np.full((n, 672), 0xFF, np.uint8)
    big[:, :DS] = rows
    dev = cupy.asarray(big)[:, :DS]
    bf16 = _dtypes.BF16.numpy
    out = cupy.full((n + 1, D), np.nan, bf16)
    w = planning.sparse_widening(dev.device.id, "bf16", "dsmla", n, planning.WIDEN_ONCE_FACTOR * n)
    w.kernel(w.grid, CACHE_THREADS, 0, cupy.cuda.get_current_stream().ptr, dev.data.ptr, 672,
             out.data.ptr, D, n)
    got = cupy.asnumpy(out).view(np.uint16)
    e4m3 = rows[:, :512].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = np.empty((n, D), np.uint16)
    want[:, :512] = (e4m3 * np.repeat(scales, 128, 1)).astype(bf16).view(np.uint16)
    want[:, 512:] = rows[:, 528:].copy().view(np.uint16)
    nan = np.isnan(got[:n].view(bf16).astype(np.float32))
    assert np.array_equal(nan, np.isnan(want.view(bf16).astype(np.float32)))
    assert np.array_equal(got[:n][~nan], want[~nan])
    assert np.isnan(got[n].view(bf16).astype(np.float32)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("family", [None, "mma", "sm90"])
@pytest.mark.parametrize("heads, padded", [(16, False), (64, True), (128, False), (20, True)])
def test_fp8_ds_mla_prefill_through_widened_rows(rng, monkeypatch, family, heads, padded):
    """A prefill over fp8_ds_mla rows whose tokens select each cached token many times
    reads them widened once (planning.sparse_widening, checked to be taken): against the
    float64 reference over 0xFF bytes in every unnamed row, -1 and out-of-range indices, a
    repeated index, topk_length and attn_sink, twice (the prepared repeat widens again into
    a fresh scratch), rows 672 bytes apart or 656; bit for bit the same call over a
    bfloat16 cache of the widened keys (the same kernel over the same keys), out and lse
    allocated; the same call below the rule's threshold reads the rows directly."""
    import cupy
    import ml_dtypes

    s_q, topk = 24, 200  # 24 x 200 selections of 768 rows (12 blocks of 64): past 4x
    h = ds_problem(rng, s_q, 1, heads, topk, flashmla_cache=False)
    kv = h["kv_cache"].reshape(-1, 1, DS)
    q = h["q"][:, 0]
    idx = h["indices"][:, 0, None].copy()
    idx[idx == -1] = -7
    idx[1, 0, 3] = kv.shape[0] + 2
    idx[2, 0, 4] = idx[2, 0, 5]
    sink = rng.normal(size=heads).astype(np.float32)
    want, want_lse = reference.sparse_mla_attention(q, kv, idx, scale=SCALE,
                                                    kv_format="fp8_ds_mla",
                                                    topk_length=h["topk_length"],
                                                    attn_sink=sink, return_lse=True)
    taken = []
    real = planning.sparse_widening
    monkeypatch.setattr(planning, "sparse_widening",
                        lambda *a: taken.append(real(*a)) or taken[-1])
    d = {k: cupy.asarray(v) for k, v in dict(q=q, kv=kv, idx=idx, tl=h["topk_length"],
                                               sink=sink).items()}
    if padded:
        big = cupy.full((kv.shape[0], 1, 672), 0xFF, np.uint8)
        big[..., :DS] = d["kv"]
        d["kv"] = big[..., :DS]

    def call():
        out = cupy.full((s_q, heads, 512), np.nan, q.dtype)
        lse = cupy.full((s_q, heads), np.nan, np.float32)
        cupaged.sparse_mla_attention(d["q"], d["kv"], d["idx"], scale=SCALE,
                                     topk_length=d["tl"], attn_sink=d["sink"], out=out,
                                     lse=lse)
        return cupy.asnumpy(out).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)

    with kernel_family(family):
        for threshold, widened in ((planning.WIDEN_ONCE_FACTOR, True), (10 ** 6, False)):
            monkeypatch.setattr(planning, "WIDEN_ONCE_FACTOR", threshold)
            _prepared.clear()
            for repeat in range(2):
                got, lse = call()
                assert (taken[-1] is not None) == widened, (threshold, repeat)
                what = f"{'widened' if widened else 'direct'} {repeat}"
                assert_close(got, want, testing.TOLERANCE["bf16"], what)
                check_lse(lse, want_lse, what)
            assert len(taken) == (1 if widened else 2)  # the repeat is the prepared call
        # the widened keys as a bfloat16 cache: the same kernel over the same keys
        rows = kv[:, 0]
        e4m3 = rows[:, :512].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        scales = np.repeat(rows[:, 512:528].copy().view("<f4"), 128, 1)
        keys = np.concatenate([(e4m3 * scales).astype(_dtypes.BF16.numpy),
                               rows[:, 528:].copy().view(_dtypes.BF16.numpy)], 1)[:, None]
        monkeypatch.setattr(planning, "WIDEN_ONCE_FACTOR", 4)
        kw = dict(scale=SCALE, topk_length=d["tl"], attn_sink=d["sink"], return_lse=True)
        got, got_lse = cupaged.sparse_mla_attention(d["q"], d["kv"], d["idx"], **kw)
        assert taken[-1] is not None
        same, same_lse = cupaged.sparse_mla_attention(d["q"], cupy.asarray(keys), d["idx"],
                                                      **kw)
        assert np.array_equal(cupy.asnumpy(got).view(np.uint16),
                              cupy.asnumpy(same).view(np.uint16))
        assert np.array_equal(cupy.asnumpy(got_lse), cupy.asnumpy(same_lse))


@pytest.mark.gpu
def test_fp8_ds_mla_prefill_over_one_row(rng):
    """s_kv 1 (the rule's smallest cache: any call of 4 selections widens it): every entry
    that counts names row 0, the others -1 or 1; against the reference."""
    import cupy

    heads, s_q, topk = 64, 3, 4
    clean = testing.random_normal((1, D), np.float32, rng)
    kv = reference.quantize_sparse_kv(clean, "fp8_ds_mla")[:, None]
    q = testing.random_normal((s_q, heads, D), _dtypes.BF16.numpy, rng)
    idx = np.array([[[0, 0, -1, 1]], [[1, -1, -1, -1]], [[0, 0, 0, 0]]], np.int32)
    want, want_lse = reference.sparse_mla_attention(q, kv, idx, scale=SCALE,
                                                    kv_format="fp8_ds_mla", return_lse=True)
    out, lse = cupaged.sparse_mla_attention(cupy.asarray(q), cupy.asarray(kv),
                                            cupy.asarray(idx), scale=SCALE, return_lse=True)
    assert_close(cupy.asnumpy(out).astype(np.float64), want, testing.TOLERANCE["bf16"])
    check_lse(cupy.asnumpy(lse).astype(np.float64), want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", *V4_FORMATS])
def test_rows_written_by_concat_and_cache_mla(rng, fmt):
    """The rows cupaged's writer lays down are what the sparse kernel reads: tokens written
    at scattered slots of a cache of 0xFF bytes (kv_c and k_pe: fp8_ds_mla's 512 and 64,
    V4's split of its 512 values as 448 and 64), then attended through their slots (the
    format found by its width), equal the reference over the reference writer's rows."""
    import cupy

    bf16 = _dtypes.BF16.numpy
    blocks, page, n_tok, heads, topk = 6, 64, 200, 32, 150
    w, d = ROW_BYTES[fmt], reference.SPARSE_KV_FORMATS[fmt][1]
    kv_c = testing.random_normal((n_tok, d - 64), bf16, rng)
    k_pe = testing.random_normal((n_tok, 64), bf16, rng)
    slots = rng.permutation(blocks * page)[:n_tok].astype(np.int64)
    cache = cupy.full((blocks, page, w), 0xFF, np.uint8)
    cupaged.concat_and_cache_mla(cupy.asarray(kv_c), cupy.asarray(k_pe), cache,
                                 cupy.asarray(slots), fmt)
    ref_cache = np.full((blocks * page, w), 0xFF, np.uint8)
    ref_cache[slots] = reference.quantize_sparse_kv(
        np.concatenate([kv_c, k_pe], -1).astype(np.float32), fmt)
    assert (cupy.asnumpy(cache).reshape(-1, w) == ref_cache).all()
    q = testing.random_normal((2, 2, heads, d), bf16, rng)
    idx = slots[rng.integers(0, n_tok, (2, 2, topk))].astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    out = cupaged.sparse_mla_attention(cupy.asarray(q), cache, cupy.asarray(idx), scale=SCALE)
    want = reference.sparse_mla_attention(q, ref_cache.reshape(blocks, page, w), idx,
                                          scale=SCALE, kv_format=fmt)
    assert_close(cupy.asnumpy(out).astype(np.float64), want, testing.TOLERANCE["bf16"], fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla", *V4_FORMATS])
@pytest.mark.parametrize("split", [0, 2])
def test_attn_sink(rng, fmt, split):
    """FlashMLA's attn_sink: out scaled by exp(lse) / (exp(lse) + exp(sink)), the lse the
    keys' alone; heads with a sink of +inf give zeros, -inf nothing changed; a row with no
    counted entry stays zeros and -inf. Single pass and split (the combine applies it)."""
    import cupy

    h = problem(fmt, rng, 3, 2, 64, 200, topk_length=[200, 150, 0])
    h["indices"][1, 1] = -1
    sink = (rng.standard_normal(64) * 3 + 2).astype(np.float32)
    sink[0], sink[1] = np.inf, -np.inf
    planning.set_mla_split(split)
    try:
        got, lse = run(h, attn_sink=cupy.asarray(sink))
    finally:
        planning.set_mla_split(None)
    want, want_lse = reference_of(h, sink=sink)
    assert_close(got, want, testing.TOLERANCE["bf16"], f"{fmt} split {split}")
    check_lse(lse, want_lse)
    assert (got[..., 0, :] == 0).all() and (got[2] == 0).all() and (got[1, 1] == 0).all()
    assert np.isneginf(lse[2]).all() and np.isneginf(lse[1, 1]).all()
    plain, plain_lse = reference_of(h)
    assert_close(got[..., 1, :], plain[..., 1, :], testing.TOLERANCE["bf16"], "sink -inf")
    check_lse(lse, plain_lse)  # the keys' lse, sink or not



@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mma", "sm90"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla", *V4_FORMATS])
@pytest.mark.parametrize("heads, split, sink", [(64, None, False), (128, 2, True),
                                                (16, None, True), (100, 0, False)])
def test_both_kernel_families(rng, family, fmt, heads, split, sink):
    """The wgmma kernel (Hopper, 64 heads or more by the planner's rule; forced for 16, whose
    rows it pads) and the mma.sync one, on the same problems over the caches (fp8_ds_mla:
    one raw stage on wgmma, 41 chunks a row over 4 copying threads; V4's rows: two raw
    stages, 33 or 18 chunks a row): partial row tiles (100 heads), split and not,
    sinks, NaN in every unnamed slot, topk not a multiple of the 64-token tile."""
    import cupy

    h = problem(fmt, rng, 3, 2, heads, 150, page=16)
    s = (rng.standard_normal(heads) * 2).astype(np.float32) if sink else None
    planning.set_mla_split(split)
    try:
        with kernel_family(family):
            got, lse = run(h, attn_sink=None if s is None else cupy.asarray(s))
    finally:
        planning.set_mla_split(None)
    want, want_lse = reference_of(h, sink=s)
    assert_close(got, want, testing.TOLERANCE["bf16"], f"{family} {heads} heads")
    check_lse(lse, want_lse)


def test_out_and_lse_must_not_overlap_what_the_kernel_reads(adapt, monkeypatch):
    """Checked with the plan (nothing launched here): out or lse over the indices,
    topk_length or attn_sink (which the epilogue reads while other CTAs write out)."""
    import contextlib

    from test_validation import Fake

    monkeypatch.setattr(_arrays, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(planning, "plan_mla", lambda *a, **k: None)
    f = fakes(topk_length=np.zeros(2, np.int32), out=np.zeros((2, 3, 16, 512), np.float16),
              lse=np.zeros((2, 3, 16), np.float32))
    sink = Fake(np.zeros(16, np.float32), ptr=1 << 30)

    def prepare(**over):
        g = dict(f, **over)
        return sparse_mla.validate_and_prepare(g["q"], g["kv_cache"], g["indices"], 0.1,
                                               g["topk_length"], g["out"], g["lse"], False,
                                               None, None, attn_sink=g.get("sink", sink))
    prep, ptrs = prepare()
    assert prep.launch is None and len(ptrs) == 10 and ptrs[6] == 1 << 30 and ptrs[7:] == [0] * 3
    for name, at in (("lse", 1 << 30), ("out", (1 << 30) - 64), ("lse", f["indices"].data.ptr),
                     ("out", f["topk_length"].data.ptr)):
        moved = Fake(np.zeros(f[name].shape, f[name].dtype), ptr=at)
        with pytest.raises(ValueError, match="out and lse must not overlap q, kv_cache, "
                                             "indices, topk_length, attn_sink, the extra_ "
                                             "arrays or each other"):
            prepare(**{name: moved})
    # the second cache's arrays too
    e = dict(extra_kv_cache=Fake(np.zeros((4, 16, 1, D), np.float16), ptr=1 << 31),
             extra_indices=Fake(np.zeros((2, 3, 8), np.int32), ptr=(1 << 31) + (1 << 24)),
             extra_topk_length=Fake(np.zeros(2, np.int32), ptr=(1 << 31) + (1 << 25)))

    def prepare_two(**over):
        g = dict(f, **e, **over)
        return sparse_mla.validate_and_prepare(
            g["q"], g["kv_cache"], g["indices"], 0.1, g["topk_length"], g["out"], g["lse"],
            False, None, None, attn_sink=sink,
            extra=(g["extra_kv_cache"], g["extra_indices"], g["extra_topk_length"]))
    prep, ptrs = prepare_two()
    assert ptrs[7:] == [e[k].data.ptr for k in ("extra_kv_cache", "extra_indices",
                                                "extra_topk_length")]
    for name, over in (("extra_kv_cache", "lse"), ("extra_indices", "out"),
                       ("extra_topk_length", "lse")):
        moved = Fake(np.zeros(f[over].shape, f[over].dtype), ptr=e[name].data.ptr)
        with pytest.raises(ValueError, match="out and lse must not overlap"):
            prepare_two(**{over: moved})


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mma", "sm90"])
def test_fp8_ds_mla_widening_is_exact_and_k_pe_in_place(rng, family):
    """One counted entry a row: out is that token's kv_c exactly as the widening states it,
    each e4m3 value times its group's scale in float32, rounded to bfloat16 (a wrong group,
    a scale rounded first, another rounding all differ somewhere). Then q only in its 64
    rotary dims over two entries: the logits are k_pe's alone, so the lse matches the
    reference to float32 rounding (k_pe read from the wrong bytes or placed at the wrong
    dims would not)."""
    import ml_dtypes

    heads, n = 64, 12 * 64
    h = ds_problem(rng, 2, 2, heads, 8, topk_length=[1, 2])
    h["indices"][h["indices"] < 0] = 3  # every entry a valid slot
    rows = h["kv_cache"].reshape(n, DS)
    for b, s in np.ndindex(2, 2):  # the counted slots hold real rows (not 0xFF)
        for j in range(2):
            if rows[h["indices"][b, s, j], 0] == 0xFF and rows[h["indices"][b, s, j], 512] == 0xFF:
                h["indices"][b, s, j] = h["indices"][0, 0, 0]
    h["q"][1, :, :, :512] = 0  # batch entry 1: the rotary dims alone
    planning.set_mla_split(0)
    try:
        with kernel_family(family):
            got, lse = run(h)
    finally:
        planning.set_mla_split(None)
    e4m3 = rows[:, :512].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = np.repeat(rows[:, 512:528].copy().view("<f4"), 128, 1)
    widened = (e4m3 * scale).astype(_dtypes.BF16.numpy).astype(np.float64)  # float32 product
    for s in range(2):
        want = widened[h["indices"][0, s, 0]]
        assert np.array_equal(got[0, s], np.broadcast_to(want, (heads, 512))), s
    _, want_lse = reference_of(h)
    assert np.allclose(lse[1], want_lse[1], rtol=1e-5, atol=1e-5)


# ---- GPU: DeepSeek-V4's v4_fp8 and v4_fp4 caches (512-dim keys and values) -------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", V4_FORMATS)
@pytest.mark.parametrize("heads, s_q, topk, page, pad", [
    (16, 1, 100, 64, 0), (16, 2, 1, 32, 0), (64, 2, 37, 16, 8), (64, 1, 2048, 64, 0),
    (128, 2, 256, 64, 0), (128, 1, 2047, 64, 16), (20, 2, 70, 64, 16), (40, 1, 33, 1, 0)])
@pytest.mark.parametrize("with_length", [True, False])
def test_v4_decode_matches_reference(rng, fmt, heads, s_q, topk, page, pad, with_length):
    """V4's rows (groups of 32 values 2^-6 to 1 in size) widened with their own scales: the
    reference reads them exactly, and the widening is exact for them. 16, 64 and 128 heads
    (the planner's three row tiles) and partial ones (20, 40), one and two query tokens, topk
    from 1 to 2048 (1, 37, 2047: no multiple of a tile), a padded cache, pages of one
    token; -1 entries, a repeated index, topk_length; stale NaN and (v4_fp8) +-inf rows in
    every slot no counted entry names; out and lse poisoned."""
    blocks = max(12, topk // page + 2)  # (2048 entries over as many distinct slots)
    h = v4_problem(rng, fmt, 3, s_q, heads, topk, page=page, blocks=blocks,
                   topk_length=None if with_length else topk)
    got, lse = run(h, with_length, pad=pad)
    want, want_lse = reference_of(h, with_length)
    assert_close(got, want, testing.TOLERANCE["bf16"], f"{fmt} {heads} heads topk {topk}")
    check_lse(lse, want_lse, fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mma", "sm90"])
@pytest.mark.parametrize("fmt", V4_FORMATS)
def test_v4_widening_is_exact(rng, fmt, family):
    """One counted entry a row and q zero (every logit 0, the entry's weight 1): out is that
    token's 512 values exactly as the widening states them, dequantize_sparse_kv's value
    (exact in float32) rounded once to bfloat16, at every dim (a unit at the wrong dims, a
    wrong scale byte, a scale rounded first all differ somewhere). Rows of random bytes:
    v4_fp8 scale bytes 10 to 246 (every product a normal bfloat16 and finite) and rows
    under 2^127 whose e4m3 values are below 2 (the largest finite products), no NaN byte;
    v4_fp4 every code and scale bytes of both signs but NaN. The lse is 0 (one weight
    of 1). Both kernels (wgmma on Hopper only)."""
    heads, blocks, page = 64, 4, 64
    n, w = blocks * page, ROW_BYTES[fmt]
    rows = rng.integers(0, 256, (n, w)).astype(np.uint8)
    if fmt == "v4_fp8":
        vals = rows[:, :512]
        vals[(vals & 0x7F) == 0x7F] ^= 1  # no NaN: 0x7F / 0xFF -> 0x7E / 0xFE
        rows[:, 512:] = rng.integers(10, 247, (n, 16))
        top = np.arange(0, n, 7)  # the largest scale, values under 2
        rows[top, 512:] = 254
        rows[top, :512] &= 0xBF
    else:
        sc = rows[:, 256:]
        sc[(sc & 0x7F) == 0x7F] ^= 1
    h = dict(q=np.zeros((2, 2, heads, D_V4), _dtypes.BF16.numpy),
             kv_cache=rows.reshape(blocks, page, 1, w),
             indices=rng.integers(0, n, (2, 2, 8)).astype(np.int32),
             topk_length=np.array([1, 1], np.int32))
    h["indices"][1, 1, 0] = top[3] if fmt == "v4_fp8" else 0
    with kernel_family(family):
        got, lse = run(h)
    widened = reference.dequantize_sparse_kv(rows, fmt).astype(np.float32)
    widened = widened.astype(_dtypes.BF16.numpy).astype(np.float64)
    assert np.isfinite(widened).all()
    for b, s in np.ndindex(2, 2):
        want = widened[h["indices"][b, s, 0]]
        assert np.array_equal(got[b, s], np.broadcast_to(want, (heads, 512))), (b, s)
    assert np.allclose(lse, 0, rtol=0, atol=1e-6)  # log(1), through the kernel's log2
