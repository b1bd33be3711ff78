"""``cupaged-bench sparse-mla``: DeepSeek's sparse attention (DSA) over a paged latent
cache, cupaged.sparse_mla_attention in FlashMLA's decode and prefill interfaces, each
case checked against the float64 reference (cupaged.reference.sparse_mla_attention) on
a few query tokens before it is timed.

Decode: ``batch`` sequences of ``context`` cached tokens, each with its own blocks of
``block_size`` scattered over the cache; each of a sequence's ``s_q`` query tokens selects
``topk`` distinct slots among that sequence's tokens (uniformly at random, as a top-k over
random scores would). The cache is 16-bit (q's dtype), DeepSeek-V3.2's fp8_ds_mla rows, or
DeepSeek-V4's v4_fp8 / v4_fp4 rows (q and keys of 512 dims, the rotary ones inside),
the rows written by cupaged.concat_and_cache_mla. Prefill: ``s_q`` query tokens over
``context`` tokens of one sequence (``kv [s_kv, 1, 576]``, or a token's row: 656 bytes for
fp8_ds_mla, 528 for v4_fp8, 288 for v4_fp4; s_kv the context rounded up to whole pages),
each selecting ``topk`` of them. (V4's rows run in V3.2's shapes: the heads, top-k and
pages of the presets.) With ``extra_topk``, a decode case also reads a second cache of the
same format (DeepSeek-V4's ``extra_k_cache``): each sequence has ``extra_context`` tokens
in blocks of its own there, and each query token selects ``extra_topk`` of them too.

Roofline numbers: bytes are the tokens the indices select, counted per query token (576
values, or the row's bytes), plus q and out; FLOPs are ``2 * (d_qk + 512)`` per (query
head, selected token), d_qk 576 (V3.2) or 512 (V4)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import cupy
import numpy as np

from .. import _dtypes, reference, testing
from . import mla, peers, workloads

__all__ = ["IMPLEMENTATIONS", "KV_CACHE_DTYPES", "PRESETS", "SparseCase", "measure"]

D_QK = mla.KV_LORA_RANK + mla.ROPE_DIM
# The caches (--kv-cache-dtype): bfloat16, then the token row formats
KV_CACHE_DTYPES = ("auto", *_dtypes.SPARSE_KV_CACHE_DTYPES)
# The default rows: DeepSeek-V3.2's caches (V4's are asked for by name)
DEFAULT_KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")
ROW_SUFFIX = {"fp8_ds_mla": "/ds", "v4_fp8": "/v4fp8", "v4_fp4": "/v4fp4"}

# DeepSeek-V3.2 (top-k 2048), pages of 64: FlashMLA's sparse decode and prefill shapes.
PRESETS = {
    "dsa-16h": dict(heads=16, batch=128, s_q=1, context=32768),
    "dsa-64h": dict(heads=64, batch=128, s_q=1, context=32768),
    "dsa-128h-q2": dict(heads=128, batch=128, s_q=2, context=32768),
    "dsa-prefill-128h": dict(heads=128, batch=1, s_q=4096, context=32768, prefill=True),
}


@dataclass
class SparseCase:
    name: str
    heads: int = 128
    batch: int = 128
    s_q: int = 1
    topk: int = 2048
    context: int = 8192
    block_size: int = 64
    kv_cache_dtype: str = "auto"
    prefill: bool = False
    extra_topk: int = 0  # a second cache's selected tokens a query token (0: none)
    extra_context: int = 0  # its tokens a sequence (0: context)
    scale: float = mla.DSV3_SCALE
    arrays: dict = field(default_factory=dict, repr=False)
    host_indices: np.ndarray | None = field(default=None, repr=False)
    host_extra_indices: np.ndarray | None = field(default=None, repr=False)
    refs: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        workloads.require_positive(self, "heads", "batch", "s_q", "topk", "context",
                                   "block_size")
        if self.topk > self.context:
            raise ValueError(f"topk ({self.topk}) must be at most context ({self.context}): "
                             f"distinct tokens")
        if self.extra_topk < 0 or self.extra_context < 0:
            raise ValueError("extra_topk and extra_context must be nonnegative")
        if self.extra_topk:
            if self.prefill:
                raise ValueError("a second cache is read by decode cases (DeepSeek-V4's "
                                 "extra_k_cache), not by a prefill case")
            self.extra_context = self.extra_context or self.context
            if self.extra_topk > self.extra_context:
                raise ValueError(f"extra_topk ({self.extra_topk}) must be at most "
                                 f"extra_context ({self.extra_context}): distinct tokens")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.prefill and self.batch != 1:
            raise ValueError("a prefill case is one sequence (batch 1)")

    @property
    def row_format(self) -> _dtypes.SparseFormat | None:
        """The cache's token row format, None for bfloat16."""
        return _dtypes.SPARSE_KV_CACHE_DTYPES.get(self.kv_cache_dtype)

    @property
    def d_qk(self) -> int:  # q's and a key's dims
        return D_QK if self.row_format is None else self.row_format.values

    @property
    def rows(self) -> int:  # query tokens
        return self.batch * self.s_q

    def token_bytes(self) -> int:
        return 2 * D_QK if self.row_format is None else self.row_format.nbytes

    @property
    def selected(self) -> int:  # tokens a query token attends to, both caches'
        return self.topk + self.extra_topk

    def bytes_moved(self) -> int:
        """The selected tokens (per query token) plus q read and out written."""
        return (self.rows * self.selected * self.token_bytes()
                + self.rows * self.heads * 2 * (self.d_qk + mla.KV_LORA_RANK))

    def flops(self) -> float:
        return 2.0 * self.rows * self.heads * self.selected * (self.d_qk + mla.KV_LORA_RANK)

    def describe(self) -> str:
        what = (f"prefill, {self.s_q} query tokens over {self.context}" if self.prefill else
                f"decode, batch {self.batch} x {self.s_q} query token"
                f"{'s' if self.s_q > 1 else ''}, contexts of {self.context}, pages of "
                f"{self.block_size}")
        second = (f" + top-{self.extra_topk} of a second cache ({self.extra_context} tokens "
                  f"a sequence)" if self.extra_topk else "")
        return (f"{self.name}: {self.heads} heads, top-{self.topk}{second}, {what}, bfloat16 "
                f"q, {'bfloat16' if self.row_format is None else self.kv_cache_dtype} cache: "
                f"{self.rows * self.selected * self.token_bytes() / 2**20:.1f} MiB selected")

    def _paged(self, rng, context: int, topk: int):
        """A cache of ``context`` tokens a sequence, each sequence's blocks scattered over
        it, and ``topk`` distinct slots of its own tokens a query token: (cache
        [num_blocks, page, width] on the device, host indices [batch, s_q, topk])."""
        import cupaged

        dt = _dtypes.BF16.numpy
        page = self.block_size
        per_seq = -(-context // page)
        nb = self.batch * per_seq
        order = rng.permutation(nb).reshape(self.batch, per_seq)  # each sequence's blocks
        # slots: a sequence's token t lives at block order[b, t // page], offset t % page
        idx = np.empty((self.batch, self.s_q, topk), np.int32)
        for b in range(self.batch):
            for s in range(self.s_q):
                t = rng.choice(context, topk, replace=False)
                idx[b, s] = order[b, t // page] * page + t % page
        d, fmt = self.d_qk, self.row_format
        width = D_QK if fmt is None else fmt.nbytes
        cache = cupy.empty((nb, page, width), dt if fmt is None else np.uint8)
        step = max(1, (1 << 16) // page)  # blocks a write: 65,536 tokens of source at a time
        for lo in range(0, nb, step):
            n = min(step, nb - lo)
            src = testing.random_normal((n * page, d), dt, rng, cupy)
            if fmt is None:
                cache[lo:lo + n] = src.reshape(n, page, D_QK)
            else:  # kv_c then 64 rotary values (V4's split of its 512)
                cupaged.concat_and_cache_mla(src[:, :d - mla.ROPE_DIM], src[:, d - mla.ROPE_DIM:],
                                             cache, cupy.arange(lo * page, (lo + n) * page),
                                             self.kv_cache_dtype)
        return cache, idx

    def build(self, seed: int = 0) -> "SparseCase":
        rng = np.random.default_rng(seed)
        cache, idx = self._paged(rng, self.context, self.topk)
        width = cache.shape[-1]
        q = testing.random_normal((self.batch, self.s_q, self.heads, self.d_qk),
                                  _dtypes.BF16.numpy, rng, cupy)
        self.host_indices = idx
        self.refs = []
        if self.prefill:  # q [s_q, heads, 576] over kv [s_kv, 1, width] (the blocks in a row:
            # an index is a token's place there), indices [s_q, 1, topk]
            self.arrays = dict(q=q[0], kv=cache.reshape(-1, 1, width),
                               indices=cupy.asarray(idx[0][:, None]))
        else:
            self.arrays = dict(q=q, kv=cache[:, :, None], indices=cupy.asarray(idx))
        if self.extra_topk:
            extra, eidx = self._paged(rng, self.extra_context, self.extra_topk)
            self.host_extra_indices = eidx
            self.arrays.update(extra_kv=extra[:, :, None], extra_indices=cupy.asarray(eidx))
        return self

    def check_tokens(self) -> list:
        """(batch entry, query token) pairs checked: the first, a middle and the last."""
        n = self.rows
        return [divmod(r, self.s_q) for r in sorted({0, n // 2, n - 1})]

    def _references(self) -> list:
        """(b, s, float64 out [heads, 512]) of check_tokens, each over a cache of its own
        selected tokens (copied to the host, page size 1)."""
        if not self.refs:
            kv = self.arrays["kv"].reshape(-1, self.arrays["kv"].shape[-1])
            q = self.arrays["q"].reshape(self.batch, self.s_q, self.heads, self.d_qk)
            extra = self.arrays.get("extra_kv")
            for b, s in self.check_tokens():
                # the selected tokens of both caches as one cache (a second cache's entries
                # join the same softmax)
                rows = [cupy.asnumpy(kv[cupy.asarray(self.host_indices[b, s])])]
                if extra is not None:
                    ekv = extra.reshape(-1, extra.shape[-1])
                    rows.append(cupy.asnumpy(ekv[cupy.asarray(self.host_extra_indices[b, s])]))
                tokens = np.concatenate(rows)[:, None]  # (distinct: no repeated index)
                local = np.arange(tokens.shape[0])
                out = reference.sparse_mla_attention(
                    cupy.asnumpy(q[b, s])[None, None], tokens,
                    local.astype(np.int32)[None, None], scale=self.scale,
                    kv_format="auto" if self.row_format is None else self.kv_cache_dtype)
                self.refs.append((b, s, out[0, 0]))
        return self.refs

    def check(self, out) -> float:
        """Max relative error over each head of the checked query tokens (NaN: inf)."""
        out = out.reshape(self.batch, self.s_q, self.heads, mla.KV_LORA_RANK)
        worst = 0.0
        for b, s, ref in self._references():
            got = cupy.asnumpy(out[b, s]).astype(np.float64)
            err = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
            worst = max(worst, float(np.nan_to_num(err, nan=np.inf).max()))
        return worst

    def tolerance(self) -> float:
        return testing.ROW_FACTOR * testing.TOLERANCE["bf16"]


def preset_case(name: str, kv_cache_dtype: str = "auto", topk: int = 2048,
                extra_topk: int = 0, batch: int | None = None) -> SparseCase:
    """A preset's case; ``batch``: another number of sequences for a decode preset, its
    name then ending in -b<batch>."""
    shape = dict(PRESETS[name])
    if batch is not None:
        if shape.get("prefill"):
            raise ValueError(f"--batch sets a decode preset's sequences; {name} is a prefill "
                             f"(one sequence of {shape['s_q']} query tokens)")
        shape["batch"] = batch
        name = f"{name}-b{batch}"
    return SparseCase(name, kv_cache_dtype=kv_cache_dtype, topk=topk, extra_topk=extra_topk,
                      **shape)


def _run_cupaged(case: SparseCase, family: str | None = None):
    """cupaged.sparse_mla_attention; ``family`` as :func:`.mla.force_family`'s."""
    import cupaged

    mla.force_family(family)
    a = case.arrays
    out = cupy.full(a["q"].shape[:-1] + (mla.KV_LORA_RANK,), np.nan, a["q"].dtype)

    extra = ({} if not case.extra_topk else
             dict(extra_kv_cache=a["extra_kv"], extra_indices=a["extra_indices"]))

    def run():
        cupaged.sparse_mla_attention(a["q"], a["kv"], a["indices"], scale=case.scale, out=out,
                                     **extra)
        return out

    return run


def _run_flashmla(case: SparseCase):
    """FlashMLA's Hopper sparse kernels over the case's own arrays (torch views of them,
    so both libraries read the same bytes): decode over fp8_ds_mla rows (its V3.2 fp8
    cache: the same 656-byte layout) through ``flash_mla_with_kvcache(.., indices=..)``,
    its tile-scheduler metadata filled by a first, untimed call; prefill over bfloat16 kv
    through ``flash_mla_sparse_fwd``. What FlashMLA's Hopper kernels take: 64 or 128
    heads, no second cache, top-k a multiple of 64 (decode) or 128 (prefill); other cases
    raise (their rows' notes say why). Each call returns a new output, as FlashMLA's API
    allocates one."""
    flash_mla = peers.require_flashmla()
    torch = peers.import_torch()
    if case.extra_topk:
        raise NotImplementedError("FlashMLA's Hopper kernels take no second cache")
    if case.heads not in (64, 128):
        raise NotImplementedError(f"FlashMLA's Hopper sparse kernels take 64 or 128 heads, "
                                  f"not {case.heads}")
    a = case.arrays
    q, idx = torch.from_dlpack(a["q"]), torch.from_dlpack(a["indices"])
    if case.prefill:
        if case.row_format is not None or case.topk % 128:
            raise NotImplementedError("FlashMLA's sparse prefill reads bfloat16 kv, top-k a "
                                      "multiple of 128")
        kv = torch.from_dlpack(a["kv"])

        def call():
            return flash_mla.flash_mla_sparse_fwd(q, kv, idx, case.scale,
                                                  d_v=mla.KV_LORA_RANK)[0]
    else:
        if case.kv_cache_dtype != "fp8_ds_mla" or case.topk % 64:
            raise NotImplementedError("FlashMLA's Hopper sparse decode reads fp8_ds_mla rows, "
                                      "top-k a multiple of 64")
        kv = torch.from_dlpack(a["kv"]).view(torch.float8_e4m3fn)
        sched, _ = flash_mla.get_mla_metadata()

        def call():
            return flash_mla.flash_mla_with_kvcache(
                q, kv, None, None, mla.KV_LORA_RANK, sched, None, softmax_scale=case.scale,
                causal=False, is_fp8_kvcache=True, indices=idx)[0]
        call()  # fills the scheduler's metadata

    def run():
        return cupy.from_dlpack(call())

    return run


IMPLEMENTATIONS = {
    "cupaged": _run_cupaged,
    "cupaged-mma": lambda c: _run_cupaged(c, "mma"),
    "cupaged-sm90": lambda c: _run_cupaged(c, "sm90"),
    "flashmla": _run_flashmla,
}


def measure(cases, impls, reps: int = 20, copy_bw: float | None = None):
    """mla.Row rows for every (case, implementation), each checked before it is timed."""
    from .. import planning

    rows = []
    for case in cases:
        case.build()
        with peers.torch_on_cupy_stream():  # FlashMLA runs on torch's current stream
            for impl in impls:
                row = mla.Row(case.name + ROW_SUFFIX.get(case.kv_cache_dtype, "")
                              + (f"+x{case.extra_topk}" if case.extra_topk else ""), impl)
                try:
                    mla.check_then_time(row, case, IMPLEMENTATIONS[impl](case), reps, copy_bw)
                except Exception as e:  # noqa: BLE001 - a runner that cannot run is a row note
                    row.note = " ".join(f"{type(e).__name__}: {e}".split())[:160]
                finally:
                    planning.set_mla_family(None)  # back to the planner's choice of kernel
                rows.append(row)
        case.arrays.clear()
        case.refs = []
        peers.free_memory()  # (a peer's outputs and workspaces too)
    return rows
