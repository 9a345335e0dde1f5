"""The loader's CUDA path end to end, with a fake device whose copies land late.

The fake performs each "DMA" only when its event is queried as done, waited on, or
handed to compute, like a real asynchronous copy. If the loader gave a slot back to
the workers before the copy event completed, the late copy would read a refilled slot
and the delivered batch would not match the dataset.
"""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeBackend, Indexed

from ringtrain.data import loader as loader_mod


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    backend = FakeBackend(lag=3)
    monkeypatch.setattr(loader_mod, "_make_backend", lambda device: backend)
    return backend


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_path_delivers_correct_batches(fake_cuda: FakeBackend, num_workers: int) -> None:
    ds = Indexed(3000)
    with loader_mod.Loader(ds, batch_size=64, num_workers=num_workers, device="cuda",
                           device_prefetch=2) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            seen = []
            for x, i in loader:
                assert torch.equal(x, torch.from_numpy(ds.x[i.numpy()]))
                seen.append(i)
            assert sorted(torch.cat(seen).tolist()) == list(range(3000))
        assert fake_cuda.copies == 2 * len(loader)
        if num_workers:
            assert fake_cuda.registered  # slots page-locked once, not per batch
            assert len(fake_cuda.registered) == loader.stats()["pinned_slots"] \
                == loader.stats()["slots"]
            assert all(fake_cuda.non_blocking[2:])
        assert loader.total_h2d_s > 0
    assert not fake_cuda.registered  # unregistered at close


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_real_cuda_path(num_workers: int) -> None:
    """On a GPU: page-locked slots, side-stream copies overlapping busy compute."""
    ds = Indexed(4096)
    big = torch.randn(2048, 2048, device="cuda")
    with loader_mod.Loader(ds, batch_size=256, num_workers=num_workers,
                           device="cuda") as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for x, i in loader:
                assert x.is_cuda and i.is_cuda
                for _ in range(4):  # keep the compute stream busy while copies run
                    big = torch.tanh(big @ big)
                ref = torch.from_numpy(ds.x[i.cpu().numpy()]).cuda()
                assert torch.equal(x, ref)
        if num_workers:
            stats = loader.stats()
            assert stats["slots"] > 0 and stats["pinned_slots"] == stats["slots"]
        assert loader.total_h2d_s > 0
    torch.cuda.synchronize()
