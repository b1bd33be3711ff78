"""The environment a run measured on, and its results as JSON, CSV and a plot."""

from __future__ import annotations


import cupy
import numpy as np

from . import workloads


def environment() -> dict:
    """Versions, GPUs and the kernel cache: what `cupaged-bench info` prints."""
    import platform

    from .. import __version__, jit

    env = {"cupaged": __version__, "python": platform.python_version(), "numpy": np.__version__,
           "cupy": cupy.__version__}
    try:
        # (with its build: the kernel cache's key takes it, so a cache made on another
        # machine serves this one only where the builds agree)
        env["nvrtc"] = (".".join(map(str, jit.nvrtc_version()))
                        + f" ({jit.nvrtc_build()})")
    except Exception as e:  # pragma: no cover - depends on the install
        env["nvrtc"] = f"unavailable ({e})"
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = None
    try:  # the installed version, without importing it (seconds, and it pulls in torch)
        from importlib import metadata

        env["flashinfer"] = metadata.version("flashinfer-python")
    except Exception:
        env["flashinfer"] = None
    cache = jit.cache_dir()
    files = [f for f in cache.glob("*.json")] if cache.is_dir() else []
    env["kernel_cache"] = str(cache)
    env["kernel_cache_kernels"] = len(files)
    env["kernel_cache_mib"] = round(sum(f.stat().st_size for f in cache.glob("*") if f.is_file())
                                    / 2**20, 2) if cache.is_dir() else 0.0
    gpus = []
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        n = 0
    if n:
        env["driver"] = cupy.cuda.runtime.driverGetVersion()
        env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    for i in range(n):
        p = cupy.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        gpus.append({"index": i, "name": name, "compute_capability": f"{p['major']}.{p['minor']}",
                     "sms": p["multiProcessorCount"],
                     "memory_gib": round(p["totalGlobalMem"] / 2**30, 1)})
    env["gpus"] = gpus
    return env


def write_json(path, results, env, copy_bw_gbps) -> None:
    import dataclasses
    import json

    doc = {"environment": env, "copy_bandwidth_gbps": copy_bw_gbps,
           "results": [dataclasses.asdict(r) for r in results]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


def write_csv(path, results, env, copy_bw_gbps) -> None:
    """One row per result with every field; the environment as leading '# key: value'
    lines (pandas: read_csv(path, comment='#'))."""
    import csv
    import dataclasses
    import json

    with open(path, "w", newline="") as f:
        for k, v in {**env, "copy_bandwidth_gbps": copy_bw_gbps}.items():
            f.write(f"# {k}: {json.dumps(v, default=str)}\n")
        names = [fl.name for fl in dataclasses.fields(workloads.Result)]
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for r in results:
            w.writerow(dataclasses.asdict(r))


def write_plot(path, results, title: str = "") -> None:
    """Percent of the copy bandwidth against mean context length, one line per
    implementation, one panel per batch size (needs matplotlib: the `plot` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok"]
    batches = sorted({r.batch for r in ok}) or [0]
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), squeeze=False,
                             sharey=True)
    for ax, b in zip(axes[0], batches):
        for impl in dict.fromkeys(r.impl for r in ok):
            pts = sorted((r.mean_context, r.pct_copy) for r in ok if r.batch == b and r.impl == impl)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("% of copy bandwidth")
    axes[0][-1].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_lines(results) -> list:
    """compare --summary: one line per workload (shape, batch, context): cupaged's time and
    % copy, then each other implementation's time over cupaged's ("FAIL" / "SKIP" for a
    row that failed its check or did not run, "-" for one not asked), then FlashInfer's
    plan() host times; then the notes of the rows that did not run or failed, once per
    (implementation, status, note) with a count."""
    def short(i):
        return i.replace("flashinfer-", "fi-").replace("torch-sdpa-", "sdpa-")

    def cell(r, key, fmt):
        if r is None:
            return "-"
        return format(getattr(r, key), fmt) if r.status == "ok" else r.status[:4].upper()

    impls = list(dict.fromkeys(r.impl for r in results))
    peers = [i for i in impls if i != "cupaged"]
    planned = [i for i in impls
               if any(r.plan_us == r.plan_us for r in results if r.impl == i)]
    lines = [f"{'shape':16s} {'batch':>5s} {'context':>10s} {'cupaged us':>10s} {'%copy':>6s} |"
             + "".join(f" {short(i):>12s}" for i in peers)
             + (" | plan us:" + "".join(f" {short(i):>12s}" for i in planned) if planned else "")]
    work: dict = {}
    for r in results:
        shape = r.preset or f"{r.heads}/{r.kv_heads}/{r.head_size}"
        work.setdefault((shape, r.batch, r.context), {})[r.impl] = r
    for (shape, b, c), by in work.items():
        cp = by.get("cupaged")
        line = (f"{shape:16s} {b:5d} {c:>10s} {cell(cp, 'median_us', '.1f'):>10s} "
                f"{cell(cp, 'pct_copy', '.1f'):>6s} |"
                + "".join(f" {cell(by.get(i), 'ratio_to_cupaged', '.2f'):>12s}" for i in peers))
        if planned:
            line += " |         " + "".join(f" {cell(by.get(i), 'plan_us', '.0f'):>12s}"
                                            for i in planned)
        lines.append(line)
    if peers:
        lines.append("peer columns: time / cupaged's time (above 1: cupaged is faster)")
    notes: dict = {}
    for r in results:
        if r.status != "ok":
            key = (r.impl, r.status, r.note[:150])
            notes[key] = notes.get(key, 0) + 1
    for (impl, status, note), n in list(notes.items())[:15]:
        lines.append(f"{n:3d} x {impl} {status}: {note}")
    return lines
