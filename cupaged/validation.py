"""Validation: every check of an attention call that reads only metadata (shapes,
dtypes, strides, pointers, devices), before anything is planned or launched, and the
checks that read device data (``CUPAGED_DEBUG=1``, with a sync). A call that passes is
described by a :class:`Problem`; planning and launch take it from there."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import _arrays, _checks, _dtypes, _kvquant, _prepared, _variants
from ._arrays import as_device_array, optional_device_array, optional_output_array

_fail = _checks.fail


OUT_OVER_QUERY = frozenset({("query", "out")})


class Problem(NamedTuple):
    device: int
    dtype: _dtypes.DType
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    max_blocks: int
    cache: _checks.CacheView  # its dtype is the cache's element type (fp8 or the query's)
    num_rows: int  # query rows: num_seqs for decode, total_q for attention()
    quant: _kvquant.KVQuant = _kvquant.NONE  # an fp8 cache's scales
    q_strides: tuple = (0, 0)  # the query's token (sequence) and head strides, in elements
    bt_stride: int = 0  # block_tables' row stride, in entries
    # An 8-bit query's format (the cache's; ``dtype`` is then out's): 8-bit products
    query_dtype: _dtypes.DType | None = None


def validate_decode(query, key_cache, value_cache, block_tables, context_lens, alibi_slopes,
                    out, kv_cache_dtype="auto", k_scale=None, v_scale=None) -> Problem:
    """paged_attention's arguments (adapted arrays): vLLM's cache layout, one query row per
    sequence."""
    dt = _checks.check_dtype(query, "query")
    cdt = _kvquant.cache_dtype(kv_cache_dtype, key_cache, value_cache, dt)
    if cdt is dt:
        for name, a in (("key_cache", key_cache), ("value_cache", value_cache)):
            if a.dtype != query.dtype:
                _fail(f"{name} dtype {a.dtype} does not match query dtype {query.dtype}",
                      TypeError)
    if query.ndim != 3:
        _fail(f"query must be 3-D [num_seqs, num_heads, head_size], got shape {query.shape}")
    num_seqs, num_heads, head_size = query.shape
    _checks.check_head_size(head_size)
    x = 16 // cdt.itemsize
    if key_cache.ndim == 5 and key_cache.shape[2] * x != head_size:
        _fail(f"key_cache.shape[2] is {key_cache.shape[2]}, expected head_size/{x} = "
              f"{head_size // x}")
    cache = _checks.check_kv_layout(key_cache, value_cache, cdt, "vllm")
    if num_heads == 0 or num_heads % cache.num_kv_heads:
        _fail(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
              f"({cache.num_kv_heads})")
    check_head_count(num_heads)
    # Strides of an empty batch are free: nothing is read through them.
    empty = num_seqs == 0
    if not empty and (query.strides[2] != dt.itemsize or min(query.strides) < 0):
        _fail(f"query's last dimension must be contiguous (strides {query.strides})")
    _checks.check_element_strides(query, "query", dt.itemsize)

    max_blocks = _checks.check_tables(block_tables, context_lens, "context_lens", num_seqs,
                                      cache.block_size, _checks.MAX_TOKENS)
    _checks.check_alibi_and_out(alibi_slopes, out, query, num_heads)
    if out is not None:
        # Written in place over the query is fine (each CTA reads its rows before it writes
        # them); a partial overlap would let one CTA's output clobber another's query.
        # (Byte ranges inline: this runs on every call.)
        q_lo, o_lo, qs = query.data.ptr, out.data.ptr, query.strides
        q_hi = q_lo + (num_seqs - 1) * qs[0] + (num_heads - 1) * qs[1] + head_size * dt.itemsize
        o_hi = o_lo + num_seqs * num_heads * head_size * dt.itemsize
        if not empty and q_lo < o_hi and o_lo < q_hi and not (q_lo == o_lo and out.strides == qs):
            _checks.check_disjoint((("query", query), ("out", out)), may_alias=OUT_OVER_QUERY)

    return _problem(query, dt, cdt, cache, num_seqs, max_blocks, num_seqs, block_tables,
                    k_scale, v_scale, (("key_cache", key_cache), ("value_cache", value_cache),
                                       ("block_tables", block_tables),
                                       ("context_lens", context_lens),
                                       ("alibi_slopes", alibi_slopes), ("out", out)))


def _problem(q, dt, cdt, cache, num_seqs: int, max_blocks: int, num_rows: int, bt, k_scale,
             v_scale, arrays, qdt: _dtypes.DType | None = None) -> Problem:
    """The Problem of a checked call, once its other ``arrays`` (name, array or None) are
    on the query's device and its cache's scales are checked (``qdt``: an 8-bit query's
    format, whose elements its strides count)."""
    device = q.data.device_id  # (not .device: that builds a Device object per call)
    _checks.check_same_device(device, "query", arrays)
    quant = _kvquant.scales(k_scale, v_scale, None if cdt is dt else cdt, cache, device)
    qsize = dt.itemsize if qdt is None else 1
    return Problem(device, dt, num_seqs, q.shape[1], cache.num_kv_heads, q.shape[2],
                   cache.block_size, cache.num_blocks, max_blocks, cache, num_rows, quant,
                   (q.strides[0] // qsize, q.strides[1] // qsize), bt.strides[0] // 4, qdt)


def softmax_scale(scale, head_size: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_size)
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        _fail(f"scale must be a number, got {type(scale).__name__}", TypeError)
    # The kernels take scale * log2(e) as a float32.
    if not math.isfinite(scale) or abs(scale) * _checks.LOG2E > _checks.FLT_MAX:
        _fail(f"scale must be finite in float32 (|scale| < "
              f"{_checks.FLT_MAX / _checks.LOG2E:.3g}), got {scale}")
    return scale


def max_context(max_context_len, p: Problem) -> int:
    """A host-side bound on the context lengths, used only to size split-KV work."""
    return _checks.host_bound(max_context_len, "max_context_len", p.max_blocks * p.block_size)


class VariantArgs(NamedTuple):
    """A call's variant arguments, as given (validated by variant_setup)."""

    window: object = None
    window_left: object = None
    logits_soft_cap: object = None
    sinks: object = None
    return_lse: bool = False
    lse: object = None
    sparse: tuple = ()  # blocksparse, already checked by _variants.blocksparse


    @property
    def wants_lse(self) -> bool:
        return bool(self.return_lse) or self.lse is not None


NO_VARIANTS = VariantArgs()


def variant_args(window, window_left, logits_soft_cap, sinks, return_lse, lse) -> VariantArgs:
    """The public keywords as one value; the shared constant when none is given (the
    common call then skips every variant check)."""
    if (window is None and window_left is None and logits_soft_cap is None and sinks is None
            and return_lse is False and lse is None):
        return NO_VARIANTS
    return VariantArgs(window, window_left, logits_soft_cap, sinks, return_lse, lse)


def variant_setup(va: VariantArgs, p: Problem):
    """Validate the variant arguments of a call (no launch, no allocation): the variants
    with their sinks adapted, and the caller's ``lse=`` array (adapted) or None."""
    if va is NO_VARIANTS:
        return _variants.PLAIN, None
    window = _variants.window_size(va.window, va.window_left)
    cap, approx = _variants.soft_cap(va.logits_soft_cap)
    sinks = _variants.check_sinks(optional_device_array(va.sinks, "sinks"), p.num_heads,
                                  p.device)
    lse = optional_output_array(va.lse, "lse")
    if lse is not None:
        _variants.check_lse(lse, p.num_rows, p.num_heads, p.device)
    elif not isinstance(va.return_lse, (bool, np.bool_)):
        _fail(f"return_lse must be a bool, got {type(va.return_lse).__name__}", TypeError)
    if not (window or cap or sinks is not None or va.sparse):
        return _variants.PLAIN, lse
    return _variants.Variants(_variants.letters(window, cap, va.sparse, approx), window, cap,
                              sinks, va.sparse), lse


def outputs_apart(q, o, lse, read, variants, p: Problem, scratch=()) -> tuple:
    """attention's and paged_attention's outputs against what the call reads: out and lse
    overlap no cache, table, length, query start, ALiBi slope, sink or scale array, nor
    each other, and lse not the query (out over the query is validate_*'s rule: in place
    or apart, repeated by _prepared.overlaps). Checked here with errors naming both
    arrays; returned as the memo's pairs (_prepared.disjoint_spans, in _prepared.run's
    address order), for _prepared.clashes to repeat at each call's addresses. ``read``:
    ``(index, name, adapted array or None)`` of the per-call arrays; the side arrays
    (``variants``' sinks, ``p``'s scale arrays, ALiBi slopes among ``read`` with index
    None) are keyed at their addresses. ``scratch``: ``(name, array)`` the kernels write
    at addresses the call is keyed by (paged_attention_v2's buffers), held apart from
    everything the call reads as out and lse are (the query and out are
    check_v2_scratch's)."""
    side = [(None, "sinks", variants.sinks)]
    side += [(None, name, a) for name, a in zip(("k_scale", "v_scale"), p.quant.keep)]
    everything = [(name, a) for _, name, a in (*read, *side)]
    _checks.check_apart((("out", o), ("lse", lse), *scratch), everything)
    _checks.check_apart((("lse", lse),), (("query", q),))
    spans = [(i, a) for i, _, a in (*read, *side)]
    return (_prepared.disjoint_spans(((6, o), (7, lse), *((None, a) for _, a in scratch)),
                                     spans)
            + _prepared.disjoint_spans(((7, lse),), ((0, q),)))


def check_vllm_args(key_cache, num_kv_heads, block_size) -> None:
    kc = as_device_array(key_cache, "key_cache")
    if kc.ndim >= 4 and (kc.shape[1] != num_kv_heads or kc.shape[3] != block_size):
        _fail(f"num_kv_heads={num_kv_heads} and block_size={block_size} do not match "
              f"key_cache of shape {kc.shape}")


def blocksparse_args(tp_rank, local_blocks, vert_stride, block_size,
                     head_sliding_step) -> VariantArgs:
    """vLLM's blocksparse arguments as the call's variants: dense attention (no variant)
    unless ``blocksparse_vert_stride > 1``, as in vLLM."""
    sparse = _variants.blocksparse(tp_rank, local_blocks, vert_stride, block_size,
                                   head_sliding_step)
    return VariantArgs(sparse=sparse) if sparse else NO_VARIANTS


def check_tables_on_device(bt, cl, num_blocks: int, block_size: int,
                           ctx: _arrays.Context) -> None:
    """check_block_tables and CUPAGED_DEBUG: every sequence's length fits its table row and
    its blocks are in the cache (reads the device: synchronizes)."""
    bt = _arrays.to_host(bt, ctx)
    cl = _arrays.to_host(cl, ctx)
    if bt.ndim != 2 or cl.shape != (bt.shape[0],):
        _fail(f"block_tables {bt.shape} and context_lens {cl.shape} disagree on num_seqs")
    lens = cl.astype(np.int64)
    bad_len = (lens < 0) | (lens > bt.shape[1] * block_size)
    if bad_len.any():
        i = int(np.flatnonzero(bad_len)[0])
        _fail(f"sequence {i}: context length {lens[i]} is outside [0, {bt.shape[1] * block_size}] "
              f"(block_tables has {bt.shape[1]} blocks of {block_size} tokens per sequence)")
    used = np.arange(bt.shape[1])[None, :] < -(-lens // block_size)[:, None]
    bad = used & ((bt < 0) | (bt >= num_blocks))
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        _fail(f"sequence {i}: block_tables[{i}, {j}] = {bt[i, j]} is outside [0, {num_blocks})")


def check_varlen_tables(bt, sl, qsl, total_q: int, block_size: int, q_name: str) -> tuple:
    """``(num_seqs, max_blocks)`` of a varlen call's block tables, sequence lengths and
    query starts (``qsl`` None: one query row per sequence, ``total_q`` of them)."""
    if bt.ndim != 2:
        _fail(f"block_tables must be 2-D [num_seqs, max_blocks_per_seq], got shape {bt.shape}")
    num_seqs = bt.shape[0]
    max_blocks = _checks.check_tables(bt, sl, "seq_lens", num_seqs, block_size,
                                      _checks.MAX_TOKENS)
    if qsl is None:
        if total_q != num_seqs:
            _fail(f"{q_name} has {total_q} rows but there are {num_seqs} sequences: without "
                  f"query_start_loc each sequence has exactly one query token")
    else:
        _checks.check_int(qsl, "query_start_loc")
        # (one entry, no sequences: its stride is free)
        if qsl.shape != (num_seqs + 1,) or (num_seqs and qsl.strides[0] != 4):
            _fail(f"query_start_loc must be a contiguous [num_seqs + 1 = {num_seqs + 1}] array, "
                  f"got shape {qsl.shape}")
    return num_seqs, max_blocks


def check_head_count(num_heads: int) -> None:
    """At most MAX_GRID_YZ query heads: the decode kernels' grid, and a split's combine,
    take a row of CTAs a head."""
    if num_heads > _checks.MAX_GRID_YZ:
        _fail(f"num_heads is {num_heads}; at most {_checks.MAX_GRID_YZ} are supported")


def validate_varlen(q, kc, vc, bt, sl, qsl, alibi, out, kv_layout, kv_cache_dtype="auto",
                    k_scale=None, v_scale=None) -> Problem:
    """attention's arguments (adapted arrays): any cache layout, a varlen batch of query
    rows (``qsl``: query_start_loc, or None for one row per sequence). A query of a 1-byte
    dtype is an 8-bit query in its fp8 cache's format, whose output type ``out`` gives."""
    if q.dtype.itemsize == 1 and (q.dtype in _kvquant.ONE_BYTE or _dtypes.fp8_of(q.dtype)):
        dt, qdt = _fp8_query(q, kc, vc, out, kv_cache_dtype)
    else:
        dt, qdt = _checks.check_dtype(q, "query"), None
    if q.ndim != 3:
        _fail(f"query must be 3-D [total_q, num_heads, head_size], got shape {q.shape}")
    total_q, num_heads, head_size = q.shape
    cdt = qdt if qdt is not None else _kvquant.cache_dtype(kv_cache_dtype, kc, vc, dt)
    cache = _checks.check_kv_layout(kc, vc, cdt, kv_layout)
    if cache.head_size != head_size:
        _fail(f"query's head_size is {head_size} but the caches' is {cache.head_size}")
    if num_heads == 0 or num_heads % cache.num_kv_heads:
        _fail(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
              f"({cache.num_kv_heads})")
    check_head_count(num_heads)
    group = num_heads // cache.num_kv_heads
    if total_q * max(group, 1) > _checks.INT32_MAX:
        _fail(f"total_q * (num_heads / num_kv_heads) = {total_q * group} query rows; at most "
              f"{_checks.INT32_MAX} are supported per call")
    qsize = q.dtype.itemsize
    if total_q and (q.strides[2] != qsize or min(q.strides) < 0):
        _fail(f"query's last dimension must be contiguous (strides {q.strides})")
    _checks.check_element_strides(q, "query", qsize)

    num_seqs, max_blocks = check_varlen_tables(bt, sl, qsl, total_q, cache.block_size, "query")
    if num_seqs * cache.num_kv_heads > _checks.INT32_MAX:  # the prefill grid's x
        _fail(f"{num_seqs} sequences x {cache.num_kv_heads} KV heads; at most "
              f"{_checks.INT32_MAX} (sequence, KV head) pairs are supported")
    _checks.check_alibi_and_out(alibi, out, q, num_heads, same_dtype=qdt is None)
    if out is not None:
        # In place over the query is fine (each query row is read by the CTA that writes
        # its output, before it writes); any other overlap is not.
        if total_q and not (out.data.ptr == q.data.ptr and out.strides == q.strides):
            _checks.check_disjoint((("query", q), ("out", out)))
    p = _problem(q, dt, cdt, cache, num_seqs, max_blocks, total_q, bt, k_scale, v_scale,
                 (("key_cache", kc), ("value_cache", vc), ("block_tables", bt),
                  ("seq_lens", sl), ("query_start_loc", qsl), ("alibi_slopes", alibi),
                  ("out", out)), qdt)
    if qdt is not None and p.quant.mode:
        _fail("an 8-bit query takes per-tensor k_scale and v_scale (floats or one-element "
              "arrays), not per-token ones", TypeError)
    return p


def _fp8_query(q, kc, vc, out, kv_cache_dtype) -> tuple:
    """``(out's type, the query's fp8 format)`` of an 8-bit query: in the format of its
    fp8 cache (``kv_cache_dtype``, or the caches' and its own float8 dtypes), its output
    the float16 or bfloat16 ``out`` the caller gives (no type to make one of)."""
    if out is None:
        _fail(f"an 8-bit query ({q.dtype}) needs out=: a float16 or bfloat16 array of its "
              f"shape for the output", TypeError)
    dt = _checks.check_dtype(out, "out")
    if dt.itemsize != 2:
        _fail(f"out of an 8-bit query must be float16 or bfloat16, got {out.dtype}", TypeError)
    fmt = _kvquant.cache_dtype(kv_cache_dtype, kc, vc, dt)
    if fmt is dt:
        _fail(f"an 8-bit query ({q.dtype}) needs an fp8 cache: kv_cache_dtype='fp8_e4m3' or "
              f"'fp8_e5m2' (the query is read in the cache's format)", TypeError)
    named = _dtypes.fp8_of(q.dtype)
    if named is not None and named is not fmt:
        _fail(f"query dtype {q.dtype} holds fp8 {named.name}, but the cache is {fmt.name}: "
              f"an 8-bit query is in its cache's format", TypeError)
    return dt, fmt


def check_queries_on_device(qsl, sl, total_q: int, ctx: _arrays.Context) -> None:
    """CUPAGED_DEBUG: the device-side facts of query_start_loc (synchronizes)."""
    starts = _arrays.to_host(qsl, ctx).astype(np.int64)
    lens = _arrays.to_host(sl, ctx).astype(np.int64)
    if starts[0] != 0 or starts[-1] != total_q:
        _fail(f"query_start_loc must run from 0 to total_q = {total_q}, got "
              f"{starts[0]} .. {starts[-1]}")
    q_lens = np.diff(starts)
    bad = np.flatnonzero(q_lens < 0)
    if bad.size:
        i = int(bad[0])
        _fail(f"query_start_loc must be non-decreasing: query_start_loc[{i + 1}] = "
              f"{starts[i + 1]} < query_start_loc[{i}] = {starts[i]}")
    bad = np.flatnonzero(q_lens > lens)
    if bad.size:
        i = int(bad[0])
        _fail(f"sequence {i}: {q_lens[i]} query tokens but seq_lens[{i}] = {lens[i]} (the "
              f"query tokens are the last q_len of the sequence's cached tokens)")


class V2Scratch(NamedTuple):
    """vLLM's v2 scratch buffers, checked: their addresses, the (sequence, head) rows and
    the float32 partitions per row that fit in them."""

    exp_sums: int
    max_logits: int
    tmp_out: int
    rows: int
    capacity: int


def check_v2_scratch(query, exp_sums, max_logits, tmp_out, out) -> V2Scratch:
    """paged_attention_v2's ``exp_sums``/``max_logits`` (float32 ``[num_seqs, num_heads,
    P]``) and ``tmp_out`` (``[num_seqs, num_heads, P, head_size]``, float32 or the query's
    dtype: then P // 2 float32 partials fit), all contiguous, on the query's device,
    4-byte aligned, overlapping nothing else of the call."""
    q = as_device_array(query, "query")
    es = as_device_array(exp_sums, "exp_sums")
    ml = as_device_array(max_logits, "max_logits")
    tmp = as_device_array(tmp_out, "tmp_out")
    if q.ndim != 3:
        _fail(f"query must be 3-D [num_seqs, num_heads, head_size], got shape {q.shape}")
    s, h, hs = q.shape
    for name, a in (("exp_sums", es), ("max_logits", ml)):
        if (a.dtype != np.float32 or a.ndim != 3 or a.shape[:2] != (s, h)
                or not (s == 0 or a.flags.c_contiguous)):
            _fail(f"{name} must be a contiguous float32 [{s}, {h}, max_num_partitions] array, "
                  f"got {a.dtype} {a.shape}")
    for name, a in (("exp_sums", es), ("max_logits", ml), ("tmp_out", tmp)):
        if a.data.device_id != q.data.device_id:
            _fail(f"{name} is on device {a.data.device_id} but query is on device "
                  f"{q.data.device_id}")
    n_user = es.shape[2]
    if (ml.shape != es.shape or tmp.shape != (s, h, n_user, hs)
            or not (s == 0 or tmp.flags.c_contiguous)):
        _fail(f"max_logits and tmp_out must match exp_sums: expected {(s, h, n_user)} and "
              f"{(s, h, n_user, hs)}, got {ml.shape} and {tmp.shape}")
    if tmp.dtype == np.float32:
        capacity = n_user
    elif tmp.dtype == q.dtype:
        capacity = n_user // 2  # float32 partials in a 16-bit buffer
    else:
        _fail(f"tmp_out must be float32 or the query's dtype, got {tmp.dtype}", TypeError)
    # vLLM sizes P as ceil(max_len / 512); past 65535 partitions (33.5M tokens) the grid
    # cannot hold them, so use fewer, larger ones.
    capacity = min(capacity, _checks.MAX_GRID_YZ)
    # The kernels write float32 partials into all three, whatever tmp_out's dtype.
    for name, a in (("exp_sums", es), ("max_logits", ml), ("tmp_out", tmp)):
        _checks.check_aligned(a.data.ptr, name, 4)
    _checks.check_disjoint((("exp_sums", es), ("max_logits", ml), ("tmp_out", tmp),
                            ("query", q), ("out", as_device_array(out, "out"))),
                           may_alias=OUT_OVER_QUERY)
    return V2Scratch(es.data.ptr, ml.data.ptr, tmp.data.ptr, s * h, capacity)


# ---- absorbed MLA -----------------------------------------------------------------------------

# The latent widths mla_attention's kernel is built for: DeepSeek-V2/V3's kv_lora_rank and
# rotary dims (Kimi K2 and the other descendants keep them).
MLA_RANKS = (512,)
MLA_ROPE_DIMS = (64,)


class MlaProblem(NamedTuple):
    """A checked mla_attention call: adapted arrays (the query and cache as latent and
    rotary parts, each with its own strides in elements) and their sizes."""

    device: int
    dtype: _dtypes.DType
    cache_dtype: _dtypes.DType  # the query's, or fp8
    num_seqs: int
    num_rows: int  # total_q
    num_heads: int
    rank: int
    rope: int
    block_size: int
    num_blocks: int
    max_blocks: int
    bt_stride: int
    q_parts: tuple  # (latent, rope) adapted arrays [total_q, num_heads, ...]
    q_offsets: tuple  # element offsets of the two parts from their arrays' pointers
    q_strides: tuple  # (latent token, latent head, rope token, rope head)
    c_parts: tuple  # (latent, rope) caches [num_blocks, block_size, ...]
    c_offsets: tuple
    c_strides: tuple  # (latent block, latent token, rope block, rope token)


def mla_bounds(p: MlaProblem, has_starts: bool, max_query_len, max_seq_len) -> tuple:
    """``(max_q, max_ctx)``: the host bounds that size an MLA call's work. Without
    query_start_loc every sequence has one query token, whatever ``max_query_len`` says
    (a bound of total_q would plan num_seqs times the rows a sequence has)."""
    max_q = _checks.host_bound(max_query_len, "max_query_len", p.num_rows)
    if not has_starts:
        max_q = 1
    return max_q, _checks.host_bound(max_seq_len, "max_seq_len", p.max_blocks * p.block_size)


def _mla_part(a, name: str, lead: tuple, what: str):
    """The strides (elements) of one query or cache array: 3-D with leading ``lead``
    sizes (when given), the last dimension contiguous, 16-byte aligned pointer and
    strides (the kernel copies 16 bytes at a time)."""
    if a.ndim != 3 or (lead and a.shape[:2] != lead):
        _fail(f"{name} must be 3-D {what}, got shape {a.shape}")
    itemsize = a.dtype.itemsize
    if not _checks.is_empty(a):
        if min(a.strides) < 0:
            _fail(f"{name}'s strides must be non-negative, got {a.strides}")
        if a.shape[2] > 1 and a.strides[2] != itemsize:
            _fail(f"{name}'s last dimension must be contiguous (strides {a.strides})")
        _checks.check_element_strides(a, name, itemsize)
        _checks.check_aligned(a.data.ptr, name)
        for n, st in zip(a.shape[:2], a.strides[:2]):
            if n > 1 and st % 16:
                _fail(f"{name}'s strides must be multiples of 16 bytes (the kernel copies "
                      f"16 bytes at a time), got {a.strides}")
    return tuple(st // itemsize for st in a.strides[:2])


# mla_attention's packed rows (tokens x heads) a call: the kernels walk a sequence's row
# tiles with an int32 stride of up to its rows plus a tile, which must not wrap.
MLA_MAX_ROWS = 2 ** 30


def validate_mla(q, kv_cache, k_pe_cache, block_tables, seq_lens, query_start_loc, out,
                 lse, kv_lora_rank, kv_cache_dtype,
                 sparse_rows: str | None = None, tables_apart: bool = True) -> MlaProblem:
    """mla_attention's arguments (adapted arrays; ``q`` an array or a (latent, rope)
    pair): metadata only, nothing read on the device. ``sparse_rows``: the cache holds
    DeepSeek's token rows of that kv_cache_dtype (the sparse kernel's: V3.2's 656-byte
    "fp8_ds_mla", V4's 528-byte "v4_fp8" or 288-byte "v4_fp4"; checked by the caller to be
    a 1-byte array), the query bfloat16. ``tables_apart``: out and lse overlap no table
    (False: the sparse caller's stand-ins for them, whose own arrays it checks)."""
    pair = isinstance(q, tuple)
    q_lat, q_rope = q if pair else (q, q)
    q_name = "q_nope" if pair else "q"
    dt = _dtypes.lookup(q_lat.dtype)
    if dt is None or dt.itemsize != 2:
        _fail(f"{q_name} dtype {q_lat.dtype} is not supported: expected float16 or bfloat16",
              TypeError)
    if kv_lora_rank is not None and (isinstance(kv_lora_rank, bool)
                                     or not isinstance(kv_lora_rank, (int, np.integer))):
        _fail(f"kv_lora_rank must be an int, got {type(kv_lora_rank).__name__}", TypeError)
    if pair and q_rope.dtype != q_lat.dtype:
        _fail(f"q_pe dtype {q_rope.dtype} does not match q_nope dtype {q_lat.dtype}",
              TypeError)
    # The cache's element type: the query's, or fp8 (named by kv_cache_dtype or its dtype).
    names = ("kv_cache", "k_pe_cache" if k_pe_cache is not None else "kv_cache")
    rows = None if sparse_rows is None else _dtypes.SPARSE_KV_CACHE_DTYPES[sparse_rows]
    if rows is not None:
        cdt = rows.dtype
        if dt is not _dtypes.BF16:
            why = ("their k_pe is bfloat16" if rows.dtype is _dtypes.DS_MLA
                   else "the kernel widens them to bfloat16")
            _fail(f"{sparse_rows} caches take bfloat16 queries ({why}), got {q_lat.dtype}",
                  TypeError)
    else:
        cdt = _kvquant.cache_dtype(kv_cache_dtype, kv_cache,
                                   kv_cache if k_pe_cache is None else k_pe_cache, dt, names)
    if cdt is dt:
        for name, c in (("kv_cache", kv_cache), ("k_pe_cache", k_pe_cache)):
            if c is not None and c.dtype != q_lat.dtype:
                _fail(f"{name} dtype {c.dtype} does not match the query's {q_lat.dtype} (or "
                      f"name an fp8 cache with kv_cache_dtype)", TypeError)
    elif k_pe_cache is not None and k_pe_cache.dtype != kv_cache.dtype:
        _fail(f"k_pe_cache dtype {k_pe_cache.dtype} does not match kv_cache's "
              f"{kv_cache.dtype}", TypeError)
    if kv_cache.ndim != 3:
        _fail(f"kv_cache must be 3-D [num_blocks, block_size, kv_lora_rank + rope_dim] (or "
              f"[.., kv_lora_rank] with k_pe_cache), got shape {kv_cache.shape}")
    num_blocks, block_size, width = kv_cache.shape
    if rows is not None:
        if width != rows.nbytes:
            _fail(f"kv_cache's {sparse_rows} rows must be {rows.nbytes} bytes a token, "
                  f"got shape {kv_cache.shape}")
        rank, rope = _dtypes.SPARSE_RANK, rows.rope
        c_rope = kv_cache
    elif k_pe_cache is None:
        rank = 512 if kv_lora_rank is None else kv_lora_rank
        rope = width - rank
        c_rope = kv_cache
    else:
        if k_pe_cache.ndim != 3 or k_pe_cache.shape[:2] != (num_blocks, block_size):
            _fail(f"k_pe_cache must be [num_blocks={num_blocks}, block_size={block_size}, "
                  f"rope_dim], got shape {k_pe_cache.shape}")
        rank, rope = width, k_pe_cache.shape[2]
        if kv_lora_rank is not None and kv_lora_rank != rank:
            _fail(f"kv_lora_rank {kv_lora_rank} does not match kv_cache's last dimension "
                  f"{rank} (with k_pe_cache, kv_cache holds kv_c alone)")
        c_rope = k_pe_cache
    if rows is None and (rank not in MLA_RANKS or rope not in MLA_ROPE_DIMS):
        hint = (" (with k_pe_cache, kv_cache holds kv_c alone)"
                if k_pe_cache is not None and rank == 576 else "")
        _fail(f"kv_lora_rank {rank} with rope_dim {rope} is not supported: mla_attention is "
              f"built for kv_lora_rank {MLA_RANKS} and rope_dim {MLA_ROPE_DIMS} "
              f"(DeepSeek's){hint}")
    if block_size not in _checks.BLOCK_SIZES:
        _fail(f"block_size {block_size} is not supported: expected a power of two from 1 "
              f"to 256")
    if num_blocks >= 2 ** 31:
        _fail(f"num_blocks {num_blocks}: at most 2^31 - 1 blocks are supported")

    if q_lat.ndim != 3:
        _fail(f"{'q_nope' if pair else 'q'} must be 3-D [total_q, num_heads, ...], got shape "
              f"{q_lat.shape}")
    total_q, num_heads = q_lat.shape[:2]
    if pair:
        if q_lat.shape[2] != rank or q_rope.shape != (total_q, num_heads, rope):
            _fail(f"q_nope and q_pe must be [total_q, num_heads, {rank}] and [.., {rope}] "
                  f"(kv_lora_rank, rope_dim), got shapes {q_lat.shape} and {q_rope.shape}")
        q_offsets = (0, 0)
    else:
        if q_lat.shape[2] != rank + rope:
            _fail(f"q's last dimension ({q_lat.shape[2]}) must be kv_lora_rank + rope_dim "
                  f"({rank} + {rope})" if rope else
                  f"q's last dimension ({q_lat.shape[2]}) must be {rank} (d_qk of "
                  f"{sparse_rows} rows)")
        q_offsets = (0, rank)
    if num_heads == 0:
        _fail("q must have at least one head")
    check_head_count(num_heads)
    if total_q * num_heads > MLA_MAX_ROWS:
        _fail(f"total_q * num_heads = {total_q * num_heads} rows; at most "
              f"{MLA_MAX_ROWS} are supported per call")
    qs = _mla_part(q_lat, q_name, (), "[total_q, num_heads, ...]")
    if pair:
        qs += _mla_part(q_rope, "q_pe", (total_q, num_heads), "[total_q, num_heads, rope_dim]")
    else:
        qs += qs
        if rope:
            _checks.check_aligned(q_lat.data.ptr + rank * dt.itemsize, "q's rotary part")
    cs = _mla_part(kv_cache, "kv_cache", (), "")
    if rows is not None:  # one row holds the token: the kernel finds its parts
        c_offsets = (0, 0)
        cs += cs
    elif k_pe_cache is None:
        c_offsets = (0, rank)
        cs += cs
    else:
        c_offsets = (0, 0)
        cs += _mla_part(k_pe_cache, "k_pe_cache", (num_blocks, block_size), "")

    num_seqs, max_blocks = check_varlen_tables(block_tables, seq_lens, query_start_loc,
                                               total_q, block_size, q_name)
    if num_seqs > _checks.INT32_MAX:  # the grid's x: (sequence, row tile)
        _fail(f"{num_seqs} sequences; at most {_checks.INT32_MAX} are supported")
    if out is not None:
        if out.dtype != q_lat.dtype:
            _fail(f"out dtype {out.dtype} does not match q's {q_lat.dtype}", TypeError)
        if out.shape != (total_q, num_heads, rank) or not (
                _checks.is_empty(out) or out.flags.c_contiguous):
            _fail(f"out must be a C-contiguous array of shape {(total_q, num_heads, rank)}, "
                  f"got shape {out.shape} with strides {out.strides}")
        _checks.check_aligned(out.data.ptr, "out", 4)
    if lse is not None:
        if lse.dtype != np.float32:
            _fail(f"lse must be float32, got {lse.dtype}", TypeError)
        if lse.shape != (total_q, num_heads) or not (_checks.is_empty(lse) or lse.flags.c_contiguous):
            _fail(f"lse must be a C-contiguous float32 array of shape {(total_q, num_heads)}, "
                  f"got shape {lse.shape} with strides {lse.strides}")
        _checks.check_aligned(lse.data.ptr, "lse", 4)
    arrays = (("q_pe", q_rope if pair else None), ("kv_cache", kv_cache),
              ("k_pe_cache", k_pe_cache), ("block_tables", block_tables),
              ("seq_lens", seq_lens), ("query_start_loc", query_start_loc), ("out", out),
              ("lse", lse))
    device = q_lat.data.device_id
    _checks.check_same_device(device, "q", arrays)
    # The output and lse are written while the query, caches and tables are read (the
    # inputs may share memory: a pair of views of one combined cache).
    inputs = (("q_nope" if pair else "q", q_lat), ("q_pe", q_rope if pair else None),
              ("kv_cache", kv_cache), ("k_pe_cache", k_pe_cache))
    if tables_apart:
        inputs += (("block_tables", block_tables), ("seq_lens", seq_lens),
                   ("query_start_loc", query_start_loc))
    for written in (("out", out), ("lse", lse)):
        if written[1] is not None:
            for read in inputs:
                _checks.check_disjoint((read, written))
    _checks.check_disjoint((("out", out), ("lse", lse)))
    return MlaProblem(device, dt, cdt, num_seqs, total_q, num_heads, rank, rope, block_size,
                      num_blocks, max_blocks, block_tables.strides[0] // 4, (q_lat, q_rope),
                      q_offsets, qs, (kv_cache, c_rope), c_offsets, cs)
