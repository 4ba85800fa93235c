"""A Llama from transformers, split on ``meta`` and trained across processes by DistributedPipe.

Run: torchrun --nproc_per_node=2 examples/hf_llama.py [--steps 30]

Every process builds the same small Llama (rotary tables, grouped-query
attention; random initialisation, nothing downloaded; needs the ``hf``
extra) on the ``meta`` device and splits it there: no process ever holds
the whole model. ``balance_by_params`` groups the pieces into one stage per
process, and ``DistributedPipe`` materialises on each process only what its
pieces use, initialised by the model's own ``_init_weights``. Every step is
one ``pipe.step`` with the attention mask as a keyword argument, on the
pydoc topics character by character. To check the result, rank 0 gathers
the stages' initial weights into a plain copy of the model and takes the
same steps on the same batches: the script prints both losses and every
process exits with 1 if any step's losses differ by more than
``--tolerance`` (relative), or if the loss did not fall. Both train in
float64, where equality holds to rounding (see ``hf_gpt2.py`` on float32).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
import torch.distributed as dist
import transformers
from gpt import Corpus, load_text
from hf_gpt2 import (
    TOLERANCE,
    TOLERANCE_HELP,
    lm_loss,
    log_step,
    plain_step,
    tolerance,
    verdict,
)
from torch import Tensor, nn

import pipeline
from balance import balance_by_params
from pipeline.distributed import DistributedPipe, init_process_group_from_env


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tolerance", type=tolerance, default=TOLERANCE, help=TOLERANCE_HELP)
    parser.add_argument("--log-every", type=int, default=10)
    return parser.parse_args(argv)


def llama(vocab: int, args: argparse.Namespace) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=args.context,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_hidden_layers=args.layers,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).double()  # float64: see hf_gpt2.py


def plain_copy(pipe: DistributedPipe, vocab: int, args: argparse.Namespace) -> nn.Module | None:
    """On rank 0, the plain model with the weights of every stage (gathered); None elsewhere."""
    mine = {name: value.detach().cpu() for name, value in pipe.state_dict().items()}
    everyone: list[dict[str, Tensor]] = [{} for _ in range(pipe.size)]
    dist.all_gather_object(everyone, mine)
    if pipe.rank != 0:
        return None
    model = llama(vocab, args)
    model.load_state_dict({name: value for theirs in everyone for name, value in theirs.items()})
    return model


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    env = init_process_group_from_env()
    transformers.logging.set_verbosity_error()
    corpus = Corpus(load_text(), args.context, seed=0)  # the same batches on every process
    vocab = len(corpus.chars)
    with torch.device("meta"):
        model = llama(vocab, args)
    ids, _ = corpus.batch(max(args.batch // args.chunks, 1))
    mask = torch.ones_like(ids)
    start = time.perf_counter()
    seq = pipeline.split(model, (ids.to("meta"),), {"attention_mask": mask.to("meta")})
    split_s = time.perf_counter() - start
    balance = balance_by_params(env.world_size, seq)
    torch.manual_seed(env.rank)  # each stage's own initialisation
    pipe = DistributedPipe(seq, balance, chunks=args.chunks, init=model._init_weights)
    plain = plain_copy(pipe, vocab, args)
    if env.rank == 0:
        print(
            f"Llama (transformers {transformers.__version__}): {args.layers} blocks of width "
            f"{args.width}, split on meta into {len(seq)} pieces in {split_s:.1f} s; "
            f"{env.world_size} processes, balance {balance} (balance_by_params); "
            f"chunks {args.chunks}; schedule {args.schedule}",
            flush=True,
        )

    first, last = 0 in pipe.local_stages, len(pipe.balance) - 1 in pipe.local_stages
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    plain_optimizer = None if plain is None else torch.optim.AdamW(plain.parameters(), lr=args.lr)
    losses: list[float] = []
    plain_losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = corpus.batch(args.batch)
        mask = torch.ones_like(x)
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.step(
            x if first else None,
            y if last else None,
            lm_loss,
            kwargs={"attention_mask": mask} if first else None,
            schedule=args.schedule,
        )
        optimizer.step()
        losses.append(float(loss))
        if plain is None or plain_optimizer is None:
            continue
        plain_losses.append(
            plain_step(plain, plain_optimizer, x, y, {"attention_mask": mask}, lm_loss)
        )
        log_step(args, step, start, losses[-1], plain_losses[-1])

    exit_code = [verdict(losses, plain_losses, args.tolerance) if env.rank == 0 else 0]
    dist.broadcast_object_list(exit_code, src=0)
    pipe.close()
    # Drop what holds the process group first (see train_dp.py).
    del optimizer, pipe
    gc.collect()
    dist.destroy_process_group()
    return int(exit_code[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
