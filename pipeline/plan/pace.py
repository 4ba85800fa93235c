"""How fast a model's layers run inside a pipe, against their profile alone.

Layers are profiled one at a time, in one process while the others wait
(``profile.py``). Inside a pipe the same layers run slower. A Pipe's CPU
workers share the cores and the interpreter's lock: a forward under the
seeding mode holds it for every op (the example GPT's forwards of 2 rows
took 14 ms beside each other against 7.5 ms alone). Processes share the
machine's cores, caches and memory, the transport's threads copy each
message beside the compute, and a stage's actions alternate with receives
and sends: a GPT stage's forward took 1.3 to 1.4 times its profile inside
a pipeline of processes, its backward 1.2 to 1.5 times. And a step costs
time outside its actions: the split into micro-batches and the loss's sum;
between processes, the processes' agreement before them and the tied
weights' sums after them (4 to 5 ms of a 41 ms GPT step, with the loss's
broadcast that a step made then).

Both are measured here with the model itself, once per micro-batch count:
a pipe of the compute-balanced cut (a ``Pipe`` on the devices, or a
``DistributedPipe`` of the group: ``Placement``) runs 1F1B steps (after a
warm-up, in two rounds over every run, the second in the opposite order;
before them all, the first run's steps once unmeasured, as a process's
first pipe steps run slow); GPipe's pace is 1F1B's. Where the plan weighs
them, ZB-H1 and the interleaved schedule are measured with steps of their
own: their paces are their own (the interleaved schedule's two stages per
worker run twice the actions and, between processes, three times the
messages per micro-batch of 1F1B, and its steps in the examples' models
ran 10 to 25% over a prediction from 1F1B's pace; a backward run as ``I``
then ``W`` cost the GPT's ZB-H1 steps more than its profile's halves say).
``outside`` is the median of every run's median seconds of a step call
beyond its actions (``call_duration - duration``; between processes, the
least over them); ``factor`` is the scale on every layer's profiled time
that, with the cost per action (and between processes, the measured
link), plays the programs in the step's measured time (the median
``call_duration``; between processes, the largest of theirs), found by
bisection. The time model (``timing.py``) then scales every action's
compute by ``factor`` and adds ``outside`` to each configuration's step.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeline.pipe import Pipe
from pipeline.plan.agreement import largest
from pipeline.plan.contention import Contention
from pipeline.plan.links import Link, cut_seconds
from pipeline.plan.partition import fitting_balance
from pipeline.plan.profile import LayerTimes, Saved
from pipeline.plan.sharding import LayerCollectives, shard_stages, stage_collectives
from pipeline.plan.timing import matching, predicted_seconds, stage_costs
from pipeline.runtime.partitions import call_style_of
from pipeline.step.schedules import resolve_schedule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipeline.distributed import DistributedPipe

__all__ = [
    "SAME_PACE",
    "Pace",
    "Placement",
    "Wanted",
    "Workload",
    "measured_paces",
    "paced_as",
    "virtual_stages",
]

LossFn = Callable[[Any, Any], Tensor]

# The range searched for the factor: far beyond what a machine does to a layer.
_SLOWEST, _FASTEST = 100.0, 0.01


@dataclass(frozen=True)
class Pace:
    """A model in a pipe: ``factor`` times its layers' profiled seconds, and
    ``outside`` seconds a step beyond its actions."""

    factor: float = 1.0
    outside: float = 0.0

    @property
    def scale(self) -> Contention:
        """The factor as the time model scales a stage's costs (forward and backward alike)."""
        return Contention(self.factor, self.factor)

    def __str__(self) -> str:
        return f"x{self.factor:.2f} + {self.outside * 1e3:.1f} ms"


SAME_PACE = Pace()  # the profile as it is, nothing outside the actions


def virtual_stages(schedule: str) -> int:
    """The stages per process ``schedule`` runs."""
    return 2 if schedule == "interleaved" else 1


def paced_as(schedule: str) -> str:
    """The schedule whose steps measure ``schedule``'s pace: GPipe runs 1F1B's actions, and
    both ZB-H1s the same ``I`` and ``W``; zero-bubble's backwards in two and the
    interleaved schedule's two stages per process have paces of their own."""
    return {"gpipe": "1f1b", "zb-h1-peak": "zb-h1"}.get(schedule, schedule)


@dataclass(frozen=True)
class Workload:
    """What a step of the model takes: the batch, the target, the loss, the keywords."""

    model: nn.Sequential
    sample: Any
    target: Any
    loss_fn: LossFn
    kwargs: Mapping[str, Any] | None


# A pace to measure: the schedule, the micro-batch count, the layers' profile at that count.
Wanted = tuple[str, int, tuple[Saved, LayerTimes]]


@dataclass(frozen=True)
class Placement:
    """Where a pace is measured: a DistributedPipe over ``group``, this process's stages on
    ``devices[0]`` (sharded over ``shards``, a 1-D mesh, as ``sharding.py`` shards them);
    or, without a group, a Pipe with a stage on each of ``devices``."""

    devices: tuple[torch.device, ...]
    group: dist.ProcessGroup | None = None
    shards: DeviceMesh | None = None

    @property
    def workers(self) -> int:
        """The group's processes, or the Pipe's devices: stage ``j`` runs on ``j % workers``."""
        return len(self.devices) if self.group is None else dist.get_world_size(self.group)

    def largest(self, value: float) -> float:
        """The largest ``value`` of the group's processes (a collective), or ``value``."""
        return value if self.group is None else largest(self.group, value)

    def built(
        self, model: nn.Sequential, balance: list[int], chunks: int
    ) -> Pipe | DistributedPipe:
        """A pipe of ``model`` cut by ``balance``, with nothing checkpointed."""
        from pipeline.distributed import DistributedPipe  # it imports pipeline, which imports this

        if self.group is None:
            devices = list(self.devices) * (len(balance) // len(self.devices))
            return Pipe(model, balance, devices=devices, chunks=chunks, checkpoint="never",
                        call_style=call_style_of(model))  # fmt: skip
        pipe = DistributedPipe(model, balance, group=self.group, device=self.devices[0],
                               chunks=chunks, checkpoint="never",
                               call_style=call_style_of(model))  # fmt: skip
        if self.shards is not None:
            shard_stages(pipe, self.shards)
        return pipe


def measured_paces(
    placement: Placement,
    work: Workload,
    wanted: Sequence[Wanted],
    link: Link | None,
    overhead: float,
    repeats: int,
    collectives: LayerCollectives | None = None,
) -> list[Pace]:
    """The model's pace in a pipe placed by ``placement`` for each of ``wanted``: stepped
    with its schedule (``"1f1b"``, ``"zb-h1"``, or ``"interleaved"``: two stages per
    worker) and count.

    With a group, a collective, the same on every rank. Each profile: the
    layers' saved bytes and times for one micro-batch of that count;
    ``link``: between processes (None: a Pipe's stages, one memory);
    ``overhead``: the seconds per action (``overhead.py``); ``collectives``:
    sharded stages' all-gathers and reduce-scatters, per layer, played with
    the actions so that the factor scales the compute alone. The seconds
    outside the actions do not depend on the schedule or the count: every
    pace takes the median of those measured, which a single measure's noise
    moves less.
    """
    if not wanted:
        return []  # no schedule of the plan can run here: the search finds nothing either
    workers = placement.workers
    cuts = [_compute_cut(times, workers * virtual_stages(name)) for name, _, (_, times) in wanted]
    # Two rounds, the second in the opposite order, each run's steps split between them:
    # the machine's pace drifts over the seconds this takes, and each run then sees both ends.
    calls: list[list[float]] = [[] for _ in wanted]
    gaps: list[list[float]] = [[] for _ in wanted]
    # A process's first pipe steps run slow (its threads start, its allocator grows):
    # the first run's steps once more, unmeasured, before any is measured.
    _stepped(placement, work, wanted[0][0], cuts[0], wanted[0][1], repeats, [], [])
    order = list(range(len(wanted)))
    for steps in (repeats - repeats // 2, repeats // 2):
        for k in order if steps else ():
            name, m, _ = wanted[k]
            _stepped(placement, work, name, cuts[k], m, steps, calls[k], gaps[k])
        order.reverse()
    measured = [placement.largest(statistics.median(c)) for c in calls]
    outside = statistics.median(-placement.largest(-statistics.median(g)) for g in gaps)
    return [
        Pace(
            _factor(name, m, profile, cut, workers, call, outside, link, overhead, collectives),
            outside,
        )
        for (name, m, profile), cut, call in zip(wanted, cuts, measured, strict=True)
    ]


def _factor(
    schedule: str,
    chunks: int,
    profile: tuple[Saved, LayerTimes],
    balance: list[int],
    workers: int,
    measured: float,
    outside: float,
    link: Link | None,
    overhead: float,
    collectives: LayerCollectives | None = None,
) -> float:
    """The factor on the layers' times that plays the step in its ``measured`` seconds."""
    saved, times = profile
    stages = len(balance)
    spans = list(pairwise([0, *accumulate(balance)]))
    programs = resolve_schedule(schedule).programs(chunks, stages)
    owner = [j % workers for j in range(stages)]
    cuts = None if link is None else cut_seconds(saved, spans, owner, link)
    fixed = stage_collectives(collectives, spans)

    def played(factor: float) -> float:
        scale = Contention(factor, factor)
        costs = [stage_costs(times, a, b, scale) for a, b in spans]
        return outside + predicted_seconds(programs, costs, set(), overhead, None, cuts, fixed)

    # The smallest factor where the link and the actions' own cost take the whole step.
    return matching(played, measured, _FASTEST, _SLOWEST)


def _compute_cut(times: LayerTimes, stages: int) -> list[int]:
    """The balance of the layers into ``stages`` for compute alone."""

    def compute(j: int, a: int, b: int) -> float:
        costs = stage_costs(times, a, b)
        return costs.forward + costs.backward

    balance = fitting_balance(len(times.forward) - 1, stages, compute, lambda j, a, b: True)
    assert balance is not None, "a cut that needs nothing to fit always exists"
    return balance


def _stepped(
    placement: Placement,
    work: Workload,
    schedule: str,
    balance: list[int],
    chunks: int,
    steps: int,
    calls: list[float],
    gaps: list[float],
) -> None:
    """This process's step calls, and their seconds beyond the actions, added to ``calls``
    and ``gaps`` for ``steps`` steps of a pipe of ``work``'s model, built for them (one
    step warms up first)."""
    cuda = [d for d in placement.devices if d.type == "cuda"]
    # The caller's model, gradients and generators are left as they were.
    with torch.random.fork_rng(devices=cuda):
        pipe = placement.built(copy.deepcopy(work.model), balance, chunks)
        try:
            for run in range(steps + 1):
                pipe.zero_grad(set_to_none=True)
                pipe.step(work.sample, work.target, work.loss_fn, kwargs=work.kwargs,
                          schedule=schedule)  # fmt: skip
                report = pipe.last_step
                assert report is not None, "a step that returned has its report"
                if run:
                    calls.append(report.call_duration)
                    gaps.append(report.call_duration - report.duration)
        finally:
            pipe.close()
