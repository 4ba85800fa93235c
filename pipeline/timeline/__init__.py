"""The parts of a pipeline timeline: events, backward hooks, and the reports made from them.

``pipeline.trace`` records; the modules here hold what it records (``event``),
how the backward pass of a task is timed (``backward``) and what is made of a
recording: a Chrome trace (``chrome``), a summary of busy and idle time
(``summary``) and a text Gantt chart (``gantt``).
"""
