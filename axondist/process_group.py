"""Process groups, the World, and which group a call uses by default."""

from __future__ import annotations

import logging
import numbers
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ._environment import check_env_launch, default_backend
from ._validate import as_members
from .backends import settings
from .backends.base import Backend
from .backends.registry import create_backend
from .errors import LaunchError, NotAMemberError, TooManyGroupsError

log = logging.getLogger("axondist")

#: Environment variable: the most groups made by ``new_group`` that may be alive at once on
#: a rank (unset: as many as the backend allows).
MAX_GROUPS_ENV = "AXONDIST_MAX_GROUPS"


class LiveGroups:
    """How many groups made by ``new_group`` (from one world) are alive on this rank.

    Shared by a world and every group made from it; a group counts from its
    creation (on its members) to its ``destroy()``. A group dropped without
    ``destroy()`` still holds its communicators, so it still counts.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.count += n


def _max_groups() -> int | None:
    limit: int | None = settings.read(MAX_GROUPS_ENV)
    return limit


def _out_of_communicators(exc: BaseException) -> str:
    """The line of a backend error saying the MPI library ran out of communicators, or ""."""
    text = str(exc)
    at = text.lower().find("too many communicators")
    return "" if at < 0 else text[at:].splitlines()[0].strip()


#: What a group holds, by backend (MPI's for the others).
_GROUP_HOLDS = {"torch": "on the torch backend each group holds a gloo process group: three "
                         "threads and a connection to every other member"}
_MPI_GROUP_HOLDS = ("on MPI each group holds two communicators: its own and a private duplicate "
                    "for the argument checks")


def too_many_groups(alive: int, why: str, backend: str = "mpi") -> TooManyGroupsError:
    """The error ``new_group`` raises when no more groups can be made (``why``: the limit;
    ``backend``: its name, for what a group holds there)."""
    return TooManyGroupsError(
        f"new_group: cannot make another group: {alive} groups made by new_group are alive on "
        f"this rank and {why} ({_GROUP_HOLDS.get(backend, _MPI_GROUP_HOLDS)}). Free the groups "
        "you no longer need: "
        "group.destroy() (every member calls it), or make them with `with world.new_group("
        "ranks) as group:`; FSDP wrappers that made groups free them with fsdp.close()")


class ProcessGroup:
    """A set of ranks that communicate together, and this process's place in it.

    Args:
        backend: this rank's endpoint in the group's communicator, or None on
            a process that is not a member (it can inspect the group but any
            communication raises :class:`NotAMemberError`).
        ranks: the members' ranks in the world, in group-rank order
            (``range(backend.world_size)`` when omitted).

    Ranks passed to collectives (``src``, ``dst``) are ranks *in this group*
    (0 .. ``size - 1``), as in MPI; ``ranks[i]`` is group rank i's world rank.
    """

    def __init__(self, backend: Backend | None, ranks: Sequence[int] | None = None,
                 *, world_rank: int | None = None) -> None:
        if backend is None and ranks is None:
            raise ValueError("ProcessGroup: a non-member group needs its ranks")
        self._backend = backend
        if ranks is None:
            assert backend is not None  # a non-member without ranks was refused above
            ranks = range(backend.world_size)
        self._ranks = tuple(ranks)
        if backend is not None and len(self._ranks) != backend.world_size:
            raise ValueError(f"ProcessGroup: {len(self._ranks)} ranks given for a backend of "
                             f"{backend.world_size}")
        self._world_rank = world_rank
        self._destroyed = False
        self._live = LiveGroups()  # shared with the groups made from this one
        self._counted = False

    @property
    def backend(self) -> Backend | None:
        """The backend endpoint (None on non-members)."""
        return self._backend

    @property
    def rank(self) -> int:
        """This process's rank in the group, or -1 when it is not a member."""
        return self._backend.rank if self._backend is not None else -1

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return len(self._ranks)

    size = world_size

    @property
    def ranks(self) -> tuple[int, ...]:
        """World ranks of the members, in group-rank order."""
        return self._ranks

    @property
    def is_member(self) -> bool:
        """True on the group's ranks; elsewhere the group may only be passed around, not used."""
        return self._backend is not None

    def contains(self, world_rank: int) -> bool:
        """True when ``world_rank`` is a member."""
        return world_rank in self._ranks

    def backend_for(self, what: str) -> Backend:
        """The backend, or a clear error when this process is not a member."""
        if self._backend is None:
            if self._destroyed:
                raise NotAMemberError(f"{what}: the group of ranks {list(self._ranks)} was "
                                      "destroyed (group.destroy() or the end of `with group:`); "
                                      "make a new one with new_group")
            who = f"rank {self._world_rank}" if self._world_rank is not None else "this process"
            raise NotAMemberError(
                f"{what}: {who} is not a member of the group of ranks {list(self._ranks)}; "
                "only members may communicate on it (check group.is_member first)"
            )
        return self._backend

    def new_group(self, ranks: Sequence[int]) -> ProcessGroup:
        """A sub-group of the members at group ranks ``ranks``; every member must call it.

        Non-members of the new group get a ProcessGroup they can inspect but
        not communicate on.

        Raises:
            RankError: a rank outside this group, or a repeated rank.
            TooManyGroupsError: the backend has run out of communicators (or
                ``AXONDIST_MAX_GROUPS`` groups are alive): the message says how
                many groups are alive and how to free them.
        """
        ranks = as_members(ranks, self.world_size, "new_group")
        parent = self.backend_for("new_group")
        limit = _max_groups()
        if limit is not None and self._live.count >= limit:
            raise too_many_groups(self._live.count, f"{MAX_GROUPS_ENV}={limit} allows no more",
                                  parent.name)
        try:
            backend = parent.new_group(ranks)
        except TooManyGroupsError as exc:  # the backend's own limit (the torch backend's)
            raise too_many_groups(self._live.count, str(exc), parent.name) from None
        except Exception as exc:
            said = _out_of_communicators(exc)
            if not said:
                raise
            raise too_many_groups(self._live.count, f"the MPI library has run out of "
                                  f"communicators ({said})") from None  # it holds MPI's line
        world_ranks = [self._ranks[r] for r in ranks]
        group = ProcessGroup(backend, world_ranks, world_rank=self._ranks[self.rank])
        group._live = self._live
        if backend is not None:
            group._counted = True
            self._live.add(1)
        log.debug("new_group: ranks %s (%s)", world_ranks,
                  "a member" if group.is_member else "not a member")
        return group

    def destroy(self) -> None:
        """Free the group's communicator; afterwards the group cannot communicate.

        Collective over the members (as ``MPI_Comm_free``), idempotent, and a
        no-op on non-members. Also the exit of ``with group:``.
        """
        backend, self._backend = self._backend, None
        if backend is not None:
            self._destroyed = True
            if self._counted:
                self._counted = False
                self._live.add(-1)
            backend.close()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def node_info(self) -> tuple[int, int, int]:
        """``(node_id, local_rank, local_size)`` of this rank (for hybrid sharding)."""
        return self.backend_for("node_info").node_info()

    def __repr__(self) -> str:
        name = self._backend.name if self._backend is not None else "non-member"
        return f"ProcessGroup({name}, rank={self.rank}, ranks={list(self._ranks)})"


class World(ProcessGroup):
    """The group of all ranks of a job, plus the way to make sub-groups.

    A World is itself a ProcessGroup (the default group), so it can be passed
    wherever a group is expected. Make one with :func:`axondist.init` (the
    backend the launch asks for), :meth:`mock` (one rank, in process) or
    :func:`axondist.spawn` (N ranks on threads).
    """

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend, range(backend.world_size), world_rank=backend.rank)

    @property
    def default_group(self) -> ProcessGroup:
        """The group of every rank: the World itself."""
        return self

    @classmethod
    def mock(cls, timeout: float | None = None) -> World:
        """A one-rank in-process world (collectives are identities)."""
        from .backends.mock import MockBackend  # loaded only by a job that uses it

        return cls(MockBackend.create_world(1, timeout)[0])

    def __repr__(self) -> str:
        name = self.backend_for("World").name  # a World always has its backend
        return f"World({name}, rank={self.rank}, world_size={self.world_size})"


class _ThreadState(threading.local):
    # A class-level default: reading a missing attribute of a plain
    # threading.local raises and catches AttributeError (~0.4 us per collective).
    world: World | None = None


_state = _ThreadState()
_process_world: World | None = None
#: The backend name and options of the :func:`init` that made ``_process_world``.
_process_made_by: tuple[str, dict[str, Any]] | None = None
_process_lock = threading.Lock()


def set_process_world(world: World | None) -> None:
    """Make ``world`` the default for every thread without one of its own."""
    global _process_world
    with _process_lock:
        _process_world = world


def peek_world() -> World | None:
    """The calling thread's world, else the process's, else None; never starts one."""
    return _state.world or _process_world


def current_world() -> World:
    """The world collectives use when no group is passed.

    The thread's world under :func:`axondist.spawn`, else the one made by
    :func:`axondist.init`, else (first use) ``init()`` is called.
    """
    world = _state.world
    if world is not None:
        return world
    if _process_world is None:
        return init()
    return _process_world


def init(backend: str | None = None, **options: Any) -> World:
    """Start this process's world and make it the default group.

    Args:
        backend: a registered backend name (``"mock"``, ``"mpi"``, ``"torch"``,
            ``"nccl"``, or one added with :func:`axondist.backends.register_backend`);
            when None, the ``AXONDIST_BACKEND`` environment variable, else
            ``"mpi"`` when the process was launched by mpiexec/mpirun/srun,
            ``"torch"`` when torchrun (or another launcher setting ``RANK`` and
            ``WORLD_SIZE``) started it and torch is installed, else a one-rank
            ``"mock"`` world.
        **options: passed to the backend's factory (``timeout`` for every
            built-in backend).

    A second call with the same backend and options returns the world the first made (a
    job has one world); after ``world.destroy()`` a call makes a new one.

    Raises:
        ValueError: an unknown backend name (the message lists the valid ones).
        BackendUnavailableError: the backend's library is missing (the message
            says what to install).
        LaunchError: an env-style launcher (torchrun) started several processes
            that this backend cannot join into one world (the message says what to
            run instead), or this process already has a world made with other
            arguments.
    """
    name = str(backend or default_backend()).strip().lower()
    existing = _existing_world(name, options)
    if existing is not None:
        return existing
    check_env_launch(name)
    world = World(create_backend(name, **options))
    set_process_world(world)
    global _process_made_by
    _process_made_by = (name, dict(options))
    node, local_rank, local_size = world.node_info()
    log.info("init: backend %s, rank %d of %d (node %d, local rank %d of %d)", name,
             world.rank, world.world_size, node, local_rank, local_size)
    return world


def _existing_world(name: str, options: dict[str, Any]) -> World | None:
    """The world an earlier :func:`init` made, when a second call asks for the same one.

    A launched job has one world: a second ``init`` with the same backend and options gets
    it back, and one with others is refused rather than building a second world beside it.
    A one-rank mock world is cheap and private, so other options replace it, as a
    destroyed world is replaced.
    """
    world, made_by = _process_world, _process_made_by
    if world is None or made_by is None or world._backend is None:
        return None
    try:
        same = made_by == (name, options)
    except Exception:  # noqa: BLE001 - options that cannot be compared are not the same
        same = False
    if same:
        return world
    if made_by[0] == "mock" and world.world_size == 1:
        return None
    asked = ", ".join([repr(name)] + [f"{k}={v!r}" for k, v in options.items()])
    made = ", ".join([repr(made_by[0])] + [f"{k}={v!r}" for k, v in made_by[1].items()])
    raise LaunchError(
        f"init({asked}): this process already has a world, rank {world.rank} of "
        f"{world.world_size} made by init({made}); a second world beside it would split the "
        "job. Use the world you have (ad.init() with the same arguments returns it), or "
        "call world.destroy() first to start another")


class use_world:
    """Context manager making ``world`` the current thread's default world."""

    def __init__(self, world: World) -> None:
        self._world = world
        self._saved: World | None = None

    def __enter__(self) -> World:
        self._saved = _state.world
        _state.world = self._world
        return self._world

    def __exit__(self, *exc: Any) -> None:
        _state.world = self._saved


def resolve_group(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the current world when None."""
    if group is None:
        return current_world()
    if not isinstance(group, ProcessGroup):
        hint = ""
        if type(group).__module__.startswith("torch"):
            torch_dist = sys.modules.get("torch.distributed")
            if torch_dist is not None and torch_dist.is_initialized() and (
                    group is torch_dist.group.WORLD):
                return current_world()  # torch's default group: every rank, the world
            hint = ("; a torch.distributed group other than dist.group.WORLD has no axondist "
                    "counterpart: make it with world.new_group(ranks)")
        elif isinstance(group, numbers.Integral) and not isinstance(group, bool):
            hint = ("; ranks are keyword arguments here: broadcast(x, src=1), "
                    "gather_tensor(x, dst=1), recv(src=1), send(x, dst=1)")
        elif isinstance(group, str):
            hint = "; pass the op by keyword: all_reduce(x, op='max')"
        raise TypeError(f"expected an axondist ProcessGroup or World as the group, got "
                        f"{type(group).__name__} {group!r}{hint}")
    return group

