"""Checkpoints that are written once, atomically, and verified when read.

File layout: an 8-byte magic, the payload length (8 bytes, little endian), the SHA-256
of the payload (32 bytes), then the payload (``torch.save`` bytes). ``save`` writes a
temporary file in the same directory, fsyncs it and renames it over the target, so a
reader sees the old file or the new one, never half of one. ``load`` checks length and
checksum before unpickling, so a truncated or flipped byte is a clear error naming the
file. In a multi-process job rank 0 writes (other ranks return at once) and rank 0
reads and broadcasts, so every rank ends with the same state even without a shared
file system.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch

from ringtrain import runtime
from ringtrain.errors import CheckpointError

__all__ = ["SUFFIX", "latest", "load", "save", "verify"]

log = logging.getLogger("ringtrain.checkpoint")

_MAGIC = b"RTCKPT01"
_HEADER = struct.Struct("<8sQ32s")
SUFFIX = ".ckpt"
_TMP_MARK = ".tmp-"


def _distributed() -> bool:
    return runtime.is_initialized() and runtime.size() > 1


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename still happened
    finally:
        os.close(fd)


def save(path: str | os.PathLike[str], state: Any) -> Path | None:
    """Write ``state`` to ``path`` atomically on rank 0; other ranks return ``None``.

    Safe to call on every rank or on rank 0 only (it never waits for other ranks).
    """
    target = Path(path)
    if runtime.is_initialized() and runtime.rank() != 0:
        return None
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    header = _HEADER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}{_TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a half-written file behind
        raise
    _fsync_dir(target.parent)
    log.info("saved checkpoint %s (%d bytes)", target, len(payload))
    return target


def _read_verified(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist; check the path") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from None
    if len(data) < _HEADER.size:
        raise CheckpointError(
            f"checkpoint {path} is truncated ({len(data)} bytes, header alone is {_HEADER.size}); "
            "use an earlier checkpoint"
        )
    magic, length, digest = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise CheckpointError(f"{path} is not a ringtrain checkpoint (bad magic); check the path")
    payload = data[_HEADER.size :]
    if len(payload) != length:
        raise CheckpointError(
            f"checkpoint {path} is truncated: {len(payload)} of {length} payload bytes; "
            "use an earlier checkpoint"
        )
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(
            f"checkpoint {path} is corrupt (checksum mismatch); use an earlier checkpoint"
        )
    return payload


def verify(path: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a complete, intact checkpoint."""
    _read_verified(Path(path))


def _unpickle(payload: bytes, path: Path, weights_only: bool | None, map_location: Any) -> Any:
    if weights_only is None:
        try:
            return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError or RuntimeError
            # The checksum proves integrity, not origin: say so when we go beyond tensors.
            log.warning(
                "checkpoint %s holds objects beyond tensors (%s); loading it with "
                "weights_only=False: only do this for files you trust",
                path, str(exc).splitlines()[0][:120],
            )
            weights_only = False
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=weights_only)


def load(
    path: str | os.PathLike[str], weights_only: bool | None = None, map_location: Any = "cpu"
) -> Any:
    """Read a checkpoint; in a job, rank 0 reads and every rank gets the same state.

    Every rank must call it. ``weights_only=None`` tries the safe loader first and falls
    back (with a warning) for states holding other Python objects.
    """
    target = Path(path)
    if not _distributed():
        return _unpickle(_read_verified(target), target, weights_only, map_location)
    from ringtrain.collectives import broadcast_, broadcast_object

    payload: bytes | None = None
    status: Any = None
    if runtime.rank() == 0:
        try:
            payload = _read_verified(target)
            status = len(payload)
        except CheckpointError as exc:
            status = str(exc)
    status = broadcast_object(status, root_rank=0, name=f"checkpoint {target}")
    if isinstance(status, str):
        raise CheckpointError(status)
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload is not None
        else torch.empty(int(status), dtype=torch.uint8)
    )
    broadcast_(buf, root_rank=0, name=f"checkpoint {target}")
    return _unpickle(buf.numpy().tobytes(), target, weights_only, map_location)


def _step_key(path: Path) -> tuple[int, float]:
    numbers = re.findall(r"\d+", path.name)
    return (int(numbers[-1]) if numbers else -1, path.stat().st_mtime)


def latest(directory: str | os.PathLike[str], pattern: str = f"*{SUFFIX}") -> Path | None:
    """The newest complete checkpoint in ``directory`` (highest number in its name, then mtime).

    Damaged files are skipped with a warning, so a crash during a write never hides the
    previous good checkpoint.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    candidates = [p for p in root.glob(pattern) if _TMP_MARK not in p.name and p.is_file()]
    for candidate in sorted(candidates, key=_step_key, reverse=True):
        try:
            _read_verified(candidate)
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
            continue
        return candidate
    return None
