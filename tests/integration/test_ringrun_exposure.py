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
