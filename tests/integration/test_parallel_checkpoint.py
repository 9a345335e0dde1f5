"""Sharded checkpoints are atomic: a kill -9 during a save leaves the previous one.

(Saving at one layout and loading at another is in test_parallel_sharding.py.)
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ringtest import run_world
from test_parallel_common import (
    LR,
    assert_identical,
    build,
    global_batches,
    local_batch,
    quiet,
)

from ringtrain import checkpoint

# -- kill -9 during a save -----------------------------------------------------------------

BLOB_MB = 64  # per rank: the second save takes long enough to be caught in the middle


def save_twice(directory: str) -> None:
    """Save A, record it, then start a large save B over it (the test kills us during B)."""
    quiet()
    root = Path(directory)
    par = build({"shard": True})
    (root / f"pid-{par.rank}").write_text(str(os.getpid()))
    opt = torch.optim.AdamW(par.parameters(), lr=LR, weight_decay=0.0)
    data = global_batches(2, 8, 16)
    par.step(*local_batch(par, data[0]), optimizer=opt)
    par.save(str(root / "ck.dcp"), opt)
    params = par.full_parameters()
    if par.rank == 0:
        torch.save(params, root / "a-params.pt")
        (root / "a-done").write_text("")
    par.step(*local_batch(par, data[1]), optimizer=opt)
    blob = torch.full((BLOB_MB * 2**18,), float(par.rank))  # a key of its own on each rank
    par.save(str(root / "ck.dcp"), opt, extra={f"blob-{par.rank}": blob})
    time.sleep(60)  # not reached in the test: it kills us first


@pytest.mark.timeout(240)
def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    errors: list[Any] = []
    world = threading.Thread(
        target=lambda: errors.extend(run_world(save_twice, 2, str(tmp_path), timeout=200,
                                               expect_failure=True)))
    world.start()
    deadline = time.monotonic() + 180
    while not (tmp_path / "a-done").exists() or not list(tmp_path.glob("ck.dcp.tmp-*")):
        assert world.is_alive(), f"the world ended before the second save: {errors}"
        assert time.monotonic() < deadline, "the second save never started"
        time.sleep(0.002)
    for rank in (0, 1):
        os.kill(int((tmp_path / f"pid-{rank}").read_text()), signal.SIGKILL)
    world.join(60)
    assert not world.is_alive()
    assert list(tmp_path.glob("ck.dcp.tmp-*")), "the kill came after the save had finished"

    # The previous checkpoint is there, complete, and loads with A's exact parameters.
    assert checkpoint.latest(tmp_path, "*.dcp") == tmp_path / "ck.dcp"
    checkpoint.verify_sharded(tmp_path / "ck.dcp")
    quiet()
    par = build({}, seed=1)
    par.load(str(tmp_path / "ck.dcp"))
    assert_identical(par.full_parameters(), torch.load(tmp_path / "a-params.pt"))

    # The next save over it clears what the killed one left.
    par.save(str(tmp_path / "ck.dcp"))
    assert not list(tmp_path.glob("ck.dcp.tmp-*"))
