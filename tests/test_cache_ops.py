"""reshape_and_cache, copy_blocks and swap_blocks on the GPU against NumPy, and an
end-to-end decode loop through PagedKVCache against the float64 reference."""

import cupy
import numpy as np
import pytest

import cupaged
from cupaged import PagedKVCache, _dtypes, reference, testing
from conftest import assert_close

pytestmark = pytest.mark.gpu

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), _dtypes.BF16.numpy]


def write_reference(kc, vc, key, value, slots):
    """NumPy: what reshape_and_cache must leave in the caches."""
    kc, vc = kc.copy(), vc.copy()
    bs, x = kc.shape[3], kc.shape[4]
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        b, off = divmod(int(slot), bs)
        kc[b, :, :, off, :] = key[t].reshape(key.shape[1], -1, x)
        vc[b, :, :, off] = value[t]
    return kc, vc


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("hs, bs", [(64, 1), (128, 16), (40, 32), (256, 8)])
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_reshape_and_cache_matches_numpy(rng, dtype, hs, bs, slot_dtype):
    kvh, n = 2, 20
    nb = max(12, -(-2 * n // bs))  # room for every token, with slots to spare
    kc, vc = testing.random_cache(nb, kvh, hs, bs, dtype, rng)
    # key/value as slices of one fused [tokens, 3, kv_heads, hs] buffer: row-strided
    fused = testing.random_normal((n, 3, kvh, hs), dtype, rng)
    key, value = fused[:, 1], fused[:, 2]
    slots = rng.choice(nb * bs, size=n, replace=False).astype(slot_dtype)
    slots[rng.random(n) < 0.25] = -1  # padding tokens
    want_k, want_v = write_reference(kc, vc, key, value, slots)
    d_kc, d_vc = cupy.asarray(kc), cupy.asarray(vc)
    d_fused = cupy.asarray(fused)
    cupaged.reshape_and_cache(d_fused[:, 1], d_fused[:, 2], d_kc, d_vc, cupy.asarray(slots))
    np.testing.assert_array_equal(cupy.asnumpy(d_kc).view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(cupy.asnumpy(d_vc).view(np.uint8), want_v.view(np.uint8))


def test_reshape_and_cache_errors(rng):
    kc, vc = (cupy.asarray(a) for a in testing.random_cache(4, 2, 64, 16, np.float16, rng))
    k = cupy.zeros((3, 2, 64), np.float16)
    with pytest.raises(ValueError, match=r"slot_mapping must be a contiguous array of shape \(3,\)"):
        cupaged.reshape_and_cache(k, k, kc, vc, cupy.zeros(4, np.int64))
    with pytest.raises(TypeError, match="slot_mapping must be int32 or int64, got float32"):
        cupaged.reshape_and_cache(k, k, kc, vc, cupy.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, 2, 64\]"):
        cupaged.reshape_and_cache(k[:, :1], k, kc, vc, cupy.zeros(3, np.int64))
    with pytest.raises(TypeError, match="value dtype float32 does not match"):
        cupaged.reshape_and_cache(k, k.astype(np.float32), kc, vc, cupy.zeros(3, np.int64))
    with pytest.raises(TypeError, match="slot_mapping is a NumPy array"):
        cupaged.reshape_and_cache(k, k, kc, vc, np.zeros(3, np.int64))


def test_out_of_range_slots_are_skipped_or_reported(rng, monkeypatch):
    kc, vc = (cupy.asarray(a) for a in testing.random_cache(2, 1, 32, 4, np.float32, rng))
    before = cupy.asnumpy(kc)
    k = cupy.ones((1, 1, 32), np.float32)
    cupaged.reshape_and_cache(k, k, kc, vc, cupy.asarray([8], np.int64))  # cache has 8 slots
    np.testing.assert_array_equal(cupy.asnumpy(kc), before)
    monkeypatch.setattr(cupaged._checks, "DEBUG", True)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 8 is past the cache \(8 slots\)"):
        cupaged.reshape_and_cache(k, k, kc, vc, cupy.asarray([8], np.int64))


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


def test_copy_blocks_errors(rng):
    k, v = (cupy.asarray(a) for a in testing.random_cache(4, 2, 64, 8, np.float16, rng))
    with pytest.raises(ValueError, match="lists of one length"):
        cupaged.copy_blocks([k, k], [v], cupy.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match=r"block_mapping must be \[num_pairs, 2\]"):
        cupaged.copy_blocks([k], [v], cupy.zeros((3,), np.int64))
    k2, v2 = (cupy.asarray(a) for a in testing.random_cache(5, 2, 64, 8, np.float16, rng))
    with pytest.raises(ValueError, match=r"key_caches\[1\] .* differs from key_caches\[0\]"):
        cupaged.copy_blocks([k, k2], [v, v2], cupy.zeros((1, 2), np.int64))


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


def test_swap_refuses_pageable_memory(rng):
    dev = cupy.zeros((4, 2, 8, 16, 8), np.float16)
    with pytest.raises(TypeError, match="pageable host memory.*cupaged.empty_pinned"):
        cupaged.swap_blocks(dev, np.zeros((4, 2, 8, 16, 8), np.float16), [[0, 1]])
    with pytest.raises(ValueError, match="same dtype and block shape"):
        cupaged.swap_blocks(dev, cupaged.empty_pinned((4, 2, 8, 8, 8), np.float16), [[0, 1]])


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16)], ids=lambda d: d.name)
def test_decode_loop_with_forks_and_frees(rng, dtype):
    """Dozens of steps over many sequences: prompts, forks (copy-on-write), frees; every
    step writes random K/V through reshape_and_cache and checks paged_attention against
    the float64 reference over each sequence's dense history, layer by layer."""
    layers, kvh, heads, hs, bs = 2, 2, 4, 64, 4
    cache = PagedKVCache(layers, 96, kvh, hs, bs, dtype)
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
    assert cache.num_used_blocks == 0 and checked > 200


def test_accounting():
    cache = PagedKVCache(4, 10, 2, 64, 16, "bfloat16")
    assert cache.bytes_per_block == 2 * 4 * 2 * 64 * 16 * 2
    cache.add("a", 40)
    assert cache.num_used_blocks == 3 and cache.num_free_blocks == 7
    assert cache.bytes_in_use == 3 * cache.bytes_per_block
    bt, cl = cache.tables(["a"])
    assert cl.tolist() == [40] and bt.shape == (1, 3)


# ---- regressions from the issue-10 review -------------------------------------------------------


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


def test_copy_blocks_on_two_streams_one_busy(rng):
    """The same caches copied on a busy stream A, then on stream B: B's copy must happen
    (it used to reuse a pointer table still queued for upload on A: block 6 never copied)."""
    from cupaged.bench import _Spin

    ks, vs = _layers(rng, 2)
    m1 = cupy.asarray([[1, 2]], np.int64)
    m2 = cupy.asarray([[0, 6]], np.int64)
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    spin = _Spin(100_000)
    cupaged.copy_blocks([cupy.zeros_like(ks[0])], [cupy.zeros_like(vs[0])], m1)  # kernel loaded
    before = [(cupy.asnumpy(k), cupy.asnumpy(v)) for k, v in zip(ks, vs)]
    cupy.cuda.Device().synchronize()
    with a:
        spin()
    cupaged.copy_blocks(ks, vs, m1, stream=a)
    cupaged.copy_blocks(ks, vs, m2, stream=b)
    cupy.cuda.Device().synchronize()
    _expect_copied(ks, vs, before, [(1, 2), (0, 6)])


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


def test_copy_blocks_spans_several_launches_for_many_layers(rng):
    """More tensors than one launch's parameter table holds (96): 60 layers."""
    ks, vs = _layers(rng, 60, nb=4)
    before = [(cupy.asnumpy(k), cupy.asnumpy(v)) for k, v in zip(ks, vs)]
    cupaged.copy_blocks(ks, vs, cupy.asarray([[0, 3], [1, 2]], np.int64))
    _expect_copied(ks, vs, before, [(0, 3), (1, 2)])


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


def test_empty_batches_in_the_cache_kernels(rng):
    kc, vc = (cupy.asarray(a) for a in testing.random_cache(4, 2, 64, 16, np.float16, rng))
    before = cupy.asnumpy(kc)
    k = cupy.zeros((0, 2, 64), np.float16)
    assert k.strides == (0, 0, 0)
    cupaged.reshape_and_cache(k, k, kc, vc, cupy.zeros((0,), np.int64))
    cupaged.copy_blocks([kc], [vc], cupy.zeros((0, 2), np.int32))
    host = cupaged.empty_pinned(kc.shape, np.float16)
    cupaged.swap_blocks(kc, host, np.zeros((0, 2), np.int64))
    cupaged.swap_blocks(kc, host, cupy.zeros((0, 2), np.int64))
    np.testing.assert_array_equal(cupy.asnumpy(kc), before)
