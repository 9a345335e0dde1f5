"""Leaving an NCCL world whose peers may be gone (a resizable job re-forming): its groups
are aborted, never shut down the normal way (which waits for every NCCL kernel, and a
kernel spinning on a vanished peer never ends), and before the layers' hooks release
their own NCCL groups. Recorded through fakes: the CPU build has no ProcessGroupNCCL."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ringtrain.runtime.membership import Membership


def _world(monkeypatch: pytest.MonkeyPatch, backend: str, abort_fails: bool = False) -> tuple[Membership, list[str]]:
    calls: list[str] = []
    state = {"up": True}

    def abort(group: Any = None) -> None:
        calls.append("abort")
        if abort_fails:
            raise RuntimeError("ncclCommAbort failed")
        state["up"] = False  # _abort_process_group() ends the default group too

    def destroy(group: Any = None) -> None:
        calls.append("destroy")
        state["up"] = False

    monkeypatch.setattr(dist, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(c10d, "_abort_process_group", abort)
    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    m = Membership()
    m.world = SimpleNamespace(owns_group=True, backend=backend)  # type: ignore[assignment]
    m.add_shutdown_hook(lambda: calls.append("hook"))
    return m, calls


def test_an_nccl_world_is_aborted_before_the_hooks_and_not_destroyed(monkeypatch: pytest.MonkeyPatch) -> None:
    m, calls = _world(monkeypatch, "nccl")
    m.abandon()
    assert calls == ["abort", "hook"]
    assert m.world is None and m.broken is None


def test_a_failed_abort_falls_back_to_destroying_the_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    m, calls = _world(monkeypatch, "nccl", abort_fails=True)
    m.abandon()
    assert calls == ["abort", "hook", "destroy"]
    assert m.world is None


def test_a_gloo_world_is_destroyed_after_the_hooks_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    m, calls = _world(monkeypatch, "gloo")
    m.abandon()
    assert calls == ["hook", "destroy"]


def test_the_abort_api_exists_in_this_torch() -> None:
    """``_abort_process_group`` is private (experimental) API: a torch that renames it
    fails here rather than silently falling back to the hanging destroy."""
    import inspect

    assert list(inspect.signature(c10d._abort_process_group).parameters) == ["group"]
