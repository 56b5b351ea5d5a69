"""FullyShardedDataParallel: parameters, gradients and optimizer state split over ranks.

Each unit (parameters flattened together, see :mod:`axondist.fsdp.sharding`)
keeps one 1-D master shard per rank; ``gather_parameters`` all-gathers the
shards into the model's ``Parameter.data`` (in the compute dtype),
``sync_gradients`` reduces the model's full gradients into shard gradients,
and an optimizer built on :meth:`FullyShardedDataParallel.sharded_parameters`
updates the shards. What each strategy shards, and over which ranks, is read
from its :class:`~axondist.fsdp.policies.ShardingSpec`; how the numbers move
is described in docs/guide.md (FSDP). The class is built from parts:
``_gather.py`` (building the units, gather and reshard), ``_gradients.py``
(reduction, no_sync, clipping), ``_layers.py`` (the layer-by-layer step of
:meth:`FullyShardedDataParallel.from_layers`), ``_groups.py`` (construction
checks and groups), ``memory.py`` (the byte counts) and ``state_dict.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import _array
from .._step import GradFn, check_grad_fn, check_optimizer, loss_and_gradients, split_grad_fn
from ..checkpoint import CheckpointReader, ShardedState, param_names
from ..parameter import Parameter, parameters_of
from ..process_group import ProcessGroup, resolve_group
from . import _layers
from . import state_dict as _state_dict
from ._gradients import GradientSync
from ._groups import check_floating, check_same_model, sharding_groups
from ._layers import LayerPlan
from .memory import (
    Footprint,
    FSDPMemoryStats,
    OptimizerModel,
    estimated_footprint,
    measured_footprint,
)
from .policies import CPUOffload, MixedPrecision, ShardingStrategy
from .sharding import DEFAULT_UNIT_BYTES, FlatUnit

if TYPE_CHECKING:
    from ..pipeline import LossFn, PipelineStage

logger = logging.getLogger("axondist.fsdp")


class FullyShardedDataParallel(GradientSync):
    """Shard a model's parameters, gradients and optimizer state over a group.

    Args:
        model: anything :func:`~axondist.parameters_of` accepts. Every rank
            must pass the same parameters (names, shapes, dtypes, order):
            construction checks it on every rank.
        group: the data-parallel group (the current world when None).
        sharding_strategy: see :class:`ShardingStrategy` (a member or its name).
        cpu_offload: see :class:`CPUOffload`.
        mixed_precision: see :class:`MixedPrecision` (None: everything in the
            model's dtypes).
        units: how parameters are grouped into flat units: a list of lists
            of parameter indices. When None, the model's ``.units()`` is used
            if it has one (lists of indices or of its Parameters, e.g. one per
            layer), else consecutive parameters of one dtype are grouped up to
            ``unit_size_mb`` MiB (a larger parameter is a unit of its own).
            A unit is the granularity of gathering: peak parameter memory in a
            unit-by-unit loop is one unit's full parameters.
        ranks_per_node: node-sharded strategies (HYBRID_SHARD) only: shard over
            blocks of this many consecutive ranks and replicate across blocks.
            When None the node layout comes from ``group.node_info()``.
        unit_size_mb: the default grouping's unit size limit.
        sync_module_states: broadcast every unit from group rank 0 before
            sharding (the default, as DDP does), so all ranks start from rank
            0's values even when their initialisation depends on the rank.
        grad_fn: the gradient callable :meth:`backward` and :meth:`step`
            use, ``grad_fn(param_arrays, *batch)`` returning ``(loss, grads)``
            or a generator of ``(index, grad)`` (the same callable DDP takes).

    Every rank of the group must make the same calls in the same order
    (construction creates sub-groups under HYBRID_SHARD; gather, sync and
    checkpoint calls communicate). :meth:`close` (or a ``with`` block)
    destroys the sub-groups it created.

    Raises:
        CollectiveMismatchError: the ranks wrap different models, or pass
            different strategies, offload, mixed precision, units or
            ranks_per_node (raised on every rank, naming the first rank and
            parameter or argument that differ).
        ValueError: bad units, a ``ranks_per_node`` that does not divide the
            group (or is given to a strategy that does not shard by node),
            mixed array libraries, an unknown strategy or offload name.
    """

    def __init__(self, model: Any, group: ProcessGroup | None = None, *,
                 sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
                 cpu_offload: CPUOffload | str | bool | None = CPUOffload.NONE,
                 mixed_precision: MixedPrecision | None = None,
                 units: Sequence[Sequence[int]] | None = None,
                 ranks_per_node: int | None = None,
                 unit_size_mb: float = DEFAULT_UNIT_BYTES / 2**20,
                 sync_module_states: bool = True, grad_fn: GradFn | None = None) -> None:
        self.module = model
        self.grad_fn = check_grad_fn(grad_fn, "FullyShardedDataParallel")
        self.group = resolve_group(group)
        self.group.backend_for("FullyShardedDataParallel")
        self.sharding_strategy = ShardingStrategy.parse(sharding_strategy)
        self.cpu_offload = CPUOffload.parse(cpu_offload)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(f"FullyShardedDataParallel: mixed_precision must be a MixedPrecision "
                            f"or None, got {type(mixed_precision).__name__}")
        self.mixed_precision = mixed_precision or MixedPrecision()
        self._params = parameters_of(model)
        self._names = param_names(self._params)
        settings = {"sharding_strategy": self.sharding_strategy.name,
                    "cpu_offload": self.cpu_offload.name,
                    "mixed_precision": repr(self.mixed_precision),
                    "units": None if units is None else [[int(i) for i in u] for u in units],
                    "ranks_per_node": ranks_per_node}
        check_same_model(self.group, [(n, tuple(p.shape), str(p.dtype))
                                      for n, p in zip(self._names, self._params)],
                         "FullyShardedDataParallel", settings)
        if not self._params:
            raise ValueError("FullyShardedDataParallel: the model has no parameters")
        check_floating(self._params, self._names)
        self._xp = _array.namespace(*(p.data for p in self._params))
        self._on_device = _array.is_cupy(self._params[0].data)
        self._shapes = [p.shape for p in self._params]
        self._no_sync_depth = 0
        self._optimizer: Any = None
        self._layer_plan: LayerPlan | None = None  # set by from_layers
        self._loss_fn: Any = None
        self.prefetch = True
        self.reshard_after_forward = True
        self._closed = False
        self.shard_group, self.replica_group, self._created_groups = sharding_groups(
            self.group, self.spec, ranks_per_node, self.sharding_strategy.name)
        self._units = self._build_units(self._unit_plan(units, unit_size_mb), sync_module_states)
        self._packs = self._shared_packs()
        self._cast_buffers(model)
        if logger.isEnabledFor(logging.INFO):
            logger.info("%r; estimated per rank: %s", self, self.memory_estimate())

    @classmethod
    def from_layers(cls, layers: Sequence[PipelineStage], group: ProcessGroup | None = None, *,
                    loss_fn: LossFn, prefetch: bool = True, reshard_after_forward: bool = True,
                    **kwargs: Any) -> FullyShardedDataParallel:
        """Wrap a model given as layers, one unit each, for steps that gather one layer at a time.

        :meth:`backward` and :meth:`step` then take ``(x, target)`` and run the
        layers' own callables, like FSDP2's per-module ``fully_shard``: forward
        gathers each layer's unit just before it runs and, with
        ``reshard_after_forward``, drops it right after; ``loss_fn(y, target)``
        gives ``(loss, grad_y)``; backward gathers each unit again, sets its
        gradients and reduce-scatters them before the next layer. With
        ``prefetch`` the next unit's all-gather is started before the current
        layer computes and waited for when that unit is needed (it overlaps where
        the backend moves data in the background, as NCCL does; MPICH on the CPU
        moves it only inside the wait, so there it holds one more unit and saves
        no time). So at most two
        units' full parameters are held (the current one and the prefetched
        one; one without prefetch), against the whole model in the
        ``grad_fn`` step; the price is moving the parameters three times per
        step instead of twice. ``reshard_after_forward=False`` keeps every unit
        from forward to backward: twice the parameters moved, the whole model
        held at the end of forward (FSDP2's ZeRO-2-like setting). Strategies
        that keep parameters (SHARD_GRAD_OP, NO_SHARD) hold them whatever the
        flags. A callable passed first (``step(grad_fn, *batch, ...)``) still
        runs the whole-model ``grad_fn`` step.

        Args:
            layers: ``PipelineStage(forward, backward, params)`` values (see
                :class:`~axondist.pipeline.PipelineStage`), in forward order:
                ``forward(param_arrays, x) -> (y, saved)``, ``backward(param_arrays,
                saved, grad_y) -> (grad_x, param_grads)``. A layer without
                parameters gets no unit. A Parameter belongs to one layer.
            group: the data-parallel group (the current world when None).
            loss_fn: ``loss_fn(y, target) -> (loss, grad_y)`` on the last
                layer's output.
            prefetch: overlap the next unit's all-gather with this layer.
            reshard_after_forward: drop each unit after its forward.
            **kwargs: the constructor's other arguments (not ``units`` or
                ``grad_fn``: the layers decide both).

        Returns:
            The wrapper; its :attr:`module` is the list of layers.

        Raises:
            TypeError: ``layers`` is not a list of layers, ``loss_fn`` is not
                callable, ``units``/``grad_fn`` given, or a flag not a bool.
            ValueError: no layers, no parameters, or a Parameter in two layers.
        """
        where = "FullyShardedDataParallel.from_layers"
        _layers.check_options(where, kwargs, loss_fn, prefetch=prefetch,
                              reshard_after_forward=reshard_after_forward)
        plan, params, units = LayerPlan.of(layers, where)
        fsdp = cls(params, group, units=units, **kwargs)
        fsdp.module = list(plan.layers)
        fsdp._layer_plan, fsdp._loss_fn = plan, loss_fn
        fsdp.prefetch, fsdp.reshard_after_forward = prefetch, reshard_after_forward
        return fsdp

    # --- construction ---------------------------------------------------------------

    def _cast_buffers(self, model: Any) -> None:
        dtype = self.mixed_precision.buffer_dtype
        if dtype is None or not callable(getattr(model, "buffers", None)):
            return
        for b in parameters_of(list(model.buffers())):
            b.data = b.data.astype(dtype)

    # --- introspection --------------------------------------------------------------------

    @property
    def units(self) -> list[FlatUnit]:
        """The flat layout of every unit."""
        return [st.flat for st in self._units]

    @property
    def world_size(self) -> int:
        """Ranks of the wrapper's whole group (sharding and replica ranks together).

        Under HYBRID_SHARD a unit is split over fewer ranks than this: see
        ``shard_group``.
        """
        return self.group.world_size

    @property
    def rank(self) -> int:
        """This rank in the wrapper's whole group (not its shard index under HYBRID_SHARD)."""
        return self.group.rank

    def sharded_parameters(self) -> list[Parameter]:
        """This rank's shard of every unit (1-D master Parameters, in unit order).

        Build the optimizer on these: it then keeps state for the shard only.
        Their ``.grad`` is set by :meth:`sync_gradients`.
        """
        return [st.shard for st in self._units]

    def parameters(self) -> list[Parameter]:
        """The sharded Parameters (so ``SGD(fsdp, lr)`` optimizes the shards)."""
        return self.sharded_parameters()

    def full_parameters(self) -> list[Parameter]:
        """The model's Parameters (full arrays while their unit is gathered)."""
        return list(self._params)

    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        """The model's parameter shapes (a resharded ``Parameter.data`` is 0-size)."""
        return list(self._shapes)

    def parameter_names(self) -> list[str]:
        """The model's parameter names (``param{i}`` for unnamed ones), as in checkpoints."""
        return list(self._names)

    def communication_shard(self, unit: int) -> Any:
        """``unit``'s master shard where collectives expect it (on the GPU in a GPU run,
        a copy when the shard rests on the host; otherwise the shard itself).

        Raises:
            ValueError: ``unit`` is not a unit index.
        """
        return self._to_compute(self._select(unit, "communication_shard")[0].shard.data)

    # --- one-call training ------------------------------------------------------------------

    def backward(self, *batch: Any) -> Any:
        """Compute gradients and reduce them into the shard gradients; return the loss.

        On a wrapper made by :meth:`from_layers`, ``backward(x, target)`` walks
        the layers, one unit gathered at a time (the next one prefetched); see
        there. Otherwise ``grad_fn(param_arrays, *batch)`` (the constructor's) gets the full
        parameter arrays in model order and returns ``(loss, grads)``, one
        gradient per parameter (None for none), or is a generator of
        ``(index, grad)`` pairs returning the loss, as under DDP. A callable
        passed first is used instead for this call: ``backward(grad_fn,
        *batch)``. All units are gathered at once (peak memory: the whole
        model's full parameters, once); gradients are then reduce-scattered
        unit by unit, each unit's full gradients dropped as soon as they are
        reduced: it moves the parameters twice per step where the layered
        step moves them three times, and holds the whole model where that one
        holds one or two units. Inside :meth:`no_sync` the sync only
        accumulates locally.

        Args:
            *batch: passed to ``grad_fn`` after the parameter arrays; under
                :meth:`from_layers`, ``x`` and (optionally) ``target``.

        Returns:
            The loss ``grad_fn`` (or ``loss_fn``) reported (this rank's).

        Raises:
            TypeError: no ``grad_fn``, or it returned something else than
                ``(loss, grads)`` or a generator; a layered wrapper given more
                than ``(x, target)``, or a ``loss_fn`` result that is not a pair.
            ValueError: a wrong number of gradients, or one of the wrong shape.
            RuntimeError: the wrapper is closed.
            UnsupportedDTypeError: a complex gradient.
        """
        where = "FullyShardedDataParallel.backward"
        if self._layer_plan is not None and not (batch and callable(batch[0])
                                             and not hasattr(batch[0], "shape")):
            return self._layered_backward(batch, where)
        grad_fn, batch = split_grad_fn(self.grad_fn, batch, where)
        self.gather_parameters()
        arrays = [p.data for p in self._params]
        try:
            loss, grads = loss_and_gradients(grad_fn(arrays, *batch), len(self._params), where)
        except BaseException:
            self.reshard_parameters()
            raise
        del arrays
        for p, g in zip(self._params, grads):
            p.grad = None if g is None else _array.as_array(g)
        # only the Parameters may hold the gradients, so that each unit's are freed as soon as
        # sync_gradients has reduced them
        del grads, g
        self.reshard_parameters()
        self.sync_gradients()
        return loss

    def _layered_backward(self, batch: tuple[Any, ...], where: str) -> Any:
        plan = self._layer_plan
        assert plan is not None
        if len(batch) not in (1, 2):
            raise TypeError(f"{where}: a wrapper made by from_layers takes backward(x, target) "
                            f"(target may be left out), got {len(batch)} arguments")
        self._select(None, where)  # refuses a closed wrapper
        x, target = batch[0], batch[1] if len(batch) == 2 else None
        return _layers.layered_backward(self, plan, self._loss_fn, x, target,
                                        prefetch=self.prefetch,
                                        reshard_after_forward=self.reshard_after_forward,
                                        where=where)

    def forward(self, x: Any) -> Any:
        """The model's output on ``x``, one layer's unit gathered at a time (no gradients).

        Only for a wrapper made by :meth:`from_layers`. Each unit is gathered
        (the next one prefetched when ``prefetch``) and resharded after its
        layer, so evaluation holds no more than a training step.

        Raises:
            RuntimeError: the wrapper was not made by :meth:`from_layers`.
        """
        where = "FullyShardedDataParallel.forward"
        if self._layer_plan is None:
            raise RuntimeError(f"{where}: only a wrapper made by from_layers(...) knows its "
                               "layers; otherwise gather_parameters() and run the model yourself")
        self._select(None, where)
        y, _ = _layers.forward(self, self._layer_plan, x, prefetch=self.prefetch,
                               reshard_after_forward=True, keep=False, where=where)
        return y

    def step(self, *batch: Any, optimizer: Any, max_norm: float | None = None) -> Any:
        """One training step: :meth:`backward`, optional clipping, ``optimizer.step()``,
        ``optimizer.zero_grad()``.

        Shard gradients accumulated by earlier :meth:`backward` calls are
        included, and are cleared after the step. The older call shape
        ``step(grad_fn, *batch, optimizer=opt)`` works too. On a wrapper made
        by :meth:`from_layers`, ``step(x, target, optimizer=opt)`` holds one
        layer's unit at a time (plus the prefetched next one).

        Args:
            *batch: passed to ``grad_fn`` (a callable first overrides it), or
                ``x, target`` under :meth:`from_layers`.
            optimizer: an optimizer built on :meth:`parameters` (the shards).
            max_norm: clip to this global norm first (:meth:`clip_grad_norm`).

        Returns:
            This rank's loss.

        Raises:
            RuntimeError: called inside :meth:`no_sync`.
            TypeError: ``optimizer`` has no ``step()``/``zero_grad()``.
        """
        check_optimizer(optimizer, "FullyShardedDataParallel.step")
        if self._no_sync_depth:
            raise RuntimeError("FullyShardedDataParallel.step: cannot step inside no_sync(); use "
                               "backward() for the micro-batches, step() for the last one")
        loss = self.backward(*batch)
        if max_norm is not None:
            self.clip_grad_norm(max_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    # --- memory ---------------------------------------------------------------------------------

    def register_optimizer(self, optimizer: Any) -> None:
        """Count ``optimizer``'s state in :meth:`memory_stats` / :meth:`memory_estimate`.

        Raises:
            ValueError: the optimizer updates Parameters that are not this wrapper's shards.
        """
        self.optimizer_units(optimizer, "register_optimizer")
        self._optimizer = optimizer

    def optimizer_units(self, optimizer: Any, where: str = "optimizer_units") -> dict[int, int]:
        """``{index in optimizer.params: unit index}`` for an optimizer built on the shards.

        Raises:
            ValueError: the optimizer updates a Parameter that is not one of the
                shards (``where`` names the calling function in the message).
        """
        unit_of = {id(st.shard): u for u, st in enumerate(self._units)}
        mapping = {}
        for k, p in enumerate(getattr(optimizer, "params", [])):
            if id(p) not in unit_of:
                raise ValueError(f"{where}: the optimizer updates a Parameter that is not one of "
                                 "this wrapper's shards; build it on fsdp.sharded_parameters()")
            mapping[k] = unit_of[id(p)]
        return mapping

    def _stats(self, held: Footprint, reference: int, measured: bool) -> FSDPMemoryStats:
        return FSDPMemoryStats(
            total_params=sum(st.flat.numel for st in self._units), world_size=self._shards,
            sharding_strategy=self.sharding_strategy, param_bytes_per_rank=held.params,
            grad_bytes_per_rank=held.grads, optim_bytes_per_rank=held.optim,
            padding_bytes_per_rank=held.padding, host_bytes_per_rank=held.host,
            no_shard_bytes_per_rank=reference, measured=measured,
            # made with the wrapper, so the estimate knows them as the measure does
            buffer_bytes_per_rank=sum(int(buf.nbytes) for buf in self._packs.values()))

    def memory_estimate(self, optimizer: Any = None) -> FSDPMemoryStats:
        """The exact per-rank bytes held right after ``backward`` and ``optimizer.step()``.

        That is the ZeRO paper's state (parameters, reduced gradients and
        optimizer state all held), computed from this wrapper's units, padding,
        dtypes and strategy spec; :meth:`memory_stats` measured at that point
        gives the same numbers, component by component. Under mixed precision
        the master shard counts as optimizer state, as in the paper.

        Args:
            optimizer: the optimizer whose state to count (default: the
                registered one; Adam's two arrays per element when none).
        """
        model = OptimizerModel.of(optimizer if optimizer is not None else self._optimizer)
        flats = [st.flat for st in self._units]
        held, reference = estimated_footprint(flats, [self._compute_dtype(f) for f in flats],
                                              self.shard_rank, self.spec, model, self.cpu_offload)
        return self._stats(held, reference, measured=False)

    def memory_stats(self, optimizer: Any = None) -> FSDPMemoryStats:
        """MEASURED per-rank bytes: the arrays held right now, each buffer counted once.

        Parameters: every master shard (optimizer state instead under mixed
        precision, as the paper counts the float32 copy), each gathered full
        buffer and the model's ``Parameter.data``. Gradients: shard gradients
        (a view counts the full buffer it keeps alive), the model's ``.grad``
        arrays and no_sync buffers. Optimizer: the state arrays of
        ``optimizer`` (or the registered one). Padding: the padding elements
        inside those arrays. Host bytes: what the offload policy keeps on the
        host. Buffers: the gradient packing buffers a pair of ranks sharing
        memory keeps (made with the wrapper; the estimate counts them too).

        ``no_shard_bytes_per_rank`` (the base of ``memory_savings()``) is what
        NO_SHARD would hold in the same state: every unit's master
        parameters (plus a full low-precision copy of the units gathered now),
        full master gradients for the units with a shard gradient, full-size
        no_sync buffers where they exist, and the optimizer state scaled
        from the shards to the full units.

        Raises:
            ValueError: the optimizer is not built on this wrapper's shards.
        """
        opt = optimizer if optimizer is not None else self._optimizer
        unit_of = None if opt is None else self.optimizer_units(opt, "memory_stats")
        held, reference = measured_footprint(
            self._units, self._params, [self._compute_dtype(st.flat) for st in self._units],
            self.shard_rank, self.cpu_offload, None if opt is None else opt.state, unit_of)
        return self._stats(held, reference, measured=True)

    # --- state dicts and checkpoints (the work is in state_dict.py) -------------------------

    def full_state_dict(self) -> dict[str, Any] | None:
        """``{name: full array}`` (NumPy, master dtype) on group rank 0; None elsewhere.

        Collective: every rank calls it (the shards of the node holding rank 0
        are gathered to it; other nodes of HYBRID_SHARD do nothing).
        """
        return _state_dict.full_state_dict(self)

    def state_dict(self) -> dict[str, Any]:
        """``{name: full array}`` (NumPy, master dtype) on EVERY rank: a collective.

        The same keys and shapes as :meth:`DistributedDataParallel.state_dict`,
        so a state saved under one strategy loads under another. Each unit's
        shards are all-gathered within the shard group (under HYBRID_SHARD
        each node already holds a whole copy). For rank 0 only, use
        :meth:`full_state_dict`.
        """
        return _state_dict.gathered_state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take this rank's shards from ``{name: full array}`` (every rank passes the same).

        The counterpart of :meth:`state_dict` (also loads a DDP state dict).
        No communication; gathered parameters are released and the next
        :meth:`backward` gathers them again.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: a name missing or unknown, or an array of another shape.
        """
        _state_dict.load_state_dict(self, state, "FullyShardedDataParallel.load_state_dict")

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's shards from a full ``{name: array}`` state (every rank passes it).

        Master shards are overwritten in place (an optimizer built on them
        stays valid); gathered full parameters are released, so call
        :meth:`gather_parameters` before the next forward. No communication.

        Raises:
            CheckpointError: a parameter missing from ``state`` or of another shape.
        """
        _state_dict.load_full_state_dict(self, state)

    def sharded_checkpoint_state(self, optimizer: Any = None) -> ShardedState:
        """This rank's part of a sharded checkpoint (see :mod:`axondist.checkpoint`).

        One flat per unit (``unit{u}``) and per optimizer state array
        (``unit{u}.{state}``); only the first replica (node 0 under
        HYBRID_SHARD, rank 0 under NO_SHARD) writes its shards.
        """
        return _state_dict.sharded_checkpoint_state(self, optimizer)

    def load_sharded_checkpoint_state(self, reader: CheckpointReader, optimizer: Any = None,
                                      strict: bool = True) -> None:
        """Fill this rank's shards (and ``optimizer``'s state) from a sharded checkpoint.

        Reads only the element ranges this rank's shards need, whatever world
        size or strategy wrote them. Gathered parameters are released.

        Args:
            reader: the checkpoint.
            optimizer: an optimizer built on the shards (None: parameters only).
            strict: refuse a checkpoint that does not list one of the
                optimizer's parameters; with False its state starts at zeros.

        Raises:
            CheckpointError: a tensor missing or of another shape, no optimizer
                state, or (``strict``) a parameter without an optimizer entry.
        """
        _state_dict.load_sharded_checkpoint_state(self, reader, optimizer, strict)

    # --- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the process groups this wrapper created; it cannot communicate afterwards.

        Under HYBRID_SHARD that is this rank's node group and replica group
        (one-rank ones included); the group passed to the constructor is
        never touched. Collective over the wrapper's group, like the
        construction (every rank closes its wrappers in the same order).
        Idempotent; also the exit of ``with FSDP(...) as f:``. The shards
        stay readable, e.g. by ``memory_stats``.
        """
        created, self._created_groups = self._created_groups, []
        self._closed = True
        for st in self._units:  # gathered buffers go too: nothing can refresh them now
            self._release(st)
        self._packs = {}
        for g in created:
            g.destroy()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def __enter__(self) -> FullyShardedDataParallel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        numel = sum(st.flat.numel for st in self._units)
        return (f"FullyShardedDataParallel({self.sharding_strategy.name}, {len(self._params)} "
                f"parameters ({numel} elements) in {len(self._units)} units, shards over "
                f"{self._shards} of {self.group.world_size} ranks)")


FSDP = FullyShardedDataParallel

__all__ = ["FSDP", "FullyShardedDataParallel"]
