"""One rank's NCCL communicator (:class:`Communicator`): the state every call reads (CuPy's
communicator, stream, flight recorder, checks), the launch machinery that orders a call
after the caller's stream, enqueues it and waits for its event, the recording and
cross-rank check of each call, and the unrecorded byte exchanges the check and the object
messages ride on. :class:`~axondist.backends.nccl.NcclBackend` holds one; its plans
(:mod:`.plans`) and messages (:mod:`.messages`) use its public methods only.
"""

from __future__ import annotations

import collections
import itertools
import pickle
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from ...errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankError,
    WorldAbortedError,
)
from ..checks import Key, check_words, compare_signatures
from ..recording.recorder import describe_detail
from .basics import (
    NCCL_BYTE,
    NCCL_DTYPES,
    NCCL_OPS,
    ReducePlan,
    check_device_array,
    nccl_error,
    parse_nccl_version,
)
from .runtime import (
    GROUP_STATE,
    Entry,
    NcclCall,
    NcclWork,
    PendingCall,
    RankState,
    WorldLink,
    mismatch_error,
    named_signatures,
    recorded_call,
)

#: Seconds past the timeout a wait keeps polling for the watchdog's verdict, which names the
#: missing ranks, before it gives up on its own.
_VERDICT_GRACE = 10.0
#: Distinct (call, arguments) pairs whose check buffers stay on the device.
_CHECK_CACHE = 4096
#: Seconds a mismatch report keeps asking peers that did not answer for their call.
_MISMATCH_PATIENCE = 5.0
#: Async calls kept for their completion before the completed ones are looked for.
_TRACKED = 64


class Communicator:
    """This rank's NCCL communicator on one GPU and what every call on it reads: its stream,
    the launch machinery, the recording of each call and the cross-rank check.

    Args:
        cupy: the ``cupy`` module.
        nccl: ``cupy.cuda.nccl``.
        comm: CuPy's ``NcclCommunicator``.
        rank: this rank in the communicator.
        world_size: ranks in the communicator.
        device: the CUDA device id it runs on.
        hosts: every member's host name, when known.
        link: what the backends of one :meth:`NcclBackend.create_world` share.
        state: what the backends of this rank share (recorder, watchdog, settings).
        group: the group's name in the flight recorder.
        members: the group's members as world ranks, in rank order.
        is_world: the world's communicator (closing it stops the rank's watchdog).
    """

    def __init__(self, cupy: ModuleType, nccl: ModuleType, comm: Any, rank: int,
                 world_size: int, device: int, hosts: tuple[str, ...] | None, link: WorldLink,
                 state: RankState, group: str, members: Sequence[int], *,
                 is_world: bool) -> None:
        self.cupy, self.nccl, self.nccl_comm = cupy, nccl, comm
        self.rank, self.world_size, self.device = rank, world_size, device
        self._here = f"rank {rank} of {world_size} (GPU {device})"  # for messages
        #: What CuPy raises when an NCCL call fails (nothing to catch where it has none).
        self._nccl_errors: Any = getattr(nccl, "NcclError", ())
        self.timeout = state.timeout
        #: Every rank's host name (for ``node_info``), once exchanged.
        self.hosts = hosts
        self.link = link
        self.closed = False
        self.inflight: collections.deque[NcclWork] = collections.deque()
        self.version = parse_nccl_version(nccl.get_version())
        self.state = state
        self.is_world = is_world
        self.group, self.p2p_group = group, f"{group}:p2p"
        self.members = tuple(members)
        state.recorder.groups[group] = state.recorder.groups[self.p2p_group] = self.members
        state.comms.append(comm)
        self._seqs, self._p2p_seqs = itertools.count(1), itertools.count(1)
        self.groups_made = 0
        self._checked = (state.checks or state.debug) and world_size > 1
        self._pairs: dict[tuple[str, tuple[Any, ...]], Any] = {}
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self._ready = cupy.cuda.Event(disable_timing=True)
            self._barrier_buf = cupy.empty(1, dtype=np.int32)  # its value does not matter
            self._check_out = cupy.empty(2, dtype=np.int64)
            self._read_stream = cupy.cuda.Stream(non_blocking=True)
        #: Why a mismatch aborted the communicator (None: it did not).
        self.broken: str | None = None

    # --- the launch machinery -------------------------------------------------------------
    def where(self) -> str:
        return self._here

    def _call(self, op: str) -> NcclCall:
        return NcclCall(self.nccl, op, self.where())

    def usable(self, op: str) -> None:
        if self.closed:
            raise RuntimeError(f"{op}: the nccl backend of {self.where()} was closed")
        if self.state.verdict is not None:
            raise self.state.verdict_error(op, self.where())
        if self.broken is not None:
            raise CollectiveMismatchError(
                f"{op}: the NCCL communicator of {self.where()} was aborted after a mismatched "
                f"call and cannot be used any more: {self.broken}")

    def launch(self, op: str, issue: Callable[[], None], *, result: Any, keep: tuple[Any, ...],
               async_op: bool, post: Callable[[], Any] | None = None,
               entry: Entry | None = None, follow_caller: bool = True) -> NcclWork:
        """:meth:`_enqueue` with this backend's GPU made current (for calls outside
        :meth:`collective`, which enters it itself)."""
        self.usable(op)
        with self.cupy.cuda.Device(self.device):
            return self._enqueue(op, issue, result, keep, async_op, post, entry, follow_caller)

    def _enqueue(self, op: str, issue: Callable[[], None], result: Any, keep: tuple[Any, ...],
                 async_op: bool, post: Callable[[], Any] | None, entry: Entry | None,
                 follow_caller: bool = True) -> NcclWork:
        """Order after the caller's stream (unless ``follow_caller`` is false), enqueue
        ``issue()``, then wait (blocking) or record the completion event (async); inside a
        group, defer both to its end. The backend's GPU is current.

        A blocking call records no event of its own: the host polls the stream, which is
        done once this call and everything enqueued before it are. The caller's stream
        costs an event only when it is not this backend's stream.
        """
        stream = self.stream
        if follow_caller:
            current = self.cupy.cuda.get_current_stream()
            if current.ptr != stream.ptr:
                self._ready.record(current)
                stream.wait_event(self._ready)
        try:
            issue()
        except self._nccl_errors as exc:
            raise nccl_error(op, exc, self._here) from exc
        work = NcclWork(self, op, result, keep, entry)
        if GROUP_STATE.depth:
            GROUP_STATE.pending.append(PendingCall(self, work, post, not async_op))
            return work
        if post is not None:
            with stream:
                post()
        if async_op:
            work._event = event = self.cupy.cuda.Event(disable_timing=True)
            event.record(stream)
            self._track(work)
            return work
        self.wait_event(stream, op, None)
        work._finish()
        if self.inflight:
            self._stream_drained()
        return work

    def start(self, work: NcclWork, post: Callable[[], Any] | None) -> None:
        """A grouped call, once its group's kernels are enqueued: run ``post`` on the
        stream, record the completion event."""
        with self.cupy.cuda.Device(self.device):
            if post is not None:
                with self.stream:
                    post()
            event = self.cupy.cuda.Event(disable_timing=True)
            event.record(self.stream)
        work._event = event
        self._track(work)

    def _track(self, work: NcclWork) -> None:
        """Keep an async call until it is known complete (its recorder entry is stamped
        then); past :data:`_TRACKED` calls, forget the leading ones that completed."""
        inflight = self.inflight
        inflight.append(work)
        if len(inflight) > _TRACKED:
            self.sweep()

    def _stream_drained(self) -> None:
        """The stream is idle (a blocking call was waited for): every call enqueued on it
        before completed, so stamp them without asking the GPU."""
        inflight, self.inflight = self.inflight, collections.deque()
        for work in inflight:
            work._record_end()

    def sweep(self) -> None:
        """Forget (and stamp in the recorder) the leading in-flight calls that completed."""
        while self.inflight and self.inflight[0].is_completed():
            self.inflight.popleft()

    def wait_event(self, event: Any, op: str, timeout: float | None) -> None:
        """Poll ``event`` (an Event, or a Stream: done when idle) until done; time out,
        notice aborts, the watchdog's verdict and NCCL's async errors.

        With ``timeout`` None the backend's timeout applies and the watchdog
        (when there is one) decides first; an explicit ``timeout`` leaves the
        operation running.
        """
        state = self.state
        if not event.done:
            self._poll(event, op, timeout)
        if state.verdict is not None or self.broken is not None:
            self.usable(op)  # an aborted call's event completes too: never return its result

    def _poll(self, event: Any, op: str, timeout: float | None) -> None:
        state = self.state
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
        state = self.state
        start = time.monotonic()
        spin_until, next_check = start + 1e-4, start + 0.25
        delay = 1e-5
        while not event.done and state.verdict is None and self.broken is None:
            now = time.monotonic()
            if self.link.reason is not None:
                raise WorldAbortedError(f"{op} cancelled on {self.where()}: {self.link.reason}")
            if now >= next_check:
                next_check = now + 0.25
                if self.version >= (2, 4, 0):
                    with self._call(op):
                        self.nccl_comm.check_async_error()
            if now - start > limit:
                if timeout is None:
                    raise state.timeout_error(op, self.where(), limit)
                raise CollectiveTimeoutError(
                    f"{op}: not completed within {limit:g} s on {self.where()}; it keeps "
                    "running: call wait() again (every rank of the group must make the same "
                    "calls in the same order; NCCL_DEBUG=INFO shows where each rank is)")
            if now >= spin_until:
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)

    def require_on_device(self, x: Any, op: str, *, writable: bool = False) -> None:
        check_device_array(x, op, self.device, writable=writable)

    # --- recording and checking ----------------------------------------------------------
    def begin_call(self, op: str, key: tuple[Any, ...], fields: Key = (),
                   blocking: bool = True) -> Entry:
        """Number and record ``op`` (an object exchange); for a blocking call (outside
        groups) then the cross-rank check, settled before anything else is enqueued."""
        self.usable(op)
        entry = self.state.begin(self.group, next(self._seqs), op, key, blocking)
        if self._checked and not GROUP_STATE.depth and (blocking or self.state.debug):
            try:
                with self.cupy.cuda.Device(self.device):
                    if self.state.debug:
                        self._agree_by_name(op, key, fields)
                    else:
                        self._agree(op, key, entry, self._check_pair(op, key))
            except BaseException:
                self.state.finish(entry)
                raise
        return entry

    def begin_p2p(self, what: str, peer: int, tag: int) -> Entry:
        """Number and record a send or receive to or from ``peer`` (apart from the
        collectives, which every rank must count alike)."""
        self.usable(what)
        return self.state.begin(self.p2p_group, next(self._p2p_seqs), what,
                                (("peer", self.members[peer]), ("tag", tag)), True)

    def collective(self, op: str, key: tuple[Any, ...], fields: Key,
                   issue: Callable[[], None], *, result: Any, keep: tuple[Any, ...],
                   async_op: bool, post: Callable[[], Any] | None = None,
                   pair: Any = None) -> NcclWork:
        """Collective ``op`` whose arguments are ``key``: numbered, recorded, checked and
        enqueued (:meth:`_enqueue`), the GPU made current once for all of it. ``fields``
        are the call's arguments by name, which ``AXONDIST_DEBUG=1`` compares.

        A blocking call's check is settled before its data call is enqueued. An async
        call's check is enqueued just before it and settled in ``wait()``, before its data
        is waited for: the host does not wait for the peers when issuing it. ``pair`` is
        the check's device buffer when the caller keeps it (a prepared call).
        """
        self.usable(op)
        state = self.state
        entry = state.begin(self.group, next(self._seqs), op, key, not async_op)
        check = None
        try:
            with self.cupy.cuda.Device(self.device):
                if self._checked and not GROUP_STATE.depth:
                    if state.debug:
                        self._agree_by_name(op, key, fields)
                    else:
                        if pair is None:
                            pair = self._check_pair(op, key)
                        if async_op:
                            check = self._check_later(op, key, entry, pair)
                        else:
                            self._agree(op, key, entry, pair)
                work = self._enqueue(op, issue, result, keep, async_op, post, entry)
        except BaseException:
            state.finish(entry)
            raise
        work._check = check
        return work

    def _issue_check(self, op: str, pair: Any, out: Any, async_op: bool) -> NcclWork:
        """Enqueue the check's MAX all-reduce of ``pair`` (``[h, -h]``) into ``out``; it
        follows this backend's earlier calls, not the caller's stream."""
        stream, comm = self.stream.ptr, self.nccl_comm

        def issue() -> None:
            comm.allReduce(pair.data.ptr, out.data.ptr, 2, NCCL_DTYPES["int64"],
                           NCCL_OPS["max"], stream)

        return self._enqueue(op, issue, None, (pair, out), async_op, None, None,
                             follow_caller=False)

    def _agree(self, op: str, key: tuple[Any, ...], entry: Entry, pair: Any) -> None:
        """Return when every rank calls ``op`` with ``key``, else raise the mismatch on all
        (the GPU is current)."""
        since = time.monotonic()
        self._issue_check(op, pair, self._check_out, False)
        got = self._check_out.get(stream=self.stream)
        self.stream.synchronize()  # idle already; CuPy < 11 copies async when given a stream
        if got[0] != -got[1]:
            raise self._mismatch(op, key, entry.group, entry.seq, True, since)

    def _check_later(self, op: str, key: tuple[Any, ...], entry: Entry,
                     pair: Any) -> Callable[[float | None], None]:
        """Enqueue an async call's check; what verifies it (``wait(timeout)`` calls it).
        The GPU is current."""
        out = self.cupy.empty(2, dtype=np.int64)  # its own: later checks may run first
        since = time.monotonic()
        work = self._issue_check(op, pair, out, True)
        group, seq = entry.group, entry.seq

        def settle(timeout: float | None) -> None:
            work.wait(timeout)
            with self.cupy.cuda.Device(self.device):
                got = out.get(stream=self._read_stream)  # the main stream may be stuck
                self._read_stream.synchronize()
            if got[0] != -got[1]:
                raise self._mismatch(op, key, group, seq, False, since)

        return settle

    def _check_pair(self, op: str, key: tuple[Any, ...]) -> Any:
        """The device copy of call ``(op, key)``'s check words (``[h, -h]``, see
        :func:`~axondist.backends.checks.check_words`), made once per distinct call (up to
        :data:`_CHECK_CACHE` of them). The GPU is current."""
        pair = self._pairs.get((op, key))
        if pair is None:
            if len(self._pairs) >= _CHECK_CACHE:
                self._pairs.clear()
            with self.stream:
                pair = self._pairs[(op, key)] = self.cupy.asarray(check_words(op, key))
        return pair

    def check_buffer(self, op: str, key: tuple[Any, ...]) -> Any:
        """The check buffer a prepared call keeps (None when calls are not checked by hash)."""
        if not self._checked or self.state.debug:
            return None
        with self.cupy.cuda.Device(self.device):
            return self._check_pair(op, key)

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
        me = self.members[self.rank]
        query = self.state.recorder.query_peers
        statuses: dict[int, Any] = {}
        unknown = [m for m in self.members if m != me]
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
                 else recorded_call(statuses.get(m), group, seq) for m in self.members]
        error, unsafe = mismatch_error(op, calls)
        watchdog = self.state.watchdog
        if watchdog is not None:
            known = [m for m in self.members if m != me and m not in unknown]
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
        self.broken = reason
        if self.nccl_comm in self.state.comms:
            self.state.comms.remove(self.nccl_comm)
        with self.cupy.cuda.Device(self.device):
            self.nccl_comm.abort()

    def _agree_by_name(self, op: str, key: tuple[Any, ...], fields: Key) -> None:
        """``AXONDIST_DEBUG=1``: every argument exchanged (pickled) and compared by name,
        for async calls too (which then wait for their peers)."""
        calls = self.allgather_object_raw(((op, key), tuple(fields)))
        error = compare_signatures(op, named_signatures([c[0] for c in calls]))
        if error is None and any(c != calls[0] for c in calls):
            error = compare_signatures(op, [(("op", c[0][0]),) + c[1] for c in calls])
        if error is not None:
            raise error

    def check_rank(self, r: int, what: str, arg: str) -> None:
        """Raise :class:`~axondist.errors.RankError` unless ``r`` is a rank of the group."""
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self.world_size:
            raise RankError(f"{what}: {arg}={r!r} is outside the group of {self.world_size} ranks "
                            f"(valid: 0..{self.world_size - 1})")

    def mean_post(self, buf: Any, plan: ReducePlan) -> Callable[[], Any] | None:
        """What turns NCCL's sum in ``buf`` into the mean on an NCCL without ``ncclAvg``
        (None when NCCL averages itself)."""
        if not plan.divide_by_size or self.world_size == 1:
            return None
        n, xp = self.world_size, self.cupy
        return lambda: xp.divide(buf, n, out=buf)  # floating and complex only (AVERAGE)

    def barrier(self) -> None:
        """An all-reduce of one number, waited for on the host (recorded and checked)."""
        buf, comm = self._barrier_buf, self.nccl_comm
        self.collective("barrier", (), (), lambda: comm.allReduce(
            buf.data.ptr, buf.data.ptr, 1, NCCL_DTYPES["int32"], NCCL_OPS["sum"],
            self.stream.ptr), result=None, keep=(), async_op=False)

    def synchronize(self) -> None:
        """Block until every operation issued on this communicator has completed."""
        with self.cupy.cuda.Device(self.device):
            event = self.cupy.cuda.Event(disable_timing=True)
            event.record(self.stream)
        self.wait_event(event, "synchronize", None)
        while self.inflight:
            self.inflight.popleft().is_completed()  # stamps each one's recorder entry

    # --- unrecorded exchanges (the check's own, and the object messages') -------------------
    def broadcast_bytes(self, buf: Any, root: int) -> None:
        """``ncclBroadcast`` of ``buf``'s bytes from ``root``, waited for, not recorded."""
        comm, stream = self.nccl_comm, self.stream.ptr

        def issue() -> None:
            if buf.nbytes:
                comm.broadcast(buf.data.ptr, buf.data.ptr, buf.nbytes, NCCL_BYTE, root, stream)

        self.launch("broadcast", issue, result=buf, keep=(buf,), async_op=False)

    def all_gather_bytes(self, send: Any, recv: Any) -> None:
        """``ncclAllGather`` of every rank's ``send`` (equal byte sizes) into ``recv``, waited
        for, not recorded."""
        comm, stream = self.nccl_comm, self.stream.ptr

        def issue() -> None:
            if send.nbytes:
                comm.allGather(send.data.ptr, recv.data.ptr, send.nbytes, NCCL_BYTE, stream)

        self.launch("all_gather", issue, result=recv, keep=(send, recv), async_op=False)

    def allgather_object_raw(self, obj: Any) -> list[Any]:
        """Every rank's pickled ``obj``, in rank order, through device buffers: two
        all-gathers (the lengths, then the payloads padded to the longest), not recorded."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        lengths, _h = self.device_bytes(np.array([len(data)], dtype=np.int64).view(np.uint8))
        all_lengths, _h2 = self.device_bytes(b"", 8 * self.world_size)
        self.all_gather_bytes(lengths, all_lengths)
        sizes = self.host_copy(all_lengths).view(np.int64).tolist()
        width = max(sizes)
        mine, _h3 = self.device_bytes(data, width)
        everything, _h4 = self.device_bytes(b"", width * self.world_size)
        self.all_gather_bytes(mine, everything)
        host = self.host_copy(everything)
        return [pickle.loads(host[k * width:k * width + n].tobytes()) for k, n in enumerate(sizes)]

    def broadcast_object_raw(self, obj: Any, root: int) -> Any:
        """``root``'s pickled ``obj`` (the root gets ``obj`` itself), not recorded."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        length, _h = self.device_bytes(np.array([len(data)], dtype=np.int64).view(np.uint8))
        self.broadcast_bytes(length, root)
        n = int(self.host_copy(length).view(np.int64)[0])
        payload, _h2 = self.device_bytes(data, n)
        self.broadcast_bytes(payload, root)
        if self.rank == root:
            return obj
        return pickle.loads(self.host_copy(payload).tobytes())

    # --- host and device bytes ------------------------------------------------------------
    def device_bytes(self, data: bytes | np.ndarray,
                     size: int | None = None) -> tuple[Any, np.ndarray]:
        """``data`` zero-padded to ``size`` bytes in a device buffer, copied on our stream.

        Returns the device buffer and the host staging array, which the
        caller keeps alive until an operation on the buffer was waited for.
        """
        host = np.zeros(len(data) if size is None else size, dtype=np.uint8)
        host[:len(data)] = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        with self.cupy.cuda.Device(self.device), self.stream:
            return self.cupy.asarray(host), host  # host stays referenced by the caller

    def host_copy(self, dev: Any) -> np.ndarray:
        """``dev`` copied to the host once this communicator's earlier calls are done."""
        with self.cupy.cuda.Device(self.device):
            out = dev.get(stream=self.stream)
            self.stream.synchronize()
        return out


__all__ = ["Communicator"]
