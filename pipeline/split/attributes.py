"""Attributes: the Python attributes of modules that the captured code reads and assigns.

torch.export makes a constant of every Python value the model's code reads
(``self.temperature``, ``nn.Dropout.p``, ``LayerNorm.eps``): the pieces run
that code's torch ops with the value of split time. And an assignment
(``self.ema = self.ema * 0.9 + ...``, ``self.steps += 1`` on an int) is not
an op at all: the pieces would never make it. So while a model is captured,
every read and every assignment of a module attribute by the captured code
is recorded here:

- a read of a value (``None``, numbers, strings, dtypes, containers of them)
  or of a tensor that is neither parameter nor buffer, as ``Read``: the
  split model compares it with the module's attribute at every call
  (``watch.py``) and refuses a call after a change;
- an assignment or deletion, as ``Write`` with the line that made it:
  ``split`` refuses it before any piece exists; an attribute other than a
  parameter or buffer is put back (torch.export puts those back).

The same holds for the attributes of the objects that modules hold and
the captured code reads (transformers' ``config``: ``self.config.
output_hidden_states``): while a capture runs, the class of each such object
records the reads of the capturing thread too, and the split model checks
them at every call, by their path (``config.output_hidden_states``).

Blocks run as themselves, so what their own code reads and assigns is
followed as in eager mode: their fake runs at capture are not recorded
(``paused``), but what they assign is put back all the same (a cache a
block makes at its first call would otherwise stay on the model, fake).
Recording swaps ``nn.Module.__getattribute__``, ``__setattr__`` and
``__delattr__`` while any capture runs; only the capturing thread records,
and only for the model's modules.
"""

from __future__ import annotations

import copy
import enum
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.split.where import frame_location

__all__ = [
    "MISSING",
    "Read",
    "Recorded",
    "Write",
    "differs",
    "held_changes",
    "is_value",
    "paused",
    "recording",
]

# What ``nn.Module`` itself keeps: the mode (followed by pieces), hooks (checked apart), internals.
_INTERNAL = frozenset(vars(nn.Module)) | frozenset(vars(nn.Module()))
_VALUES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
_CONTAINERS = (tuple, list, dict, set, frozenset)
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE
_LIBRARIES = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)


class _Missing:
    """An attribute that is not there (deleted since the split)."""

    def __repr__(self) -> str:
        return "<missing>"

    def __reduce__(self) -> str:
        return "MISSING"


MISSING = _Missing()


@dataclass(frozen=True)
class Read:
    """An attribute the captured code read: its value then (a tensor is compared by identity).

    ``owner``: a module, or an object a module holds (``Recorded.held``).
    """

    owner: Any
    attribute: str
    value: Any


@dataclass(frozen=True)
class Write:
    """An assignment (or deletion) of an attribute by the captured code, and where it was made."""

    module: nn.Module
    attribute: str
    location: str


@dataclass
class Recorded:
    """What the captured code of one split read and assigned, first occurrence each."""

    modules: dict[nn.Module, str]
    reads: dict[tuple[int, str], Read] = field(default_factory=dict)
    writes: list[Write] = field(default_factory=list)
    # The value each written attribute had before its first write, to put back.
    before: dict[tuple[int, str], tuple[nn.Module, Any]] = field(default_factory=dict)
    # The objects held by the modules whose attributes the code read, by id: their path.
    held: dict[int, str] = field(default_factory=dict)
    # Their classes, recording reads until the capture ends.
    classes: list[type] = field(default_factory=list)


def is_value(value: Any) -> bool:
    """Whether ``value`` is one that torch.export makes a constant of (containers too)."""
    if isinstance(value, _VALUES):
        return True
    if isinstance(value, dict):
        return all(is_value(key) and is_value(item) for key, item in value.items())
    return isinstance(value, _CONTAINERS) and all(is_value(item) for item in value)


class _State(threading.local):
    recorded: Recorded | None = None
    paused: int = 0


_state = _State()
_installed = 0
_install_lock = threading.Lock()
_set_attribute = nn.Module.__setattr__
_delete_attribute = nn.Module.__delattr__


@contextmanager
def recording(modules: dict[nn.Module, str]) -> Iterator[Recorded]:
    """Record what the code run on this thread reads from and assigns to ``modules``.

    Written attributes are put back to their values before the first write
    on leaving: the capture must not change the model.
    """
    recorded = Recorded(modules)
    registered = {module: _registered_names(module) for module in modules}
    _install(+1)
    _state.recorded = recorded
    try:
        yield recorded
    finally:
        _state.recorded = None
        _install(-1)
        for kind in recorded.classes:
            _unwatch_class(kind)
        for (_, attribute), (module, value) in recorded.before.items():
            _restore(module, attribute, value)
        for read, _ in held_changes(recorded):
            setattr(read.owner, read.attribute, read.value)
        for module, names in registered.items():
            _unregister_new(module, names)


_REGISTRIES = ("_parameters", "_buffers", "_modules")


def _registered_names(module: nn.Module) -> tuple[set[str], ...]:
    """The names in ``module``'s parameters, buffers and submodules."""
    held = object.__getattribute__(module, "__dict__")
    return tuple(set(held[registry]) for registry in _REGISTRIES)


def _unregister_new(module: nn.Module, before: tuple[set[str], ...]) -> None:
    """Drop what the capture registered on ``module`` (``register_buffer`` at a block's first
    call, in its fake run: the model would keep a fake tensor)."""
    held = object.__getattribute__(module, "__dict__")
    for registry, names in zip(_REGISTRIES, before, strict=True):
        for name in set(held[registry]) - names:
            del held[registry][name]
            held.get("_non_persistent_buffers_set", set()).discard(name)


def differs(value: Any, now: Any) -> bool:
    """Whether ``now`` is not what a read recorded as ``value`` (a tensor: not the same one)."""
    return now is not value and (
        isinstance(value, Tensor) or type(now) is not type(value) or now != value
    )


def held_changes(recorded: Recorded) -> list[tuple[Read, Any]]:
    """The attributes of held objects (a config) that differ from their first read, with
    their values now: the captured code assigned them (assignments of module attributes
    are recorded as ``Write``)."""
    return [
        (read, now)
        for read in recorded.reads.values()
        if not isinstance(read.owner, nn.Module)
        and differs(read.value, now := getattr(read.owner, read.attribute, MISSING))
    ]


@contextmanager
def paused() -> Iterator[None]:
    """Nothing read or assigned inside is recorded (a block's own code, which runs as itself)."""
    _state.paused += 1
    try:
        yield
    finally:
        _state.paused -= 1


def _install(change: int) -> None:
    global _installed
    with _install_lock:
        _installed += change
        if _installed == 1 and change > 0:
            nn.Module.__getattribute__ = _get  # type: ignore[method-assign,assignment]
            nn.Module.__setattr__ = _set  # type: ignore[method-assign,assignment]
            nn.Module.__delattr__ = _delete  # type: ignore[method-assign]
        elif _installed == 0:
            del nn.Module.__getattribute__
            nn.Module.__setattr__ = _set_attribute  # type: ignore[method-assign]
            nn.Module.__delattr__ = _delete_attribute  # type: ignore[method-assign]


def _recorder(module: nn.Module, attribute: str) -> Recorded | None:
    recorded = _state.recorded
    if recorded is None or _state.paused or attribute in _INTERNAL:
        return None
    return recorded if module in recorded.modules else None


def _get(module: nn.Module, attribute: str) -> Any:
    value = object.__getattribute__(module, attribute)
    recorded = _recorder(module, attribute)
    if recorded is not None and (id(module), attribute) not in recorded.reads:
        name = recorded.modules[module]
        _note_read(recorded, module, attribute, value, f"{name}.{attribute}" if name else attribute)
    return value


def _note_read(recorded: Recorded, owner: Any, attribute: str, value: Any, path: str) -> None:
    """Record a read of ``owner.attribute`` (at ``path`` from the model) of ``value``."""
    if _holdable(value):
        _hold(recorded, value, path)
        return
    kept = _kept(owner, attribute, value)
    if kept is not MISSING:
        recorded.reads[id(owner), attribute] = Read(owner, attribute, kept)


def _holdable(value: Any) -> bool:
    """An object whose attributes are followed: neither value, module, tensor, type nor callable."""
    return (
        hasattr(value, "__dict__")
        and not callable(value)
        and not isinstance(value, nn.Module | Tensor | type | types.ModuleType)
        and not is_value(value)
        and bool(type(value).__flags__ & _HEAP_TYPE)  # a class of Python code, which can record
    )


def _hold(recorded: Recorded, value: Any, path: str) -> None:
    """Follow the reads of ``value``'s attributes, named by its shortest path."""
    known = recorded.held.get(id(value))
    if known is None or len(path) < len(known):
        recorded.held[id(value)] = path
    if known is None and type(value) not in recorded.classes:
        _watch_class(type(value))
        recorded.classes.append(type(value))


def _held_read(held: Any, attribute: str, value: Any) -> None:
    recorded = _state.recorded
    if recorded is None or _state.paused or attribute.startswith("__"):
        return
    path = recorded.held.get(id(held))
    if path is not None and (id(held), attribute) not in recorded.reads:
        _note_read(recorded, held, attribute, value, f"{path}.{attribute}")


# Each class made to record, with how many captures need it and its own __getattribute__.
_watched: dict[type, tuple[int, Callable[..., Any] | None]] = {}


def _watch_class(kind: type) -> None:
    with _install_lock:
        count, own = _watched.get(kind, (0, kind.__dict__.get("__getattribute__")))
        if count == 0:
            original: Callable[[Any, str], Any] = kind.__getattribute__  # type: ignore[assignment]

            def get(held: Any, attribute: str) -> Any:
                value = original(held, attribute)
                _held_read(held, attribute, value)
                return value

            kind.__getattribute__ = get  # type: ignore[method-assign,assignment]
        _watched[kind] = (count + 1, own)


def _unwatch_class(kind: type) -> None:
    with _install_lock:
        count, own = _watched.pop(kind)
        if count > 1:
            _watched[kind] = (count - 1, own)
        elif own is None:
            del kind.__getattribute__
        else:
            kind.__getattribute__ = own  # type: ignore[method-assign]


def _kept(owner: Any, attribute: str, value: Any) -> Any:
    """What to compare later: a copy of a value, a plain tensor itself; else ``MISSING``."""
    if isinstance(value, Tensor):
        # Parameters and buffers are read from their modules at every call already.
        return value if attribute in object.__getattribute__(owner, "__dict__") else MISSING
    return copy.deepcopy(value) if is_value(value) else MISSING


def _set(module: nn.Module, attribute: str, value: Any) -> None:
    _note_write(module, attribute, value)
    _set_attribute(module, attribute, value)


def _delete(module: nn.Module, attribute: str) -> None:
    _note_write(module, attribute, MISSING)
    _delete_attribute(module, attribute)


def _note_write(module: nn.Module, attribute: str, value: Any) -> None:
    recorded = _state.recorded
    if recorded is None or attribute in _INTERNAL or module not in recorded.modules:
        return
    caller = sys._getframe(2)
    if caller.f_code.co_filename.startswith(_LIBRARIES):
        return
    before = getattr(module, attribute, MISSING)
    if value is before:
        return  # ``self.calls += 1`` on a tensor: changed in place (checks.py), bound again
    if not _state.paused:  # a block's own code assigns as it would in eager mode
        recorded.writes.append(Write(module, attribute, frame_location(caller)))
    key = (id(module), attribute)
    # torch.export puts parameters and buffers back itself (they are fake while it traces);
    # a block's fake run made any other tensor it assigned fake (a cache made at its first
    # call): the model keeps none of them.
    if key not in recorded.before and not _registered(module, attribute, before):
        recorded.before[key] = (module, before)


def _registered(module: nn.Module, attribute: str, before: Any) -> bool:
    """Whether ``attribute`` of ``module`` is a parameter or a buffer (``before``: its value)."""
    if not isinstance(before, Tensor):
        return False
    held = object.__getattribute__(module, "__dict__")
    return attribute in held["_parameters"] or attribute in held["_buffers"]


def _restore(module: nn.Module, attribute: str, value: Any) -> None:
    if value is MISSING:
        if hasattr(module, attribute):
            _delete_attribute(module, attribute)
    else:
        _set_attribute(module, attribute, value)
