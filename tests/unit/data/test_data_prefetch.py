"""The device stager's ordering, driven by a fake device whose copies land late
(the loader end to end on that fake: tests/integration/test_loader_device.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_cuda import FakeBackend

from ringtrain.data.prefetch import DeviceStager, tree_map


def test_stager_releases_host_memory_only_after_the_copy() -> None:
    backend = FakeBackend(lag=10)  # done only after 10 queries
    stager = DeviceStager(backend)
    released: list[int] = []
    for k in range(3):
        stager.stage(torch.full((4,), float(k)), True, lambda k=k: released.append(k))
    assert released == []  # copies still in flight
    assert stager.pop().tolist() == [0.0] * 4
    stager.reap(block=True)
    assert released[0] == 0
    stager.clear()
    assert sorted(released) == [0, 1, 2]
    assert stager.total_h2d_s == pytest.approx(0.003)


def test_tree_map_copies_arrays_and_keeps_objects() -> None:
    arr = np.arange(3)
    out = tree_map(lambda t: t + 1, {"a": torch.zeros(2), "b": arr, "c": ["s"]})
    assert out["a"].tolist() == [1.0, 1.0] and out["c"] == ["s"]
    assert np.array_equal(out["b"], arr) and out["b"] is not arr
