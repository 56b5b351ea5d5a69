"""Per-rank memory of a sharded model: a model of it (ZeRO accounting) and measurements.

The model follows the ZeRO paper's accounting. With ``P`` parameters and
``S`` ranks sharing the shards, each rank holds, in bytes::

                   parameters        gradients        optimizer state
    NO_SHARD       P * p             P * g            P * k
    SHARD_GRAD_OP  P * p             ceil(P/S) * g    ceil(P/S) * k
    FULL_SHARD     ceil(P/S) * p     ceil(P/S) * g    ceil(P/S) * k
    HYBRID_SHARD   as FULL_SHARD with S = ranks per node

where ``p``, ``g`` are the bytes per element of the compute parameters and
gradients and ``k`` the optimizer's bytes per parameter. Mixed-precision Adam
is p = 2, g = 2, k = 12 (float32 master weights 4 + exp_avg 4 + exp_avg_sq 4);
float32 Adam without a separate master copy is p = 4, g = 4, k = 8.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .policies import CPUOffload, ShardingStrategy

MIB = 2**20


@dataclass(frozen=True)
class FSDPMemoryStats:
    """Bytes one rank holds for parameters, gradients and optimizer state.

    Made either by the model (:meth:`estimate`,
    :meth:`FullyShardedDataParallel.memory_estimate`) or by measurement
    (:meth:`FullyShardedDataParallel.memory_stats`: the ``nbytes`` of the arrays
    the wrapper and optimizer hold at that moment; ``measured`` is then True).

    Attributes:
        total_params: parameters of the whole model (no padding).
        world_size: ranks sharing the shards (the node size under HYBRID_SHARD,
            1 under NO_SHARD).
        sharding_strategy: the strategy the numbers are for.
        param_bytes_per_rank: parameter shards plus full parameters held.
        grad_bytes_per_rank: gradient shards plus full gradients held.
        optim_bytes_per_rank: optimizer state (including float32 master
            copies when the compute parameters are in lower precision).
        padding_bytes_per_rank: bytes of padding elements inside the above
            (0 in the model).
        host_bytes_per_rank: bytes of the above that rest in host memory
            under the CPU offload policy.
        no_shard_bytes_per_rank: what one rank would hold under NO_SHARD with
            the same dtypes and optimizer (the base of :meth:`memory_savings`).
        measured: True when the numbers were measured, False when modelled.
    """

    total_params: int
    world_size: int
    sharding_strategy: ShardingStrategy
    param_bytes_per_rank: int
    grad_bytes_per_rank: int
    optim_bytes_per_rank: int
    padding_bytes_per_rank: int = 0
    host_bytes_per_rank: int = 0
    no_shard_bytes_per_rank: int = 0
    measured: bool = False

    @classmethod
    def estimate(cls, num_params: int, world_size: int,
                 sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
                 param_bytes: float = 4, grad_bytes: float = 4, optimizer_bytes: float = 8, *,
                 ranks_per_node: int | None = None,
                 cpu_offload: CPUOffload | str | None = None) -> FSDPMemoryStats:
        """The modelled per-rank bytes, before anything is built.

        Args:
            num_params: parameters of the model.
            world_size: ranks of the data-parallel group.
            sharding_strategy: a :class:`ShardingStrategy` or its name.
            param_bytes, grad_bytes: bytes per element of the compute
                parameters and gradients (2 for float16/bfloat16).
            optimizer_bytes: optimizer bytes per parameter (8 for float32
                Adam, 12 for mixed-precision Adam, 4 for SGD with momentum).
            ranks_per_node: ranks sharing the shards under HYBRID_SHARD
                (``world_size`` when None).
            cpu_offload: counts sharded state as host memory when offloaded.

        Raises:
            ValueError: negative sizes, or a ``world_size`` below 1.
        """
        strategy = ShardingStrategy.parse(sharding_strategy)
        offload = CPUOffload.parse(cpu_offload)
        if num_params < 0 or world_size < 1:
            raise ValueError(f"FSDPMemoryStats.estimate: need num_params >= 0 and world_size "
                             f">= 1, got {num_params} and {world_size}")
        if min(param_bytes, grad_bytes, optimizer_bytes) < 0:
            raise ValueError("FSDPMemoryStats.estimate: bytes per element must be >= 0")
        shards = {
            ShardingStrategy.NO_SHARD: 1,
            ShardingStrategy.HYBRID_SHARD: ranks_per_node or world_size,
        }.get(strategy, world_size)
        shard = -(-num_params // shards)
        full_params = strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP)
        params = (num_params if full_params else shard) * param_bytes
        grads = shard * grad_bytes
        optim = shard * optimizer_bytes
        host: float = 0  # the bytes per element are floats
        if offload.offloads_shards:
            host = optim + grads + (0 if full_params else params)
        return cls(
            total_params=int(num_params), world_size=shards, sharding_strategy=strategy,
            param_bytes_per_rank=round(params), grad_bytes_per_rank=round(grads),
            optim_bytes_per_rank=round(optim), host_bytes_per_rank=round(host),
            no_shard_bytes_per_rank=round(num_params * (param_bytes + grad_bytes
                                                        + optimizer_bytes)),
        )

    @property
    def total_bytes_per_rank(self) -> int:
        """Parameters + gradients + optimizer state, in bytes."""
        return self.param_bytes_per_rank + self.grad_bytes_per_rank + self.optim_bytes_per_rank

    @property
    def device_bytes_per_rank(self) -> int:
        """The part of :attr:`total_bytes_per_rank` not offloaded to host memory."""
        return self.total_bytes_per_rank - self.host_bytes_per_rank

    def total_memory_mb(self) -> float:
        """:attr:`total_bytes_per_rank` in MiB (2**20 bytes)."""
        return self.total_bytes_per_rank / MIB

    def memory_savings(self) -> float:
        """Percent saved against NO_SHARD (75.0 means a quarter of the memory; 0 when unknown)."""
        if self.no_shard_bytes_per_rank <= 0:
            return 0.0
        return 100.0 * (1.0 - self.total_bytes_per_rank / self.no_shard_bytes_per_rank)

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (strategy by name), for tables and JSON."""
        out = asdict(self)
        out["sharding_strategy"] = self.sharding_strategy.name
        out["total_memory_mb"] = self.total_memory_mb()
        out["memory_savings"] = self.memory_savings()
        return out

    def __str__(self) -> str:
        kind = "measured" if self.measured else "estimated"
        return (f"{self.sharding_strategy.name} over {self.world_size} ({kind}): "
                f"params {self.param_bytes_per_rank / MIB:.2f} MiB, grads "
                f"{self.grad_bytes_per_rank / MIB:.2f} MiB, optimizer "
                f"{self.optim_bytes_per_rank / MIB:.2f} MiB, total {self.total_memory_mb():.2f} MiB"
                f" ({self.memory_savings():.1f}% saved vs NO_SHARD)")


__all__ = ["FSDPMemoryStats"]
