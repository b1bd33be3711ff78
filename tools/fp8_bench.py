"""fp8 KV caches on the GPU machine: decode time of an fp8 (e4m3, per-tensor scales) cache
against the same call on a float16 cache and against FlashInfer's fp8 decode, prefill
TFLOP/s over fp8 against bf16, and the accuracy of e4m3 and e5m2 against a float16 cache.
One run, every figure from the same process; results in $OUT/fp8_bench.json.

    source tools/device_env.sh; python3 tools/fp8_bench.py [--no-flashinfer]
        [--tiles default,64x2,128x2] [--only decode,prefill,accuracy]

--tiles times the fp8 decode rows under several (tokens x stages) tiles as well.
"""

from __future__ import annotations

import json
import os

import cupy
import numpy as np

import cupaged
from cupaged import planning, reference, testing
from cupaged.bench import peers
from cupaged.bench import timing

OUT = os.environ.get("OUT", "/tmp/cupaged-out")
HS, BS = 128, 16


def _cache(nb, kvh, fp8, rng):
    """HND caches: float16 random normal, or fp8 bytes of finite e4m3 values (|x| < 32)."""
    shape = (nb, kvh, BS, HS)
    if fp8:
        mag = cupy.asarray(rng.integers(0, 0x60, size=shape, dtype=np.uint8))
        sign = cupy.asarray(rng.integers(0, 2, size=shape, dtype=np.uint8)) << 7
        return mag | sign, (mag ^ 0x11) | sign
    k = cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
    return k, k[::-1].copy()


def decode_rows(copy_bw, use_flashinfer, tiles=(None,)):
    rng = np.random.default_rng(0)
    rows = []
    for heads, kvh, batch, ctx in ((32, 8, 64, 2048), (32, 32, 64, 2048), (32, 8, 8, 32768)):
        blocks = batch * ctx // BS
        bt = cupy.asarray(rng.permutation(blocks).astype(np.int32).reshape(batch, -1))
        lens = cupy.full(batch, ctx, np.int32)
        q = cupy.asarray(rng.standard_normal((batch, heads, HS), dtype=np.float32)).astype(np.float16)
        out = cupy.empty_like(q)
        row = dict(shape=f"{heads}/{kvh} b{batch} ctx{ctx}")
        for name, fp8 in (("f16", False), ("e4m3", True)):
            k, v = _cache(blocks, kvh, fp8, rng)
            kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=0.05, v_scale=0.05) if fp8 else {}

            def run():
                cupaged.attention(q, k, v, bt, lens, kv_layout="HND", out=out,
                                  max_seq_len=ctx, **kw)

            nbytes = 2 * batch * ctx * kvh * HS * (1 if fp8 else 2) + 2 * q.nbytes
            for tile in tiles if fp8 else (None,):
                planning.set_tuning(tile=tile)
                tag = "" if tile is None else "_{}x{}".format(*tile)
                try:
                    us = timing.time_us(run).median_us
                except Exception as e:  # a tile this shape cannot take (reported, not fatal)
                    row[f"cupaged_{name}{tag}_error"] = str(e)[:200]
                    continue
                row[f"cupaged_{name}{tag}_us"] = us
                row[f"cupaged_{name}{tag}_bw"] = nbytes / (us * 1e-6) / copy_bw
            planning.set_tuning()
            if fp8 and use_flashinfer:
                row.update(_flashinfer_fp8(q, k, v, bt, lens, heads, kvh, nbytes, copy_bw))
        if "cupaged_e4m3_us" in row:
            row["speedup_fp8"] = row["cupaged_f16_us"] / row["cupaged_e4m3_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _flashinfer_fp8(q, k, v, bt, lens, heads, kvh, nbytes, copy_bw):
    import torch
    import flashinfer

    res = {}
    tq = torch.from_dlpack(q)
    tk = torch.from_dlpack(k).view(torch.float8_e4m3fn)
    tv = torch.from_dlpack(v).view(torch.float8_e4m3fn)
    batch, width = bt.shape
    indptr = torch.arange(0, (batch + 1) * width, width, dtype=torch.int32, device="cuda")
    indices = torch.from_dlpack(bt.ravel())
    last = torch.full((batch,), BS, dtype=torch.int32, device="cuda")
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(tq)
    for tc in (False, True):
        try:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tc)
            w.plan(indptr, indices, last, heads, kvh, HS, BS, pos_encoding_mode="NONE",
                   q_data_type=torch.float16, kv_data_type=torch.float8_e4m3fn,
                   sm_scale=HS ** -0.5)
            us = timing.time_us(lambda: w.run(tq, (tk, tv), out=out, k_scale=0.05,
                                             v_scale=0.05)).median_us
            key = "flashinfer_decode_tc" if tc else "flashinfer_decode"
            res[f"{key}_us"] = us
            res[f"{key}_bw"] = nbytes / (us * 1e-6) / copy_bw
        except Exception as e:  # report, keep measuring the rest
            res[f"flashinfer_{'tc' if tc else 'cc'}_error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def prefill_rows():
    rng = np.random.default_rng(1)
    rows = []
    for seqs, length, heads, kvh in ((1, 4096, 32, 8), (8, 2048, 32, 8)):
        blocks = seqs * length // BS
        bt = cupy.asarray(rng.permutation(blocks).astype(np.int32).reshape(seqs, -1))
        lens = cupy.full(seqs, length, np.int32)
        qsl = cupy.arange(0, (seqs + 1) * length, length, dtype=np.int32)
        q = cupy.asarray(rng.standard_normal((seqs * length, heads, HS), dtype=np.float32))
        bf16 = cupaged._dtypes.BF16.numpy
        q = q.astype(bf16)
        out = cupy.empty_like(q)
        flops = 4 * heads * HS * seqs * length * (length + 1) / 2
        row = dict(shape=f"{seqs}x{length} {heads}/{kvh}")
        for name in ("bf16", "e4m3"):
            if name == "bf16":
                k = cupy.asarray(rng.standard_normal((blocks, kvh, BS, HS), dtype=np.float32)).astype(bf16)
                v, kw = k[::-1].copy(), {}
            else:
                k, v = _cache(blocks, kvh, True, rng)
                kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=0.05, v_scale=0.05)

            def run():
                cupaged.attention(q, k, v, bt, lens, qsl, kv_layout="HND", out=out,
                                  max_query_len=length, max_seq_len=length, **kw)

            us = timing.time_us(run, reps=10).median_us
            row[f"{name}_tflops"] = flops / us / 1e6
        row["ratio"] = row["e4m3_tflops"] / row["bf16_tflops"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def accuracy_rows():
    """Relative error of attention over an fp8 cache written from a float16 one, against
    the float64 reference on the float16 cache (decode, 32/8 heads, 4 x 1000 tokens)."""
    rng = np.random.default_rng(2)
    heads, kvh, n, seqs = 32, 8, 1000, 4
    blocks = seqs * -(-n // BS)
    k16 = testing.random_normal((seqs * n, kvh, HS), np.float16, rng)
    v16 = testing.random_normal((seqs * n, kvh, HS), np.float16, rng)
    q = testing.random_normal((seqs, heads, HS), np.float16, rng)
    slots = np.concatenate([s * (-(-n // BS)) * BS + np.arange(n) for s in range(seqs)])
    bt = np.arange(blocks, dtype=np.int32).reshape(seqs, -1)
    lens = np.full(seqs, n, np.int32)
    kc16 = np.zeros((blocks, BS, kvh, HS), np.float16)
    vc16 = np.zeros_like(kc16)
    kc16.reshape(-1, kvh, HS)[slots] = k16
    vc16.reshape(-1, kvh, HS)[slots] = v16
    ref = reference.attention(q, kc16, vc16, bt, lens)
    rows = []
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        for mode in ("tensor", "token"):
            kc = cupy.zeros((blocks, BS, kvh, HS), np.uint8)
            vc = cupy.zeros_like(kc)
            if mode == "token":
                ks = cupy.zeros((blocks, kvh, BS), np.float32)
                vs = cupy.zeros_like(ks)
            else:
                fmax = reference.fp8_max(fmt)
                ks = float(np.abs(k16).max()) / fmax
                vs = float(np.abs(v16).max()) / fmax
            cupaged.reshape_and_cache(cupy.asarray(k16), cupy.asarray(v16), kc, vc,
                                      cupy.asarray(slots), fmt, ks, vs, kv_layout="NHD")
            got = cupaged.attention(cupy.asarray(q), kc, vc, cupy.asarray(bt),
                                    cupy.asarray(lens), kv_cache_dtype=fmt, k_scale=ks,
                                    v_scale=vs)
            err = np.linalg.norm(cupy.asnumpy(got).astype(np.float64) - ref) / np.linalg.norm(ref)
            rows.append(dict(format=fmt, scales=mode, rel_err=float(err)))
            print(json.dumps(rows[-1]), flush=True)
    got = cupaged.attention(cupy.asarray(q), cupy.asarray(kc16), cupy.asarray(vc16),
                            cupy.asarray(bt), cupy.asarray(lens))
    err = np.linalg.norm(cupy.asnumpy(got).astype(np.float64) - ref) / np.linalg.norm(ref)
    rows.append(dict(format="f16 (no quantization)", scales="", rel_err=float(err)))
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--tiles", default="default")
    ap.add_argument("--only", default="accuracy,decode,prefill")
    a = ap.parse_args()
    tiles = [None if t == "default" else tuple(int(v) for v in t.split("x"))
             for t in a.tiles.split(",")]
    parts = a.only.split(",")
    use_fi = not a.no_flashinfer and peers.flashinfer_unavailable() is None
    copy_bw = timing.copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; flashinfer {'on' if use_fi else 'off'}", flush=True)
    res = dict(copy_bw=copy_bw)
    if "accuracy" in parts:
        res["accuracy"] = accuracy_rows()
    if "decode" in parts:
        res["decode"] = decode_rows(copy_bw, use_fi, tiles)
    if "prefill" in parts:
        res["prefill"] = prefill_rows()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "fp8_bench.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
