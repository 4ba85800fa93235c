"""Chrome trace: a timeline as Chrome's trace event JSON, one row per partition.

chrome://tracing and https://ui.perfetto.dev open it. Every task is a
complete event (``"ph": "X"``) on the row (``tid``) of its partition, with
its micro-batch, partition, step and thread in ``args``; times are
microseconds since ``origin``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.trace.event import Event

__all__ = ["chrome_trace"]

_PID = 0


def chrome_trace(events: Sequence[Event], origin: float) -> dict[str, Any]:
    """The JSON object of a Chrome trace of ``events``.

    >>> trace = chrome_trace([Event("forward", 0, 1, 0, "t", 1.0, 1.5)], origin=1.0)
    >>> [(e["name"], e["tid"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    [('pipe.forward[mb=0,part=1]', 1, 500000.0)]
    """
    n = 1 + max((e.partition for e in events), default=-1)
    return {
        "traceEvents": _metadata(n) + [_complete_event(e, origin) for e in events],
        "displayTimeUnit": "ms",
    }


def _metadata(partitions: int) -> list[dict[str, Any]]:
    rows = [_metadata_event("process_name", 0, {"name": "pipeline"})]
    for j in range(partitions):
        rows.append(_metadata_event("thread_name", j, {"name": f"partition {j}"}))
        rows.append(_metadata_event("thread_sort_index", j, {"sort_index": j}))
    return rows


def _metadata_event(name: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": _PID, "tid": tid, "args": args}


def _complete_event(event: Event, origin: float) -> dict[str, Any]:
    return {
        "name": event.name,
        "cat": event.kind,
        "ph": "X",
        "ts": (event.start - origin) * 1e6,
        "dur": event.duration * 1e6,
        "pid": _PID,
        "tid": event.partition,
        "args": {
            "microbatch": event.microbatch,
            "partition": event.partition,
            "step": event.step,
            "thread": event.thread,
        },
    }
