"""examples/gpt_parallel.py from the outside: any layout, the same training.

One process, then 2 pipeline stages x 2 sharded data ranks under ringrun: the same
final loss after 10 steps (within 1e-5), a quarter-ish of the state per rank, and
the samples/s lines the example promises.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hosts.harness import RINGRUN, assert_no_orphans, env_for, new_marker
from test_parallel_common import EXAMPLE, ROOT

ARGS = ["--steps", "10", "--seed", "3", "--log-every", "5"]


def _run(command: list[str], marker: str) -> dict[str, float]:
    run = subprocess.run(command, cwd=ROOT, env=env_for(marker), capture_output=True,
                         text=True, timeout=200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    loss = re.findall(r"final loss (\S+)", out)
    mib = re.findall(r"state MiB per rank (\S+)", out)
    assert len(loss) == 1 and len(mib) == 1, out  # printed once: by rank 0
    assert re.search(r"step 10 loss \d+\.\d+ samples/s \d+\.\d", out), out
    return {"loss": float(loss[0]), "mib": float(mib[0])}


@pytest.mark.timeout(300)
def test_pipeline_and_sharding_train_what_one_process_trains() -> None:
    marker = new_marker()
    alone = _run([sys.executable, str(EXAMPLE), *ARGS], marker)
    split = _run([RINGRUN, "-np", "4", "--oversubscribe", sys.executable, str(EXAMPLE), "--pipeline", "2",
                  "--shard", *ARGS], marker)
    print(f"one process: {alone}; 2 stages x 2 sharded: {split}")
    assert abs(split["loss"] - alone["loss"]) <= 1e-5
    # Half the model per stage, half of that per sharded rank (the stages are cut by
    # parameter count, so the larger one sets the figure).
    assert 0.2 <= split["mib"] / alone["mib"] <= 0.32
    assert_no_orphans(marker)


@pytest.mark.system  # the real mpirun (Debian's openmpi-bin)
@pytest.mark.timeout(300)
def test_the_example_runs_under_mpirun_and_torchrun_too() -> None:
    import shutil

    from hosts.harness import ensure_packages

    marker = new_marker()
    ensure_packages({"mpirun": "openmpi-bin"})
    mpirun = shutil.which("mpirun")
    assert mpirun is not None
    alone = _run([sys.executable, str(EXAMPLE), *ARGS], marker)
    under_mpi = _run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, str(EXAMPLE),
                      "--pipeline", "2", *ARGS], marker)
    under_torchrun = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(EXAMPLE), "--shard", *ARGS], marker)
    assert abs(under_mpi["loss"] - alone["loss"]) <= 1e-5
    assert abs(under_torchrun["loss"] - alone["loss"]) <= 1e-5
    assert_no_orphans(marker)
