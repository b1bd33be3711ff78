"""``cupaged-bench context-parallel``: one long context over the GPUs of a ``torchrun`` job
through :class:`cupaged.distributed.ContextParallel`, checked, then timed per step.

A case is a batch of sequences: a long one of ``context`` tokens and a few short ones
(``others``; by default 3000 tokens, 300 (the prefill step's first chunk, over many
placement units), 5 (shorter than the world's units) and 1). Their keys and values are standard normal values drawn
chunk by chunk from generators seeded by the chunk's index, so any GPU can draw any
token's K/V again without storing them: each rank fills its own paged cache with the
tokens it owns (its blocks scattered at random, unwritten slots NaN), and the reference
draws them all again.

The reference (:func:`streamed_reference`) is dense float32 attention over score tiles of
those drawn chunks, merged across tiles by an online softmax kept in float64:
independent of cupaged's kernels and of the helper's split, and it never holds the whole
context, so it checks a context whose cache fits only across the GPUs. Before it, each
rank reads back sampled tokens of its cache (every sequence's first and last placement
units, some in between) through its tables and compares them bit for bit with the drawn
values: a misplaced block moves a long row's output by less than the bound. Where the whole context does fit one GPU too, one
GPU's :func:`cupaged.attention` over a cache of all of it is checked against the same
reference and timed beside the helper.

Steps: a decode step (one row a sequence), a chunked-prefill step (the long sequence's
last ``chunk`` tokens, one row of the second, all of the third: a first chunk, one row of
each other), and the decode step captured in a CUDA graph and replayed with a new query.
The calls timed are checked again after their timing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import workloads

__all__ = ["ContextParallelCase", "cache_for", "draw_kv", "streamed_reference"]

# float32 bytes of K (or V) drawn at once; the reference's score tiles stay within it too.
CHUNK_BYTES = 256 << 20
MIN_TILE = 256  # keys a score tile of the reference has at least
MAX_CHUNK = 16384  # prefill rows of the long sequence (the reference's sums are rows x heads x dims)
SAMPLED = 64  # tokens a sequence's placement check reads between its first and last units


@dataclass
class ContextParallelCase:
    """The workload (see the module). ValueError for shapes the calls cannot take."""

    context: int = 100_000
    others: tuple = (3000, 300, 5, 1)
    chunk: int = 512
    heads: int = 64
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    interleave: int = 16
    dtype: str = "bfloat16"
    seed: int = 0
    _offsets: np.ndarray = field(default=None, init=False, repr=False)

    def __post_init__(self):
        workloads.require_positive(self, "context", "chunk", "heads", "kv_heads", "head_size",
                                   "block_size", "interleave")
        self.others = tuple(int(n) for n in self.others)
        if any(n < 1 for n in self.others):
            raise ValueError(f"others must be positive lengths, got {list(self.others)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.chunk > min(self.context, MAX_CHUNK):
            raise ValueError(f"chunk ({self.chunk}) must be at most context ({self.context}) "
                             f"and {MAX_CHUNK}")
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"dtype must be float16 or bfloat16, got {self.dtype!r}")
        self._offsets = np.concatenate([[0], np.cumsum(self.seq_lens)])

    @property
    def seq_lens(self) -> np.ndarray:
        return np.array((self.context,) + self.others, dtype=np.int64)

    @property
    def prefill_q_lens(self) -> np.ndarray:
        """Query rows a sequence in the prefill step: the long one's last ``chunk``, one
        row of the second, the third whole (a first chunk), one row of the rest."""
        q = np.ones(len(self.seq_lens), dtype=np.int64)
        q[0] = self.chunk
        if len(q) > 2:
            q[2] = self.seq_lens[2]
        return q

    @property
    def total_tokens(self) -> int:
        return int(self._offsets[-1])

    @property
    def token_bytes(self) -> int:
        """Cache bytes of one token's K and V."""
        return 2 * self.kv_heads * self.head_size * 2

    @property
    def chunk_tokens(self) -> int:
        """Tokens drawn at once (a multiple of the block size)."""
        n = max(1, CHUNK_BYTES // (self.kv_heads * self.head_size * 4))
        return max(self.block_size, n // self.block_size * self.block_size)

    def rank_bytes(self, cp) -> int:
        """Bytes of the paged cache :func:`cache_for` makes for ``cp``'s rank."""
        blocks = int((-(-cp.local_lens(self.seq_lens) // self.block_size)).sum()) + 1
        return blocks * self.block_size * self.token_bytes

    def describe(self) -> str:
        return (f"context parallel: sequences of {self.seq_lens.tolist()} tokens, "
                f"{self.heads}/{self.kv_heads} heads of {self.head_size}, {self.dtype}, "
                f"blocks of {self.block_size}, interleave {self.interleave}; prefill step "
                f"rows {self.prefill_q_lens.tolist()}; {self.total_tokens * self.token_bytes / 2**30:.1f} "
                f"GiB of K/V in all")

    def tokens(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sequence, position)`` of the batch's tokens ``start:stop``, counted over
        the sequences laid end to end."""
        idx = np.arange(start, stop, dtype=np.int64)
        seq = np.searchsorted(self._offsets, idx, side="right") - 1
        return seq, idx - self._offsets[seq]

    def tokens_before(self, s: int) -> int:
        """Where sequence ``s``'s tokens start, counted over the sequences end to end."""
        return int(self._offsets[s])

    def rows(self, q_lens) -> tuple[np.ndarray, np.ndarray]:
        """``(sequence, position)`` of a step's query rows: each sequence's last
        ``q_lens[s]`` tokens, in order."""
        q_lens = np.asarray(q_lens, dtype=np.int64)
        seq = np.repeat(np.arange(len(q_lens)), q_lens)
        first = np.concatenate([[0], np.cumsum(q_lens)])[:-1]
        pos = self.seq_lens[seq] - q_lens[seq] + (np.arange(len(seq)) - first[seq])
        return seq, pos


def draw_kv(case: ContextParallelCase, c: int, device):
    """float32 ``(K, V)``, each ``[tokens, kv_heads, head_size]``, of the batch's tokens
    in chunk ``c`` (``c * chunk_tokens`` on), the same on every GPU."""
    import torch

    start = c * case.chunk_tokens
    n = min(case.chunk_tokens, case.total_tokens - start)
    g = torch.Generator(device=device).manual_seed(case.seed * 1_000_003 + c)
    shape = (n, case.kv_heads, case.head_size)
    k = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    v = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    return k, v


def cache_for(case: ContextParallelCase, cp, device):
    """The paged NHD cache of the tokens ``cp`` places on its rank (``cp`` of world 1:
    the whole context): ``(key_cache, value_cache, block_tables, local_seq_lens)``, the
    tables and lengths int32 on the device. Its blocks lie in a random order with one
    spare; every slot not written holds NaN."""
    import torch

    from .. import reshape_and_cache

    tdt = getattr(torch, case.dtype)
    bs = case.block_size
    local = cp.local_lens(case.seq_lens)
    nb = -(-local // bs)
    num_blocks = int(nb.sum()) + 1
    perm = np.random.default_rng(case.seed + 17 * cp.rank).permutation(num_blocks)
    tables = np.zeros((len(local), max(int(nb.max()), 1)), dtype=np.int32)
    at = 0
    for s, n in enumerate(nb.tolist()):
        tables[s, :n] = perm[at:at + n]
        at += n
    shape = (num_blocks, bs, case.kv_heads, case.head_size)
    kc = torch.full(shape, math.nan, dtype=tdt, device=device)
    vc = torch.full(shape, math.nan, dtype=tdt, device=device)
    for c in range(-(-case.total_tokens // case.chunk_tokens)):
        start = c * case.chunk_tokens
        seq, pos = case.tokens(start, min(start + case.chunk_tokens, case.total_tokens))
        slots = np.full(len(pos), -1, dtype=np.int64)
        mine = cp.owner(pos) == cp.rank
        k = cp.local_index(pos[mine])
        slots[mine] = tables[seq[mine], k // bs].astype(np.int64) * bs + k % bs
        if not mine.any():
            continue
        kf, vf = draw_kv(case, c, device)
        reshape_and_cache(kf.to(tdt), vf.to(tdt), kc, vc,
                          torch.as_tensor(slots, device=device), kv_layout="NHD")
    return (kc, vc, torch.as_tensor(tables, device=device),
            torch.as_tensor(local.astype(np.int32), device=device))


def streamed_reference(case: ContextParallelCase, query, row_seq, row_pos):
    """Causal attention of ``query`` ``[rows, heads, head_size]`` (row i a query of
    sequence ``row_seq[i]`` at position ``row_pos[i]``, seeing that sequence's keys at
    positions up to it) over the case's K/V drawn again chunk by chunk and rounded to
    the query's dtype, as the caches hold them: float32 scores and P V over tiles of
    keys (TF32 off), merged across tiles by an online softmax whose sums are float64.
    Returns ``(out float64 [rows, heads, head_size], lse float64 [rows, heads])``,
    natural log, the scale 1/sqrt(head_size) applied."""
    import torch

    dev = query.device
    rows, heads, d = query.shape
    kvh, group = case.kv_heads, heads // case.kv_heads
    row_seq, row_pos = np.asarray(row_seq), np.asarray(row_pos)
    q = query.float().view(rows, kvh, group, d) * (1.0 / math.sqrt(d))
    m = torch.full((rows, kvh, group), -math.inf, device=dev)
    l = torch.zeros((rows, kvh, group), dtype=torch.float64, device=dev)
    acc = torch.zeros((rows, kvh, group, d), dtype=torch.float64, device=dev)
    by_seq = {s: np.flatnonzero(row_seq == s) for s in np.unique(row_seq).tolist()}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for c in range(-(-case.total_tokens // case.chunk_tokens)):
            start = c * case.chunk_tokens
            stop = min(start + case.chunk_tokens, case.total_tokens)
            seq, pos = case.tokens(start, stop)
            wanted = [s for s in np.unique(seq).tolist() if s in by_seq]
            if not wanted:
                continue
            # the values the cache holds: rounded to the case's dtype
            kf, vf = (x.to(query.dtype).float() for x in draw_kv(case, c, dev))
            for s in wanted:
                keys = np.flatnonzero(seq == s)
                lo, hi = int(keys[0]), int(keys[-1]) + 1
                r = by_seq[s]
                ri = torch.as_tensor(r, device=dev)
                rpos = torch.as_tensor(row_pos[r], device=dev)
                tile = max(MIN_TILE, (CHUNK_BYTES // 4) // (len(r) * heads))
                for t0 in range(lo, hi, tile):
                    t1 = min(t0 + tile, hi)
                    kpos = torch.arange(int(pos[t0]), int(pos[t0]) + (t1 - t0), device=dev)
                    sc = torch.einsum("rhgd,thd->rhgt", q[ri], kf[t0:t1])
                    sc.masked_fill_((kpos[None, :] > rpos[:, None])[:, None, None, :], -math.inf)
                    m_old = m[ri]
                    m_new = torch.maximum(m_old, sc.amax(-1))
                    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                    alpha = torch.exp(m_old - m_safe).double()
                    p = torch.exp(sc - m_safe[..., None])
                    l[ri] = l[ri] * alpha + p.sum(-1, dtype=torch.float64)
                    acc[ri] = acc[ri] * alpha[..., None] + torch.einsum(
                        "rhgt,thd->rhgd", p, vf[t0:t1]).double()
                    m[ri] = m_new
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out = (acc / l[..., None]).view(rows, heads, d)
    lse = (torch.log(l) + m.double()).view(rows, heads)
    return out, lse


def sampled_positions(case: ContextParallelCase, s: int, rng) -> np.ndarray:
    """Positions of sequence ``s`` that the placement check reads: its first and last four
    placement units (all of a short sequence) and ``SAMPLED`` in between."""
    n, u = int(case.seq_lens[s]), 4 * case.interleave
    if n <= 2 * u + SAMPLED:
        return np.arange(n)
    mid = rng.integers(u, n - u, SAMPLED)
    return np.unique(np.concatenate([np.arange(u), mid, np.arange(n - u, n)]))


def placement_mismatches(case: ContextParallelCase, cp, cache) -> tuple[int, int]:
    """``(tokens read, tokens whose K or V differ)``: sampled tokens that ``cp``'s rank
    owns, read from its ``cache`` (:func:`cache_for`) through its host tables and
    ``cp.local_index``, against the values :func:`draw_kv` draws for them, bit for bit."""
    import torch

    kc, vc, tables, _ = cache
    host = tables.cpu().numpy()
    rng = np.random.default_rng(case.seed + 5)
    tokens, blocks, offsets = [], [], []
    for s in range(len(case.seq_lens)):
        pos = sampled_positions(case, s, rng)
        pos = pos[cp.owner(pos) == cp.rank]
        k = cp.local_index(pos)
        tokens.append(case.tokens_before(s) + pos)
        blocks.append(host[s, k // case.block_size])
        offsets.append(k % case.block_size)
    tokens = np.concatenate(tokens)
    if not len(tokens):
        return 0, 0
    dev = kc.device
    got_k = kc[torch.as_tensor(np.concatenate(blocks), device=dev),
               torch.as_tensor(np.concatenate(offsets), device=dev)]
    got_v = vc[torch.as_tensor(np.concatenate(blocks), device=dev),
               torch.as_tensor(np.concatenate(offsets), device=dev)]
    want_k, want_v = torch.empty_like(got_k), torch.empty_like(got_v)
    chunk = tokens // case.chunk_tokens
    for c in np.unique(chunk).tolist():
        at = np.flatnonzero(chunk == c)
        kf, vf = draw_kv(case, c, dev)
        idx = torch.as_tensor(tokens[at] - c * case.chunk_tokens, device=dev)
        rows = torch.as_tensor(at, device=dev)
        want_k[rows] = kf[idx].to(kc.dtype)
        want_v[rows] = vf[idx].to(vc.dtype)
    bits = lambda a: a.reshape(len(tokens), -1).view(torch.int16)  # noqa: E731
    differ = ((bits(got_k) != bits(want_k)) | (bits(got_v) != bits(want_v))).any(1)
    return len(tokens), int(differ.sum())


def errors(got, want) -> tuple[float, float, int]:
    """``(relative error of the whole, largest relative error of a row, that row)``: norms
    over everything, and over each row's heads and dims."""
    g, w = got.double().reshape(got.shape[0], -1), want.double().reshape(want.shape[0], -1)
    per_row = (g - w).norm(dim=1) / w.norm(dim=1).clamp_min(1e-12)
    worst = int(per_row.argmax()) if len(per_row) else 0
    return (float((g - w).norm() / w.norm().clamp_min(1e-12)),
            float(per_row.max()) if len(per_row) else 0.0, worst)


# A result row's error bounds: the kernels round P and the output to 16 bits (relative
# 2^-9 and 2^-8), their sums are float32. |lse - lse_ref| relative to max(1, |lse_ref|):
# the decode kernel's softmax sum adds the rounded P that its P V uses (the output is
# normalized by exactly its weights), so a row over few keys has an lse off by up to about
# 2^-9 (the test suite's bound, tests/test_variants.py's TOL_LSE).
OUT_TOL, LSE_TOL = 2e-2, 2e-3


@dataclass(frozen=True)
class Row:
    """One timed step: the median over this rank's runs, the slowest rank's median, and
    the cache bytes one GPU reads (every visible key once)."""

    what: str
    gpus: int
    median_us: float
    slowest_us: float
    bytes_read: int


class DoesNotFit(Exception):
    """The case's caches do not fit the GPUs' free memory (raised on every rank alike)."""


def _vote(ok: bool, world: int) -> bool:
    """Every rank's ``ok``, all of them true."""
    import torch.distributed as dist

    votes = [None] * world
    dist.all_gather_object(votes, bool(ok))
    return all(votes)


def measure(case: ContextParallelCase, reps: int, one_gpu, echo):
    """Check, then time, the case on every rank of the default process group (NCCL).
    ``one_gpu``: also check and time one GPU's call over a cache of the whole context
    (None: where it fits on every rank beside its part). ``echo(line)`` reports (rank 0
    prints). Returns ``(checks, rows)``: checks ``[(name, whole error, worst row error,
    lse error, ok)]`` with every rank's worst, rows :class:`Row`. Raises
    :class:`DoesNotFit` (on every rank) when a rank's part, or the whole context asked
    for with ``one_gpu=True``, would not fit its GPU; ValueError when the ranks' GPUs
    differ (the values a GPU draws depend on its number of SMs)."""
    import torch
    import torch.distributed as dist

    import cupaged

    from ..distributed import ContextParallel
    from . import peers, timing

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    kinds = [None] * world
    dist.all_gather_object(kinds, (props.name, props.multi_processor_count))
    if len(set(kinds)) > 1:
        raise ValueError(f"the ranks' GPUs differ ({sorted(set(kinds))}): each draws the "
                         f"K/V with a launch sized by its SMs, so the ranks need one kind")
    tdt = getattr(torch, case.dtype)
    cp = ContextParallel(interleave=case.interleave)
    free, _ = torch.cuda.mem_get_info()
    room = free - 3 * 4 * CHUNK_BYTES - (2 << 30)  # the reference's chunks, the steps
    part = case.rank_bytes(cp)
    if not _vote(part < room, world):
        raise DoesNotFit(f"a rank's part of the context ({part / 2**30:.1f} GiB of K/V on "
                         f"rank {rank}) does not fit its GPU ({free / 2**30:.1f} GiB free): "
                         f"use a shorter --context or more GPUs (--nproc-per-node)")
    whole_bytes = case.rank_bytes(ContextParallel(rank=0, world_size=1,
                                                  interleave=case.interleave))
    fits = _vote(world == 1 or part + whole_bytes < room, world)
    if one_gpu and not fits:
        raise DoesNotFit(f"the whole context ({whole_bytes / 2**30:.1f} GiB of K/V) does not "
                         f"fit beside a rank's part: leave out --one-gpu")
    one_gpu = fits if one_gpu is None else one_gpu
    if not one_gpu:
        echo("one GPU's rows left out: " + ("--no-one-gpu" if fits else
             f"the whole context ({whole_bytes / 2**30:.1f} GiB) does not fit beside a "
             f"rank's part"))
    cache = cache_for(case, cp, dev)
    kc, vc, tables, local_lens = cache
    whole = None
    if one_gpu:  # (a world of one: its cache is the whole context's)
        whole = cache if world == 1 else cache_for(
            case, ContextParallel(rank=0, world_size=1, interleave=case.interleave), dev)

    checks = []
    read, differ = placement_mismatches(case, cp, cache)
    every = [None] * world
    dist.all_gather_object(every, (read, differ))
    checks.append((f"placement: {sum(r for r, _ in every)} sampled tokens over the ranks, "
                   f"K and V bit for bit", float(sum(d for _, d in every)), 0.0, 0.0,
                   not any(d for _, d in every), None))

    g = torch.Generator(device=dev).manual_seed(case.seed + 99)
    n_seqs, heads, d = len(case.seq_lens), case.heads, case.head_size

    def query(rows):
        return torch.randn((rows, heads, d), generator=g, device=dev).to(tdt)

    q_lens = case.prefill_q_lens
    q_dec, q_pre, q_dec2 = query(n_seqs), query(int(q_lens.sum())), query(n_seqs)
    dec_seq, dec_pos = case.rows(np.ones(n_seqs, dtype=np.int64))
    pre_seq, pre_pos = case.rows(q_lens)
    ref_out, ref_lse = streamed_reference(
        case, torch.cat([q_dec, q_pre, q_dec2]), np.concatenate([dec_seq, pre_seq, dec_seq]),
        np.concatenate([dec_pos, pre_pos, dec_pos]))
    p0, p1 = n_seqs, n_seqs + len(pre_seq)
    refs = {"decode": (ref_out[:p0], ref_lse[:p0]), "prefill": (ref_out[p0:p1], ref_lse[p0:p1]),
            "decode2": (ref_out[p1:], ref_lse[p1:])}
    places = {"decode": (dec_seq, dec_pos), "prefill": (pre_seq, pre_pos),
              "decode2": (dec_seq, dec_pos)}

    def check(name, got, want_key, ranks_agree=False):
        """``got``: (out, lse or None), against the reference's rows ``want_key``."""
        out, lse = got
        want_out, want_lse = refs[want_key]
        e_all, e_row, worst = errors(out, want_out)
        seqs, poss = places[want_key]
        where = (int(seqs[worst]), int(poss[worst]))
        lse_err = 0.0 if lse is None else float(
            ((lse.double() - want_lse).abs() / want_lse.abs().clamp_min(1.0)).max())
        ok = e_row < OUT_TOL and lse_err < LSE_TOL
        if ranks_agree:  # every rank's merged result is rank 0's, bit for bit
            parts = [out.reshape(-1).view(torch.uint8)]
            if lse is not None:
                parts.append(lse.reshape(-1).view(torch.uint8))
            mine = torch.cat(parts)
            first = mine.clone()
            dist.broadcast(first, 0)
            ok = ok and torch.equal(first, mine)
        every = [None] * world
        dist.all_gather_object(every, (e_all, e_row, lse_err, ok, where))
        worst = tuple(max(e[i] for e in every) for i in range(3))
        at = max(every, key=lambda e: e[1])[4]
        checks.append((name,) + worst + (all(e[3] for e in every), at))

    def report(since):
        for name, e_all, e_row, lse_err, ok, at in checks[since:]:
            if name.startswith("placement"):
                echo(f"check {name}: {int(e_all)} differ" + ("" if ok else "  FAILED"))
                continue
            echo(f"check {name}: error {e_all:.1e} (worst row {e_row:.1e}: sequence {at[0]} "
                 f"at {at[1]}; lse {lse_err:.1e})" + ("" if ok else "  FAILED"))

    gpus = f"{world} GPU{'s' if world > 1 else ''}"
    lens_host, qsl_host = case.seq_lens, np.concatenate([[0], np.cumsum(q_lens)])
    max_local = int(cp.local_lens(lens_host).max())
    check(f"{gpus}: decode", cp.decode(q_dec, kc, vc, tables, local_lens, return_lse=True,
                                       max_seq_len=max_local), "decode", True)
    check(f"{gpus}: chunked prefill",
          cp.prefill(q_pre, kc, vc, tables, lens_host, qsl_host, return_lse=True), "prefill", True)
    qsl_dev = torch.as_tensor(qsl_host.astype(np.int32), device=dev)
    if whole is not None:
        wkc, wvc, wtables, wlens = whole
        check("1 GPU, whole context: decode", cupaged.attention(
            q_dec, wkc, wvc, wtables, wlens, return_lse=True), "decode")
        check("1 GPU, whole context: chunked prefill", cupaged.attention(
            q_pre, wkc, wvc, wtables, wlens, qsl_dev, return_lse=True), "prefill")

    # the decode step in a CUDA graph, replayed with a new query
    q = q_dec.clone()
    out = torch.empty_like(q)
    buf = cp.buffers(n_seqs, heads, d, tdt, dev)
    ws = cupaged.DecodeWorkspace(n_seqs, heads, d)

    def step():
        cp.decode(q, kc, vc, tables, local_lens, out=out, buffers=buf, workspace=ws,
                  max_seq_len=max_local)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q.copy_(q_dec2)
    graph.replay()
    check(f"{gpus}: decode, graph replay", (out, buf.views(n_seqs)[6]), "decode2", True)
    report(0)
    if not all(c[4] for c in checks):
        return checks, []

    # times: this rank's attention alone, the helper's steps, one GPU's calls
    rows = []
    tb = case.token_bytes
    part = buf.views(n_seqs)
    rows_pre = int(q_lens.sum())
    ws_pre = cupaged.DecodeWorkspace(rows_pre, heads, d)
    plan = cp.plan(lens_host, qsl_host)
    pre_buf = cp.buffers(rows_pre, heads, d, tdt, dev)
    pre_out = torch.empty_like(q_pre)
    local_bytes = int(cp.local_lens(lens_host).sum()) * tb
    timed = [
        ("decode: this GPU's attention alone (part of the step)", world, local_bytes,
         lambda: cupaged.attention(q, kc, vc, tables, local_lens, out=part[2], lse=part[3],
                                   workspace=ws, max_seq_len=max_local)),
        ("decode step: attention + all-gather + merge", world, local_bytes, step),
        ("decode step, CUDA graph replay", world, local_bytes, graph.replay),
        ("chunked prefill step", world, local_bytes,
         lambda: cp.prefill(q_pre, kc, vc, tables, lens_host, qsl_host, out=pre_out,
                            buffers=pre_buf, workspace=ws_pre, plan=plan)),
    ]
    if whole is not None:
        one_out, one_pre = torch.empty_like(q), torch.empty_like(q_pre)
        timed += [
            ("decode: cupaged.attention over the whole context", 1, case.total_tokens * tb,
             lambda: cupaged.attention(q, wkc, wvc, wtables, wlens, out=one_out, workspace=ws)),
            ("chunked prefill: cupaged.attention, whole context", 1, case.total_tokens * tb,
             lambda: cupaged.attention(q_pre, wkc, wvc, wtables, wlens, qsl_dev, out=one_pre,
                                       workspace=ws_pre)),
        ]
    with peers.torch_on_cupy_stream():
        for what, n_gpus, nbytes, fn in timed:
            t = timing.time_us(fn, reps=reps)
            every = [None] * world
            dist.all_gather_object(every, t.median_us)
            rows.append(Row(what, n_gpus, t.median_us, max(every), nbytes))
    torch.cuda.synchronize()
    # the timed calls' results, as they were called
    since = len(checks)
    check(f"{gpus}: decode step, timed", (out, buf.views(n_seqs)[6]), "decode2", True)
    check(f"{gpus}: chunked prefill step, timed", (pre_out, pre_buf.views(rows_pre)[6]),
          "prefill", True)
    if whole is not None:
        check("1 GPU, whole context: decode, timed", (one_out, None), "decode2")
        check("1 GPU, whole context: chunked prefill, timed", (one_pre, None), "prefill")
    report(since)
    return checks, rows
