"""``cupaged-bench fp8-error``: how much an fp8 KV cache costs in accuracy. Attention over
an fp8 cache written from a float16 one (reshape_and_cache, per-tensor or per-token
scales), against the float64 reference on the float16 cache: the quantization's error,
which the decode and prefill rows' checks (the reference on the same fp8 bytes) do not
show."""

from __future__ import annotations

import cupy
import numpy as np

from .. import testing

BS = 16


def rows(heads: int = 32, kv_heads: int = 8, head_size: int = 128, seqs: int = 4,
         tokens: int = 1000, seed: int = 2) -> list:
    """[{format, scales, rel_err}]: the relative Frobenius error of decode over e4m3 and
    e5m2 caches with per-tensor and per-token scales, and of the float16 cache itself
    (no quantization), against the float64 reference on the float16 cache."""
    import cupaged
    from cupaged import reference

    rng = np.random.default_rng(seed)
    per_seq = -(-tokens // BS)
    blocks = seqs * per_seq
    k16 = testing.random_normal((seqs * tokens, kv_heads, head_size), np.float16, rng)
    v16 = testing.random_normal((seqs * tokens, kv_heads, head_size), np.float16, rng)
    q = testing.random_normal((seqs, heads, head_size), np.float16, rng)
    slots = np.concatenate([s * per_seq * BS + np.arange(tokens) for s in range(seqs)])
    bt = np.arange(blocks, dtype=np.int32).reshape(seqs, -1)
    lens = np.full(seqs, tokens, np.int32)
    kc16 = np.zeros((blocks, BS, kv_heads, head_size), np.float16)
    vc16 = np.zeros_like(kc16)
    kc16.reshape(-1, kv_heads, head_size)[slots] = k16
    vc16.reshape(-1, kv_heads, head_size)[slots] = v16
    ref = reference.attention(q, kc16, vc16, bt, lens)

    def rel(got):
        return float(np.linalg.norm(cupy.asnumpy(got).astype(np.float64) - ref)
                     / np.linalg.norm(ref))

    out = []
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        for mode in ("tensor", "token"):
            kc = cupy.zeros((blocks, BS, kv_heads, head_size), np.uint8)
            vc = cupy.zeros_like(kc)
            if mode == "token":
                ks = cupy.zeros((blocks, kv_heads, BS), np.float32)
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
            out.append(dict(format=fmt, scales=mode, rel_err=rel(got)))
    got = cupaged.attention(cupy.asarray(q), cupy.asarray(kc16), cupy.asarray(vc16),
                            cupy.asarray(bt), cupy.asarray(lens))
    out.append(dict(format="float16 (no quantization)", scales="", rel_err=rel(got)))
    return out
