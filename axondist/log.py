"""Output for distributed scripts: the ``axondist`` logger with the rank and world size in every
record, :func:`print0` (rank 0 prints) and :func:`all_reduce_scalar` (a global loss as a Python
float). Importing this module adds no handler unless ``AXONDIST_LOG_LEVEL`` asks for one;
:func:`setup` adds a stderr handler on request."""

from __future__ import annotations

import logging
import numbers
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from . import _array, comm
from ._validate import parse_choice
from .backends import settings
from .ops import ReduceOp
from .process_group import ProcessGroup, resolve_group

#: The library's logger name; modules log to ``axondist.<module>``.
LOGGER_NAME = "axondist"
#: Set to a level name (``INFO``, ``DEBUG``...) to get a stderr handler without code.
LEVEL_VAR = "AXONDIST_LOG_LEVEL"
#: The format of :func:`setup`'s handler.
FORMAT = "%(asctime)s [rank %(rank)s/%(world_size)s] %(levelname)s %(name)s: %(message)s"

RankSource = Callable[[], "tuple[int, int] | None"]

_rank_source: RankSource | None = None
# (variable holding the rank, variable holding the size), in the order launchers are trusted.
_ENV_RANKS = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
              ("PMIX_RANK", "PMIX_SIZE"), ("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))
_ALIASES = {"mean": ReduceOp.AVERAGE, "avg": ReduceOp.AVERAGE, "prod": ReduceOp.PRODUCT}


def set_rank_source(source: RankSource | None) -> RankSource | None:
    """Tell the logger where the current rank comes from.

    The code that starts worlds registers a callable returning ``(rank, world_size)`` of the
    calling thread's world, or None when there is none yet; it must never start a world.
    Records fall back to the launcher's environment variables when it returns None.

    Args:
        source: the callable, or None to forget it.

    Returns:
        The callable registered before (to restore it later).
    """
    global _rank_source
    previous, _rank_source = _rank_source, source
    return previous


def current_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` for a log record: the registered source, else the launcher's
    environment (``PMI_RANK``/``PMI_SIZE``, ``RANK``/``WORLD_SIZE``...), else None."""
    if _rank_source is not None:
        try:
            found = _rank_source()
        except Exception:  # noqa: BLE001 - logging must never fail the caller
            found = None
        if found is not None:
            return found
    env = os.environ
    for rank_var, size_var in _ENV_RANKS:
        rank, size = env.get(rank_var, ""), env.get(size_var, "")
        if rank.isdigit() and size.isdigit():
            return int(rank), int(size)
    return None


class RankFilter(logging.Filter):
    """Adds ``record.rank`` and ``record.world_size`` (``"-"`` when no world is known) to each
    record that lacks them; attach it to a handler of your own to format with them."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Fill the fields; never drops a record."""
        if not hasattr(record, "rank"):
            found = current_rank()
            record.rank, record.world_size = found if found is not None else ("-", "-")
        return True


_FILTER = RankFilter()


def get_logger(name: str = LOGGER_NAME) -> logging.Logger:
    """The logger ``name`` under ``axondist`` (``"ddp"`` gives ``axondist.ddp``), with the
    rank fields added to every record it makes."""
    full = name if name == LOGGER_NAME or name.startswith(LOGGER_NAME + ".") else (
        f"{LOGGER_NAME}.{name}")
    logger = logging.getLogger(full)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


logger = get_logger()
logger.addHandler(logging.NullHandler())  # no "no handlers could be found" for users

_HANDLER_MARK = "_axondist_handler"


def _level(level: int | str) -> int:
    if isinstance(level, bool) or not isinstance(level, (int, str)):
        raise TypeError(f"setup: level must be a level name or number, got "
                        f"{type(level).__name__} {level!r}")
    if isinstance(level, int):
        return level
    text = level.strip().upper()
    if text.isdigit():
        return int(text)
    number = logging.getLevelName(text)
    if not isinstance(number, int):
        raise ValueError(f"setup: level {level!r} is not a logging level; use DEBUG, INFO, "
                         "WARNING, ERROR or CRITICAL")
    return number


def setup(level: int | str = "INFO", stream: TextIO | None = None,
          fmt: str = FORMAT) -> logging.Handler:
    """Send the ``axondist`` logger's records at ``level`` and above to ``stream``.

    Calling it again replaces the handler it added before (never the application's own).

    Args:
        level: a level name (``"DEBUG"``, ``"info"``) or number.
        stream: where records go (``sys.stderr`` when None).
        fmt: the :mod:`logging` format; ``%(rank)s`` and ``%(world_size)s`` are available.

    Returns:
        The handler (remove it with ``logging.getLogger("axondist").removeHandler``).

    Raises:
        ValueError: an unknown level name.
        TypeError: a level that is neither a name nor a number.
    """
    number = _level(level)
    for old in [h for h in logger.handlers if getattr(h, _HANDLER_MARK, False)]:
        logger.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(_FILTER)  # also for records of loggers made without get_logger
    handler.setFormatter(logging.Formatter(fmt))
    setattr(handler, _HANDLER_MARK, True)
    logger.addHandler(handler)
    logger.setLevel(number)
    return handler


def setup_from_env() -> logging.Handler | None:
    """Call :func:`setup` with ``AXONDIST_LOG_LEVEL`` when it is set; else do nothing.

    Raises:
        ValueError: the variable names no level (the message says which it was).
    """
    value: str | None = settings.read(LEVEL_VAR)
    if not value:
        return None
    try:
        return setup(value)
    except ValueError as exc:
        raise ValueError(f"{LEVEL_VAR}={value!r}: {exc}") from None


def print0(*args: Any, group: ProcessGroup | None = None, **kwargs: Any) -> None:
    """``print(*args, **kwargs)`` on rank 0 of ``group`` only; the other ranks print nothing.

    Not a collective: ranks need not call it together. Without a world yet, it starts one
    as every collective does (``axondist.init()``).

    Args:
        *args: what to print.
        group: whose rank 0 prints (the current world when None).
        **kwargs: ``print``'s ``sep``, ``end``, ``file``, ``flush``.
    """
    if comm.rank(group) == 0:
        print(*args, **kwargs)


def all_reduce_scalar(value: Any, op: ReduceOp | str = "mean",
                      group: ProcessGroup | None = None) -> float:
    """A scalar reduced over the group, as a Python float on every rank (a collective).

    Typical use: ``loss = all_reduce_scalar(local_loss)`` for the global mean loss. The
    reduction runs in float64, so the ranks agree bit for bit.

    Args:
        value: a Python or NumPy number, or a one-element array (NumPy, CuPy, a framework
            tensor with ``__float__``).
        op: ``"mean"`` (default), ``"sum"``, ``"min"``, ``"max"``, ``"product"``, or a
            :class:`~axondist.ReduceOp`.
        group: the group (the current world when None).

    Returns:
        The reduced value.

    Raises:
        TypeError: ``value`` is not a real number or a one-element array.
        ValueError: an unknown ``op``.
    """
    if isinstance(value, (str, bytes)) or isinstance(value, numbers.Complex) and not \
            isinstance(value, numbers.Real):
        raise TypeError(f"all_reduce_scalar: value must be a real number or a one-element "
                        f"array, got {type(value).__name__} {value!r}")
    reduce_op = parse_choice(ReduceOp, op, "all_reduce_scalar: op", _ALIASES)
    item = getattr(value, "item", None)  # arrays and tensors: their one element
    try:
        number = float(item() if callable(item) else value)
    except (TypeError, ValueError, RuntimeError):
        shape = getattr(value, "shape", None)
        what = f"an array of shape {shape}" if shape is not None else type(value).__name__
        raise TypeError(f"all_reduce_scalar: value must be a real number or a one-element "
                        f"array, got {what}; reduce arrays with axondist.all_reduce") from None
    g = resolve_group(group)
    buf = g.backend_for("all_reduce_scalar").metadata_buffer(np.array([number], dtype=np.float64))
    comm.all_reduce(buf, reduce_op, g)
    return float(_array.to_host(buf)[0])


try:
    setup_from_env()
except ValueError as _exc:  # a typo in the variable must not break `import axondist.log`
    warnings.warn(f"axondist.log: {_exc}; no log handler added", RuntimeWarning, stacklevel=1)

__all__ = ["FORMAT", "LEVEL_VAR", "LOGGER_NAME", "RankFilter", "all_reduce_scalar",
           "current_rank", "get_logger", "logger", "print0", "set_rank_source", "setup",
           "setup_from_env"]
