"""Prepared calls: a validated attention call's launches, remembered by what its validation
read, so that repeating the call (every layer of a model, every step) skips validation and
planning.

A call's arguments are seen in two parts. Its *main* arrays (query, caches, tables,
lengths, outputs) change address from layer to layer and step to step: the key holds
what validation reads of them (shape, strides, dtype, device, and the address modulo 16
for the alignment checks) and each call passes their addresses to the launches afresh.
Its *side* arrays (ALiBi slopes, sinks, scale arrays) and its scalars rarely change: the
key holds them whole (an array's address included), since the prepared launches embed
them. So a key names exactly one validation outcome: a call that would fail never
matches one that passed (a failure is never remembered), and what depends on the
addresses themselves (whether an output overlaps an input) is checked on every call.

Only CuPy arrays and torch tensors are keyed; other DLPack producers, and
``CUPAGED_DEBUG=1`` (whose checks read device data), take the validating path each time.
"""

from __future__ import annotations

import sys
import threading
from typing import NamedTuple

import cupy
import numpy as np

from . import _arrays, _checks, jit
from ._variants import SoftCap

_MAX_ENTRIES = 256


class _Memo(dict):
    def cache_clear(self) -> None:  # emptied by jit.clear_memory_caches, with the launchers
        clear()


_MEMO = _Memo()
jit.register_launcher_cache(_MEMO)
UNKEYED = object()  # an argument the memo does not handle: validate every call
_F32 = np.dtype(np.float32)
_NUMBERS = (int, float, np.integer, np.floating)
# Scalars keyed by value: immutable, hashed and compared by value (a SoftCap is a frozen
# dataclass of a number and a flag). Anything else (a 0-d tensor as scale, say, hashed by
# identity and mutable in place) is validated each call.
SCALAR_TYPES = frozenset({type(None), bool, int, float, str, tuple, np.bool_, np.int8,
                          np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                          np.uint64, np.float16, np.float32, np.float64, SoftCap})
# Bumped by clear(): a key made before a clear (an override of tiles or splits) never
# matches one made after it, even when a racing call remembers it late.
_generation = 0


class Prepared(NamedTuple):
    """What a repeated call still does itself: allocate what it returns, check that its
    outputs do not overlap its inputs, and launch."""

    launch: object  # launch.Launch, MlaLaunch or WidenedMlaLaunch; None: nothing to launch
    device: int
    kind: str  # _arrays.framework() of the query: whose arrays to allocate and return
    shape: tuple  # the output's (attention's: the query's too)
    dtype: object  # NumPy dtype of the query and the output
    q_span: tuple  # the query's bytes, [lo, hi) relative to its address; () when empty
    out_bytes: int
    in_place: bool  # out may be the query itself (the same strides)
    wants_lse: bool  # the call returns (out, lse)
    new_lse: tuple  # return_lse without lse=: the shape of a new float32 array; else ()
    # mla_attention's: the pairs of arrays validation found disjoint (disjoint_spans), which
    # any_overlap checks at each call's addresses.
    disjoint: tuple = ()


def _torch_tensor():
    t = sys.modules.get("torch")
    return None if t is None else t.Tensor


def key(kind: str, main, side, scalars, extra=()):
    """``(key, addresses)`` for a call, or ``(None, None)`` when it cannot be memoized.
    ``main``: arrays (or None) whose addresses change; ``side``: arrays, numbers or None
    kept whole; ``scalars``: hashable arguments, keyed with their types (True is not 1,
    16.0 is not 16, for validation); ``extra``: more hashable key parts."""
    if _checks.debug() or extra is UNKEYED:
        return None, None
    types = tuple(map(type, scalars))
    if not SCALAR_TYPES.issuperset(types):
        return None, None
    m, ptrs = metas(main)
    if m is None:
        return None, None
    sides = tuple([_side(x) for x in side])
    if UNKEYED in sides:
        return None, None
    # The types come before the values: a value compared with a remembered key's is then
    # of the same (hashable) type, never an array whose == is elementwise.
    return (kind, _generation, types, scalars, extra, m, sides), ptrs


def metas(arrays):
    """``(metadata, addresses)`` of arrays (or None) whose addresses change from call to
    call: per array what validation reads (shape, strides, dtype, device, the address
    modulo 16; for torch, requires_grad) and, apart, its address (0 for None). ``(None,
    None)`` when one is neither a CuPy array nor a torch tensor."""
    tensor = None
    m, ptrs = [], []
    for x in arrays:
        if x is None:
            m.append(None)
            ptrs.append(0)
        elif type(x) is cupy.ndarray:
            d = x.data
            p = d.ptr
            m.append((x.shape, x.strides, x.dtype, p & 15, d.device_id))
            ptrs.append(p)
        else:
            tensor = tensor or _torch_tensor()
            if tensor is None or not isinstance(x, tensor):
                return None, None
            if not x.is_cuda:  # (get_device() is an index on other accelerators too)
                return None, None
            p = x.data_ptr()
            m.append((x.shape, x.stride(), x.dtype, p & 15, x.get_device(), x.requires_grad))
            ptrs.append(p)
    return tuple(m), ptrs


def side_tensors(*args) -> tuple:
    """The torch tensors among a plan's side arguments (ALiBi slopes, sinks, scale
    arrays): set_, resize_ and ``.data =`` re-point or resize a tensor in place, where a
    prepared launch holds its address, so a plan compares their :func:`side_state` at
    each run. (A CuPy array's address and size cannot change.)"""
    return tuple(a for a in args if _arrays.is_torch(a))


def side_state(tensors) -> tuple:
    """What a run compares of :func:`side_tensors`: each one's address, shape, strides
    and dtype."""
    return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)


def _side(x):
    """A side argument's key: a number by type and value, an array by its metadata and
    whole address (UNKEYED for other kinds, and a CPU tensor, whose value is read)."""
    if x is None:
        return None
    if type(x) in SCALAR_TYPES and isinstance(x, _NUMBERS):
        return (type(x), x)
    m, ptrs = metas((x,))
    return UNKEYED if m is None else (m[0], ptrs[0])


# The last hit of each kind of call: a model's layers repeat one call, and comparing keys
# (mostly identical objects) costs a third of hashing one.
_LAST: dict = {}


def lookup(k):
    """The prepared call of key ``k`` (None: not yet, or not keyable)."""
    if k is None:
        return None
    last = _LAST.get(k[0])
    if last is not None and last[0] == k:
        return last[1]
    try:
        prep = _MEMO.get(k)
    except TypeError:  # an unhashable scalar: the validating path names it
        return None
    if prep is not None:
        _LAST[k[0]] = (k, prep)
    return prep


def remember(k, prepared: Prepared) -> None:
    if k is None:
        return
    if len(_MEMO) >= _MAX_ENTRIES:
        _MEMO.clear()
    try:
        _MEMO[k] = prepared
    except TypeError:  # an unhashable scalar: not remembered
        pass


def clear() -> None:
    global _generation, fast_attention, fast_mla
    with _FAST_LOCK:
        _generation += 1
        _MEMO.clear()
        _LAST.clear()
        _FAST.clear()
        fast_attention, fast_mla = {}, {}


# The fast runs (_fastrun) of remembered calls, by the identity of their prepared call
# (hashing the key again would cost what the run saves), each kept with it: (prepared, run
# or None when the call has none). `fast_attention`, `fast_mla`: the runs attention() and
# mla_attention() try first, by the query's shape (its first part's, for an MLA pair),
# most recently used first; a few a shape, so that layers of a few forms in turn
# (sliding-window and global layers) each find theirs. Keyed so that a call no run can
# take (a verify step beside decode layers) tries none: each declined run costs a Python
# call of some twenty arguments.
_FAST: dict = {}
_FAST_LOCK = threading.Lock()
_FAST_TRIED = 4
fast_attention: dict = {}
fast_mla: dict = {}


def _fast_table(kind: str) -> dict:
    """The runs the entry point of key kind ``kind`` tries ("attention" or "mla")."""
    return fast_mla if kind == "mla" else fast_attention


def use_fast(k, prepared: Prepared, make, *args) -> None:
    """Put the fast run of the remembered call of key ``k``, prepared as ``prepared``
    (``make(*args)``, once per prepared call), first among those its entry point tries
    (``k``'s kind: attention() or mla_attention()); not when the memo was cleared since
    ``k`` was made (by another thread, after this call's lookup): its prepared call may be
    outdated (a test override of tiles or splits)."""
    got = _FAST.get(id(prepared))
    if got is not None and any(r() is None for r in getattr(got[1], "refs", ())):
        got = None  # made for a workspace since freed (_fastrun.call_runner)
    if got is None:
        got = (prepared, make(*args))
        with _FAST_LOCK:
            if k[1] != _generation:
                return
            if len(_FAST) >= _MAX_ENTRIES:
                _FAST.clear()
            _FAST[id(prepared)] = got
    run = got[1]
    if run is not None:
        shape = k[5][0][0]  # the query's (metas' first array, its shape first)
        with _FAST_LOCK:
            if k[1] == _generation:
                table = _fast_table(k[0])
                tried = table.get(shape, ())
                if not tried or tried[0] is not run:
                    table[shape] = (run, *[r for r in tried if r is not run][:_FAST_TRIED - 1])


def overlaps(prep: Prepared, q: int, out: int) -> bool:
    """Would ``out`` at this address overlap the query in a way the kernels cannot take
    (anything but the very same array, written in place)?"""
    if not prep.q_span or not out:
        return False
    lo, hi = prep.q_span
    return (q + lo < out + prep.out_bytes and out < q + hi
            and not (out == q and prep.in_place))


def disjoint_spans(written, read) -> tuple:
    """What :func:`any_overlap` checks: each written array against each read one and the
    written ones against each other, as ``(i, lo, hi, j, lo, hi)``: indices into a call's
    addresses and each array's bytes relative to its address. ``written``, ``read``:
    ``(index, adapted array or None)``; absent and empty arrays are left out. An array
    whose index is None is keyed at its address (a side array, a caller's scratch): its
    bytes are absolute, and a pair of two such is left out (validation checked it once)."""
    w = [(i, *(_checks.extent(a) if i is None else span(a))) for i, a in written
         if a is not None and span(a)]
    r = [(j, *(_checks.extent(a) if j is None else span(a))) for j, a in read
         if a is not None and span(a)]
    return tuple([x + y for n, x in enumerate(w) for y in r + w[n + 1:]
                  if x[0] is not None or y[0] is not None])


def any_overlap(pairs, ptrs) -> bool:
    """Would any pair of :func:`disjoint_spans` overlap at these addresses (``ptrs``)?"""
    for i, lo1, hi1, j, lo2, hi2 in pairs:
        a = 0 if i is None else ptrs[i]
        b = 0 if j is None else ptrs[j]
        if a + lo1 < b + hi2 and b + lo2 < a + hi1:
            return True
    return False


def clashes(prep: Prepared, ptrs) -> bool:
    """Would a call of attention's or paged_attention's at these addresses (``run``'s
    order) write where it may not: out over the query other than in place, or out or lse
    over anything else the call reads?"""
    return overlaps(prep, ptrs[0], ptrs[6]) or any_overlap(prep.disjoint, ptrs)


def run(prep: Prepared, ptrs, stream, out, lse, extra: tuple = ()):
    """Launch a prepared call with these addresses (``ptrs``: query, key and value caches,
    block tables, lengths, query starts, out, lse; 0 for none; mla_attention's query is
    its (latent, rope) pair, its caches the latent and rope ones; ``extra``: the sparse
    second cache's, MlaLaunch.run's). ``out``/``lse``: the caller's arrays (or None),
    handed back. The caller has checked ``overlaps`` (or ``any_overlap``)."""
    q, k, v, bt, lens, starts, o, lse_ptr = ptrs
    with _arrays.launching(prep.device):
        ctx = _arrays.context(prep.device, prep.kind, stream)
        returned = out
        if out is None:
            made, returned = _arrays.empty(ctx, prep.shape, prep.dtype)
            o = made.data.ptr
        returned_lse = lse
        if prep.new_lse:
            made, returned_lse = _arrays.empty(ctx, prep.new_lse, _F32)
            lse_ptr = made.data.ptr
        if prep.launch is not None:
            if extra:
                prep.launch.run(ctx, o, q, k, v, bt, lens, starts, lse_ptr, extra)
            else:
                prep.launch.run(ctx, o, q, k, v, bt, lens, starts, lse_ptr)
        if ctx.kind == "jax":  # after the launches (see _arrays.hand_over)
            if out is None:
                returned = _arrays.hand_over(ctx, returned)
            if prep.new_lse:
                returned_lse = _arrays.hand_over(ctx, returned_lse)
    return (returned, returned_lse) if prep.wants_lse else returned


def addresses(*arrays) -> list:
    """The addresses of adapted arrays (0 for None), in ``run``'s order."""
    return [0 if a is None else a.data.ptr for a in arrays]


def span(a) -> tuple:
    """An adapted array's bytes as ``(lo, hi)`` relative to its address (() if empty)."""
    if _checks.is_empty(a):
        return ()
    lo, hi = _checks.extent(a)
    return lo - a.data.ptr, hi - a.data.ptr
