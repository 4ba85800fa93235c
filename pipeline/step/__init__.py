"""The engine of ``Pipe.step`` and ``DistributedPipe.step``: a schedule's actions, forward and
backward, run by workers.

``actions.py`` and ``schedules.py`` say what each worker runs, ``simulate.py`` checks it first,
``runner.py`` runs it, ``stage.py`` is one stage's actions, ``mail.py`` carries values between
stages, ``backward_in_two.py`` splits a backward in two, ``reports.py`` says what a step ran. No
imports here: import the module you mean.
"""
