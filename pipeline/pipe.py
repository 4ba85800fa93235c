"""Pipe: an nn.Sequential split across devices and run as a GPipe pipeline."""

from __future__ import annotations

import operator
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any, overload

import torch
from torch import nn

from pipeline.arguments import (
    BalanceError,
    CallStyle,
    CheckpointMode,
    Device,
    LossReduction,
    check_pipe_arguments,
    check_sharing,
    normalize_device,
    resolve_devices,
)
from pipeline.base import PipeBase
from pipeline.calls import EvaluateCall, MicroBatches, StepCall
from pipeline.clock.driver import ClockDriver
from pipeline.runtime.borrowed import find_loans
from pipeline.runtime.buffers import refuse_lazy
from pipeline.runtime.microbatch import Batch, Value, check_input, gather, scatter, to_device
from pipeline.runtime.partitions import Hook, PositionalSequential
from pipeline.runtime.recompute import checkpoint_stop
from pipeline.runtime.router_loss import ASKED, asked
from pipeline.runtime.unseen import (
    refuse_cached_parametrizations,
    refuse_reparametrized,
    refuse_unseen_state,
)
from pipeline.runtime.worker import (
    Threads,
    check_threads,
    start_workers,
    stop_workers,
    thread_layout,
)
from pipeline.skip.layout import inspect_skip_layout
from pipeline.step.actions import Program
from pipeline.step.reports import StepReport
from pipeline.step.runner import StepRun, forward_programs, programs_by_worker
from pipeline.step.schedules import Schedule, resolve_schedule
from pipeline.step.sharded import fsdp_units
from pipeline.step.simulate import Simulation, forward_idle
from pipeline.trace.profiling import warn_if_workers_unseen
from pipeline.trace.recording import begin_explicit_step

__all__ = ["BalanceError", "Pipe", "PositionalSequential", "StepReport"]


class Pipe(PipeBase):
    """Wraps an ``nn.Sequential`` to train it as a GPipe pipeline.

    The layers are split into ``len(balance)`` partitions of consecutive
    layers (``balance[j]`` layers in partition ``j``, placed on
    ``devices[j]``). Each mini-batch is split into ``chunks`` micro-batches
    that flow through the partitions so that all devices work at once.
    Outputs and gradients equal those of the plain module.

    Example::

        model = nn.Sequential(a, b, c, d)
        pipe = Pipe(model, balance=[2, 2], devices=["cuda:0", "cuda:1"], chunks=8)
        out = pipe(x.to("cuda:0"))        # out is on cuda:1
        loss_fn(out, y.to("cuda:1")).backward()

    Args:
        module: the ``nn.Sequential`` to split; its layers are moved to their
            partition's device.
        balance: the number of layers in each partition; ``balance`` (the
            package) computes one from profiling.
        devices: a device per partition (default: the CUDA devices in order,
            or ``'cpu'`` for every partition without CUDA). Partitions may
            share a device.
        chunks: the number of micro-batches per mini-batch.
        checkpoint: ``'always'``, ``'except_last'`` (every micro-batch but the
            last) or ``'never'``: which micro-batches recompute their
            activations in backward instead of keeping them.
        deferred_batch_norm: update BatchNorm running statistics once per
            mini-batch instead of once per micro-batch.
        call_style: how a tuple passes between layers. ``'tuple'`` (torchgpipe
            and fairscale): a layer receives the tuple as one argument and
            ``pipe(x)`` takes one input. ``'positional'``
            (``torch.distributed.pipeline.sync.Pipe``): a layer receives a
            tuple's items as positional arguments, and ``pipe(x, y)`` passes
            ``x, y`` to the first layer; the plain model it equals is
            ``pipeline.PositionalSequential``.
        threads: which partitions share a worker thread. ``'partition'``: a
            thread each, so that partitions on one device run at once (two
            CPU partitions on two cores), at the cost of a hand-off between
            threads per task. ``'device'``: one thread per device runs its
            partitions one task after another: fewer hand-offs, no overlap
            on a device, and random draws without a seeding mode when the
            thread owns the generator. ``'auto'`` (default): by device for
            CUDA devices (a GPU runs its kernels asynchronously, so a second
            thread adds hand-offs, not overlap), by partition elsewhere.
    """

    _NAME = "Pipe"
    _EVALUATE = "call pipe.evaluate(x) (or pipe.evaluate(x, y, loss_fn)) to evaluate"

    devices: list[torch.device]

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None = None,
        *,
        devices: Sequence[Device] | None = None,
        chunks: int = 1,
        checkpoint: CheckpointMode = "except_last",
        deferred_batch_norm: bool = False,
        call_style: CallStyle = "tuple",
        threads: Threads = "auto",
    ) -> None:
        super().__init__()
        arguments = check_pipe_arguments(
            module, balance, chunks, checkpoint, call_style, deferred_batch_norm
        )
        self.threads = check_threads(threads)
        self._adopt_arguments(arguments)
        self.devices = resolve_devices(devices, len(self.balance))
        self.partitions = self._partition(module, arguments.deferred_batch_norm)
        self._register_names(module)
        _place(self.partitions, self.devices)
        self.skip_layout = inspect_skip_layout(self.partitions, self.devices)
        self._start()

    def _start(self) -> None:
        """Start the worker threads and what runs on them (at construction and after a copy)."""
        self._thread_of = thread_layout(self.devices, self.threads)
        self._workers = start_workers(self.devices, self.threads)
        self._finalizer = weakref.finalize(self, stop_workers, self._workers)
        self._start_runtime(self.devices)
        self._driver = ClockDriver(self._runtime, self._workers, self._thread_of, self.skip_layout)
        self.last_step: StepReport | None = None

    def close(self) -> None:
        """Stop this pipe's worker threads, once a call under way on another thread has ended
        (a call waiting for it is refused). Garbage collection does it otherwise."""
        if any(worker.thread is threading.current_thread() for worker in self._workers):
            # The call under way waits for this very thread, which would wait for the call.
            raise RuntimeError(
                "Pipe.close() was called on one of the pipe's own worker threads (by a layer "
                "or a hook, during a call or a step): the pipe cannot stop the thread it runs "
                "on while the call waits for it; close the pipe once the call has returned"
            )
        with self._runtime.lock:
            super().close()

    def _placement(self) -> str:
        return f"devices={[str(d) for d in self.devices]}, threads={self.threads!r}"

    def _norm_device(self) -> torch.device:
        return self.devices[0] if self.devices else torch.device("cpu")

    def forward(self, *inputs: Value, **kwargs: Value) -> Value:
        """Run the input through the pipeline; the output is on the last device.

        One input (a tensor, or a structure holding tensors) with the
        ``'tuple'`` call style; any number with ``'positional'``. Keyword
        arguments go to the first layer, split like the input: each tensor
        along dim 0, any other value given to every micro-batch
        (``pipe(ids, attention_mask=mask)`` calls the first layer with
        ``(ids_i, attention_mask=mask_i)``; with keywords, the ``'tuple'``
        style takes one positional input or none). Interrupted (Ctrl-C), the
        call raises once the tasks under way have ended, so none writes a
        buffer (BatchNorm statistics) afterwards.
        """
        if torch.compiler.is_compiling():
            raise RuntimeError(_COMPILE_MESSAGE)
        refuse_unseen_state("Pipe.forward")
        input = self._input(inputs, kwargs)
        self._check_open()
        _refuse_sharded(self, "forward")
        _refuse_router_loss(self)
        if not self.partitions:
            _check_holds_tensor(input)
            return input
        check_input(input)
        warn_if_workers_unseen(stacklevel=4)  # forward, Module._call_impl, __call__, the caller
        # One call at a time: two threads calling one Pipe run one after the other.
        with self._runtime.lock:
            self._check_open()  # a close() may have come while this call waited
            return self._run(input)

    def _input(self, inputs: tuple[Value, ...], kwargs: dict[str, Value]) -> Value:
        if self.call_style == "tuple" and (len(inputs) > 1 or not (inputs or kwargs)):
            raise TypeError(
                f"Pipe.forward takes one input, got {len(inputs)}; pass several as a tuple, "
                "pipe((x, y)), or build the Pipe with call_style='positional' to call pipe(x, y)"
            )
        if kwargs:
            return self._first_call(inputs, kwargs)
        if self.call_style == "positional":
            # The value the first partition is called with, spread (runtime/partitions.py):
            # one argument that is not a tuple stays itself, one tuple stays one argument.
            single = len(inputs) == 1 and type(inputs[0]) is not tuple
            return inputs[0] if single else inputs
        return inputs[0]

    def _run(self, input: Value) -> Value:
        batches = scatter(to_device(input, self.devices[0]), self.chunks)
        self._refuse_rows_across(batches, gathered=True)
        hooks = list(self._completion_hooks.values())
        rows = [b.rows() for b in batches]
        stop = checkpoint_stop(self.checkpoint, len(batches), self.training)
        if stop:
            refuse_reparametrized(self, "this Pipe")
            refuse_cached_parametrizations(self, "this Pipe, which recomputes,")
            refuse_lazy(self.partitions)
        with self._one_pass(batches):
            self._driver.run(batches, stop, hooks, sum(rows))
        return gather(batches, rows)

    def _train(self, call: StepCall) -> torch.Tensor | tuple[torch.Tensor, Value]:
        started = time.perf_counter()
        reduction = self._check_step(call)
        chosen = resolve_schedule(call.schedule)
        warn_if_workers_unseen(stacklevel=3)  # _train, PipeBase.step, the caller
        value = self._input_of(call.input, call.kwargs)
        with self._runtime.lock:
            self._check_open()
            return self._step(
                self._scatter_input(value),
                self._scatter_target(call.target),
                call,
                chosen,
                reduction,
                started,
            )

    def _check_step(self, call: StepCall) -> LossReduction:
        self._check_call("step")
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                "Pipe.step cannot run inside a backward pass (a hook or an autograd "
                "Function's backward): its workers' backward would wait for the device thread "
                "running this one; call it from ordinary code"
            )
        return self._check_step_arguments(call)

    def _check_call(self, method: str) -> None:
        if torch.compiler.is_compiling():
            raise RuntimeError(_COMPILE_MESSAGE)
        refuse_unseen_state(f"Pipe.{method}")
        self._check_open()
        if not self.partitions:
            raise ValueError(f"Pipe.{method} needs at least one partition; this Pipe is empty")
        _refuse_sharded(self, method)

    def _scatter_input(self, input: Value) -> list[Batch]:
        """The input as micro-batches on the first device, as ``step`` and ``evaluate`` take it."""
        if not isinstance(input, tuple) or self.call_style != "positional":
            check_input(input)
        return scatter(to_device(input, self.devices[0]), self.chunks)

    def _scatter_target(self, target: Value) -> list[Batch]:
        """The target as micro-batches on the last device."""
        return self._micro_batches(target, self.devices[-1], "target")

    def _step(
        self,
        batches: list[Batch],
        targets: list[Batch],
        call: StepCall,
        schedule: Schedule,
        loss_reduction: LossReduction,
        started: float,
    ) -> torch.Tensor | tuple[torch.Tensor, Value]:
        n = len(self.partitions)
        workers = schedule.workers(n)
        if workers > n:
            raise ValueError(
                f"{schedule!r} needs {workers} workers, but the Pipe has {n} partitions (one "
                "worker each)"
            )
        micro_batches = MicroBatches(batches, targets, _rows_of(batches, targets))
        self._check_token_loss(batches, loss_reduction, call.loss_divisor)
        self._refuse_rows_across(batches, call.return_outputs)
        programs, simulation = self._programs(schedule, len(batches))
        self._refuse_reordered_updates(schedule, programs, range(n))
        router = self._router_tally(call, batches, programs)
        by_worker = programs_by_worker(programs, self._thread_of)
        hooks = list(self._completion_hooks.values())
        reached, late = self._reached_by_the_caller(micro_batches, range(n))
        self.last_step = None  # a step that fails midway reports nothing, not the last one's
        run = self._step_run(
            call,
            loss_reduction,
            programs,
            micro_batches,
            [partial(_unless_late, hooks, late)] if late else hooks,
            _worker_stages(programs, by_worker),
            at_end=reached,
            router=router,
        )
        thread_of_program = _thread_of_program(len(programs), by_worker)
        begin_explicit_step(simulation.idle_on(programs, thread_of_program).stages)
        with self._one_pass(batches), run.holding_hooks(), run.routing():
            self._run_programs(run, programs, by_worker, simulation)
            run.finish()
        for j in late:
            for hook in hooks:
                hook(j)
        loss = run.with_router_loss(run.loss())
        self.last_step = StepReport(
            schedule,
            simulation,
            self._measured(run, programs, thread_of_program),
            time.perf_counter() - started,
        )
        if call.return_outputs:
            return loss, gather(run.outputs, micro_batches.rows)
        return loss

    def _run_programs(
        self,
        run: StepRun,
        programs: list[Program],
        by_worker: dict[int, list[int]],
        simulation: Simulation | None = None,
    ) -> None:
        """Run a step's (or an evaluation's) programs: ``by_worker[w]`` on worker ``w``.

        ``simulation``: the programs' validation (a step's).
        """
        run.run(programs, self._workers, by_worker, simulation)

    def _evaluate(self, call: EvaluateCall) -> Any:
        self._check_call("evaluate")
        reduction = self._check_evaluate_arguments(call)
        if call.loss_fn is not None and call.target is None:
            raise TypeError("Pipe.evaluate got a loss_fn but no target: pass both, or neither")
        warn_if_workers_unseen(stacklevel=3)  # _evaluate, PipeBase.evaluate, the caller
        with self._runtime.lock:
            self._check_open()
            batches = self._scatter_input(self._input_of(call.input, call.kwargs))
            targets = self._scatter_target(call.target) if call.loss_fn is not None else []
            rows = _rows_of(batches, targets) if targets else [b.rows() for b in batches]
            self._check_token_loss(batches, reduction, call.loss_divisor)
            self._refuse_rows_across(batches, call.loss_fn is None or call.return_outputs)
            router = self._router_tally(call, batches, None)
            n = len(self.partitions)
            programs = forward_programs(len(batches), n, n)
            by_worker = programs_by_worker(programs, self._thread_of)
            thread_of_program = _thread_of_program(len(programs), by_worker)
            begin_explicit_step(forward_idle(programs, thread_of_program, n).stages)
            with self._evaluating(), self._runtime.watching(batches):
                run = self._evaluation_run(
                    call,
                    reduction,
                    MicroBatches(batches, targets, rows),
                    call.return_outputs or call.loss_fn is None,
                    _worker_stages(programs, by_worker),
                    router=router,
                )
                with run.routing():
                    self._run_programs(run, programs, by_worker)
        if call.loss_fn is None:
            return gather(run.outputs, rows)
        loss = run.with_router_loss(run.loss())
        return (loss, gather(run.outputs, rows)) if call.return_outputs else loss

    def __getstate__(self) -> dict[str, Any]:
        # Threads, queues and locks are not copied: a copy, an unpickled Pipe
        # and a loaded torch.save start workers of their own. Partition
        # backward hooks belong to whoever registered them (DataParallel's
        # reducer) and stay with the original.
        state = self.__dict__.copy()
        for name in _RUNTIME_STATE:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._start()

    def __len__(self) -> int:
        return sum(self.balance)

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    @overload
    def __getitem__(self, index: int) -> nn.Module: ...

    @overload
    def __getitem__(self, index: slice) -> nn.Sequential: ...

    def __getitem__(self, index: int | slice) -> nn.Module:
        """Layer ``index``; a slice gives an ``nn.Sequential`` of those layers (no pipeline)."""
        names = [name for partition in self.partitions for name in partition._modules]
        layers = list(self)
        if isinstance(index, slice):
            return nn.Sequential(OrderedDict(zip(names[index], layers[index], strict=True)))
        try:
            position = operator.index(index)
        except TypeError:
            raise TypeError(
                f"Pipe indices must be ints or slices, got {type(index).__name__}"
            ) from None
        if not -len(layers) <= position < len(layers):
            raise IndexError(
                f"layer index {position} out of range for a Pipe of {len(layers)} layers"
            )
        return layers[position]

    def to(self, *args: Any, **kwargs: Any) -> Pipe:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            self._refuse_move(torch.device(device), "to")
        return super().to(*args, **kwargs)

    def to_empty(self, *, device: Device | None, recurse: bool = True) -> Pipe:
        if device is not None:
            self._refuse_move(normalize_device(device), "to_empty")
        return super().to_empty(device=device, recurse=recurse)

    def cuda(self, device: Device | None = None) -> Pipe:
        self._refuse_move(normalize_device("cuda" if device is None else device), "cuda")
        return self

    def cpu(self) -> Pipe:
        self._refuse_move(torch.device("cpu"), "cpu")
        return self

    def _refuse_move(self, device: torch.device, method: str) -> None:
        target = normalize_device(device)
        if any(d != target for d in self.devices):
            placed = ", ".join(str(d) for d in self.devices)
            raise ValueError(
                f"Pipe.{method}({target}) would move partitions off their devices ({placed}); "
                "a Pipe places each partition at construction: pass devices=[...] to Pipe "
                "instead of moving it"
            )


_RUNTIME_STATE = (
    "_validated",
    "last_step",
    "_workers",
    "_thread_of",
    "_finalizer",
    "_runtime",
    "_driver",
    "_completion_hooks",
)

_COMPILE_MESSAGE = (
    "torch.compile(pipe) is not supported: the Pipe runs its partitions on worker threads, "
    "which a compiled graph cannot contain. Compile the layers instead, in place (which keeps "
    "the plain model's state_dict keys), and pipeline them: for layer in model: "
    "layer.compile(); Pipe(model, balance, ...)"
)


def _place(partitions: list[nn.Sequential], devices: list[torch.device]) -> None:
    """Move each partition to its device; a parameter tied across devices to its first user's."""
    check_sharing(partitions, devices)
    with find_loans(partitions, devices).away():
        for partition, device in zip(partitions, devices, strict=True):
            partition.to(device)


def _refuse_router_loss(pipe: Pipe) -> None:
    """Refuse ``pipe(x)`` of a model asking for its router loss, which no micro-batch holds."""
    if asked(pipe._router_loss) is not None:
        raise ValueError(
            f"{ASKED}: transformers adds a "
            "load-balancing loss over the whole batch to out.loss and out.aux_loss, which "
            "pipe(x), gathering each micro-batch's output, cannot give. Train with "
            "pipe.step(..., schedule='gpipe') and evaluate with pipe.evaluate(..., loss_fn), "
            "which add it over the whole batch, or set output_router_logits False in the "
            "model's config"
        )


def _refuse_sharded(pipe: Pipe, method: str) -> None:
    """Refuse FSDP2 units in a Pipe: its partitions' threads would race their collectives."""
    units = fsdp_units(pipe)
    if units:
        raise ValueError(
            f"Pipe.{method}: {type(units[0]).__name__} is sharded with FSDP2 (fully_shard), "
            "which a Pipe does not support: its partitions run on threads of one process, "
            "whose collectives would interleave in no fixed order. Shard the stages of a "
            "pipeline.distributed.DistributedPipe instead (docs/distributed_pipe.md, 'Sharded "
            "stages'), or replicate the Pipe with pipeline.DataParallel"
        )


def _worker_stages(programs: list[Program], by_worker: dict[int, list[int]]) -> list[list[int]]:
    """The stages each worker runs: those of the programs ``by_worker`` gives it."""
    return [sorted({a.stage for k in ks for a in programs[k]}) for ks in by_worker.values()]


def _unless_late(hooks: list[Hook], late: list[int], j: int) -> None:
    """Partition ``j``'s completion hooks, unless it is final only at the step's end."""
    if j not in late:
        for hook in hooks:
            hook(j)


def _thread_of_program(count: int, by_worker: dict[int, list[int]]) -> list[int]:
    """The thread that runs each of ``count`` programs; an empty one counts as a worker of its own.

    >>> _thread_of_program(3, {0: [0, 2], 1: [1]})
    [0, 1, 0]
    """
    thread_of = [-1 - k for k in range(count)]
    for worker, ks in by_worker.items():
        for k in ks:
            thread_of[k] = worker
    return thread_of


def _rows_of(batches: list[Batch], targets: list[Batch]) -> list[int]:
    """The micro-batches' rows, once the target splits like the input."""
    rows = [b.rows() for b in batches]
    if [t.rows() for t in targets] != rows:
        raise ValueError(
            f"target splits into micro-batches of {[t.rows() for t in targets]} rows but the "
            f"input into {rows}: give the target the input's batch size (dim 0)"
        )
    return rows


def _check_holds_tensor(input: Value) -> None:
    if not any(isinstance(leaf, torch.Tensor) for leaf in Batch(input).leaves):
        raise TypeError(f"Pipe input must be a tensor or hold tensors, got {type(input).__name__}")
