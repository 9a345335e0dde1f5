"""Shards by URL from a local HTTP server: bounded cache, retries, errors naming the shard."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from test_data_shards import decode_sample, write_tar_shards

from ringtrain.data import Loader, ShardCache, TarShards
from ringtrain.errors import DataError, WorkerError


def _serve(root: str, conn: Any, fail_first: dict[str, int], always: set[str],
           log: str | None = None) -> None:
    """An HTTP server for ``root``; a shard in ``fail_first`` answers 503 that many
    times first, one in ``always`` answers 500 forever; with ``log``, each GET appends
    ``<monotonic time> <name>`` to it (CLOCK_MONOTONIC is one clock for every process
    of the host). Runs in its own process, so the loader never forks a process that
    has a server thread."""
    left = dict(fail_first)
    lock = threading.Lock()

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=root, **kw)

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            name = self.path.rsplit("/", 1)[-1]
            if log is not None:
                with open(log, "a") as f:
                    f.write(f"{time.monotonic()} {name}\n")
            with lock:
                fail = name in always or left.get(name, 0) > 0
                if name in left and left[name] > 0:
                    left[name] -= 1
            if fail:
                self.send_error(500 if name in always else 503)
                return
            super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    conn.send(server.server_address[1])
    server.serve_forever()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Any]:
    procs = []

    def start(fail_first: dict[str, int] | None = None,
              always: set[str] | None = None) -> tuple[list[str], ShardCache]:
        paths = write_tar_shards(tmp_path / "remote", [30, 25, 40, 35, 20, 50])
        parent, child = mp.Pipe()
        proc = mp.get_context("fork").Process(
            target=_serve, args=(str(tmp_path / "remote"), child, fail_first or {},
                                 always or set()), daemon=True)
        proc.start()
        procs.append(proc)
        port = parent.recv()
        urls = [f"http://127.0.0.1:{port}/{Path(p).name}" for p in paths]
        biggest = max(os.path.getsize(p) for p in paths)
        cache = ShardCache(tmp_path / "cache", max_bytes=int(2.5 * biggest), backoff_s=0.05)
        return urls, cache

    yield start
    for proc in procs:
        proc.terminate()
        proc.join(5)


@pytest.mark.timeout(60)
def test_remote_shards_train_through_a_cache_smaller_than_the_dataset(served: Any) -> None:
    urls, cache = served()
    # the sizes, as an index would give them: no download to count samples
    ds = TarShards(urls, sizes=[30, 25, 40, 35, 20, 50], transform=decode_sample, cache=cache)
    with Loader(ds, batch_size=16, num_workers=2, device="cpu", seed=3) as loader:
        for _ in range(2):  # two epochs: shards evicted in the first come back
            labels = []
            for x, y in loader:
                assert torch.equal(x[:, 0].long(), y)
                labels += y.tolist()
                assert cache.cached_bytes() <= cache.max_bytes  # never more than the bound
            assert sorted(labels) == list(range(200))
    assert cache.cached_bytes() <= cache.max_bytes


@pytest.mark.timeout(60)
def test_a_failed_download_is_retried(served: Any) -> None:
    urls, cache = served(fail_first={"shard-002.tar": 2})  # two 503s, then the file
    ds = TarShards(urls, transform=decode_sample, cache=cache)  # counts: downloads all
    assert ds.shard_sizes == (30, 25, 40, 35, 20, 50)
    assert sorted(int(ds[i][1]) for i in range(len(ds))) == list(range(200))


@pytest.mark.timeout(60)
def test_a_shard_that_never_downloads_is_an_error_naming_it(served: Any) -> None:
    urls, cache = served(always={"shard-004.tar"})
    with pytest.raises(DataError, match=r"could not download shard http://.*/shard-004\.tar "
                                        r"\(3 attempts\): HTTP 500"):
        TarShards(urls, transform=decode_sample, cache=cache)
    ds = TarShards(urls, sizes=[30, 25, 40, 35, 20, 50], transform=decode_sample, cache=cache)
    with Loader(ds, batch_size=16, num_workers=2, device="cpu", shuffle=False) as loader:
        with pytest.raises(WorkerError, match=r"shard-004\.tar \(3 attempts\): HTTP 500"):
            for _ in loader:
                pass


def test_other_schemes_go_through_fsspec(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec", reason="needs fsspec (the formats extra)")
    paths = write_tar_shards(tmp_path / "src", [7, 5])
    fs = fsspec.filesystem("memory")
    for p in paths:
        fs.pipe(f"/bucket/{Path(p).name}", Path(p).read_bytes())
    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 20, backoff_s=0.01)
    ds = TarShards("memory://bucket/shard-{000..001}.tar", transform=decode_sample,
                   cache=cache)
    assert ds.shard_sizes == (7, 5) and [ds[i][1] for i in range(12)] == list(range(12))
    assert cache.downloads == 2  # then read from the cache
    fs.pipe("/bucket/shard-001.tar", Path(write_tar_shards(tmp_path / "new", [3])[0]).read_bytes())
    fresh = ShardCache(tmp_path / "cache", max_bytes=1 << 20, backoff_s=0.01)
    ds = TarShards("memory://bucket/shard-{000..001}.tar", transform=decode_sample, cache=fresh)
    assert ds.shard_sizes == (7, 3) and fresh.downloads == 1  # the rewritten one alone
    with pytest.raises(DataError, match=r"could not download shard memory://bucket/nope\.tar"):
        TarShards(["memory://bucket/nope.tar"], cache=cache)


@pytest.mark.timeout(60)
def test_a_shard_rewritten_at_its_source_is_downloaded_again(served: Any, tmp_path: Path) -> None:
    urls, cache = served()
    assert int(TarShards(urls[:1], transform=decode_sample, cache=cache)[0][1]) == 0
    # the same URL now serves other samples (the default cache outlives the job)
    src = tmp_path / "remote" / "shard-000.tar"
    new = write_tar_shards(tmp_path / "new", [50, 7])[1]  # samples 50..56
    os.replace(new, src)
    os.utime(src, (time.time() + 10, time.time() + 10))  # Last-Modified has whole seconds
    again = ShardCache(cache.directory, max_bytes=cache.max_bytes)
    ds = TarShards(urls[:1], transform=decode_sample, cache=again)
    assert [int(ds[i][1]) for i in range(len(ds))] == list(range(50, 57))
    assert again.downloads == 1
    unchanged = ShardCache(cache.directory, max_bytes=cache.max_bytes)
    assert len(TarShards(urls[:1], transform=decode_sample, cache=unchanged)) == 7
    assert unchanged.downloads == 0  # checked against the source, kept


@pytest.mark.timeout(60)
def test_downloads_at_once_never_claim_the_same_room_twice(tmp_path: Path) -> None:
    """Two downloads in flight together, each finding room for one shard: without a
    claim under one lock both would land and the cache would hold twice its room."""
    paths = write_tar_shards(tmp_path / "remote", [20, 20, 20])
    size = os.path.getsize(paths[0])
    assert all(os.path.getsize(p) == size for p in paths)
    arrived = threading.Barrier(2, timeout=10)

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(tmp_path / "remote"), **kw)

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = (tmp_path / "remote" / self.path.rsplit("/", 1)[-1]).read_bytes()
            if not self.path.endswith("000.tar"):
                arrived.wait()  # both requests in flight before either is answered
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.flush()
            time.sleep(0.3)  # both clients know the size now; the body comes later
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/shard-{{:03d}}.tar"
        cache = ShardCache(tmp_path / "cache", max_bytes=int(1.5 * size))
        cache.path(url.format(0))  # the cache holds one shard: room for one more
        peak, done = [0], threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], cache.cached_bytes())

        watcher = threading.Thread(target=watch)
        watcher.start()
        errors: list[BaseException] = []

        def fetch(k: int) -> None:
            try:
                ShardCache(tmp_path / "cache", max_bytes=int(1.5 * size)).path(url.format(k))
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=fetch, args=(k,)) for k in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        done.set()
        watcher.join()
        assert not errors, errors
        assert cache.cached_bytes() <= cache.max_bytes
        assert peak[0] <= cache.max_bytes, f"held {peak[0]} bytes at once"
        assert not [n for n in os.listdir(tmp_path / "cache") if n.endswith((".part", ".grow"))]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(60)
def test_the_claim_of_a_worker_that_died_mid_download_is_void(served: Any) -> None:
    urls, cache = served()
    gone = mp.get_context("fork").Process(target=int)
    gone.start()
    gone.join()
    cache.directory.mkdir(parents=True)
    stale = cache.directory / f".abc-shard-009.tar.{gone.pid}.part"
    with open(stale, "wb") as f:
        f.truncate(cache.max_bytes)  # all the room, claimed by a process that is gone
    ds = TarShards(urls, sizes=[30, 25, 40, 35, 20, 50], transform=decode_sample, cache=cache)
    assert int(ds[0][1]) == 0  # downloads instead of waiting forever
    assert not stale.exists()


def _parquet_files(directory: Path) -> list[Path]:
    """Two Parquet files of ~1 MiB each (3 and 2 row groups); column y is the row number."""
    pa = pytest.importorskip("pyarrow", reason="needs the formats extra")
    import numpy as np
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for f, (lo, hi, group) in enumerate(((0, 300, 100), (300, 500, 100))):
        n = hi - lo
        table = pa.table({
            "y": pa.array(np.arange(lo, hi, dtype=np.int64)),
            "blob": pa.array([rng.bytes(4096) for _ in range(n)], type=pa.binary())})
        paths.append(directory / f"part-{f}.parquet")
        pq.write_table(table, paths[-1], row_group_size=group, compression="none")
    return paths


class _RangeServer:
    """An HTTP server in a thread that answers ``Range`` requests (when ``ranges``) and
    counts the body bytes it sent per file."""

    def __init__(self, root: Path, ranges: bool) -> None:
        self.sent: dict[str, int] = {}
        sent, lock = self.sent, threading.Lock()

        class Handler(SimpleHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _body(self, head: bool) -> None:
                name = self.path.rsplit("/", 1)[-1]
                data = (root / name).read_bytes()
                want = self.headers.get("Range") if ranges else None
                if want is not None:
                    a, b = (int(v) for v in want.removeprefix("bytes=").split("-"))
                    data = data[a:b + 1]
                    self.send_response(206)
                else:
                    self.send_response(200)
                if ranges:
                    self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    with lock:  # before the write: the client may go on as soon as it has it
                        sent[name] = sent.get(name, 0) + len(data)
                    self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._body(head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._body(head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranges", [True, False], ids=["ranges", "no-ranges"])
def test_remote_parquet_counts_rows_from_the_footer_alone(tmp_path: Path, ranges: bool) -> None:
    from ringtrain.data import ParquetDataset

    paths = _parquet_files(tmp_path / "remote")
    server = _RangeServer(tmp_path / "remote", ranges)
    try:
        urls = [f"{server.url}/{p.name}" for p in paths]
        cache = ShardCache(tmp_path / "cache", max_bytes=64 << 20)
        ds = ParquetDataset(urls, cache=cache)
        assert ds.shard_sizes == (100, 100, 100, 100, 100)
        if ranges:  # the footers only: nothing downloaded, a small part of each file sent
            assert cache.downloads == 0 and cache.cached_bytes() == 0
            for p in paths:
                assert 0 < server.sent[p.name] < p.stat().st_size // 8, server.sent
        else:  # a server without ranges: each file downloaded once, then read locally
            assert cache.downloads == 2
        with Loader(ds, batch_size=50, num_workers=0, device="cpu", seed=2) as loader:
            ys = sorted(int(v) for batch in loader for v in batch["y"])
        assert ys == list(range(500)) and cache.downloads == 2  # read: downloaded once each
    finally:
        server.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_the_next_remote_shard_downloads_while_the_current_one_is_read(
        tmp_path: Path, prefetch: bool) -> None:
    # 4 shards of 24 batches, read in order by one rank with one worker, the loop taking
    # 30 ms a batch (the worker needs ~1 ms for one). With prefetch, shard s is requested when the worker starts shard
    # s-1, so before the loop is half-way through s-1; without, only when the worker
    # reaches s, a few batches (its window) before the loop does.
    shards = 4
    paths = write_tar_shards(tmp_path / "remote", [96] * shards)
    log = tmp_path / "gets.log"
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(
        target=_serve, args=(str(tmp_path / "remote"), child, {}, set(), str(log)), daemon=True)
    proc.start()
    try:
        port = parent.recv()
        urls = [f"http://127.0.0.1:{port}/{Path(p).name}" for p in paths]
        cache = ShardCache(tmp_path / "cache", max_bytes=64 << 20, prefetch=prefetch)
        ds = TarShards(urls, sizes=[96] * shards, transform=decode_sample, cache=cache)
        got_at: list[tuple[float, int]] = []  # (time the loop got the batch, its shard)
        with Loader(ds, batch_size=4, num_workers=1, prefetch=2, device="cpu",
                    shuffle=False) as loader:
            for _, y in loader:
                got_at.append((time.monotonic(), int(y[0]) // 96))
                time.sleep(0.03)
        assert [s for _, s in got_at] == [s for s in range(shards) for _ in range(24)]
        gets = [line.split() for line in log.read_text().splitlines()]
        names = [name for _, name in gets]
        assert sorted(names) == sorted(Path(p).name for p in paths)  # each downloaded once
        asked = {int(name[6:9]): float(t) for t, name in gets}
        for s in range(1, shards):
            halfway = got_at[24 * (s - 1) + 12][0]  # the loop half-way through shard s-1
            if prefetch:
                assert asked[s] < halfway, f"shard {s} asked for {asked[s] - halfway:.2f} s late"
            else:
                assert asked[s] > halfway
    finally:
        proc.terminate()
        proc.join(5)
