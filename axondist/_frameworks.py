"""Arrays of other frameworks (PyTorch tensors, JAX arrays): into NumPy or CuPy and back.

:func:`framework_of` names the framework of an array without importing any (a torch
tensor exists only if ``torch`` is in ``sys.modules``, a JAX array only if ``jax`` is).
Each :class:`Framework` says how its arrays cross: as views sharing memory through
DLPack (bfloat16 as its int16 bits, which NumPy's DLPack lacks), whether a collective may
write into them, and how a NumPy or CuPy result becomes one of its arrays again.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .errors import InvalidBufferError, UnsupportedDTypeError


def _cupy() -> Any:
    """CuPy, imported for a framework array that lives on a CUDA device."""
    import cupy  # a GPU tensor came in, so CuPy is required

    return cupy


class Framework:
    """How one framework's arrays cross into NumPy/CuPy and how results go back.

    Attributes:
        name: the framework's module name (``"torch"``, ``"jax"``).
        writable: whether a collective may write into its arrays in place (torch
            tensors: yes, through a view; JAX arrays are immutable: no).
    """

    name = ""
    writable = False

    def owns(self, x: Any) -> bool:
        """True when ``x`` is an array of this framework (imports nothing)."""
        raise NotImplementedError

    def array(self, x: Any, where: str) -> Any:
        """A NumPy (host) or CuPy (CUDA) array over ``x``'s memory, read-only where the
        framework says so.

        Raises:
            UnsupportedDTypeError: ``x``'s dtype has no NumPy/CuPy counterpart.
        """
        raise NotImplementedError

    def array_to_write(self, x: Any, where: str) -> Any:
        """An array a collective may write: a view of ``x`` when the framework is
        :attr:`writable`, else a writable copy of its values.

        Raises:
            InvalidBufferError: ``x`` is a view that cannot be written in place.
        """
        raise NotImplementedError

    def out_array(self, x: Any, where: str) -> Any:
        """A view of ``x`` for a collective's ``out`` to write its result into.

        Raises:
            InvalidBufferError: the framework's arrays are immutable, or ``x`` cannot be
                written in place.
        """
        if not self.writable:
            raise InvalidBufferError(
                f"{where}: out is a {self.name} array, which cannot be written; leave "
                "out=None and use the array returned")
        return self.array_to_write(x, where)

    def wrap(self, array: Any, like: Any) -> Any:
        """A new array of this framework with ``array``'s values, on ``like``'s device."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"Framework({self.name!r})"


class TorchFramework(Framework):
    """PyTorch tensors: shared both ways through DLPack; ``requires_grad`` tensors cross
    as their data (``detach()``, the same storage), as ``torch.distributed`` reduces
    ``.data``."""

    name = "torch"
    writable = True

    def owns(self, x: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(x, torch.Tensor)

    def array(self, x: Any, where: str) -> Any:
        torch = sys.modules["torch"]
        t = x.detach() if x.requires_grad else x
        device = t.device.type
        if device not in ("cpu", "cuda"):
            raise InvalidBufferError(
                f"{where}: a torch tensor on device {t.device} cannot cross; move it to the "
                "CPU or a CUDA device first (t.cpu())")
        bits = device == "cpu" and t.dtype is torch.bfloat16
        try:
            if bits:  # NumPy's DLPack has no bfloat16: the same bytes, as int16
                from ml_dtypes import bfloat16  # loaded on a job's first bfloat16

                return np.from_dlpack(t.view(torch.int16)).view(bfloat16)
            return np.from_dlpack(t) if device == "cpu" else _cupy().from_dlpack(t)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise UnsupportedDTypeError(
                f"{where}: a torch tensor of dtype {t.dtype} does not cross to "
                f"{'NumPy' if device == 'cpu' else 'CuPy'} ({exc}); convert it first, "
                "e.g. t.to(torch.float32)") from exc

    def array_to_write(self, x: Any, where: str) -> Any:
        if not x.is_contiguous():
            raise InvalidBufferError(
                f"{where}: the torch tensor of shape {tuple(x.shape)} is not contiguous, so it "
                "cannot be written in place; pass t.contiguous() and use the tensor returned")
        return self.array(x, where)

    def wrap(self, array: Any, like: Any) -> Any:
        torch = sys.modules["torch"]
        if array.dtype.name == "bfloat16":
            return torch.from_dlpack(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(array)


class JaxFramework(Framework):
    """JAX arrays: immutable, so they are read through a read-only view and results
    come back as new JAX arrays on the input's device."""

    name = "jax"
    writable = False

    def owns(self, x: Any) -> bool:
        jax = sys.modules.get("jax")
        return jax is not None and isinstance(x, jax.Array)

    @staticmethod
    def _on_gpu(x: Any) -> bool:
        return any(d.platform == "gpu" for d in x.devices())

    @staticmethod
    def is_tracer(x: Any) -> bool:
        """True when ``x`` is a JAX tracer (an abstract value inside ``jax.jit``, ``grad``
        or ``vmap``), which has no data to cross."""
        jax = sys.modules.get("jax")
        return jax is not None and isinstance(x, jax.core.Tracer)

    def array(self, x: Any, where: str) -> Any:
        if self.is_tracer(x):
            raise InvalidBufferError(
                f"{where}: got a JAX tracer (inside jax.jit, grad or vmap), which holds no "
                "data; inside jit use axondist's all_reduce, all_gather, reduce_scatter, "
                "broadcast or all_to_all (axondist.differentiable's under grad), or call "
                f"{where} outside the transformation")
        try:
            if self._on_gpu(x):
                return _cupy().from_dlpack(x)
            return np.asarray(x)  # read-only and shared on the CPU; bfloat16 included
        except (BufferError, RuntimeError, TypeError) as exc:
            raise UnsupportedDTypeError(
                f"{where}: a JAX array of dtype {x.dtype} does not cross to "
                f"{'CuPy' if self._on_gpu(x) else 'NumPy'} ({exc}); convert it first, "
                "e.g. x.astype(jnp.float32)") from exc

    def array_to_write(self, x: Any, where: str) -> Any:
        return self.array(x, where).copy()

    def wrap(self, array: Any, like: Any) -> Any:
        jax = sys.modules["jax"]
        if not isinstance(array, np.ndarray):  # CuPy: stays on the GPU
            return jax.numpy.from_dlpack(array)
        devices = like.devices()
        return jax.device_put(array, next(iter(devices)) if len(devices) == 1 else None)


TORCH = TorchFramework()
JAX = JaxFramework()

#: The frameworks whose arrays cross, in the order they are looked for.
FRAMEWORKS: tuple[Framework, ...] = (TORCH, JAX)


def framework_of(x: Any) -> Framework | None:
    """The :class:`Framework` of ``x``, or None for NumPy, CuPy and anything else."""
    for framework in FRAMEWORKS:
        if framework.owns(x):
            return framework
    return None


def any_framework(*arrays: Any) -> bool:
    """True when one of ``arrays`` belongs to a :class:`Framework` (None is skipped)."""
    return any(a is not None and framework_of(a) is not None for a in arrays)


__all__ = ["FRAMEWORKS", "JAX", "TORCH", "Framework", "JaxFramework", "TorchFramework",
           "any_framework", "framework_of"]
