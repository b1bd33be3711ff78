"""Float64 NumPy reference for paged attention: the oracle of every test.

Same arguments and layouts as the kernels' entry points, on NumPy arrays (any float
dtype, bfloat16 through ml_dtypes). Written for clarity, not speed.

Cache layouts (``kv_layout``), one block of ``block_size`` tokens per leading index:
    "vllm"  key ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` (x = 16 bytes
            of elements), value ``[num_blocks, num_kv_heads, head_size, block_size]``
    "NHD"   key and value ``[num_blocks, block_size, num_kv_heads, head_size]``
    "HND"   key and value ``[num_blocks, num_kv_heads, block_size, head_size]``

MLA latent caches (:func:`mla_attention`, :func:`concat_and_cache_mla`): vLLM's
``[num_blocks, block_size, kv_lora_rank + rope_dim]``, or a ``[.., kv_lora_rank]`` cache
with a ``[.., rope_dim]`` one beside it.

fp8 caches (``kv_cache_dtype`` "fp8"/"fp8_e4m3" or "fp8_e5m2", or float8 arrays with
"auto"; 1-byte storage of any NumPy dtype) are read as ``stored * scale`` exactly, in
float64; :func:`quantize_fp8` is the cache write's quantizer, bit for bit.

DeepSeek sparse attention (``cupaged.sparse_mla_attention`` serves 16-bit caches and all
three formats, not the second cache; ``cupaged.concat_and_cache_mla`` writes the three
formats): :func:`sparse_mla_attention` over top-k indices into a
paged cache, FlashMLA's sparse interface, and the caches' token
formats (:data:`SPARSE_KV_FORMATS`: V3.2's 656-byte ``"fp8_ds_mla"`` and two V4 layouts)
with their writers (:func:`quantize_sparse_kv`, :func:`concat_and_cache_sparse_mla`) and
reader (:func:`dequantize_sparse_kv`); the lightning indexer that picks the indices: its fp8
key cache (:func:`indexer_k_quant_and_cache`, :func:`dequantize_indexer_k`), its logits
(:func:`indexer_logits`), the top-k (:func:`indexer_topk`) and the slots
(:func:`indexer_slots`).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["KV_LAYOUTS", "attend", "attention", "blocksparse_mask", "concat_and_cache_mla",
           "dequantize_fp8", "fp8_max", "fp8_query_error_bound", "gather_kv", "merge_state",
           "merge_states", "mla_attention", "mla_cache_views", "paged_attention", "quantize_fp8",
           "reshape_and_cache", "token_head_scales", "SPARSE_KV_FORMATS",
           "concat_and_cache_sparse_mla", "dequantize_sparse_kv", "quantize_sparse_kv",
           "sparse_mla_attention", "dequantize_indexer_k", "indexer_cache_width",
           "indexer_k_quant_and_cache", "indexer_logits", "indexer_slots", "indexer_topk",
           "quantize_indexer_k"]

KV_LAYOUTS = ("NHD", "HND", "vllm")


def token_major_views(cache, kv_layout: str, is_key: bool):
    """A cache in ``kv_layout`` ("NHD", "HND" or "vllm") as ``[num_blocks, block_size,
    num_kv_heads, head_size]``: a NumPy view, except for vLLM's key, whose x-split rows
    come back as a copy."""
    c = np.asarray(cache)
    if kv_layout == "NHD":
        return c
    if kv_layout == "HND":
        return c.transpose(0, 2, 1, 3)
    if kv_layout == "vllm":
        if is_key:  # [blocks, kv_heads, hs/x, bs, x] -> [blocks, bs, kv_heads, hs/x, x]
            t = c.transpose(0, 3, 1, 2, 4)
            return t.reshape(*t.shape[:3], t.shape[3] * t.shape[4])
        return c.transpose(0, 3, 1, 2)  # [blocks, kv_heads, hs, bs] -> [blocks, bs, kv_heads, hs]
    raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")


# ---- fp8 ------------------------------------------------------------------------------------


def _fp8_format(kv_cache_dtype, cache):
    """The ml_dtypes float8 type of a cache, or None for a plain float cache."""
    import ml_dtypes

    types = {"fp8": ml_dtypes.float8_e4m3fn, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
             "fp8_e5m2": ml_dtypes.float8_e5m2}
    dt = np.asarray(cache).dtype
    if kv_cache_dtype in (None, "auto"):
        return dt.type if dt in (np.dtype(ml_dtypes.float8_e4m3fn),
                                 np.dtype(ml_dtypes.float8_e5m2)) else None
    if kv_cache_dtype not in types:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    return types[kv_cache_dtype]


def _fp8_max(fmt) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(fmt).max)


def fp8_max(kv_cache_dtype: str = "fp8_e4m3") -> float:
    """The largest finite value of an fp8 format: 448 (e4m3), 57344 (e5m2)."""
    return _fp8_max(_fp8_format(kv_cache_dtype, np.zeros(0)))


def quantize_fp8(x, kv_cache_dtype="fp8_e4m3", scale=1.0):
    """``x / scale`` in float32, saturated to the format's largest finite value and
    rounded to nearest even (NaN stays NaN): what the cache write stores, as ml_dtypes'
    float8 array. ``scale`` broadcasts against ``x`` (per tensor, or per token and head
    with a trailing axis of 1). ``kv_cache_dtype`` may also be the float8 type itself."""
    fmt = kv_cache_dtype if isinstance(kv_cache_dtype, type) else \
        _fp8_format(kv_cache_dtype, np.zeros(0))
    m = np.float32(_fp8_max(fmt))
    y = np.asarray(x).astype(np.float32) / np.asarray(scale, dtype=np.float32)
    return np.clip(y, -m, m).astype(fmt)


def token_head_scales(x, kv_cache_dtype="fp8_e4m3"):
    """Per-token-head scales of rows ``x [..., head_size]``: ``amax(|row|) / max`` in
    float32 (1 for a row of zeros), with the last axis kept (length 1)."""
    fmt = kv_cache_dtype if isinstance(kv_cache_dtype, type) else \
        _fp8_format(kv_cache_dtype, np.zeros(0))
    a = np.abs(np.asarray(x).astype(np.float32)).max(axis=-1, keepdims=True)
    return np.where(a > 0, a / np.float32(_fp8_max(fmt)), np.float32(1)).astype(np.float32)


def dequantize_fp8(cache, kv_cache_dtype="auto", scale=1.0):
    """An fp8 cache's values, ``stored * scale`` in float64 (``cache`` may be any 1-byte
    dtype; ``scale`` broadcasts)."""
    fmt = _fp8_format(kv_cache_dtype, cache)
    c = np.asarray(cache)
    return c.view(fmt).astype(np.float64) * np.asarray(scale, dtype=np.float64)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                      k_scale=None, v_scale=None, *, kv_layout: str = "vllm") -> None:
    """What ``cupaged.reshape_and_cache`` writes, into host caches in place (NumPy; an fp8
    cache may be 1-byte storage of any dtype). Per-token-head ``k_scale``/``v_scale``
    arrays ``[num_blocks, num_kv_heads, block_size]`` are written too."""
    fmt = _fp8_format(kv_cache_dtype, key_cache)
    kc = token_major_views(key_cache, kv_layout, True)  # writable views [blocks, bs, kvh, hs]
    vc = token_major_views(value_cache, kv_layout, False)
    if kv_layout == "vllm":  # the key view above is a reshaped copy: write through indices
        kc = None
    block_size = vc.shape[1]
    per_token = k_scale is not None and np.ndim(k_scale) == 3
    for i, slot in enumerate(np.asarray(slot_mapping).astype(np.int64)):
        if slot < 0:
            continue
        b, o = divmod(int(slot), block_size)
        for rows, cache, is_key, sc in ((key[i], kc, True, k_scale), (value[i], vc, False, v_scale)):
            rows = np.asarray(rows)
            if fmt is None:
                new = rows.astype(np.asarray(key_cache).dtype)
            else:
                if per_token:
                    s = token_head_scales(rows, fmt)
                    sc[b, :, o] = s[:, 0]
                else:
                    s = 1.0 if sc is None else sc
                new = quantize_fp8(rows, fmt, s).view(np.asarray(key_cache).dtype)
            if cache is not None:
                cache[b, o] = new
            else:  # vLLM's key: [blocks, kvh, hs / x, bs, x]
                x = key_cache.shape[-1]
                key_cache[b, :, :, o, :] = new.reshape(new.shape[0], -1, x)


def _block_size(key_cache, kv_layout: str = "vllm") -> int:
    """Tokens per block of a cache in ``kv_layout`` (read from none of its blocks: vLLM's
    key view is a copy)."""
    return token_major_views(np.asarray(key_cache)[:0], kv_layout, True).shape[1]


def gather_kv(key_cache, value_cache, block_table, context_len: int, kv_layout: str = "vllm",
              kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """One sequence's dense K and V, ``[context_len, num_kv_heads, head_size]`` float64,
    read from the paged caches through its row of the block table (an fp8 cache
    dequantized as ``stored * scale``)."""
    block_size = _block_size(key_cache, kv_layout)
    n_blocks = -(-context_len // block_size)
    blocks = np.asarray(block_table)[:n_blocks]
    # The sequence's blocks first, then their layout and dtype: the work grows with the
    # sequence, not with the cache (a batch's reference reads each block once)
    k = token_major_views(np.asarray(key_cache)[blocks], kv_layout, True)
    v = token_major_views(np.asarray(value_cache)[blocks], kv_layout, False)
    if _fp8_format(kv_cache_dtype, key_cache) is not None:
        def scaled(c, s):
            s = 1.0 if s is None else s
            if np.ndim(s) == 3:  # [blocks, kv_heads, bs] -> [blocks, bs, kv_heads, 1]
                s = np.asarray(s)[blocks].transpose(0, 2, 1)[..., None]
            return dequantize_fp8(c, kv_cache_dtype, s)

        k, v = scaled(k, k_scale), scaled(v, v_scale)
    k = k.astype(np.float64).reshape(n_blocks * block_size, *k.shape[2:])
    v = v.astype(np.float64).reshape(n_blocks * block_size, *v.shape[2:])
    return k[:context_len], v[:context_len]


def attend(q, k, v, scale: float, alibi_slopes=None, q_pos=None, causal: bool = True, *,
           window=None, logits_soft_cap=None, sinks=None, key_mask=None,
           return_lse: bool = False, p_fp8=None):
    """Dense attention in float64: ``q [num_heads, hs]`` (one token) or ``[q_len,
    num_heads, hs]`` against ``k [n, num_kv_heads, hs]`` and ``v [n, num_kv_heads, hv]``
    (``hv`` is the output's last dimension: ``hs`` but in MLA); query head h uses KV head
    h // (num_heads // num_kv_heads).

    ``q_pos``: each query row's position among the n keys (default: the last q_len
    positions, n - q_len + i). With ``causal`` a row sees keys at positions <= its own,
    otherwise all n. The logit of a key is ``scale * q.k``, then with ``logits_soft_cap``
    c (or a ``cupaged.SoftCap``: its cap, the tanh exact all the same) it becomes ``c *
    tanh(logit / c)`` (Gemma 2), then ALiBi adds ``slope * (key_pos -
    q_pos)``. ``window`` W keeps only keys at positions > q_pos - W (with ``causal``: the
    W positions (q_pos - W, q_pos], the row's own included; FlashInfer's ``window_left``
    is W - 1). ``sinks`` (``[num_heads]``, in logit units) adds ``exp(sink)`` to each
    row's softmax denominator and nothing to its numerator (gpt-oss). ``key_mask`` (bool,
    broadcasting against ``[num_heads, n]``) drops the keys it is False for, such as
    :func:`blocksparse_mask`'s.

    A row that sees no key gives zeros. ``return_lse`` also returns the natural log of
    each row's softmax denominator, ``[q_len, num_heads]`` (``[num_heads]`` for one
    token): -inf for a row with no key and no sink. Partial results over disjoint key
    sets merge exactly with :func:`merge_state` (give the sinks to one partial only).
    ``p_fp8`` (an fp8 kv_cache_dtype name): the weights P V takes are rounded to that
    format as 2^8 exp(logit - the row's maximum), an 8-bit query's products round them
    (the sum keeps them unrounded), relative to the final maximum where the kernel's
    running one may be lower: the size of that rounding's error, not its values."""
    q = np.asarray(q, dtype=np.float64)
    single = q.ndim == 2
    if single:
        q = q[None]
    q_len, num_heads, _ = q.shape
    n, num_kv_heads, _ = k.shape
    if q_pos is None:
        q_pos = n - q_len + np.arange(q_len)
    q_pos = np.asarray(q_pos, dtype=np.int64)
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    out = np.zeros((q_len, num_heads, v.shape[-1]))
    sink = None if sinks is None else np.asarray(sinks, dtype=np.float64)[None, :, None]
    lse = np.full((q_len, num_heads), -np.inf) if sink is None else \
        np.broadcast_to(sink[..., 0], (q_len, num_heads)).copy()
    if n and q_len:
        # Each KV head's query heads in one matrix product ([kv_heads, q_len * group, x]
        # against the head's keys or values): no copy of K or V per query head
        group = num_heads // num_kv_heads

        def by_kv_head(x):  # [q_len, num_heads, x] -> [kv_heads, q_len * group, x]
            return x.reshape(q_len, num_kv_heads, group, -1).transpose(1, 0, 2, 3).reshape(
                num_kv_heads, q_len * group, -1)

        def by_query_head(y):  # by_kv_head's inverse
            return y.reshape(num_kv_heads, q_len, group, -1).transpose(1, 0, 2, 3).reshape(
                q_len, num_heads, -1)

        logits = by_query_head(by_kv_head(q) @ np.asarray(k, np.float64).transpose(1, 2, 0))
        logits = logits * scale
        if logits_soft_cap is not None:
            c = getattr(logits_soft_cap, "cap", logits_soft_cap)  # a SoftCap: exact tanh
            logits = c * np.tanh(logits / c)
        rel = np.arange(n)[None, :] - q_pos[:, None]  # [q, n]: key position - query position
        if alibi_slopes is not None:
            logits = logits + np.asarray(alibi_slopes, dtype=np.float64)[None, :, None] * rel[:, None, :]
        mask = rel <= 0 if causal else np.ones_like(rel, dtype=bool)
        if window is not None:
            mask = mask & (rel > -window)
        visible = mask[:, None, :]
        if key_mask is not None:
            visible = visible & np.asarray(key_mask, dtype=bool)[None]
        visible = np.broadcast_to(visible, logits.shape)
        logits = np.where(visible, logits, -np.inf)
        seen = visible.any(axis=-1, keepdims=True)
        m = np.where(seen, logits.max(axis=-1, keepdims=True), -np.inf)
        if sink is not None:
            m = np.maximum(m, sink)
        m = np.where(np.isfinite(m), m, 0.0)
        w = np.where(visible, np.exp(logits - m), 0.0)
        den = w.sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - m))
        with np.errstate(divide="ignore"):
            lse = np.where(den > 0, m + np.log(np.where(den > 0, den, 1.0)), -np.inf)[..., 0]
        if p_fp8 is not None:
            fmt = _fp8_format(p_fp8, np.zeros(0))
            w = quantize_fp8(w * 256.0, fmt).astype(np.float64) / 256.0
        p = by_kv_head(w / np.where(den > 0, den, 1.0))
        out = by_query_head(p @ np.asarray(v, np.float64).transpose(1, 0, 2))
    if single:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def blocksparse_mask(seq_len: int, block_size: int, num_heads: int, num_kv_heads: int,
                     local_blocks: int, vert_stride: int, sparse_block_size: int = 64,
                     head_sliding_step: int = 0, tp_rank: int = 0):
    """vLLM's blocksparse pattern for one decode row (``paged_attention_v1/v2``'s
    ``blocksparse_*`` arguments), as bool ``[num_heads, seq_len]``: key token t of cache
    block b = t // block_size lies in sparse block ``sb = b * block_size //
    sparse_block_size`` and is kept when it is local, ``sb > (seq_len - 1) //
    sparse_block_size - local_blocks``, or strided, ``(sb + offset) % vert_stride == 0``,
    with ``offset = (tp_rank * num_heads + h) * step + 1`` for a step >= 0 (sliding over
    query heads) and ``(tp_rank * num_kv_heads + h // group) * -step + 1`` below 0 (over KV
    heads). ``num_heads`` and ``num_kv_heads`` are this rank's."""
    t = np.arange(seq_len)
    sb = (t // block_size) * block_size // sparse_block_size  # [seq_len]
    q_sb = (seq_len - 1) // sparse_block_size
    h = np.arange(num_heads)
    if head_sliding_step >= 0:
        offset = (tp_rank * num_heads + h) * head_sliding_step + 1
    else:
        offset = (tp_rank * num_kv_heads + h // (num_heads // num_kv_heads)) * -head_sliding_step + 1
    local = sb > q_sb - local_blocks
    strided = (sb[None, :] + offset[:, None]) % vert_stride == 0
    return local[None, :] | strided


def merge_state(out_a, lse_a, out_b, lse_b):
    """Two partial attentions over disjoint key sets as one, in float64: ``out [..., hs]``
    with ``lse [...]`` (natural-log softmax denominators, as :func:`attend` returns them).
    The weights are ``exp(lse - max)``; a partial with ``lse = -inf`` (no keys) is the
    identity, and two of them give zeros and -inf. Returns ``(out, lse)``."""
    out_a, out_b = np.asarray(out_a, np.float64), np.asarray(out_b, np.float64)
    lse_a, lse_b = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    m = np.maximum(lse_a, lse_b)
    finite = np.isfinite(m)
    m0 = np.where(finite, m, 0.0)
    wa = np.where(finite, np.exp(lse_a - m0), 0.0)
    wb = np.where(finite, np.exp(lse_b - m0), 0.0)
    den = wa + wb
    safe = np.where(den > 0, den, 1.0)
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / safe[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(den > 0, m0 + np.log(safe), -np.inf)
    return out, lse


def merge_states(outs, lses):
    """:func:`merge_state` over any number of partials (sequences of arrays)."""
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError("merge_states needs as many lse arrays as outputs, at least one")
    out, lse = np.asarray(outs[0], np.float64), np.asarray(lses[0], np.float64)
    for o, l in zip(outs[1:], lses[1:]):
        out, lse = merge_state(out, lse, o, l)
    return out, lse


def attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *,
              kv_layout: str = "NHD", causal: bool = True, scale=None, alibi_slopes=None,
              max_query_len=None, max_seq_len=None, kv_cache_dtype="auto", k_scale=None,
              v_scale=None, window=None, logits_soft_cap=None, sinks=None,
              blocksparse=None, return_lse: bool = False, p_fp8=None):
    """Float64 result ``[total_q, num_heads, head_size]`` of ``cupaged.attention`` (the
    last dimension is the value cache's: ``head_size`` but in MLA, :func:`mla_attention`).

    Sequence s owns query rows ``query_start_loc[s]:query_start_loc[s + 1]`` (default: one
    row each). Its ``q_len`` tokens are the last ``q_len`` of its ``seq_lens[s]`` cached
    tokens, so row i sits at position ``seq_lens[s] - q_len + i`` (bottom-right aligned);
    with ``causal`` it attends to positions up to its own, otherwise to all ``seq_lens[s]``.
    Without ``query_start_loc`` (decode) a sequence of length 0 gives a zero row.
    ``max_query_len`` and ``max_seq_len`` are accepted and ignored. An fp8 cache
    (``kv_cache_dtype``, ``k_scale``, ``v_scale`` as for the kernels) is read as
    ``stored * scale``. ``window``, ``logits_soft_cap``, ``sinks`` and ``return_lse`` (then
    ``(out, lse [total_q, num_heads])``) are :func:`attend`'s; ``blocksparse`` (decode
    only) is a dict of :func:`blocksparse_mask`'s pattern arguments (``local_blocks``,
    ``vert_stride``, ``sparse_block_size``, ``head_sliding_step``, ``tp_rank``). A query
    of a 1-byte dtype is an 8-bit query in its fp8 cache's format, read as stored (its
    scale is the caller's, in ``scale``); ``p_fp8`` as for :func:`attend`."""
    query = np.asarray(query)
    if query.dtype.itemsize == 1:
        fmt = _fp8_format(kv_cache_dtype, key_cache)
        if fmt is None:
            raise ValueError("an 8-bit query is read in its fp8 cache's format: name it with "
                             "kv_cache_dtype")
        query = query.view(fmt).astype(np.float64)
    total_q, num_heads, head_size = query.shape
    lens = np.asarray(seq_lens)
    tables = np.asarray(block_tables)
    if query_start_loc is None:
        starts = np.arange(len(lens) + 1)
    else:
        starts = np.asarray(query_start_loc).astype(np.int64)
    if starts.shape != (len(lens) + 1,) or starts[-1] != total_q:
        raise ValueError(f"query_start_loc must be [num_seqs + 1] ending at total_q={total_q}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    value_size = token_major_views(value_cache, kv_layout, False).shape[-1]  # MLA: < head_size
    out = np.zeros((total_q, num_heads, value_size))
    lse = np.full((total_q, num_heads), -np.inf)
    if sinks is not None:  # a row that sees no key still has its sink
        lse[:] = np.asarray(sinks, dtype=np.float64)[None, :]
    variants = dict(window=window, logits_soft_cap=logits_soft_cap, sinks=sinks)
    for s in range(len(lens)):
        a, b = int(starts[s]), int(starts[s + 1])
        n = int(lens[s])
        if b == a or (n == 0 and query_start_loc is None):
            continue  # (decode's convention: an empty context gives a zero row)
        if b - a > n:
            raise ValueError(f"sequence {s} has {b - a} query tokens but only {n} cached")
        k, v = gather_kv(key_cache, value_cache, tables[s], n, kv_layout, kv_cache_dtype,
                         k_scale, v_scale)
        key_mask = None
        if blocksparse is not None:
            if b - a != 1:
                raise ValueError("blocksparse is a decode pattern: one query row per sequence")
            key_mask = blocksparse_mask(n, _block_size(key_cache, kv_layout), num_heads,
                                        k.shape[1], **blocksparse)
        out[a:b], lse[a:b] = attend(query[a:b], k, v, scale, alibi_slopes, causal=causal,
                                    key_mask=key_mask, return_lse=True, p_fp8=p_fp8,
                                    **variants)
    return (out, lse) if return_lse else out


def fp8_query_error_bound(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc=None, *, kv_cache_dtype, k_scale=None,
                          v_scale=None, kv_layout: str = "NHD", scale=None, **variants):
    """Each row's error bound (its 2-norm, ``[total_q, num_heads]``) for attention with an
    8-bit ``query`` over its fp8 cache on 8-bit tensor cores, against :func:`attention`'s
    float64 result over the same bytes (arguments as there; per-tensor scales, None read
    as 1). With ``w_j`` a row's exact softmax weights (sinks in the denominator), ``o`` its
    output, ``u`` the format's rounding (2^-4 e4m3, 2^-3 e5m2):

    - the weights P V takes, 2^8 exp(logit - a running maximum) rounded to the format:
      each off by at most ``u`` of itself in the normal range, ``(u + 2^-8) sum_j w_j
      |v_j|`` with one k32 step's 8-bit sum; below it by at most half the subnormal
      spacing over 2^8 (2^-18 of the running maximum's weight in e4m3, 2^-25 in e5m2),
      ``floor * w_max * sum_j |v_j|`` over the row's keys, with ``w_max`` bounded by
      ``exp(m - lse)`` and the maximum logit ``m`` by a log-sum-exp at 2^10 times the
      logits;
    - the scores' 8-bit sums (four k32 steps of about 14 bits at head size 128: 2^-11 of
      ``|scale| sum_i |q_i k_ji| <= |scale| |q| |k_j|``, doubled for exp's curvature up to
      a logit error of 1.25): ``2^-10 |scale| |q| sum_j w_j |k_j| |v_j - o|``, taken as
      ``sqrt(sum_j w_j |k_j|^2) sqrt(sum_j w_j |v_j - o|^2)``;
    - ``2^-7 |o|``: the 16-bit output and the fp32 sums.

    Not in it: O's drift in wgmma's 8-bit accumulator across a row's tiles, which a row of
    tens of thousands of keys tests against this bound. The weighted sums are
    :func:`attention` itself, over value rows of the keys' and values' norms."""
    fmt = _fp8_format(kv_cache_dtype, key_cache)
    if fmt is None:
        raise ValueError("kv_cache_dtype must name the cache's fp8 format")
    q = np.asarray(query)
    if q.dtype.itemsize != 1:
        raise ValueError(f"query must hold 8-bit values (1-byte dtype), got {q.dtype}")
    e4m3 = fmt == _fp8_format("fp8_e4m3", key_cache)
    u, floor = (2.0 ** -4, 2.0 ** -18) if e4m3 else (2.0 ** -3, 2.0 ** -25)
    q = q.view(fmt).astype(np.float64)
    ks, vs = (1.0 if x is None else x for x in (k_scale, v_scale))
    if np.ndim(ks) or np.ndim(vs):
        raise ValueError("per-tensor k_scale and v_scale: the 8-bit query path's scales")
    k = dequantize_fp8(token_major_views(key_cache, kv_layout, True), kv_cache_dtype, ks)
    v = dequantize_fp8(token_major_views(value_cache, kv_layout, False), kv_cache_dtype, vs)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    cap = variants.pop("logits_soft_cap", None)
    cap = getattr(cap, "cap", cap)  # a SoftCap: its cap, the exact tanh's bound
    sinks = variants.pop("sinks", None)
    args = dict(block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
                kv_layout="NHD", **variants)
    ksq = np.sum(k * k, axis=-1, keepdims=True)
    vsq = np.sum(v * v, axis=-1, keepdims=True)
    feats = np.concatenate([np.sqrt(vsq), ksq, vsq, np.ones_like(ksq)], -1)
    out, lse = attention(q, k, np.concatenate([v, feats], -1), scale=scale,
                         logits_soft_cap=cap, sinks=sinks, return_lse=True, **args)
    o, (a, k2, v2, w) = out[..., :v.shape[-1]], np.moveaxis(out[..., v.shape[-1]:], -1, 0)
    on = np.linalg.norm(o, axis=-1)
    spread = np.sqrt(np.maximum(v2 - 2 * on ** 2 + w * on ** 2, 0.0))  # of sum_j w_j |v_j - o|^2
    # the largest weight: exp(m - lse), m no more than a log-sum-exp of 2^10 times the logits
    beta = 2.0 ** 10
    _, lse_b = attention(q, k, vsq, scale=beta * scale,
                         logits_soft_cap=None if cap is None else beta * cap, return_lse=True,
                         **args)
    w_max = np.minimum(np.exp(np.where(np.isfinite(lse), lse_b / beta - lse, -np.inf)), 1.0)
    # sum_j |v_j| over each row's keys: their mean (equal weights: K = 0) times their count
    mean_v, n = attention(q, np.zeros_like(k), np.sqrt(vsq), scale=scale,
                          return_lse=True, **args)
    sum_v = mean_v[..., 0] * np.exp(n)
    qn = np.linalg.norm(q, axis=-1)
    return ((u + 2.0 ** -8) * a + floor * w_max * sum_v
            + 2.0 ** -10 * abs(scale) * qn * np.sqrt(k2) * spread + 2.0 ** -7 * on)


# ---- multi-head latent attention (DeepSeek's MLA) ---------------------------------------------


def mla_cache_views(kv_cache, k_pe_cache=None, kv_lora_rank: int | None = None):
    """The latent and rotary parts of an MLA cache, ``[num_blocks, block_size,
    kv_lora_rank]`` and ``[num_blocks, block_size, rope_dim]`` (writable views): vLLM's
    combined ``kv_cache [num_blocks, block_size, kv_lora_rank + rope_dim]``, or
    FlashInfer's pair ``kv_cache [.., kv_lora_rank]`` and ``k_pe_cache [.., rope_dim]``
    (``kv_lora_rank`` None: the pair's, or 512 for a combined cache)."""
    kv_cache = np.asarray(kv_cache)
    if kv_cache.ndim != 3:
        raise ValueError(f"an MLA cache is [num_blocks, block_size, dims], got {kv_cache.shape}")
    if kv_lora_rank is None:
        kv_lora_rank = 512 if k_pe_cache is None else kv_cache.shape[-1]
    if k_pe_cache is None:
        if kv_cache.shape[-1] <= kv_lora_rank:
            raise ValueError(f"kv_cache's last dimension ({kv_cache.shape[-1]}) must hold "
                             f"kv_lora_rank ({kv_lora_rank}) latent values and the rotary ones")
        return kv_cache[..., :kv_lora_rank], kv_cache[..., kv_lora_rank:]
    k_pe_cache = np.asarray(k_pe_cache)
    if kv_cache.shape[-1] != kv_lora_rank or k_pe_cache.shape[:2] != kv_cache.shape[:2]:
        raise ValueError(f"kv_cache {kv_cache.shape} and k_pe_cache {k_pe_cache.shape} must "
                         f"be [num_blocks, block_size, {kv_lora_rank}] and [num_blocks, "
                         f"block_size, rope_dim]")
    return kv_cache, k_pe_cache


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype="auto", scale=None,
                         *, k_pe_cache=None) -> None:
    """What the latent cache write stores (vLLM's ``concat_and_cache_mla``), into a host
    cache in place: token i's ``kv_c[i]`` (``[num_tokens, kv_lora_rank]``) and ``k_pe[i]``
    (``[num_tokens, rope_dim]``) at slot ``slot_mapping[i]`` (block ``slot //
    block_size``, offset ``slot % block_size``) of :func:`mla_cache_views`' caches; a
    negative slot (padding) is skipped. An fp8 cache stores :func:`quantize_fp8` of the
    values with the per-tensor ``scale`` (1 when None)."""
    kv_c, k_pe = np.asarray(kv_c), np.asarray(k_pe)
    latent, rope = mla_cache_views(kv_cache, k_pe_cache, kv_c.shape[-1])
    fmt = _fp8_format(kv_cache_dtype, kv_cache)
    block_size = latent.shape[1]
    for i, slot in enumerate(np.asarray(slot_mapping).astype(np.int64)):
        if slot < 0:
            continue
        b, o = divmod(int(slot), block_size)
        for src, dst in ((kv_c[i], latent), (k_pe[i], rope)):
            if fmt is None:
                dst[b, o] = src.astype(dst.dtype)
            else:
                dst[b, o] = quantize_fp8(src, fmt, 1.0 if scale is None else scale).view(dst.dtype)


def mla_attention(q, kv_cache, block_tables, seq_lens, query_start_loc=None, *, scale: float,
                  kv_lora_rank: int | None = None, k_pe_cache=None, causal: bool = True,
                  kv_cache_dtype="auto", k_scale=None, return_lse: bool = False):
    """Float64 absorbed multi-head latent attention (DeepSeek's MLA) over a paged latent
    cache: ``[total_q, num_heads, kv_lora_rank]``, the latent output each head's ``W_UV``
    then maps to its values.

    ``q`` is ``[total_q, num_heads, kv_lora_rank + rope_dim]``, each head's absorbed
    ``W_UK q_nope`` (``W_UK`` of head h ``[kv_lora_rank, qk_nope_head_dim]``, mapping
    ``kv_c`` to the head's ``k_nope``) followed by its ``q_pe``, or the pair
    ``(q_latent, q_pe)``. ``kv_lora_rank`` (None: 512, or a cache pair's own) splits a
    combined cache; see :func:`mla_cache_views`. A token's
    key is its whole cached vector (``[kv_c, k_pe]``), its value the latent ``kv_c``: one
    KV head shared by every query head. ``scale`` has no default: DeepSeek's is
    ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (times YaRN's mscale squared), not
    one over the root of the key's length. Rows, positions and ``causal`` are
    :func:`attention`'s; an fp8 cache is read as ``stored * k_scale``. ``return_lse``:
    also ``[total_q, num_heads]``."""
    if isinstance(q, (tuple, list)):
        q = np.concatenate([np.asarray(q[0], np.float64), np.asarray(q[1], np.float64)], -1)
    q = np.asarray(q)
    latent, rope = mla_cache_views(kv_cache, k_pe_cache, kv_lora_rank)
    if q.shape[-1] != latent.shape[-1] + rope.shape[-1]:
        raise ValueError(f"q's last dimension ({q.shape[-1]}) must be kv_lora_rank + rope_dim "
                         f"({latent.shape[-1]} + {rope.shape[-1]})")
    fmt = _fp8_format(kv_cache_dtype, latent)

    def widen(c):
        return np.asarray(c, np.float64) if fmt is None else dequantize_fp8(
            c, kv_cache_dtype, 1.0 if k_scale is None else k_scale)

    key = np.concatenate([widen(latent), widen(rope)], -1)[:, :, None, :]  # NHD, 1 KV head
    value = widen(latent)[:, :, None, :]
    return attention(q, key, value, block_tables, seq_lens, query_start_loc, kv_layout="NHD",
                     causal=causal, scale=scale, return_lse=return_lse)


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, *, scale=None,
                    alibi_slopes=None, max_context_len=None, kv_cache_dtype="auto",
                    k_scale=None, v_scale=None, **variants):
    """Float64 result ``[num_seqs, num_heads, head_size]`` of the same call as
    :func:`cupaged.paged_attention` (decode over vLLM's layout). ``max_context_len`` is
    accepted and ignored; ``variants`` (window, logits_soft_cap, sinks, return_lse) are
    :func:`attention`'s."""
    return attention(query, key_cache, value_cache, block_tables, context_lens,
                     kv_layout="vllm", scale=scale, alibi_slopes=alibi_slopes,
                     kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
                     **variants)


# ---- DeepSeek sparse attention (DSA): sparse MLA over top-k indices ---------------------------
#
# DeepSeek-V3.2 and V4 attend each query token to its top-k cached tokens only (k = 2048 for
# V3.2), named by global slots of a paged cache; FlashMLA's sparse kernels and vLLM's caches
# define the interface. cupaged.sparse_mla_attention reads 16-bit caches and the three
# formats (not a second cache); cupaged.concat_and_cache_mla writes the three formats.

SPARSE_KV_FORMATS = {
    # name: (bytes per token, dims per token (d_qk)); "auto" caches hold the values themselves
    "fp8_ds_mla": (656, 576),
    "v4_fp8": (528, 512),
    "v4_fp4": (288, 512),
}

_FLT_MIN = np.float32(1.1754943508222875e-38)  # the smallest normal float32 (CUDA's FLT_MIN)
_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0-7; bit 3 is the sign


def _e4m3_bytes(y):
    """float32 ``y`` as e4m3 bytes (uint8), as CUDA's ``__nv_cvt_float_to_fp8(y,
    __NV_SATFINITE, __NV_E4M3)`` stores them: rounded to nearest even, saturated to +-448,
    NaN as 0x7F whatever its sign (CUDA's canonical NaN; ml_dtypes and torch keep the sign
    bit, 0xFF)."""
    import ml_dtypes

    y = np.asarray(y, np.float32)
    b = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.where(np.isnan(y), np.uint8(0x7F), b)


def _e4m3_values(b):
    """e4m3 bytes as float64 (0x7F and 0xFF are NaN)."""
    import ml_dtypes

    return np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _ue8m0_values(b):
    """ue8m0 bytes (a power of two's biased exponent) as float64: ``2 ** (byte - 127)``,
    0xFF NaN (ml_dtypes' float8_e8m0fnu)."""
    b = np.asarray(b, np.uint8)
    return np.where(b == 0xFF, np.nan, np.ldexp(1.0, b.astype(np.int64) - 127))


def _e2m1_values(nibbles):
    """e2m1 codes (0-15) as float64: ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, bit 3 the sign."""
    n = np.asarray(nibbles, np.uint8)
    return np.where(n & 8, -1.0, 1.0) * _E2M1_VALUES[n & 7]


def _group_amax(x, group: int):
    """Per-group ``max |x|`` of float32 ``x [..., d]`` over groups of ``group`` values, as
    CUDA's ``fmaxf`` reduces: NaN is skipped (a group of NaN only gives NaN)."""
    a = np.abs(x.reshape(*x.shape[:-1], -1, group))
    return np.fmax.reduce(a, axis=-1)


def _bf16_bytes(x):
    """``x`` rounded to bfloat16 (nearest even; exact for bfloat16 input), as bytes."""
    import ml_dtypes

    return np.ascontiguousarray(np.asarray(x).astype(ml_dtypes.bfloat16)).view(np.uint8)


def quantize_sparse_kv(x, kv_format: str):
    """Tokens ``x [..., d_qk]`` (any float dtype) as their cache bytes ``uint8 [...,
    bytes_per_token]`` in ``kv_format`` (:data:`SPARSE_KV_FORMATS`); everything is computed
    in float32 from ``x`` widened to float32.

    - ``"fp8_ds_mla"`` (DeepSeek-V3.2, vLLM's name; 656 bytes): ``x`` is ``[kv_c (512),
      k_pe (64)]``. Bytes 0-511: ``kv_c`` in e4m3, each group of 128 divided by its scale;
      512-527: the 4 scales, float32, ``max(amax / 448, FLT_MIN)`` (amax of the group's
      ``|kv_c|``, NaN skipped); 528-655: ``k_pe`` as bfloat16. Bit for bit vLLM's
      ``concat_and_cache_mla(.., "fp8_ds_mla", ..)`` (its ``concat_and_cache_ds_mla_kernel``,
      bf16 sources): no power-of-two rounding of the scale (FlashMLA's test quantizer rounds
      it up to one; readers take any float32).
    - ``"v4_fp8"`` (528 bytes): the 512 values in e4m3 (bytes 0-511), each group of 32
      divided by its scale, then 16 ue8m0 scales (bytes 512-527): a power of two, rounded
      UP from the group's ``amax / 448`` (so nothing saturates), at least 2^-126 (a normal
      float32; an all-zero group gets 2^-126), stored as its biased exponent ``e + 127``.
    - ``"v4_fp4"`` (288 bytes): the 512 values in e2m1 (bytes 0-255, value 2i in the low
      nibble of byte i, 2i + 1 in the high one), each group of 16 divided by its scale, then
      32 e4m3 scales (bytes 256-287): the smallest e4m3 value at least ``amax / 6`` (rounded
      up, so nothing saturates but for a group above 448 * 6), at least 2^-9 (e4m3's
      smallest; an all-zero group gets it).

    e4m3 values round to nearest even and saturate to +-448 (CUDA's ``__NV_SATFINITE``),
    e2m1 values round to nearest even and saturate to +-6. NaN: fp8 formats store it as
    0x7F (the group's scale skips it; a group of NaN only gets FLT_MIN, resp. 2^-126);
    ``"v4_fp4"`` has no NaN and raises ValueError for one (``cupaged.concat_and_cache_mla``,
    which cannot raise, stores what this gives for the token with 0 in the NaN's place).
    An infinite value: ``"fp8_ds_mla"`` makes its group's scale infinite (vLLM's rule), so
    the group reads back as NaN and zeros; ``"v4_fp8"`` gives its group the scale 2^0
    (byte 127), so the group's values are stored as they are, saturated (the infinity as
    +-448); ``"v4_fp4"`` gives its group the largest scale, 448 (byte 0x7E), and stores
    the infinity as +-6."""
    if kv_format not in SPARSE_KV_FORMATS:
        raise ValueError(f"kv_format must be one of {tuple(SPARSE_KV_FORMATS)}, got {kv_format!r}")
    nbytes, d = SPARSE_KV_FORMATS[kv_format]
    x = np.asarray(x)
    if x.shape[-1] != d:
        raise ValueError(f"{kv_format} tokens have {d} values, got x of shape {x.shape}")
    with np.errstate(invalid="ignore", over="ignore"):  # inf / inf is NaN, stored 0x7F
        return _quantize_sparse_kv(x, kv_format, nbytes)


def _quantize_sparse_kv(x, kv_format: str, nbytes: int):
    lead = x.shape[:-1]
    x32 = x.astype(np.float32)
    out = np.zeros((*lead, nbytes), np.uint8)
    if kv_format == "fp8_ds_mla":
        kv_c = x32[..., :512]
        s = np.fmax(_group_amax(kv_c, 128) / np.float32(448), _FLT_MIN).astype(np.float32)
        y = kv_c.reshape(*lead, 4, 128) / s[..., None]  # float32 IEEE division, as vLLM's
        out[..., :512] = _e4m3_bytes(y).reshape(*lead, 512)
        out[..., 512:528] = np.ascontiguousarray(s.astype("<f4")).view(np.uint8)
        out[..., 528:] = _bf16_bytes(x[..., 512:])
    elif kv_format == "v4_fp8":
        q = _group_amax(x32, 32) / np.float32(448)
        mant, exp = np.frexp(np.where(np.isnan(q), 0, q).astype(np.float32))
        e = np.where(mant == 0.5, exp - 1, exp)  # ceil(log2(q)) exactly, from q's bits
        # q = inf (a group holding an infinity): e = 0, the exponent glibc's frexp gives an
        # infinity, named here since C leaves it unspecified; the scale is 2^0
        e = np.where(np.isinf(q), 0, e)
        e = np.clip(np.where(q > 0, e, -126), -126, 127).astype(np.int64)
        s = np.ldexp(np.float32(1), e).astype(np.float32)
        y = x32.reshape(*lead, 16, 32) / s[..., None]
        out[..., :512] = _e4m3_bytes(y).reshape(*lead, 512)
        out[..., 512:] = (e + 127).astype(np.uint8)
    else:  # v4_fp4
        if np.isnan(x32).any():
            raise ValueError("v4_fp4 has no NaN: x holds one")
        q = (_group_amax(x32, 16) / np.float32(6)).astype(np.float32)
        sb = _e4m3_bytes(q)
        up = (_e4m3_values(sb) < q) & (sb < 0x7E)  # rounded down: the next e4m3 value up
        sb = np.maximum(np.where(up, sb + 1, sb), 1).astype(np.uint8)  # >= 2^-9, byte 0x01
        s = _e4m3_values(sb).astype(np.float32)
        y = np.clip(x32.reshape(*lead, 32, 16) / s[..., None], -6, 6).reshape(*lead, 512)
        codes = _e2m1_codes(y)
        out[..., :256] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        out[..., 256:] = sb
    return out


def _e2m1_codes(y):
    """float32 ``y`` (finite, within +-6) as e2m1 codes, rounded to nearest even."""
    import ml_dtypes

    return np.asarray(y, np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def dequantize_sparse_kv(cache, kv_format: str = "auto"):
    """The values of a sparse-attention cache's tokens, float64 ``[..., d_qk]``: a cache of
    ``kv_format`` bytes ``[..., bytes_per_token]`` (uint8 or any 1-byte dtype; see
    :func:`quantize_sparse_kv`), read as ``stored * scale`` exactly (``"fp8_ds_mla"``:
    ``[kv_c (512), k_pe (64)]``, its scales taken as any float32), or an ``"auto"`` cache
    of the values themselves (any float dtype)."""
    c = np.asarray(cache)
    if kv_format == "auto":
        return c.astype(np.float64)
    if kv_format not in SPARSE_KV_FORMATS:
        raise ValueError(f"kv_format must be 'auto' or one of {tuple(SPARSE_KV_FORMATS)}, "
                         f"got {kv_format!r}")
    nbytes, d = SPARSE_KV_FORMATS[kv_format]
    if c.dtype.itemsize != 1 or c.shape[-1] != nbytes:
        raise ValueError(f"a {kv_format} cache is 1-byte [..., {nbytes}], got {c.dtype} "
                         f"{c.shape}")
    b = np.ascontiguousarray(c).view(np.uint8)
    lead = b.shape[:-1]
    if kv_format == "fp8_ds_mla":
        s = np.ascontiguousarray(b[..., 512:528]).view("<f4").astype(np.float64)  # [..., 4]
        kv_c = _e4m3_values(b[..., :512]).reshape(*lead, 4, 128) * s[..., None]
        import ml_dtypes
        k_pe = np.ascontiguousarray(b[..., 528:]).view(ml_dtypes.bfloat16).astype(np.float64)
        return np.concatenate([kv_c.reshape(*lead, 512), k_pe], -1)
    if kv_format == "v4_fp8":
        s = _ue8m0_values(b[..., 512:])  # [..., 16]
        v = _e4m3_values(b[..., :512]).reshape(*lead, 16, 32)
        return (v * s[..., None]).reshape(*lead, 512)
    s = _e4m3_values(b[..., 256:])  # v4_fp4: [..., 32]
    v = np.stack([_e2m1_values(b[..., :256] & 0xF), _e2m1_values(b[..., :256] >> 4)], -1)
    return (v.reshape(*lead, 32, 16) * s[..., None]).reshape(*lead, 512)


def concat_and_cache_sparse_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_format="fp8_ds_mla"):
    """What a sparse-attention cache write stores, into a host cache in place: token i's
    :func:`quantize_sparse_kv` bytes at slot ``slot_mapping[i]`` (block ``slot //
    block_size``, offset ``slot % block_size``) of ``kv_cache [num_blocks, block_size,
    bytes_per_token]`` (or ``[num_blocks, block_size, 1, bytes_per_token]``, FlashMLA's),
    uint8 or any 1-byte dtype; a negative slot (padding) is skipped. ``"fp8_ds_mla"``:
    ``kv_c [num_tokens, 512]`` and ``k_pe [num_tokens, 64]``, vLLM's
    ``concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, "fp8_ds_mla", scale)`` (which
    ignores its ``scale``); the V4 formats: ``kv_c [num_tokens, 512]`` holds the whole vector
    (its rotary dims inside) and ``k_pe`` is None, or the vector is ``kv_c``'s values then
    ``k_pe``'s (``[num_tokens, r]`` and ``[num_tokens, 512 - r]``, as
    ``cupaged.concat_and_cache_mla`` takes it)."""
    kv_c = np.asarray(kv_c)
    # concatenation widens exactly (bfloat16 with bfloat16 stays bfloat16), so k_pe is
    # rounded to bfloat16 from its own values
    x = kv_c if k_pe is None else np.concatenate([kv_c, np.asarray(k_pe)], -1)
    cache = np.asarray(kv_cache)
    nbytes = SPARSE_KV_FORMATS[kv_format][0] if kv_format in SPARSE_KV_FORMATS else None
    if nbytes is None or cache.dtype.itemsize != 1 or cache.shape[-1] != nbytes \
            or cache.ndim not in (3, 4) or (cache.ndim == 4 and cache.shape[2] != 1):
        raise ValueError(f"kv_cache must be 1-byte [num_blocks, block_size, (1,) {nbytes}] "
                         f"for {kv_format!r}, got {cache.dtype} {cache.shape}")
    rows = kv_cache.reshape(cache.shape[0], cache.shape[1], nbytes).view(np.uint8)
    if not np.shares_memory(rows, kv_cache):
        raise ValueError("kv_cache must be writable in place (a contiguous array)")
    block_size = cache.shape[1]
    new = quantize_sparse_kv(x, kv_format)
    for i, slot in enumerate(np.asarray(slot_mapping).astype(np.int64)):
        if slot < 0:
            continue
        b, o = divmod(int(slot), block_size)
        rows[b, o] = new[i]


def _sparse_scope(cache, indices, topk_length, kv_format, decode, shape, name):
    """One cache's part of a sparse call: its tokens' values ``[num_slots, d_qk]`` (slot =
    flat index over the cache's leading dims), the rows' indices ``[rows, topk]`` (int64,
    invalid ones 0) and their validity ``[rows, topk]``."""
    c = np.asarray(cache)
    if decode and not (c.ndim == 3 or (c.ndim == 4 and c.shape[2] == 1)):
        raise ValueError(f"{name} must be [num_blocks, page_size, 1, width] (or without the "
                         f"1), got {c.shape}")
    if not decode and not (c.ndim == 2 or (c.ndim == 3 and c.shape[1] == 1)):
        raise ValueError(f"{name} must be [s_kv, 1, width] (or [s_kv, width]), got {c.shape}")
    tokens = dequantize_sparse_kv(c.reshape(-1, c.shape[-1]), kv_format)
    n = tokens.shape[0]
    rows = int(np.prod(shape))
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"{name}'s indices must be integers, got {idx.dtype}")
    if decode:
        if idx.ndim != 3 or idx.shape[:2] != shape:
            raise ValueError(f"{name}'s indices must be [batch, s_q, topk] = [{shape[0]}, "
                             f"{shape[1]}, topk], got {idx.shape}")
    else:
        if idx.ndim == 3 and idx.shape[1] == 1:
            idx = idx[:, 0]
        if idx.ndim != 2 or idx.shape[0] != shape[0]:
            raise ValueError(f"{name}'s indices must be [s_q, 1, topk] (or [s_q, topk]) with "
                             f"s_q = {shape[0]}, got {np.asarray(indices).shape}")
    idx = idx.reshape(rows, -1).astype(np.int64)
    topk = idx.shape[1]
    counted = np.ones_like(idx, dtype=bool)
    if topk_length is not None:
        tl = np.asarray(topk_length).astype(np.int64)
        if tl.shape != shape[:1]:
            raise ValueError(f"{name}'s topk_length must be [{shape[0]}] (one per "
                             f"{'batch entry' if decode else 'query token'}), got {tl.shape}")
        per_row = np.repeat(tl, rows // shape[0])
        counted = np.arange(topk)[None, :] < per_row[:, None]
    inside = (idx >= 0) & (idx < n)
    if decode:  # FlashMLA's decode skips -1 only: any other index outside the cache is a bug
        bad = counted & ~inside & (idx != -1)
        if bad.any():
            r, j = np.argwhere(bad)[0]
            raise ValueError(f"{name}'s index {idx[r, j]} (row {r}, entry {j}) is neither -1 "
                             f"nor a slot of the cache's {n}")
    valid = counted & inside
    return tokens, np.where(valid, idx, 0), valid


def sparse_mla_attention(q, kv_cache, indices, *, scale: float, kv_format: str = "auto",
                         topk_length=None, attn_sink=None, extra_kv_cache=None,
                         extra_indices=None, extra_topk_length=None, d_v: int = 512,
                         return_lse: bool = False):
    """Float64 sparse multi-head latent attention (DeepSeek sparse attention, DeepSeek-V3.2
    and V4): each query token attends to the cached tokens its indices name, FlashMLA's
    ``flash_mla_with_kvcache(.., indices=..)`` (decode) and ``flash_mla_sparse_fwd``
    (prefill) semantics.

    Shapes (one KV head, shared by every query head, as in :func:`mla_attention`):

    - decode: ``q [batch, s_q, num_heads, d_qk]``; ``kv_cache [num_blocks, page_size, 1,
      width]`` (or ``[num_blocks, page_size, width]``, vLLM's); ``indices [batch, s_q,
      topk]``, each a global slot ``block * page_size + offset`` (no block table);
      ``topk_length [batch]``. Out ``[batch, s_q, num_heads, d_v]``, lse ``[batch, s_q,
      num_heads]`` (FlashMLA returns lse as ``[batch, num_heads, s_q]``: this one's
      ``transpose(0, 2, 1)``).
    - prefill: ``q [s_q, num_heads, d_qk]`` (sequences concatenated); ``kv_cache [s_kv, 1,
      width]``; ``indices [s_q, 1, topk]`` (or ``[s_q, topk]``) into the s_kv tokens;
      ``topk_length [s_q]``. Out ``[s_q, num_heads, d_v]``, lse ``[s_q, num_heads]``.

    The cache is ``kv_format`` (:data:`SPARSE_KV_FORMATS`, read by
    :func:`dequantize_sparse_kv`: ``"fp8_ds_mla"`` for V3.2's 656-byte tokens, whose d_qk is
    576; ``"v4_fp8"``/``"v4_fp4"``, d_qk 512) or ``"auto"``, the values themselves (width =
    d_qk; FlashMLA's bf16 prefill ``kv``). A token's key is its whole vector, its value the
    first ``d_v`` (512) of it: ``kv_c`` for V3.2, the whole vector (its rotary dims inside)
    for V4.

    Index semantics (FlashMLA's): entry j of a row counts when ``j < topk_length`` (of its
    batch entry in decode, of the query token in prefill; every entry without
    ``topk_length``) and its index is valid: in decode any slot of the cache, -1 marking
    an invalid entry (any other index outside the cache, where FlashMLA's kernel would read
    out of bounds, raises ValueError); in prefill any index in ``[0, s_kv)``, everything
    else (-1, other negatives, s_kv and beyond) invalid. Entries that do not count are
    never read, so whatever they hold (past ``topk_length`` anything) has no effect. A
    repeated index counts each time it appears (its key's weight is doubled), as
    FlashMLA's kernels and reference gather them. ``extra_kv_cache`` with
    ``extra_indices`` (and ``extra_topk_length``) adds a second cache of the same format
    and d_qk (V4's ``extra_k_cache``; its own page size) whose counted entries join the
    same softmax.

    The logit of a counted entry is ``scale * q . key`` (``scale`` required: DeepSeek's is
    not ``1 / sqrt(d_qk)``); out is the softmax-weighted sum of the values and lse the
    natural log of the softmax denominator (FlashMLA's decode reports it natural too; its
    prefill, ``flash_mla_sparse_fwd``, in base 2: this lse times log2(e)). ``attn_sink [num_heads]`` (float32 in FlashMLA) scales each head's
    out by ``exp(lse) / (exp(lse) + exp(sink))`` and leaves lse as it is, FlashMLA's rule:
    so lse here is the keys' alone, and ``np.logaddexp(lse, sink)`` is :func:`attend`'s lse
    with ``sinks`` (whose out is the same). A sink of +inf gives zeros, -inf changes
    nothing.

    A row none of whose entries counts (all -1, ``topk_length`` 0) gives zeros and lse
    ``-inf``, cupaged's convention for rows that see no key (FlashMLA returns lse +inf
    there, out zeros). ``return_lse``: return ``(out, lse)``."""
    q = np.asarray(q, dtype=np.float64)
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be [batch, s_q, num_heads, d_qk] (decode) or [s_q, "
                         f"num_heads, d_qk] (prefill), got {q.shape}")
    decode = q.ndim == 4
    shape = q.shape[:-2]
    num_heads, d_qk = q.shape[-2:]
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError("extra_kv_cache and extra_indices come together")
    if extra_topk_length is not None and extra_kv_cache is None:
        raise ValueError("extra_topk_length needs extra_kv_cache")
    scopes = [_sparse_scope(kv_cache, indices, topk_length, kv_format, decode, shape,
                            "kv_cache")]
    if extra_kv_cache is not None:
        scopes.append(_sparse_scope(extra_kv_cache, extra_indices, extra_topk_length,
                                    kv_format, decode, shape, "extra_kv_cache"))
    for tokens, _, _ in scopes:
        if tokens.shape[-1] != d_qk:
            raise ValueError(f"q's d_qk ({d_qk}) must be the cache tokens' width "
                             f"({tokens.shape[-1]})")
    if not 0 < d_v <= d_qk:
        raise ValueError(f"d_v must be in [1, d_qk = {d_qk}], got {d_v}")
    rows = int(np.prod(shape))
    qr = q.reshape(rows, num_heads, d_qk)
    out = np.zeros((rows, num_heads, d_v))
    lse = np.full((rows, num_heads), -np.inf)
    for r in range(rows):
        keys = np.concatenate([t[i[r][v[r]]] for t, i, v in scopes], 0)  # counted entries
        if keys.shape[0] == 0:
            continue  # no key: zeros and -inf
        logits = qr[r] @ keys.T * scale  # [heads, n]
        m = logits.max(-1, keepdims=True)
        w = np.exp(logits - m)
        den = w.sum(-1, keepdims=True)
        out[r] = (w / den) @ keys[:, :d_v]
        lse[r] = (m + np.log(den))[:, 0]
    if attn_sink is not None:
        sink = np.asarray(attn_sink, dtype=np.float64)
        if sink.shape != (num_heads,):
            raise ValueError(f"attn_sink must be [num_heads] = [{num_heads}], got {sink.shape}")
        seen = np.isfinite(lse)
        with np.errstate(invalid="ignore"):
            factor = np.exp(lse - np.logaddexp(lse, sink[None, :]))  # exp(lse) / (.. + exp(sink))
        out *= np.where(seen, factor, 0.0)[..., None]
    out = out.reshape(*shape, num_heads, d_v)
    lse = lse.reshape(*shape, num_heads)
    return (out, lse) if return_lse else out


# ---- DSA's lightning indexer: its keys' fp8 cache, the logits, the top-k -------------------
#
# The indexer picks each query token's top-k cached tokens, the indices
# sparse_mla_attention reads. Its keys (one head of head_dim values, 128 for DeepSeek-V3.2,
# shared by the indexer's query heads) live in a paged cache of their own, vLLM's layout:
# a block of block_size tokens holds their e4m3 values token-major (block_size * head_dim
# bytes), then their float32 scales (head_dim / quant_block_size a token), so a token takes
# head_dim + 4 * head_dim / quant_block_size bytes (132 for V3.2: one scale a token).


def indexer_cache_width(head_dim: int = 128, quant_block_size: int = 128) -> int:
    """Bytes a token takes in the indexer's key cache (the cache's last dimension)."""
    if head_dim <= 0 or quant_block_size <= 0 or head_dim % quant_block_size:
        raise ValueError(f"head_dim ({head_dim}) must be a positive multiple of "
                         f"quant_block_size ({quant_block_size})")
    return head_dim + 4 * (head_dim // quant_block_size)


def quantize_indexer_k(k, quant_block_size: int = 128, ue8m0: bool = False):
    """The indexer keys ``k [..., head_dim]`` (any float dtype) as stored: ``(values uint8
    [..., head_dim] e4m3, scales float32 [..., head_dim / quant_block_size])``, computed in
    float32 from ``k`` widened. A group's scale is ``max(amax, 1e-4) / 448`` (amax of its
    ``|k|``, NaN skipped), rounded up to a power of two with ``ue8m0`` (``2 **
    ceil(log2(scale))``); its values are ``k / scale`` rounded to nearest even and saturated
    to +-448 (NaN stored as 0x7F): vLLM's ``indexer_k_quant_and_cache``."""
    k = np.asarray(k)
    d = k.shape[-1]
    indexer_cache_width(d, quant_block_size)
    lead = k.shape[:-1]
    k32 = k.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = _group_amax(k32, quant_block_size)
        s = (np.fmax(amax, np.float32(1e-4)) / np.float32(448)).astype(np.float32)
        if ue8m0:
            mant, exp = np.frexp(s)
            e = np.where(mant == 0.5, exp - 1, exp)  # ceil(log2(s)) exactly, from s's bits
            s = np.where(np.isfinite(s), np.ldexp(np.float32(1), e), s).astype(np.float32)
        y = k32.reshape(*lead, -1, quant_block_size) / s[..., None]
    return _e4m3_bytes(y).reshape(*lead, d), s


def _indexer_blocks(kv_cache, head_dim: int, quant_block_size: int):
    """The cache as ``[num_blocks, block_size * width]`` bytes (a view where possible)."""
    c = np.asarray(kv_cache)
    width = indexer_cache_width(head_dim, quant_block_size)
    if c.dtype.itemsize != 1 or c.shape[-1] != width or c.ndim not in (3, 4) \
            or (c.ndim == 4 and c.shape[2] != 1):
        raise ValueError(f"the indexer's kv_cache must be 1-byte [num_blocks, block_size, "
                         f"(1,) {width}], got {c.dtype} {c.shape}")
    return c.reshape(c.shape[0], -1).view(np.uint8), c.shape[1]


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size: int = 128,
                              ue8m0: bool = False):
    """What the indexer's cache write stores, into a host cache in place (vLLM's
    ``indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)``):
    token i of ``k [num_tokens, head_dim]`` at slot ``slot_mapping[i]`` (block ``slot //
    block_size``, offset o ``slot % block_size``) of ``kv_cache [num_blocks, block_size,
    width]`` (or ``[.., 1, width]``; 1-byte, C-contiguous), :func:`quantize_indexer_k`'s
    values at bytes ``o * head_dim`` of the block and its scales (float32) at bytes
    ``block_size * head_dim + 4 * o * (head_dim / quant_block_size)``. A negative slot
    (padding) is skipped."""
    k = np.asarray(k)
    if k.ndim != 2:
        raise ValueError(f"k must be [num_tokens, head_dim], got {k.shape}")
    d = k.shape[1]
    blocks, block_size = _indexer_blocks(kv_cache, d, quant_block_size)
    if not np.shares_memory(blocks, kv_cache):
        raise ValueError("kv_cache must be writable in place (a contiguous array)")
    values, scales = quantize_indexer_k(k, quant_block_size, ue8m0)
    g = d // quant_block_size
    for i, slot in enumerate(np.asarray(slot_mapping).astype(np.int64)):
        if slot < 0:
            continue
        b, o = divmod(int(slot), block_size)
        blocks[b, o * d:(o + 1) * d] = values[i]
        at = block_size * d + 4 * o * g
        blocks[b, at:at + 4 * g] = np.ascontiguousarray(scales[i].astype("<f4")).view(np.uint8)


def dequantize_indexer_k(kv_cache, head_dim: int = 128, quant_block_size: int = 128):
    """The indexer cache's keys in float64, ``[num_blocks, block_size, head_dim]``: each
    e4m3 value times its group's float32 scale."""
    blocks, block_size = _indexer_blocks(kv_cache, head_dim, quant_block_size)
    n, d, g = blocks.shape[0], head_dim, head_dim // quant_block_size
    values = _e4m3_values(blocks[:, :block_size * d]).reshape(n, block_size, g, -1)
    scales = np.ascontiguousarray(blocks[:, block_size * d:block_size * (d + 4 * g)])
    scales = scales.view("<f4").astype(np.float64).reshape(n, block_size, g)
    return (values * scales[..., None]).reshape(n, block_size, d)


def _rows_of(seq_lens, query_start_loc, total_q: int):
    """Each query row's (sequence, position): the last q_len of its sequence's tokens, as
    :func:`attention` places them (one row a sequence, at its last token, without starts)."""
    lens = np.asarray(seq_lens).astype(np.int64)
    starts = (np.arange(len(lens) + 1) if query_start_loc is None
              else np.asarray(query_start_loc).astype(np.int64))
    if starts.shape != (len(lens) + 1,) or starts[0] != 0 or starts[-1] != total_q \
            or (np.diff(starts) < 0).any() or (np.diff(starts) > lens).any():
        raise ValueError(f"query_start_loc must run from 0 to total_q = {total_q}, "
                         f"non-decreasing, each q_len <= its seq_lens, got {starts}")
    seq = np.repeat(np.arange(len(lens)), np.diff(starts))
    pos = lens[seq] - (starts[seq + 1] - starts[seq]) + (np.arange(total_q) - starts[seq])
    return seq, pos


def indexer_logits(q, kv_cache, weights, block_tables, seq_lens, query_start_loc=None, *,
                   quant_block_size: int = 128, max_seq_len: int | None = None):
    """Float64 logits of the lightning indexer over its paged fp8 key cache (DeepGEMM's
    ``fp8_paged_mqa_logits``, vLLM's reference): row i, cached token j,
    ``sum_h weights[i, h] * relu(q[i, h] . key_j)`` for the keys its row sees, -inf for
    the others.

    ``q [total_q, num_heads, head_dim]`` (any float dtype: an fp8 query is passed as its
    values, its scale folded into ``weights`` as the model does); ``kv_cache`` the
    indexer's cache (:func:`indexer_k_quant_and_cache`), read by
    :func:`dequantize_indexer_k`; ``weights [total_q, num_heads]``; ``block_tables``,
    ``seq_lens`` and ``query_start_loc`` as :func:`attention`'s (DeepGEMM's ``[batch,
    next_n]`` query is ``query_start_loc = arange(batch + 1) * next_n``): a row at position
    p sees its sequence's tokens 0..p. Returns ``[total_q, max_seq_len]`` (default:
    ``block_tables.shape[1] * block_size``), column j the sequence's token j."""
    q = np.asarray(q, dtype=np.float64)
    if q.ndim != 3:
        raise ValueError(f"q must be [total_q, num_heads, head_dim], got {q.shape}")
    total_q, num_heads, d = q.shape
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (total_q, num_heads):
        raise ValueError(f"weights must be [total_q, num_heads] = [{total_q}, {num_heads}], "
                         f"got {w.shape}")
    keys = dequantize_indexer_k(kv_cache, d, quant_block_size)
    block_size = keys.shape[1]
    bt = np.asarray(block_tables).astype(np.int64)
    width = bt.shape[1] * block_size if max_seq_len is None else int(max_seq_len)
    seq, pos = _rows_of(seq_lens, query_start_loc, total_q)
    logits = np.full((total_q, width), -np.inf)
    for i in range(total_q):
        n = min(int(pos[i]) + 1, width)
        if n <= 0:
            continue
        t = np.arange(n)
        k = keys[bt[seq[i], t // block_size], t % block_size]  # [n, d]
        logits[i, :n] = (np.maximum(q[i] @ k.T, 0.0) * w[i][:, None]).sum(0)
    return logits


def indexer_topk(logits, topk: int):
    """Each row's ``topk`` largest finite logits' columns (int32 ``[rows, topk]``), largest
    first, ties by the lower column; -1 fills a row with fewer finite ones. -inf (a key
    the row does not see) and NaN are never picked."""
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 2 or topk <= 0:
        raise ValueError(f"logits must be [rows, columns] and topk positive, got {x.shape}, "
                         f"{topk}")
    out = np.full((x.shape[0], topk), -1, np.int32)
    for i, row in enumerate(x):
        cols = np.flatnonzero(np.isfinite(row))
        cols = cols[np.lexsort((cols, -row[cols]))][:topk]  # by value down, then column
        out[i, :len(cols)] = cols
    return out


def indexer_slots(positions, block_tables, block_size: int, seq_lens, query_start_loc=None):
    """Top-k positions (:func:`indexer_topk`: each row's sequence-local token numbers) as
    the global slots :func:`sparse_mla_attention` takes, ``block * block_size + offset``
    through the block table of the row's sequence (rows placed as :func:`indexer_logits`
    places them); -1 stays -1; a position past the table's blocks, or a slot outside [0,
    2^31) (a bad block id), is -2^31, which the decode treats as a fault (cupaged's
    ``indexer_topk(.., block_tables=..)`` gives the same)."""
    p = np.asarray(positions).astype(np.int64)
    bt = np.asarray(block_tables).astype(np.int64)
    seq, _ = _rows_of(seq_lens, query_start_loc, p.shape[0])
    safe = np.where(p >= 0, p, 0)
    block = safe // block_size
    inside = block < bt.shape[1]
    ids = (bt[seq[:, None], np.where(inside, block, 0)] if bt.shape[1]
           else np.zeros(p.shape, np.int64))
    slots = ids * block_size + safe % block_size
    fault = ~inside | (slots < 0) | (slots > np.iinfo(np.int32).max)
    return np.where(p < 0, -1, np.where(fault, np.iinfo(np.int32).min, slots)).astype(np.int32)
