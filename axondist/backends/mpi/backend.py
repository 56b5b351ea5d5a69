"""The MPI backend: one rank's endpoint in an MPI communicator that axondist owns.

Collectives run as prepared calls (:meth:`MPIBackend.make_plan`): the plan's class comes
from the table in :mod:`~axondist.backends.mpi.choose` and lives in
:mod:`~axondist.backends.mpi.plans`, :mod:`~axondist.backends.mpi.vector_plans` or
:mod:`~axondist.backends.mpi.algorithms`. Barriers, point to point, objects and groups
run here, each numbered, recorded and checked by the group's
:class:`~axondist.backends.mpi.guard.CallGuard`.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ... import _array
from ..._validate import as_rank
from ...errors import CollectiveMismatchError
from ...ops import ReduceOp
from .. import shared_regions
from ..base import Backend, PersistentAllReduce
from ..p2p_plans import p2p_plan
from ..plan import CallKey, Plan, WidenedMeanPlan
from ..recording.recorder import FlightRecorder
from ..work import PolledWork, Work
from . import single_copy
from .algorithms.pair_exchange import (
    PairAllGatherPlan,
    PairBroadcastPlan,
    PairReduceScatterPlan,
    PairUnsizedAllGatherPlan,
)
from .algorithms.pair_halves import PairHalvesMeanPlan
from .algorithms.pair_ride import (
    PairRideAllGatherPlan,
    PairRidePlan,
    PairRideReduceScatterPlan,
)
from .algorithms.pair_shared import PairSharedReduceScatterPlan, PairSharedSumPlan
from .algorithms.pieces import AllReducePiecesPlan
from .choose import Algorithm, Layout, choose
from .guard import CallGuard, wait_until
from .plans import (
    AllGatherPlan,
    AllReducePlan,
    BroadcastPlan,
    ReducePlan,
    ReduceScatterPlan,
    StagedPlan,
    UnsizedAllGatherPlan,
)
from .transport import (
    BYTES,
    MPIOptions,
    MPIWork,
    TypeTable,
    cuda_aware_from_alloc_kinds,
    load_mpi,
    piece_bounds,
    raise_mpi_error,
    split_tag,
    synchronize_device,
    unsupported,
)
from .vector_plans import AllToAllPlan, GatherPlan, PointToPointAllToAllPlan, ScatterPlan

#: The plan class of each (collective, algorithm) the table can choose.
PLANS: dict[tuple[str, Algorithm], Callable[[Any, CallKey], Plan]] = {
    ("all_reduce", Algorithm.MPI): AllReducePlan,
    ("all_reduce", Algorithm.PAIR_RIDE): PairRidePlan,
    ("all_reduce", Algorithm.PAIR_HALVES): PairHalvesMeanPlan,
    ("all_reduce", Algorithm.PIECES): AllReducePiecesPlan,
    ("broadcast", Algorithm.MPI): BroadcastPlan,
    ("broadcast", Algorithm.PAIR_EXCHANGE): PairBroadcastPlan,
    ("all_gather", Algorithm.MPI): AllGatherPlan,
    ("all_gather", Algorithm.PAIR_EXCHANGE): PairAllGatherPlan,
    ("all_gather", Algorithm.PAIR_RIDE): PairRideAllGatherPlan,
    ("reduce_scatter", Algorithm.MPI): ReduceScatterPlan,
    ("reduce_scatter", Algorithm.PAIR_EXCHANGE): PairReduceScatterPlan,
    ("reduce_scatter", Algorithm.PAIR_RIDE): PairRideReduceScatterPlan,
    ("reduce", Algorithm.MPI): ReducePlan,
    ("gather", Algorithm.MPI): GatherPlan,
    ("scatter", Algorithm.MPI): ScatterPlan,
    ("all_to_all", Algorithm.MPI): AllToAllPlan,
    ("all_to_all", Algorithm.POINT_TO_POINT): PointToPointAllToAllPlan,
}
#: The plan class of each algorithm the table chooses for an all-gather without sizes.
UNSIZED_GATHER_PLANS: dict[Algorithm, Callable[[Any, CallKey], Plan]] = {
    Algorithm.MPI: UnsizedAllGatherPlan,
    Algorithm.PAIR_EXCHANGE: PairUnsizedAllGatherPlan,
}
#: The collectives whose blocks differ by rank (MPI's v-calls).
_VECTOR = frozenset({"gather", "scatter", "all_to_all"})
#: Bytes per persistent all-reduce piece unless ``piece_bytes`` says otherwise.
PERSISTENT_PIECE_BYTES = 2 << 20


def node_info(node_ids: Sequence[int], rank: int) -> tuple[int, int, int]:
    """(node id, local rank, local size) of ``rank`` from every rank's node id; nodes are
    numbered by their first rank, so every rank agrees."""
    order = list(dict.fromkeys(node_ids))
    mine = node_ids[rank]
    local = [r for r, n in enumerate(node_ids) if n == mine]
    return order.index(mine), local.index(rank), len(local)


class MPIBackend(Backend):
    """One rank's endpoint in an MPI communicator that axondist owns.

    Args:
        comm: the communicator (already a duplicate: the backend frees it on
            :meth:`close`). Construction is collective over ``comm``.
        options: data-movement policy (:meth:`MPIOptions.from_env` when None).
        recorder: the rank's flight recorder (a new one when None).
        group_name: the group's name in the recorder.
        members: the group's members as world ranks (all of ``comm`` when None).
        node_ids: every rank's node id (computed when None).
        types: the world's datatype table (a new one when None).
    """

    name = "mpi"

    def __init__(self, comm: Any, options: MPIOptions | None = None, *,
                 recorder: FlightRecorder | None = None, group_name: str = "world",
                 members: Sequence[int] | None = None, node_ids: Sequence[int] | None = None,
                 types: TypeTable | None = None) -> None:
        self.mpi = mpi = load_mpi()
        self._comm = comm
        self.options = options if options is not None else MPIOptions.from_env()
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self._owns_types = types is None
        self.types = TypeTable(mpi) if types is None else types
        if recorder is None:
            world = mpi.COMM_WORLD
            recorder = FlightRecorder(world.Get_rank(), world.Get_size(),
                                      mpi.Get_processor_name())
        self.guard = CallGuard(comm, mpi, recorder, group_name,
                               range(self.world_size) if members is None else members,
                               self.options.checks, self.options.debug)
        self._tag_ub = int(mpi.COMM_WORLD.Get_attr(mpi.TAG_UB))
        #: Each rank's node id (nodes numbered by their lowest rank).
        self._nodes = self._compute_nodes() if node_ids is None else list(node_ids)
        self._node = node_info(self._nodes, self.rank)
        #: What the algorithm table reads about this group.
        self.layout = Layout(self.world_size, len(set(self._nodes)), self.guard.checks
                             and not self.options.debug, self.options.chunk_bytes)
        self._cuda_aware: bool | None = True if self.options.host_staging == "never" else None
        self._persistent: weakref.WeakSet[PersistentAllReduce] = weakref.WeakSet()
        #: The shared weighted sums and reduce-scatters made so far, by (kind, dtype, shape).
        self._shared_plans: dict[tuple[type, np.dtype, tuple[int, ...]], Any] = {}
        #: Whether this group's buffers may lie in shared regions (decided the same on every
        #: rank: two ranks of one host, checks on, the option on, the host allows the peer's
        #: mapping).
        self.shares_memory = (self.world_size == 2 and self.layout.nodes == 1
                              and self.layout.checks and self.options.shared_buffers
                              and single_copy.why_not_permitted() is None)
        #: The rank's watchdog (the world backend of a job of several ranks only).
        self.watchdog: Any = None
        #: Messages (arrays and objects) this rank sent to each group rank, and received
        #: from each: at the exit the ranks compare them (:func:`.world.unreceived`).
        self.sent = np.zeros(self.world_size, np.int64)
        self.received = np.zeros(self.world_size, np.int64)

    # --- properties ---------------------------------------------------------------------
    @property
    def recorder(self) -> FlightRecorder:  # type: ignore[override]
        """The rank's flight recorder (shared by its groups)."""
        return self.guard.rec

    @property
    def comm(self) -> Any:
        """The mpi4py communicator carrying this backend's traffic (not COMM_WORLD)."""
        return self._comm

    @property
    def cuda_aware(self) -> bool:
        """Whether device buffers may go to MPI directly (detected once)."""
        if self._cuda_aware is None:
            query = getattr(self.mpi, "Query_cuda_support", None)
            if query is not None:
                self._cuda_aware = bool(query())
            else:
                info = self._comm.Get_info()
                try:
                    self._cuda_aware = cuda_aware_from_alloc_kinds(
                        info.Get("mpi_memory_alloc_kinds") or "")
                finally:
                    info.Free()
        return self._cuda_aware

    def _compute_nodes(self) -> list[int]:
        """Every rank's node id, from ``Split_type(COMM_TYPE_SHARED)``."""
        local = self._comm.Split_type(self.mpi.COMM_TYPE_SHARED, key=self.rank)
        try:
            leader = local.bcast(self.rank, root=0)
            return list(self._comm.allgather(leader))
        finally:
            local.Free()

    # --- prepared calls -------------------------------------------------------------------
    def _staged(self, key: CallKey) -> bool:
        if self.options.host_staging == "always":
            return True
        return key.library != "numpy" and not self.cuda_aware

    def make_plan(self, key: CallKey) -> Plan:
        """The plan of ``key``: a widened mean for half-precision AVERAGEs, host copies
        for device arrays MPI cannot read, else the class the table chooses."""
        self.types.admit(key.dtype)
        if key.reduce_op == "AVERAGE" and key.dtype.itemsize == 2 and key.dtype.kind != "i":
            return WidenedMeanPlan(self, key)
        if self._staged(key):
            # rows that differ by rank go point to point, staged by send and recv
            return p2p_plan(self, key) if key.collective in _VECTOR else StagedPlan(self, key)
        return self.host_plan(key)

    def host_plan(self, key: CallKey) -> Plan:
        """The plan of ``key`` on buffers MPI reads directly."""
        if key.collective == "all_gather" and key.counts is None:
            return UNSIZED_GATHER_PLANS[choose(key, self.layout)](self, key)
        if key.reduce_op is not None and key.dtype not in self.types.reduce[key.reduce_op]:
            raise unsupported(key.collective, key.dtype, key.reduce_op)
        made = PLANS.get((key.collective, choose(key, self.layout)))
        return made(self, key) if made is not None else p2p_plan(self, key)

    # --- buffers both ranks of a pair read and write -----------------------------------------
    def shared_buffer(self, count: int, dtype: Any,
                      collective: str = "all_reduce") -> np.ndarray | None:
        """A zeroed buffer of ``count`` elements in a shared region, which
        :meth:`scaled_sum_blocking` (``collective="all_reduce"``) or
        :meth:`scaled_reduce_scatter_blocking` (``"reduce_scatter"``) combine with no MPI
        transfer, when this group can (:attr:`shares_memory`, float32/64) and the buffer
        is large enough for it to pay; else None. The same answer on every rank."""
        dtype = np.dtype(dtype)
        if (not self.shares_memory or dtype not in _SHARED_DTYPES
                or int(count) * dtype.itemsize < _SHARED_PLANS[collective].from_bytes):
            return None
        return shared_regions.allocate(int(count) * dtype.itemsize, dtype)

    def scaled_sum_blocking(self, buf: Any, factor: float = 1.0) -> None:
        """``buf * factor`` summed across the ranks, in place; for a buffer of
        :meth:`shared_buffer` without MPI moving it (:mod:`.algorithms.pair_shared`)."""
        where = self._shared_place(buf, PairSharedSumPlan)
        if where is None:
            super().scaled_sum_blocking(buf, factor)
            return
        self._shared_plan(PairSharedSumPlan, buf).run(buf, factor, where)

    def scaled_reduce_scatter_blocking(self, buf: Any, factor: float = 1.0) -> Any:
        """``buf * factor`` summed across the ranks, this rank's block of rows; for a buffer
        of :meth:`shared_buffer` without MPI moving it, and ``buf`` left as it was
        (:mod:`.algorithms.pair_shared`)."""
        where = self._shared_place(buf, PairSharedReduceScatterPlan)
        if where is None:
            return super().scaled_reduce_scatter_blocking(buf, factor)
        return self._shared_plan(PairSharedReduceScatterPlan, buf).run(buf, factor, where)

    def _shared_place(self, buf: Any, kind: Any) -> tuple[shared_regions.Locator, int] | None:
        """Where ``buf`` lies in a shared region, when plan ``kind`` runs for it; else None
        (the ordinary path: also for a view of a region smaller than ``kind.from_bytes``)."""
        if (not self.shares_memory or type(buf) is not np.ndarray or buf.ndim == 0
                or buf.dtype not in _SHARED_DTYPES or buf.nbytes < kind.from_bytes):
            return None
        return shared_regions.locate(buf)

    def _shared_plan(self, kind: type, buf: np.ndarray) -> Any:
        key = (kind, buf.dtype, buf.shape)
        plan = self._shared_plans.get(key)
        if plan is None:
            plan = self._shared_plans[key] = kind(self, buf.dtype, buf.shape)
        return plan

    # --- calls outside plans ---------------------------------------------------------------
    def _checked(self, op: str, key: tuple[tuple[str, Any], ...], run: Callable[[], Any]) -> Any:
        """``run()`` as call ``op``: numbered, recorded, checked across ranks first."""
        guard = self.guard
        seq, slot = guard.begin(op, key)
        try:
            if guard.checks:
                guard.agree(op, key, guard.words(op, key))
            try:
                return run()
            except self.mpi.Exception as exc:
                raise_mpi_error(self.mpi, exc, op)
        finally:
            guard.rec.end(slot)

    def _host(self, *bufs: Any) -> bool:
        """True when these buffers go through host copies; else makes device ones ready."""
        if self.options.host_staging == "always":
            return True
        if not any(b is not None and _array.is_cupy(b) for b in bufs):
            return False
        if not self.cuda_aware:
            return True
        synchronize_device(*bufs)
        return False

    def barrier(self) -> None:
        """``Barrier`` on the backend's communicator (the watchdog ends a barrier that
        some rank never enters)."""
        self._checked("barrier", (), self._comm.Barrier)

    def monitored_barrier(self, timeout: float) -> None:
        """A barrier that fails after ``timeout`` seconds naming the ranks that did not
        arrive (asked through the watchdog); the communicator is unusable afterwards."""
        guard = self.guard
        deadline = time.monotonic() + timeout
        seq, slot = guard.begin("barrier", ())
        try:
            guard.agree_within("barrier", (), seq, deadline)
            request = self._comm.Ibarrier()
            wait_until(request.Test, deadline, lambda: guard.absent_error("barrier", seq))
        finally:
            guard.rec.end(slot)

    # --- persistent all-reduces ------------------------------------------------------------
    def persistent_all_reduce(self, buf: Any, op: ReduceOp = ReduceOp.SUM, *,
                              piece_bytes: int | None = None) -> PersistentAllReduce:
        """MPI-4 persistent ``Allreduce_init`` requests over pieces of ``buf``, made once
        (the ranks check here, once, that they set up the same call) and started each
        step: no per-call allocation, so no page faults per start. Each start is
        numbered and recorded as an ``all_reduce``, and its Work honours
        ``wait(timeout)``. Device buffers and debug mode take the contract's default."""
        if type(buf) is not np.ndarray or self.options.debug \
                or self.options.host_staging == "always":
            return super().persistent_all_reduce(buf, op, piece_bytes=piece_bytes)
        self.types.admit(buf.dtype)
        found = self.types.reduce[op.name].get(buf.dtype)
        if found is None:
            raise unsupported("all_reduce", buf.dtype, op.name)
        view, mtype, mop, average = found
        flat = buf.reshape(-1)
        wire = flat if view is None else flat.view(view)
        piece = piece_bytes or self.options.piece_bytes or PERSISTENT_PIECE_BYTES
        bounds = piece_bounds(flat.size, flat.itemsize, piece)
        self._checked("all_reduce", (("dtype", str(buf.dtype)), ("shape", buf.shape),
                                     ("reduce_op", op.name), ("persistent", piece)),
                      lambda: None)
        try:
            requests = [self._comm.Allreduce_init(self.mpi.IN_PLACE, [wire[lo:hi], mtype], mop)
                        for lo, hi in bounds]
        except self.mpi.Exception as exc:
            raise_mpi_error(self.mpi, exc, "all_reduce")
        guard = self.guard
        scale = (1.0 / self.world_size) if average else None

        def start(k: int) -> Work:
            lo, hi = bounds[k]
            request, piece_view = requests[k], flat[lo:hi]
            seq, slot = guard.begin("all_reduce", (("dtype", str(buf.dtype)),
                                                   ("shape", (hi - lo,)), ("persistent", k)),
                                    blocking=False)
            try:
                request.Start()
            except self.mpi.Exception as exc:
                raise_mpi_error(self.mpi, exc, "all_reduce")
            finally:
                guard.rec.end(slot)
            finish = None if scale is None else (
                lambda: _divide(piece_view, self.world_size))
            return PolledWork(request.Test, request.Wait, piece_view, "all_reduce", finish,
                              (guard.rec, guard.group, seq))

        def free() -> None:
            if not self.mpi.Is_finalized():
                for request in requests:
                    request.Free()

        handle = PersistentAllReduce(buf, bounds, start, free)
        self._persistent.add(handle)
        return handle

    # --- point to point (arrays as bytes; headers in their own tag space) -------------------
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """``Send`` of ``buf``'s bytes; returns once MPI may reuse ``buf``. ``tag`` must be
        in ``0 .. TAG_UB // 2`` (objects use a disjoint tag space)."""
        as_rank(dst, self.world_size, "send", "dst")
        data_tag, _ = split_tag(tag, self._tag_ub)
        if self._host(buf):
            buf = _array.copy_to_host(buf, _array.host_staging_buffer(buf))
        guard = self.guard
        slot = guard.begin_p2p("send", (("peer", guard.members[dst]), ("tag", tag),
                                       ("bytes", buf.nbytes)))
        try:
            self._comm.Send(buf.reshape(-1).view(BYTES), dst, data_tag)
        except self.mpi.Exception as exc:
            raise_mpi_error(self.mpi, exc, "send")
        finally:
            guard.rec.end(slot)
        self.sent[dst] += 1

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """``Recv`` of the next message from ``src`` with ``tag`` into ``buf``.

        Raises:
            CollectiveMismatchError: the message's size is not ``buf.nbytes``.
        """
        as_rank(src, self.world_size, "recv", "src")
        data_tag, _ = split_tag(tag, self._tag_ub)
        target = _array.host_staging_buffer(buf) if self._host(buf) else buf
        status = self.mpi.Status()
        guard = self.guard
        slot = guard.begin_p2p("recv", (("peer", guard.members[src]), ("tag", tag),
                                       ("bytes", target.nbytes)))
        try:
            self._comm.Recv(target.reshape(-1).view(BYTES), src, data_tag, status)
        except self.mpi.Exception as exc:
            self.received[src] += 1  # a message too long for the buffer is taken all the same
            raise_mpi_error(self.mpi, exc, _recv_text(src, tag, buf))
        finally:
            guard.rec.end(slot)
        self.received[src] += 1
        got = status.Get_count(self.mpi.BYTE)
        if got != target.nbytes:
            raise CollectiveMismatchError(
                f"{_recv_text(src, tag, buf)}: the message has {got} bytes but the buffer "
                f"holds {target.nbytes}; send and recv must use the same shape and dtype")
        if target is not buf:
            _array.copy_from_host(buf, target)

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """mpi4py's pickled ``send`` of ``obj``, in a tag space apart from the arrays'."""
        as_rank(dst, self.world_size, "send_object", "dst")
        _, header_tag = split_tag(tag, self._tag_ub)
        guard = self.guard
        slot = guard.begin_p2p("send", (("peer", guard.members[dst]), ("tag", tag)))
        try:
            self._comm.send(obj, dst, header_tag)
        finally:
            guard.rec.end(slot)
        self.sent[dst] += 1

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object ``src`` sent with ``tag`` (mpi4py's pickled ``recv``)."""
        as_rank(src, self.world_size, "recv_object", "src")
        _, header_tag = split_tag(tag, self._tag_ub)
        guard = self.guard
        slot = guard.begin_p2p("recv", (("peer", guard.members[src]), ("tag", tag)))
        try:
            obj = self._comm.recv(None, src, header_tag)
        finally:
            guard.rec.end(slot)
        self.received[src] += 1
        return obj

    # --- small objects ---------------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Copies of every rank's ``obj``, in rank order (mpi4py's pickled ``allgather``)."""
        result: list[Any] = self._checked("allgather_object", (),
                                          lambda: self._comm.allgather(obj))
        return result

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every rank (mpi4py's pickled ``bcast``: a copy, also on root)."""
        as_rank(root, self.world_size, "broadcast_object", "root")
        return self._checked("broadcast_object", (("root", root),),
                             lambda: self._comm.bcast(obj, root))

    # --- groups and life cycle -------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> MPIBackend | None:
        """``Split`` of this communicator: members get keys in ``ranks`` order, others
        pass ``MPI.UNDEFINED`` (and get None). The members are part of the checked
        arguments: ranks that disagree raise before the ``Split``."""
        ranks = tuple(int(r) for r in ranks)
        for r in ranks:
            as_rank(r, self.world_size, "new_group", "rank")
        self._checked("new_group", (("ranks", ranks),), lambda: None)
        guard = self.guard
        name = f"{guard.group}.{guard.groups_made}"
        guard.groups_made += 1
        member = self.rank in ranks
        sub = self._comm.Split(0 if member else self.mpi.UNDEFINED,
                               ranks.index(self.rank) if member else 0)
        if not member:
            return None
        sub.Set_errhandler(self.mpi.ERRORS_RETURN)
        return MPIBackend(sub, self.options, recorder=guard.rec, group_name=name,
                          members=[guard.members[r] for r in ranks],
                          node_ids=[self._nodes[r] for r in ranks], types=self.types)

    def node_info(self) -> tuple[int, int, int]:
        """``(node_id, local_rank, local_size)`` from ``Split_type(COMM_TYPE_SHARED)``,
        computed when the backend was created."""
        return self._node

    def close(self) -> None:
        """Free the communicator, its plans and checks (collective: every rank calls it).

        Idempotent, and a no-op once MPI is finalized.
        """
        comm, self._comm = self._comm, None
        mpi = self.mpi
        if comm is None or mpi.Is_finalized() or comm == mpi.COMM_NULL:
            return
        self.guard.forget()
        for handle in list(self._persistent):
            handle.free()  # collective, as close() is: every rank holds the same ones
        self.free_plans()
        for shared in self._shared_plans.values():
            shared.free()
        self._shared_plans.clear()
        self.guard.close()
        if self._owns_types:
            self.types.free()
        comm.Free()


#: The dtypes a shared weighted sum combines.
_SHARED_DTYPES = frozenset((np.dtype(np.float32), np.dtype(np.float64)))
#: The shared plan of each collective :meth:`MPIBackend.shared_buffer` serves.
_SHARED_PLANS = {"all_reduce": PairSharedSumPlan, "reduce_scatter": PairSharedReduceScatterPlan}


def _divide(buf: Any, n: int) -> None:
    """A sum's piece turned into its mean, in place (after MPI's SUM: its bits)."""
    np.divide(buf, n, out=buf)


def _recv_text(src: int, tag: int, buf: Any) -> str:
    """How an error of a receive names it (made only when one is raised)."""
    return f"recv from rank {src} (tag {tag}) into {_array.describe(buf)}"


__all__ = ["PLANS", "MPIBackend", "MPIWork", "node_info"]
