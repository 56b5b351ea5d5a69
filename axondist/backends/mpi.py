"""The MPI backend: one process per rank, over mpi4py, on axondist's own duplicate of
``COMM_WORLD``. Every collective is recorded in the rank's flight recorder and starts with
a check that all ranks make the same call (carried in the data of a small all-reduce, and
of a small all-gather, reduce-scatter or broadcast in a group of two); a watchdog ends a
job that stalls. The all-reduces live in ``_mpi_allreduce``, the all-gathers in
``_mpi_gather``, broadcast and reduce-scatter in ``_mpi_blockwise``, what they share in
``_mpi_core``; this module adds the rooted calls, point to point, objects, groups and the
world. ``docs/backends.md`` explains the design (pieces, rings, fused arithmetic, half-precision
and NaN handling, CuPy staging, the checks and the watchdog) and the measurements behind it.
"""

from __future__ import annotations

import secrets
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from .. import _array
from .._validate import positive_seconds
from ..errors import CollectiveMismatchError, InvalidBufferError
from ..ops import ReduceOp
from ._mpi_allreduce import AllReduceMixin
from ._mpi_blockwise import BlockwiseMixin
from ._mpi_common import (
    BYTES,
    MPIOptions,
    MPIWork,
    copy_back,
    displacements,
    host_copy,
    raise_mpi_error,
    split_tag,
)
from ._mpi_core import MPIBackendBase, _load_mpi, bind_mpi
from ._mpi_gather import GatherMixin
from ._mpi_guard import wait_until
from ._watchdog import Watchdog, exit_soon, print_and_flush, silence_all
from .base import (
    CompletedWork,
    Signature,
    Work,
    default_timeout,
    stall_warning_after,
)
from .recorder import FlightRecorder

# Bound when mpi4py loads (_mpi_core.bind_mpi).
MPI: Any = None
_IN_PLACE: Any = None
bind_mpi(globals())


class MPIBackend(AllReduceMixin, BlockwiseMixin, GatherMixin, MPIBackendBase):
    """One rank's endpoint in an MPI communicator that axondist owns.

    Args:
        comm: the communicator (already a duplicate: the backend frees it on
            :meth:`close`). Construction is collective over ``comm``.
        options: data-movement policy (:meth:`MPIOptions.from_env` when None).
    """

    def _rooted(self, what: str, root: int, counts: Sequence[int], mine: Any,
                full: Any | None, mine_arg: str, full_arg: str) -> tuple[list[int], Any]:
        """Checks shared by gather and scatter: ``counts`` as ints, and ``full`` (the
        root's whole buffer) kept on the root only."""
        self._check_rank(root, what, "root")
        counts = counts if type(counts) is list else [int(c) for c in counts]
        if self.rank != root:
            full = None
        elif full is None:
            raise InvalidBufferError(f"{what}: the root (rank {root}) must pass a {full_arg} "
                                     "buffer")
        if (len(counts) != self.world_size or mine.size != counts[self.rank]
                or (full is not None and full.size != sum(counts))):
            raise self._bad_counts(what, counts, ((mine_arg, mine, counts[self.rank]),
                                                  (full_arg, full, sum(counts))))
        return counts, full

    def gather(self, send: Any, recv: Any | None, counts: Sequence[int], root: int, *,
               signature: Signature = (), async_op: bool = False) -> Work:
        """``Gatherv`` into ``root``'s ``recv``; elsewhere ``recv`` is ignored and the result None.

        Raises:
            InvalidBufferError: the root passed no ``recv``, or a buffer does not
                hold what ``counts`` says.
        """
        counts, recv = self._rooted("gather", root, counts, send, recv, "send", "recv")
        if self._needs_host(send, recv):
            return self._via_host(
                lambda s, r: self._host.gather(s, r, counts, root, signature=signature,
                                               async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("gather", signature + (("root", root), ("counts", tuple(counts))),
                        async_op)
        key = (send.dtype, tuple(counts), root, async_op)
        call = self._issue if async_op else self._blocking
        return call("gather", key, self._rooted_call, "gather", send, recv, counts, root,
                    async_op)

    def scatter(self, send: Any | None, recv: Any, counts: Sequence[int], root: int, *,
                signature: Signature = (), async_op: bool = False) -> Work:
        """``Scatterv`` of ``root``'s ``send`` by ``counts``; ``send`` is ignored elsewhere.

        Raises:
            InvalidBufferError: the root passed no ``send``, or a buffer does not
                hold what ``counts`` says.
        """
        counts, send = self._rooted("scatter", root, counts, recv, send, "recv", "send")
        if self._needs_host(send, recv):
            return self._via_host(
                lambda s, r: self._host.scatter(s, r, counts, root, signature=signature,
                                                async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("scatter", signature + (("root", root), ("counts", tuple(counts))),
                        async_op)
        key = (recv.dtype, tuple(counts), root, async_op)
        call = self._issue if async_op else self._blocking
        return call("scatter", key, self._rooted_call, "scatter", recv, send, counts, root,
                    async_op)

    def _rooted_call(self, what: str, mine: Any, full: Any | None, counts: list[int],
                     root: int, async_op: bool) -> Work:
        """``Gatherv``/``Scatterv`` (or their non-blocking forms): ``mine`` is this rank's
        block, ``full`` the root's whole buffer (None elsewhere)."""
        m, mtype = self._transfer(mine, what)
        spec = None
        if full is not None:
            f, _ = self._transfer(full, what)
            spec = [f, counts, displacements(counts), mtype]
        comm = self._comm
        args: tuple[Any, ...]
        try:
            if what == "gather":
                args = ([m, mtype], spec, root)
                call = comm.Igatherv if async_op else comm.Gatherv
            else:
                args = (spec, [m, mtype], root)
                call = comm.Iscatterv if async_op else comm.Scatterv
            if not async_op:
                call(*args)
                return CompletedWork(full if what == "gather" else mine)
            request = call(*args)
        except MPI.Exception as exc:
            raise_mpi_error(exc, what)
        return MPIWork([request], None, full if what == "gather" else mine, what)

    def reduce(self, buf: Any, op: ReduceOp, root: int, *, signature: Signature = (),
               async_op: bool = False) -> Work:
        """``Reduce`` into ``root``'s ``buf`` (in place there); AVERAGE divides on the root.

        Non-blocking calls and host staging take the general path (an all-reduce).
        """
        self._check_rank(root, "reduce", "root")
        if async_op or self._slow or self._needs_host(buf):
            return super().reduce(buf, op, root, signature=signature, async_op=async_op)
        data, mtype, mop, average = self._reduction(buf, op, "reduce")
        comm, mine = self._comm, self.rank == root

        def run() -> None:
            try:
                if mine:
                    comm.Reduce(_IN_PLACE, [data, mtype], mop, root)
                else:
                    comm.Reduce([data, mtype], None, mop, root)
            except MPI.Exception as exc:
                raise_mpi_error(exc, "reduce")
            if average and mine:
                self._divide(buf)

        self._blocking("reduce", (buf.dtype, buf.shape, op._name_, root, False), run)
        return CompletedWork(buf)

    def all_to_all(self, send: Any, recv: Any, send_counts: Sequence[int],
                   recv_counts: Sequence[int], *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """``Alltoallv``: block k of ``send`` to rank k, ``recv`` gets the blocks in rank order.

        Non-blocking calls and host staging take the general path.
        """
        if async_op or self._slow or self._needs_host(send, recv):
            return super().all_to_all(send, recv, send_counts, recv_counts,
                                      signature=signature, async_op=async_op)
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if (len(sc) != self.world_size or len(rc) != self.world_size or send.size != sum(sc)
                or recv.size != sum(rc)):
            raise self._bad_counts("all_to_all", sc, (("send", send, sum(sc)),
                                                      ("recv", recv, sum(rc))))
        s, mtype = self._transfer(send, "all_to_all")
        r, _ = self._transfer(recv, "all_to_all")

        def run() -> None:
            try:
                self._comm.Alltoallv([s, sc, displacements(sc), mtype],
                                     [r, rc, displacements(rc), mtype])
            except MPI.Exception as exc:
                raise_mpi_error(exc, "all_to_all")

        self._blocking("all_to_all", (send.dtype, False), run)
        return CompletedWork(recv)

    def monitored_barrier(self, timeout: float) -> None:
        """A barrier that fails after ``timeout`` seconds naming the ranks that did not
        arrive (asked through the watchdog); the communicator is unusable afterwards."""
        guard = self._guard
        deadline = time.monotonic() + timeout
        seq, slot = guard.begin("barrier", ())
        try:
            guard.agree_within("barrier", (), seq, deadline)
            request = self._comm.Ibarrier()
            wait_until(request.Test, deadline, lambda: guard._absent_error("barrier", seq))
        finally:
            guard.rec.end(slot)

    def barrier(self) -> None:
        """``Barrier`` on the backend's communicator (the watchdog ends a barrier that
        some rank never enters)."""
        if self._debug:
            self._agree("barrier", ())
        self._blocking("barrier", (), self._comm.Barrier)

    # --- point to point (arrays as bytes; headers in their own tag space) ------------------
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """``Send`` of ``buf``'s bytes; returns once MPI may reuse ``buf``.

        Above MPI's eager limit that is when the matching receive has started, so
        two ranks sending large messages to each other first would deadlock.
        ``tag`` must be in ``0 .. TAG_UB // 2`` (objects use a disjoint tag space).
        """
        self._check_rank(dst, "send", "dst")
        data_tag, _ = split_tag(tag, self._tag_ub)
        if self._needs_host(buf):
            buf = host_copy(buf)
        guard = self._guard
        slot = guard.begin_p2p("send", (("peer", guard.members[dst]), ("tag", tag),
                                       ("bytes", buf.nbytes)))
        try:
            self._comm.Send(buf.reshape(-1).view(BYTES), dst, data_tag)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "send")
        finally:
            guard.rec.end(slot)

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """``Recv`` of the next message from ``src`` with ``tag`` into ``buf``.

        Raises:
            CollectiveMismatchError: the message's size is not ``buf.nbytes``
                (a longer message is reported by MPI as truncated).
        """
        self._check_rank(src, "recv", "src")
        data_tag, _ = split_tag(tag, self._tag_ub)
        target = _array.host_staging_buffer(buf) if self._needs_host(buf) else buf
        status = MPI.Status()
        what = f"recv from rank {src} (tag {tag}) into {_array.describe(buf)}"
        guard = self._guard
        slot = guard.begin_p2p("recv", (("peer", guard.members[src]), ("tag", tag),
                                       ("bytes", target.nbytes)))
        try:
            self._comm.Recv(target.reshape(-1).view(BYTES), src, data_tag, status)
        except MPI.Exception as exc:
            raise_mpi_error(exc, what)
        finally:
            guard.rec.end(slot)
        got = status.Get_count(MPI.BYTE)
        if got != target.nbytes:
            raise CollectiveMismatchError(
                f"{what}: the message has {got} bytes but the buffer holds {target.nbytes}; "
                "send and recv must use the same shape and dtype")
        if target is not buf:
            copy_back(buf, target)

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """mpi4py's pickled ``send`` of ``obj``, in a tag space apart from the arrays'."""
        self._check_rank(dst, "send_object", "dst")
        _, header_tag = split_tag(tag, self._tag_ub)
        guard = self._guard
        slot = guard.begin_p2p("send", (("peer", guard.members[dst]), ("tag", tag)))
        try:
            self._comm.send(obj, dst, header_tag)
        finally:
            guard.rec.end(slot)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object ``src`` sent with ``tag`` (mpi4py's pickled ``recv``)."""
        self._check_rank(src, "recv_object", "src")
        _, header_tag = split_tag(tag, self._tag_ub)
        guard = self._guard
        slot = guard.begin_p2p("recv", (("peer", guard.members[src]), ("tag", tag)))
        try:
            return self._comm.recv(None, src, header_tag)
        finally:
            guard.rec.end(slot)

    # --- small objects -----------------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Copies of every rank's ``obj``, in rank order (mpi4py's pickled ``allgather``)."""
        if self._debug:
            self._agree("allgather_object", ())
        result: list[Any] = self._blocking("allgather_object", (), self._comm.allgather, obj)
        return result

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every rank (mpi4py's pickled ``bcast``: a copy, also on root)."""
        self._check_rank(root, "broadcast_object", "root")
        if self._debug:
            self._agree("broadcast_object", (("root", root),))
        return self._blocking("broadcast_object", (root,), self._comm.bcast, obj, root)

    # --- groups and life cycle -------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> MPIBackend | None:
        """``Split`` of this communicator: members get keys in ``ranks`` order, others
        pass ``MPI.UNDEFINED`` (and get None)."""
        ranks = tuple(int(r) for r in ranks)
        for r in ranks:
            self._check_rank(r, "new_group", "rank")
        if self._debug:
            self._agree("new_group", (("ranks", ranks),))
        # The members are part of the checked arguments: ranks that disagree raise
        # CollectiveMismatchError naming what each passed, before the Split.
        self._blocking("new_group", (ranks,), lambda: None)
        guard = self._guard
        name = f"{guard.group}.{guard.groups_made}"
        guard.groups_made += 1
        member = self.rank in ranks
        sub = self._comm.Split(0 if member else MPI.UNDEFINED,
                               ranks.index(self.rank) if member else 0)
        if not member:
            return None
        sub.Set_errhandler(MPI.ERRORS_RETURN)
        return MPIBackend(sub, self.options, recorder=guard.rec, group_name=name,
                          members=[guard.members[r] for r in ranks],
                          node_ids=[self._nodes[r] for r in ranks])

    def node_info(self) -> tuple[int, int, int]:
        """``(node_id, local_rank, local_size)`` from ``Split_type(COMM_TYPE_SHARED)``,
        computed when the backend was created."""
        return self._node

    def close(self) -> None:
        """Free the communicator (collective: call it on every rank).

        Idempotent, and a no-op once MPI is finalized.
        """
        comm, self._comm, self._host_twin = self._comm, None, None
        if comm is not None and not MPI.Is_finalized() and comm != MPI.COMM_NULL:
            self._guard.rec.groups.pop(self._guard.group, None)
            self._guard.rec.groups.pop(self._guard.p2p_group, None)
            for handle in list(self._persistent):
                handle.free()  # collective, as close() is: every rank holds the same ones
            self._guard.close()
            comm.Free()


# --- the job: factory and abort-on-failure -------------------------------------------------

_HOOK_INSTALLED = False


def install_abort_hook() -> None:
    """Make an uncaught exception on any rank end the whole MPI job.

    The hook prints the traceback with each line prefixed by
    ``[axondist rank R/N]`` to stderr, then calls ``COMM_WORLD.Abort(1)`` (on a
    one-rank job it defers to the previous hook). Installed once per process.
    """
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    _load_mpi()
    previous = sys.excepthook

    def abort_job(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        silence_all()  # this rank fails: its peers must not read its exit as a departure
        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        if size == 1:
            previous(exc_type, exc, tb)
            return
        prefix = f"[axondist rank {rank}/{size}] "
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        text += f"rank {rank} failed: aborting the MPI job so the other ranks do not wait forever\n"
        sys.stderr.write("".join(prefix + line for line in text.splitlines(True)))
        sys.stderr.flush()
        world.Abort(1)

    sys.excepthook = abort_job
    _HOOK_INSTALLED = True


def create_world_backend(*, comm: Any = None, abort_on_exception: bool = True,
                         timeout: float | None = None, **options: Any) -> MPIBackend:
    """This process's endpoint in the world of the MPI job (``axondist.init("mpi")``).

    Also starts the rank's watchdog (for more than one rank): a call that
    waits past ``timeout`` seconds, or for a rank that left, ends the job on
    every rank with one message naming the ranks and what each was doing.

    Args:
        comm: the mpi4py communicator whose ranks form the world
            (``MPI.COMM_WORLD`` when None); axondist communicates on a
            duplicate of it, never on it.
        abort_on_exception: install :func:`install_abort_hook`.
        timeout: seconds a call may wait for its peers (``AXONDIST_TIMEOUT``,
            default 600); stall warnings start at ``AXONDIST_STALL_WARNING``
            (default 60, at most half the timeout).
        **options: fields of :class:`MPIOptions` (``chunk_bytes``,
            ``host_staging``, ``debug``, ``checks``), overriding the environment.

    Raises:
        BackendUnavailableError: mpi4py or the MPI library is missing.
        TypeError: an unknown option.
        ValueError: a timeout that is not a finite number > 0, or ranks started
            with different settings.
    """
    _load_mpi()
    policy = MPIOptions.from_env(**options)
    wait = default_timeout() if timeout is None else positive_seconds(timeout, "init")
    if abort_on_exception:
        install_abort_hook()
    base = MPI.COMM_WORLD if comm is None else comm
    dup = base.Dup()
    dup.Set_errhandler(MPI.ERRORS_RETURN)
    rank, size = dup.Get_rank(), dup.Get_size()
    recorder = FlightRecorder(rank, size, MPI.Get_processor_name())
    watchdog = None
    if size > 1:
        watchdog = Watchdog(recorder, timeout=wait, stall=stall_warning_after(wait),
                            abort=_abort_job, token=dup.bcast(secrets.token_hex(16), root=0))
    settings = (policy.checks, policy.debug, policy.chunk_bytes, policy.piece_bytes, wait)
    table = dup.allgather((settings, watchdog.address if watchdog else None))
    if any(t[0] != settings for t in table):
        detail = ", ".join(f"rank {k}: checks={t[0][0]}, debug={t[0][1]}, chunk_bytes={t[0][2]}, "
                           f"piece_bytes={t[0][3]}, timeout={t[0][4]:g}"
                           for k, t in enumerate(table))
        dup.Free()
        raise ValueError("init: the ranks were started with different axondist settings "
                         f"({detail}); set AXONDIST_CHECKS, AXONDIST_DEBUG, "
                         "AXONDIST_MPI_CHUNK_BYTES, AXONDIST_PIECE_MB and AXONDIST_TIMEOUT alike "
                         "on every rank")
    if watchdog is not None:
        watchdog.start([t[1] for t in table])
    backend = MPIBackend(dup, policy, recorder=recorder)
    backend.watchdog = watchdog
    return backend


def _abort_job(message: str) -> None:
    """Print ``message`` on this rank and end the job on every rank (the watchdog's end)."""
    silence_all()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    print_and_flush(f"[axondist rank {rank}/{size}] ", message)
    exit_soon(1, 5.0)  # should MPI_Abort itself hang (a launcher cut off from this host)
    world.Abort(1)


__all__ = ["MPIBackend", "MPIOptions", "MPIWork", "create_world_backend", "install_abort_hook"]
