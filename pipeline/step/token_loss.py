"""transformers' own loss (``out.loss`` of a model given ``labels=``) under micro-batching.

A transformers language model averages its loss over the tokens its labels
count (those not ``-100``; a causal model's shifted by one). Each
micro-batch's ``out.loss`` is then the mean over that micro-batch's tokens,
and the step's weighing by rows (``loss_reduction="mean"``) gives the
plain model's loss only where every micro-batch holds tokens in proportion
to its rows. transformers' own gradient accumulation passes the batch's
count instead, as ``num_items_in_batch``: each micro-batch's loss is then
its sum over that count, and the micro-batches' losses add up
(``loss_reduction="sum"``) to the plain model's, whatever the labels.

The same holds for any loss of integer labels some of which are ignored
(-100): classification heads, a forward computing its own
``CrossEntropyLoss`` (T5, BART, BERT). Only a token loss whose forward
passes its keyword arguments on takes the count; other models' losses
ignore it (Llama's classification heads call their ``loss_function``
without them), and are computed from the logits in ``loss_fn`` instead.

``TokenLoss`` knows a split model's loss (its first piece's call names the
arguments) and checks each step's micro-batches before any work: it
refuses a weighing that would give another loss than the plain model's,
and a count the model would ignore, with the recipe (docs/split.md,
"transformers' own loss").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipeline.arguments import LossReduction
from pipeline.runtime.microbatch import Arguments, Batch

__all__ = ["TokenLoss"]

_LOSSES = "transformers.loss.loss_utils."
# The token losses, and whether each shifts the labels by one (a causal model's).
_SHIFTS = {
    _LOSSES + "ForCausalLMLoss": True,
    _LOSSES + "ForMaskedLMLoss": False,
    _LOSSES + "ForTokenClassification": False,
}


class TokenLoss:
    """The loss a split transformers model computes from ``labels``: how its micro-batches'
    ``out.loss`` add up."""

    def __init__(
        self, shift: bool | None, takes_count: bool, signature: Any, masked: bool = False
    ) -> None:
        # shift None: a forward computing its own loss (T5, BERT), which may or may not
        # shift its labels; takes_count: whether a num_items_in_batch reaches its loss;
        # masked: whether that loss may count only the tokens its attention mask keeps.
        self.shift = shift
        self.takes_count = takes_count
        self.masked = masked
        self._signature = signature

    @classmethod
    def of(cls, module: Any, first_layer: Any) -> TokenLoss | None:
        """The loss of ``module`` (a split model) given labels, or None for any other model."""
        signature = getattr(first_layer, "signature", None)
        if not hasattr(module, "loss_name") or signature is None:
            return None
        name = module.loss_name
        shift = _SHIFTS.get(name or "", False if name is not None else None)
        takes_count = name in _SHIFTS and bool(getattr(module, "loss_takes_count", False))
        # A forward computing its own loss may select tokens by the attention mask
        # (ELECTRA's, BioGPT's token classification), unless that mask is an encoder's.
        masked = shift is None and not getattr(module, "encoder_decoder", False)
        return cls(shift, takes_count, signature, masked)

    def check(self, batches: list[Batch], reduction: LossReduction, divisor: Any) -> None:
        """Refuse, before any work, micro-batches whose ``out.loss`` would be weighed wrongly.

        Given integer labels, ``out.loss`` is the mean over the labels not
        ignored (-100): each micro-batch's weight must be its share of them.
        """
        if not batches:
            return
        _check_number(batches[0].value)
        calls = [self._signature.arguments(batch.value) for batch in batches]
        if calls[0].get("num_items_in_batch") is not None:
            if not self.takes_count:
                raise ValueError(_IGNORED_COUNT)
            _check_summed(reduction, divisor)
            return
        tokens = [self._tokens(call, *way) for way in self._ways(calls[0]) for call in calls]
        for name, counted in _OTHER_TARGETS.items():
            if isinstance(calls[0].get(name), Tensor):
                tokens += [counted(call[name], call) for call in calls]
        if not tokens:
            return
        rows = [batch.rows() for batch in batches]
        # One read for every micro-batch's counts (a device sync on a GPU).
        read = [int(c) for c in torch.stack(tokens).tolist()]
        counts = [read[k : k + len(calls)] for k in range(0, len(read), len(calls))]
        wrong = [c for c in counts if not _in_proportion(c, rows)]
        if len(batches) == 1 or (reduction == "mean" and divisor is None and not wrong):
            return
        raise ValueError(
            f"out.loss is the mean over each micro-batch's labels (or other targets: answer "
            "positions, next-sentence labels) not ignored (and, where the "
            "model's forward computes its own loss, maybe only those its attention mask keeps), "
            "but the step "
            f"weighs the micro-batches {_weighing(reduction, divisor)}: the micro-batches of "
            f"{rows} rows hold {(wrong or counts)[0]} of them, so the step's loss and "
            f"gradients would not be the plain model's. {self._recipe()}. If loss_fn does not "
            "use out.loss, do not pass labels to the model"
        )

    def _ways(self, call: dict[str, Any]) -> list[tuple[bool | None, bool]]:
        """Every way the loss may count ``labels`` (shifted or not, masked or not): each must
        be in proportion to the rows; none without labels."""
        labels = call.get("labels")
        if not isinstance(labels, Tensor):
            return []
        if labels.is_floating_point():
            # A regression's or multi-label loss: a mean over every row's values; or, in a
            # forward of its own, maybe over those its attention mask keeps (ELECTRA's).
            return [(False, True)] if self.masked else []
        if self.shift is not None:
            return [(self.shift, False)]
        # A forward computing its own loss may shift its labels or not, and may count
        # only the tokens its attention mask keeps.
        masks = (False, True) if self.masked else (False,)
        return [(shift, masked) for shift in (False, True) for masked in masks]

    def _tokens(self, call: dict[str, Any], shift: bool | None, masked: bool) -> Tensor:
        """The labels one micro-batch's loss counts, as the loss counts them (``masked``:
        those its attention mask keeps too, where the mask is shaped as the labels)."""
        ignored = call.get("ignore_index", -100)
        shifted = call.get("shift_labels")
        if isinstance(shifted, Tensor):
            return shifted.ne(ignored).sum()
        labels: Tensor = call["labels"]
        counted = labels.ne(ignored)
        mask = call.get("attention_mask")
        if masked and isinstance(mask, Tensor) and mask.shape == labels.shape:
            counted = counted & mask.ne(0)
        if shift and labels.dim() > 1:
            counted = counted[..., 1:]
        return counted.sum()

    def _recipe(self) -> str:
        if not self.takes_count:
            return _FROM_LOGITS
        count = "(labels[..., 1:] != -100).sum()" if self.shift else "(labels != -100).sum()"
        return (
            "Pass the batch's token count as transformers' gradient accumulation does: split "
            "the model with 'num_items_in_batch': a 0-dim tensor among the example's kwargs, "
            "then give each step kwargs={..., 'num_items_in_batch': pipeline.NoChunk(n)} with "
            f"n = {count} over the whole batch, and loss_reduction='sum' (docs/split.md, "
            '"transformers\' own loss")'
        )


_FROM_LOGITS = (
    "This model's loss takes no count (its forward computes its own loss, or calls its "
    "loss_function without its keyword arguments): compute the loss in loss_fn from the "
    "output's logits, summed and divided by the batch's count of labels not ignored, with "
    "loss_reduction='sum'"
)

_IGNORED_COUNT = (
    "num_items_in_batch was given, but this model ignores it: its forward computes out.loss "
    "without transformers' loss_function, or calls it without its keyword arguments, so each "
    "micro-batch's out.loss is the mean over its own labels and the micro-batches' losses "
    "would not add up to the plain model's. "
    + _FROM_LOGITS
    + "; or leave the count out and weigh by rows (loss_reduction='mean') where every "
    "micro-batch holds labels not ignored in proportion to its rows"
)


def _answer_positions(positions: Tensor, call: dict[str, Any]) -> Tensor:
    """The answer positions a question-answering loss counts: those inside the sequence
    (one past it or beyond is its ignored index; a negative one is clamped to 0)."""
    sequence = call.get("input_ids")
    if not isinstance(sequence, Tensor):
        sequence = call.get("inputs_embeds")
    if not isinstance(sequence, Tensor) or sequence.dim() < 2:
        return positions.new_tensor(positions.numel())  # every position counted
    return positions.lt(sequence.shape[1]).sum()


def _not_ignored(targets: Tensor, call: dict[str, Any]) -> Tensor:
    return targets.ne(call.get("ignore_index", -100)).sum()


# Targets besides labels that a transformers head's own loss averages over, leaving some
# out (BERT's question answering, its next-sentence prediction), with what it counts.
_OTHER_TARGETS = {
    "start_positions": _answer_positions,
    "end_positions": _answer_positions,
    "next_sentence_label": _not_ignored,
}


def _in_proportion(counts: list[int], rows: list[int]) -> bool:
    """Whether each micro-batch's share of the tokens is its share of the rows."""
    total, all_rows = sum(counts), sum(rows)
    return all(c * all_rows == r * total for c, r in zip(counts, rows, strict=True))


def _weighing(reduction: LossReduction, divisor: Any) -> str:
    if reduction == "mean":
        return "by their rows (loss_reduction='mean')"
    if divisor is None:
        return "alike (loss_reduction='sum')"
    return "alike, divided by loss_divisor"


def _check_number(call: Any) -> None:
    """Refuse a count given as a number (a keyword only: transformers takes it in ``**kwargs``).

    Checked before the first piece binds the call, which would only say that
    the number differs from the one the model was split with.
    """
    count = call.kwargs.get("num_items_in_batch") if isinstance(call, Arguments) else None
    if count is not None and not isinstance(count, Tensor):
        raise TypeError(
            f"num_items_in_batch is {type(count).__name__}, but the split model takes a number "
            "as a constant of its captured code, fixed at split time; split on a 0-dim tensor "
            "and give each step pipeline.NoChunk(n), n a 0-dim tensor of the batch's count"
        )


def _check_summed(reduction: LossReduction, divisor: Any) -> None:
    """Refuse a weighing other than a plain sum of losses already divided by the count."""
    if reduction != "sum" or divisor is not None:
        raise ValueError(
            "with num_items_in_batch, each micro-batch's out.loss is its sum over the batch's "
            "count: they add up to the plain model's loss, so pass loss_reduction='sum' and no "
            f"loss_divisor (the step would weigh them {_weighing(reduction, divisor)})"
        )
