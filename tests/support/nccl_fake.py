"""A CPU stand-in for the slice of CuPy the NCCL backend uses, to test it without a GPU.

:func:`install` puts fake ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime`` and
``cupy.cuda.nccl`` modules into ``sys.modules``. Arrays are NumPy arrays of a
subclass (:class:`FakeArray`) that carries a device id, ``.data.ptr`` (the
real host address) and ``.get()``. The fake NCCL works on those addresses:
every rank of a fake communicator posts its calls to a shared engine, a
collective runs when all ranks posted it, a send when its receive is posted
(in order per pair of ranks); calls inside ``groupStart``/``groupEnd`` are
posted only when the outermost group ends, as real NCCL launches them then.
Like NCCL, a call returns at once; an Event recorded on a stream is done
once the calls issued on that stream before it have run, and a mismatched
call surfaces through ``check_async_error``. So the fake checks what NCCL
would receive (pointers, byte counts, dtype and op codes, roots, group
structure, the signed unique-id tuple, streams of the right device) and
computes what NCCL would compute. Array work (kernels, copies) issued while
a stream is current runs on the host once the NCCL calls launched earlier on
that stream have run, which is CUDA's stream order; work on other streams
does not wait (the backend's stream is non-blocking). Timing-dependent
behaviour of real GPUs is left to the gpu tests.
Only the API the backend is documented to use exists here, so a call CuPy
lacks fails loudly. The CuPy half (devices, streams, events, arrays) is :mod:`fake_cuda`;
this module holds the NCCL half and the installation.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import importlib.machinery
import os
import sys
import threading
import types
from typing import Any

import ml_dtypes
import numpy as np
from fake_cuda import (  # the CuPy half; the tests reach it through this module too
    _PENDING,
    _PENDING_LOCK,
    _STREAMS,
    SETTINGS,
    Device,
    Event,
    FakeCupy,
    FakeMisuse,
    Settings,
    Stream,
    _local,
    _register,
    current_device,
    get_current_stream,
)
from fake_cuda import thread_counts as thread_counts  # tests read fake.module.thread_counts

# --- the fake NCCL ------------------------------------------------------------------------

_RESULT_NAMES = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                 4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError"}
_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
           6: np.float16, 7: np.float32, 8: np.float64, 9: ml_dtypes.bfloat16}


class NcclError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"NCCL_ERROR: {_RESULT_NAMES.get(status, 'unknown')} (fake)")


def _memory(ptr: int, nbytes: int) -> np.ndarray:
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def _typed(ptr: int, count: int, dtype_code: int) -> np.ndarray:
    dt = np.dtype(_DTYPES[dtype_code])
    return _memory(ptr, count * dt.itemsize).view(dt)


def _reduce(arrays: list[np.ndarray], op: int) -> np.ndarray:
    dt = arrays[0].dtype
    low = dt in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
    work = [a.astype(np.float32) if low else a.copy() for a in arrays]
    ufunc = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}[op]
    out = functools.reduce(lambda x, y: ufunc(x, y), work)
    if op == 4:
        out = out / len(arrays)
    return out.astype(dt)


class _Op:
    def __init__(self, comm: NcclCommunicator, kind: str, stream: int,
                 args: dict[str, Any]) -> None:
        self.comm, self.kind, self.stream, self.args = comm, kind, stream, args
        self.done = threading.Event()
        self.posted = False
        self.error: NcclError | None = None

    def finish(self, error: NcclError | None = None) -> None:
        if error is not None:  # like a wedged kernel: never done, reported asynchronously
            self.error = error
            self.comm.async_errors.append(error.status)
            return
        self.done.set()

    def wait(self) -> None:
        if not self.done.wait(SETTINGS.match_timeout):
            raise TimeoutError(f"fake nccl: {self.kind} on rank {self.comm.rank} never matched")


class _World:
    def __init__(self, n: int) -> None:
        self.n = n
        self.cond = threading.Condition()
        self.members: list[NcclCommunicator | None] = [None] * n
        self.colls: dict[int, list[_Op | None]] = {}
        self.sends: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)
        self.recvs: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)

    def post(self, op: _Op) -> None:
        op.posted = True
        with self.cond:
            if op.kind in ("send", "recv"):
                self._post_p2p(op)
                return
            seq = op.args.pop("seq")
            slot = self.colls.setdefault(seq, [None] * self.n)
            slot[op.comm.rank] = op
            if all(s is not None for s in slot):
                del self.colls[seq]
                self._run_collective(slot)  # type: ignore[arg-type]

    def _post_p2p(self, op: _Op) -> None:
        me, peer = op.comm.rank, op.args["peer"]
        key = (me, peer) if op.kind == "send" else (peer, me)
        (self.sends if op.kind == "send" else self.recvs)[key].append(op)
        sends, recvs = self.sends[key], self.recvs[key]
        while sends and recvs:
            s, r = sends.popleft(), recvs.popleft()
            if not (s.comm.alive and r.comm.alive):  # a side was aborted: the peer sees an error
                s.finish(NcclError(6))
                r.finish(NcclError(6))
                continue
            if s.args["count"] != r.args["count"] or s.args["dtype"] != r.args["dtype"]:
                s.finish(NcclError(5))
                r.finish(NcclError(5))
                continue
            dt = np.dtype(_DTYPES[s.args["dtype"]])
            n = s.args["count"] * dt.itemsize
            _memory(r.args["buf"], n)[...] = _memory(s.args["buf"], n)
            s.finish()
            r.finish()

    def _run_collective(self, ops: list[_Op]) -> None:
        first = ops[0]
        fields = [k for k in first.args if k not in ("send", "recv")]
        same = all(o.kind == first.kind and all(o.args[k] == first.args[k] for k in fields)
                   for o in ops)
        error = None if same else NcclError(5)
        if not all(o.comm.alive for o in ops):  # a rank aborted its communicator
            same, error = False, NcclError(6)
        if same:
            getattr(self, "_" + first.kind)(ops, **{k: first.args[k] for k in fields})
        for o in ops:
            o.finish(error)

    def _allReduce(self, ops: list[_Op], count: int, dtype: int, op: int) -> None:
        inputs = [_typed(o.args["send"], count, dtype).copy() for o in ops]
        result = _reduce(inputs, op)
        for o in ops:
            _typed(o.args["recv"], count, dtype)[...] = result

    def _reduce(self, ops: list[_Op], count: int, dtype: int, op: int, root: int) -> None:
        inputs = [_typed(o.args["send"], count, dtype).copy() for o in ops]
        _typed(ops[root].args["recv"], count, dtype)[...] = _reduce(inputs, op)

    def _broadcast(self, ops: list[_Op], count: int, dtype: int, root: int) -> None:
        data = _typed(ops[root].args["send"], count, dtype).copy()
        for o in ops:
            _typed(o.args["recv"], count, dtype)[...] = data

    def _allGather(self, ops: list[_Op], count: int, dtype: int) -> None:
        data = np.concatenate([_typed(o.args["send"], count, dtype).copy() for o in ops])
        for o in ops:
            _typed(o.args["recv"], count * self.n, dtype)[...] = data

    def _reduceScatter(self, ops: list[_Op], count: int, dtype: int, op: int) -> None:
        full = _reduce([_typed(o.args["send"], count * self.n, dtype).copy() for o in ops], op)
        for k, o in enumerate(ops):
            _typed(o.args["recv"], count, dtype)[...] = full[k * count:(k + 1) * count]


_WORLDS: dict[bytes, _World] = {}
_WORLDS_LOCK = threading.Condition()


def _submit(op: _Op) -> None:
    """Like NCCL: enqueue and return (inside a group: enqueue at the group's end)."""
    SETTINGS.calls.append((op.kind, op.comm.rank))
    with _PENDING_LOCK:
        _PENDING[op.stream].append(op)
    if getattr(_local, "group_depth", 0):
        _local.group_ops.append(op)
        return
    op.comm.world.post(op)


def groupStart() -> None:
    if getattr(_local, "group_depth", 0) == 0:
        _local.group_ops = []
    _local.group_depth = getattr(_local, "group_depth", 0) + 1


def groupEnd() -> None:
    if getattr(_local, "group_depth", 0) < 1:
        raise NcclError(5)
    _local.group_depth -= 1
    if _local.group_depth == 0:
        ops, _local.group_ops = _local.group_ops, []
        for op in ops:
            op.comm.world.post(op)


def get_version() -> int:
    return SETTINGS.version_code


def get_unique_id() -> bytes | tuple[int, ...]:
    raw = os.urandom(128)
    return tuple(b - 256 if b > 127 else b for b in raw) if SETTINGS.tuple_unique_id else raw


class NcclCommunicator:
    def __init__(self, ndev: int, commId: bytes | tuple, rank: int) -> None:
        # Like CuPy's Cython signature: the wrong type is a TypeError before NCCL is called.
        if SETTINGS.tuple_unique_id:
            if not isinstance(commId, tuple):
                raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got "
                                f"{type(commId).__name__})")
            if len(commId) != 128 or \
                    any(not isinstance(v, int) or not -128 <= v <= 127 for v in commId):
                raise FakeMisuse("NcclCommunicator: commId must be 128 signed chars")
            commId = bytes(v & 0xFF for v in commId)
        elif not isinstance(commId, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                            f"{type(commId).__name__})")
        elif len(commId) != 128:
            raise FakeMisuse("NcclCommunicator: commId must be 128 bytes")
        if not 0 <= rank < ndev:
            raise NcclError(4)
        with _WORLDS_LOCK:
            world = _WORLDS.setdefault(commId, _World(ndev))
            if world.n != ndev or world.members[rank] is not None:
                raise NcclError(5)
        self._attach(world, rank, current_device())
        with _WORLDS_LOCK:
            _WORLDS_LOCK.notify_all()
            if not _WORLDS_LOCK.wait_for(lambda: all(m is not None for m in world.members),
                                         SETTINGS.match_timeout):
                raise TimeoutError("fake ncclCommInitRank: not every rank joined")

    def _attach(self, world: _World, rank: int, device: int) -> None:
        self.world, self.rank, self.device = world, rank, device
        self.alive = True
        self.async_errors: list[int] = []
        self._seq = 0
        world.members[rank] = self

    @staticmethod
    def initAll(devices: Any) -> list[NcclCommunicator]:
        if not isinstance(devices, list):
            raise ValueError('"devices" should be an int or a list of int.')
        world = _World(len(devices))
        comms = []
        for r, d in enumerate(devices):
            c = NcclCommunicator.__new__(NcclCommunicator)
            c._attach(world, r, d)
            comms.append(c)
        return comms

    # -- checks shared by every call --
    def _check(self, stream: Any, *ptrs: Any) -> None:
        if not self.alive:
            raise NcclError(4)
        if not isinstance(stream, int) or any(not isinstance(p, int) for p in ptrs):
            raise FakeMisuse("NCCL calls take integer pointers and stream.ptr")
        owner = _STREAMS.get(stream)
        if owner is None or owner.device_id != self.device:
            raise FakeMisuse(f"stream {stream} does not belong to this comm's device {self.device}")

    def _check_types(self, dtype: int, op: int | None = None) -> None:
        modern = SETTINGS.version_code >= 21000
        if dtype not in _DTYPES or (dtype == 9 and not modern):
            raise NcclError(4)
        if op is not None and (op not in (0, 1, 2, 3, 4) or (op == 4 and not modern)):
            raise NcclError(4)

    def _coll(self, kind: str, stream: int, **args: Any) -> None:
        args["seq"] = self._seq
        self._seq += 1
        _submit(_Op(self, kind, stream, args))

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                  stream: int) -> None:
        self._check(stream, sendbuf, recvbuf)
        self._check_types(datatype, op)
        self._coll("allReduce", stream, send=sendbuf, recv=recvbuf, count=count, dtype=datatype,
                   op=op)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int,
               stream: int) -> None:
        self._check(stream, sendbuf, recvbuf)
        self._check_types(datatype, op)
        self._coll("reduce", stream, send=sendbuf, recv=recvbuf, count=count, dtype=datatype,
                   op=op, root=root)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        self._check(stream, sendbuff, recvbuff)
        self._check_types(datatype)
        self._coll("broadcast", stream, send=sendbuff, recv=recvbuff, count=count,
                   dtype=datatype, root=root)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int,
                      stream: int) -> None:
        self._check(stream, sendbuf, recvbuf)
        self._check_types(datatype, op)
        self._coll("reduceScatter", stream, send=sendbuf, recv=recvbuf, count=recvcount,
                   dtype=datatype, op=op)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,
                  stream: int) -> None:
        self._check(stream, sendbuf, recvbuf)
        self._check_types(datatype)
        self._coll("allGather", stream, send=sendbuf, recv=recvbuf, count=count, dtype=datatype)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._check(stream, sendbuf)
        self._check_types(datatype)
        if SETTINGS.version_code < 2700 or not 0 <= peer < self.world.n:
            raise NcclError(4)
        _submit(_Op(self, "send", stream, {"buf": sendbuf, "count": count, "dtype": datatype,
                                           "peer": peer}))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._check(stream, recvbuf)
        self._check_types(datatype)
        if SETTINGS.version_code < 2700 or not 0 <= peer < self.world.n:
            raise NcclError(4)
        _submit(_Op(self, "recv", stream, {"buf": recvbuf, "count": count, "dtype": datatype,
                                           "peer": peer}))

    def check_async_error(self) -> None:
        if SETTINGS.async_error is not None:
            raise NcclError(SETTINGS.async_error)
        if self.async_errors:
            raise NcclError(self.async_errors[0])

    def destroy(self) -> None:
        self.alive = False

    def abort(self) -> None:
        """ncclCommAbort: this rank's calls in flight end at once (their results are garbage),
        from any thread; a peer's matching call then fails with ncclRemoteError."""
        self.alive = False
        SETTINGS.aborted.append(self.rank)
        with _PENDING_LOCK:
            ops = [o for pending in _PENDING.values() for o in pending if o.comm is self]
        for op in ops:
            op.done.set()

    def device_id(self) -> int:
        return self.device

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.world.n


# --- installation ------------------------------------------------------------------------

def _stream_factory(*args: Any, **kwargs: Any) -> Stream:
    return _register(Stream(*args, **kwargs))


def install(monkeypatch: Any, device_count: int = 4, version_code: int = 21903) -> Settings:
    """Put the fake modules into ``sys.modules`` (undone by ``monkeypatch``); return the knobs."""
    SETTINGS.__init__(device_count, version_code)  # type: ignore[misc]
    _local.__dict__.clear()
    _PENDING.clear()
    _WORLDS.clear()
    cupy = FakeCupy("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)  # importlib.util.find_spec
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.ModuleType("cupy.cuda.runtime")
    nccl = types.ModuleType("cupy.cuda.nccl")

    def getDeviceCount() -> int:
        return SETTINGS.device_count

    def getDeviceProperties(device: int) -> dict[str, Any]:
        if not 0 <= device < SETTINGS.device_count:
            raise FakeMisuse(f"fake cupy: getDeviceProperties of device {device}")
        uuid = SETTINGS.uuids.get(device, bytes([0xFA, 0xCE]) + bytes(13) + bytes([device]))
        return {"name": b"Fake GPU", "uuid": uuid, "pciDomainID": 0, "pciBusID": 0x10 + device,
                "pciDeviceID": 0}

    runtime.getDeviceCount = getDeviceCount  # type: ignore[attr-defined]
    runtime.getDeviceProperties = getDeviceProperties  # type: ignore[attr-defined]
    cuda.Device = Device  # type: ignore[attr-defined]
    cuda.Stream = _stream_factory  # type: ignore[attr-defined]
    cuda.Event = Event  # type: ignore[attr-defined]
    cuda.get_current_stream = get_current_stream  # type: ignore[attr-defined]
    cuda.runtime = runtime  # type: ignore[attr-defined]
    cuda.nccl = nccl  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    for name in ("NcclCommunicator", "NcclError", "get_unique_id", "get_version", "groupStart",
                 "groupEnd"):
        setattr(nccl, name, globals()[name])
    nccl.available = True  # type: ignore[attr-defined]
    for name, code in (("NCCL_SUM", 0), ("NCCL_PROD", 1), ("NCCL_MAX", 2), ("NCCL_MIN", 3),
                       ("NCCL_AVG", 4), ("NCCL_INT8", 0), ("NCCL_UINT8", 1), ("NCCL_INT32", 2),
                       ("NCCL_UINT32", 3), ("NCCL_INT64", 4), ("NCCL_UINT64", 5),
                       ("NCCL_FLOAT16", 6), ("NCCL_FLOAT32", 7), ("NCCL_FLOAT64", 8),
                       ("NCCL_BFLOAT16", 9)):
        setattr(nccl, name, code)
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=float: np.empty(shape, dtype)  # type: ignore[attr-defined]
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.runtime", runtime),
                         ("cupy.cuda.nccl", nccl), ("cupyx", cupyx)):
        monkeypatch.setitem(sys.modules, name, module)
    return SETTINGS


class _ForGood:
    """``install``'s undo log in a child process, where nothing needs undoing."""

    def setitem(self, mapping: Any, key: Any, value: Any) -> None:
        mapping[key] = value


def install_for_process(device_count: int = 4, version_code: int = 21903) -> Settings:
    """:func:`install` for the rest of this process (child scripts of the tests)."""
    return install(_ForGood(), device_count, version_code)
