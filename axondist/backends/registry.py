"""Backend names and their factories: the one place ``init`` looks a backend up.

A factory takes the keyword options of ``axondist.init(name, **options)`` and
returns this process's world :class:`~axondist.backends.Backend`. The built-in
backends load their modules (and so mpi4py or CuPy) only when their factory
runs; a third-party backend registers itself with :func:`register_backend`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from . import settings
from .base import Backend

BackendFactory = Callable[..., Backend]

_FACTORIES: dict[str, BackendFactory] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make ``init(name, **options)`` build its world backend with ``factory(**options)``.

    Args:
        name: lower-case identifier (``"mock"``, ``"mpi"``, ``"my_fabric"``).
        factory: called with ``init``'s keyword options; returns this
            process's world :class:`Backend`.
        replace: allow replacing an existing registration.

    Raises:
        ValueError: a malformed name, or a name already taken without ``replace``.
        TypeError: ``factory`` is not callable.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"register_backend: name={name!r} must be a lower-case identifier "
                         "such as 'my_backend'")
    if not callable(factory):
        raise TypeError(f"register_backend: factory must be callable, got "
                        f"{type(factory).__name__}")
    if name in _FACTORIES and not replace:
        raise ValueError(f"register_backend: {name!r} is already registered; pass "
                         "replace=True to override it")
    _FACTORIES[name] = factory


def backend_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_FACTORIES)


#: torch.distributed's own backend names, which users coming from torch pass to init().
_TORCH_NAMES = {
    name: f". {name!r} is a torch.distributed backend: axondist's 'torch' backend runs on it "
          "(gloo for NumPy arrays and CPU tensors, NCCL for CUDA ones); call "
          "ad.init('torch'), or ad.init() under torchrun"
    for name in ("gloo", "ucc", "cpu:gloo,cuda:nccl")}


def create_backend(name: str, **options: Any) -> Backend:
    """This process's world backend from the factory registered as ``name``. Every
    ``AXONDIST_*`` variable is read first (:func:`axondist.backends.settings.load`): a bad
    value fails here, and a misspelt name is warned about.

    Raises:
        ValueError: no backend of that name (the message lists the valid ones), or a bad
            ``AXONDIST_*`` value (the message names the variable).
        BackendUnavailableError: the backend's library is missing.
    """
    key = str(name).strip().lower()
    factory = _FACTORIES.get(key)
    if factory is None:
        hint = _TORCH_NAMES.get(key, "")
        raise ValueError(f"init: unknown backend {name!r}; choose one of {backend_names()} "
                         f"(or register one with axondist.backends.register_backend){hint}")
    settings.load()
    backend = factory(**options)
    if not isinstance(backend, Backend):
        raise TypeError(f"init: the factory of backend {key!r} returned "
                        f"{type(backend).__name__}, not an axondist Backend")
    return backend


def _module_factory(module: str) -> BackendFactory:
    """A factory that imports ``axondist.backends.<module>`` when first used."""
    def factory(**options: Any) -> Backend:
        backend: Backend = importlib.import_module(f"{__package__}.{module}") \
            .create_world_backend(**options)
        return backend
    return factory


register_backend("mock", _module_factory("mock"))
register_backend("mpi", _module_factory("mpi"))
register_backend("nccl", _module_factory("nccl"))
register_backend("torch", _module_factory("torch"))

__all__ = ["BackendFactory", "backend_names", "create_backend", "register_backend"]
