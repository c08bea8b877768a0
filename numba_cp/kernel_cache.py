"""Compiled kernels kept on disk (CUDA), so ranks and later jobs load instead of compiling.

A first call compiles its pack and merge kernels: about 1 to 5 s each on a
2-core machine, once per process. With Numba's on-disk cache a process loads
them in milliseconds instead, and the ranks of a job, and every later job,
share what the first one compiled.

The kernels are closures built by factories (one per launch shape); numba-cuda
caches those too, keying each entry by the closure's captured values, which
pickle to the same bytes in every process. Numba tells entries apart by the
kernel's own source file only, so a change in a device function of another
file would reuse a stale kernel: the folder is named after a hash of every
source file of the package, and any change starts a fresh one.

Applies to the CUDA target. The simulator interprets kernels (nothing to
keep), and numba-hip's cache is not used. The separate IPC gather's bump,
push and wait/copy kernels are launched by the transport itself and compile
per process.

``NUMBA_CP_KERNEL_CACHE``: unset keeps kernels under ``$XDG_CACHE_HOME/numba_cp``
(default ``~/.cache/numba_cp``), a path keeps them there, ``0`` turns it off.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from functools import lru_cache
from pathlib import Path

from . import __version__, _numba
from .backend import TARGET

__all__ = ["CACHE_ENV", "cache_location", "use_disk_cache"]

CACHE_ENV = "NUMBA_CP_KERNEL_CACHE"
_PACKAGE = Path(__file__).resolve().parent


@lru_cache(maxsize=None)
def _source_tag() -> str:
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        digest.update(path.read_bytes())
    return f"{__version__}-{digest.hexdigest()[:16]}"


def cache_location() -> str | None:
    """The folder compiled kernels are kept in; None where nothing is kept."""
    if TARGET.name != "cuda":
        return None
    raw = os.environ.get(CACHE_ENV, "").strip()
    if raw == "0":
        return None
    root = (Path(raw) if raw else
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "numba_cp")
    return str(root.expanduser() / _source_tag())


@lru_cache(maxsize=None)
def _writable(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def use_disk_cache(kernel) -> bool:
    """Let ``kernel`` (a CUDA dispatcher) load and save its compiled specialisations
    in :func:`cache_location`. Returns whether it does.

    A folder that cannot be written leaves the kernel compiling in memory, as does
    anything numba-cuda refuses: Numba would otherwise fall back to a cache beside
    the sources, which has no guard against stale kernels.
    """
    folder = cache_location()
    if folder is None or not _writable(folder):
        return False
    return _numba.enable_disk_cache(kernel, folder)
