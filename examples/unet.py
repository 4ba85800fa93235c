"""Train a small U-Net through a Pipe, its skip connections jumping across partitions.

The U-Net's encoder stashes each level's features; the decoder pops them at
the same level, several partitions later. The skips travel through portals,
straight from the partition that stashes them to the one that pops them.
The script trains the Pipe and the same model as a plain nn.Sequential from
the same seed on generated data, both in float64, where equality holds to
rounding, and checks that every step's losses agree to 1e-9 (relative; in
float32, Adam would amplify rounding differences step by step)::

    python examples/unet.py
    python examples/unet.py --steps 30 --batch-size 32 --size 32
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Generator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.skip import Namespace, pop, skippable, stash


def conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(out_channels, out_channels, 3, padding=1),
        nn.ReLU(),
    )


@skippable(stash=["features"])
class Down(nn.Module):
    """Keeps its input for the decoder, then halves the resolution."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.block = conv_block(in_channels, out_channels)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("features", x)
        return self.block(F.max_pool2d(x, 2))


@skippable(pop=["features"])
class Up(nn.Module):
    """Doubles the resolution and merges the encoder's features of the same level."""

    def __init__(self, in_channels: int, skip_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, in_channels, 2, stride=2)
        self.block = conv_block(in_channels + skip_channels, out_channels)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        features = yield pop("features")
        return self.block(torch.cat([self.up(x), features], dim=1))


def unet(width: int = 8, depth: int = 3) -> nn.Sequential:
    """A U-Net as a flat nn.Sequential: stem, ``depth`` Downs, middle, ``depth`` Ups, head."""
    channels = [width * 2**level for level in range(depth + 1)]
    levels = [Namespace(f"level{level}") for level in range(depth)]
    layers: list[nn.Module] = [conv_block(1, channels[0])]
    layers += [Down(channels[d], channels[d + 1]).isolate(levels[d]) for d in range(depth)]
    layers.append(conv_block(channels[depth], channels[depth]))
    layers += [
        Up(channels[d + 1], channels[d], channels[d]).isolate(levels[d])
        for d in reversed(range(depth))
    ]
    layers.append(nn.Conv2d(channels[0], 1, 1))
    return nn.Sequential(*layers)


def generated_data(batches: int, batch_size: int, size: int) -> list[tuple[Tensor, Tensor]]:
    """Noisy images of blurry blobs; the target is the blobs' mask."""
    generator = torch.Generator().manual_seed(1234)
    data = []
    for _ in range(batches):
        blobs = torch.rand(batch_size, 1, size // 4, size // 4, generator=generator)
        clean = F.interpolate(blobs, size=(size, size), mode="bilinear", align_corners=False)
        noisy = clean + 0.3 * torch.randn(clean.shape, generator=generator)
        data.append((noisy, (clean > 0.5).float()))
    return data


def train(
    model: nn.Module, data: list[tuple[Tensor, Tensor]], steps: int, label: str
) -> list[float]:
    """Train for ``steps`` steps; return every step's loss. Prints progress and throughput."""
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    samples = 0
    start = time.perf_counter()
    losses = []
    for step in range(steps):
        images, masks = data[step % len(data)]
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(images), masks)
        loss.backward()
        optimizer.step()
        samples += images.size(0)
        losses.append(loss.item())
        if step % 5 == 0 or step == steps - 1:
            print(f"  [{label}] step {step:3d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start
    print(f"  [{label}] {samples / elapsed:.1f} samples/s over {steps} steps")
    return losses


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps")
    parser.add_argument("--batch-size", type=int, default=8, help="images per step")
    parser.add_argument("--size", type=int, default=16, help="image height and width")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size, args.chunks) < 1 or args.size < 8 or args.size % 8:
        parser.error(
            "--steps, --batch-size and --chunks must be 1 or more, and --size a multiple of 8 "
            f"(three 2x downsamplings), got {args.steps}, {args.batch_size}, {args.chunks}, "
            f"{args.size}"
        )

    torch.manual_seed(0)
    model = unet().double()
    plain = copy.deepcopy(model)
    data = [(x.double(), y.double()) for x, y in generated_data(8, args.batch_size, args.size)]

    # Stem + 2 Downs | Down + middle | 2 Ups | Up + head: the level-0 skip
    # crosses three partitions, level 1 two, level 2 one.
    pipe = Pipe(model, [3, 2, 2, 2], devices=["cpu"] * 4, chunks=args.chunks)
    print(pipe.skip_layout)

    print("Pipe:")
    pipe_losses = train(pipe, data, args.steps, "pipe")
    pipe.close()
    print("Plain nn.Sequential, same seed:")
    plain_losses = train(plain, data, args.steps, "plain")

    worst = max(abs(a - b) / abs(b) for a, b in zip(pipe_losses, plain_losses, strict=True))
    print(f"final loss: pipe {pipe_losses[-1]:.6f}, plain {plain_losses[-1]:.6f}")
    print(f"largest relative difference of a step's losses: {worst:.1e} (tolerance 1e-9)")
    if worst > 1e-9:
        print("the Pipe's losses differ from the plain model's")
        return 1
    print("the Pipe trains the U-Net like the plain model")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
