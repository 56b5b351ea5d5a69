"""Parameter: an array with an optional gradient, and what counts as a model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from . import _array
from ._frameworks import framework_of
from ._validate import check_numeric_dtype
from .errors import UnsupportedDTypeError


class Parameter:
    """A named array of model weights and its gradient, without autograd.

    Args:
        data: a NumPy or CuPy array of numbers (other frameworks' arrays come
            in through DLPack, sharing memory where possible).
        name: optional name, used in error messages and checkpoints.

    Raises:
        UnsupportedDTypeError: ``data`` is None or not numbers (text, Python
            objects, dates).

    Attributes:
        data: the values. Wrappers write into it in place when they can, so
            views a user holds stay valid.
        grad: ``None`` or an array of ``data``'s shape set by the user's
            gradient callable (DDP may make it a view into a bucket).
    """

    __slots__ = ("data", "grad", "name")

    def __init__(self, data: Any, name: str | None = None) -> None:
        what = f"Parameter({name!r})" if name else "Parameter"
        if data is None:
            raise UnsupportedDTypeError(f"{what}: data=None is not an array; pass a NumPy or "
                                        "CuPy array of numbers, e.g. np.zeros((4, 3))")
        array = _array.as_array(data)
        shown = f"data={data!r}" if isinstance(data, (str, bytes)) else \
            f"data ({type(data).__name__})"
        check_numeric_dtype(array.dtype, what, shown)
        self.data = array
        self.grad: Any = None
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        """``data``'s shape as a tuple of ints (read live: it follows a replaced ``data``)."""
        return tuple(self.data.shape)

    @property
    def dtype(self) -> Any:
        """``data``'s dtype (a NumPy dtype, also for CuPy arrays)."""
        return self.data.dtype

    @property
    def size(self) -> int:
        """Number of elements of ``data``."""
        return int(self.data.size)

    @property
    def nbytes(self) -> int:
        """Bytes of ``data`` (the gradient not counted)."""
        return int(self.data.nbytes)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient (``grad = None``), or with ``set_to_none=False`` zero it in place,
        keeping its memory (a view into a DDP bucket must stay shared). An immutable
        gradient (a JAX array) is replaced by zeros of its framework instead."""
        if set_to_none:
            self.grad = None
        elif self.grad is not None:
            framework = framework_of(self.grad)
            if framework is None or framework.writable:
                self.grad[...] = 0
            else:
                values = _array.as_array(self.grad)
                zeros = _array.namespace(values).zeros_like(values)
                self.grad = framework.wrap(zeros, like=self.grad)

    def __repr__(self) -> str:
        name = f"{self.name!r}, " if self.name else ""
        return f"Parameter({name}{_array.describe(self.data)})"


def parameters_of(model: Any) -> list[Parameter]:
    """The Parameters of ``model``, in a stable order.

    A model is any object with a ``.parameters()`` method returning
    Parameters, a list/tuple of Parameters, or a dict of them (values in
    insertion order; unnamed Parameters take their key as name).

    Raises:
        TypeError: naming the first item that is not a Parameter.
    """
    if hasattr(model, "parameters") and callable(model.parameters):
        items: Iterable[Any] = model.parameters()
    elif isinstance(model, Mapping):
        items = []
        for key, p in model.items():
            if isinstance(p, Parameter) and p.name is None:
                p.name = str(key)
            items.append(p)
    elif isinstance(model, (list, tuple)):
        items = model
    elif isinstance(model, Parameter):
        items = [model]
    else:
        raise TypeError(
            f"expected a model (an object with .parameters(), or a list/dict of Parameters), "
            f"got {type(model).__name__}"
        )
    params = list(items)
    for i, p in enumerate(params):
        if not isinstance(p, Parameter):
            framework = framework_of(p)
            if framework is not None and framework.name == "torch":
                kind = f"{type(p).__module__}.{type(p).__qualname__}"
                raise TypeError(
                    f"model item {i} is a {kind} (a torch module's parameter), not an "
                    "axondist.Parameter. Wrap each one: params = [ad.Parameter(p.data) for p in "
                    "module.parameters()]; ad.Parameter(p.data) shares the tensor's memory, so "
                    "an axondist optimizer step updates the torch module, and after "
                    "loss.backward() set params[i].grad = p.grad (see examples/"
                    "torch_autograd.py)")
            raise TypeError(
                f"model item {i} is a {type(p).__name__}, not an axondist.Parameter; wrap arrays "
                "with axondist.Parameter(array)"
            )
    return params
