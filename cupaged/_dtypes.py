"""The element types cupaged's kernels support, and how each is named everywhere."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

try:  # CuPy >= 14 represents bfloat16 arrays with ml_dtypes' NumPy dtype.
    import ml_dtypes as _ml_dtypes

    _BF16 = np.dtype(_ml_dtypes.bfloat16)
    _E4M3 = np.dtype(_ml_dtypes.float8_e4m3fn)
    _E5M2 = np.dtype(_ml_dtypes.float8_e5m2)
except ImportError:  # pragma: no cover - ml_dtypes ships with the cuda extras
    _BF16 = _E4M3 = _E5M2 = None


@dataclass(frozen=True)
class DType:
    name: str  # short name used in specialization names: f32, f16, bf16
    cxx: str  # the kernel's storage type
    itemsize: int
    numpy: np.dtype | None  # None when ml_dtypes is missing (bfloat16 only)


F32 = DType("f32", "float", 4, np.dtype(np.float32))
F16 = DType("f16", "cupaged::half_t", 2, np.dtype(np.float16))
BF16 = DType("bf16", "cupaged::bfloat16_t", 2, _BF16)

BY_NAME = {d.name: d for d in (F32, F16, BF16)}

# fp8 KV-cache formats (cuda_src/fp8.cuh): OCP E4M3 (torch.float8_e4m3fn, largest finite
# 448) and E5M2 (torch.float8_e5m2, 57344). Caches only: queries and outputs stay 16-bit.
E4M3 = DType("e4m3", "cupaged::fp8_e4m3_t", 1, _E4M3)
E5M2 = DType("e5m2", "cupaged::fp8_e5m2_t", 1, _E5M2)
FP8 = {E4M3.name: E4M3, E5M2.name: E5M2}
# DeepSeek's sparse-attention caches (cuda_src/ds_mla.cuh), one row of bytes a token,
# written by concat_and_cache_mla: V3.2's (vLLM's kv_cache_dtype "fp8_ds_mla"): 656-byte
# rows of e4m3 values, their float32 scales and bfloat16 rotary dims, read by
# mla_sparse_attention and mla_sparse_attention_sm90; V4's "v4_fp8" (528 bytes: e4m3 values
# and ue8m0 scales) and "v4_fp4" (288 bytes: e2m1 values and e4m3 scales), read by
# mla_sparse_attention (cupaged.reference.dequantize_sparse_kv states all three).
DS_MLA = DType("dsmla", "cupaged::fp8_ds_mla_t", 1, None)
V4_FP8 = DType("v4fp8", "cupaged::v4_fp8_t", 1, None)
V4_FP4 = DType("v4fp4", "cupaged::v4_fp4_t", 1, None)
SPARSE_MLA = {d.name: d for d in (DS_MLA, V4_FP8, V4_FP4)}
DS_MLA_KV_CACHE_DTYPE = "fp8_ds_mla"
DS_MLA_BYTES = 656  # per token: 512 e4m3, 4 float32 scales, 64 bfloat16


SPARSE_RANK = 512  # the value's dims (kv_c's for V3.2, the whole key for V4)


@dataclass(frozen=True)
class SparseFormat:
    """A sparse cache's kv_cache_dtype: its cache type, bytes a token, and words for errors."""

    dtype: DType
    nbytes: int
    values: int  # values a token (kv_c's then k_pe's): the key's dims, d_qk
    what: str  # "DeepSeek-V3.2's sparse MLA cache"
    readers: str  # the entry points that read it

    @property
    def rope(self) -> int:
        """The key's dims after the value's 512 (the kernels' ROPE): V3.2's 64 bfloat16
        rotary dims; 0 for V4's, whose rotary dims lie inside the 512."""
        return self.values - SPARSE_RANK


SPARSE_KV_CACHE_DTYPES = {
    DS_MLA_KV_CACHE_DTYPE: SparseFormat(DS_MLA, DS_MLA_BYTES, 576,
                                        "DeepSeek-V3.2's sparse MLA cache", "sparse_mla_attention"),
    "v4_fp8": SparseFormat(V4_FP8, 528, 512, "DeepSeek-V4's fp8 sparse MLA cache",
                           "sparse_mla_attention"),
    "v4_fp4": SparseFormat(V4_FP4, 288, 512, "DeepSeek-V4's fp4 sparse MLA cache",
                           "sparse_mla_attention"),
}
SPARSE_BY_CACHE = {f.dtype.name: f for f in SPARSE_KV_CACHE_DTYPES.values()}  # "v4fp8": ..
CACHE_BY_NAME = {**BY_NAME, **FP8, **SPARSE_MLA}
_FP8_BY_NUMPY = {d.numpy: d for d in FP8.values() if d.numpy is not None}
# kv_cache_dtype spellings (vLLM's): "auto" is the query's own type.
KV_CACHE_DTYPES = {"fp8": E4M3, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}


def kv_cache_format(name) -> DType | None:
    """The fp8 format a ``kv_cache_dtype`` string names, or None for ``"auto"`` (or None):
    the query's own type. ValueError for any other value."""
    if name is None or name == "auto":
        return None
    refuse_sparse_mla(name)
    fmt = KV_CACHE_DTYPES.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', "
                         f"got {name!r}")
    return fmt


def refuse_sparse_mla(name, where: str = "this entry point") -> None:
    """ValueError when ``name`` is a sparse cache's kv_cache_dtype (``"fp8_ds_mla"``,
    ``"v4_fp8"``, ``"v4_fp4"``), at an entry point that does not take it:
    PagedMLACache holds them, concat_and_cache_mla writes them, sparse_mla_attention reads
    them."""
    fmt = SPARSE_KV_CACHE_DTYPES.get(name) if isinstance(name, str) else None
    if fmt is None:
        return
    raise ValueError(f"kv_cache_dtype={name!r} ({fmt.what}) is held by PagedMLACache, written "
                     f"by concat_and_cache_mla, copied by copy_blocks_mla / swap_blocks and "
                     f"read by {fmt.readers} only: {where} does not take it")


def fp8_of(dtype) -> DType | None:
    """The fp8 format a NumPy dtype names (ml_dtypes' float8_e4m3fn / float8_e5m2), or None."""
    try:
        return _FP8_BY_NUMPY.get(np.dtype(dtype))
    except TypeError:
        return None
_BY_NUMPY = {d.numpy: d for d in (F32, F16, BF16) if d.numpy is not None}
_ALIASES = {"float32": F32, "float": F32, "fp32": F32, "float16": F16, "half": F16,
            "fp16": F16, "bfloat16": BF16, "bf16": BF16}


def supported_names() -> str:
    return "float32, float16, bfloat16"


def lookup(dtype) -> DType | None:
    """The DType for a NumPy dtype (or anything np.dtype accepts), or None."""
    try:
        return _BY_NUMPY.get(np.dtype(dtype))
    except TypeError:
        return None


def parse(name: str) -> DType:
    """A DType from a user-facing name such as 'float16', 'bf16' or 'f32'."""
    d = BY_NAME.get(name) or _ALIASES.get(str(name).lower())
    if d is None:
        raise ValueError(f"unknown dtype {name!r}: expected one of {supported_names()}")
    return d
