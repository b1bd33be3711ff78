"""The element types cupaged's kernels support, and how each is named everywhere."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

try:  # CuPy >= 14 represents bfloat16 arrays with ml_dtypes' NumPy dtype.
    import ml_dtypes as _ml_dtypes

    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes ships with the cuda extras
    _BF16 = None


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
