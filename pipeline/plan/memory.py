"""The planner's memory model: what one stage holds at its peak, term by term.

For stage ``j`` (layers ``first..stop``) under a schedule's program, with
micro-batches of one size (docs/plan.md writes the terms down):

- **activations**: the bytes autograd saved for backward, each storage once
  (``profile.Saved``): a task that is not checkpointed holds them from its
  forward to the end of its backward (to its ``W`` under zero-bubble: ``I``
  keeps the graph); a checkpointed one holds none until its backward
  recomputes them, then holds them until it ends. The peak is taken where
  tensors are saved (a forward, a recomputation), as the step's meter takes
  it (``pipeline/step/activations.py``): the figure is that meter's, exactly;
- **inputs**: what the stage keeps of its received input outside autograd
  (the message, until the backward): all of it for a checkpointed task,
  else what its layers did not save already; nothing on stage 0, whose
  micro-batches are views of the caller's batch;
- **parameters**, **gradients** (``.grad`` of the trainable ones, kept
  between steps) and **optimizer** state (``optimizer_bytes_per_param`` per
  trainable element: 8 for AdamW in float32), each parameter on the stage
  of the first layer that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from pipeline.plan.profile import Saved
from pipeline.step.actions import Program

__all__ = [
    "LayerParameters",
    "StageMemory",
    "held_peaks",
    "layer_parameters",
    "stage_memory",
    "stage_programs",
]


@dataclass(frozen=True)
class LayerParameters:
    """Per layer: bytes of the parameters it holds first, and elements of those trained."""

    nbytes: tuple[int, ...]
    trained_bytes: tuple[int, ...]
    optimizer: tuple[int, ...]


@dataclass(frozen=True)
class StageMemory:
    """One stage's predicted peak, in bytes, by term.

    ``activations`` is the peak of the saved bytes alone (what
    ``pipe.last_step`` measures with ``measure_memory=True``); ``inputs``
    what the received inputs add at the peak of the two together.
    """

    activations: int
    inputs: int
    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.activations + self.inputs + self.parameters + self.gradients + self.optimizer


def layer_parameters(model: nn.Sequential, optimizer_bytes_per_param: int) -> LayerParameters:
    """Each layer's parameter bytes, a parameter counted once, at the first layer holding it."""
    seen: set[int] = set()
    nbytes: list[int] = []
    trained: list[int] = []
    optimizer: list[int] = []
    for layer in model:
        fresh = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        nbytes.append(sum(p.numel() * p.element_size() for p in fresh))
        trained.append(sum(p.numel() * p.element_size() for p in fresh if p.requires_grad))
        optimizer.append(
            sum(p.numel() for p in fresh if p.requires_grad) * optimizer_bytes_per_param
        )
    return LayerParameters(tuple(nbytes), tuple(trained), tuple(optimizer))


def held_peaks(
    program: Program, checkpointed: set[tuple[int, int]], saved: int, whole_input: int, extra: int
) -> tuple[int, int]:
    """The peak saved bytes, and the peak of saved bytes and inputs together, along ``program``.

    ``program`` holds one stage's actions in order; each micro-batch saves
    ``saved`` bytes; a checkpointed task keeps ``whole_input`` bytes until
    it recomputes, and any task ``extra`` bytes of input beside what it
    saved once its graph is there.

    >>> from pipeline.step.actions import parse_program
    >>> held_peaks(parse_program("0F0 0F1 0B0 0B1"), set(), 10, 0, 0)
    (20, 20)
    >>> held_peaks(parse_program("0F0 0F1 0B0 0B1"), {(0, 0), (1, 0)}, 10, 4, 0)
    (10, 14)
    """
    holds: dict[int, tuple[int, int]] = {}  # micro-batch -> (saved, inputs)
    peak_saved = peak_held = 0
    for action in program:
        i = action.microbatch
        task = (i, action.stage) in checkpointed
        grows = action.kind == "F" or (task and action.kind in ("B", "I"))
        if grows:
            holds[i] = (0, whole_input) if task and action.kind == "F" else (saved, extra)
            peak_saved = max(peak_saved, sum(s for s, _ in holds.values()))
            peak_held = max(peak_held, sum(s + x for s, x in holds.values()))
        if action.kind in ("B", "W"):
            del holds[i]
    return peak_saved, peak_held


def stage_memory(
    program: Program,
    checkpointed: set[tuple[int, int]],
    saved: Saved,
    parameters: LayerParameters,
    first: int,
    stop: int,
) -> StageMemory:
    """The peak of the stage of layers ``first..stop`` running ``program`` (its own actions)."""
    last = stop == len(saved.outputs)
    peak_saved, peak_held = held_peaks(
        program,
        checkpointed,
        saved.saved_bytes(first, stop, last),
        saved.input_bytes(first, stop, last, kept=True),
        saved.input_bytes(first, stop, last, kept=False),
    )
    return StageMemory(
        activations=peak_saved,
        inputs=peak_held - peak_saved,
        parameters=sum(parameters.nbytes[first:stop]),
        gradients=sum(parameters.trained_bytes[first:stop]),
        optimizer=sum(parameters.optimizer[first:stop]),
    )


def stage_programs(programs: Sequence[Program], stages: int) -> list[Program]:
    """Each stage's own actions, in order, from the workers' programs."""
    return [[a for program in programs for a in program if a.stage == s] for s in range(stages)]
