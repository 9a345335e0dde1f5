"""rt.init() inside the real mpirun (Debian openmpi-bin): ranks, sizes and an allreduce."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from hosts.harness import assert_no_orphans, ensure_packages, env_for, new_marker

pytestmark = pytest.mark.system  # `make test-system`: see docs/testing.md

SCRIPT = """
import torch, ringtrain as rt
w = rt.init()
total = rt.allreduce(torch.tensor([float(rt.rank() + 1)]), op=rt.Sum).item()
print(f"rank={rt.rank()} size={rt.size()} local={rt.local_rank()}/{rt.local_size()} "
      f"cross={rt.cross_rank()}/{rt.cross_size()} launcher={w.env.launcher} sum={total:g}", flush=True)
rt.shutdown()
"""


@pytest.mark.timeout(120)
def test_rt_init_works_under_mpirun() -> None:
    ensure_packages({"mpirun": "openmpi-bin"})
    mpirun = shutil.which("mpirun")
    assert mpirun is not None
    marker = new_marker()
    res = subprocess.run(
        [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "python", "-c", SCRIPT],
        capture_output=True, text=True, timeout=100, env=env_for(marker),
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    # mpirun forwards each rank's output in chunks of its own choosing, so two ranks'
    # lines can arrive joined: find the reports wherever they are.
    lines = sorted(re.findall(r"rank=\d+ size=\d+ local=\d+/\d+ cross=\d+/\d+ launcher=\w+ sum=\d+",
                              res.stdout))
    assert lines == [
        "rank=0 size=2 local=0/2 cross=0/1 launcher=mpirun sum=3",
        "rank=1 size=2 local=1/2 cross=0/1 launcher=mpirun sum=3",
    ]
    assert_no_orphans(marker)
