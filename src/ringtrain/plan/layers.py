"""Layer profiles: the parameters and compute of a network, layer by layer.

The planner needs two facts per layer and nothing else: how many gradient bytes
the layer produces (its parameter count) and how much of the backward pass it
costs (its forward multiply-accumulates; backward is about twice that for every
layer, so the *share* of backward time is the share of forward MACs). Together they
give the order and the moments at which gradients become ready during backward,
which is what decides how much of the exchange hides behind compute.

The catalogue architectures are generated from their published definitions, so the
counts are checkable:

- ResNet-50/101/152: He et al. 2016, "Deep Residual Learning", Table 1 (bottleneck
  blocks [3,4,6,3], [3,4,23,3], [3,8,36,3]); torchvision layout (stride on the 3x3).
  Totals 25,557,032 and 44,549,160 parameters.
- VGG-16: Simonyan & Zisserman 2015, configuration D. 138,357,544 parameters.
- Inception V3: Szegedy et al. 2016, "Rethinking the Inception Architecture",
  Figures 5-7, with the layer widths of the reference implementations (tf-slim,
  torchvision) and without the auxiliary head: 23.8M parameters.

Custom networks come from a bare parameter count (:func:`from_param_count`: equal
layers, so gradients become ready uniformly through backward) or from a
``torch.nn.Module`` (:func:`from_module`), whose leaf modules give the order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringtrain.errors import ConfigError

__all__ = [
    "Layer",
    "resnet",
    "vgg16",
    "inception_v3",
    "from_param_count",
    "DEFAULT_CUSTOM_LAYERS",
    "from_module",
    "total_params",
    "total_macs",
]


@dataclass(frozen=True)
class Layer:
    """One layer in forward order: its gradient tensors and forward cost per sample."""

    name: str
    #: Elements of each gradient tensor (weight, bias, BN gamma/beta...). Frameworks pay
    #: a fixed cost per tensor (a hook, a launch, a negotiation) and parameter servers
    #: place whole tensors, so the split matters, not only the sum.
    sizes: tuple[int, ...]
    #: Forward multiply-accumulates for one sample.
    macs: float

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 0 or self.macs < 0:
            raise ConfigError(f"layer {self.name!r}: needs >= 1 tensor and counts >= 0, got {self}")

    @property
    def params(self) -> int:
        """Parameters of the layer (sum over its tensors)."""
        return sum(self.sizes)

    @property
    def tensors(self) -> int:
        """Number of gradient tensors of the layer."""
        return len(self.sizes)


def total_params(layers: list[Layer]) -> int:
    """Sum of parameters over ``layers``."""
    return sum(layer.params for layer in layers)


def total_macs(layers: list[Layer]) -> float:
    """Sum of forward multiply-accumulates per sample over ``layers``."""
    return sum(layer.macs for layer in layers)


def _conv(
    name: str, cin: int, cout: int, kh: int, kw: int, hw_out: tuple[int, int],
    *, bias: bool = False, bn: bool = True,
) -> Layer:
    """A convolution (+ batch norm) whose output is ``hw_out`` pixels."""
    weights = cin * cout * kh * kw
    sizes = (weights,) + ((cout,) if bias else ()) + ((cout, cout) if bn else ())
    return Layer(name, sizes, float(weights * hw_out[0] * hw_out[1]))


def _linear(name: str, fin: int, fout: int) -> Layer:
    return Layer(name, (fin * fout, fout), float(fin * fout))


# ---------------------------------------------------------------- ResNet

_RESNET_BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


def resnet(depth: int) -> list[Layer]:
    """ResNet-50/101/152 (bottleneck), 224x224 input, 1000 classes."""
    if depth not in _RESNET_BLOCKS:
        raise ConfigError(f"resnet depth {depth} is not one of {sorted(_RESNET_BLOCKS)}")
    layers = [_conv("conv1", 3, 64, 7, 7, (112, 112))]
    cin, size = 64, 56  # after the stride-2 max pool
    for stage, blocks in enumerate(_RESNET_BLOCKS[depth]):
        width = 64 * 2**stage
        out_size = size if stage == 0 else size // 2
        for b in range(blocks):
            p = f"layer{stage + 1}.{b}"
            first = b == 0
            # conv1 (1x1) runs at the input resolution; the stride sits on the 3x3.
            in_size = size if first else out_size
            layers.append(_conv(p + ".conv1", cin, width, 1, 1, (in_size, in_size)))
            layers.append(_conv(p + ".conv2", width, width, 3, 3, (out_size, out_size)))
            layers.append(_conv(p + ".conv3", width, 4 * width, 1, 1, (out_size, out_size)))
            if first:
                layers.append(_conv(p + ".downsample", cin, 4 * width, 1, 1, (out_size, out_size)))
            cin = 4 * width
        size = out_size
    layers.append(_linear("fc", cin, 1000))
    return layers


# ---------------------------------------------------------------- VGG-16

def vgg16() -> list[Layer]:
    """VGG-16 (configuration D), 224x224 input, 1000 classes."""
    # Output channels of each 3x3 convolution; 0 marks a 2x2 max pool.
    plan = [64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0]
    layers: list[Layer] = []
    cin, size = 3, 224
    for i, cout in enumerate(plan):
        if cout == 0:
            size //= 2
            continue
        layers.append(_conv(f"features.{i}", cin, cout, 3, 3, (size, size), bias=True, bn=False))
        cin = cout
    layers.append(_linear("classifier.0", 512 * 7 * 7, 4096))
    layers.append(_linear("classifier.3", 4096, 4096))
    layers.append(_linear("classifier.6", 4096, 1000))
    return layers


# ---------------------------------------------------------------- Inception V3

def _inception_a(p: str, cin: int, pool: int) -> tuple[list[Layer], int]:
    s = (35, 35)
    return [
        _conv(p + ".b1x1", cin, 64, 1, 1, s),
        _conv(p + ".b5x5_1", cin, 48, 1, 1, s), _conv(p + ".b5x5_2", 48, 64, 5, 5, s),
        _conv(p + ".b3dbl_1", cin, 64, 1, 1, s), _conv(p + ".b3dbl_2", 64, 96, 3, 3, s),
        _conv(p + ".b3dbl_3", 96, 96, 3, 3, s),
        _conv(p + ".pool", cin, pool, 1, 1, s),
    ], 64 + 64 + 96 + pool


def _inception_c(p: str, c7: int) -> list[Layer]:
    s = (17, 17)
    return [
        _conv(p + ".b1x1", 768, 192, 1, 1, s),
        _conv(p + ".b7_1", 768, c7, 1, 1, s), _conv(p + ".b7_2", c7, c7, 1, 7, s),
        _conv(p + ".b7_3", c7, 192, 7, 1, s),
        _conv(p + ".b7dbl_1", 768, c7, 1, 1, s), _conv(p + ".b7dbl_2", c7, c7, 7, 1, s),
        _conv(p + ".b7dbl_3", c7, c7, 1, 7, s), _conv(p + ".b7dbl_4", c7, c7, 7, 1, s),
        _conv(p + ".b7dbl_5", c7, 192, 1, 7, s),
        _conv(p + ".pool", 768, 192, 1, 1, s),
    ]


def _inception_e(p: str, cin: int) -> list[Layer]:
    s = (8, 8)
    return [
        _conv(p + ".b1x1", cin, 320, 1, 1, s),
        _conv(p + ".b3_1", cin, 384, 1, 1, s), _conv(p + ".b3_2a", 384, 384, 1, 3, s),
        _conv(p + ".b3_2b", 384, 384, 3, 1, s),
        _conv(p + ".b3dbl_1", cin, 448, 1, 1, s), _conv(p + ".b3dbl_2", 448, 384, 3, 3, s),
        _conv(p + ".b3dbl_3a", 384, 384, 1, 3, s), _conv(p + ".b3dbl_3b", 384, 384, 3, 1, s),
        _conv(p + ".pool", cin, 192, 1, 1, s),
    ]


def inception_v3() -> list[Layer]:
    """Inception V3, 299x299 input, 1000 classes, no auxiliary classifier."""
    layers = [
        _conv("Conv2d_1a_3x3", 3, 32, 3, 3, (149, 149)),
        _conv("Conv2d_2a_3x3", 32, 32, 3, 3, (147, 147)),
        _conv("Conv2d_2b_3x3", 32, 64, 3, 3, (147, 147)),
        _conv("Conv2d_3b_1x1", 64, 80, 1, 1, (73, 73)),
        _conv("Conv2d_4a_3x3", 80, 192, 3, 3, (71, 71)),
    ]
    cin = 192
    for name, pool in (("Mixed_5b", 32), ("Mixed_5c", 64), ("Mixed_5d", 64)):
        block, cin = _inception_a(name, cin, pool)
        layers += block
    layers += [  # Mixed_6a: grid reduction 35 -> 17
        _conv("Mixed_6a.b3x3", cin, 384, 3, 3, (17, 17)),
        _conv("Mixed_6a.b3dbl_1", cin, 64, 1, 1, (35, 35)),
        _conv("Mixed_6a.b3dbl_2", 64, 96, 3, 3, (35, 35)),
        _conv("Mixed_6a.b3dbl_3", 96, 96, 3, 3, (17, 17)),
    ]
    for name, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
        layers += _inception_c(name, c7)
    layers += [  # Mixed_7a: grid reduction 17 -> 8
        _conv("Mixed_7a.b3_1", 768, 192, 1, 1, (17, 17)),
        _conv("Mixed_7a.b3_2", 192, 320, 3, 3, (8, 8)),
        _conv("Mixed_7a.b7x3_1", 768, 192, 1, 1, (17, 17)),
        _conv("Mixed_7a.b7x3_2", 192, 192, 1, 7, (17, 17)),
        _conv("Mixed_7a.b7x3_3", 192, 192, 7, 1, (17, 17)),
        _conv("Mixed_7a.b7x3_4", 192, 192, 3, 3, (8, 8)),
    ]
    layers += _inception_e("Mixed_7b", 1280)
    layers += _inception_e("Mixed_7c", 2048)
    layers.append(_linear("fc", 2048, 1000))
    return layers


# ---------------------------------------------------------------- custom

#: Layers a model known only by its parameter count is split into. A stated default,
#: not a fact about any network: between VGG-16's 16 weight layers and ResNet-50's 54.
#: The simulated overlap barely depends on it once it is past a dozen or so: the
#: Gibiansky validation row (300M parameters, 40 GPUs) predicts about 68% for any
#: count from 16 to 48, against 46.6% for a single tensor exchanged after backward.
DEFAULT_CUSTOM_LAYERS = 32


def from_param_count(
    params: int, *, layers: int = DEFAULT_CUSTOM_LAYERS, name: str = "custom",
) -> list[Layer]:
    """A network known only by its size: ``layers`` equal layers of one tensor each.

    Equal parameters and equal compute per layer is the stated assumption that stands
    in for the unknown architecture: gradients become ready uniformly through
    backward, so the exchange of the later layers overlaps the backward of the
    earlier ones. ``layers=1`` is the no-overlap bound (one tensor, ready when
    backward ends). A network with fewer parameters than ``layers`` gets one layer per
    parameter. For the real order of a network, pass a module (:func:`from_module`).
    """
    if params <= 0:
        raise ConfigError(f"parameter count must be > 0, got {params}; pass e.g. --params 25e6")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ConfigError(
            f"layer count of a custom model must be a whole number >= 1, got {layers!r}; "
            f"pass e.g. --layers {DEFAULT_CUSTOM_LAYERS} (1 means no overlap with backward)"
        )
    count = min(layers, int(params))
    if count == 1:
        return [Layer(name, (int(params),), 1.0)]
    base, extra = divmod(int(params), count)
    # The remainder goes to the first layers, so the sizes differ by at most one.
    return [Layer(f"{name}.{i}", (base + (1 if i < extra else 0),), 1.0) for i in range(count)]


def from_module(module: Any, example_input: Any = None) -> list[Layer]:
    """Layer profile of a ``torch.nn.Module``, one entry per module owning parameters.

    Modules come in registration order, which for ordinary networks is forward
    order. With ``example_input`` (one sample, batch dimension 1) one forward pass runs
    under ``no_grad`` and the MACs of each Conv/Linear come from the shapes it saw;
    other modules (norms, embeddings, recurrent cells) and every module when no input
    is given count their parameter count as MACs (exact for MLPs, rough for
    convolutions, whose weights are reused across pixels).
    """
    import torch  # lazily: the planner itself does not need torch

    owners = [
        (name or type(mod).__name__, mod)
        for name, mod in module.named_modules()
        if any(p.requires_grad for p in mod.parameters(recurse=False))
    ]
    if not owners:
        raise ConfigError("the module has no trainable parameters; nothing to exchange")
    macs: dict[str, float] = {}
    if example_input is not None:
        hooks = []

        def record(key: str) -> Any:
            def hook(mod: Any, _inp: Any, out: Any) -> None:
                if isinstance(mod, torch.nn.modules.conv._ConvNd):
                    per_out = mod.weight[0].numel()  # cin/groups * kernel elements
                    macs[key] = macs.get(key, 0.0) + float(out.numel() / out.shape[0] * per_out)
                elif isinstance(mod, torch.nn.Linear):
                    rows = out.numel() / out.shape[0] / mod.out_features
                    macs[key] = macs.get(key, 0.0) + float(rows * mod.weight.numel())
            return hook

        for key, mod in owners:
            hooks.append(mod.register_forward_hook(record(key)))
        try:
            with torch.no_grad():
                module(example_input)
        finally:
            for h in hooks:
                h.remove()
    layers = []
    for key, mod in owners:
        own = [p for p in mod.parameters(recurse=False) if p.requires_grad]
        sizes = tuple(int(p.numel()) for p in own)
        layers.append(Layer(key, sizes, macs.get(key, float(sum(sizes)))))
    return layers
