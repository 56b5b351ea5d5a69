"""What every public collective does with its arguments around the call: find the group's
backend, take one NumPy/CuPy array (refusing a container of them with the call to use
instead), and run the call on views of a torch tensor or JAX array, handing the result back
in the caller's framework (:func:`in_callers_framework`, also the door of
:func:`axondist.prepare`'s calls).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _array, _jax_traced
from ._frameworks import JAX, framework_of
from .backends.base import Backend
from .backends.work import ThenWork, Work
from .errors import InvalidBufferError
from .process_group import ProcessGroup, resolve_group


def member(group: ProcessGroup | None, what: str) -> tuple[ProcessGroup, Backend]:
    """The group (the current world when None) and its backend, for a call named ``what``
    (which a non-member is refused, by name)."""
    g = resolve_group(group)
    return g, g.backend_for(what)


def group_backend(group: ProcessGroup | None, what: str) -> Backend:
    """The backend of the group (the current world when None), for a call named ``what``."""
    return resolve_group(group).backend_for(what)


def one_array(x: Any, where: str, *, in_place: bool = False) -> Any:
    """``x`` as a NumPy/CuPy array, refusing a list, tuple or dict of arrays (NumPy would
    stack it, and the caller's arrays would be left as they were) and, for an in-place
    collective, any Python container.

    Raises:
        InvalidBufferError: ``x`` is such a container; the message says what to call.
    """
    if type(x) is np.ndarray:  # the common case, kept cheap
        return x
    if isinstance(x, (list, tuple, dict)):
        items = list(x.values()) if isinstance(x, dict) else list(x)
        arrays = sum(not isinstance(item, (bool, int, float, complex)) for item in items)
        if arrays or in_place or isinstance(x, dict):
            kind = "arrays" if arrays else "numbers"
            if arrays:
                hint = ("a collective takes one array. To average gradients, "
                        "ad.sync_gradients(grads) takes a list or dict of them (one all-reduce "
                        f"per dtype, each written in place); otherwise call {where} on each "
                        "array, or stack them into one array first")
            else:
                hint = ("a Python container cannot be written in place; pass np.asarray(x) "
                        "and use the array returned")
            raise InvalidBufferError(
                f"{where}: x is a {type(x).__name__} of {len(items)} {kind}; {hint}")
    return _array.as_array(x)


def in_callers_framework(collective: Any, x: Any, *args: Any, in_place: bool = False,
                         out: Any = None, **kwargs: Any) -> Any:
    """Run ``collective(x, *args, **kwargs)`` on NumPy/CuPy views of the torch tensors or
    JAX arrays ``x`` and ``out``, and hand its result back in their framework.

    The result's framework is ``out``'s when given, else ``x``'s. A torch tensor
    written in place (``in_place``, or ``out``) is itself the result; any other
    result becomes a new tensor of the framework (a JAX input to an in-place op is
    copied, so it is left as it was). A Work's ``wait()`` gives the converted result.

    Raises:
        InvalidBufferError: ``out`` is a JAX array (immutable), or a tensor to write
            in place is not contiguous.
    """
    where = getattr(collective, "__name__", "prepared call")
    x_framework = framework_of(x)
    if x_framework is JAX and JAX.is_tracer(x):  # inside jax.jit: an ordered host callback
        return _jax_traced.run_traced(collective, x, args, kwargs, out)
    array = x
    if x_framework is not None:
        array = (x_framework.array_to_write(x, where) if in_place
                 else x_framework.array(x, where))
    framework, original = x_framework, x
    if out is not None:
        framework, original = framework_of(out), out
        kwargs["out"] = out if framework is None else framework.out_array(out, where)
    result = collective(array, *args, **kwargs)
    if framework is None:
        return result
    shared = framework.writable and (in_place or out is not None)

    def back(value: Any) -> Any:
        if value is None:
            return None
        return original if shared else framework.wrap(value, original)

    return ThenWork(result, back) if isinstance(result, Work) else back(result)


__all__ = ["group_backend", "in_callers_framework", "member", "one_array"]
