"""Shards listed by URL: downloaded whole into a bounded local cache, then read in place.

``http://`` and ``https://`` are fetched with the standard library; any other scheme
(``s3://``, ``gs://``, ...) through ``fsspec`` when it is installed (with the scheme's
own package, e.g. ``s3fs``). Local paths and ``file://`` URLs are read where they lie.

The cache holds at most ``max_bytes``: before a shard is downloaded, the least
recently used shards are deleted until it fits, so a dataset larger than the local
disk trains (each rank only ever needs the few shards it is reading). The room is
claimed under one lock for the whole directory, by a placeholder file of the shard's
size, so workers downloading different shards at once cannot each find the same free
room; when downloads in flight hold it all, the next one waits for them. (A shard whose
size the server does not announce is downloaded first and claims its room after.) A shard a worker is
still reading when another evicts it stays readable: the reader holds it open, and
the file's blocks are freed when it lets go. Workers of one host share the cache
directory; a lock file per shard makes the second worker wait for the first
worker's download instead of fetching it again.

A cached shard is checked against its source once per process before its first use:
the server's ``ETag``, ``Last-Modified`` and size (fsspec: the file's ``info``) are
kept beside the copy when it is downloaded, and a shard whose source now answers
differently is downloaded again (the default cache directory outlives the job, so a
dataset rewritten under the same URLs would otherwise be read as it was). A source
that cannot be asked (offline, no such headers) leaves the copy in use, with a warning
for the first.

A failed download (connection error, HTTP error, truncated body) is retried
``attempts`` times with exponential back-off, then raised as a ``DataError`` that
names the shard.

:meth:`ShardCache.prefetch` downloads shards a rank will read next in a background
thread, one at a time, while the current one is read (the loader asks for the shard
after the current one). A prefetch never waits for room and never evicts one of the
most recently used shards (those being read now): when the cache has no such room it
is skipped, and the reader downloads the shard when it needs it, as without prefetch.
It tries once; a failure is left to the reader, whose retries and error name the shard.

:meth:`ShardCache.open_ranges` reads parts of a remote file without downloading it
(HTTP ``Range`` requests, or fsspec's random-access files), so a Parquet footer can be
read for its row counts; a server that ignores ``Range`` gets the whole file downloaded
into the cache instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from http.client import HTTPException
from pathlib import Path
from typing import Any

from ringtrain.errors import DataError

__all__ = ["ShardCache", "is_remote"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_WAIT_S = 0.02  # between looks for room while other downloads hold it
_PREFETCH_KEEP = 8  # most recently used shards a prefetch may not evict (readers' now)


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
        prefetch: download the shard a rank reads next while it reads the current one.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None,
                 max_bytes: int = 8 << 30, attempts: int = 3, backoff_s: float = 0.5,
                 timeout_s: float = 60.0, prefetch: bool = True) -> None:
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
        self.prefetch_enabled = bool(prefetch)
        self._init_prefetcher()

    def _init_prefetcher(self) -> None:
        self._pf_pid = os.getpid()  # a forked worker starts its own (see prefetch)
        self._queue: deque[str] = deque()
        self._queued: set[str] = set()
        self._pf_lock = threading.Lock()
        self._pf_thread: threading.Thread | None = None
        self._checked: set[str] = set()  # shards this process compared with their source

    def __getstate__(self) -> dict[str, Any]:
        # A worker gets its own (empty) queue and thread, not the parent's.
        state = dict(self.__dict__)
        for key in ("_pf_pid", "_queue", "_queued", "_pf_lock", "_pf_thread", "_checked"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_prefetcher()

    def prefetch(self, names: Iterable[str]) -> None:
        """Download these shards in the background, in order, where they are remote,
        not cached and not queued (see the module docstring)."""
        if not self.prefetch_enabled:
            return
        if self._pf_pid != os.getpid():
            # Forked while the parent's thread may have held the lock: a fresh queue,
            # lock and thread for this process (the parent's thread is not here).
            self._init_prefetcher()
        todo = [n for n in names if is_remote(n) and n not in self._queued
                and not self._target(n).exists()]
        if not todo:
            return
        with self._pf_lock:
            for n in todo:
                if n not in self._queued:
                    self._queued.add(n)
                    self._queue.append(n)
            if self._pf_thread is None:
                # A daemon: a process that exits mid-download leaves a .part file whose
                # claim is void once its pid is gone (see _evict_for).
                self._pf_thread = threading.Thread(target=self._prefetch_loop, daemon=True,
                                                   name="ringtrain-prefetch")
                self._pf_thread.start()

    def _prefetch_loop(self) -> None:
        while True:
            with self._pf_lock:
                if not self._queue:
                    self._pf_thread = None
                    return
                name = self._queue[0]
            try:
                self._fetch_ahead(name)
            except Exception:  # noqa: BLE001 - the reader retries it and names it
                pass
            with self._pf_lock:
                self._queue.popleft()
                self._queued.discard(name)

    # ---- the one entry point ---------------------------------------------------------
    def path(self, name: str) -> Path:
        """A local file holding shard ``name`` (downloaded now if it is not cached)."""
        if not is_remote(name):
            return _local(name)
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self._target(name)
        with open(self._lock_path(target), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one download per shard per host
            if target.exists() and self._current(name, target):
                os.utime(target)  # most recently used
                return target
            self._download(name, target)
        return target

    def open_ranges(self, name: str) -> Any:
        """A seekable binary file over ``name`` that reads only the bytes asked for:
        a local file, an fsspec file, or HTTP ``Range`` requests. A cached copy is used
        where there is one; a server that ignores ``Range`` (or announces no size) gets
        the file downloaded into the cache. Close it after use."""
        if not is_remote(name):
            return open(_local(name), "rb")
        cached = self._target(name)
        if cached.exists():
            with open(self._lock_path(cached), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if cached.exists() and self._current(name, cached):
                    return open(cached, "rb")
        if name.startswith(("http://", "https://")):
            try:
                return io.BufferedReader(_HttpRanges(name, self.timeout_s), 1 << 16)
            except _NoRanges:
                return open(self.path(name), "rb")
            except (OSError, HTTPException, ValueError) as err:
                raise DataError(f"could not read {name}: {_reason(err)}") from None
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError:
            raise DataError(f"{name}: reading {name.split('://')[0]}:// URLs needs fsspec "
                            "(pip install fsspec and the scheme's package, e.g. s3fs)") from None
        try:
            return fsspec.open(name, "rb").open()
        except (OSError, ValueError) as err:
            raise DataError(f"could not read {name}: {_reason(err)}") from None

    def _fetch_ahead(self, name: str) -> None:
        """One download attempt for the prefetcher: skipped if the shard is cached or
        being downloaded by a reader, or if there is no room it may take."""
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self._target(name)
        with open(self._lock_path(target), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a reader has it in hand
            if target.exists():
                return
            part = target.with_name(f".{target.name}.{os.getpid()}.part")
            grow = target.with_name(f".{target.name}.{os.getpid()}.grow")
            try:
                self._fetch(name, part, grow, target, protect=_PREFETCH_KEEP)
            except _NoRoom:
                return
            finally:
                part.unlink(missing_ok=True)
                grow.unlink(missing_ok=True)
            self.downloads += 1

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
    def _current(self, name: str, target: Path) -> bool:
        """Whether the cached ``target`` still holds what ``name`` serves (asked once per
        process; the caller holds the shard's lock). A stale copy is deleted."""
        if name in self._checked:
            return True
        try:
            stamp = _stamp(name, self.timeout_s)
        except (OSError, HTTPException, ValueError, ImportError) as err:
            log.warning("cannot check the cached copy of shard %s against its source (%s); "
                        "using the copy", name, _reason(err))
            stamp = None
        kept = _stamp_path(target)
        try:
            before = kept.read_text()
        except OSError:
            before = None
        self._checked.add(name)
        if stamp is None:
            return True
        if before is None:  # a copy from before stamps were kept: adopt the source's
            _write_stamp(kept, stamp)
            return True
        if not _changed(before, stamp):
            return True
        log.info("shard %s changed at its source since it was cached; downloading it again",
                 name)
        target.unlink(missing_ok=True)
        kept.unlink(missing_ok=True)
        self._checked.discard(name)
        return False

    def _target(self, name: str) -> Path:
        digest = hashlib.sha1(name.encode()).hexdigest()[:16]
        base = name.rstrip("/").rsplit("/", 1)[-1][-80:] or "shard"
        return self.directory / f"{digest}-{base}"

    def _lock_path(self, target: Path) -> Path:
        """The per-shard lock file: one download of a shard per host at a time."""
        return self.directory / f".{target.name.split('-', 1)[0]}.lock"

    def _entries(self) -> list[Path]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return [self.directory / n for n in names if not n.startswith(".")]

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The directory-wide lock: held to claim room, install a shard and evict."""
        with open(self.directory / ".cache.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _claim(self, nbytes: int, keep: Path, then: Callable[[], None],
               protect: int | None = None) -> None:
        """Evict until ``nbytes`` more fit beside the cached shards and the room other
        downloads have claimed, then run ``then`` (claim or install) under the lock.
        ``protect``: a prefetch, which evicts none of that many most recently used
        shards and raises ``_NoRoom`` instead of waiting."""
        if nbytes > self.max_bytes:
            if protect is not None:
                raise _NoRoom(nbytes)
            raise DataError(f"a shard of {nbytes} bytes does not fit the shard cache "
                            f"(max_bytes={self.max_bytes}); raise ShardCache(max_bytes=...)")
        while True:
            with self._locked():
                if self._evict_for(nbytes, keep, protect or 0):
                    then()
                    return
            if protect is not None:
                raise _NoRoom(nbytes)
            time.sleep(_WAIT_S)  # downloads in flight hold the room: wait for one to land

    def _evict_for(self, nbytes: int, keep: Path, protect: int = 0) -> bool:
        cached, claimed = [], 0
        for name in os.listdir(self.directory):
            p = self.directory / name
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if not name.startswith("."):
                cached.append((st.st_mtime, st.st_size, p))
            elif name.endswith(".part"):
                if _alive(name):
                    claimed += st.st_size
                else:  # left by a worker that died mid-download: its claim is void
                    p.unlink(missing_ok=True)
        total = claimed + sum(size for _, size, _ in cached)
        by_age = sorted(cached, key=lambda e: e[0])  # least recently used first
        for _, size, p in by_age[:max(0, len(by_age) - protect)]:
            if total + nbytes <= self.max_bytes:
                break
            if p != keep:
                p.unlink(missing_ok=True)
                _stamp_path(p).unlink(missing_ok=True)
                total -= size
        return total + nbytes <= self.max_bytes

    def _download(self, name: str, target: Path) -> None:
        last: Exception | None = None
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            # .part: room claimed at the announced size (counted by every claimant);
            # .grow: size unknown until the end (counted once it is installed)
            part = target.with_name(f".{target.name}.{os.getpid()}.part")
            grow = target.with_name(f".{target.name}.{os.getpid()}.grow")
            try:
                self._fetch(name, part, grow, target)
                self.downloads += 1
                return
            except DataError:
                raise
            except (OSError, HTTPException, ValueError) as err:  # URLError is an OSError
                last = err
            finally:
                part.unlink(missing_ok=True)
                grow.unlink(missing_ok=True)
        raise DataError(f"could not download shard {name} ({self.attempts} attempts): "
                        f"{_reason(last)}")

    def _fetch(self, name: str, part: Path, grow: Path, target: Path,
               protect: int | None = None) -> None:
        if name.startswith(("http://", "https://")):
            with urllib.request.urlopen(name, timeout=self.timeout_s) as resp:
                length = resp.headers.get("Content-Length")
                self._receive(resp, int(length) if length is not None else None,
                              part, grow, target, protect)
                _write_stamp(_stamp_path(target), _http_stamp(resp.headers))
            self._checked.add(name)
            return
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError:
            raise DataError(f"shard {name}: reading {name.split('://')[0]}:// URLs needs "
                            "fsspec (pip install fsspec and the scheme's package, e.g. "
                            "s3fs)") from None
        stamp = _stamp(name, self.timeout_s)  # before the body: a change meanwhile re-fetches
        with fsspec.open(name, "rb") as src:
            size = getattr(src, "size", None)
            self._receive(src, size if isinstance(size, int) else None, part, grow, target,
                          protect)
        _write_stamp(_stamp_path(target), stamp)
        self._checked.add(name)

    def _receive(self, src: Any, expected: int | None, part: Path, grow: Path,
                 target: Path, protect: int | None = None) -> None:
        """Copy ``src`` into the cache as ``target``, keeping the bound throughout."""
        if expected is None:
            got = _copy(src, grow, "wb")
            self._claim(got, target, lambda: os.replace(grow, target), protect)
            return

        def placeholder() -> None:
            with open(part, "wb") as f:
                f.truncate(expected)  # sparse: claims the room, costs no blocks yet

        self._claim(expected, target, placeholder, protect)
        got = _copy(src, part, "r+b")
        if got != expected:
            raise OSError(f"the transfer stopped after {got} of {expected} bytes")
        with self._locked():  # the claim becomes the shard in one rename
            os.replace(part, target)


class _NoRoom(Exception):
    """A prefetch found no room it may take: the reader downloads the shard later."""


class _NoRanges(Exception):
    """The server does not announce ``Accept-Ranges: bytes`` and a size."""


class _HttpRanges(io.RawIOBase):
    """A read-only, seekable file over an HTTP URL: each read is one ``Range`` request."""

    def __init__(self, url: str, timeout_s: float) -> None:
        super().__init__()
        self.url, self.timeout_s, self.pos = url, timeout_s, 0
        head = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(head, timeout=timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            ranges = resp.headers.get("Accept-Ranges", "")
        if length is None or ranges.strip().lower() != "bytes":
            raise _NoRanges(url)
        self.size = int(length)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf: Any) -> int:
        want = min(len(buf), self.size - self.pos)
        if want <= 0:
            return 0
        req = urllib.request.Request(
            self.url, headers={"Range": f"bytes={self.pos}-{self.pos + want - 1}"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            if resp.status == 206:
                data = resp.read(want)
            else:  # the whole body after all: skip to the range (correct, if slow)
                data = resp.read(self.pos + want)[self.pos:]
        if len(data) != want:
            raise OSError(f"a range read of {self.url} returned {len(data)} of {want} bytes")
        buf[:want] = data
        self.pos += want
        return want


_STAMP_FIELDS = ("size", "ETag", "etag", "LastModified", "last_modified", "mtime", "created",
                 "generation", "md5Hash", "version_id")


def _http_stamp(headers: Any) -> str | None:
    fields = {k: headers.get(k) for k in ("ETag", "Last-Modified", "Content-Length")}
    fields = {k: v for k, v in fields.items() if v is not None}
    return json.dumps(fields, sort_keys=True) if fields else None


def _stamp(name: str, timeout_s: float) -> str | None:
    """What identifies the version ``name`` serves now (``None``: nothing does)."""
    if name.startswith(("http://", "https://")):
        head = urllib.request.Request(name, method="HEAD")
        with urllib.request.urlopen(head, timeout=timeout_s) as resp:
            return _http_stamp(resp.headers)
    import fsspec  # type: ignore[import-untyped]

    fs, path = fsspec.core.url_to_fs(name)
    info = fs.info(path)
    fields = {k: info[k] for k in _STAMP_FIELDS if info.get(k) is not None}
    return json.dumps(fields, sort_keys=True, default=str) if fields else None


def _changed(before: str, now: str) -> bool:
    """Whether a field both stamps carry differs (a server may give a HEAD fields its GET
    left out, e.g. a size for a chunked body: those are not a change)."""
    try:
        old, new = json.loads(before), json.loads(now)
    except ValueError:
        return True  # a damaged stamp: download again rather than trust the copy
    return any(old[k] != new[k] for k in old.keys() & new.keys())


def _stamp_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.stamp")  # a dot file: not a cache entry


def _write_stamp(path: Path, stamp: str | None) -> None:
    if stamp is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(stamp)
    os.replace(tmp, path)


def _alive(part_name: str) -> bool:
    """Whether the process named in ``.<shard>.<pid>.part`` still runs."""
    try:
        pid = int(part_name.rsplit(".", 2)[-2])
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True  # not ours to judge: count its claim
    return True


def _copy(src: Any, dest: Path, mode: str) -> int:
    with open(dest, mode) as out:
        shutil.copyfileobj(src, out, _CHUNK)
        out.truncate()  # "r+b" over a placeholder: a short body must not keep its tail
        return out.tell()


def _reason(err: Exception | None) -> str:
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code} {err.reason}"
    if isinstance(err, urllib.error.URLError):
        return str(err.reason)
    return f"{type(err).__name__}: {err}"
