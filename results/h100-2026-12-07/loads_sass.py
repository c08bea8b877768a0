"""Case b's pack (both kernels) as sm_90 SASS built by this machine's nvJitLink, as
a first launch builds it: each global load, branch and the first barrier, counted from 0."""
import glob, os, shutil, subprocess, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import param_lines as pl
tool = shutil.which("nvdisasm") or next(iter(glob.glob("/usr/local/cuda*/bin/nvdisasm")
                                             + glob.glob("/opt/**/nvdisasm", recursive=True)), None)
print("nvdisasm:", tool)
for label, factory, shape in pl.case_shapes():
    if not label.startswith("b"):
        continue
    kernel = factory(*shape)
    data = pl.cubin(kernel)
    if tool is None:
        continue
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        open(p, "wb").write(data)
        sass = subprocess.run([tool, "-c", p], capture_output=True, text=True).stdout
    lines = [l.split("*/", 1)[1].strip() for l in sass.splitlines() if pl.INSTRUCTION.search(l)]
    print(kernel.py_func.__name__, len(lines))
    for k, l in enumerate(lines):
        if "LDG" in l or "BAR.SYNC" in l or "BSSY" in l or " BRA" in l:
            print("  ", k, l[:70])
        if "BAR.SYNC" in l:
            break
