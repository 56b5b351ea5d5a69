"""Per-rank memory of a sharded model: the ZeRO paper's model, an exact model and a tally.

:meth:`FSDPMemoryStats.estimate` is the paper's accounting before anything is
built (``P`` parameters, bytes per element given); :func:`unit_footprint` is
the exact byte count one unit holds in the state the wrapper's
``memory_estimate`` describes (:func:`estimated_footprint` sums it over the
units); :class:`HeldBytes` measures the arrays really held, counting each
underlying buffer once (:func:`measured_footprint` over a wrapper's units).
The accounting is written out in docs/guide.md (FSDP, "Memory").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._validate import MIB
from .policies import CPUOffload, ShardingSpec, ShardingStrategy, Span
from .sharding import FlatUnit

if TYPE_CHECKING:
    from ..parameter import Parameter
    from ._gather import _Unit


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
        buffer_bytes_per_rank: buffers the wrapper keeps for communication (the
            gradient packing buffers of a pair of ranks that share memory,
            ``Backend.shared_buffer``; 0 in the paper's model).
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
    buffer_bytes_per_rank: int = 0
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
        strategy = ShardingStrategy.parse(sharding_strategy, "FSDPMemoryStats.estimate")
        offload = CPUOffload.parse(cpu_offload, "FSDPMemoryStats.estimate")
        if num_params < 0 or world_size < 1:
            raise ValueError(f"FSDPMemoryStats.estimate: need num_params >= 0 and world_size "
                             f">= 1, got {num_params} and {world_size}")
        if min(param_bytes, grad_bytes, optimizer_bytes) < 0:
            raise ValueError("FSDPMemoryStats.estimate: bytes per element must be >= 0")
        spec = strategy.spec
        shards = shard_count(spec, world_size, ranks_per_node)
        shard = -(-num_params // shards)
        params = (shard if spec.parameters else num_params) * param_bytes
        grads = (shard if spec.gradients else num_params) * grad_bytes
        optim = (shard if spec.optimizer_state else num_params) * optimizer_bytes
        host: float = 0  # the bytes per element are floats
        if offload.offloads_shards:
            host = optim + grads + (params if spec.parameters else 0)
        return cls(
            total_params=int(num_params), world_size=shards, sharding_strategy=strategy,
            param_bytes_per_rank=round(params), grad_bytes_per_rank=round(grads),
            optim_bytes_per_rank=round(optim), host_bytes_per_rank=round(host),
            no_shard_bytes_per_rank=round(num_params * (param_bytes + grad_bytes
                                                        + optimizer_bytes)),
        )

    @property
    def total_bytes_per_rank(self) -> int:
        """Parameters + gradients + optimizer state + kept buffers, in bytes."""
        return (self.param_bytes_per_rank + self.grad_bytes_per_rank + self.optim_bytes_per_rank
                + self.buffer_bytes_per_rank)

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
                f"{self.optim_bytes_per_rank / MIB:.2f} MiB, "
                + (f"buffers {self.buffer_bytes_per_rank / MIB:.2f} MiB, "
                   if self.buffer_bytes_per_rank else "")
                + f"total {self.total_memory_mb():.2f} MiB"
                f" ({self.memory_savings():.1f}% saved vs NO_SHARD)")


def shard_count(spec: ShardingSpec, world_size: int, ranks_per_node: int | None = None) -> int:
    """Ranks a unit is split over under ``spec`` in a group of ``world_size`` ranks."""
    if spec.shard_over is Span.NONE:
        return 1
    if spec.shard_over is Span.NODE:
        return ranks_per_node or world_size
    return world_size


@dataclass(frozen=True)
class OptimizerModel:
    """What an optimizer keeps per parameter element: ``states`` arrays of ``state_dtype``.

    Made from an axondist optimizer by :meth:`of` (its ``state_names()`` and
    ``state_dtype()``), or Adam's two arrays when no optimizer is known.
    """

    states: int
    """State arrays per updated parameter (SGD without momentum 0, with momentum 1,
    Adam 2)."""

    state_dtype: Any = None
    """dtype of those arrays for a float32 parameter; None: the optimizer's rule
    (float32 for float16/bfloat16 parameters, else the parameter's dtype)."""

    @classmethod
    def of(cls, optimizer: Any) -> OptimizerModel:
        """The model of ``optimizer`` (None: Adam's two state arrays)."""
        names = getattr(optimizer, "state_names", None)
        if optimizer is None or not callable(names):
            return cls(2)
        return cls(len(names()))

    def dtype_for(self, param_dtype: Any) -> np.dtype:
        """The state dtype for parameters of ``param_dtype``."""
        if self.state_dtype is not None:
            return np.dtype(self.state_dtype)
        dtype = np.dtype(param_dtype)
        return dtype if dtype in (np.float32, np.float64) else np.dtype(np.float32)


@dataclass
class Footprint:
    """Bytes by component (a mutable sum; see :class:`FSDPMemoryStats` for the fields)."""

    params: int = 0
    grads: int = 0
    optim: int = 0
    padding: int = 0
    host: int = 0

    def add(self, component: str, nbytes: int, padding: int = 0, host: bool = False) -> None:
        """Count ``nbytes`` (of which ``padding`` are padding) under ``component``."""
        setattr(self, component, getattr(self, component) + int(nbytes))
        self.padding += int(padding)
        if host:
            self.host += int(nbytes)


def unit_footprint(flat: FlatUnit, shard_rank: int, spec: ShardingSpec, compute_dtype: Any,
                   optimizer: OptimizerModel, offload: CPUOffload, out: Footprint) -> None:
    """Add the bytes one unit holds after ``backward`` and ``optimizer.step()`` to ``out``.

    In that state (the ZeRO paper's) a rank holds: the master shard (counted as
    optimizer state under mixed precision, as the paper counts the float32
    copy, else as parameters); the gathered full parameters where the spec
    keeps them and they are not the master shard itself; the reduced
    gradient in the master dtype (the shard, or the full padded buffer when
    gradients are not sharded); and the optimizer's state for the shard.
    Full model gradients are dropped by the sync, so they count 0.
    """
    master = np.dtype(flat.dtype)
    compute = np.dtype(compute_dtype)
    lo, hi = flat.valid_bounds(shard_rank)
    shard_pad = flat.shard_size - (hi - lo)
    mixed = compute != master
    on_host = offload.offloads_shards
    out.add("optim" if mixed else "params", flat.shard_size * master.itemsize,
            shard_pad * master.itemsize, on_host)
    if not spec.parameters and (flat.shards > 1 or mixed):
        out.add("params", flat.padded_numel * compute.itemsize, flat.padding * compute.itemsize)
    if spec.gradients or flat.shards == 1:
        out.add("grads", flat.shard_size * master.itemsize, shard_pad * master.itemsize, on_host)
    else:
        out.add("grads", flat.padded_numel * master.itemsize, flat.padding * master.itemsize,
                on_host)
    state = optimizer.dtype_for(master).itemsize * optimizer.states
    out.add("optim", flat.shard_size * state, shard_pad * state, on_host)


def owner(array: Any) -> Any:
    """The array that owns ``array``'s memory (itself, or the base of a view)."""
    while isinstance(getattr(array, "base", None), type(array)):
        array = array.base
    return array


@dataclass
class HeldBytes:
    """A tally of arrays really held, each underlying buffer counted once.

    Arrays are counted by the ``nbytes`` of their owning buffer (a view counts
    its whole base, which it keeps alive), under the first component that
    names it.
    """

    total: Footprint = field(default_factory=Footprint)
    _seen: set[int] = field(default_factory=set)

    def add(self, array: Any, component: str, flat: FlatUnit | None = None,
            shard_rank: int = 0, host: bool = False) -> None:
        """Count ``array`` (None is skipped); ``flat`` locates its padding.

        An owner of ``flat``'s padded length holds ``flat.padding`` padding
        elements, one of its shard length the shard's padding; any other
        length none.
        """
        if array is None:
            return
        base = owner(array)
        if id(base) in self._seen or not hasattr(base, "nbytes"):
            return
        self._seen.add(id(base))
        pad = 0
        if flat is not None and flat.shards > 1:
            size = int(base.size)
            if size == flat.padded_numel:
                pad = flat.padding
            elif size == flat.shard_size:
                lo, hi = flat.valid_bounds(shard_rank)
                pad = flat.shard_size - (hi - lo)
        self.total.add(component, int(base.nbytes), pad * base.itemsize, host)


def estimated_footprint(flats: Sequence[FlatUnit], compute_dtypes: Sequence[Any],
                        shard_rank: int, spec: ShardingSpec, optimizer: OptimizerModel,
                        offload: CPUOffload) -> tuple[Footprint, int]:
    """The bytes a rank holds right after ``backward`` and ``optimizer.step()`` (every unit by
    :func:`unit_footprint`), and what NO_SHARD would hold in the same state, counted as
    :func:`measured_footprint` counts it (the base of ``memory_savings()``)."""
    held = Footprint()
    reference = 0
    for flat, compute in zip(flats, compute_dtypes):
        unit_footprint(flat, shard_rank, spec, compute, optimizer, offload, held)
        master = flat.dtype.itemsize
        state = optimizer.states * optimizer.dtype_for(flat.dtype).itemsize
        low = compute.itemsize if compute != flat.dtype and not spec.parameters else 0
        reference += flat.numel * (2 * master + state + low)
    return held, reference


def measured_footprint(units: Sequence[_Unit], params: Sequence[Parameter],
                       compute_dtypes: Sequence[Any], rank: int, offload: CPUOffload,
                       optimizer_state: Mapping[int, Mapping[str, Any]] | None,
                       unit_of: Mapping[int, int] | None) -> tuple[Footprint, int]:
    """The bytes of the arrays a wrapper's ``units`` and the model's ``params`` hold now (each
    buffer once), and what NO_SHARD would hold in the same state.

    ``optimizer_state`` is an optimizer's ``state`` (``{parameter index: {name: array}}``)
    and ``unit_of`` the unit of each of its parameters; None counts no optimizer.
    """
    held = HeldBytes()
    reference = 0
    for st, compute in zip(units, compute_dtypes):
        flat, shard = st.flat, st.shard
        mixed = compute != flat.dtype
        held.add(shard.data, "optim" if mixed else "params", flat, rank,
                 offload.offloads_shards)
        held.add(st.full, "params", flat, rank)
        for i in flat.param_indices:
            held.add(params[i].data, "params")
        held.add(shard.grad, "grads", flat, rank, offload.offloads_shards)
        held.add(st.accum, "grads", None, rank, offload.offloads_accumulation)
        reference += flat.numel * flat.dtype.itemsize
        if st.full is not None and st.full.dtype != flat.dtype:
            reference += flat.numel * st.full.itemsize
        if shard.grad is not None:
            reference += flat.numel * flat.dtype.itemsize
        if st.accum is not None:
            reference += st.accum.nbytes
    full_grads = held.total.grads
    for p in params:
        held.add(p.grad, "grads")
    reference += held.total.grads - full_grads  # the model's .grad: alike under any strategy
    if optimizer_state is not None and unit_of is not None:
        for k, state in optimizer_state.items():
            flat = units[unit_of[k]].flat
            for v in state.values():
                held.add(v if hasattr(v, "nbytes") else None, "optim", flat, rank,
                         offload.offloads_shards)
                if flat.shard_size and hasattr(v, "nbytes"):
                    reference += v.nbytes * flat.numel // flat.shard_size
    return held.total, reference


__all__ = ["FSDPMemoryStats", "Footprint", "HeldBytes", "OptimizerModel", "estimated_footprint",
           "measured_footprint", "owner", "shard_count", "unit_footprint"]
