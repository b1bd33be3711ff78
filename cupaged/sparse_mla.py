"""DeepSeek sparse attention (DSA: DeepSeek-V3.2's and V4's) over a paged latent cache:
:func:`sparse_mla_attention`, FlashMLA's sparse decode interface. Each query token attends
to the cached tokens its top-k indices name; the kernels are ``mla_sparse_attention``
(``mla_attention``'s mma.sync body reading keys through the indices, sm_80+; every cache
format, V4's 512-dim rows among them) and on Hopper ``mla_sparse_attention_sm90``
(``mla_attention_sm90``'s wgmma body: 64 heads or more, fp8_ds_mla at every head
count). The layers are MLA's: array adaptation, validation
(:func:`.validation.validate_mla` over the arrays seen as one token a "sequence"),
planning (:func:`.planning.plan_mla` with ``sparse``), launch (:func:`.launch.build_mla`)."""

from __future__ import annotations

import numpy as np

from . import _arrays, _checks, _dtypes, _prepared, _variants, launch, planning, validation
from ._arrays import as_device_array, optional_device_array, optional_output_array
from .specs import geometry

_fail = _checks.fail
FOLD = "[batch, s_q, ...] with batch and s_q foldable into one dimension"

__all__ = ["sparse_mla_attention"]


def sparse_mla_attention(q, kv_cache, indices, *, scale, topk_length=None, attn_sink=None,
                         extra_kv_cache=None, extra_indices=None, extra_topk_length=None,
                         kv_cache_dtype="auto", out=None, lse=None, return_lse=False,
                         stream=None, workspace=None):
    """Sparse multi-head latent attention (DeepSeek's DSA, V3.2's and V4's): each query
    token attends to the cached tokens its indices name, in FlashMLA's two interfaces.

    Decode (``flash_mla_with_kvcache(.., indices=..)``):
        q: ``[batch, s_q, num_heads, d_qk]`` float16 or bfloat16, the last dimension
            contiguous, batch and s_q foldable into one token dimension without a copy.
            DeepSeek-V3.2 (d_qk 576): each head's absorbed query (``W_UK q_nope``, 512
            values) then its ``q_pe`` (64). DeepSeek-V4 (d_qk 512, over its caches below):
            the 512 values with the 64 rotary dims inside.
        kv_cache: the latent cache ``[num_blocks, page_size, 1, width]`` (FlashMLA's) or
            ``[num_blocks, page_size, width]`` (vLLM's), one of:

            - q's dtype, width 576: a token's key is its whole vector ``[kv_c, k_pe]``,
              its value ``kv_c``.
            - DeepSeek-V3.2's fp8 cache (``"fp8_ds_mla"``, vLLM's name, FlashMLA's fp8
              sparse cache), width 656: each token kv_c's 512 e4m3 values, their four
              float32 scales (one per 128 values, value = fp8 * scale, any float32:
              vLLM's writer does not round them to powers of two) and k_pe's 64 bfloat16
              values; key ``[kv_c, k_pe]``, value kv_c.
            - DeepSeek-V4's ``"v4_fp8"``, width 528: the token's 512 values in e4m3, then
              16 ue8m0 scales (one per 32 values: value = fp8 * 2^(byte - 127)); or
              ``"v4_fp4"``, width 288: the 512 values in e2m1 (value 2i in the low nibble
              of byte i), then 32 e4m3 scales (one per 16 values). The key is the whole
              512-dim vector and so is the value (d_qk = d_v = 512).

            The row formats are 1-byte storage (uint8, int8, float8_e4m3fn), as
            ``cupaged.concat_and_cache_mla(.., kv_cache_dtype)`` writes them
            (``cupaged.reference.quantize_sparse_kv`` states the bytes), and take
            bfloat16 q. Each value is widened to bfloat16 as FlashMLA dequantizes
            fp8_ds_mla: the stored value times its scale in float32, rounded to bfloat16
            once. For V4's formats that float32 product is exact, so a key is
            ``reference.dequantize_sparse_kv``'s value rounded to bfloat16: exactly it
            for every v4_fp4 value and every v4_fp8 value bfloat16 holds (all that the
            writer stores from 16-bit sources); a v4_fp8 product of 2^128 or more reads
            as +-inf, one under 2^-126 rounds to bfloat16's subnormals, a scale byte 0xFF
            (ue8m0's NaN) reads as NaN. Page sizes: powers of two from 1 to 256 (vLLM's
            and FlashMLA's sparse caches use 64).
        indices: int32 ``[batch, s_q, topk]``: each a global slot ``block * page_size +
            offset`` (no block table), -1 an entry that does not count. Any other index
            outside the cache is a fault: it is never read, and every head of its token
            comes back NaN (FlashMLA's decode would read out of bounds).
        topk_length: optional int32 ``[batch]`` on the device: only the first
            ``topk_length[b]`` entries of batch entry b's rows count (clamped to
            ``[0, topk]``); entries past it are never read.
        attn_sink: optional float32 ``[num_heads]`` on the device (FlashMLA's): each
            head's out is scaled by ``exp(lse) / (exp(lse) + exp(attn_sink[h]))`` (a sink
            that takes a share of the softmax and gives no value); the lse is the keys'
            alone, as FlashMLA reports it (``np.logaddexp(lse, sink)`` is the whole
            denominator's, :func:`cupaged.attention`'s ``sinks`` convention). A sink of
            +inf gives zeros, -inf changes nothing.
        extra_kv_cache, extra_indices, extra_topk_length: optional, a second cache
            attended in the same softmax (DeepSeek-V4's ``extra_k_cache``,
            ``extra_indices_in_kvcache``, ``extra_topk_length``): the first cache's format
            and width, its own blocks (any power-of-two page size up to 256) and slots,
            ``extra_indices [batch, s_q, extra_topk]`` int32 slots of it under the same
            rules, ``extra_topk_length [batch]``. A token's keys are its counted entries of
            the first cache, then those of the second. Either kernel reads it.
        kv_cache_dtype: ``"auto"`` (q's dtype, or for a 1-byte cache the format its width
            names: 656 ``"fp8_ds_mla"``, 528 ``"v4_fp8"``, 288 ``"v4_fp4"``) or one of
            those three names.
        out ``[batch, s_q, num_heads, 512]``, lse ``[batch, s_q, num_heads]``.

    Prefill (``flash_mla_sparse_fwd``): ``q [s_q, num_heads, d_qk]`` (sequences
    concatenated), ``kv_cache`` the tokens ``[s_kv, 1, width]`` (or ``[s_kv, width]``),
    ``indices [s_q, 1, topk]`` (or ``[s_q, topk]``) into them, ``topk_length [s_q]``; an
    index outside ``[0, s_kv)`` (-1 or any other) does not count. out ``[s_q, num_heads,
    512]``, lse ``[s_q, num_heads]`` (natural log: FlashMLA's prefill returns it in base 2,
    times log2(e)). A second cache takes the same forms (``extra_kv_cache [s_kv', 1,
    width]``, ``extra_indices [s_q, 1, extra_topk]``, ``extra_topk_length [s_q]``). Over
    fp8_ds_mla rows without a second cache or a workspace, where ``s_q * topk *
    ceil(num_heads / 64) >= 4 * s_kv`` and s_kv is at most 2^19, the call widens every row
    once into a temporary bfloat16 buffer of ``s_kv * 1152`` bytes and reads the 16-bit
    rows (the same keys).

    Both:
        scale: the softmax scale (required).
        out: C-contiguous, q's dtype; lse: float32, C-contiguous (implies
            ``return_lse``). return_lse: also return the lse, the natural log of each
            row's softmax denominator (FlashMLA's decode: the same values, heads first;
            its prefill: this layout, base 2).
        stream, workspace: as for :func:`cupaged.mla_attention` (a workspace made with
            ``head_size=512`` for at least a row per query token).

    A repeated index counts each time. A row none of whose entries counts gives zeros and
    lse -inf (FlashMLA returns +inf there). ``cupaged.reference.sparse_mla_attention`` is
    the statement of the result. The kernels: ``mla_sparse_attention`` (mma.sync, sm_80+)
    for every cache; on Hopper ``mla_sparse_attention_sm90`` (wgmma) with 64 heads or
    more over every cache and over fp8_ds_mla at every head count, a second cache or not.
    Not served: 16-bit caches of V4's 512-dim tokens (q's dtype, width 512).

    A call whose arrays' metadata (shapes, strides, dtypes, device, 16-byte alignment),
    ``attn_sink`` (by address), workspace and keywords match an earlier successful call's
    skips validation and planning (a model's layers repeat one call); whether ``out`` and
    ``lse`` overlap the other arrays is still checked at every call's addresses.
    """
    # attn_sink: a main array too (its address among the ones overlap is checked at), and a
    # side one (its address, packed into the launch, is part of the key)
    extra = (extra_kv_cache, extra_indices, extra_topk_length)
    k, ptrs = _prepared.key("sparse_mla",
                            (q, kv_cache, indices, topk_length, out, lse, attn_sink, *extra),
                            (attn_sink,), (scale, return_lse, kv_cache_dtype),
                            launch.workspace_key(workspace))
    prep = _prepared.lookup(k)
    if prep is None or _prepared.any_overlap(prep.disjoint, ptrs):
        prep, ptrs = validate_and_prepare(q, kv_cache, indices, scale, topk_length, out, lse,
                                          return_lse, stream, workspace, attn_sink=attn_sink,
                                          kv_cache_dtype=kv_cache_dtype, extra=extra)
        _prepared.remember(k, prep)
    # q's rotary part and the caches' lie at their latent parts' addresses (the launch's
    # offsets find them)
    ql, c, idx, tl, o, lse_ptr, _, e, e_idx, e_tl = ptrs
    # (an empty second cache's address may be 0: its arrays' presence is what counts)
    return _prepared.run(prep, ((ql, ql), c, c, idx, tl, 0, o, lse_ptr), stream, out, lse,
                         () if extra_kv_cache is None else (e, e_idx, e_tl))


def validate_and_prepare(q, kv_cache, indices, scale, topk_length, out, lse, return_lse,
                         stream, workspace, plan: bool = True, attn_sink=None,
                         kv_cache_dtype="auto", extra=(None, None, None)) -> tuple:
    """``(prepared call, addresses)``: every check, then the plan of its launches
    (``plan=False``: the checks alone). ``extra``: the second cache, its indices and its
    lengths (or Nones). The addresses: q's, the cache's, the indices', topk_length's,
    out's, lse's, attn_sink's and extra's three (0 for one not given)."""
    if scale is None:
        _fail("scale is required: DeepSeek's is 1 / sqrt(qk_nope_head_dim + "
              "qk_rope_head_dim) (times YaRN's mscale squared), not 1 / sqrt(576)", TypeError)
    qa = as_device_array(q, "q")
    kc = as_device_array(kv_cache, "kv_cache")
    idx = as_device_array(indices, "indices")
    o = optional_output_array(out, "out")
    lse_a = optional_output_array(lse, "lse")
    sparse = _sparse_rows(kv_cache_dtype, kc, qa)
    fmt = None if sparse is None else _dtypes.SPARSE_KV_CACHE_DTYPES[sparse]
    d_qk = 576 if fmt is None else fmt.values  # q's last dimension
    width = 576 if fmt is None else fmt.nbytes  # the cache's
    prefill = qa.ndim == 3
    out_shape, lse_shape = qa.shape[:-1] + (512,), qa.shape[:-1]
    e_kc, e_idx, e_tl = _second_cache_arrays(extra)
    if e_kc is not None and _sparse_rows(kv_cache_dtype, e_kc, qa, "extra_kv_cache") != sparse:
        _fail(f"extra_kv_cache must hold the first cache's format "
              f"({sparse or f'{qa.dtype} values'}), got {e_kc.dtype} of shape {e_kc.shape}")
    if prefill:  # seen as decode: each query token a batch entry of one token
        if e_kc is not None:
            _, e_kc, e_idx, _, _ = _prefill_as_decode(qa, e_kc, e_idx, None, None, d_qk, width,
                                                      "extra_")
        qa, kc, idx, o, lse_a = _prefill_as_decode(qa, kc, idx, o, lse_a, d_qk, width)
    if qa.ndim != 4:
        _fail(f"q must be [batch, s_q, num_heads, {d_qk}] (decode) or [s_q, num_heads, "
              f"{d_qk}] (prefill), got shape {qa.shape}")
    batch, s_q, num_heads = qa.shape[:3]
    if fmt is not None and qa.shape[3] != d_qk:
        _fail(f"q must be [.., num_heads, {d_qk}] over {sparse} rows (d_qk {d_qk}"
              f"{': the 64 rotary dims inside the 512' if fmt.rope == 0 else ''}), got "
              f"shape {qa.shape}")
    if kc.ndim not in (3, 4) or (kc.ndim == 4 and kc.shape[2] != 1):
        _fail(f"kv_cache must be [num_blocks, page_size, 1, {width}] or [num_blocks, "
              f"page_size, {width}], got shape {kc.shape}")
    if fmt is None and kc.shape[-1] == _dtypes.SPARSE_RANK:
        _fail(f"kv_cache of {kc.dtype} tokens of 512 dims (DeepSeek-V4's d_qk) is not read: "
              f"V4's tokens are read from 'v4_fp8' (528-byte) or 'v4_fp4' (288-byte) rows; "
              f"a 16-bit cache must be [num_blocks, page_size, (1,) 576], got shape "
              f"{kc.shape}")
    tl = optional_device_array(topk_length, "topk_length")
    _check_indices(idx, tl, batch, s_q)
    tokens = batch * s_q
    for name, a, shape in (("out", o, (batch, s_q, num_heads, 512)),
                           ("lse", lse_a, (batch, s_q, num_heads))):
        if a is not None and (a.shape != shape or not (_checks.is_empty(a)
                                                       or a.flags.c_contiguous)):
            _fail(f"{name} must be a C-contiguous array of shape {shape}, got shape "
                  f"{a.shape} with strides {a.strides}")
    _checks.check_same_device(qa.data.device_id, "q", (
        ("kv_cache", kc), ("indices", idx), ("topk_length", tl), ("out", o), ("lse", lse_a),
        ("extra_kv_cache", e_kc), ("extra_indices", e_idx), ("extra_topk_length", e_tl)))
    # One query token a "sequence" of mla_attention's checks: its rows its heads. Its
    # block-table row (the indices) is checked above and given to them as one entry a row
    # (the checks' bound on a table's tokens is a paged one), topk_length's place by a
    # stand-in of the shape they want: metadata only, never read.
    topk = idx.shape[2]
    row_stride = _arrays.reshaped(idx, (2, 1), "indices", FOLD).strides[0]
    rows = _arrays.StridedView(idx, (tokens, 1), (row_stride, 4))
    seq_lens = _arrays.DeviceView((tokens,), np.int32, idx.data.ptr, idx.data.device_id)
    p = validation.validate_mla(
        _arrays.reshaped(qa, (2, 1, 1), "q", FOLD),
        _arrays.reshaped(kc, (1, 1, kc.ndim - 2), "kv_cache", "[num_blocks, page_size, 576]"),
        None, rows, seq_lens, None,
        None if o is None else _arrays.reshaped(o, (2, 1, 1), "out", FOLD),
        None if lse_a is None else _arrays.reshaped(lse_a, (2, 1), "lse", FOLD), 512, "auto",
        sparse_rows=sparse, tables_apart=False)
    sink = _variants.check_sinks(optional_device_array(attn_sink, "attn_sink"), num_heads,
                                 p.device, "attn_sink", "q")
    variants = (_variants.PLAIN if sink is None
                else _variants.Variants("", sinks=sink, lse_keys=True))
    p = p._replace(max_blocks=topk, bt_stride=row_stride // 4)
    # The kernel's bound on a slot: the cache's tokens; strict: an index outside it other
    # than -1 is a fault (FlashMLA's decode rule).
    num_slots = p.num_blocks * p.block_size
    if num_slots >= 2 ** 31:
        _fail(f"the cache has {num_slots} token slots; at most 2^31 - 1 are supported")
    p = p._replace(num_blocks=num_slots)
    second = () if e_kc is None else _check_second_cache(e_kc, e_idx, e_tl, kc, batch, s_q,
                                                          topk)
    scale = validation.softmax_scale(scale, p.rank + p.rope)
    parts = launch.mla_workspace_partials(workspace, p.device, p.rank)
    wants_lse = bool(return_lse) or lse is not None
    if not plan:
        return None, None
    with _arrays.on_device(p.device):
        # A prefill call whose query tokens select each cached token many times (each of
        # its row tiles widening it again) widens the rows once and reads 16-bit rows,
        # into a scratch of each call's: not with a workspace, whose calls allocate
        # nothing (CUDA graphs)
        widening = None if not prefill or second or parts is not None else planning.sparse_widening(
            p.device, p.dtype.name, p.cache_dtype.name, num_slots,
            tokens * topk * -(-num_heads // geometry.MlaSm90Geometry.rows))
        # (rows [s_kv, 1, 1, width] of q's dtype as a 16-bit cache's prefill form: blocks
        # of one token, whose token stride the size-1 dimension's reshape makes 1)
        read = p if widening is None else p._replace(
            cache_dtype=p.dtype, c_offsets=(0, p.rank),
            c_strides=(widening.width, 1, widening.width, 1))
        mplan = planning.plan_mla(p.device, p.dtype.name, read.cache_dtype.name, p.rank,
                                  p.rope, p.block_size, tokens, tokens, num_heads, 1,
                                  p.max_blocks + (second[3] if second else 0),
                                  None if parts is None else parts.max_rows, sparse=True,
                                  second_cache=bool(second))
        launches = None if mplan is None else launch.build_mla(
            read, mplan, scale, False, (0, 1.0), parts, sparse=(max(s_q, 1), int(not prefill)),
            variants=variants, extra=second)
        if widening is not None and launches is not None:
            launches = launch.WidenedMlaLaunch(widening, p.c_strides[0], launches)
    disjoint = _prepared.disjoint_spans(
        ((4, o), (5, lse_a)), ((0, qa), (1, kc), (2, idx), (3, tl), (6, sink), (7, e_kc),
                               (8, e_idx), (9, e_tl)))
    prep = _prepared.Prepared(launches, p.device, _arrays.framework(q), out_shape, qa.dtype,
                              (), 0, False, wants_lse,
                              lse_shape if wants_lse and lse_a is None else (), disjoint)
    ptrs = _prepared.addresses(qa, kc, idx, tl, o, lse_a, sink, e_kc, e_idx, e_tl)
    if _prepared.any_overlap(disjoint, ptrs):
        _fail("out and lse must not overlap q, kv_cache, indices, topk_length, attn_sink, "
              "the extra_ arrays or each other")
    return prep, ptrs


def _second_cache_arrays(extra):
    """The second cache's arrays (extra_kv_cache, extra_indices, extra_topk_length),
    adapted, or Nones; they come together (the lengths optional)."""
    e_kc, e_idx, e_tl = extra
    if (e_kc is None) != (e_idx is None):
        _fail("extra_kv_cache and extra_indices come together", TypeError)
    if e_tl is not None and e_kc is None:
        _fail("extra_topk_length needs extra_kv_cache and extra_indices", TypeError)
    if e_kc is None:
        return None, None, None
    return (as_device_array(e_kc, "extra_kv_cache"), as_device_array(e_idx, "extra_indices"),
            optional_device_array(e_tl, "extra_topk_length"))


def _check_second_cache(e_kc, e_idx, e_tl, kc, batch: int, s_q: int, idx_topk: int) -> tuple:
    """The second cache's checks (in decode form; ``kc`` the first cache's, whose format
    it shares; ``idx_topk`` the first indices' topk): MlaLaunch.extra_consts (its
    block and token strides and its indices' row stride in elements, topk, slots, log2 of
    its block size)."""
    width = kc.shape[-1]
    if e_kc.ndim not in (3, 4) or (e_kc.ndim == 4 and e_kc.shape[2] != 1) \
            or e_kc.shape[-1] != width:
        _fail(f"extra_kv_cache must be [num_blocks, page_size, 1, {width}] or [num_blocks, "
              f"page_size, {width}] (the first cache's width), got shape {e_kc.shape}")
    page = e_kc.shape[1]
    if page < 1 or page > 256 or page & (page - 1):
        _fail(f"extra_kv_cache's page size must be a power of two from 1 to 256, got {page}")
    isz = e_kc.dtype.itemsize
    # (the stride of a dimension of size 1 is never used, as for the first cache, nor any
    # of an empty cache's)
    empty = _checks.is_empty(e_kc)
    block_st = e_kc.strides[0] if e_kc.shape[0] > 1 and not empty else 0
    token_st = e_kc.strides[1] if page > 1 and not empty else 0
    if not empty and (
            e_kc.strides[-1] != isz or min(block_st, token_st) < 0 or block_st % 16
            or token_st % 16 or e_kc.data.ptr % 16):
        _fail(f"extra_kv_cache's tokens must be contiguous rows at a 16-byte aligned address, "
              f"its blocks and tokens a nonnegative multiple of 16 bytes apart (strides "
              f"{e_kc.strides})")
    slots = e_kc.shape[0] * page
    if slots > 2 ** 31 - 3:  # (the kernel hands a second-cache slot on as -3 - slot)
        _fail(f"extra_kv_cache has {slots} token slots; at most 2^31 - 3 are supported")
    _check_indices(e_idx, e_tl, batch, s_q, "extra_")
    both = idx_topk + e_idx.shape[2]
    if both > 2 ** 31 - 64:  # (a token's keys, counted in int32 with a tile's slack)
        _fail(f"indices and extra_indices hold {both} entries a token together; at most "
              f"2^31 - 64 are supported")
    row_stride = _arrays.reshaped(e_idx, (2, 1), "extra_indices", FOLD).strides[0]
    return (block_st // isz, token_st // isz, row_stride // 4, e_idx.shape[2], slots,
            page.bit_length() - 1)


def _check_indices(idx, lengths, batch: int, s_q: int, prefix: str = "") -> None:
    """The indices' and their lengths' checks (in decode form; ``prefix``: "extra_" for
    the second cache's)."""
    name, lname, k = f"{prefix}indices", f"{prefix}topk_length", f"{prefix}topk"
    _checks.check_int(idx, name)
    if idx.dtype != np.int32:
        _fail(f"{name} must be int32, got {idx.dtype}", TypeError)
    if idx.ndim != 3 or idx.shape[:2] != (batch, s_q) or idx.shape[2] < 1:
        _fail(f"{name} must be [batch, s_q, {k}] = [{batch}, {s_q}, {k} >= 1], got shape "
              f"{idx.shape}")
    if batch * s_q and (idx.strides[2] != 4 or min(idx.strides) < 0
                        or idx.strides[0] % 4 or idx.strides[1] % 4):
        _fail(f"{name}' last dimension must be contiguous and its rows a whole number of "
              f"entries apart (strides {idx.strides})")
    if idx.shape[2] > 2 ** 31 - 64:  # (a token's keys, counted in int32 with a tile's slack)
        _fail(f"{name} hold {idx.shape[2]} entries a token; at most 2^31 - 64 are supported")
    _checks.check_aligned(idx.data.ptr, name, 4)  # (read as 4-byte words)
    if lengths is not None:
        _checks.check_int(lengths, lname)
        if lengths.dtype != np.int32 or lengths.shape != (batch,) \
                or (batch and lengths.strides[0] != 4):
            _fail(f"{lname} must be a contiguous int32 [batch] = [{batch}] array, got "
                  f"{lengths.dtype} of shape {lengths.shape}")
        _checks.check_aligned(lengths.data.ptr, lname, 4)


# (kv_cache_dtype, its rows' bytes) for the error that lists them
_ROW_WIDTHS = ", ".join(f"{f.nbytes}-byte {n}" for n, f in _dtypes.SPARSE_KV_CACHE_DTYPES.items())


def _sparse_rows(kv_cache_dtype, kc, qa, name: str = "kv_cache") -> str | None:
    """The kv_cache_dtype of the cache's token rows (``"fp8_ds_mla"``, ``"v4_fp8"``,
    ``"v4_fp4"``: named, or with ``"auto"`` a 1-byte cache whose last dimension is one
    of their widths, 656, 528, 288), or None for a cache of q's dtype; ``name``: the
    cache's, for errors."""
    formats = _dtypes.SPARSE_KV_CACHE_DTYPES
    if not (kv_cache_dtype == "auto" or (isinstance(kv_cache_dtype, str)
                                         and kv_cache_dtype in formats)):
        _fail(f"kv_cache_dtype must be 'auto' or one of DeepSeek's sparse caches "
              f"({', '.join(map(repr, formats))}), got {kv_cache_dtype!r}")
    one_byte = kc.dtype.itemsize == 1 and (kc.dtype.kind in "ui"
                                           or _dtypes.fp8_of(kc.dtype) is _dtypes.E4M3)
    if kv_cache_dtype == "auto" and one_byte:
        for fmt_name, fmt in formats.items():
            if kc.shape[-1:] == (fmt.nbytes,):
                kv_cache_dtype = fmt_name
    if kv_cache_dtype != "auto":
        if not one_byte:
            _fail(f"{name} dtype {kc.dtype} cannot hold {kv_cache_dtype} rows: expected a "
                  f"1-byte dtype (uint8, int8 or float8_e4m3fn)", TypeError)
        return kv_cache_dtype
    if kc.dtype != qa.dtype:
        _fail(f"{name} dtype {kc.dtype} must be q's ({qa.dtype}), or a 1-byte dtype of "
              f"DeepSeek's sparse rows ({_ROW_WIDTHS}: name it with kv_cache_dtype); "
              f"per-tensor fp8 caches are not read by sparse_mla_attention", TypeError)
    return None


def _prefill_as_decode(qa, kc, idx, o, lse_a, d_qk: int = 576, width: int = 576,
                       prefix: str = ""):
    """FlashMLA's sparse prefill arrays (q ``[s_q, heads, d_qk]``, kv ``[s_kv, 1, width]``
    or ``[s_kv, width]``, indices ``[s_q, 1, topk]`` or ``[s_q, topk]``, out ``[s_q, heads,
    512]``, lse ``[s_q, heads]``), checked, as views of the decode form: each query token
    a batch entry of one token, the tokens of kv as blocks of one token (a slot is a
    token: one specialization for every s_kv, and the views cover kv's memory exactly).
    ``prefix``: the arrays' names' ("extra_" for the second cache's)."""
    if kc.ndim == 3 and kc.shape[1] == 1:
        kc = _arrays.StridedView(kc, (kc.shape[0], kc.shape[2]), (kc.strides[0], kc.strides[2]))
    if kc.ndim != 2:
        _fail(f"{prefix}kv_cache must be [s_kv, 1, {width}] or [s_kv, {width}] for the "
              f"prefill interface (q [s_q, num_heads, {d_qk}]), got shape {kc.shape}")
    s_kv = kc.shape[0]
    kv = _arrays.StridedView(kc, (s_kv, 1, kc.shape[1]),
                             (kc.strides[0], kc.strides[0], kc.strides[1]))
    s_q = qa.shape[0]
    if idx.ndim == 2:
        idx = _arrays.StridedView(idx, (idx.shape[0], 1, idx.shape[1]),
                                  (idx.strides[0], idx.strides[0], idx.strides[1]))
    if idx.ndim != 3 or idx.shape[:2] != (s_q, 1):
        _fail(f"{prefix}indices must be [s_q, 1, topk] or [s_q, topk] with s_q = {s_q} for "
              f"the prefill interface, got shape {idx.shape}")

    for name, a, shape in (("out", o, (s_q, *qa.shape[1:2], 512)), ("lse", lse_a, qa.shape[:2])):
        if a is not None and a.shape != shape:
            _fail(f"{name} must be of shape {shape} for the prefill interface, got {a.shape}")

    def one_token(a):  # [s_q, ...] as [s_q, 1, ...]
        return None if a is None else _arrays.StridedView(
            a, (a.shape[0], 1, *a.shape[1:]), (a.strides[0], a.strides[0], *a.strides[1:]))
    return one_token(qa), kv, idx, one_token(o), one_token(lse_a)

