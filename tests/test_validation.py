"""Every input check of paged_attention, on array metadata alone (no GPU needed)."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

import cupaged
from cupaged import _checks, _variants, decode, launch, planning, validation


class Fake:
    """What validation reads of a device array: dtype, shape, strides, pointer, device.
    Without ``ptr``, each Fake lies at an address of its own (2^32 bytes apart from every
    other's), as separate device arrays do."""

    _next = itertools.count()

    def __init__(self, a: np.ndarray, device: int = 0, ptr: int | None = None):
        if ptr is None:
            ptr = (1 << 40) + (next(Fake._next) << 32)
        self.dtype, self.shape, self.strides, self.ndim = a.dtype, a.shape, a.strides, a.ndim
        self.data = SimpleNamespace(ptr=ptr, device_id=device)
        self.flags = SimpleNamespace(c_contiguous=a.flags.c_contiguous)


def args(dtype=np.float16, seqs=3, heads=8, kv_heads=2, hs=64, bs=16, blocks=10, width=4):
    x = 16 // np.dtype(dtype).itemsize
    return dict(
        query=np.zeros((seqs, heads, hs), dtype),
        key_cache=np.zeros((blocks, kv_heads, hs // x, bs, x), dtype),
        value_cache=np.zeros((blocks, kv_heads, hs, bs), dtype),
        block_tables=np.zeros((seqs, width), np.int32),
        context_lens=np.zeros(seqs, np.int32),
        alibi_slopes=None,
        out=None,
    )


def validate(**a):
    fakes = {k: (None if v is None else (v if isinstance(v, Fake) else Fake(v))) for k, v in a.items()}
    return validation.validate_decode(fakes["query"], fakes["key_cache"], fakes["value_cache"],
                               fakes["block_tables"], fakes["context_lens"],
                               fakes["alibi_slopes"], fakes["out"])


def test_valid_problem_is_described():
    p = validate(**args())
    assert (p.num_seqs, p.num_heads, p.num_kv_heads, p.head_size, p.block_size) == (3, 8, 2, 64, 16)
    assert (p.num_blocks, p.max_blocks, p.dtype.name) == (10, 4, "f16")


def bad(**changes):
    a = args()
    a.update(changes)
    return a


@pytest.mark.parametrize("a, exc, match", [
    (bad(query=np.zeros((3, 8, 64), np.float64)), TypeError, "query dtype float64 is not supported"),
    (bad(key_cache=np.zeros((10, 2, 4, 16, 4), np.float32)), TypeError, "key_cache dtype float32 does not match"),
    (bad(query=np.zeros((3, 512), np.float16)), ValueError, r"query must be 3-D"),
    (bad(key_cache=np.zeros((10, 2, 64, 16), np.float16)), ValueError, r"key_cache must be 5-D .*head_size/8"),
    (bad(key_cache=np.zeros((10, 2, 8, 16, 4), np.float16)), ValueError, r"key_cache must be 5-D"),
    (bad(value_cache=np.zeros((10, 2, 64), np.float16)), ValueError, "value_cache must be 4-D"),
    (args(hs=36), ValueError, r"head_size 36 is not supported: expected a multiple of 8 from 32 to 256"),
    (args(hs=264), ValueError, "head_size 264 is not supported"),
    (bad(key_cache=np.zeros((10, 2, 4, 16, 8), np.float16)), ValueError, r"key_cache.shape\[2\] is 4, expected head_size/8 = 8"),
    (bad(value_cache=np.zeros((10, 2, 64, 8), np.float16)), ValueError, "value_cache shape .* does not match"),
    (args(bs=12), ValueError, "block_size 12 is not supported: expected a power of two from 1 to 256"),
    (args(bs=512), ValueError, "block_size 512 is not supported"),
    (args(heads=6, kv_heads=4), ValueError, r"num_heads \(6\) must be a positive multiple of num_kv_heads \(4\)"),
    (bad(block_tables=np.zeros((3, 4), np.int64)), TypeError, r"block_tables must be int32, got int64 .*astype\(cupy.int32\)"),
    (bad(block_tables=np.zeros((3, 4), np.float32)), TypeError, "block_tables must be int32, got float32"),
    (bad(context_lens=np.zeros(3, np.int64)), TypeError, "context_lens must be int32, got int64"),
    (bad(block_tables=np.zeros((2, 4), np.int32)), ValueError, r"block_tables must be \[num_seqs=3"),
    (bad(block_tables=np.zeros((3, 8), np.int32)[:, ::2]), ValueError, "block_tables' rows must be contiguous"),
    (bad(context_lens=np.zeros(4, np.int32)), ValueError, r"context_lens must be a contiguous \[num_seqs=3\]"),
    (bad(context_lens=np.zeros(6, np.int32)[::2]), ValueError, "context_lens must be a contiguous"),
    (bad(alibi_slopes=np.zeros(8, np.float64)), TypeError, "alibi_slopes must be float32"),
    (bad(alibi_slopes=np.zeros(7, np.float32)), ValueError, r"alibi_slopes must be a contiguous \[num_heads=8\]"),
    (bad(out=np.zeros((3, 8, 64), np.float32)), TypeError, "out dtype float32 does not match"),
    (bad(out=np.zeros((3, 8, 32), np.float16)), ValueError, r"out must be a C-contiguous array of shape \(3, 8, 64\)"),
    (bad(out=np.zeros((3, 16, 64), np.float16)[:, ::2]), ValueError, "out must be a C-contiguous"),
    (bad(query=np.zeros((3, 8, 128), np.float16)[:, :, ::2]), ValueError, "query's last dimension must be contiguous"),
    (bad(key_cache=np.zeros((10, 2, 8, 32, 8), np.float16)[:, :, :, ::2]), ValueError, "key_cache must be contiguous within a block"),
    (bad(value_cache=np.zeros((10, 2, 64, 32), np.float16)[..., :16]), ValueError, "value_cache must be contiguous within a block"),
])
def test_bad_input_is_named(a, exc, match):
    with pytest.raises(exc, match=match):
        validate(**a)


def test_table_wider_than_int32_tokens_is_refused():
    a = args()
    a["block_tables"] = Fake(a["block_tables"])
    a["block_tables"].shape = (3, 2**28)
    with pytest.raises(ValueError, match="tokens per sequence; at most"):
        validate(**a)


def test_misaligned_cache_is_refused():
    a = args()
    a["key_cache"] = Fake(a["key_cache"], ptr=(1 << 20) + 8)
    with pytest.raises(ValueError, match="key_cache must be 16-byte aligned"):
        validate(**a)


def test_arrays_on_different_devices_are_refused():
    a = args()
    a["value_cache"] = Fake(a["value_cache"], device=1)
    with pytest.raises(ValueError, match="value_cache is on device 1 but query is on device 0"):
        validate(**a)


def test_empty_tables_have_no_stride_requirements():
    a = args()
    a["block_tables"] = np.zeros((3, 0), np.int32)
    a["block_tables"] = np.lib.stride_tricks.as_strided(a["block_tables"], strides=(0, 0))
    assert validate(**a).max_blocks == 0


def test_query_rows_may_be_strided():
    a = args()
    a["query"] = np.zeros((3, 3 * 8 * 64), np.float16)[:, : 8 * 64].reshape(3, 8, 64)
    assert validate(**a).num_seqs == 3


@pytest.mark.parametrize("entry", ["paged_attention", "check_block_tables"])
def test_host_arrays_are_refused_before_any_work(entry):
    a = args()
    if entry == "paged_attention":
        call = lambda: cupaged.paged_attention(a["query"], a["key_cache"], a["value_cache"],
                                               a["block_tables"], a["context_lens"])
    else:
        call = lambda: cupaged.check_block_tables(a["block_tables"], a["context_lens"], 10, 16)
    with pytest.raises(TypeError, match="is a NumPy array .*needs a CUDA array"):
        call()


def test_other_objects_are_refused():
    with pytest.raises(TypeError, match=r"query must be a CUDA array \(cupy.ndarray, torch.Tensor or any __dlpack__ producer\), got list"):
        cupaged.paged_attention([[1.0]], None, None, None, None)


# An H100's 64x2 tiles: 3 CTAs per SM, or 2 held there by more shared memory.
KS = SimpleNamespace(slots=396, tile_tokens=64, sms=132, saturate=2, smem=66688,
                     fewer=(planning.Occupancy(2, 264, 115712),))


def _problem(**kw):
    return validate(**args(**kw))


@pytest.mark.parametrize("value, match", [
    (float("nan"), "scale must be finite"), (float("inf"), "scale must be finite"),
])
def test_scale_must_be_finite(value, match):
    with pytest.raises(ValueError, match=match):
        validation.softmax_scale(value, 64)


def test_max_context_len_checks():
    p = _problem()
    assert validation.max_context(None, p) == 4 * 16
    assert validation.max_context(30, p) == 30
    assert validation.max_context(10**6, p) == 64  # never more than the table can hold
    with pytest.raises(ValueError, match="max_context_len must be >= 0"):
        validation.max_context(-1, p)
    with pytest.raises(TypeError, match="max_context_len must be an int"):
        validation.max_context(3.5, p)


@pytest.mark.parametrize("partition, match", [
    (0, "positive multiple of block_size"), (24, r"positive multiple of block_size \(16\)"),
    ("sometimes", "partition must be 'auto', 'never', 'always', 'flat' or an int"),
    (True, "partition must be"),
])
def test_partition_checks(partition, match):
    with pytest.raises(ValueError, match=match):
        planning.partition_tokens(partition, _problem(), 64, 8, KS)


def test_too_many_partitions_are_refused():
    p = _problem(width=2**20, bs=1)
    with pytest.raises(ValueError, match="more than 65535 partitions"):
        planning.partition_tokens(1, p, 2**20, 8, KS)


def test_explicit_partition_and_never():
    p = _problem()
    assert planning.partition_tokens(32, p, 64, 8, KS)[0] == 32
    assert planning.partition_tokens("never", p, 64, 8, KS)[0] == 0
    assert planning.partition_tokens(32, p, 0, 8, KS) == (0, KS.smem)  # nothing to split


def test_auto_may_choose_a_single_pass():
    p = _problem()
    assert planning.partition_tokens("auto", p, 2048, 4096, KS) == (0, KS.smem)  # many waves
    assert planning.partition_tokens("always", p, 2048, 4096, KS)[0] > 0


@pytest.mark.parametrize("ctx", [planning.MAX_PASS_TOKENS + 1, 3 << 20, 16_000_000])
@pytest.mark.parametrize("ctas", [8, 4096])
def test_decode_passes_are_held_to_the_pass_limit(ctx, ctas):
    """A context longer than MAX_PASS_TOKENS gets passes of at most that many keys
    whatever the grid (4096 CTAs: the model alone runs one pass); "never" and an explicit
    partition are kept. (Fails without planning.cap_pass.)"""
    p = _problem(width=-(-ctx // 16))
    for partition in ("auto", "always"):
        size = planning.partition_tokens(partition, p, ctx, ctas, KS)[0]
        assert 0 < size <= planning.MAX_PASS_TOKENS and size % 64 == 0
    assert planning.partition_tokens("never", p, ctx, ctas, KS)[0] == 0
    assert planning.partition_tokens(1 << 20, p, ctx, ctas, KS)[0] == 1 << 20


def test_the_pass_cap_stays_within_its_scratch_and_fills_persistent_slots():
    cap, mb = planning.MAX_PASS_TOKENS, planning.CAP_SCRATCH_BYTES
    ctx = 16_000_000  # 62 passes of at most 2^18
    assert planning.cap_pass(0, cap, 64, 8, 128) == 0  # short enough: one pass kept
    assert planning.cap_pass(4096, ctx, 64, 8, 128) == 4096  # already short passes
    assert planning.partition_count(ctx, planning.cap_pass(0, ctx, 64, 8, 128)) == 62
    # partials of 8192 x 64 rows of 130 floats: 272 MB a partition, 3 fit the budget
    rows = 8192 * 64
    assert mb // (rows * 130 * 4) == 3
    assert planning.partition_count(ctx, planning.cap_pass(0, ctx, 64, rows, 128)) == 3
    # more than the budget holds already: the model's split is kept
    assert planning.cap_pass(ctx // 4, ctx, 64, rows, 128) == ctx // 4
    # a persistent grid of 132 slots: 62 -> 66 (each partition 2 CTAs); 153 -> 264
    assert planning.partition_count(ctx, planning.cap_pass(0, ctx, 64, 8, 128, 132)) == 66
    assert planning.slot_count(153, 132, 10**6) == 264
    assert planning.slot_count(45, 132, 10**6) == 66
    assert planning.slot_count(62, 132, 64) == 62  # neither fits the budget: as asked
    assert planning.slot_count(40, 132, 50) == 44


def test_prefill_passes_are_held_to_the_pass_limit():
    """The multi-token split: one long sequence's chunk beside rows that fill the grid
    (the model alone runs one pass) gets passes of at most MAX_PASS_TOKENS, counted to
    fill paged_prefill_sm90's slots; a workspace too small for them takes fewer."""
    ctx = 16_000_000
    p = _problem(width=-(-ctx // 16))
    k = planning.PrefillKernel(None, 0, 256, 64, 132)
    for sm90, want in ((False, 62), (True, 66)):
        choice = planning.Choice("prefill", 64, (), sm90)
        size, n = planning.prefill_split(k, p, choice, 128, ctx, _variants.PLAIN, None)
        assert n == want and size <= planning.MAX_PASS_TOKENS
    ws = SimpleNamespace(max_rows=p.num_rows * p.num_heads * 4)
    size, n = planning.prefill_split(k, p, planning.Choice("prefill", 64, (), True), 128, ctx,
                                     _variants.PLAIN, ws)
    assert n == 4


@pytest.mark.parametrize("ctas, ctx, want_parts", [
    (512, 2048, 3),      # 1.3 waves single pass: three partitions fill 4 waves almost fully
    (8, 131072, 49),     # batch 1, 8 KV heads: one wave of 392 CTAs
    (512, 8192, 3),      # the same at longer contexts
    (2048, 512, 1),      # 5.2 waves: a split would not pay for itself
    (4096, 2048, 1),     # many waves already: no split
])
def test_split_choice_follows_the_waves(ctas, ctx, want_parts):
    size = planning.split_tokens(ctas, ctx, 396, 64, 64, False)
    assert planning.partition_count(ctx, size) == want_parts


@pytest.mark.parametrize("ctas, ctx, want_parts", [
    (256, 1024, 1),      # 2 CTAs per SM in one wave already keep the SMs busy: no split
    (64, 4096, 4),       # 8/1 heads, batch 64: 2 per SM in one wave, not 3
    (8, 131072, 33),     # batch 1: one wave of 264 CTAs (2 per SM), not 392
    (512, 2048, 3),      # several waves: priced in whole waves, as without the SM count
    (2048, 512, 1),
])
def test_a_single_wave_is_priced_by_its_fullest_sm(ctas, ctx, want_parts):
    size = planning.split_tokens(ctas, ctx, 396, 64, 64, False, 132, 2.0)
    assert planning.partition_count(ctx, size) == want_parts
    # Without the SM count every wave costs a full one: the same grids split further.
    if want_parts < 8:
        old = planning.split_tokens(ctas, ctx, 396, 64, 64, False)
        assert planning.partition_count(ctx, old) >= want_parts


@pytest.mark.parametrize("ctas, ctx, want_parts, want_per_sm", [
    # 32/8 heads, batch 64: 1.29 waves at 3 per SM (split in 3 to fill 3.88 waves) but
    # 1.94 at 2 per SM: one long CTA per (sequence, KV head), as FlashInfer runs it.
    (512, 2048, 1, 2),
    (512, 8192, 1, 2),
    (2048, 2048, 1, 3),   # MHA batch 64: 7.8 waves at 2 per SM, staggered: stay at 3
    (2048, 512, 1, 3),    # batch 256: the same
    (1024, 4096, 3, 3),   # 3.9 waves at 2 per SM, more than two: split at 3 per SM
    (384, 2048, 1, 3),    # one wave at 3 per SM already
    (8, 131072, 33, 3),   # batch 1: one wave of 2 per SM either way; a tie keeps 3
])
def test_residency_is_chosen_with_the_split(ctas, ctx, want_parts, want_per_sm):
    size, occ = planning.split_and_residency(ctas, ctx, KS, 64, False)
    assert planning.partition_count(ctx, size) == want_parts
    assert occ.per_sm == want_per_sm
    smem = planning.partition_tokens("auto", _problem(), ctx, ctas, KS)[1]
    assert smem == occ.smem == (KS.smem if want_per_sm == 3 else KS.fewer[0].smem)


def test_fixed_partitions_get_a_residency_too():
    p = _problem()
    # A single pass of 512 CTAs: 2 waves at either residency, shorter ones at 2 per SM.
    assert planning.partition_tokens("never", p, 2048, 512, KS) == (0, KS.fewer[0].smem)
    assert planning.partition_tokens("never", p, 2048, 2048, KS) == (0, KS.smem)
    # Without lower residencies (a --ctas-per-sm override) the natural one.
    ks = SimpleNamespace(**{**vars(KS), "fewer": ()})
    assert planning.partition_tokens("never", p, 2048, 512, ks) == (0, KS.smem)
    assert planning.split_and_residency(512, 2048, ks, 64, False)[1].per_sm == 3


def _fake_device(monkeypatch, per_sm_of):
    """planning.decode_kernels on a fake H100 (132 SMs, 228 KiB per SM): no compile, no launch;
    ``per_sm_of(smem)`` the driver's occupancy at a dynamic shared memory size."""
    dev = planning.DeviceInfo(0, "sm_90", 132, 227 * 1024, 228 * 1024)
    monkeypatch.setattr(planning, "device_info", lambda device_id: dev)
    monkeypatch.setattr(planning, "combine_kernel", lambda *a: None)
    monkeypatch.setattr(planning.jit, "load", lambda spec, device_id, smem=0: object())
    monkeypatch.setattr(planning, "resident_ctas",
                        lambda device_id, kernel, threads, smem: per_sm_of(smem) * 132)
    planning.decode_kernels.cache_clear()


@pytest.mark.parametrize("per_sm, saturating, want", [
    (3, "f16", [2]),       # fp16 hs128: 64-token tiles, two in flight saturate
    (2, "f16", []),        # already at the saturating count
    (6, "e4m3", [4, 5]),   # fp8: half the bytes per tile, four saturate
    (3, "f16-regs", []),   # registers hold it at 3 whatever the shared memory
])
def test_kernels_offer_the_lower_residencies_the_driver_grants(monkeypatch, per_sm, saturating,
                                                               want):
    def per_sm_of(smem):
        if saturating == "f16-regs":
            return per_sm
        return min(per_sm, 228 * 1024 // (smem + 1024))
    _fake_device(monkeypatch, per_sm_of)
    cache = "e4m3" if saturating == "e4m3" else "f16"
    try:
        ks = planning.decode_kernels(0, "f16", 128, 16, 4, "tok", cache, "")
        assert ks.slots == per_sm * 132
        assert [o.per_sm for o in ks.fewer] == want
        for o in ks.fewer:
            assert o.slots == o.per_sm * 132 and o.smem > ks.smem
            assert per_sm_of(o.smem) == o.per_sm
        planning.set_tuning(None, 2)  # an override: that residency alone
        assert planning.decode_kernels(0, "f16", 128, 16, 4, "tok", cache, "").fewer == ()
    finally:
        planning.set_tuning()


def test_a_long_row_among_short_ones_gets_the_sms():
    """One long row's CTAs, at the model's split for a batch of such rows, leave most SMs
    idle when the batch's other rows are short: from SKEW_MIN_CTX on, the split takes more
    partitions, within SKEW_SLACK of the model's price for the batch. (Fails without
    planning.skew_split.)"""
    ctx, rows, per_row = 100_000, 4, 8
    p = _problem(seqs=rows, heads=64, kv_heads=8, hs=128, width=-(-ctx // 16))
    size, occ = planning.split_and_residency(rows * per_row, ctx, KS, 64, False)
    assert per_row * planning.partition_count(ctx, size) < KS.sms  # the model's: 64 CTAs
    got = planning.partition_tokens("auto", p, ctx, rows * per_row, KS)[0]
    assert per_row * planning.partition_count(ctx, got) >= KS.sms
    def price(s):  # at the residency the split runs at
        slots = planning.residency(rows * per_row * planning.partition_count(ctx, s), KS).slots
        return planning.split_cost_of(rows * per_row, ctx, s, slots, 64, 132, 2.0)

    assert price(got) <= planning.SKEW_SLACK * price(size)
    # a workspace's room bounds the count
    roomy = planning.partition_tokens("auto", p, ctx, rows * per_row, KS, room=12)[0]
    assert planning.partition_count(ctx, size) < planning.partition_count(ctx, roomy) <= 12
    # one row, or a context below SKEW_MIN_CTX: the model's split
    one = _problem(seqs=1, heads=64, kv_heads=8, hs=128, width=-(-ctx // 16))
    assert planning.partition_tokens("auto", one, ctx, per_row, KS)[0] == \
        planning.split_and_residency(per_row, ctx, KS, 64, False)[0]
    short = planning.SKEW_MIN_CTX - 64
    assert planning.partition_tokens("auto", p, short, rows * per_row, KS)[0] == \
        planning.split_and_residency(rows * per_row, short, KS, 64, False)[0]


def test_a_workspace_fit_chooses_the_residency_again(monkeypatch):
    # 32/8 heads, batch 20, ctx 2048: three partitions (480 CTAs, over one wave at 3 per
    # SM) at 2 per SM; a workspace with room for two leaves 320 CTAs, which 3 per SM hold
    # in one wave.
    ks = SimpleNamespace(**vars(KS), decode=None, combine=None, name="fake")
    monkeypatch.setattr(planning, "decode_kernels", lambda *a, **k: ks)
    p = validate(**args(seqs=20, heads=32, kv_heads=8, hs=128, bs=16, width=128))
    plan = planning.plan_decode(p, 2048, "auto", None)
    assert plan.grid[2] == 3 and plan.smem == KS.fewer[0].smem
    ws = launch.Partials(1, 2, 3, max_rows=20 * 32 * 2, counters=4, max_counters=20 * 8)
    plan = planning.plan_decode(p, 2048, "auto", ws)
    assert plan.grid[2] == 2 and plan.smem == KS.smem
    # One CTA per query row (attention's row mode, here one row per sequence): the same
    # split and residency as decode, reading query_start_loc.
    rows = planning.plan_decode(p, 2048, "auto", None, rows=True)
    assert rows.grid[2] == 3 and rows.smem == KS.fewer[0].smem and rows.kind == "rows"
    built = launch.build(None, None, p, rows, 0.1, True, 0, _variants.PLAIN, None)
    assert built.takes_starts
    plain = planning.plan_decode(p, 2048, "auto", None)
    assert not launch.build(None, None, p, plain, 0.1, True, 0, _variants.PLAIN, None).takes_starts


def test_always_splits_at_least_in_two():
    assert planning.split_tokens(4096, 2048, 396, 64, 64, True) > 0
    assert -(-2048 // planning.split_tokens(4096, 2048, 396, 64, 64, True)) >= 2
    assert planning.split_tokens(8, 40, 396, 64, 64, True) == 64  # shorter than a tile: one part


# ---- grid limits and scale ranges ------------------------------------------------------------


def test_more_query_heads_than_the_grid_allows_are_refused():
    a = args(heads=65536, kv_heads=1, hs=32, seqs=1)
    with pytest.raises(ValueError, match="num_heads is 65536; at most 65535"):
        validate(**a)


@pytest.mark.parametrize("value, exc, match", [
    (3e38, ValueError, "scale must be finite in float32"),
    (-1e39, ValueError, "scale must be finite in float32"),
    ("big", TypeError, "scale must be a number, got str"),
])
def test_scale_must_fit_float32(value, exc, match):
    with pytest.raises(exc, match=match):
        validation.softmax_scale(value, 64)


def test_partition_of_2_pow_31_tokens_is_a_value_error():
    with pytest.raises(ValueError, match="below 2\\^31"):
        planning.partition_tokens(2**31, _problem(), 64, 8, KS)


def _with_ptr(a, ptr):
    f = Fake(a)
    f.data = SimpleNamespace(ptr=ptr, device_id=0)
    return f


def test_out_partly_over_the_query_is_refused_exact_alias_is_not():
    a = args()
    base = 1 << 24
    a["query"] = _with_ptr(a["query"], base)
    a["out"] = _with_ptr(np.zeros((3, 8, 64), np.float16), base + 128)  # one head further
    with pytest.raises(ValueError, match="query and out overlap in memory"):
        validate(**a)
    a["out"] = _with_ptr(np.zeros((3, 8, 64), np.float16), base)  # in place: allowed
    assert validate(**a).num_seqs == 3
    a["out"] = _with_ptr(np.zeros((3, 8, 64), np.float16), base + 3 * 8 * 64 * 2)  # adjacent
    assert validate(**a).num_seqs == 3


def _zero_strides(shape, dtype):
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape,
                                           strides=(0,) * len(shape))


def test_empty_batch_with_any_strides_is_valid():
    """An empty array's strides are arbitrary (CuPy gives (0, 0, 0)): nothing is read
    through them, so an empty batch must validate whatever they are."""
    a = args()
    a["query"] = _zero_strides((0, 8, 64), np.float16)
    a["block_tables"] = _zero_strides((0, 4), np.int32)
    a["context_lens"] = _zero_strides((0,), np.int32)
    out = Fake(_zero_strides((0, 8, 64), np.float16))
    out.flags = SimpleNamespace(c_contiguous=False)
    a["out"] = out
    assert validate(**a).num_seqs == 0


def test_devices_older_than_sm80_are_refused_by_name(monkeypatch):
    import cupy

    props = {"major": 7, "minor": 5, "name": b"Tesla T4", "multiProcessorCount": 40,
             "sharedMemPerBlockOptin": 65536}
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", lambda i: props)
    planning.device_info.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"device 3 \(Tesla T4\) has compute capability "
                                               r"7\.5; cupaged's kernels need 8\.0 or newer"):
            planning.device_info(3)
    finally:
        planning.device_info.cache_clear()


@pytest.fixture
def v2_args(monkeypatch):
    """paged_attention_v2's scratch checks run before anything touches a GPU: Fakes pass
    through the array adapter unchanged."""
    monkeypatch.setattr(decode, "as_device_array", lambda x, name: x)
    monkeypatch.setattr(validation, "as_device_array", lambda x, name: x)
    a = {k: (None if v is None else Fake(v)) for k, v in args(seqs=2, heads=4).items()}
    base = 1 << 24
    a["out"] = _with_ptr(np.zeros((2, 4, 64), np.float16), base)
    a["exp_sums"] = _with_ptr(np.zeros((2, 4, 8), np.float32), base + 4096)
    a["max_logits"] = _with_ptr(np.zeros((2, 4, 8), np.float32), base + 8192)
    a["tmp_out"] = _with_ptr(np.zeros((2, 4, 8, 64), np.float16), base + 16384)
    return a


def _call_v2(a):
    return decode.paged_attention_v2(
        a["out"], a["exp_sums"], a["max_logits"], a["tmp_out"], a["query"], a["key_cache"],
        a["value_cache"], 2, 0.1, a["block_tables"], a["context_lens"], 16, 64)


def test_v2_half_precision_tmp_out_must_be_4_byte_aligned(v2_args):
    v2_args["tmp_out"] = _with_ptr(np.zeros((2, 4, 8, 64), np.float16), (1 << 24) + 16386)
    with pytest.raises(ValueError, match="tmp_out must start on a 4-byte boundary"):
        _call_v2(v2_args)


@pytest.mark.parametrize("name, other, offset", [
    ("max_logits", "exp_sums", 4096 + 32),   # inside exp_sums
    ("tmp_out", "max_logits", 8192),         # starts where max_logits does
    ("exp_sums", "out", 0),                  # over the output
])
def test_v2_scratch_arrays_must_not_overlap(v2_args, name, other, offset):
    a = v2_args
    a[name] = _with_ptr(np.zeros(a[name].shape, a[name].dtype), (1 << 24) + offset)
    with pytest.raises(ValueError, match=rf"({name} and {other}|{other} and {name}) overlap in memory"):
        _call_v2(a)


def test_empty_arrays_overlap_nothing():
    a = _with_ptr(np.zeros((2, 4, 8), np.float32), 1000)
    b = _with_ptr(np.zeros((2, 4, 0, 64), np.float16), 1016)  # inside a, but holds nothing
    _checks.check_disjoint((("a", a), ("b", b)))


def test_v2_never_asks_for_more_partitions_than_the_grid_holds(v2_args, monkeypatch):
    """vLLM sizes max_num_partitions as ceil(max_len / 512): at 40M tokens that is 78,125,
    more than a grid dimension holds; v2 must use fewer, larger partitions."""
    seen = {}
    monkeypatch.setattr(decode, "_run", lambda *a, **k: seen.setdefault("args", a))
    a = v2_args
    n = 78125
    a["block_tables"] = Fake(np.zeros((2, 1), np.int32))
    a["block_tables"].shape = (2, 40_000_000 // 16)
    a["exp_sums"] = _with_ptr(np.zeros((2, 4, n), np.float32), 1 << 30)
    a["max_logits"] = _with_ptr(np.zeros((2, 4, n), np.float32), 1 << 31)
    tmp = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(2, 4, n, 64),
                                          strides=(4 * n * 64 * 4, n * 64 * 4, 64 * 4, 4))
    a["tmp_out"] = _with_ptr(tmp, 1 << 32)
    decode.paged_attention_v2(
        a["out"], a["exp_sums"], a["max_logits"], a["tmp_out"], a["query"], a["key_cache"],
        a["value_cache"], 2, 0.1, a["block_tables"], a["context_lens"], 16, 40_000_000)
    partition, workspace = seen["args"][9], seen["args"][11]
    assert -(-40_000_000 // partition) <= 65535
    assert workspace.max_rows == 2 * 4 * 65535


def test_a_cache_layout_that_passed_is_remembered_by_its_metadata_only():
    """check_kv_layout remembers a pass by shapes, strides, dtypes and 16-byte alignment:
    the same metadata at other pointers is served from memory, a misaligned pointer or
    other strides are checked again (and fail), and a failure is never remembered."""
    from cupaged import _checks, _dtypes

    _checks._LAYOUT_PASSED.clear()
    k = np.zeros((10, 2, 8, 16, 8), np.float16)
    v = np.zeros((10, 2, 64, 16), np.float16)
    first = _checks.check_kv_layout(Fake(k), Fake(v), _dtypes.F16, "vllm")
    assert len(_checks._LAYOUT_PASSED) == 1
    again = _checks.check_kv_layout(Fake(k, ptr=1 << 24), Fake(v, ptr=1 << 25), _dtypes.F16, "vllm")
    assert again is first and len(_checks._LAYOUT_PASSED) == 1
    odd_stride = Fake(k)
    odd_stride.strides = (k.strides[0] + 2,) + k.strides[1:]
    for bad in (Fake(k, ptr=(1 << 24) + 8), odd_stride):
        with pytest.raises(ValueError, match="16-byte aligned"):
            _checks.check_kv_layout(bad, Fake(v), _dtypes.F16, "vllm")
    assert len(_checks._LAYOUT_PASSED) == 1
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        _checks.check_kv_layout(Fake(k), Fake(v), _dtypes.F16, ["vllm"])


def _odd_strides(dtype, shape, strides):
    """A NumPy view with byte strides that are not whole elements (as_strided allows it)."""
    base = np.zeros(int(np.prod(shape)) * 4 + 64, dtype)
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)


def test_strides_must_be_whole_elements():
    """The kernels take strides in elements; a byte stride between elements would be
    rounded down, reading the wrong rows."""
    with pytest.raises(ValueError, match="query's strides must be multiples of its itemsize"):
        validate(**bad(query=_odd_strides(np.float16, (3, 8, 64), (8 * 64 * 2 + 1, 128, 2))))
    with pytest.raises(ValueError, match="block_tables' rows must be contiguous, a whole number"):
        validate(**bad(block_tables=_odd_strides(np.int32, (3, 4), (18, 4))))


# ---- the documented context limit ------------------------------------------------------------


DOCUMENTED_MAX_TOKENS = 2_147_482_623  # README's support matrix: 2^31 - 1025


def _table(width: int) -> Fake:
    """A [1, width] int32 block table's metadata (no memory behind it)."""
    t = Fake(np.zeros((1, 1), np.int32))
    t.shape, t.strides = (1, width), (4 * width, 4)
    return t


@pytest.mark.parametrize("bs", [1, 16, 256])
def test_the_documented_context_limit_is_where_validation_stops(bs):
    """A table of ``width * block_size`` tokens up to the documented limit passes, one
    block more fails, for paged_attention and attention alike."""
    from test_varlen_validation import vargs, vvalidate

    assert _checks.MAX_TOKENS == DOCUMENTED_MAX_TOKENS == 2**31 - 1025
    widest = DOCUMENTED_MAX_TOKENS // bs
    a = args(seqs=1, bs=bs)
    p = validate(**{**a, "block_tables": _table(widest)})
    assert p.max_blocks * p.block_size <= DOCUMENTED_MAX_TOKENS < (p.max_blocks + 1) * bs
    with pytest.raises(ValueError, match=rf"block_tables allows {(widest + 1) * bs} tokens per "
                                         rf"sequence; at most {DOCUMENTED_MAX_TOKENS} are supported"):
        validate(**{**a, "block_tables": _table(widest + 1)})
    v = vargs(seqs=1, total_q=1, bs=bs)
    assert vvalidate(**{**v, "block_tables": _table(widest)}).max_blocks == widest
    with pytest.raises(ValueError, match=f"at most {DOCUMENTED_MAX_TOKENS} are supported"):
        vvalidate(**{**v, "block_tables": _table(widest + 1)})


def test_auto_takes_the_flat_split_from_as_many_units_as_resident_ctas(monkeypatch):
    """planning.flat_pays: at least as many (sequence, head tile) units as resident CTAs,
    each of two tiles or more, and runs within MAX_PASS_TOKENS; plan_flat: one wave of
    CTAs at the natural residency, two partial slots a CTA per head tile, a counter a unit,
    and the grid split where a workspace lacks the room."""
    assert planning.flat_pays(2048, 2048, KS)  # 32/32 heads, batch 64
    assert planning.flat_pays(396, 2048, KS)
    assert not planning.flat_pays(395, 2048, KS)
    assert not planning.flat_pays(4096, 64, KS)  # one tile a unit: nothing to even out
    assert planning.flat_pays(4096, 65, KS)
    assert not planning.flat_pays(396, planning.MAX_PASS_TOKENS + 64, KS)  # a run too long
    assert planning.flat_pays(2048, 2048, KS, planning.FLAT_MAX_ROWS)
    assert not planning.flat_pays(2048 * 16, 2048, KS, planning.FLAT_MAX_ROWS + 1)
    ks = SimpleNamespace(**vars(KS), decode=None, combine=None, name="fake")
    monkeypatch.setattr(planning, "decode_kernels", lambda *a, **k: ks)
    p = validate(**args(seqs=64, heads=32, kv_heads=32, hs=128, bs=16, width=128))
    plan = planning.plan_decode(p, 2048, "auto", None)
    assert plan.grid == (396, 1, 1) and plan.split_tokens == -64 and plan.smem == KS.smem
    assert (plan.partial_rows, plan.counters) == (2 * 396, 64 * 32)
    built = launch.build(None, None, p, plan, 0.1, True, 0, _variants.PLAIN, None)
    assert built.split and built.scratch_rows == 2 * 396 and built.counters == 64 * 32
    # Row mode too: its rows, each finding its sequence in query_start_loc.
    in_rows = planning.plan_decode(p, 2048, "auto", None, rows=True)
    assert (in_rows.kind, in_rows.grid, in_rows.split_tokens) == ("rows", (396, 1, 1), -64)
    assert launch.build(None, None, p, in_rows, 0.1, True, 0, _variants.PLAIN, None).takes_starts
    assert planning.plan_decode(p, 2048, "never", None).split_tokens == 0
    small = launch.Partials(1, 2, 3, max_rows=2 * 396 - 1, counters=4, max_counters=10**6)
    assert planning.plan_decode(p, 2048, "flat", small).split_tokens >= 0
    roomy = launch.Partials(1, 2, 3, max_rows=2 * 396, counters=4, max_counters=64 * 32)
    assert planning.plan_decode(p, 2048, "flat", roomy).split_tokens == -64
    few = validate(**args(seqs=8, heads=32, kv_heads=8, hs=128, bs=16, width=128))
    assert planning.plan_decode(few, 2048, "auto", None).split_tokens >= 0
    assert planning.plan_decode(few, 2048, "flat", None).grid == (396, 1, 1)
    # A flat specialization that holds fewer CTAs at once: "auto" keeps the grid split.
    lower = SimpleNamespace(**{**vars(ks), "slots": 264})
    monkeypatch.setattr(planning, "decode_kernels",
                        lambda *a, **k: lower if a[-1].endswith("r") else ks)
    assert planning.plan_decode(p, 2048, "auto", None).split_tokens >= 0
    assert planning.plan_decode(p, 2048, "flat", None).grid == (264, 1, 1)


def test_auto_takes_the_flat_split_without_a_workspace_only_over_enough_bytes(monkeypatch):
    """Without a workspace the flat split's partials are a scratch of each call's own
    (an allocation and a memset: about 8 us of host time a call on the H200's host, where
    a single pass needs none), so "auto" takes it there only where the keys read take the
    GPU long enough to hide that (planning.FLAT_SCRATCH_MIN_BYTES); with a workspace it
    needs no such size, and "flat" forces it anyway."""
    ks = SimpleNamespace(**vars(KS), decode=None, combine=None, name="fake")
    monkeypatch.setattr(planning, "decode_kernels", lambda *a, **k: ks)
    roomy = launch.Partials(1, 2, 3, max_rows=10**6, counters=4, max_counters=10**6)
    # 64 sequences, 32/8 heads, fp16: 8 KV heads x 128 dims x 2 (K, V) x 2 bytes a token
    p = validate(**args(seqs=64, heads=32, kv_heads=8, hs=128, bs=16, width=256))
    per_ctx = 64 * 8 * 128 * 2 * 2
    small = planning.FLAT_SCRATCH_MIN_BYTES // per_ctx - 64  # over a few tiles, too few bytes
    assert small > 2 * KS.tile_tokens
    assert planning.plan_decode(p, small, "auto", None).split_tokens >= 0
    assert planning.plan_decode(p, small, "auto", roomy).split_tokens == -64
    assert planning.plan_decode(p, small, "flat", None).split_tokens == -64
    big = -(-planning.FLAT_SCRATCH_MIN_BYTES // per_ctx)
    assert planning.plan_decode(p, big, "auto", None).split_tokens == -64


@pytest.mark.parametrize("cfg", [(100, 32, 1, 128, 2048), (200, 32, 1, 64, 2048)])
def test_under_the_byte_rule_the_flat_split_stays_where_the_grid_split_splits(cfg):
    """FLAT_SCRATCH_MIN_BYTES declines the flat split only for a plan that then needs no
    scratch: where the grid split would split as well (few long sequences), its partials
    are a scratch of the call's own too, so the flat split keeps the call (stubbed H200:
    cupaged.attention's launches, a memset of merge counters marking a scratch)."""
    cupy = pytest.importorskip("cupy")  # noqa: F841
    from cupaged import _prepared
    from cupaged.bench.stub import stubbed_driver

    seqs, heads, kv_heads, hs, ctx = cfg
    assert 2 * seqs * kv_heads * ctx * hs * 2 < planning.FLAT_SCRATCH_MIN_BYTES
    _prepared.clear()
    try:
        with stubbed_driver(record=True) as s:
            f = s.fake
            q = f((seqs, heads, hs), np.float16)
            kc = f((seqs * ctx // 16 + 8, 16, kv_heads, hs), np.float16)
            cupaged.attention(q, kc, f(kc.shape, np.float16), f((seqs, ctx // 16), np.int32),
                              f((seqs,), np.int32), max_seq_len=ctx,
                              out=f(q.shape, np.float16))
            names = [x[0] for x in s.launches]
    finally:
        _prepared.clear()
    kernel = [n for n in names if n != "memset"]
    assert "_r_" in kernel[0] or "memset" not in names, names
