"""Starting a world: :func:`init` for the launched job, :func:`spawn` for threads."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ._environment import launched_by_mpi
from .backends.base import Backend
from .backends.mock import MockBackend
from .errors import WorldAbortedError
from .process_group import World, set_process_world, use_world

T = TypeVar("T")

def _mock_backend(**options: Any) -> Backend:
    return MockBackend.create_world(1, options.get("timeout"))[0]


def _mpi_backend(**options: Any) -> Backend:
    from .backends import mpi

    return mpi.create_world_backend(**options)


def _nccl_backend(**options: Any) -> Backend:
    from .backends import nccl

    return nccl.create_world_backend(**options)


#: name -> factory of this process's world backend.
BACKENDS: dict[str, Callable[..., Backend]] = {
    "mock": _mock_backend,
    "mpi": _mpi_backend,
    "nccl": _nccl_backend,
}


def init(backend: str | None = None, **options: Any) -> World:
    """Start this process's world and make it the default group.

    Args:
        backend: ``"mock"``, ``"mpi"`` or ``"nccl"``; when None, the
            ``AXONDIST_BACKEND`` environment variable, else ``"mpi"`` when the
            process was launched by mpiexec/mpirun/srun, else a one-rank
            ``"mock"`` world.
        **options: passed to the backend (e.g. ``timeout`` for mock).

    Raises:
        ValueError: an unknown backend name (the message lists the valid ones).
        BackendUnavailableError: the backend's library is missing (the message
            says what to install).
    """
    name = backend or os.environ.get("AXONDIST_BACKEND") or (
        "mpi" if launched_by_mpi() else "mock")
    name = name.lower()
    if name not in BACKENDS:
        raise ValueError(f"init: unknown backend {name!r}; choose one of {sorted(BACKENDS)}")
    world = World(BACKENDS[name](**options))
    set_process_world(world)
    return world


def spawn(fn: Callable[..., T], world_size: int, *args: Any, timeout: float | None = None,
          **kwargs: Any) -> list[T]:
    """Run ``fn(world, *args, **kwargs)`` on every rank of a new in-process mock world.

    Each rank runs on its own thread with ``world`` (a :class:`World`, usable
    as a group) as its default group, so collectives called without a group
    use it.

    Args:
        fn: the per-rank function.
        world_size: number of ranks (threads).
        timeout: seconds a collective waits for missing ranks before failing
            (``AXONDIST_TIMEOUT``, default 300, when None).

    Returns:
        The ranks' return values, in rank order.

    Raises:
        The first failing rank's own exception (a rank whose error was not
        merely caused by another rank's failure), with a note naming the
        rank; the other ranks are released rather than left waiting.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spawn: world_size must be a positive int, got {world_size!r}")
    backends = MockBackend.create_world(world_size, timeout)
    mock_world = backends[0].world
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(rank: int) -> None:
        with use_world(World(backends[rank])) as world:
            try:
                results[rank] = fn(world, *args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised by spawn below
                errors[rank] = exc
                mock_world.abort(rank, exc)
            finally:
                backends[rank].close()

    threads = [threading.Thread(target=run, args=(r,), name=f"axondist-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        primary = [r for r in failed if not isinstance(errors[r], WorldAbortedError)] or failed
        rank = primary[0]
        exc = errors[rank]
        assert exc is not None
        note = f"raised on rank {rank} of {world_size} (axondist.spawn)"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        try:
            exc.axondist_rank = rank  # type: ignore[attr-defined]
        except AttributeError:  # exceptions with __slots__
            pass
        raise exc
    return results


__all__ = ["BACKENDS", "init", "launched_by_mpi", "spawn"]
