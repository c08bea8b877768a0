"""PyTorch, for callers that pass tensors; never imported here.

PyTorch is optional and slow to import, so it is only used once the caller
has imported it: whoever holds a tensor has ``torch`` in ``sys.modules``.
What is looked up is looked up once.

Two things read it:

* :func:`numba_cp.launcher.array_signature` keys a tensor from its attributes
  with the tables here (``Torch.typestrs``, ``Torch.strided``): PyTorch builds
  ``__cuda_array_interface__`` anew, in Python, on every access.
* :func:`numba_cp.arrays.resolve_stream` launches a call whose first array is a
  tensor on PyTorch's current stream, where a PyTorch caller queues its work.
"""

from __future__ import annotations

import sys

__all__ = ["Torch", "found"]

# The typestr and itemsize PyTorch's __cuda_array_interface__ gives each dtype:
# only the dtypes every PyTorch release maps the same way (bool, bfloat16 and
# the wide unsigned types came later or changed), so a key from here is always
# the interface's. Other dtypes go through the interface, whose answer (or
# refusal) validation then reports.
_TYPESTRS = {"float16": ("<f2", 2), "float32": ("<f4", 4), "float64": ("<f8", 8),
             "uint8": ("|u1", 1), "int8": ("|i1", 1), "int16": ("<i2", 2),
             "int32": ("<i4", 4), "int64": ("<i8", 8)}


class Torch:
    """What is read from an imported ``torch`` module."""

    def __init__(self, torch):
        self.tensor = torch.Tensor
        self.strided = torch.strided
        # dtype -> (the interface's typestr, itemsize), for the dtypes of _TYPESTRS
        self.typestrs = {getattr(torch, name): value for name, value in _TYPESTRS.items()
                         if hasattr(torch, name)}
        self.current_stream = _current_stream_getter(torch)


def _current_stream_getter(torch):
    """``() -> int``: the raw handle of PyTorch's current stream on the current device.

    ``torch.cuda.current_stream().cuda_stream`` builds a Stream object per call;
    the two private functions PyTorch's own compiled code calls for it return
    the same handle directly. Where they are missing, the public call.
    """
    private = getattr(torch, "_C", None)
    raw = getattr(private, "_cuda_getCurrentRawStream", None)
    device = getattr(private, "_cuda_getDevice", None)
    if callable(raw) and callable(device):
        return lambda: raw(device())
    return lambda: torch.cuda.current_stream().cuda_stream


_FOUND: Torch | None = None


def found() -> Torch | None:
    """The looked-up pieces of ``torch``, or None while nothing has imported it."""
    global _FOUND
    if _FOUND is None:
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "Tensor"):  # absent, or mid-import
            return None
        _FOUND = Torch(torch)
    return _FOUND

