"""What the NCCL backend knows without a GPU: tables, plans, ids, errors, checks.

Everything here is pure Python and data, so it is unit-tested on machines
without CuPy or a CUDA device:

* the NCCL enums as plain numbers (:data:`NCCL_DTYPES`, :data:`NCCL_OPS`,
  :data:`NCCL_RESULTS`), which are NCCL's stable ABI (``nccl.h``), the same
  numbers CuPy exposes as ``cupy.cuda.nccl.NCCL_*``;
* :func:`reduce_plan`, how one reduction of one dtype runs on NCCL (complex
  as pairs of floats, ``bool`` as ``uint8`` with OR/AND, AVERAGE as
  ``ncclAvg`` or as a sum followed by a division);
* :class:`NcclUniqueId`, the 128-byte bootstrap token, and the conversions
  CuPy needs (it speaks signed chars);
* :func:`parse_nccl_version`, :func:`node_info_from_hosts`, :func:`select_device`,
  :func:`shared_gpu_message` (ranks that would share a GPU);
* the errors of this backend and :func:`check_device_array`, the test that
  refuses host (NumPy) arrays with a message saying what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import _array
from ...errors import (
    GroupedCallError,
    InvalidBufferError,
    NcclError,
    NotOnDeviceError,
    UnsupportedDTypeError,
)
from ...ops import ReduceOp, check_op_dtype

#: ``ncclDataType_t`` by NumPy dtype name (``nccl.h``; bfloat16 since NCCL 2.10).
NCCL_DTYPES: dict[str, int] = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}

#: ``ncclRedOp_t`` by name (``nccl.h``; ``avg`` since NCCL 2.10).
NCCL_OPS: dict[str, int] = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

#: ``ncclResult_t`` -> (name, what a user can do about it).
NCCL_RESULTS: dict[int, tuple[str, str]] = {
    0: ("ncclSuccess", ""),
    1: ("ncclUnhandledCudaError",
        "a CUDA call inside NCCL failed: check that the buffers live on this backend's "
        "device and that the GPU has free memory; NCCL_DEBUG=INFO shows the CUDA error"),
    2: ("ncclSystemError",
        "a system call failed (network, shared memory or file descriptors): check "
        "NCCL_SOCKET_IFNAME, firewalls and /dev/shm; NCCL_DEBUG=INFO names the call"),
    3: ("ncclInternalError",
        "NCCL hit an internal error; rerun with NCCL_DEBUG=INFO and report it"),
    4: ("ncclInvalidArgument",
        "an argument was invalid (a buffer on another device, a bad rank or count, an "
        "operation or dtype this NCCL version lacks)"),
    5: ("ncclInvalidUsage",
        "NCCL refused how it was used: two ranks of one communicator on the same GPU (at "
        "init: give each rank its own GPU, or use the mpi backend with CuPy arrays), or "
        "ranks whose calls differ (the cross-rank check, on unless AXONDIST_CHECKS=0, names "
        "such a call before NCCL sees it)"),
    6: ("ncclRemoteError",
        "a peer failed or its connection dropped; look at the other ranks' errors first"),
    7: ("ncclInProgress", "a non-blocking NCCL operation is still in progress"),
}

#: The first NCCL with ``ncclAvg`` and ``ncclBfloat16``.
NCCL_AVG_BF16_MIN_VERSION = (2, 10, 0)

#: Bytes in an ``ncclUniqueId``.
UNIQUE_ID_BYTES = 128

#: The dtype every data-movement call uses: bytes move whatever they encode.
NCCL_BYTE = NCCL_DTYPES["uint8"]

_INSTALL_HINT = ("from the axondist checkout, pip install '.[gpu-cuda13]' (cupy-cuda13x) for "
                 "CUDA 13, or pip install '.[gpu]' (cupy-cuda12x) for CUDA 12; the \"CUDA "
                 "Version\" that nvidia-smi prints says which")


# --- errors -------------------------------------------------------------------------

def nccl_error(op: str, exc: BaseException, where: str) -> NcclError:
    """The axondist error for CuPy's ``NcclError`` ``exc`` raised by ``op`` on ``where``."""
    status = getattr(exc, "status", None)
    status = int(status) if isinstance(status, (int, np.integer)) else None
    name, hint = NCCL_RESULTS.get(status, ("unknown NCCL status", "")) if status is not None \
        else ("unknown NCCL status", "")
    code = f" ({status})" if status is not None else ""
    message = f"{op}: NCCL failed with {name}{code} on {where}: {exc}"
    if hint:
        message += f"; {hint}"
    status_name = NCCL_RESULTS.get(status, ("unknown",))[0] if status is not None else ""
    return NcclError(message, op, status, status_name)


def missing_cupy_message(reason: str) -> str:
    """What :class:`BackendUnavailableError` says when CuPy cannot be imported."""
    return f"the nccl backend needs CuPy with NCCL ({reason}): {_INSTALL_HINT}"


# --- reductions -----------------------------------------------------------------------

@dataclass(frozen=True)
class ReducePlan:
    """How one reduction of one dtype runs on NCCL.

    Attributes:
        nccl_dtype: the ``ncclDataType_t`` the buffer is handed to NCCL as.
        nccl_op: the ``ncclRedOp_t`` NCCL applies.
        count_factor: NCCL elements per array element (2 for complex: real
            and imaginary parts are reduced as two floats, correct for SUM
            and AVERAGE, which act on each part alone).
        divide_by_size: after NCCL's sum, divide by the group size (AVERAGE
            on an NCCL older than 2.10, which has no ``ncclAvg``).
    """

    nccl_dtype: int
    nccl_op: int
    count_factor: int = 1
    divide_by_size: bool = False


_BASE_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min",
             ReduceOp.MAX: "max"}
# bool holds 0/1 in a byte: OR is the max, AND the min (ReduceOp's bool meaning).
_BOOL_OPS = {ReduceOp.SUM: "max", ReduceOp.MAX: "max", ReduceOp.PRODUCT: "min",
             ReduceOp.MIN: "min"}
_COMPLEX_PARTS = {"complex64": "float32", "complex128": "float64"}


def reduce_plan(dtype: Any, op: ReduceOp, version: tuple[int, int, int], where: str) -> ReducePlan:
    """The :class:`ReducePlan` for reducing ``dtype`` with ``op`` on NCCL ``version``.

    Raises:
        UnsupportedDTypeError: combinations without meaning (see
            :func:`axondist.ops.check_op_dtype`), PRODUCT on complex (not an
            operation on the parts), bfloat16 reductions on NCCL < 2.10.
    """
    check_op_dtype(op, dtype, where)
    name = np.dtype(dtype).name
    modern = tuple(version) >= NCCL_AVG_BF16_MIN_VERSION
    if name == "bool":
        return ReducePlan(NCCL_DTYPES["uint8"], NCCL_OPS[_BOOL_OPS[op]])
    factor = 1
    if name in _COMPLEX_PARTS:
        if op is ReduceOp.PRODUCT:
            raise UnsupportedDTypeError(
                f"{where}: PRODUCT of {name} is not supported on NCCL (it multiplies real and "
                "imaginary parts separately); reduce on the host or with the mpi backend")
        name, factor = _COMPLEX_PARTS[name], 2
    if name == "bfloat16" and not modern:
        raise UnsupportedDTypeError(
            f"{where}: reducing bfloat16 needs NCCL >= 2.10, this is "
            f"{'.'.join(map(str, version))}; upgrade NCCL (pip install -U nvidia-nccl-cu13, or "
            "-cu12 for CUDA 12) or reduce a float32 copy")
    if name not in NCCL_DTYPES:
        raise UnsupportedDTypeError(f"{where}: NCCL cannot reduce dtype {name}")
    if op is ReduceOp.AVERAGE:
        if modern:
            return ReducePlan(NCCL_DTYPES[name], NCCL_OPS["avg"], factor)
        return ReducePlan(NCCL_DTYPES[name], NCCL_OPS["sum"], factor, divide_by_size=True)
    return ReducePlan(NCCL_DTYPES[name], NCCL_OPS[_BASE_OPS[op]], factor)


# --- versions, ids, placement -----------------------------------------------------------

def parse_nccl_version(code: int) -> tuple[int, int, int]:
    """``(major, minor, patch)`` from ``ncclGetVersion``'s integer.

    NCCL encodes ``major*1000 + minor*100 + patch`` up to 2.8 and
    ``major*10000 + minor*100 + patch`` from 2.9 on (so minors can pass 9).
    CuPy reports 0 when built against an NCCL too old to say.
    """
    code = int(code)
    if code < 0:
        raise ValueError(f"parse_nccl_version: version code must be >= 0, got {code}")
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


@dataclass(frozen=True)
class NcclUniqueId:
    """The 128-byte token that lets ranks find each other (``ncclUniqueId``).

    One rank makes it (:meth:`NcclBackend.generate_unique_id`), every rank
    of the communicator must receive the same bytes by some other channel
    (MPI, the TCP rendezvous, a file...); :meth:`hex` and :meth:`from_hex`
    carry it as text.

    Attributes:
        internal: the raw bytes.
    """

    internal: bytes

    def __post_init__(self) -> None:
        raw = self.internal
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != UNIQUE_ID_BYTES:
            got = f"{len(raw)} bytes" if isinstance(raw, (bytes, bytearray)) else type(raw).__name__
            raise ValueError(f"NcclUniqueId: needs {UNIQUE_ID_BYTES} bytes, got {got}")
        object.__setattr__(self, "internal", bytes(self.internal))

    @classmethod
    def from_cupy(cls, values: bytes | Sequence[int]) -> NcclUniqueId:
        """From ``cupy.cuda.nccl.get_unique_id()``: 128 bytes (CuPy 14), or 128 signed chars."""
        return cls(bytes(int(v) & 0xFF for v in values))

    def to_cupy(self) -> tuple[int, ...]:
        """The signed-char tuple that CuPy before 14 takes (CuPy 14 takes :attr:`internal`)."""
        return tuple(b - 256 if b > 127 else b for b in self.internal)

    def hex(self) -> str:
        """256 hex digits (for environment variables or command lines)."""
        return self.internal.hex()

    @classmethod
    def from_hex(cls, text: str) -> NcclUniqueId:
        """Parse what :meth:`hex` wrote.

        Raises:
            ValueError: ``text`` is not hex, or not 256 digits (128 bytes).
        """
        return cls(bytes.fromhex(text))

    @classmethod
    def coerce(cls, value: Any) -> NcclUniqueId:
        """Accept an NcclUniqueId, its bytes, its hex text or CuPy's tuple."""
        if isinstance(value, cls):
            return value
        if isinstance(value, (bytes, bytearray)):
            return cls(bytes(value))
        if isinstance(value, str):
            return cls.from_hex(value)
        if isinstance(value, (tuple, list)):
            return cls.from_cupy(value)
        raise TypeError(f"NcclUniqueId: expected an NcclUniqueId, bytes, hex str or CuPy's tuple, "
                        f"got {type(value).__name__}")

    def __repr__(self) -> str:
        return f"NcclUniqueId({self.internal[:4].hex()}...)"


def select_device(local_rank: int, device_count: int) -> int:
    """The GPU of the ``local_rank``-th process on its node: ``local_rank % device_count``."""
    if device_count < 1:
        raise ValueError("select_device: no CUDA device is visible (check CUDA_VISIBLE_DEVICES "
                         "and the driver with nvidia-smi)")
    if local_rank < 0:
        raise ValueError(f"select_device: local_rank must be >= 0, got {local_rank}")
    return local_rank % device_count

@dataclass(frozen=True)
class RankGpu:
    """Where one rank runs, as the ranks exchange it before NCCL starts.

    Attributes:
        host: the host name.
        gpu: the GPU's identity (its UUID, else its PCI bus id): the same for two ranks
            on one GPU even when ``CUDA_VISIBLE_DEVICES`` numbers it differently.
        device: the CUDA device id the rank chose.
        device_count: GPUs visible to the rank.
    """

    host: str
    gpu: str
    device: int
    device_count: int


def shared_gpu_message(ranks: Sequence[RankGpu]) -> str | None:
    """What to say when ranks (in rank order) would share a GPU, else None.

    NCCL refuses two ranks of one communicator on one GPU with ``ncclInvalidUsage``
    and no word of the cause; this names the ranks, the GPU, how many GPUs their
    host has and what to run instead.
    """
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for r, place in enumerate(ranks):
        by_gpu.setdefault((place.host, place.gpu), []).append(r)
    shared = [(key, members) for key, members in by_gpu.items() if len(members) > 1]
    if not shared:
        return None
    parts = []
    for (host, gpu), members in shared:
        n = ranks[members[0]].device_count
        ids = sorted({ranks[m].device for m in members})
        seen = f"device {ids[0]}" if len(ids) == 1 else f"devices {', '.join(map(str, ids))}"
        parts.append(f"ranks {', '.join(map(str, members[:-1]))} and {members[-1]} on host "
                     f"{host} chose the same GPU ({seen}, {gpu}) of the host's "
                     f"{n} GPU{'s' if n != 1 else ''}")
    most = min(ranks[m[0]].device_count for _, m in shared)
    return (f"nccl backend: NCCL needs a GPU of its own for every rank, but {'; '.join(parts)}. "
            f"Start at most {most} rank{'s' if most != 1 else ''} per host (one rank per GPU, "
            "e.g. torchrun --nproc-per-node or mpiexec -n with one process per GPU), give "
            "each rank its own GPU (init(\"nccl\", device=...) or CUDA_VISIBLE_DEVICES), or "
            "use the mpi backend with CuPy arrays (init(\"mpi\")), where ranks may share a GPU")



def node_info_from_hosts(hosts: Sequence[str], rank: int) -> tuple[int, int, int]:
    """``(node_id, local_rank, local_size)`` of ``rank`` given every rank's host name.

    Nodes are numbered in order of their first rank; local ranks count the
    ranks on the same host in rank order.
    """
    order: dict[str, int] = {}
    for h in hosts:
        order.setdefault(h, len(order))
    mine = hosts[rank]
    local_rank = sum(1 for h in hosts[:rank] if h == mine)
    return order[mine], local_rank, sum(1 for h in hosts if h == mine)


# --- argument checks ---------------------------------------------------------------------

def host_array_error(op: str, described: str) -> NotOnDeviceError:
    """The error of ``op`` given the host (NumPy) array ``described``
    (:func:`axondist._array.describe`'s text)."""
    return NotOnDeviceError(
        f"{op}: the nccl backend moves GPU (CuPy) arrays, got the NumPy array "
        f"{described}; move it with axondist.to_device(x) first (and back "
        "with axondist.to_host(...)), or use the mpi backend for host arrays")


def not_contiguous_error(op: str, shape: tuple[int, ...], writable: bool) -> InvalidBufferError:
    """The error of ``op`` given an array of ``shape`` that is not C-contiguous (``writable``:
    the operation writes it)."""
    what = "written in place" if writable else "sent"
    return InvalidBufferError(
        f"{op}: the array of shape {tuple(shape)} is not C-contiguous, so it cannot be "
        f"{what}; pass cupy.ascontiguousarray(x)")


def check_device_array(x: Any, op: str, device: int | None = None, *,
                       writable: bool = False) -> None:
    """Refuse what NCCL cannot use: host arrays, non-arrays, other devices, strides.

    Args:
        x: the buffer.
        op: the operation, for the message.
        device: the backend's device id (not checked when None).
        writable: the operation writes ``x`` (then it must be C-contiguous;
            read-only inputs must be C-contiguous too, as NCCL reads raw memory).

    Raises:
        NotOnDeviceError: ``x`` is a NumPy array or not an array.
        InvalidBufferError: ``x`` lives on another device or is not C-contiguous.
    """
    if not _array.is_cupy(x):
        if isinstance(x, np.ndarray):
            raise host_array_error(op, _array.describe(x))
        raise NotOnDeviceError(
            f"{op}: the nccl backend moves CuPy arrays, got {type(x).__name__}; convert it "
            "with axondist.to_device(x)")
    if device is not None and x.device.id != device:
        raise InvalidBufferError(
            f"{op}: the array {_array.describe(x)} is on GPU {x.device.id} but this rank's "
            f"communicator uses GPU {device}; create it under cupy.cuda.Device({device}) or "
            f"copy it there with axondist.to_device(x, {device})")
    if not x.flags.c_contiguous:
        raise not_contiguous_error(op, x.shape, writable)


__all__ = [
    "GroupedCallError",
    "NCCL_DTYPES",
    "NCCL_OPS",
    "NCCL_RESULTS",
    "NcclError",
    "NcclUniqueId",
    "NotOnDeviceError",
    "RankGpu",
    "ReducePlan",
    "check_device_array",
    "host_array_error",
    "node_info_from_hosts",
    "not_contiguous_error",
    "parse_nccl_version",
    "reduce_plan",
    "select_device",
    "shared_gpu_message",
]
