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
