"""The torch backend frees the process groups it destroyed on a thread of its own (gloo's
teardown takes about 20 ms a group), and its exit waits for that thread."""

from __future__ import annotations

import threading
import weakref

from axondist.backends.torch.queues import Reaper


class _Group:
    """Stands in for a process group: its teardown is slow and says where it ran."""

    def __init__(self, freed: list[str], slow: threading.Event | None = None) -> None:
        self.freed, self.slow = freed, slow

    def __del__(self) -> None:
        if self.slow is not None:
            self.slow.wait(10)
        self.freed.append(threading.current_thread().name)


def test_a_dropped_group_is_freed_on_the_reapers_thread_and_drain_waits_for_it():
    reaper, freed, slow = Reaper(), [], threading.Event()
    group = _Group(freed, slow)
    alive = weakref.ref(group)
    reaper.drop(group)
    del group
    assert freed == [], "the closing thread waited for the group's teardown"
    threading.Timer(0.2, slow.set).start()
    reaper.drain()
    assert alive() is None
    assert freed == ["axondist-torch-groups-freed"]


def test_every_group_handed_over_is_freed_and_drain_without_any_returns():
    Reaper().drain()  # nothing handed over: no thread, nothing to wait for
    reaper, freed = Reaper(), []
    for _ in range(5):
        reaper.drop(_Group(freed))
    reaper.drain()
    assert freed == ["axondist-torch-groups-freed"] * 5
