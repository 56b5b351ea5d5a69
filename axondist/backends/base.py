"""The backend contract: what every communication backend implements.

A backend is one rank's endpoint in one communicator. It implements five methods:
:meth:`~Backend.make_plan` (the one door of every collective), :meth:`~Backend.barrier`,
:meth:`~Backend.send`, :meth:`~Backend.recv` and :meth:`~Backend.new_group`; everything
else has a default built on them. ``make_plan(key)`` returns a
:class:`~axondist.backends.plan.Plan` for a validated :class:`~axondist.backends.plan.CallKey`
(what the call is: collective, dtype, shape, op, root, row counts, ``async_op``); its
``run(send, recv=None)`` does the call on buffers that match the key and returns the
result (``send`` for in-place collectives, else ``recv``, allocated when None; with
``key.async_op`` a :class:`Work` whose ``wait()`` returns it); the key's ``signature()``
is what the ranks must agree on. A backend specialises the keys it can run faster and
returns :func:`axondist.backends.p2p_plans.p2p_plan` for every other: those plans are
correct over ``send``/``recv`` alone. The general methods (``all_reduce``, ``gather``...)
take flat buffers and element counts, build the key and run its plan
(:meth:`Backend.plan`, which keeps it). Ranks (``root``, ``src``, ``dst``) are ranks
inside the communicator.
"""

from __future__ import annotations

import abc
import pickle
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from .. import _array
from .._array import describe, namespace
from .._validate import as_rank
from ..errors import CollectiveMismatchError, InvalidBufferError
from ..ops import ReduceOp
from . import settings
from .plan import CallKey, Plan, validate
from .recording.recorder import FlightRecorder
from .work import CompletedWork, FutureWork, MappedWork, PolledWork, ThenWork, Work, finished

#: Plans a backend keeps at once (each key is one call shape; past this many, the cache
#: starts again, freeing the plans it held).
PLAN_CACHE_LIMIT = 1024



def debug_enabled() -> bool:
    """True when ``AXONDIST_DEBUG`` asks for the extra debug checks."""
    debug: bool = settings.read("AXONDIST_DEBUG")
    return debug


def checks_enabled() -> bool:
    """False when ``AXONDIST_CHECKS=0`` turns off the cross-rank argument checks (unsafe)."""
    checks: bool = settings.read("AXONDIST_CHECKS")
    return checks


#: Seconds a call may wait for its peers before the job ends (``AXONDIST_TIMEOUT``):
#: torch's default for NCCL, long enough for a slow checkpoint write on one rank.
DEFAULT_TIMEOUT: float = settings.BY_NAME["AXONDIST_TIMEOUT"].default
#: Seconds before the first stall warning (``AXONDIST_STALL_WARNING``), as Horovod's.
DEFAULT_STALL_WARNING: float = settings.BY_NAME["AXONDIST_STALL_WARNING"].default


def default_timeout() -> float:
    """Seconds a call may wait for peers (``AXONDIST_TIMEOUT``, default 600)."""
    seconds: float = settings.read("AXONDIST_TIMEOUT")
    return seconds


def stall_warning_after(timeout: float) -> float:
    """Seconds before the first stall warning (``AXONDIST_STALL_WARNING``, default 60),
    never later than half of ``timeout``."""
    seconds: float = settings.read("AXONDIST_STALL_WARNING")
    return min(seconds, timeout / 2)


class PersistentAllReduce:
    """An in-place all-reduce of one buffer, set up once and started again every step.

    The buffer is cut into pieces (``bounds``: ``[lo, hi)`` ranges of its flat
    view, chosen by the backend, the same on every rank); :meth:`start` starts
    one piece's reduction and returns its Work. Every rank must start the
    pieces in the same order, interleaved in the same way with its other
    collectives on the group, and may change a piece's values only until it
    starts it. ``start(k, weight)`` sums ``weight * piece`` over the ranks (each rank
    its own weight, the products rounded to the buffer's dtype): the handle multiplies
    the piece just before it starts. Made by :meth:`Backend.persistent_all_reduce`.

    Args:
        buf: the contiguous buffer reduced in place.
        bounds: the pieces as element ranges of ``buf.reshape(-1)``, in start order.
        start: ``start(k)`` starts piece ``k`` and returns its Work.
        free: releases what the backend set up (None: nothing to release).
    """

    __slots__ = ("buf", "bounds", "_start", "_free", "_works", "__weakref__")

    def __init__(self, buf: Any, bounds: Sequence[tuple[int, int]],
                 start: Callable[[int], Work], free: Callable[[], None] | None = None) -> None:
        self.buf = buf
        self.bounds = [(int(lo), int(hi)) for lo, hi in bounds]
        self._start: Callable[[int], Work] | None = start
        self._free = free
        self._works: list[Work | None] = [None] * len(self.bounds)

    @property
    def freed(self) -> bool:
        """True once :meth:`free` ran: the handle cannot start anything any more."""
        return self._start is None

    def piece(self, k: int) -> Any:
        """Piece ``k`` as a view of the buffer (flat)."""
        lo, hi = self.bounds[k]
        return self.buf.reshape(-1)[lo:hi]

    def start(self, k: int, weight: float = 1.0) -> Work:
        """Start piece ``k``'s reduction, this rank's values multiplied by ``weight``; its
        Work's ``wait()`` returns once it is done.

        Raises:
            RuntimeError: the handle was freed, or piece ``k``'s previous start
                has not completed yet (wait for its Work first).
        """
        if self._start is None:
            raise RuntimeError("PersistentAllReduce.start: the handle was freed (its DDP or "
                               "synchronizer was closed); make a new one")
        previous = self._works[k]
        if previous is not None and not previous.is_completed():
            raise RuntimeError(f"PersistentAllReduce.start: piece {k} is still being reduced; "
                               "wait() for its Work before starting it again")
        if weight != 1.0:
            piece = self.piece(k)
            namespace(piece).multiply(piece, weight, out=piece, casting="unsafe")
        work = self._works[k] = self._start(k)
        return work

    def free(self) -> None:
        """Wait for the pieces still in flight, then release the backend's resources.

        Idempotent; every rank calls it (a piece in flight completes only once
        every rank started it).
        """
        if self._start is None:
            return
        self._start = None
        works, self._works = self._works, []
        for work in works:
            if work is not None:
                work.wait()
        free, self._free = self._free, None
        if free is not None:
            free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"{len(self.bounds)} pieces"
        return f"PersistentAllReduce({describe(self.buf)}, {state})"


class Backend(abc.ABC):
    """One rank's endpoint in one communicator (see the module docstring for the contract).

    Attributes:
        name: registry name (``"mock"``, ``"mpi"``, ``"nccl"``).
        rank: this process's rank in the communicator.
        world_size: number of ranks in the communicator.
    """

    name: ClassVar[str]
    rank: int
    world_size: int
    #: The rank's flight recorder (None for a backend that records nothing).
    recorder: FlightRecorder | None = None
    #: True when collectives accept host (NumPy) buffers: callers may exchange
    #: small metadata arrays on it (NCCL takes device memory only).
    host_collectives: ClassVar[bool] = True
    #: True when a rank's sends and receives on one communicator run in one queue (NCCL:
    #: one stream), so a receive still waiting holds back every send issued after it:
    #: callers that send and receive concurrently give each direction its own group.
    serial_p2p: ClassVar[bool] = False

    # --- the contract -------------------------------------------------------------------
    @abc.abstractmethod
    def make_plan(self, key: CallKey) -> Plan:
        """A new plan for a validated ``key`` (see the module docstring); called once per
        key by :meth:`plan`. A backend returns :func:`~axondist.backends.p2p_plans.p2p_plan`
        for the keys it does not run its own way.

        Raises:
            the error naming why this backend cannot run the call (dtype, op...).
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    @abc.abstractmethod
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """Send ``buf`` (C-contiguous) to ``dst``; returns once ``buf`` may be reused.
        Messages from one rank to another with one tag arrive in the order sent."""

    @abc.abstractmethod
    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """Receive the next message from ``src`` with ``tag`` into ``buf`` (C-contiguous,
        of the message's size)."""

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Backend | None:
        """A communicator over ``ranks`` (of this one); every rank must call it.

        Returns None on ranks that are not members.
        """

    # --- prepared calls -------------------------------------------------------------------
    #: This backend's plans by key (made on first use; see :meth:`plan`).
    _call_plans: dict[CallKey, Plan] | None = None

    def plan(self, key: CallKey) -> Plan:
        """The prepared call of ``key`` on this backend: validated and made by
        :meth:`make_plan` the first time, then kept (every collective runs through here).

        Raises:
            the error naming what is wrong with the call (dtype, op, buffer, root...);
            nothing is kept then.
        """
        plans = self._call_plans
        if plans is None:
            plans = self._call_plans = {}
        plan = plans.get(key)
        if plan is None:
            validate(key, self.rank, self.world_size)
            if len(plans) >= PLAN_CACHE_LIMIT:
                self.free_plans()
                plans = self._call_plans = {}
            plan = plans[key] = self.make_plan(key)
        return plan

    def free_plans(self) -> None:
        """Free and forget every plan this backend keeps (part of :meth:`close`)."""
        plans, self._call_plans = self._call_plans, None
        for plan in (plans or {}).values():
            plan.free()

    def _planned(self, key: CallKey, send: Any, recv: Any = None, result: Any = None) -> Work:
        """Run ``key``'s plan; its Work, answering ``result`` (when given) instead of the
        plan's own (the caller's buffer, not a flat view of it)."""
        out = self.plan(key).run(send, recv)
        if key.async_op:
            return out if result is None else MappedWork(out, result)
        return CompletedWork(out if result is None else result)

    # --- collectives on flat buffers, each the plan of its key ------------------------------
    def all_reduce(self, buf: Any, op: ReduceOp, *, async_op: bool = False) -> Work:
        """Reduce ``buf`` over all ranks, in place."""
        return self._planned(CallKey.of("all_reduce", buf, reduce_op=op, async_op=async_op),
                             buf)

    def broadcast(self, buf: Any, root: int, *, async_op: bool = False) -> Work:
        """Copy root's ``buf`` into every rank's ``buf``."""
        return self._planned(CallKey.of("broadcast", buf, root=root, async_op=async_op), buf)

    def reduce(self, buf: Any, op: ReduceOp, root: int, *, async_op: bool = False) -> Work:
        """Reduce ``buf`` over all ranks into ``root``'s ``buf`` (others' are unchanged)."""
        return self._planned(CallKey.of("reduce", buf, reduce_op=op, root=root,
                                        async_op=async_op), buf)

    def all_gather(self, send: Any, recv: Any, counts: Sequence[int], *,
                   async_op: bool = False) -> Work:
        """Concatenate every rank's ``send`` (``counts[k]`` elements from rank k) into each
        rank's ``recv``, in rank order."""
        flat = send.reshape(-1)
        key = CallKey.of("all_gather", flat, counts=tuple(int(c) for c in counts),
                         async_op=async_op)
        return self._planned(key, flat, recv.reshape(-1), recv)

    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: ReduceOp, *,
                       async_op: bool = False) -> Work:
        """Reduce ``send`` over ranks; rank r receives the ``counts[r]`` elements of block r
        into ``recv``."""
        counts = [int(c) for c in counts]
        if len(counts) != self.world_size or sum(counts) != send.size \
                or recv.size != counts[self.rank]:
            raise self._bad_counts("reduce_scatter", counts, (("send", send, sum(counts)),
                                                              ("recv", recv, counts[self.rank])))
        flat = send.reshape(-1)
        key = CallKey.of("reduce_scatter", flat, reduce_op=op, counts=tuple(counts),
                         async_op=async_op)
        return self._planned(key, flat, recv.reshape(-1), recv)

    def gather(self, send: Any, recv: Any | None, counts: Sequence[int], root: int, *,
               async_op: bool = False) -> Work:
        """Concatenate every rank's ``send`` (``counts[k]`` elements from rank k) into root's
        ``recv``; the result is None elsewhere."""
        counts, recv = self._rooted("gather", root, counts, send, recv, "send", "recv")
        flat = send.reshape(-1)
        key = CallKey.of("gather", flat, root=root, counts=tuple(counts), async_op=async_op)
        return self._planned(key, flat, None if recv is None else recv.reshape(-1), recv)

    def scatter(self, send: Any | None, recv: Any, counts: Sequence[int], root: int, *,
                async_op: bool = False) -> Work:
        """Block r of root's ``send`` (``counts[r]`` elements) goes to rank r's ``recv``."""
        counts, send = self._rooted("scatter", root, counts, recv, send, "recv", "send")
        library, layout = _array.layout_of(recv)
        key = CallKey("scatter", recv.dtype, (sum(counts),), library, layout, None, root,
                      tuple(counts), bool(async_op))
        return self._planned(key, None if send is None else send.reshape(-1),
                             recv.reshape(-1), recv)

    def all_to_all(self, send: Any, recv: Any, send_counts: Sequence[int],
                   recv_counts: Sequence[int], *, async_op: bool = False) -> Work:
        """Block k of ``send`` (``send_counts[k]`` elements) goes to rank k; ``recv`` gets
        the blocks every rank sent this one, in rank order (``recv_counts[k]`` from rank k,
        which the caller learnt from the ranks: :func:`axondist.all_to_all` exchanges
        them)."""
        n = self.world_size
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if len(sc) != n or len(rc) != n or send.size != sum(sc) or recv.size != sum(rc):
            raise self._bad_counts("all_to_all", sc, (("send", send, sum(sc)),
                                                      ("recv", recv, sum(rc))))
        flat = send.reshape(-1)
        key = CallKey.of("all_to_all", flat, counts=tuple(sc + rc), async_op=async_op)
        return self._planned(key, flat, recv.reshape(-1), recv)

    def _bad_counts(self, what: str, counts: list[int],
                    sizes: Sequence[tuple[str, Any, int]]) -> Exception:
        if len(counts) != self.world_size:
            return CollectiveMismatchError(f"{what}: counts lists {len(counts)} ranks, the "
                                           f"group has {self.world_size}")
        for arg, buf, expected in sizes:
            if buf is not None and buf.size != expected:
                return InvalidBufferError(
                    f"{what}: {arg} has {buf.size} elements but counts={counts} asks for "
                    f"{expected} on rank {self.rank}")
        return CollectiveMismatchError(f"{what}: counts={counts} do not fit")

    def _rooted(self, what: str, root: int, counts: Sequence[int], mine: Any,
                full: Any | None, mine_arg: str, full_arg: str) -> tuple[list[int], Any]:
        """``counts`` as ints and the root's whole buffer (None elsewhere), checked."""
        as_rank(root, self.world_size, what, "root")
        counts = [int(c) for c in counts]
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

    def metadata_buffer(self, values: Any) -> Any:
        """``values`` (a small NumPy array: counts, flags, a loss) as a buffer this backend's
        collectives take; read the result back with ``axondist._array.to_host``.

        Wrappers exchange such metadata next to the arrays they were given, which may
        live elsewhere (offloaded to the host, or absent on a rank). The default returns
        ``values`` itself, since host backends take NumPy buffers; a backend that takes
        device memory only (NCCL) returns a copy on its device.
        """
        return values

    # --- defaults a backend may override ---------------------------------------------------
    def monitored_barrier(self, timeout: float) -> None:
        """A barrier that fails after ``timeout`` seconds naming the ranks that did not
        arrive. The default is :meth:`barrier` (which the watchdog still ends)."""
        self.barrier()

    def shared_buffer(self, count: int, dtype: Any, collective: str = "all_reduce") -> Any:
        """A zeroed buffer of ``count`` elements of ``dtype`` that :meth:`scaled_sum_blocking`
        (``collective="all_reduce"``) or :meth:`scaled_reduce_scatter_blocking`
        (``"reduce_scatter"``) combines faster than ordinary memory, or None (the default:
        no such memory). Every rank of the group gets the same answer."""
        return None

    def scaled_sum_blocking(self, buf: Any, factor: float = 1.0) -> None:
        """``buf *= factor`` (unless 1), then a SUM all-reduce of ``buf`` in place (ranks
        may pass different factors: sample weights)."""
        if factor != 1.0:
            namespace(buf).multiply(buf, factor, out=buf, casting="unsafe")
        self.plan(CallKey.of("all_reduce", buf, reduce_op=ReduceOp.SUM)).run(buf)

    def scaled_reduce_scatter_blocking(self, buf: Any, factor: float = 1.0) -> Any:
        """``buf * factor`` (unless 1, in place) summed across the ranks: this rank's
        block of rows as :func:`~axondist.comm.reduce_scatter` returns it (ranks may pass
        different factors). ``buf`` is scratch: a backend may leave it weighted."""
        if factor != 1.0:
            namespace(buf).multiply(buf, factor, out=buf, casting="unsafe")
        return self.plan(CallKey.of("reduce_scatter", buf, reduce_op=ReduceOp.SUM)).run(buf)

    def persistent_all_reduce(self, buf: Any, op: ReduceOp = ReduceOp.SUM, *,
                              piece_bytes: int | None = None) -> PersistentAllReduce:
        """Set up the in-place all-reduce of ``buf`` for many starts (see
        :class:`PersistentAllReduce`); collective: every rank calls it, in the same order.

        The default starts the plan of a non-blocking all-reduce of the piece each time;
        one piece unless ``piece_bytes`` asks for more. The MPI backend overrides it with
        MPI-4 persistent collectives (``Allreduce_init``), set up and checked across ranks
        once, in pieces (of 2 MiB unless ``piece_bytes`` says otherwise).

        Args:
            buf: contiguous buffer, reduced in place at every start.
            op: the reduction.
            piece_bytes: the largest piece in bytes (None: the backend's choice).
        """
        flat = buf.reshape(-1)
        bounds = _piece_bounds(int(flat.size), flat.dtype.itemsize, piece_bytes)
        pieces = [flat[lo:hi] for lo, hi in bounds]
        keys = [CallKey.of("all_reduce", piece, reduce_op=op, async_op=True) for piece in pieces]

        def start(k: int) -> Work:
            work: Work = self.plan(keys[k]).run(pieces[k])
            return work

        return PersistentAllReduce(buf, bounds, start)

    # --- small Python objects (metadata): pickled into bytes, sizes first --------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (copies), in rank order (for metadata, not bulk data). The
        default all-gathers the pickles' sizes, then the pickles padded to one width (a
        power of two, so the plans kept stay few)."""
        data = _pickled(obj)
        n = self.world_size
        size = np.array([data.size], np.int64)
        sizes = self.plan(CallKey.of("all_gather", size, counts=(1,) * n)).run(size).tolist()
        width = _width(max(sizes))
        mine = np.zeros(width, np.uint8)
        mine[:data.size] = data
        every = self.plan(CallKey.of("all_gather", mine, counts=(width,) * n)).run(mine)
        return [pickle.loads(every[k * width:k * width + sizes[k]].tobytes()) for k in range(n)]

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every rank (a copy, also on ``root``). The default
        broadcasts the pickle's size, then the pickle padded to a power of two."""
        as_rank(root, self.world_size, "broadcast_object", "root")
        data = _pickled(obj) if self.rank == root else None
        size = np.array([0 if data is None else data.size], np.int64)
        self.plan(CallKey.of("broadcast", size, root=root)).run(size)
        payload = np.zeros(_width(int(size[0])), np.uint8)
        if data is not None:
            payload[:data.size] = data
        self.plan(CallKey.of("broadcast", payload, root=root)).run(payload)
        return pickle.loads(payload[:int(size[0])].tobytes())

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Send a small picklable object: its size, then its pickle (two messages)."""
        data = _pickled(obj)
        self.send(np.array([data.size], np.int64), dst, tag)
        self.send(data, dst, tag)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """Receive an object :meth:`send_object` sent (a copy of it)."""
        size = np.empty(1, np.int64)
        self.recv(size, src, tag)
        data = np.empty(int(size[0]), np.uint8)
        self.recv(data, src, tag)
        return pickle.loads(data.tobytes())

    # --- where and how long -----------------------------------------------------------------
    def node_info(self) -> tuple[int, int, int]:
        """``(node_id, local_rank, local_size)``: which machine this rank is on."""
        return 0, self.rank, self.world_size

    def close(self) -> None:
        """Release resources (idempotent); the default frees the plans."""
        self.free_plans()


def _pickled(obj: Any) -> np.ndarray:
    """``obj``'s pickle as a uint8 array."""
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


def _width(size: int) -> int:
    """The padded width of a pickle of ``size`` bytes: the next power of two (at least 64)."""
    return max(64, 1 << max(0, size - 1).bit_length())


def _piece_bounds(numel: int, itemsize: int, piece_bytes: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges cutting ``numel`` elements into the fewest near-equal pieces of at
    most ``piece_bytes`` (one piece when None; at least one element each)."""
    if piece_bytes is None:
        return [(0, numel)]
    per = max(1, int(piece_bytes) // max(1, itemsize))
    pieces = max(1, -(-numel // per))
    return [(k * numel // pieces, (k + 1) * numel // pieces) for k in range(pieces)]


__all__ = ["PLAN_CACHE_LIMIT", "Backend", "CallKey", "CompletedWork", "FutureWork", "MappedWork",
           "PersistentAllReduce", "Plan", "PolledWork", "ThenWork", "Work",
           "checks_enabled", "debug_enabled", "default_timeout", "finished",
           "stall_warning_after"]
