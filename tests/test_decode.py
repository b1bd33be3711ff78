"""paged_attention on the GPU against the float64 reference."""

import random

import cupy
import numpy as np
import pytest

import cupaged
from cupaged import _checks, _dtypes, decode, jit, planning, testing
from cupaged.specs import geometry
from conftest import assert_close, make_problem, rel_err

pytestmark = pytest.mark.gpu

DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": _dtypes.BF16.numpy}
GROUPS = (1, 2, 3, 4, 6, 8, 16)


def _fits(dt, hs, bs, g):
    """Does the specialization fit an H100's shared memory? (float32 caches stop below
    head size 512: test_large_float32_heads_name_the_shared_memory_limit.)"""
    spec = jit.KernelSpec("paged_decode", dt, hs, bs, planning.group_tile(g), arch="sm_90")
    return geometry.DecodeGeometry.of(spec).fits("sm_90")


def _grid():
    """(dtype, head_size, block_size, group, kv_heads, alibi): every head size, every
    dtype x block size and every dtype x group appear at least once; the partners are
    drawn at random (with a fixed seed, so the test ids stay stable) among those that fit
    the GPU."""
    r = random.Random(2024)
    cases = set()

    def draw(dt=None, hs=None, bs=None, g=None):
        while True:
            c = (dt or r.choice(list(DTYPES)), hs or r.choice(decode.HEAD_SIZES),
                 bs or r.choice(decode.BLOCK_SIZES), g or r.choice(GROUPS))
            if _fits(*c):
                return c

    for hs in decode.HEAD_SIZES:
        cases.add(draw(hs=hs))
    for dt in DTYPES:
        for bs in decode.BLOCK_SIZES:
            cases.add(draw(dt=dt, bs=bs))
        for g in GROUPS:
            cases.add(draw(dt=dt, g=g))
    return [(*c, r.choice((1, 2)), r.random() < 0.3) for c in sorted(cases)]


GRID = _grid()


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile the grid's specializations in parallel before the tests use them."""
    arch = planning.device_info(cupy.cuda.Device().id).arch
    specs = []
    for dt, hs, bs, g, _, _ in GRID:
        specs.append(jit.KernelSpec("paged_decode", dt, hs, bs, planning.group_tile(g), arch=arch))
        specs.append(jit.KernelSpec("paged_decode_combine", dt, hs, arch=arch))
    jit.precompile(specs, workers=16)


def poisoned(shape, dtype):
    out = cupy.empty(shape, dtype=dtype)
    out.fill(float("nan"))
    return out


def run(p, partition, guard=None, guard_caches=False, **kw):
    """paged_attention over ``p`` into a poisoned ``out``; ``guard``: the block table
    placed by testing.guarded on that side of unmapped memory; ``guard_caches``: both
    caches end at unmapped memory (a read of a block past the cache faults)."""
    a = p.device_args()
    if guard:
        a["block_tables"] = testing.guarded(p.block_tables, guard)
    if guard_caches:
        a["key_cache"] = testing.guarded(p.key_cache, "after")
        a["value_cache"] = testing.guarded(p.value_cache, "after")
    out = poisoned(a["query"].shape, a["query"].dtype)
    got = cupaged.paged_attention(**a, out=out, partition=partition, **kw)
    assert got is out
    return cupy.asnumpy(out).astype(np.float64)


def tol(p):
    return testing.TOLERANCE[_dtypes.lookup(p.query.dtype).name]


@pytest.mark.parametrize("dt, hs, bs, group, kv_heads, alibi", GRID,
                         ids=[f"{c[0]}-hs{c[1]}-bs{c[2]}-g{c[3]}-kv{c[4]}{'-alibi' if c[5] else ''}"
                              for c in GRID])
def test_decode_matches_reference(rng, dt, hs, bs, group, kv_heads, alibi):
    lens = [0, 1, max(bs - 1, 1), bs, bs + 1, int(rng.integers(2, 3000)), int(rng.integers(8193, 9500))]
    rng.shuffle(lens)
    p = make_problem(rng, dtype=DTYPES[dt], lens=lens, heads=group * kv_heads, kv_heads=kv_heads,
                     head_size=hs, block_size=bs, alibi=alibi, share=True)
    ref = p.reference()
    single = run(p, "never")
    split = run(p, "always")
    flat = run(p, "flat")
    assert not np.isnan(single).any() and not np.isnan(split).any() and not np.isnan(flat).any()
    assert_close(single, ref, tol(p))
    assert_close(split, ref, tol(p))
    assert_close(flat, ref, tol(p))
    assert_close(split, single, tol(p))  # the two paths agree with each other too
    assert not single[lens.index(0)].any()  # an empty context gives zeros


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_context_of_more_than_100k_tokens(rng, dt):
    p = make_problem(rng, dtype=DTYPES[dt], lens=[131072 + 77, 3], heads=32, kv_heads=8,
                     head_size=128, block_size=16)
    ref = p.reference()
    for partition in ("never", "auto", 4096, "flat"):
        assert_close(run(p, partition), ref, tol(p), partition)


def test_large_float32_heads_name_the_shared_memory_limit(rng):
    """A float32 head of 512 dims needs more shared memory than an H100 block has (its
    32-token K and V stages alone are 256 KiB): a ValueError naming the need and the
    limit, before anything launches; float16 at 512 runs."""
    p = make_problem(rng, dtype=np.float32, lens=[5, 40], heads=2, kv_heads=1, head_size=512,
                     block_size=16)
    out = poisoned(p.query.shape, p.query.dtype)
    with pytest.raises(ValueError, match=r"needs \d+ bytes of shared memory per block; "
                                         r"device \d+ allows \d+"):
        cupaged.paged_attention(**p.device_args(), out=out)
    assert cupy.isnan(out).all()  # nothing launched
    p = make_problem(rng, dtype=np.float16, lens=[5, 40], heads=2, kv_heads=1, head_size=512,
                     block_size=16)
    assert_close(run(p, "never"), p.reference(), tol(p))


def test_long_context_fp32_large_head(rng):
    p = make_problem(rng, dtype=np.float32, lens=[100_001], heads=4, kv_heads=1,
                     head_size=256, block_size=32)
    ref = p.reference()
    assert_close(run(p, "never"), ref, tol(p))
    assert_close(run(p, "always"), ref, tol(p))


def test_offsets_past_2_pow_31_elements(rng):
    """Blocks whose element offset (block id x block stride) exceeds 2**31: 64-bit math."""
    hs, bs, kvh = 128, 16, 2
    per_block = kvh * hs * bs  # elements
    num_blocks = (2**31 // per_block) + 4096  # ~4.3 GiB per fp16 cache
    lens = np.array([1000, 37], np.int32)
    need = -(-lens // bs)
    ids = rng.choice(np.arange(num_blocks - 4096, num_blocks), size=int(need.sum()), replace=False)
    assert ids.min() * per_block >= 2**31
    bt = np.zeros((2, need.max()), np.int32)
    bt[0, : need[0]], bt[1, : need[1]] = ids[: need[0]], ids[need[0]:]
    kc = cupy.empty((num_blocks, kvh, hs // 8, bs, 8), np.float16)
    vc = cupy.empty((num_blocks, kvh, hs, bs), np.float16)
    small_k, small_v = testing.random_cache(len(ids), kvh, hs, bs, np.float16, rng)
    kc[cupy.asarray(ids)] = cupy.asarray(small_k)
    vc[cupy.asarray(ids)] = cupy.asarray(small_v)
    q = testing.random_normal((2, 8, hs), np.float16, rng)
    # The reference sees only the used blocks, renumbered 0..n-1 in the same order.
    remap = np.zeros_like(bt)
    remap[0, : need[0]] = np.arange(need[0])
    remap[1, : need[1]] = np.arange(need[0], need.sum())
    ref = cupaged.reference.paged_attention(q, small_k, small_v, remap, lens)
    for partition in ("never", "always"):
        out = cupaged.paged_attention(cupy.asarray(q), kc, vc, cupy.asarray(bt), cupy.asarray(lens),
                                      partition=partition)
        assert_close(cupy.asnumpy(out), ref, 1e-3)
    del kc, vc
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("partition", [16, 48, 512, 1008])
def test_explicit_partition_sizes(rng, partition):
    p = make_problem(rng, lens=[2000, 1, 700, 1500], heads=8, kv_heads=2, head_size=128,
                     block_size=16)
    assert_close(run(p, partition), p.reference(), tol(p))


@pytest.mark.parametrize("batch, ctx", [(1, 1024), (1, 50000), (256, 512), (7, 3000)])
def test_auto_partition(rng, batch, ctx):
    lens = rng.integers(1, ctx + 1, batch)
    lens[0] = ctx
    p = make_problem(rng, lens=lens, heads=32, kv_heads=8, head_size=128, block_size=16)
    got = run(p, "auto", max_context_len=ctx)
    assert_close(got, p.reference(), tol(p))


@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("group", [1, 4])
def test_constant_values_stay_constant_over_a_long_single_pass(rng, dt, group):
    """Every V row 0.75: each output is 0.75 exactly, in one pass over 131,072 keys (the P V
    sums and the softmax's sum add the same rounded P; summed over the whole pass in the
    tensor cores' float32 additions, which truncate, they drifted a float16 step low)."""
    dtype = DTYPES[dt]
    seqs, ctx, kv_heads, hs, bs, nb = 2, 131_072, 2, 128, 16, 256
    heads = kv_heads * group
    tables = (np.arange(seqs * ctx // bs) % nb).reshape(seqs, -1).astype(np.int32)
    out = cupaged.paged_attention(
        query=cupy.asarray(testing.random_normal((seqs, heads, hs), dtype, rng)),
        key_cache=cupy.asarray(testing.random_normal((nb, kv_heads, hs // 8, bs, 8), dtype, rng)),
        value_cache=cupy.asarray(np.full((nb, kv_heads, hs, bs), 0.75, dtype)),
        block_tables=cupy.asarray(tables), context_lens=cupy.full((seqs,), ctx, cupy.int32),
        partition="never")
    got = cupy.asnumpy(out).astype(np.float64)
    assert (got == 0.75).all(), np.unique(got)


def test_undercounted_max_context_len_still_covers_every_token(rng):
    p = make_problem(rng, lens=[5000, 300], heads=8, kv_heads=2, head_size=64, block_size=16)
    ref = p.reference()
    for partition in ("always", 256):
        assert_close(run(p, partition, max_context_len=600), ref, tol(p))


def test_query_rows_from_a_fused_qkv(rng):
    p = make_problem(rng, lens=[40, 300, 5], heads=8, kv_heads=2, head_size=64)
    ref = p.reference()
    qkv = cupy.asarray(testing.random_normal((3, (8 + 2 * 2) * 64), np.float16, rng))
    qkv[:, : 8 * 64] = cupy.asarray(p.query.reshape(3, -1))
    q = qkv[:, : 8 * 64].reshape(3, 8, 64)
    assert not q.flags.c_contiguous
    a = p.device_args()
    a["query"] = q
    for partition in ("never", "always"):
        out = cupaged.paged_attention(**a, partition=partition)
        assert_close(cupy.asnumpy(out), ref, tol(p))


def test_caches_that_are_views_of_a_larger_buffer(rng):
    """Block and head strides come from the arrays (e.g. K and V in one allocation)."""
    p = make_problem(rng, lens=[100, 33], heads=4, kv_heads=2, head_size=64, block_size=16)
    ref = p.reference()
    nb = p.key_cache.shape[0]
    big_k = cupy.zeros((nb, 5, 8, 16, 8), np.float16)
    big_k[:, 1:3] = cupy.asarray(p.key_cache)
    big_v = cupy.zeros((2, nb, 2, 64, 16), np.float16)
    big_v[1] = cupy.asarray(p.value_cache)
    a = p.device_args()
    a["key_cache"], a["value_cache"] = big_k[:, 1:3], big_v[1]
    assert_close(cupy.asnumpy(cupaged.paged_attention(**a, partition="always")), ref, tol(p))


def test_scale_and_explicit_out_dtype(rng):
    p = make_problem(rng, dtype=np.float32, lens=[70, 9], head_size=96)
    ref = p.reference(scale=0.7)
    assert_close(run(p, "never", scale=0.7), ref, tol(p))


def test_no_sequences(rng):
    p = make_problem(rng, lens=[3])
    a = p.device_args()
    for k in ("query", "block_tables", "context_lens"):
        a[k] = a[k][:0]
    out = cupaged.paged_attention(**a)
    assert out.shape == (0, 4, 64)


def test_all_empty_contexts_give_zeros(rng):
    p = make_problem(rng, lens=[0, 0, 0])
    for partition in ("never", "always", 16, "flat"):
        out = run(p, partition, max_context_len=64)
        assert (out == 0).all()


@pytest.mark.parametrize("group", [1, 4, 6])
def test_split_kv_merged_by_the_last_partition(rng, group):
    """Split-KV merges in paged_decode itself (the last partition of a head tile to finish):
    right for rows of 0, 1 and many partitions, in a workspace or a scratch buffer, with
    the workspace's counters left at zero after every call, so repeated calls (and graph
    replays) start clean."""
    p = make_problem(rng, dtype=np.float16, lens=(0, 1, 16, 17, 300, 1000, 2047),
                     heads=2 * group, kv_heads=2, head_size=64)
    ref = p.reference()
    ws = cupaged.DecodeWorkspace(7, 2 * group, 64)
    for partition in (16, 64, 256, 2048, "always", "flat"):
        for workspace in (ws, None):
            got = run(p, partition, workspace=workspace)
            assert_close(got, ref, tol(p))
            assert (got[0] == 0).all()  # no key: partition 0 alone writes the zeros
        assert int(cupy.count_nonzero(ws._counters)) == 0


@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("seqs", [1, 7, 300], ids=lambda n: f"seqs{n}")
def test_flat_split_matches_reference(rng, dt, group, seqs):
    """The flat split (paged_decode's header): the grid's CTAs take equal runs of every
    unit's tiles, so a unit is cut anywhere, across CTAs and within one, and merged by its
    last piece. One sequence, a few, and more than two of the kernel's 128-sequence scan
    rounds; lengths 0, 1, block and tile edges and long ones; in a scratch and in a
    workspace (whose counters it leaves zero), twice (the counters start clean again)."""
    lens = [int(n) for n in rng.integers(0, 3000, seqs)]
    edges = [0, 1, 15, 16, 17, 63, 64, 65, 9000]
    lens[: len(edges)] = edges[:seqs] if seqs > 1 else [5000]
    p = make_problem(rng, dtype=DTYPES[dt], lens=lens, heads=2 * group, kv_heads=2,
                     head_size=64, block_size=16, share=True)
    ref = p.reference()
    ws = cupaged.DecodeWorkspace(seqs, 2 * group, 64, rows=4096 * 16)
    for workspace in (None, ws, ws):
        got = run(p, "flat", workspace=workspace)
        assert_close(got, ref, tol(p))
        for s, n in enumerate(lens):
            if n == 0:
                assert (got[s] == 0).all()
    assert int(cupy.count_nonzero(ws._counters)) == 0


def test_flat_split_with_short_units_leaves_ctas_idle(rng):
    """Fewer tiles than CTAs: a unit of one tile each, most CTAs without a run."""
    p = make_problem(rng, dtype=np.float16, lens=[1, 5, 0, 64], heads=4, kv_heads=4,
                     head_size=128, block_size=16)
    assert_close(run(p, "flat"), p.reference(), tol(p))


def test_ctas_per_sm_knob_pads_shared_memory_and_keeps_results(rng):
    """The tuning knob behind cupaged-bench decode --ctas-per-sm: more dynamic shared
    memory per launch (so at most two CTAs fit an SM), fewer planned slots, same output.
    The kernel is loaded at its own size first: the padded launch must raise the limit
    the first load set (it failed with CUDA_ERROR_INVALID_VALUE when it did not)."""
    p = make_problem(rng, dtype=np.float16, lens=(1, 700, 2047), heads=8, kv_heads=2,
                     head_size=128)
    dev = planning.device_info(cupy.cuda.Device().id)
    assert_close(run(p, "auto"), p.reference(), tol(p))
    try:
        planning.set_tuning(ctas_per_sm=2)
        ks = planning.decode_kernels(dev.id, "f16", 128, 16, 4)
        assert ks.smem >= dev.sm_smem // 2 - 1024
        assert ks.slots <= 2 * dev.sm_count
        for partition in ("auto", "never", "always"):
            assert_close(run(p, partition), p.reference(), tol(p))
    finally:
        planning.set_tuning()
    assert planning.decode_kernels(dev.id, "f16", 128, 16, 4).slots > 2 * dev.sm_count


def test_a_lower_residency_keeps_results_and_the_natural_one(rng):
    """The split model's lower residencies (planning.DecodeKernels.fewer): the driver grants each
    its CTAs per SM at its shared memory, raising the kernel's limit leaves the natural
    residency as it was, and a grid just over one natural wave, which the model moves to
    a lower residency, gives the reference's output under every partition choice."""
    dev = planning.device_info(cupy.cuda.Device().id)
    ks = planning.decode_kernels(dev.id, "f16", 128, 16, 4)
    if not ks.fewer:
        pytest.skip("no lower residency for this specialization on this device")
    for occ in ks.fewer:
        assert planning.resident_ctas(dev.id, ks.decode, geometry.DECODE_THREADS, occ.smem) == occ.slots
    assert planning.resident_ctas(dev.id, ks.decode, geometry.DECODE_THREADS, ks.smem) == ks.slots
    batch = ks.slots // 8 + 1  # 32/8 heads: eight CTAs per sequence
    assert planning.split_and_residency(batch * 8, 300, ks, 64, False)[1] in ks.fewer
    lens = rng.integers(1, 301, batch)
    lens[:3] = (300, 16, 17)
    p = make_problem(rng, dtype=np.float16, lens=lens, heads=32, kv_heads=8, head_size=128)
    ref = p.reference()
    for partition in ("auto", "never", 64):
        assert_close(run(p, partition), ref, tol(p))


@pytest.mark.parametrize("past", [0, 5])
def test_bad_block_id_gives_nan_rows_not_a_fault(rng, past):
    """A block id at or just past the cache's end: its sequence's rows are NaN, the others
    exact, and nothing reads the block (the caches end at unmapped memory: testing.guarded,
    so a read of it faults)."""
    p = make_problem(rng, lens=[50, 60, 70], heads=4, kv_heads=2, head_size=64, block_size=16)
    ref = p.reference()
    p.block_tables[1, 2] = p.key_cache.shape[0] + past  # past the cache
    with pytest.raises(ValueError, match=r"sequence 1: block_tables\[1, 2\] = .* is outside"):
        cupaged.check_block_tables(cupy.asarray(p.block_tables), cupy.asarray(p.context_lens),
                                   p.key_cache.shape[0], 16)
    for partition in ("never", "always", "flat"):
        got = run(p, partition, guard_caches=True)
        assert np.isnan(got[1]).all()
        assert_close(got[[0, 2]], ref[[0, 2]], tol(p))


def test_lengths_past_the_table_are_clamped_and_reported(rng):
    p = make_problem(rng, lens=[40, 20], heads=4, kv_heads=2, head_size=64, block_size=16)
    ref = p.reference()  # the table holds 3 blocks = 48 tokens per sequence
    p.context_lens[1] = 10_000
    with pytest.raises(ValueError, match="sequence 1: context length 10000 is outside"):
        cupaged.check_block_tables(cupy.asarray(p.block_tables), cupy.asarray(p.context_lens),
                                   p.key_cache.shape[0], 16)
    # The kernel stops at the table's width; here that reaches the row's unused (garbage)
    # entry, so the sequence comes out NaN instead of reading outside the cache. The table
    # ends a mapping and sequence 1 is its last row: a read past the table faults.
    for partition in ("never", "always", "flat"):
        got = run(p, partition, guard="after")
        assert_close(got[0], ref[0], tol(p))
        assert np.isnan(got[1]).all()


def test_debug_switch_checks_tables_in_every_call(rng, monkeypatch):
    p = make_problem(rng, lens=[50], heads=4, kv_heads=2, head_size=64, block_size=16)
    p.block_tables[0, 1] = -3
    monkeypatch.setattr(cupaged._checks, "DEBUG", True)
    with pytest.raises(ValueError, match=r"sequence 0: block_tables\[0, 1\] = -3"):
        cupaged.paged_attention(**p.device_args())


def test_valid_tables_pass_the_check(rng):
    p = make_problem(rng, lens=[0, 1, 16, 17, 300], block_size=16, share=True)
    cupaged.check_block_tables(cupy.asarray(p.block_tables), cupy.asarray(p.context_lens),
                               p.key_cache.shape[0], 16)


def test_int64_tables_are_refused_on_device(rng):
    p = make_problem(rng, lens=[5])
    a = p.device_args()
    a["block_tables"] = a["block_tables"].astype(cupy.int64)
    with pytest.raises(TypeError, match="block_tables must be int32, got int64"):
        cupaged.paged_attention(**a)


@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
def test_vllm_v1_and_v2(rng, dt):
    p = make_problem(rng, dtype=DTYPES[dt], lens=[1500, 20, 700], heads=8, kv_heads=2,
                     head_size=128, block_size=16, alibi=True)
    ref = p.reference(scale=0.1)
    a = p.device_args()
    args = (a["key_cache"], a["value_cache"], 2, 0.1, a["block_tables"], a["context_lens"], 16, 1500)
    out = poisoned((3, 8, 128), a["query"].dtype)
    cupaged.paged_attention_v1(out, a["query"], *args, alibi_slopes=a["alibi_slopes"])
    assert_close(cupy.asnumpy(out), ref, tol(p))
    parts = -(-1500 // 512)
    for tmp_dtype in (np.float32, a["query"].dtype):
        out = poisoned((3, 8, 128), a["query"].dtype)
        es = cupy.empty((3, 8, parts), np.float32)
        ml = cupy.empty((3, 8, parts), np.float32)
        tmp = cupy.empty((3, 8, parts, 128), tmp_dtype)
        cupaged.paged_attention_v2(out, es, ml, tmp, a["query"], *args, alibi_slopes=a["alibi_slopes"])
        assert_close(cupy.asnumpy(out), ref, tol(p), tmp_dtype)


def test_v2_rejects_a_small_workspace(rng):
    p = make_problem(rng, lens=[100])
    a = p.device_args()
    with pytest.raises(ValueError, match="max_logits and tmp_out must match exp_sums"):
        cupaged.paged_attention_v2(cupy.empty((1, 4, 64), np.float16), cupy.empty((1, 4, 2), np.float32),
                                   cupy.empty((1, 4, 2), np.float32), cupy.empty((1, 4, 1, 64), np.float32),
                                   a["query"], a["key_cache"], a["value_cache"], 2, 0.1,
                                   a["block_tables"], a["context_lens"], 16, 100)


# ---- stale cache slots -------------------------------------------------------------------------

# (dtype, group, block size): the FMA path with transposed V (f32), the FMA path with V in
# the cache's layout (blocks smaller than 16 bytes of V), and the tensor-core path (16-bit,
# 1 to 8 heads per CTA, the columns past them padding).
FAMILIES = [("f32", 1, 16), ("bf16", 1, 16), ("f16", 2, 16), ("f16", 3, 16), ("f16", 4, 4),
            ("f16", 4, 16), ("bf16", 8, 32), ("f16", 8, 1)]


@pytest.mark.parametrize("stale", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("dt, group, bs", FAMILIES, ids=[f"{d}-g{g}-bs{b}" for d, g, b in FAMILIES])
def test_stale_slots_never_reach_the_output(rng, dt, group, bs, stale):
    """Every cache slot no sequence uses holds NaN or Inf: the tail of each partly filled
    last block, spare blocks, and the blocks the table's unused entries point at. Lengths
    end inside blocks and tiles, on both paths. (Without the V masking in paged_decode.cuh,
    0 * NaN puts NaN in the output: `bash tools/device.sh mutants stale-slots`
    shows these tests fail then.)"""
    lens = [1, 5, bs + 3, 63, 65, 129, 700]
    p = make_problem(rng, dtype=DTYPES[dt], lens=lens, heads=2 * group, kv_heads=2, head_size=64,
                     block_size=bs, spare_blocks=4, extra_columns=2, stale=stale)
    need = [-(-n // bs) for n in lens]
    owned = {int(b) for s, n in enumerate(need) for b in p.block_tables[s, :n]}
    spare = np.array(sorted(set(range(p.key_cache.shape[0])) - owned), np.int32)
    assert len(spare) == 4  # poisoned whole blocks no sequence owns
    for s, n in enumerate(need):  # unused table entries name real (poisoned) blocks
        p.block_tables[s, n:] = rng.choice(spare, p.block_tables.shape[1] - n)
    ref = p.reference()
    for partition in ("never", "always", 64, "flat"):
        assert_close(run(p, partition), ref, tol(p), partition)


# ---- the int32 range ----------------------------------------------------------------------------


def test_context_of_2_pow_31_tokens(rng):
    """2,147,481,600 tokens (the largest multiple of 256 validation allows) in blocks of
    256, every table entry naming block 0: the softmax over n copies of one block equals
    the softmax over that block, so the float64 reference of block 0 alone is exact. The
    split-KV combine used to overflow int32 computing its partition count (all zeros)."""
    bs, n = 256, 2_147_481_600
    assert n % bs == 0 and n <= _checks.MAX_TOKENS
    p = make_problem(rng, lens=[bs], heads=1, kv_heads=1, head_size=32, block_size=bs,
                     spare_blocks=0)
    ref = p.reference()
    a = p.device_args()
    a["block_tables"] = cupy.zeros((1, n // bs), np.int32)
    a["context_lens"] = cupy.asarray([n], np.int32)
    # 32,768 partitions of 65,536 tokens: the combine's partition count used to overflow.
    out = poisoned((1, 1, 32), np.float16)
    cupaged.paged_attention(**a, out=out, partition=65536)
    assert_close(cupy.asnumpy(out), ref, tol(p))
    # "auto" picks fewer, longer partitions (about 680k tokens each here). Summing one
    # block's probabilities over and over in fp32 rounds the same way every time, so the
    # error grows with the partition instead of averaging out: 1.5e-3 was measured. This
    # case shows the result is no longer all zeros and stays within that drift.
    cupaged.paged_attention(**a, out=out, partition="auto")
    got = cupy.asnumpy(out).astype(np.float64)
    assert rel_err(got, ref) <= 5e-3, rel_err(got, ref)


def test_a_context_at_the_documented_limit(rng, prefill_split):
    """2,147,482,623 tokens (2^31 - 1025, the documented limit), blocks of one token, every
    entry naming block 0: decode over vLLM's layout, and the last two positions as
    multi-token queries over NHD (the prefill kernel, whose positions reach the limit).
    The softmax over n copies of one key is that key's value. Its values are small
    integers and the partitions 65,536 keys long, so every partition's sums and the
    merge's are exact in fp32: the test sees indexing, not rounding. (Sums over millions
    of equal weights do drift: with random values, 0.5% at a million keys per partition
    and about 3% at 5.4 million, measured; docs/PERFORMANCE.md.)"""
    n = _checks.MAX_TOKENS
    assert n == 2_147_482_623
    p = make_problem(rng, lens=[1], heads=1, kv_heads=1, head_size=32, block_size=1,
                     spare_blocks=0)
    p.value_cache[...] = rng.integers(-2, 3, p.value_cache.shape)
    ref = p.reference()  # that key's value
    a = p.device_args()
    a["block_tables"] = cupy.zeros((1, n), np.int32)  # 8.6 GB of table
    a["context_lens"] = cupy.asarray([n], np.int32)
    out = poisoned((1, 1, 32), np.float16)
    cupaged.paged_attention(**a, out=out, partition=65536)
    assert_close(cupy.asnumpy(out), ref, tol(p))
    kc, vc = testing.convert_layout(p.key_cache, p.value_cache, "vllm", "NHD")
    q = testing.random_normal((2, 1, 32), np.float16, rng)
    prefill_split(65536)
    got = cupaged.attention(cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc),
                            a["block_tables"], a["context_lens"],
                            cupy.asarray([0, 2], np.int32), kv_layout="NHD")
    assert_close(cupy.asnumpy(got), np.broadcast_to(ref, (2, 1, 32)), tol(p))
    del a


# ---- vLLM's v2 with half-precision scratch ------------------------------------------------------


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_v2_packs_several_partitions_into_a_half_precision_tmp_out(rng, dt):
    """A 16-bit tmp_out holds P // 2 float32 partials per head: with P = 16 and 1,500
    tokens the call splits into 6 partitions of 256 and packs their float32 rows there."""
    lens = [1500, 1400, 1300]
    p = make_problem(rng, dtype=DTYPES[dt], lens=lens, heads=8, kv_heads=2, head_size=128,
                     block_size=16)
    ref = p.reference(scale=0.1)
    a = p.device_args()
    P = 16
    out = poisoned((3, 8, 128), a["query"].dtype)
    es = poisoned((3, 8, P), np.float32)
    ml = poisoned((3, 8, P), np.float32)
    tmp = poisoned((3, 8, P, 128), a["query"].dtype)
    cupaged.paged_attention_v2(out, es, ml, tmp, a["query"], a["key_cache"], a["value_cache"],
                               2, 0.1, a["block_tables"], a["context_lens"], 16, 1500)
    assert_close(cupy.asnumpy(out), ref, tol(p))
    parts = 6  # ceil(1500 / ceil(1500 / (P // 2)) rounded up to 256 tokens)
    written = cupy.asnumpy(ml).reshape(-1)[: 3 * 8 * parts]
    assert np.isfinite(written).all()  # every partition of every head wrote its max
    assert np.isnan(cupy.asnumpy(ml).reshape(-1)[3 * 8 * parts:]).all()  # and no more


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_v2_keeps_its_float32_partials_inside_a_half_precision_tmp_out(rng, dt):
    """4,096 tokens with vLLM's P = ceil(4096 / 512) = 8: a 16-bit tmp_out holds only 4
    float32 partial rows per head, so the call must split into at most 4 partitions. The
    bytes after tmp_out (a guard region of NaN in the same allocation) stay untouched."""
    lens = [4096, 4000, 3000]
    p = make_problem(rng, dtype=DTYPES[dt], lens=lens, heads=8, kv_heads=2, head_size=128,
                     block_size=16)
    ref = p.reference(scale=0.1)
    a = p.device_args()
    P, hs = 8, 128
    qdt = a["query"].dtype
    out = poisoned((3, 8, hs), qdt)
    es = poisoned((3, 8, P), np.float32)
    ml = poisoned((3, 8, P), np.float32)
    n = 3 * 8 * P * hs
    buf = poisoned((2 * n,), qdt)  # tmp_out, then as many elements of guard
    tmp = buf[:n].reshape(3, 8, P, hs)
    cupaged.paged_attention_v2(out, es, ml, tmp, a["query"], a["key_cache"], a["value_cache"],
                               2, 0.1, a["block_tables"], a["context_lens"], 16, max(lens))
    assert_close(cupy.asnumpy(out), ref, tol(p))
    guard = cupy.asnumpy(buf[n:])
    assert np.isnan(guard.astype(np.float32)).all(), "partials written past tmp_out"
    assert np.isnan(cupy.asnumpy(ml).reshape(-1)[3 * 8 * 4:]).all()  # at most 4 partitions


# ---- CUPAGED_DEBUG reads on the launch stream ----------------------------------------------------


def test_debug_check_reads_the_tables_on_the_launch_stream(rng, monkeypatch):
    """The table is made valid by work queued on the (busy) launch stream: the debug check
    must wait for it, not read the stale table on another stream and raise."""
    from cupaged.bench.timing import Spin

    p = make_problem(rng, lens=[50, 20], heads=4, kv_heads=2, head_size=64, block_size=16)
    a = p.device_args()
    good = a["block_tables"].copy()
    a["block_tables"][0, 1] = -3
    cupaged.paged_attention(**{**a, "block_tables": good})  # kernels loaded beforehand
    monkeypatch.setattr(cupaged._checks, "DEBUG", True)
    side = cupy.cuda.Stream(non_blocking=True)
    spin = Spin(100_000)
    cupy.cuda.Device().synchronize()
    with side:
        spin()
        a["block_tables"][...] = good
    out = cupaged.paged_attention(**a, stream=side)
    side.synchronize()
    assert_close(cupy.asnumpy(out), p.reference(), tol(p))


# ---- empty batches ---------------------------------------------------------------------------------


def test_empty_batch_in_every_decode_entry_point(rng):
    """Zero sequences with the strides CuPy gives empty arrays, (0, 0, 0)."""
    p = make_problem(rng, lens=[3])
    a = p.device_args()
    q = cupy.zeros((0, 4, 64), np.float16)
    bt = cupy.zeros((0, 4), np.int32)
    cl = cupy.zeros((0,), np.int32)
    assert q.strides == (0, 0, 0)  # (what CuPy does; the point of the test)
    kc, vc = a["key_cache"], a["value_cache"]
    out = cupaged.paged_attention(q, kc, vc, bt, cl)
    assert out.shape == (0, 4, 64)
    for partition in ("never", "always"):
        assert cupaged.paged_attention(q, kc, vc, bt, cl, out=cupy.zeros((0, 4, 64), np.float16),
                                       partition=partition).shape == (0, 4, 64)
    o = cupy.zeros((0, 4, 64), np.float16)
    assert cupaged.paged_attention_v1(o, q, kc, vc, 2, 0.1, bt, cl, 16, 0) is o
    es, ml = cupy.zeros((0, 4, 2), np.float32), cupy.zeros((0, 4, 2), np.float32)
    tmp = cupy.zeros((0, 4, 2, 64), np.float16)
    assert cupaged.paged_attention_v2(o, es, ml, tmp, q, kc, vc, 2, 0.1, bt, cl, 16, 0) is o
    cupaged.check_block_tables(bt, cl, kc.shape[0], 16)
