"""save_checkpoint and load_checkpoint in one process: the plain model and a Pipe.

Across processes (2 stage processes, a pp=2 x dp=2 grid) the round trips are
checkpoint_scenarios.py's, run in test_distributed_pipe.py's groups. Here:
the plain model and a Pipe resume each other, an optimizer before its first
step, gradients present when loading, an LR scheduler alongside, and what a
load refuses: a checkpoint that lacks keys, one that holds keys the model
lacks (unless strict=False), a shape that differs.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.optim.optimizer import register_optimizer_step_post_hook

from pipeline import Pipe
from pipeline.distributed import load_checkpoint, save_checkpoint
from tests.distributed.checkpoint_scenarios import (
    BLOCKS,
    MODELS,
    SAVED_AFTER,
    STEPS,
    TIED,
    UNTIED,
    Model,
    a_full_disk,
    adamw,
    assert_resumes,
    assert_weights,
    refused_untouched,
    train,
    uninterrupted,
    untied,
    weights,
)


def cpu_pipe(model: Model, seed: int) -> Pipe:
    return Pipe(model.build(seed), model.balances[2], devices=["cpu"] * 2, chunks=2)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_a_pipe_and_the_plain_model_resume_each_other(model: Model, tmp_path: Path) -> None:
    reference = uninterrupted(model)
    pipe = cpu_pipe(model, seed=0)
    optimizer = adamw(pipe)
    for step in range(SAVED_AFTER):
        train(model, pipe, optimizer, step)
    save_checkpoint(tmp_path, pipe, optimizer)
    assert_resumes(model, reference, pipe, optimizer, "the saving Pipe, trained on")
    pipe.close()
    plain = model.build(7)
    optimizer = adamw(plain)
    load_checkpoint(tmp_path, plain, optimizer)
    assert_resumes(model, reference, plain, optimizer, "the plain model")


def test_an_optimizer_before_its_first_step_is_saved_as_it_is(tmp_path: Path) -> None:
    # torch's calls give it state by a zero-lr step: step 1 too many, later steps differ.
    model = BLOCKS
    plain, reference = model.build(0), model.build(0)
    optimizer, reference_optimizer = adamw(plain), adamw(reference)
    steps: list[str] = []  # that zero-lr step is no step of the training: its hooks are quiet
    optimizer.register_step_post_hook(lambda *_: steps.append("own"))
    handle = register_optimizer_step_post_hook(lambda *_: steps.append("global"))
    save_checkpoint(tmp_path, plain, optimizer)
    assert not optimizer.state
    pipe = cpu_pipe(model, seed=7)
    loaded = adamw(pipe)
    load_checkpoint(tmp_path, pipe, loaded)
    assert not loaded.state
    handle.remove()
    assert steps == []
    for step in range(STEPS):
        for module, opt in ((plain, optimizer), (pipe, loaded), (reference, reference_optimizer)):
            train(model, module, opt, step)
        expected = dict(reference.named_parameters())
        for module in (plain, pipe):
            for name, param in module.named_parameters():
                torch.testing.assert_close(param, expected[name], rtol=0, atol=1e-12, msg=name)
    pipe.close()


def test_a_fresh_optimizer_whose_parameters_hold_grads_loads_the_state(tmp_path: Path) -> None:
    # torch's calls skip giving it state when a .grad is there, and then load none.
    model = BLOCKS
    reference = uninterrupted(model)
    plain = model.build(0)
    optimizer = adamw(plain)
    for step in range(SAVED_AFTER):
        train(model, plain, optimizer, step)
    save_checkpoint(tmp_path, plain, optimizer)
    pipe = cpu_pipe(model, seed=7)
    loaded = adamw(pipe)
    x, y = model.batch(99)
    pipe.step(x, y, model.loss)  # a warm-up pass: every parameter holds a .grad
    grads = {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}
    load_checkpoint(tmp_path, pipe, loaded)
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=0, msg=name)
    assert_resumes(model, reference, pipe, loaded, "loaded with grads present")
    pipe.close()


def test_an_lr_scheduler_rides_along_in_extra(tmp_path: Path) -> None:
    model = BLOCKS
    plain = model.build(0)
    optimizer = adamw(plain)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(SAVED_AFTER):
        train(model, plain, optimizer, step)
        scheduler.step()
    save_checkpoint(tmp_path, plain, optimizer, extra={"scheduler": scheduler})
    pipe = cpu_pipe(model, seed=7)
    loaded = adamw(pipe)
    loaded_scheduler = torch.optim.lr_scheduler.StepLR(loaded, step_size=1, gamma=0.5)
    load_checkpoint(tmp_path, pipe, loaded, extra={"scheduler": loaded_scheduler})
    assert loaded_scheduler.last_epoch == scheduler.last_epoch == SAVED_AFTER
    assert [g["lr"] for g in loaded.param_groups] == [0.05 / 4] * 2
    for step in range(SAVED_AFTER, STEPS):
        for module, opt, sched in ((plain, optimizer, scheduler), (pipe, loaded, loaded_scheduler)):
            train(model, module, opt, step)
            sched.step()
        expected = dict(plain.named_parameters())
        for name, param in pipe.named_parameters():
            torch.testing.assert_close(param, expected[name], rtol=0, atol=1e-12, msg=name)
    pipe.close()


def test_a_missing_key_is_named_and_the_optimizer_is_left_as_it_was(tmp_path: Path) -> None:
    model = BLOCKS
    plain = model.build(0)
    save_checkpoint(tmp_path, plain)  # without the optimizer
    optimizer = adamw(plain)
    train(model, plain, optimizer, 0)
    before = {k: v.clone() for k, v in optimizer.state[plain[0].weight].items()}
    with pytest.raises(
        RuntimeError,
        match=r"lacks optim\.param_groups\.0\.bias\.amsgrad, .* more, .*saved without an optimizer",
    ):
        load_checkpoint(tmp_path, plain, optimizer)
    after = optimizer.state[plain[0].weight]
    assert after.keys() == before.keys()
    for field, value in before.items():
        torch.testing.assert_close(after[field], value, rtol=0, atol=0)
    deeper = torch.nn.Sequential(*model.build(0), torch.nn.Linear(8, 8)).double()
    with pytest.raises(
        RuntimeError, match=r"lacks model\.8\.bias, model\.8\.weight, .*other parameters"
    ):
        load_checkpoint(tmp_path, deeper)


def trained_and_saved(path: Path) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """BLOCKS' plain model after a step, saved with its optimizer in ``path``."""
    plain = BLOCKS.build(0)
    optimizer = adamw(plain)
    train(BLOCKS, plain, optimizer, 0)
    save_checkpoint(path, plain, optimizer)
    return plain, optimizer


def test_param_groups_that_mix_the_saved_settings_are_refused(tmp_path: Path) -> None:
    # Saved with decay on the weights alone; one group for all would give every
    # parameter the first one's settings (torch's flattened load reads no other).
    plain, _ = trained_and_saved(tmp_path)
    merged = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.1)
    train(BLOCKS, plain, merged, 1)
    refused_untouched(
        lambda: load_checkpoint(tmp_path, plain, merged),
        plain,
        merged,
        "weight_decay=0.1 and",
        "weight_decay=0.0, which this optimizer holds in one param group",
    )
    load_checkpoint(tmp_path, plain, adamw(plain))  # the saved groups load


def test_an_optimizer_holding_a_parameter_the_module_lacks_is_refused(tmp_path: Path) -> None:
    # A learnable loss scale beside the model: torch's calls failed with a bare
    # KeyError, and the failed load had emptied the optimizer's state.
    plain, optimizer = trained_and_saved(tmp_path)
    scale = nn.Parameter(torch.ones((), dtype=torch.double))
    optimizer.add_param_group({"params": [scale], "lr": 0.5})
    outside = "holds a parameter of shape () (param group 2) that the module does not"
    with pytest.raises(ValueError, match=r"save_checkpoint refused.*" + re.escape(outside)):
        save_checkpoint(tmp_path / "again", plain, optimizer)
    refused = refused_untouched(
        lambda: load_checkpoint(tmp_path, plain, optimizer), plain, optimizer, outside
    )
    assert refused.startswith("load_checkpoint(")


@pytest.mark.parametrize("frozen_when_saved", [True, False])
def test_a_frozen_parameters_saved_state_loads_as_torchs_load_state_dict_does(
    tmp_path: Path, frozen_when_saved: bool
) -> None:
    # Trained, then frozen (fine-tuning the rest): its state was refused as another
    # optimizer's, and strict=False dropped it; unfrozen later, the run went 0.15 off.
    plain = BLOCKS.build(0)
    optimizer = adamw(plain)
    train(BLOCKS, plain, optimizer, 0)
    plain[0].weight.requires_grad_(not frozen_when_saved)
    train(BLOCKS, plain, optimizer, 1)
    save_checkpoint(tmp_path, plain, optimizer)
    resumed = BLOCKS.build(5)
    resumed[0].weight.requires_grad_(False)
    loaded = adamw(resumed)
    load_checkpoint(tmp_path, resumed, loaded)
    for model in (plain, resumed):
        model[0].weight.requires_grad_(True)
    for step in (2, 3):
        train(BLOCKS, plain, optimizer, step)
        train(BLOCKS, resumed, loaded, step)
    for name, param in plain.named_parameters():
        torch.testing.assert_close(resumed.get_parameter(name), param, rtol=0, atol=0, msg=name)


def test_keys_the_model_lacks_are_refused_unless_strict_is_false(tmp_path: Path) -> None:
    # A checkpoint of 4 blocks into a Pipe of 3 (another depth): as torch's load_state_dict.
    plain, optimizer = trained_and_saved(tmp_path)
    shallower = Pipe(nn.Sequential(*BLOCKS.build(7)[:6]), [3, 3], devices=["cpu"] * 2, chunks=2)
    loaded = adamw(shallower)
    train(BLOCKS, shallower, loaded, 0)
    refused_untouched(
        lambda: load_checkpoint(tmp_path, shallower, loaded),
        shallower,
        loaded,
        "holds model.6.bias, model.6.weight and ",
        "keys of the optimizer's state",
        "no process of the load asks for",
        "pass strict=False",
    )
    # Without an optimizer only the model's keys are asked for, and refused.
    refused_untouched(
        lambda: load_checkpoint(tmp_path, shallower),
        shallower,
        loaded,
        "holds model.6.bias, model.6.weight, which no process",
    )
    load_checkpoint(tmp_path, shallower, loaded, strict=False)
    saved = dict(plain.named_parameters())
    for name, param in shallower.named_parameters():
        torch.testing.assert_close(param.detach(), saved[name].detach(), rtol=0, atol=0)
        state, saved_state = loaded.state[param], optimizer.state[saved[name]]
        assert state.keys() == saved_state.keys()
        for field, value in saved_state.items():
            torch.testing.assert_close(state[field], value, rtol=0, atol=0, msg=field)
    shallower.close()


def test_a_shape_that_differs_is_refused_naming_the_key_and_both_shapes(tmp_path: Path) -> None:
    trained_and_saved(tmp_path)
    wider = BLOCKS.build(7)
    wider[2], wider[4] = nn.Linear(8, 16).double(), nn.Linear(16, 8).double()
    loaded = adamw(wider)
    train(BLOCKS, wider, loaded, 0)
    # A RuntimeError (an Exception), before anything is read, the optimizer too.
    refused_untouched(
        lambda: load_checkpoint(tmp_path, wider, loaded),
        wider,
        loaded,
        "shapes differ on this process: model.2.bias is (8,) in the checkpoint, (16,) in the "
        "model, model.2.weight is (8, 8) in the checkpoint, (16, 8) in the model, "
        "model.4.weight is (8, 8) in the checkpoint, (8, 16) in the model",
        "build the model with the checkpoint's sizes",
    )


def test_a_failed_save_leaves_the_checkpoint_there_and_the_directorys_other_files(
    tmp_path: Path,
) -> None:
    # DCP wrote over the old files, its old metadata kept: the failed save's data loaded.
    plain, optimizer = trained_and_saved(tmp_path)
    saved = weights(plain)
    (tmp_path / "config.json").write_text("{}")  # the user's, beside the checkpoint
    train(BLOCKS, plain, optimizer, 1)
    with a_full_disk(after_writing=True), pytest.raises(ValueError) as refused:
        save_checkpoint(tmp_path, plain, optimizer)
    assert str(refused.value).endswith(
        "failed, the checkpoint there left as it was: this process failed: OSError: [Errno 28] "
        "No space left on device"
    )
    assert isinstance(refused.value.__cause__, CheckpointException)
    loaded = BLOCKS.build(7)
    load_checkpoint(tmp_path, loaded)
    assert_weights(loaded, saved, "after the failed save")
    save_checkpoint(tmp_path, plain, optimizer)
    load_checkpoint(tmp_path, loaded)
    assert_weights(loaded, weights(plain), "after the second save")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "config.json",
    ]


def test_a_save_failing_while_its_files_move_in_leaves_no_checkpoint_rather_than_a_mix(
    tmp_path: Path,
) -> None:
    # The old .metadata goes first: a load then finds none, never old metadata on new files.
    plain, optimizer = trained_and_saved(tmp_path)
    train(BLOCKS, plain, optimizer, 1)
    replace = os.replace

    def failing(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        if Path(target).name == ".metadata":
            raise OSError(errno.EIO, "Input/output error")
        replace(source, target)

    with mock.patch("os.replace", failing), pytest.raises(ValueError) as failed:
        save_checkpoint(tmp_path, plain, optimizer)
    assert "failed after the old checkpoint's .metadata was removed" in str(failed.value)
    assert "this process failed: OSError: [Errno 5] Input/output error" in str(failed.value)
    with pytest.raises(RuntimeError, match=r"refused, nothing was loaded: .*\(its metadata\)"):
        load_checkpoint(tmp_path, BLOCKS.build(7))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["__0_0.distcp"]
    # What a failed save of two processes leaves beside, with no metadata naming it (a
    # later save kept it for good), and a killed one's staging: the next save clears both.
    # A file of the user's own is kept, whatever its suffix.
    (tmp_path / "__1_0.distcp").write_bytes(b"stale")
    (tmp_path / ".saving-rank1").mkdir()
    (tmp_path / "reference.distcp").write_bytes(b"the user's")
    save_checkpoint(tmp_path, plain, optimizer)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".metadata", "__0_0.distcp", "reference.distcp"]


@pytest.mark.parametrize("pipe", [False, True], ids=["plain", "Pipe"])
def test_a_checkpoint_whose_names_of_a_tied_weight_differ_is_refused(
    tmp_path: Path, pipe: bool
) -> None:
    # torch's load_state_dict keeps the last name's value; this load read the first's.
    saving = untied(TIED, seed=0)
    optimizer = adamw(saving)
    train(TIED, saving, optimizer, 0)
    save_checkpoint(tmp_path, saving, optimizer)
    tied: nn.Module = cpu_pipe(TIED, seed=7) if pipe else TIED.build(7)
    loaded = adamw(tied)
    train(TIED, tied, loaded, 0)
    refused_untouched(lambda: load_checkpoint(tmp_path, tied, loaded), tied, loaded, UNTIED)
    refused_untouched(lambda: load_checkpoint(tmp_path, tied), tied, loaded, UNTIED)
    # A tied model's checkpoint holds one value under both names: it loads, a NaN in it
    # too (a diverged run's: refused, as if not tied, before).
    with torch.no_grad():
        next(tied.parameters()).view(-1)[0] = float("nan")
    save_checkpoint(tmp_path / "tied", tied, loaded)
    fresh = TIED.build(5)
    load_checkpoint(tmp_path / "tied", fresh, adamw(fresh))
    for (name, p), q in zip(fresh.named_parameters(), tied.parameters(), strict=True):
        torch.testing.assert_close(p, q, equal_nan=True, msg=name)
    # The tied model's checkpoint marks its tie: its load reads no copies to compare (a
    # 98 MiB tied embedding took 3.3 times its size to load, 1.3 times without them).
    marks = [
        [k for k in FileSystemReader(where).read_metadata().state_dict_metadata if "ties" in k]
        for where in (tmp_path, tmp_path / "tied")
    ]
    assert marks[0] == [] and len(marks[1]) == 1 and marks[1][0].startswith("model-ties.")
    if isinstance(tied, Pipe):
        tied.close()


def test_a_damaged_or_missing_data_file_is_refused_and_a_corrupt_one_fails_as_an_exception(
    tmp_path: Path,
) -> None:
    # DCP failed halfway with a CheckpointException: a BaseException, not an Exception.
    plain, _ = trained_and_saved(tmp_path)
    data = tmp_path / "__0_0.distcp"
    whole = data.read_bytes()
    loaded = adamw(plain)
    train(BLOCKS, plain, loaded, 1)
    load = lambda: load_checkpoint(tmp_path, plain, loaded)  # noqa: E731
    data.write_bytes(whole[:100])  # partly copied
    damaged = "refused, nothing was loaded: the checkpoint's data files that this process reads "
    refused_untouched(
        load,
        plain,
        loaded,
        damaged,
        f"__0_0.distcp holds 100 bytes, where its metadata needs {len(whole)}",
    )
    data.unlink()
    refused_untouched(
        load, plain, loaded, damaged, "__0_0.distcp cannot be read (FileNotFoundError"
    )
    data.write_bytes(bytes(len(whole)))  # whole, but zeros
    # The optimizer's settings are read first, into tensors of their own: nothing changed.
    unreadable = "this process failed: UnpicklingError: "
    refused_untouched(load, plain, loaded, "refused, nothing was loaded: " + unreadable)
    with pytest.raises(
        RuntimeError, match="failed reading it, after some weights were read"
    ) as failed:
        load_checkpoint(tmp_path, plain)
    assert unreadable in str(failed.value)
    assert isinstance(failed.value.__cause__, CheckpointException)
