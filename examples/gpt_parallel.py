"""A small character-level GPT trained with pipeline, tensor and sharded data parallelism.

The corpus is the Python standard library's own source files (on every machine, so it
runs offline), read as bytes: a 256-symbol vocabulary. Every layout trains the same
model (same seed) on the same global batch, so its loss is the same up to rounding::

    python examples/gpt_parallel.py --steps 50                       # one process
    ringrun -np 4 --oversubscribe python examples/gpt_parallel.py --pipeline 2 --shard      # 2 stages x 2 sharded
    ringrun -np 8 --oversubscribe python examples/gpt_parallel.py --pipeline 2 --tensor 2 --shard

The data-parallel degree is world size / (pipeline x tensor). Rank 0 prints the loss
and samples/s as it goes, then ``final loss <float>`` and ``state MiB per rank <float>``
(parameters + gradients + optimizer state, measured, the largest rank).
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ringtrain as rt
from ringtrain.errors import RingtrainError
from ringtrain.parallel import parallelize

VOCAB = 256  # bytes

#: Which linear layers tensor parallelism splits: Megatron-LM's pairs (column then row).
TENSOR_PLAN = {
    "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise",
}


class Embed(nn.Module):
    def __init__(self, block: int, width: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(block, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Attention(nn.Module):
    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, width // n_head
        # Separate q, k, v (not one fused 3C layer) so a column split keeps whole heads.
        # No key bias: it adds the same q.b to every score of a query, which softmax
        # ignores, so its gradient is zero up to rounding and Adam would amplify that
        # rounding noise into lr-sized steps that differ between layouts.
        self.q, self.v = nn.Linear(width, width), nn.Linear(width, width)
        self.k = nn.Linear(width, width, bias=False)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds n_head / tensor of them.
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width, n_head)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(width), nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(nn.Module):
    """embed -> blocks -> head, applied in order: each is a pipeline unit."""

    def __init__(self, block: int = 64, layers: int = 4, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.embed = Embed(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = Head(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's top-level ``*.py`` files, in name order, as bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if len(text) < 1024:
        raise RingtrainError(f"found only {len(text)} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def windows(corpus: torch.Tensor, block: int) -> torch.utils.data.TensorDataset:
    """Non-overlapping windows of block + 1 bytes (input and next-byte target)."""
    n = (len(corpus) - 1) // block
    starts = torch.arange(n) * block
    return torch.utils.data.TensorDataset(corpus[starts[:, None] + torch.arange(block + 1)])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--tensor", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--shard", action=argparse.BooleanOptionalAction, default=None,
                   help="shard parameters, gradients and Adam state over the data ranks "
                        "(default: yes, when there are data ranks)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    p.add_argument("--seed", type=int, default=0, help="model init and sample order")
    p.add_argument("--microbatches", type=int, help="micro-batches per step (default 4 x stages)")
    p.add_argument("--schedule", default="1f1b", help="1f1b or gpipe (default 1f1b)")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    p.add_argument("--block", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--width", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--corpus-mb", type=float, default=2.0, help="bytes of source to train on")
    p.add_argument("--log-every", type=int, default=10, help="print every N steps (default 10)")
    p.add_argument("--save", help="write a sharded checkpoint to this directory at the end")
    p.add_argument("--load", help="start from this sharded checkpoint (any layout)")
    return p


def train(args: argparse.Namespace) -> None:
    # FSDP2 warns when a wrapped module returns a view (a later in-place op on it would
    # skip its hooks); nothing here modifies outputs in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    rt.init()
    torch.manual_seed(args.seed)  # the same model on every rank, in every layout
    model = GPT(args.block, args.layers, args.width, args.heads)
    par = parallelize(model, lm_loss, pipeline=args.pipeline, tensor=args.tensor,
                      shard=args.shard, microbatches=args.microbatches,
                      schedule=args.schedule, tensor_plan=TENSOR_PLAN)
    if args.batch % par.data_size:
        raise RingtrainError(f"--batch {args.batch} does not split over {par.data_size} data "
                             f"ranks; use a multiple of {par.data_size}")
    opt = torch.optim.AdamW(par.parameters(), lr=args.lr, weight_decay=0.0)
    if args.load:
        par.load(args.load, opt)
    batches = None
    if par.reads_data:  # only the first stage reads; the others get activations
        loader = rt.data.Loader(windows(stdlib_corpus(int(args.corpus_mb * 2**20)), args.block),
                                batch_size=args.batch // par.data_size, shuffle=True,
                                seed=args.seed, num_workers=0, drop_last=True,
                                rank=par.data_rank, world_size=par.data_size)
        batches = _forever(loader)
    say = print if rt.rank() == 0 else (lambda *a, **k: None)
    say(f"{par.layout.describe()} on {rt.size()} rank(s)", flush=True)
    loss, memory = math.nan, 0.0
    t_log, step_log = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        x = y = None
        if batches is not None:
            (seq,) = next(batches)
            x, y = seq[:, :-1].long(), seq[:, 1:].long()
        loss = par.step(x, y)
        if step == args.steps:  # gradients exist now (and Adam's state, from step 2 on)
            memory = par.state_memory(opt).mib
        par.update(opt)
        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            rate = args.batch * (step - step_log) / (now - t_log)  # since the last line
            t_log, step_log = now, step
            say(f"step {step} loss {loss:.4f} samples/s {rate:.1f}", flush=True)
    worst = torch.tensor(memory, dtype=torch.float64)
    if rt.size() > 1:
        # ringtrain's collective, not torch's: its tensor is held until Gloo's thread lets
        # go of it, so no finished work is released during interpreter finalization.
        worst = rt.allreduce(worst, op=rt.Max, name="state_mib")
    if args.save:
        par.save(args.save, opt)
    say(f"final loss {loss!r}")
    say(f"state MiB per rank {float(worst):.6f}", flush=True)


def _forever(loader: rt.data.Loader):  # type: ignore[no-untyped-def]
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        train(args)
    except RingtrainError as exc:
        print(f"gpt_parallel: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        rt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
