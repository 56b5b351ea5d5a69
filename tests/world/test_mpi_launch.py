"""Launch the world tests under mpiexec, and check what only a real MPI job shows.

Plain pytest (one process) runs these tests; each starts ``mpiexec -n K``
(the MPICH mpiexec next to ``sys.executable``) in a subprocess, writes every
rank's output to its own file and checks them all. Skipped under mpiexec
itself (no recursion) and when mpi4py or MPICH's mpiexec is missing.

This file is also the per-rank program of the MPI-only checks:
``mpiexec -n K python tests/world/test_mpi_launch.py CHECK`` runs the
function ``CHECKS[CHECK]`` on every rank (each rank asserts its own results
against NumPy references derived from seeds, then prints ``CHECK OK``). The
launched pytest runs use ``rank_pytest.py``, which prints each failure's traceback
at once and ends the job.

Environment: ``AXONDIST_MPI_LAUNCH_TIMEOUT`` (seconds per launch, default
600), ``AXONDIST_MPI_TEST_EXAMPLES`` (hypothesis examples in the launched
world tests, default 5).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from launched_job import (
    WORLD_RUN_SIZES,
    Launch,
    check_world_run,
    pytest_summary,
    run_job,
    world_run_args,
)
from rank_pytest import REPORT_DIR_VARIABLE

REPO = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
LAUNCH_TIMEOUT = float(os.environ.get("AXONDIST_MPI_LAUNCH_TIMEOUT", "600"))
#: The per-rank program of launched pytest runs (failures printed at once, the job ended).
RANK_PYTEST = Path(__file__).with_name("rank_pytest.py")
# MPICH busy-polls while it waits; with more ranks than free cores (CI machines,
# shared test boxes) the spinning ranks starve the one that should send. These
# settings (MPICH's own CI uses them to run mpi4py's tests oversubscribed) make
# waiting ranks yield, which made the 3-rank world tests 2x faster on 2 cores.
_GENTLE_POLLING = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
                   "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1"}


# --- the launcher (plain pytest) -------------------------------------------------------

def _why_no_mpi() -> str | None:
    """The reason these tests cannot run here, or None."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install '.[mpi]')"
    if not MPIEXEC.exists():
        return f"no mpiexec next to the Python interpreter ({MPIEXEC})"
    try:
        version = subprocess.run([str(MPIEXEC), "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{MPIEXEC} --version failed: {exc}"
    if "HYDRA" not in version:
        return f"{MPIEXEC} is not MPICH's hydra (per-rank output files need -outfile-pattern)"
    return None


def _launched() -> bool:
    from axondist._environment import env_launch_size, launched_by_mpi

    return launched_by_mpi() or env_launch_size() is not None


pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(_launched(), reason="already one rank of a launched job: the launcher "
                                           "does not recurse"),
]


@pytest.fixture(scope="module")
def mpi_ready() -> None:
    reason = _why_no_mpi()
    if reason is not None:
        pytest.skip(reason)


def launch(tmp_path: Path, n: int, args: list[str], env: dict[str, str] | None = None,
           timeout: float = LAUNCH_TIMEOUT) -> Launch:
    """Run ``mpiexec -n n python ARGS`` from the repository root; kill it all on timeout."""
    out = tmp_path / f"n{n}-{time.monotonic_ns()}"
    out.mkdir()
    pattern = str(out / "rank%r.txt")
    cmd = [str(MPIEXEC), "-outfile-pattern", pattern, "-errfile-pattern", pattern,
           "-n", str(n), sys.executable, *args]
    # the checkout's axondist first, also for a rank started as a script (tests/world/...)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**_GENTLE_POLLING, **os.environ, "AXONDIST_TIMEOUT": "30",
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})}
    full_env.pop("AXONDIST_BACKEND", None)
    return run_job(cmd, full_env, lambda: [_read(out / f"rank{r}.txt") for r in range(n)],
                   timeout, f"mpiexec -n {n} {' '.join(args)}", "mpiexec")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.parametrize("n", WORLD_RUN_SIZES)
def test_world_tests_pass_under_mpiexec(mpi_ready: None, tmp_path: Path, n: int) -> None:
    """Every world test at two ranks; at three, the tests a third rank adds to (tests/tiers.py's
    three_ranks): one job each, whose ranks each run pytest over many files."""
    # python -m mpi4py: a rank whose pytest exits non-zero aborts the whole job
    # (otherwise its MPI_Finalize waits for ranks blocked in the next collective).
    args = ["-m", "mpi4py", str(RANK_PYTEST), *world_run_args(n)]
    examples = os.environ.get("AXONDIST_MPI_TEST_EXAMPLES", "5")
    temp = tmp_path / "temp"  # the ranks' system temp folder: left empty
    reports = tmp_path / "reports"  # each rank's JUnit report
    temp.mkdir()
    reports.mkdir()
    run = launch(tmp_path, n, args, {"AXONDIST_TEST_EXAMPLES": examples, "TMPDIR": str(temp),
                                     REPORT_DIR_VARIABLE: str(reports)})
    check_world_run(run, "mpiexec", n, temp, reports)


@pytest.mark.parametrize("n", [4, 5])
def test_mpi_bits_hold_at_four_and_five_ranks(mpi_ready: None, tmp_path: Path, n: int) -> None:
    """tests/world/test_mpi_bits.py (which the world tests above run at 2 and 3 ranks) at
    4 and 5, on a few examples: sums and means keep MPI's own Allreduce's bits."""
    args = ["-m", "mpi4py", str(RANK_PYTEST), "tests/world/test_mpi_bits.py", "-q", "-p",
            "no:cacheprovider", "-x", "-rs"]
    run = launch(tmp_path, n, args, {"AXONDIST_TEST_EXAMPLES": "4"}, timeout=300)
    summaries = [pytest_summary(text) for text in run.ranks]
    for r, summary in enumerate(summaries):
        assert summary is not None and "passed" in summary and "failed" not in summary \
            and "error" not in summary, f"rank {r}: {summary}\n{run.tail()}"
        skipped = re.search(r"(\d+) skipped", summary)  # FSDP's (from 4 ranks on) alone
        assert skipped and skipped.group(1) == "1", f"rank {r}: {summary}\n{run.tail()}"
    assert run.returncode == 0, f"mpiexec exited with {run.returncode}\n{run.tail()}"


@pytest.mark.gpu
@pytest.mark.parametrize("n, staging", [(2, "auto"), (4, "auto"), (2, "always")])
def test_gpu_world_tests_pass_under_mpiexec(mpi_ready: None, tmp_path: Path, n: int,
                                            staging: str) -> None:
    """tests/gpu's world tests on CuPy arrays, every rank on the one GPU (MPI allows it)."""
    from harness import why_no_gpu  # pytest's path only: this file also runs as a script

    reason = why_no_gpu()
    if reason is not None:
        pytest.skip(reason)
    args = ["-m", "mpi4py", str(RANK_PYTEST), "tests/gpu/test_cupy_collectives.py",
            "tests/gpu/test_cupy_wrappers.py", "-q", "-p", "no:cacheprovider", "-x", "-rs"]
    run = launch(tmp_path, n, args, {"AXONDIST_TEST_EXAMPLES": "5",
                                     "AXONDIST_MPI_HOST_STAGING": staging})
    for r, text in enumerate(run.ranks):
        summary = pytest_summary(text)
        assert summary is not None and "passed" in summary and "failed" not in summary \
            and "error" not in summary, f"rank {r}: {summary}\n{run.tail(8000)}"
    assert run.returncode == 0, f"mpiexec exited with {run.returncode}\n{run.tail()}"
    print(run.ranks[0][-3000:])


def test_a_failing_world_test_prints_its_traceback_before_the_job_aborts(
        mpi_ready: None, tmp_path: Path) -> None:
    test_file = tmp_path / "test_fails_on_rank_1.py"
    test_file.write_text(
        "import numpy as np\nimport axondist as ad\n\n"
        "def test_rank_1_fails():\n"
        "    world = ad.init()\n"
        "    if world.rank == 1:\n"
        "        assert world.rank == 0, 'rank 1 fails this test on purpose'\n"
        "    ad.all_reduce(np.ones(3))  # rank 0 waits here until the abort ends it\n")
    temp = tmp_path / "temp"  # the ranks' system temp folder
    temp.mkdir()
    run = launch(tmp_path, 2, ["-m", "mpi4py", str(RANK_PYTEST), str(test_file), "-q", "-x",
                               "-p", "no:cacheprovider", f"--rootdir={tmp_path}"],
                 {"TMPDIR": str(temp)}, timeout=120)
    assert run.returncode != 0, run.tail()
    assert "rank 1: test_fails_on_rank_1.py::test_rank_1_fails failed" in run.ranks[1], run.tail()
    assert "AssertionError: rank 1 fails this test on purpose" in run.ranks[1], run.tail()
    assert run.seconds < 30, f"the job took {run.seconds:.0f} s to end\n{run.tail()}"
    assert "failed" not in run.ranks[0], "rank 0 did not fail; it must not be blamed"
    _assert_rank_folders_go(temp)


def _assert_rank_folders_go(temp: Path) -> None:
    """The failing rank 1 removed its temporary folder before it ended the job (rank 0's,
    killed by that abort, goes when a later rank starts: tests/unit/test_rank_folders.py)."""
    assert not list(temp.glob("axondist-rank1-*")), "the failing rank left its folder"


FAILING_TESTS = REPO / "tests" / "cluster" / "world_test_that_fails.py"


def test_a_failing_hypothesis_example_prints_its_traceback_and_ends_the_job(
        mpi_ready: None, tmp_path: Path) -> None:
    """Hypothesis shrinks and replays a failing example on the failing rank alone, whose
    collectives then wait for ranks that went on (a hang until the timeout, and no
    traceback). The first failing example prints it and ends the job instead."""
    test = f"{FAILING_TESTS}::test_one_rank_fails_one_example"
    temp = tmp_path / "temp"  # the ranks' system temp folder
    temp.mkdir()
    run = launch(tmp_path, 2, ["-m", "mpi4py", str(RANK_PYTEST), test, "-q", "-x", "-p",
                               "no:cacheprovider"],
                 {"AXONDIST_FAIL_RANKS": "1", "AXONDIST_TEST_EXAMPLES": "3",
                  "AXONDIST_TIMEOUT": "60", "TMPDIR": str(temp)}, timeout=120)
    assert run.returncode != 0, run.tail()
    assert run.seconds < 30, f"the job took {run.seconds:.0f} s to end\n{run.tail()}"
    assert "test_one_rank_fails_one_example failed (call), the job aborts now" in run.ranks[1], (
        run.tail())
    assert "AssertionError: rank 1 fails size=" in run.ranks[1], run.tail()
    assert "failing example on this rank: size=" in run.ranks[1], run.tail()
    assert "failed" not in run.ranks[0], "rank 0 did not fail; it must not be blamed"
    _assert_rank_folders_go(temp)


def test_uncaught_exception_aborts_the_job(mpi_ready: None, tmp_path: Path) -> None:
    run = launch(tmp_path, 2, [__file__, "raise_on_rank_1"], timeout=120)
    text = run.launcher + "".join(run.ranks)
    assert run.returncode != 0, run.tail()
    assert run.seconds < 60, f"the abort took {run.seconds:.0f} s\n{run.tail()}"
    assert "[axondist rank 1/2] Traceback (most recent call last):" in text, run.tail()
    assert "[axondist rank 1/2] ValueError: rank 1 fails on purpose" in text, run.tail()
    assert "[axondist rank 0/2]" not in text, "rank 0 did not fail; it must not be blamed"


@pytest.mark.parametrize("n", [2, 3])
def test_debug_mode_turns_a_shape_mismatch_into_an_error_on_every_rank(
        mpi_ready: None, tmp_path: Path, n: int) -> None:
    run = launch(tmp_path, n, [__file__, "shape_mismatch"], {"AXONDIST_DEBUG": "1"},
                 timeout=120)
    assert run.returncode == 0, run.tail()
    shapes = ", ".join(f"rank {r}: ({r + 1},)" for r in range(n))
    for r, text in enumerate(run.ranks):
        assert "shape_mismatch OK" in text, f"rank {r}\n{run.tail()}"
        assert f"all_reduce: ranks disagree on shape ({shapes})" in text, f"rank {r}\n{run.tail()}"
        flags = ", ".join(f"rank {k}: {k == 0}" for k in range(n))
        assert f"all_reduce: ranks disagree on async_op ({flags})" in text, run.tail()


@pytest.mark.parametrize("n", [2, 3])
def test_mpi_backend_checks(mpi_ready: None, tmp_path: Path, n: int) -> None:
    run = launch(tmp_path, n, [__file__, "backend"], timeout=300)
    assert run.returncode == 0, run.tail()
    for r, text in enumerate(run.ranks):
        assert "backend OK" in text, f"rank {r}\n{run.tail()}"


@pytest.mark.parametrize("n, user_value", [(2, None), (3, None), (2, "0")])
def test_big_messages_between_ranks_of_one_host_are_single_copy_and_right(
        mpi_ready: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int,
        user_value: str | None) -> None:
    """``ad.init()`` starts MPI with MPICH's single-copy reads on where the host allows them
    (kept off, or as the user set it, elsewhere), and big collectives and messages, the ones
    that take that path, match NumPy and MPI's own Allreduce bit for bit; at two ranks a torch
    tensor and a JAX array come back summed, in their own framework."""
    from axondist.backends.mpi.single_copy import CMA_VARIABLE, why_not_permitted

    env = {} if user_value is None else {CMA_VARIABLE: user_value}
    expected = user_value if user_value is not None else (
        "1" if why_not_permitted() is None else "unset")
    monkeypatch.delenv(CMA_VARIABLE, raising=False)  # the ranks see only what env says
    installed = all(importlib.util.find_spec(m) is not None for m in ("torch", "jax"))
    frameworks = "frameworks" if (n, user_value) == (2, None) and installed else "numpy"
    run = launch(tmp_path, n, [__file__, "single_copy", expected, frameworks], env, timeout=300)
    assert run.returncode == 0, run.tail()
    for r, text in enumerate(run.ranks):
        assert f"{CMA_VARIABLE}={expected}" in text, f"rank {r}\n{run.tail()}"
        assert "single_copy OK" in text, f"rank {r}\n{run.tail()}"


# --- the per-rank checks (run under mpiexec by the tests above) -----------------------------

def _raise_on_rank_1() -> None:
    import axondist as ad

    world = ad.init()
    if world.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    ad.all_reduce(np.ones(3))  # rank 0 blocks here until the abort ends it


def _shape_mismatch() -> None:
    import axondist as ad

    world = ad.init()
    try:
        ad.all_reduce(np.ones(world.rank + 1))
    except ad.CollectiveMismatchError as exc:
        print(f"CollectiveMismatchError: {exc}")
    else:
        raise AssertionError("a shape mismatch under AXONDIST_DEBUG=1 was not detected")
    try:  # MPI never matches a non-blocking collective with a blocking one
        ad.all_reduce(np.ones(2), async_op=world.rank == 0)
    except ad.CollectiveMismatchError as exc:
        print(f"CollectiveMismatchError: {exc}")
    else:
        raise AssertionError("mixing async_op across ranks under AXONDIST_DEBUG=1 was not detected")
    ad.barrier()  # the world is still usable afterwards
    x = ad.all_reduce(np.full(2, float(world.rank)))
    np.testing.assert_allclose(x, sum(range(world.world_size)))


def _inputs(seed: int, n: int, shape: tuple[int, ...], dtype: str = "float64") -> list[np.ndarray]:
    """Every rank's input for one collective (each rank can compute all of them)."""
    return [np.random.default_rng([seed, r]).standard_normal(shape).astype(dtype)
            for r in range(n)]


def _exercise(world, label: str) -> None:
    """Every collective through the comm API on ``world``, sync and async, vs NumPy."""
    import axondist as ad
    from axondist import ReduceOp

    n, rank = world.world_size, world.rank
    for k, (dtype, tol) in enumerate([("float64", 1e-12), ("float32", 1e-5), ("float16", 2e-2)]):
        xs = _inputs(k, n, (300, 3), dtype)
        got = ad.all_reduce(xs[rank].copy(), ReduceOp.AVERAGE, world)
        want = np.mean([x.astype(np.float64) for x in xs], axis=0)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=label)
        work = ad.all_reduce(xs[rank].copy(), ReduceOp.MAX, world, async_op=True)
        np.testing.assert_array_equal(work.wait(), np.max(xs, axis=0), err_msg=label)
        for root in range(n):
            y = ad.broadcast(xs[rank].copy(), world, src=root, async_op=root % 2 == 1)
            y = y.wait() if root % 2 == 1 else y
            np.testing.assert_array_equal(y, xs[root], err_msg=label)
    rows = [r + 1 for r in range(n)]  # uneven gathers
    xs = [np.full((rows[r], 2), r, np.int64) for r in range(n)]
    np.testing.assert_array_equal(ad.all_gather(xs[rank], world), np.concatenate(xs))
    gathered = ad.all_gather(xs[rank], world, async_op=True).wait()
    np.testing.assert_array_equal(gathered, np.concatenate(xs), err_msg=label)
    big = _inputs(7, n, (2 * n + 1, 4))
    got = ad.reduce_scatter(big[rank], ReduceOp.SUM, world)
    want = np.array_split(np.sum(big, axis=0), n)[rank]
    np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=label)
    got = ad.reduce_scatter(big[rank], ReduceOp.AVERAGE, world, async_op=True).wait()
    np.testing.assert_allclose(got, want / n, rtol=1e-12, err_msg=label)
    for root in range(n):
        got = ad.gather_tensor(xs[rank], world, dst=root)
        if rank == root:
            np.testing.assert_array_equal(got, np.concatenate(xs), err_msg=label)
        else:
            assert got is None, label
        got = ad.scatter_tensor(big[root] if rank == root else None, world, src=root)
        np.testing.assert_array_equal(got, np.array_split(big[root], n)[rank], err_msg=label)
    ring_to, ring_from = (rank + 1) % n, (rank - 1) % n
    if rank % 2 == 0:  # even ranks send first: no deadlock with blocking sends
        ad.send(big[rank], ring_to, world, tag=3)
        got = ad.recv(ring_from, world, tag=3)
    else:
        got = ad.recv(ring_from, world, tag=3)
        ad.send(big[rank], ring_to, world, tag=3)
    np.testing.assert_array_equal(got, big[ring_from], err_msg=label)


def _backend() -> None:
    from mpi4py import MPI

    import axondist as ad
    from axondist.backends import mpi
    from axondist.backends.mpi import MPIOptions

    world = ad.init()  # auto-detected from the launcher's environment
    n, rank = world.world_size, world.rank
    assert world.backend.name == "mpi" and n == MPI.COMM_WORLD.Get_size()
    # the library's communicator is a duplicate, never the user's COMM_WORLD
    assert MPI.Comm.Compare(world.backend.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
    # the node layout agrees with MPICH's (one machine or several hosts)
    shared = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    hosts = MPI.COMM_WORLD.allgather(MPI.Get_processor_name())
    first_rank_of_node = [hosts.index(h) for h in hosts]
    node_id = sorted(set(first_rank_of_node)).index(first_rank_of_node[rank])
    assert world.backend.node_info() == (node_id, shared.Get_rank(), shared.Get_size()), (
        world.backend.node_info(), hosts)
    shared.Free()

    _exercise(world, "default")
    for options in (MPIOptions(chunk_bytes=64), MPIOptions(host_staging="always"),
                    MPIOptions(debug=True)):
        other = ad.World(mpi.MPIBackend(MPI.COMM_WORLD.Dup(), options))
        _exercise(other, repr(options))
        other.backend.close()

    # user traffic on COMM_WORLD and axondist traffic with the same tag never cross
    if rank == 0:
        MPI.COMM_WORLD.send("user message", dest=1, tag=0)
        ad.send(np.arange(3.0), 1, tag=0)
    elif rank == 1:
        np.testing.assert_array_equal(ad.recv(0, tag=0), np.arange(3.0))
        assert MPI.COMM_WORLD.recv(source=0, tag=0) == "user message"

    # object headers and array data of one user tag live in separate tag spaces
    b = world.backend
    if rank == 0:
        b.send_object({"header": 5}, 1, tag=5)
        b.send(np.arange(4.0), 1, tag=5)
    elif rank == 1:
        data = np.empty(4)
        b.recv(data, 0, tag=5)  # the data first: it must not match the header
        np.testing.assert_array_equal(data, np.arange(4.0))
        assert b.recv_object(0, tag=5) == {"header": 5}

    # a message of the wrong size is an error, never a silent truncation
    if rank == 0:
        b.send(np.arange(10.0), 1, tag=7)
        b.send(np.arange(4.0), 1, tag=7)
    elif rank == 1:
        for _ in range(2):
            try:
                b.recv(np.empty(8), 0, tag=7)
            except ad.CollectiveMismatchError as exc:
                assert "recv from rank 0 (tag 7)" in str(exc), exc
            else:
                raise AssertionError("a wrong-size message was received without an error")
    try:
        b.send(np.ones(1), (rank + 1) % n, tag=-1)
    except ValueError as exc:
        assert "tag=-1" in str(exc)
    else:
        raise AssertionError("a negative tag was accepted")

    # sub-groups keep the order of the ranks given; non-members get a non-member group
    reverse = world.new_group(list(range(n))[::-1])
    np.testing.assert_array_equal(ad.all_gather(np.array([rank]), reverse), np.arange(n)[::-1])
    solo = world.new_group([n - 1])
    assert solo.is_member == (rank == n - 1)

    # Work.wait(timeout) of a non-blocking call times out while a peer is late
    # (every rank passes async_op=True: MPI never matches it with a blocking call)
    x = np.full(5, float(rank + 1))
    ad.barrier()  # start together: over a network, rank 0 may be far behind the others
    if rank != 0:
        time.sleep(0.5)
    work = ad.all_reduce(x, "sum", async_op=True)
    if rank == 0:
        try:
            work.wait(timeout=0.05)
        except ad.CollectiveTimeoutError:
            pass
        else:
            raise AssertionError("wait(timeout) returned although the others had not joined")
    np.testing.assert_array_equal(work.wait(), n * (n + 1) / 2)
    assert work.is_completed()
    ad.barrier()


def _single_copy(expected: str, frameworks: str) -> None:
    """What MPI started with, then big collectives and messages against NumPy and MPI (and,
    with ``frameworks`` "frameworks", a torch tensor's and a JAX array's all-reduce)."""
    import axondist as ad
    from axondist.backends.mpi.single_copy import CMA_VARIABLE

    world = ad.init()
    seen = os.environ.get(CMA_VARIABLE, "unset")
    print(f"{CMA_VARIABLE}={seen}", flush=True)
    assert seen == expected, (seen, expected)
    from mpi4py import MPI

    n, rank = world.world_size, world.rank
    numel = (4 << 20) + 3 * n + 1  # 16 MiB of float32 and an odd tail: uneven shares
    xs = _inputs(7, n, (numel,), "float32")
    total = np.zeros(numel, np.float32)
    MPI.COMM_WORLD.Allreduce(xs[rank], total, MPI.SUM)  # MPI's own bits
    np.testing.assert_array_equal(ad.all_reduce(xs[rank].copy(), "sum"), total)
    np.testing.assert_allclose(ad.all_reduce(xs[rank].copy(), "avg"), total / n, rtol=1e-6)
    want = np.array_split(sum(xs), n)[rank]  # uneven blocks: numel is not a multiple of n
    np.testing.assert_allclose(ad.reduce_scatter(xs[rank], "sum"), want, rtol=1e-5, atol=1e-5)
    gathered = ad.all_gather(xs[rank], sizes=[numel] * n)
    np.testing.assert_array_equal(gathered, np.concatenate(xs))
    root = xs[n - 1].copy() if rank == n - 1 else np.zeros(numel, np.float32)
    np.testing.assert_array_equal(ad.broadcast(root, src=n - 1), xs[n - 1])
    if rank == 0:
        ad.send(xs[0], 1)
    elif rank == 1:
        np.testing.assert_array_equal(ad.recv(0), xs[0])
    if frameworks == "frameworks":
        import jax.numpy as jnp
        import torch

        tensor = ad.all_reduce(torch.from_numpy(xs[rank].copy()), "sum")
        assert isinstance(tensor, torch.Tensor), type(tensor)
        np.testing.assert_array_equal(tensor.numpy(), total)
        array = ad.all_reduce(jnp.asarray(xs[rank]), "sum")
        assert type(array).__module__.startswith("jax"), type(array)
        np.testing.assert_array_equal(np.asarray(array), total)
    ad.barrier()


CHECKS = {"raise_on_rank_1": _raise_on_rank_1, "shape_mismatch": _shape_mismatch,
          "backend": _backend, "single_copy": _single_copy}

if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # the checkout's axondist
    CHECKS[sys.argv[1]](*sys.argv[2:])
    print(f"{sys.argv[1]} OK", flush=True)
