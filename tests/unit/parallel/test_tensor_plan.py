"""Tensor-parallel plans: which layers split, and whether the degree divides them."""

from __future__ import annotations

import pytest
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.parallel.tensor import check_plan, resolve_plan


class Attention(nn.Module):
    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.q, self.proj = nn.Linear(width, width), nn.Linear(width, width)


class Model(nn.Module):
    def __init__(self, width: int = 16, n_head: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(width, n_head) for _ in range(2))
        self.fc, self.out = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)


PLAN = {"blocks.*.q": "colwise", "blocks.*.proj": "rowwise", "fc": "Colwise", "out": "rowwise"}


def test_patterns_expand_to_every_matching_module() -> None:
    resolved = resolve_plan(Model(), PLAN)
    assert resolved == {"blocks.0.q": "colwise", "blocks.1.q": "colwise",
                        "blocks.0.proj": "rowwise", "blocks.1.proj": "rowwise",
                        "fc": "colwise", "out": "rowwise"}


@pytest.mark.parametrize(("plan", "word"), [
    ({"blocks.*.q": "diagonal"}, "not one of colwise, rowwise"),
    ({"blocks.*.nothing": "colwise"}, "matches no module"),
])
def test_bad_plans_are_refused(plan: dict[str, str], word: str) -> None:
    with pytest.raises(ConfigError, match=word):
        resolve_plan(Model(), plan)


def test_a_divisible_plan_passes() -> None:
    model = Model()
    check_plan(model, resolve_plan(model, PLAN), 4)


def test_a_layer_the_degree_does_not_divide_is_named() -> None:
    model = Model(width=16, hidden=60)
    with pytest.raises(ConfigError) as info:
        check_plan(model, resolve_plan(model, {"fc": "colwise"}), 8)
    assert str(info.value) == (
        "tensor parallel: fc (colwise) has 60 output features, which tensor=8 does not "
        "divide; choose tensor from [2, 3, 4, 5] or resize the layer")


def test_attention_heads_must_split_evenly() -> None:
    model = Model(width=12, n_head=6)  # 12 features divide by 4, 6 heads do not
    with pytest.raises(ConfigError) as info:
        check_plan(model, resolve_plan(model, {"blocks.*.q": "colwise"}), 4)
    assert str(info.value) == ("tensor parallel: attention blocks.0 has 6 heads, which "
                               "tensor=4 does not divide; choose tensor from [2, 3, 6]")


def test_rowwise_checks_the_input_features() -> None:
    model = Model(width=16, hidden=60)
    with pytest.raises(ConfigError, match="out \\(rowwise\\) has 60 input features"):
        check_plan(model, {"out": "rowwise"}, 8)


def test_only_linear_layers_split() -> None:
    model = Model()
    with pytest.raises(ConfigError, match="norm is a LayerNorm"):
        check_plan(model, {"norm": "colwise"}, 2)
