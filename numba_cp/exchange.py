"""The CP candidate exchange as one persistent plan per communicator.

    plan = CandidateExchange(comm, ExchangeConfig(heads=4, max_tokens=64, topk=16, ...))
    topk_idx = plan(scores, seq_lens)            # pack -> all-gather -> merge
    ...
    plan.close()

The plan owns every buffer the exchange touches (shard keys, gathered keys,
``topk_idx``, the optional sparse block table) and its transport, all set up
once; a call allocates nothing. Every rank packs every head; each rank merges
either all heads or the contiguous slice it owns (as a tensor-parallel model
shards index heads; replicated when ``heads < world``).

Construction is collective: one small ``allgather`` checks that every rank
passed the same configuration and raises the same
:class:`~numba_cp.errors.RankAgreementError` on every rank (naming the
differing field) instead of hanging in, or merging garbage from, a mismatched
all-gather; then the transport is set up once, for ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import validate
from .arrays import device_copy, resolve_stream
from .backend import TARGET
from .comm import (LeaderAllGather, agree, barrier, checked_request, choose_transport,
                   describe_problem,
                   takes_device_arrays)
from .errors import IPCTimeoutError
from .launcher import call_signature
from .constants import MAX_GLOBAL_BLOCKS, MAX_PAGE_STRIDE, MAX_PINNED, MAX_TOPK, PAGES
from .kernels.ipc import PEER_SLOTS
from .nodes import node_layout, sizes_from_env
from .ops import (check_local_topk_keys, check_merge_topk_keys, choose_method,
                  global_topk_ids, merge_keys,
                  local_topk_keys, local_topk_keys_to_peers, merge_delivered_keys,
                  merge_delivered_to_keys, merge_topk_keys)

__all__ = ["ExchangeConfig", "CandidateExchange", "CapturedExchange", "owned_heads",
           "record_graph"]


def _integer(name, value, low, high=None):
    validate.integer(f"ExchangeConfig.{name}", value, low=low, high=high)


@dataclass(frozen=True)
class ExchangeConfig:
    """What every rank of the CP group must agree on; checked when it is made.

    A field of the wrong type (``True`` and ``1.0`` are not integers) or out
    of range raises ``TypeError`` or ``ValueError`` naming it.
    """

    heads: int
    max_tokens: int
    topk: int
    world: int
    global_blocks: int
    init_blocks: int = 1
    local_blocks: int = 2
    query_len: int = 1
    per_shard: int | None = None  # keys each rank contributes; default topk (exact)
    sparse_table: bool = False  # also emit the paged sparse block table
    block_page_stride: int | None = None
    merge: str = "all"  # "all" heads on every rank, or "owned": this rank's slice
    # "flat": one all-gather over every rank; "node": gather and merge inside each node,
    # then gather the nodes' keys (SPEC.md, "The two-level exchange")
    hierarchy: str = "flat"

    def __post_init__(self):
        for name in ("heads", "max_tokens", "world", "query_len"):
            _integer(name, getattr(self, name), 1)
        _integer("topk", self.topk, 1, MAX_TOPK + 1)
        _integer("global_blocks", self.global_blocks, 0, MAX_GLOBAL_BLOCKS)
        _integer("init_blocks", self.init_blocks, 0, MAX_PINNED + 1)
        _integer("local_blocks", self.local_blocks, 0, MAX_PINNED + 1)
        if self.per_shard is not None:
            _integer("per_shard", self.per_shard, 1, MAX_TOPK + 1)
        if self.block_page_stride is not None:
            _integer("block_page_stride", self.block_page_stride, 0, MAX_PAGE_STRIDE + 1)
        if not isinstance(self.sparse_table, (bool, np.bool_)):
            raise TypeError(f"ExchangeConfig.sparse_table must be a bool, got "
                            f"{type(self.sparse_table).__name__} {self.sparse_table!r}")
        if self.merge not in ("all", "owned"):
            raise ValueError(f"ExchangeConfig.merge must be 'all' or 'owned', "
                             f"got {self.merge!r}")
        if self.hierarchy not in ("flat", "node"):
            raise ValueError(f"ExchangeConfig.hierarchy must be 'flat' or 'node', "
                             f"got {self.hierarchy!r}")
        if self.max_tokens % self.query_len:
            raise ValueError(f"ExchangeConfig.max_tokens ({self.max_tokens}) must be a "
                             f"multiple of query_len ({self.query_len})")

    @property
    def shard_keys(self) -> int:
        return self.topk if self.per_shard is None else self.per_shard


def owned_heads(heads: int, world: int, rank: int) -> range:
    """The contiguous heads ``rank`` merges when heads are sharded over ranks.

    ``heads >= world``: an even split (the first ``heads % world`` ranks take
    one more); ``heads < world``: each head is replicated on ``world // heads``
    (or one more) consecutive ranks, and a rank merges its one head.
    """
    if heads >= world:
        base, extra = divmod(heads, world)
        start = rank * base + min(rank, extra)
        return range(start, start + base + (rank < extra))
    head = rank * heads // world
    return range(head, head + 1)


class CandidateExchange:
    """pack -> all-gather -> merge (-> sparse block table) with persistent buffers.

    Args:
        comm: an mpi4py communicator of exactly ``config.world`` ranks.
        config: the :class:`ExchangeConfig`, identical on every rank.
        transport: a transport name to force (see :mod:`numba_cp.comm`);
            default: the best one for this machine.
        fused: with a transport that lets the kernels gather (``ipc``, up to
            8 ranks), the pack writes its keys straight into every rank's
            exchange buffer and the merge reads them there: two kernels per
            exchange. With ``hierarchy="node"`` the node level is what fuses
            (an IPC transport inside the node, up to 8 ranks per node): pack and
            a merge to the node's keys, then the nodes' gather and the merge.
            ``None`` (default): fused where possible; ``False``: pack, gather
            and merge as separate steps; ``True``: fused or an error.
        method, threads, sort_limit: kernel choice and launch tuning, passed
            through to :func:`~numba_cp.local_topk_keys` and the merge.

    Every step of a call runs on one stream: the ``stream`` given, else
    PyTorch's current stream when ``scores`` is a PyTorch tensor (``seq_lens``
    for :meth:`all_gather` and :meth:`merge`), else CuPy's current stream
    (:func:`numba_cp.arrays.default_stream_for`). The plan's own buffers never
    choose it, so a PyTorch caller's pack, gather and merge stay on PyTorch's
    stream; calling the steps one by one, give :meth:`all_gather` ``seq_lens``
    or the stream.
    """

    def __init__(self, comm, config: ExchangeConfig, *, transport=None, fused=None,
                 method="auto", threads=None, sort_limit=None):
        # Local checks first, inside a guard: their outcome goes through the one
        # agreement collective, so a rank that fails makes every rank raise.
        problem, values = None, None
        try:
            if not isinstance(config, ExchangeConfig):
                raise TypeError(f"config must be an ExchangeConfig, got {type(config).__name__}")
            if comm.Get_size() != config.world:
                raise ValueError(f"config.world is {config.world} but the communicator has "
                                 f"{comm.Get_size()} ranks")
            choose_method(method, config.topk)
            if fused is not None and not isinstance(fused, (bool, np.bool_)):
                raise TypeError(f"fused must be None, True or False, got {fused!r}")
            # Under the simulator, a device transport (forced, to exercise it on a CPU)
            # is handed the simulator's device arrays.
            device = not TARGET.simulator or bool(takes_device_arrays(transport))
            values = dataclasses.asdict(config)  # its fields' types are checked: 1.0 is no 1
            values.update(transport=checked_request(transport, device), fused=fused,
                          method=method, threads=threads, sort_limit=sort_limit)
            if config.hierarchy == "node":  # NUMBA_CP_NODES must say the same everywhere
                values.update(nodes=sizes_from_env(config.world))
        except Exception as exc:
            problem = describe_problem(exc)
        agree(comm, "CandidateExchange", problem=problem, values=values)
        # Agreements after this one travel on a communicator of their own: a rank
        # that asks while its peers already move data can then only time out,
        # never have its question matched with their all-gather.
        self._control = comm.Dup()
        self.comm = comm
        self.config = config
        self.rank = comm.Get_rank()
        self.launch = dict(method=method, threads=threads, sort_limit=sort_limit)
        c = config
        self.heads = (range(c.heads) if c.merge == "all"
                      else owned_heads(c.heads, c.world, self.rank))
        per_shard, merged = c.shard_keys, len(self.heads)
        self._device_payload = device
        self._levels = None
        if c.hierarchy == "node":
            # The transport serves the ranks of this node; the nodes' keys then cross
            # over MPI.
            self._levels = _NodeLevels(self, values["nodes"], transport)
            self.transport = self._levels.transport
        else:
            self.transport = choose_transport(comm, device=device, force=transport)
        # The same on every rank: the transport was chosen collectively.
        self.fused, why_not = self._fusion(fused)
        if fused and not self.fused:
            if self._levels is not None:
                self._levels.close()
            self._control.Free()
            raise ValueError(f"fused=True, but {why_not}")
        if c.world > 1 and self._levels is None:  # sized for max_tokens, serves every count
            self.transport.setup((c.heads, c.max_tokens, per_shard), np.int64)
        # The flat exchange's delivery; a fused node level keeps its own.
        self._delivery = None
        if self.fused and self._levels is None:
            self._delivery = self.transport.delivery()
        elif self.fused:
            self._levels.fuse()
        # Flat storage: the first `tokens` rows of every buffer form one contiguous
        # [heads, tokens, ...] block, so calls with fewer tokens keep SPEC's layout.
        place = self._place
        # recv: every rank's keys, or with two levels every node's [nodes, heads, tokens, topk]
        gathered = (c.world * per_shard if self._levels is None else
                    self._levels.layout.nodes * c.topk)
        self._recv = place(np.zeros(gathered * c.heads * c.max_tokens, np.int64))
        # With one rank the shard's keys are the gathered keys: pack writes straight
        # into recv[0] and nothing moves.
        self._send = (self._recv if c.world == 1 and self._levels is None else
                      place(np.zeros(c.heads * c.max_tokens * per_shard, np.int64)))
        self._topk_idx = place(np.full(merged * c.max_tokens * c.topk, -1, np.int32))
        self._sbt = self._ctx = None
        if c.sparse_table:
            self._sbt = place(np.zeros(merged * c.max_tokens * c.topk * PAGES, np.int32))
            self._ctx = place(np.zeros(merged * c.max_tokens, np.int32))
        self._views = {}
        self._captured = []  # invalidated on close: their graphs use the plan's buffers
        self._agreed = set()  # call signatures every rank has checked together
        self._failure = None  # why the plan refuses calls, once a gather gave up

    def _fusion(self, requested):
        """``(fused, why not)`` for this plan's transport and world."""
        c, t = self.config, self.transport
        if requested is False:
            return False, "fused=False"
        if self._levels is not None:
            fusible, why_not = self._levels.fusion()
            if requested:
                # Nodes may differ (each chose its transport): every rank learns whether
                # any cannot fuse, so that fused=True raises everywhere or nowhere.
                refusals = [why for ok, why in agree(self._control, "CandidateExchange fused",
                                                     payload=(fusible, why_not)) if not ok]
                if refusals:
                    return False, refusals[0]
            return fusible, why_not
        if c.world == 1:
            return False, "world 1 needs no gather"
        if not t.delivers:
            return False, f"the {t.name} transport cannot be fused into the kernels"
        if c.world > PEER_SLOTS:
            return False, f"the fused exchange serves up to {PEER_SLOTS} ranks, not {c.world}"
        return True, ""

    def _place(self, host):
        return device_copy(host, simulated_device=self._device_payload)

    # -- per-call views -------------------------------------------------------

    def _views_for(self, tokens: int):
        views = self._views.get(tokens)
        if views is None:
            c, per_shard, merged = self.config, self.config.shard_keys, len(self.heads)
            if not 0 <= tokens <= c.max_tokens or tokens % c.query_len:
                raise ValueError(f"tokens (scores.shape[1]) must be a multiple of query_len "
                                 f"({c.query_len}) in [0, {c.max_tokens}], got {tokens}")
            send = self._send[:c.heads * tokens * per_shard].reshape(c.heads, tokens, per_shard)
            ranks, keys = c.world, per_shard
            if self._levels is not None:  # the nodes' merged keys
                ranks, keys = self._levels.layout.nodes, c.topk
            recv = self._recv[:ranks * c.heads * tokens * keys].reshape(
                ranks, c.heads, tokens, keys)
            idx = self._topk_idx[:merged * tokens * c.topk].reshape(merged, tokens, c.topk)
            sbt = ctx = None
            if c.sparse_table:
                sbt = self._sbt[:merged * tokens * c.topk * PAGES].reshape(
                    merged, tokens, c.topk * PAGES)
                ctx = self._ctx[:merged * tokens].reshape(merged, tokens)
            owned = slice(self.heads.start, self.heads.stop)
            delivered = None
            if self._delivery is not None:  # the flat fused exchange
                delivered = self._delivery.keys_view((c.heads, tokens, per_shard), owned)
            views = self._views[tokens] = _Views(send, recv, recv[:, owned], idx, sbt, ctx,
                                                 delivered)
        return views

    # -- stages -----------------------------------------------------------------

    def _pack_arguments(self, scores, seq_lens, tokens):
        c = self.config
        return (scores, seq_lens), dict(
            topk=c.shard_keys, rank=self.rank, world=c.world, query_len=c.query_len,
            global_blocks=c.global_blocks, init_blocks=c.init_blocks,
            local_blocks=c.local_blocks, out=self._views_for(tokens).send, **self.launch)

    def _merge_arguments(self, seq_lens, tokens, attention_block_table, keys=None):
        c = self.config
        views = self._views_for(tokens)
        keys = views.keys if keys is None else keys
        idx, sbt, ctx = views.idx, views.sbt, views.ctx
        if c.sparse_table and attention_block_table is None:
            raise ValueError("attention_block_table is required: the plan was built with "
                             "sparse_table=True")
        if not c.sparse_table and attention_block_table is not None:
            raise ValueError("attention_block_table given, but the plan was built with "
                             "sparse_table=False")
        tables = {}
        if c.sparse_table:
            tables = dict(attention_block_table=attention_block_table,
                          sparse_block_table_out=sbt, sparse_context_lens_out=ctx,
                          block_page_stride=c.block_page_stride)
        return (keys, idx, seq_lens), dict(query_len=c.query_len, init_blocks=c.init_blocks,
                                           local_blocks=c.local_blocks, **tables, **self.launch)

    @staticmethod
    def _tokens_of(scores):
        shape = getattr(scores, "shape", None)
        if shape is None or len(shape) != 3:
            raise ValueError(f"scores must be 3-D [heads, tokens, local], got shape {shape}")
        return int(shape[1])

    def pack(self, scores, seq_lens, *, stream=None):
        """This rank's shard ``[heads, tokens, local]`` -> its keys (the send buffer)."""
        self._refuse_if_failed()
        return self._pack(scores, seq_lens, resolve_stream(stream, scores))

    def _pack(self, scores, seq_lens, stream):
        args, kwargs = self._pack_arguments(scores, seq_lens, self._tokens_of(scores))
        return local_topk_keys(*args, stream=stream, **kwargs)

    def all_gather(self, tokens: int, *, seq_lens=None, stream=None):
        """Every rank's keys -> the gathered buffer ``[world, heads, tokens, per_shard]``;
        with ``hierarchy="node"`` every node's merged keys, ``[nodes, heads, tokens,
        topk]`` (that needs ``seq_lens``: the node's merge pins with the rows' windows).

        Collective: every rank must call it with the same ``tokens`` (the first
        call with each ``tokens`` checks that on every rank).
        """
        self._refuse_if_failed()
        return self._all_gather(tokens, resolve_stream(stream, seq_lens), seq_lens)

    def _all_gather(self, tokens, stream, seq_lens=None):
        views = self._views_for(tokens)
        send, recv = views.send, views.recv
        if self.config.world == 1 and self._levels is None:
            return recv  # send is recv[0]
        if ("tokens", tokens) not in self._agreed:
            agree(self._control, "CandidateExchange.all_gather", values={"tokens": tokens})
            self._agreed.add(("tokens", tokens))
        if self._levels is not None:
            if seq_lens is None:
                raise ValueError("seq_lens is required: a two-level gather merges inside "
                                 "each node (all_gather(tokens, seq_lens=...))")
            return self._levels.all_gather(send, recv, seq_lens, stream)
        return self.transport.all_gather(send, recv, stream=stream)

    def merge(self, seq_lens, tokens: int, *, attention_block_table=None, stream=None):
        """Gathered keys -> ``topk_idx`` of this rank's heads (and the sparse table)."""
        self._refuse_if_failed()
        return self._merge(seq_lens, tokens, attention_block_table,
                           resolve_stream(stream, seq_lens))

    def _merge(self, seq_lens, tokens, attention_block_table, stream):
        args, kwargs = self._merge_arguments(seq_lens, tokens, attention_block_table)
        merge_topk_keys(*args, stream=stream, **kwargs)
        return self._outputs(tokens)

    def _outputs(self, tokens):
        views = self._views_for(tokens)
        return (views.idx, views.sbt, views.ctx) if self.config.sparse_table else views.idx

    @property
    def _whole_rows(self) -> bool:
        """World 1, flat: the shard is the whole row, and one kernel does the exchange."""
        return self.config.world == 1 and self._levels is None

    def _exchange_whole_rows(self, scores, seq_lens, attention_block_table, stream):
        """World 1: the scores' top-k ids (and table) in one kernel, no keys in memory."""
        c = self.config
        tokens = self._tokens_of(scores)
        (_, idx, _), kwargs = self._merge_arguments(seq_lens, tokens, attention_block_table)
        global_topk_ids(scores, seq_lens, idx, global_blocks=c.global_blocks, stream=stream,
                        **kwargs)
        return self._outputs(tokens)

    def _exchange_delivered(self, scores, seq_lens, attention_block_table, stream):
        """The fused exchange: the pack delivers into every rank, the merge reads in place."""
        d = self._delivery
        tokens = self._tokens_of(scores)
        args, kwargs = self._pack_arguments(scores, seq_lens, tokens)
        del kwargs["out"]
        local_topk_keys_to_peers(*args, ctrl=d.ctrl, peers=d.peers, data_start=d.data_start,
                                 slot=d.slot, stream=stream, **kwargs)
        args, kwargs = self._merge_arguments(seq_lens, tokens, attention_block_table,
                                             keys=self._views_for(tokens).delivered)
        if not d.wait_in_merge:
            d.wait(stream)
        merge_delivered_keys(*args, ctrl=d.ctrl, flags=d.flags, errors=d.errors,
                             timeout_ns=d.timeout_ns, block_wait=d.wait_in_merge,
                             stream=stream, **kwargs)
        return self._outputs(tokens)

    def _exchange_node_delivered(self, scores, seq_lens, attention_block_table, stream):
        """Two levels, the node's in two kernels: the pack delivers into every rank of the
        node, a merge keeps the node's keys in place; then the nodes' gather and merge."""
        tokens = self._tokens_of(scores)
        args, kwargs = self._pack_arguments(scores, seq_lens, tokens)
        del kwargs["out"]
        self._levels.exchange_delivered(args, kwargs, self._views_for(tokens).recv, seq_lens,
                                        stream)
        return self._merge(seq_lens, tokens, attention_block_table, stream)

    def __call__(self, scores, seq_lens, *, attention_block_table=None, stream=None):
        """The whole exchange. Returns ``topk_idx`` ``[merged heads, tokens, topk]``,
        or ``(topk_idx, sparse_block_table, context_lens)`` with ``sparse_table``.

        Collective. The first call with each argument signature (dtypes,
        shapes, strides) validates every argument on every rank and agrees on
        the outcome before anything moves, so a bad argument on one rank raises
        :class:`~numba_cp.errors.RankAgreementError` on all of them; repeated
        signatures add no collective.
        """
        self._refuse_if_failed()
        key, _ = call_signature((scores, seq_lens, attention_block_table), ())
        if key is None or key not in self._agreed:
            self._agree_on_call(scores, seq_lens, attention_block_table)
            if key is not None:
                self._agreed.add(key)
        # Once for every step: left to each, the steps on the plan's own buffers
        # would pick CuPy's stream while a PyTorch caller's pack took PyTorch's.
        stream = resolve_stream(stream, scores)
        if self._delivery is not None:
            return self._exchange_delivered(scores, seq_lens, attention_block_table, stream)
        if self._whole_rows:
            return self._exchange_whole_rows(scores, seq_lens, attention_block_table, stream)
        if self.fused:  # the two-level exchange, its node level fused
            return self._exchange_node_delivered(scores, seq_lens, attention_block_table,
                                                 stream)
        self._pack(scores, seq_lens, stream)
        tokens = scores.shape[1]
        self._all_gather(tokens, stream, seq_lens)
        return self._merge(seq_lens, tokens, attention_block_table, stream)

    def _agree_on_call(self, scores, seq_lens, attention_block_table):
        problem = tokens = None
        try:
            tokens = self._tokens_of(scores)
            args, kwargs = self._pack_arguments(scores, seq_lens, tokens)
            check_local_topk_keys(*args, **kwargs)
            args, kwargs = self._merge_arguments(seq_lens, tokens, attention_block_table)
            check_merge_topk_keys(*args, **kwargs)
        except Exception as exc:
            problem = describe_problem(exc)
        agree(self._control, "CandidateExchange call", problem=problem,
              values={"tokens": tokens})
        self._agreed.add(("tokens", tokens))

    def _refuse_if_failed(self):
        """Raise if a gather gave up: on this call and every later one (cheap: no sync)."""
        if self._failure is None:
            failure = getattr(self.transport, "failure", None)
            self._failure = failure() if failure is not None else None
        if self._failure is not None:
            raise IPCTimeoutError(f"{self._failure}; this plan refuses calls from now on: "
                                  "close it and build a new one")

    # -- life cycle ---------------------------------------------------------------

    def check(self):
        """Raise if a device-side gather gave up (the IPC transport's timeout).

        Synchronises with the device: call it outside the hot path, e.g.
        before trusting results.
        """
        if hasattr(self.transport, "check") and self.transport.is_setup:
            self.transport.check()

    def close(self, *, collective: bool = True):
        """Tear the transport down; captured exchanges of this plan stop replaying.

        Collective: every rank waits for the others before any frees memory that
        a peer may still write into (the IPC buffers). ``collective=False``
        (what leaving a ``with`` block on an exception does) releases at once.
        """
        for captured in self._captured:
            captured.invalidate()
        self._captured.clear()
        control, self._control = self._control, None
        if control is None:
            return  # closed before
        try:
            if collective and self.transport.is_setup:
                barrier(control, "CandidateExchange.close")
        finally:
            try:
                if self._levels is not None:
                    self._levels.close()
                else:
                    self.transport.teardown(collective=False)
            finally:
                self._views.clear()
                control.Free()

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        self.close(collective=kind is None)  # a failing rank must not wait for its peers
        return False

    def describe(self) -> str:
        if self._levels is not None:
            return self._levels.describe()
        if self.config.world == 1:
            return "none (world 1: one kernel takes the scores' top-k ids)"
        t = self.transport
        reason = f" ({t.reason})" if getattr(t, "reason", "") else ""
        return f"{t.name}{reason}{_fused_words(self._delivery)}"

    @property
    def gather_is_capturable(self) -> bool:
        if self._levels is not None:
            return False  # the nodes' keys cross over MPI
        return self.config.world == 1 or self.transport.capturable

    def capture(self, scores, seq_lens, *, attention_block_table=None, stream=None):
        """Record the exchange on these exact buffers for cheap replay; collective.

        Returns a :class:`CapturedExchange`. Replays read whatever ``scores``,
        ``seq_lens`` (and the table) hold at replay time, so update them in
        place; results land in the plan's buffers (the arrays :meth:`__call__`
        returns). With a device-side gather (world 1, or a capturable
        transport) the whole exchange is one CUDA/HIP graph; with an MPI
        gather, pack and merge are two graphs around the host all-gather. Two
        levels with the node's fused: the node level (pack, wait, merge to
        keys) and the last merge are two graphs around the nodes' MPI gather.
        Under the simulator the "graphs" are the eager calls, so the flow is
        the same everywhere.
        """
        tokens = scores.shape[1]
        self._views_for(tokens)
        if stream is None and not TARGET.simulator:
            import cupy  # graphs are captured on a stream of their own

            stream = cupy.cuda.Stream(non_blocking=True)
        def pack(s):
            self.pack(scores, seq_lens, stream=s)

        def gather(s):
            self.all_gather(tokens, seq_lens=seq_lens, stream=s)

        def merge(s):
            return self.merge(seq_lens, tokens, attention_block_table=attention_block_table,
                              stream=s)

        flat_fused = self._delivery is not None
        if self.fused and not flat_fused:  # two levels, the node's fused: MPI between graphs
            args, kwargs = self._pack_arguments(scores, seq_lens, tokens)
            del kwargs["out"]
            levels, recv = self._levels, self._views_for(tokens).recv
            node_keys = levels.node_keys(self.config.heads, tokens)

            def node_level(s):
                self._refuse_if_failed()
                levels.node_delivered(args, kwargs, seq_lens, s)

            def across_nodes(s):
                levels.across.all_gather(node_keys, recv, stream=s)

            segments = [(record_graph(node_level, stream), across_nodes),
                        (record_graph(merge, stream), None)]
        elif flat_fused or self._whole_rows:
            one_pass = self._exchange_delivered if flat_fused else self._exchange_whole_rows

            def exchange(s):
                self._refuse_if_failed()
                one_pass(scores, seq_lens, attention_block_table, s)

            segments = [(record_graph(exchange, stream), None)]
        elif self.gather_is_capturable:
            segments = [(record_graph(lambda s: (pack(s), gather(s), merge(s)), stream), None)]
        else:
            segments = [(record_graph(pack, stream), gather), (record_graph(merge, stream), None)]
        views = self._views_for(tokens)
        captured = CapturedExchange(segments, (views.idx, views.sbt, views.ctx),
                                    self.config.sparse_table, stream, self._refuse_if_failed,
                                    keep=(scores, seq_lens, attention_block_table))
        self._captured.append(captured)
        return captured


class _NodeLevels:
    """The two-level exchange's gather: inside each node, then across nodes.

    The plan's transport gathers the shard keys of this node's ranks, one merge
    keeps the node's ``topk`` keys per ``(head, row)`` (:func:`~numba_cp.ops.merge_keys`),
    and the nodes' leaders send those over one MPI all-gather on the whole
    communicator (:class:`~numba_cp.comm.LeaderAllGather`). Every rank of a node
    holds the same node keys, so every rank then merges every node's keys.

    Fused (:meth:`fuse`, a transport that delivers): the pack writes the keys
    straight into every node rank's exchange buffer, at the rank's place in the
    node, and :func:`~numba_cp.ops.merge_delivered_to_keys` waits for them and
    keeps the node's keys where they landed; the same keys as gathered.
    """

    def __init__(self, plan, sizes, transport):
        c, comm = plan.config, plan.comm
        self.plan = plan
        self.layout = node_layout(comm, sizes)
        node = self.layout.node_of[plan.rank]
        self.node_comm = comm.Split(node, plan.rank)
        self.transport = choose_transport(self.node_comm, device=plan._device_payload,
                                          force=transport)
        self.transport.setup((c.heads, c.max_tokens, c.shard_keys), np.int64)
        ranks = self.node_comm.Get_size()
        place = plan._place
        self._node_recv = place(np.zeros(ranks * c.heads * c.max_tokens * c.shard_keys,
                                         np.int64))
        self._node_keys_flat = place(np.zeros(c.heads * c.max_tokens * c.topk, np.int64))
        self.across = LeaderAllGather(comm, self.layout.leaders,
                                      c.heads * c.max_tokens * c.topk * 8,
                                      device=plan._device_payload)
        self.fused = False
        self._delivery = None
        self._delivered = {}  # tokens -> the delivered keys' view, both halves

    def fusion(self):
        """``(fused, why not)`` for this node's transport."""
        t, ranks = self.transport, self.node_comm.Get_size()
        if not t.delivers:
            return False, (f"the {t.name} transport inside the node of rank {self.plan.rank} "
                           "cannot be fused into the kernels")
        if ranks > PEER_SLOTS:
            return False, (f"the fused node level serves up to {PEER_SLOTS} ranks per node, "
                           f"not {ranks}")
        return True, ""

    def fuse(self):
        """Take the node transport's delivery: :meth:`exchange_delivered` may run."""
        self._delivery = self.transport.delivery()
        self.fused = True

    def node_keys(self, heads, tokens):
        c = self.plan.config
        return self._node_keys_flat[:heads * tokens * c.topk].reshape(heads, tokens, c.topk)

    def exchange_delivered(self, pack_args, pack_kwargs, recv, seq_lens, stream):
        """The fused node level, then the nodes' gather into ``recv``. ``pack_args`` and
        ``pack_kwargs``: the plan's pack arguments but the output."""
        node_keys = self.node_delivered(pack_args, pack_kwargs, seq_lens, stream)
        return self.across.all_gather(node_keys, recv, stream=stream)

    def node_delivered(self, pack_args, pack_kwargs, seq_lens, stream):
        """The fused node level alone, device work only (capturable): the node's keys."""
        c, d = self.plan.config, self._delivery
        heads, tokens = c.heads, int(pack_args[0].shape[1])
        keys = self._delivered.get(tokens)
        if keys is None:
            keys = self._delivered[tokens] = d.keys_view((heads, tokens, c.shard_keys),
                                                         slice(None))
        local_topk_keys_to_peers(*pack_args, ctrl=d.ctrl, peers=d.peers,
                                 data_start=d.data_start, slot=d.slot,
                                 peer_rank=self.node_comm.Get_rank(), stream=stream,
                                 **pack_kwargs)
        if not d.wait_in_merge:
            d.wait(stream)
        node_keys = self.node_keys(heads, tokens)
        merge_delivered_to_keys(keys, seq_lens, topk=c.topk, ctrl=d.ctrl, flags=d.flags,
                                errors=d.errors, timeout_ns=d.timeout_ns,
                                block_wait=d.wait_in_merge, query_len=c.query_len,
                                init_blocks=c.init_blocks, local_blocks=c.local_blocks,
                                out=node_keys, stream=stream, **self.plan.launch)
        return node_keys

    def all_gather(self, send, recv, seq_lens, stream):
        c = self.plan.config
        heads, tokens, per_shard = send.shape
        ranks = self.node_comm.Get_size()
        node_recv = self._node_recv[:ranks * heads * tokens * per_shard].reshape(
            ranks, heads, tokens, per_shard)
        node_keys = self.node_keys(heads, tokens)
        self.transport.all_gather(send, node_recv, stream=stream)
        merge_keys(node_recv, seq_lens, topk=c.topk, query_len=c.query_len,
                   init_blocks=c.init_blocks, local_blocks=c.local_blocks, out=node_keys,
                   stream=stream, **self.plan.launch)
        return self.across.all_gather(node_keys, recv, stream=stream)

    def describe(self) -> str:
        t = self.transport
        reason = f" ({t.reason})" if getattr(t, "reason", "") else ""
        sizes = ",".join(map(str, self.layout.sizes()))
        return (f"two-level: {self.layout.nodes} node(s) of {sizes} rank(s); inside a node "
                f"{t.name}{reason}{_fused_words(self._delivery)}; across nodes the leaders' "
                "MPI all-gather")

    def close(self):
        self._delivered.clear()
        self._delivery = None
        try:
            self.transport.teardown(collective=False)
        finally:
            self.node_comm.Free()


def _fused_words(delivery) -> str:
    """How a plan's description says where its fused gather waits (nothing if unfused)."""
    if delivery is None:
        return ""
    where = ("the merge's blocks wait for the peers" if delivery.wait_in_merge
             else "a wait kernel before the merge")
    return f", fused into pack and merge ({where})"


class _Views(NamedTuple):
    """A plan's buffers for one token count, as the kernels take them."""

    send: object  # [heads, tokens, per_shard]: this rank's keys
    recv: object  # [world, heads, tokens, per_shard]: every rank's
    keys: object  # recv's merged heads
    idx: object
    sbt: object
    ctx: object
    delivered: object  # fused: [2 * world, merged heads, tokens, per_shard] in the IPC buffer


def record_graph(work, stream):
    """Run ``work(stream)`` once eagerly, then capture it on ``stream`` (a CuPy
    stream) as a CUDA/HIP graph; returns ``replay(stream)``, which launches it.

    The eager run compiles kernels and does any lazy setup outside the capture.
    Under the simulator there are no graphs: ``replay`` is ``work`` itself.
    """
    if TARGET.simulator:
        return work
    work(stream)
    stream.synchronize()
    stream.begin_capture()
    try:
        work(stream)
    finally:
        graph = stream.end_capture()
    return graph.launch


class CapturedExchange:
    """Replays a captured exchange: ``replay()`` runs pack -> gather -> merge again."""

    def __init__(self, segments, outputs, sparse_table, stream, check, keep):
        self._segments = segments
        self._stream = stream
        self._check = check  # raises once a gather gave up
        self._keep = keep  # the graphs read these arrays' memory: keep them alive
        idx, sbt, ctx = outputs
        self.outputs = (idx, sbt, ctx) if sparse_table else idx

    def invalidate(self):
        self._segments = None

    def replay(self, stream=None):
        """Collective when the gather is MPI. Returns the plan's output arrays."""
        if self._segments is None:
            raise RuntimeError("this captured exchange's plan was closed: its buffers are gone")
        self._check()
        stream = self._stream if stream is None else stream
        for replay_graph, host_step in self._segments:
            replay_graph(stream)
            if host_step is not None:
                host_step(stream)
        return self.outputs
