"""SVG: a traced step drawn as a picture, one row per partition, with no dependency.

Each task is a box placed by its measured start and end: forward, backward,
recompute, input-gradient and weight-gradient boxes in their own colours,
labelled with their micro-batch where they are wide enough; a wait for a
message is a grey band over the part of its action that waited. The time
axis is in milliseconds from the step's first task::

     partition 0  [F0][F1]~~~~[B0]   [B1]
     partition 1      [F0][B0][F1][B1]
                  0 ms          12.3 ms
"""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape

from pipeline.trace.event import Event, Kind

__all__ = ["COLOURS", "render_svg"]

COLOURS: dict[Kind, str] = {
    "forward": "#4c78a8",
    "backward": "#e45756",
    "recompute": "#b279a2",
    "input_grad": "#f58518",
    "weight_grad": "#54a24b",
    "copy": "#bab0ac",
    "wait": "#d0d0d0",
}
_LABEL_WIDTH = 90  # the partitions' names
_ROW = 28
_GAP = 6
_TOP = 34  # the title
_AXIS = 36  # ticks and the legend below the rows
_FONT = "font-family='sans-serif'"


def render_svg(events: Sequence[Event], title: str = "", width: int = 900) -> str:
    """``events`` as an SVG document; the time axis spans them all.

    >>> text = render_svg([Event("forward", 0, 0, 0, "t", 0.0, 0.001),
    ...                    Event("backward", 0, 1, 0, "t", 0.001, 0.003)], "1F1B")
    >>> text.count("<rect")  # the background, the two tasks, the legend's six colours
    9
    """
    if width < _LABEL_WIDTH + 100:
        raise ValueError(f"width must be at least {_LABEL_WIDTH + 100} pixels, got {width}")
    if not events:
        raise ValueError("no tasks to draw: trace a step first (with pipeline.trace() as t: ...)")
    origin = min(e.start for e in events)
    span = max(e.end for e in events) - origin or 1e-9
    scale = (width - _LABEL_WIDTH - 10) / span
    rows = 1 + max(e.partition for e in events)
    height = _TOP + rows * (_ROW + _GAP) + _AXIS + 16
    body = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}'>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
        f"<text x='4' y='20' {_FONT} font-size='13'>{escape(title)}</text>",
        f"<g {_FONT} font-size='11'>",
    ]
    for j in range(rows):
        y = _TOP + j * (_ROW + _GAP)
        body.append(f"<text x='4' y='{y + _ROW / 2 + 4}'>partition {j}</text>")
    waits = [e for e in events if e.kind == "wait"]
    boxes = sorted(events, key=lambda e: e.kind == "wait")  # waits drawn over their actions
    for e in boxes:
        if e.kind != "copy":
            body.append(_box(e, origin, scale, _computing_from(e, waits)))
    body.extend(_axis(span, scale, _TOP + rows * (_ROW + _GAP)))
    body.append("</g></svg>")
    return "\n".join(body)


def _computing_from(e: Event, waits: list[Event]) -> float:
    """When ``e`` starts computing: after the waits for its messages that open it."""
    inside = [w.end for w in waits if w.partition == e.partition and e.start <= w.start < e.end]
    return max([e.start, *inside])


def _box(e: Event, origin: float, scale: float, computing: float) -> str:
    x = _LABEL_WIDTH + (e.start - origin) * scale
    w = max(e.duration * scale, 0.5)
    y = _TOP + e.partition * (_ROW + _GAP)
    tip = f"<title>{e.name}: {e.duration * 1e3:.2f} ms</title>"
    shape = (
        f"<rect x='{x:.2f}' y='{y}' width='{w:.2f}' height='{_ROW}' "
        f"fill='{COLOURS[e.kind]}' stroke='white' stroke-width='0.5'>{tip}</rect>"
    )
    # The label goes on the part that computes, which no wait covers.
    left = _LABEL_WIDTH + (computing - origin) * scale
    if e.kind == "wait" or x + w - left < 14:
        return shape
    middle = f"x='{(left + x + w) / 2:.2f}' y='{y + _ROW / 2 + 4}' text-anchor='middle'"
    return shape + f"<text {middle} fill='white'>{e.microbatch}</text>"


def _axis(span: float, scale: float, y: float) -> list[str]:
    """Ticks in milliseconds, then the colours' legend."""
    parts = []
    ticks = 5
    for k in range(ticks + 1):
        x = _LABEL_WIDTH + k * span / ticks * scale
        parts.append(f"<line x1='{x:.2f}' y1='{y}' x2='{x:.2f}' y2='{y + 5}' stroke='black'/>")
        ms = k * span / ticks * 1e3
        parts.append(f"<text x='{x:.2f}' y='{y + 17}' text-anchor='middle'>{ms:.1f} ms</text>")
    x = float(_LABEL_WIDTH)
    for kind, colour in COLOURS.items():
        if kind == "copy":
            continue
        parts.append(
            f"<rect x='{x:.0f}' y='{y + 24}' width='10' height='10' fill='{colour}'/>"
            f"<text x='{x + 14:.0f}' y='{y + 33}'>{kind.replace('_', ' ')}</text>"
        )
        x += 100
    return parts
