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
