"""BlockManager under random add / append / fork / free sequences, with and without prefix
caching; failed calls change nothing; PagedKVCache.step plans, uploads and only then
applies (checked with host stand-ins for the device). No GPU needed."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cupaged.cache_ops
from cupaged import BlockManager, OutOfBlocks, PagedKVCache


def snapshot(m: BlockManager) -> dict:
    """Everything a BlockManager answers, its host table and lengths for live rows, and the
    internals that decide what later calls do (free-list order, prefix registry, the token
    ids of partly filled blocks): equal snapshots mean nothing changed."""
    seqs = m.sequences
    bt, cl = m.tables(seqs)
    return {
        "sequences": seqs,
        "free": (m.num_free_blocks, m.num_used_blocks, list(m._free)),
        "refs": [m.ref_count(b) for b in range(m.num_blocks)],
        "seqs": {s: (s in m, m.context_len(s), m.block_table(s)) for s in seqs},
        "host": ([bt[i, : len(m.block_table(s))].tolist() for i, s in enumerate(seqs)],
                 cl.tolist()),
        "prefix": (dict(m._full), dict(m._key_of)),
        "tokens": {s: (None if q.tokens is None else list(q.tokens), q.parent)
                   for s, q in m._seqs.items()},
    }


class Model(RuleBasedStateMachine):
    """Random operations against a BlockManager, checked against a dense model: each
    sequence's token -> slot history must stay its own (never written by another
    sequence after it was shared), copy-on-write happens exactly when a shared, partly
    filled block is written, failed calls change nothing, and every block is free again at
    the end."""

    prefix_caching = False

    def __init__(self):
        super().__init__()
        self.bs = 4
        self.m = BlockManager(24, self.bs, prefix_caching=self.prefix_caching)
        self.next_id = 0
        self.slots = {}  # seq -> list of slots holding its tokens, in order
        self.data = {}  # slot -> token value most recently written there
        self.values = {}  # seq -> list of token values (its dense history)
        self.tokens = {}  # seq -> its token ids (None: appended without one)
        self.kv = {}  # token-id prefix -> the value its token writes (prefix caching)

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

    def _ids(self, data, n, none_ok):
        if not self.prefix_caching:
            return None
        tok = st.one_of(st.none(), st.integers(0, 1)) if none_ok else st.integers(0, 1)
        return data.draw(st.lists(tok, min_size=n, max_size=n))

    @rule(n=st.integers(0, 13), data=st.data())
    def add(self, n, data):
        s = self._new_id()
        ids = self._ids(data, n, none_ok=False)
        before = snapshot(self.m)
        try:
            slots = self.m.add(s, n, ids)
        except OutOfBlocks:
            assert -(-n // self.bs) > before["free"][0]
            assert snapshot(self.m) == before
            return
        # -1 exactly for the leading full blocks found in the prefix cache
        shared = int((slots < 0).sum())
        assert shared % self.bs == 0 and (slots[:shared] == -1).all()
        assert shared == 0 or self.prefix_caching
        written = slots[shared:].tolist()
        assert len(written) == n - shared and len(set(written)) == len(written)
        table = self.m.block_table(s)
        self.slots[s] = [table[i // self.bs] * self.bs + i % self.bs for i in range(n)]
        assert self.slots[s][shared:] == written
        self.tokens[s] = [None] * n if ids is None else list(ids)
        self.values[s] = [self._value(self.tokens[s][: i + 1]) for i in range(n)]
        for slot, v in zip(written, self.values[s][shared:]):
            self.data[slot] = v

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
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.slots)), min_size=1, unique=True))
        ids = self._ids(data, len(seqs), none_ok=True)
        via_plan = data.draw(st.booleans())
        before = snapshot(self.m)
        tables_before = {s: self.m.block_table(s) for s in seqs}
        shared_partial = {s for s in seqs if self.m.context_len(s) % self.bs
                          and self.m.ref_count(tables_before[s][-1]) > 1}
        try:
            if via_plan:  # as PagedKVCache.step does: host tables from the plan, then apply
                plan = self.m._plan_append(seqs, ids)
                planned_bt, planned_cl = self.m._tables_after(plan)
                assert snapshot(self.m) == before  # planning changes nothing
                self.m._apply_append(plan)
                slots, copies = plan.slots, plan.copies
                bt, cl = self.m.tables(seqs)
                assert planned_cl.tolist() == cl.tolist() and planned_bt.shape == bt.shape
                for i, s in enumerate(seqs):
                    n = len(self.m.block_table(s))
                    assert planned_bt[i, :n].tolist() == bt[i, :n].tolist()
            else:
                slots, copies = self.m.append(seqs, ids)
        except OutOfBlocks:
            assert snapshot(self.m) == before  # nothing changed
            return
        for src, dst in copies.tolist():  # copies run before the writes
            for off in range(self.bs):
                if src * self.bs + off in self.data:
                    self.data[dst * self.bs + off] = self.data[src * self.bs + off]
        # Copy-on-write exactly when a shared partial block is written, at most once per
        # (block, step) writer beyond the last.
        copied_from = [src for src, _ in copies.tolist()]
        assert set(copied_from) <= {tables_before[s][-1] for s in shared_partial}
        for i, (s, slot) in enumerate(zip(seqs, slots.tolist())):
            self.tokens[s].append(None if ids is None else ids[i])
            v = self._value(self.tokens[s])
            self.data[slot] = v
            self.slots[s].append(slot)
            self.values[s].append(v)
            table = self.m.block_table(s)
            if s in shared_partial and table[-1] != tables_before[s][-1]:
                # this sequence now owns a private copy holding its earlier tokens
                self.slots[s] = [table[j // self.bs] * self.bs + j % self.bs
                                 for j in range(len(self.slots[s]))]

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def append_bad_token_id(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.slots)), min_size=1, unique=True))
        ids = [0] * len(seqs)
        ids[data.draw(st.integers(0, len(seqs) - 1))] = [1]
        before = snapshot(self.m)
        with pytest.raises(TypeError, match=r"token_ids\[\d+\] is \[1\]"):
            self.m.append(seqs, ids)
        assert snapshot(self.m) == before

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.slots)))
        child = self._new_id()
        self.m.fork(parent, child)
        assert self.m.block_table(child) == self.m.block_table(parent)
        self.slots[child] = list(self.slots[parent])
        self.values[child] = list(self.values[parent])
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.slots)))
        self.m.free(s)
        del self.slots[s], self.values[s], self.tokens[s]
        with pytest.raises(KeyError, match="unknown sequence"):
            self.m.free(s)

    @invariant()
    def consistent(self):
        self.m.check()
        for s, slots in self.slots.items():
            table = self.m.block_table(s)
            assert slots == [table[i // self.bs] * self.bs + i % self.bs for i in range(len(slots))]
            # every token still reads back what this sequence wrote
            assert [self.data[x] for x in slots] == self.values[s]

    def teardown(self):
        for s in list(self.slots):
            self.m.free(s)
        self.m.check()
        assert self.m.num_free_blocks == self.m.num_blocks


class PrefixModel(Model):
    """The same with prefix caching: prompts and tokens from a two-id alphabet, so prefix
    blocks are shared often, and some tokens appended without an id."""

    prefix_caching = True


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestBlockManager = Model.TestCase
TestBlockManager.settings = _settings
TestBlockManagerPrefixCaching = PrefixModel.TestCase
TestBlockManagerPrefixCaching.settings = _settings


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


def test_running_out_leaves_everything_intact():
    m = BlockManager(3, 4)
    m.add("a", 4)
    m.add("b", 4)
    m.add("c", 3)
    with pytest.raises(OutOfBlocks, match="need 2 free blocks, have 0"):
        m.append(["a", "b"])
    assert m.context_len("a") == m.context_len("b") == 4
    with pytest.raises(OutOfBlocks):
        m.add("d", 1)
    assert "d" not in m
    m.check()


@pytest.mark.parametrize("call, match", [
    (lambda m: m.free("nope"), "unknown sequence 'nope'"),
    (lambda m: m.append(["a", "a"]), "appears twice"),
    (lambda m: m.add("a", 1), "already exists"),
    (lambda m: m.fork("a", "a"), "already exists"),
    (lambda m: m.fork("zz", "y"), "unknown sequence 'zz'"),
    (lambda m: m.add("q", 3, token_ids=[1, 2]), "2 ids for 3 tokens"),
])
def test_misuse_is_an_error(call, match):
    m = BlockManager(4, 4)
    m.add("a", 2)
    with pytest.raises((KeyError, ValueError), match=match):
        call(m)
    m.check()


def test_prefix_blocks_are_shared_and_released():
    m = BlockManager(16, 4, prefix_caching=True)
    system = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = m.add("a", 10, system)
    b = m.add("b", 12, system + [7, 8])
    assert m.block_table("a")[:2] == m.block_table("b")[:2]
    assert (b[:8] == -1).all() and (b[8:] >= 0).all() and (a >= 0).all()
    assert m.block_table("a")[2] != m.block_table("b")[2]  # partial blocks are never shared
    c = m.add("c", 10, [1] + system[1:])  # differs in the first token: nothing shared
    assert (c >= 0).all() and not set(m.block_table("c")) & set(m.block_table("a"))
    m.free("a")
    m.free("b")
    m.check()
    d = m.add("d", 10, system)  # the blocks are gone with their owners
    assert (d >= 0).all()
    m.check()


def test_prefix_registered_by_appends():
    m = BlockManager(16, 2, prefix_caching=True)
    m.add("a", 1, [5])
    m.append(["a"], [6])  # block [5, 6] is now full and registered
    slots = m.add("b", 3, [5, 6, 9])
    assert slots[:2].tolist() == [-1, -1] and m.block_table("b")[0] == m.block_table("a")[0]


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
    assert m.context_len("a") == 1 and m.tables(["a"])[1].tolist() == [1]
    assert snapshot(m) == before
    m.check()
    m.append(["a"], [6])  # and the manager goes on as if nothing happened
    assert m.add("b", 3, [5, 6, 7])[:2].tolist() == [-1, -1]  # [5, 6] was registered


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
    (lambda m: m.append(["b"], [[1]]), TypeError, r"token_ids\[0\] is \[1\]"),
    (lambda m: m.append(["a", "c", "b"], [6, 7, {}]), TypeError, r"token_ids\[2\] is \{\}"),
    (lambda m: m.append(["e", "a"], [[1], 6]), TypeError, r"token_ids\[0\]"),
    (lambda m: m.append(["a", "nope"], [6, 7]), KeyError, "unknown sequence 'nope'"),
    (lambda m: m.append(["a", "b", "a"]), ValueError, "appears twice"),
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
        "append-twice", "add-partial-block", "add-after-miss", "add-lookup", "add-float-length",
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
    results = [x.append(["a", "b", "c", "e", "y", "z"], [6, 7, 8, 9, 10, 11]) for x in (m, twin)]
    assert [r.tolist() for r in results[0]] == [r.tolist() for r in results[1]]
    assert snapshot(m) == snapshot(twin)
    m.check()


def test_token_ids_are_checked_without_prefix_caching():
    m = BlockManager(8, 2)
    m.add("a", 1)
    with pytest.raises(TypeError, match=r"token_ids\[0\] is \[1\]"):
        m.append(["a"], [[1]])
    with pytest.raises(TypeError, match=r"token_ids\[1\] is \[2\]"):
        m.add("b", 2, [1, [2]])
    assert m.sequences == ["a"] and m.context_len("a") == 1
    m.check()


class Injected(RuntimeError):
    """A device failure made up by a test."""


@pytest.fixture
def host_cache(monkeypatch):
    """``host_cache(manager)``: a PagedKVCache over ``manager`` whose device work runs on
    the host: uploads return NumPy copies, copy_blocks records its (src, dst) pairs in
    ``.copied``. Setting ``.fail`` to "upload" or "copy" makes that part raise, as an
    out-of-memory buffer allocation or a failed launch would."""
    caches = []

    def copy_blocks(key_caches, value_caches, block_mapping, **kwargs):
        cache = next(c for c in caches if c.key_caches is key_caches)
        if cache.fail == "copy":
            raise Injected("copy_blocks failed")
        cache.copied.append(np.asarray(block_mapping).tolist())

    monkeypatch.setattr(cupaged.cache_ops, "copy_blocks", copy_blocks)

    def make(manager):
        cache = object.__new__(PagedKVCache)
        cache.manager, cache.key_caches, cache.value_caches = manager, [], []
        cache.fail, cache.copied = None, []

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


@pytest.mark.parametrize("fail", ["upload", "copy"])
def test_failed_step_changes_nothing_and_a_retry_matches(host_cache, fail):
    seqs, ids = ["a", "b", "c", "e"], [6, 7, 8, 9]  # a and c copy-on-write, e takes a block
    m, twin = _scene(), _scene()
    cache, twin_cache = host_cache(m), host_cache(twin)
    expected = _as_lists(twin_cache.step(seqs, ids))
    before = snapshot(m)
    cache.fail = fail
    with pytest.raises(Injected):
        cache.step(seqs, ids)
    assert snapshot(m) == before and cache.copied == []
    m.check()
    cache.fail = None
    assert _as_lists(cache.step(seqs, ids)) == expected
    assert cache.copied == twin_cache.copied and len(cache.copied[0]) == 1
    assert snapshot(m) == snapshot(twin)


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_step_matches_append_then_tables(host_cache, block_size):
    """step's tables come from the plan, before the manager changes; they must be the
    tables the applied append gives (block size 1 grows the host table past its width)."""
    def scene():
        m = BlockManager(64, block_size)
        m.add("a", 7)
        m.fork("a", "b")
        m.add("c", 2 * block_size)
        return m

    m, twin = scene(), scene()
    cache = host_cache(m)
    seqs = ["c", "a", "b"]
    for _ in range(12):
        copied = len(cache.copied)
        got = cache.step(seqs)
        slots, copies = twin.append(seqs)
        bt, cl = twin.tables(seqs)
        assert got.slot_mapping.tolist() == slots.tolist()
        assert got.context_lens.tolist() == cl.tolist()
        assert got.block_tables.tolist() == bt.tolist()
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
    assert cache.add("x", 5, [1, 2, 3, 4, 6]).tolist() == twin.add("x", 5, [1, 2, 3, 4, 6]).tolist()
    assert snapshot(m) == snapshot(twin)
