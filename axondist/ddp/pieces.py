"""OVERLAPPED's persistent pieces: each gradient bucket's persistent all-reduce, made once per
group, cut into pieces that start, in the one order every rank follows, as soon as the
gradients each holds are in, weighted as they leave; a small window of pieces in flight,
moved on by tests between gradients (and, across hosts, by a helper thread).
:class:`PersistentPieces` is the part of :class:`~axondist.ddp.GradientSynchronizer`
that does this.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from itertools import islice
from typing import Any

import numpy as np

from .. import _array
from ..backends.base import Backend, CompletedWork, PersistentAllReduce, Work
from ..comm import all_reduce
from ..ops import ReduceOp
from ..process_group import ProcessGroup
from .buckets import MiB

#: Largest piece of a persistent all-reduce when ``piece_bytes`` is None.
DEFAULT_PIECE_BYTES = 4 * MiB
#: dtypes whose pieces a group of two averages in one pass (see _means_in_one_pass).
_MEAN_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64))


class PersistentPieces:
    """The persistent pieces of a gradient synchronizer's buckets (a base class: the
    synchronizer owns the buckets, the slots and the weight).

    Each bucket state (``buckets``) has ``persistent`` (its handle), ``flat``, ``layout``
    (per slot ``(first element, end, gradient index)``), ``ready_elems`` (elements from
    the start whose gradients are all in), ``weigh_from`` and ``launched``; each slot
    (``slots``) has ``weighted``.
    """

    buckets: list[Any]
    slots: list[Any]
    _group: ProcessGroup | None
    _num_samples: float | None

    #: Pieces of persistent all-reduces in flight at once (more starts wait for the
    #: oldest). Each piece is weighted just before it starts; with
    #: small pieces (``AXONDIST_PIECE_MB=0.5`` under MPI) and few in flight, MPI copies it
    #: while it is still in cache.
    PIPELINE_WINDOW = 2
    #: Seconds between the tests a helper thread makes of the persistent pieces in flight
    #: while the caller computes the next gradients (OVERLAPPED, default hook). MPI moves a
    #: non-blocking collective only inside MPI calls; between two gradients nothing would
    #: move, and over a network the kernel's socket buffers fill and then idle. None: 1 ms
    #: in a group that spans several hosts, off on one host (shared memory moves the data
    #: in the test itself, and the helper would compete for the cores); 0: off. Needs MPI
    #: initialized with ``MPI_THREAD_MULTIPLE`` (mpi4py's default) when the caller's own
    #: code makes MPI calls meanwhile.
    progress_interval: float | None = None
    #: Largest piece of a bucket's persistent all-reduce, in bytes (OVERLAPPED, default
    #: hook). A piece starts once every gradient it holds was added, so when the backward
    #: pass hands over its last gradient at most about one piece is left to start: the
    #: exposed end of the step. Smaller pieces leave less, but each pays the group's latency
    #: and Python's costs once. None: the whole bucket where each piece is a blocking mean
    #: (a checked MPI group of two on one host: see :meth:`_means_in_one_pass`), else
    #: :data:`DEFAULT_PIECE_BYTES`.
    piece_bytes: int | None = None

    def _init_pieces(self) -> None:
        #: pieces waiting to start, in the one order every rank starts them
        self._queue: deque[tuple[Any, int]] = deque()
        #: started pieces, oldest first (at most PIPELINE_WINDOW)
        self._in_flight: deque[Work] = deque()
        self._persistent_owner: Backend | None = None
        #: held by whoever touches the pieces in flight (this thread or the helper)
        self._lock = threading.Lock()
        self._helper: ProgressHelper | None = None
        #: pieces run as blocking means (see _means_in_one_pass), decided with the handles
        self._blocking_means = False

    def _weight(self) -> float:
        """This rank's weight (the synchronizer's)."""
        raise NotImplementedError

    def _make_persistent(self) -> None:
        """Give every bucket its persistent all-reduce on this step's group (made on the
        first step, again only when the group changes) and queue every piece, in the one
        order all ranks start them. Collective, in bucket order, at the start of a step:
        the same point on every rank."""
        backend = self._group.backend_for("GradientSynchronizer")  # type: ignore[union-attr]
        if not (self.buckets and self._persistent_owner is backend):
            self._free_persistent()
            self._blocking_means = self._means_in_one_pass(backend)
            for state in self.buckets:
                if self._blocking_means:  # the contract's default handle: its bounds
                    # (one piece a bucket unless piece_bytes asks: each piece's mean costs
                    # two round trips, as few as SYNCHRONOUS makes), and checked
                    # non-blocking SUMs for the steps with sample counts
                    state.persistent = Backend.persistent_all_reduce(
                        backend, state.flat, ReduceOp.SUM, piece_bytes=self.piece_bytes)
                else:
                    state.persistent = backend.persistent_all_reduce(
                        state.flat, ReduceOp.SUM,
                        piece_bytes=self.piece_bytes or DEFAULT_PIECE_BYTES)
            self._persistent_owner = backend
            interval = self._helper_interval()
            if interval > 0:
                self._helper = ProgressHelper(self, interval)
        self._queue.extend((state, k) for state in self.buckets
                           for k in range(len(state.persistent.bounds)))

    def _means_in_one_pass(self, backend: Backend) -> bool:
        """Whether each bucket of a plain mean (no sample counts) is one piece that runs as
        a blocking ``AVERAGE`` all-reduce once its gradients are in, instead of weighted
        persistent SUMs of pieces: float32/64
        NumPy buckets in a checked group of two on one host (the backend's ``layout`` says
        so: the MPI backend's), where each bucket is summed and halved in the data's one
        pass, as the synchronous strategy's are (the same calls and bits), and the data
        moves inside the call as it would in the tests between gradients.
        Depends on nothing rank-local, so every rank decides alike."""
        layout = getattr(backend, "layout", None) if backend.name == "mpi" else None
        return (layout is not None and layout.world_size == 2 and layout.nodes == 1
                and layout.checks and all(type(s.flat) is np.ndarray
                                          and s.flat.dtype in _MEAN_DTYPES
                                          for s in self.buckets))

    def _helper_interval(self) -> float:
        """Seconds between the helper's tests (0: no helper); see :attr:`progress_interval`."""
        if self.progress_interval is not None:
            return max(0.0, float(self.progress_interval))
        _, _, local_size = self._group.node_info()  # type: ignore[union-attr]
        return 1e-3 if local_size < self._group.world_size else 0.0  # type: ignore[union-attr]

    def _pump(self, pieces: int) -> int:
        """Start up to ``pieces`` queued pieces, in queue order, each once every gradient
        it holds was added and weighted just before it starts; with the window full, first
        wait for the oldest piece in flight. Which pieces start depends only on which
        gradients were added, not on timing, so every rank starts the same pieces in the
        same order. Returns how many started."""
        queue, in_flight = self._queue, self._in_flight
        started = 0
        with self._lock:
            while started < pieces and queue:
                state, k = queue[0]
                lo, hi = state.persistent.bounds[k]
                if hi > state.ready_elems:
                    break
                if len(in_flight) >= self.PIPELINE_WINDOW:
                    in_flight.popleft().wait()
                queue.popleft()
                in_flight.append(self._start_piece(state, k, lo, hi))
                state.launched = True
                started += 1
            if self._helper is not None and in_flight:
                self._helper.wake()
        return started

    def _start_piece(self, state: Any, k: int, lo: int, hi: int) -> Work:
        """Start piece ``k`` (``[lo, hi)``) of ``state``'s persistent all-reduce, weighted.
        Where no slot in the piece holds weighted values yet, the weight goes with the
        start (the handle multiplies the whole piece just before it starts); otherwise the
        slots not yet weighted are weighted here first (:meth:`_weigh_piece`). The same
        values either way, bit for bit."""
        handle = state.persistent
        if self._blocking_means and self._num_samples is None:
            piece = state.flat[lo:hi]
            if not self._holds_weighted(state, lo, hi):
                all_reduce(piece, ReduceOp.AVERAGE, self._group)
            else:  # a checked SUM: a rank whose pieces differ is told, not left waiting
                self._weigh_piece(state, lo, hi)
                all_reduce(piece, ReduceOp.SUM, self._group)
            return CompletedWork(piece)
        if not self._holds_weighted(state, lo, hi):
            return handle.start(k, self._weight())
        self._weigh_piece(state, lo, hi)
        return handle.start(k)

    def _holds_weighted(self, state: Any, lo: int, hi: int) -> bool:
        """Whether a slot overlapping ``[lo, hi)`` of ``state``'s buffer already holds
        weighted values; moves ``state.weigh_from`` past the slots that end by ``hi``
        when none does (the next piece starts there)."""
        layout, slots = state.layout, self.slots
        j = state.weigh_from
        while j < len(layout) and layout[j][0] < hi:
            if slots[layout[j][2]].weighted:
                return True
            if layout[j][1] > hi:
                break
            j += 1
        state.weigh_from = j
        return False

    def _weigh_piece(self, state: Any, lo: int, hi: int) -> None:
        """Multiply the part of ``state``'s buffer in ``[lo, hi)`` held by slots not yet
        weighted by this rank's weight, one call per run of such slots. Pieces start in
        buffer order, so ``state.weigh_from`` only moves on (a slot cut by a piece's end
        is weighted part by part)."""
        factor = self._weight()
        if factor == 1.0:
            return
        layout, slots = state.layout, self.slots
        j = state.weigh_from
        run_lo = run_hi = lo
        while j < len(layout) and layout[j][0] < hi:
            end, i = layout[j][1], layout[j][2]
            if slots[i].weighted:
                _scale(state.flat, run_lo, run_hi, factor)
                run_lo = run_hi = min(end, hi)
            else:
                run_hi = min(end, hi)
            if end > hi:
                break
            j += 1
        _scale(state.flat, run_lo, run_hi, factor)
        state.weigh_from = j

    def _progress_pieces(self, added: int) -> None:
        """Move the pieces on after a gradient of ``added`` elements: start about as many
        elements as the gradient had (at least one piece, of those whose gradients are
        all in), so communication keeps pace with the backward pass; with none to start,
        test each piece in flight once (MPI moves a non-blocking operation only inside
        MPI calls) and drop the finished
        ones from the front (under MPI on one host each test is what moves the data: MPI
        copies a big message through shared memory a part per call)."""
        queue = self._queue
        if queue:
            state, k = queue[0]
            lo, hi = state.persistent.bounds[k]
            if hi <= state.ready_elems and self._pump(max(1, added // max(1, hi - lo))):
                return
        in_flight = self._in_flight
        if not in_flight:
            return
        with self._lock:
            while in_flight:
                if not in_flight[0].is_completed():
                    for piece in islice(in_flight, 1, None):  # local tests; each moves its
                        piece.is_completed()                  # own piece on
                    break
                in_flight.popleft()

    def _wait_pieces(self) -> BaseException | None:
        """Drop the pieces not started; wait for every piece in flight. Returns the first
        error a wait raised (after waiting for the rest), or None."""
        first_error: BaseException | None = None
        self._queue.clear()
        with self._lock:
            while self._in_flight:
                try:
                    self._in_flight.popleft().wait()
                except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise
                    first_error = first_error or exc
        return first_error

    @property
    def persistent(self) -> list[PersistentAllReduce]:
        """The buckets' persistent all-reduces, in bucket order (empty until the first
        OVERLAPPED step with the default hook, and after ``close()``)."""
        return [s.persistent for s in self.buckets if s.persistent is not None]

    def _free_persistent(self) -> None:
        """Free the buckets' persistent all-reduces (each waits for its pieces in flight)."""
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.stop()
        self._queue.clear()
        self._in_flight.clear()
        for state in self.buckets:
            handle, state.persistent = state.persistent, None
            if handle is not None:
                handle.free()
        self._persistent_owner = None


def _scale(flat: Any, lo: int, hi: int, factor: float) -> None:
    """``flat[lo:hi] *= factor`` (cast to its dtype); nothing for an empty range."""
    if hi > lo:
        part = flat[lo:hi]
        _array.namespace(part).multiply(part, factor, out=part, casting="unsafe")


class ProgressHelper:
    """A daemon thread that, once woken, tests a synchronizer's pieces in flight every
    ``interval`` seconds (each test moves MPI's progress on) until none is left, then
    sleeps until woken again. It holds the synchronizer only weakly and ends with it or
    at :meth:`stop`; the synchronizer's lock keeps its tests apart from the caller's
    starts and waits (MPI forbids two threads completing one request). A test that fails
    stops the testing until the next wake; the caller's own wait on that piece raises the
    error."""

    def __init__(self, sync: PersistentPieces, interval: float) -> None:
        self._sync = weakref.ref(sync)
        self._interval = interval
        self._woken = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="axondist-grad-progress",
                                        daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Start testing (called with the synchronizer's lock held, after a start)."""
        self._woken.set()

    def stop(self) -> None:
        """End the thread and wait for it (not from the thread itself)."""
        self._stopped = True
        self._woken.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped:
            if not self._woken.wait(1.0):
                if self._sync() is None:
                    return
                continue
            sync = self._sync()
            if sync is None or self._stopped:
                return
            with sync._lock:
                try:  # every piece in flight: each test moves MPI's progress on
                    busy = [work.is_completed() for work in sync._in_flight].count(False) > 0
                except Exception:  # noqa: BLE001 - the caller's wait raises it, with context
                    busy = False
                if not busy:
                    self._woken.clear()  # under the lock: a start after this wakes us again
            del sync
            time.sleep(self._interval)


__all__ = ["DEFAULT_PIECE_BYTES", "PersistentPieces", "ProgressHelper"]
