"""axondist: distributed training for any array framework.

Data, sharded, pipeline and tensor parallelism over NumPy or CuPy arrays
(other frameworks' arrays through DLPack), with user-supplied forward and
gradient callables, on an in-process mock world, MPI or NCCL.

Importing axondist imports neither mpi4py nor CuPy; a backend loads its
library when it is created.
"""

from ._array import as_array, flatten, namespace, to_device, to_host, unflatten
from .backends.base import Work
from .backends.registry import register_backend
from .comm import (
    all_gather,
    all_gather_object,
    all_reduce,
    all_reduce_max,
    all_reduce_mean,
    all_reduce_min,
    all_reduce_product,
    all_reduce_sum,
    all_to_all,
    barrier,
    broadcast,
    broadcast_from,
    broadcast_object,
    broadcast_object_list,
    flight_recorder,
    gather_object,
    gather_tensor,
    is_main_process,
    monitored_barrier,
    rank,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_mean,
    reduce_scatter_sum,
    scatter_object_list,
    scatter_tensor,
    send,
    sync_gradient,
    sync_gradients,
    world_size,
)
from .errors import (
    AxondistError,
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidBufferError,
    LaunchError,
    NonFiniteNormError,
    NotAMemberError,
    RankError,
    RankExitedError,
    ScheduleError,
    TooManyGroupsError,
    UnsupportedDTypeError,
    WorldAbortedError,
)
from .launching.worlds import init, run, spawn, spawn_on_devices
from .ops import ReduceOp
from .parameter import Parameter, parameters_of
from .process_group import ProcessGroup, World, current_world
from .progress import progress

__version__ = "0.1.0"

# Wrappers load on first use (PEP 562), so `import axondist` stays as light as
# the collectives: an MPI job's start-up pays only for what it uses.
_LAZY = {
    "DistributedDataParallel": "ddp", "DDP": "ddp",
    "GradSyncStrategy": "ddp", "GradientBucket": "ddp",
    "GradientSynchronizer": "ddp",
    "SGD": "optim", "Adam": "optim", "AdamW": "optim", "Optimizer": "optim",
    "FullyShardedDataParallel": "fsdp", "FSDP": "fsdp", "ShardingStrategy": "fsdp",
    "CPUOffload": "fsdp", "MixedPrecision": "fsdp", "FSDPMemoryStats": "fsdp",
    "save_full_checkpoint": "checkpoint", "load_full_checkpoint": "checkpoint",
    "save_sharded_checkpoint": "checkpoint", "load_sharded_checkpoint": "checkpoint",
    "CheckpointReader": "checkpoint", "CheckpointError": "checkpoint",
    "Checkpointer": "checkpoint", "SaveHandle": "checkpoint",
    "Pipeline": "pipeline", "PipelineStage": "pipeline", "PipelineSchedule": "pipeline",
    "PipelineMemoryStats": "pipeline",
    "ColumnParallelLinear": "tensor_parallel", "RowParallelLinear": "tensor_parallel",
    "TensorParallelMLP": "tensor_parallel", "TensorParallelAttention": "tensor_parallel",
    "MixtureOfExperts": "expert_parallel",
    "DeviceMesh": "mesh", "make_mesh": "mesh",
    "HierarchicalAllReduce": "hierarchical",
    "DistributedSampler": "data",
    "print0": "log", "all_reduce_scalar": "log",
    "MockBackend": "backends", "NcclBackend": "backends",
    "ZeroRedundancyOptimizer": "zero", "ShardingSpec": "fsdp",
    "prepare": "prepared", "PreparedCall": "prepared",
    "trace_span": "trace",
    "LossScaler": "amp",
}


_SUBMODULES = {"amp", "backends", "checkpoint", "clip", "comm", "context_parallel", "data",
               "differentiable", "expert_parallel",
               "ddp", "fsdp", "log",
               "mesh", "optim", "pipeline", "tensor_parallel", "trace", "tune", "zero"}


def __getattr__(name: str) -> object:
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'axondist' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    *_LAZY,
    "AxondistError",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "InvalidBufferError",
    "LaunchError",
    "NonFiniteNormError",
    "NotAMemberError",
    "TooManyGroupsError",
    "Parameter",
    "ProcessGroup",
    "RankError",
    "RankExitedError",
    "ScheduleError",
    "ReduceOp",
    "UnsupportedDTypeError",
    "Work",
    "World",
    "WorldAbortedError",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_min",
    "all_reduce_product",
    "all_reduce_sum",
    "all_to_all",
    "as_array",
    "barrier",
    "broadcast",
    "broadcast_from",
    "broadcast_object",
    "broadcast_object_list",
    "flight_recorder",
    "gather_object",
    "current_world",
    "flatten",
    "gather_tensor",
    "init",
    "is_main_process",
    "monitored_barrier",
    "namespace",
    "parameters_of",
    "progress",
    "rank",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_mean",
    "reduce_scatter_sum",
    "register_backend",
    "run",
    "scatter_object_list",
    "scatter_tensor",
    "send",
    "spawn",
    "spawn_on_devices",
    "sync_gradient",
    "sync_gradients",
    "to_device",
    "to_host",
    "unflatten",
    "world_size",
]
