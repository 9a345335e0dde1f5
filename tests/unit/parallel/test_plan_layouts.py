"""ringtrain plan for model parallelism: memory, step time, bubble, recommendation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringtrain.errors import ConfigError
from ringtrain.plan.cli import main, parse_layout
from ringtrain.plan.network import Topology, intra_link, link
from ringtrain.plan.parallelism import (
    LayoutChoice,
    ModelSpec,
    bubble_fraction,
    layouts,
    predict,
    recommend,
)

TOPO = Topology(8, intra_link("nvlink-a100"), link("100gbit"))
SPEC = ModelSpec(params=1_000_000_000, layers=24, hidden=2048, heads=16, seq=1024)


def _predict(p: int, t: int, d: int, shard: bool = True, m: int = 8, **kw: object):
    return predict(SPEC, LayoutChoice(p, t, d, shard, m if p > 1 else 1), compute_s=8.0,
                   global_batch=256, topology=TOPO, **kw)  # type: ignore[arg-type]


def test_bubble_fraction() -> None:
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(1, 1) == 0.0
    with pytest.raises(ConfigError):
        bubble_fraction(0, 4)


def test_state_is_sixteen_bytes_per_parameter_split_by_every_degree() -> None:
    one = _predict(1, 1, 1)
    assert one.state_bytes == 16 * SPEC.params
    assert _predict(1, 1, 8).state_bytes == pytest.approx(one.state_bytes / 8)
    assert _predict(1, 1, 8, shard=False).state_bytes == one.state_bytes
    assert _predict(2, 2, 2).state_bytes == pytest.approx(one.state_bytes / 8)


def test_the_pipeline_adds_its_bubble_to_the_compute() -> None:
    pred = _predict(2, 1, 4, m=8)
    assert pred.compute_s == pytest.approx(8.0 / 8)
    assert pred.bubble_s == pytest.approx(pred.compute_s / 8)  # (p-1)/m of the compute
    assert pred.schedule_bubble == pytest.approx(1 / 9)
    assert 0 < pred.bubble_share < 1 / 9 + 1e-9  # communication makes the step longer


def test_sharding_costs_traffic_replication_costs_memory() -> None:
    shard, repl = _predict(1, 1, 8), _predict(1, 1, 8, shard=False)
    assert shard.shard_s > 0 and repl.shard_s == 0 and repl.data_s > 0
    assert shard.memory_bytes < repl.memory_bytes


def test_tensor_groups_across_hosts_use_the_slow_link() -> None:
    inside = predict(SPEC, LayoutChoice(1, 8, 1, False, 1), compute_s=8.0, global_batch=256,
                     topology=TOPO)
    across = predict(SPEC, LayoutChoice(1, 8, 1, False, 1), compute_s=8.0, global_batch=256,
                     topology=Topology(4, intra_link("nvlink-a100"), link("100gbit")))
    assert across.tensor_s > 5 * inside.tensor_s


def test_1f1b_holds_fewer_microbatches_than_gpipe() -> None:
    f1b = predict(SPEC, LayoutChoice(4, 1, 2, True, 16, "1f1b"), compute_s=8.0,
                  global_batch=256, topology=TOPO)
    gpipe = predict(SPEC, LayoutChoice(4, 1, 2, True, 16, "gpipe"), compute_s=8.0,
                    global_batch=256, topology=TOPO)
    assert f1b.activation_bytes is not None and gpipe.activation_bytes is not None
    assert gpipe.activation_bytes == pytest.approx(4 * f1b.activation_bytes)


def test_candidate_layouts_respect_hosts_heads_and_layers() -> None:
    cands = layouts(64, ModelSpec(params=10**9, layers=4, heads=12), gpus_per_host=8)
    assert cands and all(c.gpus == 64 for c in cands)
    assert all(c.tensor <= 8 and 12 % c.tensor == 0 and c.pipeline <= 4 for c in cands)
    assert not any(c.data == 1 and c.shard for c in cands)


def test_recommend_picks_a_fitting_layout_and_none_when_nothing_fits() -> None:
    big = ModelSpec(params=20_000_000_000, layers=48, hidden=6144, heads=48, seq=512)
    best = recommend(big, 64, device_memory=80 * 2**30, compute_s=600.0, global_batch=512,
                     topology=TOPO)
    assert best and all(p.fits for p in best)
    assert best[0].step_s <= min(p.step_s for p in best) * 1.01
    # 20B parameters need 320 GB of state: on 8 x 16 GB devices nothing fits.
    assert recommend(big, 8, device_memory=16 * 2**30, compute_s=600.0, global_batch=512,
                     topology=TOPO) == []


def test_parse_layout() -> None:
    assert parse_layout("2x4X8") == (2, 4, 8)
    with pytest.raises(ConfigError, match="PxTxD"):
        parse_layout("2x4")


_ARGS = ["--parallel", "--params", "1B", "--layers", "24", "--hidden", "2048", "--heads", "16",
         "--seq", "1024", "--global-batch", "256", "--gpus", "16", "--gpus-per-host", "8",
         "--step-ms", "8000", "--intra", "nvlink-a100", "--network", "100gbit"]


def test_cli_recommends_a_layout(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    assert main([*_ARGS, "--device-memory", "40", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "recommended: --pipeline" in out and "layout (PxTxD)" in out
    rows = json.loads(out_json.read_text())
    assert rows and all(r["fits"] for r in rows)


def test_cli_predicts_one_layout_with_its_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_ARGS, "--layout", "2x2x4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "2x2x4 shard" in out and "(p-1)/(m+p-1) = 11.1%" in out


@pytest.mark.parametrize(("extra", "word"), [
    (["--layout", "2x2x2"], "uses 8 devices but --gpus is 16"),
    ([], "give --device-memory"),
    (["--layout", "2x2x4", "--microbatches", "3"], "multiple of"),
])
def test_cli_mistakes_are_one_line(extra: list[str], word: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert word in err and err.count("\n") == 1
