"""torch.ops.cupaged.*: registration without importing torch, schemas that declare what
each op writes, tracing under torch.compile with no graph break (on the CPU, through the
fake implementations), and on the GPU: torch.library.opcheck for every op, each op's
result equal to its Python function's, and a compiled decode step captured in a CUDA
graph. Skipped where torch does not import."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupaged  # noqa: E402
from cupaged import reference, testing  # noqa: E402
from cupaged.integrations import torch_ops  # noqa: E402

from conftest import assert_close  # noqa: E402
from test_mla import RANK, ROPE, SCALE, make_mla  # noqa: E402
from test_varlen import make_varlen  # noqa: E402

# What each op's schema declares written: the arguments it may change, nothing else.
WRITES = {
    "attention": {"out", "lse"},
    "mla_attention": {"out", "lse"},
    "paged_attention_v1": {"out"},
    "paged_attention_v2": {"out", "exp_sums", "max_logits", "tmp_out"},
    "reshape_and_cache": {"key_cache", "value_cache"},
    "reshape_and_cache_flash": {"key_cache", "value_cache"},
    "concat_and_cache_mla": {"kv_cache", "k_pe_cache"},
    "copy_blocks": {"key_caches", "value_caches"},
    "copy_blocks_mla": {"kv_caches"},
    "swap_blocks": {"dst"},
    "merge_state": {"out", "lse_out"},
    "merge_states": {"out", "lse_out"},
}


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_import_cupaged_does_not_import_torch():
    assert _run("import sys, cupaged; print('torch' in sys.modules)") == "False"


def test_torch_imported_first_registers_the_ops():
    code = ("import torch, cupaged; "
            "print(sorted(n for n in dir(torch.ops.cupaged) if not n.startswith('_')))")
    got = _run(code)
    for name in WRITES:
        assert f"'{name}'" in got


def test_every_op_is_registered_and_listed():
    assert sorted(op._qualname.split("::")[1] for op in torch_ops.OPS) == sorted(WRITES)


def test_the_docs_name_exactly_the_registered_ops():
    """docs/API.md's op table names the ops OPS registers, no more, and the README's
    custom-ops paragraph names each of them."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    table = (root / "docs" / "API.md").read_text().split("| op | writes |", 1)[1]
    names, last = set(), ""
    for line in table.split("\n\n", 1)[0].splitlines()[2:]:
        for n in re.findall(r"`(\w+)`", line.split("|")[1]):
            last = last.rsplit("_", 1)[0] + n if n.startswith("_") else n  # `_v2`
            names.add(last)
    assert names == set(WRITES)
    readme = (root / "README.md").read_text()
    ops = readme.split("**PyTorch custom ops.**", 1)[1].split("\n- ", 1)[0]
    assert "twelve" in ops and all(f"`{n}`" in ops for n in WRITES)


@pytest.mark.parametrize("name", sorted(WRITES))
def test_schema_declares_exactly_the_written_arguments(name):
    schema = getattr(torch.ops.cupaged, name).default._schema
    written = {a.name for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
    assert written == WRITES[name], str(schema)
    assert not schema.returns, str(schema)  # results land in the written arguments


def test_per_tensor_scales_only():
    t = torch.ones(4)
    with pytest.raises(ValueError, match="k_scale: the cupaged op takes a per-tensor scale"):
        torch_ops._per_tensor(t, "k_scale")
    assert torch_ops._per_tensor(torch.ones(()), "k_scale") is not None
    with pytest.raises(ValueError, match="per-tensor scale"):  # read as a per-token array
        torch_ops._per_tensor(torch.ones(1, 1, 1), "k_scale")


class _Traced(Exception):
    """Raised in place of running a traced graph: tracing is what the CPU test checks."""


def _decode_layer(hidden, wqkv, wo, kc, vc, slots, bt, seq_lens, heads: int, kv_heads: int,
                  head_size: int):
    """A decode layer: projections, the cache write, attention, a merge with a second
    partial (a cascade's shared prefix, say) and the output projection."""
    qkv = hidden @ wqkv
    q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    q = q.view(-1, heads, head_size)
    k, v = k.view(-1, kv_heads, head_size), v.view(-1, kv_heads, head_size)
    torch.ops.cupaged.reshape_and_cache_flash(k, v, kc, vc, slots)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    torch.ops.cupaged.attention(q, kc, vc, bt, seq_lens, None, out, lse, max_query_len=1)
    merged = torch.empty_like(out)
    torch.ops.cupaged.merge_state(out, lse, q, lse - 1.0, merged, None)
    return merged.flatten(1) @ wo


def _layer_inputs(device, dtype=torch.float16, batch=3, heads=4, kv_heads=2, head_size=64,
                  block_size=16, num_blocks=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden_size = heads * head_size
    r = lambda *s: (torch.randn(*s, generator=g) / math.sqrt(s[0])).to(device, dtype)  # noqa: E731
    wqkv = r(hidden_size, (heads + 2 * kv_heads) * head_size)
    wo = r(hidden_size, hidden_size)
    kc = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=g).to(device, dtype)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=g).to(device, dtype)
    bt = torch.randperm(num_blocks, generator=g)[:batch * 4].view(batch, 4).to(device, torch.int32)
    seq_lens = torch.tensor([5, 17, 40][:batch], dtype=torch.int32, device=device)
    pos = seq_lens.long() - 1
    slots = (bt.long().gather(1, (pos // block_size)[:, None])[:, 0] * block_size
             + pos % block_size)
    hidden = torch.randn(batch, hidden_size, generator=g).to(device, dtype)
    return (hidden, wqkv, wo, kc, vc, slots, bt, seq_lens), dict(heads=heads, kv_heads=kv_heads,
                                                               head_size=head_size)


def test_a_model_traces_under_compile_with_no_graph_break():
    """fullgraph=True fails on a graph break; the functionalized graph (fake tensors
    through the fake implementations) keeps every op, its writes made explicit."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise _Traced

        return run

    args, kw = _layer_inputs("cpu")
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: _decode_layer(*a, **kw), fullgraph=True,
                       backend=aot_autograd(fw_compiler=record))
    with pytest.raises(_Traced):
        fn(*args)
    assert len(graphs) == 1
    code = graphs[0].code
    for name in ("reshape_and_cache_flash", "attention", "merge_state"):
        assert f"cupaged.{name}" in code, code


# ---- GPU ---------------------------------------------------------------------------------------


def _cuda(a, pin=False):
    a = np.ascontiguousarray(a)
    if a.dtype == np.dtype("bfloat16"):
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(a).cuda()


def _nan_like(t):
    return torch.full_like(t, float("nan"))


def _cases(rng) -> dict:
    """Each op's arguments (a list) and keywords, with random data, fresh outputs poisoned."""
    c = {}
    h = make_varlen(rng, [3, 1, 0, 17], [10, 40, 5, 17], dtype="bf16", heads=8, kv_heads=2,
                    head_size=128, block_size=16)
    d = {k: _cuda(v) for k, v in h.items() if v is not None}
    q = d["query"]
    c["attention"] = ([q, d["key_cache"], d["value_cache"], d["block_tables"], d["seq_lens"],
                       d["query_start_loc"], _nan_like(q),
                       torch.full(q.shape[:2], float("nan"), device="cuda")],
                      dict(scale=0.1, max_query_len=17))

    m = {k: _cuda(v) for k, v in make_mla(rng, [1, 2, 0, 5], [7, 70, 3, 5], heads=16,
                                          block_size=64).items()}
    mo = torch.full((m["q"].shape[0], 16, RANK), float("nan"), dtype=m["q"].dtype, device="cuda")
    c["mla_attention"] = ([m["q"][..., :RANK], m["kv_cache"], m["block_tables"], m["seq_lens"],
                           m["query_start_loc"], mo,
                           torch.full(mo.shape[:2], float("nan"), device="cuda"), float(SCALE)],
                          dict(q_pe=m["q"][..., RANK:]))

    hv = make_varlen(rng, [1, 1, 1], [1, 300, 33], layout="vllm", dtype="f16", heads=8,
                     kv_heads=2, head_size=64, block_size=16)
    v = {k: _cuda(x) for k, x in hv.items() if x is not None}
    one = torch.ones((), device="cuda")
    common = [v["query"], v["key_cache"], v["value_cache"], 2, 0.125, v["block_tables"],
              v["seq_lens"], 16, 300, None, "auto", one, one]
    c["paged_attention_v1"] = ([_nan_like(v["query"])] + common, {})
    parts = 3
    sums = torch.full((3, 8, parts), float("nan"), device="cuda")
    c["paged_attention_v2"] = ([_nan_like(v["query"]), sums, sums.clone(),
                                torch.full((3, 8, parts, 64), float("nan"), device="cuda")]
                               + common, {})

    kv, hs, bs, nb = 2, 64, 16, 12
    key = _cuda(testing.random_normal((5, kv, hs), np.float16, rng))
    val = _cuda(testing.random_normal((5, kv, hs), np.float16, rng))
    slots = torch.tensor([3, 17, -1, 40, 191], device="cuda")
    kc, vc = (_cuda(x) for x in testing.random_cache(nb, kv, hs, bs, np.float16, rng))
    c["reshape_and_cache"] = ([key, val, kc, vc, slots, "auto", one, one], {})
    flash = [_cuda(testing.random_normal((nb, bs, kv, hs), np.float16, rng)) for _ in "kv"]
    c["reshape_and_cache_flash"] = ([key, val, *flash, slots], {})

    lat = _cuda(testing.random_normal((nb, bs, RANK + ROPE), np.float16, rng))
    c["concat_and_cache_mla"] = ([_cuda(testing.random_normal((5, RANK), np.float16, rng)),
                                  _cuda(testing.random_normal((5, ROPE), np.float16, rng)),
                                  lat, slots, "auto", None, None], {})
    pairs = torch.tensor([[0, 5], [7, 2], [3, 3]], device="cuda")
    c["copy_blocks"] = ([[kc.clone(), kc.clone()], [vc.clone(), vc.clone()], pairs], {})
    c["copy_blocks_mla"] = ([[lat.clone(), lat.clone()], pairs], {})
    host = torch.zeros(vc.shape, dtype=vc.dtype, pin_memory=True)
    c["swap_blocks"] = ([vc, host, torch.tensor([[1, 4], [9, 0]])], {})

    rows, heads = 7, 4
    outs = _cuda(testing.random_normal((3, rows, heads, hs), np.float16, rng))
    lses = _cuda(rng.normal(size=(3, rows, heads)).astype(np.float32))
    lses[1, 2] = float("-inf")  # a partial that saw no key
    lse_out = torch.full((rows, heads), float("nan"), device="cuda")
    c["merge_state"] = ([outs[0], lses[0], outs[1], lses[1], _nan_like(outs[0]), lse_out], {})
    c["merge_states"] = ([outs, lses, _nan_like(outs[0]), lse_out.clone()], {})
    return c


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone().pin_memory() if x.is_pinned() else x.clone()
    if isinstance(x, list):
        return [_clone(y) for y in x]
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(WRITES))
def test_opcheck(rng, name):
    args, kw = _cases(rng)[name]
    torch.library.opcheck(getattr(torch.ops.cupaged, name).default, args, kw)


def _written(name, args, kw) -> list:
    op = getattr(torch.ops.cupaged, name).default
    names = [a.name for a in op._schema.arguments]
    got = []
    for n in sorted(WRITES[name]):
        x = kw.get(n, args[names.index(n)] if names.index(n) < len(args) else None)
        if x is not None:
            got.extend(x if isinstance(x, list) else [x])
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(WRITES))
def test_op_writes_what_its_python_function_writes(rng, name):
    """Bit for bit: the op forwards every argument to the same kernels."""
    args, kw = _cases(rng)[name]
    a2, k2 = _clone(args), _clone(kw)
    getattr(torch.ops.cupaged, name)(*args, **kw)
    if name == "attention":
        names = [a.name for a in torch.ops.cupaged.attention.default._schema.arguments]
        call = dict(zip(names, a2), **k2)
        cupaged.attention(*a2[:6], out=call["out"], lse=call["lse"], scale=call["scale"],
                          max_query_len=call["max_query_len"])
    elif name == "mla_attention":
        q, cache, bt, lens, qsl, out, lse, scale = a2
        cupaged.mla_attention((q, k2["q_pe"]), cache, bt, lens, qsl, scale=scale, out=out,
                              lse=lse)
    elif name in ("merge_state", "merge_states"):
        *ins, out, lse_out = a2
        getattr(cupaged, name)(*ins, out=out, lse_out=lse_out)
    elif name == "concat_and_cache_mla":
        cupaged.concat_and_cache_mla(*a2[:6], k_pe_cache=a2[6])
    else:
        getattr(cupaged, name)(*a2, **k2)
    torch.cuda.synchronize()
    for got, want in zip(_written(name, args, kw), _written(name, a2, k2)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.gpu
def test_attention_op_matches_the_reference(rng):
    h = make_varlen(rng, [3, 1, 0, 17], [10, 40, 5, 17], dtype="bf16", heads=8, kv_heads=2,
                    head_size=128, block_size=16)
    d = {k: _cuda(v) for k, v in h.items() if v is not None}
    out = _nan_like(d["query"])
    lse = torch.full(out.shape[:2], float("nan"), device="cuda")
    torch.ops.cupaged.attention(d["query"], d["key_cache"], d["value_cache"], d["block_tables"],
                                d["seq_lens"], d["query_start_loc"], out, lse, scale=0.1)
    ref, ref_lse = reference.attention(**h, scale=0.1, return_lse=True)
    assert_close(out.float().cpu().numpy(), ref, testing.TOLERANCE["bf16"])
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_compiled_decode_step_has_no_graph_break_and_captures_in_a_cuda_graph():
    """The decode layer through inductor with fullgraph=True equals the eager layer, writes
    the cache as eager does, and replays in a CUDA graph with new inputs."""
    torch._dynamo.reset()
    args, kw = _layer_inputs("cuda", seed=1)
    step = lambda *a: _decode_layer(*a, **kw)  # noqa: E731
    compiled = torch.compile(step, fullgraph=True)

    def both(inputs):
        eager_in, comp_in = _clone(list(inputs)), _clone(list(inputs))
        want = step(*eager_in)
        got = compiled(*comp_in)
        torch.cuda.synchronize()
        return got, want, comp_in, eager_in

    got, want, comp_in, eager_in = both(args)
    assert_close(got.float().cpu().numpy(), want.double().cpu().numpy(), 2e-3)
    for i in (3, 4):  # the caches, new tokens written
        assert torch.equal(comp_in[i], eager_in[i])

    # Capture the compiled step, then replay it over new hidden states and positions.
    static = _clone(list(args))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            compiled(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = compiled(*static)
    new_args, _ = _layer_inputs("cuda", seed=2)
    for i in (0, 3, 4, 5, 6, 7):  # hidden, caches, slots, tables, lengths; same weights
        static[i].copy_(new_args[i])
    eager_in = _clone(static)
    graph.replay()
    want = step(*eager_in)
    torch.cuda.synchronize()
    assert_close(static_out.float().cpu().numpy(), want.double().cpu().numpy(), 2e-3)
    assert torch.equal(static[3], eager_in[3]) and torch.equal(static[4], eager_in[4])
