"""Host us of the launch bindings and context reads an eager call makes (g merge + table,
CuPy arrays): timeit, best of 7 rounds of 500 calls, a synchronisation before each round.
Run from the repository root with NUMBA_CP_BACKEND=cuda; it reads package internals, so
it is a record of one measurement, not a benchmark of the package."""
import sys, timeit
sys.path.insert(0, "benchmarks")
import numba_cp
from numba_cp import ops, launcher, arrays as arrmod
import cupy
from cupy_backends.cuda.api import driver as cupy_driver
from profile_call import comparison_calls

sync = numba_cp.backend.cuda.synchronize
label, call, a, outputs = comparison_calls()[-1]
call(a); sync()
(launch,) = [l for l in ops._MERGE_LAUNCHES.values() if l.direct]
d = launch._direct
arrs = tuple(a[k] for k in ("keys", "topk_idx", "seq_lens", "attention_block_table",
                            "sparse_block_table_out", "sparse_context_lens_out"))
st = arrmod.resolve_stream(None, arrs[0])
h = st.handle
hint = int(h.value) if hasattr(h, "value") else int(h)
fn = int(d.function)
drv = d.driver
config = d.configs.get(st) or d._chained_config(st)

def T(stmt, n=500):
    return min(timeit.repeat(stmt, setup=sync, number=n, repeat=7)) / n * 1e6

res = {}
for _ in range(2):
    res["full eager call"] = T(lambda: call(a))
    res["bindings cuLaunchKernelEx (chained)"] = T(
        lambda: drv.cuLaunchKernelEx(config, d.function, d.params_address, 0))
    res["bindings cuLaunchKernel"] = T(
        lambda: drv.cuLaunchKernel(d.function, *d.dims, 0, h, d.params_address, 0))
    res["cupy launchKernel"] = T(
        lambda: cupy_driver.launchKernel(fn, *d.dims, 0, hint, d.params_address, 0))
    res["bindings cuCtxGetCurrent"] = T(lambda: drv.cuCtxGetCurrent(), 5000)
    res["cupy ctxGetCurrent"] = T(cupy_driver.ctxGetCurrent, 5000)
    res["context_token"] = T(launcher.context_token, 5000)
    res["call_signature"] = T(lambda: launcher.call_signature(arrs, (1, 1, 2)), 5000)
    res["resolve_stream"] = T(lambda: arrmod.resolve_stream(None, arrs[0]), 5000)
sync()
print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; tree {numba_cp.__file__}")
print("context tokens equal:", int(drv.cuCtxGetCurrent()[1]) == cupy_driver.ctxGetCurrent())
for k, v in res.items():
    print(f"{k:40s} {v:7.2f} us")
