"""mla_attention's input checks (validation.validate_mla, and those mla_attention makes
itself), on array metadata alone (no GPU needed): the accepted forms of the query and the
cache and what a checked call is described by, then every refusal, which names the array at
fault and what was expected."""

import numpy as np
import pytest

import cupaged
from cupaged import _arrays, _checks, _dtypes, mla, validation
from test_cache_ops import fake_view
from test_validation import Fake

RANK, ROPE = 512, 64
F16, BF16 = np.dtype(np.float16), _dtypes.BF16.numpy
# Each array its own address (16-byte aligned, far enough apart never to overlap), so that
# only a test that means to make two arrays overlap does.
BASES = {name: (i + 1) << 24 for i, name in enumerate(
    ("q", "q_pe", "kv_cache", "k_pe_cache", "block_tables", "seq_lens", "query_start_loc",
     "out", "lse"))}


def fake(a, name, shift=0, device=0):
    """``a`` as a device array at ``name``'s address, ``shift`` bytes past it."""
    return Fake(a, device=device, ptr=BASES[name] + shift)


def margs(q="combined", cache="combined", rows=5, heads=16, seqs=2, bs=16, nb=10, width=4,
          starts=True, out=False, lse=False, dtype=F16):
    """validate_mla's arguments as host arrays: q combined [rows, heads, 576] or the pair
    (q_nope, q_pe); the cache combined [nb, bs, 576] or the pair (kv_cache, k_pe_cache);
    query_start_loc when ``starts`` (else rows must equal seqs)."""
    qa = (np.zeros((rows, heads, RANK + ROPE), dtype) if q == "combined" else
          (np.zeros((rows, heads, RANK), dtype), np.zeros((rows, heads, ROPE), dtype)))
    return dict(
        q=qa,
        kv_cache=np.zeros((nb, bs, RANK + ROPE if cache == "combined" else RANK), dtype),
        k_pe_cache=None if cache == "combined" else np.zeros((nb, bs, ROPE), dtype),
        block_tables=np.zeros((seqs, width), np.int32),
        seq_lens=np.zeros(seqs, np.int32),
        query_start_loc=np.zeros(seqs + 1, np.int32) if starts else None,
        out=np.zeros((rows, heads, RANK), dtype) if out else None,
        lse=np.zeros((rows, heads), np.float32) if lse else None,
        kv_lora_rank=None, kv_cache_dtype="auto")


def mbad(q_form="combined", cache_form="combined", **changes):
    """margs of those forms (with out and lse) and ``changes``."""
    a = margs(q_form, cache_form, out=True, lse=True)
    a.update(changes)
    return a


def adapt(a):
    """The arrays of ``a`` as Fakes (each at its own address unless already a Fake)."""
    f = {k: (fake(v, k) if isinstance(v, np.ndarray) else v) for k, v in a.items()}
    if isinstance(a["q"], tuple):
        f["q"] = tuple(x if isinstance(x, Fake) else fake(x, n)
                       for x, n in zip(a["q"], ("q", "q_pe")))
    return f


def part(a, name):
    """The array ``name`` of ``a``: q (q_nope of a pair), q_pe, or any other argument."""
    if isinstance(a["q"], tuple) and name in ("q", "q_pe"):
        return a["q"][name == "q_pe"]
    return a[name]


def with_part(a, name, value):
    """``a`` with its array ``name`` (as for :func:`part`) replaced by ``value``."""
    if isinstance(a["q"], tuple) and name in ("q", "q_pe"):
        q = list(a["q"])
        q[name == "q_pe"] = value
        return dict(a, q=tuple(q))
    return dict(a, **{name: value})


def mvalidate(**a):
    f = adapt(a)
    return validation.validate_mla(f["q"], f["kv_cache"], f["k_pe_cache"], f["block_tables"],
                                   f["seq_lens"], f["query_start_loc"], f["out"], f["lse"],
                                   f["kv_lora_rank"], f["kv_cache_dtype"])


def refused(a, exc, match):
    with pytest.raises(exc, match=match):
        mvalidate(**a)


# ---- accepted forms -----------------------------------------------------------------------


@pytest.mark.parametrize("q_form", ["combined", "pair"])
@pytest.mark.parametrize("cache_form", ["combined", "pair"])
def test_both_query_and_cache_forms_are_described(q_form, cache_form):
    p = mvalidate(**margs(q_form, cache_form, out=True, lse=True))
    assert (p.device, p.dtype.name, p.num_seqs, p.num_rows, p.num_heads) == (0, "f16", 2, 5, 16)
    assert (p.rank, p.rope, p.block_size, p.num_blocks, p.max_blocks, p.bt_stride) == (
        512, 64, 16, 10, 4, 4)
    # heads and block_size are both 16: the same leading stride for q and the cache
    for form, parts, offsets, strides, names in (
            (q_form, p.q_parts, p.q_offsets, p.q_strides, ("q", "q_pe")),
            (cache_form, p.c_parts, p.c_offsets, p.c_strides, ("kv_cache", "k_pe_cache"))):
        if form == "combined":  # one array: the rope part RANK elements in
            assert parts[0] is parts[1] and offsets == (0, 512)
            assert strides == (16 * 576, 576, 16 * 576, 576)
        else:
            assert tuple(a.data.ptr for a in parts) == tuple(BASES[n] for n in names)
            assert offsets == (0, 0) and strides == (16 * 512, 512, 16 * 64, 64)


def test_bfloat16_and_decode_without_query_start_loc():
    p = mvalidate(**margs(rows=3, seqs=3, starts=False, dtype=BF16))
    assert (p.dtype.name, p.num_seqs, p.num_rows) == ("bf16", 3, 3)


def test_cache_pair_may_be_views_of_one_combined_allocation():
    """kv_c and k_pe read from vLLM's combined cache (inputs may share memory)."""
    buf = np.zeros((10, 16, RANK + ROPE), F16)
    kv, kpe = fake_view(buf[..., :RANK], buf, BASES["kv_cache"]), fake_view(
        buf[..., RANK:], buf, BASES["kv_cache"])
    p = mvalidate(**mbad(kv_cache=kv, k_pe_cache=kpe, kv_lora_rank=512))
    assert p.c_parts[1].data.ptr == BASES["kv_cache"] + 2 * RANK and p.c_offsets == (0, 0)
    assert p.c_strides == (16 * 576, 576, 16 * 576, 576)


def test_strided_queries_are_read_in_place():
    """q as a slice of a wider [total_q, heads, 1024] buffer, and the pair as two slices of
    one."""
    buf = np.zeros((5, 16, 1024), F16)
    p = mvalidate(**mbad(q=fake_view(buf[..., :RANK + ROPE], buf, BASES["q"])))
    assert p.q_strides == (16 * 1024, 1024, 16 * 1024, 1024) and p.q_offsets == (0, 512)
    pair = (fake_view(buf[..., :RANK], buf, BASES["q"]),
            fake_view(buf[..., RANK:RANK + ROPE], buf, BASES["q"]))
    p = mvalidate(**mbad("pair", q=pair))
    assert p.q_strides == (16 * 1024, 1024, 16 * 1024, 1024) and p.q_offsets == (0, 0)
    assert p.q_parts[1].data.ptr == BASES["q"] + 2 * RANK


@pytest.mark.parametrize("bs", _checks.BLOCK_SIZES)
@pytest.mark.parametrize("cache_form", ["combined", "pair"])
def test_every_power_of_two_block_size_is_accepted(bs, cache_form):
    p = mvalidate(**margs(cache=cache_form, bs=bs))
    assert p.block_size == bs and p.max_blocks == 4


def test_empty_batch_is_accepted():
    p = mvalidate(**margs(rows=0, seqs=0, out=True, lse=True))
    assert (p.num_seqs, p.num_rows, p.num_heads) == (0, 0, 16)


# ---- refusals -------------------------------------------------------------------------------


def _strided(shape, width, dtype=F16, step=None):
    """A view of shape ``shape`` into rows of ``width`` elements (``step``: every step-th
    element of them instead)."""
    buf = np.zeros((*shape[:-1], width), dtype)
    return buf[..., ::step] if step else buf[..., :shape[-1]]


@pytest.mark.parametrize("a, exc, match", [
    # dtypes
    (mbad(q=np.zeros((5, 16, 576), np.float32)), TypeError,
     "q dtype float32 is not supported: expected float16 or bfloat16"),
    (mbad("pair", q=(np.zeros((5, 16, 512), np.float32), np.zeros((5, 16, 64), np.float32))),
     TypeError, "q_nope dtype float32 is not supported: expected float16 or bfloat16"),
    (mbad("pair", q=(np.zeros((5, 16, 512), F16), np.zeros((5, 16, 64), BF16))), TypeError,
     "q_pe dtype bfloat16 does not match q_nope dtype float16"),
    (mbad(kv_cache=np.zeros((10, 16, 576), BF16)), TypeError,
     "kv_cache dtype bfloat16 does not match the query's float16"),
    (mbad(cache_form="pair", k_pe_cache=np.zeros((10, 16, 64), BF16)), TypeError,
     "k_pe_cache dtype bfloat16 does not match the query's float16"),
    (mbad(kv_cache=np.zeros((10, 16, 576), np.uint8)), TypeError,
     r"kv_cache is uint8: name its fp8 format with kv_cache_dtype='fp8_e4m3' or 'fp8_e5m2'"),
    (mbad(kv_cache_dtype="fp8"), TypeError,
     "kv_cache dtype float16 cannot hold fp8 e4m3: expected a 1-byte dtype"),
    (mbad(kv_cache_dtype="fp9"), ValueError, "kv_cache_dtype must be 'auto', 'fp8'"),
    (mbad(cache_form="pair", kv_cache=np.zeros((10, 16, 512), np.uint8),
          k_pe_cache=np.zeros((10, 16, 64), F16), kv_cache_dtype="fp8"), TypeError,
     "k_pe_cache dtype float16 cannot hold fp8 e4m3"),
    (mbad(cache_form="pair", kv_cache=np.zeros((10, 16, 512), np.uint8),
          k_pe_cache=np.zeros((10, 16, 64), np.int8), kv_cache_dtype="fp8"), TypeError,
     "k_pe_cache dtype int8 does not match kv_cache's uint8"),
    # the cache's shape, rank and rope
    (mbad(kv_cache=np.zeros((10, 16 * 576), F16)), ValueError,
     r"kv_cache must be 3-D \[num_blocks, block_size, kv_lora_rank \+ rope_dim\].*\(10, 9216\)"),
    (mbad(kv_cache=np.zeros((10, 16, 1, 576), F16)), ValueError, "kv_cache must be 3-D"),
    (mbad(cache_form="pair", k_pe_cache=np.zeros((10, 8, 64), F16)), ValueError,
     r"k_pe_cache must be \[num_blocks=10, block_size=16, rope_dim\], got shape \(10, 8, 64\)"),
    (mbad(cache_form="pair", k_pe_cache=np.zeros((9, 16, 64), F16)), ValueError,
     r"k_pe_cache must be \[num_blocks=10, .*got shape \(9, 16, 64\)"),
    (mbad(cache_form="pair", k_pe_cache=np.zeros((10 * 16, 64), F16)), ValueError,
     "k_pe_cache must be"),
    (mbad(cache_form="pair", kv_lora_rank=448), ValueError,
     "kv_lora_rank 448 does not match kv_cache's last dimension 512"),
    (mbad(kv_cache=np.zeros((10, 16, 544), F16)), ValueError,
     r"kv_lora_rank 512 with rope_dim 32 is not supported: .*built for kv_lora_rank \(512,\) "
     r"and rope_dim \(64,\)"),
    (mbad(kv_lora_rank=256), ValueError, "kv_lora_rank 256 with rope_dim 320 is not supported"),
    (mbad(cache_form="pair", kv_cache=np.zeros((10, 16, 256), F16)), ValueError,
     "kv_lora_rank 256 with rope_dim 64 is not supported"),
    (mbad(cache_form="pair", k_pe_cache=np.zeros((10, 16, 32), F16)), ValueError,
     "kv_lora_rank 512 with rope_dim 32 is not supported"),
    (mbad(cache_form="pair", kv_cache=np.zeros((10, 16, 576), F16)), ValueError,
     "kv_lora_rank 576 with rope_dim 64 is not supported"),
    (mbad(kv_cache=np.zeros((10, 3, 576), F16)), ValueError,
     "block_size 3 is not supported: expected a power of two from 1 to 256"),
    (mbad(kv_cache=np.zeros((2, 512, 576), F16)), ValueError, "block_size 512 is not supported"),
    (mbad(cache_form="pair", kv_cache=np.zeros((10, 0, 512), F16),
          k_pe_cache=np.zeros((10, 0, 64), F16)), ValueError, "block_size 0 is not supported"),
    # the query's shape
    (mbad(q=np.zeros((5, 16 * 576), F16)), ValueError,
     r"q must be 3-D \[total_q, num_heads, ...\], got shape \(5, 9216\)"),
    (mbad(q=np.zeros((5, 16, 512), F16)), ValueError,
     r"q's last dimension \(512\) must be kv_lora_rank \+ rope_dim \(512 \+ 64\)"),
    (mbad(q=np.zeros((5, 16, 640), F16)), ValueError, r"q's last dimension \(640\) must be"),
    (mbad("pair", q=(np.zeros((5, 16 * 512), F16), np.zeros((5, 16, 64), F16))), ValueError,
     r"q_nope must be 3-D \[total_q, num_heads, ...\]"),
    (mbad("pair", q=(np.zeros((5, 16, 576), F16), np.zeros((5, 16, 64), F16))), ValueError,
     r"q_nope and q_pe must be \[total_q, num_heads, 512\] and \[.., 64\] .*\(5, 16, 576\)"),
    (mbad("pair", q=(np.zeros((5, 16, 512), F16), np.zeros((5, 16, 32), F16))), ValueError,
     r"q_nope and q_pe must be .*got shapes \(5, 16, 512\) and \(5, 16, 32\)"),
    (mbad("pair", q=(np.zeros((5, 16, 512), F16), np.zeros((5, 8, 64), F16))), ValueError,
     r"q_nope and q_pe must be .*\(5, 8, 64\)"),
    (mbad("pair", q=(np.zeros((5, 16, 512), F16), np.zeros((4, 16, 64), F16))), ValueError,
     r"q_nope and q_pe must be .*\(4, 16, 64\)"),
    (mbad(q=np.zeros((5, 0, 576), F16)), ValueError, "q must have at least one head"),
    (mbad("pair", q=(np.zeros((5, 0, 512), F16), np.zeros((5, 0, 64), F16))), ValueError,
     "at least one head"),
    # the query's and cache's strides
    (mbad(q=_strided((5, 16, 576), 1152, step=2)), ValueError,
     r"q's last dimension must be contiguous \(strides \(36864, 2304, 4\)\)"),
    (mbad("pair", q=(_strided((5, 16, 512), 1024, step=2), np.zeros((5, 16, 64), F16))),
     ValueError, "q_nope's last dimension must be contiguous"),
    (mbad("pair", q=(np.zeros((5, 16, 512), F16), _strided((5, 16, 64), 128, step=2))),
     ValueError, "q_pe's last dimension must be contiguous"),
    (mbad(kv_cache=_strided((10, 16, 576), 1152, step=2)), ValueError,
     "kv_cache's last dimension must be contiguous"),
    (mbad(cache_form="pair", k_pe_cache=_strided((10, 16, 64), 128, step=2)), ValueError,
     "k_pe_cache's last dimension must be contiguous"),
    (mbad(q=_strided((5, 16, 576), 580)), ValueError,
     r"q's strides must be multiples of 16 bytes .*got \(18560, 1160, 2\)"),
    (mbad("pair", q=(_strided((5, 16, 512), 516), np.zeros((5, 16, 64), F16))), ValueError,
     "q_nope's strides must be multiples of 16 bytes"),
    (mbad("pair", q=(np.zeros((5, 16, 512), F16), _strided((5, 16, 64), 68))), ValueError,
     "q_pe's strides must be multiples of 16 bytes"),
    (mbad(kv_cache=_strided((10, 16, 576), 580)), ValueError,
     "kv_cache's strides must be multiples of 16 bytes"),
    (mbad(cache_form="pair", kv_cache=_strided((10, 16, 512), 516)), ValueError,
     "kv_cache's strides must be multiples of 16 bytes"),
    (mbad(cache_form="pair", k_pe_cache=_strided((10, 16, 64), 68)), ValueError,
     "k_pe_cache's strides must be multiples of 16 bytes"),
    # the tables
    (mbad(block_tables=np.zeros(8, np.int32)), ValueError,
     r"block_tables must be 2-D \[num_seqs, max_blocks_per_seq\], got shape \(8,\)"),
    (mbad(block_tables=np.zeros((2, 4), np.int64)), TypeError,
     r"block_tables must be int32, got int64 .*astype\(cupy.int32\)"),
    (mbad(block_tables=np.zeros((2, 8), np.int32)[:, ::2]), ValueError,
     "block_tables' rows must be contiguous"),
    (mbad(seq_lens=np.zeros(2, np.int64)), TypeError, "seq_lens must be int32, got int64"),
    (mbad(seq_lens=np.zeros((2, 1), np.int32)), ValueError,
     r"seq_lens must be a contiguous \[num_seqs=2\] array, got shape \(2, 1\)" \
     r" \(num_seqs: the rows of block_tables"),
    (mbad(seq_lens=np.zeros(4, np.int32)[::2]), ValueError,
     r"seq_lens must be a contiguous \[num_seqs=2\] array"),
    (mbad(query_start_loc=np.zeros(2, np.int32)), ValueError,
     r"query_start_loc must be a contiguous \[num_seqs \+ 1 = 3\] array, got shape \(2,\)"),
    (mbad(query_start_loc=np.zeros(6, np.int32)[::2]), ValueError,
     "query_start_loc must be a contiguous"),
    (mbad(query_start_loc=np.zeros(3, np.int64)), TypeError,
     "query_start_loc must be int32, got int64"),
    (mbad(query_start_loc=None), ValueError,
     "q has 5 rows but there are 2 sequences: without query_start_loc each sequence has "
     "exactly one query token"),
    (mbad(query_start_loc=None, block_tables=np.zeros((3, 4), np.int32),
          seq_lens=np.zeros(3, np.int32)), ValueError, "q has 5 rows but there are 3 sequences"),
    # out and lse
    (mbad(out=np.zeros((5, 16, 512), BF16)), TypeError,
     "out dtype bfloat16 does not match q's float16"),
    (mbad(out=np.zeros((5, 16, 512), np.float32)), TypeError, "out dtype float32 does not match"),
    (mbad(out=np.zeros((5, 16, 576), F16)), ValueError,
     r"out must be a C-contiguous array of shape \(5, 16, 512\), got shape \(5, 16, 576\)"),
    (mbad(out=np.zeros((5, 8, 512), F16)), ValueError, r"out must be .*got shape \(5, 8, 512\)"),
    (mbad(out=_strided((5, 16, 512), 1024)), ValueError,
     r"out must be a C-contiguous array of shape \(5, 16, 512\), got shape \(5, 16, 512\) with "
     r"strides \(32768, 2048, 2\)"),
    (mbad(lse=np.zeros((5, 16), F16)), TypeError, "lse must be float32, got float16"),
    (mbad(lse=np.zeros((5, 8), np.float32)), ValueError,
     r"lse must be a C-contiguous float32 array of shape \(5, 16\), got shape \(5, 8\)"),
    (mbad(lse=np.zeros((5, 16, 1), np.float32)), ValueError,
     r"lse must be .*shape \(5, 16\), got shape \(5, 16, 1\)"),
])
def test_bad_input_is_refused_by_name(a, exc, match):
    refused(a, exc, match)


@pytest.mark.parametrize("form, name, named", [
    ("combined", "q", "q"), ("pair", "q", "q_nope"), ("pair", "q_pe", "q_pe"),
    ("combined", "kv_cache", "kv_cache"), ("pair", "kv_cache", "kv_cache"),
    ("pair", "k_pe_cache", "k_pe_cache")])
@pytest.mark.parametrize("shift", [2, 8])
def test_misaligned_query_and_cache_are_refused(form, name, named, shift):
    """Copied 16 bytes at a time: 2 or 8 bytes past a boundary is refused, by name."""
    a = mbad(form, form)
    a = with_part(a, name, fake(part(a, name), name, shift))
    refused(a, ValueError, rf"{named} must start on a 16-byte boundary \(address 0x[0-9a-f]+ "
                           rf"is {shift} bytes past one\)")


def test_misaligned_out_is_refused():
    """out is stored 4 bytes (two elements) at a time."""
    a = mbad()
    refused(dict(a, out=fake(a["out"], "out", 2)), ValueError,
            "out must start on a 4-byte boundary .*is 2 bytes past one")
    mvalidate(**dict(a, out=fake(a["out"], "out", 4)))


def test_misaligned_lse_is_refused():
    a = mbad()
    refused(dict(a, lse=fake(a["lse"], "lse", 2)), ValueError,
            "lse must start on a 4-byte boundary")


def test_strides_that_are_not_whole_elements_are_refused():
    q = fake(np.zeros((5, 16, 576), F16), "q")
    q.strides = (16 * 1152 + 1, 1152, 2)
    refused(mbad(q=q), ValueError, r"q's strides must be multiples of its itemsize \(2 bytes\)")


def test_too_many_rows_or_blocks_are_refused():
    q = fake(np.zeros((5, 16, 576), F16), "q")
    q.shape = (2**27, 16, 576)
    refused(mbad(q=q), ValueError, r"total_q \* num_heads = 2147483648 rows; at most 1073741824")
    kc = fake(np.zeros((10, 16, 576), F16), "kv_cache")
    kc.shape = (2**31, 16, 576)
    refused(mbad(kv_cache=kc), ValueError, "num_blocks 2147483648: at most 2")
    # The combine's grid y is the heads; the row tiles' stride must stay in 32 bits
    q = fake(np.zeros((5, 16, 576), F16), "q")
    q.shape = (1, 65536, 576)
    refused(mbad(q=q, out=None, lse=None), ValueError, "num_heads is 65536; at most 65535")
    q.shape = (2**14 + 1, 2**16 - 1, 576)  # past 2^30 rows
    refused(mbad(q=q, out=None, lse=None), ValueError,
            r"total_q \* num_heads = 1073790975 rows; at most 1073741824")


def test_more_sequences_than_the_grid_holds_are_refused():
    """Grid x is (sequence, row tile): more than 2^31 - 1 sequences are refused (a table
    of stride 0 makes such a batch from little memory)."""
    a = mbad(out=None, lse=None)
    bt = fake(np.zeros((1, 4), np.int32), "block_tables")
    sl, qsl = (fake(np.zeros(4, np.int32), n) for n in ("seq_lens", "query_start_loc"))
    bt.shape, bt.strides = (2**31, 4), (0, 4)
    sl.shape = (2**31,)
    qsl.shape = (2**31 + 1,)
    refused(dict(a, block_tables=bt, seq_lens=sl, query_start_loc=qsl), ValueError,
            "2147483648 sequences; at most 2147483647")


@pytest.mark.parametrize("name", ["q_pe", "kv_cache", "k_pe_cache", "block_tables",
                                  "seq_lens", "query_start_loc", "out", "lse"])
def test_arrays_on_other_devices_are_refused(name):
    a = mbad("pair", "pair")
    refused(with_part(a, name, fake(part(a, name), name, device=1)), ValueError,
            f"{name} is on device 1 but q is on device 0")


# ---- overlaps: out and lse are written while q and the cache are read --------------------------


def _sharing(shape, name):
    """Fakes of an array of ``shape`` at the head of one allocation (at ``name``'s address)
    and of an out laid into its tail, overlapping it."""
    n, size = 5 * 16 * RANK, int(np.prod(shape))
    root = np.zeros(max(size, n) + 64, F16)
    return (fake_view(root[:size].reshape(shape), root, BASES[name]),
            fake_view(root[-n:].reshape(5, 16, RANK), root, BASES[name]))


@pytest.mark.parametrize("form, read, named", [
    ("combined", "q", "q"), ("pair", "q", "q_nope"), ("pair", "q_pe", "q_pe"),
    ("combined", "kv_cache", "kv_cache"), ("pair", "kv_cache", "kv_cache"),
    ("pair", "k_pe_cache", "k_pe_cache")])
def test_out_over_an_input_is_refused(form, read, named):
    a = mbad(form, form)
    view, out = _sharing(part(a, read).shape, read)
    refused(dict(with_part(a, read, view), out=out), ValueError,
            rf"{named} and out overlap in memory \(bytes .*\): they must be separate arrays")


def test_lse_over_q_or_out_is_refused():
    a = mbad()
    inside_q = fake(np.zeros((5, 16), np.float32), "q", shift=4096)
    refused(dict(a, lse=inside_q), ValueError, "q and lse overlap in memory")
    inside_out = fake(np.zeros((5, 16), np.float32), "out", shift=16)
    refused(dict(a, lse=inside_out), ValueError, "out and lse overlap in memory")
    inside_cache = fake(np.zeros((5, 16), np.float32), "kv_cache", shift=1024)
    refused(dict(a, lse=inside_cache), ValueError, "kv_cache and lse overlap in memory")


@pytest.mark.parametrize("table", ["block_tables", "seq_lens", "query_start_loc"])
@pytest.mark.parametrize("written", ["out", "lse"])
def test_out_or_lse_over_a_table_is_refused(table, written):
    """The kernels read the tables (query_start_loc without a clamp) while CTAs write out
    and lse: written over one, a later CTA's rows would land anywhere."""
    a = mbad()
    over = fake(a[written], table)  # at the table's own address
    refused(dict(a, **{written: over}), ValueError,
            rf"{table} and {written} overlap in memory")


def test_out_just_past_q_is_accepted():
    """Adjacent, not overlapping: out starting at q's last byte + 1."""
    a = mbad()
    q_end = 5 * 16 * 576 * 2
    mvalidate(**dict(a, out=fake(a["out"], "q", shift=q_end)))


# ---- what the messages say ----------------------------------------------------------------------


def test_unsupported_dtype_names_only_what_mla_takes():
    refused(mbad(q=np.zeros((5, 16, 576), np.float64)), TypeError,
            r"q dtype float64 is not supported: expected float16 or bfloat16$")


def test_negative_strides_are_named_as_such():
    refused(mbad(q=np.zeros((5, 16, 576), F16)[::-1]), ValueError,
            r"q's strides must be non-negative")


def test_tables_disagreeing_on_num_seqs_name_both():
    refused(mbad(block_tables=np.zeros((3, 4), np.int32)), ValueError,
            r"seq_lens .*\(2,\).*block_tables .*\(3, 4\)|block_tables .*\(3, 4\).*seq_lens")


def test_strided_lse_message_shows_its_strides():
    refused(mbad(lse=np.zeros((5, 32), np.float32)[:, ::2]), ValueError,
            r"lse must be a C-contiguous .*strides \(128, 8\)")


def test_kv_lora_rank_must_be_an_int():
    refused(mbad(kv_lora_rank=512.0), TypeError, "kv_lora_rank must be an int")


# ---- mla_attention's own checks ------------------------------------------------------------


def test_scale_is_required_before_anything_is_adapted():
    """Host (NumPy) arrays would be refused on adaptation: scale is checked first."""
    a = margs()
    with pytest.raises(TypeError, match=r"scale is required: DeepSeek's is 1 / sqrt\("
                                        r"qk_nope_head_dim \+ qk_rope_head_dim\)"):
        cupaged.mla_attention(a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"],
                              scale=None)


@pytest.mark.parametrize("n", [1, 3])
def test_q_as_a_sequence_must_be_a_pair(n):
    a = margs("pair")
    q = (a["q"] * 2)[:n]
    with pytest.raises(ValueError, match=rf"q as a sequence must be the pair \(q_nope, q_pe\), "
                                         rf"got {n} arrays"):
        cupaged.mla_attention(list(q), a["kv_cache"], a["block_tables"], a["seq_lens"],
                              scale=0.1)


def test_host_arrays_are_refused():
    a = margs()
    with pytest.raises(TypeError, match="q is a NumPy array .*needs a CUDA array"):
        cupaged.mla_attention(a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"],
                              scale=0.1)


@pytest.fixture
def fakes_adapt(monkeypatch):
    """mla_attention takes Fake arrays as device arrays (its checks then run on the CPU;
    each test's call is refused before any device work)."""
    real = _arrays.as_device_array
    adapt_one = lambda x, name: x if isinstance(x, Fake) else real(x, name)  # noqa: E731
    monkeypatch.setattr(mla, "as_device_array", adapt_one)
    monkeypatch.setattr(_arrays, "as_device_array", adapt_one)

    def call(a, **kw):
        f = adapt(a)
        return cupaged.mla_attention(f["q"], f["kv_cache"], f["block_tables"], f["seq_lens"],
                                     f["query_start_loc"], k_pe_cache=f["k_pe_cache"],
                                     out=f["out"], lse=f["lse"], **kw)
    return call


@pytest.mark.parametrize("kw, exc, match", [
    (dict(scale=float("nan")), ValueError, "scale must be finite in float32"),
    (dict(scale=float("inf")), ValueError, "scale must be finite"),
    (dict(scale=3e38), ValueError, "scale must be finite in float32"),
    (dict(scale="0.1x"), TypeError, "scale must be a number, got str"),
    (dict(scale=0.1, max_query_len=-1), ValueError, "max_query_len must be >= 0"),
    (dict(scale=0.1, max_seq_len=2.5), TypeError, "max_seq_len must be an int, got float"),
    (dict(scale=0.1, kv_cache_dtype="fp8"), TypeError, "kv_cache dtype float16 cannot hold fp8"),
    (dict(scale=0.1, k_scale=2.0), ValueError, "k_scale is for an fp8 cache"),
    (dict(scale=0.1, workspace=object()), TypeError,
     "workspace must be a cupaged.DecodeWorkspace, got object"),
    (dict(scale=0.1, kv_lora_rank=256), ValueError, "kv_lora_rank 256 with rope_dim 320"),
])
def test_mla_attention_checks_before_any_device_work(fakes_adapt, kw, exc, match):
    with pytest.raises(exc, match=match):
        fakes_adapt(mbad("pair"), **kw)


def test_mla_attention_passes_the_pair_as_a_tuple(fakes_adapt):
    """A list pair reaches validation as the pair (its q_pe checks run)."""
    a = mbad("pair")
    a["q"] = [fake(a["q"][0], "q"), fake(np.zeros((5, 16, 32), F16), "q_pe")]
    with pytest.raises(ValueError, match=r"q_nope and q_pe must be .*\(5, 16, 32\)"):
        fakes_adapt(a, scale=0.1)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("cache_form", ["combined", "pair"])
def test_fp8_latent_caches_are_accepted(fmt, cache_form):
    """One-byte caches named by kv_cache_dtype; their strides count bytes (elements)."""
    width = 576 if cache_form == "combined" else 512
    kw = dict(kv_cache=np.zeros((10, 16, width), np.uint8), kv_cache_dtype=fmt)
    if cache_form == "pair":
        kw["k_pe_cache"] = np.zeros((10, 16, 64), np.uint8)
    a = margs(cache=cache_form)
    a.update(kw)
    p = mvalidate(**a)
    assert p.cache_dtype.name == ("e5m2" if fmt == "fp8_e5m2" else "e4m3")
    assert p.c_strides[:2] == (16 * width, width)
    assert p.c_offsets == ((0, 512) if cache_form == "combined" else (0, 0))


@pytest.mark.parametrize("starts", [True, False])
def test_decode_bounds_are_one_token_a_sequence(starts):
    """Without query_start_loc each sequence has one row per head: the rows a sequence
    has (what the tile is sized by) must not be total_q times the heads."""
    p = mvalidate(**margs(rows=2 if not starts else 5, starts=starts))
    assert validation.mla_bounds(p, starts, None, None) == (p.num_rows if starts else 1,
                                                            p.max_blocks * p.block_size)
    assert validation.mla_bounds(p, starts, 3, 20) == (3 if starts else 1, 20)
    assert validation.mla_bounds(p, starts, 10**6, 10**9)[1] == p.max_blocks * p.block_size


@pytest.mark.parametrize("itemsize", [2, 1], ids=["16-bit", "fp8"])
def test_sixteen_rows_take_two_stages_where_two_ctas_share_an_sm(itemsize):
    """mla_attention's tile at 16 packed rows (16 heads decoding) is 32 tokens over two
    stages wherever that shape fits two CTAs an SM, for 16-bit caches as for fp8: the two
    CTAs' chains of phases overlap (docs/PERFORMANCE.md); more rows keep the deepest
    ring that fits one CTA."""
    from cupaged import planning
    from cupaged.specs import geometry

    for arch in ("sm_80", "sm_90"):
        two = geometry.MlaGeometry(512, 64, 16, 32, 2, itemsize).min_blocks(arch) == 2
        deepest = max(s for s in (2, 3, 4)
                      if geometry.MlaGeometry(512, 64, 16, 32, s, itemsize).fits(arch))
        assert planning.mla_tile(arch, 16, itemsize) == (16, 32, 2 if two else deepest)
        assert deepest > 2  # without two CTAs an SM, a deeper ring
    # Hopper's 227 KiB hold two at 16 rows (sm_80's 163 KiB do not), but one CTA of 64 rows
    assert planning.mla_tile("sm_90", 16, itemsize) == (16, 32, 2)
    assert planning.mla_tile("sm_90", 64, itemsize)[2] > 2


@pytest.mark.parametrize("family", [None, "mma", "sm90"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
def test_few_rows_take_the_wgmma_kernel_where_warpgroup_1_copies(mla_planned, cache, arch,
                                                                family):
    """On Hopper the paged wgmma kernel serves 64 packed rows or more, and 16 to 63 where
    warpgroup 1 copies alone (pages of 16 tokens or more: planning.PRODUCER_MIN_ROWS); under
    16 rows, in smaller pages and on other GPUs the mma.sync kernel, and either family when
    forced."""
    from cupaged import planning

    built = mla_planned(arch)
    planning.set_mla_family(family)
    planning.set_mla_split(0)
    try:
        for block_size in (1, 8, 16, 64, 256):
            for heads, max_q in ((8, 1), (15, 1), (16, 1), (8, 2), (32, 1), (20, 3), (128, 1)):
                rows = heads * max_q
                planning.plan_mla(0, "bf16", cache, 512, 64, block_size, 4, 4 * max_q, heads,
                                  max_q, 4096)
                wgmma = arch == "sm_90" and family != "mma" and (
                    family == "sm90" or rows >= 64 or (block_size >= 16 and rows >= 16))
                assert (built[-1] == "sm90") == wgmma, (block_size, heads, max_q)
    finally:
        planning.set_mla_family(None)
        planning.set_mla_split(None)


# ---- what the latent cache write takes against what mla_attention reads ----------------------


def _cache_variant(dtype, cache_form, change):
    """mla_attention's caches (combined, or the pair) of ``dtype`` as Fakes, ``change``d:
    rows padded by 8 or 16 bytes, or the pointers 8 or 16 bytes past a boundary."""
    it = np.dtype(dtype).itemsize
    widths = (RANK + ROPE,) if cache_form == "combined" else (RANK, ROPE)
    out = []
    for width, name in zip(widths, ("kv_cache", "k_pe_cache")):
        pad = {"rows+8": 8, "rows+16": 16}.get(change, 0) // it
        root = np.zeros((10, 16, width + pad), dtype)
        shift = {"ptr+8": 8, "ptr+16": 16}.get(change, 0)
        out.append(fake_view(root[..., :width], root, BASES[name] + shift))
    return out if cache_form == "pair" else [out[0], None]


@pytest.mark.parametrize("change", ["dense", "rows+8", "rows+16", "ptr+8", "ptr+16"])
@pytest.mark.parametrize("cache_form", ["combined", "pair"])
@pytest.mark.parametrize("dtype", [F16, np.dtype(np.uint8)], ids=["f16", "fp8"])
def test_the_latent_cache_write_takes_the_caches_mla_attention_reads(dtype, cache_form,
                                                                     change):
    """concat_and_cache_mla and mla_attention agree on a cache's pointer and strides
    (16-byte multiples, fp8 included): neither takes a cache the other refuses."""
    from cupaged import cache_ops

    kc, pc = _cache_variant(dtype, cache_form, change)
    kv = "fp8" if dtype.itemsize == 1 else "auto"

    def accepted(check):
        try:
            check()
        except ValueError:
            return False
        return True

    a = margs(cache=cache_form)
    a.update(kv_cache=kc, k_pe_cache=pc, kv_cache_dtype=kv)
    reads = accepted(lambda: mvalidate(**a))
    src = [Fake(np.zeros((3, w), F16), ptr=(i + 40) << 24) for i, w in enumerate((RANK, ROPE))]
    writes = accepted(lambda: cache_ops.validate_mla_write(
        *src, kc, pc, Fake(np.zeros(3, np.int64), ptr=42 << 24), kv))
    assert reads == writes == (change in ("dense", "rows+16", "ptr+16"))


def test_mla_attention_refuses_a_per_token_scale(fakes_adapt, monkeypatch):
    """MLA's latent cache takes one scale per tensor: a per-token array (any other shape
    of more than one element) is refused with a ValueError that says so, before any
    device work; so is it by concat_and_cache_mla (tests/test_cache_ops.py)."""
    from cupaged import _kvquant

    monkeypatch.setattr(_kvquant, "as_device_array", lambda x, name: x)
    a = mbad("pair", kv_cache=np.zeros((10, 16, 512), np.uint8),
             k_pe_cache=np.zeros((10, 16, 64), np.uint8))
    for shape in ((10, 1, 16), (2,)):
        per_token = Fake(np.zeros(shape, np.float32), ptr=50 << 24)
        with pytest.raises(ValueError, match=rf"k_scale must be one float \(per tensor\), got "
                                             rf"shape \({shape[0]},.*\): MLA's latent cache "
                                             rf"takes a per-tensor scale only"):
            fakes_adapt(a, scale=0.1, kv_cache_dtype="fp8", k_scale=per_token)
