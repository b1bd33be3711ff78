"""cupaged's kernels under Hugging Face transformers' continuous batching.

:func:`register` adds a paged attention implementation to transformers'
``AttentionInterface``; a model loaded or switched to it (``attn_implementation=
"paged|cupaged"``) runs ``model.generate_batch(...)`` and the ``ContinuousBatchingManager``
with cupaged's kernels over transformers' own paged cache::

    from cupaged.integrations import transformers as cupaged_tf

    name = cupaged_tf.register()                     # "paged|cupaged"
    model.set_attn_implementation(name)
    outputs = model.generate_batch(prompts, generation_config=config)

What each attention call does, per layer: the step's new keys and values go into
transformers' cache with :func:`cupaged.reshape_and_cache_flash` at the step's write
slots; each sequence's block table is read off its read slots (a full-attention layer's
slots run block by block: ``block * block_size + offset``); :func:`cupaged.attention`
then attends over the cache, causal and bottom-right aligned, as ``paged|sdpa`` does. No
K/V is gathered and no mask is built.

transformers' cache, per layer: K and V tensors of ``[(num_blocks + 2) * block_size,
num_kv_heads, head_size]`` (two padding blocks last), read here as NHD blocks.

Supported: transformers 5.16 and 5.17 (the interface read above; 5.18 moved the cache
into one byte tensor of sectors and 5.19 changed ``PagedAttentionCache.update``), checked
by :func:`register`; models whose layers are all full attention (a sliding-window layer
raises ``NotImplementedError``, as do transformers' ``softcap=`` and ``s_aux=``);
block sizes that are powers of two up to 256; float16 and bfloat16 (float32 too, through
the decode kernel's row mode). transformers' own compiled continuous batching
(``compile_config``) is not supported: the implementation calls cupaged's Python entry
points, which dynamo does not trace. With transformers' CUDA graphs, the padded query rows
(past ``cu_seq_lens_q[-1]``) belong to no sequence and are left unwritten, which
``CUPAGED_DEBUG=1``'s check of ``query_start_loc`` reports. The name must not contain
"flash" (in any case; :func:`register` raises ValueError): transformers treats such names
as FlashAttention and hands them block tables and a different cache path.
"""

from __future__ import annotations

import math
import threading
import weakref

from .._checks import BLOCK_SIZES

SUPPORTED_VERSIONS = ("5.16", "5.17")
"""The transformers releases (major.minor) whose continuous-batching interface this reads."""

__all__ = ["SUPPORTED_VERSIONS", "paged_attention_forward", "register"]


def _check_version(version: str) -> None:
    minor = ".".join(version.split(".")[:2])
    if minor not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"cupaged's transformers integration reads the continuous-batching cache of "
            f"transformers {' and '.join(SUPPORTED_VERSIONS)} (a flat K and V per layer, "
            f"PagedAttentionCache.update(read_index, write_index)); transformers {version} "
            f"differs. Install transformers>={SUPPORTED_VERSIONS[0]},<5.18, or use "
            f"attn_implementation='paged|sdpa'.")


def register(name: str = "cupaged") -> str:
    """Register cupaged's paged attention with transformers' ``AttentionInterface`` as
    ``"paged|<name>"`` and return that string (the ``attn_implementation`` to give a
    model). Raises ``RuntimeError`` for a transformers release outside
    :data:`SUPPORTED_VERSIONS` (checked first), and ``ValueError`` for a name containing
    "flash" in any case or a "|"; nothing is registered then."""
    import transformers
    from transformers import AttentionInterface

    _check_version(transformers.__version__)
    if "flash" in name.lower():
        raise ValueError(f"name={name!r}: transformers treats implementations named 'flash' "
                         f"as FlashAttention (block tables, its own cache path); pick another")
    if "|" in name:
        raise ValueError(f"name={name!r}: give the name alone; 'paged|' is added")
    key = f"paged|{name}"
    AttentionInterface.register(key, paged_attention_forward)
    return key


def block_tables(slots, cu_seq_lens_k, max_seq_len: int, block_size: int):
    """Each sequence's block table from its slots: ``slots`` (int64, concatenated over the
    sequences, ``cu_seq_lens_k`` (int32 ``[num_seqs + 1]``) giving each one's range)
    hold ``block * block_size + offset`` for positions 0, 1, ... of the sequence, so its
    j-th block is ``slots[start + j * block_size] // block_size``. ``max_seq_len``: a
    host bound on the lengths (the table's width). Entries past a sequence's last block
    are whatever lies there (clamped into ``slots``): the kernels never read them. No
    sync."""
    import torch

    width = max(1, math.ceil(max_seq_len / block_size))
    starts = cu_seq_lens_k[:-1].long()
    at = starts[:, None] + torch.arange(width, device=slots.device) * block_size
    at = at.clamp_(max=max(slots.numel() - 1, 0))
    return torch.div(slots[at], block_size, rounding_mode="floor").to(torch.int32)


def paged_attention_forward(module, query, key, value, attention_mask=None, dropout=0.0,
                            scaling=None, **kwargs):
    """transformers' attention-implementation signature: ``query`` ``[1, num_heads,
    tokens, head_size]``, ``key``/``value`` ``[1, num_kv_heads, tokens, head_size]`` (the
    step's new tokens, packed over its sequences), continuous batching's keywords
    (``cache``, ``cu_seq_lens_q``/``_k``, ``max_seqlen_q``/``_k``, ``read_index``,
    ``write_index``). Returns ``([1, tokens, num_heads, head_size], None)``."""
    from ..attention import attention
    from ..cache_ops import reshape_and_cache_flash

    cache = kwargs.get("cache")
    if cache is None:
        raise ValueError("paged|cupaged runs under continuous batching (generate_batch or the "
                         "ContinuousBatchingManager), which passes the paged cache; for a plain "
                         "forward use attn_implementation='sdpa'")
    if dropout:
        raise ValueError(f"paged|cupaged has no attention dropout (got {dropout})")
    for name in ("softcap", "s_aux"):  # Gemma 2's logit cap, gpt-oss's sinks: not mapped yet
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"paged|cupaged does not take transformers' {name}= yet "
                                      f"(layer {module.layer_idx}); use paged|sdpa")
    layer = module.layer_idx
    if cache.sliding_windows.get(layer, 1) != 1:
        raise NotImplementedError(
            f"layer {layer} has a sliding window: transformers keeps it in a ring of slots "
            f"that paged|cupaged does not read; use paged|sdpa for this model")
    group, index = cache.layer_index_to_group_indices[layer]
    bs = cache.block_size
    if bs not in BLOCK_SIZES:
        raise ValueError(f"transformers' block_size is {bs}; cupaged's kernels take powers of "
                         f"two from 1 to 256 (ContinuousBatchingConfig(block_size=...))")
    blocks = (cache.key_cache[index].shape[0] // bs, bs, *cache.key_cache[index].shape[1:])
    kc = cache.key_cache[index].view(blocks)
    vc = cache.value_cache[index].view(blocks)
    write = kwargs["write_index"][group]
    read = kwargs["read_index"][group]
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):
        cu_k, max_k = cu_k["full_attention"], max_k["full_attention"]
    cu_q, max_q = kwargs["cu_seq_lens_q"], kwargs["max_seqlen_q"]

    q = query[0].transpose(0, 1)  # [tokens, heads, head_size], a strided view
    reshape_and_cache_flash(key[0].transpose(0, 1), value[0].transpose(0, 1), kc, vc, write)
    tables, seq_lens, starts = _step_arrays(group, layer, read, write, cu_k, cu_q, int(max_k), bs)
    out = attention(q, kc, vc, tables, seq_lens, starts, kv_layout="NHD", causal=True,
                    scale=scaling, max_query_len=max(int(max_q), 1), max_seq_len=int(max_k))
    return out.unsqueeze(0), None


class _StepMemo(threading.local):
    """Per thread (a generation loop runs its forward passes one after another) and per
    cache group (whose layers share the slot tensors): the last step's arrays."""

    def __init__(self):
        self.groups = {}  # group -> (layers served, input references, bounds, arrays)


_STEP = _StepMemo()


def _step_arrays(group: int, layer: int, read, write, cu_k, cu_q, max_k: int,
                 block_size: int) -> tuple:
    """``(block_tables, seq_lens, query_start_loc)`` of a step, int32, made once per forward
    pass and shared by the layers of a cache group, which pass the same slot and length
    tensors (compared by identity, through weak references: a later step's cannot take
    their place). A layer that has already been served starts a new pass, which derives
    them anew whatever the layers' order: transformers' CUDA graphs pass the same tensors
    to every step with new contents, so the capture after a warm-up pass must record the
    derivation."""
    import torch

    tensors, bounds = (read, write, cu_k, cu_q), (max_k, block_size)
    memo = _STEP.groups.get(group)
    if (memo is not None and layer not in memo[0] and memo[2] == bounds
            and all(r() is t for r, t in zip(memo[1], tensors))):
        memo[0].add(layer)
        return memo[3]
    # No past to read (fresh prompts only): the read slots are left empty, and the write
    # slots are those positions' slots.
    slots = read if read.numel() else write
    arrays = (block_tables(slots, cu_k, max_k, block_size),
              (cu_k[1:] - cu_k[:-1]).to(torch.int32), cu_q.to(torch.int32))
    _STEP.groups[group] = ({layer}, tuple(weakref.ref(t) for t in tensors), bounds, arrays)
    return arrays
