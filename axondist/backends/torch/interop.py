"""What the torch backend needs of torch: torch loaded on first use (with a clear error when
it is missing) and the reduction ops. Buffers become tensors through
:data:`axondist._frameworks.TORCH` (DLPack, no copy; bfloat16 as its int16 bits)."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from ...errors import BackendUnavailableError, UnsupportedDTypeError
from ...ops import ReduceOp


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


__all__ = ["load_torch", "reduce_op"]
