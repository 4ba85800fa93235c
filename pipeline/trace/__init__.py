"""Timeline traces: which task ran on which partition and when, and the reports made from them.

``pipeline.trace()`` (``recording.py``) records the tasks that both engines
report; ``event.py`` holds what it records, ``backward.py`` how a task's
backward is timed, and ``chrome.py``, ``summary.py`` and ``gantt.py`` what
is made of a recording: a Chrome trace, busy and idle time, a text Gantt chart.
``profiling.py`` holds ``pipeline.profile()``: torch's profiler, the workers recorded too.
"""

from pipeline.trace.profiling import profile
from pipeline.trace.recording import Trace, begin_explicit_step, span, trace, traced

__all__ = ["Trace", "begin_explicit_step", "profile", "span", "trace", "traced"]
