"""reshape_and_cache, copy_blocks and swap_blocks on the GPU against NumPy, over every cache
layout (vLLM's, NHD, HND, views of fused allocations), and an end-to-end decode loop
through PagedKVCache against the float64 reference; their input checks on array metadata
alone (no GPU needed)."""

import contextlib
import inspect
import re

import cupy
import numpy as np
import pytest

import cupaged
from cupaged import PagedKVCache, _arrays, _dtypes, cache_ops, reference, testing
from conftest import assert_close, on_cuda
from test_validation import Fake

gpu = pytest.mark.gpu

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), _dtypes.BF16.numpy]
LAYOUTS = ("vllm", "NHD", "HND")
# How K and V sit in memory, per layout. "dense": two arrays. "heads": vLLM's layout as a
# slice of more heads (block and head strides larger than dense). "fused": the halves of
# one [num_blocks, 2, ...] allocation (FlashInfer's). "packed": the halves of the last
# dimension of one [..., 2 * head_size] allocation (vLLM's packed rows).
CACHE_KINDS = {"vllm": ("dense", "heads"), "NHD": ("dense", "fused", "packed"),
               "HND": ("dense", "fused", "packed")}
# Where key and value come from. "contiguous": two arrays. "qkv": head ranges of one fused
# [num_tokens, heads + 2 * kv_heads, head_size] projection (row-strided, 16-byte aligned
# rows: vector loads). "unaligned": the same with every head row padded by one element and
# starting one element in (no row 16-byte aligned: element loads).
SOURCES = ("contiguous", "qkv", "unaligned")


def _ids(d):
    return np.dtype(d).name


def block_shape(layout, num_kv_heads, head_size, block_size, dtype, key=True):
    """One block of a cache in ``layout`` (the shape past num_blocks)."""
    x = 16 // np.dtype(dtype).itemsize
    if layout == "NHD":
        return (block_size, num_kv_heads, head_size)
    if layout == "HND":
        return (num_kv_heads, block_size, head_size)
    return ((num_kv_heads, head_size // x, block_size, x) if key
            else (num_kv_heads, head_size, block_size))


def make_cache(layout, kind, num_blocks, num_kv_heads, head_size, block_size, dtype, rng):
    """Host roots with random contents (what every element no write touches must keep),
    and ``view``: roots (NumPy, CuPy or torch, basic slicing only) -> (key_cache,
    value_cache)."""
    kb = block_shape(layout, num_kv_heads, head_size, block_size, dtype, True)
    vb = block_shape(layout, num_kv_heads, head_size, block_size, dtype, False)
    rand = lambda *shape: testing.random_normal(shape, dtype, rng)  # noqa: E731
    if kind == "dense":
        return [rand(num_blocks, *kb), rand(num_blocks, *vb)], lambda r: (r[0], r[1])
    if kind == "heads":
        roots = [rand(num_blocks, num_kv_heads + 1, *kb[1:]),
                 rand(num_blocks, num_kv_heads + 2, *vb[1:])]
        return roots, lambda r: (r[0][:, 1:], r[1][:, 2:])
    if kind == "fused":
        return [rand(num_blocks, 2, *kb)], lambda r: (r[0][:, 0], r[0][:, 1])
    if kind == "packed":
        hs = head_size
        return [rand(num_blocks, *kb[:-1], 2 * hs)], lambda r: (r[0][..., :hs], r[0][..., hs:])
    raise ValueError(kind)


def make_source(kind, num_tokens, heads, num_kv_heads, head_size, dtype, rng):
    """Host roots and ``view``: roots -> (key, value) ``[num_tokens, num_kv_heads,
    head_size]``."""
    rand = lambda *shape: testing.random_normal(shape, dtype, rng)  # noqa: E731
    n, h, kvh, hs = num_tokens, heads, num_kv_heads, head_size
    if kind == "contiguous":
        return [rand(n, kvh, hs), rand(n, kvh, hs)], lambda r: (r[0], r[1])
    if kind == "qkv":
        return [rand(n, h + 2 * kvh, hs)], lambda r: (r[0][:, h:h + kvh], r[0][:, h + kvh:])
    if kind == "unaligned":
        return ([rand(n, h + 2 * kvh, hs + 1)],
                lambda r: (r[0][:, h:h + kvh, 1:], r[0][:, h + kvh:, 1:]))
    raise ValueError(kind)


def write_reference(kc, vc, key, value, slots, layout):
    """NumPy, in place through the cache views: what reshape_and_cache must write."""
    if layout == "vllm":  # as [blocks, slot, kv_heads, ...] views
        kt, vt = kc.transpose(0, 3, 1, 2, 4), vc.transpose(0, 3, 1, 2)
        x = kc.shape[4]
        kval = lambda t: key[t].reshape(key.shape[1], -1, x)  # noqa: E731
    elif layout == "NHD":
        kt, vt, kval = kc, vc, lambda t: key[t]
    else:
        kt, vt, kval = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3), lambda t: key[t]
    num_blocks, block_size = kt.shape[:2]
    for t, slot in enumerate(slots):
        if 0 <= slot < num_blocks * block_size:
            b, off = divmod(int(slot), block_size)
            kt[b, off] = kval(t)
            vt[b, off] = value[t]


def _layout_kw(layout):
    """vLLM's layout through the default, the others by name."""
    return {} if layout == "vllm" else {"kv_layout": layout}


def _assert_same_bytes(got, want, what=""):
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8),
                                  np.ascontiguousarray(want).view(np.uint8), err_msg=what)


# ---- reshape_and_cache on the GPU ------------------------------------------------------------


@gpu
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64], ids=_ids)
@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("hs", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reshape_and_cache_matches_numpy(rng, layout, dtype, hs, bs, slot_dtype):
    """Every layout and kind of cache, from every kind of source: the whole cache (both
    halves of a fused one) compared byte for byte, so every element no token owns must
    still hold its random contents."""
    heads, kvh, n = 4, 2, 24
    nb = max(6, -(-2 * n // bs))  # room for every token, with slots to spare
    for cache_kind in CACHE_KINDS[layout]:
        for src_kind in SOURCES:
            what = f"{cache_kind} cache, {src_kind} source"
            roots, view = make_cache(layout, cache_kind, nb, kvh, hs, bs, dtype, rng)
            src_roots, src_view = make_source(src_kind, n, heads, kvh, hs, dtype, rng)
            slots = rng.choice(nb * bs, size=n, replace=False).astype(slot_dtype)
            slots[rng.random(n) < 0.25] = -1  # padding tokens
            want = [r.copy() for r in roots]
            write_reference(*view(want), *src_view(src_roots), slots, layout)
            d_roots = [cupy.asarray(r) for r in roots]
            d_key, d_value = src_view([cupy.asarray(r) for r in src_roots])
            d_kc, d_vc = view(d_roots)
            d_slots = cupy.asarray(slots)
            w = cache_ops.validate_write(d_key, d_value, d_kc, d_vc, d_slots, layout)
            assert w.vec_src == (src_kind != "unaligned"), what  # both load paths run
            cupaged.reshape_and_cache(d_key, d_value, d_kc, d_vc, d_slots, **_layout_kw(layout))
            for got, exp in zip(d_roots, want):
                _assert_same_bytes(cupy.asnumpy(got), exp, what)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reshape_and_cache_writes_slot_mappings_rows_of_padded_sources(rng, layout):
    """key and value padded past slot_mapping's length (a CUDA graph's batch, with NaN in
    the padding): the first num_tokens rows are written, the padding never read."""
    heads, kvh, hs, bs, n, pad, nb = 4, 2, 64, 16, 10, 6, 4
    roots, view = make_cache(layout, "dense", nb, kvh, hs, bs, np.float16, rng)
    src_roots, src_view = make_source("qkv", n + pad, heads, kvh, hs, np.float16, rng)
    src_roots[0][n:] = np.nan
    slots = rng.choice(nb * bs, size=n, replace=False).astype(np.int64)
    want = [r.copy() for r in roots]
    key, value = src_view(src_roots)
    write_reference(*view(want), key[:n], value[:n], slots, layout)
    d_roots = [cupy.asarray(r) for r in roots]
    d_key, d_value = src_view([cupy.asarray(r) for r in src_roots])
    assert d_key.shape[0] == n + pad
    cupaged.reshape_and_cache(d_key, d_value, *view(d_roots), cupy.asarray(slots),
                              **_layout_kw(layout))
    for got, exp in zip(d_roots, want):
        _assert_same_bytes(cupy.asnumpy(got), exp, layout)


@gpu
@pytest.mark.parametrize("memory", ["NHD", "HND", "packed"])
@pytest.mark.parametrize("kvh, bs", [(2, 16), (16, 16)])
def test_vllm_flash_caches_written_and_read_in_vllms_convention(rng, memory, kvh, bs):
    """A cache as vLLM hands it over (shape [nb, bs, kv_heads, hs] over NHD, HND or packed
    memory, NaN where nothing is written), written by reshape_and_cache_flash and read by
    attention(kv_layout="NHD"), against the float64 reference over a dense NHD copy."""
    heads, hs = 2 * kvh, 64
    lens = np.array([1, 37, 64, 5], np.int32)
    bt, nb = testing.random_block_tables(lens, bs, rng, spare_blocks=2)
    if memory == "NHD":
        roots = [np.full((nb, bs, kvh, hs), np.nan, np.float16) for _ in range(2)]
        view = lambda r: (r[0], r[1])  # noqa: E731
    elif memory == "HND":
        roots = [np.full((nb, kvh, bs, hs), np.nan, np.float16) for _ in range(2)]
        view = lambda r: (r[0].transpose(0, 2, 1, 3), r[1].transpose(0, 2, 1, 3))  # noqa: E731
    else:
        roots = [np.full((nb, kvh, bs, 2 * hs), np.nan, np.float16)]
        view = lambda r: (r[0][..., :hs].transpose(0, 2, 1, 3),  # noqa: E731
                          r[0][..., hs:].transpose(0, 2, 1, 3))
    n = int(lens.sum())
    key = testing.random_normal((n, kvh, hs), np.float16, rng)
    value = testing.random_normal((n, kvh, hs), np.float16, rng)
    pos = np.concatenate([np.arange(x) for x in lens])
    seq = np.repeat(np.arange(len(lens)), lens)
    slots = (bt[seq, pos // bs].astype(np.int64) * bs + pos % bs)
    dense = [np.full((nb, bs, kvh, hs), np.nan, np.float16) for _ in range(2)]
    write_reference(*dense, key, value, slots, "NHD")
    d_roots = [cupy.asarray(r) for r in roots]
    d_kc, d_vc = view(d_roots)
    cupaged.reshape_and_cache_flash(cupy.asarray(key), cupy.asarray(value), d_kc, d_vc,
                                    cupy.asarray(slots), "auto", 1.0, 1.0)
    got_k, got_v = (cupy.asnumpy(c) for c in (d_kc, d_vc))
    want_k, want_v = dense
    written = ~np.isnan(want_k)
    _assert_same_bytes(got_k[written], want_k[written], "K")
    _assert_same_bytes(got_v[written], want_v[written], "V")
    q = testing.random_normal((len(lens), heads, hs), np.float16, rng)
    qsl = np.arange(len(lens) + 1, dtype=np.int32)
    got = cupaged.attention(cupy.asarray(q), d_kc, d_vc, cupy.asarray(bt), cupy.asarray(lens),
                            cupy.asarray(qsl), kv_layout="NHD")
    ref = reference.attention(q, *dense, bt, lens, qsl, kv_layout="NHD")
    assert_close(cupy.asnumpy(got), ref, testing.TOLERANCE["f16"], memory)
    if memory != "NHD":
        with pytest.raises(ValueError, match="kv_layout='HND' takes the shape"):
            cupaged.attention(cupy.asarray(q), d_kc, d_vc, cupy.asarray(bt),
                              cupy.asarray(lens), cupy.asarray(qsl), kv_layout="HND")


def _torch_of(a, torch):
    """A torch CUDA tensor with ``a``'s values (bfloat16 included)."""
    a = np.ascontiguousarray(a)
    if a.dtype == _dtypes.BF16.numpy:
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(a).cuda()


def _torch_bytes(t, torch):
    same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(same_size[t.element_size()]).cpu().numpy().view(np.uint8)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reshape_and_cache_with_torch_tensors(rng, layout, dtype):
    """torch tensors in, views of fused caches and of a fused QKV included."""
    torch = pytest.importorskip("torch")
    heads, kvh, hs, bs, n, nb = 4, 2, 128, 16, 20, 8
    for cache_kind in CACHE_KINDS[layout]:
        for src_kind in SOURCES:
            roots, view = make_cache(layout, cache_kind, nb, kvh, hs, bs, dtype, rng)
            src_roots, src_view = make_source(src_kind, n, heads, kvh, hs, dtype, rng)
            slots = rng.choice(nb * bs, size=n, replace=False).astype(np.int64)
            slots[::5] = -1
            want = [r.copy() for r in roots]
            write_reference(*view(want), *src_view(src_roots), slots, layout)
            t_roots = [_torch_of(r, torch) for r in roots]
            t_key, t_value = src_view([_torch_of(r, torch) for r in src_roots])
            cupaged.reshape_and_cache(t_key, t_value, *view(t_roots), _torch_of(slots, torch),
                                      **_layout_kw(layout))
            for got, exp in zip(t_roots, want):
                _assert_same_bytes(_torch_bytes(got, torch), exp.view(np.uint8),
                                   f"{cache_kind} cache, {src_kind} source")


@gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("layout, kind", [("NHD", "dense"), ("NHD", "fused"), ("HND", "dense"),
                                          ("HND", "packed"), ("vllm", "dense")])
def test_written_cache_reads_back_through_attention(rng, layout, kind, dtype):
    """Prompts written by reshape_and_cache (from a fused QKV, with padding tokens), then
    attended over by cupaged.attention in the same layout; then one decode step more.
    Slots nothing writes are NaN: a missed write shows."""
    dt = _dtypes.BY_NAME[dtype].numpy
    heads, kvh, hs, bs = 8, 2, 128, 16
    lens = np.array([1, 37, 100, 16, 5], np.int32)
    bt, nb = testing.random_block_tables(lens + 1, bs, rng, spare_blocks=3)
    roots, view = make_cache(layout, kind, nb, kvh, hs, bs, dt, rng)
    for r in roots:
        r[...] = np.nan
    want = [r.copy() for r in roots]
    d_roots = [cupy.asarray(r) for r in roots]
    d_kc, d_vc = view(d_roots)
    d_bt = cupy.asarray(bt)

    def slot(s, pos):
        return int(bt[s, pos // bs]) * bs + pos % bs

    # Prefill: every prompt, then 3 padding tokens.
    total = int(lens.sum())
    qkv = testing.random_normal((total + 3, heads + 2 * kvh, hs), dt, rng)
    slots = np.array([slot(s, p) for s, n in enumerate(lens) for p in range(n)] + [-1] * 3,
                     np.int64)
    split = lambda a: (a[:, :heads], a[:, heads:heads + kvh], a[:, heads + kvh:])  # noqa: E731
    d_qkv = cupy.asarray(qkv)
    _, d_key, d_value = split(d_qkv)
    cupaged.reshape_and_cache(d_key, d_value, d_kc, d_vc, cupy.asarray(slots),
                              **_layout_kw(layout))
    _, key, value = split(qkv)
    write_reference(*view(want), key, value, slots, layout)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    out = cupaged.attention(split(d_qkv)[0][:total], d_kc, d_vc, d_bt, cupy.asarray(lens),
                            cupy.asarray(qsl), kv_layout=layout, max_query_len=int(lens.max()))
    ref = reference.attention(split(qkv)[0][:total], *view(want), bt, lens, qsl,
                              kv_layout=layout)
    assert_close(cupy.asnumpy(out).astype(np.float64), ref, testing.TOLERANCE[dtype], "prefill")

    # Decode: one token more per sequence, int32 slots.
    qkv = testing.random_normal((len(lens), heads + 2 * kvh, hs), dt, rng)
    slots = np.array([slot(s, int(n)) for s, n in enumerate(lens)], np.int32)
    d_qkv = cupy.asarray(qkv)
    d_query, d_key, d_value = split(d_qkv)
    cupaged.reshape_and_cache(d_key, d_value, d_kc, d_vc, cupy.asarray(slots),
                              **_layout_kw(layout))
    query, key, value = split(qkv)
    write_reference(*view(want), key, value, slots, layout)
    out = cupaged.attention(d_query, d_kc, d_vc, d_bt, cupy.asarray(lens + 1), kv_layout=layout)
    ref = reference.attention(query, *view(want), bt, lens + 1, kv_layout=layout)
    assert_close(cupy.asnumpy(out).astype(np.float64), ref, testing.TOLERANCE[dtype], "decode")
    for got, exp in zip(d_roots, want):  # and nothing else was written
        _assert_same_bytes(cupy.asnumpy(got), exp)


@gpu
def test_reshape_and_cache_errors(rng):
    kc, vc = (cupy.asarray(a) for a in testing.random_cache(4, 2, 64, 16, np.float16, rng))
    k = cupy.zeros((3, 2, 64), np.float16)
    with pytest.raises(ValueError, match="key has 3 tokens but slot_mapping has 4"):
        cupaged.reshape_and_cache(k, k, kc, vc, cupy.zeros(4, np.int64))
    with pytest.raises(ValueError, match=r"slot_mapping must be a contiguous array of shape \(3,\)"):
        cupaged.reshape_and_cache(k, k, kc, vc, cupy.zeros(6, np.int64)[::2])
    with pytest.raises(TypeError, match="slot_mapping must be int32 or int64, got float32"):
        cupaged.reshape_and_cache(k, k, kc, vc, cupy.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, 2, 64\]"):
        cupaged.reshape_and_cache(k[:, :1], k, kc, vc, cupy.zeros(3, np.int64))
    with pytest.raises(TypeError, match="value dtype float32 does not match"):
        cupaged.reshape_and_cache(k, k.astype(np.float32), kc, vc, cupy.zeros(3, np.int64))
    with pytest.raises(TypeError, match="slot_mapping is a NumPy array"):
        cupaged.reshape_and_cache(k, k, kc, vc, np.zeros(3, np.int64))


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_range_slots_are_skipped_or_reported(rng, monkeypatch, layout):
    roots, view = make_cache(layout, "dense", 2, 1, 32, 4, np.float32, rng)
    d_roots = [cupy.asarray(r) for r in roots]
    kc, vc = view(d_roots)
    k = cupy.ones((3, 1, 32), np.float32)
    slots = cupy.asarray([8, 2**40, -5], np.int64)  # the cache has 8 slots
    cupaged.reshape_and_cache(k, k, kc, vc, slots, **_layout_kw(layout))
    for got, before in zip(d_roots, roots):
        _assert_same_bytes(cupy.asnumpy(got), before)
    monkeypatch.setattr(cupaged._checks, "DEBUG", True)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 8 is past the cache \(8 slots\)"):
        cupaged.reshape_and_cache(k, k, kc, vc, slots, **_layout_kw(layout))


@gpu
@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_copy_blocks_all_layers_one_launch(rng, index):
    layers, nb = 3, 16
    caches = [testing.random_cache(nb, 2, 64, 8, np.float16, rng) for _ in range(layers)]
    src = rng.choice(8, size=5, replace=False)
    dst = rng.choice(np.arange(8, 16), size=5, replace=False)
    mapping = np.stack([src, dst], 1).astype(index)
    ks = [cupy.asarray(k) for k, _ in caches]
    vs = [cupy.asarray(v) for _, v in caches]
    cupaged.copy_blocks(ks, vs, cupy.asarray(mapping))
    for (k, v), dk, dv in zip(caches, ks, vs):
        k, v = k.copy(), v.copy()
        k[dst], v[dst] = k[src], v[src]
        np.testing.assert_array_equal(cupy.asnumpy(dk), k)
        np.testing.assert_array_equal(cupy.asnumpy(dv), v)


@gpu
def test_copy_blocks_errors(rng):
    k, v = (cupy.asarray(a) for a in testing.random_cache(4, 2, 64, 8, np.float16, rng))
    with pytest.raises(ValueError, match="lists of one length"):
        cupaged.copy_blocks([k, k], [v], cupy.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match=r"block_mapping must be \[num_pairs, 2\]"):
        cupaged.copy_blocks([k], [v], cupy.zeros((3,), np.int64))
    k2, v2 = (cupy.asarray(a) for a in testing.random_cache(5, 2, 64, 8, np.float16, rng))
    with pytest.raises(ValueError, match=r"key_caches\[1\] .* differs from key_caches\[0\]"):
        cupaged.copy_blocks([k, k2], [v, v2], cupy.zeros((1, 2), np.int64))


@gpu
@pytest.mark.parametrize("layout, kind", [("NHD", "dense"), ("NHD", "fused"), ("HND", "dense"),
                                          ("HND", "fused"), ("vllm", "heads")])
def test_copy_blocks_on_every_layout_and_fused_views(rng, layout, kind):
    """NHD/HND caches and K/V halves of one [num_blocks, 2, ...] allocation (block stride
    twice the block), or vLLM's layout sliced by heads: each half copies its own blocks and
    leaves everything else as it was."""
    layers, nb = 2, 16
    caches = [make_cache(layout, kind, nb, 2, 64, 8, np.float16, rng) for _ in range(layers)]
    src = rng.choice(8, size=5, replace=False)
    dst = rng.choice(np.arange(8, 16), size=5, replace=False)
    d_roots = [[cupy.asarray(r) for r in roots] for roots, _ in caches]
    views = [view(d) for d, (_, view) in zip(d_roots, caches)]
    cupaged.copy_blocks([k for k, _ in views], [v for _, v in views],
                        cupy.asarray(np.stack([src, dst], 1).astype(np.int32)))
    for (roots, view), d in zip(caches, d_roots):
        want = [r.copy() for r in roots]
        for half in view(want):  # NumPy views write through to the roots
            half[dst] = half[src]
        for got, exp in zip(d, want):
            _assert_same_bytes(cupy.asnumpy(got), exp, f"{layout} {kind}")


@gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_swap_blocks_with_fused_views(rng, layout):
    """The V half of a fused device cache out to the V half of a fused pinned host cache,
    then back into the K half of another device cache: only those halves change."""
    nb_dev, nb_host, dtype = 12, 10, np.dtype(np.float16)
    roots, view = make_cache(layout, "fused", nb_dev, 2, 64, 16, dtype, rng)
    d_root = cupy.asarray(roots[0])
    _, d_v = view([d_root])
    host = cupaged.empty_pinned((nb_host,) + roots[0].shape[1:], dtype)
    host[...] = testing.random_normal(host.shape, dtype, rng)
    before = host.copy()
    out_src = rng.choice(nb_dev, size=4, replace=False)
    out_dst = rng.choice(nb_host, size=4, replace=False)
    cupaged.swap_blocks(d_v, view([host])[1], np.stack([out_src, out_dst], 1))
    cupy.cuda.get_current_stream().synchronize()
    want = before.copy()
    want[out_dst, 1] = roots[0][out_src, 1]
    _assert_same_bytes(host, want, "swap out")
    d_other = cupy.zeros_like(d_root)
    back = rng.choice(nb_dev, size=4, replace=False)
    cupaged.swap_blocks(view([host])[1], view([d_other])[0],
                        cupy.asarray(np.stack([out_dst, back], 1)))
    want = np.zeros_like(roots[0])
    want[back, 0] = roots[0][out_src, 1]
    _assert_same_bytes(cupy.asnumpy(d_other), want, "swap in")


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_swap_round_trip_through_pinned_memory(rng, dtype):
    nb_dev, nb_host = 32, 20
    kc, _ = testing.random_cache(nb_dev, 2, 128, 16, dtype, rng)
    dev = cupy.asarray(kc)
    host = cupaged.empty_pinned((nb_host,) + kc.shape[1:], dtype)
    host[...] = testing.random_normal(host.shape, dtype, rng)
    out_src = rng.choice(nb_dev, size=9, replace=False)
    out_dst = rng.choice(nb_host, size=9, replace=False)
    cupaged.swap_blocks(dev, host, np.stack([out_src, out_dst], 1))  # host-side mapping
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(host[out_dst].view(np.uint8), kc[out_src].view(np.uint8))
    back = rng.choice(nb_dev, size=9, replace=False)
    mapping = cupy.asarray(np.stack([out_dst, back], 1).astype(np.int32))  # device-side mapping
    dev2 = cupy.zeros_like(dev)
    cupaged.swap_blocks(host, dev2, mapping)
    got = cupy.asnumpy(dev2)
    np.testing.assert_array_equal(got[back].view(np.uint8), kc[out_src].view(np.uint8))
    untouched = np.setdiff1d(np.arange(nb_dev), back)
    assert not got[untouched].view(np.uint8).any()


@gpu
@pytest.mark.parametrize("host_kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_swap_with_pageable_host_memory_has_finished_when_it_returns(rng, host_kind, dtype):
    """vLLM passes plain (pageable) CPU tensors to swap_blocks and has the copy done when
    the call returns. A busy-wait of 100 ms queued ahead of each call shows it: the host
    reads the swapped-out blocks at once, and overwrites the swapped-in source at once."""
    from cupaged.bench.timing import Spin

    nb_dev, nb_host = 16, 12
    kc, _ = testing.random_cache(nb_dev, 2, 64, 16, dtype, rng)
    dev = cupy.asarray(kc)
    host = testing.random_normal((nb_host,) + kc.shape[1:], dtype, rng)
    before = host.copy()
    if host_kind == "torch":
        torch = pytest.importorskip("torch")
        host_arg = torch.from_numpy(host.view(np.int16) if dtype == _dtypes.BF16.numpy
                                    else host)  # shares the NumPy array's memory
        if dtype == _dtypes.BF16.numpy:
            host_arg = host_arg.view(torch.bfloat16)
            dev_arg = torch.as_tensor(dev.view(np.int16), device="cuda").view(torch.bfloat16)
        else:
            dev_arg = torch.as_tensor(dev, device="cuda")
    else:
        host_arg, dev_arg = host, dev
    spin = Spin(100_000)
    out_src = rng.choice(nb_dev, size=5, replace=False)
    out_dst = rng.choice(nb_host, size=5, replace=False)
    spin()
    cupaged.swap_blocks(dev_arg, host_arg, np.stack([out_src, out_dst], 1))
    want = before.copy()
    want[out_dst] = kc[out_src]
    _assert_same_bytes(host, want, "swap out")
    back = rng.choice(nb_dev, size=5, replace=False)
    dev2 = cupy.zeros_like(dev)
    dev2_arg = dev2 if host_kind == "numpy" else (
        torch.as_tensor(dev2.view(np.int16), device="cuda").view(torch.bfloat16)
        if dtype == _dtypes.BF16.numpy else torch.as_tensor(dev2, device="cuda"))
    spin()
    cupaged.swap_blocks(host_arg, dev2_arg, cupy.asarray(np.stack([out_dst, back], 1)))
    sent = host[out_dst].copy()
    host[...] = np.nan  # the source may be reused as soon as the call returns
    got = cupy.asnumpy(dev2)
    _assert_same_bytes(got[back], sent, "swap in")
    untouched = np.setdiff1d(np.arange(nb_dev), back)
    assert not got[untouched].view(np.uint8).any()


@gpu
def test_swap_with_pageable_memory_checks_its_block_ids_and_writeability():
    dev = cupy.zeros((4, 2, 8, 16, 8), np.float16)
    host = np.zeros((3, 2, 8, 16, 8), np.float16)
    for bad, side in (([[0, 3]], "destination block 3"), ([[-1, 0]], "source block -1"),
                      ([[4, 0]], "source block 4")):
        with pytest.raises(ValueError, match=rf"block_mapping\[0\] has {side}, outside"):
            cupaged.swap_blocks(dev, host, bad)
    with pytest.raises(ValueError, match=r"destination block -2, outside \[0, 4\)"):
        cupaged.swap_blocks(host, dev, np.array([[0, -2]]))
    host.flags.writeable = False
    with pytest.raises(ValueError, match="dst is a read-only NumPy array"):
        cupaged.swap_blocks(dev, host, [[0, 1]])
    with pytest.raises(ValueError, match="same dtype and block shape"):
        cupaged.swap_blocks(dev, cupaged.empty_pinned((4, 2, 8, 8, 8), np.float16), [[0, 1]])


@gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16)], ids=lambda d: d.name)
def test_decode_loop_with_forks_and_frees(rng, dtype):
    """Dozens of steps over many sequences: prompts, forks (copy-on-write), frees; every
    step writes random K/V through reshape_and_cache and checks paged_attention against
    the float64 reference over each sequence's dense history, layer by layer."""
    layers, kvh, heads, hs, bs = 2, 2, 4, 64, 4
    # Room for any walk: at most 5 + 30 sequences, each at most 17 + 30 tokens (12 blocks).
    # (96 blocks ran out in about 0.06% of seeds: OutOfBlocks, not a kernel error.)
    cache = PagedKVCache(layers, 35 * 12, kvh, hs, bs, dtype)
    history = {}  # seq -> [layer] -> (K list, V list) of float arrays [kvh, hs]
    next_id = [0]

    def write(seq_ids, slots, n_per_seq):
        """Random K/V for the given tokens, through the kernel and into the history."""
        total = sum(n_per_seq)
        for layer in range(layers):
            k = testing.random_normal((total, kvh, hs), dtype, rng)
            v = testing.random_normal((total, kvh, hs), dtype, rng)
            cupaged.reshape_and_cache(cupy.asarray(k), cupy.asarray(v), cache.key_caches[layer],
                                      cache.value_caches[layer], slots)
            at = 0
            for s, n in zip(seq_ids, n_per_seq):
                history[s][layer][0].extend(k[at:at + n].astype(np.float64))
                history[s][layer][1].extend(v[at:at + n].astype(np.float64))
                at += n

    def add(n):
        s = next_id[0] = next_id[0] + 1
        history[s] = [([], []) for _ in range(layers)]
        write([s], cache.add(s, n), [n])

    for n in (1, 3, 4, 5, 17):
        add(n)
    checked = 0
    for step in range(30):
        live = sorted(history)
        r = rng.random()
        if r < 0.25 and len(live) < 10:
            parent = int(rng.choice(live))
            child = next_id[0] = next_id[0] + 1
            cache.fork(parent, child)
            history[child] = [(list(k), list(v)) for k, v in history[parent]]
        elif r < 0.35 and len(live) > 3:
            victim = int(rng.choice(live))
            cache.free(victim)
            del history[victim]
        elif r < 0.45:
            add(int(rng.integers(1, 12)))
        seqs = sorted(history)
        d = cache.step(seqs)
        write(seqs, d.slot_mapping, [1] * len(seqs))
        for layer in range(layers):
            q = testing.random_normal((len(seqs), heads, hs), dtype, rng)
            out = cupy.full((len(seqs), heads, hs), float("nan"), dtype)
            cupaged.paged_attention(cupy.asarray(q), cache.key_caches[layer],
                                    cache.value_caches[layer], d.block_tables, d.context_lens,
                                    out=out, partition="always" if step % 2 else "never")
            got = cupy.asnumpy(out)
            for i, s in enumerate(seqs):
                k = np.array(history[s][layer][0])
                v = np.array(history[s][layer][1])
                ref = reference.attend(q[i], k, v, 1 / np.sqrt(hs))
                assert_close(got[i], ref, testing.TOLERANCE[_dtypes.lookup(dtype).name], (step, s))
                checked += 1
        cache.manager.check()
    for s in list(history):
        cache.free(s)
    # At least 3 live sequences in each of the 30 steps (frees leave 3): every row checked.
    assert cache.num_used_blocks == 0 and checked >= 30 * layers * 3


@gpu
def test_accounting():
    cache = PagedKVCache(4, 10, 2, 64, 16, "bfloat16")
    assert cache.bytes_per_block == 2 * 4 * 2 * 64 * 16 * 2
    cache.add("a", 40)
    assert cache.num_used_blocks == 3 and cache.num_free_blocks == 7
    assert cache.bytes_in_use == 3 * cache.bytes_per_block
    bt, cl = cache.tables(["a"])
    assert cl.tolist() == [40] and bt.shape == (1, 3)


# ---- block copies: layers, strides, views ---------------------------------------------------------


def _layers(rng, n, nb=8, dtype=np.float16):
    caches = [testing.random_cache(nb, 2, 64, 8, dtype, rng) for _ in range(n)]
    return [cupy.asarray(k) for k, _ in caches], [cupy.asarray(v) for _, v in caches]


def _expect_copied(ks, vs, before, pairs):
    for (k0, v0), k, v in zip(before, ks, vs):
        k0, v0 = k0.copy(), v0.copy()
        for s, d in pairs:
            k0[d], v0[d] = k0[s], v0[s]
        np.testing.assert_array_equal(cupy.asnumpy(k), k0)
        np.testing.assert_array_equal(cupy.asnumpy(v), v0)


@gpu
def test_copy_blocks_on_two_streams_one_busy(rng):
    """The same caches copied on a busy stream A, then on stream B: B's copy must happen
    (it used to reuse a pointer table still queued for upload on A: block 6 never copied)."""
    from cupaged.bench.timing import Spin

    ks, vs = _layers(rng, 2)
    m1 = cupy.asarray([[1, 2]], np.int64)
    m2 = cupy.asarray([[0, 6]], np.int64)
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    spin = Spin(100_000)
    cupaged.copy_blocks([cupy.zeros_like(ks[0])], [cupy.zeros_like(vs[0])], m1)  # kernel loaded
    before = [(cupy.asnumpy(k), cupy.asnumpy(v)) for k, v in zip(ks, vs)]
    cupy.cuda.Device().synchronize()
    with a:
        spin()
    cupaged.copy_blocks(ks, vs, m1, stream=a)
    cupaged.copy_blocks(ks, vs, m2, stream=b)
    cupy.cuda.Device().synchronize()
    _expect_copied(ks, vs, before, [(1, 2), (0, 6)])


@gpu
def test_copy_blocks_in_a_cuda_graph_outlives_other_calls(rng):
    """First use of a set of caches inside a capture; hundreds of other cache sets copied
    eagerly afterwards (the old per-process table cache evicted and freed tables a graph
    still read); every replay copies the captured caches' blocks."""
    ks, vs = _layers(rng, 3)
    mapping = cupy.asarray([[3, 5], [4, 7]], np.int32)
    cupaged.copy_blocks([cupy.zeros_like(ks[0])], [cupy.zeros_like(vs[0])], mapping)  # loaded
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        cupaged.copy_blocks(ks, vs, mapping)
        graph = stream.end_capture()
    others = [_layers(rng, 1, nb=8) for _ in range(300)]
    for k, v in others:
        cupaged.copy_blocks(k, v, mapping)
    for _ in range(2):
        for k, v in zip(ks, vs):  # new values each time: the replay must copy them
            k[...] = cupy.asarray(testing.random_normal(k.shape, k.dtype, rng))
            v[...] = cupy.asarray(testing.random_normal(v.shape, v.dtype, rng))
        before = [(cupy.asnumpy(k), cupy.asnumpy(v)) for k, v in zip(ks, vs)]
        graph.launch(stream)
        stream.synchronize()
        _expect_copied(ks, vs, before, [(3, 5), (4, 7)])


@gpu
def test_copy_blocks_spans_several_launches_for_many_layers(rng):
    """More tensors than one launch's parameter table holds (96): 60 layers."""
    ks, vs = _layers(rng, 60, nb=4)
    before = [(cupy.asnumpy(k), cupy.asnumpy(v)) for k, v in zip(ks, vs)]
    cupaged.copy_blocks(ks, vs, cupy.asarray([[0, 3], [1, 2]], np.int64))
    _expect_copied(ks, vs, before, [(0, 3), (1, 2)])


@gpu
def test_copy_blocks_checks_every_layer(rng):
    """Layer 1 a strided view, or 2 bytes off 16-byte alignment: refused before launch
    (the strided view used to overwrite another tensor's heads; the misaligned one
    crashed the CUDA context)."""
    ks, vs = _layers(rng, 2)
    mapping = cupy.asarray([[0, 1]], np.int64)
    big = cupy.zeros((8, 4, 64, 8), np.float16)
    with pytest.raises(ValueError, match=r"value_caches\[1\] must be contiguous within each block"):
        cupaged.copy_blocks(ks, [vs[0], big[:, ::2]], mapping)
    raw = cupy.zeros(vs[1].nbytes + 16, np.uint8)
    off = raw[2: 2 + vs[1].nbytes].view(np.float16).reshape(vs[1].shape)
    with pytest.raises(ValueError, match=r"value_caches\[1\] must start on a 16-byte boundary"):
        cupaged.copy_blocks(ks, [vs[0], off], mapping)
    k2 = cupy.zeros((9,) + ks[0].shape[1:], np.float16)
    with pytest.raises(ValueError, match=r"key_caches\[1\] .* differs from key_caches\[0\]"):
        cupaged.copy_blocks([ks[0], k2], vs, mapping)
    cupy.cuda.Device().synchronize()  # the context is healthy


@gpu
def test_swap_blocks_checks_alignment_of_both_sides(rng):
    dev = cupy.zeros((4, 2, 8, 16, 8), np.float16)
    host = cupaged.empty_pinned((4, 2, 8, 16, 8), np.float16)
    flat = cupy.zeros(dev.size + 8, np.float16)
    dev_off = flat[1: 1 + dev.size].reshape(dev.shape)  # one element (2 bytes) in
    with pytest.raises(ValueError, match="src must start on a 16-byte boundary"):
        cupaged.swap_blocks(dev_off, host, [[0, 1]])
    pinned = cupaged.empty_pinned(host.size + 8, np.float16)
    host_off = pinned[1: 1 + host.size].reshape(host.shape)
    with pytest.raises(ValueError, match="dst must start on a 16-byte boundary"):
        cupaged.swap_blocks(dev, host_off, [[0, 1]])
    cupy.cuda.Device().synchronize()


@gpu
def test_empty_batches_in_the_cache_kernels(rng):
    kc, vc = (cupy.asarray(a) for a in testing.random_cache(4, 2, 64, 16, np.float16, rng))
    before = cupy.asnumpy(kc)
    k = cupy.zeros((0, 2, 64), np.float16)
    assert k.strides == (0, 0, 0)
    cupaged.reshape_and_cache(k, k, kc, vc, cupy.zeros((0,), np.int64))
    nhd_k, nhd_v = cupy.zeros((2, 4, 16, 2, 64), np.float16)
    cupaged.reshape_and_cache(k, k, nhd_k, nhd_v, cupy.zeros((0,), np.int32), kv_layout="NHD")
    assert not nhd_k.any() and not nhd_v.any()
    cupaged.copy_blocks([kc], [vc], cupy.zeros((0, 2), np.int32))
    host = cupaged.empty_pinned(kc.shape, np.float16)
    cupaged.swap_blocks(kc, host, np.zeros((0, 2), np.int64))
    cupaged.swap_blocks(kc, host, cupy.zeros((0, 2), np.int64))
    np.testing.assert_array_equal(cupy.asnumpy(kc), before)


# ---- input checks, on array metadata alone (no GPU needed) ----------------------------------


def fake_view(view, root, base=1 << 20, device=0):
    """A Fake device array for a NumPy view of ``root``, its pointer offset as the view's."""
    offset = view.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    return Fake(view, device=device, ptr=base + offset)


def wargs(layout="NHD", dtype=np.float16, n=3, kvh=2, hs=64, bs=16, nb=10):
    if layout == "vllm":
        x = 16 // np.dtype(dtype).itemsize
        kc = np.zeros((nb, kvh, hs // x, bs, x), dtype)
        vc = np.zeros((nb, kvh, hs, bs), dtype)
    else:
        kc = np.zeros((nb, *block_shape(layout, kvh, hs, bs, dtype)), dtype)
        vc = np.zeros_like(kc)
    return dict(key=np.zeros((n, kvh, hs), dtype), value=np.zeros((n, kvh, hs), dtype),
                key_cache=kc, value_cache=vc, slot_mapping=np.zeros(n, np.int64),
                kv_layout=layout)


def wvalidate(**a):
    layout = a.pop("kv_layout")
    f = {k: (v if isinstance(v, Fake) else Fake(v)) for k, v in a.items()}
    return cache_ops.validate_write(f["key"], f["value"], f["key_cache"], f["value_cache"],
                                     f["slot_mapping"], layout)


def wbad(layout="NHD", **changes):
    a = wargs(layout)
    a.update(changes)
    return a


# ---- what a write must not share ---------------------------------------------------------


def test_a_cache_whose_slots_share_bytes_is_refused():
    """Blocks 0 bytes apart (or tokens closer than a row): two slots' writes would land on
    the same bytes in one launch. Refused for every writer, by name."""
    from numpy.lib.stride_tricks import as_strided

    zb = as_strided(np.zeros(2048, np.float16), (10, 16, 2, 64), (0, 256, 128, 2))
    with pytest.raises(ValueError, match="key_cache's elements overlap"):
        wvalidate(**wbad(key_cache=zb, value_cache=np.zeros((10, 16, 2, 64), np.float16)))
    with pytest.raises(ValueError, match="value_cache's elements overlap"):
        wvalidate(**wbad(value_cache=zb, key_cache=np.zeros((10, 16, 2, 64), np.float16)))
    lat = as_strided(np.zeros(16 * 576, np.float16), (10, 16, 576), (0, 1152, 2))
    with pytest.raises(ValueError, match="kv_cache's elements overlap"):
        mvalidate(**mbad(kv_cache=lat))
    rows = as_strided(np.zeros(64 * 656, np.uint8), (4, 16, 656), (16 * 656, 16, 1))
    with pytest.raises(ValueError, match="kv_cache's elements overlap"):
        mvalidate(**dsbad(kv_cache=rows))


def test_the_caches_and_what_the_write_reads_must_be_apart():
    """key_cache and value_cache one array, or slot_mapping, key or value inside a cache:
    refused by name (the launch reads them while it writes the caches). Halves of a cache
    fused along a leading dimension stay accepted."""
    a = wargs()
    with pytest.raises(ValueError, match="key_cache and value_cache are the same memory"):
        kc = Fake(a["key_cache"], ptr=1 << 24)
        wvalidate(**dict(a, key_cache=kc, value_cache=Fake(a["value_cache"], ptr=1 << 24)))
    for name in ("slot_mapping", "key", "value"):
        inside = Fake(a[name], ptr=(1 << 24) + 4096)
        with pytest.raises(ValueError, match=rf"(key_cache and {name}|{name} and key_cache) "
                                             rf"overlap"):
            wvalidate(**dict(a, key_cache=Fake(a["key_cache"], ptr=1 << 24), **{name: inside}))
    fused = np.zeros((10, 2, 16, 2, 64), np.float16)  # [num_blocks, 2, ...]: K and V halves
    wvalidate(**dict(a, key_cache=fused[:, 0], value_cache=fused[:, 1]))


@pytest.mark.parametrize("name", ["key", "value"])
def test_source_strides_must_be_whole_elements(name):
    """A view made with byte strides (as_strided) that are not whole elements: the kernels
    take strides in elements, which would read other rows."""
    from numpy.lib.stride_tricks import as_strided

    odd = as_strided(np.zeros(10000, np.float16), (3, 2, 64), (257, 128, 2))
    with pytest.raises(ValueError, match=f"{name}'s strides must be multiples of its itemsize"):
        wvalidate(**wbad(**{name: odd}))


def test_mla_source_strides_must_be_whole_elements():
    from numpy.lib.stride_tricks import as_strided

    odd = as_strided(np.zeros(10000, np.float16), (3, 512), (1025, 2))
    with pytest.raises(ValueError, match="kv_c's strides must be multiples of its itemsize"):
        mvalidate(**mbad(kv_c=odd))


def test_a_sparse_rows_cache_of_float8_e5m2_storage_is_refused():
    """sparse_mla_attention reads DeepSeek's token rows from uint8, int8 or float8_e4m3fn
    storage: the writer takes the same."""
    import ml_dtypes

    bad = np.zeros((4, 16, 656), ml_dtypes.float8_e5m2)
    with pytest.raises(TypeError, match="kv_cache .*uint8, int8 or float8_e4m3fn"):
        mvalidate(**dsbad(kv_cache=bad))


def test_write_errors_name_the_writes_own_arguments(monkeypatch):
    """reshape_and_cache has keys and values, not a query: its fp8 and scale errors say so."""
    from cupaged import _kvquant

    a = wargs("NHD", nb=4)
    f32 = np.zeros((3, 2, 64), np.float32)
    u8 = np.zeros((4, 16, 2, 64), np.uint8)
    with pytest.raises(TypeError, match="fp8 caches take float16 or bfloat16 keys and values"):
        cache_ops.validate_write(Fake(f32), Fake(f32), Fake(u8), Fake(u8), Fake(a["slot_mapping"]),
                                 "NHD", "fp8")
    monkeypatch.setattr(_kvquant, "as_device_array", lambda x, name: x)
    other = Fake(np.zeros((4, 2, 16), np.float32), device=1)
    with pytest.raises(ValueError, match="k_scale is on device 1 but key_cache is on device 0"):
        cache_ops.validate_write(Fake(a["key"]), Fake(a["value"]), Fake(u8), Fake(u8),
                                 Fake(a["slot_mapping"]), "NHD", "fp8", other,
                                 Fake(np.zeros((4, 2, 16), np.float32)))


def test_a_write_from_torch_sources_into_cupy_caches_runs_on_torchs_stream(monkeypatch):
    """A torch model's K and V written into a CuPy cache (PagedKVCache's default
    framework): the write runs on torch's current stream, where the model made K and V
    and where its attention then reads the cache, not on CuPy's."""
    torch = pytest.importorskip("torch")
    from cupaged.bench.stub import stubbed_driver

    monkeypatch.setattr(_arrays, "torch_stream_getter", lambda: (lambda dev: 0x7777))
    with stubbed_driver(record=True) as stub:
        kc, vc = stub.fake((10, 16, 8, 128), np.float16), stub.fake((10, 16, 8, 128), np.float16)
        sm = stub.fake((4,), np.int64)
        k, v = (on_cuda(torch.zeros((4, 8, 128), dtype=torch.float16)) for _ in range(2))
        cupaged.reshape_and_cache(k, v, kc, vc, sm, kv_layout="NHD")
        assert stub.launches[-1][4] == 0x7777


def _write_cases(stub):
    """reshape_and_cache's argument sets for the remembered-write tests (stubbed arrays at
    fresh addresses): NHD and vLLM's layout, 16-bit; fp8 with a one-element device scale;
    fp8 with per-token scale arrays (which the write fills)."""
    f = stub.fake
    kv = lambda: [f((8, 2, 64), np.float16) for _ in "kv"]  # noqa: E731
    slots = lambda: f((8,), np.int64)  # noqa: E731
    nhd = lambda dt: [f((16, 16, 2, 64), dt) for _ in "kv"]  # noqa: E731
    return {
        "NHD": lambda: (*kv(), *nhd(np.float16), slots(), dict(kv_layout="NHD")),
        "vllm": lambda: (*kv(), f((16, 2, 8, 16, 8), np.float16), f((16, 2, 64, 16), np.float16),
                         slots(), {}),
        "fp8 scale array": lambda: (*kv(), *nhd(np.uint8), slots(),
                                    dict(kv_layout="NHD", kv_cache_dtype="fp8",
                                         k_scale=f((1,), np.float32), v_scale=f((1,), np.float32))),
        "fp8 per token": lambda: (*kv(), *nhd(np.uint8), slots(),
                                  dict(kv_layout="NHD", kv_cache_dtype="fp8",
                                       k_scale=f((16, 2, 16), np.float32),
                                       v_scale=f((16, 2, 16), np.float32))),
    }


@pytest.mark.parametrize("case", ["NHD", "vllm", "fp8 scale array", "fp8 per token"])
def test_a_repeated_write_launches_what_a_validated_one_does(case, monkeypatch):
    """A write whose metadata an earlier one had skips validation: its launch, at its own
    addresses and on the current stream, is byte for byte the one a fresh validation
    gives."""
    from cupaged import _prepared
    from cupaged.bench.stub import stubbed_driver

    with stubbed_driver(record=True) as stub:
        make = _write_cases(stub)[case]
        first, second = make(), make()
        if case.startswith("fp8"):  # (scale arrays are keyed at their address)
            second = (*second[:5], dict(second[5], k_scale=first[5]["k_scale"],
                                        v_scale=first[5]["v_scale"]))
        _prepared.clear()
        cupaged.reshape_and_cache(*second[:5], **second[5])
        fresh = stub.launches[-1]
        _prepared.clear()
        cupaged.reshape_and_cache(*first[:5], **first[5])
        n = len(stub.launches)
        with monkeypatch.context() as m:  # remembered: no validation
            m.setattr(cache_ops, "validate_write", None)
            cupaged.reshape_and_cache(*second[:5], **second[5])
        assert len(stub.launches) == n + 1 and stub.launches[-1] == fresh
        assert fresh[4] == stub.stream().ptr
    _prepared.clear()


def test_a_repeated_write_checks_its_own_addresses():
    """A write with an earlier one's metadata whose arrays now overlap (a cache over the
    sources or the slots, one array as both caches, a per-token scale over a source) is
    refused with the first call's error, before anything launches; the same arrays apart
    again are written."""
    from cupaged import _prepared
    from cupaged.bench.stub import stubbed_driver

    with stubbed_driver(record=True) as stub:
        f = stub.fake
        make = _write_cases(stub)["NHD"]
        k, v, kc, vc, sm, kw = make()
        _prepared.clear()
        cupaged.reshape_and_cache(k, v, kc, vc, sm, **kw)
        n = len(stub.launches)
        with pytest.raises(ValueError, match="key_cache and value_cache are the same memory"):
            cupaged.reshape_and_cache(k, v, kc, kc, sm, **kw)
        inside = kc.data.ptr + 4096
        for name in ("key", "value", "slot_mapping"):
            args = dict(key=k, value=v, slot_mapping=sm)
            a = args[name]
            args[name] = f(a.shape, a.dtype, ptr=inside)
            with pytest.raises(ValueError, match=rf"(key_cache and {name}|{name} and key_cache) "
                                                 rf"overlap"):
                cupaged.reshape_and_cache(args["key"], args["value"], kc, vc,
                                          args["slot_mapping"], **kw)
        assert len(stub.launches) == n
        k8, v8, kc8, vc8, sm8, kw8 = _write_cases(stub)["fp8 per token"]()
        cupaged.reshape_and_cache(k8, v8, kc8, vc8, sm8, **kw8)
        n = len(stub.launches)
        ks = kw8["k_scale"]
        over = f(k8.shape, k8.dtype, ptr=ks.data.ptr)
        with pytest.raises(ValueError, match="k_scale and key overlap|key and k_scale overlap"):
            cupaged.reshape_and_cache(over, v8, kc8, vc8, sm8, **kw8)
        assert len(stub.launches) == n
        cupaged.reshape_and_cache(k, v, kc, vc, sm, **kw)
        assert len(stub.launches) == n + 1
        # A write of no token (a padded batch's empty step) repeats the same checks.
        none = f((0,), np.int64)
        cupaged.reshape_and_cache(k, v, kc, vc, none, **kw)
        with pytest.raises(ValueError, match="(key_cache and key|key and key_cache) overlap"):
            cupaged.reshape_and_cache(f(k.shape, k.dtype, ptr=inside), v, kc, vc, none, **kw)
        assert len(stub.launches) == n + 1
    _prepared.clear()


def test_a_debug_write_holds_its_imports_past_its_launch(monkeypatch):
    """Under CUPAGED_DEBUG a write reads slot_mapping on the host before it launches; a
    DLPack import of the call is stamped by the launch's context and recorded (held) after
    the launch, not released after the read."""
    from cupaged.bench.stub import stubbed_driver

    events = []
    monkeypatch.setattr(cupaged._checks, "DEBUG", True)
    monkeypatch.setattr(_arrays, "order_after_producers", lambda ctx: None)
    with stubbed_driver(record=True) as stub:
        monkeypatch.setattr(cache_ops, "_debug_check_slots",
                            lambda sm, n, ctx: events.append(("slots read", len(stub.launches))))

        def record():  # the write's launch is stub.launches[0]
            events.append(("recorded", len(_arrays.HOLDS.stamped), len(stub.launches)))
            _arrays.HOLDS.stamped = []  # (no events to make on the stub)

        monkeypatch.setattr(_arrays, "record_launched", record)
        k, v = (stub.fake((8, 2, 64), np.float16) for _ in "kv")
        kc, vc = (stub.fake((16, 16, 2, 64), np.float16) for _ in "kv")
        sm = stub.fake((8,), np.int64)
        monkeypatch.setattr(_arrays.HOLDS, "pending", [k])  # an import of this call's
        monkeypatch.setattr(_arrays.HOLDS, "stamped", [])
        cupaged.reshape_and_cache(k, v, kc, vc, sm, kv_layout="NHD")
    assert events == [("slots read", 0), ("recorded", 1, 1)], events


def test_a_paged_cache_past_int32_slots_is_refused():
    """Its steps upload slot mappings as int32: a cache of more than 2^31 - 1 token slots
    is refused before anything is allocated."""
    with pytest.raises(ValueError, match="2147483904 token slots; at most 2\\^31 - 1"):
        PagedKVCache(1, 2**23 + 1, 1, 32, 256, kv_layout="NHD")



def test_kv_layout_is_keyword_only_and_vllm_by_default():
    p = inspect.signature(cupaged.reshape_and_cache).parameters
    # vLLM's positional order, fp8 arguments included.
    assert list(p)[:8] == ["key", "value", "key_cache", "value_cache", "slot_mapping",
                           "kv_cache_dtype", "k_scale", "v_scale"]
    assert p["kv_layout"].kind is inspect.Parameter.KEYWORD_ONLY
    assert p["kv_layout"].default == "vllm" and p["stream"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(TypeError, match="positional argument"):
        cupaged.reshape_and_cache(None, None, None, None, None, "auto", 1.0, 1.0, "NHD")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_valid_writes_are_described(layout):
    w = wvalidate(**wargs(layout))
    c = w.cache
    assert (c.num_blocks, c.num_kv_heads, c.head_size, c.block_size) == (10, 2, 64, 16)
    assert (w.num_tokens, w.index, w.device, w.vec_src) == (3, "i64", 0, True)
    assert c.kv_format == ("vllm" if layout == "vllm" else "tok")
    if layout == "NHD":
        assert c.k_strides == c.v_strides == (16 * 2 * 64, 64, 2 * 64)  # block, head, token
    elif layout == "HND":
        assert c.k_strides == c.v_strides == (2 * 16 * 64, 16 * 64, 64)
    else:
        assert (c.k_strides, c.v_strides) == ((2 * 64 * 16, 64 * 16, 0), (2 * 64 * 16, 64 * 16, 0))
    assert wvalidate(**wbad(layout, slot_mapping=np.zeros(3, np.int32))).index == "i32"


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fused_cache_views_are_written_in_place(layout):
    """K and V halves of [num_blocks, 2, ...] and of [..., 2 * head_size]: their own
    strides, as the kernel takes them."""
    blk = block_shape(layout, 2, 64, 16, np.float16)
    tok_axis = 1 if layout == "NHD" else 2
    fused = np.zeros((10, 2, *blk), np.float16)
    k, v = fake_view(fused[:, 0], fused), fake_view(fused[:, 1], fused)
    c = wvalidate(**wbad(layout, key_cache=k, value_cache=v)).cache
    dense = np.zeros((10, *blk), np.float16).strides
    want = (2 * dense[0] // 2, dense[3 - tok_axis] // 2, dense[tok_axis] // 2)
    assert c.k_strides == c.v_strides == want
    packed = np.zeros((10, *blk[:-1], 128), np.float16)
    k, v = fake_view(packed[..., :64], packed), fake_view(packed[..., 64:], packed)
    c = wvalidate(**wbad(layout, key_cache=k, value_cache=v)).cache
    st = [s // 2 for s in packed.strides]
    assert c.k_strides == c.v_strides == (st[0], st[3 - tok_axis], st[tok_axis])


def test_vector_loads_only_for_16_byte_aligned_source_rows():
    qkv = np.zeros((3, 8, 64), np.float16)  # [tokens, 4 + 2 + 2 heads, head_size]
    k, v = fake_view(qkv[:, 4:6], qkv), fake_view(qkv[:, 6:], qkv)
    assert wvalidate(**wbad(key=k, value=v)).vec_src  # a fused QKV's slices are aligned
    assert not wvalidate(**wbad(key=Fake(wargs()["key"], ptr=(1 << 20) + 2))).vec_src
    odd = np.zeros((3, 2, 65), np.float16)[:, :, :64]  # head stride 130 bytes
    assert not wvalidate(**wbad(value=odd)).vec_src
    rows = np.zeros((3, 2 * 64 + 1), np.float16)  # token stride 258 bytes
    strided = np.lib.stride_tricks.as_strided(rows, (3, 2, 64), (258, 128, 2))
    assert not wvalidate(**wbad(key=strided)).vec_src
    # A stride no element is reached through (one token, one head) does not matter.
    one = np.lib.stride_tricks.as_strided(rows, (1, 2, 64), (258, 128, 2))
    assert wvalidate(**wbad(key=one, value=np.zeros((1, 2, 64), np.float16),
                            slot_mapping=np.zeros(1, np.int64))).vec_src


def _hnd(*shape, dtype=np.float16):
    return np.zeros(shape, dtype)


@pytest.mark.parametrize("a, exc, match", [
    # the layout
    (wbad("vllm", key_cache=_hnd(10, 16, 2, 64), value_cache=_hnd(10, 16, 2, 64)), ValueError,
     r"key_cache is 4-D .* kv_layout='vllm' \(the default\) .* pass kv_layout=\"NHD\" or "
     r"kv_layout=\"HND\""),
    (wbad(kv_layout="nhd"), ValueError, r"kv_layout must be one of \('NHD', 'HND', 'vllm'\)"),
    (wbad(kv_layout=None), TypeError, "kv_layout must be one of"),
    (wbad("NHD", key_cache=wargs("vllm")["key_cache"], value_cache=wargs("vllm")["value_cache"]),
     ValueError, r"key_cache must be 4-D \[num_blocks, block_size, num_kv_heads, head_size\] "
                 r"for kv_layout='NHD'"),
    # the caches
    (wbad(key_cache=_hnd(10, 16, 2, 64, dtype=np.float64)), TypeError,
     "key_cache dtype float64 is not supported"),
    (wbad(value_cache=_hnd(10, 16, 2, 64, dtype=np.float32)), TypeError,
     "value_cache dtype float32 does not match key_cache dtype float16"),
    (wbad(value_cache=_hnd(10, 16, 2, 32)), ValueError,
     r"value_cache shape \(10, 16, 2, 32\) does not match key_cache shape"),
    (wbad(key_cache=_hnd(10, 12, 2, 64), value_cache=_hnd(10, 12, 2, 64)), ValueError,
     r"block_size 12 \(key_cache.shape\[1\] for NHD\) is not supported"),
    (wbad("HND", key_cache=_hnd(10, 2, 16, 36), value_cache=_hnd(10, 2, 16, 36)), ValueError,
     "head_size 36 is not supported"),
    (wbad(key_cache=_hnd(10, 16, 0, 64), value_cache=_hnd(10, 16, 0, 64)), ValueError,
     "the caches have no KV heads"),
    (wbad(value_cache=_hnd(10, 16, 2, 128)[..., ::2]), ValueError,
     r"value_cache's last dimension \(head_size\) must be contiguous"),
    (wbad(key_cache=_hnd(10, 16, 2, 68)[..., :64]), ValueError,
     "key_cache must be 16-byte aligned with block, head and token strides"),
    (wbad(value_cache=Fake(_hnd(10, 16, 2, 64), ptr=(1 << 20) + 8)), ValueError,
     "value_cache must be 16-byte aligned"),
    (wbad("vllm", value_cache=_hnd(10, 2, 64, 8)), ValueError,
     "value_cache shape .* does not match the key cache"),
    (wbad("vllm", key_cache=_hnd(10, 2, 8, 32, 8)[:, :, :, ::2]), ValueError,
     "key_cache must be contiguous within a block"),
    # key and value
    (wbad(key=_hnd(3, 2, 64, dtype=np.float32)), TypeError,
     "key dtype float32 does not match the cache dtype float16"),
    (wbad(value=_hnd(3, 1, 64)), ValueError,
     r"value must be \[num_tokens, 2, 64\] \(num_tokens, num_kv_heads, head_size\), got shape"),
    (wbad(key=_hnd(3, 128)), ValueError, r"key must be \[num_tokens, 2, 64\]"),
    (wbad(key=_hnd(3, 2, 128)[:, :, ::2]), ValueError, "key's last dimension must be contiguous"),
    (wbad(value=_hnd(3, 2, 64)[::-1]), ValueError, "value's last dimension must be contiguous "
                                                   "and its strides non-negative"),
    (wbad(value=_hnd(2, 2, 64)), ValueError,
     "value has 2 tokens but slot_mapping has 3: the sources need a row for every slot"),
    # slot_mapping
    (wbad(slot_mapping=np.zeros(3, np.float32)), TypeError,
     "slot_mapping must be int32 or int64, got float32"),
    (wbad(slot_mapping=np.zeros(4, np.int64)), ValueError,
     "key has 3 tokens but slot_mapping has 4"),
    (wbad(slot_mapping=np.zeros((3, 1), np.int64)), ValueError,
     r"slot_mapping must be 1-D \[num_tokens\], got shape \(3, 1\)"),
    (wbad(slot_mapping=np.zeros(6, np.int64)[::2]), ValueError,
     r"slot_mapping must be a contiguous array of shape \(3,\)"),
    # devices
    (wbad(key=Fake(_hnd(3, 2, 64), device=1)), ValueError,
     "key is on device 1 but key_cache is on device 0"),
    (wbad(value_cache=Fake(_hnd(10, 16, 2, 64), device=1)), ValueError,
     "value_cache is on device 1 but key_cache is on device 0"),
    (wbad(slot_mapping=Fake(np.zeros(3, np.int64), device=2)), ValueError,
     "slot_mapping is on device 2"),
])
def test_reshape_and_cache_validation(a, exc, match):
    with pytest.raises(exc, match=match):
        wvalidate(**a)


def test_sources_may_hold_more_rows_than_slot_mapping():
    """Engines pad key and value to a CUDA graph's batch: slot_mapping's length is what is
    written (as vLLM's reshape_and_cache)."""
    w = wvalidate(**wbad(key=_hnd(8, 2, 64), value=_hnd(5, 2, 64)))
    assert w.num_tokens == 3
    assert wvalidate(**wbad(slot_mapping=np.zeros(0, np.int64))).num_tokens == 0


def test_per_token_scales_may_not_overlap_what_the_write_reads(monkeypatch):
    """The write fills per-token scales while it reads key, value and slot_mapping: a
    scale array overlapping any of them is refused, and so are K and V scale arrays with
    different strides (the kernel takes one pair)."""
    from cupaged import _kvquant

    monkeypatch.setattr(_kvquant, "as_device_array", lambda a, name: a)
    a = wargs("NHD", nb=4)
    kc = Fake(np.zeros((4, 16, 2, 64), np.uint8), ptr=1 << 24)
    vc = Fake(np.zeros((4, 16, 2, 64), np.uint8), ptr=1 << 25)
    key = Fake(np.zeros((3, 2, 64), np.float16), ptr=1 << 26)
    value = Fake(np.zeros((3, 2, 64), np.float16), ptr=(1 << 26) + 4096)
    sm = Fake(np.zeros(3, np.int64), ptr=1 << 27)
    scale = lambda ptr: Fake(np.zeros((4, 2, 16), np.float32), ptr=ptr)  # noqa: E731
    ok = cache_ops.validate_write(key, value, kc, vc, sm, "NHD", "fp8", scale(1 << 28),
                                   scale((1 << 28) + 4096))
    assert ok.quant.mode == "th"
    for name, ptr in (("key", 1 << 26), ("value", (1 << 26) + 4096 + 64), ("slot_mapping", 1 << 27)):
        with pytest.raises(ValueError, match=rf"(v_scale and {name}|{name} and v_scale) overlap"):
            cache_ops.validate_write(key, value, kc, vc, sm, "NHD", "fp8", scale(1 << 28),
                                      scale(ptr))
    with pytest.raises(ValueError, match="k_scale and v_scale overlap"):
        cache_ops.validate_write(key, value, kc, vc, sm, "NHD", "fp8", scale(1 << 28),
                                  scale((1 << 28) + 256))
    wide = Fake(np.zeros((4, 4, 16), np.float32)[:, :2], ptr=1 << 29)  # head stride 2x
    with pytest.raises(ValueError, match="k_scale and v_scale must have the same strides"):
        cache_ops.validate_write(key, value, kc, vc, sm, "NHD", "fp8", scale(1 << 28), wide)
    del a


def test_reshape_and_cache_takes_device_arrays_only():
    a = wargs()
    with pytest.raises(TypeError, match=r"key is a NumPy array .* cupy.asarray\(key\)"):
        cupaged.reshape_and_cache(a["key"], a["value"], a["key_cache"], a["value_cache"],
                                  a["slot_mapping"], kv_layout="NHD")


def test_reshape_and_cache_specializations():
    from cupaged import jit

    legacy = jit.KernelSpec("reshape_and_cache", "f16", index_dtype="i32")
    assert legacy.kv_format == "vllm" and legacy.name == "reshape_and_cache_f16_i32_vllm_sm90"
    tok = jit.KernelSpec("reshape_and_cache", "bf16", index_dtype="i64", kv_format="tok")
    assert tok.name_expression == ("cupaged::reshape_and_cache<cupaged::bfloat16_t, "
                                   "cupaged::bfloat16_t, 0, 0, long long>")
    with pytest.raises(ValueError, match="kv_format must be 'tok' or 'vllm'"):
        jit.KernelSpec("reshape_and_cache", "f16", index_dtype="i32", kv_format="NHD")
    # The launch packs what the token-major specialization takes (NVRTC, no GPU).
    from test_jit import _mangled_params

    _, lowered = jit._compile(tok.source_file, tok.arch, [tok.name_expression], tok.name)
    assert _mangled_params(lowered[tok.name_expression]) == jit.ARG_FORMATS["reshape_and_cache"]


@pytest.fixture
def fake_device(monkeypatch):
    """The copy entry points take Fake arrays as device arrays and record their launches
    instead of making them: [(tensors, block_bytes, src_blocks, dst_blocks)]."""
    real = cache_ops.as_device_array
    monkeypatch.setattr(cache_ops, "as_device_array",
                        lambda x, name: x if isinstance(x, Fake) else real(x, name))
    monkeypatch.setattr(_arrays, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_arrays, "context",
                        lambda device, kind, stream=None: _arrays.Context(device, 0, "cupy",
                                                                            False))
    launches = []
    monkeypatch.setattr(cache_ops, "_launch_copy",
                        lambda ctx, tensors, mapping, index, n, nbytes, sb, db:
                        launches.append((tensors, nbytes, sb, db)))
    return launches


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_copy_blocks_takes_halves_of_a_fused_allocation(fake_device, layout):
    """K and V of one [num_blocks, 2, ...] allocation: each block one contiguous run,
    every other block of the allocation apart."""
    blk = block_shape(layout, 2, 64, 16, np.float16)
    layers = [np.zeros((10, 2, *blk), np.float16) for _ in range(2)]
    ks = [fake_view(f[:, 0], f, base=(1 << 20) * (i + 1)) for i, f in enumerate(layers)]
    vs = [fake_view(f[:, 1], f, base=(1 << 20) * (i + 1)) for i, f in enumerate(layers)]
    cupaged.copy_blocks(ks, vs, Fake(np.zeros((3, 2), np.int32)))
    block = 16 * 2 * 64 * 2
    (tensors, nbytes, src_blocks, dst_blocks), = fake_device
    assert (nbytes, src_blocks, dst_blocks) == (block, 10, 10)
    assert tensors == [(k.data.ptr, k.data.ptr, 2 * block, 2 * block) for k in ks] + \
        [(v.data.ptr, v.data.ptr, 2 * block, 2 * block) for v in vs]
    assert vs[0].data.ptr - ks[0].data.ptr == block


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_copy_and_swap_refuse_halves_of_packed_rows(fake_device, layout):
    """The K half of [..., 2 * head_size] is not one run of bytes per block: refused with
    the reason, before anything launches."""
    blk = block_shape(layout, 2, 64, 16, np.float16)
    packed = np.zeros((10, *blk[:-1], 128), np.float16)
    k, v = fake_view(packed[..., :64], packed), fake_view(packed[..., 64:], packed)
    mapping = Fake(np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match=r"key_caches\[0\] must be contiguous within each "
                                         r"block .* fused within its rows"):
        cupaged.copy_blocks([k], [v], mapping)
    dense = Fake(np.zeros((10, *blk), np.float16), ptr=1 << 24)
    with pytest.raises(ValueError, match="src must be contiguous within each block"):
        cupaged.swap_blocks(k, dense, mapping)
    with pytest.raises(ValueError, match="dst must be contiguous within each block"):
        cupaged.swap_blocks(dense, v, mapping)
    assert fake_device == []


def test_copy_blocks_with_no_layers_copies_nothing(fake_device):
    """vLLM's copy_blocks returns for empty lists of caches; so does cupaged's (the
    mapping's own checks still run)."""
    cupaged.copy_blocks([], [], Fake(np.zeros((3, 2), np.int64)))
    cupaged.copy_blocks((), (), Fake(np.zeros((0, 2), np.int32)))
    assert fake_device == []
    k = Fake(np.zeros((4, 16, 2, 64), np.float16))
    with pytest.raises(ValueError, match="lists of one length, got 1 and 0"):
        cupaged.copy_blocks([k], [], Fake(np.zeros((1, 2), np.int64)))
    with pytest.raises(ValueError, match=r"block_mapping must be \[num_pairs, 2\]"):
        cupaged.copy_blocks([], [], Fake(np.zeros((3,), np.int64)))


def test_copy_blocks_refuses_overlapping_blocks(fake_device):
    buf = np.zeros(4096, np.float16)
    k = np.lib.stride_tricks.as_strided(buf, (4, 8, 16), (128, 32, 2))  # blocks 256 bytes long
    with pytest.raises(ValueError, match=r"key_caches\[0\]'s blocks overlap: its block stride "
                                         r"\(128 bytes\) is less than a block \(256 bytes\)"):
        cupaged.copy_blocks([Fake(k)], [Fake(k)], Fake(np.zeros((1, 2), np.int64)))


# ---- concat_and_cache_mla: MLA's latent cache write ---------------------------------------------

MLA_RANK, MLA_ROPE = 512, 64


def _mla_cache(form, dtype, nb, bs, rng, rank=MLA_RANK, rope=MLA_ROPE):
    """Host cache roots with random contents, and ``view``: roots -> (kv_cache, k_pe_cache).
    "combined": vLLM's [nb, bs, rank + rope]; "pair": FlashInfer's two caches; "strided":
    the combined cache as a block-strided slice of a wider allocation."""
    fill = (lambda *s: rng.integers(0, 256, s, dtype=np.uint8)) if np.dtype(dtype).itemsize == 1 \
        else (lambda *s: testing.random_normal(s, dtype, rng))
    if form == "combined":
        return [fill(nb, bs, rank + rope)], lambda r: (r[0], None)
    if form == "pair":
        return [fill(nb, bs, rank), fill(nb, bs, rope)], lambda r: (r[0], r[1])
    # strided: every other block of a [2 * nb, bs, rank + rope + 64] allocation
    return [fill(2 * nb, bs, rank + rope + 64)], lambda r: (r[0][::2, :, : rank + rope], None)


@gpu
@pytest.mark.parametrize("form", ["combined", "pair", "strided"])
@pytest.mark.parametrize("dtype, kv", [(np.float16, "auto"), (_dtypes.BF16.numpy, "auto"),
                                       (_dtypes.BF16.numpy, "fp8_e4m3"),
                                       (np.float16, "fp8_e5m2")],
                         ids=["f16", "bf16", "bf16-e4m3", "f16-e5m2"])
@pytest.mark.parametrize("source", ["contiguous", "unaligned"])
def test_concat_and_cache_mla_writes_what_the_reference_writes(rng, form, dtype, kv, source):
    """Every written slot holds the reference's bytes (fp8: bit for bit), padding and
    out-of-range slots write nothing, source rows past num_tokens are not read, and every
    other byte of the allocation keeps its contents."""
    nb, bs, n = 7, 16, 40
    cache_dt = np.uint8 if kv != "auto" else dtype
    roots, view = _mla_cache(form, cache_dt, nb, bs, rng)
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    slots[[3, 17]] = -1  # padding
    slots[20] = nb * bs + 5  # past the cache: skipped
    rows = n + 5  # rows past num_tokens must not be read (NaN there would show)
    wide = testing.random_normal((rows, MLA_RANK + MLA_ROPE + 3), dtype, rng)
    wide[n:] = np.nan
    wide[0, 5] = 3e3  # past e4m3's 448 x scale: saturates
    wide[1, MLA_RANK + 4] = -3e3
    # contiguous: two arrays; unaligned: row-strided slices one element in (no row
    # 16-byte aligned: element loads), sliced on the device (CuPy copies a strided host
    # array into a contiguous one)
    if source == "contiguous":
        cols = [(0, MLA_RANK), (MLA_RANK, MLA_RANK + MLA_ROPE)]
        kv_c, k_pe = (np.ascontiguousarray(wide[:, a:b]) for a, b in cols)
        d_kv_c, d_k_pe = cupy.asarray(kv_c), cupy.asarray(k_pe)
    else:
        cols = [(1, MLA_RANK + 1), (MLA_RANK + 2, MLA_RANK + 2 + MLA_ROPE)]
        kv_c, k_pe = (wide[:, a:b] for a, b in cols)
        dw = cupy.asarray(wide)
        d_kv_c, d_k_pe = (dw[:, a:b] for a, b in cols)
    scale = 0.0173 if kv != "auto" else None  # not a power of two: x / s, not x * (1 / s)
    want = [r.copy() for r in roots]
    wkc, wpc = view(want)
    reference.concat_and_cache_mla(kv_c[:n], k_pe[:n], wkc, np.where(slots < nb * bs, slots, -1),
                                   kv if kv != "auto" else "auto", scale, k_pe_cache=wpc)
    dev = [cupy.asarray(r) for r in roots]
    kc, pc = view(dev)
    d_slots = cupy.asarray(slots)
    w8 = cache_ops.validate_mla_write(d_kv_c, d_k_pe, kc, pc, d_slots, kv)
    assert w8.vec_src == (source == "contiguous")  # both load paths are exercised
    cupaged.concat_and_cache_mla(d_kv_c, d_k_pe, kc, d_slots, kv, scale, k_pe_cache=pc)
    for got, w in zip(dev, want):
        np.testing.assert_array_equal(cupy.asnumpy(got).view(np.uint8), w.view(np.uint8))


@gpu
def test_concat_and_cache_mla_takes_a_device_scale_and_int32_slots(rng):
    nb, bs = 3, 64
    kc = cupy.zeros((nb, bs, MLA_RANK + MLA_ROPE), cupy.uint8)
    kv_c = testing.random_normal((5, MLA_RANK), _dtypes.BF16.numpy, rng)
    k_pe = testing.random_normal((5, MLA_ROPE), _dtypes.BF16.numpy, rng)
    slots = np.array([0, 70, -1, 191, 64], np.int32)
    cupaged.concat_and_cache_mla(cupy.asarray(kv_c), cupy.asarray(k_pe), kc, cupy.asarray(slots),
                                 "fp8_e4m3", cupy.asarray(np.float32(0.0173)))
    want = np.zeros((nb, bs, MLA_RANK + MLA_ROPE), np.uint8)
    reference.concat_and_cache_mla(kv_c, k_pe, want, slots, "fp8_e4m3", np.float32(0.0173))
    np.testing.assert_array_equal(cupy.asnumpy(kc), want)


def margs(form="combined", dtype=np.float16, n=3, rank=512, rope=64, bs=16, nb=10):
    kc = np.zeros((nb, bs, rank + rope if form == "combined" else rank), dtype)
    return dict(kv_c=np.zeros((n, rank), dtype), k_pe=np.zeros((n, rope), dtype), kv_cache=kc,
                k_pe_cache=None if form == "combined" else np.zeros((nb, bs, rope), dtype),
                slot_mapping=np.zeros(n, np.int64), kv_cache_dtype="auto")


def mvalidate(**a):
    kv = a.pop("kv_cache_dtype")
    # (kv_cache at 1 << 20, what the write descriptions' assertions name; the others each
    # at an address of its own)
    f = {k: (None if v is None else v if isinstance(v, Fake)
             else Fake(v, ptr=1 << 20) if k == "kv_cache" else Fake(v)) for k, v in a.items()}
    return cache_ops.validate_mla_write(f["kv_c"], f["k_pe"], f["kv_cache"], f["k_pe_cache"],
                                         f["slot_mapping"], kv)


def mbad(form="combined", **changes):
    a = margs(form)
    a.update(changes)
    return a


def test_mla_write_is_described():
    w = mvalidate(**margs())
    assert (w.num_tokens, w.rank, w.rope, w.block_size, w.num_blocks) == (3, 512, 64, 16, 10)
    assert w.latent == (1 << 20, 16 * 576, 576) and w.rope_dst == ((1 << 20) + 1024, 16 * 576, 576)
    assert w.vec_src and w.cache is w.source
    p = mvalidate(**margs("pair"))
    assert p.latent[1:] == (16 * 512, 512) and p.rope_dst[1:] == (16 * 64, 64)
    f8 = mvalidate(**mbad(kv_cache=np.zeros((10, 16, 576), np.uint8), kv_cache_dtype="fp8"))
    assert f8.cache.name == "e4m3" and f8.latent[1:] == (16 * 576, 576)


@pytest.mark.parametrize("a, exc, match", [
    (mbad(kv_c=np.zeros((3, 512), np.float32)), TypeError, "kv_c must be float16 or bfloat16"),
    (mbad(k_pe=np.zeros((3, 64), _dtypes.BF16.numpy)), TypeError, "k_pe dtype bfloat16 does not match"),
    (mbad(kv_c=np.zeros((3, 1, 512), np.float16)), ValueError, r"kv_c must be 2-D \[num_tokens, dims\]"),
    (mbad(k_pe=np.zeros((3, 60), np.float16)), ValueError, "k_pe's width must be a positive multiple of 8"),
    (mbad(kv_cache=np.zeros((10, 16, 512), np.float16)), ValueError,
     r"kv_cache's last dimension must be kv_lora_rank \+ rope_dim = 512 \+ 64"),
    (mbad("pair", k_pe_cache=np.zeros((10, 8, 64), np.float16)), ValueError,
     r"k_pe_cache must be \[num_blocks, block_size, rope_dim\] = \(10, 16, 64\)"),
    (mbad(kv_cache=np.zeros((10, 16, 576), _dtypes.BF16.numpy)), TypeError,
     "kv_cache dtype bfloat16 does not match kv_c's float16"),
    (mbad(kv_cache=np.zeros((10, 16, 576), np.uint8)), TypeError,
     "kv_cache is uint8: name its fp8 format"),
    (mbad(kv_cache_dtype="fp8"), TypeError, "kv_cache dtype float16 cannot hold fp8 e4m3"),
    (mbad(kv_cache=np.zeros((10, 576), np.float16)), ValueError,
     r"kv_cache must be \[num_blocks, block_size, dims\]"),
    (mbad(kv_cache=Fake(np.zeros((10, 16, 576), np.float16), ptr=(1 << 20) + 8)), ValueError,
     "kv_cache must start on a 16-byte boundary"),
    (mbad(kv_cache=np.zeros((10, 16, 580), np.float16)[:, :, :576]), ValueError,
     "block and token strides must be non-negative multiples of 16 bytes"),
    (mbad(slot_mapping=np.zeros((3, 1), np.int64)), ValueError, "slot_mapping must be 1-D"),
    (mbad(slot_mapping=np.zeros(4, np.int64)), ValueError, "kv_c has 3 tokens but slot_mapping has 4"),
    (mbad(slot_mapping=np.zeros(3, np.float32)), TypeError, "slot_mapping"),
    (mbad(k_pe=Fake(np.zeros((3, 64), np.float16), device=1)), ValueError,
     "k_pe is on device 1 but kv_cache is on device 0"),
])
def test_bad_mla_writes_are_refused_by_name(a, exc, match):
    with pytest.raises(exc, match=match):
        mvalidate(**a)


def test_mla_write_reads_unaligned_sources_element_by_element():
    wide = np.zeros((3, 600), np.float16)  # rows of 1,200 bytes, one element in
    assert not mvalidate(**mbad(kv_c=fake_view(wide[:, 1:513], wide))).vec_src
    odd = np.zeros((3, 516), np.float16)  # aligned start, rows of 1,032 bytes
    assert not mvalidate(**mbad(kv_c=fake_view(odd[:, :512], odd))).vec_src
    assert mvalidate(**mbad(kv_c=fake_view(wide[:, 8:520], wide))).vec_src


def test_copy_blocks_mla_copies_each_layers_latent_blocks(fake_device):
    """One tensor per layer (vLLM's combined latent cache), one launch; the checks of
    copy_blocks, with the MLA list's own name."""
    layers = [Fake(np.zeros((10, 64, 576), np.uint8), ptr=(1 << 24) * (i + 1)) for i in range(3)]
    cupaged.copy_blocks_mla(layers, Fake(np.zeros((4, 2), np.int32)))
    (tensors, nbytes, src_blocks, dst_blocks), = fake_device
    assert (nbytes, src_blocks, dst_blocks) == (64 * 576, 10, 10)
    assert tensors == [(c.data.ptr, c.data.ptr, 64 * 576, 64 * 576) for c in layers]
    cupaged.copy_blocks_mla([], Fake(np.zeros((2, 2), np.int64)))
    assert len(fake_device) == 1
    with pytest.raises(ValueError, match=r"kv_caches\[1\] .* differs from kv_caches\[0\]"):
        cupaged.copy_blocks_mla([layers[0], Fake(np.zeros((11, 64, 576), np.uint8))],
                                Fake(np.zeros((1, 2), np.int64)))
    with pytest.raises(ValueError, match=r"kv_caches\[1\] is on device 1 but kv_caches\[0\]"):
        cupaged.copy_blocks_mla([layers[0], Fake(np.zeros((10, 64, 576), np.uint8), device=1)],
                                Fake(np.zeros((1, 2), np.int64)))
    with pytest.raises(TypeError, match="kv_caches must be a list"):
        cupaged.copy_blocks_mla(layers[0], Fake(np.zeros((1, 2), np.int64)))
    with pytest.raises(ValueError, match=r"block_mapping must be \[num_pairs, 2\]"):
        cupaged.copy_blocks_mla(layers, Fake(np.zeros((3,), np.int64)))


@gpu
def test_copy_blocks_mla_on_the_device(rng):
    nb = 12
    roots = [rng.integers(0, 256, (nb, 16, 576), dtype=np.uint8) for _ in range(2)]
    src = rng.choice(6, size=4, replace=False)
    dst = rng.choice(np.arange(6, 12), size=4, replace=False)
    dev = [cupy.asarray(r) for r in roots]
    cupaged.copy_blocks_mla(dev, cupy.asarray(np.stack([src, dst], 1).astype(np.int64)))
    for r, d in zip(roots, dev):
        want = r.copy()
        want[dst] = r[src]
        np.testing.assert_array_equal(cupy.asnumpy(d), want)


@gpu
@pytest.mark.parametrize("dtype", [_dtypes.BF16.numpy, np.uint8], ids=["bf16", "fp8-bytes"])
def test_swap_blocks_moves_latent_blocks_out_and_back(rng, dtype):
    """A latent cache's blocks ([num_blocks, block_size, 576], 16-bit or fp8 bytes) out to
    pinned host memory and back to other blocks: byte for byte, the rest untouched."""
    nb, bs = 12, 16
    host = rng.integers(0, 256, (nb, bs, 576 * np.dtype(dtype).itemsize), dtype=np.uint8)
    dev = cupy.asarray(host.view(dtype))
    pinned = cupaged.empty_pinned((6, bs, 576), dtype)
    out_map = np.array([[3, 0], [7, 1], [11, 2]], np.int32)
    cupaged.swap_blocks(dev, pinned, out_map)
    cupy.cuda.get_current_stream().synchronize()
    for s, d in out_map:
        np.testing.assert_array_equal(np.asarray(pinned[d]).view(np.uint8), host[s])
    cupaged.swap_blocks(pinned, dev, cupy.asarray(np.array([[0, 5], [2, 6]], np.int64)))
    want = host.copy()
    want[5], want[6] = host[3], host[11]
    np.testing.assert_array_equal(cupy.asnumpy(dev).view(np.uint8), want)


def test_mla_write_refuses_a_scale_it_cannot_read(fake_device, monkeypatch):
    """The fp8 scale: one float32 on the cache's device (MLA's caches have no per-token
    scales, and the message says so)."""
    from cupaged import _kvquant

    monkeypatch.setattr(_kvquant, "as_device_array", cache_ops.as_device_array)  # Fakes too
    a = margs()
    args = [Fake(a[k]) for k in ("kv_c", "k_pe")] + [Fake(np.zeros((10, 16, 576), np.uint8)),
                                                      Fake(a["slot_mapping"])]
    with pytest.raises(ValueError, match="scale is on device 1 but kv_cache is on device 0"):
        cupaged.concat_and_cache_mla(*args, "fp8", Fake(np.zeros((), np.float32), device=1))
    with pytest.raises(ValueError, match=r"scale must be one float \(per tensor\), got shape "
                                         r"\(10, 1, 16\): MLA's latent cache takes a "
                                         r"per-tensor scale only"):
        cupaged.concat_and_cache_mla(*args, "fp8", Fake(np.zeros((10, 1, 16), np.float32)))
    with pytest.raises(ValueError, match="scale must be a positive finite float32"):
        cupaged.concat_and_cache_mla(*args, "fp8", -1.0)


@pytest.mark.parametrize("cache_form", ["combined", "pair"])
@pytest.mark.parametrize("what", ["token stride", "block stride", "pointer"])
def test_mla_write_holds_fp8_caches_to_what_mla_attention_reads(cache_form, what):
    """fp8 caches too need a 16-byte aligned pointer and block and token strides in
    multiples of 16 bytes, as mla_attention reads them (the kernel's stores of eight
    values would take 8): a cache that is written is never refused when read for them."""
    rank_w = MLA_RANK + MLA_ROPE if cache_form == "combined" else MLA_RANK
    name = "kv_cache" if cache_form == "combined" or what != "pointer" else "k_pe_cache"
    a = margs(cache_form)
    caches = {"kv_cache": np.zeros((10, 16, rank_w), np.uint8),
              "k_pe_cache": None if cache_form == "combined" else np.zeros((10, 16, MLA_ROPE),
                                                                          np.uint8)}
    a.update(caches, kv_cache_dtype="fp8")
    assert mvalidate(**a).cache.name == "e4m3"
    if what == "token stride":  # rows of width + 8 bytes
        root = np.zeros((10, 16, rank_w + 8), np.uint8)
        a["kv_cache"] = fake_view(root[:, :, :rank_w], root)
        match = (r"kv_cache's block and token strides must be non-negative multiples of 16 "
                 rf"bytes \(mla_attention reads the cache 16 bytes at a time\), got "
                 rf"\({16 * (rank_w + 8)}, {rank_w + 8}, 1\)")
    elif what == "block stride":  # blocks of 16 rows and 8 bytes
        root = np.zeros((10, 16 * rank_w + 8), np.uint8)
        a["kv_cache"] = Fake(np.lib.stride_tricks.as_strided(
            root, (10, 16, rank_w), (16 * rank_w + 8, rank_w, 1)))
        match = "kv_cache's block and token strides must be non-negative multiples of 16 bytes"
    else:
        a[name] = Fake(caches[name] if caches[name] is not None else a[name],
                       ptr=(1 << 24) + 8)
        match = f"{name} must start on a 16-byte boundary"
    with pytest.raises(ValueError, match=match):
        mvalidate(**a)


def test_swap_blocks_between_two_host_arrays_is_a_value_error():
    """One side of a swap must be a device array: two host arrays (NumPy, torch CPU
    tensors) raise ValueError, before anything is uploaded or launched."""
    a, b = np.zeros((4, 16, 8), np.float16), np.zeros((4, 16, 8), np.float16)
    with pytest.raises(ValueError, match="src and dst are both host arrays: one side must be "
                                         "a device array"):
        cupaged.swap_blocks(a, b, np.array([[0, 1]], np.int64))
    with pytest.raises(ValueError, match="both host arrays"):
        cupaged.swap_blocks(a, b, [[0, 1]])


# ---- per-tensor scales: one parser, the same forms at every entry point ---------------------

# Accepted: (form, (device pointer or 0, the host value the kernels receive)).
SCALE_FORMS = [
    (0.5, (0, 0.5)), (2, (0, 2.0)), (np.float32(0.0173), (0, float(np.float32(0.0173)))),
    (np.float64(3.0), (0, 3.0)), (np.int64(4), (0, 4.0)),
    (1e-45, (0, 1e-45)),  # float32's smallest subnormal rounds to itself, positive
    (Fake(np.zeros((), np.float32), ptr=1 << 22), (1 << 22, 1.0)),
    (Fake(np.zeros((1,), np.float32), ptr=(1 << 22) + 4), ((1 << 22) + 4, 1.0)),
]
# Refused, with the exception and the message.
SCALE_REFUSALS = [
    (True, TypeError, "must be a number, a one-element CPU torch tensor or a float32 device "
                      "scalar, got bool"),
    ("0.5", TypeError, "got str"),
    (np.array(0.5, np.float32), TypeError, r"got a NumPy array \(host memory"),
    (0.0, ValueError, "must be a positive finite float32, got 0.0"),
    (-1.0, ValueError, "positive finite float32"),
    (float("inf"), ValueError, "positive finite float32"),
    (float("nan"), ValueError, "positive finite float32"),
    (1e39, ValueError, "positive finite float32"),
    (1e-50, ValueError, "positive finite float32"),  # 0 in float32
    (Fake(np.zeros((), np.float16)), TypeError, "must be float32 on the device, got float16"),
    (Fake(np.zeros((2,), np.float32)), ValueError, r"must be one float \(per tensor\)"),
    (Fake(np.zeros((), np.float32), ptr=(1 << 22) + 2), ValueError,
     "must start on a 4-byte boundary"),
]


@pytest.fixture
def scale_fakes(monkeypatch):
    """The scale parser takes Fake arrays as device arrays."""
    from cupaged import _kvquant

    real = _kvquant.as_device_array
    monkeypatch.setattr(_kvquant, "as_device_array",
                        lambda x, name: x if isinstance(x, Fake) else real(x, name))


@pytest.mark.parametrize("form, want", SCALE_FORMS, ids=lambda v: repr(v)[:24])
def test_per_tensor_scale_forms_are_accepted(scale_fakes, form, want):
    from cupaged import _kvquant

    for per_token in (True, False):
        ptr, value, _ = _kvquant.tensor_scale(form, "k_scale", per_token)
        assert (ptr, value) == want


@pytest.mark.parametrize("form, exc, match", SCALE_REFUSALS, ids=lambda v: repr(v)[:24])
def test_per_tensor_scale_forms_are_refused(scale_fakes, form, exc, match):
    from cupaged import _kvquant

    with pytest.raises(exc, match=match):
        _kvquant.tensor_scale(form, "k_scale")


def test_per_tensor_scales_as_cpu_torch_tensors():
    """A one-element CPU torch tensor gives its value (any float dtype, any shape of one
    element); more elements are refused, and so is a host tensor as a per-token array."""
    torch = pytest.importorskip("torch")
    from cupaged import _kvquant

    for t in (torch.tensor(0.25), torch.tensor([0.25], dtype=torch.float64),
              torch.tensor(0.25, dtype=torch.float16)):
        assert _kvquant.tensor_scale(t, "k_scale") == (0, 0.25, None)
    with pytest.raises(ValueError, match=r"k_scale must be one float \(per tensor\) or "
                                         r"\[num_blocks, num_kv_heads, block_size\] .*CPU "
                                         r"tensor of shape \(2,\)"):
        _kvquant.tensor_scale(torch.ones(2), "k_scale")
    with pytest.raises(ValueError, match=r"scale must be one float \(per tensor\), got a CPU "
                                         r"tensor of shape \(2,\): MLA's latent cache takes a "
                                         r"per-tensor scale only"):
        _kvquant.tensor_scale(torch.ones(2), "scale", per_token=False)
    with pytest.raises(ValueError, match="positive finite"):
        _kvquant.tensor_scale(torch.tensor(-2.0), "k_scale")


class _Parsed(Exception):
    """What the spy below raises: the value each entry point handed the scale parser."""


def _entry_point_checks(fake_device):
    """Each entry point that takes a per-tensor fp8 scale, as a function of that scale
    running its checks (on Fake arrays) up to the scale's: the attention validation of
    attention/AttentionPlan and of paged_attention (v1/v2), reshape_and_cache's,
    concat_and_cache_mla and mla_attention themselves."""
    from cupaged import mla, validation

    f16, u8 = np.float16, np.uint8
    q = Fake(np.zeros((3, 4, 64), f16))
    tables, lens = Fake(np.zeros((3, 4), np.int32)), Fake(np.zeros(3, np.int32))
    nhd = Fake(np.zeros((10, 16, 2, 64), u8))
    vk, vv = Fake(np.zeros((10, 2, 4, 16, 16), u8)), Fake(np.zeros((10, 2, 64, 16), u8))
    kv = Fake(np.zeros((3, 2, 64), f16))
    lat = Fake(np.zeros((10, 16, MLA_RANK + MLA_ROPE), u8), ptr=1 << 23)
    mq = Fake(np.zeros((3, 16, MLA_RANK + MLA_ROPE), f16))
    return {
        "attention": lambda s: validation.validate_varlen(
            q, nhd, nhd, tables, lens, None, None, None, "NHD", "fp8", s, s),
        "paged_attention": lambda s: validation.validate_decode(
            q, vk, vv, tables, lens, None, None, "fp8", s, s),
        "reshape_and_cache": lambda s: cache_ops.validate_write(
            kv, kv, nhd, Fake(np.zeros((10, 16, 2, 64), u8)), Fake(np.zeros(3, np.int64)),
            "NHD", "fp8", s, s),
        "concat_and_cache_mla": lambda s: cupaged.concat_and_cache_mla(
            Fake(np.zeros((3, MLA_RANK), f16)), Fake(np.zeros((3, MLA_ROPE), f16)), lat,
            Fake(np.zeros(0, np.int64)), "fp8", s),
        "mla_attention": lambda s: mla.mla_attention(
            mq, lat, tables, lens, scale=0.1, kv_cache_dtype="fp8", k_scale=s),
    }


ENTRY_POINTS = ("attention", "paged_attention", "reshape_and_cache", "concat_and_cache_mla",
                "mla_attention")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_parses_its_scale_with_the_one_parser(fake_device, monkeypatch,
                                                                 entry):
    """attention (and AttentionPlan, which validates as it), paged_attention (v1/v2),
    reshape_and_cache(_flash), concat_and_cache_mla and mla_attention hand a per-tensor
    scale to the same parser (_kvquant.tensor_scale), so they take the same forms."""
    from cupaged import _kvquant, mla

    monkeypatch.setattr(mla, "as_device_array", lambda x, name: x)
    monkeypatch.setattr(_arrays, "as_device_array", lambda x, name: x)
    seen = []

    def spy(x, name, per_token=True):
        seen.append((x, name, per_token))
        raise _Parsed

    monkeypatch.setattr(_kvquant, "tensor_scale", spy)
    marker = 0.375
    with pytest.raises(_Parsed):
        _entry_point_checks(fake_device)[entry](marker)
    name = "scale" if entry == "concat_and_cache_mla" else "k_scale"
    assert seen == [(marker, name, entry not in ("concat_and_cache_mla", "mla_attention"))]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("form, exc, match", [SCALE_REFUSALS[i] for i in (0, 2, 4, 8, 9, 10)],
                         ids=lambda v: repr(v)[:24])
def test_every_entry_point_refuses_the_same_scales(fake_device, scale_fakes, monkeypatch,
                                                   entry, form, exc, match):
    from cupaged import mla

    monkeypatch.setattr(mla, "as_device_array", lambda x, name: x)
    monkeypatch.setattr(_arrays, "as_device_array", lambda x, name: x)
    with pytest.raises(exc, match=match):
        _entry_point_checks(fake_device)[entry](form)


@gpu
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("src_dtype", ["float16", "bfloat16"])
def test_every_per_tensor_scale_form_writes_torchs_true_division(rng, fmt, src_dtype):
    """A per-tensor scale reaches the cache writes as one float32 value, whatever its form
    (a Python number, a NumPy float32, a CPU torch scalar of float32 or float64, a float32
    device scalar): reshape_and_cache and concat_and_cache_mla store the same bytes with
    each, those of torch's ``(x.float() / s).clamp(-max, max).to(float8)`` with ``s`` a
    float32 CUDA tensor (a true float32 division), bit for bit. The scale is not a power of
    two, so dividing by it and multiplying by its reciprocal can round apart."""
    torch = pytest.importorskip("torch")
    dev = "cuda"
    s = 0.0173
    tdt = getattr(torch, src_dtype)
    f8 = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
    fmax = float(torch.finfo(f8).max)
    forms = [s, np.float32(s), torch.tensor(s), torch.tensor(s, dtype=torch.float64),
             torch.tensor(s, dtype=torch.float32, device=dev),
             cupy.asarray(np.float32(s))]

    def torch_quantized(x):
        d = torch.tensor(s, dtype=torch.float32, device=dev)
        return (x.float() / d).clamp(-fmax, fmax).to(f8).view(torch.uint8)

    n, kvh, hs, bs = 40, 2, 64, 16
    # Magnitudes from 1e-3 to 1e2 of the scale's range: subnormals, rounding, saturation.
    mag = np.logspace(-3, 2, n)[:, None, None] * (fmax * s)
    x = torch.from_numpy(rng.standard_normal((n, kvh, hs)) * mag).to(dev, tdt)
    y = torch.from_numpy(rng.standard_normal((n, kvh, hs)) * (fmax * s)).to(dev, tdt)
    slots = torch.arange(n, device=dev)
    want_k, want_v = torch_quantized(x), torch_quantized(y)
    for form in forms:
        kc = torch.zeros(4, bs, kvh, hs, dtype=torch.uint8, device=dev)
        vc = torch.zeros_like(kc)
        cupaged.reshape_and_cache(x, y, kc, vc, slots, fmt, form, form, kv_layout="NHD")
        assert torch.equal(kc.view(-1, kvh, hs)[:n], want_k), repr(form)
        assert torch.equal(vc.view(-1, kvh, hs)[:n], want_v), repr(form)

    kv_c, k_pe = x.reshape(n, kvh * hs)[:, :MLA_ROPE * 2], y.reshape(n, kvh * hs)[:, :MLA_ROPE]
    kv_c = torch.cat([kv_c] * (MLA_RANK // (MLA_ROPE * 2)), 1).contiguous()
    k_pe = k_pe.contiguous()
    want = torch_quantized(torch.cat([kv_c, k_pe], 1))
    for form in forms:
        cache = torch.zeros(4, bs, MLA_RANK + MLA_ROPE, dtype=torch.uint8, device=dev)
        cupaged.concat_and_cache_mla(kv_c, k_pe, cache, slots, fmt, form)
        assert torch.equal(cache.view(-1, MLA_RANK + MLA_ROPE)[:n], want), repr(form)


# ---- fp8_ds_mla: DeepSeek-V3.2's sparse cache rows (concat_and_cache_mla) ---------------------

DS_BYTES = 656
BF16 = _dtypes.BF16.numpy


def dsargs(n=3, bs=16, nb=10, dtype=BF16, cache=None):
    return dict(kv_c=np.zeros((n, 512), dtype), k_pe=np.zeros((n, 64), dtype),
                kv_cache=np.zeros((nb, bs, DS_BYTES), np.uint8) if cache is None else cache,
                k_pe_cache=None, slot_mapping=np.zeros(n, np.int64),
                kv_cache_dtype="fp8_ds_mla")


def dsbad(**changes):
    a = dsargs()
    a.update(changes)
    return a


# DeepSeek-V4's rows: "v4_fp8" (528 bytes) and "v4_fp4" (288), 512 values a token split
# as kv_c's then k_pe's (the model's 448 and 64 here, unless a test says otherwise)
V4_FORMATS = ("v4_fp8", "v4_fp4")
SPARSE_FORMATS = ("fp8_ds_mla", *V4_FORMATS)
SPARSE_BYTES = {"fp8_ds_mla": DS_BYTES, "v4_fp8": 528, "v4_fp4": 288}
SPARSE_NAMES = {"fp8_ds_mla": "dsmla", "v4_fp8": "v4fp8", "v4_fp4": "v4fp4"}  # spec names


def v4args(fmt, n=3, bs=16, nb=10, dtype=BF16, rank=448, cache=None):
    return dict(kv_c=np.zeros((n, rank), dtype), k_pe=np.zeros((n, 512 - rank), dtype),
                kv_cache=(np.zeros((nb, bs, SPARSE_BYTES[fmt]), np.uint8) if cache is None
                          else cache),
                k_pe_cache=None, slot_mapping=np.zeros(n, np.int64), kv_cache_dtype=fmt)


def sparse_args(fmt, n=3):
    """A valid write's arguments in ``fmt`` (bfloat16 sources, a uint8 cache of 10 blocks
    of 16 tokens)."""
    return dsargs(n=n) if fmt == "fp8_ds_mla" else v4args(fmt, n=n)


def test_ds_mla_write_is_described():
    """One 656-byte row a token (strides in bytes), any 1-byte storage, FlashMLA's 4-D
    form too; kv_lora_rank 512 and rope_dim 64."""
    w = mvalidate(**dsargs())
    assert w.cache is _dtypes.DS_MLA and w.source is _dtypes.BF16
    assert (w.num_tokens, w.rank, w.rope, w.block_size, w.num_blocks) == (3, 512, 64, 16, 10)
    assert w.latent == w.rope_dst == (1 << 20, 16 * DS_BYTES, DS_BYTES) and w.vec_src
    for cache in (np.zeros((10, 64, 1, DS_BYTES), np.uint8), np.zeros((10, 64, DS_BYTES), np.int8),
                  np.zeros((10, 64, DS_BYTES), _dtypes.E4M3.numpy)):
        w = mvalidate(**dsargs(cache=cache))
        assert w.latent[1:] == (64 * DS_BYTES, DS_BYTES) and w.block_size == 64
    # a block-strided view (every other block) and a token-strided one (rows of 672 bytes)
    root = np.zeros((20, 16, DS_BYTES), np.uint8)
    assert mvalidate(**dsargs(cache=fake_view(root[::2], root))).latent[1:] == \
        (2 * 16 * DS_BYTES, DS_BYTES)
    wide = np.zeros((10, 16, 672), np.uint8)
    assert mvalidate(**dsargs(cache=fake_view(wide[:, :, :DS_BYTES], wide))).latent[1:] == \
        (16 * 672, 672)
    assert mvalidate(**dsargs(dtype=np.float16)).source is _dtypes.F16
    # sources: row-strided slices of wider rows (vector loads when 16-byte aligned)
    src = np.zeros((3, 600), BF16)
    assert mvalidate(**dsbad(kv_c=fake_view(src[:, 8:520], src))).vec_src
    assert not mvalidate(**dsbad(kv_c=fake_view(src[:, 1:513], src))).vec_src


@pytest.mark.parametrize("a, exc, match", [
    (dsbad(kv_c=np.zeros((3, 576), BF16)), ValueError,
     r"fp8_ds_mla holds kv_lora_rank 512 and rope_dim 64: kv_c must be \[num_tokens, 512\]"),
    (dsbad(k_pe=np.zeros((3, 32), BF16)), ValueError, r"k_pe must be \[num_tokens, 64\]"),
    (dsbad(kv_c=np.zeros((3, 512), np.float32), k_pe=np.zeros((3, 64), np.float32)), TypeError,
     "kv_c must be float16 or bfloat16"),
    (dsbad(k_pe=np.zeros((3, 64), np.float16)), TypeError, "k_pe dtype float16 does not match"),
    (dsbad(kv_c=np.zeros((3, 1024), BF16)[:, ::2]), ValueError,
     "kv_c's last dimension must be contiguous"),
    (dsbad(k_pe_cache=np.zeros((10, 16, 64), BF16)), ValueError,
     "fp8_ds_mla keeps k_pe in each token's 656-byte row of kv_cache: pass k_pe_cache=None"),
    (dsbad(kv_cache=np.zeros((10, 16, 328), np.float16)), TypeError,
     r"an fp8_ds_mla kv_cache is 1-byte storage \(uint8, int8 or a float8 type\)"),
    (dsbad(kv_cache=np.zeros((10, 16, 576), np.uint8)), ValueError,
     r"an fp8_ds_mla kv_cache must be \[num_blocks, block_size, 656\] \(or \[num_blocks, "
     r"block_size, 1, 656\], FlashMLA's\)"),
    (dsbad(kv_cache=np.zeros((10, 16, 2, DS_BYTES), np.uint8)), ValueError,
     r"must be \[num_blocks, block_size, 656\]"),
    (dsbad(kv_cache=np.zeros((10, DS_BYTES), np.uint8)), ValueError,
     r"must be \[num_blocks, block_size, 656\]"),
    (dsbad(kv_cache=np.zeros((10, 16, 2 * DS_BYTES), np.uint8)[:, :, ::2]), ValueError,
     "must have its rows contiguous"),
    (dsbad(kv_cache=np.zeros((10, 0, DS_BYTES), np.uint8)), ValueError,
     "kv_cache has blocks of 0 tokens"),
    (dsbad(kv_cache=Fake(np.zeros((10, 16, DS_BYTES), np.uint8), ptr=(1 << 20) + 8)), ValueError,
     "kv_cache must start on a 16-byte boundary"),
    (dsbad(kv_cache=np.zeros((10, 16, DS_BYTES + 8), np.uint8)[:, :, :DS_BYTES]), ValueError,
     r"kv_cache's block and token strides must be non-negative multiples of 16 bytes \(its "
     r"rows are written 16 bytes at a time\), got \(10624, 664, 1\)"),
    (dsbad(slot_mapping=np.zeros(3, np.float32)), TypeError, "slot_mapping must be int32 or int64"),
    (dsbad(slot_mapping=np.zeros(4, np.int64)), ValueError,
     "kv_c has 3 tokens but slot_mapping has 4"),
    (dsbad(k_pe=Fake(np.zeros((3, 64), BF16), device=1)), ValueError,
     "k_pe is on device 1 but kv_cache is on device 0"),
    # a 656-byte cache under another name: the message names the format
    (dsbad(kv_cache_dtype="auto"), TypeError,
     "kv_cache is uint8 with 656-byte rows: for DeepSeek-V3.2's sparse MLA cache pass "
     "kv_cache_dtype='fp8_ds_mla'"),
    (dsbad(kv_cache_dtype="fp8_e4m3"), ValueError,
     r"kv_cache's last dimension must be kv_lora_rank \+ rope_dim = 512 \+ 64"),
])
def test_bad_ds_mla_writes_are_refused_by_name(a, exc, match):
    with pytest.raises(exc, match=match):
        mvalidate(**a)


def v4bad(fmt, **changes):
    a = v4args(fmt)
    a.update(changes)
    return a


@pytest.mark.parametrize("fmt", V4_FORMATS)
def test_v4_write_is_described(fmt):
    """One row a token (528 or 288 bytes; strides in bytes), any 1-byte storage, FlashMLA's
    4-D form too; the token's 512 values split anywhere on a multiple of 8 between kv_c and
    k_pe, which may be column slices of one wider row."""
    nbytes = SPARSE_BYTES[fmt]
    w = mvalidate(**v4args(fmt))
    assert w.cache is _dtypes.SPARSE_KV_CACHE_DTYPES[fmt].dtype and w.source is _dtypes.BF16
    assert w.cache.name == SPARSE_NAMES[fmt] and w.cache.name in _dtypes.SPARSE_MLA
    assert (w.num_tokens, w.rank, w.rope, w.block_size, w.num_blocks) == (3, 448, 64, 16, 10)
    assert w.latent == w.rope_dst == (1 << 20, 16 * nbytes, nbytes) and w.vec_src
    for rank in (8, 256, 504):
        w = mvalidate(**v4args(fmt, rank=rank))
        assert (w.rank, w.rope) == (rank, 512 - rank)
    for cache in (np.zeros((10, 64, 1, nbytes), np.uint8), np.zeros((10, 64, nbytes), np.int8),
                  np.zeros((10, 64, nbytes), _dtypes.E4M3.numpy)):
        w = mvalidate(**v4args(fmt, cache=cache))
        assert w.latent[1:] == (64 * nbytes, nbytes) and w.block_size == 64
    # a block-strided view (every other block) and a token-strided one (16 bytes more a row)
    root = np.zeros((20, 16, nbytes), np.uint8)
    assert mvalidate(**v4args(fmt, cache=fake_view(root[::2], root))).latent[1:] == \
        (2 * 16 * nbytes, nbytes)
    wide = np.zeros((10, 16, nbytes + 16), np.uint8)
    assert mvalidate(**v4args(fmt, cache=fake_view(wide[:, :, :nbytes], wide))).latent[1:] == \
        (16 * (nbytes + 16), nbytes + 16)
    assert mvalidate(**v4args(fmt, dtype=np.float16)).source is _dtypes.F16
    # sources: kv_c and k_pe as column slices of one row (a fused projection's output, or
    # a whole [n, 512] vector cut at 448), vector loads when 16-byte aligned
    src = np.zeros((3, 600), BF16)
    w = mvalidate(**v4bad(fmt, kv_c=fake_view(src[:, 8:456], src),
                          k_pe=fake_view(src[:, 456:520], src)))
    assert (w.rank, w.rope) == (448, 64) and w.vec_src
    assert not mvalidate(**v4bad(fmt, kv_c=fake_view(src[:, 1:449], src),
                                 k_pe=fake_view(src[:, 449:513], src))).vec_src
    # a float8 cache as wide as the rows under "auto" is a dense fp8 latent cache
    dense = mvalidate(**v4bad(fmt, kv_c=np.zeros((3, nbytes - 64), BF16),
                              kv_cache=np.zeros((10, 16, nbytes), _dtypes.E4M3.numpy),
                              kv_cache_dtype="auto"))
    assert dense.cache is _dtypes.E4M3 and (dense.rank, dense.rope) == (nbytes - 64, 64)


def _v4_bad_cases(fmt):
    nbytes = SPARSE_BYTES[fmt]
    split = (rf"{fmt} holds 512 values a token, kv_c's then k_pe's: kv_c must be \[num_tokens, "
             rf"r\] and k_pe \[num_tokens, 512 - r\], r and 512 - r positive multiples of 8 "
             rf"\(DeepSeek-V4's 448 latent and 64 rotary values\), got shapes ")
    what = {"v4_fp8": "DeepSeek-V4's fp8 sparse MLA cache",
            "v4_fp4": "DeepSeek-V4's fp4 sparse MLA cache"}[fmt]
    other = SPARSE_BYTES["v4_fp4" if fmt == "v4_fp8" else "v4_fp8"]
    return [
        (v4bad(fmt, kv_c=np.zeros((3, 512), BF16)), ValueError,
         split + r"\(3, 512\) and \(3, 64\)"),
        (v4bad(fmt, kv_c=np.zeros((3, 452), BF16), k_pe=np.zeros((3, 60), BF16)), ValueError,
         split + r"\(3, 452\) and \(3, 60\)"),
        (v4bad(fmt, kv_c=np.zeros((3, 512), BF16), k_pe=np.zeros((3, 0), BF16)), ValueError,
         split + r"\(3, 512\) and \(3, 0\)"),
        (v4bad(fmt, kv_c=np.zeros((3, 0), BF16), k_pe=np.zeros((3, 512), BF16)), ValueError,
         split + r"\(3, 0\) and \(3, 512\)"),
        (v4bad(fmt, kv_c=np.zeros((3, 448), np.float32), k_pe=np.zeros((3, 64), np.float32)),
         TypeError, "kv_c must be float16 or bfloat16"),
        (v4bad(fmt, k_pe=np.zeros((3, 64), np.float16)), TypeError,
         "k_pe dtype float16 does not match"),
        (v4bad(fmt, kv_c=np.zeros((3, 896), BF16)[:, ::2]), ValueError,
         "kv_c's last dimension must be contiguous"),
        (v4bad(fmt, k_pe=np.zeros((3, 1, 64), BF16)), ValueError,
         r"k_pe must be 2-D \[num_tokens, dims\]"),
        (v4bad(fmt, k_pe_cache=np.zeros((10, 16, 64), BF16)), ValueError,
         rf"{fmt} keeps k_pe in each token's {nbytes}-byte row of kv_cache: pass k_pe_cache=None"),
        (v4bad(fmt, kv_cache=np.zeros((10, 16, nbytes // 2), np.float16)), TypeError,
         rf"a {fmt} kv_cache is 1-byte storage \(uint8, int8 or a float8 type\) \[num_blocks, "
         rf"block_size, {nbytes}\], got float16"),
        (v4bad(fmt, kv_cache=np.zeros((10, 16, DS_BYTES), np.uint8)), ValueError,
         rf"a {fmt} kv_cache must be \[num_blocks, block_size, {nbytes}\] \(or \[num_blocks, "
         rf"block_size, 1, {nbytes}\], FlashMLA's\), got shape \(10, 16, 656\)"),
        (v4bad(fmt, kv_cache=np.zeros((10, 16, other), np.uint8)), ValueError,
         rf"a {fmt} kv_cache must be \[num_blocks, block_size, {nbytes}\]"),
        (v4bad(fmt, kv_cache=np.zeros((10, 16, 2, nbytes), np.uint8)), ValueError,
         rf"must be \[num_blocks, block_size, {nbytes}\]"),
        (v4bad(fmt, kv_cache=np.zeros((10, 16, 2 * nbytes), np.uint8)[:, :, ::2]), ValueError,
         rf"a {fmt} kv_cache must have its rows contiguous"),
        (v4bad(fmt, kv_cache=np.zeros((10, 0, nbytes), np.uint8)), ValueError,
         "kv_cache has blocks of 0 tokens"),
        (v4bad(fmt, kv_cache=Fake(np.zeros((10, 16, nbytes), np.uint8), ptr=(1 << 20) + 8)),
         ValueError, "kv_cache must start on a 16-byte boundary"),
        (v4bad(fmt, kv_cache=np.zeros((10, 16, nbytes + 8), np.uint8)[:, :, :nbytes]), ValueError,
         rf"kv_cache's block and token strides must be non-negative multiples of 16 bytes \(its "
         rf"rows are written 16 bytes at a time\), got \({16 * (nbytes + 8)}, {nbytes + 8}, 1\)"),
        (v4bad(fmt, slot_mapping=np.zeros(3, np.float32)), TypeError,
         "slot_mapping must be int32 or int64"),
        (v4bad(fmt, slot_mapping=np.zeros(4, np.int64)), ValueError,
         "kv_c has 3 tokens but slot_mapping has 4"),
        (v4bad(fmt, k_pe=Fake(np.zeros((3, 64), BF16), device=1)), ValueError,
         "k_pe is on device 1 but kv_cache is on device 0"),
        # a uint8 or int8 cache of the format's rows under "auto": the message names it
        (v4bad(fmt, kv_cache_dtype="auto"), TypeError,
         rf"kv_cache is uint8 with {nbytes}-byte rows: for {what} pass kv_cache_dtype='{fmt}' "
         rf"\(for an fp8 latent cache, 'fp8_e4m3' or 'fp8_e5m2'\)"),
        (v4bad(fmt, kv_cache=np.zeros((10, 16, 1, nbytes), np.int8), kv_cache_dtype=None),
         TypeError, rf"kv_cache is int8 with {nbytes}-byte rows: for {what} pass "
                    rf"kv_cache_dtype='{fmt}'"),
        (v4bad(fmt, kv_cache_dtype="fp8_e4m3"), ValueError,
         rf"kv_cache's last dimension must be kv_lora_rank \+ rope_dim = 448 \+ 64"),
    ]


@pytest.mark.parametrize("fmt, a, exc, match", [(fmt, *case) for fmt in V4_FORMATS
                                                for case in _v4_bad_cases(fmt)])
def test_bad_v4_writes_are_refused_by_name(fmt, a, exc, match):
    with pytest.raises(exc, match=match):
        mvalidate(**a)


def test_sparse_formats_are_the_references():
    """The host's bytes a token per kv_cache_dtype are reference.SPARSE_KV_FORMATS' (the
    statement of the bytes), and each names a cache type that concat_and_cache_mla takes."""
    from cupaged import jit

    assert set(_dtypes.SPARSE_KV_CACHE_DTYPES) == set(reference.SPARSE_KV_FORMATS)
    for name, fmt in _dtypes.SPARSE_KV_CACHE_DTYPES.items():
        assert (fmt.nbytes, fmt.values) == reference.SPARSE_KV_FORMATS[name]
        assert fmt.nbytes == SPARSE_BYTES[name] and fmt.dtype.name == SPARSE_NAMES[name]
    assert "concat_and_cache_mla" in jit.SPARSE_MLA_KERNELS


@pytest.mark.parametrize("fmt", SPARSE_FORMATS)
def test_sparse_write_launches_a_warp_per_token_and_ignores_scale(monkeypatch, fmt):
    """Four tokens a CTA (ceil(num_tokens / 4) CTAs), the rows' bytes and strides, the
    split of the token's values (fp8_ds_mla's 512 and 64; V4's kv_c and k_pe widths), and
    no scale read or checked (vLLM's kernel ignores the one it is passed: the formats
    compute their own)."""
    monkeypatch.setattr(cache_ops, "as_device_array",
                        lambda x, name: x if isinstance(x, Fake) else Fake(x))
    monkeypatch.setattr(_arrays, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_arrays, "context",
                        lambda device, kind, stream=None: _arrays.Context(device, 7, "cupy", False))
    launches = []

    def kernel(device, name, dtype, index, cache_dtype=""):
        return lambda grid, block, smem, stream, *args: launches.append(
            (name, dtype, index, cache_dtype, grid, block, stream, args))

    monkeypatch.setattr(cache_ops, "_kernel", kernel)
    nbytes = SPARSE_BYTES[fmt]
    a = sparse_args(fmt, n=9)
    args = [Fake(a[k], ptr=1 << 20) if k == "kv_cache" else Fake(a[k])
            for k in ("kv_c", "k_pe", "kv_cache", "slot_mapping")]
    for scale in (None, 1.0, -1.0, Fake(np.zeros((10, 1, 16), np.float32), device=3)):
        cupaged.concat_and_cache_mla(*args, fmt, scale)
    assert len(launches) == 4 and len(set(launches)) == 1
    name, dtype, index, cache, grid, block, stream, p = launches[0]
    assert (name, dtype, index, cache, grid, block, stream) == (
        "concat_and_cache_mla", "bf16", "i64", SPARSE_NAMES[fmt], (3, 1, 1), 128, 7)
    # kv_c, stride, k_pe, stride, rows (ptr, block, token) twice, slots, num_tokens, the
    # widths, block size, num_slots, vec, no scale
    assert p[4:7] == (1 << 20, 16 * nbytes, nbytes) and p[4:7] == p[7:10]
    assert p[11:] == (9, a["kv_c"].shape[1], a["k_pe"].shape[1], 16, 160, 1, 0, 1.0)
    assert len(p) == len(jit_arg_tokens("concat_and_cache_mla"))
    cupaged.concat_and_cache_mla(*[Fake(x) for x in (a["kv_c"][:0], a["k_pe"][:0])],
                                 args[2], Fake(a["slot_mapping"][:0]), fmt, None)
    assert len(launches) == 4  # no tokens: no launch


def jit_arg_tokens(kernel):
    from cupaged import jit

    return jit.ARG_TOKEN.findall(jit.ARG_FORMATS[kernel])


REFUSALS = {
    fmt: (rf"kv_cache_dtype='{fmt}' \({re.escape(what)}\) is held by PagedMLACache, written "
          r"by concat_and_cache_mla, copied by copy_blocks_mla / swap_blocks and read by "
          r"sparse_mla_attention only")
    for fmt, what in (("fp8_ds_mla", "DeepSeek-V3.2's sparse MLA cache"),
                      ("v4_fp8", "DeepSeek-V4's fp8 sparse MLA cache"),
                      ("v4_fp4", "DeepSeek-V4's fp4 sparse MLA cache"))
}


@pytest.mark.parametrize("fmt", SPARSE_FORMATS)
def test_entry_points_that_do_not_take_a_sparse_format_refuse_it_by_name(fmt):
    """PagedMLACache holds the formats, concat_and_cache_mla writes them and
    sparse_mla_attention reads them: every other entry point that takes a kv_cache_dtype
    names the format in its refusal, and kernel specs take the cache types where a kernel
    has them (the wgmma sparse kernel V3.2's alone)."""
    from cupaged import jit, sparse_mla, validation
    from test_validation import args as dargs

    said = REFUSALS[fmt]
    a = wargs()
    f = {k: Fake(a[k]) for k in ("key", "value", "key_cache", "value_cache", "slot_mapping")}
    with pytest.raises(ValueError, match=said):
        cache_ops.validate_write(f["key"], f["value"], f["key_cache"], f["value_cache"],
                                  f["slot_mapping"], "NHD", fmt)
    d = {k: (None if v is None else Fake(v)) for k, v in dargs().items()}
    with pytest.raises(ValueError, match=said):
        validation.validate_decode(*d.values(), kv_cache_dtype=fmt)
    q = Fake(np.zeros((2, 16, 576), BF16))
    cache = Fake(np.zeros((10, 16, SPARSE_BYTES[fmt]), np.uint8))
    with pytest.raises(ValueError, match=said):
        validation.validate_mla(q, cache, None, Fake(np.zeros((2, 4), np.int32)),
                                Fake(np.zeros(2, np.int32)), None, None, None, None, fmt)
    with pytest.raises(ValueError, match=said):
        cupaged.PagedKVCache(1, 4, 2, 64, 16, kv_cache_dtype=fmt)
    assert sparse_mla._sparse_rows(fmt, cache, q) == fmt
    assert sparse_mla._sparse_rows("auto", cache, q) == fmt  # found by its width
    takers = ("concat_and_cache_mla, widen_sparse_rows, mla_sparse_attention, "
              "mla_sparse_attention_sm90")
    name = SPARSE_NAMES[fmt]
    with pytest.raises(ValueError, match=f"is taken by {takers} only"):
        jit.KernelSpec("reshape_and_cache", "bf16", cache_dtype=name, index_dtype="i64")
    with pytest.raises(ValueError, match=f"is taken by {takers} only"):
        jit.KernelSpec("mla_attention", "bf16", 512, 16, cache_dtype=name)
    for kernel in ("mla_sparse_attention", "mla_sparse_attention_sm90"):
        spec = jit.KernelSpec(kernel, "bf16", 512, 16, cache_dtype=name)
        assert spec.rope_dim == (64 if fmt == "fp8_ds_mla" else 0)


@pytest.mark.parametrize("fmt", SPARSE_FORMATS)
@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
def test_sparse_writers_compile_for_every_target(arch, fmt):
    """Each format's four specializations (float16 / bfloat16 sources, int32 / int64
    slots) through NVRTC and ptxas (no GPU): sm_80 the software e4m3 conversion, sm_89 and
    sm_90a the instruction; the launch packs what they take."""
    from cupaged import jit
    from test_jit import _mangled_params

    name = SPARSE_NAMES[fmt]
    specs = [jit.KernelSpec("concat_and_cache_mla", d, cache_dtype=name, index_dtype=i,
                            arch=arch) for d in ("f16", "bf16") for i in ("i32", "i64")]
    assert specs[3].name == f"concat_and_cache_mla_bf16_{name}_i64_{arch.replace('_', '')}"
    cxx = {"fp8_ds_mla": "fp8_ds_mla_t", "v4_fp8": "v4_fp8_t", "v4_fp4": "v4_fp4_t"}[fmt]
    assert specs[3].name_expression == ("cupaged::concat_and_cache_mla<cupaged::bfloat16_t, "
                                        f"cupaged::{cxx}, long long>")
    binary, lowered = jit._compile("cache_ops.cu", arch, [s.name_expression for s in specs],
                                   f"{name}_{arch}")
    assert binary
    for s in specs:
        assert _mangled_params(lowered[s.name_expression]) == jit.ARG_FORMATS[s.kernel]


@pytest.mark.parametrize("fmt", SPARSE_FORMATS)
@pytest.mark.parametrize("flashmla", [False, True], ids=["blocks", "flashmla"])
def test_copy_blocks_mla_copies_sparse_blocks(fake_device, fmt, flashmla):
    """A sparse cache's blocks are runs of block_size * row bytes (656, 528, 288: multiples
    of 16): copy_blocks_mla moves them whole, in either form."""
    nbytes = SPARSE_BYTES[fmt]
    shape = (10, 64, 1, nbytes) if flashmla else (10, 64, nbytes)
    layers = [Fake(np.zeros(shape, np.uint8), ptr=(1 << 24) * (i + 1)) for i in range(2)]
    cupaged.copy_blocks_mla(layers, Fake(np.zeros((4, 2), np.int64)))
    (tensors, block_bytes, src_blocks, dst_blocks), = fake_device
    assert (block_bytes, src_blocks, dst_blocks) == (64 * nbytes, 10, 10)
    assert tensors == [(c.data.ptr, c.data.ptr, 64 * nbytes, 64 * nbytes) for c in layers]


# The GPU writer against the reference, byte for byte.


def _ds_bf16(bits):
    return np.asarray(bits, np.uint16).view(BF16)


def ds_edge_rows(dtype, rng):
    """kv_c [n, 512] and k_pe [n, 64] rows of the values the format's rules single out:
    zeros, -0, subnormals, outliers far past 448 x the rest, NaN of both signs, infinities,
    a group of NaN only, ties of e4m3's rounding, a value saturating after the division,
    and random magnitudes."""
    n = 16
    kv_c = testing.random_normal((n, 512), np.float32, rng)
    k_pe = testing.random_normal((n, 64), np.float32, rng)
    kv_c[0] = 0
    k_pe[0] = 0
    kv_c[1] = -0.0
    k_pe[1] = -0.0
    tiny = np.float32(1e-39 if dtype == BF16 else 1e-7)  # subnormal in the source's type
    kv_c[2] = tiny * rng.integers(-3, 4, 512)
    k_pe[2] = tiny
    kv_c[3, ::37] = 3e38 if dtype == BF16 else 6e4  # outliers: the rest underflows
    kv_c[3, 1::37] = -1e-3
    kv_c[4, [0, 130, 300, 511]] = np.nan
    k_pe[4, [1, 2]] = np.nan
    kv_c[5, 5] = np.inf
    kv_c[5, 140] = -np.inf
    kv_c[5, 260:270] = np.inf  # several infinities in one group
    k_pe[5, :3] = [np.inf, -np.inf, np.nan]
    kv_c[6, 128:256] = np.nan  # a group of NaN only: FLT_MIN, 0x7F bytes
    kv_c[7] = np.float32(448) * rng.choice([1, 0.5, 0.75, 1.125, 1.0625, 2 ** -7, 2 ** -9], 512)
    kv_c[8] = rng.standard_normal(512) * np.float32(10.0) ** rng.integers(-6, 6, 512)
    kv_c[9] *= 1e4
    kv_c[10] *= 1e-4
    kv_c = kv_c.astype(dtype)
    k_pe = k_pe.astype(dtype)
    if dtype == BF16:  # NaN with the sign bit and a signalling payload
        kv_c[4, 1:3] = _ds_bf16([0xFFC0, 0xFF81])
        k_pe[4, 3:5] = _ds_bf16([0xFFC0, 0x7F81])
    else:
        kv_c[4, 1:3] = np.array([0xFE00, 0xFC01], np.uint16).view(np.float16)
        k_pe[4, 3:5] = np.array([0xFE00, 0x7C01], np.uint16).view(np.float16)
    return kv_c, k_pe


def _sparse_reference(kv_c, k_pe, cache, slots, fmt="fp8_ds_mla"):
    """What the write must leave in ``cache`` (a host copy), through the reference
    (``k_pe`` None: V4's tokens whole in ``kv_c``)."""
    nbytes = SPARSE_BYTES[fmt]
    want = cache.copy()
    rows = want.reshape(want.shape[0], want.shape[1], nbytes)
    nslots = rows.shape[0] * rows.shape[1]
    s = np.asarray(slots).astype(np.int64)
    reference.concat_and_cache_sparse_mla(kv_c[:len(s)], None if k_pe is None else k_pe[:len(s)],
                                          rows, np.where(s < nslots, s, -1), fmt)
    return want


def sparse_slots(num_slots, n, slot_dtype, rng):
    """n distinct slots of a cache of ``num_slots`` for the byte-for-byte tests (n > 33):
    the first 16 (the edge rows') inside the cache, then padding (-1, -7) and slots past
    the cache, which the writer skips."""
    slots = rng.permutation(num_slots)[:n].astype(slot_dtype)
    slots[[20, 33]] = -1
    slots[25] = -7
    slots[30] = num_slots  # past the cache: skipped
    slots[31] = num_slots + 1000
    return slots


def sparse_cache_views(form, nb, bs, nbytes, rng, write):
    """``(root, view, want)``: a poisoned allocation of ``nb`` blocks of ``bs`` rows of
    ``nbytes``, the cache that ``view(root)`` takes of it in ``form`` ("blocks" itself,
    "flashmla" ``[nb, bs, 1, nbytes]``, "strided" every other block of an allocation with
    rows 16 bytes longer, "int8" storage), and the allocation as it must be after
    ``write`` (the reference, on a contiguous copy of the rows) fills the cache."""
    if form == "strided":
        root = rng.integers(0, 256, (2 * nb, bs, nbytes + 16), dtype=np.uint8)
        view = lambda r: r[::2, :, :nbytes]  # noqa: E731
    else:
        root = rng.integers(0, 256, (nb, bs, nbytes), dtype=np.uint8)
        view = {"blocks": lambda r: r, "flashmla": lambda r: r.reshape(nb, bs, 1, nbytes),
                "int8": lambda r: r.view(np.int8)}[form]
    want = root.copy()
    rows = write(np.ascontiguousarray(view(want).view(np.uint8).reshape(-1, bs, nbytes)))
    if form == "strided":
        want[::2, :, :nbytes] = rows
    else:
        want = rows.reshape(root.shape)
    return root, view, want


def v4_edge_rows(fmt, dtype, rng, nan=None):
    """kv_c [16, 448] and k_pe [16, 64]: 512-value tokens of the values V4's rules single
    out: zeros, -0, subnormals, outliers far past the rest, infinities (one, several in a
    group, of both signs), all-zero groups, a value saturating after the division, ties
    of e4m3's and e2m1's rounding (groups whose scale is exact), groups above 448 x 6 (the
    fp4 scale's ceiling), values spread over twelve decades, random magnitudes 1e-6 to 1e4.
    NaN (``nan``, default: for v4_fp8 only; the reference refuses it in v4_fp4): of both
    signs, a group of NaN only, NaN beside an infinity."""
    nan = fmt == "v4_fp8" if nan is None else nan
    n = 16
    x = testing.random_normal((n, 512), np.float32, rng)
    x[0] = 0
    x[1] = -0.0
    tiny = np.float32(1e-39 if dtype == BF16 else 1e-7)  # subnormal in the source's type
    x[2] = tiny * rng.integers(-3, 4, 512)
    x[3, ::37] = 3e38 if dtype == BF16 else 6e4  # outliers: the rest underflows
    x[3, 1::37] = -1e-3
    x[4, 5] = np.inf
    x[4, 140] = -np.inf
    x[4, 260:270] = np.inf  # several infinities in one group
    x[4, 300:310] = -np.inf
    x[5, :32] = x[5, 160:192] = x[5, 480:] = 0  # all-zero groups (of 32 and of 16)
    x[6] = np.float32(448) * rng.choice([1, 0.5, 0.75, 1.125, 1.0625, 2 ** -7, 2 ** -9], 512)
    # e2m1's ties and steps, in groups of 16 led by 6 * 2^k: amax / 6 is 2^k, an exact scale
    k = rng.integers(-8, 9, 32).repeat(16)
    ties = [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6]
    x[7] = rng.choice(ties, 512) * rng.choice([-1, 1], 512) * np.exp2(k)
    x[7, ::16] = 6 * np.exp2(k[::16])
    x[8] = rng.standard_normal(512) * np.float32(10.0) ** rng.integers(-6, 6, 512)
    x[9] = rng.standard_normal(512) * np.float32(3000 if dtype != BF16 else 1e30)  # > 448 * 6
    for r, mag in zip(range(10, 16), (1e-6, 1e-4, 1e-2, 1, 1e2, 1e4)):
        x[r] *= np.float32(mag)
    if nan:
        x[11, [0, 33, 300, 511]] = np.nan
        x[12, 64:96] = np.nan  # a group of NaN only: the smallest scale, 0x7F bytes
        x[13, 200] = np.nan
        x[13, 201] = np.inf  # NaN beside an infinity
    with np.errstate(over="ignore"):  # float16: the widest spread saturates to inf
        x = x.astype(dtype)
    if nan:  # NaN with the sign bit and a signalling payload
        x[11, 1:3] = (_ds_bf16([0xFFC0, 0xFF81]) if dtype == BF16
                      else np.array([0xFE00, 0xFC01], np.uint16).view(np.float16))
    return x[:, :448], x[:, 448:]


def sparse_edge_rows(fmt, dtype, rng):
    """The format's edge rows, kv_c and k_pe."""
    return ds_edge_rows(dtype, rng) if fmt == "fp8_ds_mla" else v4_edge_rows(fmt, dtype, rng)


def sparse_tokens(fmt, n, dtype, rng):
    """n tokens in ``fmt``: its 16 edge rows then random normal ones, kv_c and k_pe."""
    kv_c, k_pe = sparse_edge_rows(fmt, dtype, rng)
    return (np.concatenate([kv_c, testing.random_normal((n - 16, kv_c.shape[1]), dtype, rng)]),
            np.concatenate([k_pe, testing.random_normal((n - 16, k_pe.shape[1]), dtype, rng)]))


@gpu
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64], ids=_ids)
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=_ids)
@pytest.mark.parametrize("bs", [1, 16, 64])
def test_ds_mla_write_matches_the_reference_byte_for_byte(rng, dtype, slot_dtype, bs):
    """Random tokens and the edge rows, in a number of tokens that leaves the last CTA's
    warps partly idle; padding and out-of-range slots write nothing, source rows past
    num_tokens are not read, every byte no slot names keeps its value."""
    nb = 64 // bs + 12  # at least 76 slots for 45 tokens
    n = 45
    kv_c, k_pe = sparse_tokens("fp8_ds_mla", n, dtype, rng)
    slots = sparse_slots(nb * bs, n, slot_dtype, rng)
    cache0 = rng.integers(0, 256, (nb, bs, DS_BYTES), dtype=np.uint8)
    want = _sparse_reference(kv_c, k_pe, cache0, slots)
    pad = np.full((5, kv_c.shape[1]), np.nan, dtype)  # rows past num_tokens: not read
    d_kv_c = cupy.asarray(np.concatenate([kv_c, pad]))
    d_k_pe = cupy.asarray(np.concatenate([k_pe, pad[:, :64]]))
    kc = cupy.asarray(cache0)
    cupaged.concat_and_cache_mla(d_kv_c, d_k_pe, kc, cupy.asarray(slots), "fp8_ds_mla")
    got = cupy.asnumpy(kc)
    bad = np.argwhere(got != want)
    assert not bad.size, (f"{len(bad)} bytes differ, first at {bad[0]}: got "
                          f"{got[tuple(bad[0])]:#04x}, want {want[tuple(bad[0])]:#04x}")
    # what the format says of three edge rows, independently of the reference (the 16 edge
    # rows' slots are all inside the cache)
    rows = got.reshape(-1, DS_BYTES)  # slot s is row s
    row = lambda t: rows[int(slots[t])]  # noqa: E731
    flt_min = np.float32(1.1754943508222875e-38)
    assert not row(0)[:512].any() and (row(0)[512:528].view(np.float32) == flt_min).all()
    assert (row(4)[[0, 1, 2, 130, 300, 511]] == 0x7F).all()  # NaN of either sign
    assert (row(6)[128:256] == 0x7F).all() and row(6)[516:520].view(np.float32)[0] == flt_min


@gpu
@pytest.mark.parametrize("form", ["blocks", "flashmla", "strided", "int8"])
@pytest.mark.parametrize("source", ["contiguous", "strided", "unaligned"])
def test_ds_mla_write_into_views(rng, form, source):
    """The cache as FlashMLA's [nb, bs, 1, 656], as every other block of a wider
    allocation with rows of 672 bytes, or int8 storage; the sources as 16-byte aligned
    row-strided slices (vector loads) or slices one element in (element loads)."""
    nb, bs, n = 6, 16, 23
    kv_c, k_pe = sparse_tokens("fp8_ds_mla", n, BF16, rng)
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    slots[3] = -1
    root0, view, want_root = sparse_cache_views(
        form, nb, bs, DS_BYTES, rng, lambda rows: _sparse_reference(kv_c, k_pe, rows, slots))
    if source == "contiguous":
        d_kv_c, d_k_pe = cupy.asarray(kv_c), cupy.asarray(k_pe)
    else:
        off = 8 if source == "strided" else 1  # 16 bytes in, or 2
        wide = np.zeros((n, 512 + 64 + 3 * off), BF16)
        wide[:, off:off + 512] = kv_c
        wide[:, 2 * off + 512:2 * off + 576] = k_pe
        dw = cupy.asarray(wide)
        d_kv_c, d_k_pe = dw[:, off:off + 512], dw[:, 2 * off + 512:2 * off + 576]
    root = cupy.asarray(root0)
    kc = view(root)
    w = cache_ops.validate_mla_write(d_kv_c, d_k_pe, kc, None, cupy.asarray(slots),
                                      "fp8_ds_mla")
    assert w.vec_src == (source != "unaligned")
    cupaged.concat_and_cache_mla(d_kv_c, d_k_pe, kc, cupy.asarray(slots), "fp8_ds_mla")
    np.testing.assert_array_equal(cupy.asnumpy(root), want_root)


# DeepSeek-V4's rows on the GPU against the reference, byte for byte.


def _v4_groups(row, fmt):
    """A v4 row's values' bytes (fp8) or nibble codes (fp4) [512] and its scale bytes."""
    if fmt == "v4_fp8":
        return row[:512], row[512:]
    return np.stack([row[:256] & 0xF, row[:256] >> 4], -1).reshape(512), row[256:]


@gpu
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64], ids=_ids)
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=_ids)
@pytest.mark.parametrize("bs", [1, 16, 64])
@pytest.mark.parametrize("fmt", V4_FORMATS)
def test_v4_write_matches_the_reference_byte_for_byte(rng, fmt, dtype, slot_dtype, bs):
    """The edge rows (v4_edge_rows: NaN in v4_fp8 only) and random tokens at magnitudes
    1e-6 to 1e4, in a number of tokens that leaves the last CTA's warps partly idle;
    padding and out-of-range slots write nothing, source rows past num_tokens are not
    read, every byte no slot names keeps its poison."""
    nb = 64 // bs + 12  # at least 76 slots for 45 tokens
    nbytes = SPARSE_BYTES[fmt]
    n = 45
    kv_c, k_pe = sparse_tokens(fmt, n, dtype, rng)
    mags = np.float32(10.0) ** rng.integers(-6, 5, (n - 16, 1))
    kv_c[16:] = (kv_c[16:].astype(np.float32) * mags).astype(dtype)
    k_pe[16:] = (k_pe[16:].astype(np.float32) * mags).astype(dtype)
    slots = sparse_slots(nb * bs, n, slot_dtype, rng)
    cache0 = rng.integers(0, 256, (nb, bs, nbytes), dtype=np.uint8)
    want = _sparse_reference(kv_c, k_pe, cache0, slots, fmt)
    pad = np.full((5, 512), np.nan, dtype)  # rows past num_tokens: not read
    d_kv_c = cupy.asarray(np.concatenate([kv_c, pad[:, :448]]))
    d_k_pe = cupy.asarray(np.concatenate([k_pe, pad[:, 448:]]))
    kc = cupy.asarray(cache0)
    cupaged.concat_and_cache_mla(d_kv_c, d_k_pe, kc, cupy.asarray(slots), fmt)
    got = cupy.asnumpy(kc)
    bad = np.argwhere(got != want)
    assert not bad.size, (f"{len(bad)} bytes differ, first at {bad[0]}: got "
                          f"{got[tuple(bad[0])]:#04x}, want {want[tuple(bad[0])]:#04x}")
    # what the format says of edge rows, independently of the reference (the 16 edge rows'
    # slots are all inside the cache)
    rows = got.reshape(-1, nbytes)  # slot s is row s
    row = lambda t: _v4_groups(rows[int(slots[t])], fmt)  # noqa: E731
    smallest = 1 if fmt == "v4_fp8" else 0x01  # 2^-126 (ue8m0 byte 1), 2^-9 (e4m3 byte 1)
    values, scales = row(0)  # zeros
    assert not values.any() and (scales == smallest).all()
    values, scales = row(1)  # -0: the sign bit alone
    assert (values == (0x80 if fmt == "v4_fp8" else 0x8)).all()
    values, scales = row(4)  # infinities
    group = 32 if fmt == "v4_fp8" else 16
    inf_scale, inf_max = (127, 0x7E) if fmt == "v4_fp8" else (0x7E, 0x7)
    for at, sign in ((5, 0), (140, 1), (265, 0), (305, 1)):
        assert scales[at // group] == inf_scale
        assert values[at] == inf_max | (sign << (7 if fmt == "v4_fp8" else 3))
    if fmt == "v4_fp8":  # NaN of either sign 0x7F; a group of NaN only gets 2^-126
        values, scales = row(11)
        assert (values[[0, 1, 2, 33, 300, 511]] == 0x7F).all()
        values, scales = row(12)
        assert (values[64:96] == 0x7F).all() and scales[2] == 1
        values, scales = row(13)
        assert values[200] == 0x7F and values[201] == 0x7E and scales[200 // 32] == 127


@gpu
@pytest.mark.parametrize("source", ["contiguous", "strided", "unaligned", "whole", "halves"])
@pytest.mark.parametrize("form", ["blocks", "flashmla", "strided", "int8"])
@pytest.mark.parametrize("fmt", V4_FORMATS)
def test_v4_write_into_views(rng, fmt, form, source):
    """The cache as FlashMLA's [nb, bs, 1, bytes], as every other block of a wider
    allocation with rows 16 bytes longer, or int8 storage; the sources as their own arrays
    (448 and 64), as 16-byte aligned column slices of one wider row (vector loads), as
    slices one element in (element loads), as one [n, 512] array cut at 448, or cut at 256
    (kv_c and k_pe of 256 each)."""
    nb, bs, n = 6, 16, 23
    nbytes = SPARSE_BYTES[fmt]
    kv_c, k_pe = sparse_tokens(fmt, n, BF16, rng)
    x = np.concatenate([kv_c, k_pe], -1)  # [n, 512]
    rank = 256 if source == "halves" else 448
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    slots[3] = -1
    root0, view, want_root = sparse_cache_views(  # the reference takes the whole vector
        form, nb, bs, nbytes, rng, lambda rows: _sparse_reference(x, None, rows, slots, fmt))
    if source in ("contiguous", "halves"):
        d_kv_c, d_k_pe = cupy.asarray(x[:, :rank]), cupy.asarray(x[:, rank:])
    elif source == "whole":
        dx = cupy.asarray(x)
        d_kv_c, d_k_pe = dx[:, :rank], dx[:, rank:]
    else:
        off = 8 if source == "strided" else 1  # 16 bytes in, or 2
        wide = np.zeros((n, 512 + 3 * off), BF16)
        wide[:, off:off + 448] = x[:, :448]
        wide[:, 2 * off + 448:2 * off + 512] = x[:, 448:]
        dw = cupy.asarray(wide)
        d_kv_c, d_k_pe = dw[:, off:off + 448], dw[:, 2 * off + 448:2 * off + 512]
    root = cupy.asarray(root0)
    kc = view(root)
    w = cache_ops.validate_mla_write(d_kv_c, d_k_pe, kc, None, cupy.asarray(slots), fmt)
    assert w.vec_src == (source != "unaligned") and (w.rank, w.rope) == (rank, 512 - rank)
    cupaged.concat_and_cache_mla(d_kv_c, d_k_pe, kc, cupy.asarray(slots), fmt)
    np.testing.assert_array_equal(cupy.asnumpy(root), want_root)


@gpu
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=_ids)
def test_v4_fp4_stores_nan_as_zero(rng, dtype):
    """e2m1 has no NaN and the writer cannot raise (the reference does): a NaN value, of
    either sign, is skipped by its group's amax and stored as code 0, so the row is the
    reference's for the token with 0 in the NaN's place; a group of NaN only is a group of
    zeros (scale 2^-9), and NaN beside an infinity leaves the infinity's scale (448)."""
    kv_c, k_pe = v4_edge_rows("v4_fp4", dtype, rng, nan=True)
    x = np.concatenate([kv_c, k_pe], -1)
    nan = np.isnan(x.astype(np.float32))
    assert nan[11].sum() == 6 and nan[12, 64:96].all()
    zeroed = np.where(nan, np.zeros((), dtype), x)
    slots = np.arange(16, dtype=np.int64)
    want = _sparse_reference(zeroed, None, np.zeros((1, 16, 288), np.uint8), slots, "v4_fp4")
    kc = cupy.zeros((1, 16, 288), cupy.uint8)
    cupaged.concat_and_cache_mla(cupy.asarray(kv_c), cupy.asarray(k_pe), kc,
                                 cupy.asarray(slots), "v4_fp4")
    got = cupy.asnumpy(kc)
    np.testing.assert_array_equal(got, want)
    rows = got.reshape(16, 288)
    for t in (11, 12, 13):
        codes, scales = _v4_groups(rows[t], "v4_fp4")
        assert not codes[nan[t]].any()
    assert (_v4_groups(rows[12], "v4_fp4")[1][4:6] == 0x01).all()  # the NaN-only groups
    assert _v4_groups(rows[13], "v4_fp4")[1][201 // 16] == 0x7E  # beside the infinity


@gpu
@pytest.mark.parametrize("fmt", SPARSE_FORMATS)
def test_sparse_write_with_torch_tensors_and_vllms_arguments(rng, fmt):
    """vLLM's call: torch bfloat16 sources, a uint8 cache (and float8_e4m3fn storage), int64
    slots and a scale tensor that the formats ignore, on torch's current stream."""
    torch = pytest.importorskip("torch")
    nb, bs, n = 4, 64, 37
    nbytes = SPARSE_BYTES[fmt]
    kv_c, k_pe = sparse_tokens(fmt, n, BF16, rng)
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    want = _sparse_reference(kv_c, k_pe, np.zeros((nb, bs, nbytes), np.uint8), slots, fmt)
    for storage in (torch.uint8, torch.float8_e4m3fn):
        cache = torch.zeros((nb, bs, nbytes), dtype=torch.uint8, device="cuda").view(storage)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            cupaged.concat_and_cache_mla(_torch_of(kv_c, torch), _torch_of(k_pe, torch), cache,
                                         torch.from_numpy(slots).cuda(), fmt,
                                         torch.ones((), dtype=torch.float32, device="cuda"))
        s.synchronize()
        np.testing.assert_array_equal(cache.view(torch.uint8).cpu().numpy(), want)


@gpu
@pytest.mark.parametrize("fmt", SPARSE_FORMATS)
def test_sparse_write_in_a_cuda_graph(rng, fmt):
    """A captured write replays with the sources' new values (no host sync in the call)."""
    nb, bs, n = 4, 16, 10
    nbytes = SPARSE_BYTES[fmt]
    a = sparse_args(fmt)
    rank, rope = a["kv_c"].shape[1], a["k_pe"].shape[1]
    kv_c = cupy.asarray(testing.random_normal((n, rank), BF16, rng))
    k_pe = cupy.asarray(testing.random_normal((n, rope), BF16, rng))
    kc = cupy.zeros((nb, bs, nbytes), cupy.uint8)
    slots = cupy.asarray(rng.permutation(nb * bs)[:n].astype(np.int32))
    cupaged.concat_and_cache_mla(kv_c, k_pe, kc, slots, fmt)  # loaded
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        cupaged.concat_and_cache_mla(kv_c, k_pe, kc, slots, fmt)
        graph = stream.end_capture()
    for _ in range(2):
        c = testing.random_normal((n, rank), BF16, rng) * np.float32(rng.uniform(0.01, 100))
        p = testing.random_normal((n, rope), BF16, rng)
        kv_c[...] = cupy.asarray(c.astype(BF16))
        k_pe[...] = cupy.asarray(p)
        kc[...] = 0
        cupy.cuda.Device().synchronize()  # those ran on another stream than the replay's
        graph.launch(stream)
        stream.synchronize()
        want = _sparse_reference(c.astype(BF16), p, np.zeros((nb, bs, nbytes), np.uint8),
                                 cupy.asnumpy(slots), fmt)
        np.testing.assert_array_equal(cupy.asnumpy(kc), want)


@gpu
@pytest.mark.parametrize("fmt", SPARSE_FORMATS)
def test_sparse_out_of_range_slots_are_skipped_or_reported(rng, monkeypatch, fmt):
    a = sparse_args(fmt)
    kc = cupy.asarray(rng.integers(0, 256, (2, 4, SPARSE_BYTES[fmt]), dtype=np.uint8))
    before = cupy.asnumpy(kc)
    kv_c = cupy.asarray(np.ones((3, a["kv_c"].shape[1]), BF16))
    k_pe = cupy.asarray(np.ones((3, a["k_pe"].shape[1]), BF16))
    slots = cupy.asarray([8, 2 ** 40, -5], np.int64)  # the cache has 8 slots
    cupaged.concat_and_cache_mla(kv_c, k_pe, kc, slots, fmt)
    np.testing.assert_array_equal(cupy.asnumpy(kc), before)
    monkeypatch.setattr(cupaged._checks, "DEBUG", True)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 8 is past the cache \(8 slots\)"):
        cupaged.concat_and_cache_mla(kv_c, k_pe, kc, slots, fmt)


@gpu
@pytest.mark.parametrize("fmt", SPARSE_FORMATS)
def test_sparse_software_conversion_gives_the_same_bytes(rng, monkeypatch, fmt):
    """CUPAGED_FP8_SOFTWARE=1 compiles the integer e4m3 conversion sm_80/86 run: the same
    bytes as the instruction (NaN of either sign 0x7F, saturation, ties; v4_fp4's e4m3
    scales), on the edge rows."""
    from cupaged import jit

    nbytes = SPARSE_BYTES[fmt]
    kv_c, k_pe = sparse_edge_rows(fmt, BF16, rng)
    slots = np.arange(16, dtype=np.int64)
    want = _sparse_reference(kv_c, k_pe, np.zeros((1, 16, nbytes), np.uint8), slots, fmt)
    monkeypatch.setenv("CUPAGED_FP8_SOFTWARE", "1")
    jit.clear_memory_caches()
    try:
        kc = cupy.zeros((1, 16, nbytes), cupy.uint8)
        cupaged.concat_and_cache_mla(cupy.asarray(kv_c), cupy.asarray(k_pe), kc,
                                     cupy.asarray(slots), fmt)
        np.testing.assert_array_equal(cupy.asnumpy(kc), want)
    finally:
        monkeypatch.delenv("CUPAGED_FP8_SOFTWARE")
        jit.clear_memory_caches()


@gpu
@pytest.mark.parametrize("fmt", SPARSE_FORMATS)
@pytest.mark.parametrize("form", ["blocks", "flashmla"])
def test_copy_blocks_mla_and_swap_blocks_on_sparse_caches(rng, form, fmt):
    """Blocks written by the sparse writer: copied within each layer by copy_blocks_mla,
    out to pinned host memory and back by swap_blocks, byte for byte, the rest untouched."""
    nb, bs = 8, 16
    nbytes = SPARSE_BYTES[fmt]
    shape = (nb, bs, nbytes) if form == "blocks" else (nb, bs, 1, nbytes)
    a = sparse_args(fmt)
    rank, rope = a["kv_c"].shape[1], a["k_pe"].shape[1]
    layers = []
    for _ in range(2):
        kc = cupy.asarray(rng.integers(0, 256, shape, dtype=np.uint8))
        n = 3 * bs
        cupaged.concat_and_cache_mla(cupy.asarray(testing.random_normal((n, rank), BF16, rng)),
                                     cupy.asarray(testing.random_normal((n, rope), BF16, rng)),
                                     kc, cupy.arange(n, dtype=cupy.int64), fmt)
        layers.append(kc)
    before = [cupy.asnumpy(c) for c in layers]
    cupaged.copy_blocks_mla(layers, cupy.asarray([[0, 5], [2, 7]], np.int32))
    for c, b in zip(layers, before):
        want = b.copy()
        want[5], want[7] = b[0], b[2]
        np.testing.assert_array_equal(cupy.asnumpy(c), want)
    pinned = cupaged.empty_pinned((3, *shape[1:]), np.uint8)
    cupaged.swap_blocks(layers[0], pinned, np.array([[1, 0], [5, 2]], np.int64))
    cupy.cuda.get_current_stream().synchronize()
    host = cupy.asnumpy(layers[0])
    np.testing.assert_array_equal(pinned[0], host[1])
    np.testing.assert_array_equal(pinned[2], host[5])
    cupaged.swap_blocks(pinned, layers[1], cupy.asarray(np.array([[0, 3], [2, 4]], np.int32)))
    want = cupy.asnumpy(layers[1])
    want[3], want[4] = host[1], host[5]
    np.testing.assert_array_equal(cupy.asnumpy(layers[1]), want)


# ---- indexer_k_quant_and_cache (DSA's lightning indexer) ---------------------------------------


def ivalidate(k=None, cache=None, slots=None, quant_block_size=128, scale_fmt=None):
    k = np.zeros((3, 128), BF16) if k is None else k
    cache = np.zeros((10, 64, 132), np.uint8) if cache is None else cache
    slots = np.zeros(3, np.int64) if slots is None else slots
    f = [x if isinstance(x, Fake) else Fake(x) for x in (k, cache, slots)]
    return cache_ops.validate_indexer_write(*f, quant_block_size, scale_fmt)


def test_indexer_write_is_described():
    """vLLM's [num_blocks, block_size, 132] uint8 cache (and the 4-D form, a block-strided
    view, other groups), the kernel's arguments."""
    w = ivalidate()
    assert (w.num_tokens, w.head_dim, w.quant_block_size, w.block_size, w.num_blocks) == \
        (3, 128, 128, 64, 10)
    assert w.block_stride == 64 * 132 and w.index == "i64" and not w.ue8m0
    assert ivalidate(cache=np.zeros((10, 64, 1, 132), np.int8), scale_fmt="ue8m0").ue8m0
    w = ivalidate(cache=np.zeros((10, 16, 136), np.uint8), quant_block_size=64)
    assert w.block_size == 16 and w.block_stride == 16 * 136
    root = np.zeros((20, 64, 132), np.uint8)
    assert ivalidate(cache=fake_view(root[::2], root)).block_stride == 2 * 64 * 132
    assert ivalidate(k=np.zeros((5, 32), np.float16), cache=np.zeros((4, 8, 36), np.uint8),
                     quant_block_size=32).head_dim == 32
    # head_dim 96: three values a lane, one group of all 32 lanes
    assert ivalidate(k=np.zeros((3, 96), BF16), cache=np.zeros((10, 64, 100), np.uint8),
                     quant_block_size=96).quant_block_size == 96


@pytest.mark.parametrize("kw, exc, match", [
    (dict(k=np.zeros((3, 128), np.float32)), TypeError, "k must be float16 or bfloat16"),
    (dict(k=np.zeros((3, 2, 64), BF16)), ValueError, r"k must be 2-D \[num_tokens, head_dim\]"),
    (dict(k=np.zeros((3, 256), BF16)[:, ::2]), ValueError, "k's last dimension must be contiguous"),
    (dict(k=np.zeros((3, 96), BF16), cache=np.zeros((10, 64, 108), np.uint8),
          quant_block_size=32), ValueError, "a power-of-two multiple of head_dim / 32"),
    (dict(k=np.zeros((3, 192), BF16), cache=np.zeros((10, 64, 204), np.uint8),
          quant_block_size=64), ValueError, "a power-of-two multiple of head_dim / 32"),
    (dict(k=np.zeros((3, 48), BF16)), ValueError, "head_dim must be a multiple of 32"),
    (dict(quant_block_size=100), ValueError, "quant_block_size must divide head_dim"),
    (dict(quant_block_size=0), ValueError, "quant_block_size must divide head_dim"),
    (dict(quant_block_size=128.0), TypeError, "quant_block_size must be an int"),
    (dict(scale_fmt="e8m0"), ValueError, "scale_fmt must be None .* or 'ue8m0'"),
    (dict(cache=np.zeros((10, 64, 132), np.float16)), TypeError, "1-byte storage"),
    (dict(cache=np.zeros((10, 64, 136), np.uint8)), ValueError,
     r"kv_cache must be \[num_blocks, block_size, 132\]"),
    (dict(cache=np.zeros((10, 64, 140), np.uint8)[:, :, :132]), ValueError,
     "each block of kv_cache must be one contiguous run of block_size \\* 132 bytes"),
    (dict(slots=np.zeros(4, np.int64)), ValueError, "k has 3 tokens but slot_mapping has 4"),
    (dict(slots=np.zeros(3, np.float32)), TypeError, "slot_mapping"),
])
def test_bad_indexer_writes_are_refused_by_name(kw, exc, match):
    with pytest.raises(exc, match=match):
        ivalidate(**kw)


def test_indexer_cache_blocks_must_be_4_byte_aligned():
    with pytest.raises(ValueError, match="start at 4-byte boundaries"):
        ivalidate(cache=Fake(np.zeros((10, 64, 132), np.uint8), ptr=(1 << 20) + 2))


@gpu
@pytest.mark.parametrize("head_dim, quant_block_size", [(128, 128), (128, 32), (64, 64),
                                                        (256, 64), (32, 32), (96, 96),
                                                        (512, 128)])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_indexer_write_matches_the_reference_byte_for_byte(rng, head_dim, quant_block_size,
                                                          scale_fmt, dtype):
    """Random keys of magnitudes 2^-20 to 2^10, rows of zeros, NaN, +-inf and values past
    448 x scale's reach; padding and out-of-range slots write nothing, rows past num_tokens
    are not read, every byte no slot names keeps its value."""
    bs, nb, n = 64, 6, 70
    width = head_dim + 4 * (head_dim // quant_block_size)
    k = testing.random_normal((n, head_dim), np.float32, rng)
    k *= 2.0 ** rng.integers(-20, 11, (n, 1))
    k[0] = 0
    k[1, 3] = np.nan
    k[2, 5], k[2, 6] = np.inf, -np.inf
    k[3, :] = np.nan
    k[4, 0] = 1e4  # one outlier: the rest of its group quantizes to small values
    k = k.astype(dtype)
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    slots[[10, 20]] = -1
    slots[30] = nb * bs
    cache0 = rng.integers(0, 256, (nb, bs, width), dtype=np.uint8)
    want = cache0.copy()  # (the reference takes slots inside the cache: the others skipped)
    reference.indexer_k_quant_and_cache(k, want, np.where(slots < nb * bs, slots, -1),
                                        quant_block_size, ue8m0=scale_fmt == "ue8m0")
    dk = cupy.asarray(np.concatenate([k, np.full((3, head_dim), np.nan, dtype)]))
    kc = cupy.asarray(cache0)
    cupaged.indexer_k_quant_and_cache(dk, kc, cupy.asarray(slots), quant_block_size,
                                      scale_fmt)
    got = cupy.asnumpy(kc)
    bad = np.argwhere(got != want)
    assert not bad.size, (f"{len(bad)} bytes differ, first at {bad[0]}: got "
                          f"{got[tuple(bad[0])]:#04x}, want {want[tuple(bad[0])]:#04x}")
    # independently of the reference: a zero row stores zeros and the floor scale
    b, o = divmod(int(slots[0]), bs)
    blk = got[b].reshape(-1)
    assert not blk[o * head_dim:(o + 1) * head_dim].any()
    s0 = blk[bs * head_dim + 4 * o * (head_dim // quant_block_size):][:4].view(np.float32)[0]
    floor = np.float32(1e-4) / np.float32(448)
    assert s0 == (floor if scale_fmt is None else np.float32(2.0 ** np.ceil(np.log2(floor))))


@gpu
def test_indexer_write_from_torch_with_vllms_arguments(rng):
    torch = pytest.importorskip("torch")
    k = torch.randn(9, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(4, 64, 132, dtype=torch.uint8, device="cuda")
    slots = torch.tensor([3, 70, -1, 200, 5, 6, 7, 8, 255], dtype=torch.int64, device="cuda")
    cupaged.indexer_k_quant_and_cache(k, cache, slots, 128, "ue8m0")
    want = np.zeros((4, 64, 132), np.uint8)
    reference.indexer_k_quant_and_cache(k.float().cpu().numpy(), want, slots.cpu().numpy(),
                                        128, ue8m0=True)
    assert (cache.cpu().numpy() == want).all()
