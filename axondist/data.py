"""Splitting a data set's indices between the ranks of a data-parallel group.

:class:`DistributedSampler` gives each rank its own list of sample indices
per epoch, the same length on every rank, so every rank runs the same number
of steps (a rank with one batch more would wait forever in the gradient
all-reduce of the step the others never take).

The shuffle of an epoch depends only on ``(seed, epoch)``, never on the rank
or the group size, so every rank computes the same permutation without
communicating and picks its share: positions ``rank, rank + n, rank + 2n, ...``
of the (padded or truncated) permutation, as ``torch.utils.data.DistributedSampler``
does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import numpy as np

from .process_group import ProcessGroup, resolve_group


class DistributedSampler:
    """The sample indices one rank visits in an epoch.

    With ``n`` ranks and a data set of ``L`` samples:

    * ``drop_last=False`` (default): every rank gets ``ceil(L / n)`` indices.
      The epoch's permutation is padded to ``n * ceil(L / n)`` entries by
      repeating it from its start, so every index is seen at least once per
      epoch and the ``n * ceil(L / n) - L`` padded ones are seen twice (their
      samples weigh double in that epoch's gradients).
    * ``drop_last=True``: every rank gets ``L // n`` indices and the last
      ``L % n`` entries of the permutation are dropped (a different set each
      epoch when shuffling); no index is seen twice.

    Args:
        dataset_len: the number of samples ``L`` (an int, or any object with
            ``len()``).
        num_replicas: the number of ranks sharing the data ``n``; by default
            the size of ``group``.
        rank: this rank's index in ``0 .. n - 1``; by default its rank in
            ``group``.
        shuffle: visit the indices in a random order that changes with
            :meth:`set_epoch`; otherwise in order ``0, 1, 2, ...``.
        seed: the shuffle's seed; it must be the same on every rank.
        drop_last: drop the tail instead of padding (see above).
        group: the data-parallel group ``num_replicas`` and ``rank`` default
            from (the current world when None). Not used when both are given,
            so a sampler can be built without any world.

    Raises:
        TypeError: ``seed`` is not an int.
        ValueError: a negative ``dataset_len`` or ``seed``, ``num_replicas < 1``
            or a ``rank`` outside ``0 .. num_replicas - 1``.

    Example::

        sampler = DistributedSampler(len(xs), group=dp_group, seed=1)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)          # a new shuffle, same on every rank
            idx = sampler.indices()
            for start in range(0, len(idx), batch):
                step(xs[idx[start:start + batch]])
    """

    def __init__(self, dataset_len: int | Sized, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, *, group: ProcessGroup | None = None) -> None:
        if isinstance(dataset_len, (int, np.integer)) and not isinstance(dataset_len, bool):
            length = int(dataset_len)
        elif hasattr(dataset_len, "__len__"):
            length = len(dataset_len)
        else:
            raise TypeError(f"DistributedSampler: dataset_len must be an int or a sized data set, "
                            f"got {type(dataset_len).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"DistributedSampler: seed must be an int (the same on every rank, "
                            f"e.g. seed=0), got {type(seed).__name__} {seed!r}")
        if seed < 0:
            raise ValueError(f"DistributedSampler: seed must be an int >= 0, got {seed!r}")
        if length < 0:
            raise ValueError(f"DistributedSampler: dataset_len must be a length >= 0, got "
                             f"{dataset_len!r}")
        if num_replicas is None or rank is None:
            g = resolve_group(group)
            if num_replicas is None:
                num_replicas = g.world_size
            if rank is None:
                if not g.is_member:
                    raise ValueError("DistributedSampler: this process is not a member of the "
                                     f"group of ranks {list(g.ranks)}; pass rank= explicitly")
                rank = g.rank
        if (not isinstance(num_replicas, (int, np.integer)) or isinstance(num_replicas, bool)
                or num_replicas < 1):
            raise ValueError(f"DistributedSampler: num_replicas must be an int >= 1, got "
                             f"{num_replicas!r}")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
            raise ValueError(f"DistributedSampler: rank={rank!r} is not in 0..{num_replicas - 1} "
                             f"(num_replicas={num_replicas})")
        self.dataset_len = int(length)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0

    @property
    def num_samples(self) -> int:
        """Indices per rank and epoch (the same on every rank)."""
        if self.drop_last:
            return self.dataset_len // self.num_replicas
        return -(-self.dataset_len // self.num_replicas)

    @property
    def total_size(self) -> int:
        """Indices per epoch over all ranks: ``num_samples * num_replicas``."""
        return self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` from now on; call it with the same value on every rank
        before each epoch (without it every epoch repeats epoch 0's order)."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"DistributedSampler.set_epoch: epoch must be an int >= 0, got "
                             f"{epoch!r}")
        self.epoch = int(epoch)

    def epoch_order(self) -> np.ndarray:
        """The whole epoch's order before it is split: ``total_size`` indices, every rank's.

        Rank r's indices are ``epoch_order()[r::num_replicas]``.
        """
        if self.shuffle:
            # Seeded by (seed, epoch) only, so every rank draws the same permutation.
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.dataset_len)
        else:
            order = np.arange(self.dataset_len)
        total = self.total_size
        if total <= order.size:
            return order[:total]
        # Pad by repeating from the start (np.resize tiles when the padding exceeds L).
        return np.resize(order, total)

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch, as an int64 array of ``len(self)``."""
        return self.epoch_order()[self.rank::self.num_replicas].astype(np.int64, copy=False)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"DistributedSampler(dataset_len={self.dataset_len}, rank={self.rank} of "
                f"{self.num_replicas}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last}, epoch={self.epoch})")


__all__ = ["DistributedSampler"]
