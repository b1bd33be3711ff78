"""A paged KV cache: block bookkeeping (plain Python) and the device caches it manages.

:class:`BlockManager` hands out and frees blocks, shares them between sequences with
reference counts (forks, and optionally prompt prefixes, kept after their last owner
until the space is needed), and plans copy-on-write. It needs no GPU.
:class:`PagedKVCache` owns one key and one value cache per layer in any of the layouts
:func:`cupaged.attention` reads (vLLM's, NHD, HND), of the model's dtype or fp8 (with
their scales), runs the copy-on-write copies itself, and gives every step
(prefill, chunked prefill, verify, decode, mixed) its slot mapping, block tables,
sequence lengths and query start offsets with one host-to-device copy.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, NamedTuple, Sequence

import numpy as np

__all__ = ["BlockManager", "DecodeStep", "OutOfBlocks", "PagedKVCache", "PagedMLACache",
           "Step"]


class OutOfBlocks(RuntimeError):
    """Not enough available blocks (free, or cached and evictable) for the request;
    nothing was changed."""


@dataclass
class _Seq:
    row: int  # this sequence's row of the host block table
    blocks: list = field(default_factory=list)
    length: int = 0
    # Prefix caching: token ids of the partly filled last block, and the prefix id (see
    # BlockManager._register) of the tokens before it. None when a token of the sequence has
    # no id, and parent also while the sequence has no full block.
    tokens: list | None = None
    parent: tuple | None = None
    cached: int = 0  # leading prompt tokens that add() found in the prefix cache


class _AppendPlan(NamedTuple):
    """What one append will do, decided by :meth:`BlockManager._plan_append` without
    changing anything. Valid until the manager next changes."""

    seqs: list  # the sequences, in call order
    counts: list | None  # new tokens per sequence (None: one each)
    token_ids: list | None  # one per new token, in step order
    slots: np.ndarray  # int64 [total]: where each new token goes, in step order
    copies: np.ndarray  # int64 [k, 2]: (src, dst) copy-on-write, to run before the writes
    rows: list  # each sequence's host-table row
    lens: list  # each sequence's length after the append
    # One entry per block the append takes, in the order _next_free gives them (free blocks,
    # then evicted cached ones; a sequence's entries are consecutive, in column order):
    taken: list  # the block
    takers: list  # the index in seqs of the sequence that takes it
    sources: list  # the block it copies (copy-on-write), or -1 for a fresh block
    cols: list  # its column in the taker's table row

    def query_start_loc(self) -> np.ndarray:
        """int32 ``[n + 1]``: where each sequence's new tokens start in step order."""
        if self.counts is None:
            return np.arange(len(self.seqs) + 1, dtype=np.int32)
        return _query_starts(self.counts)


def _query_starts(counts) -> np.ndarray:
    """int32 ``[len(counts) + 1]``: the running sum of ``counts`` from 0."""
    starts = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=starts[1:])
    return starts


def _check_token_ids(token_ids: list) -> None:
    """Token ids key the prefix cache, so they must be hashable. Checked up front: the ids
    of a partly filled block are hashed only when it fills, calls later."""
    try:
        hash(tuple(token_ids))  # one pass in C for the usual case
    except TypeError:
        for i, t in enumerate(token_ids):
            try:
                hash(t)
            except TypeError:
                raise TypeError(f"token_ids[{i}] is {t!r}, which is not hashable") from None
        raise


def _token_counts(num_tokens, num_seqs: int) -> list | None:
    """``num_tokens`` of an append: None (one token each) or one integer >= 0 per sequence."""
    if num_tokens is None:
        return None
    try:
        counts = [operator.index(k) for k in num_tokens]
    except TypeError:
        raise TypeError(f"num_tokens must be a sequence of integers, one per sequence, got "
                        f"{num_tokens!r}") from None
    if len(counts) != num_seqs:
        raise ValueError(f"num_tokens has {len(counts)} entries for {num_seqs} sequences")
    for i, k in enumerate(counts):
        if k < 0:
            raise ValueError(f"num_tokens[{i}] is {k}: a sequence appends 0 or more tokens")
    return counts


class BlockManager:
    """Block bookkeeping for a paged KV cache of ``num_blocks`` blocks of ``block_size``
    tokens.

    Sequences are identified by any hashable id. Slots are ``block * block_size + offset``.
    Every mutating call either succeeds or raises without changing anything.

    A sequence starts with :meth:`add` (its prompt, possibly empty) and grows with
    :meth:`append`, any number of tokens per sequence and call (chunked prefill, verify,
    decode). With ``prefix_caching``, full blocks are registered by their token ids and
    the tokens before them; :meth:`add` of a prompt with the same leading tokens shares
    those blocks instead of storing them again and returns slots only for the rest
    (:meth:`num_cached_tokens` says how many were found). Token ids may be any hashable
    values; they are checked whether or not prefix caching is on. A sequence takes part
    in the prefix cache while every token it holds has an id.

    A registered block outlives its owners: when the last sequence holding it is freed it
    stays in the prefix cache, *cached*, until a hit revives it or an allocation needs its
    space. Allocations take free blocks first, then evict cached blocks, least recently
    released first; :meth:`free` releases a sequence's blocks last to
    first, so a prefix chain is evicted from its tail. Every block is in one of three
    states: ``num_free_blocks`` (holding nothing), ``num_cached_blocks`` (registered, no
    owner, evictable) and ``num_used_blocks`` (held by a sequence); they sum to
    ``num_blocks``, and an allocation fails (:class:`OutOfBlocks`) only when it needs more
    than ``num_available_blocks``, free plus cached. Without prefix caching no block is
    ever cached. The K/V of a registered block are the caller's to write, as the slots
    :meth:`add` and :meth:`append` return say; a sequence freed before they were written
    leaves blocks in the cache that a later prompt would read.
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False):
        if num_blocks < 0 or block_size <= 0:
            raise ValueError(f"need num_blocks >= 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives low ids first
        self._ref = [0] * num_blocks
        self._seqs: dict = {}
        self._free_rows: list = []
        self._table = np.zeros((8, 8), np.int32)  # [row, logical block] -> physical block
        self._lens = np.zeros(8, np.int32)
        self._full: dict = {}  # (prefix id, tokens) -> block, for registered full blocks
        self._key_of: dict = {}  # block -> its key in _full
        self._gen = [0] * num_blocks  # times each block was evicted: see _register
        # Registered blocks by release, least recent first: the cached ones (ref 0) are
        # evicted in this order. A prefix hit leaves its block here, to be skipped while it
        # is used and moved to the end when released again, so a failed add can be undone
        # exactly (_undo_add).
        self._lru: OrderedDict = OrderedDict()
        self._num_cached = 0  # blocks in _lru with ref 0

    # ---- queries --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing: never used, evicted, or released without a prefix key."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks in the prefix cache that no sequence holds: a prompt's prefix hit
        reuses them, an allocation may evict them (always 0 without prefix caching)."""
        return self._num_cached

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free) - self._num_cached

    @property
    def num_available_blocks(self) -> int:
        """What allocations can take: free plus cached blocks."""
        return len(self._free) + self._num_cached

    @property
    def sequences(self) -> list:
        return list(self._seqs)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def context_len(self, seq_id) -> int:
        return self._get(seq_id).length

    def num_cached_tokens(self, seq_id) -> int:
        """How many leading tokens of the sequence's prompt :meth:`add` found in the prefix
        cache (a multiple of ``block_size``; 0 without prefix caching). A fork inherits
        its parent's count."""
        return self._get(seq_id).cached

    def block_table(self, seq_id) -> tuple:
        return tuple(self._get(seq_id).blocks)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def tables(self, seq_ids: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """Host ``(block_tables int32 [n, max_blocks], context_lens int32 [n])`` for these
        sequences, in this order. Entries past a sequence's blocks are unspecified."""
        seqs = [self._get(s) for s in seq_ids]
        rows = [q.row for q in seqs]
        width = max((len(q.blocks) for q in seqs), default=0)
        return self._table[rows, :width], self._lens[rows]

    # ---- mutations -----------------------------------------------------------------------------

    def cached_prefix_len(self, token_ids) -> int:
        """How many leading tokens of a prompt with these ids :meth:`add` would find in
        the prefix cache now (a multiple of ``block_size``, less than the prompt's length;
        0 without prefix caching). Changes nothing."""
        if not self.prefix_caching:
            return 0
        ids = list(token_ids)
        _check_token_ids(ids)
        return len(self._lookup(ids)[0]) * self.block_size

    def _lookup(self, token_ids: list) -> tuple[list, tuple | None]:
        """The cached blocks a prompt with these ids starts with (its full blocks before
        the last token: that one is always computed), and the prefix id after them."""
        bs, shared, parent = self.block_size, [], None
        for i in range((len(token_ids) - 1) // bs):
            b = self._full.get((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            if b is None:
                break
            shared.append(b)
            parent = (b, self._gen[b])
        return shared, parent

    def add(self, seq_id: Hashable, num_tokens: int, token_ids=None) -> np.ndarray:
        """Start a sequence with a prompt of ``num_tokens`` (0 is fine: an empty sequence
        that :meth:`append` fills, say chunk by chunk), whose ids are ``token_ids``
        (optional; with prefix caching they find and register shared blocks).

        Returns the int64 slots of the tokens the caller must compute and write: the
        whole prompt, or with a prefix-cache hit only the uncached remainder, tokens
        ``num_cached_tokens(seq_id):num_tokens`` (the cached part is always a run of
        leading full blocks). At least one token is always left to compute, so the
        prompt's last token has a query row to produce logits from: when every full
        block of a prompt is cached, its last block is not shared but stored again and
        recomputed (a shared block is never written).

        A sequence added without ``token_ids`` (and ``num_tokens > 0``) never registers
        blocks in the prefix cache; an empty one does once its appended tokens carry ids.
        A hit on a cached block (one nobody holds) takes it out of the cache, and blocks
        the prompt needs beyond the free ones are evicted from it (never a block this
        prompt hits).
        """
        return self._add(seq_id, num_tokens, token_ids)[0]

    def _add(self, seq_id, num_tokens, token_ids) -> tuple[np.ndarray, list]:
        """:meth:`add`; also returns what its :meth:`_take` popped, for :meth:`_undo_add`."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        try:
            num_tokens = operator.index(num_tokens)
        except TypeError:
            raise TypeError(f"num_tokens must be an integer, got {num_tokens!r}") from None
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if token_ids is not None:
            token_ids = list(token_ids)
            if len(token_ids) != num_tokens:
                raise ValueError(f"token_ids has {len(token_ids)} ids for {num_tokens} tokens")
            _check_token_ids(token_ids)
        elif num_tokens == 0:
            token_ids = []  # no token lacks an id: appended ids may register blocks
        bs = self.block_size
        full, n_blocks = num_tokens // bs, -(-num_tokens // bs)
        shared, parent, ref = [], None, self._ref  # leading full blocks found in the cache
        if self.prefix_caching and token_ids:
            shared, parent = self._lookup(token_ids)
        revived = {b for b in shared if not ref[b]}  # cached hits: not to be evicted
        new = self._next_free(n_blocks - len(shared), revived)
        blocks = shared + new
        t = np.arange(len(shared) * bs, num_tokens)
        slots = np.asarray(blocks, dtype=np.int64)[t // bs] * bs + t % bs
        self._ensure_width(n_blocks)

        # Everything that can fail has run (_take_row grows the table before it takes a
        # row); from here on the bookkeeping changes.
        seq = _Seq(self._take_row(), blocks, num_tokens, cached=len(shared) * bs)
        for b in shared:
            ref[b] += 1
        self._num_cached -= len(revived)
        popped = self._take(new)
        if self.prefix_caching and token_ids is not None:
            seq.parent = parent
            for i in range(len(shared), full):
                seq.parent = self._register(seq.parent, token_ids[i * bs:(i + 1) * bs], blocks[i])
            seq.tokens = token_ids[full * bs:]
        self._seqs[seq_id] = seq
        self._write_row(seq)
        return slots, popped

    def append(self, seq_ids: Sequence, *, num_tokens=None,
               token_ids=None) -> tuple[np.ndarray, np.ndarray]:
        """Append ``num_tokens[i]`` new tokens to sequence ``seq_ids[i]`` (``None``: one
        each, a decode step). An entry may be 0: the sequence is left as it is.

        ``token_ids`` (optional): one id per new token, flat in step order (sequence 0's
        tokens, then sequence 1's, ...; for a decode step one per sequence), ``None``
        entries allowed. With prefix caching, a block whose tokens all have ids is
        registered when it fills, and a sequence that fills a block with a token lacking
        an id leaves the prefix cache.

        Returns ``(slots int64 [sum(num_tokens)], copies int64 [k, 2])``: where each new
        token goes, in step order, and the (src, dst) block copies that must run *before*
        the tokens are written (copy-on-write of shared, partly filled blocks: a sequence
        writing into a block it shares gets a private copy; when every holder writes in
        one step, the last writes in place)."""
        plan = self._plan_append(seq_ids, num_tokens, token_ids)
        self._apply_append(plan)
        return plan.slots, plan.copies

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """``child`` shares all of ``parent``'s blocks (parallel sampling, beam search)."""
        p = self._get(parent)
        if child in self._seqs:
            raise ValueError(f"sequence {child!r} already exists")
        c = _Seq(self._take_row(), list(p.blocks), p.length,
                 None if p.tokens is None else list(p.tokens), p.parent, p.cached)
        for b in c.blocks:
            self._ref[b] += 1
        self._seqs[child] = c
        self._write_row(c)

    def free(self, seq_id: Hashable) -> None:
        """End a sequence. Blocks no other sequence holds are released: those registered
        in the prefix cache stay there, cached, as its most recently released blocks; the
        others return to the free list."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r} (never added, or already freed)")
        ref, lru = self._ref, self._lru
        # Last block first: a chain's tail is then evicted before its head, which matters
        # as a block can only be hit through the blocks before it.
        for b in reversed(seq.blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if b in self._key_of:
                    lru[b] = None
                    lru.move_to_end(b)  # it may still be there from before a hit
                    self._num_cached += 1
                else:
                    self._free.append(b)
        self._free_rows.append(seq.row)

    # ---- internals --------------------------------------------------------------------------

    def _undo_add(self, seq_id, popped: list) -> None:
        """Undo :meth:`_add` of ``seq_id``, the last change to the manager (after undoing
        any later ones), given what it popped: everything is as before, the prefix cache's
        keys and order included (:meth:`free` would cache the blocks the prompt registered
        before their K/V were written, and could not restore what it evicted)."""
        seq = self._seqs.pop(seq_id)
        self._free_rows.append(seq.row)
        ref, shared = self._ref, seq.cached // self.block_size
        new = seq.blocks[shared:]
        for b in new:  # new blocks: none had a key when taken
            key = self._key_of.pop(b, None)
            if key is not None:
                del self._full[key]
            ref[b] = 0
        evicted = [b for b, key in popped if key is not None]
        self._free.extend(reversed(new[:len(new) - len(evicted)]))
        for b, key in reversed(popped):
            if key is not None:
                self._full[key], self._key_of[b] = b, key
                self._gen[b] -= 1
            self._lru[b] = None
            self._lru.move_to_end(b, last=False)
        self._num_cached += len(evicted)
        for b in seq.blocks[:shared]:
            ref[b] -= 1
            self._num_cached += not ref[b]  # back in the cache, where the hit left it

    def _get(self, seq_id) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r} (never added, or already freed)")
        return seq

    def _plan_append(self, seq_ids: Sequence, num_tokens=None, token_ids=None) -> _AppendPlan:
        """Validate an :meth:`append` and decide everything it does, changing nothing:
        whatever can fail fails here. :meth:`_apply_append` carries the plan out."""
        seqs = [self._get(s) for s in seq_ids]
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError("a sequence appears twice in one append")
        counts = _token_counts(num_tokens, len(seqs))
        total = len(seqs) if counts is None else sum(counts)
        if token_ids is not None:
            token_ids = list(token_ids)
            if len(token_ids) != total:
                raise ValueError(f"token_ids has {len(token_ids)} ids for {total} new tokens "
                                 f"(one per new token, flat in step order)")
            _check_token_ids(token_ids)
        bs, ref = self.block_size, self._ref
        # `written` gets, for every column the step writes (sequence by sequence, in
        # column order), the slot of the first token written there. A column that needs a
        # free block holds only the offset until the blocks are taken, once all are counted
        # (running out must be reported with the total). A shared partial block is copied
        # by all but its last writer in this step, who may write it in place.
        rows, lens, written, at, takers, sources, cols, claimed = [], [], [], [], [], [], [], {}

        def take(i: int, src: int, col: int, offset: int) -> None:
            takers.append(i)
            sources.append(src)
            cols.append(col)
            at.append(len(written))
            written.append(offset)

        if counts is None:  # one token each: decode, the hot path, kept lean
            for i, seq in enumerate(seqs):
                n = seq.length
                rows.append(seq.row)
                lens.append(n + 1)
                offset = n % bs
                if offset:
                    b = seq.blocks[-1]
                    if ref[b] - claimed.get(b, 0) == 1:  # the block's last writer: in place
                        written.append(b * bs + offset)
                        continue
                    claimed[b] = claimed.get(b, 0) + 1
                    take(i, b, len(seq.blocks) - 1, offset)
                else:
                    take(i, -1, len(seq.blocks), 0)
        else:
            for i, (seq, k) in enumerate(zip(seqs, counts)):
                n = seq.length
                rows.append(seq.row)
                lens.append(n + k)
                if not k:
                    continue
                col, offset = divmod(n, bs)
                if offset:
                    b = seq.blocks[-1]
                    if ref[b] - claimed.get(b, 0) == 1:
                        written.append(b * bs + offset)
                    else:
                        claimed[b] = claimed.get(b, 0) + 1
                        take(i, b, col, offset)
                    col += 1
                for col in range(col, (n + k - 1) // bs + 1):  # fresh blocks
                    take(i, -1, col, 0)
        taken = self._next_free(len(takers))
        copies = []
        for j, src, b in zip(at, sources, taken):
            written[j] += b * bs
            if src >= 0:
                copies.append((src, b))
        if counts is None:  # one token each: the first token of each column is all
            slots = np.asarray(written, dtype=np.int64)
        else:
            blocks = np.asarray(written, dtype=np.int64) // bs
            k = np.asarray(counts, dtype=np.int64)
            end = np.asarray(lens, dtype=np.int64)
            n = end - k
            # Sequence i's columns start at blocks[base[i]]; its token at position p is in
            # column p // bs, so in blocks[base[i] - n[i] // bs + p // bs].
            ncols = np.where(k > 0, -(-end // bs) - n // bs, 0)
            base = np.cumsum(ncols) - ncols
            starts = np.cumsum(k) - k
            pos = np.arange(total, dtype=np.int64) + np.repeat(n - starts, k)
            slots = blocks[np.repeat(base - n // bs, k) + pos // bs] * bs + pos % bs
        return _AppendPlan(seqs, counts, token_ids, slots,
                           np.asarray(copies, dtype=np.int64).reshape(-1, 2), rows, lens,
                           taken, takers, sources, cols)

    def _apply_append(self, plan: _AppendPlan) -> None:
        """Carry out a plan from :meth:`_plan_append`, made since the manager last changed."""
        seqs, ref = plan.seqs, self._ref
        if plan.taken:
            # Widening the table is the one step that may need much memory: do it first,
            # before the bookkeeping changes.
            self._ensure_width(max(plan.cols) + 1)
            self._take(plan.taken)
            for i, src, b, col in zip(plan.takers, plan.sources, plan.taken, plan.cols):
                if src < 0:
                    seqs[i].blocks.append(b)  # a sequence's new columns come in order
                else:
                    ref[src] -= 1
                    seqs[i].blocks[col] = b
            self._table[[plan.rows[i] for i in plan.takers], plan.cols] = plan.taken
        # Vectorized, as per-element NumPy writes would dominate the step's host time.
        self._lens[plan.rows] = plan.lens
        for seq, n in zip(seqs, plan.lens):
            seq.length = n
        if self.prefix_caching:
            self._register_appended(plan)

    def _register_appended(self, plan: _AppendPlan) -> None:
        """Prefix caching after an append: each sequence's new ids join its partly filled
        block; a block that fills is registered, or, holding a token without an id,
        takes its sequence out of the prefix cache."""
        bs, ids, counts = self.block_size, plan.token_ids, plan.counts
        end = 0
        for i, seq in enumerate(plan.seqs):
            k = 1 if counts is None else counts[i]
            start, end = end, end + k
            if seq.tokens is None or not k:
                continue
            new = [None] * k if ids is None else ids[start:end]
            pos, j = seq.length - k, 0  # pos: the first new token's position
            while j < k and seq.tokens is not None:
                take = min(bs - len(seq.tokens), k - j)
                seq.tokens.extend(new[j:j + take])
                j += take
                if len(seq.tokens) == bs:
                    # A token without an id, or a prefix whose block (another sequence's,
                    # of the same tokens) was evicted: no later block of this sequence
                    # could be hit, so it leaves the prefix cache.
                    if None not in seq.tokens and self._live(seq.parent):
                        block = seq.blocks[(pos + j - 1) // bs]
                        seq.parent = self._register(seq.parent, seq.tokens, block)
                        seq.tokens = []
                    else:
                        seq.tokens = seq.parent = None

    def _tables_after(self, plan: _AppendPlan) -> tuple[np.ndarray, np.ndarray]:
        """What :meth:`tables` will give for the plan's sequences once it is applied,
        computed without applying it."""
        table = self._table
        width = -(-max(plan.lens, default=0) // self.block_size)
        if width <= table.shape[1]:
            bt = table[plan.rows, :width]  # fancy indexing copies: ours to write
        else:  # the append will widen the table
            bt = np.zeros((len(plan.rows), width), np.int32)
            bt[:, : table.shape[1]] = table[plan.rows]
        if plan.taken:
            bt[plan.takers, plan.cols] = plan.taken
        return bt, np.asarray(plan.lens, dtype=np.int32)

    def _next_free(self, n: int, keep=()) -> list:
        """The ``n`` blocks the next allocations get, without taking them: free blocks (the
        stack's top first: low ids first in a new manager), then cached ones, least
        recently released first, except those in ``keep`` (cached blocks the caller is
        about to revive)."""
        free = self._free
        if n <= len(free):  # the usual case, decode's included
            return free[len(free) - n:][::-1]
        have = len(free) + self._num_cached - len(keep)
        if n > have:
            cached = f" ({have - len(free)} of them cached)" if self.prefix_caching else ""
            raise OutOfBlocks(f"need {n} free blocks, have {have} of {self.num_blocks}{cached}")
        blocks, ref = free[::-1], self._ref
        for b in self._lru:  # skips blocks revived by hits (ref > 0), not yet released
            if not ref[b] and b not in keep:
                blocks.append(b)
                if len(blocks) == n:
                    break
        return blocks

    def _take(self, blocks: list) -> list:
        """Take the blocks :meth:`_next_free` just named (after reviving its ``keep``), each
        with one owner, evicting the cached ones. Returns the ``_lru`` entries it popped,
        in order: ``(block, its key)`` for an evicted block, ``(block, None)`` for a block
        a hit revived, left there until now."""
        free, ref, lru = self._free, self._ref, self._lru
        k = min(len(blocks), len(free))
        del free[len(free) - k:]
        popped = []
        for b in blocks[k:]:
            x = lru.popitem(last=False)[0]
            while x != b:  # in front of b, only blocks in use (_next_free skipped them)
                popped.append((x, None))
                x = lru.popitem(last=False)[0]
            key = self._key_of.pop(b)
            del self._full[key]
            self._gen[b] += 1  # retires its prefix id
            popped.append((b, key))
        self._num_cached -= len(blocks) - k
        for b in blocks:
            ref[b] = 1
        return popped

    def _register(self, parent, tokens, block: int) -> tuple:
        """Record a full block for prefix sharing and return the prefix id of the tokens
        up to its end (the first block with a key keeps it: another block of the same
        tokens, say a fully cached prompt's recomputed last block, chains on under the
        first's id).

        A key is ``(prefix id of the tokens before the block, its tokens)``, and a prefix
        id ``(block, generation)``: the registered block holding the prefix's last tokens
        and the number of times that block had been evicted when it registered. So a key
        names the whole token prefix exactly (no hash to collide), is hashed in O(block
        size), and an id is never reused: once a block is evicted (its generation bumped),
        keys built on its old id can match nothing, even when its number is reused for
        other tokens. Keying on the parent's block number alone, a cached child of an
        evicted parent would match whatever chain reached that number next."""
        key = (parent, tuple(tokens))
        b = self._full.get(key)
        if b is None:
            self._full[key] = b = block
            self._key_of[block] = key
        return b, self._gen[b]

    def _live(self, prefix) -> bool:
        """Whether a prefix id (None: the empty prefix) still names a registered block."""
        return prefix is None or (prefix[0] in self._key_of and self._gen[prefix[0]] == prefix[1])

    def _take_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        row = len(self._seqs) + len(self._free_rows)
        if row >= self._table.shape[0]:
            # New rows of zeros (np.resize would repeat the old rows: other sequences' ids)
            n = self._table.shape[0]
            self._table = np.concatenate([self._table, np.zeros_like(self._table)])
            self._lens = np.concatenate([self._lens, np.zeros(n, self._lens.dtype)])
        return row

    def _ensure_width(self, n: int) -> None:
        if n > self._table.shape[1]:
            wider = np.zeros((self._table.shape[0], max(n, 2 * self._table.shape[1])), np.int32)
            wider[:, : self._table.shape[1]] = self._table
            self._table = wider

    def _write_row(self, seq: _Seq) -> None:
        self._ensure_width(len(seq.blocks))
        self._table[seq.row, : len(seq.blocks)] = seq.blocks
        self._lens[seq.row] = seq.length

    def check(self) -> None:
        """Assert the bookkeeping's invariants (for tests; O(blocks + tokens))."""
        owners = [0] * self.num_blocks
        bs, key_of, gen = self.block_size, self._key_of, self._gen

        def prefix_id(b):  # that of a registered block's tokens, to its end
            return b, gen[b]

        for seq in self._seqs.values():
            assert len(seq.blocks) == -(-seq.length // bs), "blocks match length"
            assert list(self._table[seq.row, : len(seq.blocks)]) == seq.blocks, "table row"
            assert self._lens[seq.row] == seq.length, "length row"
            assert seq.cached % bs == 0 and 0 <= seq.cached <= max(seq.length - 1, 0), \
                "cached tokens are leading full blocks, short of the whole sequence"
            assert seq.tokens is None or len(seq.tokens) == seq.length % bs, \
                "the partial block's ids"
            assert seq.tokens is not None or seq.parent is None, "out of the cache: no parent"
            full = seq.length // bs
            if seq.tokens is not None:
                assert (seq.parent is None) == (full == 0), "a prefix id once a block is full"
                assert full == 0 or seq.blocks[full - 1] not in key_of or \
                    seq.parent == prefix_id(seq.blocks[full - 1]), \
                    "the parent names the last full block, if that one is registered"
            for c, b in enumerate(seq.blocks):
                owners[b] += 1
                if b in key_of:  # at the column of its depth in the prefix chain
                    parent = key_of[b][0]
                    assert (parent is None) == (c == 0), "a registered block's column"
                    assert c == 0 or seq.blocks[c - 1] not in key_of or \
                        parent == prefix_id(seq.blocks[c - 1]), \
                        "a registered block's holders hold the block its key names before it"
        assert owners == self._ref, "reference counts equal owners"
        free = set(self._free)
        assert len(free) == len(self._free), "no block freed twice"
        assert all(b in key_of for b in self._lru), "only registered blocks in the LRU"
        cached = {b for b in self._lru if not owners[b]}
        assert self._num_cached == len(cached), "the cached count"
        for b in range(self.num_blocks):
            if owners[b]:
                assert b not in free and b not in cached, "a used block is neither free nor cached"
            else:
                assert (b in free) != (b in cached), "an unused block is free or cached"
                assert (b in cached) == (b in key_of), "cached exactly when registered"
        used = sum(1 for o in owners if o)
        assert len(free) + len(cached) + used == self.num_blocks, "free + cached + used"
        assert (self.num_free_blocks, self.num_cached_blocks, self.num_used_blocks) == \
            (len(free), len(cached), used), "the counts"
        assert len(self._full) == len(key_of) and \
            all(self._full[k] == b for b, k in key_of.items()), "registry is one-to-one"
        assert all(k[0] is None or k[0][1] <= gen[k[0][0]] for k in self._full), \
            "keys are built on prefix ids that were handed out"
        assert self.prefix_caching or not (key_of or self._lru), "no prefix cache, no keys"


class Step(NamedTuple):
    """Device int32 arrays for one step over a batch of sequences, in the order given:
    what :func:`cupaged.reshape_and_cache` and :func:`cupaged.attention` take. Valid until
    the next call of the same kind (``step``, or ``prefill``)."""

    slot_mapping: object  # [sum(q_lens)]: each new token's slot, in step order
    block_tables: object  # [n, max_blocks]
    seq_lens: object  # [n]: tokens in each sequence's cache, the new ones included
    query_start_loc: object  # [n + 1]: cumulative new-token counts, from 0

    @property
    def context_lens(self):
        """``seq_lens``, by the name :func:`cupaged.paged_attention` uses."""
        return self.seq_lens


DecodeStep = Step  # the name before steps took several tokens per sequence


class _PagedCache:
    """What a paged cache of any kind shares: its :class:`BlockManager`, its arrays'
    framework and device, the accounting, the sequence operations whose tables and slots
    it uploads, and the copy-on-write of ``step`` (each kind copies its own arrays:
    ``_copy_on_write``)."""

    def _init_common(self, num_blocks: int, block_size: int, prefix_caching: bool,
                     framework: str, device) -> None:
        import cupy

        from . import _checks

        if block_size not in _checks.BLOCK_SIZES:
            raise ValueError(f"block_size {block_size} is not supported: expected a power of two "
                             f"from 1 to 256")
        if framework not in ("cupy", "torch"):
            raise ValueError(f"framework must be 'cupy' or 'torch', got {framework!r}")
        if num_blocks * block_size > 2**31 - 1:  # (its steps upload slots as int32)
            raise ValueError(f"num_blocks x block_size = {num_blocks * block_size} token "
                             f"slots; at most 2^31 - 1 are supported")
        self.framework = framework
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        self.block_size = block_size
        self.manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self._buffers: dict = {}  # purpose -> (host staging, device buffer), reused

    @property
    def bytes_per_block(self) -> int:
        raise NotImplementedError

    def _copy_on_write(self, pairs) -> None:
        """Copy the blocks of ``pairs`` (device int32 ``[n, 2]``, source and destination)
        in every array that holds per-block data."""
        raise NotImplementedError

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.manager.num_cached_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.manager.num_used_blocks

    @property
    def num_available_blocks(self) -> int:
        return self.manager.num_available_blocks

    @property
    def bytes_in_use(self) -> int:
        return self.num_used_blocks * self.bytes_per_block

    # ---- sequences ---------------------------------------------------------------------------

    def add(self, seq_id, num_tokens: int, token_ids=None):
        """Start a sequence with a prompt of ``num_tokens`` (as :meth:`BlockManager.add`);
        returns the device int32 slots of the tokens to compute: the whole prompt, or
        after a prefix-cache hit only the uncached remainder (tokens
        ``num_cached_tokens(seq_id):num_tokens``; never empty for a non-empty prompt).
        Valid until the next ``add``. :meth:`prefill` adds prompts and gives the whole
        step for them. If the upload fails, the sequence is not added."""
        slots, popped = self.manager._add(seq_id, num_tokens, token_ids)
        try:
            return self._upload("add", [slots])[0]
        except BaseException:
            self.manager._undo_add(seq_id, popped)
            raise

    def prefill(self, seq_ids: Sequence, num_tokens: Sequence, token_ids=None) -> Step:
        """Start sequences ``seq_ids[i]`` with prompts of ``num_tokens[i]`` tokens (each as
        :meth:`add`; ``token_ids``: optional, one list of ids per prompt, or ``None`` for a
        prompt without ids) and return the :class:`Step` that computes them in one
        attention call: ``slot_mapping`` of each prompt's uncached remainder, in order;
        ``block_tables``; ``seq_lens`` (the prompt lengths); ``query_start_loc``
        (cumulative remainder lengths). Its query rows are the remainders' tokens. A
        prompt may share blocks that an earlier prompt of the same call stores: their K/V
        are written by the step's ``reshape_and_cache`` before its attention reads them.
        Valid until the next ``prefill``. All or none of the sequences are added."""
        if num_tokens is None:
            raise TypeError("num_tokens must list each prompt's length")
        seq_ids = list(seq_ids)
        counts = _token_counts(num_tokens, len(seq_ids))
        if token_ids is None:
            token_ids = [None] * len(seq_ids)
        else:
            token_ids = list(token_ids)
            if len(token_ids) != len(seq_ids):
                raise ValueError(f"token_ids has {len(token_ids)} entries for {len(seq_ids)} "
                                 f"prompts (one list of ids per prompt, or None)")
        manager, added, slots = self.manager, [], []
        try:
            for s, n, ids in zip(seq_ids, counts, token_ids):
                x, popped = manager._add(s, n, ids)
                slots.append(x)
                added.append((s, popped))
            tables, lens = manager.tables(seq_ids)
            starts = _query_starts([len(x) for x in slots])
            sm, bt, sl, qsl = self._upload("prefill", [
                np.concatenate(slots) if slots else slots, tables.reshape(-1), lens, starts])
        except BaseException:
            for s, popped in reversed(added):
                manager._undo_add(s, popped)
            raise
        return Step(sm, bt.reshape(tables.shape), sl, qsl)

    def num_cached_tokens(self, seq_id) -> int:
        """Leading prompt tokens ``add`` found in the prefix cache (see
        :meth:`BlockManager.num_cached_tokens`)."""
        return self.manager.num_cached_tokens(seq_id)

    def fork(self, parent, child) -> None:
        self.manager.fork(parent, child)

    def free(self, seq_id) -> None:
        self.manager.free(seq_id)

    def step(self, seq_ids: Sequence, *, num_tokens=None, token_ids=None) -> Step:
        """Append ``num_tokens[i]`` tokens to sequence ``seq_ids[i]`` (``None``: one each,
        a decode step; 0: the sequence stays in the batch with its table row and length,
        but gets no query row and writes nothing) and return the :class:`Step` for the
        batch: ``slot_mapping`` (``[sum(num_tokens)]``, in step order), ``block_tables``,
        ``seq_lens`` (new tokens included; also as ``context_lens``) and
        ``query_start_loc``. ``token_ids``: optional, one per new token, flat in step order
        (see :meth:`BlockManager.append`).

        Runs the copy-on-write block copies itself, per-token fp8 scales included (on the
        current stream, before anything the caller enqueues next). One host-to-device
        copy carries all of it; the arrays stay valid until the next ``step``. If the
        upload or a copy fails, the manager is left as it was, so the step can be
        retried."""
        # Plan, do the device work, and only then apply the plan to the bookkeeping: the
        # upload's buffer allocation can run out of memory, and a launch can fail.
        manager = self.manager
        plan = manager._plan_append(seq_ids, num_tokens, token_ids)
        tables, lens = manager._tables_after(plan)
        pairs, s, bt, sl, qsl = self._upload(
            "step", [plan.copies.reshape(-1), plan.slots, tables.reshape(-1), lens,
                     plan.query_start_loc()])
        if len(plan.copies):
            self._copy_on_write(pairs.reshape(-1, 2))
        manager._apply_append(plan)
        return Step(s, bt.reshape(tables.shape), sl, qsl)

    def tables(self, seq_ids: Sequence):
        """Device ``(block_tables, context_lens)`` for these sequences in one upload, valid
        until the next ``tables``."""
        tables, lens = self.manager.tables(seq_ids)
        bt, cl = self._upload("tables", [tables.reshape(-1), lens])
        return bt.reshape(tables.shape), cl

    def _empty(self, shape, dtype, fill=None):
        """A new array of the cache's framework on its device: uninitialized, or ``fill``."""
        from . import _arrays

        with _arrays.on_device(self.device):
            if self.framework == "torch":
                import torch

                kw = dict(dtype=_arrays.torch_dtype(dtype),
                          device=torch.device("cuda", self.device))
                return torch.empty(shape, **kw) if fill is None else torch.full(shape, fill, **kw)
            import cupy

            return cupy.empty(shape, dtype) if fill is None else cupy.full(shape, fill, dtype)

    def _upload(self, purpose: str, parts: list) -> list:
        """Copy int32 host arrays into the device buffer kept for ``purpose`` with one
        asynchronous transfer on the current stream; returns device views. The pageable
        staging buffer has been read when the call returns, so it is reused at once."""
        from cupy_backends.cuda.api import runtime

        from . import _arrays

        n = sum(len(p) for p in parts)
        host, dev = self._buffers.get(purpose, (None, None))
        if host is None or n > host.size:
            size = max(n, 2 * (0 if host is None else host.size), 64)
            host, dev = np.zeros(size, np.int32), self._empty((size,), np.int32)
            self._buffers[purpose] = (host, dev)
        at, bounds = 0, []
        for p in parts:
            host[at: at + len(p)] = p
            bounds.append((at, at + len(p)))
            at += len(p)
        if n:
            with _arrays.launching(self.device):
                ctx = _arrays.context(self.device, self.framework)
                dst = _arrays.as_device_array(dev, "buffer").data.ptr
                runtime.memcpyAsync(dst, host.ctypes.data, n * 4, runtime.memcpyHostToDevice,
                                    ctx.stream)
        return [dev[a:b] for a, b in bounds]


class PagedKVCache(_PagedCache):
    """Device key and value caches for ``num_layers`` layers plus their :class:`BlockManager`.

    ``kv_layout`` (stored as ``cache.kv_layout``: pass it on to
    :func:`cupaged.attention` and :func:`cupaged.reshape_and_cache`) picks the layout of
    ``key_caches[l]`` and ``value_caches[l]``:

    - ``"vllm"`` (the default): key ``[num_blocks, num_kv_heads, head_size // x,
      block_size, x]`` with ``x = 16 // itemsize`` (16 for fp8), value ``[num_blocks,
      num_kv_heads, head_size, block_size]`` (what :func:`cupaged.paged_attention` also
      takes);
    - ``"NHD"``: both ``[num_blocks, block_size, num_kv_heads, head_size]``;
    - ``"HND"``: both ``[num_blocks, num_kv_heads, block_size, head_size]``.

    ``dtype`` is the model's (the queries'): float16, bfloat16 or float32, and with the
    default ``kv_cache_dtype="auto"`` the caches' too. ``kv_cache_dtype="fp8"`` (=
    ``"fp8_e4m3"``) or ``"fp8_e5m2"`` makes fp8 caches instead, for a float16 or bfloat16
    ``dtype`` and a head size that is a multiple of 16: ``torch.float8_e4m3fn`` /
    ``torch.float8_e5m2`` tensors with ``framework="torch"``, uint8 arrays with CuPy. An
    fp8 cache stores ``value / scale``; ``kv_scales`` picks the float32 scales, one array
    per layer for K (``cache.k_scales[l]``) and one for V (``cache.v_scales[l]``):

    - ``"tensor"`` (the default): ``[1]``, holding 1.0 until you write a calibrated scale
      into it in place (``cache.k_scales[l][...] = s``; the kernels read it on the device);
    - ``"token"``: ``[num_blocks, num_kv_heads, block_size]``, into which
      :func:`cupaged.reshape_and_cache` writes each token's ``amax(|row|) / max`` per KV
      head; ``step`` copies them with their blocks on copy-on-write. (Views of
      ``[num_blocks, row]`` arrays whose rows are padded to a multiple of 16 bytes when
      ``num_kv_heads * block_size`` is not a multiple of 4.)

    ``cache.kv_cache_dtype`` is ``"auto"`` or the format's full name (``"fp8_e4m3"``,
    ``"fp8_e5m2"``), ``cache.kv_scales`` the scale mode (None for ``"auto"``, whose scale
    lists hold None). ``cache.layer_kwargs(l)`` is ``dict(kv_cache_dtype=...,
    k_scale=cache.k_scales[l], v_scale=cache.v_scales[l])``, the same for every dtype:
    pass it on to :func:`cupaged.reshape_and_cache` and :func:`cupaged.attention` (or
    :func:`cupaged.paged_attention`).

    The caches live on ``device`` (default: the current CuPy device). With
    ``framework="torch"`` the caches and every array the cache hands out are torch
    tensors, and its uploads and copies run on torch's current stream; with the default
    ``"cupy"``, CuPy arrays and CuPy's current stream.

    A step of a chunked prefill mixed with decodes (``"a"`` added with ``add("a", 0)``,
    its prompt appended 64 tokens a step; ``"b"`` decoding)::

        step = cache.step(["a", "b"], num_tokens=[64, 1])   # copy-on-write done
        for layer in range(num_layers):
            kw = cache.layer_kwargs(layer)   # fp8: the format and this layer's scales
            cupaged.reshape_and_cache(k[layer], v[layer], cache.key_caches[layer],
                                      cache.value_caches[layer], step.slot_mapping,
                                      kv_layout=cache.kv_layout, **kw)
            out = cupaged.attention(q[layer], cache.key_caches[layer],
                                    cache.value_caches[layer], step.block_tables,
                                    step.seq_lens, step.query_start_loc,
                                    kv_layout=cache.kv_layout, max_query_len=64, **kw)

    A whole prompt, with its cached prefix shared: ``step = cache.prefill(["c"],
    [len(prompt)], token_ids=[prompt])`` gives the step for the uncached remainder.

    With ``prefix_caching``, blocks stay in the prefix cache after their last sequence is
    freed, until a hit reuses them or an allocation evicts them, least recently released
    first (see :class:`BlockManager`). ``num_free_blocks``, ``num_cached_blocks`` and
    ``num_used_blocks`` count blocks holding nothing, cached blocks nobody holds, and
    blocks sequences hold (they sum to ``num_blocks``; ``bytes_in_use`` counts the used
    ones); ``num_available_blocks``, free plus cached, is what ``add``, ``prefill`` and
    ``step`` can take before they raise :class:`OutOfBlocks`.
    """

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_size: int,
                 block_size: int, dtype="float16", *, kv_layout: str = "vllm",
                 prefix_caching: bool = False, framework: str = "cupy", device=None,
                 kv_cache_dtype: str = "auto", kv_scales: str = "tensor"):
        from . import _checks

        dt = _model_dtype(dtype)
        fmt = _fp8_format(kv_cache_dtype, kv_scales, dt)
        _checks.check_head_size(head_size)
        if fmt is not None:
            _checks.check_fp8_head_size(fmt, head_size)
        if num_layers <= 0 or num_kv_heads <= 0:
            raise ValueError(f"need num_layers > 0 and num_kv_heads > 0, got {num_layers}, {num_kv_heads}")
        if kv_layout not in _checks.KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {_checks.KV_LAYOUTS}, got {kv_layout!r}")
        self._init_common(num_blocks, block_size, prefix_caching, framework, device)
        self.dtype = dt.numpy
        self.kv_cache_dtype = "auto" if fmt is None else f"fp8_{fmt.name}"
        self.kv_scales = None if fmt is None else kv_scales
        self.kv_layout = kv_layout
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.head_size = head_size
        store = _storage_dtype(dt, fmt, framework)
        self._itemsize = store.itemsize
        k_shape, v_shape = _cache_shapes(kv_layout, num_blocks, num_kv_heads, head_size,
                                         block_size, self._itemsize)
        self.key_caches = [self._empty(k_shape, store) for _ in range(num_layers)]
        self.value_caches = [self._empty(v_shape, store) for _ in range(num_layers)]
        # Per-token scales: views of [num_blocks, row] arrays whose rows are padded to a
        # multiple of 16 bytes, as copy_blocks moves blocks (padding only when
        # num_kv_heads * block_size is not a multiple of 4).
        per_token = self.kv_scales == "token"
        self._scale_row = -(-num_kv_heads * block_size // 4) * 4 if per_token else 0
        self._k_scale_blocks = self._v_scale_blocks = None
        if fmt is None:
            self.k_scales = [None] * num_layers
            self.v_scales = [None] * num_layers
        elif kv_scales == "tensor":
            self.k_scales = [self._empty((1,), np.float32, 1.0) for _ in range(num_layers)]
            self.v_scales = [self._empty((1,), np.float32, 1.0) for _ in range(num_layers)]
        else:
            rows = (num_blocks, self._scale_row)
            self._k_scale_blocks = [self._empty(rows, np.float32) for _ in range(num_layers)]
            self._v_scale_blocks = [self._empty(rows, np.float32) for _ in range(num_layers)]
            n, shape = num_kv_heads * block_size, (num_blocks, num_kv_heads, block_size)
            self.k_scales = [a[:, :n].reshape(shape) for a in self._k_scale_blocks]
            self.v_scales = [a[:, :n].reshape(shape) for a in self._v_scale_blocks]

    def layer_kwargs(self, layer: int) -> dict:
        """``kv_cache_dtype``, ``k_scale`` and ``v_scale`` of ``layer``, to pass on to
        :func:`cupaged.reshape_and_cache`, :func:`cupaged.attention` and
        :func:`cupaged.paged_attention` (``"auto"``, ``None`` and ``None`` for a cache of
        ``dtype``)."""
        return dict(kv_cache_dtype=self.kv_cache_dtype, k_scale=self.k_scales[layer],
                    v_scale=self.v_scales[layer])

    # ---- accounting ------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """Device bytes one block takes across all layers, K and V: its cache elements and,
        with per-token scales, its float32 scale rows (per-tensor scales are not per
        block)."""
        elements = self.num_kv_heads * self.head_size * self.block_size * self._itemsize
        return 2 * self.num_layers * (elements + 4 * self._scale_row)

    def _copy_on_write(self, pairs) -> None:
        from .cache_ops import copy_blocks

        copy_blocks(self.key_caches, self.value_caches, pairs)
        if self._k_scale_blocks is not None:  # per-token scales go with their tokens
            copy_blocks(self._k_scale_blocks, self._v_scale_blocks, pairs)


class PagedMLACache(_PagedCache):
    """Device latent caches for ``num_layers`` layers of a model with multi-head latent
    attention (DeepSeek-V2/V3/R1, Kimi K2), plus their :class:`BlockManager`.

    ``kv_caches[l]`` is vLLM's combined latent cache ``[num_blocks, block_size,
    kv_lora_rank + rope_dim]`` (512 + 64: each token's compressed ``kv_c`` and its rotary
    ``k_pe``; DeepSeek's sparse formats below: one row of bytes a token), what
    :func:`cupaged.concat_and_cache_mla` writes and :func:`cupaged.mla_attention` reads.
    ``dtype``: float16 or bfloat16, the model's; with ``kv_cache_dtype="fp8"`` (=
    ``"fp8_e4m3"``) or ``"fp8_e5m2"`` the caches are fp8
    (``torch.float8_*`` tensors with ``framework="torch"``, uint8 arrays with CuPy) and
    ``scales[l]`` a float32 ``[1]`` array per layer holding 1.0 until a calibrated scale
    is written into it in place (the kernels read it on the device); without fp8,
    ``scales`` holds None. MLA's latent cache takes one scale per tensor, never per
    token (there is no ``kv_scales``). Blocks, prefix caching, copy-on-write,
    ``framework`` and ``device`` are as for :class:`PagedKVCache` (``step`` copies latent
    blocks with :func:`cupaged.copy_blocks_mla`).

    A step of one layer (``q``: ``[tokens, heads, 576]``, the absorbed query)::

        step = cache.step(seq_ids, num_tokens=counts)
        for l in range(num_layers):
            cupaged.concat_and_cache_mla(kv_c[l], k_pe[l], cache.kv_caches[l],
                                         step.slot_mapping, cache.kv_cache_dtype,
                                         cache.scales[l])
            out = cupaged.mla_attention(q[l], cache.kv_caches[l], step.block_tables,
                                        step.seq_lens, step.query_start_loc, scale=s,
                                        kv_cache_dtype=cache.kv_cache_dtype,
                                        k_scale=cache.scales[l])

    DeepSeek's sparse attention (DSA): with ``kv_cache_dtype="fp8_ds_mla"`` (DeepSeek-V3.2's)
    or V4's ``"v4_fp8"`` / ``"v4_fp4"``, ``kv_caches[l]`` is uint8 ``[num_blocks,
    block_size, bytes_per_token]`` (656, 528 or 288: one row of bytes a token), what
    :func:`cupaged.concat_and_cache_mla` writes in that format and
    :func:`cupaged.sparse_mla_attention` reads (bfloat16 queries, so ``dtype`` must be
    bfloat16); ``scales`` holds None (the rows carry their own). ``kv_lora_rank`` and
    ``rope_dim`` are the writer's ``kv_c`` and ``k_pe`` widths: 512 and 64 for fp8_ds_mla,
    two positive multiples of 8 that sum to 512 for V4's (default 448 and 64: V4's 512-dim
    token with its rotary dims inside). A decode step of one layer, its top-k from the
    lightning indexer's logits as global slots through the step's tables::

        slots = cupaged.indexer_topk(logits, 2048, block_tables=step.block_tables,
                                     block_size=cache.block_size)
        cupaged.concat_and_cache_mla(kv_c[l], k_pe[l], cache.kv_caches[l],
                                     step.slot_mapping, cache.kv_cache_dtype)
        out = cupaged.sparse_mla_attention(q[l][:, None], cache.kv_caches[l],
                                           slots[:, None], scale=s)
    """

    KV_LORA_RANK = 512
    ROPE_DIM = 64

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, dtype="bfloat16",
                 *, kv_lora_rank: int | None = None, rope_dim: int | None = None,
                 prefix_caching: bool = False, framework: str = "cupy", device=None,
                 kv_cache_dtype: str = "auto"):
        from . import _dtypes

        dt = _model_dtype(dtype)
        if dt.itemsize != 2:
            raise TypeError(f"dtype {dtype} is not supported: MLA takes float16 or bfloat16")
        rows = (_dtypes.SPARSE_KV_CACHE_DTYPES.get(kv_cache_dtype)
                if isinstance(kv_cache_dtype, str) else None)
        for name, v in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if rows is not None and rows.rope == 0:  # V4's: the rotary dims inside the 512
            if kv_lora_rank is None:
                kv_lora_rank = _dtypes.SPARSE_RANK - (self.ROPE_DIM if rope_dim is None
                                                      else rope_dim)
            if rope_dim is None:
                rope_dim = _dtypes.SPARSE_RANK - kv_lora_rank
            if not (kv_lora_rank > 0 and rope_dim > 0 and kv_lora_rank % 8 == 0
                    and rope_dim % 8 == 0 and kv_lora_rank + rope_dim == _dtypes.SPARSE_RANK):
                raise ValueError(f"kv_lora_rank {kv_lora_rank} and rope_dim {rope_dim} do not "
                                 f"split {kv_cache_dtype}'s {_dtypes.SPARSE_RANK}-dim token: "
                                 f"expected two positive multiples of 8 that sum to "
                                 f"{_dtypes.SPARSE_RANK} (V4's 448 and 64)")
        else:
            kv_lora_rank = self.KV_LORA_RANK if kv_lora_rank is None else kv_lora_rank
            rope_dim = self.ROPE_DIM if rope_dim is None else rope_dim
            if (kv_lora_rank, rope_dim) != (self.KV_LORA_RANK, self.ROPE_DIM):
                raise ValueError(f"kv_lora_rank {kv_lora_rank} and rope_dim {rope_dim} are not "
                                 f"supported: " + (
                                     f"{kv_cache_dtype} rows hold 512 and 64" if rows else
                                     "mla_attention is built for 512 and 64 (DeepSeek's)"))
        if rows is not None and dt is not _dtypes.BF16:
            raise TypeError(f"dtype {dtype} is not supported with kv_cache_dtype="
                            f"{kv_cache_dtype!r}: sparse_mla_attention reads its rows with "
                            f"bfloat16 queries")
        if num_layers <= 0:
            raise ValueError(f"need num_layers > 0, got {num_layers}")
        fmt = None if rows is not None else _fp8_format(kv_cache_dtype, "tensor", dt)
        self._init_common(num_blocks, block_size, prefix_caching, framework, device)
        self.dtype = dt.numpy
        self.kv_cache_dtype = (kv_cache_dtype if rows is not None else
                               "auto" if fmt is None else f"fp8_{fmt.name}")
        self.num_layers = num_layers
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        store = np.dtype(np.uint8) if rows is not None else _storage_dtype(dt, fmt, framework)
        self._itemsize = store.itemsize
        self._width = rows.nbytes if rows is not None else kv_lora_rank + rope_dim
        shape = (num_blocks, block_size, self._width)
        self.kv_caches = [self._empty(shape, store) for _ in range(num_layers)]
        self.scales = ([None] * num_layers if fmt is None else
                       [self._empty((1,), np.float32, 1.0) for _ in range(num_layers)])

    @property
    def bytes_per_block(self) -> int:
        """Device bytes one block takes across all layers (per-tensor scales are not per
        block)."""
        return self.num_layers * self.block_size * self._width * self._itemsize

    def _copy_on_write(self, pairs) -> None:
        from .cache_ops import copy_blocks_mla

        copy_blocks_mla(self.kv_caches, pairs)


def _model_dtype(dtype):
    """The ``_dtypes.DType`` of a cache's ``dtype`` argument, the model's (queries') type."""
    from . import _dtypes

    if isinstance(dtype, str) and dtype in _dtypes.KV_CACHE_DTYPES:
        raise ValueError(f"dtype is the model's (the queries') dtype; for an fp8 cache pass "
                         f"dtype='float16' or 'bfloat16' and kv_cache_dtype={dtype!r}")
    dt = _dtypes.parse(dtype) if isinstance(dtype, str) else _dtypes.lookup(dtype)
    if dt is None:
        raise TypeError(f"dtype {dtype} is not supported: expected {_dtypes.supported_names()}")
    return dt


def _storage_dtype(dt, fmt, framework: str) -> np.dtype:
    """What a cache's elements are stored as: the model's ``dt``, or for an fp8 ``fmt``
    torch's float8 type (its dtype then names the format too) or bytes for CuPy (the
    cache's ``kv_cache_dtype`` names the format)."""
    if fmt is None:
        return np.dtype(dt.numpy)
    return np.dtype(fmt.numpy if framework == "torch" and fmt.numpy is not None else np.uint8)


def _fp8_format(kv_cache_dtype, kv_scales, dt):
    """The fp8 format (a ``_dtypes.DType``) of a PagedKVCache's caches, or None for caches
    of the model's dtype ``dt``; the arguments checked with the kernels' wording."""
    from . import _dtypes

    if kv_scales not in ("tensor", "token"):
        raise ValueError(f"kv_scales must be 'tensor' or 'token', got {kv_scales!r}")
    fmt = _dtypes.kv_cache_format(kv_cache_dtype)
    if fmt is None:
        if kv_scales == "token":
            raise ValueError(f"kv_scales='token' needs an fp8 cache (kv_cache_dtype='fp8', "
                             f"'fp8_e4m3' or 'fp8_e5m2'): a {dt.numpy} cache has no scales")
        return None
    if dt.itemsize != 2:
        raise TypeError(f"fp8 caches take float16 or bfloat16 queries, got dtype={dt.numpy} "
                        f"(dtype is the model's, kv_cache_dtype the cache's)")
    return fmt


def _cache_shapes(kv_layout: str, num_blocks: int, num_kv_heads: int, head_size: int,
                  block_size: int, itemsize: int) -> tuple:
    """(key shape, value shape) of one layer's caches in ``kv_layout``: blocks along the
    first dimension, each one contiguous run (what copy_blocks moves)."""
    if kv_layout == "NHD":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return shape, shape
    if kv_layout == "HND":
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        return shape, shape
    x = 16 // itemsize
    return ((num_blocks, num_kv_heads, head_size // x, block_size, x),
            (num_blocks, num_kv_heads, head_size, block_size))
