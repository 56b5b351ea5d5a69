"""The whole pipeline model's parameters by global name: naming, gathering and loading.

A pipeline rank holds only its own stages, so a name that means the same
thing on every rank needs the layout of every rank: the parameters are
listed in model order (virtual stage, then position in the stage, a
Parameter shared by several local stages once, at its first), and an
unnamed one is called ``param{i}`` after its index in that list, as under
DDP and FSDP. One object all-gather over the pipeline's group gives every
rank that list, with the arrays for :func:`gather_state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from axondist import _array, comm
from axondist.parameter import Parameter
from axondist.pipeline.stage import PipelineStage
from axondist.process_group import ProcessGroup

__all__ = ["ModelEntry", "gather_state", "load_state", "model_entries"]


@dataclass(frozen=True)
class ModelEntry:
    """One parameter of the whole pipeline model, as every rank sees it."""

    name: str
    """The global name: the Parameter's own, or ``param{i}`` (``i`` its model-order index)."""
    stage: int
    """The virtual stage that holds it (the first, when shared by several)."""
    shape: tuple[int, ...]
    """The parameter's shape."""
    value: Any = None
    """A NumPy copy of its values (only from :func:`model_entries` with ``with_values``)."""


def _local(stages: dict[int, PipelineStage], with_values: bool
           ) -> tuple[list[tuple[int, int, str | None, tuple[int, ...], Any]],
                      dict[tuple[int, int], Parameter]]:
    """This process's parameters as ``(stage, position, name, shape, value)`` in model order,
    and each one's Parameter by ``(stage, position)``."""
    rows: list[tuple[int, int, str | None, tuple[int, ...], Any]] = []
    held: dict[tuple[int, int], Parameter] = {}
    seen: set[int] = set()
    for s in sorted(stages):
        for k, prm in enumerate(stages[s].params):
            if id(prm) in seen:
                continue
            seen.add(id(prm))
            value = _array.to_host(prm.data).copy() if with_values else None
            rows.append((s, k, prm.name, tuple(prm.shape), value))
            held[(s, k)] = prm
    return rows, held


def model_entries(stages: dict[int, PipelineStage], group: ProcessGroup | None, where: str, *,
                  with_values: bool = False) -> tuple[list[ModelEntry], dict[str, Parameter]]:
    """Every parameter of the whole model in model order, and those held here by name.

    Collective over ``group`` when it is not None (every rank calls it; one
    object all-gather); with None every stage is in this process.

    Raises:
        ValueError: two parameters have the same global name (on every rank alike).
    """
    rows, held = _local(stages, with_values)
    if group is not None and group.world_size > 1:
        rows = [row for part in comm.all_gather_object(rows, group) for row in part]
    rows.sort(key=lambda row: (row[0], row[1]))
    entries: list[ModelEntry] = []
    mine: dict[str, Parameter] = {}
    first: dict[str, int] = {}
    for i, (s, k, name, shape, value) in enumerate(rows):
        label = name or f"param{i}"
        if label in first:
            raise ValueError(f"{where}: two parameters are named {label!r} (in stages "
                             f"{first[label]} and {s}); name them uniquely (state dicts key "
                             "arrays by name)")
        first[label] = s
        entries.append(ModelEntry(label, s, shape, value))
        if (s, k) in held:
            mine[label] = held[(s, k)]
    return entries, mine


def gather_state(stages: dict[int, PipelineStage], group: ProcessGroup | None,
                 where: str) -> dict[str, Any]:
    """``{global name: NumPy copy}`` of the whole model, in model order, on every rank.

    Raises:
        ValueError: two parameters have the same global name.
    """
    entries, _ = model_entries(stages, group, where, with_values=True)
    return {e.name: e.value for e in entries}


def load_state(stages: dict[int, PipelineStage], group: ProcessGroup | None,
               state: Any, where: str) -> None:
    """Copy this process's parameters from ``state``, a whole model's ``{name: array}``.

    The layout is gathered first (collective), then ``state`` is checked
    against the whole model before anything is written, so every rank given
    the same ``state`` raises the same error, and a rank given a bad one
    does not leave the others waiting.

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: a name missing or unknown, an array of another shape, or
            two parameters of the model with the same name.
    """
    entries, mine = model_entries(stages, group, where)
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: state must be a dict {{name: array}} such as state_dict() "
                        f"returns, got {type(state).__name__}")
    names = [e.name for e in entries]
    missing = [n for n in names if n not in state]
    unknown = [k for k in state if k not in set(names)]
    if missing or unknown:
        raise ValueError(f"{where}: the state's names differ from the model's: missing "
                         f"{missing[:5]}, unexpected {unknown[:5]}; load a state_dict() of the "
                         "same model")
    for e in entries:
        shape = getattr(state[e.name], "shape", None)
        got = tuple(_array.as_array(state[e.name]).shape if shape is None else shape)
        if got != e.shape:
            raise ValueError(f"{where}: {e.name!r} has shape {got}, the parameter has {e.shape}")
    for name, prm in mine.items():
        xp = _array.namespace(prm.data)
        prm.data[...] = xp.asarray(state[name])
