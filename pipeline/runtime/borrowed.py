"""Parameters tied across devices in one Pipe: held by one device, borrowed by the others.

A parameter that layers of partitions on different devices use (a language
model's embedding and its output head) stays one ``nn.Parameter``: one
``state_dict`` key per name as in the plain model, one optimizer entry, one
``.grad``. It lives on the device of the first partition using it (its
home); while another device's partition runs, the layers there hold a
differentiable copy on their device instead, made at each call (a
recomputation makes it again)::

    partition 0 (cuda:0)          partition 3 (cuda:1)
    embedding.weight  ---- .to(cuda:1) ---->  head.weight (the copy, during the call)
          ^                                        |
          +------ ToCopyBackward: its gradient ----+   summed into .grad by autograd

so the gradient of every use reaches the one parameter, as in the plain
model. Only parameters are lent this way: a layer or a buffer used by
partitions on two devices is still refused (``arguments.check_sharing``).

A module that the layers of every partition holding it only read tensors
of (``layers.ReadsModules``: a split model's pieces read GPT-2's tied
``lm_head.weight`` through one module, in its first and its last piece) is
not swapped: the partitions' threads would race on the one module. Its
parameters stay home all the same, and the reader copies each one to its
device as it reads it (``split/instructions.py``, ``Fetch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.runtime.layers import modules_only_read

__all__ = ["Loan", "Loans", "find_loans"]


@dataclass(frozen=True)
class Loan:
    """``module.<name>`` in partition ``partition`` is ``param``, whose home is another device.

    ``read``: the partition only reads the module's tensors; the reader moves
    them itself, so the loan keeps the parameter home at placement only.
    """

    partition: int
    module: nn.Module
    name: str
    param: nn.Parameter
    home: torch.device
    read: bool


class Loans:
    """Every loan of a pipe's partitions, by partition."""

    def __init__(self, loans: list[Loan], devices: list[torch.device]) -> None:
        self.devices = devices
        self.all = loans
        self.by_partition: dict[int, list[Loan]] = {}
        for loan in loans:
            if not loan.read:
                self.by_partition.setdefault(loan.partition, []).append(loan)

    @contextlib.contextmanager
    def lent(self, j: int) -> Iterator[None]:
        """While partition ``j`` runs: its borrowed parameters are copies on its device."""
        loans = self.by_partition.get(j)
        if not loans:
            yield
            return
        device = self.devices[j]
        # copy=True: a copy even where the home and this device are one memory (CPU
        # devices standing for two GPUs), so the gradient takes the same path.
        with _swapped(loans, [loan.param.to(device, copy=True) for loan in loans]):
            yield

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """While the partitions move to their devices: the borrowers hold nothing to move.

        A module only read is one module in its home partition and in the
        borrower, hidden from both: its parameters then go home on their own.
        """
        with _swapped(self.all, [None] * len(self.all)):
            yield
        for loan in self.all:
            if loan.read:
                _send(loan.param, loan.home)


def find_loans(partitions: list[nn.Sequential], devices: list[torch.device]) -> Loans:
    """The parameters that partitions on another device than their first user's borrow."""
    home: dict[int, torch.device] = {}
    loans: list[Loan] = []
    for j, partition in enumerate(partitions):
        read = modules_only_read(partition.children())
        for module in partition.modules():
            for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
                where = home.setdefault(id(param), devices[j])
                if where != devices[j]:
                    loans.append(Loan(j, module, name, param, where, id(module) in read))
    return Loans(loans, devices)


def _send(param: nn.Parameter, device: torch.device) -> None:
    """Move ``param`` (and its gradient) to ``device`` in place, as ``Module.to`` does."""
    with torch.no_grad():
        param.data = param.data.to(device)
        if param.grad is not None:
            param.grad.data = param.grad.data.to(device)


@contextlib.contextmanager
def _swapped(loans: list[Loan], values: list[torch.Tensor | None]) -> Iterator[None]:
    """Each loan's module holds its value in place of the parameter, then the parameter again."""
    for loan, value in zip(loans, values, strict=True):
        # Straight into the dict: nn.Module.__setattr__ takes only a Parameter there.
        loan.module._parameters[loan.name] = value  # type: ignore[assignment]
    try:
        yield
    finally:
        for loan in loans:
            loan.module._parameters[loan.name] = loan.param
