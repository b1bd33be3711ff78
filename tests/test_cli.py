"""cupaged-bench's command line, without a GPU (the GPU runs are in the device check)."""

import pytest
from click.testing import CliRunner

from cupaged import jit
from cupaged.cli import main
from conftest import HAVE_GPU

COMMANDS = ["info", "compile", "decode", "cache-ops"]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_subcommand_has_help(cmd):
    r = CliRunner().invoke(main, [cmd, "--help"])
    assert r.exit_code == 0 and "Usage:" in r.output


def test_group_help_lists_the_subcommands():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and all(c in r.output for c in COMMANDS)


@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU message")
def test_info_without_gpu_says_so():
    r = CliRunner().invoke(main, ["info"])
    assert r.exit_code == 0, r.output
    assert "none found" in r.output and "nvrtc" in r.output and "kernel cache" in r.output


@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU message")
def test_decode_without_gpu_exits_nonzero():
    r = CliRunner().invoke(main, ["decode", "--batch", "1"])
    assert r.exit_code == 2 and "no GPU" in r.output


@pytest.mark.parametrize("argv, msg", [
    (["decode", "--batch", "1,x"], "comma-separated integers"),
    (["decode", "--batch", "-4"], "non-negative"),
    (["decode", "--dtype", "int8"], "unknown dtype"),
    (["decode", "--heads", "6", "--kv-heads", "4"], "multiple of --kv-heads"),
    (["decode", "--partition", "often"], "auto, never, always or an int"),
    (["compile", "--dtype", "float64"], "unknown dtype"),
    (["decode", "--reps", "1"], "--reps"),
])
def test_bad_options_are_usage_errors(argv, msg):
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2 and msg in r.output


def test_compile_reports_cold_and_warm_times(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(main, ["compile", "--arch", "sm_90", "--head-size", "64,96"])
    assert r.exit_code == 0, r.output
    lines = [l for l in r.output.splitlines() if l.startswith("paged_decode_")]
    assert [l.split()[0] for l in lines] == ["paged_decode_f16_hs64_bs16_g4_sm90",
                                             "paged_decode_f16_hs96_bs16_g4_sm90"]
    assert all(" s " in l and l.endswith("ms") for l in lines)
    assert not list(tmp_path.iterdir())  # timings use a private cold cache


def test_compile_precompile_fills_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    jit.clear_memory_caches()
    r = CliRunner().invoke(main, ["compile", "--arch", "sm_80", "--precompile", "--dtype",
                                  "bfloat16", "--block-size", "8,32", "--group", "1"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.cubin")) == [
        "paged_decode_bf16_hs128_bs32_g1_sm80", "paged_decode_bf16_hs128_bs8_g1_sm80"]
    jit.clear_memory_caches()
