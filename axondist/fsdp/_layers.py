"""Layer-by-layer FSDP steps: one unit per layer, gathered just before the layer runs.

A layered wrapper (:meth:`FullyShardedDataParallel.from_layers`) knows the
model as a list of layers, each a ``PipelineStage``-like value (``forward``,
``backward`` and its Parameters), so a step walks the layers and never needs
the whole model gathered: forward gathers each layer's unit (prefetching the
next one's all-gather while the layer computes) and, with
``reshard_after_forward``, drops it again; backward walks back the same way,
reduce-scattering each unit's gradients as soon as its layer is done. The
functions here use only the wrapper's public gather, reshard and sync calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._array import as_array
from ..parameter import Parameter

if TYPE_CHECKING:
    from ._gather import GatherHandle
    from .api import FullyShardedDataParallel


@dataclass(frozen=True)
class LayerPlan:
    """The layers of a layered wrapper and the unit each one runs on.

    Attributes:
        layers: the layer values, in forward order.
        unit_of_layer: each layer's unit index (None for a layer without
            parameters, which needs no gather).
    """

    layers: tuple[Any, ...]
    unit_of_layer: tuple[int | None, ...]

    @classmethod
    def of(cls, layers: Sequence[Any], where: str) -> tuple[LayerPlan, list[Parameter],
                                                            list[list[int]]]:
        """The plan, the model's Parameters (the layers' in order) and the unit of each layer.

        Raises:
            TypeError: ``layers`` is not a sequence, or an item is not a
                layer (``run_forward``, ``run_backward`` and ``parameters()``,
                as :class:`~axondist.pipeline.PipelineStage` has).
            ValueError: no layers, no parameters at all, or a Parameter in
                two layers.
        """
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
            raise TypeError(f"{where}: layers must be a list of PipelineStage(forward, backward, "
                            f"params), one per layer, got {type(layers).__name__}")
        if not layers:
            raise ValueError(f"{where}: layers is empty; pass one PipelineStage per layer")
        params: list[Parameter] = []
        units: list[list[int]] = []
        unit_of: list[int | None] = []
        seen: dict[int, int] = {}
        for k, layer in enumerate(layers):
            if not all(callable(getattr(layer, a, None))
                       for a in ("run_forward", "run_backward", "parameters")):
                raise TypeError(f"{where}: layers[{k}] must be a PipelineStage(forward, backward, "
                                f"params), got {type(layer).__name__}")
            mine = list(layer.parameters())
            for p in mine:
                if id(p) in seen:
                    raise ValueError(f"{where}: Parameter {p.name or '(unnamed)'} is in layers["
                                     f"{seen[id(p)]}] and layers[{k}]; each layer's parameters "
                                     "form its own unit, so a Parameter can be in one layer only")
                seen[id(p)] = k
            if not mine:
                unit_of.append(None)
                continue
            unit_of.append(len(units))
            units.append(list(range(len(params), len(params) + len(mine))))
            params += mine
        if not params:
            raise ValueError(f"{where}: no layer has parameters; there is nothing to shard")
        return cls(tuple(layers), tuple(unit_of)), params, units

    def next_unit(self, layer: int, step: int) -> int | None:
        """The unit of the nearest layer after ``layer`` in direction ``step`` (+1 or -1)."""
        k = layer + step
        while 0 <= k < len(self.layers):
            if self.unit_of_layer[k] is not None:
                return self.unit_of_layer[k]
            k += step
        return None

    @property
    def last_unit(self) -> int | None:
        """The unit of the last layer with parameters (backward needs it first)."""
        return self.next_unit(len(self.layers), -1)


class _Gathers:
    """Which units this pass has gathered or started gathering (at most the current unit
    and the prefetched next one are in flight)."""

    def __init__(self, fsdp: FullyShardedDataParallel, prefetch: bool) -> None:
        self.fsdp = fsdp
        self.prefetch = prefetch
        self.pending: dict[int, GatherHandle] = {}

    def start(self, unit: int | None, refresh: bool) -> None:
        """Prefetch ``unit`` (a no-op without prefetch, or when it is held and fresh)."""
        if not self.prefetch or unit is None or unit in self.pending:
            return
        if refresh or not self.fsdp.is_gathered(unit):
            handle = self.fsdp.gather_parameters(unit, async_op=True)
            assert handle is not None
            self.pending[unit] = handle

    def need(self, unit: int, refresh: bool) -> None:
        """Make ``unit``'s full parameters present: wait for its prefetch, or gather now."""
        handle = self.pending.pop(unit, None)
        if handle is not None:
            handle.wait()
        elif refresh or not self.fsdp.is_gathered(unit):
            self.fsdp.gather_parameters(unit)


def forward(fsdp: FullyShardedDataParallel, plan: LayerPlan, x: Any, *, prefetch: bool,
            reshard_after_forward: bool, keep: bool, where: str) -> tuple[Any, list[Any]]:
    """Run the layers on ``x``; returns the output and each layer's ``saved`` (when ``keep``).

    Every unit is gathered afresh (the shards may have changed since the last
    pass); each is resharded after its layer when ``reshard_after_forward``,
    except the last one when ``keep`` (backward starts with it).
    """
    gathers = _Gathers(fsdp, prefetch)
    saved: list[Any] = []
    try:
        for k, layer in enumerate(plan.layers):
            unit = plan.unit_of_layer[k]
            if unit is not None:
                gathers.need(unit, refresh=True)
            gathers.start(plan.next_unit(k, +1), refresh=True)
            x, s = layer.run_forward(x, f"{where}: layers[{k}]")
            saved.append(s if keep else None)
            if unit is not None and reshard_after_forward and not (keep
                                                                   and unit == plan.last_unit):
                fsdp.reshard_parameters(unit)
    except BaseException:
        fsdp.reshard_parameters()  # finishes what is in flight: every rank started it
        raise
    return x, saved


def backward(fsdp: FullyShardedDataParallel, plan: LayerPlan, saved: list[Any], grad: Any, *,
             prefetch: bool, where: str) -> None:
    """Walk the layers backwards from ``grad`` (the loss's gradient with respect to the output).

    Each layer's unit is gathered if the forward dropped it (its predecessor's
    all-gather prefetched meanwhile), its gradients are set, the unit is
    resharded and its gradients reduced (:meth:`sync_gradients`) before the
    next layer runs.
    """
    gathers = _Gathers(fsdp, prefetch)
    try:
        for k in reversed(range(len(plan.layers))):
            unit = plan.unit_of_layer[k]
            if unit is not None:
                gathers.need(unit, refresh=False)
            gathers.start(plan.next_unit(k, -1), refresh=False)
            layer = plan.layers[k]
            grad, param_grads = layer.run_backward(saved[k], grad, f"{where}: layers[{k}]")
            saved[k] = None
            if unit is None:
                continue
            _set_gradients(layer, param_grads)
            # the Parameters hold the gradients now: without this the list would keep them
            # alive after sync_gradients drops them, through the next layer's backward
            del param_grads
            fsdp.reshard_parameters(unit)
            fsdp.sync_gradients(unit)
    except BaseException:
        fsdp.reshard_parameters()
        raise


def _set_gradients(layer: Any, param_grads: list[Any]) -> None:
    """Hand a layer's gradients to its Parameters (``.grad``; None for none)."""
    for p, g in zip(layer.parameters(), param_grads):
        p.grad = None if g is None else as_array(g)


def loss_and_grad(loss_fn: Any, y: Any, target: Any, where: str) -> tuple[Any, Any]:
    """``loss_fn(y, target)`` checked to be a pair ``(loss, grad_y)``.

    Raises:
        TypeError: ``loss_fn`` returned something else.
    """
    out = loss_fn(y, target)
    if not (isinstance(out, tuple) and len(out) == 2):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise TypeError(f"{where}: loss_fn(y, target) must return (loss, grad_y), got {got}")
    return out


def check_options(where: str, kwargs: dict[str, Any], loss_fn: Any, *, prefetch: Any,
                  reshard_after_forward: Any) -> None:
    """Refuse what a layered wrapper does not take: ``units``/``grad_fn`` (the layers decide
    both), a ``loss_fn`` that is not callable, flags that are not bools."""
    for arg in ("units", "grad_fn"):
        if arg in kwargs:
            raise TypeError(f"{where}: {arg}= is not taken: each layer's parameters are its "
                            "unit and the layers' callables compute the gradients")
    if not callable(loss_fn):
        raise TypeError(f"{where}: loss_fn must be a callable loss_fn(y, target) returning "
                        f"(loss, grad_y), got {type(loss_fn).__name__}")
    for arg, flag in (("prefetch", prefetch), ("reshard_after_forward", reshard_after_forward)):
        if not isinstance(flag, bool):
            raise TypeError(f"{where}: {arg} must be True or False, got {flag!r}")


def layered_backward(fsdp: FullyShardedDataParallel, plan: LayerPlan, loss_fn: Any, x: Any,
                     target: Any, *, prefetch: bool, reshard_after_forward: bool,
                     where: str) -> Any:
    """One layered step's gradients: :func:`forward` keeping what backward needs,
    ``loss_fn`` on the output, then :func:`backward`; returns the loss."""
    y, saved = forward(fsdp, plan, x, prefetch=prefetch,
                       reshard_after_forward=reshard_after_forward, keep=True, where=where)
    try:
        loss, grad = loss_and_grad(loss_fn, y, target, where)
    except BaseException:
        fsdp.reshard_parameters()
        raise
    del y
    backward(fsdp, plan, saved, grad, prefetch=prefetch, where=where)
    return loss


__all__ = ["LayerPlan", "backward", "check_options", "forward", "layered_backward",
           "loss_and_grad"]
