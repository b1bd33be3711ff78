"""The fast run (cupaged/_fastrun.py) on the CPU, the device's calls stubbed
(cupaged.bench.stub): for each form of call it serves, through AttentionPlan.run and
through attention's remembered call, it launches byte for byte what the generic path
launches, refuses what the generic path refuses, and leaves to the generic path every
call it does not stand for."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import cupaged  # noqa: E402
from cupaged import _fastrun, _prepared, planning  # noqa: E402
from conftest import (no_fast_runs, on_cuda, outcome,  # noqa: E402
                      state_is_read_on_each_call)

NAMES = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")


# ---- forms of call ------------------------------------------------------------------------------


FORMS = {
    # name: (sequences, query tokens each, table width, query starts, keywords)
    # (decode's single pass: keys within one tile, so "auto" takes no split)
    "decode": (64, 1, 16, False, dict(max_seq_len=64)),
    "decode-workspace": (8, 1, 128, False, dict(max_seq_len=2048, workspace=True)),
    "decode-scratch": (8, 1, 128, False, dict(max_seq_len=2048)),
    "decode-lse": (64, 1, 16, False, dict(max_seq_len=64, window=128, lse=True)),
    "rows-scratch": (8, 1, 128, True, dict(max_query_len=1, max_seq_len=2048)),
    "prefill": (64, 32, 16, True, dict(max_query_len=32, max_seq_len=256)),
    "prefill-lse": (16, 32, 16, True, dict(max_query_len=32, max_seq_len=256, lse=True)),
    "decode-fp8-hnd": (64, 1, 16, False, dict(max_seq_len=256, kv_layout="HND",
                                              kv_cache_dtype="fp8_e4m3", k_scale=0.5,
                                              v_scale=0.25)),
    "decode-soft-cap-bf16": (64, 1, 16, False, dict(max_seq_len=64, logits_soft_cap=30.0,
                                                    dtype="bfloat16")),
    # the cap by tanh.approx (variant "ct"): a SoftCap keyword, remembered as a number is
    "decode-soft-cap-approx": (64, 1, 16, False, dict(
        max_seq_len=64, logits_soft_cap=cupaged.SoftCap(30.0, approx=True), dtype="bfloat16")),
    "prefill-soft-cap-approx": (16, 32, 16, True, dict(
        max_query_len=32, max_seq_len=256, logits_soft_cap=cupaged.SoftCap(30.0, approx=True),
        dtype="bfloat16")),
    # The flat split ("auto" with 64 x 8 (sequence, head tile) units, at least the stub's
    # H200's resident CTAs, over 1024 keys: planning.FLAT_SCRATCH_MIN_BYTES or more): grid
    # (CTAs, 1, 1), partials and one counter a unit in a scratch of the call's own (zeroed
    # per call) or in the workspace's
    "decode-flat": (64, 1, 64, False, dict(max_seq_len=1024)),
    "decode-flat-workspace": (64, 1, 64, False, dict(max_seq_len=1024, workspace=True)),
    "rows-flat": (64, 1, 128, True, dict(max_query_len=1, max_seq_len=2048)),
    "decode-flat-lse": (64, 1, 64, False, dict(max_seq_len=1024, window=512, lse=True)),
    "decode-flat-soft-cap-bf16": (64, 1, 64, False, dict(max_seq_len=1024,
                                                         logits_soft_cap=30.0,
                                                         dtype="bfloat16")),
    # side arrays: a plan's run takes them (bound), attention's has no fast run for them
    "decode-sinks-lse": (64, 1, 16, False, dict(max_seq_len=64, sinks=True, lse=True)),
    "decode-flat-sinks-lse": (64, 1, 64, False, dict(max_seq_len=1024, sinks=True, lse=True)),
    "prefill-alibi": (16, 32, 16, True, dict(max_query_len=32, max_seq_len=256, alibi=True)),
    # A split multi-token call: the kernel's partials merged by a second launch (the combine
    # kernel), in a scratch of the call's own (no counters: the combine merges) or in the
    # workspace's; paged_prefill for verify's few rows, paged_prefill_sm90 for 16 tokens
    "verify-split-scratch": (8, 4, 128, True, dict(max_query_len=4, max_seq_len=2048)),
    "verify-split-workspace-lse": (8, 4, 128, True, dict(max_query_len=4, max_seq_len=2048,
                                                         workspace=True, lse=True)),
    "prefill-sm90-split-scratch": (2, 16, 512, True, dict(max_query_len=16, max_seq_len=8192)),
}
SIDE_ARRAYS = ("decode-sinks-lse", "decode-flat-sinks-lse", "prefill-alibi")
# Forms whose split-KV partials are a scratch of each call's own: one memset of its merge
# counters before the launch
SCRATCH = ("decode-scratch", "rows-scratch", "decode-flat", "rows-flat", "decode-flat-lse",
           "decode-flat-soft-cap-bf16",
           "decode-flat-sinks-lse")
# Forms of two launches a call (a split merged by the combine kernel), whose scratch has no
# counters to zero
COMBINED = ("verify-split-scratch", "verify-split-workspace-lse", "prefill-sm90-split-scratch")


def make_form(stub, name):
    """``(arrays, keywords)`` of a form: arrays by name (the six inputs and out), a fresh
    address for each."""
    seqs, tokens, width, starts, kw = FORMS[name]
    kw = dict(kw)
    f = stub.fake
    dtype = np.dtype(kw.pop("dtype", "float16"))  # (bfloat16: ml_dtypes', which cupaged loads)
    cache = dtype if kw.get("kv_cache_dtype", "auto") == "auto" else np.dtype(np.uint8)
    shape = ((seqs * width + 8, 8, 16, 128) if kw.get("kv_layout") == "HND"
             else (seqs * width + 8, 16, 8, 128))
    a = dict(query=f((seqs * tokens, 32, 128), dtype), key_cache=f(shape, cache),
             value_cache=f(shape, cache), block_tables=f((seqs, width), np.int32),
             seq_lens=f((seqs,), np.int32),
             query_start_loc=f((seqs + 1,), np.int32) if starts else None)
    a["out"] = f(a["query"].shape, dtype)
    if kw.get("workspace"):
        kw["workspace"] = cupaged.DecodeWorkspace(seqs, 32, 128, rows=seqs * 32 * 64, device=0)
    if kw.get("lse"):
        kw["lse"] = f((seqs * tokens, 32), np.float32)
    if kw.pop("sinks", False):
        kw["sinks"] = f((32,), np.float32)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = f((32,), np.float32)
    return a, kw


def per_layer(stub, a, kw, out="apart"):
    """Another layer's arrays of the same form: query, caches, out (and lse) at new
    addresses; ``out`` "apart", "in place" (the query) or "none"."""
    b = dict(a)
    for name in ("query", "key_cache", "value_cache"):
        b[name] = stub.fake(a[name].shape, a[name].dtype)
    b["out"] = {"apart": stub.fake(a["out"].shape, a["out"].dtype), "in place": b["query"],
                "none": None}[out]
    kw = dict(kw)
    if kw.get("lse") is not None:
        kw["lse"] = stub.fake(kw["lse"].shape, kw["lse"].dtype)
    return b, kw


def plan_of(a, kw):
    return cupaged.AttentionPlan(*[a[n] for n in NAMES], out=a["out"], **kw)


def plan_call(plan, a, kw, run=None, **more):
    """plan.run on arrays ``a`` (and kw's lse); ``run``: AttentionPlan.run for the
    method itself, the generic path."""
    extra = {"lse": kw["lse"]} if kw.get("lse") is not None else {}
    args = (a["query"], a["key_cache"], a["value_cache"])
    if run is not None:
        return run(plan, *args, out=a["out"], **dict(extra, **more))
    return plan.run(*args, out=a["out"], **dict(extra, **more))


def attention_call(a, kw, **more):
    return cupaged.attention(*[a[n] for n in NAMES], out=a["out"], **dict(kw, **more))


def generic_attention_call(a, kw, **more):
    """attention() with no fast run taken or made: the generic path alone."""
    with no_fast_runs():
        return attention_call(a, kw, **more)


def warm_attention(a, kw):
    """Repeat the call until its fast run is the one attention() tries first."""
    for _ in range(2):
        attention_call(a, kw)
    assert _prepared.fast_attention, "no fast run"


ENTRIES = ("plan", "attention")


class Entry:
    """An entry point over one form: ``fast(b, kw)`` calls it as a caller would (the
    plan made, or attention's fast run for the form taken first), ``generic(b, kw)`` the
    generic path alone, for arrays ``b`` and keywords ``kw`` (lse= included)."""

    def __init__(self, entry, a, kw, fast=True):
        self.entry = entry
        if entry == "plan":
            self.plan = plan_of(a, kw)
            assert ("run" in vars(self.plan)) == fast, "a fast run" if not fast else "none"
        else:
            for _ in range(2):
                attention_call(a, kw)
            assert bool(_prepared.fast_attention.get(a["query"].shape)) == fast
            self.run = dict(_prepared.fast_attention)

    def fast(self, b, kw, **more):
        if self.entry == "plan":
            return plan_call(self.plan, b, kw, **more)
        _prepared.fast_attention = dict(self.run)  # (another call may have put its own first)
        return attention_call(b, kw, **more)

    def generic(self, b, kw, **more):
        if self.entry == "plan":
            return plan_call(self.plan, b, kw, run=cupaged.AttentionPlan.run, **more)
        return generic_attention_call(b, kw, **more)


# ---- the same launches ------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("form", FORMS)
def test_fast_run_launches_what_the_generic_path_launches(stub, generic_runs, form, entry):
    a, kw = make_form(stub, form)
    fast = not (entry == "attention" and form in SIDE_ARRAYS)
    e = Entry(entry, a, kw, fast)
    for _ in range(2):
        for out in ("apart", "in place"):
            b, bkw = per_layer(stub, a, kw, out)
            before = generic_runs[0]
            got = outcome(stub, lambda: e.fast(b, bkw))
            assert generic_runs[0] == before + (not fast), "the fast run declined"
            want = outcome(stub, lambda: e.generic(b, bkw))
            assert generic_runs[0] == before + 1 + (not fast)
            assert got == want
            assert got[0] == "launched" and got[1][0] == id(b["out"])
            kernels = [x for x in got[2] if x[0] != "memset"]
            assert len(kernels) == (2 if form in COMBINED else 1)
            assert {x[4] for x in kernels} == {stub.stream(0).ptr}
            assert len(got[2]) == len(kernels) + (form in SCRATCH)
            if form in COMBINED:
                assert kernels[0][0].startswith("paged_prefill" + "_sm90" * ("sm90" in form))
                assert kernels[1][0].startswith("paged_decode_combine")
            if "flat" in form:  # the planner's choice, which the form must stay
                name, grid = kernels[0][:2]
                assert name.split("_")[-3].endswith("r") and grid[1:] == (1, 1), name
                if form in SCRATCH:  # a counter a unit: 64 sequences x 8 head tiles
                    assert got[2][0][:4] == ("memset", got[2][0][1], 0, 4 * 64 * 8)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("form", ["decode", "prefill", "decode-lse", "prefill-lse",
                                  "verify-split-workspace-lse"])
def test_outputs_over_inputs_are_refused_as_the_generic_path_refuses(stub, form, entry):
    a, kw = make_form(stub, form)
    e = Entry(entry, a, kw)
    seen = set()
    written = ["out"] + (["lse"] if kw.get("lse") is not None else [])
    for name in written:
        w = a["out"] if name == "out" else kw["lse"]
        for target in [a[n] for n in NAMES] + [a["out"], kw.get("lse")]:
            if target is None or target is w:
                continue
            lo, hi = target.data.ptr, target.data.ptr + target.nbytes
            for at in (lo - w.nbytes - 16, lo - w.nbytes, lo - 16, lo, hi - 16, hi):
                moved = stub.fake(w.shape, w.dtype, at)
                b, bkw = dict(a), dict(kw)
                if name == "out":
                    b["out"] = moved
                else:
                    bkw["lse"] = moved
                want = outcome(stub, lambda: e.generic(b, bkw))
                assert outcome(stub, lambda: e.fast(b, bkw)) == want, (name, at - lo)
                seen.add(want[0])
    assert seen == {"ValueError", "launched"}


# ---- what the fast run must not take ----------------------------------------------------------


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_call_without_out_allocates_it(stub, generic_runs, entry):
    """No out given: the call allocates it, and writes there (never at address 0)."""
    a, kw = make_form(stub, "decode")
    a["out"] = None
    if entry == "plan":
        plan = plan_of(a, kw)
        assert "run" not in vars(plan)
        calls = (lambda: plan_call(plan, a, kw),
                 lambda: plan_call(plan, a, kw, run=cupaged.AttentionPlan.run))
    else:
        calls = (lambda: attention_call(a, kw), lambda: generic_attention_call(a, kw))
    for _ in range(3):
        got, want = outcome(stub, calls[0]), outcome(stub, calls[1])
        assert got == want and got[0] == "launched"
        assert int.from_bytes(got[2][0][-1][:8], "little") == 0x7E00_0000_0000  # its out


def test_attention_keywords_are_compared_with_the_remembered_ones(stub):
    """A keyword is the remembered object, or one of its type and equal; never another
    argument's (the scale against v_scale, say)."""
    a, kw = make_form(stub, "decode-fp8-hnd")
    kw.update(scale=0.1)
    e = Entry("attention", a, kw)
    x = 0.25
    calls = [dict(scale=x, v_scale=x), dict(scale=0.2), dict(max_seq_len=256.0),
             dict(max_seq_len=512), dict(causal=1), dict(kv_layout="NHD"),
             dict(window_left=-1), dict(k_scale=0.25), dict(kv_cache_dtype="fp8_e5m2")]
    for more in calls:
        b = dict(kw, **more)
        want = outcome(stub, lambda: e.generic(a, b))
        assert outcome(stub, lambda: e.fast(a, b)) == want, more
    assert outcome(stub, lambda: e.fast(a, dict(kw, scale=0.1)))[0] == "launched"


def test_a_soft_cap_keyword_is_compared_by_type_and_value(stub):
    """A SoftCap is remembered by value: the remembered one, or an equal one, runs fast;
    a number or another SoftCap (approx or not, another cap) launches what the generic
    path launches (its own kernel)."""
    a, kw = make_form(stub, "decode-soft-cap-approx")
    e = Entry("attention", a, kw)
    caps = [cupaged.SoftCap(30.0, approx=True), cupaged.SoftCap(30.0), 30.0,
            cupaged.SoftCap(31.0, approx=True)]
    for cap in caps:
        b = dict(kw, logits_soft_cap=cap)
        want = outcome(stub, lambda: e.generic(a, b))
        assert outcome(stub, lambda: e.fast(a, b)) == want, cap
    names = {outcome(stub, lambda: e.generic(a, dict(kw, logits_soft_cap=c)))[2][0][0]
             for c in caps[:3]}
    assert len(names) == 2 and sum("ct" in n for n in names) == 1, names


def test_a_clear_drops_the_fast_run_even_while_one_is_made(stub, monkeypatch):
    """_prepared.clear (planning's overrides, jit.clear_memory_caches) leaves no fast run,
    also one made by a call that had looked its key up before the clear."""
    a, kw = make_form(stub, "decode")
    warm_attention(a, kw)
    planning.set_tuning(ctas_per_sm=2)
    try:
        assert _prepared.fast_attention == {}
    finally:
        planning.set_tuning()
    real = _fastrun.call_runner

    def cleared_meanwhile(*args):  # another thread's clear, after this call's lookup
        _prepared.clear()
        return real(*args)

    monkeypatch.setattr(_fastrun, "call_runner", cleared_meanwhile)
    attention_call(a, kw)
    attention_call(a, kw)
    assert _prepared.fast_attention == {}


def _declined_calls(stub, a, kw):
    """(what, arrays, keywords) of calls the fast run must leave to the generic path, made
    from the form ``a``, ``kw``: whatever the generic path then does (a launch, or an
    error) the entry point must do."""
    f = stub.fake
    q, kc = a["query"], a["key_cache"]
    shifted = cupy.ndarray(q.shape, q.dtype, memptr=q.data + 8)
    strided = cupy.ndarray(kc.shape, kc.dtype, memptr=kc.data,
                           strides=(kc.strides[0] * 2,) + kc.strides[1:])

    class Sub(cupy.ndarray):
        pass

    torch = pytest.importorskip("torch")
    yield "stream=", a, dict(kw), dict(stream=0x77)
    yield "misaligned query", dict(a, query=shifted), kw, {}
    yield "cache of other strides", dict(a, key_cache=strided), kw, {}
    yield "query of another dtype", dict(a, query=f(q.shape, np.float32)), kw, {}
    yield "arrays on another device", {n: None if x is None else f(x.shape, x.dtype, device=1)
                                       for n, x in a.items()}, kw, {}
    yield "k_scale of its own", a, kw, dict(k_scale=1.0)
    yield "lse not in the form", a, kw, dict(lse=f((q.shape[0], 32), np.float32))
    yield "a CuPy subclass", dict(a, query=q.view(Sub)), kw, {}
    yield "a NumPy array", dict(a, query=np.zeros(q.shape, q.dtype)), kw, {}
    yield "a torch tensor (CPU)", dict(a, query=torch.zeros(q.shape, dtype=torch.float16)), kw, {}


@pytest.mark.parametrize("entry", ENTRIES)
def test_calls_it_does_not_stand_for_go_to_the_generic_path(stub, generic_runs, entry):
    a, kw = make_form(stub, "decode")
    e = Entry(entry, a, kw)
    for what, b, bkw, more in _declined_calls(stub, a, kw):
        want = outcome(stub, lambda: e.generic(b, bkw, **more))
        before = generic_runs[0]
        got = outcome(stub, lambda: e.fast(b, bkw, **more))
        assert got == want, what
        if got[0] == "launched":
            assert generic_runs[0] == before + 1, what


@pytest.mark.parametrize("entry", ENTRIES)
def test_the_device_stream_and_state_are_read_on_each_call(stub, generic_runs, monkeypatch,
                                                           entry):
    a, kw = make_form(stub, "decode")
    e = Entry(entry, a, kw)
    b, bkw = per_layer(stub, a, kw)
    state_is_read_on_each_call(stub, generic_runs, monkeypatch, lambda: e.fast(b, bkw),
                               lambda: e.generic(b, bkw))


def test_a_plan_rereads_its_tables(stub, generic_runs):
    a, kw = make_form(stub, "decode")
    e = Entry("plan", a, kw)
    bt = a["block_tables"]
    shape = bt.shape
    bt.shape = shape[::-1]  # reshaped in place: the plan must not read it as it was
    try:
        want = outcome(stub, lambda: e.generic(a, kw))
        assert outcome(stub, lambda: e.fast(a, kw)) == want
        assert want[0] == "ValueError"
    finally:
        bt.shape = shape
    assert outcome(stub, lambda: e.fast(a, kw))[0] == "launched"


def test_a_replaced_workspace_goes_to_the_generic_path_and_is_not_kept(stub, generic_runs):
    a, kw = make_form(stub, "decode-workspace")
    e = Entry("attention", a, kw)
    ref = weakref.ref(kw["workspace"])
    kw["workspace"] = cupaged.DecodeWorkspace(8, 32, 128, rows=8 * 32 * 64, device=0)
    assert ref() is None  # the fast run does not keep the remembered workspace alive
    want = outcome(stub, lambda: e.generic(a, kw))
    assert outcome(stub, lambda: e.fast(a, kw)) == want and want[0] == "launched"


@pytest.mark.parametrize("run", ["fast", "generic"])
@pytest.mark.parametrize("name", ["sinks", "alibi_slopes"])
def test_a_plan_rereads_its_torch_side_tensors(stub, run, name):
    """A torch side tensor bound to a plan (sinks, ALiBi slopes) re-pointed in place
    (set_, or param.data = ...) between runs: each run launches with its new address, as
    attention() does, never the old storage's."""
    torch = pytest.importorskip("torch")

    a, kw = make_form(stub, "decode-sinks-lse" if name == "sinks" else "prefill-alibi")
    side = on_cuda(torch.zeros(32, dtype=torch.float32))
    kw[name] = side
    plan = plan_of(a, kw)
    old = side.data_ptr()
    side.set_(torch.ones(32, dtype=torch.float32))
    assert side.data_ptr() != old
    b, bkw = per_layer(stub, a, kw)
    got = outcome(stub, lambda: plan_call(plan, b, bkw,
                                          run=None if run == "fast" else
                                          cupaged.AttentionPlan.run))
    want = outcome(stub, lambda: attention_call(b, bkw))
    assert got[0] == want[0] == "launched"
    params = got[2][-1][-1]
    assert side.data_ptr().to_bytes(8, "little") in params
    assert old.to_bytes(8, "little") not in params


def test_a_workspace_made_anew_where_one_was_freed_gets_a_fast_run(stub, generic_runs):
    """A DecodeWorkspace freed and made again at its address is the same call (the key's
    base and rows): after one generic call attention()'s fast run serves it again."""
    _prepared.clear()
    a, kw = make_form(stub, "decode-workspace")
    warm_attention(a, kw)
    n = generic_runs[0]
    attention_call(a, kw)
    assert generic_runs[0] == n  # the fast run's
    base = kw["workspace"]._base
    kw["workspace"] = None
    gc.collect()
    stub.next_address = base
    kw["workspace"] = cupaged.DecodeWorkspace(8, 32, 128, rows=8 * 32 * 64, device=0)
    assert kw["workspace"]._base == base
    n = generic_runs[0]
    for _ in range(4):
        attention_call(a, kw)
    assert generic_runs[0] - n <= 1


def test_a_plan_and_its_fast_run_hold_no_cycle(stub):
    a, kw = make_form(stub, "decode")
    plan = plan_of(a, kw)
    assert "run" in vars(plan)
    ref = weakref.ref(plan)
    del plan
    assert ref() is None  # freed at once, not by the cycle collector


def test_each_thread_launches_from_its_own_buffer(stub):
    a, kw = make_form(stub, "decode")
    e = Entry("plan", a, kw)
    layers = [per_layer(stub, a, kw) for _ in range(4)]
    want = {outcome(stub, lambda: e.generic(b, bkw))[2][0] for b, bkw in layers}
    del stub.launches[:]
    done = []

    def work(b, bkw):
        for _ in range(200):
            e.fast(b, bkw)
        done.append(1)

    threads = [threading.Thread(target=work, args=layer) for layer in layers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(done) == 4 and len(stub.launches) == 800 and set(stub.launches) == want


def test_alternating_forms_each_take_their_fast_run(stub, generic_runs):
    """Layers of two forms in turn (sliding-window and global layers, say): attention()
    keeps the last few forms' fast runs, so each call takes its own."""
    a, kw = make_form(stub, "decode")
    other = dict(kw, window=128)
    for _ in range(2):
        attention_call(a, kw)
        attention_call(a, other)
    before = generic_runs[0]
    for _ in range(3):
        b, _ = per_layer(stub, a, kw)
        for k in (kw, other):
            want = outcome(stub, lambda: generic_attention_call(b, k))
            assert outcome(stub, lambda: attention_call(b, k)) == want
    assert generic_runs[0] == before + 6  # the generic calls compared with, alone


def test_a_call_of_another_shape_tries_no_fast_run(stub, generic_runs):
    """attention() tries only the runs of its query's shape: a verify step beside decode
    layers, or a call whose query is not a CuPy array, tries none of them (each declined
    run is a Python call's cost), and still launches as the generic path does."""
    a, kw = make_form(stub, "decode")
    warm_attention(a, kw)
    tried = []
    for shape, runs in list(_prepared.fast_attention.items()):
        _prepared.fast_attention[shape] = tuple(
            (lambda r: lambda *x: tried.append(r) or r(*x))(r) for r in runs)
    p, pkw = make_form(stub, "prefill")
    for _ in range(3):
        want = outcome(stub, lambda: generic_attention_call(p, pkw))
        assert outcome(stub, lambda: attention_call(p, pkw)) == want
    assert tried == []
    attention_call(a, kw)  # the decode layer's own call still tries its run
    assert len(tried) == 1


def test_a_plan_keeps_its_bound_arrays(stub):
    """The caller may drop its tables: the plan holds them, and reads them where they are."""
    a, kw = make_form(stub, "rows-flat")
    e = Entry("plan", a, kw)
    refs = [weakref.ref(a[n]) for n in ("block_tables", "seq_lens", "query_start_loc")]
    b, bkw = per_layer(stub, a, kw)
    for n in ("block_tables", "seq_lens", "query_start_loc"):
        a[n] = b[n] = None
    gc.collect()
    assert all(r() is not None for r in refs)
    want = outcome(stub, lambda: e.generic(b, bkw))
    assert outcome(stub, lambda: e.fast(b, bkw)) == want and want[0] == "launched"


def test_a_subclass_that_overrides_run_keeps_its_run(stub):
    a, kw = make_form(stub, "decode")
    seen = []

    class Logged(cupaged.AttentionPlan):
        def run(self, *args, **kwargs):
            seen.append(1)
            return super().run(*args, **kwargs)

    plan = Logged(*[a[n] for n in NAMES], out=a["out"], **kw)
    plan_call(plan, a, kw)
    assert seen == [1]


@pytest.mark.parametrize("entry", ["attention", "mla_attention"])
def test_entry_points_pass_their_arguments_in_the_fast_runs_order(entry):
    """attention() and mla_attention() hand their fast runs every argument by position, in
    their own order, and the runs' makers their keywords in KEYWORDS' (MLA_KEYWORDS')
    order."""
    import inspect

    fn = getattr(cupaged, entry)
    signature, maker, keywords = {
        "attention": (_fastrun.ATTENTION_SIGNATURE, "call_runner", _fastrun.KEYWORDS),
        "mla_attention": (_fastrun.MLA_SIGNATURE, "mla_runner", _fastrun.MLA_KEYWORDS),
    }[entry]
    params = tuple(inspect.signature(fn).parameters)
    assert params == signature
    src = inspect.getsource(fn)
    call = src[src.index("r = fast(") + len("r = fast("):]
    call = call[:call.index(")")]
    assert tuple(x.strip() for x in call.split(",")) == params
    head = f"_fastrun.{maker}, prep, k[5],"
    made = src[src.index(head) + len(head):]
    made = made[:made.index(")")]
    assert tuple(x.strip() for x in made.split(",")) == keywords


def test_a_plan_made_from_a_remembered_call_checks_its_own_addresses(stub, monkeypatch):
    """A plan whose call the memo knows skips validation, but not the overlap checks at
    its own examples' addresses."""
    from cupaged import validation

    a, kw = make_form(stub, "decode")
    attention_call(a, kw)
    validations = []
    real = validation.validate_varlen
    monkeypatch.setattr(validation, "validate_varlen",
                        lambda *x, **k: validations.append(1) or real(*x, **k))
    plan_of(a, kw)
    assert not validations
    over = stub.fake(a["out"].shape, a["out"].dtype, a["value_cache"].data.ptr)
    with pytest.raises(ValueError, match="overlap"):
        plan_of(dict(a, out=over), kw)
    assert validations


# ---- on the GPU ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("form", ["decode", "decode-long-workspace", "decode-long-scratch",
                                  "decode-window-lse", "decode-flat-long-workspace",
                                  "decode-flat-long-scratch", "prefill",
                                  "prefill-split-lse", "prefill-split-long-workspace"])
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_fast_runs_compute_attention_on_the_device(rng, generic_runs, monkeypatch, request,
                                                   form, entry, framework):
    """The fast run on the device: every layer's output (and lse) against the reference,
    with no call through the generic path once the run is made, over CuPy arrays and
    torch tensors (torch's current stream). The flat forms take the flat split whatever
    the device (the flat_split fixture; attention has no partition=): a few units over one
    wave of CTAs, most idle, runs cut across units."""
    from conftest import assert_close
    from test_prepared import _device, _layers

    from cupaged import reference, testing

    decode = form.startswith("decode")
    flat = []
    if "flat" in form:
        request.getfixturevalue("flat_split")
        real_plan_flat = planning.plan_flat
        monkeypatch.setattr(planning, "plan_flat",
                            lambda *a: flat.append(real_plan_flat(*a)) or flat[-1])
    if "split" in form:  # the multi-token kernel's partials, merged by the combine kernel
        request.getfixturevalue("prefill_split")(64)
    seq = [3000, 1, 2500, 700] if "long" in form else [40, 1, 300, 64]
    q_lens = [1, 1, 1, 1] if decode else [5, 1, 33, 1]
    layers = _layers(rng, 3, q_lens, seq, heads=8, kv_heads=2)
    devs = [_device(h) for h in layers]
    kw, ref_kw = {}, {}
    if decode:
        for h, d in zip(layers, devs):
            h["query_start_loc"] = d["query_start_loc"] = None
    if form.endswith("long-workspace"):
        kw["workspace"] = cupaged.DecodeWorkspace(sum(q_lens), 8, 64)
    if form == "decode-window-lse":
        kw["window"] = ref_kw["window"] = 32
    for d in devs:
        d["out"] = cupy.full(d["query"].shape, np.nan, np.float16)
        d["lse"] = (cupy.full(d["query"].shape[:2], np.nan, np.float32)
                    if "lse" in form else None)
    to_host = cupy.asnumpy
    if framework == "torch":
        torch = pytest.importorskip("torch")
        to_host = lambda x: x.cpu().numpy()  # noqa: E731
        # (Shared tables stay shared: one tensor per CuPy array.)
        made_tensors = {}
        for d in devs:
            for n, v in d.items():
                if v is not None:
                    d[n] = made_tensors.setdefault(id(v), torch.as_tensor(v, device="cuda"))
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
             "query_start_loc")
    d0 = devs[0]
    if entry == "plan":
        plan = cupaged.AttentionPlan(*[d0[n] for n in names], out=d0["out"], lse=d0["lse"],
                                     **kw)
        if decode or "split" in form:
            assert "run" in vars(plan)
        made = "run" in vars(plan)
        call = lambda d: plan.run(d["query"], d["key_cache"], d["value_cache"],  # noqa: E731
                                  out=d["out"], lse=d["lse"])
    else:
        _prepared.clear()
        made = False  # (attention's: made by its second call, taken from its third)
        call = lambda d: cupaged.attention(*[d[n] for n in names], out=d["out"],  # noqa: E731
                                           lse=d["lse"], **kw)
    for rnd in range(2):
        for i, (h, d) in enumerate(zip(layers, devs)):
            before = generic_runs[0]
            call(d)
            if made:
                assert generic_runs[0] == before, (rnd, i)
            made = made or bool(_prepared.fast_attention)
            host = {k: v for k, v in h.items() if k != "alibi_slopes"}
            ref = reference.attention(**host, return_lse=True, **ref_kw)
            assert_close(to_host(d["out"]), ref[0], testing.TOLERANCE["f16"],
                         f"layer {i}")
            if d["lse"] is not None:
                np.testing.assert_allclose(to_host(d["lse"]), ref[1], rtol=1e-4,
                                           atol=1e-4)
            d["out"][...] = float("nan")
    if decode or "split" in form:
        assert entry == "plan" or _prepared.fast_attention
    if "flat" in form:  # planned flat, once (then remembered); minus the row count
        assert len(flat) == 1 and flat[0] is not None and flat[0].split_tokens == -len(seq)


def test_a_torch_forms_source_reads_what_torch_metas_read():
    """A torch run's checks are _prepared.metas' six fields for a tensor (the strides in
    elements by stride(), the device by get_device(), requires_grad) and its address by
    data_ptr(); it launches on torch's stream. The generated source compiles with every
    name it uses bound (make() of a form names each constant it reads)."""
    slots = tuple((i, ((8 * w, 0),)) for i, w in ((0, 0), (1, 1), (2, 2), (3, 3), (4, 4),
                                                  (6, 5)))
    src = _fastrun.source("plan", [0, 1, 2, 6], [3, 4], [], True, False, False,
                          ((slots, None),), None, (), torch=True)
    for piece in ("query.stride() == t0", "query.get_device() == dev", "query.is_cuda",
                  "query.requires_grad is r0", "(p0 := query.data_ptr()) & 15 == a0",
                  "(p3 := b3.data_ptr()) == bp3", "type(query) is _tensor",
                  "st = _torch_stream(dev)"):
        assert piece in src, piece
    assert ".data.ptr" not in src and "_current_stream" not in src
    ns = {}
    exec(compile(src, "<torch form>", "exec"), ns)
    made = [n.strip().split(" = ")[0] for n in src.splitlines() if " = c[" in n]
    assert {"r0", "r3", "_tensor", "_torch_stream", "bp3"} <= set(made)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ENTRIES)
def test_torch_calls_the_run_was_not_made_for_go_to_the_generic_path(rng, generic_runs, entry):
    """Over torch tensors: a strided view of the query, a tensor that requires grad, a
    CuPy query and stream= each go to the generic path, with its result (or its error);
    the run's own repeat after them launches from the fast run again."""
    torch = pytest.importorskip("torch")
    from conftest import assert_close
    from test_prepared import _device, _layers

    from cupaged import reference, testing

    (h,) = _layers(rng, 1, [1, 1, 1], [40, 1, 300], heads=8, kv_heads=2)
    h["query_start_loc"] = None
    d = {n: (None if v is None else torch.as_tensor(v, device="cuda"))
         for n, v in _device(h).items()}
    out = torch.full_like(d["query"], float("nan"))
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
             "query_start_loc")
    want = reference.attention(**{k: v for k, v in h.items() if k != "alibi_slopes"})
    if entry == "plan":
        plan = cupaged.AttentionPlan(*[d[n] for n in names], out=out)
        assert "run" in vars(plan)

        def call(q, o, **k):
            return plan.run(q, d["key_cache"], d["value_cache"], out=o, **k)
    else:
        _prepared.clear()

        def call(q, o, **k):
            return cupaged.attention(q, *[d[n] for n in names[1:]], out=o, **k)

        for _ in range(2):
            call(d["query"], out)
    wide = torch.full((*d["query"].shape[:2], 2 * d["query"].shape[2]), float("nan"),
                      dtype=d["query"].dtype, device="cuda")
    head_size = d["query"].shape[2]
    wide[..., :head_size] = d["query"]  # (a view whose heads are 2 x head_size apart)
    grad = d["query"].clone().requires_grad_(True)
    others = [("strided query", lambda o: call(wide[..., :head_size], o)),
              ("requires_grad query", lambda o: call(grad, o)),
              ("cupy query", lambda o: call(cupy.asarray(d["query"]), o)),
              ("stream=", lambda o: call(d["query"], o, stream=torch.cuda.current_stream()))]
    for what, fn in others:
        before = generic_runs[0]
        out.fill_(float("nan"))
        try:
            fn(out)
        except (TypeError, ValueError) as e:  # what the generic path says of it
            assert generic_runs[0] == before, what  # refused before any launch
            assert "query" in str(e), (what, e)
        else:
            assert generic_runs[0] == before + 1, what
            assert_close(out.cpu().numpy(), want, testing.TOLERANCE["f16"], what)
        before = generic_runs[0]
        out.fill_(float("nan"))
        call(d["query"], out)
        assert generic_runs[0] == before, f"the fast run after {what}"
        assert_close(out.cpu().numpy(), want, testing.TOLERANCE["f16"], f"after {what}")


def test_a_bound_address_off_an_8_byte_boundary_gets_no_view_of_its_own():
    """A bound table's address is packed into the buffer once (build), so the run takes
    8-byte views only at the per-call addresses off an 8-byte boundary, as
    _thread_buffers makes them: a bound one at 4 mod 8 would make the run's unpack of the
    views fail in the caller's thread."""
    import re

    slots = ((0, ((8, 0),)), (1, ((16, 0),)), (2, ((24, 0),)), (3, ((36, 0),)),
             (4, ((44, 0),)), (6, ((0, 0),)))
    src = _fastrun.source("plan", [0, 1, 2, 4, 6], [3], [], False, False, False,
                          ((slots, None),), None, ())
    unpacked = re.search(r"^\s+(.*), = local\.b", src, re.M).group(1).split(", ")
    # what build() hands _thread_buffers: the per-call addresses' offsets
    assert unpacked == ["w0", "pa0", "u0_44"]
