"""Host mirrors of the kernels' compile-time geometry.

Every constant a launch depends on (shared memory, which path a specialization takes) and
every ``static_assert`` of ``DecodeGeometry`` in ``cuda_src/paged_decode.cuh`` is computed
here too, so that the host can size launches without a compiler and a test can check every
supported specialization against the constraints without compiling any of them.
``tests/test_geometry.py`` has NVRTC compare these numbers with the C++ ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _dtypes

DECODE_THREADS = 128  # kDecodeThreads
WARPS = DECODE_THREADS // 32

# Opt-in dynamic shared memory per block, by compute capability (CUDA's tables).
MAX_SMEM_BY_ARCH = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024,
                    90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


@dataclass(frozen=True)
class DecodeGeometry:
    """``DecodeGeometry<T, HEAD_SIZE, BLOCK_SIZE, KV_FORMAT, GROUP_TILE, TILE_TOKENS,
    STAGES>``."""

    itemsize: int
    head_size: int
    block_size: int
    group_tile: int
    tile_tokens: int
    stages: int
    kv_format: str = "vllm"

    @classmethod
    def of(cls, spec) -> "DecodeGeometry":
        """The geometry of a ``paged_decode`` :class:`~cupaged.jit.KernelSpec`."""
        return cls(_dtypes.BY_NAME[spec.dtype].itemsize, spec.head_size, spec.block_size,
                   spec.group_tile, spec.tile_tokens, spec.stages, spec.kv_format)

    @property
    def token_major(self) -> bool:  # kTokenMajor: K and V copied [token][dim]
        return self.kv_format == "tok"

    @property
    def vec(self) -> int:  # kVec: elements per 16 bytes, the key layout's "x"
        return 16 // self.itemsize

    @property
    def sub(self) -> int:  # kSub: tokens per copied piece
        return min(self.block_size, self.tile_tokens)

    @property
    def pieces(self) -> int:  # kPieces: block-table entries per tile
        return self.tile_tokens // self.sub

    @property
    def v_transposed(self) -> bool:  # kVTransposed
        return self.kv_format == "vllm" and self.sub >= self.vec

    @property
    def mma(self) -> bool:  # kMma: tensor cores for Q K^T and P V
        return (self.itemsize == 2 and self.group_tile >= 4 and self.head_size % 16 == 0
                and (self.v_transposed or self.token_major))

    @property
    def smem_bytes(self) -> int:  # kSmemBytes
        it, tt, hs, gt = self.itemsize, self.tile_tokens, self.head_size, self.group_tile
        if self.token_major:
            k_stage = v_stage = tt * (hs + self.vec) * it
        else:
            k_stage, v_stage = tt * hs * it, hs * (tt + self.vec) * it
        q_bytes = 0 if self.mma else gt * hs * 4
        red_bytes = _round_up(gt * 4, 16) if self.mma else DECODE_THREADS * gt * 4
        return (self.stages * (k_stage + v_stage) + q_bytes + tt * gt * 4 + red_bytes
                + WARPS * gt * 4 + 16 + _round_up(2 * self.pieces * 4, 16))

    def violations(self) -> list[str]:
        """The ``static_assert``s this geometry would fail, by their messages."""
        hs, bs, gt, tt, it = self.head_size, self.block_size, self.group_tile, \
            self.tile_tokens, self.itemsize
        bad = []
        if not (hs % 8 == 0 and 32 <= hs <= 256):
            bad.append("HEAD_SIZE")
        if bs & (bs - 1) or not 1 <= bs <= 256:
            bad.append("BLOCK_SIZE")
        if tt & (tt - 1) or not 32 <= tt <= 256:
            bad.append("TILE_TOKENS")
        if gt not in (1, 2, 4, 8):
            bad.append("GROUP_TILE")
        if self.stages < 2:
            bad.append("STAGES")
        if (tt // WARPS) % self.vec:
            bad.append("P @ V walks whole 16-byte vectors")
        k_stage = tt * (hs + self.vec if self.token_major else hs) * it
        if WARPS * gt * hs * 4 > self.stages * k_stage:
            bad.append("reduction space")
        if self.mma and gt * (tt + self.vec) * 2 > tt * gt * 4:
            bad.append("P space")
        return bad

    def fits(self, arch: str) -> bool:
        """Does the dynamic shared memory fit one block on this target (``sm_90``)?"""
        cc = int(arch.split("_")[1].rstrip("a"))
        limit = MAX_SMEM_BY_ARCH.get(cc, min(MAX_SMEM_BY_ARCH.values()))
        return self.smem_bytes <= limit


@dataclass(frozen=True)
class PrefillGeometry:
    """``PrefillGeometry<T, HEAD_SIZE, BLOCK_SIZE, KV_FORMAT, WARPS, M_ATOMS, TILE_N,
    STAGES>`` of ``cuda_src/paged_prefill.cuh``."""

    itemsize: int
    head_size: int
    block_size: int
    kv_format: str
    warps: int
    m_atoms: int
    tile_tokens: int
    stages: int

    @classmethod
    def of(cls, spec) -> "PrefillGeometry":
        return cls(_dtypes.BY_NAME[spec.dtype].itemsize, spec.head_size, spec.block_size,
                   spec.kv_format, spec.warps, spec.m_atoms, spec.tile_tokens, spec.stages)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def rows(self) -> int:  # kRows: packed query rows per CTA
        return 16 * self.m_atoms * self.warps

    @property
    def smem_bytes(self) -> int:  # kSmemBytes
        hsp = _round_up(self.head_size, 16)
        row = hsp + 8
        q = self.rows * row * 2
        k_stage = self.tile_tokens * row * 2
        v_stage = hsp * (self.tile_tokens + 8) * 2 if self.kv_format == "vllm" else k_stage
        ids = max(1, self.tile_tokens // self.block_size)  # block ids per tile, per stage
        return q + self.stages * (k_stage + v_stage) + _round_up(self.stages * ids * 4, 16) + 16

    def violations(self) -> list[str]:
        hs, bs = self.head_size, self.block_size
        bad = []
        if self.itemsize != 2:
            bad.append("tensor cores take 16-bit operands")
        if not (hs % 8 == 0 and 32 <= hs <= 256):
            bad.append("HEAD_SIZE")
        if bs & (bs - 1) or not 1 <= bs <= 256:
            bad.append("BLOCK_SIZE")
        if self.kv_format == "vllm" and bs < 8:
            bad.append("vLLM's value layout is copied in runs of 8 tokens of one block")
        if self.tile_tokens not in (16, 32, 64, 128):
            bad.append("TILE_N")
        if not (1 <= self.warps <= 8 and self.m_atoms in (1, 2)):
            bad.append("WARPS, M_ATOMS")
        if self.stages < 2:
            bad.append("STAGES")
        return bad

    def fits(self, arch: str) -> bool:
        cc = int(arch.split("_")[1].rstrip("a"))
        return self.smem_bytes <= MAX_SMEM_BY_ARCH.get(cc, min(MAX_SMEM_BY_ARCH.values()))


def check_against_kernel(specs, chunk: int = 300) -> None:
    """Have NVRTC compare the mirrors with ``DecodeGeometry`` and ``PrefillGeometry`` in
    the kernel sources for each ``paged_decode`` / ``paged_prefill`` spec: one
    ``static_assert`` per spec over the shared memory (and for decode the path and the
    piece count). No kernel is instantiated, so a few hundred take a second (in
    programs of ``chunk``: NVRTC slows down more than linearly with thousands in one).
    Raises AssertionError with NVRTC's log naming the specializations that differ."""
    from concurrent.futures import ThreadPoolExecutor

    specs = list(specs)
    parts = []
    for kernel in ("paged_decode", "paged_prefill"):
        mine = [s for s in specs if s.kernel == kernel]
        parts += [mine[i:i + chunk] for i in range(0, len(mine), chunk)]
    with ThreadPoolExecutor() as pool:
        list(pool.map(_check_chunk, parts))


def _check_chunk(specs) -> None:
    from . import jit

    lines = []
    for s in specs:
        t = _dtypes.BY_NAME[s.dtype].cxx
        fmt = jit.KV_FORMATS[s.kv_format]
        if s.kernel == "paged_prefill":
            g = PrefillGeometry.of(s)
            cxx = (f"cupaged::PrefillGeometry<{t}, {s.head_size}, {s.block_size}, {fmt}, "
                   f"{s.warps}, {s.m_atoms}, {s.tile_tokens}, {s.stages}>")
            lines.append(f"static_assert({cxx}::kSmemBytes == {g.smem_bytes} && "
                         f"{cxx}::kRows == {g.rows}, \"host mirror differs: {s.name}\");\n")
            continue
        g = DecodeGeometry.of(s)
        cxx = (f"cupaged::DecodeGeometry<{t}, {s.head_size}, {s.block_size}, {fmt}, "
               f"{s.group_tile}, {s.tile_tokens}, {s.stages}>")
        lines.append(f"static_assert({cxx}::kSmemBytes == {g.smem_bytes} && "
                     f"{cxx}::kMma == {str(g.mma).lower()} && "
                     f"{cxx}::kVTransposed == {str(g.v_transposed).lower()} && "
                     f"{cxx}::kPieces == {g.pieces}, \"host mirror differs: {s.name}\");\n")
    nvrtc = jit._nvrtc()
    prog = nvrtc.createProgram(jit.source(specs[0].source_file) + "".join(lines), "mirror.cu",
                               [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [jit.CXX_STD, "-arch=compute_80"])
        except nvrtc.NVRTCError:
            raise AssertionError(nvrtc.getProgramLog(prog)) from None
    finally:
        nvrtc.destroyProgram(prog)
