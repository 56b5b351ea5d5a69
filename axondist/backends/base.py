"""The backend contract: what every communication backend implements.

A backend object is one rank's endpoint in one communicator; it moves bytes between
C-contiguous NumPy/CuPy buffers (shapes, uneven splits and argument checks live in
:mod:`axondist.comm`). Ranks (``root``, ``src``, ``dst``) are ranks inside the
communicator; ``counts`` lists each rank's element count in rank order; ``signature``
holds ``(field, value)`` pairs every rank must agree on; ``async_op=True`` returns a
:class:`Work` at once, otherwise the call has completed when it returns.
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeAlias

from .._array import describe, namespace
from ..errors import CollectiveMismatchError
from ..ops import ReduceOp
from .plan import CallKey, Plan, Signature, general_plan, validate
from .recorder import FlightRecorder
from .work import CompletedWork, FutureWork, MappedWork, PolledWork, ThenWork, Work, finished

#: Plans a backend keeps at once (each key is one call shape; past this many, the cache
#: starts again, freeing the plans it held).
PLAN_CACHE_LIMIT = 1024



def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def debug_enabled() -> bool:
    """True when ``AXONDIST_DEBUG`` asks for the extra debug checks."""
    return _env_flag("AXONDIST_DEBUG", False)


def checks_enabled() -> bool:
    """False when ``AXONDIST_CHECKS=0`` turns off the cross-rank argument checks (unsafe)."""
    return _env_flag("AXONDIST_CHECKS", True)


#: Seconds a call may wait for its peers before the job ends (``AXONDIST_TIMEOUT``):
#: torch's default for NCCL, long enough for a slow checkpoint write on one rank.
DEFAULT_TIMEOUT = 600.0
#: Seconds before the first stall warning (``AXONDIST_STALL_WARNING``), as Horovod's.
DEFAULT_STALL_WARNING = 60.0


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={text!r} must be a finite number of seconds > 0")
    return value


def default_timeout() -> float:
    """Seconds a call may wait for peers (``AXONDIST_TIMEOUT``, default 600)."""
    return _env_seconds("AXONDIST_TIMEOUT", DEFAULT_TIMEOUT)


def stall_warning_after(timeout: float) -> float:
    """Seconds before the first stall warning (``AXONDIST_STALL_WARNING``, default 60),
    never later than half of ``timeout``."""
    return min(_env_seconds("AXONDIST_STALL_WARNING", DEFAULT_STALL_WARNING), timeout / 2)


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
    """One rank's endpoint in one communicator.

    Attributes:
        name: registry name (``"mock"``, ``"mpi"``, ``"nccl"``).
        rank: this process's rank in the communicator.
        world_size: number of ranks in the communicator.
    """

    name: ClassVar[str]
    rank: int
    world_size: int
    #: False when the backend ignores ``signature`` (MPI computes its own), so
    #: callers may skip building it.
    needs_signature: bool = True
    #: The rank's flight recorder (None for a backend that records nothing).
    recorder: FlightRecorder | None = None
    #: True when collectives accept host (NumPy) buffers: callers may exchange
    #: small metadata arrays on it (NCCL takes device memory only).
    host_collectives: ClassVar[bool] = True
    #: True when a rank's sends and receives on one communicator run in one queue (NCCL:
    #: one stream), so a receive still waiting holds back every send issued after it:
    #: callers that send and receive concurrently give each direction its own group.
    serial_p2p: ClassVar[bool] = False
    #: The handle :meth:`persistent_all_reduce` returns (an alias backends build theirs from).
    Persistent: TypeAlias = PersistentAllReduce
    #: The Work of a request completed by polling (an alias for the same reason).
    Polled: TypeAlias = PolledWork

    # --- collectives on buffers -------------------------------------------------
    @abc.abstractmethod
    def all_reduce(self, buf: Any, op: ReduceOp, *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """Reduce ``buf`` over all ranks, in place."""

    @abc.abstractmethod
    def broadcast(self, buf: Any, root: int, *, signature: Signature = (),
                  async_op: bool = False) -> Work:
        """Copy root's ``buf`` into every rank's ``buf``."""

    @abc.abstractmethod
    def all_gather(self, send: Any, recv: Any, counts: Sequence[int], *,
                   signature: Signature = (), async_op: bool = False) -> Work:
        """Concatenate every rank's ``send`` into each rank's ``recv`` (rank order)."""

    @abc.abstractmethod
    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: ReduceOp, *,
                       signature: Signature = (), async_op: bool = False) -> Work:
        """Reduce ``send`` over ranks; rank r receives elements of block r into ``recv``."""

    @abc.abstractmethod
    def gather(self, send: Any, recv: Any | None, counts: Sequence[int], root: int, *,
               signature: Signature = (), async_op: bool = False) -> Work:
        """Concatenate every rank's ``send`` into root's ``recv`` (None elsewhere)."""

    @abc.abstractmethod
    def scatter(self, send: Any | None, recv: Any, counts: Sequence[int], root: int, *,
                signature: Signature = (), async_op: bool = False) -> Work:
        """Block r of root's ``send`` goes to rank r's ``recv``."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    def metadata_buffer(self, values: Any) -> Any:
        """``values`` (a small NumPy array: counts, flags, a loss) as a buffer this backend's
        collectives take; read the result back with ``axondist._array.to_host``.

        Wrappers exchange such metadata next to the arrays they were given, which may
        live elsewhere (offloaded to the host, or absent on a rank). The default returns
        ``values`` itself, since host backends take NumPy buffers; a backend that takes
        device memory only (NCCL) returns a copy on its device.
        """
        return values

    # --- prepared calls -------------------------------------------------------------------
    #: This backend's plans by key (made on first use; see :meth:`plan`).
    _call_plans: dict[CallKey, Plan] | None = None

    def plan(self, key: CallKey) -> Plan:
        """The prepared call of ``key`` on this backend: validated and made by
        :meth:`make_plan` the first time, then kept (every public collective runs
        through here).

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

    def make_plan(self, key: CallKey) -> Plan:
        """A new plan for a validated ``key``. The default runs the call through the general
        methods below (see :func:`axondist.backends.plan.general_plan`); a backend with
        algorithms to choose from overrides it."""
        return general_plan(self, key)

    def free_plans(self) -> None:
        """Free and forget every plan this backend keeps (part of :meth:`close`)."""
        plans, self._call_plans = self._call_plans, None
        for plan in (plans or {}).values():
            plan.free()

    # --- collectives with a default built on the ones above --------------------------------
    def reduce(self, buf: Any, op: ReduceOp, root: int, *, signature: Signature = (),
               async_op: bool = False) -> Work:
        """Reduce ``buf`` over all ranks into ``root``'s ``buf`` (others' are unchanged).

        The default all-reduces a copy; backends with a rooted reduction override it.
        """
        copy = namespace(buf).array(buf, copy=True)
        work = self.all_reduce(copy, op, signature=signature + (("root", root),),
                               async_op=async_op)

        def finish(_: Any = None) -> Any:
            if self.rank == root:
                buf[...] = copy
            return buf

        if not async_op:
            work.wait()
            return CompletedWork(finish())
        return ThenWork(work, finish)

    def all_to_all(self, send: Any, recv: Any, send_counts: Sequence[int],
                   recv_counts: Sequence[int], *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """Block k of ``send`` (``send_counts[k]`` elements) goes to rank k; ``recv`` gets
        the blocks every rank sent this one, in rank order (``recv_counts[k]`` from rank k).

        The default all-gathers every rank's whole ``send`` (n times the traffic);
        backends with an all-to-all override it.
        """
        n = self.world_size
        sizes = self.allgather_object((list(send_counts),))
        totals = [sum(s[0]) for s in sizes]
        everything = namespace(send).empty(sum(totals), dtype=send.dtype)
        self.all_gather(send.reshape(-1), everything, totals, signature=signature).wait()
        flat, out, start = recv.reshape(-1), 0, 0
        for k in range(n):
            counts = sizes[k][0]
            lo = start + sum(counts[: self.rank])
            take = counts[self.rank]
            if take != recv_counts[k]:
                raise CollectiveMismatchError(
                    f"all_to_all: rank {k} sends {take} elements to rank {self.rank}, which "
                    f"expects {recv_counts[k]}")
            flat[out:out + take] = everything[lo:lo + take]
            out += take
            start += totals[k]
        return CompletedWork(recv)

    def monitored_barrier(self, timeout: float) -> None:
        """A barrier that fails after ``timeout`` seconds naming the ranks that did not
        arrive. The default is :meth:`barrier` (which the watchdog still ends)."""
        self.barrier()

    def scaled_sum_blocking(self, buf: Any, factor: float = 1.0) -> None:
        """``buf *= factor`` (unless 1), then a SUM all-reduce of ``buf`` in place.

        Ranks may pass different factors (sample weights). Backends may fuse the
        multiplication with the reduction (the MPI backend weights each piece
        just before sending it).
        """
        if factor != 1.0:
            xp = namespace(buf)
            xp.multiply(buf, factor, out=buf, casting="unsafe")
        self.all_reduce(buf, ReduceOp.SUM,
                        signature=(("dtype", buf.dtype), ("shape", buf.shape),
                                   ("weighted", True))).wait()

    def persistent_all_reduce(self, buf: Any, op: ReduceOp = ReduceOp.SUM, *,
                              piece_bytes: int | None = None) -> PersistentAllReduce:
        """Set up the in-place all-reduce of ``buf`` for many starts (see
        :class:`PersistentAllReduce`); collective: every rank calls it, in the same order.

        The default starts an ordinary non-blocking :meth:`all_reduce` of the
        piece each time, with its usual checks; one piece unless
        ``piece_bytes`` asks for more. The MPI backend overrides it with MPI-4
        persistent collectives (``Allreduce_init``), set up and checked across
        ranks once, in pieces (of 512 KiB unless ``piece_bytes`` says otherwise)
        that a caller can weight just before they leave.

        Args:
            buf: contiguous buffer, reduced in place at every start.
            op: the reduction.
            piece_bytes: the largest piece in bytes (None: the backend's choice).
        """
        flat = buf.reshape(-1)
        bounds = _piece_bounds(int(flat.size), flat.dtype.itemsize, piece_bytes)
        shapes = [(hi - lo,) for lo, hi in bounds]

        def start(k: int) -> Work:
            piece = flat[bounds[k][0]:bounds[k][1]]
            signature: Signature = ((("dtype", piece.dtype), ("shape", shapes[k]))
                                    if self.needs_signature else ())
            return self.all_reduce(piece, op, signature=signature, async_op=True)

        return PersistentAllReduce(buf, bounds, start)

    # --- point to point -----------------------------------------------------------
    @abc.abstractmethod
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """Send ``buf`` to ``dst``; returns once ``buf`` may be reused."""

    @abc.abstractmethod
    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """Receive a message from ``src`` into ``buf`` (whose size must match)."""

    # --- small Python objects (metadata) ------------------------------------------
    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (for metadata, not bulk data)."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Root's ``obj`` on every rank."""

    @abc.abstractmethod
    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Send a small picklable object."""

    @abc.abstractmethod
    def recv_object(self, src: int, tag: int = 0) -> Any:
        """Receive a small picklable object."""

    # --- groups and life cycle ------------------------------------------------------
    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Backend | None:
        """A communicator over ``ranks`` (of this one); every rank must call it.

        Returns None on ranks that are not members.
        """

    def node_info(self) -> tuple[int, int, int]:
        """``(node_id, local_rank, local_size)``: which machine this rank is on."""
        return 0, self.rank, self.world_size

    def close(self) -> None:  # noqa: B027 - an optional hook: backends without resources keep it
        """Release resources (idempotent)."""


class PlannedBackend(Backend):
    """A backend whose general collective methods run through its own plans
    (:meth:`Backend.plan`), so a caller of ``backend.all_reduce(...)`` and a caller of
    ``axondist.all_reduce`` take the same path. The MPI and torch backends build on it."""

    def _planned(self, key: CallKey, send: Any, recv: Any = None, result: Any = None) -> Work:
        """Run ``key``'s plan; its Work, answering ``result`` (when given) instead of the
        plan's own (the caller's buffer, not a flat view of it)."""
        out = self.plan(key).run(send, recv)
        if key.async_op:
            return out if result is None else MappedWork(out, result)
        return CompletedWork(out if result is None else result)

    def all_reduce(self, buf: Any, op: ReduceOp, *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """The in-place all-reduce of ``buf`` (its plan's call)."""
        return self._planned(CallKey.of("all_reduce", buf, reduce_op=op, async_op=async_op),
                             buf)

    def broadcast(self, buf: Any, root: int, *, signature: Signature = (),
                  async_op: bool = False) -> Work:
        """The broadcast of ``root``'s ``buf`` (its plan's call)."""
        return self._planned(CallKey.of("broadcast", buf, root=root, async_op=async_op), buf)

    def reduce(self, buf: Any, op: ReduceOp, root: int, *, signature: Signature = (),
               async_op: bool = False) -> Work:
        """The reduce into ``root``'s ``buf`` (its plan's call)."""
        return self._planned(CallKey.of("reduce", buf, reduce_op=op, root=root,
                                        async_op=async_op), buf)

    def all_gather(self, send: Any, recv: Any, counts: Sequence[int], *,
                   signature: Signature = (), async_op: bool = False) -> Work:
        """The all-gather of flat ``send`` blocks of ``counts`` elements into ``recv``."""
        flat = send.reshape(-1)
        key = CallKey.of("all_gather", flat, counts=tuple(int(c) for c in counts),
                         async_op=async_op)
        return self._planned(key, flat, recv.reshape(-1), recv)


def _piece_bounds(numel: int, itemsize: int, piece_bytes: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges cutting ``numel`` elements into the fewest near-equal pieces of at
    most ``piece_bytes`` (one piece when None; at least one element each)."""
    if piece_bytes is None:
        return [(0, numel)]
    per = max(1, int(piece_bytes) // max(1, itemsize))
    pieces = max(1, -(-numel // per))
    return [(k * numel // pieces, (k + 1) * numel // pieces) for k in range(pieces)]


def compare_signatures(op_name: str,
                       signatures: Sequence[Signature | None]) -> CollectiveMismatchError | None:
    """The error every rank raises when ranks disagree on a collective's arguments.

    ``signatures`` holds each rank's signature in rank order, each starting
    with ``("op", name_of_the_collective)``; None when they all agree.
    Backends call it on the gathered signatures (the mock world always, MPI
    under ``AXONDIST_DEBUG=1``) so every rank raises the same message.
    """
    first = signatures[0]
    if all(s == first for s in signatures):
        return None
    fields: dict[str, list[Any]] = {}
    for sig in signatures:
        for name, _value in sig or ():
            fields.setdefault(name, [])
    for name in fields:
        fields[name] = [dict(sig or ()).get(name) for sig in signatures]
    differing = [name for name, vals in fields.items() if any(v != vals[0] for v in vals)]
    if "op" in differing:
        detail = ", ".join(f"rank {k} called {v}" for k, v in enumerate(fields["op"]))
        return CollectiveMismatchError(
            f"{op_name}: ranks called different collectives at the same point ({detail}); "
            "every rank must make the same collective calls in the same order")
    name = differing[0]
    detail = ", ".join(f"rank {k}: {v}" for k, v in enumerate(fields[name]))
    return CollectiveMismatchError(f"{op_name}: ranks disagree on {name} ({detail})")


__all__ = ["PLAN_CACHE_LIMIT", "Backend", "CallKey", "CompletedWork", "FutureWork", "MappedWork",
           "PersistentAllReduce", "Plan", "PlannedBackend", "PolledWork", "Signature", "ThenWork",
           "Work",
           "checks_enabled", "compare_signatures", "debug_enabled", "default_timeout",
           "finished", "stall_warning_after"]
