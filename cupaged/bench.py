"""Measurement helpers for cupaged-bench: CUDA-event timing with the L2 flushed between
runs, the device's copy bandwidth, and decode workloads checked against the reference."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import cupy
import numpy as np

from . import _dtypes, attention, reference, testing


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


def time_us(fn, *, warmup: int = 3, reps: int = 30, flush_l2: bool = True) -> Timing:
    """Time ``fn()`` (device work on the current stream) with CUDA events, one pair per
    run, the L2 flushed before each run outside the timed region."""
    flush = _L2Flusher() if flush_l2 else (lambda: None)
    for _ in range(warmup):
        fn()
    starts = [cupy.cuda.Event() for _ in range(reps)]
    ends = [cupy.cuda.Event() for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush()
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
    t = time_us(lambda: b.__setitem__(Ellipsis, a), warmup=3, reps=reps, flush_l2=False)
    return 2 * nbytes / (t.median_us * 1e-6)


@dataclass
class DecodeCase:
    """One decode workload: a random paged cache on the device, sequences scattered."""

    batch: int
    context_lens: np.ndarray  # int32 [batch]
    heads: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: np.dtype
    seed: int = 0
    arrays: dict = field(default_factory=dict, repr=False)

    @property
    def kv_bytes(self) -> int:
        it = self.dtype.itemsize
        return int(self.context_lens.astype(np.int64).sum()) * self.kv_heads * self.head_size * it * 2

    @property
    def bytes_moved(self) -> int:
        """Every context token's K and V once per KV head, plus q and out."""
        return self.kv_bytes + 2 * self.batch * self.heads * self.head_size * self.dtype.itemsize

    def build(self) -> "DecodeCase":
        rng = np.random.default_rng(self.seed)
        bt, nb = testing.random_block_tables(self.context_lens, self.block_size, rng)
        kc, vc = testing.random_cache(nb, self.kv_heads, self.head_size, self.block_size,
                                      self.dtype, rng, xp=cupy)
        q = testing.random_normal((self.batch, self.heads, self.head_size), self.dtype, rng, cupy)
        self.arrays = dict(query=q, key_cache=kc, value_cache=vc, block_tables=cupy.asarray(bt),
                           context_lens=cupy.asarray(self.context_lens.astype(np.int32)))
        return self

    def run(self, out=None, partition="auto"):
        return attention.paged_attention(**self.arrays, out=out, partition=partition,
                                         max_context_len=int(self.context_lens.max(initial=0)))

    def check(self, out, max_seqs: int = 8, seed: int = 1) -> float:
        """||out - ref|| / ||ref|| over up to ``max_seqs`` sequences (chosen at random),
        computed in float64 from just those sequences' blocks."""
        a = self.arrays
        rng = np.random.default_rng(seed)
        seqs = rng.choice(self.batch, size=min(max_seqs, self.batch), replace=False)
        num = den = 0.0
        for s in seqs:
            n = int(self.context_lens[s])
            blocks = a["block_tables"][s, : -(-n // self.block_size)]
            ref = reference.paged_attention(
                cupy.asnumpy(a["query"][s: s + 1]), cupy.asnumpy(a["key_cache"][blocks]),
                cupy.asnumpy(a["value_cache"][blocks]),
                np.arange(blocks.size, dtype=np.int32)[None, :], np.array([n], np.int32))
            got = cupy.asnumpy(out[s: s + 1]).astype(np.float64)
            num += float(np.sum((got - ref) ** 2))
            den += float(np.sum(ref ** 2))
        return math.sqrt(num / den) if den > 0 else math.sqrt(num)

    def tolerance(self) -> float:
        return testing.TOLERANCE[_dtypes.lookup(self.dtype).name]

    def spec_name(self) -> str:
        dev = attention._device(cupy.cuda.Device().id)
        gt = attention._group_tile(self.heads // self.kv_heads)
        return attention.jit.KernelSpec("paged_decode", _dtypes.lookup(self.dtype).name,
                                        self.head_size, self.block_size, gt, arch=dev.arch).name
