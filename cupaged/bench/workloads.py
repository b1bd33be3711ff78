"""Workloads for ``cupaged-bench decode`` and ``compare``: the model presets, context
distributions, fp8 cache dtypes and scales, attention variants, and one decode case
(:class:`DecodeCase`: random data, its float64 reference and tolerance, bytes moved)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import cupy
import numpy as np

from .. import _checks, _dtypes, decode, planning, reference, testing


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


SINK_SEED = 1234  # the --sinks values: np.random.default_rng(SINK_SEED), one per head


def require_positive(case, *names: str) -> None:
    """A case's sizes ``names`` each at least 1, else a ValueError naming the first that is
    not."""
    for name in names:
        if getattr(case, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(case, name)}")


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
    ``sinks`` (:func:`sink_values`) and ``alibi`` (:func:`alibi_slopes`); with
    ``soft_cap_approx`` cupaged takes the cap as ``cupaged.SoftCap(c, approx=True)``.
    ValueError for a window below 1, a cap that is not a positive finite float32, or
    soft_cap_approx without a cap."""

    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    alibi: bool = False
    soft_cap_approx: bool = False

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
            if not _checks.is_real_number(c):
                raise ValueError(f"soft cap must be a number, got {c!r}")
            if not (math.isfinite(c) and 0 < c <= 1e37):
                raise ValueError(f"soft cap must be a positive finite number (logits become "
                                 f"c * tanh(logit / c)), got {c}")
            object.__setattr__(self, "soft_cap", float(c))
        if self.soft_cap_approx and c is None:
            raise ValueError("soft_cap_approx needs a soft cap (the cap's tanh by tanh.approx)")
        object.__setattr__(self, "sinks", bool(self.sinks))
        object.__setattr__(self, "alibi", bool(self.alibi))
        object.__setattr__(self, "soft_cap_approx", bool(self.soft_cap_approx))

    @property
    def plain(self) -> bool:
        return self.window is None and self.soft_cap is None and not self.sinks and not self.alibi

    def label(self) -> str:
        """``"window 512, soft-cap 50, sinks, ALiBi"`` (the ones set; "" for none)."""
        parts = []
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.soft_cap is not None:
            parts.append(f"soft-cap {self.soft_cap:g}" + (" (tanh.approx)" if self.soft_cap_approx
                                                         else ""))
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
            parts.append(f"soft-cap {self.soft_cap:g}" + (
                " (cupaged's tanh by tanh.approx: cupaged.SoftCap(c, approx=True))"
                if self.soft_cap_approx else ""))
        if self.sinks:
            parts.append(f"sinks (standard normal per head, seed {SINK_SEED})")
        if self.alibi:
            parts.append("ALiBi (the standard slopes of the head count)")
        return ", ".join(parts)

    def fields(self) -> dict:
        """The Result / JSON / CSV fields: window, soft_cap (None: off), soft_cap_approx,
        sinks, alibi."""
        return dict(window=self.window, soft_cap=self.soft_cap,
                    soft_cap_approx=self.soft_cap_approx, sinks=self.sinks, alibi=self.alibi)

    def letters(self) -> str:
        """The compile-time variant letters of the decode kernel these variants launch
        (the multi-token kernel adds ``a`` for ALiBi)."""
        from .. import _variants

        return _variants.letters(self.window or 0, self.soft_cap or 0.0, (),
                                 self.soft_cap_approx)

    def device_arrays(self, num_heads: int) -> dict:
        """``sinks`` and ``alibi_slopes`` as float32 device arrays (those set)."""
        a = {}
        if self.sinks:
            a["sinks"] = cupy.asarray(sink_values(num_heads))
        if self.alibi:
            a["alibi_slopes"] = cupy.asarray(alibi_slopes(num_heads))
        return a

    def _args(self, sinks, slopes) -> dict:
        cap = self.soft_cap
        if cap is not None and self.soft_cap_approx:
            from .._variants import SoftCap

            cap = SoftCap(cap, approx=True)
        kw = dict(window=self.window, logits_soft_cap=cap, sinks=sinks, alibi_slopes=slopes)
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
        dev = planning.device_info(cupy.cuda.Device().id)
        gt = planning.group_tile(self.heads // self.kv_heads)
        cache = _dtypes.KV_CACHE_DTYPES[self.kv_cache_dtype].name if self.fp8 else ""
        return planning.decode_spec(dev.arch, _dtypes.lookup(self.dtype).name, self.head_size,
                                      self.block_size, gt, cache_dtype=cache, kv_scale="",
                                      variant=self.variants.letters()).name


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
    soft_cap_approx: bool = False  # cupaged's cap by tanh.approx
