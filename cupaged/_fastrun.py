"""The fast run: a prepared call's repeat as one straight-line function, for
``AttentionPlan.run`` and for the remembered calls of ``attention`` and ``mla_attention``,
with every check of the generic path (``_prepared.run`` after the key or the plan's
comparison) kept.

A fast run stands only for calls the generic path would launch the same way, byte for
byte (tests/test_fastrun.py and tests/test_mla_fastrun.py compare the two with the
driver stubbed). Per call it:

  - takes nothing but the arrays of its kind, CuPy arrays or torch tensors (exactly
    torch.Tensor: CUDA, requires_grad as validation saw it), no ``stream=`` (CuPy's or
    torch's current stream, as the generic path), for a plan no scales of the call's own,
    and for the entry points the remembered call's keywords (the same objects, or of the
    same type and equal);
  - checks each per-call array's shape, strides, dtype, device and address modulo 16
    against the ones validation passed, one by one against constants (mla_attention's
    query as the pair it was, and a device k_scale as a per-call array: validation reads
    nothing else of it);
  - for a plan, re-reads its bound tables' shape (a CuPy array's address, dtype and
    device are fixed, its strides change only with its shape) or, for torch tensors,
    everything (set_ and resize_ re-point and reshape one in place): a table changed in
    place must not be read where it was;
  - checks ``out`` against the query (in place or apart) and ``out`` and ``lse`` against
    every array the call reads, at this call's addresses (``_prepared.clashes``,
    ``_prepared.any_overlap``; a pair of two fixed addresses was checked when the plan was
    made);
  - runs only on the arrays' device being current, with ``CUPAGED_DEBUG`` off and no
    DLPack import of this thread waiting to be ordered and held;
then writes the call's addresses (and mla_attention_sm90's tensor maps of the call's
caches, from the launch's own ``MlaTmaMaps``) into parameter buffers packed once per
thread and calls ``cuLaunchKernel`` for each launch. Any other call goes to the generic
path, unchanged: a plan's ``run`` method, or for an entry point the memo (``MISS``; each
tries the fast runs of its last few remembered calls of the query's shape,
``_prepared.fast_attention`` and ``_prepared.fast_mla``).

A run exists for a call whose launches (one, or a split's kernel and its combine) take
its arrays' addresses, each as passed or at a fixed offset (a single MLA query's and a
combined cache's rope part), and constants (the launch's run, recorded with stand-in
addresses): ``out`` given, no new lse, CuPy arrays or torch tensors, and for
``attention`` no side arrays (ALiBi slopes, sinks, scale arrays). A split-KV scratch of
the call's own is allocated, and its counters zeroed, per call as the launch's run does
(its rows, width and counters the launch's ``scratch_need``).

The code is generated per *form* of call (which arrays are per call, which are bound,
which pairs are checked, where the addresses go) and compiled once; a plan or a
remembered call binds its constants into a closure.
"""

from __future__ import annotations

import ctypes
import linecache
import re
import struct
import sys
import threading
import weakref
from typing import Callable, NamedTuple

import cupy
from cupy_backends.cuda.api import runtime

from . import _arrays, _checks, _prepared, jit, launch
from ._variants import SoftCap

MISS = object()  # returned by a remembered call's fast run that declined
# The array types runs take: CuPy's, and torch.Tensor once a torch run has been built
# (the entry points try runs only for a query of one of these types).
TYPES = {cupy.ndarray}

# Stand-in addresses for recording a launch's arguments: two sets whose spacings differ, so
# that the words of an address tell which array's it is and at what offset, and whose low
# halves differ too (an address's first four bytes tell that it is one).
_STREAM = 0x5EED_0000
_A = tuple(0x1000_0000_0000 + i * 0x1_0000_0000 for i in range(16))
_B = tuple(0x2000_0000_0000 + i * 0x3_0000_0100 + 0x100 for i in range(16))
_MAX_OFFSET = 1 << 32  # an address passed at an offset: a part of the array (bytes)


# ---- the entry points --------------------------------------------------------------------


def _attention_addresses(la, a, present):
    return la, a[:8]  # (the call's order is _prepared.run's)


_MLA_SCALE = 9  # mla_attention's address index of a device k_scale


def _mla_addresses(la, a, present):
    if _MLA_SCALE in present:  # a device k_scale, whose address comes per call
        la = la.at_scale(a[_MLA_SCALE])
    return la, launch.mla_run_addresses(a, 1 in present, 3 in present)


class Entry(NamedTuple):
    """An entry point whose repeats take fast runs, as the generated code needs it."""

    names: tuple  # each address index's variable in the run (its argument's name, if one)
    nullable: tuple  # indices whose argument is None where a form has no such array
    refused: tuple  # arguments a fast run never takes (not None: the generic path)
    signature: str  # the run's parameters: the entry point's, which passes them in order
    miss: str  # what a declined call returns
    out: int  # out's index
    # (launch, addresses, present indices) -> (the launch, _prepared.run's addresses): how
    # a call's addresses (0 for absent indices) reach the launch's run
    addresses: Callable
    pair: tuple = ()  # (first, second): indices of a query that may come as a pair


_ATTENTION_NAMES = ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
                    "query_start_loc", "out", "lse")
# attention's own parameters, in the order attention() passes them to its fast run
ATTENTION_SIGNATURE = ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
                       "query_start_loc", "kv_layout", "causal", "scale", "alibi_slopes",
                       "max_query_len", "max_seq_len", "out", "stream", "workspace",
                       "kv_cache_dtype", "k_scale", "v_scale", "window", "window_left",
                       "logits_soft_cap", "sinks", "return_lse", "lse")
KEYWORDS = ("kv_layout", "causal", "scale", "alibi_slopes", "max_query_len", "max_seq_len",
            "workspace", "kv_cache_dtype", "k_scale", "v_scale", "window", "window_left",
            "logits_soft_cap", "sinks", "return_lse")
# mla_attention's, in the order mla_attention() passes them to its fast run
MLA_SIGNATURE = ("q", "kv_cache", "block_tables", "seq_lens", "query_start_loc", "scale",
                 "kv_lora_rank", "k_pe_cache", "causal", "max_query_len", "max_seq_len", "out",
                 "return_lse", "lse", "stream", "kv_cache_dtype", "k_scale", "workspace")
MLA_KEYWORDS = ("scale", "kv_lora_rank", "causal", "max_query_len", "max_seq_len",
                "return_lse", "kv_cache_dtype", "k_scale", "workspace")
ENTRIES = {
    "plan": Entry(_ATTENTION_NAMES, (7,), ("stream", "k_scale", "v_scale"),
                  "query, key_cache, value_cache, *, out=None, lse=None, stream=None, "
                  "k_scale=None, v_scale=None",
                  "slow(query, key_cache, value_cache, out=out, lse=lse, stream=stream, "
                  "k_scale=k_scale, v_scale=v_scale)", 6, _attention_addresses),
    "attention": Entry(_ATTENTION_NAMES, tuple(range(8)), ("stream",),
                       ", ".join(ATTENTION_SIGNATURE), "MISS", 6, _attention_addresses),
    # mla_attention's addresses: validate_and_prepare's, then a device k_scale's
    "mla": Entry(("q", "q_pe", "kv_cache", "k_pe_cache", "block_tables", "seq_lens",
                  "query_start_loc", "out", "lse", "k_scale"), (0, 2, 3, 4, 5, 6, 7, 8),
                 ("stream",), ", ".join(MLA_SIGNATURE), "MISS", 7, _mla_addresses, (0, 1)),
}


# ---- recording a launch ------------------------------------------------------------------


class _Recorder:
    """Stands for one of a launch's kernels: records each launch instead of making it."""

    def __init__(self, calls, kernel):
        self.calls, self.kernel = calls, kernel

    def __call__(self, grid, block, smem, stream, *args):
        self.calls.append((self.kernel, grid, block, smem, stream, args))


class _MapsRecorder:
    """Stands for an MlaLaunch's tensor maps (launch.MlaTmaMaps): records the addresses it
    is asked for and gives a marker (one per set of stand-ins), found where the maps go."""

    def __init__(self, seed: int):
        self.calls = []
        self.mark = bytes((k * 37 + seed) % 251 + 1 for k in range(launch.MLA_TMA.size))

    def __call__(self, lat: int, rope: int) -> bytes:
        self.calls.append((lat, rope))
        return self.mark


def _record(la, present, marks, entry: Entry):
    """``(launches, maps recorder)`` of the launch's run with the addresses ``marks`` (0
    for indices not ``present``; a per-call scratch's partials at the indices after the
    entry's), through recorders."""
    calls = []
    maps = _MapsRecorder(11 if marks is _A else 23)
    la, (q, k, v, bt, lens, starts, o, lse) = entry.addresses(
        la, [marks[i] if i in present else 0 for i in range(len(entry.names))], present)
    # (NamedTuple's _replace, its public copy-with-changes)
    changes = {"kernel": _Recorder(calls, la.kernel)}
    if la.combine is not None:
        changes["combine"] = _Recorder(calls, la.combine)
    need = la.scratch_need()
    if need is not None:
        n = len(entry.names)
        rows, _, counters = need
        changes["partials"] = launch.Partials(marks[n], marks[n + 1], marks[n + 2], rows,
                                              marks[n + 3] if counters else 0, counters)
    if isinstance(getattr(la, "tma", None), launch.MlaTmaMaps):
        changes["tma"] = maps
    la._replace(**changes).run(_arrays.Context(0, _STREAM, "cupy", False), o, q, k, v, bt,
                               lens, starts, lse)
    return calls, maps


def _resolve(a: int, b: int, indices):
    """``(index, offset)`` of an argument that was ``a`` in the first recording and ``b``
    in the second: one array's stand-in address plus a fixed offset; None otherwise."""
    for i in indices:
        if b - a == _B[i] - _A[i] and 0 <= a - _A[i] < _MAX_OFFSET:
            return i, a - _A[i]
    return None


def _address_slots(a: bytearray, b: bytearray, indices):
    """``{index: ((byte offset, address offset), ...)}``: where two recordings' packed
    parameters differ, each an address of ``indices`` (8 bytes, at a multiple of 4 as
    every parameter is), zeroed in both; None where a difference is anything else."""
    slots: dict = {}
    o, n = 0, len(a)
    while o < n:
        if a[o:o + 4] == b[o:o + 4]:
            o += 4
            continue
        got = None if o + 8 > n else _resolve(int.from_bytes(a[o:o + 8], sys.byteorder),
                                              int.from_bytes(b[o:o + 8], sys.byteorder),
                                              indices)
        if got is None:
            return None
        slots.setdefault(got[0], []).append((o, got[1]))
        a[o:o + 8] = b[o:o + 8] = bytes(8)
        o += 8
    return {i: tuple(s) for i, s in slots.items()}


class _Templates(dict):
    """(id(launch), the entry's addresses function, present): (the launch, kept, and its
    template)."""

    def cache_clear(self) -> None:  # emptied by jit.clear_memory_caches: they hold kernels
        self.clear()


_TEMPLATES = jit.register_launcher_cache(_Templates())


def template(la, present, entry: Entry) -> tuple | None:
    """Per launch of each call of ``la`` (a Launch or an MlaLaunch), where only the
    addresses of ``present`` (indices, and those after the entry's for a per-call scratch)
    change: ``(kernel, grid, threads, smem, packed bytes, slots, maps)``, the packed bytes
    holding the rest, ``slots`` as _address_slots gives them and ``maps`` None or
    ``(byte offset, size, ((index, offset), (index, offset)))``: where the tensor maps of
    the caches at those addresses go. None for any other launch. Kept per launch object:
    the plans of one call made step after step share the memo's."""
    key = (id(la), entry.addresses, present)
    got = _TEMPLATES.get(key)
    if got is None:
        got = (la, _template(la, present, entry))
        if len(_TEMPLATES) >= 256:
            _TEMPLATES.clear()
        _TEMPLATES[key] = got
    return got[1]


def _template(la, present, entry: Entry):
    if not isinstance(la, (launch.Launch, launch.MlaLaunch)):
        return None
    n = len(entry.names)
    indices = (*present, *range(n, n + 4)) if la.scratch_need() else present
    (calls_a, maps_a), (calls_b, maps_b) = (_record(la, present, m, entry) for m in (_A, _B))
    if not calls_a or len(calls_a) != len(calls_b) or len(maps_a.calls) > 1:
        return None
    maps_at = None
    if maps_a.calls:
        maps_at = tuple(_resolve(x, y, indices) for x, y in zip(maps_a.calls[0],
                                                                maps_b.calls[0]))
        if None in maps_at:
            return None
    made, found = [], 0
    for (kernel, *how, args_a), (other, *how_b, args_b) in zip(calls_a, calls_b):
        if (other is not kernel or not isinstance(kernel, jit.Launcher) or how != how_b
                or how[3] != _STREAM):
            return None  # (a kernel that is not a Launcher has no parameter buffer)
        packed_a = bytearray(kernel.packed(kernel.pack(*args_a)))
        packed_b = bytearray(kernel.packed(kernel.pack(*args_b)))
        maps = None
        at = packed_a.find(maps_a.mark) if maps_at else -1
        if at >= 0:
            size = len(maps_a.mark)
            if packed_b[at:at + size] != maps_b.mark:
                return None
            packed_a[at:at + size] = packed_b[at:at + size] = bytes(size)
            maps, found = (at, size, maps_at), found + 1
        # (A marker left twice, or anything else that moved, is a difference no address
        # explains.)
        slots = _address_slots(packed_a, packed_b, indices)
        if slots is None or packed_a != packed_b:
            return None
        made.append((kernel, *how[:3], bytes(packed_a), slots, maps))
    if maps_at and found != 1:
        return None
    return tuple(made)


class _Buffers(threading.local):
    """One fast run's parameter buffers per thread: ``b``, the views the run writes
    (_thread_buffers), made on the thread's first call from the packed templates."""


def _thread_buffers(local, layout) -> tuple:
    """Per launch of ``layout`` (kernel, packed bytes, the byte offsets of addresses not at
    a multiple of 8, whether tensor maps go in): its buffer as 8-byte words, the address
    of the pointer array cuLaunchKernel takes, an 8-byte view at each such offset and,
    with maps, the buffer as bytes."""
    keep, views = [], []
    for kernel, packed, unaligned, maps in layout:
        buf, params = kernel.new_buffer(packed)
        keep.append((buf, params))
        raw = memoryview(buf).cast("B")
        views += [raw.cast("Q"), ctypes.addressof(params)]
        views += [raw[o:o + 8].cast("Q") for o in unaligned]
        if maps:
            views.append(raw)
    local.keep = keep
    local.b = b = tuple(views)
    return b


# ---- the generated run -------------------------------------------------------------------


def _meta_check(var: str, i: int, bound: bool, torch: bool) -> str:
    """The condition that array ``var`` (index ``i``) has the metadata validation passed:
    shape, strides, dtype, device, and the address modulo 16 (a bound table: the address
    itself); a torch tensor's strides in elements, on a CUDA device, and its
    requires_grad as it was (_prepared.metas' fields). Binds ``p{i}``, the address, for
    what follows."""
    if torch:
        addr = f"(p{i} := {var}.data_ptr())"
        where = f"{addr} == bp{i}" if bound else f"{addr} & 15 == a{i}"
        return (f"{var}.shape == s{i} and {var}.stride() == t{i} and {var}.dtype is d{i} "
                f"and {var}.is_cuda and {var}.get_device() == dev "
                f"and {var}.requires_grad is r{i} and {where}")
    where = f"(p{i} := _d.ptr) == bp{i}" if bound else f"(p{i} := _d.ptr) & 15 == a{i}"
    return (f"{var}.shape == s{i} and {var}.strides == t{i} and {var}.dtype is d{i} "
            f"and (_d := {var}.data).device_id == dev and {where}")


def _address(i: int, offset: int) -> str:
    return f"p{i} + {offset}" if offset else f"p{i}"


def _unaligned(slots) -> tuple:
    return tuple(sorted(o for _, places in slots for o, _ in places if o % 8))


def source(kind: str, per_call, bound, pairs, q_out: bool, in_place: bool,
           wants_lse: bool, launches, scratch, gate, torch: bool = False,
           side: bool = False) -> str:
    """The source of ``make(c)``, which returns the fast run of one form of call with the
    constants of ``c`` (a dict) bound. ``kind``: an ENTRIES key ("plan": AttentionPlan.run,
    whose declined calls go to ``slow``; "attention", "mla": the entry points', which
    return MISS); ``per_call``, ``bound``: address indices; ``pairs``: the (i, j) pairs
    checked for overlap (None: a side array's absolute span); ``q_out``: out against the
    query; ``launches``: per launch ``(slots, maps)``, where its addresses go (the
    indices after the entry's: a per-call scratch) and its tensor maps
    (template's); ``scratch``: None, or whether a per-call scratch has merge counters to
    zero; ``gate``: the entry point's keywords as (name, how the remembered value is
    compared); ``torch``: the arrays are torch tensors (exactly torch.Tensor), launched on
    torch's current stream, else CuPy arrays on CuPy's; ``side``: the plan has torch side
    tensors, whose state is compared (_prepared.side_state)."""
    entry = ENTRIES[kind]
    names, miss, n = entry.names, entry.miss, len(entry.names)
    body = []

    def decline_unless(cond, why=None):
        if why:
            body.append(f"# {why}")
        body.append(f"if not ({cond}):")
        body.append(f"    return {miss}")

    def decline_if_any(conds, why=None):
        if why:
            body.append(f"# {why}")
        body.append(f"if ({conds[0]}")
        body.extend(f"        or {c}" for c in conds[1:])
        body[-1] += "):"
        body.append(f"    return {miss}")

    skip = [f"{name} is not None" for name in entry.refused]
    skip += [f"{names[i]} is not None" for i in entry.nullable if i not in per_call]
    for name, how in gate:
        if how == "none":
            skip.append(f"{name} is not None")
        elif how == "is":
            skip.append(f"{name} is not want_{name}")
        elif how == "ref":  # the very workspace (the run does not keep it alive)
            skip.append(f"{name} is None or {name} is not want_{name}()")
        else:  # the same object, or one of the same type and equal (validation's key)
            skip.append(f"({name} is not want_{name} and (type({name}) is not "
                        f"type_{name} or {name} != want_{name}))")
    skip += ["_checks.DEBUG", "_arrays.HOLDS.pending", "_arrays.HOLDS.stamped"]
    decline_if_any(skip, "A stream, scales or arrays of the call's own, other keywords; "
                   "CUPAGED_DEBUG (its checks read the device); a DLPack import of this "
                   "thread's that the launch stream must order and hold (_arrays.context)")
    if entry.pair and entry.pair[1] in per_call:
        first, second = (names[i] for i in entry.pair)
        decline_unless(f"type({first}) is tuple and len({first}) == 2",
                       "The query as the pair of its parts, as the run was made for")
        body.append(f"{first}, {second} = {first}")
    if torch:
        decline_unless(" and ".join(f"type({names[i]}) is _tensor" for i in per_call),
                       "torch tensors only, as the run was made for (a subclass may "
                       "override what is read)")
    else:
        decline_unless(" and ".join(f"type({names[i]}) is _nd" for i in per_call),
                       "CuPy arrays only (a torch tensor has its own stream and metadata)")
    for k, i in enumerate(per_call):
        decline_unless(_meta_check(names[i], i, False, torch),
                       "Each array as validation passed it: shape, strides, dtype, device, "
                       "address modulo 16" if k == 0 else None)
    if torch:
        for k, i in enumerate(bound):
            decline_unless(_meta_check(f"b{i}", i, True, True),
                           "The plan's tables, re-read (set_ and resize_ re-point and "
                           "reshape a tensor in place): as they were, where they were"
                           if k == 0 else None)
    elif bound:
        # A CuPy array's address, dtype and device cannot change, and its strides change
        # only with its shape (the shape setter: equal shapes then give equal strides but
        # on dims of size 1, which no index but 0 reaches), so its shape is what to re-read.
        decline_unless(" and ".join(f"b{i}.shape == s{i}" for i in bound),
                       "The plan's tables, re-read: reshaped in place, they are not read "
                       "as they were")
        body.extend(f"p{i} = bp{i}" for i in bound)
    if side:
        decline_unless("_side_state(side) == side_state",
                       "The plan's torch side tensors (sinks, ALiBi slopes, scale arrays) "
                       "where they were: re-pointed or resized in place, not")
    ptr = {i: f"p{i}" for i in (*per_call, *bound)}
    # Overlaps, as _prepared.clashes: a + lo1 < b + hi2 and b + lo2 < a + hi1 is
    # lo1 - hi2 < b - a < hi1 - lo2 (each pair's two bounds precomputed).
    clash = []
    if q_out:
        clash.append("qlo < p6 - p0 < qhi" + (" and p6 != p0" if in_place else ""))
    for k, (i, j) in enumerate(pairs):
        a = "0" if i is None else ptr[i]
        b = "0" if j is None else ptr[j]
        clash.append(f"lo{k} < {b} - {a} < hi{k}")
    if clash:
        decline_if_any([f"({c})" for c in clash],
                       "out (and lse) over the query or anything else the call reads")
    body.append("# On the arrays' device, current (the generic path would switch to it)")
    decline_unless("_get_device() == dev")
    if torch:
        body.append("st = _torch_stream(dev)  # torch's current stream, as the generic path's")
    else:
        body.append("st = _current_stream(dev).ptr  # CuPy's, as the generic path's")
    if scratch is not None:
        body.append("# A split-KV scratch of this call's own, freed in the stream's order "
                    "after the launches (launch.scratch_partials)")
        body.append(f"p{n}, keep = _arrays.scratch(scratch_ctx, scratch_bytes)")
        if scratch:
            body.append(f"_memset(p{n} + at_counters, 0, counters_bytes, st)  # zeroed")
            body.append(f"p{n + 3} = p{n} + at_counters")
        body.append(f"p{n + 1}, p{n + 2} = p{n} + at_max, p{n} + at_sum")
    views = []
    for k, (slots, maps) in enumerate(launches):
        # (a bound table's address is in the packed bytes: views at the per-call ones only,
        # as build() lays them out)
        per_call_slots = tuple((i, s) for i, s in slots if i not in bound)
        views += [f"w{k}", f"pa{k}", *[f"u{k}_{o}" for o in _unaligned(per_call_slots)]]
        views += [f"y{k}"] if maps else []
    body.append("# This call's addresses into this thread's parameter buffers (packed once)")
    body.append("try:")
    body.append(f"    {', '.join(views)}, = local.b")
    body.append("except AttributeError:  # this thread's first call")
    body.append(f"    {', '.join(views)}, = _thread_buffers(local, layout)")
    for k, (slots, maps) in enumerate(launches):
        for i, places in slots:
            if i in bound:  # (a bound table's address is in the packed bytes)
                continue
            for o, off in places:
                at = f"w{k}[{o // 8}]" if o % 8 == 0 else f"u{k}_{o}[0]"
                body.append(f"{at} = {_address(i, off)}")
        if maps:
            o, size, (lat, rope) = maps
            body.append(f"y{k}[{o}:{o + size}] = maps{k}({_address(*lat)}, {_address(*rope)})"
                        "  # the caches' tensor maps")
        body.append(f"_launch(fptr{k}, gx{k}, gy{k}, gz{k}, threads{k}, 1, 1, smem{k}, st, "
                    f"pa{k}, 0)")
    if scratch is not None:
        body.append("del keep")
    body.append("return (out, lse)" if wants_lse else "return out")

    used = set(re.findall(r"[A-Za-z_]\w*", "\n".join(body)))
    known = set(_CONSTANTS)
    known.update(f"{c}{i}" for c in ("s", "t", "d", "a", "r", "b", "bp") for i in range(n))
    known.update(f"{c}{k}" for c in ("lo", "hi") for k in range(len(pairs)))
    known.update(f"{c}{k}" for c in _PER_LAUNCH for k in range(len(launches)))
    known.update(f"{p}_{name}" for name, _ in gate for p in ("want", "type"))
    consts = sorted(used & known)
    # A constant named as a parameter would be shadowed by it: compared with the wrong
    # value.
    assert not set(consts) & set(re.findall(r"\w+", entry.signature)), consts
    src = [f"# The fast run of one form of {kind} call (cupaged/_fastrun.py, source()).",
           "def make(c):"]
    src += [f"    {name} = c[{name!r}]" for name in consts]
    src.append(f"    def run({entry.signature}):")
    src += [f"        {line}" for line in body]
    src.append("    return run")
    return "\n".join(src) + "\n"


# The constants a run may use besides the per-array ones (s, t, d, a, r, b, bp + index),
# the pairs' bounds (lo, hi + number) and the per-launch ones (_PER_LAUNCH + number).
_CONSTANTS = ("_get_device", "_current_stream", "_torch_stream", "_tensor", "_memset",
              "_launch", "dev", "qlo", "qhi", "slow", "local", "layout", "scratch_ctx",
              "scratch_bytes", "at_max", "at_sum", "at_counters", "counters_bytes", "side",
              "side_state")
_PER_LAUNCH = ("fptr", "gx", "gy", "gz", "threads", "smem", "maps")
_GLOBALS = {"_nd": cupy.ndarray, "_checks": _checks, "_arrays": _arrays, "MISS": MISS,
            "_thread_buffers": _thread_buffers, "_side_state": _prepared.side_state}
_factories: dict = {}


def _factory(form):
    make = _factories.get(form)
    if make is None:
        src = source(*form)
        name = f"<cupaged fast run #{len(_factories)}>"
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # tracebacks
        ns = dict(_GLOBALS)
        exec(compile(src, name, "exec"), ns)
        make = ns["make"]
        make.source = src
        if len(_factories) >= 256:
            _factories.clear()
        _factories[form] = make
    return make


def build(kind, prep, metas, per_call, bound=None, slow=None, gate=(), side=(),
          disjoint=None):
    """A fast run (see the module) for ``prep`` through entry ``kind`` (an ENTRIES key),
    whose calls pass the arrays of ``per_call`` (address indices) with ``metas``
    (_prepared.metas' fields, by index), ``bound``: ``{index: array}`` fixed (a plan's
    tables); or None when its calls cannot have one. ``slow``: a plan's generic run;
    ``gate``: the entry point's keywords as (name, how, value); ``side``: torch side
    tensors whose _prepared.side_state must stay as it is now; ``disjoint``: the pairs
    that must not overlap (_prepared.disjoint_spans' form, by these indices), default
    ``prep.disjoint``."""
    entry = ENTRIES[kind]
    bound = bound or {}
    if metas is None or prep.kind not in ("cupy", "torch") or prep.new_lse or prep.launch is None:
        return None
    torch = prep.kind == "torch"
    if entry.out not in per_call:
        return None  # no out: the call allocates one (the generic path's _arrays.empty)
    for i in (*per_call, *bound):  # (_prepared.metas: five fields, torch's six)
        if metas[i] is None or len(metas[i]) != (6 if torch else 5):
            return None
    la = prep.launch
    launches = template(la, (*per_call, *bound), entry)  # (tuple: a key)
    if launches is None:
        return None
    # (An array whose address no launch takes, such as paged_decode's query starts in its
    # one-token mode, is checked all the same: validation read it.)
    c = {"dev": prep.device, "slow": slow, "local": _Buffers()}
    for i in (*per_call, *bound):
        c[f"s{i}"], c[f"t{i}"], c[f"d{i}"], c[f"a{i}"] = metas[i][:4]
        if torch:
            c[f"r{i}"] = metas[i][5]
    for i, a in bound.items():
        c[f"b{i}"] = a
        c[f"bp{i}"] = a.data_ptr() if torch else a.data.ptr
    layout, form_launches = [], []
    for k, (kernel, grid, threads, smem, packed, slots, maps) in enumerate(launches):
        c[f"fptr{k}"], c[f"threads{k}"], c[f"smem{k}"] = kernel.ptr, threads, smem
        c[f"gx{k}"], c[f"gy{k}"], c[f"gz{k}"] = grid
        buf = bytearray(packed)
        for i in bound:
            for o, off in slots.get(i, ()):
                struct.pack_into("@Q", buf, o, c[f"bp{i}"] + off)
        per_call_slots = tuple(sorted((i, s) for i, s in slots.items() if i not in bound))
        layout.append((kernel, bytes(buf), _unaligned(per_call_slots), maps is not None))
        if maps is not None:
            c[f"maps{k}"] = la.tma  # (the launch's MlaTmaMaps: the generic path's maps)
        form_launches.append((tuple(sorted(slots.items())), maps))
    c["layout"] = tuple(layout)
    if prep.q_span:
        c["qlo"], c["qhi"] = prep.q_span[0] - prep.out_bytes, prep.q_span[1]
    pairs = []
    for i, lo1, hi1, j, lo2, hi2 in prep.disjoint if disjoint is None else disjoint:
        if i in per_call or j in per_call:  # (two fixed addresses: checked once)
            c[f"lo{len(pairs)}"], c[f"hi{len(pairs)}"] = lo1 - hi2, hi1 - lo2
            pairs.append((i, j))
    need = la.scratch_need()
    scratch = None
    if need is not None:  # launch.scratch_partials' allocation, as the launch's run asks
        rows, width, counters = need
        nbytes, c["at_max"], c["at_sum"], c["at_counters"] = launch.scratch_layout(
            rows, width, counters)
        c["scratch_ctx"] = _arrays.Context(prep.device, 0, prep.kind, False)
        c["scratch_bytes"], c["counters_bytes"] = nbytes, counters * 4
        scratch = bool(counters)
    for name, how, value in gate:
        c[f"want_{name}"], c[f"type_{name}"] = value, type(value)
    c["side"], c["side_state"] = tuple(side), _prepared.side_state(side)
    form = (kind, tuple(per_call), tuple(bound), tuple(pairs), bool(prep.q_span),
            prep.in_place, prep.wants_lse, tuple(form_launches), scratch,
            tuple([(name, how) for name, how, _ in gate]), torch, bool(side))
    # The runtime's and the driver's entry points, looked up once per run.
    c["_get_device"], c["_current_stream"] = runtime.getDevice, cupy.cuda.get_current_stream
    c["_memset"], c["_launch"] = runtime.memsetAsync, jit.driver.launchKernel
    if torch:
        c["_tensor"], c["_torch_stream"] = (_arrays.torch_tensor_type(),
                                            _arrays.torch_stream_getter())
        TYPES.add(c["_tensor"])
    return _factory(form)(c)


def plan_runner(prep, metas, shared, slow, doc=None, side=()):
    """The fast run of an AttentionPlan (``prep``: its prepared call; ``metas``: its
    examples' metadata in _prepared.run's order; ``shared``: its block_tables, seq_lens
    and query_start_loc, bound; ``slow``: its generic run, which takes every call the
    fast run declines; ``side``: its torch side tensors, _prepared.side_tensors, whose
    side_state each run compares), or None when its calls cannot have one."""
    if metas is None:
        return None
    per_call = [0, 1, 2, 6] + ([7] if metas[7] is not None else [])
    bound = {3 + n: a for n, a in enumerate(shared) if a is not None}
    run = build("plan", prep, metas, per_call, bound, slow, side=side)
    if run is not None:
        run.__doc__ = doc
    return run


# Keywords compared by type and value (the memo keys them so: _prepared.key)
_EQ_TYPES = frozenset({SoftCap, *[t for t in _prepared.SCALAR_TYPES
                                  if t not in (type(None), bool, tuple)]})


def _gate(names, values):
    """An entry point's keywords as build's gate, or None when one is of a kind a run does
    not compare (an array: keyed by its metadata and address)."""
    gate = []
    for name, v in zip(names, values):
        if v is None:
            gate.append((name, "none", None))
        elif isinstance(v, launch.DecodeWorkspace):
            gate.append((name, "ref", weakref.ref(v)))
        elif v is True or v is False:
            gate.append((name, "is", v))
        elif type(v) in _EQ_TYPES:
            gate.append((name, "eq", v))
        else:
            return None
    return gate


def _with_refs(run, gate):
    if run is not None:
        # The workspaces it stands for, by weak reference: once one is gone the run
        # declines every call, and _prepared.use_fast makes it anew (a workspace made
        # again at a freed one's address is the same call).
        run.refs = tuple(v for _, how, v in gate if how == "ref")
    return run


def call_runner(prep, metas, *values):
    """The fast run of a remembered attention call (``values``: its arguments other than
    the arrays, in KEYWORDS' order, which each call's must match: the same objects, or
    of the same type and equal), or None. A side array (ALiBi slopes, sinks, a scale
    array) is not taken: the generic path keys it by its metadata and address."""
    assert len(values) == len(KEYWORDS)
    gate = None if metas is None else _gate(KEYWORDS, values)
    if gate is None:
        return None
    per_call = [i for i in range(8) if metas[i] is not None]
    return _with_refs(build("attention", prep, metas, per_call, gate=gate), gate)


def mla_runner(prep, metas, *values):
    """The fast run of a remembered mla_attention call (``metas``: its key's, in
    validate_and_prepare's order of addresses; ``values``: its other arguments in
    MLA_KEYWORDS' order), or None. A device k_scale comes per call, as an array (the
    memo keys it by its address, so each layer of a model has its own prepared call,
    and one run serves them all): its metadata checked, its address written where the
    launch reads the scale and checked apart from out and lse."""
    assert len(values) == len(MLA_KEYWORDS)
    if metas is None:
        return None
    metas = [*metas, None]
    disjoint = prep.disjoint
    keywords = dict(zip(MLA_KEYWORDS, values))
    k_scale = keywords["k_scale"]
    if k_scale is not None and type(k_scale) not in _EQ_TYPES:
        m, ptrs = _prepared.metas((k_scale,))  # (of the query's framework: build's check)
        if m is None:
            return None
        metas[_MLA_SCALE] = m[0]
        del keywords["k_scale"]
        # validate_and_prepare's spans of it are absolute (the memo keys it whole, and it
        # is the only array so kept), the run's relative to its address
        at = ptrs[0]
        disjoint = tuple((i if i is not None else _MLA_SCALE, lo1 - (i is None) * at,
                          hi1 - (i is None) * at, j if j is not None else _MLA_SCALE,
                          lo2 - (j is None) * at, hi2 - (j is None) * at)
                         for i, lo1, hi1, j, lo2, hi2 in disjoint)
    gate = _gate(tuple(keywords), tuple(keywords.values()))
    if gate is None:
        return None
    per_call = [i for i in range(len(metas)) if metas[i] is not None]
    return _with_refs(build("mla", prep, metas, per_call, gate=gate, disjoint=disjoint),
                      gate)
