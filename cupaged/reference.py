"""Float64 NumPy reference for paged-attention decode: the oracle of every test.

Same arguments and layouts as :func:`cupaged.paged_attention`, on NumPy arrays (any
float dtype, bfloat16 through ml_dtypes). Written for clarity, not speed.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["gather_kv", "paged_attention"]


def gather_kv(key_cache, value_cache, block_table, context_len: int):
    """One sequence's dense K and V, ``[context_len, num_kv_heads, head_size]`` float64,
    read from the paged caches through its row of the block table."""
    kc = np.asarray(key_cache)
    vc = np.asarray(value_cache)
    _, num_kv_heads, chunks, block_size, x = kc.shape
    n_blocks = -(-context_len // block_size)
    blocks = np.asarray(block_table)[:n_blocks]
    # key [blocks, kv_heads, hs/x, bs, x] -> [blocks, bs, kv_heads, hs]
    k = kc[blocks].astype(np.float64).transpose(0, 3, 1, 2, 4).reshape(
        n_blocks * block_size, num_kv_heads, chunks * x)
    # value [blocks, kv_heads, hs, bs] -> [blocks, bs, kv_heads, hs]
    v = vc[blocks].astype(np.float64).transpose(0, 3, 1, 2).reshape(
        n_blocks * block_size, num_kv_heads, chunks * x)
    return k[:context_len], v[:context_len]


def attend(q, k, v, scale: float, alibi_slopes=None):
    """Dense decode attention in float64: ``q [num_heads, hs]`` against
    ``k, v [n, num_kv_heads, hs]``; query head h uses KV head h // (num_heads // num_kv_heads)."""
    q = np.asarray(q, dtype=np.float64)
    num_heads, head_size = q.shape
    n, num_kv_heads, _ = k.shape
    if n == 0:
        return np.zeros((num_heads, head_size))
    kv_of_head = np.arange(num_heads) // (num_heads // num_kv_heads)
    kh = k[:, kv_of_head, :]  # [n, heads, hs]
    vh = v[:, kv_of_head, :]
    logits = np.einsum("hd,nhd->hn", q, kh) * scale
    if alibi_slopes is not None:
        pos = np.arange(n) - n + 1
        logits = logits + np.asarray(alibi_slopes, dtype=np.float64)[:, None] * pos[None, :]
    logits -= logits.max(axis=1, keepdims=True)
    w = np.exp(logits)
    w /= w.sum(axis=1, keepdims=True)
    return np.einsum("hn,nhd->hd", w, vh)


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, *, scale=None,
                    alibi_slopes=None, max_context_len=None):
    """Float64 result ``[num_seqs, num_heads, head_size]`` of the same call as
    :func:`cupaged.paged_attention`. ``max_context_len`` is accepted and ignored."""
    query = np.asarray(query)
    num_seqs, num_heads, head_size = query.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    lens = np.asarray(context_lens)
    tables = np.asarray(block_tables)
    out = np.zeros((num_seqs, num_heads, head_size))
    for s in range(num_seqs):
        k, v = gather_kv(key_cache, value_cache, tables[s], int(lens[s]))
        out[s] = attend(query[s], k, v, scale, alibi_slopes)
    return out
