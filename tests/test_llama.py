"""The Llama decoder of cupaged.serving.llama on the CPU: its logits over packed, chunked batches
(dense reference attention) equal transformers' LlamaForCausalLM with the same weights;
presets, Hugging Face parameter names, seeds. Needs torch and transformers (skipped
without them)."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cupaged.serving.llama import DenseAttention, Llama, LlamaConfig, dense_attention, to_hf  # noqa: E402

TINY = LlamaConfig.preset("tiny")


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny matrices: one thread is fastest, and spares a busy machine's other cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(got, ref) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_packed_chunked_batches_match_transformers(tied):
    """Three sequences packed into flat batches over three forward calls: a prefill
    chunk, a whole prompt and a short chunk; then the rest of two of them beside a
    decode; then decodes. Every row's logits equal transformers' over the whole sequence
    at that position, to float32 rounding."""
    config = dataclasses.replace(TINY, tie_word_embeddings=tied)
    model = Llama(config, seed=7)
    hf = to_hf(model)
    gen = torch.Generator().manual_seed(1)
    seqs = {s: torch.randint(0, config.vocab_size, (n,), generator=gen)
            for s, n in (("a", 21), ("b", 13), ("c", 9))}
    steps = [[("a", 0, 8), ("b", 0, 12), ("c", 0, 3)],
             [("a", 8, 20), ("b", 12, 13), ("c", 3, 8)],
             [("a", 20, 21), ("c", 8, 9)]]
    attention = DenseAttention()
    got = {s: [] for s in seqs}
    for step in steps:
        tokens = torch.cat([seqs[s][a:b] for s, a, b in step])
        positions = torch.cat([torch.arange(a, b) for _, a, b in step])
        attention.begin([s for s, _, _ in step], [b - a for _, a, b in step])
        logits = model.forward(tokens, positions, attention)
        assert logits.shape == (len(tokens), config.vocab_size) and logits.dtype == torch.float32
        for (s, a, b), rows in zip(step, logits.split([b - a for _, a, b in step])):
            got[s].append(rows)
    with torch.no_grad():
        for s, ids in seqs.items():
            ref = hf(ids[None]).logits[0]
            mine = torch.cat(got[s])
            assert rel_err(mine, ref) < 1e-5, s
            assert ((mine - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 1e-5, s
            assert attention.context_len(s) == len(ids)


def test_logits_rows_select_rows():
    model = Llama(TINY, seed=2)
    tokens = torch.randint(0, TINY.vocab_size, (11,), generator=torch.Generator().manual_seed(0))

    def run(rows):
        attention = DenseAttention()
        attention.begin(["x", "y"], [6, 5])
        positions = torch.cat([torch.arange(6), torch.arange(5)])
        return model.forward(tokens, positions, attention, rows)

    everything = run(None)
    rows = torch.tensor([5, 10])
    assert torch.allclose(run(rows), everything[rows], rtol=1e-6, atol=1e-6)


def test_dense_attention_is_causal_bottom_right():
    """The last n of L positions: query i sees keys up to L - n + i, GQA by groups."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=gen)
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    out = dense_attention(q, k, v)
    for i in range(3):
        for h in range(4):
            keys, values = k[: 3 + i, h // 2], v[: 3 + i, h // 2]
            p = torch.softmax(keys @ q[i, h] / 8 ** 0.5, dim=0)
            assert torch.allclose(out[i, h], p @ values, atol=1e-6)


def test_dense_attention_fork_and_free():
    attention = DenseAttention()
    k = torch.randn(4, 2, 8)
    attention.begin(["p"], [4])
    attention(0, torch.randn(4, 4, 8), k, k)
    attention.fork("p", "c")
    assert attention.context_len("c") == 4
    attention.free("p")
    assert attention.context_len("p") == 0 and attention.context_len("c") == 4
    with pytest.raises(ValueError, match="rows"):
        attention(0, torch.randn(3, 4, 8), k[:3], k[:3])


def test_hf_names_and_shapes():
    """state_dict_hf has exactly transformers' keys and shapes, as views of the model's
    own tensors (the tied head is the embedding)."""
    for config in (TINY, dataclasses.replace(TINY, tie_word_embeddings=True)):
        model = Llama(config)
        ours = model.state_dict_hf()
        theirs = to_hf(model).state_dict()
        assert {k: tuple(v.shape) for k, v in ours.items()} == \
            {k: tuple(v.shape) for k, v in theirs.items()}
        q = ours["model.layers.1.self_attn.q_proj.weight"]
        assert q.data_ptr() == model.layers[1].qkv.data_ptr()
        tied = ours["lm_head.weight"].data_ptr() == ours["model.embed_tokens.weight"].data_ptr()
        assert tied == config.tie_word_embeddings


def test_weights_come_from_the_seed():
    a, b, c = Llama(TINY, seed=5), Llama(TINY, seed=5), Llama(TINY, seed=6)
    for (name, x), y, z in zip(a.state_dict_hf().items(), b.state_dict_hf().values(),
                               c.state_dict_hf().values()):
        assert torch.equal(x, y), name
        if "norm" not in name:
            assert not torch.equal(x, z), name
            assert 0.015 < float(x.float().std()) < 0.025, name
        else:
            assert bool((x == 1).all()), name
    half = Llama(TINY, dtype=torch.bfloat16, seed=5)
    assert half.embed.dtype == torch.bfloat16 and half.dtype == torch.bfloat16


def test_presets():
    """The presets have the published models' parameter counts."""
    assert LlamaConfig.preset("llama-3.2-1b").num_parameters == 1_235_814_400
    assert LlamaConfig.preset("llama-3-8b").num_parameters == 8_030_261_248
    assert LlamaConfig.preset("tiny").num_layers == 2
    with pytest.raises(ValueError, match="unknown preset"):
        LlamaConfig.preset("llama-4")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        dataclasses.replace(TINY, num_kv_heads=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.num_layers = 3
