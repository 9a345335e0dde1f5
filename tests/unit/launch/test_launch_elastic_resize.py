"""rt.elastic's resize loop without processes: ``drive`` with a fake world (the runtime's
leave/assign/join and its version are stubbed; the assignment file and its watcher are
real), the in-memory commit of a ``Resumable``, and which errors count as a lost peer."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from elastichelp import stop_watcher  # noqa: F401 - autouse: ends each test's watcher
from torch import nn

from ringtrain import assignment, elastic, runtime
from ringtrain.elastic import resize
from ringtrain.errors import CollectiveError, ConfigError, MismatchError
from ringtrain.peer_failure import is_world_failure


class _World:
    """The stubbed runtime: which world we are in, what was severed, assigned, joined."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
        self.version = 0
        self.log: list[Any] = []
        self.path = path
        self.fail_joins = 0
        monkeypatch.setattr(resize, "_watcher", None)
        monkeypatch.setattr(resize, "resizable", lambda: True)
        monkeypatch.setattr(resize, "world_version", lambda: self.version)
        monkeypatch.setattr(resize, "REFORM_WAIT_S", 5.0)
        monkeypatch.setattr(runtime, "sever", lambda addrs: self.log.append(("sever", sorted(addrs))) or 0)
        monkeypatch.setattr(runtime, "assign", lambda env: self.log.append(("assign", dict(env))))
        monkeypatch.setattr(runtime, "world", self._env)

    def _env(self) -> Any:
        class _W:
            class env:  # noqa: N801 - mimics World.env
                elastic_file = self.path
                rank, size = 0, 2
        return _W

    def publish(self, version: int, lost: list[str] | None = None, **more: Any) -> None:
        assignment.write_assignment(self.path, {"version": version, "env": {"RINGTRAIN_RANK": "0",
                                                "RINGTRAIN_WORLD_VERSION": str(version)},
                                                "lost": lost or [], "addresses": ["10.0.0.1", "10.0.0.2"],
                                                **more})

    def peer_lost_once(self) -> int:
        """A training function: in world 0, ringrun writes world 1 (a host lost) and the
        collective fails as Gloo's does; in any later world it returns the version."""
        if self.version == 0:
            self.publish(1, lost=["10.0.0.2"])
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        return self.version

    def leave(self, sever: Any) -> None:
        sever()
        self.log.append("leave")

    def join(self) -> None:
        assigned = [e for e in self.log if isinstance(e, tuple) and e[0] == "assign"][-1][1]
        self.log.append(("join", int(assigned["RINGTRAIN_WORLD_VERSION"])))
        if self.fail_joins:
            self.fail_joins -= 1
            self.publish(int(assigned["RINGTRAIN_WORLD_VERSION"]) + 1)  # replaced while joining
            time.sleep(0.3)
            raise RuntimeError("connection closed by peer")
        self.version = int(assigned["RINGTRAIN_WORLD_VERSION"])


class _State:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def restore(self) -> None:
        self.calls.append("restore")

    def sync(self) -> None:
        self.calls.append("sync")

    def on_reset(self) -> None:
        self.calls.append("reset")


@pytest.mark.timeout(30)
def test_a_lost_peer_moves_the_job_to_the_next_world(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    world = _World(monkeypatch, str(tmp_path / "w.json"))
    state = _State()
    calls = []

    def train() -> str:
        calls.append(world.version)
        if world.version == 0:
            # ringrun writes the next world...
            world.publish(1, lost=["10.0.0.2"], reason="lost rank 2 on nodeb")
            raise CollectiveError("allreduce failed: Connection reset by peer")  # ...a peer died
        return "done"

    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        assert elastic.drive(train, state, world.leave, world.join, lambda: state.calls.append("start")) == "done"
    assert calls == [0, 1]
    # one line, from the new world's rank 0: what was lost, the new size, training goes on
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == ["lost rank 2 on nodeb; world 1 has 2 rank(s); training goes on from the last commit"]
    # Horovod's order: back to the commit, leave, join, reset callbacks, then the sync.
    assert state.calls == ["start", "restore", "reset", "sync"]
    # The watcher closed every connection of the old world (the lost host's and the
    # survivors') as soon as the world was written; leaving closes them again (the
    # connections made since), then the groups go.
    assert world.log == [("sever", ["10.0.0.1", "10.0.0.2"]), ("sever", ["10.0.0.1", "10.0.0.2"]), "leave",
                         ("assign", {"RINGTRAIN_RANK": "0", "RINGTRAIN_WORLD_VERSION": "1"}), ("join", 1)]


@pytest.mark.timeout(30)
def test_connections_to_lost_hosts_are_closed_again_until_the_process_moves_on(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A connection opened to a lost host after the first close (Gloo retrying a connect,
    a group being built as the host vanished) is closed at the next round; once this
    process begins joining the next world, nothing is closed any more."""
    world = _World(monkeypatch, str(tmp_path / "w.json"))
    monkeypatch.setattr(resize, "RESEVER_S", 0.2)
    world.publish(1, lost=["10.0.0.2"])
    watcher = resize._watch()
    deadline = time.monotonic() + 20
    while len(world.log) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    # the old world's connections at once, then the lost host's, round after round
    assert world.log[:3] == [("sever", ["10.0.0.1", "10.0.0.2"]), ("sever", ["10.0.0.2"]),
                             ("sever", ["10.0.0.2"])], world.log
    assert watcher.begin_join(1) is None
    closed = len(world.log)
    time.sleep(0.6)  # three rounds at RESEVER_S
    assert len(world.log) == closed, world.log[closed:]


@pytest.mark.timeout(30)
def test_a_world_without_lost_hosts_closes_nothing_again(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    world = _World(monkeypatch, str(tmp_path / "w.json"))
    monkeypatch.setattr(resize, "RESEVER_S", 0.1)
    world.publish(1)  # the discovery script dropped a host: its workers leave cleanly
    watcher = resize._watch()
    assert watcher.newer(0, 10.0) is not None
    time.sleep(0.5)  # five rounds at RESEVER_S
    assert world.log == []


@pytest.mark.timeout(30)
def test_hosts_updated_moves_at_the_commit_without_restoring(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    world = _World(monkeypatch, str(tmp_path / "w.json"))
    state = _State()

    def train() -> int:
        if world.version == 0:
            world.publish(1)
            raise elastic.HostsUpdated(skip_sync=False)
        return world.version

    assert elastic.drive(train, state, world.leave, world.join, lambda: None) == 1
    assert state.calls == ["reset", "sync"]


@pytest.mark.timeout(30)
def test_a_world_is_joined_even_when_closing_the_old_ones_connections_fails(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The watcher reads each version once: if acting on it raised (closing connections
    failed), the world must still be published, or this rank would never join it."""
    world = _World(monkeypatch, str(tmp_path / "w.json"))
    severs = []

    def sever(addrs: Any) -> int:
        severs.append(sorted(addrs))
        if len(severs) == 1:  # the watcher's, on reading the world
            raise RuntimeError("the store went away")
        return 0

    monkeypatch.setattr(runtime, "sever", sever)
    state = _State()

    assert elastic.drive(world.peer_lost_once, state, world.leave, world.join, lambda: None) == 1
    assert len(severs) == 2  # the watcher's (failed) and the leave's


@pytest.mark.timeout(30)
def test_the_world_being_acted_on_is_joined_not_the_one_before_it(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """World 1 (the discovery script dropped a host) is published; then world 2 (that
    host was lost) is written. The watcher closes the old world's connections, which
    frees the blocked training thread at once, while the watcher is still busy with
    world 2. That thread must not join world 1: the other ranks go to world 2, and it
    would wait in world 1's rendezvous until its timeout."""
    world = _World(monkeypatch, str(tmp_path / "w.json"))
    freed = threading.Event()

    def sever(addrs: Any) -> int:
        if threading.current_thread().name == "ringtrain-elastic-watch" and not freed.is_set():
            freed.set()  # the blocked collective fails now...
            time.sleep(0.5)  # ...while the watcher has not finished with world 2
        return 0

    monkeypatch.setattr(runtime, "sever", sever)

    def train() -> int:
        if world.version == 0:
            world.publish(1)
            deadline = time.monotonic() + 10
            while (resize._watch().latest() or {}).get("version") != 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            world.publish(2, lost=["10.0.0.2"])
            assert freed.wait(10)
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        return world.version

    assert elastic.drive(train, _State(), world.leave, world.join, lambda: None) == 2
    assert [e for e in world.log if isinstance(e, tuple) and e[0] == "join"] == [("join", 2)]


@pytest.mark.timeout(30)
def test_a_world_replaced_while_it_forms_is_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    world = _World(monkeypatch, str(tmp_path / "w.json"))
    world.fail_joins = 1
    state = _State()

    assert elastic.drive(world.peer_lost_once, state, world.leave, world.join, lambda: None) == 2
    assert [e for e in world.log if isinstance(e, tuple) and e[0] == "join"] == [("join", 1), ("join", 2)]


@pytest.mark.timeout(30)
def test_the_scripts_own_errors_are_not_taken_for_a_lost_peer(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    world = _World(monkeypatch, str(tmp_path / "w.json"))
    world.publish(1)  # even with a newer world waiting

    def train() -> None:
        raise ValueError("shapes do not match")

    with pytest.raises(ValueError, match="shapes"):
        elastic.drive(train, _State(), world.leave, world.join, lambda: None)
    assert "leave" not in world.log


@pytest.mark.parametrize("exc,lost", [
    (CollectiveError("allreduce failed"), True),
    (MismatchError("Mismatched shapes"), False),
    (ConfigError("bad"), False),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"), True),
    (RuntimeError("Broken pipe"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (KeyError("x"), False),
])
def test_which_errors_count_as_a_lost_peer(exc: BaseException, lost: bool) -> None:
    assert is_world_failure(exc) is lost


def test_a_fixed_size_job_raises_as_before(tmp_path: Path) -> None:
    def train() -> None:
        raise CollectiveError("a peer died")

    with pytest.raises(CollectiveError):
        elastic.drive(train, _State(), lambda _s: None, lambda: None, lambda: None)


def test_commit_and_restore_in_memory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.Resumable(tmp_path, model=model, optimizer=opt, extra={"seen": [1, 2]})
    state.commit(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state.extra["seen"].append(3)
    state.step = 6
    state.restore()
    assert state.step == 5 and state.extra == {"seen": [1, 2]}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {}  # the step's momentum is gone too
    assert not list(tmp_path.iterdir()), "a commit writes nothing to disk"


@pytest.mark.timeout(30)
def test_a_removed_worker_leaves_at_the_commit_and_exits_0(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    """The discovery script stopped listing this worker's slot: at the commit it leaves
    the world and the process ends with 0 (the others go on without it)."""
    world = _World(monkeypatch, str(tmp_path / "w.json"))
    state = _State()

    def train() -> str:
        world.publish(1, removed=True, reason="the discovery script lists localhost:1")
        raise elastic.HostsUpdated()

    with pytest.raises(SystemExit) as stop:
        elastic.drive(train, state, world.leave, world.join, lambda: None)
    assert stop.value.code == 0 and "leave" in world.log
    assert not [e for e in world.log if isinstance(e, tuple) and e[0] in ("assign", "join")]
