"""NcclBackend: one rank's NCCL communicator on one GPU (see :mod:`axondist.backends.nccl`)."""

from __future__ import annotations

import collections
import itertools
import pickle
import secrets
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
    Entry,
    NcclCall,
    NcclWork,
    PendingCall,
    RankState,
    WorldLink,
    check_pair,
    device_count,
    group_calls,
    load_cupy,
    mismatch_error,
    named_signatures,
    new_communicator,
    recorded_call,
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
from .base import (
    Backend,
    Signature,
    Work,
    checks_enabled,
    compare_signatures,
    debug_enabled,
    default_timeout,
)
from .recorder import FlightRecorder, describe_detail

#: Seconds past the timeout a wait keeps polling for the watchdog's verdict, which names the
#: missing ranks, before it gives up on its own.
_VERDICT_GRACE = 10.0
#: Distinct (call, arguments) pairs whose check buffers stay on the device.
_CHECK_CACHE = 4096
#: Seconds a mismatch report keeps asking peers that did not answer for their call.
_MISMATCH_PATIENCE = 5.0

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
    blocks until all have joined), then the ranks exchange host names (for
    :meth:`node_info`), their settings (which must agree) and the addresses
    of their watchdogs, started here for more than one rank.

    Every collective is numbered and recorded in the rank's flight recorder
    (begun when enqueued, stamped done once the GPU finished it) and, unless
    ``AXONDIST_CHECKS=0``, starts with a 16-byte ``ncclAllReduce`` (MAX of a
    hash pair of its name and arguments) whose result the host reads: ranks
    that disagree raise :class:`~axondist.errors.CollectiveMismatchError`
    before any data moves. Calls inside :meth:`grouped` are recorded, not
    checked. The watchdog warns about a stalled call naming the missing ranks
    and, at the timeout or when a needed rank left, aborts the rank's
    communicators (``ncclCommAbort``): the waiting call raises its report.

    Raises:
        BackendUnavailableError: CuPy, NCCL or a GPU is missing.
        ValueError: rank, world size or device out of range.
        NcclError: NCCL failed to create the communicator.
    """

    name = "nccl"
    host_collectives = False
    serial_p2p = True
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
            comm = new_communicator(nccl, world_size, uid, rank)
        wait = default_timeout() if timeout is None else float(timeout)
        host = socket.gethostname()
        state = RankState(rank, world_size, host, wait, checks=checks_enabled(),
                          debug=debug_enabled())
        self._setup(cupy, nccl, comm, rank, world_size, device, None, WorldLink(), state,
                    "world", range(world_size), is_world=True)
        self._join_job(host)

    def _setup(self, cupy: ModuleType, nccl: ModuleType, comm: Any, rank: int, world_size: int,
               device: int, hosts: tuple[str, ...] | None, link: WorldLink, state: RankState,
               group: str, members: Sequence[int], *, is_world: bool) -> None:
        self._cupy, self._nccl, self._comm = cupy, nccl, comm
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = state.timeout
        self._hosts = hosts
        self._link = link
        self._closed = False
        self._inflight: collections.deque[NcclWork] = collections.deque()
        self._version = parse_nccl_version(nccl.get_version())
        self._state = state
        self._is_world = is_world
        self._group, self._p2p_group = group, f"{group}:p2p"
        self._members = tuple(members)
        state.recorder.groups[group] = state.recorder.groups[self._p2p_group] = self._members
        state.comms.append(comm)
        self._seqs, self._p2p_seqs = itertools.count(1), itertools.count(1)
        self._groups_made = 0
        self._checked = (state.checks or state.debug) and world_size > 1
        #: axondist.comm builds signature tuples only for the debug comparison.
        self.needs_signature = state.debug
        self._pairs: dict[tuple[str, tuple[Any, ...]], Any] = {}
        self._plans: dict[tuple[Any, ReduceOp], ReducePlan] = {}
        with cupy.cuda.Device(device):
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._ready = cupy.cuda.Event(disable_timing=True)
            self._barrier_buf = cupy.empty(1, dtype=np.int32)  # its value does not matter
            self._check_out = cupy.empty(2, dtype=np.int64)
            self._read_stream = cupy.cuda.Stream(non_blocking=True)
        self._broken: str | None = None  # why a mismatch aborted the communicator

    @classmethod
    def _wrap(cls, cupy: ModuleType, nccl: ModuleType, comm: Any, rank: int, world_size: int,
              device: int, hosts: tuple[str, ...] | None, link: WorldLink, state: RankState,
              group: str, members: Sequence[int], *, is_world: bool) -> NcclBackend:
        self = cls.__new__(cls)
        self._setup(cupy, nccl, comm, rank, world_size, device, hosts, link, state, group,
                    members, is_world=is_world)
        return self

    def _join_job(self, host: str) -> None:
        """Exchange host names and settings (which must agree), then start the watchdog."""
        state, n = self._state, self.world_size
        settings = (state.checks, state.debug, self.timeout)
        table = self._allgather_object_raw((host, settings))
        if any(t[1] != settings for t in table):
            state.abort_all()
            detail = "; ".join(f"rank {k}: checks={t[1][0]}, debug={t[1][1]}, timeout={t[1][2]:g}"
                               for k, t in enumerate(table))
            raise ValueError(f"NcclBackend: the ranks were started with different axondist "
                             f"settings ({detail}); set AXONDIST_CHECKS, AXONDIST_DEBUG and "
                             "AXONDIST_TIMEOUT (or timeout=) alike on every rank")
        self._hosts = tuple(t[0] for t in table)
        if n > 1:
            token = self._broadcast_object_raw(secrets.token_hex(16) if self.rank == 0 else "", 0)
            watchdog = state.make_watchdog(token)
            watchdog.start(self._allgather_object_raw(watchdog.address))

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
        wait = default_timeout() if timeout is None else float(timeout)
        checks, debug = checks_enabled(), debug_enabled()
        with NcclCall(nccl, "create_world (ncclCommInitAll)", f"GPUs {devices}"):
            comms = nccl.NcclCommunicator.initAll(devices)
        host = socket.gethostname()
        link = WorldLink()
        backends = [cls._wrap(cupy, nccl, comm, r, n, d, (host,) * n, link,
                              RankState(r, n, host, wait, checks=checks, debug=debug), "world",
                              range(n), is_world=True)
                    for r, (comm, d) in enumerate(zip(comms, devices))]
        if n > 1:
            token = secrets.token_hex(16)
            dogs = [b._state.make_watchdog(token) for b in backends]
            for dog in dogs:
                dog.start([d.address for d in dogs])
        return backends

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

    @property
    def recorder(self) -> FlightRecorder:  # type: ignore[override]
        """This rank's flight recorder (shared by its groups), completed calls stamped."""
        self._sweep()
        return self._state.recorder

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
        while self._inflight:
            self._inflight.popleft().is_completed()  # stamps each one's recorder entry

    def __repr__(self) -> str:
        return f"NcclBackend(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    # --- the launch machinery -------------------------------------------------------------
    def _where(self) -> str:
        return f"rank {self.rank} of {self.world_size} (GPU {self.device})"

    def _call(self, op: str) -> NcclCall:
        return NcclCall(self._nccl, op, self._where())

    def _usable(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"{op}: the nccl backend of {self._where()} was closed")
        if self._state.verdict is not None:
            raise self._state.verdict_error(op, self._where())
        if self._broken is not None:
            raise CollectiveMismatchError(
                f"{op}: the NCCL communicator of {self._where()} was aborted after a mismatched "
                f"call and cannot be used any more: {self._broken}")

    def _launch(self, op: str, issue: Callable[[], None], *, result: Any, keep: tuple[Any, ...],
                async_op: bool, post: Callable[[], Any] | None = None,
                entry: Entry | None = None, follow_caller: bool = True) -> NcclWork:
        """Order after the caller's stream (unless ``follow_caller`` is false), enqueue
        ``issue()``, then finish or defer to a group; ``entry`` is stamped on completion."""
        self._usable(op)
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            current = cupy.cuda.get_current_stream()
            if follow_caller and current.ptr != self._stream.ptr:
                self._ready.record(current)
                self._stream.wait_event(self._ready)
            with self._call(op):
                issue()
            work = NcclWork(self, op, result, keep, entry)
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
        self._sweep()
        self._inflight.append(work)

    def _sweep(self) -> None:
        """Forget (and stamp in the recorder) the leading in-flight calls that completed."""
        while self._inflight and self._inflight[0].is_completed():
            self._inflight.popleft()

    def _wait_event(self, event: Any, op: str, timeout: float | None) -> None:
        """Poll ``event`` until done; time out, notice aborts, the watchdog's verdict and
        NCCL's async errors.

        With ``timeout`` None the backend's timeout applies and the watchdog
        (when there is one) decides first; an explicit ``timeout`` leaves the
        operation running.
        """
        state = self._state
        if not event.done:
            self._poll(event, op, timeout)
        if state.verdict is not None or self._broken is not None:
            self._usable(op)  # an aborted call's event completes too: never return its result

    def _poll(self, event: Any, op: str, timeout: float | None) -> None:
        state = self._state
        if timeout is not None:
            limit = float(timeout)
        else:
            limit = self.timeout + (_VERDICT_GRACE if state.watchdog is not None else 0.0)
        state.polling[id(event)] = event
        try:
            self._poll_until(event, op, timeout, limit)
        finally:
            state.polling.pop(id(event), None)

    def _poll_until(self, event: Any, op: str, timeout: float | None, limit: float) -> None:
        state = self._state
        start = time.monotonic()
        spin_until, next_check = start + 1e-4, start + 0.25
        delay = 1e-5
        while not event.done and state.verdict is None and self._broken is None:
            now = time.monotonic()
            if self._link.reason is not None:
                raise WorldAbortedError(f"{op} cancelled on {self._where()}: {self._link.reason}")
            if now >= next_check:
                next_check = now + 0.25
                if self._version >= (2, 4, 0):
                    with self._call(op):
                        self._comm.check_async_error()
            if now - start > limit:
                if timeout is None:
                    raise state.timeout_error(op, self._where(), limit)
                raise CollectiveTimeoutError(
                    f"{op}: not completed within {limit:g} s on {self._where()}; it keeps "
                    "running: call wait() again (every rank of the group must make the same "
                    "calls in the same order; NCCL_DEBUG=INFO shows where each rank is)")
            if now >= spin_until:
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)

    def _check(self, x: Any, op: str, *, writable: bool = False) -> None:
        check_device_array(x, op, self.device, writable=writable)

    # --- recording and checking ----------------------------------------------------------
    def _begin_call(self, op: str, key: tuple[Any, ...], signature: Signature = (),
                    blocking: bool = True) -> Entry:
        """Number and record collective ``op``; for a blocking call (outside groups) then
        the cross-rank check, settled before anything else is enqueued."""
        self._usable(op)
        entry = self._state.begin(self._group, next(self._seqs), op, key, blocking)
        if self._checked and not GROUP_STATE.depth and (blocking or self._state.debug):
            try:
                if self._state.debug:
                    self._agree_by_name(op, key, signature)
                else:
                    self._agree(op, key, entry)
            except BaseException:
                self._state.finish(entry)
                raise
        return entry

    def _collective(self, op: str, key: tuple[Any, ...], signature: Signature,
                    issue: Callable[[], None], *, result: Any, keep: tuple[Any, ...],
                    async_op: bool, post: Callable[[], Any] | None = None) -> NcclWork:
        """:meth:`_launch` of collective ``op`` whose arguments are ``key``, recorded, checked.

        An async call's check is enqueued just before it and settled in
        ``wait()``, before its data is waited for: the host does not wait for
        the peers when issuing it.
        """
        entry = self._begin_call(op, key, signature, not async_op)
        try:
            check = None
            if async_op and self._checked and not GROUP_STATE.depth and not self._state.debug:
                check = self._check_later(op, key, entry)
            work = self._launch(op, issue, result=result, keep=keep, async_op=async_op,
                                post=post, entry=entry)
        except BaseException:
            self._state.finish(entry)
            raise
        work._check = check
        return work

    def _issue_check(self, op: str, key: tuple[Any, ...], out: Any, async_op: bool) -> NcclWork:
        """Enqueue the check's MAX all-reduce of ``[h, -h]`` into ``out``; it follows this
        backend's earlier calls, not the caller's stream."""
        pair = self._pairs.get((op, key))
        if pair is None:
            pair = self._device_pair(op, key)
        stream = self._stream.ptr

        def issue() -> None:
            self._comm.allReduce(pair.data.ptr, out.data.ptr, 2, NCCL_DTYPES["int64"],
                                 NCCL_OPS["max"], stream)

        return self._launch(op, issue, result=None, keep=(pair, out), async_op=async_op,
                            follow_caller=False)

    def _agree(self, op: str, key: tuple[Any, ...], entry: Entry) -> None:
        """Return when every rank calls ``op`` with ``key``, else raise the mismatch on all."""
        since = time.monotonic()
        self._issue_check(op, key, self._check_out, False)
        got = self._host(self._check_out)
        if got[0] != -got[1]:
            raise self._mismatch(op, key, entry.group, entry.seq, True, since)

    def _check_later(self, op: str, key: tuple[Any, ...],
                     entry: Entry) -> Callable[[float | None], None]:
        """Enqueue an async call's check; what verifies it (``wait(timeout)`` calls it)."""
        with self._cupy.cuda.Device(self.device):
            out = self._cupy.empty(2, dtype=np.int64)  # its own: later checks may run first
        since = time.monotonic()
        work = self._issue_check(op, key, out, True)
        group, seq = entry.group, entry.seq

        def settle(timeout: float | None) -> None:
            work.wait(timeout)
            with self._cupy.cuda.Device(self.device):
                got = out.get(stream=self._read_stream)  # the main stream may be stuck
            if got[0] != -got[1]:
                raise self._mismatch(op, key, group, seq, False, since)

        return settle

    def _device_pair(self, op: str, key: tuple[Any, ...]) -> Any:
        if len(self._pairs) >= _CHECK_CACHE:
            self._pairs.clear()
        with self._cupy.cuda.Device(self.device), self._stream:
            pair = self._pairs[(op, key)] = self._cupy.asarray(check_pair(op, key))
        return pair

    def _mismatch(self, op: str, key: tuple[Any, ...], group: str, seq: int,
                  blocking: bool, since: float) -> CollectiveMismatchError:
        """The error of a failed check (issued at ``since``), naming the ranks and what
        differs.

        The peers' calls are read from their flight recorders over the
        watchdog's side channel, not over this communicator, which is out of
        step when a peer's call was async (its data call is enqueued already):
        then, or when a peer did not answer, the communicator is aborted. Before
        returning, the rank waits (up to ``_MISMATCH_PATIENCE``) until the peers it
        read have read it too: a rank that raised and left at once would leave a
        slower peer without an answer.
        """
        me = self._members[self.rank]
        query = self._state.recorder.query_peers
        statuses: dict[int, Any] = {}
        unknown = [m for m in self._members if m != me]
        # A peer under load may answer late, or not have recorded the call yet: ask again
        # for up to _MISMATCH_PATIENCE seconds (the error path only) before calling its
        # call unknown, which costs the communicator.
        give_up, pause = time.monotonic() + _MISMATCH_PATIENCE, 0.05
        while query is not None and unknown:
            statuses.update(query(unknown))
            unknown = [m for m in unknown if recorded_call(statuses.get(m), group, seq) is None]
            if not unknown or time.monotonic() + pause > give_up:
                break
            time.sleep(pause)
            pause = min(2 * pause, 0.8)
        calls = [(op, describe_detail(key, op), blocking) if m == me
                 else recorded_call(statuses.get(m), group, seq) for m in self._members]
        error, unsafe = mismatch_error(op, calls)
        watchdog = self._state.watchdog
        if watchdog is not None:
            known = [m for m in self._members if m != me and m not in unknown]
            watchdog.wait_asked(known, since, _MISMATCH_PATIENCE)
        if unsafe:
            self._break(str(error))
            error = CollectiveMismatchError(
                f"{error}; a rank's call was async or is unknown, so its data call may be "
                "enqueued already: this group's NCCL communicator was aborted (ncclCommAbort) "
                "and cannot be used any more")
        return error

    def _break(self, reason: str) -> None:
        """Abort this communicator after a mismatch left it out of step."""
        self._broken = reason
        if self._comm in self._state.comms:
            self._state.comms.remove(self._comm)
        with self._cupy.cuda.Device(self.device):
            self._comm.abort()

    def _agree_by_name(self, op: str, key: tuple[Any, ...], signature: Signature) -> None:
        """``AXONDIST_DEBUG=1``: every argument exchanged (pickled) and compared by name,
        for async calls too (which then wait for their peers)."""
        calls = self._allgather_object_raw(((op, key), tuple(signature)))
        error = compare_signatures(op, named_signatures([c[0] for c in calls]))
        if error is None and any(c != calls[0] for c in calls):
            error = compare_signatures(op, [(("op", c[0][0]),) + c[1] for c in calls])
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
        """The (dtype, op) pair's plan, made once (a refused pair raises every time)."""
        plan = self._plans.get((x.dtype, op))
        if plan is None:
            plan = self._plans[x.dtype, op] = reduce_plan(x.dtype, op, self._version, what)
        return plan

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
        count = buf.size * plan.count_factor

        def issue() -> None:
            if count:
                p = buf.data.ptr
                self._comm.allReduce(p, p, count, plan.nccl_dtype, plan.nccl_op, self._stream.ptr)

        return self._collective("all_reduce", (buf.dtype, buf.shape, op.name, async_op),
                                signature, issue, result=buf, keep=(buf,), async_op=async_op,
                                post=self._divide_post(buf, plan))

    def broadcast(self, buf: Any, root: int, *, signature: Signature = (),
                  async_op: bool = False) -> Work:
        """``ncclBroadcast`` of ``root``'s ``buf`` (as bytes) into every rank's ``buf``."""
        self._check(buf, "broadcast", writable=True)
        self._check_root(root, "broadcast", "root")
        return self._broadcast(buf, root, async_op, (buf.dtype, buf.shape, int(root), async_op),
                               signature)

    def _broadcast(self, buf: Any, root: int, async_op: bool, key: tuple[Any, ...] | None = None,
                   signature: Signature = ()) -> NcclWork:
        """``ncclBroadcast`` of ``buf``'s bytes; recorded and checked when ``key`` is given."""
        def issue() -> None:
            if buf.nbytes:
                p = buf.data.ptr
                self._comm.broadcast(p, p, buf.nbytes, NCCL_BYTE, root, self._stream.ptr)

        if key is None:
            return self._launch("broadcast", issue, result=buf, keep=(buf,), async_op=async_op)
        return self._collective("broadcast", key, signature, issue, result=buf, keep=(buf,),
                                async_op=async_op)

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
        return self._all_gather(send, recv, counts, async_op,
                                (send.dtype, tuple(counts), async_op), signature)

    def _all_gather(self, send: Any, recv: Any, counts: list[int], async_op: bool,
                    key: tuple[Any, ...] | None = None, signature: Signature = ()) -> NcclWork:
        """The all-gather; recorded and checked when ``key`` is given."""
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

        if key is None:
            return self._launch("all_gather", issue, result=recv, keep=(send, recv),
                                async_op=async_op)
        return self._collective("all_gather", key, signature, issue, result=recv,
                                keep=(send, recv), async_op=async_op)

    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: ReduceOp, *,
                       signature: Signature = (), async_op: bool = False) -> Work:
        """``ncclReduceScatter``: this rank's block of the reduced ``send`` lands in ``recv``.

        Uneven ``counts`` become one ``ncclReduce`` per rank inside an NCCL group.
        """
        self._check(send, "reduce_scatter")
        self._check(recv, "reduce_scatter", writable=True)
        counts = self._check_counts("reduce_scatter", counts, recv, send, "recv", "send")
        plan = self._plan(send, op, "reduce_scatter")
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

        return self._collective("reduce_scatter", (send.dtype, tuple(counts), op.name, async_op),
                                signature, issue, result=recv, keep=(send, recv),
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

        return self._collective("gather", (send.dtype, tuple(counts), int(root), async_op),
                                signature, issue, result=recv if is_root else None,
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

        return self._collective("scatter", (recv.dtype, tuple(counts), int(root), async_op),
                                signature, issue, result=recv, keep=(send, recv),
                                async_op=async_op)

    def barrier(self) -> None:
        """An all-reduce of one number, waited for on the host."""
        require_no_group("barrier")
        buf = self._barrier_buf
        self._collective("barrier", (), (), lambda: self._comm.allReduce(
            buf.data.ptr, buf.data.ptr, 1, NCCL_DTYPES["int32"], NCCL_OPS["sum"],
            self._stream.ptr), result=None, keep=(), async_op=False)

    def metadata_buffer(self, values: Any) -> Any:
        """A copy of the host array ``values`` on this backend's GPU (NCCL reads device
        memory only), made on the caller's stream, which the collectives follow."""
        with self._cupy.cuda.Device(self.device):
            return self._cupy.asarray(values)

    # --- point to point -------------------------------------------------------------------
    def _check_peer(self, peer: int, what: str, arg: str) -> None:
        self._check_root(peer, what, arg)
        if peer == self.rank:
            raise RankError(f"{what}: {arg}={peer} is this rank; NCCL cannot send a message to "
                            "the same rank outside a group (copy the array instead)")

    def _begin_p2p(self, what: str, peer: int, tag: int) -> Entry:
        """Number and record a send or receive (apart from the collectives, which every rank
        must count alike)."""
        self._usable(what)
        return self._state.begin(self._p2p_group, next(self._p2p_seqs), what,
                                 (("peer", self._members[peer]), ("tag", tag)), True)

    def _p2p(self, what: str, buf: Any, peer: int, sending: bool,
             entry: Entry | None = None) -> None:
        stream = self._stream.ptr

        def issue() -> None:
            if buf.nbytes:
                if sending:
                    self._comm.send(buf.data.ptr, buf.nbytes, NCCL_BYTE, peer, stream)
                else:
                    self._comm.recv(buf.data.ptr, buf.nbytes, NCCL_BYTE, peer, stream)

        # Blocking: returns once the message is out (inside a group: once the group ended).
        try:
            self._launch(what, issue, result=None, keep=(buf,), async_op=False, entry=entry)
        except BaseException:
            if entry is not None:
                self._state.finish(entry)
            raise

    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """``ncclSend`` of ``buf``'s bytes; returns once it was received.

        NCCL has no tags: ``tag`` is ignored and messages between two ranks
        match in the order they were sent. Two ranks that send to each other
        must do it inside :meth:`grouped` (NCCL pairs the calls), or one of
        them must receive first.
        """
        self._check(buf, "send")
        self._check_peer(dst, "send", "dst")
        self._p2p("send", buf, dst, True, self._begin_p2p("send", dst, tag))

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """``ncclRecv`` into ``buf``, whose size must equal the message's (``tag`` is ignored)."""
        self._check(buf, "recv", writable=True)
        self._check_peer(src, "recv", "src")
        self._p2p("recv", buf, src, False, self._begin_p2p("recv", src, tag))

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
        entry = self._begin_call("allgather_object", ())
        try:
            return self._allgather_object_raw(obj)
        finally:
            self._state.finish(entry)

    def _allgather_object_raw(self, obj: Any) -> list[Any]:
        """:meth:`allgather_object` without recording or checking (the check's own exchange)."""
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
        entry = self._begin_call("broadcast_object", (int(root),))
        try:
            return self._broadcast_object_raw(obj, root)
        finally:
            self._state.finish(entry)

    def _broadcast_object_raw(self, obj: Any, root: int) -> Any:
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
        entry = self._begin_p2p("send_object", dst, tag)
        try:
            self._send_header("send_object", dst, tag, len(data))
            payload, _h = self._device_bytes(data)
            self._p2p("send_object", payload, dst, True)
        finally:
            self._state.finish(entry)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object ``src`` sent.

        Raises:
            CollectiveMismatchError: that object was sent with another ``tag``
                (it is dropped: NCCL delivers a pair's messages in order).
        """
        require_no_group("recv_object")
        self._check_peer(src, "recv_object", "src")
        entry = self._begin_p2p("recv_object", src, tag)
        try:
            got_tag, n = self._recv_header("recv_object", src)
            payload, _h = self._device_bytes(b"", n)
            self._p2p("recv_object", payload, src, False)  # even on a wrong tag: keep in step
        finally:
            self._state.finish(entry)
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
        It shares this rank's flight recorder and watchdog, as group
        ``<this group>.<k>`` (the k-th made from this one).
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
        name = f"{self._group}.{self._groups_made}"
        self._groups_made += 1
        if self.rank not in ranks:
            return None
        sub_rank, size = ranks.index(self.rank), len(ranks)
        where = f"sub-group rank {sub_rank} of {size} (GPU {self.device})"
        with self._cupy.cuda.Device(self.device), \
                NcclCall(self._nccl, "new_group (ncclCommInitRank)", where):
            comm = new_communicator(self._nccl, size, uid, sub_rank)
        hosts = tuple(self._hosts[r] for r in ranks) if self._hosts else None
        return NcclBackend._wrap(self._cupy, self._nccl, comm, sub_rank, size, self.device,
                                 hosts, self._link, self._state, name,
                                 [self._members[r] for r in ranks], is_world=False)

    def close(self) -> None:
        """Finish outstanding work and destroy the communicator (idempotent).

        After another rank of a :meth:`create_world` failed, or when the
        outstanding work does not finish in time, the communicator is
        aborted instead (``ncclCommAbort``), which does not wait for peers.
        Closing the world backend stops the rank's watchdog; after a clean
        close it tells the peers this rank left (a peer still waiting for it
        then fails at once, naming it).
        """
        if self._closed:
            return
        state = self._state
        abort = (self._link.reason is not None or state.verdict is not None
                 or self._broken is not None)
        if not abort:
            try:
                self.synchronize()
            except (CollectiveTimeoutError, CollectiveMismatchError, WorldAbortedError, NcclError,
                    GroupedCallError):
                abort = True
        self._closed = True
        self._inflight.clear()
        state.recorder.groups.pop(self._group, None)
        state.recorder.groups.pop(self._p2p_group, None)
        if self._comm in state.comms:
            state.comms.remove(self._comm)
        with self._cupy.cuda.Device(self.device):
            if state.verdict is not None or self._broken is not None:
                pass  # aborted already
            elif abort and hasattr(self._comm, "abort"):
                self._comm.abort()
            else:
                self._comm.destroy()
        if self._is_world and state.watchdog is not None:
            if abort:
                state.watchdog.stop()
            else:
                state.watchdog.announce_left()
                state.watchdog.close()  # no server thread outlives an in-process world


def _check_rank_args(rank: int, world_size: int, what: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{what}: world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{what}: rank={rank!r} must be in 0..{world_size - 1}")
