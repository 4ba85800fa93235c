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

    python examples/hf_gpt2.py
    python examples/hf_gpt2.py --layers 12 --width 768 --heads 12 --partitions 4 --chunks 8
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from gpt import Corpus, load_text
from torch import Tensor, nn

import pipeline
from balance import balance_by_time
from pipeline import Pipe


def lm_loss(output: Any, target: Tensor) -> Tensor:
    """Cross-entropy of a transformers output's logits against the next characters."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def plain_step(
    plain: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, mask: Tensor
) -> float:
    """The plain model's step on the batch the pipe took; its loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(plain(x, attention_mask=mask), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


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
    print(f"loss fell from {before:.3f} to {after:.3f}")
    return 0 if worst <= tolerance and after < before else 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    corpus = Corpus(load_text(), args.context, args.seed)
    config = transformers.GPT2Config(
        vocab_size=len(corpus.chars),
        n_positions=args.context,
        n_embd=args.width,
        n_head=args.heads,
        n_layer=args.layers,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    torch.manual_seed(args.seed)
    model = transformers.GPT2LMHeadModel(config)
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

    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=args.lr)
    losses: list[float] = []
    plain_losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = corpus.batch(args.batch)
        mask = torch.ones_like(x)
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.step(x, y, lm_loss, kwargs={"attention_mask": mask}, schedule=args.schedule)
        optimizer.step()
        losses.append(float(loss))
        plain_losses.append(plain_step(plain, plain_optimizer, x, y, mask))
        log_step(args, step, start, losses[-1], plain_losses[-1])
    pipe.close()
    return verdict(losses, plain_losses, args.tolerance)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
