"""horovodrun's elastic behaviour, scenario by scenario, the way Horovod's own elastic
integration tests run it (their test/integration/elastic_common.py is the spec): one
machine, ``localhost`` and ``127.0.0.1`` as two hosts, a discovery script whose answer
follows the epoch the job reached, ranks that raise or are killed at a given epoch and
batch. The script is tests/integration/scripts/hvd_elastic_scenarios.py (Horovod's API);
each epoch's rank 0 logs the world's size, the rank it was started as, its host and how
many worlds the state went through.

Horovod skips four of these for PyTorch (its issues 2030 and 2908); all run here. One
cheap scenario (every host blacklisted) is in the fast tier; the rest, 4-rank jobs of
10-40 s each, in ``make test-system``.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from hosts.harness import BIN, assert_no_orphans, env_for, new_marker

from ringtrain.launch.elastic.driver import HOROVOD_FAILED, HOROVOD_RESET_LIMIT

SCRIPT = Path(__file__).parent / "scripts" / "hvd_elastic_scenarios.py"
BOTH = ["localhost:2", "127.0.0.1:2"]


def _discovery(tmp: Path, log: Path, schedule: list[list[str]]) -> Path:
    """A script printing ``schedule[e]`` once ``e`` epochs are logged (the last one after)."""
    lines = ["#!/bin/sh", f'n=$(cat "{log}" 2>/dev/null | wc -l)']
    for i, hosts in enumerate(schedule):
        test = "if" if i == 0 else "elif"
        body = "; ".join(f"echo {h}" for h in hosts) or ":"
        if i < len(schedule) - 1:
            lines.append(f'{test} [ "$n" -lt {i + 1} ]; then {body}')
        else:
            lines.append(f"{'else' if i else 'if true; then'} {body}")
    lines.append("fi")
    path = tmp / "discover.sh"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


def _run(tmp: Path, flags: list[str], script_args: list[str], schedule: list[list[str]] | None = None,
         timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], list[dict[str, object]]]:
    log = tmp / "log.jsonl"
    hosts = ["--host-discovery-script", str(_discovery(tmp, log, schedule))] if schedule else []
    marker = new_marker()
    res = subprocess.run([str(BIN / "horovodrun"), *flags, *hosts, "python", str(SCRIPT), str(log),
                          *script_args], capture_output=True, text=True, timeout=timeout,
                         env=env_for(marker), cwd=tmp)
    assert_no_orphans(marker)
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return res, rows


def _shape(rows: list[dict[str, object]]) -> list[tuple[object, ...]]:
    return [(r["size"], r["start_rank"], r["hostname"], r["rendezvous"]) for r in rows]


def _ok(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # The launcher's own lines: a rank's stderr (the scheduled failure's traceback) comes
    # on the launcher's stderr too, `[N] `-prefixed.
    own = "\n".join(line for line in res.stderr.splitlines() if not re.match(r"\[\d+\] ", line))
    assert "Traceback" not in own and "c10d" not in res.stderr + res.stdout, res.stderr[-3000:]
    return res.stderr


@pytest.mark.system
@pytest.mark.timeout(300)
@pytest.mark.parametrize("slots", [2, 1])
def test_hosts_added_and_removed(tmp_path: Path, slots: int) -> None:
    """localhost, then localhost + 127.0.0.1, then 127.0.0.1 only: the job grows at the
    commit after the host is listed and shrinks when localhost (with rank 0) is no longer
    listed; the survivor started on 127.0.0.1 is rank 0 from then on."""
    res, rows = _run(tmp_path, ["-np", str(slots), "--min-np", str(slots), "--max-np", str(2 * slots)],
                     ["--wait-for-hosts-after", "0,1"],
                     [[f"localhost:{slots}"], [f"localhost:{slots}", f"127.0.0.1:{slots}"],
                      [f"127.0.0.1:{slots}"]])
    err = _ok(res)
    assert _shape(rows) == [(slots, 0, "localhost", 1), (2 * slots, 0, "localhost", 2),
                            (slots, slots, "127.0.0.1", 3)]
    assert "the discovery script no longer lists localhost" in err


@pytest.mark.system
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["exception", "kill"])
@pytest.mark.parametrize("listed", ["discovery", "fixed"])
def test_single_rank_failure(tmp_path: Path, mode: str, listed: str) -> None:
    """Every slot from the start (4 ranks); rank 0 fails at epoch 1: its host (with
    rank 1) is blacklisted and the job goes on with 127.0.0.1's two ranks. 'fixed' is
    Horovod's fault tolerance without scaling (-H, no discovery script)."""
    flags = ["-np", "2", "--min-np", "2"]
    if listed == "fixed":
        res, rows = _run(tmp_path, [*flags, "-H", ",".join(BOTH)],
                         ["--exit-at", "1,0:0", "--exit-mode", mode])
    else:
        res, rows = _run(tmp_path, [*flags, "--max-np", "4"], ["--exit-at", "1,0:0", "--exit-mode", mode],
                         [BOTH])
    err = _ok(res)
    assert _shape(rows) == [(4, 0, "localhost", 1), (2, 2, "127.0.0.1", 2), (2, 2, "127.0.0.1", 2)]
    # one line each: what was lost and the new size (ringrun's and the new rank 0's)
    assert re.search(r"re-forming to 2 rank\(s\) on 127\.0\.0\.1:2 as world 1 \(lost rank 0 on localhost", err)
    assert re.search(r"\[2\] \[ringtrain rank 0\] WARNING lost rank 0 on localhost; world 1 has 2 rank\(s\); "
                     r"training goes on from the last commit\n", res.stdout + res.stderr)


@pytest.mark.system
@pytest.mark.timeout(200)
def test_all_ranks_failure(tmp_path: Path) -> None:
    res, rows = _run(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "4"],
                     ["--exit-at", "1,0:0,1,2,3"], [BOTH])
    assert res.returncode != 0 and HOROVOD_FAILED in res.stderr, res.stderr[-3000:]
    assert _shape(rows) == [(4, 0, "localhost", 1)]


@pytest.mark.timeout(200)
def test_all_hosts_blacklisted(tmp_path: Path) -> None:
    """A rank fails on each host: both are blacklisted, no rank is left: the job ends
    non-zero at once (not after --elastic-timeout's 600 s)."""
    res, rows = _run(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "4"], ["--exit-at", "1,0:0,2"],
                     [BOTH], timeout=150)
    assert res.returncode != 0 and HOROVOD_FAILED in res.stderr, res.stderr[-3000:]
    assert _shape(rows) == [(4, 0, "localhost", 1)]


@pytest.mark.system
@pytest.mark.timeout(200)
def test_min_hosts_timeout(tmp_path: Path) -> None:
    """--min-np 4 and a host blacklisted: fewer than 4 are left; the job waits
    --elastic-timeout (1 s) for hosts, then ends with Horovod's message."""
    res, rows = _run(tmp_path, ["-np", "2", "--min-np", "4", "--max-np", "4", "--elastic-timeout", "1"],
                     ["--exit-at", "1,0:0"], [BOTH])
    assert res.returncode != 0 and HOROVOD_FAILED in res.stderr, res.stderr[-3000:]
    assert "within --elastic-timeout 1 s" in res.stderr
    assert _shape(rows) == [(4, 0, "localhost", 1)]


@pytest.mark.system
@pytest.mark.timeout(400)
def test_reset_limit(tmp_path: Path) -> None:
    """Grow, then shrink: two re-formations. --reset-limit 1 ends the job at the second
    with Horovod's message; --reset-limit 2 lets it finish."""
    schedule = [["localhost:2"], BOTH, ["127.0.0.1:2"]]
    flags = ["-np", "2", "--min-np", "2", "--max-np", "4", "--reset-limit"]
    (tmp_path / "one").mkdir()
    res, rows = _run(tmp_path / "one", [*flags, "1"], ["--wait-for-hosts-after", "0,1"], schedule)
    assert res.returncode != 0, res.stderr[-3000:]
    assert HOROVOD_RESET_LIMIT.format(1) in res.stderr
    (tmp_path / "two").mkdir()
    res, rows = _run(tmp_path / "two", [*flags, "2"], ["--wait-for-hosts-after", "0,1"], schedule)
    _ok(res)
    assert [r["size"] for r in rows] == [2, 4, 2]


@pytest.mark.system
@pytest.mark.timeout(400)
def test_blacklisted_host_comes_back_with_exponential_backoff(tmp_path: Path) -> None:
    """--blacklist-cooldown-range 1 2: the host of a failed rank comes back after 1-2 s
    and the job grows onto it again; its next failure blacklists it for longer."""
    res, rows = _run(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "4",
                                "--blacklist-cooldown-range", "1", "2"],
                     ["--epochs", "6", "--exit-at", "1,0:3;4,0:3", "--wait-for-hosts-after", "2"], [BOTH])
    err = _ok(res)
    assert [r["size"] for r in rows] == [4, 2, 2, 4, 2, 2]
    waits = [float(w) for w in re.findall(r"on 127\.0\.0\.1\) .*\(blacklisted for ([\d.]+) s\)", err)]
    assert len(waits) == 2 and 1 <= waits[0] <= 2 and waits[1] == 2, err[-3000:]
    assert "host 127.0.0.1 is no longer blacklisted" in err
