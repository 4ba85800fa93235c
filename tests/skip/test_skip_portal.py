"""Portal: keeps a tensor for a known number of reads and carries its gradient back."""

from __future__ import annotations

import pytest
import torch

from pipeline.dependency import fork, join
from pipeline.skip.portal import Portal


def test_tensor_is_dropped_at_its_last_read() -> None:
    portal = Portal()
    tensor = torch.ones(2)
    portal.enter(tensor, reads=2)
    phony = torch.empty(0)
    assert torch.equal(portal.exit(phony), tensor)
    assert portal.tensor is tensor
    assert torch.equal(portal.exit(phony), tensor)
    assert portal.tensor is None
    with pytest.raises(RuntimeError, match="popped more often than it was stashed for"):
        portal.exit(phony)


def test_enter_without_reads_keeps_nothing_but_links_the_gradient() -> None:
    portal = Portal()
    source = torch.ones(3, requires_grad=True)
    phony = portal.enter(source * 1, reads=0)
    assert portal.tensor is None
    carrier = join(torch.zeros(1, requires_grad=True), phony)
    portal.grad = torch.full((3,), 7.0)
    carrier.sum().backward()
    assert source.grad is not None
    torch.testing.assert_close(source.grad, torch.full((3,), 7.0))
    assert portal.grad is None


def test_gradient_goes_from_exit_back_to_enter() -> None:
    portal = Portal()
    source = torch.ones(3, requires_grad=True)
    stashed = source * 2
    main = join(source * 1, portal.enter(stashed, reads=1))
    main, phony = fork(main)
    popped = portal.exit(phony)
    assert portal.tensor is None and popped.requires_grad
    (main.sum() + (popped * torch.arange(3.0)).sum()).backward()
    # d/dsource of sum(source) + sum(2 * source * [0, 1, 2])
    torch.testing.assert_close(source.grad, torch.tensor([1.0, 3.0, 5.0]))
    assert portal.grad is None
