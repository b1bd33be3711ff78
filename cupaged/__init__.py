"""cupaged: paged-attention kernels compiled at run time, for any Python program.

Paged attention for every kind of step (prefill, chunked prefill, speculative verify,
decode) over NHD, HND or vLLM's cache layout, on CuPy arrays, PyTorch tensors or any
DLPack producer (no copies; torch in, torch out), with CUDA C++ templates specialized per
dtype, head size, block size and layout, compiled with NVRTC and cached.

Public API:
    attention               varlen paged attention over any layout (every kind of step)
    AttentionPlan           attention checked and planned once, run for every layer
    mla_attention           DeepSeek's absorbed multi-head latent attention over a paged latent cache
    sparse_mla_attention    DeepSeek's sparse attention (DSA) over top-k slot indices of the latent cache
    paged_attention         decode attention over vLLM's layout (single pass or split-KV)
    paged_attention_v1/v2   the same with vLLM's argument order
    DecodeWorkspace         preallocated split-KV scratch (allocation-free calls, graphs)
    reshape_and_cache       write new tokens' K and V into their cache slots
    reshape_and_cache_flash the same with vLLM's flash-cache name and convention
    concat_and_cache_mla    write new tokens' MLA latent vectors (kv_c, k_pe) into their slots
    indexer_k_quant_and_cache  write DSA's lightning-indexer keys into their fp8 cache
    indexer_logits          the lightning indexer's logits over that cache (DeepGEMM's)
    indexer_topk            each row's top-k columns of those logits
    copy_blocks             copy blocks within per-layer caches (copy-on-write)
    copy_blocks_mla         the same for per-layer MLA latent caches
    swap_blocks             move blocks between a device cache and a host cache
    empty_pinned            pinned host arrays for swap_blocks
    merge_state             merge two partial attention results by their log-sum-exp
    merge_states            merge any number of them (a list or a stacked array)
    PagedKVCache            device caches for all layers (any layout) plus their block bookkeeping
    PagedMLACache           the same for MLA latent caches, DeepSeek's sparse rows included
    Step                    one step's slot mapping, block tables, seq_lens, query_start_loc
    BlockManager            the bookkeeping alone (no GPU needed)
    check_block_tables      validate block tables against the cache (synchronizes)
    precompile              compile specializations ahead of use
    KernelSpec              one specialization (its .name appears in caches and errors)
    reference               float64 NumPy reference implementation

With torch imported before cupaged (or ``import cupaged.integrations.torch_ops``), twelve
entry points are also PyTorch custom ops, ``torch.ops.cupaged.*``, for torch.compile and
opcheck: attention, mla_attention, paged_attention_v1/v2, reshape_and_cache(_flash),
concat_and_cache_mla, copy_blocks(_mla), swap_blocks and merge_state(s)
(:mod:`cupaged.integrations.torch_ops`; paged_attention and the host-side objects have
none).
"""

import sys as _sys

from . import reference
from .decode import (
    BLOCK_SIZES,
    DecodeWorkspace,
    HEAD_SIZES,
    check_block_tables,
    paged_attention,
    paged_attention_v1,
    paged_attention_v2,
)
from .indexer import indexer_logits, indexer_topk
from .cache_ops import (
    concat_and_cache_mla,
    copy_blocks,
    copy_blocks_mla,
    empty_pinned,
    indexer_k_quant_and_cache,
    reshape_and_cache,
    reshape_and_cache_flash,
    swap_blocks,
)
from .merge import merge_state, merge_states
from .jit import CompileError, KernelSpec, precompile
from .attention import AttentionPlan, attention
from ._variants import SoftCap
from .mla import mla_attention
from .sparse_mla import sparse_mla_attention
from .kv_cache import (BlockManager, DecodeStep, OutOfBlocks, PagedKVCache, PagedMLACache,
                       Step)

__version__ = "0.1.0"

# torch.ops.cupaged.* where torch is already imported (never importing it here), and new
# enough for torch.library.custom_op (2.4). Not from a copy imported under another name
# (cupaged-bench ab's other tree): its ops would take over torch.ops.cupaged, and go when
# that copy is dropped.
if __name__ == "cupaged" and hasattr(getattr(_sys.modules.get("torch"), "library", None),
                                     "custom_op"):
    from .integrations import torch_ops as _torch_ops  # noqa: F401

__all__ = [
    "AttentionPlan",
    "BLOCK_SIZES",
    "BlockManager",
    "attention",
    "CompileError",
    "DecodeStep",
    "DecodeWorkspace",
    "OutOfBlocks",
    "PagedKVCache",
    "PagedMLACache",
    "SoftCap",
    "Step",
    "concat_and_cache_mla",
    "copy_blocks",
    "copy_blocks_mla",
    "empty_pinned",
    "indexer_k_quant_and_cache",
    "indexer_logits",
    "indexer_topk",
    "merge_state",
    "merge_states",
    "mla_attention",
    "sparse_mla_attention",
    "reshape_and_cache",
    "reshape_and_cache_flash",
    "swap_blocks",
    "HEAD_SIZES",
    "KernelSpec",
    "check_block_tables",
    "paged_attention",
    "paged_attention_v1",
    "paged_attention_v2",
    "precompile",
    "reference",
]
