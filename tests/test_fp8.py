"""fp8 KV caches: the cache write against the NumPy quantizer (bit for bit), attention
over fp8 caches against the float64 reference on the dequantized cache, vLLM's full op
signatures, and the host checks of kv_cache_dtype and the scales."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import _dtypes, reference, testing

from conftest import assert_close

DTYPES = {"f16": np.float16, "bf16": _dtypes.BY_NAME["bf16"].numpy}
FORMATS = ("fp8_e4m3", "fp8_e5m2")
LAYOUTS = ("NHD", "HND", "vllm")
# How the scales travel: a host float, a float32 device scalar, per-token-head arrays.
MODES = ("host", "device", "token")
NAN_BYTE = 0x7F  # NaN in e4m3; NaN in e5m2 too (0x7C is its infinity)


def _used_slots(bt, lens, num_blocks, block_size):
    used = np.zeros((num_blocks, block_size), bool)
    for s, n in enumerate(lens):
        t = np.arange(int(n))
        used[bt[s, t // block_size], t % block_size] = True
    return used


def fp8_problem(rng, fmt, mode, q_lens, seq_lens, *, layout="NHD", dtype="f16", heads=8,
                kv_heads=2, head_size=128, block_size=16, stale=NAN_BYTE):
    """Host arrays: an fp8 cache (uint8) in ``layout`` quantized from random values whose
    magnitude varies per token, stale slots holding the byte ``stale`` in K and it with
    the sign bit in V (NaN by default; 0x7C, e5m2's infinity, gives +inf K and -inf V)
    (and NaN scales), the query, the scales as ``mode`` passes them (device scalars as host
    floats here: ``run`` uploads them)."""
    seq_lens = np.asarray(seq_lens, np.int32)
    bt, nb = testing.random_block_tables(seq_lens, block_size, rng, spare_blocks=2, share=True)
    shape = (nb, block_size, kv_heads, head_size)  # NHD
    mag = np.exp(rng.uniform(-3, 3, (nb, block_size, kv_heads, 1))).astype(np.float32)
    k = rng.standard_normal(shape, dtype=np.float32) * mag
    v = rng.standard_normal(shape, dtype=np.float32) * mag[::-1]
    if mode == "token":
        ks = reference.token_head_scales(k, fmt)  # [nb, bs, kvh, 1]
        vs = reference.token_head_scales(v, fmt)
        k_scale = np.ascontiguousarray(ks[..., 0].transpose(0, 2, 1))  # [nb, kvh, bs]
        v_scale = np.ascontiguousarray(vs[..., 0].transpose(0, 2, 1))
    else:
        # Some values saturate: scales below amax / max.
        ks = np.float32(np.abs(k).max() / reference.fp8_max(fmt) * 0.7)
        vs = np.float32(np.abs(v).max() / reference.fp8_max(fmt) * 1.3)
        k_scale, v_scale = float(ks), float(vs)
    kq = reference.quantize_fp8(k, fmt, ks).view(np.uint8)
    vq = reference.quantize_fp8(v, fmt, vs).view(np.uint8)
    used = _used_slots(bt, seq_lens, nb, block_size)
    kq[~used] = stale
    vq[~used] = stale | 0x80
    if mode == "token":
        k_scale.transpose(0, 2, 1)[~used] = np.nan
        v_scale.transpose(0, 2, 1)[~used] = np.nan
    kq, vq = testing.convert_layout(kq, vq, "NHD", layout)
    q_lens = np.asarray(q_lens, np.int64)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = testing.random_normal((int(qsl[-1]), heads, head_size), DTYPES[dtype], rng)
    return dict(query=q, key_cache=kq, value_cache=vq, block_tables=bt, seq_lens=seq_lens,
                query_start_loc=qsl), dict(k_scale=k_scale, v_scale=v_scale)


def _device_scales(scales, mode):
    import cupy

    if mode == "host":
        return scales
    if mode == "device":
        return {k: cupy.asarray([v], dtype=np.float32) for k, v in scales.items()}
    return {k: cupy.asarray(v) for k, v in scales.items()}


def run(host, scales, mode, fmt, decode_only=False, **kw):
    import cupy

    if decode_only:  # one token per sequence: the decode kernel (split-KV allowed)
        host = dict(host)
        host["query"] = host["query"][: len(host["seq_lens"])]
        host["query_start_loc"] = None
    dev = {k: (None if v is None else cupy.asarray(v)) for k, v in host.items()}
    out = cupy.full(host["query"].shape, np.nan, dtype=host["query"].dtype)
    got = cupaged.attention(**dev, out=out, kv_cache_dtype=fmt, **_device_scales(scales, mode),
                            **kw)
    ref = reference.attention(**host, kv_cache_dtype=fmt, **scales,
                              **{k: v for k, v in kw.items() if k in ("kv_layout", "causal")})
    return cupy.asnumpy(got).astype(np.float64), ref


Q_LENS = [1, 0, 4, 1, 37, 16]
SEQ_EXTRA = [0, 9, 300, 2500, 60, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_over_fp8_matches_reference(rng, fmt, mode, layout, dtype):
    """Every format x scale mode x layout x query dtype, at 8 heads over 2 KV heads (the
    tensor-core decode path with its widened tiles) and in a mixed batch (the prefill
    kernel): the kernels read exactly what is stored."""
    seq = [q + e for q, e in zip(Q_LENS, SEQ_EXTRA)]
    host, scales = fp8_problem(rng, fmt, mode, Q_LENS, seq, layout=layout, dtype=dtype)
    tol = testing.TOLERANCE[dtype]
    got, ref = run(host, scales, mode, fmt, kv_layout=layout, max_query_len=max(Q_LENS))
    assert_close(got, ref, tol, f"mixed {fmt} {mode} {layout} {dtype}")
    got, ref = run(host, scales, mode, fmt, decode_only=True, kv_layout=layout)
    assert_close(got, ref, tol, f"decode {fmt} {mode} {layout} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("hs, group", [(128, 8), (256, 4)], ids=lambda c: str(c))
@pytest.mark.parametrize("split", ["auto", "flat"])
def test_decode_over_fp8_token_major_swizzled_rows(rng, request, hs, group, layout, split):
    """The tensor-core decode path over fp8 token-major caches whose rows (8 and 16
    chunks of 16 one-byte elements) are stored swizzled in shared memory, in the grid
    split and the flat one."""
    if split == "flat":
        request.getfixturevalue("flat_split")
    fmt = FORMATS[int(rng.integers(2))]
    mode = MODES[int(rng.integers(3))]
    seq = [0, 1, 15, 16, 17, 63, 64, 65, 200, 1000]
    host, scales = fp8_problem(rng, fmt, mode, [1] * len(seq), seq, layout=layout,
                               heads=2 * group, kv_heads=2, head_size=hs)
    got, ref = run(host, scales, mode, fmt, decode_only=True, kv_layout=layout)
    assert_close(got, ref, testing.TOLERANCE["f16"], f"{fmt} {mode} hs {hs} group {group}")


# (head_size, block_size, heads, kv_heads, layout): the FMA decode path (groups 1, 2), vLLM's
# layout with blocks under 16 tokens (V in pieces; the row-mode fallback for several
# tokens), tiny and huge blocks, every head size class.
SHAPES = [
    (64, 16, 4, 4, "NHD"),
    (128, 8, 4, 2, "vllm"),
    (32, 1, 2, 1, "vllm"),
    (48, 256, 6, 1, "HND"),
    (256, 32, 16, 2, "NHD"),
    (80, 4, 3, 3, "HND"),
    (96, 2, 8, 8, "vllm"),
    (112, 64, 32, 4, "NHD"),
    (80, 16, 8, 2, "vllm"),  # tensor cores with an odd count of 16-dim chunks
    (48, 32, 16, 4, "HND"),
    (512, 16, 8, 2, "NHD"),   # heads over 256 dims: pairs of warps in the multi-token kernel
    (384, 32, 4, 1, "vllm"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hs{}_bs{}_{}x{}_{}".format(*s))
def test_fp8_shapes_match_reference(rng, shape):
    hs, bs, heads, kvh, layout = shape
    fmt = FORMATS[int(rng.integers(2))]
    mode = MODES[int(rng.integers(3))]
    dtype = ("f16", "bf16")[int(rng.integers(2))]
    seq = [q + e for q, e in zip(Q_LENS, SEQ_EXTRA)]
    host, scales = fp8_problem(rng, fmt, mode, Q_LENS, seq, layout=layout, dtype=dtype,
                               heads=heads, kv_heads=kvh, head_size=hs, block_size=bs)
    tol = testing.TOLERANCE[dtype]
    what = f"{fmt} {mode} {dtype}"
    got, ref = run(host, scales, mode, fmt, kv_layout=layout, max_query_len=max(Q_LENS))
    assert_close(got, ref, tol, "mixed " + what)
    for partition in ("never", "always"):
        import cupy

        d = {k: cupy.asarray(v) for k, v in host.items() if k != "query_start_loc"}
        d["query"] = d["query"][: len(seq)]
        if layout != "vllm":
            continue
        got = cupaged.paged_attention(d["query"], d["key_cache"], d["value_cache"],
                                      d["block_tables"], d["seq_lens"], partition=partition,
                                      kv_cache_dtype=fmt, **_device_scales(scales, mode))
        ref = reference.paged_attention(host["query"][: len(seq)], host["key_cache"],
                                        host["value_cache"], host["block_tables"],
                                        host["seq_lens"], kv_cache_dtype=fmt, **scales)
        assert_close(cupy.asnumpy(got), ref, tol, f"paged_attention {partition} " + what)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ("HND", "vllm"))
@pytest.mark.parametrize("magnitude", (1e30, 3e4, 1e-30))
def test_bfloat16_queries_beyond_float16_range(rng, magnitude, layout):
    """The tensor-core path multiplies fp8 tiles in float16, scaling a bfloat16 query into
    float16's range: queries far above it (or far below its smallest normal) still match."""
    seq = [q + e for q, e in zip(Q_LENS, SEQ_EXTRA)]
    host, scales = fp8_problem(rng, "fp8_e4m3", "host", Q_LENS, seq, layout=layout,
                               dtype="bf16")
    host["query"] = (host["query"].astype(np.float64) * magnitude).astype(DTYPES["bf16"])
    # K's scale shrinks as much, so the scores (and the softmax) stay as they were.
    scales = dict(k_scale=scales["k_scale"] / magnitude, v_scale=scales["v_scale"])
    got, ref = run(host, scales, "host", "fp8_e4m3", decode_only=True, kv_layout=layout)
    assert_close(got, ref, testing.TOLERANCE["bf16"], f"bf16 queries ~{magnitude:g}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ("HND", "vllm"))
@pytest.mark.parametrize("magnitude", (1e6, 1e-6))
def test_bfloat16_queries_with_per_token_scales_of_any_range(rng, magnitude, layout):
    """Per-token scales carry a value's magnitude, so the dequantized V of a bfloat16 model
    may lie far outside float16's range (above 65504, or below its normals): the tensor-core
    path must apply them without float16 overflow or underflow."""
    seq = [q + e for q, e in zip(Q_LENS, SEQ_EXTRA)]
    host, scales = fp8_problem(rng, "fp8_e4m3", "token", Q_LENS, seq, layout=layout,
                               dtype="bf16")
    scales = dict(scales, v_scale=scales["v_scale"] * np.float32(magnitude))
    got, ref = run(host, scales, "token", "fp8_e4m3", decode_only=True, kv_layout=layout)
    assert_close(got, ref, testing.TOLERANCE["bf16"], f"per-token V scales x{magnitude:g}")


# ---- the cache write -------------------------------------------------------------------------


def _special_rows(rng, n, kvh, hs, fmt, scale):
    """Rows mixing values beyond the format's range, +-0, values in its subnormal range,
    exact ties, and ordinary ones (all before division by ``scale``)."""
    fmax = reference.fp8_max(fmt)
    tiny = 2.0 ** (-9 if fmt == "fp8_e4m3" else -16)  # the smallest subnormal
    pool = np.array([0.0, -0.0, fmax * 1.01, -fmax * 3, 1e30, -1e30, tiny, 1.5 * tiny,
                     2.5 * tiny, -0.5 * tiny, fmax, 1.0, -1.0625, 3.0], np.float64) * scale
    x = rng.standard_normal((n, kvh, hs)) * 3
    pick = rng.random(x.shape) < 0.3
    x[pick] = rng.choice(pool, size=int(pick.sum()))
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("hs", [64, 512])  # 512: a lane quantizes two 8-dim pieces
@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_write_is_bit_exact(rng, fmt, mode, layout, src, hs):
    import cupy

    nb, bs, kvh = 6, 16, 3
    n = 40
    scale = 0.37 if mode != "token" else 1.0
    k = _special_rows(rng, n, kvh, hs, fmt, scale).astype(DTYPES[src])
    v = _special_rows(rng, n, kvh, hs, fmt, scale).astype(DTYPES[src])
    if mode != "token":  # NaN is kept as NaN (per-token amax is undefined with NaN rows)
        k[0, 0, :3] = np.nan
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    slots[::7] = -1  # padding tokens: nothing written
    # Slots the write must leave alone hold random finite values (no Inf or NaN pattern).
    kc0 = rng.integers(0, 0x7C, (nb, bs, kvh, hs), dtype=np.uint8) | (rng.integers(0, 2, (nb, bs, kvh, hs), dtype=np.uint8) << 7)
    vc0 = rng.integers(0, 0x7C, (nb, bs, kvh, hs), dtype=np.uint8) | (rng.integers(0, 2, (nb, bs, kvh, hs), dtype=np.uint8) << 7)
    kc0, vc0 = testing.convert_layout(kc0, vc0, "NHD", layout)
    if mode == "token":
        ks0 = rng.standard_normal((nb, kvh, bs)).astype(np.float32)
        vs0 = rng.standard_normal((nb, kvh, bs)).astype(np.float32)
        host_scales = (ks0.copy(), vs0.copy())
        dev_scales = (cupy.asarray(ks0), cupy.asarray(vs0))
    elif mode == "host":
        host_scales = dev_scales = (scale, scale * 2)
    else:
        host_scales = (scale, scale * 2)
        dev_scales = tuple(cupy.asarray([s], dtype=np.float32) for s in host_scales)
    want_k, want_v = kc0.copy(), vc0.copy()
    reference.reshape_and_cache(k, v, want_k, want_v, slots, fmt, *host_scales, kv_layout=layout)
    kc, vc = cupy.asarray(kc0), cupy.asarray(vc0)
    cupaged.reshape_and_cache(cupy.asarray(k), cupy.asarray(v), kc, vc, cupy.asarray(slots),
                              fmt, *dev_scales, kv_layout=layout)
    got_k, got_v = cupy.asnumpy(kc), cupy.asnumpy(vc)
    for name, got, want in (("key", got_k, want_k), ("value", got_v, want_v)):
        as_float = reference.dequantize_fp8
        nan_got = np.isnan(as_float(got, fmt))
        nan_want = np.isnan(as_float(want, fmt))
        np.testing.assert_array_equal(nan_got, nan_want, err_msg=f"{name}: NaN positions")
        bad = (got != want) & ~nan_want
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} bytes differ, first at {np.argwhere(bad)[0]}: got "
            f"{got[bad][0]:#04x}, want {want[bad][0]:#04x}")
        assert not np.isinf(as_float(got, fmt)).any(), f"{name}: Inf stored"
    if mode == "token":
        np.testing.assert_array_equal(cupy.asnumpy(dev_scales[0]), host_scales[0])
        np.testing.assert_array_equal(cupy.asnumpy(dev_scales[1]), host_scales[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_then_attend_round_trip(rng, fmt):
    """reshape_and_cache into an fp8 NHD cache with per-token-head scales, then attention:
    the reference on the same stored bytes agrees."""
    import cupy

    nb, bs, kvh, hs, heads = 8, 16, 2, 128, 8
    n = 100
    k = testing.random_normal((n, kvh, hs), np.float16, rng)
    v = testing.random_normal((n, kvh, hs), np.float16, rng)
    kc = cupy.zeros((nb, bs, kvh, hs), np.uint8)
    vc = cupy.zeros_like(kc)
    ks = cupy.zeros((nb, kvh, bs), np.float32)
    vs = cupy.zeros_like(ks)
    cupaged.reshape_and_cache(cupy.asarray(k), cupy.asarray(v), kc, vc,
                              cupy.arange(n, dtype=cupy.int64), fmt, ks, vs, kv_layout="NHD")
    q = testing.random_normal((1, heads, hs), np.float16, rng)
    bt = np.arange(nb, dtype=np.int32)[None]
    lens = np.array([n], np.int32)
    got = cupaged.attention(cupy.asarray(q), kc, vc, cupy.asarray(bt), cupy.asarray(lens),
                            kv_cache_dtype=fmt, k_scale=ks, v_scale=vs)
    ref = reference.attention(q, cupy.asnumpy(kc), cupy.asnumpy(vc), bt, lens,
                              kv_cache_dtype=fmt, k_scale=cupy.asnumpy(ks),
                              v_scale=cupy.asnumpy(vs))
    assert_close(cupy.asnumpy(got), ref, testing.TOLERANCE["f16"], fmt)


# ---- CUDA graphs ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ("device", "token"))
def test_cuda_graph_replay_reads_new_scales(rng, mode):
    """Scales on the device are read by the kernels, not by the host: a captured cache
    write and attention step, replayed after the scales and inputs change in place, match
    the reference with the new values (and an eager call, bit for bit)."""
    import cupy

    fmt = "fp8_e4m3"
    seq = [q + e for q, e in zip(Q_LENS, SEQ_EXTRA)]
    host, scales = fp8_problem(rng, fmt, mode, Q_LENS, seq, layout="NHD")
    dev = {k: cupy.asarray(v) for k, v in host.items()}
    sc = _device_scales(scales, mode)
    nb, bs, kvh, hs = host["key_cache"].shape
    spare = cupy.asarray(testing.random_normal((5, kvh, hs), np.float16, rng))
    spare_slots = cupy.asarray(np.array([-1, 1, 2, 3, 4], np.int64))  # -1: padding
    kc_side = cupy.zeros((2, bs, kvh, hs), np.uint8)  # the write goes to a side cache
    vc_side = cupy.zeros_like(kc_side)
    side_sc = (cupy.asarray([0.5], np.float32), cupy.asarray([0.25], np.float32))
    out = cupy.empty_like(dev["query"])
    kw = dict(kv_layout="NHD", kv_cache_dtype=fmt, max_query_len=max(Q_LENS),
              max_seq_len=int(max(seq)),
              workspace=cupaged.DecodeWorkspace(len(seq), 8, hs))  # no allocation in capture

    def step():
        cupaged.reshape_and_cache(spare, spare, kc_side, vc_side, spare_slots, fmt, *side_sc,
                                  kv_layout="NHD")
        cupaged.attention(**dev, out=out, **sc, **kw)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()  # compiled and loaded before capture
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        # New values in place: scales, the query, and the tokens to write.
        new = {k: (v * 1.7 if k == "k_scale" else v * 0.6) for k, v in scales.items()}
        for k, v in new.items():
            sc[k][...] = cupy.asarray(v, np.float32)
        q2 = testing.random_normal(host["query"].shape, np.float16, rng)
        dev["query"].set(q2)
        spare2 = testing.random_normal((5, kvh, hs), np.float16, rng)
        spare.set(spare2)
        side_sc[0][...] = 2.0
        graph.launch(stream)
        stream.synchronize()
        replayed = cupy.asnumpy(out).astype(np.float64)
        written = cupy.asnumpy(kc_side), cupy.asnumpy(vc_side)
        eager = cupaged.attention(**dev, **sc, **kw)
    ref = reference.attention(**dict(host, query=q2), kv_cache_dtype=fmt, **new,
                              kv_layout="NHD")
    assert_close(replayed, ref, testing.TOLERANCE["f16"], f"replay, {mode} scales")
    np.testing.assert_array_equal(cupy.asnumpy(eager).astype(np.float64), replayed)
    want_k, want_v = np.zeros_like(written[0]), np.zeros_like(written[1])
    reference.reshape_and_cache(spare2, spare2, want_k, want_v, np.array([-1, 1, 2, 3, 4]), fmt,
                                2.0, 0.25, kv_layout="NHD")
    np.testing.assert_array_equal(written[0], want_k)
    np.testing.assert_array_equal(written[1], want_v)


# ---- the software conversions (sm_80/86) -------------------------------------------------------


def _clear_kernel_caches():
    from cupaged import jit

    jit.clear_memory_caches()


def _fp8_outputs(fmt, seed):
    """Every fp8 kernel on fixed inputs: attention over a mixed batch (prefill kernel),
    decode on tensor cores (8 / 2 heads) and on FMAs (2 / 2), each with per-token scales,
    and the cache write in both scale modes. Host arrays, in that order."""
    import cupy

    out = []
    seq = [q + e for q, e in zip(Q_LENS, SEQ_EXTRA)]
    for heads, kvh, layout in ((8, 2, "HND"), (2, 2, "vllm")):
        host, scales = fp8_problem(np.random.default_rng(seed), fmt, "token", Q_LENS, seq,
                                   layout=layout, heads=heads, kv_heads=kvh)
        for decode_only in (False, True):
            got, _ = run(host, scales, "token", fmt, decode_only=decode_only, kv_layout=layout,
                         max_query_len=max(Q_LENS))
            out.append(got)
    rng = np.random.default_rng(seed)
    k = cupy.asarray(_special_rows(rng, 40, 2, 64, fmt, 1.0).astype(np.float16))
    for token in (False, True):
        kc, vc = cupy.zeros((4, 16, 2, 64), np.uint8), cupy.zeros((4, 16, 2, 64), np.uint8)
        sc = (cupy.zeros((4, 2, 16), np.float32), cupy.zeros((4, 2, 16), np.float32)) if token \
            else (0.37, 0.5)
        cupaged.reshape_and_cache(k, k[::-1].copy(), kc, vc, cupy.arange(40, dtype=np.int64),
                                  fmt, *sc, kv_layout="NHD")
        out += [cupy.asnumpy(kc), cupy.asnumpy(vc)]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_software_conversions_give_the_same_bits(fmt, monkeypatch):
    """CUPAGED_FP8_SOFTWARE=1 compiles the integer conversions sm_80/86 run: on this GPU
    they must reproduce the hardware instructions' results bit for bit, everywhere."""
    from cupaged import jit

    spec = jit.KernelSpec("paged_decode", "f16", 128, 16, 4, kv_format="tok", cache_dtype="e4m3")
    _clear_kernel_caches()
    hw = _fp8_outputs(fmt, 7)
    key_hw = jit.cache_key(spec)
    with monkeypatch.context() as m:
        m.setenv("CUPAGED_FP8_SOFTWARE", "1")
        _clear_kernel_caches()
        try:
            assert jit.cache_key(spec) != key_hw, "the option must reach the cache key"
            sw = _fp8_outputs(fmt, 7)
        finally:
            _clear_kernel_caches()
    for i, (a, b) in enumerate(zip(hw, sw)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"output {i} differs"


# ---- vLLM's signatures and torch's float8 types ----------------------------------------------


@pytest.mark.gpu
def test_vllm_full_signatures_with_torch_float8(rng):
    torch = pytest.importorskip("torch")
    heads, kvh, hs, bs = 8, 2, 128, 16
    lens = np.array([1, 33, 700], np.int32)
    host, scales = fp8_problem(rng, "fp8_e4m3", "host", [1, 1, 1], lens, layout="vllm",
                               heads=heads, kv_heads=kvh, head_size=hs, block_size=bs)
    ref = reference.paged_attention(host["query"], host["key_cache"], host["value_cache"],
                                    host["block_tables"], lens, kv_cache_dtype="fp8", **scales)
    dev = "cuda"
    q = torch.from_numpy(host["query"]).to(dev)
    kc = torch.from_numpy(host["key_cache"]).to(dev).view(torch.float8_e4m3fn)
    vc = torch.from_numpy(host["value_cache"]).to(dev).view(torch.float8_e4m3fn)
    bt = torch.from_numpy(host["block_tables"]).to(dev)
    sl = torch.from_numpy(lens).to(dev)
    k_scale = torch.tensor(scales["k_scale"], dtype=torch.float32, device=dev)  # 0-d, as vLLM
    v_scale = torch.tensor(scales["v_scale"], dtype=torch.float32, device=dev)
    scale = hs ** -0.5
    out = torch.full_like(q, float("nan"))
    cupaged.paged_attention_v1(out, q, kc, vc, kvh, scale, bt, sl, bs, int(lens.max()), None,
                               "fp8", k_scale, v_scale, 0, 0, 0, 64, 0)
    assert_close(out.float().cpu().numpy(), ref, testing.TOLERANCE["f16"], "v1")
    parts = 4
    exp_sums = torch.empty((3, heads, parts), dtype=torch.float32, device=dev)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty((3, heads, parts, hs), dtype=torch.float32, device=dev)
    out = torch.full_like(q, float("nan"))
    cupaged.paged_attention_v2(out, exp_sums, max_logits, tmp_out, q, kc, vc, kvh, scale, bt, sl,
                               bs, int(lens.max()), None, "auto", k_scale, v_scale, 0, 0, 0, 64, 0)
    assert_close(out.float().cpu().numpy(), ref, testing.TOLERANCE["f16"], "v2, float8 auto")
    # vLLM's blocksparse arguments, positionally (local 2, vert stride 3, sparse block 32).
    pattern = dict(local_blocks=2, vert_stride=3, sparse_block_size=32, head_sliding_step=1,
                   tp_rank=1)
    ref = reference.paged_attention(host["query"], host["key_cache"], host["value_cache"],
                                    host["block_tables"], lens, kv_cache_dtype="fp8",
                                    blocksparse=pattern, **scales)
    out = torch.full_like(q, float("nan"))
    cupaged.paged_attention_v1(out, q, kc, vc, kvh, scale, bt, sl, bs, int(lens.max()), None,
                               "fp8", k_scale, v_scale, 1, 2, 3, 32, 1)
    assert_close(out.float().cpu().numpy(), ref, testing.TOLERANCE["f16"], "v1, blocksparse")


@pytest.mark.gpu
def test_vllm_reshape_and_cache_signature_with_torch(rng):
    torch = pytest.importorskip("torch")
    nb, bs, kvh, hs = 4, 16, 2, 64
    k = torch.randn(10, kvh, hs, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(10, kvh, hs, dtype=torch.bfloat16, device="cuda")
    kc = torch.zeros((nb, kvh, hs // 16, bs, 16), dtype=torch.uint8, device="cuda")
    vc = torch.zeros((nb, kvh, hs, bs), dtype=torch.uint8, device="cuda")
    slots = torch.arange(10, dtype=torch.int64, device="cuda") * 3
    one = torch.tensor(0.5, dtype=torch.float32, device="cuda")
    cupaged.reshape_and_cache(k, v, kc, vc, slots, "fp8_e5m2", one, one)  # vLLM's order
    want_k = np.zeros(kc.shape, np.uint8)
    want_v = np.zeros(vc.shape, np.uint8)
    kf = k.float().cpu().numpy().astype(DTYPES["bf16"])
    vf = v.float().cpu().numpy().astype(DTYPES["bf16"])
    reference.reshape_and_cache(kf, vf, want_k, want_v, slots.cpu().numpy(), "fp8_e5m2", 0.5, 0.5)
    np.testing.assert_array_equal(kc.cpu().numpy(), want_k)
    np.testing.assert_array_equal(vc.cpu().numpy(), want_v)


# ---- host checks (no GPU) --------------------------------------------------------------------


class _Fake:
    """Array metadata only, as the checks read it."""

    def __init__(self, shape, dtype, ptr=1 << 20, strides=None, device=0):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
        st, acc = [], self.dtype.itemsize
        for n in reversed(self.shape):
            st.append(acc)
            acc *= n
        self.strides = tuple(reversed(st)) if strides is None else tuple(strides)

        class D:
            pass

        self.data = D()
        self.data.ptr, self.data.device_id = ptr, device


def test_cache_dtype_resolution():
    from cupaged import _kvquant

    f16 = _dtypes.F16
    u8 = _Fake((4, 16, 2, 64), np.uint8)
    e4 = _Fake((4, 16, 2, 64), _dtypes.E4M3.numpy)
    h = _Fake((4, 16, 2, 64), np.float16)
    assert _kvquant.cache_dtype("auto", h, h, f16) is f16
    assert _kvquant.cache_dtype("auto", e4, e4, f16) is _dtypes.E4M3
    assert _kvquant.cache_dtype("fp8", u8, u8, f16) is _dtypes.E4M3
    assert _kvquant.cache_dtype("fp8_e5m2", u8, u8, f16) is _dtypes.E5M2
    with pytest.raises(TypeError, match="name its fp8 format"):
        _kvquant.cache_dtype("auto", u8, u8, f16)
    with pytest.raises(TypeError, match="holds fp8 e4m3, but kv_cache_dtype says e5m2"):
        _kvquant.cache_dtype("fp8_e5m2", e4, e4, f16)
    with pytest.raises(TypeError, match="cannot hold fp8"):
        _kvquant.cache_dtype("fp8", h, h, f16)
    with pytest.raises(TypeError, match="float16 or bfloat16 queries"):
        _kvquant.cache_dtype("fp8", u8, u8, _dtypes.F32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        _kvquant.cache_dtype("int8", u8, u8, f16)


def test_scale_checks(monkeypatch):
    from cupaged import _checks, _kvquant

    monkeypatch.setattr(_kvquant, "as_device_array", lambda a, name: a)  # metadata fakes

    view = _checks.CacheView(_dtypes.E4M3, 4, 2, 64, 16, "tok", (2048, 64, 128), (2048, 64, 128))
    q = _kvquant.scales(0.5, None, _dtypes.E4M3, view, 0)
    assert (q.mode, q.k_value, q.v_value, q.k_ptr) == ("", 0.5, 1.0, 0)
    assert _kvquant.scales(2.0, 2.0, None, view, 0) is _kvquant.NONE  # ignored for 16-bit
    for bad in (0.0, -1.0, float("inf"), float("nan"), 1e39):
        with pytest.raises(ValueError, match="k_scale must be a positive finite"):
            _kvquant.scales(bad, 1.0, _dtypes.E4M3, view, 0)
    arr = _Fake((4, 2, 16), np.float32)
    q = _kvquant.scales(arr, _Fake((4, 2, 16), np.float32, ptr=1 << 21), _dtypes.E4M3, view, 0)
    assert (q.mode, q.block_stride, q.head_stride) == ("th", 32, 16)
    with pytest.raises(ValueError, match="must both be per-token-head"):
        _kvquant.scales(arr, 1.0, _dtypes.E4M3, view, 0)
    with pytest.raises(ValueError, match=r"float32 \[4, 2, 16\]"):
        _kvquant.scales(_Fake((4, 16, 2), np.float32), _Fake((4, 16, 2), np.float32),
                        _dtypes.E4M3, view, 0)
    with pytest.raises(TypeError, match="must be float32"):
        _kvquant.scales(_Fake((4, 2, 16), np.float16), _Fake((4, 2, 16), np.float16),
                        _dtypes.E4M3, view, 0)
    with pytest.raises(ValueError, match="not fp8"):
        _kvquant.scales(arr, arr, None, view, 0)


def test_fp8_head_size_must_be_a_multiple_of_16():
    from cupaged import _checks

    kc = _Fake((4, 16, 2, 72), np.uint8)
    with pytest.raises(ValueError, match="multiple of 16"):
        _checks.check_kv_layout(kc, kc, _dtypes.E4M3, "NHD")


def test_blocksparse_arguments_select_the_variant_only_when_sparse():
    from cupaged import _variants

    # vert_stride 0 or 1 is vLLM's dense attention: no variant.
    assert _variants.blocksparse(0, 0, 0, 64, 0) == ()
    assert _variants.blocksparse(1, 4, 1, 64, 0) == ()
    # (local, vert, block, step, tp_rank): the kernel numbers the heads across the ranks.
    assert _variants.blocksparse(3, 4, 8, 64, -2) == (4, 8, 64, -2, 3)
    with pytest.raises(ValueError, match="blocksparse_block_size"):
        _variants.blocksparse(0, 4, 8, 0, 0)
    with pytest.raises(ValueError, match="tp_rank"):
        _variants.blocksparse(-1, 4, 8, 64, 0)
    with pytest.raises(TypeError, match="blocksparse_vert_stride"):
        _variants.blocksparse(0, 4, 8.0, 64, 0)


def test_block_strides_past_32_bits_are_refused_for_every_attention_call():
    """The decode and prefill kernels place a block with one 32x32->64-bit product:
    check_kv_layout, which every attention entry point runs, refuses larger strides."""
    from cupaged import _checks

    for layout, shape in (("NHD", (4, 16, 2, 64)), ("HND", (4, 2, 16, 64))):
        ok = _Fake(shape, np.uint8)
        _checks.check_kv_layout(ok, ok, _dtypes.E4M3, layout)
        wide = _Fake(shape, np.uint8, strides=(2**32,) + ok.strides[1:])  # bytes = elements
        with pytest.raises(ValueError, match="block stride .* too large"):
            _checks.check_kv_layout(wide, ok, _dtypes.E4M3, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_alibi_with_per_token_scales_in_the_multi_token_kernel(rng, fmt):
    """ALiBi's ramp on tiles without masks (variant bit a) with per-token scales, which
    scale each key's score before the bias is added; causal and not."""
    host, scales = fp8_problem(rng, fmt, "token", [40, 17, 1, 70], [300, 150, 77, 70])
    host["alibi_slopes"] = rng.uniform(0.0, 0.5, 8).astype(np.float32)
    for causal in (True, False):
        got, ref = run(host, scales, "token", fmt, causal=causal)
        assert_close(got, ref, testing.TOLERANCE["f16"], f"{fmt} causal={causal}")
