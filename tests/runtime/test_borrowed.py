"""A parameter tied across devices in one Pipe: one parameter, its uses' gradients summed.

``cpu:0`` and ``cpu:1`` are two devices to the Pipe, so the second
partition borrows the tied weight as a copy made at each call, as it would on
a second GPU; the DataParallel case is dp_scenarios.py's
a_weight_tied_across_devices_is_reduced_once_and_matches_full_batch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import Pipe
from tests.split.split_models import assert_same, gpt2, gradients, lm_loss, tokens

DEVICES = ["cpu:0", "cpu:1"]
SCHEDULES = [None, "gpipe", "1f1b", "zb-h1"]
MODES = ["always", "except_last", "never"]


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(11, 8)

    def forward(self, ids: Tensor) -> Tensor:
        return self.token(ids)


class Head(nn.Module):
    """The output layer, reading the embedding's weight."""

    def __init__(self, embed: Embed) -> None:
        super().__init__()
        self.weight = embed.token.weight

    def forward(self, h: Tensor) -> Tensor:
        return h @ self.weight.t()


def tied() -> nn.Sequential:
    torch.manual_seed(2)
    embed = Embed()
    layers = [embed, nn.Linear(8, 8), nn.Dropout(0.25), nn.Tanh(), Head(embed)]
    return nn.Sequential(*layers).double()


def run(pipe: Pipe, schedule: str | None, ids: Tensor, targets: Tensor) -> None:
    if schedule is None:
        F.cross_entropy(pipe(ids), targets).backward()
    else:
        pipe.step(ids, targets, F.cross_entropy, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_and_mode_trains_like_the_plain_model(schedule: str | None) -> None:
    model = tied()
    model[2].p = 0.0
    plain = copy.deepcopy(model)
    ids, targets = torch.randint(0, 11, (6,)), torch.randint(0, 11, (6,))
    F.cross_entropy(plain(ids), targets).backward()
    for mode in MODES:
        pipe = Pipe(copy.deepcopy(model), [2, 3], devices=DEVICES, chunks=3, checkpoint=mode)
        run(pipe, schedule, ids, targets)
        assert pipe.state_dict().keys() == plain.state_dict().keys()
        assert len(list(pipe.parameters())) == len(list(plain.parameters())) == 3
        assert pipe[4].weight is pipe[0].token.weight
        for name, grad in gradients(pipe).items():
            torch.testing.assert_close(grad, gradients(plain)[name], msg=f"{mode}: {name}")
        pipe.close()


def test_the_borrower_runs_on_a_copy_and_sgd_moves_the_one_parameter_as_the_plain_models() -> None:
    model = tied()
    model[2].p = 0.0
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [2, 3], devices=DEVICES, chunks=2, checkpoint="never")
    seen: list[Any] = []
    pipe[4].register_forward_pre_hook(lambda module, _: seen.append(module.weight.grad_fn))
    ids, targets = torch.randint(0, 11, (4,)), torch.randint(0, 11, (4,))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    for _ in range(2):
        pipe.step(ids, targets, F.cross_entropy, schedule="1f1b")
        F.cross_entropy(plain(ids), targets).backward()
        optimizer.step()
        plain_optimizer.step()
    assert [type(node).__name__ for node in seen] == ["ToCopyBackward0"] * 4
    assert isinstance(pipe[4].weight, nn.Parameter) and pipe[4].weight is pipe[0].token.weight
    assert len(optimizer.param_groups[0]["params"]) == 3
    for (name, param), expected in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(param, expected, msg=name)
    pipe.close()


def test_checkpoint_modes_agree_bit_for_bit_with_dropout() -> None:
    ids, targets = torch.randint(0, 11, (6,)), torch.randint(0, 11, (6,))
    results = []
    for mode in MODES:
        pipe = Pipe(tied(), [2, 3], devices=DEVICES, chunks=3, checkpoint=mode)
        torch.manual_seed(9)
        pipe.step(ids, targets, F.cross_entropy, schedule="1f1b")
        results.append(gradients(pipe))
        pipe.close()
    # The tied weight's parts are added as the partitions' threads finish them: to rounding.
    for other in results[1:]:
        for name, grad in results[0].items():
            if name == "0.token.weight":
                torch.testing.assert_close(other[name], grad, rtol=0, atol=1e-15)
            else:
                assert torch.equal(other[name], grad), name


def test_a_layer_or_a_buffer_shared_across_devices_is_still_refused() -> None:
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"a layer can be shared .* same device only.*tied across"):
        Pipe(nn.Sequential(shared, shared), [1, 1], devices=DEVICES)
    norm = nn.BatchNorm1d(2)
    other = nn.BatchNorm1d(2)
    other.running_mean = norm.running_mean
    with pytest.raises(ValueError, match=r"a buffer can be shared .* same device only"):
        Pipe(nn.Sequential(norm, other), [1, 1], devices=DEVICES)


@pytest.mark.parametrize("devices", [DEVICES, ["cpu", "cpu"]], ids=["two devices", "one device"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_partition_sharing_a_weight_is_signalled_once_the_weight_is_final(
    devices: list[str], schedule: str
) -> None:
    # In ZB-H1 the last partition ends after the first: the first waits for it.
    pipe = Pipe(tied(), [2, 3], devices=devices, chunks=3, checkpoint="never")
    tied_weight = pipe[0].token.weight
    seen: list[tuple[int, bool]] = []
    pipe.register_partition_backward_hook(lambda j: seen.append((j, tied_weight.grad is not None)))
    pipe.step(
        torch.randint(0, 11, (6,)), torch.randint(0, 11, (6,)), F.cross_entropy, schedule=schedule
    )
    assert sorted(seen) == [(0, True), (1, True)], seen
    pipe.close()


@pytest.fixture(scope="module")
def split_gpt2() -> tuple[nn.Module, nn.Sequential]:
    """GPT-2 with its tied head, and its split, whose first and last pieces read the tied weight."""
    import pipeline

    model = gpt2()
    ids, mask, _ = tokens(4, 6)
    return model, pipeline.split(copy.deepcopy(model), (ids,), {"attention_mask": mask})


def test_split_gpt2_with_its_tied_head_on_two_devices_equals_the_plain_model(
    split_gpt2: tuple[nn.Module, nn.Sequential],
) -> None:
    model, split = split_gpt2
    plain, seq = copy.deepcopy(model), copy.deepcopy(split)
    ids, mask, targets = tokens(4, 6)
    lm_loss(plain(ids, attention_mask=mask), targets).backward()
    expected = gradients(plain)
    assert "lm_head.weight" not in expected  # tied: listed once, as the embedding
    pipe = Pipe(seq, [2, len(seq) - 2], devices=DEVICES, chunks=2)
    assert pipe.state_dict().keys() == plain.state_dict().keys()
    assert pipe.lm_head.weight is pipe.transformer.wte.weight
    torch.testing.assert_close(pipe(ids, attention_mask=mask).logits, plain(ids).logits)
    for schedule in SCHEDULES[1:]:
        pipe.zero_grad(set_to_none=True)
        pipe.step(ids, targets, lm_loss, kwargs={"attention_mask": mask}, schedule=schedule)
        assert_same(gradients(pipe), expected)
    pipe.close()


def test_the_placement_of_a_split_gpt2_keeps_its_tied_weight_home(
    split_gpt2: tuple[nn.Module, nn.Sequential],
) -> None:
    # The pieces of both partitions read it through one module, lm_head.
    seq = copy.deepcopy(split_gpt2[1])
    pipe = Pipe(seq, [2, len(seq) - 2], devices=["cpu", "meta"])
    assert pipe.lm_head.weight is pipe.transformer.wte.weight
    assert pipe.lm_head.weight.device == torch.device("cpu")
    assert pipe.transformer.ln_f.weight.device == torch.device("meta")
    assert pipe.transformer.h[0].mlp.c_fc.weight.device == torch.device("cpu")
    pipe.close()


def test_a_module_run_by_one_partition_and_read_by_another_device_is_refused(
    split_gpt2: tuple[nn.Module, nn.Sequential],
) -> None:
    seq = copy.deepcopy(split_gpt2[1])
    model = nn.Sequential(*seq, seq.lm_head)
    with pytest.raises(ValueError, match=r"'0.lm_head' of partition 0 .* a layer can be shared"):
        Pipe(model, [2, len(seq) - 1], devices=DEVICES)
