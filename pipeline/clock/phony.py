"""Phony tensors: cached empty tensors that carry autograd dependencies.

A phony tensor holds no data. It exists only so that an edge can be drawn in
the autograd graph between two places that share no real tensor (see
``dependency.py``). Creating one per edge would allocate on every task, so
they are cached per (device, requires_grad).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["get_phony"]

_phonies: dict[tuple[torch.device, bool], torch.Tensor] = {}
_lock = threading.Lock()


def get_phony(device: torch.device, *, requires_grad: bool) -> torch.Tensor:
    """Return the cached empty tensor for ``device``.

    The phony that requires grad is a leaf nobody optimises: its gradient is
    never accumulated because every consumer detaches it in ``Fork``.
    """
    key = (device, requires_grad)
    phony = _phonies.get(key)
    if phony is None:
        with _lock:
            phony = _phonies.get(key)
            if phony is None:
                with torch.no_grad(), torch.inference_mode(False):
                    phony = torch.empty(0, device=device, requires_grad=requires_grad)
                _phonies[key] = phony
    return phony
