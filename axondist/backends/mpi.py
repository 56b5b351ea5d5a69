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
* **CuPy arrays** go straight to MPI when it is CUDA-aware (after
  synchronizing the current stream), otherwise through host copies: copy to
  host, communicate, copy back (for ``async_op=True``, in ``wait()``).
* **Failures abort the job.** :func:`create_world_backend` installs a
  ``sys.excepthook`` that prints the uncaught exception's traceback with
  every line prefixed by ``[axondist rank R/N]`` and then calls
  ``COMM_WORLD.Abort(1)``, so mpiexec ends every rank with a non-zero exit
  instead of leaving the others blocked in a collective.
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

import itertools
import os
import sys
import time
import traceback
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Sequence

import numpy as np

from .. import _array
from ..errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidBufferError,
    RankError,
    UnsupportedDTypeError,
)
from ..ops import ReduceOp
from .base import Backend, CompletedWork, Signature, Work, compare_signatures, debug_enabled

#: mpi4py's ``MPI`` module, loaded by :func:`_load_mpi` (importing it initializes MPI).
MPI: Any = None
_IN_PLACE: Any = None

# dtype name -> mpi4py datatype attribute; float16/bfloat16 use _TypeTable.half.
_NATIVE_TYPES = {
    "float32": "FLOAT", "float64": "DOUBLE", "int8": "INT8_T", "uint8": "UINT8_T",
    "int32": "INT32_T", "int64": "INT64_T", "bool": "C_BOOL",
    "complex64": "C_FLOAT_COMPLEX", "complex128": "C_DOUBLE_COMPLEX",
}
_HALF_VIEW = np.dtype(np.uint16)
_BYTES = np.dtype(np.uint8)
_STAGING_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class MPIOptions:
    """How the MPI backend moves data (``create_world_backend(**fields)``)."""

    chunk_bytes: int = 16 << 20
    """All-reduces and broadcasts bigger than this run in pieces of at most
    this many bytes; 0 never splits. Env: ``AXONDIST_MPI_CHUNK_BYTES``."""

    host_staging: str = "auto"
    """How CuPy arrays reach MPI: ``"auto"`` (directly when MPI is CUDA-aware,
    else through host copies), ``"never"`` (always directly: you know MPI is
    CUDA-aware), ``"always"`` (every buffer, NumPy included, goes through a
    host copy: tests that path without a GPU). Env: ``AXONDIST_MPI_HOST_STAGING``."""

    debug: bool = False
    """Compare every collective's arguments across ranks (one small extra
    allgather per call). Env: ``AXONDIST_DEBUG=1``."""

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 0:
            raise ValueError(f"MPIOptions: chunk_bytes must be an int >= 0, got {self.chunk_bytes!r}")
        if self.host_staging not in _STAGING_MODES:
            raise ValueError(f"MPIOptions: host_staging must be one of {_STAGING_MODES}, "
                             f"got {self.host_staging!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> MPIOptions:
        """Defaults, then the environment, then ``overrides`` (unknown names: TypeError)."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(overrides) - set(valid))
        if unknown:
            raise TypeError(f"mpi backend: unknown option(s) {unknown}; valid options are "
                            f"{valid + ['comm', 'abort_on_exception', 'timeout']}")
        env = os.environ
        opts = cls(debug=debug_enabled())
        if "AXONDIST_MPI_CHUNK_BYTES" in env:
            opts = replace(opts, chunk_bytes=int(env["AXONDIST_MPI_CHUNK_BYTES"]))
        if "AXONDIST_MPI_HOST_STAGING" in env:
            opts = replace(opts, host_staging=env["AXONDIST_MPI_HOST_STAGING"].lower())
        return replace(opts, **overrides)


# --- pure helpers (tested without MPI) ----------------------------------------------------

def piece_bounds(numel: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` element ranges cutting ``numel`` elements into the fewest
    near-equal pieces of at most ``chunk_bytes`` bytes (at least one element each)."""
    per = max(1, chunk_bytes // itemsize)
    pieces = max(1, -(-numel // per))
    return [(k * numel // pieces, (k + 1) * numel // pieces) for k in range(pieces)]


def displacements(counts: Sequence[int]) -> list[int]:
    """Start offset of each rank's block for ``counts`` (the v-collectives' displs)."""
    return list(itertools.accumulate(counts[:-1], initial=0)) if counts else []


def cuda_aware_from_alloc_kinds(kinds: str) -> bool:
    """True when an MPI 4.1 ``mpi_memory_alloc_kinds`` value lists CUDA memory."""
    return any(k.split(":")[0].strip().lower() == "cuda" for k in kinds.split(","))


def split_tag(tag: int, tag_ub: int) -> tuple[int, int]:
    """The MPI tags ``(data, header)`` for a user tag: two disjoint tag spaces, so
    an object header never matches an array receive of the same user tag."""
    limit = (tag_ub - 1) // 2
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag <= limit:
        raise ValueError(f"mpi backend: tag={tag!r} must be an int in 0..{limit} "
                         f"(this MPI's tag limit {tag_ub}, halved for headers)")
    return 2 * int(tag), 2 * int(tag) + 1


def half_reducer(dtype: np.dtype, ufunc: Callable[..., Any]) -> Callable[[Any, Any, Any], None]:
    """An MPI user-op callback combining two buffers of ``dtype`` with ``ufunc``
    (MPI's rule: ``inout = in (op) inout``, in NumPy, in ``dtype`` itself)."""
    def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        acc = np.frombuffer(inoutbuf, dtype=dtype)
        ufunc(np.frombuffer(inbuf, dtype=dtype), acc, out=acc)
    return reduce


def host_copy(x: Any) -> np.ndarray:
    """A host array holding ``x``'s values that communication may overwrite."""
    host = _array.to_host(x)
    return host.copy() if host is x else host


def copy_back(dst: Any, host: np.ndarray) -> None:
    """Write host values into ``dst`` (a NumPy or CuPy array) in place."""
    dst[...] = _array.namespace(dst).asarray(host)


# --- MPI loading, types, errors ------------------------------------------------------------

def _load_mpi() -> Any:
    """Import mpi4py (which initializes MPI) once; a clear error when it is missing."""
    global MPI, _IN_PLACE
    if MPI is None:
        try:
            from mpi4py import MPI as mpi
        except ImportError as exc:
            raise BackendUnavailableError(
                "the mpi backend needs mpi4py and an MPI library: pip install 'axondist[mpi]' "
                f"(installs mpi4py and the mpich wheel); import failed with: {exc}") from exc
        except RuntimeError as exc:  # mpi4py present but no loadable MPI library
            raise BackendUnavailableError(
                f"the mpi backend could not start MPI ({exc}); pip install 'axondist[mpi]' "
                "for a bundled MPICH, or check your MPI installation") from exc
        MPI, _IN_PLACE = mpi, mpi.IN_PLACE
    return MPI


class _TypeTable:
    """MPI datatypes and ops per dtype, built once per process.

    ``transfer[dtype] = (view, datatype)``: send ``buf.view(view)`` (``buf``
    when view is None) as ``datatype``. ``reduce[dtype, op] = (view,
    datatype, mpi_op, average)``; a missing key means the pair is unsupported.
    """

    def __init__(self) -> None:
        self.half = MPI.BYTE.Create_contiguous(2).Commit()
        self.transfer: dict[np.dtype, tuple[np.dtype | None, Any]] = {}
        self.reduce: dict[tuple[np.dtype, ReduceOp], tuple[np.dtype | None, Any, Any, bool]] = {}
        self._user_ops: list[Any] = []  # keep the callbacks' Op objects alive
        for dtype in _array.SUPPORTED_DTYPES:
            native = _NATIVE_TYPES.get(dtype.name)
            if native is not None:
                self.transfer[dtype] = (None, getattr(MPI, native))
                self._add_native_reductions(dtype, getattr(MPI, native))
            else:
                self.transfer[dtype] = (_HALF_VIEW, self.half)
                self._add_half_reductions(dtype)

    def _add_native_reductions(self, dtype: np.dtype, mtype: Any) -> None:
        if dtype == np.bool_:
            ops = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR,
                   ReduceOp.PRODUCT: MPI.LAND, ReduceOp.MIN: MPI.LAND}
        else:
            ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD}
            if dtype.kind != "c":
                ops.update({ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX})
            if dtype.kind in "fc":
                ops[ReduceOp.AVERAGE] = MPI.SUM
        for op, mop in ops.items():
            self.reduce[dtype, op] = (None, mtype, mop, op is ReduceOp.AVERAGE)

    def _add_half_reductions(self, dtype: np.dtype) -> None:
        ufuncs = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply,
                  ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}
        mops = {}
        for op, ufunc in ufuncs.items():
            mops[op] = MPI.Op.Create(half_reducer(dtype, ufunc), commute=True)
            self._user_ops.append(mops[op])
        mops[ReduceOp.AVERAGE] = mops[ReduceOp.SUM]
        for op, mop in mops.items():
            self.reduce[dtype, op] = (_HALF_VIEW, self.half, mop, op is ReduceOp.AVERAGE)


_TYPES: _TypeTable | None = None


def _types() -> _TypeTable:
    global _TYPES
    if _TYPES is None:
        _TYPES = _TypeTable()
    return _TYPES


def _raise_mpi_error(exc: Exception, what: str) -> None:
    """Re-raise an MPI error, as CollectiveMismatchError when it is a size mismatch."""
    if exc.Get_error_class() == MPI.ERR_TRUNCATE:  # type: ignore[attr-defined]
        first = str(exc).splitlines()[0] if str(exc) else "message truncated"
        raise CollectiveMismatchError(
            f"{what}: a message was larger than its receive buffer ({first}); every rank must "
            "pass matching buffer sizes (run with AXONDIST_DEBUG=1 to see which ranks and "
            "which argument disagree)") from exc
    raise exc


def _unsupported(what: str, dtype: np.dtype, op: ReduceOp | None = None) -> UnsupportedDTypeError:
    if op is not None and dtype in _types().transfer:
        return UnsupportedDTypeError(f"{what}: {op.name} is not defined for dtype {dtype}")
    names = ", ".join(str(d) for d in _array.SUPPORTED_DTYPES)
    return UnsupportedDTypeError(f"{what}: dtype {dtype} is not supported; use one of {names}")


def _synchronize_device(*bufs: Any) -> None:
    """Finish pending GPU work on CuPy buffers before MPI reads or writes them directly."""
    for b in bufs:
        if b is not None and _array.is_cupy(b):
            _array.namespace(b).cuda.get_current_stream().synchronize()
            return


# --- Work handles --------------------------------------------------------------------------

class MPIWork(Work):
    """Handle of non-blocking MPI requests; ``wait()`` also runs the finishing
    step (AVERAGE division) once, then returns the result."""

    __slots__ = ("_requests", "_finish", "_result", "_done", "_what")

    def __init__(self, requests: list[Any], finish: Callable[[], None] | None, result: Any,
                 what: str) -> None:
        self._requests = requests
        self._finish = finish
        self._result = result
        self._done = False
        self._what = what

    def _complete(self) -> None:
        self._done = True
        self._requests = []
        if self._finish is not None:
            self._finish()

    def wait(self, timeout: float | None = None) -> Any:
        if self._done:
            return self._result
        try:
            if timeout is None:
                MPI.Request.Waitall(self._requests)
            else:
                deadline = time.monotonic() + timeout
                while not MPI.Request.Testall(self._requests):
                    if time.monotonic() >= deadline:
                        raise CollectiveTimeoutError(
                            f"{self._what}: not finished within {timeout:g} s; MPI cannot cancel "
                            "it, so call wait() again (a rank that never joins hangs it)")
                    time.sleep(1e-4)
        except MPI.Exception as exc:
            _raise_mpi_error(exc, self._what)
        self._complete()
        return self._result

    def is_completed(self) -> bool:
        if self._done:
            return True
        try:
            if not MPI.Request.Testall(self._requests):
                return False
        except MPI.Exception as exc:
            _raise_mpi_error(exc, self._what)
        self._complete()
        return True


class _StagedWork(Work):
    """A Work on host copies; ``wait()`` copies the results back to the device once."""

    __slots__ = ("_inner", "_finish", "_result", "_done")

    def __init__(self, inner: Work, finish: Callable[[], None], result: Any) -> None:
        self._inner, self._finish, self._result, self._done = inner, finish, result, False

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._inner.wait(timeout)
            self._finish()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()


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
        self._types = _types()
        self._debug = self.options.debug
        self._chunk = self.options.chunk_bytes or sys.maxsize
        self._stage_always = self.options.host_staging == "always"
        self._cuda_aware: bool | None = True if self.options.host_staging == "never" else None
        self._tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        self._node = self._compute_node_info()

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
    def _agree(self, op_name: str, signature: Signature) -> None:
        """Under debug: raise the same CollectiveMismatchError on every rank on disagreement."""
        sigs = self._comm.allgather((("op", op_name),) + tuple(signature))
        error = compare_signatures(op_name, sigs)
        if error is not None:
            raise error

    def _check_rank(self, r: int, what: str, arg: str) -> None:
        if not 0 <= r < self.world_size:
            raise RankError(f"{what}: {arg}={r} is outside the group of {self.world_size} ranks "
                            f"(valid: 0..{self.world_size - 1})")

    def _check_counts(self, what: str, counts: Sequence[int],
                      sizes: Sequence[tuple[str, Any, int]]) -> list[int]:
        """``counts`` as ints, checked against the group size and each ``(name, buffer,
        expected elements)`` of ``sizes`` (free, local checks; a None buffer is skipped)."""
        counts = [int(c) for c in counts]
        if len(counts) != self.world_size:
            raise CollectiveMismatchError(f"{what}: counts lists {len(counts)} ranks, the group "
                                          f"has {self.world_size}")
        for arg, buf, expected in sizes:
            if buf is not None and buf.size != expected:
                raise InvalidBufferError(
                    f"{what}: {arg} has {buf.size} elements but counts={counts} asks for "
                    f"{expected} on rank {self.rank}")
        return counts

    def _needs_host(self, *bufs: Any) -> bool:
        """True when these buffers go through host copies; else makes device ones ready."""
        if self._stage_always:
            return True
        if not any(b is not None and _array.is_cupy(b) for b in bufs):
            return False
        if not self.cuda_aware:
            return True
        _synchronize_device(*bufs)
        return False

    def _via_host(self, call: Callable[..., Work], args: Sequence[Any], reads: Sequence[int],
                  writes: Sequence[int], out: int, async_op: bool) -> Work:
        """Run ``call`` on host copies of ``args`` (values copied for ``reads``), then copy
        ``writes`` back (in ``wait()`` when async); the result is ``args[out]``."""
        hosts = [None if a is None else host_copy(a) if i in reads else np.empty(a.shape, a.dtype)
                 for i, a in enumerate(args)]
        work = call(*hosts)

        def finish() -> None:
            for i in writes:
                if args[i] is not None:
                    copy_back(args[i], hosts[i])

        if not async_op:
            work.wait()
            finish()
            return CompletedWork(args[out])
        return _StagedWork(work, finish, args[out])

    def _divide(self, buf: Any) -> None:
        _array.namespace(buf).divide(buf, self.world_size, out=buf, casting="unsafe")

    def _transfer(self, buf: Any, what: str) -> tuple[Any, Any]:
        try:
            view, mtype = self._types.transfer[buf.dtype]
        except KeyError:
            raise _unsupported(what, buf.dtype) from None
        return (buf if view is None else buf.view(view)), mtype

    def _reduction(self, buf: Any, op: ReduceOp, what: str) -> tuple[Any, Any, Any, bool]:
        try:
            view, mtype, mop, average = self._types.reduce[buf.dtype, op]
        except KeyError:
            raise _unsupported(what, buf.dtype, op) from None
        return (buf if view is None else buf.view(view)), mtype, mop, average

    # --- collectives -----------------------------------------------------------------------
    def all_reduce(self, buf: Any, op: ReduceOp, *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        if (type(buf) is not np.ndarray or self._stage_always) and self._needs_host(buf):
            return self._via_host(lambda h: self._all_reduce(h, op, signature, async_op),
                                  [buf], (0,), (0,), 0, async_op)
        return self._all_reduce(buf, op, signature, async_op)

    def _all_reduce(self, buf: Any, op: ReduceOp, signature: Signature, async_op: bool) -> Work:
        if self._debug:
            self._agree("all_reduce", signature + (("reduce_op", op.name),))
        data, mtype, mop, average = self._reduction(buf, op, "all_reduce")
        comm = self._comm
        try:
            if data.nbytes <= self._chunk:
                if not async_op:
                    comm.Allreduce(_IN_PLACE, [data, mtype], mop)
                    if average:
                        self._divide(buf)
                    return CompletedWork(buf)
                requests = [comm.Iallreduce(_IN_PLACE, [data, mtype], mop)]
            else:
                flat = data.reshape(-1)
                pieces = [flat[lo:hi] for lo, hi in
                          piece_bounds(flat.size, flat.itemsize, self._chunk)]
                if not async_op:
                    for piece in pieces:
                        comm.Allreduce(_IN_PLACE, [piece, mtype], mop)
                    if average:
                        self._divide(buf)
                    return CompletedWork(buf)
                requests = [comm.Iallreduce(_IN_PLACE, [p, mtype], mop) for p in pieces]
        except MPI.Exception as exc:
            _raise_mpi_error(exc, "all_reduce")
        return MPIWork(requests, (lambda: self._divide(buf)) if average else None, buf,
                       "all_reduce")

    def broadcast(self, buf: Any, root: int, *, signature: Signature = (),
                  async_op: bool = False) -> Work:
        self._check_rank(root, "broadcast", "root")
        if (type(buf) is not np.ndarray or self._stage_always) and self._needs_host(buf):
            return self._via_host(lambda h: self._broadcast(h, root, signature, async_op),
                                  [buf], (0,) if self.rank == root else (), (0,), 0, async_op)
        return self._broadcast(buf, root, signature, async_op)

    def _broadcast(self, buf: Any, root: int, signature: Signature, async_op: bool) -> Work:
        if self._debug:
            self._agree("broadcast", signature + (("root", root),))
        data, mtype = self._transfer(buf, "broadcast")
        comm = self._comm
        try:
            if data.nbytes <= self._chunk:
                if not async_op:
                    comm.Bcast([data, mtype], root)
                    return CompletedWork(buf)
                requests = [comm.Ibcast([data, mtype], root)]
            else:
                flat = data.reshape(-1)
                pieces = [flat[lo:hi] for lo, hi in
                          piece_bounds(flat.size, flat.itemsize, self._chunk)]
                if not async_op:
                    for piece in pieces:
                        comm.Bcast([piece, mtype], root)
                    return CompletedWork(buf)
                requests = [comm.Ibcast([p, mtype], root) for p in pieces]
        except MPI.Exception as exc:
            _raise_mpi_error(exc, "broadcast")
        return MPIWork(requests, None, buf, "broadcast")

    def all_gather(self, send: Any, recv: Any, counts: Sequence[int], *,
                   signature: Signature = (), async_op: bool = False) -> Work:
        counts = self._check_counts("all_gather", counts, ())
        self._check_counts("all_gather", counts,
                           (("send", send, counts[self.rank]), ("recv", recv, sum(counts))))
        if self._needs_host(send, recv):
            return self._via_host(lambda s, r: self._all_gather(s, r, counts, signature, async_op),
                                  [send, recv], (0,), (1,), 1, async_op)
        return self._all_gather(send, recv, counts, signature, async_op)

    def _all_gather(self, send: Any, recv: Any, counts: list[int], signature: Signature,
                    async_op: bool) -> Work:
        if self._debug:
            self._agree("all_gather", signature + (("counts", tuple(counts)),))
        s, mtype = self._transfer(send, "all_gather")
        r, _ = self._transfer(recv, "all_gather")
        spec = [r, counts, displacements(counts), mtype]
        try:
            if not async_op:
                self._comm.Allgatherv([s, mtype], spec)
                return CompletedWork(recv)
            request = self._comm.Iallgatherv([s, mtype], spec)
        except MPI.Exception as exc:
            _raise_mpi_error(exc, "all_gather")
        return MPIWork([request], None, recv, "all_gather")

    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: ReduceOp, *,
                       signature: Signature = (), async_op: bool = False) -> Work:
        counts = self._check_counts("reduce_scatter", counts, ())
        self._check_counts("reduce_scatter", counts,
                           (("send", send, sum(counts)), ("recv", recv, counts[self.rank])))
        if self._needs_host(send, recv):
            return self._via_host(
                lambda s, r: self._reduce_scatter(s, r, counts, op, signature, async_op),
                [send, recv], (0,), (1,), 1, async_op)
        return self._reduce_scatter(send, recv, counts, op, signature, async_op)

    def _reduce_scatter(self, send: Any, recv: Any, counts: list[int], op: ReduceOp,
                        signature: Signature, async_op: bool) -> Work:
        if self._debug:
            self._agree("reduce_scatter",
                        signature + (("counts", tuple(counts)), ("reduce_op", op.name)))
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
            _raise_mpi_error(exc, "reduce_scatter")
        return MPIWork([request], (lambda: self._divide(recv)) if average else None, recv,
                       "reduce_scatter")

    def gather(self, send: Any, recv: Any | None, counts: Sequence[int], root: int, *,
               signature: Signature = (), async_op: bool = False) -> Work:
        self._check_rank(root, "gather", "root")
        counts = self._check_counts("gather", counts, ())
        if self.rank != root:
            recv = None
        elif recv is None:
            raise InvalidBufferError(f"gather: the root (rank {root}) must pass a recv buffer")
        self._check_counts("gather", counts,
                           (("send", send, counts[self.rank]), ("recv", recv, sum(counts))))
        if self._needs_host(send, recv):
            return self._via_host(
                lambda s, r: self._gather(s, r, counts, root, signature, async_op),
                [send, recv], (0,), (1,), 1, async_op)
        return self._gather(send, recv, counts, root, signature, async_op)

    def _gather(self, send: Any, recv: Any | None, counts: list[int], root: int,
                signature: Signature, async_op: bool) -> Work:
        if self._debug:
            self._agree("gather", signature + (("root", root), ("counts", tuple(counts))))
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
            _raise_mpi_error(exc, "gather")
        return MPIWork([request], None, recv, "gather")

    def scatter(self, send: Any | None, recv: Any, counts: Sequence[int], root: int, *,
                signature: Signature = (), async_op: bool = False) -> Work:
        self._check_rank(root, "scatter", "root")
        counts = self._check_counts("scatter", counts, ())
        if self.rank != root:
            send = None
        elif send is None:
            raise InvalidBufferError(f"scatter: the root (rank {root}) must pass a send buffer")
        self._check_counts("scatter", counts,
                           (("send", send, sum(counts)), ("recv", recv, counts[self.rank])))
        if self._needs_host(send, recv):
            return self._via_host(
                lambda s, r: self._scatter(s, r, counts, root, signature, async_op),
                [send, recv], (0,), (1,), 1, async_op)
        return self._scatter(send, recv, counts, root, signature, async_op)

    def _scatter(self, send: Any | None, recv: Any, counts: list[int], root: int,
                 signature: Signature, async_op: bool) -> Work:
        if self._debug:
            self._agree("scatter", signature + (("root", root), ("counts", tuple(counts))))
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
            _raise_mpi_error(exc, "scatter")
        return MPIWork([request], None, recv, "scatter")

    def barrier(self) -> None:
        if self._debug:
            self._agree("barrier", ())
        self._comm.Barrier()

    # --- point to point (arrays as bytes; headers in their own tag space) ------------------
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        self._check_rank(dst, "send", "dst")
        data_tag, _ = split_tag(tag, self._tag_ub)
        if self._needs_host(buf):
            buf = host_copy(buf)
        try:
            self._comm.Send(buf.reshape(-1).view(_BYTES), dst, data_tag)
        except MPI.Exception as exc:
            _raise_mpi_error(exc, "send")

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        self._check_rank(src, "recv", "src")
        data_tag, _ = split_tag(tag, self._tag_ub)
        target = np.empty(buf.shape, buf.dtype) if self._needs_host(buf) else buf
        status = MPI.Status()
        what = f"recv from rank {src} (tag {tag}) into {_array.describe(buf)}"
        try:
            self._comm.Recv(target.reshape(-1).view(_BYTES), src, data_tag, status)
        except MPI.Exception as exc:
            _raise_mpi_error(exc, what)
        got = status.Get_count(MPI.BYTE)
        if got != target.nbytes:
            raise CollectiveMismatchError(
                f"{what}: the message has {got} bytes but the buffer holds {target.nbytes}; "
                "send and recv must use the same shape and dtype")
        if target is not buf:
            copy_back(buf, target)

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        self._check_rank(dst, "send_object", "dst")
        _, header_tag = split_tag(tag, self._tag_ub)
        self._comm.send(obj, dst, header_tag)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        self._check_rank(src, "recv_object", "src")
        _, header_tag = split_tag(tag, self._tag_ub)
        return self._comm.recv(None, src, header_tag)

    # --- small objects -----------------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        if self._debug:
            self._agree("allgather_object", ())
        return self._comm.allgather(obj)

    def broadcast_object(self, obj: Any, root: int) -> Any:
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
        comm, self._comm = self._comm, None
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
