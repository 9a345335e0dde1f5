"""A script's own ``hvd.elastic.State`` subclass, as Horovod's docs suggest ("override
the base hvd.elastic.State object to handle broadcasting custom types"): it calls
``super().__init__(bcast_object=..., get_rank=...)`` (Horovod's signature) and gives
``save``/``restore``/``sync`` only. ringtrain's base took no arguments (a TypeError at
construction), and its commit in a fixed-size job called the ``snapshot()`` such a
subclass lacks (NotImplementedError on rank 0 at the first commit)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

import ringtrain.horovod as hvd


class Counter(hvd.elastic.State):
    def __init__(self, value: dict[str, int]) -> None:
        self.value = value
        self._saved = copy.deepcopy(value)
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value)

    def restore(self) -> None:
        self.value = copy.deepcopy(self._saved)

    def sync(self) -> None:
        # Horovod's base keeps the functions it was given under these names.
        if self._rank() == 0:
            self._saved = self._bcast_object(self._saved)
        self.restore()


def test_a_scripts_own_state_runs_commits_and_restores(
        hvd_one_rank: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A fixed-size job that rank 0 persists commits for (as under horovodrun/ringrun).
    monkeypatch.setenv("RINGTRAIN_ELASTIC_DIR", str(tmp_path))
    monkeypatch.setenv("RINGTRAIN_ELASTIC_PERSIST_S", "0")
    state = Counter({"n": 0})

    @hvd.elastic.run
    def train(state: Counter) -> dict[str, Any]:
        for _ in range(3):
            state.value["n"] += 1
            state.commit()
        state.value["n"] = 99
        state.restore()
        return state.value

    assert train(state) == {"n": 3}
    assert not (tmp_path / "commit.ckpt").exists()  # nothing it could write
