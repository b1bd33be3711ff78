"""Context parallelism across GPUs with NCCL: cupaged.distributed.ContextParallel's decode
and chunked-prefill steps against one GPU's cupaged.attention over the whole context, a
decode step captured in a CUDA graph and replayed, and per-step times.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 tools/cp_check.py [--context N]

Every rank builds the same random K/V (one seed), keeps its own tokens in its own paged
cache (placement, manager counts and write slots from the helper) and the whole context
in a second cache as the oracle (so N must fit one GPU). Rank 0 prints one line per check
and the times; the exit status is 1 on a mismatch."""

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=100_000, help="tokens of the long sequence")
    ap.add_argument("--interleave", type=int, default=16)
    args = ap.parse_args()

    import cupaged
    from cupaged.distributed import ContextParallel

    # NVLink multicast can put a shared host's GPUs out of service: off unless asked for
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before NCCL binds a device
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev, dt = "cuda", torch.bfloat16
    heads, kv_heads, hs, bs = 64, 8, 128, 16
    cp = ContextParallel(interleave=args.interleave)
    g = torch.Generator(device=dev).manual_seed(7)

    lens = np.array([args.context, 3000, 5, 1])  # a long one, a short one, shorter than the world
    q_lens = np.array([512, 1, 5, 1])  # a prefill chunk, decode rows, a first chunk
    n_tot = int(lens.sum())
    k_all = torch.randn(n_tot, kv_heads, hs, device=dev, generator=g, dtype=torch.float32).to(dt)
    v_all = torch.randn(n_tot, kv_heads, hs, device=dev, generator=g, dtype=torch.float32).to(dt)
    every = np.concatenate([[0], np.cumsum(lens)])  # every token as a row: writes the whole context

    def cache(c):
        """A cache holding the sequences' tokens that ``c`` places on its rank."""
        local = c.local_lens(lens)
        blocks = int(sum(-(-int(n) // bs) for n in local)) + 1
        bm = cupaged.BlockManager(blocks, bs)
        for s in range(len(lens)):
            bm.add(s, 0)
        bm.append(list(range(len(lens))), num_tokens=local.tolist())
        tables, got = bm.tables(list(range(len(lens))))
        assert (got == local).all()
        slots = c.slot_mapping(tables, lens, every, block_size=bs)
        kc = torch.empty(blocks, bs, kv_heads, hs, device=dev, dtype=dt)
        vc = torch.empty_like(kc)
        cupaged.reshape_and_cache(k_all, v_all, kc, vc, torch.as_tensor(slots, device=dev),
                                  kv_layout="NHD")
        return kc, vc, torch.as_tensor(np.ascontiguousarray(tables), device=dev), \
            torch.as_tensor(local.astype(np.int32), device=dev)

    kc, vc, tables, local_lens = cache(cp)
    wkc, wvc, wtables, wlens = cache(ContextParallel(rank=0, world_size=1))
    max_local = int(local_lens.max())
    failures = []

    def check(name, got, want, tol=2e-2):
        err = float((got.float() - want.float()).norm() / want.float().norm())
        errs = [None] * world
        dist.all_gather_object(errs, err)
        ok = all(e < tol for e in errs)
        if rank == 0:
            print(f"{name}: relative error per rank {['%.2e' % e for e in errs]} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            failures.append(name)

    # decode: one row per sequence
    q = torch.randn(len(lens), heads, hs, device=dev, generator=g, dtype=torch.float32).to(dt)
    want = cupaged.attention(q, wkc, wvc, wtables, wlens, return_lse=True)
    got = cp.decode(q, kc, vc, tables, local_lens, return_lse=True)
    check("decode out", got[0], want[0])
    check("decode lse", got[1], want[1], 1e-3)

    # chunked prefill mixed with decode rows and a first chunk
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    qp = torch.randn(int(q_lens.sum()), heads, hs, device=dev, generator=g,
                     dtype=torch.float32).to(dt)
    want = cupaged.attention(qp, wkc, wvc, wtables, wlens, torch.as_tensor(qsl.astype(np.int32),
                             device=dev), return_lse=True)
    got = cp.prefill(qp, kc, vc, tables, lens, qsl, return_lse=True)
    check("prefill out", got[0], want[0])
    check("prefill lse", got[1], want[1], 1e-3)

    # a decode step in a CUDA graph: buffers, out and workspace given; replayed with new q
    out = torch.empty_like(q)
    buf = cp.buffers(len(lens), heads, hs, dt, dev)
    ws = cupaged.DecodeWorkspace(len(lens), heads, hs)

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
    q.copy_(torch.randn(q.shape, device=dev, generator=g, dtype=torch.float32).to(dt))
    graph.replay()
    want = cupaged.attention(q, wkc, wvc, wtables, wlens)
    check("graph-replayed decode", out, want)

    # per-step times: the graph replay (attention + all-gather + merge) and one GPU's call
    def timed(fn, n=50):
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    ws1 = cupaged.DecodeWorkspace(len(lens), heads, hs)
    one = torch.empty_like(q)
    t_cp = timed(graph.replay)
    t_one = timed(lambda: cupaged.attention(q, wkc, wvc, wtables, wlens, out=one, workspace=ws1))
    if rank == 0:
        print(f"decode step, context {args.context} + {lens[1:].tolist()}, {heads}/{kv_heads} "
              f"heads of {hs}, bf16: one GPU {t_one:.1f} us, {world} GPUs (graph) "
              f"{t_cp:.1f} us", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
