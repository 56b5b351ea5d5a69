"""Which test covers each behaviour on each backend, launcher and world size, as data.

Each :class:`Behaviour` names one test and the columns of :data:`COLUMNS` it covers; a column
another test covers names that test; a column no test covers says why (``why_not``).
docs/testing.md shows the table :func:`render` makes from these rows
(``python tests/coverage_table.py --write`` rewrites it). tests/unit/test_coverage_table.py
collects every named test and checks each cell can be run where it claims; the launchers'
world runs (tests/world/test_mpi_launch.py, test_torch_launch.py) check that every world test
named for their column passed on every rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MOCK, MPI_2, MPI_3, TORCH_2, TORCH_3 = "mock", "mpiexec 2", "mpiexec 3", "torchrun 2", "torchrun 3"
#: The table's columns: the mock world on threads (each test draws or names its sizes, 1 to
#: 8 ranks), then each launcher at two and three processes.
COLUMNS = (MOCK, MPI_2, MPI_3, TORCH_2, TORCH_3)
#: Each launched column's launcher and number of ranks.
LAUNCHED = {MPI_2: ("mpiexec", 2), MPI_3: ("mpiexec", 3), TORCH_2: ("torchrun", 2),
            TORCH_3: ("torchrun", 3)}
EVERY = COLUMNS
#: The mock world and both launchers at two ranks: a third rank adds nothing here.
PAIRS = (MOCK, MPI_2, TORCH_2)
MPI = (MPI_2, MPI_3)

ROOT = Path(__file__).resolve().parents[1]
#: The files that launch jobs themselves: their tests name one job each, not a world test.
LAUNCH_FILES = ("tests/world/test_mpi_launch.py", "tests/world/test_torch_launch.py")

NO_THIRD_RANK = "a third rank adds nothing: no split, order or middle rank depends on it"
#: Why the shared buffers' rows stop at two ranks.
_NO_SHARING_AT_THREE = ("only a group of two shares memory; at three there are no shared "
                        "buffers, as on the mock world")
MPI_MACHINERY = "a property of the MPI backend's own machinery (MPI calls, plans, MPICH's limits)"


@dataclass(frozen=True)
class Behaviour:
    """One row: what is checked, the test that checks it, and where."""

    what: str
    """The behaviour, in a few words."""
    test: str
    """The test id (``path::name``, or ``path::name[param]`` for one parameter)."""
    where: tuple[str, ...]
    """The columns :attr:`test` covers."""
    others: tuple[tuple[str, str], ...] = ()
    """``(column, test id)`` for the columns another test covers."""
    why_not: str = ""
    """Why no test covers the remaining columns (required when one is left)."""

    def cells(self) -> dict[str, str]:
        """Column -> test id, for the columns a test covers."""
        return {**{column: self.test for column in self.where}, **dict(self.others)}


def _world(path: str, name: str) -> str:
    return f"tests/world/{path}::{name}"


def _collective(what: str, name: str) -> Behaviour:
    return Behaviour(what, _world("test_collectives.py", name), EVERY)


BEHAVIOURS: tuple[Behaviour, ...] = (
    # --- collectives ------------------------------------------------------------------------
    _collective("all_reduce: every op and dtype, on the world and on subgroups",
                "test_all_reduce_matches_numpy"),
    _collective("float sums: the same bits on every call, summed in rank order",
                "test_float_sums_are_reproducible"),
    _collective("broadcast from every root", "test_broadcast_copies_the_source"),
    _collective("all_gather of uneven rows", "test_all_gather_concatenates_uneven_rows"),
    _collective("gather onto one destination", "test_gather_tensor_lands_on_dst_only"),
    _collective("scatter splits like numpy.array_split",
                "test_scatter_tensor_splits_like_array_split"),
    _collective("reduce_scatter of uneven rows", "test_reduce_scatter_matches_numpy"),
    _collective("reduce onto one destination", "test_reduce_matches_numpy_on_the_destination_only"),
    _collective("all_to_all with uneven splits",
                "test_all_to_all_matches_numpy_with_uneven_splits"),
    _collective("send and recv around a ring", "test_send_recv_carries_shape_and_dtype"),
    _collective("async handles complete with their results",
                "test_async_handles_complete_with_results"),
    _collective("half-precision averages neither overflow nor underflow",
                "test_half_precision_average_never_overflows_or_underflows"),
    _collective("min and max carry a NaN from whichever rank holds it",
                "test_min_max_propagate_nan_whichever_rank_holds_it"),
    _collective("object collectives", "test_object_collectives_match_their_definitions"),
    _collective("monitored_barrier, and groups freed",
                "test_monitored_barrier_passes_when_all_arrive_and_groups_are_freed"),
    _collective("bad local input gets our error on every rank",
                "test_bad_local_input_gets_clear_errors"),
    # --- how the backends move data -----------------------------------------------------------
    Behaviour("small all_reduces on both sides of the riding limit",
              _world("test_riding_checks.py", "test_all_reduce_on_both_sides_of_the_riding_limit"),
              EVERY),
    Behaviour("small reduce_scatters on both sides of the two-rank ride's limits",
              _world("test_riding_checks.py", "test_small_reduce_scatters_match_numpy"), EVERY),
    Behaviour("sized all_gathers on both sides of the two-rank ride's limits",
              _world("test_riding_checks.py", "test_all_gather_on_both_sides_of_the_riding_limit"),
              EVERY),
    Behaviour("unsized all_gathers (row counts exchanged first)",
              _world("test_gather_rows.py", "test_unsized_all_gathers_match_numpy"), EVERY),
    Behaviour("means on both sides of the pair-halves threshold",
              _world("test_pair_halves.py", "test_means_on_both_sides_of_the_halves_threshold"),
              EVERY),
    Behaviour("reduce_scatter of uneven and even rows, big buffers",
              _world("test_mpi_pieces.py",
                     "test_reduce_scatter_of_uneven_and_even_rows_matches_numpy"), EVERY),
    Behaviour("a mean is the sum divided by n, bit for bit",
              _world("test_mpi_pieces.py", "test_average_is_the_sum_divided_by_n_bit_for_bit"),
              MPI, why_not=MPI_MACHINERY),
    Behaviour("big all_reduces go in pieces on one node",
              _world("test_mpi_pieces.py",
                     "test_big_all_reduces_go_in_pieces_on_one_node_and_broadcasts_whole"),
              (MPI_2,), why_not=f"{MPI_MACHINERY}; it counts MPI calls, the same at any size"),
    Behaviour("sums and means keep the bits of MPI's own Allreduce",
              _world("test_mpi_bits.py", "test_sum_and_average_have_the_bits_of_mpis_allreduce"),
              MPI, why_not=f"{MPI_MACHINERY}; 4 and 5 ranks: "
                           "test_mpi_launch.py::test_mpi_bits_hold_at_four_and_five_ranks"),
    Behaviour("weighted sums of buffers both ranks map have the ordinary bits",
              _world("test_shared_buckets.py",
                     "test_a_shared_weighted_sum_has_the_ordinary_paths_bits"), PAIRS,
              why_not=_NO_SHARING_AT_THREE),
    Behaviour("weighted reduce-scatters of buffers both ranks map have the ordinary bits",
              _world("test_shared_buckets.py",
                     "test_a_shared_weighted_reduce_scatter_has_the_ordinary_paths_bits"), PAIRS,
              why_not=_NO_SHARING_AT_THREE),
    Behaviour("FSDP packs gradients in shared memory where it can, counted, freed with it",
              _world("test_shared_buckets.py", "test_fsdp_packs_gradients_in_shared_memory_"
                     "where_it_can_counted_and_freed"), PAIRS, why_not=_NO_SHARING_AT_THREE),
    Behaviour("FSDP's shared packing takes torch and JAX gradients as NumPy ones",
              _world("test_shared_buckets.py",
                     "test_fsdp_packs_torch_and_jax_gradients_as_numpy_ones"), PAIRS,
              why_not=_NO_SHARING_AT_THREE),
    Behaviour("DDP's buckets shared where the group can, freed with it",
              _world("test_shared_buckets.py", "test_ddp_buckets_are_shared_where_the_group_"
                     "shares_memory_and_freed_with_it"), PAIRS, why_not=_NO_SHARING_AT_THREE),
    Behaviour("a shared buffer meeting an ordinary one is named",
              _world("test_shared_buckets.py", "test_a_shared_buffer_meeting_an_ordinary_one_"
                     "is_named_and_the_next_call_works"),
              (MPI_2,), why_not=f"{MPI_MACHINERY}; only two MPI ranks of one host share memory"),
    Behaviour("a rank that cannot map the other's shared buffer is named on both",
              _world("test_shared_buckets.py", "test_a_rank_that_cannot_map_the_other_is_"
                     "named_and_nothing_hangs"),
              (MPI_2,), why_not=f"{MPI_MACHINERY}; only two MPI ranks of one host share memory"),
    Behaviour("more shapes than the plan cache holds",
              _world("test_riding_checks.py", "test_more_shapes_than_the_plan_cache_holds"),
              (MPI_2,), why_not=f"{MPI_MACHINERY}; the cache's bound is the same at any size"),
    Behaviour("collective plans keep no arrays",
              _world("test_plan_memory.py", "test_collective_plans_keep_no_arrays"), MPI,
              why_not=MPI_MACHINERY),
    Behaviour("a warm 4 KiB all_reduce within its Python budget",
              _world("test_call_cost.py",
                     "test_a_warm_4_kib_all_reduce_stays_within_its_python_budget"), EVERY),
    Behaviour("the backend's own checks (uneven blocks, a wrong-size receive, ...)",
              _world("test_torch_backend.py",
                     "test_the_torch_backend_pads_uneven_blocks_checks_sizes_and_reduces_in_place"),
              (TORCH_2, TORCH_3),
              others=(
                  (MPI_2, "tests/world/test_mpi_launch.py::test_mpi_backend_checks[2]"),
                  (MPI_3, "tests/world/test_mpi_launch.py::test_mpi_backend_checks[3]")),
              why_not="what a launched backend arranges itself (the mock world's own: "
                      "test_mock_world.py)"),
    Behaviour("torch: two-member all-reduce, reduce-scatter, all-gather on the group's sockets",
              _world("test_torch_backend.py",
                     "test_a_pair_all_reduce_on_the_groups_sockets_equals_gloos"),
              (TORCH_2, TORCH_3),
              why_not="the torch backend's own algorithm (MPI's two-rank all-reduces: "
                      "test_pair_halves.py, test_riding_checks.py)"),
    Behaviour("torch: sums in rank order and all-gathers on the group's sockets",
              _world("test_torch_backend.py",
                     "test_sums_in_rank_order_and_all_gathers_on_the_groups_sockets_equal_gloos"),
              (TORCH_2, TORCH_3),
              why_not="the torch backend's own algorithm (the mock world's and MPI's sums: "
                      "test_collectives.py, test_mpi_bits.py)"),
    Behaviour("torch: every reduction on the group's sockets combines as the mock world",
              _world("test_torch_backend.py",
                     "test_every_reduction_on_the_groups_sockets_combines_as_the_mock_world"),
              (TORCH_2, TORCH_3),
              why_not="the torch backend's own algorithm (every backend's reductions: "
                      "test_collectives.py)"),
    Behaviour("torch: gathers, scatters, all-to-alls and reduces on the group's sockets",
              _world("test_torch_backend.py",
                     "test_gathers_scatters_all_to_alls_and_reduces_on_the_groups_sockets_equal_"
                     "gloos"),
              (TORCH_2, TORCH_3),
              why_not="the torch backend's own algorithm (every backend's: test_collectives.py)"),
    Behaviour("all-gather blocks on both sides of a size limit meet, with and without sizes",
              _world("test_gather_rows.py",
                     "test_blocks_on_both_sides_of_the_pair_exchange_limit_meet"), PAIRS,
              why_not="the limit is the MPI backend's two-rank exchange's (every table's choice "
                      "is the same on every rank: tests/unit/test_choose.py, "
                      "test_torch_choose.py)"),
    Behaviour("a wrong out on one rank of an unsized pair all-gather: named, nothing left",
              _world("test_gather_rows.py", "test_a_wrong_out_on_one_rank_of_a_pair_is_named_"
                     "there_and_the_other_gets_its_result"),
              (MPI_2,), why_not=f"{MPI_MACHINERY}; elsewhere a rank that refuses its out "
                                "leaves the others in the call, for the watchdog to name"),
    Behaviour("torch: a rank's read-only input takes the others' path",
              _world("test_torch_backend.py",
                     "test_a_rank_passing_a_read_only_input_still_meets_the_others"),
              (TORCH_2, TORCH_3),
              why_not="the torch backend's own table (MPI's plans never read the layout: "
                      "backends/mpi/choose.py)"),
    Behaviour("torch: messages of host memory on the world's own connections",
              _world("test_torch_backend.py",
                     "test_messages_of_host_memory_travel_on_the_worlds_own_connections"),
              (TORCH_2, TORCH_3),
              why_not="the torch backend's own transport (MPI's messages are MPI's; the mock "
                      "world's are queues)"),
    Behaviour("AXONDIST_DEBUG=1: a shape mismatch is an error on every rank",
              "tests/world/test_mpi_launch.py::"
              "test_debug_mode_turns_a_shape_mismatch_into_an_error_on_every_rank[2]", (MPI_2,),
              others=((MPI_3, "tests/world/test_mpi_launch.py::"
                              "test_debug_mode_turns_a_shape_mismatch_into_an_error_on_every_rank"
                              "[3]"),
                      (MOCK, "tests/world/test_mock_world.py::"
                             "test_mismatched_shapes_raise_on_every_rank_naming_them")),
              why_not="torch: tests/faults/test_mismatch_texts.py (the fault suite)"),
    Behaviour("a failing launched test prints its traceback and ends the job",
              "tests/world/test_mpi_launch.py::"
              "test_a_failing_world_test_prints_its_traceback_before_the_job_aborts", (MPI_2,),
              why_not="the same per-rank runner under every launcher; the mock world has no job"),
    Behaviour("MPICH's single-copy reads on where the host allows; big calls keep MPI's bits",
              "tests/world/test_mpi_launch.py::"
              "test_big_messages_between_ranks_of_one_host_are_single_copy_and_right[2-None]",
              (MPI_2,), others=((MPI_3, "tests/world/test_mpi_launch.py::"
                                 "test_big_messages_between_ranks_of_one_host_are_single_copy_"
                                 "and_right[3-None]"),),
              why_not="a setting of MPICH's shared-memory transport: no other backend has it"),
    Behaviour("a receive cycle is a deadlock, with collectives around it",
              _world("test_mock_concurrency.py",
                     "test_receive_cycle_is_still_a_deadlock_with_collectives_around_it"),
              (MOCK,), why_not="the mock world's own detection (launched: tests/faults/)"),
    Behaviour("a wait cycle through a collective is a deadlock, named within seconds",
              _world("test_mock_concurrency.py",
                     "test_a_cycle_through_a_collective_is_named_long_before_the_timeout"),
              (MOCK,), why_not="the mock world's own detection (launched: the watchdog's, "
                               "tests/faults/test_faults.py)"),
    # --- DDP ------------------------------------------------------------------------------------
    Behaviour("DDP trains like one process (synchronous and overlapped, weighted)",
              _world("test_ddp.py", "test_ddp_training_matches_one_process"), EVERY),
    Behaviour("DDP: unequal batches need num_samples",
              _world("test_ddp.py", "test_unequal_batches_need_num_samples"), EVERY),
    Behaviour("DDP: no_sync accumulation equals one big batch",
              _world("test_ddp.py", "test_no_sync_accumulation_equals_big_batch"), PAIRS,
              why_not=NO_THIRD_RANK),
    Behaviour("DDP overlapped keeps the synchronous bits",
              _world("test_ddp_overlapped_bits.py",
                     "test_ddp_overlapped_keeps_synchronous_bits_with_default_pieces"), EVERY),
    Behaviour("DDP with persistent all_reduces trains like one process",
              _world("test_ddp_persistent.py",
                     "test_overlapped_persistent_training_matches_one_process"), PAIRS,
              why_not=NO_THIRD_RANK),
    Behaviour("clip_grad_norm: a NaN or inf on one rank reaches every rank",
              _world("test_ddp.py", "test_clip_grad_norm_nan_and_inf_on_one_rank_reach_every_rank"),
              EVERY),
    # --- FSDP and ZeRO ------------------------------------------------------------------------
    Behaviour("FSDP trains like one process, every strategy",
              _world("test_fsdp.py", "test_training_matches_single_process"), EVERY),
    Behaviour("FSDP sharded checkpoints load at other world sizes",
              _world("test_fsdp.py", "test_sharded_checkpoint_across_world_sizes"), EVERY),
    Behaviour("FSDP refuses different models on every rank",
              _world("test_fsdp.py", "test_different_models_are_refused_on_every_rank"), EVERY),
    Behaviour("FSDP HYBRID_SHARD built and closed hundreds of times",
              _world("test_fsdp.py", "test_hybrid_shard_built_and_closed_many_times"), PAIRS,
              why_not=NO_THIRD_RANK),
    Behaviour("FSDP layered steps with prefetch train like one process",
              _world("test_fsdp_prefetch.py", "test_layered_step_matches_single_process"), EVERY),
    Behaviour("ZeRO trains like the unsharded optimizer",
              _world("test_zero.py", "test_trains_like_the_unsharded_optimizer"), EVERY),
    Behaviour("ZeRO sharded checkpoints: two ranks to three to one",
              _world("test_zero.py", "test_sharded_checkpoint_two_to_three_to_one_rank"), EVERY),
    Behaviour("a checkpoint moves from DDP to FSDP to tensor parallel to one process",
              _world("test_checkpoint_world.py",
                     "test_ddp_to_fsdp_to_tensor_parallel_to_one_process"), EVERY),
    # --- model parallelism ----------------------------------------------------------------------
    Behaviour("every pipeline schedule equals sequential full-batch training",
              _world("test_pipeline.py", "test_every_schedule_equals_sequential_full_batch"),
              EVERY),
    Behaviour("pipeline: large activations do not deadlock",
              _world("test_pipeline.py", "test_large_activations_do_not_deadlock"), EVERY),
    Behaviour("pipeline: bad batches fail on every rank",
              _world("test_pipeline.py", "test_bad_batches_fail_on_every_rank"), EVERY),
    Behaviour("tensor parallel: column-parallel layers equal the dense layer",
              _world("test_tensor_parallel.py", "test_column_parallel_matches_dense"), EVERY),
    Behaviour("tensor x data parallel training equals dense training",
              _world("test_tensor_parallel.py", "test_tp_x_dp_training_matches_dense_training"),
              EVERY),
    Behaviour("context parallel: every method and layout equals the reference",
              _world("test_context_parallel.py",
                     "test_every_method_and_layout_matches_the_reference"), EVERY),
    Behaviour("expert parallel: the dropless layer equals the reference",
              _world("test_expert_parallel.py", "test_dropless_layer_matches_the_reference"),
              EVERY),
    # --- arrays of other frameworks, autodiff, float16 ------------------------------------------
    Behaviour("differentiable collectives: gradients equal one process's",
              _world("test_differentiable.py",
                     "test_gradients_match_one_process_and_finite_differences"), PAIRS,
              why_not=NO_THIRD_RANK),
    Behaviour("torch and JAX arrays of every dtype through the collectives",
              _world("test_framework_arrays.py",
                     "test_every_dtype_round_trips_through_the_collectives"), PAIRS,
              why_not=NO_THIRD_RANK),
    Behaviour("DDP leaves the average in torch's own .grad",
              _world("test_doors.py", "test_ddp_leaves_the_average_in_torchs_own_grad"), PAIRS,
              why_not=NO_THIRD_RANK),
    Behaviour("float16 loss scaling: one rank's overflow skips the step on every rank",
              _world("test_amp_training.py", "test_every_rank_skips_when_one_rank_overflows"),
              PAIRS, why_not=NO_THIRD_RANK),
)


def named_tests() -> set[str]:
    """Every test id the table names."""
    return {test for row in BEHAVIOURS for test in row.cells().values()}


def launched_world_cells(launcher: str, ranks: int) -> set[str]:
    """The world tests the table says pass in ``launcher``'s world run at ``ranks`` ranks."""
    column = next(c for c, where in LAUNCHED.items() if where == (launcher, ranks))
    return {test for row in BEHAVIOURS for c, test in row.cells().items()
            if c == column and not test.startswith(LAUNCH_FILES)}


@dataclass(frozen=True)
class Collected:
    """What a plain pytest run's collection shows of one test item."""

    markers: frozenset[str]
    runs: bool
    """Neither a ``skip`` nor a ``skipif`` whose condition is true marks it in this process."""


def matching(collected: dict[str, Collected], test: str) -> list[Collected]:
    """The collected items a test id names (a test names all of its parameters)."""
    return [item for nodeid, item in collected.items()
            if nodeid == test or nodeid.startswith(f"{test}[")]


def problems(rows: tuple[Behaviour, ...], collected: dict[str, Collected]) -> list[str]:
    """Every way ``rows`` fail to be covered by the tests in ``collected`` (node id ->
    :class:`Collected`, from :func:`collect`): a behaviour without a test, a column left
    without a reason, a test pytest does not collect, a mock cell skipped on the mock world,
    a three-rank cell whose test the three-rank runs leave out, a launch test of the wrong
    launcher or size."""
    found = []
    for row in rows:
        cells = row.cells()
        if not cells:
            found.append(f"{row.what}: no test")
        if set(cells) - set(COLUMNS):
            found.append(f"{row.what}: unknown columns {sorted(set(cells) - set(COLUMNS))}")
        empty = sorted(set(COLUMNS) - set(cells))
        if empty and not row.why_not:
            found.append(f"{row.what}: no test and no reason for {empty}")
        for column, test in cells.items():
            items = matching(collected, test)
            where = f"{row.what}: {column} names {test}"
            if not items:
                found.append(f"{where}, which pytest does not collect")
            elif column == MOCK and (test.startswith(LAUNCH_FILES)
                                     or not any(item.runs for item in items)):
                found.append(f"{where}, which does not run on the mock world")
            elif column in LAUNCHED and test.startswith(LAUNCH_FILES):
                launcher, ranks = LAUNCHED[column]
                own = LAUNCH_FILES[0 if launcher == "mpiexec" else 1]
                size = re.search(r"\[(\d+)\]$", test)
                if not test.startswith(own) or (size and int(size.group(1)) != ranks):
                    found.append(f"{where}, a launch of another launcher or size")
            elif column in LAUNCHED and LAUNCHED[column][1] == 3 and not all(
                    "three_ranks" in item.markers for item in items):
                found.append(f"{where}, which the three-rank runs leave out "
                             "(tests/tiers.py: THREE_RANK_FILES, THREE_RANK_TESTS)")
    return found


#: The variable that asks this module, loaded as a pytest plugin by :func:`collect`, to write
#: what the collection found (a JSON file).
COLLECTED_VARIABLE = "AXONDIST_COLLECTED_TESTS"


#: What this pytest session collected, before any ``-m`` or ``-k`` deselection (recorded by
#: tests/conftest.py): node id -> :class:`Collected`.
SESSION_COLLECTED: dict[str, Collected] = {}
#: The markers the table reads (others, such as hypothesis's own, are added by plugins in an
#: order that differs between a whole run and a collection of the table's files alone).
TABLE_MARKERS = frozenset({"three_ranks"})


def record(items: list[Any]) -> None:
    """Add ``items`` (pytest items, their markers final) to :data:`SESSION_COLLECTED`."""
    SESSION_COLLECTED.update({item.nodeid: Collected(
        frozenset(mark.name for mark in item.iter_markers() if mark.name in TABLE_MARKERS),
        not _skipped(item))
        for item in items})


def pytest_collection_finish(session: Any) -> None:
    """The plugin hook of :func:`collect`: writes node id -> markers and whether it runs."""
    path = os.environ.get(COLLECTED_VARIABLE)
    if not path:
        return
    record(session.items)
    found = {nodeid: {"markers": sorted(item.markers), "runs": item.runs}
             for nodeid, item in SESSION_COLLECTED.items()}
    Path(path).write_text(json.dumps(found), encoding="utf-8")


def _skipped(item: Any) -> bool:
    if item.get_closest_marker("skip") is not None:
        return True
    return any((mark.args[0] if mark.args else mark.kwargs.get("condition")) is True
               for mark in item.iter_markers("skipif"))


def collect(files: list[str], scratch: Path) -> dict[str, Collected]:
    """What ``pytest --collect-only FILES`` finds (in a process of its own, as a plain run
    would), node id -> :class:`Collected`; ``scratch`` is a folder for its report."""
    report = scratch / "collected.json"
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "coverage_table",
               "-p", "no:cacheprovider", *files]
    env = {**os.environ, COLLECTED_VARIABLE: str(report)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"collecting {files} failed:\n{done.stdout[-3000:]}"
                           f"{done.stderr[-3000:]}")
    return {nodeid: Collected(frozenset(info["markers"]), info["runs"])
            for nodeid, info in json.loads(report.read_text(encoding="utf-8")).items()}


def session_took_the_files_whole(session_args: list[str]) -> bool:
    """Whether a session's arguments (``config.args``) collect every file the table names
    whole (the quick tier and the whole suite do), so :data:`SESSION_COLLECTED` has them."""
    whole = [(ROOT / arg).resolve() for arg in session_args if "::" not in arg]
    return all(any(path == arg or arg in path.parents for arg in whole)
               for path in ((ROOT / name).resolve() for name in named_files()))


def collected_for_the_table(session_args: list[str], scratch: Path) -> dict[str, Collected]:
    """What pytest collects of the files the table names: this session's own collection
    where it took them whole, else :func:`collect`'s."""
    if session_took_the_files_whole(session_args):
        return dict(SESSION_COLLECTED)
    return collect(named_files(), scratch)


def named_files() -> list[str]:
    """The test files the table names."""
    return sorted({test.split("::")[0] for test in named_tests()})


def _short(test: str) -> str:
    return f"`{test.removeprefix('tests/world/')}`"


def render() -> str:
    """The table as Markdown: the row's test covers a ✓ cell, another test is named."""
    head = ["Behaviour", "Test", *COLUMNS, "Not run there because"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in BEHAVIOURS:
        cells = row.cells()
        marks = ["✓" if cells.get(c) == row.test else _short(cells[c]) if c in cells else "–"
                 for c in COLUMNS]
        lines.append("| " + " | ".join([row.what, _short(row.test), *marks, row.why_not]) + " |")
    return "\n".join(lines)


DOC = ROOT / "docs" / "testing.md"
BEGIN = "<!-- coverage table: made by tests/coverage_table.py --write; edit the rows there -->"
END = "<!-- end of the coverage table -->"


def doc_with_table(text: str) -> str:
    """``text`` (docs/testing.md) with the table between its markers made anew."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    return pattern.sub(lambda _: f"{BEGIN}\n\n{render()}\n\n{END}", text)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        DOC.write_text(doc_with_table(DOC.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(render())
