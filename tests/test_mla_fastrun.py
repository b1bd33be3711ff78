"""mla_attention's fast run (cupaged/_fastrun.py) on the CPU, the device's calls stubbed
(cupaged.bench.stub): for each form of call it serves it launches byte for byte what the
generic path launches (the wgmma kernel's tensor maps of each layer's cache included),
refuses what the generic path refuses, and leaves to the generic path every call it does
not stand for. On the GPU: its layers against the float64 reference."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import cupaged  # noqa: E402
from cupaged import _fastrun, _prepared, launch, planning, tensormap  # noqa: E402
from cupaged.bench import stub as stub_module  # noqa: E402
from conftest import no_fast_runs, outcome, state_is_read_on_each_call  # noqa: E402

RANK, ROPE = 512, 64
SEQS, WIDTH = 8, 16  # sequences, and their table's width in blocks (of 64 tokens: 1024 keys)

# name: what the form takes beside its defaults (128 heads, one token a sequence, a single
# pass, a combined float16 cache in blocks of 64, out given, the scale a float):
#   heads, tokens (a sequence's query tokens: query_start_loc given when more than one),
#   split (tiles a partition), workspace, pair (q as (q_nope, q_pe)), rope_cache (kv_cache
#   with k_pe_cache), cache ("fp8_e4m3"), k_scale ("number", "device"), lse ("given",
#   "returned": given and return_lse=True), dtype, scale, block_size, family (planning's
#   MLA kernel family), arch (the stub device's), maps (a stand-in encoder of tensor maps:
#   the CPU has no driver to make them, and the wgmma kernel then gets none)
FORMS = {
    "decode": dict(),  # the wgmma kernel (the stub's H200), no maps made
    "decode-maps": dict(maps=True),
    "split-workspace": dict(heads=16, split=4, workspace=True),
    "split-workspace-maps": dict(heads=16, split=4, workspace=True, maps=True),
    "split-scratch": dict(heads=16, split=4),
    "mma": dict(family="mma"),
    "mma-split-scratch-lse": dict(heads=16, split=2, family="mma", lse="given"),
    "sm80": dict(heads=16, arch="sm_80"),
    "sm80-split-workspace": dict(heads=16, split=4, workspace=True, arch="sm_80"),
    "pair": dict(pair=True, maps=True),
    "rope-cache": dict(rope_cache=True, maps=True),
    "pair-rope-cache-split-lse": dict(heads=16, pair=True, rope_cache=True, split=4,
                                      workspace=True, lse="returned", maps=True),
    "fp8-number": dict(cache="fp8_e4m3", k_scale="number"),
    "fp8-default-scale": dict(heads=16, cache="fp8_e4m3"),
    "fp8-device-scale": dict(cache="fp8_e4m3", k_scale="device"),
    "fp8-device-scale-split-lse": dict(heads=16, cache="fp8_e4m3", k_scale="device", split=4,
                                       workspace=True, lse="given"),
    "fp8-device-scale-rope-cache": dict(cache="fp8_e4m3", k_scale="device", rope_cache=True),
    "lse": dict(lse="given", maps=True),
    "lse-returned": dict(lse="returned"),
    "varlen": dict(heads=16, tokens=2),
    "varlen-split-scratch-lse": dict(heads=16, tokens=3, split=4, lse="given"),
    "bf16-numpy-scale": dict(dtype="bfloat16", scale=np.float64(0.07), maps=True),
    "small-pages": dict(heads=16, block_size=8),
}


def _encode(dtype, address, dims, strides, box):
    """A stand-in for the driver's tensor map of a tensor: its address and sizes."""
    return (address.to_bytes(8, "little") + dims[0].to_bytes(8, "little")) * 8


@pytest.fixture
def mla_form(stub, monkeypatch):
    """``mla_form(name)``: the arrays and keywords of a form (FORMS), its planning
    settings made for the rest of the test."""
    made = []

    def make(name):
        spec = FORMS[name]
        planning.set_mla_split(spec.get("split", 0))
        planning.set_mla_family(spec.get("family"))
        if "arch" in spec:
            monkeypatch.setattr(stub_module, "DEVICE",
                                stub_module.DEVICE._replace(arch=spec["arch"]))
        if spec.get("maps"):
            monkeypatch.setattr(tensormap, "encode_tiled",
                                lambda *a: made.append(a[1]) or _encode(*a))
        return form_arrays(stub, spec)

    make.encoded = made
    yield make
    planning.set_mla_split(None)
    planning.set_mla_family(None)


def form_arrays(stub, spec):
    """``(arrays, keywords)`` of a form: arrays by name (q as an array or the pair, the
    caches, tables, lengths, query starts, out, lse), each at a fresh address."""
    f = stub.fake
    heads, tokens = spec.get("heads", 128), spec.get("tokens", 1)
    bs = spec.get("block_size", 64)
    dtype = np.dtype(spec.get("dtype", "float16"))
    cache = dtype if "cache" not in spec else np.dtype(np.uint8)
    rows = SEQS * tokens
    nb = SEQS * WIDTH * 64 // bs + 8
    a = dict(block_tables=f((SEQS, WIDTH * 64 // bs), np.int32), seq_lens=f((SEQS,), np.int32),
             query_start_loc=f((SEQS + 1,), np.int32) if tokens > 1 else None)
    kw = dict(scale=spec.get("scale", 0.07), max_seq_len=1024)
    if tokens > 1:
        kw["max_query_len"] = tokens
    if "split" in spec and spec.get("workspace"):
        kw["workspace"] = cupaged.DecodeWorkspace(rows, heads, 512, rows=rows * heads * 8,
                                                  device=0)
    if "cache" in spec:
        kw["kv_cache_dtype"] = spec["cache"]
    if spec.get("k_scale") == "number":
        kw["k_scale"] = 0.5
    if spec.get("lse") == "returned":
        kw["return_lse"] = True
    a["out"] = f((rows, heads, RANK), dtype)
    a["lse"] = f((rows, heads), np.float32) if spec.get("lse") else None
    a["q"] = ((f((rows, heads, RANK), dtype), f((rows, heads, ROPE), dtype))
              if spec.get("pair") else f((rows, heads, RANK + ROPE), dtype))
    if spec.get("rope_cache"):
        a["kv_cache"], a["k_pe_cache"] = f((nb, bs, RANK), cache), f((nb, bs, ROPE), cache)
    else:
        a["kv_cache"], a["k_pe_cache"] = f((nb, bs, RANK + ROPE), cache), None
    a["k_scale"] = f((1,), np.float32) if spec.get("k_scale") == "device" else None
    return a, kw


def per_layer(stub, a):
    """Another layer's arrays of the same form: q, caches, out, lse and a device k_scale at
    new addresses (the tables and lengths are the step's)."""
    f = stub.fake
    b = dict(a)
    b["q"] = (tuple(f(x.shape, x.dtype) for x in a["q"]) if isinstance(a["q"], tuple)
              else f(a["q"].shape, a["q"].dtype))
    for name in ("kv_cache", "k_pe_cache", "out", "lse", "k_scale"):
        if a[name] is not None:
            b[name] = f(a[name].shape, a[name].dtype)
    return b


def call(a, kw, **more):
    """mla_attention over arrays ``a`` (a device k_scale among them) and keywords ``kw``."""
    args = dict(k_pe_cache=a["k_pe_cache"], out=a["out"], lse=a["lse"], **kw)
    if a["k_scale"] is not None:
        args["k_scale"] = a["k_scale"]
    args.update(more)
    return cupaged.mla_attention(a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"],
                                 a["query_start_loc"], **args)


def generic_call(a, kw, **more):
    """mla_attention with no fast run taken or made: the generic path alone."""
    with no_fast_runs():
        return call(a, kw, **more)


class Warmed:
    """A form's call repeated until mla_attention takes its fast run first: ``fast(b, kw)``
    calls it as a caller would, ``generic(b, kw)`` the generic path alone."""

    def __init__(self, a, kw, fast=True):
        for _ in range(2):
            call(a, kw)
        assert bool(_prepared.fast_mla) == fast, "a fast run" if fast else "none"
        self.runs = dict(_prepared.fast_mla)

    def fast(self, b, kw, **more):
        _prepared.fast_mla = dict(self.runs)  # (another call may have put its own first)
        return call(b, kw, **more)

    @staticmethod
    def generic(b, kw, **more):
        return generic_call(b, kw, **more)


def _le(x: int) -> bytes:
    return x.to_bytes(8, "little")


# ---- the same launches ------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_fast_run_launches_what_the_generic_path_launches(stub, generic_runs, mla_form, form):
    """Each layer's call (its own q, caches, out, lse and device k_scale) taken by the fast
    run made from the first layer's, launching the same bytes as the generic path."""
    spec = FORMS[form]
    a, kw = mla_form(form)
    e = Warmed(a, kw)
    for _ in range(3):
        b = per_layer(stub, a)
        before = generic_runs[0]
        got = outcome(stub, lambda: e.fast(b, kw))
        assert generic_runs[0] == before, "the fast run declined"
        want = outcome(stub, lambda: e.generic(b, kw))
        assert generic_runs[0] == before + 1
        assert got == want and got[0] == "launched"
        assert got[1] == ((id(b["out"]), id(b["lse"])) if spec.get("lse") else (id(b["out"]),))
        names = [x[0] for x in got[2]]
        assert all(x[4] == stub.stream(0).ptr for x in got[2])
        # the planner's choice, which the form must stay
        assert len(names) == (2 if spec.get("split") else 1), names
        if spec.get("split"):
            assert names[1].startswith("paged_decode_combine")
        wgmma = (spec.get("family") != "mma" and spec.get("arch") != "sm_80"
                 and spec.get("block_size", 64) >= 16)
        assert names[0].startswith("mla_attention_sm90" if wgmma else "mla_attention_f"), names
        params = got[2][0][6]
        q_lat = b["q"][0] if spec.get("pair") else b["q"]
        assert _le(q_lat.data.ptr) in params and _le(b["kv_cache"].data.ptr) in params
        if b["k_scale"] is not None:  # this layer's scale, where the kernel reads it
            assert _le(b["k_scale"].data.ptr) in params
        if spec.get("maps"):  # this layer's maps
            assert _encode(0, b["kv_cache"].data.ptr, (RANK,), (), ()) in params


def test_tensor_maps_are_made_once_a_cache(stub, generic_runs, mla_form):
    """Layers in turn, step after step: each layer's cache encoded once (the launch's own
    MlaTmaMaps serves the fast run and the generic path alike), every launch with its
    own layer's maps."""
    a, kw = mla_form("decode-maps")
    Warmed(a, kw)
    layers = [per_layer(stub, a) for _ in range(5)]
    del mla_form.encoded[:]
    for _ in range(3):
        for b in layers:
            got = outcome(stub, lambda: call(b, kw))
            params = got[2][0][6]
            rope = b["kv_cache"].data.ptr + RANK * 2
            assert _encode(0, b["kv_cache"].data.ptr, (RANK,), (), ()) in params
            assert _encode(0, rope, (ROPE,), (), ()) in params
    assert sorted(mla_form.encoded) == sorted(
        p for b in layers for p in (b["kv_cache"].data.ptr, b["kv_cache"].data.ptr + RANK * 2))


@pytest.mark.parametrize("form", ["lse", "pair-rope-cache-split-lse",
                                  "fp8-device-scale-split-lse", "varlen-split-scratch-lse"])
def test_outputs_over_inputs_are_refused_as_the_generic_path_refuses(stub, mla_form, form):
    """out and lse moved over each array the call reads (and over each other), at and
    around its ends: the fast run declines where the generic path refuses (its error) and
    launches where it launches."""
    a, kw = mla_form(form)
    e = Warmed(a, kw)
    a = per_layer(stub, a)  # another layer's arrays (its own k_scale)
    q = a["q"] if isinstance(a["q"], tuple) else (a["q"],)
    read = [*q, a["kv_cache"], a["k_pe_cache"], a["block_tables"], a["seq_lens"],
            a["query_start_loc"], a["k_scale"]]
    seen = set()
    for name in ("out", "lse"):
        w = a[name]
        for target in [x for x in read if x is not None] + [a["lse" if name == "out" else "out"]]:
            lo, hi = target.data.ptr, target.data.ptr + target.nbytes
            for at in (lo - w.nbytes - 16, lo - w.nbytes, lo - 16, lo, hi - 16, hi):
                b = dict(a, **{name: stub.fake(w.shape, w.dtype, at)})
                want = outcome(stub, lambda: e.generic(b, kw))
                assert outcome(stub, lambda: e.fast(b, kw)) == want, (name, at - lo)
                seen.add(want[0])
    assert seen == {"ValueError", "launched"}


# ---- what the fast run must not take ----------------------------------------------------------


def _declined_calls(stub, a, kw):
    """(what, arrays, keywords) of calls the fast run made from ``a``, ``kw`` must leave to
    the generic path: whatever the generic path then does (a launch, or an error) the
    entry point must do."""
    f = stub.fake
    pair = isinstance(a["q"], tuple)
    q = a["q"][0] if pair else a["q"]
    kc = a["kv_cache"]

    def with_q(x):
        return dict(a, q=(x, a["q"][1]) if pair else x)

    def with_array(name, x):
        if name == "q_pe":
            return dict(a, q=(a["q"][0], x))
        return with_q(x) if name == "q" else dict(a, **{name: x})

    class Sub(cupy.ndarray):
        pass

    torch = pytest.importorskip("torch")
    yield "stream=", a, dict(kw, stream=0x77)
    arrays = dict(a, q=q, q_pe=a["q"][1] if pair else None)
    for name, x in arrays.items():  # each array's metadata as validation did not see it
        if x is None:
            continue
        other = np.float32 if x.dtype != np.float32 else np.float16
        yield f"{name} of another dtype", with_array(name, f(x.shape, other)), kw
        yield f"{name} 8 bytes on", with_array(name, f(x.shape, x.dtype, x.data.ptr + 8)), kw
        yield f"{name} of another shape", with_array(name, f((x.shape[0] + 1,) + x.shape[1:],
                                                             x.dtype)), kw
        if x.ndim > 1:
            yield f"{name} of other strides", with_array(name, cupy.ndarray(
                x.shape, x.dtype, memptr=x.data, strides=(x.strides[0] * 2,) + x.strides[1:])), kw
    yield "arrays on another device", {
        n: None if x is None else (tuple(f(y.shape, y.dtype, device=1) for y in x)
                                   if isinstance(x, tuple) else f(x.shape, x.dtype, device=1))
        for n, x in a.items()}, kw
    yield "lse not in the form" if a["lse"] is None else "no lse", dict(
        a, lse=f((q.shape[0], q.shape[1]), np.float32) if a["lse"] is None else None), kw
    yield "a new lse (return_lse)", dict(a, lse=None), dict(kw, return_lse=True)
    if a["query_start_loc"] is None:
        yield "query starts not in the form", dict(
            a, query_start_loc=f((SEQS + 1,), np.int32)), kw
    else:
        yield "no query starts", dict(a, query_start_loc=None), kw
    yield "another scale", a, dict(kw, scale=0.08)
    yield "the scale as np.float32", a, dict(kw, scale=np.float32(kw["scale"]))
    yield "kv_lora_rank given", a, dict(kw, kv_lora_rank=RANK)
    yield "causal=1", a, dict(kw, causal=1)
    yield "not causal", a, dict(kw, causal=False)
    yield "max_seq_len as a float", a, dict(kw, max_seq_len=1024.0)
    yield "another max_seq_len", a, dict(kw, max_seq_len=512)
    yield "a workspace of its own", a, dict(kw, workspace=cupaged.DecodeWorkspace(
        SEQS, 128, 512, device=0, rows=SEQS * 128 * 8))
    yield "kv_cache_dtype named", a, dict(kw, kv_cache_dtype="fp8_e5m2")
    if a["k_pe_cache"] is None:
        yield "a cache pair", dict(a, kv_cache=f(kc.shape[:2] + (RANK,), kc.dtype),
                                   k_pe_cache=f(kc.shape[:2] + (ROPE,), kc.dtype)), kw
        yield "k_pe_cache beside a combined cache", dict(
            a, k_pe_cache=f(kc.shape[:2] + (ROPE,), kc.dtype)), kw
    else:
        yield "no k_pe_cache", dict(a, k_pe_cache=None), kw
    if pair:
        yield "q as a list", dict(a, q=list(a["q"])), kw
        yield "q as three arrays", dict(a, q=(*a["q"], a["q"][1])), kw
        yield "q as one array", dict(a, q=f(q.shape[:2] + (RANK + ROPE,), q.dtype)), kw
        yield "q as one array of q_nope's shape", dict(a, q=f(q.shape, q.dtype)), kw
    else:
        yield "q as a pair", dict(a, q=(f(q.shape[:2] + (RANK,), q.dtype),
                                        f(q.shape[:2] + (ROPE,), q.dtype))), kw
    yield "a CuPy subclass", with_q(q.view(Sub)), kw
    yield "a NumPy array", with_q(np.zeros(q.shape, q.dtype)), kw
    yield "a torch tensor (CPU)", with_q(torch.zeros(q.shape, dtype=torch.float16)), kw
    if "kv_cache_dtype" not in kw:
        yield "k_scale for a 16-bit cache", a, dict(kw, k_scale=1.0)
        return
    if a["k_scale"] is None:
        yield "a device k_scale", dict(a, k_scale=f((1,), np.float32)), kw
        yield "another k_scale", a, dict(kw, k_scale=0.25)
        return
    s = a["k_scale"]
    yield "k_scale a number", dict(a, k_scale=None), dict(kw, k_scale=0.5)
    yield "no k_scale", dict(a, k_scale=None), kw
    yield "k_scale float64", dict(a, k_scale=f((1,), np.float64)), kw
    yield "k_scale of two elements", dict(a, k_scale=f((2,), np.float32)), kw
    yield "k_scale of another shape", dict(a, k_scale=f((1, 1), np.float32)), kw
    yield "k_scale 4 bytes on", dict(a, k_scale=f((1,), np.float32, s.data.ptr + 4)), kw
    yield "k_scale 2 bytes on", dict(a, k_scale=f((1,), np.float32, s.data.ptr + 2)), kw
    yield "k_scale on another device", dict(a, k_scale=f((1,), np.float32, device=1)), kw
    yield "k_scale a CuPy subclass", dict(a, k_scale=s.view(Sub)), kw
    yield "k_scale a CPU torch tensor", dict(a, k_scale=torch.tensor([0.5])), kw


@pytest.mark.parametrize("form", ["decode", "pair-rope-cache-split-lse", "fp8-number",
                                  "fp8-device-scale", "varlen-split-scratch-lse"])
def test_calls_it_does_not_stand_for_go_to_the_generic_path(stub, generic_runs, mla_form,
                                                            form):
    a, kw = mla_form(form)
    e = Warmed(a, kw)
    for what, b, bkw in _declined_calls(stub, a, kw):
        want = outcome(stub, lambda: e.generic(b, bkw))
        before = generic_runs[0]
        got = outcome(stub, lambda: e.fast(b, bkw))
        assert got == want, what
        if got[0] == "launched":
            assert generic_runs[0] == before + 1, what


def test_the_device_stream_and_state_are_read_on_each_call(stub, generic_runs, mla_form,
                                                           monkeypatch):
    a, kw = mla_form("split-workspace")
    e = Warmed(a, kw)
    b = per_layer(stub, a)
    state_is_read_on_each_call(stub, generic_runs, monkeypatch, lambda: e.fast(b, kw),
                               lambda: e.generic(b, kw))


def test_a_call_without_out_allocates_it(stub, generic_runs, mla_form):
    """No out given: no fast run; the call allocates out (and writes there)."""
    a, kw = mla_form("decode")
    a["out"] = None
    for _ in range(3):
        got, want = outcome(stub, lambda: call(a, kw)), outcome(stub, lambda: generic_call(a, kw))
        assert got == want and got[0] == "launched"
        assert got[2][0][6][:8] == _le(0x7E00_0000_0000)  # its out
    assert not _prepared.fast_mla


def test_a_replaced_workspace_goes_to_the_generic_path_and_is_not_kept(stub, generic_runs,
                                                                       mla_form):
    a, kw = mla_form("split-workspace")
    e = Warmed(a, kw)
    ref = weakref.ref(kw["workspace"])
    ws = kw["workspace"]
    kw["workspace"] = cupaged.DecodeWorkspace(ws.rows // (16 * 8), 16, 512, rows=ws.rows,
                                              device=0)
    del ws
    gc.collect()
    assert ref() is None  # the fast run does not keep the remembered workspace alive
    before = generic_runs[0]
    want = outcome(stub, lambda: e.generic(a, kw))
    assert outcome(stub, lambda: e.fast(a, kw)) == want and want[0] == "launched"
    assert generic_runs[0] == before + 2


def test_a_clear_drops_the_fast_runs(stub, mla_form):
    a, kw = mla_form("decode")
    Warmed(a, kw)
    planning.set_mla_split(4)  # remembered calls were planned without a split
    assert _prepared.fast_mla == {}


def test_one_run_serves_every_layers_device_k_scale(stub, generic_runs, mla_form):
    """Each layer's own k_scale array gives the memo a prepared call a layer (keyed by its
    address), and the one fast run made serves them all, each launch reading its own."""
    a, kw = mla_form("fp8-device-scale")
    layers = [per_layer(stub, a) for _ in range(6)]
    for b in layers:  # the first step: each layer validated once
        call(b, kw)
    call(layers[0], kw)  # a hit: its fast run made
    before = generic_runs[0]
    for b in layers * 2:
        got = outcome(stub, lambda: call(b, kw))
        assert _le(b["k_scale"].data.ptr) in got[2][0][6]
    assert generic_runs[0] == before
    assert len(_prepared.fast_mla) == 1 and len(next(iter(_prepared.fast_mla.values()))) == 1


def test_a_kernel_that_is_not_a_launcher_gets_no_run(stub):
    """A launch whose kernel is a stand-in (not a jit.Launcher, whose buffer the run packs)
    has no template: its calls keep the generic path."""
    la = launch.MlaLaunch(lambda *a: None, (1, 1, 1), 0, 0, 1, (0,) * 4, (0, 0), (0,) * 4,
                          (0, 0), (0, 0, 0, 0, 1.0), (1, 1, 0.1), None, (), (), 1, RANK)
    assert _fastrun.template(la, (0, 2, 4, 5, 7), _fastrun.ENTRIES["mla"]) is None


# ---- on the GPU ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["decode-128", "decode-128-mma", "split-workspace-16",
                                  "split-scratch-16", "pair-rope-cache-lse-16",
                                  "fp8-device-scale-128", "fp8-device-scale-split-16",
                                  "varlen-lse-16"])
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_mla_fast_runs_compute_attention_on_the_device(rng, generic_runs, form, framework):
    """Three layers of one form, each with its own query, cache (so its own tensor maps on
    the wgmma kernel), tables, out, lse and device k_scale, two steps: once the fast run
    is made every call takes it, and every layer's output (and lse) matches the float64
    reference; over CuPy arrays and torch tensors (torch's current stream)."""
    from conftest import assert_close
    from test_mla import SCALE, make_mla, to_fp8

    from cupaged import reference, testing

    heads = next(int(f) for f in form.split("-") if f.isdigit())  # (the form's number)
    decode = not form.startswith("varlen")
    q_lens = [1] * 6 if decode else [1, 3, 2, 1, 4, 1]
    seq_lens = [700, 3, 2048, 64, 0 if decode else 5, 1500]
    fp8 = "fp8" in form
    kw = dict(scale=SCALE, max_seq_len=2048)
    if not decode:
        kw["max_query_len"] = 4
    if fp8:
        kw["kv_cache_dtype"] = "fp8_e4m3"
    if "workspace" in form:
        kw["workspace"] = cupaged.DecodeWorkspace(sum(q_lens), heads, 512)
    planning.set_mla_family("mma" if "mma" in form else None)
    planning.set_mla_split(4 if "split" in form else None)
    try:
        layers = []
        for _ in range(3):
            host = make_mla(rng, q_lens, seq_lens, heads=heads, block_size=64, dtype="f16")
            if decode:
                host["query_start_loc"] = None
            ref_kw = {}
            d = {k: (None if v is None else cupy.asarray(v)) for k, v in host.items()}
            if fp8:
                scale = float(rng.uniform(0.02, 0.05))
                host["kv_cache"] = to_fp8(host["kv_cache"], "fp8_e4m3", scale)
                d["kv_cache"] = cupy.asarray(host["kv_cache"])
                d["k_scale"] = cupy.asarray([scale], np.float32)
                ref_kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=scale)
            ref = reference.mla_attention(
                host["q"], host["kv_cache"], host["block_tables"], host["seq_lens"],
                host["query_start_loc"], scale=SCALE, return_lse=True, **ref_kw)
            if "pair" in form:
                q, cache = d["q"], d["kv_cache"]
                d["q"] = (q[..., :RANK], q[..., RANK:])
                d["kv_cache"], d["k_pe_cache"] = cache[..., :RANK], cache[..., RANK:]
            rows = sum(q_lens)
            d["out"] = cupy.full((rows, heads, RANK), np.nan, np.float16)
            d["lse"] = cupy.full((rows, heads), np.nan, np.float32) if "lse" in form else None
            layers.append((d, ref))
        to_host = cupy.asnumpy
        if framework == "torch":
            torch = pytest.importorskip("torch")
            to_host = lambda x: x.cpu().numpy()  # noqa: E731
            for d, _ in layers:
                for n, v in d.items():
                    if isinstance(v, tuple):
                        d[n] = tuple(torch.as_tensor(x, device="cuda") for x in v)
                    elif v is not None:
                        d[n] = torch.as_tensor(v, device="cuda")
        _prepared.clear()
        fast = 0
        for step in range(2):
            for i, (d, (ref_out, ref_lse)) in enumerate(layers):
                before, made = generic_runs[0], bool(_prepared.fast_mla)
                got = cupaged.mla_attention(
                    d["q"], d["kv_cache"], d["block_tables"], d["seq_lens"],
                    d["query_start_loc"], k_pe_cache=d.get("k_pe_cache"), out=d["out"],
                    lse=d["lse"], k_scale=d.get("k_scale"), **kw)
                # (made by the first repeat of a remembered call: the second layer's, or
                # with each layer's own k_scale array, the first layer's second step)
                if made:
                    assert generic_runs[0] == before, (step, i)
                    fast += 1
                back = got if isinstance(got, tuple) else (got,)
                assert [id(x) for x in back] == [id(d["out"])] + (
                    [] if d["lse"] is None else [id(d["lse"])])
                assert_close(to_host(d["out"]).astype(np.float64), ref_out,
                             testing.TOLERANCE["f16"], f"step {step} layer {i}")
                if d["lse"] is not None:
                    np.testing.assert_allclose(to_host(d["lse"]), ref_lse, rtol=0, atol=2e-3)
                d["out"][...] = float("nan")
        assert fast >= 2
    finally:
        planning.set_mla_family(None)
        planning.set_mla_split(None)
