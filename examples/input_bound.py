"""The article's symptom, reproduced: the device waits for a CPU that cannot feed it.

"GPU memory is full but utilisation jumps between 0% and 90%": here a device step is
emulated by sleeping ``--device-ms`` (a real GPU step leaves the CPU free in just the
same way), and every sample needs CPU-heavy preprocessing (numpy: decode-like
conversion, blur passes, random crop and flip, normalisation; one sample in ten is
four times as costly, like a large image among small ones).

    ringtrain doctor -- python examples/input_bound.py --loader naive
    ringtrain doctor -- python examples/input_bound.py --loader ringtrain --workers 2

``--loader naive`` prepares each batch in the training loop, so the device idles
while the CPU works: the doctor says input-bound, device busy low and jumpy.
``--loader ringtrain`` prepares batches in rt.data.Loader's worker processes ahead of
the loop; with the two workers the doctor advises (and free cores for them) the
device is busy >= 95% of each step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import numpy as np
import torch

import ringtrain as rt


class AugmentedImages:
    """``n`` synthetic 3x64x64 images, preprocessed on access (map-style dataset)."""

    def __init__(self, n: int = 4096, passes: int = 12, size: int = 64, crop: int = 56) -> None:
        self.n, self.passes, self.size, self.crop = n, passes, size, crop

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(i)
        raw = rng.integers(0, 256, size=(3, self.size, self.size), dtype=np.uint8)
        img = raw.astype(np.float32) / 255.0  # "decode"
        passes = self.passes * (4 if rng.random() < 0.1 else 1)
        for _ in range(passes):  # 3x3 box blur, the CPU-heavy part
            img = (img + np.roll(img, 1, 1) + np.roll(img, -1, 1)
                   + np.roll(img, 1, 2) + np.roll(img, -1, 2)) / 5.0
        top, left = rng.integers(0, self.size - self.crop + 1, size=2)
        img = img[:, top:top + self.crop, left:left + self.crop]
        if rng.random() < 0.5:
            img = img[:, :, ::-1]
        img = (img - img.mean()) / (img.std() + 1e-6)
        return torch.from_numpy(np.ascontiguousarray(img)), int(i % 10)


def naive_batches(dataset: AugmentedImages, batch_size: int, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """What many training loops do: prepare each batch in the loop, when it is needed."""
    order = np.random.default_rng(epoch).permutation(len(dataset))
    for start in range(0, len(order) - batch_size + 1, batch_size):
        samples = [dataset[int(i)] for i in order[start:start + batch_size]]
        yield torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loader", choices=["naive", "ringtrain"], default="naive")
    parser.add_argument("--device-ms", type=float, default=40.0,
                        help="emulated device time per step (default 40)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--passes", type=int, default=12, help="blur passes per sample (CPU cost)")
    parser.add_argument("--workers", default="auto", help="rt.data.Loader num_workers (default auto)")
    parser.add_argument("--steps", type=int, default=200, help="steps to train (default 200)")
    args = parser.parse_args()

    rt.init()
    # The device's work is emulated; the CPU's cores belong to the input pipeline. (Two
    # intra-op threads on a busy machine also wait on each other at every barrier.)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dataset = AugmentedImages(passes=args.passes)
    # A small model: the device time is the emulated sleep, not the CPU's forward pass.
    crop = dataset.crop
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * crop * crop, 10))
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=rt.scale_lr(0.01)),
                                  named_parameters=model.named_parameters())
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    loader = None
    if args.loader == "ringtrain":
        workers = args.workers if args.workers == "auto" else int(args.workers)
        loader = rt.data.Loader(dataset, batch_size=args.batch_size, shuffle=True, seed=0,
                                num_workers=workers, device=rt.device(), drop_last=True)

    steps, epoch, t0 = 0, 0, time.perf_counter()
    while steps < args.steps:
        if loader is not None:
            loader.set_epoch(epoch)
            batches = rt.observe.instrument(loader)
        else:
            batches = rt.observe.instrument(naive_batches(dataset, args.batch_size, epoch))
        for x, y in batches:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            time.sleep(args.device_ms / 1e3)  # the device's share of the step
            opt.step()
            steps += 1
            if steps >= args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - t0
    if rt.rank() == 0:
        print(f"{steps} steps in {elapsed:.1f} s: {steps * args.batch_size / elapsed:,.0f} "
              f"samples/s per rank ({args.loader} loader)", flush=True)
    if loader is not None:
        loader.close()
    rt.shutdown()


if __name__ == "__main__":
    main()
