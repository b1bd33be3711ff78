"""End-to-end serving (``cupaged-bench e2e``): one workload of random requests through
several serving systems, the same model weights and the same requests for each.

The model is :class:`cupaged.serving.llama.Llama` with random weights drawn once from the seed;
the prompts are random token ids from the same seed (an optional shared system prompt
first), each request generates exactly ``output_len`` tokens greedily, and arrivals are
all at once or Poisson. The systems:

- ``cupaged``: :class:`cupaged.serving.engine.Engine` (continuous batching, chunked prefill,
  preemption) over a :class:`cupaged.PagedKVCache` sized to the KV budget, attention by
  :func:`cupaged.reshape_and_cache` and :func:`cupaged.attention`; decode steps replay
  CUDA graphs (``cuda_graphs=True``, ``max_model_len`` the longest prompt plus
  ``output_len``, every graph captured before the timed run).
- ``cupaged-eager``: the same without CUDA graphs: every step launched from Python, as
  the flashinfer system runs.
- ``cupaged-compiled``: ``cupaged`` with the model under ``torch.compile``
  (``Engine(compile=True)``: attention through ``torch.ops.cupaged``, the rest fused by
  inductor), decode steps in CUDA graphs of the compiled forward. Its compiles happen
  in the warm-up and graph capture, before the timed run; only named with ``--systems``.
  No breakdown (the profiling pass runs the model eagerly).
- ``flashinfer``: the same engine and cache (run eagerly), FlashInfer's paged kernels
  in place of ``cupaged.attention`` (:class:`FlashInferAttention`: its decode wrapper on
  tensor cores for the step's decodes, its prefill wrapper for the prompt chunks, each
  planned once per step and run per layer); the K/V writes stay
  ``cupaged.reshape_and_cache``, as vLLM's FlashInfer backend keeps its own cache write.
- ``concat``: the "before" of a paged cache. Continuous batching where each request
  keeps its own contiguous K/V per layer, grown with ``torch.cat`` every step
  (:class:`cupaged.serving.llama.SdpaAttention`: torch SDPA, one call per request, flash or
  memory-efficient: not cuDNN's, which plans anew for every length). Each step
  decodes every running request and prefills the newly admitted prompts whole, in one
  forward (the projections and the MLP batched across requests). Contiguous storage
  cannot grow into pages it does not own, so admission reserves ``prompt + output_len``
  tokens per request against a budget of the same bytes as the paged cache.
- ``hf``: transformers' ``generate`` on the same weights (shared, not copied), static
  batches of ``hf_batch`` requests in arrival order, left-padded, its default dynamic
  cache and SDPA (without cuDNN's backend, as concat). Its batch size defaults to what
  the same KV budget holds at the longest prompt plus ``output_len``, halved on running
  out of memory.

Reported per system: output tokens/s over the whole run, time to first token (arrival to
first token) and time per output token (per request, mean gap after the first), median and
p90, and the peak bytes of K/V held and claimed (see :class:`SystemResult`). For the
engine systems also where a step's time goes (:meth:`Harness.breakdown`): attention (cache
write and attention kernels), the rest of the model on the GPU, and the host (the step's
time in which the GPU runs none of the forward).

torch (with CUDA, for the benchmark) is needed by everything that runs a system;
requests, statistics, the KV arithmetic and the writers need only NumPy.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass

import numpy as np

from .. import _dtypes
from ..serving.engine import Completion, Request, RequestOutput

__all__ = ["DEFAULT_SYSTEMS", "SYSTEMS", "ConcatEngine", "FlashInferAttention", "Harness", "SystemResult",
           "Workload", "arrival_offsets", "breakdown_lines", "contiguous_reservation",
           "hf_batch_size", "kv_bytes_per_token", "kv_cache_blocks", "make_requests", "run",
           "serve", "summarize", "table_lines", "unavailable", "unsupported",
           "warmup_requests", "write_csv", "write_json", "write_plot"]

SYSTEMS = ("cupaged", "cupaged-eager", "flashinfer", "concat", "hf", "cupaged-compiled")
# Run when none is named: all but the compiled engine, whose compiles take minutes.
DEFAULT_SYSTEMS = SYSTEMS[:5]
ENGINE_SYSTEMS = ("cupaged", "cupaged-eager", "flashinfer", "cupaged-compiled")  # _run_engine
PRESETS = ("llama-3.2-1b", "llama-3-8b", "tiny")
DTYPES = ("bfloat16", "float16", "float32")
KV_LAYOUTS = ("HND", "NHD", "vllm")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # the CLI offers auto and fp8
FLASHINFER_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class Workload:
    """What every system serves, and the limits they share (the CLI's options)."""

    preset: str = "llama-3.2-1b"
    dtype: str = "bfloat16"
    num_requests: int = 64
    prompt_len: tuple = (128, 1024)  # (MIN, MAX), uniform, the shared prefix included
    output_len: int = 128
    shared_prefix: int = 0
    prefix_caching: bool = False
    kv_cache_dtype: str = "auto"  # or fp8: "fp8" (= "fp8_e4m3"), "fp8_e5m2"
    request_rate: float = math.inf  # requests/s, Poisson; inf: all at once
    max_batched_tokens: int = 2048
    max_running: int = 256
    seed: int = 0
    memory_fraction: float = 0.85  # of the GPU memory free after the weights: the KV budget
    block_size: int = 16
    kv_layout: str = "HND"
    hf_batch: int | None = None  # None: as many as the KV budget holds
    breakdown: bool = True

    def __post_init__(self):
        object.__setattr__(self, "prompt_len", tuple(int(n) for n in self.prompt_len))
        lo, hi = self.prompt_len
        checks = [
            (self.preset in PRESETS, f"--preset must be one of {', '.join(PRESETS)}"),
            (self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}"),
            (self.num_requests >= 1, "--num-requests must be at least 1"),
            (1 <= lo <= hi, f"--prompt-len MIN MAX needs 1 <= MIN <= MAX, got {lo} {hi}"),
            (self.output_len >= 1, "--output-len must be at least 1"),
            (0 <= self.shared_prefix < lo,
             f"--shared-prefix ({self.shared_prefix}) must be less than the shortest prompt "
             f"(--prompt-len MIN = {lo}): every prompt has at least one token of its own"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}"),
            (self.kv_cache_dtype == "auto" or self.dtype != "float32",
             "--kv-cache-dtype fp8 takes a float16 or bfloat16 model (--dtype)"),
            (self.request_rate > 0, "--request-rate must be positive"),
            (1 <= self.max_running <= self.max_batched_tokens,
             f"need 1 <= --max-running <= --max-batched-tokens (every running request's "
             f"decode fits a step), got {self.max_running} and {self.max_batched_tokens}"),
            (0 < self.memory_fraction <= 1, "--memory-fraction must be in (0, 1]"),
            (self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0
             and self.block_size <= 256, "--block-size must be a power of two up to 256"),
            (self.kv_layout in KV_LAYOUTS, f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}"),
            (self.hf_batch is None or self.hf_batch >= 1, "--hf-batch must be at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one cached K or V element."""
        return 1 if self.kv_cache_dtype != "auto" else _dtypes.parse(self.dtype).itemsize


# ---- requests and arrivals ------------------------------------------------------------------


def make_requests(workload: Workload, vocab_size: int) -> list:
    """The workload's requests, the same for every call with the same seed: prompt
    lengths uniform over ``prompt_len`` (MIN..MAX), the first ``shared_prefix`` tokens
    the same in every prompt, the rest random ids; ``output_len`` new tokens each."""
    rng = np.random.default_rng(workload.seed)
    lo, hi = workload.prompt_len
    prefix = rng.integers(0, vocab_size, workload.shared_prefix).tolist()
    requests = []
    for i in range(workload.num_requests):
        own = int(rng.integers(lo, hi + 1)) - len(prefix)
        requests.append(Request(i, prefix + rng.integers(0, vocab_size, own).tolist(),
                                workload.output_len))
    return requests


def arrival_offsets(num_requests: int, rate: float, seed: int) -> np.ndarray:
    """Seconds from the start at which each request arrives: Poisson arrivals at ``rate``
    per second (exponential gaps, from a stream of their own so the prompts do not
    depend on the rate), or all at 0 for an infinite rate."""
    if not np.isfinite(rate):
        return np.zeros(num_requests)
    return np.cumsum(np.random.default_rng([seed, 1]).exponential(1 / rate, num_requests))


def warmup_requests(block_size: int, second: bool = False) -> list:
    """A few short requests that make a system compile or load what a run needs (prefill
    over several blocks, decode) before it is timed. ``second``: another round with other
    counts and lengths, after which a compiled model has seen every size of its steps
    (tokens, sequences, table width, bounds) change, so it compiles them as dynamic before
    the timed run rather than in it."""
    if second:
        return [Request(f"warmup2-{i}", [2 + i] * (5 * block_size + 3 * i), 3) for i in range(7)]
    return [Request(f"warmup{i}", [1 + i] * (3 * block_size + i), 4) for i in range(4)]


def serve(runner, requests: list, offsets, on_step=None) -> tuple:
    """Submit each request at its arrival time (``offsets``: seconds from now) and step
    ``runner`` (``submit``, ``has_unfinished``, ``step``: an Engine or a ConcatEngine)
    until all finish, calling ``on_step()`` after each step. Returns ``(outputs, seconds)``,
    the outputs in request order."""
    start = time.perf_counter()
    arrivals = start + np.asarray(offsets, dtype=np.float64)
    outputs, next_up = [], 0
    while next_up < len(requests) or runner.has_unfinished():
        now = time.perf_counter()
        while next_up < len(requests) and arrivals[next_up] <= now:
            requests[next_up].arrival_time = float(arrivals[next_up])
            outputs.append(runner.submit(requests[next_up]))
            next_up += 1
        if runner.has_unfinished():
            runner.step()
            if on_step is not None:
                on_step()
        elif next_up < len(requests):
            time.sleep(max(arrivals[next_up] - time.perf_counter(), 0.0))
    return outputs, time.perf_counter() - start


# ---- statistics -------------------------------------------------------------------------------


def summarize(outputs, seconds: float) -> dict:
    """Throughput and latency of a run's outputs (RequestOutput): ``requests``,
    ``prompt_tokens``, ``output_tokens``, ``seconds``, ``output_tokens_per_s``, TTFT and
    TPOT median and p90 in ms (``ttft_median_ms``, ``ttft_p90_ms``, ``tpot_median_ms``,
    ``tpot_p90_ms``: NaN without data), ``preemptions`` and ``cached_prompt_tokens``.
    TTFT is per request, arrival to first token; TPOT per request, the mean gap between
    its later tokens (requests with one token have none)."""
    generated = sum(len(c.token_ids) for o in outputs for c in o.completions)
    ttft = np.array([o.ttft for o in outputs if o.ttft is not None]) * 1e3
    tpot = np.array([o.tpot for o in outputs if o.tpot is not None]) * 1e3

    def pct(x, q):
        return float(np.percentile(x, q)) if len(x) else math.nan

    return dict(requests=len(outputs), prompt_tokens=sum(o.prompt_len for o in outputs),
                output_tokens=generated, seconds=seconds,
                output_tokens_per_s=generated / seconds if seconds > 0 else math.nan,
                ttft_median_ms=pct(ttft, 50), ttft_p90_ms=pct(ttft, 90),
                tpot_median_ms=pct(tpot, 50), tpot_p90_ms=pct(tpot, 90),
                preemptions=sum(o.num_preemptions for o in outputs),
                cached_prompt_tokens=sum(o.num_cached_tokens for o in outputs))


# ---- KV memory arithmetic ---------------------------------------------------------------------


def kv_bytes_per_token(config, kv_itemsize: int) -> int:
    """Bytes one token's K and V take over all layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_itemsize


def kv_cache_blocks(free_bytes: int, memory_fraction: float, block_size: int,
                    bytes_per_token: int) -> int:
    """Blocks of the paged cache: ``memory_fraction`` of the free bytes, in whole blocks.
    This many blocks' bytes are every system's KV budget."""
    return int(free_bytes * memory_fraction) // (block_size * bytes_per_token)


def contiguous_reservation(prompt_len: int, output_len: int) -> int:
    """Tokens a request's contiguous K/V must hold room for from admission on: its
    prompt and every token it may generate (storage that cannot grow into pages it does
    not own has to be reserved at the largest length)."""
    return prompt_len + output_len


def hf_batch_size(budget_bytes: int, bytes_per_token: int, padded_len: int, output_len: int,
                  num_requests: int) -> int:
    """Requests per ``generate`` call that fit the KV budget: every row of a batch holds
    the batch's padded prompt length plus ``output_len`` tokens. At least 1, at most
    ``num_requests``."""
    per_row = bytes_per_token * (padded_len + output_len)
    return max(1, min(num_requests, budget_bytes // per_row))


# ---- results ----------------------------------------------------------------------------------


@dataclass
class SystemResult:
    """One system's run. ``status``: "ok", "skipped" (it could not run here or ran out of
    memory: ``note`` says why) or "failed" (an error: ``note``)."""

    system: str
    status: str = "ok"
    note: str = ""
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = math.nan
    output_tokens_per_s: float = math.nan
    ttft_median_ms: float = math.nan
    ttft_p90_ms: float = math.nan
    tpot_median_ms: float = math.nan
    tpot_p90_ms: float = math.nan
    preemptions: int = 0
    cached_prompt_tokens: int = 0
    kv_budget_bytes: int = 0  # KV bytes the system may hold (the paged cache's size)
    kv_peak_bytes: int = 0  # the most bytes of K/V it held at once
    # The most it had claimed at once: blocks in use (engines), reservations of prompt +
    # output per request (concat), rows of padded prompt + output (hf).
    kv_reserved_peak_bytes: int = 0
    steps: int = 0  # forward passes
    batch_size: int = 0  # hf: requests per generate call (the last one used)
    # The most requests running at once (engines and concat: in one step; hf: a batch).
    peak_running: int = 0
    # Engine systems, from the profiling pass: shares of the step time (they add up to 1).
    attention_fraction: float = math.nan  # reshape_and_cache + attention kernels
    model_fraction: float = math.nan  # the rest of the forward's kernels
    host_fraction: float = math.nan  # no forward kernel running: host work not hidden


def unsupported(system: str, workload: Workload) -> str | None:
    """Why ``system`` cannot serve ``workload`` whatever is installed (one line), or None."""
    if system not in SYSTEMS:
        return f"unknown system {system!r}: expected one of {', '.join(SYSTEMS)}"
    if system in ("concat", "hf") and workload.kv_cache_dtype != "auto":
        return f"{system} has no fp8 KV cache path"
    if system == "flashinfer":
        if workload.kv_layout == "vllm":
            return "flashinfer's paged kernels take NHD or HND caches, not vLLM's layout"
        if workload.dtype == "float32":
            return "flashinfer runs float16 and bfloat16 models, not float32"
        try:
            from ..serving.llama import LlamaConfig
        except ImportError:  # no torch: unavailable() says so
            return None
        head_dim = LlamaConfig.preset(workload.preset).head_dim
        if head_dim not in FLASHINFER_HEAD_DIMS:
            sizes = ", ".join(map(str, FLASHINFER_HEAD_DIMS))
            return (f"flashinfer is run with head sizes {sizes} (those of vLLM's FlashInfer "
                    f"backend), {workload.preset} has {head_dim}")
    return None


def unavailable(system: str) -> str | None:
    """Why ``system`` cannot run on this machine (a package missing), or None."""
    from . import peers

    if peers.import_torch() is None:
        return "needs PyTorch with a CUDA device"
    if system == "flashinfer":
        return peers.flashinfer_unavailable()
    if system == "hf":
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed (pip install transformers)"
    return None


# ---- the concat system --------------------------------------------------------------------------


class _ConcatSeq:
    __slots__ = ("request", "output", "tokens", "reserved")

    def __init__(self, request, output, reserved):
        self.request, self.output = request, output
        self.tokens = list(request.prompt)
        self.reserved = reserved


class ConcatEngine:
    """Continuous batching without pages (the ``concat`` system): each request keeps its
    own contiguous K/V per layer (:class:`cupaged.serving.llama.SdpaAttention`), so admission
    must reserve its largest length, ``prompt + max_new_tokens`` tokens, out of
    ``budget_tokens``.

    Each step decodes every running request (one token each, oldest first) and admits
    waiting requests in order while their reservations fit, ``max_running`` allows and
    their whole prompts fit into what is left of ``max_batched_tokens`` (a prompt longer
    than that goes alone as a step's first admission); all of it is one forward, so the
    projections and the MLP run batched and only attention runs per request. Greedy
    sampling; a request finishes after ``max_new_tokens`` tokens or its ``eos_token_id``.
    ``submit``, ``has_unfinished`` and ``step`` as :class:`cupaged.serving.engine.Engine`'s.
    """

    def __init__(self, model, *, budget_tokens: int, max_batched_tokens: int = 2048,
                 max_running: int = 256):
        from ..serving.llama import SdpaAttention

        self.model = model
        self.budget_tokens = budget_tokens
        self.max_batched_tokens, self.max_running = max_batched_tokens, max_running
        self.attention = SdpaAttention()
        self.waiting: deque = deque()
        self.running: list = []
        self.reserved_tokens = 0  # reserved by the running requests
        self.peak_reserved_tokens = 0
        self.peak_tokens = 0  # the most K/V tokens held at once
        self.peak_running = 0  # the most requests in one step
        self.num_steps = 0

    def submit(self, request: Request) -> RequestOutput:
        if not len(request.prompt) or request.max_new_tokens < 1 or request.n != 1:
            raise ValueError(f"request {request.id!r}: need a prompt, max_new_tokens >= 1 and "
                             f"n == 1 (the concat system has no forks)")
        need = contiguous_reservation(len(request.prompt), request.max_new_tokens)
        if need > self.budget_tokens:
            raise ValueError(f"request {request.id!r} can never fit: it reserves {need} tokens, "
                             f"the KV budget holds {self.budget_tokens}")
        arrival = time.perf_counter() if request.arrival_time is None else request.arrival_time
        output = RequestOutput(request.id, len(request.prompt), arrival, [Completion()])
        self.waiting.append(_ConcatSeq(request, output, need))
        return output

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> list:
        admitted, budget = [], self.max_batched_tokens - len(self.running)
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            seq = self.waiting[0]
            if self.reserved_tokens + seq.reserved > self.budget_tokens:
                break
            if admitted and len(seq.tokens) > budget:
                break
            self.waiting.popleft()
            self.reserved_tokens += seq.reserved
            admitted.append(seq)
            budget -= len(seq.tokens)
        self.peak_reserved_tokens = max(self.peak_reserved_tokens, self.reserved_tokens)
        return admitted

    def step(self) -> list:
        """One forward: every running request's next token, and the admitted prompts.
        Returns the outputs of the requests that finished."""
        import torch

        admitted = self._admit()
        rows = self.running + admitted
        if not rows:
            return []
        counts = np.array([1] * len(self.running) + [len(s.tokens) for s in admitted], np.int64)
        starts = np.array([len(s.tokens) - 1 for s in self.running] + [0] * len(admitted),
                          np.int64)
        ends = np.cumsum(counts)
        tokens = np.concatenate([s.tokens[a:] for s, a in zip(rows, starts.tolist())])
        positions = np.arange(ends[-1], dtype=np.int64) + np.repeat(starts - (ends - counts),
                                                                   counts)
        dev = torch.from_numpy(np.concatenate([tokens, positions, ends - 1])).to(self.model.device)
        t = int(ends[-1])
        self.attention.begin([s.request.id for s in rows], counts.tolist())
        logits = self.model.forward(dev[:t], dev[t:2 * t], self.attention, dev[2 * t:])
        sampled = logits.argmax(dim=-1).tolist()
        now = time.perf_counter()
        self.running = rows
        self.num_steps += 1
        self.peak_running = max(self.peak_running, len(rows))
        self.peak_tokens = max(self.peak_tokens, sum(len(s.tokens) for s in rows))
        finished = []
        for seq, token in zip(rows, sampled):
            seq.tokens.append(token)
            if seq.output.completions[0].record(token, now, seq.request):
                self.attention.free(seq.request.id)
                self.reserved_tokens -= seq.reserved
                finished.append(seq.output)
        if finished:
            self.running = [s for s in rows if s.output.completions[0].finish_reason is None]
        return finished


# ---- the flashinfer system --------------------------------------------------------------------


class FlashInferAttention:
    """An attention backend for :class:`cupaged.serving.engine.Engine` (see
    :class:`cupaged.serving.engine.PagedAttention`) with FlashInfer's paged kernels over the
    engine's own PagedKVCache (NHD or HND; 16-bit or fp8 with per-tensor scales), split as
    vLLM's FlashInfer backend splits a batch: the leading rows with one query token each
    (the scheduler puts decodes first) go to ``BatchDecodeWithPagedKVCacheWrapper`` on
    tensor cores, the rest to ``BatchPrefillWithPagedKVCacheWrapper`` (causal).

    Each step it plans the wrappers it needs once (from the block manager's host tables:
    no device sync); each layer writes the new K/V with :func:`cupaged.reshape_and_cache`
    and runs them, into one output."""

    def __init__(self, cache, config):
        from .. import _arrays
        from . import peers

        flashinfer = peers.require_flashinfer()
        torch = peers.import_torch()
        if cache.kv_layout not in ("NHD", "HND"):
            raise ValueError(f"FlashInfer takes NHD or HND caches, not {cache.kv_layout!r}")
        kc = cache.key_caches[0]
        # A workspace each: a wrapper's plan lives in its workspace until its runs.
        self.workspaces = [torch.zeros(peers.FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8,
                                       device=kc.device) for _ in range(2)]
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspaces[0],
                                                                      cache.kv_layout)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspaces[1], cache.kv_layout, use_tensor_cores=True)
        self.config, self.kv_dtype = config, kc.dtype
        self.q_dtype = _arrays.torch_dtype(cache.dtype)
        # fp8: the per-tensor scales, read once (the engine never changes them) so that
        # run() gets floats without a sync per layer.
        self.scales = [{} if cache.k_scales[i] is None else
                       dict(k_scale=float(cache.k_scales[i]), v_scale=float(cache.v_scales[i]))
                       for i in range(cache.num_layers)]

    def __call__(self, cache, batch, slot_mapping, block_tables, seq_lens, query_start_loc):
        import torch

        from . import peers

        tables, lens = cache.manager.tables(batch.seq_ids)  # after the step's appends
        single = batch.num_tokens == 1
        d = len(single) if single.all() else int(np.argmin(single))  # leading decodes
        c, dev = self.config, self.workspaces[0].device
        common = dict(q_data_type=self.q_dtype, kv_data_type=self.kv_dtype)
        if d:
            indptr, indices, last = peers.flashinfer_pages(tables[:d], lens[:d],
                                                             cache.block_size)
            self.decode.plan(torch.from_numpy(indptr), torch.from_numpy(indices).to(dev),
                             torch.from_numpy(last), c.num_heads, c.num_kv_heads, c.head_dim,
                             cache.block_size, pos_encoding_mode="NONE", **common)
        if d < len(single):
            indptr, indices, last = peers.flashinfer_pages(tables[d:], lens[d:],
                                                             cache.block_size)
            qo = batch.query_start_loc[d:] - batch.query_start_loc[d]
            self.prefill.plan(torch.from_numpy(qo), torch.from_numpy(indptr),
                              torch.from_numpy(indices).to(dev), torch.from_numpy(last),
                              c.num_heads, c.num_kv_heads, c.head_dim, cache.block_size,
                              causal=True, **common)
        rows = int(batch.query_start_loc[d])  # query rows of the decodes
        return lambda layer, q, k, v: self._layer(cache, slot_mapping, d, rows, layer, q, k, v)

    def _layer(self, cache, slot_mapping, d, rows, layer, q, k, v):
        import torch

        from .. import cache_ops

        kc, vc = cache.key_caches[layer], cache.value_caches[layer]
        cache_ops.reshape_and_cache(k, v, kc, vc, slot_mapping, kv_layout=cache.kv_layout,
                                    **cache.layer_kwargs(layer))
        scales = self.scales[layer]
        if rows == q.shape[0]:
            return self.decode.run(q, (kc, vc), **scales)
        if not d:
            return self.prefill.run(q, (kc, vc), **scales)
        out = torch.empty_like(q)
        self.decode.run(q[:rows], (kc, vc), out=out[:rows], **scales)
        self.prefill.run(q[rows:], (kc, vc), out=out[rows:], **scales)
        return out


# ---- the step-time breakdown ------------------------------------------------------------------


class _StepProfiler:
    """Stands in for the model in a profiling pass: runs each forward as the engine
    would (host and GPU overlapping), synchronizes and notes its wall time; then runs it
    again behind a GPU busy-wait long enough for the host to enqueue the whole forward,
    with CUDA events around the forward and around each layer's attention call. The
    replay's kernels then run back to back, so its events give device time only. The
    replay recomputes the same K/V into the same slots and returns the same logits."""

    def __init__(self, model):
        from . import timing

        self.model, self.config, self.dtype = model, model.config, model.dtype
        self.device = model.device
        self._spin = timing.Spin(0)
        self.forward_s = self.attention_s = self.replay_s = 0.0

    def forward(self, tokens, positions, attention, logits_rows=None):
        import torch

        t0 = time.perf_counter()
        self.model.forward(tokens, positions, attention, logits_rows)
        torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        pairs = []

        def timed(layer, q, k, v):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            out = attention(layer, q, k, v)
            end.record()
            pairs.append((start, end))
            return out

        # The host enqueues the replay in at most the real forward's wall time.
        self._spin.ns = np.uint64(1.5e9 * (t1 - t0) + 100e3)
        self._spin()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        logits = self.model.forward(tokens, positions, timed, logits_rows)
        end.record()
        end.synchronize()
        self.replay_s += time.perf_counter() - t1
        self.forward_s += start.elapsed_time(end) * 1e-3
        self.attention_s += sum(s.elapsed_time(e) for s, e in pairs) * 1e-3
        return logits

    __call__ = forward


# ---- running the systems ------------------------------------------------------------------------


class Harness:
    """The model (random weights from the seed, generated once), the KV budget and the
    requests that every system gets. ``device``: where the model lives (the concat and
    hf systems also run on the CPU, for tests); ``num_blocks``: the paged cache's blocks
    (default: :func:`kv_cache_blocks` of the memory free on the GPU after the weights)."""

    def __init__(self, workload: Workload, *, device="cuda", num_blocks: int | None = None):
        import torch

        from ..serving.llama import Llama, LlamaConfig

        self.workload = w = workload
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.config = LlamaConfig.preset(w.preset)
        self.model = Llama(self.config, device=self.device, dtype=getattr(torch, w.dtype),
                           seed=w.seed)
        self.bytes_per_token = kv_bytes_per_token(self.config, w.kv_itemsize)
        if num_blocks is None:
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            num_blocks = kv_cache_blocks(free, w.memory_fraction, w.block_size,
                                         self.bytes_per_token)
        self.num_blocks = num_blocks

    @property
    def budget_tokens(self) -> int:
        return self.num_blocks * self.workload.block_size

    @property
    def budget_bytes(self) -> int:
        return self.budget_tokens * self.bytes_per_token

    def requests(self) -> tuple:
        """Fresh ``(requests, arrival offsets)``: the same for every system."""
        w = self.workload
        return (make_requests(w, self.config.vocab_size),
                arrival_offsets(w.num_requests, w.request_rate, w.seed))

    def run(self, system: str) -> tuple:
        """Run one system: ``(SystemResult, outputs)``. Running out of GPU memory skips
        it and any other error fails it (the note says which; the traceback goes to
        stderr); outputs are then empty. Memory is released before returning."""
        from . import peers

        try:
            why = unsupported(system, self.workload)
            if why:
                return SystemResult(system, "skipped", why), []
            if system in ENGINE_SYSTEMS:
                return self._run_engine(system)
            return getattr(self, f"_run_{system}")()
        except peers.oom_errors() as e:
            return SystemResult(system, "skipped", f"out of GPU memory: {_one_line(e)}"), []
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            return SystemResult(system, "failed", f"{type(e).__name__}: {_one_line(e)}"), []
        finally:
            _release(self.device)

    # ---- each system -----------------------------------------------------------------------

    def make_cache(self):
        """The paged cache: ``num_blocks`` blocks in the workload's layout and types."""
        import cupaged

        w, c = self.workload, self.config
        return cupaged.PagedKVCache(c.num_layers, self.num_blocks, c.num_kv_heads, c.head_dim,
                                    w.block_size, w.dtype, kv_layout=w.kv_layout,
                                    prefix_caching=w.prefix_caching, framework="torch",
                                    device=self.device.index,
                                    kv_cache_dtype=w.kv_cache_dtype)

    def _engine(self, cache, backend, model=None, cuda_graphs=False, compile=False):
        from ..serving.engine import Engine

        w = self.workload
        return Engine(self.model if model is None else model, cache,
                      max_batched_tokens=w.max_batched_tokens, max_running=w.max_running,
                      attention=backend, cuda_graphs=cuda_graphs,
                      max_model_len=w.prompt_len[1] + w.output_len, compile=compile)

    def _run_engine(self, system: str):
        from ..serving.engine import PagedAttention

        cache = self.make_cache()
        backend = (FlashInferAttention(cache, self.config) if system == "flashinfer"
                   else PagedAttention)
        graphs = system in ("cupaged", "cupaged-compiled")
        engine = self._engine(cache, backend, cuda_graphs=graphs,
                              compile=system == "cupaged-compiled")
        engine.run(warmup_requests(self.workload.block_size))  # compiles, loads, plans
        if system == "cupaged-compiled":
            engine.run(warmup_requests(self.workload.block_size, second=True))
        if graphs:
            engine.capture_graphs()
        _sync(self.device)
        peak, running, steps = [0], [0], [0]
        execute = engine.execute

        def recording(batch):  # after the step's appends, before it frees what finished
            sampled = execute(batch)
            peak[0] = max(peak[0], cache.bytes_in_use)
            running[0] = max(running[0], len(batch.seq_ids))
            steps[0] += 1
            return sampled

        engine.execute = recording
        requests, offsets = self.requests()
        outputs, seconds = serve(engine, requests, offsets)
        del engine.execute
        result = SystemResult(system, **summarize(outputs, seconds),
                              kv_budget_bytes=self.num_blocks * cache.bytes_per_block,
                              kv_peak_bytes=peak[0], kv_reserved_peak_bytes=peak[0],
                              steps=steps[0], peak_running=running[0])
        if self.workload.breakdown and system != "cupaged-compiled":
            fractions = self.breakdown(cache, backend, engine if graphs else None)
            result.attention_fraction, result.model_fraction, result.host_fraction = fractions
        return result, outputs

    def breakdown(self, cache, backend, graph_engine=None) -> tuple:
        """Shares of an engine step's time: ``(attention, rest of the model, host)``,
        from a profiling pass over the same requests, all submitted at once, through the
        same cache and backend (the cache empty when it starts).

        Each step's forward runs twice (:class:`_StepProfiler`): as in the timed run,
        then replayed behind a GPU busy-wait with CUDA events. A step's time is its wall
        time without the replay. Attention is the replay's device time in the attention
        calls (``reshape_and_cache`` and the attention kernels), the rest of the model the
        replay's other forward kernels, and the host whatever is left: the part of the
        step in which the GPU runs none of the forward (scheduling, block tables, uploads,
        sampling, and launch time the GPU did not hide).

        ``graph_engine``: the run's engine with its decode graphs, whose replays the
        profiler cannot time inside. The device times are then those of the eager pass
        (its kernels on the same steps: the schedule does not depend on timing when
        everything is submitted at once; the graphs' own differ a little, padding the
        batch to their size and planning attention for ``max_model_len``), and the step
        time is that of a second pass through ``graph_engine``, with its graphs. With
        prefix caching each pass starts from what the one before left cached, so its
        schedule may differ from the timed run's."""
        profiler = _StepProfiler(self.model)
        engine = self._engine(cache, backend, model=profiler)
        wall = self._timed_pass(engine)
        step_s = wall - profiler.replay_s
        if graph_engine is not None:
            step_s = self._timed_pass(graph_engine)
        attention = profiler.attention_s / step_s
        model = (profiler.forward_s - profiler.attention_s) / step_s
        return attention, model, 1.0 - attention - model

    def _timed_pass(self, engine) -> float:
        """Seconds inside ``engine.step()`` serving the requests, all submitted at once."""
        from . import peers

        requests, _ = self.requests()
        for r in requests:
            engine.submit(r)
        wall = 0.0
        with peers.torch_on_cupy_stream():  # a profiler's busy-wait is on CuPy's stream
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                wall += time.perf_counter() - t0
        return wall

    def _run_concat(self):
        w = self.workload

        def make():
            return ConcatEngine(self.model, budget_tokens=self.budget_tokens,
                                max_batched_tokens=w.max_batched_tokens, max_running=w.max_running)

        serve(make(), warmup_requests(w.block_size), np.zeros(4))
        _release(self.device)
        engine = make()
        requests, offsets = self.requests()
        outputs, seconds = serve(engine, requests, offsets)
        return SystemResult("concat", **summarize(outputs, seconds),
                            kv_budget_bytes=self.budget_bytes,
                            kv_peak_bytes=engine.peak_tokens * self.bytes_per_token,
                            kv_reserved_peak_bytes=(engine.peak_reserved_tokens
                                                    * self.bytes_per_token),
                            steps=engine.num_steps, peak_running=engine.peak_running), outputs

    def _run_hf(self):
        import torch

        from ..serving.llama import to_hf

        w = self.workload
        hf = to_hf(self.model, share_weights=True)
        requests, offsets = self.requests()
        padded = max(len(r.prompt) for r in requests)
        batch = w.hf_batch or hf_batch_size(self.budget_bytes, self.bytes_per_token, padded,
                                            w.output_len, len(requests))
        _hf_generate(hf, [r.prompt for r in warmup_requests(w.block_size)], 4)  # warm up
        _sync(self.device)
        start = time.perf_counter()
        arrivals = start + offsets
        outputs = [RequestOutput(r.id, len(r.prompt), float(a), [Completion()])
                   for r, a in zip(requests, arrivals)]
        at, peak, reserved, steps, note, peak_batch = 0, 0, 0, 0, "", 0
        while at < len(requests):
            group = requests[at:at + batch]
            time.sleep(max(arrivals[at + len(group) - 1] - time.perf_counter(), 0.0))
            try:
                tokens, times = _hf_generate(hf, [r.prompt for r in group], w.output_len)
            except torch.OutOfMemoryError:
                if batch == 1:
                    raise
                batch //= 2
                note = f"out of memory: batches halved to {batch}"
                _release(self.device)
                continue
            for out, ids in zip(outputs[at:at + len(group)], tokens):
                c = out.completions[0]
                c.token_ids, c.token_times, c.finish_reason = ids, list(times), "length"
            padded = len(group) * max(len(r.prompt) for r in group)
            # Every row holds the padded prompt and all but the last token generated; the
            # batch size was chosen for rows of the padded prompt and the whole output.
            peak = max(peak, (padded + len(group) * (w.output_len - 1)) * self.bytes_per_token)
            reserved = max(reserved, (padded + len(group) * w.output_len) * self.bytes_per_token)
            steps += len(times)
            at += len(group)
            peak_batch = max(peak_batch, len(group))
        seconds = time.perf_counter() - start
        return SystemResult("hf", note=note, **summarize(outputs, seconds),
                            kv_budget_bytes=self.budget_bytes, kv_peak_bytes=peak,
                            kv_reserved_peak_bytes=reserved, steps=steps,
                            batch_size=batch, peak_running=peak_batch), outputs


class _StepClock:
    """A ``generate`` streamer that notes when each step's tokens reach the host
    (``generate`` copies them there, a sync): its first ``put`` is the prompt."""

    def __init__(self):
        self.times, self._prompt_seen = [], False

    def put(self, value):
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self):
        pass


def _hf_generate(hf, prompts: list, output_len: int) -> tuple:
    """Greedy ``generate`` of exactly ``output_len`` tokens for a left-padded batch:
    ``(token ids per prompt, the time each step's tokens arrived)``."""
    import torch
    from torch.nn.attention import sdpa_kernel

    from ..serving.llama import SDPA_BACKENDS

    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    clock = _StepClock()
    # No end-of-sequence token (random weights have none) and min_new_tokens: every row
    # generates output_len tokens, as in the other systems.
    # SDPA without cuDNN's backend, as the concat system (SdpaAttention): it plans for
    # each new shape, and a growing cache has a new one at every step.
    with sdpa_kernel(SDPA_BACKENDS):
        out = hf.generate(ids.to(hf.device), attention_mask=mask.to(hf.device),
                          max_new_tokens=output_len, min_new_tokens=output_len,
                          do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock)
    tokens = out[:, longest:].tolist()
    if any(len(t) != output_len for t in tokens) or len(clock.times) != output_len:
        raise RuntimeError(f"generate returned {len(tokens[0])} tokens in {len(clock.times)} "
                           f"steps, expected {output_len}")
    return tokens, clock.times


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device) -> None:
    """Give cached memory back between systems, so each starts with the same free memory."""
    from . import peers

    gc.collect()
    if device.type == "cuda":
        _sync(device)
        peers.free_memory()  # torch's cached blocks and CuPy's pool


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


# ---- output -------------------------------------------------------------------------------------


def _fmt(v, spec: str) -> str:
    return "-" if v != v else format(v, spec)  # NaN -> '-'


def table_lines(results) -> list:
    """The console table: one line per system."""
    lines = [f"{'system':13s} {'requests':>8s} {'out tok/s':>10s} {'TTFT ms p50':>12s} "
             f"{'p90':>9s} {'TPOT ms p50':>12s} {'p90':>8s} {'KV held MiB':>12s} "
             f"{'claimed MiB':>12s} {'of budget':>10s} {'running':>8s}  note"]
    for r in results:
        line = f"{r.system:13s} "
        if r.status != "ok":
            lines.append(line + f"{r.status.upper()}: {r.note}")
            continue
        share = r.kv_reserved_peak_bytes / r.kv_budget_bytes if r.kv_budget_bytes else math.nan
        line += (f"{r.requests:8d} {_fmt(r.output_tokens_per_s, '10.0f')} "
                 f"{_fmt(r.ttft_median_ms, '12.1f')} {_fmt(r.ttft_p90_ms, '9.1f')} "
                 f"{_fmt(r.tpot_median_ms, '12.2f')} {_fmt(r.tpot_p90_ms, '8.2f')} "
                 f"{r.kv_peak_bytes / 2**20:12.1f} {r.kv_reserved_peak_bytes / 2**20:12.1f} "
                 f"{_fmt(100 * share, '9.1f')}% {r.peak_running:8d}")
        extra = [r.note] if r.note else []
        if r.system == "hf":
            extra.append(f"batches of {r.batch_size}")
        if r.preemptions:
            extra.append(f"{r.preemptions} preemptions")
        if r.cached_prompt_tokens:
            extra.append(f"{r.cached_prompt_tokens} prompt tokens from the prefix cache")
        lines.append(line + ("  " + "; ".join(extra) if extra else ""))
    return lines


def breakdown_lines(results) -> list:
    """One line per system with a step-time breakdown."""
    return [f"{r.system} step time: attention {100 * r.attention_fraction:.1f}% "
            f"(reshape_and_cache + attention), rest of the model {100 * r.model_fraction:.1f}%, "
            f"host {100 * r.host_fraction:.1f}% (GPU idle: scheduling, uploads, sampling, "
            f"launches not hidden)"
            for r in results if r.status == "ok" and r.attention_fraction == r.attention_fraction]


def _workload_fields(workload: Workload) -> dict:
    d = dataclasses.asdict(workload)
    d["prompt_len"] = list(workload.prompt_len)
    return d


def write_json(path, workload: Workload, results, env) -> None:
    import json
    import os

    doc = {"environment": env, "workload": _workload_fields(workload),
           "results": [dataclasses.asdict(r) for r in results]}
    # Written aside and renamed: a run killed mid-write keeps the previous file whole.
    aside = f"{path}.tmp"
    try:
        with open(aside, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(aside, path)
    finally:
        if os.path.exists(aside):
            os.remove(aside)


def write_csv(path, workload: Workload, results, env) -> None:
    """One row per system with the workload in every row; the environment as leading
    '# key: value' lines (pandas: read_csv(path, comment='#'))."""
    import csv
    import json

    fixed = _workload_fields(workload)
    fixed["prompt_len"] = " ".join(map(str, workload.prompt_len))
    names = list(fixed) + [f.name for f in dataclasses.fields(SystemResult)]
    with open(path, "w", newline="") as f:
        for k, v in env.items():
            f.write(f"# {k}: {json.dumps(v, default=str)}\n")
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for r in results:
            w.writerow({**fixed, **dataclasses.asdict(r)})


def write_plot(path, results, title: str = "") -> None:
    """Bars per system: output tokens/s, and TTFT and TPOT medians (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok"]
    names = [r.system for r in ok]
    x = np.arange(len(ok))
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    panels = [("output tokens/s", [r.output_tokens_per_s for r in ok]),
              ("TTFT ms (median; p90 whisker)", [r.ttft_median_ms for r in ok]),
              ("TPOT ms (median; p90 whisker)", [r.tpot_median_ms for r in ok])]
    p90 = [None, [r.ttft_p90_ms for r in ok], [r.tpot_p90_ms for r in ok]]
    for ax, (label, values), high in zip(axes, panels, p90):
        values = np.nan_to_num(np.array(values, dtype=float))
        err = None
        if high is not None:  # a one-sided whisker from the median up to the p90
            err = [np.zeros(len(ok)), np.maximum(np.nan_to_num(np.array(high, float)) - values, 0)]
        ax.bar(x, values, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(ok))])
        ax.set_xticks(x, names)
        ax.set_title(label, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(workload: Workload, systems, echo=print, done=None, **harness_options) -> list:
    """Build the harness (model and budget; ``harness_options`` go to :class:`Harness`),
    say what it serves, and run ``systems`` one after another: their SystemResults.
    ``done(results)`` is called with the results so far after each system (a run cut
    short by a time limit keeps the finished systems' rows)."""
    harness = Harness(workload, **harness_options)
    c, w = harness.config, workload
    lo, hi = w.prompt_len
    echo(f"{w.preset} ({c.num_parameters / 1e9:.2f}B parameters, {w.dtype}), random weights "
         f"(seed {w.seed}); {w.num_requests} requests, prompts {lo}..{hi} tokens"
         + (f" ({w.shared_prefix} shared)" if w.shared_prefix else "")
         + f", {w.output_len} output tokens each, "
         + ("all at once" if not math.isfinite(w.request_rate) else
            f"Poisson arrivals at {w.request_rate:g}/s"))
    echo(f"KV budget {harness.budget_bytes / 2**30:.2f} GiB ({w.memory_fraction:g} of the free "
         f"memory): {harness.num_blocks} blocks of {w.block_size} tokens, {w.kv_layout}, "
         f"kv_cache_dtype {w.kv_cache_dtype}, prefix caching "
         f"{'on' if w.prefix_caching else 'off'}; concat reserves prompt + output per "
         f"request in it, hf sizes its batches by it")
    results = []
    for system in systems:
        print(f"running {system}...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        results.append(harness.run(system)[0])
        print(f"{system}: {results[-1].status} in {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
        if done is not None:
            done(results)
    return results


# ---- where the steps go -------------------------------------------------------------------------


PROFILED_SYSTEMS = ("concat", "cupaged-eager", "cupaged")


def profile_steps(workload: Workload, system: str, skip: int, steps: int, echo=print) -> None:
    """Serve the workload's requests (all at once) through one system (concat, or the
    engine eager or with CUDA graphs) after its warm-up, printing each step's wall time
    (synchronized; the first 40, then every 20th) and, for steps ``skip`` to
    ``skip + steps``, torch.profiler's top operators by CUDA and by CPU time."""
    import time as _time

    import torch

    from ..serving.engine import PagedAttention

    h = Harness(workload)
    if system == "concat":
        engine = ConcatEngine(h.model, budget_tokens=h.budget_tokens,
                              max_batched_tokens=workload.max_batched_tokens,
                              max_running=workload.max_running)

        def running():
            return len(engine.running)
    else:
        engine = h._engine(h.make_cache(), PagedAttention, cuda_graphs=system == "cupaged")

        def running():
            return len(engine.scheduler.running)
    serve(engine, warmup_requests(workload.block_size), np.zeros(4))
    requests, _ = h.requests()
    for r in requests:
        engine.submit(r)
    times, step = [], 0
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    while engine.has_unfinished():
        if step == skip:
            prof.start()
        torch.cuda.synchronize()
        t0 = _time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((_time.perf_counter() - t0) * 1e3)
        if step == skip + steps - 1:
            prof.stop()
        if step < 40 or step % 20 == 0:
            echo(f"step {step:4d}: {times[-1]:9.2f} ms, {running()} running")
        step += 1
    echo(f"{step} steps, total {sum(times) / 1e3:.2f} s, median {np.median(times):.2f} ms")
    if step <= skip:
        echo(f"only {step} steps: none profiled (from step {skip})")
        return
    if step < skip + steps:
        echo(f"only {step} steps: steps {skip} to {step - 1} profiled")
        prof.stop()
    ka = prof.key_averages()
    echo(ka.table(sort_by="self_cuda_time_total", row_limit=20))
    echo(ka.table(sort_by="self_cpu_time_total", row_limit=25))
