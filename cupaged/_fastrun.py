"""A prepared call's repeat as one straight-line function: what ``AttentionPlan.run`` and
a remembered ``attention`` call do on every call, every check kept, without the generic
path's lists, tuples, context managers and per-launch argument packing.

Per call it still:
  - checks each per-call array is a ``cupy.ndarray`` whose shape, strides, dtype,
    16-byte alignment and device are those validation passed (the memo's ``metas``),
    compared field by field against constants (no tuple of tuples is built);
  - for a plan, re-reads the bound tables' metadata and address (a table changed in
    place must not be read where it was: CuPy's private ``_init`` can re-point an
    array in place, as torch's ``set_`` can);
  - checks out (and lse) against the query (in place or apart) and against every array
    the call reads, at this call's addresses (``_prepared.clashes``; pairs whose two
    addresses are both fixed are left out: validation checked them once);
  - runs on the current device only, on CuPy's current stream for it, with no pending
    DLPack imports and CUPAGED_DEBUG off;
then patches the per-call addresses into a parameter buffer packed once (per thread)
and calls ``cuLaunchKernel``. Anything else (torch tensors, another stream, a scale, a
mismatch of any kind) goes to the generic path: the fast path only ever stands for a
call the generic path would have launched the same way (tools/host_cpu_verify.py
compares their launches byte for byte).

The code is generated per *form* of call (which arrays are per call, which pairs are
checked, which steps are on) and compiled once; each plan or remembered call binds its
constants into a closure (no compile per plan).
"""

from __future__ import annotations

import ctypes
import struct
import threading
import weakref

import cupy
from cupy_backends.cuda.api import runtime as _runtime

from . import _arrays, _checks, jit
from .jit import _ARG_TOKEN

# Which optimizations to generate (each measured by tools/host_cpu_steps.py). Those on
# keep every check exactly; the three off are options that trade one (see each).
STEPS = {
    "fused_metas": True,  # compare fields against constants, no metas tuples
    "folded_clashes": True,  # overlap pairs as one difference each, constants folded
    "inline_run": True,  # no launching()/context(): device, holds, stream inline
    "prepacked": True,  # parameter buffer packed once, addresses patched
    # split-KV without a workspace: the scratch allocated and its counters zeroed per
    # call as Launch.run does (_arrays.scratch, memsetAsync on the launch stream)
    "scratch": True,
    # Options. C-contiguous arrays (no dimension of 0 or 1): shape and CuPy's own
    # _c_contiguous flag instead of the strides (the same test while the flag is right,
    # which only CuPy's private _set_shape_and_strides(update_c_contiguity=False) breaks).
    "contig_strides": False,
    # A plan's bound CuPy tables: shape and strides only (data and dtype are read-only
    # attributes; only the private _init re-points an array in place).
    "bound_shape_only": False,
    "trust_bound": False,  # a plan's bound CuPy tables: not re-read at all
}

_NAMES = ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
          "query_start_loc", "out", "lse")
MISS = object()  # a remembered attention call's fast run declined: take the generic path
_HAS_CONTIG = hasattr(cupy.ndarray, "_c_contiguous")
_factories: dict = {}


class _Buffers(threading.local):
    """Per thread: ``b`` = (a uint64 view of the packed parameters, the address of the
    array of parameter pointers), made from the template on the thread's first launch."""


_TEMPLATES: dict = {}


def launch_template(la, absent):
    """``(launcher, grid, threads, smem, packed bytes, {address index: uint64 slot})``
    of a launch.Launch that is one kernel launch whose only per-call arguments are
    addresses (``absent``: the address indices packed as 0, arrays the calls do not
    have); None when a call needs more (a second launch). Cached by the launch's value
    (plans made step after step have equal launches)."""
    try:
        return _TEMPLATES[la, absent]
    except KeyError:
        pass
    except TypeError:  # an unhashable launch (a sinks array in its variants)
        return _launch_template(la, absent)
    got = _launch_template(la, absent)
    if len(_TEMPLATES) >= 256:
        _TEMPLATES.clear()
    _TEMPLATES[la, absent] = got
    return got


def _launch_template(la, absent):
    if la is None or type(la).__name__ != "Launch":
        return None
    scratch = la.split and la.partials is None
    if la.split and la.combine is not None or scratch and not STEPS["scratch"]:
        return None
    # Address indices: run()'s 8, then a scratch's partials and counters (8-11).
    ph = [0 if i in absent else (1 << 62) + (i << 4) for i in range(12)]
    free = {ph[i]: i for i in range(12) if i not in absent and (i < 8 or scratch)}
    starts = ph[5] if la.takes_starts else 0
    if scratch:
        head = tuple(ph[8:12])
    elif la.split:
        p = la.partials
        head = (p.part_out, p.part_max, p.part_sum, p.counters)
    else:
        head = (0, 0, 0, *la.head)
    args = (ph[6], *head, ph[0], *la.q_strides, ph[1], ph[2], *la.kv_strides, ph[3],
            *la.kv_tail, ph[4], starts, *la.tail, la.vp)
    k = la.kernel
    fmt = k._fmt
    tokens, offsets = _layout(fmt)
    if len(tokens) != len(args):
        return None
    slots = {}
    for tok, off, a in zip(tokens, offsets, args):
        if type(a) is int and a in free:
            if tok != "P" or free[a] in slots or off % 8:
                return None  # (an address twice, or not a pointer: not this layout)
            slots[free[a]] = off // 8
    # The lse address is VariantParams' second pointer (the last parameter).
    if tokens[-1] == "56s" and offsets[-1] % 8 == 0 and 7 not in absent:
        slots[7] = offsets[-1] // 8 + 1
    if scratch and not all(i in slots for i in range(8, 12)):
        return None
    buf = bytearray(k._size + (-k._size % 8))
    struct.pack_into(fmt, buf, 0, *[0 if (type(a) is int and a in free) else a for a in args])
    return k, la.grid, la.threads, la.smem, bytes(buf), slots


_LAYOUTS: dict = {}


def _layout(fmt: str):
    """A flat struct format's fields and the byte offset of each (native alignment)."""
    got = _LAYOUTS.get(fmt)
    if got is None:
        tokens = _ARG_TOKEN.findall(fmt[1:])
        offsets = [struct.calcsize("@" + "".join(tokens[:n + 1])) - struct.calcsize("@" + t)
                   for n, t in enumerate(tokens)]
        got = _LAYOUTS[fmt] = (tokens, offsets)
    return got


def _new_buffers(local, template: bytes, kernel, fixed=()):
    """This thread's parameter buffer: the template, with ``fixed`` ((slot, address) of
    a plan's bound tables) patched in once."""
    buf = ctypes.create_string_buffer(template, len(template))
    base = ctypes.addressof(buf)
    params = (ctypes.c_void_p * len(kernel._offsets))(*(base + o for o in kernel._offsets))
    mv = memoryview(buf).cast("B").cast("Q")  # (the view keeps buf alive)
    for slot, address in fixed:
        mv[slot] = address
    local.keep = params
    local.b = b = (mv, ctypes.addressof(params))
    return b


def _c_strides(shape, itemsize):
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _contig_ok(meta) -> bool:
    """Does ``shape == s and _c_contiguous`` imply ``strides == t`` for arrays of this
    validated metadata (C-contiguous, no dimension of 0 or 1)?"""
    shape, strides, dtype = meta[0], meta[1], meta[2]
    return (_HAS_CONTIG and 0 not in shape and 1 not in shape
            and strides == _c_strides(shape, dtype.itemsize))


def _meta_check(var, i, meta, steps, fixed_ptr=False):
    cond = [f"{var}.shape == s{i}"]
    if steps["contig_strides"] and _contig_ok(meta):
        cond.append(f"{var}._c_contiguous")
    else:
        cond.append(f"{var}.strides == t{i}")
    if fixed_ptr and steps["bound_shape_only"]:
        return " and ".join(cond)
    cond += [f"{var}.dtype is d{i}", f"(_d := {var}.data).device_id == dev"]
    cond.append(f"_d.ptr == bp{i}" if fixed_ptr else f"(p{i} := _d.ptr) & 15 == a{i}")
    return " and ".join(cond)


def form(kind, metas, per_call, bound, pairs, prep, steps, slots, gate_spec=()):
    """The source of a factory ``make(c)`` returning the fast run of one form of call:
    ``kind`` "plan" (AttentionPlan.run's signature, falling back to ``slow``) or
    "attention" (the arrays, in _prepared.run's order; MISS to fall back)."""
    if kind == "plan":
        head = ("def run(query, key_cache, value_cache, *, out=None, lse=None, stream=None, "
                "k_scale=None, v_scale=None):")
        miss = ("return slow(query, key_cache, value_cache, out=out, lse=lse, stream=stream, "
                "k_scale=k_scale, v_scale=v_scale)")
    else:
        head = ("def run(query, key_cache, value_cache, block_tables, seq_lens, "
                "query_start_loc, kv_layout, causal, scale, alibi_slopes, max_query_len, "
                "max_seq_len, out, stream, workspace, kv_cache_dtype, k_scale, v_scale, window, "
                "window_left, logits_soft_cap, sinks, return_lse, lse):")
        miss = "return MISS"
    b = []

    def fail_unless(cond):
        b.append(f"if not ({cond}):")
        b.append(f"    {miss}")

    gate = ["_checks.DEBUG"]
    if kind == "plan":
        gate = ["stream is not None", "k_scale is not None", "v_scale is not None"] + gate
        if 7 not in per_call:
            gate.append("lse is not None")
    else:
        gate += [f"{_NAMES[i]} is not None" for i in range(8)
                 if i not in per_call and i not in bound]
        gate.append("stream is not None")
        for name, cat in gate_spec:  # the remembered call's keywords, types included
            if cat == "none":
                gate.append(f"{name} is not None")
            elif cat == "ref":
                gate.append(f"{name} is None or {name} is not v_{name}()")
            elif cat == "is":
                gate.append(f"{name} is not v_{name}")
            else:
                gate.append(f"({name} is not v_{name} and (type({name}) is not T_{name} "
                            f"or {name} != v_{name}))")
    if steps["inline_run"]:
        gate += ["_HOLDS.pending", "_HOLDS.stamped"]
    b.append(f"if {' or '.join(gate)}:")
    b.append(f"    {miss}")
    ptr = {i: (f"p{i}" if i in per_call else f"bp{i}" if i in bound else "0")
           for i in range(8)}
    if steps["fused_metas"]:
        fail_unless(" and ".join(f"type({_NAMES[i]}) is _nd" for i in per_call))
        for i in per_call:
            fail_unless(_meta_check(_NAMES[i], i, metas[i], steps))
        if not steps["trust_bound"]:
            for i in bound:
                fail_unless(_meta_check(f"b{i}", i, metas[i], steps, fixed_ptr=True))
    else:
        arrs = ", ".join(_NAMES[i] if i in per_call else f"b{i}" if i in bound else "None"
                         for i in range(8))
        b.append(f"m, ptrs = metas(({arrs}))")
        cond = "m is None or m != plan_metas"
        if bound:
            cond += " or " + " or ".join(f"ptrs[{i}] != bp{i}" for i in bound)
        b.append(f"if {cond}:")
        b.append(f"    {miss}")
        b += [f"p{i} = ptrs[{i}]" for i in per_call]
    if steps["folded_clashes"]:
        # a + lo1 < b + hi2 and b + lo2 < a + hi1  <=>  lo1 - hi2 < b - a < hi1 - lo2
        conds = []
        if prep.q_span and 6 in per_call:
            same = " and p6 != p0" if prep.in_place else ""
            conds.append(f"(qlo < p6 - p0 < qhi{same})")
        for n, (i, j) in enumerate(pairs):
            a = "0" if i is None else ptr[i]
            bb = "0" if j is None else ptr[j]
            conds.append(f"(lo{n} < {bb} - {a} < hi{n})")
        if conds:
            b.append(f"if {' or '.join(conds)}:")
            b.append(f"    {miss}")
    else:
        b.append(f"ptrs = [{', '.join(ptr[i] for i in range(8))}]")
        b.append("if clashes(prep, ptrs):")
        b.append(f"    {miss}")
    ret = "(out, lse)" if prep.wants_lse else "out"
    if not steps["inline_run"]:
        if steps["folded_clashes"]:
            b.append(f"ptrs = [{', '.join(ptr[i] for i in range(8))}]")
        b.append("return prepared_run(prep, ptrs, None, out, lse)")
    else:
        b.append("if _runtime.getDevice() != dev:")
        b.append(f"    {miss}")
        b.append("st = _cuda.get_current_stream(dev).ptr")
        if steps["prepacked"]:
            b.append("try:")
            b.append("    mv, pa = local.b")
            b.append("except AttributeError:")
            b.append("    mv, pa = _new_buffers(local, template, kernel, fixed)")
            b += [f"mv[{slots[i]}] = p{i}" for i in per_call if i in slots]
            if 8 in slots:  # a scratch of this call's own (launch.scratch_partials)
                b.append("p8, keep = _arrays.scratch(sctx, sbytes)")
                b.append("_rt.memsetAsync(p8 + cbase, 0, cbytes, st)")
                b.append(f"mv[{slots[8]}] = p8")
                b.append(f"mv[{slots[9]}] = p8 + pmax")
                b.append(f"mv[{slots[10]}] = p8 + psum")
                b.append(f"mv[{slots[11]}] = p8 + cbase")
            b.append("launch(fptr, gx, gy, gz, threads, 1, 1, smem, st, pa, 0)")
            if 8 in slots:
                b.append("del keep  # freed in the stream's order, after the launch")
        else:
            b.append(f"prep.launch.run(_Ctx(dev, st, 'cupy', False), {ptr[6]}, "
                     f"{', '.join(ptr[i] for i in range(6))}, {ptr[7]})")
        b.append(f"return {ret}")
    used = {w for line in b for w in _words(line)}
    pro = []  # make()'s prologue: the constants this form's run uses, unpacked once
    for line, names in (
            ("dev = prep.device", ("dev",)),
            ("gx, gy, gz = grid", ("gx", "gy", "gz")),
            ("fptr = kernel.ptr", ("fptr",)),
            ("local = _Buffers()", ("local",)),
            ("launch = jit._driver.launchKernel", ("launch",)),
            ("qlo, qhi = prep.q_span[0] - prep.out_bytes, prep.q_span[1]", ("qlo", "qhi")),
            ("sctx, sbytes, cbase, cbytes, pmax, psum = extra", ("sctx", "sbytes", "cbase",
                                                                 "cbytes", "pmax", "psum")),
            ("prepared_run, clashes, metas = _prepared.run, _prepared.clashes, "
             "_prepared.metas", ("prepared_run", "clashes", "metas"))):
        if used & set(names):
            pro.append(line)
    for i in range(8):
        if {f"s{i}", f"t{i}", f"d{i}", f"a{i}"} & used:
            pro.append(f"s{i}, t{i}, d{i}, a{i} = plan_metas[{i}][:4]")
        if f"b{i}" in used:
            pro.append(f"b{i} = bound_objs[{i}]")
        if f"bp{i}" in used:
            pro.append(f"bp{i} = bound_ptrs[{i}]")
    for n in range(len(pairs)):
        pro.append(f"lo{n}, hi{n} = spans[{n}]")
    for n, (name, _) in enumerate(gate_spec):
        if f"v_{name}" in used:
            pro.append(f"v_{name} = gate[{n}]")
        if f"T_{name}" in used:
            pro.append(f"T_{name} = type(gate[{n}])")
    src = ["def make(prep, plan_metas, spans, kernel, grid, threads, smem, template, fixed, "
           "slow, bound_objs, bound_ptrs, gate, extra):"]
    src += [f"    {line}" for line in pro]
    src.append(f"    {head}")
    src += [f"        {line}" for line in b]
    src.append("    return run")
    return "\n".join(src)


def _words(line):
    import re
    return re.findall(r"[A-Za-z_][A-Za-z_0-9]*", line)




def build(kind, prep, metas, per_call, bound, bound_objs, slow=None, gate=()):
    """A fast run (see the module) for ``prep`` with these metas, or None when its calls
    cannot have one. ``per_call``: the address indices whose arrays each call passes;
    ``bound``: those fixed (a plan's tables, ``bound_objs`` by index)."""
    if metas is None or prep.kind != "cupy" or prep.new_lse or prep.launch is None:
        return None
    for i in per_call + bound:
        if metas[i] is None or len(metas[i]) != 5:
            return None
    absent = tuple(i for i in range(8) if i not in per_call and i not in bound)
    tpl = launch_template(prep.launch, absent)
    if tpl is None:
        return None
    kernel, grid, threads, smem, template, slots = tpl
    la = prep.launch
    for i in per_call:
        if i not in slots and not (i == 5 and not la.takes_starts):
            return None
    pairs, spans = [], []
    for i, lo1, hi1, j, lo2, hi2 in prep.disjoint:
        if i in per_call or j in per_call:
            pairs.append((i, j))
            spans.append((lo1 - hi2, hi1 - lo2))
    gate_spec = tuple([(name, cat) for name, cat, _ in gate])
    contig = STEPS["contig_strides"]
    fkey = (gate_spec, kind, tuple(per_call), tuple(bound), tuple(pairs), bool(prep.q_span),
            prep.in_place, prep.wants_lse, tuple(STEPS.values()), tuple(slots.items()),
            tuple([_contig_ok(metas[i]) for i in per_call + bound]) if contig else ())
    make = _factories.get(fkey)
    if make is None:
        src = form(kind, metas, per_call, bound, pairs, prep, dict(STEPS), slots, gate_spec)
        ns = {"_arrays": _arrays, "_rt": cupy.cuda.runtime, "_nd": cupy.ndarray,
              "_checks": _checks, "_HOLDS": _arrays._HOLDS, "_runtime": _runtime,
              "_cuda": cupy.cuda, "_new_buffers": _new_buffers, "_Ctx": _arrays.Context,
              "MISS": MISS, "_Buffers": _Buffers, "jit": jit, "_prepared": _prepared()}
        exec(compile(src, f"<cupaged fast {kind} run #{len(_factories)}>", "exec"), ns)
        make = _factories[fkey] = ns["make"]
        make.source = src
    bound_ptrs = {i: bound_objs[i].data.ptr for i in bound}
    fixed = tuple([(slots[i], bound_ptrs[i]) for i in bound if i in slots])
    extra = ()
    if 8 in slots:  # launch.scratch_partials' layout
        rows, hs = la.scratch_rows, la.head_size
        counters = la.grid[0] * la.grid[1]
        extra = (_arrays.Context(prep.device, 0, "cupy", False),
                 rows * (hs + 2) * 4 + counters * 4, rows * (hs + 2) * 4, counters * 4,
                 rows * hs * 4, rows * (hs + 1) * 4)
    return make(prep, metas, spans, kernel, grid, threads, smem, template, fixed, slow,
                bound_objs, bound_ptrs, [v for _, _, v in gate], extra)


def _prepared():
    from . import _prepared as p
    return p


def plan_runner(plan, generic):
    """The fast ``run`` of an AttentionPlan, or None when its call has none (torch
    tensors, no ``out``, a new lse, a scratch buffer or a second launch per call)."""
    metas = plan._metas
    if metas is None:
        return None
    per_call = [0, 1, 2, 6] + ([7] if metas[7] is not None else [])
    bound = [i for i in (3, 4, 5) if metas[i] is not None]
    objs = {3 + n: a for n, a in enumerate(plan._shared)}
    return build("plan", plan._prepared, metas, per_call, bound, objs, generic)


_KEYWORDS = ("kv_layout", "causal", "scale", "alibi_slopes", "max_query_len", "max_seq_len",
             "workspace", "kv_cache_dtype", "k_scale", "v_scale", "window", "window_left",
             "logits_soft_cap", "sinks", "return_lse")


def call_runner(prep, metas, keywords: dict):
    """The fast run of a remembered attention call (every array per call; ``keywords``:
    the call's other arguments, which the run's must match: the same objects, or of the
    same type and equal), or None. A side array (ALiBi slopes, sinks, a scale array) is
    not taken (the generic path keys it by its metadata and address)."""
    if metas is None:
        return None
    gate = []
    for name in _KEYWORDS:
        v = keywords[name]
        if v is None:
            gate.append((name, "none", None))
        elif name == "workspace":
            gate.append((name, "ref", weakref.ref(v)))  # not kept alive by the fast run
        elif v is True or v is False:
            gate.append((name, "is", v))
        elif type(v) in (int, float, str):
            gate.append((name, "eq", v))
        else:
            return None
    per_call = [i for i in range(8) if metas[i] is not None]
    return build("attention", prep, metas, per_call, [], {}, gate=gate)
