"""Shared test settings: seeded randomness, hypothesis profiles, rank in the header."""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil
import sys
import tempfile
from typing import Any

# A run starts pytest in many processes (the workers, every rank of a launched world run,
# the simulated hosts): with bytecode writing off (PYTHONDONTWRITEBYTECODE) each would
# rewrite the asserts of every test module again, 7 CPU-seconds a process. The rewritten
# modules are kept in the tests' __pycache__ folders (git ignores them) and reused.
sys.dont_write_bytecode = False

# Many mock-world ranks on threads each calling BLAS would oversubscribe the
# cores with BLAS threads; one BLAS thread per rank, set before NumPy loads.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import coverage_table  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from rank_folders import make_rank_folder, remove_rank_folder  # noqa: E402
from shm_segments import remove_orphans  # noqa: E402
from tiers import MPI_ONLY, SLOW_FILES, SLOW_FOLDERS, is_slow, needs_three_ranks, place  # noqa: E402

settings.register_profile(
    "default",
    deadline=None,
    max_examples=int(os.environ.get("AXONDIST_TEST_EXAMPLES", "40")),
    derandomize=True,
    database=None,
    # too_slow is the one time-based health check: on a loaded machine it fires on some
    # MPI ranks and not others, and ranks that stop drawing examples at different points
    # would wait for each other forever. Every other health check stays on.
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("default")

# Short collective timeout: a test that would hang fails quickly instead.
os.environ.setdefault("AXONDIST_TIMEOUT", "60")

#: pytest-xdist workers of a plain ``pytest`` run, each taking whole scopes (:func:`_group`);
#: ``AXONDIST_TEST_WORKERS=1`` (or ``-n 0``) runs in one process. A worker runs files in an
#: order one process never does, so no test may leave state behind (:func:`_no_world_left_behind`).
WORKERS = int(os.environ.get("AXONDIST_TEST_WORKERS", "2"))
#: Workers of a quick-tier run (``-m "not slow"``) unless ``AXONDIST_TEST_WORKERS`` says:
#: its longest tests mostly wait (the watchdog's looks, a cycle's second of stillness), so
#: more workers than cores fill the waits. On 2 cores, idle: 61.9 s with 2 workers, 53.7
#: with 3, 49.4 with 4; beside two busy loops 92.6 s with 2, 72.8 with 4. The whole suite
#: keeps :data:`WORKERS`: its launched jobs fill every core themselves.
QUICK_WORKERS = int(os.environ.get("AXONDIST_TEST_WORKERS", "4"))


#: The xdist scope of the launched world runs (minutes each, every core busy): one worker runs
#: them in turn, first, while the other works through the rest.
LAUNCHED_WORLDS = "launched world runs"


def _group(path: str, test: str) -> str:
    """The xdist scope of test ``test`` of file ``path``: the file (a fault module starts its
    runs once), the simulated cluster's folder (built once), or :data:`LAUNCHED_WORLDS`."""
    if test in ("test_world_tests_pass_under_mpiexec", "test_world_tests_pass_under_torchrun"):
        return LAUNCHED_WORLDS
    return "tests/cluster" if path.startswith("tests/cluster/") else path


def _item_group(item: pytest.Item) -> str:
    path, test = place(item)
    return _group(path, test.split("::")[-1])


def _launched_rank() -> bool:
    return any(os.environ.get(v) is not None for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK",
                                                        "RANK"))


def _dist_given(config: pytest.Config) -> bool:
    return any(arg == "--dist" or arg.startswith("--dist=")
               for arg in config.invocation_params.args)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Run on :data:`WORKERS` workers unless ``-n`` says otherwise, grouped (see
    :func:`_group`) unless ``--dist`` says otherwise; a launched rank, a collection and a
    debugger session run in this process."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if "PYTEST_XDIST_WORKER" in os.environ:
        # a worker reads the command line again, without the choice made below
        config.option.axondist_grouped = not _dist_given(config)
        return
    if _launched_rank() or config.option.collectonly or config.option.usepdb:
        return
    if config.option.numprocesses is None:
        quick = " ".join((config.option.markexpr or "").split()) == "not slow"
        workers = QUICK_WORKERS if quick else WORKERS
        if workers < 2:
            return
        config.option.numprocesses = workers
    if config.option.dist == "no":
        config.option.dist = "loadscope"
        config.option.axondist_grouped = True


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown where xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduling by scope, each test's scope its :func:`_group` (xdist's own
    ``xdist_group`` marks need a node id pytest 9.2 no longer lets a plugin change)."""
    if not getattr(config.option, "axondist_grouped", False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, rest = nodeid.partition("::")
            return _group(path, rest.split("[")[0])

    # scopes in the order of the workers' collection (:func:`_longest_first`), not xdist's
    # largest count of tests first: a launched world run is four tests and minutes long
    config.option.loadscopereorder = False
    return ByGroup(config, log)


def _longest_first(items: list[pytest.Item]) -> None:
    """Sort a grouped run's ``items`` into the order its workers take their scopes: the
    launched world runs first, then the slow tier's folders and files (seconds to minutes
    each), then the rest; within each, scopes with more tests first (xdist's own measure).
    The last scopes a worker takes are then short, and both workers end together."""
    groups = [_item_group(item) for item in items]
    sizes = collections.Counter(groups)

    def place_of(index: int) -> tuple[int, int, str]:
        group = groups[index]
        if group == LAUNCHED_WORLDS:
            return 0, 0, group
        slow = group.startswith(SLOW_FOLDERS) or group in SLOW_FILES
        return 1 if slow else 2, -sizes[group], group

    order = sorted(range(len(items)), key=place_of)
    items[:] = [items[i] for i in order]


class _WorkerOrder:
    """A grouped run's worker sorts the tests it will run (after ``-m`` and ``-k``) with
    :func:`_longest_first`; xdist hands out the scopes in that order."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        _longest_first(items)


def pytest_configure(config: pytest.Config) -> None:
    """Under ``mpiexec`` or ``torchrun`` each rank gets its own temporary folder
    (tests/rank_folders.py), removed when its session ends. A worker of a grouped run
    orders its tests (:class:`_WorkerOrder`)."""
    if getattr(config.option, "axondist_grouped", False):
        config.pluginmanager.register(_WorkerOrder(), "axondist-worker-order")
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK",
                                                     os.environ.get("RANK")))
    if rank is not None and config.option.basetemp is None:
        global _RANK_BASETEMP
        _RANK_BASETEMP = make_rank_folder(rank)
        config.option.basetemp = _RANK_BASETEMP
    _share_jax_compilations()


#: The JAX compilation cache this session made (removed when it ends), or None.
_JAX_CACHE: str | None = None


def _share_jax_compilations() -> None:
    """One JAX compilation cache for every process of the session (its workers, the launched
    ranks, the fault cases' processes): each program is compiled once, not once per rank and
    world run (the differentiable world tests: 30 s per launch, 12 s once compiled). The
    cache takes every program however fast it compiles, and is locked while an entry is
    read or written (its size bound turns JAX's file lock on: no process reads an entry half
    written). Left alone where the user set a cache of their own or filelock is missing."""
    global _JAX_CACHE
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or importlib.util.find_spec("filelock") is None:
        return
    _JAX_CACHE = tempfile.mkdtemp(prefix="axondist-jax-cache-")
    os.environ.update({"JAX_COMPILATION_CACHE_DIR": _JAX_CACHE,
                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
                       "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30)})


def pytest_unconfigure(config: pytest.Config) -> None:
    if _JAX_CACHE is not None:
        shutil.rmtree(_JAX_CACHE, ignore_errors=True)


#: The temporary folder made for this rank of a launched run (removed when the run ends).
_RANK_BASETEMP: str | None = None
#: Seconds each test took (setup, call and teardown), by node id, for the timing summary.
_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    """Where the time went, in every single-process run (CI's log keeps it): seconds per
    folder and the 25 slowest tests."""
    if _RANK_BASETEMP is not None or not _SECONDS:
        return
    by_folder: dict[str, float] = {}
    for nodeid, seconds in _SECONDS.items():
        folder = nodeid.split("::")[0].rsplit("/", 1)[0]
        by_folder[folder] = by_folder.get(folder, 0.0) + seconds
    write = terminalreporter.write_line
    terminalreporter.section("time per folder")
    for folder, seconds in sorted(by_folder.items(), key=lambda kv: -kv[1]):
        write(f"{seconds:8.1f} s  {folder}")
    terminalreporter.section("25 slowest tests")
    for nodeid, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1])[:25]:
        write(f"{seconds:8.1f} s  {nodeid}")


@pytest.hookimpl(tryfirst=True)  # before -m and -k select
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow tier (tests/tiers.py); skip the MPI-only properties outside mpiexec. Then
    ``AXONDIST_TEST_EXAMPLES`` caps every hypothesis test, also those that pin their own
    ``max_examples`` (the mpiexec relaunch runs every world test on a few examples)."""
    from axondist._environment import launched_by_mpi

    under_mpi = launched_by_mpi()
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)
        if needs_three_ranks(item):
            item.add_marker(pytest.mark.three_ranks)
        if not under_mpi and place(item)[1] in MPI_ONLY:
            item.add_marker(pytest.mark.skip(
                reason="a property of the MPI backend's own machinery: runs under mpiexec "
                       "(tests/world/test_mpi_launch.py), not on the mock world"))
    coverage_table.record(items)  # for tests/unit/test_coverage_table.py, before -m and -k
    cap = os.environ.get("AXONDIST_TEST_EXAMPLES")
    if cap is None:
        return
    for item in items:
        test = getattr(item, "obj", None)
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if own is not None and own.max_examples > int(cap):
            test._hypothesis_internal_use_settings = settings(own, max_examples=int(cap))


def pytest_report_header(config: pytest.Config) -> str:
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    size = os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE"))
    where = f"MPI rank {rank} of {size}" if rank is not None else "single process"
    if rank is None and os.environ.get("RANK") is not None:
        where = f"torchrun rank {os.environ['RANK']} of {os.environ.get('WORLD_SIZE')}"
    return f"axondist tests: {where}, numpy {np.__version__}"


@pytest.fixture(autouse=True)
def _no_world_left_behind() -> Any:
    """A test that starts this process's world (``init()``, or a collective called outside
    any world) must destroy it: a world left behind becomes the next test's default group
    and its log records' rank. Launched ranks keep their one world for the whole session."""
    from axondist import process_group

    before = process_group._process_world
    yield
    left = process_group._process_world
    if left is before or _launched_rank():
        return
    process_group.set_process_world(before)
    if left is not None and left._backend is not None:
        pytest.fail(f"this test left this process's world behind ({left!r}): destroy it "
                    "before the test ends, or run the body with run_world or spawn",
                    pytrace=False)


@pytest.fixture
def started_world() -> Any:
    """For a test of a call that, given no group outside any world, starts this process's
    world (a one-rank mock world here): destroys the world it started when the test ends."""
    from axondist import process_group

    before = process_group._process_world
    yield
    left = process_group._process_world
    if left is not None and left is not before:
        left.destroy()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


def _controller() -> bool:
    """Whether this process runs the session itself: no xdist worker, no launched rank."""
    return "PYTEST_XDIST_WORKER" not in os.environ and not _launched_rank()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remove MPICH's segments earlier runs left (:mod:`shm_segments`): on a machine that
    ran the suite for a day they held most of its memory."""
    if _controller():
        remove_orphans()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under ``mpiexec`` or ``torchrun``, a failing rank ends the job instead of leaving its
    peers waiting (torchrun stops the others when one rank exits with an error)."""
    from axondist._environment import env_launch_size, launched_by_mpi

    remove_rank_folder(_RANK_BASETEMP)  # nothing left behind in the system's temp folder
    if _controller():
        remove_orphans()  # nor MPICH's segments of the jobs killed on purpose
    if exitstatus not in (0, 5) and not launched_by_mpi() and env_launch_size() is not None:
        from axondist.backends.watchdog.watchdog import silence_all

        silence_all()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(exitstatus))
    if exitstatus not in (0, 5) and launched_by_mpi():
        from mpi4py import MPI

        from axondist.backends.watchdog.watchdog import silence_all

        silence_all()  # this rank fails the run: not a departure for the others to report

        MPI.COMM_WORLD.Abort(int(exitstatus))
