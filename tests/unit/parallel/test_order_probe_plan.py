"""The pipeline's order probe also refuses a "colwise" layer that forward calls last.

A head unit that registers its output layer before its norm (``self.out``, then
``self.norm``; forward ``out(norm(x))``) passed the registration-order check of the last
layer, so with pipeline 2 x tensor 2 the loss got each rank's slice of the logits and
trained silently (the step's loss was not the model's). The probe runs the model's own
forward on meta tensors at the first pipelined step, on every stage alike, and now
watches the split layers' call order too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.parallel.order import order_probe, split_order_problem


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(16, 4)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Head())


def test_the_probe_refuses_a_colwise_layer_called_last() -> None:
    probe = order_probe(_model(), ["0", "1", "2"], {"0": "colwise_gathered", "2.out": "colwise"})
    assert probe is not None
    with pytest.raises(ConfigError) as info:
        probe.check([4, 8], torch.float32, 2)
    assert "2.out ('colwise') is the last split layer the model's forward calls" in str(info.value)


def test_the_probe_passes_a_gathered_head_and_a_plan_ending_rowwise() -> None:
    for plan in ({"0": "colwise_gathered", "2.out": "colwise_gathered"},
                 {"0": "colwise", "2.out": "rowwise"}, {}):
        probe = order_probe(_model(), ["0", "1", "2"], plan)
        assert probe is not None
        probe.check([4, 8], torch.float32, 2)


def test_call_order_not_registration_order_decides() -> None:
    # torchtitan's feed-forward: w1, w2, w3 registered; w2(silu(w1(x)) * w3(x)) called.
    plan = {"w1": "colwise", "w2": "rowwise", "w3": "colwise"}
    assert split_order_problem(["w1", "w3", "w2"], plan) is None
    assert split_order_problem(["w1", "w2", "w3"], plan) is not None
    assert split_order_problem([], plan) is None


def test_a_rowwise_layer_without_its_colwise_partner_is_named() -> None:
    plan = {"a": "colwise", "b": "rowwise", "c": "rowwise", "d": "colwise_gathered"}
    assert "b ('rowwise') is called first" in str(split_order_problem(["b", "a", "c"], plan))
    assert "c ('rowwise') is called after b ('rowwise')" in str(split_order_problem(["a", "b", "c"], plan))
    assert "d ('colwise_gathered') is called after a ('colwise')" in str(split_order_problem(["a", "d"], plan))
    # Megatron's pairs, several colwise layers before one rowwise, and a gathered head.
    assert split_order_problem(["a", "b", "d"], plan) is None
    assert split_order_problem(["d", "a", "a", "b"], plan) is None
