"""The torch backend: axondist's collectives over ``torch.distributed`` (gloo for NumPy
arrays, NCCL for CuPy arrays), for jobs started by torchrun or a launcher that sets
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. torch loads when the backend
is created."""

from .backend import TorchBackend
from .world import create_world_backend, install_abort_hook

__all__ = ["TorchBackend", "create_world_backend", "install_abort_hook"]
