"""Portal: keeps a tensor for one read and carries its gradient back."""

from __future__ import annotations

import pytest
import torch

from pipeline.clock.dependency import fork, join
from pipeline.clock.portal import Portal


def test_tensor_is_dropped_at_its_read() -> None:
    portal = Portal()
    tensor = torch.ones(2)
    portal.enter(tensor)
    phony = torch.empty(0)
    assert portal.tensor is tensor
    assert torch.equal(portal.exit(phony), tensor)
    assert portal.tensor is None
    with pytest.raises(RuntimeError, match="popped twice from its portal"):
        portal.exit(phony)


def test_gradient_goes_from_exit_back_to_enter() -> None:
    portal = Portal()
    source = torch.ones(3, requires_grad=True)
    stashed = source * 2
    main = join(source * 1, portal.enter(stashed))
    main, phony = fork(main)
    popped = portal.exit(phony)
    assert portal.tensor is None and popped.requires_grad
    (main.sum() + (popped * torch.arange(3.0)).sum()).backward()
    # d/dsource of sum(source) + sum(2 * source * [0, 1, 2])
    torch.testing.assert_close(source.grad, torch.tensor([1.0, 3.0, 5.0]))
    assert portal.grad is None
