"""Hopper's wgmma operands (cuda_src/sm90.cuh): the 128-byte-swizzled shared layouts, their
matrix descriptors and the accumulator and register fragments, checked by one wgmma of a
probe kernel (cuda_src/sm90_probe.cu) against NumPy; its bulk copies and the mbarrier
phases that count them; and that the header builds for sm_90a through NVRTC and refuses
plain sm_90."""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import _dtypes, jit

PROBES = [  # (kernel, dtype, N, B MN-major, A from registers)
    ("probe_bf16_n64_k_ss", "bf16", 64, False, False),
    ("probe_bf16_n64_mn_ss", "bf16", 64, True, False),
    ("probe_bf16_n128_k_ss", "bf16", 128, False, False),
    ("probe_bf16_n128_mn_ss", "bf16", 128, True, False),
    ("probe_bf16_n128_mn_rs", "bf16", 128, True, True),
    ("probe_f16_n64_k_ss", "f16", 64, False, False),
    ("probe_f16_n64_mn_rs", "f16", 64, True, True),
    ("probe_bf16_n256_mn_rs", "bf16", 256, True, True),
    ("probe_bf16_n256_mn_ss", "bf16", 256, True, False),
    ("probe_f16_n256_k_ss", "f16", 256, False, False),
]


def _compile(arch: str) -> bytes:
    rtc = jit.nvrtc()
    prog = rtc.createProgram(jit.source("sm90_probe.cu"), "sm90_probe.cu", [], [])
    try:
        rtc.compileProgram(prog, [jit.CXX_STD, f"-arch={arch}"])
        return rtc.getCUBIN(prog)
    except rtc.NVRTCError:
        raise jit.CompileError(rtc.getProgramLog(prog)) from None
    finally:
        rtc.destroyProgram(prog)


def test_sm90_header_builds_for_sm90a_only():
    assert len(_compile("sm_90a")) > 0
    with pytest.raises(jit.CompileError, match="sm90.cuh needs sm_90a"):
        _compile("sm_90")


def _hopper():
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU (compute capability 9.0)")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, dt, n, mn_major, a_regs", PROBES, ids=[p[0] for p in PROBES])
def test_one_wgmma_matches_numpy(rng, kernel, dt, n, mn_major, a_regs):
    cupy = _hopper()
    module = cupy.cuda.function.Module()
    module.load(_compile("sm_90a"))
    npdt = _dtypes.BY_NAME[dt].numpy
    a = rng.standard_normal((64, 16)).astype(npdt)
    b_kn = rng.standard_normal((16, n)).astype(npdt)  # B as the product takes it: [K][N]
    b = b_kn if mn_major else np.ascontiguousarray(b_kn.T)  # K-major: [N][K]
    want = a.astype(np.float64) @ b_kn.astype(np.float64)
    def run(lbo, sbo):  # the probe with these descriptor offsets (0, 0: sm90.cuh's own)
        d = cupy.full((64, n), np.nan, np.float32)
        args = (cupy.asarray(a.view(np.uint16)), cupy.asarray(b.view(np.uint16)), d,
                np.uint32(lbo), np.uint32(sbo))
        module.get_function(kernel)((1,), (128,), args)
        return cupy.asnumpy(d).astype(np.float64)

    got = run(0, 0)
    # Products of 16-bit values are exact in fp32; 16 of them summed: a few ulps of fp32.
    try:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    except AssertionError:
        if not mn_major:
            raise
        # Which leading / stride byte offsets of the MN-major B descriptor would be right:
        # every pair of a small grid whose product matches NumPy.
        grid = [16, 128, 1024, 2048, 4096]
        working = [(lo, so) for lo in grid for so in grid
                   if np.allclose(run(lo, so), want, rtol=1e-5, atol=1e-5)]
        raise AssertionError(f"{kernel}: sm90.cuh's MN-major descriptor offsets are wrong; "
                             f"(lbo, sbo) pairs that work: {working or 'none of the grid'}")


@pytest.mark.gpu
@pytest.mark.parametrize("runs, size", [(1, 8192), (4, 2048), (6, 1024), (8, 16)])
def test_bulk_copies_land_and_complete_their_phases(rng, runs, size):
    """Runs of bytes from 16-byte aligned places, each announced and issued by one elected
    lane, over two phases of one mbarrier: every byte lands, each phase completes once
    all its runs did (try_wait sees it, and not the next one)."""
    cupy = _hopper()
    module = cupy.cuda.function.Module()
    module.load(_compile("sm_90a"))
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    offsets = rng.integers(0, ((1 << 16) - size) // 16, 2 * runs).astype(np.int32) * 16
    out = cupy.zeros(2 * runs * size, np.uint8)
    flags = cupy.full(4, -1, np.int32)
    module.get_function("probe_bulk_copy")(
        (1,), (128,), (cupy.asarray(src), cupy.asarray(offsets), np.int32(runs),
                       np.int32(size), out, flags))
    want = np.concatenate([src[o:o + size] for o in offsets])
    np.testing.assert_array_equal(cupy.asnumpy(out), want)
    assert cupy.asnumpy(flags).tolist() == [1, 0, 1, 0]
