"""What a caller may have entered around a Pipe call that its worker threads would not see.

Torch keeps some of what a ``with`` block sets per thread, and a Pipe's
partitions run on worker threads that start without it (``threadstate.py``
carries over grad mode, autocast and the like, not these):

- ``torch.func``'s transforms (``grad``, ``vmap``, ``jacrev``, ``jvp``) and
  forward-mode AD's dual level: the workers computed outside them, and the
  transform saw gradients of zero;
- a ``TorchDispatchMode`` (``FlopCounterMode``, a mode of the user's): its
  counts missed the partitions, its changes to values were not made; and a
  ``TorchFunctionMode`` of the user's alike (torch's own, such as
  ``torch.device(...)`` entered as a context, pass);
- ``saved_tensors_hooks`` (``save_on_cpu``, compression): never called, so
  nothing was offloaded and a hook that changes what is saved gave other
  gradients than the plain model's.

Each is refused before any work. So is ``torch.func.functional_call`` of a
Pipe that recomputes, given plain tensors: recomputation runs in the
backward, after the call has put the module's own parameters back, and
would compute the gradient of other weights than the forward's (given
``Parameter``s, or buffers only, the recomputation refuses it:
``runtime/recompute.py``). So is a step, or a recomputing call, under
``torch.nn.utils.parametrize.cached()`` over parametrized layers: the cache
is not per thread, but it shares one computed weight between micro-batches
whose backwards and recomputations run apart. Torch's and the library's own
checkpointing and meters push saved-tensor hooks too; those pass.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["refuse_cached_parametrizations", "refuse_reparametrized", "refuse_unseen_state"]

# Saved-tensor hooks of these modules are torch's checkpointing and the
# library's own (its checkpointing, its activation meter): a Pipe nested in a
# checkpointed partition, or measured, is called under them.
_OWN_HOOKS = ("torch.utils.checkpoint", "pipeline.")


def refuse_unseen_state(what: str) -> None:
    """Refuse ``what`` (a Pipe's call) under a transform, mode or hook its workers miss."""
    found = _unseen()
    if found is not None:
        raise RuntimeError(
            f"{what} runs its partitions on worker threads, which do not see {found} the "
            "caller entered (torch keeps it per thread), so its results would not be the "
            "plain model's under it; call it outside, or call the plain model there"
        )


def _unseen() -> str | None:
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "the torch.func transform (grad, vmap, jacrev, jvp)"
    if torch.autograd.forward_ad._current_level >= 0:
        return "the forward-mode AD level (torch.autograd.forward_ad.dual_level)"
    modes = [m for m in _get_current_dispatch_mode_stack() if not _own(type(m).__module__)]
    if modes:
        return f"the dispatch mode {type(modes[-1]).__name__}"
    # torch's own function modes (torch.device(...) as a context) are carried or harmless.
    functions = [
        m for m in _get_current_function_mode_stack() if not _own(type(m).__module__, "torch.")
    ]
    if functions:
        return f"the torch function mode {type(functions[-1]).__name__}"
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and not _own(getattr(hooks[0], "__module__", None) or ""):
        return f"the saved-tensor hooks ({getattr(hooks[0], '__qualname__', hooks[0])!r})"
    return None


def _own(module: str, *others: str) -> bool:
    return module.startswith((*_OWN_HOOKS, *others))


def refuse_reparametrized(partitions: nn.Module, what: str) -> None:
    """Refuse a call that will recompute while parameters are swapped for plain tensors
    (``torch.func.functional_call``)."""
    swapped = next(
        (name for name, p in partitions.named_parameters() if not isinstance(p, nn.Parameter)),
        None,
    )
    if swapped is not None:
        raise RuntimeError(
            f"{what} recomputes checkpointed micro-batches in the backward, but its parameter "
            f"'{swapped}' is a tensor given for this call (torch.func.functional_call), which "
            "the module no longer holds by then: the gradient would be another weight's; use "
            "checkpoint='never' for such calls"
        )


def refuse_cached_parametrizations(module: nn.Module, what: str) -> None:
    """Refuse ``what`` (a step, or a call that recomputes) under ``parametrize.cached()``
    over parametrized layers: one weight, computed once, shared by micro-batches whose
    backwards run apart (torch refuses the second), and not recomputed with them."""
    parametrize = sys.modules.get("torch.nn.utils.parametrize")
    if parametrize is None or not getattr(parametrize, "_cache_enabled", 0):
        return
    if any(parametrize.is_parametrized(m) for m in module.modules()):
        raise RuntimeError(
            f"{what} runs under torch.nn.utils.parametrize.cached(), which computes each "
            "parametrized weight once and shares it between the micro-batches, whose "
            "backwards and recomputations run apart (torch refuses a second backward "
            "through it); call it outside cached(): the pipe computes the weights once per "
            "micro-batch"
        )
