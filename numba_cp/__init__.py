"""numba_cp: the context-parallel candidate exchange of a sparse-attention indexer.

Each of ``world`` ranks scores a round-robin shard of the KV blocks, keeps a
per-head top-k of packed int64 keys (:func:`local_topk_keys`), all-gathers
them, and merges them into the exact global top-k (:func:`merge_topk_keys`),
optionally writing the paged sparse block table. ``docs/SPEC.md`` is the
contract; :mod:`numba_cp.reference` is its NumPy oracle.

Importing this package selects the kernel target (see :mod:`numba_cp.backend`).
"""

# The one place the version is written: pyproject.toml reads it from here.
__version__ = "0.1.0"

from . import backend, reference
from .constants import PAGES, SPARSE_BLOCK
from .errors import RankAgreementError
from .ops import METHODS, local_topk_keys, merge_topk_keys

__all__ = ["local_topk_keys", "merge_topk_keys", "METHODS", "CandidateExchange", "ExchangeConfig",
           "RankAgreementError", "reference", "backend", "PAGES", "SPARSE_BLOCK"]


def __getattr__(name):
    # The exchange needs mpi4py; importing the kernels alone must not.
    if name in ("CandidateExchange", "ExchangeConfig"):
        from . import exchange

        return getattr(exchange, name)
    raise AttributeError(f"module 'numba_cp' has no attribute {name!r}")
