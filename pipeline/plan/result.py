"""``Plan``: what the planner chose and why, the Pipe it builds, and its check against a step.

``str(plan)`` is a table: the chosen configuration, then the runner-ups,
each with why it lost (slower, or over the limit on a device, by how
much). ``plan.pipe()`` builds the chosen Pipe; ``plan.check(pipe)`` puts the
prediction beside ``pipe.last_step`` (measured with ``measure_memory=True``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pipeline.pipe import Pipe
from pipeline.plan.search import Candidate
from pipeline.step.reports import _bytes

__all__ = ["Plan", "PlanCheck", "PlanError", "choose"]

RUNNER_UPS = 8


class PlanError(ValueError):
    """No configuration fits the memory limit (the message names the device and the overflow)."""


@dataclass(frozen=True)
class PlanCheck:
    """Predicted against measured: the step's seconds, each stage's peak saved bytes.

    ``measured_activations[j]`` is ``pipe.last_step``'s
    ``peak_activation_bytes`` of stage ``j`` (None if the step did not
    measure memory); errors are measured / predicted - 1.
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
    candidates, each with why it lost), ``contention`` (how much slower a
    CPU stage was taken to run beside the others) and ``action_overhead``
    (the seconds added per action).
    """

    def __init__(
        self,
        model: nn.Sequential,
        chosen: Candidate,
        others: list[Candidate],
        contention: float = 1.0,
        action_overhead: float = 0.0,
    ) -> None:
        self.model = model
        self.chosen = chosen
        self.candidates = others
        self.contention = contention
        self.action_overhead = action_overhead

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
        return Pipe(
            self.model,
            self.balance,
            devices=self.devices,
            chunks=self.chunks,
            checkpoint=self.checkpoint,  # type: ignore[arg-type]
        )

    def check(self, pipe: Pipe) -> PlanCheck:
        """The prediction beside ``pipe.last_step``: run ``step(..., measure_memory=True)`` first.

        Refuses a pipe or a step that is not the plan's (another balance,
        chunks, checkpoint mode or schedule), saying which differs.
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
        return PlanCheck(
            self.predicted_seconds,
            report.duration,
            tuple(s.activations for s in self.chosen.memory),
            tuple(p.peak_activation_bytes for p in report.partitions),
        )

    def __str__(self) -> str:
        head = ["", "schedule", "chunks", "checkpoint", "balance", "ms", "peak per device", "why"]
        rows = [head, self._row("chosen", self.chosen, "fastest that fits")]
        rows += [self._row(str(k + 1), c, why) for k, (c, why) in enumerate(self.runner_ups)]
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
        limit = f"memory limit {_bytes(self.chosen.limit)} per device"
        factor = f"CPU contention x{self.contention:.2f}"
        overhead = f"{self.action_overhead * 1e6:.0f} us per action"
        title = f"Plan ({limit}, {factor}, {overhead})"
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


def choose(
    model: nn.Sequential,
    found: list[Candidate],
    limit: int,
    contention: float = 1.0,
    action_overhead: float = 0.0,
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
    return Plan(model, chosen, found, contention, action_overhead)


def _nothing_fits(found: list[Candidate], limit: int) -> str:
    """The message of ``PlanError``: the least-memory configuration, its overflowing devices."""
    cheapest = min(found, key=lambda c: max(c.overflow.values()))
    over = "; ".join(
        f"device {d} needs {_bytes(cheapest.device_bytes[d])}, over by {_bytes(b)} ({b} bytes)"
        for d, b in cheapest.overflow.items()
    )
    terms = ", ".join(
        f"stage {j}: {_bytes(s.total)} (activations {_bytes(s.saved)}, inputs "
        f"{_bytes(s.inputs)}, mail {_bytes(s.mail)}, recorded for W {_bytes(s.recorded)}, "
        f"parameters {_bytes(s.parameters)}, gradients "
        f"{_bytes(s.gradients)}, optimizer {_bytes(s.optimizer)})"
        for j, s in enumerate(cheapest.memory)
    )
    return (
        f"no configuration fits memory_limit={limit} bytes ({_bytes(limit)}) per device. The "
        f"one needing the least memory, {cheapest.describe()}: {over}. By stage: {terms}. "
        "Raise the limit, add devices, or try more micro-batches (chunks)"
    )
