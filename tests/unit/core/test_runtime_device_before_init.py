"""``rt.device()`` before ``rt.init()`` (a torchrun script using the loader or
``parallelize`` on its own process group): the device the script chose once it has
used CUDA, else ``cuda:$LOCAL_RANK``; it was the current device, 0 on every rank of a
script that had not chosen one, so every rank's batches went to the first GPU. CUDA is
replaced by stand-ins (no GPU here)."""

from __future__ import annotations

import pytest
import torch

from ringtrain import runtime


def _cuda(monkeypatch: pytest.MonkeyPatch, *, initialized: bool, current: int = 0, count: int = 4) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(("initialized", "current", "local", "want"), [
    (False, 0, "2", 2),    # nothing chosen yet: the launcher's local rank
    (True, 1, "2", 1),     # torch.cuda.set_device(1) (or any CUDA use): the script's choice
    (False, 0, None, 0),   # no launcher: the current device
    (False, 0, "7", 0),    # a local rank without a GPU of its own: the current device
])
def test_the_device_before_init(monkeypatch: pytest.MonkeyPatch, initialized: bool, current: int,
                                local: str | None, want: int) -> None:
    assert runtime.MEMBERSHIP.world is None
    _cuda(monkeypatch, initialized=initialized, current=current)
    if local is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local)
    assert runtime.device() == torch.device("cuda", want)
