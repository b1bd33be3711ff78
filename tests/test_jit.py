"""The compile layer: specialization names, sources, cache keys, the disk cache, threads,
the wheel, and the GPU-less compile check of every supported specialization."""

import hashlib
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from cupaged import _variants, cache_ops, jit, launch
from cupaged.bench.cli import main

SPEC = jit.KernelSpec("paged_decode", "f16", 64, 16, 4, arch="sm_90")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path / "cache"))
    jit.clear_memory_caches()
    yield tmp_path / "cache"
    jit.clear_memory_caches()


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A private copy of cuda_src that a test may edit."""
    d = tmp_path / "cuda_src"
    shutil.copytree(jit.source_dir(), d)
    monkeypatch.setattr(jit, "source_dir", lambda: d)
    return d


def test_spec_names_are_readable_and_unique():
    assert SPEC.name == "paged_decode_f16_hs64_bs16_vllm_g4_sm90"
    assert jit.KernelSpec("paged_decode_combine", "bf16", 128, arch="sm_80").name == \
        "paged_decode_combine_bf16_hs128_sm80"
    tuned = jit.KernelSpec("paged_decode", "f16", 64, 16, 4, tile_tokens=32, stages=3)
    assert tuned.name == "paged_decode_f16_hs64_bs16_vllm_g4_t32x3_sm90"


def test_spec_is_frozen_hashable_and_defaults_its_tile():
    same = jit.KernelSpec("paged_decode", "f16", 64, 16, 4)
    assert same == SPEC and hash(same) == hash(SPEC) and {same: 1}[SPEC] == 1
    assert SPEC.tile_tokens == jit.default_decode_tile(2, 64) and SPEC.stages == 2
    with pytest.raises(AttributeError):
        SPEC.head_size = 128
    assert SPEC.name_expression == (
        "cupaged::paged_decode<cupaged::half_t, cupaged::half_t, 64, 16, 1, 0, 4, 128, 2, 0>")


def test_variant_specs_name_their_variants_and_refuse_bad_spellings():
    s = jit.KernelSpec("paged_decode", "f16", 128, 16, 4, kv_format="tok", variant="wcb")
    assert s.name == "paged_decode_f16_hs128_bs16_tok_wcb_g4_sm90"
    assert s.name_expression.endswith(", 7>")
    p = jit.KernelSpec("paged_prefill", "bf16", 128, 16, variant="c")
    assert p.name.endswith("_tok_c_sm90") and p.name_expression.endswith(", 2>")
    for bad in ("cw", "ww", "x"):
        with pytest.raises(ValueError, match="variant must be"):
            jit.KernelSpec("paged_decode", "f16", 128, 16, 4, variant=bad)
    with pytest.raises(ValueError, match="variant must be"):  # blocksparse: decode only
        jit.KernelSpec("paged_prefill", "f16", 128, 16, variant="b")
    a = jit.KernelSpec("paged_prefill", "bf16", 128, 16, variant="wca")
    assert a.name.endswith("_tok_wca_sm90") and a.name_expression.endswith(", 11>")
    for bad in ("aw", "ac"):
        with pytest.raises(ValueError, match="variant must be"):
            jit.KernelSpec("paged_prefill", "bf16", 128, 16, variant=bad)
    with pytest.raises(ValueError, match="variant must be"):  # ALiBi's bit: prefill only
        jit.KernelSpec("paged_decode", "f16", 128, 16, 4, variant="a")
    f = jit.KernelSpec("paged_prefill", "bf16", 128, 16, variant="wcf")
    assert f.name.endswith("_tok_wcf_sm90") and f.name_expression.endswith(", 19>")
    for dtype, bad in (("bf16", "f"), ("bf16", "caf"), ("f16", "cf")):
        with pytest.raises(ValueError, match="fixed softmax offset"):
            jit.KernelSpec("paged_prefill", dtype, 128, 16, variant=bad)
    with pytest.raises(ValueError, match="variant must be"):  # the fixed offset: prefill only
        jit.KernelSpec("paged_decode", "bf16", 128, 16, 4, variant="cf")
    with pytest.raises(ValueError, match="takes no variant"):
        jit.KernelSpec("reshape_and_cache", "f16", kv_format="tok", index_dtype="i32",
                       variant="w")


def test_fp8_specs_name_their_cache_and_scales():
    s = jit.KernelSpec("paged_decode", "bf16", 128, 16, 8, kv_format="tok", cache_dtype="e4m3",
                       kv_scale="th")
    assert s.name == "paged_decode_bf16_e4m3_hs128_bs16_tok_th_g8_sm90"
    assert s.name_expression == ("cupaged::paged_decode<cupaged::bfloat16_t, "
                                 "cupaged::fp8_e4m3_t, 128, 16, 0, 1, 8, 64, 2, 0>")
    assert jit.KernelSpec("paged_decode", "f16", 128, 16, 8, cache_dtype="f16") == \
        jit.KernelSpec("paged_decode", "f16", 128, 16, 8)
    assert jit.KernelSpec("paged_decode", "f16", 256, 16, 1, cache_dtype="e5m2").tile_tokens == 64
    with pytest.raises(ValueError, match="needs an fp8 cache_dtype"):
        jit.KernelSpec("paged_decode", "f16", 128, 16, 8, kv_scale="th")
    with pytest.raises(ValueError, match="cache_dtype must be"):
        jit.KernelSpec("paged_decode", "f16", 128, 16, 8, cache_dtype="bf16")
    with pytest.raises(ValueError, match="takes no cache_dtype"):
        jit.KernelSpec("copy_blocks", index_dtype="i32", cache_dtype="e4m3")


@pytest.mark.parametrize("kw, match", [
    (dict(kernel="nope"), "unknown kernel"),
    (dict(dtype="f64"), "unknown dtype"),
    (dict(arch="90"), "arch must look like"),
])
def test_spec_rejects_bad_fields(kw, match):
    args = dict(kernel="paged_decode", dtype="f16", head_size=64, block_size=16, group_tile=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        jit.KernelSpec(**args)


def test_source_inlines_project_headers_once():
    text = jit.source("paged_decode.cu")
    assert '#include "' not in text
    assert text.count("struct DecodeGeometry {") == 1
    assert text.count("__device__ __forceinline__ float warp_max") == 1


def test_editing_a_header_changes_the_key_and_rebuilds(cache, sources):
    first = jit.build(SPEC)
    assert not first.from_disk and first.path.name.startswith(SPEC.name + "-")
    jit.clear_memory_caches()
    assert jit.build(SPEC).from_disk  # unchanged sources: the disk cache answers
    key = jit.cache_key(SPEC)
    time.sleep(0.01)
    with open(sources / "common.cuh", "a") as f:
        f.write("\n// an edit\n")
    assert jit.cache_key(SPEC) != key
    jit.clear_memory_caches()
    again = jit.build(SPEC)
    assert not again.from_disk and again.path != first.path


def test_key_covers_arch_options_and_nvrtc_version(monkeypatch):
    key = jit.cache_key(SPEC)
    assert jit.cache_key(SPEC.with_arch("sm_80")) != key
    assert jit.cache_key(jit.KernelSpec("paged_decode", "f16", 64, 16, 8)) != key
    monkeypatch.setattr(jit, "nvrtc_version", lambda: (99, 9))
    assert jit.cache_key(SPEC) != key
    monkeypatch.setattr(jit, "CXX_STD", "-std=c++20")
    assert "-std=c++20" in jit._options("sm_90")


def test_key_covers_the_nvrtc_build(monkeypatch):
    """NVRTC's getVersion names major.minor only: two patch releases (13.0.48, 13.0.88)
    report the same pair and may generate different code, so the key takes the build the
    compiler's own PTX header names."""
    build = jit.nvrtc_build()
    major, minor = jit.nvrtc_version()
    assert f"release {major}.{minor}, V{major}.{minor}." in build, build
    assert "Build ID" in build, build
    key = jit.cache_key(SPEC)
    monkeypatch.setattr(jit, "nvrtc_build", lambda: build.replace("Build ID", "Build ID 2"))
    assert jit.cache_key(SPEC) != key


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a"])
def test_cached_cubins_are_whole_elf_files(cache, arch):
    """The cubin in the cache is the whole ELF its headers describe (CuPy's getCUBIN drops
    NVRTC's last byte), so nvdisasm and cuobjdump read cache entries as they are."""
    spec = SPEC if arch == "sm_90" else jit.KernelSpec(
        "mla_attention_sm90", "bf16", 512, 16, rope_dim=64, cache_dtype="bf16")
    built = jit.build(spec)
    data = built.path.read_bytes()
    assert len(data) == jit.elf_end(data) == len(jit.binary(spec))


def test_cache_entries_have_a_plain_files_permissions(cache):
    """Entries are readable as any file the process makes (the umask's mode, not the
    temporary file's 0600): a cache shared by several users works."""
    import os
    import stat

    mask = os.umask(0)
    os.umask(mask)
    built = jit.build(SPEC)
    for p in (built.path, built.path.with_suffix(".json")):
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask, p


def test_a_crashed_writers_temporary_files_are_swept(cache):
    """A writer killed between its temporary file and the rename leaves ``*.tmp`` behind:
    the next write into the folder removes those an hour old or more, and leaves younger
    ones (another process may be writing them now)."""
    import os
    import time

    cache.mkdir(parents=True, exist_ok=True)
    stale = cache / "paged_decode-0123.cubinabc123.tmp"
    fresh = cache / "paged_decode-4567.cubindef456.tmp"
    stale_meta = cache / "paged_decode-0123.jsonghi789.tmp"
    # not the cache's writers' names: left alone, however old
    others = (cache / "notes.txt", cache / "notes.tmp")
    for p in (stale, fresh, stale_meta, *others):
        p.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    for p in (stale, stale_meta, *others):
        os.utime(p, (old, old))
    jit.build(SPEC)
    assert not stale.exists() and not stale_meta.exists()
    assert fresh.exists() and all(p.exists() for p in others)


def test_corrupt_cache_entry_is_rebuilt(cache):
    built = jit.build(SPEC)
    built.path.with_suffix(".json").write_text("{not json")
    jit.clear_memory_caches()
    assert not jit.build(SPEC).from_disk


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped byte"])
def test_damaged_binary_is_rebuilt_not_loaded(cache, damage):
    """A cubin that no longer matches the size and digest its JSON recorded is compiled
    again (a zero-byte cubin beside valid JSON used to load as a cache hit)."""
    built = jit.build(SPEC)
    good = built.path.read_bytes()
    bad = {"empty": b"", "truncated": good[: len(good) // 2],
           "flipped byte": good[:100] + bytes([good[100] ^ 1]) + good[101:]}[damage]
    built.path.write_bytes(bad)
    jit.clear_memory_caches()
    again = jit.build(SPEC)
    assert not again.from_disk
    # (NVRTC output differs by a few bytes between compiles, so compare with the entry.)
    assert len(jit.binary(SPEC)) > 1000
    jit.clear_memory_caches()
    assert jit.build(SPEC).from_disk  # the entry was repaired on disk


def test_an_entry_other_processes_keep_rewriting_is_still_loaded(cache, monkeypatch):
    """Processes starting together each compile a new specialization and publish their own
    build (NVRTC's output differs between processes in its internal names): the entry may
    change again and again between this process's build and its read. What is loaded is
    a verified binary with its own lowered name, never an error."""
    built = jit.build(SPEC)
    good = built.path.read_bytes()
    real_build = jit.build
    writes = [0]

    def build_then_rewritten(spec):  # another process's valid entry after each build
        got = real_build(spec)
        writes[0] += 1
        other = good + bytes(writes[0])  # (a valid entry: its JSON vouches for it)
        jit._write_entry(spec, *jit._cache_paths(spec), other, got.lowered_name)
        return got

    monkeypatch.setattr(jit, "build", build_then_rewritten)
    assert jit.binary(SPEC).startswith(good)
    jit.clear_memory_caches()
    data, lowered = jit.verified(SPEC)
    assert data.startswith(good) and lowered == built.lowered_name


def test_every_include_is_inlined_or_refused(tmp_path, monkeypatch):
    """The hashed source must hold every file it depends on: an include with a comment
    after it is inlined, one the inliner does not take (angle brackets) is refused by
    name, never left for NVRTC to find relative to the working directory."""
    (tmp_path / "paged_decode.cuh").write_text("int decode_marker;\n")
    (tmp_path / "a.cu").write_text('#include "paged_decode.cuh"  // the header\nint a;\n')
    (tmp_path / "b.cu").write_text("#include <paged_decode.cuh>\nint b;\n")
    monkeypatch.setattr(jit, "source_dir", lambda: tmp_path)
    assert "decode_marker" in jit.source("a.cu")
    with pytest.raises(jit.CompileError, match="b.cu: an include the kernel cache cannot "
                                               "follow: #include <paged_decode.cuh>"):
        jit.source("b.cu")


def test_unwritable_cache_dir_falls_back_to_memory(tmp_path, monkeypatch):
    """A cache folder that cannot be created (read-only HOME in a container) costs one
    warning; kernels still compile and are kept in memory."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(blocker / "cache"))
    jit.clear_memory_caches()
    monkeypatch.setattr(jit, "_warned_unwritable", set(), raising=False)
    try:
        with pytest.warns(RuntimeWarning, match="cannot write its kernel cache"):
            first = jit.build(SPEC)
        assert first.path is None and not first.from_disk and len(first.binary) > 1000
        assert jit.binary(SPEC) is first.binary
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning per folder, not per kernel
            other = jit.build(SPEC.with_arch("sm_80"))
        assert other.path is None and jit.build(SPEC) is first
    finally:
        jit.clear_memory_caches()


def test_binaries_are_reread_and_verified_not_kept(cache):
    """A process holds digests, not every binary it built; a binary damaged after its
    build is rebuilt when it is next needed, never loaded."""
    built = jit.build(SPEC)
    assert built.binary is None and len(built.sha256) == 64
    good = jit.binary(SPEC)
    built.path.write_bytes(good[:100])  # damaged after the build
    again = jit.binary(SPEC)
    assert len(again) > 1000 and jit.build(SPEC) is not built
    assert hashlib.sha256(again).hexdigest() == jit.build(SPEC).sha256


def test_concurrent_builds_compile_once(cache, monkeypatch):
    calls = []
    real = jit._compile

    def counting(*args):
        calls.append(args)
        time.sleep(0.2)
        return real(*args)

    monkeypatch.setattr(jit, "_compile", counting)
    results = []
    threads = [threading.Thread(target=lambda: results.append(jit.build(SPEC))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({r.path for r in results}) == 1 and len(results) == 8


def test_precompile_builds_each_spec(cache):
    specs = [SPEC, SPEC.with_arch("sm_80"), SPEC]
    built = jit.precompile(specs)
    assert [b.spec for b in built] == [SPEC, SPEC.with_arch("sm_80")]
    assert all(b.path.is_file() for b in built)


def test_refill_builds_what_another_caches_entries_name(cache, tmp_path, monkeypatch):
    """jit.refill compiles, from the current sources, the specializations another cache's
    JSON entries name, under the names and keys jit.build looks for: a process using the
    refilled cache finds them built; unknown kernels and other options are skipped."""
    import json

    specs = [SPEC, jit.KernelSpec("paged_decode_combine", "f16", 64, arch="sm_90")]
    jit.precompile(specs)
    metas = [json.loads(p.read_text()) for p in sorted(cache.glob("*.json"))]
    assert sorted(m["name"] for m in metas) == sorted(s.name for s in specs)
    other = tmp_path / "other"
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(other))
    jit.clear_memory_caches()
    # (a name that is not a plain file name would put the entry outside the cache)
    strange = [dict(metas[0], name="no_such_kernel_f16_sm90"),
               dict(metas[0], options=[*metas[0]["options"], "-lineinfo"]),
               dict(metas[0], name=metas[0]["name"] + "/../../escaped")]
    assert sorted(jit.refill(metas + strange, workers=2)) == sorted(s.name for s in specs)
    assert sorted(p.name for p in other.iterdir()) == sorted(p.name for p in cache.iterdir())
    assert not list(tmp_path.glob("escaped*"))
    assert all(jit.build(s).from_disk for s in specs)
    assert jit.refill(metas) == []  # already there
    assert jit.kernel_of("paged_prefill_sm90_bf16_x") == "paged_prefill_sm90"
    assert jit.kernel_of("paged_prefill_bf16_x") == "paged_prefill"


def test_compile_error_names_the_specialization(cache, sources):
    (sources / "paged_decode.cuh").write_text(
        (sources / "paged_decode.cuh").read_text().replace("kDecodeThreads = 128;", "kDecodeThreads = ;"))
    with pytest.raises(jit.CompileError, match=SPEC.name):
        jit.build(SPEC)


@pytest.mark.skipif(not jit.check_options(), reason="this NVRTC has no --Ofast-compile")
def test_the_fast_compile_check_still_runs_ptxas(sources):
    """compile_check's --Ofast-compile=max skips optimizations, not checks: PTX that an
    architecture lacks (fp8 pair conversions need sm_89) still fails, as a build does."""
    (sources / "probe.cu").write_text(
        "namespace cupaged {\n"
        "template <int N> __global__ void probe(unsigned short* o, float a, float b) {\n"
        "  unsigned short r;\n"
        "  asm(\"cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\" : \"=h\"(r) : \"f\"(a), \"f\"(b));\n"
        "  *o = r + N;\n"
        "}\n"
        "}  // namespace cupaged\n")
    for extra in ((), jit.check_options()):
        jit._compile("probe.cu", "sm_90", ["cupaged::probe<1>"], "probe", extra)
        with pytest.raises(jit.CompileError, match="requires .target sm_89"):
            jit._compile("probe.cu", "sm_80", ["cupaged::probe<1>"], "probe", extra)


def test_ptx_forms_compile_ptx_for_the_virtual_architecture(monkeypatch):
    seen = []

    def fake(entry, arch, exprs, label, extra):
        seen.append((arch, len(exprs), extra))
        return b"", {e: "k" for e in exprs}

    monkeypatch.setattr(jit, "_compile", fake)
    sm90a = jit.KernelSpec("paged_prefill_sm90", "bf16", 128, 16)
    other = jit.KernelSpec("paged_decode", "f16", 64, 16, 4, arch="sm_80")
    forms, _ = jit.ptx_forms([SPEC, sm90a, other])
    assert sorted(seen) == sorted([(a, 1, jit.check_options())
                                   for a in ("compute_90", "compute_90a", "compute_80")])
    assert forms == {s: frozenset() for s in (SPEC, sm90a, other)}


def test_ptx_forms_still_stop_at_a_static_assert():
    spec = jit.KernelSpec("paged_decode", "f16", 64, 16, 3)  # GROUP_TILE 3
    with pytest.raises(jit.CompileError, match="GROUP_TILE"):
        jit.ptx_forms([spec])


def test_asm_forms_follow_calls_and_blank_registers_and_addresses():
    ptx = ("//\n.func  (.param .b32 func_retval0) helper(\n)\n{\n"
           "\t// begin inline asm\n\tcvt.rn.f16x2.e4m3x2 %r1, %rs2;\n\t// end inline asm\n}\n"
           ".visible .entry kern(\n)\n{\n\t// begin inline asm\n"
           "\tbar.sync %r3, 256;\n\tcp.async.cg.shared.global [%r4+16], [%rd5], 16;\n"
           "\t// end inline asm\n\tcall.uni (retval0), helper, (param0);\n\tret;\n}\n"
           ".visible .entry other(\n)\n{\n\tret;\n}\n")
    assert jit.asm_forms(ptx, ["kern", "other"]) == {
        "kern": {"bar.sync %, 256", "cp.async.cg.shared.global [], [], 16",
                 "cvt.rn.f16x2.e4m3x2 %, %"},
        "other": frozenset()}


def test_the_covering_check_assembles_every_inline_ptx_form_on_its_target(sources, monkeypatch):
    """sm_89's fp8 conversion planted in a branch only some head sizes take (decode's
    fp8 tensor-core path with an odd count of 16-dim chunks: 80, not 64) fails the check
    on sm_80, though most of the set is compiled to PTX only: a cubin of some spec runs
    each inline-PTX form on each target."""
    from cupaged.specs import catalog

    specs = [jit.KernelSpec("paged_decode", "f16", hs, 16, 4, cache_dtype="e4m3", arch=a)
             for hs in (64, 80) for a in ("sm_80", "sm_90")]
    monkeypatch.setattr(catalog, "covering_specs", lambda archs: specs)
    argv = ["compile", "--arch", "sm_80", "--arch", "sm_90", "--covering"]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0 and "4 specializations" in r.output, r.output
    path = sources / "paged_decode.cuh"
    marker = "constexpr int kk = HS / 16 - 1;"
    planted = (' { unsigned short t; asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" '
               ': "=h"(t) : "f"(0.f), "f"(1.f)); }')
    path.write_text(path.read_text().replace(marker, marker + planted, 1))
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 1 and "requires .target sm_89" in r.output, r.output
    assert "hs80" in r.output and "sm_80" in r.output


def test_compile_check_passes_the_fast_options(monkeypatch):
    seen = []
    monkeypatch.setattr(jit, "_compile", lambda *job: seen.append(job[4]))
    jit.compile_check([SPEC])
    jit.compile_check([SPEC], fast=False)
    assert seen == [jit.check_options(), ()]


def test_compile_optimized_compiles_without_them(monkeypatch):
    """--covering: every spec to PTX, cubins of those ptx_forms' cover picks; --optimized:
    cubins of all, at full optimization."""
    from cupaged.specs import catalog

    seen = []
    monkeypatch.setattr(jit, "compile_check", lambda specs, fast=True:
                        (seen.append(("cubins", fast, list(specs))), (len(specs), 0.0))[1])
    monkeypatch.setattr(jit, "ptx_forms", lambda specs: (
        seen.append(("ptx", list(specs))) or {s: frozenset({"form"}) for s in specs}, 0.0))
    archs = ["--arch", "sm_80", "--arch", "sm_90"]  # (the catalogs the other tests build)
    cover = catalog.covering_specs(["sm_80", "sm_90"])
    r = CliRunner().invoke(main, ["compile", *archs, "--covering"])
    assert r.exit_code == 0, r.output
    # one form on each target: the first spec of each target assembles it
    firsts = [next(s for s in cover if s.arch == a) for a in ("sm_80", "sm_90", "sm_90a")]
    assert seen == [("ptx", cover), ("cubins", True, sorted(firsts, key=cover.index))]
    assert f"{len(cover)} specializations" in r.output and "3 through ptxas" in r.output
    seen.clear()
    r = CliRunner().invoke(main, ["compile", *archs, "--covering", "--optimized"])
    assert r.exit_code == 0, r.output
    assert seen == [("cubins", False, cover)]
    r = CliRunner().invoke(main, ["compile", "--arch", "sm_90", "--optimized"])
    assert r.exit_code != 0 and "--optimized goes with --all or --covering" in r.output


def test_target_for_devices():
    assert jit.target_for((9, 0)) == "sm_90"
    newest = max(jit.supported_archs())
    assert jit.target_for((99, 0)) == f"compute_{newest}"


def test_wheel_ships_the_cuda_sources(tmp_path):
    root = Path(__file__).resolve().parents[1]
    site = tmp_path / "site"
    # A non-editable install: pip builds the wheel and installs it, sources and all.
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(root)], check=True)
    probe = ("import cupaged.jit as j; print(j.source_dir()); "
             "print(len(j.source('paged_decode.cu')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, check=True, text=True,
                         capture_output=True, env={"PYTHONPATH": str(site), "PATH": ""}).stdout
    where, length = out.split()
    assert Path(where) == site / "cupaged" / "cuda_src" and int(length) > 10000


def test_compile_covering_set_for_sm80_and_sm90(compile_summary):
    """The CI compile check: a pairwise covering set of every kernel's specializations for
    both targets (every value and pair of values of the axes; `cupaged-bench compile --all`
    compiles all of them). The geometry of the rest is checked in test_geometry.py."""
    from cupaged.specs import catalog

    n = len(catalog.covering_specs(["sm_80", "sm_90"]))
    full = len(catalog.all_specs(["sm_80", "sm_90"]))
    result = CliRunner().invoke(main, ["compile", "--arch", "sm_80", "--arch", "sm_90", "--covering"])
    assert result.exit_code == 0, result.output
    m = re.search(f"compiled {n} specializations \\(a pairwise covering set of the {full} "
                  f"supported, (\\d+) through ptxas\\) for sm_80, sm_90", result.output)
    assert m and 3 <= int(m.group(1)) < n, result.output  # sm_80, sm_90 and sm_90a at least
    compile_summary.append(result.output.strip())


# Structs the kernels take by value, as ARG_FORMATS spells them.
STRUCT_FORMATS = {"CopyTable": f"{cache_ops._COPY_TABLE.size}s",
                  "MlaSparseExtra": f"{launch.SPARSE_EXTRA.size}s",
                  "MlaTma": f"{launch.MLA_TMA.size}s",
                  "PagedKV": jit.PAGED_KV_FORMAT,
                  "VariantParams": f"{_variants._STRUCT.size}s"}


def _mangled_params(lowered: str) -> str:
    """The parameter kinds of an Itanium-mangled kernel symbol as a struct format (P
    pointer, q 8-byte int, i 4-byte int, f float). Covers what cupaged's kernels use."""
    rest = lowered[lowered.index("EEv") + 3:]
    scalars = {"x": "q", "y": "q", "l": "q", "m": "q", "i": "i", "j": "i", "f": "f"}

    def nested(i):  # N <substitutions and length-prefixed names> E: (its last name, end)
        j, name = i + 1, None
        while rest[j] != "E":
            if rest[j] == "S":
                j = rest.index("_", j) + 1
            else:
                k = re.match(r"\d+", rest[j:]).end() + j
                name, j = rest[k:k + int(rest[j:k])], k + int(rest[j:k])
        return name, j + 1

    def skip_type(i):
        if rest[i] in "ST":  # substitution or template parameter: up to '_'
            return rest.index("_", i) + 1
        if rest[i] == "N":  # nested name
            return nested(i)[1]
        return i + 1  # builtin

    out, i = [], 0
    while i < len(rest):
        c = rest[i]
        if c == "N":  # a struct by value: its format from its name
            name, i = nested(i)
            out.append(STRUCT_FORMATS[name])
        elif c == "P":
            i += 1
            while rest[i] in "KV":
                i += 1
            i = skip_type(i)
            out.append("P")
        elif c == "S":  # a repeated type: in these kernels only pointers are repeated
            i = rest.index("_", i) + 1
            out.append("P")
        else:
            out.append(scalars[c])
            i += 1
    return "".join(out)


@pytest.mark.parametrize("spec", [
    jit.KernelSpec("paged_decode", "bf16", 128, 16, 4),
    jit.KernelSpec("paged_prefill", "f16", 96, 16),
    jit.KernelSpec("paged_prefill_sm90", "bf16", 128, 16),
    jit.KernelSpec("paged_decode_combine", "f32", 64),
    jit.KernelSpec("reshape_and_cache", "f16", index_dtype="i64"),
    jit.KernelSpec("copy_blocks", index_dtype="i32"),
    jit.KernelSpec("concat_and_cache_mla", "bf16", cache_dtype="e4m3", index_dtype="i64"),
    jit.KernelSpec("concat_and_cache_mla", "f16", cache_dtype="dsmla", index_dtype="i32"),
    jit.KernelSpec("concat_and_cache_mla", "bf16", cache_dtype="v4fp8", index_dtype="i64"),
    jit.KernelSpec("concat_and_cache_mla", "f16", cache_dtype="v4fp4", index_dtype="i32"),
    jit.KernelSpec("mla_attention", "bf16", 512, 64, cache_dtype="e4m3"),
    jit.KernelSpec("mla_attention_sm90", "f16", 512, 16),
    # the sparse kernels, each with its second cache (variant "x") and without: one format
    jit.KernelSpec("mla_sparse_attention", "bf16", 512, 64, cache_dtype="dsmla", variant="x"),
    jit.KernelSpec("mla_sparse_attention_sm90", "bf16", 512, 64, cache_dtype="v4fp8"),
    jit.KernelSpec("mla_sparse_attention_sm90", "bf16", 512, 16, cache_dtype="dsmla",
                   variant="x"),
], ids=lambda s: s.name)
def test_launch_formats_match_the_kernel_signatures(spec):
    _, lowered = jit._compile(spec.source_file, spec.arch, [spec.name_expression], spec.name)
    assert _mangled_params(lowered[spec.name_expression]) == jit.ARG_FORMATS[spec.kernel]


def test_every_kernel_has_a_launch_format():
    assert set(jit.ARG_FORMATS) == set(jit._KERNELS)


@pytest.mark.parametrize("entry, check", [
    ("cache_ops.cu",
     f"static_assert(sizeof(cupaged::CopyTable) == {cache_ops._COPY_TABLE.size}, \"size\");\n"
     f"static_assert(cupaged::kMaxCopyTensors == {cache_ops._COPY_TENSORS}, \"count\");\n"),
    ("paged_decode.cu",
     f"static_assert(sizeof(cupaged::VariantParams) == {_variants._STRUCT.size}, \"size\");\n"
     f"static_assert(sizeof(cupaged::PagedKV) == {launch._PAGED_KV.size}, \"size\");\n"),
    ("mla_attention_sm90.cu",
     f"static_assert(sizeof(cupaged::MlaTma) == {launch.MLA_TMA.size}, \"size\");\n"
     f"static_assert(alignof(cupaged::MlaTma) == 64, \"alignment\");\n"),
], ids=["CopyTable", "VariantParams", "MlaTma"])
def test_by_value_structs_have_the_size_the_host_packs(entry, check):
    """Structs travel in the launch parameters: the host packs exactly their bytes."""
    nvrtc = jit.nvrtc()
    prog = nvrtc.createProgram(jit.source(entry) + check, "sizes.cu", [], [])
    arch = "-arch=sm_90a" if entry == "mla_attention_sm90.cu" else "-arch=compute_80"
    try:
        try:
            nvrtc.compileProgram(prog, [jit.CXX_STD, arch])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def test_clear_memory_caches_empties_the_launcher_caches():
    """Modules keep launchers in jit.launcher_cache lookups: clearing the memory caches
    must empty those too, or a changed option (CUPAGED_FP8_SOFTWARE) would not take."""
    from cupaged import cache_ops, planning

    calls = []

    @jit.launcher_cache
    def lookup(x):
        calls.append(x)
        return object()

    first = lookup(1)
    assert lookup(1) is first and calls == [1]
    jit.clear_memory_caches()
    assert lookup(1) is not first and calls == [1, 1]
    for cached in (planning.decode_kernels, planning.prefill_kernel, planning.prefill_sm90_kernel,
                   cache_ops._kernel):
        assert cached in jit._launcher_caches
    jit._launcher_caches.remove(lookup)


def test_a_kernel_without_layouts_refuses_kv_format_by_name():
    """The merge kernel reads no cache: a kv_format is refused as such, not as a value
    outside 'tok' / 'vllm' (which it may well be)."""
    with pytest.raises(ValueError, match="paged_decode_combine takes no kv_format"):
        jit.KernelSpec("paged_decode_combine", "f16", 128, kv_format="vllm")
    with pytest.raises(ValueError, match="kv_format must be 'tok' or 'vllm'"):
        jit.KernelSpec("paged_prefill_sm90", "f16", 128, 16, kv_format="HND")
