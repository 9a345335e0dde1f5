"""Shards listed by URL: downloaded whole into a bounded local cache, then read in place.

``http://`` and ``https://`` are fetched with the standard library; any other scheme
(``s3://``, ``gs://``, ...) through ``fsspec`` when it is installed (with the scheme's
own package, e.g. ``s3fs``). Local paths and ``file://`` URLs are read where they lie.

The cache holds at most ``max_bytes``: before a shard is added, the least recently
used shards are deleted until it fits, so a dataset larger than the local disk
trains (each rank only ever needs the few shards it is reading). A shard a worker is
still reading when another evicts it stays readable: the reader holds it open, and
the file's blocks are freed when it lets go. Workers of one host share the cache
directory; a lock file per shard makes the second worker wait for the first
worker's download instead of fetching it again.

A failed download (connection error, HTTP error, truncated body) is retried
``attempts`` times with exponential back-off, then raised as a ``DataError`` that
names the shard.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from pathlib import Path
from typing import Any

from ringtrain.errors import DataError

__all__ = ["ShardCache", "is_remote"]

_CHUNK = 1 << 20


def is_remote(name: str) -> bool:
    """True for a URL the cache downloads (anything with a scheme but ``file://``)."""
    return "://" in name and not name.startswith("file://")


def _local(name: str) -> Path:
    return Path(name[len("file://"):] if name.startswith("file://") else name)


class ShardCache:
    """A bounded local copy of remote shards (see the module docstring).

    Args:
        directory: where copies live (default: ``$TMPDIR/ringtrain-shards-<uid>``).
        max_bytes: the most the cached shards may take together (default 8 GiB).
        attempts: downloads of one shard before the error.
        backoff_s: the wait before the second attempt, doubled for each later one.
        timeout_s: socket timeout of one HTTP request.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None,
                 max_bytes: int = 8 << 30, attempts: int = 3, backoff_s: float = 0.5,
                 timeout_s: float = 60.0) -> None:
        if max_bytes <= 0 or attempts <= 0:
            raise DataError(f"max_bytes and attempts must be > 0, got {max_bytes}, {attempts}")
        if directory is None:
            directory = Path(tempfile.gettempdir()) / f"ringtrain-shards-{os.getuid()}"
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)
        self.attempts = int(attempts)
        self.backoff_s = float(backoff_s)
        self.timeout_s = float(timeout_s)
        self.downloads = 0  # shards this process downloaded (hits do not count)

    # ---- the one entry point ---------------------------------------------------------
    def path(self, name: str) -> Path:
        """A local file holding shard ``name`` (downloaded now if it is not cached)."""
        if not is_remote(name):
            return _local(name)
        self.directory.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha1(name.encode()).hexdigest()[:16]
        base = name.rstrip("/").rsplit("/", 1)[-1][-80:] or "shard"
        target = self.directory / f"{digest}-{base}"
        with open(self.directory / f".{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one download per shard per host
            if target.exists():
                os.utime(target)  # most recently used
                return target
            self._download(name, target)
        return target

    def cached_bytes(self) -> int:
        """Bytes of the shards in the cache now."""
        total = 0
        for p in self._entries():
            try:
                total += p.stat().st_size
            except FileNotFoundError:  # evicted by another process meanwhile
                pass
        return total

    # ---- internals -------------------------------------------------------------------
    def _entries(self) -> list[Path]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return [self.directory / n for n in names if not n.startswith(".")]

    def _make_room(self, nbytes: int, keep: Path) -> None:
        if nbytes > self.max_bytes:
            raise DataError(f"a shard of {nbytes} bytes does not fit the shard cache "
                            f"(max_bytes={self.max_bytes}); raise ShardCache(max_bytes=...)")
        entries = []
        for p in self._entries():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):  # least recently used first
            if total + nbytes <= self.max_bytes:
                break
            if p != keep:
                p.unlink(missing_ok=True)
                total -= size

    def _download(self, name: str, target: Path) -> None:
        last: Exception | None = None
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
            try:
                self._fetch(name, tmp, target)
                os.replace(tmp, target)
                self.downloads += 1
                return
            except DataError:
                tmp.unlink(missing_ok=True)
                raise
            except (OSError, HTTPException, ValueError) as err:  # URLError is an OSError
                tmp.unlink(missing_ok=True)
                last = err
        raise DataError(f"could not download shard {name} ({self.attempts} attempts): "
                        f"{_reason(last)}")

    def _fetch(self, name: str, tmp: Path, target: Path) -> None:
        if name.startswith(("http://", "https://")):
            with urllib.request.urlopen(name, timeout=self.timeout_s) as resp:
                length = resp.headers.get("Content-Length")
                expected = int(length) if length is not None else None
                if expected is not None:
                    self._make_room(expected, target)
                got = _copy(resp, tmp)
            if expected is not None and got != expected:
                raise OSError(f"the transfer stopped after {got} of {expected} bytes")
            if expected is None:
                self._make_room(got, target)
            return
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError:
            raise DataError(f"shard {name}: reading {name.split('://')[0]}:// URLs needs "
                            "fsspec (pip install fsspec and the scheme's package, e.g. "
                            "s3fs)") from None
        with fsspec.open(name, "rb") as src:
            size = getattr(src, "size", None)
            if isinstance(size, int):
                self._make_room(size, target)
            got = _copy(src, tmp)
        if not isinstance(size, int):
            self._make_room(got, target)


def _copy(src: Any, tmp: Path) -> int:
    with open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, _CHUNK)
        return out.tell()


def _reason(err: Exception | None) -> str:
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code} {err.reason}"
    if isinstance(err, urllib.error.URLError):
        return str(err.reason)
    return f"{type(err).__name__}: {err}"
