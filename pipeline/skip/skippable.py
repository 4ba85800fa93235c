"""Skippable layers: generator forwards that stash tensors for later layers and pop them.

A skippable layer's ``forward`` is a generator. ``yield stash(name, tensor)``
hands ``tensor`` to the later layer that pops ``name``; ``x = yield
pop(name)`` takes it; the generator's return value is the layer's output::

    @skippable(stash=["skip"])
    class Down(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return self.pool(x)

    @skippable(pop=["skip"])
    class Up(nn.Module):
        def forward(self, x):
            skip = yield pop("skip")
            return self.up(x) + skip

The tensors wait in the tracker of ``current_tracker()``: the thread's own in
a plain run, one per micro-batch in a Pipe (see ``tracker.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar, cast

from torch import Tensor, nn
from typing_extensions import Self

from pipeline.skip.carrier import Carrier
from pipeline.skip.namespace import DEFAULT_NAMESPACE, Namespace
from pipeline.skip.tracker import SkipKey, current_tracker

__all__ = ["Pop", "Skippable", "Stash", "pop", "skippable", "stash"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class Stash:
    """The command ``yield stash(name, tensor)``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Any) -> None:
        self.name = name
        self.tensor = tensor


class Pop:
    """The command ``yield pop(name)``; the ``yield`` evaluates to the tensor."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def stash(name: str, tensor: Tensor) -> Stash:
    """Hand ``tensor`` to the later layer that pops ``name``: ``yield stash(name, tensor)``."""
    return Stash(name, tensor)


def pop(name: str) -> Pop:
    """Take the tensor an earlier layer stashed as ``name``: ``x = yield pop(name)``."""
    return Pop(name)


class Skippable(nn.Module):
    """The base that ``@skippable`` puts under a layer class.

    Its ``forward`` drives the class's generator forward: it takes the popped
    tensors from the tracker before the generator starts and gives the
    stashed ones to the tracker once it has returned, since a skip that
    leaves the partition hangs its ordering edges on the layer's input
    (pops) and output (stashes).
    """

    stashable_names: tuple[str, ...] = ()
    poppable_names: tuple[str, ...] = ()
    _generator_forward: Callable[..., Generator[Any, Any, Any]]

    def isolate(self, ns: Namespace, *, only: Iterable[str] | None = None) -> Self:
        """Put this layer's skip names (or those in ``only``) in namespace ``ns``.

        Returns the layer, so a block can be built and isolated in one go::

            ns = Namespace("level2")
            model = nn.Sequential(Down().isolate(ns), ..., Up().isolate(ns))
        """
        if not isinstance(ns, Namespace):
            raise TypeError(f"isolate() takes a Namespace, got {type(ns).__name__}")
        declared = self.stashable_names + self.poppable_names
        names = declared if only is None else _names("only", only)
        unknown = [n for n in names if n not in declared]
        if unknown:
            raise ValueError(
                f"{self._describe()} cannot isolate {unknown}: it declares only {list(declared)}"
            )
        self._namespaces().update(dict.fromkeys(names, ns))
        return self

    def namespaced(self, name: str) -> SkipKey:
        """The (namespace, name) key under which this layer stashes or pops ``name``."""
        return self._namespaces().get(name, DEFAULT_NAMESPACE), name

    def _namespaces(self) -> dict[str, Namespace]:
        # Kept in the instance's dict and made on first use, so that the
        # class's own __init__ runs untouched and may already call isolate().
        namespaces: dict[str, Namespace] = self.__dict__.setdefault("_skip_namespaces", {})
        return namespaces

    def stashable(self) -> list[SkipKey]:
        return [self.namespaced(name) for name in self.stashable_names]

    def poppable(self) -> list[SkipKey]:
        return [self.namespaced(name) for name in self.poppable_names]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tracker = current_tracker()
        layer = "layer " + type(self).__name__
        inputs = Carrier(_called_with(args), layer, "input")
        popped = {name: tracker.load(inputs, self.namespaced(name)) for name in self.poppable_names}
        if popped and args:
            args = (inputs.value,) if len(args) == 1 else tuple(inputs.value)

        stashed: dict[str, Tensor] = {}
        output = self._drive(self._generator_forward(*args, **kwargs), popped, stashed)
        self._check_declarations_kept(popped, stashed)

        outputs = Carrier(output, layer, "output")
        for name, tensor in stashed.items():
            tracker.save(outputs, self.namespaced(name), tensor)
        return outputs.value

    def _drive(
        self,
        generator: Generator[Any, Any, Any],
        popped: dict[str, Tensor],
        stashed: dict[str, Tensor],
    ) -> Any:
        """Run the generator to its return value, answering its commands."""
        reply = None
        while True:
            try:
                command = generator.send(reply)
            except StopIteration as stop:
                return stop.value
            try:
                reply = self._answer(command, popped, stashed)
            except BaseException:
                generator.close()
                raise

    def _answer(self, command: Any, popped: dict[str, Tensor], stashed: dict[str, Tensor]) -> Any:
        if isinstance(command, Stash):
            self._check_stash(command, stashed)
            stashed[command.name] = command.tensor
            return None
        if isinstance(command, Pop):
            self._check_pop(command, popped)
            return popped.pop(command.name)
        raise TypeError(
            f"{self._describe()} yielded {type(command).__name__}; a skippable forward yields "
            "only stash(name, tensor) or pop(name), and returns its output"
        )

    def _check_stash(self, command: Stash, stashed: dict[str, Tensor]) -> None:
        if command.name not in self.stashable_names:
            raise ValueError(
                f"{self._describe()} stashes {command.name!r}, which it does not declare; add it "
                "to @skippable(stash=[...])"
            )
        if not isinstance(command.tensor, Tensor):
            raise TypeError(
                f"{self._describe()} stashes {command.name!r} as {type(command.tensor).__name__}; "
                "only tensors can be stashed"
            )
        if command.name in stashed:
            raise RuntimeError(f"{self._describe()} stashes {command.name!r} twice in one call")

    def _check_pop(self, command: Pop, popped: dict[str, Tensor]) -> None:
        if command.name not in self.poppable_names:
            raise ValueError(
                f"{self._describe()} pops {command.name!r}, which it does not declare; add it "
                "to @skippable(pop=[...])"
            )
        if command.name not in popped:
            raise RuntimeError(f"{self._describe()} pops {command.name!r} twice in one call")

    def _check_declarations_kept(
        self, popped: dict[str, Tensor], stashed: dict[str, Tensor]
    ) -> None:
        # A declared skip left unused would leave its partner waiting: the
        # popping layer would find nothing, the stashed tensor would be lost.
        unstashed = [n for n in self.stashable_names if n not in stashed]
        if unstashed or popped:
            missing = [f"stash {n!r}" for n in unstashed] + [f"pop {n!r}" for n in popped]
            raise RuntimeError(
                f"{self._describe()} returned without doing what it declares: "
                f"{', '.join(missing)}; every call must stash and pop each declared name once"
            )

    def _describe(self) -> str:
        return (
            f"layer {type(self).__name__} (stash={list(self.stashable_names)}, "
            f"pop={list(self.poppable_names)})"
        )


def _called_with(args: tuple[Any, ...]) -> Any:
    """The value a layer was given, whose tensors a skip may hang its edges on.

    One argument is that value (a tuple in the ``'tuple'`` call style). A layer of a
    ``call_style='positional'`` pipe gets the previous layer's tuple spread into its
    arguments, and the first of them may hold no floating-point tensor (a size):
    the carrier is then found among them all, as in that tuple.
    """
    if not args:
        return None
    return args[0] if len(args) == 1 else args


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = ()
) -> Callable[[type[ModuleT]], type[ModuleT]]:
    """Make a layer class with a generator ``forward`` skippable.

    ``stash`` and ``pop`` declare the names the layer stashes and pops; every
    call must stash and pop each of them exactly once. The decorated class
    is a subclass of the original with the same name, parameters and
    ``state_dict`` keys, and it runs the same inside and outside a Pipe.
    """
    stash_names = _names("stash", stash)
    pop_names = _names("pop", pop)
    both = [n for n in stash_names if n in pop_names]
    if both:
        raise ValueError(f"{both} both stashed and popped by one layer; use two names")

    def decorate(cls: type[ModuleT]) -> type[ModuleT]:
        _check_decorated_class(cls)
        attributes = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "stashable_names": stash_names,
            "poppable_names": pop_names,
            "_generator_forward": cls.forward,
        }
        return cast(type[ModuleT], type(cls.__name__, (Skippable, cls), attributes))

    return decorate


def _check_decorated_class(cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"@skippable decorates an nn.Module class, got {cls!r}")
    if issubclass(cls, Skippable):
        raise TypeError(f"{cls.__name__} is already skippable; decorate it once")
    if not inspect.isgeneratorfunction(cls.forward):
        raise TypeError(
            f"{cls.__name__}.forward must be a generator (it yields stash(...) and pop(...) "
            "and returns the output)"
        )


def _names(argument: str, names: Iterable[str]) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(f"{argument} must be a list of names, got {names!r}")
    names = tuple(names)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(f"{argument} names must be non-empty strings, got {bad}")
    if len(set(names)) != len(names):
        raise ValueError(f"{argument} lists a name twice: {list(names)}")
    return names
