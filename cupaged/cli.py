"""cupaged-bench: measure cupaged on this machine's GPU."""

from __future__ import annotations

import itertools
import os
import platform
import sys
import tempfile
import time

import click
import numpy as np

from . import __version__, _dtypes, jit


def _int_list(ctx, param, value):
    """'1,8,64' -> [1, 8, 64]."""
    if value is None:
        return None
    try:
        items = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}")
    if not items or any(v < 0 for v in items):
        raise click.BadParameter(f"expected non-negative integers, got {value!r}")
    return items


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cupaged")
def main():
    """Benchmarks and checks for cupaged's paged-attention kernels."""


@main.command()
def info():
    """GPU, driver and library versions, and the kernel cache."""
    import cupy

    click.echo(f"cupaged      {__version__}")
    click.echo(f"python       {platform.python_version()}")
    click.echo(f"numpy        {np.__version__}")
    click.echo(f"cupy         {cupy.__version__}")
    try:
        click.echo(f"nvrtc        {'.'.join(map(str, jit.nvrtc_version()))}")
    except Exception as e:  # pragma: no cover - depends on the install
        click.echo(f"nvrtc        unavailable ({e})")
    cache = jit.cache_dir()
    files = list(cache.glob("*")) if cache.is_dir() else []
    size = sum(f.stat().st_size for f in files if f.is_file())
    click.echo(f"kernel cache {cache} ({len(files) // 2} kernels, {size / 2**20:.1f} MiB)")
    n = _gpu_count()
    if n == 0:
        click.echo("gpu          none found (kernels can still be compiled: cupaged-bench compile --all)")
        return
    click.echo(f"driver       {cupy.cuda.runtime.driverGetVersion()}")
    click.echo(f"cuda runtime {cupy.cuda.runtime.runtimeGetVersion()}")
    for i in range(n):
        p = cupy.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        click.echo(f"gpu {i}        {name}, sm_{p['major']}{p['minor']}, "
                   f"{p['multiProcessorCount']} SMs, {p['totalGlobalMem'] / 2**30:.0f} GiB")


@main.command("compile")
@click.option("--arch", "archs", multiple=True, help="Target, e.g. sm_90 (repeatable). "
              "Default: this machine's GPU, or sm_90 without one.")
@click.option("--all", "all_", is_flag=True,
              help="Compile every supported specialization with NVRTC (no GPU needed) and "
                   "print one summary line.")
@click.option("--dtype", "dtypes", multiple=True, default=("float16",), show_default=True)
@click.option("--head-size", callback=_int_list, default="128", show_default=True)
@click.option("--block-size", callback=_int_list, default="16", show_default=True)
@click.option("--group", callback=_int_list, default="4", show_default=True,
              help="Query heads per KV head.")
@click.option("--precompile", is_flag=True,
              help="Compile the listed shapes into the kernel cache for deployment.")
def compile_(archs, all_, dtypes, head_size, block_size, group, precompile):
    """Compile kernels: the --all check, or cold/warm timings of the listed shapes."""
    from . import attention

    if not archs:
        archs = (_default_arch(),)
    if all_:
        specs = [s for a in archs for s in attention.decode_specs(a)]
        try:
            n, secs = jit.compile_check(specs)
        except jit.CompileError as e:
            click.echo(str(e), err=True)
            sys.exit(1)
        click.echo(f"compiled {n} specializations for {', '.join(archs)} in {secs:.1f} s "
                   f"(NVRTC {'.'.join(map(str, jit.nvrtc_version()))})")
        return
    try:
        dts = [_dtypes.parse(d).name for d in dtypes]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--dtype")
    specs = [jit.KernelSpec("paged_decode", d, hs, bs, attention._group_tile(g), arch=a)
             for a, d, hs, bs, g in itertools.product(archs, dts, head_size, block_size, group)]
    if precompile:
        built = jit.precompile(specs)
        for b in built:
            click.echo(f"{b.spec.name:48s} {'cached' if b.from_disk else 'compiled'} "
                       f"{b.seconds:7.2f} s  {b.path}")
        return
    gpu = _gpu_count() > 0
    click.echo(f"{'specialization':48s} {'cold compile':>13s} {'warm (disk)':>12s}"
               + (f" {'module load':>12s}" if gpu else ""))
    saved = os.environ.get("CUPAGED_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CUPAGED_CACHE_DIR"] = tmp  # a cold cache, whatever the user's holds
        try:
            for spec in specs:
                jit.clear_memory_caches()
                cold = jit.build(spec)
                jit.clear_memory_caches()
                warm = jit.build(spec)
                assert warm.from_disk
                row = f"{spec.name:48s} {cold.seconds:11.2f} s {warm.seconds * 1e3:9.2f} ms"
                if gpu and spec.arch == _default_arch():
                    import cupy

                    t0 = time.perf_counter()
                    jit.load(spec, cupy.cuda.Device().id, attention._decode_smem_bytes(spec))
                    row += f" {(time.perf_counter() - t0) * 1e3:9.2f} ms"
                click.echo(row)
        finally:
            jit.clear_memory_caches()
            if saved is None:
                os.environ.pop("CUPAGED_CACHE_DIR", None)
            else:
                os.environ["CUPAGED_CACHE_DIR"] = saved


def _default_arch() -> str:
    if _gpu_count():
        import cupy

        from . import attention

        return attention._device(cupy.cuda.Device().id).arch
    return "sm_90"


@main.command()
@click.option("--batch", callback=_int_list, default="64", show_default=True)
@click.option("--context", callback=_int_list, default="2048", show_default=True)
@click.option("--heads", type=click.IntRange(1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(1), default=8, show_default=True)
@click.option("--head-size", type=int, default=128, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--dtype", default="float16", show_default=True)
@click.option("--partition", default="auto", show_default=True,
              help="auto, never, always, or tokens per partition.")
@click.option("--reps", type=click.IntRange(3), default=30, show_default=True)
@click.option("--seed", type=int, default=0)
def decode(batch, context, heads, kv_heads, head_size, block_size, dtype, partition, reps, seed):
    """Time paged-attention decode; checks each result against the reference first."""
    import cupy

    from . import bench

    try:
        dt = _dtypes.parse(dtype)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--dtype")
    if heads % kv_heads:
        raise click.BadParameter("--heads must be a multiple of --kv-heads", param_hint="--heads")
    if partition not in ("auto", "never", "always"):
        try:
            partition = int(partition)
        except ValueError:
            raise click.BadParameter(f"expected auto, never, always or an int, got {partition!r}",
                                     param_hint="--partition")
    if not _gpu_count():
        click.echo("no GPU found: nothing to time", err=True)
        sys.exit(2)
    bw = bench.copy_bandwidth()
    click.echo(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write), same run")
    header = (f"{'specialization':40s} {'batch':>5s} {'context':>7s} {'median us':>10s} "
              f"{'p10-p90 us':>15s} {'GB/s':>7s} {'% copy':>7s} {'rel err':>8s}")
    click.echo(header)
    failed = 0
    for b, c in itertools.product(batch, context):
        case = bench.DecodeCase(b, np.full(b, c, np.int32), heads, kv_heads, head_size,
                                block_size, dt.numpy, seed).build()
        out = cupy.empty(case.arrays["query"].shape, case.arrays["query"].dtype)
        out.fill(float("nan"))
        case.run(out, partition)
        err = case.check(out)
        name = case.spec_name()
        if not err <= case.tolerance():
            failed += 1
            click.echo(f"{name:40s} {b:5d} {c:7d} FAILED: rel err {err:.2e} > {case.tolerance():.0e}")
            continue
        t = bench.time_us(lambda: case.run(out, partition), reps=reps)
        gbs = case.bytes_moved / (t.median_us * 1e-6) / 1e9
        click.echo(f"{name:40s} {b:5d} {c:7d} {t.median_us:10.1f} "
                   f"{t.p10_us:7.1f}-{t.p90_us:<7.1f} {gbs:7.0f} {100 * gbs * 1e9 / bw:6.1f}% "
                   f"{err:8.1e}")
        case.arrays.clear()
    sys.exit(1 if failed else 0)


@main.command("cache-ops")
@click.option("--dtype", default="float16", show_default=True)
@click.option("--kv-heads", type=click.IntRange(1), default=8, show_default=True)
@click.option("--head-size", type=int, default=128, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--tokens", type=click.IntRange(1), default=8192, show_default=True,
              help="Tokens written by reshape_and_cache.")
@click.option("--layers", type=click.IntRange(1), default=32, show_default=True,
              help="Layers covered by one copy_blocks launch.")
@click.option("--pairs", type=click.IntRange(1), default=256, show_default=True,
              help="Blocks copied / swapped per call.")
@click.option("--seqs", type=click.IntRange(1), default=256, show_default=True,
              help="Sequences in the PagedKVCache step timing.")
@click.option("--reps", type=click.IntRange(3), default=20, show_default=True)
def cache_ops(dtype, kv_heads, head_size, block_size, tokens, layers, pairs, seqs, reps):
    """Throughput of reshape_and_cache, copy_blocks and swap_blocks (against one copy per
    block), and the host time of one PagedKVCache decode step."""
    from . import bench

    try:
        dt = _dtypes.parse(dtype)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--dtype")
    if not _gpu_count():
        click.echo("no GPU found: nothing to time", err=True)
        sys.exit(2)
    bw = bench.copy_bandwidth()
    click.echo(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write), same run")
    click.echo(f"{'operation':44s} {'median us':>10s} {'GB/s':>8s} {'% copy':>7s}  check")
    failed = 0
    for row in bench.cache_op_rows(dt.numpy, kv_heads, head_size, block_size, tokens, layers,
                                   pairs, reps):
        pct = f"{100 * row.gbps * 1e9 / bw:6.1f}%" if row.vs_copy else "      -"
        click.echo(f"{row.name:44s} {row.median_us:10.1f} {row.gbps:8.1f} {pct}  "
                   f"{'ok' if row.ok else 'FAILED'}")
        failed += not row.ok
    us = bench.kv_cache_step_us(seqs, kv_heads, head_size, block_size, dt.numpy)
    for name, t in us.items():
        click.echo(f"{name:44s} {t:10.1f}        -       -  host time")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
