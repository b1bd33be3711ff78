"""What the comparisons need of the peers, imported only when a peer is asked for: torch
(and its fp8 dtypes and streams), FlashInfer (its page lists, its workspace), FlashMLA
(its Hopper sparse kernels, where a build of it imports), and the out-of-memory errors of
either."""

from __future__ import annotations

import contextlib

import cupy
import numpy as np



def oom_errors():
    errs = [cupy.cuda.memory.OutOfMemoryError]
    torch = import_torch()
    if torch is not None:
        errs.append(torch.OutOfMemoryError)
    return tuple(errs)


def free_memory():
    cupy.get_default_memory_pool().free_all_blocks()
    torch = import_torch()
    if torch is not None:
        torch.cuda.empty_cache()


def import_torch():
    """torch, if importable and it sees a GPU; never required."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def torch_fp8_dtype(kv_cache_dtype: str):
    """torch's float8 type of an fp8 format ("fp8_e4m3" or "fp8_e5m2")."""
    torch = import_torch()
    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]


def torch_on_cupy_stream():
    """Make torch's current stream CuPy's current one, where time_us records its events
    and the checks read, so the torch and FlashInfer rows (which run on torch's current
    stream) are timed where they run. Nothing to do in the usual case: both default to
    the legacy default stream."""
    torch = import_torch()
    ptr = cupy.cuda.get_current_stream().ptr
    if torch is None or torch.cuda.current_stream().cuda_stream == ptr:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(ptr))


FLASHINFER_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended size, zeroed before first use


def flashinfer_unavailable() -> str | None:
    """Why the FlashInfer rows cannot run here (one line), or None when they can:
    ``flashinfer`` must import and torch must see a GPU."""
    return import_flashinfer()[1]


def _import_peer(name: str):
    """``(module, None)``, or ``(None, why)``: a peer's top-level package, which needs torch
    seeing a GPU too."""
    try:
        module = __import__(name)  # (builtins' import: tests can make it fail)
    except ImportError as e:  # not installed, or a dependency of it missing
        return None, str(e) if e.name == name else f"import {name}: {e}"
    except Exception as e:  # a broken install can fail at import in other ways
        return None, " ".join(f"{type(e).__name__}: {e}".split())[:200]
    if import_torch() is None:
        return None, "torch sees no CUDA device"
    return module, None


def _required(name: str, imported: tuple):
    """The module of an import_* answer, or RuntimeError saying why there is none."""
    module, why = imported
    if module is None:
        raise RuntimeError(f"{name} unavailable: {why}")
    return module


def import_flashinfer():
    """``(flashinfer, None)``, or ``(None, why)``."""
    return _import_peer("flashinfer")


def require_flashinfer():
    return _required("flashinfer", import_flashinfer())


def import_flashmla():
    """``(flash_mla, None)``, or ``(None, why)``: FlashMLA's Python package, built for
    sm_90a (tools/device_env.sh's flashmla_setup builds it on the GPU machine)."""
    return _import_peer("flash_mla")


def require_flashmla():
    return _required("flash_mla", import_flashmla())


def flashinfer_pages(block_tables, context_lens, block_size: int):
    """Block tables and lengths as FlashInfer's page lists (NumPy in, NumPy out):
    ``indptr`` int32 ``[S + 1]`` (sequence s owns ``indices[indptr[s]:indptr[s + 1]]``),
    ``indices`` int32 (each sequence's first ``ceil(len / block_size)`` block ids, in
    order) and ``last_page_len`` int32 ``[S]``, the tokens in each sequence's last page,
    ``1..block_size``. A length-0 sequence gets no pages and ``last_page_len`` 0:
    FlashInfer documents ``1 <= last_page_len <= page_size``, but both its
    ``get_seq_lens`` and its kernels (``paged_kv_t::get_length``: no pages, length 0)
    take that as an empty sequence."""
    bt = np.asarray(block_tables)
    lens = np.asarray(context_lens, dtype=np.int64)
    if bt.ndim != 2 or lens.shape != (bt.shape[0],):
        raise ValueError(f"expected block_tables [S, max_blocks] and context_lens [S], got "
                         f"{bt.shape} and {lens.shape}")
    if (lens < 0).any():
        raise ValueError("context_lens must be non-negative")
    pages = -(-lens // block_size)
    if pages.max(initial=0) > bt.shape[1]:
        raise ValueError(f"block_tables has {bt.shape[1]} columns, a sequence needs "
                         f"{int(pages.max())} blocks of {block_size}")
    indptr = np.zeros(len(lens) + 1, np.int32)
    indptr[1:] = np.cumsum(pages)
    indices = bt[np.arange(bt.shape[1])[None, :] < pages[:, None]].astype(np.int32)
    last_page_len = np.where(pages > 0, lens - (pages - 1) * block_size, 0).astype(np.int32)
    return indptr, indices, last_page_len


def flashinfer_ok() -> bool:
    return import_flashinfer()[0] is not None


def require_hopper(impl: str) -> None:
    """A runner that forces a Hopper (wgmma) kernel refuses other GPUs, whose planner would
    quietly run another kernel under its name."""
    from .. import planning

    arch = planning.device_info(cupy.cuda.Device().id).arch
    if arch != "sm_90":
        raise NotImplementedError(f"{impl} forces Hopper's wgmma kernel, which needs an sm_90 "
                                  f"GPU: this one is {arch}")
