"""Gradient clipping over tensor-parallel layers, by the norm of the whole dense model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import clip


def clip_grad_norm(layers: Sequence[Any], max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> float:
    """Clip the gradients of tensor-parallel ``layers`` by their global norm; return the norm.

    The norm is the full model's: every shard counts once (each rank holds a
    different one) and a replicated gradient (RowParallelLinear's bias) once,
    not once per rank. NaN and inf propagate as in
    ``torch.nn.utils.clip_grad_norm_``; every rank gets the same norm. The layers
    must share one group. Combine with data parallelism by clipping after the
    data-parallel average.

    Raises:
        NonFiniteNormError: the norm is NaN or inf and ``error_if_nonfinite`` (on
            every rank; nothing is scaled).
        ValueError: no layers, layers on different groups, or a bad ``max_norm``
            or ``norm_type``.
    """
    layers = list(layers)
    if not layers:
        raise ValueError("tensor_parallel.clip_grad_norm: pass at least one layer")
    group = layers[0].group
    if any(layer.group is not group for layer in layers):
        raise ValueError("tensor_parallel.clip_grad_norm: the layers are split over different "
                         "groups; clip each group's layers in their own call")
    counted, every = [], []
    for layer in layers:
        replicated = {id(p) for p in layer.replicated_parameters()}
        for param in layer.parameters():
            if param.grad is None:
                continue
            every.append(param.grad)
            if id(param) not in replicated or group.rank == 0:
                counted.append(param.grad)
    return clip.clip_grad_norm(every, max_norm, norm_type, error_if_nonfinite, group=group,
                               counted=counted, where="tensor_parallel.clip_grad_norm")


__all__ = ["clip_grad_norm"]
