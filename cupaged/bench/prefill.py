"""Multi-token benchmarks (``cupaged-bench prefill``): prefill, chunked prefill and
speculative verify over a paged cache, cupaged beside FlashInfer's paged prefill wrapper
(fa2 and fa3 backends) and torch SDPA on dense copies, each checked against the float64
reference before it is timed. Throughput is TFLOP/s of useful FLOPs (causal rows count only
the keys they see), beside the bf16 matmul rate measured in the same run; for
memory-bound shapes (verify) also the K/V bytes read once against the copy bandwidth.
Over an fp8 cache (``kv_cache_dtype``: random finite fp8 values, per-tensor scales, as
the decode bench's) cupaged and FlashInfer run; torch SDPA has no fp8 path.

Attention variants (``variants``: a sliding window, a logits soft cap, sinks, ALiBi) run in
cupaged and in FlashInfer's wrappers (``window_left = W - 1`` and ``logits_soft_cap`` to
plan(); no sinks or ALiBi); torch SDPA runs plain attention only. With a window, TFLOP/s count
only the (query, key) pairs inside both the window and the causal limit
(:func:`attended_pairs`), and the K/V bytes only the keys some query sees
(:func:`seen_keys`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import cupy
import numpy as np

from .. import _dtypes, reference, testing
from . import decode, peers, timing, workloads

__all__ = ["PRESETS", "PrefillCase", "attended_pairs", "matmul_tflops", "measure",
           "seen_keys", "variant_unsupported"]


def attended_pairs(q_len: int, ctx: int, causal: bool = True, window=None) -> int:
    """(query, key) pairs one sequence computes: its ``q_len`` new tokens at positions
    ``ctx - q_len .. ctx - 1``, each seeing the keys up to its own position (``causal``)
    or all ``ctx``, and with a window W only those at positions > p - W."""
    if not 0 <= q_len <= ctx:
        raise ValueError(f"expected 0 <= q_len <= ctx, got {q_len} and {ctx}")
    p = np.arange(ctx - q_len, ctx, dtype=np.int64)
    hi = p + 1 if causal else np.full_like(p, ctx)  # exclusive
    lo = np.zeros_like(p) if window is None else np.maximum(p - int(window) + 1, 0)
    return int(np.maximum(hi - lo, 0).sum())


def seen_keys(q_len: int, ctx: int, window=None) -> int:
    """Keys of one sequence that some query sees (causal or not: the last query sees up
    to the end): all ``ctx``, or with a window W those from ``ctx - q_len - W + 1`` on."""
    if window is None:
        return ctx
    return ctx - max(0, ctx - q_len - int(window) + 1)


# FlashInfer's prefill wrappers take these variants through plan() (not sinks or ALiBi).
_FLASHINFER_VARIANTS = {"window": "window_left", "soft_cap": "logits_soft_cap"}


def variant_unsupported(impl: str, variants: "workloads.Variants",
                        kv_layout: str = "NHD") -> str | None:
    """Why a prefill implementation cannot run ``variants`` over a ``kv_layout`` cache (one
    line), or None. The peers here read NHD caches only."""
    if impl in _CUPAGED:
        return None
    if kv_layout != "NHD":
        return f"{impl} reads NHD caches here, not {kv_layout}"
    takes = _FLASHINFER_VARIANTS if impl.startswith("flashinfer-") else None  # SDPA: none
    return decode.peer_refusal(impl, takes, variants)


@dataclass
class PrefillCase:
    """``batch`` sequences, each with ``q_len`` new tokens at the end of ``ctx`` cached ones
    (``q_len == ctx``: a whole prompt), on a ``kv_layout`` cache (NHD, HND or vllm) with
    the blocks scattered: of ``dtype``, or uint8 bytes of fp8 (``kv_cache_dtype``
    "fp8_e4m3" / "fp8_e5m2"), with attention ``variants`` (workloads.Variants)."""

    name: str
    batch: int
    q_len: int
    ctx: int
    heads: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    causal: bool = True
    kv_cache_dtype: str = "auto"
    variants: workloads.Variants = workloads.PLAIN
    kv_layout: str = "NHD"
    arrays: dict = field(default_factory=dict, repr=False)
    variant_arrays: dict = field(default_factory=dict, repr=False)  # sinks on the device

    def __post_init__(self):
        self.kv_cache_dtype = workloads.kv_cache_dtype_name(self.kv_cache_dtype)

    @property
    def np_dtype(self):
        return _dtypes.parse(self.dtype).numpy

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def kv_args(self) -> dict:
        """kv_cache_dtype, k_scale, v_scale for the kernels and the reference (fp8 only)."""
        if not self.fp8:
            return {}
        s = workloads.FP8_SCALES[self.kv_cache_dtype]
        return dict(kv_cache_dtype=self.kv_cache_dtype, k_scale=s, v_scale=s)

    def build(self, seed: int = 0) -> "PrefillCase":
        rng = np.random.default_rng(seed)
        lens = np.full(self.batch, self.ctx, np.int32)
        bt, nb = testing.random_block_tables(lens, self.block_size, rng)
        shape = (nb, self.block_size, self.kv_heads, self.head_size)
        dt = self.np_dtype

        def cache():
            if self.fp8:
                return workloads.random_fp8(shape, self.kv_cache_dtype, rng, cupy)
            return testing.random_normal(shape, dt, rng, cupy)

        k, v = cache(), cache()
        if self.kv_layout != "NHD":  # the same values, rearranged on the host
            k, v = (cupy.asarray(c) for c in testing.convert_layout(
                cupy.asnumpy(k), cupy.asnumpy(v), "NHD", self.kv_layout))

        self.arrays = dict(
            query=testing.random_normal((self.batch * self.q_len, self.heads, self.head_size),
                                        dt, rng, cupy),
            key_cache=k, value_cache=v,
            block_tables=cupy.asarray(bt), seq_lens=cupy.asarray(lens),
            query_start_loc=cupy.arange(0, self.batch * self.q_len + 1, self.q_len,
                                        dtype=np.int32))
        self.variant_arrays = self.variants.device_arrays(self.heads)
        return self

    @property
    def variant_args(self) -> dict:
        """The variants as cupaged.attention takes them (nothing for plain attention)."""
        return self.variants.kernel_args(self.variant_arrays)

    def flops(self) -> float:
        """Useful FLOPs: 2 matmuls of 2 * head_size per (query head, visible key), the
        visible keys within the causal limit and the window (attended_pairs)."""
        seen = attended_pairs(self.q_len, self.ctx, self.causal, self.variants.window)
        return 4.0 * self.head_size * self.heads * self.batch * seen

    def kv_bytes(self) -> int:
        """K and V read once (1 byte per element for fp8): the keys some query sees
        (seen_keys: all of them without a window)."""
        it = 1 if self.fp8 else np.dtype(self.np_dtype).itemsize
        keys = seen_keys(self.q_len, self.ctx, self.variants.window)
        return 2 * self.batch * keys * self.kv_heads * self.head_size * it

    def check(self, out, rows: int = 6, query=None) -> float:
        """Max relative error of a few query rows of the first and last sequences (the
        last row of each included) against the float64 reference, with the variants;
        ``query`` (host values) in place of the case's where a runner computes with
        another (an 8-bit one's)."""
        a = self.arrays
        q = np.asarray(query if query is not None else cupy.asnumpy(a["query"]),
                       dtype=np.float64)
        k = cupy.asnumpy(a["key_cache"])
        v = cupy.asnumpy(a["value_cache"])
        bt = cupy.asnumpy(a["block_tables"])
        got = cupy.asnumpy(out).astype(np.float64)
        worst = 0.0
        for s in sorted({0, self.batch - 1}):
            kk, vv = reference.gather_kv(k, v, bt[s], self.ctx, self.kv_layout, **self.kv_args)
            picks = np.unique(np.linspace(0, self.q_len - 1, rows).astype(int))
            qrows = q[s * self.q_len + picks]
            pos = self.ctx - self.q_len + picks
            ref = reference.attend(qrows, kk, vv, 1.0 / math.sqrt(self.head_size),
                                   q_pos=pos, causal=self.causal,
                                   **self.variants.reference_args(self.heads))
            g = got[s * self.q_len + picks]
            err = np.linalg.norm(g - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
            worst = max(worst, float(np.nan_to_num(err, nan=np.inf).max()))
        return worst


# The presets: bf16, head size 128, blocks of 16, causal.
PRESETS = {
    "prompt-4096": dict(batch=1, q_len=4096, ctx=4096),
    "prompt-16384": dict(batch=1, q_len=16384, ctx=16384),
    "8x2048": dict(batch=8, q_len=2048, ctx=2048),
    "4x4096-mha": dict(batch=4, q_len=4096, ctx=4096, kv_heads=32),
    "chunk-512-of-8192": dict(batch=8, q_len=512, ctx=8192),
    "verify-64x4x2048": dict(batch=64, q_len=4, ctx=2048, dtype="float16"),
}


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    """bf16 n x n x n matmul TFLOP/s (cuBLAS through CuPy): the tensor-core ceiling."""
    dt = _dtypes.parse("bfloat16").numpy
    a = cupy.ones((n, n), dtype=dt)
    b = cupy.ones((n, n), dtype=dt)
    c = cupy.empty((n, n), dtype=dt)
    t = timing.time_us(lambda: cupy.matmul(a, b, out=c), reps=reps, flush_l2=False,
                      cover_host_us=0, profiled=False)
    return 2.0 * n ** 3 / (t.median_us * 1e-6) / 1e12


# ---- runners: factory(case) -> run() returning the output as a CuPy array -------------------


def _run_cupaged(case: PrefillCase, family: str | None = None):
    """cupaged.attention as the planner chooses; ``family="mma"``: with the mma.sync
    multi-token kernel on Hopper too, ``"sm90"``: with paged_prefill_sm90 wherever it
    applies, few rows included (planning.set_prefill_family, for the A/B of the two
    families in one run; set when the runner is made, which empties the call memo)."""
    import cupaged
    from .. import planning

    if family == "sm90":
        peers.require_hopper("cupaged-sm90")
    planning.set_prefill_family(family)
    a = case.arrays
    out = cupy.full(a["query"].shape, np.nan, dtype=a["query"].dtype)

    def run():
        return cupaged.attention(**a, kv_layout=case.kv_layout, causal=case.causal,
                                 max_query_len=case.q_len, max_seq_len=case.ctx, out=out,
                                 **case.kv_args, **case.variant_args)

    return run


def _run_cupaged_fp8_query(case: PrefillCase):
    """cupaged.attention with an 8-bit query (its products on 8-bit tensor cores): the
    case's query rounded to its fp8 cache's format with a per-tensor scale (its largest
    magnitude at the format's largest value), that scale folded into ``scale``, the output
    in the case's dtype. Checked against the reference over the 8-bit query's values (the
    query's own rounding moves rows of these heavy-tailed random caches by up to about 5%
    in e4m3, measured on the CPU): the weights' rounding to fp8 (each off by up to 2^-4 of
    itself in e4m3, 2^-3 in e5m2) moves a row with few large weights by up to that, so it
    is flagged WRONG past 2^-4 over e4m3 and 2^-3 over e5m2 (four times its tolerance of
    2^-6 and 2^-5, which correct rows of these caches often exceed: up to 3.4% in e4m3 and
    7.3% in e5m2 in a CPU emulation of the kernel's rounding)."""
    import cupaged

    if not case.fp8:
        raise NotImplementedError("an 8-bit query needs an fp8 cache: --kv-cache-dtype")
    peers.require_hopper("cupaged-fp8q")
    a = case.arrays
    fmt = case.kv_cache_dtype
    q_scale = float(cupy.abs(a["query"].astype(np.float32)).max()) / reference.fp8_max(fmt)
    q8 = cupy.asarray(reference.quantize_fp8(cupy.asnumpy(a["query"]), fmt, q_scale)
                      .view(np.uint8))
    out = cupy.full(a["query"].shape, np.nan, dtype=a["query"].dtype)
    args = {**a, "query": q8}
    scale = q_scale / math.sqrt(case.head_size)
    # the values the kernel multiplies: check() scales by 1 / sqrt(head_size)
    query = reference.dequantize_fp8(cupy.asnumpy(q8), fmt, q_scale)

    def run():
        return cupaged.attention(**args, kv_layout=case.kv_layout, causal=case.causal,
                                 max_query_len=case.q_len, max_seq_len=case.ctx, out=out,
                                 scale=scale, **case.kv_args, **case.variant_args)

    run.tolerance = 2.0 ** (-6 if fmt == "fp8_e4m3" else -5)
    run.reference_query = query
    return run


def _run_flashinfer(case: PrefillCase, backend: str):
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper; an fp8 cache's bytes viewed as
    torch's float8 type, its scales passed to run() (k_scale folded into the softmax
    scale, the output multiplied by v_scale: FlashInfer's own launch, timed with it). A
    window goes to plan() as ``window_left = W - 1``, a soft cap as ``logits_soft_cap``."""
    why = variant_unsupported(f"flashinfer-{backend}", case.variants, case.kv_layout)
    if why:
        raise NotImplementedError(why)
    flashinfer = peers.require_flashinfer()
    torch = peers.import_torch()
    a = case.arrays
    indptr, indices, last = peers.flashinfer_pages(cupy.asnumpy(a["block_tables"]),
                                                    np.full(case.batch, case.ctx),
                                                    case.block_size)
    dev = torch.device("cuda", cupy.cuda.Device().id)
    q = torch.from_dlpack(a["query"])
    k = torch.from_dlpack(a["key_cache"])
    v = torch.from_dlpack(a["value_cache"])
    scales = {}
    if case.fp8:
        k, v = (x.view(peers.torch_fp8_dtype(case.kv_cache_dtype)) for x in (k, v))
        scales = {n: case.kv_args[n] for n in ("k_scale", "v_scale")}
    out = torch.full_like(q, float("nan"))
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    wrapper.plan(torch.from_dlpack(a["query_start_loc"]).cpu(),
                 torch.from_numpy(indptr), torch.from_numpy(indices).to(dev),
                 torch.from_numpy(last), case.heads, case.kv_heads, case.head_size,
                 case.block_size, causal=case.causal, q_data_type=q.dtype,
                 kv_data_type=k.dtype,
                 window_left=-1 if case.variants.window is None else case.variants.window - 1,
                 logits_soft_cap=case.variants.soft_cap)
    out_cupy = cupy.from_dlpack(out)

    def run():
        wrapper.run(q, (k, v), out=out, **scales)
        return out_cupy

    return run


def _run_sdpa(case: PrefillCase, backend: str):
    """torch SDPA on dense [batch, heads, len, head_size] copies (GQA by enable_gqa).
    Whole prompts use is_causal; a chunk over a longer context needs a bottom-right
    mask, which only the cuDNN and math backends take. No fp8 caches."""
    if case.fp8:
        raise NotImplementedError(f"torch SDPA has no fp8 cache path ({case.kv_cache_dtype})")
    why = variant_unsupported(f"torch-sdpa-{backend}", case.variants, case.kv_layout)
    if why:
        raise NotImplementedError(why)
    torch = peers.import_torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    a = case.arrays
    b, ql, ctx, h, kvh, hs = case.batch, case.q_len, case.ctx, case.heads, case.kv_heads, case.head_size
    q = torch.from_dlpack(a["query"]).view(b, ql, h, hs).transpose(1, 2).contiguous()
    bt = torch.from_dlpack(a["block_tables"]).long()
    pos = torch.arange(ctx, device=q.device)
    blocks = bt[:, pos // case.block_size]  # [b, ctx]
    k = torch.from_dlpack(a["key_cache"])[blocks, pos % case.block_size]  # [b, ctx, kvh, hs]
    v = torch.from_dlpack(a["value_cache"])[blocks, pos % case.block_size]
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    mask = None
    if case.causal and ql != ctx:
        if backend == "flash":
            raise NotImplementedError("SDPA's flash backend takes no bottom-right mask")
        qpos = torch.arange(ctx - ql, ctx, device=q.device)
        mask = (pos[None, :] <= qpos[:, None])[None, None]
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run():
        with sdpa_kernel([chosen]):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=case.causal and mask is None,
                enable_gqa=kvh != h)

    def run_checked():
        o = run()
        return cupy.from_dlpack(o.transpose(1, 2).reshape(b * ql, h, hs).contiguous())

    run_checked.timed = run
    return run_checked


_CUPAGED = ("cupaged", "cupaged-mma", "cupaged-sm90", "cupaged-fp8q")
IMPLEMENTATIONS = {
    "cupaged": _run_cupaged,
    "cupaged-mma": lambda c: _run_cupaged(c, "mma"),
    "cupaged-sm90": lambda c: _run_cupaged(c, "sm90"),
    "cupaged-fp8q": _run_cupaged_fp8_query,
    "flashinfer-fa2": lambda c: _run_flashinfer(c, "fa2"),
    "flashinfer-fa3": lambda c: _run_flashinfer(c, "fa3"),
    "torch-sdpa-flash": lambda c: _run_sdpa(c, "flash"),
    "torch-sdpa-cudnn": lambda c: _run_sdpa(c, "cudnn"),
}


@dataclass
class Row:
    case: str
    impl: str
    median_us: float
    tflops: float
    pct_copy: float  # K/V bytes once / time, against the copy bandwidth
    error: float
    note: str = ""


def measure(cases, impls, reps: int = 20, copy_bw: float | None = None):
    """Rows for every (case, implementation): a runner that cannot run gets a note."""
    from .. import planning

    rows = []
    for case in cases:
        case.build()
        for impl in impls:
            try:
                run = IMPLEMENTATIONS[impl](case)
                err = case.check(run(), query=getattr(run, "reference_query", None))
                timed = getattr(run, "timed", run)
                t = timing.time_us(timed, reps=reps)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is a row note
                rows.append(Row(case.name, impl, math.nan, math.nan, math.nan, math.nan,
                                " ".join(f"{type(e).__name__}: {e}".split())[:120]))
                continue
            finally:
                if impl in _CUPAGED:  # back to the planner's choice of kernel
                    planning.set_prefill_family(None)
            tol = getattr(run, "tolerance", None) or \
                testing.TOLERANCE["f16" if case.dtype == "float16" else "bf16"]
            tflops = case.flops() / (t.median_us * 1e-6) / 1e12
            pct = 100 * case.kv_bytes() / (t.median_us * 1e-6) / copy_bw if copy_bw else math.nan
            rows.append(Row(case.name, impl, t.median_us, tflops, pct, err,
                            "" if err <= 4 * tol else "WRONG"))
        case.arrays.clear()
        case.variant_arrays.clear()
        cupy.get_default_memory_pool().free_all_blocks()
    return rows
