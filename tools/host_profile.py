"""Where the host time of a cached call goes: cProfile over many calls of each entry
point (llama-3-8b shape, batch 8, context 1024, CuPy arrays), top functions by own time.
   python3 tools/host_profile.py [calls]"""

import cProfile
import pstats
import sys

import cupy
import numpy as np

from cupaged import cache_ops, decode
from cupaged.bench import DecodeCase

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
case = DecodeCase(8, np.full(8, 1024, np.int32), 32, 8, 128, 16, np.dtype(np.float16)).build()
a = case.arrays
out = cupy.empty(a["query"].shape, a["query"].dtype)
ws = decode.DecodeWorkspace(8, 32, 128)
ks, vs = [a["key_cache"]] * 32, [a["value_cache"]] * 32
pairs = cupy.asarray([[0, 1], [2, 3]], np.int64)
args = (a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["context_lens"])
cases = {
    "single pass": lambda: decode.paged_attention(*args, out=out, partition="never",
                                                     max_context_len=1024),
    "split-KV": lambda: decode.paged_attention(*args, out=out, partition="always",
                                                  max_context_len=1024),
    "split-KV + workspace": lambda: decode.paged_attention(
        *args, out=out, partition="always", workspace=ws, max_context_len=1024),
    "copy_blocks 32 layers": lambda: cache_ops.copy_blocks(ks, vs, pairs),
}
for name, fn in cases.items():
    for _ in range(20):
        fn()
    cupy.cuda.Device().synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    cupy.cuda.Device().synchronize()
    st = pstats.Stats(prof)
    print(f"==== {name}: {st.total_tt / calls * 1e6:.1f} us per call under cProfile")
    st.sort_stats("tottime").print_stats(12)
