"""The main job: train a small residual MLP classifier, an ordinary model, through a Pipe.

The data is generated (a spiral of classes in 2-D, lifted to 64 features by a
fixed random projection), so nothing is downloaded. The model is an ordinary
``nn.Module`` (its blocks in an ``nn.ModuleList``, its own ``forward``), not an
``nn.Sequential``: ``pipeline.split`` cuts it into pieces (one per block, one
before and one after), ``balance.balance_by_time`` groups them into
partitions by their measured time, and a ``pipeline.Pipe`` runs them on
whatever devices exist: every CUDA device, or worker threads on the CPU. Each
training step is one ``pipe.step`` (1F1B by default: forward and backward
both run on the partitions' workers); with ``--schedule call`` it is
``pipe(x)`` then ``loss.backward()``. At the end the same model is trained
again without the pipeline from the same seed, and the two final losses
must agree.

    python examples/train.py                       # defaults: 40 steps, 1F1B, seconds
    python examples/train.py --steps 200 --batch-size 512 --width 256 --depth 6
    python examples/train.py --steps 50 --chunks 8 --checkpoint always --schedule gpipe
    python examples/train.py --steps 20 --trace out.json   # timeline and bubble
    python examples/train.py --plan --memory-limit 200MB   # pipeline.plan chooses

With ``--plan``, ``pipeline.plan`` chooses the balance, the micro-batches,
the schedule and the checkpoint mode for the fastest predicted step that fits
``--memory-limit`` per device (AdamW's state counted), prints its table, and
after training puts its predictions beside the last step's measured time and
activations (docs/plan.md).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from collections.abc import Iterator

import torch
from torch import Tensor, nn

import pipeline
from balance import balance_by_time
from pipeline import Pipe
from pipeline.plan import Plan

LAST = 10  # the final loss is the mean of the last LAST steps' losses


class Block(nn.Module):
    """x + W2 gelu(W1 norm(x)): a residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Classifier(nn.Module):
    """An embedding, residual blocks, a normalised head: the model as one would write it."""

    def __init__(self, features: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def spiral_data(samples: int, features: int, classes: int, seed: int) -> tuple[Tensor, Tensor]:
    """Points on ``classes`` interleaved spiral arms, projected to ``features`` dims."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (samples,), generator=gen)
    radius = torch.rand(samples, generator=gen)
    angle = labels * (2 * math.pi / classes) + radius * 3 * math.pi
    angle = angle + 0.15 * torch.randn(samples, generator=gen)
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    projection = torch.randn(2, features, generator=gen)
    inputs = torch.sin(points @ projection * 3) + 0.05 * torch.randn(
        samples, features, generator=gen
    )
    return inputs, labels


def batches(
    inputs: Tensor, labels: Tensor, size: int, seed: int
) -> Iterator[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(inputs), generator=gen)
        for start in range(0, len(order) - size + 1, size):
            index = order[start : start + size]
            yield inputs[index], labels[index]


def pick_devices(partitions: int) -> list[str]:
    count = torch.cuda.device_count()
    if count == 0:
        return ["cpu"] * partitions
    return [f"cuda:{j % count}" for j in range(partitions)]


def throughput_meaning(pipe: Pipe) -> str:
    """What the throughput ratio means on these devices, in a few words."""
    n, m = len(pipe.devices), pipe.chunks
    ideal = n * m / (m + n - 1)  # the stages overlap but for the fill and drain
    if all(device.type == "cpu" for device in pipe.devices):
        return (
            f"on CPU the {n} partitions share {os.cpu_count()} cores and one interpreter, so "
            f"a pipeline is not expected to beat the plain model; with a GPU per partition "
            f"the stages overlap, up to {ideal:.2f}x for {n} partitions and {m} micro-batches"
        )
    return f"up to {ideal:.2f}x for {n} partitions and {m} micro-batches, less the copies"


def train(
    model: nn.Module, args: argparse.Namespace, in_device: str, out_device: str, label: str
) -> tuple[float, float]:
    """Train for ``args.steps`` steps.

    Returns the final loss (the mean of the last ``LAST`` steps' losses: one
    batch's loss is noisy) and the samples per second.
    """
    inputs, labels = spiral_data(8192, args.features, args.classes, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Decaying to zero keeps the end of training stable, so that the rounding
    # differences of micro-batching cannot grow into different final losses.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    loss_fn = nn.CrossEntropyLoss()
    data = batches(inputs, labels, args.batch_size, seed=args.seed)
    start = time.perf_counter()
    losses: list[Tensor] = []
    for step in range(1, args.steps + 1):
        x, y = next(data)
        optimizer.zero_grad(set_to_none=True)
        if isinstance(model, Pipe) and args.schedule != "call":
            measure = args.plan and step == args.steps  # for plan.check
            loss = model.step(x, y, loss_fn, schedule=args.schedule, measure_memory=measure)
        else:
            output = model(x.to(in_device))
            assert isinstance(output, Tensor)
            loss = loss_fn(output, y.to(out_device))
            loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.detach())
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - start
            rate = step * args.batch_size / elapsed
            print(
                f"[{label}] step {step:4d}/{args.steps}  loss {loss.item():.4f}  "
                f"{rate:8.0f} samples/s",
                flush=True,
            )
    elapsed = time.perf_counter() - start
    return torch.stack(losses[-LAST:]).mean().item(), args.steps * args.batch_size / elapsed


def one_step_difference(
    initial: nn.Module, args: argparse.Namespace, balance: list[int], devices: list[str]
) -> float:
    """Largest gradient difference of one step, pipe against plain model, both in float64.

    Equality holds to rounding there (about 1e-16), where float32 training
    only agrees to a tolerance: AdamW amplifies rounding differences step by
    step, so the final losses are compared to 1%.
    """
    plain = copy.deepcopy(initial).double()
    x, y = spiral_data(args.batch_size, args.features, args.classes, seed=args.seed + 1)
    x = x.double()
    sample = x[: max(2, args.batch_size // args.chunks)]
    pipe = Pipe(
        pipeline.split(copy.deepcopy(plain), (sample,)),
        balance,
        devices=devices,
        chunks=args.chunks,
        checkpoint=args.checkpoint,
    )
    loss_fn = nn.CrossEntropyLoss()
    if args.schedule == "call":
        loss_fn(pipe(x), y.to(devices[-1])).backward()
    else:
        pipe.step(x, y, loss_fn, schedule=args.schedule)
    loss_fn(plain.to(devices[0])(x.to(devices[0])), y.to(devices[0])).backward()
    pipe.close()
    return max(
        (a.grad.to(b.grad.device) - b.grad).abs().max().item()
        for a, b in zip(pipe.parameters(), plain.parameters(), strict=True)
        if a.grad is not None and b.grad is not None
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=positive, default=40, help="training steps")
    parser.add_argument("--batch-size", type=positive, default=128, help="samples per step")
    parser.add_argument(
        "--chunks", type=positive, help=f"micro-batches per step (default {CHOSEN['chunks']})"
    )
    parser.add_argument(
        "--partitions", type=positive, default=2, help="pipeline partitions (CUDA devices, or CPU)"
    )
    parser.add_argument(
        "--checkpoint",
        choices=["always", "except_last", "never"],
        help="which micro-batches' activations are recomputed in backward "
        f"(default {CHOSEN['checkpoint']})",
    )
    parser.add_argument(
        "--schedule",
        choices=["1f1b", "gpipe", "interleaved", "zb-h1", "zb-h1-peak", "call"],
        help="the schedule of pipe.step; 'call': pipe(x) then loss.backward() "
        f"(default {CHOSEN['schedule']})",
    )
    parser.add_argument("--width", type=int, default=128, help="the blocks' width")
    parser.add_argument("--depth", type=int, default=4, help="residual blocks")
    parser.add_argument("--features", type=int, default=64, help="input features of the data")
    parser.add_argument("--classes", type=int, default=5, help="spiral arms, one class each")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="weights, data and batch order")
    parser.add_argument(
        "--balance-timeout",
        type=float,
        default=1.0,
        help="seconds balance_by_time spends timing the pieces",
    )
    parser.add_argument("--log-every", type=positive, default=10, help="steps between two lines")
    parser.add_argument(
        "--trace", metavar="PATH", help="write a Chrome trace of the pipe's steps, print its bubble"
    )
    parser.add_argument(
        "--no-compare", action="store_true", help="skip training the plain model for comparison"
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="let pipeline.plan choose balance, chunks, schedule and checkpoint mode",
    )
    parser.add_argument(
        "--memory-limit",
        type=byte_count,
        help="with --plan: bytes per device, e.g. 200MB, 1GiB, 5e8 (default 1GiB)",
    )
    args = parser.parse_args(argv)
    given = [f"--{name}" for name in CHOSEN if getattr(args, name) is not None]
    if args.plan and given:
        parser.error(f"--plan chooses {', '.join(given)} itself: drop them, or drop --plan")
    if not args.plan and args.memory_limit is not None:
        parser.error("--memory-limit is the planner's: add --plan, or drop it")
    for name, default in CHOSEN.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.memory_limit is None:
        args.memory_limit = byte_count("1GiB")
    return args


# What --plan chooses, and what is used without it.
CHOSEN: dict[str, object] = {"chunks": 4, "checkpoint": "except_last", "schedule": "1f1b"}


def positive(text: str) -> int:
    """A whole number of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def byte_count(text: str) -> int:
    """``'200MB'``, ``'1GiB'`` or ``'5e8'`` as a number of bytes."""
    number = text.rstrip("BbKkMmGgIi")
    unit = text[len(number) :].lower() or "b"
    if unit not in UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit {unit!r} in {text!r}: use B, MB or MiB...")
    try:
        count = int(float(number) * UNITS[unit])
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 200MB)") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"a size must be 1 byte or more, got {text!r}")
    return count


def planned(seq: nn.Sequential, args: argparse.Namespace, devices: list[str]) -> Plan:
    """``pipeline.plan``'s choice for one step's batch; ``args`` take its settings."""
    x, y = spiral_data(args.batch_size, args.features, args.classes, seed=args.seed)
    plan = pipeline.plan(
        seq,
        x,
        y,
        nn.CrossEntropyLoss(),
        devices=devices,
        batch_size=args.batch_size,
        memory_limit=args.memory_limit,
        optimizer_bytes_per_param=8,  # AdamW's two moments in float32
    )
    print(plan)
    args.chunks, args.schedule, args.checkpoint = plan.chunks, plan.schedule, plan.checkpoint
    return plan


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = Classifier(args.features, args.width, args.depth, args.classes)
    plain = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    devices = pick_devices(args.partitions)
    # A micro-batch as the pipe will run it: the split accepts any batch size,
    # and balance_by_time times each piece on it, forward and backward.
    sample = spiral_data(max(2, args.batch_size // args.chunks), args.features, args.classes, 1)[0]
    seq = pipeline.split(model, (sample,))
    plan = planned(seq, args, devices) if args.plan else None
    if plan is not None:
        balance, chosen_by = plan.balance, "pipeline.plan"
        pipe = plan.pipe()
    else:
        balance, chosen_by = (
            balance_by_time(
                args.partitions, seq, sample, timeout=args.balance_timeout, device=devices[0]
            ),
            "balance_by_time",
        )
        pipe = Pipe(seq, balance, devices=devices, chunks=args.chunks, checkpoint=args.checkpoint)
    params = sum(p.numel() for p in pipe.parameters())
    print(
        f"model: {type(model).__name__} split into {len(seq)} pieces, {params / 1e6:.2f}M "
        f"parameters; {chosen_by} {balance} on "
        f"{[str(d) for d in pipe.devices]}; chunks {args.chunks}; checkpoint {args.checkpoint}; "
        f"schedule {args.schedule}"
    )

    with pipeline.trace(enabled=args.trace is not None) as timeline:
        pipe_loss, pipe_rate = train(pipe, args, devices[0], devices[-1], "pipe")
    if args.trace is not None:
        timeline.save_chrome_trace(args.trace)
        print(f"trace of the pipe's steps written to {args.trace} (chrome://tracing, Perfetto)")
        print(timeline.summary())
        print(timeline.render())
    if plan is not None:
        print(plan.check(pipe))
    final = f"final loss (mean of the last {min(LAST, args.steps)} steps)"
    print(f"pipe:  {final} {pipe_loss:.4f}, {pipe_rate:.0f} samples/s")
    if args.no_compare:
        return 0

    plain_device = devices[0]
    plain.to(plain_device)
    plain_loss, plain_rate = train(plain, args, plain_device, plain_device, "plain")
    print(f"plain: {final} {plain_loss:.4f}, {plain_rate:.0f} samples/s")
    print(f"throughput pipe/plain: {pipe_rate / plain_rate:.2f}x ({throughput_meaning(pipe)})")
    agree = math.isclose(pipe_loss, plain_loss, rel_tol=1e-2)
    print(
        f"final losses {'agree' if agree else 'DIFFER'} "
        f"within 1% (pipe {pipe_loss:.5f}, plain {plain_loss:.5f})"
    )
    difference = one_step_difference(initial, args, balance, devices)
    equal = difference < 1e-10
    print(
        f"one step from equal weights in float64: gradients {'equal' if equal else 'DIFFER'}, "
        f"largest difference {difference:.1e} (rounding: under 1e-10)"
    )
    return 0 if agree and equal else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
