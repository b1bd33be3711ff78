"""cupaged.jax: cupaged's entry points as JAX operations under jax.jit.

The CPU tests trace and lower on any JAX (the shapes, the aliasing, the trace-time
errors); the ``gpu`` tests run them on a GPU against the eager calls. Both skip where JAX
is not importable (CI's venv has none). To run them::

    PYTHONPATH=/path/to/jax-site:. python -m pytest -q tests/test_jax.py

With JAX's CUDA plugin on a GPU machine the ``gpu`` tests run too; the command-buffer
test starts a subprocess with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,
CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1`` (XLA reads its flags
once, when the backend starts; XLA's default command-buffer types include CUSTOM_CALL but
not WHILE, and its default minimum graph size is 5).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import cupaged  # noqa: E402
import cupaged.jax as cj  # noqa: E402
from conftest import assert_close  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F16, F32, I32 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32
NB, BS, HK, HD, H = 16, 16, 2, 128, 8  # blocks, block size, KV heads, head size, heads


def _attention_shapes(seqs=4, total_q=4, dtype=BF16, layout="NHD"):
    q = S((total_q, H, HD), dtype)
    if layout == "NHD":
        kc = S((NB, BS, HK, HD), dtype)
        vc = kc
    else:  # vllm
        x = 16 // np.dtype(dtype).itemsize
        kc = S((NB, HK, HD // x, BS, x), dtype)
        vc = S((NB, HK, HD, BS), dtype)
    return q, kc, vc, S((seqs, 4), I32), S((seqs,), I32)


# ---- CPU: import, shapes, aliasing, errors ---------------------------------------------------


def test_import_cupaged_does_not_import_jax():
    code = ("import sys, cupaged; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attention_declares_its_outputs():
    q, kc, vc, bt, sl = _attention_shapes()
    out = jax.eval_shape(lambda *a: cj.attention(*a, max_seq_len=64), q, kc, vc, bt, sl)
    assert out == S(q.shape, q.dtype)
    out, lse = jax.eval_shape(
        lambda *a: cj.attention(*a, max_query_len=3, max_seq_len=64, return_lse=True),
        *_attention_shapes(seqs=2, total_q=5), S((3,), I32))
    assert out == S((5, H, HD), BF16) and lse == S((5, H), F32)
    q, kc, vc, bt, sl = _attention_shapes(dtype=F16, layout="vllm")
    out = jax.eval_shape(lambda *a: cj.attention(*a, kv_layout="vllm", max_seq_len=64,
                                                 alibi_slopes=np.linspace(0, 1, H),
                                                 sinks=[0.5] * H, window=32,
                                                 logits_soft_cap=30.0),
                         q, kc, vc, bt, sl)
    assert out == S(q.shape, F16)


def test_mla_declares_its_outputs():
    bt, sl, qsl = S((2, 4), I32), S((2,), I32), S((3,), I32)
    q, kv = S((6, 16, 576), BF16), S((NB, BS, 576), BF16)
    out = jax.eval_shape(lambda *a: cj.mla_attention(*a, scale=0.1, max_query_len=3,
                                                     max_seq_len=64), q, kv, bt, sl, qsl)
    assert out == S((6, 16, 512), BF16)
    pair = (S((2, 16, 512), BF16), S((2, 16, 64), BF16))
    out, lse = jax.eval_shape(
        lambda qn, qp, kv, pe, bt, sl: cj.mla_attention(
            (qn, qp), kv, bt, sl, k_pe_cache=pe, scale=0.1, max_seq_len=64, return_lse=True),
        *pair, S((NB, BS, 512), BF16), S((NB, BS, 64), BF16), bt, sl)
    assert out == S((2, 16, 512), BF16) and lse == S((2, 16), F32)


def test_cache_writes_and_merge_declare_their_outputs():
    k, kc = S((4, HK, HD), BF16), S((NB, BS, HK, HD), BF16)
    got = jax.eval_shape(lambda *a: cj.reshape_and_cache(*a, kv_layout="NHD"),
                         k, k, kc, kc, S((4,), I32))
    assert got == (kc, kc)
    kv, sm = S((NB, BS, 576), BF16), S((3,), jnp.int64 if jax.config.x64_enabled else I32)
    got = jax.eval_shape(cj.concat_and_cache_mla, S((3, 512), BF16), S((3, 64), BF16), kv, sm)
    assert got == kv
    pe = S((NB, BS, 64), BF16)
    got = jax.eval_shape(lambda a, b, c, s, p: cj.concat_and_cache_mla(a, b, c, s, k_pe_cache=p),
                         S((3, 512), BF16), S((3, 64), BF16), S((NB, BS, 512), BF16), sm, pe)
    assert got == (S((NB, BS, 512), BF16), pe)
    o, lse = S((5, H, HD), F16), S((5, H), F32)
    assert jax.eval_shape(cj.merge_state, o, lse, o, lse) == (o, lse)


def _decode_step(k, v, kc, vc, sm, q, bt, sl):
    kc, vc = cj.reshape_and_cache(k, v, kc, vc, sm, kv_layout="NHD")
    return cj.attention(q, kc, vc, bt, sl, max_seq_len=64), kc, vc


def test_donated_caches_alias_the_written_ones():
    """With the caches donated, the jitted step's cache outputs are its cache inputs
    (tf.aliasing_output), and the custom call writes its operands in place
    (output_operand_aliases): no copy of the cache anywhere."""
    q, kc, vc, bt, sl = _attention_shapes()
    k = S((4, HK, HD), BF16)
    args = (k, k, kc, vc, S((4,), I32), q, bt, sl)
    text = jax.jit(_decode_step, donate_argnums=(2, 3)).lower(*args).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert main.count("tf.aliasing_output") == 2
    assert "output_operand_aliases" in text
    assert "xla_buffer_python_" in text
    # Without donation nothing aliases the parameters: XLA copies the caches first.
    text = jax.jit(_decode_step).lower(*args).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "tf.aliasing_output" not in main


def test_a_decode_loop_traces_and_compiles():
    q, kc, vc, bt, sl = _attention_shapes()
    k = S((4, HK, HD), BF16)

    def loop(k, v, kc, vc, sm, q, bt, sl):
        def body(i, c):
            kc, vc, acc = c
            out, kc, vc = _decode_step(k, v, kc, vc, sm + i, q, bt, sl + i)
            return kc, vc, acc + out.astype(F32)
        return jax.lax.fori_loop(0, 3, body, (kc, vc, jnp.zeros(q.shape, F32)))

    jax.jit(loop, donate_argnums=(2, 3)).lower(k, k, kc, vc, S((4,), I32), q, bt, sl).compile()


def _callback_eqns(jaxpr):
    """The buffer_callback equations of a jaxpr, nested ones (the functions' own jit) too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "buffer_callback":
            found.append(eqn)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    found += _callback_eqns(inner)
    return found


@pytest.mark.parametrize("command_buffer", [False, True])
def test_command_buffer_flag_reaches_the_callback(command_buffer):
    q, kc, vc, bt, sl = _attention_shapes()
    o, lse = S((5, H, HD), F16), S((5, H), F32)
    k = S((4, HK, HD), BF16)

    def step(q, kc, vc, bt, sl, k, sm, o, lse):
        kc, vc = cj.reshape_and_cache(k, k, kc, vc, sm, kv_layout="NHD",
                                      command_buffer=command_buffer)
        out = cj.attention(q, kc, vc, bt, sl, max_seq_len=64, command_buffer=command_buffer)
        merged = cj.merge_state(o, lse, o, lse, command_buffer=command_buffer)
        return out, merged, kc, vc

    eqns = _callback_eqns(jax.make_jaxpr(step)(q, kc, vc, bt, sl, k, S((4,), I32), o,
                                               lse).jaxpr)
    assert len(eqns) == 3
    assert all(e.params["command_buffer_compatible"] is command_buffer for e in eqns)


def test_decode_takes_max_query_len_none():
    """Without query_start_loc, max_query_len=None is the decode case (as for the eager
    call); with query starts it is still required."""
    q, kc, vc, bt, sl = _attention_shapes()
    out = jax.eval_shape(lambda *a: cj.attention(*a, max_query_len=None, max_seq_len=64),
                         q, kc, vc, bt, sl)
    assert out == S(q.shape, q.dtype)
    with pytest.raises(TypeError, match="needs max_query_len"):
        jax.eval_shape(lambda *a: cj.attention(*a, max_query_len=None, max_seq_len=64),
                       q, kc, vc, bt, sl, S((5,), I32))
    mla = (S((2, 16, 576), BF16), S((NB, BS, 576), BF16), S((2, 4), I32), S((2,), I32))
    out = jax.eval_shape(lambda *a: cj.mla_attention(*a, scale=0.1, max_query_len=None,
                                                     max_seq_len=64), *mla)
    assert out == S((2, 16, 512), BF16)
    with pytest.raises(TypeError, match="needs max_query_len"):
        jax.eval_shape(lambda *a: cj.mla_attention(*a, scale=0.1, max_query_len=None,
                                                   max_seq_len=64), *mla, S((3,), I32))


F8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)


@pytest.mark.parametrize("f8", F8, ids=["e4m3", "e5m2"])
def test_float8_arrays_are_refused_at_trace_time(f8):
    """XLA gives a callback no address for float8 buffers: refused when traced, pointing
    to uint8 storage with kv_cache_dtype (which traces)."""
    q, kc, vc, bt, sl = _attention_shapes(dtype=F16)
    hint = r"uint8 storage .*kv_cache_dtype=\"fp8_e4m3\""
    with pytest.raises(TypeError, match="key_cache is float8_e"):
        jax.eval_shape(lambda *a: cj.attention(*a, max_seq_len=64, kv_cache_dtype="fp8_e4m3"),
                       q, S(kc.shape, f8), S(vc.shape, f8), bt, sl)
    with pytest.raises(TypeError, match=hint):
        jax.eval_shape(lambda *a: cj.attention(*a, max_seq_len=64), q, S(kc.shape, f8),
                       S(vc.shape, f8), bt, sl)
    u8 = S(kc.shape, jnp.uint8)
    out = jax.eval_shape(lambda *a: cj.attention(*a, max_seq_len=64, kv_cache_dtype="fp8_e4m3",
                                                 k_scale=0.5, v_scale=2.0), q, u8, u8, bt, sl)
    assert out == S(q.shape, F16)
    k = S((4, HK, HD), F16)
    with pytest.raises(TypeError, match="cupaged.jax.reshape_and_cache: key_cache is float8"):
        jax.eval_shape(lambda *a: cj.reshape_and_cache(*a, "fp8_e4m3", kv_layout="NHD"),
                       k, k, S(kc.shape, f8), S(vc.shape, f8), S((4,), I32))
    got = jax.eval_shape(lambda *a: cj.reshape_and_cache(*a, "fp8_e4m3", kv_layout="NHD"),
                         k, k, u8, u8, S((4,), I32))
    assert got == (u8, u8)
    bt2, sl2 = S((2, 4), I32), S((2,), I32)
    with pytest.raises(TypeError, match="cupaged.jax.mla_attention: kv_cache is float8"):
        jax.eval_shape(lambda *a: cj.mla_attention(*a, scale=0.1, max_seq_len=64),
                       S((2, 16, 576), BF16), S((NB, BS, 576), f8), bt2, sl2)
    with pytest.raises(TypeError, match="cupaged.jax.concat_and_cache_mla: kv_cache is float8"):
        jax.eval_shape(lambda *a: cj.concat_and_cache_mla(*a, "fp8_e4m3"),
                       S((3, 512), BF16), S((3, 64), BF16), S((NB, BS, 576), f8), S((3,), I32))
    with pytest.raises(TypeError, match="out_a is float8"):
        jax.eval_shape(cj.merge_state, S((5, H, HD), f8), S((5, H), F32), S((5, H, HD), f8),
                       S((5, H), F32))


def test_a_workspace_pins_the_plan_to_its_gpu(monkeypatch):
    """With a workspace given, a trace plans for the workspace's GPU alone, even with
    command_buffer=True on a host of several GPUs, and a callback on another GPU is refused
    naming the workspace (its partials could not be written there)."""
    monkeypatch.setattr(cj, "_trace_devices", lambda every_gpu: [0, 1, 2])

    class Workspace:
        device = 2

    made = []
    plans = cj._Plans(lambda device, plan: made.append((device, plan)) or device, True,
                      Workspace())
    assert made == [(2, True)]
    assert plans.get(2, 0) == 2
    with pytest.raises(ValueError, match="the workspace given is on GPU 2, and XLA runs this "
                                         "call on GPU 0"):
        plans.get(0, 0)
    made.clear()
    cj._Plans(lambda device, plan: made.append((device, plan)), True)
    assert made == [(0, True), (1, True), (2, True)]


def test_side_values_and_scales_are_checked_as_eagerly():
    """NaN in sinks or alibi_slopes is refused when traced (it would also miss jit's cache:
    a new trace every call); the sparse formats ignore the scale, as the eager writer does, where
    an fp8 format refuses a zero one; an array of a dtype NumPy does not know (a PRNG key)
    is refused naming its argument."""
    q, kc, vc, bt, sl = _attention_shapes()
    for name in ("sinks", "alibi_slopes"):
        vals = np.zeros(H, np.float32)
        vals[3] = np.nan
        with pytest.raises(ValueError, match=f"{name} holds NaN at 3"):
            jax.eval_shape(lambda *a: cj.attention(*a, max_seq_len=64, **{name: vals}),
                           q, kc, vc, bt, sl)
    for fmt, rank, nbytes in (("v4_fp8", 448, 528), ("v4_fp4", 448, 288)):  # V4's too
        v4 = (S((3, rank), BF16), S((3, 512 - rank), BF16), S((NB, BS, nbytes), jnp.uint8),
              S((3,), I32))
        assert jax.eval_shape(lambda *a: cj.concat_and_cache_mla(*a, fmt, 0.0), *v4) == v4[2]
    args = (S((3, 512), BF16), S((3, 64), BF16), S((NB, BS, 656), jnp.uint8), S((3,), I32))
    got = jax.eval_shape(lambda *a: cj.concat_and_cache_mla(*a, "fp8_ds_mla", 0.0), *args)
    assert got == args[2]
    with pytest.raises(ValueError, match="scale"):
        jax.eval_shape(lambda *a: cj.concat_and_cache_mla(*a, "fp8_e4m3", 0.0),
                       args[0], args[1], S((NB, BS, 576), jnp.uint8), args[3])
    key = jax.eval_shape(lambda: jax.random.key(0))
    with pytest.raises(TypeError, match="cupaged.jax.merge_state: out_a is key<fry>"):
        jax.eval_shape(cj.merge_state, S((5, H, HD), key.dtype), S((5, H), F32),
                       S((5, H, HD), F16), S((5, H), F32))


def test_bounds_are_required_static_ints():
    q, kc, vc, bt, sl = _attention_shapes()
    with pytest.raises(TypeError, match="needs max_seq_len: a static Python int"):
        jax.eval_shape(lambda *a: cj.attention(*a), q, kc, vc, bt, sl)
    with pytest.raises(TypeError, match="needs max_query_len"):
        jax.eval_shape(lambda *a: cj.attention(*a, max_seq_len=64), q, kc, vc, bt, sl,
                       S((5,), I32))
    with pytest.raises(TypeError, match="max_seq_len must be a static Python int"):
        jax.jit(lambda n, *a: cj.attention(*a, max_seq_len=n))(jnp.int32(64), jnp.zeros(
            q.shape, BF16), *(jnp.zeros(x.shape, x.dtype) for x in (kc, vc, bt, sl)))
    with pytest.raises(TypeError, match="needs max_seq_len"):
        jax.eval_shape(lambda q, kv, bt, sl: cj.mla_attention(q, kv, bt, sl, scale=0.1),
                       S((2, 16, 576), BF16), S((NB, BS, 576), BF16), S((2, 4), I32), S((2,), I32))
    with pytest.raises(TypeError, match="scale is required"):
        cj.mla_attention(None, None, None, None, scale=None, max_seq_len=1)
    # Negative bounds are ValueError (as the eager call's), other types TypeError.
    with pytest.raises(ValueError, match="max_seq_len must be >= 0, got -1"):
        cj.attention(None, None, None, None, None, max_seq_len=-1)
    with pytest.raises(ValueError, match="max_query_len must be >= 0"):
        cj.attention(None, None, None, None, None, 1, max_query_len=-3, max_seq_len=8)
    with pytest.raises(TypeError, match="max_seq_len must be a static Python int .*got float"):
        cj.attention(None, None, None, None, None, max_seq_len=8.0)
    with pytest.raises(TypeError, match="max_seq_len must be a static Python int .*got bool"):
        cj.attention(None, None, None, None, None, max_seq_len=True)
    with pytest.raises(TypeError, match="kv_lora_rank must be a static Python int"):
        cj.mla_attention(None, None, None, None, scale=0.1, max_seq_len=8, kv_lora_rank="512")


def test_unhashable_static_arguments_are_named():
    q, kc, vc, bt, sl = _attention_shapes()
    with pytest.raises(TypeError, match=r"cupaged.jax.attention: window=\[3\] is not hashable"):
        jax.eval_shape(lambda *a: cj.attention(*a, max_seq_len=64, window=[3]),
                       q, kc, vc, bt, sl)
    k = S((4, HK, HD), BF16)
    with pytest.raises(TypeError, match="kv_layout=.* is not hashable"):
        jax.eval_shape(lambda *a: cj.reshape_and_cache(*a, kv_layout=["NHD"]),
                       k, k, kc, kc, S((4,), I32))


def test_argument_errors_come_at_trace_time():
    q, kc, vc, bt, sl = _attention_shapes()
    att = lambda **kw: (lambda *a: cj.attention(*a, max_seq_len=64, **kw))  # noqa: E731
    with pytest.raises(TypeError, match="query"):  # int32 queries
        jax.eval_shape(att(), S(q.shape, I32), kc, vc, bt, sl)
    with pytest.raises((TypeError, ValueError), match="dtype"):  # a cache of another dtype
        jax.eval_shape(att(), q, S(kc.shape, F16), S(vc.shape, F16), bt, sl)
    with pytest.raises(ValueError):  # a 4-D cache read as vLLM's 5-D layout
        jax.eval_shape(att(kv_layout="vllm"), q, kc, vc, bt, sl)
    with pytest.raises((TypeError, ValueError), match="block_tables"):
        jax.eval_shape(att(), q, kc, vc, S(bt.shape, F32), sl)
    with pytest.raises(TypeError, match="k_scale must be a Python number"):
        cj.attention(None, None, None, None, None, max_seq_len=1, k_scale=np.ones(1))
    with pytest.raises(TypeError, match="workspace must be a cupaged.DecodeWorkspace"):
        cj.attention(None, None, None, None, None, max_seq_len=1, workspace=object())

    sinks_traced = jax.jit(lambda s, *a: cj.attention(*a, max_seq_len=64, sinks=s))
    with pytest.raises(TypeError, match="sinks is a traced JAX value"):
        sinks_traced.lower(S((H,), F32), q, kc, vc, bt, sl)
    k = S((4, HK, HD), BF16)
    with pytest.raises((TypeError, ValueError), match="key"):  # key of the wrong head count
        jax.eval_shape(lambda *a: cj.reshape_and_cache(*a, kv_layout="NHD"),
                       S((4, HK + 1, HD), BF16), k, kc, kc, S((4,), I32))
    with pytest.raises(TypeError, match="slot_mapping"):
        jax.eval_shape(lambda *a: cj.reshape_and_cache(*a, kv_layout="NHD"),
                       k, k, kc, kc, S((4,), F32))
    o, lse = S((5, H, HD), F16), S((5, H), F32)
    with pytest.raises(ValueError, match="lse_b must be"):
        jax.eval_shape(cj.merge_state, o, lse, o, S((4, H), F32))


def test_debug_override_is_per_thread(monkeypatch):
    """A trace turns CUPAGED_DEBUG's device checks off in its own thread only: an eager
    call on another thread meanwhile keeps them."""
    from cupaged import _checks

    monkeypatch.setattr(_checks, "DEBUG", True)
    inside, release = threading.Event(), threading.Event()
    seen = []

    def trace():
        with _checks.metadata_only():
            seen.append(_checks.debug())
            inside.set()
            release.wait(10)
        seen.append(_checks.debug())

    t = threading.Thread(target=trace)
    t.start()
    assert inside.wait(10)
    assert _checks.debug()  # this thread: still on
    release.set()
    t.join()
    assert seen == [False, True]
    monkeypatch.setattr(_checks, "DEBUG", False)
    with _checks.metadata_only():
        assert not _checks.debug()
    assert not _checks.debug()


def _prep(split=False, rows=0, mla=False, partials=None, counters=0):
    """A stand-in prepared call whose launch splits over ``rows`` partial rows (merged by
    paged_decode with ``counters``) or not."""
    from cupaged import launch

    if mla:
        ln = launch.MlaLaunch(*([None] * 3), 2 if split else 0, *([None] * 10), rows, 512,
                              partials)
    else:
        ln = types.SimpleNamespace(split=split, scratch_rows=rows if split else 0,
                                   partials=partials, counters=counters, combine=None)
    return types.SimpleNamespace(launch=ln)


def test_shared_workspace_only_when_the_plan_splits(monkeypatch):
    """Planned without a workspace first: the shared one is asked for only when the plan
    splits, for the partial rows it needs (not 2 x rows x heads), and then used."""
    asked = []
    monkeypatch.setattr(cj, "_shared_workspace",
                        lambda device, rows, width: asked.append((device, rows, width)) or "ws")
    calls = []

    def prepare(result):
        def f(ws):
            calls.append(ws)
            return result(ws)
        return f

    prep, ws = cj._planned(prepare(lambda ws: _prep()), None, 0, 128)
    assert ws is None and calls == [None] and asked == []
    prep, ws = cj._planned(prepare(lambda ws: _prep(True, 640, partials=ws)), None, 1, 128)
    assert ws == "ws" and calls[1:] == [None, "ws"] and asked == [(1, 640, 128)]
    calls.clear()
    prep, ws = cj._planned(prepare(lambda ws: _prep(mla=True)), None, 0, 512)
    assert ws is None and calls == [None]
    calls.clear()
    prep, ws = cj._planned(prepare(lambda ws: _prep(True, 9000, True, ws)), None, 0, 512)
    assert ws == "ws" and asked[-1] == (0, 9000, 512)
    # The flat split's counters (one a unit) outnumber its rows' half: the workspace,
    # which holds rows // 2, is asked for twice the counters.
    prep, ws = cj._planned(prepare(lambda ws: _prep(True, 792, partials=ws, counters=2048)),
                           None, 0, 128)
    assert ws == "ws" and asked[-1] == (0, 4096, 128)
    mine = object()
    calls.clear()
    prep, ws = cj._planned(prepare(lambda ws: _prep(True, 64, partials=ws)), mine, 0, 128)
    assert ws is mine and calls == [mine]


def test_a_device_without_a_plan_is_refused_while_recording(monkeypatch):
    """A callback on a GPU the trace did not plan for plans on its first run, except
    while XLA records a command buffer (compiling and allocating would break it)."""
    made = []
    monkeypatch.setattr(cj, "_trace_devices", lambda every_gpu: [])  # as without a GPU
    plans = cj._Plans(lambda device, plan: made.append((device, plan)) or device)
    assert made == [(0, False)]  # no GPU to plan for: the checks alone
    monkeypatch.setattr(cj, "_capturing", lambda stream: True)
    with pytest.raises(RuntimeError, match="records a command buffer"):
        plans.get(3, 1234)
    monkeypatch.setattr(cj, "_capturing", lambda stream: False)
    assert plans.get(3, 1234) == 3 and made[-1] == (3, True)
    assert plans.get(3, 1234) == 3 and len(made) == 2  # made once


def test_vmap_is_refused():
    q, kc, vc, bt, sl = (jnp.zeros(s.shape, s.dtype) for s in _attention_shapes())
    f = jax.vmap(lambda q: cj.attention(q, kc, vc, bt, sl, max_seq_len=64))
    with pytest.raises(Exception, match="vmap"):
        jax.eval_shape(f, S((2, *q.shape), q.dtype))


def test_a_cpu_computation_fails_clearly():
    """On a CPU backend the callback gets host buffers: a clear error, not a crash."""
    if jax.default_backend() != "cpu":
        pytest.skip("needs JAX's CPU backend as the default")
    o, lse = jnp.zeros((2, H, HD), F16), jnp.zeros((2, H), F32)
    with pytest.raises(Exception, match="cupaged.jax runs on CUDA devices"):
        jax.block_until_ready(cj.merge_state(o, lse, o, lse))


# ---- GPU: against the eager calls ------------------------------------------------------------


def _jax_gpu():
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")


def _nhd_problem(rng, lens, q_lens=None, dtype=np.float16, heads=H, kv_heads=HK, hd=HD,
                 bs=BS):
    """Random NHD caches, tables and queries (host arrays)."""
    from cupaged import testing

    lens = np.asarray(lens, np.int32)
    bt, nb = testing.random_block_tables(lens, bs, rng, spare_blocks=3)
    kc = testing.random_normal((nb, bs, kv_heads, hd), dtype, rng)
    vc = testing.random_normal((nb, bs, kv_heads, hd), dtype, rng)
    q_lens = np.ones_like(lens) if q_lens is None else np.asarray(q_lens, np.int32)
    q = testing.random_normal((int(q_lens.sum()), heads, hd), dtype, rng)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return dict(q=q, kc=kc, vc=vc, bt=bt.astype(np.int32), sl=lens, qsl=qsl)


def _cupy_done():
    """Wait for the eager calls' CuPy stream: JAX reads the arrays they wrote in place on
    its own stream, which does not wait for CuPy's."""
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), "not bit for bit"


def _done(*xs):
    """Wait for XLA's stream: a workspace the jitted call used is free for an eager call
    on CuPy's stream (which does not wait for XLA's) only then."""
    return jax.block_until_ready(xs if len(xs) > 1 else xs[0])


def _near(got, ref, dtype="f16"):
    """(out, lse) against the float64 reference: a kernel that skipped rows fails here
    even where the eager call, skipping them too, would agree."""
    from cupaged import testing

    (out, lse), (ref_out, ref_lse) = got, ref
    assert_close(np.asarray(out).astype(np.float64), ref_out, testing.TOLERANCE[dtype])
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=0, atol=2e-3)


def _ref_attention(p, qsl, rows=slice(None), **kw):
    """The reference of an NHD problem's rows ``rows`` (query starts relative to them)."""
    from cupaged import reference

    q = p["q"][rows]
    starts = None if qsl is None else np.asarray(qsl) - np.asarray(qsl)[0]
    return reference.attention(q, p["kc"], p["vc"], p["bt"], p["sl"], starts, kv_layout="NHD",
                               return_lse=True, **kw)


def _dirty(shape, dtype):
    """Leave non-zero bytes in XLA's allocator where the next outputs are likely to go, so
    that rows nothing writes would show."""
    x = jax.jit(lambda: jnp.full(shape, 7, dtype))()
    jax.block_until_ready(x)
    x.delete()


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens", [None, (1, 5, 0, 3)], ids=["decode", "varlen"])
@pytest.mark.parametrize("command_buffer", [False, True])
def test_jit_attention_equals_eager(rng, q_lens, command_buffer):
    _jax_gpu()
    p = _nhd_problem(rng, (17, 300, 1, 64), q_lens)
    a = {k: jnp.asarray(v) for k, v in p.items()}
    qsl = a["qsl"] if q_lens is not None else None
    mq = 5 if q_lens is not None else None  # None: the decode case, as eagerly
    ws = cupaged.DecodeWorkspace(8, H, HD)
    kw = dict(max_query_len=mq, max_seq_len=300, return_lse=True, workspace=ws)
    got = _done(jax.jit(lambda q, kc, vc, bt, sl, qsl: cj.attention(
        q, kc, vc, bt, sl, qsl, command_buffer=command_buffer, **kw))(
        a["q"], a["kc"], a["vc"], a["bt"], a["sl"], qsl))
    want = cupaged.attention(a["q"], a["kc"], a["vc"], a["bt"], a["sl"], qsl, **kw)
    for g, w in zip(got, want):
        _same(g, w)
    _near(got, _ref_attention(p, None if q_lens is None else p["qsl"]))


@pytest.mark.gpu
def test_jit_attention_default_workspace(rng):
    """No workspace given: a call that splits gets the device's shared one, sized at trace
    time, and leaves its counters zero; the result equals the eager call's (whose plan,
    without a workspace either, is the same)."""
    _jax_gpu()
    import cupy

    p = _nhd_problem(rng, (3000, 17))  # two decode rows over a long context: split-KV
    a = {k: jnp.asarray(v) for k, v in p.items()}
    kw = dict(max_seq_len=3000, return_lse=True)
    before = dict(cj._WORKSPACES)
    cj._WORKSPACES.clear()  # this call's trace must make (or take) the shared one itself
    try:
        got = _done(jax.jit(lambda q, kc, vc, bt, sl: cj.attention(q, kc, vc, bt, sl, **kw))(
            a["q"], a["kc"], a["vc"], a["bt"], a["sl"]))
        shared = [ws for (dev, width), ws in cj._WORKSPACES.items() if width == HD]
    finally:
        for key, ws in before.items():
            cj._WORKSPACES.setdefault(key, ws)
    assert shared, "expected this decode call to split (and so to take the shared workspace)"
    for ws in shared:
        assert int(cupy.count_nonzero(ws._counters)) == 0
    want = cupaged.attention(a["q"], a["kc"], a["vc"], a["bt"], a["sl"], **kw)
    for g, w in zip(got, want):
        _same(g, w)
    _near(got, _ref_attention(p, None))


@pytest.mark.gpu
def test_jit_calls_sharing_a_workspace(rng):
    """Two jitted functions, and two calls in one, share a workspace: XLA runs them in
    order on its stream, each leaving the counters zero for the next."""
    _jax_gpu()
    import cupy

    ws = cupaged.DecodeWorkspace(4, H, HD)
    probs = [_nhd_problem(rng, lens) for lens in ((2000, 5, 700), (1500, 900, 3, 64))]
    args = [tuple(jnp.asarray(p[k]) for k in ("q", "kc", "vc", "bt", "sl")) for p in probs]
    kw = dict(max_seq_len=2000, return_lse=True, workspace=ws)
    f = jax.jit(lambda q, kc, vc, bt, sl: cj.attention(q, kc, vc, bt, sl, **kw))
    g = jax.jit(lambda q, kc, vc, bt, sl: cj.attention(q, kc, vc, bt, sl, max_query_len=None,
                                                       **kw))
    both = jax.jit(lambda x, y: (cj.attention(*x, **kw), cj.attention(*y, **kw)))
    first, second = f(*args[0]), g(*args[1])  # back to back, no sync between
    pair = both(args[0], args[1])
    _done(first, second, pair)
    assert int(cupy.count_nonzero(ws._counters)) == 0
    for got, again, x, p in zip((first, second), pair, args, probs):
        want = cupaged.attention(*x, **kw)
        _done(want)
        for a, b, c in zip(got, again, want):
            _same(a, c)
            _same(b, c)
        _near(got, _ref_attention(p, None))


@pytest.mark.gpu
@pytest.mark.parametrize("command_buffer", [False, True])
def test_jit_padded_rows_come_back_zero(rng, command_buffer):
    """Query starts that leave rows out (padding before starts[0] and after starts[-1]):
    those rows come back with out zero and lse -inf; the others equal the eager call's and
    the reference's."""
    _jax_gpu()
    q_lens = (1, 5, 0, 3)
    p = _nhd_problem(rng, (17, 300, 1, 64), q_lens)
    lead, tail = 2, 3
    p["q"] = np.concatenate([np.full((lead, H, HD), 5, np.float16), p["q"],
                             np.full((tail, H, HD), 5, np.float16)])
    qsl = p["qsl"] + lead
    rows = slice(lead, int(qsl[-1]))
    a = {k: jnp.asarray(v) for k, v in p.items()}
    kw = dict(max_query_len=5, max_seq_len=300, return_lse=True)
    _dirty(p["q"].shape, jnp.float16)
    got = _done(jax.jit(lambda q, kc, vc, bt, sl, qsl: cj.attention(
        q, kc, vc, bt, sl, qsl, command_buffer=command_buffer, **kw))(
        a["q"], a["kc"], a["vc"], a["bt"], a["sl"], jnp.asarray(qsl)))
    out, lse = (np.asarray(x) for x in got)
    pad = np.r_[0:lead, int(qsl[-1]):out.shape[0]]
    assert not out[pad].any() and np.isneginf(lse[pad]).all()
    want = cupaged.attention(a["q"], a["kc"], a["vc"], a["bt"], a["sl"], jnp.asarray(qsl), **kw)
    for g, w in zip((out, lse), want):
        _same(g[rows], np.asarray(w)[rows])
    _near((out[rows], lse[rows]), _ref_attention(p, qsl, rows))

    # MLA: a split cache, the same padding.
    kv, pe, q = _mla_problem(rng, int(p["bt"].max()) + 1, out.shape[0])
    mkw = dict(scale=0.07, max_query_len=5, max_seq_len=300, return_lse=True)
    _dirty((out.shape[0], 16, 512), jnp.float16)
    got = _done(jax.jit(lambda q, kv, pe, bt, sl, qsl: cj.mla_attention(
        q, kv, bt, sl, qsl, k_pe_cache=pe, command_buffer=command_buffer, **mkw))(
        q, kv, pe, a["bt"], a["sl"], jnp.asarray(qsl)))
    out, lse = (np.asarray(x) for x in got)
    assert not out[pad].any() and np.isneginf(lse[pad]).all()
    want = cupaged.mla_attention(q, kv, a["bt"], a["sl"], jnp.asarray(qsl), k_pe_cache=pe,
                                 **mkw)
    for g, w in zip((out, lse), want):
        _same(g[rows], np.asarray(w)[rows])
    from cupaged import reference

    ref = reference.mla_attention(np.asarray(q)[rows], np.asarray(kv), p["bt"], p["sl"],
                                  qsl - lead, scale=0.07, k_pe_cache=np.asarray(pe),
                                  return_lse=True)
    _near((out[rows], lse[rows]), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("q_lens", [None, (1, 5, 0, 3)], ids=["decode", "varlen"])
def test_jit_fp8_cache_equals_eager(rng, fmt, q_lens):
    """An fp8 cache as JAX arrays: uint8 storage and kv_cache_dtype (float8 JAX arrays are
    refused at trace time)."""
    _jax_gpu()
    from cupaged import reference

    p = _nhd_problem(rng, (17, 300, 1, 64), q_lens)
    scales = dict(k_scale=0.02, v_scale=0.03)
    for name, s in (("kc", scales["k_scale"]), ("vc", scales["v_scale"])):
        p[name] = reference.quantize_fp8(p[name].astype(np.float32) * 4, fmt, s).view(np.uint8)
    a = {k: jnp.asarray(v) for k, v in p.items()}
    assert a["kc"].dtype == jnp.uint8
    qsl = a["qsl"] if q_lens is not None else None
    kw = dict(max_query_len=5 if q_lens else None, max_seq_len=300, return_lse=True,
              kv_cache_dtype=fmt, **scales)
    got = _done(jax.jit(lambda q, kc, vc, bt, sl, qsl: cj.attention(
        q, kc, vc, bt, sl, qsl, **kw))(a["q"], a["kc"], a["vc"], a["bt"], a["sl"], qsl))
    want = cupaged.attention(a["q"], a["kc"], a["vc"], a["bt"], a["sl"], qsl, **kw)
    for g, w in zip(got, want):
        _same(g, w)
    _near(got, _ref_attention(p, None if q_lens is None else p["qsl"], kv_cache_dtype=fmt,
                              **scales))


def _mla_problem(rng, num_blocks, total_q, dtype=np.float16):
    """A split MLA cache (latent, rope) of ``num_blocks`` blocks and a query of
    ``total_q`` rows, as JAX arrays."""
    from cupaged import testing

    kv = jnp.asarray(testing.random_normal((num_blocks, BS, 512), dtype, rng))
    pe = jnp.asarray(testing.random_normal((num_blocks, BS, 64), dtype, rng))
    q = jnp.asarray(testing.random_normal((total_q, 16, 576), dtype, rng))
    return kv, pe, q


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["combined", "pair", "starts", "split_cache"])
def test_jit_mla_equals_eager(rng, case):
    _jax_gpu()
    from cupaged import reference, testing

    lens = np.array([40, 1, 130], np.int32)
    q_lens = np.array([3, 1, 4] if case in ("starts", "split_cache") else [1, 1, 1])
    bt, nb = testing.random_block_tables(lens, BS, rng, spare_blocks=2)
    kv_all = testing.random_normal((nb, BS, 576), np.float16, rng)
    q = jnp.asarray(testing.random_normal((int(q_lens.sum()), 16, 576), np.float16, rng))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    bt, sl = jnp.asarray(bt.astype(np.int32)), jnp.asarray(lens)
    starts = jnp.asarray(qsl) if case in ("starts", "split_cache") else None
    qq = (q[..., :512], q[..., 512:]) if case == "pair" else q
    if case == "split_cache":
        kv, pe = jnp.asarray(kv_all[..., :512].copy()), jnp.asarray(kv_all[..., 512:].copy())
    else:
        kv, pe = jnp.asarray(kv_all), None
    ws = cupaged.DecodeWorkspace(int(q_lens.sum()), 16, 512)
    kw = dict(scale=0.07, max_query_len=4 if starts is not None else None, max_seq_len=130,
              return_lse=True, workspace=ws)
    got = _done(jax.jit(lambda qq, kv, pe, bt, sl, starts: cj.mla_attention(
        qq, kv, bt, sl, starts, k_pe_cache=pe, **kw))(qq, kv, pe, bt, sl, starts))
    want = cupaged.mla_attention(qq, kv, bt, sl, starts, k_pe_cache=pe, **kw)
    for g, w in zip(got, want):
        _same(g, w)
    ref = reference.mla_attention(np.asarray(q), kv_all, np.asarray(bt), lens,
                                  None if starts is None else qsl, scale=0.07, return_lse=True)
    _near(got, ref)


@pytest.mark.gpu
def test_mla_prefill_plans_no_large_workspace():
    """A long MLA prefill (8192 tokens x 128 heads) does not split: tracing it allocates
    no workspace (it once sized one at 2 x rows x heads, about 4.3 GB)."""
    _jax_gpu()
    n = 8192
    before = {k: ws.rows for k, ws in cj._WORKSPACES.items()}
    f = jax.jit(lambda q, kv, bt, sl, qsl: cj.mla_attention(
        q, kv, bt, sl, qsl, scale=0.07, max_query_len=n, max_seq_len=n))
    f.lower(S((n, 128, 576), BF16), S((n // BS + 1, BS, 576), BF16), S((1, n // BS), I32),
            S((1,), I32), S((2,), I32))
    grown = {k: ws.rows for k, ws in cj._WORKSPACES.items() if before.get(k) != ws.rows}
    assert all(rows < 2 * n * 128 for rows in grown.values()), grown


@pytest.mark.gpu
def test_jit_cache_writes_and_merge_equal_eager(rng):
    """Against the eager calls and the reference: the writes bit for bit, merge_state
    within float32 rounding."""
    _jax_gpu()
    from cupaged import reference, testing

    p = _nhd_problem(rng, (20, 33))
    k = testing.random_normal((3, HK, HD), np.float16, rng)
    v = testing.random_normal((3, HK, HD), np.float16, rng)
    sm = np.array([5, -1, 40], np.int32)
    kc_e, vc_e = jnp.asarray(p["kc"]), jnp.asarray(p["vc"])
    cupaged.reshape_and_cache(jnp.asarray(k), jnp.asarray(v), kc_e, vc_e, jnp.asarray(sm),
                              kv_layout="NHD")  # eagerly, in place
    _cupy_done()
    got = jax.jit(lambda *a: cj.reshape_and_cache(*a, kv_layout="NHD"), donate_argnums=(2, 3))(
        jnp.asarray(k), jnp.asarray(v), jnp.asarray(p["kc"]), jnp.asarray(p["vc"]),
        jnp.asarray(sm))
    _same(got[0], kc_e)
    _same(got[1], vc_e)
    kc_r, vc_r = p["kc"].copy(), p["vc"].copy()
    reference.reshape_and_cache(k, v, kc_r, vc_r, sm, kv_layout="NHD")
    _same(got[0], kc_r)
    _same(got[1], vc_r)

    kv = testing.random_normal((4, BS, 576), np.float16, rng)
    c, r = (testing.random_normal((2, n), np.float16, rng) for n in (512, 64))
    sm = jnp.asarray(np.array([3, 60], np.int32))
    kv_e = jnp.asarray(kv)
    cupaged.concat_and_cache_mla(jnp.asarray(c), jnp.asarray(r), kv_e, sm)
    _cupy_done()
    got = cj.concat_and_cache_mla(jnp.asarray(c), jnp.asarray(r), jnp.asarray(kv), sm)
    _same(got, kv_e)
    kv_r = kv.copy()
    reference.concat_and_cache_mla(c, r, kv_r, np.asarray(sm))
    _same(got, kv_r)

    o = [jnp.asarray(testing.random_normal((5, H, HD), np.float16, rng)) for _ in range(2)]
    lse = [jnp.asarray(rng.normal(size=(5, H)).astype(np.float32)) for _ in range(2)]
    got = jax.jit(cj.merge_state)(o[0], lse[0], o[1], lse[1])
    want = cupaged.merge_state(o[0], lse[0], o[1], lse[1])
    _same(got[0], want[0])
    _same(got[1], want[1])
    _near(got, reference.merge_state(o[0], lse[0], o[1], lse[1]))


@pytest.mark.gpu
def test_donation_writes_in_place(rng):
    """The donated caches are deleted and the returned ones are the same memory."""
    _jax_gpu()
    p = _nhd_problem(rng, (20, 33))
    kc, vc = jnp.asarray(p["kc"]), jnp.asarray(p["vc"])
    ptrs = kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()
    k = jnp.asarray(np.zeros((2, HK, HD), np.float16))
    step = jax.jit(lambda *a: cj.reshape_and_cache(*a, kv_layout="NHD"), donate_argnums=(2, 3))
    kc2, vc2 = step(k, k, kc, vc, jnp.asarray(np.array([0, 1], np.int32)))
    assert kc.is_deleted() and vc.is_deleted()
    assert (kc2.unsafe_buffer_pointer(), vc2.unsafe_buffer_pointer()) == ptrs
    # Called eagerly, a cache write donates the caches itself.
    kc3, vc3 = cj.reshape_and_cache(k, k, kc2, vc2, jnp.asarray(np.array([2, 3], np.int32)),
                                    kv_layout="NHD")
    assert kc2.is_deleted() and (kc3.unsafe_buffer_pointer(), vc3.unsafe_buffer_pointer()) == ptrs


# A decode loop: 4 sequences, STEPS steps of one token each, cache write then attention.
STEPS = 6


def _loop_inputs(seed: int = 7):
    rng = np.random.default_rng(seed)
    p = _nhd_problem(rng, (9, 40, 1, 70))
    p["sl"] = p["sl"] - 1  # the first step's token is written by the step itself
    steps = rng.standard_normal((STEPS, 3, 4, H, HD)).astype(np.float16)  # q, k, v per step
    return p, steps


def _slots(bt, sl):
    """Each sequence's slot for its next token."""
    pos = sl
    return bt[np.arange(len(sl)), pos // BS] * BS + pos % BS


def _eager_loop(p, steps):
    kc, vc = jnp.asarray(p["kc"]), jnp.asarray(p["vc"])
    bt, sl = p["bt"], p["sl"].copy()
    ws = cupaged.DecodeWorkspace(4, H, HD)
    outs = []
    for i in range(STEPS):
        q, k, v = (jnp.asarray(steps[i, j][:, :HK] if j else steps[i, j]) for j in range(3))
        cupaged.reshape_and_cache(k, v, kc, vc, jnp.asarray(_slots(bt, sl).astype(np.int32)),
                                  kv_layout="NHD")
        sl = sl + 1
        outs.append(cupaged.attention(q, kc, vc, jnp.asarray(bt), jnp.asarray(sl),
                                      max_seq_len=int(bt.shape[1] * BS), workspace=ws))
    _cupy_done()
    return np.stack([np.asarray(o) for o in outs])


def _jit_loop(p, steps, command_buffer, runs=2, after_run=None):
    ws = cupaged.DecodeWorkspace(4, H, HD)
    max_seq = int(p["bt"].shape[1] * BS)

    def run(kc, vc, bt, sl, steps):
        def body(i, c):
            kc, vc, sl, outs = c
            q, k, v = steps[i, 0], steps[i, 1][:, :HK], steps[i, 2][:, :HK]
            pos = sl
            slot = bt[jnp.arange(sl.shape[0]), pos // BS] * BS + pos % BS
            kc, vc = cj.reshape_and_cache(k, v, kc, vc, slot, kv_layout="NHD",
                                          command_buffer=command_buffer)
            sl = sl + 1
            out = cj.attention(q, kc, vc, bt, sl, max_seq_len=max_seq, workspace=ws,
                               command_buffer=command_buffer)
            return kc, vc, sl, outs.at[i].set(out)

        outs = jnp.zeros((STEPS, 4, H, HD), jnp.float16)
        return jax.lax.fori_loop(0, STEPS, body, (kc, vc, sl, outs))

    f = jax.jit(run, donate_argnums=(0, 1))
    bt, sl, st = jnp.asarray(p["bt"]), jnp.asarray(p["sl"]), jnp.asarray(steps)
    results = []
    for _ in range(runs):  # each over fresh caches: command buffers replay what was recorded
        _, _, _, outs = f(jnp.asarray(p["kc"]), jnp.asarray(p["vc"]), bt, sl, st)
        results.append(np.asarray(outs))
        if after_run is not None:
            after_run()
    return results


@pytest.mark.gpu
def test_jitted_decode_loop_equals_eager_loop():
    _jax_gpu()
    p, steps = _loop_inputs()
    want = _eager_loop(p, steps)
    for got in _jit_loop(p, steps, False):
        _same(got, want)


COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL "
                        "--xla_gpu_graph_min_graph_size=1")


@pytest.mark.gpu
def test_jitted_decode_loop_with_command_buffers(tmp_path):
    """With XLA's command buffers (CUDA graphs) on for custom calls and while loops: the
    jitted decode loop's outputs equal the eager loop's in two runs, and one jitted step
    (cache write + attention) run six times on the same buffers is recorded under stream
    capture, then replayed without calling Python, its outputs the same each run."""
    _jax_gpu()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                      + COMMAND_BUFFER_FLAGS).strip(),
               XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = tmp_path / "loop.npz"
    subprocess.run([sys.executable, __file__, str(out)], check=True, env=env, cwd=root)
    got = np.load(out)
    p, steps = _loop_inputs()
    want = _eager_loop(p, steps)
    for outs in got["outs"]:
        _same(outs, want)
    loop_calls, step_calls = list(got["loop_calls"]), list(got["step_calls"])
    facts = (f"attention callbacks per run: loop of {STEPS} steps {loop_calls}, "
             f"{int(got['loop_captured'])} under capture; one step {step_calls}, "
             f"{int(got['step_captured'])} under capture")
    # XLA runs a command buffer's first execution op by op (a warm-up), records the next
    # (the callback runs under stream capture) and replays after, recording again for new
    # buffer addresses: a run's outputs may land elsewhere when the previous run's frees
    # have not completed (seen on a loaded GPU: [2, 2, 2, 0], recorded twice). (XLA
    # converts no while loop whose body slices by the loop index, as this one's does: the
    # loop's callbacks run op by op, each step, which the equality above covers.) One
    # step, run six times on the same buffers: recorded, then replayed without Python,
    # the last run at the latest.
    assert got["step_captured"] >= 1 and step_calls[-1] == 0, facts


def _jit_step_runs(p, steps, runs, after_run):
    """One decode step (cache write + attention, and the same queries as a batch padded
    by two rows through query starts), jitted with command buffers and no loop, run
    ``runs`` times on the same inputs (no donation, results dropped before the next run, so
    XLA's buffers keep their addresses): the same outputs each run, the padded rows out 0
    and lse -inf (the memsets recorded and replayed with the launches)."""
    ws = cupaged.DecodeWorkspace(4, H, HD)
    max_seq = int(p["bt"].shape[1] * BS)

    def step(kc, vc, bt, sl, q, k, v):
        slot = bt[jnp.arange(sl.shape[0]), sl // BS] * BS + sl % BS
        kc, vc = cj.reshape_and_cache(k, v, kc, vc, slot, kv_layout="NHD", command_buffer=True)
        out = cj.attention(q, kc, vc, bt, sl + 1, max_seq_len=max_seq, workspace=ws,
                           command_buffer=True)
        qp = jnp.concatenate([q, jnp.full((2, *q.shape[1:]), 3, q.dtype)])
        starts = jnp.arange(sl.shape[0] + 1, dtype=jnp.int32)
        padded = cj.attention(qp, kc, vc, bt, sl + 1, starts, max_query_len=1,
                              max_seq_len=max_seq, return_lse=True, command_buffer=True)
        return out, *padded

    f = jax.jit(step)
    args = (jnp.asarray(p["kc"]), jnp.asarray(p["vc"]), jnp.asarray(p["bt"]),
            jnp.asarray(p["sl"]), jnp.asarray(steps[0, 0]), jnp.asarray(steps[0, 1][:, :HK]),
            jnp.asarray(steps[0, 2][:, :HK]))
    first = None
    for _ in range(runs):
        got = [np.asarray(x) for x in f(*args)]
        first = got if first is None else first
        for a, b in zip(got, first):
            _same(a, b)
        out, padded, lse = got
        assert not padded[-2:].any() and np.isneginf(lse[-2:]).all()
        np.testing.assert_allclose(padded[:-2].astype(np.float64), out.astype(np.float64),
                                   rtol=0, atol=2e-3)
        after_run()


if __name__ == "__main__":  # the command-buffer run (test_jitted_decode_loop_with_command_buffers)
    import cupy
    from cupaged import _prepared

    # Count the attention callbacks (each runs _prepared.run once, looked up at call time)
    # and those that ran while XLA recorded a command buffer (stream capture).
    calls, captured = [0], [0]
    _run = _prepared.run

    def _counted(prep, ptrs, stream, *args, **kwargs):
        calls[0] += 1
        captured[0] += cupy.cuda.runtime.streamIsCapturing(stream) != 0
        return _run(prep, ptrs, stream, *args, **kwargs)

    _prepared.run = _counted
    p, steps = _loop_inputs()
    per_run = []

    def _count():
        per_run.append(calls[0] - sum(per_run))

    outs = _jit_loop(p, steps, True, runs=2, after_run=_count)
    loop_calls, loop_captured = list(per_run), captured[0]
    per_run.clear()
    calls[0] = 0
    _jit_step_runs(p, steps, 6, _count)
    np.savez(sys.argv[1], outs=np.stack(outs), loop_calls=np.array(loop_calls),
             loop_captured=loop_captured, step_calls=np.array(per_run),
             step_captured=captured[0] - loop_captured)
