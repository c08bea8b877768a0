"""Every bad argument gets a ValueError/TypeError that names it."""

import numpy as np
import pytest

import numba_cp
from support import to_device

H, T, LOCAL, TOPK = 2, 4, 6, 3


def pack_args(**change):
    args = dict(scores=to_device(np.zeros((H, T, LOCAL), np.float32)),
                seq_lens=to_device(np.full(T, 500, np.int32)), topk=TOPK, rank=0, world=2,
                query_len=1, global_blocks=12, init_blocks=1, local_blocks=1,
                out=to_device(np.zeros((H, T, TOPK), np.int64)))
    args.update(change)
    return args


def merge_args(**change):
    args = dict(keys=to_device(np.zeros((2, H, T, TOPK), np.int64)),
                topk_idx=to_device(np.zeros((H, T, TOPK), np.int32)),
                seq_lens=to_device(np.full(T, 500, np.int32)), query_len=1, init_blocks=1,
                local_blocks=1)
    args.update(change)
    return args


def table_args(heads=H, **change):
    args = dict(attention_block_table=to_device(np.zeros((T, 8), np.int32)),
                sparse_block_table_out=to_device(np.zeros((heads, T, TOPK * 8), np.int32)),
                sparse_context_lens_out=to_device(np.zeros((heads, T), np.int32)))
    args.update(change)
    return args


def test_valid_baselines_run():
    numba_cp.local_topk_keys(**pack_args())
    numba_cp.merge_topk_keys(**merge_args(), **table_args())


PACK_CASES = [
    (dict(scores=np.zeros((H, T, LOCAL), np.float64)), TypeError, "scores"),
    (dict(scores=np.zeros((H, T), np.float32)), ValueError, "scores"),
    (dict(out=np.zeros((H, T, TOPK), np.int32)), TypeError, "out"),
    (dict(out=np.zeros((H, T), np.int64)), ValueError, "out"),
    (dict(out=np.zeros((H + 1, T, TOPK), np.int64)), ValueError, "out"),
    (dict(out=np.zeros((H, T - 1, TOPK), np.int64)), ValueError, "out"),
    (dict(out=np.zeros((H, T, TOPK - 1), np.int64)), ValueError, "out"),
    (dict(rank=2), ValueError, "rank"),
    (dict(rank=-1), ValueError, "rank"),
    (dict(world=0), ValueError, "world"),
    (dict(topk=0), ValueError, "topk"),
    (dict(topk=4096), ValueError, "topk"),
    (dict(topk=2.0), TypeError, "topk"),
    (dict(topk=True), TypeError, "topk"),
    (dict(query_len=0), ValueError, "query_len"),
    (dict(query_len=3), ValueError, "query_len"),  # 4 tokens not a multiple of 3
    (dict(seq_lens=np.zeros(T, np.float32)), TypeError, "seq_lens"),
    (dict(seq_lens=np.zeros(T - 1, np.int32)), ValueError, "seq_lens"),
    (dict(seq_lens=np.zeros((T, 1), np.int32)), ValueError, "seq_lens"),
    (dict(global_blocks=65535), ValueError, "global_blocks"),
    (dict(global_blocks=-1), ValueError, "global_blocks"),
    (dict(global_blocks=13), ValueError, "scores"),  # needs 7 local columns, has 6
    (dict(init_blocks=-1), ValueError, "init_blocks"),
    (dict(local_blocks=-2), ValueError, "local_blocks"),
    (dict(threads=0), ValueError, "threads"),
    (dict(threads=2048), ValueError, "threads"),
    (dict(method="rank", threads=12), ValueError, "threads"),  # not whole warps
    (dict(method="rank", threads=0), ValueError, "threads"),
    (dict(method="rank", sort_limit=0), ValueError, "sort_limit"),
    (dict(method="bitonic"), ValueError, "method"),
    (dict(scores=[[[0.0]]]), TypeError, "scores"),
]


def test_rank_method_names_its_row_limit():
    """A shard row longer than the rank kernels hold is refused up front, not mis-ranked."""
    long = dict(scores=to_device(np.zeros((1, 1, 1025), np.float32)),
                seq_lens=to_device(np.full(1, 1025 * 128, np.int32)), world=1,
                global_blocks=1025, out=to_device(np.zeros((1, 1, TOPK), np.int64)))
    with pytest.raises(ValueError, match="method='rank' handles rows of up to 1024"):
        numba_cp.local_topk_keys(**pack_args(**long, method="rank"))


def test_rank_method_names_its_topk_limit():
    """A topk past what the rank kernels' shared memory holds is refused up front."""
    wide = dict(out=to_device(np.zeros((H, T, 1025), np.int64)), topk=1025)
    with pytest.raises(ValueError, match="method='rank' handles topk <= 1024"):
        numba_cp.local_topk_keys(**pack_args(**wide, method="rank"))


@pytest.mark.parametrize("change,error,name", PACK_CASES)
def test_local_topk_keys_rejects(change, error, name):
    change = {k: to_device(v) if isinstance(v, np.ndarray) else v for k, v in change.items()}
    with pytest.raises(error, match=name):
        numba_cp.local_topk_keys(**pack_args(**change))


MERGE_CASES = [
    (dict(keys=np.zeros((2, H, T, TOPK), np.int32)), TypeError, "keys"),
    (dict(keys=np.zeros((H, T, TOPK), np.int64)), ValueError, "keys"),
    (dict(keys=np.zeros((0, H, T, TOPK), np.int64)), ValueError, "keys"),
    (dict(keys=np.zeros((2, H + 1, T, TOPK), np.int64)), ValueError, "topk_idx"),
    (dict(topk_idx=np.zeros((H, T, TOPK), np.int64)), TypeError, "topk_idx"),
    (dict(topk_idx=np.zeros((H, T + 1, TOPK), np.int32)), ValueError, "topk_idx"),
    (dict(topk_idx=np.zeros((H, T, 0), np.int32)), ValueError, "topk"),
    (dict(seq_lens=np.zeros(2, np.int32)), ValueError, "seq_lens"),
    (dict(seq_lens=np.zeros(T, np.bool_)), TypeError, "seq_lens"),
    (dict(query_len=0), ValueError, "query_len"),
    (dict(init_blocks=-1), ValueError, "init_blocks"),
    (dict(local_blocks=1.5), TypeError, "local_blocks"),
    (dict(block_page_stride=16), ValueError, "block_page_stride"),  # without a table
]


@pytest.mark.parametrize("change,error,name", MERGE_CASES)
def test_merge_topk_keys_rejects(change, error, name):
    change = {k: to_device(v) if isinstance(v, np.ndarray) else v for k, v in change.items()}
    with pytest.raises(error, match=name):
        numba_cp.merge_topk_keys(**merge_args(**change))


TABLE_CASES = [
    (dict(sparse_context_lens_out=None), ValueError, "sparse_context_lens_out"),
    (dict(attention_block_table=None), ValueError, "attention_block_table"),
    (dict(attention_block_table=np.zeros((T, 8), np.int64)), TypeError,
     "attention_block_table"),
    (dict(attention_block_table=np.zeros((T - 1, 8), np.int32)), ValueError,
     "attention_block_table"),
    (dict(sparse_block_table_out=np.zeros((H, T, TOPK * 8 - 1), np.int32)), ValueError,
     "sparse_block_table_out"),
    (dict(sparse_block_table_out=np.zeros((H, T, TOPK * 8), np.float32)), TypeError,
     "sparse_block_table_out"),
    (dict(sparse_block_table_out=np.zeros((T, TOPK * 8), np.int32),
          sparse_context_lens_out=np.zeros(T, np.int32)), ValueError, "2-D layout"),
    (dict(sparse_context_lens_out=np.zeros(T, np.int32)), ValueError,
     "sparse_context_lens_out"),
    (dict(sparse_context_lens_out=np.zeros((H, T + 1), np.int32)), ValueError,
     "sparse_context_lens_out"),
    (dict(block_page_stride=-1), ValueError, "block_page_stride"),
]


@pytest.mark.parametrize("change,error,name", TABLE_CASES)
def test_sparse_table_arguments_rejected(change, error, name):
    change = {k: to_device(v) if isinstance(v, np.ndarray) else v for k, v in change.items()}
    with pytest.raises(error, match=name):
        numba_cp.merge_topk_keys(**merge_args(), **table_args(**change))


def test_reference_2d_layout_accepted_for_one_head():
    one = merge_args(keys=to_device(np.zeros((2, 1, T, TOPK), np.int64)),
                     topk_idx=to_device(np.zeros((1, T, TOPK), np.int32)))
    numba_cp.merge_topk_keys(**one, **table_args(
        sparse_block_table_out=to_device(np.zeros((T, TOPK * 8), np.int32)),
        sparse_context_lens_out=to_device(np.zeros(T, np.int32))))


def test_wrong_kind_of_memory():
    from numba_cp.backend import TARGET

    if TARGET.simulator:
        class FakeDevice:
            __cuda_array_interface__ = {"shape": (H, T, LOCAL), "typestr": "<f4",
                                        "data": (0, False), "version": 3}
        wrong = FakeDevice()
    else:
        wrong = np.zeros((H, T, LOCAL), np.float32)
    with pytest.raises(TypeError, match="scores"):
        numba_cp.local_topk_keys(**pack_args(scores=wrong))


# -- outputs: writable, not aliasing themselves or another argument ----------------------

sim_only = pytest.mark.skipif(not numba_cp.backend.TARGET.simulator,
                              reason="builds read-only and aliasing NumPy views")


@sim_only
def test_read_only_outputs_are_rejected_by_name():
    out = np.zeros((H, T, TOPK), np.int64)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="^out: is read-only"):
        numba_cp.local_topk_keys(**pack_args(out=out))
    idx = np.zeros((H, T, TOPK), np.int32)
    idx.flags.writeable = False
    with pytest.raises(ValueError, match="^topk_idx: is read-only"):
        numba_cp.merge_topk_keys(**merge_args(topk_idx=idx))


@sim_only
def test_zero_stride_outputs_are_rejected_by_name():
    row = np.zeros((1, T, TOPK), np.int64)
    out = np.lib.stride_tricks.as_strided(row, (H, T, TOPK), (0,) + row.strides[1:],
                                          writeable=True)
    with pytest.raises(ValueError, match="^out: has stride 0 on axis 0"):
        numba_cp.local_topk_keys(**pack_args(out=out))


@sim_only
def test_outputs_overlapping_an_argument_are_rejected_by_name():
    table = np.zeros((H, T, TOPK * 8), np.int32)
    with pytest.raises(ValueError, match="^topk_idx: overlaps sparse_block_table_out"):
        numba_cp.merge_topk_keys(**merge_args(topk_idx=table[:, :, :TOPK]),
                                 **table_args(sparse_block_table_out=table))
    idx = np.zeros((H, T, TOPK), np.int32)
    with pytest.raises(ValueError, match="^topk_idx: overlaps seq_lens"):
        numba_cp.merge_topk_keys(**merge_args(topk_idx=idx, seq_lens=idx[0, :, 0]))
    keys = np.zeros((2, H, T, TOPK), np.int64)
    with pytest.raises(ValueError, match="^out: overlaps scores"):
        numba_cp.local_topk_keys(**pack_args(
            scores=keys[0].view(np.float32)[:, :, :LOCAL], out=keys[0]))
    # the same signature with disjoint buffers is accepted: the check is per call
    numba_cp.local_topk_keys(**pack_args(scores=np.zeros((H, T, 2 * TOPK), np.float32)[..., :LOCAL],
                                         out=keys[1]))


def test_block_page_stride_must_fit_int32():
    with pytest.raises(ValueError, match="block_page_stride"):
        numba_cp.merge_topk_keys(**merge_args(), **table_args(), block_page_stride=2**40)


@pytest.mark.parametrize("dtype, values", [
    (np.int64, [2**63 - 1, 2**40 + 5, 300, 0]),
    (np.uint64, [2**64 - 1, 2**63, 129, 5]),
    (np.uint32, [2**32 - 1, 129, 0, 1]),
    (np.int8, [127, -128, 1, 0])])
def test_any_integer_seq_lens_select_as_the_oracle(dtype, values):
    """Context lengths near an integer type's limits select exactly, not as garbage."""
    from numba_cp import reference as ref
    from support import to_host

    world, global_blocks = 2, 20
    full = np.random.default_rng(3).standard_normal((H, T, global_blocks)).astype(np.float32)
    seq_lens = np.array(values, dtype)
    keys = np.zeros((world, H, T, TOPK), np.int64)
    for rank in range(world):
        shard = ref.shard_scores(full, rank=rank, world=world, global_blocks=global_blocks)
        out = to_device(np.zeros((H, T, TOPK), np.int64))
        numba_cp.local_topk_keys(**pack_args(scores=to_device(shard), seq_lens=to_device(seq_lens),
                                             rank=rank, world=world, global_blocks=global_blocks,
                                             out=out))
        keys[rank] = to_host(out)
    idx = to_device(np.zeros((H, T, TOPK), np.int32))
    numba_cp.merge_topk_keys(**merge_args(keys=to_device(keys), topk_idx=idx,
                                          seq_lens=to_device(seq_lens)))
    want = ref.global_topk(full, [int(v) for v in values], topk=TOPK,
                           global_blocks=global_blocks, query_len=1, init_blocks=1,
                           local_blocks=1)
    np.testing.assert_array_equal(to_host(idx), want)


def _delivery_arrays(world=2, heads=2, tokens=4, topk=4, slot=None):
    slot = heads * tokens * topk if slot is None else slot
    start = world + 1
    peers = [to_device(np.zeros(start + 2 * world * slot, np.int64)) for _ in range(world)]
    return dict(ctrl=to_device(np.zeros(8, np.int64)), peers=peers, data_start=start,
                slot=slot)


@pytest.mark.parametrize("change, error, message", [
    (dict(world=9, rank=0), ValueError, "world: delivering packs serve 1 to 8 ranks"),
    (dict(peers_count=1), ValueError, r"peers: one exchange buffer per rank \(2\), got 1"),
    (dict(slot=31), ValueError, "slot"),
    (dict(data_start=2), ValueError, "data_start"),
    (dict(short_peer=True), ValueError, r"peers\[1\]"),
    (dict(ctrl_dtype=np.int32), TypeError, "ctrl"),
    (dict(peer_rank=2), ValueError, "peer_rank"),
    (dict(peer_rank=-1), ValueError, "peer_rank"),
    (dict(peer_rank=True), TypeError, "peer_rank"),
    (dict(peer_rank=0, peers_count=9), ValueError, "peers: delivering packs serve 1 to 8 peers"),
])
def test_delivering_pack_rejects(change, error, message):
    world = change.get("world", 2)
    arrays = _delivery_arrays()
    if "peers_count" in change:
        arrays["peers"] = arrays["peers"][:change["peers_count"]]
    if change.get("short_peer"):
        arrays["peers"][1] = to_device(np.zeros(10, np.int64))
    if change.get("peers_count", 0) > len(arrays["peers"]):
        arrays["peers"] = [arrays["peers"][0]] * change["peers_count"]
    if "peer_rank" in change:
        arrays["peer_rank"] = change["peer_rank"]
    if "ctrl_dtype" in change:
        arrays["ctrl"] = to_device(np.zeros(8, change["ctrl_dtype"]))
    for key in ("slot", "data_start"):
        if key in change:
            arrays[key] = change[key]
    scores = to_device(np.zeros((2, 4, 16), np.float32))
    seq_lens = to_device(np.full(4, 128 * 16, np.int32))
    with pytest.raises(error, match=message):
        numba_cp.ops.local_topk_keys_to_peers(
            scores, seq_lens, topk=4, rank=change.get("rank", 1), world=world, query_len=1,
            global_blocks=16, init_blocks=1, local_blocks=1, **arrays)


@pytest.mark.parametrize("halves, flags, error, message", [
    (3, 3, ValueError, r"keys: \[2 \* world"),
    (4, 2, ValueError, "flags"),
])
def test_delivered_merge_rejects(halves, flags, error, message):
    keys = to_device(np.zeros((halves, 2, 4, 4), np.int64))
    with pytest.raises(error, match=message):
        numba_cp.ops.merge_delivered_keys(
            keys, to_device(np.zeros((2, 4, 4), np.int32)), to_device(np.full(4, 128, np.int32)),
            ctrl=to_device(np.zeros(8, np.int64)), flags=to_device(np.zeros(flags, np.int64)),
            errors=to_device(np.zeros(4, np.int64)), timeout_ns=10**9, query_len=1,
            init_blocks=1, local_blocks=1)


@pytest.mark.parametrize("change, error, message", [
    (dict(halves=3), ValueError, r"keys: \[2 \* world"),
    (dict(flags=2), ValueError, "flags"),
    (dict(topk=0), ValueError, "topk"),
    (dict(out_topk=3), ValueError, "out"),
    (dict(out_dtype=np.int32), TypeError, "out"),
    (dict(block_wait=1), TypeError, "block_wait"),
    (dict(timeout_ns=0), ValueError, "timeout_ns"),
])
def test_delivered_merge_to_keys_rejects(change, error, message):
    keys = to_device(np.zeros((change.get("halves", 4), 2, 4, 4), np.int64))
    out = to_device(np.zeros((2, 4, change.get("out_topk", 4)), change.get("out_dtype", np.int64)))
    with pytest.raises(error, match=message):
        numba_cp.ops.merge_delivered_to_keys(
            keys, to_device(np.full(4, 128, np.int32)), topk=change.get("topk", 4),
            ctrl=to_device(np.zeros(8, np.int64)),
            flags=to_device(np.zeros(change.get("flags", 3), np.int64)),
            errors=to_device(np.zeros(4, np.int64)), timeout_ns=change.get("timeout_ns", 10**9),
            block_wait=change.get("block_wait", True), query_len=1, init_blocks=1,
            local_blocks=1, out=out)
