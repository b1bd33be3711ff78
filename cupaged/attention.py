"""Paged attention for every kind of step: a varlen batch of query tokens per sequence
(prefill, chunked prefill, speculative verify, decode, all mixed) over NHD, HND or vLLM's
legacy cache layout: :func:`attention`, and :class:`AttentionPlan` for a step's layers.

A call goes down the layers once: array adaptation, validation (:mod:`.validation`),
planning (:mod:`.planning`: which kernel, its tiles, split-KV), launch (:mod:`.launch`).
Three kernels serve the plans: ``paged_decode`` for one token per sequence without
``query_start_loc`` (with split-KV), ``paged_prefill`` (tensor cores, the group's heads
and tokens packed into each tile's rows) for several tokens of a 16-bit cache, and
``paged_decode``'s row mode (one CTA per query token, split-KV too) for one token per
sequence given with ``query_start_loc`` and for what ``paged_prefill`` does not take:
float32, and vLLM's layout with blocks under 8 tokens.
"""

from __future__ import annotations

from . import _arrays, _checks, _fastrun, _prepared, launch, planning, validation
from ._arrays import as_device_array, optional_device_array, optional_output_array

_fail = _checks.fail


__all__ = ["AttentionPlan", "attention"]


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
            and strides must be multiples of 16 bytes. An 8-bit query (float8, or uint8 /
            int8 holding fp8 bytes) is read in its fp8 cache's format and multiplied on
            8-bit tensor cores (Hopper, head sizes 64 and 128, token-major caches with
            per-tensor scales, ``query_start_loc`` given): its own per-tensor scale goes
            into ``scale`` (pass ``scale = softmax_scale * q_scale``), ``out`` is required
            and gives the output's type (float16 or bfloat16), and the softmax weights are
            rounded to the fp8 format for P V (FlashAttention-3's fp8 mode: each weight off
            by up to 2^-4 of itself in e4m3).
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
            prefix's queries), made for at least ``total_q`` query rows: its partials are
            per query row and head. With ``out`` given, the call allocates nothing. Too
            small a workspace means fewer, larger partitions: the same attention, summed
            in longer passes (past 262,144 keys, with more rounding).
        kv_cache_dtype, k_scale, v_scale: an fp8 cache and its scales, as for
            :func:`paged_attention` (every layout, every kind of step; the same per-tensor
            scale forms at every entry point).
        window: sliding window W >= 1: a query at position p also needs keys at
            positions > p - W (with causal: the W positions (p - W, p], its own
            included; Mistral's and Gemma's ``sliding_window``). Blocks before the window
            are never read, table entries included, so an engine may free them.
        window_left: the same as FlashInfer spells it: ``window = window_left + 1``;
            -1 means no window.
        logits_soft_cap: c > 0: each logit ``scale * q.k`` becomes ``c * tanh(logit /
            c)`` (Gemma 2); ALiBi is added after the cap. None or 0: no cap.
            :class:`SoftCap` ``(c, approx=True)``: the tanh by the GPU's one-instruction
            approximation, each capped logit within about ``2**-11 * c`` (FlashInfer's and
            FlashAttention's form; faster, see :class:`SoftCap`).
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
        ``return_lse`` or ``lse``: ``(out, lse)``. A query row that sees no key (the row
        of a length-0 sequence, without ``query_start_loc``) gets zeros and lse -inf (with
        ``sinks``, the sink). Never synchronizes.

    A block id outside the cache is never read through (no out-of-bounds read): the rows
    whose keys include that block come out NaN in every head, lse too. The decode kernel
    (one token per sequence, and the row mode) makes exactly those rows NaN; the
    multi-token kernel (several 16-bit tokens per sequence) computes tiles of up to 128
    packed rows (tokens x the query heads of a KV head) and may make the other rows of
    such a row's tile NaN too. Other sequences are never touched (docs/API.md, "Errors and
    CUPAGED_DEBUG"). ``CUPAGED_DEBUG=1`` checks the tables and ``query_start_loc`` with a
    sync, as :func:`check_block_tables` does.

    A call whose arrays' metadata (shapes, strides, dtypes, device, 16-byte alignment),
    side arrays and keywords match an earlier successful call's skips validation and
    planning; :class:`AttentionPlan` does the same for a whole step's layers. Repeats of
    one of the last few such calls with CuPy arrays or torch tensors and ``out`` given
    (no ``stream``, no side arrays) take its fast run: the same checks in one function
    compiled for its form of call, launched from a parameter buffer packed once
    (docs/DESIGN.md, "The fast run").
    """
    # The fast runs of the last remembered calls of this query's shape (_fastrun), which
    # take CuPy arrays or torch tensors and no stream=.
    for fast in (_prepared.fast_attention.get(query.shape, ())
                 if stream is None and type(query) in _fastrun.TYPES else ()):
        r = fast(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                 kv_layout, causal, scale, alibi_slopes, max_query_len, max_seq_len, out,
                 stream, workspace, kv_cache_dtype, k_scale, v_scale, window, window_left,
                 logits_soft_cap, sinks, return_lse, lse)
        if r is not _fastrun.MISS:
            return r
    va = validation.variant_args(window, window_left, logits_soft_cap, sinks, return_lse, lse)
    k, ptrs = _prepared.key(
        "attention", (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                      out, lse),
        (alibi_slopes, sinks, k_scale, v_scale),
        (kv_layout, causal, scale, max_query_len, max_seq_len, kv_cache_dtype, window,
         window_left, logits_soft_cap, return_lse), launch.workspace_key(workspace))
    prep = _prepared.lookup(k)
    if prep is None or _prepared.clashes(prep, ptrs):
        prep, ptrs = validate_and_prepare(query, key_cache, value_cache, block_tables,
                                           seq_lens, query_start_loc, kv_layout, causal, scale,
                                           alibi_slopes, max_query_len, max_seq_len, out,
                                           stream, workspace, kv_cache_dtype, k_scale, v_scale,
                                           va)
        _prepared.remember(k, prep)
    elif stream is None:  # a hit: repeats of this call take its fast run from now on
        # (Its maker's arguments passed along, not captured by a closure: a closure would
        # make cells of this function's parameters, read indirectly on every call.)
        _prepared.use_fast(k, prep, _fastrun.call_runner, prep, k[5], kv_layout, causal,
                           scale, alibi_slopes, max_query_len, max_seq_len, workspace,
                           kv_cache_dtype, k_scale, v_scale, window, window_left,
                           logits_soft_cap, sinks, return_lse)
    return _prepared.run(prep, ptrs, stream, out, lse)


def validate_and_prepare(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, kv_layout, causal, scale, alibi_slopes,
                          max_query_len, max_seq_len, out, stream, workspace, kv_cache_dtype,
                          k_scale, v_scale, va: validation.VariantArgs,
                          plan: bool = True) -> tuple:
    """``(prepared call, addresses)`` of an attention call: every check (CUPAGED_DEBUG's
    device reads too), then the plan of its launches. ``plan=False``: the checks on
    metadata alone, which need no device (``(None, None)``; cupaged.jax while tracing)."""
    q = as_device_array(query, "query")
    kc = as_device_array(key_cache, "key_cache")
    vc = as_device_array(value_cache, "value_cache")
    bt = as_device_array(block_tables, "block_tables")
    sl = as_device_array(seq_lens, "seq_lens")
    qsl = optional_device_array(query_start_loc, "query_start_loc")
    alibi = optional_device_array(alibi_slopes, "alibi_slopes")
    o = optional_output_array(out, "out")
    p = validation.validate_varlen(q, kc, vc, bt, sl, qsl, alibi, o, kv_layout, kv_cache_dtype,
                                   k_scale, v_scale)
    scale = validation.softmax_scale(scale, p.head_size)
    max_q = _checks.host_bound(max_query_len, "max_query_len", p.num_rows)
    max_ctx = _checks.host_bound(max_seq_len, "max_seq_len", p.max_blocks * p.block_size)
    workspace = launch.workspace_partials(workspace, p)
    variants, lse = validation.variant_setup(va, p)
    disjoint = validation.outputs_apart(
        q, o, lse, ((1, "key_cache", kc), (2, "value_cache", vc), (3, "block_tables", bt),
                    (4, "seq_lens", sl), (5, "query_start_loc", qsl), (None, "alibi_slopes", alibi)),
        variants, p)
    if not plan:
        return None, None
    with _arrays.on_device(p.device):
        if _checks.debug():
            ctx = _arrays.check_context(p.device, _arrays.framework(query), stream)
            validation.check_tables_on_device(bt, sl, p.num_blocks, p.block_size, ctx)
            if qsl is not None:
                validation.check_queries_on_device(qsl, sl, p.num_rows, ctx)
        kplan = planning.plan_attention(p, qsl is not None, max_q, max_ctx, variants,
                                        alibi is not None, workspace)
        launches = launch.build(q, o, p, kplan, scale, causal,
                                0 if alibi is None else alibi.data.ptr, variants, workspace)
    return (launch.prepared_call(launches, p, q, o, va, lse, _arrays.framework(query),
                                 disjoint),
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
    be captured in a CUDA graph. The bound arrays must stay alive while the plan is used
    (the plan keeps references to them; each run re-reads the tables' metadata and
    addresses, and a torch side tensor's address, shape, strides and dtype: one re-pointed
    or resized in place makes the run a plain call).

    With CuPy arrays or torch tensors and ``out`` given (a split's combine included),
    ``plan.run`` is the plan's fast run: the same checks in one function compiled for its
    form of call, launched from a parameter buffer packed once per thread; it leaves every
    other call (``stream=``, scales of its own, the other framework's arrays, other
    metadata) to the method
    (docs/DESIGN.md, "The fast run").

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
        va = validation.variant_args(window, window_left, logits_soft_cap, sinks, return_lse, lse)
        # As attention() does: a call the memo knows (the last step's plan, say) is not
        # validated again (its key names one validation outcome; the overlaps depend on
        # the addresses and are checked here).
        k, ptrs = _prepared.key(
            "attention", (query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, out, lse),
            (alibi_slopes, sinks, k_scale, v_scale),
            (kv_layout, causal, scale, max_query_len, max_seq_len, kv_cache_dtype, window,
             window_left, logits_soft_cap, return_lse), launch.workspace_key(workspace))
        prep = _prepared.lookup(k)
        if prep is None or _prepared.clashes(prep, ptrs):
            prep, _ = validate_and_prepare(
                query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                kv_layout, causal, scale, alibi_slopes, max_query_len, max_seq_len, out, None,
                workspace, kv_cache_dtype, k_scale, v_scale, va)
            _prepared.remember(k, prep)
        self._prepared = prep
        # What run() compares: the per-layer arrays' metadata and the bound tables'
        # metadata and addresses (a torch tensor re-pointed or resized in place, by set_
        # or resize_, must not be read where it was). None: not keyable, every run is a
        # plain call. The order is _prepared.run's (query, caches, shared arrays, out, lse).
        if k is not None:
            self._metas = k[5]
        else:
            self._metas, ptrs = _prepared.metas((query, key_cache, value_cache, *self._shared,
                                                 out, lse))
        self._shared_ptrs = None if ptrs is None else ptrs[3:6]
        # Torch side tensors, which the prepared launch holds at their addresses: re-pointed
        # or resized in place, a run is a plain call (_prepared.side_tensors).
        self._side = _prepared.side_tensors(alibi_slopes, sinks, k_scale, v_scale)
        self._side_state = _prepared.side_state(self._side)
        # The same run as one straight-line function with this plan's constants bound
        # (CuPy arrays or torch tensors, out given): the fast run (_fastrun). It shadows the
        # method (not a subclass's own run); every call it declines goes to the method,
        # bound to a copy of the plan without the fast run (no reference cycle).
        if type(self).run is AttentionPlan.run:
            generic = object.__new__(AttentionPlan)
            generic.__dict__.update(self.__dict__)
            fast = _fastrun.plan_runner(prep, self._metas, self._shared, generic.run,
                                        AttentionPlan.run.__doc__, self._side)
            if fast is not None:
                self.run = fast

    def run(self, query, key_cache, value_cache, *, out=None, lse=None, stream=None,
            k_scale=None, v_scale=None):
        """Attention of this step for one layer's arrays (see the class). Returns as
        :func:`attention` does: ``out``, or ``(out, lse)`` with ``return_lse``/``lse``.
        (A plan with a fast run shadows this method with it; a call the fast run does not
        stand for comes here.)"""
        m, ptrs = _prepared.metas((query, key_cache, value_cache, *self._shared, out, lse))
        if (m is None or m != self._metas or ptrs[3:6] != self._shared_ptrs
                or k_scale is not None or v_scale is not None or _checks.debug()
                or (self._side and _prepared.side_state(self._side) != self._side_state)
                or _prepared.clashes(self._prepared, ptrs)):
            kw = dict(self._keywords)
            for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
                if given is not None:
                    kw[name] = given
            return attention(query, key_cache, value_cache, *self._shared, out=out, lse=lse,
                             stream=stream, **kw)
        return _prepared.run(self._prepared, ptrs, stream, out, lse)

    def __repr__(self) -> str:
        launches = self._prepared.launch
        what = "nothing to launch" if launches is None else launches.kernel.name
        return f"AttentionPlan({what}, query {self._prepared.shape})"
