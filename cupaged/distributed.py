"""Context parallelism: one long context over several GPUs (decode context parallel).

A sequence whose KV cache does not fit one GPU is split over the ranks of a
``torch.distributed`` group: each rank stores some of every sequence's tokens in its own
paged cache, attends to them with :func:`cupaged.attention` and its log-sum-exp, and the
ranks exchange their partial results in one all-gather and merge them with
:func:`cupaged.merge_states`. Every rank ends with the attention over the whole context.

Placement (vLLM's interleave): token t of a sequence lives on rank ``(t // interleave) %
world_size``. A rank's tokens of a sequence form its *local sequence*, in position order,
stored in its own paged cache like any sequence (its own :class:`cupaged.BlockManager` or
:class:`cupaged.PagedKVCache`, its own block tables); ``interleave`` a multiple of the
block size gives each rank whole blocks. :meth:`ContextParallel.local_step` says how many
tokens each rank's manager appends in a step, :meth:`ContextParallel.owned_rows` and
:meth:`ContextParallel.slot_mapping` where the step's new K/V go (slot -1 on every other
rank: cupaged's cache writers skip negative slots).

Masking: a query at position p sees the keys at positions <= p, which on rank r are the
first ``L_r(p + 1)`` tokens of its local sequence (``L_r(n)``: the rank's tokens among a
sequence's first n). A decode row sees all of them (:meth:`ContextParallel.decode`: one
attention call, capturable in a CUDA graph). For several rows per sequence
(:meth:`ContextParallel.prefill`: chunked prefill, verify, mixed batches) that count rises
by one per row over a run of the rank's own positions and stands still over the others',
so each rank splits the rows into segments: a run of its own positions is one causal
segment (bottom-right aligned, exactly cupaged's rule), a run of other ranks' positions is
one non-causal segment over the ``L_r`` keys before it (cut into pieces of at most that
many rows, as ``q_len <= seq_len`` asks), and rows with no local key before them are left
out (zeros, lse -inf). The two kinds run as two :func:`cupaged.attention` calls over a
gathered copy of the rows, whose results are scattered back before the exchange.

Requires torch (the collectives are ``torch.distributed``'s: NCCL on GPUs).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["ContextParallel", "ContextParallelBuffers", "ContextParallelPlan"]

# Keywords of cupaged.attention the helper passes through unchanged. Positions, ALiBi and
# windows depend on a key's global position, which a rank's local sequence does not keep.
_PASSED = frozenset({"kv_layout", "scale", "kv_cache_dtype", "k_scale", "v_scale",
                     "logits_soft_cap", "sinks"})
# Keywords refused unless they hold cupaged.attention's default (which call sites that
# forward every keyword pass): (default, why).
_REFUSED = {
    "alibi_slopes": (None, "ALiBi adds slope * (key_pos - query_pos) with global positions"),
    "window": (None, "a sliding window keeps keys by global position"),
    "window_left": (None, "a sliding window keeps keys by global position"),
    "causal": (True, "the helper's masking is causal (decoder attention); causal=False is "
                     "not supported"),
    "query_start_loc": (None, "decode has one row per sequence; use prefill() for several"),
}
_UNSET = object()


def _attend(*args, **kwargs):
    """The per-rank attention (cupaged.attention; tests substitute a float64 one)."""
    from .attention import attention

    return attention(*args, **kwargs)


def _merge(outs, lses, *, out, lse_out):
    """The merge over ranks (cupaged.merge_states; tests substitute a float64 one)."""
    from .merge import merge_states

    return merge_states(outs, lses, out=out, lse_out=lse_out)


def _all_gather(recv, send, group) -> None:
    """Every rank's ``send`` into ``recv``, in rank order (one collective of fixed size)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(recv, send, group=group)


def _torch():
    import torch

    return torch


def _dist_ready() -> bool:
    """Is there a default process group (whose size the helper's can be checked against)?"""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _host_ints(x, name: str) -> np.ndarray:
    """A host integer array (NumPy, list, CPU tensor); device arrays are refused rather
    than read with a sync."""
    if hasattr(x, "device") and getattr(getattr(x, "device", None), "type", "cpu") != "cpu":
        raise TypeError(f"{name} must be on the host (NumPy, a list or a CPU tensor): the "
                        f"helper plans the step's segments on the host")
    if hasattr(x, "__cuda_array_interface__"):
        raise TypeError(f"{name} must be on the host (NumPy, a list or a CPU tensor)")
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {a.shape}, dtype "
                         f"{a.dtype}")
    return a.astype(np.int64)


def _round16(n: int) -> int:
    return -(-n // 16) * 16


class ContextParallelPlan(NamedTuple):
    """One rank's segments of a multi-row step (:meth:`ContextParallel.plan`), host
    arrays. Rows ``perm[:num_causal_rows]`` run causally, the rest non-causally; in each
    part, segment i owns rows ``qsl[i]:qsl[i + 1]`` of that part, reads
    ``seq_lens[i]`` local keys of sequence ``seqs[i]``'s table row."""

    total_q: int
    perm: np.ndarray  # int64 [rows computed here]: the step's row of each
    num_causal_rows: int
    causal_qsl: np.ndarray  # int32 [segments + 1]
    causal_seq_lens: np.ndarray  # int32 [segments]
    causal_seqs: np.ndarray  # int64 [segments]
    full_qsl: np.ndarray
    full_seq_lens: np.ndarray
    full_seqs: np.ndarray
    # What it was made for: (rank, world_size, interleave) and the step's host lengths and
    # query starts (int64; starts None for one row a sequence), which prefill compares
    made_for: tuple = ()


class ContextParallelBuffers:
    """Preallocated exchange buffers for up to ``rows`` query rows: this rank's partial
    (output and lse packed in one byte buffer, so one all-gather moves both), every
    rank's, and the merged lse. Made by :meth:`ContextParallel.buffers`; with them and
    ``out=`` (and a :class:`cupaged.DecodeWorkspace`) a decode step allocates nothing."""

    def __init__(self, world_size: int, rows: int, num_heads: int, head_size: int, dtype,
                 device):
        torch = _torch()
        self.rows, self.num_heads, self.head_size = rows, num_heads, head_size
        self.dtype = dtype
        self.world_size = world_size
        nb = self._sizes(rows)[2]
        self.send = torch.empty(nb, dtype=torch.uint8, device=device)
        self.recv = torch.empty(world_size * nb, dtype=torch.uint8, device=device)
        self.lse = torch.empty(rows, num_heads, dtype=torch.float32, device=device)

    def _sizes(self, rows: int) -> tuple:
        """Bytes of one rank's output, its lse, and its 16-byte aligned chunk."""
        torch = _torch()
        ob = rows * self.num_heads * self.head_size * torch.empty((), dtype=self.dtype).element_size()
        lb = rows * self.num_heads * 4
        return ob, lb, _round16(ob) + _round16(lb)

    def views(self, rows: int) -> tuple:
        """``(send, recv, part_out, part_lse, all_out, all_lse, lse)`` for ``rows`` rows:
        views only (no allocation)."""
        torch = _torch()
        if rows > self.rows:
            raise ValueError(f"these buffers hold {self.rows} rows, the step has {rows}")
        h, d = self.num_heads, self.head_size
        if rows == 0:  # (zero-byte views cannot be reinterpreted: empty tensors instead)
            dev, w, f32 = self.send.device, self.world_size, torch.float32
            return (self.send[:0], self.recv[:0], torch.empty(0, h, d, dtype=self.dtype, device=dev),
                    torch.empty(0, h, dtype=f32, device=dev),
                    torch.empty(w, 0, h, d, dtype=self.dtype, device=dev),
                    torch.empty(w, 0, h, dtype=f32, device=dev), self.lse[:0])
        ob, lb, nb = self._sizes(rows)
        lo = _round16(ob)
        send = self.send[:nb]
        recv = self.recv[:self.world_size * nb]
        part_out = send[:ob].view(self.dtype).view(rows, h, d)
        part_lse = send[lo:lo + lb].view(torch.float32).view(rows, h)
        per_rank = recv.view(self.world_size, nb)
        all_out = per_rank[:, :ob].view(self.dtype).view(self.world_size, rows, h, d)
        all_lse = per_rank[:, lo:lo + lb].view(torch.float32).view(self.world_size, rows, h)
        return send, recv, part_out, part_lse, all_out, all_lse, self.lse[:rows]


class ContextParallel:
    """Attention over contexts split across the ranks of a ``torch.distributed`` group.

    Args:
        group: the process group (None: the default group). Every rank of it holds a part
            of every sequence's context and calls the same methods with the same query
            (the same heads, the same rows) in the same order.
        interleave: tokens per placement unit: token t lives on rank ``(t // interleave)
            % world_size`` (vLLM's ``cp_kv_cache_interleave_size``). A multiple of the
            cache's block size gives each rank whole blocks; larger units mean fewer,
            longer segments in :meth:`prefill`.
        rank, world_size: override the group's (placement arithmetic only, e.g. to plan
            for every rank in one process; the collectives still run on ``group``).
    """

    def __init__(self, group=None, *, interleave: int = 16, rank: int | None = None,
                 world_size: int | None = None):
        if rank is None or world_size is None:
            import torch.distributed as dist

            rank = dist.get_rank(group) if rank is None else rank
            world_size = dist.get_world_size(group) if world_size is None else world_size
        if int(interleave) < 1:
            raise ValueError(f"interleave must be at least 1, got {interleave}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.group = group
        self.rank, self.world_size, self.interleave = int(rank), int(world_size), int(interleave)

    def __repr__(self) -> str:
        return (f"ContextParallel(rank {self.rank} of {self.world_size}, interleave "
                f"{self.interleave})")

    # ---- placement (host) --------------------------------------------------------------------

    def owner(self, positions) -> np.ndarray:
        """The rank that stores each token position."""
        return (np.asarray(positions, dtype=np.int64) // self.interleave) % self.world_size

    def local_lens(self, seq_lens, rank: int | None = None) -> np.ndarray:
        """``L_r(n)``: how many of a sequence's first n tokens rank ``rank`` (default this
        one) stores, per entry of ``seq_lens``: the length of its local sequence."""
        r = self.rank if rank is None else rank
        n = np.maximum(np.asarray(seq_lens, dtype=np.int64), 0)
        units, rem = np.divmod(n, self.interleave)
        rounds, extra = np.divmod(units, self.world_size)
        return (rounds * self.interleave + np.where(extra > r, self.interleave, 0)
                + np.where(extra == r, rem, 0))

    def local_index(self, positions) -> np.ndarray:
        """Each position's index in its owner's local sequence."""
        p = np.asarray(positions, dtype=np.int64)
        unit, off = np.divmod(p, self.interleave)
        return (unit // self.world_size) * self.interleave + off

    def _rows(self, seq_lens, query_start_loc):
        """Host ``(seq_lens, q_lens, seq of each row, position of each row)`` of a step."""
        lens = _host_ints(seq_lens, "seq_lens")
        if query_start_loc is None:
            q_lens = np.ones(len(lens), dtype=np.int64)
        else:
            starts = _host_ints(query_start_loc, "query_start_loc")
            if starts.shape != (len(lens) + 1,) or (len(starts) and starts[0] != 0):
                raise ValueError(f"query_start_loc must be [num_seqs + 1] = [{len(lens) + 1}] "
                                 f"starting at 0, got {starts.tolist()[:8]}")
            q_lens = np.diff(starts)
            if (q_lens < 0).any():
                raise ValueError("query_start_loc must be non-decreasing")
        if (q_lens > lens).any():
            s = int(np.flatnonzero(q_lens > lens)[0])
            raise ValueError(f"sequence {s} has {q_lens[s]} query tokens but seq_lens[{s}] = "
                             f"{lens[s]} (the query tokens are the last q_len of its tokens)")
        seq = np.repeat(np.arange(len(lens)), q_lens)
        first = np.concatenate([[0], np.cumsum(q_lens)])[:-1]
        pos = lens[seq] - q_lens[seq] + (np.arange(len(seq)) - first[seq])
        return lens, q_lens, seq, pos

    def local_step(self, seq_lens, query_start_loc=None) -> tuple[np.ndarray, np.ndarray]:
        """``(local_seq_lens, local_num_tokens)`` of a step on this rank: its local
        sequences' lengths after the step, and how many of each sequence's new tokens it
        stores: the ``num_tokens`` of its own manager's ``append``/``step`` (0 is fine).
        ``seq_lens``: the sequences' global lengths, this step's tokens included;
        ``query_start_loc`` (host): the step's rows (None: one new token each)."""
        lens, q_lens, _, _ = self._rows(seq_lens, query_start_loc)
        after = self.local_lens(lens)
        return after, after - self.local_lens(lens - q_lens)

    def owned_rows(self, seq_lens, query_start_loc=None) -> np.ndarray:
        """The step's query rows (int64, in order) whose tokens this rank stores: where
        the slots of its manager's step (one per stored token, in step order) belong in
        the step's slot mapping, whose other rows get -1."""
        _, _, _, pos = self._rows(seq_lens, query_start_loc)
        return np.flatnonzero(self.owner(pos) == self.rank)

    def slot_mapping(self, block_tables, seq_lens, query_start_loc=None, *,
                     block_size: int) -> np.ndarray:
        """int64 ``[total_q]``: the slot of each new token in this rank's cache, from its
        host block tables (local sequences; the blocks of this step's tokens already
        allocated), or -1 where another rank stores the token. Pass it (on the device)
        to :func:`cupaged.reshape_and_cache` with every row's K/V on every rank."""
        tables = np.asarray(block_tables)
        _, _, seq, pos = self._rows(seq_lens, query_start_loc)
        slots = np.full(len(pos), -1, dtype=np.int64)
        mine = self.owner(pos) == self.rank
        k = self.local_index(pos[mine])
        slots[mine] = tables[seq[mine], k // block_size].astype(np.int64) * block_size + k % block_size
        return slots

    # ---- planning (host) ----------------------------------------------------------------------

    def plan(self, seq_lens, query_start_loc) -> ContextParallelPlan:
        """This rank's segments of a causal multi-row step (see the module): the host
        work of :meth:`prefill`, on global ``seq_lens`` and ``query_start_loc``."""
        lens, q_lens, seq, pos = self._rows(seq_lens, query_start_loc)
        made_for = self._made_for(lens, query_start_loc)
        total_q = len(pos)
        owned = self.owner(pos) == self.rank
        seen = self.local_lens(pos + 1)  # local keys each row sees
        starts = np.ones(total_q, dtype=bool)
        starts[1:] = (seq[1:] != seq[:-1]) | (owned[1:] != owned[:-1])
        first = np.flatnonzero(starts)
        last = np.append(first[1:], total_q) - 1
        causal, full = [], []  # (first row, rows, seq, local keys)
        for f, l in zip(first.tolist(), last.tolist()):
            if owned[f]:
                causal.append((f, l - f + 1, int(seq[f]), int(seen[l])))
                continue
            c0 = int(seen[f])
            for a in range(f, l + 1, max(c0, 1)) if c0 else ():
                full.append((a, min(c0, l + 1 - a), int(seq[f]), c0))

        def part(segs):
            rows = np.array([r for a, m, _, _ in segs for r in range(a, a + m)], dtype=np.int64)
            qsl = np.concatenate([[0], np.cumsum([m for _, m, _, _ in segs], dtype=np.int64)])
            return (rows, qsl.astype(np.int32), np.array([c for *_, c in segs], dtype=np.int32),
                    np.array([s for _, _, s, _ in segs], dtype=np.int64))

        rc, qc, lc, sc = part(causal)
        rf, qf, lf, sf = part(full)
        return ContextParallelPlan(total_q, np.concatenate([rc, rf]), len(rc), qc, lc, sc,
                                   qf, lf, sf, made_for)

    def _made_for(self, lens, query_start_loc) -> tuple:
        starts = None if query_start_loc is None else _host_ints(query_start_loc,
                                                                  "query_start_loc")
        return (self.rank, self.world_size, self.interleave), lens, starts  # (copies)

    def _check_plan(self, plan: ContextParallelPlan, seq_lens, query_start_loc) -> None:
        """prefill's ``plan=``: this rank's plan of this step (the same row count of
        another's would run the wrong rows over the wrong keys)."""
        placed, lens, starts = plan.made_for or ((), None, None)
        got_lens = _host_ints(seq_lens, "seq_lens")
        got_starts = (None if query_start_loc is None
                      else _host_ints(query_start_loc, "query_start_loc"))
        if (placed != (self.rank, self.world_size, self.interleave)
                or lens is None or not np.array_equal(lens, got_lens)
                or (starts is None) != (got_starts is None)
                or (starts is not None and not np.array_equal(starts, got_starts))):
            raise ValueError("plan was made for another step or rank: pass this rank's "
                             "plan(seq_lens, query_start_loc) of this step, or none")

    # ---- attention ----------------------------------------------------------------------------

    def buffers(self, rows: int, num_heads: int, head_size: int, dtype, device) -> ContextParallelBuffers:
        """Exchange buffers for steps of up to ``rows`` query rows (see
        :class:`ContextParallelBuffers`); ``dtype`` is the query's (a torch dtype)."""
        return ContextParallelBuffers(self.world_size, rows, num_heads, head_size, dtype, device)

    def _keywords(self, kw: dict) -> dict:
        kw = dict(kw)
        for name in list(kw):
            if name in _REFUSED:
                default, why = _REFUSED[name]
                value = kw.pop(name)
                # (None and True are singletons; a window of -1 is "no window" too)
                if not (value is default or (name == "window_left" and value == -1)):
                    raise ValueError(f"ContextParallel does not take {name}={value!r}: {why}")
            elif name not in _PASSED:
                raise TypeError(f"unexpected keyword argument {name!r}")
        return kw

    def _rank_keywords(self, kw: dict) -> dict:
        """The keywords of this rank's own attention: a sink joins one partial only, rank
        0's."""
        if kw.get("sinks") is not None and self.rank != 0:
            kw = dict(kw, sinks=None)
        return kw

    @staticmethod
    def _check_shared(views, query, key_cache, value_cache, block_tables, kw) -> None:
        """cupaged.attention's checks of what every rank shares (the query's type and head
        size, the caches' layout and types, the scales, the soft cap, the sinks), by a call
        of no rows (nothing launched, nothing allocated), for a rank that would skip them:
        one with no rows of its own, or whose attention does not get the sinks. A bad call
        then raises on every rank instead of leaving the others in the collective."""
        _, _, part_out, part_lse, *_ = views
        torch = _torch()
        no_lens = torch.zeros(0, dtype=torch.int32, device=query.device)
        _attend(query[:0], key_cache, value_cache, block_tables[:0], no_lens,
                out=part_out[:0], lse=part_lse[:0], **kw)

    def _buffers(self, buffers, query):
        rows, h, d = query.shape
        if buffers is None:
            buffers = self.buffers(rows, h, d, query.dtype, query.device)
        elif (buffers.num_heads, buffers.head_size, buffers.dtype) != (h, d, query.dtype):
            raise ValueError(f"buffers are for {buffers.num_heads} heads of {buffers.head_size} "
                             f"{buffers.dtype}, the query is {tuple(query.shape)} {query.dtype}")
        return buffers.views(rows)

    def _exchange(self, views, query, out, lse, return_lse: bool):
        """All-gather every rank's partial and merge them into ``out`` (and ``lse``)."""
        torch = _torch()
        send, recv, _, _, all_out, all_lse, merged_lse = views
        if self.group is not None or _dist_ready():
            import torch.distributed as dist

            if dist.get_world_size(self.group) != self.world_size:
                raise ValueError(f"this ContextParallel places tokens over {self.world_size} "
                                 f"ranks, its group has {dist.get_world_size(self.group)}")
            if dist.get_rank(self.group) != self.rank:  # (a rank= given for the wrong one)
                raise ValueError(f"this ContextParallel is rank {self.rank}, its group's "
                                 f"{dist.get_rank(self.group)}")
        if query.shape[0] == 0:  # every rank has the same rows: all skip the collective
            if out is None:
                out = torch.empty_like(query, memory_format=torch.contiguous_format)
            lse_out = merged_lse if lse is None else lse
            return (out, lse_out) if (return_lse or lse is not None) else out
        _all_gather(recv, send, self.group)
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        lse_out = merged_lse if lse is None else lse
        _merge(all_out, all_lse, out=out, lse_out=lse_out)
        return (out, lse_out) if (return_lse or lse is not None) else out

    def decode(self, query, key_cache, value_cache, block_tables, seq_lens, *, out=None,
               lse=None, return_lse: bool = False, buffers=None, workspace=None,
               max_seq_len=None, **keywords):
        """One decode step (one query row per sequence, at its last position: it sees every
        key) over this rank's part of the context, merged over all ranks.

        Args:
            query: ``[num_seqs, num_heads, head_size]`` torch tensor, the same on every rank.
            key_cache, value_cache: this rank's caches (any layout ``kv_layout`` names).
            block_tables, seq_lens: this rank's *local* tables and lengths on the device
                (its own manager's ``step``: :meth:`local_step`'s lengths); a length of 0
                (a sequence shorter than the ranks ahead of it) contributes nothing.
            out: ``[num_seqs, num_heads, head_size]`` output, C-contiguous; lse: float32
                ``[num_seqs, num_heads]`` for the merged lse (implies ``return_lse``).
            buffers: :meth:`buffers` for at least ``num_seqs`` rows; workspace: a
                :class:`cupaged.DecodeWorkspace` for the split-KV partials;
                max_seq_len: the largest local length, for the split (as for
                :func:`cupaged.attention`).
            keywords: ``kv_layout``, ``scale``, ``kv_cache_dtype``, ``k_scale``,
                ``v_scale``, ``logits_soft_cap`` and ``sinks`` (rank 0's partial carries
                them), passed to :func:`cupaged.attention`. Everything runs on torch's
                current stream, the collective included.

        Returns the merged ``out`` (and ``lse`` with ``return_lse``/``lse``), the same on
        every rank. With ``buffers`` and ``return_lse`` but no ``lse``, the lse returned
        is a view of the buffers, which the next call overwrites: pass ``lse`` to keep
        it. With ``out``, ``buffers`` and ``workspace`` given it allocates nothing
        and never synchronizes the host: capturable in a CUDA graph (the all-gather has
        a fixed size: ``num_seqs`` rows).
        """
        kw = self._keywords(keywords)
        views = self._buffers(buffers, query)
        _, _, part_out, part_lse, *_ = views
        if query.shape[0]:
            own = self._rank_keywords(kw)
            if own is not kw:  # (the sinks, which this rank's attention does not check)
                self._check_shared(views, query, key_cache, value_cache, block_tables, kw)
            _attend(query, key_cache, value_cache, block_tables, seq_lens, out=part_out,
                    lse=part_lse, workspace=workspace, max_seq_len=max_seq_len, **own)
        return self._exchange(views, query, out, lse, return_lse)

    def prefill(self, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                *, out=None, lse=None, return_lse: bool = False, buffers=None, workspace=None,
                plan: ContextParallelPlan | None = None, **keywords):
        """A causal multi-row step (chunked prefill, speculative verify, decode rows
        mixed in) over this rank's part of the context, merged over all ranks.

        Args:
            query: ``[total_q, num_heads, head_size]`` torch tensor, the same on every rank;
                sequence s owns rows ``query_start_loc[s]:query_start_loc[s + 1]``, the
                last ``q_len`` of its ``seq_lens[s]`` tokens (as for
                :func:`cupaged.attention`).
            key_cache, value_cache: this rank's caches, this step's tokens written (slots
                from :meth:`slot_mapping`).
            block_tables: this rank's local block tables on the device, one row per
                sequence.
            seq_lens, query_start_loc: the step's *global* lengths and row starts, on the
                host (the segments are planned there; device arrays are refused).
            plan: :meth:`plan`'s result for these, if already made.
            out, lse, return_lse, buffers, workspace, keywords: as for :meth:`decode`
                (a workspace for at least ``total_q`` rows).

        Returns as :meth:`decode`. Uploads the plan and gathers the query rows each call
        (allocations), so it is not for graph capture.
        """
        torch = _torch()
        shared = self._keywords(keywords)
        kw = self._rank_keywords(shared)
        if plan is not None:
            self._check_plan(plan, seq_lens, query_start_loc)
        p = self.plan(seq_lens, query_start_loc) if plan is None else plan
        if p.total_q != query.shape[0]:
            raise ValueError(f"the step has {p.total_q} query rows, the query {query.shape[0]}")
        views = self._buffers(buffers, query)
        _, _, part_out, part_lse, *_ = views
        # Checked on every rank, also one with no rows here: an error on some ranks only
        # would leave the others waiting in the collective.
        bs = _block_size(key_cache, kw.get("kv_layout", "NHD"))
        rows = len(p.perm)
        # (With sinks on every rank, rank 0's too: its part_lse takes them below, before
        # its own attention would check them.)
        if not rows or shared.get("sinks") is not None:
            self._check_shared(views, query, key_cache, value_cache, block_tables, shared)
        part_out.zero_()
        sinks = kw.get("sinks")
        if sinks is None:
            part_lse.fill_(-math.inf)
        else:  # a row with no local key still has its sink (rank 0 only)
            part_lse.copy_(torch.as_tensor(sinks, device=part_lse.device).view(1, -1)
                           .expand_as(part_lse))
        if rows:
            dev = query.device
            perm = torch.as_tensor(p.perm, device=dev)
            q = query.index_select(0, perm)
            o = torch.empty_like(q)
            l = torch.empty(rows, query.shape[1], dtype=torch.float32, device=dev)
            for causal, a, b, qsl, lens, seqs in (
                    (True, 0, p.num_causal_rows, p.causal_qsl, p.causal_seq_lens, p.causal_seqs),
                    (False, p.num_causal_rows, rows, p.full_qsl, p.full_seq_lens, p.full_seqs)):
                if a == b:
                    continue
                width = max(1, -(-int(lens.max()) // bs))
                if block_tables.shape[1] < width:  # (the kernels would stop at its end)
                    raise ValueError(f"block_tables has {block_tables.shape[1]} blocks a "
                                     f"sequence; this rank's keys need {width} of "
                                     f"{bs} tokens")
                tables = block_tables[:, :width].index_select(0, torch.as_tensor(seqs, device=dev))
                _attend(q[a:b], key_cache, value_cache, tables,
                        torch.as_tensor(lens, device=dev), torch.as_tensor(qsl, device=dev),
                        causal=causal, out=o[a:b], lse=l[a:b], workspace=workspace,
                        max_query_len=int(np.diff(qsl).max()), max_seq_len=int(lens.max()),
                        **kw)
            part_out.index_copy_(0, perm, o)
            part_lse.index_copy_(0, perm, l)
        return self._exchange(views, query, out, lse, return_lse)


def _block_size(key_cache, kv_layout: str) -> int:
    """Tokens per block of a key cache in ``kv_layout`` (from its shape)."""
    shape = tuple(key_cache.shape)
    if kv_layout == "NHD":
        return shape[1]
    if kv_layout == "HND":
        return shape[2]
    if kv_layout == "vllm":
        return shape[3]
    raise ValueError(f"kv_layout must be 'NHD', 'HND' or 'vllm', got {kv_layout!r}")
