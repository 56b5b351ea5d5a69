"""An MPI job's world: the backend every rank makes at ``axondist.init("mpi")``, its
watchdog, and the hook that ends the whole job when one rank fails."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

from ..._validate import positive_seconds
from ..base import default_timeout, stall_warning_after
from ..recording.recorder import FlightRecorder
from ..watchdog.watchdog import (
    Watchdog,
    exit_soon,
    print_and_flush,
    silence_all,
    wait_until_output_is_read,
)
from .backend import MPIBackend
from .transport import MPIOptions, load_mpi

# --- the job: factory and abort-on-failure -------------------------------------------------

_HOOK_INSTALLED = False


def install_abort_hook() -> None:
    """Make an uncaught exception on any rank end the whole MPI job.

    The hook prints the traceback with each line prefixed by
    ``[axondist rank R/N]`` to stderr, then calls ``COMM_WORLD.Abort(1)`` (on a
    one-rank job it defers to the previous hook). Installed once per process.
    """
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    MPI = load_mpi()
    previous = sys.excepthook

    def abort_job(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        silence_all()  # this rank fails: its peers must not read its exit as a departure
        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        if size == 1:
            previous(exc_type, exc, tb)
            return
        try:
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()  # what the script printed comes first
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            _abort_job(text + f"rank {rank} failed: aborting the MPI job so the other ranks "
                       "do not wait forever")
        finally:
            # where the launcher is gone (and its pipes with it), writing fails and Abort
            # fails or never returns: this rank still ends here, never in the interpreter's
            # normal exit, whose exit hooks wait for the other ranks
            os._exit(1)

    sys.excepthook = abort_job
    _HOOK_INSTALLED = True


def create_world_backend(*, comm: Any = None, abort_on_exception: bool = True,
                         timeout: float | None = None, **options: Any) -> MPIBackend:
    """This process's endpoint in the world of the MPI job (``axondist.init("mpi")``).

    Also starts the rank's watchdog (for more than one rank): a call that
    waits past ``timeout`` seconds, or for a rank that left, ends the job on
    every rank with one message naming the ranks and what each was doing.

    Args:
        comm: the mpi4py communicator whose ranks form the world
            (``MPI.COMM_WORLD`` when None); axondist communicates on a
            duplicate of it, never on it.
        abort_on_exception: install :func:`install_abort_hook`.
        timeout: seconds a call may wait for its peers (``AXONDIST_TIMEOUT``,
            default 600); stall warnings start at ``AXONDIST_STALL_WARNING``
            (default 60, at most half the timeout).
        **options: fields of :class:`MPIOptions` (``chunk_bytes``,
            ``host_staging``, ``debug``, ``checks``), overriding the environment.

    Raises:
        BackendUnavailableError: mpi4py or the MPI library is missing.
        TypeError: an unknown option.
        ValueError: a timeout that is not a finite number > 0, or ranks started
            with different settings.
    """
    MPI = load_mpi()
    policy = MPIOptions.from_env(**options)
    wait = default_timeout() if timeout is None else positive_seconds(timeout, "init")
    if abort_on_exception:
        install_abort_hook()
    base = MPI.COMM_WORLD if comm is None else comm
    dup = base.Dup()
    dup.Set_errhandler(MPI.ERRORS_RETURN)
    rank, size = dup.Get_rank(), dup.Get_size()
    recorder = FlightRecorder(rank, size, MPI.Get_processor_name())
    watchdog = None
    if size > 1:
        watchdog = Watchdog(recorder, timeout=wait, stall=stall_warning_after(wait),
                            abort=_abort_job, token=dup.bcast(os.urandom(16).hex(), root=0))
    settings = (policy.checks, policy.debug, policy.chunk_bytes, policy.piece_bytes, wait)
    table = dup.allgather((settings, watchdog.address if watchdog else None))
    if any(t[0] != settings for t in table):
        detail = ", ".join(f"rank {k}: checks={t[0][0]}, debug={t[0][1]}, chunk_bytes={t[0][2]}, "
                           f"piece_bytes={t[0][3]}, timeout={t[0][4]:g}"
                           for k, t in enumerate(table))
        dup.Free()
        raise ValueError("init: the ranks were started with different axondist settings "
                         f"({detail}); set AXONDIST_CHECKS, AXONDIST_DEBUG, "
                         "AXONDIST_MPI_CHUNK_BYTES, AXONDIST_PIECE_MB and AXONDIST_TIMEOUT alike "
                         "on every rank")
    if watchdog is not None:
        watchdog.start([t[1] for t in table])
    backend = MPIBackend(dup, policy, recorder=recorder)
    backend.watchdog = watchdog
    if size > 1:
        atexit.register(report_unreceived, backend, wait)
    return backend


#: Seconds the exit waits for the messages owed to this rank to land.
OWED_WAIT = 5.0


def unreceived(backend: MPIBackend, timeout: float) -> dict[tuple[int, int], int] | None:
    """Messages of :func:`axondist.send` sent to this rank and never received, as
    ``{(source rank, user tag): messages}``; drained, so MPI can finalize.

    Collective over the world, at the exit: the ranks exchange how many messages each sent
    to each (one ``Ialltoall``), so a rank knows exactly what is still owed to it and waits
    for those messages alone (MPI delivers every message sent; at most :data:`OWED_WAIT`
    seconds), not for a while in case one is still landing. None when some rank did not
    reach its exit within ``timeout`` seconds (the job's ``AXONDIST_TIMEOUT``)."""
    comm = backend.comm
    if comm is None:
        return {}
    mpi = backend.mpi
    owed = np.empty_like(backend.sent)
    exchange = comm.Ialltoall(backend.sent, owed)  # owed[s]: the messages rank s sent here
    give_up = time.monotonic() + timeout
    while not exchange.Test():
        if time.monotonic() >= give_up:
            return None
        time.sleep(1e-3)
    give_up = time.monotonic() + OWED_WAIT
    status = mpi.Status()
    found: dict[tuple[int, int, int], int] = {}
    for source in np.flatnonzero(owed > backend.received).tolist():
        left = int(owed[source] - backend.received[source])
        while left and time.monotonic() < give_up:
            if not comm.Iprobe(source, mpi.ANY_TAG, status):
                time.sleep(1e-3)
                continue
            tag = status.Get_tag()
            comm.Recv(bytearray(status.Get_count(mpi.BYTE)), source, tag)
            key = (source, tag // 2, tag % 2)
            found[key] = found.get(key, 0) + 1
            left -= 1
    # an array's message is a header (an object, on the odd tag) and its data (the even
    # tag): counted once
    return {(source, tag): max(found.get((source, tag, 0), 0), found.get((source, tag, 1), 0))
            for source, tag, _ in found}


def report_unreceived(backend: MPIBackend, timeout: float) -> None:
    """At a clean exit: name the messages sent to this rank that it never received, and
    end with status 1 (a send without its receive is a bug the mock world reports too).
    Waits at most ``timeout`` seconds for the other ranks to reach their exit."""
    if backend.comm is None or backend.mpi.Is_finalized():
        return
    if backend.watchdog is not None:
        # before the exchange waits for every rank's exit: a peer still inside a call with
        # this rank must hear that it left (its watchdog ends the job, naming it)
        backend.watchdog.announce_left()
    found = unreceived(backend, timeout)
    if found is None:
        print_and_flush(f"[axondist rank {backend.rank}/{backend.world_size}] ",
                        f"some ranks did not reach the end of their script within {timeout:g} s "
                        "of this rank's (AXONDIST_TIMEOUT): this rank exits without checking "
                        "that every message sent to it was received")
        return
    if not found:
        return
    silence_all()  # this rank ends the job: its peers must not read it as a departure
    rank, size = backend.rank, backend.world_size
    detail = "; ".join(f"{count} from rank {source} to rank {rank} (tag {tag})"
                       for (source, tag), count in sorted(found.items()))
    print_and_flush(f"[axondist rank {rank}/{size}] ",
                    f"messages were sent but never received: {detail}; every send needs a "
                    "matching recv (with the same tag) on its destination")
    wait_until_output_is_read()  # the launcher ends the job on this exit: read it first
    os._exit(1)


def _abort_job(message: str) -> None:
    """Print ``message`` on this rank and end the job on every rank (the watchdog's end, and
    the abort hook's)."""
    silence_all()
    world = load_mpi().COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    print_and_flush(f"[axondist rank {rank}/{size}] ", message)
    exit_soon(1, 5.0)  # should MPI_Abort itself hang (a launcher cut off from this host)
    wait_until_output_is_read()
    world.Abort(1)


__all__ = ["create_world_backend", "install_abort_hook"]
