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
  every process holding the parameter, so that their copies stay equal. The
  values under its other names are read first and compared: a checkpoint of
  a model where they are not tied is refused (torch's ``load_state_dict``
  keeps the last name's value, silently).
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
import re
import shutil
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.optim.optimizer as optimizers
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
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
    check_arguments_alike,
    check_before_loading,
    check_everywhere,
    check_extra_alike,
    check_shards_within,
    damaged_files,
    optimizer_outside,
)
from pipeline.distributed.pipe import DistributedPipe
from pipeline.runtime.lazy import instance_of

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

    A save that fails (a full disk on one process) raises ``ValueError`` on
    every process and leaves the checkpoint already in ``path`` as it was:
    each process writes into a directory of its own inside ``path``, moved in
    once every process has written (``_Staged``).
    """
    holder = _unwrapped(module)
    group = process_group if process_group is not None or not _distributed() else dist.group.WORLD
    check_arguments_alike("save_checkpoint", holder, optimizer, group, ValueError)
    check_everywhere("save_checkpoint", optimizer_outside(holder, optimizer), group, ValueError)
    if isinstance(module, DataParallel) and process_group is None:
        module.share_rank0_buffers()  # DCP writes one replica's, whichever
    names = _Names(holder)
    model_state = _model_state(holder)
    check_shards_within(model_state, process_group, "save_checkpoint")
    state: dict[str, Any] = {"model": names.every_name(model_state)}
    if optimizer is not None:
        state["optim"] = names.every_name(_optimizer_state(holder, optimizer))
    ties = names.tie_marks(model_state)
    if ties:
        state[_TIES] = ties
    state.update(_extra(extra))
    check_extra_alike(extra or {}, group)
    _Staged(path, group).save(state, process_group)


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
    checkpoint are not checked. ``optimizer`` (None, or not) and ``strict``
    are alike on every process: a process whose stages hold no parameter may
    pass None where the others pass theirs.

    Refused as well, before anything changes: a data file that a process
    reads missing or shorter than the metadata says, and a tied weight whose
    names the checkpoint gives different values. A file that fails while the
    weights are read raises ``RuntimeError`` on every process, naming it.
    """
    holder = _unwrapped(module)
    group = process_group if process_group is not None or not _distributed() else dist.group.WORLD
    called = f"load_checkpoint({os.fspath(path)!r})"
    check_arguments_alike(called, holder, optimizer, group, RuntimeError, strict)
    problem, metadata = optimizer_outside(holder, optimizer), Metadata({})
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # on this process alone (a path it does not see)
        problem = problem or f"{_failed_here(error, group)} (its metadata)"
    check_everywhere(called, problem, group, RuntimeError, _REFUSED)
    names = _Names(holder)
    stored = set(metadata.state_dict_metadata)
    model_target = _model_state(holder)
    check_shards_within(model_target, process_group, "load_checkpoint")
    model = _Reading("model.", model_target, names, stored)
    tied = _TiedValues(model_target, names, stored)
    state: dict[str, Any] = {"model": model.asked}
    covered = names.covered("model.", model_target)
    target = None if optimizer is None else _OptimizerTarget(holder, optimizer, names, stored)
    if target is not None:
        state["optim"] = target.reading.asked
        covered |= target.covered
    asked = {f"{section}.{key}": v for section in state for key, v in state[section].items()}
    asked.update({f"model.{key}": value for key, value in tied.asked.items()})
    state.update(_extra(extra))
    try:
        damaged = damaged_files(path, metadata.storage_data or {}, {*asked, *(extra or {})}, group)
        check_before_loading(
            path,
            metadata.state_dict_metadata,
            asked,
            covered,
            target is not None,
            strict,
            group,
            damaged,
        )
        _read_first(tied, target, path, process_group, called, group)
        state["model"] = model.besides(tied.asked)
        _read(state, path, process_group, called, group, _PARTLY_READ)
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


def _read_first(
    tied: _TiedValues,
    target: _OptimizerTarget | None,
    path: str | os.PathLike[str],
    process_group: dist.ProcessGroup | None,
    called: str,
    group: dist.ProcessGroup | None,
) -> None:
    """What must agree, read first into tensors of its own (collective): a tied weight's
    values under its names, the param groups' settings. Refused on every process where they
    differ, nothing changed."""
    first = {"model": tied.asked, "optim": {} if target is None else target.settings()}
    _read(first, path, process_group, called, group, _REFUSED)
    unlike = tied.unlike() or ("" if target is None else target.groups_unlike(first["optim"]))
    check_everywhere(called, unlike, group, RuntimeError, _REFUSED)


def _read(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    process_group: dist.ProcessGroup | None,
    called: str,
    group: dist.ProcessGroup | None,
    outcome: str,
) -> None:
    """DCP's load of ``state`` (collective), failing as every process's other failures do.

    DCP's own failures (a file that cannot be read) reach every process
    together, as a ``CheckpointException``: a ``BaseException`` whose text is
    the failing processes' tracebacks. They become a ``RuntimeError`` naming
    them; ``outcome`` says what became of the load.
    """
    with _single_process_quietly():
        try:
            load(state, checkpoint_id=path, process_group=process_group)
        except CheckpointException as error:
            raise RuntimeError(f"{called} {outcome}: {_failures(error, group)}") from error
        except BaseException as error:
            # An extra entry's load_state_dict, say, on this process alone: it raises its
            # own error, the others one naming it.
            with contextlib.suppress(RuntimeError):
                check_everywhere(called, _failed_here(error, group), group, RuntimeError)
            raise


_REFUSED = "refused, nothing was loaded"
_HALF_READ = (
    "failed on another process, after the weights here were read (the optimizer's state was "
    "left as it was): load again"
)
_PARTLY_READ = (
    "failed reading it, after some weights were read (load a whole checkpoint before training "
    "on; the optimizer's state was left as it was)"
)


def _failed_here(error: BaseException, group: dist.ProcessGroup | None) -> str:
    return f"{_who(group)} failed reading it: {type(error).__name__}: {error}"


def _who(group: dist.ProcessGroup | None, rank: int | None = None) -> str:
    """This process (or ``rank`` of ``group``), as errors name it."""
    if group is None:
        return "this process"
    return f"rank {dist.get_rank(group) if rank is None else rank}"


def _failures(error: CheckpointException, group: dist.ProcessGroup | None) -> str:
    """The processes where DCP failed, each with its error's first line (DCP's own text is
    their tracebacks, which the exception's cause keeps)."""
    failed = []
    for rank, (cause, _) in sorted(error.failures.items()):
        lines = str(cause).strip().splitlines() or [""]
        failed.append(f"{_who(group, rank)} failed: {type(cause).__name__}: {lines[0]}")
    return "; ".join(failed)


# DCP's: written last, the mark of a whole checkpoint.
_METADATA = ".metadata"
# Then the rank: where a process writes until every process has written.
_STAGING = ".saving-rank"
# The names of DCP's data files (``FileSystemWriter``'s: ``__<rank>_<n>.distcp``); others
# in the directory are the user's.
_DATA = re.compile(r"__\d+_\d+\.distcp")
_UNMARKED = (
    "failed after the old checkpoint's .metadata was removed (first, so that no load can mix "
    "the two): the directory holds no checkpoint now, save again"
)


class _Staged:
    """A save into a directory of each process's own inside ``path``, moved in once every
    process has written: a save that fails anywhere leaves the checkpoint there as it was.

    DCP writes its data files in place and its ``.metadata`` last: over an
    older checkpoint, a save failing on one process left the old metadata
    over old and new files, which loaded without an error, stages of two
    steps mixed. Here the old checkpoint's ``.metadata`` goes only once
    every process has written the new one, then the new files move in, its
    ``.metadata`` last: a load finds the old checkpoint, the new one, or none
    (refused), never a mix. Each process moves its own files: hosts that do
    not share the directory each keep theirs, as DCP's save does.
    """

    def __init__(self, path: str | os.PathLike[str], group: dist.ProcessGroup | None) -> None:
        self._path, self._group = Path(path), group
        self._rank = 0 if group is None else dist.get_rank(group)
        self._own = self._path / f"{_STAGING}{self._rank}"
        self._called = f"save_checkpoint({os.fspath(path)!r})"
        self._replaced: set[str] = set()

    def save(self, state: dict[str, Any], process_group: dist.ProcessGroup | None) -> None:
        """DCP's save (collective) into this process's directory, then moved in."""
        shutil.rmtree(self._own, ignore_errors=True)  # a save that crashed left it
        try:
            with _single_process_quietly():
                save(state, checkpoint_id=self._own, process_group=process_group)
        except CheckpointException as error:  # on every process: DCP's writes are agreed
            shutil.rmtree(self._own, ignore_errors=True)
            raise ValueError(
                f"{self._called} failed, the checkpoint there left as it was: "
                f"{_failures(error, self._group)}"
            ) from error
        self._everywhere(self._unmark, "failed, the checkpoint there left as it was")
        self._everywhere(self._move_in, _UNMARKED)
        self._everywhere(self._mark, _UNMARKED)

    def _everywhere(self, step: Callable[[], None], outcome: str) -> None:
        """``step`` here, then agreed: a failure on any process fails every one."""
        problem = ""
        try:
            step()
        except OSError as error:
            problem = f"{_who(self._group)} failed: {type(error).__name__}: {error}"
        try:
            check_everywhere(self._called, problem, self._group, ValueError, outcome)
        except ValueError:
            shutil.rmtree(self._own, ignore_errors=True)
            raise

    def _unmark(self) -> None:
        """Rank 0: the old checkpoint's ``.metadata`` removed, its files noted (and those of
        a save that failed after removing its own: DCP's, by their names)."""
        if self._rank == 0:
            left = {entry.name for entry in os.scandir(self._path) if _DATA.fullmatch(entry.name)}
            self._replaced = _data_files(self._path) | left
            (self._path / _METADATA).unlink(missing_ok=True)

    def _move_in(self) -> None:
        """Every process: the data files it wrote into ``path``."""
        for entry in os.scandir(self._own):
            if entry.name != _METADATA:
                os.replace(entry.path, self._path / entry.name)
        if self._rank != 0:
            with contextlib.suppress(OSError):  # left behind at worst: the next save clears it
                self._own.rmdir()

    def _mark(self) -> None:
        """Rank 0: the old checkpoint's other files removed, the new ``.metadata`` moved in."""
        if self._rank == 0:
            for name in self._replaced - _data_files(self._own):
                (self._path / name).unlink(missing_ok=True)
            os.replace(self._own / _METADATA, self._path / _METADATA)
            # This save's staging, and any a killed save of more processes left.
            for entry in os.scandir(self._path):
                if entry.name.startswith(_STAGING) and entry.is_dir():
                    shutil.rmtree(entry.path, ignore_errors=True)


def _data_files(directory: Path) -> set[str]:
    """The data files that the checkpoint in ``directory`` names (none if there is none)."""
    try:
        storage = FileSystemReader(directory).read_metadata().storage_data
    except Exception:  # no checkpoint there, or a damaged one: no files of its to remove
        return set()
    # Only files of the directory itself: its metadata is data, not an instruction.
    names = {where.relative_path for where in (storage or {}).values()}
    return {name for name in names if Path(name).name == name and name != _METADATA}


def _extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra``'s entries, saved beside the model's and the optimizer's state."""
    taken = sorted({"model", "optim", _TIES}.intersection(extra or {}))
    if taken:
        raise ValueError(
            f"extra must not use the names {taken}: they are the checkpoint's own (the model's "
            "and the optimizer's state, the marks of tied weights); give its entries other names"
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

    def tie_marks(self, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """An empty tensor keyed by the names of each tied parameter in ``state``: the mark,
        in a checkpoint, that its names hold one value (``_TiedValues``)."""
        groups = dict.fromkeys(self.aliases[key] for key in state if key in self.aliases)
        return {_tie_key(group): torch.empty(0) for group in groups}

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

    def besides(self, read: Mapping[str, Any]) -> dict[str, Any]:
        """The keys left to read once ``read`` (keys read first, some of them asked) was: what
        it holds for them takes their place."""
        self.asked.update((key, value) for key, value in read.items() if key in self.asked)
        return {key: value for key, value in self.asked.items() if key not in read}

    def found(self, read: Mapping[str, Any]) -> dict[str, Any]:
        """The target's keys with what ``read`` (some of the asked keys, read) holds for them."""
        return {key: read[found] for key, found in self._source.items() if found in read}


class _TiedValues:
    """The checkpoint's values under every name of each tied parameter held here, read first
    (into tensors of their own) where it has several of its names.

    A checkpoint of a model whose weights are not tied (an embedding and its
    output head) may hold different values under them: torch's
    ``load_state_dict`` keeps the last one's silently, the first read the
    first's. Either is wrong for one of them: the load is refused. A tied
    model's checkpoint holds one value under all of its names.
    """

    def __init__(self, target: Mapping[str, Any], names: _Names, stored: set[str]) -> None:
        self.asked: dict[str, Any] = {}
        self._tied: list[list[str]] = []
        for group in dict.fromkeys(names.aliases[key] for key in target if key in names.aliases):
            if f"{_TIES}.{_tie_key(group)}" in stored:
                continue  # saved from a model that ties them: one value (no copies read)
            saved = [name for name in group if f"model.{name}" in stored]
            value = next(target[name] for name in group if name in target)
            if len(saved) > 1 and isinstance(value, torch.Tensor):
                self._tied.append(saved)
                self.asked.update({name: torch.empty_like(value) for name in saved})

    def unlike(self) -> str:
        """Where the values read differ, as text ('' if nowhere)."""
        for saved in self._tied:
            first = _local(self.asked[saved[0]])
            for name in saved[1:]:
                if not _same_values(_local(self.asked[name]), first):
                    return (
                        f"the checkpoint holds different values under model.{saved[0]} and "
                        f"model.{name}, which this model ties into one weight: it was saved "
                        "from a model where they are not tied (torch's load_state_dict would "
                        "keep the last one's, silently); load it into such a model, or save it "
                        "again with the value you want under both names"
                    )
        return ""


# A checkpoint's marks of the weights its model tied (``_Names.tie_marks``).
_TIES = "model-ties"


def _tie_key(names: Sequence[str]) -> str:
    """The key marking ``names`` as one tied parameter's, in a checkpoint."""
    return "|".join(sorted(names))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values, a NaN the same as a NaN (a diverged
    run's tied weight is one value under both names)."""
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()) or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (FSDP2's, tensor parallelism's): compared
    here, without a collective; the others compare theirs."""
    if instance_of(tensor, "torch.distributed.tensor", "DTensor"):
        local: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
        return local
    return tensor


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

    def settings(self) -> dict[str, Any]:
        """The param groups' settings to read first, on their own (for ``groups_unlike``)."""
        return {
            key: value.clone() if isinstance(value, torch.Tensor) else value
            for key, value in self.reading.asked.items()
            if key.startswith(_GROUPS)
        }

    def groups_unlike(self, settings: Mapping[str, Any]) -> str:
        """Where the checkpoint gives the parameters of one of the optimizer's param groups
        different settings (``settings``, read), as text ('' if nowhere)."""
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
