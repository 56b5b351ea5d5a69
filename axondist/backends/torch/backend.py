"""The torch backend: one rank's endpoint in a ``torch.distributed`` process group.

torch picks the engine by where a buffer lives: gloo for NumPy arrays (seen as CPU
tensors) and NCCL for CuPy arrays (CUDA tensors), both through DLPack without copies.
Every call is numbered, recorded and checked across ranks first
(:class:`~axondist.backends.torch.guard.TorchGuard`), so a mismatch raises the same
error as on the other backends instead of gloo's abort. The collectives are plans
(:mod:`.plans`, chosen by the table in :mod:`.choose`: where gloo computes or accepts less
than the other backends, a plan arranges it). A point-to-point message of host memory
travels on the world's own connections (:mod:`.mail`), one of device memory through
torch.distributed after a small header; either way a receive of the wrong size raises
instead of ending the process.
Non-blocking calls and sends are queued on threads (:mod:`.queues`).
"""

from __future__ import annotations

import concurrent.futures
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ... import _array
from ..._frameworks import TORCH
from ..._validate import as_rank
from ...errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    TooManyGroupsError,
    WorldAbortedError,
)
from ..base import Backend
from ..checks import Key, agreed
from ..plan import CallKey, Plan, UnsizedAllGatherPlan, WidenedMeanPlan
from ..recording.recorder import FlightRecorder, describe_call
from ..watchdog.diagnostics import process_gone
from ..work import CompletedWork, PolledWork, Work
from .choose import Layout, choose
from .guard import TorchGuard
from .interop import load_torch
from .mail import Mailbox
from .plans import PLANS
from .queues import TAG_KINDS, CallOrder, Outbox, Reaper, tags
from .wires import Wiring

_INT64 = np.dtype(np.int64)
#: What gloo's errors say when a peer's process ended.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
#: Seconds a call whose peer's connection closed looks for the rank whose process ended.
_GONE_WITHIN = 1.0
#: Seconds it then waits for those ranks' announcements that they left (and how).
_ANNOUNCED_WITHIN = 0.5
#: Sends up to this many bytes return at once, from copies (MPI's eager sends do too).
EAGER_BYTES = 64 << 10
#: The most groups made by ``new_group`` that may be alive at once on a rank: each holds a
#: gloo process group, with its threads (two workers and a socket loop) and a connection to
#: every other member, for as long as it lives.
MAX_GROUPS = 1000
#: Frees the process groups this rank destroyed, off the thread that closed them.
FREED_GROUPS = Reaper()


def _ended(pid: int) -> bool:
    """Whether process ``pid`` of this host has ended: gone, or ended and waiting for its
    parent to collect it (a zombie: its sockets are closed already)."""
    if process_gone(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def node_info(hosts: Sequence[str], rank: int) -> tuple[int, int, int]:
    """(node id, local rank, local size) of ``rank`` from every rank's host name; nodes
    are numbered by their first rank, so every rank agrees."""
    order = list(dict.fromkeys(hosts))
    local = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return order.index(hosts[rank]), local.index(rank), len(local)


class TorchBackend(Backend):
    """One rank's endpoint in a ``torch.distributed`` process group.

    Args:
        pg: the process group (the default group for the world).
        recorder: the rank's flight recorder.
        group_name: the group's name in the recorder.
        members: the group's members as global ranks (in group-rank order).
        hosts: every member's host name (for :meth:`node_info`).
        checks: check every collective's arguments across ranks first.
        debug: compare full arguments (a pickled all-gather) instead of hashes.
        uid: the world's unique id (its subgroups' names in torch start with it).
        timeout: torch's timeout of the subgroups made from this one (a ``timedelta``;
            None: torch's default).
        owns_group: destroy ``pg`` in :meth:`close`.
        live: the open backends of this rank's world by group name, shared by the world and
            its groups (a new dict for the world's).
        wiring: how the group's sockets are made (None: the check is a gloo all-reduce);
            every member makes them as it constructs the backend.
    """

    name = "torch"

    def __init__(self, pg: Any, *, recorder: FlightRecorder, group_name: str = "world",
                 members: Sequence[int], hosts: Sequence[str], uid: str = "",
                 timeout: Any = None, checks: bool = True, debug: bool = False,
                 owns_group: bool = False, live: dict[str, TorchBackend] | None = None,
                 wiring: Wiring | None = None) -> None:
        self.torch, self.dist = load_torch()
        self.pg = pg
        #: The open backends of this rank's world, by group name (see :meth:`release`).
        self.live = {} if live is None else live
        self.live[group_name] = self
        self.members = tuple(members)
        self.uid = uid
        self.timeout = timeout
        self.world_size = len(self.members)
        self.rank = self.members.index(self.dist.get_rank())
        self.options = {"checks": checks, "debug": debug}
        self._hosts = tuple(hosts)
        self._node = node_info(self._hosts, self.rank)
        self._owns_group = owns_group
        self.guard = TorchGuard(self.dist, self.torch, pg, checks or debug, recorder,
                                group_name, self.members, debug)
        self.wiring = wiring
        if wiring is not None and self.guard.checks and not debug:
            store = self.dist.distributed_c10d._get_default_store()
            self.guard.wires = wiring.connect(store, f"axondist-check/{uid}/{group_name}",
                                              self.rank, self.world_size)
        #: The rank's watchdog (the world backend of a job of several ranks only).
        self.watchdog: Any = None
        #: The threads that send to each rank, shared by the world's groups.
        self.outbox = Outbox(self.guard.members[self.rank])
        #: The world's connections for messages of host memory, shared by its groups (None:
        #: messages go through torch.distributed).
        self.mail: Mailbox | None = None
        #: The order in which the group's calls reach torch (non-blocking ones queued).
        self.order = CallOrder(f"axondist-{group_name}")
        self._closed = False
        #: What the algorithm table knows about the group.
        self.layout = Layout(self.world_size, wired=self.guard.wires is not None)

    # --- what the plans share ---------------------------------------------------------------
    @property
    def recorder(self) -> FlightRecorder:  # type: ignore[override]
        """The rank's flight recorder (shared by its groups)."""
        return self.guard.rec

    def tensor(self, buf: Any) -> Any:
        """A tensor over ``buf``'s memory (no copy)."""
        return TORCH.wrap(buf, None)

    def translated(self, what: str, run: Callable[[], Any]) -> Any:
        """``run()``, with torch.distributed's errors turned into axondist's (see
        :meth:`our_error`)."""
        try:
            return run()
        except RuntimeError as exc:
            ours = self.our_error(what, exc)
            if ours is None:
                raise
            raise ours from (None if isinstance(ours, WorldAbortedError) else exc)

    def our_error(self, what: str, exc: RuntimeError) -> Exception | None:
        """axondist's error for torch.distributed's ``exc`` during ``what``: a peer's closed
        connection a :class:`WorldAbortedError` naming the ranks whose processes are gone,
        torch's timeout a :class:`CollectiveTimeoutError`; None for other errors."""
        text = str(exc)
        first = text.splitlines()[0] if text else type(exc).__name__
        if any(sign in text for sign in _PEER_GONE):
            gone = self.gone_ranks(within=_GONE_WITHIN)
            departures = (self.watchdog.departures([self.members[r] for r in gone],
                                                   _ANNOUNCED_WITHIN)
                          if gone and self.watchdog is not None else None)
            if departures is not None:  # what the watchdog would have said, had it been first
                running = [e for e in self.recorder.running() if e["group"] == self.guard.group]
                call = describe_call(running[-1]) if running else what
                return WorldAbortedError(
                    f"{call} on rank {self.rank} of {self.world_size} cannot complete: "
                    f"{departures}\n{self.recorder.last_calls()}")
            who = (f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} ended"
                   if gone else "a rank it needs ended (or its host is cut off)")
            return WorldAbortedError(
                f"{what} on rank {self.rank} of {self.world_size} (group {self.guard.group}) "
                f"cannot complete: {who}; that rank's output says why (torch.distributed: "
                f"{first})")
        if "imed out" in text or "Timeout" in text:
            return CollectiveTimeoutError(
                f"{what} on rank {self.rank} of {self.world_size}: torch.distributed timed out "
                f"({first}); set AXONDIST_TIMEOUT if the job is only slow")
        return None

    def gone_ranks(self, within: float = 0.0) -> list[int]:
        """The group ranks whose processes, on this host, are gone (the watchdog's table of
        the peers says where each runs), looked for during ``within`` seconds: a peer's
        socket closes while its process is still ending."""
        peers = getattr(self.watchdog, "peers", None) or {}
        host = self.guard.rec.host
        mine = [(r, found[3]) for r, world_rank in enumerate(self.members)
                if (found := peers.get(world_rank)) is not None and found[2] == host]
        deadline = time.monotonic() + within
        while True:
            gone = [r for r, pid in mine if _ended(pid)]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.01)

    def work(self, work: Any, result: Any, what: str, finish: Callable[[], None] | None,
             seq: int) -> Work:
        """The Work of a started torch Work (None: the call completed already, but for
        ``finish``): ``wait()`` returns ``result``."""
        if work is None:
            if finish is not None:
                finish()
            return CompletedWork(result)
        def done() -> bool:
            return bool(work.is_completed()) and self.translated(what, work.wait) is not None

        return PolledWork(done, lambda: self.translated(what, work.wait), result, what, finish,
                          (self.guard.rec, self.guard.group, seq))

    # --- prepared calls -------------------------------------------------------------------
    def make_plan(self, key: CallKey) -> Plan:
        """A widened mean for half-precision AVERAGEs, a count exchange for an unsized
        all-gather, else the plan of the algorithm the table chooses (:mod:`.choose`)."""
        if key.reduce_op == "AVERAGE" and key.dtype.name in _array.HALF_PRECISION:
            return WidenedMeanPlan(self, key)
        if key.collective == "all_gather" and key.counts is None:
            return UnsizedAllGatherPlan(self, key)
        return PLANS[key.collective, choose(key, self.layout)](self, key)

    # --- barriers ---------------------------------------------------------------------------
    def _checked(self, op: str, key: Key, run: Callable[[], Any]) -> Any:
        """``run()`` as call ``op``: numbered, recorded, checked across ranks first."""
        guard = self.guard

        def issue() -> Any:
            if guard.checks:
                self.translated(op, lambda: guard.agree(op, key, guard.words(op, key)))
            return self.translated(op, run)

        seq, slot = guard.begin(op, key)
        try:
            return self.order.now(issue)
        finally:
            guard.rec.end(slot)

    def barrier(self) -> None:
        """A barrier (the check's all-reduce is one; no data moves after it)."""
        if not self.guard.checks:
            self._checked("barrier", (), lambda: self.dist.barrier(group=self.pg))
            return
        self._checked("barrier", (), lambda: None)

    def monitored_barrier(self, timeout: float) -> None:
        """A barrier that fails after ``timeout`` seconds on every rank that arrived, naming
        the ranks that did not and what each is doing (from their flight recorders). The
        barrier is the check's all-reduce, polled; the group is unusable after a failure."""
        guard = self.guard
        deadline = time.monotonic() + timeout
        seq, slot = guard.begin("barrier", ())
        try:
            sent = guard.words("barrier", ()).copy()
            tensor = self.torch.from_numpy(sent)
            work = self.order.now(lambda: self.translated("barrier", lambda: self.dist.all_reduce(
                tensor, self.dist.ReduceOp.MAX, group=self.pg, async_op=True)))
            pause = 1e-4
            while not work.is_completed():
                if time.monotonic() >= deadline:
                    raise guard.absent_error("barrier", seq)
                time.sleep(pause)
                pause = min(2 * pause, 1e-2)
            self.translated("barrier", work.wait)
            if not agreed(sent):
                guard.disagree("barrier", ())
        finally:
            guard.rec.end(slot)

    # --- point to point: a header (bytes, dtype), then the data ------------------------------
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """Send ``buf``: a header with its size, then its bytes (see :meth:`_post`)."""
        as_rank(dst, self.world_size, "send", "dst")
        head_tag, data_tag, _, _ = tags(tag)
        guard = self.guard
        slot = guard.begin_p2p("send", (("peer", guard.members[dst]), ("tag", tag),
                                       ("bytes", buf.nbytes)))
        try:
            self._post(buf.reshape(-1).view(np.uint8), dst, head_tag, data_tag, tag)
        finally:
            guard.rec.end(slot)

    def _post(self, payload: Any, dst: int, head_tag: int, data_tag: int, tag: int) -> None:
        """Send the bytes ``payload`` after their size, on the thread that sends to ``dst``
        (so sends to one rank keep their order). Up to :data:`EAGER_BYTES` this returns
        at once, sending a copy, as MPI's eager sends do: gloo's own send waits for its
        receive, so two ranks that each send before they receive would wait forever.
        Larger sends wait for their receive, as on MPI."""
        outbox = self.outbox
        if outbox.error is not None:
            raise outbox.error
        eager = payload.size <= EAGER_BYTES
        to = self.guard.members[dst]
        mail = self.mail
        if mail is not None and isinstance(payload, np.ndarray) and mail.reaches(to):
            self._mail(mail, payload, to, data_tag, tag, eager)
            return
        if eager:
            payload = payload.copy()
        header = np.array([payload.size], _INT64)

        def send() -> None:
            self.dist.send(self.torch.from_numpy(header), group=self.pg, group_dst=dst,
                           tag=head_tag)
            if payload.size:
                self.dist.send(self.tensor(payload), group=self.pg, group_dst=dst,
                               tag=data_tag)

        sent = outbox.submit((id(self.pg), dst, head_tag), to, tag,
                             lambda: self.translated("send", send))
        if not eager:
            sent.result()

    def _mail(self, mail: Mailbox, payload: np.ndarray, to: int, data_tag: int, tag: int,
              eager: bool) -> None:
        """Send ``payload`` to world rank ``to`` through the world's own connections: written
        at once, done once received. A larger send waits for that; a failed eager one raises
        at the next send, as through gloo (and counts as unreceived at exit)."""
        outbox = self.outbox
        try:
            receipt = self.translated("send", lambda: mail.send(to, self.guard.group, data_tag,
                                                                 payload))
        except Exception as exc:
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(exc)
            outbox.track(to, tag, failed, data_tag % TAG_KINDS >= 2)
            if not eager:
                raise
            outbox.error = outbox.error or exc
            return
        outbox.track(to, tag, receipt, data_tag % TAG_KINDS >= 2)
        if not eager:
            self.translated("send", lambda: mail.wait(receipt, to))

    def _received(self, src: int, data_tag: int) -> np.ndarray | None:
        """The bytes of the next message from group rank ``src`` with ``data_tag`` through
        the world's own connections; None when messages from ``src`` go through torch."""
        mail, sender = self.mail, self.guard.members[src]
        if mail is None or not mail.reaches(sender):
            return None
        return self.translated("recv", lambda: mail.receive(sender, self.guard.group, data_tag))

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """Receive the next message from ``src`` with ``tag`` into ``buf``.

        Raises:
            CollectiveMismatchError: the message's size is not ``buf.nbytes`` (the message
                is received and dropped).
        """
        as_rank(src, self.world_size, "recv", "src")
        head_tag, data_tag, _, _ = tags(tag)
        guard = self.guard
        slot = guard.begin_p2p("recv", (("peer", guard.members[src]), ("tag", tag),
                                       ("bytes", buf.nbytes)))
        try:
            mailed = self._received(src, data_tag) if isinstance(buf, np.ndarray) else None
            if mailed is not None:
                size = mailed.size
                if size == buf.nbytes:
                    buf.reshape(-1).view(np.uint8)[...] = mailed
            else:
                header = np.zeros(1, _INT64)
                self.dist.recv(self.torch.from_numpy(header), group=self.pg, group_src=src,
                               tag=head_tag)
                size = int(header[0])
                target = buf.reshape(-1).view(np.uint8) if size == buf.nbytes else np.empty(
                    size, np.uint8)
                if size:
                    self.dist.recv(self.tensor(target), group=self.pg, group_src=src,
                                   tag=data_tag)
        finally:
            guard.rec.end(slot)
        if size != buf.nbytes:
            raise CollectiveMismatchError(
                f"recv from rank {src} (tag {tag}) into {_array.describe(buf)}: the message has "
                f"{size} bytes but the buffer holds {buf.nbytes}; send and recv must use the "
                "same shape and dtype")

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Send a pickled ``obj`` (its length, then its bytes) in a tag space of its own."""
        as_rank(dst, self.world_size, "send_object", "dst")
        _, _, head_tag, data_tag = tags(tag)
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        guard = self.guard
        slot = guard.begin_p2p("send", (("peer", guard.members[dst]), ("tag", tag)))
        try:
            self._post(data, dst, head_tag, data_tag, tag)
        finally:
            guard.rec.end(slot)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object ``src`` sent with ``tag``."""
        as_rank(src, self.world_size, "recv_object", "src")
        _, _, head_tag, data_tag = tags(tag)
        guard = self.guard
        slot = guard.begin_p2p("recv", (("peer", guard.members[src]), ("tag", tag)))
        try:
            mailed = self._received(src, data_tag)
            if mailed is not None:
                data = mailed
            else:
                header = np.zeros(1, _INT64)
                self.dist.recv(self.torch.from_numpy(header), group=self.pg, group_src=src,
                               tag=head_tag)
                data = np.empty(int(header[0]), np.uint8)
                self.dist.recv(self.torch.from_numpy(data), group=self.pg, group_src=src,
                               tag=data_tag)
        finally:
            guard.rec.end(slot)
        return pickle.loads(data.tobytes())

    # --- small objects ---------------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Copies of every rank's ``obj``, in rank order (torch's ``all_gather_object``)."""
        found: list[Any] = [None] * self.world_size
        self._checked("allgather_object", (),
                      lambda: self.dist.all_gather_object(found, obj, group=self.pg))
        return found

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every rank (a copy, also on root)."""
        as_rank(root, self.world_size, "broadcast_object", "root")
        box = [pickle.dumps(obj) if self.rank == root else None]
        self._checked("broadcast_object", (("root", root),),
                      lambda: self.dist.broadcast_object_list(box, group=self.pg,
                                                              group_src=root))
        return pickle.loads(box[0])  # type: ignore[arg-type]

    # --- groups and life cycle -------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> TorchBackend | None:
        """A process group over ``ranks`` (of this group), made by its members alone; the
        others get None. The members are part of the checked arguments: ranks that
        disagree raise before any group is made.

        torch's own ``new_group(use_local_synchronization=True)`` names a group by its ranks
        and the number of groups each process holds, which differs between ranks that belong
        to different groups, and makes the members wait forever for each other. Here the
        name comes from the parent group's name and its count of groups made, which its
        members share, under the world's unique id.
        """
        ranks = tuple(int(r) for r in ranks)
        for r in ranks:
            as_rank(r, self.world_size, "new_group", "rank")
        alive = sum(b._owns_group for b in self.live.values())
        if alive >= MAX_GROUPS:
            raise TooManyGroupsError(f"the torch backend allows at most {MAX_GROUPS}")
        guard = self.guard
        name = f"{guard.group}.{guard.groups_made}"
        guard.groups_made += 1
        members = [self.members[r] for r in ranks]
        made: list[Any] = []
        if self.rank in ranks:
            run = lambda: made.append(self._make_group(members, name))  # noqa: E731
        else:
            run = lambda: None  # noqa: E731
        self._checked("new_group", (("ranks", ranks),), run)
        if not made:
            return None
        sub = TorchBackend(made[0], recorder=guard.rec, group_name=name, members=members,
                           hosts=[self._hosts[r] for r in ranks], uid=self.uid,
                           timeout=self.timeout, checks=self.options["checks"],
                           debug=self.options["debug"], owns_group=True, live=self.live,
                           wiring=self.wiring)
        sub.watchdog = self.watchdog
        sub.outbox = self.outbox
        sub.mail = self.mail
        return sub

    def _make_group(self, members: list[int], name: str) -> Any:
        """torch's process group over the global ranks ``members`` (called by them alone),
        registered with torch.distributed under a name unique to this world."""
        c10d = self.dist.distributed_c10d
        helper = getattr(c10d, "_new_process_group_helper", None)
        if helper is None:  # a torch without the helper: its own (ranks must not diverge)
            return self.dist.new_group(members, use_local_synchronization=True, group_desc=name)
        unique = f"axondist.{self.uid}.{name}"
        me = self.dist.get_rank()
        pg, _ = helper(len(members), members.index(me), members,
                       c10d.Backend(self.dist.get_backend()),
                       c10d._get_default_store(), unique, group_desc=name,
                       timeout=self.timeout)
        c10d._world.pg_group_ranks[pg] = {g: r for r, g in enumerate(members)}
        # every member has connected to every other before any uses (or destroys) the group:
        # a rank that went on and destroyed it would cut a peer's connecting off
        self.dist.barrier(group=pg)
        return pg

    def node_info(self) -> tuple[int, int, int]:
        """``(node_id, local_rank, local_size)`` from the ranks' host names."""
        return self._node

    def close(self) -> None:
        """Forget the plans; destroy the process group of a subgroup (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.live.pop(self.guard.group, None)
        self.order.close()
        self.free_plans()
        self.guard.forget()
        if self.guard.wires is not None:
            self.guard.wires.close()
        if not self._owns_group and self.mail is not None:  # the world's: its groups' too
            self.mail.close()
        if self._owns_group and self.dist.is_initialized():
            try:  # the members' last calls on the group have ended everywhere
                self.dist.barrier(group=self.pg)
            finally:
                self.dist.destroy_process_group(self.pg)
                pg, self.pg = self.pg, None
                self.guard.pg = self.guard.checks_group = None
                FREED_GROUPS.drop(pg)

    def release(self, default_group: bool) -> None:
        """At interpreter exit: destroy the process group of every open group of this rank's
        world here and now, without a word to the other ranks (they may be gone), and let go
        of them, ``default_group`` (torch's, which ``init`` made) too. Until then this
        module's objects hold the groups, so torch's threads would still run inside gloo
        while Python finalizes and frees them, which aborts the process ("terminate called
        without an active exception"). A group with calls still queued, or sends not yet
        received, is left as it is: its threads are inside gloo, and would never join."""
        FREED_GROUPS.drain()  # gloo's teardown of the groups closed before must end first
        busy = self.outbox.busy()
        for backend in sorted(self.live.values(), key=lambda b: not b._owns_group):
            if backend.order.busy() or busy:
                continue
            backend._closed = True
            backend.order.close()
            backend.free_plans()
            if backend.guard.wires is not None:
                backend.guard.wires.close()
            if backend._owns_group and self.dist.is_initialized():
                self.dist.destroy_process_group(backend.pg)
            backend.pg = backend.guard.pg = backend.guard.checks_group = None
        if not any(b.order.busy() for b in self.live.values()) and not busy:
            if self.mail is not None:
                self.mail.close()
            self.live.clear()
            if default_group and self.dist.is_initialized():
                self.dist.destroy_process_group()


__all__ = ["FREED_GROUPS", "TorchBackend", "node_info"]
