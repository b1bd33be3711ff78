"""The serving loop (cupaged.serving.engine).

Scheduler tests (no torch, no GPU): a real BlockManager and a fake runner whose "model"
writes into each slot a hash of the whole context up to that token (what a K/V vector
depends on) and samples a token from the last one. Every step the runner checks that each
scheduled sequence's cache, read through its block table, holds exactly its true context
(right tokens, positions, copy-on-write, shared prefix blocks, recompute after
preemption), so the sampled tokens equal a dense reference however the requests were
batched, chunked, preempted or forked.

Engine tests: the tiny Llama through the Engine against transformers' greedy generate,
over a host stand-in for the device (a PagedKVCache with CPU tensors, reshape_and_cache
and attention done in torch, every call bound to the real functions' signatures: needs
torch and transformers), and on the GPU with cupaged's kernels (marked gpu).
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupaged
from cupaged import BlockManager
from cupaged.serving.engine import Request, SampleId, Scheduler, _available_blocks

VOCAB = 40


def _chain(value: int, token: int) -> int:
    """The 'K/V' of a token: a hash of the previous one's and its own id, so of the whole
    context up to it."""
    return hash((value, token))


def _sample(value: int) -> int:
    return value % VOCAB


def reference(prompt, max_new_tokens, eos=None) -> list:
    """What the fake model generates for a prompt, computed densely."""
    value, out = 0, []
    for t in prompt:
        value = _chain(value, t)
    while len(out) < max_new_tokens:
        t = _sample(value)
        out.append(t)
        if t == eos:
            break
        value = _chain(value, t)
    return out


class FakeRunner:
    """Runs a Scheduler's batches against its BlockManager: appends, copies on write,
    writes each query token's chain value into its slot, checks every scheduled
    sequence's cached context against the truth (prompt + the tokens its output holds),
    and samples."""

    def __init__(self, scheduler: Scheduler):
        self.s, self.m = scheduler, scheduler.manager
        self.kv: dict = {}  # slot -> chain value written there
        self.samples: dict = {}  # sequence id -> (prompt, its Completion)
        self.outputs: list = []
        self.steps = 0

    def submit(self, request: Request):
        out = self.s.submit(request, now=float(self.steps))
        for i, c in enumerate(out.completions):
            self.samples[SampleId(request.id, i)] = (request.prompt, c)
        self.outputs.append(out)
        return out

    def step(self) -> list:
        s, m, bs = self.s, self.m, self.m.block_size
        self.steps += 1
        batch = s.schedule()
        if batch is None:
            return []
        assert batch.num_query_tokens <= s.max_batched_tokens
        assert len(set(batch.seq_ids)) == len(batch.seq_ids) <= s.max_running
        assert (batch.num_tokens >= 1).all()
        na = batch.num_appended
        slots, copies = m.append(batch.seq_ids[:na], num_tokens=batch.num_tokens[:na].tolist(),
                                 token_ids=batch.append_token_ids)
        for src, dst in copies.tolist():  # copy-on-write, before the writes
            for o in range(bs):
                if src * bs + o in self.kv:
                    self.kv[dst * bs + o] = self.kv[src * bs + o]
        slots = np.concatenate([slots, batch.added_slots]).tolist()
        assert len(slots) == batch.num_query_tokens
        qsl, sample_rows = batch.query_start_loc.tolist(), set(batch.sample_rows.tolist())
        sampled = []
        for i, sid in enumerate(batch.seq_ids):
            a, b, end = qsl[i], qsl[i + 1], int(batch.seq_lens[i])
            start = end - (b - a)
            prompt, completion = self.samples[sid]
            true = list(prompt) + completion.token_ids
            assert m.context_len(sid) == end <= len(true)
            assert batch.tokens[a:b].tolist() == true[start:end]
            assert batch.positions[a:b].tolist() == list(range(start, end))
            table = m.block_table(sid)
            value = 0 if start == 0 else self.kv[table[(start - 1) // bs] * bs + (start - 1) % bs]
            for j, slot in enumerate(slots[a:b]):
                assert slot == table[(start + j) // bs] * bs + (start + j) % bs
                value = _chain(value, true[start + j])
                self.kv[slot] = value
            # Its whole cached context is the true one (shared prefix blocks included).
            expect = 0
            for p in range(end):
                expect = _chain(expect, true[p])
                assert self.kv[table[p // bs] * bs + p % bs] == expect, (sid, p)
            assert (b - 1 in sample_rows) == (end == len(true))
            if end == len(true):
                sampled.append(_sample(value))
        finished = s.update(batch, sampled, now=float(self.steps))
        m.check()
        return finished

    def run(self, requests, arrivals=None, max_steps=100_000):
        """Submit each request at its arrival step (default 0) and step until done."""
        arrivals = [0] * len(requests) if arrivals is None else arrivals
        order = sorted(range(len(requests)), key=lambda i: arrivals[i])
        outputs, at = [None] * len(requests), 0
        while at < len(order) or self.s.has_unfinished():
            while at < len(order) and arrivals[order[at]] <= self.steps:
                outputs[order[at]] = self.submit(requests[order[at]])
                at += 1
            self.step()
            assert self.steps < max_steps, "no progress"
        return outputs


def check_outputs(requests, outputs):
    for r, out in zip(requests, outputs):
        assert out.finished and len(out.completions) == r.n
        want = reference(r.prompt, r.max_new_tokens, r.eos_token_id)
        for c in out.completions:
            assert c.token_ids == want, (r.id, c.token_ids, want)
            assert c.finish_reason == ("eos" if want[-1] == r.eos_token_id else "length")
            assert len(c.token_times) == len(want)
            assert c.token_times == sorted(c.token_times)


def all_free(m) -> bool:
    return m.sequences == [] and _available_blocks(m) == m.num_blocks


def make(num_blocks, block_size, prefix_caching=False, **kw):
    return FakeRunner(Scheduler(BlockManager(num_blocks, block_size, prefix_caching=prefix_caching),
                                **kw))


def test_requests_finish_with_their_tokens():
    rng = np.random.default_rng(0)
    requests = [Request(i, rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist(),
                        int(rng.integers(1, 12))) for i in range(10)]
    runner = make(64, 4, max_batched_tokens=16, max_running=4)
    outputs = runner.run(requests)
    check_outputs(requests, outputs)
    assert all_free(runner.m)
    assert all(o.ttft is not None and o.ttft >= 0 for o in outputs)


def test_eos_ends_a_request():
    prompt = [1, 2, 3]
    want = reference(prompt, 30)
    eos = want[4]
    r = Request("a", prompt, 30, eos_token_id=eos)
    out = make(16, 4).run([r])[0]
    assert out.token_ids == want[:want.index(eos) + 1] and out.completions[0].finish_reason == "eos"


def test_decodes_come_first_and_prompts_are_chunked():
    """A long prompt arriving while another request decodes is computed in chunks that
    fill the budget beside the decode, which comes first in every batch."""
    long = Request("long", list(range(40)), 3)
    short = Request("short", [5, 6], 20)
    runner = make(64, 4, max_batched_tokens=8, max_running=4)
    seen = []
    real = runner.s.schedule

    def schedule():
        batch = real()
        if batch is not None:
            seen.append(([i.request for i in batch.seq_ids], batch.num_tokens.tolist()))
        return batch

    runner.s.schedule = schedule
    check_outputs([long, short], runner.run([long, short], arrivals=[2, 0]))
    mixed = [(ids, k) for ids, k in seen if ids[:1] == ["short"] and "long" in ids]
    assert len(mixed) >= 5  # 40 tokens, 7 a step beside the decode
    assert all(k[0] == 1 and sum(k) <= 8 for _, k in mixed)
    assert sum(k[ids.index("long")] for ids, k in seen if "long" in ids and ids.index("long") > 0) >= 35


def test_preemption_under_memory_pressure():
    """Six requests that need 6 blocks each in a cache of 10: decodes run out of blocks,
    the newest requests are preempted and recomputed, and every one still finishes with
    the tokens it would have had alone."""
    rng = np.random.default_rng(1)
    requests = [Request(i, rng.integers(0, VOCAB, 10).tolist(), 12) for i in range(6)]
    runner = make(10, 4, max_batched_tokens=64, max_running=6)
    outputs = runner.run(requests)
    check_outputs(requests, outputs)
    assert sum(o.num_preemptions for o in outputs) > 0
    assert all_free(runner.m)


def test_a_request_that_can_never_fit_is_refused():
    runner = make(8, 4)  # 32 tokens
    with pytest.raises(ValueError, match="can never fit"):
        runner.submit(Request("big", list(range(30)), 4))  # 33 tokens in the cache
    fits = Request("fits", list(range(30)), 3)  # 32 tokens: the whole cache
    check_outputs([fits], runner.run([fits]))
    assert all_free(runner.m)


@pytest.mark.parametrize("request_, match", [
    (Request("a", [], 3), "prompt is empty"),
    (Request("a", [1], 0), "max_new_tokens must be >= 1"),
    (Request("a", [1], 2, n=9), "n must be from 1 to max_running"),
])
def test_bad_requests_are_refused(request_, match):
    runner = make(8, 4, max_running=8, max_batched_tokens=8)
    with pytest.raises(ValueError, match=match):
        runner.submit(request_)
    assert not runner.s.has_unfinished()


def test_duplicate_ids_and_bad_limits_are_refused():
    runner = make(8, 4)
    runner.submit(Request("a", [1], 2))
    with pytest.raises(ValueError, match="already queued"):
        runner.submit(Request("a", [2], 2))
    with pytest.raises(ValueError, match="max_running <= max_batched_tokens"):
        Scheduler(BlockManager(8, 4), max_batched_tokens=4, max_running=8)


def test_forks_share_the_prompt():
    """n=3: the prompt is computed once, forked after its first token; the samples share
    its blocks (copy-on-write of the partly filled last one) and generate alike."""
    r = Request("p", list(range(10)), 6, n=3)  # 10 tokens: a partly filled third block
    runner = make(32, 4)
    out = runner.submit(r)
    runner.step()  # the prompt, and the fork
    m = runner.m
    assert sorted(m.sequences) == [SampleId("p", 0), SampleId("p", 1), SampleId("p", 2)]
    assert all(m.ref_count(b) == 3 for b in m.block_table(SampleId("p", 0)))
    while runner.s.has_unfinished():
        runner.step()
    check_outputs([r], [out])
    assert all_free(m)


def test_sample_ids_never_collide_with_request_ids():
    """Request ids are any hashables: a request ("a", 1) beside a request "a" with n=2
    (whose second sample once took the id ("a", 1) in the block manager) both run to
    their ends with the right tokens."""
    requests = [Request(("a", 1), [5, 6, 7], 4), Request("a", [1, 2, 3, 4, 5], 5, n=2),
                Request(("a", 0), [9], 3, n=3)]
    check_outputs(requests, make(64, 4).run(requests))
    assert SampleId("a", 1) != ("a", 1)


class _FailingFork(BlockManager):
    """A block manager whose ``fork`` raises on its ``fail_at``-th call (counting from 1)."""

    fail_at = 2
    calls = 0

    def fork(self, parent, child):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("fork refused")
        super().fork(parent, child)


def test_a_failed_update_changes_nothing():
    """A step whose forks fail part-way (the second of two requests' forks) raises and
    leaves the scheduler and the manager as they were: the same batch is then recorded
    again and every request finishes right."""
    m = _FailingFork(64, 4)
    s = Scheduler(m, max_batched_tokens=64, max_running=8)
    runner = FakeRunner(s)
    requests = [Request("x", [1, 2, 3], 4, n=2), Request("y", [4, 5], 3, n=3)]
    outs = [runner.submit(r) for r in requests]
    batch = s.schedule()
    na = batch.num_appended
    m.append(batch.seq_ids[:na], num_tokens=batch.num_tokens[:na].tolist())
    sampled = [7] * len(batch.sample_rows)
    state = lambda: ([(q.id, q.computed, q.forks_left, len(q.tokens)) for q in s.running],
                     sorted(m.sequences, key=repr), m.num_free_blocks,
                     [len(c.token_ids) for o in outs for c in o.completions])
    before = state()
    with pytest.raises(RuntimeError, match="fork refused"):
        s.update(batch, sampled, now=0.0)
    assert state() == before
    m.check()
    s.update(batch, sampled, now=0.0)  # fork call 3 onwards succeeds
    assert sorted(m.sequences, key=repr) == sorted(
        [SampleId("x", i) for i in range(2)] + [SampleId("y", i) for i in range(3)], key=repr)
    while s.has_unfinished():
        b = s.schedule()
        na = b.num_appended
        m.append(b.seq_ids[:na], num_tokens=b.num_tokens[:na].tolist())
        s.update(b, [7] * len(b.sample_rows), now=1.0)
    assert all(c.token_ids == [7] * r.max_new_tokens for o, r in zip(outs, requests)
               for c in o.completions)
    assert all_free(m)


def test_max_running_limits_the_batch():
    requests = [Request(i, [i, i + 1], 5) for i in range(7)]
    runner = make(64, 4, max_batched_tokens=16, max_running=3)
    seen = []
    real = runner.s.update

    def update(batch, sampled, now=None):
        seen.append(len(batch.seq_ids))
        return real(batch, sampled, now)

    runner.s.update = update
    check_outputs(requests, runner.run(requests))
    assert max(seen) == 3


def test_prefix_cache_hits_skip_recomputation():
    """B shares A's first three blocks: added after A computed them, B finds them cached
    and computes only the rest; C, added in the same step as A, finds A's blocks too (A
    stores them before C is added, and the step writes them before attending)."""
    system = list(range(100, 112))  # three blocks of 4
    a = Request("a", system + [1, 2], 4)
    b = Request("b", system + [3, 4, 5], 4)
    c = Request("c", system + [6], 4)
    runner = make(32, 4, prefix_caching=True)
    outputs = runner.run([a, c, b], arrivals=[0, 0, 2])
    check_outputs([a, c, b], outputs)
    assert [o.num_cached_tokens for o in outputs] == [0, 12, 12]
    assert all_free(runner.m)


def test_a_prompt_longer_than_the_budget_finds_its_whole_cached_prefix():
    """A prompt is looked up whole before it is admitted: its cached blocks cost no step
    budget, so prompts longer than a step's budget (a 2048-token system prompt in chunks
    of 2048) still share every cached block, and several are admitted in one step."""
    system = list(range(100, 124))  # six blocks of 4
    a = Request("a", system + [1], 2)
    later = [Request(i, system + [i] * 5, 2) for i in range(3)]  # 29 tokens, 5 their own
    runner = make(64, 4, prefix_caching=True, max_batched_tokens=16, max_running=4)
    outputs = [runner.submit(a)]
    while runner.s.has_unfinished():
        runner.step()
    outputs += [runner.submit(r) for r in later]
    batch = runner.s.schedule()
    assert batch.num_tokens.tolist() == [5, 5, 5]  # all three, their own tokens only
    check = make(64, 4, prefix_caching=True, max_batched_tokens=16, max_running=4)
    outputs = check.run([a] + later, arrivals=[0, 3, 3, 3])
    check_outputs([a] + later, outputs)
    assert [o.num_cached_tokens for o in outputs] == [0, 24, 24, 24]


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    prefix_caching = draw(st.booleans())
    base = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=24))
    max_running = draw(st.integers(1, 6))
    budget = draw(st.integers(max_running, 40))
    eos = draw(st.one_of(st.none(), st.integers(0, VOCAB - 1)))
    requests, arrivals = [], []
    for i in range(draw(st.integers(1, 8))):
        shared = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if shared else 1, max_size=12))
        n = draw(st.integers(1, min(3, max_running)))
        requests.append(Request(i, base[:shared] + tail, draw(st.integers(1, 10)), n=n,
                                eos_token_id=eos))
        arrivals.append(draw(st.integers(0, 12)))
    need = max(-(-(len(r.prompt) + r.max_new_tokens - 1) // bs) for r in requests)
    num_blocks = draw(st.integers(need, 3 * need + 4))
    return bs, prefix_caching, max_running, budget, num_blocks, requests, arrivals


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_right(workload):
    """Random arrivals, prompt and output lengths, samples, shared prefixes, block sizes,
    budgets and cache sizes (down to the one request that needs the most): every request
    finishes with the reference tokens, each step within its limits and with the cache
    holding each sequence's true context, and all blocks come back."""
    bs, prefix_caching, max_running, budget, num_blocks, requests, arrivals = workload
    runner = make(num_blocks, bs, prefix_caching, max_batched_tokens=budget,
                  max_running=max_running)
    check_outputs(requests, runner.run(requests, arrivals))
    assert all_free(runner.m)


def test_the_newest_is_preempted_to_the_front_of_the_queue():
    """A and B decode in a cache that cannot hold both to the end; C waits for room. When
    A's decode runs out of blocks, B (admitted after A) is preempted and queued before
    C, so it is admitted again first."""
    a, b = Request("a", list(range(7)), 10), Request("b", list(range(10, 17)), 10)
    c = Request("c", list(range(20, 32)), 2)
    runner = make(6, 4)
    outs = [runner.submit(r) for r in (a, b, c)]
    runner.step()
    while not outs[1].num_preemptions:
        assert [s.request.id for s in runner.s.running] == ["a", "b"]
        runner.step()
    assert outs[0].num_preemptions == 0
    assert [s.request.id for s in runner.s.waiting] == ["b", "c"]
    while runner.s.has_unfinished():
        runner.step()
    check_outputs([a, b, c], outs)
    assert outs[1].completions[0].token_times[-1] < outs[2].completions[0].token_times[0]


# ---- the Engine with the tiny Llama, against transformers ------------------------------------
#
# Each scenario runs on a cache factory: the host stand-in below (CPU, torch) or a real
# PagedKVCache on the GPU. Weights and prompts come from fixed seeds, so a run is
# deterministic.

def _tiny(device):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from cupaged.serving.llama import Llama, LlamaConfig, to_hf

    model = Llama(LlamaConfig.preset("tiny"), device=device, dtype=torch.float32, seed=0)
    return model, to_hf(model)


def hf_greedy(hf, prompt, max_new_tokens) -> list:
    import torch

    ids = torch.tensor([prompt], device=hf.device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      do_sample=False)
    return out[0, len(prompt):].tolist()


def _prompts(lengths, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def serve(engine, requests, arrivals=None) -> list:
    """Submit each request at its arrival step and step the engine until all finish."""
    arrivals = [0] * len(requests) if arrivals is None else arrivals
    outputs, steps = [None] * len(requests), 0
    while steps <= max(arrivals) or engine.has_unfinished():
        for i, r in enumerate(requests):
            if arrivals[i] == steps:
                outputs[i] = engine.submit(r)
        engine.step()
        steps += 1
    return outputs


def check_against_hf(hf, requests, outputs):
    for r, out in zip(requests, outputs):
        want = hf_greedy(hf, r.prompt, r.max_new_tokens)
        assert out.finished and len(out.completions) == r.n
        for c in out.completions:
            assert c.token_ids == want, (r.id, c.token_ids, want)


def scenario_chunked(model, hf, make_cache, **engine_kw):
    """Prompts from 3 to 40 tokens through a 16-token budget: chunked prefills mixed with
    decodes in every step."""
    from cupaged.serving.engine import Engine

    lens, new = [5, 17, 40, 23, 3, 31], [8, 5, 10, 6, 12, 7]
    requests = [Request(i, p, k) for i, (p, k) in enumerate(zip(_prompts(lens), new))]
    engine = Engine(model, make_cache(128, 4, False), max_batched_tokens=16, max_running=4,
                    **engine_kw)
    outputs = serve(engine, requests, arrivals=[0, 0, 1, 3, 3, 6])
    check_against_hf(hf, requests, outputs)
    assert engine.cache.num_used_blocks == 0
    return [engine]


def scenario_forks(model, hf, make_cache, **engine_kw):
    """Parallel samples: forked after the prompt, sharing its blocks (copy-on-write of the
    partly filled last one); greedy samples agree with generate."""
    from cupaged.serving.engine import Engine

    prompts = _prompts([13, 8, 6], seed=1)
    requests = [Request("a", prompts[0], 6, n=3), Request("b", prompts[1], 9, n=2),
                Request("c", prompts[2], 7)]
    engine = Engine(model, make_cache(64, 4, False), max_batched_tokens=32, max_running=8,
                    **engine_kw)
    outputs = serve(engine, requests, arrivals=[0, 1, 1])
    check_against_hf(hf, requests, outputs)
    assert engine.cache.num_used_blocks == 0
    return [engine]


def scenario_prefix(model, hf, make_cache, **engine_kw):
    """Prompts sharing a 3-block system prompt: those added after the first find its
    blocks in the prefix cache and compute only their own tokens."""
    from cupaged.serving.engine import Engine

    system, *tails = _prompts([24, 5, 9, 1, 14], seed=2)
    requests = [Request(i, system + t, 6) for i, t in enumerate(tails)]
    engine = Engine(model, make_cache(64, 8, True), max_batched_tokens=64, max_running=4,
                    **engine_kw)
    outputs = serve(engine, requests, arrivals=[0, 2, 2, 5])
    check_against_hf(hf, requests, outputs)
    assert [o.num_cached_tokens for o in outputs] == [0, 24, 24, 24]
    assert engine.cache.num_used_blocks == 0
    return [engine]


def scenario_preemption(model, hf, make_cache, **engine_kw):
    """Five requests that need 7 blocks each in a cache of 14: the newest are preempted
    and recomputed, and the tokens are those of a roomy run (and of generate)."""
    from cupaged.serving.engine import Engine

    requests = [Request(i, p, 16) for i, p in enumerate(_prompts([12] * 5, seed=3))]
    tight = Engine(model, make_cache(14, 4, False), max_batched_tokens=64, max_running=5,
                   **engine_kw)
    outputs = serve(tight, requests)
    assert sum(o.num_preemptions for o in outputs) > 0
    roomy = Engine(model, make_cache(64, 4, False), max_batched_tokens=64, max_running=5,
                   **engine_kw)
    alone = serve(roomy, requests)
    assert sum(o.num_preemptions for o in alone) == 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]
    check_against_hf(hf, requests, outputs)
    assert tight.cache.num_used_blocks == 0
    return [tight, roomy]


SCENARIOS = [scenario_chunked, scenario_forks, scenario_prefix, scenario_preemption]


def _same(x, y) -> bool:
    """The same array, or both None (by address: a compiled graph passes its own tensor
    objects over the caller's memory)."""
    if x is None or y is None:
        return x is y
    return x.data_ptr() == y.data_ptr() and x.shape == y.shape


class HostKernels:
    """reshape_and_cache, attention and AttentionPlan done in torch on the host, over a
    PagedKVCache stand-in with CPU tensors in NHD; each call is bound to the real
    function's signature first, so a misnamed or missing argument fails here as it would
    on the device."""

    def __init__(self, monkeypatch):
        import cupaged.cache_ops
        import cupaged.serving.engine

        real = (cupaged.cache_ops.reshape_and_cache, cupaged.attention, cupaged.AttentionPlan)
        self.sig_write, self.sig_attend = inspect.signature(real[0]), inspect.signature(real[1])
        self.sig_plan, self.sig_run = inspect.signature(real[2]), inspect.signature(real[2].run)
        self.calls = defaultdict(int)
        self.functional = False
        kernels = self

        class Plan:
            def __init__(self, *args, **kwargs):
                self.bound = kernels.sig_plan.bind(*args, **kwargs)
                self.bound.apply_defaults()
                kernels.calls["plan"] += 1

            def run(self, *args, **kwargs):
                run = kernels.sig_run.bind(self, *args, **kwargs).arguments
                a = dict(self.bound.arguments)
                a.update(query=run["query"], key_cache=run["key_cache"],
                         value_cache=run["value_cache"])
                for name in ("k_scale", "v_scale"):
                    if run.get(name) is not None:
                        a[name] = run[name]
                kernels.calls["plan.run"] += 1
                return kernels._attend(a)

        monkeypatch.setattr(cupaged.cache_ops, "reshape_and_cache", self.reshape_and_cache)
        monkeypatch.setattr(cupaged.cache_ops, "copy_blocks", self.copy_blocks)
        # The engine binds attention and AttentionPlan at import: patched where it looks.
        monkeypatch.setattr(cupaged.serving.engine, "attention", self.attention)
        monkeypatch.setattr(cupaged.serving.engine, "AttentionPlan", Plan)

    def cache(self, num_blocks, block_size, prefix_caching, *, fp8=False, model_config=None):
        """A PagedKVCache whose caches are CPU tensors (NaN until written) and whose
        uploads are CPU int32 tensors. ``fp8``: it claims to be an fp8 cache with
        per-tensor scales (its tensors stay float32), for the engine's fp8 path."""
        import torch

        c = model_config
        cache = object.__new__(cupaged.PagedKVCache)
        cache.manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        cache.framework, cache.kv_layout, cache.dtype = "torch", "NHD", np.dtype(np.float32)
        cache.num_layers, cache.num_kv_heads = c.num_layers, c.num_kv_heads
        cache.head_size, cache.block_size = c.head_dim, block_size
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        cache.key_caches = [torch.full(shape, float("nan")) for _ in range(c.num_layers)]
        cache.value_caches = [torch.full(shape, float("nan")) for _ in range(c.num_layers)]
        cache._k_scale_blocks = cache._v_scale_blocks = None
        cache.kv_cache_dtype = "fp8_e4m3" if fp8 else "auto"
        cache.kv_scales = "tensor" if fp8 else None
        cache.k_scales = [torch.ones(1) if fp8 else None for _ in range(c.num_layers)]
        cache.v_scales = [torch.ones(1) if fp8 else None for _ in range(c.num_layers)]
        cache._upload = lambda purpose, parts: [
            torch.from_numpy(np.asarray(p, dtype=np.int32).copy()) for p in parts]
        self._cache = cache
        return cache

    def _check_scales(self, a):
        cache = self._cache
        assert a["kv_cache_dtype"] == cache.kv_cache_dtype and a["kv_layout"] == cache.kv_layout
        if self.functional:  # a functionalized graph's ops get copies, not the caches
            return
        layer = [i for i, kc in enumerate(cache.key_caches) if _same(kc, a["key_cache"])]
        assert len(layer) == 1 and _same(cache.value_caches[layer[0]], a["value_cache"])
        assert _same(a["k_scale"], cache.k_scales[layer[0]])
        assert _same(a["v_scale"], cache.v_scales[layer[0]])

    def reshape_and_cache(self, *args, **kwargs):
        import torch

        bound = self.sig_write.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        self._check_scales(a)
        slots = a["slot_mapping"]
        assert slots.dtype in (torch.int32, torch.int64) and slots.shape == a["key"].shape[:1]
        for src, dst in ((a["key"], a["key_cache"]), (a["value"], a["value_cache"])):
            assert src.shape[1:] == dst.shape[2:] and src.dtype == dst.dtype
            dst.view(-1, *dst.shape[2:])[slots.long()] = src
        self.calls["write"] += 1

    def copy_blocks(self, key_caches, value_caches, block_mapping, **kwargs):
        for caches in (key_caches, value_caches):
            for c in caches:
                c[block_mapping[:, 1].long()] = c[block_mapping[:, 0].long()]
        self.calls["copy"] += 1

    def attention(self, *args, **kwargs):
        bound = self.sig_attend.bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls["attention"] += 1
        return self._attend(bound.arguments)

    def _attend(self, a):
        import torch

        from cupaged.serving.llama import dense_attention

        self._check_scales(a)
        q, kc, vc = a["query"], a["key_cache"], a["value_cache"]
        bt, lens, qsl = a["block_tables"], a["seq_lens"], a["query_start_loc"]
        assert a["causal"] is True
        assert bt.dtype == lens.dtype == qsl.dtype == torch.int32
        assert qsl.shape == (len(lens) + 1,) and int(qsl[0]) == 0 and int(qsl[-1]) == q.shape[0]
        q_lens = (qsl[1:] - qsl[:-1]).tolist()
        assert a["max_query_len"] == max(q_lens) and a["max_seq_len"] >= int(lens.max())
        bs = kc.shape[1]
        out = torch.full_like(q, float("nan"))
        for s, n in enumerate(lens.tolist()):
            pos = torch.arange(n)
            slots = bt[s].long()[pos // bs] * bs + pos % bs
            k = kc.view(-1, *kc.shape[2:])[slots]
            v = vc.view(-1, *vc.shape[2:])[slots]
            assert not (k.isnan().any() or v.isnan().any()), "read a slot never written"
            rows = slice(int(qsl[s]), int(qsl[s + 1]))
            out[rows] = dense_attention(q[rows], k, v)
        return out


@pytest.fixture(scope="module")
def tiny_cpu():
    model, hf = _tiny("cpu")
    import torch

    # Tiny matrices: one thread is fastest, and spares a busy machine's other cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, hf
    torch.set_num_threads(threads)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__[9:])
def test_engine_on_host_matches_transformers(tiny_cpu, monkeypatch, scenario):
    model, hf = tiny_cpu
    kernels = HostKernels(monkeypatch)
    scenario(model, hf, lambda *a: kernels.cache(*a, model_config=model.config))
    assert kernels.calls["plan.run"] > 0 and kernels.calls["attention"] == 0
    if scenario is scenario_forks:
        assert kernels.calls["copy"] > 0


def test_engine_on_host_steps_without_a_token(tiny_cpu, monkeypatch):
    """A prompt alone, longer than the budget: its first steps sample nothing."""
    from cupaged.serving.engine import Engine

    model, hf = tiny_cpu
    kernels = HostKernels(monkeypatch)
    engine = Engine(model, kernels.cache(32, 4, False, model_config=model.config),
                    max_batched_tokens=8, max_running=2)
    request = Request("long", _prompts([29], seed=5)[0], 4)
    out = engine.submit(request)
    assert [engine.step() for _ in range(3)] == [[], [], []] and out.token_ids == []
    while engine.has_unfinished():
        engine.step()
    check_against_hf(hf, [request], [out])


def test_engine_on_host_fp8_path(tiny_cpu, monkeypatch):
    """An fp8 cache's per-layer scales reach reshape_and_cache and attention (the
    stand-in keeps float32, so the tokens are generate's)."""
    model, hf = tiny_cpu
    kernels = HostKernels(monkeypatch)
    scenario_chunked(model, hf, lambda *a: kernels.cache(*a, fp8=True, model_config=model.config))
    assert kernels.calls["attention"] > 0 and kernels.calls["plan.run"] == 0


def test_cuda_graphs_and_compile_need_what_they_run_on(tiny_cpu, monkeypatch):
    """CUDA graphs: the default backend and a GPU; compile: the default backend and, over
    fp8, per-tensor scales."""
    from cupaged.serving.engine import Engine

    model, _ = tiny_cpu
    kernels = HostKernels(monkeypatch)
    cache = kernels.cache(16, 4, False, model_config=model.config)
    with pytest.raises(ValueError, match="default attention backend"):
        Engine(model, cache, cuda_graphs=True, attention=lambda *a: None)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(model, cache, cuda_graphs=True)
    with pytest.raises(ValueError, match="needs an Engine made with cuda_graphs=True"):
        Engine(model, cache).capture_graphs()
    with pytest.raises(ValueError, match="compile=True .* default attention backend"):
        Engine(model, cache, compile=True, attention=lambda *a: None)
    cache.kv_scales = "token"
    with pytest.raises(ValueError, match="per-tensor fp8 scales"):
        Engine(model, cache, compile=True)
    cache.kv_scales = "tensor"
    import torch

    from torch._inductor.compile_fx import compile_fx

    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    for backend in ({}, {"backend": "inductor"}, {"backend": compile_fx}):
        with pytest.raises(ValueError, match="'dynamic': True.* torch 2.14 .*189271"):
            Engine(model, cache, compile={"dynamic": True, **backend})
    Engine(model, cache, compile={"dynamic": True, "backend": "aot_eager"})  # not inductor
    monkeypatch.setattr(torch, "__version__", "2.14.0a0+git1234")
    Engine(model, cache, compile={"dynamic": True})


@pytest.mark.parametrize("max_batch, sizes", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (5, [1, 2, 4, 8]), (8, [1, 2, 4, 8]),
    (9, [1, 2, 4, 8, 16]), (20, [1, 2, 4, 8, 16, 24])])
def test_graph_batch_sizes(max_batch, sizes):
    from cupaged.serving.engine import _graph_sizes

    assert _graph_sizes(max_batch) == sizes


def test_engine_checks_model_against_cache(tiny_cpu, monkeypatch):
    from cupaged.serving.engine import Engine

    model, _ = tiny_cpu
    kernels = HostKernels(monkeypatch)
    cache = kernels.cache(16, 4, False, model_config=model.config)
    cache.head_size = 64
    with pytest.raises(ValueError, match="head size"):
        Engine(model, cache)
    cache.head_size, cache.framework = model.config.head_dim, "cupy"
    with pytest.raises(ValueError, match="framework='torch'"):
        Engine(model, cache)


# ---- on the GPU --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return _tiny("cuda")


def _gpu_cache(model, layout, kv_cache_dtype="auto"):
    import torch

    c = model.config
    dtype = {torch.float32: "float32", torch.float16: "float16",
             torch.bfloat16: "bfloat16"}[model.dtype]

    def make(num_blocks, block_size, prefix_caching):
        return cupaged.PagedKVCache(c.num_layers, num_blocks, c.num_kv_heads, c.head_dim,
                                    block_size, dtype, kv_layout=layout,
                                    prefix_caching=prefix_caching, framework="torch",
                                    device=model.device.index or 0, kv_cache_dtype=kv_cache_dtype)
    return make


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__[9:])
@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm"])
def test_engine_on_gpu_matches_transformers(tiny_gpu, scenario, layout):
    """float32 weights and cache: the Engine's greedy tokens are generate's, for chunked
    prefill under a small budget, decodes, forks, prefix-cache hits and preemption."""
    model, hf = tiny_gpu
    scenario(model, hf, _gpu_cache(model, layout))


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__[9:])
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
def test_engine_on_gpu_with_cuda_graphs_matches_transformers(tiny_gpu, scenario, layout,
                                                            monkeypatch):
    """Decode steps replayed from CUDA graphs (padded batches: the scenarios' batches of
    3, 5, 6 and 7 run in graphs of 4 and 8 rows) give generate's tokens too, and every
    replay's padding rows write nothing and read nothing (a batch that shrinks within a
    graph size leaves rows of finished sequences behind, whose blocks may be reused)."""
    from cupaged.serving.engine import _DecodeGraphs

    replay = _DecodeGraphs.replay

    def checked(self, batch, step):
        tokens = replay(self, batch, step)
        n = len(batch.seq_ids)
        b = self._size(n)
        assert (self.slots[n:b] == -1).all() and (self.lens[n:b] == 0).all()
        assert (self.lens[:n].cpu().numpy() == batch.seq_lens).all()
        return tokens

    monkeypatch.setattr(_DecodeGraphs, "replay", checked)
    model, hf = tiny_gpu
    engines = scenario(model, hf, _gpu_cache(model, layout), cuda_graphs=True)
    for engine in engines:
        assert engine.graphs.num_replays > 0 and engine.graphs.graphs
        assert engine.graphs.out is not None and engine.graphs.workspace is not None


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__[9:])
def test_compiled_engine_on_gpu_matches_transformers(tiny_gpu, scenario):
    """The model under torch.compile(fullgraph=True), attention through torch.ops.cupaged,
    decode steps in CUDA graphs of the compiled forward: generate's tokens. The graphs
    allocate no attention output or workspace: the ops allocate theirs in the graph."""
    model, hf = tiny_gpu
    engines = scenario(model, hf, _gpu_cache(model, "HND"), cuda_graphs=True, compile=True)
    for engine in engines:
        assert engine.graphs.num_replays > 0 and engine.forward is not model.forward
        assert engine.graphs.out is None and engine.graphs.workspace is None


@pytest.mark.gpu
def test_cuda_graphs_with_a_short_max_model_len_fall_back_to_eager(tiny_gpu):
    """Sequences longer than max_model_len run eagerly (the graphs' tables are narrower),
    with the same tokens; captured sizes up front are used and others are refused."""
    from cupaged.serving.engine import Engine

    model, hf = tiny_gpu
    requests = [Request(i, p, 12) for i, p in enumerate(_prompts([6, 9, 14], seed=6))]
    replays = {}
    for length in (16, 1000):
        engine = Engine(model, _gpu_cache(model, "HND")(64, 4, False), max_batched_tokens=32,
                        max_running=4, cuda_graphs=True, max_model_len=length)
        engine.capture_graphs([4])
        assert sorted(engine.graphs.graphs) == [4]
        with pytest.raises(ValueError, match="no decode graph of batch size 3"):
            engine.capture_graphs([3])
        outputs = engine.run(requests)
        check_against_hf(hf, requests, outputs)
        replays[length] = engine.graphs.num_replays, sorted(engine.graphs.graphs)
    # Tables of 4 blocks hold 16 tokens: sequences grow past them (to 25) and run eagerly,
    # so no smaller graph is ever captured; with room, every decode step replays.
    (short, short_sizes), (roomy, roomy_sizes) = replays[16], replays[1000]
    assert 0 < short < roomy and short_sizes == [4] and roomy_sizes[-1] == 4


@pytest.mark.gpu
def test_cuda_graphs_over_an_fp8_cache_give_the_eager_tokens():
    """bfloat16 over an fp8 cache (a plan per layer, for its scales): the graphs' tokens
    are the eager run's."""
    torch = pytest.importorskip("torch")
    from cupaged.serving.engine import Engine
    from cupaged.serving.llama import Llama, LlamaConfig

    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    model = Llama(LlamaConfig.preset("tiny"), device="cuda", dtype=torch.bfloat16, seed=0)
    prompts = _prompts([30, 7, 45, 12, 21], seed=4)
    runs = []
    for graphs in (False, True):
        engine = Engine(model, _gpu_cache(model, "HND", "fp8_e4m3")(64, 16, True),
                        max_batched_tokens=32, max_running=8, cuda_graphs=graphs,
                        max_model_len=64 if graphs else None)
        runs.append(engine.run([Request(i, p, 9) for i, p in enumerate(prompts)]))
        assert engine.cache.num_used_blocks == 0
    assert engine.graphs.num_replays > 0
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]


class _LogitsRecorder:
    """Stands in for the model: runs it and keeps each forward's logits, with the
    positions of the rows they are for."""

    def __init__(self, model):
        self.model, self.config, self.dtype, self.device = (model, model.config, model.dtype,
                                                            model.device)
        self.rows = []  # (position, logits [vocab]) in step order

    def forward(self, tokens, positions, attention, logits_rows=None):
        logits = self.model.forward(tokens, positions, attention, logits_rows)
        at = positions if logits_rows is None else positions[logits_rows]
        self.rows += list(zip(at.tolist(), logits.float()))
        return logits


@pytest.mark.gpu
def test_bfloat16_logits_are_as_close_to_float32_as_transformers(tiny_gpu):
    """The stated bf16 tolerance (docs/API.md, serving loop): with bfloat16 weights, the
    engine's logits (chunked prefill through a 16-token budget, then decodes; one request
    at a time, so each step's rows are one sequence's) deviate from the float32 model's
    (the same bf16-rounded weights, transformers in float32) by at most 1.25x what
    transformers' own bfloat16 forward deviates, in the largest deviation over all rows
    and in the median of the rows' largest deviations."""
    import torch

    from cupaged.serving.engine import Engine
    from cupaged.serving.llama import Llama, LlamaConfig, to_hf

    model = Llama(LlamaConfig.preset("tiny"), device="cuda", dtype=torch.bfloat16, seed=1)
    hf16 = to_hf(model, share_weights=True)
    hf32 = to_hf(model).float()  # a copy: the bf16 weights, exactly, in float32
    recorder = _LogitsRecorder(model)
    engine = Engine(recorder, _gpu_cache(model, "NHD")(64, 16, False), max_batched_tokens=16,
                    max_running=1)
    errors = {"cupaged": [], "hf": []}
    for i, prompt in enumerate(_prompts([37, 64, 100], seed=7)):
        recorder.rows.clear()
        out = engine.run([Request(i, prompt, 20)])[0]
        full = torch.tensor([prompt + out.token_ids[:-1]], device="cuda")
        with torch.no_grad():
            want = hf32(full).logits[0].float()
            hf_rows = hf16(full).logits[0].float()
        positions = [p for p, _ in recorder.rows]
        assert positions == list(range(len(prompt) - 1, full.shape[1]))
        mine = torch.stack([l for _, l in recorder.rows])
        errors["cupaged"].append((mine - want[positions]).abs().amax(dim=1))
        errors["hf"].append((hf_rows[positions] - want[positions]).abs().amax(dim=1))
        assert torch.isfinite(mine).all()
    ours, theirs = (torch.cat(errors[k]) for k in ("cupaged", "hf"))
    assert ours.max() <= 1.25 * theirs.max(), (ours.max(), theirs.max())
    assert ours.median() <= 1.25 * theirs.median(), (ours.median(), theirs.median())


@pytest.mark.gpu
def test_engine_on_gpu_fp8_cache_runs():
    """A bfloat16 model over an fp8 cache (per-layer scales, no plan): every request
    finishes with its tokens, and the blocks come back. (Quantized K/V change the tokens,
    so they are not compared with generate's.)"""
    torch = pytest.importorskip("torch")
    from cupaged.serving.engine import Engine
    from cupaged.serving.llama import Llama, LlamaConfig

    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    model = Llama(LlamaConfig.preset("tiny"), device="cuda", dtype=torch.bfloat16, seed=0)
    engine = Engine(model, _gpu_cache(model, "HND", "fp8_e4m3")(64, 16, True),
                    max_batched_tokens=32, max_running=4)
    prompts = _prompts([30, 7, 45, 12], seed=4)
    requests = [Request(i, p, 9, n=1 + i % 2) for i, p in enumerate(prompts)]
    outputs = engine.run(requests)
    for r, out in zip(requests, outputs):
        assert out.finished and all(len(c.token_ids) == 9 for c in out.completions)
        assert all(0 <= t < model.config.vocab_size for c in out.completions for t in c.token_ids)
    assert engine.cache.num_used_blocks == 0


@pytest.mark.gpu
def test_serve_example_runs(tiny_gpu):
    """examples/serve.py, as the README runs it (from the checkout, the package on the
    path): every request served, with CUDA graphs and without."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    for extra in ([], ["--no-cuda-graphs"]):
        r = subprocess.run([sys.executable, "examples/serve.py", "--preset", "tiny",
                            "--num-requests", "12", "--prompt-len", "16", "80",
                            "--output-len", "6", "--max-running", "8", "--memory-fraction",
                            "0.02", *extra], cwd=root, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "12 requests" in r.stdout and "72 output tokens" in r.stdout, r.stdout
        assert f"CUDA graphs {'off' if extra else 'on'}" in r.stdout


# ---- the compiled engine on the host -----------------------------------------------------------

_HOST_OPS = {}  # "kernels": the HostKernels serving torch.ops.cupaged on CPU tensors


def _host_op_kernels(monkeypatch) -> "HostKernels":
    """HostKernels, run by the CPU kernels of the two ops the compiled engine calls (for
    this test; the registration lasts the process)."""
    kernels = HostKernels(monkeypatch)
    kernels.functional = True
    _register_host_ops()
    monkeypatch.setitem(_HOST_OPS, "kernels", kernels)
    return kernels


def _register_host_ops():
    """CPU kernels for the two ops, running the test's HostKernels (registered once)."""
    from cupaged.integrations import torch_ops

    if _HOST_OPS.get("registered"):
        return

    def write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
              k_scale=None, v_scale=None, kv_layout="vllm"):
        _HOST_OPS["kernels"].reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                               kv_cache_dtype, k_scale, v_scale,
                                               kv_layout=kv_layout)

    def attend(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, lse,
               kv_layout="NHD", causal=True, scale=None, alibi_slopes=None,
               max_query_len=None, max_seq_len=None, kv_cache_dtype="auto", k_scale=None,
               v_scale=None, window=None, logits_soft_cap=None, sinks=None):
        kernels = _HOST_OPS["kernels"]
        kernels.calls["op"] += 1
        out.copy_(kernels._attend(dict(
            query=query, key_cache=key_cache, value_cache=value_cache,
            block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
            kv_layout=kv_layout, causal=causal, max_query_len=max_query_len,
            max_seq_len=max_seq_len, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
            v_scale=v_scale)))

    torch_ops.reshape_and_cache.register_kernel("cpu")(write)
    torch_ops.attention.register_kernel("cpu")(attend)
    _HOST_OPS["registered"] = True


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__[9:])
def test_compiled_engine_on_host_matches_transformers(tiny_cpu, monkeypatch, scenario):
    """Engine(compile=...): the forward traced whole by dynamo (fullgraph) and functionalized
    (aot_eager: no inductor build on the CPU), its attention through torch.ops.cupaged,
    served here by the host kernels: generate's tokens, every attention call an op call,
    and few graphs for all the scenario's steps (the token count and the bounds turn
    dynamic instead of recompiling every step)."""
    import torch

    model, hf = tiny_cpu
    kernels = _host_op_kernels(monkeypatch)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engines = scenario(model, hf, lambda *a: kernels.cache(*a, model_config=model.config),
                       compile={"backend": "aot_eager"})
    assert kernels.calls["op"] > 0 and kernels.calls["plan.run"] == kernels.calls["attention"] == 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 6, f"{graphs} graphs for {len(engines)} engines"


def test_compiled_engine_dynamic_from_the_start_with_inductor(tiny_cpu, monkeypatch):
    """compile={"dynamic": True} with inductor (torch 2.14 or newer: older inductors fail
    on the attention op's output, which it writes in place): generate's tokens."""
    import torch

    from cupaged.serving.engine import _torch_version

    if _torch_version() < (2, 14):
        pytest.skip(f"torch {torch.__version__}: Engine refuses dynamic=True before 2.14")
    model, hf = tiny_cpu
    kernels = _host_op_kernels(monkeypatch)
    torch._dynamo.reset()
    options, compile = [], torch.compile

    def spy(fn, **kwargs):
        options.append(kwargs)
        return compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    scenario_chunked(model, hf, lambda *a: kernels.cache(*a, model_config=model.config),
                     compile={"dynamic": True})
    assert options and all(o == {"fullgraph": True, "dynamic": True} for o in options)
    assert kernels.calls["op"] > 0 and kernels.calls["attention"] == 0


def test_compiled_engine_past_the_recompile_limit_runs_eagerly(tiny_cpu, monkeypatch):
    """Steps whose sizes are 0 or 1 in different combinations (one token, one sequence,
    one table column) each need a graph of their own: one engine serving them in turn
    passes dynamo's recompile limit, and the steps past it run the layers eagerly, with a
    warning, giving the eager engine's tokens; a second compiled model has a limit of its
    own."""
    import torch

    from cupaged.serving.engine import Engine

    model, _ = tiny_cpu
    kernels = _host_op_kernels(monkeypatch)
    # (prompt length, tokens out) per request, a phase's requests at once.
    phases = [[(2, 2), (2, 2)], [(40, 3)] * 3, [(40, 3)], [(3, 3)] * 3, [(5, 2)], [(1, 2)]]

    def serve(compile):
        engine = Engine(model, kernels.cache(256, 16, False, model_config=model.config),
                        max_batched_tokens=64, max_running=8, compile=compile)
        tokens, n = [], 0
        for phase in phases:
            requests = []
            for length, out in phase:
                requests.append(Request(f"r{n}", [1 + n % 50] * length, out))
                n += 1
            tokens += [o.token_ids for o in engine.run(requests)]
        return tokens, engine

    want, _ = serve(False)
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="recompile limit is reached"):
        got, engine = serve({"backend": "aot_eager"})
    assert got == want and engine.forward.__self__._warned
    again, other = serve({"backend": "aot_eager"})  # its own limit: no warning yet
    assert again == want and not other.forward.__self__._warned
