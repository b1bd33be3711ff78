"""DeepSeek sparse attention's float64 reference (``reference.sparse_mla_attention``) and its
cache formats, on the CPU: the attention against a brute-force loop over (row, head, entry)
and against the dense references, FlashMLA's index rules case by case, the formats' writers
and readers against each other with error bounds, the fp8_ds_mla writer bit for bit against
a second implementation in torch, and the element conversions against torch, ml_dtypes
and explicit tables; the lightning indexer's cache layout, logits and top-k against loops,
and the indexer, the slots and the sparse attention chained against the dense MLA
reference."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cupaged import reference as R

BF16 = ml_dtypes.bfloat16


def bf16(rng, *shape, spread=1.0):
    """Random bfloat16 values, never zero: normal times a per-row magnitude."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-1, 1, shape[:-1] + (1,)) * spread)
    x = np.where(x == 0, 0.5, x)
    return x.astype(BF16)


def token(cache, kv_format, slot):
    """One token's values, read by block and offset (divmod), not through a flat view."""
    c = np.asarray(cache)
    c = c.reshape(c.shape[0], -1, c.shape[-1]) if c.ndim == 4 else c
    if c.ndim == 2:  # prefill: [s_kv, width]
        row = c[slot]
    else:
        b, o = divmod(int(slot), c.shape[1])
        row = c[b, o]
    return R.dequantize_sparse_kv(row[None], kv_format)[0]


def brute(q, caches, indices, lengths, sinks, scale, d_v, kv_format="auto", decode=True):
    """out and lse by loops: every (row, head), the counted entries listed one by one."""
    if decode:
        b, s_q, h, _ = q.shape
        rows = [(i, j) for i in range(b) for j in range(s_q)]
    else:
        s_q, h, _ = q.shape
        rows = [(j,) for j in range(s_q)]
    out = np.zeros(q.shape[:-1] + (d_v,))
    lse = np.full(q.shape[:-1], -np.inf)
    for r in rows:
        keys = []
        for cache, idx, length in zip(caches, indices, lengths):
            n = math.prod(np.asarray(cache).shape[:-1])
            row_idx = idx[r] if decode else np.asarray(idx).reshape(s_q, -1)[r]
            limit = len(row_idx) if length is None else int(length[r[0]])
            for e in range(len(row_idx)):
                if e >= limit:
                    break
                i = int(row_idx[e])
                if i == -1 or (not decode and not 0 <= i < n):
                    continue
                keys.append(token(cache, kv_format, i))
        for hh in range(h):
            if not keys:
                continue
            logits = [scale * float(np.dot(q[r][hh].astype(np.float64), k)) for k in keys]
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            den = sum(w)
            o = sum(wi * k[:d_v] for wi, k in zip(w, keys)) / den
            l_ = m + math.log(den)
            if sinks is not None:
                o = o * (1.0 / (1.0 + math.exp(float(sinks[hh]) - l_))) \
                    if sinks[hh] != math.inf else o * 0
            out[r][hh] = o
            lse[r][hh] = l_
    return out, lse


def check(got, want, tol=1e-12):
    """Per-row and global relative error, rows that must be zero exactly zero."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    flat_g = got.reshape(-1, got.shape[-1])
    flat_w = want.reshape(-1, want.shape[-1])
    for g, w in zip(flat_g, flat_w):
        n = np.abs(w).max()
        if n == 0:
            assert not g.any()
        else:
            assert np.abs(g - w).max() <= tol * n
    assert np.abs(got - want).max() <= tol * max(np.abs(want).max(), 1e-300)


def check_lse(got, want):
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    f = np.isfinite(want)
    assert np.abs(got[f] - want[f]).max(initial=0) <= 1e-12 * max(1, np.abs(want[f]).max(initial=0))


# ---- attention ------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("sink", [False, True])
def test_decode_matches_brute_force(rng, extra, sink):
    b, s_q, h, d, page, blocks, topk = 2, 3, 4, 576, 8, 5, 16
    q = bf16(rng, b, s_q, h, d)
    cache = bf16(rng, blocks, page, 1, d)
    n = blocks * page
    idx = rng.integers(0, n, (b, s_q, topk)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1
    idx[0, 0, 1] = idx[0, 0, 0]  # a duplicate
    idx[1, 2, :4] = [page - 1, page, n - 1, 0]  # block boundaries, the first and last slots
    tl = np.array([topk, 5], np.int32)
    idx[1, :, 5:] = 2**31 - 1  # past topk_length: never read, never checked
    sinks = rng.standard_normal(h).astype(np.float32) if sink else None
    kw = dict(scale=0.07, topk_length=tl, attn_sink=sinks, return_lse=True)
    caches, indices, lengths = [cache], [idx], [tl]
    if extra:
        cache2 = bf16(rng, 3, 4, 1, d)  # another page size
        idx2 = rng.integers(-1, 12, (b, s_q, 6)).astype(np.int32)
        tl2 = np.array([3, 6], np.int32)
        kw.update(extra_kv_cache=cache2, extra_indices=idx2, extra_topk_length=tl2)
        caches, indices, lengths = caches + [cache2], indices + [idx2], lengths + [tl2]
    out, lse = R.sparse_mla_attention(q, cache, idx, **kw)
    want, want_lse = brute(q, caches, indices, lengths, sinks, 0.07, 512)
    assert out.shape == (b, s_q, h, 512) and lse.shape == (b, s_q, h)
    check(out, want)
    check_lse(lse, want_lse)


def test_prefill_matches_brute_force(rng):
    s_q, s_kv, h, d, topk = 5, 40, 4, 512, 12
    q = bf16(rng, s_q, h, d)
    kv = bf16(rng, s_kv, 1, d)
    idx = rng.integers(0, s_kv, (s_q, 1, topk)).astype(np.int32)
    bad = np.array([-1, -2, -2**31, s_kv, 114514, 2**31 - 1], np.int32)  # all invalid here
    mask = rng.random(idx.shape) < 0.3
    idx[mask] = rng.choice(bad, int(mask.sum()))
    idx[4] = -1  # a row with no valid index
    tl = np.array([12, 0, 7, 12, 12], np.int32)
    sinks = np.array([0.5, -np.inf, np.inf, -1.0], np.float32)
    out, lse = R.sparse_mla_attention(q, kv, idx, scale=0.05, topk_length=tl, attn_sink=sinks,
                                      return_lse=True)
    want, want_lse = brute(q, [kv], [idx], [tl], sinks, 0.05, 512, decode=False)
    check(out, want)
    check_lse(lse, want_lse)
    assert not out[[1, 4]].any() and np.isneginf(lse[[1, 4]]).all()
    assert not out[:, 2].any()  # a +inf sink: zeros
    # [s_q, topk] indices are the same call
    check(R.sparse_mla_attention(q, kv, idx[:, 0], scale=0.05, topk_length=tl,
                                 attn_sink=sinks), out, 0)


def test_all_indices_into_a_sequence_is_dense_mla(rng):
    """Indices naming every token of each sequence (in any order): reference.mla_attention
    over the same cache through block tables, out and lse."""
    h, page, blocks = 4, 4, 12
    cache = bf16(rng, blocks, page, 576)
    lens = np.array([9, 13])
    tables = np.array([[3, 7, 0, 5], [11, 1, 2, 8]])
    q = bf16(rng, 2, h, 576)
    topk = 16
    idx = np.full((2, 1, topk), -1, np.int32)
    for s in range(2):
        slots = [tables[s, t // page] * page + t % page for t in range(lens[s])]
        idx[s, 0, :lens[s]] = rng.permutation(slots)
    out, lse = R.sparse_mla_attention(q[:, None], cache, rng.permuted(idx, axis=2),
                                      scale=0.1, return_lse=True)
    want, want_lse = R.mla_attention(q, cache, tables, lens, scale=0.1, return_lse=True)
    check(out[:, 0], want)
    np.testing.assert_allclose(lse[:, 0], want_lse, rtol=1e-13)


def test_sink_is_attends_sinks_with_lse_keys_only(rng):
    """attend's sinks give the same out; its lse (which counts the sink) is logaddexp of
    this lse and the sink; a -inf sink is no sink."""
    q = bf16(rng, 3, 4, 576)
    kv = bf16(rng, 10, 1, 576)
    idx = np.arange(10, dtype=np.int32)[None, None].repeat(3, 0)
    sinks = np.array([0.3, 2.0, -1.0, 40.0])
    out, lse = R.sparse_mla_attention(q, kv, idx, scale=0.1, attn_sink=sinks, return_lse=True)
    plain, plain_lse = R.sparse_mla_attention(q, kv, idx, scale=0.1, return_lse=True)
    np.testing.assert_array_equal(lse, plain_lse)
    want, want_lse = R.attend(q, kv[:, :, :], kv[:, :, :512], 0.1, causal=False,
                              sinks=sinks, return_lse=True)
    check(out, want)
    np.testing.assert_allclose(np.logaddexp(lse, sinks), want_lse, rtol=1e-13)
    none = R.sparse_mla_attention(q, kv, idx, scale=0.1, attn_sink=np.full(4, -np.inf))
    np.testing.assert_array_equal(none, plain)


def test_empty_rows_are_zeros_and_minus_inf(rng):
    q = bf16(rng, 2, 2, 4, 576)
    cache = bf16(rng, 2, 4, 1, 576)
    idx = np.full((2, 2, 8), -1, np.int32)
    idx[1, :, :3] = [0, 5, 7]
    for kw in ({}, {"topk_length": np.array([8, 0], np.int32)},
               {"attn_sink": np.zeros(4, np.float32)}):
        out, lse = R.sparse_mla_attention(q, cache, idx, scale=0.1, return_lse=True, **kw)
        assert not out[0].any() and np.isneginf(lse[0]).all()
        if "topk_length" in kw:
            assert not out[1].any() and np.isneginf(lse[1]).all()
        else:
            assert np.abs(out[1]).min() > 0 and np.isfinite(lse[1]).all()


def test_duplicates_count_each_time(rng):
    """[a, a, b] weighs a twice: the softmax of [a, b] with a's logit raised by ln 2."""
    q = bf16(rng, 1, 1, 2, 576)
    cache = bf16(rng, 1, 8, 1, 576)
    twice = R.sparse_mla_attention(q, cache, np.array([[[3, 3, 6]]], np.int32), scale=0.1,
                                   return_lse=True)
    keys = cache[0, [3, 6], 0].astype(np.float64)
    logits = q[0, 0].astype(np.float64) @ keys.T * 0.1
    logits[:, 0] += math.log(2)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    check(twice[0][0, 0], (w / w.sum(-1, keepdims=True)) @ keys[:, :512])
    np.testing.assert_allclose(twice[1][0, 0], np.log(np.exp(logits).sum(-1)), rtol=1e-13)


def test_entries_that_do_not_count_are_never_read(rng):
    """NaN in every slot that only -1 entries, entries past topk_length or (prefill)
    out-of-range indices point at: the result is finite and unchanged."""
    q = bf16(rng, 1, 2, 2, 576)
    cache = bf16(rng, 2, 4, 1, 576)
    idx = np.array([[[0, 1, -1, 5], [2, -1, 6, 7]]], np.int32)
    tl = np.array([3], np.int32)  # entry 3 (slots 5 and 7) does not count
    clean = R.sparse_mla_attention(q, cache, idx, scale=0.1, topk_length=tl)
    poisoned = cache.copy()
    poisoned[1, 1] = poisoned[1, 3] = np.nan  # slots 5 and 7
    np.testing.assert_array_equal(
        R.sparse_mla_attention(q, poisoned, idx, scale=0.1, topk_length=tl), clean)


def test_decode_rejects_indices_outside_the_cache(rng):
    q = bf16(rng, 1, 1, 2, 576)
    cache = bf16(rng, 2, 4, 1, 576)
    for bad in (-2, 8, 2**31 - 1):
        with pytest.raises(ValueError, match="neither -1 nor a slot"):
            R.sparse_mla_attention(q, cache, np.array([[[0, bad]]], np.int32), scale=0.1)
    # past topk_length it is never looked at
    R.sparse_mla_attention(q, cache, np.array([[[0, 8]]], np.int32), scale=0.1,
                           topk_length=np.array([1], np.int32))


@pytest.mark.parametrize("kv_format", list(R.SPARSE_KV_FORMATS))
def test_quantized_cache_is_its_values(rng, kv_format):
    """Over a quantized cache the result is the "auto" one over its dequantized values, and
    the brute force reading token by token agrees."""
    nbytes, d = R.SPARSE_KV_FORMATS[kv_format]
    blocks, page = 3, 4
    cache = np.zeros((blocks, page, 1, nbytes), np.uint8)
    kv = bf16(rng, blocks * page, d, spread=3)
    if kv_format == "fp8_ds_mla":
        R.concat_and_cache_sparse_mla(kv[:, :512], kv[:, 512:], cache, np.arange(blocks * page))
    else:
        R.concat_and_cache_sparse_mla(kv, None, cache, np.arange(blocks * page), kv_format)
    q = bf16(rng, 2, 1, 4, d)
    idx = rng.integers(-1, blocks * page, (2, 1, 8)).astype(np.int32)
    out, lse = R.sparse_mla_attention(q, cache, idx, scale=0.1, kv_format=kv_format,
                                      return_lse=True)
    values = R.dequantize_sparse_kv(cache, kv_format)
    assert values.shape == (blocks, page, 1, d)
    o2, l2 = R.sparse_mla_attention(q, values, idx, scale=0.1, return_lse=True)
    np.testing.assert_array_equal(out, o2)
    np.testing.assert_array_equal(lse, l2)
    want, want_lse = brute(q, [cache], [idx], [None], None, 0.1, 512, kv_format)
    check(out, want)
    check_lse(lse, want_lse)


def test_argument_checks(rng):
    q = bf16(rng, 1, 1, 2, 576)
    cache = bf16(rng, 2, 4, 1, 576)
    idx = np.zeros((1, 1, 4), np.int32)
    with pytest.raises(ValueError, match="d_qk"):
        R.sparse_mla_attention(q[..., :512], cache, idx, scale=0.1)
    with pytest.raises(ValueError, match="come together"):
        R.sparse_mla_attention(q, cache, idx, scale=0.1, extra_kv_cache=cache)
    with pytest.raises(ValueError, match="topk_length"):
        R.sparse_mla_attention(q, cache, idx, scale=0.1, topk_length=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="fp8_ds_mla cache is 1-byte"):
        R.sparse_mla_attention(q, cache, idx, scale=0.1, kv_format="fp8_ds_mla")
    with pytest.raises(ValueError, match="attn_sink"):
        R.sparse_mla_attention(q, cache, idx, scale=0.1, attn_sink=np.zeros(3))


# ---- cache formats: round trips -------------------------------------------------------------


SLACK = 1 + 2.0**-20


def groups(x, size):
    return np.asarray(x, np.float64).reshape(*np.shape(x)[:-1], -1, size)


def test_fp8_ds_mla_round_trip(rng):
    kv = bf16(rng, 64, 576, spread=6)
    kv[3, :128] = 0  # a zero group
    kv[4, 128:256] = (rng.standard_normal(128) * 1e-36).astype(BF16)  # tiny: FLT_MIN floor
    c = R.quantize_sparse_kv(kv, "fp8_ds_mla")
    assert c.shape == (64, 656) and c.dtype == np.uint8
    s = c[:, 512:528].copy().view("<f4")
    amax = np.abs(groups(kv[:, :512], 128)).max(-1).astype(np.float32)
    np.testing.assert_array_equal(s, np.maximum(amax / np.float32(448), np.float32(2.0**-126)))
    y = R.dequantize_sparse_kv(c, "fp8_ds_mla")
    x = kv.astype(np.float64)
    np.testing.assert_array_equal(y[:, 512:], x[:, 512:])  # k_pe: bfloat16, exact
    err = np.abs(groups(y[:, :512] - x[:, :512], 128))
    # e4m3: half a step of 3 mantissa bits (2^-4 relative), or half the smallest
    # subnormal (2^-10 of the scale); SLACK for the float32 quotient's own rounding, which
    # can land on a tie and round away
    bound = np.maximum(np.abs(groups(x[:, :512], 128)) * 2**-4,
                       s[..., None] * 2.0**-10) * SLACK
    assert (err <= bound).all()
    assert not y[3, :128].any()


def test_v4_fp8_round_trip(rng):
    kv = bf16(rng, 64, 512, spread=6)
    kv[5, :32] = 0
    c = R.quantize_sparse_kv(kv, "v4_fp8")
    assert c.shape == (64, 528)
    e = c[:, 512:].astype(np.int64) - 127
    s = np.ldexp(1.0, e)
    amax = np.abs(groups(kv, 32)).max(-1)
    # the smallest power of two with amax / s <= 448 (at least 2^-126): nothing saturates
    assert (amax / s <= 448).all()
    assert ((amax / (s / 2) > 448) | (e == -126)).all()
    assert e[5, 0] == -126
    y = R.dequantize_sparse_kv(c, "v4_fp8")
    np.testing.assert_array_equal(
        R._ue8m0_values(c[:, 512:]),
        c[:, 512:].view(ml_dtypes.float8_e8m0fnu).astype(np.float64))
    x = kv.astype(np.float64)
    err = np.abs(groups(y - x, 32))
    assert (err <= np.maximum(np.abs(groups(x, 32)) * 2**-4, s[..., None] * 2.0**-10)
            * SLACK).all()


def test_v4_fp4_round_trip(rng):
    kv = bf16(rng, 64, 512, spread=4)
    kv[6, 16:32] = 0
    c = R.quantize_sparse_kv(kv, "v4_fp4")
    assert c.shape == (64, 288)
    s = R._e4m3_values(c[:, 256:])
    amax = np.abs(groups(kv, 16)).max(-1)
    # the smallest e4m3 value >= amax / 6: the one below it is smaller
    below = R._e4m3_values(c[:, 256:] - 1)
    q = amax.astype(np.float32) / np.float32(6)
    assert (s >= q).all()
    assert ((below < q) | (c[:, 256:] == 1)).all()
    assert c[6, 257] == 1  # zero group: 2^-9
    y = R.dequantize_sparse_kv(c, "v4_fp4")
    x = kv.astype(np.float64)
    err = np.abs(groups(y - x, 16))
    # e2m1: half a step is a quarter of the value (1-2: 0.25, 2-4: 0.5, 4-6: 1), or 0.25
    # of the scale below 1
    assert (err <= np.maximum(np.abs(groups(x, 16)) * 0.25, s[..., None] * 0.25) * SLACK).all()
    # nibble order: value 2i in the low nibble of byte i
    codes = np.stack([c[:, :256] & 0xF, c[:, :256] >> 4], -1).reshape(64, 512)
    np.testing.assert_array_equal(y, R._e2m1_values(codes) * np.repeat(s, 16, -1))
    with pytest.raises(ValueError, match="NaN"):
        R.quantize_sparse_kv(np.full((1, 512), np.nan, np.float32), "v4_fp4")


def test_v4_infinities_follow_the_stated_rules():
    """A group holding an infinity: v4_fp8 gives it the scale 2^0 (byte 127: frexp's
    exponent of an infinity, named in the code) and stores its values as they are,
    saturated (the infinity as +-448); v4_fp4 gives it the largest e4m3 scale, 448 (byte
    0x7E), and the infinity +-6 (test_cache_ops holds the GPU writer to the same bytes)."""
    x = np.full((1, 512), 0.5, np.float32)
    x[0, 3], x[0, 5], x[0, 40] = np.inf, 1000, -np.inf
    c = R.quantize_sparse_kv(x, "v4_fp8")[0]
    assert list(c[512:515]) == [127, 127, 118]  # 2^0, 2^0, 2^-9 (0.5 / 448 rounded up)
    assert (c[3], c[5], c[40], c[0], c[64]) == (0x7E, 0x7E, 0xFE, 0x30, 0x78)  # 0.5, 256
    np.testing.assert_array_equal(R.dequantize_sparse_kv(c, "v4_fp8")[[3, 5, 40, 0]],
                                  [448, 448, -448, 0.5])
    c = R.quantize_sparse_kv(x, "v4_fp4")[0]
    codes = np.stack([c[:256] & 0xF, c[:256] >> 4], -1).reshape(512)
    assert list(c[256:259]) == [0x7E, 0x1B, 0x7E]  # 448, 0.5 / 6 rounded up (11/128), 448
    assert R._e4m3_values(c[257]) == 11 / 128
    assert (codes[3], codes[5], codes[40], codes[0]) == (0x7, 0x4, 0xF, 0x0)  # 6, 2, -6, 0


def test_v4_writer_takes_the_vector_whole_or_split(rng):
    """V4's tokens: kv_c holding the whole vector with k_pe None, or its values then
    k_pe's (cupaged.concat_and_cache_mla's form), give the same rows."""
    x = bf16(rng, 6, 512, spread=3)
    for fmt in ("v4_fp8", "v4_fp4"):
        whole = np.zeros((2, 4, R.SPARSE_KV_FORMATS[fmt][0]), np.uint8)
        split = whole.copy()
        slots = np.array([5, -1, 0, 7, 2, 3])
        R.concat_and_cache_sparse_mla(x, None, whole, slots, fmt)
        R.concat_and_cache_sparse_mla(x[:, :448], x[:, 448:], split, slots, fmt)
        np.testing.assert_array_equal(whole, split)
        assert not whole[0, 1].any()  # slot 1: no token
        np.testing.assert_array_equal(whole[1, 3], R.quantize_sparse_kv(x[3], fmt))


# ---- the fp8_ds_mla writer, bit for bit against torch ---------------------------------------


def torch_ds_mla(kv_c, k_pe):
    """vLLM's concat_and_cache_ds_mla_kernel written again in torch (CPU, float32): per 128
    values amax by fmaxf (NaN skipped), scale max(amax / 448, FLT_MIN), value
    e4m3(satfinite(x / scale)) with CUDA's canonical NaN 0x7F, k_pe's bfloat16 bytes."""
    import torch

    n = kv_c.shape[0]
    g = kv_c.float().reshape(n, 4, 128)
    a = g.abs()
    amax = torch.where(a.isnan(), torch.zeros_like(a), a).amax(-1)  # fmaxf skips NaN
    scale = torch.clamp_min(amax / torch.full_like(amax, 448.0),
                            torch.finfo(torch.float32).tiny)
    y = g / scale[..., None]  # a tensor divisor: IEEE division, elementwise
    fp8 = y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    fp8 = torch.where(y.isnan(), torch.full_like(fp8, 0x7F), fp8)
    return torch.cat([fp8.reshape(n, 512), scale.contiguous().view(torch.uint8),
                      k_pe.contiguous().view(torch.uint8)], -1).numpy()


def test_fp8_ds_mla_writer_matches_torch_bit_for_bit(rng):
    import torch

    n = 96
    x = rng.standard_normal((n, 576)) * np.exp(rng.uniform(-8, 8, (n, 1)))
    x[0, :128] = 0  # a zero group: scale FLT_MIN, values 0
    x[1, :128] = rng.standard_normal(128) * 1e-38  # tiny (bfloat16 subnormals)
    x[2, 5] = 1e30  # one large value: the rest of the group rounds to 0 or subnormals
    x[3, 130] = -0.0
    x[4, 256] = np.nan  # NaN: stored 0x7F, skipped by the group's amax
    x[5, 384:512] = np.nan  # a group of NaN: scale FLT_MIN
    x[6, 300] = -np.inf  # inf: scale inf, the group's other values 0, inf itself NaN
    kv_c = torch.from_numpy(x[:, :512]).to(torch.bfloat16)
    k_pe = torch.from_numpy(x[:, 512:]).to(torch.bfloat16)
    want = torch_ds_mla(kv_c, k_pe)
    np_kv_c = kv_c.float().numpy().astype(BF16)  # the same bfloat16 values
    np_k_pe = k_pe.float().numpy().astype(BF16)
    got = R.quantize_sparse_kv(np.concatenate([np_kv_c, np_k_pe], -1), "fp8_ds_mla")
    np.testing.assert_array_equal(got, want)
    # every NaN is 0x7F whatever its sign, inf / inf included
    assert got[4, 256] == 0x7F and (got[5, 384:512] == 0x7F).all() and got[6, 300] == 0x7F
    assert got[5, 512 + 12:512 + 16].view("<f4")[0] == np.float32(2.0**-126)

    # the cache write: slots, block boundaries, padding (-1) skipped
    cache = np.full((4, 8, 656), 0xAB, np.uint8)
    slots = rng.permutation(32)[:n // 3].astype(np.int64)
    slots[::4] = -1
    R.concat_and_cache_sparse_mla(np_kv_c[:len(slots)], np_k_pe[:len(slots)], cache, slots)
    flat = cache.reshape(32, 656)
    for i, s in enumerate(slots):
        if s >= 0:
            np.testing.assert_array_equal(flat[s], want[i])
    untouched = np.setdiff1d(np.arange(32), slots[slots >= 0])
    assert (flat[untouched] == 0xAB).all()
    # FlashMLA's 4-D shape and float8 storage take the same bytes
    c4 = np.zeros((4, 8, 1, 656), ml_dtypes.float8_e4m3fn)
    R.concat_and_cache_sparse_mla(np_kv_c[:len(slots)], np_k_pe[:len(slots)], c4, slots)
    np.testing.assert_array_equal(c4.view(np.uint8).reshape(32, 656)[slots[slots >= 0]],
                                  flat[slots[slots >= 0]])


# ---- element conversions --------------------------------------------------------------------


def test_e4m3_conversion_is_torchs_with_satfinite_and_canonical_nan(rng):
    import torch

    every = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(
        R._e4m3_values(every),
        torch.from_numpy(every).view(torch.float8_e4m3fn).double().numpy())
    # all e4m3 values, the midpoints between neighbours (ties), and random float32
    v = np.unique(R._e4m3_values(every)[np.isfinite(R._e4m3_values(every))])
    mids = (v[1:] + v[:-1]) / 2
    y = np.concatenate([v, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        rng.standard_normal(4096) * 100, [449, 463.9, 464, 1e9, -1e9]])
    y = y.astype(np.float32)
    t = torch.from_numpy(y).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(R._e4m3_bytes(y), t)
    assert list(R._e4m3_bytes(np.array([np.nan, -np.nan], np.float32))) == [0x7F, 0x7F]


def test_e2m1_codes_round_to_nearest_even():
    """ml_dtypes' float4_e2m1fn against the explicit rule: nearest of the 8 magnitudes,
    ties to the even code."""
    mags = R._E2M1_VALUES
    probe = np.unique(np.concatenate([mags, (mags[1:] + mags[:-1]) / 2,
                                      np.linspace(0, 6, 601)]))
    probe = np.concatenate([probe, -probe]).astype(np.float32)
    got = R._e2m1_codes(probe)
    for y, c in zip(probe, got):
        d = np.abs(mags - abs(float(y)))
        best = np.flatnonzero(d == d.min())
        code = best[0] if len(best) == 1 else [b for b in best if b % 2 == 0][0]
        assert c & 7 == code, (y, c)
        assert c >> 3 == int(np.signbit(y)), (y, c)  # the sign kept, -0 included
    np.testing.assert_array_equal(
        R._e2m1_values(np.arange(16)),
        np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64))


def test_ue8m0_values_are_ml_dtypes():
    every = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(R._ue8m0_values(every),
                                  every.view(ml_dtypes.float8_e8m0fnu).astype(np.float64))


# ---- the lightning indexer ------------------------------------------------------------------


def indexer_problem(rng, seq_lens, q_lens, *, heads=4, d=128, block_size=16, spare=2):
    """Random indexer keys written through the writer into shuffled blocks, a query and
    weights: the host arrays of one call."""
    lens = np.asarray(seq_lens)
    per_seq = -(-lens // block_size)
    nb = int(per_seq.sum()) + spare
    perm = rng.permutation(nb)
    width = max(1, int(per_seq.max()))
    tables = np.full((len(lens), width), nb - 1, np.int32)  # unused entries: a real block
    used = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = perm[used:used + n]
        used += n
    cache = np.zeros((nb, block_size, R.indexer_cache_width(d)), np.uint8)
    keys = {}
    for s, n in enumerate(lens):
        k = bf16(rng, n, d)
        t = np.arange(n)
        slots = tables[s, t // block_size] * block_size + t % block_size
        R.indexer_k_quant_and_cache(k, cache, slots)
        keys[s] = k
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = bf16(rng, int(starts[-1]), heads, d)
    w = rng.standard_normal((int(starts[-1]), heads))
    return dict(q=q, cache=cache, w=w, tables=tables, lens=lens.astype(np.int32), starts=starts,
                keys=keys, block_size=block_size)


def test_indexer_writer_places_values_then_scales(rng):
    """Token o of a block: its e4m3 bytes at o * head_dim, its float32 scale after all the
    block's values (block_size * head_dim + 4 * o); padding slots skipped, other slots
    untouched; the [.., 1, width] form writes the same bytes."""
    d, bs = 128, 8
    k = bf16(rng, 6, d)
    cache = rng.integers(0, 256, (4, bs, 132)).astype(np.uint8)
    before = cache.copy()
    slots = np.array([0, 9, -1, 31, 7, 16])
    R.indexer_k_quant_and_cache(k, cache, slots)
    values, scales = R.quantize_indexer_k(k)
    flat = cache.reshape(4, -1)
    written = np.zeros_like(flat, bool)
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        b, o = divmod(int(slot), bs)
        assert np.array_equal(flat[b, o * d:(o + 1) * d], values[i])
        s = flat[b, bs * d + 4 * o:bs * d + 4 * o + 4].view("<f4")[0]
        assert s == scales[i, 0]
        written[b, o * d:(o + 1) * d] = True
        written[b, bs * d + 4 * o:bs * d + 4 * o + 4] = True
    assert np.array_equal(flat[~written], before.reshape(4, -1)[~written])
    four = before.reshape(4, bs, 1, 132).copy()
    R.indexer_k_quant_and_cache(k, four, slots)
    assert np.array_equal(four.reshape(cache.shape), cache)


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("group", [128, 64])
def test_indexer_quantization_and_round_trip(rng, ue8m0, group):
    """A group's scale is max(amax, 1e-4) / 448 (a power of two at least that with ue8m0);
    its values are e4m3 of k / scale; read back, each value is within half an e4m3 step
    (2^-4 of it, or 2^-10 of the scale for subnormals) of k, and an all-zero group keeps
    the 1e-4 floor."""
    d = 128
    k = bf16(rng, 5, d, spread=3.0).astype(np.float32)
    k[2, :group] = 0.0
    values, scales = R.quantize_indexer_k(k, group, ue8m0)
    amax = np.abs(k.reshape(5, -1, group)).max(-1)
    want = (np.fmax(amax, np.float32(1e-4)) / np.float32(448)).astype(np.float32)
    if ue8m0:
        assert np.all(np.log2(scales) == np.round(np.log2(scales)))
        assert np.all(scales >= want) and np.all(scales < 2 * want)
    else:
        assert np.array_equal(scales, want)
    assert want[2, 0] == np.float32(1e-4) / np.float32(448)  # the all-zero group's floor
    cache = np.zeros((1, 8, R.indexer_cache_width(d, group)), np.uint8)
    R.indexer_k_quant_and_cache(k, cache, np.arange(5), group, ue8m0)
    back = R.dequantize_indexer_k(cache, d, group)[0, :5]
    s = np.repeat(scales, group, axis=1).astype(np.float64)
    err = np.abs(back - k)
    assert np.all(err <= np.maximum(np.abs(k) * 2.0**-4, s * 2.0**-10) * (1 + 1e-12))
    x = k.reshape(5, -1, group) / scales[..., None]
    assert np.array_equal(values.reshape(5, -1, group),
                          x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def test_indexer_logits_match_a_loop(rng):
    """Each cell against an explicit loop over heads with the written keys read back one by
    one; a row sees its sequence's tokens up to its own position (the last q_len of the
    sequence), the rest -inf; a sequence with no query rows and one of length 1 included."""
    p = indexer_problem(rng, [40, 1, 23, 17], [3, 1, 0, 17])
    got = R.indexer_logits(p["q"], p["cache"], p["w"], p["tables"], p["lens"], p["starts"])
    keys = R.dequantize_indexer_k(p["cache"])
    bs = p["block_size"]
    assert got.shape == (p["q"].shape[0], p["tables"].shape[1] * bs)
    row = 0
    for s, (n, ql) in enumerate(zip(p["lens"], np.diff(p["starts"]))):
        for i in range(ql):
            pos = n - ql + i
            for j in range(got.shape[1]):
                if j > pos:
                    assert got[row, j] == -np.inf
                    continue
                k = keys[p["tables"][s, j // bs], j % bs]
                want = sum(p["w"][row, h] * max(0.0, float(np.dot(
                    p["q"][row, h].astype(np.float64), k))) for h in range(p["q"].shape[1]))
                assert abs(got[row, j] - want) <= 1e-12 * max(1.0, abs(want))
            row += 1


def test_indexer_logits_of_a_next_n_batch_are_deepgemms_layout(rng):
    """DeepGEMM's [batch, next_n] query is query starts in steps of next_n: rows of one
    request see 1, 2, .., next_n more tokens, the last its whole context; without starts,
    one row a sequence at its last token."""
    p = indexer_problem(rng, [30, 9], [2, 2])
    got = R.indexer_logits(p["q"], p["cache"], p["w"], p["tables"], p["lens"], p["starts"])
    seen = np.isfinite(got).sum(1)
    assert list(seen) == [29, 30, 8, 9]
    last = R.indexer_logits(p["q"][[1, 3]], p["cache"], p["w"][[1, 3]], p["tables"], p["lens"])
    assert np.array_equal(last, got[[1, 3]])


def test_indexer_topk_orders_by_value_then_column():
    """The largest first, ties by the lower column, -inf and NaN never picked, -1 after the
    finite ones run out."""
    x = np.array([[1.0, 3.0, 3.0, -np.inf, np.nan, 2.0, -5.0],
                  [-np.inf] * 7,
                  [0.0, -np.inf, 7.0, -np.inf, -np.inf, -np.inf, -np.inf]])
    assert R.indexer_topk(x, 4).tolist() == [[1, 2, 5, 0], [-1] * 4, [2, 0, -1, -1]]
    assert R.indexer_topk(x, 1).tolist() == [[1], [-1], [2]]
    with pytest.raises(ValueError, match="topk positive"):
        R.indexer_topk(x, 0)


def test_indexer_topk_over_the_whole_context_is_dense_mla(rng):
    """The pieces chained: the indexer's top-k over a topk that covers every row's context,
    turned into slots through the block tables, make sparse_mla_attention over an MLA
    cache in the same blocks equal reference.mla_attention (causal) on every row; a topk
    short of it leaves rows that see fewer keys than that exactly -1-padded."""
    p = indexer_problem(rng, [37, 5, 20], [4, 5, 1], heads=2, block_size=8)
    logits = R.indexer_logits(p["q"], p["cache"], p["w"], p["tables"], p["lens"], p["starts"])
    top = R.indexer_topk(logits, 40)
    slots = R.indexer_slots(top, p["tables"], p["block_size"], p["lens"], p["starts"])
    assert np.array_equal(slots < 0, top < 0)
    nb = p["cache"].shape[0]
    mla = bf16(rng, nb, p["block_size"], 576)
    q = bf16(rng, top.shape[0], 3, 576)
    out, lse = R.sparse_mla_attention(q[:, None], mla, slots[:, None], scale=0.1,
                                      return_lse=True)
    want, want_lse = R.mla_attention(q, mla, p["tables"], p["lens"], p["starts"], scale=0.1,
                                     return_lse=True)
    check(out[:, 0], want)
    check_lse(lse[:, 0], want_lse)
    short = R.indexer_topk(logits, 6)
    seen = np.isfinite(logits).sum(1)
    assert np.array_equal((short >= 0).sum(1), np.minimum(seen, 6))


def test_indexer_argument_checks(rng):
    p = indexer_problem(rng, [10], [2])
    with pytest.raises(ValueError, match="1-byte"):
        R.dequantize_indexer_k(p["cache"][..., :131])
    with pytest.raises(ValueError, match="multiple of quant_block_size"):
        R.quantize_indexer_k(np.ones((2, 100), np.float32))
    with pytest.raises(ValueError, match="weights must be"):
        R.indexer_logits(p["q"], p["cache"], p["w"][:1], p["tables"], p["lens"], p["starts"])
    with pytest.raises(ValueError, match="query_start_loc must run"):
        R.indexer_logits(p["q"], p["cache"], p["w"], p["tables"], p["lens"],
                         np.array([0, 3], np.int32))
    with pytest.raises(ValueError, match="writable in place"):
        R.indexer_k_quant_and_cache(bf16(rng, 1, 128), p["cache"][:, ::-1], np.array([0]))
