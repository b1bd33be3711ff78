"""``cupaged-bench mla``: absorbed multi-head latent attention (DeepSeek's MLA) decode over
a paged latent cache, cupaged.mla_attention beside FlashInfer's
BatchMLAPagedAttentionWrapper (fa2 and fa3 backends), on the same bytes, each checked
against the float64 reference (cupaged.reference.mla_attention) before it is timed.

A case is ``batch`` sequences of ``context`` cached tokens each, the last ``q_len`` of
them the query tokens (causal, bottom-right), ``heads`` query heads sharing one latent KV
head: q ``[batch * q_len, heads, 512 + 64]`` (each head's absorbed ``W_UK q_nope``, then
its ``q_pe``), vLLM's combined cache ``[num_blocks, page_size, 512 + 64]`` with each
sequence's blocks shuffled over it, out ``[batch * q_len, heads, 512]``. Random normal
data throughout. FlashInfer's ``ckv`` and ``kpe`` caches are views of that one
allocation, so both libraries read the same bytes.

Roofline numbers: bytes are the latent cache the call must read (576 elements per cached
token, every token once: the last query row sees them all) plus q and out; FLOPs are
``2 * (576 + 512)`` per (query head, visible key), the causal limit honored
(prefill.attended_pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import cupy
import numpy as np

from .. import _dtypes, reference, testing
from . import peers, prefill, timing, workloads

__all__ = ["DSV3_SCALE", "IMPLEMENTATIONS", "KV_LORA_RANK", "MLACase", "PRESETS", "ROPE_DIM",
           "Row", "measure"]

KV_LORA_RANK = 512  # DeepSeek-V3's latent (kv_c) width: the value and the output
ROPE_DIM = 64  # its decoupled rotary key (k_pe, q_pe)
# DeepSeek-V3's softmax scale: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1 / sqrt(128 +
# 64) (YaRN's mscale left out), not one over the root of the 576-wide key.
DSV3_SCALE = 1.0 / math.sqrt(128 + 64)

DTYPES = ("bfloat16", "float16")
# Latent caches: the query's dtype ("auto") or fp8 (written by cupaged.concat_and_cache_mla
# from random normal values, per-tensor scale FP8_SCALE: |x| / scale stays inside e4m3).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
FP8_SCALE = 1.0 / 64

# DeepSeek-V3 absorbed, bf16, pages of 64 (MLACase's defaults).
PRESETS = {
    "dsv3-16h-4k": dict(heads=16, batch=128, context=4096, q_len=1),
    "dsv3-16h-32k": dict(heads=16, batch=128, context=32768, q_len=1),
    "dsv3-128h-4k": dict(heads=128, batch=128, context=4096, q_len=1),
    "dsv3-128h-4k-q2": dict(heads=128, batch=128, context=4096, q_len=2),
}


@dataclass
class MLACase:
    """``batch`` sequences of ``context`` cached tokens, the last ``q_len`` of each the
    query tokens, ``heads`` query heads, pages of ``block_size`` tokens, ``dtype`` queries
    and cache (bfloat16 or float16). ValueError for a shape that cannot be built."""

    name: str
    heads: int = 16
    batch: int = 128
    context: int = 4096
    q_len: int = 1
    block_size: int = 64
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    causal: bool = True
    scale: float = DSV3_SCALE
    arrays: dict = field(default_factory=dict, repr=False)
    tables: np.ndarray | None = field(default=None, repr=False)  # host copy of block_tables
    refs: list = field(default_factory=list, repr=False)  # (seq, float64 out), once per case

    def __post_init__(self):
        workloads.require_positive(self, "heads", "batch", "context", "q_len", "block_size")
        if self.q_len > self.context:
            raise ValueError(f"context ({self.context}) counts the query tokens: at least "
                             f"q_len ({self.q_len})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def cache_itemsize(self) -> int:
        return 1 if self.fp8 else self.itemsize

    @property
    def np_dtype(self):
        return _dtypes.parse(self.dtype).numpy

    @property
    def itemsize(self) -> int:
        return _dtypes.parse(self.dtype).itemsize

    @property
    def total_q(self) -> int:
        return self.batch * self.q_len

    def kv_bytes(self) -> int:
        """The latent cache the call must read: ``512 + 64`` elements per cached token,
        each once (the last query row of a sequence sees all of its tokens)."""
        return self.batch * self.context * (KV_LORA_RANK + ROPE_DIM) * self.cache_itemsize

    def bytes_moved(self) -> int:
        """kv_bytes, plus q (``576`` per head and token) read and out (``512``) written."""
        rows = self.total_q * self.heads
        return self.kv_bytes() + rows * (2 * KV_LORA_RANK + ROPE_DIM) * self.itemsize

    def flops(self) -> float:
        """Useful FLOPs: per (query head, visible key) a 576-long dot product for the
        logit and a 512-long multiply-add for the output, 2 FLOPs each; a query row sees
        the keys up to its own position (causal) or all of them (attended_pairs)."""
        pairs = prefill.attended_pairs(self.q_len, self.context, self.causal)
        return 2.0 * self.heads * self.batch * pairs * (KV_LORA_RANK + ROPE_DIM + KV_LORA_RANK)

    def describe(self) -> str:
        return (f"{self.name}: {self.heads} heads, batch {self.batch}, context {self.context}, "
                f"{self.q_len} query token{'s' if self.q_len > 1 else ''}"
                f"{' (causal)' if self.causal and self.q_len > 1 else ''}, pages of "
                f"{self.block_size}, {self.dtype}: {self.kv_bytes() / 2**20:.1f} MiB of latent "
                f"cache" + (f" ({self.kv_cache_dtype}, k_scale {FP8_SCALE})" if self.fp8 else ""))

    def build(self, seed: int = 0) -> "MLACase":
        """Random normal q and cache on the device, each sequence's blocks scattered."""
        rng = np.random.default_rng(seed)
        lens = np.full(self.batch, self.context, np.int32)
        bt, nb = testing.random_block_tables(lens, self.block_size, rng)
        dt = self.np_dtype
        self.tables = bt
        self.refs = []
        self.arrays = dict(
            q=testing.random_normal((self.total_q, self.heads, KV_LORA_RANK + ROPE_DIM), dt,
                                    rng, cupy),
            kv_cache=self._cache(nb, dt, rng),
            block_tables=cupy.asarray(bt), seq_lens=cupy.asarray(lens),
            query_start_loc=cupy.arange(0, self.total_q + 1, self.q_len, dtype=np.int32))
        return self

    def _cache(self, nb: int, dt, rng):
        """The latent cache: random normal values of the query's dtype, or for fp8 those
        written through cupaged.concat_and_cache_mla (x / FP8_SCALE, saturated), a block
        at a time so the 16-bit source stays small."""
        shape = (nb, self.block_size, KV_LORA_RANK + ROPE_DIM)
        if not self.fp8:
            return testing.random_normal(shape, dt, rng, cupy)
        import cupaged

        cache = cupy.empty(shape, np.uint8)
        step = max(1, (1 << 24) // self.block_size)  # slots a write
        flat = nb * self.block_size
        for lo in range(0, flat, step):
            n = min(step, flat - lo)
            src = testing.random_normal((n, KV_LORA_RANK + ROPE_DIM), dt, rng, cupy)
            cupaged.concat_and_cache_mla(src[:, :KV_LORA_RANK], src[:, KV_LORA_RANK:], cache,
                                         cupy.arange(lo, lo + n, dtype=np.int64),
                                         self.kv_cache_dtype, FP8_SCALE)
        return cache

    def check_seqs(self) -> list:
        """The sequences checked: the first, the middle and the last."""
        return sorted({0, self.batch // 2, self.batch - 1})

    def _references(self) -> list:
        """``(seq, float64 out [q_len, heads, 512])`` of check_seqs, each from its own
        blocks only (copied to the host), computed on the first check and kept (the
        reference multiplies all heads by the one latent KV head at once)."""
        if not self.refs:
            a = self.arrays
            n_blocks = -(-self.context // self.block_size)
            meta = (np.arange(n_blocks, dtype=np.int32)[None], np.array([self.context], np.int32),
                    np.array([0, self.q_len], np.int32))
            for s in self.check_seqs():
                blocks = self.tables[s, :n_blocks]
                cache = cupy.asnumpy(a["kv_cache"][cupy.asarray(blocks)])
                if not self.fp8:
                    cache = cache.astype(np.float64)
                q = cupy.asnumpy(a["q"][s * self.q_len:(s + 1) * self.q_len])
                self.refs.append((s, reference.mla_attention(
                    q, cache, *meta, scale=self.scale, kv_lora_rank=KV_LORA_RANK,
                    causal=self.causal, kv_cache_dtype=self.kv_cache_dtype,
                    k_scale=FP8_SCALE if self.fp8 else None)))
        return self.refs

    def check(self, out) -> float:
        """Max relative error ``||out - ref|| / ||ref||`` over each (query row, head) of
        the check_seqs sequences (NaN: inf)."""
        worst = 0.0
        for s, ref in self._references():
            got = cupy.asnumpy(out[s * self.q_len:(s + 1) * self.q_len]).astype(np.float64)
            err = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
            worst = max(worst, float(np.nan_to_num(err, nan=np.inf).max()))
        return worst

    def tolerance(self) -> float:
        """The per-row bound of the tests (testing.ROW_FACTOR times the dtype's)."""
        return testing.ROW_FACTOR * testing.TOLERANCE[_dtypes.parse(self.dtype).name]


def preset_case(name: str, block_size: int = 64, dtype: str = "bfloat16",
                kv_cache_dtype: str = "auto") -> MLACase:
    return MLACase(name, block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                   **PRESETS[name])


# ---- runners: factory(case) -> run() returning the output as a CuPy array -------------------


def force_family(family: str | None) -> None:
    """The MLA kernel family a cupaged runner measures (planning.set_mla_family, for the
    A/B of the two families in one run; set when the runner is made, reset by the
    measuring loop): None the planner's, ``"mma"`` the mma.sync kernel on Hopper too,
    ``"sm90"`` the wgmma kernel wherever it applies, 16 rows included (Hopper only)."""
    from .. import planning

    if family == "sm90":
        peers.require_hopper("cupaged-sm90")
    planning.set_mla_family(family)


def _run_cupaged(case: MLACase, family: str | None = None):
    """cupaged.mla_attention over the combined cache; decode (one query token per
    sequence) without query_start_loc, as a serving step passes it; ``family`` as
    :func:`force_family`'s."""
    import cupaged

    force_family(family)
    a = case.arrays
    out = cupy.full((case.total_q, case.heads, KV_LORA_RANK), np.nan, dtype=a["q"].dtype)
    starts = a["query_start_loc"] if case.q_len > 1 else None
    kw = dict(scale=case.scale, kv_lora_rank=KV_LORA_RANK, causal=case.causal,
              max_query_len=case.q_len, max_seq_len=case.context, out=out)
    if case.fp8:
        kw.update(kv_cache_dtype=case.kv_cache_dtype, k_scale=FP8_SCALE)

    def run():
        cupaged.mla_attention(a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"], starts,
                              **kw)
        return out

    return run


def _run_flashinfer(case: MLACase, backend: str):
    """FlashInfer's BatchMLAPagedAttentionWrapper (``backend`` "fa2" or "fa3"), planned
    once here, outside timing; the timed call is run(). Its q_nope / q_pe and ckv / kpe
    are views of the case's q and combined cache: FlashInfer's MLA kernels take a page
    stride and a token stride for each cache and a token and head stride for each query
    part (csrc/batch_mla_run.cu, batch_mla_sm90_run.cu), so no copy is made and both
    libraries read the same bytes. FlashInfer 0.7 takes the metadata as
    ``flashinfer.mla.MLAPlanMetadata.csr`` and the split inputs as ``query=`` /
    ``kv_cache=`` pairs (the flat arguments still work there, deprecated); an older one
    takes the flat arguments only."""
    if case.fp8:
        raise RuntimeError("fp8 latent caches are measured for cupaged only")
    flashinfer = peers.require_flashinfer()
    torch = peers.import_torch()
    a = case.arrays
    q = torch.from_dlpack(a["q"])
    cache = torch.from_dlpack(a["kv_cache"])
    q_nope, q_pe = q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]
    ckv, kpe = cache[..., :KV_LORA_RANK], cache[..., KV_LORA_RANK:]
    indptr, indices, _ = peers.flashinfer_pages(case.tables, np.full(case.batch, case.context),
                                                case.block_size)
    out = torch.full(q_nope.shape, float("nan"), dtype=q.dtype, device=q.device)
    ws = torch.zeros(peers.FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
    csr = dict(qo_indptr=torch.from_dlpack(a["query_start_loc"]).cpu(),
               kv_indptr=torch.from_numpy(indptr),
               kv_indices=torch.from_numpy(indices).to(q.device),
               kv_len_arr=torch.from_dlpack(a["seq_lens"]).cpu())
    shape = dict(num_heads=case.heads, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=ROPE_DIM,
                 page_size=case.block_size, causal=case.causal, sm_scale=case.scale,
                 q_data_type=q.dtype, kv_data_type=cache.dtype)
    metadata = getattr(flashinfer.mla, "MLAPlanMetadata", None)
    if metadata is None:  # before 0.7: the flat arguments only
        wrapper.plan(**csr, **shape)
        args, kw = (q_nope, q_pe, ckv, kpe), {}
    else:
        wrapper.plan(metadata=metadata.csr(**csr), query_layout="split",
                     kv_cache_layout="split", **shape)
        args, kw = (), dict(query=(q_nope, q_pe), kv_cache=(ckv, kpe))
    out_cupy = cupy.from_dlpack(out)

    def run():
        wrapper.run(*args, out=out, **kw)
        return out_cupy

    return run


_CUPAGED = ("cupaged", "cupaged-mma", "cupaged-sm90")
IMPLEMENTATIONS = {
    "cupaged": _run_cupaged,
    "cupaged-mma": lambda c: _run_cupaged(c, "mma"),
    "cupaged-sm90": lambda c: _run_cupaged(c, "sm90"),
    "flashinfer-fa2": lambda c: _run_flashinfer(c, "fa2"),
    "flashinfer-fa3": lambda c: _run_flashinfer(c, "fa3"),
}


@dataclass
class Row:
    case: str
    impl: str
    median_us: float = math.nan
    p10_us: float = math.nan
    p90_us: float = math.nan
    tflops: float = math.nan
    pct_copy: float = math.nan  # bytes_moved / time, against the copy bandwidth
    error: float = math.nan
    note: str = ""  # "WRONG" for a failed check (then not timed), or why it did not run

    @property
    def ran(self) -> bool:
        return self.median_us == self.median_us or self.note == "WRONG"


def check_then_time(row: Row, case, run, reps: int, copy_bw: float | None) -> None:
    """Fill ``row`` for ``run`` (a runner's timed call): its error against ``case``'s
    reference, then, when within the case's tolerance, its times, TFLOP/s (case.flops())
    and share of the copy bandwidth (case.bytes_moved()); else the note WRONG, untimed."""
    row.error = case.check(run())
    if not row.error <= case.tolerance():
        row.note = "WRONG"
        return
    t = timing.time_us(run, reps=reps)
    sec = t.median_us * 1e-6
    row.median_us, row.p10_us, row.p90_us = t.median_us, t.p10_us, t.p90_us
    row.tflops = case.flops() / sec / 1e12
    if copy_bw:
        row.pct_copy = 100 * case.bytes_moved() / sec / copy_bw


def measure(cases, impls, reps: int = 20, copy_bw: float | None = None):
    """Rows for every (case, implementation), each checked before it is timed: a failed
    check gets the note WRONG and no time, a runner that cannot run a note saying why."""
    from .. import planning

    rows = []
    for case in cases:
        case.build()
        with peers.torch_on_cupy_stream():
            for impl in impls:
                row = Row(case.name, impl)
                try:
                    run = IMPLEMENTATIONS[impl](case)
                    check_then_time(row, case, run, reps, copy_bw)
                except Exception as e:  # noqa: BLE001 - a runner that cannot run is a row note
                    row.note = " ".join(f"{type(e).__name__}: {e}".split())[:160]
                finally:
                    if impl in _CUPAGED:  # back to the planner's choice of kernel
                        planning.set_mla_family(None)
                run = None  # the row's buffers (FlashInfer's workspace) go, failed or not
                peers.free_memory()
                rows.append(row)
        case.arrays.clear()
        case.refs = []
        peers.free_memory()
    return rows
