"""Benchmark: what a split model's checks at every call cost (issue 27, item 4).

Every piece of a split model checks, before it computes, that the model is
still the one it was split from (``pipeline/split/watch.py``): each attribute
the captured code read (the config's too), hooks on captured modules,
modules replaced. Measured on GPT-2 (``--layers`` blocks of ``--width``,
random weights, one sequence batch of ``--rows`` x ``--length`` tokens):

1. the checks alone: ``Watch.check()`` called ``--calls`` times per round;
   the median over rounds of the time per check;
2. a forward of the split model with its checks, against the same forward
   with ``Watch.check`` replaced by a no-op, in interleaved rounds (which
   goes first alternates); the medians, and their ratio.

One intra-op thread. The last line is JSON.

Run: PYTHONPATH=$PWD python examples/benchmarks/split_watch.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import transformers
from pipe_common import machine, print_json
from transformers import GPT2Config, GPT2LMHeadModel

import pipeline
from pipeline.split.watch import Watch


def per_call(run: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``run``, over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


@contextmanager
def unchecked() -> Iterator[None]:
    """Every split model's checks skipped (for the comparison only)."""
    check = Watch.check
    Watch.check = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Watch.check = check  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds; medians count")
    parser.add_argument("--calls", type=int, default=2000, help="checks timed per round")
    parser.add_argument("--forwards", type=int, default=50, help="forwards timed per round")
    parser.add_argument("--layers", type=int, default=3, help="GPT-2 blocks")
    parser.add_argument("--width", type=int, default=16, help="GPT-2 hidden size")
    parser.add_argument("--rows", type=int, default=4, help="sequences per batch")
    parser.add_argument("--length", type=int, default=16, help="tokens per sequence")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    print("machine:", machine())
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.width,
        n_head=2,
        vocab_size=256,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 256, (args.rows, args.length))
    seq = pipeline.split(model, (ids,))
    watch = seq[0].watch
    checks, checked, bare = [], [], []
    with torch.no_grad():
        for round_ in range(args.rounds):
            checks.append(per_call(watch.check, args.calls))
            order = [False, True] if round_ % 2 else [True, False]
            for with_checks in order:
                if with_checks:
                    checked.append(per_call(lambda: seq(ids), args.forwards))
                else:
                    with unchecked():
                        bare.append(per_call(lambda: seq(ids), args.forwards))
    check_us = statistics.median(checks) * 1e6
    forward_us, bare_us = statistics.median(checked) * 1e6, statistics.median(bare) * 1e6
    print(f"pieces {len(seq)}, attributes read {len(watch.reads)}, places {len(watch.places)}")
    print(f"one check: {check_us:.1f} us (median of {args.rounds} rounds of {args.calls})")
    print(
        f"forward of the split model: {forward_us:.0f} us with checks, {bare_us:.0f} us "
        f"without: {forward_us / bare_us:.3f}x"
    )
    print("machine after:", machine()["load_average"])
    print_json(
        {
            "benchmark": "split_watch",
            "check_us": round(check_us, 2),
            "forward_us": round(forward_us, 1),
            "forward_unchecked_us": round(bare_us, 1),
            "ratio": round(forward_us / bare_us, 4),
            "reads": len(watch.reads),
            "pieces": len(seq),
        }
    )


if __name__ == "__main__":
    main()
