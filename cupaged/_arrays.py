"""Array adaptation: turn what the caller passed into CuPy arrays, or say why not."""

from __future__ import annotations

import cupy
import numpy as np


def as_device_array(x, name: str) -> cupy.ndarray:
    """``x`` as a ``cupy.ndarray`` without copying, or a TypeError naming ``name``."""
    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} is a NumPy array (host memory); cupaged needs a CUDA array, "
            f"e.g. cupy.asarray({name})"
        )
    raise TypeError(f"{name} must be a CUDA array (cupy.ndarray), got {type(x).__name__}")


def optional_device_array(x, name: str) -> cupy.ndarray | None:
    return None if x is None else as_device_array(x, name)
