"""The timeout ringtrain gives its NCCL groups comes after the stall check: NCCL's
watchdog (under TORCH_NCCL_ASYNC_ERROR_HANDLING=1) ends the process when it fires, so a
stall timeout raised past the init timeout ended in a SIGABRT instead of a StallError
naming the missing ranks. Recorded through fakes (no ProcessGroupNCCL on the CPU build)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringtrain.runtime import backend, membership
from ringtrain.settings import Settings


def test_the_nccl_timeout_is_the_init_timeout_or_later_than_the_stall_check() -> None:
    assert backend.nccl_op_timeout(Settings(init_timeout=300.0, stall_timeout=60.0)) == 300.0
    assert backend.nccl_op_timeout(Settings(init_timeout=300.0, stall_timeout=900.0)) == (
        900.0 + backend.NCCL_TIMEOUT_MARGIN_S)


@pytest.mark.parametrize("chosen,want", [("nccl", 900.0 + backend.NCCL_TIMEOUT_MARGIN_S), ("gloo", 300.0)])
def test_join_passes_it_to_the_world_group(monkeypatch: pytest.MonkeyPatch, chosen: str, want: float) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RINGTRAIN_RANK",
                 "RINGTRAIN_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RINGTRAIN_STALL_TIMEOUT", "900")
    monkeypatch.setenv("RINGTRAIN_INIT_TIMEOUT", "300")
    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(backend, "choose_backend", lambda requested, local_size: chosen)
    monkeypatch.setattr(backend, "gloo_interface", lambda env: None)
    monkeypatch.setattr(backend, "pin_device", lambda env: torch.device("cpu"))
    monkeypatch.setattr(dist, "init_process_group", lambda name, **kw: seen.update(name=name, **kw))
    m = membership.Membership()
    m._exit_guard_registered = True  # no exit handler for this throwaway membership
    m.join()
    assert seen["name"] == chosen
    assert seen["timeout"] == datetime.timedelta(seconds=want)
