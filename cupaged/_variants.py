"""Attention variants on the host: validation of the window, soft-cap, sink, lse and
blocksparse arguments, and their packing into ``VariantParams`` (cuda_src/variants.cuh).

The compile-time part is a string of ``jit.VARIANT_BITS`` letters (part of the kernel's
specialization); the run-time part is the 56-byte struct every attention kernel takes by
value. A call that uses none of them takes the ``PLAIN`` constant without building
anything.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import _checks

_fail = _checks.fail
_LOG2E = math.log2(math.e)
_FLT_MAX = 3.4028234663852886e38

# VariantParams: sinks, lse, window, cap_in, cap_out, sparse_local, sparse_vert,
# sparse_block, sparse_step, sparse_tp_rank, lse_keys, then the C struct's tail padding.
_STRUCT = struct.Struct("@PPiffiiiiii4x")
assert _STRUCT.size == 56


@dataclass(frozen=True)
class SoftCap:
    """A logits soft-cap with a choice of its tanh, for ``logits_soft_cap=``.

    ``logits_soft_cap=c`` (a number) is ``SoftCap(c)``: each logit becomes
    ``c * tanh(logit / c)``, computed to about 1e-7 of ``c``. ``SoftCap(c, approx=True)``
    computes the tanh in one ``tanh.approx.f32`` (the form FlashInfer and FlashAttention
    use): each capped logit is then off by at most about ``2**-11 * c`` (natural-log units,
    so a weight by a factor within ``exp(+-2**-11 * c)``: 2.5% at c = 50), and Hopper's
    multi-token kernel runs a soft-capped call about 1.27x faster (docs/PERFORMANCE.md).
    Hashable; the prepared calls and ``cupaged.jax`` take it as they take a number.
    """

    cap: float
    approx: bool = False

    def __post_init__(self):
        # Types checked here, values by the call (soft_cap): equal SoftCaps are then the
        # same call's, as the remembered calls key them (SoftCap(True) would equal SoftCap(1)).
        c = self.cap
        if not _checks.is_real_number(c):
            _fail(f"SoftCap.cap must be a number, got {type(c).__name__}", TypeError)
        if not isinstance(self.approx, (bool, np.bool_)):
            _fail(f"SoftCap.approx must be a bool, got {type(self.approx).__name__}", TypeError)
        object.__setattr__(self, "cap", float(c))
        object.__setattr__(self, "approx", bool(self.approx))


class Variants(NamedTuple):
    letters: str  # the compile-time variants ("" plain, "w", "c", "wc", "b", ...)
    window: int = 0  # W >= 1, or 0 for none
    soft_cap: float = 0.0  # c > 0, or 0 for none
    sinks: object = None  # the float32 [num_heads] device array, or None
    sparse: tuple = ()  # blocksparse: (local_blocks, vert_stride, block_size, step, tp_rank)
    lse_keys: bool = False  # with sinks: the lse is the keys' alone (FlashMLA's attn_sink)

    def pack(self, lse: int = 0) -> bytes:
        """The VariantParams bytes of a call; ``lse``: the address of its float32
        ``[rows, num_heads]`` lse output (0: none), which changes from call to call."""
        c = self.soft_cap
        local, vert, block, step, rank = self.sparse or (0, 1, 1, 0, 0)
        return _STRUCT.pack(0 if self.sinks is None else self.sinks.data.ptr, lse, self.window,
                            2.0 / c if c else 0.0, c * _LOG2E if c else 0.0,
                            local, vert, block, step, rank, int(self.lse_keys))


PLAIN = Variants("")
PLAIN_BYTES = PLAIN.pack()


def _int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        _fail(f"{name} must be an int, got {type(v).__name__}", TypeError)
    return int(v)


def window_size(window, window_left) -> int:
    """W from ``window`` (keys in (p - W, p]) or FlashInfer's ``window_left`` (W - 1;
    -1 for none); 0 when neither is given."""
    if window is not None and window_left is not None:
        _fail("give window or window_left, not both (window = window_left + 1)")
    if window_left is not None:
        left = _int(window_left, "window_left")
        if left < -1:
            _fail(f"window_left must be -1 (no window) or at least 0, got {left}")
        return 0 if left == -1 else min(left + 1, _checks.INT32_MAX)
    if window is None:
        return 0
    w = _int(window, "window")
    if w < 1:
        _fail(f"window must be at least 1 (keys in (pos - window, pos]), got {w}")
    return min(w, _checks.INT32_MAX)  # beyond any position: the same as no window


def soft_cap(value) -> tuple[float, bool]:
    """``logits_soft_cap`` as (c > 0, tanh.approx wanted), or (0.0, False) for none (None
    or 0, FlashInfer's spelling of none; a SoftCap of cap 0 too)."""
    if value is None:
        return 0.0, False
    if isinstance(value, SoftCap):  # (its types checked when made)
        approx, value, what = value.approx, value.cap, "SoftCap.cap"
    elif _checks.is_real_number(value):
        approx, what = False, "logits_soft_cap"
    else:
        _fail(f"logits_soft_cap must be a number or a cupaged.SoftCap, got "
              f"{type(value).__name__}", TypeError)
    c = float(value)
    if c == 0.0:
        return 0.0, False
    if not (math.isfinite(c) and c > 0.0) or c * _LOG2E > _FLT_MAX or 2.0 / c > _FLT_MAX:
        _fail(f"{what} must be a positive finite float32 (or None / 0 for none), got {value}")
    return c, bool(approx)


def check_sinks(sinks, num_heads: int, device: int, name: str = "sinks", query: str = "query"):
    """``sinks`` as a float32 [num_heads] device array (contiguous), or None (``name``,
    ``query``: the arguments' names in errors)."""
    if sinks is None:
        return None
    if sinks.dtype != np.float32 or sinks.shape != (num_heads,) or \
            (num_heads and sinks.strides[0] != 4):
        _fail(f"{name} must be a contiguous float32 [num_heads = {num_heads}] array, got "
              f"{sinks.dtype} {sinks.shape}")
    _checks.check_aligned(sinks.data.ptr, name, 4)
    _checks.check_same_device(device, query, ((name, sinks),))
    return sinks


def check_lse(lse, rows: int, num_heads: int, device: int):
    """A caller's ``lse=`` output: float32 [rows, num_heads], C-contiguous, on ``device``."""
    if lse.dtype != np.float32 or lse.shape != (rows, num_heads) or \
            not (rows * num_heads == 0 or lse.flags.c_contiguous):
        _fail(f"lse must be a C-contiguous float32 [{rows}, {num_heads}] array, got "
              f"{lse.dtype} {lse.shape}")
    _checks.check_same_device(device, "query", (("lse", lse),))
    _checks.check_aligned(lse.data.ptr, "lse", 4)
    return lse


def blocksparse(tp_rank, local_blocks, vert_stride, block_size, head_sliding_step) -> tuple:
    """vLLM's blocksparse arguments as VariantParams' (local, vert, block, step, tp_rank),
    or () for dense attention (``vert_stride`` 0 or 1, vLLM's own switch)."""
    names = ("tp_rank", "blocksparse_local_blocks", "blocksparse_vert_stride",
             "blocksparse_block_size", "blocksparse_head_sliding_step")
    vals = [_int(v, n) for v, n in zip((tp_rank, local_blocks, vert_stride, block_size,
                                        head_sliding_step), names)]
    tp_rank, local_blocks, vert_stride, block_size, step = vals
    if vert_stride <= 1:
        return ()
    if block_size <= 0:
        _fail(f"blocksparse_block_size must be positive, got {block_size}")
    if tp_rank < 0 or local_blocks < 0:
        _fail(f"tp_rank and blocksparse_local_blocks must be >= 0, got {tp_rank} and "
              f"{local_blocks}")
    for name, v in zip(names, vals):
        if abs(v) > _checks.INT32_MAX:
            _fail(f"{name} is {v}; at most {_checks.INT32_MAX}")
    return (local_blocks, vert_stride, block_size, step, tp_rank)


def letters(window: int, cap: float, sparse: tuple, approx: bool = False) -> str:
    """The compile-time variant string of a call (``approx``: the cap's tanh.approx)."""
    return (("w" if window else "") + ("c" if cap else "") + ("t" if cap and approx else "")
            + ("b" if sparse else ""))


# cuda_src/variants.cuh's kMaxFixedCap: the largest soft-cap, in log2 units (c log2(e)),
# whose logits the multi-token kernel weighs against a fixed offset instead of a running
# maximum (c <= 54.06).
MAX_FIXED_CAP = 78.0


def prefill_letters(v: Variants, dtype: str, alibi: bool) -> str:
    """paged_prefill's variant letters: the call's, "a" with ALiBi slopes, and "f" for a
    bfloat16 soft-cap without ALiBi small enough for the fixed offset (the logits are then
    bounded, so the softmax needs no running maximum; float16 weights lack the range)."""
    fixed = v.soft_cap and not alibi and dtype == "bf16" and v.soft_cap * _LOG2E <= MAX_FIXED_CAP
    return v.letters + ("a" if alibi else "") + ("f" if fixed else "")
