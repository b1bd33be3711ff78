"""Serve random requests with a randomly initialized Llama over cupaged's paged KV cache.

Builds the model (random weights, nothing downloaded), a PagedKVCache sized to the GPU
memory left, and the continuous-batching Engine (cupaged.engine); runs the requests and
prints output tokens per second, time to first token (TTFT) and time per output token
(TPOT), median and p90. Needs PyTorch with CUDA and a GPU:

    python examples/serve.py --preset llama-3.2-1b --num-requests 256
    python examples/serve.py --preset llama-3-8b --prefix-caching --shared-prefix 512
    python examples/serve.py --kv-cache-dtype fp8 --request-rate 20
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import cupaged
from cupaged.engine import Engine, Request
from cupaged.llama import Llama, LlamaConfig

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.2-1b", help="llama-3.2-1b, llama-3-8b or tiny")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(128, 1024), metavar=("MIN", "MAX"),
                   help="prompt lengths, drawn uniformly from MIN..MAX")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="leading prompt tokens all requests share (for --prefix-caching)")
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e5m2"])
    p.add_argument("--kv-layout", default="HND", choices=["HND", "NHD", "vllm"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--memory-fraction", type=float, default=0.85,
                   help="share of the GPU memory left after the weights that the cache takes")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); default: all at once")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_requests(args, vocab: int, rng) -> list:
    lo, hi = args.prompt_len
    prefix = rng.integers(0, vocab, args.shared_prefix).tolist()
    requests = []
    for i in range(args.num_requests):
        n = max(int(rng.integers(lo, hi + 1)) - len(prefix), 1)
        requests.append(Request(i, prefix + rng.integers(0, vocab, n).tolist(), args.output_len))
    return requests


def make_cache(args, config: LlamaConfig) -> cupaged.PagedKVCache:
    itemsize = 1 if args.kv_cache_dtype != "auto" else DTYPES[args.dtype].itemsize
    per_block = 2 * config.num_layers * config.num_kv_heads * config.head_dim * args.block_size * itemsize
    free, _ = torch.cuda.mem_get_info()
    num_blocks = int(free * args.memory_fraction) // per_block
    return cupaged.PagedKVCache(config.num_layers, num_blocks, config.num_kv_heads,
                                config.head_dim, args.block_size, args.dtype,
                                kv_layout=args.kv_layout, prefix_caching=args.prefix_caching,
                                framework="torch", device=torch.cuda.current_device(),
                                kv_cache_dtype=args.kv_cache_dtype)


def serve(engine: Engine, requests: list, rate: float, rng) -> tuple:
    """Submit each request at its (Poisson) arrival time and step until all finish;
    returns (outputs, seconds)."""
    gaps = rng.exponential(1 / rate, len(requests)) if np.isfinite(rate) else np.zeros(len(requests))
    start = time.perf_counter()
    arrivals = start + np.cumsum(gaps)
    outputs, next_up = [], 0
    while next_up < len(requests) or engine.has_unfinished():
        now = time.perf_counter()
        while next_up < len(requests) and arrivals[next_up] <= now:
            requests[next_up].arrival_time = float(arrivals[next_up])
            outputs.append(engine.submit(requests[next_up]))
            next_up += 1
        if engine.has_unfinished():
            engine.step()
        elif next_up < len(requests):
            time.sleep(max(arrivals[next_up] - time.perf_counter(), 0.0))
    return outputs, time.perf_counter() - start


def main():
    args = parse_args()
    rng = np.random.default_rng(args.seed)
    config = LlamaConfig.preset(args.preset)
    model = Llama(config, device="cuda", dtype=DTYPES[args.dtype], seed=args.seed)
    cache = make_cache(args, config)
    engine = Engine(model, cache, max_batched_tokens=args.max_batched_tokens,
                    max_running=args.max_running)
    print(f"{args.preset} ({config.num_parameters / 1e9:.2f}B parameters, {args.dtype}); "
          f"cache: {cache.manager.num_blocks} blocks of {args.block_size} tokens, "
          f"{args.kv_layout}, kv_cache_dtype={cache.kv_cache_dtype}, "
          f"prefix caching {'on' if args.prefix_caching else 'off'}")

    # Compile the kernels this run needs (prefill and decode) before timing.
    engine.run([Request(f"warmup{i}", [1 + i] * (3 * args.block_size + i), 4) for i in range(4)])
    torch.cuda.synchronize()

    requests = make_requests(args, config.vocab_size, rng)
    outputs, seconds = serve(engine, requests, args.request_rate, rng)
    generated = sum(len(o.token_ids) for o in outputs)
    ttft = np.array([o.ttft for o in outputs]) * 1e3
    tpot = np.array([o.tpot for o in outputs if o.tpot is not None]) * 1e3
    print(f"{len(outputs)} requests, {sum(len(r.prompt) for r in requests)} prompt tokens, "
          f"{generated} output tokens in {seconds:.2f} s: {generated / seconds:.0f} output tokens/s")
    print(f"TTFT ms: median {np.median(ttft):.1f}, p90 {np.percentile(ttft, 90):.1f}")
    if len(tpot):
        print(f"TPOT ms: median {np.median(tpot):.2f}, p90 {np.percentile(tpot, 90):.2f}")
    print(f"preemptions: {sum(o.num_preemptions for o in outputs)}, prompt tokens found in the "
          f"prefix cache: {sum(o.num_cached_tokens for o in outputs)}")


if __name__ == "__main__":
    main()
