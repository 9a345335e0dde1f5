"""Per-step exchange or a periodic one (``rt.LocalSGD``, ``rt.DiLoCo``): what each costs
per step, and where exchanging every ``H`` steps pays. Pure functions.

Per-step exchange (``sync``) is the step of :func:`ringtrain.plan.simulate.simulate`:
gradients bucketed as they become ready in backward, the exchange partly hidden behind
the rest of backward, the slowest of N ranks setting the pace. A periodic mode runs
``H`` local steps without any exchange, then one exchange of the whole model (the outer
gradient of DiLoCo, the parameters' change of LocalSGD: as many bytes as the gradients)
that nothing hides, since it starts after the step::

    step(H) = compute x stragglers(cv / sqrt(H)) + allreduce(model) / H

The straggler term shrinks because ranks meet once per ``H`` steps: the slowest rank is
late by the spread of a sum of ``H`` step times, ``sqrt(H)`` times the spread of one,
spread over ``H`` steps. Fragments (Streaming DiLoCo) leave the mean unchanged and cut
the longest step to ``compute + allreduce(model / F)``. LocalSGD and DiLoCo move the
same bytes at the same steps: their step costs are equal; they differ in convergence,
which this model does not predict.

Where it pays (:func:`recommend`): a periodic mode can at best remove the exchange the
per-step mode leaves exposed, so when that exposed exchange is under half the step
(:data:`PAYS_SHARE`, the rule ``ringtrain doctor`` uses too) the saving is at most 2x
and the planner keeps per-step exchange, since fewer syncs can cost convergence. The
advice states the break-even: a periodic mode whose steps are ``k`` times faster reaches a
loss sooner only if it needs fewer than ``k`` times the samples. That cost depends on the
task. In benchmarks/lowcomm.py at N = 4, DiLoCo at H=50 needed 1.25x the samples; with
2 ranks on loopback it needed fewer than per-step exchange, so it was faster at a 30%
exchange share (docs/lowcomm.md). Above the line, the planner names the smallest ``H``
whose exchange is at most :data:`TARGET_SHARE` of the compute per step: most of the
gain, with as few local steps between syncs as that allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ringtrain.errors import ConfigError
from ringtrain.plan.cost import allreduce_time
from ringtrain.plan.simulate import Scenario, simulate, straggler_factor

__all__ = ["LADDER", "PAYS_SHARE", "TARGET_SHARE", "ModeCost", "Advice", "mode_costs", "recommend",
           "format_modes"]

#: The exposed exchange's share of a per-step step above which a periodic mode pays.
PAYS_SHARE = 0.5
#: The amortised exchange's share of the compute that the recommended H reaches.
TARGET_SHARE = 0.10
#: The values of H the recommendation chooses from.
LADDER = (2, 5, 10, 20, 50, 100, 200, 500, 1000)


@dataclass(frozen=True)
class ModeCost:
    """One mode's predicted cost per step on ``ranks`` ranks (seconds, bytes)."""

    mode: str  #: "sync" (per-step exchange), "localsgd", "diloco"
    sync_every: int
    ranks: int
    step_s: float  #: mean seconds per step
    compute_s: float  #: of which compute (stragglers included)
    exchange_s: float  #: of which exchange (exposed, averaged over the steps)
    peak_step_s: float  #: the longest step (a sync step)
    bytes_per_step: float  #: bytes one rank sends per step, averaged (ring: 2(N-1)/N x model)
    speedup: float  #: the per-step mode's step over this one

    @property
    def exchange_share(self) -> float:
        return self.exchange_s / self.step_s if self.step_s > 0 else 0.0


@dataclass(frozen=True)
class Advice:
    """Where a periodic mode pays, for one number of ranks."""

    pays: bool
    sync_share: float  #: exposed exchange / step of the per-step mode
    sync_every: int | None  #: the recommended H (None when per-step is the choice)
    text: str


def _sent(model_bytes: float, n: int) -> float:
    """Bytes one rank sends in a bandwidth-optimal allreduce of ``model_bytes``."""
    return 2 * (n - 1) / n * model_bytes if n > 1 else 0.0


def mode_costs(sc: Scenario, ranks: int, sync_every: Sequence[int], fragments: int = 1,
               modes: Sequence[str] = ("localsgd", "diloco")) -> list[ModeCost]:
    """The per-step mode, then each periodic mode at each ``H`` of ``sync_every``."""
    if ranks < 1:
        raise ConfigError(f"number of ranks must be >= 1, got {ranks}")
    if fragments < 1:
        raise ConfigError(f"fragments must be >= 1, got {fragments}")
    for h in sync_every:
        if h < 1:
            raise ConfigError(f"sync_every must be >= 1, got {h}")
        if fragments > h:
            raise ConfigError(f"fragments={fragments} is more than sync_every={h}")
    strategy = sc.strategy if sc.strategy != "ps" else "ring"
    sc = replace(sc, strategy=strategy)
    per_step = simulate(sc, ranks)
    model = sc.gradient_bytes
    whole = allreduce_time(strategy, model, ranks, sc.topology, inter=sc.inter) if ranks > 1 else 0.0
    part = allreduce_time(strategy, model / fragments, ranks, sc.topology, inter=sc.inter) if ranks > 1 else 0.0
    sync_step = per_step.step_s
    out = [ModeCost("sync", 1, ranks, sync_step, per_step.compute_s, per_step.exposed_s, sync_step,
                    _sent(model, ranks), 1.0)]
    for mode in modes:
        for h in sync_every:
            compute = sc.compute_s * straggler_factor(ranks, sc.jitter_cv / math.sqrt(h))
            exchange = whole / h
            step = compute + exchange
            out.append(ModeCost(mode, h, ranks, step, compute, exchange, compute + part,
                                _sent(model, ranks) / h, sync_step / step))
    return out


def recommend(sc: Scenario, ranks: int, ladder: Sequence[int] = LADDER) -> Advice:
    """Per-step exchange, or a periodic mode and its H (see the module doc)."""
    costs = mode_costs(sc, ranks, ladder, modes=("diloco",))
    sync = costs[0]
    share = sync.exchange_share
    if ranks == 1:
        return Advice(False, 0.0, None, "one rank: nothing to exchange")
    if share <= PAYS_SHARE:
        best = max(costs[1:], key=lambda c: c.speedup)
        return Advice(False, share, None, (
            f"per-step exchange: it costs {share:.0%} of the step ({sync.exchange_s * 1e3:.1f} of "
            f"{sync.step_s * 1e3:.1f} ms), under {PAYS_SHARE:.0%}. Exchanging every H steps makes steps "
            f"at most {best.speedup:.2f}x faster, so it reaches a loss sooner only if it needs fewer than "
            f"{best.speedup:.2f}x the samples; measure the loss after the same samples before switching "
            "(docs/lowcomm.md)"))
    chosen = next((c for c in costs[1:] if c.exchange_s <= TARGET_SHARE * c.compute_s), costs[-1])
    return Advice(True, share, chosen.sync_every, (
        f"DiLoCo pays: per-step exchange costs {share:.0%} of the step ({sync.exchange_s * 1e3:.1f} of "
        f"{sync.step_s * 1e3:.1f} ms). At sync_every={chosen.sync_every} the exchange is "
        f"{chosen.exchange_share:.0%} of a {chosen.step_s * 1e3:.1f} ms step: {chosen.speedup:.1f}x "
        f"the steps per second, {chosen.sync_every}x fewer bytes. Check the loss after the same "
        "samples (docs/lowcomm.md): more local steps per sync cost convergence"))


def format_modes(costs: Sequence[ModeCost], advice: Advice) -> str:
    """A table of the modes for one number of ranks, and the advice."""
    n = costs[0].ranks
    lines = [f"{n} ranks", f"{'mode':<9} {'H':>5} {'step ms':>9} {'exchange':>9} {'peak ms':>9} "
             f"{'MB/step':>9} {'vs sync':>8}"]
    for c in costs:
        lines.append(f"{c.mode:<9} {c.sync_every:>5} {c.step_s * 1e3:>9.1f} {c.exchange_share:>9.0%} "
                     f"{c.peak_step_s * 1e3:>9.1f} {c.bytes_per_step / 2**20:>9.3f} {c.speedup:>7.2f}x")
    lines.append(f"advice: {advice.text}")
    return "\n".join(lines)
