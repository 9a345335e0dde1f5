"""The alpha-beta formulas of each exchange strategy."""

from __future__ import annotations

import math

import pytest

from ringtrain.errors import ConfigError
from ringtrain.plan.cost import (
    allreduce_time,
    check_strategy,
    flat_halving_doubling,
    flat_ring,
    halving_doubling_allreduce,
    hierarchical_allreduce,
    ps_exchange,
    ps_one_way,
    ring_allreduce,
)
from ringtrain.plan.network import Link, Topology, intra_link, link

A, B, M = 10e-6, 1e9, 100e6  # 10 us, 1 GB/s, 100 MB


def test_ring_matches_the_textbook_formula() -> None:
    n = 8
    assert ring_allreduce(M, n, A, B) == pytest.approx(2 * (n - 1) * A + 2 * (n - 1) / n * M / B)


def test_ring_bandwidth_term_approaches_twice_the_message() -> None:
    # Gibiansky 2017: each GPU sends and receives 2(N-1)/N of the data, independent of N.
    assert ring_allreduce(M, 1024, 0.0, B) == pytest.approx(2 * M / B, rel=1e-3)
    assert ring_allreduce(M, 1, A, B) == 0.0


def test_halving_doubling_has_logarithmic_latency() -> None:
    t = halving_doubling_allreduce(0.0, 512, A, B)
    assert t == pytest.approx(2 * 9 * A)
    assert t < ring_allreduce(0.0, 512, A, B) / 50


def test_halving_doubling_pays_two_extra_steps_off_powers_of_two() -> None:
    extra = halving_doubling_allreduce(M, 12, A, B) - halving_doubling_allreduce(M, 8, A, B)
    assert extra == pytest.approx(2 * (A + M / B))


def test_parameter_server_link_carries_n_m_over_k() -> None:
    n, k = 64, 8
    t = ps_exchange(M, n, k, A, worker_bw=B, server_bw=B)
    assert t == pytest.approx(2 * (A + n * M / k / B))
    # An uneven split is as slow as its busiest server.
    assert ps_exchange(M, n, k, A, B, B, max_share=0.5) > t


def _topo(g: int = 4, intra: float = 10e9, inter: float = 1e9) -> Topology:
    return Topology(g, Link("in", intra, 1.0, 1e-6), Link("net", inter, 1.0, A))


def test_flat_ring_on_one_host_uses_the_intra_link_only() -> None:
    t = _topo()
    assert flat_ring(M, 4, t) == pytest.approx(ring_allreduce(M, 4, 1e-6, 10e9))


def test_flat_ring_across_hosts_runs_at_the_slowest_link() -> None:
    t = _topo()
    assert flat_ring(M, 16, t) == pytest.approx(ring_allreduce(M, 16, A, 1e9))


def test_hierarchical_puts_less_on_the_nic_than_a_flat_ring_with_few_hosts() -> None:
    t = _topo(g=8, intra=100e9)
    # 2 hosts: hierarchical moves M across the NIC, the flat ring 2(N-1)/N M = 1.875 M.
    assert hierarchical_allreduce(M, 16, t) < flat_ring(M, 16, t)
    across = ring_allreduce(M, 2, A, 1e9)
    inside = 2 * 7 * (1e-6 + M / 8 / 100e9)
    assert hierarchical_allreduce(M, 16, t) == pytest.approx(across + inside)


def test_flat_halving_doubling_nic_traffic_is_ring_like() -> None:
    t = _topo(g=4, intra=1e15, inter=1e9)
    hd = flat_halving_doubling(M, 64, t)
    ring = flat_ring(M, 64, t)
    assert 0.9 * ring < hd < 1.1 * ring


def test_ps_one_way_skips_the_local_gpus() -> None:
    t = _topo()
    assert ps_one_way(M, 16, t, colocated=True) == pytest.approx(A + 12 * M / 1e9)
    assert ps_one_way(M, 16, t, colocated=False) == pytest.approx(A + 16 * M / 1e9)


def test_a_cpu_bound_transport_caps_the_server_link() -> None:
    # TensorFlow's gRPC of 2016-17: about 0.9 GB/s per process whatever the NIC (here 1 GB/s).
    t = _topo()
    assert ps_one_way(M, 16, t, per_host=True, transport_bw=0.5e9) == pytest.approx(A + 3 * M / 0.5e9)
    assert ps_one_way(M, 16, t, per_host=True, transport_bw=5e9) == ps_one_way(M, 16, t, per_host=True)


def test_strategy_names() -> None:
    assert check_strategy("Tree") == "hd"
    assert check_strategy("ring") == "ring"
    with pytest.raises(ConfigError, match="unknown strategy 'gossip'"):
        check_strategy("gossip")
    with pytest.raises(ConfigError):
        allreduce_time("ps", M, 8, _topo())


def test_presets_have_sane_rates() -> None:
    assert link("25gbit").line_rate == pytest.approx(25e9 / 8)
    assert link("25gbit-roce").bandwidth > link("25gbit").bandwidth
    assert link("40").line_rate == pytest.approx(5e9)  # a bare number is Gbit/s
    assert intra_link("nvlink-v100").bandwidth > intra_link("pcie3").bandwidth
    with pytest.raises(ConfigError, match="unknown --network"):
        link("carrier-pigeon")
    assert math.isfinite(allreduce_time("hierarchical", M, 512, _topo()))
