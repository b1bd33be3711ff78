"""cupaged's kernels under Hugging Face transformers' continuous batching.

The attention implementation, :func:`paged_attention_forward`, serves transformers 5.16 to
5.23 (:data:`SUPPORTED_VERSIONS`); how it is installed depends on the release, because
from 5.19 on the ``ContinuousBatchingManager`` runs only ``paged|eager``, ``sdpa`` and
flash implementations (it refuses any other name, and a "flash" name makes transformers
load a FlashAttention kernel of that name):

- transformers 5.16 to 5.18: :func:`register` adds it to transformers'
  ``AttentionInterface`` under a name of its own::

      from cupaged.integrations import transformers as cupaged_tf

      model.set_attn_implementation(cupaged_tf.register())      # "paged|cupaged"
      outputs = model.generate_batch(prompts, generation_config=config)

- every supported release, 5.19 on included: :func:`override_paged_eager` puts it in
  place of transformers' own ``paged|eager`` function, for every model of the process,
  until :func:`restore_paged_eager` puts the original back::

      model.set_attn_implementation(cupaged_tf.override_paged_eager())   # "paged|eager"
      outputs = model.generate_batch(prompts, generation_config=config)
      cupaged_tf.restore_paged_eager()

  (continuous batching switches a model loaded with ``attn_implementation="eager"`` to
  ``paged|eager`` itself, unless FlashAttention or transformers' ``kernels`` fallback is
  installed: then, with ``auto_switch_to_flash`` left True, it takes a FlashAttention
  implementation and cupaged is not called. Set ``"paged|eager"`` explicitly, as above,
  or pass ``auto_switch_to_flash=False``. :func:`paged_eager` is the same in a ``with``
  block, restored also on an exception.) Under ``paged|eager`` transformers still builds its
  attention mask each step, which this implementation does not read.

What each attention call does, per layer: the step's new keys and values go into
transformers' cache with :func:`cupaged.reshape_and_cache_flash` at the step's write
slots; each sequence's block table is read off its read slots; :func:`cupaged.attention`
then attends over the cache in place, causal and bottom-right aligned, as transformers'
paged SDPA path does. ``cache.update`` is never called: no K/V is gathered, and the
implementation builds and reads no mask.

transformers' cache, per full-attention layer, read as NHD blocks in place:

- 5.16, 5.17: a K and a V tensor of ``[(num_blocks + 2) * block_size, num_kv_heads,
  head_size]``; a slot is ``block * block_size + offset``.
- 5.18 to 5.23: one flat byte tensor. Each block of a group of ``L`` full-attention
  layers holds one page per layer, a page being its ``page_size`` K rows then its
  ``page_size`` V rows (``[num_kv_heads, head_size]`` each). A layer's K blocks are
  ``rows.view(num_blocks, L, 2, page_size, heads, head_size)[:, i, 0]`` and its V blocks
  ``[:, i, 1]`` (``i`` its place in the group), views whose block stride is ``2 * L *
  page_size`` rows; a slot is ``block * 2 * L * page_size + offset``, counted from the
  layer's first K row.

Keywords read: ``cache``, ``read_index``/``write_index`` (one tensor per cache group),
``cu_seq_lens_q``/``_k``, and ``max_seqlen_q``/``_k`` (5.16 to 5.18) or
``max_length_q``/``_k`` (5.19 on); a per-layer-type dict of ``cu_seq_lens_k`` or of the
key bound is read at ``"full_attention"``.

Supported: models whose layers are all full attention (a sliding-window layer raises
``NotImplementedError``, as do transformers' ``softcap=`` and ``s_aux=``/attention
sinks); block (page) sizes that are powers of two up to 256; float16 and bfloat16 (float32
too, through the decode kernel's row mode); transformers' CUDA graphs. transformers' own
compiled continuous batching (``compile_config``, ``default_compile_level``) is not
supported: the implementation calls cupaged's Python entry points, which dynamo does not
trace. With transformers' CUDA graphs, the padded query rows (past ``cu_seq_lens_q[-1]``)
belong to no sequence and are left unwritten, which ``CUPAGED_DEBUG=1``'s check of
``query_start_loc`` reports.
The name given to :func:`register` must not contain "flash" (in any case: ValueError):
transformers treats such names as FlashAttention and hands them block tables and a
different cache path.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref

from .._checks import BLOCK_SIZES

SUPPORTED_VERSIONS = ("5.16", "5.17", "5.18", "5.19", "5.20", "5.21", "5.22", "5.23")
"""The transformers releases (major.minor) whose continuous-batching interface this reads."""

NAMED_VERSIONS = ("5.16", "5.17", "5.18")
"""The releases whose continuous batching runs an implementation registered under a name
of its own (:func:`register`); the later ones run only ``paged|eager``, ``sdpa`` and flash
names (:func:`override_paged_eager`)."""

__all__ = ["NAMED_VERSIONS", "SUPPORTED_VERSIONS", "block_tables", "override_paged_eager",
           "paged_attention_forward", "register", "restore_paged_eager"]

PAGED_EAGER = "paged|eager"


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _check_version(version: str) -> None:
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = None
    # a pre-release or dev build of a supported minor may carry the previous cycle's cache
    if parsed is None or parsed.is_prerelease or parsed.is_devrelease \
            or _minor(version) not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"cupaged's transformers integration reads the continuous-batching cache and "
            f"attention keywords of transformers {SUPPORTED_VERSIONS[0]} to "
            f"{SUPPORTED_VERSIONS[-1]}; transformers {version} differs or is not known to "
            f"it. Install a release from {SUPPORTED_VERSIONS[0]} to {SUPPORTED_VERSIONS[-1]}, "
            f"or use transformers' own paged SDPA path.")


def register(name: str = "cupaged") -> str:
    """Register cupaged's paged attention with transformers' ``AttentionInterface`` as
    ``"paged|<name>"`` and return that string (the ``attn_implementation`` to give a
    model). transformers 5.16 to 5.18 (:data:`NAMED_VERSIONS`) only: later releases run
    continuous batching under ``paged|eager``, ``sdpa`` and flash names alone, served by
    :func:`override_paged_eager`. Raises ``RuntimeError`` for a release outside
    :data:`NAMED_VERSIONS` (checked first), and ``ValueError`` for a name containing
    "flash" in any case or a "|"; nothing is registered then."""
    import transformers
    from transformers import AttentionInterface

    version = transformers.__version__
    _check_version(version)
    if _minor(version) not in NAMED_VERSIONS:
        raise RuntimeError(
            f"transformers {version} runs continuous batching only under 'paged|eager', "
            f"'sdpa' or a flash implementation (its ContinuousBatchingManager refuses other "
            f"names and drops a 'paged|' prefix), so a name of cupaged's own cannot be served; "
            f"call cupaged_tf.override_paged_eager(), which puts cupaged's implementation "
            f"under 'paged|eager' until cupaged_tf.restore_paged_eager()")
    if "flash" in name.lower():
        raise ValueError(f"name={name!r}: transformers treats implementations named 'flash' "
                         f"as FlashAttention (block tables, its own cache path); pick another")
    if "|" in name:
        raise ValueError(f"name={name!r}: give the name alone; 'paged|' is added")
    key = f"paged|{name}"
    AttentionInterface.register(key, paged_attention_forward)
    return key


_OVERRIDE_LOCK = threading.Lock()
_OVERRIDDEN = []  # [the function that 'paged|eager' named before override_paged_eager]


def override_paged_eager() -> str:
    """Put :func:`paged_attention_forward` in place of transformers' ``paged|eager``
    function, for every model of the process, and return ``"paged|eager"`` (the
    ``attn_implementation`` to give a model; continuous batching switches a model loaded
    with ``"eager"`` to it too, unless it switches to a FlashAttention implementation: see
    the module's docs). Opt-in and global: every ``paged|eager`` run of continuous
    batching attends with cupaged until :func:`restore_paged_eager`. A call while
    cupaged's function is in place does nothing; one after something else replaced it
    installs it again, keeping the first call's original for the restore. Any supported release (:data:`SUPPORTED_VERSIONS`); raises
    ``RuntimeError`` for another."""
    import transformers
    from transformers import AttentionInterface

    _check_version(transformers.__version__)
    with _OVERRIDE_LOCK:
        mapping = AttentionInterface._global_mapping
        now = mapping.get(PAGED_EAGER)
        if now is None:
            raise RuntimeError(f"transformers {transformers.__version__} has no "
                               f"'{PAGED_EAGER}' attention function to replace")
        if now is not paged_attention_forward:
            # Decided by what the mapping holds, not by an earlier call: if something
            # replaced cupaged's function since, it is cupaged's again (the original kept
            # from the first call, the replacement set aside as the one to restore).
            _OVERRIDDEN[:] = [_OVERRIDDEN[0] if _OVERRIDDEN else now]
            AttentionInterface.register(PAGED_EAGER, paged_attention_forward)
    return PAGED_EAGER


@contextlib.contextmanager
def paged_eager():
    """:func:`override_paged_eager` for a ``with`` block, restored when it exits, also on an
    exception: ``with cupaged_tf.paged_eager() as name: model.set_attn_implementation(name);
    ...``. (CUDA graphs continuous batching captured under one implementation replay it
    whatever the mapping holds later: a manager kept across sessions keeps its graphs.)"""
    name = override_paged_eager()
    try:
        yield name
    finally:
        restore_paged_eager()


def restore_paged_eager() -> bool:
    """Undo :func:`override_paged_eager`: put back the function ``paged|eager`` named
    before it. Returns whether there was an override to undo. Raises ``RuntimeError``
    (and leaves the mapping as it is) if something other than cupaged's implementation
    has replaced it since."""
    from transformers import AttentionInterface

    with _OVERRIDE_LOCK:
        if not _OVERRIDDEN:
            return False
        now = AttentionInterface._global_mapping.get(PAGED_EAGER)
        if now is not paged_attention_forward:
            raise RuntimeError(f"'{PAGED_EAGER}' names {now!r} now, not cupaged's "
                               f"implementation: something replaced it after "
                               f"override_paged_eager(); not restoring over it")
        AttentionInterface.register(PAGED_EAGER, _OVERRIDDEN.pop())
    return True


def block_tables(slots, cu_seq_lens_k, max_seq_len: int, block_size: int,
                 block_stride: int | None = None):
    """Each sequence's block table from its slots: ``slots`` (int64, concatenated over the
    sequences, ``cu_seq_lens_k`` (int32 ``[num_seqs + 1]``) giving each one's range)
    hold ``block * block_stride + offset`` (``offset < block_size``; ``block_stride``
    defaults to ``block_size``) for positions 0, 1, ... of the sequence, so its j-th block
    is ``slots[start + j * block_size] // block_stride``. ``max_seq_len``: a host bound on
    the lengths (the table's width). Entries past a sequence's last block are whatever
    lies there (clamped into ``slots``): the kernels never read them. No sync."""
    import torch

    stride = block_size if block_stride is None else block_stride
    width = max(1, math.ceil(max_seq_len / block_size))
    starts = cu_seq_lens_k[:-1].long()
    at = starts[:, None] + torch.arange(width, device=slots.device) * block_size
    at = at.clamp_(max=max(slots.numel() - 1, 0))
    return torch.div(slots[at], stride, rounding_mode="floor").to(torch.int32)


def _compiler_disable(fn):
    """``torch.compiler.disable``, as transformers' own paged attention functions carry it
    (torch.compile breaks the graph there instead of tracing CuPy and ctypes code); the
    function itself where torch is not installed (the module imports without it)."""
    try:
        import torch
    except ImportError:
        return fn
    return torch.compiler.disable(fn)


@_compiler_disable
def paged_attention_forward(module, query, key, value, attention_mask=None, dropout=0.0,
                            scaling=None, **kwargs):
    """transformers' attention-implementation signature: ``query`` ``[1, num_heads,
    tokens, head_size]``, ``key``/``value`` ``[1, num_kv_heads, tokens, head_size]`` (the
    step's new tokens, packed over its sequences), continuous batching's keywords
    (``cache``, ``cu_seq_lens_q``/``_k``, ``max_seqlen_q``/``_k`` or
    ``max_length_q``/``_k``, ``read_index``, ``write_index``). ``attention_mask`` is not
    read (the kernels mask causally themselves). Returns ``([1, tokens, num_heads,
    head_size], None)``."""
    from ..attention import attention
    from ..cache_ops import reshape_and_cache_flash

    cache = kwargs.get("cache")
    if cache is None:
        raise ValueError("cupaged's paged attention runs under continuous batching "
                         "(generate_batch or the ContinuousBatchingManager), which passes the "
                         "paged cache; for a plain forward use attn_implementation='sdpa'")
    if dropout:
        raise ValueError(f"cupaged's paged attention has no attention dropout (got "
                         f"dropout={dropout})")
    layer = module.layer_idx
    # Gemma 2's logit cap, gpt-oss's sinks: not mapped yet
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"cupaged's paged attention does not take transformers' "
                                      f"{name}= yet (layer {layer}); use transformers' paged "
                                      f"SDPA path")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError(f"layer {layer} has attention sinks, which cupaged's paged "
                                  f"attention does not take from transformers yet")
    # (what the kernels would otherwise ignore: full causal attention would be wrong)
    if kwargs.get("sliding_window") not in (None, -1):
        raise NotImplementedError(f"layer {layer} passes sliding_window="
                                  f"{kwargs['sliding_window']}, which cupaged's paged "
                                  f"attention does not take from transformers yet")
    if getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"layer {layer} is not causal; cupaged's paged attention "
                                  f"runs causal decoder layers")
    view = _layer_view(cache, layer)
    write = kwargs["write_index"][view.group]
    read = kwargs["read_index"][view.group]
    cu_k = kwargs["cu_seq_lens_k"]
    max_k = _either(kwargs, "max_length_k", "max_seqlen_k")
    if isinstance(cu_k, dict):
        cu_k = cu_k[view.layer_type]
    if isinstance(max_k, dict):
        max_k = max_k[view.layer_type]
    cu_q = kwargs["cu_seq_lens_q"]
    max_q = _either(kwargs, "max_length_q", "max_seqlen_q")

    q = query[0].transpose(0, 1)  # [tokens, heads, head_size], a strided view
    tables, seq_lens, starts, slots = _step_arrays(view.group, layer, read, write, cu_k, cu_q,
                                                   int(max_k), view.block_size, view.stride)
    reshape_and_cache_flash(key[0].transpose(0, 1), value[0].transpose(0, 1), view.k, view.v,
                            slots)
    out = attention(q, view.k, view.v, tables, seq_lens, starts, kv_layout="NHD", causal=True,
                    scale=scaling, max_query_len=max(int(max_q), 1), max_seq_len=int(max_k))
    return out.unsqueeze(0), None


def _either(kwargs, new: str, old: str):
    """The keyword a release passes under one of two names (5.19 renamed them)."""
    if new in kwargs:
        return kwargs[new]
    if old in kwargs:
        return kwargs[old]
    raise TypeError(f"continuous batching passed neither {new}= nor {old}= to the attention "
                    f"function (keywords given: {sorted(kwargs)})")


class _LayerView:
    """A layer's K and V caches as NHD blocks (views of transformers' cache), its cache
    group (the index into ``read_index``/``write_index``), the layer type naming its
    entries of per-type keywords, the block size, and the stride between blocks of the
    slots transformers lists (rows of the layer's K or V)."""

    __slots__ = ("k", "v", "group", "layer_type", "block_size", "stride")

    def __init__(self, k, v, group, layer_type, block_size, stride):
        self.k, self.v, self.group, self.layer_type = k, v, group, layer_type
        self.block_size, self.stride = block_size, stride


_VIEWS = weakref.WeakKeyDictionary()  # cache allocator (5.18 on) -> {layer: _LayerView}


def _layer_view(cache, layer: int) -> _LayerView:
    if not hasattr(cache, "layer_to_allocator"):
        return _flat_view(cache, layer)  # a few views of two tensors: not worth a memo
    allocator = cache.layer_to_allocator[layer]
    views = _VIEWS.setdefault(allocator, {})
    view = views.get(layer)
    if view is None:
        view = views[layer] = _pages_view(cache, layer)
    return view


def _check_block_size(bs: int, what: str) -> None:
    if bs not in BLOCK_SIZES:
        raise ValueError(f"transformers' {what} is {bs}; cupaged's kernels take powers of two "
                         f"from 1 to 256 (ContinuousBatchingConfig({what}=...))")


def _flat_view(cache, layer: int) -> _LayerView:
    """transformers 5.16, 5.17: per layer a K and a V tensor of ``[(num_blocks + 2) *
    block_size, num_kv_heads, head_size]``."""
    if cache.sliding_windows.get(layer, 1) != 1:
        raise NotImplementedError(
            f"layer {layer} has a sliding window: transformers keeps it in a ring of slots "
            f"that cupaged's paged attention does not read; use transformers' paged SDPA path "
            f"for this model")
    group, index = cache.layer_index_to_group_indices[layer]
    bs = cache.block_size
    _check_block_size(bs, "block_size")
    k, v = cache.key_cache[index], cache.value_cache[index]
    blocks = (k.shape[0] // bs, bs, *k.shape[1:])
    return _LayerView(k.view(blocks), v.view(blocks), group, "full_attention", bs, bs)


def _pages_view(cache, layer: int) -> _LayerView:
    """transformers 5.18 on: the layer's K and V pages inside the flat cache tensor."""
    import transformers

    allocator = cache.layer_to_allocator[layer]
    layer_type = next((t for t, a in cache.cache_allocators.items() if a is allocator), None)
    if layer_type is None:
        raise RuntimeError(f"layer {layer}'s cache allocator is not among the cache's "
                           f"cache_allocators: a layout this integration does not know")
    if layer_type != "full_attention" or getattr(allocator, "sliding_window", None):
        raise NotImplementedError(
            f"layer {layer} is a {layer_type} layer: transformers keeps it in a ring of slots "
            f"that cupaged's paged attention does not read; use transformers' paged SDPA path "
            f"for this model")
    P = allocator.tokens_per_page
    _check_block_size(P, "page_size")
    L = len(allocator.layer_indices)
    i = allocator.layer_indices.index(layer)
    stride = allocator.block_physical_stride
    rows = allocator.cache_tensor  # [tokens, 2, kv_heads, head_size]
    heads, dim = rows.shape[-2:]
    rows = rows.view(-1, heads, dim)
    blocks = rows[:rows.shape[0] // stride * stride].view(-1, L, 2, P, heads, dim)
    k, v = blocks[:, i, 0], blocks[:, i, 1]
    # The layout read above is 5.18's to 5.23's: check it against the allocator's own views
    # of this layer (slot 0 of each), so that a changed layout raises instead of misreading.
    theirs = getattr(allocator, "_kv_token_views", {}).get(layer)
    if (stride != 2 * L * P or theirs is None or theirs[0].data_ptr() != k.data_ptr()
            or theirs[1].data_ptr() != v.data_ptr()
            or tuple(theirs[0].stride()) != tuple(k.stride()[1:])):
        raise RuntimeError(
            f"transformers {transformers.__version__}'s paged cache is not laid out as "
            f"cupaged reads it (pages of page_size K rows then V rows, one per layer of the "
            f"group, slots block * {2 * L * P} + offset); use transformers' paged SDPA path")
    return _LayerView(k, v, allocator.index, layer_type, P, stride)


class _StepMemo(threading.local):
    """Per thread (a generation loop runs its forward passes one after another) and per
    cache group (whose layers share the slot tensors): the last step's arrays."""

    def __init__(self):
        self.groups = {}  # group -> (layers served, input references, bounds, arrays)


_STEP = _StepMemo()


def _step_arrays(group: int, layer: int, read, write, cu_k, cu_q, max_k: int,
                 block_size: int, block_stride: int | None = None) -> tuple:
    """``(block_tables, seq_lens, query_start_loc, write_slots)`` of a step (int32, int32,
    int32, int64), made once per forward pass and shared by the layers of a cache group,
    which pass the same slot and length tensors (compared by identity, through weak
    references: a later step's cannot take their place). ``write_slots`` are the write
    slots as cupaged's cache writer counts them (``block * block_size + offset``). A
    layer that has already been served starts a new pass, which derives them anew
    whatever the layers' order: transformers' CUDA graphs pass the same tensors to every
    step with new contents, so the capture after a warm-up pass must record the
    derivation."""
    import torch

    stride = block_size if block_stride is None else block_stride
    tensors, bounds = (read, write, cu_k, cu_q), (max_k, block_size, stride)
    memo = _STEP.groups.get(group)
    if (memo is not None and layer not in memo[0] and memo[2] == bounds
            and all(r() is t for r, t in zip(memo[1], tensors))):
        memo[0].add(layer)
        return memo[3]
    # No past to read (fresh prompts only): the read slots are left empty, and the write
    # slots are those positions' slots.
    slots = read if read.numel() else write
    if stride == block_size:
        written = write
    else:  # block * stride + offset -> block * block_size + offset
        written = torch.div(write, stride, rounding_mode="floor") * block_size + write % stride
    arrays = (block_tables(slots, cu_k, max_k, block_size, stride),
              (cu_k[1:] - cu_k[:-1]).to(torch.int32), cu_q.to(torch.int32), written)
    _STEP.groups[group] = ({layer}, tuple(weakref.ref(t) for t in tensors), bounds, arrays)
    return arrays
