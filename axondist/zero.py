"""ZeroRedundancyOptimizer: any axondist optimizer with its state split over ranks (ZeRO-1).

Parameters and gradients stay replicated (average the gradients first, e.g.
with :class:`~axondist.DistributedDataParallel`); the parameters are
flattened into padded units of one dtype, each split into equal shards, and
each rank's optimizer updates only its shard, so it holds only ``1/N`` of the
optimizer state. After the update the shards are all-gathered back into
every rank's parameters. :meth:`ZeroRedundancyOptimizer.state_dict` gathers
the state into the unsharded optimizer's own format, so a checkpoint loads at
any world size, or into the plain optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _array, comm
from ._validate import check_real_gradient
from .errors import CollectiveMismatchError
from .fsdp.sharding import DEFAULT_UNIT_BYTES, FlatUnit, plan_units
from .optim import STATE_DICT_VERSION, Optimizer, optimizer_params
from .parameter import Parameter
from .process_group import ProcessGroup, resolve_group


@dataclass(frozen=True)
class _Piece:
    """The part ``[start, stop)`` of flattened parameter ``param`` this rank updates."""

    param: int
    start: int
    stop: int


class ZeroRedundancyOptimizer:
    """Wrap an optimizer class so each rank keeps and updates 1/N of its state.

    Each rank builds ``optimizer_class`` over 1-D views of its shard, one per
    parameter piece it owns, so the update of every element, and every
    hyper-parameter, is exactly that of the unsharded optimizer (a piece
    whose parameter has no gradient is skipped, as the optimizer skips it).
    ``step()`` copies this rank's pieces of the parameters and gradients
    into the shard, steps, and all-gathers the shards into every parameter
    in place. Every rank must pass the same parameters (checked at
    construction) holding the same values, and call :meth:`step`,
    :meth:`state_dict` together.

    Args:
        params: a model or Parameters, replicated on every rank.
        optimizer_class: an axondist optimizer class (``SGD``, ``Adam``,
            ``AdamW`` or a subclass of :class:`~axondist.optim.Optimizer`).
        group: the data-parallel group (the current world when None).
        unit_size_mb: parameters of one dtype are flattened together in units
            of at most this many MiB (a larger parameter is a unit of its own);
            one all-gather per unit.
        **defaults: the optimizer's hyper-parameters (``lr=...``).

    Raises:
        TypeError: ``optimizer_class`` is not an axondist optimizer class.
        ValueError: no parameters, or bad hyper-parameters (from the optimizer).
        CollectiveMismatchError: the ranks pass different parameters (on every rank).
    """

    def __init__(self, params: Any, optimizer_class: type[Optimizer],
                 group: ProcessGroup | None = None, *,
                 unit_size_mb: float = DEFAULT_UNIT_BYTES / 2**20, **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError("ZeroRedundancyOptimizer: optimizer_class must be an axondist "
                            "optimizer class such as axondist.optim.Adam, got "
                            f"{optimizer_class!r}")
        self.group = resolve_group(group)
        self.params: list[Parameter] = optimizer_params(params, "ZeroRedundancyOptimizer")
        if not self.params:
            raise ValueError("ZeroRedundancyOptimizer: got an empty parameter list")
        self.optimizer_class = optimizer_class
        self._check_same_params()
        self._xp = _array.namespace(*(p.data for p in self.params))
        n, rank = self.group.world_size, self.group.rank
        plan = plan_units([p.size for p in self.params], [p.dtype for p in self.params], None,
                          max(1, int(unit_size_mb * 2**20)))
        self.units = [FlatUnit(u, tuple(m), tuple(self.params[i].shape for i in m),
                               np.dtype(self.params[m[0]].dtype), n) for u, m in enumerate(plan)]
        self._shards = [self._xp.zeros(u.shard_size, dtype=u.dtype) for u in self.units]
        self._pieces: list[_Piece | None] = []
        views: list[Parameter] = []
        for unit, shard in zip(self.units, self._shards):
            for pc in unit.pieces(rank):
                i = unit.param_indices[pc.position]
                self._pieces.append(_Piece(i, pc.param_start, pc.param_stop))
                views.append(Parameter(shard[pc.shard_offset:pc.shard_offset + pc.size],
                                       name=f"{self.params[i].name or f'param{i}'}"
                                            f"[{pc.param_start}:{pc.param_stop}]"))
        if not views:  # more ranks than elements: nothing to update here
            self._pieces.append(None)
            views.append(Parameter(self._xp.zeros(0, dtype=self.params[0].dtype)))
        self._views = views
        self.optim = optimizer_class(views, **defaults)

    def _check_same_params(self) -> None:
        mine = [(tuple(p.shape), str(p.dtype)) for p in self.params]
        everyone = comm.all_gather_object(mine, self.group)
        for r, other in enumerate(everyone):
            if other == everyone[0]:
                continue
            if len(other) != len(everyone[0]):
                detail = (f"rank {r} passes {len(other)} parameters, rank 0 passes "
                          f"{len(everyone[0])}")
            else:
                k = next(i for i, (a, b) in enumerate(zip(other, everyone[0])) if a != b)
                detail = (f"parameter {k} is {other[k][1]}{list(other[k][0])} on rank {r} but "
                          f"{everyone[0][k][1]}{list(everyone[0][k][0])} on rank 0")
            raise CollectiveMismatchError(
                f"ZeroRedundancyOptimizer: the ranks' parameters differ: {detail}. Every rank "
                "must pass the same parameters (shapes, dtypes) in the same order")

    # --- the optimizer interface ------------------------------------------------------------

    @property
    def lr(self) -> float:
        """The wrapped optimizer's learning rate (settable)."""
        return self.optim.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optim.lr = value

    @property
    def step_count(self) -> int:
        """How many times :meth:`step` ran."""
        return self.optim.step_count

    def step(self) -> None:
        """Update this rank's shard from the gradients, then all-gather every parameter.

        Parameters whose ``.grad`` is None are not updated (on any rank: the
        gradients are replicated). Collective: every rank of the group calls it.

        Raises:
            ValueError: a gradient's shape differs from its parameter's.
            UnsupportedDTypeError: a gradient is complex (never cast to real).
        """
        grads = [p.grad if p.grad is None or type(p.grad) is np.ndarray
                 else _array.as_array(p.grad) for p in self.params]  # torch/JAX: their views
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is not None:
                check_real_gradient(g, "ZeroRedundancyOptimizer.step", i, p.name)
            if g is not None and tuple(g.shape) != p.shape:
                raise ValueError(f"ZeroRedundancyOptimizer.step: parameter {i} "
                                 f"({p.name or 'unnamed'}) has shape {p.shape} but its .grad has "
                                 f"shape {tuple(g.shape)}")
        for piece, view in zip(self._pieces, self._views):
            if piece is None:
                continue
            p = self.params[piece.param]
            view.data[...] = p.data.reshape(-1)[piece.start:piece.stop]
            g = grads[piece.param]
            view.grad = None if g is None else g.reshape(-1)[piece.start:piece.stop]
        try:
            self.optim.step()
        finally:
            for view in self._views:
                view.grad = None
        self._all_gather()

    def _all_gather(self) -> None:
        n = self.group.world_size
        for unit, shard in zip(self.units, self._shards):
            full = shard if n == 1 else comm.all_gather(shard, self.group,
                                                        sizes=[unit.shard_size] * n)
            for i, view in zip(unit.param_indices, unit.layout.views(full[:unit.numel])):
                self.params[i].data[...] = view

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (``grad = None``, or zeros in place with False)."""
        for p in self.params:
            p.zero_grad(set_to_none)

    # --- memory and state ------------------------------------------------------------------

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (about 1/N of the unsharded optimizer's).

        Besides it, each rank keeps its 1-D shard of the parameters (the copy
        the optimizer updates, ``1/N`` of the parameter bytes).
        """
        return sum(int(v.nbytes) for state in self.optim.state.values()
                   for v in state.values() if hasattr(v, "nbytes"))

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state in the unsharded optimizer's format, on every rank.

        Collective: each rank's pieces are all-gathered and assembled into
        full-shape NumPy arrays keyed by parameter index, exactly as
        ``optimizer_class(params).state_dict()`` lays them out, so it loads
        into a :class:`ZeroRedundancyOptimizer` of any world size or into the
        plain optimizer.

        Returns:
            ``{"optimizer", "version", "hyperparameters", "step_count",
            "state": {param index: {"step": int, name: numpy array}}}``.
        """
        local: dict[int, dict[str, Any]] = {}
        for k, state in self.optim.state.items():
            piece = self._pieces[k]
            if piece is None:
                continue
            entry = local.setdefault(piece.param, {"step": 0, "pieces": {}})
            entry["step"] = max(entry["step"], int(state.get("step", 0)))
            for name, value in state.items():
                if name != "step":
                    entry["pieces"].setdefault(name, []).append(
                        (piece.start, piece.stop, _array.to_host(value)))
        merged: dict[int, dict[str, Any]] = {}
        for part in comm.all_gather_object(local, self.group):
            for i, entry in part.items():
                out = merged.setdefault(i, {"step": 0})
                out["step"] = max(out["step"], entry["step"])
                for name, pieces in entry["pieces"].items():
                    if name not in out:
                        out[name] = np.zeros(self.params[i].size, dtype=pieces[0][2].dtype)
                    for start, stop, values in pieces:
                        out[name][start:stop] = values
        for i, out in merged.items():
            for name in out:
                if name != "step":
                    out[name] = out[name].reshape(self.params[i].shape)
        return {"optimizer": self.optimizer_class.__name__, "version": STATE_DICT_VERSION,
                "hyperparameters": self.optim.hyperparameters(),
                "step_count": self.optim.step_count, "state": dict(sorted(merged.items()))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (of any world size, or the plain optimizer's).

        Each rank keeps the pieces of each state array it updates; no
        communication.

        Raises:
            ValueError: not a state dict of ``optimizer_class``, a parameter
                index out of range, or a state array whose shape differs from
                its parameter's.
        """
        where = "ZeroRedundancyOptimizer.load_state_dict"
        if not isinstance(state_dict, dict) or "state" not in state_dict:
            raise ValueError(f"{where}: expected a dict made by state_dict(), got "
                             f"{type(state_dict).__name__}")
        full = {int(k): v for k, v in state_dict["state"].items()}
        for i, entry in full.items():
            if not 0 <= i < len(self.params):
                raise ValueError(f"{where}: state for parameter index {i}, but there are "
                                 f"{len(self.params)} parameters (0..{len(self.params) - 1})")
            for name, value in entry.items():
                if name != "step" and tuple(np.shape(value)) != self.params[i].shape:
                    raise ValueError(f"{where}: state {name!r} of parameter {i} has shape "
                                     f"{tuple(np.shape(value))}, the parameter has "
                                     f"{self.params[i].shape}")
        local: dict[int, dict[str, Any]] = {}
        for k, piece in enumerate(self._pieces):
            if piece is None or piece.param not in full:
                continue
            entry = full[piece.param]
            local[k] = {name: (int(v) if name == "step" else
                               _array.to_host(v).reshape(-1)[piece.start:piece.stop])
                        for name, v in entry.items()}
        self.optim.load_state_dict({**state_dict, "state": local})

    # --- sharded checkpoints: this rank's part only ---------------------------------------

    def state_ranges(self) -> dict[int, tuple[int, int]]:
        """``{parameter index: (start, stop)}``: the elements of each flattened parameter
        this rank updates, and so holds optimizer state for (parameters it has none of are
        left out). The ranges of all ranks tile every parameter."""
        return {pc.param: (pc.start, pc.stop) for pc in self._pieces if pc is not None}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of :meth:`state_dict`, without communication.

        The wrapped optimizer's format, keyed by parameter index, except that
        each state array is 1-D and holds elements ``state_ranges()[index]``
        of the flattened state (copies, as ``state_dict()`` gives). A sharded
        checkpoint (:func:`~axondist.checkpoint.save_sharded_checkpoint` with
        this optimizer) writes these on each rank.

        Returns:
            ``{"optimizer", "version", "hyperparameters", "step_count",
            "state": {param index: {"step": int, name: 1-D array}}}``.
        """
        sd = self.optim.state_dict()
        state = {}
        for k, entry in sd["state"].items():
            piece = self._pieces[k]
            if piece is not None:
                state[piece.param] = entry
        return {**sd, "state": dict(sorted(state.items()))}

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's part of the state: :meth:`sharded_state_dict`'s format, for
        the ranges :meth:`state_ranges` gives (of any saved world size). No communication.

        Raises:
            ValueError: not a state dict of ``optimizer_class``, a parameter
                index this rank holds no range of, or an array whose size is
                not its range's.
        """
        where = "ZeroRedundancyOptimizer.load_sharded_state_dict"
        if not isinstance(state_dict, dict) or "state" not in state_dict:
            raise ValueError(f"{where}: expected a dict made by sharded_state_dict(), got "
                             f"{type(state_dict).__name__}")
        ranges = self.state_ranges()
        parts = {int(k): v for k, v in state_dict["state"].items()}
        for i, entry in parts.items():
            if i not in ranges:
                raise ValueError(f"{where}: state for parameter index {i}, of which this rank "
                                 f"updates no elements (it holds {sorted(ranges)})")
            lo, hi = ranges[i]
            for name, value in entry.items():
                if name != "step" and int(np.size(value)) != hi - lo:
                    raise ValueError(f"{where}: state {name!r} of parameter {i} has "
                                     f"{int(np.size(value))} elements, its range [{lo}, {hi}) "
                                     f"has {hi - lo}")
        local = {k: {name: (int(v) if name == "step" else _array.to_host(v).reshape(-1))
                     for name, v in parts[pc.param].items()}
                 for k, pc in enumerate(self._pieces) if pc is not None and pc.param in parts}
        self.optim.load_state_dict({**state_dict, "state": local})

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, "
                f"{len(self.params)} parameters in {len(self.units)} units, state split over "
                f"{self.group.world_size} ranks)")


def shard_elements(units: Sequence[FlatUnit], rank: int) -> int:
    """Real (non-padding) elements rank ``rank`` updates across ``units``."""
    return sum(hi - lo for lo, hi in (u.valid_bounds(rank) for u in units))


__all__ = ["ZeroRedundancyOptimizer", "shard_elements"]
