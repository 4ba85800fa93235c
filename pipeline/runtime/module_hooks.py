"""The hooks registered on a module, named: for refusals that say whose hooks would not run."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["call_hook_kinds", "hook_name", "state_dict_hook_kinds"]


def call_hook_kinds(module: nn.Module) -> list[str]:
    """Each kind of forward or backward hook ``module`` has, with the hooks' names."""
    backward = "full backward" if module._is_full_backward_hook else "backward"
    return _listed(
        {
            "forward": module._forward_hooks,
            "forward pre": module._forward_pre_hooks,
            backward: module._backward_hooks,
            "backward pre": module._backward_pre_hooks,
        }
    )


def state_dict_hook_kinds(module: nn.Module) -> list[str]:
    """Each kind of ``state_dict`` or ``load_state_dict`` hook ``module`` has, named."""
    return _listed(
        {
            "state_dict": module._state_dict_hooks,
            "state_dict pre": module._state_dict_pre_hooks,
            "load_state_dict pre": module._load_state_dict_pre_hooks,
            "load_state_dict post": module._load_state_dict_post_hooks,
        }
    )


def _listed(found: dict[str, Any]) -> list[str]:
    return [
        f"{kind} hooks ({', '.join(hook_name(hook) for hook in hooks.values())})"
        for kind, hooks in found.items()
        if hooks
    ]


def hook_name(hook: Any) -> str:
    """A hook function's qualified name: transformers' ``make_inputs_require_grads`` says
    gradient checkpointing registered it."""
    function = getattr(hook, "func", hook)  # a functools.partial's function
    module = getattr(function, "__module__", None) or ""
    name = getattr(function, "__qualname__", type(function).__qualname__)
    return f"{module}.{name}" if module else name
