"""``cupaged-bench cache-ops``: the cache kernels (write, copy, swap against one copy
per block) and the host time of the block manager's steps."""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from .. import testing
from . import timing


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
    from .. import cache_ops
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
    t = timing.time_us(run, reps=reps)
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
    t = timing.time_us(run, reps=reps)
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
        t = timing.time_us(run, reps=reps, flush_l2=False)
        rows.append(OpRow(f"{name} ({pairs} blocks)", t.median_us,
                          pairs * block_bytes / (t.median_us * 1e3), False, ok))
    return rows


def kv_cache_step_us(seqs, kv_heads, head_size, block_size, dtype, steps=200) -> dict:
    """Host microseconds per decode step for ``seqs`` sequences: the block manager's
    bookkeeping alone, and PagedKVCache.step (bookkeeping + the one upload)."""
    import time

    from ..kv_cache import BlockManager, PagedKVCache

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
