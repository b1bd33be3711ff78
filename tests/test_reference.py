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
