"""An in-process world: N ranks on N threads of one process, deterministic.

Each collective is a round with its own lock: every rank deposits its buffers,
and the last to arrive checks that all ranks agree on the arguments. That rank
then does a small round whole, for every rank (the others wake once, to
return); a large one is cut into parts (slices of the output) that the ranks
claim one by one and do in parallel, NumPy releasing the GIL in its loops, and
the round ends when every part is done. Reductions combine in rank order, so
every run gives the same bits. Messages wait in one mailbox per pair of ranks
and tag. A call whose peers do not come warns after the stall time, naming
them and their last calls, and fails at the world's timeout; a peer that left
or failed fails it at once, and a cycle of waits (receives, or collectives the ranks
issued on different groups or in different orders) as soon as it has held for a second
with nothing moving, naming each rank's call as the MPI backend's watchdog does.
"""

from __future__ import annotations

import concurrent.futures
import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ... import _array
from ..._validate import as_rank
from ...errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidBufferError,
)
from ..base import Backend, FutureWork
from ..checks import compare_signatures, printable
from ..plan import CallKey, Plan, Signature, WidenedMeanPlan
from ..recording.recorder import FlightRecorder
from .plans import PLANS, UnsizedAllGatherPlan
from .world import (
    _DONE,
    _GATHERING,
    _SHARING,
    CYCLE_STILL,
    MockWorld,
    Text,
    _Mailbox,
    _Round,
)

#: Bytes a round reads and writes, below which the last rank to arrive does all of it:
#: waking the other ranks to help costs more than the work they would take.
_SHARED_MIN_BYTES = 1 << 20

#: The calls of the rounds that are not collectives on arrays, as the ranks compare them.
_BARRIER = (("op", "barrier"), ("async_op", False))
_ALLGATHER_OBJECT = (("op", "allgather_object"), ("async_op", False))

Part = Callable[[_Round, int], None]
Whole = Callable[[_Round], None]



class MockBackend(Backend):
    """One rank's endpoint in a :class:`MockWorld` communicator.

    Create a world with :meth:`create_world`, which returns one backend per
    rank; each must be used from its own thread (see :func:`axondist.spawn`).
    """

    name = "mock"

    def __init__(self, world: MockWorld, group_key: Any, ranks: Sequence[int], rank: int) -> None:
        self.world = world
        self.group_key = group_key
        self.global_ranks = tuple(ranks)
        self.rank = rank
        self.world_size = len(ranks)
        self._seq = 0
        self._p2p_seq = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.recorder: FlightRecorder = world.recorders[self.global_ranks[rank]]
        self.group_name = _group_name(group_key)
        self.recorder.groups[self.group_name] = self.global_ranks

    @classmethod
    def create_world(cls, world_size: int, timeout: float | None = None) -> list[MockBackend]:
        """One backend per rank of a new in-process world of ``world_size`` ranks."""
        world = MockWorld(world_size, timeout)
        ranks = tuple(range(world_size))
        return [cls(world, ("world",), ranks, r) for r in range(world_size)]

    # --- the round machinery -------------------------------------------------------
    def _describe(self, op_name: str, seq: int) -> str:
        return (f"{op_name} #{seq + 1} on {self.group_name} of ranks {list(self.global_ranks)} "
                f"(rank {self.global_ranks[self.rank]})")

    def _join(self, op_name: str, seq: int, payload: Any, call: Signature,
              part: Part | None, whole: Whole | None, parts: int,
              work_bytes: int, timeout: float | None) -> _Round:
        """Deposit this rank's payload and take part in the round until it is done.

        The last rank to arrive checks the calls (``async_op`` among their fields:
        MPI never matches a blocking call with a non-blocking one); then
        it does the whole round itself (small) or opens its parts to every
        rank (large), and each rank claims parts until none is left and waits
        for the last to finish.
        """
        w, n, me = self.world, self.world_size, self.rank
        key = (self.group_key, seq)

        def what() -> str:
            return self._describe(op_name, seq)

        w._check_abort(what)
        with w.lock:
            rnd = w.rounds.get(key)
            if rnd is None:
                rnd = w.rounds[key] = _Round(op_name, n)
        with rnd.signal:
            rnd.payloads[me] = payload
            rnd.signatures[me] = call
            rnd.arrived += 1
            last = rnd.arrived == n
            if not last:
                def absent() -> list[int]:
                    return [self.global_ranks[r] for r in range(n) if rnd.signatures[r] is None]

                try:
                    w.wait_for(rnd.signal, lambda: rnd.stage != _GATHERING, what,
                               lambda: f"ranks {absent()} of {n} did not join", absent, timeout,
                               self.global_ranks[me])
                except BaseException:
                    with w.lock:
                        if w.rounds.get(key) is rnd:
                            del w.rounds[key]
                    raise
        if last:
            self._start(key, rnd, part, whole, parts, work_bytes)
        if rnd.stage == _SHARING:
            assert part is not None  # only rounds with parts are shared
            self._work(rnd, part, what)
        if rnd.error is not None:
            if rnd.differ is not None:  # worded for this rank's call, as every backend does
                raise compare_signatures(op_name, rnd.differ) or rnd.error
            raise rnd.error
        return rnd

    def _start(self, key: Any, rnd: _Round, part: Part | None, whole: Whole | None,
               parts: int, work_bytes: int) -> None:
        """What the last rank to arrive does: check the signatures, then do the whole round
        (a small one) or open its parts to every rank (a large one), and wake the others."""
        w = self.world
        with w.lock:
            del w.rounds[key]
            w.progress += 1
        error: BaseException | None = None
        calls = rnd.signatures
        if calls.count(calls[0]) != len(calls):
            rnd.differ = [printable(s or ()) for s in calls]
            error = compare_signatures(rnd.op_name, rnd.differ)
        if error is None and rnd.op_name in _ARRAY_ROUNDS:
            error = _mixed_libraries(rnd.op_name, rnd.payloads)
        stage = _DONE
        if error is None and part is not None:
            if self.world_size > 1 and parts > 1 and work_bytes >= _SHARED_MIN_BYTES:
                stage = _SHARING
                rnd.parts = parts
            else:
                try:
                    if whole is not None:
                        whole(rnd)
                    else:
                        rnd.parts = parts
                        for i in range(parts):
                            part(rnd, i)
                except BaseException as exc:
                    error = exc
        with rnd.signal:
            rnd.error = error
            rnd.stage = stage
            rnd.signal.notify_all()

    def _work(self, rnd: _Round, part: Part, what: Text) -> None:
        """Claim and do parts of a shared round until none is left; return once every part
        is done (the first error of any part is the round's error)."""
        signal = rnd.signal
        while True:
            with signal:
                i = rnd.claimed
                if i == rnd.parts:
                    self.world.wait_for(signal, lambda: rnd.stage == _DONE, what,
                                        lambda: "some ranks did not finish their part")
                    return
                rnd.claimed = i + 1
            error: BaseException | None = None
            try:
                part(rnd, i)
            except BaseException as exc:
                error = exc
            with signal:
                if error is not None and rnd.error is None:
                    rnd.error = error
                rnd.finished += 1
                if rnd.finished == rnd.parts:
                    rnd.stage = _DONE
                    signal.notify_all()

    def _run(self, op_name: str, payload: Any, call: Signature, async_op: bool,
             part: Part | None = None, parts: int = 0, whole: Whole | None = None,
             work_bytes: int = 0, timeout: float | None = None) -> Any:
        """Run one collective round (see :meth:`_join`): the round once done, or with
        ``async_op`` a Work whose ``wait()`` returns it.

        ``call`` is the call as the ranks compare it: ``("op", op_name)``, the fields
        every rank must agree on, then ``("async_op", async_op)``. ``part(round, i)``
        does part ``i`` of ``parts`` of the round's outputs (every rank's), from
        ``round.payloads`` (the ranks' payloads, in rank order); any rank's thread may
        run it. ``whole(round)``, when given, does every part at once. ``work_bytes``
        (what the round reads and writes) decides whether the ranks share the parts.
        """
        seq = self._seq
        self._seq += 1
        recorder = self.recorder
        if not async_op:
            slot = recorder.begin(self.group_name, seq + 1, op_name, call[1:-1])
            try:
                return self._join(op_name, seq, payload, call, part, whole, parts,
                                  work_bytes, timeout)
            finally:
                recorder.end(slot)

        def execute() -> Any:
            slot = recorder.begin(self.group_name, seq + 1, op_name, call[1:-1])
            try:
                return self._join(op_name, seq, payload, call, part, whole, parts,
                                  work_bytes, timeout)
            finally:
                recorder.end(slot)

        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"axondist-mock-r{self.rank}")
        return FutureWork(self._executor.submit(execute),
                          what=self._describe(op_name, seq))

    # --- the contract ---------------------------------------------------------------
    def make_plan(self, key: CallKey) -> Plan:
        """The round of ``key`` (:mod:`.plans`): a widened mean for half-precision AVERAGEs,
        else the plan of its collective."""
        if key.reduce_op == "AVERAGE" and key.dtype.name in _array.HALF_PRECISION:
            return WidenedMeanPlan(self, key)
        if key.collective == "all_gather" and key.counts is None:
            return UnsizedAllGatherPlan(self, key)
        return PLANS[key.collective](self, key)

    def barrier(self) -> None:
        """Return once every rank of the group has arrived (or fail after the world's timeout)."""
        self._run("barrier", None, _BARRIER, False)

    def monitored_barrier(self, timeout: float) -> None:
        """:meth:`barrier` failing after ``timeout`` seconds, naming the absent ranks."""
        self._run("barrier", None, _BARRIER, False, timeout=timeout)

    # --- objects -----------------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (the objects themselves, not copies), in rank order."""
        return list(self._run("allgather_object", obj, _ALLGATHER_OBJECT, False).payloads)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every rank (the same object, not a copy)."""
        self._check_rank(root, "broadcast_object", "root")
        call = (("op", "broadcast_object"), ("root", root), ("async_op", False))
        return self._run("broadcast_object", obj, call, False).payloads[root]

    # --- point to point ----------------------------------------------------------------
    def _mailbox(self, src: int, dst: int, tag: int) -> _Mailbox:
        return self.world.mailbox((self.group_key, src, dst, tag))

    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """Post a copy of ``buf`` to ``dst``'s mailbox and return at once (never blocks)."""
        self._post(_array.namespace(buf).array(buf, copy=True), dst, tag, "send")

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Post a deep copy of ``obj`` to ``dst``'s mailbox and return at once."""
        self._post(copy.deepcopy(obj), dst, tag, "send_object")

    def _post(self, item: Any, dst: int, tag: int, what: str) -> None:
        self._check_rank(dst, what, "dst")
        w = self.world
        w._check_abort(what)
        box = self._mailbox(self.rank, dst, tag)
        with box.signal:
            box.items.append((what, item))
            with w.lock:
                w.progress += 1
            box.signal.notify_all()

    def _take(self, src: int, tag: int, what: str, pop: bool = True) -> Any:
        """The next message from ``src`` with ``tag`` (removed from the mailbox if ``pop``)."""
        self._check_rank(src, what, "src")
        w = self.world
        box = self._mailbox(src, self.rank, tag)
        me, peer = self.global_ranks[self.rank], self.global_ranks[src]
        description = f"{what} on rank {me} from rank {peer} (tag {tag})"

        seen: list[float] = []  # (progress, since) while a cycle is seen

        def ready() -> bool:
            if box.items:
                return True
            with w.lock:
                cycle = self._receive_cycle(me, peer)
                progress = w.progress
            if not cycle:
                seen.clear()
            elif not seen or seen[0] != progress:
                seen[:] = [progress, time.monotonic()]
            elif time.monotonic() - seen[1] >= CYCLE_STILL:
                raise CollectiveTimeoutError(
                    f"{description}: deadlock: every rank in the cycle "
                    + " -> ".join(f"rank {r}" for r in cycle)
                    + " waits to receive from the next one and no message moved for "
                    f"{CYCLE_STILL:g} s; make one side send first")
            return False

        with box.signal:
            if not box.items:
                self._p2p_seq += 1
                slot = self.recorder.begin(f"{self.group_name}:p2p", self._p2p_seq, what,
                                           (("peer", peer), ("tag", tag)))
                with w.lock:
                    w.receiving[me] = (box, peer)
                try:
                    w.wait_for(box.signal, ready, description,
                               lambda: f"rank {peer} sent nothing", lambda: [peer], rank=me)
                finally:
                    with w.lock:
                        w.receiving.pop(me, None)
                    self.recorder.end(slot)
            return box.items.popleft()[1] if pop else box.items[0][1]

    def _receive_cycle(self, me: int, peer: int) -> list[int]:
        """The ranks of a cycle of pending receives from this rank back to it (empty when
        there is none; call it holding the world's lock). Alone it proves nothing: another
        thread of a rank may still send."""
        w, chain, at = self.world, [me], peer
        while at in w.receiving and at not in chain:
            mailbox, source = w.receiving[at]
            if mailbox.items:
                return []  # its message is there: it is about to wake up
            chain.append(at)
            at = source
        return chain + [me] if at == me and len(chain) > 1 else []

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """Wait for the next message from ``src`` with ``tag`` and copy it into ``buf``.

        Raises:
            CollectiveMismatchError: the message's size or dtype differs from ``buf``'s.
            CollectiveTimeoutError: nothing arrived within the world's timeout.
        """
        data = self._take(src, tag, "recv")  # consumed even when it does not fit: the next
        if data.size != buf.size or data.dtype != buf.dtype:  # recv gets the next message
            raise CollectiveMismatchError(
                f"recv from rank {src} (tag {tag}): message is {_array.describe(data)} but the "
                f"receive buffer is {_array.describe(buf)}; the message was discarded"
            )
        buf.reshape(-1)[...] = data.reshape(-1)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """Wait for the next object ``src`` sent with ``tag`` (a deep copy of what it sent)."""
        return self._take(src, tag, "recv")

    # --- groups ------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> MockBackend | None:
        """A backend over ``ranks`` (group-local); None on ranks outside it.

        Collective: every rank must pass the same ranks, else every rank raises
        :class:`~axondist.errors.CollectiveMismatchError` naming what each passed.
        """
        ranks = tuple(int(r) for r in ranks)
        seq = self._seq  # the key of the group, identical on every rank
        all_ranks = self.allgather_object(ranks)
        if any(r != ranks for r in all_ranks):
            raise CollectiveMismatchError(
                "new_group: ranks disagree on the members: "
                + ", ".join(f"rank {k} passed {list(r)}" for k, r in enumerate(all_ranks))
            )
        if self.rank not in ranks:
            return None
        global_ranks = tuple(self.global_ranks[r] for r in ranks)
        return MockBackend(self.world, (self.group_key, seq), global_ranks, ranks.index(self.rank))

    def _check_rank(self, r: int, what: str, arg: str) -> None:
        as_rank(r, self.world_size, what, arg)

    def drain(self) -> None:
        """Wait until this rank's ``async_op`` calls finished (they may still fail)."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()

    def close(self) -> None:
        """Shut down this rank's thread for ``async_op`` work without waiting; idempotent."""
        if self.group_key != ("world",):
            self.recorder.groups.pop(self.group_name, None)
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


#: The rounds that compute on the ranks' arrays (object rounds hand objects over as they are).
_ARRAY_ROUNDS = frozenset({"all_reduce", "broadcast", "all_gather", "reduce_scatter", "gather",
                           "scatter"})


def _mixed_libraries(op_name: str, payloads: Sequence[Any]) -> InvalidBufferError | None:
    """The error for a round whose ranks passed NumPy and CuPy arrays, else None.

    MPI moves bytes and does not mind; the mock world computes each round
    with one array library, so it refuses the mix on every rank alike.
    """
    first = payloads[0].__class__
    if first is not tuple and first is not list:
        for p in payloads:  # the common case, decided without walking the payloads
            if p.__class__ is not first:
                break
        else:
            return None
    libraries = [sorted({_array.library_name(a) for a in _arrays_in(p)}) for p in payloads]
    if len({lib for libs in libraries for lib in libs}) < 2:
        return None
    found = ", ".join(f"rank {r}: {'+'.join(libs) or 'none'}" for r, libs in enumerate(libraries))
    return InvalidBufferError(
        f"{op_name}: the ranks passed arrays of different libraries ({found}); the mock world "
        "runs a call on one library: pass CuPy arrays on every rank or NumPy arrays on every "
        "rank (axondist.to_device / axondist.to_host)")


def _arrays_in(payload: Any) -> list[Any]:
    if isinstance(payload, (tuple, list)):
        return [a for item in payload for a in _arrays_in(item)]
    return [payload] if isinstance(payload, np.ndarray) or _array.is_cupy(payload) else []


def _group_name(group_key: Any) -> str:
    """``"world"``, ``"world.3"``...: a group's name in flight-recorder entries."""
    if group_key == ("world",):
        return "world"
    parent, seq = group_key
    return f"{_group_name(parent)}.{seq}"


def create_world_backend(timeout: float | None = None) -> MockBackend:
    """A one-rank mock world (``axondist.init("mock")``)."""
    return MockBackend.create_world(1, timeout)[0]


MockWorld.__module__ = __name__  # documented and shown here, its public home
__all__ = ["MockBackend", "MockWorld", "create_world_backend"]
