"""Cost of agreeing which gradients to exchange: Horovod's 2018 negotiation cycle.

A framework whose ranks produce gradients in slightly different orders must agree,
before every collective, on which tensors every rank has ready. Horovod of 2017-2018
(the version behind the validation's Horovod rows) did this through a coordinator, in a background thread on every rank (``RunLoopOnce`` in
``horovod/common/operations.cc`` of that time):

1. sleep until ``cycle_s`` after the previous cycle *started* (no sleep when the
   previous cycle's work took longer);
2. every rank sends the list of tensors it has ready to rank 0: ``MPI_Gather`` of the
   list lengths, then ``MPI_Gatherv`` of the lists;
3. rank 0 parses the ``N - 1`` lists, counts each tensor, and sends the fused
   responses to everyone: two ``MPI_Bcast`` (length, then the list);
4. every rank runs the responses one after another, blocking the thread until each
   collective is done (it waits on a CUDA event).

Steps 2-3 are paid on every cycle, before any collective of that cycle can start.
Their cost has two parts:

- tree-shaped latency: Open MPI's gather and broadcast of small messages use
  binomial trees, ``ceil(log2 N)`` rounds each of one control-message latency
  ``alpha``; the gather, the gatherv's first message and two broadcasts make about
  ``3 ceil(log2 N) + 1`` rounds (the gatherv itself is linear, see below);
- linear work at the coordinator: Open MPI's default ``MPI_Gatherv`` posts one
  receive per rank at the root, and Horovod then parses each rank's list; rank 0
  handles ``N - 1`` messages one after another, ``per_rank_s`` each.

Later Horovod versions (the response cache of 2019, horovod PR #902) replaced most
of this with a bit-vector allreduce, so the planner's ``horovod`` preset is the 2018
one, as the validation needs; :data:`ringtrain.plan.simulate.FRAMEWORKS` says so.
"""

from __future__ import annotations

import math

from ringtrain.errors import ConfigError

__all__ = ["negotiation_s"]


def negotiation_s(gpus: int, alpha_s: float, per_rank_s: float) -> float:
    """Seconds one coordinator cycle spends before its first collective can start.

    ``alpha_s`` is the latency of one small control message (the MPI transport's,
    not the collective library's); ``per_rank_s`` is rank 0's cost per other rank
    (receiving and parsing its request list). Zero on one GPU: there is nobody to
    agree with, and Horovod skips the exchange.
    """
    if gpus < 1:
        raise ConfigError(f"number of GPUs must be >= 1, got {gpus}")
    if alpha_s < 0 or per_rank_s < 0:
        raise ConfigError(
            f"negotiation costs must be >= 0 s, got alpha {alpha_s} and per-rank {per_rank_s}"
        )
    if gpus == 1:
        return 0.0
    rounds = 3 * math.ceil(math.log2(gpus)) + 1
    return rounds * alpha_s + (gpus - 1) * per_rank_s
