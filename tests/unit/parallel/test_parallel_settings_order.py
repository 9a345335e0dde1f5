"""Model-parallel settings that would do nothing, and forwards a pipeline would not run.

One process: the checks are pure (a pipeline setting without a pipeline) or run the
model on the ``meta`` device (the forward-order probe), so no world is needed; the
pipelined step that uses the probe is in tests/integration/test_parallel_audit3.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.parallel import parallelize, pipeline_units
from ringtrain.parallel.order import order_probe


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.parametrize(("settings", "words"), [
    ({"schedule": "gpipe"}, ["schedule='gpipe' has no effect with pipeline=1", "drop schedule="]),
    ({"schedule": " GPipe "}, ["schedule='gpipe' has no effect"]),
    ({"split": ["2"]}, ["split=['2'] has no effect with pipeline=1", "drop split="]),
    ({"split": "layers"}, ["split='layers' has no effect with pipeline=1"]),
    ({"tensor_plan": {"nope.*": "colwise"}}, ["tensor plan pattern 'nope.*' matches no module"]),
    ({"tensor_plan": {"1": "colwise"}}, ["1 is a Tanh, only nn.Linear layers are split"]),
], ids=["gpipe", "gpipe-spelled", "split-points", "split-word", "plan-typo", "plan-not-linear"])
def test_a_setting_without_its_technique_is_refused(settings: dict[str, Any],
                                                    words: list[str]) -> None:
    # Before: accepted and ignored (a run "with GPipe" or "split at 2" was neither; a
    # plan with a typo passed until the day the job ran with tensor > 1).
    with pytest.raises(ConfigError) as caught:
        parallelize(_model(), nn.functional.mse_loss, **settings)
    message = str(caught.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("settings", [
    {"schedule": "1f1b"}, {"split": "params"}, {"split": []},
    {"tensor_plan": {"0": "colwise", "2": "rowwise"}},
], ids=["default-schedule", "default-split", "no-split-points", "valid-plan"])
def test_defaults_and_a_valid_plan_still_pass_without_the_technique(
        settings: dict[str, Any]) -> None:
    # What leaving the setting out means, or a plan that fits the model (the example
    # passes its plan at every tensor degree), is not an error.
    par = parallelize(_model(), nn.functional.mse_loss, **settings)
    assert par.layout.pipeline == par.layout.tensor == 1


class Swapped(nn.Module):
    """Units registered b, a; forward runs a, then b."""

    def __init__(self) -> None:
        super().__init__()
        self.b, self.a = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Reused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.a(x)))


class Between(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Skipped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class After(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return 2 * x


class InOrder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        self.head = nn.Linear(4, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize(("model", "problem"), [
    (Swapped, "calls a where b comes next"),
    (Reused, "calls a again after a"),
    (Between, "does not call b with the output of a alone"),
    (Skipped, "never calls c"),
    (After, "does not return the output of blocks.1 as it is"),
])
def test_a_forward_that_is_not_its_units_in_order_is_named(model: type[nn.Module],
                                                           problem: str) -> None:
    net = model()
    probe = order_probe(net, [name for name, _ in pipeline_units(net)])
    assert probe is not None
    with pytest.raises(ConfigError) as caught:
        probe.check([2, 4], torch.float32, 2)
    assert problem in str(caught.value) and "registration order" in str(caught.value)
    assert all(not p.is_meta for p in net.parameters())  # the probe left the model alone


def test_a_forward_that_is_its_units_in_order_passes() -> None:
    net = InOrder()
    probe = order_probe(net, [name for name, _ in pipeline_units(net)])
    assert probe is not None
    probe.check([2, 3], torch.int64, 2)
    assert sum(t.numel() for t in probe.skeleton.parameters() if not t.is_meta) == 0
