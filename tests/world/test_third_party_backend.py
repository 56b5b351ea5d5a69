"""A backend written against the contract's abstract methods only (``make_plan``, ``barrier``,
``send``, ``recv``, ``new_group``): ranks on threads, messages in thread queues, every
collective the point-to-point plan of :mod:`axondist.backends.p2p_plans`. Every collective,
the object calls, groups, DDP and FSDP give what NumPy and one-process training give, on 2
and 3 ranks. Runs its own threads, so not under a launcher.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from harness import mock_only
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist.backends.base import Backend
from axondist.backends.p2p_plans import p2p_plan
from axondist.backends.plan import CallKey, Plan
from axondist.fsdp import FSDP, ShardingStrategy
from axondist.launching.worlds import run_ranks
from axondist.optim import Adam

pytestmark = mock_only


class Wires:
    """What the ranks of one job share: a queue per (source, destination, group, tag), and
    the reason the job failed (None while it runs)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[tuple[Any, ...], queue.Queue] = defaultdict(queue.Queue)
        self.failed: str | None = None

    def queue(self, *where: Any) -> queue.Queue:
        with self.lock:
            return self.queues[where]

    def abort(self, rank: int, exc: BaseException) -> None:
        self.failed = f"rank {rank} failed: {exc!r}"


class QueueBackend(Backend):
    """One rank of a job whose messages travel through :class:`Wires`."""

    name = "queues"

    def __init__(self, wires: Wires, members: Sequence[int], rank: int, group: Any = ()):
        self.wires, self.members, self.group = wires, tuple(members), group
        self.rank, self.world_size = rank, len(members)
        self._groups_made = 0

    def make_plan(self, key: CallKey) -> Plan:
        return p2p_plan(self, key)

    def barrier(self) -> None:
        self.allgather_object(None)

    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        me, to = self.members[self.rank], self.members[dst]
        self.wires.queue(me, to, self.group, tag).put(np.array(buf, copy=True))

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        box = self.wires.queue(self.members[src], self.members[self.rank], self.group, tag)
        for _ in range(600):
            if self.wires.failed is not None:
                raise RuntimeError(f"recv cancelled: {self.wires.failed}")
            try:
                message = box.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        else:
            raise TimeoutError(f"rank {self.rank}: nothing from rank {src} (tag {tag})")
        assert message.nbytes == buf.nbytes, (message.shape, buf.shape)
        buf.reshape(-1)[...] = message.reshape(-1).view(buf.dtype)

    def new_group(self, ranks: Sequence[int]) -> QueueBackend | None:
        ranks = [int(r) for r in ranks]
        self._groups_made += 1
        if self.rank not in ranks:
            return None
        return QueueBackend(self.wires, [self.members[r] for r in ranks], ranks.index(self.rank),
                            (self.group, self._groups_made))


def run_queues(body: Any, n: int, *args: Any) -> list[Any]:
    """``body(world, *args)`` on every rank of a new job of ``n`` queue backends."""
    wires = Wires()
    backends = [QueueBackend(wires, range(n), r) for r in range(n)]
    results = run_ranks(backends, body, args, {}, abort=wires.abort, label="queues")
    assert not any(q.qsize() for q in wires.queues.values()), "a message was never received"
    return results


def values(seed: int, rank: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    return np.array(rng.standard_normal(shape) * 4, dtype=dtype)


RANKS = st.sampled_from([2, 3])
SHAPES = st.sampled_from([(), (1,), (5,), (7, 3), (2, 0, 4)])
DTYPES = st.sampled_from([np.float64, np.float32, np.int64, np.float16])
OPS = st.sampled_from(list(ad.ReduceOp))


def _collectives(world: ad.World, seed: int, shape: tuple[int, ...], dtype: Any,
                 op: ad.ReduceOp, rows: list[int]) -> None:
    n, me = world.world_size, world.rank
    everyone = [values(seed, r, shape, dtype) for r in range(n)]
    wide = [e.astype(np.float64) for e in everyone]
    if not (op is ad.ReduceOp.AVERAGE and np.dtype(dtype).kind == "i"):
        want = {ad.ReduceOp.SUM: sum(wide), ad.ReduceOp.PRODUCT: math.prod(wide),
                ad.ReduceOp.MIN: np.minimum.reduce(wide), ad.ReduceOp.MAX: np.maximum.reduce(wide),
                ad.ReduceOp.AVERAGE: sum(wide) / n}[op]
        tol = 2e-2 if dtype == np.float16 else 1e-5
        x = everyone[me].copy()
        assert ad.all_reduce(x, op) is x
        np.testing.assert_allclose(x.astype(np.float64), want, rtol=tol, atol=tol * 8)
        y = everyone[me].copy()
        ad.all_reduce(y, op, async_op=True).wait()
        np.testing.assert_array_equal(y, x)  # the same bits, blocking or not
        for root in range(n):
            z = everyone[me].copy()
            ad.reduce(z, root, op)
            np.testing.assert_array_equal(z, x if me == root else everyone[me])
        if shape and shape[0]:
            block = np.array_split(x, n)[me]
            np.testing.assert_array_equal(ad.reduce_scatter(everyone[me], op), block)
    for root in range(n):
        b = everyone[me].copy()
        np.testing.assert_array_equal(ad.broadcast(b, src=root), everyone[root])
    mine = values(seed, me, (rows[me], 2), dtype)
    stacked = np.concatenate([values(seed, r, (rows[r], 2), dtype) for r in range(n)])
    np.testing.assert_array_equal(ad.all_gather(mine), stacked)
    np.testing.assert_array_equal(ad.all_gather(mine, sizes=rows), stacked)
    for root in range(n):
        got = ad.gather_tensor(mine, dst=root)
        assert (got is None) == (me != root)
        if got is not None:
            np.testing.assert_array_equal(got, stacked)
        whole = stacked if me == root else None
        np.testing.assert_array_equal(ad.scatter_tensor(whole, src=root),
                                      np.array_split(stacked, n)[me])
    sends = [int(s) for s in np.random.default_rng([seed, me, 9]).integers(0, 4, size=n)]
    outgoing = values(seed + 1, me, (sum(sends), 3), dtype)
    got = ad.all_to_all(outgoing, send_sizes=sends)
    pieces = []
    for r in range(n):
        theirs = [int(s) for s in np.random.default_rng([seed, r, 9]).integers(0, 4, size=n)]
        lo = sum(theirs[:me])
        pieces.append(values(seed + 1, r, (sum(theirs), 3), dtype)[lo:lo + theirs[me]])
    np.testing.assert_array_equal(got, np.concatenate(pieces))


@settings(max_examples=6, deadline=None)
@given(n=RANKS, seed=st.integers(0, 2**16), shape=SHAPES, dtype=DTYPES, op=OPS,
       rows=st.lists(st.integers(0, 3), min_size=3, max_size=3))
def test_every_collective_matches_numpy(n, seed, shape, dtype, op, rows):
    run_queues(_collectives, n, seed, shape, dtype, op, rows[:n])


def _objects_groups_and_messages(world: ad.World) -> None:
    n, me = world.world_size, world.rank
    assert ad.all_gather_object({"rank": me, "pad": "x" * (100 * me)}) == [
        {"rank": r, "pad": "x" * (100 * r)} for r in range(n)]
    assert ad.broadcast_object(("from", me), src=n - 1) == ("from", n - 1)
    ad.barrier()
    nxt, prev = (me + 1) % n, (me - 1) % n
    ad.send(np.arange(me + 3.0), nxt, tag=5)
    np.testing.assert_array_equal(ad.recv(prev, tag=5), np.arange(prev + 3.0))
    pair = world.new_group([0, n - 1])
    if me in (0, n - 1):
        x = np.full(4, float(me + 1))
        ad.all_reduce(x, group=pair)
        np.testing.assert_array_equal(x, 1.0 + n)
    else:
        assert not pair.is_member


@pytest.mark.parametrize("n", [2, 3])
def test_objects_groups_and_point_to_point(n):
    run_queues(_objects_groups_and_messages, n)


# --- training ---------------------------------------------------------------------------

SIZES = [(3, 2), (4,), ()]


def _batch(seed: int, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    dim = sum(math.prod(s) for s in SIZES)
    rng = np.random.default_rng([seed, rank, step])
    return rng.standard_normal((3, dim)) / math.sqrt(dim), rng.standard_normal(3)


def _grad_fn(arrays: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, list]:
    """Loss and gradients of mean((x @ theta - y)^2)."""
    theta = np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in arrays])
    r = x @ theta - y
    g = 2.0 / len(y) * (x.T @ r)
    grads, at = [], 0
    for a in arrays:
        grads.append(g[at:at + a.size].reshape(a.shape).astype(a.dtype))
        at += a.size
    return float(np.mean(r * r)), grads


def _params(seed: int) -> list[ad.Parameter]:
    rng = np.random.default_rng([seed, 1])
    return [ad.Parameter(rng.standard_normal(s), name=f"p{i}") for i, s in enumerate(SIZES)]


def _one_process(seed: int, n: int, steps: int) -> list[np.ndarray]:
    params = _params(seed)
    opt = Adam(params, lr=0.05)
    for step in range(steps):
        parts = [_batch(seed, r, step) for r in range(n)]
        _, grads = _grad_fn([p.data for p in params], np.concatenate([p[0] for p in parts]),
                            np.concatenate([p[1] for p in parts]))
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return [p.data for p in params]


def _ddp(world: ad.World, seed: int, steps: int) -> list[np.ndarray]:
    ddp = ad.DDP(_params(seed), world, grad_fn=_grad_fn)
    opt = Adam(ddp.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        ddp.backward(*_batch(seed, world.rank, step))
        opt.step()
    return [p.data for p in ddp.parameters()]


def _fsdp(world: ad.World, seed: int, steps: int, strategy: ShardingStrategy
          ) -> list[np.ndarray]:
    hybrid = strategy is ShardingStrategy.HYBRID_SHARD
    f = FSDP(_params(seed), world, sharding_strategy=strategy,
             ranks_per_node=1 if hybrid else None)
    opt = Adam(f.sharded_parameters(), lr=0.05)
    for step in range(steps):
        f.step(_grad_fn, *_batch(seed, world.rank, step), optimizer=opt)
    f.gather_parameters()
    full = [np.array(p.data) for p in f.full_parameters()]
    f.reshard_parameters()
    return full


@settings(max_examples=6, deadline=None)
@given(n=RANKS, seed=st.integers(0, 2**16))
def test_ddp_training_matches_one_process(n, seed):
    want = _one_process(seed, n, 3)
    for got in run_queues(_ddp, n, seed, 3):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@settings(max_examples=6, deadline=None)
@given(n=RANKS, seed=st.integers(0, 2**16), strategy=st.sampled_from(list(ShardingStrategy)))
def test_fsdp_training_matches_one_process(n, seed, strategy):
    want = _one_process(seed, n, 3)
    for got in run_queues(_fsdp, n, seed, 3, strategy):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
