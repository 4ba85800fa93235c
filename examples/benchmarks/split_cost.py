"""Benchmark: what ``pipeline.split`` costs: the split itself, and a step of the split model.

1. Split time: ``pipeline.split`` of GPT-2 small (12 blocks of 768, the
   config of the ``gpt2`` checkpoint, random weights) and of a Llama of 16
   blocks of 2048 (the shapes of Llama 3.2 1B), both built on ``meta`` (the
   capture runs on fake tensors either way; ``meta`` keeps the 1B model out
   of memory), on one micro-batch of 2 sequences of 128 tokens, with the mask
   as a keyword. Each is split ``--rounds`` times; the median counts.
2. Step time: the GPT of ``examples/gpt.py`` as the hand-written
   ``nn.Sequential`` (``gpt.build_model``) against the same model written as
   an ordinary module (``examples/gpt_module.py``) and split, equal weights,
   each in a ``Pipe`` of 2 CPU partitions with the same balance
   (``balance_by_time`` of the Sequential) and checkpoint mode, one
   ``pipe.step`` (1F1B) per timing. The two run in interleaved rounds (which goes first alternates),
   so they see the same load; the medians count, and their ratio.

One intra-op thread. Prints the machine's load average before and after;
the last line is JSON. ``--tiny`` runs small configs (for a quick check).

Run: PYTHONPATH=$PWD python examples/benchmarks/split_cost.py [--rounds 5] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pipe_common import machine, print_json
from torch import nn

import pipeline
from balance import balance_by_time
from pipeline import Pipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: gpt, gpt_module
import gpt
from gpt_module import build_gpt


def transformers_models(tiny: bool) -> dict[str, Callable[[], nn.Module]]:
    """GPT-2 small and a Llama of 1B's shapes (or tiny ones), to build on ``meta``."""
    import transformers

    transformers.logging.set_verbosity_error()
    gpt2 = transformers.GPT2Config(use_cache=False)  # the gpt2 checkpoint's sizes
    llama = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        use_cache=False,
    )
    if tiny:
        gpt2 = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, use_cache=False)
        llama = transformers.LlamaConfig(
            vocab_size=100,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_cache=False,
        )
    gpt2_name = f"GPT-2 ({gpt2.n_layer} blocks of {gpt2.n_embd})"
    llama_name = f"Llama ({llama.num_hidden_layers} blocks of {llama.hidden_size})"
    return {
        gpt2_name: lambda: transformers.GPT2LMHeadModel(gpt2),
        llama_name: lambda: transformers.LlamaForCausalLM(llama),
    }


def split_seconds(make: Callable[[], nn.Module], rounds: int) -> list[float]:
    """The wall time of ``pipeline.split`` on a model built on meta, each round."""
    with torch.device("meta"):
        model = make()
    ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
    mask = torch.ones_like(ids)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        pipeline.split(model, (ids,), {"attention_mask": mask})
        times.append(time.perf_counter() - start)
    return times


def step_seconds(args: argparse.Namespace) -> dict[str, list[float]]:
    """Interleaved rounds of one pipe.step each: the Sequential GPT and the split module GPT."""
    options = ["--layers", str(args.layers), "--width", str(args.width)]
    model_args = gpt.parse_args([*options, "--context", str(args.context)])
    corpus = gpt.Corpus(gpt.load_text(), model_args.context, seed=0)
    vocab = len(corpus.chars)
    torch.manual_seed(0)
    sequential = gpt.build_model(vocab, model_args)
    torch.manual_seed(0)
    module = build_gpt(vocab, model_args)
    sample, _ = corpus.batch(args.sequences)  # one micro-batch
    split = pipeline.split(module, (sample,))
    assert len(split) == len(sequential)
    balance = balance_by_time(2, sequential, sample, timeout=0.5, device="cpu")
    pipes = {
        name: Pipe(
            model, balance, devices=["cpu"] * 2, chunks=args.chunks, checkpoint=args.checkpoint
        )
        for name, model in (("Sequential", sequential), ("split module", split))
    }
    x, y = corpus.batch(args.sequences * args.chunks)

    def step(pipe: Pipe) -> float:
        pipe.zero_grad(set_to_none=True)
        start = time.perf_counter()
        pipe.step(x, y, gpt.language_model_loss, schedule="1f1b")
        return time.perf_counter() - start

    for pipe in pipes.values():  # warm-up
        step(pipe)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for round_ in range(args.steps):
        order = list(pipes) if round_ % 2 == 0 else list(reversed(pipes))
        for name in order:
            times[name].append(step(pipes[name]))
    for pipe in pipes.values():
        pipe.close()
    print(f"balance {balance} (balance_by_time of the Sequential), for both")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="splits of each model")
    parser.add_argument("--steps", type=int, default=40, help="interleaved steps of each GPT")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument(
        "--checkpoint", default="except_last", choices=["always", "except_last", "never"]
    )
    parser.add_argument("--tiny", action="store_true", help="small configs, for a quick check")
    parser.add_argument("--skip-split", action="store_true", help="only the step times")
    args = parser.parse_args()
    torch.set_num_threads(1)
    info = machine()
    print(f"machine: {info}")
    result: dict[str, Any] = {"benchmark": "split_cost", "machine": info, "split_s": {}}
    if not args.skip_split:
        for name, make in transformers_models(args.tiny).items():
            times = split_seconds(make, args.rounds)
            result["split_s"][name] = round(statistics.median(times), 3)
            print(f"split {name}: median {statistics.median(times):.2f} s over {len(times)}")
    times = step_seconds(args)
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    for name, median in medians.items():
        print(f"step of the {name} GPT: median {median * 1e3:.1f} ms over {len(times[name])}")
    ratio = medians["split module"] / medians["Sequential"]
    print(f"split module / Sequential: {ratio:.3f}")
    result["step_ms"] = {name: round(median * 1e3, 2) for name, median in medians.items()}
    result["ratio"] = round(ratio, 4)
    result["load_average_after"] = [round(load, 2) for load in os.getloadavg()]
    print(f"load average after: {result['load_average_after']}")
    print_json(result)


if __name__ == "__main__":
    main()
