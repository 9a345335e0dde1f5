"""Shards by URL from a local HTTP server: bounded cache, retries, errors naming the shard."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from test_data_shards import decode_sample, write_tar_shards

from ringtrain.data import Loader, ShardCache, TarShards
from ringtrain.errors import DataError, WorkerError


def _serve(root: str, conn: Any, fail_first: dict[str, int], always: set[str]) -> None:
    """An HTTP server for ``root``; a shard in ``fail_first`` answers 503 that many
    times first, one in ``always`` answers 500 forever. Runs in its own process, so
    the loader never forks a process that has a server thread."""
    left = dict(fail_first)
    lock = threading.Lock()

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=root, **kw)

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            name = self.path.rsplit("/", 1)[-1]
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
    with pytest.raises(DataError, match=r"could not download shard memory://bucket/nope\.tar"):
        TarShards(["memory://bucket/nope.tar"], cache=cache)
