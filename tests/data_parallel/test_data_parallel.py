"""DataParallel in a real process group (gloo; NCCL where a GPU is): gradients, options, errors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from tests.gloo_groups import GroupRunner, Outcomes

SCENARIOS = Path(__file__).with_name("dp_scenarios.py")

# All scenarios that leave the group usable share one group: starting
# processes costs seconds, running a scenario a fraction of one.
SHARED = [
    "matches_ddp_and_full_batch",
    "a_dataclass_output_is_averaged_like_ddp",
    "a_parameter_unfrozen_or_replaced_after_wrapping_is_refused",
    "hooks_on_the_wrapper_are_refused_by_step",
    "a_backward_failing_on_every_replica_leaves_the_next_averages_right",
    "a_backward_failing_alike_with_bucket_views_leaves_the_next_averages_right",
    "a_second_backward_through_one_forward_is_refused",
    "a_replica_that_fails_a_step_and_goes_on_is_caught_at_the_next_average",
    "a_replica_whose_forward_fails_and_goes_on_is_caught_at_the_next_average",
    "a_step_failing_after_its_partitions_launched_all_reduces_refuses_the_next",
    "sgd_keeps_replicas_identical",
    "buckets_rebuilt_in_ready_order",
    "trace_names_the_work",
    "no_sync_accumulates_locally",
    "unused_parameter_with_flag",
    "buffers_broadcast",
    "statistics_a_step_updates_are_rank_0s_on_every_replica_after_it",
    "a_checkpoint_after_a_forward_and_backward_keeps_rank_0s_statistics",
    "a_save_by_one_replica_alone_exchanges_nothing_with_the_others",
    "gradient_as_bucket_view",
    "mismatched_replicas_raise",
    "different_find_unused_parameters_raise",
    "different_bucket_caps_raise",
    "different_balance_raises",
    "autograd_grad_without_find_unused_raises",
    "autograd_grad_with_find_unused_raises",
    "rank_without_any_gradient_with_flag",
    "pipe_unused_parameter_without_flag_raises",
    "pipe_matches_full_batch",
    "torch_ddp_wraps_a_checkpointed_pipe",
    "pipe_step_matches_full_batch",
    "a_weight_tied_across_devices_is_reduced_once_and_matches_full_batch",
    "a_mean_over_every_replicas_tokens_with_a_divisor",
    "pipe_of_a_split_model_matches_full_batch",
    "unused_parameter_without_flag_raises",
    "repeated_accumulation_without_protocol_raises",
    "pipe_two_forwards_one_backward_raises",
]


@pytest.fixture(scope="module")
def shared_outcomes(group_runner: GroupRunner) -> Outcomes:
    return group_runner(SHARED, script=SCENARIOS)


@pytest.mark.parametrize("name", SHARED)
def test_scenario(shared_outcomes: Outcomes, name: str) -> None:
    for rank, outcomes in enumerate(shared_outcomes):
        assert outcomes.get(name) == "ok", f"rank {rank}:\n{outcomes.get(name)}"


def test_data_parallel_needs_no_numpy(group_runner: GroupRunner) -> None:
    # torch prints a warning without NumPy but works; so must DataParallel.
    names = ["matches_ddp_and_full_batch", "mismatched_replicas_raise", "different_balance_raises"]
    for rank, outcomes in enumerate(group_runner(names, script=SCENARIOS, numpy=False)):
        for name in names:
            assert outcomes.get(name) == "ok", f"rank {rank}, {name}:\n{outcomes.get(name)}"


@pytest.mark.parametrize(
    "fault", ["peer_dies_mid_step", "peer_stalls_mid_step", "peer_stalls_before_the_count_of_steps"]
)
def test_fault_mid_step_is_an_error_naming_the_all_reduce(
    group_runner: GroupRunner, fault: str
) -> None:
    outcomes = group_runner([fault], script=SCENARIOS, pg_timeout_s=2, wall_timeout_s=30)
    for rank, outcome in enumerate(outcomes):
        assert outcome.get(fault) == "ok", f"rank {rank}:\n{outcome}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA device")
def test_nccl_exchanges_on_the_current_gpu(group_runner: GroupRunner) -> None:
    # One rank per GPU, as NCCL requires; one GPU still runs the whole path.
    world_size = min(2, torch.cuda.device_count())
    outcomes = group_runner(
        ["nccl_step_on_the_current_gpu"], script=SCENARIOS, world_size=world_size, backend="nccl"
    )
    for rank, outcome in enumerate(outcomes):
        assert outcome.get("nccl_step_on_the_current_gpu") == "ok", f"rank {rank}:\n{outcome}"
