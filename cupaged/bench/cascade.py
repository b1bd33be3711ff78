"""Cascade attention (``cupaged-bench cascade``): ``seqs`` decode queries whose sequences
share a prompt prefix of ``prefix`` tokens and each hold ``suffix`` tokens of their own.

One paged cache holds the prefix's blocks once; every sequence's block table points to
those shared blocks, then to its own. On the same data it times

- plain paged decode of the batch over the full tables (context ``prefix + suffix``):
  every sequence reads the shared prefix again;
- cascade attention: all decode queries over the shared prefix at once, as one
  multi-token, non-causal query of one sequence (``cupaged.attention`` with
  ``query_start_loc = [0, seqs]``, ``return_lse``), each sequence's decode over its own
  suffix blocks (``return_lse``), and ``cupaged.merge_state`` of the two partials.

Both results are checked against each other (outputs and lse) and, for a few sequences,
against the float64 reference of plain decode before anything is timed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import cupy
import numpy as np

from .. import _dtypes, reference, testing
from . import timing, workloads

__all__ = ["CascadeCase", "CascadeRow", "cascade_tables", "measure", "write_csv", "write_json"]

KV_LAYOUTS = ("NHD", "HND", "vllm")
# |lse - lse_ref| allowed, relative to max(1, |lse_ref|): the lses are fp32 sums of exact
# products (the test suite's bound for them).
LSE_TOL = 2e-3


def cascade_tables(seqs: int, prefix: int, suffix: int, block_size: int,
                   rng: np.random.Generator):
    """The block tables of a shared prefix (NumPy, int32), with all blocks scattered at
    random over the cache: ``(prefix_table [1, prefix / block_size], suffix_tables [seqs,
    ceil(suffix / block_size)], full_tables [seqs, both widths], num_blocks)``. Every
    row of ``full_tables`` is the prefix's blocks followed by the sequence's own."""
    if prefix % block_size:
        raise ValueError(f"the shared prefix fills whole blocks: prefix ({prefix}) must be a "
                         f"multiple of the block size ({block_size})")
    pb, sb = prefix // block_size, -(-suffix // block_size)
    num_blocks = pb + seqs * sb
    perm = rng.permutation(num_blocks).astype(np.int32)
    prefix_table = perm[None, :pb]
    suffix_tables = perm[pb:].reshape(seqs, sb)
    full = np.concatenate([np.broadcast_to(prefix_table, (seqs, pb)), suffix_tables], axis=1)
    return prefix_table.copy(), suffix_tables.copy(), np.ascontiguousarray(full), num_blocks


@dataclass
class CascadeCase:
    """The workload: ``seqs`` sequences, a shared prefix of ``prefix`` tokens (whole
    blocks) and ``suffix`` tokens of each sequence's own, in one ``kv_layout`` cache
    (NHD, HND or vLLM's). ValueError for shapes the calls cannot take."""

    seqs: int = 128
    prefix: int = 32768
    suffix: int = 256
    heads: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    kv_layout: str = "NHD"
    seed: int = 0
    arrays: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.dtype = _dtypes.parse(self.dtype).numpy.name
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got "
                             f"{self.kv_layout!r}")
        workloads.require_positive(self, "seqs", "prefix", "suffix", "heads", "kv_heads")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.prefix % self.block_size:
            raise ValueError(f"the shared prefix fills whole blocks: prefix ({self.prefix}) "
                             f"must be a multiple of the block size ({self.block_size})")
        if self.seqs > self.prefix:
            raise ValueError(f"the prefix pass is one sequence with {self.seqs} query tokens, "
                             f"at most its {self.prefix} cached ones: seqs must be <= prefix")

    @property
    def np_dtype(self) -> np.dtype:
        return _dtypes.parse(self.dtype).numpy

    @property
    def context(self) -> int:
        return self.prefix + self.suffix

    def _bytes(self, tokens: int) -> int:
        return 2 * tokens * self.kv_heads * self.head_size * self.np_dtype.itemsize

    def step_bytes(self) -> dict:
        """Bytes each step must move at least: the K and V it reads (plain decode: every
        sequence's full context; cascade: the prefix once and each suffix), the queries,
        and the outputs and lses it writes (the merge: both partials in, one result out)."""
        it = self.np_dtype.itemsize
        rows = self.seqs * self.heads
        q = o = rows * self.head_size * it
        lse = rows * 4
        plain = self._bytes(self.seqs * self.context) + q + o
        prefix = self._bytes(self.prefix) + q + o + lse
        suffix = self._bytes(self.seqs * self.suffix) + q + o + lse
        merge = 3 * (o + lse)
        return dict(plain=plain, cascade=prefix + suffix + merge, prefix=prefix,
                    suffix=suffix, merge=merge)

    def build(self) -> "CascadeCase":
        rng = np.random.default_rng(self.seed)
        pt, st, full, nb = cascade_tables(self.seqs, self.prefix, self.suffix, self.block_size,
                                          rng)
        dt = self.np_dtype
        if self.kv_layout == "vllm":
            kc, vc = testing.random_cache(nb, self.kv_heads, self.head_size, self.block_size,
                                          dt, rng, xp=cupy)
        else:
            shape = ((nb, self.block_size, self.kv_heads, self.head_size)
                     if self.kv_layout == "NHD" else
                     (nb, self.kv_heads, self.block_size, self.head_size))
            kc = testing.random_normal(shape, dt, rng, cupy)
            vc = testing.random_normal(shape, dt, rng, cupy)
        n, h, hs = self.seqs, self.heads, self.head_size
        q = testing.random_normal((n, h, hs), dt, rng, cupy)

        def out():
            return cupy.full((n, h, hs), np.nan, dt)

        def lse():
            return cupy.full((n, h), np.nan, np.float32)

        self.arrays = dict(
            query=q, key_cache=kc, value_cache=vc, full_tables_host=full,
            full_tables=cupy.asarray(full), prefix_table=cupy.asarray(pt),
            suffix_tables=cupy.asarray(st),
            full_lens=cupy.full(n, self.context, np.int32),
            prefix_lens=cupy.full(1, self.prefix, np.int32),
            suffix_lens=cupy.full(n, self.suffix, np.int32),
            prefix_starts=cupy.asarray(np.array([0, n], np.int32)),
            out_plain=out(), lse_plain=lse(), out_prefix=out(), lse_prefix=lse(),
            out_suffix=out(), lse_suffix=lse(), out=out(), lse=lse())
        return self

    # ---- the calls timed --------------------------------------------------------------------

    def _decode(self, tables, lens, max_len, out, lse=None):
        import cupaged

        a = self.arrays
        kw = {} if lse is None else dict(lse=lse)
        if self.kv_layout == "vllm":
            return cupaged.paged_attention(a["query"], a["key_cache"], a["value_cache"], tables,
                                           lens, max_context_len=max_len, out=out, **kw)
        return cupaged.attention(a["query"], a["key_cache"], a["value_cache"], tables, lens,
                                 kv_layout=self.kv_layout, max_seq_len=max_len, out=out, **kw)

    def run_plain(self, lse=None):
        """Plain paged decode over the full tables (``lse``: also write the lse)."""
        a = self.arrays
        return self._decode(a["full_tables"], a["full_lens"], self.context, a["out_plain"], lse)

    def run_prefix(self):
        """Every decode query over the shared prefix: one sequence of ``seqs`` query
        tokens, non-causal, with its lse."""
        import cupaged

        a = self.arrays
        return cupaged.attention(a["query"], a["key_cache"], a["value_cache"], a["prefix_table"],
                                 a["prefix_lens"], a["prefix_starts"], kv_layout=self.kv_layout,
                                 causal=False, max_query_len=self.seqs, max_seq_len=self.prefix,
                                 out=a["out_prefix"], lse=a["lse_prefix"])

    def run_suffix(self):
        """Each sequence's decode over its own blocks only, with its lse."""
        a = self.arrays
        return self._decode(a["suffix_tables"], a["suffix_lens"], self.suffix, a["out_suffix"],
                            a["lse_suffix"])

    def run_merge(self):
        import cupaged

        a = self.arrays
        return cupaged.merge_state(a["out_prefix"], a["lse_prefix"], a["out_suffix"],
                                   a["lse_suffix"], out=a["out"], lse_out=a["lse"])

    def run_cascade(self):
        self.run_prefix()
        self.run_suffix()
        return self.run_merge()

    # ---- checks -----------------------------------------------------------------------------

    def reference(self, seqs) -> tuple:
        """Float64 ``(out, lse)`` of plain decode for the sequences ``seqs`` (from a host
        copy of just their blocks)."""
        a = self.arrays
        seqs = np.asarray(seqs)
        need = -(-self.context // self.block_size)
        rows = a["full_tables_host"][seqs, :need]
        blocks = np.unique(rows)
        idx = cupy.asarray(blocks)
        kc, vc = cupy.asnumpy(a["key_cache"][idx]), cupy.asnumpy(a["value_cache"][idx])
        tables = np.searchsorted(blocks, rows).astype(np.int32)
        return reference.attention(cupy.asnumpy(a["query"][cupy.asarray(seqs)]), kc, vc, tables,
                                   np.full(len(seqs), self.context, np.int32),
                                   kv_layout=self.kv_layout, return_lse=True)

    def check(self, check_seqs: int = 3) -> dict:
        """Run both once and compare: the cascade against plain decode (every row,
        outputs and lse), and both against the float64 reference for ``check_seqs``
        sequences (the first, the last, and evenly spaced ones between). Returns the
        errors, the tolerances and ``ok``."""
        a = self.arrays
        self.run_plain(lse=a["lse_plain"])
        self.run_cascade()
        plain, casc = (cupy.asnumpy(a[k]).astype(np.float64) for k in ("out_plain", "out"))
        lp, lc = (cupy.asnumpy(a[k]).astype(np.float64) for k in ("lse_plain", "lse"))
        tol = testing.TOLERANCE[_dtypes.lookup(self.np_dtype).name]
        r = dict(tolerance=tol, lse_tolerance=LSE_TOL)
        r["cascade_vs_plain"] = _rel_err(casc, plain)
        r["lse_cascade_vs_plain"] = _lse_err(lc, lp)
        seqs = np.unique(np.linspace(0, self.seqs - 1, max(1, min(check_seqs, self.seqs)))
                         .round().astype(int))
        ref, ref_lse = self.reference(seqs)
        r["checked_seqs"] = seqs.tolist()
        r["plain_vs_reference"] = _rel_err(plain[seqs], ref)
        r["cascade_vs_reference"] = _rel_err(casc[seqs], ref)
        r["lse_cascade_vs_reference"] = _lse_err(lc[seqs], ref_lse)
        r["ok"] = bool(max(r["cascade_vs_plain"], r["plain_vs_reference"],
                           r["cascade_vs_reference"]) <= tol
                       and max(r["lse_cascade_vs_plain"], r["lse_cascade_vs_reference"]) <= LSE_TOL)
        return r


def _rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| (NaN anywhere: inf)."""
    if not np.isfinite(got).all():
        return math.inf
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(got - ref))
    return num / den if den > 0 else num


def _lse_err(got, ref) -> float:
    """max |got - ref| / max(1, |ref|) (NaN anywhere: inf)."""
    if not np.isfinite(got).all():
        return math.inf
    return float((np.abs(got - ref) / np.maximum(1.0, np.abs(ref))).max(initial=0.0))


@dataclass
class CascadeRow:
    """One timed step."""

    step: str  # "plain", "cascade", "prefix", "suffix", "merge"
    what: str  # what the step computes, in words
    status: str  # "ok" | "failed" | "skipped"
    median_us: float = math.nan
    p10_us: float = math.nan
    p90_us: float = math.nan
    bytes_moved: int = 0
    gbps: float = math.nan
    pct_copy: float = math.nan
    ratio_to_plain: float = math.nan  # this step's time / plain decode's
    note: str = ""


def describe(case: CascadeCase) -> dict:
    """Each step's words, for the table."""
    return dict(
        plain=f"plain decode: {case.seqs} x {case.context} tokens",
        cascade="cascade: prefix + suffix + merge",
        prefix=f"  prefix: {case.seqs} queries x {case.prefix} shared, non-causal",
        suffix=f"  suffix: {case.seqs} x {case.suffix}-token decode",
        merge="  merge_state")


def measure(case: CascadeCase, reps: int = 30, copy_bw: float = math.nan,
            check_seqs: int = 3) -> tuple:
    """Build, check, then time every step on the same data. Returns ``(rows, checks)``;
    a failed check leaves every row "failed" and untimed."""
    case.build()
    try:
        checks = case.check(check_seqs)
        words = describe(case)
        nbytes = case.step_bytes()
        runs = dict(plain=case.run_plain, cascade=case.run_cascade, prefix=case.run_prefix,
                    suffix=case.run_suffix, merge=case.run_merge)
        rows = []
        for step, fn in runs.items():
            row = CascadeRow(step, words[step], "ok", bytes_moved=nbytes[step])
            if not checks["ok"]:
                row.status, row.note = "failed", "check failed: not timed"
            else:
                t = timing.time_us(fn, reps=reps)
                row.median_us, row.p10_us, row.p90_us = t.median_us, t.p10_us, t.p90_us
                row.gbps = row.bytes_moved / (t.median_us * 1e-6) / 1e9
                row.pct_copy = 100 * row.gbps * 1e9 / copy_bw
            rows.append(row)
        if checks["ok"]:
            plain_us = rows[0].median_us
            for row in rows:
                row.ratio_to_plain = row.median_us / plain_us
    finally:
        case.arrays.clear()
        cupy.get_default_memory_pool().free_all_blocks()
    return rows, checks


def speedup(rows) -> float:
    """Plain decode's time / the cascade's (NaN unless both were timed)."""
    t = {r.step: r.median_us for r in rows}
    return t.get("plain", math.nan) / t.get("cascade", math.nan)


def config(case: CascadeCase) -> dict:
    return {f.name: getattr(case, f.name) for f in dataclasses.fields(case) if f.name != "arrays"}


def write_json(path, case, rows, checks, env, copy_bw_gbps) -> None:
    import json

    doc = {"environment": env, "copy_bandwidth_gbps": copy_bw_gbps, "config": config(case),
           "checks": checks, "speedup": speedup(rows),
           "rows": [dataclasses.asdict(r) for r in rows]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


def write_csv(path, case, rows, checks, env, copy_bw_gbps) -> None:
    """One row per step with the configuration and the checks in every row; the
    environment as leading '# key: value' lines (pandas: read_csv(path, comment='#'))."""
    import csv
    import json

    fixed = {**config(case), **{f"check_{k}": (" ".join(map(str, v)) if isinstance(v, list) else v)
                                for k, v in checks.items()}, "speedup": speedup(rows)}
    names = list(fixed) + [f.name for f in dataclasses.fields(CascadeRow)]
    with open(path, "w", newline="") as f:
        for k, v in {**env, "copy_bandwidth_gbps": copy_bw_gbps}.items():
            f.write(f"# {k}: {json.dumps(v, default=str)}\n")
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for r in rows:
            w.writerow({**fixed, **dataclasses.asdict(r)})
