"""cupaged.integrations.transformers against whichever transformers release is installed
(5.16 to 5.23 served). On the CPU: the version, name and override checks; the block
tables read off transformers' slot lists; the layer views of 5.18's paged cache; the step
memo; and generate_batch through host stand-ins for the two kernels (chunked prefill,
padded steps, CUDA-graph capture and replay emulated), with each call's writes and reads
checked against transformers' own ``cache.update``. On the GPU: generate_batch on
cupaged's kernels gives transformers' paged SDPA greedy tokens, with and without CUDA
graphs, and its float16 and bfloat16 logits stay within the engine's stated tolerance.

The implementation is installed the way the release takes it: ``register()`` on 5.16 to
5.18, and ``override_paged_eager()`` on every release (the only way from 5.19 on); each
test runs on a copy of transformers' attention mapping, so nothing leaks between tests.
The reference is ``paged|sdpa`` up to 5.18 and ``sdpa`` (its paged path) from 5.19.

To run against another release, put its wheel on the path ahead of the installed one,
e.g. ``pip install --no-deps --target /tmp/tf523 transformers-5.23.0-py3-none-any.whl``
then ``PYTHONPATH=/tmp/tf523:$PWD python3 -m pytest tests/test_transformers.py`` (5.23
needs huggingface_hub >= 1.31 beside it). Skipped where torch or transformers does not
import."""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cupaged.integrations import transformers as cupaged_tf  # noqa: E402
from cupaged.serving.llama import Llama, LlamaConfig, to_hf  # noqa: E402

RELEASE = cupaged_tf._minor(transformers.__version__)
SUPPORTED = RELEASE in cupaged_tf.SUPPORTED_VERSIONS
NAMED = RELEASE in cupaged_tf.NAMED_VERSIONS  # register() serves it
REFERENCE = "paged|sdpa" if NAMED else "sdpa"  # transformers' paged SDPA path
needs_release = pytest.mark.skipif(not SUPPORTED, reason="this transformers release is not "
                                   "supported")


@pytest.fixture(autouse=True)
def _own_attention_mapping(monkeypatch):
    """Each test registers into a copy of transformers' attention mapping, with no
    override of cupaged's in force."""
    from transformers import AttentionInterface

    monkeypatch.setattr(AttentionInterface, "_global_mapping",
                        dict(AttentionInterface._global_mapping))
    monkeypatch.setattr(cupaged_tf, "_OVERRIDDEN", [])


@pytest.fixture(params=["register", "override"])
def install(request):
    """The ways this release takes the implementation: a function returning the
    ``attn_implementation`` name to give the model."""
    if request.param == "register" and not NAMED:
        pytest.skip(f"transformers {RELEASE} runs no implementation of another name")
    return cupaged_tf.register if request.param == "register" else cupaged_tf.override_paged_eager


@pytest.mark.parametrize("version", ["5.15.0", "5.24.0", "6.0.0"])
@pytest.mark.parametrize("entry", ["register", "override_paged_eager"])
def test_unsupported_releases_are_refused(monkeypatch, version, entry):
    # The module register() imports now (another test may have imported it anew).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    with pytest.raises(RuntimeError, match=f"transformers {version} differs or is not known"):
        getattr(cupaged_tf, entry)()


@pytest.mark.parametrize("version", ["5.19.0", "5.23.0"])
def test_register_refused_where_names_are_not_run(monkeypatch, version):
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    with pytest.raises(RuntimeError, match=f"transformers {version} runs continuous batching "
                       f"only under 'paged\\|eager'.*override_paged_eager"):
        cupaged_tf.register()


@pytest.mark.skipif(not NAMED, reason="register() does not serve this release")
def test_register_names_and_refusals():
    from transformers import AttentionInterface

    assert cupaged_tf.register() == "paged|cupaged"
    assert AttentionInterface._global_mapping["paged|cupaged"] is cupaged_tf.paged_attention_forward
    with pytest.raises(ValueError, match="treats implementations named 'flash'"):
        cupaged_tf.register("my_flash")
    with pytest.raises(ValueError, match="treats implementations named 'flash'"):
        cupaged_tf.register("My_FLASH")  # in any case
    assert "paged|My_FLASH" not in AttentionInterface._global_mapping
    with pytest.raises(ValueError, match="'paged\\|' is added"):
        cupaged_tf.register("paged|x")


@needs_release
def test_override_paged_eager_is_reversible():
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = AttentionInterface._global_mapping
    original = mapping["paged|eager"]
    assert cupaged_tf.restore_paged_eager() is False  # nothing to undo
    assert cupaged_tf.override_paged_eager() == "paged|eager"
    assert ALL_ATTENTION_FUNCTIONS["paged|eager"] is cupaged_tf.paged_attention_forward
    assert cupaged_tf.override_paged_eager() == "paged|eager"  # a second call keeps the original
    assert cupaged_tf.restore_paged_eager() is True
    assert mapping["paged|eager"] is original
    assert cupaged_tf.restore_paged_eager() is False

    cupaged_tf.override_paged_eager()
    mapping["paged|eager"] = other = (lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="something replaced it after override_paged_eager"):
        cupaged_tf.restore_paged_eager()
    assert mapping["paged|eager"] is other
    # Decided by the mapping, not by the first call: cupaged's function is in place again,
    # and the restore puts back transformers' own (kept from the first call).
    assert cupaged_tf.override_paged_eager() == "paged|eager"
    assert mapping["paged|eager"] is cupaged_tf.paged_attention_forward
    assert cupaged_tf.restore_paged_eager() is True
    assert mapping["paged|eager"] is original


@needs_release
def test_paged_eager_restores_on_exit_and_on_an_exception():
    from transformers import AttentionInterface

    mapping = AttentionInterface._global_mapping
    original = mapping["paged|eager"]
    with cupaged_tf.paged_eager() as name:
        assert name == "paged|eager"
        assert mapping[name] is cupaged_tf.paged_attention_forward
    assert mapping["paged|eager"] is original
    with pytest.raises(KeyError):
        with cupaged_tf.paged_eager():
            raise KeyError("a failed generate_batch")
    assert mapping["paged|eager"] is original


@pytest.mark.parametrize("version", ["5.16.0.dev0", "5.23.0rc1", "5.19.0a1", "not-a-version"])
def test_pre_releases_and_dev_builds_are_refused(monkeypatch, version):
    """A dev build or pre-release of a supported minor may carry the previous cycle's
    cache layout: refused as an unknown release."""
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    with pytest.raises(RuntimeError, match=f"transformers {version} differs or is not known"):
        cupaged_tf.override_paged_eager()


def _fake_call(block_size=16, **extra):
    """paged_attention_forward's arguments for one layer of a tiny step (CPU tensors:
    the checks come before any kernel)."""
    from types import SimpleNamespace

    cache = SimpleNamespace(
        sliding_windows={0: 1}, layer_index_to_group_indices={0: (0, 0)},
        block_size=block_size, key_cache=[torch.zeros(6 * block_size, 2, 32)],
        value_cache=[torch.zeros(6 * block_size, 2, 32)])
    kw = dict(cache=cache, read_index=[torch.zeros(0, dtype=torch.int64)],
              write_index=[torch.arange(3)], cu_seq_lens_q=torch.tensor([0, 3]),
              cu_seq_lens_k=torch.tensor([0, 3]), max_seqlen_q=3, max_seqlen_k=3, **extra)
    q, k = torch.zeros(1, 4, 3, 32), torch.zeros(1, 2, 3, 32)
    return (SimpleNamespace(layer_idx=0), q, k, k), kw


@pytest.mark.parametrize("extra, error, match", [
    (dict(softcap=30.0), NotImplementedError, "softcap="),
    (dict(s_aux=torch.zeros(4)), NotImplementedError, "s_aux="),
    (dict(sliding_window=4096), NotImplementedError, "passes sliding_window=4096"),
    (dict(is_causal=False), NotImplementedError, "layer 0 is not causal"),
    (dict(block_size=12), ValueError, "powers of two"),
    (dict(cache=None), ValueError, "runs under continuous batching"),
])
def test_what_the_implementation_refuses(extra, error, match):
    block_size = extra.pop("block_size", 16)
    args, kw = _fake_call(block_size)
    if "is_causal" in extra:
        args[0].is_causal = extra.pop("is_causal")
    kw.update(extra)
    with pytest.raises(error, match=match):
        cupaged_tf.paged_attention_forward(*args, **kw)


def test_sliding_window_layers_are_refused():
    args, kw = _fake_call()
    kw["cache"].sliding_windows[0] = 4096
    with pytest.raises(NotImplementedError, match="layer 0 has a sliding window"):
        cupaged_tf.paged_attention_forward(*args, **kw)


class _Allocator:
    """A full-attention cache allocator of transformers 5.18 on, as much of it as the
    layer views read: ``layers`` share each block, a page per layer of ``P`` K rows then
    ``P`` V rows; ``_kv_token_views`` as transformers makes them (``shift`` rows off, to
    stand for a layout cupaged does not know)."""

    def __init__(self, layers, P=16, heads=2, dim=32, blocks=5, shift=0):
        self.index, self.layer_indices, self.tokens_per_page = 0, list(layers), P
        self.block_physical_stride = 2 * len(layers) * P
        self.cache_tensor = torch.zeros(blocks * len(layers) * P, 2, heads, dim)
        rows = self.cache_tensor.view(-1, heads, dim)
        self._kv_token_views = {layer: (rows[(2 * i) * P + shift:], rows[(2 * i + 1) * P:])
                                for i, layer in enumerate(layers)}


def _paged_cache(allocator, layer_type="full_attention"):
    from types import SimpleNamespace

    return SimpleNamespace(layer_to_allocator=dict.fromkeys(allocator.layer_indices, allocator),
                           cache_allocators={layer_type: allocator})


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_page_views_address_transformers_slots(layer):
    """5.18 on: a layer's K and V block views put transformers' slot ``block * 2 * L * P +
    offset`` (a row of the allocator's per-layer views) at ``[block, offset]``."""
    allocator = _Allocator([0, 1, 2])
    view = cupaged_tf._layer_view(_paged_cache(allocator), layer)
    assert (view.block_size, view.stride, view.group, view.layer_type) == (16, 96, 0,
                                                                          "full_attention")
    k_rows, v_rows = allocator._kv_token_views[layer]
    slots = torch.tensor([0, 5, 96 + 15, 4 * 96 + 3])
    k_rows[slots] = torch.randn(len(slots), *k_rows.shape[1:])
    v_rows[slots] = torch.randn(len(slots), *v_rows.shape[1:])
    for slot in slots.tolist():
        assert torch.equal(view.k[slot // 96, slot % 96], k_rows[slot])
        assert torch.equal(view.v[slot // 96, slot % 96], v_rows[slot])
    assert view.k.untyped_storage().data_ptr() == allocator.cache_tensor.data_ptr()


def test_page_views_refuse_an_unknown_layout_and_sliding_layers():
    with pytest.raises(RuntimeError, match="not laid out as cupaged reads it"):
        cupaged_tf._layer_view(_paged_cache(_Allocator([0, 1], shift=1)), 1)
    with pytest.raises(NotImplementedError, match="layer 0 is a sliding_attention layer"):
        cupaged_tf._layer_view(_paged_cache(_Allocator([0]), "sliding_attention"), 0)
    with pytest.raises(ValueError, match="page_size is 12; cupaged's kernels take powers"):
        cupaged_tf._layer_view(_paged_cache(_Allocator([0], P=12)), 0)


def _three_layer_call(monkeypatch, seen):
    """_fake_call's arguments over three layers of one cache group, the kernels replaced by
    a recorder of the block tables attention gets (its tensor and its contents)."""
    import cupaged.cache_ops

    def attend(q, kc, vc, tables, *args, **kwargs):
        seen.append((tables, tables.clone()))
        return torch.zeros_like(q)

    monkeypatch.setattr(cupaged.cache_ops, "reshape_and_cache_flash", lambda *a, **k: None)
    monkeypatch.setattr(sys.modules["cupaged.attention"], "attention", attend)
    args, kw = _fake_call()
    cache = kw["cache"]
    for layer in (1, 2):
        cache.sliding_windows[layer] = 1
        cache.layer_index_to_group_indices[layer] = (0, layer)
        cache.key_cache.append(cache.key_cache[0].clone())
        cache.value_cache.append(cache.value_cache[0].clone())
    return args, kw


def _slots_in_block(block):
    return torch.arange(block * 16, block * 16 + 3)  # a sequence's 3 tokens in one block


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_each_forward_pass_derives_its_step_arrays(monkeypatch, order):
    """transformers' CUDA graphs pass the same slot tensors to every step, their contents
    changed in place: each forward pass derives the block tables anew (so that a capture
    records it) whatever order its layers run in, and its other layers share them."""
    seen = []
    args, kw = _three_layer_call(monkeypatch, seen)
    read = _slots_in_block(3)
    kw.update(read_index=[read])
    for block in (3, 5):
        read.copy_(_slots_in_block(block))
        for layer in order:
            args[0].layer_idx = layer
            cupaged_tf.paged_attention_forward(*args, **kw)
    assert [t.tolist() for _, t in seen] == [[[3]]] * 3 + [[[5]]] * 3
    assert seen[0][0] is seen[1][0] is seen[2][0] and seen[3][0] is seen[4][0] is seen[5][0]


def test_step_arrays_of_threads_interleaved(monkeypatch):
    """Two generation loops (two models, a thread each) interleaved: one model's pass
    broken by the other's layer, then its next pass over the same tensors with new
    contents (a warm-up pass, then a capture). Each pass's tables are its own contents'."""
    from concurrent.futures import ThreadPoolExecutor

    seen = []
    args, kw = _three_layer_call(monkeypatch, seen)
    reads = {"a": _slots_in_block(3), "b": _slots_in_block(4)}
    loops = {name: ThreadPoolExecutor(max_workers=1) for name in reads}
    # (loop, layer, the block its read slots are set to first; None: left as they are)
    turns = [("a", 0, 3), ("b", 0, 4), ("a", 1, None), ("a", 2, None),
             ("a", 0, 5), ("a", 1, None), ("a", 2, None), ("b", 1, None), ("b", 2, None)]
    want = []
    try:
        for name, layer, block in turns:  # one call at a time, in this order
            if block is not None:
                reads[name].copy_(_slots_in_block(block))
            want.append([[int(reads[name][0]) // 16]])
            module = type(args[0])(layer_idx=layer)
            loops[name].submit(cupaged_tf.paged_attention_forward, module, *args[1:],
                               **dict(kw, read_index=[reads[name]])).result()
    finally:
        for loop in loops.values():
            loop.shutdown()
    assert [t.tolist() for _, t in seen] == want


def _slots_like_transformers(tables, lens, block_size):
    """Each sequence's read slots as transformers lists them: positions 0..len-1, block by
    block (its cache manager's get_read_indices)."""
    out = []
    for t, n in zip(tables, lens):
        out += [t[p // block_size] * block_size + p % block_size for p in range(n)]
    return out


@pytest.mark.parametrize("block_size", [4, 16, 256])
def test_block_tables_from_read_slots(rng, block_size):
    lens = [1, 0, block_size, block_size + 1, 3 * block_size - 1, 7]
    width = max(-(-n // block_size) for n in lens)
    tables = [list(rng.permutation(40)[:width]) for _ in lens]
    slots = torch.tensor(_slots_like_transformers(tables, lens, block_size))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    for bound in (max(lens), max(lens) + 3 * block_size):  # an overcount widens the table
        got = cupaged_tf.block_tables(slots, cu, bound, block_size)
        assert got.dtype == torch.int32 and got.shape[0] == len(lens)
        assert got.shape[1] == -(-bound // block_size)
        for s, n in enumerate(lens):
            used = -(-n // block_size)
            assert got[s, :used].tolist() == tables[s][:used]


def test_block_tables_of_an_empty_step():
    got = cupaged_tf.block_tables(torch.zeros(0, dtype=torch.int64),
                                  torch.zeros(1, dtype=torch.int32), 0, 16)
    assert got.shape == (0, 1)


# ---- generate_batch ----------------------------------------------------------------------------

gpu = pytest.mark.gpu


def _model(dtype, seed=0, device="cuda"):
    model = Llama(LlamaConfig.preset("tiny"), device=device, dtype=dtype, seed=seed)
    return model, to_hf(model, share_weights=True)


def _prompts(lengths, seed, vocab=512):
    g = np.random.default_rng(seed)
    return [g.integers(1, vocab, n).tolist() for n in lengths]


def _generate(hf, implementation, prompts, new_tokens, block_size=16, cuda_graphs=False,
              max_batch_tokens=512):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    hf.set_attn_implementation(implementation)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    # 5.18 renamed block_size page_size (the old name warns)
    size = "block_size" if RELEASE in ("5.16", "5.17") else "page_size"
    cb = ContinuousBatchingConfig(**{size: block_size}, num_blocks=64,
                                  max_batch_tokens=max_batch_tokens, use_cuda_graph=cuda_graphs)
    out = hf.generate_batch(prompts, generation_config=config, continuous_batching_config=cb,
                            warmup=cuda_graphs)
    assert len(out) == len(prompts)  # in the prompts' order
    errors = [r.error for r in out.values() if r.error is not None]
    assert not errors, errors[0]  # generate_batch logs a request's failure and goes on
    return [r.generated_tokens for r in out.values()]


@pytest.fixture
def attention_calls(monkeypatch):
    """Counts cupaged.attention's calls (a reference run must not reach it, a cupaged run
    must)."""
    from collections import Counter

    calls = Counter()
    attend = sys.modules["cupaged.attention"].attention

    def counted(*args, **kwargs):
        calls["attention"] += 1
        return attend(*args, **kwargs)

    monkeypatch.setattr(sys.modules["cupaged.attention"], "attention", counted)
    return calls


@gpu
@needs_release
@pytest.mark.parametrize("block_size", [16, 32])
def test_generate_batch_gives_paged_sdpa_tokens(install, attention_calls, block_size):
    """float32: the same greedy tokens as transformers' paged SDPA path, prompts within
    one block and over several, prefilled in chunks (48 tokens a step), generated past
    block boundaries."""
    _, hf = _model(torch.float32)
    prompts = _prompts([5, 37, 64, 100, 1], seed=3)
    want = _generate(hf, REFERENCE, prompts, 24, block_size, max_batch_tokens=48)
    assert attention_calls["attention"] == 0
    got = _generate(hf, install(), prompts, 24, block_size, max_batch_tokens=48)
    assert attention_calls["attention"] > 0
    assert [len(t) for t in got] == [24] * len(prompts)
    assert got == want


@gpu
@needs_release
def test_generate_batch_with_cuda_graphs_gives_paged_sdpa_tokens(install, attention_calls):
    _, hf = _model(torch.float32, seed=2)
    prompts = _prompts([9, 50, 17], seed=4)
    want = _generate(hf, REFERENCE, prompts, 16)
    got = _generate(hf, install(), prompts, 16, cuda_graphs=True)
    assert attention_calls["attention"] > 0
    assert got == want


@gpu
@needs_release
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_logits_within_the_stated_tolerance(install, attention_calls, dtype):
    """The engine's stated bf16 tolerance (docs/API.md), for float16 and bfloat16: with
    weights in that dtype, the logits of each generated position deviate from the float32
    model's (the same rounded weights) by at most 1.25x what transformers' own paged SDPA
    path in that dtype deviates, in the largest deviation and in the median of the rows'
    largest deviations."""
    model, hf16 = _model(getattr(torch, dtype), seed=1)
    hf32 = to_hf(model).float()
    name = install()
    prompts = _prompts([37, 64, 100], seed=7)
    errors = {}
    for implementation in (REFERENCE, name):
        rows, errs = [], []
        hook = hf16.lm_head.register_forward_hook(lambda m, i, o: rows.append(o[0, -1].float()))
        try:
            for prompt in prompts:  # one request at a time: each forward is one step of it
                rows.clear()
                out = _generate(hf16, implementation, [prompt], 12)[0]
                assert len(rows) == len(out)  # the prompt in one step, then one per token
                full = torch.tensor([prompt + out[:-1]], device="cuda")
                with torch.no_grad():
                    want = hf32(full).logits[0].float()[len(prompt) - 1:]
                mine = torch.stack(rows)
                assert torch.isfinite(mine).all()
                errs.append((mine - want).abs().amax(dim=1))
        finally:
            hook.remove()
        errors[implementation] = torch.cat(errs)
    assert attention_calls["attention"] > 0
    ours, theirs = errors[name], errors[REFERENCE]
    assert ours.max() <= 1.25 * theirs.max(), (ours.max(), theirs.max())
    assert ours.median() <= 1.25 * theirs.median(), (ours.median(), theirs.median())


# ---- generate_batch on the host ------------------------------------------------------------------

def _host_kernels(monkeypatch, calls):
    """cupaged.reshape_and_cache_flash and cupaged.attention in torch on the host, over
    NHD blocks (any strides) and block tables (what the kernels read), for the CPU runs
    below. ``calls["last"]``: the last attention call's caches, tables and lengths."""
    import cupaged.cache_ops
    from cupaged.serving.llama import dense_attention

    def write(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs):
        assert key.shape[1:] == key_cache.shape[2:] and slot_mapping.dtype == torch.int64
        bs = key_cache.shape[1]
        for src, dst in ((key, key_cache), (value, value_cache)):
            dst[slot_mapping // bs, slot_mapping % bs] = src
        calls["write"] += 1

    def attend(q, kc, vc, tables, seq_lens, qsl, *, kv_layout, causal, scale, max_query_len,
               max_seq_len):
        assert kv_layout == "NHD" and causal and tables.dtype == seq_lens.dtype == torch.int32
        assert max_seq_len >= max(seq_lens.tolist(), default=0)
        assert max_query_len >= max((qsl[1:] - qsl[:-1]).tolist(), default=0)
        bs = kc.shape[1]
        out = torch.full_like(q, float("nan"))
        for s, n in enumerate(seq_lens.tolist()):
            pos = torch.arange(n)
            blocks, offsets = tables[s].long()[pos // bs], pos % bs
            rows = slice(int(qsl[s]), int(qsl[s + 1]))
            out[rows] = dense_attention(q[rows], kc[blocks, offsets], vc[blocks, offsets])
        calls["attention"] += 1
        calls["last"] = (kc, vc, tables, seq_lens)
        return out

    monkeypatch.setattr(cupaged.cache_ops, "reshape_and_cache_flash", write)
    monkeypatch.setattr(sys.modules["cupaged.attention"], "attention", attend)


@needs_release
@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_generate_batch_on_host_gives_paged_sdpa_tokens(monkeypatch, install, block_size):
    """The integration's reading of transformers' cache and keywords, on the CPU: with the
    two kernels done in torch over the block tables it derives, generate_batch gives the
    paged SDPA path's greedy tokens (float32, prompts over several blocks)."""
    from collections import Counter

    pytest.importorskip("psutil")  # transformers sizes its cache on the CPU through it
    model, hf = _model(torch.float32, device="cpu")
    calls = Counter()
    _host_kernels(monkeypatch, calls)
    tables = cupaged_tf.block_tables

    def counted(*args):
        calls["tables"] += 1
        return tables(*args)

    monkeypatch.setattr(cupaged_tf, "block_tables", counted)
    prompts = _prompts([5, 37, 64, 100, 1], seed=3)
    # 48 tokens a step: prompts in chunks, later chunks reading the earlier ones' cache.
    want = _generate(hf, REFERENCE, prompts, 10, block_size, max_batch_tokens=48)
    assert calls["attention"] == 0
    got = _generate(hf, install(), prompts, 10, block_size, max_batch_tokens=48)
    assert calls["attention"] > 0 and calls["write"] == calls["attention"]
    # One block table a step, shared by the model's layers.
    assert calls["tables"] * model.config.num_layers == calls["attention"]
    assert got == want


def _cache_contents(cache):
    """The cache's bytes (compared bit for bit: never-written rows may hold NaNs)."""
    if hasattr(cache, "cache_tensor"):  # 5.18 on: one flat byte tensor
        return cache.cache_tensor.clone()
    return torch.cat([t.flatten().view(torch.uint8)
                      for t in (*cache.key_cache, *cache.value_cache)])


def _transformers_update(cache, key, value, layer, kwargs):
    """transformers' own cache.update for this call: it writes the new K/V and returns
    the sequences' K and V, ``[tokens, kv_heads, head_size]``, gathered off the read
    slots (the new K/V themselves when there are none)."""
    kw = dict(kwargs)
    if RELEASE in cupaged_tf.NAMED_VERSIONS:
        k, v = cache.update(key_states=key, value_states=value, layer_idx=layer,
                            read_index=kw["read_index"], write_index=kw["write_index"])
    else:  # 5.19 on: the keywords travel whole
        k, v = cache.update(key, value, layer, kw)
    return [x[0].transpose(0, 1) if x.dim() == 4 else x for x in (k, v)]


@needs_release
def test_writes_and_reads_are_transformers_cache_updates(monkeypatch, install):
    """At every attention call of a generate_batch run (chunked prefill, then decode):
    the cache holds after cupaged's write exactly what transformers' own cache.update
    then writes (so it changes nothing more), and the K/V that cupaged's block tables
    read off its views of the pages are the ones cache.update gathers, position by
    position, for every sequence."""
    from collections import Counter

    from transformers import AttentionInterface

    pytest.importorskip("psutil")
    _, hf = _model(torch.float32, device="cpu", seed=1)
    calls = Counter()
    _host_kernels(monkeypatch, calls)
    name = install()

    def checked(module, query, key, value, *args, **kwargs):
        cache = kwargs["cache"]
        out = cupaged_tf.paged_attention_forward(module, query, key, value, *args, **kwargs)
        ours = _cache_contents(cache)
        k_want, v_want = _transformers_update(cache, key, value, module.layer_idx, kwargs)
        assert torch.equal(_cache_contents(cache), ours), "cache.update wrote something else"
        kc, vc, tables, seq_lens = calls["last"]
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), seq_lens.long().cumsum(0)])
        bs = kc.shape[1]
        for s, n in enumerate(seq_lens.tolist()):
            pos = torch.arange(n)
            blocks, offsets = tables[s].long()[pos // bs], pos % bs
            rows = slice(int(cu[s]), int(cu[s]) + n)
            assert torch.equal(kc[blocks, offsets], k_want[rows])
            assert torch.equal(vc[blocks, offsets], v_want[rows])
        calls["checked"] += 1
        calls["read"] += int(kwargs["read_index"][0].numel() > 0)
        return out

    monkeypatch.setitem(AttentionInterface._global_mapping, name, checked)
    prompts = _prompts([5, 37, 64, 100, 1], seed=5)
    want = _generate(hf, REFERENCE, prompts, 6, 16, max_batch_tokens=48)
    got = _generate(hf, name, prompts, 6, 16, max_batch_tokens=48)
    assert calls["checked"] > 0 and calls["read"] > 0
    assert got == want


@needs_release
def test_padded_steps_and_shared_prefixes_on_host(monkeypatch, install):
    """Steps padded as transformers pads them for its CUDA graphs (query rows past
    cu_seq_lens_q[-1], sequences of length 0, trash slots in the slot lists) and prompts
    with a common prefix (whose blocks transformers may share): the paged SDPA path's
    tokens, with padded rows seen."""
    from collections import Counter

    from transformers.generation.continuous_batching import model_runner

    pytest.importorskip("psutil")
    init = model_runner.ModelRunner.__init__

    def padded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pad_inputs = True

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padded)
    _, hf = _model(torch.float32, device="cpu")
    calls = Counter()
    _host_kernels(monkeypatch, calls)
    name = install()
    seen = Counter()

    def spy(module, query, *args, **kwargs):
        seen["padded"] += int(kwargs["cu_seq_lens_q"][-1]) < query.shape[2]
        return cupaged_tf.paged_attention_forward(module, query, *args, **kwargs)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, name, spy)
    base = _prompts([40], seed=9)[0]
    prompts = _prompts([5, 37, 64], seed=3) + [base + [7, 8, 9], base + [1, 2], base]
    want = _generate(hf, REFERENCE, prompts, 8, 16, max_batch_tokens=48)
    got = _generate(hf, name, prompts, 8, 16, max_batch_tokens=48)
    assert seen["padded"] > 0 and calls["attention"] > 0
    assert got == want


@needs_release
@pytest.mark.parametrize("warmup", [False, True])
def test_cuda_graph_capture_and_replay_emulated_on_host(monkeypatch, install, warmup):
    """transformers' CUDA-graph path on the CPU: its compute_batch with the capture and
    replay emulated (a new graph key runs the forward twice over the same batch tensors,
    a warm-up pass then the "capture"; a replay reruns the captured pass after the tensors
    were refilled in place; with ``warmup``, generate_batch's warm-up captures on the
    calling thread and the generation loop replays). The capture must derive the block
    tables it attends with, as a real capture records only what runs inside it; the
    tokens are the paged SDPA path's."""
    import threading
    from collections import Counter

    from transformers.generation.continuous_batching import model_runner

    pytest.importorskip("psutil")
    state = threading.local()
    stats = Counter()

    class Graph:
        def __init__(self, forward, args):
            self.forward, self.args = forward, args

        def replay(self):
            stats["replays"] += 1
            self.forward(*self.args)

        def reset(self):
            pass

    def compute_batch(self, model, batch_data):  # ModelRunner.compute_batch's graph branch
        if self.supports_logits_to_keep(model):
            batch_data["logits_to_keep"] = batch_data["logits_indices"]
        forward, graphed = self._get_forward_fn(self.inputs_and_outputs.use_block_table)
        assert graphed
        graph = self.inputs_and_outputs.get_graph()
        if graph is not None:
            return graph.replay()
        args = (model, batch_data, *self.inputs_and_outputs.get_cb_kwargs())
        forward(*args)  # the warm-up pass
        state.capturing, state.derived = True, set()
        try:
            forward(*args)
        finally:
            state.capturing = False
        stats["captures"] += 1
        self.inputs_and_outputs.set_graph(Graph(forward, args))

    init = model_runner.ModelRunner.__init__

    def graphed(self, *args, **kwargs):  # the varlen path under graphs, inputs padded
        init(self, *args, **kwargs)
        self.pad_inputs = self.use_cuda_graph_varlen = True
        self.inputs_and_outputs.use_cuda_graph_varlen = True

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", graphed)
    monkeypatch.setattr(model_runner.ModelRunner, "compute_batch", compute_batch)
    calls = Counter()
    _host_kernels(monkeypatch, calls)
    tables = cupaged_tf.block_tables

    def derived(*args):
        t = tables(*args)
        if getattr(state, "capturing", False):
            state.derived.add(id(t))
        return t

    monkeypatch.setattr(cupaged_tf, "block_tables", derived)
    attend = sys.modules["cupaged.attention"].attention

    def checked(q, kc, vc, block_tables, *args, **kwargs):
        if getattr(state, "capturing", False):
            assert id(block_tables) in state.derived, "the capture read tables made before it"
        return attend(q, kc, vc, block_tables, *args, **kwargs)

    monkeypatch.setattr(sys.modules["cupaged.attention"], "attention", checked)
    _, hf = _model(torch.float32, device="cpu", seed=2)
    name = install()
    prompts = _prompts([9, 50, 17, 70, 3], seed=4)
    want = _generate(hf, REFERENCE, prompts, 16, max_batch_tokens=48)
    got = _generate(hf, name, prompts, 16, cuda_graphs=warmup, max_batch_tokens=48)
    assert stats["captures"] > 0 and stats["replays"] > 0
    assert got == want
