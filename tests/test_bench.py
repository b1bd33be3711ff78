"""cupaged.bench without a GPU: FlashInfer's inputs built from a case (page lists, the
"HND" layout), FlashInfer's optional presence, and the plan_us field. The timed rows
themselves run on the device (tools/device.sh rows sweep, the compare GPU test)."""

import os
import subprocess
import sys
import types

import numpy as np
import pytest

import cupaged
from cupaged import testing
from cupaged.bench import decode as bench_decode
from cupaged.bench import peers
from cupaged.bench import timing
from cupaged.bench import workloads

BLOCK = 16


def _seq_lens_flashinfer(indptr, last_page_len, page_size):
    """FlashInfer's own rule (flashinfer.page.get_seq_lens, paged_kv_t::get_length)."""
    pages = np.diff(indptr)
    return np.where(pages > 0, np.maximum(pages - 1, 0) * page_size + last_page_len, 0)


def test_page_lists_cover_each_sequence_in_order(rng):
    lens = rng.integers(1, 20 * BLOCK, 40)
    lens[:6] = [1, BLOCK, 2 * BLOCK, BLOCK + 1, BLOCK - 1, 7 * BLOCK]  # edges, block multiples
    tables, _ = testing.random_block_tables(lens, BLOCK, rng, extra_columns=3)
    indptr, indices, last = peers.flashinfer_pages(tables, lens, BLOCK)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    need = -(-lens // BLOCK)
    assert indptr[0] == 0 and np.array_equal(np.diff(indptr), need)
    expect = np.concatenate([tables[s, :n] for s, n in enumerate(need)])
    assert np.array_equal(indices, expect)  # the used blocks, never the garbage after them
    assert np.array_equal(_seq_lens_flashinfer(indptr, last, BLOCK), lens)
    assert ((last >= 1) & (last <= BLOCK)).all()
    assert last[0] == 1 and last[1] == BLOCK and last[2] == BLOCK and last[3] == 1
    assert last[4] == BLOCK - 1 and last[5] == BLOCK


def test_page_lists_of_an_empty_sequence(rng):
    lens = np.array([0, 5, 0, 3 * BLOCK], np.int32)
    tables, _ = testing.random_block_tables(lens, BLOCK, rng)
    indptr, indices, last = peers.flashinfer_pages(tables, lens, BLOCK)
    assert indptr.tolist() == [0, 0, 1, 1, 4] and last.tolist() == [0, 5, 0, BLOCK]
    assert indices.tolist() == [tables[1, 0], *tables[3, :3]]
    assert np.array_equal(_seq_lens_flashinfer(indptr, last, BLOCK), lens)


@pytest.mark.parametrize("lens, width, msg", [
    ([5, 40], 2, "needs 3 blocks"),
    ([5, -1], 3, "non-negative"),
    ([5], 3, "context_lens [S]"),
])
def test_page_lists_reject_bad_input(lens, width, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[")):
        peers.flashinfer_pages(np.zeros((2, width), np.int32), lens, BLOCK)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_hnd_views_hold_the_same_values(rng, dtype):
    kvh, hs, nb = 2, 32, 5
    kc, vc = testing.random_cache(nb, kvh, hs, BLOCK, dtype, rng)
    x = kc.shape[-1]
    k, v = bench_decode.to_hnd(kc, vc)
    k = np.ascontiguousarray(k).reshape(nb, kvh, BLOCK, hs)  # as FlashInfer's copy
    assert v.shape == (nb, kvh, BLOCK, hs)
    b, h, t, d = (rng.integers(0, n, 200) for n in (nb, kvh, BLOCK, hs))
    assert np.array_equal(k[b, h, t, d], kc[b, h, d // x, t, d % x])
    assert np.array_equal(v[b, h, t, d], vc[b, h, d, t])


def test_flashinfer_rows_listed_only_when_importable(monkeypatch, no_flashinfer):
    assert peers.flashinfer_unavailable() == "No module named 'flashinfer'"
    assert not set(bench_decode.available_implementations()) & set(bench_decode.FLASHINFER_IMPLS)
    monkeypatch.setattr(peers, "import_flashinfer", lambda: (types.ModuleType("flashinfer"), None))
    listed = bench_decode.available_implementations()
    assert listed[-3:] == ["flashinfer-decode", "flashinfer-decode-tc", "flashinfer-xqa"]
    assert set(bench_decode.FLASHINFER_IMPLS) == set(listed[-3:])


def test_flashinfer_without_torch_gpu_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(peers, "import_torch", lambda: None)
    assert peers.flashinfer_unavailable() == "torch sees no CUDA device"


def test_xqa_row_without_xqa_gives_its_reason(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.2.0"
    fake.decode = types.ModuleType("flashinfer.decode")  # no xqa_batch_decode_with_kv_cache
    monkeypatch.setattr(peers, "import_flashinfer", lambda: (fake, None))
    with pytest.raises(NotImplementedError,
                       match=r"flashinfer 0\.2\.0 has no flashinfer\.decode\.xqa_batch_decode"):
        bench_decode.run_flashinfer_xqa(None, "auto")  # before touching the case


def test_flashinfer_factories_refuse_without_flashinfer(no_flashinfer):
    for name in bench_decode.FLASHINFER_IMPLS:
        with pytest.raises(RuntimeError, match="No module named 'flashinfer'"):
            bench_decode.IMPLEMENTATIONS[name][0](None, "auto")


def test_import_cupaged_imports_neither_flashinfer_nor_torch(tmp_path):
    # a "flashinfer" first on the path that fails loudly if anything imports it
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise SystemExit('imported')\n")
    code = ("import sys, cupaged, cupaged.bench.cli, cupaged.bench.decode, cupaged.bench.prefill, "
            "cupaged.bench.mla, cupaged.bench.cascade, cupaged.bench.e2e, cupaged.serving.engine; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flashinfer', 'torch')))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
    sanity = subprocess.run([sys.executable, "-c", "import flashinfer"], env=env)
    assert sanity.returncode != 0  # the trap works


def test_result_has_plan_us_nan_by_default():
    r = workloads.Result("cupaged", "", "", 1, "512", 512.0, 32, 8, 128, 16, "float16", "auto", "ok")
    assert r.plan_us != r.plan_us
    assert workloads.Result(**{**r.__dict__, "plan_us": 612.5}).plan_us == 612.5


# ---- fp8 caches -------------------------------------------------------------------------------


def _finite_fp8_bytes(kv_cache_dtype):
    """Every byte that is a finite value of the format (ml_dtypes decodes them)."""
    from cupaged import reference

    b = np.arange(256, dtype=np.uint8)
    return set(b[np.isfinite(reference.dequantize_fp8(b, kv_cache_dtype))].tolist())


@pytest.mark.parametrize("name, canonical", [
    ("auto", "auto"), (None, "auto"), ("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"),
    ("fp8_e5m2", "fp8_e5m2")])
def test_kv_cache_dtype_names(name, canonical):
    assert workloads.kv_cache_dtype_name(name) == canonical


@pytest.mark.parametrize("bad", ["e4m3", "fp16", "float8_e4m3fn", "FP8", 8])
def test_unknown_kv_cache_dtype_is_refused(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto', 'fp8'"):
        workloads.kv_cache_dtype_name(bad)
    with pytest.raises(ValueError, match="kv_cache_dtype must be "):
        workloads.Workload(1, 16, 8, 2, 64, 16, "float16", kv_cache_dtype=bad)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_random_fp8_holds_every_finite_value_and_nothing_else(rng, fmt):
    b = workloads.random_fp8((40, 2, 8, 16), fmt, rng)
    assert b.dtype == np.uint8 and b.shape == (40, 2, 8, 16)
    finite = _finite_fp8_bytes(fmt)
    assert len(finite) == (254 if fmt == "fp8_e4m3" else 248)
    assert set(np.unique(b).tolist()) == finite  # 10240 draws of ~250 patterns: all seen


def _case(kv_cache_dtype, lens=(5, 17, 300)):
    return workloads.DecodeCase(len(lens), np.array(lens, np.int32), 8, 2, 128, 16,
                            np.dtype(np.float16), kv_cache_dtype=kv_cache_dtype)


def test_fp8_case_counts_one_byte_per_cache_element():
    f16, fp8 = _case("auto"), _case("fp8")
    tokens = 5 + 17 + 300
    assert f16.kv_bytes == tokens * 2 * 128 * 2 * 2  # K and V, 2 KV heads, 2 bytes
    assert fp8.kv_bytes == tokens * 2 * 128 * 2 * 1 == f16.kv_bytes // 2
    q_and_out = 2 * 3 * 8 * 128 * 2  # 16-bit query and output either way
    assert fp8.bytes_moved - fp8.kv_bytes == f16.bytes_moved - f16.kv_bytes == q_and_out
    assert fp8.kv_cache_dtype == "fp8_e4m3" and fp8.fp8 and not f16.fp8
    assert f16.kv_args == {}
    assert fp8.kv_args == dict(kv_cache_dtype="fp8_e4m3", k_scale=workloads.FP8_SCALES["fp8_e4m3"],
                               v_scale=workloads.FP8_SCALES["fp8_e4m3"])
    assert fp8.tolerance() == f16.tolerance() == testing.TOLERANCE["f16"]


def test_workload_carries_the_kv_cache_dtype_to_its_case():
    w = workloads.Workload(4, (10, 90), 8, 2, 64, 16, "bfloat16", "p", "fp8")
    assert w.kv_cache_dtype == "fp8_e4m3"
    c = w.case(seed=2)
    assert c.kv_cache_dtype == "fp8_e4m3" and c.batch == 4 and c.head_size == 64
    assert workloads.Workload(4, 10, 8, 2, 64, 16, "float16").case(0).kv_cache_dtype == "auto"


def test_fp8_case_names_its_specialization(monkeypatch):
    import cupy

    from cupaged import planning

    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: types.SimpleNamespace(id=0))
    monkeypatch.setattr(planning, "device_info", lambda i: planning.DeviceInfo(i, "sm_90", 132, 232448, 233472))
    assert _case("auto").spec_name() == "paged_decode_f16_hs128_bs16_vllm_g4_sm90"
    assert _case("fp8").spec_name() == "paged_decode_f16_e4m3_hs128_bs16_vllm_g4_sm90"
    assert _case("fp8_e5m2").spec_name() == "paged_decode_f16_e5m2_hs128_bs16_vllm_g4_sm90"


def test_peers_without_an_fp8_path_are_named():
    for impl in bench_decode.IMPLEMENTATIONS:
        assert bench_decode.fp8_unsupported(impl, "auto") is None
    no_e4m3 = {i for i in bench_decode.IMPLEMENTATIONS if bench_decode.fp8_unsupported(i, "fp8")}
    no_e5m2 = {i for i in bench_decode.IMPLEMENTATIONS if bench_decode.fp8_unsupported(i, "fp8_e5m2")}
    assert no_e4m3 == {"cupy-gather", "torch-sdpa-paged", "torch-sdpa-dense"}
    assert no_e5m2 == no_e4m3 | {"flashinfer-xqa"}
    assert "e4m3 caches only" in bench_decode.fp8_unsupported("flashinfer-xqa", "fp8_e5m2")
    assert "cupy-gather" not in bench_decode.available_implementations("fp8_e4m3")
    assert "cupy-gather" in bench_decode.available_implementations()


@pytest.mark.parametrize("impl", ["cupy-gather", "torch-sdpa-paged", "torch-sdpa-dense"])
def test_gather_peers_refuse_an_fp8_case_with_a_reason(impl):
    with pytest.raises(NotImplementedError, match="no fp8 cache path"):
        bench_decode.IMPLEMENTATIONS[impl][0](_case("fp8"), "auto")  # before touching its arrays


def test_result_says_its_kv_cache_dtype():
    import dataclasses

    r = workloads.Result("cupaged", "", "", 1, "512", 512.0, 32, 8, 128, 16, "float16", "auto", "ok")
    assert r.kv_cache_dtype == "auto"
    assert "kv_cache_dtype" in {f.name for f in dataclasses.fields(workloads.Result)}
    assert workloads.Result(**{**r.__dict__, "kv_cache_dtype": "fp8_e4m3"}).kv_cache_dtype == "fp8_e4m3"


def test_prefill_case_over_fp8_counts_one_byte():
    from cupaged.bench import prefill as bench_prefill

    kw = dict(batch=2, q_len=8, ctx=64, heads=4, kv_heads=2, head_size=64)
    bf16 = bench_prefill.PrefillCase("x", **kw)
    fp8 = bench_prefill.PrefillCase("x", **kw, kv_cache_dtype="fp8")
    assert fp8.kv_cache_dtype == "fp8_e4m3" and bf16.kv_args == {}
    assert bf16.kv_bytes() == 2 * fp8.kv_bytes() == 2 * 2 * 64 * 2 * 64 * 2
    assert fp8.flops() == bf16.flops()
    assert fp8.kv_args["k_scale"] == workloads.FP8_SCALES["fp8_e4m3"]


# ---- on a GPU: a tiny fp8 decode through the bench machinery ------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_decode_measures_and_checks(fmt, dtype):
    import cupy

    from cupaged import planning

    w = workloads.Workload(3, (1, 300), 8, 2, 128, 16, dtype, kv_cache_dtype=fmt)
    rows = bench_decode.measure(w, ["cupaged", "cupaged-nhd", "cupaged-hnd"], reps=3, copy_bw=1e12)
    assert [r.impl for r in rows] == ["cupaged", "cupaged-nhd", "cupaged-hnd"]
    tol = testing.TOLERANCE["f16" if dtype == "float16" else "bf16"]
    for r in rows:
        assert r.status == "ok", r.note
        assert r.rel_err <= tol and r.kv_cache_dtype == fmt
    # the row names the specialization decode launched for this cache
    name = fmt.split("_")[1]
    launched = planning.decode_kernels(cupy.cuda.Device().id, "f16" if dtype == "float16" else "bf16",
                               128, 16, planning.group_tile(4), "vllm", name, "").name
    assert rows[0].kernel == launched and f"_{name}_" in launched


@pytest.mark.gpu
def test_fp8_case_caches_are_finite_bytes_in_vllm_layout():
    import cupy

    c = workloads.Workload(2, 40, 8, 2, 64, 16, "float16", kv_cache_dtype="fp8_e5m2").case(0).build()
    kc, vc = c.arrays["key_cache"], c.arrays["value_cache"]
    nb = kc.shape[0]
    assert kc.dtype == vc.dtype == np.uint8
    assert kc.shape == (nb, 2, 64 // 16, 16, 16) and vc.shape == (nb, 2, 64, 16)
    seen = set(cupy.asnumpy(cupy.unique(cupy.concatenate([kc.ravel(), vc.ravel()]))).tolist())
    assert seen == _finite_fp8_bytes("fp8_e5m2")
    c.arrays.clear()


# ---- attention variants: options, accounting, skips (pure functions) ----------------------------


def test_variants_default_to_plain_and_say_what_they_are():
    v = workloads.Variants()
    assert v.plain and v.label() == "" and v.describe() == "" and v == workloads.PLAIN
    assert v.fields() == dict(window=None, soft_cap=None, soft_cap_approx=False, sinks=False,
                              alibi=False)
    assert v.kernel_args({}) == {} and v.reference_args(8) == {} and v.letters() == ""
    w = workloads.Variants(512, 50, True, True)
    assert not w.plain and w.label() == "window 512, soft-cap 50, sinks, ALiBi"
    assert "window_left 511" in w.describe() and f"seed {workloads.SINK_SEED}" in w.describe()
    assert w.fields() == dict(window=512, soft_cap=50.0, soft_cap_approx=False, sinks=True,
                              alibi=True)
    assert w.letters() == "wc" and workloads.Variants(soft_cap=30.0).letters() == "c"
    assert workloads.Variants(sinks=True).letters() == workloads.Variants(alibi=True).letters() == ""
    ref = w.reference_args(8)
    assert ref["window"] == 512 and ref["logits_soft_cap"] == 50.0
    assert np.array_equal(ref["sinks"], workloads.sink_values(8))
    assert np.array_equal(ref["alibi_slopes"], workloads.alibi_slopes(8))
    got = w.kernel_args({"sinks": "S", "alibi_slopes": "A"})
    assert got == dict(window=512, logits_soft_cap=50.0, sinks="S", alibi_slopes="A")
    # The cap by tanh.approx: cupaged takes a SoftCap, the label says so, letters "ct"
    a = workloads.Variants(soft_cap=30.0, soft_cap_approx=True)
    assert a.label() == "soft-cap 30 (tanh.approx)" and a.letters() == "ct"
    assert a.kernel_args({}) == dict(logits_soft_cap=cupaged.SoftCap(30.0, approx=True))
    assert a.fields()["soft_cap_approx"] is True
    with pytest.raises(ValueError, match="soft_cap_approx needs a soft cap"):
        workloads.Variants(soft_cap_approx=True)


@pytest.mark.parametrize("kw, msg", [
    (dict(window=0), "window must be at least 1"),
    (dict(window=-5), "window must be at least 1"),
    (dict(window=2.5), "window must be an int"),
    (dict(soft_cap=0.0), "soft cap must be a positive finite number"),
    (dict(soft_cap=-1.0), "soft cap must be a positive finite number"),
    (dict(soft_cap=float("inf")), "soft cap must be a positive finite number"),
    (dict(soft_cap=float("nan")), "soft cap must be a positive finite number"),
    (dict(soft_cap="50"), "soft cap must be a number"),
])
def test_bad_variants_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        workloads.Variants(**kw)


def test_sinks_are_fixed_standard_normal_values():
    s = workloads.sink_values(64)
    assert s.dtype == np.float32 and s.shape == (64,)
    assert np.array_equal(s, workloads.sink_values(64)) and abs(float(s.mean())) < 0.5
    assert np.array_equal(workloads.sink_values(8), s[:8])  # the same stream, per head


def test_alibi_slopes_are_the_standard_ones():
    assert np.allclose(workloads.alibi_slopes(8), [2.0 ** -i for i in range(1, 9)])
    s32 = workloads.alibi_slopes(32)
    assert np.allclose(s32, [2.0 ** (-i / 4) for i in range(1, 33)]) and s32.dtype == np.float32
    # not a power of two: the 8 of 8 heads, then odd slopes of 16 heads
    s12 = workloads.alibi_slopes(12)
    assert np.allclose(s12[:8], workloads.alibi_slopes(8))
    assert np.allclose(s12[8:], workloads.alibi_slopes(16)[0::2][:4])
    assert workloads.alibi_slopes(1).tolist() == [2.0 ** -8]
    assert len(workloads.alibi_slopes(28)) == 28 and len(set(workloads.alibi_slopes(28))) == 28


def test_visible_tokens_count_only_the_window():
    lens = [5, 17, 300, 32768]
    assert workloads.visible_tokens(lens) == 5 + 17 + 300 + 32768
    assert workloads.visible_tokens(lens, 512) == 5 + 17 + 300 + 512
    assert workloads.visible_tokens(lens, 1) == 4 and workloads.visible_tokens([], 8) == 0


def test_decode_bytes_with_a_window_count_the_keys_a_query_sees():
    plain = _case("auto", lens=(100, 1000, 4000))
    win = workloads.DecodeCase(3, np.array([100, 1000, 4000], np.int32), 8, 2, 128, 16,
                           np.dtype(np.float16), variants=workloads.Variants(window=512))
    per_token = 2 * 128 * 2 * 2  # K and V, 2 KV heads, 2 bytes
    assert plain.kv_bytes == 5100 * per_token
    assert win.kv_bytes == (100 + 512 + 512) * per_token
    assert win.bytes_moved - win.kv_bytes == plain.bytes_moved - plain.kv_bytes
    capped = workloads.DecodeCase(3, np.array([100, 1000, 4000], np.int32), 8, 2, 128, 16,
                              np.dtype(np.float16),
                              variants=workloads.Variants(soft_cap=30.0, sinks=True, alibi=True))
    assert capped.kv_bytes == plain.kv_bytes  # no window: every key is seen


def test_workload_carries_the_variants_to_its_case():
    v = workloads.Variants(window=64, soft_cap=20.0, sinks=True)
    w = workloads.Workload(4, (10, 90), 8, 2, 64, 16, "bfloat16", "p", "auto", v)
    assert w.case(seed=1).variants is v
    assert workloads.Workload(4, 10, 8, 2, 64, 16, "float16").case(0).variants == workloads.PLAIN


def test_variant_case_names_its_specialization(monkeypatch):
    import cupy

    from cupaged import planning

    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: types.SimpleNamespace(id=0))
    monkeypatch.setattr(planning, "device_info", lambda i: planning.DeviceInfo(i, "sm_90", 132, 232448, 233472))

    def name(**kw):
        return workloads.DecodeCase(1, np.array([5], np.int32), 8, 2, 128, 16, np.dtype(np.float16),
                                variants=workloads.Variants(**kw)).spec_name()

    assert name() == "paged_decode_f16_hs128_bs16_vllm_g4_sm90"
    assert name(sinks=True, alibi=True) == name()  # run-time arguments only
    assert name(window=8) != name() and name(soft_cap=5.0) != name()
    assert name(window=8, soft_cap=5.0) not in (name(window=8), name(soft_cap=5.0))


def test_peers_that_cannot_run_variants_are_named():
    plain_only = {"cupy-gather", "torch-sdpa-paged", "torch-sdpa-dense"}
    decode = {"flashinfer-decode", "flashinfer-decode-tc"}  # window_left, logits_soft_cap
    xqa = {"flashinfer-xqa"}  # window_left, sinks
    for impl in bench_decode.IMPLEMENTATIONS:
        assert bench_decode.variant_unsupported(impl, workloads.PLAIN) is None
    refused = {workloads.Variants(window=512): plain_only,
               workloads.Variants(soft_cap=50.0): plain_only | xqa,
               workloads.Variants(window=512, soft_cap=50.0): plain_only | xqa,
               workloads.Variants(sinks=True): plain_only | decode,
               workloads.Variants(window=512, sinks=True): plain_only | decode,
               workloads.Variants(alibi=True): plain_only | decode | xqa}
    for v, no in refused.items():
        assert {i for i in bench_decode.IMPLEMENTATIONS if bench_decode.variant_unsupported(i, v)} == no, v
    assert "runs plain attention only (asked for: window 512)" in bench_decode.variant_unsupported(
        "cupy-gather", workloads.Variants(window=512))
    assert bench_decode.variant_unsupported("flashinfer-decode", workloads.Variants(sinks=True, alibi=True)) \
        == "flashinfer-decode is run with window_left and logits_soft_cap only, not sinks or ALiBi"
    assert bench_decode.variant_unsupported("flashinfer-xqa", workloads.Variants(soft_cap=5.0, sinks=True)) \
        == "flashinfer-xqa is run with window_left and sinks only, not soft-cap"
    # A peer in neither table runs plain attention only.
    assert "runs plain attention only" in bench_decode.variant_unsupported(
        "flashinfer-future", workloads.Variants(window=4))
    assert all(bench_decode.variant_unsupported(i, workloads.Variants(1, 1.0, True, True)) is None
               for i in ("cupaged", "cupaged-nhd", "cupaged-hnd"))
    # fp8 first, then the variants
    assert "no fp8 cache path" in bench_decode.unsupported("cupy-gather", "fp8", workloads.Variants(window=4))
    assert bench_decode.available_implementations("auto", workloads.Variants(window=4))[:3] == [
        "cupaged", "cupaged-nhd", "cupaged-hnd"]
    assert not set(bench_decode.available_implementations("auto", workloads.Variants(window=4))) & plain_only


@pytest.mark.parametrize("impl", ["cupy-gather", "torch-sdpa-paged", "torch-sdpa-dense"])
def test_gather_peers_refuse_variants_with_a_reason(impl):
    case = workloads.DecodeCase(1, np.array([5], np.int32), 8, 2, 128, 16, np.dtype(np.float16),
                            variants=workloads.Variants(soft_cap=10.0))
    with pytest.raises(NotImplementedError, match="plain attention only"):
        bench_decode.IMPLEMENTATIONS[impl][0](case, "auto")  # before touching its arrays


@pytest.mark.parametrize("impl", ["flashinfer-decode", "flashinfer-decode-tc", "flashinfer-xqa"])
def test_flashinfer_rows_refuse_what_they_are_not_given(monkeypatch, impl):
    fake = types.ModuleType("flashinfer")
    fake.decode = types.SimpleNamespace(xqa_batch_decode_with_kv_cache=lambda *a, **k: None)
    monkeypatch.setattr(peers, "import_flashinfer", lambda: (fake, None))
    # Each is given a window; the decode wrappers are refused sinks, XQA a soft cap.
    refused = dict(soft_cap=5.0) if impl == "flashinfer-xqa" else dict(sinks=True)
    case = workloads.DecodeCase(1, np.array([5], np.int32), 8, 2, 128, 16, np.dtype(np.float16),
                            variants=workloads.Variants(window=4, **refused))
    with pytest.raises(NotImplementedError, match="not soft-cap" if impl == "flashinfer-xqa"
                       else "not sinks"):
        bench_decode.IMPLEMENTATIONS[impl][0](case, "auto")  # before touching its arrays


def test_result_records_the_variants():
    import dataclasses

    names = {f.name for f in dataclasses.fields(workloads.Result)}
    assert {"window", "soft_cap", "sinks", "alibi"} <= names
    r = workloads.Result("cupaged", "", "", 1, "512", 512.0, 32, 8, 128, 16, "float16", "auto", "ok",
                     **workloads.Variants(window=8, alibi=True).fields())
    assert (r.window, r.soft_cap, r.sinks, r.alibi) == (8, None, False, True)


# ---- prefill: FLOPs and bytes with a window ----------------------------------------------------


def _pairs_brute(q_len, ctx, causal, window):
    n = 0
    for p in range(ctx - q_len, ctx):
        for k in range(ctx):
            n += (k <= p or not causal) and (window is None or k > p - window)
    return n


@pytest.mark.parametrize("q_len, ctx", [(1, 1), (4, 4), (4, 37), (37, 37), (16, 100), (0, 9)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 3, 16, 50, 1000])
def test_attended_pairs_match_a_brute_count(q_len, ctx, causal, window):
    from cupaged.bench import prefill as bench_prefill

    assert bench_prefill.attended_pairs(q_len, ctx, causal, window) == \
        _pairs_brute(q_len, ctx, causal, window)


def test_attended_pairs_closed_forms():
    from cupaged.bench import prefill as bench_prefill

    q, c = 4096, 4096
    assert bench_prefill.attended_pairs(q, c) == q * (q + 1) // 2
    assert bench_prefill.attended_pairs(512, 8192) == 512 * (8192 - 512) + 512 * 513 // 2
    assert bench_prefill.attended_pairs(q, c, False) == q * c
    # a window W over a whole prompt: W keys per row once past the first W rows
    w = 512
    assert bench_prefill.attended_pairs(q, c, True, w) == w * (w + 1) // 2 + (q - w) * w
    assert bench_prefill.attended_pairs(q, c, True, c) == bench_prefill.attended_pairs(q, c)
    with pytest.raises(ValueError, match="q_len <= ctx"):
        bench_prefill.attended_pairs(5, 4)


@pytest.mark.parametrize("q_len, ctx, window, keys", [
    (4096, 4096, None, 4096), (4096, 4096, 512, 4096), (1, 8192, 512, 512),
    (512, 8192, 512, 1023), (4, 2048, 4096, 2048), (4, 2048, 1, 4)])
def test_seen_keys(q_len, ctx, window, keys):
    from cupaged.bench import prefill as bench_prefill

    assert bench_prefill.seen_keys(q_len, ctx, window) == keys


def test_prefill_case_counts_flops_and_bytes_inside_the_window():
    from cupaged.bench import prefill as bench_prefill

    kw = dict(batch=2, q_len=64, ctx=256, heads=4, kv_heads=2, head_size=64)
    plain = bench_prefill.PrefillCase("x", **kw)
    win = bench_prefill.PrefillCase("x", **kw, variants=workloads.Variants(window=32))
    cap = bench_prefill.PrefillCase("x", **kw, variants=workloads.Variants(soft_cap=30.0, sinks=True))
    assert plain.flops() == 4.0 * 64 * 4 * 2 * (64 * 192 + 64 * 65 // 2) == cap.flops()
    assert win.flops() == 4.0 * 64 * 4 * 2 * 64 * 32
    assert plain.kv_bytes() == cap.kv_bytes() == 2 * 2 * 256 * 2 * 64 * 2
    assert win.kv_bytes() == 2 * 2 * (64 + 31) * 2 * 64 * 2
    assert win.variant_args == dict(window=32) and plain.variant_args == {}


def test_prefill_peers_that_cannot_run_variants():
    from cupaged.bench import prefill as bench_prefill

    impls = list(bench_prefill.IMPLEMENTATIONS)
    for v, no in ((workloads.PLAIN, set()),
                  (workloads.Variants(window=4096), {"torch-sdpa-flash", "torch-sdpa-cudnn"}),
                  (workloads.Variants(soft_cap=50.0), {"torch-sdpa-flash", "torch-sdpa-cudnn"}),
                  (workloads.Variants(sinks=True), {"torch-sdpa-flash", "torch-sdpa-cudnn",
                                                "flashinfer-fa2", "flashinfer-fa3"}),
                  (workloads.Variants(alibi=True), {"torch-sdpa-flash", "torch-sdpa-cudnn",
                                                "flashinfer-fa2", "flashinfer-fa3"})):
        assert {i for i in impls if bench_prefill.variant_unsupported(i, v)} == no
    assert bench_prefill.variant_unsupported("flashinfer-fa3", workloads.Variants(
        sinks=True, alibi=True)) == ("flashinfer-fa3 is run with window_left and "
                                     "logits_soft_cap only, not sinks or ALiBi")
    case = bench_prefill.PrefillCase("x", 1, 4, 4, variants=workloads.Variants(window=2))
    with pytest.raises(NotImplementedError, match="torch-sdpa-flash runs plain attention only"):
        bench_prefill.IMPLEMENTATIONS["torch-sdpa-flash"](case)


# ---- the cases' plumbing on the host: NumPy for CuPy, the float64 reference for the kernels ----


def on_host(monkeypatch):
    """Run the bench cases without a GPU: CuPy's few calls answered by NumPy, cupaged's
    entry points by the float64 reference (writing the outputs they are given), the
    timer by a constant. Returns the list of ``(entry point, keyword arguments)`` of the
    calls made."""
    import cupaged
    from cupaged import decode, planning, reference
    from cupaged.bench import cascade as bench_cascade
    from cupaged.bench import mla as bench_mla
    from cupaged.bench import prefill as bench_prefill

    calls = []
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    shim = types.SimpleNamespace(
        asarray=np.asarray, asnumpy=np.asarray, full=np.full, empty=np.empty,
        arange=np.arange, where=np.where, minimum=np.minimum,
        ascontiguousarray=np.ascontiguousarray, random=np.random,
        get_default_memory_pool=lambda: pool,
        cuda=types.SimpleNamespace(Device=lambda *a: types.SimpleNamespace(id=0),
                                   get_current_stream=lambda: types.SimpleNamespace(ptr=0),
                                   memory=types.SimpleNamespace(OutOfMemoryError=MemoryError)))
    for mod in (workloads, bench_decode, timing, peers, bench_prefill, bench_cascade, bench_mla):
        monkeypatch.setattr(mod, "cupy", shim)
    monkeypatch.setattr(peers, "import_torch", lambda: None)
    monkeypatch.setattr(planning, "device_info", lambda i: planning.DeviceInfo(i, "sm_90", 132, 232448, 233472))
    monkeypatch.setattr(timing, "time_us", lambda fn, reps=30, **kw: timing.Timing(
        100.0, 90.0, 110.0, reps))

    def attend(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *,
               kv_layout="NHD", causal=True, out=None, lse=None, return_lse=False,
               max_query_len=None, max_seq_len=None, **kw):
        o, l = reference.attention(query, key_cache, value_cache, block_tables, seq_lens,
                                   query_start_loc, kv_layout=kv_layout, causal=causal,
                                   return_lse=True, **kw)
        out = np.empty(query.shape, query.dtype) if out is None else out
        out[...] = o
        if lse is None and not return_lse:
            return out
        if lse is None:
            lse = np.empty(l.shape, np.float32)
        lse[...] = l
        return out, lse

    def attention(*args, **kw):
        calls.append(("attention", kw))
        return attend(*args, **kw)

    def paged_attention(*args, max_context_len=None, partition="auto", **kw):
        calls.append(("paged_attention", kw))
        return attend(*args, kv_layout="vllm", **kw)

    def merge_state(oa, la, ob, lb, *, out=None, lse_out=None):
        calls.append(("merge_state", {}))
        o, l = reference.merge_state(oa, la, ob, lb)
        out[...], lse_out[...] = o, l
        return out, lse_out

    for mod, name, fn in ((cupaged, "attention", attention), (sys.modules["cupaged.attention"], "attention", attention),
                          (cupaged, "paged_attention", paged_attention),
                          (decode, "paged_attention", paged_attention),
                          (cupaged, "merge_state", merge_state)):
        monkeypatch.setattr(mod, name, fn)
    return calls


@pytest.mark.parametrize("impl", ["cupaged", "cupaged-nhd", "cupaged-hnd"])
def test_decode_variants_reach_every_cupaged_run_and_the_reference(monkeypatch, impl):
    calls = on_host(monkeypatch)
    v = workloads.Variants(window=40, soft_cap=3.0, sinks=True, alibi=True)
    w = workloads.Workload(3, (1, 150), 8, 2, 64, 16, "float32", variants=v)
    rows = bench_decode.measure(w, [impl], reps=3, copy_bw=1e12)
    assert len(rows) == 1 and rows[0].status == "ok", rows[0].note
    assert rows[0].rel_err < 1e-6  # the fake kernel is the reference itself
    assert (rows[0].window, rows[0].soft_cap, rows[0].sinks, rows[0].alibi) == (40, 3.0, True, True)
    kw = calls[0][1]
    assert calls[0][0] == ("paged_attention" if impl == "cupaged" else "attention")
    assert kw["window"] == 40 and kw["logits_soft_cap"] == 3.0
    assert np.array_equal(kw["sinks"], workloads.sink_values(8))
    assert np.array_equal(kw["alibi_slopes"], workloads.alibi_slopes(8))
    if impl == "cupaged":
        assert rows[0].kernel == "paged_decode_f32_hs64_bs16_vllm_wc_g4_sm90"


def test_decode_check_fails_when_the_reference_has_other_variants(monkeypatch):
    """The check's reference really gets the case's variants: a run without them fails."""
    calls = on_host(monkeypatch)
    from cupaged import decode

    plain_run = decode.paged_attention

    def forgetful(*args, **kw):
        for k in ("window", "logits_soft_cap", "sinks", "alibi_slopes"):
            kw.pop(k, None)
        return plain_run(*args, **kw)

    monkeypatch.setattr(decode, "paged_attention", forgetful)
    w = workloads.Workload(2, 200, 8, 2, 64, 16, "float32", variants=workloads.Variants(window=8))
    rows = bench_decode.measure(w, ["cupaged"], reps=3, copy_bw=1e12)
    assert rows[0].status == "failed" and "rel err" in rows[0].note and calls


def test_prefill_variants_reach_cupaged_and_the_reference(monkeypatch):
    from cupaged.bench import prefill as bench_prefill

    calls = on_host(monkeypatch)
    v = workloads.Variants(window=24, soft_cap=5.0, sinks=True)
    case = bench_prefill.PrefillCase("x", 2, 40, 100, 8, 2, 64, 16, "float32", variants=v)
    rows = bench_prefill.measure([case], ["cupaged"], reps=3, copy_bw=1e12)
    assert rows[0].note == "" and rows[0].error < 1e-6
    kw = calls[0][1]
    assert kw["window"] == 24 and kw["logits_soft_cap"] == 5.0 and kw["causal"]
    assert np.array_equal(kw["sinks"], workloads.sink_values(8))
    assert rows[0].tflops == pytest.approx(case.flops() / 100e-6 / 1e12)
    assert case.flops() == 4.0 * 64 * 8 * 2 * bench_prefill.attended_pairs(40, 100, True, 24)


@pytest.mark.parametrize("layout", ["HND", "vllm"])
def test_prefill_case_in_another_layout_holds_the_same_values(monkeypatch, layout):
    from cupaged.bench import prefill as bench_prefill

    calls = on_host(monkeypatch)
    nhd = bench_prefill.PrefillCase("x", 2, 20, 50, 4, 2, 64, 16, "float32").build()
    other = bench_prefill.PrefillCase("x", 2, 20, 50, 4, 2, 64, 16, "float32",
                                      kv_layout=layout).build()
    from cupaged import testing

    k, v = testing.convert_layout(np.asarray(nhd.arrays["key_cache"]),
                                  np.asarray(nhd.arrays["value_cache"]), "NHD", layout)
    assert np.array_equal(np.asarray(other.arrays["key_cache"]), k)
    assert np.array_equal(np.asarray(other.arrays["value_cache"]), v)
    rows = bench_prefill.measure([other], ["cupaged", "flashinfer-fa3"], reps=3, copy_bw=1e12)
    assert rows[0].note == "" and rows[0].error < 1e-6
    assert calls[0][1]["kv_layout"] == layout
    assert f"reads NHD caches here, not {layout}" in rows[1].note


# ---- cascade attention ----------------------------------------------------------------------------


def test_cascade_tables_share_the_prefix_blocks(rng):
    from cupaged.bench import cascade as bench_cascade

    pt, st, full, nb = bench_cascade.cascade_tables(5, 64, 20, 16, rng)
    assert pt.shape == (1, 4) and st.shape == (5, 2) and full.shape == (5, 6) and nb == 4 + 10
    assert all(x.dtype == np.int32 for x in (pt, st, full))
    assert (full[:, :4] == pt).all() and (full[:, 4:] == st).all()
    assert sorted(np.concatenate([pt.ravel(), st.ravel()]).tolist()) == list(range(nb))
    with pytest.raises(ValueError, match="multiple of the block size"):
        bench_cascade.cascade_tables(5, 60, 20, 16, rng)


@pytest.mark.parametrize("kw, msg", [
    (dict(prefix=100), "prefix \\(100\\) must be a multiple of the block size \\(16\\)"),
    (dict(seqs=65, prefix=64), "seqs must be <= prefix"),
    (dict(heads=12, kv_heads=8), "multiple of kv_heads"),
    (dict(suffix=0), "suffix must be at least 1"),
    (dict(kv_layout="nhd"), "kv_layout must be one of"),
    (dict(dtype="int8"), "unknown dtype"),
])
def test_cascade_case_refuses_impossible_shapes(kw, msg):
    from cupaged.bench import cascade as bench_cascade

    with pytest.raises(ValueError, match=msg):
        bench_cascade.CascadeCase(**kw)


def test_cascade_bytes():
    from cupaged.bench import cascade as bench_cascade

    c = bench_cascade.CascadeCase()
    b = c.step_bytes()
    kv_token = 2 * 8 * 128 * 2
    q = 128 * 32 * 128 * 2
    lse = 128 * 32 * 4
    assert b["plain"] == 128 * (32768 + 256) * kv_token + 2 * q
    assert b["prefix"] == 32768 * kv_token + 2 * q + lse
    assert b["suffix"] == 128 * 256 * kv_token + 2 * q + lse
    assert b["merge"] == 3 * (q + lse)
    assert b["cascade"] == b["prefix"] + b["suffix"] + b["merge"]
    assert b["plain"] / b["cascade"] > 30  # the prefix read once, not 128 times


@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm"])
def test_cascade_equals_plain_decode_on_the_host(monkeypatch, layout):
    """The three calls, run by the float64 reference, give plain decode: the tables,
    the prefix pass (one sequence, all queries, non-causal) and the merge are right."""
    from cupaged.bench import cascade as bench_cascade

    calls = on_host(monkeypatch)
    case = bench_cascade.CascadeCase(6, 64, 21, 8, 2, 64, 16, "float32", layout)
    rows, checks = bench_cascade.measure(case, reps=3, copy_bw=1e12, check_seqs=3)
    assert checks["ok"] and checks["checked_seqs"] == [0, 2, 5], checks
    assert checks["cascade_vs_plain"] < 1e-6 and checks["cascade_vs_reference"] < 1e-6
    assert checks["lse_cascade_vs_plain"] < 1e-6
    assert [r.step for r in rows] == ["plain", "cascade", "prefix", "suffix", "merge"]
    assert all(r.status == "ok" and r.median_us == 100.0 for r in rows)
    assert rows[0].ratio_to_plain == 1.0 and bench_cascade.speedup(rows) == 1.0
    plain_entry = "paged_attention" if layout == "vllm" else "attention"
    names = [n for n, _ in calls]
    assert names[:4] == [plain_entry, "attention", plain_entry, "merge_state"]
    prefix = calls[1][1]
    assert prefix["causal"] is False and prefix["max_query_len"] == 6
    assert prefix["kv_layout"] == layout and prefix["lse"] is not None
    assert calls[2][1]["lse"] is not None and "lse" in calls[0][1]  # the check's plain run


def test_cascade_check_catches_a_wrong_merge(monkeypatch):
    import cupaged
    from cupaged.bench import cascade as bench_cascade

    on_host(monkeypatch)
    monkeypatch.setattr(cupaged, "merge_state", lambda oa, la, ob, lb, out, lse_out: (out, lse_out))
    rows, checks = bench_cascade.measure(bench_cascade.CascadeCase(4, 32, 5, 4, 2, 32, 16,
                                                                   "float32"), reps=3)
    assert not checks["ok"] and checks["cascade_vs_plain"] == float("inf")  # NaN-poisoned out
    assert all(r.status == "failed" and r.median_us != r.median_us for r in rows)


# ---- on a GPU: variants and the cascade through the bench machinery ----------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("variants", [dict(window=100), dict(soft_cap=5.0), dict(sinks=True),
                                      dict(alibi=True),
                                      dict(window=33, soft_cap=8.0, sinks=True, alibi=True)])
def test_decode_variants_measure_and_check(variants):
    w = workloads.Workload(3, (1, 300), 8, 2, 128, 16, "bfloat16", variants=workloads.Variants(**variants))
    rows = bench_decode.measure(w, ["cupaged", "cupaged-nhd", "cupaged-hnd"], reps=3, copy_bw=1e12)
    for r in rows:
        assert r.status == "ok" and r.rel_err <= testing.TOLERANCE["bf16"], (r.impl, r.note)
        assert r.window == variants.get("window") and r.sinks == variants.get("sinks", False)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
def test_cascade_measures_and_checks(layout):
    from cupaged.bench import cascade as bench_cascade

    case = bench_cascade.CascadeCase(8, 256, 40, 8, 2, 128, 16, "bfloat16", layout)
    rows, checks = bench_cascade.measure(case, reps=3, copy_bw=1e12)
    assert checks["ok"], checks
    assert all(r.status == "ok" and r.median_us > 0 for r in rows)


# ---- cupaged-bench ab: the parts without a GPU --------------------------------------------------


@pytest.mark.parametrize("setting, parsed", [
    ("-", (None, None, "auto")),
    ("2@never", (None, 2, "never")),
    ("2@auto@128x2", ((128, 2), 2, "auto")),
    ("-@auto@64x3", ((64, 3), None, "auto")),
    ("-@always", (None, None, "always")),
    ("-@flat", (None, None, "flat")),
    ("3@512", (None, 3, 512)),
    ("1@@64x4", ((64, 4), 1, "auto")),
])
def test_tuning_settings_parse(setting, parsed):
    from cupaged.bench import ab

    assert ab.parse_setting(setting) == parsed


def test_partition_lever_plans_with_its_partition_and_restores(monkeypatch):
    """attention() always plans decode with "auto": the lever hands planning.plan_decode
    its own partition while active, and puts the real one back."""
    from cupaged import planning
    from cupaged.bench import ab

    seen = []
    monkeypatch.setattr(planning, "plan_decode", lambda p, m, part, *a, **k: seen.append(part))
    monkeypatch.setattr(planning, "set_tuning", lambda *a: seen.append(("tuning", a)))
    real = planning.plan_decode
    with ab._Partition() as lever:
        lever.set((64, 3), 2, "never")
        planning.plan_decode(None, 1024, "auto", None)
        lever.set(None, None, 256)
        planning.plan_decode(None, 1024, "auto", None)
    assert planning.plan_decode is real
    assert seen == [("tuning", ((64, 3), 2)), "never", ("tuning", (None, None)), 256,
                    ("tuning", ())]


def test_load_tree_imports_another_copy_of_the_library(tmp_path):
    """The other tree runs its own code (its modules import each other relatively) and
    compiles from its own cuda_src; with torch imported it leaves torch.ops.cupaged to the
    library's own ops (its own would take them over, and take them away when dropped)."""
    import gc
    import shutil
    import sys
    from pathlib import Path

    torch = pytest.importorskip("torch")
    import cupaged.integrations.torch_ops  # noqa: F401  (torch.ops.cupaged, the library's)

    from cupaged.bench import ab

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "cupaged", tmp_path / "cupaged",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root / "cuda_src", tmp_path / "cuda_src")
    (tmp_path / "cupaged" / "marker.py").write_text("WHO = 'other'\n")
    alias = "cupaged_ab_test_tree"
    try:
        other = ab.load_tree(str(tmp_path), alias)
        assert other.__name__ == alias and other is not sys.modules["cupaged"]
        assert other.jit.__name__ == f"{alias}.jit"
        assert other.jit.source_dir() == tmp_path / "cuda_src"
        assert importlib_marker(alias) == "other"
        assert callable(other.attention) and callable(other.paged_attention)
        assert ab.load_tree(str(tmp_path), alias) is other
        assert f"{alias}.integrations.torch_ops" not in sys.modules
    finally:
        for name in [m for m in sys.modules if m == alias or m.startswith(alias + ".")]:
            del sys.modules[name]
    del other
    gc.collect()
    torch.ops.cupaged.attention.default  # the library's ops outlive the other tree


def importlib_marker(alias):
    import importlib

    return importlib.import_module(f"{alias}.marker").WHO


def test_load_tree_refuses_a_folder_without_the_library(tmp_path):
    from cupaged.bench import ab

    with pytest.raises(FileNotFoundError, match="holds no cupaged/__init__.py and cuda_src/"):
        ab.load_tree(str(tmp_path))


@pytest.mark.parametrize("value, wanted", [("", False), ("0", False), ("1", True),
                                           ("yes", True), ("on", True)])
def test_nvtx_ranges_follow_the_environment(monkeypatch, value, wanted):
    monkeypatch.setenv("CUPAGED_BENCH_NVTX", value)
    assert timing.nvtx_wanted() is wanted
