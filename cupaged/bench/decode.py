"""``cupaged-bench decode`` and ``compare``: cupaged and the implementations users run
today (CuPy and torch gathers, torch SDPA, FlashInfer's decode wrappers and XQA) on the
same data, each checked against the float64 reference before it is timed."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import cupy
import numpy as np

from .. import _dtypes
from . import peers, timing, workloads


# Peers with no fp8 cache path: they would time a dequantizing copy, not attention.
_NO_FP8 = ("cupy-gather", "torch-sdpa-paged", "torch-sdpa-dense")


def fp8_unsupported(impl: str, kv_cache_dtype: str = "auto") -> str | None:
    """Why ``impl`` cannot run over a ``kv_cache_dtype`` cache (one line), or None."""
    kv = workloads.kv_cache_dtype_name(kv_cache_dtype)
    if kv == "auto":
        return None
    if impl in _NO_FP8:
        return f"{impl} has no fp8 cache path (it gathers 16-bit pages)"
    if impl == "flashinfer-xqa" and kv != "fp8_e4m3":
        return "FlashInfer's XQA takes fp8 e4m3 caches only"
    return None


# The peers run with some variants, and the arguments those go to; every other peer (the
# gather baselines, torch SDPA) runs plain softmax attention only.
_PEER_VARIANTS = {
    "flashinfer-decode": {"window": "window_left", "soft_cap": "logits_soft_cap"},
    "flashinfer-decode-tc": {"window": "window_left", "soft_cap": "logits_soft_cap"},
    "flashinfer-xqa": {"window": "window_left", "sinks": "sinks"},
}


_VARIANT_LABELS = {"window": "window", "soft_cap": "soft-cap", "sinks": "sinks", "alibi": "ALiBi"}


def variant_unsupported(impl: str, variants: workloads.Variants = workloads.PLAIN) -> str | None:
    """Why ``impl`` cannot run ``variants`` (one line), or None. cupaged runs them all;
    FlashInfer's decode wrappers get a window (``window_left = W - 1``) and a soft cap
    through plan(), its XQA kernel a window and sinks; their other variant paths are not
    wired up here."""
    if impl.startswith("cupaged"):
        return None
    return peer_refusal(impl, _PEER_VARIANTS.get(impl), variants)


def peer_refusal(impl: str, takes: dict | None, variants: workloads.Variants) -> str | None:
    """Why peer ``impl``, run with the variants ``takes`` maps to its arguments (None: it
    runs plain attention only), cannot run ``variants`` (one line), or None."""
    if variants.plain:
        return None
    if takes is None:
        return f"{impl} runs plain attention only (asked for: {variants.label()})"
    asked = {k for k, v in variants.fields().items() if v not in (None, False)}
    missing = [label for k, label in _VARIANT_LABELS.items() if k in asked and k not in takes]
    if missing:
        return (f"{impl} is run with {' and '.join(takes.values())} only, not "
                f"{' or '.join(missing)}")
    return None


def unsupported(impl: str, kv_cache_dtype: str = "auto", variants: workloads.Variants = workloads.PLAIN) -> str | None:
    """Why ``impl`` cannot run over this cache with these variants, or None."""
    return fp8_unsupported(impl, kv_cache_dtype) or variant_unsupported(impl, variants)


def _require_supported(case: "workloads.DecodeCase", impl: str) -> None:
    why = unsupported(impl, case.kv_cache_dtype, case.variants)
    if why:
        raise NotImplementedError(why)


def run_cupaged(case: "workloads.DecodeCase", partition):
    out = cupy.empty(case.arrays["query"].shape, case.arrays["query"].dtype)
    return lambda: case.run(out, partition)


def cache_in_layout(key_cache, value_cache, layout: str):
    """Contiguous copies of vLLM-layout caches ([blocks, kv_heads, hs/x, bs, x] and
    [blocks, kv_heads, hs, bs]) in ``layout``: "NHD", "HND", or "vllm" (themselves)."""
    if layout == "vllm":
        return key_cache, value_cache
    k, v = key_cache, value_cache
    nb, kvh, _, bs, _ = k.shape
    if layout == "NHD":
        k = k.transpose(0, 3, 1, 2, 4).reshape(nb, bs, kvh, -1)
        v = v.transpose(0, 3, 1, 2)
    else:
        k = k.transpose(0, 1, 3, 2, 4).reshape(nb, kvh, bs, -1)
        v = v.transpose(0, 1, 3, 2)
    return cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)


def _run_cupaged_layout(case: "workloads.DecodeCase", partition, layout: str):
    """cupaged.attention (decode: no query_start_loc) on a copy of the case's cache in
    ``layout`` ("NHD" or "HND"), made once outside timing."""
    from ..attention import attention

    a = case.arrays
    k, v = cache_in_layout(a["key_cache"], a["value_cache"], layout)
    out = cupy.empty(a["query"].shape, a["query"].dtype)
    max_len = int(case.context_lens.max(initial=0))
    return lambda: attention(a["query"], k, v, a["block_tables"], a["context_lens"],
                             kv_layout=layout, max_seq_len=max_len, out=out, **case.kv_args,
                             **case.variant_args)


def _gather_dense(case: "workloads.DecodeCase"):
    """Index arrays for gathering each sequence's pages into [S, kv_heads, T, hs] (block
    ids past a sequence's end replaced by 0 so every gather stays inside the cache)."""
    a = case.arrays
    nb = a["block_tables"].shape[1]
    valid = cupy.arange(nb)[None, :] < cupy.asarray(-(-case.context_lens // case.block_size))[:, None]
    return cupy.where(valid, a["block_tables"], 0), nb * case.block_size


def _run_cupy_gather(case: "workloads.DecodeCase", partition):
    """What a user writes by hand: gather the pages, then matmul / softmax / matmul."""
    _require_supported(case, "cupy-gather")
    a = case.arrays
    s, h, hs = a["query"].shape
    kvh, g = case.kv_heads, case.heads // case.kv_heads
    bt, t = _gather_dense(case)
    mask = (cupy.arange(t)[None, :] < a["context_lens"][:, None])[:, None, None, :]
    compute = np.float32 if case.dtype == _dtypes.BF16.numpy else case.dtype
    scale = 1.0 / math.sqrt(hs)

    def run():
        k = a["key_cache"][bt].transpose(0, 2, 1, 4, 3, 5).reshape(s, kvh, t, hs).astype(compute)
        v = a["value_cache"][bt].transpose(0, 2, 1, 4, 3).reshape(s, kvh, t, hs).astype(compute)
        q = a["query"].reshape(s, kvh, g, hs).astype(compute)
        logits = cupy.matmul(q, k.transpose(0, 1, 3, 2)).astype(np.float32) * scale
        logits = cupy.where(mask, logits, -cupy.inf)
        logits -= logits.max(axis=-1, keepdims=True)
        p = cupy.exp(logits)
        p /= p.sum(axis=-1, keepdims=True)
        return cupy.matmul(p.astype(compute), v).reshape(s, h, hs).astype(case.dtype)

    return run


def _torch_inputs(case: "workloads.DecodeCase"):
    torch = peers.import_torch()
    a = case.arrays
    s, h, hs = a["query"].shape
    bt, t = _gather_dense(case)
    lens = torch.from_dlpack(a["context_lens"])
    mask = None
    if int(case.context_lens.min()) != t:  # padded keys must be masked out
        mask = (torch.arange(t, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]
    q = torch.from_dlpack(a["query"]).reshape(s, h, 1, hs)
    return torch, q, torch.from_dlpack(bt).long(), t, mask


def to_hnd(key, value):
    """vLLM-layout pages as views in FlashInfer's "HND" order (no copy; NumPy, CuPy or
    torch): key ``[..., kv_heads, head_size // x, block_size, x]`` ->
    ``[..., kv_heads, block_size, head_size // x, x]`` (its last two dims then reshape to
    head_size, which copies), value ``[..., kv_heads, head_size, block_size]`` ->
    ``[..., kv_heads, block_size, head_size]``."""
    return key.swapaxes(-3, -2), value.swapaxes(-2, -1)


def _torch_gather(case, torch, bt, t):
    """Each sequence's pages gathered into K and V ``[S, kv_heads, T, head_size]``."""
    a = case.arrays
    s, kvh, hs = case.batch, case.kv_heads, case.head_size
    k, v = to_hnd(torch.from_dlpack(a["key_cache"])[bt], torch.from_dlpack(a["value_cache"])[bt])
    # [S, pages, kv_heads, block_size, ...] -> [S, kv_heads, pages * block_size, head_size]
    return k.swapaxes(1, 2).reshape(s, kvh, t, hs), v.swapaxes(1, 2).reshape(s, kvh, t, hs)


def _run_torch_paged(case: "workloads.DecodeCase", partition):
    """torch SDPA after gathering the pages (paging handled by indexing)."""
    _require_supported(case, "torch-sdpa-paged")
    torch, q, bt, t, mask = _torch_inputs(case)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        k, v = _torch_gather(case, torch, bt, t)
        o = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        return cupy.from_dlpack(o.reshape(case.batch, case.heads, case.head_size))

    return run


def _run_torch_dense(case: "workloads.DecodeCase", partition):
    """torch SDPA over contiguous K/V built beforehand: no paging at all."""
    _require_supported(case, "torch-sdpa-dense")
    torch, q, bt, t, mask = _torch_inputs(case)
    k, v = (x.contiguous() for x in _torch_gather(case, torch, bt, t))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        o = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        return cupy.from_dlpack(o.reshape(case.batch, case.heads, case.head_size))

    return run


@dataclass
class _FlashInferInputs:
    """One case's data as FlashInfer takes it, built once outside timing."""

    q: object  # torch view of the case's query [S, heads, head_size]
    out: object  # [S, heads, head_size], NaN until a kernel writes it
    out_cupy: object  # the same memory as a CuPy array, for workloads.DecodeCase.check
    k: object  # "HND" copy of the key cache [num_blocks, kv_heads, block_size, head_size]
    v: object  # "HND" copy of the value cache, same shape
    # plan()'s page lists (peers.flashinfer_pages), where vLLM keeps them: indptr and
    # last_page_len in pinned host memory, indices on the device
    indptr: object
    indices: object
    last_page_len: object
    block_tables: object  # XQA's: int32 [S, max_blocks], ids past a sequence's end 0
    seq_lens: object  # XQA's: int32 [S] on the device (the case's context_lens)
    workspace: object  # zeroed uint8, both kernels' scratch
    scale: float  # 1 / sqrt(head_size), cupaged's and the reference's default
    kv_scales: dict  # the decode wrappers' run() k_scale / v_scale (none for 16 bits)


def _flashinfer_inputs(case: "workloads.DecodeCase") -> _FlashInferInputs:
    """The case's query, lengths and tables viewed as torch tensors, its caches copied
    into FlashInfer's "HND" layout (an out-of-memory here skips the row; fp8 bytes viewed
    as torch's float8 type of the format), and its block tables as FlashInfer's page
    lists. The output is poisoned with NaN, so a kernel that writes nothing fails the
    check instead of finding an earlier row's result."""
    torch = peers.import_torch()
    a = case.arrays
    q = torch.from_dlpack(a["query"])
    k, v = to_hnd(torch.from_dlpack(a["key_cache"]), torch.from_dlpack(a["value_cache"]))
    k, v = k.contiguous().view(v.shape), v.contiguous()
    kv_scales = {}
    if case.fp8:
        k, v = (x.view(peers.torch_fp8_dtype(case.kv_cache_dtype)) for x in (k, v))
        kv_scales = dict(k_scale=case.k_scale, v_scale=case.v_scale)
    indptr, indices, last = peers.flashinfer_pages(cupy.asnumpy(a["block_tables"]), case.context_lens,
                                              case.block_size)
    tables, _ = _gather_dense(case)
    out = torch.full_like(q, float("nan"))
    return _FlashInferInputs(
        q=q, out=out, out_cupy=cupy.from_dlpack(out), k=k, v=v,
        indptr=torch.from_numpy(indptr).pin_memory(),
        indices=torch.from_numpy(indices).to(q.device),
        last_page_len=torch.from_numpy(last).pin_memory(),
        block_tables=torch.from_dlpack(cupy.ascontiguousarray(tables, dtype=np.int32)),
        seq_lens=torch.from_dlpack(a["context_lens"]),
        workspace=torch.zeros(peers.FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device),
        scale=1.0 / math.sqrt(case.head_size), kv_scales=kv_scales)


def _plan_host_us(plan, calls: int = 5) -> float:
    """Median host microseconds of ``plan()`` over ``calls`` calls, each after a device
    sync. A first call beforehand builds FlashInfer's module (nvcc, on first use) or
    loads it, outside every timing."""
    import time

    torch = peers.import_torch()
    plan()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return float(np.median(times)) * 1e6


def _run_flashinfer_decode(case: "workloads.DecodeCase", partition, tensor_cores: bool = False):
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper on "HND" caches, on CUDA cores or
    tensor cores. plan() runs once per workload, as once per step for all layers in a
    model; its host time is the runner's ``plan_us``. The timed call is run() (over fp8,
    with k_scale and v_scale: FlashInfer folds k_scale into the softmax scale and
    multiplies the output by v_scale in a launch of its own, timed as part of run()).
    A window goes to plan() as ``window_left = W - 1``, a soft cap as ``logits_soft_cap``;
    sinks and ALiBi are refused (variant_unsupported)."""
    flashinfer = peers.require_flashinfer()
    _require_supported(case, "flashinfer-decode-tc" if tensor_cores else "flashinfer-decode")
    fi = _flashinfer_inputs(case)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(fi.workspace, "HND",
                                                           use_tensor_cores=tensor_cores)
    variants = {}
    if case.variants.window is not None:
        variants["window_left"] = case.variants.window - 1
    if case.variants.soft_cap is not None:
        variants["logits_soft_cap"] = case.variants.soft_cap

    def plan():
        wrapper.plan(fi.indptr, fi.indices, fi.last_page_len, case.heads, case.kv_heads,
                     case.head_size, case.block_size, pos_encoding_mode="NONE",
                     q_data_type=fi.q.dtype, kv_data_type=fi.k.dtype, sm_scale=fi.scale,
                     **variants)

    plan_us = _plan_host_us(plan)

    def run():
        wrapper.run(fi.q, (fi.k, fi.v), out=fi.out, **fi.kv_scales)
        return fi.out_cupy

    run.plan_us = plan_us
    return run


# XQA over fp8 rounds its operands to e4m3 (unit roundoff 2^-4): twice that, which still
# catches a wrong scale or layout (errors of order 1).
_XQA_FP8_TOL = 2.0 ** -3


def run_flashinfer_xqa(case: "workloads.DecodeCase", partition):
    """FlashInfer's plan-free XQA decode (TensorRT-LLM's kernel, what FlashInfer's
    trtllm_batch_decode_with_kv_cache runs on SM90) on "HND" caches and the block table.
    Its lengths are the case's int32 context_lens: XQA reads them as uint32 (equal for
    non-negative values), as vLLM and SGLang pass them. Over an fp8 cache (e4m3 only) the
    scales go where vLLM puts them, k_scale into bmm1_scale and v_scale as bmm2_scale, and
    XQA computes in fp8 ("xqa will run fp8 calculation": on an H100, 4e-2 from the
    reference), so its row is checked against e4m3's precision instead (_XQA_FP8_TOL).
    A window goes to it as ``window_left = W - 1``, sinks (float32 ``[num_heads]``, the
    gpt-oss convention, as cupaged's) as ``sinks``; soft-cap and ALiBi are refused."""
    flashinfer = peers.require_flashinfer()
    xqa = getattr(getattr(flashinfer, "decode", None), "xqa_batch_decode_with_kv_cache", None)
    if xqa is None:
        raise NotImplementedError(f"flashinfer {getattr(flashinfer, '__version__', '?')} has "
                                  "no flashinfer.decode.xqa_batch_decode_with_kv_cache")
    _require_supported(case, "flashinfer-xqa")
    fi = _flashinfer_inputs(case)
    max_len = int(case.context_lens.max(initial=0))
    kw = dict(bmm1_scale=fi.scale)
    if case.fp8:
        kw = dict(bmm1_scale=fi.scale * case.k_scale, bmm2_scale=case.v_scale)
    if case.variants.window is not None:
        kw["window_left"] = case.variants.window - 1
    if case.variants.sinks:
        torch = peers.import_torch()
        kw["sinks"] = torch.as_tensor(workloads.sink_values(case.heads), device=fi.q.device)

    def run():
        xqa(fi.q, (fi.k, fi.v), fi.workspace, fi.block_tables, fi.seq_lens, max_len,
            kv_layout="HND", out=fi.out, **kw)
        return fi.out_cupy

    if case.fp8:
        run.tolerance = _XQA_FP8_TOL
        run.note = f"computes in fp8 e4m3: checked against {_XQA_FP8_TOL:g}, not {case.tolerance():g}"
    return run


# name -> (runner factory, available?). A factory takes (case, partition) and returns
# run(): device work on the current stream, returning the output as a CuPy array; it may
# carry a ``plan_us`` attribute (host time of a separate planning step), and a
# ``tolerance`` (instead of the case's) with a ``note`` saying why.
IMPLEMENTATIONS = {
    "cupaged": (run_cupaged, lambda: True),
    "cupaged-nhd": (functools.partial(_run_cupaged_layout, layout="NHD"), lambda: True),
    "cupaged-hnd": (functools.partial(_run_cupaged_layout, layout="HND"), lambda: True),
    "cupy-gather": (_run_cupy_gather, lambda: True),
    "torch-sdpa-paged": (_run_torch_paged, lambda: peers.import_torch() is not None),
    "torch-sdpa-dense": (_run_torch_dense, lambda: peers.import_torch() is not None),
    "flashinfer-decode": (_run_flashinfer_decode, peers.flashinfer_ok),
    "flashinfer-decode-tc": (functools.partial(_run_flashinfer_decode, tensor_cores=True),
                             peers.flashinfer_ok),
    "flashinfer-xqa": (run_flashinfer_xqa, peers.flashinfer_ok),
}


FLASHINFER_IMPLS = tuple(n for n in IMPLEMENTATIONS if n.startswith("flashinfer-"))


def available_implementations(kv_cache_dtype: str = "auto", variants: workloads.Variants = workloads.PLAIN) -> list:
    """The implementations that can run here, over a ``kv_cache_dtype`` cache, with
    ``variants``."""
    return [name for name, (_, ok) in IMPLEMENTATIONS.items()
            if not unsupported(name, kv_cache_dtype, variants) and ok()]


def measure(workload: workloads.Workload, impls, partition="auto", reps: int = 30, seed: int = 0,
            copy_bw: float = float("nan")) -> list:
    """Build the workload once, then check and time each implementation on the same data.
    A failed check is reported, never timed; an implementation that runs out of memory is
    reported as skipped."""
    rows = []
    base = dict(preset=workload.preset, batch=workload.batch, context=workload.context_label,
                heads=workload.heads, kv_heads=workload.kv_heads, head_size=workload.head_size,
                block_size=workload.block_size, dtype=workload.dtype, partition=str(partition),
                kv_cache_dtype=workload.kv_cache_dtype, **workload.variants.fields())
    try:
        case = workload.case(seed).build()
    except peers.oom_errors():
        peers.free_memory()
        return [workloads.Result(i, "", mean_context=float("nan"), status="skipped",
                       note="the cache does not fit in GPU memory", **base) for i in impls]
    kernel = case.spec_name()
    mean_ctx = float(case.context_lens.mean()) if case.batch else 0.0
    cupaged_us = float("nan")
    with peers.torch_on_cupy_stream():
        for impl in impls:
            row = workloads.Result(impl, kernel if impl == "cupaged" else "", mean_context=mean_ctx,
                         status="ok", **base)
            try:
                run = IMPLEMENTATIONS[impl][0](case, partition)
                row.plan_us = getattr(run, "plan_us", float("nan"))
                row.note = getattr(run, "note", "")
                tol = getattr(run, "tolerance", case.tolerance())
                out = run()
                row.rel_err = case.check(out)
                if not row.rel_err <= tol:
                    row.status = "failed"
                    row.note = f"rel err {row.rel_err:.2e} > {tol:.0e}"
                else:
                    t = timing.time_us(run, reps=reps)
                    row.median_us, row.p10_us, row.p90_us = t.median_us, t.p10_us, t.p90_us
                    row.gbps = case.bytes_moved / (t.median_us * 1e-6) / 1e9
                    row.pct_copy = 100 * row.gbps * 1e9 / copy_bw
                    if impl == "cupaged":
                        cupaged_us = t.median_us
                    row.ratio_to_cupaged = t.median_us / cupaged_us
            except peers.oom_errors():
                row.status, row.note = "skipped", "out of GPU memory"
            except Exception as e:  # a peer that cannot run this case is skipped, cupaged is not
                if impl == "cupaged":
                    raise
                # one line: compiler errors (FlashInfer's nvcc) span many
                row.status, row.note = "skipped", " ".join(f"{type(e).__name__}: {e}".split())[:200]
            run = out = None  # the row's buffers (FlashInfer's cache copies) go, failed or not
            peers.free_memory()
            rows.append(row)
    case.arrays.clear()
    peers.free_memory()
    return rows
