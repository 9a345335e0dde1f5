"""What every gradient-exchange strategy shares, and how a name becomes one.

A strategy is an allreduce algorithm object: ``strategy(tensor, op, name) -> Handle``
reduces ``tensor`` in place across ranks and may return before it finishes (the
contract of :data:`ringtrain.collectives.AllreduceAlgorithm`). Strategies add two
things to a bare algorithm: each launch is an arrival for stall inspection, and the
handle's wait gives up after ``stall_timeout`` with a :class:`StallError` that names the
missing ranks.

Point-to-point strategies (ring, ps) run their rounds on the exchange thread of
:mod:`ringtrain.sync.channel`; subclasses only write :meth:`P2PStrategy.exchange`.
"""

from __future__ import annotations

from typing import Any

import torch

from ringtrain import collectives, runtime
from ringtrain.collectives import Handle, ReduceOp, torch_op
from ringtrain.errors import ConfigError
from ringtrain.sync import stall
from ringtrain.sync._tensors import flat_work
from ringtrain.sync.channel import Channel, channel

__all__ = ["Strategy", "P2PStrategy", "make_strategy", "STRATEGIES"]

#: The built-in strategies (DistributedOptimizer(strategy=...)).
STRATEGIES = ("native", "ring", "ps")


class Strategy:
    """Base class: an allreduce algorithm with stall inspection."""

    #: The name used in ``strategy=`` / ``algorithm=``.
    name = "strategy"

    def __init__(self, stall_timeout: float | None = None) -> None:
        if stall_timeout is not None and not stall_timeout > 0:
            raise ConfigError(f"stall_timeout must be > 0 seconds, got {stall_timeout}")
        self.stall_timeout = stall_timeout

    def timeout(self) -> float:
        """Seconds a wait may take: this strategy's value, else RINGTRAIN_STALL_TIMEOUT."""
        if self.stall_timeout is not None:
            return self.stall_timeout
        return runtime.settings().stall_timeout

    def __call__(self, tensor: torch.Tensor, op: ReduceOp, name: str | None) -> Handle:
        raise NotImplementedError

    def signature(self) -> dict[str, str]:
        """Settings every rank must share (compared by the first-step signature check):
        the name and every option except the stall timeout, which may differ."""
        options = {k: str(v) for k, v in self._options().items()
                   if v is not None and k != "stall_timeout"}
        return {"strategy": self.name, **options}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._options().items() if v is not None)
        return f"{type(self).__name__}({args})"

    def _options(self) -> dict[str, Any]:
        return {"stall_timeout": self.stall_timeout}


class P2PStrategy(Strategy):
    """A strategy written with point-to-point sends and receives on the exchange thread."""

    def exchange(self, flat: torch.Tensor, op: ReduceOp, ch: Channel) -> None:
        """Reduce the flat CPU tensor in place across ``ch``'s ranks (exchange thread).

        An Average is finished (divided) inside, before results are sent back, so every
        rank ends with the same bytes."""
        raise NotImplementedError

    def check_world(self, size: int) -> None:
        """Raise ConfigError when the strategy cannot run on ``size`` ranks."""

    def __call__(self, tensor: torch.Tensor, op: ReduceOp, name: str | None) -> Handle:
        torch_op(op)  # validates op with a helpful error
        size = runtime.size()
        self.check_world(size)
        arrival = stall.tracker().arrive(name, tensor)
        if size == 1 or tensor.numel() == 0:
            return Handle(tensor, lambda: None, name)
        flat, write_back = flat_work(tensor)
        ch = channel()

        def job() -> None:
            self.exchange(flat, op, ch)
            if write_back is not None:
                write_back()

        timeout = self.timeout()
        fut = ch.submit(job, timeout)

        def wait() -> None:
            ch.run_if_next(fut)  # next in line and the thread idle: no hand-off
            stall.wait_future(fut, arrival, timeout)

        return Handle(tensor, wait, name)


def make_strategy(
    strategy: str | collectives.AllreduceAlgorithm, **options: Any
) -> collectives.AllreduceAlgorithm:
    """``"native"`` / ``"ring"`` / ``"ps"`` plus options -> a strategy object.

    Options: ``stall_timeout`` (every strategy), ``ps_servers`` (ps), ``chunks_per_rank``
    (ring and ps). A callable is returned unchanged (options are then an error); another
    registered algorithm name is looked up in :mod:`ringtrain.collectives`.
    """
    from ringtrain.sync.native import Native
    from ringtrain.sync.ps import ParameterServer
    from ringtrain.sync.ring import Ring

    accepted = {
        "native": (Native, {"stall_timeout"}),
        "ring": (Ring, {"stall_timeout", "chunks_per_rank"}),
        "ps": (ParameterServer, {"stall_timeout", "ps_servers", "chunks_per_rank"}),
    }
    if not isinstance(strategy, str):
        if options:
            raise ConfigError(
                f"options {sorted(options)} only apply to a strategy given by name "
                f"({', '.join(STRATEGIES)}); configure the object itself instead"
            )
        return strategy
    if strategy not in accepted:
        algorithm = collectives._algorithm(strategy)  # unknown names fail with the choices
        if options:
            raise ConfigError(f"options {sorted(options)} do not apply to algorithm {strategy!r}")
        return algorithm
    cls, allowed = accepted[strategy]
    known = {name for _, names in accepted.values() for name in names}
    unknown = sorted(set(options) - known)
    if unknown:
        listing = "; ".join(
            f"{opt} ({', '.join(n for n, (_, names) in accepted.items() if opt in names)})"
            for opt in sorted(known))
        raise ConfigError(
            f"unknown argument(s) {unknown}; the strategy options are: {listing}"
        )
    misplaced = sorted(set(options) - allowed)
    if misplaced:
        raise ConfigError(
            f"option(s) {misplaced} apply to strategy "
            + " / ".join(repr(n) for n, (_, names) in accepted.items() if set(misplaced) <= names)
            + f", not to strategy={strategy!r}; pass strategy= accordingly or drop the option"
        )
    if strategy == "ps" and "ps_servers" in options:
        options = dict(options)
        options["servers"] = options.pop("ps_servers")
    return cls(**options)  # type: ignore[no-any-return]
