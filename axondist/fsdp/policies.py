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


class ShardingStrategy(enum.Enum):
    """Which of parameters, gradients and optimizer state are split over ranks.

    With ``N`` ranks sharing the work and ``P`` parameters, per rank:

    ============== ============ ============ ================ ==================
    strategy        parameters   gradients    optimizer state  gradient sync
    ============== ============ ============ ================ ==================
    FULL_SHARD      P / N        P / N        P / N            reduce-scatter
    SHARD_GRAD_OP   P (kept)     P / N        P / N            reduce-scatter
    NO_SHARD        P            P            P                all-reduce
    HYBRID_SHARD    P / L        P / L        P / L            reduce-scatter in
                                                               the node, then
                                                               all-reduce across
    ============== ============ ============ ================ ==================

    (``L`` = ranks per node.) The parameter column is what stays resident
    between steps: every strategy holds a unit's full parameters while that
    unit is gathered.
    """

    FULL_SHARD = "full_shard"
    """ZeRO-3: only this rank's shard of each unit stays resident; a unit's full
    parameters exist between ``gather_parameters`` and ``reshard_parameters``."""

    SHARD_GRAD_OP = "shard_grad_op"
    """ZeRO-2: once gathered, the full parameters stay resident (``reshard_parameters``
    keeps them); gradients and optimizer state are sharded. The next
    ``gather_parameters`` refreshes them after an optimizer step."""

    NO_SHARD = "no_shard"
    """DDP-like: every rank holds everything and gradients are all-reduced."""

    HYBRID_SHARD = "hybrid_shard"
    """FULL_SHARD inside each node, replicated across nodes: gradients are
    reduce-scattered over the node's ranks, then each shard is all-reduced over
    the ranks holding the same shard on the other nodes."""

    @classmethod
    def parse(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        """Accept a member or its name (``"full_shard"``, ``"FULL_SHARD"``)."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(m.name for m in cls)
            raise ValueError(f"sharding_strategy={value!r} is not a strategy; use one of "
                             f"{valid}") from None

    @property
    def shards_parameters(self) -> bool:
        """True when full parameters are released by ``reshard_parameters``."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class CPUOffload(enum.Enum):
    """Where the sharded state rests between uses (host memory or the compute device).

    axondist's optimizers keep their state next to the Parameters they update,
    so offloading the optimizer state means offloading the float32 master shards
    it updates (and the gradient shards handed to it): the optimizer step then
    runs on the host. ``OPTIMIZER_STATES`` is therefore the same member as
    ``PARAMS`` (an alias kept for the reference API's name).

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
    def parse(cls, value: CPUOffload | str | bool | None) -> CPUOffload:
        """Accept a member, its name, or a bool (True = PARAMS, False/None = NONE)."""
        if isinstance(value, cls):
            return value
        if value is None or value is False:
            return cls.NONE
        if value is True:
            return cls.PARAMS
        name = str(value).upper()
        if name in cls.__members__:
            return cls.__members__[name]
        valid = ", ".join(cls.__members__)
        raise ValueError(f"cpu_offload={value!r} is not an offload policy; use one of {valid}")

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


__all__ = ["CPUOffload", "MixedPrecision", "ShardingStrategy"]
