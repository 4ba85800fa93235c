"""Skip connections across partitions: a layer stashes a tensor, a later layer pops it.

See ``skippable.py`` for how a layer declares and uses skips,
``pipeline/clock/portal.py`` for how ``pipe(x)`` carries a skip across
partitions without passing it through those between, and ``docs/skip.md``
for the guide.
"""

from pipeline.skip.layout import Route, SkipLayout
from pipeline.skip.namespace import Namespace
from pipeline.skip.skippable import pop, skippable, stash
from pipeline.skip.tracker import discard_stashed
from pipeline.skip.verify import verify_skippables

__all__ = [
    "Namespace",
    "Route",
    "SkipLayout",
    "discard_stashed",
    "pop",
    "skippable",
    "stash",
    "verify_skippables",
]
