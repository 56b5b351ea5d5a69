"""What the MPI backend moves data with: mpi4py loaded on first use (with a clear error
when it is missing), the table from each dtype to its MPI datatype and reduction ops
(float16/bfloat16 through user-defined ops), the backend's options, MPI errors turned into
axondist's, the Work of non-blocking requests, and page-locked host buffers for CuPy
arrays on an MPI that is not CUDA-aware.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, NoReturn

import numpy as np

from ... import _array
from ..._validate import positive_number
from ...errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    UnsupportedDTypeError,
)
from ...ops import ReduceOp
from .. import settings
from ..base import Work, checks_enabled, debug_enabled
from . import single_copy

# dtype name -> mpi4py datatype attribute; float16/bfloat16 travel as 2-byte units.
_NATIVE_TYPES = {
    "float32": "FLOAT", "float64": "DOUBLE", "int8": "INT8_T", "uint8": "UINT8_T",
    "int32": "INT32_T", "int64": "INT64_T", "bool": "C_BOOL",
    "complex64": "C_FLOAT_COMPLEX", "complex128": "C_DOUBLE_COMPLEX",
}
HALF_VIEW = np.dtype(np.uint16)
BYTES = np.dtype(np.uint8)
_STAGING_MODES = ("auto", "always", "never")


def load_mpi() -> Any:
    """mpi4py's MPI module (importing it initializes MPI, with MPICH's single-copy path on
    where the host allows it: :mod:`.single_copy`); a clear error when missing."""
    single_copy.before_mpi_starts()
    try:
        return importlib.import_module("mpi4py.MPI")
    except ImportError as exc:
        raise BackendUnavailableError(
            "the mpi backend needs mpi4py and an MPI library: pip install '.[mpi]' from the "
            f"axondist checkout (mpi4py and the mpich wheel); import failed with: {exc}") from exc
    except RuntimeError as exc:  # mpi4py present but no loadable MPI library
        raise BackendUnavailableError(
            f"the mpi backend could not start MPI ({exc}); pip install '.[mpi]' for a bundled "
            "MPICH, or check your MPI installation") from exc


@dataclass(frozen=True)
class MPIOptions:
    """How the MPI backend moves data (``create_world_backend(**fields)``)."""

    chunk_bytes: int | None = None
    """All-reduces and broadcasts bigger than this run in pieces of at most this many
    bytes; 0 never splits. None: the layout's choice (see
    :mod:`axondist.backends.mpi.choose`). Env: ``AXONDIST_MPI_CHUNK_BYTES``."""

    piece_bytes: int | None = None
    """Piece size of persistent all-reduces (DDP's overlapped buckets). None: the
    layout's choice. Env: ``AXONDIST_PIECE_MB`` (MiB, fractions allowed)."""

    host_staging: str = "auto"
    """How CuPy arrays reach MPI: ``"auto"`` (directly when MPI is CUDA-aware, else
    through page-locked host copies), ``"never"`` (always directly: you know MPI is
    CUDA-aware), ``"always"`` (every buffer, NumPy included, goes through a host copy:
    tests that path without a GPU). Env: ``AXONDIST_MPI_HOST_STAGING``."""

    shared_buffers: bool = True
    """A group of two ranks of one host hands out buffers both ranks map
    (``MPIBackend.shared_buffer``: DDP's buckets, FSDP's gradient packing), summed or
    reduce-scattered with no MPI transfer, where the host allows it. Env:
    ``AXONDIST_MPI_SHARED_BUFFERS``."""

    debug: bool = False
    """Compare every collective's full arguments across ranks (a pickled all-gather per
    call: slow, names every argument). Env: ``AXONDIST_DEBUG=1``."""

    checks: bool = True
    """Check before every collective that all ranks call the same collective with the
    same arguments (one small all-reduce of a hash). Turning it off
    (``AXONDIST_CHECKS=0``) is unsafe: a mismatch then hangs, truncates or returns wrong
    numbers. Env: ``AXONDIST_CHECKS``."""

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
        opts = cls(debug=debug_enabled(), checks=checks_enabled(),
                   host_staging=settings.read("AXONDIST_MPI_HOST_STAGING"),
                   shared_buffers=settings.read("AXONDIST_MPI_SHARED_BUFFERS"))
        chunk_bytes = settings.read("AXONDIST_MPI_CHUNK_BYTES")
        if chunk_bytes is not None:
            opts = replace(opts, chunk_bytes=chunk_bytes)
        piece_mb = settings.read("AXONDIST_PIECE_MB")
        if piece_mb is not None:
            opts = replace(opts, piece_bytes=max(1, round(piece_mb * 2**20)))
        return replace(opts, **overrides)


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


def piece_bounds(numel: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` element ranges cutting ``numel`` elements into the fewest
    near-equal pieces of at most ``chunk_bytes`` bytes (at least one element each)."""
    per = max(1, chunk_bytes // itemsize)
    pieces = max(1, -(-numel // per))
    return [(k * numel // pieces, (k + 1) * numel // pieces) for k in range(pieces)]


def mean_scaling(n: int) -> tuple[str, float]:
    """How AVERAGE turns a sum of ``n`` values into their mean: ``("multiply", 1 / n)``
    when ``n`` is a power of two (1/n is exact, so the product equals the quotient bit for
    bit, and runs ~3x faster), else ``("divide", n)``."""
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


class TypeTable:
    """MPI datatypes and ops per dtype, made by the world backend and shared by its groups.

    ``transfer[dtype] = (view, datatype)``: send ``buf.view(view)`` (``buf`` when view is
    None) as ``datatype``. ``reduce[op_name][dtype] = (view, datatype, mpi_op, average)``;
    a missing key means the pair is unsupported. Float MIN/MAX are user ops with NumPy's
    NaN propagation (MPI's own keep or drop a NaN depending on which rank holds it).
    bfloat16's entries are made by :meth:`admit`, the first time a call meets one (so a job
    without bfloat16 neither imports ml_dtypes nor holds its four user ops).
    """

    def __init__(self, mpi: Any) -> None:
        self._mpi = mpi
        self.half = mpi.BYTE.Create_contiguous(2).Commit()
        self.transfer: dict[np.dtype, tuple[np.dtype | None, Any]] = {}
        self.reduce: dict[str, dict[np.dtype, tuple[np.dtype | None, Any, Any, bool]]] = {
            op.name: {} for op in ReduceOp}
        self._user_ops: list[Any] = []
        for dtype in _array.SUPPORTED_DTYPE_NAMES[:-1]:  # all but bfloat16
            self._add(np.dtype(dtype))

    def admit(self, dtype: np.dtype) -> None:
        """Make bfloat16's entries if ``dtype`` is bfloat16 and they are not made yet."""
        if dtype not in self.transfer and dtype.name == "bfloat16":
            self._add(dtype)

    def _add(self, dtype: np.dtype) -> None:
        mpi = self._mpi
        native = _NATIVE_TYPES.get(dtype.name)
        if native is not None:
            self.transfer[dtype] = (None, getattr(mpi, native))
            self._add_native(mpi, dtype, getattr(mpi, native))
        else:
            self.transfer[dtype] = (HALF_VIEW, self.half)
            self._add_half(mpi, dtype)

    def _user_op(self, mpi: Any, dtype: np.dtype, ufunc: Any) -> Any:
        try:
            op = mpi.Op.Create(numpy_reducer(dtype, ufunc), commute=True)
        except RuntimeError as exc:  # mpi4py's cap on user-defined ops per process
            raise RuntimeError(
                f"mpi backend: no more user-defined reduction ops ({exc}); each MPIBackend "
                "made without types= holds 12: close() the ones no longer used, or pass "
                "types=world.backend.types to share the world's") from exc
        self._user_ops.append(op)
        return op

    def _add_native(self, mpi: Any, dtype: np.dtype, mtype: Any) -> None:
        if dtype == np.bool_:
            ops = {ReduceOp.SUM: mpi.LOR, ReduceOp.MAX: mpi.LOR,
                   ReduceOp.PRODUCT: mpi.LAND, ReduceOp.MIN: mpi.LAND}
        else:
            ops = {ReduceOp.SUM: mpi.SUM, ReduceOp.PRODUCT: mpi.PROD}
            if dtype.kind in "iu":
                ops.update({ReduceOp.MIN: mpi.MIN, ReduceOp.MAX: mpi.MAX})
            elif dtype.kind == "f":
                ops[ReduceOp.MIN] = self._user_op(mpi, dtype, np.minimum)
                ops[ReduceOp.MAX] = self._user_op(mpi, dtype, np.maximum)
            if dtype.kind in "fc":
                ops[ReduceOp.AVERAGE] = mpi.SUM
        for op, mop in ops.items():
            self.reduce[op.name][dtype] = (None, mtype, mop, op is ReduceOp.AVERAGE)

    def _add_half(self, mpi: Any, dtype: np.dtype) -> None:
        ufuncs = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply,
                  ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}
        for op, ufunc in ufuncs.items():
            self.reduce[op.name][dtype] = (HALF_VIEW, self.half,
                                            self._user_op(mpi, dtype, ufunc), False)
        total = self.reduce[ReduceOp.SUM.name][dtype]
        self.reduce[ReduceOp.AVERAGE.name][dtype] = total[:3] + (True,)

    def free(self) -> None:
        """Free the user ops and the half datatype (MPI must still be initialized)."""
        for op in self._user_ops:
            op.Free()
        self._user_ops = []
        self.half.Free()


def raise_mpi_error(mpi: Any, exc: Exception, what: str) -> NoReturn:
    """Re-raise an MPI error, as CollectiveMismatchError when it is a size mismatch."""
    if exc.Get_error_class() == mpi.ERR_TRUNCATE:  # type: ignore[attr-defined]
        first = str(exc).splitlines()[0] if str(exc) else "message truncated"
        raise CollectiveMismatchError(
            f"{what}: a message was larger than its receive buffer ({first}); every rank must "
            "pass matching buffer sizes (run with AXONDIST_DEBUG=1 to see which ranks and "
            "which argument disagree)") from exc
    raise exc


def unsupported(what: str, dtype: np.dtype, op: str | None = None) -> UnsupportedDTypeError:
    """The error for a dtype (or dtype and op) that has no entry in the type table."""
    if op is not None and _array.is_supported_dtype(dtype):
        return UnsupportedDTypeError(f"{what}: {op} is not defined for dtype {dtype}")
    names = ", ".join(_array.SUPPORTED_DTYPE_NAMES)
    return UnsupportedDTypeError(f"{what}: dtype {dtype} is not supported; use one of {names}")


class HostStaging:
    """Page-locked host buffers for the device arrays of calls that go through the host,
    one per (shape, dtype), kept by the plan that uses them: copies between the GPU and
    page-locked memory run at the bus's speed, and the page-locking happens once."""

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], np.ndarray] = {}

    def buffer(self, like: Any) -> np.ndarray:
        """A host buffer shaped like ``like`` (uninitialized; the same one call after call)."""
        key = (like.shape, like.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = _array.host_staging_buffer(like)
        return buf

    def to_host(self, x: Any) -> np.ndarray:
        """``x``'s values in its host buffer."""
        return _array.copy_to_host(x, self.buffer(x))

    def free(self) -> None:
        """Drop the buffers (the memory pool takes them back)."""
        self._buffers.clear()


def synchronize_device(*bufs: Any) -> None:
    """Finish pending GPU work on CuPy buffers before MPI reads or writes them directly."""
    for b in bufs:
        if b is not None and _array.is_cupy(b):
            _array.namespace(b).cuda.get_current_stream().synchronize()
            return


class MPIWork(Work):
    """Handle of non-blocking MPI requests. ``wait()`` first settles the call's cross-rank
    check (a mismatch raises before the data is waited for), then the requests, then runs
    the finishing step (AVERAGE's division, a copy back to the device) once, and returns
    the result. Waits are recorded in the flight recorder as the call's own."""

    __slots__ = ("_mpi", "_requests", "_finish", "_result", "_done", "_what", "_track",
                 "_check")

    def __init__(self, mpi: Any, requests: list[Any], finish: Callable[[], None] | None,
                 result: Any, what: str, check: tuple[Any, Callable[[], None]] | None = None,
                 track: tuple[Any, str, int] | None = None) -> None:
        self._mpi, self._requests, self._finish, self._result = mpi, requests, finish, result
        self._done, self._what, self._check, self._track = False, what, check, track

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
        """Wait for the check and the requests, finish once, return the result.

        Raises:
            CollectiveTimeoutError: ``timeout`` seconds passed first; MPI cannot
                cancel the requests, so call ``wait`` again.
            CollectiveMismatchError: the ranks' calls differ, or a message was larger
                than its receive buffer (other MPI errors are raised as they are).
        """
        if self._done:
            return self._result
        slot = None
        if self._track is not None:
            recorder, group, seq = self._track
            slot = recorder.begin(group, seq, f"wait {self._what}", None)
        mpi = self._mpi
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._settle_check(deadline)
            if deadline is None:
                mpi.Request.Waitall(self._requests)
            else:
                while not mpi.Request.Testall(self._requests):
                    if time.monotonic() >= deadline:
                        raise CollectiveTimeoutError(
                            f"{self._what}: not finished within {timeout:g} s; MPI cannot cancel "
                            "it, so call wait() again (a rank that never joins hangs it)")
                    time.sleep(1e-4)
        except mpi.Exception as exc:
            raise_mpi_error(mpi, exc, self._what)
        finally:
            if slot is not None:
                self._track[0].end(slot)  # type: ignore[index]
        self._complete()
        return self._result

    def is_completed(self) -> bool:
        """Test the requests without blocking; when all are done, also finish."""
        if self._done:
            return True
        mpi = self._mpi
        try:
            if self._check is not None:
                if not self._check[0].Test():
                    return False
                self._settle_check(None)
            if not mpi.Request.Testall(self._requests):
                return False
        except mpi.Exception as exc:
            raise_mpi_error(mpi, exc, self._what)
        self._complete()
        return True


__all__ = ["BYTES", "HALF_VIEW", "HostStaging", "MPIOptions", "MPIWork", "TypeTable",
           "cuda_aware_from_alloc_kinds", "displacements", "load_mpi", "mean_scaling",
           "numpy_reducer", "piece_bounds", "piece_bytes_from_env", "raise_mpi_error",
           "split_tag", "synchronize_device", "unsupported"]
