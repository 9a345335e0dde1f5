"""hvd.elastic without processes: the ElasticSampler against Horovod's contract (its
order, ``processed_num``, a reset mid-epoch), TorchState's sync of what each rank
recorded, State's ``reset()`` hook and the order of callbacks and sync, and a peer lost
during the sync that follows a resize. Each test failed before its fix (the comment says
how)."""

from __future__ import annotations

import collections
import copy
import random
from pathlib import Path
from typing import Any

import pytest
from elastichelp import stop_watcher  # noqa: F401 - autouse: ends each test's watcher

import ringtrain.horovod as hvd
from ringtrain import assignment, elastic, runtime
from ringtrain.elastic import resize
from ringtrain.horovod import functions
from ringtrain.horovod.elastic import ElasticSampler, ObjectState, TorchState

N, BS = 100, 5


def _sampler(size: int, rank: int, state: dict[str, Any] | None = None, n: int = N) -> ElasticSampler:
    s = ElasticSampler(list(range(n)), shuffle=True, seed=3)
    s.num_replicas, s.rank = size, rank  # what reset() takes from hvd.size()/hvd.rank()
    s.load_state_dict(state or {"epoch": 0, "processed_num": 0, "processed_indices": []})
    return s


def _world(size: int, state: dict[str, Any], first_batch: int, batches: int,
           seen: list[int]) -> dict[str, Any]:
    """``batches`` steps of a world of ``size`` ranks from the commit ``state``; each rank
    records its batch as the script writes it, with the batch's index in the epoch."""
    ranks = [_sampler(size, r, state) for r in range(size)]
    for i in range(batches):
        for s in ranks:
            seen += s.indices[i * BS:(i + 1) * BS]
            s.record_batch(first_batch + i, BS)
    return ranks[0].state_dict()


def test_a_reset_mid_epoch_neither_repeats_nor_skips_when_batches_are_counted_in_the_epoch() -> None:
    """record_batch(state.batch, bs), the batch's index in the epoch: Horovod counts
    batch_size * size samples whatever the index. ringtrain took the index as a position
    in the split made at the last reset, so after two resizes in an epoch (2 -> 3 -> 2
    ranks) 28 of 100 samples were trained twice and 25 never (with real processes,
    4 -> 3 -> 2 ranks on 90 samples: 24 twice, 6 never)."""
    seen: list[int] = []
    state = _world(2, {"epoch": 0, "processed_num": 0, "processed_indices": []}, 0, 3, seen)
    state = _world(3, state, 3, 2, seen)
    left = len(_sampler(2, 0, state))
    _world(2, state, 5, -(-left // BS), seen)
    twice = [i for i, c in collections.Counter(seen).items() if c > 1]
    assert (len(twice), N - len(set(seen))) == (0, 0)


def test_the_order_and_the_split_are_horovods() -> None:
    """Horovod shuffles with Python's random.Random(seed + epoch); ringtrain drew a torch
    permutation, so every rank trained other samples than under Horovod."""
    order = list(range(N))
    random.Random(3 + 2).shuffle(order)
    s = _sampler(3, 1, {"epoch": 2, "processed_num": 0, "processed_indices": []})
    assert list(s) == (order + order[:2])[1::3] and len(s) == 34  # padded as DistributedSampler
    plain = ElasticSampler(list(range(10)), shuffle=False)
    assert list(plain) == list(range(10))


def test_a_horovod_sampler_state_resumes_where_it_left_off() -> None:
    """A state saved by Horovod's sampler (``{"epoch", "processed_num"}``, in a script's
    own checkpoint) loads and goes on after the processed samples; it raised KeyError
    ('processed_indices'), and ``processed_num`` did not exist."""
    s = _sampler(2, 0, {"epoch": 1, "processed_num": 0})
    s.record_batch(0, 4)
    s.record_batch(1, 4)
    assert s.processed_num == 16  # Horovod's count: batch_size * num_replicas per batch
    order = list(range(N))
    random.Random(3 + 1).shuffle(order)
    resumed = _sampler(2, 1, {"epoch": 1, "processed_num": 16})
    assert list(resumed) == order[16:][1::2]


@pytest.fixture
def rank1_of_2(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """This process as rank 1 of a 2-rank resizable world; collectives answer with what
    rank 0 sent (``sent``) and the two ranks' gathered values."""
    sent: dict[str, Any] = {"objects": {"epoch": 0}}

    def bcast(obj: Any, root_rank: int = 0, name: str | None = None, **_: Any) -> Any:
        return copy.deepcopy(sent["sampler"] if name and name.startswith("elastic.sampler.") else sent["objects"])

    def gather(obj: Any, name: str | None = None, **_: Any) -> list[Any]:
        return [sent["gathered"], obj]

    monkeypatch.setattr(functions, "broadcast_object", bcast)
    monkeypatch.setattr(functions, "allgather_object", gather)
    monkeypatch.setattr(runtime, "rank", lambda: 1)
    monkeypatch.setattr(elastic, "resizable", lambda: True)
    return sent


def test_sync_after_a_resize_takes_every_ranks_recorded_indices(rank1_of_2: dict[str, Any]) -> None:
    """record_indices (Horovod before 0.23): each rank records its own samples and the
    sync takes their union. A resizable job took rank 0's record only: after a resize the
    other ranks' samples of the epoch were trained again (24 of 90 twice with real
    processes, 3 -> 2 ranks)."""
    sampler = _sampler(2, 1, n=20)
    state = TorchState(sampler=sampler, epoch=0)
    sampler.record_indices([7, 8])
    rank1_of_2["sampler"] = {"epoch": 0, "processed_num": 0, "processed_indices": [1, 2]}
    rank1_of_2["gathered"] = [1, 2]
    state.sync()
    assert sampler.processed_indices == {1, 2, 7, 8}
    assert not {1, 2, 7, 8} & set(sampler.remaining_indices) and len(sampler.remaining_indices) == 16


def test_sync_after_a_resize_takes_rank_0s_count(rank1_of_2: dict[str, Any]) -> None:
    sampler = _sampler(2, 1)
    state = TorchState(sampler=sampler, epoch=0)
    sampler.record_batch(0, BS)  # this rank committed one batch less than rank 0
    rank1_of_2["sampler"] = {"epoch": 0, "processed_num": 2 * 2 * BS, "processed_indices": []}
    rank1_of_2["gathered"] = []
    state.sync()
    assert sampler.processed_num == 20 and len(sampler.remaining_indices) == N - 20


def test_a_states_reset_hook_runs_before_the_callbacks() -> None:
    """Horovod's State.on_reset calls ``self.reset()`` (a subclass's hook, "before
    synchronization"), then the callbacks; it was never called."""
    calls: list[str] = []

    class Mine(ObjectState):
        def reset(self) -> None:
            calls.append("reset")

    state = Mine(epoch=0)
    state.register_reset_callbacks([lambda: calls.append("callback")])
    state.on_reset()
    assert calls == ["reset", "callback"]


def test_a_fixed_size_job_runs_the_callbacks_before_the_sync() -> None:
    """hvd.elastic.run outside a resizable job, on HostsUpdatedInterrupt: Horovod's order
    is the callbacks, then the sync (rank 0's state overrides what a callback set on one
    rank); the sync came first."""
    calls: list[str] = []

    class Mine(ObjectState):
        def sync(self) -> None:
            calls.append("sync")
            super().sync()

    hvd.init()
    try:
        state = Mine(epoch=0)
        state.register_reset_callbacks([lambda: calls.append("callback")])

        @hvd.elastic.run
        def train(state: Mine) -> int:
            if len(calls) == 1:
                raise hvd.elastic.HostsUpdatedInterrupt(False)
            return len(calls)

        assert train(state) == 3
        assert calls == ["sync", "callback", "sync"]
    finally:
        hvd.shutdown()


class _Drive:
    """drive() in a fake resizable world: the assignment file and its watcher are real,
    leaving and joining only move the version."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
        self.version = 0
        self.path = str(path)
        self.calls: list[str] = []
        monkeypatch.setattr(resize, "_watcher", None)
        monkeypatch.setattr(resize, "resizable", lambda: True)
        monkeypatch.setattr(resize, "world_version", lambda: self.version)
        monkeypatch.setattr(runtime, "sever", lambda addrs: 0)
        monkeypatch.setattr(runtime, "assign", lambda env: setattr(self, "assigned", dict(env)))
        monkeypatch.setattr(runtime, "world", lambda: self)
        monkeypatch.setattr(runtime, "rank", lambda: 0)
        monkeypatch.setattr(runtime, "size", lambda: 2)

    @property
    def env(self) -> Any:
        return type("Env", (), {"elastic_file": self.path})

    def publish(self, version: int) -> None:
        assignment.write_assignment(self.path, {"version": version, "lost": ["10.0.0.2"],
                                                "addresses": ["10.0.0.1", "10.0.0.2"],
                                                "env": {"RINGTRAIN_WORLD_VERSION": str(version)}})

    def join(self) -> None:
        self.version = int(self.assigned["RINGTRAIN_WORLD_VERSION"])

    # the state drive() calls
    def restore(self) -> None:
        self.calls.append("restore")

    def on_reset(self) -> None:
        self.calls.append("reset")

    def sync(self) -> None:
        self.calls.append("sync")
        if self.version == 1:  # a rank of world 1 (one that just joined) is lost mid-sync
            self.publish(2)
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")


@pytest.mark.timeout(30)
def test_a_peer_lost_during_the_sync_after_a_resize_is_one_more_resize(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Horovod syncs inside its retry loop, so a HorovodInternalError there restores and
    re-forms again. drive() synced outside it: every survivor raised and the job ended
    (e.g. a host added by the discovery script whose rank failed after init)."""
    world = _Drive(monkeypatch, tmp_path / "w.json")

    def train() -> int:
        if world.version == 0:
            world.publish(1)
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        return world.version

    assert elastic.drive(train, world, lambda sever: None, world.join, lambda: None) == 2  # type: ignore[arg-type]
    assert world.calls == ["restore", "reset", "sync", "restore", "reset", "sync"]
