"""cupaged.distributed.ContextParallel: placement, local tables and write slots, the
per-rank segments of causal multi-row steps, the exchange and the merge.

CPU: ranks are spawned processes over torch.distributed's gloo backend (world 2 and 3),
with the per-rank attention and the merge done by the float64 reference (the helper's
``_attend`` and ``_merge`` hooks), against the single-process reference over the whole
context. GPU (marked ``gpu``): the ranks are threads sharing one GPU, with the real
kernels and an all-gather between the threads. Across GPUs with NCCL:
``NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m cupaged.bench context-parallel``
(its workload and reference are tested here)."""

from __future__ import annotations

import math
import os
import socket
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupaged import reference  # noqa: E402
from cupaged import distributed as cpd  # noqa: E402
from cupaged.kv_cache import BlockManager  # noqa: E402

HEADS, KV_HEADS, HS = 4, 2, 8

# (seq_lens, q_lens or None for decode, interleave, block_size): uneven splits, sequences
# shorter than the world (ranks with no key), first chunks, chunks spanning units, an
# interleave that is not a multiple of the block size.
CASES = [
    ([37, 5, 1, 64], None, 4, 4),
    ([37, 5, 1, 64], None, 1, 4),
    ([2, 100], None, 16, 8),
    ([37, 21, 64], [12, 21, 1], 4, 4),
    ([9, 30], [9, 7], 3, 4),
    ([50, 3, 70], [0, 3, 33], 16, 16),
    ([1, 2], [1, 2], 1, 4),
    ([130], [130], 8, 8),
    ([77, 40], [5, 40], 5, 8),
]


def _problem(seed, lens, q_lens, hs=HS):
    """Random K/V of whole sequences, a query and the reference over the whole context."""
    rng = np.random.default_rng(seed)
    lens = np.array(lens)
    q_lens = np.ones(len(lens), int) if q_lens is None else np.array(q_lens)
    ks = [rng.standard_normal((n, KV_HEADS, hs)) for n in lens]
    vs = [rng.standard_normal((n, KV_HEADS, hs)) for n in lens]
    q = rng.standard_normal((int(q_lens.sum()), HEADS, hs))
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    # the whole context in one paged cache (blocks of 4, shuffled)
    bs = 4
    nb = [-(-int(n) // bs) for n in lens]
    perm = rng.permutation(sum(nb) + 1)
    kc = rng.standard_normal((sum(nb) + 1, bs, KV_HEADS, hs))
    vc = rng.standard_normal(kc.shape)
    tables = np.zeros((len(lens), max(nb + [1])), np.int32)
    at = 0
    for s, n in enumerate(lens):
        tables[s, :nb[s]] = perm[at:at + nb[s]]
        at += nb[s]
        slots = tables[s, np.arange(n) // bs] * bs + np.arange(n) % bs
        reference.reshape_and_cache(ks[s], vs[s], kc, vc, slots, kv_layout="NHD")
    return ks, vs, q, lens, q_lens, qsl, (kc, vc, tables)


def _rank_cache(cp, ks, vs, lens, q_lens, qsl, block_size, decode):
    """This rank's cache as an engine would build it: its manager holds the local
    sequences before the step, appends :meth:`local_step`'s counts, and the step's K/V go
    through :meth:`slot_mapping` (checked against the manager's slots and owned_rows)."""
    num_blocks = sum(-(-int(n) // block_size) + 1 for n in lens) + 2
    bm = BlockManager(num_blocks, block_size)
    kc = np.full((num_blocks, block_size, KV_HEADS, ks[0].shape[-1]), np.nan)  # never read where unwritten
    vc = np.full(kc.shape, np.nan)
    for s, n in enumerate(lens):
        before = int(n - q_lens[s])
        slots = bm.add(s, int(cp.local_lens([before])[0]))
        pos = np.flatnonzero(cp.owner(np.arange(before)) == cp.rank)
        assert (cp.local_index(pos) == np.arange(len(pos))).all()
        reference.reshape_and_cache(ks[s][pos], vs[s][pos], kc, vc, slots, kv_layout="NHD")
    step_qsl = None if decode else qsl
    local_lens, local_new = cp.local_step(lens, step_qsl)
    assert (local_lens == cp.local_lens(lens)).all()
    new_slots, copies = bm.append(list(range(len(lens))), num_tokens=local_new.tolist())
    assert len(copies) == 0
    tables, got_lens = bm.tables(list(range(len(lens))))
    assert (got_lens == local_lens).all()
    slots = cp.slot_mapping(tables, lens, step_qsl, block_size=block_size)
    rows = cp.owned_rows(lens, step_qsl)
    assert (slots[rows] == new_slots).all()
    assert (np.delete(slots, rows) == -1).all()
    new_k = np.concatenate([ks[s][n - m:] for s, (n, m) in enumerate(zip(lens, q_lens))])
    new_v = np.concatenate([vs[s][n - m:] for s, (n, m) in enumerate(zip(lens, q_lens))])
    reference.reshape_and_cache(new_k, new_v, kc, vc, slots, kv_layout="NHD")
    return kc, vc, tables, local_lens


# ---- placement, on the host ---------------------------------------------------------------


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (2, 16), (3, 4), (4, 3)])
def test_placement_splits_every_sequence_exactly(world, interleave):
    n = np.arange(0, 200)
    cps = [cpd.ContextParallel(rank=r, world_size=world, interleave=interleave)
           for r in range(world)]
    per_rank = np.stack([cp.local_lens(n) for cp in cps])
    assert (per_rank.sum(0) == n).all()
    pos = np.arange(200)
    owner = cps[0].owner(pos)
    assert (owner == (pos // interleave) % world).all()
    for r, cp in enumerate(cps):
        mine = pos[owner == r]
        assert (cp.local_index(mine) == np.arange(len(mine))).all()  # in order, no gaps
        assert (cp.local_lens(pos + 1)[owner == r] == np.arange(1, len(mine) + 1)).all()


def test_plan_gives_each_row_its_visible_local_keys():
    """Every row is in at most one segment; the segment makes it see exactly the rank's
    keys at positions <= its own (causal: bottom-right aligned), and q_len <= seq_len."""
    lens, q_lens = np.array([50, 3, 70, 9]), np.array([0, 3, 33, 9])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    seq = np.repeat(np.arange(4), q_lens)
    pos = lens[seq] - q_lens[seq] + np.arange(len(seq)) - qsl[seq]
    for world, il in ((2, 16), (3, 4), (3, 1)):
        for r in range(world):
            cp = cpd.ContextParallel(rank=r, world_size=world, interleave=il)
            p = cp.plan(lens, qsl)
            want = cp.local_lens(pos + 1)
            got = np.zeros(len(pos), int)
            for causal, rows, qs, ls, ss in (
                    (True, p.perm[:p.num_causal_rows], p.causal_qsl, p.causal_seq_lens,
                     p.causal_seqs),
                    (False, p.perm[p.num_causal_rows:], p.full_qsl, p.full_seq_lens,
                     p.full_seqs)):
                for i in range(len(ls)):
                    q = qs[i + 1] - qs[i]
                    assert 1 <= q <= ls[i]
                    for j, row in enumerate(rows[qs[i]:qs[i + 1]]):
                        assert seq[row] == ss[i]
                        got[row] = ls[i] - q + j + 1 if causal else ls[i]
            assert len(set(p.perm.tolist())) == len(p.perm)
            assert (got == want).all(), (world, il, r)


def test_a_plan_of_another_step_or_rank_is_refused():
    """prefill's plan= must be this rank's plan of this step: another's (the same row
    count, other segments) would run the wrong rows over the wrong keys."""
    cps = [cpd.ContextParallel(rank=r, world_size=2, interleave=4) for r in (0, 1)]
    lens, qsl = [37, 21], [0, 12, 21]
    q = torch.zeros(21, HEADS, HS)
    for other, what in ((cps[1].plan(lens, qsl), "rank"),
                        (cps[0].plan([40, 21], qsl), "step"),
                        (cps[0].plan(lens, [0, 13, 21]), "step")):
        with pytest.raises(ValueError, match="plan was made for another step or rank"):
            cps[0].prefill(q, None, None, None, lens, qsl, plan=other)


def test_bad_steps_and_keywords_are_refused():
    cp = cpd.ContextParallel(rank=0, world_size=2)
    with pytest.raises(ValueError, match="query tokens"):
        cp.plan([3], [0, 4])
    with pytest.raises(ValueError, match="query_start_loc"):
        cp.plan([3, 4], [0, 1])
    with pytest.raises(ValueError, match="ALiBi"):
        cp.decode(torch.zeros(1, HEADS, HS), None, None, None, None,
                  alibi_slopes=torch.ones(HEADS))
    with pytest.raises(ValueError, match="window=4: a sliding window"):
        cp.prefill(torch.zeros(1, HEADS, HS), None, None, None, [1], [0, 1], window=4)
    with pytest.raises(ValueError, match="causal=False"):
        cp.prefill(torch.zeros(1, HEADS, HS), None, None, None, [1], [0, 1], causal=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'return_lse_please'"):
        cp.decode(torch.zeros(1, HEADS, HS), None, None, None, None, return_lse_please=True)
    # cupaged.attention's defaults, as call sites that forward every keyword pass them
    assert cp._keywords(dict(alibi_slopes=None, window=None, window_left=-1, causal=True,
                             query_start_loc=None, scale=0.5)) == {"scale": 0.5}
    with pytest.raises(ValueError):
        cpd.ContextParallel(rank=2, world_size=2)


# ---- the whole helper over gloo, with the float64 reference per rank -------------------------


def _reference_attend(query, key_cache, value_cache, block_tables, seq_lens,
                      query_start_loc=None, *, out, lse, causal=True, workspace=None,
                      max_seq_len=None, max_query_len=None, **kw):
    """cupaged.attention's contract on CPU tensors, by the float64 reference (which also
    refuses q_len > seq_len, as cupaged's contract does)."""
    def host(x):
        return None if x is None else x.numpy() if isinstance(x, torch.Tensor) else x

    if query_start_loc is not None:
        q_lens = np.diff(host(query_start_loc))
        assert (q_lens >= 1).all() and (q_lens <= host(seq_lens)).all()
    o, l = reference.attention(host(query), host(key_cache), host(value_cache),
                               host(block_tables), host(seq_lens), host(query_start_loc),
                               kv_layout=kw.pop("kv_layout", "NHD"), causal=causal,
                               return_lse=True, sinks=host(kw.pop("sinks", None)), **kw)
    out.copy_(torch.from_numpy(o))
    lse.copy_(torch.from_numpy(l))
    return out, lse


def _reference_merge(outs, lses, *, out, lse_out):
    o, l = reference.merge_states(list(outs.numpy()), list(lses.numpy()))
    out.copy_(torch.from_numpy(o))
    lse_out.copy_(torch.from_numpy(l))
    return out, lse_out


def _run_cases(cp, seed0, cases=CASES, atol=2e-6):  # lse is float32
    for i, (lens, q_lens, interleave, bs) in enumerate(cases):
        cp.interleave = interleave
        decode = q_lens is None
        ks, vs, q, lens, q_lens, qsl, whole = _problem(seed0 + i, lens, q_lens)
        sinks = np.linspace(-1.0, 1.0, HEADS) if i % 3 == 2 else None
        want, want_lse = reference.attention(q, *whole, lens, None if decode else qsl,
                                             kv_layout="NHD", return_lse=True, sinks=sinks)
        kc, vc, tables, local_lens = _rank_cache(cp, ks, vs, lens, q_lens, qsl, bs, decode)
        args = (torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc),
                torch.from_numpy(np.ascontiguousarray(tables)))
        kw = {} if sinks is None else {"sinks": torch.from_numpy(sinks)}
        if decode:
            out, lse = cp.decode(*args, torch.from_numpy(local_lens.astype(np.int32)),
                                 return_lse=True, **kw)
        else:
            out, lse = cp.prefill(*args, lens, qsl, return_lse=True, **kw)
        np.testing.assert_allclose(out.numpy(), want, atol=atol, err_msg=f"case {i}")
        np.testing.assert_allclose(lse.numpy(), want_lse, atol=atol, err_msg=f"case {i}")
        assert np.isfinite(out.numpy()).all()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank, world, port, seed):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cpd._attend, cpd._merge = _reference_attend, _reference_merge
        cp = cpd.ContextParallel()
        assert (cp.rank, cp.world_size) == (rank, world)
        _run_cases(cp, seed)
        # preallocated buffers and outputs, several steps through the same ones
        buf = cp.buffers(8, HEADS, HS, torch.float64, "cpu")
        out = torch.empty(4, HEADS, HS, dtype=torch.float64)
        lse = torch.empty(4, HEADS, dtype=torch.float32)
        ks, vs, q, lens, q_lens, qsl, whole = _problem(seed + 99, [33, 2, 17, 60], None)
        want, want_lse = reference.attention(q, *whole, lens, kv_layout="NHD", return_lse=True)
        kc, vc, tables, local_lens = _rank_cache(cp, ks, vs, lens, q_lens, qsl, 4, True)
        got = cp.decode(torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc),
                        torch.from_numpy(np.ascontiguousarray(tables)),
                        torch.from_numpy(local_lens.astype(np.int32)), out=out, lse=lse,
                        buffers=buf)
        assert got[0] is out and got[1] is lse
        np.testing.assert_allclose(out.numpy(), want, atol=2e-6)
        np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-5)
        # an empty step: no rows on any rank, no collective, empty results
        e = torch.zeros(0, HEADS, HS, dtype=torch.float64)
        got = cp.decode(e, torch.from_numpy(kc), torch.from_numpy(vc),
                        torch.from_numpy(np.ascontiguousarray(tables))[:0],
                        torch.zeros(0, dtype=torch.int32), return_lse=True)
        assert got[0].shape == (0, HEADS, HS) and got[1].shape == (0, HEADS)
        got = cp.prefill(e, torch.from_numpy(kc), torch.from_numpy(vc),
                         torch.from_numpy(np.ascontiguousarray(tables))[:0], [], [0], buffers=buf)
        assert got.shape == (0, HEADS, HS)
        # a helper placing tokens over another world size than its group's is refused
        other = cpd.ContextParallel(rank=0, world_size=world + 1)
        with pytest.raises(ValueError, match=f"over {world + 1} ranks, its group has {world}"):
            other.decode(torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc),
                         torch.from_numpy(np.ascontiguousarray(tables)),
                         torch.from_numpy(local_lens.astype(np.int32)))
    finally:
        dist.destroy_process_group()


def _checking_attend(query, key_cache, value_cache, block_tables, seq_lens,
                     query_start_loc=None, **kw):
    """_reference_attend after the shared checks cupaged.attention makes (a soft cap's
    value, the sinks' length), on any call, one of no rows included."""
    from cupaged import _variants

    _variants.soft_cap(kw.get("logits_soft_cap"))
    sinks = kw.get("sinks")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(f"sinks must be [num_heads = {query.shape[1]}]")
    return _reference_attend(query, key_cache, value_cache, block_tables, seq_lens,
                             query_start_loc, **kw)


def _bad_call_worker(rank, world, port):
    """A bad shared argument raises on every rank: on a rank with no rows of its own
    (rank 1 of a first chunk of 8 tokens over units of 16) and on ranks that do not pass
    the sinks on (all but rank 0). A rank left in the collective would time out there."""
    import datetime

    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        cpd._attend, cpd._merge = _checking_attend, _reference_merge
        cp = cpd.ContextParallel(interleave=16)
        ks, vs, q, lens, q_lens, qsl, _ = _problem(7, [8], [8])
        kc, vc, tables, local_lens = _rank_cache(cp, ks, vs, lens, q_lens, qsl, 4, False)
        args = (torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc),
                torch.from_numpy(np.ascontiguousarray(tables)))
        assert len(cp.plan(lens, qsl).perm) == (8 if rank == 0 else 0)
        with pytest.raises(ValueError, match="logits_soft_cap"):
            cp.prefill(*args, lens, qsl, logits_soft_cap=-5.0)
        bad_sinks = torch.zeros(HEADS + 1, dtype=torch.float64)
        with pytest.raises(ValueError, match="sinks"):
            cp.prefill(*args, lens, qsl, sinks=bad_sinks)
        ks, vs, q, lens, q_lens, qsl, _ = _problem(8, [40, 3], None)
        kc, vc, tables, local_lens = _rank_cache(cp, ks, vs, lens, q_lens, qsl, 4, True)
        args = (torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc),
                torch.from_numpy(np.ascontiguousarray(tables)),
                torch.from_numpy(local_lens.astype(np.int32)))
        with pytest.raises(ValueError, match="sinks"):
            cp.decode(*args, sinks=bad_sinks)
        cp.decode(*args)  # the ranks are still in step
        # A rank= of its own that is not its rank in the group: each rank's placement
        # would be another's (the sinks counted on the wrong rank); refused
        swapped = cpd.ContextParallel(interleave=16, rank=world - 1 - rank, world_size=world)
        with pytest.raises(ValueError, match=f"rank {world - 1 - rank}, its group's {rank}"):
            swapped.decode(*args)
    finally:
        dist.destroy_process_group()


def test_a_local_table_too_narrow_for_the_local_keys_is_refused():
    """prefill knows each rank's key counts on the host: a table that cannot hold them
    (the kernels would stop at its end, the keys past it dropped) is refused."""
    cpd_attend = cpd._attend
    cp = cpd.ContextParallel(rank=0, world_size=1)
    ks, vs, q, lens, q_lens, qsl, _ = _problem(3, [40], [40])
    kc, vc, tables, _ = _rank_cache(cp, ks, vs, lens, q_lens, qsl, 4, False)
    narrow = torch.from_numpy(np.ascontiguousarray(tables[:, :9]))  # 36 of 40 tokens
    try:
        cpd._attend = _reference_attend
        with pytest.raises(ValueError, match="block_tables has 9 blocks a sequence; this "
                                             "rank's keys need 10 of 4 tokens"):
            cp.prefill(torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc),
                       narrow, lens, qsl)
    finally:
        cpd._attend = cpd_attend


def test_a_bad_shared_argument_raises_on_every_rank():
    import torch.multiprocessing as mp

    mp.spawn(_bad_call_worker, args=(2, _free_port()), nprocs=2, join=True)


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_over_gloo_matches_the_whole_context(world, rng):
    import torch.multiprocessing as mp

    seed = int(rng.integers(2**31))
    mp.spawn(_gloo_worker, args=(world, _free_port(), seed), nprocs=world, join=True)


# ---- GPU: the real kernels, ranks as threads sharing one GPU -------------------------------


class _ThreadGather:
    """An all-gather between threads (each thread one rank), for one GPU."""

    def __init__(self, world):
        self.world, self.sends = world, [None] * world
        self.barrier = threading.Barrier(world)
        self.local = threading.local()  # each thread's rank

    def __call__(self, recv, send, group):
        assert group is None
        rank = self.local.rank
        torch.cuda.current_stream().synchronize()
        self.sends[rank] = send
        self.barrier.wait()
        recv.copy_(torch.cat(self.sends))
        self.barrier.wait()


def _threads(world, fn):
    errors = []

    def run(r):
        try:
            fn(r)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_context_parallel_kernels_match_one_gpu(world, dtype, rng, monkeypatch):
    """Each rank's cupaged.attention (decode and two-part prefill), index copies and
    cupaged.merge_states, against one cupaged.attention over the whole context."""
    import cupaged

    seed = int(rng.integers(2**31))
    tdt = getattr(torch, dtype)
    gather = _ThreadGather(world)
    monkeypatch.setattr(cpd, "_all_gather", gather)
    cases = CASES + [([3000, 700], [512, 1], 16, 16), ([2049], None, 16, 16)]
    for i, (lens, q_lens, interleave, bs) in enumerate(cases):
        decode = q_lens is None
        ks, vs, q, lens, q_lens, qsl, _ = _problem(seed + i, lens, q_lens, hs=64)
        # one GPU's cache of the whole context (the oracle)
        kc, vc, tables, _ = _rank_cache(cpd.ContextParallel(rank=0, world_size=1),
                                        ks, vs, lens, q_lens, qsl, bs, decode)
        dev = lambda a, t=tdt: torch.as_tensor(np.nan_to_num(a), device="cuda").to(t)  # noqa: E731
        qd = dev(q)
        ints = lambda a: torch.as_tensor(np.ascontiguousarray(a).astype(np.int32), device="cuda")  # noqa: E731
        whole = cupaged.attention(qd, dev(kc), dev(vc), ints(tables), ints(lens),
                                  None if decode else ints(qsl), return_lse=True)
        results = [None] * world

        def rank_fn(r):
            gather.local.rank = r
            cp = cpd.ContextParallel(None, rank=r, world_size=world, interleave=interleave)
            rkc, rvc, rtables, rlens = _rank_cache(cp, ks, vs, lens, q_lens, qsl, bs, decode)
            args = (qd, dev(rkc), dev(rvc), ints(rtables))
            if decode:
                results[r] = cp.decode(*args, ints(rlens), return_lse=True)
            else:
                results[r] = cp.prefill(*args, lens, qsl, return_lse=True)
            torch.cuda.current_stream().synchronize()

        _threads(world, rank_fn)
        for out, lse in results:
            ref = whole[0].float()
            err = float((out.float() - ref).norm() / max(ref.norm(), 1e-6))
            assert err < 2e-2, (i, err)
            np.testing.assert_allclose(lse.cpu().numpy(), whole[1].cpu().numpy(), atol=2e-2,
                                       err_msg=f"case {i}")


# ---- cupaged-bench context-parallel: its workload and its streamed reference -------------


def test_bench_case_rows_and_tokens():
    from cupaged.bench.context_parallel import ContextParallelCase

    case = ContextParallelCase(context=40, others=(7, 3, 1), chunk=5)
    assert case.seq_lens.tolist() == [40, 7, 3, 1]
    assert case.prefill_q_lens.tolist() == [5, 1, 3, 1]
    seq, pos = case.tokens(38, 51)
    assert seq.tolist() == [0, 0] + [1] * 7 + [2] * 3 + [3] and pos[:4].tolist() == [38, 39, 0, 1]
    seq, pos = case.rows(case.prefill_q_lens)
    assert seq.tolist() == [0] * 5 + [1, 2, 2, 2, 3]
    assert pos.tolist() == [35, 36, 37, 38, 39, 6, 0, 1, 2, 0]
    for kw, msg in ((dict(chunk=50), r"chunk \(50\) must be at most context \(40\)"),
                    (dict(heads=12), r"heads \(12\) must be a multiple of kv_heads"),
                    (dict(others=(4, 0)), "others must be positive"),
                    (dict(dtype="float32"), "dtype must be float16 or bfloat16"),
                    (dict(interleave=0), "interleave")):
        with pytest.raises(ValueError, match=msg):
            ContextParallelCase(**{"context": 40, "chunk": 5, **kw})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_reference_is_the_float64_attention(monkeypatch, dtype):
    """The dense reference the bench checks against, on the host: chunks of 48 tokens
    (sequences straddle them), score tiles of a few keys, rows at position 0, rows of
    several sequences in one call, against reference.attend on the same drawn K/V rounded
    to the query's dtype (as the caches hold them)."""
    tdt = getattr(torch, dtype)
    from cupaged.bench import context_parallel as cpb

    monkeypatch.setattr(cpb, "CHUNK_BYTES", 48 * 2 * 8 * 4)  # 48 tokens of 2 heads of 8
    case = cpb.ContextParallelCase(context=130, others=(3, 70, 1), chunk=9, heads=4,
                                   kv_heads=2, head_size=8, block_size=16, seed=5)
    assert case.chunk_tokens == 48
    ks, vs = zip(*(cpb.draw_kv(case, c, "cpu") for c in range(-(-case.total_tokens // 48))))
    k_all = torch.cat(ks).to(tdt).double().numpy()
    v_all = torch.cat(vs).to(tdt).double().numpy()
    monkeypatch.setattr(cpb, "MIN_TILE", 5)  # score tiles of 5 keys and more
    seq, pos = case.rows(case.prefill_q_lens)
    seq = np.concatenate([seq, [1, 2]])
    pos = np.concatenate([pos, [0, 69]])
    q = torch.randn(len(seq), 4, 8, generator=torch.Generator().manual_seed(3)).to(tdt)
    out, lse = cpb.streamed_reference(case, q, seq, pos)
    off = np.concatenate([[0], np.cumsum(case.seq_lens)])
    for i, (s, p) in enumerate(zip(seq, pos)):
        k = k_all[off[s]:off[s] + p + 1]
        v = v_all[off[s]:off[s] + p + 1]
        want, want_lse = reference.attend(q[i].double().numpy(), k, v, 1 / math.sqrt(8),
                                          return_lse=True)
        np.testing.assert_allclose(out[i].numpy(), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[i].numpy(), want_lse, rtol=1e-6, atol=1e-6)


def test_bench_sampled_positions():
    from cupaged.bench import context_parallel as cpb

    case = cpb.ContextParallelCase(context=100_000, others=(150, 5), chunk=8, interleave=16)
    rng = np.random.default_rng(0)
    long = cpb.sampled_positions(case, 0, rng)
    assert (long[:64] == np.arange(64)).all() and (long[-64:] == np.arange(99_936, 100_000)).all()
    assert 128 < len(long) <= 128 + cpb.SAMPLED and (np.diff(long) > 0).all()
    assert (cpb.sampled_positions(case, 1, rng) == np.arange(150)).all()
    assert (cpb.sampled_positions(case, 2, rng) == np.arange(5)).all()
    with pytest.raises(ValueError, match=r"chunk \(20000\) must be at most context \(100000\) "
                                         r"and 16384"):
        cpb.ContextParallelCase(context=100_000, chunk=20_000)


@pytest.mark.parametrize("rank", [0, 1])
def test_bench_placement_check_reads_what_was_drawn(monkeypatch, rank):
    """A rank's cache written from the drawn K/V (host stand-in for cache_for): no token
    differs; the same cache with two of a sequence's blocks swapped in its table, or one
    slot overwritten, differs where it should."""
    from cupaged.bench import context_parallel as cpb

    monkeypatch.setattr(cpb, "CHUNK_BYTES", 64 * 2 * 8 * 4)  # 64 tokens a chunk
    case = cpb.ContextParallelCase(context=700, others=(90, 3), chunk=8, heads=4, kv_heads=2,
                                   head_size=8, block_size=4, interleave=8)
    cp = cpd.ContextParallel(rank=rank, world_size=2, interleave=8)
    chunks = -(-case.total_tokens // case.chunk_tokens)
    k_all = torch.cat([cpb.draw_kv(case, c, "cpu")[0] for c in range(chunks)]).bfloat16()
    v_all = torch.cat([cpb.draw_kv(case, c, "cpu")[1] for c in range(chunks)]).bfloat16()
    local = cp.local_lens(case.seq_lens)
    nb = -(-local // 4)
    perm = np.random.default_rng(1).permutation(int(nb.sum()) + 1)
    tables = np.zeros((3, int(nb.max())), np.int32)
    at = 0
    for s_, n in enumerate(nb):
        tables[s_, :n] = perm[at:at + n]
        at += n
    kc = torch.full((int(nb.sum()) + 1, 4, 2, 8), math.nan, dtype=torch.bfloat16)
    vc = kc.clone()
    seq, pos = case.tokens(0, case.total_tokens)
    mine = np.flatnonzero(cp.owner(pos) == rank)
    k = cp.local_index(pos[mine])
    blk = torch.as_tensor(tables[seq[mine], k // 4].astype(np.int64))
    off = torch.as_tensor(k % 4)
    kc[blk, off] = k_all[mine]
    vc[blk, off] = v_all[mine]
    cache = lambda t: (kc, vc, torch.from_numpy(t), None)  # noqa: E731
    read, differ = cpb.placement_mismatches(case, cp, cache(tables))
    assert read > 100 and differ == 0
    swapped = tables.copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    assert cpb.placement_mismatches(case, cp, cache(swapped))[1] == 8  # two blocks of 4
    if rank == 0:  # (the third sequence's 3 tokens are all rank 0's)
        vc[tables[2, 0], 0, 1, 3] += 1.0  # one value of its first token
        assert cpb.placement_mismatches(case, cp, cache(tables))[1] == 1


def test_bench_errors_name_the_worst_row():
    from cupaged.bench.context_parallel import errors

    want = torch.ones(3, 2, 4)
    got = want.clone()
    got[1, 0, 0] = 1.8
    e_all, e_row, worst = errors(got, want)
    assert e_row == pytest.approx(0.8 / math.sqrt(8)) and e_all < e_row and worst == 1


@pytest.mark.gpu
def test_bench_context_parallel_on_one_gpu(tmp_path):
    """`cupaged-bench context-parallel` outside torchrun: a world of one, every check
    (the helper's steps, the graph replay and one GPU's calls against the streamed
    reference) passing, then the timed rows."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "cupaged.bench", "context-parallel",
                        "--context", "5000", "--chunk", "64", "--reps", "3", "--heads", "8",
                        "--kv-heads", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    checks = [l for l in r.stdout.splitlines() if l.startswith("check ")]
    assert len(checks) == 10 and not any("FAILED" in l for l in checks), r.stdout
    assert "placement: " in checks[0] and "0 differ" in checks[0]
    assert "decode step, CUDA graph replay" in r.stdout and "helper beyond" in r.stdout
