"""Distributed data parallelism: every rank holds the whole model, gradients are averaged.

Each rank computes gradients on its own part of the batch; :class:`DistributedDataParallel`
averages them over the group, so an optimizer step on every rank applies the
same update and the replicas stay identical. The averaging runs through
persistent flat buckets (see :mod:`axondist.ddp.synchronizer`): a few large
all-reduces instead of one per parameter, optionally overlapped with the
computation of the remaining gradients.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import _array, clip
from .._step import GradFn, check_grad_fn, check_optimizer, split_grad_fn
from .._validate import check_state_names, mib, positive_number
from ..comm import all_gather_object
from ..errors import CollectiveMismatchError
from ..parameter import Parameter, parameters_of
from ..process_group import ProcessGroup, resolve_group
from ._replicas import ReplicaSync, bytes_of_mib
from .buckets import DEFAULT_BUCKET_CAP_MB, MiB
from .compression import ReductionHook
from .synchronizer import GradientSynchronizer, GradSyncStrategy

ForwardFn = Callable[..., Any]

_MISSING_MODES = ("zeros", "error")

logger = logging.getLogger("axondist.ddp")


class DistributedDataParallel(ReplicaSync):
    """Wrap a model so that its gradients are averaged over a process group.

    Options are Python keyword arguments rather than a builder chain: write
    ``DDP(model, group, broadcast_buffers=False)``; there is no
    ``.broadcast_buffers(False)`` method.

    A training step is either

    * ``loss = ddp.backward(*batch)`` — runs ``grad_fn`` on this rank's batch,
      accumulates its gradients into ``.grad`` and averages them; or
    * the user sets every ``p.grad`` and calls ``ddp.sync_gradients()``;

    then ``opt.step()`` on every rank; or ``ddp.step(*batch, optimizer=opt)``
    in one call. :meth:`close` (or the end of ``with DDP(...) as ddp:``) frees
    what the OVERLAPPED strategy sets up on the group. These,
    :meth:`clip_grad_norm`, :meth:`no_sync`, :meth:`summon_full_params` and
    :meth:`state_dict` are the calls FSDP offers too, so switching wrapper
    changes no other line. The constructor broadcasts group rank 0's
    parameters to every rank (``init_sync=True``), as torch DDP does.

    Gradient functions. ``grad_fn(params, *batch)`` receives the parameters'
    arrays (``[p.data for p in ddp.parameters()]``) and either

    * returns ``(loss, grads)``, ``grads`` a list in parameter order whose
      entries may be None (no gradient for that parameter); or
    * is a generator that yields ``(index, grad)`` pairs as each gradient
      becomes ready (typically last parameter first, as backward makes them)
      and ends with ``return loss``. Under
      :attr:`GradSyncStrategy.OVERLAPPED` a bucket's all-reduce starts as
      soon as its last gradient is yielded, while the generator computes the
      rest. Each index may be yielded once per call.

    Bucket views (``gradient_as_bucket_view=True``). After a synchronized step
    every ``p.grad`` is a view into a persistent bucket buffer holding the
    average. A gradient written into that array in place
    (``p.grad[...] = g``, ``p.grad += g``, or ``opt.zero_grad(set_to_none=False)``
    followed by accumulation) is already in its bucket and the next step
    sends it without a packing copy; a gradient assigned as a new array is
    copied in. With False, buckets are private and the averages are copied
    back into the ``.grad`` arrays.

    Missing gradients (``p.grad is None`` at a synchronized step, or an index
    a generator never yields). With ``missing_grad="zeros"`` they count as
    zeros: the rank still takes part and the average includes its zero
    contribution, and afterwards every rank has a ``.grad`` for the
    parameter. With ``"error"`` the ranks compare which parameters have
    gradients (a small all-gather of a presence mask per step); when they
    disagree every rank raises :class:`~axondist.CollectiveMismatchError`
    naming the parameters and ranks; parameters no rank has a gradient for
    keep ``grad=None``.

    Buffers (arrays that are not trained, e.g. running statistics): with
    ``broadcast_buffers=True`` they are broadcast from group rank 0 by
    :meth:`sync_parameters` and at the start of every synchronized step
    (:meth:`start_grad_sync`, so before ``grad_fn`` runs in :meth:`backward`);
    with False they are left alone.

    Args:
        model: the model (anything :func:`~axondist.parameters_of` accepts).
        group: the data-parallel group (the current world when None).
        bucket_cap_mb: MiB per gradient bucket; None: :data:`DEFAULT_BUCKET_CAP_MB`
            (25, as torch DDP). Under OVERLAPPED, ``python -m axondist tune`` picks
            the smallest bucket that still moves data near the links' bandwidth
            (less left to reduce after the last gradient); pass its pick
            explicitly, e.g. ``**tuned_ddp_options(group)`` from
            :mod:`axondist.tune`. A synchronous step only gains from fewer,
            bigger buckets.
        piece_bytes: bytes per piece of an OVERLAPPED bucket's persistent
            all-reduce (``synchronizer.piece_bytes``); None: the synchronizer's
            default (4 MiB). ``tune`` picks one too (see ``bucket_cap_mb``).
        first_bucket_mb: MiB of the first bucket of each dtype (1, as torch
            DDP): the first all-reduce starts after the first few gradients.
        broadcast_buffers: broadcast ``buffers`` at every synchronized step.
        gradient_as_bucket_view: make ``.grad`` views into the buckets (above).
        strategy: when buckets are reduced (see :class:`GradSyncStrategy`);
            NO_SYNC makes every step local (see also :meth:`no_sync`).
        grad_fn: the gradient callable used by :meth:`backward`.
        forward_fn: ``forward_fn(params, *inputs)`` used by :meth:`forward`;
            when None, ``model.forward(*inputs)``.
        compression: None, ``"fp16"``, ``"bf16"`` (all-reduce float32/64
            buckets in 16 bits; see :class:`~axondist.ddp.compression.CastCompression`
            for the accuracy cost) or a
            :class:`~axondist.ddp.compression.ReductionHook`.
        buffers: arrays or Parameters to keep equal to rank 0's.
        missing_grad: ``"zeros"`` or ``"error"`` (above).
        init_sync: call :meth:`sync_parameters` in the constructor.

    Raises:
        CollectiveMismatchError: the ranks' models differ in parameter count,
            shapes or dtypes (checked in the constructor on every rank).
        TypeError: a parameter is not floating point.
    """

    def __init__(self, model: Any, group: ProcessGroup | None = None, *,
                 bucket_cap_mb: float | None = None, piece_bytes: int | None = None,
                 first_bucket_mb: float = 1.0,
                 broadcast_buffers: bool = True, gradient_as_bucket_view: bool = True,
                 strategy: GradSyncStrategy | str = GradSyncStrategy.SYNCHRONOUS,
                 grad_fn: GradFn | None = None, forward_fn: ForwardFn | None = None,
                 compression: str | ReductionHook | None = None,
                 buffers: Sequence[Any] | None = None, missing_grad: str = "zeros",
                 init_sync: bool = True) -> None:
        self.module = model
        self._params = parameters_of(model)
        self.process_group = resolve_group(group)
        strategy = GradSyncStrategy.parse(strategy)
        if bucket_cap_mb is None:
            bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
        bucket_cap_mb = positive_number(bucket_cap_mb, "DistributedDataParallel",
                                        "bucket_cap_mb (MiB per bucket, e.g. 25)")
        if piece_bytes is not None:
            piece_bytes = max(1, round(positive_number(
                piece_bytes, "DistributedDataParallel",
                "piece_bytes (bytes per OVERLAPPED piece, e.g. 4 MiB: 4194304)")))
        first_bucket_mb = positive_number(first_bucket_mb, "DistributedDataParallel",
                                          "first_bucket_mb (MiB, e.g. 1)")
        if missing_grad not in _MISSING_MODES:
            raise ValueError(f"DistributedDataParallel: missing_grad={missing_grad!r}; use one "
                             f"of {_MISSING_MODES}")
        for i, p in enumerate(self._params):
            if not _array.is_floating(p.dtype):
                raise TypeError(f"DistributedDataParallel: parameter {i} ({p.name or 'unnamed'}) "
                                f"is {p.dtype}; only floating-point parameters can be trained")
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.first_bucket_mb = float(first_bucket_mb)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.strategy = strategy
        self.grad_fn = check_grad_fn(grad_fn, "DistributedDataParallel")
        self.forward_fn = forward_fn
        self.missing_grad = missing_grad
        self.buffers: list[Any] = [b.data if isinstance(b, Parameter) else _array.as_array(b)
                                   for b in (buffers or [])]
        self._no_sync_depth = 0
        self._in_step = False
        #: torch tensors and JAX arrays handed over as gradients this step, by index: the
        #: user's own objects, which hold the average after the step (see finish_grad_sync).
        self._handed: dict[int, Any] = {}
        self._check_same_model()
        self.synchronizer = GradientSynchronizer(
            self.strategy, bucket_bytes=bytes_of_mib(self.bucket_cap_mb),
            first_bucket_bytes=bytes_of_mib(self.first_bucket_mb), compression=compression,
            group=self.process_group)
        if piece_bytes is not None:
            self.synchronizer.piece_bytes = piece_bytes
        self.synchronizer.prepare(self._params)
        self._unsynced = False  # .grad holds local sums made inside no_sync()
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s", self.bucket_plan_text())
        if init_sync:
            self.sync_parameters()

    # --- the model -----------------------------------------------------------------------
    def parameters(self) -> list[Parameter]:
        """The wrapped model's Parameters, in order (what to give the optimizer)."""
        return list(self._params)

    @property
    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices of each gradient bucket, in communication order."""
        return self.synchronizer.plan

    def bucket_plan_text(self) -> str:
        """The bucket plan in words, as the constructor logs it at INFO on ``axondist.ddp``:
        per bucket, in communication order, its parameters, dtype and size."""
        parts = [f"{self!r}: cap {self.bucket_cap_mb:g} MiB (first {self.first_bucket_mb:g} "
                 f"MiB), strategy {self.strategy.name}"]
        for b, state in enumerate(self.synchronizer.buckets):
            names = [self._params[i].name or f"param{i}" for i in state.indices]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4
                                             else "")
            dtype = np.dtype(state.bucket.dtype)
            parts.append(f"bucket {b}: {len(names)} parameters ({shown}), {dtype}, "
                         f"{_size_text(state.bucket.capacity * dtype.itemsize)}")
        return "; ".join(parts)

    def forward(self, *inputs: Any) -> Any:
        """Run the model: ``forward_fn([p.data ...], *inputs)`` when given, else
        ``module.forward(*inputs)``.

        Raises:
            TypeError: neither a ``forward_fn`` nor a model with ``forward``.
        """
        if self.forward_fn is not None:
            return self.forward_fn([p.data for p in self._params], *inputs)
        forward = getattr(self.module, "forward", None)
        if not callable(forward):
            raise TypeError("DistributedDataParallel.forward: pass forward_fn=... or wrap a model "
                            f"with a forward method ({type(self.module).__name__} has none)")
        return forward(*inputs)

    __call__ = forward

    def _check_same_model(self) -> None:
        """Every rank must wrap parameters of the same shapes and dtypes."""
        mine = tuple((p.shape, str(p.dtype)) for p in self._params)
        theirs = all_gather_object(mine, self.process_group)
        for r, other in enumerate(theirs):
            if other == mine:
                continue
            if len(other) != len(mine):
                detail = f"{len(other)} parameters on rank {r}, {len(mine)} here"
            else:
                k = next(i for i, (a, b) in enumerate(zip(other, mine)) if a != b)
                detail = (f"parameter {k} is {other[k][1]}{list(other[k][0])} on rank {r}, "
                          f"{mine[k][1]}{list(mine[k][0])} on rank {self.process_group.rank}")
            raise CollectiveMismatchError(
                f"DistributedDataParallel: the ranks' models differ ({detail}); every rank "
                "must wrap the same parameter shapes and dtypes, in the same order")

    # --- parameters and buffers ----------------------------------------------------------
    def sync_parameters(self) -> None:
        """Copy group rank 0's parameters (and, with ``broadcast_buffers``, buffers) into
        every rank's, in place.

        Arrays are coalesced per dtype into flat buffers of at most
        ``bucket_cap_mb`` MiB, one broadcast each.
        """
        self._broadcast_arrays([p.data for p in self._params], "sync_parameters")
        if self.buffers and self.broadcast_buffers:
            self._broadcast_arrays(self.buffers, "sync_parameters")

    # --- gradient synchronization (the step's calls are ReplicaSync's) -----------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[DistributedDataParallel]:
        """Steps inside the block do not communicate; gradients accumulate locally.

        :meth:`backward` adds each micro-batch's gradients into ``.grad``, and
        the first synchronized step after the block averages the accumulated
        sums (so with k equal micro-batches of mean-loss gradients the result
        is k times the big batch's mean gradient; scale the loss or lr by 1/k).
        """
        self._no_sync_depth += 1
        try:
            yield self
        finally:
            self._no_sync_depth -= 1

    def backward(self, *batch: Any, num_samples: float | None = None) -> Any:
        """Compute this rank's gradients with ``grad_fn`` and average them (one step).

        Like ``loss.backward()`` under torch DDP: gradients accumulate into
        ``.grad`` (call ``opt.zero_grad()`` between steps) and are averaged
        over the group unless inside :meth:`no_sync`. The same call works on
        every wrapper (FSDP, DDP with a ZeroRedundancyOptimizer). A callable
        passed first is used instead of the constructor's ``grad_fn`` for this
        call: ``backward(grad_fn, *batch)``.

        Args:
            *batch: passed to ``grad_fn(params, *batch)``.
            num_samples: this rank's sample count for a sample-weighted average.

        Returns:
            The loss ``grad_fn`` reported (this rank's, not averaged).

        Raises:
            TypeError: no ``grad_fn`` was given, or it returned something else
                than ``(loss, grads)`` or a generator.
            UnsupportedDTypeError: a gradient is complex.
        """
        grad_fn, batch = split_grad_fn(self.grad_fn, batch, "DistributedDataParallel.backward")
        self.start_grad_sync(num_samples)
        try:
            loss = self._run_grad_fn(grad_fn, batch)
        except BaseException:
            self._abandon()
            raise
        self.finish_grad_sync()
        return loss

    def step(self, *batch: Any, optimizer: Any, max_norm: float | None = None,
             num_samples: float | None = None) -> Any:
        """One training step: :meth:`backward`, optional clipping, ``optimizer.step()``,
        ``optimizer.zero_grad()``.

        Gradients accumulated by earlier :meth:`backward` calls inside
        :meth:`no_sync` are included. ``optimizer`` may be a plain optimizer
        or a :class:`~axondist.ZeroRedundancyOptimizer` built on
        :meth:`parameters`.

        Args:
            *batch: passed to ``grad_fn`` (a callable first overrides it, as in
                :meth:`backward`).
            optimizer: what updates the parameters.
            max_norm: clip the averaged gradients to this global norm first
                (see :meth:`clip_grad_norm`); None: no clipping.
            num_samples: this rank's sample count for a sample-weighted average.

        Returns:
            This rank's loss.

        Raises:
            RuntimeError: called inside :meth:`no_sync` (use :meth:`backward`
                for the micro-batches and ``step`` for the last one).
            TypeError: ``optimizer`` has no ``step()``/``zero_grad()``.
        """
        check_optimizer(optimizer, "DistributedDataParallel.step")
        if self._no_sync_depth:
            raise RuntimeError("DistributedDataParallel.step: cannot step inside no_sync(); use "
                               "backward() for the micro-batches, step() for the last one")
        loss = self.backward(*batch, num_samples=num_samples)
        if max_norm is not None:
            self.clip_grad_norm(max_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0,
                       error_if_nonfinite: bool = False) -> float:
        """Scale every ``.grad`` so that the gradient's global norm is at most ``max_norm``.

        Call it after a synchronized step: the gradients are then the
        group's average, the same on every rank, so the norm of all
        parameters' gradients together is the global one and every rank
        computes the same float without communicating. Non-finite values
        behave as in ``torch.nn.utils.clip_grad_norm_``: a NaN makes the
        norm NaN and every gradient NaN; an inf makes the norm inf and scales
        by 0. Parameters without a gradient are skipped.

        Args:
            max_norm: the largest norm allowed (> 0).
            norm_type: p (> 0) or ``math.inf``.
            error_if_nonfinite: raise instead of scaling by a NaN or inf norm.

        Returns:
            The norm before clipping.

        Raises:
            RuntimeError: the gradients are local sums from :meth:`no_sync`
                not averaged yet.
            NonFiniteNormError: the norm is NaN or inf and ``error_if_nonfinite``.
            TypeError: ``max_norm`` is not a number.
            ValueError: ``max_norm`` is not > 0, or ``norm_type`` is not > 0 or inf.
        """
        where = "DistributedDataParallel.clip_grad_norm"
        if self._unsynced or self._no_sync_depth:
            raise RuntimeError(f"{where}: the gradients are local sums from no_sync(), not "
                               "averaged yet; clip after the first backward() outside no_sync()")
        grads = [q.grad for q in self._params if q.grad is not None]
        return clip.clip_grad_norm(grads, max_norm, norm_type, error_if_nonfinite, where=where)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every ``.grad`` (``None``, or zeros in place with False, keeping bucket views)."""
        for p in self._params:
            p.zero_grad(set_to_none)
        self._unsynced = False

    # --- the same surface as FSDP ------------------------------------------------------------
    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[list[Parameter]]:
        """Yield the model's Parameters; every rank already holds them in full.

        Does nothing else: it exists so that evaluation code written for
        FSDP (``with model.summon_full_params(): ...``) runs under DDP as is.
        """
        yield self.parameters()

    def state_dict(self) -> dict[str, Any]:
        """``{name: copy of the parameter}`` (``param{i}`` for unnamed ones), on every rank.

        The same keys and full shapes as
        :meth:`FullyShardedDataParallel.state_dict`, so a state saved under
        one strategy loads under another. No communication.

        Raises:
            ValueError: two parameters share a name.
        """
        return {name: p.data.copy() for name, p in zip(self._param_names(), self._params)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy ``{name: array}`` into the parameters, in place (every rank passes the same).

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: a parameter missing from ``state``, a name that is not a
                parameter's, or an array of another shape.
        """
        where = "DistributedDataParallel.load_state_dict"
        names = self._param_names()
        check_state_names(state, names, where)
        for name, p in zip(names, self._params):
            value = state[name]
            if tuple(np.shape(value)) != p.shape:
                raise ValueError(f"{where}: {name!r} has shape {tuple(np.shape(value))}, the "
                                 f"parameter has {p.shape}")
        for name, p in zip(names, self._params):
            xp = _array.namespace(p.data)
            p.data[...] = xp.asarray(state[name])

    def _param_names(self) -> list[str]:
        names = [p.name or f"param{i}" for i, p in enumerate(self._params)]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"DistributedDataParallel.state_dict: two parameters are named "
                             f"{dup!r}; name them uniquely (state dicts key arrays by name)")
        return names

    def _run_grad_fn(self, grad_fn: GradFn, batch: tuple[Any, ...]) -> Any:
        result = grad_fn([p.data for p in self._params], *batch)
        if inspect.isgenerator(result):
            seen: set[int] = set()
            while True:
                try:
                    item = next(result)
                except StopIteration as stop:
                    return stop.value
                index, grad = _pair(item)
                if index in seen:
                    raise ValueError(f"DistributedDataParallel.backward: grad_fn yielded "
                                     f"parameter {index} twice in one call")
                seen.add(index)
                self.add_gradient(index, grad)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError("DistributedDataParallel.backward: grad_fn must return (loss, grads) "
                            f"or be a generator of (index, grad); got {type(result).__name__}")
        loss, grads = result
        grads = list(grads)
        if len(grads) != len(self._params):
            raise ValueError(f"DistributedDataParallel.backward: grad_fn returned {len(grads)} "
                             f"gradients for {len(self._params)} parameters")
        for i in reversed(range(len(grads))):
            if grads[i] is not None:
                self.add_gradient(i, grads[i])
        return loss

    def close(self) -> None:
        """Release what gradient synchronization holds on the group: under MPI, the
        persistent all-reduce requests of OVERLAPPED buckets (they keep the group's
        communicator alive). Idempotent; every rank calls it, before destroying the
        group. The wrapper stays usable: a later step sets them up again.
        """
        self._in_step = False
        self.synchronizer.close()

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DistributedDataParallel({len(self._params)} parameters, "
                f"{len(self.synchronizer.buckets)} buckets, {self.strategy.name}, "
                f"group of {self.process_group.world_size})")


def _size_text(nbytes: int) -> str:
    """``nbytes`` as text: bytes below 1 KiB, KiB below 1 MiB, else MiB."""
    if nbytes < 1024:
        return f"{nbytes} B"
    return f"{nbytes / 1024:.3g} KiB" if nbytes < MiB else mib(nbytes)


def _pair(item: Any) -> tuple[int, Any]:
    try:
        index, grad = item
    except (TypeError, ValueError):
        raise TypeError("DistributedDataParallel.backward: a generator grad_fn must yield "
                        f"(index, grad) pairs, got {type(item).__name__}") from None
    return int(index), grad


#: Short alias (torch's ``DDP``).
DDP = DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel"]
