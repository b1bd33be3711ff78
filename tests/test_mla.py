"""cupaged.mla_attention (absorbed MLA over a paged latent cache) against the float64
reference: decode, several tokens per sequence, chunked prefill, page sizes, head counts,
both cache forms and both query forms, split-KV, stale NaN slots, bad block ids, lse."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import planning, reference, testing

from conftest import assert_close

pytestmark = pytest.mark.gpu

RANK, ROPE = 512, 64
SCALE = 1 / np.sqrt(192)  # DeepSeek's: the per-head q.k length before absorption


def _np_dtype(name):
    import ml_dtypes  # noqa: F401  (bfloat16 for NumPy)

    return np.float16 if name == "f16" else np.dtype("bfloat16")


def make_mla(rng, q_lens, seq_lens, *, heads=16, block_size=16, dtype="bf16", stale=np.nan,
             spare_blocks=3, share=False):
    """Host arrays of an MLA problem: q [total_q, heads, 576], a combined cache whose slots
    outside every sequence hold ``stale``, block tables, lengths, query starts."""
    dt = _np_dtype(dtype)
    tables, nb = testing.random_block_tables(seq_lens, block_size, rng,
                                             spare_blocks=spare_blocks, share=share)
    cache = testing.random_normal((nb, block_size, RANK + ROPE), dt, rng)
    used = np.zeros((nb, block_size), bool)
    for s, n in enumerate(seq_lens):
        t = np.arange(n)
        used[tables[s, t // block_size], t % block_size] = True
    cache[~used] = stale
    total_q = int(sum(q_lens))
    q = testing.random_normal((total_q, heads, RANK + ROPE), dt, rng)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return dict(q=q, kv_cache=cache, block_tables=tables,
                seq_lens=np.asarray(seq_lens, np.int32), query_start_loc=starts)


def device(host):
    import cupy

    return {k: cupy.asarray(v) for k, v in host.items()}


def ref_of(host, causal=True, return_lse=False, decode=False):
    h = dict(host)
    if decode:
        h["query_start_loc"] = None
    return reference.mla_attention(h["q"], h["kv_cache"], h["block_tables"], h["seq_lens"],
                                   h["query_start_loc"], scale=SCALE, causal=causal,
                                   return_lse=return_lse)


@pytest.fixture
def mla_split():
    """Set mla_attention's split-KV (tiles per partition; 0 never) for one test."""
    yield planning.set_mla_split
    planning.set_mla_split(None)


@pytest.fixture(params=["mma", "sm90"])
def family(request):
    """Each MLA kernel family in turn (the wgmma one on a Hopper GPU only)."""
    import cupy

    if request.param == "sm90" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU (compute capability 9.0)")
    planning.set_mla_family(request.param)
    yield request.param
    planning.set_mla_family(None)


@pytest.fixture
def mla_tile():
    """Force mla_attention's (rows, tile_tokens, stages) for one test."""
    yield planning.set_mla_tile
    planning.set_mla_tile(None)


def poisoned_out(host, xp):
    q = host["q"]
    return xp.full((q.shape[0], q.shape[1], RANK), np.nan, dtype=q.dtype)


# (q_lens, seq_lens): decode rows, multi-token prediction, verify, a chunk of a long
# context, empty sequences, single-token caches, block and tile boundaries.
MIXED = ([1, 2, 0, 4, 37, 1, 3], [1, 2, 0, 4097, 1000, 33, 64])


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
@pytest.mark.parametrize("heads", [16, 20, 32, 64, 128])
def test_mixed_batch_matches_reference(rng, family, dtype, block_size, heads):
    import cupy

    host = make_mla(rng, *MIXED, heads=heads, block_size=block_size, dtype=dtype)
    dev = device(host)
    out = poisoned_out(dev, cupy)
    got = cupaged.mla_attention(**dev, scale=SCALE, out=out)
    assert got is out
    assert_close(cupy.asnumpy(got).astype(np.float64), ref_of(host),
                 testing.TOLERANCE[dtype], f"{dtype} bs={block_size} heads={heads}")


@pytest.mark.parametrize("split", [None, 0, 1, 3], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_split_kv_and_lse(rng, family, mla_split, split, causal):
    import cupy

    mla_split(split)
    host = make_mla(rng, [1, 2, 0, 5, 130], [700, 2, 0, 3000, 400], heads=16, block_size=64)
    dev = device(host)
    got, lse = cupaged.mla_attention(**dev, scale=SCALE, causal=causal, return_lse=True)
    ref, ref_lse = ref_of(host, causal=causal, return_lse=True)
    assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                 f"split={split} causal={causal}")
    np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=0, atol=2e-3)


def test_decode_without_query_start_loc_and_torch(rng):
    torch = pytest.importorskip("torch")
    host = make_mla(rng, [1] * 9, [1, 15, 16, 17, 64, 65, 300, 2048, 4096], heads=128,
                    block_size=64)
    t = {k: torch.from_numpy(host[k]).cuda() for k in ("block_tables", "seq_lens")}
    for k in ("q", "kv_cache"):  # bfloat16 through its bits (ml_dtypes' is not torch's)
        t[k] = torch.from_numpy(host[k].view(np.int16)).view(torch.bfloat16).cuda()
    got = cupaged.mla_attention(**t, scale=SCALE)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert_close(got.float().cpu().numpy(), ref_of(host, decode=True), testing.TOLERANCE["bf16"])


def test_query_and_cache_pairs(rng, family):
    """(q_nope, q_pe) and FlashInfer's kv_c / k_pe caches: separate arrays, and views of
    one allocation with odd strides."""
    import cupy

    host = make_mla(rng, [3, 1, 8], [50, 1, 300], heads=32, block_size=32)
    dev = device(host)
    ref = ref_of(host)
    # Views: a query padded to 1024 per head, read in two parts.
    wide = cupy.zeros(dev["q"].shape[:2] + (1024,), dev["q"].dtype)
    wide[..., :RANK + ROPE] = dev["q"]
    q_pair = (wide[..., :RANK], wide[..., RANK:RANK + ROPE])
    cache = dev["kv_cache"]
    kv_c, k_pe = cache[..., :RANK], cache[..., RANK:]
    sep = (cupy.ascontiguousarray(kv_c), cupy.ascontiguousarray(k_pe))
    args = dict(block_tables=dev["block_tables"], seq_lens=dev["seq_lens"],
                query_start_loc=dev["query_start_loc"], scale=SCALE)
    for q in (dev["q"], q_pair):
        for c, pe in ((cache, None), (kv_c, k_pe), sep):
            got = cupaged.mla_attention(q, c, k_pe_cache=pe, **args)
            assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                         f"q pair={isinstance(q, tuple)} cache pair={pe is not None}")


@pytest.mark.parametrize("stale", [float("inf"), float("-inf"), float("nan")])
def test_stale_slots_never_reach_the_output(rng, family, mla_split, stale):
    import cupy

    for split in (0, 2):
        mla_split(split)
        host = make_mla(rng, [1, 4, 3], [17, 70, 129], heads=16, block_size=64, stale=stale)
        got = cupaged.mla_attention(**device(host), scale=SCALE)
        assert_close(cupy.asnumpy(got).astype(np.float64), ref_of(host),
                     testing.TOLERANCE["bf16"], f"stale={stale} split={split}")


@pytest.mark.parametrize("split", [0, 2])
@pytest.mark.parametrize("bad", [5, 20], ids=["tile1", "tile5"])
@pytest.mark.parametrize("past", [0, 10**6], ids=["at_the_end", "far"])
def test_a_bad_block_id_gives_nan_for_its_sequence_only(rng, family, mla_split, split, bad,
                                                        past):
    """A block id outside the cache (the first past its end, or far past it) in a
    sequence's second or sixth 64-key tile (the wgmma kernel's producer issues the first
    two before its loop, the rest in it). The cache ends at unmapped memory
    (testing.guarded), so a read of the block just past it faults."""
    import cupy

    mla_split(split)
    host = make_mla(rng, [2, 3], [300, 400], heads=16, block_size=16)
    host["block_tables"][1, bad] = host["kv_cache"].shape[0] + past
    dev = device(host)
    dev["kv_cache"] = testing.guarded(host["kv_cache"], "after")
    got = cupy.asnumpy(cupaged.mla_attention(**dev, scale=SCALE)).astype(np.float64)
    first = {**host, "seq_lens": host["seq_lens"][:1], "block_tables": host["block_tables"][:1],
             "query_start_loc": host["query_start_loc"][:2], "q": host["q"][:2]}
    assert_close(got[:2], ref_of(first), testing.TOLERANCE["bf16"])
    assert np.isnan(got[2:]).all()


@pytest.mark.parametrize("split", [0, 2])
def test_an_empty_sequence_gives_zeros_and_minus_inf_lse(rng, family, mla_split, split):
    """A length-0 sequence decoding (one row, no query_start_loc) sees no key: zeros and
    lse -inf in every head, in a single pass and split; the other sequences exact."""
    import cupy

    mla_split(split)
    host = make_mla(rng, [1, 1, 1], [300, 1, 700], heads=16, block_size=16)
    host["seq_lens"][1] = 0
    dev = device({k: v for k, v in host.items() if k != "query_start_loc"})
    got, lse = (cupy.asnumpy(a) for a in cupaged.mla_attention(**dev, scale=SCALE,
                                                              return_lse=True))
    assert (got[1] == 0).all() and np.isneginf(lse[1]).all()
    keep = [0, 2]
    rest = {**host, "q": host["q"][keep], "block_tables": host["block_tables"][keep],
            "seq_lens": host["seq_lens"][keep]}
    ref, ref_lse = ref_of(rest, return_lse=True, decode=True)
    assert_close(got[keep].astype(np.float64), ref, testing.TOLERANCE["bf16"], f"split={split}")
    np.testing.assert_allclose(lse[keep], ref_lse, rtol=0, atol=2e-3)


@pytest.mark.parametrize("heads,block_size", [(16, 16), (128, 16), (128, 64)])
@pytest.mark.parametrize("first_len", [0, -3])
def test_an_empty_first_sequence(rng, family, mla_split, heads, block_size, first_len):
    """Sequence 0 decoding with no keys (length 0, or negative: empty) where warpgroup 1
    copies (16 and 128 heads, pages of 16 and 64): its rows are zeros and lse -inf, the
    others exact, single pass and split. The block table starts a mapping (testing.guarded),
    so a read before it faults: the kernel's threads that do not copy once read entry -1 of
    row 0 in pages of 16."""
    import cupy

    for split in (0, 1):
        mla_split(split)
        host = make_mla(rng, [1, 1, 1], [0, 70, 130], heads=heads, block_size=block_size)
        host["seq_lens"][0] = first_len
        dev = device({k: v for k, v in host.items() if k != "query_start_loc"})
        dev["block_tables"] = testing.guarded(host["block_tables"], "before")
        got, lse = (cupy.asnumpy(a) for a in cupaged.mla_attention(**dev, scale=SCALE,
                                                                  return_lse=True))
        assert (got[0] == 0).all() and np.isneginf(lse[0]).all(), f"split={split}"
        keep = [1, 2]
        rest = {**host, "q": host["q"][keep], "block_tables": host["block_tables"][keep],
                "seq_lens": host["seq_lens"][keep]}
        ref, ref_lse = ref_of(rest, return_lse=True, decode=True)
        assert_close(got[keep].astype(np.float64), ref, testing.TOLERANCE["bf16"],
                     f"split={split}")
        np.testing.assert_allclose(lse[keep], ref_lse, rtol=0, atol=2e-3)


@pytest.mark.parametrize("split", [0, 2])
def test_rows_outside_the_query_starts_are_left_as_they_are(rng, family, mla_split, split):
    """Rows before query_start_loc[0] and from query_start_loc[-1] on (a padded batch, as
    cupaged.jax takes one) are written by neither kernel family nor the combine of their
    split partials; the rows between equal the reference, out and lse."""
    import cupy

    mla_split(split)
    host = make_mla(rng, [1, 5, 0, 3], [17, 300, 1, 64], heads=16, block_size=16)
    lead, tail = 2, 3
    q = host["q"]
    pad = lambda n: testing.random_normal((n, *q.shape[1:]), q.dtype, rng)  # noqa: E731
    padded = dict(host, q=np.concatenate([pad(lead), q, pad(tail)]),
                  query_start_loc=host["query_start_loc"] + lead)
    dev = device(padded)
    out = cupy.full((len(padded["q"]), 16, RANK), 7.0, dev["q"].dtype)
    lse = cupy.full((len(padded["q"]), 16), 7.0, np.float32)
    cupaged.mla_attention(**dev, scale=SCALE, out=out, lse=lse, max_query_len=5)
    got, got_lse = cupy.asnumpy(out).astype(np.float64), cupy.asnumpy(lse)
    rows = slice(lead, lead + len(q))
    assert (got[:lead] == 7).all() and (got[rows.stop:] == 7).all()
    assert (got_lse[:lead] == 7).all() and (got_lse[rows.stop:] == 7).all()
    ref, ref_lse = ref_of(host, return_lse=True)
    assert_close(got[rows], ref, testing.TOLERANCE["bf16"], f"split={split}")
    np.testing.assert_allclose(got_lse[rows], ref_lse, rtol=0, atol=2e-3)


def test_long_context_and_undercounted_bounds(rng, family):
    """128k keys in one sequence beside short ones; bounds that undercount the longest
    query and context cost parallelism, never rows or keys."""
    import cupy

    host = make_mla(rng, [3, 1, 70], [131072, 5, 600], heads=16, block_size=64)
    dev = device(host)
    ref = ref_of(host)
    for bounds in ({}, {"max_query_len": 1, "max_seq_len": 64}):
        got = cupaged.mla_attention(**dev, scale=SCALE, **bounds)
        assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                     f"{bounds}")


@pytest.mark.parametrize("cache", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("form", ["decode", "two_tokens_bound_one"])
@pytest.mark.parametrize("split", [None, 1, 2], ids=lambda s: f"split{s}")
def test_tile_counts_around_the_stage_ring(rng, family, mla_split, split, form, cache):
    """Sequences of 0 to 5 tiles of 64 keys, a key past each tile boundary and on it (the
    two-stage ring's first uses), whole and in partitions of 1 and 2 tiles (some with
    none), over a 16-bit and an fp8 cache. Decode form (no query_start_loc), so the empty
    sequence's row is zeros; or two query tokens a sequence with max_query_len=1, so each
    CTA walks two row tiles and carries the ring's slot and phase, odd and even tile counts,
    from one to the next."""
    import cupy

    mla_split(split)
    lens = [1, 64, 65, 128, 129, 192, 193, 0, 320]
    q_lens = [1] * len(lens)
    if form == "two_tokens_bound_one":
        lens[0] = 2
        q_lens = [2 if n else 0 for n in lens]
    host = make_mla(rng, q_lens, lens, heads=128, block_size=64)
    kw, k_scale = {}, 0.0371
    if cache != "bf16":
        host["kv_cache"] = to_fp8(host["kv_cache"], cache, k_scale)
        ref = reference.mla_attention(
            host["q"], host["kv_cache"], host["block_tables"], host["seq_lens"],
            None if form == "decode" else host["query_start_loc"], scale=SCALE,
            kv_cache_dtype=cache, k_scale=k_scale)
        kw = {"kv_cache_dtype": cache, "k_scale": k_scale}
    else:
        ref = ref_of(host, decode=form == "decode")
    if form == "decode":
        dev = device({k: v for k, v in host.items() if k != "query_start_loc"})
    else:
        dev = device(host)
        kw["max_query_len"] = 1
    got = cupaged.mla_attention(**dev, scale=SCALE, out=poisoned_out(dev, cupy), **kw)
    assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                 f"split={split} {form} {cache}")


@pytest.mark.parametrize("layout", ["rows_padded", "base_off"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_caches_tensor_copies_refuse_take_the_copying_warpgroup(rng, family, mla_split,
                                                               layout, block_size):
    """A 16-bit cache whose token rows are not 128-byte multiples apart (a padded row of
    584 values, 1,168 bytes) or whose base sits 16 bytes past one gets no tensor maps, so
    the wgmma kernel's copying warpgroup copies every tile by cp.async, whole tiles
    included (pages of 16 and 64; the padding and the slots no sequence holds are NaN);
    tile boundaries, a split and two row tiles a CTA, out poisoned."""
    import cupy

    mla_split(2)
    lens = [1, 64, 65, 128, 193, 320]
    host = make_mla(rng, [1, 2, 1, 1, 2, 1], lens, heads=128, block_size=block_size)
    ref = ref_of(host)
    dev = device(host)
    cache = dev["kv_cache"]
    nb = cache.shape[0]
    if layout == "rows_padded":
        wide = cupy.full((nb, block_size, RANK + ROPE + 8), np.nan, cache.dtype)
        wide[..., :RANK + ROPE] = cache
        view = wide[..., :RANK + ROPE]
    else:
        flat = cupy.full(cache.size + 8, np.nan, cache.dtype)
        view = flat[8:].reshape(cache.shape)
        view[...] = cache
    dev["kv_cache"] = view
    got = cupaged.mla_attention(**dev, scale=SCALE, out=poisoned_out(dev, cupy),
                                max_query_len=1)
    assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                 f"{layout} bs={block_size}")


def test_empty_batch_and_empty_sequences(rng):
    import cupy

    host = make_mla(rng, [0, 0], [0, 5], heads=16)
    got = cupaged.mla_attention(**device(host), scale=SCALE)
    assert got.shape == (0, 16, RANK)
    dev = device(make_mla(rng, [1], [3], heads=16))
    empty = {"q": dev["q"][:0], "kv_cache": dev["kv_cache"],
             "block_tables": dev["block_tables"][:0], "seq_lens": dev["seq_lens"][:0]}
    got, lse = cupaged.mla_attention(**empty, scale=SCALE, return_lse=True)
    assert got.shape == (0, 16, RANK) and lse.shape == (0, 16)
    assert isinstance(got, cupy.ndarray)


def to_fp8(cache, fmt, scale):
    """A latent cache as fp8 bytes holding cache / scale (NaN and Inf slots stay non-finite)."""
    import ml_dtypes

    t = ml_dtypes.float8_e5m2 if fmt == "fp8_e5m2" else ml_dtypes.float8_e4m3fn
    return (cache.astype(np.float32) / scale).astype(t).view(np.uint8)


@pytest.mark.parametrize("split", [0, 2], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("cache_form", ["combined", "pair"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_latent_cache(rng, family, mla_split, fmt, cache_form, split):
    """fp8 bytes read as stored * k_scale (a number, or a float32 device scalar), stale NaN
    slots included, against the reference's dequantization of the same bytes; both
    families (the wgmma one widens raw stages into its 16-bit stage)."""
    import cupy

    mla_split(split)
    scale = 0.0371
    host = make_mla(rng, *MIXED, heads=16, block_size=16, dtype="bf16")
    q8 = to_fp8(host["kv_cache"], fmt, scale)
    ref = reference.mla_attention(host["q"], q8, host["block_tables"], host["seq_lens"],
                                  host["query_start_loc"], scale=SCALE, kv_cache_dtype=fmt,
                                  k_scale=scale)
    dev = device({**host, "kv_cache": q8})
    cache, pe = dev["kv_cache"], None
    if cache_form == "pair":
        cache, pe = cupy.ascontiguousarray(cache[..., :RANK]), cupy.ascontiguousarray(cache[..., RANK:])
    for k_scale in (scale, cupy.asarray([scale], np.float32)):
        got = cupaged.mla_attention(dev["q"], cache, dev["block_tables"], dev["seq_lens"],
                                    dev["query_start_loc"], scale=SCALE, k_pe_cache=pe,
                                    kv_cache_dtype=fmt, k_scale=k_scale)
        assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                     f"{fmt} {cache_form} split={split} k_scale={type(k_scale).__name__}")


@pytest.mark.parametrize("block_size", [1, 8])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_small_pages_and_rows_far_apart(rng, family, fmt, block_size):
    """fp8 caches in pages under 16 tokens (where every thread of the wgmma kernel copies
    and widens its own chunks), 128 heads of two query tokens under max_query_len=1 (a CTA
    walks several row tiles), and query rows 2^80 apart within each row tile: the even
    heads scaled by 2^40 (a k_scale of 2^-40 times the bytes' brings their scores back to
    ordinary sizes), some odd heads by 2^-40, one row of zeros; out and lse against the
    float64 reference."""
    import cupy

    k_scale = 0.0371 * 2.0 ** -40
    host = make_mla(rng, [2, 2, 1], [70, 129, 5], heads=128, block_size=block_size)
    q = host["q"].astype(np.float64)
    q[:, ::2] *= 2.0 ** 40
    q[1, 1::4] *= 2.0 ** -40
    q[3, 6] = 0.0
    host["q"] = q.astype(host["q"].dtype)
    host["kv_cache"] = to_fp8(host["kv_cache"], fmt, 0.0371)  # bytes of ordinary size
    ref, ref_lse = reference.mla_attention(
        host["q"], host["kv_cache"], host["block_tables"], host["seq_lens"],
        host["query_start_loc"], scale=SCALE, kv_cache_dtype=fmt, k_scale=k_scale,
        return_lse=True)
    dev = device(host)
    got, lse = cupaged.mla_attention(**dev, scale=SCALE, kv_cache_dtype=fmt, k_scale=k_scale,
                                     max_query_len=1, out=poisoned_out(dev, cupy),
                                     return_lse=True)
    assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                 f"{fmt} pages of {block_size}")
    np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=0, atol=2e-3)


# The shapes smaller GPUs get (sm_80: 163 KiB, sm_86/89: 99 KiB), which an H100's planner
# never picks: 16-token tiles (one softmax column a thread, the k-steps over 8 warps).
OTHER_SHAPES = [(16, 16, 2), (16, 16, 3), (32, 16, 2), (64, 16, 2), (64, 16, 4), (16, 32, 3),
                (32, 32, 2), (64, 32, 2)]


@pytest.mark.parametrize("shape", OTHER_SHAPES, ids=lambda t: "r{}t{}x{}".format(*t))
def test_every_tile_shape(rng, mla_tile, mla_split, shape):
    """f16 over blocks of 1 with a split, lse, and an undercounted max_query_len (a CTA then
    walks several row tiles, each split over grid z)."""
    import cupy

    mla_tile(shape)
    mla_split(3)
    host = make_mla(rng, [1, 7, 0, 12], [40, 300, 0, 130], heads=20, block_size=1,
                    dtype="f16")
    got, lse = cupaged.mla_attention(**device(host), scale=SCALE, return_lse=True,
                                     max_query_len=2)
    ref, ref_lse = ref_of(host, return_lse=True)
    assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["f16"],
                 f"shape {shape}")
    np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=0, atol=2e-3)


def test_a_bad_block_spares_the_rows_of_other_tiles(rng, family, mla_split):
    """A bad block seen only by later tokens of a long verify: the rows that see it are
    NaN, those in row tiles before any of them stay right (a tile holds at most 64 rows:
    4 tokens of 16 heads; tokens 12 and 13 share one with token 14, the first to see it)."""
    import cupy

    for split in (0, 2):
        mla_split(split)
        host = make_mla(rng, [40], [202], heads=16, block_size=16)
        host["block_tables"][0, 11] = 10**6  # keys 176-191; token i is at position 162 + i
        got = cupy.asnumpy(cupaged.mla_attention(**device(host), scale=SCALE))
        assert np.isnan(got[14:]).all()
        early = {**host, "q": host["q"][:12], "seq_lens": np.array([174], np.int32),
                 "query_start_loc": np.array([0, 12], np.int32)}
        assert_close(got[:12].astype(np.float64), ref_of(early), testing.TOLERANCE["bf16"],
                     f"split={split}")


def test_lengths_past_the_table_and_negative_are_clamped(rng, family):
    """seq_lens beyond the table's width read the table's blocks only; negative lengths
    count as empty (zeros). The long sequence is the table's last row and the table ends a
    mapping (testing.guarded), so a read past it faults."""
    import cupy

    host = make_mla(rng, [1, 1, 1], [40, 5, 64], heads=16, block_size=16)
    assert host["block_tables"].shape[1] == 4  # 64 tokens a row
    keep = [0, 2]
    ref = ref_of({**host, "q": host["q"][keep], "block_tables": host["block_tables"][keep],
                  "seq_lens": host["seq_lens"][keep],
                  "query_start_loc": np.array([0, 1, 2], np.int32)})
    host["seq_lens"] = np.array([40, -7, 64 + 1000], np.int32)
    dev = device(host)
    dev["block_tables"] = testing.guarded(host["block_tables"], "after")
    got = cupy.asnumpy(cupaged.mla_attention(**dev, scale=SCALE)).astype(np.float64)
    assert_close(got[keep], ref, testing.TOLERANCE["bf16"])
    assert (got[1] == 0).all()


def test_workspace_makes_a_split_call_capturable(rng, mla_split):
    """With a DecodeWorkspace(head_size=512), out and lse given, a split call allocates
    nothing: capture it in a CUDA graph, change the query, replay. A workspace too small
    for the split gives fewer partitions, the same result."""
    import cupy

    mla_split(2)
    host = make_mla(rng, [1, 3, 2], [700, 260, 1500], heads=16, block_size=64)
    dev = device(host)
    out = poisoned_out(dev, cupy)
    lse = cupy.full(out.shape[:2], np.nan, np.float32)
    ws = cupaged.DecodeWorkspace(6, 16, 512)
    kw = dict(scale=SCALE, out=out, lse=lse, workspace=ws, max_query_len=3, max_seq_len=1500)
    stream = cupy.cuda.Stream(non_blocking=True)
    allocs = []

    class Allocations(cupy.cuda.memory_hook.MemoryHook):
        name = "allocations"

        def malloc_preprocess(self, **kw):
            allocs.append(kw)

    with stream:
        cupaged.mla_attention(**dev, **kw)  # compiled and planned outside the capture
        stream.synchronize()
        # (CuPy's relaxed capture lets the pool allocate: the hook sees any allocation)
        with Allocations():
            stream.begin_capture()
            cupaged.mla_attention(**dev, **kw)
            graph = stream.end_capture()
    assert allocs == []
    host["q"] = testing.random_normal(host["q"].shape, host["q"].dtype, rng)
    dev["q"][...] = cupy.asarray(host["q"])
    out.fill(np.nan)
    cupy.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    ref, ref_lse = ref_of(host, return_lse=True)
    assert_close(cupy.asnumpy(out).astype(np.float64), ref, testing.TOLERANCE["bf16"])
    np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=0, atol=2e-3)
    rows = out.shape[0] * out.shape[1]
    for capacity in (2 * rows, 2 * rows - 1):  # two partitions; too few for two: one pass
        small = cupaged.DecodeWorkspace(1, 1, 512, rows=capacity)
        got = cupaged.mla_attention(**dev, scale=SCALE, workspace=small)
        assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                     f"workspace of {capacity} rows")
