"""DistributedPipe: stages in separate gloo processes on 127.0.0.1, each group bounded in time."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.gloo_groups import GroupRunner, Outcomes

STAGES = Path(__file__).with_name("stage_scenarios.py")

# Scenarios that leave the group usable share one group per size.
SHARED = [
    "every_schedule_and_mode_equals_the_plain_model",
    "a_weight_the_callers_graph_reaches_too_is_accumulated_once",
    "interleaved_stages_equal_the_plain_model",
    "skips_go_straight_to_non_adjacent_processes",
    "a_model_on_the_meta_device_is_materialised_stage_by_stage",
    "meta_layers_get_their_own_reset_and_real_layers_keep_their_values",
    "tied_weights_across_processes_stay_equal_and_train_like_the_plain_model",
    "tied_weights_accumulate_over_steps_like_the_plain_model",
    "clip_grad_norm_clips_by_the_whole_models_norm_counting_tied_weights_once",
    "hooks_of_one_backward_fire_once_per_step_with_the_whole_gradient",
    "two_stages_save_and_another_balance_a_pipe_and_the_plain_model_resume",
    "the_plain_model_or_a_pipe_saves_and_two_stages_resume",
    "a_checkpoint_whose_names_of_a_tied_weight_differ_is_refused_by_every_process",
    "torch_calls_with_a_flattened_optimizer_state_resume_two_stages",
    "a_load_is_refused_on_every_process_for_keys_no_process_asks_for_or_a_shape_one_finds",
    "a_save_failing_on_one_process_leaves_the_checkpoint_there_as_it_was",
    "a_damaged_or_missing_data_file_is_refused_by_every_process_naming_it",
    "load_state_dict_with_strict_false_returns_the_keys_of_no_process_as_unexpected",
    "a_process_without_parameters_passes_no_optimizer_and_disagreements_are_refused",
    "a_failing_process_makes_the_others_fail_at_once_naming_it",
    "a_failure_after_the_other_processes_are_done_fails_them_too",
    "a_step_whose_last_backwards_outlast_the_groups_timeout_ends_whole",
    "a_failure_in_a_backward_with_tied_weights_fails_every_holder_at_once",
    "bad_arguments_are_refused_by_every_process_before_any_work",
    "a_predecessors_checkpoint_loads_into_each_processs_stages",
    "tensors_sharing_memory_into_a_stage_writing_its_input_are_refused",
    "tensors_sharing_memory_written_by_a_stage_in_another_process_are_refused",
    "a_write_into_a_skip_sharing_memory_with_the_main_path_is_refused_by_every_process",
    "an_output_with_fewer_leaves_than_an_earlier_sharing_one_crosses",
    "a_buffer_written_in_a_forward_by_stages_of_two_processes_is_refused",
    "arguments_that_differ_between_processes_are_refused_by_every_process_at_construction",
    "chunks_that_differ_on_one_process_are_refused_by_every_process_and_the_group_goes_on",
    "an_argument_refused_on_one_process_fails_every_process_within_seconds",
    "an_interrupted_process_stops_the_others_and_the_next_step_is_right",
    "a_pipe_closed_right_after_construction_lets_its_peers_close_at_once",
    "a_step_after_every_peer_closed_is_refused_at_once",
    "batch_norm_and_autocast_match_the_single_process_pipe",
    "dropout_is_replayed_exactly_in_every_checkpoint_mode",
    "compiled_stages_compile_and_give_the_plain_models_gradients",
    "tuples_dicts_and_plain_values_cross_processes",
    "evaluate_returns_loss_and_outputs_on_every_process",
    "evaluate_arguments_are_agreed_by_every_process",
    "evaluate_returns_a_loss_of_any_dtype_as_the_single_process_pipe",
    "forwards_out_of_order_raise_program_error_on_every_process_saying_why",
    "loss_reductions_and_divisors_equal_the_plain_model",
    "a_grad_scaler_must_agree_on_infs_across_processes",
    "last_step_reports_this_process_stages",
    "a_sent_message_is_let_go_of_once_the_next_to_its_peer_is_posted",
    "a_message_that_fits_the_room_its_peer_posted_travels_in_one_send",
    "the_loss_comes_down_with_the_last_gradients_in_its_dtype_and_no_collective",
    "a_message_that_could_not_go_leaves_both_ends_with_one_room",
    "every_action_of_step_and_evaluate_shows_under_the_plain_profiler",
    "a_value_that_cannot_cross_is_refused_by_its_sender_naming_it",
    "an_output_that_cannot_cross_fails_evaluate_on_every_process",
    "a_crafted_message_runs_no_code_and_fails_closed_naming_its_sender",
    # closing_scenarios.py: many pipelines closed in turn, pipelines left open until the
    # processes exit, then a process whose script raises, which ends the group: last.
    "many_pipelines_closed_one_after_another_give_back_every_descriptor_and_thread",
    "pipelines_collected_in_different_orders_or_at_exit_let_every_process_end",
    "a_process_whose_script_raises_exits_at_once_and_the_others_name_it",
]


def check(outcomes: Outcomes, names: list[str]) -> None:
    """Every rank ran every scenario; else every rank's failure, so the first cause shows."""
    failures = [
        f"rank {rank}, {name}:\n{outcome.get(name)}"
        for name in names
        for rank, outcome in enumerate(outcomes)
        if outcome.get(name) != "ok"
    ]
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def two_processes(group_runner: GroupRunner) -> Outcomes:
    # A group timeout far above the bound within which a refusal must reach every process.
    return group_runner(SHARED, script=STAGES, world_size=2, pg_timeout_s=60, wall_timeout_s=150)


@pytest.mark.parametrize("name", SHARED)
def test_two_stage_processes(two_processes: Outcomes, name: str) -> None:
    check(two_processes, [name])


def test_a_pause_longer_than_the_group_timeout_then_exits_apart(group_runner: GroupRunner) -> None:
    names = [
        "a_pause_longer_than_the_group_timeout_and_new_shapes_are_harmless",
        "a_process_that_exits_before_its_peer_closes_waits_for_it_and_exits_cleanly",
    ]
    check(group_runner(names, script=STAGES, pg_timeout_s=3, wall_timeout_s=60), names)


def test_three_stage_processes_with_skips_over_the_middle_one(group_runner: GroupRunner) -> None:
    names = [
        "every_schedule_and_mode_equals_the_plain_model",
        "skips_go_straight_to_non_adjacent_processes",
        "tied_weights_across_processes_stay_equal_and_train_like_the_plain_model",
        "tuples_dicts_and_plain_values_cross_processes",
        "evaluate_returns_loss_and_outputs_on_every_process",
        "an_output_that_cannot_cross_fails_evaluate_on_every_process",
        "a_failure_on_the_last_process_reaches_every_process",
        "a_failure_reaches_a_process_whose_send_follows_the_failed_peers_abort",
        "a_pipe_closed_mid_step_fails_every_process_at_once",
        "pipelines_of_several_sizes_in_one_job_each_equal_the_plain_model",
        "pipelines_of_several_sizes_with_tied_weights_are_refused_by_every_process",
    ]
    check(group_runner(names, script=STAGES, world_size=3, wall_timeout_s=150), names)


FOUR_STAGES = [
    "every_schedule_and_mode_equals_the_plain_model",
    "skips_go_straight_to_non_adjacent_processes",
    "the_loss_comes_down_with_the_last_gradients_in_its_dtype_and_no_collective",
]
GRID = [
    "a_pipeline_refused_in_a_grid_stops_every_pipeline",
    "a_step_failing_after_a_stage_launched_its_all_reduces_is_refused_by_every_process",
    "a_pp_by_dp_grid_equals_single_process_training_on_the_full_batch",
    "a_grid_saves_and_another_grid_four_stages_a_pipe_and_the_plain_model_resume",
]


@pytest.fixture(scope="module")
def four_processes(group_runner: GroupRunner) -> Outcomes:
    # One group of four for both tests: starting processes costs more than a scenario.
    return group_runner(FOUR_STAGES + GRID, script=STAGES, world_size=4, wall_timeout_s=240)


def test_four_stage_processes(four_processes: Outcomes) -> None:
    check(four_processes, FOUR_STAGES)


def test_a_pp_2_by_dp_2_grid(four_processes: Outcomes) -> None:
    check(four_processes, GRID)


@pytest.mark.parametrize(
    "fault",
    [
        "a_dead_process_makes_the_others_fail_naming_it",
        "a_stalled_process_makes_the_others_fail_after_the_timeout",
    ],
)
def test_faults_end_in_errors_naming_the_process(group_runner: GroupRunner, fault: str) -> None:
    check(group_runner([fault], script=STAGES, world_size=2, wall_timeout_s=60), [fault])
