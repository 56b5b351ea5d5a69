"""FSDP's gradient calls: reduce full gradients into shard gradients, accumulate, clip.

:class:`GradientSync` adds them to :class:`~axondist.fsdp._gather.UnitState`;
:class:`~axondist.fsdp.FullyShardedDataParallel` inherits both. What each
strategy does with a unit's gradients (reduce-scatter, all-reduce, both) is
read from its :class:`~axondist.fsdp.ShardingSpec`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _array, clip, comm
from .._validate import check_real_gradient
from ..ops import ReduceOp
from ._gather import UnitState, _Unit
from .memory import owner


class GradientSync(UnitState):
    """Gradient reduction, no_sync accumulation, zero_grad and clipping over the units."""

    _names: list[str]
    _shapes: list[tuple[int, ...]]
    _no_sync_depth: int
    #: The shared pack buffers, by reduce dtype (:meth:`_shared_packs`).
    _packs: dict[np.dtype, Any]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communicating, until the block ends.

        Inside the block :meth:`sync_gradients` adds each unit's full
        gradients into a full-size, unsharded accumulation buffer (in the
        master dtype) and clears ``.grad``: no reduce-scatter, but a full
        gradient copy per unit stays in memory. The first ``sync_gradients``
        after the block reduces the buffer together with the gradients then
        set. Without ``no_sync``, every sync reduce-scatters and adds into the
        shard gradient, so accumulation keeps only sharded gradients.
        """
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def _flat_grads(self, st: _Unit, where: str) -> list[Any] | None:
        grads = [self._params[i].grad for i in st.flat.param_indices]
        if all(g is None for g in grads):
            return None
        # a torch tensor or JAX array set as .grad is read through its NumPy/CuPy view
        grads = [g if g is None or type(g) is np.ndarray else _array.as_array(g) for g in grads]
        for i, g in zip(st.flat.param_indices, grads):
            if g is not None:
                check_real_gradient(g, where, i, self._names[i])
            if g is not None and tuple(g.shape) != self._shapes[i]:
                raise ValueError(f"{where}: parameter {self._names[i]!r} has shape "
                                 f"{self._shapes[i]} but its .grad has shape {tuple(g.shape)}")
        return grads

    def sync_gradients(self, unit: int | None = None) -> None:
        """Reduce the model's full gradients into the shard gradients (averaged over ranks).

        For each selected unit whose parameters have a ``.grad`` (a missing
        one counts as zeros; a unit with none is skipped, so every rank must
        set gradients for the same units): flatten in the reduce dtype,
        reduce-scatter (FULL_SHARD, SHARD_GRAD_OP), all-reduce (NO_SHARD), or
        both (HYBRID_SHARD: within the node, then across nodes), cast to the
        master dtype and ADD into ``shard.grad`` (set when None). The full
        gradients are then dropped (``.grad = None``). Inside :meth:`no_sync`
        no communication happens (see there).
        """
        for st in self._select(unit, "sync_gradients"):
            grads = self._flat_grads(st, "sync_gradients")
            if self._no_sync_depth:
                if grads is not None:
                    self._accumulate_locally(st, grads)
            elif grads is not None or st.accum is not None:
                self._reduce_unit(st, grads)
            for i in st.flat.param_indices:
                self._params[i].grad = None

    def _accumulate_locally(self, st: _Unit, grads: list[Any]) -> None:
        flat = st.flat
        if st.accum is None:
            xp = np if (self.cpu_offload.offloads_accumulation or not self._on_device) else self._xp
            st.accum = xp.zeros(flat.numel, dtype=flat.dtype)
        on_host = not _array.is_cupy(st.accum)
        for view, g in zip(flat.layout.views(st.accum), grads):
            if g is not None:
                view += _array.to_host(g) if on_host else self._to_compute(g)

    def _shared_packs(self) -> dict[np.dtype, Any]:
        """The buffers gradients are packed into for a reduce-scatter the shard group's
        backend does without moving them (one per reduce dtype, the largest unit's size,
        from ``Backend.shared_buffer``: two MPI ranks of one host, a unit large enough),
        made once, with the wrapper, and counted in :meth:`memory_stats`; empty where the
        group cannot, or the strategy does not reduce-scatter. Smaller units packed there
        take the ordinary path. The same on every rank."""
        if self.shard_group is None or not self.spec.gradients:
            return {}
        sizes: dict[np.dtype, int] = {}
        for st in self._units:
            rdt = np.dtype(self.mixed_precision.communication_dtype(st.flat.dtype))
            if self._packed_scale(rdt) is not None:
                sizes[rdt] = max(sizes.get(rdt, 0), st.flat.padded_numel)
        backend = self.shard_group.backend_for("FullyShardedDataParallel")
        made = {rdt: backend.shared_buffer(n, rdt, "reduce_scatter") for rdt, n in sizes.items()}
        return {rdt: buf for rdt, buf in made.items() if buf is not None}

    def _reduce_unit(self, st: _Unit, grads: list[Any] | None) -> None:
        flat = st.flat
        rdt = self.mixed_precision.communication_dtype(flat.dtype)
        shared = self._packs.get(np.dtype(rdt))
        buf = (shared[:flat.padded_numel] if shared is not None
               else self._xp.empty(flat.padded_numel, dtype=rdt))
        buf[flat.numel:] = 0  # padding
        scale = self._packed_scale(rdt)
        for k, view in enumerate(flat.layout.views(buf[:flat.numel])):
            g = grads[k] if grads is not None else None
            if g is None:
                view[...] = 0
            elif scale is None:
                view[...] = g
            else:
                np.multiply(g, scale, out=view, casting="unsafe")
        if st.accum is not None:
            low = self._to_compute(st.accum).astype(rdt)
            if scale is not None:
                low *= scale
            buf[:flat.numel] += low
            st.accum = None
        op = ReduceOp.AVERAGE if scale is None else ReduceOp.SUM
        keep_full = self.shard_group is not None and not self.spec.gradients
        if self.shard_group is None:
            part = buf
        elif keep_full:
            part = comm.all_reduce(buf, op, self.shard_group)
        elif shared is not None:  # packed scaled: the sum is the average
            part = self.shard_group.backend_for("sync_gradients").scaled_reduce_scatter_blocking(
                buf)
        else:
            part = comm.reduce_scatter(buf, op, self.shard_group)
        del buf
        if self.replica_group is not None:
            comm.all_reduce(part, ReduceOp.AVERAGE, self.replica_group)
        if keep_full:
            self._keep_full_gradient(st, part)
            return
        part = self._to_rest(part.astype(flat.dtype, copy=part.dtype != flat.dtype))
        if st.shard.grad is None:
            st.shard.grad = part
        else:
            st.shard.grad += part

    def _packed_scale(self, reduce_dtype: Any) -> float | None:
        """``1 / shards`` when the shard group's average is taken by scaling each rank's
        gradients as they are packed, then summing (None: the collective averages).

        Only for NumPy buffers of float32/float64 over a power-of-two group: scaling by
        ``1 / 2**k`` is exact, so the result equals the collective's average bit for bit
        (unless a scaled value falls into the subnormal range, or the unscaled sum would
        have overflowed), and the packing pass that already happens replaces the
        collective's own scaling pass.
        """
        n = self._shards
        if (n == 1 or n & (n - 1) or self._xp is not np
                or reduce_dtype not in (np.float32, np.float64)):
            return None
        return 1.0 / n

    def _keep_full_gradient(self, st: _Unit, full: Any) -> None:
        """Unsharded gradients (SHARD_OPTIMIZER): keep the full average, hand the shard a view.

        The shard gradient is a view of the full padded average in the master
        dtype, so accumulating into it (or clipping it) acts on the full
        buffer it keeps alive; dropping it (``zero_grad``) frees that buffer.
        """
        flat = st.flat
        full = self._to_rest(full.astype(flat.dtype, copy=full.dtype != flat.dtype))
        lo, hi = flat.shard_bounds(self.shard_rank)
        held = st.shard.grad
        base = owner(held) if held is not None else None
        if held is None:
            st.shard.grad = full[lo:hi]
        elif base is not held and getattr(base, "size", -1) == flat.padded_numel:
            base += full
        else:  # the user replaced the view: accumulate into the shard only
            held += full[lo:hi]

    def zero_grad(self) -> None:
        """Drop shard gradients, the model's full gradients and no_sync buffers."""
        for st in self._units:
            st.shard.grad = None
            st.accum = None
        for p in self._params:
            p.grad = None

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0,
                       error_if_nonfinite: bool = False) -> float:
        """Scale the shard gradients so their global norm is at most ``max_norm``.

        The norm is that of the whole model's averaged gradient, padding
        excluded: each shard group rank's local sum of ``|g|**p`` is summed
        over the shard group (the node under HYBRID_SHARD; replicas hold the
        same values), and under NO_SHARD the local norm is the global one.
        When the norm exceeds ``max_norm`` every shard gradient is multiplied
        by ``max_norm / (norm + 1e-6)``. Non-finite values behave as in
        ``torch.nn.utils.clip_grad_norm_``: a NaN anywhere makes the norm NaN
        and every gradient NaN; an inf makes the norm inf and scales by 0.
        Call it after :meth:`sync_gradients`.

        Args:
            max_norm: the largest norm allowed.
            norm_type: p (> 0) or ``math.inf``.
            error_if_nonfinite: raise instead of scaling by a NaN or inf norm.

        Returns:
            The norm before clipping (the same float on every rank).

        Raises:
            RuntimeError: gradients are still pending in a no_sync buffer, or the
                norm is not finite and ``error_if_nonfinite`` is set (on every rank;
                a :class:`~axondist.errors.NonFiniteNormError`).
            TypeError: ``max_norm`` is not a number.
            ValueError: ``max_norm`` is not > 0, or ``norm_type`` is not > 0 or inf.
        """
        where = "FullyShardedDataParallel.clip_grad_norm"
        if any(st.accum is not None for st in self._units):
            raise RuntimeError(f"{where}: gradients accumulated under no_sync() are not "
                               "reduced yet; call sync_gradients() outside no_sync() first")
        pieces, grads = [], []
        for st in self._units:
            g = st.shard.grad
            if g is None:
                continue
            start, _ = st.flat.shard_bounds(self.shard_rank)
            lo, hi = st.flat.valid_bounds(self.shard_rank)
            pieces.append(g[lo - start:hi - start])
            grads.append(g)
        return clip.clip_grad_norm(grads, max_norm, norm_type, error_if_nonfinite,
                                   group=self.shard_group, counted=pieces, where=where)


__all__ = ["GradientSync"]
