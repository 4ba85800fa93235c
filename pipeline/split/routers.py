"""Routers: a transformers MoE model's load-balancing loss, kept by its split.

Asked for its router logits (``output_router_logits=True`` in the call or
the config), a Mixtral or Qwen2-MoE model records each router's logits with
hooks while its forward runs, and adds ``router_aux_loss_coef`` times its
module's ``load_balancing_loss_func`` of them (over the whole batch) to its
loss. The pieces of a split model run without that recording, so split
captures the model with the flag off and keeps the loss apart, as a
``RouterLoss``:

- ``seq(...)`` records the routers' logits and calls the model's own
  function on them, so its output is the model's (``loss``, ``aux_loss``,
  ``router_logits``);
- a pipe's step adds the loss over the whole batch, value and gradient
  (``pipeline/runtime/router_loss.py``, which says how and when it is exact).

The step computes the loss with its own formula, so split checks it against
the model's function first, on random logits with and without a mask: a
transformers version whose loss differs is refused, not followed wrongly.
A model without that function and those attributes keeps the refusal of
``hooks.py``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.runtime.router_loss import Router, RouterSettings, gradient, tokens, value
from pipeline.split.hooks import forward_names, model_configs
from pipeline.split.signature import Signature

__all__ = ["FLAG", "RouterLoss", "router_loss_of"]

FLAG = "output_router_logits"
# What transformers records for that flag, and the name of the output that holds it.
RECORDED = "router_logits"
# The model's attributes its forward passes to the loss function, and the coefficient.
_ATTRIBUTES = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
_FUNCTION = "load_balancing_loss_func"


class RouterLoss:
    """A split model's router loss: which routers, and the model's settings at each call."""

    def __init__(
        self,
        model: nn.Module,
        routers: list[Router],
        function: Callable[..., Any],
        in_call: bool,
        signature: Signature,
    ) -> None:
        self.model = model
        self.routers = routers
        self.function = function
        self._in_call = in_call
        self._signature = signature
        self._around = _around(model, routers)

    def settings(self) -> RouterSettings | None:
        """The loss's settings, read now; None when the config no longer asks for it."""
        if not self._in_call and not getattr(getattr(self.model, "config", None), FLAG, False):
            return None
        coefficient, experts, top_k = (getattr(self.model, name) for name in _ATTRIBUTES)
        return RouterSettings(float(coefficient), int(experts), int(top_k))

    def calls(self, values: list[Any]) -> list[dict[str, Any]]:
        """Each micro-batch's call of the model (a first layer's input), by argument name."""
        return [self._signature.arguments(v) for v in values]

    def recomputes_itself(self) -> str | None:
        """A module around a router whose transformers gradient checkpointing is on in
        training (it runs its forward again in backward), by name; or None."""
        return next(
            (
                name
                for name, m in self._around
                if m.training and getattr(m, "gradient_checkpointing", False) is True
            ),
            None,
        )

    def added_to(self, output: Any, logits: list[Tensor], call: dict[str, Any]) -> Any:
        """``output`` of ``seq(...)`` made the model's: its loss, ``aux_loss`` and logits added."""
        settings = self.settings()
        assert settings is not None, "called while the loss is asked for"
        if not _has_the_fields(output):
            raise TypeError(
                f"the split model returned {type(output).__name__}, but with {FLAG} on it "
                "gives the model's output with its aux_loss, loss and router_logits: call it "
                "with return_dict left on"
            )
        aux = self.function(
            tuple(logits), settings.experts, settings.top_k, call.get("attention_mask")
        )
        loss = output.loss
        if loss is not None:
            loss = loss + settings.coefficient * aux.to(loss.device)
        return _replaced(output, loss=loss, aux_loss=aux, **{RECORDED: tuple(logits)})


def _has_the_fields(output: Any) -> bool:
    """Whether ``output`` is a dataclass (a ``ModelOutput``) with the router loss's fields."""
    fields = ("loss", "aux_loss", RECORDED)
    return dataclasses.is_dataclass(output) and all(hasattr(output, f) for f in fields)


def _replaced(output: Any, **values: Any) -> Any:
    """A copy of the dataclass ``output`` (a ``ModelOutput``) with ``values`` in its fields.

    Built anew rather than assigned: a ``ModelOutput`` keys its fields that are not None
    in the order they were set, so ``aux_loss`` set after the model left it None came
    after ``logits``, and ``out[1]`` and ``out.to_tuple()`` gave the logits where the
    plain model gives ``aux_loss``. Its constructor keys them in the class's field order,
    as the model's own output.
    """
    kept = {f.name: getattr(output, f.name) for f in dataclasses.fields(output) if f.init}
    return type(output)(**{**kept, **values})


def _around(model: nn.Module, routers: list[Router]) -> list[tuple[str, nn.Module]]:
    """The routers and the modules around them that transformers can checkpoint (they have
    its ``gradient_checkpointing`` switch), by name."""
    names = {
        ".".join(parts[:k])
        for parts in (router.name.split(".") for router in routers)
        for k in range(len(parts) + 1)
    }
    modules = ((name, model.get_submodule(name)) for name in sorted(names))
    return [(name or "the model", m) for name, m in modules if hasattr(m, "gradient_checkpointing")]


def asked(model: nn.Module, kwargs: dict[str, Any]) -> tuple[bool, bool]:
    """Whether the call asks for router logits, and whether the call itself (not a config) does."""
    if FLAG in kwargs:
        return bool(kwargs[FLAG]), True
    return any(getattr(c, FLAG, False) for c in model_configs(model)), False


def router_loss_of(
    model: nn.Module, kwargs: dict[str, Any], blocks: dict[nn.Module, str], error: type[Exception]
) -> tuple[list[Router], Callable[..., Any]] | None:
    """The routers of ``model`` and its loss function, or None if it has no such loss.

    Raises ``error`` for a model that has one but whose routers split could
    not follow, whose function is not the loss a pipe computes, or whose
    call (``kwargs``) returns a tuple, which has no place for the loss.
    """
    function = getattr(sys.modules.get(type(model).__module__), _FUNCTION, None)
    if not callable(function) or not _adds_the_loss(model):
        return None
    if kwargs.get("return_dict", True) is False:
        raise error(
            f"{FLAG} is on and the example passes return_dict=False: split adds the router "
            "loss to the model's output as its out.loss and out.aux_loss, which a tuple has no "
            f"place for; leave return_dict on, or set {FLAG} False"
        )
    routers = _routers(model, blocks, error)
    _check_function(function, model, error)
    return routers, function


def _adds_the_loss(model: nn.Module) -> bool:
    """Whether the model's forward calls the function with its attributes (names in its code).

    A model whose module has the function but whose forward does not add
    it (or adds it from other attributes) is not one split knows.
    """
    names = forward_names(model)
    return {_FUNCTION, *_ATTRIBUTES} <= names and all(hasattr(model, a) for a in _ATTRIBUTES)


def _routers(
    model: nn.Module, blocks: dict[nn.Module, str], error: type[Exception]
) -> list[Router]:
    """The modules transformers records router logits of, as it matches them, with their blocks."""
    specs = _specs(model)
    block_of = {sub: block for block in blocks for sub in block.modules()}
    routers = []
    for name, module in model.named_modules():
        index = next((i for match, i in specs if match(name, module)), None)
        if index is None:
            continue
        block = block_of.get(module)
        if block is None:
            raise error(
                f"router {name!r} ({type(module).__name__}) runs outside the blocks, in code "
                f"that split captures, so its logits cannot be followed for the {FLAG} loss: "
                "name the module that holds it in points, or set the flag False"
            )
        if block is module:
            # Its gradient term would ride on its own output, the logits, which the MoE
            # block does not pass on: it would never reach the router.
            raise error(
                f"router {name!r} ({type(module).__name__}) is itself a point of the split; "
                f"the {FLAG} loss gives the router its gradient through the output of the "
                "piece around it, which the model carries on: name the module that holds it "
                "(its MoE block or its decoder layer) in points instead, or set the flag False"
            )
        routers.append(Router(name, module, block, index))
    if not routers:
        raise error(
            f"{FLAG} is on, but split found no module of {type(model).__name__} whose router "
            "logits transformers records; set the flag False before splitting"
        )
    return routers


def _specs(model: nn.Module) -> list[tuple[Callable[[str, nn.Module], bool], int]]:
    """transformers' ``_can_record_outputs["router_logits"]`` of every submodel, as matchers."""
    found = []
    for module in model.modules():
        declared = getattr(module, "_can_record_outputs", None)
        if not isinstance(declared, dict) or RECORDED not in declared:
            continue
        specs = declared[RECORDED]
        for spec in specs if isinstance(specs, list) else [specs]:
            found.append(_matcher(spec))
    return found


def _matcher(spec: Any) -> tuple[Callable[[str, nn.Module], bool], int]:
    """What transformers hooks for one recorder spec: a class, a name's end, a layer name."""
    if isinstance(spec, type | str):
        # A bare class or name records its output's item 1 (transformers' rule for all but
        # hidden states).
        target = spec if isinstance(spec, type) else None
        suffix = spec if isinstance(spec, str) else None
        layer, index = None, 1
    else:
        target, suffix = getattr(spec, "target_class", None), getattr(spec, "class_name", None)
        layer, index = getattr(spec, "layer_name", None), int(getattr(spec, "index", 0))

    def match(name: str, module: nn.Module) -> bool:
        hit = (target is not None and isinstance(module, target)) or (
            suffix is not None and name.endswith(suffix)
        )
        return hit and (layer is None or f".{layer.strip('.')}." in f".{name}.")

    return match, index


def _check_function(function: Callable[..., Any], model: nn.Module, error: type[Exception]) -> None:
    """Refuse if ``function`` is not the loss ``router_loss.py`` computes (value and gradient)."""
    experts, top_k = (int(getattr(model, name)) for name in _ATTRIBUTES[1:])
    top_k = min(top_k, experts)
    generator = torch.Generator().manual_seed(0)
    for mask in (None, torch.tensor([[1, 1, 0], [1, 0, 0]])):
        logits = [
            torch.randn(6, experts, dtype=torch.float64, generator=generator).requires_grad_()
            for _ in range(2)
        ]
        theirs = function(tuple(logits), experts, top_k, mask)
        if not isinstance(theirs, Tensor):
            raise error(_differs(function, f"returned {type(theirs).__name__}"))
        their_grads = torch.autograd.grad(theirs, logits)
        weights = None if mask is None else mask.reshape(-1).double()
        probabilities = [torch.softmax(z.detach(), dim=-1) for z in logits]
        totals = sum(tokens(p, top_k, weights) for p in probabilities)
        assert isinstance(totals, Tensor)
        ours = [gradient(p, totals, 1.0, weights) for p in probabilities]
        close = torch.allclose(theirs.double(), value(totals), rtol=1e-5, atol=0) and all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-9)
            for a, b in zip(their_grads, ours, strict=True)
        )
        if not close:
            masked = "with" if mask is not None else "without"
            raise error(_differs(function, f"gave another value or gradient {masked} a mask"))


def _differs(function: Callable[..., Any], how: str) -> str:
    return (
        f"{function.__module__}.{function.__qualname__} {how} than the load-balancing loss a "
        f"pipe computes over the whole batch (E / N² · Σ counts · probability sums): this "
        f"transformers version's loss is not one split can follow; set {FLAG} False before "
        "splitting"
    )


@contextmanager
def flag_off(model: nn.Module) -> Iterator[None]:
    """Within the block, the model's configs do not ask for router logits (for the capture)."""
    on = [c for c in model_configs(model) if getattr(c, FLAG, False)]
    for config in on:
        setattr(config, FLAG, False)
    try:
        yield
    finally:
        for config in on:
            setattr(config, FLAG, True)
