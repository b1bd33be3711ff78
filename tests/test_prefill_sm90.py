"""paged_prefill_sm90, Hopper's wgmma kernel, against the float64 reference: forced for
every call it can serve (``planning.set_prefill_family("sm90")``) over head sizes, groups,
block sizes, layouts, variants, split-KV, stale and bad cache entries and query tiles
that one CTA walks in turn. Skipped unless the GPU is a Hopper (compute capability 9.0)."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import planning, reference, testing

from conftest import assert_close
from test_fp8 import fp8_problem
from test_variants import VARIANT_CASES, _check_lse, _poison_before_windows, _problem, _run, \
    _variant_kwargs
from test_varlen import make_varlen, run

pytestmark = pytest.mark.gpu


@pytest.fixture
def sm90(prefill_split, monkeypatch):
    """Hopper's kernel for every call it can serve; the test fails if it served none (a
    call it cannot take falls back to the mma.sync kernel silently)."""
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU (compute capability 9.0)")
    served = []
    real = planning.prefill_sm90_kernel
    monkeypatch.setattr(planning, "prefill_sm90_kernel",
                        lambda *a, **k: served.append(a) or real(*a, **k))
    planning.set_prefill_family("sm90")
    yield prefill_split
    planning.set_prefill_family(None)
    assert served, "paged_prefill_sm90 served none of the test's calls"


def first_sequence(host):
    """A varlen host problem cut to its first sequence (its rows, table row and length)."""
    rows = int(host["query_start_loc"][1])
    return {**host, "seq_lens": host["seq_lens"][:1], "block_tables": host["block_tables"][:1],
            "query_start_loc": host["query_start_loc"][:2], "query": host["query"][:rows]}


# (dtype, head_size, block_size, heads, kv_heads)
CASES = [
    ("f16", 64, 16, 8, 8),
    ("bf16", 128, 16, 32, 8),
    ("f16", 192, 32, 8, 2),
    ("bf16", 256, 8, 4, 1),
    ("f16", 128, 1, 4, 4),
    ("bf16", 64, 256, 6, 2),   # group of 3: 128-row tiles end mid-token
    ("f16", 128, 64, 12, 3),
    ("bf16", 256, 128, 2, 2),
    # over 256 dims: both consumers on the same 64 rows, half the dims each
    ("bf16", 512, 16, 8, 2),
    ("f16", 384, 32, 4, 4),
    ("f16", 512, 1, 6, 2),     # group of 3: 64-row tiles end mid-token
    ("bf16", 384, 16, 12, 4),  # group of 3; O's halves start at dim 192
]
# Empty sequences, single tokens, verify, chunks of long contexts, whole prompts whose
# packed rows end mid-tile, a context of exactly one tile.
Q_LENS = [0, 1, 4, 300, 0, 129, 64, 33, 128]
SEQ_EXTRA = [0, 0, 2000, 0, 5, 1000, 64, 4096 + 7, 0]


# vLLM's layout takes this kernel in blocks of 8 tokens or more, head sizes to 256
# (others stay on mma.sync, which the fixture would report as a test the kernel never
# served).
LAYOUT_CASES = [pytest.param(c, layout, id="{}_hs{}_bs{}_{}x{}-".format(*c) + layout)
                for c in CASES for layout in ("NHD", "HND", "vllm")
                if layout != "vllm" or (c[2] >= 8 and c[1] <= 256)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case, layout", LAYOUT_CASES)
def test_matches_reference(rng, sm90, case, layout, causal):
    dtype, hs, bs, heads, kv_heads = case
    seq = [q + e for q, e in zip(Q_LENS, SEQ_EXTRA)]
    host = make_varlen(rng, Q_LENS, seq, layout=layout, dtype=dtype, heads=heads,
                       kv_heads=kv_heads, head_size=hs, block_size=bs, share=True)
    got, ref = run(host, kv_layout=layout, causal=causal, max_query_len=max(Q_LENS))
    assert_close(got, ref, testing.TOLERANCE[dtype], f"{case} {layout} causal={causal}")


@pytest.mark.parametrize("hs", [128, 384, 512], ids=lambda h: f"hs{h}")
@pytest.mark.parametrize("split", [0, 128, 384], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_variants_and_split_kv(rng, sm90, case, split, hs):
    sm90(split)
    heads, kvh, bs = 8, 2, 16
    dtype = "bf16" if case == "all" else "f16"
    q_lens = [0, 1, 5, 200, 17, 70]
    seq = [3, 1, 5, 900, 150, 1500]
    kw, alibi = _variant_kwargs(rng, case, heads)
    host = _problem(rng, q_lens, seq, dtype=dtype, heads=heads, kv_heads=kvh, head_size=hs,
                    block_size=bs, alibi=alibi)
    w = kw.get("window", kw.get("window_left", -2) + 1)
    if w > 0:
        host["kernel_tables"] = _poison_before_windows(host, w, q_lens)
    got, lse, ref, ref_lse = _run(host, kw, "NHD", max_query_len=max(q_lens))
    assert_close(got, ref, testing.TOLERANCE[dtype], f"{case} split={split}")
    _check_lse(lse, ref_lse, f"{case} split={split}")


@pytest.mark.parametrize("kv, hs", [("auto", 128), ("fp8_e4m3", 128), ("auto", 512)])
def test_huge_logits_keep_an_exact_softmax(rng, sm90, kv, hs):
    """Heads whose logits reach about 2^32 (a query 2^8 of unit size under a scale 2^24
    times the usual) beside heads of unit logits (a query 2^-24 of unit size): the
    softmax's folded FFMA against the rounded maximum would err by up to half an ulp of
    the maximum there (inf and NaN); those warps round their scores first. Outputs and
    lse against the reference, causal and not, single pass and split."""
    import cupy
    from test_fp8 import fp8_problem
    from test_variants import _device

    heads, kv_heads = 6, 2
    q_lens, seq = [1, 37, 200, 130], [1, 300, 2500, 131]
    if kv == "auto":
        host = make_varlen(rng, q_lens, seq, dtype="bf16", heads=heads, kv_heads=kv_heads,
                           head_size=hs)
        scales = {}
    else:
        host, scales = fp8_problem(rng, kv, "tensor", q_lens, seq, dtype="bf16", heads=heads,
                                   kv_heads=kv_heads, head_size=hs)
    big = np.arange(heads) % (heads // kv_heads) == 0
    factor = np.where(big, 2.0**8, 2.0**-24) * 2.0 ** rng.uniform(-3.0, 3.0, heads)
    q = host["query"].astype(np.float32) * factor.astype(np.float32)[:, None]
    host["query"] = q.astype(host["query"].dtype)
    dev = _device(host)
    kw = dict(kv_cache_dtype=kv, scale=2.0**24 / np.sqrt(hs), **scales)
    for causal in (True, False):
        ref, ref_lse = reference.attention(**host, causal=causal, return_lse=True, **kw)
        for split in (0, 192):
            what = f"{kv} causal={causal} split {split}"
            sm90(split)
            got, lse = cupaged.attention(**dev, causal=causal, max_query_len=max(q_lens),
                                         return_lse=True, **kw)
            assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                         what)
            _check_lse(cupy.asnumpy(lse), ref_lse, what)


@pytest.mark.parametrize("layout, hs", [("NHD", 128), ("vllm", 128), ("NHD", 512)])
@pytest.mark.parametrize("stale", [float("inf"), float("-inf"), float("nan")])
def test_stale_slots_never_reach_the_output(rng, sm90, stale, layout, hs):
    """Slots past each sequence hold stale values; in vLLM's layout the last 8-token run of
    V is copied through registers with them zeroed."""
    host = make_varlen(rng, [200, 3, 130], [200 + 9, 77, 130], heads=8, kv_heads=2,
                       head_size=hs, block_size=32, stale=stale, layout=layout)
    for causal in (True, False):
        got, ref = run(host, causal=causal, kv_layout=layout)
        assert_close(got, ref, testing.TOLERANCE["f16"], f"stale {stale} causal={causal}")


@pytest.mark.parametrize("hs", [128, 384, 512], ids=lambda h: f"hs{h}")
@pytest.mark.parametrize("split", [0, 128])
def test_a_bad_block_id_gives_nan_for_its_sequence_only(rng, sm90, split, hs):
    import cupy

    sm90(split)
    host = make_varlen(rng, [150, 140], [400, 600], dtype="bf16", heads=8, kv_heads=2,
                       head_size=hs)
    host["block_tables"][1, 3] = 10**6
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    got = cupy.asnumpy(cupaged.attention(**dev)).astype(np.float64)
    ref = reference.attention(**first_sequence(host))
    assert_close(got[:150], ref, testing.TOLERANCE["bf16"])
    assert np.isnan(got[150:]).all()


@pytest.mark.parametrize("hs", [64, 384, 512], ids=lambda h: f"hs{h}")
@pytest.mark.parametrize("max_query_len", [1, 40, None])
def test_query_tiles_one_cta_walks_in_turn(rng, sm90, max_query_len, hs):
    """A host bound that undercounts the longest query gives fewer ranks, each job walking
    several query tiles (the mbarrier phases run on across them; over 256 dims the
    partial scores' slots too)."""
    host = make_varlen(rng, [1000, 7, 300], [1000, 2000, 310], heads=8, kv_heads=2,
                       head_size=hs, block_size=16)
    for causal in (True, False):
        got, ref = run(host, causal=causal, max_query_len=max_query_len)
        assert_close(got, ref, testing.TOLERANCE["f16"], f"bound {max_query_len}")


@pytest.mark.parametrize("split", [0, 32])
def test_query_tiles_of_one_key_tile_each_over_256_dims(rng, sm90, split):
    """Over 256 dims the consumers exchange partial scores in two slots by the parity of
    the CTA's tile count: 60 prompts of 1-16 tokens (one 32-key tile each; split 32:
    partitions of one tile, most of them empty) walked back to back by the persistent
    CTAs, then longer ones, so a query tile of one key tile follows another on the same
    CTA."""
    sm90(split)
    q_lens = [int(q) for q in rng.integers(1, 17, 60)] + [70, 1, 33]
    seq = q_lens[:60] + [300, 40, 33]
    host = make_varlen(rng, q_lens, seq, dtype="bf16", heads=16, kv_heads=4, head_size=512,
                       block_size=16)
    for causal in (True, False):
        got, ref = run(host, causal=causal, max_query_len=max(q_lens))
        assert_close(got, ref, testing.TOLERANCE["bf16"], f"causal={causal} split {split}")


def test_persistent_ctas_walk_more_jobs_than_the_device_holds(rng, sm90):
    """40 sequences x 8 KV heads x up to 5 query tiles (3 jobs of paired tiles): about
    950 jobs for about one CTA per SM, each CTA's producer running into its next job while
    its consumers finish."""
    q_lens = list(rng.integers(1, 300, 40))
    seq = [int(q) + int(e) for q, e in zip(q_lens, rng.integers(0, 500, 40))]
    host = make_varlen(rng, q_lens, seq, heads=16, kv_heads=8, head_size=64, block_size=16)
    for causal in (True, False):
        got, ref = run(host, causal=causal, max_query_len=max(q_lens))
        assert_close(got, ref, testing.TOLERANCE["f16"], f"causal={causal}")


def test_odd_strides_and_long_context(rng, sm90):
    """A query view with padded token and head strides, over a 70k-token context."""
    import cupy

    host = make_varlen(rng, [256], [70_000], dtype="bf16", heads=4, kv_heads=1,
                       head_size=128, block_size=64)
    q = host["query"]
    wide = np.zeros((q.shape[0], q.shape[1] + 1, q.shape[2] + 64), q.dtype)
    wide[:, :4, :128] = q
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None and k != "query"}
    view = cupy.asarray(wide)[:, :4, :128]
    got = cupy.asnumpy(cupaged.attention(view, **dev)).astype(np.float64)
    assert_close(got, reference.attention(**host), testing.TOLERANCE["bf16"], "strided")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype, hs, heads, kv_heads", [("f16", 64, 8, 2), ("bf16", 128, 8, 8),
                                                        ("bf16", 192, 6, 2), ("f16", 128, 16, 2),
                                                        ("bf16", 128, 8, 1)])
@pytest.mark.parametrize("mode", ["device", "host"])
def test_fp8_caches_with_per_tensor_scales(rng, sm90, fmt, dtype, hs, heads, kv_heads, mode):
    """The producer widens fp8 tiles (NaN bytes in unused slots, some values saturated)
    while the next tile's bytes fly; scales as device scalars or host floats; split-KV
    too. NHD over one KV head has its page's tokens next to each other: bulk copies."""
    from test_fp8 import fp8_problem, run as run_fp8

    q_lens, seq = [0, 1, 37, 200, 16, 130], [9, 1, 300, 2500, 16, 131]
    host, scales = fp8_problem(rng, fmt, "tensor", q_lens, seq, dtype=dtype, heads=heads,
                               kv_heads=kv_heads, head_size=hs)
    for split in (0, 192):
        sm90(split)
        for causal in (True, False):
            got, ref = run_fp8(host, scales, mode, fmt, causal=causal,
                               max_query_len=max(q_lens))
            assert_close(got, ref, testing.TOLERANCE[dtype], f"split {split} causal={causal}")


# The ways the producer brings an fp8 tile's bytes in, by the cache's view (the kernel
# picks per launch from the token strides): bulk copies of a page's contiguous tokens
# ("HND": dense; "HND-fused": the halves of one [blocks, 2, kv_heads, block, head]
# allocation, block strides twice the dense ones) where pages hold 8 tokens or more, and
# per-thread cp.async of strided token rows ("NHD"; "HND-padded": rows 32 bytes apart past
# the head size) and of smaller pages.
FP8_VIEWS = ("NHD", "HND", "HND-fused", "HND-padded")


def fp8_device_caches(host, view):
    """Device key and value caches holding ``host``'s NHD fp8 caches in ``view``, and the
    kv_layout to pass with them. Stale bytes (NaN) fill the padding too."""
    import cupy

    from test_fp8 import NAN_BYTE

    kq, vq = host["key_cache"], host["value_cache"]
    if view == "NHD":
        return cupy.asarray(kq), cupy.asarray(vq), "NHD"
    k, v = testing.convert_layout(kq, vq, "NHD", "HND")
    if view == "HND":
        return cupy.asarray(k), cupy.asarray(v), "HND"
    if view == "HND-fused":
        fused = cupy.asarray(np.stack([k, v], axis=1))
        return fused[:, 0], fused[:, 1], "HND"
    assert view == "HND-padded", view
    hs = k.shape[-1]
    padded = np.full((2, *k.shape[:-1], hs + 32), NAN_BYTE, np.uint8)
    padded[0, ..., :hs], padded[1, ..., :hs] = k, v
    dev = cupy.asarray(padded)
    return dev[0, ..., :hs], dev[1, ..., :hs], "HND"


def run_fp8_view(host, scales, fmt, view, **kw):
    """cupaged.attention over ``host``'s fp8 caches in ``view`` (host scales), into an
    output poisoned with NaN, and the reference."""
    import cupy

    kc, vc, layout = fp8_device_caches(host, view)
    dev = {k: cupy.asarray(v) for k, v in host.items()
           if v is not None and k not in ("key_cache", "value_cache")}
    out = cupy.full(host["query"].shape, np.nan, dtype=host["query"].dtype)
    got = cupaged.attention(key_cache=kc, value_cache=vc, out=out, kv_layout=layout,
                            kv_cache_dtype=fmt, **scales, **dev, **kw)
    ref = reference.attention(**host, kv_cache_dtype=fmt, **scales,
                              **{k: v for k, v in kw.items() if k in ("causal", "window")})
    return cupy.asnumpy(got).astype(np.float64), ref


def fp8_lengths(bs):
    """Sequences of 0 and 1 tokens, a page less one, a page, a page and one, tiles that end
    mid-page or mid-tile, and a long one; query lengths up to two query tiles."""
    seq = [0, 1, max(bs - 1, 1), bs, bs + 1, 2 * bs + 37, 63, 65, 3000 + 7]
    q = [0, 1, 9, 64, 65, 130, 63, 1, 200]
    return [min(a, b) for a, b in zip(q, seq)], seq


@pytest.mark.parametrize("view", FP8_VIEWS)
@pytest.mark.parametrize("bs", [1, 8, 16, 64, 256], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("fmt, dtype, hs", [("fp8_e4m3", "bf16", 128), ("fp8_e5m2", "f16", 64),
                                            ("fp8_e4m3", "f16", 192)],
                         ids=lambda x: str(x))
def test_fp8_tiles_by_bulk_copies_and_by_cp_async(rng, sm90, fmt, dtype, hs, bs, view):
    """Every way an fp8 tile arrives (FP8_VIEWS) over pages of 1 to 256 tokens (tiles
    inside a page, pages inside a tile), sequences of 0, 1, a page +-1, tile ends mid-page
    and a few thousand tokens, stale NaN in every unused slot (and the padding), causal and
    not, single pass and split-KV, outputs poisoned before the launch."""
    q_lens, seq = fp8_lengths(bs)
    host, scales = fp8_problem(rng, fmt, "host", q_lens, seq, dtype=dtype, heads=8,
                               kv_heads=2, head_size=hs, block_size=bs)
    for split in (0, 192):
        sm90(split)
        for causal in (True, False):
            got, ref = run_fp8_view(host, scales, fmt, view, causal=causal,
                                    max_query_len=max(q_lens))
            assert_close(got, ref, testing.TOLERANCE[dtype],
                         f"{view} bs{bs} split {split} causal={causal}")


@pytest.mark.parametrize("view", ["NHD", "HND", "HND-padded"])
@pytest.mark.parametrize("stale", ["nan", "inf"])
def test_fp8_stale_slots_never_reach_the_output(rng, sm90, stale, view):
    """e5m2 caches whose every unused slot holds NaN, or +inf in K and -inf in V (0 * inf
    is NaN as 0 * NaN is), under a window that starts mid-page and without one: tokens
    past the keys and before the window are never read and their V rows read 0."""
    from test_fp8 import NAN_BYTE

    q_lens, seq = [200, 3, 130, 1], [200 + 9, 77, 130, 40]
    host, scales = fp8_problem(rng, "fp8_e5m2", "host", q_lens, seq, dtype="f16", heads=8,
                               kv_heads=2, head_size=128, block_size=32,
                               stale=NAN_BYTE if stale == "nan" else 0x7C)
    for window in (None, 45):
        for split in (0, 64):
            sm90(split)
            for causal in (True, False):
                kw = dict(causal=causal, max_query_len=max(q_lens))
                if window is not None:
                    kw["window"] = window
                got, ref = run_fp8_view(host, scales, "fp8_e5m2", view, **kw)
                assert_close(got, ref, testing.TOLERANCE["f16"],
                             f"{stale} {view} window {window} split {split} causal={causal}")


@pytest.fixture
def few_ctas(sm90, monkeypatch):
    """paged_prefill_sm90 launched on two CTAs (one a split-KV partition when split), so
    each walks many jobs in turn: its producer's barrier phases run on across them."""
    real = planning.prefill_sm90_kernel
    monkeypatch.setattr(planning, "prefill_sm90_kernel",
                        lambda *a, **k: real(*a, **k)._replace(slots=2))
    yield sm90


@pytest.mark.parametrize("view", FP8_VIEWS)
@pytest.mark.parametrize("bs", [8, 16, 128], ids=lambda b: f"bs{b}")
def test_fp8_persistent_ctas_walk_many_jobs(rng, few_ctas, view, bs):
    """Twelve sequences x 2 KV heads of odd tile counts on two CTAs: the raw stages'
    barriers alternate over spans of odd and even tile counts, jobs and query tiles."""
    q_lens = [1, 7, 64, 129, 33, 0, 250, 2, 65, 16, 100, 3]
    seq = [1, 70, 64 + 64, 129 + 5, 33 + 300, 19, 250 + 777, 2 + 63, 65 + 1, 16, 100, 3 + 1000]
    host, scales = fp8_problem(rng, "fp8_e4m3", "host", q_lens, seq, dtype="bf16", heads=8,
                               kv_heads=2, head_size=128, block_size=bs)
    for split in (0, 128):
        few_ctas(split)
        for causal in (True, False):
            got, ref = run_fp8_view(host, scales, "fp8_e4m3", view, causal=causal,
                                    max_query_len=max(q_lens))
            assert_close(got, ref, testing.TOLERANCE["bf16"],
                         f"{view} bs{bs} split {split} causal={causal}")


@pytest.fixture
def sm90_tile(sm90):
    yield planning.set_sm90_tile
    planning.set_sm90_tile(None)


@pytest.mark.parametrize("tile", [(64, 2), (64, 3), (64, 4), (128, 2), (128, 3)],
                         ids=lambda t: "n{}x{}".format(*t))
@pytest.mark.parametrize("case", [("bf16", 128, ""), ("f16", 64, ""), ("f16", 64, "fp8_e4m3"),
                                  ("f16", 64, "fp8_e4m3", "HND")],
                         ids=lambda c: "_".join(str(x) for x in c if x))
def test_every_tile_shape(rng, sm90_tile, case, tile):
    """The tiles `cupaged-bench prefill --tile N,S` times (tools/device.sh rows
    prefill-tiles:sm90) beside the defaults, each the same attention; fp8 with 128-token
    tiles too, by cp.async (NHD) and by bulk copies (HND: eight page segments a
    128-token tile)."""
    from test_fp8 import fp8_problem, run as run_fp8

    dtype, hs, fmt = case[:3]
    layout = case[3] if len(case) > 3 else "NHD"
    sm90_tile(tile)
    q_lens, seq = [200, 1, 0, 64, 17, 130], [300, 900, 40, 64 + 1000, 17 + 129, 130]
    for causal in (True, False):
        if fmt:
            host, scales = fp8_problem(rng, fmt, "tensor", q_lens, seq, dtype=dtype, heads=8,
                                       kv_heads=2, head_size=hs, layout=layout)
            got, ref = run_fp8(host, scales, "device", fmt, causal=causal,
                               max_query_len=max(q_lens), kv_layout=layout)
        else:
            host = make_varlen(rng, q_lens, seq, dtype=dtype, heads=8, kv_heads=2,
                               head_size=hs, block_size=16)
            got, ref = run(host, causal=causal, max_query_len=max(q_lens))
        assert_close(got, ref, testing.TOLERANCE[dtype], f"{tile} {case} causal={causal}")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("case", ["all", "cap_wide", "window"])
def test_fp8_with_the_variants(rng, sm90, case, layout):
    """The widened fp8 tiles under every variant (window, soft-cap, sinks, ALiBi together;
    a soft-cap whose logits reach past the cap; a window), lse included; HND's tiles come
    by bulk copies, a window's first page segment from its first key."""
    from test_fp8 import fp8_problem
    from test_variants import _device

    import cupy

    heads = 8
    q_lens, seq = [0, 1, 5, 200, 17, 70], [3, 1, 5, 900, 150, 1500]
    host, scales = fp8_problem(rng, "fp8_e4m3", "tensor", q_lens, seq, dtype="bf16",
                               heads=heads, kv_heads=2, head_size=128, layout=layout)
    kw, alibi = _variant_kwargs(rng, case, heads)
    if alibi:
        host["alibi_slopes"] = rng.uniform(0.0, 0.5, heads).astype(np.float32)
    dev = _device(host)
    dev_kw = dict(kw, sinks=cupy.asarray(kw["sinks"])) if kw.get("sinks") is not None else kw
    got, lse = cupaged.attention(**dev, kv_cache_dtype="fp8_e4m3", return_lse=True,
                                 max_query_len=max(q_lens), kv_layout=layout, **scales,
                                 **dev_kw)
    ref, ref_lse = reference.attention(**host, kv_cache_dtype="fp8_e4m3", return_lse=True,
                                       kv_layout=layout, **scales, **kw)
    assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"], case)
    _check_lse(cupy.asnumpy(lse), ref_lse, case)


@pytest.mark.parametrize("fmt, hs, case", [("fp8_e4m3", 128, ""), ("fp8_e5m2", 128, ""),
                                           ("fp8_e4m3", 64, ""), ("fp8_e5m2", 192, ""),
                                           ("fp8_e4m3", 128, "all"), ("fp8_e5m2", 64, "all")],
                         ids=lambda x: str(x) if x != "" else "plain")
def test_fp8_bfloat16_query_rows_keep_their_own_scale(rng, sm90, fmt, hs, case):
    """Over an fp8 cache the products run in float16, a bfloat16 query converted with a
    power-of-two scale a row. Most heads' queries are 2^-24 of unit size, the call's scale
    2^24 times the usual one so that their logits are of unit size: converted without a
    scale they flush to zero, and with one scale for a tile that also holds the heads at
    2^8 of unit size (their softmax one-hot) they become float16 subnormals of a few bits.
    Every head has its own factor 2^U(-3, 3) and the group is odd (6 heads over 2), so a
    thread's two C-fragment rows (r and r + 8) take different scales. One infinite element
    (left out of its row's scale) makes its row non-finite and leaves every other row as
    exact as a query of one magnitude. Outputs and lse, causal and not, split-KV, and a
    variant set."""
    from test_fp8 import fp8_problem
    from test_variants import TOL_LSE, _device

    import cupy

    heads, kv_heads = 6, 2
    group = heads // kv_heads
    q_lens, seq = [0, 1, 37, 200, 16, 130], [9, 1, 300, 2500, 16, 131]
    host, scales = fp8_problem(rng, fmt, "tensor", q_lens, seq, dtype="bf16", heads=heads,
                               kv_heads=kv_heads, head_size=hs)
    big = np.arange(heads) % group == group - 1  # one head of each KV head's group
    factor = np.where(big, 2.0**8, 2.0**-24) * 2.0 ** rng.uniform(-3.0, 3.0, heads)
    q = host["query"].astype(np.float32) * factor.astype(np.float32)[:, None]
    inf_token, inf_head = 1 + 37 + 50, 3  # the fourth sequence's 51st token, a small head
    assert not big[inf_head]
    q[inf_token, inf_head, hs // 3] = np.inf
    host["query"] = q.astype(host["query"].dtype)
    kw, alibi = _variant_kwargs(rng, case, heads) if case else ({}, False)
    kw["scale"] = 2.0**24 / np.sqrt(hs)
    if alibi:
        host["alibi_slopes"] = rng.uniform(0.0, 0.5, heads).astype(np.float32)
    dev = _device(host)
    dev_kw = dict(kw, sinks=cupy.asarray(kw["sinks"])) if kw.get("sinks") is not None else kw
    # A soft-cap turns the infinite row's +-inf logits into +-cap: that row may be finite.
    capped = kw.get("logits_soft_cap") is not None
    for causal in (True, False):
        with np.errstate(invalid="ignore", over="ignore"):
            ref, ref_lse = reference.attention(**host, kv_cache_dtype=fmt, causal=causal,
                                               return_lse=True, **scales, **kw)
        ref[inf_token, inf_head] = 0.0
        ref_lse[inf_token, inf_head] = 0.0
        for split in (0, 192):
            what = f"{fmt} hs{hs} {case} causal={causal} split {split}"
            sm90(split)
            got, lse = cupaged.attention(**dev, kv_cache_dtype=fmt, causal=causal,
                                         max_query_len=max(q_lens), return_lse=True,
                                         **scales, **dev_kw)
            got = cupy.asnumpy(got).astype(np.float64)
            lse = cupy.asnumpy(lse).astype(np.float64)
            if not capped:
                assert not np.isfinite(got[inf_token, inf_head]).all(), what
            got[inf_token, inf_head] = 0.0
            lse[inf_token, inf_head] = 0.0
            assert_close(got, ref, testing.TOLERANCE["bf16"], what)
            # The big heads' logits reach about 2^32 of unit size, and so does their lse,
            # which the kernel keeps in fp32 (and sums its scores in fp32): an absolute
            # tolerance alone cannot hold them, so a relative 1e-4 of |lse| stands beside
            # it. The small heads' lse (unit logits) keep about the absolute one: a
            # per-tile or missing scale moves it by percents.
            both_inf = np.isneginf(lse) & np.isneginf(ref_lse)
            err = np.where(both_inf, 0.0, np.abs(lse - ref_lse) - 1e-4 * np.abs(ref_lse))
            err = np.where(np.isnan(err), np.inf, err)
            worst = np.unravel_index(int(np.argmax(err)), err.shape)
            assert err[worst] <= TOL_LSE, (
                f"{what}: lse row {worst} got {lse[worst]} want {ref_lse[worst]}")


@pytest.mark.parametrize("split", [0, 128])
@pytest.mark.parametrize("view, bs", [("NHD", 16), ("HND", 16), ("HND", 64), ("HND", 256),
                                      ("HND-fused", 8), ("HND-padded", 16)],
                         ids=lambda x: str(x))
def test_fp8_bad_block_id_gives_nan_for_its_sequence_only(rng, sm90, view, bs, split):
    """A bad id in the second sequence: its rows NaN; the first's exact, although the
    producer widens whatever stale bytes stand where the bad block was not copied (with
    bulk copies: the whole page segment)."""
    import cupy

    sm90(split)
    host, scales = fp8_problem(rng, "fp8_e5m2", "tensor", [150, 140], [400, 600],
                               dtype="f16", heads=8, kv_heads=2, head_size=64, block_size=bs)
    host["block_tables"][1, 80 // bs] = 10**6
    kc, vc, layout = fp8_device_caches(host, view)
    dev = {k: cupy.asarray(v) for k, v in host.items()
           if v is not None and k not in ("key_cache", "value_cache")}
    # poisoned with a finite value: the NaN rows must be the kernel's
    out = cupy.full(host["query"].shape, 7.0, dtype=host["query"].dtype)
    got = cupy.asnumpy(cupaged.attention(key_cache=kc, value_cache=vc, out=out,
                                         kv_layout=layout, kv_cache_dtype="fp8_e5m2",
                                         **scales, **dev))
    ref = reference.attention(**first_sequence(host), kv_cache_dtype="fp8_e5m2", **scales)
    assert_close(got[:150].astype(np.float64), ref, testing.TOLERANCE["f16"])
    assert np.isnan(got[150:]).all()


def test_in_place_over_the_query(rng, sm90):
    import cupy

    host = make_varlen(rng, [300, 2], [500, 2], dtype="bf16", heads=8, kv_heads=2,
                       head_size=128)
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    ref = reference.attention(**host)
    out = cupaged.attention(**dev, out=dev["query"])
    assert out is dev["query"]
    assert_close(cupy.asnumpy(out).astype(np.float64), ref, testing.TOLERANCE["bf16"])


@pytest.mark.parametrize("split", [0, 128])
@pytest.mark.parametrize("window", [21, 200])
def test_vllm_layout_with_nan_before_windows(rng, sm90, window, split):
    """vLLM's layout under windows that start inside blocks and inside 8-token runs of V,
    over caches with NaN in every slot before the earliest row's window: the straddling
    runs go through registers with their outside tokens zeroed."""
    import cupy

    from test_variants import _device, _nan_before_windows, _problem

    sm90(split)
    seq = [22, 37, 300, 1000, 333]
    q_lens = [1, 5, 130, 200, 40]
    host = _problem(rng, q_lens, seq, layout="vllm", dtype="bf16", heads=8, kv_heads=2,
                    head_size=128, block_size=16)
    ref = reference.attention(host["query"], host["key_cache"], host["value_cache"],
                              host["block_tables"], host["seq_lens"], host["query_start_loc"],
                              kv_layout="vllm", window=window)
    kc, vc = _nan_before_windows(host, window, q_lens)
    dev = _device(dict(query=host["query"], key_cache=kc, value_cache=vc,
                       block_tables=host["block_tables"], seq_lens=host["seq_lens"],
                       query_start_loc=host["query_start_loc"]))
    out = cupy.full(host["query"].shape, np.nan, dtype=host["query"].dtype)
    got = cupaged.attention(**dev, out=out, kv_layout="vllm", window=window,
                            max_query_len=max(q_lens))
    assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                 f"window {window} split {split}")


def test_the_planner_takes_it_for_prompts_on_hopper(rng):
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU (compute capability 9.0)")
    from cupaged import validation

    host = make_varlen(rng, [300, 4], [300, 900], heads=8, kv_heads=2, head_size=128)
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    out = cupy.empty_like(dev["query"])
    p = validation.validate_varlen(dev["query"], dev["key_cache"], dev["value_cache"],
                                   dev["block_tables"], dev["seq_lens"], dev["query_start_loc"],
                                   None, out, "NHD")
    assert planning.choose_kernel(p, True, 300).sm90
    assert not planning.choose_kernel(p, True, 4).sm90  # 4 tokens x 4 heads: 16 rows


def test_a_launch_short_of_the_warpgroups_registers_is_refused(rng, sm90, monkeypatch):
    """setmaxnreg.inc waits forever for registers the launch did not allocate: jit.load
    checks the compiled count against what the warpgroups divide before any launch."""
    from cupaged import jit

    host = make_varlen(rng, [200], [300], dtype="f16", heads=4, kv_heads=4, head_size=64,
                       block_size=16)
    run(host, max_query_len=200)  # compiles and loads it
    jit.clear_memory_caches()
    monkeypatch.setitem(jit.LAUNCH_REGS, "paged_prefill_sm90", 256)
    try:
        with pytest.raises(RuntimeError, match="setmaxnreg would hang"):
            run(host, max_query_len=200)
    finally:
        jit.clear_memory_caches()


def fp8_query_check(got, host, scales, fmt, scale, what, **kw):
    """An 8-bit query's output against the float64 reference over the same bytes: each
    row within reference.fp8_query_error_bound (the weights rounded to ``fmt``, the 8-bit
    sums, the 16-bit output), and the whole array within twice the
    error of the reference's own rounding of the weights (p_fp8) plus 2^-8. (Rounded
    relative to a running maximum, as the kernel rounds them, a row's weights err
    independently of p_fp8's: a row with few large weights can be several times further
    off than p_fp8 is, within its bound.)"""
    ref = reference.attention(**host, kv_cache_dtype=fmt, scale=scale, **scales, **kw)
    emu = reference.attention(**host, kv_cache_dtype=fmt, scale=scale, **scales,
                              p_fp8=fmt, **kw)
    bound = reference.fp8_query_error_bound(**host, kv_cache_dtype=fmt, scale=scale,
                                            **scales, **kw)
    assert not np.isnan(got).any(), what
    assert np.isfinite(bound).all(), what
    err = np.linalg.norm(got - ref, axis=-1)
    bad = err > bound
    assert not bad.any(), (what, np.argwhere(bad)[:4].tolist(), float((err / bound).max()))
    whole = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert whole <= 2 * np.linalg.norm(emu - ref) / np.linalg.norm(ref) + 2.0 ** -8, (what, whole)


@pytest.mark.parametrize("view", ["NHD", "HND", "HND-padded"])
@pytest.mark.parametrize("bs", [1, 16, 64], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("fmt, dtype, hs", [("fp8_e4m3", "bf16", 128), ("fp8_e5m2", "f16", 64),
                                            ("fp8_e4m3", "f16", 64)], ids=lambda x: str(x))
def test_an_8bit_query_over_its_fp8_cache(rng, sm90, fmt, dtype, hs, bs, view):
    """An 8-bit query (the e4m3 / e5m2 bytes of a 16-bit one, its per-tensor scale in
    ``scale``) over an fp8 cache of its format in every way its tiles arrive (cp.async
    under 8 tokens a page, bulk copies over HND), sequences of 0, 1, a page +-1 and a few
    thousand tokens, stale NaN in every unused slot, causal and not, single pass and
    split-KV, the output poisoned before the launch: fp8_query_check's bounds."""
    import cupy

    q_lens, seq = fp8_lengths(bs)
    host, scales = fp8_problem(rng, fmt, "host", q_lens, seq, dtype=dtype, heads=8,
                               kv_heads=2, head_size=hs, block_size=bs)
    q = host["query"].astype(np.float32)
    q_scale = float(np.abs(q).max() / reference.fp8_max(fmt))
    q8 = reference.quantize_fp8(q, fmt, q_scale).view(np.uint8)
    host8 = {**host, "query": q8}
    scale = q_scale / np.sqrt(hs)
    kc, vc, layout = fp8_device_caches(host, view)
    dev = {k: cupy.asarray(v) for k, v in host8.items()
           if v is not None and k not in ("key_cache", "value_cache")}
    for split in (0, 192):
        sm90(split)
        for causal in (True, False):
            out = cupy.full(q.shape, np.nan, dtype=host["query"].dtype)
            cupaged.attention(key_cache=kc, value_cache=vc, out=out, kv_layout=layout,
                              kv_cache_dtype=fmt, scale=scale, causal=causal,
                              max_query_len=max(q_lens), **scales, **dev)
            fp8_query_check(cupy.asnumpy(out).astype(np.float64), host8, scales, fmt, scale,
                            f"{view} bs{bs} split {split} causal={causal}", causal=causal)


@pytest.mark.parametrize("variants", [dict(logits_soft_cap=20.0), dict(window=100),
                                      dict(sinks=True), dict(return_lse=True)],
                         ids=["cap", "window", "sinks", "lse"])
def test_an_8bit_query_with_the_variants(rng, sm90, variants):
    """Soft-cap (no fixed offset over 8-bit weights, even in bfloat16), a window, sinks
    and the lse, whose 2^8 weight factor the kernel's end removes: lse within 1e-3 of the
    reference's (in natural log)."""
    import cupy

    fmt, hs = "fp8_e4m3", 128
    q_lens, seq = [7, 200, 1], [300, 2000, 5]
    host, scales = fp8_problem(rng, fmt, "host", q_lens, seq, dtype="bf16", heads=8,
                               kv_heads=2, head_size=hs, block_size=16)
    q = host["query"].astype(np.float32)
    q8 = reference.quantize_fp8(q, fmt, 1.0).view(np.uint8)
    host8 = {**host, "query": q8}
    kw = dict(variants)
    if kw.pop("sinks", None):
        kw["sinks"] = rng.uniform(-1, 3, 8).astype(np.float32)
    dev = {k: cupy.asarray(v) for k, v in host8.items() if v is not None}
    out = cupy.full(q.shape, np.nan, dtype=host["query"].dtype)
    got = cupaged.attention(out=out, kv_cache_dtype=fmt, **scales, **dev,
                            **{k: (cupy.asarray(v) if k == "sinks" else v) for k, v in kw.items()})
    ref_kw = {k: v for k, v in kw.items() if k != "return_lse"}
    if kw.get("return_lse"):
        got, lse = got
        _, ref_lse = reference.attention(**host8, kv_cache_dtype=fmt, **scales,
                                         return_lse=True)
        np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=1e-3, atol=1e-3)
    fp8_query_check(cupy.asnumpy(got).astype(np.float64), host8, scales, fmt,
                    1 / np.sqrt(hs), str(variants), **ref_kw)


def test_an_8bit_query_over_a_long_context(rng, sm90):
    """32,773 keys (257 tiles): O sums every tile's P V in wgmma's 8-bit accumulator,
    whose additions keep fewer bits than fp32, so its error grows with the tiles, a
    drift fp8_query_error_bound leaves out: held to fp8_query_check's bounds, single pass
    and split-KV."""
    import cupy

    fmt, hs = "fp8_e4m3", 128
    host, scales = fp8_problem(rng, fmt, "host", [64, 1], [32773, 300], dtype="bf16",
                               heads=8, kv_heads=2, head_size=hs, block_size=16)
    q8 = reference.quantize_fp8(host["query"].astype(np.float32), fmt, 1.0).view(np.uint8)
    host8 = {**host, "query": q8}
    dev = {k: cupy.asarray(v) for k, v in host8.items() if v is not None}
    for split in (0, 4096):
        sm90(split)
        out = cupy.full(q8.shape, np.nan, dtype=host["query"].dtype)
        cupaged.attention(out=out, kv_cache_dtype=fmt, **scales, **dev)
        fp8_query_check(cupy.asnumpy(out).astype(np.float64), host8, scales, fmt,
                        1 / np.sqrt(hs), f"split {split}")
