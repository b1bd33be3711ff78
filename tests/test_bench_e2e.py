"""cupaged-bench e2e (cupaged.bench.e2e).

Without a GPU: the workload's checks, the requests and arrivals (deterministic from the
seed), the statistics from synthetic outputs, the KV budget arithmetic, the table and
the writers, and the CLI with the run faked. With torch (and transformers) on the CPU:
the concat backend's attention against the dense reference, the concat system's
admission under its budget, and the concat, hf and cupaged systems (the last over the
host stand-in of the kernels from test_engine) serving the tiny model to the same greedy
tokens. On a GPU (marked gpu): the command end to end on the tiny preset, and cupaged's,
concat's and hf's tokens equal in float32.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from cupaged.bench import e2e as bench_e2e
from cupaged.bench.e2e import SystemResult, Workload
from cupaged.bench.cli import main
from cupaged.serving.engine import Completion, Request, RequestOutput
from conftest import HAVE_GPU

TINY = dict(preset="tiny", dtype="float32", num_requests=6, prompt_len=(5, 40), output_len=7,
            shared_prefix=3, max_batched_tokens=64, max_running=4, breakdown=False)


@pytest.fixture
def one_thread():
    # Tiny matrices: one thread is fastest, and spares a busy machine's other cores.
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(threads)


# ---- the workload, requests and arrivals ----------------------------------------------------------


@pytest.mark.parametrize("change, msg", [
    (dict(prompt_len=(9, 5)), "1 <= MIN <= MAX"),
    (dict(prompt_len=(0, 5)), "1 <= MIN <= MAX"),
    (dict(shared_prefix=128), "--shared-prefix (128) must be less than the shortest prompt"),
    (dict(output_len=0), "--output-len"),
    (dict(num_requests=0), "--num-requests"),
    (dict(max_running=300), "--max-running <= --max-batched-tokens"),
    (dict(kv_cache_dtype="fp8", dtype="float32"), "float16 or bfloat16 model"),
    (dict(kv_cache_dtype="int8"), "--kv-cache-dtype must be one of"),
    (dict(request_rate=0.0), "--request-rate must be positive"),
    (dict(memory_fraction=1.5), "--memory-fraction"),
    (dict(block_size=24), "power of two"),
    (dict(kv_layout="nhd"), "--kv-layout"),
    (dict(preset="gpt-5"), "--preset"),
    (dict(hf_batch=0), "--hf-batch"),
])
def test_workload_refuses_bad_options(change, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        Workload(**{**dict(max_batched_tokens=256), **change})


def test_requests_come_from_the_seed():
    w = Workload(num_requests=50, prompt_len=(20, 90), output_len=9, shared_prefix=12, seed=3)
    a, b = bench_e2e.make_requests(w, 1000), bench_e2e.make_requests(w, 1000)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.id for r in a] == list(range(50)) and all(r.max_new_tokens == 9 for r in a)
    lens = [len(r.prompt) for r in a]
    assert min(lens) >= 20 and max(lens) <= 90 and len(set(lens)) > 10
    assert all(r.prompt[:12] == a[0].prompt[:12] for r in a)  # the shared system prompt
    assert len({tuple(r.prompt[12:16]) for r in a}) == 50  # then each its own
    assert all(0 <= t < 1000 for r in a for t in r.prompt)
    other = bench_e2e.make_requests(dataclasses.replace(w, seed=4), 1000)
    assert [r.prompt for r in other] != [r.prompt for r in a]
    # Arrivals draw from a stream of their own: the prompts do not depend on the rate.
    poisson = bench_e2e.make_requests(dataclasses.replace(w, request_rate=5.0), 1000)
    assert [r.prompt for r in poisson] == [r.prompt for r in a]


def test_arrivals():
    assert np.array_equal(bench_e2e.arrival_offsets(5, math.inf, 0), np.zeros(5))
    a = bench_e2e.arrival_offsets(4000, 20.0, 1)
    assert np.array_equal(a, bench_e2e.arrival_offsets(4000, 20.0, 1))
    assert (np.diff(a) >= 0).all() and a[0] > 0
    assert abs(a[-1] / 4000 - 1 / 20) < 0.1 / 20  # mean gap 1 / rate (4000 draws: within 10%)
    assert not np.array_equal(a, bench_e2e.arrival_offsets(4000, 20.0, 2))


# ---- statistics --------------------------------------------------------------------------------


def _output(i, arrival, first, gap, n, prompt_len=10, cached=0, preemptions=0):
    times = [first + k * gap for k in range(n)]
    c = Completion(list(range(n)), times, "length")
    return RequestOutput(i, prompt_len, arrival, [c], cached, preemptions)


def test_summary_of_synthetic_outputs():
    # TTFT 10, 20, ..., 100 ms; TPOT 1, 2, ..., 10 ms; 5 tokens each.
    outs = [_output(i, 0.0, 0.01 * (i + 1), 0.001 * (i + 1), 5, prompt_len=i, cached=2,
                    preemptions=i % 2) for i in range(10)]
    s = bench_e2e.summarize(outs, seconds=2.0)
    assert s["requests"] == 10 and s["output_tokens"] == 50 and s["prompt_tokens"] == 45
    assert s["output_tokens_per_s"] == 25.0 and s["seconds"] == 2.0
    assert s["ttft_median_ms"] == pytest.approx(55.0) and s["ttft_p90_ms"] == pytest.approx(91.0)
    assert s["tpot_median_ms"] == pytest.approx(5.5) and s["tpot_p90_ms"] == pytest.approx(9.1)
    assert s["preemptions"] == 5 and s["cached_prompt_tokens"] == 20
    assert set(s) <= {f.name for f in dataclasses.fields(SystemResult)}


def test_summary_without_a_second_token_has_no_tpot():
    s = bench_e2e.summarize([_output(0, 1.0, 1.5, 0.0, 1)], seconds=0.5)
    assert s["ttft_median_ms"] == pytest.approx(500.0) and math.isnan(s["tpot_median_ms"])
    assert s["output_tokens_per_s"] == 2.0


# ---- KV budget arithmetic ----------------------------------------------------------------------


def test_kv_budget_arithmetic():
    from types import SimpleNamespace

    # The presets' shapes (cupaged.serving.llama needs torch).
    one_b = SimpleNamespace(num_layers=16, num_kv_heads=8, head_dim=64)
    eight_b = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128)
    assert bench_e2e.kv_bytes_per_token(one_b, 2) == 2 * 16 * 8 * 64 * 2 == 32768
    assert bench_e2e.kv_bytes_per_token(eight_b, 2) == 131072
    assert bench_e2e.kv_bytes_per_token(eight_b, 1) == 65536  # fp8
    assert Workload(dtype="float32").kv_itemsize == 4
    assert Workload(kv_cache_dtype="fp8").kv_itemsize == 1
    blocks = bench_e2e.kv_cache_blocks(10 * 2**30, 0.85, 16, 32768)
    assert blocks == int(10 * 2**30 * 0.85) // (16 * 32768) == 17408
    # The paged cache's bytes are the budget; a contiguous request reserves its prompt and
    # every token it may generate.
    assert bench_e2e.contiguous_reservation(1000, 128) == 1128
    budget = blocks * 16 * 32768
    assert bench_e2e.hf_batch_size(budget, 32768, 1024, 128, 10_000) == budget // (32768 * 1152)
    assert bench_e2e.hf_batch_size(budget, 32768, 1024, 128, 64) == 64
    assert bench_e2e.hf_batch_size(1000, 32768, 1024, 128, 64) == 1  # never below one


def test_concat_admission_reserves_prompt_plus_output(one_thread):
    """A budget of 3 requests' reservations: never more running, the budget never
    exceeded, and every request still finishes with its tokens; a request that could
    never fit is refused."""
    from cupaged.serving.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig.preset("tiny"), seed=0)
    prompts = [[7] * 10, [8] * 12, [9] * 9, [10] * 11, [11] * 10]
    budget = 3 * (12 + 5)
    engine = bench_e2e.ConcatEngine(model, budget_tokens=budget, max_batched_tokens=64,
                                    max_running=8)
    outs = [engine.submit(Request(i, p, 5)) for i, p in enumerate(prompts)]
    seen = []
    while engine.has_unfinished():
        engine.step()
        seen.append((len(engine.running), engine.reserved_tokens))
        assert engine.reserved_tokens <= budget
    assert max(n for n, _ in seen) == 3 and seen[-1] == (0, 0)
    assert all(len(o.token_ids) == 5 and o.finished for o in outs)
    # At most 3 requests' tokens were ever held: prompts plus all but the last token.
    assert engine.peak_tokens <= 12 + 11 + 10 + 3 * 4
    with pytest.raises(ValueError, match="can never fit"):
        engine.submit(Request("big", [1] * budget, 1))


def test_concat_prompt_budget_per_step(one_thread):
    """Whole prompts only: a step admits prompts while they fit beside its decodes; a
    prompt longer than max_batched_tokens goes alone as a step's first admission."""
    from cupaged.serving.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig.preset("tiny"), seed=0)
    engine = bench_e2e.ConcatEngine(model, budget_tokens=10_000, max_batched_tokens=16,
                                    max_running=4)
    for i, n in enumerate([6, 6, 6, 30]):
        engine.submit(Request(i, [3] * n, 5))
    engine.step()
    assert [s.request.id for s in engine.running] == [0, 1]  # 12 tokens; a third needs 18
    engine.step()
    assert [s.request.id for s in engine.running] == [0, 1, 2]  # 2 decodes + 6 = 8 <= 16
    engine.step()
    assert [s.request.id for s in engine.running] == [0, 1, 2, 3]  # 30 tokens, first admitted
    while engine.has_unfinished():
        engine.step()


# ---- the concat backend's attention --------------------------------------------------------------


def test_sdpa_attention_equals_the_dense_reference(one_thread):
    """The same packed batches (three sequences: whole prompts, a chunk after cached
    tokens, decodes, a freed sequence) through SdpaAttention and DenseAttention."""
    torch = one_thread
    from cupaged.serving.llama import DenseAttention, SdpaAttention

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 8, 2, 32
    batches = [(["a", "b"], [7, 1]), (["a", "b", "c"], [1, 5, 9]), (["b", "c"], [1, 1]),
               (["a", "c"], [4, 1]), (["c"], [1])]
    dense, sdpa = DenseAttention(), SdpaAttention()
    for step, (ids, counts) in enumerate(batches):
        if step == 3:
            for att in (dense, sdpa):
                att.free("b")
        t = sum(counts)
        q, k, v = (torch.randn(t, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
        for att in (dense, sdpa):
            att.begin(ids, counts)
        for layer in range(2):
            want, got = dense(layer, q, k, v), sdpa(layer, q, k, v)
            assert got.shape == want.shape == (t, heads, dim)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sdpa.context_len("a") == 12 and sdpa.context_len("c") == 12
    assert sdpa.context_len("b") == 0


def test_sdpa_attention_in_the_model_gives_the_dense_logits(one_thread):
    torch = one_thread
    from cupaged.serving.llama import DenseAttention, Llama, LlamaConfig, SdpaAttention

    model = Llama(LlamaConfig.preset("tiny"), seed=1)
    gen = torch.Generator().manual_seed(2)
    dense, sdpa = DenseAttention(), SdpaAttention()
    for ids, counts, starts in [((0, 1), (9, 4), (0, 0)), ((0, 1), (1, 6), (9, 4))]:
        tokens = torch.randint(0, 512, (sum(counts),), generator=gen)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
        logits = []
        for att in (dense, sdpa):
            att.begin(ids, counts)
            logits.append(model.forward(tokens, positions, att))
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


# ---- the systems on the CPU ------------------------------------------------------------------------


def test_concat_and_hf_serve_the_same_greedy_tokens(one_thread):
    """float32 on the CPU: the concat engine's tokens are generate's over left-padded
    batches, every request gets output_len tokens, and the fields are filled in."""
    pytest.importorskip("transformers")
    harness = bench_e2e.Harness(Workload(**TINY), device="cpu", num_blocks=64)
    concat, concat_out = harness.run("concat")
    hf, hf_out = harness.run("hf")
    for r in (concat, hf):
        assert r.status == "ok", r.note
        assert r.requests == 6 and r.output_tokens == 42 and r.output_tokens_per_s > 0
        assert 0 < r.kv_peak_bytes < r.kv_reserved_peak_bytes <= r.kv_budget_bytes
        assert r.kv_budget_bytes == 64 * 16 * harness.bytes_per_token
        assert r.ttft_median_ms <= r.ttft_p90_ms and r.tpot_median_ms <= r.tpot_p90_ms
    assert [o.token_ids for o in concat_out] == [o.token_ids for o in hf_out]
    assert all(len(o.token_ids) == 7 for o in hf_out)
    assert hf.batch_size == 6 and hf.steps == 7 and concat.steps >= 7
    requests, _ = harness.requests()
    longest = max(len(r.prompt) for r in requests)
    assert hf.kv_peak_bytes == 6 * (longest + 6) * harness.bytes_per_token
    assert hf.kv_reserved_peak_bytes == 6 * (longest + 7) * harness.bytes_per_token
    # concat reserved prompt + output for the (at most 4) requests running at once.
    assert concat.kv_reserved_peak_bytes <= 4 * (40 + 7) * harness.bytes_per_token


def test_hf_batches_halve_on_running_out_of_memory(one_thread, monkeypatch):
    torch = one_thread
    pytest.importorskip("transformers")
    real, sizes = bench_e2e._hf_generate, []

    def generate(hf, prompts, output_len):
        sizes.append(len(prompts))
        if len(prompts) > 2 and output_len > 4:  # the warm-up's 4 requests pass
            raise torch.OutOfMemoryError("fake: CUDA out of memory")
        return real(hf, prompts, output_len)

    monkeypatch.setattr(bench_e2e, "_hf_generate", generate)
    harness = bench_e2e.Harness(Workload(**TINY, hf_batch=5), device="cpu", num_blocks=64)
    result, outputs = harness.run("hf")
    assert result.status == "ok" and result.batch_size == 2
    assert "halved to 2" in result.note
    assert sizes == [4, 5, 2, 2, 2]  # the warm-up, 5 fails, then 2 + 2 + 2
    assert all(len(o.token_ids) == 7 for o in outputs)
    ttft = [o.ttft for o in outputs]
    assert ttft[0] < ttft[2] < ttft[4]  # later batches wait for earlier ones


def test_run_says_what_it_serves_and_runs_each_system(one_thread):
    pytest.importorskip("transformers")
    lines = []
    w = Workload(**{**TINY, "request_rate": 500.0})
    finished = []
    results = bench_e2e.run(w, ["concat", "hf"], echo=lines.append, device="cpu", num_blocks=64,
                            done=lambda so_far: finished.append([r.system for r in so_far]))
    assert [r.system for r in results] == ["concat", "hf"]
    assert finished == [["concat"], ["concat", "hf"]]
    assert all(r.status == "ok" and r.output_tokens == 42 for r in results)
    assert lines[0] == ("tiny (0.00B parameters, float32), random weights (seed 0); 6 requests, "
                        "prompts 5..40 tokens (3 shared), 7 output tokens each, Poisson "
                        "arrivals at 500/s")
    assert lines[1].startswith("KV budget 0.00 GiB (0.85 of the free memory): 64 blocks of 16 "
                               "tokens, HND, kv_cache_dtype auto, prefix caching off")


def test_a_failing_system_is_reported_not_raised(one_thread, monkeypatch):
    harness = bench_e2e.Harness(Workload(**TINY), device="cpu", num_blocks=64)

    def broken(self):
        raise RuntimeError("something broke")

    monkeypatch.setattr(bench_e2e.Harness, "_run_concat", broken)
    result, outputs = harness.run("concat")
    assert (result.status, result.note, outputs) == ("failed", "RuntimeError: something broke", [])
    result, _ = bench_e2e.Harness(Workload(**{**TINY, "dtype": "bfloat16"}, kv_cache_dtype="fp8"),
                                  device="cpu", num_blocks=64).run("hf")
    assert (result.status, result.note) == ("skipped", "hf has no fp8 KV cache path")


def test_cupaged_eager_system_on_host_kernels_matches_concat(one_thread, monkeypatch):
    """The cupaged system's path (Harness, Engine, the recording backend, serve, the
    summary) over the host stand-in for the kernels and the cache: concat's tokens, and
    the peak KV bytes are the blocks in use."""
    pytest.importorskip("transformers")  # test_engine's module needs it for its fixtures
    from test_engine import HostKernels

    kernels = HostKernels(monkeypatch)
    harness = bench_e2e.Harness(Workload(**TINY, block_size=4), device="cpu", num_blocks=64)

    def make_cache():
        cache = kernels.cache(64, 4, False, model_config=harness.config)
        cache._itemsize, cache._scale_row = 4, 0  # for bytes_per_block
        return cache

    monkeypatch.setattr(harness, "make_cache", make_cache)
    paged, paged_out = harness.run("cupaged-eager")  # the graphs need a GPU
    concat, concat_out = harness.run("concat")
    assert paged.status == "ok", paged.note
    assert 1 <= paged.peak_running <= TINY["max_running"]
    assert [o.token_ids for o in paged_out] == [o.token_ids for o in concat_out]
    assert paged.kv_budget_bytes == concat.kv_budget_bytes == 64 * 4 * harness.bytes_per_token
    # The peak is whole blocks in use, claimed as they fill.
    assert 0 < paged.kv_peak_bytes == paged.kv_reserved_peak_bytes <= paged.kv_budget_bytes
    assert paged.kv_peak_bytes % (4 * harness.bytes_per_token) == 0
    assert paged.steps > 7 and math.isnan(paged.attention_fraction)  # breakdown off
    assert kernels.calls["plan.run"] > 0


def test_breakdown_replays_each_forward_on_host_kernels(one_thread, monkeypatch):
    """The profiling pass's bookkeeping, with host stand-ins for the kernels, the CUDA
    events (host clocks) and the GPU busy-wait: each forward runs twice, the replay's
    logits (the tokens) are the timed run's, the busy-wait covers the real forward's
    time, and the three shares add up to 1."""
    torch = one_thread
    pytest.importorskip("transformers")
    from cupaged.bench import peers
    from cupaged.bench import timing
    import contextlib
    import time

    from test_engine import HostKernels



    class Event:  # a host clock standing in for a CUDA event
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    spins = []

    class Spin:
        def __init__(self, us):
            self.ns = 0

        def __call__(self):
            spins.append(int(self.ns))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing, "Spin", Spin)
    monkeypatch.setattr(peers, "torch_on_cupy_stream", contextlib.nullcontext)
    kernels = HostKernels(monkeypatch)
    harness = bench_e2e.Harness(Workload(**{**TINY, "breakdown": True}, block_size=4),
                                device="cpu", num_blocks=64)
    forwards = []
    real_forward = harness.model.forward

    def counting_forward(*args):
        forwards.append(args[0].shape[0])
        return real_forward(*args)

    monkeypatch.setattr(harness.model, "forward", counting_forward)

    def make_cache():
        cache = kernels.cache(64, 4, False, model_config=harness.config)
        cache._itemsize, cache._scale_row = 4, 0
        return cache

    monkeypatch.setattr(harness, "make_cache", make_cache)
    result, outputs = harness.run("cupaged-eager")
    assert result.status == "ok", result.note
    # Warm-up, the timed run, then the profiling pass: the same requests all at once, so
    # the timed run's steps again, each forward twice with the same rows.
    steps = result.steps
    assert len(forwards) > 3 * steps
    profiled = forwards[-2 * steps:]
    assert profiled[0::2] == profiled[1::2] == forwards[-3 * steps:-2 * steps]
    assert len(spins) == steps and min(spins) >= 100_000  # at least 100 us each
    parts = (result.attention_fraction, result.model_fraction, result.host_fraction)
    assert 0 < parts[0] < 1 and 0 < parts[1] < 1 and sum(parts) == pytest.approx(1.0)
    concat, concat_out = harness.run("concat")
    assert [o.token_ids for o in outputs] == [o.token_ids for o in concat_out]


# ---- output --------------------------------------------------------------------------------------


def _results():
    ok = dict(status="ok", requests=64, prompt_tokens=36000, output_tokens=8192, seconds=2.0,
              output_tokens_per_s=4096.0, ttft_median_ms=120.0, ttft_p90_ms=300.0,
              tpot_median_ms=12.5, tpot_p90_ms=20.0, kv_budget_bytes=2**34, kv_peak_bytes=2**31,
              kv_reserved_peak_bytes=2**31)
    return [SystemResult("cupaged", **ok, steps=300, attention_fraction=0.25, model_fraction=0.6,
                         host_fraction=0.15, cached_prompt_tokens=512),
            SystemResult("concat", **{**ok, "output_tokens_per_s": 1024.0,
                                      "kv_reserved_peak_bytes": 2**34}, steps=900),
            SystemResult("hf", **{**ok, "output_tokens_per_s": 512.0}, batch_size=32, steps=256),
            SystemResult("flashinfer", "skipped", "out of GPU memory: fake")]


ENV = {"cupaged": "0.1.0", "gpus": [{"index": 0, "name": "Fake GPU"}], "torch": None}


def test_table_and_breakdown_lines():
    lines = bench_e2e.table_lines(_results())
    assert lines[0].split()[:3] == ["system", "requests", "out"]
    assert lines[1].split()[:10] == ["cupaged", "64", "4096", "120.0", "300.0", "12.50", "20.00",
                                     "2048.0", "2048.0", "12.5%"]
    assert "512 prompt tokens from the prefix cache" in lines[1]
    assert lines[2].split()[7:10] == ["2048.0", "16384.0", "100.0%"]  # concat's reservations
    assert lines[3].endswith("batches of 32")
    assert lines[4] == f"{'flashinfer':13s} SKIPPED: out of GPU memory: fake"
    (b,) = bench_e2e.breakdown_lines(_results())
    assert b.startswith("cupaged step time: attention 25.0% (reshape_and_cache + attention), "
                        "rest of the model 60.0%, host 15.0%")


def test_a_failed_json_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "e.json"
    bench_e2e.write_json(path, Workload(), _results()[:1], ENV)
    before = path.read_text()
    with pytest.raises(TypeError):  # not serializable, even as a string: the write fails
        bench_e2e.write_json(path, Workload(), _results(), {"bad": _Unprintable()})
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["e.json"]


class _Unprintable:
    def __str__(self):
        raise TypeError("no text")


def test_json_csv_and_plot_writers(tmp_path):
    import csv

    w = Workload(shared_prefix=64, prefix_caching=True)
    bench_e2e.write_json(tmp_path / "e.json", w, _results(), ENV)
    assert [p.name for p in tmp_path.iterdir()] == ["e.json"]  # nothing left aside
    doc = json.loads((tmp_path / "e.json").read_text())
    assert doc["environment"] == ENV and doc["workload"]["prompt_len"] == [128, 1024]
    assert doc["workload"]["request_rate"] == math.inf and doc["workload"]["prefix_caching"]
    assert [r["system"] for r in doc["results"]] == ["cupaged", "concat", "hf", "flashinfer"]
    assert all(set(r) == {f.name for f in dataclasses.fields(SystemResult)} for r in doc["results"])
    assert doc["results"][0]["host_fraction"] == 0.15 and doc["results"][2]["batch_size"] == 32
    bench_e2e.write_csv(tmp_path / "e.csv", w, _results(), ENV)
    lines = (tmp_path / "e.csv").read_text().splitlines()
    assert '# cupaged: "0.1.0"' in lines
    table = list(csv.DictReader(l for l in lines if not l.startswith("#")))
    assert [r["system"] for r in table] == ["cupaged", "concat", "hf", "flashinfer"]
    assert table[0]["prompt_len"] == "128 1024" and table[1]["output_tokens_per_s"] == "1024.0"
    assert table[3]["status"] == "skipped" and table[3]["shared_prefix"] == "64"
    pytest.importorskip("matplotlib")
    bench_e2e.write_plot(tmp_path / "e.png", _results(), "synthetic")
    data = (tmp_path / "e.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


# ---- the command, the run faked ----------------------------------------------------------------------


def _fake_run(monkeypatch, missing=(), results=None):
    """e2e as on a GPU with ``missing`` systems not installed; bench_e2e.run records the
    workload and the systems it is asked for and returns ``results`` (default: one ok
    row per system)."""
    from cupaged.bench import report
    from cupaged.bench import cli

    calls = []

    def run(workload, systems, echo, done=None):
        calls.append((workload, list(systems)))
        rows = results
        if rows is None:
            rows = [dataclasses.replace(_results()[0], system=s) for s in systems]
        for i in range(len(rows) if done is not None else 0):
            done(rows[:i + 1])
        return rows

    monkeypatch.setattr(cli, "_gpu_count", lambda: 1)
    monkeypatch.setattr(bench_e2e, "run", run)
    monkeypatch.setattr(bench_e2e, "unavailable",
                        lambda s: f"{s} is not installed here" if s in missing else None)
    monkeypatch.setattr(report, "environment", lambda: ENV)
    return calls


def test_e2e_passes_every_option(monkeypatch, tmp_path):
    calls = _fake_run(monkeypatch)
    argv = ["e2e", "--preset", "llama-3-8b", "--dtype", "float16", "--num-requests", "32",
            "--prompt-len", "100", "200", "--output-len", "50", "--shared-prefix", "64",
            "--prefix-caching", "--kv-cache-dtype", "fp8", "--request-rate", "7.5",
            "--systems", "cupaged", "--systems", "flashinfer", "--max-batched-tokens", "512",
            "--max-running", "16", "--seed", "9", "--memory-fraction", "0.5", "--block-size", "32",
            "--kv-layout", "NHD", "--hf-batch", "8", "--no-breakdown",
            "--json", str(tmp_path / "e.json"), "--csv", str(tmp_path / "e.csv")]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    ((w, systems),) = calls
    assert systems == ["cupaged", "flashinfer"]
    assert w == Workload(preset="llama-3-8b", dtype="float16", num_requests=32,
                         prompt_len=(100, 200), output_len=50, shared_prefix=64,
                         prefix_caching=True, kv_cache_dtype="fp8", request_rate=7.5,
                         max_batched_tokens=512, max_running=16, seed=9, memory_fraction=0.5,
                         block_size=32, kv_layout="NHD", hf_batch=8, breakdown=False)
    assert "cupaged step time: attention 25.0%" in r.output
    assert json.loads((tmp_path / "e.json").read_text())["workload"]["seed"] == 9
    assert (tmp_path / "e.csv").read_text().startswith("# cupaged")


def test_e2e_json_holds_each_system_once_it_finishes(monkeypatch, tmp_path):
    """A run cut short (the device's time limit) keeps the finished systems' rows."""
    _fake_run(monkeypatch)
    path = tmp_path / "e.json"
    seen = []

    def run(workload, systems, echo, done=None):
        rows = [dataclasses.replace(_results()[0], system=s) for s in systems]
        for i in range(len(rows)):
            done(rows[:i + 1])
            seen.append([r["system"] for r in json.loads(path.read_text())["results"]])
        return rows

    monkeypatch.setattr(bench_e2e, "run", run)
    r = CliRunner().invoke(main, ["e2e", "--systems", "cupaged", "--systems", "hf",
                                  "--json", str(path)])
    assert r.exit_code == 0, r.output
    assert seen == [["cupaged"], ["cupaged", "hf"]]


def test_e2e_defaults(monkeypatch):
    calls = _fake_run(monkeypatch)
    r = CliRunner().invoke(main, ["e2e"])
    assert r.exit_code == 0, r.output
    ((w, systems),) = calls
    assert w == Workload() and w.request_rate == math.inf and w.breakdown
    assert systems == ["cupaged", "cupaged-eager", "flashinfer", "concat", "hf"]


def test_e2e_leaves_out_what_is_missing_or_cannot_run(monkeypatch):
    calls = _fake_run(monkeypatch, missing=("flashinfer",))
    r = CliRunner().invoke(main, ["e2e", "--kv-cache-dtype", "fp8"])
    assert r.exit_code == 0, r.output
    assert calls[0][1] == ["cupaged", "cupaged-eager"]
    assert "flashinfer left out: flashinfer is not installed here" in r.output
    assert "concat left out: concat has no fp8 KV cache path" in r.output
    assert "hf left out: hf has no fp8 KV cache path" in r.output


def test_e2e_asking_for_a_missing_system_is_a_usage_error(monkeypatch):
    calls = _fake_run(monkeypatch, missing=("hf",))
    r = CliRunner().invoke(main, ["e2e", "--systems", "hf"])
    assert r.exit_code == 2 and "--systems hf: hf is not installed here" in r.output
    assert not calls


@pytest.mark.parametrize("status, code", [("skipped", 3), ("failed", 1)])
def test_e2e_exit_status(monkeypatch, status, code):
    rows = _results()[:3] + [SystemResult("flashinfer", status, "fake")]
    _fake_run(monkeypatch, results=rows)
    r = CliRunner().invoke(main, ["e2e"])
    assert r.exit_code == code and f"{status.upper()}: fake" in r.output


@pytest.mark.parametrize("argv, msg", [
    (["--prompt-len", "9", "5"], "1 <= MIN <= MAX"),
    (["--prompt-len", "9"], "'--prompt-len' requires 2 arguments"),
    (["--shared-prefix", "200"], "must be less than the shortest prompt"),
    (["--max-running", "300", "--max-batched-tokens", "256"], "--max-running <= --max-batched"),
    (["--kv-cache-dtype", "fp8", "--dtype", "float32"], "float16 or bfloat16 model"),
    (["--kv-cache-dtype", "fp8_e4m3"], "Invalid value for '--kv-cache-dtype'"),
    (["--systems", "vllm"], "Invalid value for '--systems'"),
    (["--kv-cache-dtype", "fp8", "--systems", "concat"], "concat has no fp8 KV cache path"),
    (["--kv-layout", "vllm", "--systems", "flashinfer"], "NHD or HND caches"),
    (["--dtype", "float32", "--systems", "flashinfer"], "not float32"),
    (["--memory-fraction", "0"], "Invalid value for '--memory-fraction'"),
    (["--block-size", "24"], "power of two"),
    (["--request-rate", "0"], "--request-rate must be positive"),
    (["--preset", "gpt-5"], "Invalid value for '--preset'"),
    (["--json", "/nonexistent-folder/e.json"], "the folder /nonexistent-folder does not exist"),
    (["--csv", "/nonexistent-folder/e.csv"], "Invalid value for --csv"),
])
def test_e2e_bad_options_are_usage_errors(argv, msg):
    r = CliRunner().invoke(main, ["e2e", *argv])  # before any GPU check
    assert r.exit_code == 2 and msg in r.output, r.output


def test_what_each_system_cannot_serve():
    assert bench_e2e.unsupported("cupaged", Workload(kv_cache_dtype="fp8", kv_layout="vllm")) is None
    assert bench_e2e.unsupported("concat", Workload()) is None
    assert bench_e2e.unsupported("hf", Workload(kv_cache_dtype="fp8")) == "hf has no fp8 KV cache path"
    assert "NHD or HND" in bench_e2e.unsupported("flashinfer", Workload(kv_layout="vllm"))
    assert "not float32" in bench_e2e.unsupported("flashinfer", Workload(dtype="float32"))
    assert "unknown system" in bench_e2e.unsupported("vllm", Workload())
    pytest.importorskip("torch")  # the presets' head sizes
    assert bench_e2e.unsupported("flashinfer", Workload()) is None  # head size 64
    assert bench_e2e.unsupported("flashinfer", Workload(preset="tiny")) == (
        "flashinfer is run with head sizes 64, 128, 256 (those of vLLM's FlashInfer backend), "
        "tiny has 32")


@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU message")
def test_e2e_without_gpu_exits_nonzero():
    r = CliRunner().invoke(main, ["e2e", "--preset", "tiny"])
    assert r.exit_code == 2 and "no GPU" in r.output


# ---- on a GPU --------------------------------------------------------------------------------------


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch


@pytest.mark.gpu
def test_e2e_tiny_every_available_system(tmp_path):
    """The command on the tiny preset: every available system serves every request and
    the JSON and CSV have every field (flashinfer and hf where installed)."""
    _cuda_torch()
    argv = ["e2e", "--preset", "tiny", "--num-requests", "6", "--prompt-len", "20", "90",
            "--output-len", "6", "--shared-prefix", "16", "--prefix-caching",
            "--max-batched-tokens", "64", "--max-running", "4", "--memory-fraction", "0.05",
            "--json", str(tmp_path / "e.json"), "--csv", str(tmp_path / "e.csv"),
            "--plot", str(tmp_path / "e.png")]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "e.json").read_text())
    rows = {x["system"]: x for x in doc["results"]}
    # flashinfer is left out: the tiny preset's head size is 32.
    expect = ["cupaged", "cupaged-eager", "concat"] + (
        ["hf"] if bench_e2e.unavailable("hf") is None else [])
    assert list(rows) == expect
    assert "flashinfer left out: flashinfer is run with head sizes 64, 128, 256" in r.output
    for name, x in rows.items():
        assert set(x) == {f.name for f in dataclasses.fields(SystemResult)}
        assert x["status"] == "ok", x["note"]
        assert x["requests"] == 6 and x["output_tokens"] == 36 and x["output_tokens_per_s"] > 0
        assert 0 < x["ttft_median_ms"] <= x["ttft_p90_ms"] and 0 < x["tpot_median_ms"]
        assert 0 < x["kv_peak_bytes"] <= x["kv_budget_bytes"]
        # --max-running 4 for the engines and concat; hf runs one batch of all 6.
        assert 1 <= x["peak_running"] <= (6 if name == "hf" else 4)
    for x in (rows["cupaged"], rows["cupaged-eager"]):
        parts = [x["attention_fraction"], x["model_fraction"], x["host_fraction"]]
        assert all(0 < p < 1 for p in parts[:2]) and sum(parts) == pytest.approx(1.0)
    x = rows["cupaged"]
    # The shared block is found by the requests admitted while another holds it.
    assert x["cached_prompt_tokens"] > 0 and x["cached_prompt_tokens"] % 16 == 0
    assert math.isnan(rows["concat"]["attention_fraction"])
    assert len((tmp_path / "e.csv").read_text().splitlines()) == len(doc["environment"]) + 1 + len(rows)
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.gpu
def test_cupaged_concat_and_hf_greedy_tokens_agree_in_float32():
    """Different attention paths over the same float32 model: cupaged's paged kernels
    (chunked prefill under a small budget, decodes), concat's SDPA over contiguous K/V
    and generate's over left-padded batches give the same greedy tokens."""
    _cuda_torch()
    w = Workload(preset="tiny", dtype="float32", num_requests=8, prompt_len=(5, 70),
                 output_len=12, max_batched_tokens=48, max_running=4, memory_fraction=0.02,
                 breakdown=False)
    harness = bench_e2e.Harness(w)
    paged, paged_out = harness.run("cupaged")
    eager, eager_out = harness.run("cupaged-eager")
    concat, concat_out = harness.run("concat")
    assert paged.status == eager.status == concat.status == "ok", (paged.note, concat.note)
    assert [o.token_ids for o in paged_out] == [o.token_ids for o in concat_out]
    assert [o.token_ids for o in eager_out] == [o.token_ids for o in concat_out]
    assert all(len(o.token_ids) == 12 for o in paged_out)
    if bench_e2e.unavailable("hf") is None:
        hf, hf_out = harness.run("hf")
        assert hf.status == "ok", hf.note
        assert [o.token_ids for o in hf_out] == [o.token_ids for o in paged_out]


@pytest.mark.gpu
def test_flashinfer_system_serves_every_request():
    """FlashInfer's kernels in the engine (llama-3.2-1b's head size 64; bfloat16, so
    its tokens are not compared with cupaged's), with its step-time breakdown."""
    _cuda_torch()
    why = bench_e2e.unavailable("flashinfer")
    if why:
        pytest.skip(why)
    w = Workload(preset="llama-3.2-1b", num_requests=6, prompt_len=(20, 200), output_len=8,
                 max_batched_tokens=128, max_running=4, memory_fraction=0.05)
    result, outputs = bench_e2e.Harness(w).run("flashinfer")
    assert result.status == "ok", result.note
    assert all(len(o.token_ids) == 8 for o in outputs) and result.output_tokens == 48
    assert 0 < result.attention_fraction < 1 and 0 < result.kv_peak_bytes


@pytest.mark.gpu
def test_flashinfer_backend_matches_cupaged_attention_step_by_step():
    """FlashInferAttention's split (decode wrapper for the leading one-token rows, prefill
    wrapper for the rest) against cupaged's attention on the same steps and layers:
    decode-only, prefill-only and mixed steps, bfloat16 outputs within 2e-2 of the
    largest magnitude."""
    torch = _cuda_torch()
    why = bench_e2e.unavailable("flashinfer")
    if why:
        pytest.skip(why)
    import cupaged
    from cupaged.serving.engine import Engine, PagedAttention, Request
    from cupaged.serving.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=8, num_kv_heads=2, head_dim=64)
    model = Llama(config, device="cuda", dtype=torch.bfloat16, seed=3)
    cache = cupaged.PagedKVCache(2, 256, 2, 64, 16, "bfloat16", kv_layout="HND",
                                 framework="torch", device=0)
    theirs_backend = bench_e2e.FlashInferAttention(cache, config)
    errors, kinds = [], set()

    def backend(cache, batch, *arrays):
        single = batch.num_tokens == 1
        kinds.add("decode" if single.all() else "mixed" if single[0] else "prefill")
        mine = PagedAttention(cache, batch, *arrays)
        theirs = theirs_backend(cache, batch, *arrays)

        def attend(layer, q, k, v):
            a, b = mine(layer, q, k, v).float(), theirs(layer, q, k, v).float()
            errors.append(float((a - b).abs().max() / a.abs().max()))
            return a.to(q.dtype)
        return attend

    rng = np.random.default_rng(5)
    requests = [Request(i, rng.integers(0, 512, n).tolist(), 6)
                for i, n in enumerate([20, 150, 33, 90, 7])]
    engine = Engine(model, cache, max_batched_tokens=64, max_running=4, attention=backend)
    outputs = engine.run(requests)
    assert all(len(o.token_ids) == 6 for o in outputs)
    assert kinds == {"decode", "mixed", "prefill"}
    assert max(errors) < 2e-2, max(errors)


@pytest.mark.gpu
def test_fp8_cache_runs_the_engine_systems_only():
    _cuda_torch()
    r = CliRunner().invoke(main, ["e2e", "--preset", "tiny", "--num-requests", "4",
                                  "--prompt-len", "10", "40", "--output-len", "4",
                                  "--kv-cache-dtype", "fp8", "--memory-fraction", "0.02"])
    assert r.exit_code == 0, r.output
    assert "concat left out: concat has no fp8 KV cache path" in r.output
    assert "kv_cache_dtype fp8" in r.output and "cupaged step time: attention" in r.output
