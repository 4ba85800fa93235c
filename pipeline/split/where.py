"""Where in the model's code something happens: the module and the source line, for messages."""

from __future__ import annotations

import inspect
import linecache
import os
import re
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import SequenceKey, keystr, tree_flatten_with_path

__all__ = [
    "WRAPPED",
    "argument_names",
    "describe_module",
    "failure_location",
    "frame_location",
    "node_location",
    "node_module",
]

# The capture calls the model as a child of this name (``capture.py``); names drop it.
WRAPPED = "model"

_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n +(?P<code>.*)'
)
_TORCH = os.path.dirname(torch.__file__) + os.sep
_SPLIT = os.path.dirname(__file__) + os.sep


def describe_module(name: str, module: nn.Module) -> str:
    """``module 'transformer.h.0' (GPT2Block)``, or ``the model (GPT2LMHeadModel)`` for the root."""
    kind = type(module).__name__
    return f"module {name!r} ({kind})" if name else f"the model ({kind})"


def node_module(node: fx.Node) -> str:
    """The name of the innermost module whose forward made ``node`` ('' for the model)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    name, _ = list(stack.values())[-1]
    # A module's second call is recorded as 'name@1'.
    name = str(name).split("@")[0]
    return "" if name == WRAPPED else name.removeprefix(WRAPPED + ".")


def argument_names(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """A name for each leaf of ``(args, kwargs)``: its parameter's name, then where inside it.

    ``input_ids``, ``past_key_values``, ``inputs[1]``, ``mask['causal']``.
    """
    positional: list[str] = []
    extra = "argument"
    try:
        for parameter in inspect.signature(module.forward).parameters.values():
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                positional.append(parameter.name)
            elif parameter.kind == parameter.VAR_POSITIONAL:
                extra = parameter.name
    except (TypeError, ValueError):
        pass
    names = []
    for path, _ in tree_flatten_with_path((args, kwargs))[0]:
        which, first, *rest = path
        if isinstance(which, SequenceKey) and which.idx == 0 and isinstance(first, SequenceKey):
            index = first.idx
            where = positional[index] if index < len(positional) else f"{extra}[{index}]"
        else:
            where = str(getattr(first, "key", first))
        names.append(where + keystr(tuple(rest)))
    return names


def node_location(node: fx.Node) -> str:
    """``file.py:12 (`code`)`` for the innermost frame of the model's code that made ``node``."""
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    if not frames:
        return "an unknown line"
    last = frames[-1]
    return f"{_short(last['file'])}:{last['line']} (`{last['code'].strip()}`)"


def failure_location(error: BaseException, names: dict[nn.Module, str]) -> tuple[str, str]:
    """The module (of ``names``) and the source line where ``error`` was raised.

    The module is the innermost one whose own code was running; the line is
    the innermost one outside torch (a helper that the module's code called).
    """
    module, line = "", "an unknown line"
    traceback: TracebackType | None = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        owner = frame.f_locals.get("self")
        code = frame.f_code.co_filename
        model_code = not code.startswith((_TORCH, _SPLIT))
        if isinstance(owner, nn.Module) and owner in names and model_code:
            module = describe_module(names[owner], owner)
        if model_code:
            line = _line(code, traceback.tb_lineno)
        traceback = traceback.tb_next
    return module, line


def frame_location(frame: FrameType) -> str:
    """``file.py:12 (`code`)`` for the line that ``frame`` is running."""
    return _line(frame.f_code.co_filename, frame.f_lineno)


def _line(path: str, number: int) -> str:
    text = linecache.getline(path, number).strip()
    return f"{_short(path)}:{number} (`{text}`)"


def _short(path: str) -> str:
    """The path from the package directory on, which is enough to find the file."""
    marker = f"{os.sep}site-packages{os.sep}"
    return path.split(marker, 1)[1] if marker in path else path
