"""What the torch backend moves data with: torch loaded on first use (with a clear error
when it is missing), NumPy and CuPy buffers seen as tensors through DLPack without a copy
(bfloat16, which NumPy's DLPack lacks, as its int16 bits), and the reduction ops."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from ... import _array
from ...errors import BackendUnavailableError, UnsupportedDTypeError
from ...ops import ReduceOp

_INT16 = np.dtype(np.int16)


def load_torch() -> tuple[Any, Any]:
    """``(torch, torch.distributed)``; a clear error when torch or its distributed package
    is missing."""
    try:
        torch = importlib.import_module("torch")
        dist = importlib.import_module("torch.distributed")
    except ImportError as exc:
        raise BackendUnavailableError(
            "the torch backend needs PyTorch: pip install '.[torch]' from the axondist checkout "
            "(on a CPU-only Linux machine add --extra-index-url "
            f"https://download.pytorch.org/whl/cpu); import failed with: {exc}") from exc
    if not dist.is_available():
        raise BackendUnavailableError(
            f"the torch backend needs torch.distributed, which this build of torch "
            f"({torch.__version__}) lacks; install a build from pytorch.org")
    return torch, dist


class TensorView:
    """Tensors sharing memory with NumPy or CuPy buffers (DLPack, no copy).

    ``of(buf)`` is the tensor torch.distributed reads and writes; a bfloat16 buffer is
    viewed as int16 and the tensor re-viewed as ``torch.bfloat16``, so the bits are
    the same and nothing is copied.
    """

    __slots__ = ("_torch", "_bf16")

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self._bf16 = torch.bfloat16

    def of(self, buf: Any) -> Any:
        """The tensor over ``buf``'s memory (``buf`` a C-contiguous NumPy or CuPy array)."""
        if buf.dtype == _array.bfloat16:
            return self._torch.from_dlpack(buf.view(_INT16)).view(self._bf16)
        return self._torch.from_dlpack(buf)


#: Our reductions by name -> torch.distributed's (AVERAGE runs as SUM, then a division,
#: so every backend rounds a mean alike).
_OPS = {"SUM": "SUM", "AVERAGE": "SUM", "PRODUCT": "PRODUCT", "MIN": "MIN", "MAX": "MAX"}


def reduce_op(dist: Any, op: ReduceOp, dtype: Any, what: str) -> Any:
    """torch.distributed's op for ``op`` on ``dtype``.

    Raises:
        UnsupportedDTypeError: PRODUCT of complex values, which torch.distributed refuses.
    """
    if op is ReduceOp.PRODUCT and np.dtype(dtype).kind == "c":
        raise UnsupportedDTypeError(
            f"{what}: the torch backend cannot multiply complex values ({dtype}): "
            "torch.distributed reduces complex tensors with SUM and AVERAGE only; use the "
            "mpi or mock backend for a complex PRODUCT")
    return getattr(dist.ReduceOp, _OPS[op.name])


__all__ = ["TensorView", "load_torch", "reduce_op"]
