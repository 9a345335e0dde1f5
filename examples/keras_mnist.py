"""The article's Keras MNIST CNN, made data-parallel with ringtrain's six steps.

Keras 3 runs on its PyTorch backend (``ringtrain.keras`` sets ``KERAS_BACKEND=torch``),
so the gradients go through the same engine as the PyTorch example. Trains on the
scikit-learn digits set (1,797 real 8x8 handwritten digits, shipped inside
scikit-learn, so it runs offline), upsampled to 28x28 like MNIST, with a held-out test
split. Needs ``pip install 'ringtrain[keras,examples]'``. Run it alone or with
``ringrun -np 2 python examples/keras_mnist.py``.

The six changes of the article's Horovod/Keras script are marked (1)..(6).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

import ringtrain as rt
import ringtrain.keras as rtk  # sets KERAS_BACKEND=torch, so it comes before keras
from ringtrain.data import Loader

# isort: split
import keras


def load_digits_28x28(test_fraction: float = 0.2, seed: int = 0
                      ) -> tuple[torch.utils.data.TensorDataset, tuple[np.ndarray, np.ndarray]]:
    """scikit-learn's digits in [0, 1], upsampled to 28x28 (channels last), split
    train / test the same way as examples/mnist_cnn.py."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear",
                                             align_corners=False)
    images = images.permute(0, 2, 3, 1).contiguous()  # Keras wants (N, 28, 28, 1)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (torch.utils.data.TensorDataset(images[train], labels[train]),
            (images[test].numpy(), labels[test].numpy()))


def mnist_cnn() -> keras.Model:
    """Keras' mnist_cnn, as in the article."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.Conv2D(64, (3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Dropout(0.25),
        layers.Flatten(),
        layers.Dense(128, activation="relu"),
        layers.Dropout(0.5),
        layers.Dense(10, activation="softmax"),
    ])


class Throughput(keras.callbacks.Callback):
    """Rank 0 prints one line per epoch: averaged loss, test accuracy, samples/s."""

    def __init__(self, samples_per_epoch: int, test: tuple[np.ndarray, np.ndarray]) -> None:
        super().__init__()
        self.samples_per_epoch = samples_per_epoch
        self.test = test
        self.rates: list[float] = []

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs or {}
        rate = self.samples_per_epoch / (time.perf_counter() - self.t0)
        self.rates.append(rate)
        if rt.rank() == 0:
            _, acc = self.model.evaluate(*self.test, batch_size=512, verbose=0)
            print(f"epoch {epoch + 1}/{self.params['epochs']}  loss {logs['loss']:.4f}  "
                  f"train accuracy {logs['accuracy']:.4f}  test accuracy {acc:.4f}  "
                  f"{rate:,.0f} samples/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=32, help="epochs for one process (divided by size)")
    parser.add_argument("--batch-size", type=int, default=64, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=1.0, help="Adadelta rate for one process (scaled by size)")
    parser.add_argument("--warmup-epochs", type=float, default=1.0,
                        help="epochs to ramp the rate from lr to lr x size (Goyal et al.)")
    parser.add_argument("--workers", default="0", help="loader worker processes, or 'auto'")
    parser.add_argument("--checkpoint-dir", default="runs/keras_mnist", help="where rank 0 writes checkpoints")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    rt.init()                                                     # (1) initialise ringtrain
    # (2) one device per process: rt.init() pinned cuda:<local_rank> (when there are GPUs)
    #     and Keras' torch backend computes on the current CUDA device.
    keras.utils.set_random_seed(args.seed + rt.rank())            # different dropout per rank
    train_set, test = load_digits_28x28()
    model = mnist_cnn()

    # (6) Linear scaling rule: rate x size; fewer epochs, since each sees size x the data.
    lr = rt.scale_lr(args.lr)
    epochs = max(1, math.ceil(args.epochs / rt.size()))
    opt = rtk.DistributedOptimizer(keras.optimizers.Adadelta(learning_rate=lr))  # (3) average gradients
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    # The article's workers / use_multiprocessing / max_queue_size advice is the loader's
    # num_workers / prefetch; each rank reads its own shard.
    workers = args.workers if args.workers == "auto" else int(args.workers)
    loader = Loader(train_set, batch_size=args.batch_size, shuffle=True, seed=args.seed,
                    num_workers=workers, device=rt.device())
    initial_epoch = rtk.restore(model, args.checkpoint_dir)      # resume where rank 0 left off

    callbacks = [
        rtk.BroadcastGlobalVariablesCallback(0),                  # (4) same initial state everywhere
        rtk.MetricAverageCallback(),                              # every rank logs the same numbers
        rtk.LearningRateWarmupCallback(lr, warmup_epochs=args.warmup_epochs),
        Throughput(math.ceil(len(train_set) / rt.size()) * rt.size(), test),
        rtk.CheckpointCallback(args.checkpoint_dir, keep=3),      # (5) only rank 0 writes
    ]
    if rt.rank() == 0:
        print(f"training on {rt.size()} process(es), {len(train_set)} images, {epochs} epochs, "
              f"lr {lr:g}, batch {args.batch_size} per process", flush=True)
    model.fit(rtk.LoaderDataset(loader, initial_epoch=initial_epoch), epochs=epochs,
              initial_epoch=initial_epoch, callbacks=callbacks, verbose=0)
    if rt.rank() == 0:                                            # (5) only rank 0 reports
        _, acc = model.evaluate(*test, batch_size=512, verbose=0)
        print(f"final test accuracy {acc:.4f}", flush=True)
    loader.close()
    rt.shutdown()


if __name__ == "__main__":
    main()
