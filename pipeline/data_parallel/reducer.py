"""The reducer: turns gradient readiness during backward into overlapped, bucketed all-reduces."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from pipeline.data_parallel.buckets import GradBucket, assign_buckets
from pipeline.data_parallel.replicas import broadcast_from_rank0


class Reducer:
    """Averages gradients across ranks while the backward pass is still running.

    A gradient is "ready" when it is final for this backward. Readiness comes
    from one of two places:

    - per parameter, for any module: the hook on the parameter's gradient
      accumulator, which autograd runs once per backward;
    - per partition, for a pipeline (`partitions` given): there an accumulator
      runs once per micro-batch, so only the pipeline knows when a partition's
      gradients are final, and it calls `on_partition_done(j)`.

    A bucket whose gradients are all loaded is all-reduced at once, but buckets
    are launched strictly in index order, which is identical on every rank,
    because collectives on one group must be issued in the same order
    everywhere. An autograd engine callback at the end of backward loads what
    was never signalled, waits for every all-reduce and writes the averages
    into `.grad`. After the first reduced backward the buckets are rebuilt
    once, in the order the gradients actually became ready on rank 0.

    A parameter without a gradient (without `find_unused`), or a backward in
    which no parameter got one (torch.autograd.grad), is reported by that
    callback, at a point every rank in the same situation reaches having
    issued the same collectives.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        partitions: list[int] | None,
        group: dist.ProcessGroup,
        *,
        cap_bytes: int,
        first_cap_bytes: int,
        find_unused: bool,
        as_view: bool,
    ) -> None:
        self._names = [name for name, _ in named_params]
        self._params = [param for _, param in named_params]
        self._partitions = partitions
        self._group = group
        self._world_size = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self._cap_bytes = cap_bytes
        self._first_cap_bytes = first_cap_bytes
        self._find_unused = find_unused
        self._as_view = as_view

        # Autograd may run hooks on one thread per device at the same time.
        self._lock = threading.Lock()
        self._armed = False
        self._callback_queued = False
        # Each synced forward's number, and whether its backward has averaged the gradients.
        self._iteration = 0
        self._reduced = False
        # The last iteration whose backward averaged: a backward through its output, or an
        # earlier one's, again (retain_graph) would add this replica's own to the averages.
        self._last_reduced = 0
        # Why no step may follow (a failed step left all-reduces the others may lack).
        self._out_of_step: str | None = None
        self._ready = [False] * len(self._params)
        self._ready_order: list[int] = []
        self._missing: list[int] = []
        self._next_launch = 0
        self._rebuilt = False
        self._build_buckets(list(reversed(range(len(self._params)))))
        if partitions is None:
            for index, param in enumerate(self._params):
                param.register_post_accumulate_grad_hook(partial(self._on_accumulated, index))

    @property
    def buckets(self) -> list[GradBucket]:
        """The current buckets, in launch order."""
        return self._buckets

    def prepare_for_forward(self) -> None:
        """Begin a synced forward's step, before the module runs: a replica whose forward
        raises has counted it all the same, so that ``_check_same_step`` sees it if the
        replica goes on while the others average this step."""
        self.check_in_step()
        with self._lock:
            self._start_iteration()

    def step_failed(self) -> None:
        """A step (``Pipe.step``) raised on this replica: if its partitions had launched
        all-reduces, no later step may run.

        Its partitions end on threads of their own, so how far each got before
        the failure stopped them is a matter of timing: the replicas, even all
        failing alike, may have launched different all-reduces, and the next
        step's would pair with another replica's leftovers (gloo aborts the
        process on the sizes, or averages the wrong tensors where they agree).
        """
        with self._lock:
            launched = [b.index for b in self._buckets if b.launched]
            if launched and not self._reduced:
                self._out_of_step = (
                    f"DataParallel: an earlier step raised on this replica after its "
                    f"partitions had launched the all-reduces of gradient buckets {launched}; "
                    "the other replicas, stopped elsewhere, may have launched others, so the "
                    "process group's collectives are out of step and no later step can be "
                    "averaged safely. End the job (torchrun restarts it if asked to)"
                )

    def prepare_for_backward(self, output: Any) -> None:
        """Arm the reducer for the backward of `output`; called after every synced forward
        (whose step ``prepare_for_forward`` began).

        The backward's end is known from a hook on the output's tensors: an
        output that holds none DataParallel can find, while parameters would
        get gradients, is refused, since each replica would keep its own.
        """
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        if not outputs and torch.is_grad_enabled() and any(p.requires_grad for p in self._params):
            raise TypeError(
                f"DataParallel: the module returned {type(output).__name__}, in which it found "
                "no tensor that requires grad (it looks in tensors, lists, tuples, dicts and "
                "dataclasses); it averages the gradients when the backward through those "
                "tensors ends, so a backward through others would leave each replica its own "
                "gradients. Return the tensors in one of those containers"
            )
        with self._lock:
            self._armed = True
        for tensor in outputs:
            tensor.register_hook(partial(self._on_output_grad, self._iteration))
        if self._find_unused and self._partitions is None:
            self._mark_unreached_ready(leaves_reached(outputs))

    def prepare_for_step(self) -> None:
        """Arm the reducer for a step that runs its own backward (``Pipe.step``).

        The pipeline signals each partition as its last backward ends; the
        caller then calls ``finish_step``, in place of the end-of-backward
        callback that ``prepare_for_backward`` queues.
        """
        with self._lock:
            self._start_iteration()
            self._armed = True

    def finish_step(self) -> None:
        """Reduce what was not signalled, wait for every all-reduce, write the averages."""
        self._finish_backward()

    def disarm(self) -> None:
        """Let the next backward accumulate gradients locally (no_sync)."""
        with self._lock:
            self._armed = False

    def on_partition_done(self, partition: int) -> None:
        """Pipeline hook: partition `partition`'s gradients are final, reduce its buckets."""
        with self._lock:
            if not self._armed:
                return
            members = self._partition_members.get(partition, [])
            if members and self._ready[members[0]]:
                raise RuntimeError(
                    f"DataParallel: partition {partition} signalled the end of its backward "
                    "twice in one backward pass; run one forward per backward (to accumulate "
                    "gradients over several, use no_sync() for all but the last)"
                )
            for index in members:
                self._mark_ready(index)
            self._launch_in_order()

    def _build_buckets(self, order: list[int]) -> None:
        specs = assign_buckets(
            self._params,
            order,
            cap_bytes=self._cap_bytes,
            first_cap_bytes=self._first_cap_bytes,
            partitions=self._partitions,
        )
        self._buckets = [
            GradBucket(
                k,
                [self._params[i] for i in spec.indices],
                world_size=self._world_size,
                track_use=self._find_unused,
                as_view=self._as_view,
            )
            for k, spec in enumerate(specs)
        ]
        self._slot_of = {
            i: (k, slot) for k, spec in enumerate(specs) for slot, i in enumerate(spec.indices)
        }
        self._partition_members: dict[int, list[int]] = {}
        for spec in specs:
            self._partition_members.setdefault(spec.partition, []).extend(spec.indices)

    @property
    def awaits_backward(self) -> bool:
        """Whether a synced forward's backward has yet to average (the reducer is armed)."""
        return self._armed

    def check_in_step(self) -> None:
        """Raise if an earlier step left this replica's collectives out of step
        (``step_failed``)."""
        if self._out_of_step is not None:
            raise RuntimeError(self._out_of_step)

    def _start_iteration(self) -> None:
        # A backward that launched all-reduces and never finished (it failed, alike on
        # every replica) left them writing into the buckets, after it raised.
        abandoned = not self._reduced and any(bucket.launched for bucket in self._buckets)
        self._iteration += 1
        self._reduced = False
        self._callback_queued = False
        self._ready = [False] * len(self._params)
        self._ready_order = []
        self._missing = []
        self._next_launch = 0
        for bucket in self._buckets:
            bucket.reset(abandoned)

    def _on_output_grad(self, iteration: int, grad: torch.Tensor) -> None:
        # The output's gradient is the first thing the outer backward computes,
        # so the callback lands on its graph task, not on a nested one (such as
        # a checkpoint's recomputation) that would end too early.
        with self._lock:
            if iteration <= self._last_reduced:
                raise RuntimeError(
                    "DataParallel: a second backward through the output of one forward "
                    "(retain_graph=True): the first averaged the gradients, and the second "
                    "would add this replica's own to them (DDP does, silently). Run a forward "
                    "for each backward, or add the losses and call backward once"
                )
            if not self._armed or self._callback_queued:
                return
            self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_accumulated(self, index: int, param: nn.Parameter) -> None:
        with self._lock:
            if not self._armed:
                return
            if self._ready[index]:
                raise RuntimeError(
                    f"DataParallel: parameter '{self._names[index]}' received its gradient "
                    "twice in one backward pass. A module that runs a parameter's backward in "
                    "pieces (micro-batches, reentrant checkpointing) must tell DataParallel when "
                    "gradients are final: wrap a pipeline.Pipe, which implements "
                    "register_partition_backward_hook."
                )
            self._mark_ready(index)
            self._launch_in_order()

    def _mark_unreached_ready(self, reached: set[int]) -> None:
        # Unreached parameters will get no gradient; loading them now lets their
        # buckets launch during backward. Launching waits for the backward, so
        # a forward that is never followed by one leaves no collective behind.
        with self._lock:
            for index, param in enumerate(self._params):
                if id(param) not in reached:
                    self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        self._ready[index] = True
        self._ready_order.append(index)
        if self._params[index].grad is None and not self._find_unused:
            # Reported at the end of backward, which alone can tell an unused
            # parameter from a backward that gave none a gradient. Left out of
            # its bucket, it keeps that bucket and all later ones from launching.
            self._missing.append(index)
            return
        bucket, slot = self._slot_of[index]
        self._buckets[bucket].load(slot)

    def _launch_in_order(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].full:
            bucket = self._buckets[self._next_launch]
            try:
                bucket.launch(self._group)
            except RuntimeError as error:
                raise self._comm_error(bucket.describe(), error) from error
            self._next_launch += 1

    def _finish_backward(self) -> None:
        with record_function("dp.finish_backward"):
            with self._lock:
                self._armed = False
                self._reduced = True
                self._last_reduced = self._iteration
                if not self._buckets:  # a pipeline's stage without parameters: no averages
                    return
                self._load_unsignalled()
                if self._missing:
                    raise RuntimeError(self._missing_message())
                self._launch_in_order()
            for bucket in self._buckets:
                try:
                    bucket.wait()
                except RuntimeError as error:
                    raise self._comm_error(bucket.describe(), error) from error
            self._check_same_step()
            # Only with find_unused can a bucket store nothing: its usage flags,
            # summed across ranks by the all-reduces just waited for, say no
            # rank had a gradient for it, so every rank decides this alike. A
            # backward() accumulates into every parameter its graph reaches, so
            # a backward that left no gradient on any rank either accumulated
            # nothing (torch.autograd.grad, backward(inputs=...)) or has a loss
            # that depends on no parameter anywhere: nothing to train either way.
            # One rank without gradients while others have some is legitimate
            # and passes.
            stored = [bucket.store() for bucket in self._buckets]
            if not any(stored):
                raise RuntimeError(self._no_gradient_message("on any rank"))
            if not self._rebuilt:
                self._rebuild_in_ready_order()

    def _check_same_step(self) -> None:
        """Raise on every replica if the all-reduces just waited for were of different steps.

        A replica whose step or backward raised, and that went on to its next
        one, pairs its collectives with the others' of another step: every
        average is then of two steps, with no error (DDP's too). One more
        all-reduce per step, of each replica's count of synced steps, shows it.
        """
        counts = torch.tensor(
            [self._iteration, -self._iteration],
            dtype=torch.float64,
            device=self._buckets[0].flat.device,
        )
        try:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self._group)
        except RuntimeError as error:
            raise self._comm_error("the replicas' counts of steps", error) from error
        most, least = int(counts[0]), -int(counts[1])
        if most != least:
            raise RuntimeError(
                f"DataParallel: the replicas averaged the gradients of different steps (steps "
                f"{least} to {most} of theirs; this rank's is {self._iteration}): a replica "
                "whose step or backward raised went on to its next step, so its all-reduces "
                "met the others' of another step. These gradients are wrong, and the replicas "
                "stay out of step: end the job (a replica that fails must stop every replica)"
            )

    def _load_unsignalled(self) -> None:
        unsignalled = [i for i, ready in enumerate(self._ready) if not ready]
        if self._partitions is None and not self._find_unused:
            # A plain module's parameters are signalled as their gradients are
            # accumulated: these got none in this backward, whatever .grad holds.
            self._missing.extend(unsignalled)
            return
        for index in unsignalled:
            self._mark_ready(index)

    def _rebuild_in_ready_order(self) -> None:
        with record_function("dp.rebuild_buckets"):
            # Ranks may see different orders (threads, data-dependent branches);
            # all must build the same buckets, so rank 0's order wins.
            order = torch.tensor(self._ready_order, dtype=torch.int64)
            order = order.to(self._buckets[0].flat.device)
            broadcast_from_rank0([order], self._group, "the bucket order")
            self._build_buckets(order.tolist())
            self._rebuilt = True

    def _missing_message(self) -> str:
        # Without find_unused every parameter must get a gradient on every
        # rank; none getting one means torch.autograd.grad (or a loss that
        # depends on no parameter), which a list of every parameter would hide.
        if len(self._missing) == len(self._params):
            return self._no_gradient_message(f"on rank {self._rank}")
        return self._unused_message(sorted(self._missing))

    def _no_gradient_message(self, where: str) -> str:
        return (
            f"DataParallel: no parameter received a gradient in this backward pass {where}. "
            "torch.autograd.grad() through DataParallel is not supported: it computes "
            "gradients without accumulating them into .grad, so there is nothing to average; "
            "use loss.backward() (then read p.grad), or call torch.autograd.grad on the "
            "wrapped module outside DataParallel. (A loss.backward() whose loss depends on "
            "no parameter looks the same: then make the parameters contribute to the loss.)"
        )

    def _unused_message(self, indices: list[int]) -> str:
        names = ", ".join(f"'{self._names[i]}'" for i in indices[:5])
        more = f" and {len(indices) - 5} more" if len(indices) > 5 else ""
        return (
            f"DataParallel: parameter {names}{more} received no gradient in this backward "
            f"pass on rank {self._rank}. If some parameters are legitimately unused in a "
            "step (a branch not taken, a head without loss), pass "
            "find_unused_parameters=True; otherwise make sure every parameter contributes "
            "to the loss."
        )

    def _comm_error(self, what: str, error: RuntimeError) -> RuntimeError:
        return RuntimeError(
            f"DataParallel: all-reduce of {what} failed or timed out on rank {self._rank} "
            f"(a replica that failed stops the others: its own error says why): {error}"
        )


def tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a module's output: a tensor, or lists, tuples, dicts and
    dataclasses of them (as DDP looks)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from tensors_in(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for field in dataclasses.fields(output):
            yield from tensors_in(getattr(output, field.name))


def leaves_reached(outputs: list[torch.Tensor]) -> set[int]:
    """The ids of the leaf tensors whose gradients a backward from `outputs` would accumulate.

    Walks the autograd graph from the outputs' grad_fn nodes down to their
    AccumulateGrad nodes, each of which holds one leaf as `variable`.
    """
    reached = {id(t) for t in outputs if t.requires_grad and t.grad_fn is None}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            reached.add(id(leaf))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return reached
