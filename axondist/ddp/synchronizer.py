"""Gradient synchronization through buckets: :class:`GradSyncStrategy` (when buckets are
all-reduced) and :class:`GradientSynchronizer`, a fixed set of flat buckets for a model's
gradients (added by index, each bucket's all-reduce issued, asynchronously under
:attr:`GradSyncStrategy.OVERLAPPED`, and awaited by :meth:`GradientSynchronizer.finish`),
which :class:`~axondist.ddp.DistributedDataParallel` is built from. Each bucket is
multiplied in place by this rank's weight (``1 / world_size``, or ``n_i / sum(n)`` for a
sample-weighted average) before the ranks' buckets are *summed*: the one pass a mean needs
anyway, which keeps float16 values in range and folds into the packing copy. The bucket
plan and buffer live in :mod:`axondist.ddp.buckets`, the reduction hooks in
:mod:`axondist.ddp.compression`, the persistent pieces in :mod:`axondist.ddp.pieces`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from math import prod
from typing import Any

import numpy as np

from .. import _array
from .._validate import check_real_gradient
from ..backends.base import Backend, CompletedWork, PersistentAllReduce, Work
from ..comm import all_reduce
from ..errors import UnsupportedDTypeError
from ..ops import ReduceOp
from ..parameter import Parameter
from ..process_group import ProcessGroup, peek_world, resolve_group
from .buckets import GradientBucket, MiB, bucket_plan
from .compression import ReductionHook, resolve_compression, sum_hook
from .pieces import PersistentPieces


def check_gradient(grad: Any, where: str, index: int, name: str | None = None) -> None:
    """Refuse a gradient that cannot be averaged into a floating-point bucket: a complex
    one, or one whose dtype is not a number (object, string, datetime...).

    Raises:
        UnsupportedDTypeError: naming ``where``, the parameter and the dtype.
    """
    if grad.dtype.kind in "fiub":  # the common case, checked once per gradient and step
        return
    dtype = np.dtype(grad.dtype)
    check_real_gradient(grad, where, index, name)
    if not _array.is_floating(dtype):
        label = f"parameter {index}" + (f" ({name})" if name else "")
        raise UnsupportedDTypeError(
            f"{where}: the gradient of {label} has dtype {dtype}; a gradient must be an "
            "array of real numbers (floating point, or integers that are cast). Convert it "
            "first, e.g. np.asarray(grad, dtype=np.float32)")


class GradSyncStrategy(enum.Enum):
    """When gradient buckets are all-reduced."""

    #: every bucket is all-reduced, one blocking call after another, at finish().
    SYNCHRONOUS = "synchronous"
    #: a bucket's all-reduce is issued as soon as all its gradients were added,
    #: overlapping communication with the computation of the remaining gradients;
    #: finish() waits for every bucket. With the default hook each bucket's
    #: all-reduce is persistent (set up on the first step; under MPI, MPI-4 persistent
    #: collectives) and cut into pieces (GradientSynchronizer.piece_bytes), each started,
    #: in bucket order, once its own gradients are in and weighted just before it leaves
    #: (in a checked MPI group of two on one host, each bucket of a plain mean is instead a
    #: blocking mean once its gradients are in, summed and halved in one pass).
    OVERLAPPED = "overlapped"
    #: no communication: gradients stay local (e.g. to accumulate over several
    #: micro-batches before one synchronized step).
    NO_SYNC = "no_sync"

    @classmethod
    def parse(cls, value: GradSyncStrategy | str) -> GradSyncStrategy:
        """Accept a member or its name (``"overlapped"``, ``"OVERLAPPED"``)."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(m.name for m in cls)
            raise ValueError(f"unknown gradient sync strategy {value!r}; use one of {valid}") \
                from None


# --- the synchronizer ------------------------------------------------------------------------

class _Slot:
    __slots__ = ("bucket", "ready", "view", "weighted")

    def __init__(self, bucket: int, view: Any) -> None:
        self.bucket, self.view = bucket, view
        self.ready = False
        #: the slot already holds its gradient times this rank's weight
        self.weighted = False


class _BucketState:
    __slots__ = ("bucket", "cursor", "flat", "indices", "launched", "layout",
                 "pending", "persistent", "ready_elems", "weigh_from", "work")

    def __init__(self, bucket: GradientBucket, indices: list[int],
                 layout: list[tuple[int, int, int]]) -> None:
        self.bucket, self.indices = bucket, indices
        #: per slot, in buffer order: (first element, end, gradient index)
        self.layout = layout
        #: position in ``layout`` of the first slot not ready yet (this step)
        self.cursor = 0
        #: elements from the buffer's start whose slots are all ready (this step)
        self.ready_elems = 0
        #: position in ``layout`` of the first slot the next piece to start may weight
        self.weigh_from = 0
        #: the bucket's used part, one array object for its lifetime (hooks may
        #: key per-bucket scratch memory on it)
        self.flat = bucket.data
        self.pending = len(indices)
        self.work: Work | None = None
        self.launched = False
        #: the bucket's persistent all-reduce (OVERLAPPED, default hook), made once per group
        self.persistent: PersistentAllReduce | None = None


def _describe_item(item: Any) -> tuple[tuple[int, ...], np.dtype, Any]:
    """(shape, dtype, an array for the namespace or None) of a Parameter, array or shape."""
    if isinstance(item, Parameter):
        return item.shape, np.dtype(item.dtype), item.data
    if hasattr(item, "shape") and hasattr(item, "dtype"):
        return tuple(item.shape), np.dtype(item.dtype), item
    return tuple(int(d) for d in item), None, None  # type: ignore[return-value]


class GradientSynchronizer(PersistentPieces):
    """Averages a fixed list of gradients over a group through persistent buckets.

    Gradients are identified by index (their parameter's position). After
    :meth:`prepare`, one step is::

        sync.start(group, num_samples=None)   # optional; sync_all/add_gradient imply it
        sync.add_gradient(i, grad)            # any order; copies into i's slot
        grads = sync.finish()                 # averaged, as views of the buckets

    or ``sync_all(group)`` once all gradients were added. Buckets group
    gradients of one dtype in reverse index order (the order a backward pass
    makes them), sized by :func:`bucket_plan`. Under
    :attr:`GradSyncStrategy.OVERLAPPED` a bucket's all-reduce is issued as
    soon as its last gradient arrives (with the default hook: each of its
    pieces, of :attr:`piece_bytes`, as soon as the gradients that piece holds
    arrived), but always in bucket order (a complete bucket or piece waits for
    the ones before it), so every rank issues the same collectives in the same
    order whatever order its gradients come in.
    Gradients never added in a step count as zeros.

    Args:
        strategy: see :class:`GradSyncStrategy`.
        bucket_size: elements per bucket (of each gradient's own dtype, a count
            rather than bytes); ignored when ``bucket_bytes`` is given.
        first_bucket_size: elements in the first bucket of each dtype
            (``bucket_size`` when None).
        bucket_bytes / first_bucket_bytes: the same caps in bytes (what DDP
            passes), overriding the element counts.
        compression: None, ``"fp16"``, ``"bf16"`` or a :class:`ReductionHook`.
        group: the group used when a step does not name one.
    """

    def __init__(self, strategy: GradSyncStrategy | str = GradSyncStrategy.SYNCHRONOUS,
                 bucket_size: int = 25 * MiB // 4, *, first_bucket_size: int | None = None,
                 bucket_bytes: int | None = None, first_bucket_bytes: int | None = None,
                 compression: str | ReductionHook | None = None,
                 group: ProcessGroup | None = None) -> None:
        self.strategy = GradSyncStrategy.parse(strategy)
        for name, value in (("bucket_size", bucket_size), ("first_bucket_size", first_bucket_size),
                            ("bucket_bytes", bucket_bytes),
                            ("first_bucket_bytes", first_bucket_bytes)):
            if value is not None and value <= 0:
                raise ValueError(f"GradientSynchronizer: {name} must be > 0, got {value}")
        self.bucket_size = int(bucket_size)
        self.first_bucket_size = first_bucket_size
        self.bucket_bytes = bucket_bytes
        self.first_bucket_bytes = first_bucket_bytes
        self.hook = resolve_compression(compression)
        self.group = group
        self.buckets: list[_BucketState] = []
        self.slots: list[_Slot] = []
        #: gradients copied into their slot in the current/last step (0 when
        #: every gradient already was its bucket view).
        self.copies = 0
        self._active = False
        self._group: ProcessGroup | None = None
        self._factor = 1.0
        self._count: Any = None
        self._count_work: Work | None = None
        self._num_samples: float | None = None
        self._next_launch = 0
        self._oldest_in_flight = 0
        self._init_pieces()

    # --- layout ----------------------------------------------------------------------------
    def _caps(self, dtype: np.dtype) -> tuple[int, int]:
        if self.bucket_bytes is not None:
            cap = int(self.bucket_bytes)
        else:
            cap = self.bucket_size * dtype.itemsize
        if self.first_bucket_bytes is not None:
            first = int(self.first_bucket_bytes)
        elif self.first_bucket_size is not None:
            first = int(self.first_bucket_size) * dtype.itemsize
        else:
            first = cap
        return cap, first

    def prepare(self, shapes_or_params: Sequence[Any], *, dtype: Any = np.float32,
                like: Any = None) -> list[list[int]]:
        """Plan the buckets and allocate their buffers (once; reused every step).

        Args:
            shapes_or_params: per gradient, a Parameter, an array (its shape,
                dtype and namespace are used) or a shape.
            dtype: the dtype of gradients given as bare shapes.
            like: an array whose namespace buffers of bare shapes take.

        Returns:
            The buckets, in communication order, as lists of gradient indices.
        """
        self._wait_pending()
        self._free_persistent()
        items = [_describe_item(x) for x in shapes_or_params]
        by_dtype: dict[np.dtype, list[int]] = {}
        for i in reversed(range(len(items))):
            shape, dt, _ = items[i]
            dt = np.dtype(dtype) if dt is None else dt
            if not _array.is_floating(dt):
                raise TypeError(f"GradientSynchronizer.prepare: gradient {i} has dtype {dt}; "
                                "only floating-point gradients can be averaged")
            items[i] = (shape, dt, items[i][2])
            by_dtype.setdefault(dt, []).append(i)
        planned: list[list[int]] = []
        for dt, order in by_dtype.items():
            cap, first = self._caps(dt)
            sizes = [prod(items[i][0]) * dt.itemsize for i in order]
            planned += [[order[k] for k in b] for b in bucket_plan(sizes, cap, first)]
        # Communication order: by when a backward pass (reverse index order) starts a bucket.
        planned.sort(key=lambda b: -b[0])
        self.slots = [None] * len(items)  # type: ignore[list-item]
        self.buckets = []
        backend = self._sharing_backend()
        for b, indices in enumerate(planned):
            dt = items[indices[0]][1]
            source = next((items[i][2] for i in indices if items[i][2] is not None), like)
            count = sum(prod(items[i][0]) for i in indices)
            shared = (backend.shared_buffer(count, dt) if backend is not None
                      and (source is None or type(source) is np.ndarray) else None)
            bucket = GradientBucket(count, dt, like=source, buffer=shared)
            layout = []
            for i in indices:
                offset = bucket.size
                self.slots[i] = _Slot(b, bucket.reserve(items[i][0], like=source))
                layout.append((offset, bucket.size, i))
            self.buckets.append(_BucketState(bucket, indices, layout))
        self._active = False
        return [list(s.indices) for s in self.buckets]

    def _sharing_backend(self) -> Backend | None:
        """The backend of the group this synchronizer names (or the world already started)
        when it may put buckets in memory both ranks map (see ``Backend.shared_buffer``):
        a strategy that synchronizes, the default hook (no compression). The same on every
        rank. Under OVERLAPPED a shared bucket is summed as soon as its last gradient is in,
        before backward goes on: the ranks' own cores do the sum, so there is no transfer
        to hide behind the rest of backward."""
        if self.strategy is GradSyncStrategy.NO_SYNC or self.hook is not sum_hook:
            return None
        group = self.group if self.group is not None else peek_world()
        if group is None or not group.is_member:
            return None
        return group.backend_for("GradientSynchronizer")

    @property
    def plan(self) -> list[list[int]]:
        """The buckets, in communication order, as lists of gradient indices."""
        return [list(s.indices) for s in self.buckets]

    def slot(self, index: int) -> Any:
        """Gradient ``index``'s view into its bucket (the array DDP hands out as ``.grad``)."""
        self._check_index(index, "slot")
        return self.slots[index].view

    def _open_slot(self, index: int, what: str, hint: str = "") -> _Slot:
        """Gradient ``index``'s slot, once it is known to be still open in this step (which
        starts here if it had not).

        Raises:
            ValueError: a bad index, or the gradient was already added this step.
        """
        self._check_index(index, what)
        if not self._active:
            self.start()
        slot = self.slots[index]
        if slot.ready:
            raise ValueError(f"GradientSynchronizer.{what}: gradient {index} was already "
                             f"added in this step{hint}")
        return slot

    def _check_index(self, index: int, where: str) -> None:
        if not self.slots:
            raise RuntimeError(f"GradientSynchronizer.{where}: call prepare(...) first")
        if not isinstance(index, (int, np.integer)) or not 0 <= index < len(self.slots):
            raise IndexError(f"GradientSynchronizer.{where}: gradient index {index!r} is out of "
                             f"range 0..{len(self.slots) - 1}")

    # --- one step --------------------------------------------------------------------------
    def start(self, group: ProcessGroup | None = None, num_samples: float | None = None) -> None:
        """Begin a step: forget which gradients arrived and fix the group and weights.

        With ``num_samples`` this rank's gradients are weighted by
        ``num_samples / (sum over ranks)``; the total is all-reduced here
        (asynchronously under OVERLAPPED, waited for before the first bucket
        leaves). Every rank must pass a count, or none.
        """
        if not self.slots and not self.buckets:
            raise RuntimeError("GradientSynchronizer.start: call prepare(...) first")
        self._wait_pending()
        for s in self.slots:
            s.ready = s.weighted = False
        for b in self.buckets:
            b.pending, b.work, b.launched = len(b.indices), None, False
            b.cursor = b.ready_elems = b.weigh_from = 0
            self._advance_ready(b)  # a bucket of zero-size gradients only is ready at once
        self.copies = 0
        self._next_launch = 0
        self._oldest_in_flight = 0
        self._group = resolve_group(group if group is not None else self.group)
        if self._persistent_path():
            self._make_persistent()  # and queue every piece (see PersistentPieces._pump)
        self._count_work = None
        self._num_samples = None
        if num_samples is not None:
            n = float(num_samples)
            if not n >= 0:  # also refuses NaN
                raise ValueError(f"GradientSynchronizer.start: num_samples must be >= 0, got "
                                 f"{num_samples!r}")
            self._num_samples = n
            if self.strategy is not GradSyncStrategy.NO_SYNC:
                backend = self._group.backend_for("GradientSynchronizer.start")
                self._count = backend.metadata_buffer(np.array([n], dtype=np.float64))
                overlapped = self.strategy is GradSyncStrategy.OVERLAPPED
                work = all_reduce(self._count, ReduceOp.SUM, self._group, async_op=overlapped)
                self._count_work = work if overlapped else CompletedWork(work)
        self._factor = 1.0 / self._group.world_size if num_samples is None else 0.0
        self._active = True

    def add_gradient(self, index: int, grad: Any) -> None:
        """Put gradient ``index`` into its slot (no copy when ``grad`` is that slot).

        Under OVERLAPPED, issues the all-reduce of every bucket that is now
        complete and whose predecessors have been issued.

        Raises:
            ValueError: wrong shape, or the gradient was already added this step.
        """
        slot = self._open_slot(index, "add_gradient",
                               " (accumulate into .grad before adding it)")
        if grad is not slot.view:
            grad = _array.as_array(grad)
            check_gradient(grad, "GradientSynchronizer.add_gradient", index)
            if tuple(grad.shape) != slot.view.shape:
                raise ValueError(f"GradientSynchronizer.add_gradient: gradient {index} has shape "
                                 f"{tuple(grad.shape)}, its parameter has {slot.view.shape}")
            if self.strategy is GradSyncStrategy.NO_SYNC:
                slot.view[...] = grad
            else:
                # The packing copy applies the weight too: no separate pass for this slot.
                _array.namespace(slot.view).multiply(grad, self._weight(), out=slot.view,
                                                     casting="unsafe")
                slot.weighted = True
            self.copies += 1
        self._hand_over(slot)

    def _hand_over(self, slot: _Slot) -> None:
        """Mark ``slot`` ready; under OVERLAPPED issue what is now complete and move on."""
        slot.ready = True
        state = self.buckets[slot.bucket]
        state.pending -= 1
        if self.strategy is GradSyncStrategy.OVERLAPPED:
            if state.persistent is not None:
                self._advance_ready(state)
                self._progress_pieces(slot.view.size)
                return
            if state.pending == 0:
                self._launch_ready()
            self._progress(slot.view.size)

    def _advance_ready(self, state: _BucketState) -> None:
        """Move ``state``'s ready prefix past the slots that are ready now (in buffer order:
        the order a backward pass fills it, so usually by one slot per gradient)."""
        layout, slots, c = state.layout, self.slots, state.cursor
        while c < len(layout) and slots[layout[c][2]].ready:
            c += 1
        state.cursor = c
        state.ready_elems = layout[c][0] if c < len(layout) else state.flat.size

    #: Elements per block of :meth:`accumulate` (256 KiB of float32): a block's sum is
    #: still in cache when it is weighted, so the two steps cost one pass over memory.
    ACCUMULATE_BLOCK = 1 << 16

    def accumulate(self, index: int, grad: Any) -> None:
        """Add ``grad`` into gradient ``index``'s slot and hand the sum over, as
        ``slot += grad`` then :meth:`add_gradient` of the slot would, but weighting the
        sum block by block while it is in cache instead of in a later pass over the bucket
        (NumPy; other arrays in two whole-array steps). The same arithmetic: the sum is
        rounded to the slot's dtype, then multiplied by the weight.

        Raises:
            ValueError: wrong shape, or the gradient was already added this step.
        """
        slot = self._open_slot(index, "accumulate")
        grad = _array.as_array(grad)
        check_gradient(grad, "GradientSynchronizer.accumulate", index)
        view = slot.view
        if tuple(grad.shape) != view.shape:
            raise ValueError(f"GradientSynchronizer.accumulate: gradient {index} has shape "
                             f"{tuple(grad.shape)}, its parameter has {view.shape}")
        weight = 1.0 if self.strategy is GradSyncStrategy.NO_SYNC else self._weight()
        xp = _array.namespace(view)
        if weight == 1.0:
            xp.add(view, grad, out=view)
        elif type(view) is np.ndarray and view.size > self.ACCUMULATE_BLOCK:
            flat, source = view.reshape(-1), grad.reshape(-1)
            for lo in range(0, flat.size, self.ACCUMULATE_BLOCK):
                block = flat[lo:lo + self.ACCUMULATE_BLOCK]
                np.add(block, source[lo:lo + self.ACCUMULATE_BLOCK], out=block)
                np.multiply(block, weight, out=block, casting="unsafe")
        else:
            xp.add(view, grad, out=view)
            xp.multiply(view, weight, out=view, casting="unsafe")
        slot.weighted = weight != 1.0 or slot.weighted
        self._hand_over(slot)

    def _weight(self) -> float:
        """This rank's weight; waits for the sample total the first time it is needed."""
        if self._count_work is not None:
            self._count_work.wait()
            self._count_work = None
            total = float(_array.to_host(self._count)[0])
            if total <= 0:
                raise ValueError("GradientSynchronizer: num_samples add up to 0 over the group; "
                                 "at least one rank must have samples")
            self._factor = self._num_samples / total  # type: ignore[operator]
        return self._factor

    def _launch(self, state: _BucketState, async_op: bool) -> None:
        data = state.flat
        factor = self._weight()
        whole = 1.0  # the weight still to apply to the whole bucket
        if factor != 1.0:
            unweighted = [i for i in state.indices if not self.slots[i].weighted]
            if len(unweighted) == len(state.indices):
                whole = factor
            else:
                xp = _array.namespace(data)
                for i in unweighted:
                    view = self.slots[i].view
                    xp.multiply(view, factor, out=view, casting="unsafe")
        state.launched = True
        shared = state.bucket.given  # summed where it lies, at once (also when OVERLAPPED)
        fused = self._fused_backend(data, async_op and not shared)
        if fused is not None and whole != 1.0 and self._halved_mean(data) and not shared:
            all_reduce(data, ReduceOp.AVERAGE, self._group)  # the sum halved in its own pass
            state.work = None
        elif fused is not None:
            fused.scaled_sum_blocking(data, whole)
            state.work = None
        else:
            if whole != 1.0:
                _array.namespace(data).multiply(data, whole, out=data, casting="unsafe")
            work = self.hook(data, self._group, async_op)  # type: ignore[arg-type]
            state.work = work if isinstance(work, Work) else None

    def _halved_mean(self, data: Any) -> bool:
        """Whether a bucket none of whose slots is weighted yet is averaged as the sum
        halved (``AVERAGE``) rather than weighted and summed: an unweighted mean of a
        float32/64 bucket in a group of two, where both give the same bits (halving is
        exact) except where a value is subnormal or the sum overflows, and where the MPI
        backend sums and halves in the data's one pass. The same on every rank."""
        return (self._num_samples is None and self._group.world_size == 2  # type: ignore[union-attr]
                and data.dtype.itemsize >= 4 and data.dtype.kind == "f")

    def _fused_backend(self, data: Any, async_op: bool) -> Backend | None:
        """The backend when it can weight and sum this bucket in one call
        (``scaled_sum_blocking``: blocking, default hook, NumPy buffer), else None.
        Depends on nothing rank-local, so every rank makes the same calls."""
        if async_op or self.hook is not sum_hook or type(data) is not np.ndarray:
            return None
        return self._group.backend_for("GradientSynchronizer")  # type: ignore[union-attr]

    # --- persistent all-reduces (OVERLAPPED with the default hook) --------------------------
    def _persistent_path(self) -> bool:
        """Whether buckets go through persistent all-reduces (the same on every rank):
        OVERLAPPED with the default hook, unless its buckets lie in shared memory."""
        return (self.strategy is GradSyncStrategy.OVERLAPPED and self.hook is sum_hook
                and not any(state.bucket.given for state in self.buckets))

    def _progress(self, added: int = 0) -> None:
        """Move the all-reduces in flight on, after a gradient of ``added`` elements:
        persistent pieces through :meth:`PersistentPieces._progress_pieces`; otherwise test
        the oldest bucket in flight: MPI advances a non-blocking collective only inside MPI
        calls (unless the library runs a progress thread); a test between two gradients
        lets the all-reduces move on while the gradients are being computed."""
        if self._queue or self._in_flight:
            self._progress_pieces(added)
            return
        while self._oldest_in_flight < self._next_launch:
            work = self.buckets[self._oldest_in_flight].work
            if work is not None and not work.is_completed():
                return
            self._oldest_in_flight += 1

    def _launch_ready(self) -> None:
        while (self._next_launch < len(self.buckets)
               and self.buckets[self._next_launch].pending == 0):
            self._launch(self.buckets[self._next_launch], async_op=True)
            self._next_launch += 1

    def finish(self) -> list[Any]:
        """Complete the step: zero missing gradients, reduce what is left, wait for all.

        Returns:
            Per index, the averaged gradient as a view of its bucket (under
            NO_SYNC: this rank's gradient, unscaled).
        """
        if not self._active:
            raise RuntimeError("GradientSynchronizer.finish: no step in progress; add gradients "
                               "or call start() first")
        for s in self.slots:
            if not s.ready:
                s.view[...] = 0
                s.weighted = True
        try:
            if self._persistent_path():  # every gradient is in (or zero) now
                for state in self.buckets:
                    state.ready_elems = state.flat.size
                self._pump(len(self._queue))
            elif self.strategy is not GradSyncStrategy.NO_SYNC:
                overlapped = self.strategy is GradSyncStrategy.OVERLAPPED
                for state in self.buckets[self._next_launch:]:
                    self._launch(state, async_op=overlapped)
                self._next_launch = len(self.buckets)
        finally:
            self._wait_pending()
            self._active = False
        return [s.view for s in self.slots]

    def sync_all(self, group: ProcessGroup | None = None,
                 num_samples: float | None = None) -> list[Any]:
        """Average every gradient added since the step began (see :meth:`finish`).

        ``group`` and ``num_samples`` apply when the step was not started yet
        (no gradient added and no :meth:`start`).
        """
        if not self._active:
            self.start(group, num_samples)
        elif group is not None and resolve_group(group) is not self._group:
            raise ValueError("GradientSynchronizer.sync_all: the step was started on another "
                             "group; pass the group to start() instead")
        return self.finish()

    def missing(self) -> list[int]:
        """Indices not added in the current step."""
        return [i for i, s in enumerate(self.slots) if not s.ready]

    def _wait_pending(self) -> None:
        """Wait for every all-reduce in flight; pieces not started yet are dropped."""
        first_error = self._wait_pieces()
        for state in self.buckets:
            work, state.work = state.work, None
            if work is not None:
                try:
                    work.wait()
                except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise
                    first_error = first_error or exc
        if self._count_work is not None:
            work, self._count_work = self._count_work, None
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def clear(self) -> None:
        """Abandon the current step (waiting for any all-reduce in flight); keep the buffers."""
        self._wait_pending()
        for s in self.slots:
            s.ready = False
        self._active = False

    def close(self) -> None:
        """Wait for what is in flight and free the persistent all-reduces (under MPI their
        requests, which otherwise keep the group's communicator alive); idempotent.

        Every rank calls it. A later step makes new ones.
        """
        self._wait_pending()
        self._active = False
        self._free_persistent()

    def __repr__(self) -> str:
        sizes = ", ".join(str(s.bucket.capacity) for s in self.buckets)
        return (f"GradientSynchronizer({self.strategy.name}, {len(self.slots)} gradients, "
                f"buckets of [{sizes}] elements)")


__all__ = ["GradSyncStrategy", "GradientSynchronizer", "check_gradient"]
