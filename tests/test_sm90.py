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


PROBES8 = [  # (kernel, 8-bit type, N, A from registers)
    ("probe_e4m3_n64_ss", "float8_e4m3fn", 64, False),
    ("probe_e4m3_n128_rs", "float8_e4m3fn", 128, True),
    ("probe_e4m3_n256_ss", "float8_e4m3fn", 256, False),
    ("probe_e5m2_n64_rs", "float8_e5m2", 64, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, fmt, n, a_regs", PROBES8, ids=[p[0] for p in PROBES8])
def test_one_8bit_wgmma_matches_numpy(rng, kernel, fmt, n, a_regs):
    """An e4m3 / e5m2 k32 wgmma, both operands K-major in the 128-byte-swizzled layout
    (sw128_offset8, kmajor_desc): A from shared memory, or from registers as
    fp8_a_fragment packs an fp32 accumulator's 32 columns (each rounded to nearest even,
    as ml_dtypes rounds) with B's rows in fp8_k_column's order. Against NumPy in float64:
    each product of two 8-bit values is exact, and wgmma sums its 32 with about 13 bits
    kept below the largest one's exponent (DeepSeek-V3's report of Hopper's 8-bit sums):
    within 32 x 2^-13 of the largest product and 2^-12 of the magnitudes' sum. A wrong
    layout or order is off by whole products."""
    import ml_dtypes

    cupy = _hopper()
    module = cupy.cuda.function.Module()
    module.load(_compile("sm_90a"))
    f8 = getattr(ml_dtypes, fmt)
    a_f32 = (2.0 * rng.standard_normal((64, 32))).astype(np.float32)
    a_f32[0, :4] = [1e6, -1e6, 0.0, 2.0 ** -9]  # saturated both ways, zero, a subnormal
    top = float(ml_dtypes.finfo(f8).max)  # cvt.rn.satfinite saturates; ml_dtypes would not
    a8 = np.clip(a_f32, -top, top).astype(f8)
    b8 = rng.standard_normal((n, 32)).astype(f8)  # [N][K]: K-major B
    want = a8.astype(np.float64) @ b8.astype(np.float64).T
    d = cupy.full((64, n), np.nan, np.float32)
    module.get_function(kernel)((1,), (128,), (
        cupy.asarray(a8.view(np.uint8)), cupy.asarray(a_f32), cupy.asarray(b8.view(np.uint8)), d))
    got = cupy.asnumpy(d).astype(np.float64)
    terms = np.abs(a8.astype(np.float64))[:, None, :] * np.abs(b8.astype(np.float64))[None]
    bound = 2.0 ** -12 * terms.sum(-1) + 32 * 2.0 ** -13 * terms.max(-1) + 1e-6
    assert (np.abs(got - want) <= bound).all(), float(np.max(np.abs(got - want) / bound))


def fp8_k_column(p: int) -> int:
    """sm90.cuh's fp8_k_column: the column of P (the token) at k position p."""
    return (p & ~15) + 2 * ((p >> 2) & 3) + (p & 1) + (8 if p & 2 else 0)


def sw128_offset8(row: int, col: int, rows: int) -> int:
    """sm90.cuh's sw128_offset8: byte `col` of `row` in a 128-byte-swizzled tile."""
    c16 = col >> 1
    chunk = ((c16 & 63) >> 3) ^ (row & 7)
    return (c16 >> 6) * rows * 128 + row * 128 + (chunk << 4) + (c16 & 7) * 2 + (col & 1)


def test_fp8_k_order_gives_each_thread_its_own_columns():
    """The k order fp8_a_fragment packs P in, as sm90.cuh states it: position 16h + 4t + i
    holds column 16h + 2t + i (i < 2) or 16h + 8 + 2t + i - 2, so the four positions of
    quad thread t are the columns it holds in the accumulator (2t, 2t + 1, 8 + 2t, 9 + 2t
    of each 16), and each 16 columns are a permutation of themselves."""
    for p in range(256):
        h, t, i = p // 16, (p % 16) // 4, p % 4
        assert fp8_k_column(p) == 16 * h + (2 * t + i if i < 2 else 8 + 2 * t + i - 2)
    for h in range(16):
        assert sorted(fp8_k_column(p) for p in range(16 * h, 16 * h + 16)) == \
            list(range(16 * h, 16 * h + 16))


TRANSPOSES = [("probe_transpose_h128_n128", 128, 128, 128),
              ("probe_transpose_h64_n256", 64, 256, 128),
              ("probe_transpose_h256_n128", 256, 128, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, hs, tile_n, threads", TRANSPOSES, ids=[t[0] for t in TRANSPOSES])
def test_fp8_transpose_v_places_every_byte(rng, kernel, hs, tile_n, threads):
    """fp8_transpose_v: a dense token-major tile [tile_n][hs] of bytes becomes the K-major
    V^T tile, byte (dim n, position p) at sw128_offset8(n, p, hs) holding token
    fp8_k_column(p)'s dim n, each of the tile's bytes compared."""
    cupy = _hopper()
    module = cupy.cuda.function.Module()
    module.load(_compile("sm_90a"))
    src = rng.integers(0, 256, (tile_n, hs), dtype=np.uint8)
    want = np.empty(tile_n * hs, np.uint8)
    rows, cols = np.meshgrid(np.arange(hs), np.arange(tile_n), indexing="ij")
    offs = np.vectorize(lambda n, p: sw128_offset8(n, p, hs))(rows, cols)
    assert len(np.unique(offs)) == tile_n * hs  # the layout is a bijection onto the tile
    tokens = np.vectorize(fp8_k_column)(cols)
    want[offs] = src[tokens, rows]
    out = cupy.full(tile_n * hs, 0xEE, np.uint8)
    func = module.get_function(kernel)
    smem = 2 * tile_n * hs
    jit.driver.funcSetAttribute(
        func.ptr, jit.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
    func((1,), (threads,), (cupy.asarray(src), out), shared_mem=smem)
    np.testing.assert_array_equal(cupy.asnumpy(out), want)


ATTENTIONS = [("probe_fp8_attention_h128", 128, 2), ("probe_fp8_attention_h64", 64, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, hs, tiles", ATTENTIONS, ids=[a[0] for a in ATTENTIONS])
def test_fp8_attention_over_tiles_matches_its_emulation(rng, kernel, hs, tiles):
    """The fp8 chain of one warpgroup over tiles of 128 keys (probe_fp8_attention): e4m3
    S = Q K^T, the online softmax with weights offset by 2^8, P rounded to e4m3 in
    fp8_a_fragment's order, V transposed to match, e4m3 P V. S as the kernel summed it
    within the 8-bit sums' bound of exact (test_one_8bit_wgmma_matches_numpy's, over
    head_size / 32 steps); then, from that S, a float64 emulation that rounds the same
    weights to e4m3: O within 5e-3 of each row's norm (P V's 8-bit sums), m and l within
    1e-5; and O against exact attention over the same fp8 inputs within 2^-4 of each
    row's norm (the largest relative rounding of an e4m3 weight). Row 1's largest key is
    in the last tile, so its running maximum moves and O is rescaled."""
    import ml_dtypes

    cupy = _hopper()
    module = cupy.cuda.function.Module()
    module.load(_compile("sm_90a"))
    f8 = ml_dtypes.float8_e4m3fn
    n = 128 * tiles
    q = rng.standard_normal((64, hs)).astype(f8)
    k = rng.standard_normal((n, hs)).astype(f8)
    v = rng.standard_normal((n, hs)).astype(f8)
    k[n - 1] = (2 * q[1].astype(np.float32)).astype(f8)
    scale_log2, v_scale = float(np.log2(np.e) / np.sqrt(hs)), 0.75
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    o_got = cupy.full((64, hs), np.nan, np.float32)
    m_got = cupy.full(64, np.nan, np.float32)
    l_got = cupy.full(64, np.nan, np.float32)
    s_got = cupy.full((tiles, 64, 128), np.nan, np.float32)
    func = module.get_function(kernel)
    row_bytes = -(-hs // 128) * 128
    smem = (64 + 128) * row_bytes + 2 * 128 * hs + 1024
    jit.driver.funcSetAttribute(
        func.ptr, jit.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
    func((1,), (128,), (cupy.asarray(q.view(np.uint8)), cupy.asarray(k.view(np.uint8)),
                        cupy.asarray(v.view(np.uint8)), np.float32(scale_log2),
                        np.float32(v_scale), o_got, m_got, l_got, s_got), shared_mem=smem)
    exact_s = q64 @ k64.T
    s = np.concatenate(list(cupy.asnumpy(s_got).astype(np.float64)), axis=1)  # [64][n]
    terms = np.abs(q64)[:, None, :] * np.abs(k64)[None]
    s_bound = 2.0 ** -12 * terms.sum(-1) + hs * 2.0 ** -13 * terms.max(-1) + 1e-6
    assert (np.abs(s - exact_s) <= s_bound).all(), float(np.max(np.abs(s - exact_s) / s_bound))
    sl = float(np.float32(scale_log2))
    m = np.full(64, -np.inf)
    l, o = np.zeros(64), np.zeros((64, hs))
    for t in range(tiles):
        st = s[:, 128 * t:128 * (t + 1)]
        m_new = np.maximum(m, st.max(1) * sl)
        alpha = np.exp2(m - m_new)
        p = np.exp2(st * sl - (m_new - 8)[:, None])
        l = l * alpha + p.sum(1)
        p8 = p.astype(np.float32).astype(f8).astype(np.float64)
        o = o * alpha[:, None] + p8 @ v64[128 * t:128 * (t + 1)]
        m = m_new
    emulated = o / l[:, None] * v_scale
    w = np.exp(exact_s / np.sqrt(hs) - (exact_s / np.sqrt(hs)).max(1, keepdims=True))
    exact = w / w.sum(1, keepdims=True) @ v64 * v_scale
    got = cupy.asnumpy(o_got).astype(np.float64)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(cupy.asnumpy(m_got), m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cupy.asnumpy(l_got), l, rtol=1e-5)
    norm = np.linalg.norm(exact, axis=1)
    to_emulated = np.linalg.norm(got - emulated, axis=1) / norm
    to_exact = np.linalg.norm(got - exact, axis=1) / norm
    assert to_emulated.max() <= 5e-3, (int(to_emulated.argmax()), float(to_emulated.max()))
    assert to_exact.max() <= 2.0 ** -4, (int(to_exact.argmax()), float(to_exact.max()))


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
