"""Checkpoints on torch.distributed.checkpoint (DCP), under the plain model's names.

``save_checkpoint`` writes a model's and its optimizer's state, and
``load_checkpoint`` reads them into another layout: the plain model, a
``Pipe``, a ``DistributedPipe`` of any balance or number of processes, any of
them wrapped in ``pipeline.DataParallel`` (a pp x dp grid) or torch's DDP::

    save_checkpoint("ckpt/step-1000", pipe, optimizer)  # every process of the job
    load_checkpoint("ckpt/step-1000", model, optimizer)  # in any other layout

Loads are strict, as torch's ``load_state_dict``: what a load refuses, on
every process and before reading anything, is in ``checkpoint_checks.py``.

Each process writes the keys of the parameters it holds; the optimizer's state
is flattened, keyed per parameter (``optim.state.<name>.exp_avg``,
``optim.param_groups.<name>.lr``), so that any layout reads the keys of its
own parameters. torch's own calls (``get_state_dict``, ``dcp.save``,
``dcp.load``, ``set_state_dict``) go wrong here in five ways, which these
functions avoid:

- With the default options the optimizer's param groups are keyed by their
  index: every process writes ``optim.param_groups.0.lr`` for its own
  parameters, DCP keeps one process's copy, and the others load a group
  without ``lr`` or ``betas`` (``KeyError: 'betas'`` at the next step).
  Flattened, every key belongs to one parameter.
- ``DataParallel`` and DDP prefix every name with ``module.``: unwrapped here.
- A tied parameter has several names (an embedding and the output head), and
  torch keys its optimizer state under the first one its module lists, which
  depends on the layout. Here every name is written, and a layout reads the
  first of the plain model's names that the checkpoint has: the same key on
  every process holding the parameter, so that their copies stay equal.
- An optimizer that has not stepped yet gets state from torch's calls by a
  zero-lr step: when saving, the live optimizer then counts one step too
  many and trains differently; when loading into one whose parameters hold a
  ``.grad``, the step is skipped and no state is loaded at all. Here saving
  leaves the optimizer as it was (the checkpoint holds no state for it), and
  loading always reads the checkpoint's state.
- A stage process without state (a ``Tanh`` alone) is refused, and a param
  group without parameters (the biases' group of a process holding a
  bias-free head alone) fails the load: here the one has nothing to save or
  load, the other keeps its settings.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
import torch.optim.optimizer as optimizers
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel

from pipeline.data_parallel.wrapper import DataParallel
from pipeline.distributed.checkpoint_checks import (
    check_before_loading,
    check_everywhere,
    check_extra_alike,
    check_shards_within,
    optimizer_outside,
)
from pipeline.distributed.pipe import DistributedPipe

__all__ = ["load_checkpoint", "save_checkpoint"]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# The sections of a flattened optimizer state: "state.<name>.<field>",
# "param_groups.<name>.<field>".
_STATE, _GROUPS = "state.", "param_groups."


def save_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Save ``module``'s state (and ``optimizer``'s) in the directory ``path``, with DCP.

    Collective: every process of ``process_group`` (default: the whole job;
    one process when torch.distributed is not initialized) calls it, each
    with its own part (every replica of a grid too: DCP writes one copy of
    what replicas hold alike). ``module`` is the plain model, a ``Pipe``, a
    ``DistributedPipe``, or one of them in ``DataParallel`` or DDP; the keys
    are the plain model's. ``extra``'s entries are saved beside them, under
    their names: what DCP saves (tensors, plain values, objects with
    ``state_dict`` and ``load_state_dict`` such as an LR scheduler)::

        save_checkpoint(f"ckpt/{step}", pipe, optimizer, extra={"scheduler": scheduler})
    """
    holder = _unwrapped(module)
    group = process_group if process_group is not None or not _distributed() else dist.group.WORLD
    check_everywhere("save_checkpoint", optimizer_outside(holder, optimizer), group, ValueError)
    if isinstance(module, DataParallel) and process_group is None:
        module.share_rank0_buffers()  # DCP writes one replica's, whichever
    names = _Names(holder)
    model_state = _model_state(holder)
    check_shards_within(model_state, process_group, "save_checkpoint")
    state: dict[str, Any] = {"model": names.every_name(model_state)}
    if optimizer is not None:
        state["optim"] = names.every_name(_optimizer_state(holder, optimizer))
    state.update(_extra(extra))
    check_extra_alike(extra or {}, group)
    with _single_process_quietly():
        save(state, checkpoint_id=path, process_group=process_group)


def load_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: MutableMapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
) -> None:
    """Load what ``save_checkpoint`` saved in ``path`` into ``module`` (and ``optimizer``).

    Collective, like ``save_checkpoint``; the layout may differ from the
    saving one (another balance, number of processes or replicas, a ``Pipe``,
    the plain model). The optimizer's state and its param groups' settings
    (``lr``, ``betas``, ...) become the checkpoint's: a parameter without
    state there has none after the load. ``.grad`` is left as it is.
    ``extra``'s entries are loaded by name: tensors and objects with
    ``load_state_dict`` in place, other values replaced in ``extra``.

    Strict, as torch's ``load_state_dict``: a key some process needs and the
    checkpoint lacks, a tensor whose shape differs from the saved one, and a
    saved key of the model's (or, given an optimizer, the optimizer's) state
    that no process of the load asks for are refused together, on every
    process, by a ``RuntimeError`` naming them, before anything is read: the
    model and the optimizer are left as they were. So is an optimizer whose
    param groups hold together parameters the checkpoint gives different
    settings (their settings are read first). ``strict=False`` loads
    what the model has and leaves the checkpoint's other keys unread: then
    nothing is checked for keys the model lacks (missing keys and shapes
    still are). ``extra``'s entries are loaded by name; other entries of the
    checkpoint are not checked.
    """
    holder = _unwrapped(module)
    group = process_group if process_group is not None or not _distributed() else dist.group.WORLD
    called = f"load_checkpoint({os.fspath(path)!r})"
    problem, metadata = optimizer_outside(holder, optimizer), {}
    try:
        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as error:  # on this process alone (a path it does not see)
        problem = problem or f"{_failed_here(error, group)} (its metadata)"
    check_everywhere(called, problem, group, RuntimeError, _REFUSED)
    names = _Names(holder)
    stored = set(metadata)
    model_target = _model_state(holder)
    check_shards_within(model_target, process_group, "load_checkpoint")
    model = _Reading("model.", model_target, names, stored)
    state: dict[str, Any] = {"model": model.asked}
    covered = names.covered("model.", model_target)
    target = None if optimizer is None else _OptimizerTarget(holder, optimizer, names, stored)
    if target is not None:
        state["optim"] = target.reading.asked
        covered |= target.covered
    asked = {f"{section}.{key}": v for section in state for key, v in state[section].items()}
    state.update(_extra(extra))
    try:
        check_before_loading(path, metadata, asked, covered, target is not None, strict, group)
        if target is not None:
            unlike = target.groups_unlike(path, process_group)
            check_everywhere(called, unlike, group, RuntimeError, _REFUSED)
        with _single_process_quietly():
            try:
                load(state, checkpoint_id=path, process_group=process_group)
            except BaseException as error:
                # An extra entry's load_state_dict, say, on this process alone: it raises its
                # own error, the others one naming it.
                with contextlib.suppress(RuntimeError):
                    check_everywhere(called, _failed_here(error, group), group, RuntimeError)
                raise
        check_everywhere(called, "", group, RuntimeError, _HALF_READ)
    except BaseException:
        if target is not None:
            target.undo()
        raise
    if model.asked:  # torch's call refuses a module without state
        set_model_state_dict(holder, model.loaded())
    if target is not None:
        target.load()
    if extra is not None:
        # DCP loads a value that is neither a tensor nor Stateful by replacing it.
        extra.update({k: state[k] for k, v in extra.items() if not isinstance(v, Stateful)})


_REFUSED = "refused, nothing was loaded"
_HALF_READ = (
    "failed on another process, after the weights here were read (the optimizer's state was "
    "left as it was): load again"
)


def _failed_here(error: BaseException, group: dist.ProcessGroup | None) -> str:
    who = "this process" if group is None else f"rank {dist.get_rank(group)}"
    return f"{who} failed reading it: {type(error).__name__}: {error}"


def _extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra``'s entries, saved beside the model's and the optimizer's state."""
    taken = sorted({"model", "optim"}.intersection(extra or {}))
    if taken:
        raise ValueError(
            f"extra must not use the names {taken}: they hold the model's and the optimizer's "
            "state; give its entries other names"
        )
    return dict(extra or {})


def _unwrapped(module: nn.Module) -> nn.Module:
    """The model inside ``DataParallel`` or DDP (whose ``module.`` the plain model's names lack)."""
    while isinstance(module, (DataParallel, DistributedDataParallel)):
        module = module.module
    return module


class _Names:
    """Every name the plain model gives each parameter of a module (several when tied).

    In the plain model's order, which every layout keeps: the same on every
    process, so that all holders of a tied parameter read the same key.
    """

    def __init__(self, module: nn.Module) -> None:
        by_object: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            by_object.setdefault(id(param), []).append(name)
        groups = [tuple(names) for names in by_object.values()]
        if isinstance(module, DistributedPipe):
            # A weight tied across processes has names in the others' stages too.
            tied = {name: names for names in module._tied_names() for name in names}
            groups = [tied.get(group[0], group) for group in groups]
        self.known = {name for group in groups for name in group}
        self.aliases = {name: group for group in groups if len(group) > 1 for name in group}

    def parameter_of(self, key: str, section: str) -> str | None:
        """The parameter name in ``key`` of ``section`` (``"state.3.weight.step"``: ``"3.weight"``).

        The longest name that ``key`` continues with a dot: nested optimizer
        state has dots after the name too.
        """
        if not key.startswith(section):
            return None
        parts = key[len(section) :].split(".")
        prefixes = (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1))
        return next((name for name in prefixes if name in self.known), None)

    def keys(self, key: str) -> tuple[str, ...]:
        """``key`` under every name of its parameter, in order (``(key,)`` if it has one)."""
        if key in self.aliases:
            return self.aliases[key]
        for section in (_STATE, _GROUPS):
            name = self.parameter_of(key, section)
            if name is not None and name in self.aliases:
                field = key[len(section) + len(name) :]
                return tuple(f"{section}{alias}{field}" for alias in self.aliases[name])
        return (key,)

    def every_name(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` with each tied parameter's entries under all of its names."""
        return {alias: value for key, value in state.items() for alias in self.keys(key)}

    def covered(self, section: str, target: Mapping[str, Any]) -> set[str]:
        """The keys of ``target`` under every name of their parameters, as stored (``section``)."""
        return {section + alias for alias in self.every_name(target)}

    def without_state(self, target: Mapping[str, Any], stored: set[str]) -> set[str]:
        """The parameters in ``target`` (flattened) without optimizer state in the checkpoint."""
        saved = {self.parameter_of(key, "optim." + _STATE) for key in stored}
        return {
            name
            for key in target
            if (name := self.parameter_of(key, _STATE)) is not None
            and not any(alias in saved for alias in self.aliases.get(name, (name,)))
        }


class _Reading:
    """The keys to read for a target state: each under the first of its names the checkpoint has.

    Every key is asked once, so that two names of one parameter held here
    read the same value; a key the checkpoint lacks is asked under its own
    name, for DCP to refuse it naming it.
    """

    def __init__(
        self, section: str, target: Mapping[str, Any], names: _Names, stored: set[str]
    ) -> None:
        self.asked: dict[str, Any] = {}
        self._source: dict[str, str] = {}
        for key, value in target.items():
            found = next((k for k in names.keys(key) if section + k in stored), key)
            self.asked.setdefault(found, value)
            self._source[key] = found

    def loaded(self) -> dict[str, Any]:
        """The target's keys with what DCP read (into the tensors, or in place of other values)."""
        return self.found(self.asked)

    def found(self, read: Mapping[str, Any]) -> dict[str, Any]:
        """The target's keys with what ``read`` (some of the asked keys, read) holds for them."""
        return {key: read[found] for key, found in self._source.items() if found in read}


def _model_state(module: nn.Module) -> dict[str, Any]:
    """``module``'s state by torch's call, which refuses a module without any.

    A stage process whose layers hold no parameter or buffer (a ``Tanh``
    alone) has none to save or load.
    """
    return get_model_state_dict(module) if module.state_dict() else {}


def _holds_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any param group of ``optimizer`` has a parameter (torch's calls refuse none)."""
    return any(group["params"] for group in optimizer.param_groups)


def _optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's flattened state to save, the optimizer left as it was.

    torch gives an optimizer without state some by a zero-lr step (when no
    parameter has a ``.grad``); it is dropped again, from the optimizer and
    from what is saved.
    """
    if not _holds_parameters(optimizer):
        return {}
    fresh = not optimizer.state
    with _step_hooks_quiet(optimizer):
        state = get_optimizer_state_dict(module, optimizer, options=_FLAT)
    if fresh:
        optimizer.state.clear()
        state = {k: v for k, v in state.items() if not k.startswith(_STATE)}
    return state


class _OptimizerTarget:
    """An optimizer made ready to load: its flattened state, with a tensor for DCP to read into.

    The old state is set aside (put back by ``undo``) and torch gives every
    parameter fresh state by a zero-lr step, which it skips when a parameter
    has a ``.grad``: they are set aside around it. A parameter that has no
    state in the checkpoint is not read, and has none after the load.
    """

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, names: _Names, stored: set[str]
    ) -> None:
        self._module, self._optimizer = module, optimizer
        # Set aside, not copied: a refused load puts the very same state back.
        self._before = optimizer.state
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        # torch's step gives no state to a frozen parameter, whose saved state (trained,
        # then frozen) would be taken for another optimizer's: trained around torch's calls.
        self._frozen = [p for p in params if not p.requires_grad and p.dtype.is_floating_point]
        optimizer.state = defaultdict(dict)
        for param in params:
            param.grad = None
        try:
            with _step_hooks_quiet(optimizer), _trained(self._frozen):
                self._target = (
                    get_optimizer_state_dict(module, optimizer, options=_FLAT)
                    if _holds_parameters(optimizer)
                    else {}
                )
        except BaseException:
            optimizer.state = self._before  # a target that could not be made changes nothing
            raise
        finally:
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
        self._stateless = names.without_state(self._target, stored)
        wanted = {
            key: value
            for key, value in self._target.items()
            if names.parameter_of(key, _STATE) not in self._stateless
        }
        self.reading = _Reading("optim.", wanted, names, stored)
        self.covered = names.covered("optim.", self._target)

    def groups_unlike(
        self, path: str | os.PathLike[str], process_group: dist.ProcessGroup | None
    ) -> str:
        """Where the checkpoint gives the parameters of one of the optimizer's param groups
        different settings, as text ('' if nowhere): read first, on their own (collective)."""
        settings = {
            key: value.clone() if isinstance(value, torch.Tensor) else value
            for key, value in self.reading.asked.items()
            if key.startswith(_GROUPS)
        }
        with _single_process_quietly():
            load({"optim": settings}, checkpoint_id=path, process_group=process_group)
        read = self.reading.found(settings)
        names: dict[int, str] = {}
        for name, param in self._module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
        for group in self._optimizer.param_groups:
            first: dict[str, tuple[str, Any]] = {}
            for param in group["params"]:
                held = names.get(id(param), "")
                for field in (f for f in group if f != "params"):
                    value = read.get(f"{_GROUPS}{held}.{field}", _ABSENT)
                    if value is _ABSENT:
                        continue
                    seen = first.setdefault(field, (held, value))
                    if not _same(seen[1], value):
                        return (
                            f"the checkpoint gives {seen[0]} {field}={seen[1]!r} and {held} "
                            f"{field}={value!r}, which this optimizer holds in one param "
                            "group (the settings are saved per parameter, and torch would "
                            "give the group its first one's): build the optimizer with the "
                            "param groups it was saved with"
                        )
        return ""

    def load(self) -> None:
        """Into the optimizer, once DCP has read: a parameter without saved state keeps none."""
        if not self._target:
            return  # no parameter here: nothing to load
        loaded = {**self._target, **self.reading.loaded()}
        with (
            _without_empty_groups(self._optimizer),
            _step_hooks_quiet(self._optimizer),
            _trained(self._frozen),
        ):
            set_optimizer_state_dict(self._module, self._optimizer, loaded, options=_FLAT)
        for name in self._stateless:
            self._optimizer.state.pop(self._module.get_parameter(name), None)

    def undo(self) -> None:
        """The optimizer as it was (a refused or failed load): its own state, untouched."""
        self._optimizer.state = self._before


@contextlib.contextmanager
def _trained(frozen: list[torch.Tensor]) -> Iterator[None]:
    """``frozen`` parameters requiring grad for the block, then frozen again."""
    for param in frozen:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for param in frozen:
            param.requires_grad_(False)


@contextlib.contextmanager
def _without_empty_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer's param groups without a parameter set aside, then put back in place.

    torch's flattened load fails on a group without parameters (a stage
    process whose layers have weights and no bias, the biases' group empty);
    such a group has no state and, flattened, no settings in a checkpoint:
    it keeps its own.
    """
    groups = optimizer.param_groups
    if all(group["params"] for group in groups):
        yield
        return
    optimizer.param_groups = [group for group in groups if group["params"]]
    try:
        yield
    finally:
        # A load replaces the groups holding parameters by new ones, in order.
        loaded = iter(optimizer.param_groups)
        optimizer.param_groups = [next(loaded) if group["params"] else group for group in groups]


_ABSENT = object()


def _same(a: Any, b: Any) -> bool:
    """Whether two settings of a param group are equal (a tensor ``lr`` as its values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


@contextlib.contextmanager
def _step_hooks_quiet(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer's step hooks (its own and the global ones) set aside meanwhile: torch's
    calls give an optimizer without state some by a zero-lr step, which is no step of the
    training (a weight average or a step counter in a hook would count it)."""
    kept = (
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
        optimizers._global_optimizer_pre_hooks,
        optimizers._global_optimizer_post_hooks,
    )
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()
    optimizers._global_optimizer_pre_hooks = OrderedDict()
    optimizers._global_optimizer_post_hooks = OrderedDict()
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = kept[:2]
        optimizers._global_optimizer_pre_hooks, optimizers._global_optimizer_post_hooks = kept[2:]


def _distributed() -> bool:
    """Whether torch.distributed is initialized: DCP's calls are collective then."""
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """Without a process group DCP reads and writes in this process alone, as asked: no warning."""
    if _distributed():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
