"""A lost peer is recognised from what torch 2.13 really raises: the type where torch gives
one, the one text table where it does not (ringtrain.peer_failure).

The Gloo and store messages below were printed by torch 2.13.0 (CPU build) for a 2-rank
Gloo job whose peer was SIGKILLed, exited, slept past the timeout or had its connections
shut down, and by TCPStore when a key never came, the server went away or nobody
listened. They are also produced live here, in this process (two Gloo groups on threads,
a store server of its own), so a new torch that rewords them fails here first.
"""

from __future__ import annotations

import datetime
import gc
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ringtrain import sever
from ringtrain.errors import CollectiveError, ConfigError, MismatchError, StallError
from ringtrain.peer_failure import TEXT_TABLE, Failure, classify, is_world_failure

_PAIR = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
         "[127.0.0.1]:4239. This is typically caused by a remote worker crashing. Check the logs of the "
         "remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")

RECORDED: list[tuple[str, type[BaseException], str, Failure]] = [
    # (case, type torch raised, message, what it means)
    ("gloo: peer SIGKILLed mid-allreduce", RuntimeError, _PAIR, Failure.PEER_GONE),
    ("gloo: peer exited, recv from it", RuntimeError, _PAIR.replace("4239", "17058"), Failure.PEER_GONE),
    ("gloo: connections shut down (sever)", RuntimeError, _PAIR.replace("4239", "47245"), Failure.PEER_GONE),
    ("gloo: process-group timeout", RuntimeError,
     "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
     "2000ms for recv operation to complete", Failure.TIMEOUT),
    ("gloo: work.wait(timeout)", RuntimeError, "Operation timed out!", Failure.TIMEOUT),
    ("gloo: reset while reading", RuntimeError,
     "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:43222: Connection reset by peer", Failure.PEER_GONE),
    ("store: key never set", dist.DistStoreError, "wait timeout after 500ms, keys: /missing", Failure.TIMEOUT),
    ("store: nobody listens", dist.DistNetworkError,
     "The client socket has timed out after 1000ms while trying to connect to (127.0.0.1, 40485).",
     Failure.PEER_GONE),
    ("store: server gone during a wait", dist.DistNetworkError,
     "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?",
     Failure.PEER_GONE),
    # NCCL (no GPU here, so not recorded): torch's DistBackendError wording "NCCL error in:
    # <file>:<line>, <ncclGetErrorString>, NCCL version <v>" with the strings NCCL gives
    # for ncclRemoteError and ncclSystemError.
    ("nccl: remote error", dist.DistBackendError,
     "NCCL error in: ProcessGroupNCCL.cpp:2036, remote process exited or there was a network error, "
     "NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote "
     "process exiting prematurely.", Failure.PEER_GONE),
    ("nccl: system error", dist.DistBackendError,
     "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for "
     "details), NCCL version 2.21.5", Failure.TRANSPORT),
]


@pytest.mark.parametrize("case,kind,message,want", RECORDED, ids=[r[0] for r in RECORDED])
def test_recorded_messages(case: str, kind: type[BaseException], message: str, want: Failure) -> None:
    exc = kind(message)
    assert classify(exc) is want
    assert is_world_failure(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x1)"),
    RuntimeError("CUDA out of memory"),
    ValueError("connection string is malformed"),  # not raised by torch.distributed
    KeyError("store"),
])
def test_the_scripts_own_errors_are_no_distributed_failure(exc: BaseException) -> None:
    assert classify(exc) is None and not is_world_failure(exc)


def test_types_decide_before_text() -> None:
    assert classify(dist.DistNetworkError("anything")) is Failure.PEER_GONE
    assert classify(ConnectionResetError(104, "reset")) is Failure.PEER_GONE
    assert classify(dist.DistStoreError("anything")) is Failure.TIMEOUT
    assert classify(dist.DistBackendError("words the table does not know")) is Failure.TRANSPORT


def test_ringtrains_own_errors_say_themselves() -> None:
    assert is_world_failure(StallError("rank 1 missing"))
    assert is_world_failure(CollectiveError("allreduce failed"))
    assert not is_world_failure(MismatchError("Mismatched shapes: Connection closed"))
    assert not is_world_failure(ConfigError("bad"))


def test_the_table_tries_specific_fragments_first() -> None:
    order = [fragment for fragment, _ in TEXT_TABLE]
    for general in ("connection", "socket"):
        for fragment in order:
            if general in fragment and fragment != general:
                assert order.index(fragment) < order.index(general), fragment


# -- produced live: the real messages of this process's torch --------------------------------


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    yield server
    del server
    gc.collect()


def _gloo_pair(store: dist.TCPStore, prefix: str, timeout_s: float) -> dict[int, dist.ProcessGroup]:
    """Two ranks of a Gloo group in this process, each on its own store connection."""
    groups: dict[int, dist.ProcessGroup] = {}

    def make(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=datetime.timedelta(seconds=10))
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), rank, 2,
                                             datetime.timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(groups) == 2
    return groups


def _failure_of(group: dist.ProcessGroup) -> BaseException:
    with pytest.raises(RuntimeError) as info:
        group.allreduce([torch.ones(4)]).wait()
    return info.value


@pytest.mark.timeout(60)
def test_live_gloo_failures(store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    before = set(sever.socket_inodes())
    # The peer never arrives: Gloo's own timeout.
    groups = _gloo_pair(store, "timeout/", 0.2)
    exc = _failure_of(groups[0])
    assert "Timed out waiting" in str(exc) and classify(exc) is Failure.TIMEOUT
    groups.clear()
    # The peer's group is gone (its process exited): its connections closed.
    groups = _gloo_pair(store, "closed/", 10.0)
    del groups[1]
    gc.collect()
    exc = _failure_of(groups[0])
    assert "Connection closed by peer" in str(exc) and classify(exc) is Failure.PEER_GONE
    groups.clear()
    # A resizable job's survivor shuts its connections down (ringtrain.sever).
    groups = _gloo_pair(store, "severed/", 10.0)
    timer = threading.Timer(0.3, lambda: sever.sever(["127.0.0.1"], spare=before))
    timer.start()
    exc = _failure_of(groups[0])
    timer.join()
    assert classify(exc) is Failure.PEER_GONE and is_world_failure(exc)
    groups.clear()
    gc.collect()


@pytest.mark.timeout(60)
def test_live_store_failures(store: dist.TCPStore) -> None:
    with pytest.raises(dist.DistStoreError) as waited:
        store.wait(["never"], datetime.timedelta(milliseconds=100))
    assert classify(waited.value) is Failure.TIMEOUT
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    with pytest.raises(dist.DistNetworkError) as refused:
        dist.TCPStore("127.0.0.1", closed_port, None, False, timeout=datetime.timedelta(milliseconds=300))
    assert classify(refused.value) is Failure.PEER_GONE
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=10))
    got: list[BaseException] = []

    def wait() -> None:
        try:
            client.wait(["never"])
        except BaseException as exc:  # noqa: BLE001 - what we came for
            got.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    del server
    gc.collect()
    waiter.join(10)
    assert got and isinstance(got[0], dist.DistNetworkError) and classify(got[0]) is Failure.PEER_GONE
