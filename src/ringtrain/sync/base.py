"""What every gradient-exchange strategy shares: the base classes.

A strategy is an allreduce algorithm object: ``strategy(tensor, op, name) -> Handle``
reduces ``tensor`` in place across ranks and may return before it finishes (the
contract of :data:`ringtrain.collectives.AllreduceAlgorithm`). Strategies add two
things to a bare algorithm: each launch is an arrival for stall inspection, and the
handle's wait gives up after ``stall_timeout`` with a :class:`StallError` that names the
missing ranks.

Point-to-point strategies (ring, ps) run their rounds on the exchange thread of
:mod:`ringtrain.sync.channel`; subclasses only write :meth:`P2PStrategy.exchange`, once
for host and device buffers alike (the channel's transport says where they live).
Each concrete class declares its ``name`` and the ``options`` a user may pass by name;
:mod:`ringtrain.sync.table` lists the classes.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ringtrain import runtime
from ringtrain.collectives import Handle, ReduceOp, torch_op
from ringtrain.errors import ConfigError
from ringtrain.sync import stall
from ringtrain.sync._tensors import flat_work
from ringtrain.sync.channel import Channel, channel, channel_device

__all__ = ["P2PStrategy", "Strategy"]


class Strategy:
    """Base class: an allreduce algorithm with stall inspection."""

    #: The name used in ``strategy=`` / ``algorithm=`` (set by each concrete class).
    name: ClassVar[str] = ""
    #: Keyword options ``make_strategy`` accepts for this strategy, mapped to the
    #: constructor argument each one sets.
    options: ClassVar[dict[str, str]] = {"stall_timeout": "stall_timeout"}

    def __init__(self, stall_timeout: float | None = None) -> None:
        if stall_timeout is not None and not (isinstance(stall_timeout, (int, float))
                                              and math.isfinite(stall_timeout) and stall_timeout > 0):
            raise ConfigError(f"stall_timeout must be a finite number > 0 (seconds), got {stall_timeout}")
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
        """Reduce the flat tensor (on ``ch.device``) in place across ``ch``'s ranks
        (exchange thread). Post messages with ``ch.start``; when ``ch.lockstep``, each
        round's receives must go out with its sends, in the same round order on every
        rank (see :mod:`ringtrain.sync.transport`).

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
        ch = channel(channel_device(tensor))
        # The exchange writes the result in place, outside autograd (as torch's
        # dist.all_reduce and Horovod's allreduce_ do): through ``detach()`` a parameter or
        # any tensor that requires grad can be reduced in place. Without it the first
        # in-place addition raised on the exchange thread mid-round, after messages had
        # gone out, and every later ring/ps exchange of the job stalled.
        flat, write_back = flat_work(tensor.detach() if tensor.requires_grad else tensor, ch.device)

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
