"""Layer profiles reproduce the published sizes of the catalogue networks."""

from __future__ import annotations

import pytest
import torch

from ringtrain.errors import ConfigError
from ringtrain.plan.layers import (
    DEFAULT_CUSTOM_LAYERS,
    Layer,
    from_module,
    from_param_count,
    total_macs,
    total_params,
)
from ringtrain.plan.models import MODELS, canonical_model, model_layers


@pytest.mark.parametrize(
    ("name", "params", "tensors"),
    [
        # torchvision's counts (same architectures): parameters and parameter tensors.
        ("resnet50", 25_557_032, 161),
        ("resnet101", 44_549_160, 314),
        ("resnet152", 60_192_808, 467),
        ("vgg16", 138_357_544, 32),
    ],
)
def test_parameter_counts_match_torchvision(name: str, params: int, tensors: int) -> None:
    layers = model_layers(name)
    assert total_params(layers) == params
    assert sum(layer.tensors for layer in layers) == tensors


def test_inception_v3_without_aux_head_is_23_8m() -> None:
    # torchvision: 27,161,264 with the auxiliary head, whose 3,326,696 parameters we leave out.
    assert total_params(model_layers("inception_v3")) == 27_161_264 - 3_326_696


@pytest.mark.parametrize(
    ("name", "gmacs"),
    # Published multiply-accumulates per 224x224 (299x299) image.
    [("resnet50", 4.1), ("resnet101", 7.8), ("resnet152", 11.5), ("vgg16", 15.5), ("inception_v3", 5.7)],
)
def test_forward_macs_match_published(name: str, gmacs: float) -> None:
    assert total_macs(model_layers(name)) / 1e9 == pytest.approx(gmacs, rel=0.03)


def test_vgg_parameters_sit_at_the_end_and_compute_at_the_start() -> None:
    layers = model_layers("vgg16")
    fc = [layer for layer in layers if layer.name.startswith("classifier")]
    assert sum(layer.params for layer in fc) / total_params(layers) > 0.85
    assert sum(layer.macs for layer in fc) / total_macs(layers) < 0.01


def test_names_are_normalised_and_unknown_ones_rejected() -> None:
    assert canonical_model("ResNet-50") == "resnet50"
    assert canonical_model("inception-v3") == "inception_v3"
    with pytest.raises(ConfigError, match="unknown model 'alexnet'"):
        canonical_model("alexnet")
    assert set(MODELS) >= {"resnet50", "resnet101", "inception_v3", "vgg16"}


def test_param_count_model_is_equal_layers_of_equal_compute() -> None:
    layers = from_param_count(300_000_001)
    assert len(layers) == DEFAULT_CUSTOM_LAYERS
    assert total_params(layers) == 300_000_001
    assert max(x.params for x in layers) - min(x.params for x in layers) <= 1
    assert {x.macs for x in layers} == {1.0}
    assert all(x.tensors == 1 for x in layers)


def test_one_layer_is_a_single_tensor_and_tiny_models_get_one_layer_per_parameter() -> None:
    (layer,) = from_param_count(300_000_000, layers=1)
    assert (layer.params, layer.tensors) == (300_000_000, 1)
    assert [x.params for x in from_param_count(3, layers=8)] == [1, 1, 1]


@pytest.mark.parametrize(("params", "layers"), [(0, 32), (10, 0), (10, -3)])
def test_bad_param_count_models_are_config_errors(params: int, layers: int) -> None:
    with pytest.raises(ConfigError, match="parameter count|layer count"):
        from_param_count(params, layers=layers)


def test_layer_rejects_negative_sizes() -> None:
    with pytest.raises(ConfigError):
        Layer("bad", (-1,), 1.0)


def test_from_module_counts_tensors_and_traces_macs() -> None:
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 26 * 26, 10))
    layers = from_module(net, torch.randn(1, 1, 28, 28))
    assert [layer.sizes for layer in layers] == [(36, 4), (27040, 10)]
    assert layers[0].macs == 1 * 4 * 9 * 26 * 26  # cin * cout * k*k * output pixels
    assert layers[1].macs == 4 * 26 * 26 * 10


def test_from_module_without_input_uses_parameter_counts() -> None:
    layers = from_module(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1)))
    assert [layer.macs for layer in layers] == [8.0, 3.0]


def test_from_module_without_parameters_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no trainable parameters"):
        from_module(torch.nn.ReLU())
