"""T5 from transformers, an encoder-decoder, split by ``pipeline.split``, trained by ``Pipe.step``.

A small T5 (random initialisation, nothing downloaded; needs the ``hf``
extra) learns to write windows of the pydoc topics backwards, character by
character: the encoder reads a window, the decoder writes it reversed.
``pipeline.split`` cuts the unchanged transformers model at the blocks of
both stacks, the encoder's and the decoder's (the encoder's output reaches
each decoder piece as a skip, not through the pieces between);
``balance_by_time`` groups the pieces into CPU partitions; every step is one
``pipe.step`` with the decoder's inputs and the attention mask given as
keyword arguments, as to the model. A copy of the plain model takes the same
steps on the same batches (dropout is off): the script prints both losses
and exits with 1 if any step's losses differ by more than ``--tolerance``
(relative), or if the loss did not fall. Both train in float64, as in
``hf_gpt2.py`` (which says why).

    python examples/hf_t5.py                # 2 + 2 blocks of 32, 12 steps: seconds
    python examples/hf_t5.py --layers 4 --width 64 --partitions 4 --schedule zb-h1
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
from hf_gpt2 import TOLERANCE, TOLERANCE_HELP, tolerance, train_both, verdict
from torch import Tensor

import pipeline
from balance import balance_by_time
from pipeline import Pipe

START = 0  # the decoder's first input; characters are 1 and up


def seq2seq_loss(output: Any, target: Tensor) -> Tensor:
    """Cross-entropy of a transformers output's logits against the reversed windows."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def reversal(corpus: Corpus, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Windows (encoder inputs), the decoder's inputs, and the targets: the windows reversed."""
    windows, _ = corpus.batch(rows)
    source = windows + 1
    target = source.flip(1)
    decoder = torch.cat([torch.full_like(target[:, :1], START), target[:, :-1]], dim=1)
    return source, decoder, target


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps")
    parser.add_argument("--batch", type=int, default=8, help="windows per step")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--partitions", type=int, default=3, help="CPU partitions")
    parser.add_argument(
        "--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"], help="of pipe.step"
    )
    parser.add_argument("--context", type=int, default=12, help="characters per window")
    parser.add_argument("--width", type=int, default=32, help="T5's d_model")
    parser.add_argument("--heads", type=int, default=4, help="T5's num_heads")
    parser.add_argument("--layers", type=int, default=2, help="blocks in each stack")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    parser.add_argument("--tolerance", type=tolerance, default=TOLERANCE, help=TOLERANCE_HELP)
    parser.add_argument("--seed", type=int, default=0, help="initialisation and batches")
    parser.add_argument("--log-every", type=int, default=4, help="steps between two lines")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    corpus = Corpus(load_text(), args.context, args.seed)
    config = transformers.T5Config(
        vocab_size=len(corpus.chars) + 1,
        d_model=args.width,
        d_kv=args.width // args.heads,
        d_ff=4 * args.width,
        num_layers=args.layers,
        num_heads=args.heads,
        dropout_rate=0.0,
        decoder_start_token_id=START,
        pad_token_id=START,
        use_cache=False,
    )
    torch.manual_seed(args.seed)
    model = transformers.T5ForConditionalGeneration(config).double()
    plain = copy.deepcopy(model)

    x, decoder, _ = reversal(corpus, max(args.batch // args.chunks, 1))  # one micro-batch
    sample = {"decoder_input_ids": decoder, "attention_mask": torch.ones_like(x)}
    start = time.perf_counter()
    seq = pipeline.split(model, (x,), sample)
    split_s = time.perf_counter() - start
    balance = balance_by_time(args.partitions, seq, x, kwargs=sample, timeout=0.2, device="cpu")
    pipe = Pipe(seq, balance, devices=["cpu"] * args.partitions, chunks=args.chunks)
    params = sum(p.numel() for p in pipe.parameters())
    print(
        f"T5 (transformers {transformers.__version__}): {args.layers} + {args.layers} blocks "
        f"of width {args.width}, {params / 1e6:.2f}M parameters; split into {len(seq)} pieces "
        f"in {split_s:.1f} s; balance {balance} (balance_by_time); chunks {args.chunks}; "
        f"schedule {args.schedule}",
        flush=True,
    )

    def batch() -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        x, decoder, y = reversal(corpus, args.batch)
        return x, y, {"decoder_input_ids": decoder, "attention_mask": torch.ones_like(x)}

    losses, plain_losses = train_both(args, pipe, plain, seq2seq_loss, batch)
    return verdict(losses, plain_losses, args.tolerance)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
