"""cupaged-bench's command line, without a GPU (the GPU runs are in the device check)."""

import importlib.util

import pytest
from click.testing import CliRunner

from cupaged import jit
from cupaged.bench.cli import main
from conftest import HAVE_GPU

COMMANDS = ["info", "compile", "decode", "compare", "prefill", "mla", "cascade", "e2e",
            "overhead", "cache-ops", "context-parallel", "fp8-error", "ab"]
AB_COMMANDS = ["decode", "host", "tuning"]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_subcommand_has_help(cmd):
    r = CliRunner().invoke(main, [cmd, "--help"])
    assert r.exit_code == 0 and "Usage:" in r.output


@pytest.mark.parametrize("cmd", AB_COMMANDS)
def test_every_ab_command_has_help(cmd):
    r = CliRunner().invoke(main, ["ab", cmd, "--help"])
    assert r.exit_code == 0 and "Usage:" in r.output


def test_group_help_lists_the_subcommands():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and all(c in r.output for c in COMMANDS)


@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU message")
def test_info_without_gpu_says_so():
    r = CliRunner().invoke(main, ["info"])
    assert r.exit_code == 0, r.output
    assert "none found" in r.output and "nvrtc" in r.output and "kernel cache" in r.output
    assert "compilation tools, release" in r.output  # NVRTC's build, which the key takes


@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU message")
def test_decode_without_gpu_exits_nonzero():
    r = CliRunner().invoke(main, ["decode", "--batch", "1"])
    assert r.exit_code == 2 and "no GPU" in r.output


@pytest.mark.parametrize("argv, msg", [
    (["decode", "--batch", "1,x"], "comma-separated integers"),
    (["decode", "--batch", "-4"], "non-negative"),
    (["decode", "--dtype", "int8"], "unknown dtype"),
    (["decode", "--heads", "6", "--kv-heads", "4"], "multiple of --kv-heads"),
    (["decode", "--partition", "often"], "auto, never, always, flat or an int"),
    (["compile", "--dtype", "float64"], "unknown dtype"),
    (["decode", "--reps", "1"], "--reps"),
    (["decode", "--context-dist", "normal:5:9"], "expected uniform:LO:HI"),
    (["decode", "--context-dist", "uniform:9:5"], "0 <= LO <= HI"),
    (["compare", "--preset", "gpt-5"], "Invalid value for '--preset'"),
    (["compare", "--impl", "flash"], "unknown implementation 'flash'"),
    (["decode", "--kv-cache-dtype", "int8"], "Invalid value for '--kv-cache-dtype'"),
    (["decode", "--kv-cache-dtype", "e4m3"], "'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'"),
    (["decode", "--kv-cache-dtype", "fp8", "--dtype", "float32"], "float16 or bfloat16 queries"),
    (["compare", "--kv-cache-dtype", "fp8", "--impl", "cupy-gather"],
     "cupy-gather has no fp8 cache path"),
    (["compare", "--kv-cache-dtype", "fp8_e5m2", "--impl", "flashinfer-xqa"],
     "XQA takes fp8 e4m3 caches only"),
    (["prefill", "--kv-cache-dtype", "fp16"], "Invalid value for '--kv-cache-dtype'"),
    (["prefill", "--kv-cache-dtype", "fp8", "--batch", "1", "--query-len", "4", "--dtype",
      "float32"], "float16 or bfloat16 queries"),
    (["decode", "--window", "0"], "Invalid value for --window: window must be at least 1"),
    (["decode", "--window", "-4"], "window must be at least 1"),
    (["decode", "--window", "x"], "Invalid value for '--window'"),
    (["compare", "--window", "0"], "window must be at least 1"),
    (["prefill", "--window", "0"], "Invalid value for --window: window must be at least 1"),
    (["decode", "--soft-cap", "0"],
     "Invalid value for --soft-cap: soft cap must be a positive finite number"),
    (["decode", "--soft-cap", "-30"], "soft cap must be a positive finite number"),
    (["compare", "--soft-cap", "inf"], "soft cap must be a positive finite number"),
    (["compare", "--soft-cap", "nan"], "soft cap must be a positive finite number"),
    (["prefill", "--soft-cap", "-1"], "soft cap must be a positive finite number"),
    (["compare", "--window", "512", "--impl", "cupy-gather"],
     "cupy-gather runs plain attention only (asked for: window 512)"),
    (["compare", "--soft-cap", "50", "--impl", "flashinfer-xqa"],
     "flashinfer-xqa is run with window_left and sinks only, not soft-cap"),
    (["compare", "--sinks", "--impl", "flashinfer-decode"],
     "flashinfer-decode is run with window_left and logits_soft_cap only, not sinks"),
    (["compare", "--alibi", "--impl", "flashinfer-decode-tc"], "not ALiBi"),
    (["cascade", "--prefix", "1000"], "prefix (1000) must be a multiple of the block size (16)"),
    (["cascade", "--seqs", "64", "--prefix", "32"], "seqs must be <= prefix"),
    (["cascade", "--heads", "12"], "heads (12) must be a multiple of kv_heads (8)"),
    (["cascade", "--dtype", "int8"], "unknown dtype"),
    (["cascade", "--kv-layout", "nhd"], "Invalid value for '--kv-layout'"),
    (["cascade", "--suffix", "0"], "Invalid value for '--suffix'"),
    (["context-parallel", "--context", "100", "--chunk", "200"],
     "chunk (200) must be at most context (100)"),
    (["context-parallel", "--heads", "12"], "heads (12) must be a multiple of kv_heads (8)"),
    (["context-parallel", "--others", "5,0"], "others must be positive lengths"),
    (["mla", "--preset", "dsv3-671b"], "Invalid value for '--preset'"),
    (["mla", "--impl", "flashinfer-fa4"], "Invalid value for '--impl'"),
    (["mla", "--impl", "flashinfer"], "'cupaged', 'cupaged-mma', 'cupaged-sm90', 'flashinfer-fa2', 'flashinfer-fa3'"),
    (["mla", "--dtype", "float32"], "Invalid value for '--dtype'"),
    (["mla", "--page-size", "0"], "Invalid value for '--page-size'"),
    (["mla", "--heads", "0"], "Invalid value for '--heads'"),
    (["mla", "--q-len", "x"], "Invalid value for '--q-len'"),
    (["mla", "--context", "2", "--q-len", "3"],
     "context (2) counts the query tokens: at least q_len (3)"),
    (["mla", "--reps", "2"], "Invalid value for '--reps'"),
    (["compare", "--row", "32/8/64"], "expected HEADS/KV_HEADS/BATCH/CONTEXT"),
    (["decode", "--row", "32/8/x/2048"], "expected HEADS/KV_HEADS/BATCH/CONTEXT"),
    (["compare", "--row", "32/8/64/uniform:9:3"], "expected HEADS/KV_HEADS/BATCH/CONTEXT"),
    (["compare", "--row", "32/8/0/2048"], "must be positive"),
    (["decode", "--row", "32/12/64/2048"], "query heads must be a multiple of KV heads"),
    (["compare", "--row", "32/8/64/2048", "--preset", "llama-3-8b"],
     "--row gives whole shapes: not with --preset or --context-dist"),
    (["compare", "--tile", "48x2"], "tokens must be 32, 64, 128 or 256"),
    (["compare", "--ctas-per-sm", "0"], "Invalid value for '--ctas-per-sm'"),
    (["prefill", "--tile", "4,2,64"], "expected 5 or 4 or 2 positive integers"),
    (["prefill", "--tile", "128,x"], "expected 5 or 4 or 2 positive integers"),
    (["prefill", "--split", "-1"], "expected auto or tokens per partition"),
    (["mla", "--tile", "16,32"], "expected 3 positive integers"),
    (["mla", "--split", "some"], "expected auto or tiles per partition"),
    (["e2e", "--profile-steps", "20", "5", "--systems", "hf"],
     "--profile-steps profiles one system"),
    (["e2e", "--profile-steps", "20", "0", "--systems", "concat"],
     "Invalid value for '--profile-steps'"),
    (["fp8-error", "--heads", "12"], "--heads must be a multiple of --kv-heads"),
    (["ab", "tuning", "--settings=-,2@sometimes"], "partition auto, never, always, flat or tokens"),
    (["ab", "tuning", "--settings=x@never"], "CTAs an integer or '-'"),
    (["ab", "tuning", "--settings=-@auto@64"], "the tile is TOKENSxSTAGES"),
    (["ab", "tuning", "--settings=40"], "CTAs per SM between 1 and 32"),
    (["ab", "tuning", "--settings=1@auto@64x3@x"], "expected ctas[@partition[@TOKENSxSTAGES]]"),
    (["ab", "tuning", "--heads", "32/8"], "--heads needs --batch and --context"),
    (["ab", "tuning", "--heads", "32/12", "--batch", "1", "--context", "9"],
     "expected HEADS/KV_HEADS pairs"),
    (["ab", "tuning", "--batch", "8"], "--batch and --context go with --heads"),
    (["ab", "tuning", "--heads", "32/8", "--batch", "1", "--context", "9", "--row",
      "32/8/1/9"], "--heads (with --batch and --context) or --row, not both"),
    (["ab", "decode", "--tree", "/nonexistent/tree"], "does not exist"),
    (["ab", "decode", "--tree", ".", "--layouts", "vllm,XYZ"], "expected comma-separated values"),
    (["ab", "host"], "Missing option '--tree'"),
])
def test_bad_options_are_usage_errors(argv, msg):
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2 and msg in r.output


def test_compile_count_prints_the_catalogs_sizes():
    """The numbers the docs used to copy come from the code: --count prints them."""
    from cupaged.specs import catalog

    archs = ("sm_80", "sm_90")
    argv = ["compile", "--arch", "sm_80", "--arch", "sm_90", "--count"]
    r = CliRunner().invoke(main, argv + ["--covering"])
    assert r.exit_code == 0, r.output
    full, cov = len(catalog.all_specs(archs)), len(catalog.covering_specs(archs))
    assert r.output.strip() == (f"{cov} specializations in the covering set of the {full} "
                                f"supported for sm_80, sm_90")
    r = CliRunner().invoke(main, argv + ["--all"])
    assert r.output.strip() == f"{full} specializations for sm_80, sm_90"
    r = CliRunner().invoke(main, ["compile", "--count"])
    assert r.exit_code == 2 and "--count goes with --all or --covering" in r.output


def test_compile_reports_cold_and_warm_times(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(main, ["compile", "--arch", "sm_90", "--head-size", "64,96"])
    assert r.exit_code == 0, r.output
    lines = [l for l in r.output.splitlines() if l.startswith("paged_decode_")]
    assert [l.split()[0] for l in lines] == ["paged_decode_f16_hs64_bs16_vllm_g4_sm90",
                                             "paged_decode_f16_hs96_bs16_vllm_g4_sm90"]
    assert all(" s " in l and l.endswith("ms") for l in lines)
    assert not list(tmp_path.iterdir())  # timings use a private cold cache


def test_compile_times_the_multi_token_kernels(tmp_path, monkeypatch):
    """--kernel prefill / prefill-sm90: their cold compiles (the Hopper kernel built for
    sm_90a whatever the targets); shapes a kernel does not take are refused by name."""
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(main, ["compile", "--arch", "sm_80", "--kernel", "prefill-sm90",
                                  "--dtype", "bfloat16", "--head-size", "64"])
    assert r.exit_code == 0, r.output
    assert [l.split()[0] for l in r.output.splitlines()[1:]] == [
        "paged_prefill_sm90_bf16_hs64_bs16_tok_sm90a"]
    r = CliRunner().invoke(main, ["compile", "--arch", "sm_80", "--kernel", "prefill",
                                  "--head-size", "80"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[1].split()[0] == "paged_prefill_f16_hs80_bs16_tok_sm80"
    r = CliRunner().invoke(main, ["compile", "--kernel", "prefill-sm90", "--head-size", "96"])
    assert r.exit_code == 2
    assert "paged_prefill_sm90 takes 64, 128, 192, 256, 384, 512; got 96" in r.output
    r = CliRunner().invoke(main, ["compile", "--kernel", "prefill", "--dtype", "float32"])
    assert r.exit_code == 2 and "got f32" in r.output
    assert not list(tmp_path.iterdir())


def test_compile_precompile_fills_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    jit.clear_memory_caches()
    r = CliRunner().invoke(main, ["compile", "--arch", "sm_80", "--precompile", "--dtype",
                                  "bfloat16", "--block-size", "8,32", "--group", "1"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.cubin")) == [
        "paged_decode_bf16_hs128_bs32_vllm_g1_sm80", "paged_decode_bf16_hs128_bs8_vllm_g1_sm80"]
    jit.clear_memory_caches()


@pytest.mark.parametrize("cmd", ["decode", "compare", "prefill"])
def test_kv_cache_dtype_is_documented(cmd):
    r = CliRunner().invoke(main, [cmd, "--help"])
    assert r.exit_code == 0 and "--kv-cache-dtype" in r.output and "fp8_e5m2" in r.output


def test_presets_and_lists_expand_to_workloads():
    from cupaged.bench.cli import _workloads

    ws = _workloads(("llama-3-8b", "llama-2-7b"), [1, 8], [512, 2048], None, 1, 1, 1, 16, "bf16")
    assert len(ws) == 8
    assert {(w.heads, w.kv_heads, w.head_size) for w in ws} == {(32, 8, 128), (32, 32, 128)}
    assert {w.dtype for w in ws} == {"bfloat16"} and ws[0].preset == "llama-3-8b"
    mixed = _workloads((), [128], [0], "uniform:128:4096", 28, 4, 128, 16, "float16")
    assert len(mixed) == 1 and mixed[0].context == (128, 4096)
    lens = mixed[0].lengths(seed=3)
    assert lens.shape == (128,) and lens.min() >= 128 and lens.max() <= 4096 and len(set(lens)) > 50
    assert mixed[0].context_label == "U128-4096"
    assert {w.kv_cache_dtype for w in ws + mixed} == {"auto"}


def test_rows_give_whole_shapes_in_one_run(monkeypatch):
    """--row: each its own heads, KV heads, batch and context (or uniform lengths), in the
    order given, with the shared head size, block size and dtype; nothing else crossed in."""
    seen = []
    _fake_sweep(monkeypatch, seen)
    r = CliRunner().invoke(main, ["decode", "--row", "32/8/64/2048", "--row", "8/1/64/4096",
                                  "--row", "32/8/128/uniform:128:4096", "--batch", "1,2",
                                  "--head-size", "64", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert [(w.heads, w.kv_heads, w.batch, w.context) for w in seen] == [
        (32, 8, 64, 2048), (8, 1, 64, 4096), (32, 8, 128, (128, 4096))]
    assert {(w.head_size, w.block_size, w.dtype) for w in seen} == {(64, 16, "bfloat16")}


@pytest.mark.parametrize("given, canonical", [("auto", "auto"), ("fp8", "fp8_e4m3"),
                                              ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")])
def test_workloads_carry_the_kv_cache_dtype(given, canonical):
    from cupaged.bench.cli import _workloads

    ws = _workloads(("llama-3-8b",), [1, 8], [512], None, 1, 1, 1, 16, "bf16", given)
    assert len(ws) == 2 and {w.kv_cache_dtype for w in ws} == {canonical}


def _synthetic_results():
    from cupaged.bench.workloads import Result

    rows = []
    for impl, scale in (("cupaged", 1.0), ("cupy-gather", 3.0)):
        for ctx in (512, 2048, 8192):
            us = scale * ctx / 10
            rows.append(Result(impl, "paged_decode_f16_hs128_bs16_vllm_g4_sm90" if impl == "cupaged" else "",
                               "llama-3-8b", 64, str(ctx), float(ctx), 32, 8, 128, 16, "float16",
                               "auto", "ok", us, us * 0.98, us * 1.03, 2000 / scale, 66.0 / scale,
                               2e-4, scale))
    rows.append(Result("flashinfer-decode", "", "llama-3-8b", 64, "8192", 8192.0, 32, 8, 128, 16,
                       "float16", "auto", "ok", 700.0, 690.0, 720.0, 1900.0, 62.0, 3e-4, 0.85,
                       plan_us=612.5))
    rows.append(Result("torch-sdpa-dense", "", "llama-3-8b", 64, "8192", 8192.0, 32, 8, 128, 16,
                       "float16", "auto", "skipped", note="out of GPU memory"))
    return rows


ENV = {"cupaged": "0.1.0", "gpus": [{"index": 0, "name": "Fake GPU"}], "torch": None}


def test_json_writer_keeps_every_field(tmp_path):
    import dataclasses
    import json

    from cupaged.bench import report
    from cupaged.bench import workloads

    rows = _synthetic_results()
    report.write_json(tmp_path / "r.json", rows, ENV, 3000.0)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["environment"] == ENV and doc["copy_bandwidth_gbps"] == 3000.0
    assert len(doc["results"]) == len(rows)
    assert set(doc["results"][0]) == {f.name for f in dataclasses.fields(workloads.Result)}
    assert doc["results"][3]["ratio_to_cupaged"] == 3.0
    assert doc["results"][-1]["status"] == "skipped"
    plans = [r["plan_us"] for r in doc["results"]]  # NaN (JSON's NaN) but for FlashInfer's
    assert plans[6] == 612.5 and all(p != p for i, p in enumerate(plans) if i != 6)


def test_csv_writer_has_environment_and_rows(tmp_path):
    import csv

    from cupaged.bench import report

    rows = _synthetic_results()
    report.write_csv(tmp_path / "r.csv", rows, ENV, 3000.0)
    lines = (tmp_path / "r.csv").read_text().splitlines()
    comments = [l for l in lines if l.startswith("#")]
    assert "# cupaged: \"0.1.0\"" in comments and any("Fake GPU" in c for c in comments)
    table = list(csv.DictReader(l for l in lines if not l.startswith("#")))
    assert len(table) == len(rows) and table[0]["impl"] == "cupaged"
    assert float(table[4]["median_us"]) == rows[4].median_us
    assert float(table[6]["plan_us"]) == 612.5 and table[0]["plan_us"] == "nan"


def test_plot_writer_makes_a_png(tmp_path):
    from cupaged.bench import report

    report.write_plot(tmp_path / "p.png", _synthetic_results(), "synthetic")
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_summary_has_one_line_per_workload_and_the_notes():
    from cupaged.bench import report

    lines = report.summary_lines(_synthetic_results())
    head, body = lines[0], lines[1:]
    assert "cupaged us" in head and "fi-decode" in head and "sdpa-dense" in head
    assert "plan us:" in head  # FlashInfer planned
    rows = [l for l in body if l.startswith("llama-3-8b")]
    assert len(rows) == 3  # 512, 2048, 8192
    last = rows[-1].split()
    # cupaged's 819.2 us, then cupy-gather 3.00, FlashInfer 0.85, SDPA skipped, plan 612.5
    assert last[3] == "819.2" and last[6:9] == ["3.00", "0.85", "SKIP"] and last[-1] == "612"
    assert rows[0].split()[7] == "-"  # no FlashInfer row at 512
    assert any("1 x torch-sdpa-dense skipped: out of GPU memory" in l for l in body)


def test_table_shows_ratios_and_skips(capsys):
    from cupaged.bench.cli import _print_table

    _print_table(_synthetic_results(), compare=True)
    out = capsys.readouterr().out
    assert "x cupaged" in out and "SKIPPED: out of GPU memory" in out
    assert "    3.00" in out
    lines = out.splitlines()
    assert lines[0].endswith("plan us")
    assert [l.split()[-1] for l in lines[1:] if "SKIPPED" not in l] == ["-"] * 6 + ["612.5"]


def test_table_shows_the_note_of_an_ok_row(capsys):
    import dataclasses

    from cupaged.bench.cli import _print_table

    rows = _synthetic_results()
    rows[6] = dataclasses.replace(rows[6], note="computes in fp8 e4m3", kv_cache_dtype="fp8_e4m3")
    _print_table(rows, compare=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[7].endswith("612.5  computes in fp8 e4m3") and "computes" not in lines[1]


def test_table_has_no_plan_column_without_plans(capsys):
    from cupaged.bench.cli import _print_table

    _print_table([r for r in _synthetic_results() if r.impl != "flashinfer-decode"], compare=True)
    out = capsys.readouterr().out
    assert "plan us" not in out and out.splitlines()[1].split()[-1] == "1.00"


@pytest.mark.parametrize("impl", ["flashinfer-decode", "flashinfer-decode-tc", "flashinfer-xqa"])
def test_compare_flashinfer_impl_without_flashinfer_is_a_usage_error(impl, no_flashinfer):
    r = CliRunner().invoke(main, ["compare", "--impl", "cupaged", "--impl", impl])
    assert r.exit_code == 2, r.output
    assert f"--impl {impl} needs FlashInfer" in r.output
    assert "No module named 'flashinfer'" in r.output


def _fake_sweep(monkeypatch, workloads=None):
    """compare as on a GPU, with bench_decode.measure faked: which implementations it is asked for
    (and, into ``workloads``, the workloads)."""
    from cupaged.bench import timing
    from cupaged.bench import decode as bench_decode
    from cupaged.bench import report
    from cupaged.bench import workloads as bench_workloads
    from cupaged.bench import cli

    asked = []

    def measure(w, impls, partition, reps, seed, bw):
        asked.append(list(impls))
        if workloads is not None:
            workloads.append(w)
        return [bench_workloads.Result(i, "", w.preset, w.batch, w.context_label, 512.0, w.heads,
                             w.kv_heads, w.head_size, w.block_size, w.dtype, "auto", "ok",
                             10.0, 9.0, 11.0, 2000.0, 60.0, 1e-4, 1.0,
                             kv_cache_dtype=w.kv_cache_dtype, **w.variants.fields())
                for i in impls]

    monkeypatch.setattr(cli, "_gpu_count", lambda: 1)
    monkeypatch.setattr(timing, "copy_bandwidth", lambda: 3e12)
    monkeypatch.setattr(bench_decode, "measure", measure)
    monkeypatch.setattr(report, "environment", lambda: ENV)
    return asked


def test_compare_without_flashinfer_says_so_once(monkeypatch, no_flashinfer):
    asked = _fake_sweep(monkeypatch)
    r = CliRunner().invoke(main, ["compare", "--batch", "1,8", "--context", "512,2048"])
    assert r.exit_code == 0, r.output  # not 3: nothing was skipped
    lines = [l for l in r.output.splitlines() if "flashinfer" in l]
    assert lines == ["flashinfer rows skipped: No module named 'flashinfer'"]
    assert len(asked) == 4 and all(a[0] == "cupaged" and "cupy-gather" in a for a in asked)


def test_compare_with_flashinfer_lists_its_rows(monkeypatch):
    import types

    from cupaged.bench import decode as bench_decode
    from cupaged.bench import peers

    asked = _fake_sweep(monkeypatch)
    monkeypatch.setattr(peers, "import_flashinfer", lambda: (types.ModuleType("flashinfer"), None))
    r = CliRunner().invoke(main, ["compare", "--batch", "1", "--context", "512"])
    assert r.exit_code == 0, r.output
    assert "skipped" not in r.output
    assert asked == [bench_decode.available_implementations()] and asked[0][-1] == "flashinfer-xqa"


def test_compare_over_fp8_leaves_out_the_peers_without_it(monkeypatch, no_flashinfer, tmp_path):
    import csv

    from cupaged.bench import decode as bench_decode

    seen = []
    asked = _fake_sweep(monkeypatch, seen)
    r = CliRunner().invoke(main, ["compare", "--batch", "1", "--context", "512", "--kv-cache-dtype",
                                  "fp8", "--csv", str(tmp_path / "c.csv")])
    assert r.exit_code == 0, r.output
    assert "no fp8 cache path, left out: cupy-gather, torch-sdpa-paged, torch-sdpa-dense" in r.output
    assert "KV cache fp8_e4m3: random finite values, per-tensor scales" in r.output
    assert asked == [bench_decode.available_implementations("fp8_e4m3")] and asked[0][0] == "cupaged"
    assert not {"cupy-gather", "torch-sdpa-paged", "torch-sdpa-dense"} & set(asked[0])
    assert [w.kv_cache_dtype for w in seen] == ["fp8_e4m3"]
    lines = [l for l in (tmp_path / "c.csv").read_text().splitlines() if not l.startswith("#")]
    assert {row["kv_cache_dtype"] for row in csv.DictReader(lines)} == {"fp8_e4m3"}


def test_decode_over_fp8_e5m2_passes_it_to_every_workload(monkeypatch):
    seen = []
    asked = _fake_sweep(monkeypatch, seen)
    r = CliRunner().invoke(main, ["decode", "--batch", "1,4", "--context", "512",
                                  "--kv-cache-dtype", "fp8_e5m2", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert asked == [["cupaged"], ["cupaged"]]
    assert [(w.batch, w.kv_cache_dtype, w.dtype) for w in seen] == [
        (1, "fp8_e5m2", "bfloat16"), (4, "fp8_e5m2", "bfloat16")]
    assert "KV cache fp8_e5m2" in r.output and "left out" not in r.output


def test_compare_over_16_bit_caches_says_nothing_of_fp8(monkeypatch, no_flashinfer):
    _fake_sweep(monkeypatch)
    r = CliRunner().invoke(main, ["compare", "--batch", "1", "--context", "512"])
    assert r.exit_code == 0, r.output
    assert "fp8" not in r.output and "KV cache" not in r.output


# ---- attention variants ------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["decode", "compare", "prefill"])
def test_variant_options_are_documented(cmd):
    r = CliRunner().invoke(main, [cmd, "--help"])
    out = " ".join(r.output.split())
    assert r.exit_code == 0
    for opt in ("--window W", "--soft-cap C", "--sinks", "--alibi", "window_left = W - 1"):
        assert opt in out, opt
    if cmd == "prefill":
        assert "TFLOP/s then count only the (query, key) pairs inside the window" in out
    else:
        assert "count only the keys a query sees: min(context, W) tokens per sequence" in out


def test_decode_passes_the_variants_to_every_workload(monkeypatch, tmp_path):
    import csv
    import json

    from cupaged.bench import workloads

    seen = []
    asked = _fake_sweep(monkeypatch, seen)
    r = CliRunner().invoke(main, ["decode", "--batch", "1,8", "--context", "32768",
                                  "--window", "512", "--soft-cap", "50", "--sinks", "--alibi",
                                  "--json", str(tmp_path / "d.json"), "--csv", str(tmp_path / "d.csv")])
    assert r.exit_code == 0, r.output
    assert asked == [["cupaged"], ["cupaged"]]
    v = workloads.Variants(512, 50.0, True, True)
    assert [w.variants for w in seen] == [v, v]
    assert "variants: window 512 (FlashInfer's window_left 511; bytes and FLOPs count only " \
           "the keys inside it), soft-cap 50, sinks (standard normal per head, seed" in r.output
    rows = json.loads((tmp_path / "d.json").read_text())["results"]
    assert {(x["window"], x["soft_cap"], x["sinks"], x["alibi"]) for x in rows} == {(512, 50.0, True, True)}
    lines = [l for l in (tmp_path / "d.csv").read_text().splitlines() if not l.startswith("#")]
    assert {(x["window"], x["soft_cap"], x["sinks"], x["alibi"]) for x in csv.DictReader(lines)} \
        == {("512", "50.0", "True", "True")}


def test_plain_decode_says_nothing_of_variants(monkeypatch):
    from cupaged.bench import workloads

    seen = []
    _fake_sweep(monkeypatch, seen)
    r = CliRunner().invoke(main, ["decode", "--batch", "1", "--context", "512"])
    assert r.exit_code == 0, r.output
    assert "variants" not in r.output and seen[0].variants == workloads.PLAIN


def test_compare_with_a_window_leaves_out_the_plain_peers(monkeypatch, no_flashinfer):
    from cupaged.bench import decode as bench_decode
    from cupaged.bench import workloads

    asked = _fake_sweep(monkeypatch)
    r = CliRunner().invoke(main, ["compare", "--batch", "8", "--context", "2048", "--window", "512"])
    assert r.exit_code == 0, r.output
    # (not flashinfer-xqa: the line about FlashInfer's missing rows covers it)
    assert [l for l in r.output.splitlines() if l.startswith("cannot run")] == [
        "cannot run window 512, left out: cupy-gather, torch-sdpa-paged, torch-sdpa-dense"]
    v = workloads.Variants(window=512)
    assert asked == [bench_decode.available_implementations("auto", v)]
    assert not {"cupy-gather", "torch-sdpa-paged", "torch-sdpa-dense"} & set(asked[0])
    assert asked[0][:3] == ["cupaged", "cupaged-nhd", "cupaged-hnd"]


@pytest.mark.parametrize("flags, left_out", [
    (["--window", "512", "--soft-cap", "50"], ["flashinfer-xqa"]),
    (["--sinks"], ["flashinfer-decode", "flashinfer-decode-tc"]),
    (["--window", "512", "--sinks"], ["flashinfer-decode", "flashinfer-decode-tc"]),
    (["--alibi"], ["flashinfer-decode", "flashinfer-decode-tc", "flashinfer-xqa"]),
])
def test_compare_with_flashinfer_keeps_the_rows_that_take_the_variants(monkeypatch, flags,
                                                                        left_out):
    import types

    from cupaged.bench import decode as bench_decode
    from cupaged.bench import peers

    asked = _fake_sweep(monkeypatch)
    monkeypatch.setattr(peers, "import_flashinfer", lambda: (types.ModuleType("flashinfer"), None))
    r = CliRunner().invoke(main, ["compare", "--batch", "1", "--context", "512", *flags])
    assert r.exit_code == 0, r.output
    line = [l for l in r.output.splitlines() if l.startswith("cannot run")]
    assert len(line) == 1 and line[0].endswith(", ".join(left_out))
    fi = [i for i in asked[0] if i.startswith("flashinfer")]
    assert fi == [i for i in bench_decode.FLASHINFER_IMPLS if i not in left_out]


# ---- cascade on the host (the float64 reference standing in for the kernels) ---------------------


def _fake_cascade(monkeypatch):
    from cupaged.bench import timing
    from test_bench import on_host

    from cupaged.bench import report
    from cupaged.bench import cli

    calls = on_host(monkeypatch)
    monkeypatch.setattr(cli, "_gpu_count", lambda: 1)
    monkeypatch.setattr(timing, "copy_bandwidth", lambda: 3e12)
    monkeypatch.setattr(report, "environment", lambda: ENV)
    return calls


def test_cascade_prints_checks_steps_and_speedup(monkeypatch, tmp_path):
    import csv
    import json

    _fake_cascade(monkeypatch)
    r = CliRunner().invoke(main, ["cascade", "--seqs", "5", "--prefix", "64", "--suffix", "20",
                                  "--heads", "8", "--kv-heads", "2", "--head-size", "32",
                                  "--dtype", "float32", "--reps", "3",
                                  "--json", str(tmp_path / "c.json"), "--csv", str(tmp_path / "c.csv")])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "cascade: 5 sequences x (shared prefix 64 + own 20 tokens), 8/2/32" in out
    assert "cascade vs plain" in out and "FAILED" not in out
    for step in ("plain decode: 5 x 84 tokens", "cascade: prefix + suffix + merge",
                 "prefix: 5 queries x 64 shared, non-causal", "suffix: 5 x 20-token decode",
                 "merge_state"):
        assert step in out, step
    assert "speed-up of the cascade over plain decode: 1.00x" in out
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["config"]["prefix"] == 64 and doc["config"]["kv_layout"] == "NHD"
    assert doc["checks"]["ok"] and doc["speedup"] == 1.0 and doc["environment"] == ENV
    assert [x["step"] for x in doc["rows"]] == ["plain", "cascade", "prefix", "suffix", "merge"]
    assert all(x["status"] == "ok" for x in doc["rows"])
    lines = [l for l in (tmp_path / "c.csv").read_text().splitlines() if not l.startswith("#")]
    table = list(csv.DictReader(lines))
    assert len(table) == 5 and table[0]["seqs"] == "5" and table[0]["check_ok"] == "True"
    assert float(table[1]["median_us"]) == 100.0


def test_cascade_with_a_failed_check_exits_1(monkeypatch):
    import cupaged

    _fake_cascade(monkeypatch)
    monkeypatch.setattr(cupaged, "merge_state",
                        lambda oa, la, ob, lb, out, lse_out: (out, lse_out))  # writes nothing
    r = CliRunner().invoke(main, ["cascade", "--seqs", "4", "--prefix", "32", "--suffix", "3",
                                  "--heads", "4", "--kv-heads", "2", "--head-size", "32",
                                  "--dtype", "float32", "--reps", "3"])
    assert r.exit_code == 1, r.output
    assert "FAILED" in r.output and "speed-up" not in r.output
    assert r.output.count("FAILED: check failed: not timed") == 5


@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU message")
def test_cascade_without_gpu_exits_nonzero():
    r = CliRunner().invoke(main, ["cascade"])
    assert r.exit_code == 2 and "no GPU" in r.output


# ---- on a GPU: every subcommand end to end, small sweeps ------------------------------------


@pytest.mark.gpu
def test_info_lists_the_gpu():
    r = CliRunner().invoke(main, ["info"])
    assert r.exit_code == 0 and "compute capability" in r.output and "SMs" in r.output


@pytest.mark.gpu
def test_decode_sweep_writes_files(tmp_path):
    import json

    argv = ["decode", "--batch", "1,4", "--context", "100,700", "--heads", "8", "--kv-heads", "2",
            "--head-size", "64", "--reps", "5", "--json", str(tmp_path / "d.json"),
            "--csv", str(tmp_path / "d.csv"), "--plot", str(tmp_path / "d.png")]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "d.json").read_text())["results"]
    assert len(rows) == 4 and all(x["status"] == "ok" and x["median_us"] > 0 for x in rows)
    assert all(x["kernel"].startswith("paged_decode_f16_hs64_bs16_vllm_g4_sm") for x in rows)
    assert (tmp_path / "d.png").stat().st_size > 5000 and (tmp_path / "d.csv").is_file()


@pytest.mark.gpu
def test_decode_with_mixed_lengths_and_a_preset():
    r = CliRunner().invoke(main, ["decode", "--preset", "qwen2.5-7b", "--batch", "16",
                                  "--context-dist", "uniform:1:900", "--reps", "5",
                                  "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert "28/4/128" in r.output and "U1-900" in r.output


@pytest.mark.gpu
def test_compare_runs_every_available_implementation(tmp_path):
    import json

    from cupaged.bench import decode as bench_decode

    r = CliRunner().invoke(main, ["compare", "--preset", "llama-3-8b", "--batch", "2",
                                  "--context", "300", "--reps", "5", "--json", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "c.json").read_text())["results"]
    assert [x["impl"] for x in rows] == bench_decode.available_implementations()
    assert rows[0]["ratio_to_cupaged"] == 1.0
    assert all(x["status"] == "ok" for x in rows), [x["note"] for x in rows]


@pytest.mark.gpu
def test_compare_flashinfer_rows_check_and_plan(tmp_path):
    """FlashInfer's rows on mixed lengths (partial last pages, block multiples), checked
    against the reference; plan() host time for the planned ones only."""
    import json

    from cupaged.bench import decode as bench_decode
    from cupaged.bench import peers

    why = peers.flashinfer_unavailable()
    if why:
        pytest.skip(f"flashinfer unavailable: {why} (source .flashinfer/setup.sh)")
    argv = ["compare", "--heads", "16", "--kv-heads", "4", "--batch", "5",
            "--context-dist", "uniform:1:300", "--reps", "3", "--json", str(tmp_path / "f.json"),
            "--impl", "cupaged"] + [a for i in bench_decode.FLASHINFER_IMPLS for a in ("--impl", i)]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "f.json").read_text())["results"]
    assert [x["impl"] for x in rows] == ["cupaged", *bench_decode.FLASHINFER_IMPLS]
    assert all(x["status"] == "ok" and x["rel_err"] < 1e-3 for x in rows), [x["note"] for x in rows]
    plans = {x["impl"]: x["plan_us"] for x in rows}
    assert plans["flashinfer-decode"] > 0 and plans["flashinfer-decode-tc"] > 0
    assert plans["cupaged"] != plans["cupaged"] and plans["flashinfer-xqa"] != plans["flashinfer-xqa"]
    assert "plan us" in r.output


@pytest.mark.gpu
def test_decode_over_an_fp8_cache(tmp_path):
    import json

    argv = ["decode", "--batch", "2", "--context", "100,700", "--heads", "8", "--kv-heads", "2",
            "--head-size", "64", "--reps", "3", "--kv-cache-dtype", "fp8_e4m3",
            "--json", str(tmp_path / "d.json")]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    assert "KV cache fp8_e4m3" in r.output
    rows = json.loads((tmp_path / "d.json").read_text())["results"]
    assert len(rows) == 2 and all(x["status"] == "ok" and x["rel_err"] <= 1e-3 for x in rows)
    assert all(x["kv_cache_dtype"] == "fp8_e4m3" for x in rows)
    assert all(x["kernel"].startswith("paged_decode_f16_e4m3_hs64_bs16_vllm_g4_sm") for x in rows)


@pytest.mark.gpu
def test_compare_over_an_fp8_cache(tmp_path):
    """Every implementation with an fp8 path that runs here (FlashInfer's when it
    imports), checked against the reference on the same bytes."""
    import json

    from cupaged.bench import decode as bench_decode

    r = CliRunner().invoke(main, ["compare", "--heads", "16", "--kv-heads", "4", "--batch", "3",
                                  "--context-dist", "uniform:1:300", "--reps", "3",
                                  "--kv-cache-dtype", "fp8", "--json", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "c.json").read_text())["results"]
    assert [x["impl"] for x in rows] == bench_decode.available_implementations("fp8_e4m3")
    assert all(x["status"] == "ok" and x["kv_cache_dtype"] == "fp8_e4m3" for x in rows), \
        [(x["impl"], x["note"]) for x in rows]
    # XQA computes in fp8 and says so; the rest read the cache as exactly as cupaged
    assert all(x["rel_err"] <= 1e-3 for x in rows if x["impl"] != "flashinfer-xqa")
    assert all("computes in fp8" in x["note"] for x in rows if x["impl"] == "flashinfer-xqa")


@pytest.mark.gpu
def test_prefill_over_an_fp8_cache():
    r = CliRunner().invoke(main, ["prefill", "--batch", "2", "--query-len", "64", "--context",
                                  "200", "--heads", "8", "--kv-heads", "2", "--head-size", "64",
                                  "--reps", "3", "--impl", "cupaged", "--kv-cache-dtype",
                                  "fp8_e5m2"])
    assert r.exit_code == 0, r.output
    assert "KV cache fp8_e5m2" in r.output and "WRONG" not in r.output
    row = [l for l in r.output.splitlines() if l.startswith("2x64/200")]
    assert len(row) == 1 and row[0].split()[1] == "cupaged" and "Error" not in row[0]


@pytest.mark.gpu
def test_compile_times_with_module_load(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(main, ["compile", "--head-size", "96"])
    assert r.exit_code == 0, r.output
    assert "module load" in r.output and r.output.strip().endswith("ms")


@pytest.mark.gpu
def test_overhead_reports_every_entry_point():
    r = CliRunner().invoke(main, ["overhead", "--calls", "20"])
    assert r.exit_code == 0, r.output
    for name in ("single pass", "split-KV", "reshape_and_cache", "copy_blocks",
                 "PagedKVCache.step", "CuPy graph replay", "attention, NHD, decode",
                 "AttentionPlan.run, NHD, decode", "AttentionPlan.run, NHD, verify",
                 "sparse_mla_attention, 128 heads"):
        assert name in r.output
    if importlib.util.find_spec("torch") is not None:
        assert "torch tensors, single pass" in r.output and "torch.cuda.graph replay" in r.output
        assert "AttentionPlan.run, torch tensors" in r.output


def test_overhead_with_the_driver_stubbed_needs_no_gpu():
    from cupaged import jit

    driver = jit.driver
    r = CliRunner().invoke(main, ["overhead", "--stub-driver", "--calls", "10"])
    assert r.exit_code == 0, r.output
    for name in ("python gauge", "AttentionPlan.run, decode 64 x 64 (single pass)",
                 "attention, decode 64 x 256 (flat split, scratch)",
                 "attention, decode 8 x 2048 (split-KV, scratch)",
                 "AttentionPlan.run, prefill 16 x 32 tokens, stream= (generic path)",
                 "mla_attention, 128 heads, decode (single pass)",
                 "mla_attention, 16 heads, decode (split-KV, workspace)",
                 "mla_attention, 16 heads, decode (split-KV, scratch)",
                 "mla_attention, 128 heads, decode (single pass), stream= (generic path)",
                 "reshape_and_cache, 8 tokens"):
        assert name in r.output
    assert jit.driver is driver  # the stand-ins are gone


@pytest.mark.parametrize("other", [["--stub-driver"], ["--calls", "50"]])
def test_overhead_refuses_what_pieces_does_not_take(other):
    """--pieces launches on a GPU, which --stub-driver stands in for, and times its own
    runs: refused before anything is timed (no GPU needed to say so)."""
    r = CliRunner().invoke(main, ["overhead", "--pieces", *other])
    assert r.exit_code == 2 and other[0] in r.output, r.output


@pytest.mark.gpu
def test_cache_ops_small():
    r = CliRunner().invoke(main, ["cache-ops", "--tokens", "256", "--layers", "2", "--pairs", "8",
                                  "--seqs", "16", "--reps", "5"])
    assert r.exit_code == 0, r.output
    assert "FAILED" not in r.output and "swap in, one cudaMemcpyAsync per block" in r.output


@pytest.mark.gpu
def test_decode_with_variants(tmp_path):
    import json

    argv = ["decode", "--batch", "2,5", "--context", "300", "--heads", "8", "--kv-heads", "2",
            "--head-size", "64", "--reps", "3", "--window", "100", "--soft-cap", "20", "--sinks",
            "--json", str(tmp_path / "d.json")]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    assert "variants: window 100" in r.output
    rows = json.loads((tmp_path / "d.json").read_text())["results"]
    assert len(rows) == 2 and all(x["status"] == "ok" and x["rel_err"] <= 1e-3 for x in rows)
    assert all((x["window"], x["soft_cap"], x["sinks"], x["alibi"]) == (100, 20.0, True, False)
               for x in rows)
    assert all("_wc_" in x["kernel"] for x in rows)


@pytest.mark.gpu
def test_decode_with_alibi():
    r = CliRunner().invoke(main, ["decode", "--batch", "3", "--context", "200", "--heads", "8",
                                  "--kv-heads", "2", "--head-size", "64", "--reps", "3", "--alibi"])
    assert r.exit_code == 0, r.output
    assert "ALiBi" in r.output


@pytest.mark.gpu
def test_compare_with_a_window_and_a_soft_cap(tmp_path):
    """cupaged's three rows and (when FlashInfer imports) its decode wrappers with
    window_left and logits_soft_cap, all checked against the reference."""
    import json

    from cupaged.bench import decode as bench_decode
    from cupaged.bench import workloads

    r = CliRunner().invoke(main, ["compare", "--heads", "16", "--kv-heads", "4", "--batch", "3",
                                  "--context-dist", "uniform:1:300", "--reps", "3", "--window",
                                  "64", "--soft-cap", "30", "--json", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "c.json").read_text())["results"]
    v = workloads.Variants(64, 30.0)
    assert [x["impl"] for x in rows] == bench_decode.available_implementations("auto", v)
    assert all(x["status"] == "ok" and x["rel_err"] <= 1e-3 for x in rows), \
        [(x["impl"], x["note"]) for x in rows]


@pytest.mark.gpu
def test_compare_with_a_window_and_sinks(tmp_path):
    """cupaged's rows and (when FlashInfer imports) XQA with window_left and sinks, checked
    against the reference: the same conventions."""
    import json

    from cupaged.bench import decode as bench_decode
    from cupaged.bench import workloads

    r = CliRunner().invoke(main, ["compare", "--heads", "16", "--kv-heads", "4", "--batch", "3",
                                  "--context-dist", "uniform:1:300", "--reps", "3", "--window",
                                  "64", "--sinks", "--json", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "c.json").read_text())["results"]
    v = workloads.Variants(64, sinks=True)
    assert [x["impl"] for x in rows] == bench_decode.available_implementations("auto", v)
    assert all(x["status"] == "ok" and x["rel_err"] <= 1e-3 for x in rows), \
        [(x["impl"], x["note"]) for x in rows]


@pytest.mark.gpu
def test_prefill_with_variants():
    r = CliRunner().invoke(main, ["prefill", "--batch", "2", "--query-len", "64", "--context",
                                  "200", "--heads", "8", "--kv-heads", "2", "--head-size", "64",
                                  "--reps", "3", "--impl", "cupaged", "--window", "50",
                                  "--soft-cap", "20", "--sinks"])
    assert r.exit_code == 0, r.output
    assert "variants: window 50" in r.output and "WRONG" not in r.output
    row = [l for l in r.output.splitlines() if l.startswith("2x64/200")]
    assert len(row) == 1 and row[0].split()[1] == "cupaged" and "Error" not in row[0]


@pytest.mark.gpu
def test_prefill_with_alibi_and_a_soft_cap():
    r = CliRunner().invoke(main, ["prefill", "--batch", "2", "--query-len", "64", "--context",
                                  "200", "--heads", "8", "--kv-heads", "2", "--head-size", "64",
                                  "--reps", "3", "--impl", "cupaged", "--alibi", "--soft-cap", "20"])
    assert r.exit_code == 0, r.output
    assert "ALiBi" in r.output and "WRONG" not in r.output
    row = [l for l in r.output.splitlines() if l.startswith("2x64/200")]
    assert len(row) == 1 and row[0].split()[1] == "cupaged" and "Error" not in row[0]


@pytest.mark.gpu
def test_prefill_with_a_window_over_the_peers():
    """Every peer that imports: FlashInfer with window_left, SDPA left out."""
    r = CliRunner().invoke(main, ["prefill", "--batch", "2", "--query-len", "64", "--context",
                                  "200", "--heads", "8", "--kv-heads", "2", "--head-size", "64",
                                  "--reps", "3", "--window", "40"])
    assert r.exit_code == 0, r.output
    assert "WRONG" not in r.output
    rows = [l for l in r.output.splitlines() if l.startswith("2x64/200")]
    assert rows and rows[0].split()[1] == "cupaged" and "Error" not in rows[0]
    assert not any("torch-sdpa" in l for l in rows)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm"])
def test_cascade_small(tmp_path, layout):
    import json

    r = CliRunner().invoke(main, ["cascade", "--seqs", "6", "--prefix", "128", "--suffix", "37",
                                  "--heads", "8", "--kv-heads", "2", "--head-size", "64",
                                  "--kv-layout", layout, "--reps", "3",
                                  "--json", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["checks"]["ok"] and doc["speedup"] > 0
    assert all(x["status"] == "ok" and x["median_us"] > 0 for x in doc["rows"])
