"""The fast run: a prepared attention call's repeat as one straight-line function, for
``AttentionPlan.run`` and for ``attention``'s remembered call, with every check of the
generic path (``_prepared.run`` after the key or the plan's comparison) kept.

A fast run stands only for calls the generic path would launch the same way, byte for
byte (tests/test_fastrun.py compares the two with the driver stubbed). Per call it:

  - takes nothing but the arrays of its kind, CuPy arrays or torch tensors (exactly
    torch.Tensor: CUDA, requires_grad as validation saw it), no ``stream=`` (CuPy's or
    torch's current stream, as the generic path), no scales of the call's own, and for
    ``attention`` the remembered call's keywords (the same objects, or of the same type
    and equal);
  - checks each per-call array's shape, strides, dtype, device and address modulo 16
    against the ones validation passed, one by one against constants;
  - for a plan, re-reads its bound tables' shape (a CuPy array's address, dtype and
    device are fixed, its strides change only with its shape) or, for torch tensors,
    everything (set_ and resize_ re-point and reshape one in place): a table changed in
    place must not be read where it was;
  - checks ``out`` against the query (in place or apart) and ``out`` and ``lse`` against
    every array the call reads, at this call's addresses (``_prepared.clashes``; a pair
    of two fixed addresses was checked when the plan was made);
  - runs only on the arrays' device being current, with ``CUPAGED_DEBUG`` off and no
    DLPack import of this thread waiting to be ordered and held;
then writes the call's addresses into a parameter buffer packed once per thread and
calls ``cuLaunchKernel``. Any other call goes to the generic path, unchanged: a plan's
``run`` method, or for ``attention`` the memo (``MISS``; attention tries the fast runs
of its last few remembered calls of the query's shape, ``_prepared.fast_attention``).

A run exists only for a call of one launch whose arguments are its arrays' addresses and
constants (Launch.run's, recorded with stand-in addresses): ``out`` given, no new lse,
CuPy arrays or torch tensors, no second (combine) launch, and for ``attention`` no side
arrays (ALiBi slopes, sinks, scale arrays); a split-KV scratch of the call's own is
allocated and its counters zeroed per call as Launch.run does (its rows and counters the
Launch's: the grid split's, or the flat split's two slots a CTA and one counter a
(sequence, head tile)).

The code is generated per *form* of call (which arrays are per call, which are bound,
which pairs are checked, where the addresses go) and compiled once; a plan or a
remembered call binds its constants into a closure.
"""

from __future__ import annotations

import ctypes
import linecache
import re
import threading
import weakref

import cupy
from cupy_backends.cuda.api import runtime

from . import _arrays, _checks, _prepared, jit, launch
from ._variants import SoftCap

# Address indices, in _prepared.run's order; 8-11 are a per-call scratch's partials
# (part_out, part_max, part_sum, counters).
_NAMES = ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
          "query_start_loc", "out", "lse")
MISS = object()  # returned by a remembered attention call's fast run that declined
# The array types runs take: CuPy's, and torch.Tensor once a torch run has been built
# (attention() tries runs only for a query of one of these types).
TYPES = {cupy.ndarray}

# Stand-in addresses for recording Launch.run's arguments: two sets whose spacings differ,
# so an address the launch passed through unchanged is told from one it moved.
_STREAM = 0x5EED_0000
_A = tuple(0x1000_0000_0000 + i * 0x1_0000_0000 for i in range(12))
_B = tuple(0x2000_0000_0000 + i * 0x3_0000_0010 for i in range(12))


class _Recorder:
    """Stands for a Launch's kernels: records each launch instead of making it."""

    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, smem, stream, *args):
        self.calls.append((grid, block, smem, stream, args))


def _record(la: launch.Launch, present, marks, scratch: bool):
    """Launch.run's launches with the addresses ``marks`` (0 for indices not ``present``),
    through recorders; a scratch's partials at marks 8-11."""
    rec = _Recorder()
    parts = la.partials
    if scratch:
        parts = launch.Partials(marks[8], marks[9], marks[10], la.scratch_rows, marks[11],
                                la.counters)
    # (NamedTuple's _replace, its public copy-with-changes)
    stand_in = la._replace(kernel=rec, combine=None if la.combine is None else rec,
                           partials=parts)
    a = [marks[i] if i in present else 0 for i in range(8)]
    stand_in.run(_arrays.Context(0, _STREAM, "cupy", False), a[6], *a[:6], a[7])
    return rec.calls


class _Templates(dict):
    """(id(launch), present): (the launch, kept, and its template)."""

    def cache_clear(self) -> None:  # emptied by jit.clear_memory_caches: they hold kernels
        self.clear()


_TEMPLATES = jit.register_launcher_cache(_Templates())


def template(la, present) -> tuple | None:
    """``(kernel, grid, threads, smem, packed bytes, {address index: word slots})`` of a
    Launch whose every call is one launch of ``la.kernel`` where only the addresses of
    ``present`` (indices, and 8-11 for a per-call scratch) change: the packed bytes hold
    the rest, and each index's address goes in its slots (the buffer as 8-byte words).
    None for any other launch. Kept per launch object: the plans of one call made step
    after step share the memo's."""
    got = _TEMPLATES.get((id(la), present))
    if got is None:
        got = (la, _template(la, present))
        if len(_TEMPLATES) >= 256:
            _TEMPLATES.clear()
        _TEMPLATES[id(la), present] = got
    return got[1]


def _template(la, present):
    if not isinstance(la, launch.Launch):
        return None
    scratch = la.split and la.partials is None
    if scratch:
        present = (*present, 8, 9, 10, 11)
    got = [_record(la, present, marks, scratch) for marks in (_A, _B)]
    if len(got[0]) != 1 or len(got[1]) != 1:
        return None  # a second launch (a combine kernel) per call
    (grid, threads, smem, stream, args_a), (*same, args_b) = got[0][0], got[1][0]
    if same != [grid, threads, smem, stream] or stream != _STREAM:
        return None
    kernel = la.kernel
    packed_a = bytearray(kernel.packed(kernel.pack(*args_a)))
    packed_b = bytearray(kernel.packed(kernel.pack(*args_b)))
    words_a = memoryview(packed_a).cast("Q")
    words_b = memoryview(packed_b).cast("Q")
    slots: dict = {}
    for w in range(len(words_a)):
        if words_a[w] == words_b[w]:
            continue
        # Words that differ between the two records must hold one array's address, as
        # passed: anything else (an address moved, or cut across words) is not this form.
        index = [i for i in present if _A[i] == words_a[w] and _B[i] == words_b[w]]
        if len(index) != 1:
            return None
        slots.setdefault(index[0], []).append(w)
        words_a[w] = words_b[w] = 0
    if packed_a != packed_b:
        return None
    if scratch and any(i not in slots for i in (8, 9, 10, 11)):
        return None
    return (kernel, grid, threads, smem, bytes(packed_a),
            {i: tuple(w) for i, w in slots.items()})


class _Buffers(threading.local):
    """One fast run's parameter buffer per thread: ``b`` = (the buffer as 8-byte words,
    the address of the pointer array cuLaunchKernel takes), made on the thread's first
    call from the packed template."""


def _thread_buffer(local, kernel, packed: bytes):
    buf, params = kernel.new_buffer(packed)
    local.keep = (buf, params)
    local.b = b = (memoryview(buf).cast("B").cast("Q"), ctypes.addressof(params))
    return b


# ---- the generated run -----------------------------------------------------------------------

_PLAN_SIGNATURE = ("query, key_cache, value_cache, *, out=None, lse=None, stream=None, "
                   "k_scale=None, v_scale=None")
_PLAN_FALLBACK = ("slow(query, key_cache, value_cache, out=out, lse=lse, stream=stream, "
                  "k_scale=k_scale, v_scale=v_scale)")
# attention's own parameters, in the order attention() passes them to its fast run
ATTENTION_SIGNATURE = ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
                       "query_start_loc", "kv_layout", "causal", "scale", "alibi_slopes",
                       "max_query_len", "max_seq_len", "out", "stream", "workspace",
                       "kv_cache_dtype", "k_scale", "v_scale", "window", "window_left",
                       "logits_soft_cap", "sinks", "return_lse", "lse")
KEYWORDS = ("kv_layout", "causal", "scale", "alibi_slopes", "max_query_len", "max_seq_len",
             "workspace", "kv_cache_dtype", "k_scale", "v_scale", "window", "window_left",
             "logits_soft_cap", "sinks", "return_lse")


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


def source(kind: str, per_call, bound, pairs, q_out: bool, in_place: bool,
           wants_lse: bool, slots, gate, torch: bool = False, side: bool = False) -> str:
    """The source of ``make(c)``, which returns the fast run of one form of call with the
    constants of ``c`` (a dict) bound. ``kind``: "plan" (AttentionPlan.run's signature;
    a declined call goes to ``slow``) or "attention" (ATTENTION_SIGNATURE; returns MISS);
    ``per_call``, ``bound``: address indices; ``pairs``: the (i, j) pairs checked for
    overlap (None: a side array's absolute span); ``q_out``: out against the query;
    ``slots``: the address indices the launch takes, scratch's 8-11 included; ``gate``:
    attention's keywords as (name, how the remembered value is compared); ``torch``:
    the arrays are torch tensors (exactly torch.Tensor), launched on torch's current
    stream, else CuPy arrays on CuPy's; ``side``: the plan has torch side tensors, whose
    state is compared (_prepared.side_state)."""
    miss = _PLAN_FALLBACK if kind == "plan" else "MISS"
    slots = dict(slots)
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

    skip = []
    if kind == "plan":
        skip = ["stream is not None", "k_scale is not None", "v_scale is not None"]
        if 7 not in per_call:
            skip.append("lse is not None")
    else:
        skip = [f"{_NAMES[i]} is not None" for i in range(8) if i not in per_call]
        skip.append("stream is not None")
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
    if torch:
        decline_unless(" and ".join(f"type({_NAMES[i]}) is _tensor" for i in per_call),
                       "torch tensors only, as the run was made for (a subclass may "
                       "override what is read)")
    else:
        decline_unless(" and ".join(f"type({_NAMES[i]}) is _nd" for i in per_call),
                       "CuPy arrays only (a torch tensor has its own stream and metadata)")
    for n, i in enumerate(per_call):
        decline_unless(_meta_check(_NAMES[i], i, False, torch),
                       "Each array as validation passed it: shape, strides, dtype, device, "
                       "address modulo 16" if n == 0 else None)
    if torch:
        for n, i in enumerate(bound):
            decline_unless(_meta_check(f"b{i}", i, True, True),
                           "The plan's tables, re-read (set_ and resize_ re-point and "
                           "reshape a tensor in place): as they were, where they were"
                           if n == 0 else None)
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
    for n, (i, j) in enumerate(pairs):
        a = "0" if i is None else ptr[i]
        b = "0" if j is None else ptr[j]
        clash.append(f"lo{n} < {b} - {a} < hi{n}")
    if clash:
        decline_if_any([f"({c})" for c in clash],
                       "out (and lse) over the query or anything else the call reads")
    body.append("# On the arrays' device, current (the generic path would switch to it)")
    decline_unless("_get_device() == dev")
    if torch:
        body.append("st = _torch_stream(dev)  # torch's current stream, as the generic path's")
    else:
        body.append("st = _current_stream(dev).ptr  # CuPy's, as the generic path's")
    if 8 in slots:
        body.append("# A split-KV scratch of this call's own, freed in the stream's order "
                    "after the launch; its counters zeroed (launch.scratch_partials)")
        body.append("p8, keep = _arrays.scratch(scratch_ctx, scratch_bytes)")
        body.append("_memset(p8 + at_counters, 0, counters_bytes, st)")
        body.append("p9, p10, p11 = p8 + at_max, p8 + at_sum, p8 + at_counters")
    body.append("# This call's addresses into this thread's parameter buffer (packed once)")
    body.append("try:")
    body.append("    words, params = local.b")
    body.append("except AttributeError:  # this thread's first call")
    body.append("    words, params = _thread_buffer(local, kernel, packed)")
    for i in sorted(slots):
        if i not in bound:  # (a bound table's address is in the packed bytes)
            body += [f"words[{w}] = p{i}" for w in slots[i]]
    body.append("_launch(fptr, gx, gy, gz, threads, 1, 1, smem, st, params, 0)")
    if 8 in slots:
        body.append("del keep")
    body.append("return (out, lse)" if wants_lse else "return out")

    used = set(re.findall(r"[A-Za-z_]\w*", "\n".join(body)))
    consts = sorted(used & set(_CONSTANTS + tuple(
        f"{c}{i}" for c in ("s", "t", "d", "a", "r", "b", "bp", "lo", "hi") for i in range(12))
        + tuple(f"{p}_{name}" for name, _ in gate for p in ("want", "type"))))
    signature = (_PLAN_SIGNATURE if kind == "plan" else ", ".join(ATTENTION_SIGNATURE))
    # A constant named as a parameter would be shadowed by it: compared with the wrong
    # value.
    assert not set(consts) & set(re.findall(r"\w+", signature)), consts
    src = [f"# The fast run of one form of {kind} call (cupaged/_fastrun.py, source()).",
           "def make(c):"]
    src += [f"    {name} = c[{name!r}]" for name in consts]
    src.append(f"    def run({signature}):")
    src += [f"        {line}" for line in body]
    src.append("    return run")
    return "\n".join(src) + "\n"


# The constants a run may use besides the per-array ones (s, t, d, a, r, b, bp + index) and
# the pairs' bounds (lo, hi + number).
_CONSTANTS = ("_get_device", "_current_stream", "_torch_stream", "_tensor", "_memset",
              "_launch", "dev", "qlo", "qhi", "slow", "local", "kernel", "packed", "fptr",
              "gx", "gy", "gz", "threads", "smem", "scratch_ctx", "scratch_bytes", "at_max",
              "at_sum", "at_counters", "counters_bytes", "side", "side_state")
_GLOBALS = {"_nd": cupy.ndarray, "_checks": _checks, "_arrays": _arrays, "MISS": MISS,
            "_thread_buffer": _thread_buffer, "_side_state": _prepared.side_state}
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


def build(kind, prep, metas, per_call, bound=None, slow=None, gate=(), side=()):
    """A fast run (see the module) for ``prep``, whose calls pass the arrays of
    ``per_call`` (address indices) with ``metas`` (_prepared.metas' order), ``bound``:
    ``{index: array}`` fixed (a plan's tables); or None when its calls cannot have one.
    ``slow``: a plan's generic run; ``gate``: attention's keywords as (name, how, value);
    ``side``: torch side tensors whose _prepared.side_state must stay as it is now."""
    bound = bound or {}
    if metas is None or prep.kind not in ("cupy", "torch") or prep.new_lse or prep.launch is None:
        return None
    torch = prep.kind == "torch"
    if 6 not in per_call:
        return None  # no out: the call allocates one (the generic path's _arrays.empty)
    for i in (*per_call, *bound):  # (_prepared.metas: five fields, torch's six)
        if metas[i] is None or len(metas[i]) != (6 if torch else 5):
            return None
    got = template(prep.launch, (*per_call, *bound))  # (tuple: a key)
    if got is None:
        return None
    kernel, grid, threads, smem, packed, slots = got
    la = prep.launch
    for i in per_call:
        if i not in slots and not (i == 5 and not la.takes_starts):
            return None
    c = {"dev": prep.device, "slow": slow, "local": _Buffers(), "kernel": kernel,
         "fptr": kernel.ptr, "threads": threads, "smem": smem}
    c["gx"], c["gy"], c["gz"] = grid
    for i in (*per_call, *bound):
        c[f"s{i}"], c[f"t{i}"], c[f"d{i}"], c[f"a{i}"] = metas[i][:4]
        if torch:
            c[f"r{i}"] = metas[i][5]
    words = memoryview(bytearray(packed)).cast("Q")
    for i, a in bound.items():
        c[f"b{i}"] = a
        c[f"bp{i}"] = ptr = a.data_ptr() if torch else a.data.ptr
        for w in slots.get(i, ()):
            words[w] = ptr
    c["packed"] = words.cast("B").tobytes()
    if prep.q_span:
        c["qlo"], c["qhi"] = prep.q_span[0] - prep.out_bytes, prep.q_span[1]
    pairs = []
    for i, lo1, hi1, j, lo2, hi2 in prep.disjoint:
        if i in per_call or j in per_call:  # (two fixed addresses: checked once)
            c[f"lo{len(pairs)}"], c[f"hi{len(pairs)}"] = lo1 - hi2, hi1 - lo2
            pairs.append((i, j))
    if 8 in slots:  # launch.scratch_partials' allocation, as Launch.run asks for it
        counters = la.counters
        nbytes, c["at_max"], c["at_sum"], c["at_counters"] = launch.scratch_layout(
            la.scratch_rows, la.head_size, counters)
        c["scratch_ctx"] = _arrays.Context(prep.device, 0, prep.kind, False)
        c["scratch_bytes"], c["counters_bytes"] = nbytes, counters * 4
    for name, how, value in gate:
        c[f"want_{name}"], c[f"type_{name}"] = value, type(value)
    c["side"], c["side_state"] = tuple(side), _prepared.side_state(side)
    form = (kind, tuple(per_call), tuple(bound), tuple(pairs), bool(prep.q_span),
            prep.in_place, prep.wants_lse, tuple(sorted(slots.items())),
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


def call_runner(prep, metas, *values):
    """The fast run of a remembered attention call (``values``: its arguments other than
    the arrays, in KEYWORDS' order, which each call's must match: the same objects, or
    of the same type and equal), or None. A side array (ALiBi slopes, sinks, a scale
    array) is not taken: the generic path keys it by its metadata and address."""
    if metas is None:
        return None
    assert len(values) == len(KEYWORDS)
    gate = []
    for name, v in zip(KEYWORDS, values):
        if v is None:
            gate.append((name, "none", None))
        elif isinstance(v, launch.DecodeWorkspace):
            gate.append((name, "ref", weakref.ref(v)))
        elif v is True or v is False:
            gate.append((name, "is", v))
        elif type(v) in (int, float, str, SoftCap):
            gate.append((name, "eq", v))
        else:
            return None
    per_call = [i for i in range(8) if metas[i] is not None]
    run = build("attention", prep, metas, per_call, {}, gate=gate)
    if run is not None:
        # The workspaces it stands for, by weak reference: once one is gone the run
        # declines every call, and _prepared.use_fast makes it anew (a workspace made
        # again at a freed one's address is the same call).
        run.refs = tuple(v for _, how, v in gate if how == "ref")
    return run
