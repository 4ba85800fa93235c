"""A tensor's own hooks, held back while a step computes its gradient in pieces.

A step computes a parameter's gradient micro-batch by micro-batch with
``autograd.grad`` (``gradients.py``), and autograd calls a leaf's tensor
hooks (``register_hook``) whenever it hands out the leaf's gradient, so each
piece would go through them. Until the step accumulates the tensor's whole
gradient, its hooks are replaced by ones that do nothing, key by key, in the
dicts where torch keeps them (``Tensor._backward_hooks``,
``Tensor._post_accumulate_grad_hooks``, read by autograd at each call): a
hook removed meanwhile stays removed, and the order is kept. Those
attributes are torch's own, not a public API, so ``check_supported`` tries
the mechanism once on a tensor of its own and refuses to step if this torch
keeps hooks elsewhere. A tensor is looked at once a step: one found without
hooks is not looked at again (each micro-batch reaches the same parameters).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["HeldHooks", "check_supported"]

_KINDS = ("_backward_hooks", "_post_accumulate_grad_hooks")


class HeldHooks:
    """The tensors whose hooks are held back, each with its own hooks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(tensor) -> (tensor, per kind: the hook dict and the hooks it had)
        self._held: dict[int, tuple[Tensor, list[tuple[_Hooks, dict[Any, Any]]]]] = {}
        # The tensors found without hooks (each backward of a step reaches
        # the same parameters again), kept alive while their ids are.
        self._without: dict[int, Tensor] = {}

    def hold(self, tensors: Iterable[Tensor]) -> bool:
        """Hold back the hooks of ``tensors`` (those not held yet), until ``release``.

        Whether any of them has hooks held back (now or before).
        """
        without = self._without
        if all(id(tensor) in without for tensor in tensors):
            return False  # each looked at before, without hooks (kept so until ``release``)
        holding = False
        with self._lock:
            for tensor in tensors:
                key = id(tensor)
                if key in self._without:
                    continue
                if key not in self._held:
                    held = [(hooks, _silence(hooks)) for hooks in _hook_dicts(tensor)]
                    if not held:
                        self._without[key] = tensor
                        continue
                    self._held[key] = (tensor, held)
                holding = True
        return holding

    def holds(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s hooks are held back now."""
        return id(tensor) in self._held

    def release(self, tensors: Iterable[Tensor] | None = None) -> None:
        """Give ``tensors`` (every tensor held, if None) their hooks back."""
        with self._lock:
            if tensors is None:
                self._without.clear()
            keys = list(self._held) if tensors is None else [id(t) for t in tensors]
            for key in keys:
                entry = self._held.pop(key, None)
                if entry is not None:
                    for hooks, saved in entry[1]:
                        _restore(hooks, saved)


_Hooks = MutableMapping[Any, Callable[..., Any]]


def _hook_dicts(tensor: Tensor) -> list[_Hooks]:
    """The non-empty hook dicts of ``tensor``."""
    return [hooks for hooks in (getattr(tensor, kind, None) for kind in _KINDS) if hooks]


def _silence(hooks: _Hooks) -> dict[Any, Any]:
    saved = dict(hooks)
    for key in saved:
        hooks[key] = _nothing
    return saved


def _restore(hooks: _Hooks, saved: dict[Any, Any]) -> None:
    for key, hook in saved.items():
        if key in hooks:  # removed while held: stays removed
            hooks[key] = hook


def _nothing(*_: Any) -> None:
    return None


@functools.cache
def _works() -> bool:
    """Whether holding back works on this torch: tried once, on a tensor of its own."""
    try:
        leaf = torch.zeros(1, requires_grad=True)
        fired: list[str] = []
        leaf.register_hook(lambda grad: fired.append("pre"))
        leaf.register_post_accumulate_grad_hook(lambda tensor: fired.append("post"))
        held = HeldHooks()
        held.hold([leaf])
        torch.autograd.grad((leaf * 2).sum(), leaf)
        (leaf * 2).sum().backward()
        silent = not fired
        held.release()
        (leaf * 2).sum().backward()
        return silent and fired == ["pre", "post"]
    except Exception:
        return False


def check_supported() -> None:
    """Refuse to step on a torch whose tensor hooks cannot be held back."""
    if not _works():
        raise RuntimeError(
            f"Pipe.step holds a parameter's hooks back until its whole gradient is in, through "
            f"where torch keeps them (Tensor._backward_hooks, "
            f"Tensor._post_accumulate_grad_hooks), but torch {torch.__version__} keeps them "
            "elsewhere: stepping would call them once per micro-batch. Use pipe(x) and "
            "backward() instead, or a torch version this release supports"
        )
