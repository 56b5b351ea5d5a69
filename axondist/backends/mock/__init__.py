"""The mock backend: an in-process world of N ranks on N threads, deterministic.

:mod:`.world` holds what the ranks share (the rounds of collectives in progress, the
mailboxes of messages, the flight recorders); :mod:`.backend` puts one
:class:`MockBackend` per rank on top of it; :mod:`.process_end` names a rank that
ends the whole process. Always available; it imports no communication library.
"""

from .backend import MockBackend, create_world_backend
from .world import MockWorld

__all__ = ["MockBackend", "MockWorld", "create_world_backend"]
