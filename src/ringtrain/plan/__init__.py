"""Scaling planner: predict data-parallel throughput before buying the GPUs.

Pure Python, no processes (except :mod:`ringtrain.plan.calibrate`, which starts
local Gloo processes on purpose). The pieces, one concern per module:

- :mod:`~ringtrain.plan.layers`     layer profiles (parameters, MACs) of networks
- :mod:`~ringtrain.plan.models`     catalogue: architectures and published GPU speeds
- :mod:`~ringtrain.plan.network`    links (alpha, bandwidth) and host topology
- :mod:`~ringtrain.plan.cost`       alpha-beta cost of each exchange strategy
- :mod:`~ringtrain.plan.coordination` Horovod's 2018 negotiation cycle, growing with N
- :mod:`~ringtrain.plan.simulate`   ready order, buckets, overlap: one step on N GPUs
- :mod:`~ringtrain.plan.validation` published results vs predictions
- :mod:`~ringtrain.plan.calibrate`  fit the local backend, check a real step
- :mod:`~ringtrain.plan.report`, :mod:`~ringtrain.plan.plot`, :mod:`~ringtrain.plan.cli`

Example::

    from ringtrain.plan import Scenario, Topology, link, intra_link, model_layers, simulate
    sc = Scenario(tuple(model_layers("resnet50")), compute_s=0.29,
                  topology=Topology(4, intra_link("pcie3"), link("25gbit")))
    simulate(sc, 64).efficiency
"""

from __future__ import annotations

from ringtrain.plan.cost import STRATEGIES, allreduce_time
from ringtrain.plan.layers import DEFAULT_CUSTOM_LAYERS, Layer, from_module, from_param_count
from ringtrain.plan.models import MODELS, model_layers, step_time
from ringtrain.plan.network import INTRA_LINKS, LINKS, Link, Topology, intra_link, link
from ringtrain.plan.simulate import (
    DEFAULT_BACKWARD_FRACTION,
    DEFAULT_JITTER_CV,
    FRAMEWORKS,
    Framework,
    Scenario,
    StepBreakdown,
    scaling,
    simulate,
)

__all__ = [
    "STRATEGIES",
    "allreduce_time",
    "Layer",
    "from_module",
    "from_param_count",
    "DEFAULT_CUSTOM_LAYERS",
    "MODELS",
    "model_layers",
    "step_time",
    "INTRA_LINKS",
    "LINKS",
    "Link",
    "Topology",
    "intra_link",
    "link",
    "DEFAULT_BACKWARD_FRACTION",
    "DEFAULT_JITTER_CV",
    "FRAMEWORKS",
    "Framework",
    "Scenario",
    "StepBreakdown",
    "scaling",
    "simulate",
]
