"""The router loss: a Mixture-of-Experts load-balancing loss over the whole batch, in a step.

Like DeferredBatchNorm's statistics (``batchnorm.py``), a value over every
micro-batch of a mini-batch, which no micro-batch holds alone.

transformers' MoE models (Mixtral, Qwen2-MoE, ...) asked for their router
logits (``config.output_router_logits``) add to their loss Switch
Transformer's load-balancing loss over every token of the batch and every
router call (each MoE layer's)::

    aux = E / N² · Σ_e c_e s_e

E experts; N the tokens counted, once per router call (weighed by the
attention mask); c_e how many of them have expert e among the top k of
their router probabilities p = softmax(z); s_e the sum of their p_e. A
product of two sums over the whole batch: no sum of losses per micro-batch
equals it. Its gradient, for one token's router logits z, is::

    ∂aux/∂z = E / N² · w · p ⊙ (c - ⟨p, c⟩)        (w: the token's mask)

which needs the whole batch's counts c and N, and nothing else of the other
micro-batches: both known once every forward has run. A step whose every
forward runs before any backward (GPipe) is then exact::

  forward of micro-batch i   each router's hook adds its tokens to c, s and
                             N (once: not again when the task is
                             recomputed), and the block around it returns
                             its output through _AddRouterGradient, which
                             keeps the tokens' p
  first backward             close(): c, s, N of the whole batch, summed
                             over devices (and over processes: ``reduce``)
  backward of micro-batch i  _AddRouterGradient passes its output's gradient
                             on, and gives each router's logits z the
                             gradient above, times the loss's coefficient;
                             autograd adds it to z's own

        x ──► block ────────────────────────► out ─┐
               │                                    ├─► _AddRouterGradient ─► out ─► next piece
               └─ router ─► z ─┬─► experts ─► ...   │   (the same tensor)
                               └────────────────────┘
        backward: out's gradient passes through; z gets the loss's term too

The step adds ``coefficient · aux`` to its loss, as transformers adds it to
``out.loss``. At its end it checks that every block output the term rode on
had a backward: one that the model does not carry on would drop the term.
On GPUs each stream sums its own tokens (a stream orders only its own
work), ``close`` waits for those streams once, and a stream reads the
masks and the totals from copies queued on it: no sync per router call.
``RouterLossSource`` is what a split model gives
(``pipeline/split/routers.py``); this file knows no model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from pipeline.runtime.phase import is_recomputing
from pipeline.runtime.rng import running_microbatch
from pipeline.runtime.stream import Stream, copy_to, current_stream, synchronize

__all__ = [
    "ASKED",
    "Router",
    "RouterLossSource",
    "RouterSettings",
    "RouterTally",
    "asked",
    "check_loss",
    "gradient",
    "recording_logits",
    "step_tally",
    "tokens",
    "value",
]


@dataclass(frozen=True)
class Router:
    """A module whose output holds router logits (at ``index``), and the block it runs in."""

    name: str
    module: nn.Module = field(repr=False)
    block: nn.Module = field(repr=False)
    index: int


@dataclass(frozen=True)
class RouterSettings:
    """What the loss is made of, read from the model at each step: it may change between steps."""

    coefficient: float
    experts: int
    top_k: int


class RouterLossSource(Protocol):
    """What a model with a router loss gives a pipe (a split transformers model's router_loss)."""

    @property
    def routers(self) -> list[Router]: ...

    def settings(self) -> RouterSettings | None:
        """The loss's settings, or None while the model does not ask for the loss."""

    def calls(self, values: list[Any]) -> list[dict[str, Any]]:
        """Each micro-batch's call of the model, by argument name."""

    def recomputes_itself(self) -> str | None:
        """The name of a module around a router that would run it again in backward (its
        own activation checkpointing, on in training), or None."""


ASKED = "the model asks for its router loss (output_router_logits)"
_OFF = "or set output_router_logits False in the model's config"


def asked(source: RouterLossSource | None) -> RouterSettings | None:
    """The settings of the router loss ``source`` asks for now, or None (none, or not asked)."""
    return None if source is None else source.settings()


def step_tally(
    source: RouterLossSource | None,
    values: list[Any],
    here: set[nn.Module],
    *,
    early_backward: str | None,
    loss_fn: Any,
    grad_scaler: Any,
    divisor: Any,
    reduce: Callable[[Tensor], Tensor] | None = None,
    stepping: bool,
) -> RouterTally | None:
    """A step's or an evaluation's tally, or None without a router loss.

    Refuses, before any work, what would not give the model's loss: a
    schedule with a backward before the last forward (``early_backward``:
    the first such action, as text), no labels (transformers adds
    the loss to ``out.loss`` only with labels), a divisor (the loss is
    added apart from the divided micro-batch losses), an evaluation of
    outputs only, a step through a module that checkpoints itself (its
    recomputation in backward would run routers outside the step's
    micro-batches). ``values``: each micro-batch's first-layer input;
    ``here``: the modules this process runs; ``grad_scaler``: the step's,
    whose scale the loss's gradient takes as the scaled losses' do.
    """
    settings = asked(source)
    if source is None or settings is None:
        return None
    why = _refusal(early_backward, loss_fn, divisor)
    itself = source.recomputes_itself() if stepping and why is None else None
    if itself is not None:
        why = (
            f"{itself!r} checkpoints itself, and would run its routers again in backward, "
            "outside the step's micro-batches: turn its checkpointing off (transformers: "
            "model.gradient_checkpointing_disable()) and let the pipe recompute "
            "(checkpoint='always')"
        )
    calls = source.calls(values)
    if why is None and calls and not isinstance(calls[0].get("labels"), Tensor):
        why = (
            "transformers adds it to out.loss, which the model computes only when given labels: "
            "pass labels in kwargs and a loss_fn returning out.loss"
        )
    if why is not None:
        raise ValueError(
            f"{ASKED}, a load-balancing loss over the whole batch, which a pipe adds as the "
            f"model does; but {why}, {_OFF}"
        )
    routers = [router for router in source.routers if router.module in here]
    masks = [call.get("attention_mask") for call in calls]
    masks = [mask if isinstance(mask, Tensor) else None for mask in masks]
    return RouterTally(settings, routers, len(source.routers), masks, reduce, grad_scaler)


def _refusal(early_backward: str | None, loss_fn: Any, divisor: Any) -> str | None:
    """Why a call cannot have the router loss, or None."""
    if loss_fn is None:
        return (
            "evaluate(input) returns each micro-batch's outputs, which cannot hold it: evaluate "
            "with a loss_fn for the loss, or call the split model itself for its output"
        )
    if early_backward is not None:
        return (
            f"its gradient needs every micro-batch's routing before any backward, and the "
            f"schedule runs {early_backward} before a forward: use schedule='gpipe' (with "
            "checkpoint='always', a stage keeps one micro-batch's activations at a time)"
        )
    if divisor is not None:
        return (
            "loss_divisor would divide the micro-batches' losses and not it: weigh out.loss "
            "with num_items_in_batch instead (docs/split.md)"
        )
    return None


def check_loss(output: Any, loss: Tensor) -> None:
    """Refuse a ``loss_fn`` that did not return ``out.loss`` itself (the router loss joins that)."""
    if getattr(output, "loss", None) is not loss:
        raise ValueError(
            f"{ASKED}, which the step adds once to the sum of the micro-batches' out.loss, as "
            "transformers adds it to out.loss; but loss_fn returned another tensor than "
            f"out.loss: return out.loss itself, {_OFF}"
        )


def tokens(p: Tensor, top_k: int, weights: Tensor | None) -> Tensor:
    """One router call's share: its counts c, its sums s and its tokens N, in one float64 row.

    ``p``: the call's router probabilities, one row per token; ``weights``:
    each token's mask (float64), or None for all ones.
    """
    experts = p.shape[-1]
    _, chosen = torch.topk(p, top_k, dim=-1)
    if weights is None:
        each = torch.ones(chosen.numel(), dtype=torch.float64, device=p.device)
        sums = p.double().sum(0)
        count = torch.full((1,), float(p.shape[0]), dtype=torch.float64, device=p.device)
    else:
        each = weights.repeat_interleave(top_k)
        sums = (p.double() * weights[:, None]).sum(0)
        count = weights.sum().reshape(1)
    counts = torch.zeros(experts, dtype=torch.float64, device=p.device)
    counts.index_add_(0, chosen.reshape(-1), each)
    return torch.cat([counts, sums, count])


def value(totals: Tensor) -> Tensor:
    """``aux`` of the whole batch's ``totals`` (``tokens`` summed): ``E / N² · Σ c_e s_e``."""
    experts = (totals.numel() - 1) // 2
    counts, sums, n = totals[:experts], totals[experts:-1], totals[-1]
    return experts * (counts * sums).sum() / (n * n)


def gradient(p: Tensor, totals: Tensor, scale: float | Tensor, weights: Tensor | None) -> Tensor:
    """``scale · ∂aux/∂z`` for one router call's logits z, whose probabilities are ``p``.

    ``scale``: the coefficient, times a GradScaler's scale (a tensor on
    ``p``'s device) where the step has one.

    As autograd computes it through the model's own softmax: the gradient
    reaching the probabilities is rounded to their dtype, and softmax's
    backward works in float32 at least and rounds once (in half precision
    the result is then the model's, not a more accurate other one).
    """
    experts = p.shape[-1]
    counts, n = totals[:experts], totals[-1]
    wide = torch.promote_types(p.dtype, torch.float32)
    per_token = (counts * (scale * experts) / (n * n))[None, :]
    if weights is not None:
        per_token = per_token * weights[:, None]
    reaching = per_token.to(p.dtype).to(wide)
    q = p.to(wide)
    return (q * (reaching - (q * reaching).sum(-1, keepdim=True))).to(p.dtype)


def _logits(router: Router, output: Any) -> Tensor:
    z = output[router.index] if isinstance(output, tuple | list) else output
    if not isinstance(z, Tensor) or z.dim() != 2:
        shape = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
        raise TypeError(
            f"router {router.name!r} gave {shape} at index {router.index} of its output; the "
            "router loss takes its logits there, one row per token: [tokens, experts]"
        )
    return z


@contextmanager
def recording_logits(routers: list[Router]) -> Iterator[list[Tensor]]:
    """Within the block, each router call's logits, appended in call order (a plain forward)."""
    found: list[Tensor] = []
    handles = [
        router.module.register_forward_hook(
            lambda _m, _a, output, router=router: found.append(_logits(router, output))
        )
        for router in routers
    ]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


class RouterTally:
    """One step's router loss: the whole batch's c, s and N, and the gradient they give.

    ``masks[i]``: micro-batch ``i``'s attention mask (one weight per token,
    in the order the routers see the tokens), or None. ``routers``: those
    that run in this process, of the model's ``in_model``. ``reduce``: sums
    a tensor over the processes of a DistributedPipe (each process calls it
    once per step, at its first backward), or None in one process.
    ``grad_scaler``: the step's GradScaler, whose scale the gradient takes
    before it is rounded to the logits' dtype, as the scaled loss's does.
    """

    def __init__(
        self,
        settings: RouterSettings,
        routers: list[Router],
        in_model: int,
        masks: list[Tensor | None],
        reduce: Callable[[Tensor], Tensor] | None = None,
        grad_scaler: Any = None,
    ) -> None:
        self.settings = settings
        self._grad_scaler = grad_scaler
        self.routers = routers
        self._in_model = in_model
        # On the CPU, read once here: a worker copies its micro-batch's to its stream.
        self._masks = [None if m is None else m.reshape(-1).to("cpu", torch.float64) for m in masks]
        self._reduce = reduce
        self._lock = threading.Lock()
        # Sums and copies per stream: a GPU stream orders only its own work.
        self._partial: dict[Stream, Tensor] = {}
        self._copies: dict[tuple[int, Stream], Tensor] = {}
        self._calls = 0
        # The blocks' outputs that carry the loss's gradient, and the backwards through them.
        self._carriers = 0
        self._carried = 0
        self._totals: Tensor | None = None
        # Each thread's blocks being run: the router calls inside each.
        self._pending = threading.local()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Within the block (the step), the routers and their blocks are hooked."""
        handles: list[RemovableHandle] = []
        try:
            for router in self.routers:
                handles.append(router.module.register_forward_hook(self._hook_of(router)))
            for block in {id(r.block): r.block for r in self.routers}.values():
                handles.append(block.register_forward_pre_hook(self._enter_block))
                handles.append(block.register_forward_hook(self._leave_block))
            yield
            self._check_carried()
        finally:
            for handle in handles:
                handle.remove()

    def _stack(self) -> list[list[tuple[Tensor, Tensor, Tensor | None]]]:
        stack: list[list[tuple[Tensor, Tensor, Tensor | None]]] | None = getattr(
            self._pending, "stack", None
        )
        if stack is None:
            stack = self._pending.stack = []
        return stack

    def _enter_block(self, _module: nn.Module, _args: Any) -> None:
        self._stack().append([])

    def _leave_block(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        entries = self._stack().pop()
        if not entries or not torch.is_grad_enabled():
            return None
        logits = [z for z, _, _ in entries]
        kept = [(p, weights) for _, p, weights in entries]
        if not is_recomputing():  # a recomputed graph's backward is its forward's
            with self._lock:
                self._carriers += 1
        if isinstance(output, Tensor):
            return _AddRouterGradient.apply(self, kept, output, *logits)
        if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
            first = _AddRouterGradient.apply(self, kept, output[0], *logits)
            return (first, *output[1:])
        raise TypeError(
            f"a block holding routers returned {type(output).__name__}; the router loss adds "
            "its gradient through the block's output, which must be a tensor or a tuple "
            "starting with one"
        )

    def carried(self) -> None:
        """A backward through a block's output: its routers' logits got their terms."""
        with self._lock:
            self._carried += 1

    def _check_carried(self) -> None:
        """Raise if a block's output that carries the loss's gradient had no backward.

        A block whose first output the model does not carry on (split keeps
        routers from being points for this) would leave its routers without
        their terms, and every gradient before them wrong.
        """
        if self._carried != self._carriers:
            raise RuntimeError(
                f"the router loss's gradient reached {self._carried} of the {self._carriers} "
                "block outputs it rides on in this step: a block holding routers returned a "
                "first output that the model does not carry on, so its routers' gradients miss "
                "the loss's term; split with the MoE block or the decoder layer as the point"
            )

    def _hook_of(self, router: Router) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            self.routed(router, output)

        return hook

    def routed(self, router: Router, output: Any) -> None:
        """A call of ``router`` (its forward hook): count its tokens, keep them for backward."""
        z = _logits(router, output)
        i = running_microbatch()
        if i is None or not 0 <= i < len(self._masks):
            raise RuntimeError(
                f"router {router.name!r} ran outside a micro-batch of the step; the router "
                "loss counts each micro-batch's tokens once"
            )
        weights = self._weights(i, z, router)
        p = torch.softmax(z.detach(), dim=-1)
        if not is_recomputing():
            share = tokens(p, self.settings.top_k, weights)
            with self._lock:
                if self._totals is not None:
                    raise RuntimeError(
                        f"router {router.name!r} ran a forward after the step's first backward; "
                        "the router loss needs every forward before any backward (GPipe)"
                    )
                stream = current_stream(share.device)
                held = self._partial.get(stream)
                self._partial[stream] = share if held is None else held + share
                self._calls += 1
        if torch.is_grad_enabled() and z.requires_grad:
            stack = self._stack()
            if not stack:
                raise RuntimeError(f"router {router.name!r} ran outside its block")
            stack[-1].append((z, p, weights))

    def _weights(self, i: int, z: Tensor, router: Router) -> Tensor | None:
        mask = self._masks[i]
        if mask is None:
            return None
        if mask.numel() != z.shape[0]:
            raise ValueError(
                f"router {router.name!r} saw {z.shape[0]} tokens of micro-batch {i}, but its "
                f"attention mask holds {mask.numel()}: the router loss weighs each token by "
                "its mask, and needs one weight per token"
            )
        return self._copied(i, mask, z.device)

    def _copied(self, key: int, tensor: Tensor, device: torch.device) -> Tensor:
        """``tensor`` (on the CPU) on ``device``, copied once per stream that reads it."""
        stream = current_stream(device)
        with self._lock:
            held = self._copies.get((key, stream))
        if held is None:
            held = copy_to(tensor, device)
            with self._lock:
                self._copies[key, stream] = held
        return held

    @property
    def to_meet(self) -> bool:
        """Whether the totals still wait for the other processes': close them before a backward.

        Each process closes at its first backward action, before it waits for
        any gradient: under GPipe its forwards are done then, so once every
        process's are, every forward is. In one process there is nothing to
        meet: the totals close when the first gradient asks for them, which
        comes after the last forward (the last stage's first backward follows it).
        """
        return self._reduce is not None and self._totals is None

    def close(self) -> None:
        """The whole batch's totals, once every forward has run.

        Checks that every router of the model ran once per micro-batch, in
        whichever process: a router that ran without its hook would leave
        its tokens out, and the loss wrong.
        """
        with self._lock:
            if self._totals is not None:
                return
            total = torch.zeros(2 * self.settings.experts + 2, dtype=torch.float64)
            for stream, share in self._partial.items():
                synchronize(stream)  # its sums are read here, on another thread's stream
                total[:-1] += share.cpu()
            total[-1] = self._calls
            if self._reduce is not None:
                total = self._reduce(total).cpu()
            expected = len(self._masks) * self._in_model
            if int(total[-1]) != expected:
                raise RuntimeError(
                    f"the router loss counted {int(total[-1])} router calls when the first "
                    f"backward came, but {len(self._masks)} micro-batches through the model's "
                    f"{self._in_model} routers make {expected}: it needs every forward before "
                    "any backward (GPipe), each router run in a pipe's partition"
                )
            self._totals = total[:-1]

    def totals_on(self, device: torch.device) -> Tensor:
        """The whole batch's totals, on ``device`` (closing them)."""
        self.close()
        assert self._totals is not None
        return self._copied(-1, self._totals, device)

    def scale_on(self, device: torch.device) -> float | Tensor:
        """The gradient's scale: the coefficient, times the GradScaler's scale on ``device``."""
        coefficient = self.settings.coefficient
        if self._grad_scaler is None:
            return coefficient
        one = torch.ones((), dtype=torch.float64, device=device)
        scaled: Tensor = self._grad_scaler.scale(one)
        return coefficient * scaled

    def loss(self) -> Tensor:
        """``coefficient · aux`` of the whole batch (float64, on the CPU)."""
        self.close()
        assert self._totals is not None
        return self.settings.coefficient * value(self._totals)


class _AddRouterGradient(torch.autograd.Function):
    """Its output is the block's; its backward also gives the routers' logits their loss term.

    The routers' probabilities and token weights are saved for backward, so
    that a checkpointed forward keeps none of them and a memory meter
    counts them.
    """

    @staticmethod
    def forward(
        ctx: Any,
        tally: RouterTally,
        kept: list[tuple[Tensor, Tensor | None]],
        output: Tensor,
        *logits: Tensor,
    ) -> Tensor:
        ctx.tally = tally
        ctx.calls = len(kept)
        ctx.save_for_backward(*(p for p, _ in kept), *(weights for _, weights in kept))
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        tally: RouterTally = ctx.tally
        tally.carried()
        saved = ctx.saved_tensors
        terms = [
            gradient(p, tally.totals_on(p.device), tally.scale_on(p.device), weights)
            for p, weights in zip(saved[: ctx.calls], saved[ctx.calls :], strict=True)
        ]
        return (None, None, grad, *terms)
