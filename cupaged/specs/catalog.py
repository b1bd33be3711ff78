"""Every supported specialization of every kernel, and the covering set CI compiles.

``all_specs`` is the full product of each kernel's axes (``cupaged-bench compile --all``:
thousands of NVRTC compiles, the check to run after changing a kernel template or a
geometry mirror). ``covering_specs`` is what the test suite compiles: per kernel, a
pairwise covering set of its supported specializations over its axes and the targets
(every value of every axis, and every pair of values of any two axes that some
specialization has, at least once), plus each target's largest and
smallest shared-memory decode specializations, and every specialization of the cache
kernels (small: all of them compile in about a second). Constraints that no compile of a
subset can prove for all (shared memory, static_asserts) are checked for every
specialization by their host mirrors (``geometry``), which needs no compiler.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from itertools import product

from .. import _checks, _dtypes, jit
from . import covering, geometry

GROUP_TILES = (1, 2, 4, 8)
KV_FORMATS = tuple(jit.KV_FORMATS)
# The cache's element type: "" the query's own, or an fp8 format; and its scales.
CACHE_DTYPES = ("", *_dtypes.FP8)
KV_SCALES = tuple(jit.KV_SCALES)
# Compile-time variants (cuda_src/variants.cuh): each alone and all together, so every
# pair with another axis' values meets each feature ("t" and "f" come with "c"; KernelSpec
# refuses "f" for f16, so those rows of the product are dropped).
DECODE_VARIANTS = ("", "w", "c", "b", "r", "ct", "wcb", "wcbr")
PREFILL_VARIANTS = ("", "w", "c", "a", "wca", "ct", "cf", "ctf", "wcf")
# paged_prefill_sm90's head sizes: wgmma's N of P V in steps of 64, and over 256 those
# whose halves are (a consumer's share of the dims).
SM90_HEAD_SIZES = tuple(h for h in _checks.HEAD_SIZES
                        if h % 64 == 0 and (h <= 256 or h % 128 == 0))

# Each kernel's template axes (its KernelSpec fields) and their supported values.
AXES = {
    "paged_decode": {"dtype": tuple(_dtypes.BY_NAME), "cache_dtype": CACHE_DTYPES,
                     "head_size": _checks.HEAD_SIZES, "block_size": _checks.BLOCK_SIZES,
                     "kv_format": KV_FORMATS, "kv_scale": KV_SCALES, "group_tile": GROUP_TILES,
                     "variant": DECODE_VARIANTS},
    "paged_prefill": {"dtype": ("f16", "bf16"), "cache_dtype": CACHE_DTYPES,
                      "head_size": _checks.HEAD_SIZES, "block_size": _checks.BLOCK_SIZES,
                      "kv_format": KV_FORMATS, "kv_scale": KV_SCALES,
                      "variant": PREFILL_VARIANTS},
    # Hopper only (jit.ARCH_ONLY): built for sm_90a where the targets include sm_90.
    # query_dtype: an 8-bit query over a cache of its format (8-bit products)
    "paged_prefill_sm90": {"dtype": ("f16", "bf16"), "cache_dtype": CACHE_DTYPES,
                           "head_size": SM90_HEAD_SIZES, "block_size": _checks.BLOCK_SIZES,
                           "kv_format": KV_FORMATS, "query_dtype": ("", *_dtypes.FP8),
                           "variant": PREFILL_VARIANTS},
    # (512: mla_attention's split-KV, whose outputs are kv_lora_rank wide)
    "paged_decode_combine": {"dtype": tuple(_dtypes.BY_NAME),
                             "head_size": tuple(sorted({*_checks.HEAD_SIZES, 512}))},
    "reshape_and_cache": {"dtype": tuple(_dtypes.BY_NAME), "cache_dtype": CACHE_DTYPES,
                          "kv_format": KV_FORMATS, "kv_scale": KV_SCALES,
                          "index_dtype": ("i32", "i64")},
    "copy_blocks": {"index_dtype": ("i32", "i64")},
    # MLA's latent cache write: 16-bit sources (kv_c and k_pe of a model's dtype), into a
    # cache of their type, fp8, or DeepSeek's sparse rows ("dsmla": V3.2's, vLLM's
    # fp8_ds_mla; "v4fp8", "v4fp4": V4's)
    "concat_and_cache_mla": {"dtype": ("f16", "bf16"),
                             "cache_dtype": (*CACHE_DTYPES, *_dtypes.SPARSE_MLA),
                             "index_dtype": ("i32", "i64")},
    "merge_states": {"dtype": tuple(_dtypes.BY_NAME)},
    "indexer_k_quant_and_cache": {"dtype": ("f16", "bf16"), "index_dtype": ("i32", "i64")},
    # fp8_ds_mla's rows as bfloat16 keys (sparse_mla_attention's prefill over many tokens)
    "widen_sparse_rows": {"dtype": ("bf16",), "cache_dtype": ("dsmla",)},
    # its logits: 16 to 64 query heads a CTA, pages of 4 to 256 tokens, one query row a CTA
    # or a sequence's two (next_n 2 and more)
    "indexer_logits": {"dtype": ("f16", "bf16"), "rows": (16, 32, 48, 64),
                       "block_size": tuple(b for b in _checks.BLOCK_SIZES if b >= 4),
                       "group_tile": (1, 2)},
    "indexer_topk": {"dtype": ("f32",)},
    # Absorbed MLA over DeepSeek's latent cache (kv_lora_rank 512, 64 rotary dims): every
    # page size and each (rows, tile, stages) shape the planner picks (MLA_TILES).
    "mla_attention": {"dtype": ("f16", "bf16"), "cache_dtype": CACHE_DTYPES,
                      "head_size": (512,), "rope_dim": (64,),
                      "block_size": _checks.BLOCK_SIZES, "rows": (16, 32, 64),
                      "tile_tokens": (16, 32), "stages": (2, 3, 4)},
    # DeepSeek's sparse attention (mla_attention's body, its shapes), over 16-bit caches
    # and DeepSeek's token rows (bfloat16 queries): V3.2's fp8_ds_mla ("dsmla"), V4's
    # ("v4fp8", "v4fp4"). No rope_dim axis: the spec's default is the cache's (64, V4's 0).
    # Variant "x": a second cache (V4's extra_k_cache).
    "mla_sparse_attention": {"dtype": ("f16", "bf16"),
                             "cache_dtype": ("", *_dtypes.SPARSE_MLA),
                             "head_size": (512,),
                             "block_size": _checks.BLOCK_SIZES, "rows": (16, 32, 64),
                             "tile_tokens": (16, 32), "stages": (2, 3, 4),
                             "variant": ("", "x")},
    # Hopper only (jit.ARCH_ONLY)
    "mla_attention_sm90": {"dtype": ("f16", "bf16"), "cache_dtype": CACHE_DTYPES,
                           "head_size": (512,), "rope_dim": (64,),
                           "block_size": _checks.BLOCK_SIZES},
    # Hopper only, its sparse form over 16-bit caches and DeepSeek's token rows (bfloat16
    # queries; no rope_dim axis, as mla_sparse_attention's), with a second cache or without
    "mla_sparse_attention_sm90": {"dtype": ("f16", "bf16"),
                                  "cache_dtype": ("", *_dtypes.SPARSE_MLA),
                                  "head_size": (512,), "block_size": _checks.BLOCK_SIZES,
                                  "variant": ("", "x")},
}

# Kernels small enough to compile every specialization of, not just a covering set (the
# cache kernels: 44, 2, 24, 3 and 4 per target, and the indexer's top-k, a few seconds in
# all).
SMALL_KERNELS = ("reshape_and_cache", "copy_blocks", "concat_and_cache_mla", "merge_states",
                 "indexer_k_quant_and_cache", "indexer_topk", "widen_sparse_rows")


def supported(spec: jit.KernelSpec) -> bool:
    """Axis values that exist alone but not together: fp8 caches take float16/bfloat16
    queries and head sizes that are multiples of 16, and only they have per-token-head
    scales; paged_prefill copies vLLM's value layout in 16-byte runs of one block, so it
    takes that layout from 8-token blocks up (16 for fp8; smaller ones go to the decode
    kernel's row mode); paged_prefill_sm90 takes fp8 caches token-major up to head size
    192, vLLM's layout in blocks of 8 tokens or more up to head size 256; an 8-bit query
    up to head size 128 (its geometry's violations)."""
    if spec.cache_dtype in _dtypes.SPARSE_MLA and spec.kernel != "concat_and_cache_mla" \
            and spec.dtype != "bf16":
        return False  # the readers of token rows take bfloat16 queries
    if spec.kernel in jit.MLA_MMA_KERNELS:  # its (rows, tile, stages) where the target holds them
        return geometry.MlaGeometry.of(spec).fits(spec.arch)
    fp8 = spec.cache_dtype in _dtypes.FP8
    if fp8 and (spec.dtype == "f32" or spec.head_size % 16):
        return False
    if spec.kv_scale and not fp8:
        return False
    if spec.kernel == "paged_prefill_sm90":
        if fp8 and (spec.head_size > 192 or spec.kv_format == "vllm"):
            return False  # its raw fp8 stages: token-major, and beside the ring up to 192
        if spec.head_size > 256 and spec.kv_format == "vllm":
            return False  # its consumers' halves of the dims: token-major caches
        if spec.kv_format == "vllm" and spec.block_size < 8:
            return False  # vLLM's value in 16-byte runs of one block
        if spec.query_dtype and geometry.Sm90PrefillGeometry.of(spec).violations():
            return False
    if spec.kernel == "paged_decode":
        # Past the target's shared memory (float32 heads over 256 dims, the largest tiles of
        # vLLM's layout on sm_80): the planner names the limit instead.
        return geometry.DecodeGeometry.of(spec).fits(spec.arch)
    return not (spec.kernel == "paged_prefill" and spec.kv_format == "vllm"
                and spec.block_size < (16 if fp8 else 8))


def _spec(kernel: str, **fields) -> jit.KernelSpec | None:
    """The spec, or None when its axis values do not go together (KernelSpec refuses
    some combinations itself, `supported` the rest)."""
    try:
        spec = jit.KernelSpec(kernel, **fields)
    except ValueError:
        return None
    return spec if supported(spec) else None


def fitting_prefill_tile(spec: jit.KernelSpec, rows: int,
                         max_smem: int | None = None) -> tuple | None:
    """The tile (``jit.PREFILL_TILE``) cupaged.planning runs paged_prefill in for
    ``spec``'s types, head and block size, layout and target, where a (sequence, KV head)
    has at most ``rows`` packed query rows (0: more than ``jit.FEW_ROWS``): the default
    or the few-rows shape, else the first of ``jit.smaller_prefill_tiles`` whose shared
    memory fits ``max_smem`` (default: the target's, ``geometry.max_smem``; the planner
    passes the device's own); None where none does."""
    hs = spec.head_size
    limit = geometry.max_smem(spec.arch) if max_smem is None else max_smem
    first = (jit.few_rows_prefill_tile(hs, rows) if 0 < rows <= jit.FEW_ROWS
             else jit.default_prefill_tile(hs))
    for tile in (first, *jit.smaller_prefill_tiles(hs, first)):
        g = geometry.PrefillGeometry.of(with_prefill_tile(spec, tile))
        if g.smem_bytes <= limit:
            return tile
    return None


def with_prefill_tile(spec: jit.KernelSpec, tile: tuple) -> jit.KernelSpec:
    """``spec`` (paged_prefill) in ``tile`` (``jit.PREFILL_TILE``'s fields)."""
    return replace(spec, **dict(zip(jit.PREFILL_TILE, tile)))


def fitting_decode_stages(spec: jit.KernelSpec) -> jit.KernelSpec:
    """paged_decode in three stages above head size 256 where two stages already leave a
    single CTA an SM and the target holds three, else ``spec`` (two): the third stage
    keeps more bytes in flight for the lone CTA (H100, head size 512, batch 64 x 4096:
    87.0% of the copy bandwidth against 85.0%, docs/PERFORMANCE.md); where two stages let
    two CTAs share an SM, those hide each other's latency instead."""
    if spec.head_size <= 256 or spec.stages != 2:
        return spec
    if geometry.DecodeGeometry.of(spec).ctas_per_sm(spec.arch) > 1:
        return spec
    three = replace(spec, stages=3)
    return three if geometry.DecodeGeometry.of(three).fits(spec.arch) else spec


def prefill_tiles(spec: jit.KernelSpec) -> tuple:
    """The shapes cupaged.planning may pick for paged_prefill on ``spec``'s target: the
    fitting default shape and those for at most ``jit.FEW_ROWS`` and ``jit.FEWEST_ROWS``
    packed rows (``fitting_prefill_tile``)."""
    tiles = (fitting_prefill_tile(spec, rows)
             for rows in (0, jit.FEW_ROWS, jit.FEWEST_ROWS))
    return tuple(dict.fromkeys(t for t in tiles if t is not None))


def _with_tiles(spec: jit.KernelSpec) -> list:
    if spec.kernel == "paged_decode":
        return [fitting_decode_stages(spec)]
    if spec.kernel != "paged_prefill":
        return [spec]
    return [with_prefill_tile(spec, tile) for tile in prefill_tiles(spec)]


def all_specs(archs) -> list[jit.KernelSpec]:
    """The full product: every supported specialization of every kernel, every target
    (paged_prefill in each tile shape its planner may pick)."""
    return list(_all_specs(tuple(archs)))


@lru_cache(maxsize=4)
def _all_specs(archs: tuple) -> tuple:
    """all_specs, built once per set of targets (about 370,000 specs for sm_80 and sm_90).
    Whether a specialization is supported, and its tiles, do not depend on its variant
    (the last axis): each is worked out once for the plain spec, and its variants are
    copies of it, in the product's order."""
    specs = []
    for kernel, axes in AXES.items():
        names = [n for n in axes if n != "variant"]
        assert "variant" not in axes or list(axes)[-1] == "variant"  # the product's order
        for arch in kernel_archs(kernel, archs):
            for values in product(*(axes[n] for n in names)):
                plain = _spec(kernel, arch=arch, **dict(zip(names, values)))
                if plain is None:
                    continue
                tiled = _with_tiles(plain)
                for v in axes.get("variant", ("",)):
                    try:
                        specs += [replace(t, variant=v) for t in tiled] if v else tiled
                    except ValueError:  # "f" without bfloat16
                        pass
    return tuple(specs)


def kernel_archs(kernel: str, archs) -> tuple:
    """The targets of ``archs`` a kernel is built for: all of them, or its own
    (``jit.ARCH_ONLY``) where they include it or its plain form (sm_90 for sm_90a)."""
    own = jit.ARCH_ONLY.get(kernel)
    if own is None:
        return tuple(archs)
    return (own,) if own in archs or own.rstrip("a") in archs else ()


def decode_path(spec) -> tuple:
    """What selects the code a decode specialization compiles: its element types and scale
    mode, its tile
    and group tile, and the branches DecodeGeometry derives from several axes at once
    (tensor cores, V's shared-memory layout), which pairs of axes alone may miss."""
    g = geometry.DecodeGeometry.of(spec)
    return (spec.dtype, spec.cache_dtype, spec.kv_scale, spec.tile_tokens, spec.group_tile,
            spec.kv_format, g.mma, g.v_transposed)


def covering_specs(archs) -> list[jit.KernelSpec]:
    """A pairwise covering set of each kernel's supported specializations for ``archs``
    (``covering.cover_pairs`` over its axes and the target), which for paged_decode also
    reaches every code path (``decode_path``) of each target; plus each target's decode
    specializations with the most and the least shared memory; paged_prefill in every
    tile shape of each class of head size; and every specialization of the
    ``SMALL_KERNELS``."""
    return list(_covering_specs(tuple(archs)))


@lru_cache(maxsize=4)
def _covering_specs(archs: tuple) -> tuple:
    specs = []
    full = all_specs(archs)
    for kernel, axes in AXES.items():
        names = (*axes, "arch")
        mine = [s for s in full if s.kernel == kernel]
        if not mine:
            continue
        # decode: every code path per target too (decode_path), in the same greedy choice
        keys = [(s.arch, decode_path(s)) for s in mine] if kernel == "paged_decode" else None
        picked = covering.cover_pairs([tuple(getattr(s, n) for n in names) for s in mine], keys)
        specs += [mine[i] for i in picked]
        if kernel in SMALL_KERNELS:
            specs += mine
        if kernel == "paged_prefill":  # every tile shape, per dtype, layout and target, in
            # each class of head size (pairs of warps above 256, and at 512 the smallest)
            for arch, dtype, fmt, hs in product(archs, axes["dtype"], axes["kv_format"],
                                                (128, 272, 512)):
                specs += _with_tiles(jit.KernelSpec(kernel, dtype, hs, 16, kv_format=fmt,
                                                    arch=arch))
    for arch in archs:  # (shared memory does not depend on the variant)
        decode = [s for s in full if s.kernel == "paged_decode" and s.arch == arch
                  and not s.variant]
        smem = [geometry.DecodeGeometry.of(s).smem_bytes for s in decode]
        specs.append(decode[smem.index(max(smem))])
        specs.append(decode[smem.index(min(smem))])
    return tuple(dict.fromkeys(specs))
