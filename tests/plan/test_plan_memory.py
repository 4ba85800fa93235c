"""The memory model's activation term is what a step's meter measures, to the byte."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch import nn

import pipeline
from pipeline.plan.held import HeldPeaks, MicroBatchBytes, held_peaks
from pipeline.step.actions import parse_program
from tests.plan.plan_models import WIDTH, batch, gelu_mlp, one_thread, planned_step

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

MODES = ["never", "except_last", "always"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h1-peak"])
def test_predicted_activations_equal_the_measured_peak_of_each_stage(
    schedule: str, mode: str
) -> None:
    *_, check = planned_step(gelu_mlp(), schedule, mode, devices=3)
    assert check.measured_activations == check.predicted_activations
    assert all(bytes_ > 0 for bytes_ in check.predicted_activations)


def test_a_stage_after_frozen_layers_has_no_input_gradient_to_let_go_of() -> None:
    # Its I has no input path, as stage 0's: the model took it for a received
    # input requiring grad and predicted 1160 bytes where the step held 1296.
    model = gelu_mlp()
    for layer in list(model)[:-1]:
        layer.requires_grad_(False)
    *_, check = planned_step(model, "zb-h1-peak", "never")
    assert check.measured_activations == check.predicted_activations


def test_buffers_a_layer_saves_are_model_state_not_activations() -> None:
    # BatchNorm saves its running statistics, one storage for every
    # micro-batch: the meter counted them once, the model once per micro-batch
    # held (3072 bytes predicted, 2304 measured). Neither counts them now; the
    # stage's parameters term holds them.
    model = nn.Sequential(nn.Linear(WIDTH, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, WIDTH))
    plan, _, check = planned_step(model.double(), "gpipe", "never")
    assert check.measured_activations == check.predicted_activations
    state = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert sum(stage.parameters for stage in plan.chosen.memory) == state


@pytest.mark.parametrize(
    ("schedule", "mode"),
    [("gpipe", "always"), ("1f1b", "always"), ("zb-h1", "always"), ("zb-h1-peak", "always"),
     ("zb-h1", "except_last")],
)  # fmt: skip
def test_a_recomputation_saves_copies_of_the_buffers_its_layers_change(
    schedule: str, mode: str
) -> None:
    # A checkpointed BatchNorm recomputes on copies of its running statistics, which its
    # backward saves: 128 bytes a micro-batch for 8 features, which the model left out.
    # A BatchNorm in every layer pair, the last one on top of its stage's last weight:
    # every cut has one in each stage, one of them above the stage's topmost anchor.
    model = nn.Sequential(
        nn.Linear(WIDTH, 8), nn.BatchNorm1d(8), nn.Linear(8, WIDTH), nn.BatchNorm1d(WIDTH),
        nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH),
    )  # fmt: skip
    *_, check = planned_step(model.double(), schedule, mode)
    assert check.measured_activations == check.predicted_activations


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_layer_is_profiled_in_its_own_mode(mode: str) -> None:
    # BatchNorm frozen in eval mode, as for fine-tuning: the profile set the whole model
    # training, so its batch statistics (and, recomputed, its running statistics' copies)
    # were predicted saved (1024 against 512 bytes measured on stage 0).
    model = nn.Sequential(
        nn.Linear(WIDTH, 8),
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Linear(8, WIDTH),
        nn.BatchNorm1d(WIDTH),
    ).double()
    model[1].eval()
    model[4].eval()
    *_, check = planned_step(model, "gpipe", mode)
    assert check.measured_activations == check.predicted_activations


def test_checkpointed_tasks_keep_their_received_inputs_beside_the_recomputation() -> None:
    # GPipe, always, 2 micro-batches: while micro-batch 1 recomputes on stage 1,
    # micro-batch 0 holds only its received input (the inputs term); micro-batch 1's
    # input is saved by the stage's first Linear (the activations term).
    x, y = batch()
    plan = pipeline.plan(
        gelu_mlp(), x, y, F.mse_loss, devices=["cpu"] * 2, batch_size=len(x),
        memory_limit=2**30, chunks=[2], schedules=["gpipe"], checkpoints=["always"], repeats=1,
    )  # fmt: skip
    second = plan.chosen.memory[1]
    one_input = (len(x) // 2) * x.size(1) * 8
    # GPipe holds both micro-batches' inputs; the recomputed one's is saved, the other kept.
    assert second.inputs == one_input
    assert plan.chosen.memory[0].inputs == 0  # stage 0's input is the caller's


def test_held_peaks_count_a_zero_bubble_graph_and_its_recorded_gradients_until_w() -> None:
    program = parse_program("0F0 0F1 0I0 0F2 0W0 0I1 0W1 0I2 0W2")
    # At 0F2: three graphs, and what 0I0 recorded for 0W0.
    peaks = held_peaks(program, 0, set(), MicroBatchBytes(10, 0, 0, 0, 4))
    assert peaks == HeldPeaks(activations=30, saved=30, inputs=0, mail=0, recorded=4)


def test_parameters_gradients_and_optimizer_state_are_counted_once_per_parameter() -> None:
    x, y = batch()
    model = gelu_mlp(depth=2)
    tied = nn.Sequential(model[0], nn.Linear(16, 16).double(), model[1])
    tied[1].weight = tied[0][0].weight  # one parameter in two layers
    plan = pipeline.plan(
        tied, x, y, F.mse_loss, devices=["cpu"], batch_size=len(x), memory_limit=2**30,
        chunks=[1], schedules=["1f1b"], checkpoints=["never"], optimizer_bytes_per_param=8,
        repeats=1,
    )  # fmt: skip
    (stage,) = plan.chosen.memory
    elements = sum(p.numel() for p in tied.parameters())  # each parameter once
    assert stage.parameters == stage.gradients == elements * 8
    assert stage.optimizer == elements * 8
