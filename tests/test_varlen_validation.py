"""Every input check of cupaged.attention, on array metadata alone (no GPU needed), and
the planner's choice of kernel."""

import numpy as np
import pytest

from cupaged import _checks, jit, planning, validation
from cupaged.specs import geometry
from test_validation import Fake


def vargs(layout="NHD", dtype=np.float16, seqs=3, total_q=7, heads=8, kv_heads=2, hs=64,
          bs=16, blocks=10, width=4):
    if layout == "NHD":
        kc = np.zeros((blocks, bs, kv_heads, hs), dtype)
    elif layout == "HND":
        kc = np.zeros((blocks, kv_heads, bs, hs), dtype)
    else:
        x = 16 // np.dtype(dtype).itemsize
        kc = np.zeros((blocks, kv_heads, hs // x, bs, x), dtype)
    vc = kc if layout != "vllm" else np.zeros((blocks, kv_heads, hs, bs), dtype)
    return dict(query=np.zeros((total_q, heads, hs), dtype), key_cache=kc, value_cache=vc,
                block_tables=np.zeros((seqs, width), np.int32), seq_lens=np.zeros(seqs, np.int32),
                query_start_loc=np.zeros(seqs + 1, np.int32), alibi_slopes=None, out=None,
                kv_layout=layout)


def vvalidate(**a):
    layout = a.pop("kv_layout")
    f = {k: (None if v is None else (v if isinstance(v, Fake) else Fake(v))) for k, v in a.items()}
    return validation.validate_varlen(f["query"], f["key_cache"], f["value_cache"], f["block_tables"],
                            f["seq_lens"], f["query_start_loc"], f["alibi_slopes"], f["out"],
                            layout)


def vbad(layout="NHD", **changes):
    a = vargs(layout)
    a.update(changes)
    return a


@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm"])
def test_valid_problem_is_described(layout):
    p = vvalidate(**vargs(layout))
    assert (p.num_seqs, p.num_heads, p.num_kv_heads, p.head_size, p.block_size) == (3, 8, 2, 64, 16)
    assert (p.num_rows, p.cache.kv_format) == (7, "vllm" if layout == "vllm" else "tok")


def test_strides_of_nhd_and_hnd_views():
    nhd = vvalidate(**vargs("NHD")).cache
    assert nhd.k_strides == (16 * 2 * 64, 64, 2 * 64)  # block, head, token
    hnd = vvalidate(**vargs("HND")).cache
    assert hnd.k_strides == (2 * 16 * 64, 16 * 64, 64)
    fused = np.zeros((10, 2, 16, 2, 64), np.float16)  # FlashInfer's [blocks, 2, bs, kvh, hs]
    c = vvalidate(**vbad(key_cache=fused[:, 0], value_cache=fused[:, 1])).cache
    assert c.k_strides == c.v_strides == (2 * 16 * 2 * 64, 64, 2 * 64)


def _vllm_flash_cache(num_blocks, block_size, kv_heads, hs, memory):
    """A cache as vLLM hands it to its flash kernels: always the shape [num_blocks,
    block_size, num_kv_heads, head_size]; ``memory`` "NHD", "HND" (a permuted view of
    head-major memory) or "packed" (the K half of [num_blocks, kv_heads, block_size,
    2 * head_size], permuted)."""
    if memory == "NHD":
        return np.zeros((num_blocks, block_size, kv_heads, hs), np.float16)
    if memory == "HND":
        return np.zeros((num_blocks, kv_heads, block_size, hs), np.float16).transpose(0, 2, 1, 3)
    packed = np.zeros((num_blocks, kv_heads, block_size, 2 * hs), np.float16)
    return packed[..., :hs].transpose(0, 2, 1, 3)


@pytest.mark.parametrize("memory", ["NHD", "HND", "packed"])
@pytest.mark.parametrize("kv_heads, bs", [(2, 16), (8, 8), (16, 16)])
def test_vllm_flash_caches_are_kv_layout_nhd_whatever_their_memory(memory, kv_heads, bs):
    """cupaged's kv_layout names the shape's order: vLLM's flash caches (shape [nb, bs,
    kv_heads, hs] over NHD, HND or packed memory) are read as "NHD" with their strides;
    passed as "HND" they are refused, also when kv_heads == block_size, where the shape
    cannot tell the two conventions apart."""
    kc = _vllm_flash_cache(10, bs, kv_heads, 64, memory)
    a = vargs(heads=2 * kv_heads, kv_heads=kv_heads, bs=bs)
    c = vvalidate(**{**a, "key_cache": kc, "value_cache": kc, "kv_layout": "NHD"}).cache
    st = tuple(x // 2 for x in kc.strides)
    assert (c.num_kv_heads, c.block_size) == (kv_heads, bs)
    assert c.k_strides == (st[0], st[2], st[1])  # block, head, token
    if memory != "NHD":
        with pytest.raises(ValueError, match=r"key_cache of shape .* has strides .*dimension 2 "
                                             r"lies outside dimension 1.*kv_layout='NHD'"):
            vvalidate(**{**a, "key_cache": kc, "value_cache": kc, "kv_layout": "HND"})


def test_hnd_caches_of_every_kind_still_pass():
    """What kv_layout='HND' always took: dense, halves of [nb, 2, ...] and of packed rows,
    one KV head or one-token blocks (whose strides are free)."""
    dense = np.zeros((10, 2, 16, 64), np.float16)
    fused = np.zeros((10, 2, 2, 16, 64), np.float16)
    packed = np.zeros((10, 2, 16, 128), np.float16)
    one_head = np.zeros((10, 16, 1, 64), np.float16).transpose(0, 2, 1, 3)
    for kc, vc in ((dense, dense), (fused[:, 0], fused[:, 1]), (packed[..., :64], packed[..., 64:])):
        vvalidate(**{**vargs("HND"), "key_cache": kc, "value_cache": vc})
    vvalidate(**{**vargs("HND", heads=4, kv_heads=1), "key_cache": one_head, "value_cache": one_head})


@pytest.mark.parametrize("a, exc, match", [
    (vbad(kv_layout="NDH"), ValueError, r"kv_layout must be one of \('NHD', 'HND', 'vllm'\)"),
    (vbad(key_cache=np.zeros((10, 16, 2, 64, 1), np.float16)), ValueError,
     r"key_cache must be 4-D \[num_blocks, block_size, num_kv_heads, head_size\]"),
    (vbad("HND", value_cache=np.zeros((10, 2, 16, 32), np.float16)), ValueError,
     "value_cache shape .* does not match key_cache"),
    (vbad(key_cache=np.zeros((10, 12, 2, 64), np.float16), value_cache=np.zeros((10, 12, 2, 64), np.float16)),
     ValueError, r"block_size 12 \(key_cache.shape\[1\] for NHD\)"),
    (vbad(query=np.zeros((7, 8, 32), np.float16)), ValueError, "query's head_size is 32 but the caches' is 64"),
    (vbad(query=np.zeros((7, 7, 64), np.float16)), ValueError, r"num_heads \(7\) must be a positive multiple"),
    (vbad(key_cache=np.zeros((10, 16, 2, 128), np.float16)[..., ::2],
          value_cache=np.zeros((10, 16, 2, 128), np.float16)[..., ::2]),
     ValueError, "key_cache's last dimension .* must be contiguous"),
    (vbad(key_cache=np.zeros((10, 16, 2, 68), np.float16)[..., :64],
          value_cache=np.zeros((10, 16, 2, 68), np.float16)[..., :64]),
     ValueError, "key_cache must be 16-byte aligned with block, head and token strides"),
    (vbad(query_start_loc=np.zeros(3, np.int32)), ValueError,
     r"query_start_loc must be a contiguous \[num_seqs \+ 1 = 4\] array"),
    (vbad(query_start_loc=np.zeros(4, np.int64)), TypeError, "query_start_loc must be int32"),
    (vbad(query_start_loc=None), ValueError,
     "query has 7 rows but there are 3 sequences: without query_start_loc"),
    (vbad(seq_lens=np.zeros(4, np.int32)), ValueError, r"seq_lens must be a contiguous \[num_seqs=3\]"),
    (vbad(seq_lens=np.zeros(3, np.int64)), TypeError, "seq_lens must be int32"),
    (vbad(block_tables=np.zeros(3, np.int32)), ValueError, "block_tables must be 2-D"),
    (vbad(out=np.zeros((7, 8, 64), np.float32)), TypeError, "out dtype float32 does not match"),
    (vbad(out=np.zeros((6, 8, 64), np.float16)), ValueError, r"out must be a C-contiguous array of shape \(7, 8, 64\)"),
    (vbad(key_cache=np.zeros((10, 16, 2, 64), np.float32)), TypeError, "key_cache dtype float32 does not match"),
])
def test_bad_input_is_named(a, exc, match):
    with pytest.raises(exc, match=match):
        vvalidate(**a)


def test_out_may_be_the_query_but_not_overlap_it():
    a = vargs()
    q = Fake(a["query"])
    vvalidate(**{**a, "query": q, "out": Fake(a["query"])})  # the same array: in place
    with pytest.raises(ValueError, match="overlap"):
        vvalidate(**{**a, "query": q, "out": Fake(a["query"], ptr=q.data.ptr + 128)})


@pytest.mark.parametrize("name", ["max_query_len", "max_seq_len"])
def test_host_bounds(name):
    assert _checks.host_bound(None, name, 9) == 9
    assert _checks.host_bound(100, name, 9) == 9
    assert _checks.host_bound(3, name, 9) == 3
    with pytest.raises(ValueError, match=f"{name} must be >= 0"):
        _checks.host_bound(-1, name, 9)
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        _checks.host_bound(2.0, name, 9)


@pytest.mark.parametrize("layout, dtype, bs, starts, max_q, total_q, kind", [
    ("NHD", np.float16, 16, False, 1, 3, "decode"),     # no query_start_loc
    ("NHD", np.float16, 16, True, 1, 3, "rows"),        # one token each, said by the host:
                                                        # still read through the starts
    ("NHD", np.float16, 16, True, 4, 7, "prefill"),
    ("NHD", np.float16, 16, True, 1, 7, "prefill"),     # bound undercounts: rows still packed
    ("vllm", np.float16, 8, True, 4, 7, "prefill"),
    ("vllm", np.float16, 4, True, 4, 7, "rows"),        # tiny vLLM blocks: row mode
    ("NHD", np.float32, 16, True, 4, 7, "rows"),        # float32: row mode
])
def test_the_planner_picks_the_kernel(device_arch, layout, dtype, bs, starts, max_q, total_q,
                                      kind):
    a = vargs(layout, dtype=dtype, bs=bs, total_q=total_q)
    p = vvalidate(**a)
    assert planning.choose_kernel(p, starts, max_q).kind == kind


@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("max_q", [0, 1, 2, 7])
def test_a_call_with_query_start_loc_always_reads_it(device_arch, layout, dtype, max_q):
    """Host bounds may undercount: whatever they say, a call given query_start_loc runs a
    kernel that reads it (the decode kernel's one-token mode does not)."""
    p = vvalidate(**vargs(layout, dtype=dtype, seqs=3, total_q=3))
    assert planning.choose_kernel(p, True, max_q).kind in ("rows", "prefill")


def test_the_planner_takes_fewer_rows_per_cta_for_few_rows(device_arch):
    p = vvalidate(**vargs(total_q=7))
    fewest, few, many = (planning.choose_kernel(p, True, q).tile for q in (4, 9, 300))
    assert fewest == jit.few_rows_prefill_tile(p.head_size, 16)  # 4 tokens x 4 heads = 16
    assert fewest[4] == 2                                        # warps sharing the rows
    assert few == jit.few_rows_prefill_tile(p.head_size)         # 36 rows: 16 a warp
    assert many == jit.default_prefill_tile(p.head_size)
    rows = [geometry.prefill_rows(p.head_size, t[0], t[1], t[4]) for t in (fewest, few, many)]
    assert rows == [32, 64, 128]                                 # fewer padding rows


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("case, sm90", [
    (dict(), True),                                    # f16, NHD, head size 64, 8/2 heads
    (dict(layout="HND"), True),
    (dict(dtype=np.float32), False),                   # row mode
    (dict(layout="vllm"), True),                       # vLLM's layout, blocks of 16
    (dict(layout="vllm", bs=4), False),                # blocks under 8 tokens: mma.sync
    (dict(hs=96), False),                              # wgmma's N of P V: steps of 64
    (dict(hs=256), True),
])
@pytest.mark.parametrize("max_q", [4, 15, 16, 300])
def test_the_planner_takes_the_wgmma_kernel_on_hopper_for_many_rows(device_arch, arch, case, sm90,
                                                                     max_q):
    """paged_prefill_sm90 on sm_90 for 16-bit token-major caches (and vLLM's layout in
    blocks of 8 tokens or more), head sizes that are multiples of 64 and SM90_MIN_ROWS
    packed rows or more (a group of 4: 15 tokens are 60 rows, 16 are 64); the mma.sync
    kernel elsewhere."""
    device_arch(arch)
    case = dict(case)
    layout = case.pop("layout", "NHD")
    p = vvalidate(**vargs(layout, **case))
    c = planning.choose_kernel(p, True, max_q)
    want = sm90 and arch == "sm_90" and max_q * 4 >= planning.SM90_MIN_ROWS
    assert c.sm90 == want
    if want:
        assert c.q_tiles == -(-max_q * 4 // 128)
        assert c.tile == jit.default_sm90_prefill_tile(p.head_size)
    planning.set_prefill_family("mma")
    try:
        assert not planning.choose_kernel(p, True, max_q).sm90
        # asked for, Hopper's kernel takes the few rows too, but nothing it cannot serve
        planning.set_prefill_family("sm90")
        forced = planning.choose_kernel(p, True, max_q).sm90
        assert forced == (arch == "sm_90" and sm90)
    finally:
        planning.set_prefill_family(None)


@pytest.mark.parametrize("hs, sm90", [(128, True), (192, True), (256, False)])
def test_the_planner_takes_fp8_caches_with_per_tensor_scales_to_the_wgmma_kernel(
        device_arch, hs, sm90):
    """fp8 caches with per-tensor scales up to head size 192 (the raw stages beside the
    ring fit there); per-token scales stay on the mma.sync kernel."""
    device_arch("sm_90")
    a = vargs(hs=hs)
    a["key_cache"] = a["key_cache"].view(np.uint8)[..., :hs]
    a["value_cache"] = a["key_cache"]
    p = validation.validate_varlen(*(Fake(a[k]) for k in ("query", "key_cache", "value_cache",
                                                          "block_tables", "seq_lens",
                                                          "query_start_loc")),
                                   None, None, "NHD", kv_cache_dtype="fp8_e4m3", k_scale=1.0,
                                   v_scale=1.0)
    c = planning.choose_kernel(p, True, 300)
    assert c.kind == "prefill" and c.sm90 == sm90
    if sm90:
        assert c.tile == jit.default_sm90_prefill_tile(hs, True)
    per_token = p._replace(quant=p.quant._replace(mode="th"))
    assert not planning.choose_kernel(per_token, True, 300).sm90


def _fp8(a, hs, layout="NHD"):
    """validate_varlen over ``a``'s arrays with an fp8 e4m3 cache (per-tensor scales)."""
    if layout == "vllm":
        blocks, kvh, _, bs, _ = a["key_cache"].shape
        a["key_cache"] = np.zeros((blocks, kvh, hs // 16, bs, 16), np.uint8)
        a["value_cache"] = np.zeros((blocks, kvh, hs, bs), np.uint8)
    else:
        a["key_cache"] = a["key_cache"].view(np.uint8)[..., :hs]
        a["value_cache"] = a["key_cache"]
    return validation.validate_varlen(*(Fake(a[k]) for k in ("query", "key_cache", "value_cache",
                                                          "block_tables", "seq_lens",
                                                          "query_start_loc")),
                                      None, None, layout, kv_cache_dtype="fp8_e4m3", k_scale=1.0,
                                      v_scale=1.0)


@pytest.mark.parametrize("arch, hs", [("sm_80", 272), ("sm_80", 384), ("sm_80", 512),
                                      ("sm_90", 272)])
def test_heads_over_256_dims_take_the_mma_kernel_with_pairs_of_warps(device_arch, arch, hs):
    """Above 256 dims, but for 384 and 512 on Hopper, the wgmma kernel does not apply;
    paged_prefill takes pairs of warps per 16 rows, 64 rows a CTA where the target holds
    it (32 rows for a few)."""
    device_arch(arch, geometry.max_smem(arch))
    p = vvalidate(**vargs(hs=hs, total_q=300 * 3))
    many, few = planning.choose_kernel(p, True, 300), planning.choose_kernel(p, True, 4)
    assert many.kind == few.kind == "prefill" and not many.sm90 and not few.sm90
    assert many.tile[:2] == (8, 1) and few.tile[:2] == (4, 1)  # tokens per tile: as fits
    assert geometry.prefill_rows(hs, *many.tile[:2]) == 64
    assert many.q_tiles == -(-300 * 4 // 64)
    assert geometry.prefill_rows(hs, *few.tile[:2]) == 32
    spec = planning.prefill_spec(arch, "f16", hs, 16, "tok", many.tile)
    assert geometry.PrefillGeometry.of(spec).fits(arch)


@pytest.mark.parametrize("hs", [384, 512])
def test_heads_of_384_and_512_on_hopper_split_the_dims_over_the_consumers(device_arch, hs):
    """On sm_90, head sizes 384 and 512 over a token-major cache of the query's type run
    the wgmma kernel with both consumers on the same 64 rows (each half the dims) in
    32-token tiles of two stages; few rows, vLLM's layout and fp8 caches keep the mma.sync
    kernel."""
    device_arch("sm_90", geometry.max_smem("sm_90"))
    p = vvalidate(**vargs(hs=hs, total_q=300 * 3))
    many, few = planning.choose_kernel(p, True, 300), planning.choose_kernel(p, True, 4)
    assert many.sm90 and many.tile == (32, 2) and not few.sm90
    assert many.q_tiles == -(-300 * 4 // 64) == -(-300 * 4 // geometry.sm90_prefill_rows(hs))
    spec = jit.KernelSpec("paged_prefill_sm90", "f16", hs, 16, arch="sm_90a")
    g = geometry.Sm90PrefillGeometry.of(spec)
    assert (spec.tile_tokens, spec.stages) == (32, 2) and g.rows == 64
    assert g.violations() == [] and g.fits("sm_90a")
    assert not planning.choose_kernel(vvalidate(**vargs("vllm", hs=hs, total_q=900)), True,
                                      300).sm90
    assert not planning.choose_kernel(_fp8(vargs(hs=hs, total_q=900), hs), True, 300).sm90
    # what the kernel refuses over 256 dims: fp8 caches, other tiles, other head sizes
    for bad, why in ((dict(cache_dtype="e4m3"), "16-bit type"),
                     (dict(tile_tokens=64), "TILE_N"), (dict(head_size=320), "HEAD_SIZE")):
        fields = dict(dtype="f16", head_size=hs, block_size=16, arch="sm_90a") | bad
        g = geometry.Sm90PrefillGeometry.of(jit.KernelSpec("paged_prefill_sm90", **fields))
        assert any(why in v for v in g.violations()), (bad, g.violations())


@pytest.mark.parametrize("hs, layout, tile", [
    (128, "NHD", (4, 1, 64, 2, 1)),    # the default's 104 KB: 16 rows a warp instead
    (256, "NHD", (4, 1, 16, 2, 1)),    # 101,408 bytes at 32 tokens, 1 KB past 99 KiB
    (384, "vllm", (4, 1, 16, 2, 1)),
    (512, "NHD", (2, 1, 16, 2, 1)),    # one pair of warps, 16 rows
    (512, "vllm", (2, 1, 16, 2, 1)),
])
def test_the_planner_fits_the_multi_token_tile_to_99_kib(device_arch, hs, layout, tile):
    """sm_86/89 (RTX 30x0/40x0, L40) give a block 99 KiB: the first smaller shape that
    fits, the same on every call."""
    device_arch("sm_86", geometry.max_smem("sm_86"))
    p = vvalidate(**vargs(layout, hs=hs, total_q=300 * 3))
    assert planning.choose_kernel(p, True, 300).tile == tile
    fmt = "vllm" if layout == "vllm" else "tok"
    spec = planning.prefill_spec("sm_86", "f16", hs, 16, fmt, tile)
    assert geometry.PrefillGeometry.of(spec).smem_bytes <= geometry.max_smem("sm_86")


def test_a_multi_token_call_past_the_gpus_shared_memory_names_the_limit(device_arch):
    """An fp8 cache in vLLM's layout at head size 512 needs 101,920+ bytes even in the
    smallest tile (one pair of warps, 16 tokens): a ValueError naming the need and the
    device's limit, from the planner (before any launch). The limit is the device's own,
    not its target's table: an sm_90 device reporting 99 KiB a block gets the same."""
    for arch in ("sm_86", "sm_90"):
        device_arch(arch, geometry.max_smem("sm_86"))
        p = _fp8(vargs("vllm", hs=512, total_q=9), 512, "vllm")
        with pytest.raises(ValueError, match=rf"multi-token attention at head_size 512 \(vllm "
                                             rf"layout, e4m3 cache, blocks of 16\) needs \d+ bytes "
                                             rf"of shared memory per block in its smallest tile; "
                                             rf"the device \({arch}\) allows 101376: a smaller "
                                             rf"head size, or a token-major layout"):
            planning.choose_kernel(p, True, 3)
    device_arch("sm_86", geometry.max_smem("sm_86"))
    p = _fp8(vargs("NHD", hs=512, total_q=9), 512)  # token-major fits: one pair of warps
    assert planning.choose_kernel(p, True, 3).tile == (2, 1, 16, 2, 1)


def test_the_split_model_splits_few_ctas_over_long_keys_only():
    """paged_prefill's split-KV choice (host only): a shared prefix's 32 CTAs over 32k keys
    split; a long prompt's thousand CTAs and short contexts do not; a window bounds the
    keys a partition covers."""
    from cupaged import _variants, planning, validation

    k = planning.PrefillKernel(None, 0, 128, 64, 264)

    def split(num_seqs, q_tiles, max_ctx, window=0, max_q=128):
        p = validation.Problem(0, None, num_seqs, 32, 8, 128, 16, 0, 0, None, num_seqs * max_q)
        v = _variants.Variants("w" if window else "", window)
        return planning.prefill_split(k, p, planning.Choice("prefill", q_tiles), max_q, max_ctx,
                                     v, None)

    size, parts = split(1, 4, 32768)
    assert parts >= 4 and size % 64 == 0 and size * parts >= 32768
    assert split(1, 128, 4096) == (0, 1)  # a 4096-token prompt: 1024 CTAs
    assert split(64, 1, 64) == (0, 1)
    size, parts = split(1, 4, 32768, window=512)
    assert size * (parts - 1) < 512 + 128 + 64 <= size * parts


def test_block_strides_past_32_bits_are_refused_for_the_prefill_kernel():
    dt = _checks._dtypes.BY_NAME["f16"]
    ok = _checks.CacheView(dt, 10, 8, 128, 16, "tok", (2**31, 128, 1024), (2**31, 128, 1024))
    _checks.check_block_strides(ok)
    for k_strides in ((2**32, 128, 1024), (2**20, 128, 2**28)):  # block stride; rows in a block
        bad = ok._replace(k_strides=k_strides)
        with pytest.raises(ValueError, match="key_cache's block stride .* too large"):
            _checks.check_block_strides(bad)


def test_more_query_heads_than_the_combine_grid_allows_are_refused():
    """A split multi-token call's combine runs a CTA row a head (grid y): more than 65535
    query heads are refused before anything is planned."""
    with pytest.raises(ValueError, match="num_heads is 65536; at most 65535"):
        vvalidate(**vargs(total_q=1, heads=65536, kv_heads=1, hs=32))
    vvalidate(**vargs(total_q=1, heads=65535, kv_heads=1, hs=32))


def test_query_strides_must_be_whole_elements():
    from test_validation import _odd_strides

    q = _odd_strides(np.float16, (7, 8, 64), (8 * 64 * 2 + 2 * 64 + 1, 128, 2))
    with pytest.raises(ValueError, match="query's strides must be multiples of its itemsize"):
        vvalidate(**vbad(query=q))



def test_a_tile_override_past_shared_memory_is_refused_by_name(device_arch):
    device_arch("sm_90")
    with pytest.raises(ValueError, match=r"paged_prefill_sm90_bf16_e4m3_hs128_bs16_tok_n128x3_sm90a "
                                         r"needs 296096 bytes"):
        planning.prefill_sm90_kernel(0, "bf16", 128, 16, "", (128, 3), "e4m3")


@pytest.mark.parametrize("tile, why", [
    ((6, 1, 64, 2, 3), "KEY_WARPS"),    # 21 keys a warp: not whole 16-key steps
    ((4, 1, 32, 2, 4), "KEY_WARPS"),    # 8 keys a warp
    ((4, 1, 64, 2, -1), "KEY_WARPS"),
    ((3, 1, 64, 2, 2), "KEY_WARPS"),    # warps that the sharing does not divide
])
def test_a_tile_the_kernel_does_not_take_is_refused_before_loading(device_arch, monkeypatch,
                                                                  tile, why):
    """A tile override outside the kernel's static_asserts is a ValueError naming the
    specialization and the broken rule, raised before NVRTC sees it."""
    from cupaged import jit

    device_arch("sm_90")
    loads = []
    monkeypatch.setattr(jit, "load", lambda *a, **k: loads.append(a))
    planning.prefill_kernel.cache_clear()
    with pytest.raises(ValueError, match=rf"paged_prefill\S* is not a shape the kernel takes: "
                                         rf".*{why}"):
        planning.prefill_kernel(0, "f16", 128, 16, "tok", tile)
    assert loads == []
    assert why in geometry.PrefillGeometry.of(planning.prefill_spec(
        "sm_90", "f16", 128, 16, "tok", tile)).violations()


@pytest.mark.parametrize("family", ["mma", "sm90"])
def test_a_tile_past_the_devices_shared_memory_is_refused_before_loading(device_arch, monkeypatch,
                                                                        family):
    """A tile override that needs more shared memory than the device allows is a
    ValueError naming the kernel's specialization, raised before anything compiles or
    loads (both multi-token families share the check)."""
    from cupaged import jit

    device_arch("sm_90")
    loads = []
    monkeypatch.setattr(jit, "load", lambda *a, **k: loads.append(a))
    planning.prefill_kernel.cache_clear()
    planning.prefill_sm90_kernel.cache_clear()
    small = planning.DeviceInfo(0, "sm_90", 132, 48 * 1024, 233472)
    monkeypatch.setattr(planning, "device_info", lambda device_id: small)
    with pytest.raises(ValueError, match=r"paged_prefill\S* needs \d+ bytes of shared memory "
                                         r"per block; device 0 allows 49152"):
        if family == "sm90":
            planning.prefill_sm90_kernel(0, "bf16", 128, 16, "", (128, 3))
        else:
            planning.prefill_kernel(0, "bf16", 128, 16, "tok", jit.default_prefill_tile(128))
    assert loads == []


def _fp8_query(hs=128, layout="NHD", out=np.float16, query=np.uint8, cache="fp8_e4m3",
               k_scale=1.0, total_q=9):
    """validate_varlen of an 8-bit query (``query``: its 1-byte dtype) over an fp8 cache
    (``cache``: kv_cache_dtype) with ``out`` of that dtype (None: no out)."""
    a = vargs(layout, hs=hs, total_q=total_q)
    kc = a["key_cache"].view(np.uint8)[..., :hs]
    q = np.zeros(a["query"].shape, query)
    o = None if out is None else np.zeros(a["query"].shape, out)
    return validation.validate_varlen(Fake(q), Fake(kc), Fake(kc), Fake(a["block_tables"]),
                                      Fake(a["seq_lens"]), Fake(a["query_start_loc"]), None,
                                      None if o is None else Fake(o, ptr=1 << 30), layout,
                                      kv_cache_dtype=cache, k_scale=k_scale, v_scale=1.0)


def test_an_8bit_query_is_described_in_its_caches_format():
    """A uint8 query over an e4m3 cache: an e4m3 query, out's type the problem's, the
    query's strides in bytes."""
    p = _fp8_query()
    assert p.query_dtype.name == "e4m3" and p.dtype.name == "f16"
    assert p.q_strides == (8 * 128, 128)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(out=None), TypeError, "needs out="),
    (dict(out=np.float32), TypeError, "out of an 8-bit query must be float16 or bfloat16"),
    (dict(cache="auto"), TypeError, "name its fp8 format"),
])
def test_an_8bit_query_refuses_what_it_cannot_run(kw, exc, match):
    with pytest.raises(exc, match=match):
        _fp8_query(**kw)


def test_an_8bit_query_refuses_per_token_scales(monkeypatch):
    """(Scale arrays need a device: the checked scales stand in, per token and head.)"""
    from cupaged import _kvquant

    monkeypatch.setattr(_kvquant, "scales", lambda *a: _kvquant.NONE._replace(mode="th"))
    with pytest.raises(TypeError, match="an 8-bit query takes per-tensor k_scale"):
        _fp8_query()


def test_a_float8_query_of_the_other_format_is_refused():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with pytest.raises(TypeError, match="holds fp8 e5m2, but the cache is e4m3"):
        _fp8_query(query=ml_dtypes.float8_e5m2)
    assert _fp8_query(query=ml_dtypes.float8_e4m3fn).query_dtype.name == "e4m3"


@pytest.mark.parametrize("max_q", [1, 3, 300])
@pytest.mark.parametrize("hs", [64, 128])
def test_the_planner_takes_an_8bit_query_to_the_8bit_products(device_arch, hs, max_q):
    """The wgmma kernel with query_dtype whatever the row count (no other kernel multiplies
    8-bit values), its 128-key tiles, and no fixed offset under a bfloat16 soft-cap."""
    device_arch("sm_90")
    p = _fp8_query(hs=hs, out=np.float16)
    c = planning.choose_kernel(p, True, max_q)
    assert c.kind == "prefill" and c.sm90 and c.tile == jit.default_sm90_prefill_tile(
        hs, True, True) == (128, 3)
    assert c.q_tiles == -(-max_q * 4 // 128)
    planning.set_sm90_tile((64, 3))  # a tuning override: not the 8-bit products' shape
    try:
        assert planning.choose_kernel(p, True, max_q).tile == (128, 3)
    finally:
        planning.set_sm90_tile(None)


@pytest.mark.parametrize("arch, hs, layout, starts, match", [
    ("sm_80", 128, "NHD", True, "a Hopper GPU"),
    ("sm_90", 192, "NHD", True, r"head size 64 or 128 \(got 192\)"),
    ("sm_90", 128, "NHD", False, "query_start_loc"),
])
def test_an_8bit_query_where_the_8bit_products_do_not_run_is_refused(device_arch, arch, hs,
                                                                     layout, starts, match):
    device_arch(arch)
    p = _fp8_query(hs=hs, layout=layout)
    with pytest.raises(ValueError, match="an 8-bit query needs .*" + match):
        planning.choose_kernel(p, starts, 9)


def test_an_8bit_querys_spec_names_its_format(device_arch, monkeypatch):
    """plan_prefill asks for paged_prefill_sm90 with query_dtype, bfloat16 out and a
    soft-cap included (no fixed offset: P is 8-bit)."""
    from cupaged import _variants

    device_arch("sm_90")
    asked = []
    monkeypatch.setattr(planning, "prefill_sm90_kernel", lambda *a: asked.append(a) or
                        (_ for _ in ()).throw(RuntimeError("stop")))
    p = _fp8_query(out=np.float16)._replace(dtype=validation._dtypes.BF16)
    c = planning.choose_kernel(p, True, 64)
    v = _variants.Variants("c", soft_cap=30.0)
    with pytest.raises(RuntimeError, match="stop"):
        planning.plan_prefill(p, c, 64, 1000, v, False, None)
    (dev, dtype, hs, bs, letters, tile, cache, fmt, query), = asked
    assert (dtype, cache, query, fmt) == ("bf16", "e4m3", "e4m3", "tok")
    assert "f" not in letters and "c" in letters


def test_an_8bit_querys_memo_spans_its_16bit_out():
    """A repeat's overlap check (_prepared.overlaps) holds out's bytes against the query's:
    out of an 8-bit query is twice the query's bytes, so one placed to end inside the
    query overlaps it."""
    from cupaged import _prepared, launch

    p = _fp8_query()
    q, o = np.zeros((9, 8, 128), np.uint8), np.zeros((9, 8, 128), np.float16)
    va = validation.variant_args(None, None, None, None, False, None)
    prep = launch.prepared_call(None, p, Fake(q), Fake(o, ptr=1 << 30), va, None, "cupy", ())
    assert prep.out_bytes == o.nbytes
    base = 1 << 30
    assert _prepared.overlaps(prep, base, base - 10000)  # out ends 8,432 bytes into q
    assert not _prepared.overlaps(prep, base, base - o.nbytes)
