"""cupaged.attention on the GPU against the float64 reference: varlen batches (prefill,
chunked prefill, verify, decode, mixed) over NHD, HND and vLLM's layout."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import _dtypes, jit, reference, testing

from conftest import assert_close

pytestmark = pytest.mark.gpu

DTYPES = {"f16": np.float16, "bf16": _dtypes.BY_NAME["bf16"].numpy, "f32": np.float32}
LAYOUTS = ("NHD", "HND", "vllm")


def make_varlen(rng, q_lens, seq_lens, *, layout="NHD", dtype="f16", heads=4, kv_heads=2,
                head_size=64, block_size=16, alibi=False, stale=float("nan"), share=False):
    """A host problem: caches in ``layout`` with unused slots set to ``stale``, a query of
    sum(q_lens) rows, and query_start_loc."""
    seq_lens = np.asarray(seq_lens, np.int32)
    q_lens = np.asarray(q_lens, np.int64)
    assert (q_lens <= seq_lens).all()
    dt = DTYPES[dtype]
    bt, nb = testing.random_block_tables(seq_lens, block_size, rng, spare_blocks=2, share=share)
    kc, vc = testing.random_cache(nb, kv_heads, head_size, block_size, dt, rng)
    if stale is not None:
        testing.poison_unused_slots(kc, vc, bt, seq_lens, stale)
    kc, vc = testing.convert_layout(kc, vc, "vllm", layout)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = testing.random_normal((int(qsl[-1]), heads, head_size), dt, rng)
    slopes = rng.uniform(0.0, 0.5, heads).astype(np.float32) if alibi else None
    return dict(query=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=seq_lens,
                query_start_loc=qsl, alibi_slopes=slopes)


def run(host, **kw):
    """cupaged.attention on device copies of ``host``, and the reference."""
    import cupy

    dev = {k: (None if v is None else cupy.asarray(v)) for k, v in host.items()}
    out = kw.pop("out", None)
    if out is None:  # poisoned: every row must be written
        out = cupy.full(host["query"].shape, np.nan, dtype=host["query"].dtype)
    got = cupaged.attention(**dev, out=out, **kw)
    kw.pop("max_query_len", None), kw.pop("max_seq_len", None)
    ref = reference.attention(**host, **{k: v for k, v in kw.items() if k != "workspace"})
    return cupy.asnumpy(got).astype(np.float64), ref


# (dtype, head_size, block_size, heads, kv_heads): every code path and odd sizes.
CASES = [
    ("f16", 128, 16, 8, 2),
    ("bf16", 128, 16, 32, 8),
    ("f16", 64, 1, 4, 4),
    ("bf16", 40, 2, 6, 1),    # head size not a multiple of 16, group of 6
    ("f16", 96, 8, 8, 1),
    ("f16", 256, 32, 2, 1),
    ("bf16", 32, 256, 3, 3),
    ("f16", 72, 4, 16, 2),
    ("f32", 64, 16, 4, 2),    # float32: the decode kernel's row mode
    ("f32", 128, 1, 8, 1),
    ("bf16", 512, 16, 4, 1),  # heads over 256 dims: a pair of warps per row
    ("f16", 272, 8, 6, 2),    # 17 16-dim steps: the pair's halves differ
    ("bf16", 384, 32, 8, 2),
]
# Mixed batches: empty sequences, decode tokens, verify, chunks, whole prompts.
Q_LENS = [0, 1, 1, 4, 7, 16, 100, 0, 33]
SEQ_EXTRA = [0, 0, 31, 2048 - 4, 0, 17, 0, 5, 64 * 3 + 1]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}_hs{}_bs{}_{}x{}".format(*c))
def test_mixed_batch_matches_reference(rng, case, layout, causal):
    dtype, hs, bs, heads, kv_heads = case
    seq = [q + e for q, e in zip(Q_LENS, SEQ_EXTRA)]
    host = make_varlen(rng, Q_LENS, seq, layout=layout, dtype=dtype, heads=heads,
                       kv_heads=kv_heads, head_size=hs, block_size=bs, share=True)
    got, ref = run(host, kv_layout=layout, causal=causal, max_query_len=max(Q_LENS))
    assert_close(got, ref, testing.TOLERANCE[dtype], f"{case} {layout}")


# Tile shapes (jit.PREFILL_TILE: warps, m_atoms, tile_tokens, stages, key_warps) beyond the
# planner's: the tuning sweep (cupaged-bench prefill --tile) times these, so each must
# compute the same attention. Those with warps sharing rows merge their states at the end.
TILES = [(4, 1, 32, 2, 1), (8, 1, 32, 2, 1), (4, 2, 64, 2, 1), (8, 1, 64, 2, 1),
         (4, 1, 64, 3, 1), (4, 2, 32, 2, 1), (2, 1, 128, 2, 1), (4, 1, 16, 3, 1),
         (4, 1, 64, 2, 4), (4, 1, 128, 2, 4), (4, 2, 64, 2, 2), (8, 1, 32, 2, 2)]


@pytest.fixture
def tile_override():
    from cupaged import planning

    yield planning.set_prefill_tile
    planning.set_prefill_tile(None)


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("case", [("bf16", 128, 16, 16, 4, "NHD"), ("f16", 72, 128, 6, 2, "vllm"),
                                  ("f16", 256, 8, 4, 1, "HND"), ("bf16", 64, 1, 2, 2, "NHD"),
                                  ("bf16", 512, 16, 4, 1, "NHD")],
                         ids=lambda c: "{}_hs{}_bs{}_{}x{}_{}".format(*c))
@pytest.mark.parametrize("tile", TILES, ids=lambda t: jit.prefill_tile_name(t))
def test_every_tile_shape_matches_reference(rng, tile_override, tile, case, alibi):
    from cupaged.specs import geometry

    dtype, hs, bs, heads, kv_heads, layout = case
    spec = jit.KernelSpec("paged_prefill", dtype, hs, bs, kv_format="vllm" if layout == "vllm"
                          else "tok", **dict(zip(jit.PREFILL_TILE, tile)))
    g = geometry.PrefillGeometry.of(spec)
    if g.violations() or not g.fits("sm_90"):
        pytest.skip("not a shape of this head size: " + ", ".join(g.violations() or ["smem"]))
    tile_override(tile)
    q_lens = [300, 1, 0, 64, 17, 200]
    host = make_varlen(rng, q_lens, [300, 900, 40, 64 + 1000, 17 + 129, 200 + 7], layout=layout,
                       dtype=dtype, heads=heads, kv_heads=kv_heads, head_size=hs,
                       block_size=bs, alibi=alibi)
    for causal in (True, False):
        got, ref = run(host, kv_layout=layout, causal=causal, max_query_len=max(q_lens))
        assert_close(got, ref, testing.TOLERANCE[dtype], f"{tile} {case} causal={causal}")


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
def test_alibi(rng, dtype, layout):
    host = make_varlen(rng, [5, 40, 1], [5, 300, 77], layout=layout, dtype=dtype, heads=8,
                       kv_heads=2, alibi=True)
    for causal in (True, False):
        got, ref = run(host, kv_layout=layout, causal=causal)
        assert_close(got, ref, testing.TOLERANCE[dtype], f"alibi causal={causal}")


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_alibi_with_steep_slopes_over_long_contexts(rng, dtype):
    """ALiBi with the slopes of a 32-head model (2^-0.25 .. 2^-8, the steepest near 1) over
    long contexts, where most tiles take the ramp (no masks: non-causal, and causal rows
    far past a tile): the ramp's slope * offset must carry the slope's full precision,
    since a logit error of e moves a probability by about e."""
    heads = 32
    host = make_varlen(rng, [64, 1, 130], [3000, 2048, 1500], dtype=dtype, heads=heads,
                       kv_heads=8, head_size=128)
    host["alibi_slopes"] = (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)
    for causal in (True, False):
        got, ref = run(host, causal=causal)
        assert_close(got, ref, testing.TOLERANCE[dtype], f"steep alibi causal={causal}")


# ---- split-KV prefill ------------------------------------------------------------------------

# Decode over token-major caches on the tensor-core path (groups 4 and 8): head sizes
# whose rows are whole groups of eight 16-byte chunks, stored swizzled in shared memory
# (64, 128, 192, 256), and two whose rows are padded instead (80 and 224: 10 and 28).
SWIZZLE_CASES = [(64, 4), (128, 8), (192, 4), (256, 8), (80, 4), (224, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("hs, group", SWIZZLE_CASES, ids=lambda c: str(c))
def test_decode_over_token_major_rows_of_every_chunk_count(rng, hs, group, dtype, layout):
    """One query per sequence (the decode kernel), lengths ending inside and at the ends
    of blocks and tiles, an empty sequence, a long one (split-KV), stale slots NaN."""
    seq = [1, 1, 15, 16, 17, 63, 64, 65, 200, 1000]
    host = make_varlen(rng, [1] * len(seq), seq, layout=layout, dtype=dtype, heads=2 * group,
                       kv_heads=2, head_size=hs, block_size=16, share=True)
    host["query_start_loc"] = None
    host["seq_lens"][0] = 0  # empty: zeros
    got, ref = run(host, kv_layout=layout)
    assert_close(got, ref, testing.TOLERANCE[dtype], f"hs {hs} group {group} {dtype} {layout}")


# (dtype, head_size, block_size, heads, kv_heads): the 64-token tile (two shapes, the
# few-rows one included), the 32-token tile of head size 256, a head size of odd chunks.
SPLIT_CASES = [("bf16", 128, 16, 8, 2), ("f16", 64, 32, 16, 2), ("f16", 256, 8, 4, 1),
               ("bf16", 40, 128, 6, 3), ("bf16", 512, 16, 4, 1), ("f16", 272, 32, 4, 2)]


@pytest.mark.parametrize("split", [0, 64, 192], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "{}_hs{}_bs{}_{}x{}".format(*c))
def test_split_kv_prefill_matches_reference(rng, prefill_split, case, layout, split):
    """Partitions of 64 and 192 tokens against a single pass: empty sequences, rows whose
    causal keys end before later partitions, a context of one partition plus one token,
    and a long one; outputs and lses against the float64 reference, every row written."""
    from test_variants import _check_lse

    dtype, hs, bs, heads, kv_heads = case
    prefill_split(split)
    q_lens = [0, 1, 5, 100, 3, 64, 2]
    seq = [0, 1, 700, 1100, 3 + 129, 64 + 64, 193]
    host = make_varlen(rng, q_lens, seq, layout=layout, dtype=dtype, heads=heads,
                       kv_heads=kv_heads, head_size=hs, block_size=bs, share=True)
    for causal in (True, False):
        got, ref = run(host, kv_layout=layout, causal=causal, max_query_len=max(q_lens))
        assert_close(got, ref, testing.TOLERANCE[dtype], f"{case} {layout} causal={causal}")
    import cupy

    dev = {k: (None if v is None else cupy.asarray(v)) for k, v in host.items()}
    lse = cupy.full((sum(q_lens), heads), np.nan, np.float32)
    cupaged.attention(**dev, kv_layout=layout, lse=lse)
    _, ref_lse = reference.attention(**host, kv_layout=layout, return_lse=True)
    _check_lse(cupy.asnumpy(lse), ref_lse, f"{case} {layout} split={split}")


def test_split_kv_prefill_of_a_bad_block_gives_nan_for_its_sequence_only(rng, prefill_split):
    """A bad id in one partition of the second sequence: its rows NaN (the combine keeps
    NaN), the first sequence's exact."""
    import cupy

    prefill_split(64)
    host = make_varlen(rng, [4, 6], [400, 500], dtype="bf16", heads=4, kv_heads=2)
    host["block_tables"][1, 20] = 10**6  # keys 320..335: the sixth partition of 64
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    got = cupy.asnumpy(cupaged.attention(**dev)).astype(np.float64)
    good = {**host, "seq_lens": host["seq_lens"][:1], "block_tables": host["block_tables"][:1],
            "query_start_loc": host["query_start_loc"][:2], "query": host["query"][:4]}
    assert_close(got[:4], reference.attention(**good), testing.TOLERANCE["bf16"])
    assert np.isnan(got[4:]).all()


def test_split_kv_prefill_fits_a_small_workspace_or_runs_single_pass(rng, prefill_split):
    """A DecodeWorkspace too small for the chosen partitions: larger partitions, or a
    single pass when not even two fit; the result is the same attention."""
    prefill_split(64)
    host = make_varlen(rng, [8, 3], [900, 300], heads=8, kv_heads=2)
    rows = 11 * 8  # query rows x heads
    for ws_rows in (rows * 3, rows):
        ws = cupaged.DecodeWorkspace(2, 8, 64, rows=ws_rows)
        got, ref = run(host, workspace=ws)
        assert_close(got, ref, testing.TOLERANCE["f16"], f"workspace of {ws_rows} rows")


@pytest.mark.parametrize("q_len, ctx", [(1000, 1000), (16, 100_003), (3, 131_072)])
def test_long_prompts_and_contexts(rng, q_len, ctx):
    host = make_varlen(rng, [q_len], [ctx], dtype="bf16", heads=8, kv_heads=2, head_size=64,
                       block_size=64)
    got, ref = run(host, kv_layout="NHD")
    assert_close(got, ref, testing.TOLERANCE["bf16"], f"{q_len} over {ctx}")


@pytest.mark.parametrize("head_size", [64, 72])
@pytest.mark.parametrize("max_query_len", [None, 1, 3])
def test_host_bounds_that_undercount_cost_nothing_but_parallelism(rng, max_query_len, head_size):
    """A bound of 1 or 3 tokens (8 or 24 packed rows) takes the tile whose warps share
    rows, and each CTA then walks many query tiles of the 200-token sequence: the merge's
    states, written over the stages, must not leave the zero padding of a 72-dim head's K
    rows dirty for the next (they did: NaN rows)."""
    host = make_varlen(rng, [200, 3, 64], [300, 3, 64], heads=8, kv_heads=1,
                       head_size=head_size)
    got, ref = run(host, max_query_len=max_query_len, max_seq_len=2)
    assert_close(got, ref, testing.TOLERANCE["f16"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_lens, seq", [
    ([2, 0], [5, 40]),                        # PagedKVCache.step(num_tokens=[2, 0])
    ([0, 2], [3000, 4000]),                   # long enough to split the keys
    ([0, 3, 0, 1], [9, 300, 1, 17]),
    ([1, 0, 2, 1, 1, 1], [1, 70, 33, 2048, 1, 4]),
])
@pytest.mark.parametrize("workspace", [False, True])
@pytest.mark.parametrize("split", ["auto", "flat"])
def test_max_query_len_of_one_never_hides_a_longer_query(rng, request, layout, q_lens, seq,
                                                         workspace, split):
    """total_q == num_seqs with max_query_len=1 is most likely a decode step, but the bound
    may undercount: the rows must still be the sequences query_start_loc says they are,
    single pass, split, or the flat split over the rows."""
    import cupy

    if split == "flat":
        request.getfixturevalue("flat_split")

    assert sum(q_lens) == len(seq) and max(q_lens) > 1
    host = make_varlen(rng, q_lens, seq, layout=layout, heads=8, kv_heads=2, head_size=128)
    ws = cupaged.DecodeWorkspace(len(seq), 8, 128) if workspace else None
    got, ref = run(host, kv_layout=layout, max_query_len=1, workspace=ws)
    assert_close(got, ref, testing.TOLERANCE["f16"], f"{q_lens}")
    # The case is what it claims: split-KV over query_start_loc.
    if max(seq) >= 3000 and split == "auto":
        dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
        plan = cupaged.AttentionPlan(**dev, kv_layout=layout, max_query_len=1, workspace=ws)
        assert plan._prepared.launch.split and plan._prepared.launch.takes_starts


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["f16", "f32"])
@pytest.mark.parametrize("split", ["auto", "flat"])
def test_decode_through_attention_equals_paged_attention(rng, request, layout, dtype, split):
    """One token per sequence, with and without query_start_loc, single pass and split
    (and the flat split, over sequences and over rows)."""
    import cupy

    if split == "flat":
        request.getfixturevalue("flat_split")

    seq = [1, 17, 1000, 4096, 2, 33]
    host = make_varlen(rng, [1] * len(seq), seq, layout=layout, dtype=dtype, heads=8,
                       kv_heads=2, head_size=128)
    ref = reference.attention(**{**host, "query_start_loc": None}, kv_layout=layout)
    tol = testing.TOLERANCE[dtype]
    dev = {k: (None if v is None else cupy.asarray(v)) for k, v in host.items()}
    for starts, mq in ((None, None), (dev["query_start_loc"], 1)):
        args = {**dev, "query_start_loc": starts}
        got = cupaged.attention(**args, kv_layout=layout, max_query_len=mq)
        assert_close(cupy.asnumpy(got), ref, tol, f"{layout} starts={starts is not None}")
        got = cupaged.attention(**args, kv_layout=layout, max_query_len=mq, max_seq_len=64)
        assert_close(cupy.asnumpy(got), ref, tol, "undercounted max_seq_len")
    if layout == "vllm":
        legacy = cupaged.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"],
                                         dev["block_tables"], dev["seq_lens"])
        np.testing.assert_array_equal(cupy.asnumpy(legacy),
                                      cupy.asnumpy(cupaged.attention(
                                          **{**dev, "query_start_loc": None}, kv_layout="vllm")))


def test_fused_and_packed_views_are_read_in_place(rng):
    """K and V as halves of FlashInfer's [blocks, 2, bs, kvh, hs] and of vLLM's packed
    [blocks, kvh, bs, 2 * hs] allocations."""
    import cupy

    host = make_varlen(rng, [3, 20], [40, 20], heads=8, kv_heads=2, head_size=64)
    fused = np.stack([host["key_cache"], host["value_cache"]], axis=1)  # NHD halves
    d_fused = cupy.asarray(fused)
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    dev.update(key_cache=d_fused[:, 0], value_cache=d_fused[:, 1])
    ref = reference.attention(**host)
    got = cupaged.attention(**dev, kv_layout="NHD")
    assert_close(cupy.asnumpy(got), ref, testing.TOLERANCE["f16"], "FlashInfer 5-D")

    hnd_k, hnd_v = testing.convert_layout(host["key_cache"], host["value_cache"], "NHD", "HND")
    packed = cupy.asarray(np.concatenate([hnd_k, hnd_v], axis=-1))  # [nb, kvh, bs, 2 * hs]
    dev.update(key_cache=packed[..., :64], value_cache=packed[..., 64:])
    got = cupaged.attention(**dev, kv_layout="HND")
    assert_close(cupy.asnumpy(got), ref, testing.TOLERANCE["f16"], "vLLM packed")


def test_chunked_prefill_equals_one_shot_prefill(rng, prefill_split):
    """A 300-token prompt in chunks of 128, 100 and 72 (each attending to the cache so far)
    gives the rows of one 300-token prefill (bit for bit in a single pass: split-KV would
    sum the chunks' keys in other partitions)."""
    import cupy

    prefill_split(0)
    host = make_varlen(rng, [300], [300], dtype="bf16", heads=8, kv_heads=2)
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    whole = cupy.asnumpy(cupaged.attention(**dev))
    rows, done = [], 0
    for n in (128, 100, 72):
        done += n
        part = cupaged.attention(dev["query"][done - n:done], dev["key_cache"],
                                 dev["value_cache"], dev["block_tables"],
                                 cupy.asarray([done], np.int32), cupy.asarray([0, n], np.int32))
        rows.append(cupy.asnumpy(part))
    np.testing.assert_array_equal(np.concatenate(rows), whole)
    assert_close(whole, reference.attention(**host), testing.TOLERANCE["bf16"])


@pytest.mark.parametrize("stale", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stale_slots_never_reach_the_output(rng, stale, layout):
    host = make_varlen(rng, [5, 9, 1], [21, 9, 1], layout=layout, block_size=16, stale=stale)
    got, ref = run(host, kv_layout=layout)
    assert_close(got, ref, testing.TOLERANCE["f16"], f"stale={stale}")


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_a_bad_block_id_gives_nan_for_its_sequence_only(rng, dtype):
    import cupy

    host = make_varlen(rng, [4, 6], [40, 50], dtype=dtype, heads=4, kv_heads=2)
    host["block_tables"][1, 1] = 10**6
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    got = cupy.asnumpy(cupaged.attention(**dev)).astype(np.float64)
    good = {**host, "seq_lens": host["seq_lens"][:1], "block_tables": host["block_tables"][:1],
            "query_start_loc": host["query_start_loc"][:2], "query": host["query"][:4]}
    assert_close(got[:4], reference.attention(**good), testing.TOLERANCE[dtype])
    assert np.isnan(got[4:]).all()


def test_a_bad_block_gives_nan_to_exactly_the_rows_that_see_it_in_row_mode(rng):
    """The decode kernel's row mode (float32 queries here) runs one CTA per query row: the
    rows whose keys include a bad block come out NaN in every head, their lse too, and the
    sequence's earlier rows, whose causal keys stop before the block, are exact."""
    import cupy
    from test_variants import _check_lse

    host = make_varlen(rng, [30, 3], [40, 20], dtype="f32", heads=4, kv_heads=2)
    host["block_tables"][0, 2] = 10**6  # keys 32..47; row i of sequence 0 at position 10 + i
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    got, lse = (cupy.asnumpy(a).astype(np.float64)
                for a in cupaged.attention(**dev, max_query_len=30, return_lse=True))
    assert np.isnan(got[22:30]).all() and np.isnan(lse[22:30]).all()
    early = {**host, "seq_lens": np.array([32], np.int32), "block_tables": host["block_tables"][:1],
             "query_start_loc": np.array([0, 22], np.int32), "query": host["query"][:22]}
    ref, ref_lse = reference.attention(**early, return_lse=True)
    assert_close(got[:22], ref, testing.TOLERANCE["f32"])
    _check_lse(lse[:22], ref_lse, "rows before the bad block")
    other = {**host, "seq_lens": host["seq_lens"][1:], "block_tables": host["block_tables"][1:],
             "query_start_loc": np.array([0, 3], np.int32), "query": host["query"][30:]}
    assert_close(got[30:], reference.attention(**other), testing.TOLERANCE["f32"])


@pytest.mark.parametrize("family", ["mma", "sm90"])
@pytest.mark.parametrize("split", [0, 64], ids=lambda s: f"split{s}")
def test_a_bad_block_spares_the_query_tiles_before_it(rng, prefill_split, family, split):
    """The multi-token kernels give a bad block's NaN to whole tiles of packed rows (query
    tokens x the query heads of one KV head, 16 to 128 rows): every row that sees the block
    is NaN, and so may others of its tile; rows of earlier tiles are exact. With 2 heads a
    KV head, a tile holds at most 64 tokens, so tokens 0..63 never share one with token 148,
    the first to see the block."""
    import cupy
    from cupaged import planning

    if family == "sm90" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU (compute capability 9.0)")
    prefill_split(split)
    planning.set_prefill_family(family)
    try:
        host = make_varlen(rng, [200], [260], dtype="f16", heads=4, kv_heads=2)
        host["block_tables"][0, 13] = 10**6  # keys 208..223; token i at position 60 + i
        dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
        got = cupy.asnumpy(cupaged.attention(**dev, max_query_len=200)).astype(np.float64)
    finally:
        planning.set_prefill_family(None)
    assert np.isnan(got[148:]).all()
    early = {**host, "seq_lens": np.array([124], np.int32),
             "query_start_loc": np.array([0, 64], np.int32), "query": host["query"][:64]}
    assert_close(got[:64], reference.attention(**early), testing.TOLERANCE["f16"],
                 f"{family} split={split}")


@pytest.mark.parametrize("family", ["mma", "sm90"])
@pytest.mark.parametrize("split", [0, 64], ids=lambda s: f"split{s}")
def test_rows_outside_the_query_starts_are_left_as_they_are(rng, prefill_split, family, split):
    """Rows before query_start_loc[0] and from query_start_loc[-1] on (a batch padded to a
    fixed size, as cupaged.jax takes one) are no sequence's: neither the multi-token kernels
    nor the combine of their split partials write them (cupaged.jax zeroes them first and
    relies on it); the rows between equal the reference, out and lse."""
    import cupy
    from cupaged import planning

    if family == "sm90" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU (compute capability 9.0)")
    prefill_split(split)
    host = make_varlen(rng, [1, 5, 0, 3], [17, 300, 1, 64], dtype="f16", heads=4, kv_heads=2)
    lead, tail = 2, 3
    q = host["query"]
    pad = lambda n: testing.random_normal((n, *q.shape[1:]), np.float16, rng)  # noqa: E731
    padded = dict(host, query=np.concatenate([pad(lead), q, pad(tail)]),
                  query_start_loc=host["query_start_loc"] + lead)
    dev = {k: cupy.asarray(v) for k, v in padded.items() if v is not None}
    out = cupy.full(padded["query"].shape, 7.0, np.float16)
    lse = cupy.full(padded["query"].shape[:2], 7.0, np.float32)
    planning.set_prefill_family(family)
    try:
        cupaged.attention(**dev, out=out, lse=lse, max_query_len=5)
    finally:
        planning.set_prefill_family(None)
    got, got_lse = cupy.asnumpy(out).astype(np.float64), cupy.asnumpy(lse)
    rows = slice(lead, lead + len(q))
    assert (got[:lead] == 7).all() and (got[rows.stop:] == 7).all()
    assert (got_lse[:lead] == 7).all() and (got_lse[rows.stop:] == 7).all()
    ref, ref_lse = reference.attention(**host, return_lse=True)
    assert_close(got[rows], ref, testing.TOLERANCE["f16"], f"{family} split={split}")
    np.testing.assert_allclose(got_lse[rows], ref_lse, rtol=0, atol=2e-3)


@pytest.mark.parametrize("workspace", [False, True])
def test_an_empty_sequence_gives_zeros_and_minus_inf_lse(rng, workspace):
    """A length-0 sequence, one row without query_start_loc (the decode path, split-KV
    over the long ones), sees no key: zeros and lse -inf in every head, through attention
    and an AttentionPlan; a negative length counts as 0."""
    import cupy
    from test_variants import _check_lse

    host = make_varlen(rng, [1, 1, 1, 1], [300, 5, 3000, 9], heads=4, kv_heads=2)
    host["seq_lens"][[1, 3]] = [0, -4]
    dev = {k: cupy.asarray(v) for k, v in host.items()
           if v is not None and k != "query_start_loc"}
    kw = dict(return_lse=True)
    if workspace:
        kw["workspace"] = cupaged.DecodeWorkspace(4, 4, 64)
    plan = cupaged.AttentionPlan(**dev, **kw)
    for out, lse in (cupaged.attention(**dev, **kw), plan.run(dev["query"], dev["key_cache"],
                                                              dev["value_cache"])):
        out, lse = cupy.asnumpy(out), cupy.asnumpy(lse)
        assert (out[[1, 3]] == 0).all() and np.isneginf(lse[[1, 3]]).all()
        for s in (0, 2):
            one = {**host, "seq_lens": host["seq_lens"][s:s + 1],
                   "block_tables": host["block_tables"][s:s + 1], "query_start_loc": None,
                   "query": host["query"][s:s + 1]}
            ref, ref_lse = reference.attention(**one, return_lse=True)
            assert_close(out[s:s + 1].astype(np.float64), ref, testing.TOLERANCE["f16"])
            _check_lse(lse[s:s + 1], ref_lse, f"sequence {s}")


def test_empty_batches_and_sequences(rng):
    import cupy

    host = make_varlen(rng, [0, 0], [0, 7])
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    out = cupaged.attention(**dev)
    assert out.shape == (0, 4, 64)
    z = cupy.zeros((0, 1), np.int32)
    out = cupaged.attention(cupy.zeros((0, 4, 64), np.float16), dev["key_cache"],
                            dev["value_cache"], z, cupy.zeros(0, np.int32),
                            cupy.zeros(1, np.int32))
    assert out.shape == (0, 4, 64)


def test_in_place_over_the_query(rng):
    import cupy

    host = make_varlen(rng, [30, 2], [50, 2], heads=8, kv_heads=2)
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    ref = reference.attention(**host)
    out = cupaged.attention(**dev, out=dev["query"])
    assert out is dev["query"]
    assert_close(cupy.asnumpy(out), ref, testing.TOLERANCE["f16"])


def test_torch_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    host = make_varlen(rng, [3, 8], [10, 8], dtype="f16", heads=8, kv_heads=2)
    dev = {k: torch.from_numpy(np.ascontiguousarray(v)).cuda() for k, v in host.items()
           if v is not None}
    got = cupaged.attention(**dev)
    assert isinstance(got, torch.Tensor) and got.shape == dev["query"].shape
    torch.cuda.synchronize()
    assert_close(got.cpu().numpy(), reference.attention(**host), testing.TOLERANCE["f16"])


# ---- CUDA graphs -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["prefill", "rows", "decode"])
def test_cupy_graph_replays_every_kernel_with_new_inputs(rng, kind):
    """Capture one call per planner path, then change every input in place (queries, cache
    contents, block tables, lengths, query starts with the same total) and replay: the
    graph reads the new values and matches the reference and an eager call bit for bit."""
    import cupy

    dtype = "f32" if kind == "rows" else "f16"
    q_lens = [1, 1, 1] if kind == "decode" else [7, 1, 24]
    seqs = [[40, 3, 70], [90, 1, 33]]  # before and after the in-place update
    later = q_lens if kind == "decode" else q_lens[::-1]
    hosts = [make_varlen(rng, q, s, dtype=dtype, heads=8, kv_heads=2)
             for q, s in zip((q_lens, later), seqs)]
    for h in hosts:  # the same shapes, so the second is written over the first
        width = max(x["block_tables"].shape[1] for x in hosts)
        nb = max(x["key_cache"].shape[0] for x in hosts)
        h["block_tables"] = np.pad(h["block_tables"], ((0, 0), (0, width - h["block_tables"].shape[1])))
        for name in ("key_cache", "value_cache"):
            h[name] = np.concatenate([h[name], np.zeros((nb - h[name].shape[0],) + h[name].shape[1:],
                                                       h[name].dtype)])
    names = [k for k, v in hosts[0].items() if v is not None]
    if kind == "decode":
        names.remove("query_start_loc")
    dev = {k: cupy.asarray(hosts[0][k]) for k in names}
    out = cupy.empty_like(dev["query"])
    bounds = dict(max_query_len=max(q_lens), max_seq_len=hosts[0]["block_tables"].shape[1] * 16,
                  workspace=cupaged.DecodeWorkspace(3, 8, 64))  # no allocation while capturing
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cupaged.attention(**dev, out=out, **bounds)  # compiled and loaded before capture
        stream.begin_capture()
        cupaged.attention(**dev, out=out, **bounds)
        graph = stream.end_capture()
        for k in names:
            dev[k].set(hosts[1][k])
        graph.launch(stream)
        stream.synchronize()
        replayed = cupy.asnumpy(out).astype(np.float64)
        ref_args = {k: hosts[1][k] for k in names}
        assert_close(replayed, reference.attention(**ref_args), testing.TOLERANCE[dtype], kind)
        eager = cupaged.attention(**dev, **bounds)
        np.testing.assert_array_equal(cupy.asnumpy(eager).astype(np.float64), replayed)


def test_torch_graph_replays_a_mixed_step(rng):
    torch = pytest.importorskip("torch")
    host = make_varlen(rng, [16, 1, 3], [100, 20, 3], dtype="f16", heads=8, kv_heads=2)
    dev = {k: torch.from_numpy(np.ascontiguousarray(v)).cuda() for k, v in host.items()
           if v is not None}
    out = torch.empty_like(dev["query"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cupaged.attention(**dev, out=out, max_query_len=16)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cupaged.attention(**dev, out=out, max_query_len=16)
    q2 = testing.random_normal(host["query"].shape, np.float16, rng)
    dev["query"].copy_(torch.from_numpy(q2).cuda())
    g.replay()
    torch.cuda.synchronize()
    got = out.cpu().numpy().astype(np.float64)
    assert_close(got, reference.attention(**{**host, "query": q2}), testing.TOLERANCE["f16"])


# ---- CUPAGED_DEBUG ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, match", [
    ([0, 5, 3, 8], "must be non-decreasing: query_start_loc\\[2\\] = 3 < query_start_loc\\[1\\] = 5"),
    ([0, 2, 5, 8], "sequence 2: 3 query tokens but seq_lens\\[2\\] = 2"),
    ([0, 2, 4, 7], "must run from 0 to total_q = 8"),
])
def test_debug_checks_query_start_loc_on_the_device(rng, monkeypatch, bad, match):
    import cupy

    host = make_varlen(rng, [2, 4, 2], [10, 6, 2])
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    cupaged.attention(**dev)  # valid: no error, debug or not
    monkeypatch.setattr(cupaged._checks, "DEBUG", True)
    cupaged.attention(**dev)
    dev["query_start_loc"] = cupy.asarray(bad, np.int32)
    with pytest.raises(ValueError, match=match):
        cupaged.attention(**dev)
