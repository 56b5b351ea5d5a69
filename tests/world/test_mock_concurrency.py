"""The mock world under concurrency: many groups, interleaved async calls, sub-groups at the
same time, messages between collectives, each result bitwise equal to NumPy's rank-ordered
reduction; large rounds split into parts that any rank may do, and their failures."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from harness import mock_only
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist.backends.mock import backend as mock
from axondist.backends.mock import plans as mock_plans

pytestmark = mock_only

REPO = Path(__file__).resolve().parents[2]
OPS = ["sum", "mean", "max", "min", "product"]


@contextlib.contextmanager
def shared_rounds(part_bytes: int, min_bytes: int) -> Iterator[None]:
    """Split rounds into parts of ``part_bytes`` from ``min_bytes`` of work on (so that
    small arrays take the path large ones take)."""
    saved = mock_plans._PART_BYTES, mock._SHARED_MIN_BYTES
    mock_plans._PART_BYTES, mock._SHARED_MIN_BYTES = part_bytes, min_bytes
    try:
        yield
    finally:
        mock_plans._PART_BYTES, mock._SHARED_MIN_BYTES = saved


def rank_input(seed: int, call: int, rank: int, count: int) -> np.ndarray:
    values = np.random.default_rng([seed, call, rank]).standard_normal(count)
    return values * np.random.default_rng([seed, call]).choice([1e-3, 1.0, 1e3])


def rank_ordered(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """NumPy's reduction of ``inputs`` in list order (the bits the mock world must give)."""
    ufunc = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
             "product": np.multiply}[op]
    out = inputs[0].copy()
    for x in inputs[1:]:
        ufunc(out, x, out=out)
    if op == "mean":
        out /= len(inputs)
    return out


calls = st.lists(st.tuples(st.sampled_from(["all_reduce", "broadcast", "all_gather",
                                            "reduce_scatter", "send"]),
                           st.integers(0, 2),  # group: 0 world, 1 evens, 2 odds (rank 0 alone)
                           st.sampled_from(OPS),
                           st.integers(1, 3000),  # elements per rank
                           st.booleans()),  # async
                 min_size=1, max_size=12)


def _program(world: ad.World, seed: int, program: list, parts: bool) -> None:
    """Run ``program`` (the same on every rank): each call on its group, async ones waited
    for at the end in reverse order, every result checked bit for bit."""
    n, me = world.world_size, world.rank
    groups = [world, world.new_group(range(0, n, 2)), world.new_group(range(1, n, 2) or [0])]
    pending = []
    for call, (kind, g, op, count, is_async) in enumerate(program):
        group = groups[g]
        if not group.is_member:
            continue
        members = group.ranks
        k = len(members)
        mine = rank_input(seed, call, me, count)
        every = [rank_input(seed, call, r, count) for r in members]
        if kind == "all_reduce":
            work = ad.all_reduce(mine, op, group, async_op=is_async)
            want = rank_ordered(every, op)
        elif kind == "broadcast":
            src = call % k
            work = ad.broadcast(mine, group, src=src, async_op=is_async)
            want = every[src]
        elif kind == "all_gather":
            work = ad.all_gather(mine, group, async_op=is_async)
            want = np.concatenate(every)
        elif kind == "reduce_scatter":
            rows = np.vstack([np.resize(x, (k, 2)) for x in every])  # k rows of 2 per rank
            work = ad.reduce_scatter(np.resize(mine, (k, 2)), op if op != "mean" else "sum",
                                     group, async_op=is_async)
            per_rank = [rows[j * k:(j + 1) * k] for j in range(k)]
            want = rank_ordered(per_rank, op if op != "mean" else "sum")[[group.rank]]
        elif k == 1:
            continue  # no one else to send to
        else:  # a ring of messages on the group, between the collectives
            right, left = (group.rank + 1) % k, (group.rank - 1) % k
            ad.send(mine, right, group, tag=call)
            got = ad.recv(left, group, tag=call)
            np.testing.assert_array_equal(got, every[left])
            continue
        if is_async:
            pending.append((work, want))
        else:
            np.testing.assert_array_equal(work, want)
    for work, want in reversed(pending):
        np.testing.assert_array_equal(work.wait(), want)
    ad.barrier()


@given(n=st.integers(1, 5), seed=st.integers(0, 2**16), program=calls, parts=st.booleans())
def test_interleaved_calls_on_many_groups_match_numpy_bit_for_bit(n, seed, program, parts):
    with shared_rounds(64, 0) if parts else contextlib.nullcontext():
        ad.spawn(_program, n, seed, program, parts, timeout=60)


def _concurrent_subgroups(world: ad.World, seed: int, rounds: int, counts: list[int]) -> None:
    """Disjoint sub-groups (and the world, between them) reducing at the same time."""
    n, me = world.world_size, world.rank
    pairs = [world.new_group([r, r + 1]) for r in range(0, n - 1, 2)]
    for step in range(rounds):
        count = counts[step % len(counts)]
        for p in pairs:
            if p.is_member:
                x = rank_input(seed, step, me, count)
                ad.all_reduce(x, "sum", p)
                want = rank_ordered([rank_input(seed, step, r, count) for r in p.ranks], "sum")
                np.testing.assert_array_equal(x, want)
        y = rank_input(seed, 1000 + step, me, count)
        ad.all_reduce(y, "max")
        want = rank_ordered([rank_input(seed, 1000 + step, r, count) for r in range(n)], "max")
        np.testing.assert_array_equal(y, want)


@settings(max_examples=20)
@given(n=st.integers(2, 6), seed=st.integers(0, 2**16),
       counts=st.lists(st.integers(1, 5000), min_size=1, max_size=4))
def test_disjoint_subgroups_reduce_concurrently(n, seed, counts):
    with shared_rounds(256, 0):
        ad.spawn(_concurrent_subgroups, n, seed, 6, counts, timeout=60)


def _parts_equal_whole(world: ad.World, seed: int, count: int, op: str) -> np.ndarray:
    x = rank_input(seed, 0, world.rank, count).astype(np.float32)
    return ad.all_reduce(x, op)


@given(n=st.integers(2, 5), seed=st.integers(0, 2**16), count=st.integers(1, 4000),
       op=st.sampled_from(OPS), part_bytes=st.integers(4, 4096))
def test_parts_give_the_same_bits_as_one_pass(n, seed, count, op, part_bytes):
    whole = ad.spawn(_parts_equal_whole, n, seed, count, op)
    with shared_rounds(part_bytes, 0):
        split = ad.spawn(_parts_equal_whole, n, seed, count, op)
    want = rank_ordered([rank_input(seed, 0, r, count).astype(np.float32) for r in range(n)],
                        op)
    for a, b in zip(whole, split):
        assert a.tobytes() == b.tobytes() == want.tobytes()


def test_many_async_calls_from_every_rank_complete_in_order():
    def body(world):
        xs = [np.full(2000, float(world.rank + i)) for i in range(40)]
        works = [ad.all_reduce(x, async_op=True) for x in xs]
        for i, (w, x) in enumerate(zip(works, xs)):
            assert w.wait() is x
            np.testing.assert_array_equal(x, np.full(2000, float(sum(r + i for r in range(4)))))
        return True

    with shared_rounds(512, 0):
        assert ad.spawn(body, 4) == [True] * 4


def test_a_blocking_call_never_meets_a_non_blocking_one():
    """As under MPI, which never matches them: every rank raises, naming ``async_op``."""
    def body(world):
        x = np.ones(4, np.float32)
        with pytest.raises(ad.CollectiveMismatchError,
                           match=r"all_reduce: ranks disagree on async_op \(rank 0: False, "
                                 r"rank 1: True\)"):
            if world.rank == 0:
                ad.all_reduce(x)
            else:
                ad.all_reduce(x, async_op=True).wait()
        ad.barrier()  # the world goes on
        return True

    assert ad.spawn(body, 2, timeout=30) == [True, True]


# --- failures, each in its own process under a timeout -----------------------------------

def _run_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
        import numpy as np
        import axondist as ad
        from axondist.backends.mock import backend as mock, plans as mock_plans
        mock_plans._PART_BYTES, mock._SHARED_MIN_BYTES = 64, 0
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={"PYTHONPATH": str(REPO),
                                                           "AXONDIST_TIMEOUT": "20"})


def test_a_part_that_fails_fails_every_rank_of_the_round():
    """A part that raises (one of a shared all-reduce's slices): every rank raises its
    error instead of waiting for the parts that failed."""
    proc = _run_script("""
        part = mock_plans.AllReducePlan._part

        def breaking(self, rnd, i):
            if i == 1:
                raise ValueError("part 1 broke")
            part(self, rnd, i)

        mock_plans.AllReducePlan._part = breaking

        def body(world):
            try:
                ad.all_reduce(np.ones(1020))
            except ValueError as exc:
                return "raised: " + str(exc)
            return "passed"

        print(ad.spawn(body, 3))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("raised: part 1 broke") == 3, proc.stdout


def test_a_failing_rank_wakes_the_peers_waiting_in_a_shared_round():
    """A rank that fails while its peers wait in a shared round wakes them: spawn reports
    its error at once (the world's timeout is 20 s)."""
    proc = _run_script("""
        import time
        def body(world):
            if world.rank == 2:
                time.sleep(0.5)
                raise KeyError("bad batch")
            ad.all_reduce(np.ones(4000))

        start = time.monotonic()
        try:
            ad.spawn(body, 3)
        except KeyError as exc:
            print("KeyError after", round(time.monotonic() - start), "s", exc.__notes__)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "KeyError after 0 s" in proc.stdout or "KeyError after 1 s" in proc.stdout, (
        proc.stdout + proc.stderr)


def test_timeout_in_a_shared_round_names_the_missing_rank():
    proc = _run_script("""
        import time
        def body(world):
            if world.rank == 1:
                time.sleep(3)
                return
            ad.all_reduce(np.ones(4000))

        try:
            ad.spawn(body, 3, timeout=0.5)
        except ad.CollectiveTimeoutError as exc:
            print("timeout:", exc)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "all_reduce #1 on world of ranks [0, 1, 2]" in proc.stdout, proc.stdout
    assert "ranks [1] of 3 did not join within 0.5 s" in proc.stdout, proc.stdout


def test_mismatch_in_a_shared_round_is_named_on_every_rank():
    proc = _run_script("""
        def body(world):
            try:
                ad.all_reduce(np.ones(3000 + world.rank))
            except ad.CollectiveMismatchError as exc:
                return str(exc)

        print("\\n".join(ad.spawn(body, 3)))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("all_reduce: ranks disagree on shape (rank 0: (3000,), "
                             "rank 1: (3001,), rank 2: (3002,))") == 3, proc.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_a_cycle_through_a_collective_is_named_long_before_the_timeout(n):
    """Collectives issued on different groups, and a receive whose sender waits in a
    collective, fail as deadlocks naming each rank's call (AXONDIST_TIMEOUT is 20 s); a
    rank of three that waits for both is not in the cycle."""
    proc = _run_script(f"""
        import time

        def groups(world):
            pair = world.new_group([0, 1])
            ad.all_reduce(np.ones(4), group=pair if world.rank == 0 else None)

        def receive_before_barrier(world):
            if world.rank == 1:
                ad.recv(src=0)
            ad.barrier()

        for body in (groups, receive_before_barrier):
            started = time.monotonic()
            try:
                ad.spawn(body, {n})
            except ad.CollectiveTimeoutError as exc:
                print(f"{{body.__name__}} after {{time.monotonic() - started:.1f}} s:", exc)
    """)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    assert re.match(r"groups after [0-9]\.\d s: (all_reduce #1 on world\.0 of ranks \[0, 1\] "
                    r"\(rank 0\): deadlock: rank 1 waits in all_reduce #2 on world \(.*\), "
                    r"which needs this rank; while this rank waits in all_reduce #1 on world\.0 "
                    r".*\(wait cycle rank 0 -> rank 1 -> rank 0\)|all_reduce #2 on world of "
                    r"ranks .* \(rank 1\): deadlock: rank 0 waits in all_reduce #1 on world\.0 "
                    r"\(.*\), which needs this rank; while this rank waits in all_reduce #2 on "
                    r"world .*\(wait cycle rank 1 -> rank 0 -> rank 1\))", lines[0]), lines[0]
    assert re.match(r"receive_before_barrier after [0-9]\.\d s: (recv on rank 1 from rank 0 "
                    r"\(tag 0\): deadlock: rank 0 waits in barrier #1 on world, which needs "
                    r"this rank|barrier #1 on world of ranks .* \(rank 0\): deadlock: rank 1 "
                    r"waits in recv #1 on world:p2p \(peer=0, tag=0\), which needs this rank)",
                    lines[1]), lines[1]


@pytest.mark.parametrize("n", [2, 3])
def test_receive_cycle_is_still_a_deadlock_with_collectives_around_it(n):
    proc = _run_script(f"""
        def body(world):
            ad.all_reduce(np.ones(4000))
            if world.rank < 2:
                ad.recv(1 - world.rank)
            ad.barrier()

        try:
            ad.spawn(body, {n})
        except ad.CollectiveTimeoutError as exc:
            print("deadlock:", exc)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "deadlock: every rank in the cycle rank" in proc.stdout, proc.stdout + proc.stderr
