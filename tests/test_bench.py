"""cupaged.bench without a GPU: FlashInfer's inputs built from a case (page lists, the
"HND" layout), FlashInfer's optional presence, and the plan_us field. The timed rows
themselves run on the device (tools/flashinfer_sweep.sh, the compare GPU test)."""

import os
import subprocess
import sys
import types

import numpy as np
import pytest

from cupaged import bench, testing

BLOCK = 16


def _seq_lens_flashinfer(indptr, last_page_len, page_size):
    """FlashInfer's own rule (flashinfer.page.get_seq_lens, paged_kv_t::get_length)."""
    pages = np.diff(indptr)
    return np.where(pages > 0, np.maximum(pages - 1, 0) * page_size + last_page_len, 0)


def test_page_lists_cover_each_sequence_in_order(rng):
    lens = rng.integers(1, 20 * BLOCK, 40)
    lens[:6] = [1, BLOCK, 2 * BLOCK, BLOCK + 1, BLOCK - 1, 7 * BLOCK]  # edges, block multiples
    tables, _ = testing.random_block_tables(lens, BLOCK, rng, extra_columns=3)
    indptr, indices, last = bench._flashinfer_pages(tables, lens, BLOCK)
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
    indptr, indices, last = bench._flashinfer_pages(tables, lens, BLOCK)
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
        bench._flashinfer_pages(np.zeros((2, width), np.int32), lens, BLOCK)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_hnd_views_hold_the_same_values(rng, dtype):
    kvh, hs, nb = 2, 32, 5
    kc, vc = testing.random_cache(nb, kvh, hs, BLOCK, dtype, rng)
    x = kc.shape[-1]
    k, v = bench._to_hnd(kc, vc)
    k = np.ascontiguousarray(k).reshape(nb, kvh, BLOCK, hs)  # as FlashInfer's copy
    assert v.shape == (nb, kvh, BLOCK, hs)
    b, h, t, d = (rng.integers(0, n, 200) for n in (nb, kvh, BLOCK, hs))
    assert np.array_equal(k[b, h, t, d], kc[b, h, d // x, t, d % x])
    assert np.array_equal(v[b, h, t, d], vc[b, h, d, t])


def test_flashinfer_rows_listed_only_when_importable(monkeypatch, no_flashinfer):
    assert bench.flashinfer_unavailable() == "No module named 'flashinfer'"
    assert not set(bench.available_implementations()) & set(bench.FLASHINFER_IMPLS)
    monkeypatch.setattr(bench, "_flashinfer", lambda: (types.ModuleType("flashinfer"), None))
    listed = bench.available_implementations()
    assert listed[-3:] == ["flashinfer-decode", "flashinfer-decode-tc", "flashinfer-xqa"]
    assert set(bench.FLASHINFER_IMPLS) == set(listed[-3:])


def test_flashinfer_without_torch_gpu_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(bench, "_torch", lambda: None)
    assert bench.flashinfer_unavailable() == "torch sees no CUDA device"


def test_xqa_row_without_xqa_gives_its_reason(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.2.0"
    fake.decode = types.ModuleType("flashinfer.decode")  # no xqa_batch_decode_with_kv_cache
    monkeypatch.setattr(bench, "_flashinfer", lambda: (fake, None))
    with pytest.raises(NotImplementedError,
                       match=r"flashinfer 0\.2\.0 has no flashinfer\.decode\.xqa_batch_decode"):
        bench._run_flashinfer_xqa(None, "auto")  # before touching the case


def test_flashinfer_factories_refuse_without_flashinfer(no_flashinfer):
    for name in bench.FLASHINFER_IMPLS:
        with pytest.raises(RuntimeError, match="No module named 'flashinfer'"):
            bench.IMPLEMENTATIONS[name][0](None, "auto")


def test_import_cupaged_imports_neither_flashinfer_nor_torch(tmp_path):
    # a "flashinfer" first on the path that fails loudly if anything imports it
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise SystemExit('imported')\n")
    code = ("import sys, cupaged, cupaged.bench, cupaged.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flashinfer', 'torch')))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
    sanity = subprocess.run([sys.executable, "-c", "import flashinfer"], env=env)
    assert sanity.returncode != 0  # the trap works


def test_result_has_plan_us_nan_by_default():
    r = bench.Result("cupaged", "", "", 1, "512", 512.0, 32, 8, 128, 16, "float16", "auto", "ok")
    assert r.plan_us != r.plan_us
    assert bench.Result(**{**r.__dict__, "plan_us": 612.5}).plan_us == 612.5


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
    assert bench.kv_cache_dtype_name(name) == canonical


@pytest.mark.parametrize("bad", ["e4m3", "fp16", "float8_e4m3fn", "FP8", 8])
def test_unknown_kv_cache_dtype_is_refused(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto', 'fp8'"):
        bench.kv_cache_dtype_name(bad)
    with pytest.raises(ValueError, match="kv_cache_dtype must be "):
        bench.Workload(1, 16, 8, 2, 64, 16, "float16", kv_cache_dtype=bad)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_random_fp8_holds_every_finite_value_and_nothing_else(rng, fmt):
    b = bench.random_fp8((40, 2, 8, 16), fmt, rng)
    assert b.dtype == np.uint8 and b.shape == (40, 2, 8, 16)
    finite = _finite_fp8_bytes(fmt)
    assert len(finite) == (254 if fmt == "fp8_e4m3" else 248)
    assert set(np.unique(b).tolist()) == finite  # 10240 draws of ~250 patterns: all seen


def _case(kv_cache_dtype, lens=(5, 17, 300)):
    return bench.DecodeCase(len(lens), np.array(lens, np.int32), 8, 2, 128, 16,
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
    assert fp8.kv_args == dict(kv_cache_dtype="fp8_e4m3", k_scale=bench.FP8_SCALES["fp8_e4m3"],
                               v_scale=bench.FP8_SCALES["fp8_e4m3"])
    assert fp8.tolerance() == f16.tolerance() == testing.TOLERANCE["f16"]


def test_workload_carries_the_kv_cache_dtype_to_its_case():
    w = bench.Workload(4, (10, 90), 8, 2, 64, 16, "bfloat16", "p", "fp8")
    assert w.kv_cache_dtype == "fp8_e4m3"
    c = w.case(seed=2)
    assert c.kv_cache_dtype == "fp8_e4m3" and c.batch == 4 and c.head_size == 64
    assert bench.Workload(4, 10, 8, 2, 64, 16, "float16").case(0).kv_cache_dtype == "auto"


def test_fp8_case_names_its_specialization(monkeypatch):
    import cupy

    from cupaged import decode

    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: types.SimpleNamespace(id=0))
    monkeypatch.setattr(decode, "_device", lambda i: decode._Device(i, "sm_90", 132, 232448))
    assert _case("auto").spec_name() == "paged_decode_f16_hs128_bs16_vllm_g4_sm90"
    assert _case("fp8").spec_name() == "paged_decode_f16_e4m3_hs128_bs16_vllm_g4_sm90"
    assert _case("fp8_e5m2").spec_name() == "paged_decode_f16_e5m2_hs128_bs16_vllm_g4_sm90"


def test_peers_without_an_fp8_path_are_named():
    for impl in bench.IMPLEMENTATIONS:
        assert bench.fp8_unsupported(impl, "auto") is None
    no_e4m3 = {i for i in bench.IMPLEMENTATIONS if bench.fp8_unsupported(i, "fp8")}
    no_e5m2 = {i for i in bench.IMPLEMENTATIONS if bench.fp8_unsupported(i, "fp8_e5m2")}
    assert no_e4m3 == {"cupy-gather", "torch-sdpa-paged", "torch-sdpa-dense"}
    assert no_e5m2 == no_e4m3 | {"flashinfer-xqa"}
    assert "e4m3 caches only" in bench.fp8_unsupported("flashinfer-xqa", "fp8_e5m2")
    assert "cupy-gather" not in bench.available_implementations("fp8_e4m3")
    assert "cupy-gather" in bench.available_implementations()


@pytest.mark.parametrize("impl", ["cupy-gather", "torch-sdpa-paged", "torch-sdpa-dense"])
def test_gather_peers_refuse_an_fp8_case_with_a_reason(impl):
    with pytest.raises(NotImplementedError, match="no fp8 cache path"):
        bench.IMPLEMENTATIONS[impl][0](_case("fp8"), "auto")  # before touching its arrays


def test_result_says_its_kv_cache_dtype():
    import dataclasses

    r = bench.Result("cupaged", "", "", 1, "512", 512.0, 32, 8, 128, 16, "float16", "auto", "ok")
    assert r.kv_cache_dtype == "auto"
    assert "kv_cache_dtype" in {f.name for f in dataclasses.fields(bench.Result)}
    assert bench.Result(**{**r.__dict__, "kv_cache_dtype": "fp8_e4m3"}).kv_cache_dtype == "fp8_e4m3"


def test_prefill_case_over_fp8_counts_one_byte():
    from cupaged import bench_prefill

    kw = dict(batch=2, q_len=8, ctx=64, heads=4, kv_heads=2, head_size=64)
    bf16 = bench_prefill.PrefillCase("x", **kw)
    fp8 = bench_prefill.PrefillCase("x", **kw, kv_cache_dtype="fp8")
    assert fp8.kv_cache_dtype == "fp8_e4m3" and bf16.kv_args == {}
    assert bf16.kv_bytes() == 2 * fp8.kv_bytes() == 2 * 2 * 64 * 2 * 64 * 2
    assert fp8.flops() == bf16.flops()
    assert fp8.kv_args["k_scale"] == bench.FP8_SCALES["fp8_e4m3"]


# ---- on a GPU: a tiny fp8 decode through the bench machinery ------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_decode_measures_and_checks(fmt, dtype):
    import cupy

    from cupaged import decode

    w = bench.Workload(3, (1, 300), 8, 2, 128, 16, dtype, kv_cache_dtype=fmt)
    rows = bench.measure(w, ["cupaged", "cupaged-nhd", "cupaged-hnd"], reps=3, copy_bw=1e12)
    assert [r.impl for r in rows] == ["cupaged", "cupaged-nhd", "cupaged-hnd"]
    tol = testing.TOLERANCE["f16" if dtype == "float16" else "bf16"]
    for r in rows:
        assert r.status == "ok", r.note
        assert r.rel_err <= tol and r.kv_cache_dtype == fmt
    # the row names the specialization decode launched for this cache
    name = fmt.split("_")[1]
    launched = decode._kernels(cupy.cuda.Device().id, "f16" if dtype == "float16" else "bf16",
                               128, 16, decode._group_tile(4), "vllm", name, "").name
    assert rows[0].kernel == launched and f"_{name}_" in launched


@pytest.mark.gpu
def test_fp8_case_caches_are_finite_bytes_in_vllm_layout():
    import cupy

    c = bench.Workload(2, 40, 8, 2, 64, 16, "float16", kv_cache_dtype="fp8_e5m2").case(0).build()
    kc, vc = c.arrays["key_cache"], c.arrays["value_cache"]
    nb = kc.shape[0]
    assert kc.dtype == vc.dtype == np.uint8
    assert kc.shape == (nb, 2, 64 // 16, 16, 16) and vc.shape == (nb, 2, 64, 16)
    seen = set(cupy.asnumpy(cupy.unique(cupy.concatenate([kc.ravel(), vc.ravel()]))).tolist())
    assert seen == _finite_fp8_bytes("fp8_e5m2")
    c.arrays.clear()
