"""The quick tier, ``pytest -m "not slow"``: which tests are slow, by place.

The quick tier runs every module's core properties on the mock world and one ``mpiexec -n 2``
launch (:data:`QUICK_LAUNCH`). ``slow`` marks (tests/conftest.py adds it) what costs seconds
to minutes each: the places below, and every other test that launches mpiexec (the ``mpi``
marker)."""

from __future__ import annotations

import pytest

#: Folders whose every test is slow: each failure case runs under its own timeout, on the mock
#: world and under mpiexec -n 2/3; the simulated hosts start several launches per test.
SLOW_FOLDERS = ("tests/faults/", "tests/cluster/")

#: Files whose every test is slow: the docs site build, the examples (each trains a model
#: twice), the benchmark runner's runs, the torchrun launches.
SLOW_FILES = frozenset({
    "tests/world/test_torch_launch.py",
    "tests/integration/test_docs_build.py",
    "tests/integration/test_examples.py",
    "tests/integration/test_benchmarks_runner.py",
    "tests/integration/test_launch_doors.py",
})

#: Single tests (any parameters) that launch processes, run an example-sized training, rerun
#: other test files, wait out a timeout (failure paths, like tests/faults/) or type-check the
#: package (mypy: half a minute; ruff stays quick).
SLOW_TESTS = frozenset({
    "tests/integration/test_lint.py::test_mypy_is_clean",
    "tests/world/test_one_loop.py::test_the_script_agrees_for_every_strategy",
    "tests/world/test_one_loop.py::test_the_script_exits_non_zero_when_it_disagrees",
    "tests/world/test_one_loop.py::test_the_script_under_mpiexec_matches_threads",
    "tests/world/test_one_loop.py::test_the_script_under_axondist_run",
    "tests/world/test_fsdp.py::test_hybrid_shard_built_and_closed_many_times",
    "tests/world/test_differentiable.py::test_gradients_match_one_process_and_finite_differences",
    "tests/world/test_differentiable.py::"
    "test_every_case_at_two_and_three_ranks_in_both_frameworks",
    "tests/world/test_differentiable.py::"
    "test_plain_collectives_inside_jit_and_vmap_equal_the_eager_call",
    "tests/world/test_differentiable.py::"
    "test_jit_of_vmap_of_grad_equals_the_per_example_gradients",
    "tests/world/test_expert_parallel.py::test_torch_and_jax_arrays_come_back_in_their_framework",
    "tests/world/test_expert_parallel.py::"
    "test_expert_shards_reshard_from_two_ranks_to_four_and_one",
    "tests/world/test_expert_parallel.py::"
    "test_expert_shards_saved_from_a_mesh_load_in_one_process",
    "tests/integration/test_nccl_fake_backend.py::test_the_gpu_test_file_passes_on_the_cpu_stand_in",
    "tests/integration/test_nccl_fake_backend.py::"
    "test_the_cupy_world_test_files_pass_on_the_cpu_stand_in",
    "tests/integration/test_nccl_fake_wrappers.py::"
    "test_real_data_examples_train_on_cupy_arrays_on_the_stand_in",
    "tests/integration/test_nccl_fake_wrappers.py::test_real_data_examples_say_what_a_gpu_run_lacks",
    "tests/integration/test_watchdog.py::test_a_host_that_stops_answering_is_cut_off_after_the_setting",
    "tests/integration/test_watchdog.py::test_a_host_never_reached_is_left_to_the_timeout",
    "tests/integration/test_nccl_fake_backend.py::"
    "test_a_rank_that_skips_a_collective_times_out_with_the_watchdogs_report",
})

#: The one mpiexec launch of the quick tier: the MPI backend's own checks on two processes.
QUICK_LAUNCH = "tests/world/test_mpi_launch.py::test_mpi_backend_checks[2]"

#: Properties of the MPI backend's own machinery (its plan cache): on the mock world they check
#: only what other tests check, at 5-20 s each, so they run under mpiexec alone
#: (tests/world/test_mpi_launch.py reruns the world tests there).
MPI_ONLY = frozenset({
    "tests/world/test_riding_checks.py::test_more_shapes_than_the_plan_cache_holds",
})


def place(item: pytest.Item) -> tuple[str, str]:
    """``(file, file::test)`` of an item, relative to the repository, without parameters."""
    path = item.nodeid.split("::")[0]
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    return path, f"{path}::{name}"


def is_slow(item: pytest.Item) -> bool:
    """Whether ``item`` belongs to the slow tier (see the tables above)."""
    path, test = place(item)
    if item.nodeid == QUICK_LAUNCH:
        return False
    return (path.startswith(SLOW_FOLDERS) or path in SLOW_FILES or test in SLOW_TESTS
            or item.get_closest_marker("mpi") is not None)
