"""Checkpoint audit C2: a silently wrong model, a file in the wrong place, misleading errors.

- ``save`` of FSDP2 / tensor-parallel state (DTensors sharded over the ranks) wrote rank
  0's shards, and ``load`` handed them to every rank: each rank's ``load_state_dict``
  copied rank 0's rows into its own shard without an error;
- ``save("~/ckpt/a.ckpt")`` created a directory named ``~`` in the working directory;
- a checkpoint of another ringtrain format was "not a ringtrain checkpoint; check the path";
- a read-only directory, a file where the directory should be: errors without a fix;
- ``save_sharded`` over a file checkpoint left ``<name>.old-<token>`` forever, and the
  directory of a sharded save whose rank 0 was killed was never removed.
"""

from __future__ import annotations

import errno
import os
import subprocess
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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    root, out = Path(directory), {}
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(8.0).reshape(4, 2)
    sharded = {"model": {"w": distribute_tensor(full, mesh, [Shard(0)])}}
    try:
        checkpoint.save(root / "fsdp.ckpt", sharded)
        out["save"] = "saved"
    except CheckpointError as exc:
        out["save"] = str(exc)
    # A file that holds rank 0's shards anyway (torch.save's payload, an older ringtrain).
    if rt.rank() == 0:
        refuse = getattr(checkpoint, "_refuse_rank_local", None)
        checkpoint._refuse_rank_local = lambda *_: None  # type: ignore[assignment]
        try:
            checkpoint.save(root / "shards.ckpt", sharded)
        finally:
            checkpoint._refuse_rank_local = refuse  # type: ignore[assignment]
    rt.barrier()
    try:
        out["load"] = checkpoint.load(root / "shards.ckpt")["model"]["w"].to_local().tolist()
    except CheckpointError as exc:
        out["load"] = str(exc)
    # Replicated DTensors are whole on rank 0: they save and load.
    checkpoint.save(root / "rep.ckpt", {"w": distribute_tensor(full, mesh, [Replicate()])})
    out["replicated"] = checkpoint.load(root / "rep.ckpt")["w"].to_local().tolist()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(ranks, 2, str(tmp_path_factory.mktemp("world")), timeout=120)


@pytest.mark.timeout(150)
def test_sharded_dtensors_are_refused_by_save_and_load_on_every_rank(world: list[dict[str, Any]]) -> None:
    for got in world:
        # was "saved", then rank 1 loaded [[0, 1], [2, 3]]: rank 0's rows as its own
        assert "state['model']['w'] (a DTensor placed Shard(dim=0) over 2 ranks)" in got["save"], got
        assert "save_sharded" in got["save"]
        assert isinstance(got["load"], str) and "rank 0's part" in got["load"], got
        assert got["replicated"] == torch.arange(8.0).reshape(4, 2).tolist()


def test_a_tilde_path_is_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert checkpoint.save("~/ckpt/a.ckpt", {"x": 1}) == home / "ckpt" / "a.ckpt"
    assert not (cwd / "~").exists()  # was ./~/ckpt/a.ckpt
    assert checkpoint.load("~/ckpt/a.ckpt") == {"x": 1} and checkpoint.latest("~/ckpt") == home / "ckpt" / "a.ckpt"


def test_another_format_version_is_named(tmp_path: Path) -> None:
    p = tmp_path / "a.ckpt"
    checkpoint.save(p, {"x": 1})
    data = bytearray(p.read_bytes())
    data[6:8] = b"02"
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="ringtrain checkpoint format '02'.*version that wrote it"):
        checkpoint.load(p)


def test_write_errors_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="a file of that name is in the way"):
        checkpoint.save(tmp_path / "afile" / "a.ckpt", {"x": 1})

    def read_only(*_: Any, **__: Any) -> Any:
        raise PermissionError(errno.EACCES, "Permission denied")

    # (as root, chmod does not stop a write: the refusal is simulated)
    monkeypatch.setattr(checkpoint, "open", read_only, raising=False)
    with pytest.raises(CheckpointError, match="Permission denied; save to a directory you can write"):
        checkpoint.save(tmp_path / "b.ckpt", {"x": 1})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_sharded_save_over_a_file_checkpoint_leaves_no_old_copy(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "a.dcp", {"x": 1})
    checkpoint.save_sharded(tmp_path / "a.dcp", {"x": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.dcp"]  # was also a.dcp.old-<token>


def test_a_killed_sharded_save_is_removed_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint.save_sharded(tmp_path / "a.dcp", {"x": torch.ones(2)})
    # A save whose rank 0 was killed during dcp.save: its pid is gone, so the next
    # save (or latest()) on this host removes the directory (it stayed forever).
    dead = subprocess.Popen(["true"])
    dead.wait()
    import torch.distributed.checkpoint as dcp

    def killed(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt  # a BaseException, as a kill: nothing cleans up

    with monkeypatch.context() as m:
        m.setattr(checkpoint.os, "getpid", lambda: dead.pid)
        m.setattr(dcp, "save", killed)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_sharded(tmp_path / "b.dcp", {"x": torch.ones(2)})
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("b.dcp.tmp-")]) == 1
    assert checkpoint.latest(tmp_path, "*.dcp") == tmp_path / "a.dcp"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.dcp"]
    assert os.path.isdir(tmp_path / "a.dcp")
