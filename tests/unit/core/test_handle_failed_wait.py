"""A collective's handle whose wait failed keeps failing (no processes).

Before: the first ``wait()`` raised (a peer lost mid-exchange, a stall) and marked the
handle finished, so a second ``wait()`` returned the tensor, half reduced, as a result.
"""

from __future__ import annotations

import pytest
import torch

from ringtrain.collectives import Handle
from ringtrain.errors import CollectiveError


def test_a_second_wait_raises_the_same_error_instead_of_a_partial_result() -> None:
    calls = []

    def fail() -> None:
        calls.append(1)
        raise CollectiveError("allreduce of 'g' failed on rank 0: peer lost")

    h = Handle(torch.zeros(3), fail, "g")
    with pytest.raises(CollectiveError, match="peer lost") as first:
        h.wait()
    with pytest.raises(CollectiveError, match="peer lost") as second:
        h.wait()
    assert second.value is first.value
    assert calls == [1]  # the exchange's wait runs once
    assert h.done()


def test_a_wait_interrupted_by_ctrl_c_can_be_waited_for_again() -> None:
    state = {"calls": 0}

    def wait() -> None:
        state["calls"] += 1
        if state["calls"] == 1:
            raise KeyboardInterrupt

    t = torch.ones(2)
    h = Handle(t, wait, None)
    with pytest.raises(KeyboardInterrupt):
        h.wait()
    assert not h.done()
    assert h.wait() is t
    assert state["calls"] == 2 and h.done()
