"""Absorbed multi-head latent attention (DeepSeek's MLA) over a paged latent cache:
:func:`mla_attention`. A call goes down the same layers as :func:`cupaged.attention`:
array adaptation, validation (:func:`.validation.validate_mla`), planning
(:func:`.planning.plan_mla`: the kernel, rows per CTA, tiles, split-KV), launch
(:func:`.launch.build_mla`), and a repeated call skips to the launch (``_prepared``).
Two kernels serve it: ``mla_attention`` (mma.sync, sm_80+) and, on Hopper,
``mla_attention_sm90`` (wgmma) for 64 packed rows or more, or 16 over pages of 16 tokens
or more; ``paged_decode_combine`` merges a split."""

from __future__ import annotations

from . import _arrays, _checks, _fastrun, _kvquant, _prepared, launch, planning, validation
from ._arrays import as_device_array, optional_device_array, optional_output_array

_fail = _checks.fail

__all__ = ["mla_attention"]


def mla_attention(q, kv_cache, block_tables, seq_lens, query_start_loc=None, *, scale,
                  kv_lora_rank=None, k_pe_cache=None, causal=True, max_query_len=None,
                  max_seq_len=None, out=None, return_lse=False, lse=None, stream=None,
                  kv_cache_dtype="auto", k_scale=None, workspace=None):
    """Absorbed multi-head latent attention over a paged latent cache, for decode, several
    query tokens per sequence (multi-token prediction, speculative verify) and chunked
    prefill, mixed in one varlen batch.

    With the up-projections absorbed, every query head attends over the same cached
    vectors: a token's key is its whole latent vector ``[kv_c, k_pe]`` (kv_lora_rank +
    rope_dim = 512 + 64 dims), its value ``kv_c`` (512 dims). The output is each head's
    latent result, which the caller maps to values with the head's ``W_UV``.

    Args:
        q: ``[total_q, num_heads, kv_lora_rank + rope_dim]`` (each head's absorbed
            ``W_UK q_nope`` followed by its ``q_pe``), or the pair ``(q_nope, q_pe)`` of
            ``[total_q, num_heads, kv_lora_rank]`` and ``[.., rope_dim]``; float16 or
            bfloat16. Token and head strides are free; the last dimension is contiguous,
            pointers and strides multiples of 16 bytes.
        kv_cache: vLLM's combined latent cache ``[num_blocks, block_size, kv_lora_rank +
            rope_dim]`` (what :func:`cupaged.concat_and_cache_mla` writes), or with
            ``k_pe_cache`` FlashInfer's ``kv_c`` cache ``[num_blocks, block_size,
            kv_lora_rank]``; the query's dtype. Block and token strides are free (multiples
            of 16 bytes), so views of a larger allocation are read in place.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; entries past a sequence's
            last block are never read, and a block id outside the cache is never
            dereferenced: the rows of its sequence whose keys include it come out NaN,
            lse too, and so may the others of that sequence that share a tile of 16 to 64
            packed rows (query tokens x heads) with one; rows of earlier tiles and of other
            sequences are exact.
        seq_lens: int32 ``[num_seqs]``: cached tokens of each sequence, this step's
            included.
        query_start_loc: int32 ``[num_seqs + 1]``: sequence s owns query rows
            ``query_start_loc[s]:query_start_loc[s + 1]``, the last ``q_len`` of its
            tokens (row i at position ``seq_lens[s] - q_len + i``), as in
            :func:`cupaged.attention` (its device facts are the caller's, checked under
            ``CUPAGED_DEBUG=1``; output rows outside every sequence's range are
            unspecified). None: one token per sequence (decode).
        scale: the softmax scale, required: DeepSeek's is ``1 / sqrt(qk_nope_head_dim +
            qk_rope_head_dim)`` (times YaRN's mscale squared), not one over the root of the
            576-dim key.
        kv_lora_rank: splits a combined cache (default 512; the rest of its last
            dimension is rope_dim); with ``k_pe_cache`` it must match ``kv_cache``'s last
            dimension (ValueError), and rope_dim is ``k_pe_cache``'s. Built for 512 with 64
            rotary dims only: any other pair raises ValueError naming both, before
            anything is launched (an int is required: TypeError).
        k_pe_cache: ``[num_blocks, block_size, rope_dim]``, the rotary keys of a split
            cache.
        causal: each query token sees keys up to its own position (bottom-right aligned);
            False: all ``seq_lens[s]`` keys.
        max_query_len, max_seq_len: host-side bounds used only to size the work (an
            undercount costs parallelism, never correctness; no device sync when omitted).
        out: optional C-contiguous ``[total_q, num_heads, kv_lora_rank]`` output of the
            query's dtype.
        return_lse, lse: also return (or write into ``lse``, float32 ``[total_q,
            num_heads]``) each row's natural-log softmax denominator, for
            :func:`cupaged.merge_state`.
        stream: as for :func:`cupaged.attention` (default: the caller's framework's
            current stream).
        workspace: a :class:`cupaged.DecodeWorkspace` for the split-KV partials, made as
            ``DecodeWorkspace(max_total_q, num_heads, 512)``: its first argument counts
            query rows (the most query tokens of a call, all sequences together; the
            batch size in decode), ``num_heads`` is this call's, and 512 the partials'
            width (kv_lora_rank). Each (token, head) row splits into at most ``rows //
            (total_q * num_heads)`` partitions. With ``out`` (and ``lse`` when asked)
            given, the call then allocates nothing (CUDA graph capture). Too small a
            workspace means fewer, larger partitions: the same attention, summed in
            longer passes (past 262,144 keys, with more rounding).
        kv_cache_dtype, k_scale: an fp8 latent cache (``"fp8"``/``"fp8_e4m3"``,
            ``"fp8_e5m2"``, or ``"auto"`` with a float8 dtype; uint8/int8 arrays need the
            name), read as ``stored * k_scale``: one scale per tensor for kv_c and k_pe
            alike, as :func:`cupaged.concat_and_cache_mla` writes it, in the forms every
            entry point takes (a positive finite number, a one-element CPU torch tensor or
            a one-element float32 device array; default 1.0: docs/API.md, "fp8 scale
            forms"). MLA's latent cache has no per-token scales: an array of more than one
            element raises ValueError saying so. With a 16-bit cache a ``k_scale`` raises
            ValueError. Each tile is widened to the query's dtype in shared memory (exact)
            before the products.

    Returns:
        ``out`` (a torch tensor when ``q`` is one, else a CuPy array), or ``(out, lse)``.
        A sequence of length 0, decoding without ``query_start_loc``, gets zeros and lse
        -inf in every head. Never synchronizes; nothing is allocated but ``out``/``lse``
        when not given and, for split-KV without ``workspace``, a scratch buffer in the
        stream's order.

    Page sizes are powers of two from 1 to 256; any number of heads (16 to 128 is what
    DeepSeek's models shard to).

    A call whose arrays' metadata (shapes, strides, dtypes, device, 16-byte alignment),
    ``k_scale``, workspace and keywords match an earlier successful call's skips
    validation and planning; whether ``out`` and ``lse`` overlap the query, the caches or
    each other is still checked at every call's addresses. Repeats of one of the last few
    such calls with CuPy arrays or torch tensors and ``out`` given (no ``stream``; ``lse``
    given where it is asked for) take its fast run: the same checks in one function
    compiled for its form of call, launched from parameter buffers packed once
    (docs/DESIGN.md, "The fast run"); a device ``k_scale`` is then read per call, so one
    run serves every layer's.
    """
    # The fast runs of the last remembered calls of this query's shape (_fastrun), which
    # take CuPy arrays or torch tensors and no stream=.
    first = q[0] if type(q) is tuple and len(q) == 2 else q
    if stream is None and type(first) in _fastrun.TYPES:
        for fast in _prepared.fast_mla.get(first.shape, ()):
            r = fast(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, kv_lora_rank,
                     k_pe_cache, causal, max_query_len, max_seq_len, out, return_lse, lse,
                     stream, kv_cache_dtype, k_scale, workspace)
            if r is not _fastrun.MISS:
                return r
    pair = isinstance(q, (tuple, list))
    k = ptrs = None
    if not pair or len(q) == 2:
        q_lat, q_pe = q if pair else (q, None)
        k, ptrs = _prepared.key(
            "mla", (q_lat, q_pe, kv_cache, k_pe_cache, block_tables, seq_lens, query_start_loc,
                    out, lse),
            (k_scale,), (scale, kv_lora_rank, causal, max_query_len, max_seq_len, return_lse,
                         kv_cache_dtype, pair), launch.workspace_key(workspace))
    prep = _prepared.lookup(k)
    if prep is None or _prepared.any_overlap(prep.disjoint, ptrs):
        prep, ptrs = validate_and_prepare(q, kv_cache, block_tables, seq_lens, query_start_loc,
                                           scale, kv_lora_rank, k_pe_cache, causal,
                                           max_query_len, max_seq_len, out, return_lse, lse,
                                           stream, kv_cache_dtype, k_scale, workspace)
        _prepared.remember(k, prep)
    elif stream is None:  # a hit: repeats of this call take its fast run from now on
        # (Its maker's arguments passed along, not captured by a closure: a closure would
        # make cells of this function's parameters, read indirectly on every call.)
        _prepared.use_fast(k, prep, _fastrun.mla_runner, prep, k[5], scale, kv_lora_rank,
                           causal, max_query_len, max_seq_len, return_lse, kv_cache_dtype,
                           k_scale, workspace)
    return _prepared.run(prep, launch.mla_run_addresses(ptrs, pair, k_pe_cache is not None),
                         stream, out, lse)


def validate_and_prepare(q, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                          kv_lora_rank, k_pe_cache, causal, max_query_len, max_seq_len, out,
                          return_lse, lse, stream, kv_cache_dtype, k_scale, workspace,
                          plan: bool = True) -> tuple:
    """``(prepared call, addresses)`` of an mla_attention call: every check (CUPAGED_DEBUG's
    device reads too), then the plan of its launches (``plan=False``: the checks on
    metadata alone, which need no device, giving ``(None, None)``). The addresses: q's (q_nope's),
    q_pe's (0 for a single q), the caches', the tables', lengths', query starts', out's
    and lse's (0 for none)."""
    if scale is None:
        _fail("scale is required: DeepSeek's is 1 / sqrt(qk_nope_head_dim + "
              "qk_rope_head_dim) (times YaRN's mscale squared), not 1 / sqrt(576)", TypeError)
    pair = isinstance(q, (tuple, list))
    if pair:
        if len(q) != 2:
            _fail(f"q as a sequence must be the pair (q_nope, q_pe), got {len(q)} arrays")
        qa = (as_device_array(q[0], "q_nope"), as_device_array(q[1], "q_pe"))
        first = q[0]
    else:
        qa = as_device_array(q, "q")
        first = q
    kc = as_device_array(kv_cache, "kv_cache")
    kpe = optional_device_array(k_pe_cache, "k_pe_cache")
    bt = as_device_array(block_tables, "block_tables")
    sl = as_device_array(seq_lens, "seq_lens")
    qsl = optional_device_array(query_start_loc, "query_start_loc")
    o = optional_output_array(out, "out")
    lse_a = optional_output_array(lse, "lse")
    p = validation.validate_mla(qa, kc, kpe, bt, sl, qsl, o, lse_a, kv_lora_rank,
                                kv_cache_dtype)
    scale_ptr, scale_value, scale_a = (0, 1.0, None)
    if p.cache_dtype is not p.dtype:
        scale_ptr, scale_value, scale_a = _kvquant.tensor_scale(
            1.0 if k_scale is None else k_scale, "k_scale", per_token=False)
        _checks.check_same_device(p.device, "q", (("k_scale", scale_a),))
        _checks.check_apart((("out", o), ("lse", lse_a)), (("k_scale", scale_a),),
                            written_apart=False)  # (out against lse: validate_mla's)
    elif k_scale is not None:
        _fail("k_scale is for an fp8 cache (kv_cache_dtype); this cache is "
              f"{p.cache_dtype.name}")
    scale = validation.softmax_scale(scale, p.rank + p.rope)
    max_q, max_ctx = validation.mla_bounds(p, qsl is not None, max_query_len, max_seq_len)
    parts = launch.mla_workspace_partials(workspace, p.device, p.rank)
    wants_lse = bool(return_lse) or lse is not None
    kind = _arrays.framework(first)
    if not plan:
        return None, None
    with _arrays.on_device(p.device):
        if _checks.debug():
            ctx = _arrays.check_context(p.device, kind, stream)
            validation.check_tables_on_device(bt, sl, p.num_blocks, p.block_size, ctx)
            if qsl is not None:
                validation.check_queries_on_device(qsl, sl, p.num_rows, ctx)
        mplan = planning.plan_mla(p.device, p.dtype.name, p.cache_dtype.name, p.rank, p.rope,
                                  p.block_size, p.num_seqs, p.num_rows, p.num_heads, max_q,
                                  max_ctx, None if parts is None else parts.max_rows)
        launches = None if mplan is None else launch.build_mla(
            p, mplan, scale, causal, (scale_ptr, scale_value), parts)
    q_lat, q_pe = qa if pair else (qa, None)
    # The checks of validate_mla that read addresses, to repeat at each call's own (a
    # scale array keyed at its address).
    disjoint = _prepared.disjoint_spans(((7, o), (8, lse_a)),
                                        ((0, q_lat), (1, q_pe), (2, kc), (3, kpe), (4, bt),
                                         (5, sl), (6, qsl), (None, scale_a)))
    prep = _prepared.Prepared(launches, p.device, kind, (p.num_rows, p.num_heads, p.rank),
                              q_lat.dtype, (), 0, False, wants_lse,
                              (p.num_rows, p.num_heads) if wants_lse and lse_a is None else (),
                              disjoint)
    return prep, _prepared.addresses(q_lat, q_pe, kc, kpe, bt, sl, qsl, o, lse_a)
