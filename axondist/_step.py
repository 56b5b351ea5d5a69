"""The training-step contract every data-parallel wrapper shares: where the gradient callable
comes from, what an optimizer must offer, and the order of a one-call step."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

GradFn = Callable[..., Any]


def check_grad_fn(grad_fn: Any, where: str) -> GradFn | None:
    """``grad_fn`` when it is None or callable, else a TypeError naming ``where``.

    Raises:
        TypeError: ``grad_fn`` is neither None nor callable.
    """
    if grad_fn is not None and not callable(grad_fn):
        raise TypeError(f"{where}: grad_fn must be a callable grad_fn(params, *batch) returning "
                        f"(loss, grads), got {type(grad_fn).__name__} {grad_fn!r}")
    return grad_fn


def split_grad_fn(default: GradFn | None, batch: tuple[Any, ...],
                  where: str) -> tuple[GradFn, tuple[Any, ...]]:
    """The gradient callable for one call and the batch it gets.

    The wrapper's own ``grad_fn`` (given to its constructor) is used, unless
    the first positional argument is a callable that is not an array: then it
    is this call's gradient callable and the rest is the batch (the older
    ``fsdp.step(grad_fn, x, y, optimizer=opt)`` call shape).

    Raises:
        TypeError: no gradient callable either way.
    """
    if batch and callable(batch[0]) and not hasattr(batch[0], "shape"):
        return batch[0], batch[1:]
    if default is None:
        raise TypeError(f"{where}: no grad_fn; pass grad_fn=... to the constructor (then call "
                        f"{where.rsplit('.', 1)[-1]}(*batch)), or pass it first: "
                        f"{where.rsplit('.', 1)[-1]}(grad_fn, *batch)")
    return default, batch


def loss_and_gradients(result: Any, count: int, where: str) -> tuple[Any, list[Any]]:
    """``(loss, grads)`` from what a gradient callable returned, in either form.

    ``result`` is ``(loss, grads)`` (one entry per parameter, None for
    none) or a generator yielding ``(index, grad)`` pairs and returning the
    loss; the generator is run to its end and missing indices are None.

    Raises:
        TypeError: another kind of result, or a yield that is not a pair.
        ValueError: a wrong number of gradients, an index out of range or
            yielded twice.
    """
    if inspect.isgenerator(result):
        grads: list[Any] = [None] * count
        seen: set[int] = set()
        while True:
            try:
                item: Any = next(result)
            except StopIteration as stop:
                return stop.value, grads
            try:
                raw_index, grad = item
                index = int(raw_index)
            except (TypeError, ValueError):
                raise TypeError(f"{where}: a generator grad_fn must yield (index, grad) pairs, "
                                f"got {type(item).__name__}") from None
            if not 0 <= index < count:
                raise ValueError(f"{where}: grad_fn yielded parameter index {index}, outside "
                                 f"0..{count - 1}")
            if index in seen:
                raise ValueError(f"{where}: grad_fn yielded parameter {index} twice in one call")
            seen.add(index)
            grads[index] = grad
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"{where}: grad_fn must return (loss, grads) or be a generator of "
                        f"(index, grad); got {type(result).__name__}")
    loss, grads = result
    grads = list(grads)
    if len(grads) != count:
        raise ValueError(f"{where}: grad_fn returned {len(grads)} gradients for {count} "
                         "parameters")
    return loss, grads


def check_optimizer(optimizer: Any, where: str) -> Any:
    """``optimizer`` when it has ``step()`` and ``zero_grad()``, else a TypeError.

    Raises:
        TypeError: ``optimizer`` lacks ``step`` or ``zero_grad``.
    """
    if not (callable(getattr(optimizer, "step", None))
            and callable(getattr(optimizer, "zero_grad", None))):
        raise TypeError(f"{where}: optimizer= must be an optimizer with step() and zero_grad() "
                        f"(e.g. axondist.SGD(model.parameters(), lr=0.1)), got "
                        f"{type(optimizer).__name__} {optimizer!r}")
    return optimizer


__all__ = ["GradFn", "check_grad_fn", "check_optimizer", "loss_and_gradients", "split_grad_fn"]
