#!/usr/bin/env python3
"""Reports on compiled kernels and on Nsight Compute's per-instruction samples.

    python3 tools/kernel_report.py spec KERNEL [FIELD=VALUE ...] [--tree DIR] [--sass] [--mix N]
        One specialization (cupaged.jit.KernelSpec's fields, e.g. paged_decode dtype=f16
        head_size=128 block_size=16 group_tile=4, or paged_prefill dtype=bf16 head_size=128
        block_size=16 warps=8 m_atoms=1 tile_tokens=32 stages=2 variant=c), compiled as the
        library compiles it (NVRTC, into the kernel cache): its resource use (registers,
        stack, shared and local memory, spills), with --mix N its N most frequent SASS
        opcodes and the instruction count, with --sass the disassembly. --tree: the
        library of another checkout (its cupaged/ and cuda_src/, e.g. the code before a
        change). Resources come from cuobjdump -res-usage on the cubin, or, without
        cuobjdump, from ptxas -v on the specialization's PTX (not for the sm_90a-only
        kernels); SASS needs cuobjdump (the CUDA toolkit).
    python3 tools/kernel_report.py cubins [GLOB] [--mix N] [--count OPCODES]
        The same for the cubins already in the kernel cache ($CUPAGED_CACHE_DIR) whose
        names match GLOB (default '*'), e.g. '*prefill_sm90*' --count HGMMA,LDL,STL: how
        many of those instructions each holds.
    python3 tools/kernel_report.py source CSV [--top N]
        Where a kernel's warps spend their time, from Nsight Compute's warp samples per
        SASS instruction (tools/device.sh profile --set source writes the CSV): the
        samples of each stretch of SASS between setmaxnreg instructions (a
        warp-specialized kernel's roles) and their stall reasons, then the N instructions
        with the most samples.
    python3 tools/kernel_report.py refill FOLDER [--workers N]
        Compile into the kernel cache ($CUPAGED_CACHE_DIR), from this checkout's sources,
        the specializations another cache's entries name (FOLDER: that cache, or a listing
        of its JSON entries): a GPU machine's cache rebuilt ahead on this one, for
        `tools/device.sh cache-pack`'s pieces (.kcache/) to carry.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)")


# ---- compiled kernels ---------------------------------------------------------------------


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name))


def _run(cmd) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{r.stdout}{r.stderr}")
    return r.stdout + r.stderr


def opcode_mix(sass: str) -> Counter:
    """Opcode -> count over a cuobjdump -sass listing (predicates stripped)."""
    return Counter(m.group(1) for m in map(_SASS_LINE.match, sass.splitlines()) if m)


def parse_spec(kernel: str, fields: list, jit):
    """A KernelSpec from 'name=value' strings (ints where the field's default is one)."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(jit.KernelSpec)}
    kw = {}
    for item in fields:
        name, sep, value = item.partition("=")
        if not sep or name not in defaults or name in ("kernel", "_params"):
            known = ", ".join(n for n in defaults if n not in ("kernel", "_params"))
            raise SystemExit(f"expected FIELD=VALUE with FIELD one of {known}; got {item!r}")
        kw[name] = int(value) if isinstance(defaults[name], int) else value
    return jit.KernelSpec(kernel, **kw)


def _report_cubin(path: Path, mix: int, count: list, sass: bool, out=print) -> None:
    tool = _tool("cuobjdump")
    if tool is None:
        raise SystemExit("cuobjdump (the CUDA toolkit) is not on PATH or in $CUDA_HOME/bin")
    res = [ln.strip() for ln in _run([tool, "-res-usage", str(path)]).splitlines()
           if "REG:" in ln]
    out("  " + ("\n  ".join(res) if res else "no resource line"))
    if not (mix or count or sass):
        return
    listing = _run([tool, "-sass", str(path)])
    ops = opcode_mix(listing)
    if mix:
        out(f"  {sum(ops.values())} instructions; " + " ".join(
            f"{n} {op}" for op, n in ops.most_common(mix)))
    if count:
        out("  " + ", ".join(f"{sum(n for op, n in ops.items() if op.startswith(c))} {c}"
                             for c in count))
    if sass:
        out(listing)


def spec_report(kernel: str, fields: list, mix: int, sass: bool, tree: str | None) -> None:
    sys.path.insert(0, str(Path(tree).resolve() if tree else ROOT))
    from cupaged import jit

    spec = parse_spec(kernel, fields, jit)
    print(spec.name)
    if _tool("cuobjdump") is None and not (mix or sass) and spec.kernel not in jit.ARCH_ONLY:
        # No cuobjdump: ptxas -v over the PTX NVRTC makes for the same target.
        import dataclasses

        target = spec.arch
        ptx = jit.build(dataclasses.replace(spec, arch=target.replace("sm_", "compute_")))
        ptxas = _tool("ptxas")
        if ptxas is None or ptx.path is None:
            raise SystemExit("needs cuobjdump, or ptxas and a writable kernel cache")
        with tempfile.TemporaryDirectory() as tmp:
            print(_run([ptxas, "-v", f"-arch={target}", str(ptx.path), "-o",
                        str(Path(tmp) / "k.cubin")]), end="")
        return
    built = jit.build(spec)
    if built.path is None:
        raise SystemExit("the kernel cache is not writable: set CUPAGED_CACHE_DIR")
    _report_cubin(built.path, mix, [], sass)


def cubins_report(pattern: str, mix: int, count: list) -> None:
    sys.path.insert(0, str(ROOT))
    from cupaged import jit

    paths = sorted(p for p in jit.cache_dir().glob("*.cubin") if fnmatch.fnmatch(p.name, pattern))
    if not paths:
        print(f"no cubin matching {pattern!r} in {jit.cache_dir()}")
    for p in paths:
        print(p.name)
        _report_cubin(p, mix, count, False)


# ---- Nsight Compute source counters ---------------------------------------------------------


def read_source_csv(path: str):
    """(column names, one dict per SASS instruction with its 'samples'), from ncu's
    --page source --csv --print-source sass export."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"])
    names = rows[head]
    out = []
    for r in rows[head + 1:]:
        if len(r) != len(names):
            continue
        d = dict(zip(names, r))
        d["samples"] = int(d["Warp Stall Sampling (All Samples)"] or 0)
        out.append(d)
    return names, out


def stalls(d: dict, names) -> Counter:
    c = Counter()
    for n in names:
        if n.startswith("stall_") and "(Not Issued)" not in n:
            c[n[6:]] += int(d[n] or 0)
    return c


def source_summary(path: str, top: int = 30, out=print) -> None:
    names, ins = read_source_csv(path)
    total = sum(d["samples"] for d in ins) or 1
    # stretches: a new one at each setmaxnreg (USETMAXREG)
    parts, cur = [], {"from": ins[0]["Source"].strip() if ins else "", "samples": 0,
                      "stalls": Counter(), "n": 0}
    for d in ins:
        if "USETMAXREG" in d["Source"]:
            parts.append(cur)
            cur = {"from": d["Source"].strip(), "samples": 0, "stalls": Counter(), "n": 0}
        cur["samples"] += d["samples"]
        cur["stalls"] += stalls(d, names)
        cur["n"] += 1
    parts.append(cur)
    out(f"{total} samples, {len(ins)} instructions")
    for p in parts:
        reasons = ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in p["stalls"].most_common(6))
        out(f"- from '{p['from'][:40]}': {p['n']} instructions, "
            f"{100 * p['samples'] / total:.1f}% of samples ({reasons})")
    out(f"top {top} instructions:")
    for d in sorted(ins, key=lambda d: -d["samples"])[:top]:
        reasons = ", ".join(f"{k} {v}" for k, v in stalls(d, names).most_common(3) if v)
        out(f"  {d['Address'][-5:]} {100 * d['samples'] / total:5.2f}%  "
            f"{d['Source'].strip()[:60]:60s} {reasons}")


def refill(folder: str, workers: int | None) -> None:
    import json

    sys.path.insert(0, str(ROOT))
    from cupaged import jit

    metas = []
    for p in sorted(Path(folder).glob("*.json")):
        try:
            metas.append(json.loads(p.read_text()))
        except ValueError:
            print(f"skipped {p.name}: not a cache entry", file=sys.stderr)
    made = jit.refill(metas, workers)
    print(f"{len(made)} of {len(metas)} entries compiled into {jit.cache_dir()} "
          f"(the rest there already, or not this checkout's)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("spec", help="one specialization, compiled as the library compiles it")
    s.add_argument("kernel")
    s.add_argument("fields", nargs="*", metavar="FIELD=VALUE")
    s.add_argument("--tree", default=None, help="another checkout's cupaged/ and cuda_src/")
    s.add_argument("--mix", type=int, default=0, metavar="N", help="the N most frequent opcodes")
    s.add_argument("--sass", action="store_true", help="the disassembly")
    c = sub.add_parser("cubins", help="the kernel cache's cubins")
    c.add_argument("glob", nargs="?", default="*")
    c.add_argument("--mix", type=int, default=0, metavar="N")
    c.add_argument("--count", default="", metavar="OPCODES",
                   help="comma-separated opcode prefixes to count, e.g. HGMMA,LDL,STL")
    r = sub.add_parser("source", help="ncu's per-instruction warp samples (CSV)")
    r.add_argument("csv")
    r.add_argument("--top", type=int, default=30)
    f = sub.add_parser("refill", help="another cache's specializations, built here")
    f.add_argument("folder")
    # (One compile at a time unless asked: two threads' NVRTC calls failed to load
    # libnvrtc-builtins on the 2-core CPU machine.)
    f.add_argument("--workers", type=int, default=1)
    a = ap.parse_args(argv)
    if a.cmd == "spec":
        spec_report(a.kernel, a.fields, a.mix, a.sass, a.tree)
    elif a.cmd == "cubins":
        cubins_report(a.glob, a.mix, [x for x in a.count.split(",") if x])
    elif a.cmd == "refill":
        refill(a.folder, a.workers)
    else:
        source_summary(a.csv, a.top)


if __name__ == "__main__":
    main()
