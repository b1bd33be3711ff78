"""cupaged-bench: measure cupaged on this machine's GPU."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import tempfile
import time

import click

from .. import __version__, _dtypes, jit


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


def _kv_cache_dtype_option(f):
    """--kv-cache-dtype (decode, compare, prefill)."""
    from .workloads import KV_CACHE_DTYPES

    return click.option(
        "--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto",
        show_default=True,
        help="The KV cache's element type: auto (the query's --dtype) or fp8 (fp8 is "
             "fp8_e4m3): random finite values with per-tensor scales, checked against "
             "the reference on the same bytes.")(f)


def _kv_cache_dtype(value: str, dt: _dtypes.DType) -> str:
    """The canonical --kv-cache-dtype ('fp8' -> 'fp8_e4m3') for queries of ``dt``; usage
    errors for a combination the kernels do not take."""
    from .workloads import kv_cache_dtype_name

    try:
        kv = kv_cache_dtype_name(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--kv-cache-dtype")
    if kv != "auto" and dt.itemsize != 2:
        raise click.BadParameter(f"an fp8 cache takes float16 or bfloat16 queries, not "
                                 f"{dt.numpy}", param_hint="--kv-cache-dtype")
    return kv


def _window_option(extra: str = ""):
    return click.option(
        "--window", type=int, default=None, metavar="W",
        help="Sliding window: a query at position p sees only the keys in (p - W, p] "
             "(FlashInfer's window_left = W - 1)." + extra)


def _dtype_option(default: str):
    """--dtype: the query's and a 16-bit cache's type."""
    return click.option("--dtype", type=click.Choice(["float16", "bfloat16"]), default=default,
                        show_default=True)


def _soft_cap_option(f):
    f = click.option("--soft-cap-approx", is_flag=True,
                     help="With --soft-cap: cupaged computes the cap's tanh by tanh.approx "
                          "(cupaged.SoftCap(C, approx=True), FlashInfer's form; each "
                          "capped logit within about 2^-11 C).")(f)
    return click.option("--soft-cap", type=float, default=None, metavar="C",
                        help="Logits soft cap: each logit becomes C * tanh(logit / C) "
                             "(Gemma 2), C > 0.")(f)


def _sinks_option(f):
    return click.option("--sinks", is_flag=True,
                        help="Attention sinks: one standard normal value per head (fixed "
                             "seed), natural-log units, added to the softmax denominator "
                             "only.")(f)


def _alibi_option(f):
    return click.option("--alibi", is_flag=True,
                        help="ALiBi: the standard slopes of --heads (2^(-8 i / heads) for a "
                             "power of two; cupaged.bench.workloads.alibi_slopes).")(f)


def _variants(window, soft_cap, soft_cap_approx=False, sinks=False, alibi=False):
    """The variant options as a workloads.Variants; usage errors for bad values."""
    from .workloads import Variants

    for hint, kw in (("--window", dict(window=window)), ("--soft-cap", dict(soft_cap=soft_cap)),
                     ("--soft-cap-approx", dict(soft_cap=soft_cap,
                                                soft_cap_approx=soft_cap_approx))):
        try:
            Variants(**kw)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=hint)
    return Variants(window, soft_cap, sinks, alibi, soft_cap_approx)


def _echo_variants(variants) -> None:
    """One line naming the variants and their conventions (nothing for plain attention)."""
    if not variants.plain:
        click.echo(f"variants: {variants.describe()}")


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _require_gpu():
    if not _gpu_count():
        click.echo("no GPU found: nothing to time", err=True)
        sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cupaged")
def main():
    """Benchmarks and checks for cupaged's paged-attention kernels."""


@main.command()
def info():
    """GPU, driver and library versions, and the kernel cache."""
    from .report import environment

    env = environment()
    for key in ("cupaged", "python", "numpy", "cupy", "nvrtc"):
        click.echo(f"{key:13s}{env[key]}")
    click.echo(f"{'torch':13s}{env['torch'] or 'not importable (optional)'}")
    click.echo(f"{'kernel cache':13s}{env['kernel_cache']} ({env['kernel_cache_kernels']} kernels, "
               f"{env['kernel_cache_mib']:.1f} MiB)")
    if not env["gpus"]:
        click.echo(f"{'gpu':13s}none found (kernels can still be compiled: "
                   "cupaged-bench compile --all)")
        return
    click.echo(f"{'driver':13s}{env['driver']}")
    click.echo(f"{'cuda runtime':13s}{env['cuda_runtime']}")
    for g in env["gpus"]:
        click.echo(f"{'gpu ' + str(g['index']):13s}{g['name']}, compute capability "
                   f"{g['compute_capability']}, {g['sms']} SMs, {g['memory_gib']:.0f} GiB")


# ---- compile ---------------------------------------------------------------------------------


def _default_arch() -> str:
    if _gpu_count():
        import cupy

        from .. import planning

        return planning.device_info(cupy.cuda.Device().id).arch
    return "sm_90"


# cupaged-bench compile --kernel: the kernel the listed shapes are of.
_COMPILE_KERNELS = {"decode": "paged_decode", "prefill": "paged_prefill",
                    "prefill-sm90": "paged_prefill_sm90"}


def _smem_bytes(spec) -> int:
    """A specialization's dynamic shared memory (its geometry mirror's)."""
    from ..specs import geometry

    mirror = {"paged_decode": geometry.DecodeGeometry, "paged_prefill": geometry.PrefillGeometry,
              "paged_prefill_sm90": geometry.Sm90PrefillGeometry}[spec.kernel]
    return mirror.of(spec).smem_bytes


@main.command("compile")
@click.option("--arch", "archs", multiple=True, help="Target, e.g. sm_90 (repeatable). "
              "Default: this machine's GPU, or sm_90 without one.")
@click.option("--all", "all_", is_flag=True,
              help="Compile every supported specialization with NVRTC (no GPU needed) and "
                   "print one summary line. Run it after changing a kernel template or a "
                   "geometry mirror: hours on two cores (--count says how many).")
@click.option("--covering", is_flag=True,
              help="Compile the covering set the test suite compiles: every value and every "
                   "pair of values of the kernels' axes, to PTX, and through ptxas to cubins "
                   "as many as it takes to assemble every inline-PTX form of the set on each "
                   "target (about a minute on two cores).")
@click.option("--optimized", is_flag=True,
              help="With --all or --covering: compile at the optimization kernels are built "
                   "with, not NVRTC's --Ofast-compile=max (which catches the same source and "
                   "target errors about 3.5x faster, but not resource use or failures of the "
                   "optimizer).")
@click.option("--count", is_flag=True,
              help="With --all or --covering: print how many specializations that is, "
                   "compiling nothing.")
@click.option("--dtype", "dtypes", multiple=True, default=("float16",), show_default=True)
@click.option("--head-size", callback=_int_list, default="128", show_default=True)
@click.option("--block-size", callback=_int_list, default="16", show_default=True)
@click.option("--group", callback=_int_list, default="4", show_default=True,
              help="Query heads per KV head.")
@click.option("--precompile", is_flag=True,
              help="Compile the listed shapes into the kernel cache for deployment.")
@click.option("--kernel", type=click.Choice(list(_COMPILE_KERNELS)), default="decode",
              show_default=True,
              help="Which kernel the listed shapes are of: decode (paged_decode), prefill "
                   "(paged_prefill, mma.sync) or prefill-sm90 (paged_prefill_sm90, built for "
                   "sm_90a: the targets' sm_90, or sm_90 without one).")
def compile_(archs, all_, covering, optimized, count, dtypes, head_size, block_size, group,
             precompile, kernel):
    """Compile kernels: the --all or --covering check, or cold/warm timings of the listed
    shapes."""
    from .. import planning
    from ..specs import catalog, geometry
    from ..specs.covering import cover_sets

    if not archs:
        archs = (_default_arch(),)
    for flag, given in (("--optimized", optimized), ("--count", count)):
        if given and not (all_ or covering):
            raise click.UsageError(f"{flag} goes with --all or --covering")
    if all_ or covering:
        full = catalog.all_specs(archs)
        specs = full if all_ else catalog.covering_specs(archs)
        if count:
            click.echo(f"{len(specs)} specializations"
                       + ("" if all_ else f" in the covering set of the {len(full)} supported")
                       + f" for {', '.join(archs)}")
            return
        try:
            if all_ or optimized:  # every cubin
                n, secs = jit.compile_check(specs, fast=not optimized)
                cubins = n
            else:  # every spec to PTX; cubins of a few running every inline-PTX form
                forms, secs = jit.ptx_forms(specs)
                runs = [frozenset((s.arch, f) for f in forms[s]) for s in specs]
                chosen = [specs[i] for i in cover_sets(runs)]
                cubins, more = jit.compile_check(chosen)
                n, secs = len(specs), secs + more
            if all_:  # the geometry mirror agrees with the kernel for every decode spec
                geometry.check_against_kernel(s for s in specs if s.kernel == "paged_decode")
        except (jit.CompileError, AssertionError) as e:
            click.echo(str(e), err=True)
            sys.exit(1)
        what = "" if all_ else (f" (a pairwise covering set of the {len(full)} supported, "
                                f"{cubins} through ptxas)")
        how = ", ".join(("NVRTC " + ".".join(map(str, jit.nvrtc_version())),
                         *(() if optimized else jit.check_options())))
        click.echo(f"compiled {n} specializations{what} for {', '.join(archs)} in {secs:.1f} s "
                   f"({how})")
        return
    try:
        dts = [_dtypes.parse(d).name for d in dtypes]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--dtype")
    if kernel == "decode":
        specs = [jit.KernelSpec("paged_decode", d, hs, bs, planning.group_tile(g), arch=a)
                 for a, d, hs, bs, g in itertools.product(archs, dts, head_size, block_size,
                                                          group)]
    else:
        name = _COMPILE_KERNELS[kernel]
        axes = catalog.AXES[name]
        for opt, values, allowed in (("--dtype", dts, axes["dtype"]),
                                     ("--head-size", head_size, axes["head_size"]),
                                     ("--block-size", block_size, axes["block_size"])):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise click.BadParameter(f"{name} takes {', '.join(map(str, allowed))}; got "
                                         f"{', '.join(map(str, bad))}", param_hint=opt)
        targets = catalog.kernel_archs(name, archs if kernel == "prefill" else (*archs, "sm_90"))
        specs = [jit.KernelSpec(name, d, hs, bs, arch=a)
                 for a, d, hs, bs in itertools.product(targets, dts, head_size, block_size)]
    if precompile:
        for b in jit.precompile(specs):
            click.echo(f"{b.spec.name:48s} {'cached' if b.from_disk else 'compiled'} "
                       f"{b.seconds:7.2f} s  {b.path or '(kept in memory: cache folder not writable)'}")
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
                if gpu and spec.arch.rstrip("a") == _default_arch():
                    import cupy

                    t0 = time.perf_counter()
                    jit.load(spec, cupy.cuda.Device().id, _smem_bytes(spec))
                    row += f" {(time.perf_counter() - t0) * 1e3:9.2f} ms"
                click.echo(row)
        finally:
            jit.clear_memory_caches()
            if saved is None:
                os.environ.pop("CUPAGED_CACHE_DIR", None)
            else:
                os.environ["CUPAGED_CACHE_DIR"] = saved


# ---- decode / compare ---------------------------------------------------------------------------


def _workload_options(f):
    """The options that describe a sweep of decode workloads (decode and compare)."""
    from .workloads import PRESETS

    opts = [
        click.option("--preset", "presets", multiple=True, type=click.Choice(sorted(PRESETS)),
                     help="Model shape (heads / kv heads / head size); repeatable. "
                          "Overrides --heads, --kv-heads, --head-size."),
        click.option("--batch", callback=_int_list, default="64", show_default=True,
                     help="Batch sizes, comma-separated."),
        click.option("--context", callback=_int_list, default="2048", show_default=True,
                     help="Context lengths, comma-separated."),
        click.option("--context-dist", default=None,
                     help="Mixed lengths instead of --context: uniform:LO:HI."),
        click.option("--row", "rows", multiple=True, callback=_rows, metavar="H/KVH/B/CTX",
                     help="One shape, repeatable, instead of the product of the presets, "
                          "--batch and --context: query heads / KV heads / batch / "
                          "context (tokens, or uniform:LO:HI), head size --head-size; "
                          "e.g. --row 32/8/64/2048 --row 8/1/64/4096, all in one run."),
        click.option("--heads", type=click.IntRange(1), default=32, show_default=True),
        click.option("--kv-heads", type=click.IntRange(1), default=8, show_default=True),
        click.option("--head-size", type=int, default=128, show_default=True),
        click.option("--block-size", type=int, default=16, show_default=True),
        click.option("--dtype", default="float16", show_default=True),
        _kv_cache_dtype_option,
        _window_option(" Bytes moved and % copy then count only the keys a query sees: "
                       "min(context, W) tokens per sequence."),
        _soft_cap_option,
        _sinks_option,
        _alibi_option,
        click.option("--partition", default="auto", show_default=True,
                     help="auto, never, always, flat (decode's flat split), or tokens per "
                          "partition."),
        click.option("--reps", type=click.IntRange(3), default=30, show_default=True),
        click.option("--seed", type=int, default=0),
        click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
                     help="Write every field and the environment as JSON."),
        click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
                     help="Write every field as CSV (environment as # comment lines)."),
        click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
                     help="Plot % of copy bandwidth against context (needs matplotlib)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _rows(ctx, param, value):
    """--row values as (heads, kv_heads, batch, context) with context tokens or (lo, hi)."""
    from .workloads import parse_context_dist

    rows = []
    for v in value:
        parts = v.split("/")
        try:
            if len(parts) != 4:
                raise ValueError
            h, kvh, b = (int(x) for x in parts[:3])
            c = parse_context_dist(parts[3]) if ":" in parts[3] else int(parts[3])
        except ValueError:
            raise click.BadParameter(f"expected HEADS/KV_HEADS/BATCH/CONTEXT (CONTEXT tokens or "
                                     f"uniform:LO:HI), e.g. 32/8/64/2048, got {v!r}") from None
        if min(h, kvh, b) < 1 or (isinstance(c, int) and c < 1):
            raise click.BadParameter(f"heads, kv heads, batch and context must be positive, "
                                     f"got {v!r}")
        if h % kvh:
            raise click.BadParameter(f"query heads must be a multiple of KV heads, got {v!r}")
        rows.append((h, kvh, b, c))
    return tuple(rows)


def _workloads(presets, batch, context, context_dist, heads, kv_heads, head_size, block_size,
               dtype, kv_cache_dtype="auto", variants=None, rows=()):
    """Expand the options into workloads (``rows``: --row's shapes instead of the product
    of the presets, batches and contexts); usage errors for impossible combinations."""
    from .workloads import PRESETS, Workload, parse_context_dist

    try:
        dt = _dtypes.parse(dtype)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--dtype")
    kv = _kv_cache_dtype(kv_cache_dtype, dt)
    extra = {} if variants is None else dict(variants=variants)
    if rows:
        if presets or context_dist is not None:
            raise click.UsageError("--row gives whole shapes: not with --preset or --context-dist")
        return [Workload(b, c, h, kvh, head_size, block_size, dt.numpy.name, "", kv, **extra)
                for h, kvh, b, c in rows]
    if context_dist is not None:
        try:
            contexts = [parse_context_dist(context_dist)]
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--context-dist")
    else:
        contexts = context
    shapes = [(p, *PRESETS[p]) for p in presets] or [("", heads, kv_heads, head_size)]
    for _, h, kvh, _ in shapes:
        if h % kvh:
            raise click.BadParameter("--heads must be a multiple of --kv-heads", param_hint="--heads")
    return [Workload(b, c, h, kvh, hs, block_size, dt.numpy.name, p, kv, **extra)
            for (p, h, kvh, hs), b, c in itertools.product(shapes, batch, contexts)]


def _partition(value):
    if value in ("auto", "never", "always", "flat"):
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"expected auto, never, always, flat or an int, got {value!r}",
                                 param_hint="--partition")


def _sweep(workloads, impls, partition, reps, seed, json_path, csv_path, plot_path, title,
           summary=False):
    """Run, print the table, write the files; exit 1 if any check failed."""
    from . import decode, report, timing

    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise click.UsageError("--plot needs matplotlib: pip install 'cupaged[plot]'")
    _require_gpu()
    bw = timing.copy_bandwidth()
    click.echo(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write), same run")
    _echo_kv_cache(workloads[0].kv_cache_dtype if workloads else "auto")
    if workloads:
        _echo_variants(workloads[0].variants)
    results = []
    with click.progressbar(workloads, label="measuring", file=sys.stderr,
                           item_show_func=lambda w: w and f"batch {w.batch} ctx {w.context_label}") as bar:
        for w in bar:
            results += decode.measure(w, impls, partition, reps, seed, bw)
    if summary:
        for line in report.summary_lines(results):
            click.echo(line)
    else:
        _print_table(results, compare=len(impls) > 1)
    env = report.environment()
    if json_path:
        report.write_json(json_path, results, env, bw / 1e9)
    if csv_path:
        report.write_csv(csv_path, results, env, bw / 1e9)
    if plot_path:
        report.write_plot(plot_path, results, title)
    failed = [r for r in results if r.status == "failed"]
    skipped = [r for r in results if r.status == "skipped"]
    if skipped:
        click.echo(f"{len(skipped)} rows skipped (see their notes)")
    # 0: everything ran and passed its check; 1: a check failed; 3: some rows did not run.
    sys.exit(1 if failed else 3 if skipped else 0)


def _echo_kv_cache(kv_cache_dtype: str):
    """One line naming an fp8 cache and its scales (nothing for a 16-bit one)."""
    from . import workloads

    if kv_cache_dtype != "auto":
        s = workloads.FP8_SCALES[kv_cache_dtype]
        click.echo(f"KV cache {kv_cache_dtype}: random finite values, per-tensor scales "
                   f"k_scale = v_scale = {s:g}")


def _fmt(v, spec):
    return "-" if v != v else format(v, spec)  # NaN -> '-'


def _print_table(results, compare: bool):
    plan = any(r.plan_us == r.plan_us for r in results)  # a column only when some row planned
    head = (f"{'implementation':20s} {'kernel':38s} {'shape':12s} {'batch':>5s} {'context':>10s} "
            f"{'median us':>10s} {'p10-p90 us':>17s} {'GB/s':>7s} {'% copy':>7s} {'rel err':>8s}")
    if compare:
        head += f" {'x cupaged':>9s}"
    if plan:
        head += f" {'plan us':>8s}"
    click.echo(head)
    for r in results:
        shape = f"{r.heads}/{r.kv_heads}/{r.head_size}"
        line = (f"{r.impl:20s} {r.kernel or '-':38s} {shape:12s} {r.batch:5d} {r.context:>10s} ")
        if r.status != "ok":
            click.echo(line + f"{r.status.upper()}: {r.note}")
            continue
        line += (f"{r.median_us:10.1f} {_fmt(r.p10_us, '8.1f')}-{_fmt(r.p90_us, '<8.1f')} "
                 f"{r.gbps:7.0f} {r.pct_copy:6.1f}% {r.rel_err:8.1e}")
        if compare:
            line += f" {_fmt(r.ratio_to_cupaged, '9.2f')}"
        if plan:
            line += f" {_fmt(r.plan_us, '8.1f'):>8s}"
        if r.note:  # why an ok row is special (a looser check)
            line += f"  {r.note}"
        click.echo(line)


def _int_tuples(values, lengths, hint: str) -> tuple:
    """'4,2,64,2' values -> tuples of ints, each of one of ``lengths``."""
    out = []
    for v in values:
        try:
            t = tuple(int(x) for x in v.split(","))
            if len(t) not in lengths or min(t) < 1:
                raise ValueError
        except ValueError:
            raise click.BadParameter(f"expected {' or '.join(map(str, lengths))} positive "
                                     f"integers, comma-separated, got {v!r}",
                                     param_hint=hint) from None
        out.append(t)
    return tuple(out)


def _split_tokens(values) -> tuple:
    """--split values: None for 'auto', else tokens per partition (0: a single pass)."""
    out = []
    for v in values:
        if v != "auto" and not v.isdigit():
            raise click.BadParameter(f"expected auto or tokens per partition, got {v!r}",
                                     param_hint="--split")
        out.append(None if v == "auto" else int(v))
    return tuple(out)


def _tile(ctx, param, value):
    if value is None:
        return None
    try:
        tt, st = (int(v) for v in value.lower().split("x"))
    except ValueError:
        raise click.BadParameter(f"expected TOKENSxSTAGES such as 32x3, got {value!r}") from None
    if tt not in (32, 64, 128, 256) or not 2 <= st <= 8:
        raise click.BadParameter(f"tokens must be 32, 64, 128 or 256 and stages 2..8, got {value}")
    return tt, st


def _tuning_options(f):
    """--tile and --ctas-per-sm (decode and compare: cupaged's rows)."""
    f = click.option("--ctas-per-sm", type=click.IntRange(1, 32), default=None,
                     help="Tuning: at most this many decode CTAs resident per SM (the launch "
                          "reserves shared memory to enforce it); the split model plans "
                          "with it.")(f)
    return click.option("--tile", default=None, callback=_tile, metavar="TOKENSxSTAGES",
                        help="Tuning: force the decode kernels' tile (tokens) and pipeline "
                             "depth, e.g. 32x3, instead of the default for the dtype and "
                             "head size.")(f)


@main.command()
@_workload_options
@_tuning_options
def decode(presets, batch, context, context_dist, rows, heads, kv_heads, head_size, block_size,
           dtype, kv_cache_dtype, window, soft_cap, soft_cap_approx, sinks, alibi, partition,
           reps, seed, json_path, csv_path, plot_path, tile, ctas_per_sm):
    """Time paged-attention decode over a sweep; each result is checked against the
    float64 reference (with the same variants) before it is timed."""
    from .. import planning

    variants = _variants(window, soft_cap, soft_cap_approx, sinks, alibi)
    ws = _workloads(presets, batch, context, context_dist, heads, kv_heads, head_size,
                    block_size, dtype, kv_cache_dtype, variants, rows)
    planning.set_tuning(tile, ctas_per_sm)
    kv = ws[0].kv_cache_dtype if ws else "auto"
    _sweep(ws, ["cupaged"], _partition(partition), reps, seed, json_path, csv_path, plot_path,
           "cupaged decode" + ("" if kv == "auto" else f", {kv} cache")
           + (f", {variants.label()}" if not variants.plain else ""))


@main.command()
@_workload_options
@click.option("--impl", "impls", multiple=True,
              help="Implementations to run (default: every one available here).")
@_tuning_options
@click.option("--summary", is_flag=True,
              help="Instead of the full table (which --json and --csv keep), one line per "
                   "workload: cupaged's time and % copy, each other implementation's time "
                   "over cupaged's, FlashInfer's plan() host times; then the notes of the "
                   "rows that did not run or failed their check.")
def compare(presets, batch, context, context_dist, rows, heads, kv_heads, head_size, block_size,
            dtype, kv_cache_dtype, window, soft_cap, soft_cap_approx, sinks, alibi, partition,
            reps, seed, json_path, csv_path, plot_path, impls, tile, ctas_per_sm, summary):
    """The same workloads through every implementation available here, on the same data:
    cupaged, a CuPy gather-then-attend baseline, (when torch is importable) torch SDPA
    over gathered pages and over dense contiguous KV, and (when FlashInfer is importable)
    FlashInfer's batch decode on CUDA cores and on tensor cores and its XQA kernel, whose
    plan() host time is reported apart. Ratios are time / cupaged's time. Over an fp8
    cache the peers without an fp8 path (the gather baselines; XQA for e5m2) are left out;
    with variants, those that cannot run them (the gather baselines for any; FlashInfer's
    decode, which gets window_left and logits_soft_cap, for sinks and ALiBi; XQA, which
    gets window_left and sinks, for soft-cap and ALiBi)."""
    from . import decode, peers, workloads

    variants = _variants(window, soft_cap, soft_cap_approx, sinks, alibi)
    ws = _workloads(presets, batch, context, context_dist, heads, kv_heads, head_size,
                    block_size, dtype, kv_cache_dtype, variants, rows)
    kv = workloads.kv_cache_dtype_name(kv_cache_dtype)
    known = list(decode.IMPLEMENTATIONS)
    for i in impls:
        if i not in known:
            raise click.BadParameter(f"unknown implementation {i!r}: expected {', '.join(known)}",
                                     param_hint="--impl")
        why = decode.fp8_unsupported(i, kv)
        if why:
            raise click.BadParameter(f"--kv-cache-dtype {kv}: {why}", param_hint="--impl")
        why = decode.variant_unsupported(i, variants)
        if why:
            raise click.BadParameter(why, param_hint="--impl")
    asked_fi = [i for i in impls if i in decode.FLASHINFER_IMPLS]
    gpu = _gpu_count() > 0
    why = peers.flashinfer_unavailable() if asked_fi or (gpu and not impls) else None
    if why and asked_fi:
        raise click.UsageError(f"--impl {asked_fi[0]} needs FlashInfer (pip install "
                               f"flashinfer-python) and torch with CUDA: {why}")
    if why:  # one line for all of them, not a skipped row per workload
        click.echo(f"flashinfer rows skipped: {why}")
    if not impls:  # one line each for the peers an fp8 cache or the variants leave out
        no_fp8 = [i for i in known if decode.fp8_unsupported(i, kv)]
        if no_fp8:
            click.echo(f"no fp8 cache path, left out: {', '.join(no_fp8)}")
        no_var = [i for i in known if not decode.fp8_unsupported(i, kv)
                  and decode.variant_unsupported(i, variants)
                  and not (why and i in decode.FLASHINFER_IMPLS)]
        if no_var:
            click.echo(f"cannot run {variants.label()}, left out: {', '.join(no_var)}")
    chosen = list(impls) or (decode.available_implementations(kv, variants) if gpu else
                             [i for i in known if not decode.unsupported(i, kv, variants)])
    if "cupaged" in chosen:  # first, so the others' ratios refer to it
        chosen = ["cupaged"] + [i for i in chosen if i != "cupaged"]
    title = "decode: " + ", ".join(dict.fromkeys(w.preset or f"{w.heads}/{w.kv_heads}/{w.head_size}"
                                                   for w in ws))
    if kv != "auto":
        title += f" ({kv} cache)"
    if not variants.plain:
        title += f" ({variants.label()})"
    from .. import planning

    planning.set_tuning(tile, ctas_per_sm)
    _sweep(ws, chosen, _partition(partition), reps, seed, json_path, csv_path, plot_path, title,
           summary)


# ---- multi-token steps ----------------------------------------------------------------------------


@main.command()
@click.option("--preset", "presets", multiple=True,
              help="Named shapes (default: all): " + ", ".join(
                  ["prompt-4096", "prompt-16384", "8x2048", "4x4096-mha", "chunk-512-of-8192",
                   "verify-64x4x2048"]))
@click.option("--impl", "impls", multiple=True,
              help="cupaged, cupaged-mma (the mma.sync kernel on Hopper too), cupaged-sm90 "
                   "(Hopper's wgmma kernel wherever it applies, few rows included), "
                   "flashinfer-fa2, flashinfer-fa3, torch-sdpa-flash, torch-sdpa-cudnn "
                   "(default: cupaged and every peer that imports).")
@click.option("--batch", type=click.IntRange(1), default=None, help="A custom shape: sequences.")
@click.option("--query-len", type=click.IntRange(1), default=None,
              help="A custom shape: new tokens per sequence.")
@click.option("--context", type=click.IntRange(1), default=None,
              help="A custom shape: cached tokens per sequence, the new ones included "
                   "(default: the query length, a whole prompt).")
@click.option("--heads", type=click.IntRange(1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(1), default=8, show_default=True)
@click.option("--head-size", type=int, default=128, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@_kv_cache_dtype_option
@click.option("--kv-layout", type=click.Choice(["NHD", "HND", "vllm"]), default="NHD",
              show_default=True, help="The caches' layout (the peers read NHD only: with "
                                      "another they are left out).")
@click.option("--non-causal", is_flag=True, help="Every query token sees every key.")
@_window_option(" TFLOP/s then count only the (query, key) pairs inside the window and "
                "the causal limit; % copy only the keys some query sees.")
@_soft_cap_option
@_sinks_option
@_alibi_option
@click.option("--reps", type=click.IntRange(3), default=20, show_default=True)
@click.option("--tile", "tiles", multiple=True, callback=lambda c, p, v: _int_tuples(
                  v, (5, 4, 2), "--tile"), metavar="W,M,N,S[,K]|N,S",
              help="Tuning, repeatable (each tile's rows in turn, labelled): the multi-token "
                   "kernel's tile instead of the planner's, warps,m_atoms,tile_tokens,stages"
                   "[,key_warps] of paged_prefill (the mma.sync kernel, e.g. 4,2,64,2, or "
                   "4,1,64,2,4: four warps sharing 16 rows) or tile_tokens,stages of "
                   "Hopper's paged_prefill_sm90 (e.g. 128,3).")
@click.option("--split", "splits", multiple=True, metavar="auto|TOKENS",
              callback=lambda c, p, v: _split_tokens(v),
              help="Tuning, repeatable (with each tile, labelled): the multi-token kernels' "
                   "split-KV, tokens per partition (0: a single pass; rounded up to the "
                   "kernel's tile) instead of the planner's (auto).")
def prefill(presets, impls, batch, query_len, context, heads, kv_heads, head_size, block_size,
            dtype, kv_cache_dtype, kv_layout, non_causal, window, soft_cap, soft_cap_approx,
            sinks, alibi, reps, tiles, splits):
    """Prefill, chunked prefill and verify: cupaged.attention beside FlashInfer's paged
    prefill (fa2, fa3) and torch SDPA, each checked against the float64 reference first.
    TFLOP/s count useful FLOPs only; the bf16 matmul rate and the copy bandwidth are
    measured in the same run. Over an fp8 cache (--kv-cache-dtype; the presets keep
    their query types) torch SDPA, which has no fp8 path, is left out; with --window,
    --soft-cap, --sinks or --alibi it is too (plain attention only), and FlashInfer (which
    gets window_left = W - 1 and logits_soft_cap) with --sinks or --alibi."""
    from . import prefill, peers, timing, workloads

    variants = _variants(window, soft_cap, soft_cap_approx, sinks, alibi)

    kv = workloads.kv_cache_dtype_name(kv_cache_dtype)
    if kv != "auto" and (batch or query_len):  # a custom shape's --dtype (presets: 16 bits)
        try:
            dt = _dtypes.parse(dtype)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--dtype")
        kv = _kv_cache_dtype(kv, dt)
    _require_gpu()
    cases = []
    if batch or query_len:
        if not (batch and query_len):
            raise click.BadParameter("a custom shape needs --batch and --query-len")
        ctx = context or query_len
        if ctx < query_len:
            raise click.BadParameter("--context counts the new tokens: at least --query-len")
        cases.append(prefill.PrefillCase(
            f"{batch}x{query_len}/{ctx}", batch, query_len, ctx, heads, kv_heads, head_size,
            block_size, dtype, not non_causal, kv, variants, kv_layout))
    for name in presets or (() if cases else tuple(prefill.PRESETS)):
        if name not in prefill.PRESETS:
            raise click.BadParameter(f"unknown preset {name!r}", param_hint="--preset")
        kw = prefill.PRESETS[name]
        cases.append(prefill.PrefillCase(name, causal=not non_causal, kv_cache_dtype=kv,
                                               variants=variants, kv_layout=kv_layout, **kw))
    if not impls:
        impls = ["cupaged"]
        if peers.import_torch() is not None and kv == "auto":  # SDPA: no fp8 cache path
            impls += ["torch-sdpa-flash", "torch-sdpa-cudnn"]
        if peers.flashinfer_unavailable() is None:
            impls += ["flashinfer-fa2", "flashinfer-fa3"]
        left_out = [i for i in impls if prefill.variant_unsupported(i, variants, kv_layout)]
        if left_out:
            click.echo(f"cannot run {variants.label()} on {kv_layout}, left out: "
                       f"{', '.join(left_out)}")
            impls = [i for i in impls if i not in left_out]
    bw = timing.copy_bandwidth()
    mm = prefill.matmul_tflops()
    click.echo(f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s (same run)")
    _echo_kv_cache(kv)
    _echo_variants(variants)
    click.echo(f"{'shape':20s} {'implementation':18s} {'median us':>10s} {'TFLOP/s':>8s} "
               f"{'% mm':>6s} {'% copy':>7s} {'error':>8s}  note")
    from .. import planning

    wrong = 0
    for tile, split in itertools.product(tiles or (None,), splits or (None,)):
        if tile is not None and len(tile) == 4:
            tile += (1,)  # warps on rows of their own
        label = ""
        if tile is not None:
            label = " " + (jit.prefill_tile_name(tile) if len(tile) == 5
                           else "n{}x{}".format(*tile))
        if split is not None:
            label += f" split={split}"
        if tile is not None:
            (planning.set_prefill_tile if len(tile) == 5 else planning.set_sm90_tile)(tile)
        planning.set_prefill_split(split)
        try:
            rows = prefill.measure(cases, impls, reps, bw)
        finally:
            planning.set_prefill_tile(None)
            planning.set_sm90_tile(None)
            planning.set_prefill_split(None)
        for r in rows:
            click.echo(f"{r.case:20s} {r.impl + label:18s} {r.median_us:10.1f} {r.tflops:8.1f} "
                       f"{100 * r.tflops / mm:5.1f}% {r.pct_copy:6.1f}% {r.error:8.1e}  {r.note}")
            wrong += r.note == "WRONG"
    sys.exit(1 if wrong else 0)


# ---- multi-head latent attention ------------------------------------------------------------------


def _mla_options(f):
    """The options of ``mla``; its choices come from cupaged.bench.mla."""
    from .mla import DTYPES, IMPLEMENTATIONS, KV_CACHE_DTYPES, PRESETS

    opts = [
        click.option("--preset", "presets", multiple=True, type=click.Choice(list(PRESETS)),
                     help="Named shapes, DeepSeek-V3 absorbed (repeatable; default all, or "
                          "none with a custom shape)."),
        click.option("--impl", "impls", multiple=True, type=click.Choice(list(IMPLEMENTATIONS)),
                     help="Implementations to run (repeatable; default cupaged): FlashInfer's "
                          "BatchMLAPagedAttentionWrapper with its fa2 or fa3 backend."),
        click.option("--heads", type=click.IntRange(1), default=None,
                     help="A custom shape: query heads (default 16)."),
        click.option("--batch", type=click.IntRange(1), default=None,
                     help="A custom shape: sequences (default 128)."),
        click.option("--context", type=click.IntRange(1), default=None,
                     help="A custom shape: cached tokens per sequence, the query tokens "
                          "included (default 4096)."),
        click.option("--q-len", type=click.IntRange(1), default=None,
                     help="A custom shape: query tokens per sequence, causal (default 1)."),
        click.option("--page-size", type=click.IntRange(1), default=64, show_default=True,
                     help="Tokens per cache page, every shape."),
        click.option("--dtype", type=click.Choice(DTYPES), default="bfloat16",
                     show_default=True, help="q, the latent cache and out, every shape."),
        click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto",
                     show_default=True,
                     help="The latent cache: the query's dtype, or fp8 (per-tensor scale "
                          "1/64, written by concat_and_cache_mla; cupaged rows only)."),
        click.option("--reps", type=click.IntRange(3), default=20, show_default=True),
        click.option("--tile", "tiles", multiple=True, metavar="R,T,S|all",
                     help="Tuning, repeatable: mla_attention's mma.sync kernel in this tile "
                          "(rows, tile_tokens, stages, e.g. 16,32,4) instead of the "
                          "planner's choice; 'all': every 16- or 32-token tile of 2 to 4 "
                          "stages this GPU's shared memory holds, in the fewest rows of 16, "
                          "32, 64 that hold a case's packed rows. Each row is labelled with "
                          "its tile and how many CTAs an SM holds (/SM)."),
        click.option("--split", "splits", multiple=True, metavar="auto|TILES",
                     help="Tuning, repeatable: mla_attention's split-KV, tiles per partition "
                          "(0: a single pass) instead of the planner's (auto)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _mla_tuned(cases, impls, reps, bw, tiles, splits):
    """mla.measure under every (tile, split) override asked for, each row's impl labelled
    with them; tiles that do not fit the GPU are skipped with a line saying so."""
    import cupy

    from .. import planning
    from ..specs import geometry
    from . import mla

    dev = planning.device_info(cupy.cuda.Device().id)
    rows = []
    for case in cases:
        if "all" in tiles:
            need = case.heads * case.q_len
            r = min(64, max(16, 1 << (need - 1).bit_length()))
            shapes = [(r, t, st) for t in (16, 32) for st in (2, 3, 4)]
        else:
            shapes = [tuple(int(x) for x in t.split(",")) for t in tiles] or [None]
        for tile in shapes:
            per_sm = ""
            if tile is not None:
                g = geometry.MlaGeometry(512, 64, *tile, case.cache_itemsize)
                if not g.fits(dev.arch):
                    click.echo(f"{case.name}: tile {tile} does not fit {dev.arch}'s shared "
                               f"memory, skipped")
                    continue
                try:  # CTAs an SM holds (shared memory and registers: the occupancy API)
                    cache = ("bf16" if case.dtype == "bfloat16" else "f16") if not case.fp8 \
                        else case.kv_cache_dtype.split("_")[1]
                    k = planning.mla_kernel(cupy.cuda.Device().id,
                                            "bf16" if case.dtype == "bfloat16" else "f16",
                                            cache, 512, 64, case.block_size, tile)
                    per_sm = f" {k.slots // dev.sm_count}/SM"
                except Exception:  # noqa: BLE001 - the row itself says why it cannot run
                    per_sm = ""
            for split in splits or ("auto",):
                planning.set_mla_tile(tile)
                planning.set_mla_split(None if split == "auto" else int(split))
                try:
                    got = mla.measure([case], impls, reps, bw)
                finally:
                    planning.set_mla_tile(None)
                    planning.set_mla_split(None)
                label = ("" if tile is None else " r{}t{}x{}".format(*tile) + per_sm) + \
                    ("" if split == "auto" and not splits else f" split={split}")
                for r in got:
                    r.impl += label
                rows += got
    return rows


def _mla_row(r, mm: float) -> str:
    """One table row ('-' for what a row that did not run lacks)."""
    spread = "-" if r.p10_us != r.p10_us else f"{r.p10_us:8.1f}-{r.p90_us:<8.1f}"
    return (f"{r.case:20s} {r.impl:16s} {_fmt(r.median_us, '.1f'):>10s} {spread:>17s} "
            f"{_fmt(r.tflops, '.1f'):>8s} "
            f"{_fmt(100 * r.tflops / mm, '.1f'):>5s}% {_fmt(r.pct_copy, '.1f'):>6s}% "
            f"{_fmt(r.error, '.1e'):>8s}  {r.note}").rstrip()


@main.command()
@_mla_options
def mla(presets, impls, heads, batch, context, q_len, page_size, dtype, kv_cache_dtype, reps,
        tiles, splits):
    """Absorbed multi-head latent attention (DeepSeek's MLA) decode over a paged latent
    cache: cupaged.mla_attention beside FlashInfer's BatchMLAPagedAttentionWrapper (fa2,
    fa3), on the same bytes (FlashInfer's ckv and kpe caches are views of the combined
    [blocks, page, 512 + 64] cache), scale 1/sqrt(192), random normal data, shuffled
    blocks. Each is checked against the float64 reference (the first, middle and last
    sequences, every head) before it is timed. % copy counts the latent cache read once
    plus q and out against the copy bandwidth; TFLOP/s count 2 * (576 + 512) FLOPs per
    (head, visible key), against the bf16 matmul rate; both measured in the same run. A
    FlashInfer row that cannot run (not installed, a shape it refuses) says why.
    Exit status 1 when a check failed, 3 when some row did not run."""
    from . import mla

    cases = []
    custom = {k: v for k, v in dict(heads=heads, batch=batch, context=context,
                                    q_len=q_len).items() if v is not None}
    try:
        if custom:
            case = mla.MLACase("", block_size=page_size, dtype=dtype,
                               kv_cache_dtype=kv_cache_dtype, **custom)
            case.name = f"{case.heads}h-{case.batch}x{case.q_len}/{case.context}"
            cases.append(case)
        for name in dict.fromkeys(presets or (() if cases else mla.PRESETS)):
            cases.append(mla.preset_case(name, page_size, dtype, kv_cache_dtype))
    except ValueError as e:
        raise click.UsageError(str(e))
    impls = list(dict.fromkeys(impls or ["cupaged"]))
    for t in tiles:
        if t != "all":
            _int_tuples([t], (3,), "--tile")
    for sp in splits:
        if sp != "auto" and not sp.isdigit():
            raise click.BadParameter(f"expected auto or tiles per partition, got {sp!r}",
                                     param_hint="--split")
    if tiles or splits:
        _mla_table(cases, lambda bw: _mla_tuned(cases, impls, reps, bw, tiles, splits))
    else:
        _mla_table(cases, lambda bw: mla.measure(cases, impls, reps, bw))


def _mla_table(cases, measure) -> None:
    """Measure the ceilings, print each case and the rows ``measure(copy bandwidth)``
    gives (mla.Row), and exit: 0 when everything ran and passed its check, 1 when a check
    failed, 3 when some row did not run."""
    from . import prefill, timing

    _require_gpu()
    bw = timing.copy_bandwidth()
    mm = prefill.matmul_tflops()
    click.echo(f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s (same run)")
    for c in cases:
        click.echo(c.describe())
    click.echo(f"{'shape':20s} {'implementation':16s} {'median us':>10s} {'p10-p90 us':>17s} "
               f"{'TFLOP/s':>8s} {'% mm':>6s} {'% copy':>7s} {'error':>8s}  note")
    rows = measure(bw)
    for r in rows:
        click.echo(_mla_row(r, mm))
    sys.exit(1 if any(r.note == "WRONG" for r in rows) else
             0 if all(r.ran for r in rows) else 3)


def _sparse_mla_options(f):
    """The options of ``sparse-mla``; its choices come from cupaged.bench.sparse_mla."""
    from .sparse_mla import IMPLEMENTATIONS, KV_CACHE_DTYPES, PRESETS

    opts = [
        click.option("--preset", "presets", multiple=True, type=click.Choice(list(PRESETS)),
                     help="Named shapes, DeepSeek-V3.2's (repeatable; default all)."),
        click.option("--impl", "impls", multiple=True, type=click.Choice(list(IMPLEMENTATIONS)),
                     help="cupaged (the planner's kernel), cupaged-mma (mma.sync), "
                          "cupaged-sm90 (wgmma wherever it applies) or flashmla (FlashMLA's "
                          "Hopper sparse kernels, where flash_mla imports: decode over "
                          "fp8_ds_mla, prefill over bfloat16, 64 or 128 heads): repeatable, "
                          "default cupaged."),
        click.option("--kv-cache-dtype", "kv_cache_dtypes", multiple=True,
                     type=click.Choice(KV_CACHE_DTYPES),
                     help="The latent cache: bfloat16 ('auto'), DeepSeek-V3.2's fp8_ds_mla "
                          "rows, DeepSeek-V4's v4_fp8 / v4_fp4 rows (512-dim q and keys, in "
                          "the presets' shapes); repeatable, default auto and fp8_ds_mla."),
        click.option("--topk", type=click.IntRange(1), default=2048, show_default=True),
        click.option("--extra-topk", type=click.IntRange(0), default=0, show_default=True,
                     help="A second cache of the same format (DeepSeek-V4's extra_k_cache), "
                          "as many tokens a sequence as the first: each query token also "
                          "attends to this many of its tokens there. Decode presets only "
                          "(the default presets become those)."),
        click.option("--batch", type=click.IntRange(1), default=None,
                     help="Sequences of the decode presets instead of theirs (128); the "
                          "rows' names end in -b<batch>. Decode presets only (the default "
                          "presets become those)."),
        click.option("--reps", type=click.IntRange(3), default=20, show_default=True),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@main.command("sparse-mla")
@_sparse_mla_options
def sparse_mla(presets, impls, kv_cache_dtypes, topk, extra_topk, batch, reps):
    """DeepSeek's sparse attention (DSA): cupaged.sparse_mla_attention, each query token
    over its top-k cached tokens, in FlashMLA's decode and prefill interfaces, checked
    against the float64 reference before it is timed. % copy counts the selected tokens'
    bytes (per query token) plus q and out against the copy bandwidth; TFLOP/s count 2 *
    (d_qk + 512) FLOPs per (head, selected token), d_qk 576 (V3.2) or 512 (V4's rows),
    against the bf16 matmul rate; both measured in the same run. Exit status 1 when a check
    failed, 3 when a row did not run."""
    from . import sparse_mla as sm

    names = presets or [n for n, p in sm.PRESETS.items()
                        if not ((extra_topk or batch) and p.get("prefill"))]
    try:
        cases = [sm.preset_case(name, kvd, topk, extra_topk, batch)
                 for name in dict.fromkeys(names)
                 for kvd in dict.fromkeys(kv_cache_dtypes or sm.DEFAULT_KV_CACHE_DTYPES)]
    except ValueError as e:
        raise click.UsageError(str(e))
    impls = list(dict.fromkeys(impls or ["cupaged"]))
    _mla_table(cases, lambda bw: sm.measure(cases, impls, reps, bw))


def _indexer_options(f):
    """The options of ``indexer``; its choices come from cupaged.bench.indexer."""
    from .indexer import IMPLEMENTATIONS, PRESETS

    opts = [
        click.option("--preset", "presets", multiple=True, type=click.Choice(list(PRESETS)),
                     help="Named shapes, DeepSeek-V3.2's indexer (repeatable; default all)."),
        click.option("--step", "steps", multiple=True,
                     type=click.Choice(list(IMPLEMENTATIONS)),
                     help="indexer_logits and/or indexer_topk (repeatable; default both)."),
        click.option("--topk", type=click.IntRange(1, 2048), default=2048, show_default=True),
        click.option("--reps", type=click.IntRange(3), default=20, show_default=True),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@main.command()
@_indexer_options
def indexer(presets, steps, topk, reps):
    """DeepSeek-V3.2's lightning indexer: cupaged.indexer_logits over its fp8 paged key
    cache (64 heads of 128), then cupaged.indexer_topk over those logits, each checked
    against the float64 reference (the first and last rows) before it is timed. % copy
    counts each sequence's keys read once plus q, weights and the logits written (top-k:
    the logits read and the columns written) against the copy bandwidth; TFLOP/s count
    2 * 128 FLOPs per (row, head, visible key), against the bf16 matmul rate; both
    measured in the same run. Exit status 1 when a check failed, 3 when a row did not run."""
    from . import indexer as ix

    cases = [ix.preset_case(name, topk) for name in dict.fromkeys(presets or ix.PRESETS)]
    steps = list(dict.fromkeys(steps or ix.IMPLEMENTATIONS))
    _mla_table(cases, lambda bw: ix.measure(cases, steps, reps, bw))


# ---- context parallel ------------------------------------------------------------------------------


@main.command("context-parallel")
@click.option("--context", type=click.IntRange(1), default=100_000, show_default=True,
              help="Tokens of the long sequence.")
@click.option("--others", callback=_int_list, default="3000,300,5,1", show_default=True,
              help="The other sequences' lengths, comma-separated, each at least 1 (the "
                   "third is the prefill step's first chunk).")
@click.option("--chunk", type=click.IntRange(1, 16384), default=None,
              help="The long sequence's query rows in the chunked-prefill step (default 512, "
                   "or the context if shorter).")
@click.option("--heads", type=click.IntRange(1), default=64, show_default=True)
@click.option("--kv-heads", type=click.IntRange(1), default=8, show_default=True)
@click.option("--head-size", type=click.IntRange(1), default=128, show_default=True)
@click.option("--block-size", type=click.IntRange(1), default=16, show_default=True)
@click.option("--interleave", type=click.IntRange(1), default=16, show_default=True,
              help="Tokens per placement unit (ContextParallel's interleave).")
@_dtype_option("bfloat16")
@click.option("--one-gpu/--no-one-gpu", default=None,
              help="Also check and time one GPU's call over a cache of the whole context "
                   "(default: where it fits beside each rank's part).")
@click.option("--reps", type=click.IntRange(3), default=20, show_default=True)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
def context_parallel(context, others, chunk, heads, kv_heads, head_size, block_size,
                     interleave, dtype, one_gpu, reps, seed):
    """One long context over the GPUs of a torchrun job, through
    cupaged.distributed.ContextParallel (NCCL): run it as
    `NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node N -m cupaged.bench context-parallel`
    (without torchrun: one GPU, a world of one). Each rank fills its paged cache with the
    tokens it owns and reads sampled ones back bit for bit; a decode step, a
    chunked-prefill step and a graph-replayed decode step are checked against a dense
    reference (float32 over tiles of keys, float64 across them) that draws the K/V again
    chunk by chunk (so a context that fits only across the GPUs is checked too), and,
    where the whole context fits one GPU beside a rank's part, one GPU's
    cupaged.attention likewise. Then each step is timed (CUDA events, L2 flushed; the
    slowest rank's median beside rank 0's), with this GPU's attention alone: the step's
    time beyond it is the helper's (all-gather and merge); the timed calls' results are
    checked after. % copy: the cache bytes one GPU reads against the copy bandwidth. The
    prefill step includes the helper's host work and uploads of its plan. Exit status 1
    when a check failed, 3 when the caches do not fit the GPUs' memory."""
    from . import context_parallel as cpb
    from . import peers, timing

    try:
        chunk = min(512, context) if chunk is None else chunk
        case = cpb.ContextParallelCase(context, tuple(others or ()), chunk, heads, kv_heads,
                                       head_size, block_size, interleave, dtype, seed)
    except ValueError as e:
        raise click.UsageError(str(e))
    _require_gpu()
    torch = peers.import_torch()
    if torch is None:
        click.echo("context-parallel needs torch (torch.distributed)", err=True)
        sys.exit(2)
    import torch.distributed as dist

    if "RANK" not in os.environ:  # a world of one on this process's GPU
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    # NVLink multicast can take a shared host's GPUs out of service: off unless asked for
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before NCCL binds one
    import cupy

    cupy.cuda.Device(torch.cuda.current_device()).use()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    echo = click.echo if rank == 0 else (lambda *a, **k: None)
    try:
        bw = timing.copy_bandwidth()
        echo(f"copy bandwidth {bw / 1e9:.0f} GB/s (rank 0, same run); {world} GPUs: "
             f"{torch.cuda.get_device_name()}")
        echo(case.describe())
        try:
            checks, rows = cpb.measure(case, reps, one_gpu, echo)
        except cpb.DoesNotFit as e:
            echo(f"SKIPPED: {e}")
            sys.exit(3)
        if rows:
            echo(f"{'step':54s} {'GPUs':>4s} {'median us':>10s} {'slowest rank':>13s} "
                 f"{'GiB a GPU':>9s} {'% copy':>7s}")
        for r in rows:
            pct = (f"{100 * r.bytes_read / (r.slowest_us * 1e-6) / bw:6.1f}%"
                   if r.what.startswith("decode") else f"{'-':>7s}")
            echo(f"{r.what:54s} {r.gpus:4d} {r.median_us:10.1f} {r.slowest_us:13.1f} "
                 f"{r.bytes_read / 2**30:9.2f} {pct}")
        by = {r.what: r for r in rows}
        alone = by.get("decode: this GPU's attention alone (part of the step)")
        for label, what in (("eager", "decode step: attention + all-gather + merge"),
                            ("CUDA graph", "decode step, CUDA graph replay")):
            if alone and what in by:
                echo(f"helper beyond the attention, decode step ({label}): "
                     f"{by[what].slowest_us - alone.slowest_us:.1f} us (slowest ranks)")
        failed = not all(c[4] for c in checks)
    finally:
        dist.destroy_process_group()
    sys.exit(1 if failed else 0)


# ---- cascade attention ------------------------------------------------------------------------------


@main.command()
@click.option("--seqs", type=click.IntRange(1), default=128, show_default=True,
              help="Sequences (decode queries) sharing the prefix.")
@click.option("--prefix", type=click.IntRange(1), default=32768, show_default=True,
              help="Tokens of the shared prefix, stored once (a multiple of --block-size).")
@click.option("--suffix", type=click.IntRange(1), default=256, show_default=True,
              help="Tokens of each sequence's own after the prefix, the new one included.")
@click.option("--heads", type=click.IntRange(1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(1), default=8, show_default=True)
@click.option("--head-size", type=int, default=128, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--kv-layout", type=click.Choice(["NHD", "HND", "vllm"]), default="NHD",
              show_default=True, help="The cache's layout (vllm: plain and suffix decode "
                                      "through cupaged.paged_attention).")
@click.option("--check-seqs", type=click.IntRange(1), default=3, show_default=True,
              help="Sequences checked against the float64 reference of plain decode.")
@click.option("--reps", type=click.IntRange(3), default=30, show_default=True)
@click.option("--seed", type=int, default=0)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the configuration, checks, rows and environment as JSON.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write one row per step as CSV (environment as # comment lines).")
def cascade(seqs, prefix, suffix, heads, kv_heads, head_size, block_size, dtype, kv_layout,
            check_seqs, reps, seed, json_path, csv_path):
    """Cascade attention over a shared prefix. One paged cache stores the prefix's blocks
    once and every sequence's table points to them, then to its own blocks. Times, on the
    same data, plain paged decode over the full tables against the cascade: all decode
    queries over the prefix once (cupaged.attention, one sequence of --seqs query tokens,
    non-causal, return_lse), each sequence's decode over its own blocks (return_lse), and
    cupaged.merge_state. The two results are checked against each other and, for
    --check-seqs sequences, against the float64 reference before timing. Each step is
    also timed alone (cold L2 each time, so the parts need not add up to the whole)."""
    from . import cascade, peers, report, timing

    try:
        case = cascade.CascadeCase(seqs, prefix, suffix, heads, kv_heads, head_size,
                                         block_size, dtype, kv_layout, seed)
    except ValueError as e:
        raise click.UsageError(str(e))
    _require_gpu()
    bw = timing.copy_bandwidth()
    click.echo(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write), same run")
    click.echo(f"cascade: {seqs} sequences x (shared prefix {prefix} + own {suffix} tokens), "
               f"{heads}/{kv_heads}/{head_size}, block {block_size}, {case.dtype}, {kv_layout}")
    try:
        rows, checks = cascade.measure(case, reps, bw, check_seqs)
    except peers.oom_errors():
        peers.free_memory()
        click.echo("SKIPPED: the cache does not fit in GPU memory")
        sys.exit(3)
    click.echo(f"checks (tolerance {checks['tolerance']:g}, lse {checks['lse_tolerance']:g}): "
               f"cascade vs plain {checks['cascade_vs_plain']:.1e} "
               f"(lse {checks['lse_cascade_vs_plain']:.1e}); vs the float64 reference, "
               f"sequences {', '.join(map(str, checks['checked_seqs']))}: plain "
               f"{checks['plain_vs_reference']:.1e}, cascade {checks['cascade_vs_reference']:.1e} "
               f"(lse {checks['lse_cascade_vs_reference']:.1e})"
               + ("" if checks["ok"] else "  FAILED"))
    click.echo(f"{'step':48s} {'median us':>10s} {'p10-p90 us':>17s} {'MiB moved':>10s} "
               f"{'GB/s':>7s} {'% copy':>7s} {'x plain':>8s}")
    for r in rows:
        line = f"{r.what:48s} "
        if r.status != "ok":
            click.echo(line + f"{r.status.upper()}: {r.note}")
            continue
        click.echo(line + f"{r.median_us:10.1f} {_fmt(r.p10_us, '8.1f')}-{_fmt(r.p90_us, '<8.1f')} "
                   f"{r.bytes_moved / 2**20:10.1f} {r.gbps:7.0f} {r.pct_copy:6.1f}% "
                   f"{r.ratio_to_plain:8.3f}")
    if checks["ok"]:
        click.echo(f"speed-up of the cascade over plain decode: "
                   f"{cascade.speedup(rows):.2f}x")
    env = report.environment()
    if json_path:
        cascade.write_json(json_path, case, rows, checks, env, bw / 1e9)
    if csv_path:
        cascade.write_csv(csv_path, case, rows, checks, env, bw / 1e9)
    sys.exit(0 if checks["ok"] else 1)


# ---- end to end -------------------------------------------------------------------------------------


@main.command()
@click.option("--preset", type=click.Choice(["llama-3.2-1b", "llama-3-8b", "tiny"]),
              default="llama-3.2-1b", show_default=True,
              help="Model shape (random weights, nothing downloaded).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]),
              default="bfloat16", show_default=True)
@click.option("--num-requests", type=click.IntRange(1), default=64, show_default=True)
@click.option("--prompt-len", type=(int, int), default=(128, 1024), show_default=True,
              metavar="MIN MAX", help="Prompt lengths (the shared prefix included), uniform.")
@click.option("--output-len", type=click.IntRange(1), default=128, show_default=True,
              help="Tokens every request generates.")
@click.option("--shared-prefix", type=click.IntRange(0), default=0, metavar="N",
              help="A system prompt of N tokens at the start of every prompt.")
@click.option("--prefix-caching/--no-prefix-caching", default=False, show_default=True,
              help="Share cached prompt blocks (cupaged and flashinfer).")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto",
              show_default=True, help="auto: the model's dtype; fp8: e4m3 with per-tensor "
                                      "scales (cupaged and flashinfer only).")
@click.option("--request-rate", type=float, default=float("inf"),
              help="Requests per second, Poisson arrivals. Default: all at once.")
@click.option("--systems", "systems", multiple=True,
              type=click.Choice(["cupaged", "cupaged-eager", "concat", "hf", "flashinfer",
                                 "cupaged-compiled"]),
              help="Repeatable. Default: every one available here but cupaged-compiled.")
@click.option("--max-batched-tokens", type=click.IntRange(1), default=2048, show_default=True,
              help="Query tokens per step (cupaged, flashinfer, concat).")
@click.option("--max-running", type=click.IntRange(1), default=256, show_default=True,
              help="Requests in a step at most (cupaged, flashinfer, concat).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Weights, prompts and arrivals.")
@click.option("--memory-fraction", type=click.FloatRange(0, 1, min_open=True), default=0.85,
              show_default=True, help="Share of the GPU memory free after the weights that is "
                                      "the KV budget of every system.")
@click.option("--block-size", type=click.IntRange(1), default=16, show_default=True)
@click.option("--kv-layout", type=click.Choice(["HND", "NHD", "vllm"]), default="HND",
              show_default=True, help="The paged cache's layout (flashinfer: HND or NHD).")
@click.option("--hf-batch", type=click.IntRange(1), default=None,
              help="Requests per generate call (default: what the KV budget holds; halved "
                   "on running out of memory).")
@click.option("--breakdown/--no-breakdown", default=True, show_default=True,
              help="A profiling pass after the timed run of each engine system: the shares "
                   "of the step time in attention, the rest of the model and the host.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the workload, every field and the environment as JSON (after each "
                   "system: a run cut short keeps the finished rows).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write one row per system as CSV (environment as # comment lines).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Bar charts of tokens/s, TTFT and TPOT per system (needs matplotlib).")
@click.option("--profile-steps", type=(click.IntRange(0), click.IntRange(1)), default=None,
              metavar="SKIP STEPS",
              help="Instead of the comparison: where one system's steps go. One --systems of "
                   "concat, cupaged-eager or cupaged serves the requests (all at once) after "
                   "its warm-up; each step's wall time is printed (synchronized), and "
                   "torch.profiler's top operators by CUDA and CPU time over STEPS steps "
                   "from step SKIP.")
def e2e(preset, dtype, num_requests, prompt_len, output_len, shared_prefix, prefix_caching,
        kv_cache_dtype, request_rate, systems, max_batched_tokens, max_running, seed,
        memory_fraction, block_size, kv_layout, hf_batch, breakdown, json_path, csv_path,
        plot_path, profile_steps):
    """Serve one workload of random requests end to end through several systems, with
    the same model weights and the same requests for each: cupaged (the engine's
    continuous batching over a PagedKVCache, decode steps in CUDA graphs), cupaged-eager
    (the same, every step launched from Python), cupaged-compiled (cupaged with the model
    under torch.compile, attention through torch.ops.cupaged; only when named), flashinfer (the same engine, eager, with FlashInfer's
    paged decode and prefill kernels for attention), concat (continuous batching with contiguous
    per-request K/V grown by torch.cat, attention by torch SDPA, admission reserving
    prompt + output per request in the same KV budget) and hf (transformers' generate on
    the same weights, static left-padded batches). Reports output tokens/s, TTFT and TPOT
    (median, p90) and the peak KV bytes held, and for the engine systems the share of the
    step time in attention, the rest of the model and the host. Needs PyTorch with CUDA
    (transformers for hf, FlashInfer for flashinfer)."""
    from . import e2e, report

    try:
        workload = e2e.Workload(
            preset=preset, dtype=dtype, num_requests=num_requests, prompt_len=prompt_len,
            output_len=output_len, shared_prefix=shared_prefix, prefix_caching=prefix_caching,
            kv_cache_dtype=kv_cache_dtype, request_rate=request_rate,
            max_batched_tokens=max_batched_tokens, max_running=max_running, seed=seed,
            memory_fraction=memory_fraction, block_size=block_size, kv_layout=kv_layout,
            hf_batch=hf_batch, breakdown=breakdown)
    except ValueError as e:
        raise click.UsageError(str(e))
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise click.UsageError("--plot needs matplotlib: pip install 'cupaged[plot]'")
    # Checked now: the JSON is first written after the first system has run.
    for hint, path in (("--json", json_path), ("--csv", csv_path), ("--plot", plot_path)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise click.BadParameter(f"the folder {folder} does not exist", param_hint=hint)
    for s in systems:
        why = e2e.unsupported(s, workload)
        if why:
            raise click.BadParameter(why, param_hint="--systems")
    if profile_steps is not None:
        if len(set(systems)) != 1 or systems[0] not in e2e.PROFILED_SYSTEMS:
            raise click.BadParameter(f"--profile-steps profiles one system: one --systems of "
                                     f"{', '.join(e2e.PROFILED_SYSTEMS)}",
                                     param_hint="--systems")
        _require_gpu()
        e2e.profile_steps(workload, systems[0], *profile_steps, echo=click.echo)
        return
    _require_gpu()
    for s in systems:
        why = e2e.unavailable(s)
        if why:
            raise click.UsageError(f"--systems {s}: {why}")
    chosen = list(dict.fromkeys(systems))
    if not chosen:
        for s in e2e.DEFAULT_SYSTEMS:
            why = e2e.unsupported(s, workload) or e2e.unavailable(s)
            if why:
                click.echo(f"{s} left out: {why}")
            else:
                chosen.append(s)
    if not chosen:
        click.echo("no system can run here", err=True)
        sys.exit(2)
    def written(so_far):  # after each system, so that a run cut short keeps its rows
        e2e.write_json(json_path, workload, so_far, report.environment())

    results = e2e.run(workload, chosen, echo=click.echo, done=written if json_path else None)
    for line in e2e.table_lines(results) + e2e.breakdown_lines(results):
        click.echo(line)
    env = report.environment()
    if csv_path:
        e2e.write_csv(csv_path, workload, results, env)
    if plot_path:
        e2e.write_plot(plot_path, results, f"e2e: {preset} {dtype}, {num_requests} requests")
    statuses = {r.status for r in results}
    sys.exit(1 if "failed" in statuses else 3 if "skipped" in statuses else 0)


# ---- fp8 accuracy --------------------------------------------------------------------------------


@main.command("fp8-error")
@click.option("--heads", type=click.IntRange(1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(1), default=8, show_default=True)
@click.option("--head-size", type=int, default=128, show_default=True)
@click.option("--seqs", type=click.IntRange(1), default=4, show_default=True)
@click.option("--tokens", type=click.IntRange(1), default=1000, show_default=True,
              help="Cached tokens per sequence.")
def fp8_error(heads, kv_heads, head_size, seqs, tokens):
    """The accuracy an fp8 KV cache costs: decode over e4m3 and e5m2 caches written from
    a float16 one by reshape_and_cache (per-tensor scales from the values' maximum, and
    per-token scales), against the float64 reference on the float16 cache; the float16
    cache's own error beside them. Relative Frobenius error of the output."""
    from . import fp8_error as fe

    if heads % kv_heads:
        raise click.BadParameter("--heads must be a multiple of --kv-heads", param_hint="--heads")
    _require_gpu()
    click.echo(f"decode, {heads}/{kv_heads} heads, head size {head_size}, {seqs} x {tokens} "
               f"tokens, float16 queries; relative error against the float64 reference on "
               f"the float16 cache")
    click.echo(f"{'cache':28s} {'scales':8s} {'rel err':>9s}")
    for r in fe.rows(heads, kv_heads, head_size, seqs, tokens):
        click.echo(f"{r['format']:28s} {r['scales']:8s} {r['rel_err']:9.2e}")


# ---- A/B in one process ------------------------------------------------------------------------


@main.group()
def ab():
    """A/B measurements in one process, the two sides' runs interleaved in rounds so both
    see the same clocks and CPU phases: another library tree against this one (decode
    kernel time, host time per call), or decode under planner overrides. (Two trees
    through whole bench commands, one process each, in turn: tools/device.sh ab.)"""


_TREE_HELP = ("The other library: a folder holding a checkout's cupaged/ and cuda_src/ (e.g. "
              "`git archive BASE cupaged cuda_src | tar -x -C .ab/base`), imported beside "
              "this one; its columns are 'old'.")


def _load_tree(tree):
    from . import ab as ab_mod

    try:
        return ab_mod.load_tree(tree)
    except FileNotFoundError as e:
        raise click.BadParameter(str(e), param_hint="--tree")


def _csv_choice(value: str, allowed, hint: str) -> list:
    items = [v for v in value.split(",") if v]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise click.BadParameter(f"expected comma-separated values of {', '.join(allowed)}, "
                                 f"got {value!r}", param_hint=hint)
    return items


def _shapes(ctx, param, value):
    """--shapes A,B,...: the same as --row A --row B."""
    return _rows(ctx, param, [v for v in (value or "").split(",") if v])


_SHAPES_HELP = "Shapes as --row's, comma-separated (added to --row's)."


@ab.command("decode")
@click.option("--tree", required=True, type=click.Path(exists=True, file_okay=False),
              help=_TREE_HELP)
@click.option("--row", "rows", multiple=True, callback=_rows, metavar="H/KVH/B/CTX",
              help="A shape (repeatable), as decode's --row; default the eight decode rows "
                   "(32/8/64/2048, 32/32/64/2048, 32/8/8/32768, 32/8/1/1024, "
                   "32/8/128/uniform:128:4096, 32/8/256/512, 8/1/64/4096, 32/8/1/131072).")
@click.option("--shapes", callback=_shapes, default=None, metavar="H/KVH/B/CTX,...",
              help=_SHAPES_HELP)
@click.option("--layouts", default="vllm,NHD,HND", show_default=True,
              help="Cache layouts, comma-separated: vllm (paged_attention), NHD, HND "
                   "(attention).")
@_dtype_option("float16")
@click.option("--starts", is_flag=True,
              help="Call attention with query_start_loc and max_query_len=1 (as vLLM's "
                   "backends do), every layout.")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True)
@click.option("--reps", type=click.IntRange(3), default=10, show_default=True)
def ab_decode(tree, rows, shapes, layouts, dtype, starts, rounds, reps):
    """Decode kernel time, the library in --tree against this one, on the same data in one
    process: each (row, layout) is checked against the float64 reference for both, then
    timed in rounds alternating old and new (L2 flushed, a GPU busy-wait before each run,
    device time); new/old of the medians is the figure. Exit status 1 when a check
    failed."""
    from . import ab as ab_mod

    lay = _csv_choice(layouts, ("vllm", "NHD", "HND"), "--layouts")
    _require_gpu()
    other = _load_tree(tree)
    ok = ab_mod.decode_ab(other, list(rows + shapes) or ab_mod.DECODE_ROWS, lay, dtype, rounds,
                          reps, starts, echo=click.echo)
    sys.exit(0 if ok else 1)


@ab.command("host")
@click.option("--tree", required=True, type=click.Path(exists=True, file_okay=False),
              help=_TREE_HELP)
@click.option("--rounds", type=click.IntRange(1), default=15, show_default=True)
@click.option("--calls", type=click.IntRange(1), default=100, show_default=True,
              help="Calls per round and side.")
def ab_host(tree, rounds, calls):
    """Host time per call of the entry points (kernels cached, out given; CuPy, and torch
    where it imports), the library in --tree against this one, in one process: rounds of
    CALLS calls alternate old and new (and which goes first); the median of the per-round
    ratios new/old is the figure. The first row, plain Python work, gauges the CPU's
    phase. Pin the process to one core (taskset -c N; tools/device.sh bench does with
    CORE=N)."""
    from . import ab as ab_mod

    _require_gpu()
    other = _load_tree(tree)  # before torch: the trees register no torch ops then
    torch = None
    if importlib.util.find_spec("torch") is not None:
        import torch
    ab_mod.host_ab(other, rounds, calls, torch, echo=click.echo)


def _pairs(value: str) -> list:
    try:
        out = [tuple(int(x) for x in p.split("/")) for p in value.split(",") if p]
        if not out or any(len(p) != 2 or min(p) < 1 or p[0] % p[1] for p in out):
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"expected HEADS/KV_HEADS pairs, comma-separated (heads a "
                                 f"multiple of KV heads), got {value!r}",
                                 param_hint="--heads") from None
    return out


@ab.command("tuning")
@click.option("--settings", default="-,2@never,2@auto", show_default=True,
              help="Comma-separated settings, each ctas[@partition[@TOKENSxSTAGES]]: CTAs "
                   "per SM, split-KV partition (auto, never, always, flat or tokens) and decode "
                   "tile, '-' a default (e.g. -,2@never,-@auto@64x3). The last column is the "
                   "first setting's time over the best of the others. (A value that starts "
                   "with '-': --settings=-,...)")
@click.option("--row", "rows", multiple=True, callback=_rows, metavar="H/KVH/B/CTX",
              help="A shape (repeatable), as decode's --row; default 32/8/64/2048, "
                   "32/32/64/2048, 32/8/8/32768, 32/8/256/512, 32/8/128/uniform:128:4096, "
                   "8/1/64/4096.")
@click.option("--shapes", callback=_shapes, default=None, metavar="H/KVH/B/CTX,...",
              help=_SHAPES_HELP)
@click.option("--heads", default=None, metavar="H/KVH,...",
              help="Instead of --row: the product of these head pairs, --batch and --context.")
@click.option("--batch", callback=_int_list, default=None, help="With --heads.")
@click.option("--context", callback=_int_list, default=None, help="With --heads.")
@click.option("--layout", type=click.Choice(["NHD", "HND", "vllm"]), default="HND",
              show_default=True, help="The cache's layout (attention() on every one).")
@_dtype_option("float16")
@click.option("--head-size", type=int, default=128, show_default=True)
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8_e4m3", "fp8_e5m2"]),
              default="auto", show_default=True)
@click.option("--max-gib", type=float, default=20.0, show_default=True,
              help="Skip caches larger than this (the layout's copy doubles it).")
@click.option("--flashinfer/--no-flashinfer", "peer", default=True, show_default=True,
              help="FlashInfer's tensor-core decode as a column, where it imports.")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True)
@click.option("--reps", type=click.IntRange(3), default=10, show_default=True)
def ab_tuning(settings, rows, shapes, heads, batch, context, layout, dtype, head_size,
              kv_cache_dtype, max_gib, peer, rounds, reps):
    """Decode under planner overrides side by side on the same data in one process: each
    setting runs cupaged.attention over the row's cache in --layout, checked against the
    float64 reference before it is timed; rounds alternate the settings (L2 flushed,
    device time). With the default first ('-'), the last column is auto against every
    fixed choice (e.g. --settings=-,-@never,-@always: the split model's rule against
    never and always splitting). Exit status 1 when a check failed."""
    from . import ab as ab_mod

    listed = [s for s in settings.split(",") if s]
    for s in listed:
        try:
            ab_mod.parse_setting(s)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--settings")
    if not listed:
        raise click.BadParameter("no setting given", param_hint="--settings")
    rows = rows + shapes
    if heads is not None:
        if rows:
            raise click.UsageError("--heads (with --batch and --context) or --row, not both")
        if not (batch and context):
            raise click.UsageError("--heads needs --batch and --context")
        shapes = [(h, kvh, b, c) for h, kvh in _pairs(heads) for b in batch for c in context]
    else:
        if batch or context:
            raise click.UsageError("--batch and --context go with --heads")
        shapes = list(rows) or ab_mod.TUNING_ROWS
    _require_gpu()
    ok = ab_mod.tuning_ab(shapes, listed, layout, dtype, head_size, kv_cache_dtype, rounds,
                          reps, max_gib, peer, echo=click.echo)
    sys.exit(0 if ok else 1)


# ---- overhead -------------------------------------------------------------------------------------


@main.command()
@click.option("--calls", type=click.IntRange(10), default=None,
              help="Calls per timed run (nine runs, the median reported)  [default: 200; "
                   "10000 with --stub-driver]")
@click.option("--pieces", is_flag=True,
              help="Instead: where the host time of an eager decode call goes, piece by "
                   "piece (adaptation, validation, the prepared call's lookup and launch, "
                   "parameter packing, cuLaunchKernel, and the primitives a faster path "
                   "would use), then a cProfile of each call (needs torch and a GPU).")
@click.option("--stub-driver", is_flag=True,
              help="Time AttentionPlan.run, attention's and mla_attention's repeated "
                   "calls and a cache write on the CPU alone, "
                   "no GPU needed: CuPy arrays at made-up device addresses, and the current "
                   "device and stream, allocation, kernel loading, cuLaunchKernel and "
                   "cudaMemsetAsync replaced by stand-ins that launch nothing "
                   "(cupaged.bench.stub). Each form is timed as a caller runs it (the fast "
                   "run) and with stream= (the generic path). The figures are cupaged's own "
                   "Python per call, the launch's cost excluded: for comparing versions of "
                   "the call path on one machine, beside the pure-Python gauge row, not with "
                   "the GPU rows. Not with --pieces, whose pieces launch on a GPU.")
def overhead(calls, pieces, stub_driver):
    """Host time per call of the Python entry points with their kernels cached (what a
    serving loop pays per layer), and per replay of a captured CUDA graph; or, with
    --stub-driver, the CPU-only host time of the attention call path."""
    from . import overhead

    if pieces and stub_driver:
        raise click.UsageError(
            "--pieces times real launches, CuPy's and torch's device calls on a GPU, which "
            "--stub-driver replaces; run one or the other")
    if pieces and calls is not None:
        raise click.UsageError("--pieces times its own runs (7 x 200 calls); --calls does "
                               "not apply")
    if stub_driver:
        rows = overhead.stubbed_overheads(calls or 10000)
        click.echo("CPU only, device calls stubbed (nothing launched)")
    else:
        _require_gpu()
        if pieces:
            overhead.pieces(echo=click.echo)
            return
        rows = overhead.host_overheads(calls or 200)
    width = max(52, *map(len, rows))
    click.echo(f"{'entry point':{width}s} {'host us/call':>12s}")
    for name, us in rows.items():
        click.echo(f"{name:{width}s} {us:12.2f}" if stub_driver else f"{name:{width}s} {us:12.1f}")


# ---- cache operations ---------------------------------------------------------------------------


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
    from . import cache_ops, timing

    try:
        dt = _dtypes.parse(dtype)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--dtype")
    _require_gpu()
    bw = timing.copy_bandwidth()
    click.echo(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write), same run")
    click.echo(f"{'operation':52s} {'median us':>10s} {'GB/s':>8s} {'% copy':>7s}  check")
    failed = 0
    for row in cache_ops.cache_op_rows(dt.numpy, kv_heads, head_size, block_size, tokens, layers,
                                   pairs, reps):
        pct = f"{100 * row.gbps * 1e9 / bw:6.1f}%" if row.vs_copy else "      -"
        click.echo(f"{row.name:52s} {row.median_us:10.1f} {row.gbps:8.1f} {pct}  "
                   f"{'ok' if row.ok else 'FAILED'}")
        failed += not row.ok
    for name, t in cache_ops.kv_cache_step_us(seqs, kv_heads, head_size, block_size, dt.numpy).items():
        click.echo(f"{name:52s} {t:10.1f}        -       -  host time")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
