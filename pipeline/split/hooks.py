"""Hooks on modules whose code split captures: refused at split time and at every call after.

The pieces run a captured module's torch ops, never the module itself, so
its hooks would not fire. Blocks, and the modules inside them, run as
themselves, hooks included. Global module hooks
(``register_module_forward_hook`` and the like) would not fire for the
captured modules either.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from torch import nn

from pipeline.runtime.module_hooks import call_hook_kinds
from pipeline.split.where import describe_module

__all__ = ["captured_modules", "model_configs", "refuse_hooks", "refuse_recorded_outputs"]

# What transformers' models record with hooks when asked by an ``output_<key>`` flag;
# a model adds its own keys in its class's ``_can_record_outputs``.
RECORDED = ("hidden_states", "attentions", "router_logits")
# What split does keep of router logits, said where it cannot.
ROUTER_LOSS = (
    " (Split keeps the load-balancing loss of a model whose module defines transformers' "
    "load_balancing_loss_func, as Mixtral's and Qwen2-MoE's do, and adds it as the model "
    "would; this model has none, so the logits themselves would be the output.)"
)


def captured_modules(model: nn.Module, blocks: dict[nn.Module, str]) -> list[tuple[str, nn.Module]]:
    """The modules whose forward split captures as torch ops: all but blocks and their insides."""
    inside = {sub for block in blocks for sub in block.modules()}
    return [(name, module) for name, module in model.named_modules() if module not in inside]


def refuse_hooks(modules: list[tuple[str, nn.Module]], error: type[Exception], fix: str) -> None:
    """Raise ``error`` (saying ``fix``) if a module of ``modules`` has hooks, or any module has."""
    for name, module in modules:
        if (
            module._forward_hooks
            or module._forward_pre_hooks
            or module._backward_hooks
            or module._backward_pre_hooks
        ):
            raise error(
                f"{describe_module(name, module)} has {' and '.join(call_hook_kinds(module))}, "
                "but its forward is captured as torch ops by split, and the pieces run those ops "
                f"without calling the module, so the hooks would never run: {fix}"
                + _of_transformers(module)
            )
    if nn.modules.module._has_any_global_hook():
        raise error(
            "global module hooks are registered (torch.nn.modules.module."
            "register_module_forward_hook and the like); the modules that split captures as "
            f"torch ops would never call them: {fix}"
        )


def _of_transformers(module: nn.Module) -> str:
    """What to do about a hook transformers registered itself, if it is one."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    if not any(getattr(h, "__name__", "") == "make_inputs_require_grads" for h in hooks):
        return ""
    return (
        ". This one is transformers' own (enable_input_require_grads, which "
        "gradient_checkpointing_enable() calls): call model.gradient_checkpointing_disable() "
        "(activation_checkpointing_disable() in newer transformers) and "
        "model.disable_input_require_grads() before splitting, and let the pipe "
        "recompute (checkpoint='always' or 'except_last')"
    )


def forward_names(model: nn.Module) -> set[str]:
    """The global and attribute names the model's own forward code reads (decorators
    unwrapped): whether it calls ``self.loss_function``, for one."""
    forward = inspect.unwrap(type(model).forward)
    return set(getattr(getattr(forward, "__code__", None), "co_names", ()))


def passes_keywords(model: nn.Module, method: str) -> bool:
    """Whether every call of ``self.<method>(...)`` in the model's forward passes ``**kwargs``
    on (a ``num_items_in_batch`` given to the model then reaches it); False where the
    source cannot be read, or no such call is there."""
    try:
        source = inspect.getsource(inspect.unwrap(type(model).forward))
    except (OSError, TypeError):
        return False
    calls = [_arguments(source, match.end()) for match in re.finditer(rf"\.{method}\(", source)]
    return bool(calls) and all("**" in arguments for arguments in calls)


def _arguments(source: str, start: int) -> str:
    """The text of a call's arguments, from just after its opening parenthesis."""
    depth = 1
    for end in range(start, len(source)):
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        if depth == 0:
            return source[start:end]
    return source[start:]


def model_configs(model: nn.Module) -> list[Any]:
    """The configs the model's modules hold (transformers' ``config``), each once."""
    found = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    return list(found.values())


def refuse_recorded_outputs(
    model: nn.Module,
    kwargs: dict[str, Any],
    error: type[Exception],
    allowed: tuple[str, ...] = (),
) -> None:
    """Raise ``error`` if the call asks a transformers model for outputs recorded by hooks.

    A flag counts as asked when ``kwargs`` sets it true, or leaves it out and
    a module's config sets it true (as transformers reads it). The flags
    ``allowed`` are not refused (split keeps what they ask for: ``routers.py``).
    """
    keys = set(RECORDED)
    for module in model.modules():
        declared = getattr(module, "_can_record_outputs", None)
        if isinstance(declared, dict):
            keys.update(str(key) for key in declared)
    configs = model_configs(model)
    for flag in sorted(f"output_{key}" for key in keys if f"output_{key}" not in allowed):
        if flag in kwargs:
            asked, source = bool(kwargs[flag]), f"{flag}={kwargs[flag]!r} was passed"
        else:
            asked = any(getattr(config, flag, False) for config in configs)
            source = f"the model's config sets {flag}"
        if asked:
            raise error(
                f"{source}, but split cannot give that output: transformers collects it with "
                "hooks on the blocks and on modules inside them while its forward runs, and the "
                "pieces of a split model run without that collection (it would come out empty, "
                f"or wrong).{ROUTER_LOSS if flag == 'output_router_logits' else ''} Pass "
                f"{flag}=False in the example's kwargs (it overrides the config) or set it False "
                "in the config before splitting; to read a block's output, register a forward "
                "hook on the block itself (blocks run as themselves, hooks included)"
            )
