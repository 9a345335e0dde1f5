"""Every ringtrain.horovod collective called before ``hvd.init()`` raises Horovod's
"not initialized" ValueError, which names the fix (the unregistered global process set's
error pointed at ``hvd.add_process_set()``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import ringtrain.horovod as hvd

CALLS: dict[str, Callable[[], Any]] = {
    "allreduce": lambda: hvd.allreduce(torch.ones(2)),
    "allgather": lambda: hvd.allgather(torch.ones(2)),
    "broadcast_": lambda: hvd.broadcast_(torch.ones(2), 0),
    "broadcast_object": lambda: hvd.broadcast_object(1),
    "allgather_object": lambda: hvd.allgather_object(1),
    "broadcast_parameters": lambda: hvd.broadcast_parameters({"w": torch.ones(1)}, 0),
    "broadcast_optimizer_state": lambda: hvd.broadcast_optimizer_state(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), 0),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_before_init_names_hvd_init(call: str) -> None:
    if hvd.is_initialized():
        pytest.skip("another test left hvd initialised in this process")
    with pytest.raises(ValueError, match=r"use hvd\.init\(\)"):
        CALLS[call]()
