"""SplitModel: the nn.Sequential that ``pipeline.split`` returns, with the model's own names.

Its layers (``len``, iteration, indexing, what a Pipe and ``balance``
split) are the pieces. Its registered children are the model's own
children, and its parameters and buffers the model's own, so that every
name and attribute path is the model's::

    seq = pipeline.split(gpt2, (ids,), {"attention_mask": mask})
    len(seq)                      # 14 pieces: embeddings, 12 blocks, head
    seq[3]                        # Piece(3: from transformer.h.2, ...)
    seq.state_dict().keys()       # transformer.wte.weight, ..., lm_head.weight
    seq.transformer.h[2] is gpt2.transformer.h[2]    # the same modules

Tied parameters stay one parameter, a transformers checkpoint loads into
it, and ``seq(*args, **kwargs)`` returns what ``model(*args, **kwargs)`` does.
The layers a Pipe splits are asked for through ``pipeline.runtime.layers``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, NoReturn, overload

from torch import nn

from pipeline.runtime.microbatch import Arguments
from pipeline.runtime.router_loss import asked, recording_logits
from pipeline.split.hooks import forward_names, passes_keywords
from pipeline.split.piece import Piece
from pipeline.split.routers import RouterLoss

__all__ = ["SplitModel"]


class SplitModel(nn.Sequential):
    """A model cut into pieces: an ``nn.Sequential`` of pieces with the model's names."""

    def __init__(
        self,
        model: nn.Module,
        pieces: list[Piece],
        router_loss: RouterLoss | None = None,
        rows_across: tuple[str, ...] = (),
    ) -> None:
        nn.Module.__init__(self)
        for name, child in model._modules.items():
            self.add_module(name, child)
        for name, parameter in model._parameters.items():
            self.register_parameter(name, parameter)
        for name, buffer in model._buffers.items():
            persistent = name not in model._non_persistent_buffers_set
            self.register_buffer(name, buffer, persistent=persistent)
        self.training = model.training
        self._split_pieces = list(pieces)
        self._split_of = type(model).__name__
        self._loss_name = _loss_name(model)
        self._loss_takes_count = self._loss_name is not None and passes_keywords(
            model, "loss_function"
        )
        self._router_loss = router_loss
        self._rows_across = rows_across
        config = getattr(model, "config", None)
        self._encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))

    @property
    def encoder_decoder(self) -> bool:
        """Whether the model is an encoder-decoder (T5, BART: its ``attention_mask`` is the
        encoder's, never its loss's)."""
        return self._encoder_decoder

    @property
    def loss_name(self) -> str | None:
        """The qualified name of the model's own ``loss_function`` (transformers'), or None.

        What a model given ``labels=`` computes ``out.loss`` with, e.g.
        ``'transformers.loss.loss_utils.ForCausalLMLoss'``: a pipe reads it to
        refuse micro-batches that would weigh that loss wrongly.
        """
        return self._loss_name

    @property
    def loss_takes_count(self) -> bool:
        """Whether the model's forward passes its keyword arguments on to its
        ``loss_function``, so that a ``num_items_in_batch`` given to it reaches its loss
        (Llama's token classification calls it without them)."""
        return self._loss_takes_count

    @property
    def rows_across(self) -> tuple[str, ...]:
        """The outputs whose size past their first dimension is the batch's (every row
        against every row, as CLIP's ``logits_per_image``), by their place in the output: a
        pipe refuses gathering them over several micro-batches, each of which would hold
        its own rows alone (docs/split.md, "Outputs that mix the rows of the batch")."""
        return self._rows_across

    @property
    def router_loss(self) -> RouterLoss | None:
        """The model's router load-balancing loss, kept apart from the pieces, or None.

        Present when the model was split asked for its router logits
        (``output_router_logits``) and has transformers' load-balancing loss:
        ``seq(...)`` adds it as the model does, and a pipe's step adds it over
        the whole batch (``pipeline/split/routers.py``).
        """
        return self._router_loss

    def named_layers(self) -> OrderedDict[str, nn.Module]:
        """The pieces by layer name (``'0'``, ``'1'``, ...): what a Pipe partitions."""
        return OrderedDict((str(i), piece) for i, piece in enumerate(self._split_pieces))

    def modes_read(self, layer: str) -> list[nn.Module]:
        """The modules whose mode piece ``layer`` reads, beyond those it runs."""
        return self._split_pieces[int(layer)].modes_read()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        router_loss = self._router_loss
        if router_loss is None or asked(router_loss) is None:
            return self._run(args, kwargs)
        with recording_logits(router_loss.routers) as logits:
            output = self._run(args, kwargs)
        (call,) = router_loss.calls([Arguments(args, kwargs)])
        return router_loss.added_to(output, logits, call)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        first, *rest = self._split_pieces
        value = first(*args, **kwargs)
        for piece in rest:
            value = piece(value)
        return value

    def __len__(self) -> int:
        return len(self._split_pieces)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._split_pieces)

    @overload
    def __getitem__(self, index: int) -> nn.Module: ...

    @overload
    def __getitem__(self, index: slice) -> nn.Sequential: ...

    def __getitem__(self, index: int | slice) -> nn.Module:
        """Piece ``index``; a slice gives a plain ``nn.Sequential`` of those pieces."""
        if isinstance(index, slice):
            items = list(self.named_layers().items())[index]
            return nn.Sequential(OrderedDict(items))
        return self._split_pieces[index]

    def __repr__(self) -> str:
        lines = [f"SplitModel({self._split_of}, {len(self)} pieces):"]
        lines += [f"  ({i}): {piece!r}" for i, piece in enumerate(self._split_pieces)]
        return "\n".join(lines)

    def _fixed(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "the pieces of a split model are fixed (each one knows what the others send it); "
            "call pipeline.split again with other points to change them"
        )

    __setitem__ = __delitem__ = append = extend = insert = pop = _fixed
    __add__ = __iadd__ = __mul__ = __rmul__ = __imul__ = _fixed


def _loss_name(model: nn.Module) -> str | None:
    """The name of the ``loss_function`` the model's forward computes ``out.loss`` with, or
    None: T5 and BERT's masked LM have one, but their forwards compute their own
    ``CrossEntropyLoss``, which neither shifts as it does nor takes ``num_items_in_batch``."""
    function = getattr(model, "loss_function", None)
    if function is None or "loss_function" not in forward_names(model):
        return None
    # A name, not the function: a split model pickles, and a lambda would not.
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"
