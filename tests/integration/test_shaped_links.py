"""The allreduce benchmark on shaped links: 2 namespace hosts, one small measurement.

Builds two hosts whose veth links tc shapes to 100 Mbit/s (prefix ``rtsht``,
10.213.71.0/24: apart from tests/hosts and from a benchmark run with the defaults),
runs one round of every algorithm at 1 MB and checks the JSON records and that the
shaper holds: busbw is compared with the configured rate, a ratio, not a time. Skips
with the reason when not root or without iproute2.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import allreduce  # noqa: E402
import shaped_hosts  # noqa: E402

MBIT = 100.0


@pytest.mark.system  # shaped network-namespace hosts
@pytest.mark.timeout(60)
def test_two_shaped_hosts_write_records_and_respect_the_rate(tmp_path: Path) -> None:
    reason = shaped_hosts.requirements()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "shaped.json"
    with warnings.catch_warnings():  # a kernel without netem: links without added delay
        warnings.simplefilter("ignore", UserWarning)
        rc = allreduce.main(["--shaped-hosts", "2", "--link-mbit", str(MBIT), "--sizes", str(1 << 20),
                             "--rounds", "1", "--budget", "0.05", "--netns-prefix", "rtsht",
                             "--netns-subnet", "10.213.71", "--json", str(out),
                             "--png", str(tmp_path / "shaped.png")])
    assert rc == 0
    records = json.loads(out.read_text())
    assert isinstance(records, list)
    assert sorted(r["algorithm"] for r in records) == ["native", "ps1", "psN", "ring"]
    for r in records:
        assert {"algorithm", "n", "bytes", "seconds"} <= set(r)
        assert r["n"] == 2 and r["bytes"] == 1 << 20 and r["seconds"] > 0
        # The link carries at most its rate (TCP payload is ~95% of it), and the exchange
        # is limited by the link rather than by anything else.
        assert r["busbw_link"] < 1.05, r
        if r["algorithm"] in ("native", "ring"):
            assert r["busbw_link"] > 0.3, r
    assert (tmp_path / "shaped.png").stat().st_size > 0
    assert not any(ns.startswith("rtsht") for ns in _namespaces())  # cleaned up


def test_without_root_the_benchmark_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(shaped_hosts.os, "geteuid", lambda: 1000)
    assert allreduce.main(["--shaped-hosts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "root" in err


def _namespaces() -> list[str]:
    import subprocess

    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in res.stdout.splitlines() if line.split()]


@pytest.mark.system  # shaped network-namespace hosts
@pytest.mark.timeout(90)
def test_links_get_the_fixed_delay_and_a_dead_delay_line_is_named() -> None:
    """5 ms one way: every round trip pays at least 10 ms (netem, or the delay line on a
    kernel without it); a delay line that dies ends a job with its name, not a hang."""
    reason = shaped_hosts.requirements()
    if reason:
        pytest.skip(reason)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no silent fallback to no delay
        hosts = shaped_hosts.build(2, 100.0, 5.0, prefix="rtshd", subnet="10.213.72")
    try:
        assert hosts.delay_ms == 5.0 and ("netem" in hosts.qdisc or "delay line" in hosts.qdisc)
        rtt = shaped_hosts.probe_rtt(hosts, count=15)
        assert rtt[0] >= 10.0, rtt  # both directions delayed, none skipped
        assert rtt[len(rtt) // 2] < 10.0 + 8.0, rtt  # the delay, not the delay plus a stall
        if hosts.delay_lines:
            hosts.delay_lines[1].kill()
            with pytest.raises(shaped_hosts.ShapedHostsError, match="delay line of rtshd2"):
                shaped_hosts.launch(hosts, [sys.executable, "-c", "import time; time.sleep(60)"],
                                    timeout_s=30)
    finally:
        shaped_hosts.teardown(hosts)
    assert all(p.poll() is not None for p in hosts.delay_lines)
    assert not any(ns.startswith("rtshd") for ns in _namespaces())
