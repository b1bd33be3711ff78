"""Decode entry points: :func:`paged_attention` (one query token per sequence over vLLM's
cache layout) and vLLM's ``paged_attention_v1``/``v2`` with their argument order, plus
:func:`check_block_tables`.

A call goes down the layers once: array adaptation (``_arrays``), validation
(:mod:`.validation`), planning (:mod:`.planning`: specialization, split-KV, residency) and
launch (:mod:`.launch`), or, when the same call (by metadata) passed before, straight to its
prepared launches (``_prepared``).
"""

from __future__ import annotations

import numpy as np

from . import _arrays, _checks, _prepared, launch, planning, validation
from ._arrays import as_device_array, optional_device_array, optional_output_array
from .launch import DecodeWorkspace

_fail = _checks.fail


__all__ = [
    "BLOCK_SIZES",
    "DecodeWorkspace",
    "HEAD_SIZES",
    "check_block_tables",
    "paged_attention",
    "paged_attention_v1",
    "paged_attention_v2",
]


HEAD_SIZES = _checks.HEAD_SIZES
BLOCK_SIZES = _checks.BLOCK_SIZES


def _run(query, key_cache, value_cache, block_tables, context_lens, scale, alibi_slopes,
         max_context_len, out, partition, stream=None, workspace=None, kv_cache_dtype="auto",
         k_scale=None, v_scale=None, va: validation.VariantArgs = validation.NO_VARIANTS):
    """One decode call: its prepared launches when the same call (by metadata) passed
    validation before, else validation and planning first."""
    k, ptrs = _prepared.key(
        "decode", (query, key_cache, value_cache, block_tables, context_lens, None, out, va.lse),
        (alibi_slopes, va.sinks, k_scale, v_scale),
        (scale, max_context_len, partition, kv_cache_dtype, va.window, va.window_left,
         va.logits_soft_cap, va.return_lse, va.sparse), launch.workspace_key(workspace))
    prep = _prepared.lookup(k)
    if prep is None or _prepared.clashes(prep, ptrs):
        prep, ptrs = _validate_and_prepare(query, key_cache, value_cache, block_tables,
                                           context_lens, scale, alibi_slopes, max_context_len,
                                           out, partition, stream, workspace, kv_cache_dtype,
                                           k_scale, v_scale, va)
        _prepared.remember(k, prep)
    return _prepared.run(prep, ptrs, stream, out, va.lse)


def _validate_and_prepare(query, key_cache, value_cache, block_tables, context_lens, scale,
                          alibi_slopes, max_context_len, out, partition, stream, workspace,
                          kv_cache_dtype, k_scale, v_scale, va: validation.VariantArgs) -> tuple:
    """``(prepared call, addresses)``: every check (CUPAGED_DEBUG's device reads too),
    then the launches' plan."""
    q = as_device_array(query, "query")
    kc = as_device_array(key_cache, "key_cache")
    vc = as_device_array(value_cache, "value_cache")
    bt = as_device_array(block_tables, "block_tables")
    cl = as_device_array(context_lens, "context_lens")
    alibi = optional_device_array(alibi_slopes, "alibi_slopes")
    o = optional_output_array(out, "out")
    p = validation.validate_decode(q, kc, vc, bt, cl, alibi, o, kv_cache_dtype, k_scale, v_scale)
    scale = validation.softmax_scale(scale, p.head_size)
    max_ctx = validation.max_context(max_context_len, p)
    # paged_attention_v2's buffers come as Partials (a DecodeWorkspace's memory is its own)
    scratch = () if not isinstance(workspace, launch.Partials) else _v2_scratch(workspace, p)
    workspace = launch.workspace_partials(workspace, p)
    variants, lse = validation.variant_setup(va, p)
    disjoint = validation.outputs_apart(
        q, o, lse, ((1, "key_cache", kc), (2, "value_cache", vc), (3, "block_tables", bt),
                    (4, "context_lens", cl), (None, "alibi_slopes", alibi)), variants, p,
        scratch)
    if _checks.debug():
        with _arrays.on_device(p.device):
            validation.check_tables_on_device(
                bt, cl, p.num_blocks, p.block_size,
                _arrays.check_context(p.device, _arrays.framework(query), stream))
    with _arrays.on_device(p.device):
        plan = planning.plan_decode(p, max_ctx, partition, workspace, variants)
        launches = launch.build(q, o, p, plan, scale, True,
                                0 if alibi is None else alibi.data.ptr, variants, workspace)
    return (launch.prepared_call(launches, p, q, o, va, lse, _arrays.framework(query),
                                 disjoint),
            _prepared.addresses(q, kc, vc, bt, cl, None, o, lse))


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, *, scale=None,
                    alibi_slopes=None, max_context_len=None, out=None, partition="auto",
                    stream=None, workspace=None, kv_cache_dtype="auto", k_scale=None,
                    v_scale=None, window=None, window_left=None, logits_soft_cap=None,
                    sinks=None, return_lse=False, lse=None):
    """Decode attention of one query token per sequence over a paged KV cache.

    Args:
        query: ``[num_seqs, num_heads, head_size]``, float32, float16 or bfloat16. The
            sequence and head strides are free (a slice of a fused QKV works); the last
            dimension must be contiguous.
        key_cache: ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` with
            ``x = 16 // itemsize`` of the cache (vLLM's layout; 16 for fp8), the query's
            dtype or fp8 (``kv_cache_dtype``).
        value_cache: ``[num_blocks, num_kv_heads, head_size, block_size]``.
            Both caches must be contiguous within a block; their block and head strides
            are free (multiples of 16 bytes).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``: the physical block of each
            logical block. Entries past a sequence's last block are never read.
        context_lens: int32 ``[num_seqs]``: tokens in each sequence's cache.
        scale: softmax scale; default ``1 / sqrt(head_size)``.
        alibi_slopes: optional float32 ``[num_heads]``; adds ``slope * (pos - len + 1)``.
        max_context_len: a host-side bound on ``context_lens``, used only to size the
            split-KV work; default ``max_blocks_per_seq * block_size`` (no device sync).
            An undercount costs parallelism, never correctness.
        out: optional ``[num_seqs, num_heads, head_size]`` C-contiguous output.
        partition: ``"auto"`` (split-KV when it fills the GPU better), ``"never"``,
            ``"always"``, ``"flat"`` (equal runs of all the sequences' key tiles, one per
            resident CTA; docs/DESIGN.md), or a partition size in tokens (a multiple of
            block_size).
        stream: where the kernels run (a CuPy or torch stream, anything with
            ``__cuda_stream__``, or a handle); default torch's current stream of the
            arrays' device when ``query`` is a torch tensor, else CuPy's.
        workspace: a :class:`DecodeWorkspace` for the split-KV partials, made for at
            least ``num_seqs`` rows; with ``out`` given, the call then allocates nothing
            (CUDA graph capture).
        kv_cache_dtype: ``"auto"``: the caches hold the query's dtype, or an fp8 format
            their dtype names (torch's ``float8_e4m3fn``/``float8_e5m2``, ml_dtypes');
            ``"fp8"``/``"fp8_e4m3"`` or ``"fp8_e5m2"``: fp8 in any 1-byte storage (uint8,
            int8 or the float8 types). fp8 needs float16/bfloat16 queries and head sizes
            that are multiples of 16.
        k_scale, v_scale: an fp8 cache's scales: it holds ``value / scale`` and is read
            as ``stored * scale`` (fp32). Per tensor, in the forms every entry point takes
            (docs/API.md, "fp8 scale forms"): a positive finite number (a Python or NumPy
            scalar, not a bool; rounded to float32), a one-element CPU torch tensor (its
            value, read on the host), or a one-element float32 device array (read in the
            kernel: no sync, graph-safe; vLLM's ``layer._k_scale``); default 1. Per token
            and head: float32 ``[num_blocks, num_kv_heads, block_size]`` arrays (tokens
            contiguous), as :func:`reshape_and_cache` writes them, both or neither.
            Per-tensor scales are ignored (unchecked) for caches of the query's dtype;
            per-token arrays are refused there.
        window, window_left, logits_soft_cap, sinks, return_lse, lse: attention variants,
            as for :func:`attention` (a window here: the last ``window`` tokens).

    Arrays may be CuPy arrays, torch CUDA tensors or any ``__dlpack__`` producer on one
    device, mixed freely; none is copied.

    Returns:
        ``out``: ``[num_seqs, num_heads, head_size]``, the query's dtype; a new torch
        tensor when ``query`` is one, else a CuPy array. A sequence of length 0 gets
        zeros (and lse -inf; with ``sinks``, the sink). With ``return_lse`` (or ``lse=``):
        ``(out, lse)``, lse float32 ``[num_seqs, num_heads]``. head_size: any multiple of
        8 from 32 to 256, or of 16 to 512 (where the GPU's shared memory holds the tiles,
        else a ValueError naming the limit); block_size: a power of two from 1 to 256;
        ``num_heads`` a multiple of ``num_kv_heads``.

    Never synchronizes. Block ids are not range-checked on the host (that needs a sync):
    a sequence whose keys include a block id outside the cache gets NaN in every head
    (lse too), never an out-of-bounds read, and no other sequence is touched; a table
    entry it never reads (past its length, or wholly before its window) never matters.
    Use :func:`check_block_tables` or ``CUPAGED_DEBUG=1`` to find it.
    """
    va = validation.variant_args(window, window_left, logits_soft_cap, sinks, return_lse, lse)
    return _run(query, key_cache, value_cache, block_tables, context_lens, scale,
                alibi_slopes, max_context_len, out, partition, stream, workspace,
                kv_cache_dtype, k_scale, v_scale, va)


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                       context_lens, block_size, max_context_len, alibi_slopes=None,
                       kv_cache_dtype="auto", k_scale=None, v_scale=None, tp_rank=0,
                       blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                       blocksparse_block_size=64, blocksparse_head_sliding_step=0, *,
                       stream=None):
    """vLLM's ``paged_attention_v1``, with its full positional argument list: single-pass
    decode into ``out``. ``kv_cache_dtype``, ``k_scale`` and ``v_scale`` are as for
    :func:`paged_attention`. With ``blocksparse_vert_stride > 1`` (vLLM's switch) a key in
    sparse block ``sb = (key // block_size * block_size) // blocksparse_block_size`` is
    seen when ``sb > q_sb - blocksparse_local_blocks`` (``q_sb`` the query's own) or
    ``(sb + offset) % blocksparse_vert_stride == 0``, with ``offset = (tp_rank * num_heads
    + head) * step + 1`` for ``step = blocksparse_head_sliding_step >= 0``, else
    ``(tp_rank * num_kv_heads + kv_head) * -step + 1`` (vLLM's pattern;
    :func:`cupaged.reference.blocksparse_mask`)."""
    va = validation.blocksparse_args(tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                                     blocksparse_block_size, blocksparse_head_sliding_step)
    validation.check_vllm_args(key_cache, num_kv_heads, block_size)
    if out is None:
        _fail("out is required by paged_attention_v1")
    return _run(query, key_cache, value_cache, block_tables, context_lens, scale, alibi_slopes,
                max_context_len, out, "never", stream, None, kv_cache_dtype, k_scale, v_scale,
                va)


def _v2_scratch(parts: "launch.Partials", p) -> tuple:
    """paged_attention_v2's buffers as the float32 runs its kernels write in them."""
    n = parts.max_rows
    return tuple((name, _arrays.DeviceView((size,), np.float32, ptr, p.device))
                 for name, ptr, size in (("tmp_out", parts.part_out, n * p.head_size),
                                         ("max_logits", parts.part_max, n),
                                         ("exp_sums", parts.part_sum, n)))


def paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache,
                       num_kv_heads, scale, block_tables, context_lens, block_size,
                       max_context_len, alibi_slopes=None, kv_cache_dtype="auto", k_scale=None,
                       v_scale=None, tp_rank=0, blocksparse_local_blocks=0,
                       blocksparse_vert_stride=0, blocksparse_block_size=64,
                       blocksparse_head_sliding_step=0, *, stream=None):
    """vLLM's ``paged_attention_v2``, with its full positional argument list: split-KV
    decode into ``out`` (fp8 and blocksparse arguments as for :func:`paged_attention_v1`).

    ``exp_sums``/``max_logits``: float32 ``[num_seqs, num_heads, P]``; ``tmp_out``:
    ``[num_seqs, num_heads, P, head_size]``, float32 or the query's dtype, all contiguous.
    They are scratch space; cupaged picks a partition size so its (float32) partials fit
    in them, which for a 16-bit ``tmp_out`` means at most P // 2 partitions.
    """
    va = validation.blocksparse_args(tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                                     blocksparse_block_size, blocksparse_head_sliding_step)
    validation.check_vllm_args(key_cache, num_kv_heads, block_size)
    if out is None:
        _fail("out is required by paged_attention_v2")
    scratch = validation.check_v2_scratch(query, exp_sums, max_logits, tmp_out, out)
    bt = as_device_array(block_tables, "block_tables")
    partition = planning.v2_partition(scratch.capacity, bt.shape[-1] * block_size,
                                      max_context_len, block_size)
    # The partials are float32 rows carved from the caller's buffers (sizes checked).
    workspace = None if partition == "never" else launch.Partials(
        scratch.tmp_out, scratch.max_logits, scratch.exp_sums, scratch.rows * scratch.capacity)
    return _run(query, key_cache, value_cache, block_tables, context_lens, scale, alibi_slopes,
                max_context_len, out, partition, stream, workspace, kv_cache_dtype, k_scale,
                v_scale, va)


def check_block_tables(block_tables, context_lens, num_blocks: int, block_size: int, *,
                       stream=None) -> None:
    """Check, with a device sync, that every sequence's blocks exist: its length fits its
    row of ``block_tables`` and each of its first ``ceil(len / block_size)`` entries is in
    ``[0, num_blocks)``. Raises ValueError naming the first bad sequence. The arrays are
    read in the order of ``stream`` (default as for :func:`paged_attention`)."""
    bt = as_device_array(block_tables, "block_tables")
    cl = as_device_array(context_lens, "context_lens")
    device = bt.data.device_id
    with _arrays.launching(device):
        ctx = _arrays.context(device, _arrays.framework(block_tables), stream)
        validation.check_tables_on_device(bt, cl, num_blocks, block_size, ctx)
