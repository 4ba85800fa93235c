"""Small models of the device tier that the other tests' helpers lack (the rest are reused)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.helpers import mlp


def dropped(width: int = 8) -> nn.Sequential:
    """helpers.mlp (float64, 6 layers) with a dropout after every layer: 12 layers."""
    return nn.Sequential(*(m for layer in mlp(width) for m in (layer, nn.Dropout(0.3))))


class Residual(nn.Module):
    """x + dropout(tanh(linear(x))): a layer of the user's own, which dynamo compiles.

    (Dynamo leaves a bare ``nn.Linear`` to eager: torch.nn's own frames are not
    compiled on their own.)
    """

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        return x + F.dropout(torch.tanh(self.linear(x)), self.dropout, self.training)


def residuals(count: int = 6, width: int = 8, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(*(Residual(width, dropout) for _ in range(count))).double()
