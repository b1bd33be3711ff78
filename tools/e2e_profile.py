"""Where an e2e system's steps go: per-step wall times and torch.profiler's top operators
for a few steps of one system of ``cupaged-bench e2e`` (device only).

    python3 tools/e2e_profile.py concat --preset llama-3.2-1b --num-requests 64 \
        --prompt-len 128 1024 --output-len 64 [--skip 20] [--steps 5]

Steps ``skip`` .. ``skip + steps`` are profiled (after the prefills, by default); every
step's wall time is printed (synchronized), so slow steps stand out.
"""

import argparse
import time

import numpy as np
import torch

from cupaged.bench import e2e as bench_e2e
from cupaged.serving.engine import PagedAttention


def main():
    p = argparse.ArgumentParser()
    p.add_argument("system", choices=("concat", "cupaged"))
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(128, 1024))
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--skip", type=int, default=30)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    w = bench_e2e.Workload(preset=a.preset, num_requests=a.num_requests,
                           prompt_len=tuple(a.prompt_len), output_len=a.output_len,
                           breakdown=False)
    h = bench_e2e.Harness(w)
    if a.system == "concat":
        engine = bench_e2e.ConcatEngine(h.model, budget_tokens=h.budget_tokens,
                                        max_batched_tokens=w.max_batched_tokens,
                                        max_running=w.max_running)
        running = lambda: len(engine.running)  # noqa: E731
    else:
        engine = h._engine(h.make_cache(), PagedAttention)
        running = lambda: len(engine.scheduler.running)  # noqa: E731
    bench_e2e.serve(engine, bench_e2e.warmup_requests(w.block_size), np.zeros(4))
    requests, _ = h.requests()
    for r in requests:
        engine.submit(r)
    times, step = [], 0
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    while engine.has_unfinished():
        if step == a.skip:
            prof.start()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        if step == a.skip + a.steps - 1:
            prof.stop()
        if step < 40 or step % 20 == 0:
            print(f"step {step:4d}: {times[-1]:9.2f} ms, {running()} running")
        step += 1
    print(f"{step} steps, total {sum(times) / 1e3:.2f} s, median {np.median(times):.2f} ms")
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cuda_time_total", row_limit=20))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
