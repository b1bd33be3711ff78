"""Host mirrors of the kernels' compile-time geometry.

Every constant a launch depends on (shared memory, which path a specialization takes) and
every ``static_assert`` of ``DecodeGeometry`` in ``cuda_src/paged_decode.cuh`` is computed
here too, so that the host can size launches without a compiler and a test can check every
supported specialization against the constraints without compiling any of them.
``tests/test_geometry.py`` has NVRTC compare these numbers with the C++ ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _dtypes

DECODE_THREADS = 128  # kDecodeThreads
CACHE_THREADS = 128  # kCacheThreads (cuda_src/cache_ops.cuh): the cache kernels' CTA
WARPS = DECODE_THREADS // 32

# Opt-in dynamic shared memory per block, by compute capability (CUDA's tables).
MAX_SMEM_BY_ARCH = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024,
                    90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
# Hopper's: what the wgmma kernels' static_asserts hold a CTA to
SM90_SMEM = MAX_SMEM_BY_ARCH[90]


# Shared memory of an SM (what resident CTAs share), as mla_attention.cuh's kSmSmem.
SM_SMEM_BY_ARCH = {80: 164 * 1024, 87: 164 * 1024, 90: 228 * 1024, 100: 228 * 1024}


def max_smem(arch: str) -> int:
    """Opt-in dynamic shared memory per block on a target (``sm_90``, ``sm_90a``,
    ``compute_80``): MAX_SMEM_BY_ARCH's, the smallest for one it does not list."""
    cc = int(arch.split("_")[1].rstrip("a"))
    return MAX_SMEM_BY_ARCH.get(cc, min(MAX_SMEM_BY_ARCH.values()))


def sm_smem(arch: str) -> int:
    """Shared memory of an SM on a target (SM_SMEM_BY_ARCH's; 100 KiB for others)."""
    cc = int(arch.split("_")[1].rstrip("a"))
    return SM_SMEM_BY_ARCH.get(cc, 100 * 1024)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _cache_itemsize(spec) -> int:
    return _dtypes.CACHE_BY_NAME[spec.cache_dtype or spec.dtype].itemsize


@dataclass(frozen=True)
class DecodeGeometry:
    """``DecodeGeometry<T, C, HEAD_SIZE, BLOCK_SIZE, KV_FORMAT, KV_SCALE, GROUP_TILE,
    TILE_TOKENS, STAGES>``: ``itemsize`` is T's (the query's), ``cache_itemsize`` C's
    (0: the same), ``token_scales`` KV_SCALE == kScaleTokenHead with an fp8 cache."""

    itemsize: int
    head_size: int
    block_size: int
    group_tile: int
    tile_tokens: int
    stages: int
    kv_format: str = "vllm"
    cache_itemsize: int = 0
    token_scales: bool = False

    @classmethod
    def of(cls, spec) -> "DecodeGeometry":
        """The geometry of a ``paged_decode`` :class:`~cupaged.jit.KernelSpec`."""
        return cls(_dtypes.BY_NAME[spec.dtype].itemsize, spec.head_size, spec.block_size,
                   spec.group_tile, spec.tile_tokens, spec.stages, spec.kv_format,
                   _cache_itemsize(spec), spec.kv_scale == "th")

    @property
    def cit(self) -> int:  # sizeof(C)
        return self.cache_itemsize or self.itemsize

    @property
    def quant(self) -> bool:  # kQuant: an fp8 cache
        return self.cit != self.itemsize

    @property
    def token_major(self) -> bool:  # kTokenMajor: K and V copied [token][dim]
        return self.kv_format == "tok"

    @property
    def vec(self) -> int:  # kVec: cache elements per 16 bytes, the key layout's "x"
        return 16 // self.cit

    @property
    def swizzle(self) -> bool:  # kSwizzle: unpadded token rows, chunks XOR-swizzled
        return self.token_major and self.mma and (self.head_size // self.vec) % 8 == 0

    @property
    def tok_row(self) -> int:  # kTokRow: unpadded when swizzled, else an odd number of chunks
        chunks = self.head_size // self.vec
        if self.swizzle:
            return self.head_size
        return self.head_size + self.vec * (1 if chunks % 2 == 0 else 2)

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
        return (self.itemsize == 2 and self.head_size % 16 == 0
                and (self.v_transposed or self.token_major))

    @property
    def smem_bytes(self) -> int:  # kSmemBytes
        it, tt, hs, gt = self.cit, self.tile_tokens, self.head_size, self.group_tile
        if self.token_major:
            k_stage = v_stage = tt * self.tok_row * it
        else:
            k_stage, v_stage = tt * hs * it, hs * (tt + self.vec) * it
        q_bytes = 0 if self.mma else gt * hs * 4
        red_bytes = _round_up(gt * 4, 16) if self.mma else DECODE_THREADS * gt * 4
        scales = 2 * self.stages * tt * 4 if self.quant and self.token_scales else 0
        return (self.stages * (k_stage + v_stage) + q_bytes + tt * gt * 4 + red_bytes
                + WARPS * gt * 4 + 16 + _round_up(2 * self.pieces * 4, 16) + scales)

    def violations(self) -> list[str]:
        """The ``static_assert``s this geometry would fail, by their messages."""
        hs, bs, gt, tt, it = self.head_size, self.block_size, self.group_tile, \
            self.tile_tokens, self.itemsize
        bad = []
        if not (hs % 8 == 0 and 32 <= hs <= 512):
            bad.append("HEAD_SIZE")
        if bs & (bs - 1) or not 1 <= bs <= 256:
            bad.append("BLOCK_SIZE")
        if tt & (tt - 1) or not 32 <= tt <= 256:
            bad.append("TILE_TOKENS")
        if gt not in (1, 2, 4, 8):
            bad.append("GROUP_TILE")
        if self.stages < 2:
            bad.append("STAGES")
        if self.quant and not (self.cit == 1 and it == 2 and hs % 16 == 0):
            bad.append("fp8 caches: 16-bit queries, head sizes that are multiples of 16")
        if not self.mma and (tt // WARPS) % self.vec:
            bad.append("P @ V walks whole 16-byte vectors")
        k_stage = tt * (self.tok_row if self.token_major else hs) * self.cit
        if WARPS * gt * hs * 4 > self.stages * k_stage:
            bad.append("reduction space")
        if self.mma and gt * (tt + 16 // it) * 2 > tt * gt * 4:
            bad.append("P space")
        return bad

    def fits(self, arch: str) -> bool:
        """Does the dynamic shared memory fit one block on this target (``sm_90``)?"""
        return self.smem_bytes <= max_smem(arch)

    def ctas_per_sm(self, arch: str) -> int:
        """CTAs an SM of this target holds by shared memory (1 KiB a block is the
        driver's)."""
        return sm_smem(arch) // (self.smem_bytes + 1024)


def prefill_dim_split(head_size: int) -> int:
    """PrefillGeometry's kDimSplit: 2 (a pair of warps shares each row) above 256 dims."""
    return 2 if _round_up(head_size, 16) > 256 else 1


def prefill_rows(head_size: int, warps: int, m_atoms: int, key_warps: int = 1) -> int:
    """PrefillGeometry's kRows: packed query rows of a paged_prefill CTA."""
    return 16 * m_atoms * warps // prefill_dim_split(head_size) // key_warps


@dataclass(frozen=True)
class PrefillGeometry:
    """``PrefillGeometry<T, C, HEAD_SIZE, BLOCK_SIZE, KV_FORMAT, KV_SCALE, WARPS, M_ATOMS,
    KEY_WARPS, TILE_N, STAGES>`` of ``cuda_src/paged_prefill.cuh`` (``cache_itemsize`` and
    ``token_scales`` as for :class:`DecodeGeometry`)."""

    itemsize: int
    head_size: int
    block_size: int
    kv_format: str
    warps: int
    m_atoms: int
    tile_tokens: int
    stages: int
    cache_itemsize: int = 0
    token_scales: bool = False
    key_warps: int = 1

    @classmethod
    def of(cls, spec) -> "PrefillGeometry":
        return cls(_dtypes.BY_NAME[spec.dtype].itemsize, spec.head_size, spec.block_size,
                   spec.kv_format, spec.warps, spec.m_atoms, spec.tile_tokens, spec.stages,
                   _cache_itemsize(spec), spec.kv_scale == "th", spec.key_warps)

    @property
    def quant(self) -> bool:  # kQuant: an fp8 cache
        return (self.cache_itemsize or self.itemsize) != self.itemsize

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def dim_split(self) -> int:  # kDimSplit: warps sharing a row's dims (heads over 256)
        return prefill_dim_split(self.head_size)

    @property
    def rows(self) -> int:  # kRows: packed query rows per CTA
        return prefill_rows(self.head_size, self.warps, self.m_atoms, self.key_warps)

    def _tiles(self) -> tuple[int, int]:
        """Bytes of one K stage plus one V stage, and of the widened tile (fp8)."""
        hsp = _round_up(self.head_size, 16)
        tt = self.tile_tokens
        row = hsp + 8
        vllm = self.kv_format == "vllm"
        k_wide = tt * row * 2
        v_wide = hsp * (tt + 8) * 2 if vllm else k_wide
        if self.quant:  # stages of cache bytes, rows padded by 16; one tile widened to T
            crow = self.head_size + 16
            return tt * crow + (hsp * (tt + 16) if vllm else tt * crow), k_wide + v_wide
        return k_wide + v_wide, 0

    @property
    def smem_stages(self) -> int:  # kOffWide - kOffK: the K and V stages
        return self.stages * self._tiles()[0]

    @property
    def smem_bytes(self) -> int:  # kSmemBytes
        tt = self.tile_tokens
        q = self.rows * (_round_up(self.head_size, 16) + 8) * 2
        ids = max(1, tt // self.block_size)  # block ids per tile, per stage
        scales = 2 * self.stages * tt * 4 if self.quant and self.token_scales else 0
        # the pairs' partial scores (kDimSplit 2): 4 floats per n8 tile and lane
        exchange = self.warps * self.m_atoms * (tt // 8) * 4 * 32 * 4 if self.dim_split > 1 else 0
        return (q + self.smem_stages + self._tiles()[1] + _round_up(self.stages * ids * 4, 16)
                + 16 + scales + exchange)

    def violations(self) -> list[str]:
        hs, bs = self.head_size, self.block_size
        bad = []
        if self.itemsize != 2:
            bad.append("tensor cores take 16-bit operands")
        if not (hs % 8 == 0 and 32 <= hs <= 512):
            bad.append("HEAD_SIZE")
        if bs & (bs - 1) or not 1 <= bs <= 256:
            bad.append("BLOCK_SIZE")
        if self.kv_format == "vllm" and bs < (16 if self.quant else 8):
            bad.append("vLLM's value layout is copied in runs of 16 bytes of one block")
        if self.quant and hs % 16:
            bad.append("fp8 caches: head sizes that are multiples of 16")
        if self.tile_tokens not in (16, 32, 64, 128):
            bad.append("TILE_N")
        if not (1 <= self.warps <= 8 and self.m_atoms in (1, 2)):
            bad.append("WARPS, M_ATOMS")
        if self.warps % self.dim_split:
            bad.append("heads over 256 dims take warps in pairs")
        kw = self.key_warps
        if kw < 1:
            bad.append("KEY_WARPS")
        elif kw > 1:
            rows = self.warps // kw
            state = (kw - 1) * rows * self.m_atoms * (4 + _round_up(self.head_size, 16) // 2) * 128
            if (self.dim_split > 1 or self.warps % kw or self.tile_tokens % (16 * kw)
                    or state > self.smem_stages):
                bad.append("KEY_WARPS")
        if self.stages < 2:
            bad.append("STAGES")
        return bad

    def fits(self, arch: str) -> bool:
        return self.smem_bytes <= max_smem(arch)


def sm90_prefill_rows(head_size: int) -> int:
    """Packed query rows a paged_prefill_sm90 CTA takes (``kRows``): two consumers' 64
    each, or over 256 dims the same 64 for both (each takes half the dims)."""
    return 64 if head_size > 256 else 128


@dataclass(frozen=True)
class Sm90PrefillGeometry:
    """``Sm90PrefillGeometry<T, C, HEAD_SIZE, BLOCK_SIZE, TILE_N, STAGES, Q>`` of
    ``cuda_src/paged_prefill_sm90.cuh`` (``cache_itemsize`` as for
    :class:`DecodeGeometry`; ``fp8_query``: Q is an 8-bit query's type, the cache's)."""

    itemsize: int
    head_size: int
    block_size: int
    tile_tokens: int
    stages: int
    cache_itemsize: int = 0
    fp8_query: bool = False

    @classmethod
    def of(cls, spec) -> "Sm90PrefillGeometry":
        return cls(_dtypes.BY_NAME[spec.dtype].itemsize, spec.head_size, spec.block_size,
                   spec.tile_tokens, spec.stages, _cache_itemsize(spec),
                   bool(spec.query_dtype))

    @property
    def quant(self) -> bool:  # kQuant: an fp8 cache, widened by the producer
        return (self.cache_itemsize or self.itemsize) != self.itemsize

    threads = 384  # kThreads: a producer and two consumer warpgroups

    @property
    def split_o(self) -> bool:  # kSplitO: both consumers on the same rows, half the dims each
        return self.head_size > 256

    @property
    def rows(self) -> int:  # kRows: packed query rows per CTA
        return sm90_prefill_rows(self.head_size)

    @property
    def raw_stages(self) -> int:  # kRawStages: an fp8 cache's raw stages
        return 2 if self.quant else 0

    @property
    def row_bytes(self) -> int:  # kRowBytes: a Q or K tile's row (8-bit: whole 128-byte blocks)
        return -(-self.head_size // 128) * 128 if self.fp8_query else self.head_size * 2

    @property
    def smem_bytes(self) -> int:  # kSmemBytes: Q, K/V stages, raw fp8 stages, barriers, flags
        tile = self.tile_tokens * self.row_bytes
        raw = self.raw_stages * 2 * self.tile_tokens * self.head_size
        # mbarriers: full and empty a stage, q_full and q_empty a consumer, raw_full and
        # raw_free a raw stage (kBars)
        bars = 2 * self.stages + 4 + 2 * self.raw_stages
        # kSplitO: the partial scores, two tiles' of each consumer's 128 threads
        partials = 2 * 2 * self.tile_tokens // 2 * 128 * 4 if self.split_o else 0
        # kQBytes: both consumers' Q tiles of 64 rows (kSplitO: half the row each)
        q = 2 * 64 * (self.row_bytes // 2 if self.split_o else self.row_bytes)
        return (q + 2 * self.stages * tile + partials + raw
                + 8 * bars + 16 * self.stages + 1024)

    def violations(self) -> list[str]:
        hs, bs = self.head_size, self.block_size
        bad = []
        if self.itemsize != 2:
            bad.append("16-bit outputs (and tensor-core operands, but 8-bit ones)")
        if self.quant and self.cache_itemsize != 1:
            bad.append("caches of T or fp8")
        if self.fp8_query and not (self.quant and self.tile_tokens == 128 and hs <= 128
                                   and self.stages >= 3):
            bad.append("an 8-bit query over a cache of its format, in tiles of 128 keys, "
                       "head sizes 64 and 128, three stages or more")
        if not (hs % 64 == 0 and 64 <= hs and (hs <= 256 or (hs % 128 == 0 and hs <= 512))):
            bad.append("HEAD_SIZE")
        if self.split_o and (self.quant or self.fp8_query):
            bad.append("head sizes over 256: caches of the query's 16-bit type")
        if bs & (bs - 1) or not 1 <= bs <= 256:
            bad.append("BLOCK_SIZE")
        if self.tile_tokens not in ((32,) if self.split_o else (64, 128)):
            bad.append("TILE_N: wgmma's N of S (32 over 256 dims)")
        if not 2 <= self.stages <= 4:
            bad.append("STAGES")
        return bad

    def fits(self, arch: str) -> bool:
        return self.smem_bytes <= max_smem(arch)


MLA_THREADS = 256  # kMlaThreads: eight warps


@dataclass(frozen=True)
class MlaGeometry:
    """``MlaGeometry<T, RANK, ROPE, ROWS, TILE_N, STAGES>`` of ``cuda_src/mla_attention.cuh``
    (``rank`` is the spec's head_size, the latent width)."""

    rank: int
    rope: int
    rows: int
    tile_tokens: int
    stages: int
    cache_itemsize: int = 2  # sizeof(C): 2, or 1 for an fp8 cache (widened in a tile of its own)
    token_bytes: int = 0  # a cached token's bytes: 0 (rank + rope) * cache_itemsize, or a
    #                       token row's: 656 for DeepSeek-V3.2's fp8_ds_mla (spec cache_dtype
    #                       "dsmla"), 528 and 288 for V4's ("v4fp8", "v4fp4"; rope 0)

    @classmethod
    def of(cls, spec) -> "MlaGeometry":
        rows = _dtypes.SPARSE_BY_CACHE.get(spec.cache_dtype)
        return cls(spec.head_size, spec.rope_dim, spec.rows, spec.tile_tokens, spec.stages,
                   _cache_itemsize(spec), 0 if rows is None else rows.nbytes)

    threads = MLA_THREADS

    @property
    def k_split(self) -> int:  # kKSplit: warps sharing one block (up to 32 x 32) of S
        blocks = self.rows // min(self.rows, 32) * (self.tile_tokens // min(self.tile_tokens, 32))
        return 1 if blocks >= 8 else 8 // blocks

    @property
    def smem_bytes(self) -> int:  # kSmemBytes: Q, the stages, S partials, P, row state
        row = (self.rank + self.rope + 8) * 2
        stage_row = (self.token_bytes or (self.rank + self.rope) * self.cache_itemsize) + 16
        wide = self.tile_tokens * row if self.cache_itemsize == 1 else 0
        return (self.rows * row + self.stages * self.tile_tokens * stage_row + wide
                + self.k_split * self.rows * (self.tile_tokens + 4) * 4
                + self.rows * (self.tile_tokens + 8) * 2 + 3 * self.rows * 4 + 16
                + self.stages * self.tile_tokens)  # the sparse kernel's key flags

    def violations(self) -> list[str]:
        bad = []
        if self.rank % 128 or self.rope % 16:
            bad.append("RANK, ROPE")
        if self.rows not in (16, 32, 64):
            bad.append("ROWS")
        if self.tile_tokens not in (16, 32, 64):
            bad.append("TILE_N")
        if self.stages < 2:
            bad.append("STAGES")
        return bad

    def fits(self, arch: str) -> bool:
        return self.smem_bytes <= max_smem(arch)

    def min_blocks(self, arch: str) -> int:
        """kMinBlocks: 2 (the kernel asks for two CTAs an SM, capping registers) for 16
        rows where the SM's shared memory holds two CTAs of the shape, else 1."""
        return 2 if self.rows == 16 and 2 * (self.smem_bytes + 1024) <= sm_smem(arch) else 1


def mla_sm90_producer(block_size: int, sparse: bool, token_rows: bool = False) -> bool:
    """``mla_sm90_producer<C, T, BLOCK_SIZE, SPARSE>()`` of ``cuda_src/mla_attention_sm90.cuh``:
    warpgroup 1 alone copies the tiles (paged, pages of 16 tokens or more, a 16-bit or fp8
    cache; ``token_rows``: DeepSeek's sparse row formats, which never take it)."""
    return not token_rows and not sparse and block_size >= 16


def mla_sm90_tma(block_size: int, cache_itemsize: int, sparse: bool) -> bool:
    """``mla_sm90_tma<C, T, BLOCK_SIZE, SPARSE>()`` of ``cuda_src/mla_attention_sm90.cuh``:
    the producer (paged, pages of 16 tokens or more) over a 16-bit cache whose 64-token
    tiles are whole boxes of one block each, copied by TMA where a tile's blocks allow."""
    return (not sparse and cache_itemsize == 2 and block_size >= 16
            and (block_size % 64 == 0 or 64 % block_size == 0))


@dataclass(frozen=True)
class MlaSm90Geometry:
    """``MlaSm90Geometry<T, C, RANK, ROPE>`` of ``cuda_src/mla_attention_sm90.cuh``: 64
    rows, 64-token tiles, the 128-byte-swizzled tiles 1024-byte aligned; two 16-bit stages,
    or for an fp8 cache (``cache_itemsize`` 1) one and two raw stages of its bytes, or for
    token rows (``token_bytes``: 656 for fp8_ds_mla, 528 and 288 for V4's) one and two raw
    stages of them where two fit (V4's), else one (fp8_ds_mla's)."""

    rank: int
    rope: int
    cache_itemsize: int = 2
    token_bytes: int = 0  # a token row's bytes, as MlaGeometry's (0: not a token row)

    @classmethod
    def of(cls, spec) -> "MlaSm90Geometry":
        rows = _dtypes.SPARSE_BY_CACHE.get(spec.cache_dtype)
        return cls(spec.head_size, spec.rope_dim,
                   _dtypes.CACHE_BY_NAME[spec.cache_dtype].itemsize,
                   0 if rows is None else rows.nbytes)

    threads = 256
    rows = 64
    tile_tokens = 64

    # kTail: P, row state, flag, the sparse kernel's key flags, the producer's two
    # mbarriers, alignment
    _tail = 64 * 128 + 3 * 64 * 4 + 16 + 2 * 64 + 16 + 1024

    @property
    def _tile(self) -> int:  # kTileBytes: Q, or one 16-bit stage
        return (self.rank + self.rope) // 64 * 64 * 128

    @property
    def _raw_tile(self) -> int:  # kRawTileBytes: a tile of an fp8 cache's bytes or rows
        if self.cache_itemsize == 2:
            return 0
        return 64 * (self.token_bytes or self.rank + self.rope)

    @property
    def _stages(self) -> int:  # kStages: 16-bit stages (an fp8 cache: the widened tile)
        return 2 if self.cache_itemsize == 2 else 1

    @property
    def raw_stages(self) -> int:  # kRawStages
        fits = (1 + self._stages) * self._tile + 2 * self._raw_tile + self._tail <= SM90_SMEM
        return 1 if self.token_bytes and not fits else 2

    @property
    def smem_bytes(self) -> int:  # kSmemBytes: Q, the 16-bit stages, the raw stages, kTail
        return (1 + self._stages) * self._tile + self.raw_stages * self._raw_tile + self._tail

    def fits(self, arch: str) -> bool:
        return self.smem_bytes <= max_smem(arch)


# cuda_src/indexer.cuh's constants (indexer.py takes them from here; check_against_kernel
# compares them with the kernel's).
INDEXER_CHUNK = 1024  # kIndexerChunk: columns a CTA
TOPK_MAX = 2048  # kTopkMax
TOPK_THREADS = 512  # kTopkThreads
TOPK_STEP = TOPK_THREADS * 8  # kTopkStep: columns a CTA-wide step (an int column index)


def indexer_smem_bytes(heads: int, rows: int) -> int:
    """``IndexerGeometry<T, HEADS, ROWS>::kSmemBytes`` of ``cuda_src/indexer.cuh``: the rows'
    Q and the widened tile (rows of 136 16-bit values), two raw stages of 64 keys, their
    scales and flags, each row's warps' column sums."""
    return (rows * heads * 136 * 2 + 64 * 136 * 2 + 2 * 64 * 128 + 2 * 64 * 4 * 2
            + rows * heads // 16 * 64 * 4)


def check_against_kernel(specs, chunk: int = 100) -> None:
    """Have NVRTC compare the mirrors with ``DecodeGeometry``, ``PrefillGeometry``,
    ``Sm90PrefillGeometry``, ``MlaGeometry`` and ``MlaSm90Geometry`` in the kernel sources for
    each spec of those kernels, compiled for the spec's target: one ``static_assert`` per
    spec over the shared memory (and for decode the path and the piece count, for MLA the
    CTAs an SM asked for). No kernel is instantiated, so a few hundred take a second (in
    programs of ``chunk``: NVRTC slows down more than linearly with more in one, 3.1 ms a
    decode spec in programs of 100, 4.6 in programs of 300, 13 in programs of 1,000).
    Raises AssertionError with NVRTC's log naming the specializations that differ."""
    from concurrent.futures import ThreadPoolExecutor

    specs = list(specs)
    parts = []
    for kernel in ("paged_decode", "paged_prefill", "paged_prefill_sm90", "mla_attention",
                   "mla_sparse_attention", "mla_attention_sm90", "mla_sparse_attention_sm90",
                   "indexer_logits"):
        for arch in sorted({s.arch for s in specs}):
            mine = [s for s in specs if s.kernel == kernel and s.arch == arch]
            parts += [mine[i:i + chunk] for i in range(0, len(mine), chunk)]
    with ThreadPoolExecutor() as pool:
        list(pool.map(_check_chunk, parts))


def _check_chunk(specs) -> None:
    from .. import jit

    lines = []
    for s in specs:
        t = _dtypes.BY_NAME[s.dtype].cxx
        if s.kernel == "indexer_logits":
            lines.append(f"static_assert(cupaged::IndexerGeometry<{t}, {s.rows}, "
                         f"{s.group_tile}>::kSmemBytes == "
                         f"{indexer_smem_bytes(s.rows, s.group_tile)}, "
                         f"\"host mirror differs: {s.name}\");\n")
            lines.append(f"static_assert(cupaged::kIndexerChunk == {INDEXER_CHUNK} && "
                         f"cupaged::kTopkThreads == {TOPK_THREADS} && "
                         f"cupaged::kTopkMax == {TOPK_MAX} && "
                         f"cupaged::kTopkStep == {TOPK_STEP}, "
                         f"\"geometry.py's indexer constants differ from indexer.cuh's\");\n")
            continue
        if s.kernel in jit.MLA_SM90_KERNELS:
            g = MlaSm90Geometry.of(s)
            c = _dtypes.CACHE_BY_NAME[s.cache_dtype].cxx
            cxx = f"cupaged::MlaSm90Geometry<{t}, {c}, {s.head_size}, {s.rope_dim}>"
            lines.append(f"static_assert({cxx}::kSmemBytes == {g.smem_bytes} && "
                         f"{cxx}::kRawStages == {g.raw_stages}, "
                         f"\"host mirror differs: {s.name}\");\n")
            sparse = s.kernel == "mla_sparse_attention_sm90"
            copy = f"<{c}, {t}, {s.block_size}, {str(sparse).lower()}>()"
            producer = mla_sm90_producer(s.block_size, sparse, g.token_bytes > 0)
            tma = mla_sm90_tma(s.block_size, g.cache_itemsize, sparse)
            lines.append(f"static_assert(cupaged::mla_sm90_producer{copy} == "
                         f"{str(producer).lower()} && cupaged::mla_sm90_tma{copy} == "
                         f"{str(tma).lower()}, \"host mirror differs: {s.name}\");\n")
            continue
        if s.kernel in ("mla_attention", "mla_sparse_attention"):
            g = MlaGeometry.of(s)
            c = _dtypes.CACHE_BY_NAME[s.cache_dtype].cxx
            cxx = (f"cupaged::MlaGeometry<{t}, {c}, {s.head_size}, {s.rope_dim}, {s.rows}, "
                   f"{s.tile_tokens}, {s.stages}>")
            lines.append(f"static_assert({cxx}::kSmemBytes == {g.smem_bytes} && "
                         f"{cxx}::kKSplit == {g.k_split} && "
                         f"{cxx}::kMinBlocks == {g.min_blocks(s.arch)}, "
                         f"\"host mirror differs: {s.name}\");\n")
            continue
        if s.kernel == "paged_prefill_sm90":
            g = Sm90PrefillGeometry.of(s)
            c = _dtypes.CACHE_BY_NAME[s.cache_dtype].cxx
            q = f", {c}" if s.query_dtype else ""
            cxx = (f"cupaged::Sm90PrefillGeometry<{t}, {c}, {s.head_size}, {s.block_size}, "
                   f"{s.tile_tokens}, {s.stages}{q}>")
            lines.append(f"static_assert({cxx}::kSmemBytes == {g.smem_bytes} && "
                         f"{cxx}::kRows == {g.rows} && {cxx}::kThreads == {g.threads}, "
                         f"\"host mirror differs: {s.name}\");\n")
            continue
        c = _dtypes.CACHE_BY_NAME[s.cache_dtype].cxx
        fmt = jit.KV_FORMATS[s.kv_format]
        sc = jit.KV_SCALES[s.kv_scale]
        if s.kernel == "paged_prefill":
            g = PrefillGeometry.of(s)
            cxx = (f"cupaged::PrefillGeometry<{t}, {c}, {s.head_size}, {s.block_size}, {fmt}, "
                   f"{sc}, {s.warps}, {s.m_atoms}, {s.key_warps}, {s.tile_tokens}, "
                   f"{s.stages}>")
            lines.append(f"static_assert({cxx}::kSmemBytes == {g.smem_bytes} && "
                         f"{cxx}::kRows == {g.rows}, \"host mirror differs: {s.name}\");\n")
            continue
        g = DecodeGeometry.of(s)
        cxx = (f"cupaged::DecodeGeometry<{t}, {c}, {s.head_size}, {s.block_size}, {fmt}, "
               f"{sc}, {s.group_tile}, {s.tile_tokens}, {s.stages}>")
        lines.append(f"static_assert({cxx}::kSmemBytes == {g.smem_bytes} && "
                     f"{cxx}::kMma == {str(g.mma).lower()} && "
                     f"{cxx}::kVTransposed == {str(g.v_transposed).lower()} && "
                     f"{cxx}::kSwizzle == {str(g.swizzle).lower()} && "
                     f"{cxx}::kPieces == {g.pieces}, \"host mirror differs: {s.name}\");\n")
    nvrtc = jit.ready_nvrtc()
    prog = nvrtc.createProgram(jit.source(specs[0].source_file) + "".join(lines), "mirror.cu",
                               [], [])
    try:
        try:
            # each chunk for its specs' target (mla_attention's kMinBlocks depends on it);
            # sm90.cuh builds for sm_90a only
            arch = ("compute_90a" if specs[0].kernel in jit.ARCH_ONLY
                    else "compute_" + specs[0].arch.split("_")[1])
            nvrtc.compileProgram(prog, [jit.CXX_STD, f"-arch={arch}"])
        except nvrtc.NVRTCError:
            raise AssertionError(nvrtc.getProgramLog(prog)) from None
    finally:
        nvrtc.destroyProgram(prog)
