"""Measurement helpers for cupaged-bench: CUDA-event timing with the L2 flushed between
runs, the device's copy bandwidth, and decode workloads (with attention variants: a
window, a soft cap, sinks, ALiBi) checked against the reference."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field

import cupy
import numpy as np

from . import _dtypes, decode, reference, testing


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    runs: int


class _L2Flusher:
    """Writes a buffer twice the L2's size, so each timed run starts with a cold cache."""

    def __init__(self):
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.buf = cupy.empty(max(2 * props["l2CacheSize"], 1 << 20), dtype=np.uint8)

    def __call__(self):
        self.buf.fill(0)


class _Spin:
    """Busy-waits the GPU (cuda_src/bench_spin.cu), so the host has enqueued a timed run
    before its start event fires: the events then bracket device time only, however
    long the call's host side takes."""

    def __init__(self, us: float):
        from . import jit

        src = (jit.source_dir() / "bench_spin.cu").read_text()
        self.kernel = cupy.RawModule(code=src).get_function("cupaged_spin")
        self.ns = np.uint64(us * 1000)

    def __call__(self):
        self.kernel((1,), (1,), (self.ns,))


def time_us(fn, *, warmup: int = 3, reps: int = 30, flush_l2: bool = True,
            cover_host_us: float = 300.0) -> Timing:
    """Time ``fn()`` (device work on the current stream) with CUDA events, one pair per
    run, the L2 flushed before each run outside the timed region. A GPU busy-wait of
    ``cover_host_us`` precedes each run (0: none), so host-side launch time stays
    outside the measurement as long as one call's host side takes less than that."""
    flush = _L2Flusher() if flush_l2 else (lambda: None)
    spin = _Spin(cover_host_us) if cover_host_us > 0 else (lambda: None)
    for _ in range(warmup):
        fn()
    starts = [cupy.cuda.Event() for _ in range(reps)]
    ends = [cupy.cuda.Event() for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush()
        spin()
        s.record()
        fn()
        e.record()
    ends[-1].synchronize()
    t = np.array([cupy.cuda.get_elapsed_time(s, e) * 1e3 for s, e in zip(starts, ends)])
    return Timing(float(np.median(t)), float(np.percentile(t, 10)), float(np.percentile(t, 90)),
                  reps)


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written
    (the roofline every memory-bound kernel is measured against)."""
    a = cupy.ones(nbytes // 4, dtype=np.float32)
    b = cupy.empty_like(a)
    t = time_us(lambda: b.__setitem__(Ellipsis, a), warmup=3, reps=reps, flush_l2=False,
                cover_host_us=0)
    return 2 * nbytes / (t.median_us * 1e-6)


# ---- fp8 caches ------------------------------------------------------------------------------

# What `--kv-cache-dtype` takes: "auto" (the query's 16-bit type), or fp8 ("fp8" is e4m3).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# Per-tensor scales of the fp8 cases: their random bit patterns are log-uniform in
# magnitude, RMS about 100 (e4m3) and 9500 (e5m2); these scales bring it near 1, as the
# 16-bit cases' standard normal values, so softmax is as peaked in both.
FP8_SCALES = {"fp8_e4m3": 0.01, "fp8_e5m2": 1e-4}
# Magnitude bytes below these are finite: e4m3's 0x7F is NaN, e5m2's 0x7C..0x7F Inf and NaN.
_FP8_FINITE = {"fp8_e4m3": 0x7F, "fp8_e5m2": 0x7C}


def kv_cache_dtype_name(name) -> str:
    """The canonical spelling of a ``kv_cache_dtype``: ``"auto"``, ``"fp8_e4m3"`` (also
    for ``"fp8"``) or ``"fp8_e5m2"``; ValueError for anything else."""
    fmt = _dtypes.kv_cache_format(name)
    return "auto" if fmt is None else f"fp8_{fmt.name}"


def random_fp8(shape, kv_cache_dtype: str, rng: np.random.Generator, xp=np):
    """uint8 bit patterns of random finite fp8 values of ``kv_cache_dtype`` ("fp8_e4m3"
    or "fp8_e5m2"), every finite pattern of either sign equally likely; ``xp`` is numpy or
    cupy (generated on that side, like testing.random_normal)."""
    n = _FP8_FINITE[kv_cache_dtype_name(kv_cache_dtype)]
    if xp is np:
        b = rng.integers(0, 2 * n, shape, dtype=np.uint8)
    else:  # float32 uniforms scaled in place: 5 bytes per element at most
        u = xp.random.default_rng(int(rng.integers(2**31))).random(shape, dtype=np.float32)
        u *= 2 * n
        b = xp.minimum(u, 2 * n - 1, out=u).astype(np.uint8)
        del u
    # [0, n): positive magnitudes; [n, 2n): the same magnitudes with the sign bit set
    return xp.where(b < n, b, b + np.uint8(0x80 - n)).astype(np.uint8)


# ---- attention variants ---------------------------------------------------------------------

SINK_SEED = 1234  # the --sinks values: np.random.default_rng(SINK_SEED), one per head


def sink_values(num_heads: int) -> np.ndarray:
    """The benchmarks' attention sinks: float32 ``[num_heads]`` standard normal values
    (natural-log units, as the logits), the same for every run (seed SINK_SEED)."""
    return np.random.default_rng(SINK_SEED).standard_normal(num_heads).astype(np.float32)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's slopes, float32 ``[num_heads]``: for n heads a power of two, ``2^(-8 i / n)``
    for i = 1..n; for other n, those of the largest power of two p below n, then the odd
    powers 1, 3, 5, ... of ``2^(-4 / p)`` (the slopes of 2p heads not already taken)."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    p = 1 << (num_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * i / p) for i in range(1, p + 1)]
    slopes += [2.0 ** (-4.0 * i / p) for i in range(1, 2 * (num_heads - p), 2)]
    return np.array(slopes, np.float32)


def visible_tokens(context_lens, window=None) -> int:
    """Keys one decode query per sequence sees: ``sum(min(context, window))`` (every
    context token without a window). The bytes-moved roofline counts only these."""
    lens = np.asarray(context_lens, dtype=np.int64)
    if window is not None:
        lens = np.minimum(lens, int(window))
    return int(lens.sum())


@dataclass(frozen=True)
class Variants:
    """The attention variants a benchmark runs, all off by default: a sliding ``window``
    of W tokens (a query at position p sees keys in (p - W, p]; FlashInfer's window_left
    is W - 1), a logits ``soft_cap`` c (``c * tanh(logit / c)``), per-head attention
    ``sinks`` (:func:`sink_values`) and ``alibi`` (:func:`alibi_slopes`). ValueError for
    a window below 1 or a cap that is not a positive finite float32."""

    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    alibi: bool = False

    def __post_init__(self):
        w, c = self.window, self.soft_cap
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
                raise ValueError(f"window must be an int, got {w!r}")
            if w < 1:
                raise ValueError(f"window must be at least 1 (a query at position p sees the "
                                 f"keys in (p - window, p]), got {w}")
            object.__setattr__(self, "window", int(w))
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, (int, float, np.integer, np.floating)):
                raise ValueError(f"soft cap must be a number, got {c!r}")
            if not (math.isfinite(c) and 0 < c <= 1e37):
                raise ValueError(f"soft cap must be a positive finite number (logits become "
                                 f"c * tanh(logit / c)), got {c}")
            object.__setattr__(self, "soft_cap", float(c))
        object.__setattr__(self, "sinks", bool(self.sinks))
        object.__setattr__(self, "alibi", bool(self.alibi))

    @property
    def plain(self) -> bool:
        return self.window is None and self.soft_cap is None and not self.sinks and not self.alibi

    def label(self) -> str:
        """``"window 512, soft-cap 50, sinks, ALiBi"`` (the ones set; "" for none)."""
        parts = []
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.soft_cap is not None:
            parts.append(f"soft-cap {self.soft_cap:g}")
        if self.sinks:
            parts.append("sinks")
        if self.alibi:
            parts.append("ALiBi")
        return ", ".join(parts)

    def describe(self) -> str:
        """One line for the output, with each variant's convention ("" for none)."""
        parts = []
        if self.window is not None:
            parts.append(f"window {self.window} (FlashInfer's window_left {self.window - 1}; "
                         f"bytes and FLOPs count only the keys inside it)")
        if self.soft_cap is not None:
            parts.append(f"soft-cap {self.soft_cap:g}")
        if self.sinks:
            parts.append(f"sinks (standard normal per head, seed {SINK_SEED})")
        if self.alibi:
            parts.append("ALiBi (the standard slopes of the head count)")
        return ", ".join(parts)

    def fields(self) -> dict:
        """The Result / JSON / CSV fields: window, soft_cap (None: off), sinks, alibi."""
        return dict(window=self.window, soft_cap=self.soft_cap, sinks=self.sinks,
                    alibi=self.alibi)

    def letters(self) -> str:
        """The compile-time variant letters of the decode kernel these variants launch
        (the multi-token kernel adds ``a`` for ALiBi)."""
        from . import _variants

        return _variants.letters(self.window or 0, self.soft_cap or 0.0, ())

    def device_arrays(self, num_heads: int) -> dict:
        """``sinks`` and ``alibi_slopes`` as float32 device arrays (those set)."""
        a = {}
        if self.sinks:
            a["sinks"] = cupy.asarray(sink_values(num_heads))
        if self.alibi:
            a["alibi_slopes"] = cupy.asarray(alibi_slopes(num_heads))
        return a

    def _args(self, sinks, slopes) -> dict:
        kw = dict(window=self.window, logits_soft_cap=self.soft_cap, sinks=sinks,
                  alibi_slopes=slopes)
        return {k: v for k, v in kw.items() if v is not None}

    def kernel_args(self, arrays: dict) -> dict:
        """What cupaged.attention / paged_attention take (nothing for plain attention);
        ``arrays``: what device_arrays made."""
        return self._args(arrays["sinks"] if self.sinks else None,
                          arrays["alibi_slopes"] if self.alibi else None)

    def reference_args(self, num_heads: int) -> dict:
        """The same for cupaged.reference (host arrays)."""
        return self._args(sink_values(num_heads) if self.sinks else None,
                          alibi_slopes(num_heads) if self.alibi else None)


PLAIN = Variants()


@dataclass
class DecodeCase:
    """One decode workload: a random paged cache on the device, sequences scattered.
    ``kv_cache_dtype`` "auto": caches of ``dtype``; "fp8_e4m3" / "fp8_e5m2": uint8 caches
    of random finite fp8 values with per-tensor scales (FP8_SCALES). ``variants``: the
    attention variants every cupaged run and the reference check use."""

    batch: int
    context_lens: np.ndarray  # int32 [batch]
    heads: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: np.dtype
    seed: int = 0
    kv_cache_dtype: str = "auto"
    variants: Variants = PLAIN
    arrays: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.kv_cache_dtype = kv_cache_dtype_name(self.kv_cache_dtype)

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def k_scale(self) -> float:
        return FP8_SCALES.get(self.kv_cache_dtype, 1.0)

    @property
    def v_scale(self) -> float:
        return FP8_SCALES.get(self.kv_cache_dtype, 1.0)

    @property
    def kv_args(self) -> dict:
        """What the kernels and the reference take about the cache (nothing for 16 bits)."""
        if not self.fp8:
            return {}
        return dict(kv_cache_dtype=self.kv_cache_dtype, k_scale=self.k_scale,
                    v_scale=self.v_scale)

    @property
    def variant_args(self) -> dict:
        """The variants as the kernels take them (nothing for plain attention)."""
        return self.variants.kernel_args(self.arrays)

    @property
    def kv_bytes(self) -> int:
        """K and V of the keys a query sees, once per KV head: every context token, or
        with a window min(context, window) per sequence (visible_tokens)."""
        it = 1 if self.fp8 else self.dtype.itemsize
        tokens = visible_tokens(self.context_lens, self.variants.window)
        return tokens * self.kv_heads * self.head_size * it * 2

    @property
    def bytes_moved(self) -> int:
        """The K and V of every key a query sees once per KV head (kv_bytes), plus q and
        out."""
        return self.kv_bytes + 2 * self.batch * self.heads * self.head_size * self.dtype.itemsize

    def build(self) -> "DecodeCase":
        rng = np.random.default_rng(self.seed)
        bt, nb = testing.random_block_tables(self.context_lens, self.block_size, rng)
        if self.fp8:  # vLLM's layouts as testing.random_cache makes them, x = 16 bytes
            kc = random_fp8((nb, self.kv_heads, self.head_size // 16, self.block_size, 16),
                            self.kv_cache_dtype, rng, cupy)
            vc = random_fp8((nb, self.kv_heads, self.head_size, self.block_size),
                            self.kv_cache_dtype, rng, cupy)
        else:
            kc, vc = testing.random_cache(nb, self.kv_heads, self.head_size, self.block_size,
                                          self.dtype, rng, xp=cupy)
        q = testing.random_normal((self.batch, self.heads, self.head_size), self.dtype, rng, cupy)
        self.arrays = dict(query=q, key_cache=kc, value_cache=vc, block_tables=cupy.asarray(bt),
                           context_lens=cupy.asarray(self.context_lens.astype(np.int32)),
                           **self.variants.device_arrays(self.heads))
        return self

    def run(self, out=None, partition="auto"):
        a = self.arrays
        kw = a.get("_call_keywords")
        if kw is None:  # built once: the overhead rows time the library, not this harness
            kw = a["_call_keywords"] = dict(
                max_context_len=int(self.context_lens.max(initial=0)), **self.kv_args,
                **self.variant_args)
        return decode.paged_attention(a["query"], a["key_cache"], a["value_cache"],
                                      a["block_tables"], a["context_lens"], out=out,
                                      partition=partition, **kw)

    def check(self, out, max_seqs: int = 8, seed: int = 1) -> float:
        """||out - ref|| / ||ref|| over up to ``max_seqs`` sequences (chosen at random),
        computed in float64 from just those sequences' blocks (once per case), with the
        case's variants; an fp8 cache is read as the kernels read it, ``stored * scale``."""
        a = self.arrays
        if "_refs" not in a:
            rng = np.random.default_rng(seed)
            seqs = rng.choice(self.batch, size=min(max_seqs, self.batch), replace=False)
            refs = []
            for s in seqs:
                n = int(self.context_lens[s])
                blocks = a["block_tables"][s, : -(-n // self.block_size)]
                refs.append((s, reference.paged_attention(
                    cupy.asnumpy(a["query"][s: s + 1]), cupy.asnumpy(a["key_cache"][blocks]),
                    cupy.asnumpy(a["value_cache"][blocks]),
                    np.arange(blocks.size, dtype=np.int32)[None, :], np.array([n], np.int32),
                    **self.kv_args, **self.variants.reference_args(self.heads))))
            a["_refs"] = refs
        num = den = 0.0
        for s, ref in a["_refs"]:
            got = cupy.asnumpy(out[s: s + 1]).astype(np.float64)
            num += float(np.sum((got - ref) ** 2))
            den += float(np.sum(ref ** 2))
        return math.sqrt(num / den) if den > 0 else math.sqrt(num)

    def tolerance(self) -> float:
        """The query type's: attention reads exactly what an fp8 cache stores, so the
        reference over the same bytes is as close as over a 16-bit cache."""
        return testing.TOLERANCE[_dtypes.lookup(self.dtype).name]

    def spec_name(self) -> str:
        """The decode specialization ``run()`` launches: for fp8, the cache's format as
        _kvquant.cache_dtype names it and per-tensor scales (_kvquant.scales' mode ""); the
        window and soft-cap variants' letters (sinks and ALiBi are run-time arguments)."""
        dev = decode._device(cupy.cuda.Device().id)
        gt = decode._group_tile(self.heads // self.kv_heads)
        cache = _dtypes.KV_CACHE_DTYPES[self.kv_cache_dtype].name if self.fp8 else ""
        return decode._decode_spec(dev.arch, _dtypes.lookup(self.dtype).name, self.head_size,
                                      self.block_size, gt, cache_dtype=cache, kv_scale="",
                                      variant=self.variants.letters()).name


# ---- workloads -------------------------------------------------------------------------------

# (heads, kv_heads, head_size) of common models' attention layers.
PRESETS = {
    "llama-3-8b": (32, 8, 128),
    "llama-3-70b-tp8": (8, 1, 128),  # 64 q / 8 kv heads split over 8 GPUs
    "mistral-7b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "llama-2-7b": (32, 32, 128),  # MHA
}


def parse_context_dist(spec: str):
    """'uniform:LO:HI' -> (lo, hi); raises ValueError otherwise."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "uniform":
        raise ValueError(f"expected uniform:LO:HI, got {spec!r}")
    lo, hi = int(parts[1]), int(parts[2])
    if not 0 <= lo <= hi:
        raise ValueError(f"expected 0 <= LO <= HI in {spec!r}")
    return lo, hi


@dataclass(frozen=True)
class Workload:
    """One decode shape: a batch with a fixed context length or a uniform distribution,
    over a cache of the query's type or of fp8 (``kv_cache_dtype``, as DecodeCase), with
    attention ``variants`` (plain by default)."""

    batch: int
    context: int | tuple  # tokens, or (lo, hi) for uniform lengths
    heads: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: str  # numpy name
    preset: str = ""
    kv_cache_dtype: str = "auto"  # "auto", "fp8_e4m3" or "fp8_e5m2" ("fp8": e4m3)
    variants: Variants = PLAIN

    def __post_init__(self):
        object.__setattr__(self, "kv_cache_dtype", kv_cache_dtype_name(self.kv_cache_dtype))

    @property
    def context_label(self) -> str:
        c = self.context
        return str(c) if isinstance(c, int) else f"U{c[0]}-{c[1]}"

    def lengths(self, seed: int) -> np.ndarray:
        if isinstance(self.context, int):
            return np.full(self.batch, self.context, np.int32)
        lo, hi = self.context
        return np.random.default_rng(seed).integers(lo, hi + 1, self.batch).astype(np.int32)

    def case(self, seed: int) -> "DecodeCase":
        return DecodeCase(self.batch, self.lengths(seed), self.heads, self.kv_heads,
                          self.head_size, self.block_size, _dtypes.parse(self.dtype).numpy, seed,
                          self.kv_cache_dtype, self.variants)


@dataclass
class Result:
    """One timed (or failed, or skipped) row."""

    impl: str
    kernel: str
    preset: str
    batch: int
    context: str
    mean_context: float
    heads: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    partition: str
    status: str  # "ok" | "failed" | "skipped"
    median_us: float = float("nan")
    p10_us: float = float("nan")
    p90_us: float = float("nan")
    gbps: float = float("nan")
    pct_copy: float = float("nan")
    rel_err: float = float("nan")
    ratio_to_cupaged: float = float("nan")  # this time / cupaged's time (compare)
    plan_us: float = float("nan")  # host time of one FlashInfer plan() (NaN for the rest)
    note: str = ""
    kv_cache_dtype: str = "auto"  # the cache's: "auto" (dtype), "fp8_e4m3" or "fp8_e5m2"
    window: int | None = None  # the variants run (Variants.fields); None / False: off
    soft_cap: float | None = None
    sinks: bool = False
    alibi: bool = False


def _oom_errors():
    errs = [cupy.cuda.memory.OutOfMemoryError]
    torch = _torch()
    if torch is not None:
        errs.append(torch.OutOfMemoryError)
    return tuple(errs)


def _free_memory():
    cupy.get_default_memory_pool().free_all_blocks()
    torch = _torch()
    if torch is not None:
        torch.cuda.empty_cache()


def call_in_nvtx_range(fn, warmup: int = 3, name: str = "timed"):
    """Call ``fn`` ``warmup`` times, then once more inside the NVTX range ``name``, with
    the device idle on both sides: the one call the Nsight Compute scripts in tools/
    profile (``ncu --nvtx --nvtx-include timed/``)."""
    for _ in range(warmup):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.nvtx.RangePush(name)
    fn()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.nvtx.RangePop()


def _torch():
    """torch, if importable and it sees a GPU; never required."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_fp8(kv_cache_dtype: str):
    """torch's float8 type of an fp8 format ("fp8_e4m3" or "fp8_e5m2")."""
    torch = _torch()
    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]


def _torch_on_cupy_stream():
    """Make torch's current stream CuPy's current one, where time_us records its events
    and the checks read, so the torch and FlashInfer rows (which run on torch's current
    stream) are timed where they run. Nothing to do in the usual case: both default to
    the legacy default stream."""
    torch = _torch()
    ptr = cupy.cuda.get_current_stream().ptr
    if torch is None or torch.cuda.current_stream().cuda_stream == ptr:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(ptr))


# ---- implementations compared ----------------------------------------------------------------

# Peers with no fp8 cache path: they would time a dequantizing copy, not attention.
_NO_FP8 = ("cupy-gather", "torch-sdpa-paged", "torch-sdpa-dense")


def fp8_unsupported(impl: str, kv_cache_dtype: str = "auto") -> str | None:
    """Why ``impl`` cannot run over a ``kv_cache_dtype`` cache (one line), or None."""
    kv = kv_cache_dtype_name(kv_cache_dtype)
    if kv == "auto":
        return None
    if impl in _NO_FP8:
        return f"{impl} has no fp8 cache path (it gathers 16-bit pages)"
    if impl == "flashinfer-xqa" and kv != "fp8_e4m3":
        return "FlashInfer's XQA takes fp8 e4m3 caches only"
    return None


# The peers run with some variants, and the arguments those go to; every other peer (the
# gather baselines, torch SDPA) runs plain softmax attention only.
_PEER_VARIANTS = {
    "flashinfer-decode": {"window": "window_left", "soft_cap": "logits_soft_cap"},
    "flashinfer-decode-tc": {"window": "window_left", "soft_cap": "logits_soft_cap"},
    "flashinfer-xqa": {"window": "window_left", "sinks": "sinks"},
}
_VARIANT_LABELS = {"window": "window", "soft_cap": "soft-cap", "sinks": "sinks", "alibi": "ALiBi"}


def variant_unsupported(impl: str, variants: Variants = PLAIN) -> str | None:
    """Why ``impl`` cannot run ``variants`` (one line), or None. cupaged runs them all;
    FlashInfer's decode wrappers get a window (``window_left = W - 1``) and a soft cap
    through plan(), its XQA kernel a window and sinks; their other variant paths are not
    wired up here."""
    if impl.startswith("cupaged"):
        return None
    return peer_refusal(impl, _PEER_VARIANTS.get(impl), variants)


def peer_refusal(impl: str, takes: dict | None, variants: Variants) -> str | None:
    """Why peer ``impl``, run with the variants ``takes`` maps to its arguments (None: it
    runs plain attention only), cannot run ``variants`` (one line), or None."""
    if variants.plain:
        return None
    if takes is None:
        return f"{impl} runs plain attention only (asked for: {variants.label()})"
    asked = {k for k, v in variants.fields().items() if v not in (None, False)}
    missing = [label for k, label in _VARIANT_LABELS.items() if k in asked and k not in takes]
    if missing:
        return (f"{impl} is run with {' and '.join(takes.values())} only, not "
                f"{' or '.join(missing)}")
    return None


def unsupported(impl: str, kv_cache_dtype: str = "auto", variants: Variants = PLAIN) -> str | None:
    """Why ``impl`` cannot run over this cache with these variants, or None."""
    return fp8_unsupported(impl, kv_cache_dtype) or variant_unsupported(impl, variants)


def _require_supported(case: "DecodeCase", impl: str) -> None:
    why = unsupported(impl, case.kv_cache_dtype, case.variants)
    if why:
        raise NotImplementedError(why)


def _run_cupaged(case: "DecodeCase", partition):
    out = cupy.empty(case.arrays["query"].shape, case.arrays["query"].dtype)
    return lambda: case.run(out, partition)


def cache_in_layout(key_cache, value_cache, layout: str):
    """Contiguous copies of vLLM-layout caches ([blocks, kv_heads, hs/x, bs, x] and
    [blocks, kv_heads, hs, bs]) in ``layout``: "NHD", "HND", or "vllm" (themselves)."""
    if layout == "vllm":
        return key_cache, value_cache
    k, v = key_cache, value_cache
    nb, kvh, _, bs, _ = k.shape
    if layout == "NHD":
        k = k.transpose(0, 3, 1, 2, 4).reshape(nb, bs, kvh, -1)
        v = v.transpose(0, 3, 1, 2)
    else:
        k = k.transpose(0, 1, 3, 2, 4).reshape(nb, kvh, bs, -1)
        v = v.transpose(0, 1, 3, 2)
    return cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)


def _run_cupaged_layout(case: "DecodeCase", partition, layout: str):
    """cupaged.attention (decode: no query_start_loc) on a copy of the case's cache in
    ``layout`` ("NHD" or "HND"), made once outside timing."""
    from .varlen import attention

    a = case.arrays
    k, v = cache_in_layout(a["key_cache"], a["value_cache"], layout)
    out = cupy.empty(a["query"].shape, a["query"].dtype)
    max_len = int(case.context_lens.max(initial=0))
    return lambda: attention(a["query"], k, v, a["block_tables"], a["context_lens"],
                             kv_layout=layout, max_seq_len=max_len, out=out, **case.kv_args,
                             **case.variant_args)


def _gather_dense(case: "DecodeCase"):
    """Index arrays for gathering each sequence's pages into [S, kv_heads, T, hs] (block
    ids past a sequence's end replaced by 0 so every gather stays inside the cache)."""
    a = case.arrays
    nb = a["block_tables"].shape[1]
    valid = cupy.arange(nb)[None, :] < cupy.asarray(-(-case.context_lens // case.block_size))[:, None]
    return cupy.where(valid, a["block_tables"], 0), nb * case.block_size


def _run_cupy_gather(case: "DecodeCase", partition):
    """What a user writes by hand: gather the pages, then matmul / softmax / matmul."""
    _require_supported(case, "cupy-gather")
    a = case.arrays
    s, h, hs = a["query"].shape
    kvh, g = case.kv_heads, case.heads // case.kv_heads
    bt, t = _gather_dense(case)
    mask = (cupy.arange(t)[None, :] < a["context_lens"][:, None])[:, None, None, :]
    compute = np.float32 if case.dtype == _dtypes.BF16.numpy else case.dtype
    scale = 1.0 / math.sqrt(hs)

    def run():
        k = a["key_cache"][bt].transpose(0, 2, 1, 4, 3, 5).reshape(s, kvh, t, hs).astype(compute)
        v = a["value_cache"][bt].transpose(0, 2, 1, 4, 3).reshape(s, kvh, t, hs).astype(compute)
        q = a["query"].reshape(s, kvh, g, hs).astype(compute)
        logits = cupy.matmul(q, k.transpose(0, 1, 3, 2)).astype(np.float32) * scale
        logits = cupy.where(mask, logits, -cupy.inf)
        logits -= logits.max(axis=-1, keepdims=True)
        p = cupy.exp(logits)
        p /= p.sum(axis=-1, keepdims=True)
        return cupy.matmul(p.astype(compute), v).reshape(s, h, hs).astype(case.dtype)

    return run


def _torch_inputs(case: "DecodeCase"):
    torch = _torch()
    a = case.arrays
    s, h, hs = a["query"].shape
    bt, t = _gather_dense(case)
    lens = torch.from_dlpack(a["context_lens"])
    mask = None
    if int(case.context_lens.min()) != t:  # padded keys must be masked out
        mask = (torch.arange(t, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]
    q = torch.from_dlpack(a["query"]).reshape(s, h, 1, hs)
    return torch, q, torch.from_dlpack(bt).long(), t, mask


def _to_hnd(key, value):
    """vLLM-layout pages as views in FlashInfer's "HND" order (no copy; NumPy, CuPy or
    torch): key ``[..., kv_heads, head_size // x, block_size, x]`` ->
    ``[..., kv_heads, block_size, head_size // x, x]`` (its last two dims then reshape to
    head_size, which copies), value ``[..., kv_heads, head_size, block_size]`` ->
    ``[..., kv_heads, block_size, head_size]``."""
    return key.swapaxes(-3, -2), value.swapaxes(-2, -1)


def _torch_gather(case, torch, bt, t):
    """Each sequence's pages gathered into K and V ``[S, kv_heads, T, head_size]``."""
    a = case.arrays
    s, kvh, hs = case.batch, case.kv_heads, case.head_size
    k, v = _to_hnd(torch.from_dlpack(a["key_cache"])[bt], torch.from_dlpack(a["value_cache"])[bt])
    # [S, pages, kv_heads, block_size, ...] -> [S, kv_heads, pages * block_size, head_size]
    return k.swapaxes(1, 2).reshape(s, kvh, t, hs), v.swapaxes(1, 2).reshape(s, kvh, t, hs)


def _run_torch_paged(case: "DecodeCase", partition):
    """torch SDPA after gathering the pages (paging handled by indexing)."""
    _require_supported(case, "torch-sdpa-paged")
    torch, q, bt, t, mask = _torch_inputs(case)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        k, v = _torch_gather(case, torch, bt, t)
        o = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        return cupy.from_dlpack(o.reshape(case.batch, case.heads, case.head_size))

    return run


def _run_torch_dense(case: "DecodeCase", partition):
    """torch SDPA over contiguous K/V built beforehand: no paging at all."""
    _require_supported(case, "torch-sdpa-dense")
    torch, q, bt, t, mask = _torch_inputs(case)
    k, v = (x.contiguous() for x in _torch_gather(case, torch, bt, t))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        o = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        return cupy.from_dlpack(o.reshape(case.batch, case.heads, case.head_size))

    return run


# ---- FlashInfer (optional: imported only when a FlashInfer row is asked for or listed) ----------

_FLASHINFER_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended size, zeroed before first use


def flashinfer_unavailable() -> str | None:
    """Why the FlashInfer rows cannot run here (one line), or None when they can:
    ``flashinfer`` must import and torch must see a GPU."""
    return _flashinfer()[1]


def _flashinfer():
    """``(flashinfer, None)``, or ``(None, why)``."""
    try:
        import flashinfer
    except ImportError as e:  # not installed, or a dependency of it missing
        return None, str(e) if e.name == "flashinfer" else f"import flashinfer: {e}"
    except Exception as e:  # a broken install can fail at import in other ways
        return None, " ".join(f"{type(e).__name__}: {e}".split())[:200]
    if _torch() is None:
        return None, "torch sees no CUDA device"
    return flashinfer, None


def _require_flashinfer():
    flashinfer, why = _flashinfer()
    if flashinfer is None:
        raise RuntimeError(f"flashinfer unavailable: {why}")
    return flashinfer


def _flashinfer_pages(block_tables, context_lens, block_size: int):
    """Block tables and lengths as FlashInfer's page lists (NumPy in, NumPy out):
    ``indptr`` int32 ``[S + 1]`` (sequence s owns ``indices[indptr[s]:indptr[s + 1]]``),
    ``indices`` int32 (each sequence's first ``ceil(len / block_size)`` block ids, in
    order) and ``last_page_len`` int32 ``[S]``, the tokens in each sequence's last page,
    ``1..block_size``. A length-0 sequence gets no pages and ``last_page_len`` 0:
    FlashInfer documents ``1 <= last_page_len <= page_size``, but both its
    ``get_seq_lens`` and its kernels (``paged_kv_t::get_length``: no pages, length 0)
    take that as an empty sequence."""
    bt = np.asarray(block_tables)
    lens = np.asarray(context_lens, dtype=np.int64)
    if bt.ndim != 2 or lens.shape != (bt.shape[0],):
        raise ValueError(f"expected block_tables [S, max_blocks] and context_lens [S], got "
                         f"{bt.shape} and {lens.shape}")
    if (lens < 0).any():
        raise ValueError("context_lens must be non-negative")
    pages = -(-lens // block_size)
    if pages.max(initial=0) > bt.shape[1]:
        raise ValueError(f"block_tables has {bt.shape[1]} columns, a sequence needs "
                         f"{int(pages.max())} blocks of {block_size}")
    indptr = np.zeros(len(lens) + 1, np.int32)
    indptr[1:] = np.cumsum(pages)
    indices = bt[np.arange(bt.shape[1])[None, :] < pages[:, None]].astype(np.int32)
    last_page_len = np.where(pages > 0, lens - (pages - 1) * block_size, 0).astype(np.int32)
    return indptr, indices, last_page_len


@dataclass
class _FlashInferInputs:
    """One case's data as FlashInfer takes it, built once outside timing."""

    q: object  # torch view of the case's query [S, heads, head_size]
    out: object  # [S, heads, head_size], NaN until a kernel writes it
    out_cupy: object  # the same memory as a CuPy array, for DecodeCase.check
    k: object  # "HND" copy of the key cache [num_blocks, kv_heads, block_size, head_size]
    v: object  # "HND" copy of the value cache, same shape
    # plan()'s page lists (_flashinfer_pages), where vLLM keeps them: indptr and
    # last_page_len in pinned host memory, indices on the device
    indptr: object
    indices: object
    last_page_len: object
    block_tables: object  # XQA's: int32 [S, max_blocks], ids past a sequence's end 0
    seq_lens: object  # XQA's: int32 [S] on the device (the case's context_lens)
    workspace: object  # zeroed uint8, both kernels' scratch
    scale: float  # 1 / sqrt(head_size), cupaged's and the reference's default
    kv_scales: dict  # the decode wrappers' run() k_scale / v_scale (none for 16 bits)


def _flashinfer_inputs(case: "DecodeCase") -> _FlashInferInputs:
    """The case's query, lengths and tables viewed as torch tensors, its caches copied
    into FlashInfer's "HND" layout (an out-of-memory here skips the row; fp8 bytes viewed
    as torch's float8 type of the format), and its block tables as FlashInfer's page
    lists. The output is poisoned with NaN, so a kernel that writes nothing fails the
    check instead of finding an earlier row's result."""
    torch = _torch()
    a = case.arrays
    q = torch.from_dlpack(a["query"])
    k, v = _to_hnd(torch.from_dlpack(a["key_cache"]), torch.from_dlpack(a["value_cache"]))
    k, v = k.contiguous().view(v.shape), v.contiguous()
    kv_scales = {}
    if case.fp8:
        k, v = (x.view(_torch_fp8(case.kv_cache_dtype)) for x in (k, v))
        kv_scales = dict(k_scale=case.k_scale, v_scale=case.v_scale)
    indptr, indices, last = _flashinfer_pages(cupy.asnumpy(a["block_tables"]), case.context_lens,
                                              case.block_size)
    tables, _ = _gather_dense(case)
    out = torch.full_like(q, float("nan"))
    return _FlashInferInputs(
        q=q, out=out, out_cupy=cupy.from_dlpack(out), k=k, v=v,
        indptr=torch.from_numpy(indptr).pin_memory(),
        indices=torch.from_numpy(indices).to(q.device),
        last_page_len=torch.from_numpy(last).pin_memory(),
        block_tables=torch.from_dlpack(cupy.ascontiguousarray(tables, dtype=np.int32)),
        seq_lens=torch.from_dlpack(a["context_lens"]),
        workspace=torch.zeros(_FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device),
        scale=1.0 / math.sqrt(case.head_size), kv_scales=kv_scales)


def _plan_host_us(plan, calls: int = 5) -> float:
    """Median host microseconds of ``plan()`` over ``calls`` calls, each after a device
    sync. A first call beforehand builds FlashInfer's module (nvcc, on first use) or
    loads it, outside every timing."""
    import time

    torch = _torch()
    plan()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return float(np.median(times)) * 1e6


def _run_flashinfer_decode(case: "DecodeCase", partition, tensor_cores: bool = False):
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper on "HND" caches, on CUDA cores or
    tensor cores. plan() runs once per workload, as once per step for all layers in a
    model; its host time is the runner's ``plan_us``. The timed call is run() (over fp8,
    with k_scale and v_scale: FlashInfer folds k_scale into the softmax scale and
    multiplies the output by v_scale in a launch of its own, timed as part of run()).
    A window goes to plan() as ``window_left = W - 1``, a soft cap as ``logits_soft_cap``;
    sinks and ALiBi are refused (variant_unsupported)."""
    flashinfer = _require_flashinfer()
    _require_supported(case, "flashinfer-decode-tc" if tensor_cores else "flashinfer-decode")
    fi = _flashinfer_inputs(case)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(fi.workspace, "HND",
                                                           use_tensor_cores=tensor_cores)
    variants = {}
    if case.variants.window is not None:
        variants["window_left"] = case.variants.window - 1
    if case.variants.soft_cap is not None:
        variants["logits_soft_cap"] = case.variants.soft_cap

    def plan():
        wrapper.plan(fi.indptr, fi.indices, fi.last_page_len, case.heads, case.kv_heads,
                     case.head_size, case.block_size, pos_encoding_mode="NONE",
                     q_data_type=fi.q.dtype, kv_data_type=fi.k.dtype, sm_scale=fi.scale,
                     **variants)

    plan_us = _plan_host_us(plan)

    def run():
        wrapper.run(fi.q, (fi.k, fi.v), out=fi.out, **fi.kv_scales)
        return fi.out_cupy

    run.plan_us = plan_us
    return run


# XQA over fp8 rounds its operands to e4m3 (unit roundoff 2^-4): twice that, which still
# catches a wrong scale or layout (errors of order 1).
_XQA_FP8_TOL = 2.0 ** -3


def _run_flashinfer_xqa(case: "DecodeCase", partition):
    """FlashInfer's plan-free XQA decode (TensorRT-LLM's kernel, what FlashInfer's
    trtllm_batch_decode_with_kv_cache runs on SM90) on "HND" caches and the block table.
    Its lengths are the case's int32 context_lens: XQA reads them as uint32 (equal for
    non-negative values), as vLLM and SGLang pass them. Over an fp8 cache (e4m3 only) the
    scales go where vLLM puts them, k_scale into bmm1_scale and v_scale as bmm2_scale, and
    XQA computes in fp8 ("xqa will run fp8 calculation": on an H100, 4e-2 from the
    reference), so its row is checked against e4m3's precision instead (_XQA_FP8_TOL).
    A window goes to it as ``window_left = W - 1``, sinks (float32 ``[num_heads]``, the
    gpt-oss convention, as cupaged's) as ``sinks``; soft-cap and ALiBi are refused."""
    flashinfer = _require_flashinfer()
    xqa = getattr(getattr(flashinfer, "decode", None), "xqa_batch_decode_with_kv_cache", None)
    if xqa is None:
        raise NotImplementedError(f"flashinfer {getattr(flashinfer, '__version__', '?')} has "
                                  "no flashinfer.decode.xqa_batch_decode_with_kv_cache")
    _require_supported(case, "flashinfer-xqa")
    fi = _flashinfer_inputs(case)
    max_len = int(case.context_lens.max(initial=0))
    kw = dict(bmm1_scale=fi.scale)
    if case.fp8:
        kw = dict(bmm1_scale=fi.scale * case.k_scale, bmm2_scale=case.v_scale)
    if case.variants.window is not None:
        kw["window_left"] = case.variants.window - 1
    if case.variants.sinks:
        torch = _torch()
        kw["sinks"] = torch.as_tensor(sink_values(case.heads), device=fi.q.device)

    def run():
        xqa(fi.q, (fi.k, fi.v), fi.workspace, fi.block_tables, fi.seq_lens, max_len,
            kv_layout="HND", out=fi.out, **kw)
        return fi.out_cupy

    if case.fp8:
        run.tolerance = _XQA_FP8_TOL
        run.note = f"computes in fp8 e4m3: checked against {_XQA_FP8_TOL:g}, not {case.tolerance():g}"
    return run


def _flashinfer_ok() -> bool:
    return _flashinfer()[0] is not None


# name -> (runner factory, available?). A factory takes (case, partition) and returns
# run(): device work on the current stream, returning the output as a CuPy array; it may
# carry a ``plan_us`` attribute (host time of a separate planning step), and a
# ``tolerance`` (instead of the case's) with a ``note`` saying why.
IMPLEMENTATIONS = {
    "cupaged": (_run_cupaged, lambda: True),
    "cupaged-nhd": (functools.partial(_run_cupaged_layout, layout="NHD"), lambda: True),
    "cupaged-hnd": (functools.partial(_run_cupaged_layout, layout="HND"), lambda: True),
    "cupy-gather": (_run_cupy_gather, lambda: True),
    "torch-sdpa-paged": (_run_torch_paged, lambda: _torch() is not None),
    "torch-sdpa-dense": (_run_torch_dense, lambda: _torch() is not None),
    "flashinfer-decode": (_run_flashinfer_decode, _flashinfer_ok),
    "flashinfer-decode-tc": (functools.partial(_run_flashinfer_decode, tensor_cores=True),
                             _flashinfer_ok),
    "flashinfer-xqa": (_run_flashinfer_xqa, _flashinfer_ok),
}
FLASHINFER_IMPLS = tuple(n for n in IMPLEMENTATIONS if n.startswith("flashinfer-"))


def available_implementations(kv_cache_dtype: str = "auto", variants: Variants = PLAIN) -> list:
    """The implementations that can run here, over a ``kv_cache_dtype`` cache, with
    ``variants``."""
    return [name for name, (_, ok) in IMPLEMENTATIONS.items()
            if not unsupported(name, kv_cache_dtype, variants) and ok()]


def measure(workload: Workload, impls, partition="auto", reps: int = 30, seed: int = 0,
            copy_bw: float = float("nan")) -> list:
    """Build the workload once, then check and time each implementation on the same data.
    A failed check is reported, never timed; an implementation that runs out of memory is
    reported as skipped."""
    rows = []
    base = dict(preset=workload.preset, batch=workload.batch, context=workload.context_label,
                heads=workload.heads, kv_heads=workload.kv_heads, head_size=workload.head_size,
                block_size=workload.block_size, dtype=workload.dtype, partition=str(partition),
                kv_cache_dtype=workload.kv_cache_dtype, **workload.variants.fields())
    try:
        case = workload.case(seed).build()
    except _oom_errors():
        _free_memory()
        return [Result(i, "", mean_context=float("nan"), status="skipped",
                       note="the cache does not fit in GPU memory", **base) for i in impls]
    kernel = case.spec_name()
    mean_ctx = float(case.context_lens.mean()) if case.batch else 0.0
    cupaged_us = float("nan")
    with _torch_on_cupy_stream():
        for impl in impls:
            row = Result(impl, kernel if impl == "cupaged" else "", mean_context=mean_ctx,
                         status="ok", **base)
            try:
                run = IMPLEMENTATIONS[impl][0](case, partition)
                row.plan_us = getattr(run, "plan_us", float("nan"))
                row.note = getattr(run, "note", "")
                tol = getattr(run, "tolerance", case.tolerance())
                out = run()
                row.rel_err = case.check(out)
                if not row.rel_err <= tol:
                    row.status = "failed"
                    row.note = f"rel err {row.rel_err:.2e} > {tol:.0e}"
                else:
                    t = time_us(run, reps=reps)
                    row.median_us, row.p10_us, row.p90_us = t.median_us, t.p10_us, t.p90_us
                    row.gbps = case.bytes_moved / (t.median_us * 1e-6) / 1e9
                    row.pct_copy = 100 * row.gbps * 1e9 / copy_bw
                    if impl == "cupaged":
                        cupaged_us = t.median_us
                    row.ratio_to_cupaged = t.median_us / cupaged_us
            except _oom_errors():
                row.status, row.note = "skipped", "out of GPU memory"
            except Exception as e:  # a peer that cannot run this case is skipped, cupaged is not
                if impl == "cupaged":
                    raise
                # one line: compiler errors (FlashInfer's nvcc) span many
                row.status, row.note = "skipped", " ".join(f"{type(e).__name__}: {e}".split())[:200]
            run = out = None  # the row's buffers (FlashInfer's cache copies) go, failed or not
            _free_memory()
            rows.append(row)
    case.arrays.clear()
    _free_memory()
    return rows


# ---- environment and writers --------------------------------------------------------------------


def environment() -> dict:
    """Versions, GPUs and the kernel cache: what `cupaged-bench info` prints."""
    import platform

    from . import __version__, jit

    env = {"cupaged": __version__, "python": platform.python_version(), "numpy": np.__version__,
           "cupy": cupy.__version__}
    try:
        env["nvrtc"] = ".".join(map(str, jit.nvrtc_version()))
    except Exception as e:  # pragma: no cover - depends on the install
        env["nvrtc"] = f"unavailable ({e})"
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = None
    try:  # the installed version, without importing it (seconds, and it pulls in torch)
        from importlib import metadata

        env["flashinfer"] = metadata.version("flashinfer-python")
    except Exception:
        env["flashinfer"] = None
    cache = jit.cache_dir()
    files = [f for f in cache.glob("*.json")] if cache.is_dir() else []
    env["kernel_cache"] = str(cache)
    env["kernel_cache_kernels"] = len(files)
    env["kernel_cache_mib"] = round(sum(f.stat().st_size for f in cache.glob("*") if f.is_file())
                                    / 2**20, 2) if cache.is_dir() else 0.0
    gpus = []
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        n = 0
    if n:
        env["driver"] = cupy.cuda.runtime.driverGetVersion()
        env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    for i in range(n):
        p = cupy.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        gpus.append({"index": i, "name": name, "compute_capability": f"{p['major']}.{p['minor']}",
                     "sms": p["multiProcessorCount"],
                     "memory_gib": round(p["totalGlobalMem"] / 2**30, 1)})
    env["gpus"] = gpus
    return env


def write_json(path, results, env, copy_bw_gbps) -> None:
    import dataclasses
    import json

    doc = {"environment": env, "copy_bandwidth_gbps": copy_bw_gbps,
           "results": [dataclasses.asdict(r) for r in results]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


def write_csv(path, results, env, copy_bw_gbps) -> None:
    """One row per result with every field; the environment as leading '# key: value'
    lines (pandas: read_csv(path, comment='#'))."""
    import csv
    import dataclasses
    import json

    with open(path, "w", newline="") as f:
        for k, v in {**env, "copy_bandwidth_gbps": copy_bw_gbps}.items():
            f.write(f"# {k}: {json.dumps(v, default=str)}\n")
        names = [fl.name for fl in dataclasses.fields(Result)]
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for r in results:
            w.writerow(dataclasses.asdict(r))


def write_plot(path, results, title: str = "") -> None:
    """Percent of the copy bandwidth against mean context length, one line per
    implementation, one panel per batch size (needs matplotlib: the `plot` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok"]
    batches = sorted({r.batch for r in ok}) or [0]
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), squeeze=False,
                             sharey=True)
    for ax, b in zip(axes[0], batches):
        for impl in dict.fromkeys(r.impl for r in ok):
            pts = sorted((r.mean_context, r.pct_copy) for r in ok if r.batch == b and r.impl == impl)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("% of copy bandwidth")
    axes[0][-1].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- cache operations -------------------------------------------------------------------------


@dataclass(frozen=True)
class OpRow:
    name: str
    median_us: float
    gbps: float
    vs_copy: bool  # device-memory traffic, comparable with the copy bandwidth (not PCIe)
    ok: bool


def cache_op_rows(dtype, kv_heads, head_size, block_size, tokens, layers, pairs, reps):
    """Timed rows for reshape_and_cache, copy_blocks and the two swap directions (the
    swap kernel, and one cudaMemcpyAsync per block as vLLM does), each checked first."""
    from . import cache_ops
    from cupy_backends.cuda.api import runtime

    rng = np.random.default_rng(0)
    it = np.dtype(dtype).itemsize
    block_bytes = kv_heads * head_size * block_size * it
    num_blocks = max(-(-tokens // block_size), 2 * pairs) + 1
    kc, vc = testing.random_cache(num_blocks, kv_heads, head_size, block_size, dtype, rng, cupy)
    rows = []

    # reshape_and_cache: read K and V of each token, write them into scattered slots.
    k = testing.random_normal((tokens, kv_heads, head_size), dtype, rng, cupy)
    v = testing.random_normal((tokens, kv_heads, head_size), dtype, rng, cupy)
    slots = cupy.asarray(rng.permutation(num_blocks * block_size)[:tokens].astype(np.int64))
    run = lambda: cache_ops.reshape_and_cache(k, v, kc, vc, slots)
    run()
    s0 = int(slots[0])
    ok = bool((kc[s0 // block_size, :, :, s0 % block_size, :].reshape(kv_heads, head_size)
               == k[0]).all() and (vc[s0 // block_size, :, :, s0 % block_size] == v[0]).all())
    t = time_us(run, reps=reps)
    rows.append(OpRow(f"reshape_and_cache {tokens} tokens", t.median_us,
                      4 * k.nbytes / (t.median_us * 1e3), True, ok))

    # copy_blocks: every layer's K and V, one launch.
    ks = [kc] + [cupy.empty_like(kc) for _ in range(layers - 1)]
    vs = [vc] + [cupy.empty_like(vc) for _ in range(layers - 1)]
    perm = rng.permutation(num_blocks)
    mapping = cupy.asarray(np.stack([perm[:pairs], perm[pairs:2 * pairs]], 1).astype(np.int64))
    run = lambda: cache_ops.copy_blocks(ks, vs, mapping)
    run()
    ok = bool((kc[perm[pairs]] == kc[perm[0]]).all() and (vc[perm[pairs]] == vc[perm[0]]).all())
    t = time_us(run, reps=reps)
    moved = 2 * 2 * layers * pairs * block_bytes
    rows.append(OpRow(f"copy_blocks {layers} layers x {pairs} pairs", t.median_us,
                      moved / (t.median_us * 1e3), True, ok))

    # swap_blocks: scattered blocks between the device cache and pinned host memory.
    host = cache_ops.empty_pinned((2 * pairs,) + kc.shape[1:], dtype)
    dev_ids = rng.permutation(num_blocks)[:pairs]
    host_ids = rng.permutation(2 * pairs)[:pairs]
    stream = cupy.cuda.get_current_stream()

    def per_block(src, dst, src_ids, dst_ids, src_host):
        s_ptr = src.ctypes.data if src_host else src.data.ptr
        d_ptr = dst.data.ptr if src_host else dst.ctypes.data
        for a, b in zip(src_ids.tolist(), dst_ids.tolist()):
            runtime.memcpyAsync(d_ptr + b * block_bytes, s_ptr + a * block_bytes, block_bytes,
                                runtime.memcpyDefault, stream.ptr)

    out_map = np.stack([dev_ids, host_ids], 1)
    in_map = np.stack([host_ids, dev_ids], 1)
    dev_back = cupy.empty_like(kc)
    cases = [
        ("swap out (device -> pinned), one kernel", lambda: cache_ops.swap_blocks(kc, host, out_map)),
        ("swap out, one cudaMemcpyAsync per block", lambda: per_block(kc, host, dev_ids, host_ids, False)),
        ("swap in (pinned -> device), one kernel", lambda: cache_ops.swap_blocks(host, dev_back, in_map)),
        ("swap in, one cudaMemcpyAsync per block", lambda: per_block(host, dev_back, host_ids, dev_ids, True)),
    ]
    expect = cupy.asnumpy(kc[cupy.asarray(dev_ids)])
    for name, run in cases:
        host[...] = 0
        dev_back[...] = 0
        if "out" in name:
            run()
            stream.synchronize()
            ok = bool((host[host_ids].view(np.uint8) == expect.view(np.uint8)).all())
        else:
            host[host_ids] = expect
            run()
            ok = bool((cupy.asnumpy(dev_back[cupy.asarray(dev_ids)]).view(np.uint8)
                       == expect.view(np.uint8)).all())
        t = time_us(run, reps=reps, flush_l2=False)
        rows.append(OpRow(f"{name} ({pairs} blocks)", t.median_us,
                          pairs * block_bytes / (t.median_us * 1e3), False, ok))
    return rows


def kv_cache_step_us(seqs, kv_heads, head_size, block_size, dtype, steps=200) -> dict:
    """Host microseconds per decode step for ``seqs`` sequences: the block manager's
    bookkeeping alone, and PagedKVCache.step (bookkeeping + the one upload)."""
    import time

    from .kv_cache import BlockManager, PagedKVCache

    per_seq = -(-(1000 + steps) // block_size) + 1
    m = BlockManager(seqs * per_seq, block_size)
    cache = PagedKVCache(1, seqs * per_seq, kv_heads, head_size, block_size, dtype)
    ids = list(range(seqs))
    for s in ids:
        m.add(s, 1000)
        cache.add(s, 1000)
    t0 = time.perf_counter()
    for _ in range(steps):
        m.append(ids)
        m.tables(ids)
    manager = (time.perf_counter() - t0) / steps * 1e6
    t0 = time.perf_counter()
    for _ in range(steps):
        cache.step(ids)
    step = (time.perf_counter() - t0) / steps * 1e6
    cupy.cuda.get_current_stream().synchronize()
    return {f"BlockManager.append+tables, {seqs} seqs": manager,
            f"PagedKVCache.step, {seqs} seqs": step}


def _run_us(fn, calls: int) -> float:
    """Host microseconds per call over one run of ``calls`` calls of ``fn``, after a sync
    and with none inside."""
    import time

    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _host_us(fn, calls: int, repeats: int = 9) -> float:
    """Host microseconds per call of ``fn``: the median over ``repeats`` runs of ``calls``
    calls each (few enough calls that the launch queue never fills and throttles the
    host). One run alone moved by 40% between identical runs on the GPU machine's shared
    CPU; the median of nine holds still."""
    for _ in range(10):
        fn()
    runs = [_run_us(fn, calls) for _ in range(repeats)]
    cupy.cuda.get_current_stream().synchronize()
    return float(np.median(runs))


def _nhd_copy(arrays: dict) -> tuple:
    """A case's vLLM-layout caches copied to NHD (for attention's default layout)."""
    kc, vc = arrays["key_cache"], arrays["value_cache"]
    nb, kvh, _, bs, _ = kc.shape
    hs = vc.shape[2]
    return (cupy.ascontiguousarray(kc.transpose(0, 3, 1, 2, 4).reshape(nb, bs, kvh, hs)),
            cupy.ascontiguousarray(vc.transpose(0, 3, 1, 2)))


def host_overheads(calls: int = 200, layers: int = 32) -> dict:
    """Host time per call of each entry point with its kernel cached (llama-3-8b shape,
    batch 8, context 1024), for CuPy arrays and (when torch imports) torch tensors, and
    per replay of a decode step of ``layers`` layers captured in a CUDA graph."""
    from . import cache_ops, decode
    from .kv_cache import PagedKVCache

    case = DecodeCase(8, np.full(8, 1024, np.int32), 32, 8, 128, 16, np.dtype(np.float16)).build()
    a = case.arrays
    out = cupy.empty(a["query"].shape, a["query"].dtype)
    rows = {}
    rows["paged_attention, single pass"] = _host_us(lambda: case.run(out, "never"), calls)
    rows["paged_attention, split-KV"] = _host_us(lambda: case.run(out, "always"), calls)
    rows["paged_attention_v1"] = _host_us(lambda: decode.paged_attention_v1(
        out, a["query"], a["key_cache"], a["value_cache"], 8, 0.1, a["block_tables"],
        a["context_lens"], 16, 1024), calls)
    from .varlen import attention

    starts = cupy.arange(9, dtype=np.int32)
    rows["attention, vLLM layout, decode (query_start_loc, max_query_len=1)"] = _host_us(
        lambda: attention(a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                          a["context_lens"], starts, kv_layout="vllm", max_query_len=1,
                          max_seq_len=1024, out=out), calls)
    starts4 = cupy.arange(0, 9 * 4, 4, dtype=np.int32)
    q4 = cupy.ones((32, 32, 128), np.float16)
    out4 = cupy.empty_like(q4)
    rows["attention, vLLM layout, verify 8 x 4 tokens"] = _host_us(
        lambda: attention(q4, a["key_cache"], a["value_cache"], a["block_tables"],
                          a["context_lens"], starts4, kv_layout="vllm", max_query_len=4,
                          max_seq_len=1024, out=out4), calls)
    # attention() and AttentionPlan over the same cache as NHD (a copy), with the split-KV
    # partials in a workspace (so the plan rows allocate nothing).
    from .varlen import AttentionPlan

    hk, hv = _nhd_copy(a)
    ws = decode.DecodeWorkspace(8, 32, 128)
    q, bt, cl = a["query"], a["block_tables"], a["context_lens"]
    rows["attention, NHD, decode"] = _host_us(
        lambda: attention(q, hk, hv, bt, cl, max_seq_len=1024, out=out), calls)
    plan = AttentionPlan(q, hk, hv, bt, cl, max_seq_len=1024, out=out, workspace=ws)
    rows["AttentionPlan.run, NHD, decode (split-KV, workspace)"] = _host_us(
        lambda: plan.run(q, hk, hv, out=out), calls)
    plan4 = AttentionPlan(q4, hk, hv, bt, cl, starts4, max_query_len=4, max_seq_len=1024,
                          out=out4, workspace=ws)
    rows["AttentionPlan.run, NHD, verify 8 x 4 tokens (split-KV, workspace)"] = _host_us(
        lambda: plan4.run(q4, hk, hv, out=out4), calls)
    # The same bytes as 64 x 256 tokens: 512 CTAs, which "auto" serves in a single pass.
    wide = DecodeCase(64, np.full(64, 256, np.int32), 32, 8, 128, 16, np.dtype(np.float16),
                      seed=1).build()
    w = wide.arrays
    wk, wv = _nhd_copy(w)
    wq, wbt, wcl = w["query"], w["block_tables"], w["context_lens"]
    wout = cupy.empty_like(wq)
    rows["attention, NHD, decode 64 x 256 (single pass)"] = _host_us(
        lambda: attention(wq, wk, wv, wbt, wcl, max_seq_len=256, out=wout), calls)
    wplan = AttentionPlan(wq, wk, wv, wbt, wcl, max_seq_len=256, out=wout)
    rows["AttentionPlan.run, NHD, decode 64 x 256 (single pass)"] = _host_us(
        lambda: wplan.run(wq, wk, wv, out=wout), calls)
    k = cupy.ones((8, 8, 128), np.float16)
    slots = cupy.arange(8, dtype=np.int64) * 16
    rows["reshape_and_cache, 8 tokens"] = _host_us(lambda: cache_ops.reshape_and_cache(
        k, k, a["key_cache"], a["value_cache"], slots), calls)
    ks, vs = [a["key_cache"]] * layers, [a["value_cache"]] * layers
    pairs = cupy.asarray([[0, 1], [2, 3]], np.int64)
    rows[f"copy_blocks, {layers} layers"] = _host_us(lambda: cache_ops.copy_blocks(ks, vs, pairs), calls)
    # Room for every timed step: 64 sequences of 1,000 tokens, each growing by up to
    # 10 + 9 x 100 tokens (the warm-up and _host_us's runs).
    cache = PagedKVCache(1, 64 * 160, 8, 128, 16, "float16")
    ids = list(range(64))
    for s in ids:
        cache.add(s, 1000)
    rows["PagedKVCache.step, 64 sequences"] = _host_us(lambda: cache.step(ids), min(calls, 100))

    # A decode step captured once and replayed: per layer, write the new token's K/V and
    # attend (split-KV into the preallocated workspace, so nothing allocates while capturing).

    def step(arrays):
        q, kc, vc, bt, cl, o, kv, sl = arrays
        for _ in range(layers):
            cache_ops.reshape_and_cache(kv, kv, kc, vc, sl)
            decode.paged_attention(q, kc, vc, bt, cl, out=o, workspace=ws, partition="always",
                                      max_context_len=1024)

    cupy_args = (a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                 a["context_lens"], out, k, slots)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step(cupy_args)  # kernels loaded before capture
        stream.begin_capture()
        step(cupy_args)
        graph = stream.end_capture()
        rows[f"CuPy graph replay, {layers} x (reshape_and_cache + split-KV attention)"] = \
            _host_us(lambda: graph.launch(stream), calls)
    rows[f"the same step eager, {layers} x (reshape_and_cache + split-KV attention)"] = \
        _host_us(lambda: step(cupy_args), max(10, calls // 10))

    torch = _torch()
    if torch is not None:  # the same arrays as torch tensors (zero-copy views)
        tq, tkc, tvc, tbt, tcl, tk, t_slots = (torch.from_dlpack(x) for x in (
            a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["context_lens"],
            k, slots))
        tout = torch.empty_like(tq)
        torch_args = (tq, tkc, tvc, tbt, tcl, tout, tk, t_slots)
        rows["paged_attention, torch tensors, single pass"] = _host_us(
            lambda: decode.paged_attention(tq, tkc, tvc, tbt, tcl, out=tout, partition="never",
                                              max_context_len=1024), calls)
        rows["paged_attention, torch tensors, split-KV + workspace"] = _host_us(
            lambda: decode.paged_attention(tq, tkc, tvc, tbt, tcl, out=tout, partition="always",
                                              workspace=ws, max_context_len=1024), calls)
        thk, thv = torch.from_dlpack(hk), torch.from_dlpack(hv)
        rows["attention, torch tensors, NHD, decode"] = _host_us(
            lambda: attention(tq, thk, thv, tbt, tcl, max_seq_len=1024, out=tout), calls)
        tplan = AttentionPlan(tq, thk, thv, tbt, tcl, max_seq_len=1024, out=tout, workspace=ws)
        rows["AttentionPlan.run, torch tensors, NHD, decode (split-KV, workspace)"] = _host_us(
            lambda: tplan.run(tq, thk, thv, out=tout), calls)
        twq, twk, twv, twbt, twcl, twout = (torch.from_dlpack(x) for x in (
            wq, wk, wv, wbt, wcl, wout))
        twplan = AttentionPlan(twq, twk, twv, twbt, twcl, max_seq_len=256, out=twout)
        rows["AttentionPlan.run, torch tensors, NHD, decode 64 x 256 (single pass)"] = \
            _host_us(lambda: twplan.run(twq, twk, twv, out=twout), calls)
        rows["reshape_and_cache, torch tensors, 8 tokens"] = _host_us(
            lambda: cache_ops.reshape_and_cache(tk, tk, tkc, tvc, t_slots), calls)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the default stream, as torch asks
            step(torch_args)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(torch_args)
        rows[f"torch.cuda.graph replay, {layers} x (reshape_and_cache + split-KV attention)"] = \
            _host_us(g.replay, calls)
        torch.cuda.synchronize()
        del g
    case.arrays.clear()
    wide.arrays.clear()
    return rows
