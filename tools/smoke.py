import os, sys, time, math
import numpy as np, cupy
import ml_dtypes
import cupaged
from cupaged import reference
print(cupy.__version__, cupy.cuda.runtime.runtimeGetVersion(), cupaged.jit.nvrtc_version(), cupaged.jit.source_dir())
bf = np.dtype(ml_dtypes.bfloat16)
a = cupy.asarray(np.arange(4, dtype=np.float32).astype(bf)); print('bf16 asarray', a.dtype, cupy.asnumpy(a))
try:
    print('bf16 astype on device', cupy.arange(4, dtype=cupy.float32).astype(bf))
except Exception as e: print('astype fail', e)
rng = np.random.default_rng(0)
for dt in (np.float32, np.float16, bf):
  for (S,H,KVH,hs,bs,ctx_max,part) in [(4,8,2,128,16,300,'never'),(4,8,2,128,16,3000,'always'),(3,4,4,40,1,100,'never'),(2,12,1,256,256,700,'always'),(2,12,1,256,4,700,512)]:
    it = np.dtype(dt).itemsize; x = 16//it
    lens = rng.integers(0, ctx_max, S).astype(np.int32); lens[0] = ctx_max
    nbl = -(-lens//bs); mb = int(nbl.max()) + 1; NB = int(nbl.sum()) + 3
    perm = rng.permutation(NB).astype(np.int32)
    bt = np.full((S, mb), -7, np.int32); o = 0
    for s in range(S): bt[s,:nbl[s]] = perm[o:o+nbl[s]]; o += nbl[s]
    q = rng.standard_normal((S,H,hs)).astype(dt)
    kc = rng.standard_normal((NB,KVH,hs//x,bs,x)).astype(dt)
    vc = rng.standard_normal((NB,KVH,hs,bs)).astype(dt)
    ref = reference.paged_attention(q,kc,vc,bt,lens)
    t=time.time()
    out = cupaged.paged_attention(cupy.asarray(q),cupy.asarray(kc),cupy.asarray(vc),cupy.asarray(bt),cupy.asarray(lens),partition=part)
    got = cupy.asnumpy(out).astype(np.float64)
    err = np.linalg.norm(got-ref)/np.linalg.norm(ref)
    print(np.dtype(dt).name, S,H,KVH,hs,bs,ctx_max,part, 'err %.2e'%err, 'nan', np.isnan(got).any(), '%.1fs'%(time.time()-t))
