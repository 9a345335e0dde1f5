"""Cutting a model into pipeline stages (no processes)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.parallel.split import (
    StageModule,
    pipeline_units,
    split_by_names,
    split_by_params,
    split_units,
)


class Net(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.embed = nn.Linear(4, widths[0])
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False))
        self.head = nn.Linear(widths[-1], 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def test_units_open_module_lists_one_level() -> None:
    names = [name for name, _ in pipeline_units(Net([8, 8, 8]))]
    assert names == ["embed", "blocks.0", "blocks.1", "head"]
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert [name for name, _ in pipeline_units(seq)] == ["0", "1"]


def _heaviest(counts: list[int], starts: list[int]) -> int:
    bounds = [*starts, len(counts)]
    return max(sum(counts[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))


def test_even_parameter_split_is_optimal() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        counts = [rng.randint(0, 50) for _ in range(n)]
        stages = rng.randint(1, n)
        starts = split_by_params(counts, stages)
        assert starts[0] == 0 and starts == sorted(set(starts)) and len(starts) == stages
        best = min(_heaviest(counts, [0, *cut])
                   for cut in itertools.combinations(range(1, n), stages - 1))
        assert _heaviest(counts, starts) == best


def test_even_split_of_equal_units_is_equal() -> None:
    assert split_by_params([5, 10, 10, 10, 10, 5], 2) == [0, 3]


def test_split_by_names_and_its_errors() -> None:
    names = ["embed", "blocks.0", "blocks.1", "head"]
    assert split_by_names(names, ["blocks.1"], 2) == [0, 2]
    with pytest.raises(ConfigError, match="need 1 split point"):
        split_by_names(names, [], 2)
    with pytest.raises(ConfigError, match="units are: embed, blocks.0"):
        split_by_names(names, ["blocks.7"], 2)
    with pytest.raises(ConfigError, match="forward order"):
        split_by_names(names, ["head", "blocks.0"], 3)


def test_more_stages_than_units_names_the_limit() -> None:
    with pytest.raises(ConfigError, match="only 3 unit.*use pipeline <= 3"):
        split_units(Net([8, 8]), 4)


def test_a_parameter_shared_across_stages_is_refused() -> None:
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight  # tied, like an embedding and an output layer
    model = nn.Sequential(first, nn.Linear(4, 4), last)
    with pytest.raises(ConfigError, match="0.weight .*same tensor as 2.weight"):
        split_units(model, 2, ["1"])


def test_a_bad_split_spec_is_refused() -> None:
    with pytest.raises(ConfigError, match="'params'"):
        split_units(Net([8, 8]), 2, "layers")


def test_stages_keep_the_models_names_and_compose_to_the_model() -> None:
    torch.manual_seed(0)
    net = Net([8, 8, 8, 8])
    full = net.state_dict()
    groups = split_units(net, 2)
    stages = [StageModule(g) for g in groups]
    keys = [set(s.state_dict()) for s in stages]
    assert keys[0] | keys[1] == set(full) and not keys[0] & keys[1]
    assert all(torch.equal(s.state_dict()[k], full[k]) for s in stages for k in s.state_dict())
    # The model's forward also applies tanh between blocks, so compose a Sequential one.
    seq = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    x = torch.randn(5, 3)
    parts = [StageModule(g) for g in split_units(seq, 3)]
    y = x
    for part in parts:
        y = part(y)
    assert torch.equal(y, seq(x))
    assert sum((p.unit_names for p in parts), []) == ["0", "1", "2", "3", "4"]


class WithOwnState(nn.Module):
    """A model whose forward uses a parameter or buffer held by no unit."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        if kind == "parameter":
            self.scale = nn.Parameter(torch.full((4,), 2.0))
        else:
            self.register_buffer("scale", torch.full((4,), 2.0))
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.scale)


@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_state_outside_every_unit_is_refused(kind: str) -> None:
    # Before: the stages were cut from the units alone, so `scale` was in no stage and
    # a 2-stage pipeline trained b(a(x)) instead of b(a(x) * scale) without a word
    # (loss 0.46 against the one-process 1.26 in the audit's repro).
    with pytest.raises(ConfigError, match=rf"{kind} scale belongs to no pipeline unit"):
        split_units(WithOwnState(kind), 2)
