"""A tensor plan that splits a layer whose weight is tied to another module is refused.

``parallelize_module`` gives the split layer a new DTensor parameter and leaves the
other holder's tensor whole, so an output layer tied to the embedding became two
parameters trained apart: on 2 tensor ranks the loss left one process's at the second
step (3.9725 against 3.9671) and the weights ended 0.12 apart, with no error
(tests/integration/test_parallel_tied_tensor.py runs it on two ranks).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.parallel import parallelize
from ringtrain.parallel.tensor import check_plan, resolve_plan

VOCAB, WIDTH = 16, 8


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2 and nanoGPT do

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(x))))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


@pytest.mark.parametrize("tensor", [1, 2])
def test_a_tied_layer_in_the_plan_is_refused_at_any_degree(tensor: int) -> None:
    model = TiedNet()
    with pytest.raises(ConfigError) as info:
        check_plan(model, resolve_plan(model, {"head": "colwise_gathered"}), tensor)
    message = str(info.value)
    assert "head.weight is tied to embed.weight" in message and "\n" not in message
    assert "leave head out of the plan or untie" in message


def test_parallelize_refuses_it_with_tensor_1_too() -> None:
    # A plan describes the model: the error shows at once, not at the first tensor > 1.
    with pytest.raises(ConfigError, match="head.weight is tied to embed.weight"):
        parallelize(TiedNet(), _loss, tensor_plan={"head": "colwise_gathered"})


def test_untied_layers_of_a_tied_model_may_be_split() -> None:
    model = TiedNet()
    check_plan(model, resolve_plan(model, {"mid": "colwise_gathered"}), 2)


def test_one_layer_reused_under_two_names_is_split_once_and_passes() -> None:
    # The same module object twice: splitting it splits both uses, nothing is untied.
    shared = nn.Linear(WIDTH, WIDTH)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    check_plan(model, resolve_plan(model, {"0": "colwise_gathered"}), 2)
