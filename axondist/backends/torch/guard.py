"""What runs around every call of the torch backend: its number, its flight-recorder entry,
and the cross-rank check that the ranks called the same thing with the same arguments.

The check is one small all-reduce (MAX of the call's check words ``[h, -h]``, see
:mod:`~axondist.backends.checks`) before the call's data moves, over the group's own
sockets (:mod:`.wires`) where the world made them, else on the group's process group; a
non-blocking call is checked before it starts. When the ranks differ they
exchange their keys (pickled) and raise the same
:class:`~axondist.errors.CollectiveMismatchError`, before any data reaches a caller's
buffer: gloo itself would abort the process on a size mismatch, or hang. Under
``AXONDIST_DEBUG=1`` the check exchanges the full keys instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..checks import CallLog, Key, agreed, raise_if_different
from ..recording.recorder import FlightRecorder
from .wires import GroupWires


class TorchGuard(CallLog):
    """Numbering, recording and argument checks of one torch process group.

    Args:
        dist: ``torch.distributed``.
        torch: ``torch``.
        pg: the group's process group.
        checks: check every call across ranks first.
        recorder: the rank's flight recorder (shared by all its groups).
        group: the group's name in the recorder.
        members: the group's members as world ranks, in group-rank order.
        debug: compare full keys (a pickled all-gather) instead of hashes.
    """

    def __init__(self, dist: Any, torch: Any, pg: Any, checks: bool, recorder: FlightRecorder,
                 group: str, members: Iterable[int], debug: bool = False) -> None:
        super().__init__(recorder, group, members)
        self._dist = dist
        self.pg = pg
        #: The process group the checks run on (None: no checks, or one rank).
        self.checks_group = pg if checks and len(self.members) > 1 else None
        self.checks = self.checks_group is not None
        self.debug = debug
        self._sent = np.zeros(2, np.int64)
        self._tensor = torch.from_numpy(self._sent)
        self._max = dist.ReduceOp.MAX
        #: The group's check sockets (None: the check runs on ``checks_group``).
        self.wires: GroupWires | None = None

    def agree(self, op: str, key: Key, words: np.ndarray) -> None:
        """Return when every rank of the group calls ``op`` with this ``key`` (``words``:
        its check words).

        Raises:
            CollectiveMismatchError: on every rank, naming what differs.
        """
        group = self.checks_group
        if group is None:
            return
        if self.debug:  # the whole call, so ranks in different collectives are told so
            raise_if_different(op, self._all_gather((op, key), group))
            return
        self._sent[...] = words
        if self.wires is not None:
            self.wires.largest(self._sent)
        else:
            self._dist.all_reduce(self._tensor, self._max, group=group)
        if not agreed(self._sent):
            self.disagree(op, key)

    def disagree(self, op: str, key: Key) -> None:
        """Raise, on every rank of the group (each calls this), the error naming what the
        ranks' calls differ in."""
        raise_if_different(op, self._all_gather((op, key), self.pg), named=True)

    def _all_gather(self, obj: Any, group: Any) -> list[Any]:
        found: list[Any] = [None] * len(self.members)
        self._dist.all_gather_object(found, obj, group=group)
        return found


__all__ = ["TorchGuard"]
