"""DistributedPipe stages sharded by torch's FSDP2 and tensor parallelism: 4 gloo processes.

One process group runs every scenario of sharded_scenarios.py: a (dp=2, pp=2)
mesh for FSDP2, a (pp=2, tp=2) mesh for tensor parallelism, each scenario
against the plain model in float64, or refused by every process.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.distributed.test_distributed_pipe import check

if TYPE_CHECKING:
    from tests.gloo_groups import GroupRunner, Outcomes

SCENARIOS = Path(__file__).with_name("sharded_scenarios.py")

NAMES = [
    "fsdp_stages_equal_the_plain_model_in_every_schedule",
    "nested_fsdp_units_equal_the_plain_model",
    "interleaved_fsdp_stages_equal_the_plain_model",
    "dropout_under_fsdp_is_the_unsharded_pipes",
    "batch_norm_statistics_of_fsdp_stages_are_the_first_replicas_on_every_replica",
    "tensor_parallel_stages_equal_the_plain_model",
    "a_refusal_in_one_pipeline_is_heard_by_every_pipeline_sharding_its_stages",
    "replicas_sharding_their_stages_differently_are_refused_by_every_process",
    "hsdp_stages_all_reduce_once_per_step",
    "sharding_a_step_would_get_wrong_is_refused_by_every_process",
    "a_pipe_in_one_process_refuses_fsdp_units_before_any_work",
    "a_module_only_read_by_a_split_models_code_is_refused_in_a_sharded_stage",
    "clip_grad_norm_over_sharded_stages_equals_the_plain_models",
    "sharded_stages_save_and_load_across_layouts",
    "data_parallel_over_fsdp_stages_is_refused_before_any_work",
    "a_plan_for_sharded_stages_is_one_plan_that_predicts_each_term",
]


@pytest.fixture(scope="module")
def four_processes(group_runner: GroupRunner) -> Outcomes:
    return group_runner(NAMES, script=SCENARIOS, world_size=4, pg_timeout_s=60, wall_timeout_s=360)


@pytest.mark.parametrize("name", NAMES)
def test_sharded_stages(four_processes: Outcomes, name: str) -> None:
    check(four_processes, [name])
