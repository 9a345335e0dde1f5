"""Horovod's 2018 negotiation cycle: its cost, and how the step simulation uses it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ringtrain.errors import ConfigError
from ringtrain.plan.coordination import negotiation_s
from ringtrain.plan.cost import allreduce_time
from ringtrain.plan.layers import Layer
from ringtrain.plan.models import model_layers
from ringtrain.plan.network import Topology, intra_link, link
from ringtrain.plan.simulate import FRAMEWORKS, Framework, Scenario, simulate

ALPHA, PER_RANK = 30e-6, 2e-6
TOPO = Topology(4, intra_link("pcie3"), link("25gbit"))


def test_nothing_to_negotiate_on_one_gpu() -> None:
    assert negotiation_s(1, ALPHA, PER_RANK) == 0.0


def test_negotiation_counts_tree_rounds_and_ranks() -> None:
    # Gather, gatherv and two broadcasts: 3 * ceil(log2 128) + 1 = 22 rounds; 127 lists at rank 0.
    assert negotiation_s(128, ALPHA, PER_RANK) == pytest.approx(22 * ALPHA + 127 * PER_RANK)
    assert negotiation_s(2, ALPHA, PER_RANK) == pytest.approx(4 * ALPHA + PER_RANK)


@pytest.mark.parametrize("gpus", [2, 4, 8, 16, 32, 64, 128, 256, 512])
def test_negotiation_grows_with_the_number_of_gpus(gpus: int) -> None:
    assert negotiation_s(2 * gpus, ALPHA, PER_RANK) > negotiation_s(gpus, ALPHA, PER_RANK)


def test_the_coordinator_term_is_linear_and_dominates_at_scale() -> None:
    # Doubling N adds 3 tree rounds but N more lists for rank 0 to take in.
    step = negotiation_s(4096, ALPHA, PER_RANK) - negotiation_s(2048, ALPHA, PER_RANK)
    assert step == pytest.approx(3 * ALPHA + 2048 * PER_RANK)
    assert 2048 * PER_RANK > 3 * ALPHA * 10


@pytest.mark.parametrize("args", [(0, ALPHA, PER_RANK), (8, -1e-6, PER_RANK), (8, ALPHA, -1e-6)])
def test_bad_negotiation_inputs_are_config_errors(args: tuple[int, float, float]) -> None:
    with pytest.raises(ConfigError):
        negotiation_s(*args)


def test_bad_framework_costs_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        Framework("x", 1e6, cycle_s=1e-3, control_alpha_s=-1e-6)
    with pytest.raises(ConfigError):
        Framework("x", 1e6, transport_bw=0.0)


def _two_tensor_scenario(fw: Framework) -> Scenario:
    # Forward 100.1 ms, then layer 1's backward (its 400 MB gradient is ready at 200.2 ms),
    # then layer 0's (its 1 MB gradient is ready at 300.3 ms).
    layers = (Layer("l0", (250_000,), 1.0), Layer("l1", (100_000_000,), 1.0))
    return Scenario(layers, 0.3003, TOPO, "ring", fw, jitter_cv=0.0)


@pytest.mark.parametrize("alpha", [0.0, ALPHA])
def test_a_cycle_starts_at_once_after_a_long_one(alpha: float) -> None:
    # The 400 MB allreduce outlasts layer 0's backward; Horovod's loop then starts the next
    # cycle as soon as it ends, instead of waiting for the next 5 ms tick.
    fw = Framework("hvd", 64 * 2**20, cycle_s=5e-3, control_alpha_s=alpha, coordinator_per_rank_s=PER_RANK)
    gpus = 8
    neg = negotiation_s(gpus, fw.control_alpha_s, fw.coordinator_per_rank_s)
    first_cycle = math.ceil(0.2002 / 5e-3) * 5e-3
    big, small = (allreduce_time("ring", m, gpus, TOPO) for m in (400e6, 1e6))
    r = simulate(_two_tensor_scenario(fw), gpus)
    assert r.buckets == 2
    assert r.step_s == pytest.approx(first_cycle + 2 * neg + big + small)


def test_negotiation_slows_a_horovod_step_and_costs_nothing_on_one_gpu() -> None:
    quiet = replace(FRAMEWORKS["horovod"], control_alpha_s=0.0, coordinator_per_rank_s=0.0)
    sc = Scenario(tuple(model_layers("vgg16")), 0.415, TOPO, "ring", FRAMEWORKS["horovod"], jitter_cv=0.0)
    without = replace(sc, framework=quiet)
    assert simulate(sc, 512).step_s > simulate(without, 512).step_s
    assert simulate(sc, 1).step_s == simulate(without, 1).step_s == pytest.approx(0.415)


def test_an_exposed_exchange_pays_more_negotiation_at_larger_n() -> None:
    # VGG-16's exchange runs past backward in several cycles; each opens with a negotiation
    # that grows with N, so its cost to the step grows from 128 to 512 GPUs.
    sc = Scenario(tuple(model_layers("vgg16")), 0.415, TOPO, "ring", FRAMEWORKS["horovod"], jitter_cv=0.0)
    quiet = replace(sc, framework=replace(FRAMEWORKS["horovod"], control_alpha_s=0.0, coordinator_per_rank_s=0.0))
    cost = {n: simulate(sc, n).step_s - simulate(quiet, n).step_s for n in (128, 512)}
    assert 0 < cost[128] < cost[512]


def test_the_2018_horovod_preset_negotiates_every_cycle() -> None:
    fw = FRAMEWORKS["horovod"]
    assert fw.cycle_s == pytest.approx(5e-3)
    assert negotiation_s(512, fw.control_alpha_s, fw.coordinator_per_rank_s) > 1e-3
