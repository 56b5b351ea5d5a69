"""NcclBackend: one rank's endpoint on one GPU (see :mod:`axondist.backends.nccl`), made of
parts it holds: its communicator (:class:`~.communicator.Communicator`: launch, recording,
checks), the plans its collectives run as (:mod:`.plans`) and its messages
(:class:`~.messages.Messages`). Here: construction, queries, sub-groups and close."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Sequence
from typing import Any

from ...errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankError,
    WorldAbortedError,
)
from ..base import Backend, checks_enabled, debug_enabled, default_timeout
from ..plan import CallKey, Plan, UnsizedAllGatherPlan, WidenedMeanPlan
from ..recording.recorder import FlightRecorder
from ..work import Work
from .basics import GroupedCallError, NcclError, NcclUniqueId, node_info_from_hosts
from .communicator import Communicator
from .messages import Messages
from .plans import NcclPlan, plan_for
from .runtime import (
    NcclCall,
    RankState,
    WorldLink,
    device_count,
    group_calls,
    load_cupy,
    new_communicator,
    require_no_group,
)


class NcclBackend(Backend):
    """One rank's endpoint in an NCCL communicator, on one GPU, for CuPy arrays.

    Args:
        unique_id: the communicator's :class:`NcclUniqueId` (or its bytes, hex
            text or CuPy tuple), the same on every rank.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks.
        device: the CUDA device id this rank uses.
        timeout: seconds a wait may take before
            :class:`~axondist.errors.CollectiveTimeoutError`
            (``AXONDIST_TIMEOUT``, default 600, when None).

    Creating it is collective: every rank must construct its backend (NCCL
    blocks until all have joined), then the ranks exchange host names (for
    :meth:`node_info`), their settings (which must agree) and the addresses
    of their watchdogs, started here for more than one rank.

    Every collective is numbered and recorded in the rank's flight recorder
    (begun when enqueued, stamped done once the GPU finished it) and, unless
    ``AXONDIST_CHECKS=0``, starts with a 16-byte ``ncclAllReduce`` (MAX of a
    hash pair of its name and arguments) whose result the host reads: ranks
    that disagree raise :class:`~axondist.errors.CollectiveMismatchError`
    before any data moves. Calls inside :meth:`grouped` are recorded, not
    checked. The watchdog warns about a stalled call naming the missing ranks
    and, at the timeout or when a needed rank left, aborts the rank's
    communicators (``ncclCommAbort``): the waiting call raises its report.

    Raises:
        BackendUnavailableError: CuPy, NCCL or a GPU is missing.
        ValueError: rank, world size or device out of range.
        NcclError: NCCL failed to create the communicator.
    """

    name = "nccl"
    host_collectives = False
    serial_p2p = True

    def __init__(self, unique_id: Any, rank: int, world_size: int, device: int, *,
                 timeout: float | None = None) -> None:
        cupy, nccl = load_cupy()
        uid = NcclUniqueId.coerce(unique_id)
        _check_rank_args(rank, world_size, "NcclBackend")
        count = device_count(cupy)
        if not isinstance(device, int) or not 0 <= device < count:
            raise ValueError(f"NcclBackend: device={device!r} is not a visible GPU "
                             f"(valid: 0..{count - 1})")
        where = f"rank {rank} of {world_size} (GPU {device})"
        with cupy.cuda.Device(device), NcclCall(nccl, "NcclBackend (ncclCommInitRank)", where):
            comm = new_communicator(nccl, world_size, uid, rank)
        wait = default_timeout() if timeout is None else float(timeout)
        host = socket.gethostname()
        state = RankState(rank, world_size, host, wait, checks=checks_enabled(),
                          debug=debug_enabled())
        self._hold(Communicator(cupy, nccl, comm, rank, world_size, device, None, WorldLink(),
                                state, "world", range(world_size), is_world=True))
        self._join_job(host)

    @classmethod
    def _around(cls, comm: Communicator) -> NcclBackend:
        """A backend holding ``comm`` (a sub-group's, or one of :meth:`create_world`'s)."""
        self = cls.__new__(cls)
        self._hold(comm)
        return self

    def _hold(self, comm: Communicator) -> None:
        #: This rank's communicator: launch, recording and checks (what the plans use).
        self.comm = comm
        #: Point-to-point and object messages over it.
        self.messages = Messages(comm)
        self.rank, self.world_size, self.device = comm.rank, comm.world_size, comm.device
        self.timeout = comm.timeout

    def _join_job(self, host: str) -> None:
        """Exchange host names and settings (which must agree), then start the watchdog."""
        state, n = self.comm.state, self.world_size
        settings = (state.checks, state.debug, self.timeout)
        table = self.comm.allgather_object_raw((host, settings))
        if any(t[1] != settings for t in table):
            state.abort_all()
            detail = "; ".join(f"rank {k}: checks={t[1][0]}, debug={t[1][1]}, timeout={t[1][2]:g}"
                               for k, t in enumerate(table))
            raise ValueError(f"NcclBackend: the ranks were started with different axondist "
                             f"settings ({detail}); set AXONDIST_CHECKS, AXONDIST_DEBUG and "
                             "AXONDIST_TIMEOUT (or timeout=) alike on every rank")
        self.comm.hosts = tuple(t[0] for t in table)
        if n > 1:
            token = self.comm.broadcast_object_raw(secrets.token_hex(16) if self.rank == 0 else "",
                                                   0)
            watchdog = state.make_watchdog(token)
            watchdog.start(self.comm.allgather_object_raw(watchdog.address))

    # --- construction helpers -------------------------------------------------------------
    @staticmethod
    def generate_unique_id() -> NcclUniqueId:
        """A new :class:`NcclUniqueId` (on one rank; share it with the others).

        Raises:
            BackendUnavailableError: CuPy or NCCL missing.
        """
        _, nccl = load_cupy()
        with NcclCall(nccl, "generate_unique_id (ncclGetUniqueId)", "this process"):
            return NcclUniqueId.from_cupy(nccl.get_unique_id())

    @classmethod
    def create_world(cls, devices: Sequence[int], *,
                     timeout: float | None = None) -> list[NcclBackend]:
        """One backend per GPU in ``devices``, all driven by this process (``ncclCommInitAll``).

        Use each from its own thread (:func:`spawn_on_devices`), or issue
        every backend's call from one thread inside :func:`group_calls`.

        Raises:
            ValueError: an empty list, a repeated or invalid device id.
        """
        cupy, nccl = load_cupy()
        devices = [int(d) for d in devices]
        count = device_count(cupy)
        if not devices or len(set(devices)) != len(devices) or \
                any(not 0 <= d < count for d in devices):
            raise ValueError(f"create_world: devices={devices} must be distinct visible GPU ids "
                             f"(0..{count - 1})")
        n = len(devices)
        wait = default_timeout() if timeout is None else float(timeout)
        checks, debug = checks_enabled(), debug_enabled()
        with NcclCall(nccl, "create_world (ncclCommInitAll)", f"GPUs {devices}"):
            comms = nccl.NcclCommunicator.initAll(devices)
        host = socket.gethostname()
        link = WorldLink()
        backends = [cls._around(Communicator(
                        cupy, nccl, comm, r, n, d, (host,) * n, link,
                        RankState(r, n, host, wait, checks=checks, debug=debug), "world",
                        range(n), is_world=True))
                    for r, (comm, d) in enumerate(zip(comms, devices))]
        if n > 1:
            token = secrets.token_hex(16)
            dogs = [b.comm.state.make_watchdog(token) for b in backends]
            for dog in dogs:
                dog.start([d.address for d in dogs])
        return backends

    # --- collectives: plans ------------------------------------------------------------------
    def make_plan(self, key: CallKey) -> Plan:
        """The NCCL plan of ``key`` (:mod:`.plans`: every collective on CuPy arrays); a
        half-precision mean widens to float32 first, an all-gather without row counts
        exchanges them first, each then through this backend's plans."""
        made = plan_for(self.comm, key)
        if made is not None:
            return made
        if key.collective == "all_gather" and key.counts is None:
            return UnsizedAllGatherPlan(self, key)
        return WidenedMeanPlan(self, key)

    def _planned(self, key: CallKey, send: Any, recv: Any = None, result: Any = None) -> Work:
        """The contract's, except that an NCCL plan's Work comes back as it is, an
        :class:`~.runtime.NcclWork` answering ``result``: its ``wait_stream`` hands the
        result to another stream without a host wait, and a blocking call inside
        :meth:`grouped` returns at once, completed by the block's end (how one thread
        drives every GPU of :meth:`create_world`)."""
        plan = self.plan(key)
        if not isinstance(plan, NcclPlan):
            return super()._planned(key, send, recv, result)
        work = plan.start(send, recv)
        return work if result is None else work.answering(result)

    def barrier(self) -> None:
        """An all-reduce of one number, waited for on the host."""
        require_no_group("barrier")
        self.comm.barrier()

    def metadata_buffer(self, values: Any) -> Any:
        """A copy of the host array ``values`` on this backend's GPU (NCCL reads device
        memory only), made on the caller's stream, which the collectives follow."""
        with self.comm.cupy.cuda.Device(self.device):
            return self.comm.cupy.asarray(values)

    # --- messages -------------------------------------------------------------------------
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """See :meth:`.messages.Messages.send`."""
        self.messages.send(buf, dst, tag)

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """See :meth:`.messages.Messages.recv`."""
        self.messages.recv(buf, src, tag)

    def allgather_object(self, obj: Any) -> list[Any]:
        """See :meth:`.messages.Messages.allgather_object`."""
        return self.messages.allgather_object(obj)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """See :meth:`.messages.Messages.broadcast_object`."""
        return self.messages.broadcast_object(obj, root)

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """See :meth:`.messages.Messages.send_object`."""
        self.messages.send_object(obj, dst, tag)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """See :meth:`.messages.Messages.recv_object`."""
        return self.messages.recv_object(src, tag)

    # --- queries --------------------------------------------------------------------------
    def nccl_version(self) -> tuple[int, int, int]:
        """The NCCL library's ``(major, minor, patch)``."""
        return self.comm.version

    @property
    def stream(self) -> Any:
        """The ``cupy.cuda.Stream`` this backend's operations run on."""
        return self.comm.stream

    @property
    def communicator(self) -> Any:
        """The underlying ``cupy.cuda.nccl.NcclCommunicator`` (for what axondist lacks)."""
        return self.comm.nccl_comm

    def node_info(self) -> tuple[int, int, int]:
        """``(node_id, local_rank, local_size)`` from the host names the ranks exchanged."""
        return node_info_from_hosts(self.comm.hosts or (socket.gethostname(),) * self.world_size,
                                    self.rank)

    @property
    def recorder(self) -> FlightRecorder:  # type: ignore[override]
        """This rank's flight recorder (shared by its groups), completed calls stamped."""
        self.comm.sweep()
        return self.comm.state.recorder

    def grouped(self) -> group_calls:
        """Context manager bracketing calls in ``ncclGroupStart``/``ncclGroupEnd``."""
        return group_calls()

    def synchronize(self) -> None:
        """Block until every operation issued on this backend has completed."""
        require_no_group("synchronize")
        self.comm.synchronize()

    def __repr__(self) -> str:
        return f"NcclBackend(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    # --- groups and life cycle ------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> NcclBackend | None:
        """A communicator over ``ranks``: a fresh unique id from its first member.

        Every rank of this communicator must call it (it broadcasts over
        this communicator); members then create the new communicator together.
        It shares this rank's flight recorder and watchdog, as group
        ``<this group>.<k>`` (the k-th made from this one).
        """
        require_no_group("new_group")
        ranks = tuple(int(r) for r in ranks)
        for r in ranks:
            self.comm.check_rank(r, "new_group", "rank")
        if not ranks or len(set(ranks)) != len(ranks):
            raise RankError(f"new_group: ranks {list(ranks)} must be distinct and non-empty")
        all_ranks = self.allgather_object(ranks)
        if any(r != ranks for r in all_ranks):
            raise CollectiveMismatchError(
                "new_group: ranks disagree on the members: "
                + ", ".join(f"rank {k} passed {list(r)}" for k, r in enumerate(all_ranks)))
        uid = self.generate_unique_id() if self.rank == ranks[0] else None
        uid = self.broadcast_object(uid, ranks[0])
        c = self.comm
        name = f"{c.group}.{c.groups_made}"
        c.groups_made += 1
        if self.rank not in ranks:
            return None
        sub_rank, size = ranks.index(self.rank), len(ranks)
        where = f"sub-group rank {sub_rank} of {size} (GPU {self.device})"
        with c.cupy.cuda.Device(self.device), \
                NcclCall(c.nccl, "new_group (ncclCommInitRank)", where):
            comm = new_communicator(c.nccl, size, uid, sub_rank)
        hosts = tuple(c.hosts[r] for r in ranks) if c.hosts else None
        return NcclBackend._around(Communicator(
            c.cupy, c.nccl, comm, sub_rank, size, self.device, hosts, c.link, c.state, name,
            [c.members[r] for r in ranks], is_world=False))

    def close(self) -> None:
        """Finish outstanding work and destroy the communicator (idempotent).

        After another rank of a :meth:`create_world` failed, or when the
        outstanding work does not finish in time, the communicator is
        aborted instead (``ncclCommAbort``), which does not wait for peers.
        Closing the world backend stops the rank's watchdog; after a clean
        close it tells the peers this rank left (a peer still waiting for it
        then fails at once, naming it).
        """
        c = self.comm
        if c.closed:
            return
        state = c.state
        abort = c.link.reason is not None or state.verdict is not None or c.broken is not None
        if not abort:
            try:
                self.synchronize()
            except (CollectiveTimeoutError, CollectiveMismatchError, WorldAbortedError, NcclError,
                    GroupedCallError):
                abort = True
        c.closed = True
        c.inflight.clear()
        self.free_plans()
        state.recorder.groups.pop(c.group, None)
        state.recorder.groups.pop(c.p2p_group, None)
        if c.nccl_comm in state.comms:
            state.comms.remove(c.nccl_comm)
        with c.cupy.cuda.Device(self.device):
            if state.verdict is not None or c.broken is not None:
                pass  # aborted already
            elif abort and hasattr(c.nccl_comm, "abort"):
                c.nccl_comm.abort()
            else:
                c.nccl_comm.destroy()
        if c.is_world and state.watchdog is not None:
            if abort:
                state.watchdog.stop()
            else:
                state.watchdog.announce_left()
                state.watchdog.close()  # no server thread outlives an in-process world


def _check_rank_args(rank: int, world_size: int, what: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{what}: world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{what}: rank={rank!r} must be in 0..{world_size - 1}")
