"""The backend ringtrain uses in a group the script made itself (torchrun-style
``init_process_group()``): without a backend argument torch makes one backend per
device type and ``get_backend()`` says ``"undefined"``; a CUDA process's exchanges run
on that group's NCCL, a CPU process's on its Gloo."""

from __future__ import annotations

import pytest
import torch

from ringtrain.runtime.backend import existing_backend

CUDA, CPU = torch.device("cuda", 1), torch.device("cpu")


@pytest.mark.parametrize(("name", "config", "device", "want"), [
    ("undefined", "cpu:gloo,cuda:nccl", CUDA, "nccl"),   # init_process_group() on a GPU host
    ("undefined", "cpu:gloo,cuda:nccl", CPU, "gloo"),    # ... a rank without a GPU
    ("undefined", "cpu:gloo", CPU, "gloo"),              # ... on a CPU host
    ("undefined", "cpu:gloo", CUDA, "gloo"),
    ("nccl", "nccl", CUDA, "nccl"),                      # init_process_group("nccl")
    ("gloo", "gloo", CUDA, "gloo"),
])
def test_the_devices_backend_of_the_group(name: str, config: str, device: torch.device, want: str) -> None:
    assert existing_backend(name, config, device) == want
