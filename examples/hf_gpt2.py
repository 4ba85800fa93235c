"""GPT-2 from transformers, split by ``pipeline.split`` and trained through ``Pipe.step``.

A small GPT-2 (random initialisation, nothing downloaded; needs the ``hf``
extra) learns the pydoc topics character by character, as ``gpt.py``'s
model does. ``pipeline.split`` cuts the unchanged transformers model at its
blocks; ``balance_by_time`` groups the pieces into CPU partitions; every
step is one ``pipe.step`` with the attention mask given as a keyword
argument, as to the model. A copy of the plain model takes the same steps
on the same batches (dropout is off, so both compute the same thing): the
script prints both losses and exits with 1 if any step's losses differ by
more than ``--tolerance`` (relative), or if the loss did not fall.

Both train in float64, where equality holds to rounding: the losses stayed
within 1.1e-10 (relative) of each other over 40 steps of the former
defaults (4 blocks of 64, batches of 16 x 64), so ``--tolerance`` is 1e-8. In
float32 they drift apart as AdamW amplifies rounding differences: 2e-2
after 35 steps, as far as the plain model drifts from itself trained with
micro-batch accumulation (2.4e-2), so no float32 tolerance would tell a
defect from noise.

    python examples/hf_gpt2.py              # 2 blocks of 32, 20 steps: seconds
    python examples/hf_gpt2.py --steps 40 --layers 4 --width 64 --batch 16 --context 64
    python examples/hf_gpt2.py --layers 12 --width 768 --heads 12 --partitions 4 --chunks 8
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from gpt import Corpus, load_text
from torch import Tensor, nn

import pipeline
from balance import balance_by_time
from pipeline import Pipe

TOLERANCE = 1e-8
TOLERANCE_HELP = "largest relative difference of a step's losses (float64 rounding: 1e-10)"


def tolerance(text: str) -> float:
    """A ``--tolerance``: a relative difference of 0 or more."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"a tolerance is 0 or more, got {text}")
    return value


def lm_loss(output: Any, target: Tensor) -> Tensor:
    """Cross-entropy of a transformers output's logits against the next characters."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def plain_step(
    plain: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: Tensor,
    y: Tensor,
    kwargs: dict[str, Tensor],
    loss_fn: Callable[[Any, Tensor], Tensor],
) -> float:
    """The plain model's step on the batch the pipe took; its loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(plain(x, **kwargs), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def train_both(
    args: argparse.Namespace,
    pipe: Pipe,
    plain: nn.Module,
    loss_fn: Callable[[Any, Tensor], Tensor],
    batch: Callable[[], tuple[Tensor, Tensor, dict[str, Tensor]]],
) -> tuple[list[float], list[float]]:
    """``args.steps`` AdamW steps of the pipe and of the plain model on the same batches.

    ``batch()`` gives a step's input, target and keywords. Returns both
    losses of every step; prints a line every ``--log-every`` steps.
    """
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=args.lr)
    losses: list[float] = []
    plain_losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y, kwargs = batch()
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.step(x, y, loss_fn, kwargs=kwargs, schedule=args.schedule)
        optimizer.step()
        losses.append(float(loss))
        plain_losses.append(plain_step(plain, plain_optimizer, x, y, kwargs, loss_fn))
        log_step(args, step, start, losses[-1], plain_losses[-1])
    pipe.close()
    return losses, plain_losses


def log_step(args: argparse.Namespace, step: int, start: float, loss: float, plain: float) -> None:
    """Every ``--log-every`` steps and at the last: both losses and the tokens per second."""
    if step % args.log_every == 0 or step == args.steps:
        rate = step * args.batch * args.context / (time.perf_counter() - start)
        print(
            f"step {step:4d}/{args.steps}  loss {loss:.4f}  plain model {plain:.4f}  "
            f"{rate:,.0f} tokens/s (both)",
            flush=True,
        )


def verdict(losses: list[float], plain_losses: list[float], tolerance: float) -> int:
    """0 if every step's losses agree within ``tolerance`` (relative) and the loss fell, else 1."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, plain_losses, strict=True))
    print(f"largest relative difference between the losses: {worst:.2e} (tolerance {tolerance})")
    window = max(len(losses) // 10, 1)
    before, after = sum(losses[:window]) / window, sum(losses[-window:]) / window
    print(f"loss {'fell' if after < before else 'did NOT fall'} from {before:.3f} to {after:.3f}")
    return 0 if worst <= tolerance and after < before else 1


def gpt2(vocab: int, args: argparse.Namespace) -> nn.Module:
    """A GPT-2 of ``args.layers`` blocks of ``args.width``, dropout off, in float64."""
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=args.context,
        n_embd=args.width,
        n_head=args.heads,
        n_layer=args.layers,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return transformers.GPT2LMHeadModel(config).double()  # why float64: see the docstring


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--partitions", type=int, default=2, help="CPU partitions")
    parser.add_argument(
        "--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"], help="of pipe.step"
    )
    parser.add_argument("--context", type=int, default=32, help="characters per sequence")
    parser.add_argument("--width", type=int, default=32, help="GPT-2's n_embd")
    parser.add_argument("--heads", type=int, default=4, help="GPT-2's n_head")
    parser.add_argument("--layers", type=int, default=2, help="GPT-2's n_layer")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    parser.add_argument("--tolerance", type=tolerance, default=TOLERANCE, help=TOLERANCE_HELP)
    parser.add_argument("--seed", type=int, default=0, help="initialisation and batches")
    parser.add_argument("--log-every", type=int, default=5, help="steps between two lines")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    corpus = Corpus(load_text(), args.context, args.seed)
    torch.manual_seed(args.seed)
    model = gpt2(len(corpus.chars), args)
    plain = copy.deepcopy(model)

    ids, _ = corpus.batch(max(args.batch // args.chunks, 1))  # one micro-batch
    mask = torch.ones_like(ids)
    start = time.perf_counter()
    seq = pipeline.split(model, (ids,), {"attention_mask": mask})
    split_s = time.perf_counter() - start
    sample = {"attention_mask": mask}
    balance = balance_by_time(args.partitions, seq, ids, kwargs=sample, timeout=0.2, device="cpu")
    pipe = Pipe(seq, balance, devices=["cpu"] * args.partitions, chunks=args.chunks)
    params = sum(p.numel() for p in pipe.parameters())
    print(
        f"GPT-2 (transformers {transformers.__version__}): {args.layers} blocks of width "
        f"{args.width}, {params / 1e6:.2f}M parameters; split into {len(seq)} pieces in "
        f"{split_s:.1f} s; balance {balance} (balance_by_time); chunks {args.chunks}; "
        f"schedule {args.schedule}",
        flush=True,
    )

    def batch() -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        x, y = corpus.batch(args.batch)
        return x, y, {"attention_mask": torch.ones_like(x)}

    losses, plain_losses = train_both(args, pipe, plain, lm_loss, batch)
    return verdict(losses, plain_losses, args.tolerance)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
