"""DataParallel in a real two-process gloo group: gradients, options, errors and faults."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import GroupRunner, Outcomes

# All scenarios that leave the group usable share one group: starting
# processes costs seconds, running a scenario a fraction of one.
SHARED = [
    "matches_ddp_and_full_batch",
    "sgd_keeps_replicas_identical",
    "buckets_rebuilt_in_ready_order",
    "trace_names_the_work",
    "no_sync_accumulates_locally",
    "unused_parameter_with_flag",
    "buffers_broadcast",
    "gradient_as_bucket_view",
    "mismatched_replicas_raise",
    "pipe_matches_full_batch",
    "unused_parameter_without_flag_raises",
    "repeated_accumulation_without_protocol_raises",
    "pipe_two_forwards_one_backward_raises",
]


@pytest.fixture(scope="module")
def shared_outcomes(group_runner: GroupRunner) -> Outcomes:
    return group_runner(SHARED)


@pytest.mark.parametrize("name", SHARED)
def test_scenario(shared_outcomes: Outcomes, name: str) -> None:
    for rank, outcomes in enumerate(shared_outcomes):
        assert outcomes.get(name) == "ok", f"rank {rank}:\n{outcomes.get(name)}"


@pytest.mark.parametrize("fault", ["peer_dies_mid_step", "peer_stalls_mid_step"])
def test_fault_mid_step_is_an_error_naming_the_all_reduce(
    group_runner: GroupRunner, fault: str
) -> None:
    outcomes = group_runner([fault], pg_timeout_s=2, wall_timeout_s=30)
    for rank, outcome in enumerate(outcomes):
        assert outcome.get(fault) == "ok", f"rank {rank}:\n{outcome}"
