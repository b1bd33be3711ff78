"""``cupaged-bench indexer``: DeepSeek-V3.2's lightning indexer, the step that picks each
query token's top-k keys for sparse attention: :func:`cupaged.indexer_logits` over the
indexer's fp8 paged key cache (written by :func:`cupaged.indexer_k_quant_and_cache`),
then :func:`cupaged.indexer_topk` over those logits, each checked against the float64
reference on a few rows before it is timed.

A case is ``batch`` sequences of ``context`` cached tokens, each with its own blocks of
``block_size`` scattered over the cache, ``next_n`` query tokens a sequence (1 for
decode, 2 with one multi-token-prediction draft), 64 heads of 128 dims, logits as wide as
the context. Roofline numbers: the logits read each sequence's keys once (132 bytes a
token: 128 e4m3 values and a float32 scale) and q, write ``rows x width`` float32
logits, and count ``2 * 128`` FLOPs per (row, head, visible key); top-k reads the logits
and writes ``rows x topk`` int32 columns. The logits are continuous random values: top-k's
tie-free path (no tie at a row's k-th value), the common one."""

from __future__ import annotations

from dataclasses import dataclass, field

import cupy
import numpy as np

from .. import _dtypes, reference, testing
from . import mla, workloads

__all__ = ["IMPLEMENTATIONS", "PRESETS", "IndexerCase", "measure"]

HEAD_DIM = 128
CACHE_WIDTH = HEAD_DIM + 4

# DeepSeek-V3.2's indexer (64 heads, top-k 2048), pages of 64.
PRESETS = {
    "v32-decode": dict(batch=128, next_n=1, context=32768),
    "v32-mtp": dict(batch=128, next_n=2, context=32768),
    "v32-long": dict(batch=16, next_n=1, context=131072),
}


@dataclass
class IndexerCase:
    name: str
    batch: int = 128
    next_n: int = 1
    context: int = 32768
    heads: int = 64
    block_size: int = 64
    topk: int = 2048
    arrays: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        workloads.require_positive(self, "batch", "next_n", "context", "heads", "block_size",
                                   "topk")
        if self.next_n > self.context:
            raise ValueError(f"next_n ({self.next_n}) must be at most context ({self.context})")

    @property
    def rows(self) -> int:
        return self.batch * self.next_n

    def describe(self) -> str:
        return (f"{self.name}: {self.heads} heads x {HEAD_DIM}, batch {self.batch} x "
                f"{self.next_n} query token{'s' if self.next_n > 1 else ''}, contexts of "
                f"{self.context}, pages of {self.block_size}, top-{self.topk}, bfloat16 q: "
                f"{self.batch * self.context * CACHE_WIDTH / 2**20:.1f} MiB of keys, "
                f"{self.rows * self.context * 4 / 2**20:.1f} MiB of logits")

    def build(self, seed: int = 0) -> "IndexerCase":
        import cupaged

        rng = np.random.default_rng(seed)
        page = self.block_size
        per_seq = -(-self.context // page)
        nb = self.batch * per_seq
        tables = rng.permutation(nb).reshape(self.batch, per_seq).astype(np.int32)
        cache = cupy.empty((nb, page, CACHE_WIDTH), np.uint8)
        step = max(1, (1 << 16) // page)  # blocks a write: 65,536 tokens of source at a time
        for lo in range(0, nb, step):
            n = min(step, nb - lo)
            k = testing.random_normal((n * page, HEAD_DIM), _dtypes.BF16.numpy, rng, cupy)
            cupaged.indexer_k_quant_and_cache(k, cache, cupy.arange(lo * page, (lo + n) * page),
                                              128)
        self.arrays = dict(
            q=testing.random_normal((self.batch, self.next_n, self.heads, HEAD_DIM),
                                    _dtypes.BF16.numpy, rng, cupy),
            kv_cache=cache,
            weights=cupy.asarray((rng.standard_normal((self.rows, self.heads))
                                  / np.sqrt(self.heads)).astype(np.float32)),
            block_tables=cupy.asarray(tables),
            seq_lens=cupy.full(self.batch, self.context, np.int32),
            logits=cupy.full((self.rows, self.context), np.nan, np.float32),
            indices=cupy.full((self.rows, self.topk), -7, np.int32))
        return self

    def check_rows(self) -> list:
        """Rows checked: the first and the last."""
        return sorted({0, self.rows - 1})

    def reference_logits(self, row: int) -> np.ndarray:
        """Float64 logits of one row, over a host copy of its sequence's blocks."""
        a = self.arrays
        b, t = divmod(row, self.next_n)
        blocks = cupy.asnumpy(a["block_tables"][b])
        cache = cupy.asnumpy(a["kv_cache"][cupy.asarray(blocks)])
        q = cupy.asnumpy(a["q"][b]).astype(np.float64)  # [next_n, heads, 128]
        w = cupy.asnumpy(a["weights"][b * self.next_n:(b + 1) * self.next_n])
        logits = reference.indexer_logits(
            q, cache, w, np.arange(len(blocks), dtype=np.int32)[None],
            np.array([self.context], np.int32), np.array([0, self.next_n], np.int32),
            max_seq_len=self.context)
        return logits[t]


class _Logits:
    """indexer_logits as mla.check_then_time measures it."""

    def __init__(self, case: IndexerCase):
        self.case = case

    def flops(self) -> float:
        c = self.case
        visible = c.context * c.rows - c.batch * c.next_n * (c.next_n - 1) // 2
        return 2.0 * c.heads * HEAD_DIM * visible

    def bytes_moved(self) -> int:
        c = self.case
        return (c.batch * c.context * CACHE_WIDTH + c.rows * c.heads * HEAD_DIM * 2
                + c.rows * c.heads * 4 + c.rows * c.context * 4)

    def check(self, logits) -> float:
        """Max over the checked rows of |logit - reference| / the row's largest |logit|
        (inf where the -inf or NaN pattern differs)."""
        worst = 0.0
        for row in self.case.check_rows():
            ref = self.case.reference_logits(row)
            got = cupy.asnumpy(logits[row]).astype(np.float64)
            f = np.isfinite(ref)
            if not (np.array_equal(np.isneginf(got), np.isneginf(ref))
                    and np.isfinite(got[f]).all()):
                return np.inf
            scale = max(np.abs(ref[f]).max(initial=0), 1e-30)
            worst = max(worst, float(np.abs(got[f] - ref[f]).max(initial=0) / scale))
        return worst

    def tolerance(self) -> float:
        return 1e-4  # float32 sums of exact products against float64 (tests/test_indexer.py)


class _Topk:
    """indexer_topk over the case's logits as mla.check_then_time measures it."""

    def __init__(self, case: IndexerCase):
        self.case = case

    def flops(self) -> float:
        return float("nan")  # a selection: no FLOP rate (the table prints '-')

    def bytes_moved(self) -> int:
        c = self.case
        return c.rows * c.context * 4 + c.rows * c.topk * 4

    def check(self, indices) -> float:
        """0 when the checked rows' columns equal the reference's top-k of the same logits
        exactly (ties by the lower column), else inf."""
        c = self.case
        for row in c.check_rows():
            want = reference.indexer_topk(cupy.asnumpy(c.arrays["logits"][row])[None], c.topk)
            if not np.array_equal(cupy.asnumpy(indices[row]), want[0]):
                return np.inf
        return 0.0

    def tolerance(self) -> float:
        return 0.0


def _run_logits(case: IndexerCase):
    import cupaged

    a = case.arrays

    def run():
        return cupaged.indexer_logits(a["q"], a["kv_cache"], a["weights"], a["block_tables"],
                                      a["seq_lens"], max_seq_len=case.context, out=a["logits"])

    return _Logits(case), run


def _run_topk(case: IndexerCase):
    import cupaged

    a = case.arrays
    what, logits = _run_logits(case)
    error = what.check(logits())  # the logits it selects from, checked as their own row is
    if not error <= what.tolerance():
        raise RuntimeError(f"the logits top-k selects from are wrong (error {error:.1e})")

    def run():
        return cupaged.indexer_topk(a["logits"], case.topk, out=a["indices"])

    return _Topk(case), run


IMPLEMENTATIONS = {"logits": _run_logits, "topk": _run_topk}


def preset_case(name: str, topk: int = 2048) -> IndexerCase:
    return IndexerCase(name, topk=topk, **PRESETS[name])


def measure(cases, impls, reps: int = 20, copy_bw: float | None = None):
    """mla.Row rows for every (case, step), each checked before it is timed."""
    rows = []
    for case in cases:
        case.build()
        for impl in impls:
            row = mla.Row(case.name, impl)
            try:
                what, run = IMPLEMENTATIONS[impl](case)
                mla.check_then_time(row, what, run, reps, copy_bw)
            except Exception as e:  # noqa: BLE001 - a step that cannot run is a row note
                row.note = " ".join(f"{type(e).__name__}: {e}".split())[:160]
            rows.append(row)
        case.arrays.clear()
    return rows
