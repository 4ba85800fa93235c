"""Benchmark: what the explicit attention mask of a split transformers model costs on CPU.

Traced, transformers builds a ``(batch, 1, seq, seq)`` boolean causal mask
and passes it from piece to piece, where the eager model calls
``scaled_dot_product_attention(..., is_causal=True)`` with no mask. Two costs:

1. Bytes per partition boundary: the mask's ``batch * seq * seq`` bytes
   next to the hidden state's ``batch * seq * width * itemsize``.
2. Time: one attention's forward and backward (GPT-2 small's 12 heads of 64,
   float32, one intra-op thread) with the explicit mask against
   ``is_causal=True``, in interleaved rounds; medians and the median ratio.

Run: PYTHONPATH=$PWD python examples/benchmarks/split_mask.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pipe_common import machine, print_json

HEADS, HEAD_DIM, BATCH = 12, 64, 4


def attention(seq: int, masked: bool) -> Callable[[], None]:
    """One forward and backward of causal attention over ``seq`` tokens."""
    q, k, v = (torch.randn(BATCH, HEADS, seq, HEAD_DIM, requires_grad=True) for _ in range(3))
    mask = torch.ones(seq, seq, dtype=torch.bool).tril().expand(BATCH, 1, seq, seq)

    def run() -> None:
        if masked:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    return run


def seconds(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512, 1024])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("machine:", machine())
    results = {}
    for seq in args.seq:
        masked, causal = attention(seq, True), attention(seq, False)
        masked(), causal()  # warm up
        times: dict[str, list[float]] = {"mask": [], "is_causal": []}
        for r in range(args.rounds):
            order = [("mask", masked), ("is_causal", causal)]
            for name, run in order if r % 2 == 0 else order[::-1]:
                times[name].append(seconds(run))
        pairs = zip(times["mask"], times["is_causal"], strict=True)
        ratio = statistics.median(m / c for m, c in pairs)
        mask_bytes = BATCH * seq * seq
        hidden_bytes = BATCH * seq * HEADS * HEAD_DIM * 4
        results[seq] = {
            "mask_ms": 1e3 * statistics.median(times["mask"]),
            "is_causal_ms": 1e3 * statistics.median(times["is_causal"]),
            "ratio": ratio,
            "mask_bytes": mask_bytes,
            "hidden_bytes": hidden_bytes,
        }
        print(
            f"seq {seq:5d}: attention fwd+bwd with the mask {results[seq]['mask_ms']:.2f} ms, "
            f"is_causal {results[seq]['is_causal_ms']:.2f} ms ({ratio:.2f}x); mask "
            f"{mask_bytes / 2**20:.2f} MiB per boundary, hidden state "
            f"{hidden_bytes / 2**20:.2f} MiB ({mask_bytes / hidden_bytes:.0%})"
        )
    print("machine after:", machine())
    print_json({"benchmark": "split_mask", "batch": BATCH, "results": results})


if __name__ == "__main__":
    main()
