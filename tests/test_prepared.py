"""Prepared calls (cupaged/_prepared.py): a repeated call skips validation and planning, yet
reads each call's own arrays, and never lets through what validation would refuse."""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest

import cupaged
from cupaged import _checks, _prepared, _variants, launch, reference, testing, validation

from conftest import assert_close, make_problem
from test_merge import fake_device  # noqa: F401  (a fixture)
from test_mla_validation import fakes_adapt  # noqa: F401  (a fixture)
from test_varlen import make_varlen

TOL = testing.TOLERANCE["f16"]


# ---- keys (no GPU) ------------------------------------------------------------------------------


def test_scalars_are_keyed_with_their_types():
    """True == 1 and 16.0 == 16 in Python, but validation accepts one and refuses the other."""
    k = lambda *s: _prepared.key("t", (), (), s)[0]
    assert k(16) != k(16.0)
    assert k(1) != k(True)
    assert k(None, "auto") == k(None, "auto")


def test_unknown_arrays_and_arguments_are_not_keyed(monkeypatch):
    class Fake:
        shape, strides, dtype = (2,), (4,), np.dtype(np.int32)

    assert _prepared.key("t", (Fake(),), (), ())[0] is None  # not CuPy, not torch
    assert _prepared.key("t", (), (object(),), ())[0] is None  # a side argument of no kind
    assert _prepared.key("t", (), (), (), _prepared.UNKEYED)[0] is None
    monkeypatch.setattr(_checks, "DEBUG", True)  # its checks read device data every call
    assert _prepared.key("t", (), (), ())[0] is None


def test_unhashable_scalars_take_the_validating_path():
    k, _ = _prepared.key("t", (), (), ([1, 2],))
    assert _prepared.lookup(k) is None
    _prepared.remember(k, "x")  # not remembered, no error
    assert _prepared.lookup(k) is None


def test_the_memo_is_bounded():
    _prepared.clear()
    for i in range(_prepared._MAX_ENTRIES + 5):
        _prepared.remember(("bounded", i), i)
    assert len(_prepared._MEMO) <= _prepared._MAX_ENTRIES
    _prepared.clear()


# ---- repeated calls on the GPU --------------------------------------------------------------------


@pytest.fixture
def validations(monkeypatch):
    """Counts the calls that went through validation (the others were prepared)."""
    count = {"decode": 0, "attention": 0, "mla": 0}

    def counting(name, function):
        real = getattr(validation, function)

        def wrapped(*a, **k):
            count[name] += 1
            return real(*a, **k)

        monkeypatch.setattr(validation, function, wrapped)

    counting("decode", "validate_decode")
    counting("attention", "validate_varlen")
    counting("mla", "validate_mla")
    _prepared.clear()
    yield count
    _prepared.clear()


def _same_shape_problems(rng, n=3, **kw):
    """Problems with identical metadata and different data and tables."""
    return [make_problem(rng, **kw) for _ in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("partition", ["never", "always", 32])
@pytest.mark.parametrize("given_out", [True, False], ids=["out", "new-out"])
def test_repeated_decode_reads_each_calls_arrays(rng, validations, partition, given_out):
    import cupy

    problems = _same_shape_problems(rng, lens=(40, 17, 1, 0), heads=8, kv_heads=2, head_size=64)
    for i, pb in enumerate(problems + problems[:1]):
        d = pb.device_args()
        out = cupy.full(pb.query.shape, np.nan, np.float16) if given_out else None
        got = cupaged.paged_attention(**d, out=out, partition=partition, max_context_len=48)
        assert_close(cupy.asnumpy(got), pb.reference(), TOL, f"call {i}")
    assert validations["decode"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
@pytest.mark.parametrize("kind", ["decode", "mixed", "split-prefill"])
def test_repeated_attention_reads_each_calls_arrays(rng, validations, prefill_split, layout,
                                                    kind):
    import cupy

    if kind == "decode":
        q_lens, seq = [1, 1, 1], [40, 1, 300]
    else:
        q_lens, seq = [5, 0, 33, 1], [5, 20, 200, 64]
    if kind == "split-prefill":
        prefill_split(64)
    hosts = [make_varlen(rng, q_lens, seq, layout=layout, heads=8, kv_heads=2)
             for _ in range(3)]
    for i, host in enumerate(hosts + hosts[:1]):
        dev = {k: (None if v is None else cupy.asarray(v)) for k, v in host.items()}
        if kind == "decode":
            dev["query_start_loc"] = None
        out = cupy.full(host["query"].shape, np.nan, np.float16)
        got, lse = cupaged.attention(**dev, kv_layout=layout, out=out, return_lse=True)
        ref, ref_lse = reference.attention(**host, kv_layout=layout, return_lse=True)
        assert_close(cupy.asnumpy(got), ref, TOL, f"call {i}")
        np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=1e-4, atol=1e-4)
    assert validations["attention"] == 1


@pytest.mark.gpu
def test_side_arrays_and_workspaces_are_keyed_by_address(rng, validations):
    """ALiBi slopes, sinks and workspaces are embedded in a prepared call: another array of
    the same shape is another call, read correctly."""
    import cupy

    pb = make_problem(rng, lens=(70, 3), heads=8, kv_heads=2, head_size=64)
    d = pb.device_args()
    alive = []  # each call's arrays at their own addresses
    for _ in range(2):
        slopes = rng.uniform(0.0, 0.5, 8).astype(np.float32)
        sinks = rng.normal(size=8).astype(np.float32)
        dev = (cupy.asarray(slopes), cupy.asarray(sinks), launch.DecodeWorkspace(2, 8, 64))
        alive.append(dev)
        got = cupaged.paged_attention(**{**d, "alibi_slopes": dev[0]}, sinks=dev[1],
                                      workspace=dev[2], partition="always")
        ref = reference.paged_attention(**{**pb.host_args(), "alibi_slopes": slopes},
                                        sinks=sinks)
        assert_close(cupy.asnumpy(got), ref, TOL)
    assert validations["decode"] == 2


@pytest.mark.gpu
def test_a_new_workspace_every_step_counts_in_its_own_memory(rng, validations, monkeypatch):
    """A loop that makes a new DecodeWorkspace each step gets memory of freed ones back
    from CuPy's pool. A prepared call embeds the workspace's addresses, so its key must
    name every one of them: the launch that runs (remembered or new) must write its
    partials and count in the current workspace's own memory."""
    import cupy

    ran = []
    real_run = launch.Launch.run

    def recording(self, *a, **k):
        ran.append(self.partials)
        return real_run(self, *a, **k)

    monkeypatch.setattr(launch.Launch, "run", recording)
    pb = make_problem(rng, lens=(3000, 2000, 100), heads=8, kv_heads=2, head_size=64)
    d, ref = pb.device_args(), pb.reference()
    ws = None
    for step in range(8):
        if step % 2:
            ws = None  # freed before the next one is made, as well as after
        ws = cupaged.DecodeWorkspace(3, 8, 64)
        out = cupaged.paged_attention(**d, workspace=ws, partition=256)
        assert_close(cupy.asnumpy(out), ref, TOL, f"step {step}")
        parts = ran[-1]
        lo, hi = ws._buf.data.ptr, ws._buf.data.ptr + ws.nbytes
        for addr in (parts.part_out, parts.part_max, parts.part_sum, parts.counters):
            assert lo <= addr < hi, f"step {step}: the launch uses memory outside its workspace"
    assert validations["decode"] < 8  # some steps did reuse a remembered launch


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["paged_attention", "attention"])
def test_overlap_is_checked_on_every_call(rng, validations, entry):
    """The query and out share metadata with a call that passed; only their addresses
    overlap now, which must still be refused (and writing in place still works)."""
    import cupy

    pb = make_problem(rng, lens=(9, 30, 4), heads=4, kv_heads=2, head_size=64)
    d = pb.device_args()
    buf = cupy.asarray(np.concatenate([pb.query[:1], pb.query]))
    q = buf[1:]
    call = (cupaged.paged_attention if entry == "paged_attention" else
            lambda query, **a: cupaged.attention(query, a["key_cache"], a["value_cache"],
                                                 a["block_tables"], a["context_lens"],
                                                 kv_layout="vllm", out=a["out"]))
    args = {k: v for k, v in d.items() if k not in ("query", "alibi_slopes")}
    call(q, **args, out=cupy.empty_like(q))
    with pytest.raises(ValueError, match="overlap"):
        call(q, **args, out=buf[:-1])
    got = call(q, **args, out=q)  # in place: the same array
    assert got.data.ptr == q.data.ptr
    assert_close(cupy.asnumpy(q), pb.reference(), TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["paged_attention", "attention", "plan"])
def test_outputs_over_inputs_are_refused_after_a_hit(rng, validations, entry):
    """A call that passed, then the same call (metadata alike, so its prepared launches
    match) with out over the value cache, or lse over the sinks (keyed at their
    address): refused, where the kernels would have written into what they read; the
    caches and sinks are left as they were."""
    import cupy

    pb = make_problem(rng, lens=(9, 30, 4), heads=4, kv_heads=2, head_size=64)
    d = pb.device_args()
    q, kc, vc, bt, cl = (d[n] for n in ("query", "key_cache", "value_cache", "block_tables",
                                        "context_lens"))
    shelf = cupy.asarray(rng.standard_normal(3 * 4), np.float32)
    sinks = shelf[:4]
    lse_over_sinks = shelf.reshape(3, 4)
    if entry == "paged_attention":
        def call(out, lse):
            return cupaged.paged_attention(q, kc, vc, bt, cl, out=out, sinks=sinks, lse=lse)
    elif entry == "attention":
        def call(out, lse):
            return cupaged.attention(q, kc, vc, bt, cl, kv_layout="vllm", out=out,
                                     sinks=sinks, lse=lse)
    else:
        plan = cupaged.AttentionPlan(q, kc, vc, bt, cl, kv_layout="vllm", sinks=sinks,
                                     out=cupy.empty_like(q), lse=cupy.empty((3, 4), np.float32))

        def call(out, lse):
            return plan.run(q, kc, vc, out=out, lse=lse)
    call(cupy.empty_like(q), cupy.empty((3, 4), np.float32))
    before = [cupy.asnumpy(a) for a in (vc, shelf)]
    out_over_cache = vc.reshape(-1)[:q.size].reshape(q.shape)  # C-contiguous, as q
    assert out_over_cache.data.ptr % 16 == 0
    with pytest.raises(ValueError, match="out and value_cache overlap in memory"):
        call(out_over_cache, cupy.empty((3, 4), np.float32))
    with pytest.raises(ValueError, match="lse and sinks overlap in memory"):
        call(cupy.empty_like(q), lse_over_sinks)
    cupy.cuda.get_current_stream().synchronize()
    for was, a in zip(before, (vc, shelf)):
        np.testing.assert_array_equal(cupy.asnumpy(a), was)


@pytest.mark.gpu
def test_v2_scratch_over_a_cache_is_refused_after_a_hit(rng, validations):
    """paged_attention_v2 with its scratch apart from the caches, then the same call (the
    same scratch, a value cache of the same metadata: a remembered call) with the value
    cache over tmp_out: refused, where the partials would overwrite values still to be
    read."""
    import cupy

    pb = make_problem(rng, lens=(900, 30, 4), heads=4, kv_heads=2, head_size=64)
    d = pb.device_args()
    q, kc, vc, bt, cl = (d[n] for n in ("query", "key_cache", "value_cache", "block_tables",
                                        "context_lens"))
    parts = 8
    es = cupy.empty((3, 4, parts), np.float32)
    ml = cupy.empty_like(es)
    n_tmp = 3 * 4 * parts * 64
    shelf = cupy.empty(max(8 + vc.size, 2 * n_tmp), np.float16)
    tmp = shelf[:2 * n_tmp].view(np.float32).reshape(3, 4, parts, 64)

    def call(value_cache):
        cupaged.paged_attention_v2(cupy.empty_like(q), es, ml, tmp, q, kc, value_cache, 2,
                                   0.125, bt, cl, 16, 900)

    call(vc)
    n = validations["decode"]
    vc2 = shelf[8:8 + vc.size].reshape(vc.shape)  # 16 bytes into tmp_out, aligned as vc
    vc2[...] = vc
    with pytest.raises(ValueError, match="tmp_out and value_cache overlap in memory"):
        call(vc2)
    assert validations["decode"] == n + 1  # validated again (and refused), not launched


@pytest.mark.gpu
def test_a_call_validation_refuses_is_refused_after_a_hit(rng, validations):
    """What differs from a prepared call only in a scalar's type or a pointer's alignment is
    validated afresh, and refused."""
    import cupy

    host = make_varlen(rng, [5, 20], [40, 20], heads=4, kv_heads=2)
    dev = {k: cupy.asarray(v) for k, v in host.items() if v is not None}
    cupaged.attention(**dev, max_query_len=20)
    with pytest.raises(TypeError, match="max_query_len must be an int"):
        cupaged.attention(**dev, max_query_len=20.0)
    # The same query 8 bytes off a 16-byte boundary: multi-token queries must be aligned.
    buf = cupy.empty(dev["query"].size + 4, np.float16)
    q = buf[4:].reshape(dev["query"].shape)
    q[...] = dev["query"]
    with pytest.raises(ValueError, match="16-byte aligned"):
        cupaged.attention(**{**dev, "query": q})
    pb = make_problem(rng, lens=(9,), block_size=1)
    d = pb.device_args()
    cupaged.paged_attention(**d, partition=1)
    with pytest.raises(ValueError, match="partition must be"):
        cupaged.paged_attention(**d, partition=True)


@pytest.mark.gpu
def test_debug_mode_validates_every_call(rng, validations, monkeypatch):
    monkeypatch.setattr(_checks, "DEBUG", True)
    pb = make_problem(rng, lens=(9, 30))
    d = pb.device_args()
    for _ in range(3):
        cupaged.paged_attention(**d)
    assert validations["decode"] == 3


@pytest.mark.gpu
def test_repeated_torch_calls(rng, validations):
    torch = pytest.importorskip("torch")
    for i, pb in enumerate(_same_shape_problems(rng, lens=(33, 2), heads=8, kv_heads=2)):
        d = {k: (None if v is None else torch.from_numpy(v).cuda())
             for k, v in pb.host_args().items()}
        got = cupaged.paged_attention(**d, partition="always")
        assert isinstance(got, torch.Tensor)
        assert_close(got.cpu().numpy(), pb.reference(), TOL, f"call {i}")
    assert validations["decode"] == 1


# ---- AttentionPlan ------------------------------------------------------------------------------


def _layers(rng, n, q_lens, seq, layout="NHD", **kw):
    """``n`` layers' host problems sharing one step's tables and lengths (the first with
    its unused cache slots poisoned)."""
    first = make_varlen(rng, q_lens, seq, layout=layout, **kw)
    layers = [first]
    for _ in range(n - 1):
        # (Not poisoned: its unused slots follow its own tables, not the shared ones.)
        other = make_varlen(rng, q_lens, seq, layout=layout, stale=None, **kw)
        layers.append({**other, "block_tables": first["block_tables"],
                       "seq_lens": first["seq_lens"], "query_start_loc": first["query_start_loc"]})
    return layers


def _device(host):
    import cupy

    return {k: (None if v is None else cupy.asarray(v)) for k, v in host.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm"])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_plan_runs_every_layer(rng, validations, layout, kind):
    import cupy

    q_lens, seq = ([1, 1, 1], [40, 1, 300]) if kind == "decode" else ([5, 0, 33, 1], [5, 20, 200, 64])
    layers = _layers(rng, 3, q_lens, seq, layout, heads=8, kv_heads=2)
    devs = [_device(h) for h in layers]
    if kind == "decode":
        for d in devs:
            d["query_start_loc"] = None
    outs = [cupy.full(h["query"].shape, np.nan, np.float16) for h in layers]
    d0 = devs[0]
    plan = cupaged.AttentionPlan(d0["query"], d0["key_cache"], d0["value_cache"],
                                 d0["block_tables"], d0["seq_lens"], d0["query_start_loc"],
                                 kv_layout=layout, out=outs[0], return_lse=True)
    assert validations["attention"] == 1
    for i, (h, d, o) in enumerate(zip(layers, devs, outs)):
        got, lse = plan.run(d["query"], d["key_cache"], d["value_cache"], out=o)
        assert got is o
        ref, ref_lse = reference.attention(**h, kv_layout=layout, return_lse=True)
        assert_close(cupy.asnumpy(o), ref, TOL, f"layer {i}")
        np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=1e-4, atol=1e-4)
    assert validations["attention"] == 1  # the runs validated nothing


@pytest.mark.gpu
def test_plan_with_other_arrays_is_a_plain_call(rng, validations):
    """Arrays unlike the plan's run as attention() would: right, or refused."""
    import cupy

    host = make_varlen(rng, [5, 30], [5, 90], heads=4, kv_heads=2)
    d = _device(host)
    plan = cupaged.AttentionPlan(d["query"], d["key_cache"], d["value_cache"],
                                 d["block_tables"], d["seq_lens"], d["query_start_loc"])
    ref = reference.attention(**host)
    got = plan.run(d["query"], d["key_cache"], d["value_cache"],
                   out=cupy.empty_like(d["query"]))  # planned without out
    assert_close(cupy.asnumpy(got), ref, TOL)
    five = cupy.concatenate([d["query"], d["query"][:, :1]], axis=1)  # 5 heads over 2
    with pytest.raises(ValueError, match="num_heads"):
        plan.run(five, d["key_cache"], d["value_cache"])
    buf = cupy.concatenate([d["query"][:1], d["query"]])
    plan2 = cupaged.AttentionPlan(buf[1:], d["key_cache"], d["value_cache"], d["block_tables"],
                                  d["seq_lens"], d["query_start_loc"], out=buf[:-1].copy())
    with pytest.raises(ValueError, match="overlap"):
        plan2.run(buf[1:], d["key_cache"], d["value_cache"], out=buf[:-1])


@pytest.mark.gpu
def test_plan_runs_in_a_cuda_graph(rng):
    """With out given a run allocates nothing: capture two layers, change the data, replay."""
    import cupy

    layers = _layers(rng, 2, [1, 1, 1, 1], [70, 1, 300, 16], heads=8, kv_heads=2)
    devs = [_device(h) for h in layers]
    outs = [cupy.full(h["query"].shape, np.nan, np.float16) for h in layers]
    d0 = devs[0]
    plan = cupaged.AttentionPlan(d0["query"], d0["key_cache"], d0["value_cache"],
                                 d0["block_tables"], d0["seq_lens"], out=outs[0],
                                 workspace=cupaged.DecodeWorkspace(4, 8, 64))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for d, o in zip(devs, outs):
            plan.run(d["query"], d["key_cache"], d["value_cache"], out=o)
        graph = stream.end_capture()
    for h, d in zip(layers, devs):  # new queries, after the capture
        h["query"] = testing.random_normal(h["query"].shape, np.float16, rng)
        d["query"][...] = cupy.asarray(h["query"])
    cupy.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    for i, (h, o) in enumerate(zip(layers, outs)):
        host = {**h, "query_start_loc": None}
        assert_close(cupy.asnumpy(o), reference.attention(**host), TOL, f"layer {i}")


@pytest.mark.gpu
def test_plan_with_torch_tensors(rng, validations):
    torch = pytest.importorskip("torch")
    layers = _layers(rng, 2, [3, 1], [40, 9], heads=8, kv_heads=2)
    devs = [{k: (None if v is None else torch.from_numpy(v).cuda()) for k, v in h.items()}
            for h in layers]
    d0 = devs[0]
    plan = cupaged.AttentionPlan(d0["query"], d0["key_cache"], d0["value_cache"],
                                 d0["block_tables"], d0["seq_lens"], d0["query_start_loc"])
    for i, (h, d) in enumerate(zip(layers, devs)):
        got = plan.run(d["query"], d["key_cache"], d["value_cache"])
        assert isinstance(got, torch.Tensor)
        assert_close(got.cpu().numpy(), reference.attention(**h), TOL, f"layer {i}")
    assert validations["attention"] == 1


def test_array_scalars_never_match_a_remembered_key():
    """A NumPy array where a number was remembered: compared by type first (an array's ==
    is elementwise), never a match, never an error."""
    k1, _ = _prepared.key("t", (), (), (0.5, "auto"))
    _prepared.remember(k1, "prepared")
    assert _prepared.lookup(k1) == "prepared"
    k2, _ = _prepared.key("t", (), (), (np.array([0.5, 0.5]), "auto"))
    assert _prepared.lookup(k2) is None
    _prepared.clear()


def test_scalars_of_other_types_are_not_keyed():
    """A 0-d tensor as ``scale`` hashes by identity and can change in place: such a scalar
    is validated (read) on every call, never remembered."""

    class Scalar:  # hashable by identity, read with float()
        def __init__(self, v):
            self.v = v

        def __float__(self):
            return self.v

    assert _prepared.key("t", (), (), (Scalar(0.5),))[0] is None
    assert _prepared.key("t", (), (Scalar(0.5),), ())[0] is None  # as a k_scale
    assert _prepared.key("t", (), (), (np.float32(0.5), 3, None))[0] is not None


def test_a_clear_outdates_every_key():
    k1, _ = _prepared.key("t", (), (), (1,))
    _prepared.clear()
    k2, _ = _prepared.key("t", (), (), (1,))
    _prepared.remember(k1, "made before the clear")  # a racing call, late
    assert k1 != k2 and _prepared.lookup(k2) is None
    _prepared.clear()


@pytest.mark.gpu
def test_plan_run_with_one_scale_keeps_the_other(rng):
    """An fp8 layer's own k_scale at run time replaces the plan's k_scale only."""
    import cupy

    from test_fp8 import fp8_problem

    host, scales = fp8_problem(rng, "fp8_e4m3", "host", [3, 1], [40, 70])
    dev = _device(host)
    plan = cupaged.AttentionPlan(dev["query"], dev["key_cache"], dev["value_cache"],
                                 dev["block_tables"], dev["seq_lens"], dev["query_start_loc"],
                                 kv_cache_dtype="fp8_e4m3", **scales)
    k_scale = scales["k_scale"] * 1.5
    got = plan.run(dev["query"], dev["key_cache"], dev["value_cache"], k_scale=k_scale)
    ref = reference.attention(**host, kv_cache_dtype="fp8_e4m3", k_scale=k_scale,
                              v_scale=scales["v_scale"])
    assert_close(cupy.asnumpy(got), ref, testing.TOLERANCE["f16"])


@pytest.mark.gpu
def test_plan_rereads_tables_replaced_in_place(rng):
    """A bound torch table re-pointed in place (set_) between runs is read as it is now."""
    torch = pytest.importorskip("torch")
    h = make_varlen(rng, [2, 1], [40, 90], heads=4, kv_heads=2, stale=None)
    d = {k: (None if v is None else torch.from_numpy(v).cuda()) for k, v in h.items()}
    plan = cupaged.AttentionPlan(d["query"], d["key_cache"], d["value_cache"],
                                 d["block_tables"], d["seq_lens"], d["query_start_loc"])
    # Other blocks of the same cache, in a wider table (a new allocation).
    other, nb = testing.random_block_tables(h["seq_lens"], 16, rng, spare_blocks=2,
                                            extra_columns=2)
    assert nb == h["key_cache"].shape[0]
    d["block_tables"].set_(torch.from_numpy(other).cuda())
    got = plan.run(d["query"], d["key_cache"], d["value_cache"])
    ref = reference.attention(**{**h, "block_tables": other})
    assert_close(got.cpu().numpy(), ref, TOL)


@pytest.mark.gpu
def test_decode_steps_read_the_query_start_loc_they_are_given(rng, validations):
    """One token per sequence (max_query_len=1) runs the decode kernel, which still reads
    query_start_loc: a repeated call with the same metadata and other starts (q_lens
    [1, 2, 0] after [1, 1, 1]) follows the starts, not the host bound."""
    import cupy

    host = make_varlen(rng, [1, 1, 1], [40, 2, 300], heads=8, kv_heads=2)
    dev = _device(host)
    got = cupaged.attention(**dev, max_query_len=1)
    assert_close(cupy.asnumpy(got), reference.attention(**host), TOL)
    other = np.array([0, 1, 3, 3], np.int32)
    got = cupaged.attention(**{**dev, "query_start_loc": cupy.asarray(other)}, max_query_len=1)
    assert_close(cupy.asnumpy(got), reference.attention(**{**host, "query_start_loc": other}),
                 TOL)
    assert validations["attention"] == 1


# ---- mla_attention ------------------------------------------------------------------------------


class MlaLaunched(NamedTuple):
    """One launch of the mla_attention kernel as the fake_mla fixture records it: the
    addresses it reads and writes, the query's and the caches' (latent, rope) parts
    resolved."""

    out: int
    q: tuple
    cache: tuple
    block_tables: int
    seq_lens: int
    query_start_loc: int
    k_scale: tuple  # (device pointer or 0, value)
    vp: bytes  # VariantParams: lse's address packed in
    extra: bytes = b""  # mla_sparse_attention's second cache (b"" for none)
    tma: bytes = b""  # mla_attention_sm90's MlaTma (b"" for none: NO_MLA_TMA or no such
    #                   parameter)


class _Launches(list):
    """fake_mla's record of launches, with ``planned``: each sparse plan's (max_ctx,
    second_cache)."""

    planned: list


@pytest.fixture(params=["", "_sm90"], ids=["mma", "sm90"])
def fake_mla(monkeypatch, validations, fakes_adapt, fake_device, request):
    """mla_attention on the CPU over test_mla_validation's Fake arrays (its fakes_adapt,
    with test_merge's fake_device allocating Fakes): keyed as CuPy arrays are (metadata,
    address modulo 16), planned as one single-pass CTA a sequence of either family's
    kernels (the fixture's parameter) and launched into a record. Returns ``(call,
    launched)``: fakes_adapt's ``call(a, **kw)``; ``launched``: an MlaLaunched a launch."""
    from cupaged import _arrays, _kvquant, planning

    from test_validation import Fake

    real_metas = _prepared.metas

    def metas(arrays):  # a Fake as a CuPy array (_prepared.metas)
        if not any(isinstance(x, Fake) for x in arrays):
            return real_metas(arrays)
        m, ptrs = [], []
        for x in arrays:
            p = 0 if x is None else x.data.ptr
            m.append(None if x is None else (x.shape, x.strides, x.dtype, p & 15,
                                             x.data.device_id))
            ptrs.append(p)
        return tuple(m), ptrs

    monkeypatch.setattr(_prepared, "metas", metas)
    monkeypatch.setattr(_kvquant, "as_device_array", _arrays.as_device_array)  # a device k_scale
    launched = _Launches()
    launched.planned = []  # plan_mla's (max_ctx, second_cache) of each sparse plan
    planned_sparse = [False]

    def kernel(grid, threads, smem, stream, *a):
        # MlaLaunch.run's order: out, 3 partials, split_tiles, row_tiles, q's parts, their 4
        # strides, the caches' parts, their 4 strides, the table, its 5 constants, lengths,
        # starts, 3 scalars, VariantParams.
        # (mla_sparse_attention's: lengths_per, strict and its second cache before
        # VariantParams; mla_attention_sm90's: its tensor maps after it)
        takes_tma = not planned_sparse[0] and request.param == "_sm90"
        if takes_tma:
            a, tma = a[:-1], a[-1]
        assert len(a) == (33 if planned_sparse[0] else 30) and a[1:5] == (0, 0, 0, 0)
        extra = a[-2] if planned_sparse[0] and a[-2] != launch.NO_SPARSE_EXTRA else b""
        launched.append(MlaLaunched(a[0], tuple(a[6:8]), tuple(a[12:14]), a[18], a[24], a[25],
                                    tuple(a[22:24]), a[-1], extra,
                                    tma if takes_tma and tma != launch.NO_MLA_TMA else b""))

    def plan_mla(device, dtype, cache_dtype, rank, rope, block_size, num_seqs, num_rows,
                 num_heads, max_q, max_ctx, workspace_rows=None, sparse=False,
                 second_cache=False):
        planned_sparse[0] = sparse  # the launch of this plan takes the sparse arguments
        if sparse:
            launched.planned.append((max_ctx, second_cache))
        if not (num_seqs and num_rows):
            return None
        name = ("mla_sparse_attention" if sparse else "mla_attention") + request.param
        spec = SimpleNamespace(kernel=name, variant="x" if second_cache else "")
        return SimpleNamespace(kernel=SimpleNamespace(launch=kernel, smem=0, spec=spec),
                               grid=(num_seqs, 1, 1), split_tiles=0, row_tiles=1,
                               combine=None, combine_grid=(), combine_tail=(), partitions=1)

    monkeypatch.setattr(planning, "plan_mla", plan_mla)
    return fakes_adapt, launched


def _moved(a, shift):
    """margs's arrays, each ``shift`` bytes past its BASES address (as Fakes)."""
    from test_mla_validation import adapt, fake

    f = adapt(a)
    moved = {k: (fake(a[k], k, shift) if isinstance(a[k], np.ndarray) else v)
             for k, v in f.items()}
    if isinstance(a["q"], tuple):
        moved["q"] = (fake(a["q"][0], "q", shift), fake(a["q"][1], "q_pe", shift))
    return moved


@pytest.mark.parametrize("q_form", ["combined", "pair"])
@pytest.mark.parametrize("cache_form", ["combined", "pair"])
@pytest.mark.parametrize("given", ["out+lse", "new"])
def test_repeated_mla_calls_are_prepared_with_their_own_addresses(fake_mla, validations,
                                                                  q_form, cache_form, given):
    """Every call's own arrays reach the launch (a single q's and a combined cache's rope
    part RANK elements into it), its outputs allocated anew when not given; one validation."""
    from test_mla_validation import BASES, margs

    call, launched = fake_mla
    a = margs(q_form, cache_form, out=given != "new", lse=given != "new")
    for n, shift in enumerate((0, 1 << 16, 3 << 16, 0)):
        got = call(_moved(a, shift), scale=0.1, return_lse=True)
        out, lse = got
        at = {k: v + shift for k, v in BASES.items()}
        rope = 2 * 512  # bytes into a combined array's rows
        assert launched[-1] == MlaLaunched(
            out.data.ptr,
            (at["q"], at["q_pe"] if q_form == "pair" else at["q"] + rope),
            (at["kv_cache"], at["k_pe_cache"] if cache_form == "pair" else at["kv_cache"] + rope),
            at["block_tables"], at["seq_lens"], at["query_start_loc"], (0, 1.0),
            _variants.PLAIN.pack(lse.data.ptr)), f"call {n}"
        if given == "new":
            assert out.shape == (5, 16, 512) and lse.shape == (5, 16)
        else:
            assert (out.data.ptr, lse.data.ptr) == (at["out"], at["lse"])
    assert len({x.out for x in launched}) == (4 if given == "new" else 3)
    assert validations["mla"] == 1


@pytest.mark.parametrize("table", ["block_tables", "seq_lens", "query_start_loc"])
def test_a_repeated_mla_call_with_out_over_a_table_is_refused(fake_mla, validations, table):
    """Remembered at addresses apart, a call whose out now lies over a table the kernels
    read is validated again and refused, as its first call would have been."""
    from test_mla_validation import fake, margs

    call, launched = fake_mla
    a = margs(out=True, lse=True)
    call(_moved(a, 0), scale=0.1)
    n = len(launched)
    moved = _moved(a, 0)
    moved["out"] = fake(a["out"], table)  # at the table's address
    with pytest.raises(ValueError, match=f"{table} and out overlap in memory"):
        call(moved, scale=0.1)
    assert len(launched) == n and validations["mla"] == 2


@pytest.mark.parametrize("bs", [8, 16, 32, 64, 256])
@pytest.mark.parametrize("cache_form", ["combined", "pair"])
def test_mla_tensor_maps_made_once_an_address(fake_mla, monkeypatch, request, cache_form, bs):
    """The wgmma paged kernel's MlaTma: where its producer copies by TMA (a 16-bit cache in
    pages of 16 tokens or more), the latent and rotary parts' maps (dims innermost first,
    the token and block dimensions' strides in bytes, boxes of 64 dims x min(pages, 64)
    tokens x 1 block) made once an address pair and packed with `use` 1; a map the driver
    refuses gives none (zeros), and so do a cache off 128-byte alignment and smaller pages;
    the mma.sync kernel takes none."""
    from cupaged import tensormap
    from test_mla_validation import BASES, margs

    call, launched = fake_mla
    made = []

    def encode(dtype, address, dims, strides, box):
        made.append((dtype, address, dims, strides, box))
        return bytes([len(made)]) * tensormap.SIZE

    monkeypatch.setattr(tensormap, "encode_tiled", encode)
    a = margs(cache=cache_form, bs=bs, nb=7)
    for shift in (0, 1 << 16, 0):
        call(_moved(a, shift), scale=0.1)
    if request.node.callspec.params["fake_mla"] != "_sm90" or bs < 16:
        assert made == [] and {x.tma for x in launched} == {b""}
        return
    row = 2 * (576 if cache_form == "combined" else 512)  # a latent token's bytes
    lat = BASES["kv_cache"]
    rope, rope_row = ((lat + 2 * 512, row) if cache_form == "combined" else
                      (BASES["k_pe_cache"], 2 * 64))
    box = (64, min(bs, 64), 1)
    assert made == [("f16", lat + s, (512, bs, 7), (row, bs * row), box) if i % 2 == 0 else
                    ("f16", rope + s, (64, bs, 7), (rope_row, bs * rope_row), box)
                    for i, s in enumerate((0, 0, 1 << 16, 1 << 16))]
    assert [x.tma for x in launched] == [
        launch.MLA_TMA.pack(bytes([i]) * 128, bytes([i + 1]) * 128, 1) for i in (1, 3, 1)]
    monkeypatch.setattr(tensormap, "encode_tiled", lambda *args: None)
    call(_moved(a, 2 << 16), scale=0.1)
    assert launched[-1].tma == b""
    # a cache 16 bytes off a multiple of 128 (the swizzle's alignment): none, not asked for
    made.clear()
    monkeypatch.setattr(tensormap, "encode_tiled", encode)
    call(_moved(a, (3 << 16) + 16), scale=0.1)
    assert launched[-1].tma == b"" and made == []


def test_mla_keys_the_query_form_and_k_scale(fake_mla, validations):
    """A pair and a single q, a number (by type and value) and a device scalar (by
    address) as k_scale: each its own prepared call. A CPU torch scalar, whose value the
    call reads, is validated on every call, as everything is under CUPAGED_DEBUG."""
    from test_mla_validation import BASES, fake, margs

    call, launched = fake_mla
    fp8 = dict(kv_cache=np.zeros((10, 16, 576), np.uint8))
    single, pair = {**margs(), **fp8}, {**margs("pair"), **fp8}
    dev_scale = fake(np.zeros(1, np.float32), "lse", 1 << 20)
    other_scale = fake(np.zeros(1, np.float32), "lse", 2 << 20)
    calls = [(single, 0.5), (pair, 0.5), (single, np.float32(0.5)), (single, 0.25),
             (single, dev_scale), (single, other_scale)]
    for a, k_scale in calls + calls:
        call(a, scale=0.1, kv_cache_dtype="fp8", k_scale=k_scale)
    assert validations["mla"] == len(calls)
    assert [x.k_scale for x in launched] == 2 * [(0, 0.5), (0, 0.5), (0, 0.5), (0, 0.25),
                                                 (dev_scale.data.ptr, 1.0),
                                                 (other_scale.data.ptr, 1.0)]
    assert [x.q[1] - x.q[0] for x in launched[:2]] == [1024, BASES["q_pe"] - BASES["q"]]
    torch = pytest.importorskip("torch")
    for _ in range(2):
        call(single, scale=0.1, kv_cache_dtype="fp8", k_scale=torch.tensor(0.5))
    assert validations["mla"] == len(calls) + 2


def test_mla_under_debug_validates_every_call(fake_mla, validations, monkeypatch):
    from test_mla_validation import margs

    call, _ = fake_mla
    checked = []
    monkeypatch.setattr(validation, "check_tables_on_device", lambda *a: checked.append(a))
    monkeypatch.setattr(validation, "check_queries_on_device", lambda *a: checked.append(a))
    monkeypatch.setattr(_checks, "DEBUG", True)
    for _ in range(3):
        call(margs(), scale=0.1)
    assert validations["mla"] == 3 and len(checked) == 6


@pytest.mark.parametrize("written, read, q_form, cache_form", [
    ("out", "kv_cache", "combined", "combined"),
    ("out", "q", "combined", "combined"),
    ("out", "q_pe", "pair", "pair"),
    ("out", "k_pe_cache", "pair", "pair"),
    ("lse", "kv_cache", "pair", "combined"),
    ("lse", "q", "combined", "pair"),
    ("lse", "out", "combined", "combined"),
])
def test_a_repeated_mla_call_with_overlapping_outputs_is_refused(fake_mla, validations,
                                                                 written, read, q_form,
                                                                 cache_form):
    """Metadata alike, addresses overlapping: refused as validation refuses a first call,
    with the same error; a later call whose arrays are apart again is prepared."""
    from test_mla_validation import BASES, fake, margs

    call, launched = fake_mla
    a = margs(q_form, cache_form, out=True, lse=True)
    call(a, scale=0.1)
    assert validations["mla"] == 1
    # The written array 16 bytes into the other's last row: the same 16-byte alignment.
    shape = (a["out"] if written == "out" else a["lse"]).shape
    host = np.zeros(shape, np.float16 if written == "out" else np.float32)
    other = a["q"][read == "q_pe"] if read in ("q", "q_pe") and q_form == "pair" else a[read]
    at = BASES[read] + other.nbytes - 16 - BASES[written]
    bad = {**_moved(a, 0), written: fake(host, written, at)}
    with pytest.raises(ValueError, match=f"overlap in memory") as repeated:
        call(bad, scale=0.1)
    assert validations["mla"] == 2  # the prepared call's check sent it to validation
    _prepared.clear()
    with pytest.raises(ValueError) as first:
        call(bad, scale=0.1)
    assert str(repeated.value) == str(first.value)
    names = {written, read}
    assert all(f" {n} " in f" {str(first.value)} " for n in names)
    call(a, scale=0.1)
    n = validations["mla"]
    call(a, scale=0.1)
    assert validations["mla"] == n and len(launched) == 3


def test_disjoint_spans_and_any_overlap():
    from test_validation import Fake

    out = Fake(np.zeros((2, 4), np.float32), ptr=1 << 20)  # 32 bytes
    q = Fake(np.zeros((4, 4), np.float16), ptr=2 << 20)  # 32 bytes
    empty = Fake(np.zeros((0, 4), np.float16), ptr=3 << 20)
    pairs = _prepared.disjoint_spans(((2, out), (3, None)), ((0, q), (1, empty)))
    assert pairs == ((2, 0, 32, 0, 0, 32),)
    assert not _prepared.any_overlap(pairs, [1000, 0, 1032, 0])  # out just past q
    assert not _prepared.any_overlap(pairs, [1000, 0, 968, 0])  # out just before q
    assert _prepared.any_overlap(pairs, [1000, 0, 1031, 0])
    assert _prepared.any_overlap(pairs, [1000, 0, 969, 0])
    assert not _prepared.any_overlap((), [0, 0, 0, 0])


def _views(layout):
    """DeviceViews at given addresses: {name: (shape, dtype, ptr)}."""
    from cupaged import _arrays

    return {n: _arrays.DeviceView(shape, dt, ptr, 0) for n, (shape, dt, ptr) in layout.items()}


_MiB = 1 << 20
# A decode call's arrays (4 sequences, 8 heads over 2, head 64, 10 blocks of 16, vLLM's
# layout), each 1 MiB apart: out and lse may then be placed over any of them.
_DECODE = dict(query=((4, 8, 64), np.float16, 1 * _MiB),
               key_cache=((10, 2, 8, 16, 8), np.float16, 2 * _MiB),
               value_cache=((10, 2, 64, 16), np.float16, 3 * _MiB),
               block_tables=((4, 4), np.int32, 4 * _MiB),
               context_lens=((4,), np.int32, 5 * _MiB),
               alibi_slopes=((8,), np.float32, 6 * _MiB),
               sinks=((8,), np.float32, 7 * _MiB))


def _apart(out_at=None, lse_at=None):
    """validation.outputs_apart for _DECODE's arrays with out and lse at these addresses
    (None: not given)."""
    v = _views(_DECODE)
    p = validation.validate_decode(v["query"], v["key_cache"], v["value_cache"],
                                   v["block_tables"], v["context_lens"], v["alibi_slopes"],
                                   None)
    variants = _variants.Variants("", sinks=v["sinks"])
    o = None if out_at is None else _views({"o": ((4, 8, 64), np.float16, out_at)})["o"]
    lse = None if lse_at is None else _views({"l": ((4, 8), np.float32, lse_at)})["l"]
    read = ((1, "key_cache", v["key_cache"]), (2, "value_cache", v["value_cache"]),
            (3, "block_tables", v["block_tables"]), (4, "context_lens", v["context_lens"]),
            (None, "alibi_slopes", v["alibi_slopes"]))
    return validation.outputs_apart(v["query"], o, lse, read, variants, p)


@pytest.mark.parametrize("written", ["out", "lse"])
@pytest.mark.parametrize("over", ["key_cache", "value_cache", "block_tables", "context_lens",
                                  "alibi_slopes", "sinks"])
def test_outputs_over_what_a_call_reads_are_refused_by_name(written, over):
    """out or lse over any array the call reads (the last bytes of it): a ValueError naming
    both, where the kernels would have written into their own inputs."""
    shape, dt, ptr = _DECODE[over]
    end = ptr + int(np.prod(shape)) * np.dtype(dt).itemsize
    at = dict(out_at=10 * _MiB, lse_at=11 * _MiB)
    at[f"{written}_at"] = end - 4  # its first bytes over the array's last four
    with pytest.raises(ValueError, match=f"{written} and {over} overlap in memory"):
        _apart(**at)
    at[f"{written}_at"] = end  # just past it: apart
    _apart(**at)


def test_lse_over_the_query_or_out_is_refused():
    with pytest.raises(ValueError, match="lse and query overlap in memory"):
        _apart(out_at=10 * _MiB, lse_at=1 * _MiB)
    with pytest.raises(ValueError, match="out and lse overlap in memory"):
        _apart(out_at=10 * _MiB, lse_at=10 * _MiB + 64)


def test_v2_scratch_over_what_the_call_reads_is_refused_then_and_after():
    """paged_attention_v2's buffers, keyed at their addresses: over a cache refused at
    validation, and the pairs that repeat the check at each call cover the per-call arrays
    (a pair of two keyed arrays is validation's alone)."""
    from cupaged import _arrays

    v = _views(_DECODE)
    p = validation.validate_decode(v["query"], v["key_cache"], v["value_cache"],
                                   v["block_tables"], v["context_lens"], None, None)
    read = ((1, "key_cache", v["key_cache"]), (2, "value_cache", v["value_cache"]),
            (3, "block_tables", v["block_tables"]), (4, "context_lens", v["context_lens"]),
            (None, "alibi_slopes", v["alibi_slopes"]))
    sums = _arrays.DeviceView((64,), np.float32, 3 * _MiB + 8, 0)  # inside the value cache
    with pytest.raises(ValueError, match="exp_sums and value_cache overlap in memory"):
        validation.outputs_apart(v["query"], None, None, read, _variants.PLAIN, p,
                                 (("exp_sums", sums),))
    with pytest.raises(ValueError, match="exp_sums and alibi_slopes overlap in memory"):
        validation.outputs_apart(v["query"], None, None, read, _variants.PLAIN, p,
                                 (("exp_sums", sums.at(6 * _MiB)),))
    pairs = validation.outputs_apart(v["query"], None, None, read, _variants.PLAIN, p,
                                     (("exp_sums", sums.at(12 * _MiB)),))
    assert pairs and all(i is None and j in (1, 2, 3, 4) for i, _, _, j, _, _ in pairs)
    prep = SimpleNamespace(q_span=(), out_bytes=0, in_place=False, disjoint=pairs)
    base = [1 * _MiB, 2 * _MiB, 3 * _MiB, 4 * _MiB, 5 * _MiB, 0, 0, 0]
    assert not _prepared.clashes(prep, base)
    assert _prepared.clashes(prep, [1 * _MiB, 12 * _MiB + 64, *base[2:]])  # a cache moved over it


def test_a_prepared_call_repeats_the_output_checks_at_each_calls_addresses():
    """The pairs outputs_apart returns, checked by _prepared.clashes at another call's
    addresses: out or lse moved over a cache, a table, a side array (keyed at its
    address) or each other is caught; apart, or out exactly over the query, is not."""
    pairs = _apart(out_at=10 * _MiB, lse_at=11 * _MiB)
    prep = SimpleNamespace(q_span=(0, 4 * 8 * 64 * 2), out_bytes=4 * 8 * 64 * 2, in_place=True,
                           disjoint=pairs)
    base = [1 * _MiB, 2 * _MiB, 3 * _MiB, 4 * _MiB, 5 * _MiB, 0, 10 * _MiB, 11 * _MiB]

    def at(**moved):
        ptrs = list(base)
        for i, ptr in moved.items():
            ptrs[int(i[1:])] = ptr
        return _prepared.clashes(prep, ptrs)

    assert not at()
    assert not at(i6=1 * _MiB)  # out is the query itself: written in place
    assert at(i6=1 * _MiB + 128)  # out partly over the query
    assert at(i6=3 * _MiB + 1000)  # out over the value cache
    assert at(i7=4 * _MiB)  # lse over the block tables
    assert at(i7=7 * _MiB - 16)  # lse over the sinks (at their keyed address)
    assert at(i7=6 * _MiB + 16)  # lse over the ALiBi slopes
    assert at(i7=1 * _MiB)  # lse over the query
    assert at(i7=10 * _MiB + 64)  # lse over out
    assert not at(i1=20 * _MiB, i2=30 * _MiB)  # the caches elsewhere, still apart


def test_an_empty_mla_batch_launches_nothing_repeatedly(fake_mla, validations):
    from test_mla_validation import margs

    call, launched = fake_mla
    a = margs(rows=0, seqs=0)
    for _ in range(2):
        out, lse = call(a, scale=0.1, return_lse=True)
        assert out.shape == (0, 16, 512) and lse.shape == (0, 16)
    assert launched == [] and validations["mla"] == 1


# On the GPU.


def _mla_forms(host, q_form, cache_form):
    """mla_attention's arguments for a test_mla host problem, the query and the cache as
    one array each or as pairs (separate arrays)."""
    import cupy

    from test_mla import RANK

    d = {k: cupy.asarray(v) for k, v in host.items()}
    if q_form == "pair":
        d["q"] = (cupy.ascontiguousarray(d["q"][..., :RANK]),
                  cupy.ascontiguousarray(d["q"][..., RANK:]))
    if cache_form == "pair":
        c = d["kv_cache"]
        d["kv_cache"] = cupy.ascontiguousarray(c[..., :RANK])
        d["k_pe_cache"] = cupy.ascontiguousarray(c[..., RANK:])
    return d


@pytest.mark.gpu
@pytest.mark.parametrize("q_form", ["combined", "pair"])
@pytest.mark.parametrize("cache_form", ["combined", "pair"])
@pytest.mark.parametrize("given_out", [True, False], ids=["out", "new-out"])
def test_repeated_mla_reads_each_calls_arrays(rng, validations, q_form, cache_form, given_out):
    import cupy

    from test_mla import SCALE, make_mla, ref_of

    hosts = [make_mla(rng, [1, 3, 0, 2], [40, 300, 7, 2], heads=16) for _ in range(3)]
    devs = [_mla_forms(h, q_form, cache_form) for h in hosts]  # all alive: apart
    for i, (h, d) in enumerate(zip(hosts + hosts[:1], devs + devs[:1])):
        dq = d["q"][0] if q_form == "pair" else d["q"]
        out = cupy.full((6, 16, 512), np.nan, dq.dtype) if given_out else None
        got, lse = cupaged.mla_attention(**d, scale=SCALE, out=out, return_lse=True)
        assert out is None or got is out
        ref, ref_lse = ref_of(h, return_lse=True)
        assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                     f"call {i}")
        np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=0, atol=2e-3)
    assert validations["mla"] == 1


@pytest.mark.gpu
def test_repeated_mla_overlap_is_checked_on_every_call(rng, validations):
    """out inside kv_cache, with a passing call's metadata: refused as a first call is."""
    import cupy

    from test_mla import SCALE, device, make_mla, ref_of

    host = make_mla(rng, [1, 1], [40, 70], heads=16)
    d = device(host)
    cupaged.mla_attention(**d, scale=SCALE, out=cupy.empty((2, 16, 512), d["q"].dtype))
    inside = d["kv_cache"].reshape(-1)[8 * 1000:8 * 1000 + 2 * 16 * 512].reshape(2, 16, 512)
    with pytest.raises(ValueError, match="kv_cache and out overlap in memory"):
        cupaged.mla_attention(**d, scale=SCALE, out=inside)
    assert validations["mla"] == 2
    got = cupaged.mla_attention(**d, scale=SCALE, out=cupy.empty((2, 16, 512), d["q"].dtype))
    assert_close(cupy.asnumpy(got).astype(np.float64), ref_of(host), testing.TOLERANCE["bf16"])
    assert validations["mla"] == 2


@pytest.mark.gpu
def test_repeated_mla_over_an_fp8_cache_with_a_device_scale(rng, validations):
    """A float32 device scalar k_scale is embedded by address: repeated calls read each
    call's query and the scalar's value at the time."""
    import cupy

    from cupaged import reference
    from test_mla import SCALE, make_mla, to_fp8

    scale = 0.0371
    hosts = [make_mla(rng, [1, 2], [90, 300], heads=16) for _ in range(2)]
    k_scale = cupy.asarray([scale], np.float32)
    for i, value in enumerate((scale, scale, 2 * scale)):
        h = hosts[i % 2]
        q8 = to_fp8(h["kv_cache"], "fp8_e4m3", scale)
        k_scale.fill(value)
        d = {k: cupy.asarray(v) for k, v in {**h, "kv_cache": q8}.items()}
        got = cupaged.mla_attention(**d, scale=SCALE, kv_cache_dtype="fp8_e4m3",
                                    k_scale=k_scale)
        ref = reference.mla_attention(h["q"], q8, h["block_tables"], h["seq_lens"],
                                      h["query_start_loc"], scale=SCALE,
                                      kv_cache_dtype="fp8_e4m3", k_scale=value)
        assert_close(cupy.asnumpy(got).astype(np.float64), ref, testing.TOLERANCE["bf16"],
                     f"call {i}")
    assert validations["mla"] == 1


@pytest.mark.gpu
def test_repeated_mla_with_workspace_out_and_lse_allocates_nothing(rng, validations):
    """A split call with a workspace, out and lse given: a repeated call (other arrays)
    allocates nothing, and reads its own arrays."""
    import cupy

    from cupaged import planning
    from test_mla import SCALE, make_mla, ref_of

    hosts = [make_mla(rng, [1, 3, 2], [700, 260, 1500], heads=16, block_size=64)
             for _ in range(2)]
    devs = [{k: cupy.asarray(v) for k, v in h.items()} for h in hosts]
    outs = [cupy.full((6, 16, 512), np.nan, devs[0]["q"].dtype) for _ in hosts]
    lses = [cupy.full((6, 16), np.nan, np.float32) for _ in hosts]
    ws = cupaged.DecodeWorkspace(6, 16, 512)
    allocs = []

    class Allocations(cupy.cuda.memory_hook.MemoryHook):
        name = "allocations"

        def malloc_preprocess(self, **kw):
            allocs.append(kw)

    planning.set_mla_split(2)
    try:
        kw = dict(scale=SCALE, workspace=ws, max_query_len=3, max_seq_len=1500)
        cupaged.mla_attention(**devs[0], out=outs[0], lse=lses[0], **kw)
        with Allocations():
            cupaged.mla_attention(**devs[1], out=outs[1], lse=lses[1], **kw)
    finally:
        planning.set_mla_split(None)
    assert allocs == [] and validations["mla"] == 1
    for h, o, lse in zip(hosts, outs, lses):
        ref, ref_lse = ref_of(h, return_lse=True)
        assert_close(cupy.asnumpy(o).astype(np.float64), ref, testing.TOLERANCE["bf16"])
        np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=0, atol=2e-3)


@pytest.mark.gpu
def test_repeated_mla_torch_calls(rng, validations):
    torch = pytest.importorskip("torch")
    from test_mla import SCALE, make_mla, ref_of

    for i in range(3):
        h = make_mla(rng, [1, 1, 1], [33, 2, 129], heads=16, dtype="f16")
        d = {k: torch.from_numpy(v).cuda() for k, v in h.items() if k != "query_start_loc"}
        got = cupaged.mla_attention(**d, scale=SCALE)
        assert isinstance(got, torch.Tensor)
        assert_close(got.cpu().numpy().astype(np.float64), ref_of(h, decode=True),
                     testing.TOLERANCE["f16"], f"call {i}")
    assert validations["mla"] == 1


# ---- sparse_mla_attention --------------------------------------------------------------------------


def _sparse_call(monkeypatch):
    """sparse_mla_attention over Fake arrays (with fake_mla's keying, plan and launch
    record): ``call(shift, **kw)`` with every array ``shift`` bytes past its own base."""
    from cupaged import _arrays, sparse_mla

    from test_validation import Fake

    real = _arrays.as_device_array
    one = lambda x, name: x if isinstance(x, Fake) else real(x, name)  # noqa: E731
    monkeypatch.setattr(sparse_mla, "as_device_array", one)
    monkeypatch.setattr(_arrays, "as_device_array", one)
    shapes = dict(q=((2, 3, 16, 576), np.float16), kv_cache=((10, 64, 1, 576), np.float16),
                  indices=((2, 3, 32), np.int32), topk_length=((2,), np.int32),
                  out=((2, 3, 16, 512), np.float16), lse=((2, 3, 16), np.float32))
    bases = {k: (i + 1) << 28 for i, k in enumerate(shapes)}

    def call(shift=0, **kw):
        f = {k: Fake(np.zeros(*shapes[k]), ptr=bases[k] + shift) for k in shapes}
        f.update(kw.pop("arrays", {}))
        return f, sparse_mla.sparse_mla_attention(f["q"], f["kv_cache"], f["indices"],
                                                  topk_length=f["topk_length"], out=f["out"],
                                                  lse=f["lse"], **kw)
    return call


def test_repeated_sparse_mla_calls_are_prepared_with_their_own_addresses(fake_mla, validations,
                                                                         monkeypatch):
    """Each call's own arrays reach the launch (q's and the cache's rotary parts 512
    elements into their rows, the indices as the table, topk_length as the lengths, the
    lse in VariantParams); one validation for calls of the same metadata."""
    call = _sparse_call(monkeypatch)
    _, launched = fake_mla
    for n, shift in enumerate((0, 1 << 16, 3 << 16, 0)):
        f, (out, lse) = call(shift, scale=0.1)
        p = {k: v.data.ptr for k, v in f.items()}
        assert launched[-1] == MlaLaunched(p["out"], (p["q"], p["q"] + 1024),
                                           (p["kv_cache"], p["kv_cache"] + 1024), p["indices"],
                                           p["topk_length"], 0, (0, 1.0),
                                           _variants.PLAIN.pack(p["lse"])), f"call {n}"
        assert (out.data.ptr, lse.data.ptr) == (p["out"], p["lse"])
    assert validations["mla"] == 1


def test_a_second_cache_reaches_the_launch_at_each_call(fake_mla, validations, monkeypatch):
    """A sparse call with a second cache: its addresses (its rotary part 512 elements into
    its rows, like the first cache's), strides, indices' row, topk, slots and page shift
    packed into the launch at each call, the plan made for both topks on the kernel that
    reads it; a call without one, of otherwise the same arrays, is its own prepared call."""
    from test_validation import Fake

    call = _sparse_call(monkeypatch)
    _, launched = fake_mla
    for n, shift in enumerate((0, 1 << 16, 0)):
        e = dict(extra_kv_cache=Fake(np.zeros((7, 16, 1, 576), np.float16),
                                     ptr=(7 << 28) + shift),
                 extra_indices=Fake(np.zeros((2, 3, 40), np.int32), ptr=(8 << 28) + shift),
                 extra_topk_length=Fake(np.zeros(2, np.int32), ptr=(9 << 28) + shift))
        f, _ = call(shift, scale=0.1, **e)
        ekv = (7 << 28) + shift
        assert launched[-1].extra == launch.SPARSE_EXTRA.pack(
            ekv, ekv + 1024, (8 << 28) + shift, (9 << 28) + shift, 16 * 576, 576, 40, 40,
            7 * 16, 4), f"call {n}"
        assert launched[-1].cache == (f["kv_cache"].data.ptr, f["kv_cache"].data.ptr + 1024)
    assert validations["mla"] == 1 and launched.planned == [(32 + 40, True)]
    call(0, scale=0.1)
    assert launched[-1].extra == b"" and validations["mla"] == 2
    assert launched.planned[-1] == (32, False)
    # indices a slice of wider rows (their row stride not their topk), and an empty second
    # cache (address 0: its slots none, so no entry of it counts)
    wide = np.zeros((2, 3, 48), np.int32)[:, :, :40]
    call(0, scale=0.1, extra_kv_cache=Fake(np.zeros((0, 16, 1, 576), np.float16), ptr=0),
         extra_indices=Fake(wide, ptr=8 << 28))
    # (no block: its strides unused, packed as 0)
    assert launched[-1].extra == launch.SPARSE_EXTRA.pack(0, 1024, 8 << 28, 0, 0, 0, 48, 40, 0,
                                                         4)


def test_sparse_mla_keys_the_sink_and_the_scale_and_checks_overlap_each_call(
        fake_mla, validations, monkeypatch):
    """attn_sink by address (its pointer is packed into the launch), scale by type and value:
    each its own prepared call; an out that overlaps q is refused after a hit too."""
    from test_validation import Fake

    call = _sparse_call(monkeypatch)
    _, launched = fake_mla
    sinks = [Fake(np.zeros(16, np.float32), ptr=(9 << 28) + i * (1 << 20)) for i in range(2)]
    calls = [dict(scale=0.1), dict(scale=np.float32(0.1)), dict(scale=0.2),
             dict(scale=0.1, attn_sink=sinks[0]), dict(scale=0.1, attn_sink=sinks[1])]
    for kw in calls + calls:
        call(**kw)
    assert validations["mla"] == len(calls)
    packed = [_variants.Variants("", sinks=s, lse_keys=True).pack(6 << 28) for s in sinks]  # lse: the 6th array
    assert [x.vp for x in launched[3:5]] == packed and launched[8].vp == packed[0]
    assert launched[0].vp == _variants.PLAIN.pack(6 << 28) == launched[2].vp
    f, _ = call(scale=0.1)
    on_q = Fake(np.zeros((2, 3, 16, 512), np.float16), ptr=f["q"].data.ptr)
    with pytest.raises(ValueError, match="q and out overlap in memory"):  # a hit's key
        call(scale=0.1, arrays=dict(out=on_q))

