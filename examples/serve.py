"""Serve random requests with a randomly initialized Llama over cupaged's paged KV cache.

Builds the model (random weights, nothing downloaded), a PagedKVCache sized to the GPU
memory left, and the continuous-batching Engine (cupaged.serving.engine); runs the requests and
prints output tokens per second, time to first token (TTFT) and time per output token
(TPOT), median and p90. Needs PyTorch with CUDA and a GPU:

    python examples/serve.py --preset llama-3.2-1b --num-requests 256
    python examples/serve.py --preset llama-3-8b --prefix-caching --shared-prefix 512
    python examples/serve.py --kv-cache-dtype fp8 --request-rate 20

The requests, the cache sizing, the serving loop and the statistics are those of
`cupaged-bench e2e` (cupaged.bench.e2e), which runs the same workload through other
systems beside this one.
"""

from __future__ import annotations

import argparse

import torch

from cupaged.bench.e2e import DTYPES, Harness, Workload, serve, summarize, warmup_requests
from cupaged.serving.engine import Engine


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.2-1b", help="llama-3.2-1b, llama-3-8b or tiny")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
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
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="launch decode steps from Python instead of replaying CUDA graphs")
    args = vars(p.parse_args())
    graphs = not args.pop("no_cuda_graphs")
    try:
        return Workload(**args, breakdown=False), graphs  # the other options: Workload's
    except ValueError as e:
        p.error(str(e))


def main():
    w, graphs = parse_args()
    harness = Harness(w)  # the model, and the cache's blocks from the memory left
    cache = harness.make_cache()
    # Decode steps replay CUDA graphs, planned for the longest sequence of the workload.
    engine = Engine(harness.model, cache, max_batched_tokens=w.max_batched_tokens,
                    max_running=w.max_running, cuda_graphs=graphs,
                    max_model_len=w.prompt_len[1] + w.output_len)
    print(f"{w.preset} ({harness.config.num_parameters / 1e9:.2f}B parameters, {w.dtype}); "
          f"cache: {cache.manager.num_blocks} blocks of {w.block_size} tokens, "
          f"{w.kv_layout}, kv_cache_dtype={cache.kv_cache_dtype}, "
          f"prefix caching {'on' if w.prefix_caching else 'off'}, CUDA graphs "
          f"{'on' if graphs else 'off'}")

    # Compile the kernels this run needs (prefill and decode) and capture the decode
    # graphs of every batch size before timing.
    engine.run(warmup_requests(w.block_size))
    if graphs:
        engine.capture_graphs()
    torch.cuda.synchronize()

    requests, offsets = harness.requests()
    outputs, seconds = serve(engine, requests, offsets)
    s = summarize(outputs, seconds)
    print(f"{s['requests']} requests, {s['prompt_tokens']} prompt tokens, {s['output_tokens']} "
          f"output tokens in {seconds:.2f} s: {s['output_tokens_per_s']:.0f} output tokens/s")
    print(f"TTFT ms: median {s['ttft_median_ms']:.1f}, p90 {s['ttft_p90_ms']:.1f}")
    if s["tpot_median_ms"] == s["tpot_median_ms"]:  # NaN with one output token
        print(f"TPOT ms: median {s['tpot_median_ms']:.2f}, p90 {s['tpot_p90_ms']:.2f}")
    print(f"preemptions: {s['preemptions']}, prompt tokens found in the prefix cache: "
          f"{s['cached_prompt_tokens']}")


if __name__ == "__main__":
    main()
