"""Checkpoints that are written once, atomically, and verified when read.

File layout: an 8-byte magic, the payload length (8 bytes, little endian), the SHA-256
of the payload (32 bytes), then the payload (``torch.save`` bytes). ``save`` writes a
temporary file in the same directory, fsyncs it and renames it over the target, so a
reader sees the old file or the new one, never half of one. ``load`` checks length and
checksum before unpickling, so a truncated or flipped byte is a clear error naming the
file. Plain ``torch.load`` cannot read this format (it fails with an IndexError, as on
any file that is not its own); :func:`read` is the one-process read, and a file
``torch.save`` wrote is refused by :func:`load` with a line saying to use ``torch.load``.
In a multi-process job rank 0 writes (other ranks return at once) and rank 0
reads and broadcasts, so every rank ends with the same state even without a shared
file system. A rank that reads the file itself (:func:`read`, :func:`latest`) right
after a :func:`save` must wait for rank 0 first (``rt.barrier()``): it may still find
the previous file, never a half-written one.

Sharded state (FSDP2 / DTensor parameters, pipeline stages that each hold part of the
model) goes through ``torch.distributed.checkpoint`` instead: :func:`save_sharded`
has every rank write its own shards into a temporary directory, then rank 0 writes a
manifest (size and SHA-256 of every file) and renames the directory into place;
:func:`load_sharded` fills a state dict of *any* layout from it (DCP reshards by the
tensors' global shapes). A kill during the save leaves the previous checkpoint
untouched; a kill between the two renames of an overwrite leaves it under
``<name>.old-<token>``, where :func:`load_sharded` finds it. Every rank must see the
same directory (one host, or a shared file system), as with DCP itself.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import socket
import struct
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ringtrain import runtime
from ringtrain.agreement.ranks import settle
from ringtrain.errors import CheckpointError, first_line

__all__ = [
    "SHARDED_SUFFIX", "SUFFIX", "is_final_name", "latest", "load", "load_sharded", "read", "remove_stale_temps",
    "save",
    "save_sharded", "verify", "verify_sharded",
]

log = logging.getLogger("ringtrain.checkpoint")

_MAGIC = b"RTCKPT01"
_HEADER = struct.Struct("<8sQ32s")
SUFFIX = ".ckpt"
#: Suggested suffix of a sharded checkpoint directory (``latest(d, "*.dcp")``).
SHARDED_SUFFIX = ".dcp"
_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"
_MANIFEST = "ringtrain-manifest.json"


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


def _path(path: str | os.PathLike[str]) -> Path:
    # "~/ckpt/x.ckpt" means the home directory: taken literally, save created a
    # directory named "~" in the working directory (torch.save refuses the path).
    return Path(path).expanduser()


def _rank_local_part(state: Any) -> str | None:
    """Where ``state`` holds a DTensor whose value is spread over several ranks (FSDP2
    parameters, tensor-parallel shards, a pending ``Partial`` sum), described; else None.

    Such a tensor pickles as this rank's part only: a file rank 0 writes holds rank 0's
    shards, and a load hands them to every rank, which ``load_state_dict`` copies into
    each rank's own shard without complaint."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None:  # never imported: no DTensor can exist
        return None
    stack: list[tuple[str, Any]] = [("state", state)]
    seen: set[int] = set()
    while stack:
        where, node = stack.pop()
        if isinstance(node, dtensor):
            mesh = node.device_mesh
            spread = [repr(p) for i, p in enumerate(node.placements)
                      if not p.is_replicate() and mesh.size(i) > 1]
            if spread:
                return f"{where} (a DTensor placed {', '.join(spread)} over {mesh.size()} ranks)"
        elif isinstance(node, (dict, list, tuple)) and id(node) not in seen:
            seen.add(id(node))
            items = node.items() if isinstance(node, dict) else enumerate(node)
            stack.extend((f"{where}[{key!r}]", value) for key, value in items)
    return None


def _refuse_rank_local(target: Path, state: Any) -> None:
    where = _rank_local_part(state)
    if where is not None:
        raise CheckpointError(
            f"cannot save checkpoint {target}: {where} holds only this rank's part, so a load "
            "would give every rank rank 0's part; save sharded state with "
            "rt.checkpoint.save_sharded on every rank, or gather a full state first "
            "(torch.distributed.checkpoint.state_dict.get_state_dict with "
            "StateDictOptions(full_state_dict=True))")


def save(path: str | os.PathLike[str], state: Any) -> Path | None:
    """Write ``state`` to ``path`` atomically on rank 0; other ranks return ``None``.

    Safe to call on every rank or on rank 0 only (it never waits for other ranks). A
    DTensor spread over several ranks (FSDP2, tensor parallel) is a :class:`CheckpointError`
    on every rank that calls it: rank 0's file would hold rank 0's shards alone
    (:func:`save_sharded` is for such state).
    """
    target = _path(path)
    # Before the rank test: every rank that calls save raises, not rank 0 alone.
    _refuse_rank_local(target, state)
    if runtime.is_initialized() and runtime.rank() != 0:
        return None
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        # Before any file is touched: a lambda, a lock or a local class in the state.
        raise CheckpointError(
            f"cannot save checkpoint {target}: the state holds an object pickle cannot write "
            f"({exc}); save plain data (state_dict()s, tensors, numbers, strings) instead") from None
    payload = buf.getbuffer()
    header = _HEADER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest())
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fix = ("a file of that name is in the way: remove it or save elsewhere"
               if exc.errno in (errno.EEXIST, errno.ENOTDIR) else "save to a directory you can write")
        raise CheckpointError(f"cannot create the checkpoint directory {target.parent}: "
                              f"{exc.strerror}; {fix}") from None
    remove_stale_temps(target.parent)
    tmp = target.with_name(_temp_name(target.name))
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        _discard(tmp)  # never leave a half-written file behind
        raise CheckpointError(_write_error(target, exc, len(payload))) from None
    except BaseException:
        _discard(tmp)
        raise
    _fsync_dir(target.parent)
    log.info("saved checkpoint %s (%d bytes)", target, len(payload))
    return target


def _discard(tmp: Path) -> None:
    """Remove a temporary file; where that fails too (a read-only file system), the
    error being reported already says why, and the next save removes leftovers."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def is_final_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint's own name (not a writer's temporary or an old copy)."""
    return _TMP_MARK not in name and _OLD_MARK not in name


def _temp_name(name: str) -> str:
    # host and pid: a later save (or latest()) can tell a dead writer's leftover from a
    # live writer's file, also on a file system shared by several hosts. The token: two
    # saves of one path at once in one process (threads) must not share a temporary file
    # (the second truncated the first's, one rename failed, the other could publish a mix).
    return f"{name}{_TMP_MARK}{socket.gethostname()}-{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _writer_is_gone(tmp_name: str) -> bool:
    tail = tmp_name.rsplit(_TMP_MARK, 1)[-1]
    host, _, pid = tail.rpartition("-")
    pid = pid.split(".", 1)[0]  # "<pid>.<token>" (a pre-token leftover is "<pid>")
    if not host or not pid.isdigit():
        return False  # not a host-pid name (an older sharded save's token: its name's next save cleans it)
    if host != socket.gethostname():
        return False  # another host's writer: not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False  # alive (another user's), or not a pid at all
    return False


def remove_stale_temps(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete temporary files and directories that writers killed mid-save left in
    ``directory`` (those of live writers and of other hosts are kept); returns them."""
    root = _path(directory)
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if _TMP_MARK in entry.name and _writer_is_gone(entry.name):
            try:
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                removed.append(entry)
                log.info("removed %s, left by a writer that died mid-save", entry)
            except OSError:
                pass
    return removed


def _write_error(target: Path, exc: OSError, nbytes: int) -> str:
    text = f"cannot write checkpoint {target} ({nbytes / 2**20:.1f} MiB): {exc.strerror}"
    if exc.errno == errno.ENOSPC:
        try:
            free = shutil.disk_usage(target.parent).free
            text += f" ({free / 2**20:.1f} MiB free there); free space or save elsewhere"
        except OSError:
            text += "; free space or save elsewhere"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        text += "; save to a directory you can write"
    elif exc.errno == errno.EISDIR:
        text += f"; name a file in it (e.g. {target / ('checkpoint' + SUFFIX)})"
    return text


def _read_verified(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist; check the path") from None
    except IsADirectoryError:
        raise CheckpointError(f"checkpoint {path} is a directory; a sharded checkpoint (save_sharded) "
                              "loads with rt.checkpoint.load_sharded") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from None
    if len(data) < _HEADER.size:
        raise CheckpointError(
            f"checkpoint {path} is truncated ({len(data)} bytes, header alone is {_HEADER.size}); "
            "use an earlier checkpoint"
        )
    magic, length, digest = _HEADER.unpack_from(data)
    if magic != _MAGIC and magic[:6] == _MAGIC[:6]:
        # Another ringtrain's format: "not a ringtrain checkpoint; check the path" misled.
        raise CheckpointError(
            f"checkpoint {path} is in ringtrain checkpoint format {magic[6:].decode(errors='replace')!r}, "
            f"which this ringtrain (format {_MAGIC[6:].decode()!r}) cannot read; load it with "
            "the ringtrain version that wrote it")
    if magic != _MAGIC:
        hint = ("; it looks like a plain torch.save file: load it with torch.load"
                if data[:2] == b"PK" or data[:1] == b"\x80" else "; check the path")
        raise CheckpointError(f"{path} is not a ringtrain checkpoint (bad magic){hint}")
    payload = data[_HEADER.size :]
    if len(payload) < length:
        raise CheckpointError(
            f"checkpoint {path} is truncated: {len(payload)} of {length} payload bytes; "
            "use an earlier checkpoint"
        )
    if len(payload) > length:
        raise CheckpointError(
            f"checkpoint {path} has {len(payload) - length} bytes after its end (something "
            "appended to it); use an earlier checkpoint"
        )
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(
            f"checkpoint {path} is corrupt (checksum mismatch); use an earlier checkpoint"
        )
    return payload


def verify(path: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a complete, intact checkpoint."""
    _read_verified(_path(path))


_UNSAFE_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _unpickle(payload: bytes, path: Path, weights_only: bool | None, map_location: Any) -> Any:
    """Unpickle safely: ``torch.load(weights_only=True)`` allows tensors, numbers,
    strings, bools, None and containers of them, which is everything ringtrain itself
    saves (model and optimizer state, loader positions, RNG states, step counts). The
    SHA-256 header proves the file is intact, not who wrote it: a crafted pickle could run
    code, so any other type is an error that names it; ``weights_only=False`` is the
    explicit opt-in for a file you trust. ``None`` (the default) is torch.load's own
    default: safe, unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` is set (torch honours
    the variable only where the call leaves ``weights_only`` unset)."""
    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError or RuntimeError
        if weights_only is False or not isinstance(exc, pickle.UnpicklingError):
            # Not the safe load's refusal (that is an UnpicklingError): a map_location
            # naming a device this machine lacks, say. weights_only=False would not help.
            why = first_line(exc, 120)
            if "device" in why.lower():
                why += f" (map_location={map_location!r}); load with map_location='cpu' (the default)"
            raise CheckpointError(f"cannot load checkpoint {path}: {why}") from None
        found = sorted(set(_UNSAFE_GLOBAL.findall(str(exc))))
        what = ", ".join(found) if found else first_line(exc, 160)
        raise CheckpointError(
            f"checkpoint {path} holds {what}, which a safe load does not allow (unpickling it could "
            "run code); if you trust the file, allow the type with torch.serialization.add_safe_globals "
            "or load it with rt.checkpoint.load(path, weights_only=False)"
        ) from None


def read(
    path: str | os.PathLike[str], weights_only: bool | None = None, map_location: Any = "cpu"
) -> Any:
    """Read a checkpoint in this process alone: no collective, any rank may call it at any
    time (its file system must hold the file). Verified and loaded as :func:`load` does."""
    target = _path(path)
    return _unpickle(_read_verified(target), target, weights_only, map_location)


def load(
    path: str | os.PathLike[str], weights_only: bool | None = None, map_location: Any = "cpu"
) -> Any:
    """Read a checkpoint; in a job, rank 0 reads and every rank gets the same state.

    Every rank must call it, with the same path. The load is safe by default (see :func:`_unpickle`);
    ``weights_only=False`` loads arbitrary pickled objects and is only for trusted files.
    """
    target = _path(path)
    if not _distributed():
        return read(target, weights_only, map_location)
    from ringtrain.collectives import allgather_object, broadcast_

    payload: bytes | None = None
    status: Any = None
    if runtime.rank() == 0:
        try:
            payload = _read_verified(target)
            status = len(payload)
        except CheckpointError as exc:
            status = str(exc)
    # Every rank's path along with rank 0's verdict: per-rank files (``ckpt-{rank}``)
    # would otherwise all load rank 0's file, silently.
    parts = allgather_object((status, str(target)), name=f"checkpoint {target}")
    status = parts[0][0]
    paths = [path for _, path in parts]
    if len(set(paths)) > 1:
        other = next(r for r, p in enumerate(paths) if p != paths[0])
        raise CheckpointError(
            f"rt.checkpoint.load got different paths: {paths[0]} on rank 0, {paths[other]} on rank "
            f"{other}; it reads rank 0's file for every rank (and rt.checkpoint.save writes on rank 0 "
            "only): pass the same path on every rank, or save and load per-rank files with "
            "torch.save / torch.load")
    if isinstance(status, str):
        raise CheckpointError(status)
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload is not None
        else torch.empty(int(status), dtype=torch.uint8)
    )
    broadcast_(buf, root_rank=0, name=f"checkpoint {target}")
    state = _unpickle(buf.numpy().tobytes(), target, weights_only, map_location)
    # A file torch.save wrote on rank 0 (or an older save): its sharded DTensors hold rank
    # 0's shards, which every rank's load_state_dict would take as its own.
    where = _rank_local_part(state)
    if where is not None:
        raise CheckpointError(
            f"checkpoint {target} holds rank 0's part of sharded state in {where}; every rank "
            "would load rank 0's part: save sharded state with rt.checkpoint.save_sharded and "
            "load it with rt.checkpoint.load_sharded")
    return state


def _step_key(path: Path) -> tuple[tuple[int, ...], float]:
    # Every number in the name, compared left to right as numbers: epoch-10 follows
    # epoch-9, and "step_200-loss_0.20" follows "step_100-loss_0.35" (the last number
    # alone, the loss's digits, picked the older one).
    numbers = tuple(int(n) for n in re.findall(r"\d+", path.name))
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = 0.0  # removed since the listing; reading it below skips it
    return (numbers, mtime)


def latest(directory: str | os.PathLike[str], pattern: str = f"*{SUFFIX}") -> Path | None:
    """The newest complete checkpoint in ``directory``: the numbers in its name compared
    left to right (``epoch=10-step=900`` after ``epoch=9-step=990``), then its mtime.

    Damaged files are skipped with a warning, so a crash during a write never hides the
    previous good checkpoint. Sharded checkpoint directories (:func:`save_sharded`)
    count too when ``pattern`` matches them (e.g. ``"*.dcp"``).
    """
    root = _path(directory)
    if not root.is_dir():
        return None
    remove_stale_temps(root)
    candidates = [p for p in root.glob(pattern)
                  if _TMP_MARK not in p.name and _OLD_MARK not in p.name
                  and (p.is_file() or (p / _MANIFEST).exists())]
    for candidate in sorted(candidates, key=_step_key, reverse=True):
        try:
            if candidate.is_dir():
                _check_manifest(candidate, hashes=False)
            else:
                _read_verified(candidate)
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
            continue
        return candidate
    return None


# -- sharded state through torch.distributed.checkpoint ------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _rank_and_size() -> tuple[int, int]:
    return (runtime.rank(), runtime.size()) if _distributed() else (0, 1)


def _agree(status: str | None, what: str) -> None:
    """Rank 0's status reaches every rank: all raise the same error, or none does."""
    def from_rank0(mine: str | None) -> list[str | None]:
        if not _distributed():
            return [mine]
        from ringtrain.collectives import broadcast_object

        return [broadcast_object(mine, root_rank=0, name=what)]

    found = settle(status, from_rank0)
    if found:
        raise CheckpointError(found[0])


@contextlib.contextmanager
def _single_process_is_meant(size: int) -> Iterator[None]:
    # DCP warns that it "assumes" a single process whenever no_dist is set; here it is
    # not an assumption.
    with warnings.catch_warnings():
        if size == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` (tensors may be DTensors / shards) to the directory ``path``.

    Every rank must call it (it is collective). The directory appears complete or not
    at all; an existing one is replaced only once the new one is complete.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    target = _path(path)
    rank, size = _rank_and_size()
    # Rank 0's host and pid, as a file save's temporary has them: a later save or
    # latest() on that host removes the directory of a save whose rank 0 was killed
    # (a random token alone kept it forever unless the same name was saved again).
    token: Any = _temp_name("")[len(_TMP_MARK):]
    if rank == 0:
        remove_stale_temps(target.parent)
    if size > 1:
        from ringtrain.collectives import broadcast_object

        token = broadcast_object(token, root_rank=0, name=f"checkpoint {target}")
    tmp = target.with_name(f"{target.name}{_TMP_MARK}{token}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(_write_error(target, exc, 0)) from None
    try:
        with _single_process_is_meant(size):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                     no_dist=size == 1)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        # (every rank gets it: DCP gathers the failures) No half-written directory stays
        # behind to fill the disk: a later save cannot tell a token's leftover is dead.
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write sharded checkpoint {target}: {_dcp_reason(exc)}; "
                              "free space or save elsewhere") from None
    # When dcp.save returns on any rank, every rank's files and the metadata are
    # written (DCP finishes with a gather to the coordinator and a broadcast back).
    mine = {f.name: [f.stat().st_size, _sha256(f)] for f in sorted(tmp.glob(f"__{rank}_*"))}
    parts: list[Any] = [mine]
    if size > 1:
        from ringtrain.collectives import allgather_object

        parts = allgather_object(mine, name=f"checkpoint {target}")
    status: str | None = None
    if rank == 0:
        try:
            _publish(tmp, target, parts, size)
        except OSError as exc:
            status = f"cannot write sharded checkpoint {target}: {exc}"
    _agree(status, f"checkpoint {target}")
    log.info("saved sharded checkpoint %s (%d ranks)", target, size)
    return target


def _dcp_reason(exc: BaseException) -> str:
    """The first rank's own error inside DCP's CheckpointException (whose text is every
    rank's traceback), in one line."""
    failures = getattr(exc, "failures", None)
    where = ""
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        exc, where = failures[rank][0], f"rank {rank}: "
    lines = str(getattr(exc, "strerror", None) or exc).strip().splitlines()
    return where + (lines[0] if lines else type(exc).__name__)


def _publish(tmp: Path, target: Path, parts: list[dict[str, Any]], size: int) -> None:
    files: dict[str, Any] = {}
    for part in parts:
        files.update(part)
    for f in sorted(tmp.iterdir()):
        if f.is_file() and f.name not in files:  # the metadata, anything not claimed
            _fsync_file(f)
            files[f.name] = [f.stat().st_size, _sha256(f)]
    manifest = tmp / _MANIFEST
    with open(manifest, "w") as out:
        json.dump({"format": "torch.distributed.checkpoint", "ranks": size,
                   "files": files}, out, indent=1, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    _fsync_dir(tmp)
    old = None
    if target.exists():
        old = target.with_name(f"{target.name}{_OLD_MARK}{tmp.name.rsplit(_TMP_MARK, 1)[1]}")
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    # Leftovers of this name from saves that were killed: no longer needed now.
    for stale in target.parent.glob(f"{_glob_escape(target.name)}.*-*"):
        if (_TMP_MARK in stale.name or _OLD_MARK in stale.name) and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:  # a file checkpoint (rt.checkpoint.save) had this name: its .old- copy stayed forever
            _discard(old)


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _check_manifest(directory: Path, hashes: bool) -> None:
    manifest = directory / _MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} is not a complete sharded checkpoint (no {_MANIFEST}); use an "
            "earlier checkpoint") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest} is unreadable ({exc}); use an earlier checkpoint") from None
    for name, (length, digest) in sorted(files.items()):
        f = directory / name
        try:
            actual = f.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"sharded checkpoint {directory} lacks {name}; use an "
                                  "earlier checkpoint") from None
        if actual != length:
            raise CheckpointError(f"sharded checkpoint {directory}: {name} is truncated "
                                  f"({actual} of {length} bytes); use an earlier checkpoint")
        if hashes and _sha256(f) != digest:
            raise CheckpointError(f"sharded checkpoint {directory}: {name} is corrupt "
                                  "(checksum mismatch); use an earlier checkpoint")


def verify_sharded(path: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is complete and every checksum holds."""
    _check_manifest(_path(path), hashes=True)


def _resolve_sharded(target: Path) -> Path:
    if target.is_dir():
        return target
    if target.is_file():  # before: "does not exist", for a file that is there
        raise CheckpointError(f"{target} is a file, not a sharded checkpoint directory; a checkpoint "
                              "written by rt.checkpoint.save loads with rt.checkpoint.load")
    # A save killed between its two renames left the previous checkpoint here.
    olds = sorted(target.parent.glob(f"{_glob_escape(target.name)}{_OLD_MARK}*"),
                  key=lambda p: p.stat().st_mtime, reverse=True)
    for old in olds:
        try:
            _check_manifest(old, hashes=False)
        except CheckpointError:
            continue
        log.warning("sharded checkpoint %s is missing; loading %s, left by an interrupted "
                    "save", target, old.name)
        return old
    raise CheckpointError(f"sharded checkpoint {target} does not exist; check the path")


def _lacking(directory: Path, state: dict[str, Any]) -> list[str] | None:
    """The checkpoint's keys under a top-level key that ``state`` has which ``state``
    lacks (``None``: the metadata cannot tell)."""
    import torch.distributed.checkpoint as dcp

    try:
        paths = dcp.FileSystemReader(str(directory)).read_metadata().planner_data
    except Exception:  # noqa: BLE001 - DCP's own load reports an unreadable metadata file
        return None
    if not isinstance(paths, dict):
        return None
    lacking = []
    for key, where in paths.items():
        if not isinstance(where, tuple) or not where or where[0] not in state:
            continue  # a whole entry the caller does not ask for (the optimizer, extras)
        node: Any = state
        for part in where:
            if isinstance(node, dict) or (isinstance(node, list) and isinstance(part, int)):
                if part not in node if isinstance(node, dict) else part >= len(node):
                    lacking.append(key)
                    break
                node = node[part]
            else:
                break  # the state holds a leaf here: DCP judges whether it fits
    return sorted(lacking)


def _refuse_partial(found: Path, state: dict[str, Any], target: Path, size: int) -> None:
    """A :class:`CheckpointError` on every rank where the checkpoint holds keys that no
    rank's ``state`` has (a pipeline stage's state lacks the other stages' keys)."""
    mine = _lacking(found, state)
    parts: list[Any] = [mine]
    if size > 1:
        from ringtrain.collectives import allgather_object

        parts = allgather_object(mine, name=f"checkpoint {target} (keys)")
    known = [set(part) for part in parts if part is not None]
    lacking = sorted(set.intersection(*known)) if known else []
    if lacking:
        more = f" and {len(lacking) - 1} more" if len(lacking) > 1 else ""
        raise CheckpointError(
            f"cannot load sharded checkpoint {target} into this state: the checkpoint holds "
            f"{lacking[0]}{more}, which the state lacks (another model's checkpoint?); load it "
            "into a state of the model that saved it, or pass strict=False to load_sharded to "
            "fill only the state's own keys")


def load_sharded(path: str | os.PathLike[str], state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """Fill ``state`` in place from the sharded checkpoint at ``path`` and return it.

    ``state`` describes *this* run's layout (e.g. ``Parallel.state_dict(opt)``): its
    tensors say which pieces this rank needs, whatever layout saved them. Every rank
    must call it. A key of ``state`` the checkpoint lacks is an error (as in DCP); so,
    with ``strict``, is a key the checkpoint holds under a top-level entry of ``state``
    that ``state`` lacks (as ``load_state_dict(strict=True)``; DCP would skip it): a
    4-layer model's checkpoint does not load into a 2-layer model. Top-level entries
    ``state`` does not name (``"optimizer"``, extras) are not read.
    """
    import torch.distributed.checkpoint as dcp

    target = _path(path)
    rank, size = _rank_and_size()
    status: str | None = None
    found: Any = None
    if rank == 0:
        try:
            found = _resolve_sharded(target)
            _check_manifest(found, hashes=False)
        except CheckpointError as exc:
            status = str(exc)
    _agree(status, f"checkpoint {target}")
    if size > 1:
        from ringtrain.collectives import broadcast_object

        found = broadcast_object(str(found), root_rank=0, name=f"checkpoint {target}")
    if strict:
        _refuse_partial(Path(found), state, target, size)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _single_process_is_meant(size):
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(found)), no_dist=size == 1)
    except CheckpointException as exc:
        # DCP raises it on every rank (it gathers the failures) as a BaseException that
        # `except Exception` lets through, its text a traceback per rank. A key or shape
        # that does not fit is the user's mistake: one line naming it.
        raise _sharded_load_error()(
            f"cannot load sharded checkpoint {target} into this state: {_dcp_reason(exc)}; load it "
            "into a state of the model that saved it (same names and shapes)", exc.failures) from None
    return state


@functools.cache
def _sharded_load_error() -> type[CheckpointError]:
    """The error :func:`load_sharded` raises: a :class:`CheckpointError` with one line that
    is still DCP's ``CheckpointException`` (``failures`` included) for code that catches
    that one. Made on first use: importing DCP costs 0.7 s, which ``import
    ringtrain.checkpoint`` should not pay."""
    from torch.distributed.checkpoint.api import CheckpointException

    class ShardedLoadError(CheckpointError, CheckpointException):
        def __init__(self, message: str, failures: dict[int, Any]) -> None:
            CheckpointError.__init__(self, message)
            self._failures = failures

        def __str__(self) -> str:
            return str(self.args[0])

    return ShardedLoadError
