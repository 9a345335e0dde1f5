"""The resizable job's driver as a state machine, without processes: the transition table
(ringtrain.launch.elastic.states) and the real Driver over fake workers, hosts and
discovery, one scenario per transition, a host lost during a resize included."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ringtrain import assignment
from ringtrain.errors import LaunchError
from ringtrain.launch.elastic.driver import Driver
from ringtrain.launch.elastic.states import TRANSITIONS, Event, IllegalTransition, JobState, next_state
from ringtrain.launch.elastic.workers import JobHost, WorkerProc
from ringtrain.launch.elastic.worlds import ElasticConfig, WorkerOnHost
from ringtrain.launch.hosts import Host
from ringtrain.launch.job import HostsDown, JobConfig, Stopped
from ringtrain.launch.output import OutputFailure, OutputSink
from ringtrain.launch.remote import HOST_LOST

S, E = JobState, Event

# -- the table --------------------------------------------------------------------------------


@pytest.mark.parametrize("move", sorted(TRANSITIONS.items(), key=str), ids=lambda m: str(m))
def test_each_listed_transition(move: tuple[tuple[JobState, Event], JobState]) -> None:
    (state, event), to = move
    assert next_state(state, event) is to


def test_everything_else_is_refused() -> None:
    refused = [(s, e) for s, e in itertools.product(JobState, Event) if (s, e) not in TRANSITIONS]
    assert (S.ENDED, E.LAUNCHED) in refused and (S.RUNNING, E.ALL_EXITED) in refused
    for state, event in refused:
        with pytest.raises(IllegalTransition):
            next_state(state, event)
    assert not [k for k in TRANSITIONS if k[0] is S.ENDED], "ENDED is final"


# -- fakes ------------------------------------------------------------------------------------


class _Local:
    """A local worker process: exits when the test says."""

    def __init__(self, worker: int) -> None:
        self.worker, self.code, self.ranks = worker, None, (worker,)
        self.stopped = False

    def exits(self) -> dict[int, int]:
        return {} if self.code is None else {self.worker: self.code}

    def alive(self) -> bool:
        return self.code is None

    def where(self, rank: int) -> str:
        return f"pid 1{self.worker} on here"

    def request_stop(self) -> None:
        self.stopped = True
        if self.code is None:
            self.code = -15

    def force_kill(self) -> None:
        pass

    def finish_output(self, timeout: float = 2.0) -> None:
        pass


class _Remote:
    """A remote host's agent connection: ready when the test says, lost when it says."""

    def __init__(self, host: str, ids: list[int], address: str) -> None:
        self.host, self.ranks, self.address = host, tuple(ids), address
        self.ready = True
        self.joined: dict[int, int] = {}
        self.gone = False
        self.error: str | None = None
        self.ssh_tail: list[str] = []
        self.info = {"ifaces": {"eth0": address}}
        self.stopped = False

    def exits(self) -> dict[int, int]:
        return {w: HOST_LOST for w in self.ranks} if self.gone else {}

    def lost(self) -> bool:
        return self.gone

    def problem(self) -> str:
        return "Connection timed out"

    def wait_ready(self, deadline: float) -> bool:
        return self.ready

    def ssh_done(self) -> bool:
        return self.gone

    def heartbeat(self) -> None:
        pass

    def alive(self) -> bool:
        return not self.gone

    def where(self, rank: int) -> str:
        return f"on {self.host}"

    def request_stop(self) -> None:
        self.stopped = True

    def force_kill(self) -> None:
        pass

    def finish_output(self, timeout: float = 2.0) -> None:
        pass


class _Workers:
    """JobWorkers without processes: records every world it is asked to launch."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.procs: dict[int, WorkerProc] = {}
        self.hosts: dict[str, JobHost] = {}
        self.launched: list[dict[str, Any]] = []
        self.made: dict[str, _Remote] = {}
        self.rank0_reachable = True
        self.refuse: Exception | None = None  # what the next launch raises
        self.removed: list[tuple[list[int], int]] = []

    def members(self) -> list[Any]:
        return [p.local for p in self.procs.values() if p.local is not None] + list(self.remotes().values())

    def remote(self, name: str, ids: list[int]) -> Any:
        self.made[name] = _Remote(name, ids, f"10.0.0.{len(self.made) + 7}")
        return self.made[name]

    def register(self, name: str, remote: Any, infos: dict[str, dict[str, Any]]) -> JobHost:
        own = list(remote.info["ifaces"].values()) if remote is not None else ["127.0.0.1"]
        self.hosts[name] = JobHost(name, remote, own, own[0])
        return self.hosts[name]

    def remotes(self) -> dict[str, Any]:
        return {h.name: h.remote for h in self.hosts.values() if h.remote is not None}

    def launch(self, order: list[WorkerOnHost], new: list[WorkerOnHost], lost: list[str], reason: str,
               version: int) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.dir.mkdir(parents=True, exist_ok=True)  # as JobWorkers does before writing a world
        for s in new:
            host = self.hosts[s.host]
            host.workers.append(s.worker)
            self.procs[s.worker] = WorkerProc(
                s.worker, s.host, host.reach, 40000 + s.worker, version,
                assignment.worker_file(self.dir, s.worker),
                local=_Local(s.worker) if host.remote is None else None, remote=host.remote)
        self.launched.append({"version": version, "world": [s.worker for s in order],
                              "new": [s.worker for s in new], "lost": lost, "reason": reason})

    def can_be_rank0(self, slot: WorkerOnHost, hosts: set[str]) -> bool:
        return self.rank0_reachable or len(hosts) < 2

    def remove(self, workers: list[int], version: int, reason: str) -> None:
        self.removed.append((list(workers), version))


class _Discovery:
    def __init__(self, hosts: list[Host]) -> None:
        self.listed, self.answers = list(hosts), 0

    def first(self) -> list[Host]:
        return list(self.listed)

    def start(self) -> None:
        pass

    def hosts(self) -> list[Host]:
        return list(self.listed)

    def rounds(self) -> int:
        return self.answers

    def list(self, hosts: list[Host]) -> None:
        self.listed, self.answers = list(hosts), self.answers + 1

    def close(self) -> None:
        pass


class _Job:
    """A driver over the fakes, and the test's hands on its workers."""

    def __init__(self, tmp: Path, hosts: list[Host], min_np: int, max_np: int, np: int | None = None,
                 reset_limit: int | None = None, start: bool = True, **more: Any) -> None:
        ecfg = ElasticConfig(min_np=min_np, max_np=max_np, hosts=tuple(hosts), np=np, reset_limit=reset_limit,
                             **more)
        cfg = JobConfig(command=("true",), placements=(), elastic=ecfg, start_timeout=5.0)
        self.workers = _Workers(tmp / "job")
        self.discovery = _Discovery(hosts)
        self.stop_flag: list[int] = []
        self.sink = OutputSink(None)
        self.driver = Driver(cfg, f"test{id(self)}", self.sink, self.stop_flag, None,
                             workers=self.workers, discovery=self.discovery)  # type: ignore[arg-type]
        if start:
            self.driver.start()

    @property
    def state(self) -> JobState:
        return self.driver.state

    def join_all(self) -> None:
        """Every worker of the newest world acknowledges it."""
        for w in self.driver.world:
            proc = self.workers.procs[w]
            if proc.remote is not None:
                proc.remote.joined[w] = self.driver.version
            else:
                assignment.write_ack(proc.file, self.driver.version)

    def exit(self, worker: int, code: int) -> None:
        local = self.workers.procs[worker].local
        assert isinstance(local, _Local)
        local.code = code

    def step(self) -> JobState:
        self.driver.step()
        return self.driver.state

    def moves(self) -> list[tuple[JobState, Event, JobState]]:
        return self.driver.history


def _running(tmp: Path, **kw: Any) -> _Job:
    """Two workers on this host, world 0 formed."""
    job = _Job(tmp, [Host("127.0.0.1", 2)], **{"min_np": 1, "max_np": 4, **kw})
    job.join_all()
    assert job.step() is S.RUNNING
    return job


# -- one scenario per transition --------------------------------------------------------------


def scenario_start_and_form(tmp: Path) -> _Job:
    job = _Job(tmp, [Host("127.0.0.1", 2)], min_np=1, max_np=4)
    assert job.state is S.FORMING and job.workers.launched[0]["world"] == [0, 1]
    assert job.step() is S.FORMING  # nobody joined yet
    job.join_all()
    assert job.step() is S.RUNNING and job.driver.formed == 0
    return job


def scenario_lost_while_running(tmp: Path) -> _Job:
    job = _running(tmp)
    job.exit(1, -9)
    assert job.step() is S.FORMING
    assert job.workers.launched[-1] == {"version": 1, "world": [0], "new": [], "lost": [],
                                        "reason": "lost rank 1 on 127.0.0.1"}
    job.join_all()
    assert job.step() is S.RUNNING
    return job


def scenario_grown_while_running(tmp: Path) -> _Job:
    job = _running(tmp)
    job.discovery.list([Host("127.0.0.1", 2), Host("127.0.0.2", 1)])
    assert job.step() is S.FORMING
    assert job.workers.launched[-1]["world"] == [0, 1, 2] and job.workers.launched[-1]["new"] == [2]
    return job


def scenario_host_lost_during_a_resize(tmp: Path) -> _Job:
    """The job grows onto a remote host; that host is lost before the larger world formed:
    the survivors get the next world, told the lost host's address."""
    job = _running(tmp)
    job.discovery.list([Host("127.0.0.1", 2), Host("nodeb", 1)])
    job.step()  # nodeb's agent is connecting
    assert job.step() is S.FORMING and job.workers.launched[-1]["new"] == [2]
    job.workers.made["nodeb"].gone = True  # nodeb vanished with worker 2
    assert job.step() is S.FORMING
    assert job.workers.launched[-1] == {"version": 2, "world": [0, 1], "new": [], "lost": ["10.0.0.7"],
                                        "reason": "lost rank 2 on nodeb"}
    assert "nodeb" not in job.workers.hosts and job.driver.blacklist.blocked("nodeb")
    job.join_all()
    assert job.step() is S.RUNNING
    return job


def scenario_survivor_lost_during_a_resize(tmp: Path) -> _Job:
    """An old worker dies while a grown world forms: the new worker, which holds no state,
    is stopped and the survivors re-form without it."""
    job = scenario_grown_while_running(tmp)
    job.exit(1, 1)
    assert job.step() is S.FORMING
    assert job.driver.cancelled == {2} and job.workers.procs[2].local.stopped  # type: ignore[union-attr]
    assert job.workers.launched[-1]["world"] == [0] and job.workers.launched[-1]["version"] == 2
    return job


def scenario_grown_while_forming(tmp: Path) -> _Job:
    """A host whose agent was still coming up when a worker died joins the re-forming world."""
    job = _running(tmp)
    job.discovery.list([Host("127.0.0.1", 2), Host("nodeb", 1)])
    job.driver._grow()
    job.driver.connecting["nodeb"][0].ready = False
    job.exit(1, -9)
    assert job.step() is S.FORMING and job.driver.version == 1
    job.driver.connecting["nodeb"][0].ready = True
    assert job.step() is S.FORMING and job.driver.version == 2
    assert job.workers.launched[-1]["new"] == [2] and job.workers.launched[-1]["world"] == [0, 2]
    return job


def scenario_finished_then_all_exited(tmp: Path) -> _Job:
    job = _running(tmp)
    job.exit(0, 0)
    assert job.step() is S.FINISHING
    job.exit(1, 0)
    assert job.step() is S.ENDED and job.driver.exit_code == 0
    return job


def scenario_finished_while_forming_then_formed(tmp: Path) -> _Job:
    """Worker 0 joined the grown world and finished before the others joined it."""
    job = scenario_grown_while_running(tmp)
    assignment.write_ack(job.workers.procs[0].file, 1)
    job.exit(0, 0)
    assert job.step() is S.FINISHING
    job.join_all()
    assert job.step() is S.FINISHING and job.driver.formed == 1
    return job


def scenario_lost_while_finishing(tmp: Path) -> _Job:
    job = _running(tmp)
    job.exit(0, 0)
    assert job.step() is S.FINISHING
    job.exit(1, 3)
    assert job.step() is S.ENDED and job.driver.exit_code == 3
    return job


def scenario_too_few(tmp: Path) -> _Job:
    job = _running(tmp, min_np=2)
    job.exit(1, -9)
    assert job.step() is S.ENDED and job.driver.exit_code == 128 + 9
    return job


def scenario_too_few_while_forming(tmp: Path) -> _Job:
    job = _Job(tmp, [Host("127.0.0.1", 2)], min_np=2, max_np=2)
    job.exit(0, -9)
    assert job.step() is S.ENDED and job.driver.exit_code == 128 + 9
    return job


def scenario_reset_limit(tmp: Path) -> _Job:
    job = _running(tmp, reset_limit=0)
    job.exit(1, 1)
    assert job.step() is S.ENDED and job.driver.exit_code == 1
    return job


def scenario_reset_limit_while_forming(tmp: Path) -> _Job:
    job = _Job(tmp, [Host("127.0.0.1", 3)], min_np=1, max_np=3, reset_limit=1)
    job.join_all()
    job.step()
    job.exit(2, -9)
    assert job.step() is S.FORMING  # the one change allowed
    job.exit(1, -9)
    assert job.step() is S.ENDED and job.driver.exit_code == 1
    return job


def _signalled(job: _Job) -> _Job:
    job.stop_flag.append(15)
    with pytest.raises(Stopped):
        job.step()
    assert job.state is S.ENDED and job.driver.exit_code == 128 + 15
    return job


def scenario_stopped_while_starting(tmp: Path) -> _Job:
    """Fewer slots than --min-np: the driver waits for more, and a signal ends the wait."""
    job = _Job(tmp, [Host("127.0.0.1", 1)], min_np=2, max_np=2, start=False)
    job.stop_flag.append(2)
    with pytest.raises(Stopped):
        job.driver.start()
    assert job.state is S.ENDED and job.driver.exit_code == 128 + 2 and not job.workers.launched
    return job


def scenario_stopped_while_forming(tmp: Path) -> _Job:
    return _signalled(_Job(tmp, [Host("127.0.0.1", 2)], min_np=1, max_np=2))


def scenario_stopped_while_running(tmp: Path) -> _Job:
    return _signalled(_running(tmp))


def scenario_stopped_while_finishing(tmp: Path) -> _Job:
    job = _running(tmp)
    job.exit(0, 0)
    job.step()
    return _signalled(job)


def _output_failed(job: _Job) -> _Job:
    job.sink.failure = OutputFailure("stdout is closed", 141)
    assert job.step() is S.ENDED and job.driver.exit_code == 141
    return job


def scenario_output_failed_while_forming(tmp: Path) -> _Job:
    return _output_failed(_Job(tmp, [Host("127.0.0.1", 2)], min_np=1, max_np=2))


def scenario_output_failed_while_running(tmp: Path) -> _Job:
    return _output_failed(_running(tmp))


def scenario_output_failed_while_finishing(tmp: Path) -> _Job:
    job = _running(tmp)
    job.exit(0, 0)
    job.step()
    return _output_failed(job)


def scenario_removed_while_running(tmp: Path) -> _Job:
    """The discovery script lists one slot fewer: the host's last worker is told to leave
    at the next commit, the others get the smaller world, its exit 0 ends nothing."""
    job = _running(tmp, discovery_script="hosts.sh")
    job.discovery.list([Host("127.0.0.1", 1)])
    assert job.step() is S.FORMING
    assert job.workers.launched[-1]["world"] == [0] and job.workers.removed == [([1], 1)]
    job.exit(1, 0)
    job.join_all()
    assert job.step() is S.RUNNING and job.driver.formed == 1
    return job


def test_a_removed_host_that_vanishes_is_announced_as_lost(tmp_path: Path) -> None:
    """The script drops nodeb and nodeb's link goes down at once: its worker never leaves
    at the commit, and the survivors may be blocked on its connections. The same world is
    announced again with nodeb's address, so they sever them."""
    job = _running(tmp_path, discovery_script="hosts.sh")
    job.discovery.list([Host("127.0.0.1", 2), Host("nodeb", 1)])
    job.step()
    assert job.step() is S.FORMING
    job.join_all()
    assert job.step() is S.RUNNING and job.driver.world == [0, 1, 2]
    job.discovery.list([Host("127.0.0.1", 2)])
    assert job.step() is S.FORMING and job.workers.removed == [([2], 2)]
    job.workers.made["nodeb"].gone = True
    assert job.step() is S.FORMING
    assert job.workers.launched[-1] == {"version": 3, "world": [0, 1], "new": [], "lost": ["10.0.0.7"],
                                        "reason": "lost host(s) nodeb"}
    assert "nodeb" not in job.workers.hosts


def scenario_short_while_running_then_a_host_comes(tmp: Path) -> _Job:
    """Below --min-np with --elastic-timeout: the survivor waits; a new host makes the
    next world (the failed host stays blacklisted)."""
    job = _running(tmp, min_np=2, elastic_timeout=30.0)
    job.exit(1, 1)
    assert job.step() is S.WAITING and len(job.workers.launched) == 1
    job.discovery.list([Host("127.0.0.1", 2), Host("127.0.0.2", 1)])
    assert job.step() is S.FORMING
    assert job.workers.launched[-1]["world"] == [0, 2] and job.workers.launched[-1]["new"] == [2]
    return job


def scenario_lost_while_waiting_then_timeout(tmp: Path) -> _Job:
    job = _Job(tmp, [Host("127.0.0.1", 3)], min_np=3, max_np=3, elastic_timeout=30.0)
    job.join_all()
    job.step()
    job.exit(2, 1)
    assert job.step() is S.WAITING
    job.exit(1, 1)
    assert job.step() is S.WAITING and job.driver.world == [0]
    job.driver.waiting_until = 0.0  # --elastic-timeout ran out
    assert job.step() is S.ENDED and job.driver.exit_code == 1
    return job


def scenario_short_while_forming_then_stopped(tmp: Path) -> _Job:
    job = _Job(tmp, [Host("127.0.0.1", 2)], min_np=2, max_np=2, elastic_timeout=30.0)
    job.exit(0, -9)
    assert job.step() is S.WAITING
    return _signalled(job)


def scenario_output_failed_while_waiting(tmp: Path) -> _Job:
    job = _running(tmp, min_np=2, elastic_timeout=30.0)
    job.exit(1, 1)
    assert job.step() is S.WAITING
    return _output_failed(job)


def scenario_reset_limit_instead_of_waiting(tmp: Path) -> _Job:
    """No change of size is left (--reset-limit): waiting for hosts could not help."""
    job = _running(tmp, min_np=2, elastic_timeout=30.0, reset_limit=0)
    job.exit(1, 1)
    assert job.step() is S.ENDED and job.driver.exit_code == 1
    assert job.moves()[-1][1] is E.LIMIT
    return job


def scenario_like_horovod_blacklists_the_failed_ranks_host(tmp: Path) -> _Job:
    """Horovod's rules: both names of this machine are hosts; the first world takes every
    slot; a rank that fails takes its host's other rank out with it."""
    hosts = [Host("localhost", 2), Host("127.0.0.1", 2)]
    job = _Job(tmp, hosts, min_np=2, max_np=4, np=2, like_horovod=True)
    assert job.workers.launched[0]["world"] == [0, 1, 2, 3]
    job.join_all()
    assert job.step() is S.RUNNING
    job.exit(0, 1)
    assert job.step() is S.FORMING
    assert job.workers.launched[-1]["world"] == [2, 3] and job.driver.cancelled == {1}
    assert job.driver.blacklist.blocked("localhost")
    return job


def scenario_like_horovod_every_host_blacklisted(tmp: Path) -> _Job:
    hosts = [Host("localhost", 2), Host("127.0.0.1", 2)]
    job = _Job(tmp, hosts, min_np=2, max_np=4, like_horovod=True, elastic_timeout=600.0)
    job.join_all()
    job.step()
    job.exit(0, 1)
    job.exit(2, 1)
    assert job.step() is S.ENDED and job.driver.exit_code == 1  # no rank left: no waiting
    return job


def scenario_blacklisted_host_comes_back_after_its_cooldown(tmp: Path) -> _Job:
    hosts = [Host("localhost", 2), Host("127.0.0.1", 2)]
    job = _Job(tmp, hosts, min_np=2, max_np=4, like_horovod=True, cooldown_range=(0.05, 0.05))
    job.join_all()
    job.step()
    job.exit(3, 1)
    assert job.step() is S.FORMING and job.workers.launched[-1]["world"] == [0, 1]
    job.join_all()
    assert job.step() is S.RUNNING and job.driver.blacklist.blocked("127.0.0.1")
    import time
    time.sleep(0.1)
    assert job.step() is S.FORMING and not job.driver.blacklist.blocked("127.0.0.1")
    assert job.workers.launched[-1]["world"] == [0, 1, 4, 5]
    return job


SCENARIOS: dict[str, Callable[[Path], _Job]] = {
    name.removeprefix("scenario_"): fn for name, fn in globals().items() if name.startswith("scenario_")}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario(name: str, tmp_path: Path) -> None:
    SCENARIOS[name](tmp_path)


def test_every_transition_is_taken_by_some_scenario(tmp_path: Path) -> None:
    taken: set[tuple[JobState, Event]] = set()
    for i, fn in enumerate(SCENARIOS.values()):
        job = fn(tmp_path / str(i))
        for before, event, after in job.moves():
            assert TRANSITIONS[(before, event)] is after
            taken.add((before, event))
    assert set(TRANSITIONS) - taken == set()


def test_a_host_that_answers_while_the_job_ends_is_not_used(tmp_path: Path) -> None:
    job = _running(tmp_path)
    job.discovery.list([Host("127.0.0.1", 2), Host("nodeb", 1)])
    job.driver._grow()
    remote = job.driver.connecting["nodeb"][0]
    job.exit(0, 0)
    assert job.step() is S.FINISHING
    assert not job.driver.connecting and remote.stopped and len(job.workers.launched) == 1


def test_a_host_whose_world_could_not_start_is_dropped(tmp_path: Path) -> None:
    """The new host's agent cannot reserve ports, or no survivor's rendezvous is
    reachable from it: the job stays as it was and the host is not tried again."""
    for why, refuse, reachable in [("could not reserve", HostsDown("host nodeb could not reserve"), True),
                                   ("on loopback", None, False)]:
        job = _running(tmp_path / why)
        job.workers.refuse, job.workers.rank0_reachable = refuse, reachable
        job.discovery.list([Host("127.0.0.1", 2), Host("nodeb", 1)])
        job.step()
        assert job.step() is S.RUNNING and job.driver.version == 0, why
        assert "nodeb" not in job.workers.hosts and job.driver.blacklist.blocked("nodeb")
        assert job.workers.made["nodeb"].stopped


def test_no_survivor_able_to_host_the_rendezvous_is_an_error(tmp_path: Path) -> None:
    job = _running(tmp_path)
    job.discovery.list([Host("127.0.0.1", 2), Host("nodeb", 2)])
    job.step()
    job.step()
    job.join_all()
    assert job.step() is S.RUNNING and job.driver.version == 1
    job.workers.rank0_reachable = False
    job.exit(1, -9)
    with pytest.raises(LaunchError, match="no surviving worker can host the rendezvous"):
        job.step()
