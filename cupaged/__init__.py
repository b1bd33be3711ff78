"""cupaged: paged-attention kernels compiled at run time, for any Python program.

Decode attention over a paged KV cache (vLLM's layout) on CuPy arrays, with CUDA C++
templates specialized per dtype, head size and block size, compiled with NVRTC and cached.

Public API:
    paged_attention         decode attention (single pass or split-KV)
    paged_attention_v1/v2   the same with vLLM's argument order
    check_block_tables      validate block tables against the cache (synchronizes)
    precompile              compile specializations ahead of use
    KernelSpec              one specialization (its .name appears in caches and errors)
    reference               float64 NumPy reference implementation
"""

from . import reference
from .attention import (
    BLOCK_SIZES,
    HEAD_SIZES,
    check_block_tables,
    paged_attention,
    paged_attention_v1,
    paged_attention_v2,
)
from .jit import CompileError, KernelSpec, precompile

__version__ = "0.1.0"

__all__ = [
    "BLOCK_SIZES",
    "CompileError",
    "HEAD_SIZES",
    "KernelSpec",
    "check_block_tables",
    "paged_attention",
    "paged_attention_v1",
    "paged_attention_v2",
    "precompile",
    "reference",
]
