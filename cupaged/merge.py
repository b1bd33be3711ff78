"""Merging partial attention results by their log-sum-exp.

A partial attention result over some set of keys is ``out [rows, num_heads, head_size]``
(float16, bfloat16 or float32: each row already divided by its own softmax denominator)
with ``lse [rows, num_heads]`` float32, the natural log of that denominator (the sum of
``exp(logit)`` over its keys, the logits scaled as the attention scaled them).
Partials over disjoint key sets (a prefix and a suffix, split-KV partitions, a shared
prompt and each request's own tokens) merge exactly into the attention over their union::

    m = max(lse_a, lse_b),  w_a = exp(lse_a - m),  w_b = exp(lse_b - m)
    out = (w_a * out_a + w_b * out_b) / (w_a + w_b),  lse = m + log(w_a + w_b)

and likewise over any number of partials, in fp32. A partial with ``lse = -inf`` (it saw
no key) is the identity; a row whose partials all have ``lse = -inf`` comes out as zeros
with ``lse = -inf`` (never NaN), and a single partial as it is. NaN in any input reaches
the output.

FlashInfer's lse (its ``merge_state`` and the ``return_lse=True`` of its wrappers) is in
base 2: pass ``lse_flashinfer * math.log(2)``, and divide a result by ``math.log(2)`` to
hand it back. ``cupaged.reference.attend(..., return_lse=True)`` gives natural lses.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from . import _arrays, _checks, _dtypes, jit, planning
from ._arrays import as_device_array, optional_output_array

__all__ = ["merge_state", "merge_states"]

_THREADS = 128  # kMergeThreads in cuda_src/merge_states.cuh
_MAX_STATES = 8  # kMaxMergeStates: partials per launch
# MergeInputs: 8 out and 8 lse addresses, 8 each of the out row, out head, lse row and lse
# head strides (elements), the count, and the struct's tail padding.
_INPUTS = struct.Struct(f"@{2 * _MAX_STATES}P{4 * _MAX_STATES}qi4x")
_fail = _checks.fail


@jit.launcher_cache
def merge_kernel(device_id: int, dtype: str):
    spec = jit.KernelSpec("merge_states", dtype, arch=planning.device_info(device_id).arch)
    return jit.load(spec, device_id)


# ---- adaptation ------------------------------------------------------------------------------


class _Part(NamedTuple):
    """One partial of a stacked array, seen as the checks see adapted arrays (a view)."""

    shape: tuple
    strides: tuple
    dtype: np.dtype
    data: _arrays.Data

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _partials(xs, name: str, stacked: str) -> list:
    """``(name, array)`` per partial: of a sequence of arrays, or of one stacked array
    whose leading dimension indexes the partials (``stacked`` names its shape)."""
    if isinstance(xs, (list, tuple)):
        return [(f"{name}[{i}]", as_device_array(x, f"{name}[{i}]")) for i, x in enumerate(xs)]
    a = as_device_array(xs, name)
    if a.ndim != stacked.count(",") + 1:
        _fail(f"{name} must be a sequence of arrays or one stacked {stacked} array, got shape "
              f"{a.shape}")
    st, ptr, device = a.strides[0], a.data.ptr, a.data.device_id
    return [(f"{name}[{i}]", _Part(a.shape[1:], a.strides[1:], a.dtype,
                                   _arrays.Data(ptr + i * st, device)))
            for i in range(a.shape[0])]


# ---- validation ------------------------------------------------------------------------------


class _Input(NamedTuple):
    """What the kernel reads of one partial (a MergeInputs entry): addresses, and strides
    in elements."""

    out: int
    lse: int
    out_row: int
    out_head: int
    lse_row: int
    lse_head: int


class _Merge(NamedTuple):
    """A validated merge."""

    dtype: _dtypes.DType
    shape: tuple  # (rows, num_heads, head_size)
    device: int
    inputs: tuple  # _Input per partial, in order
    vec: bool  # every partial's (row, head) rows can be read in 16-byte vectors


def _vector_rows(ptr: int, strides, shape, itemsize: int) -> bool:
    """Is every (row, head) vector of an array 16-byte aligned and a whole number of 16
    bytes long? (The stride of a dimension of size 1 is never used.)"""
    return ptr % 16 == 0 and shape[2] * itemsize % 16 == 0 and all(
        st % 16 == 0 for n, st in zip(shape[:2], strides[:2]) if n > 1)


def _check_elements(a, name: str) -> None:
    it = a.dtype.itemsize
    if not _checks.is_empty(a) and (a.data.ptr % it or any(st % it for st in a.strides)):
        _fail(f"{name} must be aligned to its {it}-byte elements (pointer {a.data.ptr:#x}, "
              f"strides {a.strides})")


def _check_out(a, name: str, dt: _dtypes.DType, shape, ref: str) -> None:
    if a.dtype != dt.numpy:
        _fail(f"{name} dtype {a.dtype} does not match {ref} dtype {dt.numpy}", TypeError)
    if a.shape != shape:
        _fail(f"{name} shape {a.shape} does not match {ref} shape {shape}: every partial "
              f"output is [rows, num_heads, head_size]")
    _check_elements(a, name)
    if shape[2] > 1 and not _checks.is_empty(a) and a.strides[2] != a.dtype.itemsize:
        _fail(f"{name}'s last dimension (head_size) must be contiguous, got strides {a.strides}")


def _check_lse(a, name: str, shape) -> None:
    if a.dtype != np.float32:
        _fail(f"{name} must be float32 (the natural log of each row's softmax denominator), "
              f"got {a.dtype}", TypeError)
    if a.shape != shape:
        _fail(f"{name} must be [rows, num_heads] = {shape}, got shape {a.shape}")
    _check_elements(a, name)


def _check_distinct(a, name: str) -> None:
    """An output needs one address per element (each is written by one thread): no
    broadcast (zero) strides, no dimensions folded over each other."""
    if _checks.is_empty(a):
        return
    reach = a.dtype.itemsize
    for st, n in sorted((abs(st), n) for n, st in zip(a.shape, a.strides) if n > 1):
        if st < reach:
            _fail(f"{name}'s elements overlap (shape {a.shape}, strides {a.strides}): an "
                  f"output needs its own address for every element")
        reach += st * (n - 1)


def _same_array(a, b) -> bool:
    return (a.data.ptr, a.shape, a.strides, a.dtype) == (b.data.ptr, b.shape, b.strides, b.dtype)


def _check_apart(outputs, inputs, first: dict) -> None:
    """Outputs overlap no input, except that ``out`` and ``lse_out`` may be exactly the
    first partial's (``first``: output name -> that input's name): merging in place."""
    for oname, o in outputs:
        lo, hi = _checks.extent(o)
        for iname, a in inputs:
            ilo, ihi = _checks.extent(a)
            if lo >= ihi or ilo >= hi or _checks.is_empty(o) or _checks.is_empty(a):
                continue
            if iname == first[oname]:
                if not _same_array(o, a):
                    _fail(f"{oname} overlaps {iname} without being exactly it (the same "
                          f"address, shape and strides), which in-place merging needs")
            else:
                _fail(f"{oname} overlaps {iname}: outputs may be written in place only over "
                      f"the first partial ({first[oname]}), and overlap nothing else")


def validate_merge(outs: list, lses: list, out=None, lse_out=None) -> _Merge:
    """Every check, on array metadata only (no device sync). ``outs``, ``lses``: ``(name,
    adapted array)`` per partial; ``out``, ``lse_out``: adapted arrays or None."""
    if not outs:
        _fail("there must be at least one partial result to merge")
    if len(lses) != len(outs):
        _fail(f"{len(outs)} partial outputs but {len(lses)} lse arrays: one lse per output")
    ref, first = outs[0]
    dt = _checks.check_dtype(first, ref)
    if first.ndim != 3:
        _fail(f"{ref} must be [rows, num_heads, head_size], got shape {first.shape}")
    shape = first.shape
    it = dt.itemsize
    inputs = []
    vec = True
    for (oname, o), (lname, lse) in zip(outs, lses):
        _check_out(o, oname, dt, shape, ref)
        _check_lse(lse, lname, shape[:2])
        inputs.append(_Input(o.data.ptr, lse.data.ptr, o.strides[0] // it, o.strides[1] // it,
                             lse.strides[0] // 4, lse.strides[1] // 4))
        vec = vec and _vector_rows(o.data.ptr, o.strides, shape, it)
    device = first.data.device_id
    _checks.check_same_device(device, ref, (*outs[1:], *lses, ("out", out), ("lse_out", lse_out)))
    outputs = []
    if out is not None:
        _check_out(out, "out", dt, shape, ref)
        _check_distinct(out, "out")
        outputs.append(("out", out))
    if lse_out is not None:
        _check_lse(lse_out, "lse_out", shape[:2])
        _check_distinct(lse_out, "lse_out")
        outputs.append(("lse_out", lse_out))
    if outputs:
        _checks.check_disjoint(outputs)
        _check_apart(outputs, (*outs, *lses), {"out": ref, "lse_out": lses[0][0]})
    return _Merge(dt, shape, device, tuple(inputs), vec)


# ---- launch ----------------------------------------------------------------------------------


def _pack(chunk) -> bytes:
    """MergeInputs for up to 8 partials, unused entries zero."""
    pad = (0,) * (_MAX_STATES - len(chunk))
    return _INPUTS.pack(*(v for field in zip(*chunk) for v in (*field, *pad)), len(chunk))


def launch_merge(ctx: _arrays.Context, m: _Merge, o, lo) -> None:
    """Merge into ``o``, ``lo`` (adapted): the first 8 partials in one launch, then the
    running result (read from ``o``, ``lo`` in place) with up to 7 more per launch. With
    ``ctx.device`` current."""
    rows, heads, hs = m.shape
    it = m.dtype.itemsize
    vec = m.vec and _vector_rows(o.data.ptr, o.strides, m.shape, it)
    lanes = max(1, -(-hs // (16 // it if vec else 1)))  # threads one (row, head) could use
    shift = min(5, (lanes - 1).bit_length())  # a group of 2^shift threads, at most a warp
    grid = -(-((rows * heads) << shift) // _THREADS)
    running = _Input(o.data.ptr, lo.data.ptr, o.strides[0] // it, o.strides[1] // it,
                     lo.strides[0] // 4, lo.strides[1] // 4)
    kern = merge_kernel(ctx.device, m.dtype.name)
    tail = (o.data.ptr, running.out_row, running.out_head, lo.data.ptr, running.lse_row,
            running.lse_head, rows, heads, hs, shift, int(vec))
    inputs = m.inputs
    kern((grid, 1, 1), _THREADS, 0, ctx.stream, _pack(inputs[:_MAX_STATES]), *tail)
    for i in range(_MAX_STATES, len(inputs), _MAX_STATES - 1):
        chunk = (running, *inputs[i:i + _MAX_STATES - 1])
        kern((grid, 1, 1), _THREADS, 0, ctx.stream, _pack(chunk), *tail)


def _merge(outs: list, lses: list, out, lse_out, stream, kind: str):
    o = optional_output_array(out, "out")
    lo = optional_output_array(lse_out, "lse_out")
    m = validate_merge(outs, lses, o, lo)
    with _arrays.launching(m.device):
        ctx = _arrays.context(m.device, kind, stream)
        made_out, made_lse = o is None, lo is None
        if made_out:
            o, out = _arrays.empty(ctx, m.shape, m.dtype.numpy)
        if made_lse:
            lo, lse_out = _arrays.empty(ctx, m.shape[:2], np.float32)
        if m.shape[0] * m.shape[1]:
            launch_merge(ctx, m, o, lo)
        if made_out:
            out = _arrays.hand_over(ctx, out)
        if made_lse:
            lse_out = _arrays.hand_over(ctx, lse_out)
    return out, lse_out


def merge_state(out_a, lse_a, out_b, lse_b, *, out=None, lse_out=None, stream=None):
    """Merge two partial attention results over disjoint key sets into one.

    Args:
        out_a, out_b: ``[rows, num_heads, head_size]``, float16, bfloat16 or float32 (the
            same for both), each row normalized by its own softmax; row and head strides
            free, the last dimension contiguous.
        lse_a, lse_b: float32 ``[rows, num_heads]`` (any strides), the natural log of each
            row's softmax denominator; ``-inf`` for a row that saw no key. FlashInfer's
            lse is base 2: pass ``lse * math.log(2)``.
        out, lse_out: optional outputs (``out``'s dtype and shape, float32 ``[rows,
            num_heads]``; any strides that give each element its own address, the last
            dimension of ``out`` contiguous). ``out=out_a, lse_out=lse_a`` merges in
            place into the first partial; no other overlap with an input is allowed.
        stream: as for :func:`cupaged.paged_attention` (torch's current stream when
            ``out_a`` is a torch tensor).

    Returns ``(out, lse)``: ``out = (w_a out_a + w_b out_b) / (w_a + w_b)`` with ``w =
    exp(lse - max(lse_a, lse_b))``, ``lse = max + log(w_a + w_b)``, computed in fp32;
    the given outputs, or new arrays of ``out_a``'s kind (torch in, torch out). A partial
    with ``lse = -inf`` is the identity; two give zeros and ``-inf``. No copies, no sync.
    """
    outs = [("out_a", as_device_array(out_a, "out_a")), ("out_b", as_device_array(out_b, "out_b"))]
    lses = [("lse_a", as_device_array(lse_a, "lse_a")), ("lse_b", as_device_array(lse_b, "lse_b"))]
    return _merge(outs, lses, out, lse_out, stream, _arrays.framework(out_a))


def merge_states(outs, lses, *, out=None, lse_out=None, stream=None):
    """Merge any number of partial attention results over disjoint key sets into one.

    Args:
        outs: a sequence of ``[rows, num_heads, head_size]`` arrays (float16, bfloat16 or
            float32, all one dtype; row and head strides free, the last dimension
            contiguous), or one stacked ``[num_states, rows, num_heads, head_size]`` array.
        lses: float32, a sequence of ``[rows, num_heads]`` arrays or one stacked
            ``[num_states, rows, num_heads]`` array (any strides): the natural log of each
            row's softmax denominator, ``-inf`` where a partial saw no key. FlashInfer's
            lse is base 2: pass ``lse * math.log(2)``.
        out, lse_out: optional outputs, as for :func:`merge_state`; ``out=outs[0],
            lse_out=lses[0]`` (or the first slices of stacked arrays) merges in place.
        stream: as for :func:`cupaged.paged_attention` (torch's current stream when the
            first partial is a torch tensor).

    Returns ``(out, lse)``, as :func:`merge_state` over all partials at once: one launch
    for up to 8 partials; more go 7 at a time with the running result, which is then
    rounded to the dtype between launches. A single partial comes back as it is.
    """
    o = _partials(outs, "outs", "[num_states, rows, num_heads, head_size]")
    lse = _partials(lses, "lses", "[num_states, rows, num_heads]")
    first = outs[0] if isinstance(outs, (list, tuple)) and outs else outs
    return _merge(o, lse, out, lse_out, stream, _arrays.framework(first))
