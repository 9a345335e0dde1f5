"""Loader workers and the death of their training process: workers whose training
process died mid-batch exit without a word, as DataLoader's do (no traceback on the
terminal of a job killed by SIGKILL or SIGTERM); workers whose training process lives
stay, whichever process started them (a fork server's are not orphans)."""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
import sys
import time

import numpy as np
import pytest
import torch
from ringtest import PRELOAD
from torch.utils.data import TensorDataset

from ringtrain.data import Loader


class WaitsForOrphan:
    """Batch 0 (samples 0-3) loads at once; a later sample is returned only once the
    training process that forked this worker is gone, so the worker answers a dead one."""

    def __init__(self) -> None:
        self.trainer = os.getpid()  # made in the training process

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> np.ndarray:
        if i >= 4:
            deadline = time.monotonic() + 20
            while os.getppid() == self.trainer and time.monotonic() < deadline:
                time.sleep(0.01)
        return np.full(4, i, np.float32)


def _training_process(err_w: int, ready_w: int) -> None:
    """The body of the forked training process; never returns."""
    code = 1
    try:
        os.dup2(err_w, 2)  # the workers inherit it: what they print comes to the test
        # pytest's capture replaced sys.stderr by its own file: write to fd 2 again.
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        loader = Loader(WaitsForOrphan(), batch_size=4, num_workers=2, device="cpu",
                        shuffle=False)
        it = iter(loader)
        next(it)
        os.write(ready_w, " ".join(map(str, loader.worker_pids)).encode() + b"\n")
        next(it)  # the workers hold batch 1 until this process is killed
        code = 0
    finally:
        os._exit(code)


def _read_until_eof(fd: int, timeout: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            return out
        out += chunk
    raise AssertionError(f"the workers still held stderr after {timeout} s; so far: {out!r}")


@pytest.mark.timeout(60)
def test_workers_of_a_killed_training_process_exit_silently() -> None:
    err_r, err_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(err_r)
        os.close(ready_r)
        _training_process(err_w, ready_w)
    os.close(err_w)
    os.close(ready_w)
    try:
        with os.fdopen(ready_r) as ready:
            pids = [int(p) for p in ready.readline().split()]
        assert len(pids) == 2
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        # EOF once every worker has exited (each holds the pipe as its stderr).
        printed = _read_until_eof(err_r, timeout=20)
    finally:
        os.close(err_r)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    assert b"Traceback" not in printed and b"BrokenPipeError" not in printed, printed.decode()
    assert printed == b"", printed.decode()


@pytest.mark.system  # `make test-system`: a fork server and an idle second and a half, ~5 s
@pytest.mark.timeout(60)
def test_forkserver_workers_stay_through_an_idle_second() -> None:
    # A forkserver worker's parent is the fork server, not the training process: taken
    # for an orphan at its first idle second (the loop in a long step, an evaluation,
    # between epochs), it exited and the next batch was a WorkerDiedError.
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # warm, as ringtest's
    data = TensorDataset(torch.arange(8))
    with Loader(data, batch_size=4, num_workers=1, device="cpu", shuffle=False,
                start_method="forkserver") as loader:
        first = [b[0].tolist() for b in loader]
        pids = loader.worker_pids
        time.sleep(1.5)  # the worker looks for its parent after each idle second
        second = [b[0].tolist() for b in loader]
        assert loader.worker_pids == pids
    assert first == second == [[0, 1, 2, 3], [4, 5, 6, 7]]
