"""``torch.ops.cupaged.*``: twelve of cupaged's entry points as PyTorch custom operators
(the table below; :data:`OPS` holds them).

A model that calls these compiles with ``torch.compile(fullgraph=True)`` without a graph
break, traces under fake tensors (each op has a fake implementation), passes
``torch.library.opcheck``, and captures in CUDA graphs (its compiled step included:
scratch memory comes from torch's allocator, launches go to torch's current stream), but
for ``swap_blocks`` with a ``block_mapping`` on the host (vLLM's form), which is uploaded
by a copy no capture takes: under capture pass it on the device.

Every op writes into arrays the caller passes (``out``, the caches, ...), declared in its
schema as mutated, and returns nothing: the convention of vLLM's ops, whose argument
order the vLLM-named ones keep. Arguments are those of the Python function of the same
name (see its docstring); where that function takes a number or an array for a scale,
the op takes a tensor (one element, on the device or the CPU: the scale forms of
docs/API.md; per-token arrays only in the ``attention`` op), optional but in
``paged_attention_v1``/``_v2``.

=========================== ============================================================
op                          Python function it runs
=========================== ============================================================
``attention``               :func:`cupaged.attention` into ``out`` (and ``lse``)
``mla_attention``           :func:`cupaged.mla_attention` into ``out`` (and ``lse``)
``paged_attention_v1/v2``   :func:`cupaged.paged_attention_v1` / ``_v2`` (vLLM's schema)
``reshape_and_cache``       :func:`cupaged.reshape_and_cache` (vLLM's schema, + layout)
``reshape_and_cache_flash`` :func:`cupaged.reshape_and_cache_flash` (vLLM's schema)
``concat_and_cache_mla``    :func:`cupaged.concat_and_cache_mla` (vLLM's schema)
``copy_blocks``             :func:`cupaged.copy_blocks` (vLLM's schema)
``copy_blocks_mla``         :func:`cupaged.copy_blocks_mla`
``swap_blocks``             :func:`cupaged.swap_blocks` (vLLM's schema)
``merge_state``             :func:`cupaged.merge_state` into ``out`` (and ``lse_out``)
``merge_states``            :func:`cupaged.merge_states` over stacked partials
=========================== ============================================================

Per-token fp8 scale arrays, which :func:`cupaged.reshape_and_cache` writes, are not taken
by the cache-write ops (their schemas declare the caches alone as written): pass
per-tensor scales, or call the Python function.

The rest of the API has no op: :func:`cupaged.paged_attention` (its decode is the
``attention`` op with ``kv_layout="vllm"`` and no ``query_start_loc``, or the
``paged_attention_v1``/``_v2`` ops), the host-side objects (``AttentionPlan``,
``DecodeWorkspace``, ``PagedKVCache``, ``PagedMLACache``, ``BlockManager``, ``Step``),
whose tensors a compiled model passes to the ops, and ``check_block_tables`` (it
synchronizes), ``empty_pinned``, ``precompile`` and ``reference``.

Importing this module imports torch and registers the ops (once); ``import cupaged``
does it when torch is already imported.
"""

from typing import List, Optional

import torch

from .. import cache_ops, decode, merge, mla
from ..attention import attention as _attention

__all__ = ["OPS"]

Tensor = torch.Tensor

# The module-level functions below are the ops' real implementations (CUDA); one fake
# implementation for tracing serves them all (see the end). Schemas are inferred from the
# annotations. An optional written argument (lse, lse_out, k_pe_cache) has no default: it
# is always passed, None or a tensor (torch before 2.13 fails on a written argument left
# to its default).


def _per_tensor(scale: Optional[Tensor], name: str) -> Optional[Tensor]:
    """A scale tensor the op only reads: one element (a per-tensor scale)."""
    if scale is not None and (scale.numel() != 1 or scale.dim() > 1):
        raise ValueError(f"{name}: the cupaged op takes a per-tensor scale (one element), "
                         f"got shape {tuple(scale.shape)}; per-token scale arrays go through "
                         f"the Python function")
    return scale


@torch.library.custom_op("cupaged::attention", mutates_args=("out", "lse"))
def attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
              seq_lens: Tensor, query_start_loc: Optional[Tensor], out: Tensor,
              lse: Optional[Tensor], kv_layout: str = "NHD", causal: bool = True,
              scale: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
              max_query_len: Optional[int] = None, max_seq_len: Optional[int] = None,
              kv_cache_dtype: str = "auto", k_scale: Optional[Tensor] = None,
              v_scale: Optional[Tensor] = None, window: Optional[int] = None,
              logits_soft_cap: Optional[float] = None,
              sinks: Optional[Tensor] = None) -> None:
    _attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        kv_layout=kv_layout, causal=causal, scale=scale, alibi_slopes=alibi_slopes,
        max_query_len=max_query_len, max_seq_len=max_seq_len, out=out,
        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, window=window,
        logits_soft_cap=logits_soft_cap, sinks=sinks, lse=lse)


@torch.library.custom_op("cupaged::mla_attention", mutates_args=("out", "lse"))
def mla_attention(q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                  query_start_loc: Optional[Tensor], out: Tensor, lse: Optional[Tensor],
                  scale: float, q_pe: Optional[Tensor] = None,
                  kv_lora_rank: Optional[int] = None, k_pe_cache: Optional[Tensor] = None,
                  causal: bool = True, max_query_len: Optional[int] = None,
                  max_seq_len: Optional[int] = None, kv_cache_dtype: str = "auto",
                  k_scale: Optional[Tensor] = None) -> None:
    """``q``: the whole ``[.., 576]`` query, or ``q_nope`` with ``q_pe`` given."""
    mla.mla_attention(q if q_pe is None else (q, q_pe), kv_cache, block_tables, seq_lens,
                      query_start_loc, scale=scale, kv_lora_rank=kv_lora_rank,
                      k_pe_cache=k_pe_cache, causal=causal, max_query_len=max_query_len,
                      max_seq_len=max_seq_len, out=out, lse=lse, kv_cache_dtype=kv_cache_dtype,
                      k_scale=_per_tensor(k_scale, "k_scale"))


@torch.library.custom_op("cupaged::paged_attention_v1", mutates_args=("out",))
def paged_attention_v1(out: Tensor, query: Tensor, key_cache: Tensor, value_cache: Tensor,
                       num_kv_heads: int, scale: float, block_tables: Tensor, seq_lens: Tensor,
                       block_size: int, max_seq_len: int, alibi_slopes: Optional[Tensor],
                       kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor,
                       tp_rank: int = 0, blocksparse_local_blocks: int = 0,
                       blocksparse_vert_stride: int = 0, blocksparse_block_size: int = 64,
                       blocksparse_head_sliding_step: int = 0) -> None:
    decode.paged_attention_v1(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        block_size, max_seq_len, alibi_slopes, kv_cache_dtype, _per_tensor(k_scale, "k_scale"),
        _per_tensor(v_scale, "v_scale"), tp_rank, blocksparse_local_blocks,
        blocksparse_vert_stride, blocksparse_block_size, blocksparse_head_sliding_step)


@torch.library.custom_op("cupaged::paged_attention_v2",
                         mutates_args=("out", "exp_sums", "max_logits", "tmp_out"))
def paged_attention_v2(out: Tensor, exp_sums: Tensor, max_logits: Tensor, tmp_out: Tensor,
                       query: Tensor, key_cache: Tensor, value_cache: Tensor,
                       num_kv_heads: int, scale: float, block_tables: Tensor, seq_lens: Tensor,
                       block_size: int, max_seq_len: int, alibi_slopes: Optional[Tensor],
                       kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor,
                       tp_rank: int = 0, blocksparse_local_blocks: int = 0,
                       blocksparse_vert_stride: int = 0, blocksparse_block_size: int = 64,
                       blocksparse_head_sliding_step: int = 0) -> None:
    decode.paged_attention_v2(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
        scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype,
        _per_tensor(k_scale, "k_scale"), _per_tensor(v_scale, "v_scale"), tp_rank,
        blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
        blocksparse_head_sliding_step)


@torch.library.custom_op("cupaged::reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor, kv_cache_dtype: str = "auto",
                      k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
                      kv_layout: str = "vllm") -> None:
    cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                _per_tensor(k_scale, "k_scale"), _per_tensor(v_scale, "v_scale"),
                                kv_layout=kv_layout)


@torch.library.custom_op("cupaged::reshape_and_cache_flash",
                         mutates_args=("key_cache", "value_cache"))
def reshape_and_cache_flash(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                            slot_mapping: Tensor, kv_cache_dtype: str = "auto",
                            k_scale: Optional[Tensor] = None,
                            v_scale: Optional[Tensor] = None) -> None:
    cache_ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                      kv_cache_dtype, _per_tensor(k_scale, "k_scale"),
                                      _per_tensor(v_scale, "v_scale"))


@torch.library.custom_op("cupaged::concat_and_cache_mla", mutates_args=("kv_cache", "k_pe_cache"))
def concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                         kv_cache_dtype: str, scale: Optional[Tensor],
                         k_pe_cache: Optional[Tensor]) -> None:
    cache_ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                                   _per_tensor(scale, "scale"), k_pe_cache=k_pe_cache)


@torch.library.custom_op("cupaged::copy_blocks", mutates_args=("key_caches", "value_caches"))
def copy_blocks(key_caches: List[Tensor], value_caches: List[Tensor],
                block_mapping: Tensor) -> None:
    cache_ops.copy_blocks(key_caches, value_caches, block_mapping)


@torch.library.custom_op("cupaged::copy_blocks_mla", mutates_args=("kv_caches",))
def copy_blocks_mla(kv_caches: List[Tensor], block_mapping: Tensor) -> None:
    cache_ops.copy_blocks_mla(kv_caches, block_mapping)


@torch.library.custom_op("cupaged::swap_blocks", mutates_args=("dst",))
def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    cache_ops.swap_blocks(src, dst, block_mapping)


@torch.library.custom_op("cupaged::merge_state", mutates_args=("out", "lse_out"))
def merge_state(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Tensor,
                lse_out: Optional[Tensor]) -> None:
    merge.merge_state(out_a, lse_a, out_b, lse_b, out=out, lse_out=lse_out)


@torch.library.custom_op("cupaged::merge_states", mutates_args=("out", "lse_out"))
def merge_states(outs: Tensor, lses: Tensor, out: Tensor, lse_out: Optional[Tensor]) -> None:
    """``outs``: stacked ``[num_states, rows, num_heads, head_size]``; ``lses``: stacked
    ``[num_states, rows, num_heads]``."""
    merge.merge_states(outs, lses, out=out, lse_out=lse_out)


OPS = (attention, mla_attention, paged_attention_v1, paged_attention_v2, reshape_and_cache,
       reshape_and_cache_flash, concat_and_cache_mla, copy_blocks, copy_blocks_mla,
       swap_blocks, merge_state, merge_states)
"""Every registered op (``torch.library.CustomOpDef`` objects; ``torch.ops.cupaged.<name>``
is each one's overload packet)."""


def _writes_only(*args, **kwargs) -> None:
    """Every op's fake implementation: the ops return nothing and write only arguments the
    schema marks, so tracing has no output to shape."""
    return None


for _op in OPS:
    _op.register_fake(_writes_only)
