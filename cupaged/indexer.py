"""DeepSeek-V3.2's lightning indexer (DSA) on the GPU: :func:`indexer_logits`, each query
token's logits over its sequence's keys in the indexer's fp8 paged cache (DeepGEMM's
``fp8_paged_mqa_logits``), and :func:`indexer_topk`, each row's top-k columns. The key cache is written by
:func:`cupaged.indexer_k_quant_and_cache`; ``cupaged.reference.indexer_logits`` is the
statement of the result. Validation, planning (one CTA per chunk of ``kIndexerChunk``
columns and query token, or pair of a sequence's query tokens: :func:`rows_a_cta`) and
the launch, a kernel family small enough for one module."""

from __future__ import annotations

import numpy as np

from . import _arrays, _checks, _dtypes, jit, planning
from ._arrays import as_device_array, optional_output_array
from .specs import geometry
from .specs.geometry import INDEXER_CHUNK as CHUNK, TOPK_MAX, TOPK_STEP, TOPK_THREADS

_fail = _checks.fail

__all__ = ["indexer_logits", "indexer_topk"]

HEAD_DIM = 128  # kIndexerDim: the indexer's head_dim (DeepSeek-V3.2's)
CACHE_WIDTH = HEAD_DIM + 4  # e4m3 values, then one float32 scale a token
HEADS = (16, 32, 48, 64)


@jit.launcher_cache
def _kernel(device: int, dtype: str, heads: int, block_size: int, group: int):
    spec = jit.KernelSpec("indexer_logits", dtype, rows=heads, block_size=block_size,
                          group_tile=group, arch=planning.device_info(device).arch)
    return jit.load(spec, device, geometry.indexer_smem_bytes(heads, group))


def rows_a_cta(next_n: int) -> int:
    """Query rows of one sequence a CTA takes (the kernel's ROWS): two share each key tile's
    copy and widening, where next_n is 2 or more; one otherwise."""
    return 2 if next_n >= 2 else 1


def indexer_logits(q, kv_cache, weights, block_tables, seq_lens, *, max_seq_len, out=None,
                   stream=None):
    """The lightning indexer's logits over its paged fp8 key cache: for query row i (token
    ``t`` of sequence ``b``: ``i = b * next_n + t``) and each column j < ``max_seq_len``,
    ``sum_h weights[i, h] * relu(q[i, h] . key_j)`` where the row sees token j of its
    sequence (``j <= seq_lens[b] - next_n + t``), -inf where it does not.

    Args:
        q: ``[batch, next_n, num_heads, 128]`` (DeepGEMM's) or ``[batch, num_heads,
            128]`` (next_n 1), float16 or bfloat16; num_heads 16, 32, 48 or 64. An fp8
            query is passed as its values (widened), its scale folded into ``weights``.
            The last dimension contiguous, 16-byte aligned rows.
        kv_cache: the indexer's cache as :func:`cupaged.indexer_k_quant_and_cache` writes
            it with ``quant_block_size=128``: 1-byte ``[num_blocks, block_size, 132]`` (or
            ``[.., 1, 132]``), each block one contiguous run at a 16-byte boundary, pages
            of a power of two from 4 to 256 tokens.
        weights: float32 ``[batch * next_n, num_heads]`` (or ``[batch, next_n,
            num_heads]``), the last dimension contiguous.
        block_tables: int32 ``[batch, max_blocks]``; seq_lens: int32 ``[batch]`` (each
            sequence's cached tokens, its query tokens the last next_n of them).
        max_seq_len: the logits' width (DeepGEMM's ``max_model_len``), a host int.
        out: float32 ``[batch * next_n, max_seq_len]``, C-contiguous (default: allocated).
        stream: as for the other entry points.

    Returns ``out``. A block id outside the cache is never read: its columns come back
    NaN (``reference.indexer_topk`` never picks NaN or -inf). Keys are e4m3 values times
    their scale, the products on tensor cores in float16 with float32 sums (a bfloat16
    q scaled by a power of two into float16's range: docs/API.md; the reference sums in
    float64). Never synchronizes; capturable in a CUDA graph.
    """
    qa = as_device_array(q, "q")
    kc = as_device_array(kv_cache, "kv_cache")
    w = as_device_array(weights, "weights")
    bt = as_device_array(block_tables, "block_tables")
    sl = as_device_array(seq_lens, "seq_lens")
    o = optional_output_array(out, "out")
    dt = _dtypes.lookup(qa.dtype)
    if dt is None or dt.itemsize != 2:
        _fail(f"q must be float16 or bfloat16, got {qa.dtype}", TypeError)
    if qa.ndim == 3:
        qa = _arrays.StridedView(qa, (qa.shape[0], 1, *qa.shape[1:]),
                                 (qa.strides[0], qa.strides[0], *qa.strides[1:]))
    if qa.ndim != 4 or qa.shape[3] != HEAD_DIM:
        _fail(f"q must be [batch, next_n, num_heads, {HEAD_DIM}] or [batch, num_heads, "
              f"{HEAD_DIM}], got shape {qa.shape}")
    batch, next_n, heads = qa.shape[:3]
    if heads not in HEADS:
        _fail(f"q's num_heads must be one of {HEADS} (DeepSeek-V3.2's indexer has 64), got "
              f"{heads}")
    rows = batch * next_n
    if next_n == 1:  # a row is a batch entry: the size-1 dimension's stride means nothing
        qa = _arrays.StridedView(qa, qa.shape, (qa.strides[0], qa.strides[0], *qa.strides[2:]))
    if not _checks.is_empty(qa):
        st = qa.strides
        if st[3] != 2 or min(st) < 0 or any(n > 1 and s % 16 for n, s in zip(qa.shape[:3], st)):
            _fail(f"q's last dimension must be contiguous and its other strides non-negative "
                  f"multiples of 16 bytes, got {st}")
        if batch > 1 and next_n > 1 and st[0] != next_n * st[1]:
            _fail(f"q's batch and next_n dimensions must fold into one row dimension "
                  f"(strides {st})")
        _checks.check_aligned(qa.data.ptr, "q")
    if w.dtype != np.float32:
        _fail(f"weights must be float32, got {w.dtype}", TypeError)
    if w.ndim == 3 and w.shape == (batch, next_n, heads):
        if batch > 1 and next_n > 1 and w.strides[0] != next_n * w.strides[1]:
            _fail(f"weights' batch and next_n dimensions must fold into one (strides {w.strides})")
        w = _arrays.StridedView(w, (rows, heads),
                                (w.strides[1] if next_n > 1 else w.strides[0], w.strides[2]))
    if w.shape != (rows, heads) or (rows and heads > 1 and w.strides[1] != 4) \
            or (rows and (w.strides[0] < 0 or w.strides[0] % 4)):
        _fail(f"weights must be float32 [batch * next_n, num_heads] = [{rows}, {heads}] with "
              f"its last dimension contiguous, got shape {w.shape}")
    # head_dim 128, quant_block_size 128: 128 e4m3 bytes and one float32 scale a token
    num_blocks, block_size = _checks.check_row_cache(kc, CACHE_WIDTH, "the indexer's ")
    if block_size not in _checks.BLOCK_SIZES or block_size < 4:
        _fail(f"kv_cache's block_size must be a power of two from 4 to 256, got {block_size}")
    if num_blocks >= 2 ** 31:
        _fail(f"kv_cache has {num_blocks} blocks; at most 2^31 - 1 are supported")
    if not _checks.is_empty(kc):
        if kc.strides[-1] != 1 or kc.strides[1] != CACHE_WIDTH or min(kc.strides) < 0:
            _fail(f"each block of kv_cache must be one contiguous run of block_size * "
                  f"{CACHE_WIDTH} bytes, got strides {kc.strides}")
        if kc.data.ptr % 16 or (num_blocks > 1 and (kc.strides[0] % 16
                                                    or kc.strides[0] < block_size * CACHE_WIDTH)):
            _fail(f"kv_cache's blocks must start at 16-byte boundaries and not overlap (its "
                  f"keys are read 16 bytes at a time), got address {kc.data.ptr:#x} and "
                  f"block stride {kc.strides[0]}")
    max_blocks = _checks.check_tables(bt, sl, "seq_lens", batch, block_size, _checks.INT32_MAX)
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) \
            or max_seq_len < 0:
        _fail(f"max_seq_len must be a non-negative int (the logits' width), got {max_seq_len!r}",
              TypeError if not isinstance(max_seq_len, (int, np.integer)) else ValueError)
    width = int(max_seq_len)
    if -(-width // CHUNK) > _checks.MAX_GRID_YZ:
        _fail(f"max_seq_len {width} is past the {_checks.MAX_GRID_YZ * CHUNK} columns a call "
              f"takes")
    _checks.check_new_out(o, np.float32, (rows, width))
    device = qa.data.device_id
    _checks.check_same_device(device, "q", (("kv_cache", kc), ("weights", w),
                                            ("block_tables", bt), ("seq_lens", sl), ("out", o)))
    _checks.check_apart((("out", o),), (("q", qa), ("kv_cache", kc), ("weights", w),
                                        ("block_tables", bt), ("seq_lens", sl)))
    with _arrays.launching(device):
        ctx = _arrays.context(device, _arrays.framework(q), stream)
        owner = out
        if o is None:
            o, owner = _arrays.empty(ctx, (rows, width), np.float32)
        if rows and width:
            group = rows_a_cta(next_n)
            kern = _kernel(device, dt.name, heads, block_size, group)
            grid = (batch * -(-next_n // group), -(-width // CHUNK), 1)
            kern(grid, heads // 16 * 32, geometry.indexer_smem_bytes(heads, group), ctx.stream,
                 o.data.ptr, width, width, qa.data.ptr, qa.strides[1] // 2, qa.strides[2] // 2,
                 w.data.ptr, w.strides[0] // 4 if rows > 1 else 0, kc.data.ptr,
                 kc.strides[0] if num_blocks > 1 else 0, num_blocks, bt.data.ptr,
                 bt.strides[0] // 4 if batch > 1 else 0, max_blocks, sl.data.ptr, next_n)
        return _arrays.hand_over(ctx, owner) if out is None else out


@jit.launcher_cache
def _topk_kernel(device: int):
    spec = jit.KernelSpec("indexer_topk", "f32", arch=planning.device_info(device).arch)
    return jit.load(spec, device)


def indexer_topk(logits, topk, *, block_tables=None, block_size=None, next_n=1, out=None,
                 stream=None):
    """Each row's ``topk`` largest finite logits' columns: int32 ``[rows, topk]``, largest
    first, ties by the lower column, -1 after a row's finite logits run out (-inf, +inf
    and NaN are never picked). ``cupaged.reference.indexer_topk``'s result, bit for bit.

    Args:
        logits: float32 ``[rows, width]`` (:func:`indexer_logits`'s), the last dimension
            contiguous, rows any whole number of entries apart.
        topk: 1 to 2048 (DeepSeek-V3.2's is 2048).
        block_tables: optional int32 ``[rows / next_n, max_blocks]`` (a step's tables, rows
            contiguous) with ``block_size`` (a power of two, 1 to 256): each picked column
            goes out as the global slot ``block_tables[r // next_n, c // block_size] *
            block_size + c % block_size`` of row r's sequence (rows placed as
            :func:`indexer_logits` places them: sequence b's next_n query tokens), what
            ``sparse_mla_attention``'s decode takes; -1 stays -1 (``reference.indexer_slots``
            states it). A column past the table's blocks or a slot outside [0, 2^31) comes
            out as -2^31, which ``sparse_mla_attention``'s decode treats as a fault (its
            token's rows NaN), never as another token's slot.
        next_n: the query tokens of a sequence (rows per table row), with ``block_tables``.
        out: int32 ``[rows, topk]``, C-contiguous (default: allocated).

    Without ``block_tables`` the columns are positions in each row's sequence (its tokens
    0..); cupaged's ``sparse_mla_attention`` prefill takes them as they are, its decode as
    global slots (``block_tables=`` above). One CTA a row: a radix select of the k-th largest (a
    12-bit first digit, then 8, 8 and 4 bits; two passes over the row when the k-th's
    first-digit bin holds at most 3840 keys, which the later digits then count in shared
    memory, five otherwise), the keys above it and the lowest columns equal to it, a
    bitonic sort. No host sync; capturable.
    """
    lg = as_device_array(logits, "logits")
    o = optional_output_array(out, "out")
    if lg.dtype != np.float32:
        _fail(f"logits must be float32, got {lg.dtype}", TypeError)
    if lg.ndim != 2:
        _fail(f"logits must be 2-D [rows, width], got shape {lg.shape}")
    rows, width = lg.shape
    if not _checks.is_empty(lg) and ((width > 1 and lg.strides[1] != 4)
                                     or lg.strides[0] < 0 or lg.strides[0] % 4):
        _fail(f"logits' last dimension must be contiguous and its rows a whole number of "
              f"entries apart (strides {lg.strides})")
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)):
        _fail(f"topk must be an int, got {type(topk).__name__}", TypeError)
    if not 1 <= topk <= TOPK_MAX:
        _fail(f"topk must be from 1 to {TOPK_MAX}, got {topk}")
    if width > _checks.INT32_MAX - TOPK_STEP:
        _fail(f"logits has {width} columns; at most {_checks.INT32_MAX - TOPK_STEP} are "
              f"supported")
    _checks.check_new_out(o, np.int32, (rows, int(topk)))
    bt = None if block_tables is None else as_device_array(block_tables, "block_tables")
    table = _slot_table(bt, block_size, next_n, rows)
    device = lg.data.device_id
    _checks.check_same_device(device, "logits", (("out", o), ("block_tables", bt)))
    # other rows' CTAs still read the logits and the tables
    _checks.check_apart((("out", o),), (("logits", lg), ("block_tables", bt)))
    with _arrays.launching(device):
        ctx = _arrays.context(device, _arrays.framework(logits), stream)
        owner = out
        if o is None:
            o, owner = _arrays.empty(ctx, (rows, int(topk)), np.int32)
        if rows:
            _topk_kernel(device)((rows, 1, 1), TOPK_THREADS, 0, ctx.stream, o.data.ptr,
                                 int(topk), lg.data.ptr, lg.strides[0] // 4 if rows > 1 else 0,
                                 width, int(topk), *table)
        return _arrays.hand_over(ctx, owner) if out is None else out


def _slot_table(bt, block_size, next_n, rows: int) -> tuple:
    """indexer_topk's table arguments (address, row stride in entries, max_blocks,
    block_size, next_n), checked; next_n 0 without block tables (the kernel's flag: an
    empty table's address may be 0)."""
    if isinstance(next_n, bool) or not isinstance(next_n, (int, np.integer)) or next_n < 1:
        _fail(f"next_n must be a positive int, got {next_n!r}")
    if bt is None:
        if block_size is not None or next_n != 1:
            _fail("block_size and next_n go with block_tables (the columns as global slots)")
        return 0, 0, 0, 1, 0
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size not in _checks.BLOCK_SIZES:
        _fail(f"block_size must be a power of two from 1 to 256 (the cache's), got "
              f"{block_size!r}")
    # (rows not a multiple of next_n: no table row count fits)
    seqs = rows // next_n if rows % next_n == 0 else -1
    max_blocks = _checks.check_table_rows(
        bt, seqs, f"[rows / next_n, max_blocks] with rows ({rows}) a multiple of next_n "
                  f"({next_n})")
    return (bt.data.ptr, bt.strides[0] // 4 if seqs > 1 else 0, max_blocks, int(block_size),
            int(next_n))
