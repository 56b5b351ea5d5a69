"""Distributed data parallelism: every rank holds the whole model, gradients are averaged.

:class:`DistributedDataParallel` (:mod:`~axondist.ddp.wrapper`; its parameter broadcast and
gradient step in ``_replicas.py``) is built from a
:class:`GradientSynchronizer` (:mod:`~axondist.ddp.synchronizer`: when buckets are
all-reduced), its buckets (:mod:`~axondist.ddp.buckets`: which gradients share one, and the
flat buffer), OVERLAPPED's persistent pieces (:mod:`~axondist.ddp.pieces`) and the hook that
sums a bucket (:mod:`~axondist.ddp.compression`).
"""

from .buckets import DEFAULT_BUCKET_CAP_MB, GradientBucket, bucket_plan
from .compression import CastCompression, ReductionHook, resolve_compression, sum_hook
from .synchronizer import GradientSynchronizer, GradSyncStrategy
from .wrapper import DDP, DistributedDataParallel

__all__ = [
    "DDP",
    "DEFAULT_BUCKET_CAP_MB",
    "CastCompression",
    "DistributedDataParallel",
    "GradSyncStrategy",
    "GradientBucket",
    "GradientSynchronizer",
    "ReductionHook",
    "bucket_plan",
    "resolve_compression",
    "sum_hook",
]
