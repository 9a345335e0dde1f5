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


class _Planted:
    """What an attacker pickles: unpickling calls os.system (here: touches a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os

        return (os.system, (f"touch {self.marker}",))


def _planted_checkpoint(path: Path, marker: Path, key: str = "model") -> None:
    """A well-formed ringtrain checkpoint (valid header and SHA-256) with a malicious payload."""
    import hashlib
    import io
    import struct

    buf = io.BytesIO()
    torch.save({key: _Planted(marker), "step": 1}, buf)
    payload = buf.getvalue()
    path.write_bytes(struct.pack("<8sQ32s", b"RTCKPT01", len(payload), hashlib.sha256(payload).digest())
                     + payload)


def test_a_crafted_pickle_is_refused_naming_the_type_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    p = tmp_path / "step-999999.ckpt"
    _planted_checkpoint(p, marker)
    with pytest.raises(rt.errors.CheckpointError, match=r"holds posix\.system.*weights_only=False"):
        rt.checkpoint.load(p)
    assert not marker.exists(), "unpickling the planted file ran code"


def test_resume_and_keras_restore_refuse_a_planted_checkpoint(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _planted_checkpoint(tmp_path / "step-999999.ckpt", marker)
    model = torch.nn.Linear(2, 1)
    state = rt.elastic.Resumable(tmp_path, model=model, every=1)
    with pytest.raises(rt.errors.CheckpointError, match="posix.system"):
        state.resume()
    assert not marker.exists()


def test_objects_beyond_tensors_need_the_explicit_opt_in(tmp_path: Path) -> None:
    import fractions

    p = tmp_path / "o.ckpt"
    rt.checkpoint.save(p, {"frac": fractions.Fraction(1, 3)})
    with pytest.raises(rt.errors.CheckpointError, match="fractions.Fraction"):
        rt.checkpoint.load(p)
    assert rt.checkpoint.load(p, weights_only=False)["frac"] == fractions.Fraction(1, 3)


def test_what_ringtrain_saves_loads_safely(tmp_path: Path) -> None:
    import random

    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": m.state_dict(), "optimizer": opt.state_dict(), "rng": random.getstate(),
             "torch_rng": torch.get_rng_state(), "step": 3, "name": "x", "flags": (True, None)}
    rt.checkpoint.save(tmp_path / "s.ckpt", state)
    back = rt.checkpoint.load(tmp_path / "s.ckpt")
    assert back["rng"] == state["rng"] and back["optimizer"]["state"][0]["step"] == 1


def test_appended_bytes_and_stale_temp_files(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    p = tmp_path / "a.ckpt"
    rt.checkpoint.save(p, {"x": torch.ones(3)})
    with open(p, "ab") as f:
        f.write(b"junk")
    with pytest.raises(rt.errors.CheckpointError, match="4 bytes after its end"):
        rt.checkpoint.load(p)
    # a writer killed mid-save (its pid no longer exists) left its temporary file
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    import socket

    stale = tmp_path / f"b.ckpt.tmp-{socket.gethostname()}-{dead}"
    stale.write_bytes(b"half")
    live = tmp_path / f"c.ckpt.tmp-{socket.gethostname()}-{os.getpid()}"
    live.write_bytes(b"in progress")
    other_host = tmp_path / f"d.ckpt.tmp-elsewhere-{dead}"
    other_host.write_bytes(b"someone else's")
    assert rt.checkpoint.latest(tmp_path) is None  # the damaged a.ckpt is skipped
    assert not stale.exists() and live.exists() and other_host.exists()
    stale.write_bytes(b"half")
    rt.checkpoint.save(tmp_path / "e.ckpt", {"x": 1})
    assert not stale.exists()


def test_a_full_disk_names_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os as os_module

    real_fsync = os_module.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os_module, "fsync", full)
    with pytest.raises(rt.errors.CheckpointError, match=r"cannot write checkpoint .*f\.ckpt.*No space left.*free"):
        rt.checkpoint.save(tmp_path / "f.ckpt", {"x": torch.ones(2)})
    monkeypatch.setattr(os_module, "fsync", real_fsync)
    assert not list(tmp_path.glob("f.ckpt*")), "no half-written file is left"


@pytest.mark.parametrize("bad", ["lambda", "lock"])
def test_a_state_pickle_cannot_write_is_a_checkpoint_error_and_no_file(tmp_path: Path, bad: str) -> None:
    # It was pickle's own TypeError / PicklingError (or an AttributeError for a local class).
    import threading

    target = tmp_path / "c.ckpt"
    rt.checkpoint.save(target, {"step": 1})
    obj = (lambda x: x) if bad == "lambda" else threading.Lock()
    with pytest.raises(CheckpointError, match="pickle cannot write .*state_dict"):
        rt.checkpoint.save(target, {"step": 2, "extra": obj})
    assert rt.checkpoint.load(target) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]
