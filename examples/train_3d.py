"""pp x fsdp x tp on one DeviceMesh: a Llama-shaped decoder, split, pipelined, sharded, checked.

Run: torchrun --nproc_per_node=8 examples/train_3d.py [--steps 3]

Eight processes form a ``DeviceMesh`` of pp=2 x dp=2 x tp=2. The model is
a plain ``nn.Module`` (token embedding, blocks of RMSNorm + causal
attention and RMSNorm + SwiGLU MLP, a final RMSNorm, an untied head), cut
into pieces by ``pipeline.split``; a ``DistributedPipe`` on the mesh's "pp"
group holds a stage per process. In each stage, torch's
``parallelize_module`` splits every block's linear layers over "tp"
(column-wise q, k, v, gate and up; row-wise o and down), and torch's
``fully_shard`` makes each module the model calls (embedding, blocks, final
norm, head: a piece each) an FSDP2 unit over "dp". The two dp
replicas take halves of each batch; the tp ranks of a replica the same half.

After a few AdamW steps every process gathers its parameters whole and
compares them with the plain model trained the same way in one process, in
float64: the verdict is printed, and the exit code is 1 if they differ.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import pipeline
from pipeline.distributed import DistributedPipe, init_process_group_from_env
from pipeline.split import Piece

TOLERANCE = 1e-10  # float64: rounding differs with the order of sums, nothing more


class Attention(nn.Module):
    """Causal self-attention; under tensor parallelism each tp rank holds some of the heads."""

    def __init__(self, width: int, head_width: int) -> None:
        super().__init__()
        self.head_width = head_width
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape

        def heads(projection: nn.Linear) -> Tensor:
            # -1 heads: this tp rank's share of them once q, k and v are split column-wise.
            return projection(x).view(batch, length, -1, self.head_width).transpose(1, 2)

        mixed = F.scaled_dot_product_attention(
            heads(self.q), heads(self.k), heads(self.v), is_causal=True
        )
        return self.o(mixed.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    """Llama's SwiGLU feed-forward layer."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, width: int, head_width: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(width)
        self.attention = Attention(width, head_width)
        self.mlp_norm = nn.RMSNorm(width)
        self.mlp = MLP(width, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """A Llama-shaped language model: embedding, blocks, final norm, untied head."""

    def __init__(self, vocab: int, width: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, width // heads, 2 * width) for _ in range(blocks))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# Megatron's split of a block: column-wise into the heads and the hidden layer, row-wise out.
TP_PLAN = {
    "attention.q": ColwiseParallel(),
    "attention.k": ColwiseParallel(),
    "attention.v": ColwiseParallel(),
    "attention.o": RowwiseParallel(),
    "mlp.gate": ColwiseParallel(),
    "mlp.up": ColwiseParallel(),
    "mlp.down": RowwiseParallel(),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps")
    parser.add_argument("--blocks", type=int, default=4, help="decoder blocks")
    parser.add_argument("--width", type=int, default=16, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (even: tp=2)")
    parser.add_argument("--vocab", type=int, default=32, help="vocabulary size")
    parser.add_argument("--length", type=int, default=8, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, all replicas")
    parser.add_argument("--chunks", type=int, default=2, help="micro-batches per step")
    parser.add_argument(
        "--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"], help="pipeline schedule"
    )
    return parser.parse_args(argv)


def build(args: argparse.Namespace) -> Decoder:
    torch.manual_seed(0)
    return Decoder(args.vocab, args.width, args.heads, args.blocks).double()


def batches(args: argparse.Namespace) -> list[tuple[Tensor, Tensor]]:
    """The same tokens on every process: each step's inputs and next-token targets."""
    generator = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(args.steps):
        text = torch.randint(0, args.vocab, (args.batch, args.length + 1), generator=generator)
        steps.append((text[:, :-1], text[:, 1:]))
    return steps


def language_model_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def shard(pipe: DistributedPipe, mesh: DeviceMesh) -> None:
    """tp on the decoder blocks of this process's stages, then an FSDP2 unit per module called."""
    for s in pipe.local_stages:
        for piece in cast("list[Piece]", list(pipe.partitions[s])):
            for _, module in piece.blocks:
                if isinstance(module, Block):
                    parallelize_module(module, mesh["tp"], TP_PLAN)
                fully_shard(module, mesh=mesh["dp"])


def train_sharded(args: argparse.Namespace, mesh: DeviceMesh) -> dict[str, Tensor]:
    """The pp x fsdp x tp run: this process's parameters, gathered whole, by name."""
    model = build(args)
    example = torch.zeros(2, args.length, dtype=torch.long)
    # A piece per module the model calls, each run as itself: fully_shard's hooks run when a
    # module is called (the default split would run the embedding and the head as captured ops).
    points = ["embed", *(f"blocks.{i}" for i in range(args.blocks)), "norm", "head"]
    pieces = pipeline.split(model, (example,), points=points)
    pipe = DistributedPipe(
        pieces,
        halves(len(pieces)),
        group=mesh["pp"].get_group(),
        chunks=args.chunks,
    )
    shard(pipe, mesh)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    replica, rows = mesh["dp"].get_local_rank(), args.batch // mesh["dp"].size()
    mine = slice(replica * rows, (replica + 1) * rows)
    for x, y in batches(args):
        optimizer.zero_grad()
        pipe.step(x[mine], y[mine], language_model_loss, schedule=args.schedule)
        optimizer.step()
    weights = {name: whole(p.detach()) for name, p in pipe.named_parameters()}
    pipe.close()
    return weights


def halves(pieces: int) -> list[int]:
    """Two stages of the split's pieces, the second one the larger if they are odd."""
    return [pieces // 2, pieces - pieces // 2]


def whole(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train_plain(args: argparse.Namespace) -> dict[str, Tensor]:
    """The plain model trained the same way, on each whole batch, in this process alone."""
    model = build(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x, y in batches(args):
        optimizer.zero_grad()
        language_model_loss(model(x), y).backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    env = init_process_group_from_env()
    if env.world_size != 8:
        raise SystemExit(f"run it in 8 processes (pp=2 x dp=2 x tp=2), not {env.world_size}")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    if env.rank == 0:
        print(
            f"Llama-shaped decoder: {args.blocks} blocks of width {args.width}, {args.heads} "
            f"heads; pp=2 x dp=2 x tp=2; {args.steps} AdamW steps, schedule {args.schedule}",
            flush=True,
        )
    sharded = train_sharded(args, mesh)
    plain = train_plain(args)
    apart = max((sharded[name] - plain[name]).abs().max().item() for name in sharded)
    worst = torch.tensor(apart, dtype=torch.double)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    # Each parameter is held by its stage's 4 processes (dp x tp): count it once.
    names: list[list[str]] = [[] for _ in range(env.world_size)]
    dist.all_gather_object(names, sorted(sharded))
    compared = set().union(*names)
    passed = float(worst) <= TOLERANCE and compared == set(plain)
    if env.rank == 0:
        verdict = "equal to the plain model" if passed else "DIFFERENT from the plain model"
        print(
            f"{len(compared)} of the plain model's {len(plain)} parameters compared across 8 "
            f"processes, max difference {float(worst):.3g}"
        )
        print(f"verdict: pp x fsdp x tp is {verdict} (float64, tolerance {TOLERANCE:g})")
    del mesh
    gc.collect()
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
