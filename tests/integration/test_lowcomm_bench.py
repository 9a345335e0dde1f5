"""benchmarks/lowcomm.py end to end on 4 shaped hosts, with a few steps: the records the
issue asks for, the bytes each rank's card sent, and the planner's prediction beside the
measured step (ratios and counts, no times). Skips with the reason when not root."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import lowcomm  # noqa: E402
import shaped_hosts  # noqa: E402


@pytest.mark.system  # shaped network-namespace hosts
@pytest.mark.timeout(420)
def test_a_short_run_writes_the_records_and_diloco_sends_a_fraction(tmp_path: Path) -> None:
    reason = shaped_hosts.requirements()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "lowcomm.json"
    with warnings.catch_warnings():  # a kernel without netem and iptables: no added delay
        warnings.simplefilter("ignore", UserWarning)
        rc = lowcomm.main(["--steps", "20", "--rounds", "1", "--methods", "sync:1,diloco:10",
                           "--netns-prefix", "rtslc", "--netns-subnet", "10.213.72", "--json", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())
    runs = [r for r in records if not r.get("summary")]
    summary = {r["method"]: r for r in records if r.get("summary")}
    assert sorted((r["method"], r["sync_every"]) for r in runs) == [("diloco", 10), ("sync", 1)]
    for r in records:
        assert {"method", "sync_every", "wall_s_to_target", "bytes_per_rank", "final_loss"} <= set(r)
        assert r["meta"]["transport"] == "shaped-veth" and r["meta"]["link_mbit"] == 100.0
    sync, diloco = summary["sync"], summary["diloco"]
    # 20 steps of 6.9 MB (ring: 1.5 x 4.8 MB) against 2 syncs: the cards sent about 10x fewer
    # bytes (headers, acknowledgements and the first-step agreement on top of both).
    model = 1_199_882 * 4 * 1.5
    assert 20 * model <= sync["bytes_per_rank"] < 1.15 * 20 * model
    assert 7 < sync["bytes_per_rank"] / diloco["bytes_per_rank"] <= 10.5
    assert diloco["predicted_step_s"] and sync["predicted_step_s"]
    assert 0.5 < sync["predicted_step_s"] / sync["step_s"] < 2  # the same units, the same link
    assert not any(ns.startswith("rtslc") for ns in _namespaces())  # cleaned up


def test_without_root_the_benchmark_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(shaped_hosts.os, "geteuid", lambda: 1000)
    assert lowcomm.main(["--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "root" in err and "--loopback" in err


def test_the_summary_takes_medians_and_ratios_to_sync() -> None:
    def rec(method: str, h: int, to: float | None, nbytes: float, loss: float, step: float) -> dict:
        return {"method": method, "sync_every": h, "wall_s_to_target": to, "bytes_per_rank": nbytes,
                "final_loss": loss, "final_held_out_loss": loss, "step_s": step, "local_step_mean_s": None}
    records = [rec("sync", 1, 100.0, 1000.0, 0.10, 0.7), rec("sync", 1, 120.0, 1000.0, 0.12, 0.8),
               rec("sync", 1, 110.0, 1000.0, 0.11, 0.75), rec("diloco", 50, 10.0, 20.0, 0.105, 0.1),
               rec("diloco", 50, 12.0, 20.0, 0.115, 0.1), rec("diloco", 50, None, 20.0, 0.2, 0.1)]
    meta = {"rounds": 3, "target": 0.08, "steps": 600, "n": 4, "batch_per_rank": 4, "transport": "loopback"}
    summary, table = lowcomm.summarize(records, meta)
    d = next(s for s in summary if s["method"] == "diloco")
    assert d["wall_s_to_target"] is None  # a run that never reached it: no median
    assert d["fewer_bytes"] == pytest.approx(50.0)
    assert d["final_loss"] == pytest.approx(0.115) and d["final_loss_vs_sync"] == pytest.approx(0.115 / 0.11 - 1)
    assert "not reached" in table and "50.0x" in table


def test_the_planner_still_predicts_the_recorded_shaped_host_steps_within_a_fifth() -> None:
    """The committed run on the shaped hosts (benchmarks/lowcomm.json, docs/lowcomm.md),
    summarized again with today's planner: every method's step within 20% of the measured
    one, and the issue's ratios for DiLoCo H=50 (a change to the planner or the summary
    that moved these would show here, without re-running the 100 Mbit/s hosts)."""
    records = json.loads((BENCH / "lowcomm.json").read_text())
    runs = [r for r in records if not r.get("summary")]
    summary, _table = lowcomm.summarize(runs, runs[0]["meta"])
    assert {(s["method"], s["sync_every"]) for s in summary} == {
        ("sync", 1), ("localsgd", 10), ("localsgd", 50), ("diloco", 10), ("diloco", 50)}
    for s in summary:
        assert abs(s["planner_error"]) <= 0.2, s
    diloco = next(s for s in summary if (s["method"], s["sync_every"]) == ("diloco", 50))
    assert diloco["speedup_to_target"] >= 5 and diloco["fewer_bytes"] >= 40
    assert diloco["planner_says_periodic_pays"] and diloco["fastest_to_target"]
    assert "planner: DiLoCo pays; fastest to the target: diloco H=50 (agrees)" in _table


def test_on_loopback_at_64_samples_per_rank_the_planner_and_the_benchmark_pick_per_step_exchange() -> None:
    """The committed loopback run at a training batch (benchmarks/lowcomm_loopback2_b64.json:
    2 ranks, one per core, 64 samples each, the target by the sync-third rule): the planner
    advises per-step exchange, and synchronous training reached the target first in every
    round (DiLoCo and LocalSGD steps were barely shorter and needed more samples)."""
    records = json.loads((BENCH / "lowcomm_loopback2_b64.json").read_text())
    runs = [r for r in records if not r.get("summary")]
    meta = runs[0]["meta"]
    assert (meta["transport"], meta["n"], meta["batch_per_rank"], meta["target_rule"]) == (
        "loopback", 2, 64, "sync-third")
    summary, table = lowcomm.summarize(runs, meta)
    assert "planner: per-step exchange; fastest to the target: sync (agrees)" in table
    for s in summary:
        assert s["planner_says_periodic_pays"] is False
        assert abs(s["planner_error"]) <= 0.2, s
    for r in range(meta["rounds"]):
        times = {x["method"]: x["wall_s_to_target"] for x in runs if x["round"] == r}
        assert times["sync"] < min(times["diloco"], times["localsgd"]), (r, times)


def test_the_sync_third_target_is_the_sync_runs_loss_at_a_third_of_its_steps() -> None:
    curve = [[s, s / 10, 1.0 / s, 2.0] for s in (10, 20, 30, 40, 50, 60)]
    records = [{"method": "diloco", "curve": [[10, 1.0, 0.0, 0.0]]}, {"method": "sync", "curve": curve}]
    assert lowcomm.sync_third_target(records, 60) == pytest.approx(1 / 20)
    assert lowcomm.sync_third_target(records, 50) == pytest.approx(1 / 20)  # first at or after 16.7
    with pytest.raises(ValueError, match="needs the sync method"):
        lowcomm.sync_third_target(records[:1], 60)


def test_the_planner_still_predicts_the_recorded_one_rank_per_core_loopback_steps_within_a_fifth() -> None:
    """The committed loopback run with one rank per core (benchmarks/lowcomm_loopback2.json:
    2 ranks x 8 samples on this 2-core machine, docs/lowcomm.md) summarized again: the
    planner's ``loopback`` link puts every method's step within 20% of the measured one,
    which the 4-ranks-on-2-cores run (-6% to -42%) could not show."""
    records = json.loads((BENCH / "lowcomm_loopback2.json").read_text())
    runs = [r for r in records if not r.get("summary")]
    meta = runs[0]["meta"]
    assert (meta["transport"], meta["n"], meta["batch_per_rank"]) == ("loopback", 2, 8)
    summary, table = lowcomm.summarize(runs, meta)
    assert len(summary) == 5 and "2 ranks x 8 samples" in table
    for s in summary:
        assert abs(s["planner_error"]) <= 0.2, s


@pytest.mark.parametrize(("argv", "needle"), [
    (["--loopback", "--ranks", "1"], "--ranks must be >= 2 and --batch >= 1, got 1 and 4"),
    (["--loopback", "--batch", "0"], "--ranks must be >= 2 and --batch >= 1, got 4 and 0"),
    (["--loopback", "--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--loopback", "--methods", "sync"], "--methods: 'sync' is not METHOD:H"),
    (["--loopback", "--methods", "diloco:1"], "--methods: 'diloco:1' is not METHOD:H"),
    (["--loopback", "--methods", "sync:1,adam:5"], "--methods: 'adam:5' is not METHOD:H"),
    (["--loopback", "--eval-every", "10"], "--eval-every must be a multiple of every method's H"),
    (["--loopback", "--eval-every", "0", "--methods", "sync:1"], "--eval-every must be a multiple"),
    (["--loopback", "--methods", "diloco:10", "--target", "sync-third"], "--target sync-third needs sync:1"),
    (["--loopback", "--target", "low"], "--target must be a loss > 0 or sync-third, got 'low'"),
    (["--loopback", "--target", "nan"], "--target must be a loss > 0 or sync-third, got 'nan'"),
])
def test_settings_that_cannot_train_are_refused_in_one_line_before_anything_starts(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        lowcomm.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def _namespaces() -> list[str]:
    import subprocess

    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in res.stdout.splitlines() if line.split()]
