"""What keeps DDP's replicas equal: rank 0's parameters and buffers broadcast to every rank,
and each step's gradients averaged in two calls (``start_grad_sync``, then
``finish_grad_sync``, with ``add_gradient`` between them).

:class:`ReplicaSync` is the base of :class:`~axondist.ddp.DistributedDataParallel`, whose
constructor sets the attributes declared here; the buckets themselves are the
:class:`~axondist.ddp.synchronizer.GradientSynchronizer`'s.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _array
from .._frameworks import framework_of
from ..comm import all_gather, broadcast
from ..errors import CollectiveMismatchError
from ..parameter import Parameter
from ..process_group import ProcessGroup
from .buckets import MiB, bucket_plan
from .synchronizer import GradientSynchronizer, GradSyncStrategy, check_gradient


class ReplicaSync:
    """Parameter and buffer broadcasts and the gradient step of a data-parallel wrapper.

    The attributes are set by :class:`~axondist.ddp.DistributedDataParallel`'s constructor.
    """

    process_group: ProcessGroup
    synchronizer: GradientSynchronizer
    strategy: GradSyncStrategy
    bucket_cap_mb: float
    broadcast_buffers: bool
    gradient_as_bucket_view: bool
    missing_grad: str
    buffers: list[Any]
    _params: list[Parameter]
    _no_sync_depth: int
    _in_step: bool
    _handed: dict[int, Any]
    _unsynced: bool

    # --- parameters and buffers ------------------------------------------------------
    def _broadcast_arrays(self, arrays: Sequence[Any], where: str) -> None:
        for a in arrays:
            _array.check_writable(a, f"DistributedDataParallel.{where}")
        by_dtype: dict[str, list[int]] = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(str(a.dtype), []).append(i)
        root = self.process_group.rank == 0
        cap = bytes_of_mib(self.bucket_cap_mb)
        for idx in by_dtype.values():
            for chunk in bucket_plan([arrays[i].nbytes for i in idx], cap):
                group_arrays = [arrays[idx[k]] for k in chunk]
                xp = _array.namespace(*group_arrays)
                layout = _array.FlatLayout.of((a.shape for a in group_arrays),
                                              group_arrays[0].dtype)
                flat = xp.empty(layout.numel, dtype=layout.dtype)
                if root:
                    layout.pack(group_arrays, out=flat)
                broadcast(flat, self.process_group, src=0)
                if not root:
                    for a, view in zip(group_arrays, layout.views(flat)):
                        a[...] = view

    # --- gradient synchronization ----------------------------------------------------------
    @property
    def syncing(self) -> bool:
        """False inside :meth:`no_sync` or with strategy NO_SYNC (steps stay local)."""
        return self._no_sync_depth == 0 and self.strategy is not GradSyncStrategy.NO_SYNC

    def start_grad_sync(self, num_samples: float | None = None) -> None:
        """Begin a step: broadcast buffers (when asked) and open the buckets.

        Gradients are then handed over with :meth:`add_gradient` and the step
        ends with :meth:`finish_grad_sync`. Outside a synchronized step
        (inside :meth:`no_sync`) this does nothing.

        Args:
            num_samples: this rank's sample count, to weight its gradients by
                ``num_samples / sum over ranks`` (the exact full-batch mean when
                gradients are per-rank means); every rank passes one, or none.
        """
        if self._in_step:
            raise RuntimeError("DistributedDataParallel.start_grad_sync: a step is already in "
                               "progress; call finish_grad_sync() first")
        _check_num_samples(num_samples)
        self._in_step = True
        if not self.syncing:
            self._unsynced = True
            return
        try:
            if self.broadcast_buffers and self.buffers:
                self._broadcast_arrays(self.buffers, "start_grad_sync")
            self.synchronizer.start(self.process_group, num_samples)
        except BaseException:
            self._in_step = False
            raise

    def add_gradient(self, index: int, grad: Any) -> None:
        """Accumulate ``grad`` into parameter ``index``'s ``.grad`` and hand it to its bucket.

        ``.grad`` becomes ``grad`` when it was None (written into the bucket
        view with ``gradient_as_bucket_view``), else ``.grad += grad``. In a
        synchronized step the result goes to the synchronizer, which issues the
        bucket's all-reduce once the bucket is complete (OVERLAPPED).
        """
        if not self._in_step:
            raise RuntimeError("DistributedDataParallel.add_gradient: call start_grad_sync() "
                               "first")
        if not isinstance(index, (int, np.integer)) or not 0 <= index < len(self._params):
            raise IndexError(f"DistributedDataParallel.add_gradient: parameter index {index!r} "
                             f"is out of range 0..{len(self._params) - 1}")
        p = self._params[index]
        handed = grad
        grad = grad if type(grad) is np.ndarray else _array.as_array(grad)
        check_gradient(grad, "DistributedDataParallel.add_gradient", index, p.name)
        if tuple(grad.shape) != p.shape:
            raise ValueError(f"DistributedDataParallel.add_gradient: gradient of parameter "
                             f"{index} ({p.name or 'unnamed'}) has shape {tuple(grad.shape)}, the "
                             f"parameter has {p.shape}")
        if p.grad is None and self.gradient_as_bucket_view:
            slot = self.synchronizer.slot(index)
            if self.syncing:
                self.synchronizer.add_gradient(index, grad)  # one copy, weighted on the way
            else:
                slot[...] = grad
            p.grad = slot
            if self.syncing and handed is not grad:  # a torch tensor or JAX array
                self._handed[index] = handed  # the torch tensor gets the average too
            return
        if self.syncing and p.grad is self.synchronizer.slot(index):
            # .grad is its bucket view: add and weight in one pass over memory.
            self.synchronizer.accumulate(index, grad)
            return
        if p.grad is None:
            p.grad = grad.copy()
        else:
            p.grad += grad
        if self.syncing:
            self.synchronizer.add_gradient(index, p.grad)

    def finish_grad_sync(self) -> None:
        """Wait for every bucket and write the averages into ``.grad``.

        Raises:
            CollectiveMismatchError: ``missing_grad="error"`` and the ranks
                disagree on which parameters have gradients.
        """
        if not self._in_step:
            raise RuntimeError("DistributedDataParallel.finish_grad_sync: no step in progress")
        self._in_step = False
        if not self.syncing:
            return
        self._unsynced = False
        for i in self.synchronizer.missing():
            if self._params[i].grad is not None:
                # .grad set but never handed over (user-managed flow): take it now.
                self.synchronizer.add_gradient(i, self._params[i].grad)
        present = np.array([p.grad is not None for p in self._params], dtype=np.int8)
        handed, self._handed = self._handed, {}
        for i, p in enumerate(self._params):
            if p.grad is not None and type(p.grad) is not np.ndarray and framework_of(p.grad):
                handed[i] = p.grad
        averaged = self.synchronizer.finish()
        keep_none: set[int] = set()
        if self.missing_grad == "error":
            keep_none = self._check_presence(present)
        for i, (p, avg) in enumerate(zip(self._params, averaged)):
            if i in keep_none:
                continue
            if i in handed:
                _average_into_handed(p, handed[i], avg)
            elif self.gradient_as_bucket_view:
                p.grad = avg
            elif p.grad is not None and _writable_like(p.grad, avg):
                # a torch .grad is written through its view, so it stays the user's tensor
                (p.grad if type(p.grad) is np.ndarray else _array.as_array(p.grad))[...] = avg
            else:
                p.grad = avg.copy()

    def _check_presence(self, present: Any) -> set[int]:
        """All-gather the presence masks; raise on disagreement; return all-missing indices."""
        group = self.process_group
        world = group.world_size
        mine = group.backend_for("DistributedDataParallel.sync_gradients").metadata_buffer(present)
        masks = _array.to_host(all_gather(mine, group)).reshape(world, -1)
        counts = masks.sum(axis=0)
        split = [i for i in range(len(self._params)) if 0 < counts[i] < world]
        if split:
            parts = []
            for i in split[:5]:
                lacking = [r for r in range(world) if not masks[r, i]]
                name = self._params[i].name or "unnamed"
                parts.append(f"parameter {i} ({name}) has no gradient on ranks {lacking}")
            more = f" and {len(split) - 5} more" if len(split) > 5 else ""
            raise CollectiveMismatchError(
                "DistributedDataParallel.sync_gradients: ranks disagree on which parameters have "
                f"gradients: {'; '.join(parts)}{more}. Give every rank a gradient (zeros for an "
                "unused parameter) or use missing_grad='zeros'")
        return {i for i in range(len(self._params)) if counts[i] == 0}

    def sync_gradients(self, num_samples: float | None = None) -> None:
        """Average every parameter's ``.grad`` over the group and write it back.

        Gradients are handed to the buckets in reverse parameter order.
        Inside :meth:`no_sync` (or with strategy NO_SYNC) nothing happens.

        Args:
            num_samples: this rank's sample count for a sample-weighted average
                ``sum(n_i * g_i) / sum(n_i)`` (see :meth:`start_grad_sync`);
                None (the default) for the plain mean.

        Raises:
            TypeError: ``num_samples`` is not None or a number (a list of
                gradients belongs to :func:`axondist.sync_gradients`).
            UnsupportedDTypeError: a ``.grad`` is complex or not numeric (checked
                before the step communicates anything).
        """
        if self.syncing:  # refuse a bad .grad before the step communicates anything
            where = "DistributedDataParallel.sync_gradients"
            for i, p in enumerate(self._params):
                g = p.grad
                if g is not None:
                    check_gradient(g if type(g) is np.ndarray else _array.as_array(g), where, i,
                                   p.name)
        self.start_grad_sync(num_samples)
        if self.syncing:
            try:
                for i in reversed(range(len(self._params))):
                    g = self._params[i].grad
                    if g is not None:
                        self.synchronizer.add_gradient(i, g)
            except BaseException:
                self._abandon()
                raise
        self.finish_grad_sync()

    def _abandon(self) -> None:
        """Leave a failed step: wait for what is in flight, close the step."""
        self._in_step = False
        self._handed.clear()
        self.synchronizer.clear()


def _check_num_samples(num_samples: Any) -> None:
    """Refuse a ``num_samples`` that is not None or a real number >= 0."""
    if num_samples is None:
        return
    what = "DistributedDataParallel.sync_gradients: num_samples"
    if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Real):
        hint = ("; to average a list of arrays, call axondist.sync_gradients(grads)"
                if isinstance(num_samples, (list, tuple)) else "")
        raise TypeError(f"{what} must be None or this rank's sample count (a number >= 0), "
                        f"got {type(num_samples).__name__} {num_samples!r}{hint}")
    if not float(num_samples) >= 0:  # also refuses NaN
        raise ValueError(f"{what} must be a sample count >= 0, got {num_samples!r}")


def bytes_of_mib(mb: float) -> int:
    """Whole bytes for a cap in MiB (at least 1: a tiny cap means one array per bucket)."""
    return max(1, int(mb * MiB))


def _average_into_handed(p: Parameter, handed: Any, avg: Any) -> None:
    """Give the torch tensor or JAX array the user handed over as ``p``'s gradient the
    average ``avg``: a torch tensor is written in place (and stays ``p.grad`` when it was),
    a JAX array, immutable, is replaced by a new one. Whatever the bucket setting, the
    object a torch optimizer or the user reads next holds the average, not the local
    gradient."""
    framework = framework_of(handed)
    assert framework is not None
    if framework.writable and _writable_like(handed, avg):
        framework.array_to_write(handed, "DistributedDataParallel")[...] = avg
        # .grad stays (or becomes) the tensor, unless it is the bucket view, which holds it too
        p.grad = avg if type(p.grad) is np.ndarray else handed
        return
    if p.grad is handed:
        p.grad = framework.wrap(avg.copy(), handed)  # a copy: the bucket is reused
    else:
        p.grad = avg


def _writable_like(dst: Any, src: Any) -> bool:
    """Whether the averaged ``src`` can be copied into ``dst`` in place (a torch tensor
    through its view; a JAX array never: it is immutable)."""
    dst = dst if type(dst) is np.ndarray else _array.as_array(dst)
    try:
        _array.check_writable(dst, "DistributedDataParallel")
    except ValueError:
        return False
    return tuple(dst.shape) == tuple(src.shape) and _array.namespace(dst) is _array.namespace(src)


__all__ = ["ReplicaSync", "bytes_of_mib"]
