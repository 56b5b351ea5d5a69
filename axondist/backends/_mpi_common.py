"""What the MPI backend needs besides the backend class itself.

Loading mpi4py (which initializes MPI) with a clear error when it is
missing; the table from each supported dtype to its MPI datatype and
reduction ops (float16/bfloat16 through user-defined ops, see
:mod:`axondist.backends.mpi`); the backend's options; the Work handles of
non-blocking calls; and pure helpers (piece sizes, displacements, tags,
host staging) that are tested without MPI.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, NoReturn

import numpy as np

from .. import _array
from .._validate import positive_number
from ..errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    UnsupportedDTypeError,
)
from ..ops import ReduceOp
from .base import Work, checks_enabled, debug_enabled

#: mpi4py's ``MPI`` module once :func:`load_mpi` ran (importing it initializes MPI).
MPI: Any = None

# dtype name -> mpi4py datatype attribute; float16/bfloat16 use TypeTable.half.
_NATIVE_TYPES = {
    "float32": "FLOAT", "float64": "DOUBLE", "int8": "INT8_T", "uint8": "UINT8_T",
    "int32": "INT32_T", "int64": "INT64_T", "bool": "C_BOOL",
    "complex64": "C_FLOAT_COMPLEX", "complex128": "C_DOUBLE_COMPLEX",
}
HALF_VIEW = np.dtype(np.uint16)
BYTES = np.dtype(np.uint8)
_STAGING_MODES = ("auto", "always", "never")


#: The pieces of big all-reduces and broadcasts in a group on one node. Measured on two
#: ranks against one raw ``Allreduce`` of the whole (sum; mean alike): 2 MiB pieces took
#: 0.90x at 4 MiB, 0.73x at 16 MiB and 0.43x at 64 MiB; 16 MiB pieces 1.06x, 1.02x and
#: 0.64x; 1 MiB pieces were no faster than 2 MiB ones.
NODE_CHUNK_BYTES = 2 << 20


def chunk_for(option: int | None, nodes: int) -> int:
    """Bytes per piece of big messages in a group spanning ``nodes`` nodes (0: no pieces)
    for :attr:`MPIOptions.chunk_bytes` ``option``."""
    if option is not None:
        return option
    return NODE_CHUNK_BYTES if nodes <= 1 else 0


@dataclass(frozen=True)
class MPIOptions:
    """How the MPI backend moves data (``create_world_backend(**fields)``)."""

    chunk_bytes: int | None = None
    """All-reduces and broadcasts bigger than this run in pieces of at most
    this many bytes; 0 never splits. None: :data:`NODE_CHUNK_BYTES` in a group
    on one node (pieces avoid MPICH's page faults on big shared-memory
    messages), no pieces in a group that spans nodes (each blocking piece costs
    the network's round trips). Env: ``AXONDIST_MPI_CHUNK_BYTES``."""

    piece_bytes: int | None = None
    """Piece size of a blocking weighted sum (``scaled_sum_blocking``, DDP's buckets): each
    piece is scaled just before its all-reduce, and each is one blocking round trip. None:
    ``chunk_bytes``. Small pieces (``0.5`` MiB: still in cache when MPI copies them) save
    most of the scaling pass only on a node whose cores nothing else uses and where a
    round trip costs microseconds; elsewhere every piece waits for the slowest rank (see
    docs/backends.md). Env: ``AXONDIST_PIECE_MB`` (MiB, fractions allowed)."""

    host_staging: str = "auto"
    """How CuPy arrays reach MPI: ``"auto"`` (directly when MPI is CUDA-aware,
    else through host copies), ``"never"`` (always directly: you know MPI is
    CUDA-aware), ``"always"`` (every buffer, NumPy included, goes through a
    host copy: tests that path without a GPU). Env: ``AXONDIST_MPI_HOST_STAGING``."""

    debug: bool = False
    """Compare every collective's full arguments across ranks with a pickled
    allgather per call (slow; names every argument). Env: ``AXONDIST_DEBUG=1``."""

    checks: bool = True
    """Check before every collective, with one exchange of 24-byte headers, that all
    ranks call the same collective with the same arguments. Turning it off
    (``AXONDIST_CHECKS=0``) is unsafe: a mismatch then hangs, truncates or
    returns wrong numbers. Env: ``AXONDIST_CHECKS``."""

    def __post_init__(self) -> None:
        if self.chunk_bytes is not None and (not isinstance(self.chunk_bytes, int)
                                             or self.chunk_bytes < 0):
            raise ValueError(
                f"MPIOptions: chunk_bytes must be an int >= 0, got {self.chunk_bytes!r}")
        if self.piece_bytes is not None and (
                isinstance(self.piece_bytes, bool) or not isinstance(self.piece_bytes, int)
                or self.piece_bytes < 1):
            raise ValueError(f"MPIOptions: piece_bytes must be an int >= 1 or None (the size "
                             f"picked by the layout), got {self.piece_bytes!r}")
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
        opts = cls(debug=debug_enabled(), checks=checks_enabled())
        if "AXONDIST_MPI_CHUNK_BYTES" in env:
            opts = replace(opts, chunk_bytes=int(env["AXONDIST_MPI_CHUNK_BYTES"]))
        if env.get("AXONDIST_PIECE_MB"):
            opts = replace(opts, piece_bytes=piece_bytes_from_env(env["AXONDIST_PIECE_MB"]))
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


def piece_bytes_from_env(text: str) -> int:
    """Bytes per piece from ``AXONDIST_PIECE_MB`` (MiB, fractions allowed), at least 1.

    Raises:
        ValueError: not a number, or not a finite number > 0.
    """
    try:
        mib = float(text)
    except ValueError:
        raise ValueError(f"mpi backend: AXONDIST_PIECE_MB={text!r} is not a number; set it "
                         "to a size in MiB > 0 (0.5, 16) or unset it for the size picked by "
                         "the layout") from None
    return max(1, round(positive_number(mib, "mpi backend", "AXONDIST_PIECE_MB") * 2**20))


def piece_size(option: int | None, chunk_bytes: int) -> int:
    """Bytes per piece of a weighted all-reduce: ``option``, at most ``chunk_bytes`` (0: no
    limit); ``chunk_bytes`` when ``option`` is None. Every piece is a blocking round trip
    (a 95 MiB model in 512 KiB pieces makes ~190 of them per step, in 16 MiB ones 6)."""
    limit = chunk_bytes or sys.maxsize
    return limit if option is None else min(option, limit)


#: Blocking AVERAGEs above this size run as a reduce-scatter, a scaled move of this rank's
#: block and an all-gather (:meth:`MPIBackend._mean_in_blocks`); smaller ones as one
#: all-reduce and a pass over the (cached) result, one collective instead of two.
MEAN_IN_BLOCKS_BYTES = 512 << 10


def block_counts(numel: int, n: int) -> list[int]:
    """Elements of each of ``n`` near-equal blocks of ``numel`` (the first ones one longer),
    so that every block after the first starts at or after the end of the first."""
    base, extra = divmod(numel, n)
    return [base + 1 if k < extra else base for k in range(n)]


def mean_scaling(n: int) -> tuple[str, float]:
    """How AVERAGE turns a sum of ``n`` values into their mean: ``("multiply", 1 / n)``
    when ``n`` is a power of two (1/n is exact, so the product equals the quotient bit for
    bit, and a multiplication runs ~3x faster than a division), else ``("divide", n)``."""
    if n & (n - 1) == 0:
        return "multiply", 1.0 / n
    return "divide", float(n)


def displacements(counts: Sequence[int]) -> list[int]:
    """Start offset of each rank's block for ``counts`` (the v-collectives' displs)."""
    displs, total = [], 0
    for c in counts:
        displs.append(total)
        total += c
    return displs


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


def numpy_reducer(dtype: np.dtype, ufunc: Callable[..., Any]) -> Callable[[Any, Any, Any], None]:
    """An MPI user-op callback combining two buffers of ``dtype`` with ``ufunc``
    (MPI's rule: ``inout = in (op) inout``, in NumPy, in ``dtype`` itself)."""
    def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        acc = np.frombuffer(inoutbuf, dtype=dtype)
        with np.errstate(invalid="ignore"):  # minimum/maximum propagate NaN on purpose
            ufunc(np.frombuffer(inbuf, dtype=dtype), acc, out=acc)
    return reduce


def host_copy(x: Any) -> np.ndarray:
    """A host array holding ``x``'s values that communication may overwrite (page-locked
    for a CuPy ``x``: see :func:`axondist._array.host_staging_buffer`)."""
    return _array.copy_to_host(x, _array.host_staging_buffer(x))


def copy_back(dst: Any, host: np.ndarray) -> None:
    """Write host values into ``dst`` (a NumPy or CuPy array) in place."""
    _array.copy_from_host(dst, host)


# --- MPI loading, types, errors ------------------------------------------------------------

def load_mpi() -> Any:
    """mpi4py's MPI module, imported once (which initializes MPI); a clear error when missing."""
    global MPI
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
        MPI = mpi
    return MPI


class TypeTable:
    """MPI datatypes and ops per dtype, built once per process.

    ``transfer[dtype] = (view, datatype)``: send ``buf.view(view)`` (``buf``
    when view is None) as ``datatype``. ``reduce[op][dtype] = (view,
    datatype, mpi_op, average)``; a missing key means the pair is unsupported.
    Keyed op first, then dtype: two plain dict lookups are the cheapest on
    the all-reduce hot path (a (dtype, op) tuple key costs more to hash).
    """

    def __init__(self) -> None:
        self.half = MPI.BYTE.Create_contiguous(2).Commit()
        self.transfer: dict[np.dtype, tuple[np.dtype | None, Any]] = {}
        self.reduce: dict[ReduceOp, dict[np.dtype, tuple[np.dtype | None, Any, Any, bool]]] = {
            op: {} for op in ReduceOp}
        self._user_ops: list[Any] = []  # keep the callbacks' Op objects alive
        for dtype in _array.SUPPORTED_DTYPES:
            native = _NATIVE_TYPES.get(dtype.name)
            if native is not None:
                self.transfer[dtype] = (None, getattr(MPI, native))
                self._add_native_reductions(dtype, getattr(MPI, native))
            else:
                self.transfer[dtype] = (HALF_VIEW, self.half)
                self._add_half_reductions(dtype)

    def _add_native_reductions(self, dtype: np.dtype, mtype: Any) -> None:
        if dtype == np.bool_:
            ops = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR,
                   ReduceOp.PRODUCT: MPI.LAND, ReduceOp.MIN: MPI.LAND}
        else:
            ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD}
            if dtype.kind in "iu":
                ops.update({ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX})
            elif dtype.kind == "f":
                # MPI's MIN/MAX keep or drop a NaN depending on which rank holds it;
                # NumPy's minimum/maximum always propagate it (as the mock world does).
                for op, ufunc in ((ReduceOp.MIN, np.minimum), (ReduceOp.MAX, np.maximum)):
                    user_op = MPI.Op.Create(numpy_reducer(dtype, ufunc), commute=True)
                    self._user_ops.append(user_op)
                    ops[op] = user_op
            if dtype.kind in "fc":
                ops[ReduceOp.AVERAGE] = MPI.SUM
        for op, mop in ops.items():
            self.reduce[op][dtype] = (None, mtype, mop, op is ReduceOp.AVERAGE)

    def _add_half_reductions(self, dtype: np.dtype) -> None:
        ufuncs = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply,
                  ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}
        mops = {}
        for op, ufunc in ufuncs.items():
            mops[op] = MPI.Op.Create(numpy_reducer(dtype, ufunc), commute=True)
            self._user_ops.append(mops[op])
        mops[ReduceOp.AVERAGE] = mops[ReduceOp.SUM]
        for op, mop in mops.items():
            self.reduce[op][dtype] = (HALF_VIEW, self.half, mop, op is ReduceOp.AVERAGE)


_TYPES: TypeTable | None = None


def type_table() -> TypeTable:
    """The process-wide table (loads MPI if needed)."""
    global _TYPES
    if _TYPES is None:
        load_mpi()
        _TYPES = TypeTable()
    return _TYPES


def raise_mpi_error(exc: Exception, what: str) -> NoReturn:
    """Re-raise an MPI error, as CollectiveMismatchError when it is a size mismatch."""
    if exc.Get_error_class() == MPI.ERR_TRUNCATE:  # type: ignore[attr-defined]
        first = str(exc).splitlines()[0] if str(exc) else "message truncated"
        raise CollectiveMismatchError(
            f"{what}: a message was larger than its receive buffer ({first}); every rank must "
            "pass matching buffer sizes (run with AXONDIST_DEBUG=1 to see which ranks and "
            "which argument disagree)") from exc
    raise exc


def unsupported(what: str, dtype: np.dtype, op: ReduceOp | None = None) -> UnsupportedDTypeError:
    """The error for a dtype (or dtype and op) that has no entry in the type table."""
    if op is not None and dtype in type_table().transfer:
        return UnsupportedDTypeError(f"{what}: {op.name} is not defined for dtype {dtype}")
    names = ", ".join(str(d) for d in _array.SUPPORTED_DTYPES)
    return UnsupportedDTypeError(f"{what}: dtype {dtype} is not supported; use one of {names}")


def synchronize_device(*bufs: Any) -> None:
    """Finish pending GPU work on CuPy buffers before MPI reads or writes them directly."""
    for b in bufs:
        if b is not None and _array.is_cupy(b):
            _array.namespace(b).cuda.get_current_stream().synchronize()
            return


# --- Work handles --------------------------------------------------------------------------

class MPIWork(Work):
    """Handle of non-blocking MPI requests; ``wait()`` also runs the finishing
    step (AVERAGE division) once, then returns the result."""

    __slots__ = ("_requests", "_finish", "_result", "_done", "_what", "_track", "_check")

    def __init__(self, requests: list[Any], finish: Callable[[], None] | None, result: Any,
                 what: str) -> None:
        self._requests = requests
        self._finish = finish
        self._result = result
        self._done = False
        self._what = what
        self._track: tuple[Any, str, int] | None = None
        self._check: tuple[Any, Callable[[], None]] | None = None

    def track(self, recorder: Any, group: str, seq: int) -> None:
        """Record waits on this Work in ``recorder`` as call ``seq`` of ``group``."""
        self._track = (recorder, group, seq)

    def checked_by(self, request: Any, verify: Callable[[], None]) -> None:
        """Complete ``request`` (the cross-rank argument check issued just before this
        call) first, then ``verify()`` it: a mismatch raises before the data is waited for."""
        self._check = (request, verify)

    def _settle_check(self, deadline: float | None) -> None:
        if self._check is None:
            return
        request, verify = self._check
        if deadline is None:
            request.Wait()
        else:
            while not request.Test():
                if time.monotonic() >= deadline:
                    raise CollectiveTimeoutError(
                        f"{self._what}: not started by every rank within the timeout; MPI "
                        "cannot cancel it, so call wait() again (a rank that never joins "
                        "hangs it)")
                time.sleep(1e-4)
        self._check = None
        verify()

    def _complete(self) -> None:
        self._done = True
        self._requests = []
        if self._finish is not None:
            self._finish()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the requests, run the finishing step once, return the result.

        Raises:
            CollectiveTimeoutError: ``timeout`` seconds passed first; MPI cannot
                cancel the requests, so call ``wait`` again.
            CollectiveMismatchError: a message was larger than its receive
                buffer (other MPI errors are raised as they are).
        """
        if self._done:
            return self._result
        slot = None
        if self._track is not None:
            recorder, group, seq = self._track
            slot = recorder.begin(group, seq, f"wait {self._what}", None)
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._settle_check(deadline)
            if deadline is None:
                MPI.Request.Waitall(self._requests)
            else:
                while not MPI.Request.Testall(self._requests):
                    if time.monotonic() >= deadline:
                        raise CollectiveTimeoutError(
                            f"{self._what}: not finished within {timeout:g} s; MPI cannot cancel "
                            "it, so call wait() again (a rank that never joins hangs it)")
                    time.sleep(1e-4)
        except MPI.Exception as exc:
            raise_mpi_error(exc, self._what)
        finally:
            if slot is not None:
                self._track[0].end(slot)  # type: ignore[index]
        self._complete()
        return self._result

    def is_completed(self) -> bool:
        """Test the requests without blocking; when all are done, also run the finishing step."""
        if self._done:
            return True
        try:
            if self._check is not None:
                if not self._check[0].Test():
                    return False
                self._settle_check(None)
            if not MPI.Request.Testall(self._requests):
                return False
        except MPI.Exception as exc:
            raise_mpi_error(exc, self._what)
        self._complete()
        return True


class StagedWork(Work):
    """A Work on host copies; ``wait()`` copies the results back to the device once."""

    __slots__ = ("_inner", "_finish", "_result", "_done")

    def __init__(self, inner: Work, finish: Callable[[], None], result: Any) -> None:
        self._inner, self._finish, self._result, self._done = inner, finish, result, False

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the host operation, then copy its results to the device (once); the result."""
        if not self._done:
            self._inner.wait(timeout)
            self._finish()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        """True once the host operation finished (the copy back happens in :meth:`wait`)."""
        return self._done or self._inner.is_completed()
