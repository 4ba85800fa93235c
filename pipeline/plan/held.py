"""What one stage holds along a schedule's actions, micro-batch by micro-batch: the walk.

``held_peaks`` walks every stage's actions (in the order one thread would
run them) and samples, after each action, what the stage holds: autograd's
saved bytes, its inputs, the mail waiting for it, and zero-bubble's
recorded gradients (``memory.py`` says what each term is). The walk's shape
depends on the schedule, the stage and what is checkpointed; the bytes, on
the stage's layers. A search weighs thousands of cuts under one schedule,
so ``PeakForms`` walks once with symbols for the bytes, and each sample
becomes four linear forms of one micro-batch's bytes::

    walk once:   0F0  0F1  0B0 ...     sample k: saved  = 2*saved - released
                  |    |    |                    inputs = 2*unsaved
                  v    v    v                    mail   = grad + skip from 2
                 sample 1, 2, 3 ...              ...
    each cut:    peaks = max over the samples, the forms read with its bytes

Reading the forms gives exactly the walk's figures: the same sums, the
first sample of the greatest total kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import mul

from pipeline.step.actions import Action

__all__ = ["HeldPeaks", "MicroBatchBytes", "PeakForms", "held_peaks"]


@dataclass(frozen=True)
class MicroBatchBytes:
    """What one micro-batch puts on a stage, by what holds it.

    ``saved`` by autograd; ``received`` its input, whole (0 on stage 0);
    ``unsaved`` the part of that its layers do not save; ``grad`` the
    gradient mailed back to it (0 on the last stage); ``recorded`` what
    zero-bubble's ``I`` keeps for ``W``; ``released`` the saved bytes ``I``
    lets go (what lies above the stage's topmost anchor, the loss's
    included, where ``I`` starts from the stage's received input:
    ``Saved.released_bytes``); ``replayed`` the buffer copies a
    recomputation saves beside ``saved`` (``Saved.replayed_bytes``), of
    which ``I`` lets ``replayed_released`` go.
    """

    saved: int
    received: int
    unsaved: int
    grad: int
    recorded: int
    released: int = 0
    replayed: int = 0
    replayed_released: int = 0
    # Mail from other stages than the neighbours' activation and gradient: skips, as
    # (stashing stage, bytes) arriving at its forward, and their gradients, as (popping
    # stage, bytes) arriving at its backward (or I). ``received`` holds the skips too.
    skips_in: tuple[tuple[int, int], ...] = ()
    skip_grads: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class HeldPeaks:
    """``activations``: the peak saved bytes alone; the rest: the joint peak, by term."""

    activations: int
    saved: int
    inputs: int
    mail: int
    recorded: int


# The symbols of one micro-batch's bytes: MicroBatchBytes's numbers, the activation mailed
# (its input less its skips), then the skips from each stage, then their gradients.
(SAVED_BYTES, RECEIVED, UNSAVED, GRAD, RECORDED_BYTES, RELEASED, REPLAYED, REPLAYED_RELEASED,
 MAILED, SKIPS) = range(10)  # fmt: skip
# The four terms of what a stage holds.
SAVED, INPUTS, MAIL, RECORDED = range(4)

_Form = dict[int, int]  # symbol: coefficient
_Read = tuple[tuple[int, ...], tuple[int, ...]]  # a form frozen: its symbols, their coefficients


def held_peaks(
    order: Sequence[Action], stage: int, checkpointed: set[tuple[int, int]], one: MicroBatchBytes
) -> HeldPeaks:
    """The peaks of ``stage`` along ``order`` (every stage's actions), each micro-batch ``one``.

    >>> from pipeline.step.actions import parse_program
    >>> one = MicroBatchBytes(saved=10, received=0, unsaved=0, grad=4, recorded=0)
    >>> held_peaks(parse_program("0F0 0F1 0B0 0B1"), 0, set(), one).activations
    20
    >>> order = parse_program("0F0 1F0 0F1 1F1 1B1 1B0 0B1 0B0")
    >>> held_peaks(order, 0, set(), one)  # 1B1 mails a gradient back while 0 holds both
    HeldPeaks(activations=20, saved=20, inputs=0, mail=8, recorded=0)
    """
    return PeakForms(order, stage, checkpointed).peaks(one)


class PeakForms:
    """``held_peaks`` of one stage along one order, walked once: read with each cut's bytes."""

    def __init__(
        self, order: Sequence[Action], stage: int, checkpointed: set[tuple[int, int]]
    ) -> None:
        self.stage = stage
        self._stages = 1 + max((action.stage for action in order), default=stage)
        # Each sample's total beside its terms: a cut reads the terms of its peak alone.
        samples = _walked(order, stage, checkpointed, self._stages)
        self._samples = tuple((_summed(terms), terms) for terms in samples)

    def peaks(self, one: MicroBatchBytes) -> HeldPeaks:
        """The peaks with each micro-batch ``one``: ``held_peaks``'s figures."""
        values = [
            one.saved,
            one.received,
            one.unsaved,
            one.grad,
            one.recorded,
            one.released,
            one.replayed,
            one.replayed_released,
            one.received - sum(nbytes for _, nbytes in one.skips_in),
            *[0] * (2 * self._stages),
        ]
        for start, mail in ((SKIPS, one.skips_in), (SKIPS + self._stages, one.skip_grads)):
            for stage, nbytes in mail:
                if 0 <= stage < self._stages:  # from a stage with actions in the order
                    values[start + stage] += nbytes
        activations, peak_total, peak_terms = 0, 0, None
        for total, terms in self._samples:
            activations = max(activations, _read(terms[SAVED], values))
            held = _read(total, values)
            if held > peak_total:
                peak_total, peak_terms = held, terms
        peak = (0, 0, 0, 0) if peak_terms is None else [_read(t, values) for t in peak_terms]
        return HeldPeaks(activations, *peak)


def _walked(
    order: Sequence[Action], stage: int, checkpointed: set[tuple[int, int]], stages: int
) -> list[tuple[_Read, ...]]:
    """The stage's four sums after each action of ``order``, as forms, each once (the first
    of equal samples is the one a peak keeps)."""
    held = _Held()
    samples: dict[tuple[_Read, ...], None] = {}

    def sample() -> None:
        samples.setdefault(held.frozen(), None)

    for action in order:
        i, kind = action.microbatch, action.kind
        task = (i, stage) in checkpointed
        if action.stage != stage and kind == "F":
            held.add(i, MAIL, {SKIPS + action.stage: 1})
        elif action.stage != stage and kind in ("B", "I"):
            held.add(i, MAIL, {SKIPS + stages + action.stage: 1})
        if action.stage == stage - 1 and kind == "F":
            held.add(i, MAIL, {MAILED: 1})  # the activation, mailed
        elif action.stage == stage + 1 and kind in ("B", "I"):
            held.add(i, MAIL, {GRAD: 1})  # the gradient, mailed back
        elif action.stage == stage:
            if kind == "F":
                # The mailed activation becomes the input, and what the layers save of it.
                held.set(i, SAVED, {} if task else {SAVED_BYTES: 1})
                held.set(i, INPUTS, {RECEIVED: 1} if task else {UNSAVED: 1})
                held.set(i, MAIL, {})
            elif kind in ("B", "I") and task:
                # Recomputed (on copies of the buffers it changes), its gradient still mailed.
                held.set(i, SAVED, {SAVED_BYTES: 1, REPLAYED: 1})
                held.set(i, INPUTS, {UNSAVED: 1})
            sample()
            if kind in ("B", "I"):
                held.set(i, MAIL, {})
            if kind == "I":
                held.add(i, SAVED, {RELEASED: -1, **({REPLAYED_RELEASED: -1} if task else {})})
                held.set(i, RECORDED, {RECORDED_BYTES: 1})
            if kind in ("B", "W"):
                held.drop(i)
        sample()
    return list(samples)


class _Held:
    """What each micro-batch holds on one stage, term by term as forms, and their sums."""

    def __init__(self) -> None:
        self._by_microbatch: dict[int, list[_Form]] = {}
        self._sums: list[_Form] = [{}, {}, {}, {}]

    def set(self, i: int, term: int, form: _Form) -> None:
        terms = self._by_microbatch.setdefault(i, [{}, {}, {}, {}])
        _add(self._sums[term], terms[term], -1)
        _add(self._sums[term], form, 1)
        terms[term] = dict(form)

    def add(self, i: int, term: int, form: _Form) -> None:
        _add(self._by_microbatch.setdefault(i, [{}, {}, {}, {}])[term], form, 1)
        _add(self._sums[term], form, 1)

    def drop(self, i: int) -> None:
        for term, form in enumerate(self._by_microbatch.pop(i, ())):
            _add(self._sums[term], form, -1)

    def frozen(self) -> tuple[_Read, ...]:
        """The four sums, as they are now."""
        return tuple(_frozen(form) for form in self._sums)


def _add(form: _Form, other: _Form, sign: int) -> None:
    for symbol, coefficient in other.items():
        form[symbol] = form.get(symbol, 0) + sign * coefficient


def _frozen(form: _Form) -> _Read:
    pairs = sorted((symbol, c) for symbol, c in form.items() if c)
    return tuple(symbol for symbol, _ in pairs), tuple(c for _, c in pairs)


def _summed(forms: tuple[_Read, ...]) -> _Read:
    total: _Form = {}
    for symbols, coefficients in forms:
        _add(total, dict(zip(symbols, coefficients, strict=True)), 1)
    return _frozen(total)


def _read(form: _Read, values: list[int]) -> int:
    """The form's value for one micro-batch's bytes ``values``."""
    symbols, coefficients = form
    return sum(map(mul, coefficients, map(values.__getitem__, symbols)))
