"""Horovod's names for a rank's place in the job, given to every rank (pure).

``horovodrun`` (Horovod's Gloo launcher) tells each worker who it is with
``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``,
``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE`` and ``HOROVOD_HOSTNAME``; scripts and
test harnesses written for Horovod read them (Horovod's own test suite checks
``HOROVOD_RANK`` to know it runs under horovodrun). ringrun sets them too, not only
ringtrain's ``horovodrun``: they cost nothing, a Horovod script then runs under either
launcher, and a script that imports the real ``horovod`` under ringrun fails loudly at
its rendezvous instead of silently training N separate one-process jobs.

Horovod's cross communicator joins the ranks with the same local rank, one per host,
so on hosts with different rank counts its size depends on the local rank: with
``-H a:2,b:1``, local rank 0 has a cross size of 2 (a and b) and local rank 1 of 1
(only a). ``RINGTRAIN_CROSS_SIZE`` is the number of hosts; the two agree whenever every
host runs the same number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from ringtrain.launch.hosts import Placement

__all__ = ["horovod_env"]


def horovod_env(placements: Sequence[Placement]) -> dict[int, dict[str, str]]:
    """``{rank: {HOROVOD_*: value}}`` for every placed rank."""
    sizes: dict[str, int] = {}
    for p in placements:  # hosts in order, as ranks fill them
        sizes[p.host] = p.local_size
    hosts = list(sizes)
    out = {}
    for p in placements:
        peers = [h for h in hosts if sizes[h] > p.local_rank]  # hosts with this local rank
        out[p.rank] = {
            "HOROVOD_RANK": str(p.rank),
            "HOROVOD_SIZE": str(len(placements)),
            "HOROVOD_LOCAL_RANK": str(p.local_rank),
            "HOROVOD_LOCAL_SIZE": str(p.local_size),
            "HOROVOD_CROSS_RANK": str(peers.index(p.host)),
            "HOROVOD_CROSS_SIZE": str(len(peers)),
            "HOROVOD_HOSTNAME": p.host,
        }
    return out
