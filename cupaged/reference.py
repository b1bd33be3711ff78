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
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["KV_LAYOUTS", "attend", "attention", "blocksparse_mask", "concat_and_cache_mla",
           "dequantize_fp8", "fp8_max", "gather_kv", "merge_state", "merge_states",
           "mla_attention", "mla_cache_views", "paged_attention", "quantize_fp8",
           "reshape_and_cache", "token_head_scales"]

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
            return t.reshape(t.shape[0], t.shape[1], t.shape[2], -1)
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
    """Tokens per block of a cache in ``kv_layout``."""
    return token_major_views(key_cache, kv_layout, True).shape[1]


def gather_kv(key_cache, value_cache, block_table, context_len: int, kv_layout: str = "vllm",
              kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """One sequence's dense K and V, ``[context_len, num_kv_heads, head_size]`` float64,
    read from the paged caches through its row of the block table (an fp8 cache
    dequantized as ``stored * scale``)."""
    k = token_major_views(key_cache, kv_layout, True)
    v = token_major_views(value_cache, kv_layout, False)
    if _fp8_format(kv_cache_dtype, key_cache) is not None:
        def scaled(c, s):
            s = 1.0 if s is None else s
            if np.ndim(s) == 3:  # [blocks, kv_heads, bs] -> [blocks, bs, kv_heads, 1]
                s = np.asarray(s).transpose(0, 2, 1)[..., None]
            return dequantize_fp8(c, kv_cache_dtype, s)

        k, v = scaled(k, k_scale), scaled(v, v_scale)
    block_size = k.shape[1]
    n_blocks = -(-context_len // block_size)
    blocks = np.asarray(block_table)[:n_blocks]
    k = k[blocks].astype(np.float64).reshape(n_blocks * block_size, *k.shape[2:])
    v = v[blocks].astype(np.float64).reshape(n_blocks * block_size, *v.shape[2:])
    return k[:context_len], v[:context_len]


def attend(q, k, v, scale: float, alibi_slopes=None, q_pos=None, causal: bool = True, *,
           window=None, logits_soft_cap=None, sinks=None, key_mask=None,
           return_lse: bool = False):
    """Dense attention in float64: ``q [num_heads, hs]`` (one token) or ``[q_len,
    num_heads, hs]`` against ``k [n, num_kv_heads, hs]`` and ``v [n, num_kv_heads, hv]``
    (``hv`` is the output's last dimension: ``hs`` but in MLA); query head h uses KV head
    h // (num_heads // num_kv_heads).

    ``q_pos``: each query row's position among the n keys (default: the last q_len
    positions, n - q_len + i). With ``causal`` a row sees keys at positions <= its own,
    otherwise all n. The logit of a key is ``scale * q.k``, then with ``logits_soft_cap``
    c it becomes ``c * tanh(logit / c)`` (Gemma 2), then ALiBi adds ``slope * (key_pos -
    q_pos)``. ``window`` W keeps only keys at positions > q_pos - W (with ``causal``: the
    W positions (q_pos - W, q_pos], the row's own included; FlashInfer's ``window_left``
    is W - 1). ``sinks`` (``[num_heads]``, in logit units) adds ``exp(sink)`` to each
    row's softmax denominator and nothing to its numerator (gpt-oss). ``key_mask`` (bool,
    broadcasting against ``[num_heads, n]``) drops the keys it is False for, such as
    :func:`blocksparse_mask`'s.

    A row that sees no key gives zeros. ``return_lse`` also returns the natural log of
    each row's softmax denominator, ``[q_len, num_heads]`` (``[num_heads]`` for one
    token): -inf for a row with no key and no sink. Partial results over disjoint key
    sets merge exactly with :func:`merge_state` (give the sinks to one partial only)."""
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
        kv_of_head = np.arange(num_heads) // (num_heads // num_kv_heads)
        kh = k[:, kv_of_head, :]  # [n, heads, hs]
        vh = v[:, kv_of_head, :]
        logits = np.einsum("qhd,nhd->qhn", q, kh) * scale
        if logits_soft_cap is not None:
            logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
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
        out = np.einsum("qhn,nhd->qhd", w / np.where(den > 0, den, 1.0), vh)
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
              blocksparse=None, return_lse: bool = False):
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
    ``vert_stride``, ``sparse_block_size``, ``head_sliding_step``, ``tp_rank``)."""
    query = np.asarray(query)
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
                                    key_mask=key_mask, return_lse=True, **variants)
    return (out, lse) if return_lse else out


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
