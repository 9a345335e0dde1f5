"""A job confined to one host listens on loopback only (rendezvous store and Gloo alike).

The multi-host counterpart (listeners only on the chosen addresses) is in
test_ringrun_hosts.py.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from hosts.harness import HERE, RINGRUN, assert_no_orphans, env_for, new_marker
from hosts.sockets import listening_addresses


@pytest.mark.timeout(90)
def test_one_host_job_listens_only_on_loopback() -> None:
    marker = new_marker()
    proc = subprocess.Popen([RINGRUN, "-np", "2", "python", str(HERE / "listen_worker.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_for(marker))
    try:
        assert proc.stdout is not None
        ready = 0
        deadline = time.monotonic() + 80
        while ready < 2 and time.monotonic() < deadline:
            ready += proc.stdout.readline().rstrip().endswith("ready")
        assert ready == 2
        found = listening_addresses(marker)
        assert found, "the job listens nowhere?"
        assert all(addr.startswith("127.") or addr == "::1" for addr, _ in found), found
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert_no_orphans(marker)


@pytest.mark.timeout(120)
def test_ranks_get_a_per_job_secret_that_differs_between_jobs() -> None:
    import subprocess
    import sys

    code = "import os; print('secret', os.environ.get('RINGTRAIN_JOB_SECRET', ''))"
    seen = []
    for _ in range(2):
        res = subprocess.run([RINGRUN, "-np", "2", sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        secrets = {line.split()[-1] for line in res.stdout.splitlines() if "secret" in line}
        assert len(secrets) == 1 and len(next(iter(secrets))) == 32  # the same for the job's ranks
        seen.append(next(iter(secrets)))
    assert seen[0] != seen[1]
