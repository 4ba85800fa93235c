"""Split any model into the pipeline's nn.Sequential: capture, cut into pieces, run the pieces.

``pipeline.split(model, args, kwargs)`` returns a ``SplitModel``, an
``nn.Sequential`` of ``Piece`` layers with the model's own parameter names,
for ``pipeline.Pipe`` and ``balance``. See ``docs/split.md``. Splitting
needs torch.export, imported on the first call only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from pipeline.split.errors import SplitError
from pipeline.split.model import SplitModel
from pipeline.split.piece import Piece

__all__ = ["Piece", "SplitError", "SplitModel", "split"]


def split(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    points: Sequence[str] | None = None,
) -> SplitModel:
    """Cut ``model`` into an ``nn.Sequential`` of pieces that a Pipe and ``balance`` can split.

    ``model(*args, **kwargs)`` is captured once on these example inputs
    (``torch.export``, every dimension free), and cut so that a piece starts
    at each module named in ``points`` (default: each block of the model's
    largest repeated ``nn.ModuleList`` or ``nn.Sequential``, plus a piece
    for what comes before the first and one for what comes after the last).
    The blocks run as themselves; the code between them runs as captured
    torch ops. Values a later piece needs travel as skips, straight there.

    The result has the model's parameters and buffers under their own names
    (its ``state_dict()`` is the model's), and ``seq(*args, **kwargs)``
    returns what the model returns, for any batch size and sequence length
    the model's code leaves free. What cannot be captured is refused with
    ``ValueError`` naming the module and the line::

        seq = pipeline.split(gpt2, (ids,), {"attention_mask": mask, "use_cache": False})
        pipe = pipeline.Pipe(seq, balance_by_time(4, seq, ids), chunks=8)
    """
    from pipeline.split.splitter import split as split_model

    return split_model(model, args, kwargs, points=points)
