r"""Benchmark: models split by ``pipeline.split`` and by torch.distributed.pipelining's pipeline().

Four models, in float64, on the same inputs: GPT-2 (its head tied to the
token embedding, the attention mask as a keyword), Llama (rotary tables,
grouped-query attention), the GPT of ``examples/gpt.py`` written as an
ordinary module (``examples/gpt_module.py``, also tied) and the model of
``tests/split`` whose early values are used at the end. GPT-2, Llama and the
early-values model are those of ``tests/split/split_models.py`` (tiny
configs), so the script needs the test extra and transformers.

Each model is cut into two stages at the middle block, the embedding in the
first and the head in the second, by:

- ``pipeline.split``, then ``Pipe`` (two CPU partitions, 2 micro-batches)
  and ``pipe.step``;
- ``torch.distributed.pipelining.pipeline`` with a ``SplitPoint.BEGINNING``
  at the middle block. Its split graph (``split_gm``: the stage modules
  called in order, what its ``PipelineStage``\ s run in their processes) is
  run in this process by ``torch.fx.Interpreter`` on the same 2
  micro-batches, each one's loss weighted by its share of the rows and
  backpropagated. (Calling its ``Pipe`` object runs a test executor that
  detaches every stage's inputs, so no gradient reaches earlier stages;
  ``split_gm`` refuses to be called.)

Each takes 2 SGD steps from the plain model's weights, as does the plain
model; the script prints whether it ran, how far each step's loss and the
second step's gradients are from the plain model's (by the model's parameter
names; every copy of a parameter counts), and how far apart the copies of a
tied weight are after the 2 steps. The last line is JSON.

Run: PYTHONPATH=$PWD python examples/benchmarks/split_compare.py
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pipe_common import print_json
from torch import Tensor, nn
from torch.distributed.pipelining import SplitPoint, pipeline

import pipeline as pipegrad
from pipeline import Pipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: gpt_module, gpt
from gpt_module import GPT

from tests.split.split_models import VOCAB, early_late, gpt2, llama, tokens

ROWS, LENGTH, STEPS, LR = 4, 8, 2, 0.1
ROUNDING = 1e-9  # relative: float64 sums in another order differ by ~1e-16
Batch = tuple[tuple[Tensor, ...], dict[str, Tensor], Tensor]


@dataclass
class Case:
    """A model, where its middle block is, its inputs and its loss."""

    name: str
    make: Callable[[], nn.Module]
    middle: str
    batch: Callable[[], Batch]
    loss: Callable[[Any, Tensor], Tensor]


def logits_of(output: Any) -> Tensor:
    """The logits, from a ModelOutput, a tuple (torch's split returns one) or a tensor."""
    if hasattr(output, "logits"):
        return output.logits
    return output[0] if isinstance(output, tuple) else output


def lm_loss(output: Any, target: Tensor) -> Tensor:
    return F.cross_entropy(logits_of(output).flatten(0, 1), target.flatten())


def mse(output: Any, target: Tensor) -> Tensor:
    return F.mse_loss(logits_of(output), target)


def text_batch(keyword_mask: bool) -> Callable[[], Batch]:
    def make() -> Batch:
        torch.manual_seed(1)
        ids, mask, target = tokens(ROWS, LENGTH, padded=2)
        if keyword_mask:
            return (ids,), {"attention_mask": mask}, target
        return (ids, mask), {}, target

    return make


def ids_batch() -> Batch:
    torch.manual_seed(1)
    ids, _, target = tokens(ROWS, LENGTH)
    return (ids,), {}, target


def features_batch() -> Batch:
    torch.manual_seed(1)
    x = torch.randn(ROWS, 8, dtype=torch.double)
    return (x,), {}, torch.randn(ROWS, 3, dtype=torch.double)


def gpt_module() -> nn.Module:
    return GPT(VOCAB, width=16, heads=2, layers=4, context=LENGTH, dropout=0.0).double()


CASES = [
    Case("GPT-2 (tied head)", gpt2, "transformer.h.1", text_batch(True), lm_loss),
    Case("Llama", llama, "model.layers.1", text_batch(False), lm_loss),
    Case("GPT of examples/gpt.py as a module", gpt_module, "blocks.2", ids_batch, lm_loss),
    Case("early values used late", early_late, "blocks.2", features_batch, mse),
]


def halves(batch: Batch) -> list[Batch]:
    """The batch as 2 micro-batches."""
    args, kwargs, target = batch
    half = ROWS // 2

    def part(k: int) -> Batch:
        cut = slice(k * half, (k + 1) * half)
        return tuple(a[cut] for a in args), {n: v[cut] for n, v in kwargs.items()}, target[cut]

    return [part(0), part(1)]


def plain_step(model: nn.Module, batch: Batch, loss_fn: Callable[[Any, Tensor], Tensor]) -> float:
    args, kwargs, target = batch
    loss = loss_fn(model(*args, **kwargs), target)
    loss.backward()
    return float(loss.detach())


def our_step(pipe: Pipe, batch: Batch, loss_fn: Callable[[Any, Tensor], Tensor]) -> float:
    args, kwargs, target = batch
    value = args[0] if len(args) == 1 else args
    return float(pipe.step(value, target, loss_fn, kwargs=kwargs or None, schedule="1f1b"))


def torch_step(split: Any, batch: Batch, loss_fn: Callable[[Any, Tensor], Tensor]) -> float:
    """One step through torch's stages in order, autograd across them, on 2 micro-batches."""
    graph = split.split_gm
    names = [node.target for node in graph.graph.nodes if node.op == "placeholder"]
    total = 0.0
    for args, kwargs, target in halves(batch):
        inputs = [*args, *(kwargs[name] for name in names[len(args) :])]
        output = torch.fx.Interpreter(graph).run(*inputs)
        loss = loss_fn(output, target) * (target.size(0) / ROWS)
        loss.backward()
        total += float(loss.detach())
    return total


@dataclass
class Outcome:
    """Whether a split ran, and how far it is from the plain model."""

    runs: str
    loss_differences: list[float] | None = None  # each step's |loss - plain|
    gradient_differences: list[float] | None = None  # each step's max |gradient - plain|
    differing: list[list[str]] | None = None  # each step's names whose gradient differs
    without_gradient: list[str] | None = None  # names with a copy that got no gradient
    parameters: int = 0  # the plain model's parameter names, a tied weight's each
    tied_apart: float | None = None  # max |difference| between a tied weight's copies


Run = tuple[list[float], list[dict[str, list[Tensor]]]]


def train(model: nn.Module, step: Callable[[Batch], float], batch: Batch) -> Run:
    """STEPS steps of SGD; each step's loss and gradients (by the model's names)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, gradients = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses.append(step(batch))
        gradients.append(by_name(model, lambda p: p.grad))
        optimizer.step()
    return losses, gradients


def original_name(name: str) -> str:
    """The model's name of a parameter of torch's split (``split_gm.submod_1.x`` -> ``x``)."""
    parts = name.split(".")
    if parts[0] == "split_gm":
        return ".".join(parts[2:])
    return name


def by_name(model: nn.Module, value: Callable[[Tensor], Tensor | None]) -> dict[str, list[Tensor]]:
    """Every copy of every parameter under the model's names (a tied weight under each name)."""
    found: dict[str, list[Tensor]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        tensor = value(parameter)
        if tensor is not None:
            found.setdefault(original_name(name), []).append(tensor.detach().clone())
    return found


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The plain model's names that one parameter goes by, where it has more than one."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def compare(model: nn.Module, plain: Run, found: Run, groups: list[list[str]]) -> Outcome:
    """How far ``found`` (the split's losses and gradients) is from the plain model's."""
    (expected_losses, expected), (losses, gradients) = plain, found
    outcome = Outcome("yes", [abs(a - b) for a, b in zip(losses, expected_losses, strict=True)])
    outcome.gradient_differences, outcome.differing, outcome.without_gradient = [], [], []
    outcome.parameters = len(expected[0])
    for reference, mine in zip(expected, gradients, strict=True):
        gaps, differing = [0.0], []
        for name, (plain_gradient,) in reference.items():
            copies = mine.get(name, [])
            if len(copies) < copies_of(model, name) and name not in outcome.without_gradient:
                outcome.without_gradient.append(name)
            for gradient in copies:
                gaps.append(float((gradient - plain_gradient).abs().max()))
                if gaps[-1] > ROUNDING * float(plain_gradient.abs().max()):
                    differing.append(name)
        outcome.gradient_differences.append(max(gaps))
        outcome.differing.append(sorted(set(differing)))
    weights = by_name(model, lambda p: p)
    apart = [0.0]
    for group in groups:
        copies = [w for name in group for w in weights.get(name, [])]
        apart += [float((c - copies[0]).abs().max()) for c in copies]
    outcome.tied_apart = max(apart)
    return outcome


def copies_of(model: nn.Module, name: str) -> int:
    """How many parameters of ``model`` go by the model's ``name``."""
    return sum(original_name(n) == name for n, _ in model.named_parameters(remove_duplicate=False))


def measure(case: Case, splitter: str) -> Outcome:
    torch.manual_seed(0)
    model = case.make()
    groups = tied_groups(model)
    batch = case.batch()
    reference = copy.deepcopy(model)
    # Gradients under one name per parameter, as the plain model names them.
    expected = train(reference, lambda b: plain_step(reference, b, case.loss), batch)
    args, kwargs, _ = halves(batch)[0]
    try:
        if splitter == "pipeline.split":
            seq = pipegrad.split(model, args, kwargs or None)
            half = len(seq) // 2
            runner: nn.Module = Pipe(seq, [half, len(seq) - half], devices=["cpu"] * 2, chunks=2)
            step: Callable[[Batch], float] = lambda b: our_step(runner, b, case.loss)  # noqa: E731
        else:
            runner = pipeline(model, args, kwargs or None, {case.middle: SplitPoint.BEGINNING})
            step = lambda b: torch_step(runner, b, case.loss)  # noqa: E731
        ours = train(runner, step, batch)
    except Exception as error:  # what fails is the result
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Outcome(f"fails: {type(error).__name__}: {first[:120]}")
    return compare(runner, expected, ours, groups)


def describe(outcome: Outcome) -> str:
    if outcome.loss_differences is None:
        return f"runs: {outcome.runs}"
    assert outcome.gradient_differences is not None and outcome.differing is not None
    parts = ["runs"]
    for step, (loss, gradient, names) in enumerate(
        zip(outcome.loss_differences, outcome.gradient_differences, outcome.differing, strict=True),
        1,
    ):
        which = names if len(names) <= 3 else f"{len(names)} of {outcome.parameters} names"
        parts.append(
            f"step {step}: |loss - plain| {loss:.1e}, max |gradient - plain| {gradient:.1e}, "
            f"gradients that differ: {which or 'none'}"
        )
    parts.append(f"copies without a gradient: {outcome.without_gradient or 'none'}")
    parts.append(f"tied copies apart after {STEPS} steps: {outcome.tied_apart:.1e}")
    return "; ".join(parts)


def main() -> int:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = []
    for case in CASES:
        for splitter in ("pipeline.split", "torch pipeline()"):
            outcome = measure(case, splitter)
            rows.append({"model": case.name, "splitter": splitter, **vars(outcome)})
            print(f"{case.name} | {splitter} | {describe(outcome)}", flush=True)
    print_json({"benchmark": "split_compare", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
