"""NcclBackend: one rank's NCCL communicator on one GPU (see :mod:`axondist.backends.nccl`)."""

from __future__ import annotations

import collections
import pickle
import socket
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidBufferError,
    RankError,
    WorldAbortedError,
)
from ..ops import ReduceOp
from ._nccl_runtime import (
    GROUP_STATE,
    NcclCall,
    NcclWork,
    PendingCall,
    WorldLink,
    device_count,
    group_calls,
    load_cupy,
    require_no_group,
)
from ._nccl_types import (
    NCCL_BYTE,
    NCCL_DTYPES,
    NCCL_OPS,
    GroupedCallError,
    NcclError,
    NcclUniqueId,
    ReducePlan,
    check_device_array,
    node_info_from_hosts,
    parse_nccl_version,
    reduce_plan,
)
from .base import Backend, Signature, Work, compare_signatures, debug_enabled, default_timeout

# --- the backend --------------------------------------------------------------------------

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
    blocks until all have joined), then the ranks exchange host names for
    :meth:`node_info`.

    Raises:
        BackendUnavailableError: CuPy, NCCL or a GPU is missing.
        ValueError: rank, world size or device out of range.
        NcclError: NCCL failed to create the communicator.
    """

    name = "nccl"
    host_collectives = False
    _hosts: tuple[str, ...] | None  # every rank's host name, for node_info

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
            comm = nccl.NcclCommunicator(world_size, uid.to_cupy(), rank)
        self._setup(cupy, nccl, comm, rank, world_size, device, timeout, None, WorldLink())
        self._hosts = tuple(self.allgather_object(socket.gethostname()))

    def _setup(self, cupy: ModuleType, nccl: ModuleType, comm: Any, rank: int, world_size: int,
               device: int, timeout: float | None, hosts: tuple[str, ...] | None,
               link: WorldLink) -> None:
        self._cupy, self._nccl, self._comm = cupy, nccl, comm
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self._hosts = hosts
        self._link = link
        self._closed = False
        self._inflight: collections.deque[NcclWork] = collections.deque()
        self._version = parse_nccl_version(nccl.get_version())
        with cupy.cuda.Device(device):
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._ready = cupy.cuda.Event(disable_timing=True)
            self._barrier_buf = cupy.empty(1, dtype=np.int32)  # its value does not matter

    @classmethod
    def _wrap(cls, cupy: ModuleType, nccl: ModuleType, comm: Any, rank: int, world_size: int,
              device: int, timeout: float | None, hosts: tuple[str, ...] | None,
              link: WorldLink) -> NcclBackend:
        self = cls.__new__(cls)
        self._setup(cupy, nccl, comm, rank, world_size, device, timeout, hosts, link)
        return self

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
        with NcclCall(nccl, "create_world (ncclCommInitAll)", f"GPUs {devices}"):
            comms = nccl.NcclCommunicator.initAll(devices)
        hosts = (socket.gethostname(),) * n
        link = WorldLink()
        return [cls._wrap(cupy, nccl, comm, r, n, d, timeout, hosts, link)
                for r, (comm, d) in enumerate(zip(comms, devices))]

    # --- queries --------------------------------------------------------------------------
    def nccl_version(self) -> tuple[int, int, int]:
        """The NCCL library's ``(major, minor, patch)``."""
        return self._version

    @property
    def stream(self) -> Any:
        """The ``cupy.cuda.Stream`` this backend's operations run on."""
        return self._stream

    @property
    def communicator(self) -> Any:
        """The underlying ``cupy.cuda.nccl.NcclCommunicator`` (for what axondist lacks)."""
        return self._comm

    def node_info(self) -> tuple[int, int, int]:
        """``(node_id, local_rank, local_size)`` from the host names the ranks exchanged."""
        return node_info_from_hosts(self._hosts or (socket.gethostname(),) * self.world_size,
                                    self.rank)

    def grouped(self) -> group_calls:
        """Context manager bracketing calls in ``ncclGroupStart``/``ncclGroupEnd``."""
        return group_calls()

    def synchronize(self) -> None:
        """Block until every operation issued on this backend has completed."""
        require_no_group("synchronize")
        with self._cupy.cuda.Device(self.device):
            event = self._cupy.cuda.Event(disable_timing=True)
            event.record(self._stream)
        self._wait_event(event, "synchronize", None)
        self._inflight.clear()

    def __repr__(self) -> str:
        return f"NcclBackend(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    # --- the launch machinery -------------------------------------------------------------
    def _where(self) -> str:
        return f"rank {self.rank} of {self.world_size} (GPU {self.device})"

    def _call(self, op: str) -> NcclCall:
        return NcclCall(self._nccl, op, self._where())

    def _launch(self, op: str, issue: Callable[[], None], *, result: Any, keep: tuple[Any, ...],
                async_op: bool, post: Callable[[], Any] | None = None) -> NcclWork:
        """Order after the caller's stream, enqueue ``issue()``, then finish or defer to a group."""
        if self._closed:
            raise RuntimeError(f"{op}: the nccl backend of {self._where()} was closed")
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            current = cupy.cuda.get_current_stream()
            if current.ptr != self._stream.ptr:
                self._ready.record(current)
                self._stream.wait_event(self._ready)
            with self._call(op):
                issue()
            work = NcclWork(self, op, result, keep)
            if GROUP_STATE.depth:
                GROUP_STATE.pending.append(PendingCall(self, work, post, not async_op))
                return work
            self._start(work, post)
        if not async_op:
            work.wait()
        return work

    def _start(self, work: NcclWork, post: Callable[[], Any] | None) -> None:
        """After the kernels are enqueued: run ``post`` on the stream, record the event."""
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            if post is not None:
                with self._stream:
                    post()
            event = cupy.cuda.Event(disable_timing=True)
            event.record(self._stream)
        work._event = event
        while self._inflight and self._inflight[0].is_completed():
            self._inflight.popleft()
        self._inflight.append(work)

    def _wait_event(self, event: Any, op: str, timeout: float | None) -> None:
        """Poll ``event`` until done; time out, notice aborts and NCCL's async errors."""
        if event.done:
            return
        limit = self.timeout if timeout is None else float(timeout)
        start = time.monotonic()
        spin_until, next_check = start + 1e-4, start + 0.25
        delay = 1e-5
        while not event.done:
            now = time.monotonic()
            if self._link.reason is not None:
                raise WorldAbortedError(f"{op} cancelled on {self._where()}: {self._link.reason}")
            if now >= next_check:
                next_check = now + 0.25
                if self._version >= (2, 4, 0):
                    with self._call(op):
                        self._comm.check_async_error()
            if now - start > limit:
                raise CollectiveTimeoutError(
                    f"{op}: not completed within {limit:g} s on {self._where()}; every rank of the "
                    "group must make the same calls in the same order (NCCL_DEBUG=INFO shows "
                    "where each rank is)")
            if now >= spin_until:
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)

    def _check(self, x: Any, op: str, *, writable: bool = False) -> None:
        check_device_array(x, op, self.device, writable=writable)

    def _check_signature(self, op: str, signature: Signature) -> None:
        if debug_enabled() and not GROUP_STATE.depth:
            error = compare_signatures(op, self.allgather_object((("op", op),) + tuple(signature)))
            if error is not None:
                raise error

    def _check_root(self, r: int, what: str, arg: str) -> None:
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self.world_size:
            raise RankError(f"{what}: {arg}={r!r} is outside the group of {self.world_size} ranks "
                            f"(valid: 0..{self.world_size - 1})")

    def _divide_post(self, buf: Any, plan: ReducePlan) -> Callable[[], Any] | None:
        if not plan.divide_by_size or self.world_size == 1:
            return None
        n, xp = self.world_size, self._cupy
        return lambda: xp.divide(buf, n, out=buf)  # floating and complex only (AVERAGE)

    def _plan(self, x: Any, op: ReduceOp, what: str) -> ReducePlan:
        return reduce_plan(x.dtype, op, self._version, what)

    # --- collectives ----------------------------------------------------------------------
    def all_reduce(self, buf: Any, op: ReduceOp, *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """``ncclAllReduce`` in place on this backend's stream.

        Ordered after the caller's current stream. AVERAGE is a SUM followed by a
        division on the stream; dtypes NCCL lacks are refused (see ``reduce_plan``).
        Inside :func:`group_calls` the call only joins the group.
        """
        self._check(buf, "all_reduce", writable=True)
        plan = self._plan(buf, op, "all_reduce")
        self._check_signature("all_reduce", signature + (("reduce_op", op.name),))
        count = buf.size * plan.count_factor

        def issue() -> None:
            if count:
                p = buf.data.ptr
                self._comm.allReduce(p, p, count, plan.nccl_dtype, plan.nccl_op, self._stream.ptr)

        return self._launch("all_reduce", issue, result=buf, keep=(buf,), async_op=async_op,
                            post=self._divide_post(buf, plan))

    def broadcast(self, buf: Any, root: int, *, signature: Signature = (),
                  async_op: bool = False) -> Work:
        """``ncclBroadcast`` of ``root``'s ``buf`` (as bytes) into every rank's ``buf``."""
        self._check(buf, "broadcast", writable=True)
        self._check_root(root, "broadcast", "root")
        self._check_signature("broadcast", signature + (("root", root),))
        return self._broadcast(buf, root, async_op)

    def _broadcast(self, buf: Any, root: int, async_op: bool) -> NcclWork:
        def issue() -> None:
            if buf.nbytes:
                p = buf.data.ptr
                self._comm.broadcast(p, p, buf.nbytes, NCCL_BYTE, root, self._stream.ptr)

        return self._launch("broadcast", issue, result=buf, keep=(buf,), async_op=async_op)

    def _check_counts(self, what: str, counts: Sequence[int], local: Any, total: Any,
                      local_name: str, total_name: str) -> list[int]:
        counts = [int(c) for c in counts]
        if len(counts) != self.world_size or any(c < 0 for c in counts):
            raise ValueError(f"{what}: counts={counts} must list {self.world_size} sizes >= 0")
        if local is not None and local.size != counts[self.rank]:
            raise InvalidBufferError(f"{what}: {local_name} has {local.size} elements, counts say "
                                     f"{counts[self.rank]} for rank {self.rank}")
        if total is not None and total.size != sum(counts):
            raise InvalidBufferError(f"{what}: {total_name} has {total.size} elements, counts add "
                                     f"up to {sum(counts)}")
        if local is not None and total is not None and local.dtype != total.dtype:
            raise InvalidBufferError(f"{what}: {local_name} is {local.dtype} but {total_name} is "
                                     f"{total.dtype}")
        return counts

    def all_gather(self, send: Any, recv: Any, counts: Sequence[int], *,
                   signature: Signature = (), async_op: bool = False) -> Work:
        """``ncclAllGather`` of ``send`` into ``recv`` (rank order).

        Uneven ``counts`` become one broadcast per rank inside an NCCL group.
        """
        self._check(send, "all_gather")
        self._check(recv, "all_gather", writable=True)
        counts = self._check_counts("all_gather", counts, send, recv, "send", "recv")
        self._check_signature("all_gather", signature + (("counts", tuple(counts)),))
        return self._all_gather(send, recv, counts, async_op)

    def _all_gather(self, send: Any, recv: Any, counts: list[int], async_op: bool) -> NcclWork:
        size = recv.itemsize
        stream = self._stream.ptr

        def issue() -> None:
            if len(set(counts)) == 1:
                if counts[0]:
                    self._comm.allGather(send.data.ptr, recv.data.ptr, counts[0] * size,
                                         NCCL_BYTE, stream)
                return
            self._nccl.groupStart()  # one broadcast per rank: all-gather with uneven counts
            try:
                offset = 0
                for k, c in enumerate(counts):
                    dst = recv.data.ptr + offset * size
                    if c:
                        src = send.data.ptr if k == self.rank else dst
                        self._comm.broadcast(src, dst, c * size, NCCL_BYTE, k, stream)
                    offset += c
            finally:
                self._nccl.groupEnd()

        return self._launch("all_gather", issue, result=recv, keep=(send, recv), async_op=async_op)

    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: ReduceOp, *,
                       signature: Signature = (), async_op: bool = False) -> Work:
        """``ncclReduceScatter``: this rank's block of the reduced ``send`` lands in ``recv``.

        Uneven ``counts`` become one ``ncclReduce`` per rank inside an NCCL group.
        """
        self._check(send, "reduce_scatter")
        self._check(recv, "reduce_scatter", writable=True)
        counts = self._check_counts("reduce_scatter", counts, recv, send, "recv", "send")
        plan = self._plan(send, op, "reduce_scatter")
        self._check_signature("reduce_scatter", signature + (("counts", tuple(counts)),
                                                             ("reduce_op", op.name)))
        f, size, stream = plan.count_factor, send.itemsize, self._stream.ptr

        def issue() -> None:
            if len(set(counts)) == 1:
                if counts[0]:
                    self._comm.reduceScatter(send.data.ptr, recv.data.ptr, counts[0] * f,
                                             plan.nccl_dtype, plan.nccl_op, stream)
                return
            self._nccl.groupStart()  # one reduce per rank: reduce-scatter with uneven counts
            try:
                offset = 0
                for k, c in enumerate(counts):
                    src = send.data.ptr + offset * size
                    if c:
                        dst = recv.data.ptr if k == self.rank else src  # unused off the root
                        self._comm.reduce(src, dst, c * f, plan.nccl_dtype, plan.nccl_op, k,
                                          stream)
                    offset += c
            finally:
                self._nccl.groupEnd()

        return self._launch("reduce_scatter", issue, result=recv, keep=(send, recv),
                            async_op=async_op, post=self._divide_post(recv, plan))

    def gather(self, send: Any, recv: Any | None, counts: Sequence[int], root: int, *,
               signature: Signature = (), async_op: bool = False) -> Work:
        """Sends to ``root`` and receives there, in one NCCL group; None off the root."""
        self._check_root(root, "gather", "root")
        self._check(send, "gather")
        is_root = self.rank == root
        if is_root:
            self._check(recv, "gather", writable=True)
        counts = self._check_counts("gather", counts, send, recv if is_root else None,
                                    "send", "recv")
        self._check_signature("gather", signature + (("root", root), ("counts", tuple(counts))))
        size, stream = send.itemsize, self._stream.ptr
        out: Any = recv  # used on the root only

        def issue() -> None:
            self._nccl.groupStart()
            try:
                if not is_root:
                    if counts[self.rank]:
                        self._comm.send(send.data.ptr, send.nbytes, NCCL_BYTE, root, stream)
                    return
                offset = 0
                for k, c in enumerate(counts):
                    if c and k != root:
                        self._comm.recv(out.data.ptr + offset * size, c * size, NCCL_BYTE, k,
                                        stream)
                    offset += c
            finally:
                self._nccl.groupEnd()
            if is_root and counts[root]:
                lo = sum(counts[:root])
                with self._stream:
                    out.reshape(-1)[lo:lo + counts[root]] = send.reshape(-1)

        return self._launch("gather", issue, result=recv if is_root else None,
                            keep=(send, recv), async_op=async_op)

    def scatter(self, send: Any | None, recv: Any, counts: Sequence[int], root: int, *,
                signature: Signature = (), async_op: bool = False) -> Work:
        """Sends from ``root`` to every rank's ``recv``, in one NCCL group."""
        self._check_root(root, "scatter", "root")
        self._check(recv, "scatter", writable=True)
        is_root = self.rank == root
        if is_root:
            self._check(send, "scatter")
        counts = self._check_counts("scatter", counts, recv, send if is_root else None,
                                    "recv", "send")
        self._check_signature("scatter", signature + (("root", root), ("counts", tuple(counts))))
        size, stream = recv.itemsize, self._stream.ptr
        source: Any = send  # used on the root only

        def issue() -> None:
            self._nccl.groupStart()
            try:
                if not is_root:
                    if counts[self.rank]:
                        self._comm.recv(recv.data.ptr, recv.nbytes, NCCL_BYTE, root, stream)
                    return
                offset = 0
                for k, c in enumerate(counts):
                    if c and k != root:
                        self._comm.send(source.data.ptr + offset * size, c * size, NCCL_BYTE,
                                        k, stream)
                    offset += c
            finally:
                self._nccl.groupEnd()
            if is_root and counts[root]:
                lo = sum(counts[:root])
                with self._stream:
                    recv.reshape(-1)[...] = source.reshape(-1)[lo:lo + counts[root]]

        return self._launch("scatter", issue, result=recv, keep=(send, recv), async_op=async_op)

    def barrier(self) -> None:
        """An all-reduce of one number, waited for on the host."""
        require_no_group("barrier")
        buf = self._barrier_buf
        self._launch("barrier", lambda: self._comm.allReduce(
            buf.data.ptr, buf.data.ptr, 1, NCCL_DTYPES["int32"], NCCL_OPS["sum"],
            self._stream.ptr),
            result=None, keep=(), async_op=False)


    # --- point to point -------------------------------------------------------------------
    def _check_peer(self, peer: int, what: str, arg: str) -> None:
        self._check_root(peer, what, arg)
        if peer == self.rank:
            raise RankError(f"{what}: {arg}={peer} is this rank; NCCL cannot send a message to "
                            "the same rank outside a group (copy the array instead)")

    def _p2p(self, what: str, buf: Any, peer: int, sending: bool) -> None:
        stream = self._stream.ptr

        def issue() -> None:
            if buf.nbytes:
                if sending:
                    self._comm.send(buf.data.ptr, buf.nbytes, NCCL_BYTE, peer, stream)
                else:
                    self._comm.recv(buf.data.ptr, buf.nbytes, NCCL_BYTE, peer, stream)

        # Blocking: returns once the message is out (inside a group: once the group ended).
        self._launch(what, issue, result=None, keep=(buf,), async_op=False)

    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """``ncclSend`` of ``buf``'s bytes; returns once it was received.

        NCCL has no tags: ``tag`` is ignored and messages between two ranks
        match in the order they were sent. Two ranks that send to each other
        must do it inside :meth:`grouped` (NCCL pairs the calls), or one of
        them must receive first.
        """
        self._check(buf, "send")
        self._check_peer(dst, "send", "dst")
        self._p2p("send", buf, dst, True)

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """``ncclRecv`` into ``buf``, whose size must equal the message's (``tag`` is ignored)."""
        self._check(buf, "recv", writable=True)
        self._check_peer(src, "recv", "src")
        self._p2p("recv", buf, src, False)

    # --- Python objects over NCCL ---------------------------------------------------------
    def _device_bytes(self, data: bytes | np.ndarray,
                      size: int | None = None) -> tuple[Any, np.ndarray]:
        """``data`` zero-padded to ``size`` bytes in a device buffer, copied on our stream.

        Returns the device buffer and the host staging array, which the
        caller keeps alive until an operation on the buffer was waited for.
        """
        host = np.zeros(len(data) if size is None else size, dtype=np.uint8)
        host[:len(data)] = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        with self._cupy.cuda.Device(self.device), self._stream:
            return self._cupy.asarray(host), host  # host stays referenced by the caller

    def _host(self, dev: Any) -> np.ndarray:
        with self._cupy.cuda.Device(self.device):
            out = dev.get(stream=self._stream)
            self._stream.synchronize()
        return out

    def _send_header(self, what: str, dst: int, tag: int, nbytes: int) -> None:
        dev, _staging = self._device_bytes(np.array([tag, nbytes], dtype=np.int64).view(np.uint8))
        self._p2p(what, dev, dst, True)

    def _recv_header(self, what: str, src: int) -> tuple[int, int]:
        dev, _staging = self._device_bytes(b"", 16)
        self._p2p(what, dev, src, False)
        tag, nbytes = self._host(dev).view(np.int64)
        return int(tag), int(nbytes)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's pickled ``obj``, in rank order, gathered through device buffers.

        Blocking, and refused inside :func:`group_calls`; two all-gathers (the
        lengths, then the padded payloads).
        """
        require_no_group("allgather_object")
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        lengths, _h = self._device_bytes(np.array([len(data)], dtype=np.int64).view(np.uint8))
        all_lengths, _h2 = self._device_bytes(b"", 8 * self.world_size)
        self._all_gather(lengths, all_lengths, [8] * self.world_size, False)
        sizes = self._host(all_lengths).view(np.int64).tolist()
        width = max(sizes)
        mine, _h3 = self._device_bytes(data, width)
        everything, _h4 = self._device_bytes(b"", width * self.world_size)
        self._all_gather(mine, everything, [width] * self.world_size, False)
        host = self._host(everything)
        return [pickle.loads(host[k * width:k * width + n].tobytes()) for k, n in enumerate(sizes)]

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj``, pickled through a device buffer (the root gets ``obj`` itself)."""
        require_no_group("broadcast_object")
        self._check_root(root, "broadcast_object", "root")
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        length, _h = self._device_bytes(np.array([len(data)], dtype=np.int64).view(np.uint8))
        self._broadcast(length, root, False)
        n = int(self._host(length).view(np.int64)[0])
        payload, _h2 = self._device_bytes(data, n)
        self._broadcast(payload, root, False)
        if self.rank == root:
            return obj
        return pickle.loads(self._host(payload).tobytes())

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Pickle ``obj`` and send a (tag, length) header then the payload to ``dst``."""
        require_no_group("send_object")
        self._check_peer(dst, "send_object", "dst")
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._send_header("send_object", dst, tag, len(data))
        payload, _h = self._device_bytes(data)
        self._p2p("send_object", payload, dst, True)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object ``src`` sent.

        Raises:
            CollectiveMismatchError: that object was sent with another ``tag``
                (it is dropped: NCCL delivers a pair's messages in order).
        """
        require_no_group("recv_object")
        self._check_peer(src, "recv_object", "src")
        got_tag, n = self._recv_header("recv_object", src)
        payload, _h = self._device_bytes(b"", n)
        self._p2p("recv_object", payload, src, False)  # even on a wrong tag: keep the pair in step
        if got_tag != tag:
            raise CollectiveMismatchError(
                f"recv_object from rank {src}: the next message has tag {got_tag}, this receive "
                f"expects tag {tag}; NCCL delivers the messages between two ranks in the order "
                "they were sent, so receive them in that order (the message was dropped)")
        return pickle.loads(self._host(payload).tobytes())

    # --- groups and life cycle ------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> NcclBackend | None:
        """A communicator over ``ranks``: a fresh unique id from its first member.

        Every rank of this communicator must call it (it broadcasts over
        this communicator); members then create the new communicator together.
        """
        require_no_group("new_group")
        ranks = tuple(int(r) for r in ranks)
        for r in ranks:
            self._check_root(r, "new_group", "rank")
        if not ranks or len(set(ranks)) != len(ranks):
            raise RankError(f"new_group: ranks {list(ranks)} must be distinct and non-empty")
        all_ranks = self.allgather_object(ranks)
        if any(r != ranks for r in all_ranks):
            raise CollectiveMismatchError(
                "new_group: ranks disagree on the members: "
                + ", ".join(f"rank {k} passed {list(r)}" for k, r in enumerate(all_ranks)))
        uid = self.generate_unique_id() if self.rank == ranks[0] else None
        uid = self.broadcast_object(uid, ranks[0])
        if self.rank not in ranks:
            return None
        sub_rank, size = ranks.index(self.rank), len(ranks)
        where = f"sub-group rank {sub_rank} of {size} (GPU {self.device})"
        with self._cupy.cuda.Device(self.device), \
                NcclCall(self._nccl, "new_group (ncclCommInitRank)", where):
            comm = self._nccl.NcclCommunicator(size, uid.to_cupy(), sub_rank)
        hosts = tuple(self._hosts[r] for r in ranks) if self._hosts else None
        return NcclBackend._wrap(self._cupy, self._nccl, comm, sub_rank, size, self.device,
                                 self.timeout, hosts, self._link)

    def close(self) -> None:
        """Finish outstanding work and destroy the communicator (idempotent).

        After another rank of a :meth:`create_world` failed, or when the
        outstanding work does not finish in time, the communicator is
        aborted instead (``ncclCommAbort``), which does not wait for peers.
        """
        if self._closed:
            return
        abort = self._link.reason is not None
        if not abort:
            try:
                self.synchronize()
            except (CollectiveTimeoutError, WorldAbortedError, NcclError, GroupedCallError):
                abort = True
        self._closed = True
        self._inflight.clear()
        with self._cupy.cuda.Device(self.device):
            if abort and hasattr(self._comm, "abort"):
                self._comm.abort()
            else:
                self._comm.destroy()


def _check_rank_args(rank: int, world_size: int, what: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{what}: world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{what}: rank={rank!r} must be in 0..{world_size - 1}")
