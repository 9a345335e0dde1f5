"""The article's MNIST CNN, made data-parallel with ringtrain's six steps.

Trains on the scikit-learn digits set (1,797 real 8x8 handwritten digits, shipped
inside scikit-learn, so it runs offline), upsampled to 28x28 like MNIST, with a
held-out test split. Run it alone or with ``ringrun -np 2 python examples/mnist_cnn.py``.

The six steps (as in the article's Horovod/Keras script) are marked (1)..(6).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ringtrain as rt


class MnistCNN(nn.Module):
    """Keras' mnist_cnn: Conv32 3x3, Conv64 3x3, MaxPool 2, Dropout .25, Dense 128, Dropout .5, softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.drop1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(64 * 12 * 12, 128)
        self.drop2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.drop1(x), 1)
        x = self.drop2(F.relu(self.fc1(x)))
        return self.fc2(x)  # logits; cross_entropy applies the softmax


def load_digits_28x28(test_fraction: float = 0.2, seed: int = 0) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """scikit-learn's digits, scaled to [0, 1], upsampled to 28x28, split train/test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    images = (images - 0.5) / 0.5
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (
        torch.utils.data.TensorDataset(images[train], labels[train]),
        torch.utils.data.TensorDataset(images[test], labels[test]),
    )


def evaluate(model: nn.Module, dataset: torch.utils.data.TensorDataset, device: torch.device) -> float:
    model.eval()
    x, y = dataset.tensors
    with torch.no_grad():
        correct = (model(x.to(device)).argmax(1).cpu() == y).sum().item()
    model.train()
    return correct / len(y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=24, help="epochs for one process (divided by size)")
    parser.add_argument("--batch-size", type=int, default=64, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=1.0, help="Adadelta rate for one process (scaled by size)")
    parser.add_argument("--checkpoint-dir", default="runs/mnist_cnn", help="where rank 0 writes checkpoints")
    parser.add_argument("--strategy", default="native", help="gradient exchange: native, ring or ps")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    rt.init()                                                     # (1) initialise ringtrain
    device = rt.device()                                          # (2) one device per process (cuda:<local_rank>)
    torch.manual_seed(args.seed + rt.rank())
    train_set, test_set = load_digits_28x28()
    model = MnistCNN().to(device)

    # (6) Linear scaling rule: rate x size; fewer epochs, since each sees size x the data.
    lr = rt.scale_lr(args.lr)
    epochs = max(1, math.ceil(args.epochs / rt.size()))
    opt = torch.optim.Adadelta(model.parameters(), lr=lr)
    opt = rt.DistributedOptimizer(                                # (3) average gradients across ranks
        opt, named_parameters=model.named_parameters(), strategy=args.strategy
    )
    loader = rt.data.Loader(train_set, batch_size=args.batch_size, shuffle=True,
                            seed=args.seed, num_workers=0, device=device)

    start_epoch = 0
    ckpt_dir = Path(args.checkpoint_dir)
    # Rank 0 picks the checkpoint (a host without the directory finds none); every rank
    # loads it (rank 0 reads the file and sends it), so all resume at one epoch.
    latest = rt.broadcast_object(rt.checkpoint.latest(ckpt_dir) if rt.rank() == 0 else None)
    if latest is not None:                                        # resume where rank 0 left off
        state = rt.checkpoint.load(latest)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    rt.broadcast_parameters(model.state_dict(), root_rank=0)      # (4) same initial state everywhere
    rt.broadcast_optimizer_state(opt, root_rank=0)

    if rt.rank() == 0:
        print(f"training on {rt.size()} process(es), {len(train_set)} images, "
              f"{epochs} epochs, lr {lr:g}, batch {args.batch_size} per process", flush=True)
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        t0, seen, total_loss, steps = time.perf_counter(), 0, 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            seen += len(y)
            total_loss += loss.item()
            steps += 1
        elapsed = time.perf_counter() - t0
        mean_loss = rt.allreduce(torch.tensor(total_loss / max(1, steps))).item()
        samples_s = rt.allreduce(torch.tensor(float(seen)), op=rt.Sum).item() / elapsed
        if rt.rank() == 0:                                        # (5) only rank 0 reports and saves
            acc = evaluate(model, test_set, device)
            print(f"epoch {epoch + 1}/{epochs}  loss {mean_loss:.4f}  test accuracy {acc:.4f}  "
                  f"{samples_s:,.0f} samples/s", flush=True)
            rt.checkpoint.save(ckpt_dir / f"epoch-{epoch:03d}.ckpt",
                               {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch})
    if rt.rank() == 0:
        print(f"final test accuracy {evaluate(model, test_set, device):.4f}", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
