"""DistributedPipe on split transformers models: GPT-2 and Llama, stages in separate processes.

Started by tests/gloo_groups.py's run_group with ``script=split_scenarios.py``;
the runner and its helpers are that module's. Each process splits its own
copy of the model, built alike from a seed (on ``meta`` too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import pipeline
from pipeline.distributed import DistributedPipe
from pipeline.schedules import Interleaved1F1B
from tests.gloo_groups import main, rank, scenario, world
from tests.split.split_models import gpt2, llama, lm_loss, tokens


def seeded(make: Callable[..., nn.Module], **config: Any) -> nn.Module:
    torch.manual_seed(0)
    return make(**config)


def batch(rows: int = 6, length: int = 7) -> tuple[Tensor, Tensor, Tensor]:
    torch.manual_seed(1)
    return tokens(rows, length, padded=2)


def split_gpt2(model: nn.Module) -> nn.Sequential:
    """Split on model(ids, attention_mask=mask): the mask passed as a keyword."""
    ids, mask, _ = batch()
    return pipeline.split(model, (ids.to(model.device),), {"attention_mask": mask.to(model.device)})


def split_llama(model: nn.Module) -> nn.Sequential:
    ids, mask, _ = batch()
    return pipeline.split(model, (ids.to(model.device), mask.to(model.device)))


def ends(pipe: DistributedPipe) -> tuple[bool, bool]:
    return 0 in pipe.local_stages, len(pipe.balance) - 1 in pipe.local_stages


def gpt2_step(
    pipe: DistributedPipe, ids: Tensor, mask: Tensor, target: Tensor, **options: Any
) -> Tensor:
    first, last = ends(pipe)
    kwargs = {"attention_mask": mask} if first else None
    return pipe.step(
        ids if first else None, target if last else None, lm_loss, kwargs=kwargs, **options
    )


def llama_step(
    pipe: DistributedPipe, ids: Tensor, mask: Tensor, target: Tensor, **options: Any
) -> Tensor:
    first, last = ends(pipe)
    return pipe.step((ids, mask) if first else None, target if last else None, lm_loss, **options)


def assert_like_the_plain_model(pipe: DistributedPipe, plain: nn.Module, what: str) -> None:
    """Every gradient this process holds equals the plain model's, under the plain model's names."""
    reference = dict(plain.named_parameters(remove_duplicate=False))
    names = [name for name, _ in pipe.named_parameters()]
    assert names and set(names) <= set(reference), f"{what}: {names}"
    for name, param in pipe.named_parameters():
        assert param.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(param.grad, reference[name].grad, msg=f"{what}: {name}")


def assert_names_cover_the_model(pipe: DistributedPipe, model: nn.Module) -> None:
    """Each process holds the model's names of what its pieces use; together, all of them."""
    mine = list(pipe.state_dict())
    everyone: list[list[str]] = [[] for _ in range(world())]
    dist.all_gather_object(everyone, mine)
    keys = list(model.state_dict())
    assert set(mine) <= set(keys)
    assert {key for theirs in everyone for key in theirs} == set(keys)
    assert mine == [key for key in keys if key in mine], "the model's order"


@scenario
def split_gpt2_equals_the_plain_model_with_every_schedule() -> None:
    model = seeded(gpt2)
    plain = copy.deepcopy(model)
    seq = split_gpt2(model)
    ids, mask, target = batch()
    expected = lm_loss(plain(ids, attention_mask=mask), target)
    expected.backward()
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        for checkpoint in ("always", "never"):
            what = f"GPT-2, {schedule}, {checkpoint}"
            model.zero_grad()
            pipe = DistributedPipe(seq, [3, 2], chunks=3, checkpoint=checkpoint)
            loss = gpt2_step(pipe, ids, mask, target, schedule=schedule)
            torch.testing.assert_close(loss, expected.detach(), msg=what)
            assert_like_the_plain_model(pipe, plain, what)
            pipe.close()
    pipe = DistributedPipe(seq, [3, 2], chunks=3)
    assert_names_cover_the_model(pipe, model)
    pipe.close()


@scenario
def split_gpt2_tied_head_and_embedding_train_like_the_plain_model() -> None:
    model = seeded(gpt2)
    plain = copy.deepcopy(model)
    pipe = DistributedPipe(split_gpt2(model), [2, 3], chunks=2)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    for step in range(3):
        ids, mask, target = tokens(4, 6, padded=step)
        optimizer.zero_grad()
        plain_optimizer.zero_grad()
        gpt2_step(pipe, ids, mask, target)
        lm_loss(plain(ids, attention_mask=mask), target).backward()
        optimizer.step()
        plain_optimizer.step()
        reference = dict(plain.named_parameters(remove_duplicate=False))
        for name, param in pipe.named_parameters():
            torch.testing.assert_close(param, reference[name], msg=f"step {step}: {name}")
    # The head's copies in both processes are one parameter there, and equal.
    head = model.lm_head.weight.detach().clone()
    copies = [torch.empty_like(head) for _ in range(world())]
    dist.all_gather(copies, head)
    assert all(torch.equal(c, copies[0]) for c in copies)
    assert model.lm_head.weight is model.transformer.wte.weight
    pipe.close()


@scenario
def split_llama_interleaved_equals_the_plain_model() -> None:
    model = seeded(llama)
    plain = copy.deepcopy(model)
    ids, mask, target = batch()
    pipe = DistributedPipe(split_llama(model), [2, 1, 1, 1], chunks=2)
    loss = llama_step(pipe, ids, mask, target, schedule=Interleaved1F1B(virtual=2))
    expected = lm_loss(plain(ids, mask), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_like_the_plain_model(pipe, plain, "Llama, interleaved")
    assert_names_cover_the_model(pipe, model)
    pipe.close()


def on_meta(make: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return seeded(make)


def meta_names(model: nn.Module) -> set[str]:
    return {name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta}


@scenario
def split_models_built_on_meta_materialise_only_their_pieces() -> None:
    for make, split, step in ((gpt2, split_gpt2, gpt2_step), (llama, split_llama, llama_step)):
        plain = seeded(make)
        model = on_meta(make)
        seq = split(model)  # captured on the meta model, with inputs on meta
        pipe = DistributedPipe(seq, [3, 2], chunks=2, init=model._init_weights)
        what = type(model).__name__
        held = {name for name, _ in [*pipe.named_parameters(), *pipe.named_buffers()]}
        assert held and not meta_names(pipe), f"{what}: {meta_names(pipe)} still on meta"
        # What other processes hold stays on meta here; a tied weight is held by both.
        left = meta_names(model)
        everything = {name for name, _ in [*model.named_parameters(), *model.named_buffers()]}
        assert left and left == everything - held, what
        pipe.load_state_dict(plain.state_dict())
        ids, mask, target = batch()
        loss = step(pipe, ids, mask, target)
        expected = lm_loss(
            plain(ids, mask) if make is llama else plain(ids, attention_mask=mask), target
        )
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), msg=what)
        assert_like_the_plain_model(pipe, plain, what)
        pipe.close()


@scenario
def split_models_built_on_meta_get_the_models_initialisation() -> None:
    model = on_meta(gpt2)
    pipe = DistributedPipe(split_gpt2(model), [3, 2], init=model._init_weights)
    for name, param in pipe.named_parameters():
        if name.endswith("ln_1.weight") or name.endswith("ln_f.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        if name.endswith("c_attn.weight"):  # normal(0, 0.02), as transformers initialises it
            assert 0.01 < float(param.std()) < 0.03, name
    # The tied head starts equal in both processes, from the first holder's values.
    head = model.lm_head.weight.detach().clone()
    copies = [torch.empty_like(head) for _ in range(world())]
    dist.all_gather(copies, head)
    assert torch.equal(copies[0], copies[1])
    pipe.close()
    refused = on_meta(llama)
    try:
        DistributedPipe(split_llama(refused), [3, 2])
    except ValueError as error:
        assert "has no reset_parameters()" in str(error) and "init=" in str(error), str(error)
    else:
        raise AssertionError("a Llama on meta without init was not refused")


@scenario
def split_gpt2_in_eval_mode_across_processes() -> None:
    model = seeded(gpt2, embd_pdrop=0.5, resid_pdrop=0.5, attn_pdrop=0.5)
    plain = copy.deepcopy(model).eval()
    pipe = DistributedPipe(split_gpt2(model), [1, 4], chunks=2)
    pipe.eval()
    assert not model.transformer.drop.training or rank() != 0, "the embedding's dropout"
    ids, mask, target = batch()
    loss = gpt2_step(pipe, ids, mask, target)
    expected = lm_loss(plain(ids, attention_mask=mask), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_like_the_plain_model(pipe, plain, "eval mode")
    pipe.close()


if __name__ == "__main__":
    main()
