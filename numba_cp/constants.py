"""Numbers fixed by the contract (docs/SPEC.md); everything else derives from them."""

import numpy as np

SPARSE_BLOCK = 128  # tokens per KV block
PAGE_TOKENS = 16  # tokens per attention page
PAGES = SPARSE_BLOCK // PAGE_TOKENS  # pages per block (8)

INIT_SCORE = np.float32(1e30)  # pinned score of an init (sink) block
LOCAL_SCORE = np.float32(1e29)  # pinned score of a local block; overrides INIT_SCORE

MAX_GLOBAL_BLOCKS = 65535  # global_blocks must be below this: g + 1 fits in 16 bits
KEY_VALID_BIT = 1 << 48

# The largest topk the kernels are built and tested for.
MAX_TOPK = 2048

# Page ids are int32: a block's first page, its table entry times the stride, must fit.
MAX_PAGE_STRIDE = (1 << 31) - 1
# init_blocks and local_blocks: any value past the largest global_blocks means "all".
MAX_PINNED = (1 << 31) - 1
