"""``cupaged-bench overhead``: host time per call of every entry point, eager and
through prepared calls, CuPy and torch, and CUDA-graph replay for scale."""

from __future__ import annotations


import contextlib

import cupy
import numpy as np

from .. import planning
from . import peers, timing, workloads


def nhd_copy(arrays: dict) -> tuple:
    """A case's vLLM-layout caches copied to NHD (for attention's default layout)."""
    kc, vc = arrays["key_cache"], arrays["value_cache"]
    nb, kvh, _, bs, _ = kc.shape
    hs = vc.shape[2]
    return (cupy.ascontiguousarray(kc.transpose(0, 3, 1, 2, 4).reshape(nb, bs, kvh, hs)),
            cupy.ascontiguousarray(vc.transpose(0, 3, 1, 2)))


@contextlib.contextmanager
def _mla_split(tiles: int):
    """mla_attention's split-KV fixed while a row is timed (its calls are planned, and
    remembered, under it), the planner's choice after."""
    planning.set_mla_split(tiles)
    try:
        yield
    finally:
        planning.set_mla_split(None)


def host_overheads(calls: int = 200, layers: int = 32) -> dict:
    """Host time per call of each entry point with its kernel cached (llama-3-8b shape,
    batch 8, context 1024), for CuPy arrays and (when torch imports) torch tensors, and
    per replay of a decode step of ``layers`` layers captured in a CUDA graph."""
    from .. import cache_ops, decode
    from ..kv_cache import PagedKVCache

    case = workloads.DecodeCase(8, np.full(8, 1024, np.int32), 32, 8, 128, 16, np.dtype(np.float16)).build()
    a = case.arrays
    out = cupy.empty(a["query"].shape, a["query"].dtype)
    rows = {}
    rows["paged_attention, single pass"] = timing.host_us(lambda: case.run(out, "never"), calls)
    rows["paged_attention, split-KV"] = timing.host_us(lambda: case.run(out, "always"), calls)
    rows["paged_attention_v1"] = timing.host_us(lambda: decode.paged_attention_v1(
        out, a["query"], a["key_cache"], a["value_cache"], 8, 0.1, a["block_tables"],
        a["context_lens"], 16, 1024), calls)
    from ..attention import attention

    starts = cupy.arange(9, dtype=np.int32)
    rows["attention, vLLM layout, decode (query_start_loc, max_query_len=1)"] = timing.host_us(
        lambda: attention(a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                          a["context_lens"], starts, kv_layout="vllm", max_query_len=1,
                          max_seq_len=1024, out=out), calls)
    starts4 = cupy.arange(0, 9 * 4, 4, dtype=np.int32)
    q4 = cupy.ones((32, 32, 128), np.float16)
    out4 = cupy.empty_like(q4)
    rows["attention, vLLM layout, verify 8 x 4 tokens"] = timing.host_us(
        lambda: attention(q4, a["key_cache"], a["value_cache"], a["block_tables"],
                          a["context_lens"], starts4, kv_layout="vllm", max_query_len=4,
                          max_seq_len=1024, out=out4), calls)
    # attention() and AttentionPlan over the same cache as NHD (a copy), with the split-KV
    # partials in a workspace (so the plan rows allocate nothing).
    from ..attention import AttentionPlan

    hk, hv = nhd_copy(a)
    ws = decode.DecodeWorkspace(8, 32, 128)
    q, bt, cl = a["query"], a["block_tables"], a["context_lens"]
    rows["attention, NHD, decode"] = timing.host_us(
        lambda: attention(q, hk, hv, bt, cl, max_seq_len=1024, out=out), calls)
    plan = AttentionPlan(q, hk, hv, bt, cl, max_seq_len=1024, out=out, workspace=ws)
    rows["AttentionPlan.run, NHD, decode (split-KV, workspace)"] = timing.host_us(
        lambda: plan.run(q, hk, hv, out=out), calls)
    plan4 = AttentionPlan(q4, hk, hv, bt, cl, starts4, max_query_len=4, max_seq_len=1024,
                          out=out4, workspace=ws)
    rows["AttentionPlan.run, NHD, verify 8 x 4 tokens (split-KV, workspace)"] = timing.host_us(
        lambda: plan4.run(q4, hk, hv, out=out4), calls)
    # The same bytes as 64 x 256 tokens: 512 CTAs, which "auto" serves in a single pass.
    wide = workloads.DecodeCase(64, np.full(64, 256, np.int32), 32, 8, 128, 16, np.dtype(np.float16),
                      seed=1).build()
    w = wide.arrays
    wk, wv = nhd_copy(w)
    wq, wbt, wcl = w["query"], w["block_tables"], w["context_lens"]
    wout = cupy.empty_like(wq)
    rows["attention, NHD, decode 64 x 256 (single pass)"] = timing.host_us(
        lambda: attention(wq, wk, wv, wbt, wcl, max_seq_len=256, out=wout), calls)
    wplan = AttentionPlan(wq, wk, wv, wbt, wcl, max_seq_len=256, out=wout)
    rows["AttentionPlan.run, NHD, decode 64 x 256 (single pass)"] = timing.host_us(
        lambda: wplan.run(wq, wk, wv, out=wout), calls)
    # mla_attention over DeepSeek's combined latent cache (batch 8, context 1024, blocks of
    # 64): 128 heads in a single pass, and 16 heads split into a workspace.
    from ..mla import mla_attention

    mla_cache = cupy.ones((8 * 16, 64, 576), np.float16)
    mla_bt = cupy.arange(8 * 16, dtype=np.int32).reshape(8, 16)
    mla_q = {h: cupy.ones((8, h, 576), np.float16) for h in (128, 16)}
    mla_out = {h: cupy.empty((8, h, 512), np.float16) for h in (128, 16)}
    mla_ws = decode.DecodeWorkspace(8, 16, 512)
    mla_scale = 1 / np.sqrt(192)
    with _mla_split(0):
        rows["mla_attention, 128 heads, decode (single pass)"] = timing.host_us(
            lambda: mla_attention(mla_q[128], mla_cache, mla_bt, cl, scale=mla_scale,
                                  max_seq_len=1024, out=mla_out[128]), calls)
    with _mla_split(4):
        rows["mla_attention, 16 heads, decode (split-KV, workspace)"] = timing.host_us(
            lambda: mla_attention(mla_q[16], mla_cache, mla_bt, cl, scale=mla_scale,
                                  max_seq_len=1024, out=mla_out[16], workspace=mla_ws), calls)
    # sparse_mla_attention (DeepSeek-V3.2's DSA decode) over the same cache: batch 8, two
    # query tokens each, 128 heads, top-2048 slots.
    from ..sparse_mla import sparse_mla_attention

    sq = cupy.ones((8, 2, 128, 576), np.float16)
    sidx = cupy.zeros((8, 2, 2048), np.int32)
    sout = cupy.empty((8, 2, 128, 512), np.float16)
    rows["sparse_mla_attention, 128 heads, decode 8 x 2 (top-2048)"] = timing.host_us(
        lambda: sparse_mla_attention(sq, mla_cache, sidx, scale=mla_scale, out=sout), calls)
    k = cupy.ones((8, 8, 128), np.float16)
    slots = cupy.arange(8, dtype=np.int64) * 16
    rows["reshape_and_cache, 8 tokens"] = timing.host_us(lambda: cache_ops.reshape_and_cache(
        k, k, a["key_cache"], a["value_cache"], slots), calls)
    ks, vs = [a["key_cache"]] * layers, [a["value_cache"]] * layers
    pairs = cupy.asarray([[0, 1], [2, 3]], np.int64)
    rows[f"copy_blocks, {layers} layers"] = timing.host_us(lambda: cache_ops.copy_blocks(ks, vs, pairs), calls)
    # Room for every timed step: 64 sequences of 1,000 tokens, each growing by up to
    # 10 + 9 x 100 tokens (the warm-up and timing.host_us's runs).
    cache = PagedKVCache(1, 64 * 160, 8, 128, 16, "float16")
    ids = list(range(64))
    for s in ids:
        cache.add(s, 1000)
    rows["PagedKVCache.step, 64 sequences"] = timing.host_us(lambda: cache.step(ids), min(calls, 100))

    # A decode step captured once and replayed: per layer, write the new token's K/V and
    # attend (split-KV into the preallocated workspace, so nothing allocates while capturing).

    def step(arrays):
        q, kc, vc, bt, cl, o, kv, sl = arrays
        for _ in range(layers):
            cache_ops.reshape_and_cache(kv, kv, kc, vc, sl)
            decode.paged_attention(q, kc, vc, bt, cl, out=o, workspace=ws, partition="always",
                                      max_context_len=1024)

    cupy_args = (a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                 a["context_lens"], out, k, slots)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step(cupy_args)  # kernels loaded before capture
        stream.begin_capture()
        step(cupy_args)
        graph = stream.end_capture()
        rows[f"CuPy graph replay, {layers} x (reshape_and_cache + split-KV attention)"] = \
            timing.host_us(lambda: graph.launch(stream), calls)
    rows[f"the same step eager, {layers} x (reshape_and_cache + split-KV attention)"] = \
        timing.host_us(lambda: step(cupy_args), max(10, calls // 10))

    torch = peers.import_torch()
    if torch is not None:  # the same arrays as torch tensors (zero-copy views)
        tq, tkc, tvc, tbt, tcl, tk, t_slots = (torch.from_dlpack(x) for x in (
            a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["context_lens"],
            k, slots))
        tout = torch.empty_like(tq)
        torch_args = (tq, tkc, tvc, tbt, tcl, tout, tk, t_slots)
        rows["paged_attention, torch tensors, single pass"] = timing.host_us(
            lambda: decode.paged_attention(tq, tkc, tvc, tbt, tcl, out=tout, partition="never",
                                              max_context_len=1024), calls)
        rows["paged_attention, torch tensors, split-KV + workspace"] = timing.host_us(
            lambda: decode.paged_attention(tq, tkc, tvc, tbt, tcl, out=tout, partition="always",
                                              workspace=ws, max_context_len=1024), calls)
        thk, thv = torch.from_dlpack(hk), torch.from_dlpack(hv)
        rows["attention, torch tensors, NHD, decode"] = timing.host_us(
            lambda: attention(tq, thk, thv, tbt, tcl, max_seq_len=1024, out=tout), calls)
        tplan = AttentionPlan(tq, thk, thv, tbt, tcl, max_seq_len=1024, out=tout, workspace=ws)
        rows["AttentionPlan.run, torch tensors, NHD, decode (split-KV, workspace)"] = timing.host_us(
            lambda: tplan.run(tq, thk, thv, out=tout), calls)
        twq, twk, twv, twbt, twcl, twout = (torch.from_dlpack(x) for x in (
            wq, wk, wv, wbt, wcl, wout))
        twplan = AttentionPlan(twq, twk, twv, twbt, twcl, max_seq_len=256, out=twout)
        rows["AttentionPlan.run, torch tensors, NHD, decode 64 x 256 (single pass)"] = \
            timing.host_us(lambda: twplan.run(twq, twk, twv, out=twout), calls)
        tmq, tmc, tmbt, tmout = (torch.from_dlpack(x) for x in (
            mla_q[16], mla_cache, mla_bt, mla_out[16]))
        with _mla_split(4):
            rows["mla_attention, torch tensors, 16 heads, decode (split-KV, workspace)"] = \
                timing.host_us(lambda: mla_attention(tmq, tmc, tmbt, tcl, scale=mla_scale,
                                                     max_seq_len=1024, out=tmout,
                                                     workspace=mla_ws), calls)
        rows["reshape_and_cache, torch tensors, 8 tokens"] = timing.host_us(
            lambda: cache_ops.reshape_and_cache(tk, tk, tkc, tvc, t_slots), calls)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the default stream, as torch asks
            step(torch_args)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(torch_args)
        rows[f"torch.cuda.graph replay, {layers} x (reshape_and_cache + split-KV attention)"] = \
            timing.host_us(g.replay, calls)
        torch.cuda.synchronize()
        del g
    case.arrays.clear()
    wide.arrays.clear()
    return rows


def stubbed_overheads(calls: int = 10000) -> dict:
    """Host time per call of AttentionPlan.run, of attention's and mla_attention's
    repeated calls and of a cache write on the CPU alone, the device's calls stubbed
    (:mod:`.stub`: nothing launches, so the launch's own cost is not in them), llama-3-8b's
    shape (32 query heads, 8 KV heads, head size 128, float16, NHD blocks of 16; MLA:
    DeepSeek's latent cache, 128 and 16 heads). Each attention form is timed as a caller
    runs it (the fast run) and with ``stream=`` CuPy's current stream, which the fast run
    leaves to the generic path; a pure-Python loop gauges the CPU's speed."""
    from .. import decode
    from ..attention import AttentionPlan, attention
    from ..cache_ops import reshape_and_cache
    from .stub import stubbed_driver

    rows = {}
    with stubbed_driver() as stub:
        gauge = lambda: sum(i * i for i in range(50))  # noqa: E731
        rows["python gauge: sum of 50 squares"] = timing.host_us(gauge, calls)
        f = stub.fake

        def case(seqs, tokens, width, **kw):
            q = f((seqs * tokens, 32, 128), np.float16)
            kc, vc = (f((seqs * width + 8, 16, 8, 128), np.float16) for _ in "kv")
            starts = f((seqs + 1,), np.int32) if tokens > 1 else None
            return ((q, kc, vc, f((seqs, width), np.int32), f((seqs,), np.int32), starts),
                    f(q.shape, q.dtype), kw)

        forms = {
            "decode 64 x 64 (single pass)": case(64, 1, 4, max_seq_len=64),
            "decode 64 x 256 (flat split, scratch)": case(64, 1, 16, max_seq_len=256),
            "decode 8 x 2048 (split-KV, workspace)": case(
                8, 1, 128, max_seq_len=2048,
                workspace=decode.DecodeWorkspace(8, 32, 128, rows=8 * 32 * 64, device=0)),
            "decode 8 x 2048 (split-KV, scratch)": case(8, 1, 128, max_seq_len=2048),
            "prefill 16 x 32 tokens": case(16, 32, 16, max_query_len=32, max_seq_len=256),
        }
        current = cupy.cuda.get_current_stream().ptr  # (a handle)
        for name, (arrays, out, kw) in forms.items():
            q, kc, vc = arrays[:3]
            plan = AttentionPlan(*arrays, out=out, **kw)
            rows[f"AttentionPlan.run, {name}"] = timing.host_us(
                lambda: plan.run(q, kc, vc, out=out), calls)
            rows[f"AttentionPlan.run, {name}, stream= (generic path)"] = timing.host_us(
                lambda: plan.run(q, kc, vc, out=out, stream=current), calls)
            rows[f"attention, {name}"] = timing.host_us(
                lambda: attention(*arrays, out=out, **kw), calls)
            rows[f"attention, {name}, stream= (generic path)"] = timing.host_us(
                lambda: attention(*arrays, out=out, stream=current, **kw), calls)
        # mla_attention's decode rows (the eager rows' shapes: batch 8, context 1024,
        # DeepSeek's combined latent cache in blocks of 64)
        from ..mla import mla_attention

        mla_cache = f((8 * 16, 64, 576), np.float16)
        mla_bt, mla_lens = f((8, 16), np.int32), f((8,), np.int32)
        mla_ws = decode.DecodeWorkspace(8, 16, 512, rows=8 * 16 * 8, device=0)
        for heads, split, ws in ((128, 0, None), (16, 4, mla_ws)):
            q, o = f((8, heads, 576), np.float16), f((8, heads, 512), np.float16)
            with _mla_split(split):
                name = "single pass" if not split else "split-KV, workspace"
                rows[f"mla_attention, {heads} heads, decode ({name})"] = timing.host_us(
                    lambda: mla_attention(q, mla_cache, mla_bt, mla_lens, scale=0.07,
                                          max_seq_len=1024, out=o, workspace=ws), calls)
        # A step's cache write of 8 tokens into NHD caches (the eager row's shape)
        kv = [f((8, 8, 128), np.float16) for _ in "kv"]
        caches = [f((512, 16, 8, 128), np.float16) for _ in "kv"]
        slots = f((8,), np.int64)
        rows["reshape_and_cache, 8 tokens"] = timing.host_us(
            lambda: reshape_and_cache(*kv, *caches, slots, kv_layout="NHD"), calls)
    return rows


def _kw20(a=None, b=None, c=None, d=None, e=None, f=None, g=None, h=None, i=None, j=None,
          k=None, l=None, m=None, n=None, o=None, p=None, q=None, r=None, s=None,  # noqa: E741
          t=None):
    return a


def _cprofile(name: str, fn, echo, n: int = 3000) -> None:
    """cProfile over ``n`` calls of ``fn``: the 28 lines of most own time."""
    import cProfile
    import io
    import pstats

    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    cupy.cuda.runtime.deviceSynchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    echo(f"==== cProfile: {name} ({n} calls)")
    echo("\n".join(s.getvalue().splitlines()[6:34]))


def pieces(echo=print) -> None:
    """Where the host time of an eager decode call goes (batch 8 x 1024 tokens, 32/8
    heads, fp16; kernels cached, out given): host µs per call of paged_attention and
    attention with CuPy and torch inputs, of each piece of the CuPy single-pass call
    (argument adaptation, validation, the prepared-call lookup and launch, the launch's
    parameter packing and cuLaunchKernel) and of the Python and framework primitives a
    faster path would need; then a cProfile of each whole call. Needs torch. The pieces
    reach into the library's internals: they follow its code, not its API."""
    import torch
    from cupy_backends.cuda.api import driver

    from .. import _arrays, _prepared, validation
    from ..attention import AttentionPlan, attention
    from ..decode import DecodeWorkspace, paged_attention

    def per_call_us(fn):  # median of 7 runs of 200 calls (the launch queue never fills)
        return timing.host_us(fn, 200, 7)

    case = workloads.DecodeCase(8, np.full(8, 1024, np.int32), 32, 8, 128, 16,
                                np.dtype(np.float16)).build()
    a = case.arrays
    q, kc, vc, bt, cl = (a[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                         "context_lens"))
    out = cupy.empty(q.shape, q.dtype)
    tq, tkc, tvc, tbt, tcl = (torch.from_dlpack(x) for x in (q, kc, vc, bt, cl))
    tout = torch.empty_like(tq)
    hk, hv = nhd_copy(a)
    calls = {
        "paged_attention cupy single": lambda: paged_attention(
            q, kc, vc, bt, cl, out=out, partition="never", max_context_len=1024),
        "paged_attention cupy split": lambda: paged_attention(
            q, kc, vc, bt, cl, out=out, partition="always", max_context_len=1024),
        "paged_attention torch single": lambda: paged_attention(
            tq, tkc, tvc, tbt, tcl, out=tout, partition="never", max_context_len=1024),
        "attention NHD cupy decode": lambda: attention(
            q, hk, hv, bt, cl, kv_layout="NHD", max_seq_len=1024, out=out),
    }
    for name, fn in calls.items():
        echo(f"{name:40s} {per_call_us(fn):7.1f} us/call")

    p = validation.validate_decode(q, kc, vc, bt, cl, None, out)
    memo = {}
    key = (p.device, p.dtype.name, p.head_size, p.block_size, planning.group_tile(4),
           p.cache.kv_format, p.cache.dtype.name, p.quant.mode, "")
    ks = planning.decode_kernels(*key)
    main_arrays = (q, kc, vc, bt, cl, None, out, None)
    t_main = (tq, tkc, tvc, tbt, tcl, None, tout, None)
    scalars = (None, 1024, "never", "auto", None, None, None, False, ())
    mk, ptrs = _prepared.key("decode", main_arrays, (None,) * 4, scalars, None)
    calls["paged_attention cupy single"]()
    prep = _prepared.lookup(mk)
    if prep is None:
        raise RuntimeError("the single-pass call was not memoized: the pieces below follow "
                           "an older _prepared.key")
    def context_in_scope(kind):  # as every call makes its context: in a launching scope
        with _arrays.launching(0):
            return _arrays.context(0, kind, None)

    ctx = context_in_scope("cupy")
    la = prep.launch
    args = (out.data.ptr, 0, 0, 0, q.data.ptr, *la.q_strides, kc.data.ptr, vc.data.ptr,
            *la.kv_strides, bt.data.ptr, *la.kv_tail, cl.data.ptr, 0, *la.tail, la.vp)
    params = ks.decode.pack(*args)
    plan = AttentionPlan(q, hk, hv, bt, cl, max_seq_len=1024, out=out,
                         workspace=DecodeWorkspace(8, 32, 128))
    pieces = {
        "as_device_array x6": lambda: [_arrays.as_device_array(x, "x")
                                       for x in (q, kc, vc, bt, cl, out)],
        "validation.validate_decode": lambda: validation.validate_decode(q, kc, vc, bt, cl,
                                                                         None, out),
        "on_device": lambda: _arrays.on_device(0),
        "launching + context (cupy)": lambda: context_in_scope("cupy"),
        "launching + context (torch)": lambda: context_in_scope("torch"),
        "runtime.getDevice": lambda: cupy.cuda.runtime.getDevice(),
        "cupy get_current_stream": lambda: cupy.cuda.get_current_stream().ptr,
        "TorchArray": lambda: _arrays.TorchArray(tq, "q"),
        "torch data_ptr": lambda: tq.data_ptr(),
        # The primitives a metadata-keyed fast path would need.
        "cupy (shape, strides, dtype, ptr)": lambda: (q.shape, q.strides, q.dtype, q.data.ptr),
        "torch (shape, stride(), dtype, data_ptr)": lambda: (tq.shape, tq.stride(), tq.dtype,
                                                              tq.data_ptr()),
        "torch get_device": lambda: tq.get_device(),
        "torch is_cuda + requires_grad": lambda: (tq.is_cuda, tq.requires_grad),
        "dict get, 8-tuple key": lambda: memo.get((1, 2, 3, 4, 5, 6, 7, key)),
        "cupy.empty(8 x 32 x 128)": lambda: cupy.empty((8, 32, 128), np.float16),
        "torch.empty(8 x 32 x 128)": lambda: torch.empty((8, 32, 128), dtype=torch.float16,
                                                         device="cuda"),
        "python call, 20 kwargs": lambda: _kw20(a=1, b=2, c=3, d=4, e=5, f=6, g=7, h=8, i=9,
                                               j=10, k=11, l=12, m=13, n=14, o=15, p=16,
                                               q=17, r=18, s=19, t=20),
        "planning.decode_kernels lookup": lambda: planning.decode_kernels(*key),
        # The prepared (memoized) path's pieces.
        "_prepared.key (cupy decode)": lambda: _prepared.key(
            "decode", main_arrays, (None,) * 4, scalars, None),
        "_prepared.key (torch decode)": lambda: _prepared.key(
            "decode", t_main, (None,) * 4, scalars, None),
        "_prepared.lookup": lambda: _prepared.lookup(mk),
        "_prepared.run (context + launch)": lambda: _prepared.run(prep, ptrs, None, out, None),
        "launch.Launch.run (launch)": lambda: prep.launch.run(ctx, ptrs[6], *ptrs[:6]),
        "_prepared.metas (4 cupy arrays)": lambda: _prepared.metas((q, kc, vc, out)),
        "_prepared.metas (4 torch tensors)": lambda: _prepared.metas((tq, tkc, tvc, tout)),
        "AttentionPlan.run cupy NHD decode + workspace": lambda: plan.run(q, hk, hv, out=out),
        "launch only (Launcher)": lambda: ks.decode((8, 8, 1), 128, ks.smem, ctx.stream,
                                                    *args),
        "  of which struct.pack_into": lambda: ks.decode.pack(*args),
        "  of which cuLaunchKernel": lambda: driver.launchKernel(
            ks.decode.ptr, 8, 8, 1, 128, 1, 1, ks.smem, ctx.stream, params, 0),
    }
    for name, fn in pieces.items():
        echo(f"  {name:44s} {per_call_us(fn):7.2f} us")
    for name, fn in calls.items():
        _cprofile(name, fn, echo)
