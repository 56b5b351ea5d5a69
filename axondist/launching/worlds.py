"""Starting worlds: :func:`init` for a launched job, :func:`spawn` for ranks on threads,
:func:`run` for a script that should work both ways."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .. import log
from .._environment import env_launch_size, launched_by_mpi
from ..backends import settings
from ..backends.base import Backend
from ..errors import CollectiveMismatchError, RankExitedError, WorldAbortedError
from ..process_group import World, init, peek_world, use_world

T = TypeVar("T")


def _rank_of_thread() -> tuple[int, int] | None:
    world = peek_world()
    return None if world is None else (world.rank, world.world_size)


log.set_rank_source(_rank_of_thread)

#: Seconds spawn waits for the remaining ranks once one failed: a rank stuck in its
#: own code must not keep spawn from reporting the failure.
_GRACE = 2.0


def spawn(fn: Callable[..., T], world_size: int, *args: Any, timeout: float | None = None,
          **kwargs: Any) -> list[T]:
    """Run ``fn(world, *args, **kwargs)`` on every rank of a new in-process mock world.

    Each rank runs on its own thread with ``world`` (a :class:`World`, usable
    as a group) as its default group, so collectives called without a group
    use it. A rank whose function returns (or calls ``sys.exit``) has left:
    a peer still waiting for it fails at once with :class:`RankExitedError`.

    Args:
        fn: the per-rank function.
        world_size: number of ranks (threads).
        timeout: seconds a call waits for missing ranks before failing
            (``AXONDIST_TIMEOUT``, default 600, when None).

    Returns:
        The ranks' return values, in rank order.

    Raises:
        CollectiveMismatchError: every rank returned but a message sent with
            :func:`axondist.send` was never received.
        The first failing rank's own exception with a note naming the rank
        (an error caused only by another rank's failure or departure comes
        second). When the only failures are ``sys.exit`` calls that no other
        rank waited for, that ``SystemExit`` is raised.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spawn: world_size must be a positive int, got {world_size!r}")
    launcher = launcher_name()
    if launcher is not None:
        warnings.warn(
            f"axondist.spawn runs {world_size} ranks on threads inside each of the processes "
            f"{launcher} started, as separate worlds that train separate models; to use the "
            "launched world, call axondist.run(fn, world_size) (the launched world under a "
            "launcher, threads otherwise) or axondist.init()", RuntimeWarning, stacklevel=2)
    from ..backends.mock import MockBackend  # threads' world: loaded by the call that uses it
    from ..backends.mock.process_end import ProcessEndWatch

    settings.load()  # a bad AXONDIST_* value fails here; a misspelt name is warned about
    backends = MockBackend.create_world(world_size, timeout)
    mock_world = backends[0].world
    with ProcessEndWatch(mock_world, "axondist.spawn") as watch:  # a rank ending the process
        results = run_ranks(backends, watch.wrap(fn), args, kwargs, abort=mock_world.abort,
                            left=mock_world.mark_left, label="axondist.spawn")
    leftover = mock_world.unreceived()
    if leftover:
        raise CollectiveMismatchError(
            "spawn: messages were sent but never received: " + "; ".join(leftover)
            + " (group ranks); every send needs a matching recv")
    return results


def spawn_on_devices(fn: Callable[..., T], devices: Sequence[int], *args: Any,
                     timeout: float | None = None, **kwargs: Any) -> list[T]:
    """Run ``fn(world, *args, **kwargs)`` on one thread per GPU of ``devices`` (NCCL).

    The ranks are the devices in order; each thread has its GPU as the
    current CuPy device and its :class:`World` as the default group.

    Returns:
        The ranks' return values, in rank order.

    Raises:
        As :func:`spawn`; the communicators of the other ranks are aborted.
    """
    from ..backends import nccl  # CuPy's backend: loaded only by the call that uses it

    backends = nccl.NcclBackend.create_world(list(devices), timeout=timeout)
    link = backends[0].comm.link

    def use_device(rank: int) -> None:
        nccl.use_device(backends[rank].device)

    return run_ranks(backends, fn, args, kwargs, abort=link.abort, before=use_device,
                     label="axondist.spawn_on_devices")


def run(fn: Callable[..., T], world_size: int, *args: Any, timeout: float | None = None,
        **kwargs: Any) -> list[T]:
    """Run ``fn(world, *args, **kwargs)`` on every rank, wherever the script was started.

    Under a launcher this process is one rank of the launched world, the one
    :func:`init` joins: MPI under ``mpiexec``, ``srun`` or ``axondist run``; the torch
    backend under ``torchrun``, ``axondist run --launcher torchrun`` or a Kubernetes
    operator (``RANK``/``WORLD_SIZE`` set). ``fn`` runs once here, ``world_size`` is
    ignored, and the list holds this rank's result only. Otherwise ``world_size`` ranks
    run on threads, as :func:`spawn`, and the list holds every rank's result.

    Returns:
        This process's ranks' results, in rank order.

    Raises:
        LaunchError: a launcher started several processes that no installed backend can
            join (torchrun without torch, say), as :func:`init` raises it.
    """
    if launcher_name() is not None:
        world = peek_world()
        if world is None or world.backend is None or world.world_size == 1:
            world = init(timeout=timeout) if timeout is not None else init()
        return [fn(world, *args, **kwargs)]
    return spawn(fn, world_size, *args, timeout=timeout, **kwargs)


def launcher_name() -> str | None:
    """What started this process as one rank of several (``"mpiexec"``, ``"torchrun"``, an
    env-style launcher), or None for a plain ``python`` run."""
    if launched_by_mpi():
        return "mpiexec"
    if env_launch_size() is None:
        return None
    return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "the launcher"


def run_ranks(backends: Sequence[Backend], fn: Callable[..., T], args: Sequence[Any],
              kwargs: dict[str, Any], *, abort: Callable[[int, BaseException], None],
              left: Callable[[int, str], None] | None = None,
              before: Callable[[int], None] | None = None, label: str) -> list[T]:
    """Run ``fn(world, ...)`` for each backend on its own thread; what spawn and
    spawn_on_devices share (failure, departure and stuck-rank handling)."""
    n = len(backends)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    finished = threading.Semaphore(0)
    ended = [False] * n

    def body(rank: int) -> None:
        backend = backends[rank]
        try:
            if before is not None:
                before(rank)
            with use_world(World(backend)) as world:
                results[rank] = fn(world, *args, **kwargs)
            _drain(backend)
            if left is not None:
                left(rank, "its function returned")
        except SystemExit as exc:
            errors[rank] = exc
            if left is not None:
                left(rank, f"it called sys.exit({exc.code!r})")
            else:
                abort(rank, exc)
        except BaseException as exc:  # noqa: BLE001 - re-raised by run_ranks below
            errors[rank] = exc
            abort(rank, exc)
        finally:
            backend.close()
            ended[rank] = True
            finished.release()

    threads = [threading.Thread(target=body, args=(r,), name=f"axondist-rank{r}", daemon=True)
               for r in range(n)]
    for t in threads:
        t.start()
    done, deadline = 0, None
    while done < n:
        if finished.acquire(timeout=None if deadline is None else
                            max(0.0, deadline - time.monotonic())):
            done += 1
            if deadline is None and any(e is not None for e in errors):
                deadline = time.monotonic() + _GRACE
        else:
            break  # some ranks are stuck in their own code after another one failed
    for rank, thread in enumerate(threads):
        if ended[rank]:
            # its end is near but not done: its thread-local state (a JAX rank's, in C++)
            # is destroyed as the thread ends, which must not meet the interpreter's exit
            thread.join()
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    return _results_or_raise(results, errors, stuck, label)


def _drain(backend: Backend) -> None:
    """Wait for the rank's own non-blocking calls before it counts as having left."""
    drain = getattr(backend, "drain", None)
    if drain is not None:
        drain()


def _results_or_raise(results: list[Any], errors: list[BaseException | None],
                      stuck: list[int], label: str) -> list[Any]:
    n = len(errors)
    failed = [r for r, e in enumerate(errors) if e is not None]
    if not failed:
        return results
    exits = [r for r in failed if isinstance(errors[r], SystemExit)]
    if len(exits) == len(failed) and not stuck:
        raise errors[exits[0]]  # type: ignore[misc]  # no other rank was harmed by the exit

    def rank_of_kind(kind: Callable[[BaseException], bool]) -> int | None:
        return next((r for r in failed if kind(errors[r])), None)  # type: ignore[arg-type]

    rank = rank_of_kind(lambda e: not isinstance(e, (WorldAbortedError, SystemExit)))
    if rank is None:
        rank = rank_of_kind(lambda e: isinstance(e, RankExitedError))
    if rank is None:
        rank = rank_of_kind(lambda e: isinstance(e, WorldAbortedError))
    if rank is None:
        rank = exits[0]
    exc = errors[rank]
    assert exc is not None
    if isinstance(exc, SystemExit):
        exc = RankExitedError(f"rank {rank} called sys.exit({exc.code!r}) while ranks {stuck} "
                              "were still running")
    note = f"raised on rank {rank} of {n} ({label})"
    if stuck:
        note += (f"; ranks {stuck} were still running {_GRACE:g} s later (stuck in their own "
                 "code) and were left behind")
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(note)
    try:
        exc.axondist_rank = rank  # type: ignore[attr-defined]
    except AttributeError:  # exceptions with __slots__
        pass
    raise exc


__all__ = ["init", "launched_by_mpi", "run", "run_ranks", "spawn", "spawn_on_devices"]
