#!/usr/bin/env python3
"""Resource use of one specialization: nvcc compiles cuda_src/paged_decode.cu on its own
with -Xptxas -v (registers, spills, stack) and optionally dumps SASS.

    python3 tools/ptxas_report.py --dtype f16 --head-size 128 --block-size 16 --group-tile 4
    python3 tools/ptxas_report.py ... --sass   # also print the disassembly
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupaged import _dtypes, jit  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--group-tile", type=int, default=4)
    ap.add_argument("--tile-tokens", type=int, default=0)
    ap.add_argument("--stages", type=int, default=0)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--sass", action="store_true")
    a = ap.parse_args()
    spec = jit.KernelSpec("paged_decode", _dtypes.parse(a.dtype).name, a.head_size, a.block_size,
                          a.group_tile, tile_tokens=a.tile_tokens, stages=a.stages, arch=a.arch)
    defines = {"CUPAGED_T": _dtypes.BY_NAME[spec.dtype].cxx, "CUPAGED_HS": spec.head_size,
               "CUPAGED_BS": spec.block_size, "CUPAGED_GT": spec.group_tile,
               "CUPAGED_TILE": spec.tile_tokens, "CUPAGED_STAGES": spec.stages}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cmd = ["nvcc", f"-arch={a.arch}", "-cubin", "-std=c++17", "-Xptxas", "-v",
               "-DCUPAGED_INSTANTIATE", *(f"-D{k}={v}" for k, v in defines.items()),
               str(jit.source_dir() / "paged_decode.cu"), "-o", str(cubin)]
        print(spec.name)
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(r.stderr, end="")
        if r.returncode:
            sys.exit(r.returncode)
        if a.sass:
            tool = shutil.which("cuobjdump") or shutil.which(
                os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"))
            if tool is None:
                sys.exit("--sass needs cuobjdump (CUDA toolkit); it is not on PATH or in $CUDA_HOME/bin")
            r = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True)
            print(r.stdout, r.stderr, sep="", end="")
            if r.returncode:
                sys.exit(r.returncode)


if __name__ == "__main__":
    main()
