"""cupaged-bench mla without a GPU: its options, presets, byte and FLOP accounting, the
case's data and check on the host (NumPy for CuPy, the float64 reference for the kernel),
and FlashInfer's absence. The timed rows run on the device (the GPU tests at the end)."""

import math
import types

import numpy as np
import pytest
from click.testing import CliRunner

from cupaged import _dtypes, reference, testing
from cupaged.bench import cli
from cupaged.bench import mla as bench_mla
from cupaged.bench import peers, prefill, timing

from conftest import HAVE_GPU
from test_bench import on_host

BF16 = _dtypes.BF16.numpy

main = cli.main


# ---- presets and accounting -----------------------------------------------------------------------


def test_presets_are_the_issues_shapes():
    got = {n: bench_mla.preset_case(n) for n in bench_mla.PRESETS}
    assert list(got) == ["dsv3-16h-4k", "dsv3-16h-32k", "dsv3-128h-4k", "dsv3-128h-4k-q2"]
    assert [(c.heads, c.batch, c.context, c.q_len) for c in got.values()] == [
        (16, 128, 4096, 1), (16, 128, 32768, 1), (128, 128, 4096, 1), (128, 128, 4096, 2)]
    for c in got.values():
        assert (c.block_size, c.dtype, c.causal) == (64, "bfloat16", True)
        assert c.scale == 1 / math.sqrt(192) == bench_mla.DSV3_SCALE
    c = bench_mla.preset_case("dsv3-128h-4k", block_size=16, dtype="float16")
    assert (c.block_size, c.dtype, c.heads) == (16, "float16", 128)


# Hand-computed: cache 576 x 2 bytes per token read once, q 576 and out 512 per (token,
# head); FLOPs 2 x (576 + 512) per (head, visible key).
@pytest.mark.parametrize("name, bytes_moved, flops", [
    ("dsv3-16h-4k", 603_979_776 + 2_359_296 + 2_097_152, 18_253_611_008),
    ("dsv3-16h-32k", 4_831_838_208 + 2_359_296 + 2_097_152, 146_028_888_064),
    ("dsv3-128h-4k", 603_979_776 + 18_874_368 + 16_777_216, 146_028_888_064),
    # two query tokens, causal: the first sees 4095 keys, the second 4096
    ("dsv3-128h-4k-q2", 603_979_776 + 37_748_736 + 33_554_432, 292_022_124_544),
])
def test_preset_bytes_and_flops(name, bytes_moved, flops):
    c = bench_mla.preset_case(name)
    assert c.bytes_moved() == bytes_moved
    assert c.flops() == flops


def test_small_case_bytes_and_flops():
    kw = dict(heads=4, batch=3, context=70, q_len=2, block_size=16, dtype="float16")
    c = bench_mla.MLACase("x", **kw)
    assert c.kv_bytes() == 3 * 70 * 576 * 2 == 241_920  # a partial last page: tokens only
    assert c.bytes_moved() == 241_920 + 6 * 4 * 576 * 2 + 6 * 4 * 512 * 2 == 294_144
    assert c.flops() == 2 * 4 * 3 * (69 + 70) * 1088 == 3_629_568
    assert bench_mla.MLACase("x", causal=False, **kw).flops() == 2 * 4 * 3 * 140 * 1088


@pytest.mark.parametrize("kw, msg", [
    (dict(context=3, q_len=4), r"context \(3\) counts the query tokens: at least q_len \(4\)"),
    (dict(heads=0), "heads must be at least 1"),
    (dict(block_size=0), "block_size must be at least 1"),
    (dict(dtype="float32"), "dtype must be one of bfloat16, float16"),
])
def test_impossible_cases_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        bench_mla.MLACase("x", **kw)


def test_checked_sequences():
    assert bench_mla.MLACase("x", batch=128).check_seqs() == [0, 64, 127]
    assert bench_mla.MLACase("x", batch=2).check_seqs() == [0, 1]
    assert bench_mla.MLACase("x", batch=1).check_seqs() == [0]


# ---- the case on the host: its data, its check, the rows ----------------------------------------


def fake_mla(monkeypatch, calls, **override):
    """cupaged.mla_attention answered by the float64 reference, written into ``out``;
    ``override``: arguments the fake gives the reference instead of the caller's."""
    import cupaged

    def mla_attention(q, kv_cache, block_tables, seq_lens, query_start_loc=None, *, scale,
                      kv_lora_rank=None, causal=True, out=None, max_query_len=None,
                      max_seq_len=None, **kw):
        calls.append(dict(query_start_loc=query_start_loc, scale=scale, causal=causal,
                          kv_lora_rank=kv_lora_rank, max_query_len=max_query_len,
                          max_seq_len=max_seq_len, out=out, **kw))
        args = dict(block_tables=block_tables, scale=scale, causal=causal)
        args.update(override)
        out[...] = reference.mla_attention(q, kv_cache, args["block_tables"], seq_lens,
                                           query_start_loc, scale=args["scale"],
                                           kv_lora_rank=kv_lora_rank, causal=args["causal"])
        return out

    monkeypatch.setattr(cupaged, "mla_attention", mla_attention, raising=False)


def _case(**kw):
    return bench_mla.MLACase("x", **{**dict(heads=4, batch=5, context=70, q_len=2,
                                            block_size=16, dtype="float16"), **kw})


def test_case_data_is_random_and_its_blocks_scattered(monkeypatch):
    on_host(monkeypatch)
    c = _case().build()
    a = c.arrays
    assert a["q"].shape == (10, 4, 576) and a["kv_cache"].shape == (25, 16, 576)
    assert a["q"].dtype == a["kv_cache"].dtype == np.float16
    assert np.all(a["kv_cache"] != 0) or np.mean(a["kv_cache"] == 0) < 1e-3  # never zeros
    assert a["block_tables"].shape == (5, 5) and a["block_tables"].dtype == np.int32
    assert sorted(a["block_tables"].ravel().tolist()) == list(range(25))
    assert not np.array_equal(a["block_tables"].ravel(), np.arange(25))  # shuffled
    assert np.array_equal(c.tables, a["block_tables"])
    assert a["seq_lens"].tolist() == [70] * 5 and a["query_start_loc"].tolist() == [0, 2, 4, 6, 8, 10]


@pytest.mark.parametrize("q_len", [1, 3])
def test_cupaged_row_is_checked_then_timed(monkeypatch, q_len):
    on_host(monkeypatch)
    calls = []
    fake_mla(monkeypatch, calls)
    c = _case(q_len=q_len)
    rows = bench_mla.measure([c], ["cupaged"], reps=3, copy_bw=1e12)
    (r,) = rows
    assert r.note == "" and r.error < 1e-3 and r.ran  # the reference rounded to float16
    assert (r.median_us, r.p10_us, r.p90_us) == (100.0, 90.0, 110.0)
    assert r.tflops == pytest.approx(c.flops() / 100e-6 / 1e12)
    assert r.pct_copy == pytest.approx(100 * c.bytes_moved() / 100e-6 / 1e12)
    kw = calls[0]
    assert kw["scale"] == bench_mla.DSV3_SCALE and kw["causal"] and kw["kv_lora_rank"] == 512
    assert kw["max_query_len"] == q_len and kw["max_seq_len"] == 70
    assert kw["out"].shape == (5 * q_len, 4, 512)
    if q_len == 1:  # decode: one token per sequence, no query_start_loc
        assert kw["query_start_loc"] is None
    else:
        assert kw["query_start_loc"].tolist() == list(range(0, 5 * q_len + 1, q_len))
    assert c.arrays == {} and c.refs == []  # freed after the case


@pytest.mark.parametrize("impl, family", [("cupaged", None), ("cupaged-mma", "mma"),
                                          ("cupaged-sm90", "sm90")])
def test_forcing_runners_run_their_family_and_give_the_planner_back(monkeypatch, impl,
                                                                    family):
    """cupaged-mma / cupaged-sm90 run mla_attention with that kernel family forced (the A/B
    of the two in one run), and the planner's own choice returns after the row."""
    from cupaged import planning

    on_host(monkeypatch)
    calls = []
    fake_mla(monkeypatch, calls)
    seen = []
    monkeypatch.setattr(planning, "set_mla_family",
                        lambda f, real=planning.set_mla_family: (seen.append(f), real(f)))
    (r,) = bench_mla.measure([_case()], [impl], reps=3, copy_bw=1e12)
    assert r.note == "" and calls
    assert seen[0] == family and seen[-1] is None


def test_the_sm90_runner_refuses_other_gpus(monkeypatch):
    """cupaged-sm90 on a GPU without wgmma is a row note, not the mma.sync kernel's time
    under the wgmma kernel's name; the planner's choice returns after it."""
    from cupaged import planning

    on_host(monkeypatch)
    fake_mla(monkeypatch, [])
    monkeypatch.setattr(planning, "device_info",
                        lambda i: planning.DeviceInfo(i, "sm_80", 108, 166912, 167936))
    (r,) = bench_mla.measure([_case()], ["cupaged-sm90"], reps=3, copy_bw=1e12)
    assert "needs an sm_90 GPU: this one is sm_80" in r.note and math.isnan(r.median_us)
    (r,) = bench_mla.measure([_case()], ["cupaged-mma"], reps=3, copy_bw=1e12)
    assert r.note == ""


@pytest.mark.parametrize("override", [
    dict(scale=1 / math.sqrt(576)),  # one over the root of the key's length
    dict(causal=False),  # the first query token seeing the second's key
    dict(block_tables=np.tile(np.arange(5, dtype=np.int32), (5, 1))),  # tables ignored
])
def test_check_catches_a_wrong_kernel_and_does_not_time_it(monkeypatch, override):
    on_host(monkeypatch)
    fake_mla(monkeypatch, [], **override)
    (r,) = bench_mla.measure([_case()], ["cupaged"], reps=3, copy_bw=1e12)
    assert r.note == "WRONG" and r.error > _case().tolerance() and r.ran
    assert math.isnan(r.median_us) and math.isnan(r.tflops)


def test_check_reads_only_the_checked_sequences_blocks(monkeypatch):
    """The reference runs on each checked sequence's own blocks, copied to the host, all
    heads at once, and agrees with one over the whole cache."""
    on_host(monkeypatch)
    c = _case(batch=7, q_len=1).build()
    a = c.arrays
    whole = reference.mla_attention(a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"],
                                    scale=c.scale)
    calls, real = [], reference.mla_attention
    monkeypatch.setattr(reference, "mla_attention", lambda q, cache, *a, **kw:
                        calls.append((q.shape[1], len(cache))) or real(q, cache, *a, **kw))
    assert c.check(whole.astype(np.float16)) < 1e-3
    n_blocks = -(-c.context // c.block_size)
    assert [s for s, _ in c.refs] == [0, 3, 6] and calls == [(c.heads, n_blocks)] * 3
    for s, ref in c.refs:
        np.testing.assert_allclose(ref, whole[s:s + 1], rtol=1e-12, atol=1e-12)
    bad = whole.copy()
    bad[3, 2] *= 1.5  # one head of the middle sequence
    assert c.check(bad) == pytest.approx(0.5)
    bad[6, 0] = np.nan
    assert c.check(bad) == math.inf


def test_flashinfer_rows_without_flashinfer_say_so(monkeypatch, no_flashinfer):
    on_host(monkeypatch)
    fake_mla(monkeypatch, [])
    rows = bench_mla.measure([_case()], ["cupaged", "flashinfer-fa2", "flashinfer-fa3"], reps=3)
    assert rows[0].note == "" and rows[0].ran
    for r in rows[1:]:
        assert r.note == "RuntimeError: flashinfer unavailable: No module named 'flashinfer'"
        assert not r.ran and math.isnan(r.median_us) and math.isnan(r.error)


def test_flashinfer_rows_without_a_torch_gpu_say_so(monkeypatch):
    on_host(monkeypatch)  # torch: not importable with a GPU
    monkeypatch.setattr(peers, "import_flashinfer",
                        lambda: (None, "torch sees no CUDA device"))
    (r,) = bench_mla.measure([_case()], ["flashinfer-fa3"], reps=3)
    assert r.note == "RuntimeError: flashinfer unavailable: torch sees no CUDA device"


def test_a_failing_cupaged_is_a_row_note(monkeypatch):
    import cupaged

    on_host(monkeypatch)
    monkeypatch.delattr(cupaged, "mla_attention", raising=False)
    (r,) = bench_mla.measure([_case()], ["cupaged"], reps=3)
    assert r.note.startswith("AttributeError:") and "mla_attention" in r.note and not r.ran


# ---- the command line ---------------------------------------------------------------------------


@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU message")
def test_mla_without_gpu_exits_2():
    r = CliRunner().invoke(main, ["mla", "--preset", "dsv3-16h-4k"])
    assert r.exit_code == 2 and "no GPU" in r.output


def _on_fake_gpu(monkeypatch):
    monkeypatch.setattr(cli, "_gpu_count", lambda: 1)
    monkeypatch.setattr(timing, "copy_bandwidth", lambda: 3e12)
    monkeypatch.setattr(prefill, "matmul_tflops", lambda: 800.0)


def _asked(monkeypatch):
    """What mla.measure is asked for: [(cases, impls, reps)] (no rows come back)."""
    _on_fake_gpu(monkeypatch)
    asked = []
    monkeypatch.setattr(bench_mla, "measure",
                        lambda cases, impls, reps, bw: asked.append((cases, impls, reps)) or [])
    return asked


@pytest.mark.parametrize("argv, shapes", [
    ([], [("dsv3-16h-4k", 16, 128, 4096, 1), ("dsv3-16h-32k", 16, 128, 32768, 1),
          ("dsv3-128h-4k", 128, 128, 4096, 1), ("dsv3-128h-4k-q2", 128, 128, 4096, 2)]),
    (["--preset", "dsv3-128h-4k-q2", "--preset", "dsv3-16h-4k", "--preset", "dsv3-128h-4k-q2"],
     [("dsv3-128h-4k-q2", 128, 128, 4096, 2), ("dsv3-16h-4k", 16, 128, 4096, 1)]),
    (["--heads", "32"], [("32h-128x1/4096", 32, 128, 4096, 1)]),
    (["--batch", "8", "--context", "1000", "--q-len", "4", "--preset", "dsv3-16h-32k"],
     [("16h-8x4/1000", 16, 8, 1000, 4), ("dsv3-16h-32k", 16, 128, 32768, 1)]),
])
def test_presets_and_custom_shapes(monkeypatch, argv, shapes):
    asked = _asked(monkeypatch)
    r = CliRunner().invoke(main, ["mla", *argv])
    assert r.exit_code == 0, r.output
    (cases, impls, reps), = asked
    assert [(c.name, c.heads, c.batch, c.context, c.q_len) for c in cases] == shapes
    assert impls == ["cupaged"] and reps == 20
    assert all(c.block_size == 64 and c.dtype == "bfloat16" and c.causal for c in cases)


def test_page_size_dtype_and_impls_reach_every_case(monkeypatch):
    asked = _asked(monkeypatch)
    r = CliRunner().invoke(main, ["mla", "--preset", "dsv3-16h-4k", "--heads", "8",
                                  "--page-size", "16", "--dtype", "float16", "--reps", "5",
                                  "--impl", "flashinfer-fa3", "--impl", "cupaged",
                                  "--impl", "flashinfer-fa3"])
    assert r.exit_code == 0, r.output
    (cases, impls, reps), = asked
    assert [(c.block_size, c.dtype) for c in cases] == [(16, "float16")] * 2
    assert impls == ["flashinfer-fa3", "cupaged"] and reps == 5
    assert "dsv3-16h-4k: 16 heads, batch 128, context 4096, 1 query token, pages of 16, " \
           "float16: 576.0 MiB of latent cache" in r.output


def test_mla_prints_the_ceilings_and_the_rows(monkeypatch, no_flashinfer):
    """End to end on the host: the fake kernel's row checked and timed, FlashInfer's
    note; exit status 3 (a row did not run)."""
    _on_fake_gpu(monkeypatch)
    on_host(monkeypatch)
    fake_mla(monkeypatch, [])
    r = CliRunner().invoke(main, ["mla", "--heads", "4", "--batch", "3", "--context", "70",
                                  "--q-len", "2", "--page-size", "16", "--dtype", "float16",
                                  "--reps", "3", "--impl", "cupaged", "--impl", "flashinfer-fa2"])
    assert r.exit_code == 3, r.output
    lines = r.output.splitlines()
    assert lines[0] == "copy bandwidth 3000 GB/s, bf16 matmul 800 TFLOP/s (same run)"
    assert lines[1].startswith("4h-3x2/70: 4 heads, batch 3, context 70, 2 query tokens (causal)")
    assert lines[2].split() == ["shape", "implementation", "median", "us", "p10-p90", "us",
                                "TFLOP/s", "%", "mm", "%", "copy", "error", "note"]
    ours = lines[3].split()
    tflops = 3_629_568 / 100e-6 / 1e12
    assert ours[:4] == ["4h-3x2/70", "cupaged", "100.0", "90.0-110.0"]
    assert ours[4:7] == [f"{tflops:.1f}", f"{100 * tflops / 800:.1f}%",
                         f"{100 * 294_144 / 100e-6 / 3e12:.1f}%"]
    assert float(ours[7]) < 1e-3 and len(ours) == 8
    assert lines[4].split()[:8] == ["4h-3x2/70", "flashinfer-fa2", "-", "-", "-", "-%", "-%", "-"]
    assert lines[4].endswith("RuntimeError: flashinfer unavailable: No module named 'flashinfer'")
    assert len(lines) == 5


def test_mla_exits_1_on_a_wrong_row(monkeypatch):
    _on_fake_gpu(monkeypatch)
    on_host(monkeypatch)
    fake_mla(monkeypatch, [], causal=False)
    r = CliRunner().invoke(main, ["mla", "--heads", "4", "--batch", "3", "--context", "70",
                                  "--q-len", "2", "--page-size", "16", "--reps", "3"])
    assert r.exit_code == 1, r.output
    assert r.output.splitlines()[-1].endswith("WRONG")


# ---- on a GPU --------------------------------------------------------------------------------------


def _gpu_impls():
    return ["cupaged"] + (["flashinfer-fa2", "flashinfer-fa3"] if peers.flashinfer_ok() else [])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [dict(heads=16, q_len=1, block_size=64),
                                   dict(heads=128, q_len=2, block_size=16),
                                   dict(heads=16, q_len=3, block_size=1)])
def test_mla_rows_check_and_time(dtype, shape):
    c = bench_mla.MLACase("x", batch=5, context=333, dtype=dtype, **shape)
    rows = bench_mla.measure([c], _gpu_impls(), reps=3, copy_bw=1e12)
    for r in rows:
        assert r.note == "" and r.error <= testing.TOLERANCE[
            "bf16" if dtype == "bfloat16" else "f16"] * testing.ROW_FACTOR, (r.impl, r.note)
        assert r.median_us > 0 and r.tflops > 0 and r.pct_copy > 0


@pytest.mark.gpu
def test_mla_command_small():
    r = CliRunner().invoke(main, ["mla", "--heads", "16", "--batch", "4", "--context", "300",
                                  "--reps", "3", *sum((["--impl", i] for i in _gpu_impls()), [])])
    assert r.exit_code == 0, r.output
    # (the case's description line starts "16h-4x1/300:", its rows with the padded name)
    rows = [l for l in r.output.splitlines() if l.startswith("16h-4x1/300 ")]
    assert [l.split()[1] for l in rows] == _gpu_impls()
    assert "WRONG" not in r.output


def test_fp8_cases_count_one_byte_a_cached_value_and_refuse_unknown_formats():
    from cupaged.bench import mla

    bf16 = mla.MLACase("x", heads=16, batch=2, context=64)
    fp8 = mla.MLACase("x", heads=16, batch=2, context=64, kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_bytes() * 2 == bf16.kv_bytes() == 2 * 64 * 576 * 2
    assert fp8.flops() == bf16.flops()
    assert "fp8_e4m3, k_scale" in fp8.describe()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3"):
        mla.MLACase("x", kv_cache_dtype="fp8")


# ---- cupaged-bench sparse-mla ----------------------------------------------------------------------


def _sparse_on_host(monkeypatch, calls, wrong=False):
    """sparse-mla's case on the host: CuPy's calls answered by NumPy, the fp8_ds_mla writer
    by the reference's, the kernel by the float64 reference writing the out it is given
    (NaN with ``wrong``), the timer by a constant."""
    import cupaged
    from cupaged.bench import sparse_mla as bench_sparse

    on_host(monkeypatch)
    monkeypatch.setattr(bench_sparse, "cupy", bench_mla.cupy)

    def write(kv_c, k_pe, cache, slots, kv_cache_dtype):
        reference.concat_and_cache_sparse_mla(kv_c, k_pe, cache, slots, kv_cache_dtype)

    def attend(q, kv, indices, *, scale, out, **kw):
        calls.append(dict(q=q, kv=kv, indices=indices, scale=scale, **kw))
        fmt = {656: "fp8_ds_mla", 528: "v4_fp8", 288: "v4_fp4"}[kv.shape[-1]] \
            if kv.dtype == np.uint8 else "auto"
        out[...] = np.nan if wrong else reference.sparse_mla_attention(
            q, kv, indices, scale=scale, kv_format=fmt)
        return out

    monkeypatch.setattr(cupaged, "concat_and_cache_mla", write)
    monkeypatch.setattr(cupaged, "sparse_mla_attention", attend)
    return bench_sparse


def _fake_flashmla(monkeypatch, calls):
    """A torch and a flash_mla that answer with the float64 reference (the decode over
    fp8_ds_mla bytes, the prefill over bfloat16 kv), recording their calls."""
    import types

    from cupaged.bench import peers

    class T:  # a torch tensor: the array, and the dtype a view gave it
        def __init__(self, a, dtype=None):
            self.a, self.dtype = a, dtype

        def view(self, dtype):
            return T(self.a, dtype)

    torch = types.SimpleNamespace(
        from_dlpack=T, float8_e4m3fn="float8_e4m3fn",
        cuda=types.SimpleNamespace(current_stream=lambda: types.SimpleNamespace(cuda_stream=0),
                                   empty_cache=lambda: None))

    def decode(q, kv, block_table, cache_seqlens, head_dim_v, sched, num_splits, **kw):
        calls.append(("decode", kv.dtype, block_table, cache_seqlens, head_dim_v, sched,
                      num_splits, kw))
        out = reference.sparse_mla_attention(q.a, kv.a, kw["indices"].a,
                                             scale=kw["softmax_scale"], kv_format="fp8_ds_mla")
        return out, None

    def prefill(q, kv, indices, sm_scale, d_v):
        calls.append(("prefill", kv.dtype, sm_scale, d_v))
        return reference.sparse_mla_attention(q.a, kv.a, indices.a, scale=sm_scale), None, None

    flash_mla = types.SimpleNamespace(get_mla_metadata=lambda: ("sched", None),
                                      flash_mla_with_kvcache=decode,
                                      flash_mla_sparse_fwd=prefill)
    monkeypatch.setattr(peers, "import_torch", lambda: torch)
    monkeypatch.setattr(peers, "require_flashmla", lambda: flash_mla)
    monkeypatch.setattr(bench_mla.cupy, "from_dlpack", np.asarray, raising=False)


def test_flashmla_rows(monkeypatch):
    """FlashMLA's rows: the decode over the case's fp8_ds_mla bytes viewed as e4m3
    (indices as they are, the scheduler's metadata made before timing), the prefill over
    bfloat16 kv, each checked then timed; the cases its Hopper kernels do not take are row
    notes saying why, as is a missing flash_mla."""
    from cupaged.bench import peers

    bench_sparse = _sparse_on_host(monkeypatch, [])
    kw = dict(heads=64, topk=64, context=128, block_size=16)
    missing = bench_sparse.measure([bench_sparse.SparseCase(
        "x", batch=2, kv_cache_dtype="fp8_ds_mla", **kw)], ["flashmla"], reps=3)
    assert missing[0].note.startswith("RuntimeError: flash_mla unavailable"), missing[0]
    calls = []
    _fake_flashmla(monkeypatch, calls)
    cases = [bench_sparse.SparseCase("d", batch=2, s_q=2, kv_cache_dtype="fp8_ds_mla", **kw),
             bench_sparse.SparseCase("p", batch=1, s_q=5, prefill=True,
                                     **dict(kw, topk=128)),
             bench_sparse.SparseCase("bf16-decode", batch=2, **kw),
             bench_sparse.SparseCase("h16", batch=2, kv_cache_dtype="fp8_ds_mla",
                                     **dict(kw, heads=16)),
             bench_sparse.SparseCase("p64", batch=1, s_q=5, prefill=True, **kw),
             bench_sparse.SparseCase("x", batch=2, kv_cache_dtype="fp8_ds_mla", extra_topk=8,
                                     **kw)]
    rows = bench_sparse.measure(cases, ["flashmla"], reps=3)
    assert [r.note for r in rows[:2]] == ["", ""] and rows[0].median_us == 100.0, rows[:2]
    assert all(r.error < 1e-2 for r in rows[:2])
    decode = [c for c in calls if c[0] == "decode"]
    assert len(decode) == 2  # the metadata's call, then the check's
    assert decode[0][1:7] == ("float8_e4m3fn", None, None, 512, "sched", None)
    assert decode[0][7]["is_fp8_kvcache"] is True and decode[0][7]["causal"] is False
    assert [c for c in calls if c[0] == "prefill"] == [("prefill", None, cases[1].scale, 512)]
    notes = [r.note for r in rows[2:]]
    assert "reads fp8_ds_mla rows" in notes[0] and "64 or 128 heads, not 16" in notes[1]
    assert "top-k a multiple of 128" in notes[2] and "no second cache" in notes[3], notes


def test_sparse_presets_and_accounting():
    from cupaged.bench import sparse_mla as bench_sparse

    got = {n: bench_sparse.preset_case(n) for n in bench_sparse.PRESETS}
    assert [(c.heads, c.batch, c.s_q, c.topk, c.prefill) for c in got.values()] == [
        (16, 128, 1, 2048, False), (64, 128, 1, 2048, False), (128, 128, 2, 2048, False),
        (128, 1, 4096, 2048, True)]
    c = bench_sparse.SparseCase("x", heads=4, batch=3, s_q=2, topk=10, context=50)
    assert c.flops() == 2.0 * 6 * 4 * 10 * (576 + 512)
    assert c.bytes_moved() == 6 * 10 * 1152 + 6 * 4 * 2 * (576 + 512)
    ds = bench_sparse.SparseCase("x", heads=4, batch=3, s_q=2, topk=10, context=50,
                                 kv_cache_dtype="fp8_ds_mla")
    assert ds.bytes_moved() == 6 * 10 * 656 + 6 * 4 * 2 * (576 + 512)
    for fmt, width in (("v4_fp8", 528), ("v4_fp4", 288)):  # 512-dim q and keys
        v4 = bench_sparse.SparseCase("x", heads=4, batch=3, s_q=2, topk=10, context=50,
                                     kv_cache_dtype=fmt)
        assert v4.bytes_moved() == 6 * 10 * width + 6 * 4 * 2 * (512 + 512)
        assert v4.flops() == 2.0 * 6 * 4 * 10 * (512 + 512)
        assert f"bfloat16 q, {fmt} cache" in v4.describe()
    assert bench_sparse.KV_CACHE_DTYPES == ("auto", "fp8_ds_mla", "v4_fp8", "v4_fp4")
    for kw, msg in ((dict(topk=60), "topk \\(60\\) must be at most context"),
                    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be one of"),
                    (dict(prefill=True), "a prefill case is one sequence")):
        with pytest.raises(ValueError, match=msg):
            bench_sparse.SparseCase("x", **{**dict(batch=3, topk=10, context=50), **kw})


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_ds_mla", "v4_fp8", "v4_fp4"])
@pytest.mark.parametrize("prefill", [False, True])
def test_sparse_case_is_checked_then_timed(monkeypatch, kv_cache_dtype, prefill):
    """Each query token's indices are distinct tokens of its own sequence's blocks; the
    row is checked against the reference, then timed; a NaN output is WRONG, not timed."""
    calls = []
    bench_sparse = _sparse_on_host(monkeypatch, calls)
    kw = dict(heads=4, batch=1 if prefill else 3, s_q=7 if prefill else 2, topk=20,
              context=70, block_size=16, kv_cache_dtype=kv_cache_dtype, prefill=prefill)
    c = bench_sparse.SparseCase("x", **kw).build()
    idx, page = c.host_indices, 16
    slots = (-(-70 // page)) * page * idx.shape[0]
    assert ((idx >= 0) & (idx < slots)).all()
    for b in range(idx.shape[0]):
        for s in range(idx.shape[1]):
            assert len(set(idx[b, s].tolist())) == 20  # distinct
    blocks_of = [{int(i) // page for i in idx[b].ravel()} for b in range(idx.shape[0])]
    for i in range(len(blocks_of)):  # a sequence's tokens live in its own blocks
        for j in range(i):
            assert not blocks_of[i] & blocks_of[j]
    width = {"auto": 576, "fp8_ds_mla": 656, "v4_fp8": 528, "v4_fp4": 288}[kv_cache_dtype]
    d = 512 if kv_cache_dtype.startswith("v4") else 576
    c.arrays.clear()
    (row,) = bench_sparse.measure([bench_sparse.SparseCase("x", **kw)], ["cupaged"], reps=3,
                                  copy_bw=1e12)
    assert row.note == "" and row.error < 1e-2 and row.median_us == 100.0, row
    assert row.case == "x" + {"auto": "", "fp8_ds_mla": "/ds", "v4_fp8": "/v4fp8",
                              "v4_fp4": "/v4fp4"}[kv_cache_dtype]
    assert calls[0]["kv"].shape[-1] == width and calls[0]["kv"].ndim == (3 if prefill else 4)
    assert calls[0]["q"].shape == ((7, 4, d) if prefill else (3, 2, 4, d))
    bench_sparse = _sparse_on_host(monkeypatch, [], wrong=True)
    (row,) = bench_sparse.measure([bench_sparse.SparseCase("x", **kw)], ["cupaged"], reps=3)
    assert row.note == "WRONG" and row.median_us != row.median_us


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "v4_fp8"])
def test_a_second_cache_case_is_checked_then_timed(monkeypatch, kv_cache_dtype):
    """--extra-topk: a second cache of the same format with each sequence's own blocks,
    distinct tokens of it a query token, passed as extra_kv_cache / extra_indices; the
    check's reference reads both caches' selected tokens in one softmax (a kernel that
    drops the second cache is WRONG); bytes and FLOPs count both; the wgmma runner times
    it too."""
    import cupaged

    calls = []
    bench_sparse = _sparse_on_host(monkeypatch, calls)
    kw = dict(heads=4, batch=3, s_q=2, topk=20, context=70, block_size=16,
              kv_cache_dtype=kv_cache_dtype, extra_topk=9, extra_context=40)
    c = bench_sparse.SparseCase("x", **kw)
    d = 512 if kv_cache_dtype == "v4_fp8" else 576
    width = 528 if kv_cache_dtype == "v4_fp8" else 1152
    assert c.flops() == 2.0 * 6 * 4 * 29 * (d + 512)
    assert c.bytes_moved() == 6 * 29 * width + 6 * 4 * 2 * (d + 512)
    assert "top-20 + top-9 of a second cache (40 tokens a sequence)" in c.describe()
    c.build()
    e = c.host_extra_indices
    assert e.shape == (3, 2, 9) and ((e >= 0) & (e < 3 * 3 * 16)).all()
    assert all(len(set(e[b, s].tolist())) == 9 for b in range(3) for s in range(2))
    blocks_of = [{int(i) // 16 for i in e[b].ravel()} for b in range(3)]
    assert not (blocks_of[0] & blocks_of[1] or blocks_of[0] & blocks_of[2]
                or blocks_of[1] & blocks_of[2])
    seen = {}

    def attend(q, kv, indices, *, scale, out, extra_kv_cache=None, extra_indices=None, **kw):
        seen.update(extra=extra_kv_cache is not None)
        fmt = "v4_fp8" if kv.dtype == np.uint8 else "auto"
        out[...] = reference.sparse_mla_attention(
            q, kv, indices, scale=scale, kv_format=fmt, extra_kv_cache=extra_kv_cache,
            extra_indices=extra_indices)
        return out

    monkeypatch.setattr(cupaged, "sparse_mla_attention", attend)
    for impl in ("cupaged", "cupaged-sm90"):
        seen.clear()
        (row,) = bench_sparse.measure([bench_sparse.SparseCase("x", **kw)], [impl], reps=3)
        assert seen["extra"] and row.note == "" and row.error < 1e-2, row
        assert row.case.endswith("+x9")

    def first_only(q, kv, indices, *, scale, out, **kw):
        fmt = "v4_fp8" if kv.dtype == np.uint8 else "auto"
        out[...] = reference.sparse_mla_attention(q, kv, indices, scale=scale, kv_format=fmt)
        return out

    monkeypatch.setattr(cupaged, "sparse_mla_attention", first_only)
    (row,) = bench_sparse.measure([bench_sparse.SparseCase("x", **kw)], ["cupaged"], reps=3)
    assert row.note == "WRONG"
    with pytest.raises(ValueError, match="a second cache is read by decode cases"):
        bench_sparse.SparseCase("x", **{**kw, "batch": 1, "prefill": True})
    with pytest.raises(ValueError, match="extra_topk \\(9\\) must be at most extra_context"):
        bench_sparse.SparseCase("x", **{**kw, "extra_context": 5})


def test_sparse_cli_takes_a_second_cache(monkeypatch):
    """--extra-topk N: the decode presets (the prefill one only when asked for, refused)."""
    seen = []
    monkeypatch.setattr(cli, "_mla_table", lambda cases, measure: seen.append(cases))
    r = CliRunner().invoke(main, ["sparse-mla", "--kv-cache-dtype", "v4_fp8", "--extra-topk",
                                  "512"])
    assert r.exit_code == 0, r.output
    assert [(c.name, c.extra_topk, c.extra_context) for c in seen[0]] == [
        ("dsa-16h", 512, 32768), ("dsa-64h", 512, 32768), ("dsa-128h-q2", 512, 32768)]
    r = CliRunner().invoke(main, ["sparse-mla", "--preset", "dsa-prefill-128h", "--extra-topk",
                                  "8"])
    assert r.exit_code == 2 and "a second cache is read by decode cases" in r.output


def test_sparse_cli_takes_a_batch(monkeypatch):
    """--batch N: the decode presets with N sequences, named -bN (the prefill preset only
    when asked for, refused)."""
    seen = []
    monkeypatch.setattr(cli, "_mla_table", lambda cases, measure: seen.append(cases))
    r = CliRunner().invoke(main, ["sparse-mla", "--kv-cache-dtype", "fp8_ds_mla", "--batch",
                                  "8"])
    assert r.exit_code == 0, r.output
    assert [(c.name, c.batch, c.heads, c.s_q) for c in seen[0]] == [
        ("dsa-16h-b8", 8, 16, 1), ("dsa-64h-b8", 8, 64, 1), ("dsa-128h-q2-b8", 8, 128, 2)]
    r = CliRunner().invoke(main, ["sparse-mla", "--preset", "dsa-prefill-128h", "--batch",
                                  "8"])
    assert r.exit_code == 2 and "--batch sets a decode preset's sequences" in r.output
    r = CliRunner().invoke(main, ["sparse-mla", "--batch", "0"])
    assert r.exit_code == 2


@pytest.mark.parametrize("fmt", ["v4_fp8", "v4_fp4"])
def test_both_runners_time_v4_rows(monkeypatch, fmt):
    """cupaged-sm90 and cupaged-mma both time V4's rows (each family reads them), checked
    against the reference first."""
    from cupaged import planning

    bench_sparse = _sparse_on_host(monkeypatch, [])
    monkeypatch.setattr(planning, "device_info",
                        lambda i: planning.DeviceInfo(i, "sm_90", 132, 232448, 233472))
    kw = dict(heads=4, batch=3, s_q=1, topk=20, context=70, block_size=16, kv_cache_dtype=fmt)
    sm90, mma = bench_sparse.measure([bench_sparse.SparseCase("x", **kw)],
                                     ["cupaged-sm90", "cupaged-mma"], reps=3)
    for r in (sm90, mma):
        assert r.note == "" and r.median_us == 100.0, r


def test_sparse_cli_takes_v4_rows_by_name(monkeypatch):
    """--kv-cache-dtype v4_fp8 / v4_fp4 make rows of V4's caches in each preset's shape;
    without it, V3.2's two caches."""
    seen = []
    monkeypatch.setattr(cli, "_mla_table", lambda cases, measure: seen.append(cases))
    argv = ["sparse-mla", "--preset", "dsa-16h", "--preset", "dsa-prefill-128h"]
    r = CliRunner().invoke(main, [*argv, "--kv-cache-dtype", "v4_fp8", "--kv-cache-dtype",
                                  "v4_fp4", "--topk", "512"])
    assert r.exit_code == 0, r.output
    assert [(c.name, c.kv_cache_dtype, c.topk, c.d_qk) for c in seen[0]] == [
        ("dsa-16h", "v4_fp8", 512, 512), ("dsa-16h", "v4_fp4", 512, 512),
        ("dsa-prefill-128h", "v4_fp8", 512, 512), ("dsa-prefill-128h", "v4_fp4", 512, 512)]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    assert [c.kv_cache_dtype for c in seen[1]] == ["auto", "fp8_ds_mla"] * 2
    r = CliRunner().invoke(main, [*argv, "--kv-cache-dtype", "fp8"])
    assert r.exit_code == 2 and "'fp8' is not one of" in r.output


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_ds_mla", "v4_fp8", "v4_fp4"])
@pytest.mark.parametrize("prefill", [False, True])
def test_sparse_benchmark_checks_what_it_times_on_the_gpu(kv_cache_dtype, prefill):
    """cupaged-bench sparse-mla's cases, small: built, checked against the reference and
    timed; a row that gave NaN is reported WRONG, not timed."""
    from cupaged.bench import sparse_mla as bench

    case = bench.SparseCase("t", heads=16, batch=1 if prefill else 3, s_q=40 if prefill else 2,
                            topk=100, context=300, kv_cache_dtype=kv_cache_dtype,
                            prefill=prefill)
    (row,) = bench.measure([case], ["cupaged"], reps=3)
    assert row.note == "" and row.error <= case.tolerance() and row.median_us > 0, row
    if not prefill:  # with a second cache (--extra-topk)
        two = bench.SparseCase("t", heads=16, batch=3, s_q=2, topk=100, context=300,
                               kv_cache_dtype=kv_cache_dtype, extra_topk=37, extra_context=90)
        (row,) = bench.measure([two], ["cupaged"], reps=3)
        assert row.note == "" and row.error <= two.tolerance() and row.median_us > 0, row
    broken = bench.SparseCase("t", heads=16, batch=2, s_q=1, topk=50, context=100,
                              kv_cache_dtype=kv_cache_dtype)
    real = bench.IMPLEMENTATIONS["cupaged"]

    def nan_out(c):
        run = real(c)

        def wrong():
            out = run()
            out.fill(np.nan)
            return out
        return wrong

    bench.IMPLEMENTATIONS["cupaged"] = nan_out
    try:
        (row,) = bench.measure([broken], ["cupaged"], reps=3)
    finally:
        bench.IMPLEMENTATIONS["cupaged"] = real
    assert row.note == "WRONG" and row.median_us != row.median_us


# ---- cupaged-bench indexer ---------------------------------------------------------------------


def _indexer_on_host(monkeypatch, wrong=None):
    """indexer's case on the host: CuPy's calls answered by NumPy, the writer, logits and
    top-k by the reference's (writing the outputs they are given; ``wrong``: "logits"
    or "topk" spoils that step's output), the timer by a constant."""
    import cupaged
    from cupaged.bench import indexer as bench_indexer

    on_host(monkeypatch)
    monkeypatch.setattr(bench_indexer, "cupy", bench_mla.cupy)

    def write(k, cache, slots, qbs):
        reference.indexer_k_quant_and_cache(k, cache, slots, qbs)

    def logits(q, kv_cache, weights, block_tables, seq_lens, *, max_seq_len, out):
        # the dtypes cupaged.indexer_logits takes
        assert (q.dtype, kv_cache.dtype, weights.dtype, block_tables.dtype, seq_lens.dtype,
                out.dtype) == (BF16, np.uint8, np.float32, np.int32, np.int32, np.float32)
        batch, next_n = q.shape[:2]
        out[...] = reference.indexer_logits(
            q.reshape(batch * next_n, *q.shape[2:]), kv_cache, weights, block_tables,
            seq_lens, np.arange(batch + 1) * next_n, max_seq_len=max_seq_len)
        if wrong == "logits":
            out[-1, 3] += 1.0
        return out

    def topk(lg, k, *, out):
        assert (lg.dtype, out.dtype) == (np.float32, np.int32)
        out[...] = reference.indexer_topk(lg, k)
        if wrong == "topk":
            out[0, [0, 1]] = out[0, [1, 0]]
        return out

    monkeypatch.setattr(cupaged, "indexer_k_quant_and_cache", write)
    monkeypatch.setattr(cupaged, "indexer_logits", logits)
    monkeypatch.setattr(cupaged, "indexer_topk", topk)
    return bench_indexer


def test_indexer_presets_and_accounting():
    from cupaged.bench import indexer as bench_indexer

    got = [bench_indexer.preset_case(n) for n in bench_indexer.PRESETS]
    assert [(c.batch, c.next_n, c.context, c.heads, c.topk) for c in got] == [
        (128, 1, 32768, 64, 2048), (128, 2, 32768, 64, 2048), (16, 1, 131072, 64, 2048)]
    c = bench_indexer.IndexerCase("x", batch=3, next_n=2, context=50, heads=16, topk=10)
    logits, topk = bench_indexer._Logits(c), bench_indexer._Topk(c)
    assert logits.flops() == 2.0 * 16 * 128 * (3 * (49 + 50))  # row t sees 50 - 2 + t + 1
    assert logits.bytes_moved() == 3 * 50 * 132 + 6 * 16 * 128 * 2 + 6 * 16 * 4 + 6 * 50 * 4
    assert topk.bytes_moved() == 6 * 50 * 4 + 6 * 10 * 4
    with pytest.raises(ValueError, match="next_n \\(3\\) must be at most context"):
        bench_indexer.IndexerCase("x", next_n=3, context=2)


@pytest.mark.parametrize("next_n", [1, 2])
def test_indexer_case_is_checked_then_timed(monkeypatch, next_n):
    """Both steps are checked against the reference (their own host copies of a row's
    blocks), then timed; a logit off by one, or two columns swapped, is WRONG, untimed."""
    kw = dict(batch=3, next_n=next_n, context=70, heads=16, block_size=16, topk=20)
    bench_indexer = _indexer_on_host(monkeypatch)
    rows = bench_indexer.measure([bench_indexer.IndexerCase("x", **kw)], ["logits", "topk"],
                                 reps=3, copy_bw=1e12)
    assert [(r.impl, r.note, r.median_us) for r in rows] == [("logits", "", 100.0),
                                                             ("topk", "", 100.0)], rows
    assert rows[0].error < 1e-6 and rows[1].error == 0.0  # float32 logits: rounding alone
    for step in ("logits", "topk"):
        bench_indexer = _indexer_on_host(monkeypatch, wrong=step)
        (row,) = bench_indexer.measure([bench_indexer.IndexerCase("x", **kw)], [step], reps=3)
        assert row.note == "WRONG" and row.median_us != row.median_us, row
    # top-k alone still checks the logits it selects from: wrong ones leave it untimed
    bench_indexer = _indexer_on_host(monkeypatch, wrong="logits")
    (row,) = bench_indexer.measure([bench_indexer.IndexerCase("x", **kw)], ["topk"], reps=3)
    assert "logits top-k selects from are wrong" in row.note and row.median_us != row.median_us
    assert rows[1].tflops != rows[1].tflops  # a selection has no FLOP rate: '-'

