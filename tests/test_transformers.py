"""cupaged.integrations.transformers. On the CPU: the version and name checks, the block
tables read off transformers' slot lists, the step memo, and generate_batch through host
stand-ins for the two kernels (chunked prefill, padded steps, CUDA-graph capture and replay
emulated). On the GPU: generate_batch with paged|cupaged gives paged|sdpa's greedy tokens,
with and without CUDA graphs, and its bfloat16 logits stay within the engine's stated
tolerance. Skipped where torch or transformers does not import."""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cupaged.integrations import transformers as cupaged_tf  # noqa: E402
from cupaged.serving.llama import Llama, LlamaConfig, to_hf  # noqa: E402

SUPPORTED = ".".join(transformers.__version__.split(".")[:2]) in cupaged_tf.SUPPORTED_VERSIONS


@pytest.mark.parametrize("version", ["5.15.0", "5.18.0", "5.23.0", "6.0.0"])
def test_unsupported_releases_are_refused(monkeypatch, version):
    # The module register() imports now (another test may have imported it anew).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    with pytest.raises(RuntimeError, match=f"transformers {version} differs"):
        cupaged_tf.register()


@pytest.mark.skipif(not SUPPORTED, reason="this transformers release is not supported")
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
    (dict(block_size=12), ValueError, "powers of two"),
    (dict(cache=None), ValueError, "runs under continuous batching"),
])
def test_what_the_implementation_refuses(extra, error, match):
    block_size = extra.pop("block_size", 16)
    args, kw = _fake_call(block_size)
    kw.update(extra)
    with pytest.raises(error, match=match):
        cupaged_tf.paged_attention_forward(*args, **kw)


def test_sliding_window_layers_are_refused():
    args, kw = _fake_call()
    kw["cache"].sliding_windows[0] = 4096
    with pytest.raises(NotImplementedError, match="layer 0 has a sliding window"):
        cupaged_tf.paged_attention_forward(*args, **kw)


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


# ---- GPU ---------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_release = pytest.mark.skipif(not SUPPORTED, reason="this transformers release is not "
                                   "supported")


def _model(dtype, seed=0):
    model = Llama(LlamaConfig.preset("tiny"), device="cuda", dtype=dtype, seed=seed)
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
    cb = ContinuousBatchingConfig(block_size=block_size, num_blocks=64,
                                  max_batch_tokens=max_batch_tokens,
                                  use_cuda_graph=cuda_graphs)
    out = hf.generate_batch(prompts, generation_config=config, continuous_batching_config=cb,
                            warmup=cuda_graphs)
    assert len(out) == len(prompts)  # in the prompts' order
    errors = [r.error for r in out.values() if r.error is not None]
    assert not errors, errors[0]  # generate_batch logs a request's failure and goes on
    return [r.generated_tokens for r in out.values()]


@gpu
@needs_release
@pytest.mark.parametrize("block_size", [16, 32])
def test_generate_batch_gives_paged_sdpa_tokens(block_size):
    """float32: the same greedy tokens as transformers' own paged|sdpa, prompts within
    one block and over several, generated past block boundaries."""
    _, hf = _model(torch.float32)
    name = cupaged_tf.register()
    prompts = _prompts([5, 37, 64, 100, 1], seed=3)
    want = _generate(hf, "paged|sdpa", prompts, 24, block_size, max_batch_tokens=48)
    got = _generate(hf, name, prompts, 24, block_size, max_batch_tokens=48)
    assert [len(t) for t in got] == [24] * len(prompts)
    assert got == want


@gpu
@needs_release
def test_generate_batch_with_cuda_graphs_gives_paged_sdpa_tokens():
    _, hf = _model(torch.float32, seed=2)
    name = cupaged_tf.register()
    prompts = _prompts([9, 50, 17], seed=4)
    want = _generate(hf, "paged|sdpa", prompts, 16)
    assert _generate(hf, name, prompts, 16, cuda_graphs=True) == want


@gpu
@needs_release
def test_bfloat16_logits_within_the_stated_tolerance():
    """The engine's stated bf16 tolerance (docs/API.md): with bfloat16 weights, the logits
    of each generated position deviate from the float32 model's (the same bf16-rounded
    weights) by at most 1.25x what transformers' own paged|sdpa in bfloat16 deviates, in
    the largest deviation and in the median of the rows' largest deviations."""
    model, hf16 = _model(torch.bfloat16, seed=1)
    hf32 = to_hf(model).float()
    name = cupaged_tf.register()
    prompts = _prompts([37, 64, 100], seed=7)
    errors = {}
    for implementation in ("paged|sdpa", name):
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
    ours, theirs = errors[name], errors["paged|sdpa"]
    assert ours.max() <= 1.25 * theirs.max(), (ours.max(), theirs.max())
    assert ours.median() <= 1.25 * theirs.median(), (ours.median(), theirs.median())


def _host_kernels(monkeypatch, calls):
    """cupaged.reshape_and_cache_flash and cupaged.attention in torch on the host, over
    NHD blocks and block tables (what the kernels read), for the CPU run below."""
    import cupaged.cache_ops
    from cupaged.serving.llama import dense_attention

    def write(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs):
        assert key.shape[1:] == key_cache.shape[2:] and slot_mapping.dtype == torch.int64
        for src, dst in ((key, key_cache), (value, value_cache)):
            dst.view(-1, *dst.shape[2:])[slot_mapping] = src
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
            slots = tables[s].long()[pos // bs] * bs + pos % bs
            rows = slice(int(qsl[s]), int(qsl[s + 1]))
            out[rows] = dense_attention(q[rows], kc.view(-1, *kc.shape[2:])[slots],
                                        vc.view(-1, *vc.shape[2:])[slots])
        calls["attention"] += 1
        return out

    monkeypatch.setattr(cupaged.cache_ops, "reshape_and_cache_flash", write)
    monkeypatch.setattr(sys.modules["cupaged.attention"], "attention", attend)


@needs_release
@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_generate_batch_on_host_gives_paged_sdpa_tokens(monkeypatch, block_size):
    """The integration's reading of transformers' cache and keywords, on the CPU: with the
    two kernels done in torch over the block tables it derives, generate_batch gives
    paged|sdpa's greedy tokens (float32, prompts over several blocks)."""
    from collections import Counter

    pytest.importorskip("psutil")  # transformers sizes its cache on the CPU through it
    model = Llama(LlamaConfig.preset("tiny"), device="cpu", dtype=torch.float32, seed=0)
    hf = to_hf(model, share_weights=True)
    calls = Counter()
    _host_kernels(monkeypatch, calls)
    tables = cupaged_tf.block_tables

    def counted(*args):
        calls["tables"] += 1
        return tables(*args)

    monkeypatch.setattr(cupaged_tf, "block_tables", counted)
    name = cupaged_tf.register()
    prompts = _prompts([5, 37, 64, 100, 1], seed=3)
    # 48 tokens a step: prompts in chunks, later chunks reading the earlier ones' cache.
    want = _generate(hf, "paged|sdpa", prompts, 10, block_size, max_batch_tokens=48)
    got = _generate(hf, name, prompts, 10, block_size, max_batch_tokens=48)
    assert calls["attention"] > 0 and calls["write"] == calls["attention"]
    # One block table a step, shared by the model's layers.
    assert calls["tables"] * model.config.num_layers == calls["attention"]
    assert got == want


@needs_release
def test_padded_steps_and_shared_prefixes_on_host(monkeypatch):
    """Steps padded as transformers pads them for its CUDA graphs (query rows past
    cu_seq_lens_q[-1], sequences of length 0, trash slots in the slot lists) and prompts
    with a common prefix (whose blocks transformers may share): paged|sdpa's tokens, with
    padded rows seen."""
    from collections import Counter

    from transformers.generation.continuous_batching import model_runner

    pytest.importorskip("psutil")
    init = model_runner.ModelRunner.__init__

    def padded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pad_inputs = True

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padded)
    model = Llama(LlamaConfig.preset("tiny"), device="cpu", dtype=torch.float32, seed=0)
    hf = to_hf(model, share_weights=True)
    calls = Counter()
    _host_kernels(monkeypatch, calls)
    name = cupaged_tf.register()
    seen = Counter()

    def spy(module, query, *args, **kwargs):
        seen["padded"] += int(kwargs["cu_seq_lens_q"][-1]) < query.shape[2]
        return cupaged_tf.paged_attention_forward(module, query, *args, **kwargs)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, name, spy)
    base = _prompts([40], seed=9)[0]
    prompts = _prompts([5, 37, 64], seed=3) + [base + [7, 8, 9], base + [1, 2], base]
    want = _generate(hf, "paged|sdpa", prompts, 8, 16, max_batch_tokens=48)
    got = _generate(hf, name, prompts, 8, 16, max_batch_tokens=48)
    assert seen["padded"] > 0 and calls["attention"] > 0
    assert got == want


@needs_release
@pytest.mark.parametrize("warmup", [False, True])
def test_cuda_graph_capture_and_replay_emulated_on_host(monkeypatch, warmup):
    """transformers' CUDA-graph path on the CPU: its compute_batch with the capture and
    replay emulated (a new graph key runs the forward twice over the same batch tensors,
    a warm-up pass then the "capture"; a replay reruns the captured pass after the tensors
    were refilled in place; with ``warmup``, generate_batch's warm-up captures on the
    calling thread and the generation loop replays). The capture must derive the block
    tables it attends with, as a real capture records only what runs inside it; the
    tokens are paged|sdpa's."""
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
    model = Llama(LlamaConfig.preset("tiny"), device="cpu", dtype=torch.float32, seed=2)
    hf = to_hf(model, share_weights=True)
    name = cupaged_tf.register()
    prompts = _prompts([9, 50, 17, 70, 3], seed=4)
    want = _generate(hf, "paged|sdpa", prompts, 16, max_batch_tokens=48)
    got = _generate(hf, name, prompts, 16, cuda_graphs=warmup, max_batch_tokens=48)
    assert stats["captures"] > 0 and stats["replays"] > 0
    assert got == want
