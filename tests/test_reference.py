"""The float64 reference against a direct softmax formula, token by token."""

import math

import numpy as np
import pytest

from cupaged import reference, testing
from conftest import assert_close, make_problem, rel_err


def direct(problem, scale=None):
    """softmax(q.k * scale + alibi) @ v written out with explicit loops over tokens."""
    q, kc, vc = problem.query, problem.key_cache, problem.value_cache
    num_seqs, num_heads, hs = q.shape
    _, kv_heads, _, bs, x = kc.shape
    scale = 1 / math.sqrt(hs) if scale is None else scale
    out = np.zeros((num_seqs, num_heads, hs))
    for s in range(num_seqs):
        n = int(problem.context_lens[s])
        for h in range(num_heads):
            kvh = h // (num_heads // kv_heads)
            logits, values = [], []
            for t in range(n):
                blk = problem.block_tables[s, t // bs]
                k = np.array([float(kc[blk, kvh, d // x, t % bs, d % x]) for d in range(hs)])
                v = np.array([float(vc[blk, kvh, d, t % bs]) for d in range(hs)])
                logit = scale * float(np.dot(q[s, h].astype(np.float64), k))
                if problem.alibi_slopes is not None:
                    logit += float(problem.alibi_slopes[h]) * (t - n + 1)
                logits.append(logit)
                values.append(v)
            if n:
                w = np.exp(np.array(logits) - max(logits))
                out[s, h] = (w[:, None] * np.array(values)).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_matches_direct_formula(rng, dtype, alibi, block_size):
    p = make_problem(rng, dtype=dtype, lens=(0, 1, block_size, block_size + 1, 23), heads=4,
                     kv_heads=2, head_size=32, block_size=block_size, alibi=alibi, share=True)
    scale = float(rng.uniform(0.05, 0.3))
    got = reference.paged_attention(**p.host_args(), scale=scale)
    np.testing.assert_allclose(got, direct(p, scale), rtol=1e-12, atol=1e-12)


def test_reference_bfloat16_and_mqa(rng):
    from cupaged import _dtypes

    p = make_problem(rng, dtype=_dtypes.BF16.numpy, lens=(9, 3), heads=6, kv_heads=1,
                     head_size=40, block_size=8)
    np.testing.assert_allclose(reference.paged_attention(**p.host_args()), direct(p),
                               rtol=1e-12, atol=1e-12)


def test_empty_context_gives_zeros(rng):
    p = make_problem(rng, lens=(0, 0), head_size=32)
    assert not reference.paged_attention(**p.host_args()).any()


def test_gather_kv_reads_only_the_sequence_blocks(rng):
    p = make_problem(rng, lens=(37,), kv_heads=3, head_size=48, block_size=8)
    k, v = reference.gather_kv(p.key_cache, p.value_cache, p.block_tables[0], 37)
    assert k.shape == v.shape == (37, 3, 48)
    t = 20  # token 20 lives in logical block 2, slot 4
    blk = p.block_tables[0, 2]
    np.testing.assert_array_equal(v[t, 1], p.value_cache[blk, 1, :, 4].astype(np.float64))
    np.testing.assert_array_equal(k[t, 1], p.key_cache[blk, 1, :, 4, :].reshape(-1).astype(np.float64))


@pytest.mark.parametrize("layout", ["vllm", "NHD", "HND"])
@pytest.mark.parametrize("scales", [None, "tensor", "token"])
def test_gather_kv_reads_each_token_through_the_table(rng, layout, scales):
    """Token t of a sequence is slot t % block_size of block table[t // block_size] in
    every layout, read as stored * scale from an fp8 cache with a per-tensor or
    per-token-head scale ([num_blocks, kv_heads, block_size]); checked token by token
    against vLLM's layout, with the cache's other blocks NaN."""
    bs, kvh, hs, n = 8, 3, 48, 37
    p = make_problem(rng, lens=(n,), kv_heads=kvh, head_size=hs, block_size=bs,
                     spare_blocks=4)
    kc, vc = p.key_cache, p.value_cache
    kw, k_s, v_s = {}, np.ones((len(kc), kvh, bs)), np.ones((len(kc), kvh, bs))
    if scales is not None:
        k_s, v_s = (rng.uniform(0.5, 2.0, (len(kc), kvh, bs)).astype(np.float32)
                    for _ in range(2))
        if scales == "tensor":
            k_s, v_s = np.full_like(k_s, 0.25), np.full_like(v_s, 4.0)
        kc, vc = (reference.quantize_fp8(c, "fp8_e4m3").view(np.uint8) for c in (kc, vc))
        kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=0.25 if scales == "tensor" else k_s,
                  v_scale=4.0 if scales == "tensor" else v_s)
    used = p.block_tables[0, : -(-n // bs)]
    kc, vc = kc.copy(), vc.copy()
    for c in (kc, vc):  # blocks the sequence does not own: NaN (0xFF in fp8)
        c[np.setdiff1d(np.arange(len(c)), used)] = np.nan if scales is None else 0xFF
    want_k, want_v = np.empty((n, kvh, hs)), np.empty((n, kvh, hs))
    for t in range(n):
        b, o = p.block_tables[0, t // bs], t % bs
        for h in range(kvh):
            k_row, v_row = kc[b, h, :, o, :].reshape(-1), vc[b, h, :, o]
            if scales is not None:
                k_row, v_row = (reference.dequantize_fp8(r, "fp8_e4m3") for r in (k_row, v_row))
            want_k[t, h] = np.asarray(k_row, np.float64) * float(k_s[b, h, o])
            want_v[t, h] = np.asarray(v_row, np.float64) * float(v_s[b, h, o])
    kc, vc = testing.convert_layout(kc, vc, "vllm", layout)
    k, v = reference.gather_kv(kc, vc, p.block_tables[0], n, layout, **kw)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)


def test_poison_reaches_every_unused_slot_and_no_used_one(rng):
    lens = np.array([0, 1, 15, 16, 17, 40], np.int32)
    bt, nb = testing.random_block_tables(lens, 16, rng, spare_blocks=3, share=True)
    kc, vc = testing.random_cache(nb, 2, 64, 16, np.float16, rng)
    clean_k, clean_v = kc.copy(), vc.copy()
    used = testing.poison_unused_slots(kc, vc, bt, lens)
    assert used.sum() == len({(int(bt[s, t // 16]), t % 16) for s, n in enumerate(lens)
                              for t in range(n)})
    assert used.sum() < used.size - 3 * 16  # tails of last blocks and the spare blocks
    k_slots = np.moveaxis(kc, 3, 1).reshape(nb, 16, -1)
    v_slots = np.moveaxis(vc, 3, 1).reshape(nb, 16, -1)
    assert np.isnan(k_slots[~used]).all() and np.isnan(v_slots[~used]).all()
    np.testing.assert_array_equal(k_slots[used], np.moveaxis(clean_k, 3, 1).reshape(nb, 16, -1)[used])
    np.testing.assert_array_equal(v_slots[used], np.moveaxis(clean_v, 3, 1).reshape(nb, 16, -1)[used])
    ref = reference.paged_attention(rng.standard_normal((6, 4, 64)), kc, vc, bt, lens)
    assert np.isfinite(ref).all()  # the reference reads used slots only


def test_assert_close_catches_one_bad_head_among_thousands(rng):
    """One head 5% off in 8,192 rows passes a global-norm check; the per-row one fails."""
    ref = rng.standard_normal((1024, 8, 128))
    got = ref + 2e-4 * rng.standard_normal(ref.shape) * np.linalg.norm(ref, axis=-1, keepdims=True) / np.sqrt(128)
    assert_close(got, ref, 1e-3)
    got[517, 3] += 0.05 * np.linalg.norm(ref[517, 3]) * rng.standard_normal(128) / np.sqrt(128)
    assert rel_err(got, ref) <= 1e-3
    with pytest.raises(AssertionError, match=r"row \(517, 3\) is off by"):
        assert_close(got, ref, 1e-3)
    got[517, 3] = np.nan
    with pytest.raises(AssertionError):
        assert_close(got, ref, 1e-3)


def test_assert_close_row_floor_holds_rows_to_at_least_the_floor():
    """A one-element row cancelled to near zero passes with rounding of its inputs' size
    once held to the floor; a row above the floor is still held to its own norm."""
    ref = np.ones((100, 1))
    ref[7] = 2e-4
    got = ref.copy()
    got[7] += 3e-8
    with pytest.raises(AssertionError, match=r"row \(7,\) is off by"):
        assert_close(got, ref, 1e-5)
    assert_close(got, ref, 1e-5, row_floor=1.0)
    got[40] += 5e-5  # 5e-5 of its own norm > 4 x 1e-5
    with pytest.raises(AssertionError, match=r"row \(40,\) is off by"):
        assert_close(got, ref, 1e-5, row_floor=1.0)


# ---- varlen (prefill, chunked prefill, verify) over every layout -------------------------------


def direct_varlen(q, k_tok, v_tok, tables, seq_lens, starts, scale, causal, slopes=None):
    """Loops over rows and tokens; k_tok/v_tok are NHD caches [blocks, bs, kv_heads, hs]."""
    total_q, heads, hs = q.shape
    bs, kv_heads = k_tok.shape[1], k_tok.shape[2]
    out = np.zeros((total_q, heads, hs))
    for s in range(len(seq_lens)):
        n, a, b = int(seq_lens[s]), int(starts[s]), int(starts[s + 1])
        for i in range(a, b):
            pos = n - (b - a) + (i - a)
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                logits, values = [], []
                for t in range(n if not causal else pos + 1):
                    blk = tables[s, t // bs]
                    logit = scale * float(np.dot(q[i, h].astype(np.float64),
                                                 k_tok[blk, t % bs, kvh].astype(np.float64)))
                    if slopes is not None:
                        logit += float(slopes[h]) * (t - pos)
                    logits.append(logit)
                    values.append(v_tok[blk, t % bs, kvh].astype(np.float64))
                w = np.exp(np.array(logits) - max(logits))
                out[i, h] = (w[:, None] * np.array(values)).sum(0) / w.sum()
    return out


def varlen_problem(rng, q_lens, seq_lens, heads=4, kv_heads=2, hs=32, bs=4, dtype=np.float16):
    seq_lens = np.asarray(seq_lens, np.int32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    bt, nb = testing.random_block_tables(seq_lens, bs, rng, spare_blocks=2)
    k = testing.random_normal((nb, bs, kv_heads, hs), dtype, rng)  # NHD
    v = testing.random_normal((nb, bs, kv_heads, hs), dtype, rng)
    testing.poison_unused_slots(*testing.convert_layout(k, v, "NHD", "vllm"), bt, seq_lens)
    q = testing.random_normal((int(starts[-1]), heads, hs), dtype, rng)
    return q, k, v, bt, seq_lens, starts


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("alibi", [False, True])
def test_varlen_reference_matches_the_direct_formula(rng, causal, alibi):
    """A mixed batch: a whole prompt, a chunk after a cached prefix, a 3-token verify, a
    decode step, an idle sequence (q_len 0)."""
    q_lens, seq_lens = [9, 5, 3, 1, 0], [9, 14, 20, 7, 6]
    q, k, v, bt, lens, starts = varlen_problem(rng, q_lens, seq_lens)
    slopes = rng.uniform(0, 0.5, 4) if alibi else None
    got = reference.attention(q, k, v, bt, lens, starts, kv_layout="NHD", causal=causal,
                              scale=0.2, alibi_slopes=slopes)
    want = direct_varlen(q, k, v, bt, lens, starts, 0.2, causal, slopes)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["HND", "vllm"])
def test_every_layout_gives_the_same_attention(rng, layout):
    q, k, v, bt, lens, starts = varlen_problem(rng, [4, 1, 6], [10, 3, 6], hs=64, bs=8)
    want = reference.attention(q, k, v, bt, lens, starts, kv_layout="NHD")
    k2, v2 = testing.convert_layout(k, v, "NHD", layout)
    back = testing.convert_layout(k2, v2, layout, "NHD")
    np.testing.assert_array_equal(back[0], k)
    np.testing.assert_array_equal(back[1], v)
    got = reference.attention(q, k2, v2, bt, lens, starts, kv_layout=layout)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_decode_is_the_one_token_case(rng):
    p = make_problem(rng, lens=(0, 1, 17, 40), heads=4, kv_heads=2, head_size=32, alibi=True)
    dec = reference.paged_attention(**p.host_args())
    k, v = testing.convert_layout(p.key_cache, p.value_cache, "vllm", "HND")
    # The varlen form: the empty sequence has no query row, the others one each.
    one = reference.attention(p.query[1:], k, v, p.block_tables, p.context_lens,
                              np.array([0, 0, 1, 2, 3]), kv_layout="HND",
                              alibi_slopes=p.alibi_slopes)
    np.testing.assert_allclose(one, dec[1:], rtol=1e-12, atol=1e-12)
    assert not dec[0].any()


def test_chunked_prefill_equals_one_shot_prefill(rng):
    """Rows of a prompt computed in three chunks (each over the cache as it stood) equal
    the same rows of the whole prompt at once."""
    n = 23
    q, k, v, bt, lens, starts = varlen_problem(rng, [n], [n])
    whole = reference.attention(q, k, v, bt, lens, starts)
    for a, b in [(0, 8), (8, 16), (16, 23)]:
        part = reference.attention(q[a:b], k, v, bt, np.array([b]), np.array([0, b - a]))
        np.testing.assert_allclose(part, whole[a:b], rtol=1e-12, atol=1e-12)


def test_non_causal_rows_see_every_key(rng):
    q, k, v, bt, lens, starts = varlen_problem(rng, [5], [12])
    got = reference.attention(q, k, v, bt, lens, starts, causal=False)
    for i in range(5):
        last = reference.attention(q[i:i + 1], k, v, bt, lens, np.array([0, 1]))
        np.testing.assert_allclose(got[i], last[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("starts, lens, match", [
    ([0, 3, 5], [2, 9], "sequence 0 has 3 query tokens but only 2 cached"),
    ([0, 3], [4, 9], r"query_start_loc must be \[num_seqs \+ 1\]"),
    ([0, 3, 4], [4, 9], "ending at total_q=5"),
])
def test_varlen_reference_refuses_inconsistent_rows(rng, starts, lens, match):
    q, k, v, bt, _, _ = varlen_problem(rng, [3, 2], [4, 9])
    with pytest.raises(ValueError, match=match):
        reference.attention(q, k, v, bt, np.array(lens), np.array(starts))


# ---- variants: sliding window, soft-cap, sinks, log-sum-exp and merging ----------------------


def _dense(rng, q_len=3, n=40, heads=4, kv_heads=2, hs=16):
    q = rng.standard_normal((q_len, heads, hs))
    k = rng.standard_normal((n, kv_heads, hs))
    v = rng.standard_normal((n, kv_heads, hs))
    return q, k, v


def _one_row(q, k, v, h, visible, scale, cap=None, sink=None):
    """One query row ``q [heads, hs]``, head h, by the scalar formulas: softmax over the
    visible keys' (capped) logits, the sink only in the denominator; (out, lse)."""
    g = q.shape[0] // k.shape[1]
    logits = [scale * float(q[h] @ k[j, h // g]) for j in visible]
    if cap is not None:
        logits = [cap * math.tanh(x / cap) for x in logits]
    terms = [math.exp(x) for x in logits]
    den = sum(terms) + (math.exp(sink) if sink is not None else 0.0)
    out = sum(t * v[j, h // g] for t, j in zip(terms, visible)) / den if terms else 0 * v[0, 0]
    return out, (math.log(den) if den > 0 else -math.inf)


@pytest.mark.parametrize("window", [1, 5, 40, 100])
def test_window_keeps_the_last_w_positions(rng, window):
    q, k, v = _dense(rng)
    n, scale = k.shape[0], 0.3
    out, lse = reference.attend(q, k, v, scale, window=window, return_lse=True)
    for i in range(q.shape[0]):
        p = n - q.shape[0] + i
        visible = [j for j in range(n) if p - window < j <= p]
        for h in range(q.shape[1]):
            o, l = _one_row(q[i], k, v, h, visible, scale)
            np.testing.assert_allclose(out[i, h], o, rtol=1e-12, atol=1e-12)
            assert lse[i, h] == pytest.approx(l, rel=1e-12)
    # Non-causal: the window bounds the left side only.
    out = reference.attend(q, k, v, scale, causal=False, window=window, q_pos=[0, 10, 39])
    o, _ = _one_row(q[1], k, v, 2, [j for j in range(n) if j > 10 - window], scale)
    np.testing.assert_allclose(out[1, 2], o, rtol=1e-12, atol=1e-12)


def test_soft_cap_and_sinks_follow_the_scalar_formulas(rng):
    q, k, v = _dense(rng, q_len=2)
    q *= 8  # logits well past the cap
    sinks = rng.standard_normal(q.shape[1]) * 3
    out, lse = reference.attend(q, k, v, 0.5, logits_soft_cap=4.0, sinks=sinks, return_lse=True)
    n = k.shape[0]
    for i in range(2):
        for h in range(q.shape[1]):
            o, l = _one_row(q[i], k, v, h, list(range(n - 2 + i + 1)), 0.5, cap=4.0, sink=sinks[h])
            np.testing.assert_allclose(out[i, h], o, rtol=1e-11, atol=1e-12)
            assert lse[i, h] == pytest.approx(l, rel=1e-12)


def test_merging_halves_gives_the_whole(rng):
    """Keys split at any point: the two partials' merge equals attention over all keys,
    output and lse; sinks go with one partial only; an empty partial is the identity."""
    q, k, v = _dense(rng, q_len=1, n=50)
    sinks = rng.standard_normal(q.shape[1])
    pos = [49]
    whole, whole_lse = reference.attend(q, k, v, 0.2, q_pos=pos, sinks=sinks, return_lse=True)
    for cut in (0, 1, 17, 49, 50):
        a = reference.attend(q, k[:cut], v[:cut], 0.2, q_pos=pos, causal=False, sinks=sinks,
                             return_lse=True)
        b = reference.attend(q, k[cut:], v[cut:], 0.2, q_pos=[p - cut for p in pos],
                             return_lse=True)
        out, lse = reference.merge_state(*a, *b)
        np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse, whole_lse, rtol=1e-12, atol=1e-12)
    # Three pieces through merge_states, and an empty partial (lse -inf) changes nothing.
    parts = [reference.attend(q, k[a:b], v[a:b], 0.2, q_pos=[49 - a], causal=False,
                              return_lse=True) for a, b in ((0, 10), (10, 30), (30, 50))]
    out, lse = reference.merge_states([p[0] for p in parts], [p[1] for p in parts])
    plain, plain_lse = reference.attend(q, k, v, 0.2, return_lse=True)
    np.testing.assert_allclose(out, plain, rtol=1e-12, atol=1e-14)
    empty = (np.zeros_like(out), np.full_like(lse, -np.inf))
    same, same_lse = reference.merge_state(out, lse, *empty)
    np.testing.assert_array_equal(same, out)
    np.testing.assert_array_equal(same_lse, lse)
    both, both_lse = reference.merge_state(*empty, *empty)
    assert not both.any() and np.isneginf(both_lse).all()


def test_rows_without_keys_are_zero_and_finite_with_sinks(rng):
    q, k, v = _dense(rng, q_len=2, n=0)
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    out, lse = reference.attend(q, k, v, 0.3, sinks=sinks, return_lse=True)
    assert not out.any()
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks, lse.shape))
    out, lse = reference.attend(q, k, v, 0.3, return_lse=True)
    assert not out.any() and np.isneginf(lse).all()


def test_paged_reference_passes_the_variants_on(rng):
    """attention() over a paged cache equals attend() on the gathered keys, variants on,
    including a decode row with an empty context (zeros; lse = its sink)."""
    p = make_problem(rng, lens=(0, 1, 33, 70), heads=4, kv_heads=2, head_size=16, block_size=8)
    sinks = rng.standard_normal(4)
    kw = dict(window=9, logits_soft_cap=5.0, sinks=sinks)
    out, lse = reference.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables,
                                         p.context_lens, return_lse=True, **kw)
    assert not out[0].any()
    np.testing.assert_array_equal(lse[0], sinks)
    for s in (1, 2, 3):
        n = int(p.context_lens[s])
        k, v = reference.gather_kv(p.key_cache, p.value_cache, p.block_tables[s], n)
        o, l = reference.attend(p.query[s], k, v, 16 ** -0.5, return_lse=True, **kw)
        np.testing.assert_allclose(out[s], o, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[s], l, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("step", [0, 1, -2])
def test_blocksparse_mask_follows_vllms_block_loop(step):
    """The mask against vLLM's kernel logic, written as its per-cache-block loop."""
    heads, kv_heads, tp_rank, local, vert, sparse = 8, 2, 1, 2, 3, 32
    for seq_len in (1, 16, 100, 300):
        for bs in (8, 16, 128):
            m = reference.blocksparse_mask(seq_len, bs, heads, kv_heads, local, vert, sparse,
                                           step, tp_rank)
            assert m.shape == (heads, seq_len)
            q_sb = (seq_len - 1) // sparse
            for h in range(heads):
                if step >= 0:
                    off = (tp_rank * heads + h) * step + 1
                else:
                    off = (tp_rank * kv_heads + h // (heads // kv_heads)) * -step + 1
                for blk in range(-(-seq_len // bs)):
                    sb = blk * bs // sparse
                    keep = (sb + off) % vert == 0 or sb > q_sb - local
                    assert (m[h, blk * bs: (blk + 1) * bs] == keep).all(), (seq_len, bs, h, blk)


def test_paged_reference_applies_the_blocksparse_mask(rng):
    p = make_problem(rng, lens=(1, 70, 300), heads=4, kv_heads=2, head_size=16, block_size=16)
    pattern = dict(local_blocks=1, vert_stride=2, sparse_block_size=32, head_sliding_step=1)
    got = reference.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables,
                                    p.context_lens, blocksparse=pattern)
    dense = reference.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables,
                                      p.context_lens)
    for s, n in enumerate(p.context_lens):
        k, v = reference.gather_kv(p.key_cache, p.value_cache, p.block_tables[s], int(n))
        mask = reference.blocksparse_mask(int(n), 16, 4, 2, **pattern)
        want = reference.attend(p.query[s], k, v, 16 ** -0.5, key_mask=mask)
        np.testing.assert_allclose(got[s], want, rtol=1e-12, atol=1e-12)
    assert not np.allclose(got[2], dense[2])  # the pattern dropped keys of the long row


# ---- multi-head latent attention (MLA) ----------------------------------------------------------

MLA_DIMS = dict(rank=32, nope=16, rope=8, v=16)  # DeepSeek-V3's 512 / 128 / 64 / 128, shrunk


def _mla_problem(rng, q_lens, seq_lens, heads=4, block_size=4, dims=MLA_DIMS):
    """Random unabsorbed MLA weights and activations, and the latent cache a model would
    hold for them: per token kv_c (the compressed K and V) and k_pe, per head W_UK and
    W_UV (kv_c -> k_nope, kv_c -> v), per query token and head q_nope and q_pe."""
    r, dn, dr, dv = dims["rank"], dims["nope"], dims["rope"], dims["v"]
    bt, nb = testing.random_block_tables(np.array(seq_lens), block_size, rng, spare_blocks=2)
    cache = np.full((nb, block_size, r + dr), np.nan)  # never-written slots stay NaN
    kv_c, k_pe = [], []
    for s, n in enumerate(seq_lens):
        kv_c.append(rng.standard_normal((n, r)))
        k_pe.append(rng.standard_normal((n, dr)))
        slots = np.array([bt[s][t // block_size] * block_size + t % block_size for t in range(n)])
        reference.concat_and_cache_mla(kv_c[-1], k_pe[-1], cache, slots)
    total = sum(q_lens)
    return dict(
        cache=cache, bt=bt, kv_c=kv_c, k_pe=k_pe, heads=heads,
        w_uk=rng.standard_normal((heads, r, dn)) / math.sqrt(r),
        w_uv=rng.standard_normal((heads, r, dv)) / math.sqrt(r),
        q_nope=rng.standard_normal((total, heads, dn)), q_pe=rng.standard_normal((total, heads, dr)),
        starts=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        lens=np.array(seq_lens, np.int32), scale=1.0 / math.sqrt(dn + dr))


def _unabsorbed(pb, causal=True):
    """The model's own formulation: per head, k = [kv_c W_UK, k_pe] and v = kv_c W_UV."""
    out = []
    for s in range(len(pb["lens"])):
        a, b = pb["starts"][s], pb["starts"][s + 1]
        k_nope = np.einsum("nr,hrd->nhd", pb["kv_c"][s], pb["w_uk"])
        k_pe = np.broadcast_to(pb["k_pe"][s][:, None, :], (len(k_nope), pb["heads"],
                                                          pb["k_pe"][s].shape[-1]))
        v = np.einsum("nr,hrd->nhd", pb["kv_c"][s], pb["w_uv"])
        q = np.concatenate([pb["q_nope"][a:b], pb["q_pe"][a:b]], -1)
        out.append(reference.attend(q, np.concatenate([k_nope, k_pe], -1), v, pb["scale"],
                                    causal=causal))
    return np.concatenate(out)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_absorbed_mla_equals_the_unabsorbed_formulation(rng, causal):
    """q_nope W_UK^T against the latent cache, then the latent output times W_UV, is the
    per-head attention the model defines (empty, single-token, decode and chunked rows)."""
    pb = _mla_problem(rng, q_lens=[0, 1, 3, 9, 1], seq_lens=[5, 1, 7, 9, 13])
    q_latent = np.einsum("thd,hrd->thr", pb["q_nope"], pb["w_uk"])
    latent = reference.mla_attention((q_latent, pb["q_pe"]), pb["cache"], pb["bt"], pb["lens"],
                                     pb["starts"], scale=pb["scale"], causal=causal,
                                     kv_lora_rank=MLA_DIMS["rank"])
    got = np.einsum("thr,hrd->thd", latent, pb["w_uv"])
    want = _unabsorbed(pb, causal)
    assert got.shape == want.shape == (14, 4, MLA_DIMS["v"])
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert np.abs(want).max() > 0.1  # not a comparison of zeros


def test_mla_cache_forms_and_the_query_forms_agree(rng):
    """vLLM's combined cache and FlashInfer's kv_c / k_pe pair; q as one array or a pair."""
    pb = _mla_problem(rng, q_lens=[2, 4], seq_lens=[6, 11])
    r = MLA_DIMS["rank"]
    q = np.concatenate([rng.standard_normal((6, 4, r)), pb["q_pe"]], -1)
    kw = dict(scale=0.3, return_lse=True)
    one, lse = reference.mla_attention(q, pb["cache"], pb["bt"], pb["lens"], pb["starts"],
                                       kv_lora_rank=r, **kw)
    split, lse2 = reference.mla_attention((q[..., :r], q[..., r:]), pb["cache"][..., :r].copy(),
                                          pb["bt"], pb["lens"], pb["starts"],
                                          k_pe_cache=pb["cache"][..., r:].copy(), **kw)  # its rank
    np.testing.assert_array_equal(one, split)
    np.testing.assert_array_equal(lse, lse2)
    assert np.isfinite(one).all() and one.shape == (6, 4, r)


def test_concat_and_cache_mla_writes_its_slots_only_and_skips_padding(rng):
    cache = np.full((3, 4, 10), -7.0)
    kv_c, k_pe = rng.standard_normal((3, 6)), rng.standard_normal((3, 4))
    reference.concat_and_cache_mla(kv_c, k_pe, cache, np.array([5, -1, 11]))
    np.testing.assert_array_equal(cache[1, 1], np.concatenate([kv_c[0], k_pe[0]]))
    np.testing.assert_array_equal(cache[2, 3], np.concatenate([kv_c[2], k_pe[2]]))
    assert (cache == -7.0).sum() == cache.size - 20  # the padding token wrote nothing


def test_concat_and_cache_mla_quantizes_fp8_with_the_scale(rng):
    cache = np.zeros((2, 4, 12), np.uint8)
    kv_c, k_pe = rng.standard_normal((2, 8)) * 3, rng.standard_normal((2, 4))
    reference.concat_and_cache_mla(kv_c, k_pe, cache, np.array([0, 6]), "fp8_e4m3", scale=0.5)
    want = reference.quantize_fp8(np.concatenate([kv_c[1], k_pe[1]]), "fp8_e4m3", 0.5)
    np.testing.assert_array_equal(cache[1, 2], want.view(np.uint8))
    back = reference.dequantize_fp8(cache[1, 2], "fp8_e4m3", 0.5)
    np.testing.assert_allclose(back, np.concatenate([kv_c[1], k_pe[1]]), rtol=0.07, atol=0.01)


def test_mla_reads_an_fp8_latent_cache_as_stored_times_scale(rng):
    pb = _mla_problem(rng, q_lens=[3], seq_lens=[9])
    r = MLA_DIMS["rank"]
    stored = reference.quantize_fp8(np.nan_to_num(pb["cache"]), "fp8_e4m3", 0.25).view(np.uint8)
    q = (rng.standard_normal((3, 4, r)), pb["q_pe"])
    got = reference.mla_attention(q, stored, pb["bt"], pb["lens"], pb["starts"], scale=0.2,
                                  kv_lora_rank=r, kv_cache_dtype="fp8_e4m3", k_scale=0.25)
    exact = reference.dequantize_fp8(stored, "fp8_e4m3", 0.25)
    want = reference.mla_attention(q, exact, pb["bt"], pb["lens"], pb["starts"], scale=0.2,
                                   kv_lora_rank=r)
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("cache, kw, match", [
    (np.zeros((2, 4, 8)), dict(kv_lora_rank=8), "must hold kv_lora_rank"),
    (np.zeros((2, 4)), dict(), r"\[num_blocks, block_size, dims\]"),
    (np.zeros((2, 4, 8)), dict(kv_lora_rank=8, k_pe_cache=np.zeros((2, 3, 2))), "k_pe_cache"),
    (np.zeros((2, 4, 10)), dict(kv_lora_rank=8), r"q's last dimension \(11\)"),
])
def test_mla_reference_refuses_inconsistent_shapes(cache, kw, match):
    with pytest.raises(ValueError, match=match):
        reference.mla_attention(np.zeros((1, 2, 11)), cache, np.zeros((1, 1), np.int32),
                                np.array([1], np.int32), np.array([0, 1], np.int32), scale=1.0,
                                **kw)


def test_fp8_weights_round_each_weight_and_keep_the_sum(rng):
    """attend's p_fp8: P V takes 2^8 exp(logit - max) rounded to e4m3 (over 2^8), the
    denominator the exact weights: the result moves by at most 2^-4 of the weights'
    spread (e4m3's largest relative rounding), and equals a direct computation."""
    import ml_dtypes

    q = rng.standard_normal((3, 4, 32))
    k, v = rng.standard_normal((50, 2, 32)), rng.standard_normal((50, 2, 32))
    exact = reference.attend(q, k, v, 0.2)
    got = reference.attend(q, k, v, 0.2, p_fp8="fp8_e4m3")
    logits = np.einsum("qhd,nhd->qhn", q, k[:, [0, 0, 1, 1]]) * 0.2
    logits = np.where(np.arange(50)[None, None] <= 47 + np.arange(3)[:, None, None], logits,
                      -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w8 = (256 * w).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / 256
    want = np.einsum("qhn,nhd->qhd", w8 / w.sum(-1, keepdims=True), v[:, [0, 0, 1, 1]])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    spread = np.einsum("qhn,nhd->qhd", w / w.sum(-1, keepdims=True), np.abs(v[:, [0, 0, 1, 1]]))
    assert (np.abs(got - exact) <= 2.0 ** -4 * spread + 1e-12).all()
    assert np.abs(got - exact).max() > 0  # the rounding shows


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_query_error_bound_holds_rounded_weights_not_a_swapped_key(rng, fmt):
    """fp8_query_error_bound: every row of p_fp8's result (the weights rounded to the
    format) and of the weights rounded per 128-key tile against the running maximum, as
    the kernel rounds them, lies within it; a result with two keys' values swapped (the
    largest weight's and the smallest's) does not, nor one that skips a rescale."""
    import ml_dtypes

    from test_fp8 import fp8_problem

    host, scales = fp8_problem(rng, fmt, "host", [40, 1], [300, 20], dtype="bf16", heads=4,
                               kv_heads=2, head_size=64, block_size=16)
    q8 = reference.quantize_fp8(host["query"].astype(np.float32), fmt, 1.0).view(np.uint8)
    host8 = {**host, "query": q8}
    kw = dict(kv_cache_dtype=fmt, **scales)
    ref = reference.attention(**host8, **kw)
    bound = reference.fp8_query_error_bound(**host8, **kw)
    emu = reference.attention(**host8, p_fp8=fmt, **kw)
    assert (np.linalg.norm(emu - ref, axis=-1) <= bound).all()

    # sequence 0's rows, by the kernel's rule: 128-key tiles, a running maximum
    f8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}[fmt]
    k, v = reference.gather_kv(host["key_cache"], host["value_cache"], host["block_tables"][0],
                               300, "NHD", fmt, scales["k_scale"], scales["v_scale"])
    q = q8[:40].view(f8).astype(np.float64)

    def tiled(v, rescale=True):
        out = np.zeros((40, 4, 64))
        for i in range(40):
            for h in range(4):
                x = k[:261 + i, h // 2] @ q[i, h] / 8.0
                m, l, o = -np.inf, 0.0, np.zeros(64)
                for t in range(0, len(x), 128):
                    mn = max(m, x[t:t + 128].max())
                    a = math.exp(m - mn) if rescale else 1.0
                    p = 256 * np.exp(x[t:t + 128] - mn)
                    l = l * math.exp(m - mn) + p.sum()
                    o = o * a + p.astype(f8).astype(np.float64) @ v[t:t + len(p), h // 2]
                    m = mn
                out[i, h] = o / l
        return out

    def worst(got):
        return (np.linalg.norm(got - ref[:40], axis=-1) / bound[:40]).max()

    assert worst(tiled(v)) <= 1
    x = k[:, 0] @ q[39, 0]  # the last row's largest and smallest weights trade values
    swapped = v.copy()
    swapped[[x.argmax(), x.argmin()], 0] = swapped[[x.argmin(), x.argmax()], 0]
    assert worst(tiled(swapped)) > 2
    assert worst(tiled(v, rescale=False)) > 1


def test_fp8_query_error_bound_holds_subnormal_weights_of_one_sign():
    """One key far above 4,096 others whose weights fall below e4m3's normal range (each
    1.01 * 2^-18 of the largest: 2^8 times that rounds to 2^-9, about twice itself) and
    whose values share a sign: their errors add, past any multiple of the output's norm
    the bound's other terms give, and within the bound's subnormal term. Also: a 16-bit
    query is refused."""
    import ml_dtypes

    n, bs, d = 4097, 16, 64
    nb = -(-n // bs)
    k = np.zeros((nb * bs, 1, d), np.float32)
    v = np.zeros_like(k)
    k[0, 0, 0], k[1:n, 0, 0], v[1:n, 0, 0] = 16, 4, 1
    f8 = ml_dtypes.float8_e4m3fn
    q = np.zeros((1, 1, d), np.float32)
    q[0, 0, 0] = 1
    host = dict(query=q.astype(f8).view(np.uint8),
                key_cache=k.astype(f8).view(np.uint8).reshape(nb, bs, 1, d),
                value_cache=v.astype(f8).view(np.uint8).reshape(nb, bs, 1, d),
                block_tables=np.arange(nb, dtype=np.int32)[None],
                seq_lens=np.array([n], np.int32), query_start_loc=np.array([0, 1], np.int32))
    s = math.log(2.0 ** 18 / 1.01) / 12  # logits 16 s and 4 s: 2^-18 / 1.01 apart
    kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=1.0, v_scale=1.0, scale=s)
    ref = reference.attention(**host, **kw)[0, 0]
    x = k[:n, 0, 0].astype(np.float64) * s
    p = 256 * np.exp(x - x.max())  # one tile's worth of rule: the maximum is key 0's
    got = (p.astype(np.float32).astype(f8).astype(np.float64) @ v[:n, 0]) / p.sum()
    err = np.linalg.norm(got - ref)
    bound = reference.fp8_query_error_bound(**host, **kw)[0, 0]
    assert err > 0.5 * np.linalg.norm(ref)  # the subnormals' error rivals the output
    assert err <= bound
    with pytest.raises(ValueError, match="8-bit values"):
        reference.fp8_query_error_bound(**{**host, "query": q}, **kw)
