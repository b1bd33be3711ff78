"""Device: when a wgmma probe of tests/test_sm90.py fails, which descriptor offsets
(leading and stride byte offsets) make its MN-major B operand right: each probe's error
with sm90.cuh's own offsets, and for a failing MN-major one every (lbo, sbo) pair of a
small grid that matches NumPy.   python3 tools/sm90_layout_scan.py   (a Hopper GPU)"""
import numpy as np, cupy, itertools, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
from test_sm90 import _compile, PROBES
from cupaged import _dtypes
m = cupy.cuda.function.Module(); m.load(_compile("sm_90a"))
rng = np.random.default_rng(0)
for kernel, dt, n, mn, ar in PROBES:
    npdt = _dtypes.BY_NAME[dt].numpy
    a = rng.standard_normal((64, 16)).astype(npdt); bkn = rng.standard_normal((16, n)).astype(npdt)
    b = bkn if mn else np.ascontiguousarray(bkn.T)
    want = a.astype(np.float64) @ bkn.astype(np.float64)
    def run(lbo, sbo):
        d = cupy.full((64, n), np.nan, np.float32)
        m.get_function(kernel)((1,), (128,), (cupy.asarray(a.view(np.uint16)), cupy.asarray(b.view(np.uint16)), d, np.uint32(lbo), np.uint32(sbo)))
        g = cupy.asnumpy(d).astype(np.float64)
        return np.nanmax(np.abs(g - want)) if not np.isnan(g).all() else np.inf
    base = run(0, 0)
    line = f"{kernel}: default err {base:.3g}"
    if mn and base > 1e-3:
        ok = [(l, s) for l, s in itertools.product([16, 128, 1024, 2048, 4096], [16, 128, 1024, 2048, 4096]) if run(l, s) < 1e-3]
        line += f"; working (lbo, sbo): {ok}"
    print(line, flush=True)
