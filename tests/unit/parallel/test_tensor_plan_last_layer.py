"""A tensor plan that would hand the loss a slice of the model's output is refused.

A ``"colwise"`` layer's output is each tensor rank's slice of its features, for the
rowwise layer after it; as the model's last layer (its head) the slice went to the loss:
a shape error in ``cross_entropy``, a wrong value, silently, in a loss that broadcasts.
"""

from __future__ import annotations

import pytest
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.parallel.tensor import check_plan, resolve_plan


class FeedForward(nn.Module):
    """torchtitan's: w2(silu(w1(x)) * w3(x)), registered w1, w2, w3."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.w3 = nn.Linear(width, hidden)


def _sequential() -> nn.Sequential:
    # The hidden width equals the head's: the rowwise "2" takes 16 features, as many as
    # the head gives, but a norm lies between them.
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.LayerNorm(8),
                         nn.Linear(8, 16))


@pytest.mark.parametrize("model", [_sequential(), nn.Sequential(FeedForward(8, 16),
                                                                nn.Linear(8, 16))],
                         ids=["after-a-norm", "after-a-block"])
def test_a_last_layer_split_by_columns_alone_is_refused(model: nn.Module) -> None:
    plan = {"0": "colwise", "2": "rowwise", "4": "colwise"} if len(model) == 5 else {
        "0.w1": "colwise", "0.w3": "colwise", "0.w2": "rowwise", "1": "colwise"}
    last = "4" if len(model) == 5 else "1"
    with pytest.raises(ConfigError) as info:
        check_plan(model, resolve_plan(model, plan), 2)
    assert str(info.value) == (
        f"tensor plan: {last} is the model's last layer and 'colwise' would hand the loss "
        "each tensor rank's slice of its output features; plan it as 'colwise_gathered' "
        "(split, output gathered whole) or leave it out of the plan")


@pytest.mark.parametrize("head", ["colwise_gathered", "Colwise_Gathered", None])
def test_a_gathered_or_whole_head_passes(head: str | None) -> None:
    model = _sequential()
    plan = {"0": "colwise", "2": "rowwise", **({"4": head} if head else {})}
    check_plan(model, resolve_plan(model, plan), 2)


def test_a_pair_registered_out_of_order_at_the_end_passes() -> None:
    # w3 is registered last, but w2 (rowwise, beside it, 16 input features) takes it.
    model = FeedForward(8, 16)
    check_plan(model, resolve_plan(model, {"w1": "colwise", "w2": "rowwise",
                                           "w3": "colwise"}), 2)


def test_the_gathered_style_splits_output_features() -> None:
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 15))
    with pytest.raises(ConfigError, match=r"1 \(colwise_gathered\) has 15 output features"):
        check_plan(model, resolve_plan(model, {"1": "colwise_gathered"}), 2)
