"""`ringtrain plan --lowcomm`: the step of each mode, and where exchanging every H steps pays."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from ringtrain.errors import ConfigError
from ringtrain.plan import FRAMEWORKS, Scenario, Topology, from_param_count, intra_link, link
from ringtrain.plan.cli import main
from ringtrain.plan.cost import ring_allreduce
from ringtrain.plan.lowcomm import LADDER, PAYS_SHARE, mode_costs, recommend
from ringtrain.plan.network import with_rtt

PARAMS = 1_199_882  # the article's CNN
SLOW = with_rtt(link("100mbit"), 2.5)


def scenario(inter: object = SLOW, compute: float = 0.07, jitter: float = 0.0) -> Scenario:
    return Scenario(tuple(from_param_count(PARAMS, layers=1)), compute,
                    Topology(1, intra_link("pcie3"), inter), "ring", FRAMEWORKS["flat"],  # type: ignore[arg-type]
                    jitter_cv=jitter)


def test_each_mode_costs_compute_plus_its_share_of_one_ring_exchange() -> None:
    costs = mode_costs(scenario(), 4, [10, 50])
    ring = ring_allreduce(PARAMS * 4, 4, SLOW.alpha_s, SLOW.bandwidth)
    assert ring == pytest.approx(6 * 2.5e-3 + 1.5 * PARAMS * 4 / (100e6 / 8 * 0.8))
    sync, *periodic = costs
    assert (sync.mode, sync.sync_every) == ("sync", 1)
    assert sync.step_s == pytest.approx(0.07 + ring)  # one flat exchange after backward
    assert [(c.mode, c.sync_every) for c in periodic] == [("localsgd", 10), ("localsgd", 50),
                                                          ("diloco", 10), ("diloco", 50)]
    for c in periodic:
        assert c.step_s == pytest.approx(0.07 + ring / c.sync_every)
        assert c.peak_step_s == pytest.approx(0.07 + ring)
        assert c.bytes_per_step == pytest.approx(1.5 * PARAMS * 4 / c.sync_every)
        assert c.speedup == pytest.approx(sync.step_s / c.step_s)
    assert sync.bytes_per_step == pytest.approx(1.5 * PARAMS * 4)


def test_fragments_cut_the_longest_step_not_the_mean() -> None:
    one, four = mode_costs(scenario(), 4, [20])[1], mode_costs(scenario(), 4, [20], fragments=4)[1]
    assert four.step_s == pytest.approx(one.step_s)
    assert four.peak_step_s - 0.07 == pytest.approx(
        ring_allreduce(PARAMS * 4 / 4, 4, SLOW.alpha_s, SLOW.bandwidth))
    with pytest.raises(ConfigError, match="fragments=30 is more than sync_every=20"):
        mode_costs(scenario(), 4, [20], fragments=30)


def test_stragglers_weigh_less_when_ranks_meet_every_h_steps() -> None:
    sc = scenario(jitter=0.04)
    sync, h10 = mode_costs(sc, 16, [10])[:2]
    assert sync.compute_s > h10.compute_s > 0.07
    assert h10.compute_s - 0.07 == pytest.approx((sync.compute_s - 0.07) / math.sqrt(10))


def test_on_a_slow_link_diloco_pays_and_the_h_keeps_the_exchange_under_a_tenth() -> None:
    advice = recommend(scenario(), 4)
    assert advice.pays and advice.sync_share > PAYS_SHARE
    # ring 15 ms + 1.5 x 4.8 MB at 10 MB/s = 0.735 s against 70 ms of compute: 0.735 / H
    # <= 7 ms fails at H = 100 (7.35 ms) and first holds at H = 200.
    assert advice.sync_every == 200
    assert "DiLoCo pays" in advice.text and "sync_every=200" in advice.text


def test_on_loopback_per_step_exchange_is_the_choice() -> None:
    advice = recommend(scenario(link("loopback")), 4)
    assert not advice.pays and advice.sync_every is None and advice.sync_share < 0.2
    assert advice.text.startswith("per-step exchange")
    # the break-even it states is the best periodic step's speed-up over per-step exchange
    best = max(c.speedup for c in mode_costs(scenario(link("loopback")), 4, LADDER, modes=("diloco",))[1:])
    assert f"fewer than {best:.2f}x the samples" in advice.text and 1 < best < 1.25


def test_one_rank_has_nothing_to_exchange() -> None:
    assert not recommend(scenario(), 1).pays


def test_networks_in_mbit_and_a_round_trip() -> None:
    assert link("100mbit").line_rate == pytest.approx(100e6 / 8)
    assert link("100mbit").name == "100mbit"
    assert with_rtt(link("1gbit"), 3.0).alpha_s == pytest.approx(3e-3)
    with pytest.raises(ConfigError, match="rtt"):
        with_rtt(link("1gbit"), -1.0)


def test_cli_prints_a_table_per_rank_count_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lc.json"
    rc = main(["--lowcomm", "--model", "custom", "--params", "1.2M", "--step-ms", "70", "--gpus", "2,4",
               "--gpus-per-host", "1", "--network", "100mbit", "--rtt-ms", "2.5", "--sync-every", "10,50",
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert text.count("advice: DiLoCo pays") == 2 and "2 ranks" in text and "4 ranks" in text
    rows = json.loads(out.read_text())
    assert {(r["mode"], r["sync_every"]) for r in rows} == {("sync", 1), ("localsgd", 10), ("localsgd", 50),
                                                           ("diloco", 10), ("diloco", 50)}
    assert all(r["pays"] for r in rows)


@pytest.mark.parametrize("args,words", [
    (["--sync-every", "10,x"], "--sync-every"),
    (["--sync-every", "0"], "--sync-every '0': give whole numbers >= 1"),
    (["--strategy", "ps"], "--lowcomm compares allreduce"),
    (["--rtt-ms", "-2"], "--rtt-ms"),
])
def test_cli_mistakes_are_one_line(args: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--lowcomm", "--model", "custom", "--params", "1M", "--step-ms", "50", "--gpus", "4",
               "--network", "100mbit", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and words in err


def test_the_fragment_flag_reaches_the_peak() -> None:
    sc = replace(scenario(), framework=FRAMEWORKS["ddp"])
    assert mode_costs(sc, 4, [10], fragments=2)[1].peak_step_s < mode_costs(sc, 4, [10])[1].peak_step_s
