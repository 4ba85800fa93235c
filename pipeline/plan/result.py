"""``Plan``: what the planner chose and why, the pipe it builds, and its check against a step.

``str(plan)`` is a table: the chosen configuration, then the runner-ups,
each with why it lost (slower, or over the limit on a device or process, by
how much). ``plan.pipe()`` builds the chosen Pipe, ``plan.distributed()``
this process's DistributedPipe (planned with ``processes=N``);
``plan.check(pipe)`` puts the prediction beside ``pipe.last_step``
(measured with ``measure_memory=True``), gathered from every process for a
DistributedPipe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.pipe import Pipe
from pipeline.plan.contention import NO_CONTENTION, Contention
from pipeline.plan.links import Link
from pipeline.plan.pace import Pace
from pipeline.plan.search import Candidate
from pipeline.plan.sharding import Sharding, shard_stages
from pipeline.runtime.agreement import gather_rows
from pipeline.runtime.partitions import call_style_of
from pipeline.step.reports import DistributedStepReport, _bytes

if TYPE_CHECKING:
    from pipeline.distributed import DistributedPipe

__all__ = ["Plan", "PlanCheck", "PlanError", "Processes", "choose"]

# What plan.distributed() takes from the plan, and may not be given again.
_PLANNED = ("balance", "chunks", "checkpoint", "group", "device", "call_style")

RUNNER_UPS = 8


@dataclass(frozen=True)
class Processes:
    """A plan's processes: how many, their group (None: planned outside one), this one's
    device, the link between them, and how their stages are sharded (None: whole)."""

    count: int
    group: dist.ProcessGroup | None
    device: torch.device
    link: Link
    sharding: Sharding | None = None


class PlanError(ValueError):
    """No configuration fits the memory limit (the message names the device and the overflow)."""


@dataclass(frozen=True)
class PlanCheck:
    """Predicted against measured: the step's seconds, each stage's peak saved bytes.

    ``measured_activations[j]`` is ``pipe.last_step``'s
    ``peak_activation_bytes`` of stage ``j`` (None if the step did not
    measure memory); errors are measured / predicted - 1. The step's
    seconds are ``last_step.call_duration`` (the actions and what comes
    before and after them, as the plan's pace predicts it); for a
    DistributedPipe, every process's stages, and the longest of the
    processes' step calls.
    """

    predicted_seconds: float
    measured_seconds: float
    predicted_activations: tuple[int, ...]
    measured_activations: tuple[int | None, ...]

    @property
    def time_error(self) -> float:
        return self.measured_seconds / self.predicted_seconds - 1

    def __str__(self) -> str:
        lines = [
            f"step time: predicted {self.predicted_seconds * 1e3:.2f} ms, measured "
            f"{self.measured_seconds * 1e3:.2f} ms ({self.time_error:+.0%})",
            "stage  predicted activations  measured activations",
        ]
        for j, (p, m) in enumerate(
            zip(self.predicted_activations, self.measured_activations, strict=True)
        ):
            shown = "-" if m is None else _bytes(m)
            lines.append(f"{j:>5}  {_bytes(p):>21}  {shown:>20}")
        return "\n".join(lines)


class Plan:
    """The configuration the planner chose for a model, and the others it weighed.

    ``balance``, ``chunks``, ``schedule`` (the name ``pipe.step`` takes),
    ``checkpoint``, ``devices`` (one per partition), ``predicted_seconds``,
    ``predicted_memory`` (bytes per device), ``chosen`` (its ``Candidate``,
    with each stage's memory by term) and ``runner_ups`` (the next
    candidates, each with why it lost), ``contention`` (by micro-batch
    count, how much slower a CPU stage was taken to run beside the
    others), ``action_overhead``
    (the seconds added per action), ``processes`` (planned with
    ``processes=N``: their count, group, this process's device and the link
    between them; else None) and ``paces`` (the model's pace measured in the
    pipe, by the schedule that measured it and micro-batch count:
    ``pace.py``; empty where it was not measured).
    """

    def __init__(
        self,
        model: nn.Sequential,
        chosen: Candidate,
        others: list[Candidate],
        contention: Mapping[int, Contention] | None = None,
        action_overhead: float = 0.0,
        processes: Processes | None = None,
        paces: Mapping[tuple[str, int], Pace] | None = None,
    ) -> None:
        self.model = model
        self.chosen = chosen
        self.candidates = others
        self.contention: Mapping[int, Contention] = contention or {}
        self.action_overhead = action_overhead
        self.processes = processes
        self.paces: Mapping[tuple[str, int], Pace] = paces or {}

    @property
    def balance(self) -> list[int]:
        return list(self.chosen.balance)

    @property
    def chunks(self) -> int:
        return self.chosen.chunks

    @property
    def schedule(self) -> str:
        return self.chosen.schedule

    @property
    def checkpoint(self) -> str:
        return self.chosen.checkpoint

    @property
    def devices(self) -> list[str]:
        return [str(d) for d in self.chosen.devices]

    @property
    def predicted_seconds(self) -> float:
        return self.chosen.seconds

    @property
    def predicted_memory(self) -> dict[str, int]:
        return self.chosen.device_bytes

    @property
    def runner_ups(self) -> list[tuple[Candidate, str]]:
        """The fastest other candidates, each with why it lost to the chosen one."""
        others = sorted(
            (c for c in self.candidates if c is not self.chosen), key=lambda c: c.seconds
        )
        return [(c, self._why(c)) for c in others[:RUNNER_UPS]]

    def _why(self, other: Candidate) -> str:
        if not other.fits:
            over = ", ".join(f"{d} by {_bytes(b)}" for d, b in other.overflow.items())
            return f"over the limit on {over}"
        return f"slower by {other.seconds / self.chosen.seconds - 1:.1%}"

    def pipe(self) -> Pipe:
        """The chosen Pipe, over the model's own layers (they move to their devices).

        Train it with ``pipe.step(x, y, loss_fn, schedule=plan.schedule)``.
        """
        if self.processes is not None:
            raise ValueError(
                f"this plan is for {self.processes.count} processes: build this process's "
                "stages with plan.distributed() in every process, or plan with devices=[...] "
                "for a Pipe"
            )
        return Pipe(
            self.model,
            self.balance,
            devices=self.devices,
            chunks=self.chunks,
            checkpoint=self.checkpoint,  # type: ignore[arg-type]
            call_style=call_style_of(self.model),
        )

    def distributed(self, **options: Any) -> DistributedPipe:
        """This process's stages of the chosen DistributedPipe; every process of the plan calls it.

        The plan's balance, chunks and checkpoint mode, on the group and
        device it was planned with, its stages sharded as planned with
        ``mesh=`` (``sharding.shard_stages``: make the optimizer after this,
        over the sharded parameters); ``options`` are DistributedPipe's others
        (``timeout``, ``init``, ...). The processes compare their arguments
        as they build it and all refuse a mismatch (DistributedPipe's own
        agreement). Train it with ``pipe.step(x, y, loss_fn,
        schedule=plan.schedule)`` in every process.
        """
        from pipeline.distributed import DistributedPipe  # it imports pipeline, which imports this

        if self.processes is None:
            raise ValueError(
                "this plan is for a Pipe in this process (planned with devices=): build it with "
                "plan.pipe(), or plan with processes=N for a DistributedPipe"
            )
        if self.processes.group is None:
            raise ValueError(
                f"this plan for {self.processes.count} processes was made outside a process "
                "group: call pipeline.plan in every process of the group, then "
                "plan.distributed(), or build DistributedPipe(model, plan.balance, "
                "chunks=plan.chunks, checkpoint=plan.checkpoint) yourself"
            )
        again = sorted(set(options) & set(_PLANNED))
        if again:
            raise TypeError(
                f"plan.distributed() got {', '.join(again)}, which the plan chose or was made "
                "with; plan again with other arguments instead (its other options are "
                "DistributedPipe's)"
            )
        pipe = DistributedPipe(
            self.model,
            self.balance,
            group=self.processes.group,
            device=self.processes.device,
            chunks=self.chunks,
            checkpoint=self.checkpoint,  # type: ignore[arg-type]
            call_style=call_style_of(self.model),
            **options,
        )
        sharding = self.processes.sharding
        if sharding is not None:
            shard_stages(pipe, sharding.mesh["dp"])
        return pipe

    def check(self, pipe: Pipe | DistributedPipe) -> PlanCheck:
        """The prediction beside ``pipe.last_step``: run ``step(..., measure_memory=True)`` first.

        Refuses a pipe or a step that is not the plan's (another balance,
        chunks, checkpoint mode or schedule), saying which differs. A
        DistributedPipe's check is a collective: every process calls it, and
        each gets every process's figures.
        """
        report = pipe.last_step
        if report is None:
            raise ValueError(
                "the pipe has run no step yet: run pipe.step(x, y, loss_fn, "
                f"schedule={self.schedule!r}, measure_memory=True), then check it"
            )
        found = {
            "balance": list(pipe.balance),
            "chunks": pipe.chunks,
            "checkpoint": pipe.checkpoint,
            "schedule": report.schedule.name,
        }
        wanted = {
            "balance": self.balance,
            "chunks": self.chunks,
            "checkpoint": self.checkpoint,
            "schedule": self.schedule,
        }
        differ = [
            f"{k} {found[k]!r} (planned {wanted[k]!r})" for k in wanted if found[k] != wanted[k]
        ]
        if differ:
            raise ValueError(
                "the pipe's last step is not the plan's configuration: "
                + "; ".join(differ)
                + "; build it with plan.pipe() and step with schedule=plan.schedule"
            )
        predicted = tuple(s.activations for s in self.chosen.memory)
        measured = {p.partition: p.peak_activation_bytes for p in report.partitions}
        if isinstance(pipe, Pipe):
            return PlanCheck(
                self.predicted_seconds,
                report.call_duration,
                predicted,
                tuple(measured[j] for j in range(len(predicted))),
            )
        assert isinstance(report, DistributedStepReport), "a DistributedPipe reports its process"
        seconds, every = _from_every_process(
            pipe.group, report.call_duration, measured, len(predicted)
        )
        return PlanCheck(self.predicted_seconds, seconds, predicted, every)

    def __str__(self) -> str:
        each = "device" if self.processes is None else "process"
        head = ["", "schedule", "chunks", "checkpoint", "balance", "ms", f"peak per {each}", "why"]
        rows = [head, self._row("chosen", self.chosen, "fastest that fits")]
        rows += [self._row(str(k + 1), c, why) for k, (c, why) in enumerate(self.runner_ups)]
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
        each = "device" if self.processes is None else "process"
        limit = f"memory limit {_bytes(self.chosen.limit)} per {each}"
        factor = (
            f"pace in the pipeline {_paces_shown(self.paces)}"
            if self.paces
            else f"CPU contention {_by_chunks(self.contention)}"
        )
        overhead = f"{self.action_overhead * 1e6:.0f} us per action"
        parts = [limit, factor, overhead]
        if self.processes is not None:
            link = self.processes.link
            parts.append(
                f"{self.processes.count} processes, link {link.latency * 1e6:.0f} us + "
                f"{link.seconds_per_byte * 1e9:.3f} ns/B per message"
            )
            sharding = self.processes.sharding
            if sharding is not None:
                gather, reduce = sharding.collectives.gather, sharding.collectives.reduce
                parts.append(
                    f"stages sharded {sharding.shards} ways (FSDP2), all-gather "
                    f"{gather.latency * 1e6:.0f} us + {gather.seconds_per_byte * 1e9:.3f} ns/B, "
                    f"reduce-scatter {reduce.latency * 1e6:.0f} us + "
                    f"{reduce.seconds_per_byte * 1e9:.3f} ns/B per unit"
                )
        title = f"Plan ({', '.join(parts)})"
        return "\n".join([title, *(line.rstrip() for line in lines)])

    def __repr__(self) -> str:
        return f"Plan({self.chosen.describe()}, predicted {self.predicted_seconds * 1e3:.2f} ms)"

    @staticmethod
    def _row(label: str, c: Candidate, why: str) -> list[str]:
        memory = ", ".join(f"{d} {_bytes(b)}" for d, b in c.device_bytes.items())
        return [
            label,
            c.schedule,
            str(c.chunks),
            c.checkpoint,
            str(list(c.balance)),
            f"{c.seconds * 1e3:.2f}",
            memory,
            why,
        ]


def _by_chunks(contention: Mapping[int, Contention]) -> str:
    """``x1.20``, or ``x1.20 forward, x1.00 backward``, or one such per micro-batch count."""
    factors = set(contention.values()) or {NO_CONTENTION}
    if len(factors) == 1:
        return str(factors.pop())
    return "; ".join(f"{m} chunks {factor}" for m, factor in sorted(contention.items()))


def _paces_shown(paces: Mapping[tuple[str, int], Pace]) -> str:
    """``2 chunks x1.38 + 4.1 ms; ...; 2 chunks interleaved x1.52 + 4.1 ms``: 1F1B's
    (GPipe's too) by count, then each other schedule's."""
    ordered = sorted(paces.items(), key=lambda item: (item[0][0] != "1f1b", item[0]))
    return "; ".join(
        f"{m} chunks{'' if name == '1f1b' else ' ' + name} {pace}" for (name, m), pace in ordered
    )


def choose(
    model: nn.Sequential,
    found: list[Candidate],
    limit: int,
    contention: Mapping[int, Contention] | None = None,
    action_overhead: float = 0.0,
    processes: Processes | None = None,
    paces: Mapping[tuple[str, int], Pace] | None = None,
) -> Plan:
    """The plan of the fastest candidate that fits (the least memory among equals).

    Raises ``PlanError`` when none fits, naming the devices that overflow
    under the candidate that needs the least memory, and by how much.
    """
    if not found:
        raise PlanError(
            "no configuration can run: the interleaved schedule needs twice as many layers as "
            "devices and chunks that are multiples of the devices; add other schedules or chunks"
        )
    fitting = [c for c in found if c.fits]
    if not fitting:
        raise PlanError(_nothing_fits(found, limit))
    chosen = min(fitting, key=lambda c: (c.seconds, max(c.device_bytes.values())))
    return Plan(model, chosen, found, contention, action_overhead, processes, paces)


def _nothing_fits(found: list[Candidate], limit: int) -> str:
    """The message of ``PlanError``: the least-memory configuration, its overflowing devices."""
    cheapest = min(found, key=lambda c: max(c.overflow.values()))
    each = "process" if cheapest.places else "device"
    over = "; ".join(
        f"{d if cheapest.places else f'device {d}'} needs {_bytes(cheapest.device_bytes[d])}, "
        f"over by {_bytes(b)} ({b} bytes)"
        for d, b in cheapest.overflow.items()
    )
    terms = ", ".join(
        f"stage {j}: {_bytes(s.total)} (activations {_bytes(s.saved)}, inputs "
        f"{_bytes(s.inputs)}, mail {_bytes(s.mail)}, recorded for W {_bytes(s.recorded)}, "
        f"parameters {_bytes(s.parameters)}"
        + (f" and gathered {_bytes(s.gathered)}" if s.gathered else "")
        + f", gradients {_bytes(s.gradients)}, optimizer {_bytes(s.optimizer)})"
        for j, s in enumerate(cheapest.memory)
    )
    return (
        f"no configuration fits memory_limit={limit} bytes ({_bytes(limit)}) per {each}. The "
        f"one needing the least memory, {cheapest.describe()}: {over}. By stage: {terms}. "
        f"Raise the limit, add {'processes' if cheapest.places else 'devices'}, or try more "
        "micro-batches (chunks)"
    )


def _from_every_process(
    group: dist.ProcessGroup, seconds: float, activations: dict[int, int | None], stages: int
) -> tuple[float, tuple[int | None, ...]]:
    """The longest step time of the processes, and each stage's activations from its process.

    A collective: one row per process, its step time in nanoseconds, then a
    column per stage (-1: not its stage, -2: not measured).
    """
    row = [round(seconds * 1e9)]
    row += [-1 if j not in activations else _or(activations[j], -2) for j in range(stages)]
    rows = gather_rows(row, group)
    every: list[int | None] = []
    for j in range(1, stages + 1):
        found = [r[j] for r in rows if r[j] != -1]
        every.append(found[0] if found and found[0] >= 0 else None)
    return max(r[0] for r in rows) / 1e9, tuple(every)


def _or(value: int | None, instead: int) -> int:
    return instead if value is None else value
