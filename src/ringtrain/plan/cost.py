"""Alpha-beta cost of one gradient exchange, per strategy. Pure functions.

Notation: ``m`` bytes per GPU, ``n`` GPUs, ``alpha`` seconds per message, ``bw``
achieved bytes/s of the link a step crosses. Sources for the formulas:

- Ring allreduce = reduce-scatter + allgather, ``2(n-1)`` steps of ``m/n`` bytes:
  ``2(n-1) alpha + 2(n-1)/n * m/bw`` (Patarasuk & Yuan 2009; Gibiansky 2017; the
  "bus bandwidth" factor ``2(n-1)/n`` of NCCL-tests).
- Recursive halving / doubling (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005):
  ``2 log2(n) alpha + 2(n-1)/n * m/bw`` for a power of two; other ``n`` fold the
  extra ranks in first and out last, two more steps carrying the whole vector.
- Parameter server: each worker pushes ``m`` and pulls ``m``; a server holding a
  fraction ``s`` of the parameters receives ``n*s*m`` and sends as much, so with ``k``
  even shards its link carries ``n*m/k`` each way (Li et al. 2014, OSDI).
- Hierarchical: reduce-scatter inside each host, allreduce of each ``1/g`` shard
  across hosts (the ``g`` shards share the host's NIC), allgather inside the host
  (Goyal et al. 2017, section 4; Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE).

Flat algorithms on several hosts run at the pace of their slowest hop: a ring over
hosts filled in order crosses each NIC once in each direction, so its bandwidth is
``min(intra, inter)``.
"""

from __future__ import annotations

import math

from ringtrain.errors import ConfigError
from ringtrain.plan.network import Topology

__all__ = [
    "STRATEGIES",
    "ring_allreduce",
    "halving_doubling_allreduce",
    "ps_exchange",
    "flat_ring",
    "flat_halving_doubling",
    "hierarchical_allreduce",
    "allreduce_time",
    "ps_one_way",
    "check_strategy",
]

#: Strategy names the planner accepts. ``tree`` is taken as halving-doubling: both
#: have ``log2(n)`` latency and (pipelined) the ring's bandwidth term.
STRATEGIES = ("ring", "hd", "tree", "hierarchical", "ps")


def check_strategy(name: str) -> str:
    """Normalise ``name`` or raise a ConfigError that lists the choices."""
    key = name.strip().lower()
    if key not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return "hd" if key == "tree" else key


def _check(m: float, n: int) -> None:
    if m < 0:
        raise ConfigError(f"message size must be >= 0 bytes, got {m}")
    if n < 1:
        raise ConfigError(f"number of GPUs must be >= 1, got {n}")


def ring_allreduce(m: float, n: int, alpha: float, bw: float) -> float:
    """Seconds for a ring allreduce of ``m`` bytes over ``n`` ranks on one kind of link."""
    _check(m, n)
    if n == 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * m / bw


def halving_doubling_allreduce(m: float, n: int, alpha: float, bw: float) -> float:
    """Seconds for Rabenseifner's recursive halving/doubling allreduce."""
    _check(m, n)
    if n == 1:
        return 0.0
    p = 2 ** int(math.log2(n))
    t = 2 * math.log2(p) * alpha + 2 * (p - 1) / p * m / bw if p > 1 else 0.0
    if n != p:  # the n - p extra ranks hand their whole vector in and get it back
        t += 2 * (alpha + m / bw)
    return t


def ps_exchange(
    m: float, workers: int, shards: int, alpha: float, worker_bw: float, server_bw: float,
    max_share: float | None = None,
) -> float:
    """Seconds for push + pull through ``shards`` dedicated servers.

    The busiest server holds ``max_share`` of the bytes (``1/shards`` when even); its
    link carries ``workers * max_share * m`` each way, each worker's link ``m``.
    """
    _check(m, workers)
    if shards < 1:
        raise ConfigError(f"parameter-server shards must be >= 1, got {shards}")
    share = 1 / shards if max_share is None else max_share
    per_phase = max(m / worker_bw, workers * share * m / server_bw)
    return 2 * (alpha + per_phase)


def flat_ring(m: float, n: int, topo: Topology) -> float:
    """Ring over ``n`` GPUs laid out host by host."""
    if topo.hosts(n) == 1:
        return ring_allreduce(m, n, topo.intra.alpha_s, topo.intra.bandwidth)
    alpha = max(topo.intra.alpha_s, topo.inter.alpha_s)
    return ring_allreduce(m, n, alpha, min(topo.intra.bandwidth, topo.inter.bandwidth))


def flat_halving_doubling(m: float, n: int, topo: Topology) -> float:
    """Halving-doubling over ``n`` GPUs, partners at distance 1, 2, 4, ... (near first).

    With hosts filled in order, steps whose partner distance reaches ``g`` (GPUs per
    host) cross the network, all ``g`` local GPUs at once through one NIC; those are
    the late steps with the small chunks, so the NIC carries about what a ring puts
    on it.
    """
    _check(m, n)
    if n == 1:
        return 0.0
    g, hosts = topo.local(n), topo.hosts(n)
    if hosts == 1:
        return halving_doubling_allreduce(m, n, topo.intra.alpha_s, topo.intra.bandwidth)
    p = 2 ** int(math.log2(n))
    total = 0.0
    for k in range(1, int(math.log2(p)) + 1):
        chunk = m / 2**k
        if 2 ** (k - 1) >= g:  # partner on another host
            total += topo.inter.alpha_s + max(g * chunk / topo.inter.bandwidth, chunk / topo.intra.bandwidth)
        else:
            total += topo.intra.alpha_s + chunk / topo.intra.bandwidth
    total *= 2  # the allgather retraces the reduce-scatter
    if n != p:
        total += 2 * (topo.inter.alpha_s + m / topo.inter.bandwidth)
    return total


def hierarchical_allreduce(m: float, n: int, topo: Topology, inter: str = "ring") -> float:
    """Reduce-scatter in the host, allreduce of the shards across hosts, allgather in the host."""
    _check(m, n)
    g, hosts = topo.local(n), topo.hosts(n)
    if hosts == 1:
        return ring_allreduce(m, n, topo.intra.alpha_s, topo.intra.bandwidth)
    intra = (g - 1) * (topo.intra.alpha_s + m / g / topo.intra.bandwidth) if g > 1 else 0.0
    # g shards of m/g cross hosts at once and share the NIC: each sees bandwidth B/g,
    # which is the same time as one allreduce of m at the full NIC bandwidth.
    across = ring_allreduce if inter == "ring" else halving_doubling_allreduce
    return 2 * intra + across(m, hosts, topo.inter.alpha_s, topo.inter.bandwidth)


def allreduce_time(strategy: str, m: float, n: int, topo: Topology, *, inter: str = "ring") -> float:
    """Seconds for one allreduce of ``m`` bytes per GPU with ``strategy``."""
    s = check_strategy(strategy)
    if s == "ring":
        return flat_ring(m, n, topo)
    if s == "hd":
        return flat_halving_doubling(m, n, topo)
    if s == "hierarchical":
        return hierarchical_allreduce(m, n, topo, inter)
    raise ConfigError(f"strategy {strategy!r} is not an allreduce; use ps_one_way for 'ps'")


def ps_one_way(
    m: float, n: int, topo: Topology, *, colocated: bool = True, per_host: bool = False,
    transport_bw: float | None = None,
) -> float:
    """Seconds one server needs to receive a tensor of ``m`` bytes from every worker.

    Sending the updated tensor back to every worker takes as long in the other
    direction of the (full-duplex) link. Each tensor lives on one server, as with
    TensorFlow's ``replica_device_setter``. With ``colocated`` servers (one per
    worker host, the usual distributed-TensorFlow layout) the host's own GPUs reach
    their server without the network; on one host everything crosses PCIe to the CPU.
    With ``per_host`` each host first sums its GPUs' gradients and sends one copy (one
    worker process per host driving its GPUs, as ``tf_cnn_benchmarks`` runs). A
    ``transport_bw`` caps what the server process moves across hosts, whatever the
    NIC (an RPC stack bound by CPU, like TensorFlow's gRPC of 2016-17).
    """
    _check(m, n)
    hosts = topo.hosts(n)
    if hosts == 1:
        return topo.intra.alpha_s + (1 if per_host else n) * m / topo.intra.bandwidth
    if per_host:
        remote = hosts - 1 if colocated else hosts
    else:
        remote = n - topo.local(n) if colocated else n
    bw = topo.inter.bandwidth if transport_bw is None else min(topo.inter.bandwidth, transport_bw)
    return topo.inter.alpha_s + remote * m / bw
