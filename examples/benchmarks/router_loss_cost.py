"""Benchmark: what the router loss adds to a GPipe step of a split Mixture-of-Experts model.

A Mixtral (``--layers`` layers of ``--width``, ``--experts`` experts, 2 per
token, random weights) asked for its router loss is split and stepped in a
Pipe of 3 partitions with GPipe (the router loss needs it), ``--chunks``
micro-batches of a batch of ``--rows`` x ``--length`` tokens, transformers'
own loss with its count. The same step with the config's
``output_router_logits`` on (the router loss counted in each forward,
closed once, its gradient added in each backward:
``pipeline/runtime/router_loss.py``) and off, in interleaved rounds (which
goes first alternates); the medians of each and of the per-round ratios.
The last line is JSON.

Run: PYTHONPATH=$PWD python examples/benchmarks/router_loss_cost.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from pipe_common import machine, print_json

import pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds; medians count")
    parser.add_argument("--layers", type=int, default=4, help="Mixtral layers")
    parser.add_argument("--width", type=int, default=256, help="hidden size")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer")
    parser.add_argument("--rows", type=int, default=16, help="sequences per batch")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    print("machine:", machine())
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=1000,
        hidden_size=args.width,
        intermediate_size=2 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=args.length,
        use_cache=False,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    )
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, 1000, (args.rows, args.length))
    n = (ids[..., 1:] != -100).sum()
    seq = pipeline.split(model, (ids[:2],), {"labels": ids[:2], "num_items_in_batch": n})
    pieces = len(seq)
    balance = [pieces // 3 + (k < pieces % 3) for k in range(3)]
    pipe = pipeline.Pipe(seq, balance, chunks=args.chunks)
    kwargs = {"labels": ids, "num_items_in_batch": pipeline.NoChunk(n)}

    def step(router_loss: bool) -> float:
        model.config.output_router_logits = router_loss
        start = time.perf_counter()
        pipe.step(
            ids, ids, lambda out, _: out.loss, kwargs=kwargs, loss_reduction="sum", schedule="gpipe"
        )
        return time.perf_counter() - start

    for warm in (True, False, True, False):
        step(warm)
    on: list[float] = []
    off: list[float] = []
    for round_ in range(args.rounds):
        for router_loss in (True, False) if round_ % 2 == 0 else (False, True):
            (on if router_loss else off).append(step(router_loss))
    pipe.close()
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    on_ms, off_ms = statistics.median(on) * 1e3, statistics.median(off) * 1e3
    ratio = statistics.median(ratios)
    print(f"pieces {pieces} on {balance}, {args.chunks} micro-batches, {args.rounds} rounds")
    print(f"GPipe step: {on_ms:.1f} ms with the router loss, {off_ms:.1f} ms without")
    print(f"ratio per round: median {ratio:.3f}, from {min(ratios):.3f} to {max(ratios):.3f}")
    print("machine after:", machine()["load_average"])
    print_json(
        {
            "benchmark": "router_loss_cost",
            "step_ms": round(on_ms, 2),
            "step_without_ms": round(off_ms, 2),
            "ratio": round(ratio, 4),
            "ratio_min": round(min(ratios), 4),
            "ratio_max": round(max(ratios), 4),
        }
    )


if __name__ == "__main__":
    main()
