"""A small continuous-batching serving loop over cupaged's paged KV cache.

:class:`Scheduler` decides, step by step, which sequences run and how many of their tokens
(chunked prefill mixed with decodes under a token budget), admits requests while cache
blocks last, preempts by recompute when they run out, and forks sequences for parallel
sampling. It is plain Python over a :class:`cupaged.BlockManager` (no GPU, no torch), and
hands each step to a runner as a :class:`Batch`. :class:`Engine` is that runner for a
model such as :class:`cupaged.serving.llama.Llama` over a :class:`cupaged.PagedKVCache` (torch
framework): it packs the batch into one flat forward, writes and attends through
:func:`cupaged.reshape_and_cache` and :func:`cupaged.attention`, and samples greedily.

Scheduling, each step (``max_batched_tokens`` query tokens at most, ``max_running``
sequences at most):

1. decodes first: every running sequence with one token to compute, oldest admitted first;
2. then the next chunks of partly computed prompts, oldest first, as the budget allows;
3. then new (or preempted) requests from the front of the waiting queue, in order, while
   their whole prompt (and the first generated token) fits in the blocks left over after
   what the running prompts still need; each starts with a first chunk of its prompt.

A running sequence that cannot get the blocks for its next token(s) preempts the most
recently admitted running sequence (possibly itself): its blocks are freed and it goes
back to the front of the waiting queue with its prompt plus what it generated so far as
its new prompt, to be computed again (recompute, no swapping). The oldest sequence always
progresses, and a request whose tokens could never fit in the whole cache is refused at
submission, so every request finishes.

With prefix caching (``BlockManager(prefix_caching=True)``) a prompt is added with its
token ids and the blocks found in the prefix cache are shared instead of computed
(:meth:`BlockManager.num_cached_tokens`). A waiting prompt is looked up whole
(:meth:`BlockManager.cached_prefix_len`) before it is admitted: its cached blocks take no
step budget, so its first chunk is those blocks plus as many tokens as the budget left.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from typing import Hashable, NamedTuple, Sequence

import numpy as np

from .. import cache_ops
from ..attention import AttentionPlan, attention

__all__ = ["Batch", "Completion", "Engine", "OpsAttention", "PagedAttention", "Request",
           "RequestOutput", "SampleId", "Scheduler"]


def _available_blocks(manager) -> int:
    """Blocks an allocation can get now. Managers that keep freed prefix blocks cached
    (evictable) count those too (``num_available_blocks``); others only free ones."""
    return getattr(manager, "num_available_blocks", manager.num_free_blocks)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True, order=True)
class SampleId:
    """The cache's sequence id of sample ``index`` of request ``request``. Its own type,
    equal only to another SampleId of the same request and index: never to a request id,
    whatever hashable values the request ids are (a request ``("a", 1)`` beside a request
    ``"a"`` with two samples)."""

    request: Hashable
    index: int


@dataclass
class Request:
    """A generation request.

    ``prompt``: token ids (at least one). ``max_new_tokens``: tokens to generate (>= 1),
    fewer only if ``eos_token_id`` is generated (it is kept, as the last token). ``n``:
    parallel samples; the sequence is forked after its prompt, the samples sharing the
    prompt's blocks (their first token is the prompt's one sampled token). ``arrival_time``:
    a ``time.perf_counter()`` value; ``None``: the time of submission.
    """

    id: Hashable
    prompt: Sequence[int]
    max_new_tokens: int
    n: int = 1
    eos_token_id: int | None = None
    arrival_time: float | None = None


@dataclass
class Completion:
    """One sample's output: its generated token ids, the ``time.perf_counter()`` time each
    was sampled at, and why it stopped (``"length"``, ``"eos"``; ``None`` while running)."""

    token_ids: list = field(default_factory=list)
    token_times: list = field(default_factory=list)
    finish_reason: str | None = None

    def record(self, token: int, now: float, request: Request) -> bool:
        """Append a token sampled at ``now``; True when it ends the sample (the
        request's ``eos_token_id``, or its ``max_new_tokens`` reached)."""
        self.token_ids.append(token)
        self.token_times.append(now)
        if token == request.eos_token_id:
            self.finish_reason = "eos"
        elif len(self.token_ids) >= request.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's output: ``completions`` (``n`` of them), its ``arrival_time``, how many
    prompt tokens were found in the prefix cache (summed over admissions) and how often it
    was preempted. ``token_ids`` and ``token_times`` are the first completion's."""

    id: Hashable
    prompt_len: int
    arrival_time: float
    completions: list
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list:
        return self.completions[0].token_ids

    @property
    def token_times(self) -> list:
        return self.completions[0].token_times

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token (None before it)."""
        times = self.token_times
        return times[0] - self.arrival_time if times else None

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first, over all completions (None with
        fewer than two tokens)."""
        gaps = [(c.token_times[-1] - c.token_times[0], len(c.token_times) - 1)
                for c in self.completions if len(c.token_times) > 1]
        if not gaps:
            return None
        return sum(g for g, _ in gaps) / sum(k for _, k in gaps)


class _Seq:
    """A sequence the scheduler tracks: one sample of a request."""

    __slots__ = ("id", "request", "output", "completion", "tokens", "computed", "forks_left",
                 "shares_tail", "stamp", "max_tokens")

    def __init__(self, seq_id, request: Request, output: RequestOutput, completion: Completion,
                 tokens: list):
        self.id = seq_id  # the cache's sequence id
        self.request, self.output, self.completion = request, output, completion
        self.tokens = tokens  # prompt + generated so far
        self.computed = 0  # leading tokens whose K/V are in the cache
        self.forks_left = request.n - 1  # samples to fork once the prompt is computed
        self.shares_tail = False  # since a fork, until its next append: copy-on-write
        self.stamp = 0  # admission order (later: larger)
        # The most tokens it ever holds in the cache: the last sampled one is never computed.
        self.max_tokens = len(request.prompt) + request.max_new_tokens - 1

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed


class _Row(NamedTuple):
    """A sequence scheduled in the step being built."""

    seq: _Seq
    tokens: int  # query tokens
    blocks: int  # blocks its append may take (0 for a sequence added this step)
    slots: object = None  # added this step: its query tokens' slots, from add()


@dataclass
class Batch:
    """One step's work, from :meth:`Scheduler.schedule`: ``n`` sequences (rows), each with
    ``num_tokens[i] >= 1`` query tokens.

    The first ``num_appended`` sequences were in the cache before the step: the runner
    appends their tokens (``cache.step(seq_ids, num_tokens=step_num_tokens,
    token_ids=append_token_ids)`` or ``BlockManager.append``). The others were added by the
    scheduler this step (``BlockManager.add``); their query tokens' slots are
    ``added_slots`` (they join ``cache.step`` with 0 tokens, for their tables and lengths).
    """

    seq_ids: list  # the cache's sequence ids, in row order
    num_tokens: np.ndarray  # int64 [n]: query tokens of each sequence
    num_appended: int
    tokens: np.ndarray  # int64 [T]: the query tokens' ids, sequence after sequence
    positions: np.ndarray  # int64 [T]: their positions in their sequences
    query_start_loc: np.ndarray  # int32 [n + 1]: where each sequence's rows start, from 0
    seq_lens: np.ndarray  # int32 [n]: each sequence's tokens in the cache after the step
    added_slots: np.ndarray  # int64 [T - appended tokens]: cache slots of the added rows
    sample_rows: np.ndarray  # int64 [k]: query rows whose logits give a token, ascending
    prefix_caching: bool
    _seqs: list  # the scheduler's sequences, in row order
    _sampling: list  # the indices of the sequences that sample

    @property
    def num_query_tokens(self) -> int:
        return len(self.tokens)

    @property
    def step_num_tokens(self) -> list:
        """Per sequence, the tokens to append: ``num_tokens`` for the appended ones, 0 for
        those added this step."""
        k = self.num_tokens.tolist()
        return k[:self.num_appended] + [0] * (len(k) - self.num_appended)

    @property
    def append_token_ids(self) -> list | None:
        """The appended tokens' ids, flat in step order, with prefix caching (so filled
        blocks are registered); ``None`` without."""
        if not self.prefix_caching:
            return None
        return self.tokens[:self.query_start_loc[self.num_appended]].tolist()


class Scheduler:
    """Continuous batching over a :class:`cupaged.BlockManager` (or anything with its
    ``add``, ``fork``, ``free``, ``ref_count``, ``block_table``, ``num_cached_tokens``,
    ``num_free_blocks``, ``num_blocks``, ``block_size`` and ``prefix_caching``; with
    prefix caching also ``cached_prefix_len``). The
    policy is in the module's docstring.

    A runner loops: ``batch = schedule()``; appends the batch's tokens to the cache and
    computes them (:class:`Batch` says how); ``update(batch, tokens)`` with one sampled
    token per ``batch.sample_rows`` entry. The scheduler adds, forks and frees sequences in
    the manager itself; the runner only appends.
    """

    def __init__(self, manager, *, max_batched_tokens: int = 2048, max_running: int = 256):
        if max_running < 1 or max_batched_tokens < max_running:
            raise ValueError(f"need 1 <= max_running <= max_batched_tokens (every running "
                             f"sequence's decode fits a step), got max_running={max_running}, "
                             f"max_batched_tokens={max_batched_tokens}")
        self.manager = manager
        self.max_batched_tokens, self.max_running = max_batched_tokens, max_running
        self.prefix_caching = bool(getattr(manager, "prefix_caching", False))
        self.waiting: deque = deque()  # _Seq, not in the cache
        self.running: list = []  # _Seq in the cache, in admission order
        self._ids: set = set()  # unfinished requests' ids
        self._stamp = 0

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, request: Request, now: float | None = None) -> RequestOutput:
        """Queue a request; returns its output, filled in as it runs. Raises ValueError for
        a request that could never run: an empty prompt, ``max_new_tokens < 1``, ``n``
        outside ``1..max_running``, a duplicate id, or more tokens than the whole cache
        holds."""
        prompt = [int(t) for t in request.prompt]
        if not prompt:
            raise ValueError(f"request {request.id!r}: the prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError(f"request {request.id!r}: max_new_tokens must be >= 1, got "
                             f"{request.max_new_tokens}")
        if not 1 <= request.n <= self.max_running:
            raise ValueError(f"request {request.id!r}: n must be from 1 to max_running "
                             f"({self.max_running}), got {request.n}")
        if request.id in self._ids:
            raise ValueError(f"request {request.id!r} is already queued or running")
        m = self.manager
        tokens = len(prompt) + request.max_new_tokens - 1
        if _blocks(tokens, m.block_size) > m.num_blocks:
            raise ValueError(
                f"request {request.id!r} can never fit: its prompt ({len(prompt)} tokens) and "
                f"max_new_tokens ({request.max_new_tokens}) need {tokens} tokens in the cache, "
                f"{_blocks(tokens, m.block_size)} blocks of {m.block_size}; the whole cache has "
                f"{m.num_blocks}")
        arrival = request.arrival_time
        if arrival is None:
            arrival = time.perf_counter() if now is None else now
        output = RequestOutput(request.id, len(prompt), arrival,
                               [Completion() for _ in range(request.n)])
        self.waiting.append(_Seq(SampleId(request.id, 0), request, output,
                                 output.completions[0], prompt))
        self._ids.add(request.id)
        return output

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> Batch | None:
        """The next step's batch (``None`` when nothing is waiting or running). Adds the
        admitted prompts to the manager (and frees preempted sequences) as it goes."""
        self._rows: list = []  # _Row, in batch order
        self._need = 0  # blocks the scheduled appends may take
        self._budget = self.max_batched_tokens
        self._decodes()
        self._chunks()
        num_appended = len(self._rows)
        self._admit()
        rows, self._rows = self._rows, []
        if not rows:
            if self.has_unfinished():  # the oldest request always fits: a bug if not
                raise RuntimeError(f"nothing could be scheduled: {len(self.waiting)} waiting, "
                                   f"{len(self.running)} running")
            return None
        return self._batch(rows, num_appended)

    def _avail(self) -> int:
        return _available_blocks(self.manager) - self._need

    def _tail_shared(self, seq: _Seq) -> bool:
        """Whether appending to ``seq`` copies its partly filled last block first."""
        m = self.manager
        return (seq.shares_tail and seq.computed % m.block_size != 0
                and m.ref_count(m.block_table(seq.id)[-1]) > 1)

    def _append_blocks(self, seq: _Seq, k: int) -> int:
        """Blocks appending ``k`` tokens to ``seq`` may take (a copy-on-write included:
        its last writer would write in place, so this may count one too many)."""
        bs, n = self.manager.block_size, seq.computed
        return _blocks(n + k, bs) - _blocks(n, bs) + self._tail_shared(seq)

    def _capacity(self, seq: _Seq, blocks: int) -> int:
        """The most tokens ``seq`` can append with ``blocks`` blocks."""
        bs = self.manager.block_size
        room = -seq.computed % bs  # free slots of its last block
        if room and self._tail_shared(seq):
            return room + (blocks - 1) * bs if blocks > 0 else 0
        return room + max(blocks, 0) * bs

    def _schedule(self, seq: _Seq, k: int, blocks: int) -> None:
        self._rows.append(_Row(seq, k, blocks))
        self._need += blocks
        self._budget -= k

    def _make_room(self, seq: _Seq, blocks: int) -> bool:
        """Preempt the newest running sequences until ``blocks`` fit; False if ``seq``
        itself had to go."""
        while blocks > self._avail():
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _decodes(self) -> None:
        for seq in list(self.running):
            if seq.pending == 1 and seq.stamp:  # stamp 0: preempted meanwhile
                blocks = self._append_blocks(seq, 1)
                if self._make_room(seq, blocks):
                    self._schedule(seq, 1, blocks)

    def _chunks(self) -> None:
        scheduled = {id(row.seq) for row in self._rows}
        for seq in list(self.running):
            if self._budget == 0:
                return
            if seq.pending <= 1 or not seq.stamp or id(seq) in scheduled:
                continue
            k = min(seq.pending, self._budget, self._capacity(seq, self._avail()))
            if k == 0:  # not one token fits: make room for one block's worth
                k = min(seq.pending, self._budget, self.manager.block_size)
                if not self._make_room(seq, self._append_blocks(seq, k)):
                    continue
                k = min(seq.pending, self._budget, self._capacity(seq, self._avail()))
            self._schedule(seq, k, self._append_blocks(seq, k))

    def _admit(self) -> None:
        m, bs = self.manager, self.manager.block_size
        seats = len(self.running) + sum(s.forks_left for s in self.running)
        # Blocks the running prompts still need past this step: kept free for them.
        scheduled = {id(row.seq): row.tokens for row in self._rows}
        reserve = sum(_blocks(len(s.tokens), bs) - _blocks(s.computed + scheduled.get(id(s), 0), bs)
                      for s in self.running)
        while self.waiting and self._budget > 0:
            seq = self.waiting[0]
            if seats + 1 + seq.forks_left > self.max_running:
                return
            size = len(seq.tokens)
            # Room for the whole prompt and the first generated token.
            if _blocks(min(size + 1, seq.max_tokens), bs) + reserve > self._avail():
                return
            # Its cached leading blocks cost no budget: the first chunk is them and what
            # the budget allows (add() finds the same blocks in the chunk's ids).
            hit = m.cached_prefix_len(seq.tokens) if self.prefix_caching else 0
            k = min(size, hit + self._budget)
            slots = m.add(seq.id, k, seq.tokens[:k] if self.prefix_caching else None)
            cached = m.num_cached_tokens(seq.id)
            self.waiting.popleft()
            self._stamp += 1
            seq.stamp, seq.computed = self._stamp, cached
            seq.output.num_cached_tokens += cached
            self.running.append(seq)
            seats += 1 + seq.forks_left
            reserve += _blocks(size, bs) - _blocks(k, bs)
            self._rows.append(_Row(seq, k - cached, 0, slots))  # add() took its blocks
            self._budget -= k - cached

    def _preempt(self, seq: _Seq) -> None:
        """Free ``seq``'s blocks and requeue it at the front of the waiting queue, to be
        computed again from its prompt and generated tokens."""
        for i, row in enumerate(self._rows):
            if row.seq is seq:  # scheduled earlier in this step: unschedule
                del self._rows[i]
                self._need -= row.blocks
                self._budget += row.tokens
                break
        self.manager.free(seq.id)
        self.running.remove(seq)
        seq.computed, seq.stamp, seq.shares_tail = 0, 0, False
        seq.output.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _batch(self, rows: list, num_appended: int) -> Batch:
        seqs = [row.seq for row in rows]
        counts = np.array([row.tokens for row in rows], dtype=np.int64)
        starts = np.array([s.computed for s in seqs], dtype=np.int64)
        qsl = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(counts, out=qsl[1:])
        total = int(qsl[-1])
        tokens = np.fromiter(chain.from_iterable(
            s.tokens[a:a + k] for s, a, k in zip(seqs, starts.tolist(), counts.tolist())),
            np.int64, total)
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - qsl[:-1], counts)
        ends = starts + counts
        sampling = [i for i, s in enumerate(seqs) if ends[i] == len(s.tokens)]
        added = [row.slots for row in rows[num_appended:]]
        return Batch(
            seq_ids=[s.id for s in seqs], num_tokens=counts, num_appended=num_appended,
            tokens=tokens, positions=positions, query_start_loc=qsl,
            seq_lens=ends.astype(np.int32),
            added_slots=np.concatenate(added) if added else np.zeros(0, np.int64),
            sample_rows=qsl[1:][sampling].astype(np.int64) - 1,
            prefix_caching=self.prefix_caching, _seqs=seqs, _sampling=sampling)

    def update(self, batch: Batch, sampled: Sequence[int], now: float | None = None) -> list:
        """Record a computed batch: ``sampled[j]`` is the token sampled from query row
        ``batch.sample_rows[j]``. Finishes, frees and forks sequences; returns the outputs
        of requests that finished with this step. An update that raises has changed
        nothing: the same batch can be recorded again."""
        if len(sampled) != len(batch.sample_rows):
            raise ValueError(f"{len(sampled)} tokens for {len(batch.sample_rows)} sampled rows")
        tokens = [int(t) for t in sampled]
        now = time.perf_counter() if now is None else now
        families = self._fork(batch)  # the one part that can fail: done (or undone) first
        for seq, k in zip(batch._seqs, batch.num_tokens.tolist()):
            seq.computed += k
            seq.shares_tail = False
        finished = []
        for i, token, children in zip(batch._sampling, tokens, families):
            seq = batch._seqs[i]
            if children:  # the prompt is computed: the other samples start here
                self._adopt(seq, children)
            for s in (seq, *children):
                s.tokens.append(token)
                if s.completion.record(token, now, s.request):
                    self.manager.free(s.id)
                    self.running.remove(s)
                    if s.output.finished:
                        self._ids.discard(s.request.id)
                        finished.append(s.output)
        return finished

    def _fork(self, batch: Batch) -> list:
        """For each sampling sequence of ``batch``, the samples still to fork from it,
        forked in the manager. If a fork fails, those made are freed before it raises, so
        the manager is as it was."""
        families, made = [], []
        try:
            for i in batch._sampling:
                parent, children = batch._seqs[i], []
                r = parent.request
                for j in range(r.n - parent.forks_left, r.n):
                    child = _Seq(SampleId(r.id, j), r, parent.output, parent.output.completions[j],
                                 list(parent.tokens))
                    self.manager.fork(parent.id, child.id)
                    made.append(child)
                    children.append(child)
                families.append(children)
        except BaseException:
            for child in reversed(made):
                self.manager.free(child.id)
            raise
        return families

    def _adopt(self, parent: _Seq, children: list) -> None:
        """Forked samples join the running sequences, sharing the parent's cache (its
        partly filled last block is copied on the next write)."""
        for child in children:
            child.forks_left = 0
            child.computed, child.shares_tail = parent.computed, True
            self._stamp += 1
            child.stamp = self._stamp
            self.running.append(child)
        parent.forks_left, parent.shares_tail = 0, True


class PagedAttention:
    """The engine's default attention backend: for one step, the model's per-layer
    attention over the paged cache. Each layer writes the new tokens' K/V into their
    slots (:func:`cupaged.reshape_and_cache`), then attends with :func:`cupaged.attention`
    (one AttentionPlan for the step's layers; per layer over an fp8 cache, whose scales
    differ by layer).

    A backend is anything called once per step as ``backend(cache, batch, slot_mapping,
    block_tables, seq_lens, query_start_loc)`` (the device arrays of the step, int32)
    that returns the ``attention(layer, q, k, v)`` callable the model runs for that step.
    """

    # The decode graphs hand a backend that writes into them an ``out`` buffer and a
    # split-KV workspace of their own; one whose outputs the graph allocates needs neither.
    takes_buffers = True

    def __init__(self, cache, batch: Batch, slot_mapping, block_tables, seq_lens,
                 query_start_loc):
        self._bind(cache, slot_mapping, (block_tables, seq_lens, query_start_loc),
                   max_query_len=int(batch.num_tokens.max()),
                   max_seq_len=int(batch.seq_lens.max()))

    @classmethod
    def _static(cls, cache, slot_mapping, tables, **options) -> "PagedAttention":
        """Over arrays that outlive a step (the decode graphs'): the bounds given, and
        ``out`` and ``workspace`` so that nothing is allocated."""
        self = cls.__new__(cls)
        self._bind(cache, slot_mapping, tables, **options)
        return self

    def _bind(self, cache, slot_mapping, tables, *, max_query_len, max_seq_len, out=None,
              workspace=None):
        self.cache, self.slot_mapping, self.tables = cache, slot_mapping, tables
        self.options = dict(max_query_len=max_query_len, max_seq_len=max_seq_len, out=out,
                            workspace=workspace)
        self.plan = None

    def __call__(self, layer: int, q, k, v):
        cache = self.cache
        kc, vc = cache.key_caches[layer], cache.value_caches[layer]
        kw = cache.layer_kwargs(layer)
        cache_ops.reshape_and_cache(k, v, kc, vc, self.slot_mapping, kv_layout=cache.kv_layout,
                                    **kw)
        if kw["k_scale"] is not None:  # fp8: each layer its own scales, no plan to share
            return attention(q, kc, vc, *self.tables, kv_layout=cache.kv_layout,
                                    causal=True, **self.options, **kw)
        if self.plan is None:
            self.plan = AttentionPlan(q, kc, vc, *self.tables, kv_layout=cache.kv_layout,
                                             causal=True, **self.options)
        return self.plan.run(q, kc, vc, out=self.options["out"])


class OpsAttention(PagedAttention):
    """The attention backend of a compiled engine (``Engine(compile=True)``): the same
    cache write and attention as :class:`PagedAttention`, through the custom ops
    ``torch.ops.cupaged.reshape_and_cache`` and ``torch.ops.cupaged.attention``, which
    ``torch.compile`` traces without a graph break (no plan object: each layer's call is
    an op in the graph, its output allocated in the graph). Per-tensor fp8 scales are
    passed as the ops' scale tensors; per-token scales are not taken (see
    :mod:`cupaged.integrations.torch_ops`)."""

    takes_buffers = False

    def __call__(self, layer: int, q, k, v):
        return self.layer(layer)(q, k, v)

    def layer(self, layer: int) -> "_OpsLayer":
        """``attend(q, k, v)`` of one layer, its arrays as attributes (a compiled layer's
        inputs: see :meth:`cupaged.serving.llama.Llama.compiled`)."""
        cache = self.cache
        kw = cache.layer_kwargs(layer)
        return _OpsLayer(cache.key_caches[layer], cache.value_caches[layer], kw["k_scale"],
                         kw["v_scale"], self.slot_mapping, *self.tables,
                         self.options["max_query_len"], self.options["max_seq_len"],
                         cache.kv_layout, kw["kv_cache_dtype"])


class _OpsLayer(NamedTuple):
    """One layer's cache write and attention through ``torch.ops.cupaged``."""

    key_cache: object
    value_cache: object
    k_scale: object
    v_scale: object
    slot_mapping: object
    block_tables: object
    seq_lens: object
    query_start_loc: object
    max_query_len: int
    max_seq_len: int
    kv_layout: str
    kv_cache_dtype: str

    def __call__(self, q, k, v):
        import torch

        ops = torch.ops.cupaged
        ops.reshape_and_cache(k, v, self.key_cache, self.value_cache, self.slot_mapping,
                              self.kv_cache_dtype, self.k_scale, self.v_scale,
                              kv_layout=self.kv_layout)
        out = torch.empty_like(q)
        ops.attention(q, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                      self.query_start_loc, out, None, kv_layout=self.kv_layout, causal=True,
                      max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
                      kv_cache_dtype=self.kv_cache_dtype, k_scale=self.k_scale,
                      v_scale=self.v_scale)
        return out


def _torch_version() -> tuple:
    """torch's (major, minor)."""
    import torch

    return tuple(int(x) for x in torch.__version__.split(".")[:2])


def _is_inductor(backend) -> bool:
    """Whether a ``torch.compile`` backend (None: the default) is inductor, by name or as
    its compile function."""
    if backend is None or backend == "inductor":
        return True
    return getattr(backend, "__module__", "").startswith("torch._inductor")


def _graph_sizes(max_batch: int) -> list:
    """The padded batch sizes of decode graphs: 1, 2, 4, 8, then multiples of 8, up to
    the first that holds ``max_batch``."""
    sizes = [1, 2, 4] + list(range(8, max_batch + 8, 8))
    return sizes[:next(i for i, b in enumerate(sizes) if b >= max_batch) + 1]


class _DecodeGraphs:
    """The CUDA graphs of an :class:`Engine`'s decode steps (see ``cuda_graphs``).

    Every graph reads the same static inputs (token ids, positions, slots, block tables,
    lengths: the first ``b`` rows of buffers for ``max_batch`` rows) and writes its greedy
    tokens to its own output; all share one memory pool and (for a backend that
    ``takes_buffers``) one attention output and split-KV workspace, as they never run at
    once. A step fills the first rows from the step's own device arrays
    and marks the padding rows (slot -1: no write; length 0: no keys, a zero output row
    that nothing samples)."""

    def __init__(self, model, cache, max_batch: int, max_model_len: int, forward=None,
                 backend=PagedAttention):
        import torch

        from ..decode import DecodeWorkspace

        c = model.config
        self.model, self.cache = model, cache
        self.forward, self.backend = forward or model.forward, backend
        self.sizes = _graph_sizes(max_batch)
        m = self.sizes[-1]
        self.width = _blocks(max_model_len, cache.block_size)
        self.max_seq_len = self.width * cache.block_size
        dev = cache.key_caches[0].device
        i32 = dict(dtype=torch.int32, device=dev)
        self.inputs = torch.zeros(2 * m, dtype=torch.int64, device=dev)  # tokens, positions
        self.host = torch.zeros(2 * m, dtype=torch.int64).pin_memory()
        self.host_np = self.host.numpy()
        self.slots = torch.full((m,), -1, **i32)
        self.tables = torch.zeros((m, self.width), **i32)
        self.lens = torch.zeros((m,), **i32)
        self.starts = torch.arange(m + 1, **i32)  # one query row per sequence
        self.out = self.workspace = None
        if backend.takes_buffers:
            self.out = torch.empty((m, c.num_heads, c.head_dim), dtype=model.dtype,
                                   device=dev)
            self.workspace = DecodeWorkspace(m, c.num_heads, c.head_dim, device=dev.index)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs = {}  # padded batch size -> (CUDAGraph, its sampled tokens)
        self.failed = set()  # sizes whose capture failed at their first step: eager
        self.num_replays = 0

    def serves(self, batch: Batch, step) -> bool:
        """Whether a graph runs this step: decodes only, a batch no larger than the
        largest graph, tables no wider than the graphs', and a size whose capture has
        not failed."""
        n = len(batch.seq_ids)
        return (batch.num_appended == n == len(batch.tokens) == len(batch.sample_rows)
                and n <= self.sizes[-1] and step.block_tables.shape[1] <= self.width
                and self._size(n) not in self.failed)

    def _size(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def replay(self, batch: Batch, step) -> list | None:
        """The step's greedy tokens from its size's graph (captured now if it is new);
        ``None`` when that capture fails (the size then runs eagerly, with a warning)."""
        import torch

        n = len(batch.seq_ids)
        b = self._size(n)
        m = self.sizes[-1]
        # Pinned staging, one copy. The last step's copy out of it has finished: its
        # tokens came back (a sync) after it in stream order.
        host = self.host_np
        host[:n], host[m:m + n] = batch.tokens, batch.positions
        self.inputs.copy_(self.host, non_blocking=True)
        w = step.block_tables.shape[1]
        self.slots[:n].copy_(step.slot_mapping)
        self.lens[:n].copy_(step.seq_lens)
        self.tables[:n, :w].copy_(step.block_tables)
        if b > n:  # the padding rows, left by an earlier step
            self.slots[n:b].fill_(-1)
            self.lens[n:b].fill_(0)
        if b not in self.graphs:
            try:
                self.capture([b])
            except Exception as e:  # out of memory, say: this size runs eagerly from now on
                import warnings

                self.failed.add(b)
                warnings.warn(f"cupaged Engine: the decode graph of batch size {b} failed to "
                              f"capture ({type(e).__name__}: {e}); that size runs eagerly",
                              RuntimeWarning, stacklevel=3)
                return None
        graph, sampled = self.graphs[b]
        with torch.cuda.device(self.inputs.device):
            graph.replay()
        self.num_replays += 1
        return sampled[:n].tolist()

    def capture(self, sizes) -> None:
        import torch

        todo = sorted({int(b) for b in sizes} - set(self.graphs), reverse=True)
        bad = [b for b in todo if b not in self.sizes]
        if bad:
            raise ValueError(f"no decode graph of batch size {bad[0]}: the sizes are "
                             f"{self.sizes}")
        if not todo:
            return
        # Captured with no keys to read and no slots to write, so the warm-up run that
        # precedes each capture changes nothing; replay() fills the rows it runs.
        saved = self.slots.clone(), self.lens.clone()
        self.slots.fill_(-1)
        self.lens.fill_(0)
        # On the cache's device, whichever is current: capture and launches go there.
        with torch.cuda.device(self.inputs.device):
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            try:
                for b in todo:  # largest first: the smaller graphs reuse its pool's memory
                    side.wait_stream(current)
                    with torch.cuda.stream(side):
                        self._forward(b)  # first launches (cuBLAS, modules) uncaptured
                    current.wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        sampled = self._forward(b)
                    self.graphs[b] = (graph, sampled)
            finally:
                self.slots.copy_(saved[0])
                self.lens.copy_(saved[1])

    def _forward(self, b: int):
        """The greedy tokens of the first ``b`` rows (launched on the current stream)."""
        m = self.sizes[-1]
        attention = self.backend._static(
            self.cache, self.slots[:b], (self.tables[:b], self.lens[:b], self.starts[:b + 1]),
            max_query_len=1, max_seq_len=self.max_seq_len,
            out=None if self.out is None else self.out[:b], workspace=self.workspace)
        logits = self.forward(self.inputs[:b], self.inputs[m:m + b], attention)
        return logits.argmax(dim=-1)


class Engine:
    """Continuous batching of a model over a paged KV cache, greedy sampling.

    ``model``: a :class:`cupaged.serving.llama.Llama` (or anything with its ``config`` and
    ``forward(tokens, positions, attention, logits_rows)``); ``cache``: a
    :class:`cupaged.PagedKVCache` made with ``framework="torch"`` on the model's device,
    with the model's layers, KV heads, head size and dtype (any layout, fp8 or not,
    prefix caching or not). ``max_batched_tokens`` and ``max_running`` go to the
    :class:`Scheduler`. ``attention``: the attention backend (see :class:`PagedAttention`,
    the default); ``cupaged-bench e2e`` plugs FlashInfer's kernels in here.

    ``cuda_graphs=True``: decode steps (every sequence computing one token) replay a CUDA
    graph of the whole forward and the greedy sampling, one graph per padded batch size
    (1, 2, 4, 8, then multiples of 8, the last the first at or above ``max_running``),
    captured by :meth:`capture_graphs` (recommended, before serving) or at a size's first
    step (a size whose capture then fails runs eagerly, with a warning); other steps run
    eagerly. Padding rows write no
    K/V and attend over nothing. The graphs' block tables hold ``max_model_len`` tokens
    per sequence (default: the whole cache) and their attention is planned for that
    length: give the longest sequence the engine will serve (prompt plus generated
    tokens), as a shorter bound plans better splits for short contexts; a step with a
    longer sequence runs eagerly. Graphs need the default attention backend and keep
    their inputs, outputs and activations (the largest batch's) allocated.

    ``compile=True``: each decoder layer runs under ``torch.compile(fullgraph=True)``
    (``model.compiled()``, such as :meth:`cupaged.serving.llama.Llama.compiled`: one graph
    serves every layer; inductor fuses the norms, RoPE, activation and residuals), its
    attention through ``torch.ops.cupaged`` (:class:`OpsAttention`), in every step and in
    the decode graphs. The first steps of new shapes compile (seconds each; the token
    count and bounds turn dynamic after their first change, so a few graphs serve every
    step). It needs the default attention backend and, for fp8 caches, per-tensor
    scales. A dict instead of True: keyword arguments for ``torch.compile``
    (``{"mode": "max-autotune"}``, ``{"backend": "aot_eager"}``) over the default
    ``fullgraph=True``; ``{"dynamic": True}`` with inductor needs torch 2.14 or newer
    (refused before: pytorch/pytorch#189271).

    ``submit(request)`` queues a request, ``step()`` runs one batch and returns the
    requests that finished, ``run(requests)`` does both until everything is done.
    """

    def __init__(self, model, cache, *, max_batched_tokens: int = 2048, max_running: int = 256,
                 attention=PagedAttention, cuda_graphs: bool = False,
                 max_model_len: int | None = None, compile: bool | dict = False):
        import torch  # also for _arrays, which maps dtypes through an imported torch

        from .. import _arrays

        c = model.config
        if cache.framework != "torch":
            raise ValueError("the cache must be made with framework='torch'")
        for what, want, got in (("layers", c.num_layers, cache.num_layers),
                                ("KV heads", c.num_kv_heads, cache.num_kv_heads),
                                ("head size", c.head_dim, cache.head_size)):
            if want != got:
                raise ValueError(f"the model has {want} {what}, the cache {got}")
        if _arrays.torch_dtype(cache.dtype) != model.dtype:
            raise ValueError(f"the model's dtype is {model.dtype}, the cache's {cache.dtype}")
        self.model, self.cache, self.attention = model, cache, attention
        self.forward = model.forward
        if compile or isinstance(compile, dict):  # {}: compiled with the defaults
            if attention is not PagedAttention:
                raise ValueError("compile=True runs cupaged's attention through its torch ops: "
                                 "it needs the default attention backend")
            if cache.kv_scales == "token":
                raise ValueError("compile=True takes per-tensor fp8 scales (the ops do not "
                                 "write per-token scale arrays): make the cache with "
                                 "kv_scales='tensor'")
            from ..integrations import torch_ops  # noqa: F401  (registers torch.ops.cupaged)

            if not hasattr(model, "compiled"):
                raise ValueError("compile=True needs a model with compiled(**options) (such "
                                 "as cupaged.serving.llama.Llama)")
            self.attention = OpsAttention
            # By default the token count, the step's bounds and the table width turn
            # dynamic after their first change (a few graphs in all).
            options = dict(fullgraph=True)
            options.update(compile if isinstance(compile, dict) else {})
            if (options.get("dynamic") is True and _is_inductor(options.get("backend"))
                    and _torch_version() < (2, 14)):
                # The attention op writes the output allocated before it in place, and
                # these inductors fail on that buffer under symbolic shapes (a KeyError
                # in Scheduler.compute_ancestors, pytorch/pytorch#189271).
                raise ValueError(f"compile={{'dynamic': True}} with inductor needs torch 2.14 "
                                 f"or newer (torch {torch.__version__}'s inductor fails on it: "
                                 f"pytorch/pytorch#189271); leave 'dynamic' unset (shapes "
                                 f"turn dynamic after their first change)")
            self.forward = model.compiled(**options).forward
        self.device = cache.key_caches[0].device
        self.scheduler = Scheduler(cache.manager, max_batched_tokens=max_batched_tokens,
                                   max_running=max_running)
        self.graphs = None
        if cuda_graphs:
            if attention is not PagedAttention:
                raise ValueError("cuda_graphs=True replays cupaged's own attention: it needs "
                                 "the default attention backend")
            if self.device.type != "cuda":
                raise ValueError("cuda_graphs=True needs a CUDA device")
            if max_model_len is None:
                max_model_len = cache.manager.num_blocks * cache.block_size
            try:
                length = operator.index(max_model_len)
            except TypeError:
                length = 0
            if isinstance(max_model_len, bool) or length < 1:
                raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
            self.graphs = _DecodeGraphs(model, cache, max_running, length, self.forward,
                                        self.attention)

    def submit(self, request: Request) -> RequestOutput:
        """Queue a request (see :meth:`Scheduler.submit`); returns its output, filled in
        as it runs."""
        return self.scheduler.submit(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list:
        """Run one batch: returns the outputs of the requests it finished."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        return self.scheduler.update(batch, self.execute(batch))

    def run(self, requests: Sequence[Request]) -> list:
        """Submit ``requests`` and step until all of them (and anything queued before)
        finish; returns their outputs in order."""
        outputs = [self.submit(r) for r in requests]
        while self.has_unfinished():
            self.step()
        return outputs

    def capture_graphs(self, batch_sizes=None) -> None:
        """Capture the decode graphs of ``batch_sizes`` now (default: every size a step can
        be padded to) rather than at each size's first decode step: startup work, outside
        of the steps a benchmark times. Needs ``cuda_graphs=True``."""
        if self.graphs is None:
            raise ValueError("capture_graphs() needs an Engine made with cuda_graphs=True")
        self.graphs.capture(self.graphs.sizes if batch_sizes is None else batch_sizes)

    def execute(self, batch: Batch) -> list:
        """Compute one scheduled batch: append its tokens to the cache, run the model
        (through a captured graph where one serves) and sample greedily; the sampled
        tokens, one per ``batch.sample_rows`` entry. :meth:`step` calls it between
        :meth:`Scheduler.schedule` and :meth:`Scheduler.update`; a benchmark may wrap it."""
        import torch

        cache = self.cache
        step = cache.step(batch.seq_ids, num_tokens=batch.step_num_tokens,
                          token_ids=batch.append_token_ids)
        if self.graphs is not None and self.graphs.serves(batch, step):
            sampled = self.graphs.replay(batch, step)
            if sampled is not None:
                return sampled
        # One host-to-device copy for the model's inputs and what cache.step cannot know:
        # the added rows' slots and, with them, the query offsets of the whole batch.
        t, added = batch.num_query_tokens, len(batch.added_slots)
        parts = [batch.tokens, batch.positions, batch.sample_rows]
        if added:
            parts += [batch.added_slots, batch.query_start_loc.astype(np.int64)]
        host = torch.from_numpy(np.concatenate(parts))
        dev = host.to(self.device)
        tokens, positions = dev[:t], dev[t:2 * t]
        at = 2 * t + len(batch.sample_rows)
        logits_rows = dev[2 * t:at]
        if added:
            slot_mapping = torch.cat((step.slot_mapping, dev[at:at + added].to(torch.int32)))
            query_start_loc = dev[at + added:].to(torch.int32)
        else:
            slot_mapping, query_start_loc = step.slot_mapping, step.query_start_loc
        attention = self.attention(cache, batch, slot_mapping, step.block_tables, step.seq_lens,
                                   query_start_loc)
        logits = self.forward(tokens, positions, attention, logits_rows)
        return logits.argmax(dim=-1).tolist()
