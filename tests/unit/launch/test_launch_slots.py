"""Slots of this host and placement beyond them (--oversubscribe), pure."""

from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.launch.cli import build_config
from ringtrain.launch.hosts import Host, place_ranks
from ringtrain.launch.slots import Slots, count_slots, local_slots


@pytest.mark.parametrize("cpus,gpus,visible,want", [
    (2, 0, None, Slots(2, "2 CPU cores")),
    (1, 0, None, Slots(1, "1 CPU core")),
    (64, 8, None, Slots(8, "8 GPUs")),            # a GPU host: one rank per device
    (64, 8, "0,1", Slots(2, "2 GPUs")),
    (64, 8, "", Slots(64, "64 CPU cores")),       # no GPU visible: the cores count
    (64, 8, "-1", Slots(64, "64 CPU cores")),
    (64, 8, "3,-1,4", Slots(1, "1 GPU")),         # CUDA stops at the first invalid entry
    (64, 2, "0,1,2,3", Slots(2, "2 GPUs")),       # cannot see more than exist
    (4, 0, "0,1", Slots(4, "4 CPU cores")),       # the variable alone is no GPU
])
def test_slots_are_gpus_else_cores(cpus: int, gpus: int, visible: str | None, want: Slots) -> None:
    assert count_slots(cpus, gpus, visible) == want


def test_this_host_has_at_least_one_slot() -> None:
    assert local_slots({}).count >= 1


def test_oversubscribe_spreads_ranks_by_slots() -> None:
    placed = place_ranks([Host("a", 2), Host("b", 2)], 5, oversubscribe=True)
    assert [(p.host, p.local_rank, p.local_size) for p in placed] == [
        ("a", 0, 3), ("a", 1, 3), ("a", 2, 3), ("b", 0, 2), ("b", 1, 2)]
    assert [p.rank for p in placed] == list(range(5))


def test_oversubscribe_on_one_host_puts_every_rank_there() -> None:
    placed = place_ranks([Host("localhost", 2)], 8, oversubscribe=True)
    assert {p.host for p in placed} == {"localhost"} and placed[-1].local_size == 8


def test_within_the_slots_oversubscribe_changes_nothing() -> None:
    hosts = [Host("a", 2), Host("b", 2)]
    assert place_ranks(hosts, 3, oversubscribe=True) == place_ranks(hosts, 3)


def test_more_ranks_than_this_hosts_slots_needs_the_flag() -> None:
    n = local_slots().count + 1
    with pytest.raises(ConfigError, match=r"slots of this host \(.*\); lower -np.*--oversubscribe"):
        build_config(["-np", str(n), "true"])
    cfg = build_config(["-np", str(n), "--oversubscribe", "true"])
    assert len(cfg.placements) == n


def test_explicit_slots_are_trusted() -> None:
    # -H localhost:N says N slots, whatever the core count.
    cfg = build_config(["-np", "64", "-H", "localhost:64", "true"])
    assert len(cfg.placements) == 64
