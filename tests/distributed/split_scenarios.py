"""DistributedPipe on split transformers models: GPT-2 and Llama, stages in separate processes.

Started by tests/gloo_groups.py's run_group with ``script=split_scenarios.py``;
the runner and its helpers are that module's. Each process splits its own
copy of the model, built alike from a seed (on ``meta`` too), once: the
scenarios share it and start from its initial weights (a split takes seconds).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import pipeline
from pipeline.distributed import DistributedPipe
from pipeline.schedules import Interleaved1F1B
from pipeline.step.mail import AbortedError
from tests.gloo_groups import expect_error, main, rank, scenario, world
from tests.split import hf_labels
from tests.split.split_models import EarlyLate, gpt2, llama, lm_loss, mixtral, tokens


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


@cache
def _shared_gpt2() -> tuple[nn.Module, nn.Sequential, dict[str, Tensor]]:
    model = seeded(gpt2)
    return model, split_gpt2(model), copy.deepcopy(model.state_dict())


def shared_gpt2() -> tuple[nn.Module, nn.Sequential, nn.Module]:
    """This process's split GPT-2 at its initial weights, and a plain copy of it."""
    model, seq, initial = _shared_gpt2()
    model.load_state_dict(initial)
    model.zero_grad()
    return model, seq, copy.deepcopy(model)


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
    model, seq, plain = shared_gpt2()
    ids, mask, target = batch()
    expected = lm_loss(plain(ids, attention_mask=mask), target)
    expected.backward()
    for schedule, checkpoint in (("gpipe", "always"), ("1f1b", "never"), ("zb-h1", "always")):
        what = f"GPT-2, {schedule}, {checkpoint}"
        model.zero_grad()
        pipe = DistributedPipe(seq, [3, 2], chunks=3, checkpoint=checkpoint)
        loss = gpt2_step(pipe, ids, mask, target, schedule=schedule)
        torch.testing.assert_close(loss, expected.detach(), msg=what)
        assert_like_the_plain_model(pipe, plain, what)
        pipe.close()
    pipe = DistributedPipe(seq, [3, 2], chunks=3)
    assert_names_cover_the_model(pipe, model)
    # evaluate takes the mask as step does. (Its loss: the output, a ModelOutput, is not
    # a value the wire format carries between processes.)
    first, last = ends(pipe)
    kwargs = {"attention_mask": mask} if first else None
    loss = pipe.evaluate(ids if first else None, target if last else None, lm_loss, kwargs=kwargs)
    with torch.no_grad():
        torch.testing.assert_close(loss, lm_loss(plain.eval()(ids, attention_mask=mask), target))
    plain.train()
    pipe.close()


@scenario
def split_gpt2_tied_head_and_embedding_train_like_the_plain_model() -> None:
    model, seq, plain = shared_gpt2()
    pipe = DistributedPipe(seq, [2, 3], chunks=2)
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


def on_meta(make: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return seeded(make)


def meta_names(model: nn.Module) -> set[str]:
    return {name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta}


def assert_initialised_like_transformers(pipe: DistributedPipe, model: nn.Module) -> None:
    for name, param in pipe.named_parameters():
        if name.endswith(("layernorm.weight", "norm.weight", "ln_1.weight", "ln_f.weight")):
            assert torch.equal(param, torch.ones_like(param)), name
        if name.endswith(("c_attn.weight", "q_proj.weight")):  # normal(0, 0.02)
            assert 0.01 < float(param.detach().std()) < 0.03, name
    if model.lm_head.weight is not model.get_input_embeddings().weight:
        return
    # A tied head starts equal in both processes, from the first holder's values.
    head = model.lm_head.weight.detach().clone()
    copies = [torch.empty_like(head) for _ in range(world())]
    dist.all_gather(copies, head)
    assert torch.equal(copies[0], copies[1])


REFUSED_WITHOUT_INIT = ("has no reset_parameters()", "init=")


LLAMA = (llama, split_llama, llama_step, [2, 1, 1, 1], Interleaved1F1B(virtual=2))
GPT2 = (gpt2, split_gpt2, gpt2_step, [3, 2], "1f1b")


@scenario
def split_models_built_on_meta_materialise_only_their_pieces() -> None:
    """Llama (its stages interleaved) and GPT-2, each process materialising its pieces."""
    for make, split, step, balance, schedule in (LLAMA, GPT2):
        plain = seeded(make)
        model = on_meta(make)
        seq = split(model)  # captured on the meta model, with inputs on meta
        what = type(model).__name__
        if make is llama:  # no reset_parameters() in transformers modules: init= is needed
            expect_error(ValueError, partial(DistributedPipe, seq, balance), *REFUSED_WITHOUT_INIT)
        pipe = DistributedPipe(seq, balance, chunks=2, init=model._init_weights)
        held = {name for name, _ in [*pipe.named_parameters(), *pipe.named_buffers()]}
        assert held and not meta_names(pipe), f"{what}: {meta_names(pipe)} still on meta"
        # What other processes hold stays on meta here; a tied weight is held by both.
        left = meta_names(model)
        everything = {name for name, _ in [*model.named_parameters(), *model.named_buffers()]}
        assert left and left == everything - held, what
        assert_initialised_like_transformers(pipe, model)
        pipe.load_state_dict(plain.state_dict())
        ids, mask, target = batch()
        loss = step(pipe, ids, mask, target, schedule=schedule)
        expected = lm_loss(
            plain(ids, mask) if make is llama else plain(ids, attention_mask=mask), target
        )
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), msg=what)
        assert_like_the_plain_model(pipe, plain, what)
        pipe.close()
        pipe = DistributedPipe(seq, balance, init=model._init_weights)
        assert_names_cover_the_model(pipe, model)
        pipe.close()


@scenario
def split_mixtral_with_eager_experts_on_meta_trains_like_the_plain_model() -> None:
    """Routing on values inside the blocks (learned at split from a run on stand-ins, on the
    CPU for a meta model): each process materialises its pieces; 1F1B and ZB-H1 equal."""
    plain = seeded(mixtral)
    model = on_meta(mixtral)
    ids, _, target = batch()
    seq = pipeline.split(model, (ids[:2].to("meta"),))
    for schedule in ("1f1b", "zb-h1"):
        pipe = DistributedPipe(seq, [2, 2], chunks=3, init=model._init_weights)
        assert not meta_names(pipe), meta_names(pipe)
        pipe.load_state_dict(plain.state_dict())
        pipe.zero_grad()  # the pieces' parameters are the first pipe's
        first, last = ends(pipe)
        loss = pipe.step(
            ids if first else None, target if last else None, lm_loss, schedule=schedule
        )
        plain.zero_grad()
        expected = lm_loss(plain(ids), target)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), msg=schedule)
        assert_like_the_plain_model(pipe, plain, f"Mixtral, {schedule}")
        pipe.close()


def asking_for_the_router_loss(model: nn.Module) -> nn.Module:
    model.config.output_router_logits = True
    model.router_aux_loss_coef = 0.5  # large, so that its gradient shows
    return model


@scenario
def split_mixtral_router_loss_on_meta_in_gpipe_like_the_plain_model() -> None:
    """The load-balancing loss over the whole batch (tests/split/test_router_loss.py): each
    process counts its routers' tokens, the counts are summed over the processes at the first
    backward. GPipe and evaluate equal; 1F1B, or a process without the input, refused on all."""
    plain = asking_for_the_router_loss(seeded(mixtral))
    model = asking_for_the_router_loss(on_meta(mixtral))
    ids, mask, _ = batch()
    labels = ids.clone()
    labels[1, :3] = -100
    n = (labels[..., 1:] != -100).sum()
    example = {"attention_mask": mask[:2], "labels": labels[:2], "num_items_in_batch": n}
    seq = pipeline.split(
        model, (ids[:2].to("meta"),), {k: v.to("meta") for k, v in example.items()}
    )
    pipe = DistributedPipe(seq, [2, 2], chunks=3, init=model._init_weights)
    pipe.load_state_dict(plain.state_dict())
    recipe = {"attention_mask": mask, "labels": labels, "num_items_in_batch": pipeline.NoChunk(n)}

    def step(here: bool = True, **options: Any) -> Tensor:
        return pipe.step(
            ids if here else None,
            labels,
            hf_labels.out_loss,
            kwargs=recipe if here else None,
            loss_reduction="sum",
            **options,
        )

    expect_error(ValueError, lambda: step(schedule="1f1b"), "use schedule='gpipe'")
    absent = "pass the same input and kwargs on every process" if rank() == 1 else "refused"
    expect_error(ValueError, lambda: step(rank() != 1, schedule="gpipe"), absent)
    assert all(p.grad is None for p in pipe.parameters()), "refused before any work"
    # Refused mid-step where the last stage runs, which stops the other's wait for the counts.
    other_loss = partial(
        pipe.step,
        ids,
        labels,
        lambda out, _: out.loss * 1.0,
        kwargs=recipe,
        loss_reduction="sum",
        schedule="gpipe",
    )
    expect_error(ValueError if rank() == 1 else AbortedError, other_loss, "return out.loss itself")
    loss = step(schedule="gpipe")
    expected = plain(ids, **recipe | {"num_items_in_batch": n}).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_like_the_plain_model(pipe, plain, "Mixtral's router loss, GPipe")
    evaluated = pipe.evaluate(ids, labels, hf_labels.out_loss, kwargs=recipe, loss_reduction="sum")
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(evaluated, plain(ids, **recipe | {"num_items_in_batch": n}).loss)
    pipe.close()


@scenario
def split_mixtral_router_loss_in_data_parallel_like_ddp_of_the_plain_model() -> None:
    """Under DataParallel each replica's router loss is over its own rows, as under DDP (and
    docs/split.md says): the replicas' averaged gradients equal the plain model's averaged over
    the replicas' rows, each replica's loss the plain model's on its rows."""
    plain = asking_for_the_router_loss(seeded(mixtral))
    model = asking_for_the_router_loss(seeded(mixtral))
    ids, mask, _ = batch()
    labels = ids.clone()
    labels[1, :3] = -100  # the replicas count different tokens
    rows = ids.shape[0] // world()

    def recipe(part: slice) -> dict[str, Any]:
        n = (labels[part][..., 1:] != -100).sum()
        return {"attention_mask": mask[part], "labels": labels[part], "num_items_in_batch": n}

    seq = pipeline.split(model, (ids[:1],), recipe(slice(0, 1)))
    dp = pipeline.DataParallel(pipeline.Pipe(seq, [2, 2], chunks=rows))
    mine = slice(rank() * rows, (rank() + 1) * rows)
    mine_recipe = recipe(mine)
    mine_recipe["num_items_in_batch"] = pipeline.NoChunk(mine_recipe["num_items_in_batch"])
    loss = dp.step(
        ids[mine],
        labels[mine],
        hf_labels.out_loss,
        kwargs=mine_recipe,
        loss_reduction="sum",
        schedule="gpipe",
    )
    for r in range(world()):
        part = slice(r * rows, (r + 1) * rows)
        out = plain(ids[part], **recipe(part))
        assert out.aux_loss is not None and float(out.aux_loss) > 0
        (out.loss / world()).backward()
        if r == rank():
            torch.testing.assert_close(loss, out.loss.detach())
    reference = dict(plain.named_parameters())
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        torch.testing.assert_close(parameter.grad, reference[name].grad, msg=name)
    dp.module.close()


def set_dropout(model: nn.Module, p: float) -> None:
    """Inside GPT-2's blocks (each called as itself), a dropout's p is read at each call."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p


@scenario
def split_gpt2_in_eval_mode_across_processes() -> None:
    model, seq, plain = shared_gpt2()
    set_dropout(model, 0.5)
    set_dropout(plain, 0.5)
    plain.eval()
    try:
        pipe = DistributedPipe(seq, [1, 4], chunks=2)
        pipe.eval()
        assert not model.transformer.drop.training or rank() != 0, "the embedding's dropout"
        ids, mask, target = batch()
        loss = gpt2_step(pipe, ids, mask, target)
        expected = lm_loss(plain(ids, attention_mask=mask), target)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        assert_like_the_plain_model(pipe, plain, "eval mode")
        pipe.close()
    finally:
        set_dropout(model, 0.0)
        model.train()


# transformers' own loss (out.loss given labels=), with the count of the
# whole batch's tokens as num_items_in_batch (tests/split/test_hf_loss.py).


@cache
def _counted_gpt2() -> tuple[nn.Module, nn.Sequential, dict[str, Tensor]]:
    # A float count: under DataParallel each replica passes the global count
    # over the number of replicas.
    model = seeded(gpt2)
    return model, hf_labels.split_counted(model, torch.float64), copy.deepcopy(model.state_dict())


def counted_gpt2() -> tuple[nn.Module, nn.Sequential, nn.Module]:
    """This process's GPT-2 split with num_items_in_batch at its initial weights, and a copy."""
    model, seq, initial = _counted_gpt2()
    model.load_state_dict(initial)
    model.zero_grad(set_to_none=True)
    return model, seq, copy.deepcopy(model)


@scenario
def split_gpt2_own_loss_with_the_count_across_processes() -> None:
    _, seq, plain = counted_gpt2()
    ids, mask, labels = hf_labels.batch(1)
    pipe = DistributedPipe(seq, [3, 2], chunks=hf_labels.CHUNKS)
    first, last = ends(pipe)
    n = hf_labels.count(labels).double()

    def step(**options: Any) -> Tensor:
        return pipe.step(
            ids if first else None,
            labels if last else None,
            hf_labels.out_loss,
            kwargs=hf_labels.recipe(mask, labels, n) if first else None,
            **options,
        )

    # Weighed by rows, the summed losses would be wrong: every process refuses.
    expected_error = "loss_reduction='sum'" if first else "refused this step's arguments"
    expect_error(ValueError, step, expected_error)
    assert all(p.grad is None for p in pipe.parameters()), "refused before any work"
    loss = step(loss_reduction="sum")
    expected = hf_labels.plain_loss(plain, ids, mask, labels)
    # float32 over a float64 count: a float64 loss.
    torch.testing.assert_close(loss, expected, check_dtype=False)
    assert_like_the_plain_model(pipe, plain, "out.loss with num_items_in_batch")
    pipe.close()


@scenario
def split_gpt2_own_loss_in_data_parallel_is_the_mean_over_every_token() -> None:
    # Each replica's count is the global one over the replicas: averaging the
    # replicas' gradients gives the plain model's mean over every token.
    model, seq, plain = counted_gpt2()
    ids, mask, labels = hf_labels.batch(2, rows=hf_labels.ROWS * world())
    mine = slice(rank() * hf_labels.ROWS, (rank() + 1) * hf_labels.ROWS)
    local = hf_labels.count(labels[mine]).double()
    counts = [torch.zeros_like(local) for _ in range(world())]
    dist.all_gather(counts, local)
    assert len({int(c) for c in counts}) > 1, "the replicas must hold different counts"
    n = sum(counts) / world()
    dp = pipeline.DataParallel(pipeline.Pipe(seq, [2, 3], chunks=hf_labels.CHUNKS))
    loss = dp.step(
        ids[mine],
        labels[mine],
        hf_labels.out_loss,
        kwargs=hf_labels.recipe(mask[mine], labels[mine], n),
        loss_reduction="sum",
    )
    expected = hf_labels.plain_loss(plain, ids, mask, labels)
    dist.all_reduce(loss)
    torch.testing.assert_close(loss / world(), expected, check_dtype=False)
    reference = dict(plain.named_parameters())
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        torch.testing.assert_close(parameter.grad, reference[name].grad, msg=name)
    dp.module.close()


def values_by_place(module: nn.Module) -> None:
    """An init giving each of a module's own tensors values by their place, alike anywhere."""
    with torch.no_grad():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for k, tensor in enumerate(own):
            place = torch.arange(tensor.numel(), dtype=torch.float64) * (k + 1) + tensor.numel()
            tensor.copy_(torch.sin(place).reshape(tensor.shape))


@scenario
def a_split_model_with_tensors_of_its_own_built_on_meta_trains_like_the_plain_model() -> None:
    """The model's own parameter and buffer, materialised: the split model's checks follow
    them (they were refused as replaced after the split, midway through the first step)."""
    plain = EarlyLate().double()
    plain.apply(values_by_place)
    with torch.device("meta"):
        model = EarlyLate().double()
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 8, dtype=torch.float64, generator=gen), torch.randn(8, 3, generator=gen)
    seq = pipeline.split(model, (x.to("meta"),))
    half = len(seq) // 2
    pipe = DistributedPipe(seq, [half, len(seq) - half], chunks=2, init=values_by_place)
    first, last = ends(pipe)
    loss = pipe.step(x if first else None, y.double() if last else None, F.mse_loss)
    expected = F.mse_loss(plain(x), y.double())
    expected.backward()
    if last:
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_like_the_plain_model(pipe, plain, "a split model's own tensors, from meta")
    pipe.close()


if __name__ == "__main__":
    main()
