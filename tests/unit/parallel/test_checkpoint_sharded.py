"""rt.checkpoint's sharded checkpoints in one process: atomic replace, damage, fallback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ringtrain import checkpoint
from ringtrain.errors import CheckpointError


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), value), "b": torch.arange(8.0) + value}


def _load(path: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load_sharded(path, _state(-1.0))


def test_round_trip_and_manifest(tmp_path: Path) -> None:
    path = tmp_path / "step-1.dcp"
    assert checkpoint.save_sharded(path, _state(1.0)) == path
    assert torch.equal(_load(path)["w"], torch.full((64,), 1.0))
    checkpoint.verify_sharded(path)
    assert (path / "ringtrain-manifest.json").exists() and (path / ".metadata").exists()


def test_replacing_leaves_only_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "ck.dcp"
    checkpoint.save_sharded(path, _state(1.0))
    (tmp_path / "ck.dcp.tmp-deadbeef").mkdir()  # left by a save that was killed
    checkpoint.save_sharded(path, _state(2.0))
    assert torch.equal(_load(path)["b"], torch.arange(8.0) + 2.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.dcp"]


def test_a_save_killed_between_its_renames_loads_the_previous_one(tmp_path: Path) -> None:
    path = tmp_path / "ck.dcp"
    checkpoint.save_sharded(path, _state(3.0))
    os.replace(path, tmp_path / "ck.dcp.old-0123")  # what the first rename of an overwrite did
    assert torch.equal(_load(path)["w"], torch.full((64,), 3.0))


def test_an_incomplete_or_truncated_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "ck.dcp"
    checkpoint.save_sharded(path, _state(1.0))
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        _load(path)
    (path / "ringtrain-manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete sharded checkpoint"):
        _load(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        _load(tmp_path / "nothing.dcp")


def test_verify_catches_a_flipped_byte(tmp_path: Path) -> None:
    path = tmp_path / "ck.dcp"
    checkpoint.save_sharded(path, _state(1.0))
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.verify_sharded(path)


def test_latest_finds_the_newest_complete_directory(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        checkpoint.save_sharded(tmp_path / f"step-{step}.dcp", _state(float(step)))
    (tmp_path / "step-3.dcp" / "ringtrain-manifest.json").unlink()  # damaged
    (tmp_path / "step-9.dcp.tmp-abc").mkdir()  # unfinished
    assert checkpoint.latest(tmp_path, "*.dcp") == tmp_path / "step-2.dcp"
    # The file checkpoints' default pattern still sees only files.
    checkpoint.save(tmp_path / "epoch-5.ckpt", {"x": 1})
    assert checkpoint.latest(tmp_path) == tmp_path / "epoch-5.ckpt"


@pytest.mark.parametrize("state,named", [
    ({"w": torch.zeros(8, 8), "b": torch.zeros(8)}, r"Size mismatch .* for w"),
    ({"w": torch.zeros(64), "b": torch.zeros(8), "extra": torch.zeros(2)}, r"Missing key .*extra"),
])
def test_a_state_that_does_not_fit_is_one_line(tmp_path: Path, state: dict[str, torch.Tensor],
                                               named: str) -> None:
    # Before: DCP's CheckpointException, a BaseException (`except Exception` let it through)
    # whose text was a traceback per rank.
    from torch.distributed.checkpoint.api import CheckpointException

    path = tmp_path / "ck.dcp"
    checkpoint.save_sharded(path, _state(1.0))
    with pytest.raises(CheckpointError, match=f"cannot load sharded checkpoint {path} into this state: "
                                              f"rank 0: {named}") as err:
        checkpoint.load_sharded(path, state)
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)
    assert isinstance(err.value, CheckpointException) and 0 in err.value.failures  # as before, for its catchers


def test_a_file_checkpoint_given_to_load_sharded_is_named(tmp_path: Path) -> None:
    # Before: "sharded checkpoint ... does not exist; check the path", for a file that is there.
    path = tmp_path / "step-1.ckpt"
    checkpoint.save(path, _state(1.0))
    with pytest.raises(CheckpointError, match=r"is a file, not a sharded checkpoint directory; .*"
                                              r"rt\.checkpoint\.load"):
        checkpoint.load_sharded(path, _state(0.0))
