"""What ``load_checkpoint`` refuses before it reads anything, on every process of the load.

As strict as torch's ``load_state_dict``: a key a process needs that the
checkpoint lacks, a tensor whose shape differs from the stored one, and a
stored key of the model's or the optimizer's state that no process asks
for (a deeper model's layers, another optimizer's fields) are refused,
together, in one ``RuntimeError``, before DCP reads anything.

In a pipeline each process asks for the keys of its own stages, so a key is
unexpected only if no process of the load asks for it: every process flags
the stored keys it accounts for (under every name of a tied parameter), and
one all-reduce takes their union. The stored keys are the checkpoint's, so
the same list on every process. A problem that one process finds alone
(its missing keys, its shapes) travels to the others as text, so that every
process raises the same error, and none waits in DCP for the others.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pipeline.runtime.agreement import (
    camps,
    fingerprint,
    gather_rows,
    gather_texts,
    ranks_text,
    refused_text,
)
from pipeline.runtime.lazy import instance_of
from pipeline.runtime.process_group import collective_device

__all__ = [
    "check_arguments_alike",
    "check_before_loading",
    "check_everywhere",
    "check_extra_alike",
    "check_shards_within",
    "damaged_files",
    "optimizer_outside",
]

# Texts name 4 keys of each kind at most; this bounds what a peer may announce.
_TEXT_LIMIT = 1 << 20
_SHOWN = 4
_DTENSOR = "torch.distributed.tensor"


def check_before_loading(
    path: str | os.PathLike[str],
    stored: Mapping[str, Any],
    asked: Mapping[str, Any],
    covered: Collection[str],
    optimizer: bool,
    strict: bool,
    group: dist.ProcessGroup | None,
    damaged: str = "",
) -> None:
    """Raise ``RuntimeError`` on every process of ``group`` if the load must be refused.

    ``stored``: the checkpoint's metadata by key; ``asked``: what this process
    reads (key, target value); ``covered``: the stored keys this process
    accounts for; ``optimizer``: whether it loads an optimizer (its keys are
    then checked too); ``strict``: whether unexpected keys are refused (alike
    on every process: ``check_arguments_alike``); ``damaged``: the data files
    this process reads that are damaged (``damaged_files``), as text.
    Collective over ``group`` (None: this process alone).
    """
    mine = "; ".join(filter(None, [_problems(asked, stored, group), damaged]))
    keys = sorted(k for k in stored if k.startswith(("model.", "optim.")))
    flags = [k in covered for k in keys] + [optimizer, bool(mine)]
    flags = _any_process(flags, group)
    optimizers, troubled = flags[-2], flags[-1]
    unexpected = [
        k
        for k, seen in zip(keys, flags, strict=False)
        if not seen and (k.startswith("model.") or optimizers)
    ]
    problems = _every_process(mine, group) if troubled else []
    if strict and unexpected:
        saved = {k[len("model.") :] for k in stored if k.startswith("model.")}
        problems.append(_unexpected_text(unexpected, saved))
    if problems:
        raise RuntimeError(
            f"load_checkpoint({os.fspath(path)!r}) refused, nothing was loaded: "
            + "; ".join(problems)
        )


def check_everywhere(
    call: str,
    problem: str,
    group: dist.ProcessGroup | None,
    error: type[Exception],
    outcome: str = "refused, nothing was done",
) -> None:
    """Raise ``error`` on every process of ``group`` if one found ``problem`` ('' if none):
    alone, it would leave the others waiting in the call's collectives until their timeout,
    or going on as if the call had succeeded. ``outcome`` says what became of the call."""
    if not _any_process([bool(problem)], group)[0]:
        return
    # Once each: the holders of a tied weight, say, find the same problem.
    texts = dict.fromkeys(_every_process(problem, group))
    raise error(f"{call} {outcome}: " + "; ".join(texts))


def check_arguments_alike(
    call: str,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    group: dist.ProcessGroup | None,
    error: type[Exception],
    strict: bool = True,
) -> None:
    """Raise ``error`` on every process of ``group`` (one ``all_gather``) if their arguments
    disagree where a process going its own way would be wrong or wait in a collective the
    others skip: an optimizer given on some processes and not on one whose stages hold
    parameters (their state would be left out, a frozen one's too, which a trained and then
    frozen parameter keeps), or ``strict`` differing (only some would refuse). A process
    whose stages hold no parameter may pass None: it has no state."""
    if group is None or not _distributed():
        return
    holds = any(True for _ in module.parameters())
    rows = gather_rows([optimizer is not None, holds, strict], group)
    given = [rank for rank, row in enumerate(rows) if row[0]]
    without = [rank for rank, row in enumerate(rows) if not row[0] and row[1]]
    problems = []
    if given and without:
        problems.append(
            f"{refused_text(given)} passed an optimizer and {refused_text(without)}, whose "
            "stages hold parameters, none (their optimizer's state would be left out): pass "
            "each process's optimizer (over frozen parameters too: torch.optim.AdamW(params) "
            "takes them, and keeps no state for those that never trained), or None on every "
            "process (a process whose stages hold no parameter may pass None)"
        )
    strictness = camps([row[2] for row in rows])
    if len(strictness) > 1:
        passed = ", ".join(f"{bool(rows[c[0]][2])} on {refused_text(c)}" for c in strictness)
        problems.append(
            f"strict differs between the processes ({passed}): only some would refuse; pass "
            "the same on every process"
        )
    if problems:
        raise error(f"{call} refused, nothing was done: " + "; ".join(problems))


def damaged_files(
    path: str | os.PathLike[str],
    storage: Mapping[Any, Any],
    read: Collection[str],
    group: dist.ProcessGroup | None,
) -> str:
    """The checkpoint's data files that this process reads (for the keys ``read`` and what
    they hold nested; ``storage``: the metadata's ``storage_data``) and finds missing or
    shorter than the metadata says, as text ('' if none): a partly copied checkpoint, or one
    whose files some host lacks. Found before anything is read, where DCP would fail
    halfway, on every process, after some had read their weights."""
    needed: dict[str, int] = {}
    for index, where in storage.items():
        parts = str(getattr(index, "fqn", "")).split(".")
        if any(".".join(parts[:k]) in read for k in range(1, len(parts) + 1)):
            end = where.offset + where.length
            needed[where.relative_path] = max(needed.get(where.relative_path, 0), end)
    problems = []
    for name, size in sorted(needed.items()):
        try:
            found = os.stat(os.path.join(path, name)).st_size
        except OSError as error:
            problems.append(f"{name} cannot be read ({type(error).__name__}: {error.strerror})")
            continue
        if found < size:
            problems.append(f"{name} holds {found} bytes, where its metadata needs {size}")
    if not problems:
        return ""
    who = "this process" if group is None else f"rank {dist.get_rank(group)}"
    return (
        f"the checkpoint's data files that {who} reads are damaged or partly copied: "
        f"{_shown(problems)}; copy the whole checkpoint directory again (to every host), or "
        "load another"
    )


def optimizer_outside(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> str:
    """Where ``optimizer`` holds a parameter that ``module`` does not, as text ('' if nowhere)."""
    if optimizer is None:
        return ""
    held = {id(p) for p in module.parameters()}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in held:
                return (
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} (param group "
                    f"{index}) that the module does not: its state is saved under the module's "
                    "parameter names; make it a parameter of the module, or give it an optimizer "
                    "of its own and save that in extra"
                )
    return ""


def check_extra_alike(extra: Mapping[str, Any], group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` on every process of ``group`` if an entry of ``extra`` to save,
    under one name, differs between the processes that give it.

    DCP keeps one copy of a value that is not sharded: every process would
    load that one's. An LR scheduler over param groups that differ between
    the processes of a pipeline (its ``base_lrs``) is one.
    """
    if group is None or not _distributed():
        return
    try:
        mine = "".join(
            f"{fingerprint(name)} {fingerprint(_described(_saved(v)))}\n"
            for name, v in extra.items()
        )
    except BaseException as error:  # an entry's state_dict, on this process alone
        who = f"rank {dist.get_rank(group)}"
        failed = f"{who} failed reading extra: {type(error).__name__}: {error}"
        with contextlib.suppress(ValueError):
            check_everywhere("save_checkpoint", failed, group, ValueError)
        raise
    check_everywhere("save_checkpoint", "", group, ValueError)
    texts = gather_texts(mine, group, _TEXT_LIMIT) or [mine]
    held: dict[int, dict[int, list[int]]] = {}  # name -> value -> ranks
    for rank, text in enumerate(texts):
        for line in text.splitlines():
            key, value = (int(part) for part in line.split())
            held.setdefault(key, {}).setdefault(value, []).append(rank)
    for name in extra:
        values = held.get(fingerprint(name), {})
        if len(values) > 1:
            raise ValueError(
                f"save_checkpoint: extra[{name!r}] differs between the processes "
                f"({ranks_text(list(values.values()))} hold different ones): DCP saves one "
                "copy of a value that is not sharded, and every process would load that one's "
                "(an LR scheduler's base_lrs where the processes' param groups differ); give "
                f"each process's value a name of its own (f'{name}.{{rank}}', loaded in the "
                "same layout), or save only what is alike"
            )


def _saved(value: Any) -> Any:
    state_dict = getattr(value, "state_dict", None)
    return state_dict() if callable(state_dict) else value


def _described(value: Any) -> str:
    """A text that tells values apart: tensors by their values, a sharded one by its shape."""
    if isinstance(value, torch.Tensor):
        if instance_of(value, _DTENSOR, "DTensor"):
            return f"sharded {tuple(value.shape)}"  # each process holds its own shard
        return f"tensor {value.dtype} {tuple(value.shape)} {value.detach().cpu().tolist()!r}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_described(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_described(v) for v in value) + "]"
    return re.sub(r"0x[0-9a-fA-F]+", "0x", repr(value))  # an object's address is its own


def check_shards_within(
    state: Mapping[str, Any], group: dist.ProcessGroup | None, call: str
) -> None:
    """Raise ``ValueError`` if a sharded tensor of ``state`` has shards outside ``group``.

    A DTensor (FSDP2's shards, tensor parallelism's) is saved and loaded by
    the processes of its mesh together: DCP in a group that lacks some of
    them would write a checkpoint of part of the tensor, or read part of it.
    Every process holding such a tensor refuses, before anything is read or
    written. ``group`` None: the whole job (or no torch.distributed at all).
    """
    if group is None or not _distributed():
        return
    ranks = set(dist.get_process_group_ranks(group))
    for key, value in state.items():
        if instance_of(value, _DTENSOR, "DTensor"):
            mesh = set(value.device_mesh.mesh.flatten().tolist())
            if not mesh <= ranks:
                raise ValueError(
                    f"{call}: {key} is sharded over ranks {sorted(mesh)} (a DTensor of FSDP2 "
                    f"or tensor parallelism), but process_group holds ranks {sorted(ranks)}: "
                    "the processes of its mesh save and load it together; pass a "
                    "process_group holding them all (default: the whole job)"
                )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _problems(
    asked: Mapping[str, Any], stored: Mapping[str, Any], group: dist.ProcessGroup | None
) -> str:
    """This process's missing keys and shapes that differ, as text ('' if none)."""
    who = "this process" if group is None else f"rank {dist.get_rank(group)}"
    parts = []
    missing = sorted(k for k in asked if k not in stored)
    if missing:
        parts.append(
            f"the checkpoint lacks {_shown(missing)}, which {who} needs; {_why(missing, stored)}"
        )
    differ = [
        f"{key} is {tuple(meta.size)} in the checkpoint, {tuple(value.shape)} in the model"
        for key, value in sorted(asked.items())
        if isinstance(value, torch.Tensor)
        and isinstance(meta := stored.get(key), TensorStorageMetadata)
        and tuple(meta.size) != tuple(value.shape)
    ]
    if differ:
        parts.append(
            f"shapes differ on {who}: {_shown(differ)}; it was saved from a model of other "
            "sizes (another width, vocabulary or config): build the model with the "
            "checkpoint's sizes"
        )
    return "; ".join(parts)


def _why(missing: list[str], stored: Mapping[str, Any]) -> str:
    if all(k.startswith("optim.") for k in missing) and not any(
        k.startswith("optim.") for k in stored
    ):
        return "it was saved without an optimizer: load it without one"
    if all(k.startswith("optim.param_groups.") and k.endswith(".initial_lr") for k in missing):
        return (
            "the optimizer's param groups hold initial_lr, which an LR scheduler adds and the "
            "saving optimizer had not: build the scheduler after the load"
        )
    return "it was saved from a model with other parameters, or an optimizer of another kind"


def _unexpected_text(unexpected: list[str], saved: set[str]) -> str:
    model = [k for k in unexpected if k.startswith("model.")]
    optimizer = [k for k in unexpected if k.startswith("optim.")]
    if not model and all(_parameter_in(k, saved) for k in optimizer):
        return (
            f"the checkpoint holds {len(optimizer)} keys of the optimizer's state or settings "
            f"({_shown(optimizer, 2)}) for parameters this optimizer keeps no such entry for: "
            "an optimizer of another kind, or settings an LR scheduler added (initial_lr); "
            "pass strict=False "
            "to load what this optimizer has and leave the rest, or load it into the "
            "optimizer it was saved from"
        )
    # The model's keys first: the optimizer's follow its parameters, many per parameter.
    held = [_shown(model)] if model else []
    if optimizer:
        held.append(f"{len(optimizer)} keys of the optimizer's state ({_shown(optimizer, 2)})")
    return (
        f"the checkpoint holds {' and '.join(held)}, which no process of the load asks for: it "
        "was saved from a model with more or other parameters (another depth or config), or "
        "an optimizer of another kind; load it into the model and optimizer it was saved "
        "from, or pass strict=False to load what the model has and leave the rest"
    )


def _parameter_in(key: str, saved: set[str]) -> bool:
    """Whether the optimizer's ``key`` (``optim.state.<name>.<field>``) is of a parameter of
    the model's saved state."""
    for section in ("optim.state.", "optim.param_groups."):
        if key.startswith(section):
            parts = key[len(section) :].split(".")
            return any(".".join(parts[:k]) in saved for k in range(len(parts) - 1, 0, -1))
    return False


def _shown(items: list[str], most: int = _SHOWN) -> str:
    more = len(items) - most
    return ", ".join(items[:most]) + (f" and {more} more" if more > 0 else "")


def _any_process(flags: list[bool], group: dist.ProcessGroup | None) -> list[bool]:
    """Each flag, true if it is on any process of ``group``."""
    if group is None:
        return flags
    values = torch.tensor(flags, dtype=torch.uint8, device=collective_device(group))
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in values.tolist()]


def _every_process(text: str, group: dist.ProcessGroup | None) -> list[str]:
    """The non-empty texts of every process of ``group``, by rank."""
    if group is None:
        return [text]
    texts = gather_texts(text, group, _TEXT_LIMIT)
    if texts is None:  # a text of a megabyte (keys of that length): each names its own
        texts = [text]
    return [t for t in texts if t]
