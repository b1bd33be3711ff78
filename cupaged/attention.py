"""Paged attention for every kind of step: a varlen batch of query tokens per sequence
(prefill, chunked prefill, speculative verify, decode, all mixed) over NHD, HND or vLLM's
legacy cache layout.

The layers are those of :mod:`cupaged.decode`: array adaptation, validation (metadata only,
no device sync), planning (which kernel, its tiles, split-KV), launch. Three kernels serve
the plans: ``paged_decode`` for one token per sequence without ``query_start_loc`` (with
split-KV), ``paged_prefill`` (tensor cores, the group's heads and tokens packed into each
tile's rows) for several tokens of a 16-bit cache, and ``paged_decode``'s row mode (one
CTA per query token, split-KV too) for one token per sequence given with
``query_start_loc`` and for what ``paged_prefill`` does not take: float32, and vLLM's
layout with blocks under 8 tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _arrays, _checks, _geometry, _kvquant, _prepared, _variants, decode, jit
from ._arrays import as_device_array, optional_device_array, optional_output_array

__all__ = ["AttentionPlan", "attention"]

_fail = _checks.fail
_MAX_GRID_Y = 65535


class _Prefill(NamedTuple):
    launch: jit.Launcher
    smem: int
    threads: int
    tile_tokens: int
    slots: int  # CTAs resident at once on the whole device


# (warps, m_atoms, tile_tokens, stages) for every prefill specialization instead of the
# default, for tuning experiments (tools/prefill_tiles.py); set through _set_tile.
_tile_override: tuple | None = None


def _set_tile(tile: tuple | None) -> None:
    global _tile_override
    _tile_override = tile
    _prefill_kernel.cache_clear()
    _prepared.clear()


# Split-KV of paged_prefill instead of the cost model's choice, for tests and experiments:
# None (the model), 0 (never) or tokens per partition (a multiple of the tile's tokens).
_split_override: int | None = None


def _set_split(tokens: int | None) -> None:
    global _split_override
    _split_override = tokens
    _prepared.clear()


# Up to this many packed query rows per (sequence, KV head), 16 rows per warp instead of
# the default's 32: verify's 4 tokens x 4 heads fill 16 rows, and the default's 128-row
# tile would be mostly padding (docs/PERFORMANCE.md).
_FEW_ROWS = 64


def _prefill_tile(head_size: int, rows_needed: int) -> tuple:
    if _tile_override is not None:
        return _tile_override
    if rows_needed <= _FEW_ROWS:
        return jit.few_rows_prefill_tile(head_size)
    return jit.default_prefill_tile(head_size)


def _prefill_spec(arch: str, dtype: str, head_size: int, block_size: int,
                  kv_format: str, tile: tuple, cache_dtype: str = "",
                  kv_scale: str = "", variant: str = "") -> jit.KernelSpec:
    w, m, n, st = tile
    return jit.KernelSpec("paged_prefill", dtype, head_size, block_size, tile_tokens=n,
                          stages=st, kv_format=kv_format, warps=w, m_atoms=m,
                          cache_dtype=cache_dtype, kv_scale=kv_scale, variant=variant,
                          arch=arch)


@jit.launcher_cache
def _prefill_kernel(device_id: int, dtype: str, head_size: int, block_size: int,
                    kv_format: str, tile: tuple, cache_dtype: str = "",
                    kv_scale: str = "", variant: str = "") -> _Prefill:
    dev = decode._device(device_id)
    spec = _prefill_spec(dev.arch, dtype, head_size, block_size, kv_format, tile, cache_dtype,
                         kv_scale, variant)
    g = _geometry.PrefillGeometry.of(spec)
    if g.smem_bytes > dev.max_smem:
        raise ValueError(f"{spec.name} needs {g.smem_bytes} bytes of shared memory per block; "
                         f"device {device_id} allows {dev.max_smem}")
    kernel = jit.load(spec, device_id, g.smem_bytes)
    return _Prefill(kernel, g.smem_bytes, g.threads, spec.tile_tokens,
                    decode._resident_ctas(device_id, kernel, g.threads, g.smem_bytes))


# ---- validation ---------------------------------------------------------------------------


def _validate(q, kc, vc, bt, sl, qsl, alibi, out, kv_layout, kv_cache_dtype="auto",
              k_scale=None, v_scale=None) -> decode._Problem:
    dt = _checks.check_dtype(q, "query")
    if q.ndim != 3:
        _fail(f"query must be 3-D [total_q, num_heads, head_size], got shape {q.shape}")
    total_q, num_heads, head_size = q.shape
    cdt = _kvquant.cache_dtype(kv_cache_dtype, kc, vc, dt)
    cache = _checks.check_kv_layout(kc, vc, cdt, kv_layout)
    if cache.head_size != head_size:
        _fail(f"query's head_size is {head_size} but the caches' is {cache.head_size}")
    if num_heads == 0 or num_heads % cache.num_kv_heads:
        _fail(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
              f"({cache.num_kv_heads})")
    group = num_heads // cache.num_kv_heads
    if total_q * max(group, 1) > _checks.INT32_MAX:
        _fail(f"total_q * (num_heads / num_kv_heads) = {total_q * group} query rows; at most "
              f"{_checks.INT32_MAX} are supported per call")
    if total_q and (q.strides[2] != dt.itemsize or min(q.strides) < 0):
        _fail(f"query's last dimension must be contiguous (strides {q.strides})")
    _checks.check_element_strides(q, "query", dt.itemsize)

    if bt.ndim != 2:
        _fail(f"block_tables must be 2-D [num_seqs, max_blocks_per_seq], got shape {bt.shape}")
    num_seqs = bt.shape[0]
    max_blocks = _checks.check_tables(bt, sl, "seq_lens", num_seqs, cache.block_size,
                                      decode._MAX_TOKENS)
    if qsl is None:
        if total_q != num_seqs:
            _fail(f"query has {total_q} rows but there are {num_seqs} sequences: without "
                  f"query_start_loc each sequence has exactly one query token")
    else:
        _checks.check_int(qsl, "query_start_loc")
        if qsl.shape != (num_seqs + 1,) or qsl.strides[0] != 4:
            _fail(f"query_start_loc must be a contiguous [num_seqs + 1 = {num_seqs + 1}] array, "
                  f"got shape {qsl.shape}")
    if num_seqs * cache.num_kv_heads > _checks.INT32_MAX:  # the prefill grid's x
        _fail(f"{num_seqs} sequences x {cache.num_kv_heads} KV heads; at most "
              f"{_checks.INT32_MAX} (sequence, KV head) pairs are supported")
    _checks.check_alibi_and_out(alibi, out, q, num_heads)
    if out is not None:
        # In place over the query is fine (each query row is read by the CTA that writes
        # its output, before it writes); any other overlap is not.
        if total_q and not (out.data.ptr == q.data.ptr and out.strides == q.strides):
            _checks.check_disjoint((("query", q), ("out", out)))
    device = q.data.device_id
    _checks.check_same_device(device, "query", (
        ("key_cache", kc), ("value_cache", vc), ("block_tables", bt), ("seq_lens", sl),
        ("query_start_loc", qsl), ("alibi_slopes", alibi), ("out", out)))
    quant = _kvquant.scales(k_scale, v_scale, None if cdt is dt else cdt, cache, device)
    return decode._Problem(device, dt, num_seqs, num_heads, cache.num_kv_heads, head_size,
                           cache.block_size, cache.num_blocks, max_blocks, cache, total_q, quant,
                           (q.strides[0] // dt.itemsize, q.strides[1] // dt.itemsize),
                           bt.strides[0] // 4)


def _check_queries(qsl, sl, total_q: int, ctx: _arrays.Context) -> None:
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


# ---- planning -----------------------------------------------------------------------------


class _Plan(NamedTuple):
    kind: str  # "decode" | "prefill" | "rows"
    q_tiles: int = 0  # prefill: grid y
    tile: tuple = ()  # prefill: (warps, m_atoms, tile_tokens, stages)


def _plan(p: decode._Problem, has_starts: bool, max_q: int) -> _Plan:
    """Which kernel serves the call, from host facts only (no device sync). The host
    bounds may undercount, so they choose only among kernels that read
    ``query_start_loc`` whenever it is given."""
    if not has_starts:
        return _Plan("decode")  # one token per sequence, by the call's contract
    if max_q <= 1 and p.num_rows == p.num_seqs:
        # Most likely a decode step: the decode kernel's row mode (split-KV included)
        # finds row r in sequence r at once, and any other split of the rows correctly.
        return _Plan("rows")
    # vLLM's value layout is copied in 16-byte runs of one block: 8 tokens, 16 for fp8.
    if p.dtype.itemsize == 2 and (p.cache.kv_format == "tok"
                                  or p.block_size * p.cache.dtype.itemsize >= 16):
        group = p.num_heads // p.num_kv_heads
        tile = _prefill_tile(p.head_size, max_q * group)
        rows = 16 * tile[0] * tile[1]
        return _Plan("prefill", max(1, min(_MAX_GRID_Y, -(-max_q * group // rows))), tile)
    return _Plan("rows")


# ---- launch -------------------------------------------------------------------------------


def _prefill_split(k: _Prefill, p: decode._Problem, plan: _Plan, max_q: int, max_ctx: int,
                   variants: _variants.Variants, workspace) -> tuple:
    """``(tokens per split-KV partition, partitions)`` of paged_prefill; ``(0, 1)`` for a
    single pass. Each query tile splits its own keys (from its window's first tile, if
    any) into partitions, the last running to the end: few CTAs over long contexts (a
    shared prefix's queries, a chunk of a long prompt) would leave most SMs idle."""
    tn = k.tile_tokens
    # The keys of a query tile: at most its window plus its rows' positions (and a tile
    # of alignment), else the context. An undercount costs parallelism, never keys.
    span = max_ctx if not variants.window else min(max_ctx, variants.window + max_q + tn)
    if _split_override is not None:
        size = _split_override
        if size % tn:
            _fail(f"the split-KV partition ({size} tokens) must be a multiple of the tile's "
                  f"{tn} tokens")
    else:
        ctas = p.num_seqs * p.num_kv_heads * plan.q_tiles
        size = decode._split(ctas, span, k.slots, tn, tn, False) if span > tn else 0
    if size and workspace is not None:
        size = decode._fit_partitions(size, "auto", p, span, workspace.max_rows, tn)
    n_parts = min(decode._parts(span, size), decode._MAX_GRID_YZ)
    return (size, n_parts) if n_parts > 1 else (0, 1)


def _prepare_prefill(q, o, p: decode._Problem, plan: _Plan, scale: float, causal: bool,
                     alibi: int, variants: _variants.Variants = _variants.PLAIN,
                     max_q: int = 0, max_ctx: int = 0,
                     workspace: decode._Partials | None = None) -> decode._Launch:
    """paged_prefill's launches (and the combine of its split-KV) for a validated call
    (``q``, ``o``: the adapted query and out, or None for a new out)."""
    if q.data.ptr % 16 or q.strides[0] % 16 or q.strides[1] % 16:
        _fail(f"query must be 16-byte aligned with token and head strides that are multiples "
              f"of 16 bytes for multi-token {p.dtype.name} attention (pointer "
              f"{q.data.ptr:#x}, strides {q.strides})")
    if o is not None and o.data.ptr % 4:
        _fail(f"out must be 4-byte aligned (pointer {o.data.ptr:#x})")
    # ALiBi and the soft-cap's fixed offset are compile-time variants of this kernel only.
    letters = _variants.prefill_letters(variants, p.dtype.name, bool(alibi))
    k = _prefill_kernel(p.device, p.dtype.name, p.head_size, p.block_size, p.cache.kv_format,
                        plan.tile, p.cache.dtype.name, p.quant.mode, letters)
    vp = _variants.PLAIN_BYTES if variants is _variants.PLAIN else variants.pack()
    size, n_parts = _prefill_split(k, p, plan, max_q, max_ctx, variants, workspace)
    kv_strides, kv_tail = decode._kv_args(p)
    # Grid x is (sequence, KV head), y the query tiles, heaviest first (the kernel's
    # header), z the split-KV partitions.
    launch = decode._Launch(
        k.launch, (p.num_seqs * p.num_kv_heads, plan.q_tiles, n_parts), k.threads, k.smem,
        True, (size // k.tile_tokens,), p.q_strides, kv_strides, kv_tail,
        (alibi, p.num_heads, p.num_heads // p.num_kv_heads, int(causal),
         scale * decode._LOG2E), variants, vp)
    if n_parts == 1:
        return launch
    # (The combine is loaded here, not with the kernel: most multi-token calls never split.)
    return launch._replace(
        split=True, combine=decode._combine(p.device, p.dtype.name, p.head_size),
        combine_grid=(p.num_rows, p.num_heads, 1), combine_tail=(0, size, n_parts, k.tile_tokens),
        partials=workspace, scratch_rows=p.num_rows * p.num_heads * n_parts,
        head_size=p.head_size)


def attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *,
              kv_layout="NHD", causal=True, scale=None, alibi_slopes=None, max_query_len=None,
              max_seq_len=None, out=None, stream=None, workspace=None, kv_cache_dtype="auto",
              k_scale=None, v_scale=None, window=None, window_left=None, logits_soft_cap=None,
              sinks=None, return_lse=False, lse=None):
    """Paged attention of a varlen batch of query tokens over a paged KV cache: prefill,
    chunked prefill, speculative verify and decode, mixed freely in one call.

    Args:
        query: ``[total_q, num_heads, head_size]``, float16, bfloat16 or float32. Token and
            head strides are free (a slice of a fused QKV works); the last dimension must
            be contiguous. For several tokens per sequence with a 16-bit dtype the pointer
            and strides must be multiples of 16 bytes.
        key_cache, value_cache: the paged cache in ``kv_layout``, the query's dtype or fp8
            (``kv_cache_dtype``):
            ``"NHD"``: ``[num_blocks, block_size, num_kv_heads, head_size]``;
            ``"HND"``: ``[num_blocks, num_kv_heads, block_size, head_size]``;
            ``"vllm"``: key ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``
            with ``x = 16 // itemsize`` (16 for fp8), value ``[num_blocks, num_kv_heads, head_size,
            block_size]`` (what :func:`paged_attention` takes).
            NHD/HND caches may be views with any strides (K and V halves of FlashInfer's
            ``[num_blocks, 2, ...]`` or of vLLM's ``[..., 2 * head_size]``) as long as the
            last dimension is contiguous and the pointer and other strides are multiples of
            16 bytes; they are read in place.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, the physical block of each
            logical block; entries past a sequence's last block are never read.
        seq_lens: int32 ``[num_seqs]``: tokens in each sequence's cache, this step's
            tokens included (their K/V were written before the call).
        query_start_loc: int32 ``[num_seqs + 1]`` on the device: sequence s owns query rows
            ``query_start_loc[s]:query_start_loc[s + 1]`` (``q_len`` may be 0). Those
            tokens are the last ``q_len`` of its ``seq_lens[s]``: row i is at position
            ``seq_lens[s] - q_len + i``. ``None``: one token per sequence (decode).
            It must run from 0 to ``total_q``, non-decreasing, with each ``q_len <=
            seq_lens[s]``: device facts that ``CUPAGED_DEBUG=1`` checks (with a sync);
            without it, output rows outside every sequence's range are unspecified.
        kv_layout: ``"NHD"`` (default), ``"HND"`` or ``"vllm"``.
        causal: each query token sees keys at positions up to its own (bottom-right
            aligned, as FlashAttention and vLLM); ``False``: all ``seq_lens[s]`` keys.
        scale: softmax scale; default ``1 / sqrt(head_size)``.
        alibi_slopes: optional float32 ``[num_heads]``: adds
            ``slope * (key_pos - query_pos)`` to the scores.
        max_query_len, max_seq_len: host-side bounds used only to size the work (no device
            sync when omitted: ``total_q`` and the table's width). An undercount costs
            parallelism, never correctness. ``max_query_len == 1`` with
            ``total_q == num_seqs`` selects the decode kernel (with split-KV), which still
            reads ``query_start_loc``: a batch whose rows are split otherwise (such as
            ``[2, 0]``) is computed as it is.
        out: optional C-contiguous ``[total_q, num_heads, head_size]`` output (may be the
            query itself, written in place).
        stream: as for :func:`paged_attention`.
        workspace: a :class:`DecodeWorkspace` for the split-KV partials (decode, and
            multi-token steps with few query tiles over long contexts, such as a shared
            prefix's queries); with ``out`` given, the call allocates nothing. Too small a
            workspace means fewer, larger partitions, never a different result.
        kv_cache_dtype, k_scale, v_scale: an fp8 cache and its scales, as for
            :func:`paged_attention` (every layout, every kind of step).
        window: sliding window W >= 1: a query at position p also needs keys at
            positions > p - W (with causal: the W positions (p - W, p], its own
            included; Mistral's and Gemma's ``sliding_window``). Blocks before the window
            are never read, table entries included, so an engine may free them.
        window_left: the same as FlashInfer spells it: ``window = window_left + 1``;
            -1 means no window.
        logits_soft_cap: c > 0: each logit ``scale * q.k`` becomes ``c * tanh(logit /
            c)`` (Gemma 2); ALiBi is added after the cap. None or 0: no cap.
        sinks: float32 ``[num_heads]`` on the device: each head's softmax denominator
            gains ``exp(sink)`` (natural-log units), with no value attached (gpt-oss's
            attention sinks). A row that sees no key then gives zeros.
        return_lse: also return float32 ``lse [total_q, num_heads]``, the natural log of
            each row's softmax denominator (sink included); -inf for a row with no key
            and no sink. FlashInfer's lse is base 2: ``lse_e = lse_2 * ln(2)``. Partial
            results over disjoint keys merge exactly with :func:`merge_state`.
        lse: a float32 ``[total_q, num_heads]`` C-contiguous array to write the lse into
            (implies ``return_lse``; no allocation, for graph capture).

    Returns:
        ``out``, a new torch tensor when ``query`` is one (else a CuPy array); with
        ``return_lse`` or ``lse``: ``(out, lse)``. A query row that sees no key (its
        sequence is empty) gets zeros. Never synchronizes; block ids outside the cache give
        NaN rows, never an out-of-bounds read (``CUPAGED_DEBUG=1`` checks the tables and
        ``query_start_loc`` with a sync).

    A call whose arrays' metadata (shapes, strides, dtypes, device, 16-byte alignment),
    side arrays and keywords match an earlier successful call's skips validation and
    planning; :class:`AttentionPlan` does the same for a whole step's layers.
    """
    va = decode._variant_args(window, window_left, logits_soft_cap, sinks, return_lse, lse)
    k, ptrs = _prepared.key(
        "attention", (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                      out, lse),
        (alibi_slopes, sinks, k_scale, v_scale),
        (kv_layout, causal, scale, max_query_len, max_seq_len, kv_cache_dtype, window,
         window_left, logits_soft_cap, return_lse), decode._workspace_key(workspace))
    prep = _prepared.lookup(k)
    if prep is None or _prepared.overlaps(prep, ptrs[0], ptrs[6]):
        prep, ptrs = _validate_and_prepare(query, key_cache, value_cache, block_tables,
                                           seq_lens, query_start_loc, kv_layout, causal, scale,
                                           alibi_slopes, max_query_len, max_seq_len, out,
                                           stream, workspace, kv_cache_dtype, k_scale, v_scale,
                                           va)
        _prepared.remember(k, prep)
    return _prepared.run(prep, ptrs, stream, out, lse)


def _validate_and_prepare(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, kv_layout, causal, scale, alibi_slopes,
                          max_query_len, max_seq_len, out, stream, workspace, kv_cache_dtype,
                          k_scale, v_scale, va: decode._VariantArgs) -> tuple:
    """``(prepared call, addresses)`` of an attention call: every check (CUPAGED_DEBUG's
    device reads too), then the plan of its launches."""
    q = as_device_array(query, "query")
    kc = as_device_array(key_cache, "key_cache")
    vc = as_device_array(value_cache, "value_cache")
    bt = as_device_array(block_tables, "block_tables")
    sl = as_device_array(seq_lens, "seq_lens")
    qsl = optional_device_array(query_start_loc, "query_start_loc")
    alibi = optional_device_array(alibi_slopes, "alibi_slopes")
    o = optional_output_array(out, "out")
    p = _validate(q, kc, vc, bt, sl, qsl, alibi, o, kv_layout, kv_cache_dtype, k_scale, v_scale)
    scale = decode._scale(scale, p.head_size)
    max_q = _checks.host_bound(max_query_len, "max_query_len", p.num_rows)
    max_ctx = _checks.host_bound(max_seq_len, "max_seq_len", p.max_blocks * p.block_size)
    workspace = decode._workspace_partials(workspace, p)
    variants, lse = decode._variant_setup(va, p)
    plan = _plan(p, qsl is not None, max_q)
    alibi_ptr = 0 if alibi is None else alibi.data.ptr
    with _arrays.on_device(p.device):
        if _checks.DEBUG:
            ctx = _arrays.context(p.device, _arrays.framework(query), stream)
            decode._check_tables(bt, sl, p.num_blocks, p.block_size, ctx)
            if qsl is not None:
                _check_queries(qsl, sl, p.num_rows, ctx)
        if not (p.num_seqs and p.num_rows):
            launch = None
        elif plan.kind == "prefill":
            launch = _prepare_prefill(q, o, p, plan, scale, causal, alibi_ptr, variants, max_q,
                                      max_ctx, workspace)
        else:
            launch = decode._prepare(p, scale, max_ctx, "auto", alibi_ptr, workspace,
                                     rows=plan.kind == "rows", causal=causal, variants=variants)
    return (decode._prepared_call(launch, p, q, o, va, lse, _arrays.framework(query)),
            _prepared.addresses(q, kc, vc, bt, sl, qsl, o, lse))


class AttentionPlan:
    """:func:`attention` validated and planned once, then run many times: every layer of
    a model in one step, each with its own query, caches and output.

    ``AttentionPlan(query, key_cache, value_cache, block_tables, seq_lens,
    query_start_loc, **keywords)`` takes exactly :func:`attention`'s arguments (``stream``
    excepted) and checks them as a call would, launching nothing. It binds the step's
    shared arguments: ``block_tables``, ``seq_lens``, ``query_start_loc``, ALiBi slopes,
    sinks, scales, the workspace and every scalar keyword. The query, caches, ``out`` and
    ``lse`` it is given are examples: :meth:`run` takes arrays of the same kind, shapes,
    strides, dtypes and device (their data and addresses are free), so one plan serves
    all layers. A run with other arrays, or with ``k_scale``/``v_scale`` of its own (an
    fp8 layer's scales), is a plain :func:`attention` call with the plan's other
    arguments: still right, only slower.

    A plan reads nothing on the device and allocates nothing; :meth:`run` allocates only
    ``out`` (and ``lse`` with ``return_lse``) when not given, so with both given it can
    be captured in a CUDA graph. The bound arrays must stay alive and unmoved while the
    plan is used (the plan keeps references to them).

    Example, one decode step of an n-layer model::

        plan = cupaged.AttentionPlan(q[0], k_caches[0], v_caches[0], block_tables,
                                     seq_lens, query_start_loc, out=outs[0])
        for layer in range(n):
            plan.run(q[layer], k_caches[layer], v_caches[layer], out=outs[layer])
    """

    def __init__(self, query, key_cache, value_cache, block_tables, seq_lens,
                 query_start_loc=None, *, kv_layout="NHD", causal=True, scale=None,
                 alibi_slopes=None, max_query_len=None, max_seq_len=None, out=None,
                 workspace=None, kv_cache_dtype="auto", k_scale=None, v_scale=None,
                 window=None, window_left=None, logits_soft_cap=None, sinks=None,
                 return_lse=False, lse=None):
        self._shared = (block_tables, seq_lens, query_start_loc)
        self._keywords = dict(kv_layout=kv_layout, causal=causal, scale=scale,
                              alibi_slopes=alibi_slopes, max_query_len=max_query_len,
                              max_seq_len=max_seq_len, workspace=workspace,
                              kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
                              window=window, window_left=window_left,
                              logits_soft_cap=logits_soft_cap, sinks=sinks,
                              return_lse=return_lse)
        va = decode._variant_args(window, window_left, logits_soft_cap, sinks, return_lse, lse)
        self._prepared, _ = _validate_and_prepare(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, kv_layout,
            causal, scale, alibi_slopes, max_query_len, max_seq_len, out, None, workspace,
            kv_cache_dtype, k_scale, v_scale, va)
        # What run() compares: the per-layer arrays' metadata and the bound tables'
        # metadata and addresses (a torch tensor re-pointed or resized in place, by set_
        # or resize_, must not be read where it was). None: not keyable, every run is a
        # plain call.
        self._metas, ptrs = _prepared.metas((query, key_cache, value_cache, out, lse,
                                             *self._shared))
        self._shared_ptrs = None if ptrs is None else ptrs[5:]

    def run(self, query, key_cache, value_cache, *, out=None, lse=None, stream=None,
            k_scale=None, v_scale=None):
        """Attention of this step for one layer's arrays (see the class). Returns as
        :func:`attention` does: ``out``, or ``(out, lse)`` with ``return_lse``/``lse``."""
        m, ptrs = _prepared.metas((query, key_cache, value_cache, out, lse, *self._shared))
        if (m is None or m != self._metas or ptrs[5:] != self._shared_ptrs
                or k_scale is not None or v_scale is not None or _checks.DEBUG
                or _prepared.overlaps(self._prepared, ptrs[0], ptrs[3])):
            kw = dict(self._keywords)
            for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
                if given is not None:
                    kw[name] = given
            return attention(query, key_cache, value_cache, *self._shared, out=out, lse=lse,
                             stream=stream, **kw)
        q, kc, vc, o, l, bt, lens, starts = ptrs
        return _prepared.run(self._prepared, (q, kc, vc, bt, lens, starts, o, l), stream, out,
                             lse)

    def __repr__(self) -> str:
        launch = self._prepared.launch
        what = "nothing to launch" if launch is None else launch.kernel.name
        return f"AttentionPlan({what}, query {self._prepared.shape})"
