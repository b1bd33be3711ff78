"""BlockManager under random add / append / fork / free sequences, with and without prefix
caching (blocks cached after their sequences end, evicted least recently released first,
found again only with the same tokens), appends of any number of tokens per sequence (0
included); failed calls change nothing (a failed upload after an eviction included);
PagedKVCache.step and .prefill plan, upload and only then apply (checked with host
stand-ins for the device); fp8 caches' arguments, shapes, dtypes, scale arrays and bytes
(with host arrays). No GPU needed, except for the tests marked gpu at the end: every cache
layout through reshape_and_cache and cupaged.attention, mixed steps with copy-on-write, a
prefix-cache hit against the whole prompt, and fp8 caches (both frameworks, both scale
modes) through prefill, decode and a fork's copy-on-write."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cupaged
import cupaged.cache_ops
from cupaged import BlockManager, DecodeStep, OutOfBlocks, PagedKVCache, Step, reference, testing
from cupaged import _dtypes

from conftest import assert_close


def snapshot(m: BlockManager) -> dict:
    """Everything a BlockManager answers, its host table and lengths for live rows, and the
    internals that decide what later calls do (free-list and LRU order, prefix registry and
    block generations, the token ids of partly filled blocks): equal snapshots mean
    nothing changed."""
    seqs = m.sequences
    bt, cl = m.tables(seqs)
    return {
        "sequences": seqs,
        "counts": (m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks,
                   m.num_available_blocks),
        "free": list(m._free),
        "lru": list(m._lru),
        "gen": list(m._gen),
        "refs": [m.ref_count(b) for b in range(m.num_blocks)],
        "seqs": {s: (s in m, m.context_len(s), m.block_table(s), m.num_cached_tokens(s))
                 for s in seqs},
        "host": ([bt[i, : len(m.block_table(s))].tolist() for i, s in enumerate(seqs)],
                 cl.tolist()),
        "prefix": (dict(m._full), dict(m._key_of)),
        "tokens": {s: (None if q.tokens is None else list(q.tokens), q.parent)
                   for s, q in m._seqs.items()},
    }


def slots_of(table, bs, positions):
    return [table[p // bs] * bs + p % bs for p in positions]


def cached_blocks(m: BlockManager) -> list:
    """The blocks in m's prefix cache that nobody holds, least recently released first."""
    return [b for b in m._lru if m.ref_count(b) == 0]


class Model(RuleBasedStateMachine):
    """Random operations against a BlockManager, checked against a dense model: each
    sequence's token -> slot history must stay its own (never written by another
    sequence after it was shared), copy-on-write happens exactly when a shared, partly
    filled block is written, a step writes only blocks nobody else holds, exactly the
    blocks it needs are taken, free ones first, then cached ones least recently released
    first (OutOfBlocks exactly when free + cached are too few), failed calls change
    nothing, free + cached + used blocks are all blocks, and none is used at the end.

    The model records what each slot holds (the value written there and the token-id
    prefix it was computed from), like device memory: blocks in the prefix cache keep it
    after their sequences are freed, and a prefix hit must find exactly its tokens."""

    prefix_caching = False
    num_blocks = 24

    def __init__(self):
        super().__init__()
        self.bs = 4
        self.m = BlockManager(self.num_blocks, self.bs, prefix_caching=self.prefix_caching)
        self.next_id = 0
        self.slots = {}  # seq -> list of slots holding its tokens, in order
        self.data = {}  # slot -> token value most recently written there
        self.values = {}  # seq -> list of token values (its dense history)
        self.tokens = {}  # seq -> its token ids (None: appended without one)
        self.kv = {}  # token-id prefix -> the value its token writes (prefix caching)
        self.written = {}  # slot -> the token-id prefix of the value there (None: no ids)
        self.lru = []  # cached blocks (registered, no owner), least recently released first
        self.prompts = []  # the token ids of every prompt added with ids

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _value(self, prefix):
        """The value a token writes. With prefix caching a token's K/V is a function of
        the token ids up to it, so a shared prefix block holds what the sharer would have
        written; without ids (or without prefix caching) it is fresh."""
        if not self.prefix_caching or None in prefix:
            return np.random.random()
        return self.kv.setdefault(tuple(prefix), np.random.random())

    def _write(self, slot, tokens):
        """The model's write of the token whose ids (with those before it) are ``tokens``."""
        v = self._value(tokens)
        self.data[slot] = v
        self.written[slot] = None if None in tokens else tuple(tokens)
        return v

    def _next_blocks(self, before, n, keep=()):
        """The blocks an allocation of ``n`` takes: free ones first, from the top of the
        stack, then cached ones, least recently released first, but not ``keep``'s."""
        return (before["free"][::-1] + [b for b in self.lru if b not in keep])[:n]

    def _hits(self, before, ids, n):
        """The leading full blocks (short of the last token) that the registry before the
        add gives for ``ids``: each found under (the prefix id of the one before, its
        ids), the chain stopping at the first miss."""
        bs, hits, parent = self.bs, [], None
        if not self.prefix_caching or not ids:
            return hits
        registry, gen = before["prefix"][0], before["gen"]
        for i in range((n - 1) // bs):
            b = registry.get((parent, tuple(ids[i * bs:(i + 1) * bs])))
            if b is None:
                break
            hits.append(b)
            parent = (b, gen[b])
        return hits

    def _ids(self, data, n, none_ok):
        if not self.prefix_caching:
            return None
        tok = st.one_of(st.none(), st.integers(0, 1)) if none_ok else st.integers(0, 1)
        return data.draw(st.lists(tok, min_size=n, max_size=n))

    def _need(self, seqs, counts):
        """(fresh blocks, copy-on-write copies) an append of ``counts`` takes: blocks past
        each writer's last, and for a shared partial block with w writers among its r
        holders, min(w, r - 1) copies (the last writer may write in place)."""
        bs, fresh, writers = self.bs, 0, {}
        for s, k in zip(seqs, counts):
            n = self.m.context_len(s)
            if not k:
                continue
            fresh += -(-(n + k) // bs) - -(-n // bs)
            if n % bs:
                b = self.m.block_table(s)[-1]
                writers[b] = writers.get(b, 0) + 1
        return fresh, sum(min(w, self.m.ref_count(b) - 1) for b, w in writers.items())

    @rule(n=st.integers(0, 13), data=st.data())
    def add(self, n, data):
        self._add(n, self._ids(data, n, none_ok=False))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def add_again(self, data):
        """A prompt that starts like an earlier one (a shared system prompt, a retried
        request): hits, on blocks in use or cached, far more often than random ids."""
        ids = data.draw(st.sampled_from(self.prompts))
        ids = ids[:data.draw(st.integers(0, len(ids)))] + self._ids(
            data, data.draw(st.integers(0, 5)), none_ok=False)
        self._add(len(ids), ids)

    def _add(self, n, ids):
        s, bs = self._new_id(), self.bs
        before = snapshot(self.m)
        hits = self._hits(before, ids, n)
        # The lookup alone (the engine's, before it admits a prompt) finds them and
        # changes nothing.
        if ids is not None:
            assert self.m.cached_prefix_len(ids) == len(hits) * bs
            assert snapshot(self.m) == before
        revived = [b for b in hits if before["refs"][b] == 0]  # cached hits
        need = -(-n // bs) - len(hits)
        free, n_cached, used, _ = before["counts"]
        try:
            slots = self.m.add(s, n, ids)
        except OutOfBlocks:
            # only when the free and cached blocks, less those the prompt hits, are too few
            assert need > free + n_cached - len(revived)
            assert snapshot(self.m) == before
            return
        cached, table = self.m.num_cached_tokens(s), self.m.block_table(s)
        # The cached part: leading full blocks, never the whole prompt (its last token is
        # always computed), each the block registered under its ids and the prefix before;
        # a hit holds exactly the K/V of the prompt's tokens up to its end.
        assert cached % bs == 0 and (n == 0 or cached < n)
        assert cached == 0 or self.prefix_caching
        assert list(table[:cached // bs]) == hits
        for i, b in enumerate(hits):
            assert [self.written[b * bs + j] for j in range(bs)] == \
                [tuple(ids[:i * bs + j + 1]) for j in range(bs)]
        # The rest: free blocks first, then evicted cached ones, least recently released
        # first, never one the prompt hits nor one anybody holds.
        new = list(table[len(hits):])
        assert new == self._next_blocks(before, need, revived)
        assert all(before["refs"][b] == 0 for b in new)
        evicted = new[free:]
        assert snapshot(self.m)["counts"][:3] == (
            free - len(new) + len(evicted), n_cached - len(revived) - len(evicted),
            used + need + len(revived))
        self.lru = [b for b in self.lru if b not in revived and b not in evicted]
        # Slots for the remainder only, in fresh blocks of its own.
        assert slots.tolist() == slots_of(table, bs, range(cached, n))
        assert all(self.m.ref_count(x // bs) == 1 for x in slots.tolist())
        self.slots[s] = slots_of(table, bs, range(n))
        self.tokens[s] = [None] * n if ids is None else list(ids)
        if ids:
            self.prompts.append(list(ids))
        self.values[s] = [self._value(self.tokens[s][: i + 1]) for i in range(cached)]
        for i, slot in zip(range(cached, n), slots.tolist()):
            self.values[s].append(self._write(slot, self.tokens[s][: i + 1]))

    @rule(n=st.integers(1, 13), data=st.data())
    def add_bad_token_id(self, n, data):
        ids = [0] * n
        ids[data.draw(st.integers(0, n - 1))] = [1]
        before = snapshot(self.m)
        with pytest.raises(TypeError, match=r"token_ids\[\d+\] is \[1\]"):
            self.m.add(self._new_id(), n, ids)
        assert snapshot(self.m) == before

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def append(self, data):
        bs = self.bs
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.slots)), min_size=1, unique=True))
        # None: one token each (decode); else 0 to 9 per sequence (idle, verify, chunks)
        counts = data.draw(st.one_of(st.none(), st.lists(
            st.integers(0, 9), min_size=len(seqs), max_size=len(seqs))))
        ks = [1] * len(seqs) if counts is None else counts
        ids = self._ids(data, sum(ks), none_ok=True)
        via_plan = data.draw(st.booleans())
        before = snapshot(self.m)
        lens_before = {s: self.m.context_len(s) for s in seqs}
        tables_before = {s: self.m.block_table(s) for s in seqs}
        shared_partial = {s for s, k in zip(seqs, ks) if k and lens_before[s] % bs
                          and self.m.ref_count(tables_before[s][-1]) > 1}
        fresh, n_copies = self._need(seqs, ks)
        try:
            if via_plan:  # as PagedKVCache.step does: host tables from the plan, then apply
                plan = self.m._plan_append(seqs, counts, ids)
                planned_bt, planned_cl = self.m._tables_after(plan)
                assert snapshot(self.m) == before  # planning changes nothing
                assert plan.query_start_loc().tolist() == [0, *np.cumsum(ks).tolist()]
                self.m._apply_append(plan)
                slots, copies = plan.slots, plan.copies
                bt, cl = self.m.tables(seqs)
                assert planned_cl.tolist() == cl.tolist() and planned_bt.shape == bt.shape
                for i, s in enumerate(seqs):
                    n = len(self.m.block_table(s))
                    assert planned_bt[i, :n].tolist() == bt[i, :n].tolist()
            else:
                slots, copies = self.m.append(seqs, num_tokens=counts, token_ids=ids)
        except OutOfBlocks:
            assert fresh + n_copies > before["counts"][3]  # more than free + cached
            assert snapshot(self.m) == before  # nothing changed
            return
        # Free blocks first, then evicted cached ones, least recently released first;
        # none that anybody held.
        free, n_cached, used, _ = before["counts"]
        taken = [b for s in seqs for b in self.m.block_table(s) if b not in tables_before[s]]
        assert sorted(taken) == sorted(self._next_blocks(before, fresh + n_copies))
        assert all(before["refs"][b] == 0 for b in taken)
        evicted = self._next_blocks(before, fresh + n_copies)[free:]
        assert snapshot(self.m)["counts"][:3] == (
            free - len(taken) + len(evicted), n_cached - len(evicted),
            used + fresh + n_copies)
        self.lru = [b for b in self.lru if b not in evicted]
        assert len(copies) == n_copies
        slots = slots.tolist()
        # Every token its own slot, in a block nobody else holds: shared blocks are copied
        # before they are written, never written.
        assert len(slots) == sum(ks) and len(set(slots)) == len(slots)
        assert all(self.m.ref_count(x // bs) == 1 for x in slots)
        for src, dst in copies.tolist():  # copies run before the writes
            for off in range(bs):
                if src * bs + off in self.data:
                    self.data[dst * bs + off] = self.data[src * bs + off]
                    self.written[dst * bs + off] = self.written[src * bs + off]
        # Copy-on-write only from shared partial blocks that this step writes.
        copied_from = [src for src, _ in copies.tolist()]
        assert set(copied_from) <= {tables_before[s][-1] for s in shared_partial}
        at = 0
        for s, k in zip(seqs, ks):
            n, table = lens_before[s], self.m.block_table(s)
            assert self.m.context_len(s) == n + k
            old = -(-n // bs)
            changed = [c for c in range(old) if table[c] != tables_before[s][c]]
            assert changed in ([], [old - 1] if s in shared_partial else [])
            if changed:  # this sequence now owns a private copy holding its earlier tokens
                self.slots[s] = slots_of(table, bs, range(n))
            assert slots[at:at + k] == slots_of(table, bs, range(n, n + k))
            for j in range(k):
                self.tokens[s].append(None if ids is None else ids[at + j])
                self.values[s].append(self._write(slots[at + j], self.tokens[s]))
                self.slots[s].append(slots[at + j])
            at += k

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def append_bad_token_id(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.slots)), min_size=1, unique=True))
        counts = data.draw(st.one_of(st.none(), st.lists(
            st.integers(1, 3), min_size=len(seqs), max_size=len(seqs))))
        total = len(seqs) if counts is None else sum(counts)
        ids = [0] * total
        ids[data.draw(st.integers(0, total - 1))] = [1]
        before = snapshot(self.m)
        with pytest.raises(TypeError, match=r"token_ids\[\d+\] is \[1\]"):
            self.m.append(seqs, num_tokens=counts, token_ids=ids)
        assert snapshot(self.m) == before

    @precondition(lambda self: self.slots)
    @rule(data=st.data(), how=st.sampled_from(["negative", "length", "ids", "type"]))
    def append_bad_counts(self, data, how):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.slots)), min_size=1, unique=True))
        counts = data.draw(st.lists(st.integers(0, 3), min_size=len(seqs), max_size=len(seqs)))
        ids = None
        if how == "negative":
            counts[data.draw(st.integers(0, len(seqs) - 1))] = -1
            error, match = ValueError, r"num_tokens\[\d+\] is -1"
        elif how == "length":
            counts.append(1)
            error, match = ValueError, "num_tokens has"
        elif how == "ids":
            ids = [0] * (sum(counts) + 1)
            error, match = ValueError, "token_ids has"
        else:
            counts[0] = 1.5
            error, match = TypeError, "num_tokens must be a sequence of integers"
        before = snapshot(self.m)
        with pytest.raises(error, match=match):
            self.m.append(seqs, num_tokens=counts, token_ids=ids)
        assert snapshot(self.m) == before

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.slots)))
        child = self._new_id()
        self.m.fork(parent, child)
        assert self.m.block_table(child) == self.m.block_table(parent)
        assert self.m.num_cached_tokens(child) == self.m.num_cached_tokens(parent)
        self.slots[child] = list(self.slots[parent])
        self.values[child] = list(self.values[parent])
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.slots)))
        table, free = self.m.block_table(s), self.m.num_free_blocks
        self.m.free(s)
        # Blocks nobody holds now, last first: registered ones join the prefix cache as
        # its most recently released, the others the free list.
        released = [b for b in reversed(table) if self.m.ref_count(b) == 0]
        self.lru += [b for b in released if b in self.m._key_of]
        assert self.m.num_free_blocks == free + len([b for b in released
                                                     if b not in self.m._key_of])
        assert self.prefix_caching or self.m.num_free_blocks == free + len(released)
        del self.slots[s], self.values[s], self.tokens[s]
        with pytest.raises(KeyError, match="unknown sequence"):
            self.m.free(s)

    @invariant()
    def consistent(self):
        self.m.check()
        for s, slots in self.slots.items():
            table = self.m.block_table(s)
            assert slots == slots_of(table, self.bs, range(len(slots)))
            # every token still reads back what this sequence wrote
            assert [self.data[x] for x in slots] == self.values[s]

    @invariant()
    def counts(self):
        m = self.m
        assert m.num_free_blocks + m.num_cached_blocks + m.num_used_blocks == m.num_blocks
        assert m.num_available_blocks == m.num_free_blocks + m.num_cached_blocks
        assert cached_blocks(m) == self.lru and m.num_cached_blocks == len(self.lru)
        assert self.prefix_caching or not self.lru

    @invariant()
    def registered_blocks_hold_their_keys(self):
        """A block in the prefix cache, used or cached, holds exactly the tokens of its
        key: the values of one whole token-id prefix ending in the key's ids, which
        (while the key's parent prefix id names a block) continues that block's prefix;
        every sequence holding it has those ids up to its column."""
        bs = self.bs
        for (parent, ids), b in self.m._full.items():
            prefixes = [self.written[b * bs + j] for j in range(bs)]
            whole = prefixes[-1]
            assert whole is not None and whole[-bs:] == ids
            assert prefixes == [whole[:len(whole) - bs + j + 1] for j in range(bs)]
            assert [self.data[b * bs + j] for j in range(bs)] == [self.kv[p] for p in prefixes]
            if parent is None:
                assert len(whole) == bs
            elif self.m._live(parent):
                assert self.written[parent[0] * bs + bs - 1] == whole[:-bs]
            holders = 0
            for s, table in ((s, self.m.block_table(s)) for s in self.slots):
                for c in (c for c, x in enumerate(table) if x == b):
                    holders += 1
                    assert tuple(self.tokens[s][:(c + 1) * bs]) == whole
            assert holders == self.m.ref_count(b)

    def teardown(self):
        for s in list(self.slots):
            self.m.free(s)
        self.m.check()
        assert self.m.num_used_blocks == 0
        assert self.m.num_free_blocks + self.m.num_cached_blocks == self.m.num_blocks
        assert self.prefix_caching or self.m.num_free_blocks == self.m.num_blocks


class PrefixModel(Model):
    """The same with prefix caching: prompts and tokens from a two-id alphabet, or starting
    like earlier prompts, so prefix blocks are shared often; some tokens appended without
    an id; fewer blocks, so the prefix cache fills and allocations evict from it."""

    prefix_caching = True
    num_blocks = 16


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestBlockManager = Model.TestCase
TestBlockManager.settings = _settings
TestBlockManagerPrefixCaching = PrefixModel.TestCase
# more examples: an eviction needs the free list spent and cached blocks behind it
TestBlockManagerPrefixCaching.settings = settings(_settings, max_examples=300)


def test_copy_on_write_after_fork():
    m = BlockManager(8, 4)
    m.add("a", 6)  # blocks [0, 1], block 1 half full
    m.fork("a", "b")
    slots, copies = m.append(["b"])
    assert copies.tolist() == [[1, 2]] and m.block_table("b") == (0, 2)
    assert slots.tolist() == [2 * 4 + 2]
    slots, copies = m.append(["a"])  # a is now block 1's only owner: in place
    assert copies.size == 0 and slots.tolist() == [1 * 4 + 2]


def test_both_owners_in_one_step_copy_once():
    m = BlockManager(8, 4)
    m.add("a", 5)
    m.fork("a", "b")
    slots, copies = m.append(["a", "b"])
    assert len(copies) == 1 and m.num_used_blocks == 3
    m.check()


def test_full_shared_block_needs_no_copy():
    m = BlockManager(8, 4)
    m.add("a", 8)
    m.fork("a", "b")
    _, copies = m.append(["a", "b"])
    assert copies.size == 0 and m.block_table("a")[:2] == m.block_table("b")[:2]


def test_multi_token_append_copies_then_fills_fresh_blocks():
    m = BlockManager(16, 4)
    m.add("a", 6)  # blocks [0, 1], block 1 half full
    m.fork("a", "b")
    m.add("c", 0)
    slots, copies = m.append(["a", "c", "b"], num_tokens=[7, 5, 0])
    # a copies block 1 (b still holds it) to 2, fills it, then takes 3 and 4; c takes 5, 6
    assert copies.tolist() == [[1, 2]]
    assert m.block_table("a") == (0, 2, 3, 4) and m.block_table("c") == (5, 6)
    assert m.block_table("b") == (0, 1) and m.context_len("b") == 6  # 0 tokens: untouched
    assert slots.tolist() == [10, 11, 12, 13, 14, 15, 16] + [20, 21, 22, 23, 24]
    slots, copies = m.append(["b", "a"], num_tokens=[3, 0])  # b is block 1's only holder now
    assert copies.size == 0 and slots.tolist() == [6, 7, 28] and m.block_table("b") == (0, 1, 7)
    m.check()


def test_zero_tokens_keeps_a_shared_block_shared():
    m = BlockManager(8, 4)
    m.add("a", 5)
    m.fork("a", "b")
    slots, copies = m.append(["a", "b"], num_tokens=[0, 0])
    assert slots.size == 0 and copies.size == 0 and m.num_used_blocks == 2
    slots, copies = m.append(["a", "b"], num_tokens=[0, 2])  # a holds block 1: b copies
    assert copies.tolist() == [[1, 2]] and slots.tolist() == [9, 10]
    m.check()


def test_running_out_leaves_everything_intact():
    m = BlockManager(3, 4)
    m.add("a", 4)
    m.add("b", 4)
    m.add("c", 3)
    with pytest.raises(OutOfBlocks, match="need 2 free blocks, have 0"):
        m.append(["a", "b"])
    assert m.context_len("a") == m.context_len("b") == 4
    with pytest.raises(OutOfBlocks, match="need 1 free blocks, have 0"):
        m.append(["c", "a"], num_tokens=[2, 0])  # c fills its block and needs another
    assert m.context_len("c") == 3
    with pytest.raises(OutOfBlocks):
        m.add("d", 1)
    assert "d" not in m
    m.check()


@pytest.mark.parametrize("call, error, match", [
    (lambda m: m.free("nope"), KeyError, "unknown sequence 'nope'"),
    (lambda m: m.append(["a", "a"]), ValueError, "appears twice"),
    (lambda m: m.add("a", 1), ValueError, "already exists"),
    (lambda m: m.fork("a", "a"), ValueError, "already exists"),
    (lambda m: m.fork("zz", "y"), KeyError, "unknown sequence 'zz'"),
    (lambda m: m.add("q", 3, token_ids=[1, 2]), ValueError, "2 ids for 3 tokens"),
    (lambda m: m.append(["a"], num_tokens=[-2]), ValueError, r"num_tokens\[0\] is -2"),
    (lambda m: m.append(["a"], num_tokens=[1, 1]), ValueError, "2 entries for 1 sequences"),
    (lambda m: m.append(["a"], num_tokens=3), TypeError, "a sequence of integers"),
    (lambda m: m.append(["a"], num_tokens=[2], token_ids=[5]), ValueError,
     "1 ids for 2 new tokens"),
    (lambda m: m.append(["a"], [5]), TypeError, "positional argument"),
])
def test_misuse_is_an_error(call, error, match):
    m = BlockManager(4, 4)
    m.add("a", 2)
    before = snapshot(m)
    with pytest.raises(error, match=match):
        call(m)
    assert snapshot(m) == before
    m.check()


def test_prefix_blocks_are_shared_then_cached():
    m = BlockManager(16, 4, prefix_caching=True)
    system = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = m.add("a", 10, system)
    b = m.add("b", 12, system + [7, 8])
    assert m.block_table("a")[:2] == m.block_table("b")[:2]
    assert len(a) == 10 and m.num_cached_tokens("a") == 0
    # b's slots: only the uncached remainder, tokens 8..11 in a block of its own
    assert m.num_cached_tokens("b") == 8 and b.tolist() == slots_of(m.block_table("b"), 4, range(8, 12))
    assert m.block_table("a")[2] != m.block_table("b")[2]  # partial blocks are never shared
    c = m.add("c", 10, [1] + system[1:])  # differs in the first token: nothing shared
    assert len(c) == 10 and not set(m.block_table("c")) & set(m.block_table("a"))
    shared = m.block_table("a")[:2]
    m.free("a")
    m.free("b")
    m.check()
    # Their registered blocks (the shared two, b's third) stay cached; a's partial one is free.
    assert (m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks) == (10, 3, 3)
    assert m.num_available_blocks == 13
    d = m.add("d", 10, system)  # hits them: one new block for the last two tokens
    assert len(d) == 2 and m.num_cached_tokens("d") == 8 and m.block_table("d")[:2] == shared
    assert (m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks) == (9, 1, 6)
    m.check()


def test_a_fully_cached_prompt_recomputes_its_last_block():
    """Every token of the prompt is in the prefix cache: its last block is stored again and
    recomputed, so the last token has a query row; a longer prompt shares all of it."""
    m = BlockManager(16, 4, prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    m.add("a", 8, prompt)
    slots = m.add("b", 8, prompt)
    assert m.num_cached_tokens("b") == 4 and len(slots) == 4
    assert m.block_table("b")[0] == m.block_table("a")[0]
    assert m.block_table("b")[1] != m.block_table("a")[1]  # a shared block is never written
    assert slots.tolist() == slots_of(m.block_table("b"), 4, range(4, 8))
    a0, a1 = m.block_table("a")
    assert m._full[((a0, 0), (5, 6, 7, 8))] == a1  # a's stays registered
    slots = m.add("c", 9, prompt + [9])
    assert m.num_cached_tokens("c") == 8 and len(slots) == 1
    assert m.block_table("c")[:2] == m.block_table("a")[:2]
    assert len(m.add("d", 1, [1])) == 1 and m.num_cached_tokens("d") == 0
    assert len(m.add("e", 4, [1, 2, 3, 4])) == 4 and m.num_cached_tokens("e") == 0
    assert len(m.add("f", 0, [])) == 0 and m.num_cached_tokens("f") == 0
    m.check()


def test_prefix_registered_by_appends():
    m = BlockManager(16, 2, prefix_caching=True)
    m.add("a", 1, [5])
    m.append(["a"], token_ids=[6])  # block [5, 6] is now full and registered
    slots = m.add("b", 3, [5, 6, 9])
    assert len(slots) == 1 and m.num_cached_tokens("b") == 2
    assert m.block_table("b")[0] == m.block_table("a")[0]


def test_chunked_prompt_registers_its_blocks():
    """An empty sequence whose prompt comes in chunks through append (with ids) registers
    its blocks as they fill, as a prompt added whole does; a chunk with a token lacking
    an id takes the sequence out of the prefix cache once that block fills."""
    prompt = list(range(50, 61))  # 11 tokens: 2 full blocks of 4, then 3
    whole = BlockManager(16, 4, prefix_caching=True)
    whole.add("a", 11, prompt)
    chunked = BlockManager(16, 4, prefix_caching=True)
    chunked.add("a", 0)
    for lo, hi in ((0, 3), (3, 3), (3, 9), (9, 11)):
        chunked.append(["a"], num_tokens=[hi - lo], token_ids=prompt[lo:hi])
    assert snapshot(chunked) == snapshot(whole)
    assert chunked.add("b", 9, prompt[:9]).tolist() == whole.add("b", 9, prompt[:9]).tolist()
    assert chunked.num_cached_tokens("b") == 8
    chunked.append(["a"], num_tokens=[5], token_ids=[1, None, 2, 3, 4])  # block 3 has a None
    assert chunked._seqs["a"].tokens is None and len(chunked._full) == 3
    chunked.check()


def test_a_freed_prompt_is_found_again():
    """Freed, a prompt's registered blocks stay cached: the same prompt added again shares
    them and takes one block, for its last token's."""
    m = BlockManager(8, 4, prefix_caching=True)
    prompt = list(range(9))  # 2 full blocks + 1 token
    m.add("a", 9, prompt)
    table = m.block_table("a")
    m.free("a")
    assert (m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks) == (6, 2, 0)
    assert cached_blocks(m) == [table[1], table[0]]  # released last block first
    slots = m.add("b", 9, prompt)
    assert m.num_cached_tokens("b") == 8 and slots.tolist() == [table[2] * 4]
    assert m.block_table("b") == table  # the freed partial block is the free list's top
    assert (m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks) == (5, 0, 3)
    m.check()


def test_eviction_takes_the_least_recently_released_first():
    """Allocations take free blocks first, then cached ones in the order they were last
    released; a prefix hit and its release make a block the most recent."""
    m = BlockManager(6, 2, prefix_caching=True)
    for s, t in (("a", 1), ("b", 2), ("c", 3)):
        m.add(s, 3, [t, t, 9])  # blocks 0-1, 2-3, 4-5: the first of each registered
    for s in ("b", "a", "c"):
        m.free(s)
    assert cached_blocks(m) == [2, 0, 4] and m.num_free_blocks == 3
    m.add("a2", 3, [1, 1, 7])  # hits block 0: out of the cache while used
    assert m.block_table("a2")[0] == 0 and cached_blocks(m) == [2, 4]
    m.free("a2")
    assert cached_blocks(m) == [2, 4, 0]  # the hit made 0 the most recent
    m.add("x", 10, [8] * 10)  # 5 blocks: the 3 free ones, then 2 then 4 are evicted
    assert m.block_table("x")[:3] == (5, 1, 3) and m.block_table("x")[3:] == (2, 4)
    assert cached_blocks(m) == [0] and m.num_available_blocks == 1
    m.check()
    m.free("x")
    for s, t, hit in (("a3", 1, 2), ("b2", 2, 0), ("c2", 3, 0)):
        m.add(s, 3, [t, t, 9])
        assert m.num_cached_tokens(s) == hit, s
    m.check()


def test_a_chain_is_evicted_from_its_tail():
    """free releases a sequence's blocks last first, so an allocation evicts the end of a
    cached chain and a prompt with the same start still finds its head."""
    m = BlockManager(5, 2, prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6, 7]  # blocks 0, 1, 2 full, 3 partial
    m.add("a", 7, prompt)
    m.free("a")
    assert cached_blocks(m) == [2, 1, 0] and m.num_free_blocks == 2
    m.add("x", 5, [9] * 5)  # the 2 free blocks and the chain's tail
    assert m.block_table("x") == (3, 4, 2) and cached_blocks(m) == [1, 0]
    m.free("x")
    m.add("a2", 7, prompt)
    assert m.num_cached_tokens("a2") == 4 and m.block_table("a2")[:2] == (0, 1)
    m.check()


def test_an_evicted_prefix_matches_nothing_after_it():
    """Keys name whole prefixes, not parent block numbers. A's prompt is cached, B repeats
    it (so stores its last block again, a copy nobody registers) and registers block 3
    after it. A's last block, 1, is evicted and reused for other tokens: a prompt reaching
    block 1 through those must not find block 3, nor may the original prompt (its
    second block is gone). B2, B's fork, fills a block after the evicted prefix: it
    registers nothing and leaves the prefix cache."""
    m = BlockManager(7, 2, prefix_caching=True)
    m.add("A", 4, [1, 2, 3, 4])  # blocks 0, 1
    m.add("B", 4, [1, 2, 3, 4])  # shares 0; block 2 holds [3, 4] again
    m.fork("B", "B2")
    m.append(["B"], num_tokens=[2], token_ids=[5, 6])  # block 3, after the prefix [1, 2, 3, 4]
    assert m.block_table("B") == (0, 2, 3) and len(m._full) == 3
    m.free("A")  # block 1 cached (0 is still B's)
    m.add("filler", 6)  # the free blocks
    m.add("q", 2, [8, 8])  # evicts block 1 and registers it for [8, 8]
    assert m.block_table("q") == (1,) and m.num_cached_blocks == 0
    m.free("filler")
    registry = dict(m._full)
    m.append(["B2"], num_tokens=[2], token_ids=[5, 6])  # after a prefix no block names now
    assert m._full == registry and m._seqs["B2"].tokens is None
    m.check()
    m.free("B")
    m.free("B2")
    assert 3 in cached_blocks(m)  # still registered, unreachable: evicted in its turn
    m.add("h", 5, [8, 8, 5, 6, 0])
    assert m.num_cached_tokens("h") == 2 and m.block_table("h")[:2] != (1, 3)
    m.add("a2", 7, [1, 2, 3, 4, 5, 6, 0])
    assert m.num_cached_tokens("a2") == 2 and m.block_table("a2")[0] == 0
    m.check()


def test_allocation_evicts_before_running_out():
    """An allocation evicts cached blocks rather than raise; OutOfBlocks only when free
    plus cached blocks are too few, never counting or evicting the blocks the prompt
    itself hits; and then nothing changes."""
    m = BlockManager(4, 2, prefix_caching=True)
    m.add("a", 8, list(range(8)))
    m.free("a")
    assert (m.num_free_blocks, m.num_cached_blocks, m.num_available_blocks) == (0, 4, 4)
    m.add("b", 8, list(range(10, 18)))
    assert m.num_used_blocks == 4 and m.num_cached_blocks == 0
    m.free("b")
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match=r"need 5 free blocks, have 4 of 4 \(4 of them cached\)"):
        m.add("c", 9, list(range(20, 29)))
    assert snapshot(m) == before
    m.check()

    m = BlockManager(3, 2, prefix_caching=True)
    m.add("a", 3, [1, 2, 3])  # block 0 registered, 1 partial
    m.add("c", 2, [5, 6])  # block 2
    m.free("a")
    m.free("c")
    assert cached_blocks(m) == [0, 2] and m._free == [1]
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match="need 3 free blocks, have 2 of 3"):
        m.add("d", 7, [1, 2, 7, 7, 7, 7, 7])  # hits 0: 3 more, of 1 free and 1 cached
    assert snapshot(m) == before
    m.add("d", 5, [1, 2, 7, 7, 7])  # hits 0, the oldest: takes 1, evicts 2, not 0
    assert m.block_table("d") == (0, 1, 2) and m.num_cached_tokens("d") == 2
    assert m.num_available_blocks == 0
    m.check()


def test_without_prefix_caching_nothing_is_cached():
    m = BlockManager(4, 2)
    m.add("a", 5, [1, 2, 3, 4, 5])
    assert m.cached_prefix_len([1, 2, 3, 4, 5]) == 0
    m.free("a")
    assert (m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks) == (4, 0, 0)
    assert m.num_available_blocks == 4 and not m._full and not m._lru
    m.add("b", 5, [1, 2, 3, 4, 5])
    assert m.num_cached_tokens("b") == 0 and m.num_cached_blocks == 0
    with pytest.raises(OutOfBlocks, match=r"need 2 free blocks, have 1 of 4$"):
        m.add("c", 3, [1, 2, 3])
    m.check()


def test_tables_are_gathered_per_request():
    m = BlockManager(16, 4)
    m.add("x", 9)
    m.add("y", 1)
    bt, cl = m.tables(["y", "x"])
    assert cl.tolist() == [1, 9] and bt.shape == (2, 3)
    assert bt[1].tolist() == list(m.block_table("x")) and bt[0, 0] == m.block_table("y")[0]


def test_unhashable_token_id_in_append_changes_nothing():
    m = BlockManager(8, 2, prefix_caching=True)
    m.add("a", 1, token_ids=[5])
    before = snapshot(m)
    with pytest.raises(TypeError, match=r"token_ids\[0\] is \[1\], which is not hashable"):
        m.append(["a"], token_ids=[[1]])
    with pytest.raises(TypeError, match=r"token_ids\[2\] is \[1\], which is not hashable"):
        m.append(["a"], num_tokens=[3], token_ids=[6, 7, [1]])
    assert m.context_len("a") == 1 and m.tables(["a"])[1].tolist() == [1]
    assert snapshot(m) == before
    m.check()
    m.append(["a"], token_ids=[6])  # and the manager goes on as if nothing happened
    assert len(m.add("b", 3, [5, 6, 7])) == 1  # [5, 6] was registered
    assert m.num_cached_tokens("b") == 2


def _scene():
    """A prefix-caching manager with a little of everything: registered prefix blocks, a
    prompt sharing one, a fork sharing a partly filled block, a sequence at a block
    boundary, and a free host-table row below live ones."""
    m = BlockManager(12, 2, prefix_caching=True)
    m.add("tmp", 1, [0])
    m.add("a", 5, [1, 2, 3, 4, 5])  # blocks [1, 2] and [3, 4] registered, [5] partial
    m.add("b", 3, [1, 2, 9])  # shares a's first block
    m.fork("a", "c")  # shares a's partial block
    m.add("e", 2, [7, 7])  # at a block boundary
    m.free("tmp")
    return m


@pytest.mark.parametrize("call, error, match", [
    # appends: the bad id fills a block, sits behind a copy-on-write, or fills nothing yet
    (lambda m: m.append(["b"], token_ids=[[1]]), TypeError, r"token_ids\[0\] is \[1\]"),
    (lambda m: m.append(["a", "c", "b"], token_ids=[6, 7, {}]), TypeError,
     r"token_ids\[2\] is \{\}"),
    (lambda m: m.append(["e", "a"], token_ids=[[1], 6]), TypeError, r"token_ids\[0\]"),
    (lambda m: m.append(["a", "nope"], token_ids=[6, 7]), KeyError, "unknown sequence 'nope'"),
    (lambda m: m.append(["a", "b", "a"]), ValueError, "appears twice"),
    # multi-token appends: a bad id after a copy-on-write and fresh blocks, too few ids,
    # a negative count, more blocks than there are
    (lambda m: m.append(["a", "e"], num_tokens=[4, 1], token_ids=[6, 7, 8, 9, [2]]),
     TypeError, r"token_ids\[4\] is \[2\]"),
    (lambda m: m.append(["a", "e"], num_tokens=[4, 1], token_ids=[6, 7, 8, 9]), ValueError,
     "4 ids for 5 new tokens"),
    (lambda m: m.append(["a", "e"], num_tokens=[4, -1]), ValueError, r"num_tokens\[1\] is -1"),
    (lambda m: m.append(["c", "e"], num_tokens=[9, 9]), OutOfBlocks, "need 10 free blocks"),
    # adds: the bad id in the partial last block, in a full block after a prefix-cache
    # miss, or in the block being looked up; a length that is not an integer
    (lambda m: m.add("x", 3, [1, 2, [3]]), TypeError, r"token_ids\[2\] is \[3\]"),
    (lambda m: m.add("x", 4, [8, 8, [3], 4]), TypeError, r"token_ids\[2\] is \[3\]"),
    (lambda m: m.add("x", 4, [1, 2, [3], 4]), TypeError, r"token_ids\[2\] is \[3\]"),
    (lambda m: m.add("x", 2.5), TypeError, "num_tokens must be an integer, got 2.5"),
    (lambda m: m.add("x", 40, list(range(40))), OutOfBlocks, "need 20 free blocks"),
    (lambda m: m.fork("a", ["x"]), TypeError, "unhashable"),
    (lambda m: m.free(["x"]), TypeError, "unhashable"),
], ids=["append-fills-block", "append-after-cow", "append-no-fill", "append-unknown",
        "append-twice", "multi-bad-id", "multi-few-ids", "multi-negative", "multi-out-of-blocks",
        "add-partial-block", "add-after-miss", "add-lookup", "add-float-length",
        "add-out-of-blocks", "fork-unhashable", "free-unhashable"])
def test_failed_call_changes_nothing(call, error, match):
    """A call that raises leaves the manager as it was: the same answers, tables and
    internals as a twin that never saw the call, and the same results from then on."""
    m, twin = _scene(), _scene()
    with pytest.raises(error, match=match):
        call(m)
    assert snapshot(m) == snapshot(twin)
    m.check()
    for x in (m, twin):  # a lost host-table row, say, shows up only now
        x.add("y", 3, [1, 2, 6])
        x.add("z", 1, [4])
    seqs = ["a", "b", "c", "e", "y", "z"]
    for counts, ids in ((None, [6, 7, 8, 9, 10, 11]), ([1, 0, 0, 0, 2, 1], [12, 13, 14, 15])):
        results = [x.append(seqs, num_tokens=counts, token_ids=ids) for x in (m, twin)]
        assert [r.tolist() for r in results[0]] == [r.tolist() for r in results[1]]
        assert snapshot(m) == snapshot(twin)
    m.check()


def test_token_ids_are_checked_without_prefix_caching():
    m = BlockManager(8, 2)
    m.add("a", 1)
    with pytest.raises(TypeError, match=r"token_ids\[0\] is \[1\]"):
        m.append(["a"], token_ids=[[1]])
    with pytest.raises(TypeError, match=r"token_ids\[1\] is \[2\]"):
        m.add("b", 2, [1, [2]])
    assert m.sequences == ["a"] and m.context_len("a") == 1
    m.check()


def test_a_bad_layout_is_refused():
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        PagedKVCache(1, 4, 1, 64, 16, kv_layout="nhd")


class Injected(RuntimeError):
    """A device failure made up by a test."""


@pytest.fixture
def host_cache(monkeypatch):
    """``host_cache(manager, token_scales=False)``: a PagedKVCache over ``manager`` whose
    device work runs on the host: uploads return NumPy copies, copy_blocks records its
    (src, dst) pairs in ``.copied``, and with ``token_scales`` (an fp8 cache with
    per-token scales) those of the scale arrays in ``.scales_copied``. Setting ``.fail``
    to "upload", "copy" or "scales copy" makes that part raise, as an out-of-memory buffer
    allocation or a failed launch would."""
    caches = []

    def copy_blocks(key_caches, value_caches, block_mapping, **kwargs):
        for c in caches:
            for what, ks, vs, log in (
                    ("copy", c.key_caches, c.value_caches, c.copied),
                    ("scales copy", c._k_scale_blocks, c._v_scale_blocks, c.scales_copied)):
                if ks is key_caches and vs is value_caches:
                    if c.fail == what:
                        raise Injected(f"{what} failed")
                    log.append(np.asarray(block_mapping).tolist())
                    return
        raise AssertionError("copy_blocks got lists that no cache holds")

    monkeypatch.setattr(cupaged.cache_ops, "copy_blocks", copy_blocks)

    def make(manager, token_scales=False):
        cache = object.__new__(PagedKVCache)
        cache.manager, cache.key_caches, cache.value_caches = manager, [], []
        cache._k_scale_blocks, cache._v_scale_blocks = ([], []) if token_scales else (None, None)
        cache.fail, cache.copied, cache.scales_copied = None, [], []

        def upload(purpose, parts):
            if cache.fail == "upload":
                raise Injected("out of device memory")
            return [np.array(p, np.int32) for p in parts]

        cache._upload = upload
        caches.append(cache)
        return cache

    return make


def _as_lists(step):
    return [np.asarray(x).tolist() for x in step]


def test_step_type():
    assert DecodeStep is Step and cupaged.Step is Step
    step = Step(1, 2, 3, 4)
    assert step.context_lens == step.seq_lens == 3 and len(step) == 4


@pytest.mark.parametrize("fail", ["upload", "copy"])
@pytest.mark.parametrize("counts", [None, [3, 0, 1, 2]], ids=["decode", "mixed"])
def test_failed_step_changes_nothing_and_a_retry_matches(host_cache, fail, counts):
    seqs = ["a", "b", "c", "e"]  # a and c share a partial block: one copy
    ids = [6, 7, 8, 9] if counts is None else list(range(20, 26))
    m, twin = _scene(), _scene()
    cache, twin_cache = host_cache(m), host_cache(twin)
    expected = _as_lists(twin_cache.step(seqs, num_tokens=counts, token_ids=ids))
    before = snapshot(m)
    cache.fail = fail
    with pytest.raises(Injected):
        cache.step(seqs, num_tokens=counts, token_ids=ids)
    assert snapshot(m) == before and cache.copied == []
    m.check()
    cache.fail = None
    assert _as_lists(cache.step(seqs, num_tokens=counts, token_ids=ids)) == expected
    assert cache.copied == twin_cache.copied and len(cache.copied[0]) == 1
    assert snapshot(m) == snapshot(twin)


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_step_matches_append_then_tables(host_cache, block_size, mixed):
    """step's tables come from the plan, before the manager changes; they must be the
    tables the applied append gives (block size 1 grows the host table past its width),
    and its query_start_loc the running sum of the new tokens."""
    def scene():
        m = BlockManager(512, block_size)
        m.add("a", 7)
        m.fork("a", "b")
        m.add("c", 2 * block_size)
        m.add("d", 0)
        return m

    m, twin = scene(), scene()
    cache = host_cache(m)
    seqs = ["c", "a", "d", "b"]
    rng = np.random.default_rng(0)
    for _ in range(12):
        counts = rng.integers(0, 9, size=4).tolist() if mixed else None
        copied = len(cache.copied)
        got = cache.step(seqs, num_tokens=counts)
        slots, copies = twin.append(seqs, num_tokens=counts)
        bt, cl = twin.tables(seqs)
        assert got.slot_mapping.tolist() == slots.tolist()
        assert got.seq_lens.tolist() == got.context_lens.tolist() == cl.tolist()
        assert got.block_tables.tolist() == bt.tolist()
        ks = [1] * 4 if counts is None else counts
        assert got.query_start_loc.tolist() == [0, *np.cumsum(ks).tolist()]
        assert cache.copied[copied:] == ([copies.tolist()] if len(copies) else [])
        assert snapshot(m) == snapshot(twin)
    assert len(cache.copied) == (block_size > 1)  # a and b share a partial block once


def test_failed_add_upload_changes_nothing(host_cache):
    m, twin = _scene(), _scene()
    cache = host_cache(m)
    cache.fail = "upload"
    with pytest.raises(Injected):
        cache.add("x", 5, [1, 2, 3, 4, 6])  # shares two prefix blocks, takes one
    assert snapshot(m) == snapshot(twin)
    m.check()
    cache.fail = None
    got = cache.add("x", 5, [1, 2, 3, 4, 6])
    assert got.tolist() == twin.add("x", 5, [1, 2, 3, 4, 6]).tolist() and len(got) == 1
    assert snapshot(m) == snapshot(twin)


def _cached_scene():
    """A prefix-caching manager whose cache holds two freed chains, [1, 1, 1, 1] (blocks 0,
    1) and then [2, 2, 2, 2] (3, 4), released last block first; one sequence still live."""
    m = BlockManager(9, 2, prefix_caching=True)
    for s, t in (("p1", 1), ("p2", 2), ("live", 3)):
        m.add(s, 5, [t] * 4 + [0])
    m.free("p1")
    m.free("p2")
    assert cached_blocks(m) == [1, 0, 4, 3] and m.num_free_blocks == 2
    return m


@pytest.mark.parametrize("prompt, hits", [
    ([1] * 4 + [9] * 5, [0, 1]),  # hits the LRU's front: evicts 4 behind them
    ([2] * 4 + [9] * 5, [3, 4]),  # hits its middle: evicts 1
], ids=["hit-front", "hit-middle"])
@pytest.mark.parametrize("prefill", [False, True], ids=["add", "prefill"])
def test_failed_upload_after_eviction_restores_the_cache(host_cache, prompt, hits, prefill):
    """An add (or prefill) that revives cached blocks, evicts others and registers new
    ones, whose upload then fails, leaves the manager exactly as it was: the evicted
    blocks' keys, every block's place in the LRU, and no key for the blocks whose K/V
    were never written. A retry does what the twin does; the cache's counts are the
    manager's."""
    m, twin = _cached_scene(), _cached_scene()
    cache = host_cache(m)
    before = snapshot(m)
    cache.fail = "upload"
    with pytest.raises(Injected):
        if prefill:  # y hits x's new blocks, then evicts another cached one
            cache.prefill(["x", "y"], [9, 7], token_ids=[prompt, prompt[:6] + [5]])
        else:
            cache.add("x", 9, prompt)
    assert snapshot(m) == before
    m.check()
    cache.fail = None
    if prefill:
        got = cache.prefill(["x", "y"], [9, 7], token_ids=[prompt, prompt[:6] + [5]])
        want = [twin.add("x", 9, prompt), twin.add("y", 7, prompt[:6] + [5])]
        assert got.slot_mapping.tolist() == np.concatenate(want).tolist()
        assert twin.num_cached_tokens("y") == 6
    else:
        assert cache.add("x", 9, prompt).tolist() == twin.add("x", 9, prompt).tolist()
    assert snapshot(m) == snapshot(twin)
    assert list(m.block_table("x")[:2]) == hits and m.num_cached_tokens("x") == 4
    assert m.num_free_blocks == 0 and before["counts"][1] - m.num_cached_blocks >= 3
    assert (cache.num_free_blocks, cache.num_cached_blocks, cache.num_used_blocks,
            cache.num_available_blocks) == snapshot(m)["counts"]
    m.check()


def test_prefill_gives_the_step_for_the_remainders(host_cache):
    """prefill: the adds' remainder slots in order, the tables and prompt lengths, and
    query_start_loc over the remainders; a prompt may share blocks an earlier prompt of
    the same call stores."""
    m, twin = _scene(), _scene()
    cache = host_cache(m)
    prompts = {"x": [1, 2, 3, 4, 6], "y": [8, 8, 8, 8, 8], "z": [8, 8, 8, 8, 1], "w": None}
    lens = [5, 5, 5, 3]
    step = cache.prefill(list(prompts), lens, token_ids=list(prompts.values()))
    want = [twin.add(s, n, ids) for (s, ids), n in zip(prompts.items(), lens)]
    assert [len(x) for x in want] == [1, 5, 1, 3]  # x shares a's blocks, z shares y's
    assert step.slot_mapping.tolist() == np.concatenate(want).tolist()
    bt, cl = twin.tables(list(prompts))
    assert step.block_tables.tolist() == bt.tolist() and step.seq_lens.tolist() == lens
    assert step.query_start_loc.tolist() == [0, 1, 6, 7, 10]
    assert snapshot(m) == snapshot(twin)
    assert [cache.num_cached_tokens(s) for s in prompts] == [4, 0, 4, 0]
    empty = cache.prefill([], [])
    assert _as_lists(empty) == [[], [], [], [0]]


@pytest.mark.parametrize("how, error, match", [
    ("upload", Injected, "out of device memory"),
    ("blocks", OutOfBlocks, "need 10 free blocks"),
    ("twice", ValueError, "already exists"),
    ("ids", TypeError, r"token_ids\[1\] is \[2\]"),
    ("lengths", ValueError, "2 entries for 3 sequences"),
    ("no-lengths", TypeError, "must list each prompt's length"),
])
def test_failed_prefill_adds_nothing(host_cache, how, error, match):
    m, twin = _scene(), _scene()
    cache = host_cache(m)
    seqs, lens, ids = ["x", "y", "z"], [5, 2, 3], [[1, 2, 3, 4, 6], None, [7, 7, 7]]
    if how == "upload":
        cache.fail = "upload"
    elif how == "blocks":
        lens[2], ids[2] = 20, None
    elif how == "twice":
        seqs[2] = "x"
    elif how == "ids":
        ids[2] = [1, [2], 3]
    elif how == "lengths":
        lens = lens[:2]
    else:
        lens = None
    with pytest.raises(error, match=match):
        cache.prefill(seqs, lens, token_ids=ids)
    assert snapshot(m) == snapshot(twin)
    m.check()


# ---- fp8 caches, on the host: arguments, shapes, dtypes, scales, accounting ----------------

FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")
_BF16 = _dtypes.BF16.numpy


@pytest.fixture
def host_arrays(monkeypatch):
    """PagedKVCache and PagedMLACache allocate NumPy arrays of the dtypes they ask for
    (ml_dtypes' float8 for torch's float8 tensors), so they can be built without a GPU
    (with ``device=0``)."""
    def empty(self, shape, dtype, fill=None):
        a = np.empty(shape, dtype)
        if fill is not None:
            a.fill(fill)
        return a

    monkeypatch.setattr(PagedKVCache, "_empty", empty)
    monkeypatch.setattr(cupaged.PagedMLACache, "_empty", empty)


def test_cache_shapes_of_one_byte_elements():
    from cupaged.kv_cache import _cache_shapes

    assert _cache_shapes("vllm", 10, 2, 64, 16, 1) == ((10, 2, 4, 16, 16), (10, 2, 64, 16))
    assert _cache_shapes("vllm", 10, 2, 64, 16, 2) == ((10, 2, 8, 16, 8), (10, 2, 64, 16))
    assert _cache_shapes("NHD", 10, 2, 64, 16, 1) == ((10, 16, 2, 64),) * 2
    assert _cache_shapes("HND", 10, 2, 64, 16, 1) == ((10, 2, 16, 64),) * 2


@pytest.mark.parametrize("kw, error, match", [
    (dict(kv_cache_dtype="int8"), ValueError, "kv_cache_dtype must be 'auto', 'fp8'"),
    (dict(kv_cache_dtype="e4m3"), ValueError, "kv_cache_dtype must be"),
    (dict(kv_cache_dtype="fp8", kv_scales="channel"), ValueError,
     "kv_scales must be 'tensor' or 'token', got 'channel'"),
    (dict(kv_scales="token"), ValueError, "kv_scales='token' needs an fp8 cache"),
    (dict(kv_scales=None), ValueError, "kv_scales must be"),
    (dict(kv_cache_dtype="fp8", dtype="float32"), TypeError,
     "fp8 caches take float16 or bfloat16 queries, got dtype=float32"),
    (dict(kv_cache_dtype="fp8_e5m2", head_size=72), ValueError,
     "head_size 72 is not supported with an fp8 cache: expected a multiple of 16"),
    (dict(kv_cache_dtype="fp8", head_size=20), ValueError, "head_size 20 is not supported"),
    (dict(dtype="fp8"), ValueError, "kv_cache_dtype='fp8'"),
    (dict(dtype="fp8_e5m2", kv_cache_dtype="fp8_e5m2"), ValueError, "dtype is the model's"),
], ids=["format", "format-name", "scales", "token-16-bit", "scales-none", "float32",
        "head-size", "head-size-any", "dtype-fp8", "dtype-fp8-e5m2"])
def test_fp8_arguments_are_checked(host_arrays, kw, error, match):
    args = dict(num_layers=2, num_blocks=4, num_kv_heads=2, head_size=64, block_size=16,
                dtype="float16", device=0)
    args.update(kw)
    with pytest.raises(error, match=match):
        PagedKVCache(**args)


def test_auto_cache_is_as_before(host_arrays):
    """kv_cache_dtype="auto" (the default): caches of ``dtype``, no scales, the same bytes;
    a head size fp8 refuses is fine."""
    for kw in ({}, dict(kv_cache_dtype="auto", kv_scales="tensor"), dict(kv_cache_dtype=None)):
        cache = PagedKVCache(3, 10, 2, 72, 16, "bfloat16", kv_layout="vllm", device=0, **kw)
        assert cache.kv_cache_dtype == "auto" and cache.kv_scales is None
        assert cache.dtype == cache.key_caches[0].dtype == cache.value_caches[0].dtype
        assert cache.key_caches[0].shape == (10, 2, 9, 16, 8)
        assert cache.k_scales == cache.v_scales == [None] * 3
        assert cache.layer_kwargs(2) == dict(kv_cache_dtype="auto", k_scale=None, v_scale=None)
        assert cache.bytes_per_block == 2 * 3 * 2 * 72 * 16 * 2


@pytest.mark.parametrize("layout", ["vllm", "NHD", "HND"])
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("fmt", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_caches_per_tensor_scales(host_arrays, layout, framework, fmt, dtype):
    layers, nb, kvh, hs, bs = 3, 10, 2, 64, 16
    cache = PagedKVCache(layers, nb, kvh, hs, bs, dtype, kv_layout=layout,
                         framework=framework, device=0, kv_cache_dtype=fmt)
    name = "fp8_e5m2" if fmt == "fp8_e5m2" else "fp8_e4m3"
    assert cache.kv_cache_dtype == name and cache.kv_scales == "tensor"
    assert cache.dtype == np.dtype(dtype)  # the model's dtype stays
    # torch: its float8 type (asked for as ml_dtypes' NumPy dtype); CuPy: bytes
    store = _dtypes.KV_CACHE_DTYPES[name].numpy if framework == "torch" else np.dtype(np.uint8)
    want = {"vllm": ((nb, kvh, hs // 16, bs, 16), (nb, kvh, hs, bs)),
            "NHD": ((nb, bs, kvh, hs),) * 2, "HND": ((nb, kvh, bs, hs),) * 2}[layout]
    for kc, vc in zip(cache.key_caches, cache.value_caches):
        assert (kc.shape, vc.shape) == want and kc.dtype == vc.dtype == store
    assert len(cache.k_scales) == len(cache.v_scales) == layers
    scales = cache.k_scales + cache.v_scales
    for s in scales:
        assert s.shape == (1,) and s.dtype == np.float32 and s[0] == 1.0
    assert len({id(s) for s in scales}) == 2 * layers  # each its own, to calibrate alone
    kw = cache.layer_kwargs(1)
    assert kw == dict(kv_cache_dtype=name, k_scale=cache.k_scales[1], v_scale=cache.v_scales[1])
    assert kw["k_scale"] is cache.k_scales[1] and kw["v_scale"] is cache.v_scales[1]
    assert cache.bytes_per_block == 2 * layers * kvh * hs * bs  # one byte each, no scales


@pytest.mark.parametrize("layout", ["vllm", "NHD", "HND"])
@pytest.mark.parametrize("geometry, row", [((2, 16), 32), ((4, 1), 4), ((3, 2), 8), ((1, 1), 4)],
                         ids=["kvh2_bs16", "kvh4_bs1", "kvh3_bs2-padded", "kvh1_bs1-padded"])
def test_fp8_caches_per_token_scales(host_arrays, layout, geometry, row):
    """Per-token scales: [num_blocks, num_kv_heads, block_size] float32 per layer for K and
    for V, views of [num_blocks, row] arrays (row padded to a multiple of 4 floats, 16
    bytes, as copy_blocks moves blocks) that step's copy-on-write copies."""
    layers, nb, hs = 2, 6, 32
    kvh, bs = geometry
    cache = PagedKVCache(layers, nb, kvh, hs, bs, "float16", kv_layout=layout, device=0,
                         kv_cache_dtype="fp8_e5m2", kv_scales="token")
    assert cache.kv_cache_dtype == "fp8_e5m2" and cache.kv_scales == "token"
    assert cache.key_caches[0].dtype == np.uint8
    for views, blocks in ((cache.k_scales, cache._k_scale_blocks),
                          (cache.v_scales, cache._v_scale_blocks)):
        assert len(views) == len(blocks) == layers
        for view, block in zip(views, blocks):
            assert view.shape == (nb, kvh, bs) and view.dtype == np.float32
            assert block.shape == (nb, row) and block.dtype == np.float32
            # tokens contiguous, blocks padded (the stride of a dimension of 1 is free)
            assert all(n == 1 or st == want for n, st, want in
                       zip(view.shape, view.strides, (4 * row, 4 * bs, 4))), view.strides
            assert np.shares_memory(view, block)  # a view: copying blocks copies it
            view[...] = np.arange(view.size, dtype=np.float32).reshape(view.shape)
            assert block[:, :kvh * bs].ravel().tolist() == list(range(view.size))
    all_arrays = cache.k_scales + cache.v_scales
    assert not any(np.shares_memory(a, b) for i, a in enumerate(all_arrays)
                   for b in all_arrays[i + 1:])
    assert cache.layer_kwargs(0)["k_scale"] is cache.k_scales[0]
    assert cache.bytes_per_block == 2 * layers * (kvh * hs * bs + 4 * row)


def test_fp8_bytes_per_block_arithmetic(host_arrays):
    """A 32-layer, 8-KV-head, head-size-128 model with 16-token blocks: float16 2 MiB a
    block; e4m3 half that; with per-token scales 2 * 32 * 8 * 16 * 4 bytes (32 KiB) more."""
    args = (32, 4, 8, 128, 16, "float16")
    f16 = PagedKVCache(*args, device=0).bytes_per_block
    fp8 = PagedKVCache(*args, device=0, kv_cache_dtype="fp8").bytes_per_block
    tok = PagedKVCache(*args, device=0, kv_cache_dtype="fp8", kv_scales="token").bytes_per_block
    assert f16 == 2 * 32 * 8 * 128 * 16 * 2 == 2 << 20
    assert fp8 * 2 == f16
    assert tok - fp8 == 2 * 32 * 8 * 16 * 4 == 32 << 10
    cache = PagedKVCache(*args, device=0, kv_cache_dtype="fp8", kv_scales="token")
    cache.manager.add("a", 40)  # three blocks (the bookkeeping alone: no upload here)
    assert cache.bytes_in_use == 3 * tok


@pytest.mark.parametrize("fail", [None, "copy", "scales copy"])
def test_copy_on_write_copies_token_scales(host_cache, fail):
    """With per-token scales, step copies the scale rows of the blocks it copies, with the
    same pairs; if either copy fails nothing changes, and a retry copies both."""
    m, twin = _scene(), _scene()
    cache = host_cache(m, token_scales=True)
    twin_cache = host_cache(twin)  # without scales: only the caches are copied
    seqs, ids = ["a", "b", "c", "e"], [6, 7, 8, 9]
    expected = _as_lists(twin_cache.step(seqs, token_ids=ids))
    if fail:
        before = snapshot(m)
        cache.fail = fail
        with pytest.raises(Injected, match=fail):
            cache.step(seqs, token_ids=ids)
        assert snapshot(m) == before
        m.check()
        cache.fail = None
        cache.copied, cache.scales_copied = [], []
    assert _as_lists(cache.step(seqs, token_ids=ids)) == expected
    assert cache.copied == cache.scales_copied == twin_cache.copied
    assert len(cache.copied) == 1 and len(cache.copied[0]) == 1  # a and c share a block
    assert twin_cache.scales_copied == []
    assert snapshot(m) == snapshot(twin)


# ---- on the GPU: every layout through reshape_and_cache and cupaged.attention ------------------

LAYOUTS = ("vllm", "NHD", "HND")


def _write(cache, layer, k, v, slots):
    """K/V rows (host) into the cache's slots, through the kernel, in the cache's layout."""
    import cupy

    cupaged.reshape_and_cache(cupy.asarray(k), cupy.asarray(v), cache.key_caches[layer],
                              cache.value_caches[layer], slots, kv_layout=cache.kv_layout)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_layouts(layout):
    cache = PagedKVCache(3, 10, 2, 64, 16, "bfloat16", kv_layout=layout)
    assert cache.kv_layout == layout and len(cache.key_caches) == len(cache.value_caches) == 3
    want = {"vllm": ((10, 2, 8, 16, 8), (10, 2, 64, 16)),
            "NHD": ((10, 16, 2, 64),) * 2, "HND": ((10, 2, 16, 64),) * 2}[layout]
    assert (tuple(cache.key_caches[0].shape), tuple(cache.value_caches[0].shape)) == want
    assert cache.bytes_per_block == 2 * 3 * 2 * 64 * 16 * 2
    assert PagedKVCache(1, 4, 1, 64, 16).kv_layout == "vllm"  # the default


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_mixed_steps_through_attention(rng, layout, dtype):
    """Chunked prefills, verify-sized steps, decodes and idle (0-token) sequences in one
    batch per step, with forks (copy-on-write, whole blocks along dim 0 in every layout)
    and frees: each step writes random K/V through reshape_and_cache and checks
    cupaged.attention over the step's arrays against the float64 reference over each
    sequence's dense history, layer by layer."""
    import cupy

    layers, kvh, heads, hs, bs = 2, 2, 4, 64, 4
    dt = np.dtype(dtype)
    tol = testing.TOLERANCE["f16" if dt == np.float16 else "f32"]
    cache = PagedKVCache(layers, 200, kvh, hs, bs, dtype, kv_layout=layout)
    history = {}  # seq -> [layer] -> (K rows, V rows), float64 [kvh, hs] each
    next_id, checked, copied = 0, 0, 0

    def start(n):
        nonlocal next_id
        next_id += 1
        history[next_id] = [([], []) for _ in range(layers)]
        slots = cache.add(next_id, n)
        for layer in range(layers):
            k = testing.random_normal((n, kvh, hs), dt, rng)
            v = testing.random_normal((n, kvh, hs), dt, rng)
            _write(cache, layer, k, v, slots)
            history[next_id][layer][0].extend(k.astype(np.float64))
            history[next_id][layer][1].extend(v.astype(np.float64))

    for n in (0, 3, 6, 17):
        start(n)
    for it in range(240):
        if it >= 24 and copied:
            break  # 24 steps, more while no step has copied a shared block (1% of walks)
        # Preempt the longest sequences while a worst-case step might not fit, as an engine
        # would: a new sequence takes up to 3 blocks of 4 tokens, and each sequence's step
        # up to 4 plus a copy-on-write block. (Unchecked, the random walk can run out.)
        while len(history) > 1 and cache.num_free_blocks < 5 * (len(history) + 1) + 3:
            victim = max(history, key=cache.manager.context_len)
            cache.free(victim)
            del history[victim]
        live = sorted(history)
        r = rng.random()
        if r < 0.3 and len(live) < 8:
            parent = int(rng.choice(live))
            next_id += 1
            cache.fork(parent, next_id)
            history[next_id] = [(list(k), list(v)) for k, v in history[parent]]
        elif r < 0.4 and len(live) > 3:
            victim = int(rng.choice(live))
            cache.free(victim)
            del history[victim]
        elif r < 0.55:
            start(int(rng.integers(0, 12)))
        seqs = sorted(history)
        decode = it % 5 == 4  # one token each, without num_tokens
        counts = [1 if decode else int(rng.choice([0, 1, 1, 2, 5, 16])) for _ in seqs]
        m = cache.manager
        copied += sum(1 for s, k in zip(seqs, counts) if k and m.context_len(s) % bs
                      and m.ref_count(m.block_table(s)[-1]) > 1)
        step = cache.step(seqs, num_tokens=None if decode else counts)
        starts = [0, *np.cumsum(counts).tolist()]
        total = starts[-1]
        assert cupy.asnumpy(step.query_start_loc).tolist() == starts
        assert cupy.asnumpy(step.seq_lens).tolist() == [m.context_len(s) for s in seqs]
        for layer in range(layers):
            k = testing.random_normal((total, kvh, hs), dt, rng)
            v = testing.random_normal((total, kvh, hs), dt, rng)
            _write(cache, layer, k, v, step.slot_mapping)
            q = testing.random_normal((total, heads, hs), dt, rng)
            out = cupy.full((total, heads, hs), float("nan"), dt)
            cupaged.attention(cupy.asarray(q), cache.key_caches[layer], cache.value_caches[layer],
                              step.block_tables, step.seq_lens, step.query_start_loc,
                              kv_layout=cache.kv_layout, max_query_len=max(counts, default=0),
                              out=out)
            got = cupy.asnumpy(out)
            for i, s in enumerate(seqs):
                a, b = starts[i], starts[i + 1]
                history[s][layer][0].extend(k[a:b].astype(np.float64))
                history[s][layer][1].extend(v[a:b].astype(np.float64))
                if a == b:
                    continue
                ref = reference.attend(q[a:b], np.array(history[s][layer][0]),
                                       np.array(history[s][layer][1]), 1 / np.sqrt(hs))
                assert_close(got[a:b], ref, tol, (it, s, layer))
                checked += 1
        m.check()
    for s in list(history):
        cache.free(s)
    assert cache.num_used_blocks == 0 and checked > 100 and copied > 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tail", [7, 0], ids=["prefix-hit", "whole-prompt-cached"])
def test_prefix_hit_remainder_equals_whole_prompt(rng, layout, tail):
    """B's prompt repeats A's first three blocks, then ``tail`` tokens of its own (none:
    B's prompt is A's first three blocks exactly, so its last block is recomputed). With
    prefix caching B stores and computes only its remainder, attending over A's shared
    blocks and its own; those rows equal the same rows of B's whole prompt computed in a
    cache without prefix caching (and the float64 reference)."""
    import cupy

    bs, kvh, heads, hs, dt = 16, 2, 8, 64, np.float16
    a_ids = list(range(100, 100 + 3 * bs + 9))
    b_ids = a_ids[:3 * bs] + list(range(900, 900 + tail))
    n = len(b_ids)
    # A token's K/V depend on the tokens up to it: B's first three blocks have A's.
    kv_a = testing.random_normal((len(a_ids), 2, kvh, hs), dt, rng)
    kv_b = np.concatenate([kv_a[:3 * bs], testing.random_normal((tail, 2, kvh, hs), dt, rng)])
    q = testing.random_normal((n, heads, hs), dt, rng)

    def attend(cache, rows, step):
        return cupy.asnumpy(cupaged.attention(
            cupy.asarray(q[rows]), cache.key_caches[0], cache.value_caches[0],
            step.block_tables, step.seq_lens, step.query_start_loc, kv_layout=cache.kv_layout,
            max_query_len=len(q[rows])))

    plain = PagedKVCache(1, 32, kvh, hs, bs, "float16", kv_layout=layout)
    plain.add("a", len(a_ids))  # the same blocks taken as below, unused
    step = plain.prefill(["b"], [n], token_ids=[b_ids])
    _write(plain, 0, kv_b[:, 0], kv_b[:, 1], step.slot_mapping)
    whole = attend(plain, slice(0, n), step)
    ref = reference.attend(q, kv_b[:, 0].astype(np.float64), kv_b[:, 1].astype(np.float64),
                           1 / np.sqrt(hs))
    assert_close(whole, ref, testing.TOLERANCE["f16"], "whole prompt")

    cache = PagedKVCache(1, 32, kvh, hs, bs, "float16", kv_layout=layout, prefix_caching=True)
    slots = cache.add("a", len(a_ids), token_ids=a_ids)
    _write(cache, 0, kv_a[:, 0], kv_a[:, 1], slots)
    step = cache.prefill(["b"], [n], token_ids=[b_ids])
    cached = cache.num_cached_tokens("b")
    assert cached == (3 * bs if tail else 2 * bs)
    assert cache.manager.block_table("b")[:cached // bs] == cache.manager.block_table("a")[:cached // bs]
    assert cupy.asnumpy(step.query_start_loc).tolist() == [0, n - cached]
    assert cupy.asnumpy(step.seq_lens).tolist() == [n] and step.slot_mapping.shape == (n - cached,)
    _write(cache, 0, kv_b[cached:, 0], kv_b[cached:, 1], step.slot_mapping)
    got = attend(cache, slice(cached, n), step)
    assert_close(got, whole[cached:], testing.TOLERANCE["f16"], "remainder vs whole prompt")
    assert_close(got, ref[cached:], testing.TOLERANCE["f16"], "remainder vs reference")
    # A's blocks were only read: A's own rows are as before.
    bt, sl = cache.tables(["a"])
    qa = testing.random_normal((len(a_ids), heads, hs), dt, rng)
    out = cupaged.attention(cupy.asarray(qa), cache.key_caches[0], cache.value_caches[0], bt, sl,
                            cupy.asarray([0, len(a_ids)], np.int32), kv_layout=layout)
    ref_a = reference.attend(qa, kv_a[:, 0].astype(np.float64), kv_a[:, 1].astype(np.float64),
                             1 / np.sqrt(hs))
    assert_close(cupy.asnumpy(out), ref_a, testing.TOLERANCE["f16"], "A after B")


# ---- on the GPU: fp8 caches -----------------------------------------------------------------


def _dev(x, framework):
    """A host array on the GPU, as a CuPy array or a torch tensor."""
    if framework == "cupy":
        import cupy

        return cupy.asarray(x)
    import torch

    from cupaged import _arrays

    src = x.astype(np.float32) if x.dtype.itemsize == 2 and x.dtype != np.float16 else x
    return torch.from_numpy(np.ascontiguousarray(src)).to("cuda", _arrays.torch_dtype(x.dtype))


def _host(a):
    """A CuPy array or torch tensor as a NumPy array (fp8 tensors as their bytes, bfloat16
    tensors as float32)."""
    if hasattr(a, "cpu"):
        import torch

        if a.element_size() == 1:
            a = a.view(torch.uint8)
        elif a.dtype == torch.bfloat16:
            a = a.float()
        return a.cpu().numpy()
    import cupy

    return cupy.asnumpy(a)


def _host_layer(cache, layer):
    """A layer's caches and scales on the host, as the reference takes them (per tensor:
    the float32 value the kernels read)."""
    kc, vc = _host(cache.key_caches[layer]), _host(cache.value_caches[layer])
    ks, vs = _host(cache.k_scales[layer]), _host(cache.v_scales[layer])
    return (kc, vc, ks, vs) if cache.kv_scales == "token" else (kc, vc, ks[0], vs[0])


def _quantized(rows, fmt, scale):
    """What an fp8 cache holds for ``rows [n, kv_heads, head_size]``, read as ``stored *
    scale`` in float64: quantized with ``scale``, or with None per token and head."""
    s = reference.token_head_scales(rows, fmt) if scale is None else scale
    return reference.dequantize_fp8(reference.quantize_fp8(rows, fmt, s), fmt, s)


def _check_stored(cache, layer, history):
    """Every sequence's tokens in the cache are exactly its K/V history quantized with the
    layer's scales (the reference quantizer, bit for bit)."""
    kc, vc, ks, vs = _host_layer(cache, layer)
    fmt, per_token = cache.kv_cache_dtype, cache.kv_scales == "token"
    for s, hist in history.items():
        k_rows, v_rows = (np.concatenate(h) for h in hist[layer])
        table = np.asarray(cache.manager.block_table(s))
        k, v = reference.gather_kv(kc, vc, table, len(k_rows), cache.kv_layout, fmt, ks, vs)
        np.testing.assert_array_equal(k, _quantized(k_rows, fmt, None if per_token else ks),
                                      err_msg=f"sequence {s!r}, layer {layer}: K")
        np.testing.assert_array_equal(v, _quantized(v_rows, fmt, None if per_token else vs),
                                      err_msg=f"sequence {s!r}, layer {layer}: V")


def _poison(cache):
    """NaN in every cache byte (0x7F is NaN in both formats) and every per-token scale: the
    stale slots of recycled blocks, which must never reach an output."""
    for a in cache.key_caches + cache.value_caches:
        if cache.framework == "torch":
            import torch

            a.view(torch.uint8).fill_(0x7F)
        else:
            a.fill(0x7F)
    if cache.kv_scales == "token":
        for a in cache.k_scales + cache.v_scales:
            a[...] = float("nan")


def _rows(rng, n, kvh, hs, dtype):
    """Random K or V rows whose magnitude varies by token and head (so per-token scales
    differ and small rows are not lost under a large one's scale)."""
    mag = np.exp(rng.uniform(-2, 2, (n, kvh, 1)))
    return (rng.standard_normal((n, kvh, hs)) * mag).astype(dtype)


def _attend(cache, layer, q, step, framework, max_query_len):
    """cupaged.attention over the step, into a NaN-poisoned output: host result and the
    float64 reference over the cache's stored bytes and scales."""
    out = _dev(np.full(q.shape, np.nan, q.dtype), framework)
    cupaged.attention(_dev(q, framework), cache.key_caches[layer], cache.value_caches[layer],
                      step.block_tables, step.seq_lens, step.query_start_loc,
                      kv_layout=cache.kv_layout, max_query_len=max_query_len, out=out,
                      **cache.layer_kwargs(layer))
    kc, vc, ks, vs = _host_layer(cache, layer)
    ref = reference.attention(q, kc, vc, _host(step.block_tables), _host(step.seq_lens),
                              _host(step.query_start_loc), kv_layout=cache.kv_layout,
                              kv_cache_dtype=cache.kv_cache_dtype, k_scale=ks, v_scale=vs)
    return _host(out), ref


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("fmt, kv_scales, kvh, bs", [
    ("fp8_e4m3", "tensor", 2, 16), ("fp8_e5m2", "token", 2, 16), ("fp8", "token", 3, 2)],
    ids=["e4m3-tensor", "e5m2-token", "e4m3-token-padded"])
def test_fp8_caches_on_the_device(layout, framework, fmt, kv_scales, kvh, bs):
    """fp8 caches in each layout and framework: torch's float8 type or CuPy's uint8, on
    the device, in vLLM's layout with x = 16; per-tensor scales start at 1.0, and
    per-token scales are views of the padded arrays copy-on-write copies."""
    if framework == "torch":
        torch = pytest.importorskip("torch")
    layers, nb, hs = 2, 6, 64
    cache = PagedKVCache(layers, nb, kvh, hs, bs, "float16", kv_layout=layout,
                         framework=framework, kv_cache_dtype=fmt, kv_scales=kv_scales)
    name = "fp8_e5m2" if fmt == "fp8_e5m2" else "fp8_e4m3"
    assert cache.kv_cache_dtype == name and cache.kv_scales == kv_scales
    want = {"vllm": ((nb, kvh, hs // 16, bs, 16), (nb, kvh, hs, bs)),
            "NHD": ((nb, bs, kvh, hs),) * 2, "HND": ((nb, kvh, bs, hs),) * 2}[layout]
    for kc, vc in zip(cache.key_caches, cache.value_caches):
        assert (tuple(kc.shape), tuple(vc.shape)) == want
        if framework == "torch":
            assert kc.dtype == vc.dtype == getattr(torch, "float8_e5m2" if name == "fp8_e5m2"
                                                   else "float8_e4m3fn")
            assert kc.is_cuda and vc.is_cuda
        else:
            import cupy

            assert isinstance(kc, cupy.ndarray) and kc.dtype == vc.dtype == np.uint8
    for layer in range(layers):
        ks, vs = cache.k_scales[layer], cache.v_scales[layer]
        if kv_scales == "tensor":
            assert tuple(ks.shape) == tuple(vs.shape) == (1,)
            assert _host(ks).tolist() == _host(vs).tolist() == [1.0]
        else:
            assert tuple(ks.shape) == tuple(vs.shape) == (nb, kvh, bs)
            ks[...] = 3.0  # through the view into the array copy_blocks copies
            vs[...] = 5.0
            assert (_host(cache._k_scale_blocks[layer])[:, :kvh * bs] == 3.0).all()
            assert (_host(cache._v_scale_blocks[layer])[:, :kvh * bs] == 5.0).all()
        assert _host(ks).dtype == np.float32
    row = -(-kvh * bs // 4) * 4 if kv_scales == "token" else 0
    assert cache.bytes_per_block == 2 * layers * (kvh * hs * bs + 4 * row)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("kv_scales", ["tensor", "token"])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fp8_prefill_then_decode_matches_reference(rng, fmt, kv_scales, framework, layout):
    """Two layers of fp8 cache through a prefill of three prompts and three decode steps,
    K/V written by reshape_and_cache with ``cache.layer_kwargs`` (per tensor: calibrated
    scales, different per layer and for K and V, written into ``cache.k_scales`` in
    place first) into a cache whose every byte and scale starts as NaN. The cache holds
    exactly the quantized history, and cupaged.attention (the multi-token kernel, then
    the decode kernel; paged_attention too over vLLM's layout) matches the float64
    reference over the stored bytes and scales."""
    if framework == "torch":
        pytest.importorskip("torch")
    layers, kvh, heads, hs, bs = 2, 2, 8, 64, 16
    dtype = np.float16 if fmt == "fp8_e4m3" else _BF16  # both model dtypes
    tol = testing.TOLERANCE["f16" if dtype == np.float16 else "bf16"]
    cache = PagedKVCache(layers, 24, kvh, hs, bs, np.dtype(dtype).name, kv_layout=layout,
                         framework=framework, kv_cache_dtype=fmt, kv_scales=kv_scales)
    assert cache.kv_cache_dtype == fmt
    _poison(cache)
    seqs, prompts, steps = ["a", "b", "c"], [1, 37, 16], 3
    # K/V of every token up front, so per-tensor scales can be calibrated on them.
    kv = {s: [[_rows(rng, n + steps, kvh, hs, dtype) for _ in "kv"] for _ in range(layers)]
          for s, n in zip(seqs, prompts)}
    if kv_scales == "tensor":
        fmax = reference.fp8_max(fmt)
        for layer in range(layers):
            for i, (scales, factor) in enumerate(((cache.k_scales, 0.9), (cache.v_scales, 1.3))):
                amax = max(np.abs(kv[s][layer][i].astype(np.float32)).max() for s in seqs)
                scales[layer][...] = float(np.float32(amax / fmax * factor))  # some saturate
    history = {s: [([], []) for _ in range(layers)] for s in seqs}

    def write(step, counts, start):
        """The next ``counts[i]`` tokens of each sequence, from token ``start[i]``."""
        for layer in range(layers):
            kw = cache.layer_kwargs(layer)
            k, v = (np.concatenate([kv[s][layer][i][a:a + n] for s, a, n in
                                    zip(seqs, start, counts)]) for i in range(2))
            cupaged.reshape_and_cache(_dev(k, framework), _dev(v, framework),
                                      cache.key_caches[layer], cache.value_caches[layer],
                                      step.slot_mapping, kv_layout=cache.kv_layout, **kw)
            for s, a, n in zip(seqs, start, counts):
                history[s][layer][0].append(kv[s][layer][0][a:a + n])
                history[s][layer][1].append(kv[s][layer][1][a:a + n])

    step = cache.prefill(seqs, prompts)
    write(step, prompts, [0, 0, 0])
    for layer in range(layers):
        _check_stored(cache, layer, history)
        q = testing.random_normal((sum(prompts), heads, hs), dtype, rng)
        got, ref = _attend(cache, layer, q, step, framework, max(prompts))
        assert_close(got, ref, tol, f"prefill, layer {layer}")
    for it in range(steps):
        step = cache.step(seqs)
        write(step, [1, 1, 1], [n + it for n in prompts])
        for layer in range(layers):
            _check_stored(cache, layer, history)
            q = testing.random_normal((len(seqs), heads, hs), dtype, rng)
            got, ref = _attend(cache, layer, q, step, framework, 1)
            assert_close(got, ref, tol, f"decode {it}, layer {layer}")
            if layout == "vllm":
                kc, vc, ks, vs = _host_layer(cache, layer)
                out = cupaged.paged_attention(_dev(q, framework), cache.key_caches[layer],
                                              cache.value_caches[layer], step.block_tables,
                                              step.context_lens, **cache.layer_kwargs(layer))
                ref = reference.paged_attention(q, kc, vc, _host(step.block_tables),
                                                _host(step.context_lens), kv_cache_dtype=fmt,
                                                k_scale=ks, v_scale=vs)
                assert_close(_host(out), ref, tol, f"paged_attention {it}, layer {layer}")
    assert [cache.manager.context_len(s) for s in seqs] == [n + steps for n in prompts]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("kvh, bs", [(2, 16), (3, 2)], ids=["kvh2_bs16", "kvh3_bs2-padded"])
def test_fp8_fork_copies_token_scales(rng, layout, framework, kvh, bs):
    """Per-token scales through a fork: the step that makes the child's private copy of
    the shared, partly filled block copies that block's scale rows too (they equal the
    source's), and afterwards parent and child each read their own tokens, exactly
    quantized, through attention that matches the reference."""
    if framework == "torch":
        pytest.importorskip("torch")
    layers, heads, hs, fmt = 2, 2 * kvh, 64, "fp8_e4m3"
    tol = testing.TOLERANCE["f16"]
    cache = PagedKVCache(layers, 32, kvh, hs, bs, "float16", kv_layout=layout,
                         framework=framework, kv_cache_dtype=fmt, kv_scales="token")
    for layer in range(layers):  # never a scale reshape_and_cache writes: rows not copied show
        cache.k_scales[layer][...] = -1.0
        cache.v_scales[layer][...] = -2.0
    n = 3 * bs + (bs + 1) // 2  # the last block partly filled
    history = {"a": [([], []) for _ in range(layers)]}

    slots = cache.add("a", n)
    for layer in range(layers):
        k, v = _rows(rng, n, kvh, hs, np.float16), _rows(rng, n, kvh, hs, np.float16)
        cupaged.reshape_and_cache(_dev(k, framework), _dev(v, framework),
                                  cache.key_caches[layer], cache.value_caches[layer], slots,
                                  kv_layout=layout, **cache.layer_kwargs(layer))
        history["a"][layer][0].append(k)
        history["a"][layer][1].append(v)
    cache.fork("a", "b")
    history["b"] = [(list(k), list(v)) for k, v in history["a"]]
    src = cache.manager.block_table("a")[-1]
    before = [_host_layer(cache, layer) for layer in range(layers)]
    step = cache.step(["b"])  # b writes into the shared partial block: copy-on-write
    dst = cache.manager.block_table("b")[-1]
    assert dst != src and cache.manager.block_table("a")[-1] == src
    filled = n % bs
    for layer in range(layers):
        kc, vc, ks, vs = _host_layer(cache, layer)
        for name, got, was in (("K scales", ks, before[layer][2]),
                               ("V scales", vs, before[layer][3])):
            assert (was[src][:, :filled] > 0).all(), f"{name}: the source's rows were written"
            assert (was[dst] < 0).all(), f"{name}: the destination held the sentinel"
            np.testing.assert_array_equal(got[dst], got[src], err_msg=f"layer {layer}: {name}")
            np.testing.assert_array_equal(got[src], was[src], err_msg=f"layer {layer}: {name}")
        assert (kc[dst] == kc[src]).all() and (vc[dst] == vc[src]).all()
    # b's new token, then a step where both decode (a now writes its block in place).
    for step_seqs in (["b"], ["a", "b"]):
        if step_seqs != ["b"]:
            step = cache.step(step_seqs)
        for layer in range(layers):
            k = _rows(rng, len(step_seqs), kvh, hs, np.float16)
            v = _rows(rng, len(step_seqs), kvh, hs, np.float16)
            cupaged.reshape_and_cache(_dev(k, framework), _dev(v, framework),
                                      cache.key_caches[layer], cache.value_caches[layer],
                                      step.slot_mapping, kv_layout=layout,
                                      **cache.layer_kwargs(layer))
            for i, s in enumerate(step_seqs):
                history[s][layer][0].append(k[i:i + 1])
                history[s][layer][1].append(v[i:i + 1])
            _check_stored(cache, layer, history)
            q = testing.random_normal((len(step_seqs), heads, hs), np.float16, rng)
            got, ref = _attend(cache, layer, q, step, framework, 1)
            assert_close(got, ref, tol, f"{step_seqs}, layer {layer}")
    assert cache.manager.context_len("a") == n + 1 and cache.manager.context_len("b") == n + 2


# ---- PagedMLACache ---------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("kv, dtype", [("auto", "bfloat16"), ("auto", "float16"),
                                       ("fp8", "bfloat16"), ("fp8_e5m2", "float16")])
def test_latent_cache_shapes_dtypes_and_scales(host_arrays, framework, kv, dtype):
    layers, nb, bs = 3, 10, 64
    cache = cupaged.PagedMLACache(layers, nb, bs, dtype, framework=framework, device=0,
                                  kv_cache_dtype=kv)
    assert cache.dtype == np.dtype(dtype) and (cache.kv_lora_rank, cache.rope_dim) == (512, 64)
    assert len(cache.kv_caches) == len(cache.scales) == layers
    assert len({id(c) for c in cache.kv_caches}) == layers
    if kv == "auto":
        assert cache.kv_cache_dtype == "auto" and cache.scales == [None] * layers
        store = np.dtype(dtype)
    else:
        name = "fp8_e5m2" if kv == "fp8_e5m2" else "fp8_e4m3"
        assert cache.kv_cache_dtype == name
        store = (_dtypes.KV_CACHE_DTYPES[name].numpy if framework == "torch"
                 else np.dtype(np.uint8))
        for s in cache.scales:
            assert s.shape == (1,) and s.dtype == np.float32 and s[0] == 1.0
        assert len({id(s) for s in cache.scales}) == layers  # each layer calibrates its own
    for c in cache.kv_caches:
        assert c.shape == (nb, bs, 576) and c.dtype == store
    assert cache.bytes_per_block == layers * bs * 576 * store.itemsize
    assert cache.num_free_blocks == nb and cache.bytes_in_use == 0


@pytest.mark.parametrize("kw, error, match", [
    (dict(dtype="float32"), TypeError, "dtype float32 is not supported: MLA takes float16 or "
                                       "bfloat16"),
    (dict(dtype="fp8"), ValueError, "dtype is the model's"),
    (dict(kv_lora_rank=256), ValueError, "kv_lora_rank 256 and rope_dim 64 are not supported: "
                                         "mla_attention is built for 512 and 64"),
    (dict(rope_dim=32), ValueError, "rope_dim 32"),
    (dict(block_size=24), ValueError, "block_size 24 is not supported"),
    (dict(num_layers=0), ValueError, "need num_layers > 0"),
    (dict(kv_cache_dtype="int8"), ValueError, "kv_cache_dtype must be"),
    (dict(framework="jax"), ValueError, "framework must be 'cupy' or 'torch'"),
])
def test_latent_cache_arguments_are_checked(host_arrays, kw, error, match):
    args = dict(num_layers=2, num_blocks=4, block_size=16, device=0)
    args.update(kw)
    with pytest.raises(error, match=match):
        cupaged.PagedMLACache(**args)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("kv, width, split", [("fp8_ds_mla", 656, (512, 64)),
                                              ("v4_fp8", 528, (448, 64)),
                                              ("v4_fp4", 288, (448, 64))])
def test_sparse_caches_hold_token_rows(host_arrays, framework, kv, width, split):
    """DeepSeek's sparse formats: one uint8 row of the format's bytes a token (torch too:
    the writer and the readers take uint8), no scales (the rows carry theirs), the
    writer's kv_c / k_pe split (V4's 512 values: 448 and 64 by default, or as given)."""
    layers, nb, bs = 2, 6, 64
    cache = cupaged.PagedMLACache(layers, nb, bs, "bfloat16", framework=framework, device=0,
                                  kv_cache_dtype=kv)
    assert cache.kv_cache_dtype == kv and cache.scales == [None] * layers
    assert (cache.kv_lora_rank, cache.rope_dim) == split
    for c in cache.kv_caches:
        assert c.shape == (nb, bs, width) and c.dtype == np.uint8
    assert cache.bytes_per_block == layers * bs * width
    if kv != "fp8_ds_mla":
        for given, want in ((dict(rope_dim=32), (480, 32)), (dict(kv_lora_rank=384), (384, 128)),
                            (dict(kv_lora_rank=256, rope_dim=256), (256, 256))):
            c = cupaged.PagedMLACache(1, 2, 16, framework=framework, device=0,
                                      kv_cache_dtype=kv, **given)
            assert (c.kv_lora_rank, c.rope_dim) == want, given


@pytest.mark.parametrize("kv, kw, error, match", [
    ("fp8_ds_mla", dict(dtype="float16"), TypeError,
     "dtype float16 is not supported with kv_cache_dtype='fp8_ds_mla': sparse_mla_attention "
     "reads its rows with bfloat16 queries"),
    ("v4_fp4", dict(dtype="float16"), TypeError, "dtype float16 is not supported with"),
    ("fp8_ds_mla", dict(kv_lora_rank=448), ValueError,
     "kv_lora_rank 448 and rope_dim 64 are not supported: fp8_ds_mla rows hold 512 and 64"),
    ("v4_fp8", dict(kv_lora_rank=448, rope_dim=32), ValueError,
     r"kv_lora_rank 448 and rope_dim 32 do not split v4_fp8's 512-dim token: expected two "
     r"positive multiples of 8 that sum to 512 \(V4's 448 and 64\)"),
    ("v4_fp8", dict(kv_lora_rank=508), ValueError, "kv_lora_rank 508 and rope_dim 4 do not"),
    ("v4_fp4", dict(rope_dim=0), ValueError, "kv_lora_rank 512 and rope_dim 0 do not"),
    ("v4_fp4", dict(kv_lora_rank=512, rope_dim=64), ValueError, "do not split"),
    ("v4_fp8", dict(kv_lora_rank=448.0), TypeError, "kv_lora_rank must be an int, got 448.0"),
    ("v4_fp8", dict(rope_dim="64"), TypeError, "rope_dim must be an int, got '64'"),
    ("auto", dict(kv_lora_rank=True), TypeError, "kv_lora_rank must be an int"),
])
def test_sparse_cache_arguments_are_checked(host_arrays, kv, kw, error, match):
    args = dict(num_layers=1, num_blocks=4, block_size=16, device=0, kv_cache_dtype=kv)
    args.update(kw)
    with pytest.raises(error, match=match):
        cupaged.PagedMLACache(**args)


def test_latent_cache_step_copies_latent_blocks_on_write(host_arrays, monkeypatch):
    """step's copy-on-write goes through copy_blocks_mla with every layer's cache and the
    plan's (source, destination) pairs; the upload is replaced by host views."""
    calls = []
    monkeypatch.setattr(cupaged.cache_ops, "copy_blocks_mla",
                        lambda caches, pairs: calls.append((list(caches), np.array(pairs))))
    monkeypatch.setattr(cupaged.PagedMLACache, "_upload",
                        lambda self, purpose, parts: [np.asarray(p, np.int32) for p in parts])
    cache = cupaged.PagedMLACache(2, 8, 4, device=0)
    cache.add("a", 6)                  # blocks 0 (full) and 1 (half)
    cache.fork("a", "b")               # b shares both
    step = cache.step(["b"])           # b's 7th token: its half block is copied first
    assert len(calls) == 1
    caches, pairs = calls[0]
    assert [id(c) for c in caches] == [id(c) for c in cache.kv_caches]
    (src, dst), = pairs.tolist()
    assert src == cache.manager.block_table("a")[1] and dst == cache.manager.block_table("b")[1]
    assert src != dst and step.seq_lens.tolist() == [7]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_latent_cache_serves_mla_attention(rng, kv):
    """Prompts written with concat_and_cache_mla into a PagedMLACache, a fork whose decode
    step copies its shared half block, then mla_attention over the step's tables against
    the float64 reference over the same cache bytes."""
    import cupy

    layers, nb, bs, heads = 2, 32, 16, 16
    cache = cupaged.PagedMLACache(layers, nb, bs, "bfloat16", kv_cache_dtype=kv)
    for s in cache.scales if kv != "auto" else ():
        s[...] = 0.05
    bf16 = _dtypes.BF16.numpy

    def write(step, n):
        for layer in range(layers):
            kv_c = cupy.asarray(testing.random_normal((n, 512), bf16, rng))
            k_pe = cupy.asarray(testing.random_normal((n, 64), bf16, rng))
            cupaged.concat_and_cache_mla(kv_c, k_pe, cache.kv_caches[layer],
                                         step.slot_mapping, cache.kv_cache_dtype,
                                         cache.scales[layer])

    write(cache.prefill(["a", "c"], [37, 5]), 42)
    cache.fork("a", "b")
    step = cache.step(["a", "b", "c"])  # b's copy of a's last block, then one token each
    write(step, 3)
    scale = 1 / np.sqrt(192)
    for layer in range(layers):
        q = cupy.asarray(testing.random_normal((3, heads, 576), bf16, rng))
        out = cupy.full((3, heads, 512), np.nan, bf16)
        kw = dict(kv_cache_dtype=cache.kv_cache_dtype, k_scale=cache.scales[layer])
        cupaged.mla_attention(q, cache.kv_caches[layer], step.block_tables, step.seq_lens,
                              step.query_start_loc, scale=scale, out=out, **kw)
        host_kw = dict(kv_cache_dtype=cache.kv_cache_dtype,
                       k_scale=None if kv == "auto" else float(cache.scales[layer][0]))
        ref = reference.mla_attention(cupy.asnumpy(q), cupy.asnumpy(cache.kv_caches[layer]),
                                      cupy.asnumpy(step.block_tables),
                                      cupy.asnumpy(step.seq_lens),
                                      cupy.asnumpy(step.query_start_loc), scale=scale,
                                      **host_kw)
        assert_close(cupy.asnumpy(out).astype(np.float64), ref, testing.TOLERANCE["bf16"])
    # b's table differs from a's in its copied last block only, whose first 37 % 16 tokens
    # are a's bytes
    ta, tb = cache.manager.block_table("a"), cache.manager.block_table("b")
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    for c in cache.kv_caches:
        got = cupy.asnumpy(c)
        np.testing.assert_array_equal(got[tb[2], :5].view(np.uint8), got[ta[2], :5].view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_ds_mla", "v4_fp8", "v4_fp4"])
def test_sparse_cache_serves_sparse_mla_attention(rng, kv):
    """DSA over a PagedMLACache of DeepSeek's token rows: prompts written with
    concat_and_cache_mla in the format, a fork whose decode step copies its shared half
    block, the step's top-k as global slots from indexer_topk through the step's tables
    (logits over each sequence's tokens, -inf past them: the short sequence's row ends in
    -1s), then sparse_mla_attention over those slots against the float64 reference over
    the same cache bytes; the copied block's rows are the source's bytes."""
    import cupy

    layers, nb, bs, heads, topk = 2, 32, 16, 64, 24
    cache = cupaged.PagedMLACache(layers, nb, bs, "bfloat16", kv_cache_dtype=kv)
    rank, rope = cache.kv_lora_rank, cache.rope_dim
    d_qk = _dtypes.SPARSE_KV_CACHE_DTYPES[kv].values
    bf16 = _dtypes.BF16.numpy

    def write(step, n):
        for layer in range(layers):
            kv_c = cupy.asarray(testing.random_normal((n, rank), bf16, rng))
            k_pe = cupy.asarray(testing.random_normal((n, rope), bf16, rng))
            cupaged.concat_and_cache_mla(kv_c, k_pe, cache.kv_caches[layer],
                                         step.slot_mapping, cache.kv_cache_dtype)

    write(cache.prefill(["a", "c"], [37, 5]), 42)
    cache.fork("a", "b")
    step = cache.step(["a", "b", "c"])  # b's copy of a's last block, then one token each
    write(step, 3)
    lens = cupy.asnumpy(step.seq_lens)
    tables = cupy.asnumpy(step.block_tables)
    width = int(lens.max())
    logits = rng.normal(size=(3, width)).astype(np.float32)
    logits[np.arange(width)[None] >= lens[:, None]] = -np.inf
    slots = cupaged.indexer_topk(cupy.asarray(logits), topk, block_tables=step.block_tables,
                                 block_size=bs)
    want_slots = reference.indexer_slots(reference.indexer_topk(logits, topk), tables, bs,
                                         lens)
    assert np.array_equal(cupy.asnumpy(slots), want_slots)
    assert (want_slots[2] == -1).sum() == topk - 6 and (want_slots[:2] >= 0).all()
    scale = 1 / np.sqrt(192)
    for layer in range(layers):
        q = cupy.asarray(testing.random_normal((3, 1, heads, d_qk), bf16, rng))
        out = cupy.full((3, 1, heads, 512), np.nan, bf16)
        cupaged.sparse_mla_attention(q, cache.kv_caches[layer], slots[:, None], scale=scale,
                                     out=out)
        ref = reference.sparse_mla_attention(cupy.asnumpy(q),
                                             cupy.asnumpy(cache.kv_caches[layer]),
                                             want_slots[:, None], scale=scale, kv_format=kv)
        assert_close(cupy.asnumpy(out).astype(np.float64), ref, testing.TOLERANCE["bf16"], kv)
    ta, tb = cache.manager.block_table("a"), cache.manager.block_table("b")
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    for c in cache.kv_caches:
        got = cupy.asnumpy(c)
        np.testing.assert_array_equal(got[tb[2], :5], got[ta[2], :5])


def test_table_rows_grown_for_more_sequences_start_as_zeros():
    """Past the host table's first 8 rows it grows with rows of zeros: a sequence's
    entries past its blocks name block 0, never another sequence's blocks."""
    m = BlockManager(64, 4)
    m.add("long", 4 * 6)  # row 0: six blocks
    for i in range(8):
        m.add(i, 1)  # rows 1-8: one block each (row 8 needs the table grown)
    tables, lens = m.tables([7])
    assert lens.tolist() == [1] and tables.shape == (1, 1)
    row = m._seqs[7].row
    assert row >= 8 and (m._table[row, 1:] == 0).all(), m._table[row]
