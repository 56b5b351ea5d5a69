"""The MPI backend: one process per rank, over mpi4py.

Launch ``mpiexec -n K python train.py``; ``axondist.init()`` sees the MPI
launch and calls :func:`create_world_backend`. What the code does not show:

* **Own communicator.** Library traffic runs on ``COMM_WORLD.Dup()``, so
  axondist's messages never match the user's receives or collectives on
  ``COMM_WORLD``. Sub-groups are ``Split`` of that duplicate.
* **Zero copy.** Buffers go to MPI as they are (upper-case mpi4py calls).
  float16 and bfloat16 have no MPI datatype: they travel as a committed
  2-byte contiguous datatype and reduce with user-defined commutative MPI
  ops that do the arithmetic in NumPy in the dtype itself (what the mock
  world does). bool uses ``MPI.C_BOOL`` with logical OR (SUM, MAX) and AND
  (PRODUCT, MIN). AVERAGE is SUM, then an in-place division by the group
  size. MIN/MAX follow MPI's rules on NaN (not NumPy's propagation).
* **Big messages in pieces.** All-reduces and broadcasts larger than
  ``chunk_bytes`` (16 MiB) run as several calls on slices. MPICH allocates a
  temporary buffer the size of an all-reduce; from 32 MiB glibc serves it
  with fresh mmap pages every call, and the page faults made one 64 MiB
  all-reduce ~1.6x slower than four 16 MiB ones (measured with
  ``benchmarks/bench_mpi_collectives.py``).
* **Arithmetic fused with the pieces.** A blocking AVERAGE above
  ``FUSED_PIECE_BYTES`` (512 KiB) runs piece by piece, each piece divided
  right after its all-reduce while it is still in cache; gradient buckets
  weight and sum the same way (:meth:`MPIBackend.scaled_sum_blocking`). A
  separate pass over a 95 MiB model's buckets cost ~30% on top of the
  all-reduces; fused it costs ~0-5%.
* **A lean blocking path.** :mod:`axondist.comm` calls the
  ``*_blocking`` methods directly for NumPy arrays (no signature tuple, no
  Work object) unless ``AXONDIST_DEBUG`` or ``host_staging="always"``.
* **CuPy arrays** go straight to MPI when it is CUDA-aware (after
  synchronizing the current stream), otherwise through host copies: copy to
  host, communicate, copy back (for ``async_op=True``, in ``wait()``).
* **Failures abort the job.** :func:`create_world_backend` installs a
  ``sys.excepthook`` that prints the uncaught exception's traceback with
  every line prefixed by ``[axondist rank R/N]`` and then calls
  ``COMM_WORLD.Abort(1)``, so mpiexec ends every rank with a non-zero exit
  instead of leaving the others blocked in a collective.
* **async_op agrees across ranks.** ``async_op=True`` uses MPI's
  non-blocking collectives (``Iallreduce``...), which MPI never matches with
  a blocking call on another rank: every rank must pass the same
  ``async_op`` to a given collective (``AXONDIST_DEBUG=1`` reports it).
  Non-blocking calls progress inside MPI calls and ``wait()``.
* **No timeouts.** A blocking MPI collective cannot time out: a peer that
  never calls it hangs the others (a peer that *fails* aborts the job, see
  above). ``Work.wait(timeout)`` of a non-blocking call does raise
  :class:`CollectiveTimeoutError`, leaving the operation pending.
* **Cross-rank checks.** Local checks are always on (buffer sizes against
  counts; a received message against its buffer, by ``Status``). With
  ``AXONDIST_DEBUG=1`` every collective first gathers every rank's
  signature (one small extra allgather per call) and raises the same
  :class:`CollectiveMismatchError` on every rank when they disagree, instead
  of truncating, corrupting or hanging.
"""

from __future__ import annotations

import copy
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _array
from ..errors import CollectiveMismatchError, InvalidBufferError, RankError
from ..ops import ReduceOp
from ._mpi_common import (
    BYTES,
    MPIOptions,
    MPIWork,
    StagedWork,
    copy_back,
    cuda_aware_from_alloc_kinds,
    displacements,
    host_copy,
    load_mpi,
    piece_bounds,
    raise_mpi_error,
    split_tag,
    synchronize_device,
    type_table,
    unsupported,
)
from .base import Backend, CompletedWork, Signature, Work, compare_signatures

# Bound by _load_mpi(): module globals keep the hot path to plain lookups.
MPI: Any = None
_IN_PLACE: Any = None

#: Piece size where a pass over the data is fused with the all-reduce (AVERAGE's
#: division, :meth:`MPIBackend.scaled_sum_blocking`'s weighting): small enough
#: that the piece is still in the core's cache between the arithmetic and MPI's
#: copy of it. Measured on 95 MiB of float32 in 25 MiB buckets, 2 ranks: a
#: weighting pass before whole-bucket all-reduces cost 1.35x the all-reduces
#: alone; fused per 1 MiB piece 1.12x, per 512 KiB 1.02x, per 256 KiB 1.05x.
FUSED_PIECE_BYTES = 512 << 10


def _load_mpi() -> Any:
    global MPI, _IN_PLACE
    if MPI is None:
        MPI = load_mpi()
        _IN_PLACE = MPI.IN_PLACE
    return MPI


# --- the backend ---------------------------------------------------------------------------

class MPIBackend(Backend):
    """One rank's endpoint in an MPI communicator that axondist owns.

    Args:
        comm: the communicator (already a duplicate: the backend frees it on
            :meth:`close`). Construction is collective over ``comm``.
        options: data-movement policy (:meth:`MPIOptions.from_env` when None).
    """

    name = "mpi"

    def __init__(self, comm: Any, options: MPIOptions | None = None) -> None:
        _load_mpi()
        self._comm = comm
        self.options = options if options is not None else MPIOptions.from_env()
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self._types = type_table()
        self._reduce_plans = self._types.reduce
        # The same keyed by the op's name, for the hot path: ReduceOp's hash is
        # Enum's Python-level __hash__ (~0.1 us), a str caches its hash.
        self._plans_by_name = {op._name_: plans for op, plans in self._reduce_plans.items()}
        self._transfer_plans = self._types.transfer
        self._debug = self.options.debug
        #: axondist.comm builds the signature tuples only when this is true.
        self.needs_signature = self._debug
        self._chunk = self.options.chunk_bytes or sys.maxsize
        self._stage_always = self.options.host_staging == "always"
        #: axondist.comm's blocking calls on NumPy arrays may call the
        #: ``*_blocking`` methods directly (no signature, no Work object).
        self.blocking_fast_path = not (self._debug or self._stage_always)
        self._cuda_aware: bool | None = True if self.options.host_staging == "never" else None
        self._tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        self._node = self._compute_node_info()
        self._host_twin: MPIBackend | None = None

    @property
    def comm(self) -> Any:
        """The mpi4py communicator carrying this backend's traffic (not COMM_WORLD)."""
        return self._comm

    @property
    def cuda_aware(self) -> bool:
        """Whether device buffers may go to MPI directly (detected once)."""
        if self._cuda_aware is None:
            query = getattr(MPI, "Query_cuda_support", None)
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

    def _compute_node_info(self) -> tuple[int, int, int]:
        """(node id, local rank, local size); node ids number the nodes by their
        lowest rank, so every rank agrees on them."""
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            leader = local.bcast(self.rank, root=0)
            leaders = sorted(set(self._comm.allgather(leader)))
            return leaders.index(leader), local.Get_rank(), local.Get_size()
        finally:
            local.Free()

    # --- helpers ---------------------------------------------------------------------------
    def _agree(self, op_name: str, signature: Signature, async_op: bool = False) -> None:
        """Under debug: raise the same CollectiveMismatchError on every rank on disagreement.

        ``async_op`` is compared too: MPI never matches a non-blocking
        collective (``Iallreduce``) with a blocking one on another rank.
        """
        sigs = self._comm.allgather((("op", op_name),) + tuple(signature)
                                    + (("async_op", bool(async_op)),))
        error = compare_signatures(op_name, sigs)
        if error is not None:
            raise error

    def _check_rank(self, r: int, what: str, arg: str) -> None:
        if not 0 <= r < self.world_size:
            raise RankError(f"{what}: {arg}={r} is outside the group of {self.world_size} ranks "
                            f"(valid: 0..{self.world_size - 1})")

    def _bad_counts(self, what: str, counts: list[int],
                    sizes: Sequence[tuple[str, Any, int]]) -> Exception:
        """The error for counts that do not fit the group or the buffers (slow path only)."""
        if len(counts) != self.world_size:
            return CollectiveMismatchError(f"{what}: counts lists {len(counts)} ranks, the "
                                           f"group has {self.world_size}")
        for arg, buf, expected in sizes:
            if buf is not None and buf.size != expected:
                return InvalidBufferError(
                    f"{what}: {arg} has {buf.size} elements but counts={counts} asks for "
                    f"{expected} on rank {self.rank}")
        return CollectiveMismatchError(f"{what}: counts={counts} do not fit")  # unreachable

    def _needs_host(self, *bufs: Any) -> bool:
        """True when these buffers go through host copies; else makes device ones ready."""
        if self._stage_always:
            return True
        if not any(b is not None and _array.is_cupy(b) for b in bufs):
            return False
        if not self.cuda_aware:
            return True
        synchronize_device(*bufs)
        return False

    @property
    def _host(self) -> MPIBackend:
        """This backend without host staging: what staged calls run on their NumPy copies."""
        if self._host_twin is None:
            twin = copy.copy(self)
            twin._stage_always = False
            twin.blocking_fast_path = not twin._debug
            twin._host_twin = twin
            self._host_twin = twin
        return self._host_twin

    def _via_host(self, call: Callable[..., Work], args: Sequence[Any], reads: Sequence[int],
                  writes: Sequence[int], out: int, async_op: bool) -> Work:
        """Run ``call`` on host copies of ``args`` (values copied for ``reads``), then copy
        ``writes`` back (in ``wait()`` when async); the result is ``args[out]``."""
        hosts: list[Any] = [None if a is None else host_copy(a) if i in reads
                            else np.empty(a.shape, a.dtype) for i, a in enumerate(args)]
        work = call(*hosts)

        def finish() -> None:
            for i in writes:
                if args[i] is not None:
                    copy_back(args[i], hosts[i])

        if not async_op:
            work.wait()
            finish()
            return CompletedWork(args[out])
        return StagedWork(work, finish, args[out])

    def _divide(self, buf: Any) -> None:
        _array.namespace(buf).divide(buf, self.world_size, out=buf, casting="unsafe")

    def _transfer(self, buf: Any, what: str) -> tuple[Any, Any]:
        plan = self._transfer_plans.get(buf.dtype)
        if plan is None:
            raise unsupported(what, buf.dtype)
        view, mtype = plan
        return (buf if view is None else buf.view(view)), mtype

    def _reduction(self, buf: Any, op: ReduceOp, what: str) -> tuple[Any, Any, Any, bool]:
        plan = self._plans_by_name[op._name_].get(buf.dtype)
        if plan is None:
            raise unsupported(what, buf.dtype, op)
        view, mtype, mop, average = plan
        return (buf if view is None else buf.view(view)), mtype, mop, average

    # --- collectives -----------------------------------------------------------------------
    # Each method is one layer: checks, then (rarely) the host-staging detour, which
    # re-enters the same method on the host twin with NumPy copies, then the MPI call.
    # The small blocking case is kept to attribute reads, dict lookups and the call:
    # at 4 KiB its Python cost is comparable to the whole MPI all-reduce.

    def all_reduce(self, buf: Any, op: ReduceOp, *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """``Allreduce`` in place (``Iallreduce`` pieces with ``async_op``).

        Messages above ``chunk_bytes`` run in pieces; a blocking AVERAGE above
        ``FUSED_PIECE_BYTES`` is divided piece by piece. Device arrays go through
        host copies unless MPI is CUDA-aware.
        """
        if (type(buf) is not np.ndarray or self._stage_always) and self._needs_host(buf):
            return self._via_host(
                lambda h: self._host.all_reduce(h, op, signature=signature, async_op=async_op),
                [buf], (0,), (0,), 0, async_op)
        if self._debug:
            self._agree("all_reduce", signature + (("reduce_op", op.name),), async_op)
        if not async_op:
            self.all_reduce_blocking(buf, op)
            return CompletedWork(buf)
        plan = self._plans_by_name[op._name_].get(buf.dtype)
        if plan is None:
            raise unsupported("all_reduce", buf.dtype, op)
        view, mtype, mop, average = plan
        return self._all_reduce_pieces(buf, buf if view is None else buf.view(view), mtype, mop,
                                       average, True)

    def all_reduce_blocking(self, buf: Any, op: ReduceOp) -> None:
        """The blocking part of :meth:`all_reduce`: no staging, no debug check, no Work.

        ``buf`` is a NumPy array (or a device array MPI reads directly). What
        :meth:`all_reduce` runs, and what :mod:`axondist.comm` calls directly
        on its hot path when :attr:`blocking_fast_path` is true.
        """
        plan = self._plans_by_name[op._name_].get(buf.dtype)
        if plan is None:
            raise unsupported("all_reduce", buf.dtype, op)
        view, mtype, mop, average = plan
        data = buf if view is None else buf.view(view)
        if average and data.nbytes > FUSED_PIECE_BYTES:
            self._fused_pieces(buf, data, mtype, mop, 1.0, True)
            return
        if data.nbytes > self._chunk:
            self._all_reduce_pieces(buf, data, mtype, mop, average, False)
            return
        try:
            self._comm.Allreduce(_IN_PLACE, [data, mtype], mop)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")
        if average:
            self._divide(buf)

    def scaled_sum_blocking(self, buf: Any, factor: float = 1.0) -> None:
        """Multiply ``buf`` (a NumPy array) by ``factor`` and sum it over the ranks, in place.

        Equal to ``buf *= factor`` (casting unsafely to ``buf``'s dtype; skipped
        when ``factor`` is 1) then a SUM :meth:`all_reduce_blocking`, but in
        pieces of ``FUSED_PIECE_BYTES``, each weighted just before its
        Allreduce so MPI reads it from cache: one pass over memory instead of
        two. The pieces depend only on ``buf``'s size and dtype, so ranks with
        different factors (sample weights) make the same MPI calls. What
        gradient buckets use for their weighted sum.
        """
        plan = self._plans_by_name["SUM"].get(buf.dtype)
        if plan is None:
            raise unsupported("all_reduce", buf.dtype, ReduceOp.SUM)
        view, mtype, mop, _ = plan
        self._fused_pieces(buf, buf if view is None else buf.view(view), mtype, mop, factor,
                           False)

    def _fused_pieces(self, buf: Any, data: Any, mtype: Any, mop: Any, factor: float,
                      average: bool) -> None:
        """Blocking all-reduce piece by piece: each piece multiplied by ``factor`` (unless 1;
        NumPy buffers only) before its Allreduce and, for AVERAGE, divided by the group
        size after it (in ``buf``'s namespace: a device buffer MPI reads directly too)."""
        flat, wire = buf.reshape(-1), data.reshape(-1)
        comm, n, scale = self._comm, self.world_size, factor != 1.0
        xp = _array.namespace(buf)
        try:
            for lo, hi in piece_bounds(flat.size, flat.itemsize, FUSED_PIECE_BYTES):
                piece = flat[lo:hi]
                if scale:
                    np.multiply(piece, factor, out=piece, casting="unsafe")
                comm.Allreduce(_IN_PLACE, [wire[lo:hi], mtype], mop)
                if average:
                    xp.divide(piece, n, out=piece, casting="unsafe")
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

    def _all_reduce_pieces(self, buf: Any, data: Any, mtype: Any, mop: Any, average: bool,
                           async_op: bool) -> Work:
        """Big or non-blocking all-reduce: one call per piece of at most ``chunk_bytes``."""
        flat = data.reshape(-1)
        pieces = [flat[lo:hi] for lo, hi in piece_bounds(flat.size, flat.itemsize, self._chunk)]
        comm = self._comm
        try:
            if not async_op:
                for piece in pieces:
                    comm.Allreduce(_IN_PLACE, [piece, mtype], mop)
                if average:
                    self._divide(buf)
                return CompletedWork(buf)
            requests = [comm.Iallreduce(_IN_PLACE, [p, mtype], mop) for p in pieces]
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")
        return MPIWork(requests, (lambda: self._divide(buf)) if average else None, buf,
                       "all_reduce")

    def broadcast(self, buf: Any, root: int, *, signature: Signature = (),
                  async_op: bool = False) -> Work:
        """``Bcast`` of ``root``'s ``buf`` (``Ibcast`` if ``async_op``), in chunk_bytes pieces."""
        if not 0 <= root < self.world_size:
            self._check_rank(root, "broadcast", "root")
        if (type(buf) is not np.ndarray or self._stage_always) and self._needs_host(buf):
            return self._via_host(
                lambda h: self._host.broadcast(h, root, signature=signature, async_op=async_op),
                [buf], (0,) if self.rank == root else (), (0,), 0, async_op)
        if self._debug:
            self._agree("broadcast", signature + (("root", root),), async_op)
        if not async_op:
            self.broadcast_blocking(buf, root)
            return CompletedWork(buf)
        plan = self._transfer_plans.get(buf.dtype)
        if plan is None:
            raise unsupported("broadcast", buf.dtype)
        view, mtype = plan
        data = buf if view is None else buf.view(view)
        comm = self._comm
        try:
            flat = data.reshape(-1)
            pieces = [flat[lo:hi] for lo, hi in
                      piece_bounds(flat.size, flat.itemsize, self._chunk)]
            if not async_op:
                for piece in pieces:
                    comm.Bcast([piece, mtype], root)
                return CompletedWork(buf)
            requests = [comm.Ibcast([p, mtype], root) for p in pieces]
        except MPI.Exception as exc:
            raise_mpi_error(exc, "broadcast")
        return MPIWork(requests, None, buf, "broadcast")

    def broadcast_blocking(self, buf: Any, root: int) -> None:
        """The blocking part of :meth:`broadcast` (see :meth:`all_reduce_blocking`)."""
        if not 0 <= root < self.world_size:
            self._check_rank(root, "broadcast", "root")
        plan = self._transfer_plans.get(buf.dtype)
        if plan is None:
            raise unsupported("broadcast", buf.dtype)
        view, mtype = plan
        data = buf if view is None else buf.view(view)
        comm = self._comm
        try:
            if data.nbytes <= self._chunk:
                comm.Bcast([data, mtype], root)
                return
            flat = data.reshape(-1)
            for lo, hi in piece_bounds(flat.size, flat.itemsize, self._chunk):
                comm.Bcast([flat[lo:hi], mtype], root)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "broadcast")

    def all_gather(self, send: Any, recv: Any, counts: Sequence[int], *,
                   signature: Signature = (), async_op: bool = False) -> Work:
        """``Allgather`` of ``send`` into ``recv`` (``Allgatherv`` for uneven ``counts``).

        Raises:
            CollectiveMismatchError: ``counts`` does not list one size per rank.
            InvalidBufferError: ``send`` or ``recv`` does not hold what ``counts`` says.
        """
        counts = counts if type(counts) is list else [int(c) for c in counts]
        total = sum(counts)
        if (len(counts) != self.world_size or send.size != counts[self.rank]
                or recv.size != total):
            raise self._bad_counts("all_gather", counts, (("send", send, counts[self.rank]),
                                                          ("recv", recv, total)))
        if ((type(send) is not np.ndarray or type(recv) is not np.ndarray or self._stage_always)
                and self._needs_host(send, recv)):
            return self._via_host(
                lambda s, r: self._host.all_gather(s, r, counts, signature=signature,
                                                   async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("all_gather", signature + (("counts", tuple(counts)),), async_op)
        if not async_op:
            self.all_gather_blocking(send, recv, counts)
            return CompletedWork(recv)
        s, r, mtype = self._gather_buffers(send, recv)
        try:
            if counts.count(counts[0]) == len(counts):
                request = self._comm.Iallgather([s, mtype], [r, mtype])
            else:
                request = self._comm.Iallgatherv([s, mtype],
                                                 [r, counts, displacements(counts), mtype])
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_gather")
        return MPIWork([request], None, recv, "all_gather")

    def _gather_buffers(self, send: Any, recv: Any) -> tuple[Any, Any, Any]:
        """(send view, recv view, MPI datatype) for an all-gather."""
        plan = self._transfer_plans.get(send.dtype)
        rplan = plan if recv.dtype is send.dtype else self._transfer_plans.get(recv.dtype)
        if plan is None or rplan is None:
            raise unsupported("all_gather", send.dtype if plan is None else recv.dtype)
        view, mtype = plan
        return (send if view is None else send.view(view),
                recv if rplan[0] is None else recv.view(rplan[0]), mtype)

    def all_gather_blocking(self, send: Any, recv: Any, counts: list[int]) -> None:
        """The blocking part of :meth:`all_gather` (see :meth:`all_reduce_blocking`).

        ``counts`` is a list of ints that the caller checked against the
        group and the buffers (:meth:`all_gather` and :mod:`axondist.comm` do).
        """
        plan = self._transfer_plans.get(send.dtype)
        if plan is not None and plan[0] is None and recv.dtype is send.dtype:
            s, r, mtype = send, recv, plan[1]  # a native MPI type: no views
        else:
            s, r, mtype = self._gather_buffers(send, recv)
        try:
            if counts.count(counts[0]) == len(counts):  # the common case needs no displs
                self._comm.Allgather([s, mtype], [r, mtype])
            else:
                self._comm.Allgatherv([s, mtype], [r, counts, displacements(counts), mtype])
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_gather")

    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: ReduceOp, *,
                       signature: Signature = (), async_op: bool = False) -> Work:
        """``Reduce_scatter`` of ``send`` by ``counts`` into ``recv``; AVERAGE divides afterwards.

        Raises:
            CollectiveMismatchError: ``counts`` does not list one size per rank.
            InvalidBufferError: ``send`` or ``recv`` does not hold what ``counts`` says.
        """
        counts = counts if type(counts) is list else [int(c) for c in counts]
        if (len(counts) != self.world_size or send.size != sum(counts)
                or recv.size != counts[self.rank]):
            raise self._bad_counts("reduce_scatter", counts, (("send", send, sum(counts)),
                                                              ("recv", recv, counts[self.rank])))
        if self._needs_host(send, recv):
            return self._via_host(
                lambda s, r: self._host.reduce_scatter(s, r, counts, op, signature=signature,
                                                       async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("reduce_scatter",
                        signature + (("counts", tuple(counts)), ("reduce_op", op.name)), async_op)
        s, mtype, mop, average = self._reduction(send, op, "reduce_scatter")
        r, _, _, _ = self._reduction(recv, op, "reduce_scatter")
        try:
            if not async_op:
                self._comm.Reduce_scatter([s, mtype], [r, mtype], counts, mop)
                if average:
                    self._divide(recv)
                return CompletedWork(recv)
            request = self._comm.Ireduce_scatter([s, mtype], [r, mtype], counts, mop)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "reduce_scatter")
        return MPIWork([request], (lambda: self._divide(recv)) if average else None, recv,
                       "reduce_scatter")

    def gather(self, send: Any, recv: Any | None, counts: Sequence[int], root: int, *,
               signature: Signature = (), async_op: bool = False) -> Work:
        """``Gatherv`` into ``root``'s ``recv``; elsewhere ``recv`` is ignored and the result None.

        Raises:
            InvalidBufferError: the root passed no ``recv``, or a buffer does not
                hold what ``counts`` says.
        """
        self._check_rank(root, "gather", "root")
        counts = counts if type(counts) is list else [int(c) for c in counts]
        if self.rank != root:
            recv = None
        elif recv is None:
            raise InvalidBufferError(f"gather: the root (rank {root}) must pass a recv buffer")
        if (len(counts) != self.world_size or send.size != counts[self.rank]
                or (recv is not None and recv.size != sum(counts))):
            raise self._bad_counts("gather", counts, (("send", send, counts[self.rank]),
                                                      ("recv", recv, sum(counts))))
        if self._needs_host(send, recv):
            return self._via_host(
                lambda s, r: self._host.gather(s, r, counts, root, signature=signature,
                                               async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("gather", signature + (("root", root), ("counts", tuple(counts))),
                        async_op)
        s, mtype = self._transfer(send, "gather")
        spec = None
        if recv is not None:
            r, _ = self._transfer(recv, "gather")
            spec = [r, counts, displacements(counts), mtype]
        try:
            if not async_op:
                self._comm.Gatherv([s, mtype], spec, root)
                return CompletedWork(recv)
            request = self._comm.Igatherv([s, mtype], spec, root)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "gather")
        return MPIWork([request], None, recv, "gather")

    def scatter(self, send: Any | None, recv: Any, counts: Sequence[int], root: int, *,
                signature: Signature = (), async_op: bool = False) -> Work:
        """``Scatterv`` of ``root``'s ``send`` by ``counts``; ``send`` is ignored elsewhere.

        Raises:
            InvalidBufferError: the root passed no ``send``, or a buffer does not
                hold what ``counts`` says.
        """
        self._check_rank(root, "scatter", "root")
        counts = counts if type(counts) is list else [int(c) for c in counts]
        if self.rank != root:
            send = None
        elif send is None:
            raise InvalidBufferError(f"scatter: the root (rank {root}) must pass a send buffer")
        if (len(counts) != self.world_size or recv.size != counts[self.rank]
                or (send is not None and send.size != sum(counts))):
            raise self._bad_counts("scatter", counts, (("send", send, sum(counts)),
                                                       ("recv", recv, counts[self.rank])))
        if self._needs_host(send, recv):
            return self._via_host(
                lambda s, r: self._host.scatter(s, r, counts, root, signature=signature,
                                                async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("scatter", signature + (("root", root), ("counts", tuple(counts))),
                        async_op)
        r, mtype = self._transfer(recv, "scatter")
        spec = None
        if send is not None:
            s, _ = self._transfer(send, "scatter")
            spec = [s, counts, displacements(counts), mtype]
        try:
            if not async_op:
                self._comm.Scatterv(spec, [r, mtype], root)
                return CompletedWork(recv)
            request = self._comm.Iscatterv(spec, [r, mtype], root)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "scatter")
        return MPIWork([request], None, recv, "scatter")

    def barrier(self) -> None:
        """``Barrier`` on the backend's communicator (it cannot time out)."""
        if self._debug:
            self._agree("barrier", ())
        self._comm.Barrier()

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
        try:
            self._comm.Send(buf.reshape(-1).view(BYTES), dst, data_tag)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "send")

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """``Recv`` of the next message from ``src`` with ``tag`` into ``buf``.

        Raises:
            CollectiveMismatchError: the message's size is not ``buf.nbytes``
                (a longer message is reported by MPI as truncated).
        """
        self._check_rank(src, "recv", "src")
        data_tag, _ = split_tag(tag, self._tag_ub)
        target = np.empty(buf.shape, buf.dtype) if self._needs_host(buf) else buf
        status = MPI.Status()
        what = f"recv from rank {src} (tag {tag}) into {_array.describe(buf)}"
        try:
            self._comm.Recv(target.reshape(-1).view(BYTES), src, data_tag, status)
        except MPI.Exception as exc:
            raise_mpi_error(exc, what)
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
        self._comm.send(obj, dst, header_tag)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object ``src`` sent with ``tag`` (mpi4py's pickled ``recv``)."""
        self._check_rank(src, "recv_object", "src")
        _, header_tag = split_tag(tag, self._tag_ub)
        return self._comm.recv(None, src, header_tag)

    # --- small objects -----------------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Copies of every rank's ``obj``, in rank order (mpi4py's pickled ``allgather``)."""
        if self._debug:
            self._agree("allgather_object", ())
        return self._comm.allgather(obj)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every rank (mpi4py's pickled ``bcast``: a copy, also on root)."""
        self._check_rank(root, "broadcast_object", "root")
        if self._debug:
            self._agree("broadcast_object", (("root", root),))
        return self._comm.bcast(obj, root)

    # --- groups and life cycle -------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> MPIBackend | None:
        """``Split`` of this communicator: members get keys in ``ranks`` order, others
        pass ``MPI.UNDEFINED`` (and get None)."""
        ranks = tuple(int(r) for r in ranks)
        all_ranks = self._comm.allgather(ranks)
        if any(r != ranks for r in all_ranks):
            raise CollectiveMismatchError(
                "new_group: ranks disagree on the members: "
                + ", ".join(f"rank {k} passed {list(r)}" for k, r in enumerate(all_ranks)))
        for r in ranks:
            self._check_rank(r, "new_group", "rank")
        member = self.rank in ranks
        sub = self._comm.Split(0 if member else MPI.UNDEFINED,
                               ranks.index(self.rank) if member else 0)
        if not member:
            return None
        return MPIBackend(sub, self.options)

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

    Args:
        comm: the mpi4py communicator whose ranks form the world
            (``MPI.COMM_WORLD`` when None); axondist communicates on a
            duplicate of it, never on it.
        abort_on_exception: install :func:`install_abort_hook`.
        timeout: accepted so ``init(timeout=...)`` works for every backend;
            blocking MPI collectives cannot time out (see the module docs).
        **options: fields of :class:`MPIOptions` (``chunk_bytes``,
            ``host_staging``, ``debug``), overriding the environment.

    Raises:
        BackendUnavailableError: mpi4py or the MPI library is missing.
        TypeError: an unknown option.
    """
    _load_mpi()
    policy = MPIOptions.from_env(**options)
    if abort_on_exception:
        install_abort_hook()
    base = MPI.COMM_WORLD if comm is None else comm
    return MPIBackend(base.Dup(), policy)


__all__ = ["MPIBackend", "MPIOptions", "MPIWork", "create_world_backend", "install_abort_hook"]
