"""cupaged.indexer_logits (DSA's lightning indexer over its fp8 paged key cache): its
checks on array metadata (CPU) and, on the GPU, against cupaged.reference.indexer_logits
over caches written by the reference writer: shuffled blocks, contexts of 0 and 1 tokens
and on block boundaries, next_n 1 and 2, -inf past each row's keys and the width, NaN for
the columns of a bad block id and nowhere else."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import _arrays, _dtypes, indexer, reference, testing
from test_validation import Fake

BF16 = _dtypes.BF16.numpy


def args(**over):
    a = dict(q=np.zeros((3, 2, 64, 128), BF16), kv_cache=np.zeros((10, 64, 132), np.uint8),
             weights=np.zeros((6, 64), np.float32), block_tables=np.zeros((3, 4), np.int32),
             seq_lens=np.zeros(3, np.int32), out=None)
    a.update(over)
    return a


class Launched(Exception):
    """Raised where a call's device work would begin: every check has passed."""


def _stop_at_the_device(monkeypatch):
    """The entry points take Fake arrays, and stop (Launched) where device work begins."""
    real = _arrays.as_device_array
    one = lambda x, name: x if isinstance(x, Fake) else real(x, name)  # noqa: E731
    monkeypatch.setattr(indexer, "as_device_array", one)
    monkeypatch.setattr(_arrays, "as_device_array", one)

    def on_device(device):
        raise Launched

    monkeypatch.setattr(_arrays, "on_device", on_device)


@pytest.fixture
def call(monkeypatch):
    """indexer_logits over Fake arrays, stopped before any device work (its launch)."""
    _stop_at_the_device(monkeypatch)

    def run(max_seq_len=256, **over):
        a = {k: (v if v is None or isinstance(v, Fake) else Fake(v, ptr=(i + 1) << 24))
             for i, (k, v) in enumerate(args(**over).items())}
        try:
            cupaged.indexer_logits(a["q"], a["kv_cache"], a["weights"], a["block_tables"],
                                   a["seq_lens"], max_seq_len=max_seq_len, out=a["out"])
        except Launched:
            return True
        return False
    return run


def test_deepgemms_forms_are_accepted(call):
    assert call()
    assert call(q=np.zeros((3, 64, 128), np.float16), weights=np.zeros((3, 64), np.float32))
    assert call(weights=np.zeros((3, 2, 64), np.float32))
    assert call(kv_cache=np.zeros((10, 64, 1, 132), np.uint8), q=np.zeros((3, 2, 16, 128), BF16),
                weights=np.zeros((6, 16), np.float32), out=np.zeros((6, 256), np.float32))
    assert call(kv_cache=np.zeros((10, 4, 132), np.int8))


@pytest.mark.parametrize("over, exc, match", [
    (dict(q=np.zeros((3, 2, 64, 128), np.float32)), TypeError, "q must be float16 or bfloat16"),
    (dict(q=np.zeros((3, 2, 64, 64), BF16)), ValueError,
     r"q must be \[batch, next_n, num_heads, 128\]"),
    (dict(q=np.zeros((3, 2, 40, 128), BF16), weights=np.zeros((6, 40), np.float32)), ValueError,
     r"num_heads must be one of \(16, 32, 48, 64\)"),
    (dict(q=np.zeros((3, 2, 64, 256), BF16)[..., ::2]), ValueError,
     "q's last dimension must be contiguous"),
    (dict(weights=np.zeros((6, 64), np.float16)), TypeError, "weights must be float32"),
    (dict(weights=np.zeros((6, 32), np.float32)), ValueError,
     r"weights must be float32 \[batch \* next_n, num_heads\] = \[6, 64\]"),
    (dict(kv_cache=np.zeros((10, 64, 132), np.float16)), TypeError, "1-byte storage"),
    (dict(kv_cache=np.zeros((10, 64, 136), np.uint8)), ValueError,
     r"kv_cache must be \[num_blocks, block_size, 132\]"),
    (dict(kv_cache=np.zeros((10, 2, 132), np.uint8)), ValueError,
     "block_size must be a power of two from 4 to 256"),
    (dict(kv_cache=np.zeros((10, 64, 140), np.uint8)[:, :, :132]), ValueError,
     "each block of kv_cache must be one contiguous run"),
    (dict(block_tables=np.zeros((2, 4), np.int32)), ValueError, r"block_tables must be \[num_seqs=3"),
    (dict(seq_lens=np.zeros(3, np.int64)), TypeError, "seq_lens"),
    (dict(out=np.zeros((6, 128), np.float32)), ValueError,
     r"out must be a C-contiguous float32 array of shape \(6, 256\)"),
])
def test_refusals_name_the_argument(call, over, exc, match):
    with pytest.raises(exc, match=match):
        call(**over)


def test_max_seq_len_is_required_as_an_int(call):
    with pytest.raises(TypeError, match="max_seq_len must be a non-negative int"):
        call(max_seq_len=256.0)
    with pytest.raises(ValueError, match="max_seq_len must be a non-negative int"):
        call(max_seq_len=-1)


def test_out_must_not_overlap_what_is_read(call):
    with pytest.raises(ValueError, match="out and weights overlap in memory"):
        call(out=Fake(np.zeros((6, 256), np.float32), ptr=3 << 24))  # weights' address


def test_the_width_is_bounded_by_the_grid(call):
    from cupaged import _checks, indexer

    limit = _checks.MAX_GRID_YZ * indexer.CHUNK
    with pytest.raises(ValueError, match=f"max_seq_len {limit + 1} is past the {limit} columns"):
        call(max_seq_len=limit + 1)


def test_the_launch_gets_each_rows_stride(monkeypatch):
    """A 4-D q or 3-D weights with next_n 1 (a slice of a wider next_n, say) are read a
    batch entry a row: the size-1 dimension's stride is not the row stride."""
    import contextlib

    _stop_at_the_device(monkeypatch)
    monkeypatch.setattr(_arrays, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_arrays, "context", lambda device, kind, stream=None:
                        _arrays.Context(device, 7, kind, False))
    launched = []
    monkeypatch.setattr(indexer, "_kernel", lambda *k: lambda *a: launched.append(a))
    q2 = np.zeros((3, 2, 64, 128), BF16)
    w2 = np.zeros((3, 2, 64), np.float32)
    f = dict(q=Fake(q2[:, :1], ptr=1 << 24), kv_cache=Fake(np.zeros((10, 64, 132), np.uint8)),
             weights=Fake(w2[:, :1], ptr=2 << 24), block_tables=Fake(np.zeros((3, 4), np.int32)),
             seq_lens=Fake(np.zeros(3, np.int32)),
             out=Fake(np.zeros((3, 256), np.float32), ptr=3 << 24))
    cupaged.indexer_logits(f["q"], f["kv_cache"], f["weights"], f["block_tables"],
                           f["seq_lens"], max_seq_len=256, out=f["out"])
    (a,) = launched
    grid, threads, smem, stream, *args = a
    assert grid == (3, 1, 1) and threads == 64 * 2 and stream == 7
    assert args[4] == 2 * 64 * 128 and args[5] == 128  # q: a batch entry a row, heads
    assert args[7] == 2 * 64  # weights: a batch entry a row
    assert args[-1] == 1  # next_n


def test_blocks_must_be_16_byte_aligned(call):
    with pytest.raises(ValueError, match="start at 16-byte boundaries"):
        call(kv_cache=Fake(np.zeros((10, 64, 132), np.uint8), ptr=(1 << 24) + 4))


# ---- GPU: against the float64 reference -------------------------------------------------------


def problem(rng, lens, next_n, heads, block_size, dtype=BF16, spare=3):
    """Host arrays: q, weights, a cache written by the reference writer (keys 2^-8 to 2^8
    a token, NaN in every slot no sequence holds), shuffled block tables."""
    lens = np.asarray(lens, np.int32)
    bt, nb = testing.random_block_tables(lens, block_size, rng, spare_blocks=spare)
    k = testing.random_normal((nb * block_size, 128), np.float32, rng)
    k *= 2.0 ** rng.integers(-8, 9, (len(k), 1))
    cache = np.zeros((nb, block_size, 132), np.uint8)
    reference.indexer_k_quant_and_cache(k, cache, np.arange(nb * block_size), 128)
    used = np.zeros(nb, bool)
    for s, n in enumerate(lens):
        used[bt[s, :-(-n // block_size)]] = True
    cache[~used] = 0x7F  # NaN values, NaN-ish scales: never read
    batch = len(lens)
    q = testing.random_normal((batch, next_n, heads, 128), dtype, rng)
    w = rng.standard_normal((batch * next_n, heads)).astype(np.float32)
    return dict(q=q, kv_cache=cache, weights=w, block_tables=bt, seq_lens=lens)


def run(h, width, **kw):
    import cupy

    d = {k: cupy.asarray(v) for k, v in h.items()}
    out = cupy.full((h["weights"].shape[0], width), 7.0, np.float32)  # poisoned
    got = cupaged.indexer_logits(d["q"], d["kv_cache"], d["weights"], d["block_tables"],
                                 d["seq_lens"], max_seq_len=width, out=out, **kw)
    assert got is out
    return cupy.asnumpy(out)


def want(h, width):
    """The reference's logits; a sequence with fewer tokens than its query rows (which the
    reference refuses) sees no key: its rows all -inf."""
    batch, next_n = h["q"].shape[:2]
    ok = np.flatnonzero(h["seq_lens"] >= next_n)
    rows = (ok[:, None] * next_n + np.arange(next_n)).ravel()
    out = np.full((batch * next_n, width), -np.inf)
    out[rows] = reference.indexer_logits(
        h["q"][ok].reshape(len(rows), *h["q"].shape[2:]), h["kv_cache"], h["weights"][rows],
        h["block_tables"][ok], h["seq_lens"][ok], np.arange(len(ok) + 1) * next_n,
        max_seq_len=width)
    return out


def check(got, ref):
    assert np.array_equal(np.isneginf(got), np.isneginf(ref))
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    f = np.isfinite(ref)
    assert np.isfinite(got[f]).all()
    scale = np.abs(ref).max(-1, keepdims=True, initial=0, where=f)  # a row's largest logit
    with np.errstate(invalid="ignore"):  # -inf - -inf where masked
        err = np.abs(got - ref) / np.maximum(scale, 1e-30)
    # float32 sums of exact products (q's 16 bits times e4m3's 4) against float64
    assert err[f].max(initial=0) <= 1e-4, err[f].max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.float16])
@pytest.mark.parametrize("heads", [16, 48, 64])
@pytest.mark.parametrize("next_n, block_size", [(1, 64), (2, 16), (1, 4), (2, 256), (3, 32),
                                               (5, 64)])
def test_logits_match_the_reference(rng, dtype, heads, next_n, block_size):
    """Contexts of 0 to 2,100 tokens (one row without keys, block boundaries, three CTAs'
    chunks of columns), a width past every context: -inf beyond each row's last key and
    in every unseen column. next_n 2 and more: a CTA takes a sequence's rows in pairs (3
    and 5: a last row alone)."""
    lens = [0, 1, 63, 64, 65, 513, 1100, 2100] if next_n == 1 else \
        [next_n, next_n + 1, 63, 64, 65, 513, 1100, 2100]
    h = problem(rng, lens, next_n, heads, block_size, dtype)
    width = 2200
    check(run(h, width), want(h, width))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_queries_of_any_finite_magnitude(rng, dtype):
    """The products run in float16: a bfloat16 query is scaled by a power of two per row
    and warp of heads into float16's range, the inverse folded into the weights. Rows of
    query magnitudes 2^80, 2^-80 and 1 (bfloat16, within the range the scale keeps
    exact; float16 takes 2^10, 2^-10 and 1), one row whose heads span 2^-12 to 2^12, and
    with next_n 2 a pair of rows 2^160 apart in one CTA, each against the reference to
    the row's largest logit."""
    big = 10 if dtype == np.float16 else 80
    for next_n in (1, 2):  # 2: a CTA's pair of rows, each with its own scale
        h = problem(rng, [300, 300, 300, 300], next_n, 64, 64, dtype)
        q = h["q"].astype(np.float32)  # [batch, next_n, heads, 128]
        q[0] *= 2.0 ** big
        q[1] *= 2.0 ** -big
        q[3] *= 2.0 ** np.linspace(-12, 12, 64, dtype=np.float32)[:, None]
        if next_n == 2:
            q[2, 0] *= 2.0 ** big
            q[2, 1] *= 2.0 ** -big
        h["q"] = q.astype(dtype)
        check(run(h, 512), want(h, 512))


@pytest.mark.gpu
def test_nan_keys_and_queries_give_nan_logits(rng):
    """relu keeps a NaN (the reference's and torch's do): a NaN in a key makes its column
    NaN, a NaN in a query head its whole row, as in the reference."""
    h = problem(rng, [300, 300], 1, 64, 64)
    blocks = h["kv_cache"].reshape(h["kv_cache"].shape[0], -1)
    b0 = h["block_tables"][0, 0]
    blocks[b0, 5 * 128 + 7] = 0x7F  # key 5 of sequence 0: one NaN value
    h["q"][1, 0, 3, 10] = np.nan  # sequence 1's row: one head NaN
    got, ref = run(h, 512), want(h, 512)
    assert np.isnan(ref[0, 5]) and np.isnan(got[0, 5]) and np.isnan(got[1, :300]).all()
    check(got, ref)


@pytest.mark.gpu
def test_a_width_shorter_than_the_contexts_cuts_the_columns(rng):
    h = problem(rng, [700, 300], 1, 64, 64)
    check(run(h, 600), want(h, 600))


@pytest.mark.gpu
def test_a_bad_block_id_gives_its_columns_nan_and_no_others(rng):
    h = problem(rng, [200, 200], 1, 32, 64)
    h["block_tables"][0, 1] = 10 ** 6  # tokens 64..127 of sequence 0
    got = run(h, 256)
    assert np.isnan(got[0, 64:128]).all() and not np.isnan(np.delete(got[0], range(64, 128))).any()
    ok = dict(h, block_tables=h["block_tables"].copy())
    ok["block_tables"][0, 1] = ok["block_tables"][1, 0]
    ref = want(ok, 256)
    keep = np.ones(256, bool)
    keep[64:128] = False
    check(got[:, keep], ref[:, keep])
    assert not np.isnan(got[1]).any()


@pytest.mark.gpu
def test_a_bad_block_only_the_later_row_sees_is_nan_there_alone(rng):
    """next_n 2, 65 keys in pages of 64: token 64 (block 1) is the second row's alone. With
    that block id bad, the second row's column 64 is NaN and the first row's -inf (a key it
    does not see, though its CTA reads the tile for its partner)."""
    h = problem(rng, [65, 130], 2, 16, 64)
    ok = dict(h, block_tables=h["block_tables"].copy())  # the reference reads a real block
    h["block_tables"][0, 1] = 10 ** 6
    got = run(h, 128)
    assert np.isneginf(got[0, 64:]).all() and np.isnan(got[1, 64]) and \
        np.isneginf(got[1, 65:]).all()
    ref = want(ok, 128)
    check(got[:2, :64], ref[:2, :64])
    check(got[2:], ref[2:])


@pytest.mark.gpu
def test_the_chain_picks_the_references_top_k(rng):
    """indexer_k_quant_and_cache (GPU) -> indexer_logits (GPU) -> reference top-k: the
    columns the reference's top-k picks from the GPU logits equal the ones it picks from its
    own, but where two logits tie within the GPU's rounding."""
    import cupy

    h = problem(rng, [900, 400], 1, 64, 64)
    k = testing.random_normal((h["kv_cache"].shape[0] * 64, 128), BF16, rng)
    cache = cupy.zeros(h["kv_cache"].shape, np.uint8)
    slots = np.arange(len(k))
    cupaged.indexer_k_quant_and_cache(cupy.asarray(k), cache, cupy.asarray(slots))
    h = dict(h, kv_cache=np.zeros(h["kv_cache"].shape, np.uint8))
    reference.indexer_k_quant_and_cache(k, h["kv_cache"], slots)
    assert (cupy.asnumpy(cache) == h["kv_cache"]).all()
    got = run(h, 1024)
    ref = want(h, 1024)
    check(got, ref)
    top_got, top_ref = reference.indexer_topk(got, 64), reference.indexer_topk(ref, 64)
    for r in range(2):
        differ = set(top_got[r]) ^ set(top_ref[r])
        if differ:  # only near-ties may swap
            kth = np.sort(ref[r][np.isfinite(ref[r])])[-64]
            assert all(abs(ref[r, c] - kth) <= 1e-3 * abs(kth) for c in differ if c >= 0)


def test_the_host_mirror_is_the_kernels():
    """indexer_smem_bytes against IndexerGeometry, through NVRTC (no GPU), every head count
    and both targets; every shape fits sm_80's shared memory."""
    from cupaged import jit
    from cupaged.specs import geometry

    specs = [jit.KernelSpec("indexer_logits", d, rows=h, block_size=64, group_tile=g, arch=a)
             for d in ("f16", "bf16") for h in indexer.HEADS for g in (1, 2)
             for a in ("sm_80", "sm_90")]
    geometry.check_against_kernel(specs)
    assert all(geometry.indexer_smem_bytes(h, g) <= geometry.max_smem("sm_80")
               for h in indexer.HEADS for g in (1, 2))


@pytest.mark.parametrize("next_n, rows", [(1, 1), (2, 2), (3, 2), (5, 2)])
def test_a_cta_takes_a_sequences_rows_in_pairs(next_n, rows):
    assert indexer.rows_a_cta(next_n) == rows


# ---- indexer_topk ---------------------------------------------------------------------------------


@pytest.fixture
def topk_call(monkeypatch):
    """indexer_topk over Fake arrays, stopped before any device work."""
    _stop_at_the_device(monkeypatch)

    def run(logits=None, topk=2048, out=None, block_tables=None, **kw):
        lg = Fake(np.zeros((4, 8192), np.float32) if logits is None else logits, ptr=1 << 24)
        o = None if out is None else Fake(out, ptr=1 << 28)
        bt = None if block_tables is None else Fake(block_tables, ptr=1 << 30)
        try:
            cupaged.indexer_topk(lg, topk, out=o, block_tables=bt, **kw)
        except Launched:
            return True
        return False
    return run


def test_topk_out_must_not_overlap_the_logits(topk_call):
    lg = Fake(np.zeros((4, 8192), np.float32), ptr=1 << 24)
    with pytest.raises(ValueError, match="out and logits overlap in memory"):
        cupaged.indexer_topk(lg, 2048, out=Fake(np.zeros((4, 2048), np.int32), ptr=1 << 24))


def test_topk_forms_are_accepted(topk_call):
    assert topk_call() and topk_call(topk=1, out=np.zeros((4, 1), np.int32))
    assert topk_call(logits=np.zeros((4, 9000), np.float32)[:, :8192])  # rows apart
    # global slots: a table row per sequence of next_n rows, rows apart, one block
    assert topk_call(block_tables=np.zeros((4, 128), np.int32), block_size=64)
    assert topk_call(block_tables=np.zeros((2, 200), np.int32)[:, :128], block_size=1,
                     next_n=2)
    assert topk_call(block_tables=np.zeros((1, 1), np.int32), block_size=256, next_n=4)


def test_topk_tables_are_flagged_by_next_n_not_by_their_address():
    """The kernel maps columns through a table where next_n is set, whatever the table's
    address: an empty one (address 0, as CuPy and torch give it) still maps, every column
    past its 0 blocks a fault; without tables next_n is 0."""
    empty = Fake(np.zeros((4, 0), np.int32), ptr=0)
    assert indexer._slot_table(empty, 16, 1, 4) == (0, 0, 0, 16, 1)
    assert indexer._slot_table(empty, 16, 2, 8)[4] == 2
    assert indexer._slot_table(None, None, 1, 4)[4] == 0


def test_topk_tables_must_not_overlap_out(topk_call):
    lg = Fake(np.zeros((4, 8192), np.float32), ptr=1 << 24)
    with pytest.raises(ValueError, match="out and block_tables overlap in memory"):
        cupaged.indexer_topk(lg, 2048, out=Fake(np.zeros((4, 2048), np.int32), ptr=1 << 28),
                             block_tables=Fake(np.zeros((4, 8), np.int32), ptr=1 << 28),
                             block_size=16)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(logits=np.zeros((4, 64), np.float16)), TypeError, "logits must be float32"),
    (dict(logits=np.zeros((4, 2, 64), np.float32)), ValueError, r"logits must be 2-D"),
    (dict(logits=np.zeros((4, 128), np.float32)[:, ::2]), ValueError,
     "logits' last dimension must be contiguous"),
    (dict(topk=0), ValueError, "topk must be from 1 to 2048"),
    (dict(topk=2049), ValueError, "topk must be from 1 to 2048"),
    (dict(topk=2.0), TypeError, "topk must be an int"),
    (dict(out=np.zeros((4, 2048), np.int64)), ValueError,
     r"out must be a C-contiguous int32 array of shape \(4, 2048\)"),
    (dict(block_size=16), ValueError, "block_size and next_n go with block_tables"),
    (dict(next_n=2), ValueError, "block_size and next_n go with block_tables"),
    (dict(block_tables=np.zeros((4, 8), np.int64), block_size=16), TypeError,
     "block_tables must be int32"),
    (dict(block_tables=np.zeros((4, 8), np.int32)), ValueError,
     "block_size must be a power of two from 1 to 256 .the cache's., got None"),
    (dict(block_tables=np.zeros((4, 8), np.int32), block_size=24), ValueError,
     "block_size must be a power of two"),
    (dict(block_tables=np.zeros((4, 8), np.int32), block_size=True), ValueError,
     "block_size must be a power of two"),
    (dict(block_tables=np.zeros((4, 8), np.int32), block_size=16, next_n=0), ValueError,
     "next_n must be a positive int, got 0"),
    (dict(block_tables=np.zeros((4, 8), np.int32), block_size=16, next_n=3), ValueError,
     r"block_tables must be \[rows / next_n, max_blocks\] with rows \(4\) a multiple of "
     r"next_n \(3\), got shape \(4, 8\)"),
    (dict(block_tables=np.zeros((4, 8), np.int32), block_size=16, next_n=2), ValueError,
     r"block_tables must be \[rows / next_n, max_blocks\]"),
    (dict(block_tables=np.zeros(4, np.int32), block_size=16), ValueError,
     r"block_tables must be \[rows / next_n"),
    (dict(block_tables=np.zeros((4, 16), np.int32)[:, ::2], block_size=16), ValueError,
     "block_tables' rows must be contiguous"),
])
def test_topk_refusals_name_the_argument(topk_call, kw, exc, match):
    with pytest.raises(exc, match=match):
        topk_call(**kw)


def topk_rows(rng, rows, width):
    """Logits with runs of ties, -0 and +0, -inf, +inf and NaN, a row of one repeated value,
    a row with no finite value and one with fewer finite values than most top-ks."""
    x = rng.standard_normal((rows, width)).astype(np.float32)
    r = rng.random((rows, width))
    x[r < 0.2] = np.round(x[r < 0.2] * 4) / 4  # ties
    x[(r >= 0.2) & (r < 0.3)] = -np.inf
    x[(r >= 0.3) & (r < 0.32)] = np.nan
    x[(r >= 0.32) & (r < 0.33)] = np.inf
    x[(r >= 0.33) & (r < 0.35)] = -0.0
    x[(r >= 0.35) & (r < 0.37)] = 0.0
    x[0] = 1.5
    x[1] = -np.inf
    x[2, 40:] = -np.inf
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("width, topk", [(1, 1), (100, 64), (5000, 2048), (131072, 2048),
                                         (3000, 1000), (70000, 37)])
def test_topk_matches_the_reference(rng, width, topk):
    import cupy

    x = topk_rows(rng, 6, width)
    out = cupy.full((6, topk), 12345, np.int32)
    got = cupaged.indexer_topk(cupy.asarray(x), topk, out=out)
    assert got is out
    want = reference.indexer_topk(x, topk)
    assert np.array_equal(cupy.asnumpy(out), want)


@pytest.mark.gpu
@pytest.mark.parametrize("width, topk", [(32768, 2048), (2048, 2048), (4097, 4)])
def test_topk_of_distinct_logits(rng, width, topk):
    """Distinct values (no tie at the k-th: its equals join the keys above it in one
    pass) in rows of like magnitude (their top bits shared, so the first radix passes
    count most keys into a few bins), and the same values negated."""
    import cupy

    x = (1.0 + rng.permutation(width)[None] / width + np.zeros((3, 1))).astype(np.float32)
    x[1] = -x[1]
    x[2] = rng.permutation(x[0])
    got = cupaged.indexer_topk(cupy.asarray(x), topk)
    assert np.array_equal(cupy.asnumpy(got), reference.indexer_topk(x, topk))


@pytest.mark.gpu
@pytest.mark.parametrize("in_bin", [2049, 3840, 3841])
@pytest.mark.parametrize("tie", [False, True], ids=["distinct", "tie-cut"])
def test_topk_around_the_kept_bins_size(rng, in_bin, tie):
    """The k-th's first-digit bin (the key's top 12 bits) kept in shared memory when it
    holds at most 3840 keys, counted in passes over the row when it holds more: bins of
    2049, 3840 and 3841 keys in [1, 1.125) under 1000 keys above them and beside smaller
    ones; with six equals at the k-th, of which three are taken (the lowest columns), or
    none."""
    import cupy

    width, topk = 8000, 2048
    above = 4 + 4 * rng.permutation(1000) / 1000
    in_k = 1 + rng.permutation(in_bin) / (in_bin * 8)
    if tie:
        order = np.sort(in_k)[::-1]
        kth = order[topk - 1000 - 1]
        in_k[np.isin(in_k, order[topk - 1000 - 3:topk - 1000 + 3])] = kth
    below = 0.25 + rng.random(width - 1000 - in_bin) / 4
    x = np.concatenate([above, in_k, below]).astype(np.float32)
    x = np.stack([x[rng.permutation(width)] for _ in range(3)])
    got = cupaged.indexer_topk(cupy.asarray(x), topk)
    want = reference.indexer_topk(x, topk)
    if tie:
        kth32 = np.float32(kth)
        assert ((x[0] == kth32).sum() == 6 and
                (x[0][want[0]] == kth32).sum() == 3)  # the tie is cut
    assert np.array_equal(cupy.asnumpy(got), want)


@pytest.mark.gpu
@pytest.mark.parametrize("next_n, block_size", [(1, 64), (2, 16), (3, 1)])
def test_topk_as_global_slots(rng, next_n, block_size):
    """block_tables: the picked columns as global slots through each row's sequence's
    table (reference.indexer_slots over the reference's columns, and the rule written out
    here), -1 kept; a column past the table's blocks, a negative block id and (pages over
    one token) a block whose slot leaves int32 come out as -2^31 (a fault to
    sparse_mla_attention's decode), not as a slot; tables rows apart; an empty table (its
    address 0) faults every column."""
    import cupy

    seqs, width, topk = 4, 700, 96
    rows = seqs * next_n
    x = topk_rows(rng, rows, width)
    blocks = -(-width // block_size)
    wide = rng.permutation(10 ** 5)[:seqs * (blocks + 3)].reshape(seqs, blocks + 3)
    wide = wide.astype(np.int32)
    bt = wide[:, :blocks - 1]  # the last block's columns are past the table
    fault = np.int32(-2 ** 31)
    bt[0, 0] = -3
    bt[1, 1 % (blocks - 1)] = 2 ** 31 // block_size + 1 if block_size > 1 else 2 ** 31 - 1
    cols = reference.indexer_topk(x, topk)
    seq = np.arange(rows) // next_n
    want = np.full_like(cols, -1)
    for r, c in np.argwhere(cols >= 0):
        col = int(cols[r, c])
        b = col // block_size
        slot = -1 if b >= bt.shape[1] else int(bt[seq[r], b]) * block_size + col % block_size
        want[r, c] = slot if 0 <= slot < 2 ** 31 else fault
    lens = np.full(seqs, width, np.int32)
    starts = np.arange(0, rows + 1, next_n)
    assert np.array_equal(reference.indexer_slots(cols, bt, block_size, lens, starts), want)
    assert (want == fault).any() and (want == -1).any()
    dev = cupy.asarray(wide)[:, :blocks - 1]
    dev[...] = cupy.asarray(bt)
    out = cupy.full((rows, topk), 12345, np.int32)
    got = cupaged.indexer_topk(cupy.asarray(x), topk, block_tables=dev, block_size=block_size,
                               next_n=next_n, out=out)
    assert got is out
    assert np.array_equal(cupy.asnumpy(out), want)
    empty = cupy.zeros((seqs, 0), np.int32)
    got = cupaged.indexer_topk(cupy.asarray(x), topk, block_tables=empty,
                               block_size=block_size, next_n=next_n)
    assert np.array_equal(cupy.asnumpy(got), np.where(cols >= 0, fault, -1))


@pytest.mark.gpu
def test_topk_over_strided_rows_and_the_logits_kernel(rng):
    """Rows a view of wider rows; then the chain logits -> top-k against the reference's
    top-k of the GPU logits (the same input: the selection itself is exact)."""
    import cupy

    wide = topk_rows(rng, 5, 3000)
    got = cupaged.indexer_topk(cupy.asarray(wide)[:, :2500], 300)
    assert np.array_equal(cupy.asnumpy(got), reference.indexer_topk(wide[:, :2500], 300))
    h = problem(rng, [900, 400, 1], 1, 64, 64)
    logits = cupaged.indexer_logits(*(cupy.asarray(h[k]) for k in (
        "q", "kv_cache", "weights", "block_tables", "seq_lens")), max_seq_len=1024)
    top = cupaged.indexer_topk(logits, 512)
    assert np.array_equal(cupy.asnumpy(top), reference.indexer_topk(cupy.asnumpy(logits), 512))
