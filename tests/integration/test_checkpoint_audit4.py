"""Checkpoint audit: results that were silently wrong, and misleading errors.

- ``load`` with a different path on each rank gave every rank rank 0's file;
- two saves of one path at once in one process shared a temporary file;
- ``latest`` ordered by the last number in the name (a metric's digits);
- ``load_sharded`` skipped the checkpoint's keys the state lacked (a 4-layer model's
  checkpoint loaded into a 2-layer model);
- a device error in ``load`` was blamed on the safe load, advising ``weights_only=False``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from ringtest import run_world

import ringtrain as rt
from ringtrain import checkpoint
from ringtrain.errors import CheckpointError


def ranks(directory: str) -> dict[str, Any]:
    """Everything this module needs from a 2-rank world (one world for the module)."""
    r, root = rt.rank(), Path(directory)
    out: dict[str, Any] = {}
    # Per-rank files: save writes rank 0's only, and load read rank 0's for every rank.
    checkpoint.save(root / f"ck-rank{r}.ckpt", {"rank": torch.tensor([r])})
    try:
        out["per_rank"] = checkpoint.load(root / f"ck-rank{r}.ckpt")["rank"].item()
    except CheckpointError as exc:
        out["per_rank"] = str(exc)
    # One path on every rank still loads.
    out["same"] = checkpoint.load(root / "ck-rank0.ckpt")["rank"].item()
    # Sharded: each rank's state holds part of the keys (as pipeline stages do); the
    # checkpoint's keys are judged against all ranks' together.
    full = {k: torch.full((2,), float(i)) for i, k in enumerate("abc")}
    checkpoint.save_sharded(root / "abc.dcp", {"model": full})
    checkpoint.save_sharded(root / "ab.dcp", {"model": {k: full[k] for k in "ab"}})
    part = {"model": {"ab"[r]: torch.zeros(2)}}
    checkpoint.load_sharded(root / "ab.dcp", part)
    out["split"] = part["model"]["ab"[r]].tolist()
    try:
        checkpoint.load_sharded(root / "abc.dcp", {"model": {"ab"[r]: torch.zeros(2)}})
        out["lacking"] = "loaded"
    except CheckpointError as exc:
        out["lacking"] = str(exc)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(ranks, 2, str(tmp_path_factory.mktemp("world")), timeout=120)


@pytest.mark.timeout(150)
def test_load_of_per_rank_paths_is_an_error_on_every_rank(world: list[dict[str, Any]]) -> None:
    for got in world:
        assert isinstance(got["per_rank"], str), got  # was 0 (rank 0's file) on rank 1
        assert "different paths" in got["per_rank"] and "ck-rank1.ckpt on rank 1" in got["per_rank"]
    assert [got["same"] for got in world] == [0, 0]


@pytest.mark.timeout(150)
def test_sharded_keys_no_rank_holds_are_refused(world: list[dict[str, Any]]) -> None:
    assert [got["split"] for got in world] == [[0.0, 0.0], [1.0, 1.0]]
    for got in world:
        assert "holds model.c, which the state lacks" in got["lacking"], got


def test_a_sharded_checkpoint_of_a_bigger_model_is_refused(tmp_path: Path) -> None:
    checkpoint.save_sharded(tmp_path / "a.dcp", {"model": {"w": torch.ones(2), "extra": torch.ones(3)},
                                                 "optimizer": {"w.exp_avg": torch.ones(2)}})
    state = {"model": {"w": torch.zeros(2)}}
    with pytest.raises(CheckpointError, match=r"holds model\.extra, which the state lacks"):
        checkpoint.load_sharded(tmp_path / "a.dcp", state)
    # strict=False is DCP's own partial load; an entry the state does not name is not read.
    assert checkpoint.load_sharded(tmp_path / "a.dcp", state, strict=False)["model"]["w"].tolist() == [1, 1]
    state = {"model": {"w": torch.zeros(2), "extra": torch.zeros(3)}}
    assert checkpoint.load_sharded(tmp_path / "a.dcp", state)["model"]["extra"].tolist() == [1, 1, 1]


def test_two_saves_of_one_path_at_once_both_land(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both threads have written their temporary file before either renames it.
    barrier, real_fsync, calls, lock = threading.Barrier(2), os.fsync, [0], threading.Lock()

    def fsync(fd: int) -> None:
        with lock:
            calls[0] += 1
            first_two = calls[0] <= 2
        if first_two:
            barrier.wait(timeout=10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    errors: list[BaseException] = []

    def save(value: float) -> None:
        try:
            checkpoint.save(tmp_path / "a.ckpt", {"x": torch.full((1000,), value)})
        except BaseException as exc:  # noqa: BLE001 - collected for the assert
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(v,)) for v in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors  # was "cannot write checkpoint ...: No such file or directory"
    assert checkpoint.load(tmp_path / "a.ckpt")["x"].unique().tolist() in ([1.0], [2.0])
    assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]


@pytest.mark.parametrize(("older", "newer"), [
    ("epoch-9.ckpt", "epoch-10.ckpt"),
    ("step_100-loss_0.35.ckpt", "step_200-loss_0.20.ckpt"),
    ("epoch=9-step=990-val_loss=0.52.ckpt", "epoch=10-step=1100-val_loss=0.41.ckpt"),
])
def test_latest_compares_every_number_in_the_name(tmp_path: Path, older: str, newer: str) -> None:
    checkpoint.save(tmp_path / newer, {"v": 2})
    checkpoint.save(tmp_path / older, {"v": 1})  # the later mtime must not decide
    assert checkpoint.latest(tmp_path) == tmp_path / newer


def test_a_device_error_is_not_blamed_on_the_safe_load(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "a.ckpt", {"x": torch.ones(2)})
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(tmp_path / "a.ckpt", map_location="cuda:999")
    text = str(info.value)
    assert "weights_only=False" not in text and "map_location='cpu'" in text, text
