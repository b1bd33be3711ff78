"""cupaged.jax: cupaged's entry points as JAX operations under jax.jit.

The CPU tests trace and lower on any JAX (the shapes, the aliasing, the trace-time
errors); the ``gpu`` tests run them on a GPU against the eager calls. Both skip where JAX
is not importable (CI's venv has none). To run them::

    PYTHONPATH=/path/to/jax-site:. python -m pytest -q tests/test_jax.py

With JAX's CUDA plugin on a GPU machine the ``gpu`` tests run too; the command-buffer
test starts a subprocess with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,
CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1`` (XLA reads its flags
once, when the backend starts).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import cupaged  # noqa: E402
import cupaged.jax as cj  # noqa: E402

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


def test_command_buffer_flag_lowers():
    q, kc, vc, bt, sl = _attention_shapes()
    f = jax.jit(lambda *a: cj.attention(*a, max_seq_len=64, command_buffer=True))
    assert "xla_buffer_python_" in f.lower(q, kc, vc, bt, sl).as_text()


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


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens", [None, (1, 5, 0, 3)], ids=["decode", "varlen"])
@pytest.mark.parametrize("command_buffer", [False, True])
def test_jit_attention_equals_eager(rng, q_lens, command_buffer):
    _jax_gpu()
    p = _nhd_problem(rng, (17, 300, 1, 64), q_lens)
    a = {k: jnp.asarray(v) for k, v in p.items()}
    qsl = a["qsl"] if q_lens is not None else None
    mq = 5 if q_lens is not None else None
    ws = cupaged.DecodeWorkspace(8, H, HD)
    kw = dict(max_query_len=mq, max_seq_len=300, return_lse=True, workspace=ws)
    got = jax.jit(lambda q, kc, vc, bt, sl, qsl: cj.attention(
        q, kc, vc, bt, sl, qsl, command_buffer=command_buffer, **kw))(
        a["q"], a["kc"], a["vc"], a["bt"], a["sl"], qsl)
    want = cupaged.attention(a["q"], a["kc"], a["vc"], a["bt"], a["sl"], qsl, **kw)
    for g, w in zip(got, want):
        _same(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [False, True])
def test_jit_mla_equals_eager(rng, pair):
    _jax_gpu()
    from cupaged import testing

    lens = np.array([40, 1, 130], np.int32)
    bt, nb = testing.random_block_tables(lens, BS, rng, spare_blocks=2)
    kv = jnp.asarray(testing.random_normal((nb, BS, 576), np.float16, rng))
    q = jnp.asarray(testing.random_normal((3, 16, 576), np.float16, rng))
    qq = (q[..., :512], q[..., 512:]) if pair else q
    bt, sl = jnp.asarray(bt.astype(np.int32)), jnp.asarray(lens)
    ws = cupaged.DecodeWorkspace(3, 16, 512)
    kw = dict(scale=0.07, max_seq_len=130, return_lse=True, workspace=ws)
    got = jax.jit(lambda qq, kv, bt, sl: cj.mla_attention(qq, kv, bt, sl, **kw))(qq, kv, bt, sl)
    want = cupaged.mla_attention(qq, kv, bt, sl, **kw)
    for g, w in zip(got, want):
        _same(g, w)


@pytest.mark.gpu
def test_jit_cache_writes_and_merge_equal_eager(rng):
    _jax_gpu()
    from cupaged import testing

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

    kv = testing.random_normal((4, BS, 576), np.float16, rng)
    c, r = (testing.random_normal((2, n), np.float16, rng) for n in (512, 64))
    sm = jnp.asarray(np.array([3, 60], np.int32))
    kv_e = jnp.asarray(kv)
    cupaged.concat_and_cache_mla(jnp.asarray(c), jnp.asarray(r), kv_e, sm)
    _cupy_done()
    _same(cj.concat_and_cache_mla(jnp.asarray(c), jnp.asarray(r), jnp.asarray(kv), sm), kv_e)

    o = [jnp.asarray(testing.random_normal((5, H, HD), np.float16, rng)) for _ in range(2)]
    lse = [jnp.asarray(rng.normal(size=(5, H)).astype(np.float32)) for _ in range(2)]
    got = jax.jit(cj.merge_state)(o[0], lse[0], o[1], lse[1])
    want = cupaged.merge_state(o[0], lse[0], o[1], lse[1])
    _same(got[0], want[0])
    _same(got[1], want[1])


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


def _jit_loop(p, steps, command_buffer):
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
    _, _, _, outs = f(jnp.asarray(p["kc"]), jnp.asarray(p["vc"]), jnp.asarray(p["bt"]),
                      jnp.asarray(p["sl"]), jnp.asarray(steps))
    # A second run over fresh caches: command buffers replay what the first recorded.
    _, _, _, outs2 = f(jnp.asarray(p["kc"]), jnp.asarray(p["vc"]), jnp.asarray(p["bt"]),
                       jnp.asarray(p["sl"]), jnp.asarray(steps))
    return np.asarray(outs), np.asarray(outs2)


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
    """The loop with the callbacks in XLA's command buffers (CUDA graphs), in a process
    whose XLA_FLAGS turn them on for custom calls: its outputs equal the eager loop's."""
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
    _same(got["first"], want)
    _same(got["second"], want)


if __name__ == "__main__":  # the command-buffer run (test_jitted_decode_loop_with_command_buffers)
    p, steps = _loop_inputs()
    first, second = _jit_loop(p, steps, True)
    np.savez(sys.argv[1], first=first, second=second)
