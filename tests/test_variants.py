"""Attention variants (sliding window, logits soft-cap, sinks, log-sum-exp, blocksparse) on
the GPU against the float64 reference, on every path: decode single pass and split-KV, the
multi-token kernel, the row mode, every layout, 16-bit and fp8 caches; plus their argument
checks (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import _variants, reference, testing

from conftest import assert_close
from test_varlen import LAYOUTS, make_varlen

TOL_LSE = 2e-3  # |lse - ref| <= TOL_LSE * max(1, |ref|): scores are fp32 sums of exact products


def _device(host):
    import cupy

    return {k: (None if v is None else cupy.asarray(v)) for k, v in host.items()}


def _quantize(host, rng, kv_cache_dtype, layout):
    """The host problem's caches as fp8 bytes with per-tensor scales (vLLM's key layout
    regrouped for 1-byte elements, x = 16); returns the scales."""
    scales = dict(k_scale=float(rng.uniform(0.01, 0.05)), v_scale=float(rng.uniform(0.01, 0.05)))
    kc, vc = testing.convert_layout(host["key_cache"], host["value_cache"], layout, "NHD")
    kq, vq = (reference.quantize_fp8(c.astype(np.float32), kv_cache_dtype, scales[s]).view(np.uint8)
              for c, s in ((kc, "k_scale"), (vc, "v_scale")))
    host["key_cache"], host["value_cache"] = testing.convert_layout(kq, vq, "NHD", layout)
    return scales


def _check_lse(got, ref, what):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    both_inf = np.isneginf(got) & np.isneginf(ref)
    err = np.where(both_inf, 0.0, np.abs(got - ref) / np.maximum(1.0, np.abs(ref)))
    err = np.where(np.isnan(err), np.inf, err)
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    assert err[worst] <= TOL_LSE, f"{what}: lse row {worst} got {got[worst]} want {ref[worst]}"


def _first_seen(n, q, window):
    """The first key position the earliest of a sequence's ``q`` query rows (of ``n``
    positions) sees under a causal ``window``."""
    return max(0, int(n) - int(q) - window + 1)


def _poison_before_windows(host, window, q_lens):
    """Block-table entries wholly before every query row's window of their sequence set to
    ids outside the cache: the kernels must never read them (a bad id turns the output
    into NaN), as an engine that frees blocks slid out of the window requires."""
    bt = host["block_tables"].copy()
    bs = host["block_size"]
    nb = host["num_blocks"]
    for s, (n, q) in enumerate(zip(host["seq_lens"], q_lens)):
        if q == 0:
            continue
        bt[s, : _first_seen(n, q, window) // bs] = nb + 7
    return bt


VARIANT_CASES = {
    "window": dict(window=37),
    "window1": dict(window=1),
    "window_left": dict(window_left=15),
    "cap": dict(logits_soft_cap=1.5),
    # Logits spread up to about the cap (most of them well inside it, a few saturated).
    "cap_wide": dict(logits_soft_cap=30.0, scale=8.0),
    "sinks": dict(sinks=True),
    "alibi": dict(alibi=True),
    "alibi_cap": dict(logits_soft_cap=5.0, alibi=True),
    "all": dict(window=100, logits_soft_cap=2.0, sinks=True, alibi=True),
}


def _variant_kwargs(rng, case, heads):
    kw = dict(VARIANT_CASES[case])
    alibi = kw.pop("alibi", False)
    if kw.pop("sinks", False):
        kw["sinks"] = rng.normal(0.0, 2.0, heads).astype(np.float32)
    return kw, alibi


def _run(host, kw, layout, causal=True, **extra):
    import cupy

    dev = _device({k: v for k, v in host.items() if k not in ("block_size", "num_blocks",
                                                               "kernel_tables")})
    if "kernel_tables" in host:
        dev["block_tables"] = cupy.asarray(host["kernel_tables"])
    if kw.get("sinks") is not None:
        dev_kw = dict(kw, sinks=cupy.asarray(kw["sinks"]))
    else:
        dev_kw = kw
    out = cupy.full(host["query"].shape, np.nan, dtype=host["query"].dtype)
    got, lse = cupaged.attention(**dev, out=out, kv_layout=layout, causal=causal,
                                 return_lse=True, **dev_kw, **extra)
    ref_kw = {k: v for k, v in kw.items() if k != "window_left"}
    if "window_left" in kw:
        ref_kw["window"] = kw["window_left"] + 1
    ref_host = {k: v for k, v in host.items() if k not in ("block_size", "num_blocks",
                                                           "kernel_tables")}
    for k in ("max_query_len", "max_seq_len", "partition"):
        extra.pop(k, None)
    ref, ref_lse = reference.attention(**ref_host, kv_layout=layout, causal=causal,
                                       return_lse=True, **ref_kw, **extra)
    return cupy.asnumpy(got).astype(np.float64), cupy.asnumpy(lse), ref, ref_lse


def _problem(rng, q_lens, seq_lens, **kw):
    host = make_varlen(rng, q_lens, seq_lens, **kw)
    host["block_size"] = kw.get("block_size", 16)
    host["num_blocks"] = host["key_cache"].shape[0]
    return host


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(VARIANT_CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["decode", "decode_flat", "mixed", "mixed_split", "rows",
                                  "rows_flat"])
def test_variants_match_reference(rng, prefill_split, request, case, layout, kind):
    """Each variant alone and all together, on decode (split-KV and not, and the flat
    split), a mixed varlen batch (the multi-token kernel, single pass and split into
    64-token partitions) and float32 (the decode kernel's row mode, its grid split and its
    flat split over rows that find their sequences in query_start_loc)."""
    prefill_split(64 if kind == "mixed_split" else 0)
    if kind.endswith("_flat"):
        request.getfixturevalue("flat_split")
        kind = kind[: -len("_flat")]
    heads, kvh, hs, bs = 8, 2, 64, 16
    dtype = "f32" if kind == "rows" else ("bf16" if case == "all" else "f16")
    if kind == "decode":
        q_lens = [1] * 6
        seq = [1, 16, 17, 300, 2100, 64]
    else:
        q_lens = [0, 1, 5, 40, 17, 1]
        seq = [3, 1, 5, 300, 150, 700]
    kw, alibi = _variant_kwargs(rng, case, heads)
    host = _problem(rng, q_lens, seq, layout=layout, dtype=dtype, heads=heads, kv_heads=kvh,
                    head_size=hs, block_size=bs, alibi=alibi)
    w = kw.get("window", kw.get("window_left", -2) + 1)
    if w > 0:
        host["kernel_tables"] = _poison_before_windows(host, w, q_lens)
    extra = dict(max_query_len=max(q_lens))
    if kind == "decode":
        del host["query_start_loc"]
        extra = dict(max_query_len=1)
    got, lse, ref, ref_lse = _run(host, kw, layout, **extra)
    tol = testing.TOLERANCE[dtype]
    assert_close(got, ref, tol, f"{case} {layout} {kind}")
    _check_lse(lse, ref_lse, f"{case} {layout} {kind}")


@pytest.mark.gpu
@pytest.mark.parametrize("partition", ["never", "always", 16, 64, "flat"])
@pytest.mark.parametrize("window", [1, 16, 64, 65, 200, 5000])
def test_window_edges_on_split_kv_decode(rng, window, partition):
    """W = 1, W = block size, W straddling tile and partition boundaries, W beyond the
    context; split-KV partitions cover the window only and the combine agrees."""
    heads, kvh = 8, 1
    lens = np.array([1, 15, 16, 17, 63, 64, 65, 129, 1000, 3000], np.int32)
    host = _problem(rng, [1] * len(lens), lens, layout="vllm", dtype="f16", heads=heads,
                    kv_heads=kvh, head_size=128, block_size=16)
    del host["query_start_loc"]
    host["kernel_tables"] = _poison_before_windows(host, window, [1] * len(lens))
    import cupy

    sinks = rng.normal(0, 1, heads).astype(np.float32)
    dev = _device({k: host[k] for k in ("query", "key_cache", "value_cache", "seq_lens")})
    out = cupy.full(host["query"].shape, np.nan, dtype=np.float16)
    got, lse = cupaged.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"],
                                       cupy.asarray(host["kernel_tables"]), dev["seq_lens"],
                                       out=out, partition=partition, window=window,
                                       sinks=cupy.asarray(sinks), return_lse=True)
    ref, ref_lse = reference.paged_attention(host["query"], host["key_cache"],
                                             host["value_cache"], host["block_tables"], lens,
                                             window=window, sinks=sinks, return_lse=True)
    assert_close(cupy.asnumpy(got), ref, testing.TOLERANCE["f16"], f"W={window} {partition}")
    _check_lse(cupy.asnumpy(lse), ref_lse, f"W={window} {partition}")


def _nan_before_windows(host, window, q_lens):
    """Copies of the (vLLM-layout) caches with NaN in every K and V slot before the
    earliest query row's window of its sequence: slots a window engine may have reused or
    never written."""
    kc, vc = host["key_cache"].copy(), host["value_cache"].copy()
    bs = host["block_size"]
    for s, (n, q) in enumerate(zip(host["seq_lens"], q_lens)):
        for j in range(_first_seen(n, q, window)):
            b, t = host["block_tables"][s, j // bs], j % bs
            kc[b, :, :, t, :] = np.nan
            vc[b, :, :, t] = np.nan
    return kc, vc


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", [2, 8], ids=["group1", "group4"])
@pytest.mark.parametrize("kind", ["decode", "mixed", "mixed_split"])
def test_slots_before_the_window_may_hold_nan(rng, prefill_split, layout, heads, kind):
    """Windows that start inside blocks, inside vLLM's pieces and inside tiles, over caches
    whose slots before the window hold NaN: the first tile a row sees copies some of them
    (a partly seen block or piece), so the kernels must mask their scores and clear their
    V before P V (0 * NaN is NaN). Decode on the FMA path (group 1) and tensor cores
    (group 4), single pass and split-KV; the multi-token kernel, single pass and split."""
    import cupy

    prefill_split(64 if kind == "mixed_split" else 0)
    window = 21
    seq = [22, 37, 64, 100, 333, 1000]
    q_lens = [1] * len(seq) if kind == "decode" else [1, 5, 16, 3, 40, 1]
    host = _problem(rng, q_lens, seq, layout="vllm", dtype="f16", heads=heads, kv_heads=2,
                    head_size=64, block_size=16)
    qsl = None if kind == "decode" else host["query_start_loc"]
    ref = reference.attention(host["query"], host["key_cache"], host["value_cache"],
                              host["block_tables"], host["seq_lens"], qsl, kv_layout="vllm",
                              window=window)
    kc, vc = testing.convert_layout(*_nan_before_windows(host, window, q_lens), "vllm", layout)
    dev = _device(dict(query=host["query"], key_cache=kc, value_cache=vc,
                       block_tables=host["block_tables"], seq_lens=host["seq_lens"]))
    calls = {"attention": lambda out: cupaged.attention(
        **dev, query_start_loc=None if qsl is None else cupy.asarray(qsl), out=out,
        kv_layout=layout, window=window, max_query_len=max(q_lens))}
    if kind == "decode" and layout == "vllm":
        for partition in ("never", "always", 16):
            calls[f"partition {partition}"] = lambda out, partition=partition: (
                cupaged.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"],
                                        dev["block_tables"], dev["seq_lens"], out=out,
                                        partition=partition, window=window))
    for what, call in calls.items():
        out = cupy.full(host["query"].shape, np.nan, dtype=host["query"].dtype)
        got = cupy.asnumpy(call(out)).astype(np.float64)
        assert_close(got, ref, testing.TOLERANCE["f16"], f"{layout} {kind} {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.3])
@pytest.mark.parametrize("case", ["plain", "cap"])
def test_multi_token_scores_of_any_sign(rng, scale, case):
    """Negative, zero and positive scales through the multi-token kernel, on tiles with
    and without masks: a guard for any shortcut that assumes a positive scale (such as
    taking a tile's maximum from its raw scores, tried and measured slower: a negative
    scale turns the raw maximum into the scaled minimum)."""
    heads, kvh = 8, 2
    q_lens, seq = [40, 17, 100], [300, 150, 700]
    host = _problem(rng, q_lens, seq, layout="NHD", dtype="f16", heads=heads, kv_heads=kvh,
                    head_size=64, block_size=16)
    kw = {} if case == "plain" else dict(logits_soft_cap=2.0)
    got, lse, ref, ref_lse = _run(host, dict(kw, scale=scale), "NHD",
                                  max_query_len=max(q_lens))
    assert_close(got, ref, testing.TOLERANCE["f16"], f"{case} scale {scale}")
    _check_lse(lse, ref_lse, f"{case} scale {scale}")


@pytest.mark.gpu
@pytest.mark.parametrize("force", ["host", "bit_without_slopes", "slopes_without_bit"])
def test_alibi_bit_is_chosen_and_either_mismatch_stays_correct(rng, monkeypatch, force):
    """The host asks for the multi-token kernel's ALiBi bit exactly when slopes are given
    (the ramp); a spec whose bit disagrees with the call (forced here) still gives the
    reference's result: slopes without the bit take the per-key path, the bit without
    slopes adds a zero ramp."""
    from cupaged import _prepared, planning

    asked = []

    def spy_on(name, variant_at):  # each multi-token kernel, its variant argument forced
        orig = getattr(planning, name)

        def spy(*args):
            args = list(args) + [""] * (variant_at + 1 - len(args))
            variant = args[variant_at]
            asked.append(variant)
            if force == "bit_without_slopes":
                variant += "" if "a" in variant else "a"
            elif force == "slopes_without_bit":
                variant = variant.replace("a", "")
            args[variant_at] = variant
            return orig(*args)

        monkeypatch.setattr(planning, name, spy)

    spy_on("prefill_kernel", 8)
    spy_on("prefill_sm90_kernel", 4)
    _prepared.clear()
    try:
        q_lens, seq = [40, 17, 1, 100], [300, 150, 77, 700]
        for alibi in (True, False):
            host = _problem(rng, q_lens, seq, layout="NHD", dtype="f16", heads=8, kv_heads=2,
                            head_size=64, block_size=16, alibi=alibi)
            got, lse, ref, ref_lse = _run(host, dict(logits_soft_cap=5.0), "NHD",
                                          max_query_len=max(q_lens))
            assert_close(got, ref, testing.TOLERANCE["f16"], f"alibi={alibi} {force}")
            assert asked and all(("a" in v) == alibi for v in asked), (alibi, asked)
            assert all(v.startswith("c") for v in asked), asked
            asked.clear()
            _prepared.clear()
    finally:
        _prepared.clear()


def variants_asked(monkeypatch, decode: bool = True) -> list:
    """The variant letters each attention kernel is asked for from now on (the planner's
    kernel getters spied on; remembered calls forgotten, so each call plans), in a list
    the caller may clear; ``decode``: the decode kernel's too, not only the multi-token
    kernels'."""
    from cupaged import _prepared, planning

    asked = []

    def spy_on(name, variant_at):
        orig = getattr(planning, name)

        def spy(*args, **kw):
            asked.append(kw.get("variant", args[variant_at] if len(args) > variant_at else ""))
            return orig(*args, **kw)

        monkeypatch.setattr(planning, name, spy)

    spy_on("prefill_kernel", 8)
    spy_on("prefill_sm90_kernel", 4)
    if decode:
        spy_on("decode_kernels", 8)
    _prepared.clear()
    return asked


# (cap, scale, saturate, the fixed offset expected): a cap most logits stay inside;
# logits spread past both ends of the cap (scale 8); every logit saturated near -cap
# (saturate: queries and keys made nonnegative, scale -8), the weights' lowest range,
# with 16-bit values scaled by 2^-30 (products near the range's floor); the largest cap the
# offset takes (c log2(e) = 77.9) and one just past it (the running maximum again).
FIXED_CAPS = [(1.5, None, False, True), (30.0, 8.0, False, True), (30.0, -8.0, True, True),
              (54.0, 8.0, False, True), (54.0, -8.0, True, True), (54.5, 8.0, False, False)]
# Batches: varlen (single pass and 64-token split-KV partitions, some with no key), a
# verify-sized one (the few-rows tile), fp8 with per-tensor scales (split) and per-token
# e5m2 scales.
FIXED_KINDS = ["mixed", "mixed_split", "verify", "fp8_split", "fp8_token"]


@pytest.mark.gpu
@pytest.mark.parametrize("cap,scale,saturate,fixed", FIXED_CAPS, ids=lambda v: str(v))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", FIXED_KINDS)
def test_soft_cap_fixed_offset_in_bfloat16(rng, monkeypatch, prefill_split, cap, scale,
                                           saturate, fixed, layout, kind):
    """bfloat16 soft-cap without ALiBi takes the multi-token kernel's fixed softmax offset
    (variant f) up to its largest cap, and matches the reference there: with sinks (one
    far above the logits where the output stays representable), lse, a window, empty
    rows, split-KV partitions and fp8 caches."""
    from cupaged import _prepared

    from test_fp8 import fp8_problem

    if saturate and kind == "fp8_token":
        pytest.skip("per-token fp8 keys keep their signs")
    asked = variants_asked(monkeypatch, decode=False)
    prefill_split(64 if kind.endswith("split") else 0)
    heads, kvh = 8, 2
    if kind == "verify":
        q_lens, seq = [1, 4, 3, 2, 4, 0], [500, 900, 40, 3000, 64, 5]
    else:
        q_lens, seq = [0, 1, 5, 40, 17, 100], [3, 1, 5, 300, 150, 700]
    extra = dict(max_query_len=max(q_lens))
    if kind == "fp8_token":
        host, scales = fp8_problem(rng, "fp8_e5m2", "token", q_lens, seq, layout=layout,
                                   dtype="bf16", heads=heads, kv_heads=kvh)
        host.update(scales, block_size=16, num_blocks=host["key_cache"].shape[0])
        extra["kv_cache_dtype"] = "fp8_e5m2"
    else:
        host = _problem(rng, q_lens, seq, layout=layout, dtype="bf16", heads=heads,
                        kv_heads=kvh, head_size=64 if kind in ("mixed", "mixed_split") else 128,
                        block_size=16, stale=None if kind == "fp8_split" else float("nan"))
        if saturate:
            for k in ("query", "key_cache"):
                host[k] = np.abs(host[k])
            if kind != "fp8_split":  # (fp8 would round such values to zero)
                host["value_cache"] = host["value_cache"] * host["value_cache"].dtype.type(2.0**-30)
        if kind == "fp8_split":
            extra.update(_quantize(host, rng, "fp8_e4m3", layout), kv_cache_dtype="fp8_e4m3")
    sinks = rng.normal(0, 2, heads).astype(np.float32)
    if not saturate:  # (with every logit near -54 and values of 2^-30, head 0's true
        # output, around 1e-43, would be below bfloat16's smallest number)
        sinks[0] = 30.0  # above every logit: the keys' share of head 0's denominator is tiny
    kw = dict(logits_soft_cap=cap, sinks=sinks)
    if scale is not None:
        kw["scale"] = scale
    try:
        for window in (None, 120):
            got, lse, ref, ref_lse = _run(host, dict(kw, window=window), layout, **extra)
            what = f"cap {cap} scale {scale} window {window} {layout} {kind}"
            assert_close(got, ref, testing.TOLERANCE["bf16"], what)
            _check_lse(lse, ref_lse, what)
            assert asked and all(v.endswith("f") == fixed for v in asked), (what, asked)
            asked.clear()
    finally:
        _prepared.clear()


# tanh.approx.f32's relative error (about 2^-11, PTX ISA) with room for the fp32 steps
# around it: each logit capped through cupaged.SoftCap(c, approx=True) is within
# TANH_APPROX_REL * c of c tanh(logit / c).
TANH_APPROX_REL = 2.0 ** -10.5
# (cap, scale, more variants): a cap most logits pass through the tanh's curve with a
# window and sinks; logits spread past both ends of a wide cap; ALiBi's bias added to
# the capped logit.
APPROX_CAPS = [(2.0, None, "window_sinks"), (30.0, 8.0, ""), (5.0, None, "alibi")]
APPROX_KINDS = ["decode", "decode_flat", "rows", "mixed_mma", "mixed_sm90", "mixed_split",
                "verify", "fp8"]


@pytest.mark.gpu
@pytest.mark.parametrize("cap,scale,more", APPROX_CAPS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("kind", APPROX_KINDS)
def test_soft_cap_by_tanh_approx_within_its_bound(rng, request, monkeypatch, prefill_split,
                                                 kind, dtype, cap, scale, more):
    """SoftCap(c, approx=True) on every kernel path: each row within its bound of the float64
    reference (exact tanh), on kernels whose variant letters have "t" (and the exact
    form's call on kernels without it). A logit off by at most e = TANH_APPROX_REL * c
    scales each softmax weight by a factor within exp(+-2e) once renormalized, so a row's
    output moves by at most (exp(2e) - 1) max_j |v_j - o| over its sequence's values."""
    import cupy

    from cupaged import _prepared, planning

    if kind == "rows" and dtype == "bf16":
        pytest.skip("the row mode is float32's")
    if kind == "mixed_sm90" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper kernel")
    if kind == "decode_flat":
        request.getfixturevalue("flat_split")
    prefill_split(64 if kind == "mixed_split" else 0)
    heads, kvh, hs = 8, 2, 64 if kind != "verify" else 128
    dtype = "f32" if kind == "rows" else dtype
    if kind.startswith("decode"):
        q_lens, seq = [1] * 6, [1, 16, 17, 300, 2100, 64]
    elif kind == "verify":
        q_lens, seq = [1, 4, 3, 2, 4, 0], [500, 900, 40, 3000, 64, 5]
    else:
        q_lens, seq = [0, 1, 5, 40, 17, 100], [3, 1, 5, 300, 150, 700]
    host = _problem(rng, q_lens, seq, layout="NHD", dtype=dtype, heads=heads, kv_heads=kvh,
                    head_size=hs, block_size=16, alibi=more == "alibi",
                    stale=None if kind == "fp8" else float("nan"))
    extra = dict(max_query_len=max(q_lens))
    if kind.startswith("decode"):
        del host["query_start_loc"]
        extra = dict(max_query_len=1)  # (the 2100-token context takes split-KV)
    scales = {}
    if kind == "fp8":  # per-tensor scales: the factor that folds them into the tanh's argument
        scales = _quantize(host, rng, "fp8_e4m3", "NHD")
        extra.update(scales, kv_cache_dtype="fp8_e4m3")
    kw = dict(logits_soft_cap=cap)
    if scale is not None:
        kw["scale"] = scale
    if more == "window_sinks":
        kw.update(window=120, sinks=rng.normal(0, 2, heads).astype(np.float32))
    family = {"mixed_mma": "mma", "mixed_sm90": "sm90"}.get(kind)
    asked = variants_asked(monkeypatch)
    what = f"{kind} {dtype} cap {cap} {more}"
    planning.set_prefill_family(family)
    try:
        _run(host, kw, "NHD", **extra)
        assert asked and not any("t" in v for v in asked), (what, asked)
        asked.clear()
        kw["logits_soft_cap"] = cupaged.SoftCap(cap, approx=True)
        got, lse, ref, ref_lse = _run(host, kw, "NHD", **extra)
        assert asked and all("ct" in v for v in asked), (what, asked)
    finally:
        planning.set_prefill_family(None)
        _prepared.clear()
    # Each row's largest |v_j - o| over its sequence's values (a superset of those it sees).
    starts = host.get("query_start_loc", np.arange(len(seq) + 1))
    spread = np.zeros(ref.shape[:2])
    group = heads // kvh
    for s, n in enumerate(seq):
        a, b = int(starts[s]), int(starts[s + 1])
        if b == a or n == 0:
            continue
        _, v = reference.gather_kv(host["key_cache"], host["value_cache"], host["block_tables"][s],
                                   n, "NHD", extra.get("kv_cache_dtype", "auto"),
                                   scales.get("k_scale"), scales.get("v_scale"))
        for h in range(heads):
            d = v[None, :, h // group] - ref[a:b, h][:, None]  # [rows, keys, dims]
            spread[a:b, h] = np.linalg.norm(d, axis=-1).max(axis=-1)
    e = TANH_APPROX_REL * cap
    tol = testing.TOLERANCE[dtype]
    bound = (testing.ROW_FACTOR * tol * np.linalg.norm(ref, axis=-1)
             + np.expm1(2 * e) * spread)
    err = np.linalg.norm(got - ref, axis=-1)
    err = np.where(np.isnan(err), np.inf, err)
    worst = np.unravel_index(int(np.argmax(err - bound)), err.shape)
    assert err[worst] <= bound[worst], (
        f"{what}: row {tuple(int(i) for i in worst)} off by {err[worst]:.3e} > its bound "
        f"{bound[worst]:.3e}")
    # The lse moves by at most e: every logit does.
    both_inf = np.isneginf(lse) & np.isneginf(ref_lse)
    lse_err = np.where(both_inf, 0.0, np.abs(lse - ref_lse))
    lse_err = np.where(np.isnan(lse_err), np.inf, lse_err)
    assert (lse_err <= TOL_LSE * np.maximum(1.0, np.abs(ref_lse)) + e).all(), (
        f"{what}: lse off by up to {lse_err.max():.3e}")


def test_the_approximate_cap_runs_tanh_approx_and_only_there():
    """Variant "t" compiles to tanh.approx.f32 in every kernel that takes soft-cap (decode,
    both multi-token kernels, with the fixed offset too), and the exact forms hold none:
    the bound test alone would pass a kernel that ignored "t" (the exact tanh is within
    the bound)."""
    from dataclasses import replace

    from cupaged import jit

    base = [jit.KernelSpec("paged_decode", "bf16", 128, 16, 4, variant="c"),
            jit.KernelSpec("paged_prefill", "bf16", 128, 16, variant="c", warps=4,
                           m_atoms=2, tile_tokens=64, stages=2),
            jit.KernelSpec("paged_prefill", "bf16", 128, 16, variant="cf", warps=4,
                           m_atoms=2, tile_tokens=64, stages=2),
            jit.KernelSpec("paged_prefill_sm90", "bf16", 128, 16, variant="c"),
            jit.KernelSpec("paged_prefill_sm90", "bf16", 128, 16, variant="cf")]
    approx = [replace(s, variant=s.variant.replace("c", "ct")) for s in base]
    forms, _ = jit.ptx_forms(base + approx)
    tanh = "tanh.approx.f32 %, %"
    for exact, fast in zip(base, approx):
        assert tanh in forms[fast], fast.name
        assert tanh not in forms[exact], exact.name


def test_the_fixed_offset_bound_matches_the_kernels():
    """_variants.MAX_FIXED_CAP is variants.cuh's kMaxFixedCap: the host chooses the fixed
    offset only where the kernel's range argument holds."""
    import re

    from cupaged import jit

    src = (jit.source_dir() / "variants.cuh").read_text()
    m = re.search(r"constexpr float kMaxFixedCap = ([0-9.]+)f;", src)
    assert m and float(m.group(1)) == _variants.MAX_FIXED_CAP


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["decode", "decode_flat", "mixed"])
def test_variants_over_fp8_caches(rng, request, fmt, layout, kind):
    if kind == "decode_flat":
        request.getfixturevalue("flat_split")
        kind = "decode"
    heads, kvh = 16, 4
    q_lens = [1] * 5 if kind == "decode" else [1, 9, 0, 33]
    seq = [5, 70, 1, 900, 260] if kind == "decode" else [40, 300, 2, 600]
    host = _problem(rng, q_lens, seq, layout=layout, dtype="bf16", heads=heads, kv_heads=kvh,
                    head_size=128, block_size=16, alibi=True, stale=None)
    scales = _quantize(host, rng, fmt, layout)
    if kind == "decode":
        del host["query_start_loc"]
    kw = dict(window=150, logits_soft_cap=3.0, sinks=rng.normal(0, 1, heads).astype(np.float32))
    got, lse, ref, ref_lse = _run(host, kw, layout, kv_cache_dtype=fmt, max_query_len=max(q_lens),
                                  **scales)
    assert_close(got, ref, testing.TOLERANCE["bf16"], f"{fmt} {layout} {kind}")
    _check_lse(lse, ref_lse, f"{fmt} {layout} {kind}")


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["never", "always", "flat"])
def test_sinks_with_empty_contexts_give_zeros_and_the_sink_as_lse(rng, split):
    import cupy

    heads = 4
    host = _problem(rng, [1, 1, 1], [1, 5, 1], layout="vllm", dtype="f16", heads=heads,
                    kv_heads=2, head_size=64)
    host["seq_lens"] = np.array([0, 5, 0], np.int32)  # sequences 0 and 2: empty contexts
    sinks = rng.normal(0, 3, heads).astype(np.float32)
    dev = _device({k: host[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                        "seq_lens")})
    out, lse = cupaged.paged_attention(*dev.values(), partition=split,
                                       sinks=cupy.asarray(sinks), return_lse=True)
    out, lse = cupy.asnumpy(out), cupy.asnumpy(lse)
    assert np.isfinite(out).all()
    assert (out[[0, 2]] == 0).all()
    np.testing.assert_allclose(lse[[0, 2]], np.broadcast_to(sinks, (2, heads)), rtol=1e-6,
                               atol=1e-6)
    _, ref_lse = reference.paged_attention(host["query"], host["key_cache"], host["value_cache"],
                                           host["block_tables"], host["seq_lens"], sinks=sinks,
                                           return_lse=True)
    _check_lse(lse, ref_lse, "sinks, empty contexts")
    # Without sinks an empty context's lse is -inf, and its output zeros.
    out, lse = cupaged.paged_attention(*dev.values(), partition=split, return_lse=True)
    assert np.isneginf(cupy.asnumpy(lse)[[0, 2]]).all()
    assert (cupy.asnumpy(out)[[0, 2]] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("step", [0, 1, -2])
@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_blocksparse_matches_dense_mask(rng, step, v, block_size):
    """vLLM's positional v1/v2 arguments against the reference's dense NumPy mask."""
    import cupy

    heads, kvh, hs = 8, 2, 64
    lens = np.array([1, 31, 64, 65, 500, 1300], np.int32)
    host = _problem(rng, [1] * len(lens), lens, layout="vllm", dtype="f16", heads=heads,
                    kv_heads=kvh, head_size=hs, block_size=block_size)
    pattern = dict(local_blocks=2, vert_stride=4, sparse_block_size=64,
                   head_sliding_step=step, tp_rank=1)
    ref = reference.paged_attention(host["query"], host["key_cache"], host["value_cache"],
                                    host["block_tables"], lens, blocksparse=pattern)
    q, kc, vc, bt, sl = (cupy.asarray(host[k]) for k in ("query", "key_cache", "value_cache",
                                                         "block_tables", "seq_lens"))
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    args = (kvh, hs ** -0.5, bt, sl, block_size, int(lens.max()), None, "auto", 1.0, 1.0,
            1, 2, 4, 64, step)
    if v == 1:
        cupaged.paged_attention_v1(out, q, kc, vc, *args)
    else:
        parts = 8
        es = cupy.empty((len(lens), heads, parts), np.float32)
        cupaged.paged_attention_v2(out, es, cupy.empty_like(es),
                                   cupy.empty((len(lens), heads, parts, hs), np.float32),
                                   q, kc, vc, *args)
    assert_close(cupy.asnumpy(out), ref, testing.TOLERANCE["f16"], f"v{v} step {step}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
def test_lse_of_two_key_halves_merges_into_the_whole(rng, layout):
    """Attention over a prefix (non-causal, as cascade attention runs it) and over the
    rest, merged by their lse, equals attention over all keys."""
    import cupy

    heads, kvh, hs, bs = 8, 2, 128, 16
    n_pre, n = 512, 700
    host = _problem(rng, [1] * 4, [n] * 4, layout=layout, dtype="f16", heads=heads,
                    kv_heads=kvh, head_size=hs, block_size=bs)
    del host["query_start_loc"]
    dev = _device({k: host[k] for k in ("query", "key_cache", "value_cache", "block_tables")})
    whole = reference.attention(**{k: v for k, v in host.items() if k not in
                                   ("block_size", "num_blocks")}, kv_layout=layout)
    # Keys [0, n_pre): the first n_pre / bs blocks; keys [n_pre, n): the rest.
    lens_a = cupy.full(4, n_pre, np.int32)
    a, la = cupaged.attention(dev["query"], dev["key_cache"], dev["value_cache"],
                              dev["block_tables"], lens_a, kv_layout=layout, causal=False,
                              return_lse=True)
    bt_b = cupy.ascontiguousarray(dev["block_tables"][:, n_pre // bs:])
    b, lb = cupaged.attention(dev["query"], dev["key_cache"], dev["value_cache"], bt_b,
                              cupy.full(4, n - n_pre, np.int32), kv_layout=layout,
                              causal=False, return_lse=True)
    merged, _ = reference.merge_state(cupy.asnumpy(a).astype(np.float64), cupy.asnumpy(la),
                                      cupy.asnumpy(b).astype(np.float64), cupy.asnumpy(lb))
    assert_close(merged, whole, testing.TOLERANCE["f16"], f"{layout} halves")


@pytest.mark.gpu
def test_plain_calls_return_no_lse_and_lse_out_is_written_in_place(rng):
    import cupy

    host = _problem(rng, [1, 1], [9, 40], layout="HND", dtype="f16", heads=4, kv_heads=2,
                    head_size=64)
    del host["query_start_loc"]
    dev = _device({k: host[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                        "seq_lens")})
    out = cupaged.attention(*dev.values(), kv_layout="HND")
    assert not isinstance(out, tuple)
    lse = cupy.full((2, 4), np.nan, np.float32)
    got, lse_ret = cupaged.attention(*dev.values(), kv_layout="HND", lse=lse)
    assert lse_ret is lse and np.isfinite(cupy.asnumpy(lse)).all()
    _, ref_lse = reference.attention(**{k: host[k] for k in ("query", "key_cache", "value_cache",
                                                             "block_tables", "seq_lens")},
                                     kv_layout="HND", return_lse=True)
    _check_lse(cupy.asnumpy(lse), ref_lse, "lse=")


# ---- argument checks (no GPU) ---------------------------------------------------------------


def test_window_spellings_and_errors():
    assert _variants.window_size(None, None) == 0
    assert _variants.window_size(128, None) == 128
    assert _variants.window_size(None, 127) == 128
    assert _variants.window_size(None, -1) == 0
    with pytest.raises(ValueError, match="not both"):
        _variants.window_size(4, 3)
    with pytest.raises(ValueError, match="window must be at least 1"):
        _variants.window_size(0, None)
    with pytest.raises(ValueError, match="window_left must be -1"):
        _variants.window_size(None, -2)
    with pytest.raises(TypeError, match="window must be an int"):
        _variants.window_size(2.5, None)


def test_soft_cap_values():
    assert _variants.soft_cap(None) == (0.0, False)
    assert _variants.soft_cap(0) == (0.0, False)
    assert _variants.soft_cap(30) == (30.0, False)
    assert _variants.soft_cap(cupaged.SoftCap(30)) == (30.0, False)
    assert _variants.soft_cap(cupaged.SoftCap(30, approx=True)) == (30.0, True)
    assert _variants.soft_cap(cupaged.SoftCap(0, approx=True)) == (0.0, False)
    for bad in (-1.0, float("inf"), float("nan"), 1e-45):
        with pytest.raises(ValueError, match="logits_soft_cap"):
            _variants.soft_cap(bad)
        with pytest.raises(ValueError, match="SoftCap.cap"):
            _variants.soft_cap(cupaged.SoftCap(bad, approx=True))
    with pytest.raises(TypeError, match="logits_soft_cap"):
        _variants.soft_cap("30")
    with pytest.raises(TypeError, match="SoftCap.approx must be a bool"):
        cupaged.SoftCap(30, approx="yes")
    for bad in (True, "30", None):
        with pytest.raises(TypeError, match="SoftCap.cap must be a number"):
            cupaged.SoftCap(bad)
    assert cupaged.SoftCap(np.float32(30)) == cupaged.SoftCap(30) and \
        type(cupaged.SoftCap(30).cap) is float
    # A value of the memo keys: equal and hashing alike when equal.
    assert hash(cupaged.SoftCap(30, True)) == hash(cupaged.SoftCap(30, True))
    assert cupaged.SoftCap(30, True) != cupaged.SoftCap(30)


def test_variant_letters_and_params_layout():
    assert _variants.letters(0, 0.0, ()) == ""
    assert _variants.letters(5, 2.0, (1, 2, 3, 4, 5)) == "wcb"
    assert _variants.letters(5, 2.0, (1, 2, 3, 4, 5), approx=True) == "wctb"
    assert _variants.letters(0, 0.0, (), approx=True) == ""
    # The multi-token kernel's letters: ALiBi's bit, and the fixed offset for bf16 caps
    # up to c log2(e) = 78 without ALiBi.
    at = _variants.Variants
    assert _variants.prefill_letters(at("wc", 5, 54.0), "bf16", False) == "wcf"
    assert _variants.prefill_letters(at("c", 0, 54.07), "bf16", False) == "c"
    assert _variants.prefill_letters(at("c", 0, 50.0), "f16", False) == "c"
    assert _variants.prefill_letters(at("c", 0, 50.0), "bf16", True) == "ca"
    assert _variants.prefill_letters(at("ct", 0, 50.0), "bf16", False) == "ctf"
    assert _variants.prefill_letters(at("ct", 0, 50.0), "bf16", True) == "cta"
    assert _variants.prefill_letters(at("w", 5), "bf16", False) == "w"
    assert _variants.prefill_letters(_variants.PLAIN, "bf16", True) == "a"
    v = _variants.Variants("wc", 5, 2.0, sparse=(1, 2, 3, 4, 5))
    raw = v.pack()
    assert len(raw) == 56
    f = _variants._STRUCT.unpack(raw)
    assert f[2] == 5 and f[3] == pytest.approx(1.0) and f[4] == pytest.approx(2 * 1.4426950408889634)
    assert f[5:] == (1, 2, 3, 4, 5, 0)
    assert _variants.PLAIN_BYTES == _variants.PLAIN.pack()


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["never", "always"])
def test_an_infinite_sink_gives_its_head_zeros(rng, split):
    """A sink of +inf takes the whole softmax: its head's out is zeros and its lse +inf (as
    the reference's), single pass and split, the other heads as with finite sinks."""
    import cupy

    heads = 4
    host = _problem(rng, [1, 1], [40, 300], layout="vllm", dtype="f16", heads=heads,
                    kv_heads=2, head_size=64)
    sinks = rng.normal(0, 1, heads).astype(np.float32)
    sinks[1] = np.inf
    dev = _device({k: host[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                        "seq_lens")})
    out, lse = cupaged.paged_attention(*dev.values(), partition=split,
                                       sinks=cupy.asarray(sinks), return_lse=True)
    out, lse = cupy.asnumpy(out).astype(np.float64), cupy.asnumpy(lse)
    ref, ref_lse = reference.paged_attention(host["query"], host["key_cache"], host["value_cache"],
                                             host["block_tables"], host["seq_lens"], sinks=sinks,
                                             return_lse=True)
    assert (out[:, 1] == 0).all() and np.isposinf(lse[:, 1]).all() and np.isposinf(ref_lse[:, 1]).all()
    keep = [0, 2, 3]
    assert_close(out[:, keep], ref[:, keep], testing.TOLERANCE["f16"], split)
    _check_lse(lse[:, keep], ref_lse[:, keep], split)
