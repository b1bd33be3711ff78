"""cupaged.testing's device arrays against unmapped memory (guarded): where they lie, the
driver structs they are made with, and, on a GPU, that an access across the guarded edge
faults while every access inside works."""

import ctypes
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cupaged import testing


def test_the_driver_structs_have_cuda_h_layout():
    """Sizes and offsets of CUmemAllocationProp and CUmemAccessDesc as cuda.h (CUDA 13)
    lays them out, read with a C compiler's sizeof / offsetof: the driver reads them as
    such."""
    prop, access = testing.CUmemAllocationProp, testing.CUmemAccessDesc
    assert ctypes.sizeof(prop) == 32 and ctypes.sizeof(access) == 12
    assert prop.location.offset == 8 and prop.win32HandleMetaData.offset == 16
    assert prop.allocFlags.offset == 24 and access.flags.offset == 8


@pytest.mark.parametrize("nbytes", [0, 1, 4, 12, 2 << 20, (2 << 20) + 4])
@pytest.mark.parametrize("align", [1, 4, 16])
def test_guard_layout(nbytes, align):
    gran = 2 << 20
    mapped, offset = testing.guard_layout(nbytes, gran, "before", align)
    assert offset == 0 and mapped % gran == 0 and mapped >= max(nbytes, 1)
    assert mapped - gran < max(nbytes, 1)  # no granule more than needed
    mapped, offset = testing.guard_layout(nbytes, gran, "after", align)
    assert offset % align == 0 and offset + nbytes <= mapped < offset + nbytes + align
    if nbytes % align == 0:
        assert offset + nbytes == mapped


def test_guard_layout_refuses_bad_arguments():
    with pytest.raises(ValueError, match="side"):
        testing.guard_layout(4, 1 << 21, "middle", 4)
    with pytest.raises(ValueError, match="multiple of align"):
        testing.guard_layout(4, 1 << 21, "after", 3)


# One process a case: a fault ends the CUDA context.
PROBE = textwrap.dedent("""
    import sys
    import cupy, numpy as np
    from cupaged import testing
    side, index = sys.argv[1], int(sys.argv[2])
    host = np.arange(1000, 1013, dtype=np.int32)  # 13 elements: 52 bytes, not a multiple of 16
    arr = testing.guarded(host[::1], side)
    assert (cupy.asnumpy(arr) == host).all()
    read = cupy.RawKernel(r'''
    extern "C" __global__ void read(const int* a, long long i, int* out) { *out = a[i]; }
    ''', "read")
    out = cupy.zeros(1, cupy.int32)
    read((1,), (1,), (arr, np.int64(index), out))
    try:
        cupy.cuda.runtime.deviceSynchronize()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        print("FAULT", e)
        sys.exit(3)
    print("READ", int(out[0]))
""")


@pytest.mark.gpu
@pytest.mark.parametrize("side,index,faults", [
    ("before", 0, False), ("before", 12, False), ("before", -1, True),
    ("after", 0, False), ("after", 12, False), ("after", 13, True),
])
def test_an_access_across_the_guarded_edge_faults(side, index, faults):
    run = subprocess.run([sys.executable, "-c", PROBE, side, str(index)], capture_output=True,
                         text=True, timeout=120)
    if faults:
        assert run.returncode == 3 and "FAULT" in run.stdout, run.stdout + run.stderr
    else:
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.split()[-1] == str(1000 + index)


@pytest.mark.gpu
def test_a_guarded_copy_of_a_strided_view():
    import cupy

    rng = np.random.default_rng(0)
    host = rng.standard_normal((6, 10)).astype(np.float32)[:, ::3]
    for side in ("before", "after"):
        arr = testing.guarded(cupy.asarray(host), side)
        assert arr.flags.c_contiguous and (cupy.asnumpy(arr) == host).all()
