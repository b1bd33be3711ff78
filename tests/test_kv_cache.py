"""BlockManager under random add / append / fork / free sequences (no GPU needed), and
PagedKVCache's accounting."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cupaged import BlockManager, OutOfBlocks


class Model(RuleBasedStateMachine):
    """Random operations against a BlockManager, checked against a dense model: each
    sequence's token -> slot history must stay its own (never written by another
    sequence after it was shared), copy-on-write happens exactly when a shared, partly
    filled block is written, and every block is free again at the end."""

    def __init__(self):
        super().__init__()
        self.bs = 4
        self.m = BlockManager(24, self.bs)
        self.next_id = 0
        self.slots = {}  # seq -> list of slots holding its tokens, in order
        self.data = {}  # slot -> token value most recently written there
        self.values = {}  # seq -> list of token values (its dense history)

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(n=st.integers(0, 13))
    def add(self, n):
        s = self._new_id()
        free = self.m.num_free_blocks
        try:
            slots = self.m.add(s, n)
        except OutOfBlocks:
            assert -(-n // self.bs) > free
            return
        assert len(slots) == n and len(set(slots.tolist())) == n
        self.slots[s] = slots.tolist()
        self.values[s] = []
        for slot in slots.tolist():
            v = np.random.random()
            self.data[slot] = v
            self.values[s].append(v)

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def append(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.slots)), min_size=1, unique=True))
        before = {s: self.m.block_table(s) for s in seqs}
        shared_partial = {s for s in seqs if self.m.context_len(s) % self.bs
                          and self.m.ref_count(before[s][-1]) > 1}
        free = self.m.num_free_blocks
        try:
            slots, copies = self.m.append(seqs)
        except OutOfBlocks:
            assert self.m.num_free_blocks == free
            assert all(self.m.block_table(s) == before[s] for s in seqs)  # nothing changed
            return
        for src, dst in copies.tolist():  # copies run before the writes
            for off in range(self.bs):
                if src * self.bs + off in self.data:
                    self.data[dst * self.bs + off] = self.data[src * self.bs + off]
        # Copy-on-write exactly when a shared partial block is written, at most once per
        # (block, step) writer beyond the last.
        copied_from = [src for src, _ in copies.tolist()]
        assert set(copied_from) <= {before[s][-1] for s in shared_partial}
        for s, slot in zip(seqs, slots.tolist()):
            v = np.random.random()
            self.data[slot] = v
            self.slots[s].append(slot)
            self.values[s].append(v)
            table = self.m.block_table(s)
            if s in shared_partial and table[-1] != before[s][-1]:
                # this sequence now owns a private copy holding its earlier tokens
                self.slots[s] = [table[i // self.bs] * self.bs + i % self.bs
                                 for i in range(len(self.slots[s]))]

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.slots)))
        child = self._new_id()
        self.m.fork(parent, child)
        assert self.m.block_table(child) == self.m.block_table(parent)
        self.slots[child] = list(self.slots[parent])
        self.values[child] = list(self.values[parent])

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.slots)))
        self.m.free(s)
        del self.slots[s], self.values[s]
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


TestBlockManager = Model.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


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
