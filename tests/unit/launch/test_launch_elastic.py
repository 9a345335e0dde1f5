"""Resizable jobs, the pure parts: flags, worlds and ranks, the blacklist, discovery
output, assignment files, and closing connections by address."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from ringtrain import assignment, sever
from ringtrain.env import parse_env
from ringtrain.errors import ConfigError
from ringtrain.launch import cli
from ringtrain.launch.elastic.discovery import parse_discovered, run_script
from ringtrain.launch.elastic.worlds import Blacklist, ElasticConfig, WorkerOnHost, next_world, placements
from ringtrain.launch.hosts import Host, Placement


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# -- flags ------------------------------------------------------------------------------------


def test_min_and_max_np_make_a_resizable_job() -> None:
    cfg = cli.build_config("-H a:1,b:1,c:1 --min-np 2 --max-np 3 true".split())
    assert cfg.elastic == ElasticConfig(min_np=2, max_np=3, hosts=(Host("a", 1), Host("b", 1), Host("c", 1)))
    assert cfg.placements == ()  # the worlds are planned while the job runs


def test_max_np_defaults_to_the_slots_listed_and_min_np_to_np() -> None:
    cfg = cli.build_config("-np 2 -H a:2,b:2 --max-np 4 true".split())
    assert cfg.elastic is not None and (cfg.elastic.min_np, cfg.elastic.max_np, cfg.elastic.np) == (2, 4, 2)
    cfg = cli.build_config("-H a:2,b:2 --min-np 1 true".split())
    assert cfg.elastic is not None and cfg.elastic.max_np == 4


def test_a_discovery_script_needs_no_hosts_and_has_no_upper_bound(tmp_path: Path) -> None:
    script = _script(tmp_path, "echo a:2")
    cfg = cli.build_config(["--min-np", "2", "--host-discovery-script", script, "true"])
    assert cfg.elastic is not None and cfg.elastic.discovery_script == script
    assert cfg.elastic.max_np == cli.UNLIMITED_NP and cfg.elastic.hosts == ()


def test_a_fixed_size_job_is_unchanged() -> None:
    cfg = cli.build_config("-np 2 -H a:1,b:1 --max-restarts 2 true".split())
    assert cfg.elastic is None and [p.host for p in cfg.placements] == ["a", "b"]


@pytest.mark.parametrize("line,fragment", [
    ("--min-np 2 --max-np 3 true", "needs its hosts"),
    ("-H a:1,b:1 --max-np 2 true", "--min-np M is needed"),
    ("-H a:1,b:1 --min-np 3 --max-np 2 true", "--max-np 2 is below --min-np 3"),
    ("-H a:1,b:1 --min-np 1 --max-np 3 true", "more than the 2 slots"),
    ("-np 3 -H a:2,b:2 --min-np 1 --max-np 2 true", "-np 3 must be within"),
    ("-H a:1,b:1 --min-np 1 --max-np 2 --max-restarts 2 true", "use --reset-limit"),
    ("-H a:1,b:1 --min-np 1 --max-np 2 --master-port 29500 true", "rank 0, and with it"),
    ("-H a:1,b:1 --min-np 1 --max-np 2 --reset-limit -1 true", "--reset-limit must be >= 0"),
    ("-np 2 -H a:1,b:1 --reset-limit 3 true", "--reset-limit applies to a resizable job"),
    ("--min-np 1 --host-discovery-script /nonexistent/d.sh true", "is not an executable file"),
    ("-H a:1 --host-discovery-script x.sh --min-np 1 true", "not allowed with argument"),
])
def test_bad_resizing_flags_are_one_line_errors(line: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        cli.build_config(line.split())


def test_the_launch_environment_carries_the_world_and_its_file() -> None:
    env = parse_env({"RINGTRAIN_RANK": "1", "RINGTRAIN_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9",
                     "RINGTRAIN_WORLD_VERSION": "3", "RINGTRAIN_ELASTIC_FILE": "/tmp/w.json"})
    assert (env.version, env.elastic_file) == (3, "/tmp/w.json")
    plain = parse_env({"RINGTRAIN_RANK": "0", "RINGTRAIN_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9"})
    assert (plain.version, plain.elastic_file) == (0, "")


# -- worlds -----------------------------------------------------------------------------------


def test_survivors_keep_their_order_and_rank_0() -> None:
    world = next_world([WorkerOnHost(0, "a"), WorkerOnHost(2, "c")], [])
    assert world == [WorkerOnHost(0, "a"), WorkerOnHost(2, "c")]
    assert placements(world) == [Placement(0, "a", 0, 1, 0, 2), Placement(1, "c", 0, 1, 1, 2)]


def test_new_workers_come_after_the_survivors_and_hosts_stay_together() -> None:
    world = next_world([WorkerOnHost(0, "a"), WorkerOnHost(1, "b")], [WorkerOnHost(5, "c"), WorkerOnHost(6, "a")])
    assert world == [WorkerOnHost(0, "a"), WorkerOnHost(6, "a"), WorkerOnHost(1, "b"), WorkerOnHost(5, "c")]
    assert [(p.rank, p.host, p.local_rank, p.local_size, p.cross_rank) for p in placements(world)] == [
        (0, "a", 0, 2, 0), (1, "a", 1, 2, 0), (2, "b", 0, 1, 1), (3, "c", 0, 1, 2)]


def test_rank_0_must_be_a_survivor_whose_rendezvous_the_hosts_reach() -> None:
    loopback = {0}

    def reachable(s: WorkerOnHost, hosts: set[str]) -> bool:
        return not (len(hosts) > 1 and s.worker in loopback)

    # worker 0's port is on loopback: in a multi-host world worker 1 hosts the rendezvous
    assert next_world([WorkerOnHost(0, "a"), WorkerOnHost(1, "b")], [], reachable)[0] == WorkerOnHost(1, "b")
    assert next_world([WorkerOnHost(0, "a")], [WorkerOnHost(3, "b")], reachable) is None
    assert next_world([WorkerOnHost(0, "a")], [WorkerOnHost(3, "a")], reachable) == [WorkerOnHost(0, "a"), WorkerOnHost(3, "a")]


def test_a_failed_host_comes_back_once_discovery_dropped_and_relisted_it() -> None:
    bl = Blacklist(cooldown=60.0)
    bl.add("c", now=0.0)
    bl.observe(["a", "b", "c"], now=1.0)  # still listed: it may not have been replaced
    assert bl.blocked("c")
    bl.observe(["a", "b"], now=2.0)
    assert bl.blocked("c")
    bl.observe(["a", "b", "c"], now=3.0)
    assert not bl.blocked("c")


def test_a_failed_host_comes_back_after_the_cooldown_or_never_without_one() -> None:
    bl = Blacklist(cooldown=60.0)
    bl.add("c", now=0.0)
    bl.observe(["c"], now=59.0)
    assert bl.blocked("c")
    bl.observe(["c"], now=61.0)
    assert not bl.blocked("c")
    fixed = Blacklist()
    fixed.add("c", now=0.0)
    fixed.observe(["c"], now=1e9)
    assert fixed.blocked("c")


# -- discovery --------------------------------------------------------------------------------


def test_discovery_output_is_host_slots_lines() -> None:
    assert parse_discovered("a:2\n# spare\n\nb\n10.0.0.3:4  # rack 2\n") == [
        Host("a", 2), Host("b", 1), Host("10.0.0.3", 4)]
    assert parse_discovered("") == []
    with pytest.raises(ConfigError, match="not 'host:slots' lines"):
        parse_discovered("a:x\n")


def test_the_discovery_script_is_run_and_its_failures_are_one_line(tmp_path: Path) -> None:
    assert run_script(_script(tmp_path, "echo a:1; echo b:2")) == [Host("a", 1), Host("b", 2)]
    with pytest.raises(ConfigError, match="exited with code 3 \\(no hosts file\\)"):
        run_script(_script(tmp_path, "echo 'no hosts file' >&2; exit 3"))
    with pytest.raises(ConfigError, match="did not finish within"):
        run_script(_script(tmp_path, "sleep 5"), timeout=0.3)


# -- assignment files -------------------------------------------------------------------------


def test_assignments_and_acks_round_trip(tmp_path: Path) -> None:
    path = assignment.worker_file(tmp_path / "job", 7)
    assert assignment.read_assignment(path) is None and assignment.read_ack(path) is None
    world = {"version": 2, "env": {"RINGTRAIN_RANK": "1"}, "lost": ["10.0.0.9"], "addresses": []}
    assignment.write_assignment(path, world)
    assert assignment.read_assignment(path) == world
    assignment.write_ack(path, 2)
    assert assignment.read_ack(path) == 2
    Path(path).write_text("{half")  # what a non-atomic writer could leave: ignored
    assert assignment.read_assignment(path) is None
    assert not [p for p in os.listdir(tmp_path / "job") if p.startswith(".tmp-")]


def test_an_ack_after_the_job_removed_its_directory_leaves_nothing(tmp_path: Path) -> None:
    # A worker still joining when ringrun ended the job and removed the job's directory
    # must not create it again (it stayed in /tmp after the job).
    path = assignment.worker_file(tmp_path / "job", 3)
    assignment.write_ack(path, 1)
    assert not (tmp_path / "job").exists()


# -- severing ---------------------------------------------------------------------------------


def test_severing_ends_a_read_blocked_on_a_silent_peer() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    other = socket.socket()  # a connection that must stay: spared by inode
    other.connect(server.getsockname())
    kept, _ = server.accept()
    spare = {c.inode for c in sever.connections() if c.fd in (other.fileno(), kept.fileno())}
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(client.recv(10)))
    reader.start()
    try:
        assert sever.sever(["127.0.0.1"], spare=spare) == 2  # client and its accepted end
        reader.join(5)
        assert got == [b""] and not reader.is_alive()
        other.sendall(b"x")
        assert kept.recv(1) == b"x"
        assert sever.sever(["10.255.255.1"]) == 0
    finally:
        for s in (client, accepted, other, kept, server):
            s.close()


def test_severing_keeps_the_connections_this_process_serves() -> None:
    """A resizable job's rank 0 severs the old world while the next world's ranks connect
    to its store server: what that server accepted (local end on its port) stays, decided
    per connection at the time of the call; what this process opened to the host goes."""
    served = socket.socket()
    served.bind(("127.0.0.1", 0))
    served.listen()
    port = served.getsockname()[1]
    peer = socket.socket()  # another host's server this process is a client of
    peer.bind(("127.0.0.1", 0))
    peer.listen()
    outgoing = socket.create_connection(peer.getsockname())
    outgoing_far, _ = peer.accept()
    newcomer = socket.create_connection(("127.0.0.1", port))  # a next-world rank (elsewhere)
    newcomer_here, _ = served.accept()
    elsewhere = {c.inode for c in sever.connections() if c.fd == newcomer.fileno()}
    try:
        assert sever.sever(["127.0.0.1"], keep_local_ports=[port], spare=elsewhere) == 2
        assert outgoing.recv(1) == b""
        newcomer.sendall(b"q")
        assert newcomer_here.recv(1) == b"q"
        newcomer_here.sendall(b"a")
        assert newcomer.recv(1) == b"a"
    finally:
        for s in (served, peer, outgoing, outgoing_far, newcomer, newcomer_here):
            s.close()
