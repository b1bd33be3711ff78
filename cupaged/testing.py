"""Random paged KV caches, for tests and benchmarks (NumPy on the host or CuPy on a device)."""

from __future__ import annotations

import numpy as np

from . import _dtypes

__all__ = ["convert_layout", "poison_unused_slots", "random_block_tables", "random_cache",
           "random_normal", "ROW_FACTOR", "TOLERANCE"]

# ||out - ref|| / ||ref|| accepted against the float64 reference, by element type.
TOLERANCE = {"f32": 1e-5, "f16": 1e-3, "bf16": 8e-3}
# Any one output row (a head's vector) may be off by this many times TOLERANCE of its own
# norm: rounding to the element type alone costs about half of TOLERANCE per row, and a
# row 5% off fails it for every type.
ROW_FACTOR = 4


def random_block_tables(context_lens, block_size: int, rng: np.random.Generator, *,
                        spare_blocks: int = 0, share: bool = False, extra_columns: int = 0):
    """Block tables with each sequence's blocks scattered at random over the cache.

    Returns ``(block_tables int32 [num_seqs, max_blocks], num_blocks)``. Entries past a
    sequence's last block hold out-of-range garbage (they must never be read). With
    ``share``, about half of the sequences reuse a prefix of another sequence's blocks,
    as forks and shared prompts do.
    """
    lens = np.asarray(context_lens, dtype=np.int64)
    need = -(-lens // block_size)
    width = int(need.max(initial=0)) + extra_columns
    num_blocks = int(need.sum()) + spare_blocks
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = rng.integers(num_blocks, num_blocks + 1000, size=(len(lens), max(width, 1)))
    tables = tables.astype(np.int32)[:, :width]
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[used:used + n]
        used += n
        if share and s > 0 and rng.random() < 0.5:
            donor = int(rng.integers(0, s))
            k = int(min(n, need[donor], rng.integers(0, n + 1)))
            tables[s, :k] = tables[donor, :k]
    return tables, num_blocks


def random_normal(shape, dtype, rng, xp=np):
    """Standard-normal values of ``dtype`` (a NumPy dtype, bfloat16 included); ``xp`` is
    numpy or cupy (generated on that side)."""
    if xp is np:
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    return xp.random.default_rng(int(rng.integers(2**31))).standard_normal(
        shape, dtype=np.float32).astype(dtype)


def random_cache(num_blocks: int, num_kv_heads: int, head_size: int, block_size: int, dtype,
                 rng: np.random.Generator, xp=np):
    """``(key_cache, value_cache)`` in vLLM's layouts, random normal values."""
    x = 16 // _dtypes.lookup(dtype).itemsize
    k = random_normal((num_blocks, num_kv_heads, head_size // x, block_size, x), dtype, rng, xp)
    v = random_normal((num_blocks, num_kv_heads, head_size, block_size), dtype, rng, xp)
    return k, v


def poison_unused_slots(key_cache, value_cache, block_tables, context_lens, value=float("nan")):
    """Fill every cache slot that holds no token of any sequence (the tail of each partly
    filled last block, and whole unused blocks) with ``value`` (NaN, +-Inf), in place, on
    host arrays in vLLM's layouts: stale slots a kernel must never let into its output
    (0 * NaN is NaN, so masking scores alone is not enough). Returns the [num_blocks,
    block_size] mask of used slots."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[3]
    used = np.zeros((num_blocks, block_size), dtype=bool)
    tables = np.asarray(block_tables)
    for s, n in enumerate(np.asarray(context_lens)):
        t = np.arange(int(n))
        used[tables[s, t // block_size], t % block_size] = True
    np.moveaxis(key_cache, 3, 1)[~used] = value  # [blocks, slot, kv_heads, hs/x, x]
    np.moveaxis(value_cache, 3, 1)[~used] = value  # [blocks, slot, kv_heads, hs]
    return used


def convert_layout(key_cache, value_cache, src: str, dst: str):
    """Host caches from one layout to another (``"NHD"``, ``"HND"``, ``"vllm"``; see
    :mod:`cupaged.reference`), as new C-contiguous NumPy arrays with the same values."""
    from .reference import token_major_views

    k = token_major_views(key_cache, src, True)  # [blocks, block_size, kv_heads, head_size] views
    v = token_major_views(value_cache, src, False)
    if dst == "NHD":
        pass
    elif dst == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    elif dst == "vllm":
        nb, bs, kvh, hs = k.shape
        x = 16 // k.dtype.itemsize
        k = k.reshape(nb, bs, kvh, hs // x, x).transpose(0, 2, 3, 1, 4)
        v = v.transpose(0, 2, 3, 1)
    else:
        raise ValueError(f"unknown layout {dst!r}")
    return np.ascontiguousarray(k), np.ascontiguousarray(v)
