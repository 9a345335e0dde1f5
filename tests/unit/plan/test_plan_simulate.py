"""Ready order, bucketing and overlap: one step on N GPUs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ringtrain.errors import ConfigError
from ringtrain.plan.cost import allreduce_time
from ringtrain.plan.layers import Layer, from_param_count
from ringtrain.plan.models import model_layers
from ringtrain.plan.network import Link, Topology, intra_link, link
from ringtrain.plan.simulate import FRAMEWORKS, Framework, Scenario, simulate, straggler_factor

TOPO = Topology(4, intra_link("pcie3"), link("25gbit"))


def _scenario(model: str = "resnet50", **kw: object) -> Scenario:
    base = dict(topology=TOPO, framework=FRAMEWORKS["horovod"], jitter_cv=0.0, batch=64)
    base.update(kw)
    return Scenario(tuple(model_layers(model)), 0.3, **base)  # type: ignore[arg-type]


def test_one_gpu_is_the_plain_step() -> None:
    r = simulate(_scenario(), 1)
    assert r.step_s == pytest.approx(0.3)
    assert r.efficiency == pytest.approx(1.0)
    assert (r.comm_s, r.buckets) == (0.0, 0)


def test_without_overlap_the_step_is_compute_plus_one_allreduce() -> None:
    sc = _scenario(framework=FRAMEWORKS["flat"])
    r = simulate(sc, 64)
    assert r.step_s == pytest.approx(0.3 + allreduce_time("ring", sc.gradient_bytes, 64, TOPO))
    assert r.buckets == 1


def test_overlap_hides_part_of_the_exchange() -> None:
    flat = simulate(_scenario(framework=FRAMEWORKS["flat"]), 64)
    overlapped = simulate(_scenario(), 64)
    assert overlapped.step_s < flat.step_s
    assert overlapped.exposed_s < overlapped.comm_s


def test_exposed_time_is_never_below_the_last_buckets_exchange() -> None:
    # The first layer's gradients are ready only at the very end of backward.
    sc = _scenario(framework=FRAMEWORKS["per-tensor"])
    first = model_layers("resnet50")[0]
    r = simulate(sc, 64)
    assert r.exposed_s >= allreduce_time("ring", 4 * first.sizes[-1], 64, TOPO)


def test_vgg_exchange_starts_early_because_its_fc_layers_are_last() -> None:
    # Same size, same compute: VGG-16's parameters are ready first, a flat layer order is not.
    vgg = _scenario("vgg16")
    uniform = replace(vgg, layers=tuple(from_param_count(138_357_544)))
    assert simulate(vgg, 128).step_s < simulate(uniform, 128).step_s


def _custom(backward_fraction: float, framework: str = "per-tensor") -> Scenario:
    # A model known only by its size: 300M parameters in equal layers, on 5 hosts of 8.
    return Scenario(tuple(from_param_count(300_000_000)), 0.37, Topology(8, intra_link("pcie3"), link("ib-fdr")),
                    framework=FRAMEWORKS[framework], backward_fraction=backward_fraction, jitter_cv=0.0)


@pytest.mark.parametrize("framework", ["per-tensor", "horovod", "ddp"])
@pytest.mark.parametrize(("less", "more"), [(0.0, 0.3), (0.3, 2 / 3), (2 / 3, 0.9)])
def test_custom_model_waits_less_with_a_longer_backward(framework: str, less: float, more: float) -> None:
    # The same step with more of it in backward: more of the exchange hides behind it.
    short, long = simulate(_custom(less, framework), 40), simulate(_custom(more, framework), 40)
    assert long.exposed_s < short.exposed_s
    assert long.step_s < short.step_s


@pytest.mark.parametrize("framework", ["per-tensor", "horovod"])
def test_custom_model_without_backward_is_the_no_overlap_case(framework: str) -> None:
    sc = _custom(0.0, framework)
    no_overlap = replace(sc, framework=replace(sc.framework, overlap=False))
    got, want = simulate(sc, 40), simulate(no_overlap, 40)
    assert got.step_s == pytest.approx(want.step_s)
    assert got.exposed_s == pytest.approx(want.exposed_s)
    # Nothing hides (Horovod adds its negotiation on top of the busy time).
    assert got.exposed_s >= got.comm_s * (1 - 1e-9)


def test_custom_model_in_equal_layers_overlaps_but_one_tensor_cannot() -> None:
    layered = _custom(2 / 3)
    single = replace(layered, layers=tuple(from_param_count(300_000_000, layers=1)))
    assert simulate(layered, 40).exposed_s < 0.5 * simulate(single, 40).exposed_s
    assert simulate(single, 40).exposed_s == pytest.approx(simulate(single, 40).comm_s)


def test_fp16_halves_the_bytes_and_helps_a_communication_bound_model() -> None:
    fp32, fp16 = _scenario("vgg16"), _scenario("vgg16", wire_bytes=2)
    assert fp16.gradient_bytes == fp32.gradient_bytes / 2
    assert simulate(fp16, 128).efficiency > simulate(fp32, 128).efficiency


@pytest.mark.parametrize("strategy", ["ring", "hd", "hierarchical", "ps"])
def test_faster_network_never_hurts(strategy: str) -> None:
    slow = _scenario(strategy=strategy)
    fast = replace(slow, topology=Topology(4, intra_link("pcie3"), link("100gbit")))
    assert simulate(fast, 64).step_s <= simulate(slow, 64).step_s


def test_ddp_static_buckets_follow_the_cap() -> None:
    sc = _scenario(framework=FRAMEWORKS["ddp"])
    r = simulate(sc, 16)
    # 102 MB in 25 MB buckets after a 1 MB first one: at least 5 buckets.
    assert 5 <= r.buckets <= 10
    no_cap = replace(sc, framework=replace(FRAMEWORKS["ddp"], bucket_bytes=float("inf"), first_bucket_bytes=None))
    assert simulate(no_cap, 16).buckets == 1


def test_dynamic_fusion_never_exceeds_the_threshold_except_for_single_tensors() -> None:
    layers = tuple(Layer(f"l{i}", (1_000_000,), 1.0) for i in range(40))  # 4 MB each
    fw = Framework("test", bucket_bytes=10e6, cycle_s=1e-3)
    sc = Scenario(layers, 1.0, TOPO, "ring", fw, jitter_cv=0.0)
    r = simulate(sc, 8)
    assert r.buckets >= 40 * 4e6 / 10e6


def test_per_tensor_cost_stretches_backward() -> None:
    plain = _scenario(framework=FRAMEWORKS["per-tensor"])
    costly = replace(plain, framework=replace(FRAMEWORKS["per-tensor"], per_tensor_s=100e-6))
    assert simulate(costly, 1).step_s == pytest.approx(0.3 + 161 * 100e-6)
    assert simulate(costly, 1).efficiency < 1.0


def test_parameter_server_hot_spot_is_the_largest_tensor() -> None:
    # One big tensor on one server: its link carries it from every remote GPU, both ways.
    one = tuple(from_param_count(25_000_000, layers=1))
    sc = Scenario(one, 0.3, TOPO, "ps", FRAMEWORKS["per-tensor"], jitter_cv=0.0)
    r = simulate(sc, 32)
    one_way = TOPO.inter.alpha_s + 28 * 100e6 / TOPO.inter.bandwidth
    assert r.step_s == pytest.approx(0.3 + 2 * one_way)


def test_more_servers_help_a_model_with_many_tensors() -> None:
    few = _scenario(strategy="ps", ps_shards=2)
    many = _scenario(strategy="ps", ps_shards=32)
    assert simulate(many, 128).step_s < simulate(few, 128).step_s


def test_summing_per_host_before_pushing_relieves_the_servers() -> None:
    per_gpu = _scenario("inception_v3", strategy="ps")
    per_host = replace(per_gpu, ps_per_host=True)
    assert simulate(per_host, 128).step_s < 0.6 * simulate(per_gpu, 128).step_s


def test_a_cpu_bound_transport_slows_the_servers() -> None:
    nic = _scenario("inception_v3", strategy="ps", ps_per_host=True, framework=FRAMEWORKS["per-tensor"])
    grpc = replace(nic, framework=FRAMEWORKS["tf-grpc"])
    assert simulate(grpc, 128).step_s > simulate(nic, 128).step_s
    assert simulate(grpc, 1).step_s == simulate(nic, 1).step_s


def test_stragglers_grow_slowly_with_n() -> None:
    assert straggler_factor(1, 0.05) == 1.0
    # Exact expected maxima of n standard normals: 0.5642 (n=2), 2.5076 (n=100), 3.0367 (n=500).
    assert straggler_factor(2, 1.0) - 1 == pytest.approx(0.5642, abs=0.03)
    assert straggler_factor(100, 1.0) - 1 == pytest.approx(2.5076, abs=0.02)
    assert straggler_factor(500, 1.0) - 1 == pytest.approx(3.0367, abs=0.02)
    assert straggler_factor(16, 0.05) < straggler_factor(512, 0.05)


def test_efficiency_relative_to_a_baseline_count() -> None:
    sc = _scenario()
    r = simulate(sc, 64, baseline_gpus=8)
    assert r.efficiency == pytest.approx(simulate(sc, 8).step_s / r.step_s)
    assert simulate(sc, 8, baseline_gpus=8).efficiency == 1.0


@pytest.mark.parametrize(
    "kw",
    [{"compute_s": 0.0}, {"wire_bytes": 3}, {"inter": "torus"}, {"ps_shards": 0}, {"strategy": "gossip"},
     {"backward_fraction": 1.0}, {"backward_fraction": -0.1}, {"backward_fraction": float("nan")},
     {"jitter_cv": -0.1}],
)
def test_bad_scenarios_are_config_errors(kw: dict[str, object]) -> None:
    base: dict[str, object] = dict(layers=tuple(from_param_count(10)), compute_s=0.1, topology=TOPO)
    base.update(kw)
    with pytest.raises(ConfigError):
        Scenario(**base)  # type: ignore[arg-type]


def test_bad_links_and_topologies_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        Link("x", 0.0, 0.5, 1e-6)
    with pytest.raises(ConfigError):
        Link("x", 1e9, 1.5, 1e-6)
    with pytest.raises(ConfigError):
        Topology(0, TOPO.intra, TOPO.inter)
    with pytest.raises(ConfigError):
        simulate(_scenario(), 0)
