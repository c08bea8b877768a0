"""Eager host time of the direct launch through ctypes (libcuda) against cuda-bindings,
in one process on the same arrays, rounds interleaved (b pack, b merge, g merge + table;
CuPy arrays and PyTorch tensors). Run from the repository root, NUMBA_CP_BACKEND=cuda.
Reads package internals to switch the binding: a record, not a package benchmark."""
import sys, time, timeit, types
sys.path.insert(0, "benchmarks")
import numpy as np
import numba_cp
from numba_cp import ops, launcher
import torch, cupy
from profile_call import comparison_calls

sync = numba_cp.backend.cuda.synchronize
print(numba_cp.backend.describe())
from importlib.metadata import version
print(torch.cuda.get_device_name(), "numba-cuda", version("numba-cuda"), "cupy", cupy.__version__, "torch", torch.__version__)
real_libcuda = launcher._libcuda
no_libcuda = types.SimpleNamespace(driver=lambda: None)


def directs():
    for cache in (ops._PACK_LAUNCHES, ops._MERGE_LAUNCHES):
        for launch in cache.values():
            d = getattr(launch, "_direct", None)
            if d is not None:
                yield d


saved = {}


def use(variant):
    for d in directs():
        saved.setdefault(id(d), d.launch_kernel)
        d.launch_kernel = saved[id(d)] if variant == "ctypes" else None
    launcher._libcuda = real_libcuda if variant == "ctypes" else no_libcuda


def host(call, arrays, n):
    start = time.perf_counter()
    for _ in range(n):
        call(arrays)
    sync()
    return (time.perf_counter() - start) * 1e6 / n


N, ROUNDS = 2000, 7
print(f"host us per eager call, {N} calls back to back then one sync; best and median of {ROUNDS} rounds, variants in turn")
for label, call, cp_arrays, outputs in comparison_calls():
    sync()
    tensors = {k: torch.as_tensor(v, device="cuda").clone() for k, v in cp_arrays.items()}
    torch.cuda.synchronize()
    for kind, arrays in (("cupy", cp_arrays), ("torch", tensors)):
        call(arrays); call(arrays); sync()
        got = {}
        for variant in ("bindings", "ctypes"):
            use(variant)
            for name in outputs:
                arrays[name][...] = 0 if kind == "cupy" else 0
            call(arrays); sync()
            got[variant] = [cupy.asnumpy(arrays[n]) if kind == "cupy" else arrays[n].cpu().numpy() for n in outputs]
        same = all(np.array_equal(x, y) for x, y in zip(got["bindings"], got["ctypes"]))
        times = {"ctypes": [], "bindings": []}
        for r in range(ROUNDS):
            for variant in (("ctypes", "bindings") if r % 2 == 0 else ("bindings", "ctypes")):
                use(variant)
                times[variant].append(host(call, arrays, N))
        use("ctypes")
        print(f"{label:16s} {kind:6s} ctypes best {min(times['ctypes']):6.2f} med {np.median(times['ctypes']):6.2f} | "
              f"bindings best {min(times['bindings']):6.2f} med {np.median(times['bindings']):6.2f} | same outputs {same}", flush=True)

def T(f, n=20000):
    return min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6
use("ctypes"); a = T(launcher.context_token)
use("bindings"); b = T(launcher.context_token)
use("ctypes")
print(f"context_token: ctypes {a:.2f} us, cuda-bindings {b:.2f} us")
