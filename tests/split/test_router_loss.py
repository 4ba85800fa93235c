"""The router loss: a split MoE model's load-balancing loss over the whole batch, as the model's.

Mixtral and Qwen2-MoE asked for their router logits add
``router_aux_loss_coef`` times a load-balancing loss over every token of
the batch to ``out.loss``. The split model itself gives the model's output;
a Pipe's GPipe step and its evaluation give the model's loss and every
gradient, in each checkpoint mode, with a padded mask and labels ignoring
tokens; what cannot be exact is refused before any work. Across processes:
tests/distributed/split_scenarios.py.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch
from split_models import assert_same, gradients, mixtral, qwen2_moe, tokens, twin
from torch import Tensor, nn

import pipeline
from pipeline import Pipe
from pipeline.schedules import Interleaved1F1B
from pipeline.split import SplitError

transformers = pytest.importorskip("transformers")

MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe}
# Large, so that the loss's gradient shows beside the language model's.
COEFFICIENT = 0.5


def asking(make: Callable[[], nn.Module]) -> nn.Module:
    """The model, its config asking for router logits (so for the router loss)."""
    torch.manual_seed(0)
    model = make()
    model.config.output_router_logits = True
    model.router_aux_loss_coef = COEFFICIENT
    return model


@cache
def _shared(name: str, labelled: bool) -> tuple[nn.Module, nn.Sequential, dict[str, Tensor]]:
    model = asking(MODELS[name])
    seq = split(model) if labelled else split(model, labels=None, num_items_in_batch=None)
    return model, seq, copy.deepcopy(model.state_dict())


def shared(name: str, labelled: bool = True) -> tuple[nn.Module, nn.Sequential]:
    """The model split once (a split takes seconds), as ``asking`` made it, without gradients."""
    model, seq, initial = _shared(name, labelled)
    model.load_state_dict(initial)
    model.zero_grad(set_to_none=True)
    model.config.output_router_logits = True
    model.router_aux_loss_coef = COEFFICIENT
    return model, seq


def batch() -> tuple[Tensor, Tensor, Tensor]:
    """Ids, a mask padding two tokens of row 0, labels ignoring some tokens of row 1."""
    torch.manual_seed(1)
    ids, mask, _ = tokens(8, 6, padded=2)
    labels = ids.clone()
    labels[1, :3] = -100
    return ids, mask, labels


def count(labels: Tensor) -> Tensor:
    return (labels[..., 1:] != -100).sum()


def split(model: nn.Module, **example: Any) -> nn.Sequential:
    """Split on the recipe's call; an ``example`` keyword given None is left out."""
    ids, mask, labels = batch()
    call = {"attention_mask": mask[:2], "labels": labels[:2], "num_items_in_batch": count(labels)}
    call = {key: value for key, value in {**call, **example}.items() if value is not None}
    return pipeline.split(model, (ids[:2],), call)


def kwargs(mask: Tensor, labels: Tensor) -> dict[str, Any]:
    return {
        "attention_mask": mask,
        "labels": labels,
        "num_items_in_batch": pipeline.NoChunk(count(labels)),
    }


def out_loss(output: Any, _: Tensor) -> Tensor:
    return output.loss


def step(pipe: Pipe, **options: Any) -> Tensor:
    ids, mask, labels = batch()
    options = {"loss_reduction": "sum", "schedule": "gpipe", **options}
    return pipe.step(ids, labels, out_loss, kwargs=kwargs(mask, labels), **options)


def plain_loss(plain: nn.Module) -> Tensor:
    """The plain model's own loss over the whole batch, back-propagated."""
    ids, mask, labels = batch()
    loss = plain(ids, attention_mask=mask, labels=labels, num_items_in_batch=count(labels)).loss
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("name", MODELS)
def test_the_split_model_gives_the_models_output_with_its_router_loss(name: str) -> None:
    model, seq = shared(name)
    plain = twin(model)
    ids, mask, labels = batch()
    out = seq(ids, attention_mask=mask, labels=labels, num_items_in_batch=count(labels))
    expected = plain(ids, attention_mask=mask, labels=labels, num_items_in_batch=count(labels))
    torch.testing.assert_close(out.aux_loss, expected.aux_loss)
    torch.testing.assert_close(out.loss, expected.loss)
    assert len(out.router_logits) == len(expected.router_logits) == 2
    for ours, theirs in zip(out.router_logits, expected.router_logits, strict=True):
        torch.testing.assert_close(ours, theirs)
    out.loss.backward()
    expected.loss.backward()
    assert_same(gradients(model), gradients(plain))


@pytest.mark.parametrize("labelled", [True, False])
@pytest.mark.parametrize("name", MODELS)
def test_the_split_models_output_has_the_models_fields_in_its_order(
    name: str, labelled: bool
) -> None:
    # The model leaves aux_loss None until it adds the router loss: set afterwards on the
    # output, it was keyed after the logits, and out[1] gave the logits, silently.
    model, seq = shared(name, labelled)
    ids, mask, labels = batch()
    call: dict[str, Any] = {"attention_mask": mask}
    if labelled:
        call |= {"labels": labels, "num_items_in_batch": count(labels)}
    with torch.no_grad():
        out, expected = seq(ids, **call), twin(model)(ids, **call)
    assert type(out) is type(expected)
    assert list(out.keys()) == list(expected.keys())
    for ours, theirs in zip(out.to_tuple(), expected.to_tuple(), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_asked_in_the_call_the_split_model_gives_the_models_output() -> None:
    torch.manual_seed(0)
    model = mixtral()
    plain = twin(model)
    seq = split(model, output_router_logits=True)
    ids, mask, labels = batch()
    call = {"attention_mask": mask, "labels": labels, "num_items_in_batch": count(labels)}
    call["output_router_logits"] = True
    out, expected = seq(ids, **call), plain(ids, **call)
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(out.aux_loss, expected.aux_loss)


# Every checkpoint mode with Mixtral; Qwen2-MoE in the default one.
CASES = [("mixtral", mode) for mode in ("never", "always", "except_last")] + [
    ("qwen2_moe", "except_last")
]


@pytest.mark.parametrize(("name", "checkpoint"), CASES)
def test_a_gpipe_step_and_an_evaluation_give_the_models_loss_and_gradients(
    name: str, checkpoint: str
) -> None:
    model, seq = shared(name)
    plain = twin(model)
    without = twin(model)
    without.router_aux_loss_coef = 0.0
    expected_loss = plain_loss(plain)
    plain_loss(without)
    pipe = Pipe(seq, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4, checkpoint=checkpoint)
    torch.testing.assert_close(step(pipe), expected_loss)
    assert_same(gradients(model), gradients(plain))
    # The router loss moved the routers' gradients: the comparison above saw it.
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(gradients(model)[gate], gradients(without)[gate])
    # A second step accumulates as the plain model's second backward does.
    torch.testing.assert_close(step(pipe), expected_loss)
    plain_loss(plain)
    assert_same(gradients(model), gradients(plain))
    ids, mask, labels = batch()
    plain.eval()
    with torch.no_grad():
        evaluated = plain(ids, **kwargs(mask, labels) | {"num_items_in_batch": count(labels)})
    loss = pipe.evaluate(ids, labels, out_loss, kwargs=kwargs(mask, labels), loss_reduction="sum")
    torch.testing.assert_close(loss, evaluated.loss)
    pipe.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_the_pipes_term_is_the_models_gradient_in_half_and_single_precision(
    dtype: torch.dtype, masked: bool
) -> None:
    # bfloat16 rounds the gradient reaching the router's probabilities, then softmax's
    # backward rounds once: the pipe's term does the same, bit for bit (computed more
    # exactly, it differed from the model's by 4% of the largest).
    from pipeline.runtime.router_loss import gradient, tokens

    function = sys.modules[type(mixtral()).__module__].load_balancing_loss_func
    generator = torch.Generator().manual_seed(0)
    experts, top_k = 4, 2
    logits = [
        torch.randn(48, experts, generator=generator).to(dtype).requires_grad_() for _ in range(2)
    ]
    mask = (torch.rand(6, 8, generator=generator) > 0.3).long() if masked else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        (COEFFICIENT * function(tuple(logits), experts, top_k, mask)).backward()
        probabilities = [torch.softmax(z.detach(), dim=-1) for z in logits]
    weights = None if mask is None else mask.reshape(-1).double()
    totals = sum(tokens(p, top_k, weights) for p in probabilities)
    assert isinstance(totals, Tensor)
    for z, p in zip(logits, probabilities, strict=True):
        ours = gradient(p, totals, COEFFICIENT, weights)
        assert ours.dtype == dtype
        torch.testing.assert_close(
            ours, z.grad, rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-9
        )


def test_under_autocast_a_step_gives_the_models_loss_and_gradients() -> None:
    # What differs from the plain model is the micro-batches' own bfloat16 rounding: 0.5%
    # of the largest gradient, here.
    torch.manual_seed(0)
    model = mixtral(dtype=torch.float32)
    model.config.output_router_logits = True
    model.router_aux_loss_coef = COEFFICIENT
    plain = twin(model)
    pipe = Pipe(split(model), [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain_loss(plain)
        loss = step(pipe)
    torch.testing.assert_close(loss, expected)
    found = gradients(model)
    for name, grad in gradients(plain).items():
        difference = (found[name] - grad).abs().max()
        assert difference <= 0.015 * grad.abs().max(), (name, difference, grad.abs().max())
    pipe.close()


def test_the_step_follows_the_coefficient_and_the_config_after_the_split() -> None:
    model, seq = shared("mixtral")
    pipe = Pipe(seq, [2, 2], devices=["cpu"] * 2, chunks=2)
    for coefficient, asked in [(0.1, True), (COEFFICIENT, False)]:
        model.router_aux_loss_coef = coefficient
        model.config.output_router_logits = asked
        plain = twin(model)
        model.zero_grad()
        expected = plain_loss(plain)
        # Without the router loss, 1F1B is allowed again.
        torch.testing.assert_close(step(pipe, schedule="gpipe" if asked else "1f1b"), expected)
        assert_same(gradients(model), gradients(plain))
    pipe.close()


def test_a_grad_scaler_scales_the_router_losss_gradient_with_the_rest() -> None:
    model, seq = shared("mixtral")
    plain = twin(model)
    expected = plain_loss(plain)
    pipe = Pipe(seq, [2, 2], devices=["cpu"] * 2, chunks=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**5)
    torch.testing.assert_close(step(pipe, grad_scaler=scaler), expected)  # unscaled
    assert_same(gradients(model), {k: g * 2.0**5 for k, g in gradients(plain).items()})
    pipe.close()


def no_labels(pipe: Pipe) -> Any:
    ids, mask, _ = batch()
    return pipe.step(
        ids, ids, lambda out, y: out.logits.sum(), kwargs={"attention_mask": mask}, schedule="gpipe"
    )


def outputs_only(pipe: Pipe) -> Any:
    ids, mask, _ = batch()
    return pipe.evaluate(ids, kwargs={"attention_mask": mask})


def called(pipe: Pipe) -> Any:
    ids, mask, _ = batch()
    return pipe(ids, attention_mask=mask)


def another_loss(pipe: Pipe) -> Any:
    ids, mask, labels = batch()
    return pipe.step(
        ids,
        labels,
        lambda out, _: out.loss * 1.0,
        kwargs=kwargs(mask, labels),
        loss_reduction="sum",
        schedule="gpipe",
    )


REFUSED: dict[str, tuple[Callable[[Pipe], Any], str]] = {
    "1f1b": (lambda pipe: step(pipe, schedule="1f1b"), "use schedule='gpipe'"),
    "zb-h1": (lambda pipe: step(pipe, schedule="zb-h1"), "use schedule='gpipe'"),
    "interleaved": (
        lambda pipe: step(pipe, schedule=Interleaved1F1B(2)),
        "use schedule='gpipe'",
    ),
    "no labels": (no_labels, "only when given labels"),
    # transformers' own loss refuses it first (token_loss.py).
    "loss_divisor": (lambda pipe: step(pipe, loss_divisor=3), "no loss_divisor"),
    "a loss other than out.loss": (another_loss, "return out.loss itself"),
    "evaluate(x)": (outputs_only, "evaluate with a loss_fn"),
    "pipe(x)": (called, "pipe(x), gathering each micro-batch's output, cannot give"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_give_the_models_loss_is_refused_before_any_gradient(case: str) -> None:
    run, fragment = REFUSED[case]
    # Split with labels, but for the calls without them.
    model, seq = shared("mixtral", labelled=run not in (no_labels, outputs_only, called))
    pipe = Pipe(seq, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4)
    with pytest.raises(ValueError) as error:
        run(pipe)
    assert fragment in str(error.value)
    assert all(p.grad is None for p in model.parameters())
    routers = seq.router_loss.routers
    hooked = [m for r in routers for m in (r.module, r.block) if m._forward_hooks]
    assert not hooked and not any(r.block._forward_pre_hooks for r in routers)
    pipe.close()


def test_a_router_outside_the_blocks_is_refused_at_split() -> None:
    model = asking(mixtral)
    ids, _, _ = batch()
    with pytest.raises(SplitError, match=r"router 'model.layers.0.mlp.gate'.*outside the blocks"):
        pipeline.split(model, (ids[:2],), points=["model.layers.0.mlp.experts"])


def test_a_router_named_as_a_point_is_refused_at_split() -> None:
    # Its own output, the logits, is not what the model carries on: its term would be lost.
    model = asking(mixtral)
    ids, _, _ = batch()
    points = [f"model.layers.{i}.mlp.{name}" for i in range(2) for name in ("gate", "experts")]
    with pytest.raises(SplitError, match=r"'model.layers.0.mlp.gate'.*itself a point"):
        pipeline.split(model, (ids[:2],), points=points)


def test_a_block_output_the_model_does_not_carry_on_fails_the_step_loudly() -> None:
    # What split refuses above, made by hand: each router its own block.
    _, seq = shared("mixtral")
    source = seq.router_loss
    original = list(source.routers)
    source.routers[:] = [dataclasses.replace(r, block=r.module) for r in original]
    pipe = Pipe(seq, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4)
    try:
        with pytest.raises(RuntimeError, match="reached 0 of the 8 block outputs it rides on"):
            step(pipe)
    finally:
        source.routers[:] = original
        pipe.close()


def test_a_layer_that_checkpoints_itself_is_refused_before_any_gradient() -> None:
    # transformers' gradient checkpointing would run the routers again in backward.
    model, seq = shared("mixtral")
    layer = model.model.layers[1]
    pipe = Pipe(seq, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4)
    layer.gradient_checkpointing = True
    try:
        with pytest.raises(ValueError, match=r"'model\.layers\.1' checkpoints itself"):
            step(pipe)
        assert all(p.grad is None for p in model.parameters())
        layer.eval()  # transformers checkpoints in training only
        step(pipe)
    finally:
        layer.gradient_checkpointing = False
        layer.train()
        pipe.close()


def test_a_tuple_output_is_refused_at_split() -> None:
    model = asking(mixtral)
    ids, _, _ = batch()
    with pytest.raises(SplitError, match="return_dict=False"):
        pipeline.split(model, (ids[:2],), {"return_dict": False})


def test_a_transformers_loss_other_than_the_one_the_pipe_computes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = asking(mixtral)
    module = sys.modules[type(model).__module__]
    ours = module.load_balancing_loss_func
    monkeypatch.setattr(module, "load_balancing_loss_func", lambda *args: ours(*args) * ours(*args))
    ids, _, _ = batch()
    with pytest.raises(SplitError, match="is not one split can follow"):
        pipeline.split(model, (ids[:2],))


def test_a_moe_model_without_the_loss_keeps_the_refusal() -> None:
    from split_models import deepseek_v3

    model = deepseek_v3()
    model.config.output_router_logits = True
    ids, _, _ = batch()
    with pytest.raises(SplitError, match="the model's config sets output_router_logits, but") as e:
        pipeline.split(model, (ids[:2],))
    assert "this model has none" in str(e.value)


def test_the_planner_is_asked_for_gpipe_alone() -> None:
    _, seq = shared("mixtral")
    ids, mask, labels = batch()
    with pytest.raises(ValueError, match=r"pass schedules=\('gpipe',\)"):
        pipeline.plan(
            seq,
            ids,
            labels,
            out_loss,
            devices=["cpu", "cpu"],
            batch_size=8,
            memory_limit=2**30,
            kwargs=kwargs(mask, labels),
        )
