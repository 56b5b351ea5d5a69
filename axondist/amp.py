"""Dynamic loss scaling for float16 training: :class:`LossScaler`.

float16 flushes gradients below ~6e-8 to zero and overflows above 65504. The
scaler multiplies the backward pass's seed (dL/dL = 1) by a large ``scale`` so
small gradients survive, divides the gradients by it before the optimizer
(and before clipping) sees them, skips the step on every rank when any rank
found an inf or NaN, and adapts the scale as ``torch.amp.GradScaler`` does:
halve it after an overflow, double it after 2,000 steps without one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _array
from .comm import all_reduce
from .parameter import Parameter
from .process_group import ProcessGroup, resolve_group

#: ``loss_fn(y, target) -> (loss, grad_y)``: the seed of a wrapper's backward pass.
LossFn = Callable[[Any, Any], tuple[Any, Any]]


def _positive(value: Any, name: str, at_least: float = 0.0, strict: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"LossScaler: {name} must be a number, got {type(value).__name__} "
                        f"{value!r}")
    value = float(value)
    ok = value > at_least if strict else value >= at_least
    if not ok or not math.isfinite(value):
        relation = ">" if strict else ">="
        raise ValueError(f"LossScaler: {name} must be finite and {relation} {at_least:g}, "
                         f"got {value!r}")
    return value


def next_scale(scale: float, growth_tracker: int, found_inf: bool, growth_factor: float,
               backoff_factor: float, growth_interval: int) -> tuple[float, int]:
    """The scale and growth tracker after one step (``torch.amp.GradScaler``'s rule).

    An overflow multiplies the scale by ``backoff_factor`` and restarts the
    count; ``growth_interval`` steps in a row without one multiply it by
    ``growth_factor``. A scale that would grow to inf stays where it is.
    """
    if found_inf:
        return scale * backoff_factor, 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = scale * growth_factor
        return (grown if math.isfinite(grown) else scale), 0
    return scale, growth_tracker


class LossScaler:
    """Scale the loss's gradient, check and unscale the gradients, skip steps that overflowed.

    One step, with any wrapper::

        loss = model.backward(batch)      # the gradient callable seeds with scaler.scale
        scaler.unscale_(grads)            # optional: before clipping; agrees on overflow
        clip_grad_norm(grads, 1.0)
        scaler.step(optimizer)            # optimizer.step() unless some rank overflowed
        scaler.update()                   # back off, or grow the scale

    How the seed is scaled, the same for every wrapper: a gradient callable
    (DDP's ``grad_fn``, the one passed to ``backward``/``step`` of FSDP, ZeRO,
    tensor parallel layers) computes the gradients of ``scaler.scale * loss``:
    it starts its backward pass from ``scaler.scale`` instead of 1. Where a
    wrapper seeds the backward pass itself from a ``loss_fn(y, target) ->
    (loss, grad_y)`` (the pipeline, FSDP ``from_layers``), pass
    ``scaler.scale_loss_fn(loss_fn)``: its ``grad_y`` is scaled, its loss not.

    The overflow verdict: each rank checks its gradients for inf and NaN, and
    the ranks agree in one all-reduce of a flag over ``group``. Gradients that
    are the same on every rank after a summing all-reduce (DDP, and ZeRO-1 on
    DDP's gradients) already carry any rank's inf or NaN (the sum spreads
    them), so ``replicated=True`` reads the verdict without communicating.

    Args:
        init_scale: the first scale (torch: 2**16).
        growth_factor: the scale's factor after ``growth_interval`` good steps (2).
        backoff_factor: the scale's factor after an overflow (0.5).
        growth_interval: good steps in a row before the scale grows (2000).
        enabled: False makes every method a pass-through (scale 1, never skips),
            so one training loop serves float32 and float16.
        group: the ranks that agree on the verdict (the current world when None):
            every rank whose gradients the optimizer step reads.

    Raises:
        TypeError, ValueError: a factor or interval of the wrong type or range.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, group: ProcessGroup | None = None) -> None:
        self._scale = _positive(init_scale, "init_scale")
        self.growth_factor = _positive(growth_factor, "growth_factor", 1.0)
        self.backoff_factor = _positive(backoff_factor, "backoff_factor")
        if self.backoff_factor >= 1.0:
            raise ValueError(f"LossScaler: backoff_factor must be < 1, got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, (int, np.integer)) \
                or growth_interval < 1:
            raise ValueError(f"LossScaler: growth_interval must be an int >= 1, got "
                             f"{growth_interval!r}")
        self.growth_interval = int(growth_interval)
        self.enabled = bool(enabled)
        self.group = group
        self._growth_tracker = 0
        self._found_inf: bool | None = None  # this step's verdict once unscaled
        #: Steps skipped since the scaler was made (or its state loaded).
        self.skipped_steps = 0

    # --- scaling -----------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        """The factor the backward pass's seed is multiplied by now (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale_loss(self, loss: Any) -> Any:
        """``loss * scale``: for a gradient callable that differentiates a loss value."""
        return loss * self.scale if self.enabled else loss

    def scale_seed(self, grad: Any, like: Any = None) -> Any:
        """``grad * scale`` computed in at least float32, then cast to ``like``'s dtype (a
        float16 output's gradient: the scale itself, 2**16, is inf in float16)."""
        grad = _array.as_array(grad)
        if not self.enabled:
            return grad
        wide = grad.astype(np.promote_types(grad.dtype, np.float32)) * self._scale
        dtype = getattr(like, "dtype", None)
        target = dtype if dtype is not None and _array.is_floating(dtype) else grad.dtype
        with np.errstate(over="ignore"):  # an inf here is the overflow the scaler looks for
            return wide.astype(target, copy=False)

    def scale_loss_fn(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` whose ``grad_y`` is multiplied by the scale in force when it runs (the
        loss it returns is not), for wrappers that seed backward from a ``loss_fn``.

        Return ``grad_y`` in float32 (or wider) from ``loss_fn``: a float16 one
        may have underflowed before it is scaled. It is scaled in float32 and
        cast to the dtype of ``y`` (what the last layer's backward expects)."""
        if not callable(loss_fn):
            raise TypeError(f"LossScaler.scale_loss_fn: loss_fn must be a callable loss_fn(y, "
                            f"target) -> (loss, grad_y), got {type(loss_fn).__name__}")

        def scaled(y: Any, target: Any) -> tuple[Any, Any]:
            loss, grad_y = loss_fn(y, target)
            if not self.enabled:
                return loss, grad_y
            return loss, self.scale_seed(grad_y, like=y)

        return scaled

    # --- checking and unscaling ---------------------------------------------------------------
    def unscale_(self, grads: Sequence[Any], *, replicated: bool = False,
                 group: ProcessGroup | None = None) -> bool:
        """Divide ``grads`` by the scale in place and agree with the other ranks on whether
        any rank's gradients hold an inf or NaN; once per step.

        Args:
            grads: arrays, or Parameters (their ``.grad``; None grads are skipped).
                Keep them in float32 (the master gradients): a float16 gradient
                unscaled in place may underflow again.
            replicated: every rank holds the same gradients (summed by an
                all-reduce): the local verdict is everyone's, no collective.
            group: the ranks that agree (the scaler's group when None).

        Returns:
            True when some rank found an inf or NaN (the step will be skipped).

        Raises:
            RuntimeError: called twice in one step (call :meth:`update` between steps).
        """
        if self._found_inf is not None:
            raise RuntimeError("LossScaler.unscale_: already called since the last update(); "
                               "call update() after each step")
        arrays = _gradients(grads)
        found = False
        if self.enabled:
            inverse = 1.0 / self._scale
            for g in arrays:
                xp = _array.namespace(g)
                g *= g.dtype.type(inverse)
                if not found and not bool(xp.isfinite(g).all()):
                    found = True
            if not replicated:
                found = self._agree(found, group if group is not None else self.group)
        self._found_inf = found
        return found

    def _agree(self, found: bool, group: ProcessGroup | None) -> bool:
        """Every rank's verdict: one all-reduce (max) of a one-value flag (in the buffer the
        backend's collectives take: device memory on NCCL)."""
        g = resolve_group(group)
        if g.world_size == 1:
            return found
        flag = g.backend_for("LossScaler.unscale_").metadata_buffer(
            np.array([1.0 if found else 0.0], dtype=np.float32))
        all_reduce(flag, op="max", group=g)
        return bool(_array.to_host(flag)[0] > 0)

    @property
    def found_inf(self) -> bool | None:
        """This step's verdict (None before :meth:`unscale_` or :meth:`step`)."""
        return self._found_inf

    # --- stepping ---------------------------------------------------------------------------
    def step(self, optimizer: Any, grads: Sequence[Any] | None = None, *,
             replicated: bool = False, group: ProcessGroup | None = None) -> bool:
        """``optimizer.step()`` unless some rank's gradients overflowed; the gradients are
        unscaled first unless :meth:`unscale_` already ran this step.

        Args:
            optimizer: anything with ``step()``; its ``params`` give the gradients
                when ``grads`` is None.
            grads, replicated, group: as for :meth:`unscale_`.

        Returns:
            True when the optimizer stepped, False when the step was skipped.
        """
        if not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"LossScaler.step: optimizer must have a step() method, got "
                            f"{type(optimizer).__name__}")
        if self._found_inf is None:
            if grads is None:
                grads = getattr(optimizer, "params", None)
                if grads is None:
                    raise TypeError("LossScaler.step: the optimizer has no .params; pass its "
                                    "gradients: step(optimizer, grads)")
            self.unscale_(grads, replicated=replicated, group=group)
        if self._found_inf:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self, new_scale: float | None = None) -> None:
        """Adapt the scale to this step's verdict (or set it to ``new_scale``); the next
        step may unscale again.

        Raises:
            RuntimeError: no :meth:`unscale_` or :meth:`step` since the last update.
        """
        if not self.enabled:
            self._found_inf = None
            return
        if new_scale is not None:
            self._scale = _positive(new_scale, "new_scale")
            self._growth_tracker = 0
        else:
            if self._found_inf is None:
                raise RuntimeError("LossScaler.update: no unscale_() or step() since the last "
                                   "update(); the scale needs this step's verdict")
            self._scale, self._growth_tracker = next_scale(
                self._scale, self._growth_tracker, self._found_inf, self.growth_factor,
                self.backoff_factor, self.growth_interval)
        self._found_inf = None

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The scale and its schedule, for a checkpoint (torch's keys)."""
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self._growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`.

        Raises:
            KeyError: ``state`` lacks ``scale`` (the message names what it holds).
        """
        if "scale" not in state:
            raise KeyError(f"LossScaler.load_state_dict: no 'scale' in the state (keys: "
                           f"{sorted(state)}); pass what LossScaler.state_dict() returned")
        self._scale = _positive(float(state["scale"]), "scale")
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self._growth_tracker = int(state.get("_growth_tracker", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._found_inf = None

    def __repr__(self) -> str:
        return (f"LossScaler(scale={self.scale:g}, growth_factor={self.growth_factor:g}, "
                f"backoff_factor={self.backoff_factor:g}, growth_interval="
                f"{self.growth_interval}, enabled={self.enabled})")


def _gradients(grads: Sequence[Any]) -> list[Any]:
    """The gradient arrays of ``grads`` (arrays, or Parameters whose ``.grad`` is set)."""
    if isinstance(grads, Parameter) or hasattr(grads, "shape"):  # one gradient
        grads = [grads]
    out = []
    for i, g in enumerate(grads):
        if isinstance(g, Parameter):
            g = g.grad
            if g is None:
                continue
        arr = _array.as_array(g)
        if not _array.is_floating(arr.dtype):
            raise TypeError(f"LossScaler.unscale_: gradient {i} is {arr.dtype}; gradients "
                            "must be floating-point arrays")
        out.append(arr)
    return out


__all__ = ["LossScaler", "next_scale"]
