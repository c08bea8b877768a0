"""NumPy oracle for the exchange, written from SPEC.md alone (clear over fast).

Nothing here imports the kernels: tests compare the kernels against these
functions, and the launch drivers check a distributed run against
:func:`global_topk`. Every function returns fresh arrays.

Shapes follow SPEC.md: ``scores [heads, tokens, local]``, keys
``[heads, tokens, topk]``, gathered keys ``[world, heads, tokens, per_shard]``,
``topk_idx [heads, tokens, topk]``.
"""

from __future__ import annotations

import numpy as np

from .constants import INIT_SCORE, KEY_VALID_BIT, LOCAL_SCORE, PAGES, SPARSE_BLOCK

__all__ = [
    "row_window",
    "pack_keys",
    "unpack_keys",
    "local_topk_keys",
    "merge_topk_keys",
    "sparse_block_table",
    "global_topk",
    "shard_scores",
    "fake_cp_exchange",
]


def row_window(seq_len: int, t: int, *, query_len: int, local_blocks: int):
    """``(causal_len, valid_blocks, local_start)`` of query ``t`` of a request."""
    causal_len = int(seq_len) - query_len + t + 1
    valid_blocks = max(0, -(-causal_len // SPARSE_BLOCK))  # ceil division
    local_start = max(0, valid_blocks - local_blocks)
    return causal_len, valid_blocks, local_start


def _pin(scores: np.ndarray, blocks: np.ndarray, init_blocks: int, local_start: int):
    pinned = np.where(blocks < init_blocks, INIT_SCORE, scores.astype(np.float32))
    return np.where(blocks >= local_start, LOCAL_SCORE, pinned).astype(np.float32)


def _ordered_from_bits(bits: np.ndarray) -> np.ndarray:
    bits = bits.astype(np.int64) & 0xFFFFFFFF
    bits = np.where(bits == 0x80000000, 0, bits)
    ordered = np.where(bits & 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    return np.where((bits & 0x7FFFFFFF) > 0x7F800000, 0, ordered)


def pack_keys(scores, blocks) -> np.ndarray:
    """int64 keys of float32 ``scores`` (already pinned) for block ids ``blocks``."""
    bits = np.asarray(scores, dtype=np.float32).view(np.uint32)
    ordered = _ordered_from_bits(bits)
    return KEY_VALID_BIT | (ordered << 16) | (np.asarray(blocks, dtype=np.int64) + 1)


def unpack_keys(keys):
    """``(blocks, scores)`` of int64 keys; the bit layout is SPEC.md's wire format."""
    keys = np.asarray(keys, dtype=np.int64)
    blocks = (keys & 0xFFFF) - 1
    ordered = (keys >> 16) & 0xFFFFFFFF
    bits = np.where(ordered & 0x80000000, ordered ^ 0x80000000, ordered ^ 0xFFFFFFFF)
    return blocks, bits.astype(np.uint32).view(np.float32)


def _top(keys: np.ndarray, topk: int) -> np.ndarray:
    """The ``topk`` largest keys, descending, padded with 0."""
    out = np.zeros(topk, dtype=np.int64)
    best = np.sort(keys)[::-1][:topk]
    out[: best.size] = best
    return out


def _rows(tokens: int, query_len: int):
    for row in range(tokens):
        yield row, row // query_len, row % query_len


def local_topk_keys(scores, seq_lens, *, topk, rank, world, query_len, global_blocks,
                    init_blocks, local_blocks) -> np.ndarray:
    """Per-head top-k keys of one rank's shard: int64 ``[heads, tokens, topk]``."""
    scores = np.asarray(scores, dtype=np.float32)
    heads, tokens, local = scores.shape
    out = np.zeros((heads, tokens, topk), dtype=np.int64)
    columns = np.arange(local)
    blocks = columns * world + rank
    for row, request, t in _rows(tokens, query_len):
        _, valid_blocks, local_start = row_window(
            seq_lens[request], t, query_len=query_len, local_blocks=local_blocks)
        valid = (blocks < valid_blocks) & (blocks < global_blocks)
        for h in range(heads):
            pinned = _pin(scores[h, row, valid], blocks[valid], init_blocks, local_start)
            out[h, row] = _top(pack_keys(pinned, blocks[valid]), topk)
    return out


def _merge_row(candidates, topk, init_blocks, local_start):
    candidates = candidates[candidates != 0]
    blocks, scores = unpack_keys(candidates)
    repacked = pack_keys(_pin(scores, blocks, init_blocks, local_start), blocks)
    return _top(repacked, topk)


def merge_keys(keys, seq_lens, *, topk, query_len, init_blocks, local_blocks):
    """Merge gathered keys ``[world, heads, tokens, per_shard]`` into keys again:
    int64 ``[heads, tokens, topk]``, each row's ``topk`` largest keys pinned with
    its window, in descending order, padded with 0 (SPEC.md, two-level exchange)."""
    keys = np.asarray(keys, dtype=np.int64)
    _, heads, tokens, _ = keys.shape
    out = np.zeros((heads, tokens, topk), dtype=np.int64)
    for row, request, t in _rows(tokens, query_len):
        _, _, local_start = row_window(seq_lens[request], t, query_len=query_len,
                                       local_blocks=local_blocks)
        for h in range(heads):
            out[h, row] = _merge_row(keys[:, h, row, :].ravel(), topk, init_blocks, local_start)
    return out


def merge_topk_keys(keys, seq_lens, *, topk, query_len, init_blocks, local_blocks,
                    attention_block_table=None, block_page_stride=None):
    """Merge gathered keys ``[world, heads, tokens, per_shard]`` into ``topk_idx``.

    Returns int32 ``topk_idx [heads, tokens, topk]``; with ``attention_block_table``
    also the per-head sparse table ``[heads, tokens, topk * 8]`` and context
    lengths ``[heads, tokens]``: ``(topk_idx, sbt, ctx)``.
    """
    keys = np.asarray(keys, dtype=np.int64)
    _, heads, tokens, _ = keys.shape
    topk_idx = np.full((heads, tokens, topk), -1, dtype=np.int32)
    for row, request, t in _rows(tokens, query_len):
        _, valid_blocks, local_start = row_window(
            seq_lens[request], t, query_len=query_len, local_blocks=local_blocks)
        for h in range(heads):
            merged = _merge_row(keys[:, h, row, :].ravel(), topk, init_blocks, local_start)
            use = (np.arange(topk) < min(topk, valid_blocks)) & (merged != 0)
            topk_idx[h, row] = np.where(use, (merged & 0xFFFF) - 1, -1)
    if attention_block_table is None:
        return topk_idx
    sbt, ctx = sparse_block_table(topk_idx, seq_lens, attention_block_table,
                                  query_len=query_len, block_page_stride=block_page_stride)
    return topk_idx, sbt, ctx


def sparse_block_table(topk_idx, seq_lens, attention_block_table, *, query_len,
                       block_page_stride=None):
    """Paged sparse block table of SPEC.md, per head: ``(sbt, ctx)``.

    ``sbt`` is int32 ``[heads, tokens, topk * PAGES]``, ``ctx`` int32
    ``[heads, tokens]``. A selected block at or past the table's width has no
    page to read and counts as not selected.
    """
    topk_idx = np.asarray(topk_idx)
    table = np.asarray(attention_block_table)
    heads, tokens, topk = topk_idx.shape
    stride = block_page_stride or PAGES
    sbt = np.zeros((heads, tokens, topk * PAGES), dtype=np.int32)
    ctx = np.zeros((heads, tokens), dtype=np.int32)
    for row, request, t in _rows(tokens, query_len):
        causal_len, _, _ = row_window(seq_lens[request], t, query_len=query_len, local_blocks=0)
        abs_pos = causal_len - 1
        ctx_len = max(abs_pos + 1, 0)
        self_blk = abs_pos // SPARSE_BLOCK
        for h in range(heads):
            used = [int(b) for b in topk_idx[h, row]
                    if ctx_len > 0 and 0 <= b <= self_blk and b < table.shape[1]]
            full = [b for b in used if b < self_blk]
            has_tail = len(full) < len(used)
            slots = full + ([self_blk] if has_tail else [])
            for s, b in enumerate(slots):
                sbt[h, row, s * PAGES:(s + 1) * PAGES] = (
                    int(table[request, b]) * stride + np.arange(PAGES))
            if has_tail:
                ctx[h, row] = len(full) * SPARSE_BLOCK + (ctx_len - self_blk * SPARSE_BLOCK)
            else:
                ctx[h, row] = min(len(slots) * SPARSE_BLOCK, ctx_len)
    return sbt, ctx


def global_topk(full_scores, seq_lens, *, topk, query_len, global_blocks, init_blocks,
                local_blocks) -> np.ndarray:
    """Top-k block ids of the unsharded forced rows: int32 ``[heads, tokens, topk]``.

    ``full_scores`` is float32 ``[heads, tokens, >= global_blocks]`` indexed by
    global block id. This is what any CP exchange must reproduce.
    """
    full_scores = np.asarray(full_scores, dtype=np.float32)
    heads, tokens, _ = full_scores.shape
    blocks = np.arange(global_blocks)
    topk_idx = np.full((heads, tokens, topk), -1, dtype=np.int32)
    for row, request, t in _rows(tokens, query_len):
        _, valid_blocks, local_start = row_window(
            seq_lens[request], t, query_len=query_len, local_blocks=local_blocks)
        valid = blocks < valid_blocks
        for h in range(heads):
            pinned = _pin(full_scores[h, row, :global_blocks][valid], blocks[valid],
                          init_blocks, local_start)
            best = _top(pack_keys(pinned, blocks[valid]), topk)
            use = (np.arange(topk) < min(topk, valid_blocks)) & (best != 0)
            topk_idx[h, row] = np.where(use, (best & 0xFFFF) - 1, -1)
    return topk_idx


def shard_scores(full_scores, *, rank, world, global_blocks, local=None, fill=np.nan):
    """Rank ``rank``'s round-robin shard ``[heads, tokens, local]`` of full-context scores.

    Column ``j`` holds global block ``j * world + rank``; columns past
    ``global_blocks`` hold ``fill`` (they never change a correct kernel's result).
    """
    full_scores = np.asarray(full_scores, dtype=np.float32)
    heads, tokens, _ = full_scores.shape
    if local is None:
        local = -(-global_blocks // world)
    shard = np.full((heads, tokens, local), fill, dtype=np.float32)
    blocks = np.arange(local) * world + rank
    present = blocks < global_blocks
    shard[:, :, present] = full_scores[:, :, blocks[present]]
    return shard


def fake_cp_exchange(full_scores, seq_lens, *, world, topk, query_len, global_blocks,
                     init_blocks, local_blocks, per_shard=None, attention_block_table=None,
                     block_page_stride=None):
    """Single-process CP exchange: shard over ``world`` ranks, pack, stack, merge.

    Returns what the distributed exchange must return on every rank (see
    :func:`merge_topk_keys`). ``per_shard`` (default ``topk``) is each rank's
    key count.
    """
    per_shard = topk if per_shard is None else per_shard
    gathered = np.stack([
        local_topk_keys(
            shard_scores(full_scores, rank=r, world=world, global_blocks=global_blocks),
            seq_lens, topk=per_shard, rank=r, world=world, query_len=query_len,
            global_blocks=global_blocks, init_blocks=init_blocks, local_blocks=local_blocks)
        for r in range(world)
    ])
    return merge_topk_keys(gathered, seq_lens, topk=topk, query_len=query_len,
                           init_blocks=init_blocks, local_blocks=local_blocks,
                           attention_block_table=attention_block_table,
                           block_page_stride=block_page_stride)
