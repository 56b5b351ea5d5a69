"""MixtureOfExperts: a replicated router and feed-forward experts split over a group."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _array
from .._frameworks import framework_of
from .._validate import positive_int, real_number
from ..comm import all_gather, all_reduce_sum
from ..errors import CollectiveMismatchError, InvalidBufferError, UnsupportedDTypeError
from ..parameter import Parameter
from ..process_group import ProcessGroup, resolve_group
from ..tensor_parallel import ACTIVATIONS
from . import router as rt
from .dispatch import (
    DispatchStats,
    combine,
    dispatch,
    expert_capacity,
    pack,
    plan_dispatch,
    unpack,
)
from .experts import EXPERT_TENSORS, LocalExperts, router_weight, store_grad

Array = Any


class MixtureOfExperts:
    """y_t = sum over the top-k experts e of token t of p_te * FFN_e(x_t), experts split
    over a group.

    ``p_t = softmax(x_t Wr^T)`` is the router (``Wr`` ``(E, d_model)``, replicated on
    every rank); ``FFN_e(x) = act(x W1_e^T + b1_e) W2_e^T + b2_e``. Rank r of ``group``
    holds experts ``[r E/W, (r+1) E/W)``. ``forward`` takes this rank's own tokens (any
    number, zero included), sends each (token, expert) row to the expert's rank with one
    all-to-all whose sizes come from exchanged counts (:mod:`.dispatch`), applies the
    experts there, and brings the outputs back with the inverse all-to-all; ``backward``
    runs the same two all-to-alls the other way round.

    Gradients are those of the one loss summed over every rank's tokens (pass each rank
    its part of d(loss)/dy, e.g. divided by the global token count for a mean): an
    expert's gradient sums the rows it processed, then over ``data_group`` (the ranks
    holding the same experts, never across experts); the router's sums over ``group``
    and ``data_group``. So :meth:`full_grads` is the same dense gradient at any group size.

    Auxiliary losses, over the whole batch (every rank of ``group`` and ``data_group``):
    the load-balancing loss ``aux_loss_coeff * E * sum_i f_i P_i`` (``f_i`` the share of
    assignments to expert i, ``P_i`` its mean probability) and the z-loss
    ``z_loss_coeff * mean_t logsumexp(z_t)^2``. ``forward`` sets :attr:`aux_loss` and
    :attr:`z_loss` (add them to the loss you report); ``backward`` adds their gradients.

    Args:
        d_model: width of x and y.
        d_hidden: width of each expert's hidden layer.
        num_experts: E, a multiple of the group size.
        top_k: experts per token.
        group: the expert-parallel group (the current world when None).
        capacity_factor: None for dropless; else each rank sends at most
            ``ceil(T * top_k * capacity_factor / E)`` rows to each expert and drops the rest.
        padded: with a capacity, send exactly that many rows per expert (static sizes).
        data_group: the ranks holding the same experts as this one (a mesh's other axis),
            over which expert and router gradients are also summed; None: no replicas.
        aux_loss_coeff: weight of the load-balancing loss (0: not computed).
        z_loss_coeff: weight of the router z-loss (0: not computed).
        activation: ``"gelu"`` (tanh approximation) or ``"relu"``.
        seed: the router and every expert draw their weights from it
            (:func:`~.experts.expert_weights`), the same whatever the group size.
        dtype: the parameters' (and the computation's) floating dtype.

    Attributes:
        router: Parameter ``(E, d_model)``, replicated.
        experts: this rank's :class:`~.experts.LocalExperts`.
        stats: the last forward's :class:`~.dispatch.DispatchStats` (dropped, bytes moved).
        aux_loss, z_loss: the last forward's auxiliary losses (floats, the same on every rank).

    Raises:
        ValueError: ``num_experts`` not a multiple of the group size, ``top_k`` above it,
            or a bad size, factor or coefficient.
        CollectiveMismatchError: the ranks of the group built different layers.
    """

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, top_k: int = 2,
                 group: ProcessGroup | None = None, *, capacity_factor: float | None = None,
                 padded: bool = False, data_group: ProcessGroup | None = None,
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 activation: str = "gelu", seed: int = 0, dtype: Any = np.float32) -> None:
        what = "MixtureOfExperts"
        self.d_model = positive_int(d_model, what, "d_model")
        self.d_hidden = positive_int(d_hidden, what, "d_hidden")
        self.num_experts = positive_int(num_experts, what, "num_experts")
        self.top_k = positive_int(top_k, what, "top_k")
        self.group = resolve_group(group)
        self.group.backend_for(what)  # a clear error on non-members
        self.data_group = None if data_group is None else resolve_group(data_group)
        w = self.group.world_size
        if self.num_experts % w:
            fits = [n for n in range(w, 4 * w + 1, w)]
            raise ValueError(f"{what}: num_experts={self.num_experts} does not split over the "
                             f"{w} ranks of the group (experts are split contiguously, the same "
                             f"number per rank); use a multiple of {w}, e.g. {fits}")
        if self.top_k > self.num_experts:
            raise ValueError(f"{what}: top_k={self.top_k} is more than num_experts="
                             f"{self.num_experts}; pick top_k <= {self.num_experts}")
        self.capacity_factor = None if capacity_factor is None else real_number(
            capacity_factor, what, "capacity_factor", low=1e-12, meaning="rows per expert "
            "relative to an even split")
        if padded and capacity_factor is None:
            raise ValueError(f"{what}: padded=True needs a capacity_factor (the padded size); "
                             "pass capacity_factor=1.25, say, or padded=False")
        self.padded = bool(padded)
        self.aux_loss_coeff = real_number(aux_loss_coeff, what, "aux_loss_coeff")
        self.z_loss_coeff = real_number(z_loss_coeff, what, "z_loss_coeff")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{what}: activation={activation!r} is not supported; choose one "
                             f"of {sorted(ACTIVATIONS)}")
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise UnsupportedDTypeError(f"{what}: dtype={self.dtype} is not a floating type; "
                                        "pass np.float32 or np.float64")
        self.seed = int(seed)
        self._check_same_everywhere(activation)
        local = self.num_experts // w
        self.router = Parameter(router_weight(self.seed, self.num_experts, self.d_model)
                                .astype(self.dtype), "router.weight")
        self.experts = LocalExperts(self.d_model, self.d_hidden, self.group.rank * local, local,
                                    ACTIVATIONS[activation], self.seed, self.dtype)
        self.stats: DispatchStats | None = None
        self.aux_loss = 0.0
        self.z_loss = 0.0
        self._saved: tuple[Any, ...] | None = None

    def _check_same_everywhere(self, activation: str) -> None:
        mine = (self.d_model, self.d_hidden, self.num_experts, self.top_k, self.capacity_factor,
                self.padded, self.aux_loss_coeff, self.z_loss_coeff, activation, self.seed,
                str(self.dtype))
        every = self.group.backend_for("MixtureOfExperts").allgather_object(mine)
        if any(other != mine for other in every):
            names = ("d_model", "d_hidden", "num_experts", "top_k", "capacity_factor", "padded",
                     "aux_loss_coeff", "z_loss_coeff", "activation", "seed", "dtype")
            field = next(n for i, n in enumerate(names) if any(o[i] != every[0][i]
                                                               for o in every))
            i = names.index(field)
            detail = ", ".join(f"rank {r}: {o[i]!r}" for r, o in enumerate(every))
            raise CollectiveMismatchError(f"MixtureOfExperts: the ranks of the expert group "
                                          f"built different layers: {field} differs ({detail}); "
                                          "construct it with the same arguments on every rank")

    # --- parameters ------------------------------------------------------------------

    @property
    def local_experts(self) -> range:
        """The global indices of the experts this rank holds."""
        return range(self.experts.first, self.experts.first + self.experts.count)

    def parameters(self) -> list[Parameter]:
        """The router's weight, then each local expert's ``w1, b1, w2, b2``."""
        return [self.router] + self.experts.parameters()

    def expert_parameters(self) -> list[Parameter]:
        """The local experts' parameters (reduced over ``data_group`` only)."""
        return self.experts.parameters()

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (``grad = None``)."""
        for p in self.parameters():
            p.zero_grad()

    def _where(self) -> str:
        g = self.group
        return (f"MixtureOfExperts(d_model={self.d_model}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, rank {g.rank} of {g.world_size}, experts "
                f"{self.experts.first}:{self.experts.first + self.experts.count})")

    __repr__ = _where

    # --- forward and backward ----------------------------------------------------------

    def _input(self, x: Any, name: str, call: str) -> Any:
        a = _array.as_array(x)
        if a.ndim != 2 or a.shape[1] != self.d_model:
            raise InvalidBufferError(f"{self._where()}.{call}: {name} of shape {tuple(a.shape)}, "
                                     f"expected (tokens, d_model={self.d_model}); flatten the "
                                     f"batch and sequence axes first: {name}.reshape(-1, "
                                     f"{self.d_model})")
        if a.dtype.kind != "f":
            raise UnsupportedDTypeError(f"{self._where()}.{call}: {name} has dtype {a.dtype}, "
                                        "not floating point; pass float32 or float64 values")
        if _array.namespace(a) is not _array.namespace(self.router.data):
            where = "CuPy (device)" if _array.is_cupy(a) else "NumPy (host)"
            raise InvalidBufferError(f"{self._where()}.{call}: {name} is a {where} array but "
                                     "the parameters are not; call layer.to_device() for CuPy "
                                     "inputs, or pass host arrays")
        return a.astype(self.dtype, copy=False)

    def forward(self, x: Any) -> Any:
        """y ``(T, d_model)`` for this rank's tokens x ``(T, d_model)`` (collective over the
        group, and over ``data_group`` when auxiliary losses are on). A torch tensor or JAX
        array gives one of its framework back."""
        framework = framework_of(x)
        xs = self._input(x, "x", "forward")
        xp = _array.namespace(xs)
        logits = xs @ self.router.data.T
        routing = rt.route(logits, self.top_k)
        totals = self._batch_totals(routing, logits)
        capacity = None if self.capacity_factor is None else expert_capacity(
            xs.shape[0], self.top_k, self.capacity_factor, self.num_experts)
        plan = plan_dispatch(routing.experts, self.num_experts, self.group, capacity=capacity,
                             padded=self.padded, row_bytes=self.d_model * self.dtype.itemsize)
        received = dispatch(pack(xs, plan), plan, self.group)
        outputs = self.experts.forward(received, plan.expert_rows)
        back = unpack(combine(outputs, plan, self.group), plan)  # (T, k, d)
        y = (back * routing.gates[:, :, None]).sum(axis=1) if xs.shape[0] else \
            xp.zeros_like(xs)
        self.stats = plan.stats
        self._saved = (xs, logits, routing, plan, back, totals, framework)
        return y if framework is None else framework.wrap(y, like=x)

    def _batch_totals(self, routing: rt.Routing, logits: Array) -> rt.BalanceTotals | None:
        if not (self.aux_loss_coeff or self.z_loss_coeff):
            self.aux_loss = self.z_loss = 0.0
            return None
        sums = rt.balance_sums(routing, logits, self.num_experts)
        for g in self._token_groups():
            sums = all_reduce_sum(sums, g)
        totals = rt.BalanceTotals.of(sums, self.num_experts)
        self.aux_loss = rt.load_balancing_loss(totals, self.top_k, self.aux_loss_coeff)
        self.z_loss = rt.z_loss(totals, self.z_loss_coeff)
        return totals

    def _token_groups(self) -> list[ProcessGroup]:
        """The groups whose ranks hold other tokens of the batch."""
        return [g for g in (self.group, self.data_group) if g is not None and g.world_size > 1]

    def backward(self, grad_y: Any, accumulate: bool = False) -> Any:
        """d(loss)/dx for this rank's tokens from d(loss)/dy (collective over the group and
        ``data_group``); writes every parameter's ``.grad`` (added to it with
        ``accumulate``), the auxiliary losses' gradients included."""
        if self._saved is None:
            raise RuntimeError(f"{self._where()}.backward: called before forward; run "
                               "forward(x) first (it saves what backward needs)")
        xs, logits, routing, plan, back, totals, framework = self._saved
        gy = self._input(grad_y, "grad_y", "backward")
        if gy.shape[0] != xs.shape[0]:
            raise InvalidBufferError(f"{self._where()}.backward: grad_y has {gy.shape[0]} rows "
                                     f"but forward had {xs.shape[0]} tokens; pass d(loss)/dy "
                                     "of the forward output's shape")
        xp = _array.namespace(gy)
        grad_gates = (back * gy[:, None, :]).sum(axis=-1)  # (T, k); zero where dropped
        to_experts = dispatch(pack(gy, plan, weights=routing.gates), plan, self.group)
        grad_rows, expert_grads = self.experts.backward(to_experts)
        grad_x = unpack(combine(grad_rows, plan, self.group), plan).sum(axis=1)
        grad_probs = None
        if totals is not None and self.aux_loss_coeff:
            per_expert = rt.load_balancing_grad(totals, self.top_k, self.aux_loss_coeff)
            grad_probs = xp.broadcast_to(xp.asarray(per_expert, dtype=self.dtype),
                                         routing.probs.shape)
        grad_logits = rt.route_backward(routing, grad_gates, grad_probs)
        if totals is not None and self.z_loss_coeff:
            grad_logits = grad_logits + rt.z_loss_grad(logits, routing.probs, totals.tokens,
                                                       self.z_loss_coeff)
        grad_x = grad_x + grad_logits @ self.router.data
        grad_router = xp.ascontiguousarray(grad_logits.T @ xs)
        self._reduce_and_store(grad_router, expert_grads, accumulate)
        return grad_x if framework is None else framework.wrap(grad_x, like=grad_y)

    def _reduce_and_store(self, grad_router: Array, expert_grads: list[Array],
                          accumulate: bool) -> None:
        """Router: summed over the group, then (with the experts' in one buffer) over
        ``data_group``; the experts' never over the group (each rank's are different
        experts)."""
        if self.group.world_size > 1:
            grad_router = all_reduce_sum(grad_router, self.group)
        grads = [grad_router, *expert_grads]
        if self.data_group is not None and self.data_group.world_size > 1:
            flat, layout = _array.flatten(grads, dtype=self.dtype)
            grads = _array.unflatten(all_reduce_sum(flat, self.data_group), layout)
        for p, g in zip(self.parameters(), grads):
            store_grad(p, g, accumulate)

    # --- dense views -------------------------------------------------------------------

    def _dense(self, grads: bool) -> dict[str, Array]:
        if grads and self.router.grad is None:
            raise RuntimeError(f"{self._where()}.full_grads: router.weight has no gradient; "
                               "run backward first")
        router = _array.as_array(self.router.grad if grads else self.router.data)
        out = {"router": router.copy()}
        for name in EXPERT_TENSORS:
            out[name] = all_gather(self.experts.stacked(name, grads), self.group)
        return out

    def full_weights(self) -> dict[str, Array]:
        """``{"router": (E, d), "w1": (E, h, d), "b1": (E, h), "w2": (E, d, h), "b2": (E, d)}``,
        dense, the same on every rank (collective over the group)."""
        return self._dense(grads=False)

    def full_grads(self) -> dict[str, Array]:
        """The gradients of :meth:`full_weights`' arrays, dense, on every rank (collective).

        Raises:
            RuntimeError: backward has not run.
        """
        return self._dense(grads=True)

    def to_device(self, device: int | None = None) -> MixtureOfExperts:
        """Move the parameters to a CUDA device as CuPy arrays (for CuPy inputs); returns
        the layer. Gradients are dropped."""
        for p in self.parameters():
            p.data = _array.to_device(p.data, device)
            p.grad = None
        return self


__all__ = ["MixtureOfExperts"]
