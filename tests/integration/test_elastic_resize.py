"""Resizable jobs on this host (``--min-np/--max-np``): a rank that dies is dropped and the
others go on at the smaller size, in the same processes, from the last commit in memory.

Each job runs 3 ranks on localhost; one SIGKILLs itself mid-epoch (``RESIZE_KILL``).
Checked: the job ends 0 without a restart, the survivors ran at sizes [3, 2], the
reset callback set the rate for 2, and every sample of every epoch was trained on
exactly once. The multi-host scenario (a whole host lost, then back) is in
test_elastic_resize_hosts.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from hosts.harness import RINGRUN, assert_no_orphans, env_for, new_marker

SCRIPTS = Path(__file__).parent / "scripts"


def _exactly_once(seen: dict[str, list[int]], samples: int, epochs: int) -> None:
    assert sorted(map(int, seen)) == list(range(epochs))
    for epoch, ids in seen.items():
        assert sorted(ids) == list(range(samples)), f"epoch {epoch}: a sample lost or repeated"


# `make test` shrinks the rt.elastic job below (the same driver, the same in-place reset)
# and runs hvd.elastic through a killed worker (test_horovod_training.py); this job and
# horovodrun's elastic scenarios are hvd.elastic's in-place shrink (system tier).
@pytest.mark.system
@pytest.mark.timeout(300)
def test_horovod_job_shrinks_in_place_when_a_rank_dies(tmp_path: Path) -> None:
    """A Horovod elastic script under ringrun --min-np/--max-np loses rank 2 mid-epoch and
    goes on with the two others of the same host (ringrun's rule; under horovodrun the
    host would leave with its ranks, as in Horovod: test_horovodrun_elastic.py)."""
    marker = new_marker()
    out = tmp_path / "out.json"
    res = subprocess.run(
        [RINGRUN, "-np", "3", "--min-np", "2", "--max-np", "3", "-H", "localhost:3",
         "python", str(SCRIPTS / "hvd_elastic_resize.py"), str(out), "--epochs", "2"],
        capture_output=True, text=True, timeout=280, env=env_for(marker, RESIZE_KILL="2:10"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "restarting" not in res.stderr
    assert "elastic: worker 2 (rank 2" in res.stderr and "was killed by SIGKILL" in res.stderr
    assert "world 1 formed: 2 rank(s)" in res.stderr
    got = json.loads(out.read_text())
    assert got["sizes"] == [3, 2]
    _exactly_once(got["seen"], got["samples"], 2)
    events = [json.loads(line) for line in Path(str(out) + ".events").read_text().splitlines()]
    resets = [e for e in events if e["event"] == "reset"]
    assert [(e["size"], e["lr"]) for e in resets] == [(2, 0.5 * 2)]  # the rate follows the size
    assert_no_orphans(marker)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharded", [
    pytest.param(False, id="map-style"),
    # the loader's re-cut of a sharded epoch is also checked without processes
    # (tests/unit/data/test_data_shardplan.py); the whole job in `make test-system`
    pytest.param(True, id="sharded", marks=pytest.mark.system),
])
def test_rt_elastic_job_shrinks_in_place_and_the_loader_resplits_the_epoch(
        tmp_path: Path, sharded: bool) -> None:
    marker = new_marker()
    out = tmp_path / "out.json"
    res = subprocess.run(
        [RINGRUN, "-H", "localhost:3", "--min-np", "2", "--max-np", "3", "python",
         str(SCRIPTS / "rt_elastic_resize.py"), str(out), str(tmp_path / "ckpt"),
         *(["--sharded"] if sharded else [])],
        capture_output=True, text=True, timeout=220, env=env_for(marker, RESIZE_KILL="1:10"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "world 1 formed: 2 rank(s)" in res.stderr
    got = json.loads(out.read_text())
    assert got["sizes"] == [3, 2] and got["lrs"] == [0.04] and got["size"] == 2
    _exactly_once(got["seen"], 96, 3)
    # 8 steps of epoch 0 and 2 of epoch 1 at 3 ranks, the other 72 samples of epoch 1 at 2
    # ranks (9 steps), epoch 2 at 2 ranks (12): nothing redone, nothing skipped (sharded:
    # the 3 ranks' unread 24 samples each are re-cut into 2 ranges of 36).
    assert got["steps"] == 8 + 2 + 9 + 12
    assert not list((tmp_path / "ckpt").glob("*.ckpt")), "a resize needs no checkpoint on disk"
    assert_no_orphans(marker)


@pytest.mark.system  # a third resizable job; the hook's semantics are in test_lowcomm.py
@pytest.mark.timeout(240)
def test_diloco_job_shrinks_in_place_and_syncs_one_model(tmp_path: Path) -> None:
    """rt.DiLoCo (sync_every=4) in the same script: rank 1 dies mid-interval (step 10, two
    steps after the sync at 8); the survivors go on from their last commit, keeping their
    local steps (test_lowcomm.py checks that part bit for bit), every sample is trained
    on once, and the final sync leaves one model on both ranks."""
    marker = new_marker()
    out = tmp_path / "out.json"
    res = subprocess.run(
        [RINGRUN, "-H", "localhost:3", "--min-np", "2", "--max-np", "3", "python",
         str(SCRIPTS / "rt_elastic_resize.py"), str(out), str(tmp_path / "ckpt"), "--diloco", "4"],
        capture_output=True, text=True, timeout=220, env=env_for(marker, RESIZE_KILL="1:10"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "world 1 formed: 2 rank(s)" in res.stderr
    got = json.loads(out.read_text())
    assert got["sizes"] == [3, 2] and got["size"] == 2
    _exactly_once(got["seen"], 96, 3)
    assert got["steps"] == 8 + 2 + 9 + 12
    assert len(got["digests"]) == 2 and len(set(got["digests"])) == 1
    assert got["syncs"] >= (9 + 12) // 4  # it kept syncing in the smaller world
    assert_no_orphans(marker)


@pytest.mark.system  # the rule itself is a driver scenario in test_launch_elastic_driver.py
@pytest.mark.timeout(180)
def test_fewer_ranks_than_min_np_end_the_job(tmp_path: Path) -> None:
    marker = new_marker()
    res = subprocess.run(
        [RINGRUN, "-H", "localhost:3", "--min-np", "3", "--max-np", "3", "python",
         str(SCRIPTS / "rt_elastic_resize.py"), str(tmp_path / "out.json"), str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=160, env=env_for(marker, RESIZE_KILL="0:5"))
    assert res.returncode == 128 + 9, res.stderr[-2000:]
    assert "2 rank(s) left, fewer than --min-np 3; stopping the job" in res.stderr
    assert "Traceback" not in res.stderr
    assert_no_orphans(marker)


@pytest.mark.system
@pytest.mark.timeout(240)
def test_rt_elastic_job_grows_in_place_when_the_discovery_script_lists_a_slot_more(tmp_path: Path) -> None:
    """Resumable takes a grow at a commit: the discovery script goes from localhost:2 to
    localhost:3 after step 4 of the first world, and the job goes on at 3 ranks, in the
    same processes plus the new one, which takes rank 0's state. Before, nothing asked
    at the commits: ringrun said "growing to 3 rank(s)" and the job ended at 2 (and
    with the grow taken, the first-step agreement's per-process counter made every rank
    a StallError: the new rank's check was #0, the others' #1)."""
    marker = new_marker()
    out = tmp_path / "out.json"
    flag = tmp_path / "grow"
    discover = tmp_path / "discover.sh"
    discover.write_text(f'#!/bin/sh\nif [ -e "{flag}" ]; then echo localhost:3; else echo localhost:2; fi\n')
    discover.chmod(0o755)
    res = subprocess.run(
        [RINGRUN, "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(discover), "python",
         str(SCRIPTS / "rt_elastic_resize.py"), str(out), str(tmp_path / "ckpt"), "--epochs", "3"],
        capture_output=True, text=True, timeout=220, env=env_for(marker, RESIZE_GROW=f"4:{flag}"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["sizes"] == [2, 3] and got["size"] == 3, (got["sizes"], res.stderr[-2000:])
    assert got["lrs"] == [pytest.approx(0.06)]  # the reset callback set the rate for 3
    for epoch, ids in got["seen"].items():  # the rest of an epoch re-cut for 3 ranks: at
        assert set(ids) == set(range(96)), epoch  # most a sample per rank padded once
        assert len(ids) - 96 < 3, epoch
    assert_no_orphans(marker)
