"""tools/ without a GPU: the device script's modes print the commands they would run
(DRY=1), every mutant still applies to the source it mutates, and the kernel report reads
Nsight Compute's source CSV and compiles a specialization's resource report."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def _dry(tmp_path, *args, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "DRY": "1", "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(TOOLS / "device.sh"), *args], capture_output=True,
                          text=True, env=e, timeout=60)


@pytest.mark.parametrize("script", sorted(p.name for p in TOOLS.glob("*.sh")))
def test_shell_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(TOOLS / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_tool_has_a_usage_header():
    for p in TOOLS.iterdir():
        if p.suffix == ".sh":
            head = p.read_text().splitlines()[1:3]
            assert all(line.startswith("#") for line in head), p.name
        elif p.suffix == ".py":
            assert '"""' in p.read_text()[:400], p.name


def test_without_a_mode_the_script_prints_its_usage(tmp_path):
    r = _dry(tmp_path)
    assert r.returncode == 2 and "suite [SHARD]" in r.stderr and "profile [--set" in r.stderr


def test_suite_shards(tmp_path):
    r = _dry(tmp_path, "suite", "2", "-k", "foo")
    assert r.returncode == 0, r.stderr
    pytest_line = next(ln for ln in r.stdout.splitlines() if "-m pytest" in ln)
    assert "-m gpu" in pytest_line and "--ignore=tests/test_decode.py" in pytest_line
    assert pytest_line.split(">")[0].rstrip().endswith("-k foo")
    assert "cupaged.bench overhead" in r.stdout  # shard 2 runs the smoke rows
    r = _dry(tmp_path, "suite", "3", WORKERS="4")
    line = next(ln for ln in r.stdout.splitlines() if "-m pytest" in ln)
    assert "-m gpu" not in line and "-n 4" in line and "tests/test_engine.py" in line
    assert "cupaged.bench overhead" not in r.stdout


def test_the_kernels_shard_in_three_parts(tmp_path):
    """kernels-a, kernels-b and kernels-c: the kernels shard's test files split between
    three calls, every one of them in exactly one part, no serving file in any,
    FlashInfer's CLI row deselected."""
    parts = ("kernels-a", "kernels-b", "kernels-c")
    files = {}
    for part in parts:
        r = _dry(tmp_path, "suite", part, WORKERS="15")
        assert r.returncode == 0, r.stderr
        line = next(ln for ln in r.stdout.splitlines() if "-m pytest" in ln)
        assert "-m gpu" in line and "-n 15" in line
        assert "--deselect=tests/test_cli.py::test_compare_flashinfer_rows_check_and_plan" in line
        files[part] = {w for w in line.split() if w.startswith("tests/test_") and "::" not in w}
    serving = {"tests/test_engine.py", "tests/test_llama.py", "tests/test_bench_e2e.py",
               "tests/test_torch_ops.py", "tests/test_transformers.py"}
    every = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
    for i, a in enumerate(parts):
        for b in parts[i + 1:]:
            assert files[a].isdisjoint(files[b]), (a, b)
    assert set().union(*files.values()) == every - serving
    assert "tests/test_decode.py" in files["kernels-a"]
    assert "tests/test_prefill_sm90.py" in files["kernels-b"]
    assert "tests/test_varlen.py" in files["kernels-c"]


def test_every_row_set_runs_through_cupaged_bench(tmp_path):
    listed = _dry(tmp_path, "rows", "list").stdout
    names = [ln.split()[0] for ln in listed.splitlines() if ln and not ln.startswith(" ")]
    assert {"decode", "sweep", "sm90", "mla", "split", "decode-tiles", "fp8"} <= set(names)
    from click.testing import CliRunner

    from cupaged.bench.cli import main

    for name in names:
        r = _dry(tmp_path, "rows", name)
        assert r.returncode == 0 and "no row set" not in r.stderr, (name, r.stderr)
        commands = [ln for ln in r.stdout.splitlines() if ln.startswith("+ ")]
        assert commands, name
        for ln in commands:
            assert "python3 -m cupaged.bench " in ln, ln
            argv = ln.split("cupaged.bench ", 1)[1].split(" >> ")[0].split()
            # every command's options parse (--help after them: nothing runs)
            sub = 2 if argv[0] == "ab" else 1
            h = CliRunner().invoke(main, argv[:sub] + ["--help"])
            assert h.exit_code == 0, (ln, h.output)
            opts = {a.split("=")[0] for a in argv if a.startswith("--")}
            for o in opts:
                assert o in h.output, (ln, o)


def test_rows_take_sections_and_extra_arguments(tmp_path):
    r = _dry(tmp_path, "rows", "prefill-tiles:sm90", "head512:peers", "--", "--soft-cap", "50")
    commands = [ln for ln in r.stdout.splitlines() if ln.startswith("+ ")]
    assert len(commands) == 3 and all("--soft-cap 50 >>" in c for c in commands)
    assert "--tile 128,3" in commands[0] and "--head-size 512" in commands[1]
    assert "--tile 8,1,32,2" not in r.stdout
    r = _dry(tmp_path, "rows", "nope")
    assert "no row set nope" in r.stderr


def test_ab_alternates_trees_in_rounds(tmp_path):
    r = _dry(tmp_path, "ab", "--", "mla", "--preset", "dsv3-128h-4k", TREES="old .",
             ROUNDS="2")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("== round", "+ "))]
    assert [ln.split(":")[0] for ln in lines[::2]] == ["== round 1", "== round 1",
                                                       "== round 2", "== round 2"]
    assert lines[1].startswith("+ (cd old) python3 -m cupaged.")
    assert lines[3] == "+ (cd .) python3 -m cupaged.bench mla --preset dsv3-128h-4k"
    r = _dry(tmp_path, "ab", "trees:decode", TREES=".", ROUNDS="1")
    assert "(cd .) python3 -m cupaged.bench compare" in r.stdout
    assert _dry(tmp_path, "ab").returncode == 2
    r = _dry(tmp_path, "ab", "--", "mla", TREES=".", ROUNDS="1", LIMIT="90")
    assert "+ (cd .) timeout -k 5 90 python3 -m cupaged.bench mla" in r.stdout


def test_profile_wraps_a_bench_command_in_ncu(tmp_path):
    r = _dry(tmp_path, "profile", "--kernel", "paged_decode", "--tag", "d", "compare",
             "--row", "32/8/64/2048", "--impl", "cupaged-hnd")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("+ env"))
    assert line.startswith("+ env CUPAGED_BENCH_NVTX=1 ncu --metrics ")
    assert "--kernel-name regex:paged_decode --nvtx --nvtx-include timed/ python3 -m " \
           "cupaged.bench compare --row 32/8/64/2048 --impl cupaged-hnd" in line
    assert line.endswith("ncu-d.txt")
    r = _dry(tmp_path, "profile", "--set", "source", "mla", "--preset", "dsv3-128h-4k")
    assert "--section SourceCounters" in r.stdout and "--launch-count 1" in r.stdout
    assert _dry(tmp_path, "profile", "--set", "most", "mla").returncode == 2


def test_sanitize_runs_controls_then_the_tests(tmp_path):
    r = _dry(tmp_path, "sanitize", TOOLS="racecheck")
    controls = [ln for ln in r.stdout.splitlines() if "sanitize_control.py" in ln]
    assert [ln.split("sanitize_control.py ")[1].split()[0] for ln in controls] == ["race",
                                                                                  "arrive"]
    assert "--tool racecheck" in r.stdout.splitlines()[-1] and "pytest" in r.stdout
    r = _dry(tmp_path, "sanitize", "mla", "sm90", CASES="2:fp8_e4m3:sm90", TOOLS="memcheck")
    launches = [ln for ln in r.stdout.splitlines() if ln.startswith("+ ")]
    assert len(launches) == 2
    assert "kns=mla_attention" in launches[0] and launches[0].split(" >> ")[0].endswith(
        "sanitize_control.py mla 2 fp8_e4m3 sm90")
    assert "kns=paged_prefill_sm90" in launches[1]
    assert _dry(tmp_path, "sanitize", "everything").returncode == 2


def test_mutants_and_regress(tmp_path):
    r = _dry(tmp_path, "mutants", "stale-slots")
    assert "mutants.py apply stale-slots" in r.stdout
    assert "pytest -q -p no:cacheprovider -x tests/test_decode.py -k stale" in r.stdout
    r = _dry(tmp_path, "regress", "tests/test_decode.py -k stale")
    assert r.stdout.splitlines()[-1].endswith("-x tests/test_decode.py -k stale")
    assert _dry(tmp_path, "regress").returncode == 2


@pytest.mark.parametrize("name", ["quick", "main", "main-fi", "main-concat", "compiled",
                                  "prefix", "fp8"])
def test_e2e_runs_are_bench_commands(tmp_path, name):
    r = _dry(tmp_path, "e2e", name)
    assert r.returncode == 0 and "python3 -m cupaged.bench e2e" in r.stdout
    assert f"--json {tmp_path / 'out'}/e2e-{name}" in r.stdout


@pytest.mark.parametrize("name", ["stale-slots", "v2-half-capacity"])
def test_each_mutant_applies_to_the_source(tmp_path, name):
    sys.path.insert(0, str(TOOLS))
    try:
        import mutants
    finally:
        sys.path.pop(0)
    assert name in mutants.MUTANTS
    path = mutants.MUTANTS[name][0]
    (tmp_path / path).parent.mkdir(parents=True)
    shutil.copy(ROOT / path, tmp_path / path)
    mutants.apply(name, str(tmp_path))  # each pattern must match exactly once
    assert (tmp_path / path).read_text() != (ROOT / path).read_text()


def test_kernel_report_summarizes_source_counters(tmp_path):
    csv = tmp_path / "src.csv"
    csv.write_text(
        '"Kernel","x"\n'
        '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb",'
        '"stall_wait","stall_barrier (Not Issued)"\n'
        '"0x10","LDG.E R0, [R2]","30","25","5","9"\n'
        '"0x20","USETMAXREG.DEALLOC 40","10","0","10","0"\n'
        '"0x30","HMMA.16816 R4, R8","60","0","60","0"\n')
    r = subprocess.run([sys.executable, str(TOOLS / "kernel_report.py"), "source", str(csv),
                        "--top", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "100 samples, 3 instructions"
    assert out[1].startswith("- from 'LDG.E R0, [R2]': 1 instructions, 30.0% of samples")
    assert "long_sb 25.0%" in out[1] and "barrier" not in out[1]
    assert out[2].startswith("- from 'USETMAXREG.DEALLOC 40': 2 instructions, 70.0%")
    assert "HMMA.16816" in out[4] and "60.00%" in out[4]


@pytest.mark.skipif(not (shutil.which("cuobjdump") or shutil.which("ptxas")),
                    reason="needs cuobjdump or ptxas (the CUDA toolkit)")
def test_kernel_report_gives_a_specializations_resources(tmp_path):
    r = subprocess.run([sys.executable, str(TOOLS / "kernel_report.py"), "spec",
                        "paged_decode", "dtype=f16", "head_size=128", "block_size=16",
                        "group_tile=4"], capture_output=True, text=True,
                       env={**os.environ, "CUPAGED_CACHE_DIR": str(tmp_path)}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("paged_decode_f16_hs128_bs16_vllm_g4_")
    assert "registers" in r.stdout or "REG:" in r.stdout
    r = subprocess.run([sys.executable, str(TOOLS / "kernel_report.py"), "spec",
                        "paged_decode", "bogus=1"], capture_output=True, text=True)
    assert r.returncode != 0 and "expected FIELD=VALUE" in r.stderr


def test_a_packed_kernel_cache_unpacks_on_the_next_machine(tmp_path):
    """cache-pack leaves the kernel cache as xz pieces under $OUT; device_env.sh, with
    them carried as .kcache/, unpacks them once into a fresh machine's cache, the same
    bytes under the same names."""
    if not all(shutil.which(t) for t in ("xz", "split", "tar")):
        pytest.skip("needs xz, split and tar")
    cache = tmp_path / "cache"
    cache.mkdir()
    files = {"paged_decode_f16_a1b2.cubin": os.urandom(40000), "x.json": b'{"sha256": "0"}'}
    for name, data in files.items():
        (cache / name).write_bytes(data)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "CUPAGED_CACHE_DIR": str(cache)}
    env.pop("DRY", None)
    r = subprocess.run(["bash", str(TOOLS / "device.sh"), "cache-pack"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    parts = sorted(out.glob("kc.part.*"))
    assert parts
    # The next machine: a checkout with the pieces in .kcache/, an empty cache.
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(TOOLS / "device_env.sh", repo / "tools")
    (repo / ".kcache").mkdir()
    for p in parts:
        shutil.copy(p, repo / ".kcache")
    fresh = tmp_path / "fresh"
    env = {**env, "CUPAGED_CACHE_DIR": str(fresh), "OUT": str(tmp_path / "out2")}
    for _ in range(2):  # (the second finds it unpacked)
        r = subprocess.run(["bash", "-c", f"source {repo / 'tools' / 'device_env.sh'}"],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0 and "did not unpack" not in r.stderr, r.stderr
    for name, data in files.items():
        assert (fresh / name).read_bytes() == data
    assert (fresh / ".unpacked").exists()
    # Other pieces carried to the same machine later unpack too.
    (cache / "later.cubin").write_bytes(b"later")
    env2 = {**env, "OUT": str(out), "CUPAGED_CACHE_DIR": str(cache)}
    r = subprocess.run(["bash", str(TOOLS / "device.sh"), "cache-pack"], capture_output=True,
                       text=True, env=env2, timeout=60)
    assert r.returncode == 0, r.stderr
    for p in (repo / ".kcache").iterdir():
        p.unlink()
    for p in sorted(out.glob("kc.part.*")):
        shutil.copy(p, repo / ".kcache")
    r = subprocess.run(["bash", "-c", f"source {repo / 'tools' / 'device_env.sh'}"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (fresh / "later.cubin").read_bytes() == b"later"


def test_suite_limit_and_the_test_times_summary(tmp_path):
    """LIMIT= runs the suite's pytest under timeout; test-times names the tests a cut run
    left unfinished and the slowest, from CUPAGED_TEST_TIMES' per-worker logs."""
    r = _dry(tmp_path, "suite", "kernels-a", LIMIT="300")
    line = next(ln for ln in r.stdout.splitlines() if "-m pytest" in ln)
    assert line.startswith("+ timeout -k 5 300 python3 -m pytest")
    logs = tmp_path / "times"
    (tmp_path / "times.gw0").write_text("S 100.0 t::a\nF 103.5 t::a\nS 103.5 t::b\n")
    (tmp_path / "times.gw1").write_text("S 100.0 t::c\nF 100.25 t::c\n")
    r = subprocess.run(["bash", str(TOOLS / "device.sh"), "test-times", f"{logs}.gw0",
                        f"{logs}.gw1"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "OUT": str(tmp_path / "out")})
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "tests started 3, finished 2"
    assert out[1] == "unfinished (started at 4 s): t::b"
    assert [ln.split()[-1] for ln in out[2:]] == ["t::a", "t::c"]
    assert out[2].split()[0] == "3.5"


def test_conftest_logs_each_tests_start_and_finish(tmp_path):
    """CUPAGED_TEST_TIMES=PREFIX: a pytest run appends S and F lines per test to
    PREFIX.main (PREFIX.<worker> under xdist)."""
    (tmp_path / "test_two.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n"
                                          "    pass\n")
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(tmp_path / "test_two.py")], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path,
                       env={**os.environ, "CUPAGED_TEST_TIMES": str(tmp_path / "t")})
    assert r.returncode == 0, r.stdout + r.stderr
    kinds = [(ln.split()[0], ln.split()[2].split("::")[-1])
             for ln in (tmp_path / "t.main").read_text().splitlines()]
    assert kinds == [("S", "test_a"), ("F", "test_a"), ("S", "test_b"), ("F", "test_b")]
