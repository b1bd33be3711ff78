"""What compute-sanitizer runs in tools/device.sh sanitize, besides the GPU tests.

Positive controls: deliberately faulty kernels in namespace cupaged, so a sanitizer run
that reports nothing is known to have instrumented the library's kernels (its
--kernel-name filter matched) and not to have skipped them. Each must end with a
non-zero error count:
    compute-sanitizer --tool memcheck  --kernel-name kns=cupaged python3 tools/sanitize_control.py oob-near
    compute-sanitizer --tool memcheck  --kernel-name kns=cupaged python3 tools/sanitize_control.py oob-far
    compute-sanitizer --tool racecheck --kernel-name kns=cupaged python3 tools/sanitize_control.py race
    ... python3 tools/sanitize_control.py arrive
is a correct kernel instead: a hand-off through bar.arrive / bar.sync (mla_attention_sm90's
pattern for P and its factors), whose racecheck report says whether the tool orders a
thread's accesses before its bar.arrive against the waiting threads' accesses after their
bar.sync (on the device's CUDA 13 it does not: it reports hazards there).

Single library launches, checked against the reference (the sanitizer watches one
kernel's edges at a time):
    ... python3 tools/sanitize_control.py mla SPLIT KV FAMILY
        mla_attention over a decode batch whose first sequence is empty, then a mixed
        batch: SPLIT tiles per split-KV partition (0: one pass), KV the cache (auto or
        fp8_e4m3 / fp8_e5m2), FAMILY mma or sm90
    ... python3 tools/sanitize_control.py sm90 LAYOUT KV [HEAD_SIZE]
        paged_prefill_sm90 (asserted to serve the call) over a mixed batch: LAYOUT NHD,
        HND or vllm, KV auto or an fp8 format, HEAD_SIZE 128 unless given (512: its
        consumers splitting the dims, the partial scores through shared memory; then
        40 prompts of one key tile each follow)
"""
import sys
from pathlib import Path

import cupy

SOURCE = r"""
namespace cupaged {
// Writes `past` elements past the end of an n-element buffer.
__global__ void control_oob(float* p, int n, int past) { p[n - 1 + past] = 1.f; }
// Thread t reads the slot thread t + 1 writes, with no barrier between.
__global__ void control_race(float* out) {
  __shared__ float s[64];
  s[threadIdx.x] = threadIdx.x;
  out[threadIdx.x] = s[(threadIdx.x + 1) % 64];
}
// 256 threads, two passes of four rounds: threads 0-127 write s, threads 128-255 read it
// after named barrier 2 (both sync), then only arrive on barrier 1, which the writers sync
// on before the next round's writes; after each pass the writers publish m through
// __syncthreads and every thread reads it. Race-free (mla_attention_sm90's row tiles).
__global__ void control_arrive(float* out) {
  __shared__ float s[128], m[128];
  const int t = threadIdx.x;
  float acc = 0.f;
  for (int pass = 0; pass < 2; ++pass) {
    __syncthreads();  // the previous pass's reads of m are done
    for (int it = 0; it < 4; ++it) {
      if (t < 128) {
        if (it > 0) asm volatile("bar.sync 1, 256;" ::: "memory");
        s[t] = t + it;
      }
      asm volatile("bar.sync 2, 256;" ::: "memory");
      if (t >= 128) {
        acc += s[t - 128];
        if (it + 1 < 4) asm volatile("bar.arrive 1, 256;" ::: "memory");
      }
    }
    if (t < 128) m[t] = pass;
    __syncthreads();
    acc += m[t % 128];
  }
  out[t] = acc;
}
}
"""


def controls(which: str) -> None:
    cupy.cuda.set_allocator(None)  # the buffer its own allocation, as CUPAGED_TEST_NO_POOL does
    mod = cupy.RawModule(code=SOURCE, name_expressions=[
        "cupaged::control_oob", "cupaged::control_race", "cupaged::control_arrive"])
    if which.startswith("oob"):
        # oob-near: one element past the end; oob-far: 1 GiB past it.
        buf = cupy.zeros(32, cupy.float32)
        past = 1 if which == "oob-near" else 1 << 28
        mod.get_function("cupaged::control_oob")((1,), (1,), (buf, cupy.int32(32),
                                                              cupy.int32(past)))
    elif which == "arrive":
        buf = cupy.zeros(256, cupy.float32)
        mod.get_function("cupaged::control_arrive")((1,), (256,), (buf,))
        want = [2 * sum(t - 128 + it for it in range(4)) * (t >= 128) + 1 for t in range(256)]
        assert buf.get().tolist() == want, "the hand-off kernel computed a wrong sum"
    else:
        buf = cupy.zeros(64, cupy.float32)
        mod.get_function("cupaged::control_race")((1,), (64,), (buf,))
    try:
        cupy.cuda.runtime.deviceSynchronize()
    except Exception as e:  # memcheck turns the launch's fault into an error here
        print(f"launch error (expected under memcheck): {e}")
    print(f"control {which} ran")


def mla_launch(split: int, fmt: str, family: str) -> None:
    import numpy as np

    import cupaged
    from cupaged import planning, reference

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_mla import SCALE, device, make_mla, to_fp8

    cupy.cuda.set_allocator(None)  # each array its own allocation: an overrun leaves it
    planning.set_mla_split(split)
    planning.set_mla_family(family)
    rng = np.random.default_rng(0)
    kw = {} if fmt == "auto" else dict(kv_cache_dtype=fmt, k_scale=0.05)

    def problem(q_lens, seq_lens):  # host arrays, the cache in the case's format
        h = make_mla(rng, q_lens, seq_lens, heads=16, block_size=16)
        if fmt != "auto":
            h["kv_cache"] = to_fp8(h["kv_cache"], fmt, 0.05)
        return h

    # Decode form, the first sequence empty: nothing may read before its table row (the
    # table's first entry)
    dec = {k: v for k, v in problem([1, 1], [0, 70]).items() if k != "query_start_loc"}
    got = cupy.asnumpy(cupaged.mla_attention(**device(dec), scale=SCALE, **kw))
    assert (got[0] == 0).all(), "the empty sequence's rows"
    host = problem([1, 3, 20], [100, 260, 90])
    ref = reference.mla_attention(host["q"], host["kv_cache"], host["block_tables"],
                                  host["seq_lens"], host["query_start_loc"], scale=SCALE, **kw)
    got = cupy.asnumpy(cupaged.mla_attention(**device(host), scale=SCALE, **kw))
    err = np.abs(got.astype(np.float64) - ref).max()
    print("max abs error", err)
    assert err < 0.05


def sm90_launch(layout: str, kv: str, head_size: int = 128) -> None:
    import numpy as np

    import cupaged
    from cupaged import planning, reference, testing

    rng = np.random.default_rng(0)
    fp8_query = kv.endswith("-q")  # an 8-bit query as well (the kernel's 8-bit products)
    kv = kv.removesuffix("-q")
    q_lens, seq = [300, 5, 130], [300, 900, 2000]
    if head_size > 256:  # and prompts of one key tile each: the partial scores' two slots
        q_lens, seq = q_lens + [12] * 40, seq + [12] * 40
    bt, nb = testing.random_block_tables(np.array(seq, np.int32), 16, rng, spare_blocks=2)
    kc, vc = testing.random_cache(nb, 2, head_size, 16, np.float16, rng)
    fp8 = {}
    if kv != "auto":  # the same values' fp8 bytes, per-tensor scales
        kc, vc = (reference.quantize_fp8(c, kv, 0.01).view(np.uint8) for c in (kc, vc))
        fp8 = dict(kv_cache_dtype=kv, k_scale=0.01, v_scale=0.01)
    kc, vc = testing.convert_layout(kc, vc, "vllm", layout)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = testing.random_normal((int(qsl[-1]), 8, head_size), np.float16, rng)
    if fp8_query:
        fp8["out"] = cupy.empty(q.shape, np.float16)
        q = reference.quantize_fp8(q, kv, 1.0).view(np.uint8)
    d = {k: cupy.asarray(v) for k, v in dict(
        query=q, key_cache=kc, value_cache=vc, block_tables=bt,
        seq_lens=np.array(seq, np.int32), query_start_loc=qsl).items()}
    planning.set_prefill_family("sm90")
    served = []  # the Hopper kernel must serve it, or the sanitizer would watch nothing
    real = planning.prefill_sm90_kernel
    planning.prefill_sm90_kernel = lambda *a, **k: served.append(a) or real(*a, **k)
    cupaged.attention(**d, kv_layout=layout, **fp8)
    assert served, f"paged_prefill_sm90 does not serve {layout}:{kv}"
    cupy.cuda.Device().synchronize()
    print("done")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which in ("-h", "--help"):
        print(__doc__)
    elif which in ("oob-near", "oob-far", "race", "arrive"):
        controls(which)
    elif which == "mla" and len(sys.argv) == 5:
        mla_launch(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    elif which == "sm90" and len(sys.argv) in (4, 5):
        sm90_launch(sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:]))
    else:
        raise SystemExit(__doc__)
