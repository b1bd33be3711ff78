"""The host mirrors of the kernels' geometry, the specialization catalog and its covering
set (no GPU needed)."""

import itertools
import os
import subprocess
import sys

import pytest

from cupaged import jit
from cupaged.specs import catalog
from cupaged.specs import covering
from cupaged.specs import geometry

ARCHS = ("sm_80", "sm_90")
ALL = catalog.all_specs(ARCHS)
# Shared memory and the static_asserts do not depend on the attention variant: the
# geometry checks run over the plain specializations (each variant repeats them).
DECODE = [s for s in ALL if s.kernel == "paged_decode" and not s.variant]
PREFILL = [s for s in ALL if s.kernel == "paged_prefill" and not s.variant]


def test_every_variant_repeats_the_plain_specializations():
    for kernel, plain, variants in (("paged_decode", DECODE, catalog.DECODE_VARIANTS),
                                    ("paged_prefill", PREFILL, catalog.PREFILL_VARIANTS)):
        mine = [s for s in ALL if s.kernel == kernel]
        # The soft-cap's fixed offset ("f") exists for bfloat16 queries only.
        fixed = [v for v in variants if "f" in v]
        bf16 = [s for s in plain if s.dtype == "bf16"]
        assert len(mine) == len(plain) * (len(variants) - len(fixed)) + len(bf16) * len(fixed)
        assert {s.variant for s in mine} == set(variants)


def test_every_supported_decode_specialization_satisfies_the_kernel_constraints():
    """Every static_assert of DecodeGeometry, and the shared memory of each target, for
    all specializations: what compiling a covering set cannot prove for the rest."""
    # Up to head size 256, 16-bit caches: 3 dtypes x 29 head sizes x 9 block sizes x 2
    # layouts x 4 group tiles; fp8: 2 query dtypes x 2 formats x 2 scale modes x 15 head
    # sizes (multiples of 16)
    small = [s for s in DECODE if s.head_size <= 256]
    assert len(small) == 2 * (3 * 29 * 9 * 2 * 4 + 2 * 2 * 2 * 15 * 9 * 2 * 4)
    # Above, 16 head sizes (multiples of 16 to 512): on sm_90 every one of 16-bit queries
    # (their own caches and the four fp8 ones); float32 and, on sm_80, vLLM's layout only
    # where the target's shared memory holds them (never float32 at 512)
    big = [s for s in DECODE if s.head_size > 256]
    assert sum(s.arch == "sm_90" and s.dtype != "f32" for s in big) == 2 * 16 * 9 * 2 * 4 * 5
    assert not [s for s in big if s.dtype == "f32" and s.head_size == 512]
    assert {s.head_size for s in big if s.arch == "sm_80" and s.dtype != "f32"} == \
        set(range(272, 513, 16))
    for s in DECODE:
        g = geometry.DecodeGeometry.of(s)
        assert g.violations() == [], s.name
        assert g.fits(s.arch), (s.name, g.smem_bytes)


def test_every_supported_prefill_specialization_satisfies_the_kernel_constraints():
    # vLLM's layout from block size 8 up (6 of 9 sizes; fp8 from 16: 5), the token-major
    # one for all 9; head sizes up to 128 (13 of 29; fp8: 7 of 15) in three tile shapes
    # (the default, few rows, warps sharing rows in pairs), and the 16 over 256 in two
    # (each target's: catalog.fitting_prefill_tile)
    assert len(PREFILL) == 2 * (2 * (29 + 2 * 13 + 2 * 16) * (9 + 6)
                                + 2 * 2 * 2 * (15 + 2 * 7 + 2 * 16) * (9 + 5))
    for s in PREFILL:
        g = geometry.PrefillGeometry.of(s)
        assert g.violations() == [], s.name
        assert g.fits(s.arch), (s.name, g.smem_bytes)


def test_every_supported_sm90_prefill_specialization_satisfies_the_kernel_constraints():
    sm90 = [s for s in ALL if s.kernel == "paged_prefill_sm90"]
    assert {s.arch for s in sm90} == {"sm_90a"}
    assert {s.head_size for s in sm90} == {64, 128, 192, 256, 384, 512}
    for s in sm90:
        g = geometry.Sm90PrefillGeometry.of(s)
        assert g.violations() == [], s.name
        assert g.fits(s.arch), (s.name, g.smem_bytes)
    geometry.check_against_kernel([s for s in sm90 if s.variant == ""])


def test_every_supported_mla_specialization_satisfies_the_kernel_constraints():
    mla = [s for s in ALL if s.kernel == "mla_attention"]
    assert {(s.head_size, s.rope_dim) for s in mla} == {(512, 64)}
    for s in mla:
        g = geometry.MlaGeometry.of(s)
        assert g.violations() == [], s.name
        assert g.fits(s.arch), (s.name, g.smem_bytes)
    # Shapes past a target's shared memory are not listed for it: 64 rows over three
    # 32-token stages need 202,000 bytes (sm_90's 227 KiB, not sm_80's 163).
    shapes = {a: {(s.rows, s.tile_tokens, s.stages) for s in mla if s.arch == a} for a in ARCHS}
    assert (64, 32, 3) in shapes["sm_90"] and (64, 32, 3) not in shapes["sm_80"]
    geometry.check_against_kernel([s for s in mla if s.block_size == 16])
    # Hopper's: sm_90a only, 16-bit and both fp8 caches, every block size
    sm90 = [s for s in ALL if s.kernel == "mla_attention_sm90"]
    assert {s.arch for s in sm90} == {"sm_90a"} and len(sm90) == 2 * 3 * 9
    assert {s.cache_dtype for s in sm90} == {"f16", "bf16", "e4m3", "e5m2"}
    for s in sm90:
        assert geometry.MlaSm90Geometry.of(s).fits(s.arch), (s.name, geometry.MlaSm90Geometry.of(s).smem_bytes)
    # every block size: which copy paths a page size takes (mla_sm90_producer, _tma)
    geometry.check_against_kernel(sm90)
    # The sparse forms (DSA): the mma.sync kernel over 16-bit caches and DeepSeek's token
    # rows (bfloat16 only: V3.2's 656-byte fp8_ds_mla rows, rope 64; V4's 528-byte v4_fp8
    # and 288-byte v4_fp4 rows, rope 0: 512-dim keys), the wgmma one on sm_90a over 16-bit
    # caches and fp8_ds_mla. Smaller stage rows leave room for more shapes: V4's fit the
    # (rows, tile, stages) shapes of 14 / 16 on sm_80 and 18 on sm_90. Each with a second
    # cache (variant "x") and without.
    sparse = [s for s in ALL if s.kernel == "mla_sparse_attention"]
    assert len([s for s in sparse if s.variant == "x"]) * 2 == len(sparse)
    ds = [s for s in sparse if s.cache_dtype == "dsmla"]
    assert {s.dtype for s in ds} == {"bf16"} and len(ds) == 2 * 9 * (13 + 17)
    width = {"dsmla": 656, "v4fp8": 528, "v4fp4": 288}
    for cache, n in (("v4fp8", 2 * 9 * (14 + 18)), ("v4fp4", 2 * 9 * (16 + 18))):
        v4 = [s for s in sparse if s.cache_dtype == cache]
        assert len(v4) == n and {(s.dtype, s.head_size, s.rope_dim) for s in v4} == {
            ("bf16", 512, 0)}, cache
    for s in sparse:
        g = geometry.MlaGeometry.of(s)
        assert g.violations() == [] and g.fits(s.arch), (s.name, g.smem_bytes)
        assert g.token_bytes == width.get(s.cache_dtype, 0), s.name
        assert s.rope_dim == (0 if s.cache_dtype.startswith("v4") else 64), s.name
    covered = {(s.cache_dtype, s.arch) for s in COVER if s.kernel == "mla_sparse_attention"}
    assert {(c, a) for c in ("v4fp8", "v4fp4") for a in ARCHS} <= covered  # CI compiles them
    assert {s.variant for s in COVER if s.kernel == "mla_sparse_attention"} == {"", "x"}
    sparse90 = [s for s in ALL if s.kernel == "mla_sparse_attention_sm90"]
    assert {s.arch for s in sparse90} == {"sm_90a"} and len(sparse90) == 2 * 5 * 9
    assert len([s for s in sparse90 if s.variant == "x"]) * 2 == len(sparse90)
    assert {s.cache_dtype for s in sparse90} == {"f16", "bf16", "dsmla", "v4fp8", "v4fp4"}
    for s in sparse90:
        g = geometry.MlaSm90Geometry.of(s)
        assert g.fits(s.arch), s.name
        assert s.rope_dim == (0 if s.cache_dtype.startswith("v4") else 64), s.name
        # V4's rows in two raw stages (tile i + 1 flies during tile i's widening), 656-byte
        # fp8_ds_mla rows in one (two would not fit beside Q and the widened tile)
        assert g.raw_stages == (1 if s.cache_dtype == "dsmla" else 2), s.name
        assert g.token_bytes == width.get(s.cache_dtype, 0), s.name
    geometry.check_against_kernel([s for s in sparse if s.block_size == 64] + sparse90)


def test_the_sm90_kernel_is_built_for_sm90a_only():
    assert jit.KernelSpec("paged_prefill_sm90", "f16", 64, 16).arch == "sm_90a"
    assert jit.KernelSpec("paged_prefill_sm90", "f16", 64, 16, arch="sm_90").arch == "sm_90a"
    for arch in ("sm_80", "sm_89", "compute_90", "sm_100"):
        with pytest.raises(ValueError, match="built for sm_90a only"):
            jit.KernelSpec("paged_prefill_sm90", "f16", 64, 16, arch=arch)
    assert catalog.kernel_archs("paged_prefill_sm90", ("sm_80", "sm_89")) == ()
    assert catalog.kernel_archs("paged_prefill_sm90", ("sm_80", "sm_90")) == ("sm_90a",)
    assert catalog.kernel_archs("paged_decode", ("sm_80", "sm_90")) == ("sm_80", "sm_90")


def test_the_mirror_agrees_with_the_kernel_for_every_specialization():
    """NVRTC evaluates DecodeGeometry for each of the 14,904 decode geometries and
    PrefillGeometry for the 4,898 prefill ones, and compares their shared memory, path and
    piece count with the host's (seconds: no kernel is built)."""
    geometry.check_against_kernel([s for s in DECODE + PREFILL if s.arch == "sm_90"])


@pytest.mark.parametrize("cache, block_size", [("", 4), ("e4m3", 8)])
def test_prefill_takes_vllm_layout_from_16_byte_runs(cache, block_size):
    """8-token blocks of 16-bit values, 16-token blocks of fp8."""
    spec = jit.KernelSpec("paged_prefill", "f16", 64, block_size, kv_format="vllm",
                          cache_dtype=cache)
    assert not catalog.supported(spec)
    assert "vLLM's value layout is copied in runs of 16 bytes of one block" in \
        geometry.PrefillGeometry.of(spec).violations()
    with pytest.raises(jit.CompileError, match="runs of 16 bytes"):
        jit.compile_check([spec])
    assert catalog.supported(jit.KernelSpec("paged_prefill", "f16", 64, 2 * block_size,
                                             kv_format="vllm", cache_dtype=cache))


def test_a_wrong_mirror_is_caught(monkeypatch):
    spec = jit.KernelSpec("paged_decode", "f16", 128, 16, 4)
    real = geometry.DecodeGeometry.smem_bytes
    monkeypatch.setattr(geometry.DecodeGeometry, "smem_bytes",
                        property(lambda g: real.fget(g) + 16))
    with pytest.raises(AssertionError, match=f"host mirror differs: {spec.name}"):
        geometry.check_against_kernel([spec])


@pytest.mark.parametrize("fields, message", [
    (dict(tile_tokens=16), "TILE_TOKENS"),
    (dict(tile_tokens=48), "TILE_TOKENS"),
    (dict(group_tile=3), "GROUP_TILE"),
    (dict(stages=1), "STAGES"),
    (dict(head_size=36), "HEAD_SIZE"),
])
def test_host_violations_match_the_kernels_static_asserts(fields, message):
    """Geometries outside the supported set: the host names the same static_assert NVRTC
    stops at."""
    base = dict(dtype="f16", head_size=64, block_size=16, group_tile=4, tile_tokens=64, stages=2)
    base.update(fields)
    spec = jit.KernelSpec("paged_decode", **base)
    assert message in geometry.DecodeGeometry.of(spec).violations()
    with pytest.raises(jit.CompileError, match=message):
        jit.compile_check([spec])


@pytest.mark.parametrize("fields", [
    dict(warps=6, key_warps=3),                     # 21 keys a warp: not whole 16-key steps
    dict(warps=4, key_warps=4, tile_tokens=32),     # 8 keys a warp
    dict(warps=3, key_warps=2),                     # sharing that does not divide the warps
    dict(warps=8, key_warps=2, head_size=384),      # heads over 256 dims: pairs on the dims
])
def test_host_prefill_violations_match_the_kernels_static_asserts(fields):
    """paged_prefill's warps sharing rows: where the host refuses a tile, NVRTC stops at
    the same static_assert."""
    base = dict(dtype="f16", head_size=128, block_size=16, warps=4, m_atoms=1, tile_tokens=64,
                stages=2)
    base.update(fields)
    spec = jit.KernelSpec("paged_prefill", **base)
    assert "KEY_WARPS" in geometry.PrefillGeometry.of(spec).violations()
    with pytest.raises(jit.CompileError, match="KEY_WARPS"):
        jit.compile_check([spec])


def test_specialization_names_are_unique():
    # paged_decode: 14904 per target for each of 8 variants; paged_prefill: 4898 for each of
    # 6 (1174 of them warps sharing rows in pairs), and the 2449 of bfloat16 for each of the 3
    # with the fixed offset; paged_prefill_sm90
    # for sm_90a only: 2 dtypes x (9 block sizes x (6 head sizes of 16-bit token-major
    # caches (384 and 512 among them), 2 fp8 formats x 3 head sizes) + vLLM's layout: 6
    # block sizes x 4 head sizes) for each of 6 variants, and its 132 of bfloat16 for each
    # of 3, and with an 8-bit query
    # over a cache of its format 2 dtypes x 2 formats x 2 head sizes (64, 128) x 9 block
    # sizes for each of the 6 (not the fixed offset's 3); the cache kernels:
    # reshape_and_cache 44, copy_blocks 2, concat_and_cache_mla 24 (2 dtypes x 6
    # cache types: the source's, 2 fp8 formats, fp8_ds_mla, v4_fp8, v4_fp4; x 2 index
    # types), merge_states 3, indexer_k_quant_and_cache 4,
    # indexer_logits 2 dtypes x 4 head counts x 7 block sizes x 2 row counts, indexer_topk 1,
    # widen_sparse_rows 1 (bfloat16 keys of fp8_ds_mla rows); the
    # combine 3 dtypes x 45 head sizes; mla_attention 2 dtypes x 9 block sizes x the
    # (rows, tile, stages) shapes each target's shared memory holds (11 on sm_80, 17 on
    # sm_90), and over fp8 caches 2 dtypes x 2 formats x 9 block sizes x their shapes (13
    # and 18: half the bytes a stage, beside a widened tile); mla_attention_sm90 for sm_90a
    # only: 2 dtypes x 3 cache types (the query's, 2 fp8 formats) x 9 block sizes;
    # mla_sparse_attention as many as mla_attention over 16-bit caches, and over
    # fp8_ds_mla rows (bfloat16 only) 9 block sizes x the shapes that hold their 656-byte
    # stage rows beside a widened tile (13 on sm_80, 17 on sm_90), over V4's 528-byte
    # v4_fp8 rows 9 x (14 + 18) and 288-byte v4_fp4 rows 9 x (16 + 18) (512-dim keys, a
    # smaller Q and widened tile), each with a second cache (variant "x") and without;
    # mla_sparse_attention_sm90 for sm_90a only: 2 dtypes x 9 block sizes over 16-bit
    # caches, 9 over each of the three token row formats, with a second cache and
    # without. Head sizes over 256 add 23,866
    # decode specializations (both targets) for each of 8 variants, and 9,088 prefill ones
    # for each of 6 and their 4,544 of bfloat16 for each of 3.
    assert len({s.name for s in ALL}) == len(ALL) == 2 * (14904 * 8 + 4898 * 6 + 2449 * 3 + 135
                                                          + 44 + 2 + 24 + 3 + 4 + 2 * 4 * 7 * 2
                                                          + 1 + 1) + 264 * 6 + 132 * 3 + 72 * 6 \
        + 2 * 9 * (11 + 17) + 2 * 2 * 9 * (13 + 18) + 2 * 3 * 9 + 23866 * 8 + 9088 * 6 + 4544 * 3 \
        + 2 * (2 * 9 * (11 + 17) + 9 * (13 + 17) + 9 * (14 + 18) + 9 * (16 + 18)) \
        + 2 * (2 * 9 + 3 * 9)


# ---- the covering set ------------------------------------------------------------------------

COVER = catalog.covering_specs(ARCHS)


def _pairs(specs, names) -> dict:
    """{(axis, axis): the pairs of values the specs have}, for every two axes."""
    cols = {n: [getattr(s, n) for s in specs] for n in names}
    return {(a, b): set(zip(cols[a], cols[b])) for i, a in enumerate(names) for b in names[i + 1:]}


@pytest.mark.parametrize("kernel", sorted(catalog.AXES))
def test_covering_set_covers_every_pair_of_every_kernel(kernel):
    """Every pair of values that some supported specialization has, in about as few
    specializations as any set can: the two largest axes' pairs (a lower bound), the
    decode code paths (below) and the extras covering_specs adds."""
    names = (*catalog.AXES[kernel], "arch")
    mine = [s for s in ALL if s.kernel == kernel]
    want = _pairs(mine, names)
    cover = [s for s in COVER if s.kernel == kernel]
    assert _pairs(cover, names) == want
    assert {getattr(s, n) for s in cover for n in names} == {getattr(s, n) for s in mine for n in names}
    assert all(catalog.supported(s) for s in cover)
    bound = max(map(len, want.values()), default=0)
    if kernel == "paged_decode":
        bound = max(bound, len({(s.arch, catalog.decode_path(s)) for s in mine}))
    extras = {"paged_prefill": 72 * 2, "paged_decode": 4}.get(kernel, 0)
    if kernel not in catalog.SMALL_KERNELS:
        assert bound <= len(cover) <= 1.1 * bound + extras, (len(cover), bound)


def test_covering_set_reaches_every_decode_code_path():
    """Tensor cores and V's layout depend on three or four axes at once: pairs alone
    missed 10 of the 30 (dtype, tile, path) combinations, so the choice covers every path
    as well."""
    for arch in ARCHS:
        want = {catalog.decode_path(s) for s in DECODE if s.arch == arch}
        got = {catalog.decode_path(s) for s in COVER if s.kernel == "paged_decode" and s.arch == arch}
        assert got == want


def test_covering_set_has_the_shared_memory_extremes():
    cover = set(COVER)
    for arch in ARCHS:
        smem = {s: geometry.DecodeGeometry.of(s).smem_bytes for s in DECODE if s.arch == arch}
        assert max(smem, key=smem.get) in cover and min(smem, key=smem.get) in cover


def test_covering_set_is_deterministic_and_small():
    """The same choice under other string hashes (a set's order would change with them)."""
    code = ("import itertools; from cupaged.specs import covering\n"
            "rows = [r for k, r in enumerate(itertools.product(*[[f'{a}{v}' for v in range(n)]\n"
            "        for a, n in zip('abcde', (9, 7, 5, 3, 2))])) if k % 5]\n"
            "print(covering.cover_pairs(rows, [r[0] + r[1] for r in rows]))\n")
    runs = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert len(runs) == 1
    assert len(COVER) == len(set(COVER)) and len(COVER) < len(ALL) / 100


def test_cover_sets_covers_the_union_greedily():
    sets = [frozenset({1, 2}), frozenset({2, 3, 4}), frozenset({4}), frozenset({1, 5}), frozenset()]
    picked = covering.cover_sets(sets)
    assert set().union(*(sets[i] for i in picked)) == {1, 2, 3, 4, 5}
    assert picked == [1, 3]  # {2, 3, 4} first, then {1, 5}
    assert covering.cover_sets([]) == [] and covering.cover_sets([frozenset()]) == []


@pytest.mark.parametrize("sizes", [(3,), (2, 2), (3, 2, 2), (4, 3, 3, 2), (29, 9, 4, 3, 2),
                                   (5, 5, 5, 5, 5)])
def test_cover_pairs_covers_every_pair_of_the_rows_given(sizes):
    """Over a full product, and over one with holes (rows that do not exist): every pair
    the rows have, in not many more rows than the two largest axes' product."""
    axes = {f"a{i}": [f"v{j}" for j in range(n)] for i, n in enumerate(sizes)}
    full = list(itertools.product(*axes.values()))
    rows = [full[i] for i in covering.cover_pairs(full)]
    assert covering.covers_all_pairs(axes, [dict(zip(axes, r)) for r in rows])
    top = sorted(sizes, reverse=True)
    if len(sizes) >= 2:
        assert top[0] * top[1] <= len(rows) <= top[0] * top[1] * 1.5
    else:
        assert len(rows) == top[0]
    holes = [r for k, r in enumerate(full) if k % 3 and not (r[0] == "v0" and r[-1] == "v1")]
    want = {(i, r[i], j, r[j]) for r in holes for i in range(len(r)) for j in range(i, len(r))}
    got = {(i, r[i], j, r[j]) for k in covering.cover_pairs(holes)
           for r in [holes[k]] for i in range(len(r)) for j in range(i, len(r))}
    assert got == want
    assert covering.cover_pairs(holes) == covering.cover_pairs(list(holes))


def test_cover_pairs_covers_the_keys_too():
    rows = [(a, b) for a in range(3) for b in range(3)]
    keys = [k % 5 for k in range(len(rows))]
    picked = covering.cover_pairs(rows, keys)
    assert {keys[i] for i in picked} == set(keys)
    assert {rows[i] for i in picked} == set(rows)  # 3 x 3: every row is needed
    assert covering.cover_pairs([]) == []
    for bad in ([(1, 2), (1, 2, 3)], [(), ()]):
        with pytest.raises(ValueError, match="rows must be tuples of one length"):
            covering.cover_pairs(bad)


def test_covers_all_pairs_notices_a_missing_pair():
    axes = {"x": [0, 1], "y": [0, 1]}
    assert not covering.covers_all_pairs(axes, [{"x": 0, "y": 0}, {"x": 1, "y": 1}])


def test_the_sm90_kernel_refuses_what_it_does_not_take():
    """Per-token fp8 scales go to the mma.sync kernel (a spec naming them for the Hopper
    kernel would build the per-tensor kernel under their name); it takes neither fp8 in
    vLLM's layout, nor that layout in blocks under 8 tokens, nor fp8 at head size 256."""
    with pytest.raises(ValueError, match="per-tensor scales only"):
        jit.KernelSpec("paged_prefill_sm90", "bf16", 128, 16, cache_dtype="e4m3", kv_scale="th")
    for fields in (dict(cache_dtype="e4m3", kv_format="vllm"), dict(kv_format="vllm"),
                   dict(cache_dtype="e4m3", head_size=256)):
        spec = jit.KernelSpec("paged_prefill_sm90", "bf16", fields.pop("head_size", 128),
                              4 if fields.get("kv_format") == "vllm" and "cache_dtype" not in
                              fields else 16, **fields)
        assert not catalog.supported(spec), spec.name


def test_heads_over_256_decode_in_three_stages_where_the_target_holds_them():
    """catalog.fitting_decode_stages: what the planner and the catalog both use."""
    def spec(hs, arch, dtype="bf16"):
        return catalog.fitting_decode_stages(jit.KernelSpec("paged_decode", dtype, hs, 16, 4,
                                                            arch=arch))
    assert spec(512, "sm_90").stages == 3 and "_t32x3_" in spec(512, "sm_90").name
    assert spec(512, "sm_80").stages == 2    # 221,808 bytes: past sm_80's 163 KiB
    assert spec(256, "sm_90").stages == 2    # up to 256: two, several CTAs an SM
    for s in (spec(512, "sm_90"), spec(384, "sm_80")):
        assert geometry.DecodeGeometry.of(s).fits(s.arch)
    three = {s.name for s in DECODE if s.stages == 3}
    assert spec(512, "sm_90").name in three and all("_t" in n for n in three)


def test_the_covering_set_is_what_the_planner_runs():
    """Every specialization CI compiles is one the planner may run (its tile and stages on
    its target), and for each class of head size the multi-token shapes it picks are
    among them (pairs of warps above 256, the smallest at 512 on sm_80)."""
    cov = COVER
    assert set(cov) <= set(ALL)
    shapes = {(s.arch, s.head_size, tuple(getattr(s, f) for f in jit.PREFILL_TILE))
              for s in cov if s.kernel == "paged_prefill"}
    for arch in ARCHS:
        for hs in (128, 272, 512):
            spec = jit.KernelSpec("paged_prefill", "bf16", hs, 16, arch=arch)
            for tile in catalog.prefill_tiles(spec):
                assert (arch, hs, tile) in shapes, (arch, hs, tile)
    assert ("sm_80", 512, (4, 1, 16, 2, 1)) in shapes
    assert ("sm_90", 512, (4, 1, 32, 2, 1)) in shapes
    assert ("sm_90", 128, (4, 1, 64, 2, 2)) in shapes  # warps sharing rows in pairs
    assert any(s.kernel == "paged_decode" and s.stages == 3 for s in cov)
