"""The runtime state of FSDP's flat units and the calls that gather and drop their parameters.

:class:`UnitState` is the base of :class:`~axondist.fsdp.FullyShardedDataParallel`:
each unit keeps its master shard, the gathered full buffer while it is held
and the all-gather in flight, if any (:class:`GatherHandle`); this module
decides where arrays live (compute device, host under offload, compute
dtype) and how a unit's all-gather starts, finishes and is undone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .. import _array, comm
from ..backends.base import CompletedWork, Work
from ..parameter import Parameter
from ..process_group import ProcessGroup
from .policies import CPUOffload, MixedPrecision, ShardingSpec, ShardingStrategy
from .sharding import FlatUnit, plan_units, unit_indices


class _Unit:
    """Runtime state of one unit: its shard Parameter and what is gathered."""

    __slots__ = ("flat", "shard", "full", "accum", "pending")

    def __init__(self, flat: FlatUnit, shard: Parameter) -> None:
        self.flat = flat
        self.shard = shard
        self.full: Any = None  # the gathered padded flat buffer (compute dtype) or None
        self.accum: Any = None  # no_sync: summed unreduced gradients (master dtype, numel)
        self.pending: GatherHandle | None = None  # an all-gather started, not yet waited for


class GatherHandle:
    """An all-gather of one or more units in flight (``gather_parameters(async_op=True)``).

    :meth:`wait` completes it and installs the full parameters in the model;
    until then the units count as not gathered. Waiting twice is harmless,
    and resharding or gathering a unit again first finishes its pending
    gather, so every rank still makes the same collectives.
    """

    __slots__ = ("_owner", "_parts")

    def __init__(self, owner: UnitState, parts: list[tuple[_Unit, Any]]) -> None:
        self._owner = owner
        self._parts = parts  # (unit, the Work whose result is its full buffer); emptied by wait()

    def wait(self) -> None:
        """Finish the all-gathers and point the model's Parameters at the full buffers."""
        parts, self._parts = self._parts, []
        for st, work in parts:
            full = work.wait()  # every request is completed, installed or not
            if st.pending is self:
                st.pending = None
                self._owner._install(st, full)

    def is_completed(self) -> bool:
        """True once :meth:`wait` ran (the parameters are then in the model)."""
        return not self._parts


class UnitState:
    """The units of a sharded model and their gathering (FullyShardedDataParallel's base).

    The attributes are set by the wrapper's constructor.
    """

    group: ProcessGroup
    shard_group: ProcessGroup | None
    replica_group: ProcessGroup | None
    sharding_strategy: ShardingStrategy
    cpu_offload: CPUOffload
    mixed_precision: MixedPrecision
    module: Any
    _units: list[_Unit]
    _params: list[Parameter]
    _xp: Any
    _on_device: bool
    _closed: bool

    @property
    def spec(self) -> ShardingSpec:
        """What the strategy shards and over which ranks (``sharding_strategy.spec``)."""
        return self.sharding_strategy.spec

    @property
    def _shards(self) -> int:
        return self.shard_group.world_size if self.shard_group is not None else 1

    @property
    def shard_rank(self) -> int:
        """This rank's index in its shard group (0 when units are not split)."""
        return self.shard_group.rank if self.shard_group is not None else 0

    # --- building the units -----------------------------------------------------------

    def _unit_plan(self, units: Sequence[Sequence[Any]] | None,
                   unit_size_mb: float) -> list[list[int]]:
        if units is None and callable(getattr(self.module, "units", None)):
            units = unit_indices(self.module.units(), self._params)
        return plan_units([p.size for p in self._params], [p.dtype for p in self._params],
                          units, int(unit_size_mb * 2**20))

    def _build_units(self, plan: list[list[int]], sync_states: bool) -> list[_Unit]:
        """The units of ``plan`` (lists of parameter indices): each keeps this rank's shard
        (rank 0's values on every rank when ``sync_states``), and its parameters are left
        as empty placeholders until gathered."""
        out = []
        for u, members in enumerate(plan):
            params = [self._params[i] for i in members]
            flat = FlatUnit(u, tuple(members), tuple(p.shape for p in params),
                            np.dtype(params[0].dtype), self._shards)
            buf = self._xp.zeros(flat.padded_numel, dtype=flat.dtype)
            flat.layout.pack([p.data for p in params], out=buf[:flat.numel])
            if sync_states and self.group.world_size > 1:
                comm.broadcast(buf, self.group, src=0)
            lo, hi = flat.shard_bounds(self.shard_rank)
            shard = self._to_rest(buf[lo:hi].copy())
            del buf
            out.append(_Unit(flat, Parameter(shard, name=f"fsdp.unit{u}")))
            for _member, p in zip(members, params):
                p.data = self._placeholder(flat)
                p.grad = None
        return out

    # --- where arrays live --------------------------------------------------------------

    def _to_rest(self, x: Any) -> Any:
        """Where shards rest: host memory under CPU offload, else where computed."""
        return _array.to_host(x) if self.cpu_offload.offloads_shards else x

    def _to_compute(self, x: Any) -> Any:
        """On the compute device (a copy only when ``x`` rests on the host of a GPU run)."""
        if self._on_device and not _array.is_cupy(x):
            return _array.to_device(x)
        return x

    def _compute_dtype(self, flat: FlatUnit) -> np.dtype:
        return self.mixed_precision.compute_dtype(flat.dtype)

    def _placeholder(self, flat: FlatUnit) -> Any:
        return self._xp.empty(0, dtype=self._compute_dtype(flat))

    def _select(self, unit: int | None, where: str) -> list[_Unit]:
        if self._closed:
            raise RuntimeError(f"{where}: this FullyShardedDataParallel is closed (close() "
                               "destroyed the groups it created); wrap the model again")
        if unit is None:
            return self._units
        if not isinstance(unit, (int, np.integer)) or not 0 <= unit < len(self._units):
            raise ValueError(f"{where}: unit={unit!r} is not a unit index "
                             f"(0..{len(self._units) - 1})")
        return [self._units[unit]]

    # --- gather / reshard -------------------------------------------------------------------

    def gather_parameters(self, unit: int | None = None, *,
                          async_op: bool = False) -> GatherHandle | None:
        """All-gather full parameters of ``unit`` (every unit when None) into the model.

        Each model ``Parameter.data`` becomes a view of the unit's gathered
        flat buffer, in the compute dtype (``MixedPrecision.param_dtype`` or
        the master dtype). Always communicates, so it also refreshes values
        that an optimizer step made stale (SHARD_GRAD_OP, NO_SHARD). With
        ``async_op`` the all-gathers are only started (the shards are read
        now): compute on other units meanwhile, then ``handle.wait()``; this
        is how :meth:`from_layers` prefetches the next unit.

        Args:
            unit: one unit's index, or None for every unit.
            async_op: return a :class:`GatherHandle` instead of waiting.

        Returns:
            The handle with ``async_op``, else None.

        Raises:
            ValueError: ``unit`` is not a unit index.
        """
        units = self._select(unit, "gather_parameters")
        for st in units:
            self._finish_pending(st)
        handle = GatherHandle(self, [(st, self._start_gather(st)) for st in units])
        for st in units:
            st.pending = handle
        if async_op:
            return handle
        handle.wait()
        return None

    def _start_gather(self, st: _Unit) -> Work:
        """Start ``st``'s all-gather; the Work's result is the full padded buffer."""
        flat = st.flat
        src = self._to_compute(st.shard.data)
        cdt = self._compute_dtype(flat)
        if src.dtype != cdt:
            src = src.astype(cdt)
        if self.shard_group is None:
            return CompletedWork(src)  # one shard is the whole flat (may alias the master)
        sizes = [flat.shard_size] * self._shards  # equal shards: no size exchange
        return comm.all_gather(src, self.shard_group, sizes=sizes, async_op=True)

    def _install(self, st: _Unit, full: Any) -> None:
        st.full = full
        for i, view in zip(st.flat.param_indices, st.flat.layout.views(full[:st.flat.numel])):
            self._params[i].data = view

    def _finish_pending(self, st: _Unit) -> None:
        if st.pending is not None:
            st.pending.wait()

    def reshard_parameters(self, unit: int | None = None) -> None:
        """Release the full parameters of ``unit`` (every unit when None).

        FULL_SHARD and HYBRID_SHARD drop the gathered buffer and set each
        model ``Parameter.data`` to a 0-size placeholder (shape ``(0,)``).
        SHARD_GRAD_OP and NO_SHARD keep the full parameters resident (they
        become stale after an optimizer step until the next gather).
        """
        if not self.spec.parameters:
            self._select(unit, "reshard_parameters")  # still check the argument
            return
        for st in self._select(unit, "reshard_parameters"):
            self._release(st)

    def release_parameters(self, unit: int | None = None) -> None:
        """Drop the full parameters of ``unit`` (every unit when None), whatever the strategy.

        Unlike :meth:`reshard_parameters` this also releases what SHARD_GRAD_OP,
        SHARD_OPTIMIZER and NO_SHARD keep, e.g. after the shards were
        overwritten by a load; call :meth:`gather_parameters` before the next
        forward.
        """
        for st in self._select(unit, "release_parameters"):
            self._release(st)

    def _release(self, st: _Unit) -> None:
        self._finish_pending(st)  # every rank started it: finish it before dropping it
        st.full = None
        for i in st.flat.param_indices:
            self._params[i].data = self._placeholder(st.flat)

    @contextlib.contextmanager
    def summon_full_params(self, unit: int | None = None) -> Iterator[list[Parameter]]:
        """Gather full parameters for the block; reshard when it ends, also on an exception.

        Yields the model's Parameters (full arrays inside the block). The
        strategy decides what "reshard" keeps, as in :meth:`reshard_parameters`.

        Args:
            unit: one unit's index, or None for every unit.

        Raises:
            ValueError: ``unit`` is not a unit index.
        """
        self.gather_parameters(unit)
        try:
            yield list(self._params)
        finally:
            self.reshard_parameters(unit)

    def is_gathered(self, unit: int) -> bool:
        """True while ``unit``'s full parameters are held (not while only being gathered)."""
        return self._select(unit, "is_gathered")[0].full is not None

    def is_gathering(self, unit: int) -> bool:
        """True while an all-gather of ``unit`` started with ``async_op=True`` is not waited for
        (its full buffer is already allocated)."""
        return self._select(unit, "is_gathering")[0].pending is not None


__all__ = ["GatherHandle", "UnitState"]
