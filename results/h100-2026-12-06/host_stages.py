"""Stage timings of an eager g merge + table call, with CuPy arrays and with PyTorch
tensors: each piece of the host path timed alone with timeit (run from the repository
root with NUMBA_CP_BACKEND=cuda; it reads package internals, so it is a record, not a
benchmark of the package)."""
import sys, timeit
sys.path.insert(0, "benchmarks")
import numpy as np
import numba_cp
from numba_cp import ops, launcher, arrays as arrmod, _torch
import torch, cupy
from profile_call import comparison_calls

calls = comparison_calls()
label, call, cp_arrays, outputs = calls[-1]
numba_cp.backend.cuda.synchronize()
tensors = {k: torch.as_tensor(v, device="cuda").clone() for k, v in cp_arrays.items()}
order = ("keys", "topk_idx", "seq_lens", "attention_block_table", "sparse_block_table_out", "sparse_context_lens_out")
_, g_window, _, _ = __import__("bench_kernels").case_arrays("g", 0)
print("window", g_window)
scalars = (g_window["query_len"], g_window["init_blocks"], g_window["local_blocks"], None, "auto", None, None)
def T(stmt, n=20000):
    best = min(timeit.repeat(stmt, number=n, repeat=5))
    return best / n * 1e6
for kind, a in (("cupy", cp_arrays), ("torch", tensors)):
    call(a); numba_cp.backend.cuda.synchronize()
    arrs = tuple(a[k] for k in order)
    key, ptrs = launcher.call_signature(arrs, scalars)
    launch = ops._MERGE_LAUNCHES.get(key)
    res = {}
    res["full call"] = T(lambda: call(a), 5000); numba_cp.backend.cuda.synchronize()
    res["array_signature x6"] = T(lambda: [launcher.array_signature(x) for x in arrs])
    res["array_signature x1 keys"] = T(lambda: launcher.array_signature(arrs[0]))
    res["call_signature"] = T(lambda: launcher.call_signature(arrs, scalars))
    res["context_token"] = T(launcher.context_token)
    res["hash key"] = T(lambda: hash(key))
    res["cache get"] = T(lambda: ops._MERGE_LAUNCHES.get(key))
    res["launch_for"] = T(lambda: ops._MERGE_LAUNCHES.launch_for(arrs, scalars, None))
    res["footprint.check"] = T(lambda: launch.footprint.check(arrs, ptrs))
    res["resolve_stream"] = T(lambda: arrmod.resolve_stream(None, arrs[0]))
    res["default_stream_for"] = T(lambda: arrmod.default_stream_for(arrs[0]))
    d = launch._direct
    res["direct launch"] = T(lambda: d(arrs, None, ptrs), 5000); numba_cp.backend.cuda.synchronize()
    st = arrmod.resolve_stream(None, arrs[0])
    h = st.handle
    drv = d.driver
    res["bare cuLaunchKernel"] = T(lambda: drv.cuLaunchKernel(d.function, *d.dims, 0, h, d.params_address, 0), 5000); numba_cp.backend.cuda.synchronize()
    res["st.handle"] = T(lambda: st.handle)
    for k, v in res.items():
        print(f"{kind:6s} {k:26s} {v:7.2f} us")

# launch binding variants (cupy arrays' launch)
a = cp_arrays
arrs = tuple(a[k] for k in order)
key, ptrs = launcher.call_signature(arrs, scalars)
launch = ops._MERGE_LAUNCHES.get(key)
d = launch._direct
st = arrmod.resolve_stream(None, arrs[0])
drv = d.driver
h = st.handle
print("stream handle type", type(h), "function type", type(d.function))
hint = int(h.value) if hasattr(h, "value") else int(h)
cus = drv.CUstream(hint)
res = {}
res["cuLaunchKernel numba handle"] = T(lambda: drv.cuLaunchKernel(d.function, *d.dims, 0, h, d.params_address, 0), 5000)
res["cuLaunchKernel int stream"] = T(lambda: drv.cuLaunchKernel(d.function, *d.dims, 0, hint, d.params_address, 0), 5000)
res["cuLaunchKernel CUstream"] = T(lambda: drv.cuLaunchKernel(d.function, *d.dims, 0, cus, d.params_address, 0), 5000)
fn_int = int(d.function) if not isinstance(d.function, int) else d.function
try:
    res["cuLaunchKernel int fn+stream"] = T(lambda: drv.cuLaunchKernel(fn_int, *d.dims, 0, hint, d.params_address, 0), 5000)
except Exception as e:
    print("int fn refused", e)
numba_cp.backend.cuda.synchronize()
import ctypes
libcuda = ctypes.CDLL("libcuda.so.1")
getctx = libcuda.cuCtxGetCurrent
ctxbuf = ctypes.c_void_p()
ref_ctx = ctypes.byref(ctxbuf)
res["ctypes cuCtxGetCurrent"] = T(lambda: getctx(ref_ctx) or ctxbuf.value)
print("ctx equal", launcher.context_token(), (getctx(ref_ctx), ctxbuf.value))
res["bindings cuCtxGetCurrent"] = T(lambda: drv.cuCtxGetCurrent())
res["cupy getDevice"] = T(lambda: cupy.cuda.runtime.getDevice())
res["torch current raw stream"] = T(_torch.found().current_stream)
res["cupy current stream ptr"] = T(lambda: cupy.cuda.get_current_stream().ptr)
lock = d.lock
res["lock"] = T(lambda: lock.__enter__() or lock.__exit__(None, None, None))
vals = d.values
res["6 slot writes"] = T(lambda: [vals.__setitem__(s, ptrs[i]) for s, i in d.pointer_slots])
res["map type scalars"] = T(lambda: tuple(map(type, scalars)))
# cupy raw kernel launch for comparison
k = cupy.RawKernel(r'extern "C" __global__ void f(long long* p, int n) { }', "f")
xp = cupy.zeros(4, dtype=cupy.int64)
res["cupy RawKernel 2 args"] = T(lambda: k((1,), (32,), (xp, np.int32(4))), 5000)
numba_cp.backend.cuda.synchronize()
for kk, v in res.items():
    print(f"launch {kk:30s} {v:7.2f} us")
