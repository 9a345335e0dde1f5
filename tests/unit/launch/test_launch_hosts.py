"""Host lists, hostfiles and rank placement (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain.errors import ConfigError
from ringtrain.launch.hosts import Host, parse_hostfile, parse_hosts, place_ranks


def test_parse_hosts_reads_names_and_slots() -> None:
    assert parse_hosts("server1:4,server2:2, server3") == [
        Host("server1", 4), Host("server2", 2), Host("server3", 1)]


@pytest.mark.parametrize("spec,fragment", [
    ("a:two", "bad slot count 'two'"),
    ("a:0", "bad slot count '0'"),
    ("a:4,,b:4", "empty entry"),
    ("a:4,a:2", "appears twice"),
    ("bad host:2", "bad host name"),
])
def test_parse_hosts_rejects_malformed_entries(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_hosts(spec)


def test_hostfile_allows_comments_blank_lines_and_slots(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("# the cluster\n\nserver1 slots=4   # first\nserver2 slots=2 max_slots=8\nserver3\n")
    assert parse_hostfile(f) == [Host("server1", 4), Host("server2", 2), Host("server3", 1)]


@pytest.mark.parametrize("text,fragment", [
    ("server1 slots=x\n", "line 1"),
    ("server1 slot=4\n", "write 'host slots=N'"),
    ("# nothing\n\n", "lists no hosts"),
    ("a slots=1\na slots=2\n", "appears twice"),
])
def test_hostfile_errors_name_the_line_and_the_fix(tmp_path: Path, text: str, fragment: str) -> None:
    f = tmp_path / "hosts"
    f.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        parse_hostfile(f)


def test_missing_hostfile_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "nope")


def test_ranks_fill_hosts_in_order() -> None:
    placed = place_ranks([Host("a", 2), Host("b", 2), Host("c", 4)], 5)
    assert [(p.rank, p.host, p.local_rank, p.local_size, p.cross_rank) for p in placed] == [
        (0, "a", 0, 2, 0), (1, "a", 1, 2, 0), (2, "b", 0, 2, 1), (3, "b", 1, 2, 1), (4, "c", 0, 1, 2)]
    assert {p.cross_size for p in placed} == {3}


def test_the_articles_sixteen_ranks_on_four_servers() -> None:
    hosts = parse_hosts("server1:4,server2:4,server3:4,server4:4")
    placed = place_ranks(hosts, 16)
    assert [p.host for p in placed[::4]] == ["server1", "server2", "server3", "server4"]
    assert all(p.local_size == 4 and p.cross_size == 4 for p in placed)


@pytest.mark.parametrize("np,fragment", [(0, "must be >= 1"), (9, "more than the 8 slots")])
def test_np_outside_the_slots_is_refused(np: int, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        place_ranks([Host("a", 4), Host("b", 4)], np)


def test_loopback_and_this_machines_name_are_local() -> None:
    import socket

    from ringtrain.launch.hosts import is_local_host

    assert is_local_host("localhost") and is_local_host("127.0.0.1") and is_local_host("::1")
    assert is_local_host(socket.gethostname())
    assert not is_local_host("10.213.57.11") and not is_local_host("server1")
