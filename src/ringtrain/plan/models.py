"""Catalogue of published model facts: layer profiles and per-GPU speed.

The planner predicts scaling, not single-GPU speed: the compute time of one step on
one GPU is an input. For the catalogue models on the GPUs of the validation papers
it comes from published single-GPU measurements, listed here with their sources;
for anything else the user gives ``--step-ms`` (or measures it with the step meter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ringtrain.errors import ConfigError
from ringtrain.plan.layers import Layer, inception_v3, resnet, total_macs, vgg16

__all__ = ["MODELS", "THROUGHPUTS", "Throughput", "canonical_model", "model_layers", "step_time"]

#: Catalogue architectures by the name the CLI takes (``--model``).
MODELS: dict[str, Callable[[], list[Layer]]] = {
    "resnet50": lambda: resnet(50),
    "resnet101": lambda: resnet(101),
    "resnet152": lambda: resnet(152),
    "inception_v3": inception_v3,
    "vgg16": vgg16,
}


def canonical_model(name: str) -> str:
    """The catalogue key for ``name`` (``ResNet-50`` -> ``resnet50``), or a ConfigError."""
    key = name.strip().lower().replace("-", "").replace(" ", "")
    key = {"inceptionv3": "inception_v3", "inception3": "inception_v3"}.get(key, key)
    if key not in MODELS:
        raise ConfigError(
            f"unknown model {name!r}; choose one of: {', '.join(MODELS)}, custom "
            "(custom needs --params N or --module, and --step-ms T)"
        )
    return key


def model_layers(name: str) -> list[Layer]:
    """Layer profile of the catalogue model ``name``."""
    return MODELS[canonical_model(name)]()


@dataclass(frozen=True)
class Throughput:
    """A published single-GPU training speed: images/s at a per-GPU batch size."""

    gpu: str
    model: str
    batch: int
    images_per_s: float
    source: str


_TF_BENCH = (
    "TensorFlow performance benchmarks, DGX-1 P100, tf_cnn_benchmarks, synthetic data, "
    "May 2017 (tensorflow/docs_src/performance/benchmarks.md)"
)
_DDP_README = (
    "PyTorch DDP benchmark README (pytorch/benchmarks/distributed/ddp), V100, "
    "'1 GPUs -- no ddp' row, p50"
)

#: Published single-GPU training speeds (no gradient exchange).
THROUGHPUTS: tuple[Throughput, ...] = (
    Throughput("p100", "inception_v3", 64, 142.0, _TF_BENCH),
    Throughput("p100", "resnet50", 64, 219.0, _TF_BENCH),
    Throughput("p100", "resnet152", 64, 91.8, _TF_BENCH),
    Throughput("p100", "vgg16", 64, 154.0, _TF_BENCH),
    Throughput("p100", "inception_v3", 32, 128.0, _TF_BENCH + ", batch-32 table"),
    Throughput("p100", "resnet50", 32, 195.0, _TF_BENCH + ", batch-32 table"),
    Throughput("p100", "resnet152", 32, 82.7, _TF_BENCH + ", batch-32 table"),
    Throughput("p100", "vgg16", 32, 144.0, _TF_BENCH + ", batch-32 table"),
    Throughput("v100", "resnet50", 32, 329.0, _DDP_README),
    Throughput("v100", "resnet101", 32, 197.0, _DDP_README),
)


def step_time(gpu: str, model: str, batch: int) -> tuple[float, str]:
    """Seconds for one single-GPU step of ``model`` at ``batch`` on ``gpu``, and its source.

    When the exact model is not in :data:`THROUGHPUTS` but two others of the same
    (gpu, batch) bracket it in multiply-accumulates, time per image is interpolated
    linearly in MACs between them (how ResNet-101 on P100 is obtained from ResNet-50
    and ResNet-152). The source string says so.
    """
    gpu, model = gpu.lower(), model.lower()
    same = [t for t in THROUGHPUTS if t.gpu == gpu and t.batch == batch]
    for t in same:
        if t.model == model:
            return batch / t.images_per_s, t.source
    family = model.rstrip("0123456789_v")
    if model in MODELS:
        target = total_macs(MODELS[model]())
        # Only a network of the same family (ResNets) scales with MACs this simply.
        known = sorted(
            (total_macs(MODELS[t.model]()), 1.0 / t.images_per_s, t.model)
            for t in same
            if t.model.rstrip("0123456789_v") == family
        )
        below = [k for k in known if k[0] < target]
        above = [k for k in known if k[0] > target]
        if below and above:
            (x0, y0, m0), (x1, y1, m1) = below[-1], above[0]
            per_image = y0 + (target - x0) * (y1 - y0) / (x1 - x0)
            return batch * per_image, (
                f"interpolated in MACs between {m0} and {m1} on {gpu} at batch {batch} "
                f"({same[0].source})"
            )
    have = sorted({f"{t.model}@{t.gpu}/batch{t.batch}" for t in THROUGHPUTS})
    raise ConfigError(
        f"no published step time for {model} on {gpu} at batch {batch} (known: {', '.join(have)}); "
        "pass --step-ms with your measured single-GPU step time"
    )
