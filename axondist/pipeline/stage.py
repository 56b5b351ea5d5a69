"""PipelineStage: one slice of a model as user callables over its parameters (no autograd).

The runtime keeps a forward's ``saved`` value untouched until the backward of
the same microbatch (it is what "live activations" count) and splits batches
along the leading axis, which a stage must keep. A stage may give a full
``backward``, the two halves of a split backward (``backward_input`` and
``backward_weight``, which zero-bubble schedules run at ``I`` and ``W``), or
both; how each form runs under each schedule is in :class:`PipelineStage`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from axondist import _array
from axondist.parameter import Parameter, parameters_of

__all__ = ["BackwardFn", "BackwardInputFn", "BackwardWeightFn", "ForwardFn", "PipelineStage"]

ForwardFn = Callable[[list[Any], Any], tuple[Any, Any]]
BackwardFn = Callable[[list[Any], Any, Any], tuple[Any, Sequence[Any]]]
BackwardInputFn = Callable[[list[Any], Any, Any], tuple[Any, Any]]
BackwardWeightFn = Callable[[list[Any], Any, Any, Any], Sequence[Any]]


class PipelineStage:
    """One pipeline stage: forward and backward callables and the parameters they use.

    Args:
        forward: ``forward(param_arrays, x) -> (y, saved)``.
        backward: ``backward(param_arrays, saved, grad_y) -> (grad_x, param_grads)``;
            may be omitted when both halves below are given.
        params: the stage's Parameters (a list, dict, Parameter or object with
            ``.parameters()``, as :func:`~axondist.parameters_of` accepts).
        backward_input: ``backward_input(param_arrays, saved, grad_y) -> (grad_x, extra)``.
        backward_weight: ``backward_weight(param_arrays, saved, grad_y, extra) -> param_grads``.
        name: used in error messages (``"stage 3"`` when None; the runtime
            fills in the virtual stage index).

    ``param_arrays`` is ``[p.data for p in params]``; ``param_grads`` lists one
    gradient per parameter, in that order. ``extra`` carries what the input
    half computed that the weight half can reuse (the gradient before the
    activation function, say); the runtime keeps ``saved``, ``grad_y`` and
    ``extra`` from the ``I`` step to the ``W`` step. With only ``backward``, a
    split schedule's ``I`` step calls it (input and weight gradient) and ``W``
    only adds the weight gradient it computed: correct, without the
    zero-bubble speed-up. With only the halves, a full ``B`` runs
    ``backward_input`` then ``backward_weight``. The first stage's ``grad_x``
    is never used, so its backward may return ``None`` for it.

    Raises:
        TypeError: a callable is not callable, a parameter is not a Parameter,
            or only one of ``backward_input``/``backward_weight`` is given, or
            no backward at all.
    """

    def __init__(
        self,
        forward: ForwardFn,
        backward: BackwardFn | None = None,
        params: Any = (),
        *,
        backward_input: BackwardInputFn | None = None,
        backward_weight: BackwardWeightFn | None = None,
        name: str | None = None,
    ) -> None:
        label = f"PipelineStage({name!r})" if name else "PipelineStage"
        for arg, fn in (("forward", forward), ("backward", backward),
                        ("backward_input", backward_input), ("backward_weight", backward_weight)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{label}: {arg} must be callable, got {type(fn).__name__}")
        if forward is None:
            raise TypeError(f"{label}: forward is required")
        if (backward_input is None) != (backward_weight is None):
            given, missing = (("backward_input", "backward_weight") if backward_weight is None
                              else ("backward_weight", "backward_input"))
            raise TypeError(f"{label}: {given} was given without {missing}; a split backward "
                            "needs both halves (or pass neither and use backward)")
        if backward is None and backward_input is None:
            raise TypeError(f"{label}: needs backward, or backward_input and backward_weight")
        self.forward_fn = forward
        self.backward_fn = backward
        self.backward_input_fn = backward_input
        self.backward_weight_fn = backward_weight
        self.params: list[Parameter] = parameters_of(params)
        self.name = name

    @property
    def has_split_backward(self) -> bool:
        """True when ``backward_input`` and ``backward_weight`` are given."""
        return self.backward_input_fn is not None

    def parameters(self) -> list[Parameter]:
        """The stage's Parameters, in the order the callables see them."""
        return list(self.params)

    def param_arrays(self) -> list[Any]:
        """``[p.data for p in params]``: what the callables receive."""
        return [p.data for p in self.params]

    def __repr__(self) -> str:
        kind = "split" if self.has_split_backward else "full"
        name = f"{self.name!r}, " if self.name else ""
        return f"PipelineStage({name}{len(self.params)} params, {kind} backward)"

    # -- calls with their results checked (the runtime uses these) -------------------

    def run_forward(self, x: Any, where: str) -> tuple[Any, Any]:
        """``forward`` on ``x``; returns ``(y, saved)``; ``where`` names the stage in errors."""
        out = self.forward_fn(self.param_arrays(), x)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{where}: forward must return a pair (y, saved), got "
                            f"{_kind(out)}")
        y = _array.as_array(out[0]) if out[0] is not None else None
        if y is None or y.ndim == 0:
            raise TypeError(f"{where}: forward must return y with a leading batch axis, got "
                            f"{_kind(out[0])}")
        return y, out[1]

    def run_backward(self, saved: Any, grad_y: Any, where: str) -> tuple[Any, list[Any]]:
        """The full backward: ``(grad_x, param_grads)``; halves in sequence when split only."""
        if self.backward_fn is None:
            grad_x, extra = self.run_backward_input(saved, grad_y, where)
            return grad_x, self.run_backward_weight(saved, grad_y, extra, where)
        out = self.backward_fn(self.param_arrays(), saved, grad_y)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{where}: backward must return a pair (grad_x, param_grads), got "
                            f"{_kind(out)}")
        return out[0], self._check_param_grads(out[1], where, "backward")

    def run_backward_input(self, saved: Any, grad_y: Any, where: str) -> tuple[Any, Any]:
        """The input half: ``(grad_x, extra)``."""
        assert self.backward_input_fn is not None
        out = self.backward_input_fn(self.param_arrays(), saved, grad_y)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{where}: backward_input must return a pair (grad_x, extra), got "
                            f"{_kind(out)}")
        return out

    def run_backward_weight(self, saved: Any, grad_y: Any, extra: Any, where: str) -> list[Any]:
        """The weight half: ``param_grads``."""
        assert self.backward_weight_fn is not None
        grads = self.backward_weight_fn(self.param_arrays(), saved, grad_y, extra)
        return self._check_param_grads(grads, where, "backward_weight")

    def _check_param_grads(self, grads: Any, where: str, fn: str) -> list[Any]:
        if not isinstance(grads, (list, tuple)) or len(grads) != len(self.params):
            got = f"{len(grads)} items" if isinstance(grads, (list, tuple)) else _kind(grads)
            raise ValueError(f"{where}: {fn} must return one gradient per parameter "
                             f"({len(self.params)}, in the order of params), got {got}")
        out = []
        for i, (g, p) in enumerate(zip(grads, self.params)):
            g = _array.as_array(g)
            if tuple(g.shape) != p.shape:
                pname = f" ({p.name})" if p.name else ""
                raise ValueError(f"{where}: {fn} returned a gradient of shape {tuple(g.shape)} "
                                 f"for parameter {i}{pname} of shape {p.shape}")
            out.append(g)
        return out


def _kind(obj: Any) -> str:
    if isinstance(obj, tuple):
        return f"a tuple of {len(obj)}"
    return type(obj).__name__
