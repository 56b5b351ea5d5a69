"""What the mock world says when one of its ranks ends the whole process.

Every rank of the mock world is a thread of one process, so a rank that calls
``os._exit``, kills its own process or aborts it takes every rank with it, where
under a launcher only that rank's process would end and its peers would name it.
While a world runs, :class:`ProcessEndWatch` stands in front of ``os._exit``,
``os.kill`` and ``os.abort``: a call that ends the process first prints (to
stderr, flushed) which rank made it, how, and what the other ranks were doing,
then goes on as asked. A fault no Python code sees (a segmentation fault in an
extension) is reported by :mod:`faulthandler`, enabled while the world runs,
whose stack of the crashing thread shows the rank's frame, ``rank_N_of_the_mock_world``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from .world import MockWorld

#: Signals whose default action does not end the process.
_HARMLESS = frozenset(getattr(signal, name) for name in (
    "SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH", "SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU")
    if hasattr(signal, name))

_running: list[ProcessEndWatch] = []  # innermost last
_lock = threading.Lock()
_installed: dict[str, Any] = {}  # what stood there before the watches (restored after the last)


class ProcessEndWatch:
    """While entered, a call of one of ``world``'s ranks that ends the process is named first.

    Args:
        world: the mock world whose ranks run on threads of this process.
        label: what started it (``"axondist.spawn"``), for the message.
    """

    def __init__(self, world: MockWorld, label: str) -> None:
        self.world = world
        self.label = label
        self._ranks: dict[int, int] = {}  # thread ident -> rank
        self._faulthandler = False

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` called through a frame named for its rank (``rank_1_of_the_mock_world``),
        which registers the calling thread as that rank: a crash dump's stack names it."""
        frames = [_named_frame(rank) for rank in range(self.world.world_size)]

        def rank_entry(world: Any, *args: Any, **kwargs: Any) -> Any:
            self._ranks[threading.get_ident()] = world.rank
            self.world.rank_threads[world.rank] = threading.get_ident()
            return frames[world.rank](fn, world, *args, **kwargs)

        return rank_entry

    def __enter__(self) -> ProcessEndWatch:
        with _lock:
            if not _running:
                _install()
            _running.append(self)
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)
            self._faulthandler = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._faulthandler:
            faulthandler.disable()
        with _lock:
            _running.remove(self)
            if not _running:
                _uninstall()

    def rank_of_this_thread(self) -> int | None:
        """The rank whose thread is calling, or None for another thread."""
        return self._ranks.get(threading.get_ident())

    def describe(self, rank: int | None, how: str) -> str:
        """The message for the process ended by ``how`` (``"it called os._exit(1)"``)."""
        n = self.world.world_size
        who = (f"rank {rank} of the mock world ({self.label}, {n} ranks on threads of this "
               f"process)" if rank is not None else
               f"a thread of this process that is not a rank of the mock world ({self.label}, "
               f"{n} ranks)")
        others = [r for r in range(n) if r != rank]
        lines = [f"{who} ends the whole process: {how}. Every rank of the mock world is a "
                 f"thread of this one process, so ranks {others} end with it:"]
        lines += [f"  {self.world.describe_rank(r)}" for r in others]
        lines.append("End one rank with return, sys.exit() or an exception instead: the other "
                     "ranks are then told which rank left and why.")
        return "\n".join(lines)

    def unfinished(self, rank: int | None) -> bool:
        """Whether a rank other than ``rank`` has not finished yet (its function still runs)."""
        with self.world.lock:
            left = set(self.world.left)
        return any(r not in left for r in range(self.world.world_size) if r != rank)


def _named_frame(rank: int) -> Callable[..., Any]:
    def frame(fn: Callable[..., Any], world: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(world, *args, **kwargs)

    frame.__code__ = frame.__code__.replace(co_name=f"rank_{rank}_of_the_mock_world")
    return frame


def _say(text: str) -> None:
    """``text`` on stderr, each line marked, after whatever the ranks printed (flushed: the
    process ends without flushing)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        sys.stderr.write("".join(f"[axondist] {line}" for line in (text + "\n").splitlines(True)))
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _caller() -> tuple[ProcessEndWatch, int | None] | None:
    """The innermost running watch and the calling thread's rank in it (the watch whose
    rank the thread is, else the innermost with None); None when no watch runs."""
    running = list(_running)
    for watch in reversed(running):
        rank = watch.rank_of_this_thread()
        if rank is not None:
            return watch, rank
    return (running[-1], None) if running else None


def _exit(status: int) -> None:
    found = _caller()
    if found is not None:
        watch, rank = found
        if status == 0 and watch.unfinished(rank):
            status = 1  # the job did not finish: a launcher would report it failed
            how = "it called os._exit(0) (the process exits with status 1: ranks had not finished)"
        else:
            how = f"it called os._exit({status})"
        _say(watch.describe(rank, how))
    _installed["_exit"](status)


def _kill(pid: int, sig: int) -> None:
    found = _caller()
    if found is not None and pid in (0, os.getpid(), -os.getpgrp()) and _ends_process(sig):
        watch, rank = found
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        _say(watch.describe(rank, f"it sent {name} to its own process"
                                  + (" (its process group)" if pid <= 0 else "")))
    _installed["kill"](pid, sig)


def _abort() -> None:
    found = _caller()
    if found is not None:
        _say(found[0].describe(found[1], "it called os.abort() (SIGABRT)"))
    _installed["abort"]()


def _ends_process(sig: int) -> bool:
    """Whether ``sig`` ends this process: its handler is the default one and the default
    action is to terminate (SIGKILL always does)."""
    if sig == signal.SIGKILL:
        return True
    if sig in _HARMLESS or sig == 0:
        return False
    try:
        return signal.getsignal(sig) == signal.SIG_DFL
    except ValueError:
        return False


def _install() -> None:
    _installed.update({"_exit": os._exit, "kill": os.kill, "abort": os.abort})
    os._exit, os.kill, os.abort = _exit, _kill, _abort  # type: ignore[assignment]


def _uninstall() -> None:
    """Put back what stood there, unless someone replaced ours meanwhile (then theirs stays)."""
    if os._exit is _exit:
        os._exit = _installed["_exit"]
    if os.kill is _kill:
        os.kill = _installed["kill"]
    if os.abort is _abort:
        os.abort = _installed["abort"]


__all__ = ["ProcessEndWatch"]
