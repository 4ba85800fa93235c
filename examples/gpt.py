"""A small character-level GPT trained through ``Pipe.step``.

The model is an ``nn.Sequential``: token and position embedding, pre-norm
transformer blocks (causal self-attention with attention dropout, then an
MLP), a final norm and a head whose weight is the token embedding's (tied:
the first and the last partition use one parameter, on one device). The
text is the pydoc topics that ship with Python. The partitions come from
``balance_by_time``; every step is one ``pipe.step`` with the schedule of
``--schedule``. At the end, from the same initial weights and the same
batch, one step of the pipe (dropout off) and one of the plain model, both
in float64, must give the same gradients (to rounding), and the loss must
have fallen.

    python examples/gpt.py                          # 1F1B, 2 partitions, 30 steps
    python examples/gpt.py --steps 150 --batch 32   # longer: the loss goes lower
    python examples/gpt.py --schedule zb-h1 --partitions 4 --chunks 8
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import inspect
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from balance import balance_by_time
from pipeline import Pipe


def load_text() -> str:
    """Text that ships with Python: the pydoc topics, else the source of a few modules."""
    spec = importlib.util.find_spec("pydoc_data.topics")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).read_text(encoding="utf-8")
    import argparse as a
    import inspect as i
    import typing as t

    return "".join(inspect.getsource(module) for module in (a, i, t))


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, context: int, dropout: float) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Small, as in GPT-2: the head's logits start near uniform (also after ``meta``)."""
        nn.init.normal_(self.token.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        return self.dropout(self.token(tokens) + self.position(positions))


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)); attention is causal."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        t = x.size(1)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(diagonal=1)
        h = self.norm1(x)
        attended, _ = self.attention(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)
        x = x + attended
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final norm, then logits against the token embedding (the tied weight)."""

    def __init__(self, embedding: nn.Embedding, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.embedding = embedding

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x) @ self.embedding.weight.t()


def build_model(vocab: int, args: argparse.Namespace) -> nn.Sequential:
    embed = Embed(vocab, args.width, args.context, args.dropout)
    blocks = [Block(args.width, args.heads, args.dropout) for _ in range(args.layers)]
    return nn.Sequential(embed, *blocks, Head(embed.token, args.width))


def language_model_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Corpus:
    """The text as character ids, and random windows of it."""

    def __init__(self, text: str, context: int, seed: int) -> None:
        self.chars = sorted(set(text))
        index = {c: k for k, c in enumerate(self.chars)}
        self.ids = torch.tensor([index[c] for c in text])
        self.context = context
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, rows: int) -> tuple[Tensor, Tensor]:
        starts = torch.randint(len(self.ids) - self.context - 1, (rows,), generator=self.generator)
        windows = torch.stack([self.ids[s : s + self.context + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]


def one_step_gradients_match(
    pipe: Pipe, plain: nn.Module, corpus: Corpus, args: argparse.Namespace
) -> float:
    """Max gradient difference of one step from equal weights, dropout off (eval mode)."""
    x, y = corpus.batch(args.batch)
    pipe.eval()
    plain.eval()
    pipe.zero_grad()
    plain.zero_grad()
    pipe.step(x, y, language_model_loss, schedule=args.schedule)
    language_model_loss(plain(x), y).backward()
    differences = [
        (a.grad - b.grad).abs().max().item()
        for a, b in zip(pipe.parameters(), plain.parameters(), strict=True)
        if a.grad is not None and b.grad is not None
    ]
    return max(differences)


def add_model_arguments(parser: argparse.ArgumentParser, context: int) -> None:
    """The model's size, its checkpointing and the learning rate (shared with train_grid.py)."""
    parser.add_argument(
        "--checkpoint",
        default="except_last",
        choices=["always", "except_last", "never"],
        help="which micro-batches' activations are recomputed in backward",
    )
    parser.add_argument("--context", type=int, default=context, help="characters per sequence")
    parser.add_argument("--width", type=int, default=64, help="embedding width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout probability")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--partitions", type=int, default=2, help="CPU partitions")
    parser.add_argument(
        "--schedule",
        default="1f1b",
        choices=["gpipe", "1f1b", "interleaved", "zb-h1"],
        help="the schedule of pipe.step",
    )
    add_model_arguments(parser, context=64)
    parser.add_argument("--seed", type=int, default=0, help="initialisation and batches")
    parser.add_argument("--log-every", type=int, default=10, help="steps between two lines")
    args = parser.parse_args(argv)
    counts = (args.steps, args.batch, args.chunks, args.partitions, args.log_every, args.heads)
    if min(counts) < 1:
        parser.error(
            "--steps, --batch, --chunks, --partitions, --log-every and --heads must be 1 or more"
        )
    if args.width % args.heads:
        parser.error(f"--heads ({args.heads}) must divide --width ({args.width})")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    corpus = Corpus(load_text(), args.context, args.seed)
    torch.manual_seed(args.seed)
    model = build_model(len(corpus.chars), args)
    initial = copy.deepcopy(model)
    sample, _ = corpus.batch(max(args.batch // args.chunks, 1))
    balance = balance_by_time(args.partitions, model, sample, timeout=0.2, device="cpu")
    devices = ["cpu"] * args.partitions
    pipe = Pipe(model, balance, devices=devices, chunks=args.chunks, checkpoint=args.checkpoint)
    params = sum(p.numel() for p in pipe.parameters())
    print(
        f"GPT: {args.layers} blocks of width {args.width}, vocabulary {len(corpus.chars)}, "
        f"{params / 1e6:.2f}M parameters; text of {len(corpus.ids):,} characters; balance "
        f"{balance} (balance_by_time); chunks {args.chunks}; schedule {args.schedule}",
        flush=True,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = corpus.batch(args.batch)
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.step(x, y, language_model_loss, schedule=args.schedule)
        optimizer.step()
        losses.append(float(loss))
        if step % args.log_every == 0 or step == args.steps:
            rate = step * args.batch * args.context / (time.perf_counter() - start)
            print(f"step {step:4d}/{args.steps}  loss {loss:.4f}  {rate:,.0f} tokens/s", flush=True)

    # In float64, where equality holds to rounding (about 1e-16); float32 only
    # agrees to its own rounding, which a defect of 1e-5 would hide in.
    plain = initial.double()
    check = Pipe(
        copy.deepcopy(plain),
        balance,
        devices=devices,
        chunks=args.chunks,
        checkpoint=args.checkpoint,
    )
    difference = one_step_gradients_match(check, plain, corpus, args)
    print(
        "one step from equal weights, float64: gradients differ from the plain model's by "
        f"{difference:.2e} (rounding: under 1e-10)"
    )
    window = max(len(losses) // 10, 1)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    print(f"loss {'fell' if last < first else 'did NOT fall'} from {first:.3f} to {last:.3f}")
    return 0 if difference < 1e-10 and last < first else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
