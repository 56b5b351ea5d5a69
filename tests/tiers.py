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
    "tests/unit/test_coverage_table.py::"
    "test_this_sessions_collection_is_what_a_collection_of_its_own_finds",
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
    # each 2-8 s on 2 idle cores (a tenth of the quick tier's minute): JAX compiles per case,
    # float16 training of two wrappers, pipeline training checked step by step, 60 memory
    # layouts; the rest start processes (docs blocks, torch's rendezvous, the NCCL stand-in)
    "tests/integration/test_docs.py::test_python_blocks_run",
    "tests/world/test_differentiable.py::test_jit_of_grad_called_many_times_equals_eager",
    "tests/world/test_amp_training.py::test_ddp_and_zero1_float16_with_loss_scaling",
    "tests/world/test_amp_training.py::test_fsdp_mixed_precision_float16_with_loss_scaling",
    "tests/unit/test_pipeline_runtime.py::test_backward_adds_into_grad_and_train_step_replaces",
    "tests/unit/test_pipeline_runtime.py::test_sgd_steps_equal_sequential_training",
    "tests/unit/test_pipeline_runtime.py::"
    "test_step_and_no_sync_accumulation_equal_sequential_training",
    "tests/world/test_pipeline.py::test_every_schedule_equals_sequential_full_batch",
    "tests/world/test_fsdp.py::test_memory_estimate_equals_memory_stats",
    "tests/world/test_ddp_overlapped_bits.py::"
    "test_ddp_overlapped_keeps_synchronous_bits_with_default_pieces",
    "tests/unit/test_amp.py::test_torch_grad_scaler_skips_the_same_steps_and_ends_at_the_same_scale",
    "tests/unit/test_trace.py::test_several_processes_trace_into_one_folder",
    "tests/integration/test_environment.py::"
    "test_init_in_a_torchrun_style_process_joins_through_torch_and_names_a_missing_rank_0",
    "tests/integration/test_nccl_fake_wrappers.py::"
    "test_a_stage_raising_on_one_rank_ends_every_rank_of_an_nccl_pipeline",
    "tests/integration/test_nccl_fake_wrappers.py::test_pipeline_loss_on_every_rank_equals_mock",
    "tests/integration/test_nccl_fake_backend.py::"
    "test_a_rank_that_left_is_named_within_seconds_not_at_the_timeout",
    "tests/integration/test_nccl_fake_backend.py::"
    "test_two_ranks_on_one_gpu_are_refused_before_nccl_starts",
    "tests/integration/test_nccl_fake_backend.py::test_rendezvous_between_processes",
    # 1.5-3 s of CPU each on a loaded machine: an mpiexec launch, matplotlib pictures, the
    # pipeline's training loops (its schedules stay quick), the context-parallel grid (its
    # property test stays), big persistent buffers, a checkpoint over three world sizes
    "tests/world/test_fsdp.py::test_different_models_under_mpiexec_fail_fast_on_every_rank",
    "tests/unit/test_pipeline_render.py::"
    "test_every_bar_is_labelled_and_chunk_swatches_use_the_kinds_colours",
    "tests/world/test_pipeline.py::test_the_one_loop_calls_train_like_one_process",
    "tests/world/test_pipeline.py::test_sgd_steps_equal_sequential_training",
    "tests/world/test_context_parallel.py::test_every_method_and_layout_matches_the_reference",
    "tests/world/test_overlap_pieces.py::test_persistent_pieces_sum_like_numpy",
    "tests/world/test_zero.py::test_sharded_checkpoint_two_to_three_to_one_rank",
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


#: What a third rank adds over two, rerun at three ranks under each launcher (the launchers'
#: world runs take every world test at two ranks, ``-m three_ranks`` at three): sums whose
#: rank order changes their bits (a sum of two is the same either way), splits that leave
#: one rank short, chains and rings with a middle rank (pipeline stages, ring attention,
#: send/recv), roots and peers past rank 1, and the MPI algorithms chosen for groups of more
#: than two (two-rank groups take the pair algorithms). Whole files first, then single tests.
THREE_RANK_FILES = frozenset({
    "tests/world/test_collectives.py",
    "tests/world/test_mpi_bits.py",
    "tests/world/test_call_cost.py",
    "tests/world/test_pipeline.py",
    "tests/world/test_context_parallel.py",
    "tests/world/test_tensor_parallel.py",
    "tests/world/test_expert_parallel.py",
    "tests/world/test_zero.py",
    "tests/world/test_fsdp_prefetch.py",
    "tests/world/test_fsdp_grad_average.py",
    "tests/world/test_ddp_overlapped_bits.py",
    "tests/world/test_checkpoint_world.py",
    "tests/world/test_plan_memory.py",
    "tests/world/test_torch_backend.py",
})

#: Single world tests that run at three ranks (besides :data:`THREE_RANK_FILES`). Their files'
#: other tests show nothing new at three ranks: they count MPI calls or cached plans of big
#: buffers, free groups hundreds of times, or check one pair algorithm.
THREE_RANK_TESTS = frozenset({
    *(f"tests/world/test_fsdp.py::{name}" for name in (
        "test_training_matches_single_process", "test_manual_loop_matches_ddp",
        "test_clip_grad_norm_is_the_full_gradient_norm", "test_mixed_precision_within_tolerance",
        "test_accumulation_equals_big_batch", "test_sharded_checkpoint_across_world_sizes",
        "test_full_checkpoint_round_trip", "test_hybrid_groups_follow_ranks_per_node",
        "test_full_shard_memory_is_a_share_plus_one_unit", "test_gather_reshard_and_offload",
        "test_memory_estimate_equals_memory_stats",
        "test_shard_optimizer_keeps_full_gradients_and_shards_state",
        "test_different_models_are_refused_on_every_rank",
        "test_summon_full_params_gathers_and_reshards",
        "test_state_dict_is_the_full_master_state_on_every_rank")),
    *(f"tests/world/test_riding_checks.py::{name}" for name in (
        "test_all_reduce_on_both_sides_of_the_riding_limit",
        "test_small_all_reduces_match_numpy_on_every_rank",
        "test_ranks_passing_array_subclasses_still_agree", "test_small_all_gathers_match_numpy",
        "test_all_gather_on_both_sides_of_the_riding_limit",
        "test_small_reduce_scatters_match_numpy", "test_small_broadcasts_match_the_source")),
    *(f"tests/world/test_mpi_pieces.py::{name}" for name in (
        "test_mean_of_big_odd_buffers_matches_numpy",
        "test_reduce_scatter_of_uneven_and_even_rows_matches_numpy",
        "test_average_is_the_sum_divided_by_n_bit_for_bit",
        "test_scaled_sum_weights_each_rank_then_sums_bit_for_bit",
        "test_reduce_scatter_average_is_the_sum_divided",
        "test_gathers_and_reduce_scatters_give_mpis_bits_on_both_sides_of_the_pair_exchange")),
    *(f"tests/world/test_gather_rows.py::{name}" for name in (
        "test_unsized_all_gathers_match_numpy", "test_row_counts_that_change_between_calls",
        "test_a_wrong_out_on_every_rank_raises_and_the_next_call_works")),
    "tests/world/test_pair_halves.py::test_means_on_both_sides_of_the_halves_threshold",
    "tests/world/test_overlap_pieces.py::test_ddp_overlapped_equals_synchronous_and_one_process",
    "tests/world/test_overlap_pieces.py::test_persistent_pieces_sum_like_numpy",
    "tests/world/test_ddp.py::test_ddp_training_matches_one_process",
    "tests/world/test_ddp.py::test_unequal_batches_need_num_samples",
    "tests/world/test_ddp.py::test_clip_grad_norm_nan_and_inf_on_one_rank_reach_every_rank",
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


def needs_three_ranks(item: pytest.Item) -> bool:
    """Whether ``item`` reruns at three ranks under each launcher (see the tables above)."""
    path, test = place(item)
    return path in THREE_RANK_FILES or test in THREE_RANK_TESTS


def three_rank_files() -> list[str]:
    """The files that hold a three-rank test: the three-rank runs collect only these."""
    return sorted(THREE_RANK_FILES | {test.split("::")[0] for test in THREE_RANK_TESTS})
