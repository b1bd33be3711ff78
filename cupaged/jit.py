"""Run-time specialization: kernel specs, NVRTC compilation and the kernel caches.

A :class:`KernelSpec` names one instantiation of a kernel template in ``cuda_src/``. It is
compiled with NVRTC (called directly, so compiling needs no GPU), the binary is kept in a
disk cache under a readable file name (verified by size and digest before each use), and
loaded per device through CuPy's module API.

The cache key hashes the whole source (every project header is inlined into it), the
template instantiation, the compiler options, the NVRTC version and build (a patch
release may generate other code) and the target, so an edited ``.cuh`` can never load a
stale binary. CuPy's own cache is not used: it keys on
the top-level source string only and names its files by hash.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from . import _dtypes

try:  # CuPy's driver binding (cuLaunchKernel, kernel attributes); loading it needs no GPU
    from cupy_backends.cuda.api import driver
except ImportError:  # pragma: no cover
    driver = None

__all__ = [
    "CompileError",
    "KernelSpec",
    "cache_dir",
    "compile_check",
    "load",
    "precompile",
    "source_dir",
]

CXX_STD = "-std=c++17"


class CompileError(RuntimeError):
    """NVRTC rejected a specialization; the message carries its name and the log."""


# ---- the kernels: template name -> entry file and template parameters ---------------------

_DECODE_PARAMS = ("dtype", "cache_dtype", "head_size", "block_size", "kv_format", "kv_scale",
                  "group_tile", "tile_tokens", "stages", "variant")
_PREFILL_PARAMS = ("dtype", "cache_dtype", "head_size", "block_size", "kv_format", "kv_scale",
                   "warps", "m_atoms", "key_warps", "tile_tokens", "stages", "variant")
# The Hopper multi-token kernel: token-major caches of the query's type or fp8 with
# per-tensor scales, vLLM's layout of the query's type; its own tile shape; and an 8-bit
# query over a cache of its format (query_dtype, the template's last argument: 8-bit
# products, dtype then the output's type).
_PREFILL_SM90_PARAMS = ("dtype", "cache_dtype", "head_size", "block_size", "kv_format",
                        "tile_tokens", "stages", "variant", "query_dtype")
# Absorbed MLA: head_size is the latent rank (kv_c's and the output's dims), rope_dim the
# rotary part of the key; rows packed query rows per CTA.
_MLA_PARAMS = ("dtype", "cache_dtype", "head_size", "rope_dim", "block_size", "rows",
               "tile_tokens", "stages")
_MLA_SM90_PARAMS = ("dtype", "cache_dtype", "head_size", "rope_dim", "block_size")
_KERNELS = {
    "paged_decode": ("paged_decode.cu", _DECODE_PARAMS),
    "paged_prefill": ("paged_prefill.cu", _PREFILL_PARAMS),
    "paged_prefill_sm90": ("paged_prefill_sm90.cu", _PREFILL_SM90_PARAMS),
    "paged_decode_combine": ("paged_decode.cu", ("dtype", "head_size")),
    "mla_attention": ("mla_attention.cu", _MLA_PARAMS),
    # its sparse form (DSA), over 16-bit caches and DeepSeek's token rows (V3.2's, V4's)
    "mla_sparse_attention": ("mla_attention.cu", _MLA_PARAMS + ("variant",)),
    # Hopper's: 64 rows over 64-token tiles in two stages; 16-bit or fp8 caches
    "mla_attention_sm90": ("mla_attention_sm90.cu", _MLA_SM90_PARAMS),
    # its sparse form (DSA), over 16-bit caches and DeepSeek's token rows (V3.2's, V4's);
    # variant "x" a second cache, as mla_sparse_attention's
    "mla_sparse_attention_sm90": ("mla_attention_sm90.cu", _MLA_SM90_PARAMS + ("variant",)),
    "reshape_and_cache": ("cache_ops.cu", ("dtype", "cache_dtype", "kv_format", "kv_scale",
                                           "index_dtype")),
    "copy_blocks": ("cache_ops.cu", ("index_dtype",)),
    # cache_dtype: the source's, an fp8 format, or a sparse cache's rows ("dsmla":
    # DeepSeek-V3.2's; "v4fp8", "v4fp4": V4's)
    "concat_and_cache_mla": ("cache_ops.cu", ("dtype", "cache_dtype", "index_dtype")),
    # DSA's lightning indexer: its keys into their fp8 cache, and its logits over them
    # (rows: the query heads a CTA holds; group_tile: the query rows, 1 or 2, of one
    # sequence that share its key tiles)
    "indexer_k_quant_and_cache": ("cache_ops.cu", ("dtype", "index_dtype")),
    # a sparse cache's token rows widened to 16-bit keys (dtype: the keys')
    "widen_sparse_rows": ("cache_ops.cu", ("dtype", "cache_dtype")),
    "indexer_logits": ("indexer.cu", ("dtype", "rows", "block_size", "group_tile")),
    "indexer_topk": ("indexer.cu", ("dtype",)),
    "merge_states": ("merge_states.cu", ("dtype",)),
}
# The sparse MLA kernels (DSA), each of the two families': variant "x" reads a second cache.
SPARSE_MLA_READERS = ("mla_sparse_attention", "mla_sparse_attention_sm90")
# The MLA kernels that take tensor maps (mla_attention_sm90.cuh's MlaTma).
MLA_TMA_READERS = ("mla_attention_sm90",)
# The kernels that take the sparse MLA cache types (_dtypes.SPARSE_MLA) as their
# cache_dtype, every one of them: the writer and the readers (V4's with rope_dim 0: their
# 512 dims hold the rotary ones).
SPARSE_MLA_KERNELS = ("concat_and_cache_mla", "widen_sparse_rows", *SPARSE_MLA_READERS)
# Each kernel's parameter list as a struct format, one token per parameter (P pointer,
# q int64, i int32, f float32, Ns a struct of N bytes passed by value), for Launcher.
# tests/test_jit.py checks these against the symbols NVRTC mangles.
# A struct passed by value is either its bytes ("56s": packed by the caller) or its fields
# in braces (one kernel parameter packed in the same pack_into as the others: PagedKV's
# fields change with every call's pointers, and a separate pack would cost a microsecond).
PAGED_KV_FORMAT = "{PPqqqqqqPqiiPPqqff}"  # PagedKV (kv_layout.cuh), 128 bytes
ARG_FORMATS = {
    "paged_decode": f"PPPPPPqq{PAGED_KV_FORMAT}PPPiiiiif56s",  # VariantParams (56 bytes)
    "paged_prefill": f"PPPPiPqq{PAGED_KV_FORMAT}PPPiiif56s",
    # paged_prefill's, with its jobs (num_seqs, ranks) after split_tiles
    "paged_prefill_sm90": f"PPPPiiiPqq{PAGED_KV_FORMAT}PPPiiif56s",
    "paged_decode_combine": "PPPPPPiiiii56s",
    # partials, split_tiles, row tiles; q latent / rope and their strides; cache latent / rope and
    # their strides; table, its stride, max_blocks, num_blocks; the fp8 scale (pointer,
    # value); lengths, starts; heads, causal, scale
    "mla_attention": "PPPPiiPPqqqqPPqqqqPqiiPfPPiif56s",
    # mla_attention's, then lengths_per, strict and the second cache (MlaSparseExtra)
    "mla_sparse_attention": "PPPPiiPPqqqqPPqqqqPqiiPfPPiifii72s56s",
    # mla_attention's, then MlaTma (launch.MLA_TMA: two 128-byte tensor maps and a flag;
    # its 64-byte alignment in the kernel's parameter space is the driver's doing, which
    # copies each parameter through its own pointer, so the flat buffer's offsets differ)
    "mla_attention_sm90": "PPPPiiPPqqqqPPqqqqPqiiPfPPiif56s320s",
    # mla_sparse_attention's
    "mla_sparse_attention_sm90": "PPPPiiPPqqqqPPqqqqPqiiPfPPiifii72s56s",
    "reshape_and_cache": "PqqPqqPqqqPqqqPiiiqiPPqqff",
    "copy_blocks": "3072sPqqq",  # CopyTable (96 x 4 int64) by value
    # sources; latent and rope destinations; slots, num_tokens, widths, block size,
    # num_slots, vec, the fp8 scale (pointer, value)
    "concat_and_cache_mla": "PqPqPqqPqqPiiiiqiPf",
    # k, its token stride; the cache, its block stride; slots, num_tokens, head_dim,
    # quant_block_size, block size, num_slots, ue8m0
    "indexer_k_quant_and_cache": "PqPqPiiiiqi",
    "widen_sparse_rows": "PqPqq",  # rows, their stride (bytes); out, its row stride; rows
    # out, its row stride, width; q, its row and head strides; weights, their row stride;
    # the cache, its block stride, num_blocks; tables, their stride, max_blocks; lengths,
    # next_n
    "indexer_logits": "PqiPqqPqPqiPqiPi",
    # out, its row stride; logits, their row stride; width, topk; block tables (0: columns
    # out), their row stride, max_blocks, block size, next_n
    "indexer_topk": "PqPqiiPqiii",
    "merge_states": "392sPqqPqqqiiii",  # MergeInputs (8 partials) by value
}
ARG_TOKEN = re.compile(r"\{[^}]*\}|\d*[a-zA-Z?]")  # one kernel parameter
_INDEX_CXX = {"i32": "int", "i64": "long long"}
# KVFormat in cuda_src/kv_layout.cuh: "tok" for token-major caches (NHD, HND, fused views),
# "vllm" for vLLM's legacy x-split key and dimension-major value.
KV_FORMATS = {"tok": 0, "vllm": 1}
# KVScale in cuda_src/kv_layout.cuh: how an fp8 cache's scales come. "" one per tensor (and
# caches of the query's type, which have none), "th" one per (token, KV head).
KV_SCALES = {"": 0, "th": 1}
# VariantBits in cuda_src/variants.cuh: the compile-time variants, spelled in a spec as
# letters in this order ("" plain attention, "wc" window and soft-cap, ...).
VARIANT_BITS = {"w": 1, "c": 2, "t": 128, "b": 4, "a": 8, "f": 16, "r": 32, "x": 64}


def default_decode_tile(itemsize: int, head_size: int, fp8: bool = False) -> int:
    """Tokens per pipeline tile: about 16 KiB of K (and of V) per stage at the query's
    ``itemsize``, a power of two in [32, 256]. Large enough to keep many bytes in flight,
    small enough for two or three CTAs per SM. An fp8 cache takes the same tokens (half
    the bytes per stage, so about five CTAs per SM; 128-token tiles and three stages
    measured no faster on an H100, docs/PERFORMANCE.md), and at least 64: the FMA path
    walks V in 16-byte runs of tokens per warp."""
    tokens = max(1, 16384 // (head_size * itemsize))
    tokens = 1 << (tokens.bit_length() - 1)
    return min(256, max(64 if fp8 else 32, tokens))


# paged_prefill's tile: (warps, m_atoms, tile_tokens, stages, key_warps), the last the warps
# that share each row, splitting every K/V tile's keys between them (1: none).
PREFILL_TILE = ("warps", "m_atoms", "tile_tokens", "stages", "key_warps")


def prefill_tile_name(tile: tuple) -> str:
    """A paged_prefill tile as spec names and test ids spell it: ``w4m1n64x2``, with
    ``k4`` after it where warps share rows."""
    w, m, n, st, kw = tile
    return f"w{w}m{m}n{n}x{st}" + (f"k{kw}" if kw > 1 else "")


def default_prefill_tile(head_size: int) -> tuple[int, int, int, int, int]:
    """The tile of paged_prefill: up to head size 128, FlashAttention-2's shape, four
    warps of 32 query rows over 64-token K/V tiles, two stages (the fastest of nine shapes
    measured on an H100, docs/PERFORMANCE.md); above, the 32 rows' accumulators do not fit
    in registers, so four warps of 16 rows over 32-token tiles; above 256, where pairs of
    warps share a row's dims, eight warps (64 rows, as at 256)."""
    if head_size <= 128:
        return 4, 2, 64, 2, 1
    return (4, 1, 32, 2, 1) if head_size <= 256 else (8, 1, 32, 2, 1)


# Packed query rows per (sequence, KV head) up to which paged_prefill takes the few-rows
# tile, and up to which (head sizes to 128) the tile whose warps share rows in pairs.
FEW_ROWS = 64
FEWEST_ROWS = 32


def few_rows_prefill_tile(head_size: int, rows: int = FEW_ROWS) -> tuple:
    """The tile for a (sequence, KV head) with at most ``rows`` packed query rows
    (FEW_ROWS or fewer): four warps of 16 rows (two pairs above head size 256), so fewer
    rows are padding; up to FEWEST_ROWS (verify's 4 tokens x 4 heads are 16) and head
    size 128, four warps as two pairs, each pair on 16 rows and each warp of it on half of
    every 64-token tile's keys: 32 rows a CTA, and half the tile's mma work a warp
    (H200: 1.07x on verify's 16 rows, 1.13x on 32; four warps on 16 rows ran slower,
    docs/PERFORMANCE.md)."""
    if rows <= FEWEST_ROWS and head_size <= 128:
        return 4, 1, 64, 2, 2
    return (4, 1, 64, 2, 1) if head_size <= 128 else (4, 1, 32, 2, 1)


def smaller_prefill_tiles(head_size: int, tile: tuple) -> tuple:
    """Shapes of paged_prefill with less shared memory than ``tile``, in the order the
    planner tries them where ``tile`` does not fit (sm_86/89's 99 KiB): 16 rows a warp,
    then 32- and 16-token K/V tiles, then half the warps at a time, down to one warp (a
    pair above head size 256); warps on rows of their own."""
    least = 2 if head_size > 256 else 1
    warps, _, tokens, stages, _ = tile
    out = [(warps, 1, tokens, stages, 1), (warps, 1, min(tokens, 32), 2, 1),
           (warps, 1, 16, 2, 1)]
    while warps > least:
        warps //= 2
        out.append((warps, 1, 16, 2, 1))
    return tuple(t for t in dict.fromkeys(out) if t != tile)


def default_sm90_prefill_tile(head_size: int, fp8: bool = False,
                              fp8_query: bool = False) -> tuple[int, int]:
    """(tile_tokens, stages) of paged_prefill_sm90: 128-token K/V tiles up to head size
    128 (S of 64 rows x 128 keys, P and O fit the consumers' registers beside each
    other), 64 above (O alone is 64 x 256 fp32 over a warpgroup: 128 registers a
    thread); three stages where 227 KiB hold them (a consumer holds two at once: tile j's
    K and tile j - 1's V), two at head size 256. An fp8 cache also keeps two raw stages
    of its bytes: 64-token tiles, two stages above head size 128 (at 256 nothing fits).
    An 8-bit query (8-bit products, head sizes 64 and 128) takes 128-token tiles, whose
    V^T rows are whole 128-byte blocks, in three stages (176 KB at head size 128). Over
    256 dims (384, 512: both consumers on the same 64 rows, each half the dims) 32-token
    tiles in two stages: with the partial scores, 230,496 bytes at 512."""
    if fp8_query:
        return 128, 3
    if head_size > 256:
        return 32, 2
    if fp8:
        return 64, (3 if head_size <= 128 else 2)
    return (128 if head_size <= 128 else 64), (2 if head_size > 192 else 3)


def default_mla_tile() -> tuple[int, int, int, int]:
    """(rope_dim, rows, tile_tokens, stages) of mla_attention when a spec leaves them 0:
    DeepSeek's 64 rotary dims, 16 rows (16 heads of one decode token), 32-token tiles
    (37 KB of latent cache each), two stages. The planner picks its own per call."""
    return 64, 16, 32, 2


# The targets each kernel is built for when not every one: wgmma and setmaxnreg are
# sm_90a's (Hopper's architecture-specific features; no other GPU runs them).
ARCH_ONLY = {"paged_prefill_sm90": "sm_90a", "mla_attention_sm90": "sm_90a",
             "mla_sparse_attention_sm90": "sm_90a"}
# The wgmma MLA kernels (one body, mla_attention_sm90.cuh): paged and sparse.
MLA_SM90_KERNELS = ("mla_attention_sm90", "mla_sparse_attention_sm90")
# The mma.sync MLA kernels (one body, mla_attention.cuh): paged and sparse (DSA).
MLA_MMA_KERNELS = ("mla_attention", "mla_sparse_attention")


@dataclass(frozen=True)
class KernelSpec:
    """One specialization of a kernel template: everything that is a compile-time
    constant, plus the target architecture.

    Fields a kernel does not take are left at 0. ``tile_tokens``, ``stages``, ``warps``,
    ``m_atoms`` and ``key_warps`` default (0) to the tuned choice for the kernel, dtype and
    head size.
    """

    kernel: str
    dtype: str = ""  # "f32" | "f16" | "bf16": the query's (and the output's)
    head_size: int = 0
    block_size: int = 0
    group_tile: int = 0
    tile_tokens: int = 0
    stages: int = 0
    index_dtype: str = ""  # "i32" | "i64": slot or block-id arrays
    kv_format: str = ""  # "tok" | "vllm" (KV_FORMATS); default "vllm", prefill "tok"
    warps: int = 0  # paged_prefill: warps per CTA
    m_atoms: int = 0  # paged_prefill: 16-row mma tiles per warp
    rope_dim: int = 0  # mla_attention: the key's rotary dims after the latent head_size
    #                    (left 0: 64, or 0 over V4's rows, which hold them inside)
    rows: int = 0  # mla_attention: packed query rows (tokens x heads) per CTA
    cache_dtype: str = ""  # the cache's: "e4m3" | "e5m2" (fp8), or "" / dtype for the same;
    #                        "dsmla": DeepSeek-V3.2's sparse rows, "v4fp8" / "v4fp4" V4's
    #                        (SPARSE_MLA_KERNELS: the writer, the widening, the readers)
    kv_scale: str = ""  # fp8: "" one scale per tensor, "th" per (token, KV head)
    variant: str = ""  # VARIANT_BITS letters: "w" window, "c" soft-cap ("t" with its tanh
    #                    by tanh.approx), "b" blocksparse,
    #                    "a" ALiBi (paged_prefill), "f" soft-cap against a fixed softmax
    #                    offset (paged_prefill, bf16, with "c" and without "a"), "r" the
    #                    flat split's runs (paged_decode: the planner's choice), "x" a second
    #                    cache (the sparse MLA kernels: DeepSeek-V4's extra_k_cache)
    arch: str = "sm_90"  # "sm_XY": a cubin; "compute_XY": PTX for the driver to finish
    query_dtype: str = ""  # paged_prefill_sm90: "" the dtype's, or "e4m3" | "e5m2" (the
    #                        cache's format): 8-bit products, dtype the output's type
    key_warps: int = 0  # paged_prefill: warps sharing each row, a share of every tile's
    #                     keys each (1: every warp rows of its own)
    _params: tuple = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        if self.kernel not in _KERNELS:
            raise ValueError(f"unknown kernel {self.kernel!r}: expected one of {sorted(_KERNELS)}")
        params = _KERNELS[self.kernel][1]
        if ("dtype" in params) != (self.dtype in _dtypes.BY_NAME):
            raise ValueError(f"unknown dtype in {self!r}")
        if "cache_dtype" in params:
            if self.cache_dtype in ("", self.dtype):
                object.__setattr__(self, "cache_dtype", self.dtype)
            elif self.cache_dtype in _dtypes.SPARSE_MLA:
                if self.kernel not in SPARSE_MLA_KERNELS:
                    raise ValueError(f"cache_dtype {self.cache_dtype!r} (a sparse MLA cache) "
                                     f"is taken by {', '.join(SPARSE_MLA_KERNELS)} only: "
                                     f"{self!r}")
            elif self.cache_dtype not in _dtypes.FP8:
                raise ValueError(f"cache_dtype must be the dtype or one of {sorted(_dtypes.FP8)} "
                                 f"(or a sparse MLA cache, {sorted(_dtypes.SPARSE_MLA)}, for "
                                 f"{', '.join(SPARSE_MLA_KERNELS)}) in {self!r}")
            if self.kv_scale not in KV_SCALES:
                raise ValueError(f"kv_scale must be one of {sorted(KV_SCALES)} in {self!r}")
            if self.kv_scale and self.cache_dtype not in _dtypes.FP8:
                raise ValueError(f"kv_scale {self.kv_scale!r} needs an fp8 cache_dtype in {self!r}")
        elif self.cache_dtype or self.kv_scale:
            raise ValueError(f"{self.kernel} takes no cache_dtype or kv_scale: {self!r}")
        if ("index_dtype" in params) != (self.index_dtype in _INDEX_CXX):
            raise ValueError(f"index_dtype must be 'i32' or 'i64' in {self!r}")
        if not re.fullmatch(r"(sm|compute)_\d+a?", self.arch):
            raise ValueError(f"arch must look like 'sm_90' or 'compute_90', got {self.arch!r}")
        if self.kernel in ARCH_ONLY:
            # sm_90 names the same GPUs as sm_90a: the kernel's own target stands for it.
            own = ARCH_ONLY[self.kernel]
            if self.arch == own.rstrip("a"):
                object.__setattr__(self, "arch", own)
            elif self.arch != own:
                raise ValueError(f"{self.kernel} is built for {own} only, got arch {self.arch!r}")
        if self.variant:
            if "variant" not in params:
                raise ValueError(f"{self.kernel} takes no variant: {self!r}")
            allowed = ("wctaf" if self.kernel.startswith("paged_prefill")
                       else "x" if self.kernel in SPARSE_MLA_READERS else "wctbr")
            if any(ch not in allowed for ch in self.variant) or \
                    "".join(ch for ch in VARIANT_BITS if ch in self.variant) != self.variant:
                raise ValueError(f"variant must be letters of {allowed!r}, each once, in that "
                                 f"order, in {self!r}")
            if "f" in self.variant and ("c" not in self.variant or "a" in self.variant
                                        or self.dtype != "bf16" or self.query_dtype):
                raise ValueError(f"variant 'f' (the soft-cap's fixed softmax offset) needs 'c', "
                                 f"no 'a', dtype bf16 and a 16-bit query, in {self!r}")
            if "t" in self.variant and "c" not in self.variant:
                raise ValueError(f"variant 't' (the soft-cap's tanh.approx) needs 'c', in "
                                 f"{self!r}")
        if self.kv_scale and "kv_scale" not in params:
            raise ValueError(f"{self.kernel} takes per-tensor scales only (kv_scale ''): "
                             f"{self!r}")
        if "kv_format" in params and not self.kv_format:  # the layout each kernel began with
            object.__setattr__(self, "kv_format",
                               "tok" if self.kernel.startswith("paged_prefill") else "vllm")
        if "kv_format" not in params and self.kv_format:
            raise ValueError(f"{self.kernel} takes no kv_format (it reads no cache): {self!r}")
        if ("kv_format" in params) != (self.kv_format in KV_FORMATS):
            raise ValueError(f"kv_format must be 'tok' or 'vllm' in {self!r}")
        if self.query_dtype:
            if "query_dtype" not in params:
                raise ValueError(f"{self.kernel} takes no query_dtype (its query is of "
                                 f"dtype): {self!r}")
            if self.query_dtype not in _dtypes.FP8 or self.query_dtype != self.cache_dtype \
                    or self.kv_format != "tok":
                raise ValueError(f"query_dtype must be an fp8 format and the cache's own, over "
                                 f"a token-major cache (kv_format 'tok'), in {self!r}")
        object.__setattr__(self, "_params", params)
        if self.kernel == "paged_prefill":
            for name, default in zip(PREFILL_TILE, default_prefill_tile(self.head_size)):
                if getattr(self, name) == 0:
                    object.__setattr__(self, name, default)
        elif self.kernel == "paged_prefill_sm90":
            tile = default_sm90_prefill_tile(self.head_size, self.cache_dtype != self.dtype,
                                             bool(self.query_dtype))
            for name, default in zip(("tile_tokens", "stages"), tile):
                if getattr(self, name) == 0:
                    object.__setattr__(self, name, default)
        elif self.kernel in MLA_MMA_KERNELS or self.kernel in MLA_SM90_KERNELS:
            rows = _dtypes.SPARSE_BY_CACHE.get(self.cache_dtype)
            if rows is not None and rows.rope == 0 and self.rope_dim:
                raise ValueError(f"cache_dtype {self.cache_dtype!r} holds the rotary dims "
                                 f"inside its {rows.values}: rope_dim must be 0 in {self!r}")
            if rows is not None and self.rope_dim not in (0, rows.rope):
                raise ValueError(f"cache_dtype {self.cache_dtype!r} holds {rows.rope} rotary "
                                 f"dims: rope_dim must be {rows.rope} (or 0) in {self!r}")
            # (the wgmma kernels' shape is fixed: only rope_dim)
            names = ("rope_dim", "rows", "tile_tokens", "stages")
            if self.kernel in MLA_SM90_KERNELS:
                names = names[:1]
            for name, default in zip(names, default_mla_tile()):
                if getattr(self, name) == 0 and not (name == "rope_dim" and rows is not None
                                                     and rows.rope == 0):
                    object.__setattr__(self, name, default)
        elif "tile_tokens" in params:
            if self.tile_tokens == 0:
                object.__setattr__(self, "tile_tokens", self._default_tile())
            if self.stages == 0:
                object.__setattr__(self, "stages", 2)

    def _default_tile(self) -> int:
        return default_decode_tile(_dtypes.BY_NAME[self.dtype].itemsize, self.head_size,
                                   self.cache_dtype in _dtypes.FP8)

    @property
    def source_file(self) -> str:
        return _KERNELS[self.kernel][0]

    @property
    def name(self) -> str:
        """Readable and unique, e.g. ``paged_decode_f16_hs128_bs16_vllm_g4_sm90``."""
        p = self._params
        parts = [self.kernel]
        if "dtype" in p:
            parts.append(self.dtype)
        if "cache_dtype" in p and self.cache_dtype != self.dtype:
            parts.append(self.cache_dtype)
        if self.query_dtype:
            parts.append(f"q{self.query_dtype}")
        if "head_size" in p:
            parts.append(f"hs{self.head_size}")
        if "rope_dim" in p:
            parts.append(f"rope{self.rope_dim}")
        if "index_dtype" in p:
            parts.append(self.index_dtype)
        if "block_size" in p:
            parts.append(f"bs{self.block_size}")
        if "kv_format" in p:
            parts.append(self.kv_format)
        if self.kv_scale:
            parts.append(self.kv_scale)
        if self.variant:
            parts.append(self.variant)
        if "group_tile" in p:
            parts.append(f"g{self.group_tile}")
        if self.kernel == "paged_prefill":
            tile = tuple(getattr(self, f) for f in PREFILL_TILE)
            if tile != default_prefill_tile(self.head_size):
                parts.append(prefill_tile_name(tile))
        elif self.kernel in MLA_MMA_KERNELS:
            parts.append(f"r{self.rows}t{self.tile_tokens}x{self.stages}")
        elif self.kernel == "indexer_logits":
            parts.append(f"h{self.rows}")
        elif self.kernel == "paged_prefill_sm90":
            tile = (self.tile_tokens, self.stages)
            if tile != default_sm90_prefill_tile(self.head_size, self.cache_dtype != self.dtype,
                                                 bool(self.query_dtype)):
                parts.append("n{}x{}".format(*tile))
        elif "tile_tokens" in p:
            if (self.tile_tokens, self.stages) != (self._default_tile(), 2):
                parts.append(f"t{self.tile_tokens}x{self.stages}")
        parts.append(self.arch.replace("_", ""))
        return "_".join(parts)

    @property
    def name_expression(self) -> str:
        """The C++ instantiation NVRTC is asked for."""
        args = []
        for p in self._params:
            v = getattr(self, p)
            if p == "query_dtype" and not v:
                continue  # the template's default: the query is of dtype
            if p in ("dtype", "cache_dtype", "query_dtype"):
                v = _dtypes.CACHE_BY_NAME[v].cxx
            elif p == "kv_scale":
                v = KV_SCALES[v]
            elif p == "index_dtype":
                v = _INDEX_CXX[v]
            elif p == "kv_format":
                v = KV_FORMATS[v]
            elif p == "variant":
                v = sum(VARIANT_BITS[ch] for ch in v)
            args.append(str(v))
        return f"cupaged::{self.kernel}<{', '.join(args)}>"

    def with_arch(self, arch: str) -> "KernelSpec":
        from dataclasses import replace

        return replace(self, arch=arch)


# ---- sources ------------------------------------------------------------------------------


def source_dir() -> Path:
    """Where the CUDA sources are: inside the installed package (a wheel) or beside it
    (a source checkout or an editable install)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "paged_decode.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        f"cupaged's CUDA sources were not found in {here / 'cuda_src'} or "
        f"{here.parent / 'cuda_src'}; the installation is incomplete"
    )


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*(?://.*)?$', re.M)
_ANY_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include\b.*$", re.M)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.M)


def _inline(path: Path, seen: set) -> str:
    seen.add(path.name)
    text = _PRAGMA_ONCE.sub("", path.read_text())

    def expand(m: re.Match) -> str:
        target = path.parent / m.group(1)
        if target.name in seen:
            return ""
        return f'{_inline(target, seen)}\n#line {text.count(chr(10), 0, m.start()) + 2} "{path.name}"'

    return f'#line 1 "{path.name}"\n' + _INCLUDE.sub(expand, text)


@lru_cache(maxsize=None)
def _source_cached(entry: str, stamp: tuple) -> str:
    text = _inline(source_dir() / entry, set())
    # An include left in the text would be found by NVRTC outside what is hashed
    left = _ANY_INCLUDE.search(text)
    if left:
        raise CompileError(f"{entry}: an include the kernel cache cannot follow: "
                           f"{left.group(0).strip()} (only #include \"file\" of cuda_src/)")
    return text


def source(entry: str) -> str:
    """The entry file with the project's own headers inlined, so the text that is
    compiled (and hashed) contains every file it depends on."""
    d = source_dir()
    stamp = tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size)
                         for p in d.iterdir() if p.suffix in (".cu", ".cuh")))
    return _source_cached(entry, stamp)


# ---- NVRTC --------------------------------------------------------------------------------


def nvrtc():
    from cupy_backends.cuda.libs import nvrtc  # loads libnvrtc only; no driver needed

    return nvrtc


_first_compile = threading.Lock()
_compiled_once = False


def _probe(rtc, options: list) -> bool:
    """Does an empty kernel compile with these options?"""
    return _probe_ptx(rtc, options) is not None


def _probe_ptx(rtc, options: list) -> bytes | None:
    """An empty kernel's PTX with these options (None: it does not compile)."""
    prog = rtc.createProgram("__global__ void probe() {}", "probe.cu", [], [])
    try:
        rtc.compileProgram(prog, [*options, "-arch=compute_80"])
        return rtc.getPTX(prog)
    except rtc.NVRTCError:
        return None
    finally:
        rtc.destroyProgram(prog)


def ready_nvrtc():
    """``nvrtc()`` after the process's first compile, made once on one thread: NVRTC
    13.0's first compiles, started on several threads at once, can fail to open
    libnvrtc-builtins (seen in the mirror check's thread pool), and every compile here
    may run on a pool (compile_check, precompile, concurrent first calls)."""
    global _compiled_once
    rtc = nvrtc()
    if not _compiled_once:
        with _first_compile:
            if not _compiled_once:
                _probe(rtc, [])
                _compiled_once = True
    return rtc


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    return tuple(nvrtc().getVersion())


@lru_cache(maxsize=None)
def nvrtc_build() -> str:
    """This NVRTC's build as its PTX header names it ("Compiler Build ID: CL-36424714;
    Cuda compilation tools, release 13.0, V13.0.88"), from one empty kernel compiled once
    a process: getVersion's (major, minor) is shared by patch releases, which may generate
    different code, so the cache key takes the build."""
    ptx = _probe_ptx(ready_nvrtc(), []) or b""
    header = ptx.decode("ascii", "replace").split(".version", 1)[0]
    named = [line.lstrip("/ ").strip() for line in header.splitlines()
             if "Build ID" in line or "compilation tools" in line]
    return "; ".join(named) or f"NVRTC {nvrtc_version()}"


@lru_cache(maxsize=None)
def supported_archs() -> tuple[int, ...]:
    return tuple(nvrtc().getSupportedArchs())


def target_for(compute_capability: tuple[int, int]) -> str:
    """The NVRTC target for a device: its own cubin when this NVRTC knows the
    architecture, else PTX for the newest one it knows (the driver finishes it)."""
    cc = compute_capability[0] * 10 + compute_capability[1]
    archs = supported_archs()
    if cc in archs:
        return f"sm_{cc}"
    older = [a for a in archs if a <= cc]
    if not older:
        raise RuntimeError(f"NVRTC {nvrtc_version()} cannot target compute capability {cc}")
    return f"compute_{max(older)}"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _options(arch: str) -> tuple[str, ...]:
    # CUPAGED_FP8_SOFTWARE=1 compiles fp8.cuh's integer conversions instead of the sm_89+
    # instructions (what sm_80/86 run), to test them on a newer GPU. CUPAGED_LINEINFO=1
    # adds source lines (compute-sanitizer's and ncu's reports name them). Both are part
    # of the cache key; set them before the first kernel loads (in-process caches do not
    # watch them).
    opts = (CXX_STD, f"-arch={arch}")
    if _env_flag("CUPAGED_FP8_SOFTWARE"):
        opts += ("-DCUPAGED_FP8_SOFTWARE",)
    if _env_flag("CUPAGED_LINEINFO"):
        opts += ("-lineinfo",)
    return opts


def _compile(entry: str, arch: str, name_expressions: list[str], label: str,
             extra: tuple[str, ...] = ()):
    """Compile one program; returns (binary, {name expression: lowered name})."""
    rtc = ready_nvrtc()
    prog = rtc.createProgram(source(entry), entry, [], [])
    try:
        for expr in name_expressions:
            rtc.addNameExpression(prog, expr)
        try:
            rtc.compileProgram(prog, [*_options(arch), *extra])
        except rtc.NVRTCError as e:
            log = rtc.getProgramLog(prog)
            raise CompileError(f"NVRTC could not compile {label} for {arch}: {e}\n{log}") from None
        binary = whole_elf(rtc.getCUBIN(prog)) if arch.startswith("sm_") else rtc.getPTX(prog)
        lowered = {expr: rtc.getLoweredName(prog, expr) for expr in name_expressions}
    finally:
        rtc.destroyProgram(prog)
    return binary, lowered


def elf_end(binary: bytes) -> int | None:
    """Where an ELF64 file ends by its own headers (past its program and section header
    tables), or None for bytes that are not one."""
    if len(binary) < 64 or binary[:5] != b"\x7fELF\x02":
        return None
    phoff, shoff = struct.unpack_from("<QQ", binary, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", binary, 0x36)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def whole_elf(cubin: bytes) -> bytes:
    """The cubin as NVRTC made it. CuPy's getCUBIN drops its last byte (a terminator, as
    for PTX), which is the high byte of a 64-bit field of the last header, zero; the
    driver never missed it (a bytes object ends in a hidden NUL), but nvdisasm and cuobjdump
    refuse the short file in the cache. Where the ELF's headers end one byte past the
    data, that zero byte is put back; anything else is returned as it is."""
    return cubin + b"\0" if elf_end(cubin) == len(cubin) + 1 else cubin


def cache_key(spec: KernelSpec) -> str:
    return _key(spec.source_file, spec.name_expression, spec.arch)


def _key(source_file: str, name_expression: str, arch: str) -> str:
    """A cache entry's key: the inlined source, the instantiation, the options, NVRTC's
    version and build."""
    h = hashlib.sha256()
    for part in (source(source_file), name_expression, " ".join(_options(arch)),
                 repr(nvrtc_version()), nvrtc_build()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def cache_dir() -> Path:
    """``$CUPAGED_CACHE_DIR``, else ``$XDG_CACHE_HOME/cupaged``, else ``~/.cache/cupaged``."""
    if os.environ.get("CUPAGED_CACHE_DIR"):
        return Path(os.environ["CUPAGED_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cupaged"


def _cache_paths(spec: KernelSpec) -> tuple[Path, Path]:
    return _paths(spec.name, cache_key(spec), spec.arch)


def _paths(name: str, key: str, arch: str) -> tuple[Path, Path]:
    stem = f"{name}-{key[:20]}"
    ext = ".cubin" if arch.startswith("sm_") else ".ptx"
    d = cache_dir()
    return d / (stem + ext), d / (stem + ".json")


# The process's umask, read once at import (reading it sets it: not while threads run)
_UMASK = os.umask(0)
os.umask(_UMASK)


# A writer's temporary file older than this is a crashed writer's (one compile's write
# takes milliseconds): the first write of a process into a folder removes them.
_STALE_TMP_SECONDS = 3600
_swept: set = set()


def _sweep_stale_tmp(folder: Path) -> None:
    if folder in _swept:
        return
    _swept.add(folder)
    cutoff = time.time() - _STALE_TMP_SECONDS
    # (_write_atomic's names: an entry's file name, mkstemp's random part, ".tmp")
    for p in (q for ext in (".cubin", ".ptx", ".json") for q in folder.glob(f"*{ext}*.tmp")):
        try:
            if p.stat().st_mtime < cutoff:
                p.unlink()
        except OSError:  # gone already, or not ours to remove
            pass


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # a plain file's mode, not mkstemp's 0600
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@dataclass(frozen=True)
class Built:
    """A compiled specialization, on disk (verified when read) or, when the disk cache is
    not writable, in memory. Loading reads the file again and checks it against
    ``sha256``, so a long-lived process holds digests, not every binary it compiled."""

    spec: KernelSpec
    path: Path | None  # the cached cubin (or PTX); None when the disk cache is not writable
    binary: bytes | None = field(repr=False)  # only when path is None
    sha256: str
    lowered_name: str
    seconds: float  # time spent compiling or reading the cache
    from_disk: bool


_spec_locks: dict = {}
_built: dict = {}
_warned_unwritable: set = set()


def _read_entry(spec: KernelSpec, binary_path: Path, meta_path: Path):
    """The cached (binary, lowered name), or None when the entry is missing, from another
    instantiation, or damaged: its size and SHA-256 must match what the JSON recorded
    when it was written (a truncated or corrupted cubin is rebuilt, never loaded)."""
    try:
        meta = json.loads(meta_path.read_text())
        binary = binary_path.read_bytes()
        if (meta["name_expression"] == spec.name_expression and meta["size"] == len(binary)
                and meta["sha256"] == hashlib.sha256(binary).hexdigest()):
            return binary, meta["lowered_name"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_entry(spec: KernelSpec, binary_path: Path, meta_path: Path, binary: bytes,
                 lowered: str) -> Path | None:
    """Store a new entry (the binary first, then the JSON that vouches for it); None, with
    one warning per folder, when the cache folder cannot be written: the kernel is then
    kept in memory only."""
    return _write_meta(spec.name, spec.name_expression, spec.arch, binary_path, meta_path,
                       binary, lowered)


def _write_meta(name: str, name_expression: str, arch: str, binary_path: Path,
                meta_path: Path, binary: bytes, lowered: str) -> Path | None:
    meta = {"name": name, "name_expression": name_expression,
            "lowered_name": lowered, "options": list(_options(arch)),
            "nvrtc": list(nvrtc_version()), "nvrtc_build": nvrtc_build(),
            "size": len(binary),
            "sha256": hashlib.sha256(binary).hexdigest()}
    try:
        _write_atomic(binary_path, binary)
        _write_atomic(meta_path, json.dumps(meta, indent=1).encode())
        return binary_path
    except OSError as e:
        folder = str(binary_path.parent)
        if folder not in _warned_unwritable:
            _warned_unwritable.add(folder)
            warnings.warn(f"cupaged cannot write its kernel cache in {folder} ({e}); compiled "
                          f"kernels are kept in memory for this process only. Set "
                          f"CUPAGED_CACHE_DIR to a writable folder to keep them.",
                          RuntimeWarning, stacklevel=3)
        return None


def _compile_spec(spec: KernelSpec) -> tuple[bytes, str]:
    """``(binary, lowered kernel name)`` of one specialization, compiled now."""
    binary, names = _compile(spec.source_file, spec.arch, [spec.name_expression], spec.name)
    return binary, names[spec.name_expression]


def build(spec: KernelSpec) -> Built:
    """Compile ``spec`` into the disk cache, or find it there. Thread-safe: concurrent
    callers asking for the same new specialization compile it once."""
    done = _built.get(spec)
    if done is not None:
        return done
    with _spec_locks.setdefault(spec, threading.Lock()):
        done = _built.get(spec)
        if done is not None:
            return done
        t0 = time.perf_counter()
        binary_path, meta_path = _cache_paths(spec)
        entry = _read_entry(spec, binary_path, meta_path)
        if entry is not None:
            binary, lowered = entry
            path = binary_path
        else:
            binary, lowered = _compile_spec(spec)
            path = _write_entry(spec, binary_path, meta_path, binary, lowered)
        done = Built(spec, path, binary if path is None else None,
                     hashlib.sha256(binary).hexdigest(), lowered, time.perf_counter() - t0,
                     entry is not None)
        _built[spec] = done
        return done


def binary(spec: KernelSpec) -> bytes:
    """The verified binary of a specialization (:func:`verified`)."""
    return verified(spec)[0]


def verified(spec: KernelSpec) -> tuple[bytes, str]:
    """``(binary, lowered kernel name)`` of a specialization, verified: from memory, or
    read back from the disk cache and checked against the digest recorded when it was
    built. An entry that changed since was rewritten by another process (each publishes
    its own build of the same source: NVRTC's output differs between processes in its
    internal names) or damaged or deleted: it is read anew and checked against its own
    record, or, missing or mid-write, compiled again here and kept in memory. What is
    returned is what was checked, never the file read a second time."""
    built = build(spec)
    if built.binary is not None:
        return built.binary, built.lowered_name
    try:
        data = built.path.read_bytes()
    except OSError:
        data = None
    if data is not None and hashlib.sha256(data).hexdigest() == built.sha256:
        return data, built.lowered_name
    with _spec_locks.setdefault(spec, threading.Lock()):
        t0 = time.perf_counter()
        entry = _read_entry(spec, *_cache_paths(spec)) or _compile_spec(spec)
        _built[spec] = Built(spec, None, entry[0], hashlib.sha256(entry[0]).hexdigest(),
                             entry[1], time.perf_counter() - t0, False)
    return entry


def precompile(specs: Iterable[KernelSpec], workers: int | None = None) -> list[Built]:
    """Compile specializations ahead of use (into the disk cache), in parallel."""
    specs = list(dict.fromkeys(specs))
    workers = workers or min(len(specs), os.cpu_count() or 1) or 1
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(build, specs))


def kernel_of(name: str) -> str | None:
    """The kernel a specialization's readable name belongs to (the longest kernel name it
    starts with), or None."""
    found = [k for k in _KERNELS if name.startswith(k + "_")]
    return max(found, key=len) if found else None


def refill(metas: Iterable[dict], workers: int | None = None) -> list[str]:
    """Compile, into this disk cache and from the current sources, the specializations
    another cache's entries name (their JSON's ``name``, ``name_expression`` and
    ``options``): a machine that will run what that one ran finds them built. Entries of
    an unknown kernel, whose name is not a plain file name, or whose options are not what
    this process would use for their arch, are skipped; one already in the cache is kept,
    one that fails to compile is reported (a warning) and the rest go on. Returns the
    names compiled."""
    todo = {}
    for m in metas:
        # (a name that is not a plain file name would put the entry outside the cache)
        if not re.fullmatch(r"[A-Za-z0-9_.]+", str(m.get("name", ""))) or ".." in m["name"]:
            continue
        kernel = kernel_of(m["name"])
        arch = next((o[len("-arch="):] for o in m.get("options", ()) if o.startswith("-arch=")),
                    None)
        if kernel is None or arch is None or list(_options(arch)) != list(m["options"]):
            continue
        todo[m["name"], m["name_expression"]] = (_KERNELS[kernel][0], arch)

    def one(item):
        (name, expr), (source_file, arch) = item
        binary_path, meta_path = _paths(name, _key(source_file, expr, arch), arch)
        if binary_path.exists() and meta_path.exists():
            return None
        try:
            binary, names = _compile(source_file, arch, [expr], name)
        except CompileError as e:
            warnings.warn(f"refill: {e}", RuntimeWarning, stacklevel=2)
            return None
        _write_meta(name, expr, arch, binary_path, meta_path, binary, names[expr])
        return name

    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(workers) as pool:
        return [n for n in pool.map(one, todo.items()) if n is not None]


# ---- loading onto a device -----------------------------------------------------------------

_loaded: dict = {}


class Launcher:
    """Launches one loaded kernel through ``cuLaunchKernel`` with its arguments packed
    into a parameter buffer by one ``struct.pack_into``: a few microseconds per launch,
    where CuPy's generic path converts each argument separately.

    ``launcher(grid, block, smem, stream_ptr, *args)``: pointers as ints (``a.data.ptr``),
    a braced struct's fields one by one. The buffer is per thread, so concurrent launches
    from several threads are safe. ``fmt`` is the buffer's flat struct format (native
    alignment) and ``size`` its bytes; :meth:`pack`, :meth:`packed` and
    :meth:`new_buffer` serve a caller that packs a buffer once and launches from it many
    times (``_fastrun``), or that times the packing apart from the launch.
    """

    def __init__(self, function, fmt: str, name: str):
        self.function = function  # a cupy.cuda.function.Function: keeps its module loaded
        self.ptr = function.ptr
        self.smem_limit = 48 * 1024  # dynamic shared memory a launch may ask for (jit.load)
        self.name = name
        flat = fmt.replace("{", "").replace("}", "")
        self.fmt = "@" + flat
        # Slack past the end: the driver reads a struct's full (padded) size. A whole
        # number of 8-byte words, so the buffer can be seen as one.
        self.size = (struct.calcsize(self.fmt) + 16 + 7) // 8 * 8
        # Where each parameter starts: the native-aligned size up to and including it, less
        # its own size (a braced struct: up to its first field, less that field). Byte
        # structs come first or after 8-byte fields, so their alignment of 8 in the
        # kernel's ABI holds; a braced struct starts with an 8-byte field.
        self._offsets, prefix = [], ""
        for m in ARG_TOKEN.finditer(fmt):
            tok = m.group(0)
            first = ARG_TOKEN.match(tok[1:-1]).group(0) if tok[0] == "{" else tok
            self._offsets.append(struct.calcsize("@" + prefix + first)
                                 - struct.calcsize("@" + first))
            prefix += tok.strip("{}")
        self._local = threading.local()

    def new_buffer(self, data: bytes = b"") -> tuple:
        """A parameter buffer holding ``data`` (zeros past it) and the array of pointers to
        its parameters that ``cuLaunchKernel`` takes: ``(buffer, pointers)``, both to be
        kept alive while launching from them."""
        buf = ctypes.create_string_buffer(data, self.size)
        base = ctypes.addressof(buf)
        return buf, (ctypes.c_void_p * len(self._offsets))(*(base + o for o in self._offsets))

    def _buffers(self):
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf, params = self.new_buffer()
            self._local.buf, self._local.params = buf, params
            self._local.params_addr = ctypes.addressof(params)
        return self._local.buf, self._local.params_addr

    def pack(self, *args) -> int:
        """Pack ``args`` into this thread's parameter buffer as a launch does; the address
        of the parameter pointers cuLaunchKernel takes (``cupaged-bench overhead --pieces``
        times the two steps apart). The packed bytes, as the driver reads them, are the
        ``size`` bytes at the first pointer (:meth:`packed`)."""
        buf, params = self._buffers()
        struct.pack_into(self.fmt, buf, 0, *args)
        return params

    def packed(self, params: int) -> bytes:
        """The ``size`` bytes of the parameter buffer whose pointer array is at ``params``
        (:meth:`pack`'s return), read as ``cuLaunchKernel`` reads them: from the first
        parameter's address, the buffer's start."""
        return ctypes.string_at(ctypes.c_void_p.from_address(params).value, self.size)

    def __call__(self, grid, block, smem: int, stream: int, *args) -> None:
        buf, params = self._buffers()
        struct.pack_into(self.fmt, buf, 0, *args)
        driver.launchKernel(self.ptr, grid[0], grid[1], grid[2], block, 1, 1, smem, stream,
                            params, 0)


# Registers a kernel's launch must allocate per thread: paged_prefill_sm90's warpgroups
# re-divide the CTA's registers with setmaxnreg, and setmaxnreg.inc waits forever for
# registers the launch did not allocate. The C++ side bounds the split by the same 168
# (Sm90Registers' static_assert, from __launch_bounds__(384, 1)).
LAUNCH_REGS = {"paged_prefill_sm90": 168}


def load(spec: KernelSpec, device_id: int, dynamic_smem: int = 0) -> Launcher:
    """The :class:`Launcher` for ``spec`` on a device (compiled on first use). Kernels
    needing more than 48 KiB of dynamic shared memory get their limit raised here, also
    when an earlier load of the same kernel asked for less."""
    key = (device_id, spec)
    kernel = _loaded.get(key)
    if kernel is not None and dynamic_smem <= kernel.smem_limit:
        return kernel
    import cupy

    # The verified bytes, not the file, are loaded: what was checked is what runs. (Read
    # outside the lock: building takes it.)
    data, lowered = verified(spec)
    with _spec_locks.setdefault(spec, threading.Lock()), cupy.cuda.Device(device_id):
        kernel = _loaded.get(key)
        if kernel is None:
            module = cupy.cuda.function.Module()
            module.load(data)
            kernel = Launcher(module.get_function(lowered), ARG_FORMATS[spec.kernel], spec.name)
            need = LAUNCH_REGS.get(spec.kernel, 0)
            if need:
                regs = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, kernel.ptr)
                if regs < need:
                    raise RuntimeError(
                        f"{spec.name}: compiled to {regs} registers a thread, but its "
                        f"warpgroups divide {need} (setmaxnreg would hang); not launched")
            _loaded[key] = kernel
        if dynamic_smem > kernel.smem_limit:
            driver.funcSetAttribute(
                kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_smem)
            kernel.smem_limit = dynamic_smem
    return kernel


# Caches of launchers kept by the modules that launch kernels (functools.lru_cache'd
# lookups): clear_memory_caches empties them too, or they would keep serving old kernels.
_launcher_caches: list = []


def launcher_cache(fn):
    """Decorator: ``functools.lru_cache`` for a function returning launchers, emptied by
    :func:`clear_memory_caches`."""
    return register_launcher_cache(lru_cache(maxsize=None)(fn))


def register_launcher_cache(cache):
    """Have :func:`clear_memory_caches` empty ``cache`` too (anything with
    ``cache_clear()`` that holds launchers, such as the prepared-call memo)."""
    _launcher_caches.append(cache)
    return cache


def clear_memory_caches() -> None:
    """Forget compiled and loaded kernels in this process, and the launchers the
    launching modules keep (the disk cache stays)."""
    _built.clear()
    _loaded.clear()
    for cached in _launcher_caches:
        cached.cache_clear()


# ---- compile check (no GPU needed) ---------------------------------------------------------


# NVRTC's fastest compile: the front end, NVVM and ptxas all run, so template errors,
# static_asserts and PTX an architecture lacks are caught as in a build, about 3.5x
# faster on the covering set. Code generation skips most optimizations (helpers called,
# not inlined: a prefill kernel of 255 registers comes out at 122 and a stack frame), so
# it says nothing of resource use and cannot meet a failure of the optimizer; for those,
# compile with fast=False (`cupaged-bench compile --covering --optimized`). For compile
# checks only: kernels are never built this way.
_FAST_CHECK = ("--Ofast-compile=max",)


@lru_cache(maxsize=None)
def check_options() -> tuple[str, ...]:
    """The options compile_check adds when ``fast``: ``_FAST_CHECK`` where this NVRTC
    accepts them (12.8 added them; a probe compile asks), else none."""
    return _FAST_CHECK if _probe(ready_nvrtc(), list(_FAST_CHECK)) else ()


# PTX's functions (".entry" kernels and ".func"s), their inline assembly and their calls.
_PTX_FUNC = re.compile(r"^(?:\.visible\s+|\.weak\s+)?(?:\.entry|\.func)\s+(?:\([^)]*\)\s*)?"
                       r"([\w$]+)", re.M)
_PTX_ASM = re.compile(r"// begin inline asm\n(.*?)// end inline asm", re.S)
_PTX_CALL = re.compile(r"\bcall(?:\.uni)?\s+(?:\([^)]*\)\s*,\s*)?([\w$]+)")


def _asm_form(instruction: str) -> str:
    """An inline PTX instruction with its registers and addresses blanked and its
    immediates kept: ``bar.sync %, 256``, ``cvt.rn.f16x2.e4m3x2 %, %``."""
    text = re.sub(r"\[[^\]]*\]", "[]", instruction)
    text = re.sub(r"%[\w.$]+", "%", text)
    return " ".join(text.split())


def asm_forms(ptx: str, entries: Iterable[str]) -> dict:
    """``{entry: frozenset of the inline-PTX forms it runs}`` for kernels (lowered names)
    of a PTX program: their own inline assembly and that of every function they call
    (``--Ofast-compile`` leaves many uninlined)."""
    heads = list(_PTX_FUNC.finditer(ptx))
    own, calls = {}, {}
    for i, m in enumerate(heads):
        body = ptx[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(ptx)]
        own[m.group(1)] = {_asm_form(ins) for block in _PTX_ASM.findall(body)
                           for ins in block.split(";") if ins.strip() not in ("", "{", "}")}
        calls[m.group(1)] = set(_PTX_CALL.findall(body))
    out = {}
    for entry in entries:
        seen, todo, forms = set(), [entry], set()
        while todo:
            f = todo.pop()
            if f in seen or f not in own:
                continue
            seen.add(f)
            forms |= own[f]
            todo += calls[f]
        out[entry] = frozenset(forms)
    return out


def ptx_forms(specs: Iterable[KernelSpec], workers: int | None = None,
              batch: int = 48) -> tuple[dict, float]:
    """Compile every spec to PTX for its target's virtual architecture (NVRTC's front end
    and code generation, fast options, no ptxas: every C++ and template error) and read
    the inline-PTX forms each kernel runs. Returns ({spec: frozenset of forms}, seconds);
    raises CompileError naming the failing batch. What only ptxas checks (inline PTX a
    target lacks, bad immediates) a cubin of some spec running each form on each target
    then shows: see ``cupaged-bench compile --covering``."""
    def run(job):
        chunk, args = job
        ptx, lowered = _compile(*args)
        text = ptx.decode() if isinstance(ptx, bytes) else ptx
        forms = asm_forms(text, [lowered[s.name_expression] for s in chunk])
        return {s: forms[lowered[s.name_expression]] for s in chunk}

    jobs = _batches(specs, batch, check_options(),
                    lambda s: "compute_" + s.arch.partition("_")[2])
    t0 = time.perf_counter()
    out: dict = {}
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        for part in pool.map(run, jobs):
            out.update(part)
    return out, time.perf_counter() - t0


def _batches(specs, batch: int, extra: tuple, arch_of) -> list:
    """``(specs, _compile's arguments)`` per program: instantiations of one source and
    target (``arch_of(spec)``), ``batch`` at most."""
    groups: dict = {}
    for s in dict.fromkeys(specs):
        groups.setdefault((s.source_file, arch_of(s)), []).append(s)
    jobs = []
    for (entry, arch), members in groups.items():
        for i in range(0, len(members), batch):
            chunk = members[i:i + batch]
            jobs.append((chunk, (entry, arch, [s.name_expression for s in chunk],
                                 f"{chunk[0].name} .. {chunk[-1].name} ({len(chunk)} "
                                 f"specializations)", extra)))
    return jobs


def compile_check(specs: Iterable[KernelSpec], workers: int | None = None,
                  batch: int = 48, fast: bool = True) -> tuple[int, float]:
    """Compile every spec with NVRTC, batching instantiations of one source and arch into
    one program, without touching the disk cache or a GPU. ``fast`` (where this NVRTC has
    it) compiles with ``--Ofast-compile=max``, which catches the same source and target
    errors as a build but not resource use (``_FAST_CHECK``); ``fast=False`` compiles
    exactly as kernels are built. Returns (count, seconds); raises CompileError naming
    the failing batch."""
    jobs = _batches(specs, batch, check_options() if fast else (), lambda s: s.arch)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        list(pool.map(lambda j: _compile(*j[1]), jobs))
    return sum(len(chunk) for chunk, _ in jobs), time.perf_counter() - t0
