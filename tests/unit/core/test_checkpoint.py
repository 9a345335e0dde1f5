"""Checkpoint files: round trip, damage detection, atomicity, latest()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ringtrain as rt
from ringtrain.errors import CheckpointError


def _state() -> dict[str, object]:
    return {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "epoch": 3, "note": "x"}


def test_round_trip(tmp_path: Path) -> None:
    path = rt.checkpoint.save(tmp_path / "a.ckpt", _state())
    assert path == tmp_path / "a.ckpt"
    got = rt.checkpoint.load(tmp_path / "a.ckpt")
    assert got["epoch"] == 3 and torch.equal(got["model"]["w"], _state()["model"]["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]  # no temp files left


def test_truncated_file_is_named(tmp_path: Path) -> None:
    p = tmp_path / "t.ckpt"
    rt.checkpoint.save(p, _state())
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"t\.ckpt is truncated"):
        rt.checkpoint.load(p)


def test_flipped_byte_is_detected(tmp_path: Path) -> None:
    p = tmp_path / "c.ckpt"
    rt.checkpoint.save(p, _state())
    data = bytearray(p.read_bytes())
    data[-20] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        rt.checkpoint.load(p)


def test_not_a_checkpoint_and_missing(tmp_path: Path) -> None:
    (tmp_path / "x.ckpt").write_bytes(b"hello world, this is not a checkpoint at all......")
    with pytest.raises(CheckpointError, match="not a ringtrain checkpoint"):
        rt.checkpoint.load(tmp_path / "x.ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        rt.checkpoint.load(tmp_path / "missing.ckpt")


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path) -> None:
    p = tmp_path / "k.ckpt"
    rt.checkpoint.save(p, _state())

    class Unpicklable:
        def __reduce__(self) -> tuple[object, ...]:
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        rt.checkpoint.save(p, {"bad": Unpicklable()})
    assert rt.checkpoint.load(p)["epoch"] == 3
    assert sorted(x.name for x in tmp_path.iterdir()) == ["k.ckpt"]


def test_latest_skips_damaged_and_temp_files(tmp_path: Path) -> None:
    assert rt.checkpoint.latest(tmp_path / "nothing") is None
    for step in (1, 2, 10):
        rt.checkpoint.save(tmp_path / f"step-{step}.ckpt", {"step": step})
    (tmp_path / "step-11.ckpt.tmp-123").write_bytes(b"partial")
    assert rt.checkpoint.latest(tmp_path) == tmp_path / "step-10.ckpt"
    p = tmp_path / "step-10.ckpt"
    p.write_bytes(p.read_bytes()[:30])
    assert rt.checkpoint.latest(tmp_path) == tmp_path / "step-2.ckpt"


def test_objects_beyond_tensors_load_with_fallback(tmp_path: Path) -> None:
    import fractions
    from collections import OrderedDict

    p = tmp_path / "o.ckpt"
    rt.checkpoint.save(p, {"frac": fractions.Fraction(1, 3), "od": OrderedDict(a=1)})
    assert rt.checkpoint.load(p)["frac"] == fractions.Fraction(1, 3)
    with pytest.raises(Exception, match="(?i)weights.only"):
        rt.checkpoint.load(p, weights_only=True)
