"""An input-bound photo job: an ImageFolder that decodes whole photos, then crops them in
its transform; one loader worker; a 2 ms step."""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import ringtrain as rt

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from photos import write_photo_folder  # noqa: E402


def centre_crop(img: np.ndarray) -> np.ndarray:
    h, w = img.shape[:2]
    top, left = (h - 64) // 2, (w - 64) // 2
    return np.ascontiguousarray(img[top:top + 64, left:left + 64].transpose(2, 0, 1))


# One thread: on a loaded 2-core machine torch's thread pool made this tiny step take
# 60-90 ms (measured), longer than the loading it is meant to wait for.
torch.set_num_threads(1)
root = Path(tempfile.mkdtemp(prefix="rt-photos-"))
atexit.register(shutil.rmtree, root, True)
write_photo_folder(root, 24, classes=2)
rt.init()
loader = rt.data.Loader(rt.data.ImageFolder(root, transform=centre_crop), batch_size=16,
                        num_workers=1, device="cpu", prefetch=2)
model = torch.nn.Linear(3, 2)
opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              named_parameters=model.named_parameters())
for epoch in range(1000):
    loader.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.float().mean((2, 3)) / 255), y.long()).backward()
        time.sleep(0.002)  # the device step
        opt.step()
