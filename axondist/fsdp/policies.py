"""What FSDP shards, where the shards rest, and in which precision it computes.

These are values (an enum each, and a frozen dataclass), passed to
:class:`~axondist.fsdp.FullyShardedDataParallel`; they do nothing on their own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _array
from .._validate import parse_choice


class Span(enum.Enum):
    """A set of ranks, named relative to the wrapper's group and this rank."""

    NONE = "none"
    """This rank alone: nothing is split or replicated, no communication."""

    GROUP = "group"
    """Every rank of the wrapper's group."""

    NODE = "node"
    """The ranks of this rank's node (``ranks_per_node`` or ``group.node_info()``)."""

    ACROSS_NODES = "across_nodes"
    """The ranks holding this rank's local index on every node."""


@dataclass(frozen=True)
class ShardingSpec:
    """What a sharding strategy splits over ranks, and over which ranks.

    ZeRO's stages are nested: sharded parameters imply sharded gradients,
    which imply sharded optimizer state; a spec that breaks the nesting is
    refused. Every place that behaves differently per strategy reads these
    fields, so a new strategy is a new row of :data:`SHARDING_SPECS`.
    """

    shard_over: Span
    """The ranks a unit is split over (its shard group): NONE, GROUP or NODE."""

    replicate_over: Span
    """The ranks holding the same shard (its replica group), whose gradients are
    averaged by an all-reduce: NONE, GROUP or ACROSS_NODES."""

    parameters: bool
    """Full parameters are released by ``reshard_parameters`` (only shards stay)."""

    gradients: bool
    """Gradients are reduce-scattered and only shards are kept; False: all-reduced
    over the shard group, and the full averaged gradient is kept."""

    optimizer_state: bool
    """The optimizer updates (and keeps state for) shards only."""

    def __post_init__(self) -> None:
        if self.shard_over not in (Span.NONE, Span.GROUP, Span.NODE):
            raise ValueError(f"ShardingSpec: shard_over={self.shard_over.name}; use NONE, "
                             "GROUP or NODE")
        if self.replicate_over not in (Span.NONE, Span.GROUP, Span.ACROSS_NODES):
            raise ValueError(f"ShardingSpec: replicate_over={self.replicate_over.name}; use "
                             "NONE, GROUP or ACROSS_NODES")
        if (self.shard_over is Span.NODE) != (self.replicate_over is Span.ACROSS_NODES):
            raise ValueError("ShardingSpec: shard_over=NODE and replicate_over=ACROSS_NODES "
                             "go together (shard within a node, replicate across nodes)")
        if self.shard_over is not Span.NODE and ((self.shard_over is Span.NONE)
                                                 == (self.replicate_over is Span.NONE)):
            raise ValueError("ShardingSpec: one of shard_over and replicate_over spans the "
                             "group and the other is NONE (or use NODE with ACROSS_NODES)")
        if self.shard_over is Span.NONE and (self.parameters or self.gradients
                                             or self.optimizer_state):
            raise ValueError("ShardingSpec: shard_over=NONE shards nothing; set parameters, "
                             "gradients and optimizer_state to False")
        if (self.parameters and not self.gradients) or (self.gradients
                                                        and not self.optimizer_state):
            raise ValueError("ShardingSpec: sharding is nested: parameters imply gradients, "
                             "gradients imply optimizer_state")
        if self.shard_over is not Span.NONE and not self.optimizer_state:
            raise ValueError("ShardingSpec: a spec that shards over ranks shards at least the "
                             "optimizer state (ZeRO-1)")

    @property
    def uses_nodes(self) -> bool:
        """True when the layout depends on which ranks share a node."""
        return self.shard_over is Span.NODE


class ShardingStrategy(enum.Enum):
    """Which of parameters, gradients and optimizer state are split over ranks.

    With ``N`` ranks sharing the work and ``P`` parameters, per rank:

    =============== ============ ============ ================ ==================
    strategy         parameters   gradients    optimizer state  gradient sync
    =============== ============ ============ ================ ==================
    FULL_SHARD       P / N        P / N        P / N            reduce-scatter
    SHARD_GRAD_OP    P (kept)     P / N        P / N            reduce-scatter
    SHARD_OPTIMIZER  P (kept)     P            P / N            all-reduce
    NO_SHARD         P            P            P                all-reduce
    HYBRID_SHARD     P / L        P / L        P / L            reduce-scatter in
                                                                the node, then
                                                                all-reduce across
    =============== ============ ============ ================ ==================

    (``L`` = ranks per node.) The parameter column is what stays resident
    between steps: every strategy holds a unit's full parameters while that
    unit is gathered. :attr:`spec` is the row as data
    (:data:`SHARDING_SPECS`). Names parse case-insensitively, and ``"zero1"``,
    ``"zero2"``, ``"zero3"`` name the ZeRO stages.
    """

    FULL_SHARD = "full_shard"
    """ZeRO-3: only this rank's shard of each unit stays resident; a unit's full
    parameters exist between ``gather_parameters`` and ``reshard_parameters``."""

    SHARD_GRAD_OP = "shard_grad_op"
    """ZeRO-2: once gathered, the full parameters stay resident (``reshard_parameters``
    keeps them); gradients and optimizer state are sharded. The next
    ``gather_parameters`` refreshes them after an optimizer step."""

    SHARD_OPTIMIZER = "shard_optimizer"
    """ZeRO-1: full parameters stay resident and gradients are all-reduced and
    kept in full; only the optimizer state (and the master shard it updates) is
    split. The next ``gather_parameters`` brings every rank's updated shard."""

    NO_SHARD = "no_shard"
    """DDP-like: every rank holds everything and gradients are all-reduced."""

    HYBRID_SHARD = "hybrid_shard"
    """FULL_SHARD inside each node, replicated across nodes: gradients are
    reduce-scattered over the node's ranks, then each shard is all-reduced over
    the ranks holding the same shard on the other nodes."""

    @classmethod
    def parse(cls, value: ShardingStrategy | str,
              where: str = "FullyShardedDataParallel") -> ShardingStrategy:
        """Accept a member, its name or value (``"full_shard"``, ``"FULL_SHARD"``) or a
        ZeRO stage (``"zero1"``, ``"zero2"``, ``"zero3"``).

        Raises:
            ValueError: ``value`` names no strategy; the message names ``where`` and
                lists the valid names.
        """
        return parse_choice(cls, value, f"{where}: sharding_strategy", _ZERO_STAGES)

    @property
    def spec(self) -> ShardingSpec:
        """What this strategy shards and over which ranks (its :data:`SHARDING_SPECS` row)."""
        return SHARDING_SPECS[self]

    @property
    def shards_parameters(self) -> bool:
        """True when full parameters are released by ``reshard_parameters``."""
        return self.spec.parameters


#: Each strategy's behaviour as data: every place that differs per strategy reads this.
SHARDING_SPECS: dict[ShardingStrategy, ShardingSpec] = {
    ShardingStrategy.FULL_SHARD: ShardingSpec(Span.GROUP, Span.NONE, True, True, True),
    ShardingStrategy.SHARD_GRAD_OP: ShardingSpec(Span.GROUP, Span.NONE, False, True, True),
    ShardingStrategy.SHARD_OPTIMIZER: ShardingSpec(Span.GROUP, Span.NONE, False, False, True),
    ShardingStrategy.NO_SHARD: ShardingSpec(Span.NONE, Span.GROUP, False, False, False),
    ShardingStrategy.HYBRID_SHARD: ShardingSpec(Span.NODE, Span.ACROSS_NODES, True, True, True),
}

_ZERO_STAGES = {
    "zero1": ShardingStrategy.SHARD_OPTIMIZER,
    "zero2": ShardingStrategy.SHARD_GRAD_OP,
    "zero3": ShardingStrategy.FULL_SHARD,
}


class CPUOffload(enum.Enum):
    """Where the sharded state rests between uses (host memory or the compute device).

    axondist's optimizers keep their state next to the Parameters they update,
    so offloading the optimizer state means offloading the float32 master shards
    it updates (and the gradient shards handed to it): the optimizer step then
    runs on the host. ``OPTIMIZER_STATES`` is therefore the same member as
    ``PARAMS`` (an alias kept for the name other libraries use).

    With CuPy parameters the moves are real host <-> device copies; with NumPy
    parameters host and device are the same memory, so offloading only changes
    how :meth:`FullyShardedDataParallel.memory_stats` accounts the bytes.
    """

    NONE = "none"
    """Shards, gradient shards and optimizer state stay on the compute device."""

    PARAMS = "params"
    """Parameter shards, their gradient shards and the optimizer state rest in
    host memory; a shard is copied to the device only to be all-gathered, and a
    reduced gradient shard is copied back to the host."""

    OPTIMIZER_STATES = "params"  # an alias of PARAMS (see the class docstring)

    FULL = "full"
    """PARAMS, plus the full-size gradient accumulation buffers kept by
    ``no_sync()`` rest in host memory."""

    @classmethod
    def parse(cls, value: CPUOffload | str | bool | None,
              where: str = "FullyShardedDataParallel") -> CPUOffload:
        """Accept a member, its name, or a bool (True = PARAMS, False/None = NONE).

        Raises:
            ValueError: ``value`` names no policy; the message lists the valid names.
        """
        if isinstance(value, cls):
            return value
        if value is None or value is False:
            return cls.NONE
        if value is True:
            return cls.PARAMS
        return parse_choice(cls, value, f"{where}: cpu_offload",
                            {"optimizer_states": cls.PARAMS})

    @property
    def offloads_shards(self) -> bool:
        """True when shards, their grads and optimizer state rest in host memory."""
        return self is not CPUOffload.NONE

    @property
    def offloads_accumulation(self) -> bool:
        """True when ``no_sync`` accumulation buffers rest in host memory."""
        return self is CPUOffload.FULL


def _floating_dtype(value: Any, field: str) -> np.dtype | None:
    if value is None:
        return None
    dtype = _array.dtype_named(value) if isinstance(value, str) else np.dtype(value)
    if not _array.is_floating(dtype):
        raise ValueError(f"MixedPrecision: {field}={dtype} is not a floating dtype; use "
                         "float16, bfloat16, float32 or float64")
    return dtype


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision copies for compute and communication; float32 master shards stay.

    The shards the optimizer updates keep the model's original dtype (the
    "master" weights, usually float32). Each field set here only changes a
    temporary copy. Strings (``"bfloat16"``) and NumPy dtypes are accepted.
    """

    param_dtype: Any = None
    """dtype of the gathered full parameters: each rank casts its shard to it
    before the all-gather (so the gather moves fewer bytes) and the model's
    ``Parameter.data`` are arrays of this dtype. None: the master dtype."""

    reduce_dtype: Any = None
    """dtype gradients are reduced in: the full gradients are cast to it before
    the reduce-scatter / all-reduce, and the result is cast back to the master
    dtype before it is added into the shard gradient. None: ``param_dtype`` when
    that is set (as torch does), else the master dtype."""

    buffer_dtype: Any = None
    """dtype the model's buffers are cast to at wrap time, for models with a
    ``.buffers()`` method returning Parameters (non-trained state such as
    running statistics). None: buffers keep their dtype."""

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            object.__setattr__(self, field, _floating_dtype(getattr(self, field), field))

    def compute_dtype(self, master: Any) -> np.dtype:
        """dtype of the gathered parameters for a unit whose master dtype is ``master``."""
        return self.param_dtype if self.param_dtype is not None else np.dtype(master)

    def communication_dtype(self, master: Any) -> np.dtype:
        """dtype gradients are reduced in for a unit whose master dtype is ``master``."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return self.compute_dtype(master)


__all__ = ["SHARDING_SPECS", "CPUOffload", "MixedPrecision", "ShardingSpec", "ShardingStrategy",
           "Span"]
