"""DistributedPipe on split GPT-2, Llama, Mixtral: two gloo processes, against the plain model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.distributed.test_distributed_pipe import check

if TYPE_CHECKING:
    from tests.gloo_groups import GroupRunner, Outcomes

pytest.importorskip("transformers")

SCENARIOS = Path(__file__).with_name("split_scenarios.py")
SHARED = [
    "split_gpt2_equals_the_plain_model_with_every_schedule",
    "split_gpt2_tied_head_and_embedding_train_like_the_plain_model",
    "split_models_built_on_meta_materialise_only_their_pieces",
    "a_split_model_with_tensors_of_its_own_built_on_meta_trains_like_the_plain_model",
    "split_gpt2_in_eval_mode_across_processes",
    "split_mixtral_with_eager_experts_on_meta_trains_like_the_plain_model",
    "split_mixtral_router_loss_on_meta_in_gpipe_like_the_plain_model",
    "split_mixtral_router_loss_in_data_parallel_like_ddp_of_the_plain_model",
]


@pytest.fixture(scope="module")
def two_processes(group_runner: GroupRunner) -> Outcomes:
    return group_runner(SHARED, script=SCENARIOS, world_size=2, pg_timeout_s=60, wall_timeout_s=240)


@pytest.mark.parametrize("name", SHARED)
def test_split_model_stages_in_two_processes(two_processes: Outcomes, name: str) -> None:
    check(two_processes, [name])
