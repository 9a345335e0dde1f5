"""A resizable job's worlds, as files: ringrun writes each worker's next world, the
worker acknowledges the one it joined (a leaf of the standard library only: ringrun,
its host agent and the workers all use it).

In a job started with ``ringrun --min-np M --max-np N`` every worker has a file of its
own (``RINGTRAIN_ELASTIC_FILE``). When the job changes size ringrun (for remote workers:
their host's agent, told over the ssh connection) replaces it, atomically, with::

    {"version": 3,                     # the world's number, one more per change
     "env": {"RINGTRAIN_RANK": "1", ...},  # the launch variables of that world
     "lost": ["10.0.0.7"],             # addresses of hosts that were lost on the way
     "addresses": ["10.0.0.5", ...],   # every address of every host of the job so far
     "reason": "host 10.0.0.7 lost"}

A worker that has joined a world writes ``<file>.joined`` (``{"version": 3}``), which
ringrun (through the agent) reads to know when a world has formed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["ack_path", "read_ack", "read_assignment", "worker_file", "write_ack", "write_assignment"]

#: Suffix of the acknowledgement a worker writes beside its assignment file.
ACK_SUFFIX = ".joined"


def worker_file(directory: str | Path, worker: int) -> str:
    """The assignment file of worker ``worker`` in the job's directory."""
    return str(Path(directory) / f"worker-{worker}.json")


def ack_path(assignment_file: str) -> str:
    return assignment_file + ACK_SUFFIX


def _write_atomic(path: str, data: dict[str, Any], *, create_dir: bool = True) -> None:
    # A reader polling the file sees the old content or the new one, never half of it.
    directory = os.path.dirname(path) or "."
    if create_dir:
        os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # not written yet (or removed at the end of the job)
    return data if isinstance(data, dict) else None


def write_assignment(path: str, assignment: dict[str, Any]) -> None:
    _write_atomic(path, assignment)


def read_assignment(path: str) -> dict[str, Any] | None:
    """The newest world ringrun wrote for this worker, or None."""
    data = _read(path)
    if data is None or not isinstance(data.get("version"), int) or not isinstance(data.get("env"), dict):
        return None
    return data


def write_ack(assignment_file: str, version: int) -> None:
    """This worker has joined world ``version``.

    Never creates the job's directory: ringrun wrote the assignment there before the
    worker read it, so a missing directory means the job ended and removed it while this
    worker was still joining. Creating it again left a ``ringtrain-elastic-*`` directory
    in the temporary folder after the job.
    """
    try:
        _write_atomic(ack_path(assignment_file), {"version": int(version)}, create_dir=False)
    except FileNotFoundError:
        pass  # nobody is left to read it


def read_ack(assignment_file: str) -> int | None:
    data = _read(ack_path(assignment_file))
    version = data.get("version") if data else None
    return version if isinstance(version, int) else None
