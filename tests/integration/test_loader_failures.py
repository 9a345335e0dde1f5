"""rt.data.Loader when things go wrong: errors, dead workers, hangs, cleanup."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ringtrain.data import Loader
from ringtrain.errors import DataError, WorkerDiedError, WorkerError

SRC = str(Path(__file__).resolve().parents[2] / "src")


class Faulty:
    """Raises, dies or hangs at chosen sample indices."""

    def __init__(self, n: int = 2000, raise_at: int = -1, die_at: int = -1,
                 hang_at: int = -1) -> None:
        self.n, self.raise_at, self.die_at, self.hang_at = n, raise_at, die_at, hang_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i == self.raise_at:
            raise ValueError(f"cannot decode sample {i}")
        if i == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
        if i == self.hang_at:
            time.sleep(3600)
        return np.full(4, i, np.float32), i


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[1].split()[0] != "Z":
                    alive.append(pid)
        except FileNotFoundError:
            pass
    return alive


def _worker_pids(loader: Loader) -> list[int]:
    return loader.worker_pids


def _shm() -> set[str]:
    """Shared-memory names a data loader could leak (other tests' semaphores excluded)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if n.startswith(("ringtrain", "torch_", "psm_"))}


@pytest.mark.timeout(60)
def test_worker_exception_is_reraised_with_traceback_and_index() -> None:
    loader = Loader(Faulty(raise_at=1234), batch_size=16, num_workers=2, device="cpu")
    it = iter(loader)
    got = [next(it)[1]]
    pids = _worker_pids(loader)
    with pytest.raises(WorkerError) as info:
        for _, i in it:
            got.append(i)
    msg = str(info.value)
    assert "ValueError at sample index 1234" in msg
    assert "cannot decode sample 1234" in msg and "Traceback" in msg
    assert "in __getitem__" in msg  # the worker's own traceback, naming the dataset frame
    assert "loader worker" in msg
    time.sleep(0.2)
    assert _alive(pids) == []  # the workers were stopped
    # the loader can be used again (fresh workers), and resumes where it stopped
    loader.dataset.raise_at = -1
    rest = [i for _, i in loader]
    assert len(got) + len(rest) == len(loader) and _worker_pids(loader) != pids
    assert sorted(torch.cat(got + rest).tolist()) == list(range(2000))
    loader.close()


class FailsOnce(Faulty):
    """Raises at ``raise_at`` the first time it is asked for it (in any process)."""

    def __init__(self, n: int, raise_at: int, flag: Path) -> None:
        super().__init__(n)
        self.at, self.flag = raise_at, flag

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i == self.at and not self.flag.exists():
            self.flag.touch()
            raise ValueError(f"transient failure at sample {i}")
        return super().__getitem__(i)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterating_again_after_an_error_continues_after_the_last_batch(
        num_workers: int, tmp_path: Path) -> None:
    # Issue 18: iterating again after a worker error used to restart the epoch at
    # sample 0, so every batch handed out before the error was trained on twice.
    ds = FailsOnce(2000, raise_at=1234, flag=tmp_path / "failed")
    with Loader(ds, batch_size=16, num_workers=num_workers, device="cpu", seed=5) as loader:
        before: list[torch.Tensor] = []
        with pytest.raises((WorkerError, ValueError), match="transient failure"):
            for _, i in loader:
                before.append(i)
        state = loader.state_dict()
        after = [i for _, i in loader]  # the same epoch, from the batch that failed
        assert loader.epoch == 1
    seen = torch.cat(before + after).tolist()
    assert len(before) > 0 and len(before) + len(after) == len(loader)
    assert sorted(seen) == list(range(2000))  # each sample once: none twice, none lost
    assert state["epoch"] == 0 and state["position"] == 16 * len(before)


@pytest.mark.timeout(60)
def test_killed_worker_is_a_clear_error_not_a_hang() -> None:
    loader = Loader(Faulty(die_at=777), batch_size=16, num_workers=2, device="cpu")
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        for _ in loader:
            pass
    assert time.monotonic() - t0 < 20
    msg = str(info.value)
    assert "loader worker" in msg and "SIGKILL" in msg and "777" in msg
    assert info.value.recoverable
    assert isinstance(info.value, RuntimeError)  # as DataLoader's "worker ... is killed by signal"
    loader.close()


@pytest.mark.timeout(60)
def test_worker_init_fn_failure() -> None:
    def init(worker_id: int) -> None:
        raise RuntimeError(f"no GPU for worker {worker_id}")

    loader = Loader(Faulty(), num_workers=1, device="cpu", worker_init_fn=init)
    with pytest.raises(WorkerError, match="worker_init_fn raised"):
        list(loader)
    loader.close()


@pytest.mark.timeout(60)
def test_hanging_dataset_hits_the_timeout() -> None:
    loader = Loader(Faulty(hang_at=5), batch_size=8, num_workers=2, device="cpu",
                    shuffle=False, timeout=1.0)
    pids: list[int] = []
    # A RuntimeError too, as DataLoader's timeout is: an `except RuntimeError:` retry
    # written for DataLoader catches it.
    with pytest.raises(RuntimeError, match="no batch from the 2 loader workers in 1 s") as caught:
        it = iter(loader)
        pids = _worker_pids(loader)
        list(it)
    assert isinstance(caught.value, DataError)  # and ringtrain's own, as before
    time.sleep(0.2)
    assert _alive(pids) == []  # the hung worker was terminated


@pytest.mark.timeout(60)
def test_close_leaves_no_processes_descriptors_or_shm() -> None:
    shm_before = _shm()
    fds_before = len(os.listdir("/proc/self/fd"))
    loader = Loader(Faulty(), batch_size=16, num_workers=2, device="cpu")
    kept = [b for _, b in zip(range(5), loader, strict=False)]  # hold some zero-copy batches
    pids = _worker_pids(loader)
    assert _alive(pids) == pids
    loader.close()
    time.sleep(0.2)
    assert _alive(pids) == []
    assert _shm() == shm_before
    assert kept[0][1].tolist()  # held batches stay readable after close
    del kept
    assert len(os.listdir("/proc/self/fd")) <= fds_before


@pytest.mark.timeout(60)
def test_a_dropped_loader_stops_its_workers() -> None:
    loader = Loader(Faulty(), batch_size=16, num_workers=2, device="cpu")
    it = iter(loader)
    next(it)
    pids = _worker_pids(loader)
    del loader, it
    gc.collect()
    time.sleep(0.2)
    assert _alive(pids) == []


def _run_script(body: str, *args: str, sig: int | None = None, wait_for: str = "READY"
                ) -> tuple[subprocess.CompletedProcess[str] | None, list[int], str]:
    # The child takes Ctrl-C as Python's default does whatever it inherited: a suite
    # started in the background by a non-interactive shell (``make test &``, a CI runner
    # under nohup) passes SIGINT down ignored, and a Python started so never raises
    # KeyboardInterrupt (seen: the ctrl-c case below then trained its epoch to the end).
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, {SRC!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_loader_failures import Faulty
        from ringtrain.data import Loader
    """) + body
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    pids: list[int] = []
    out = ""
    for line in proc.stdout:
        out += line
        if line.startswith("PIDS"):
            pids = [int(p) for p in line.split()[1:]]
        if line.startswith(wait_for):
            break
    if sig is not None:
        # One press: the first Ctrl-C was lost once in ~350 runs under load, when it
        # arrived while a dropped batch's weakref callback ran Python code (see
        # test_dropping_a_batch_runs_no_python_code below).
        proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out + rest), pids, out + rest


LOOP = textwrap.dedent("""
    loader = Loader(Faulty(10**6), batch_size=64, num_workers=2, device="cpu")
    it = iter(loader)
    next(it)
    print("PIDS", *loader.worker_pids, flush=True)
    print("READY", flush=True)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["ctrl-c", "normal-exit", "parent-killed"])
def test_workers_go_away_with_the_training_process(how: str) -> None:
    shm_before = _shm()
    if how == "ctrl-c":
        body = LOOP + "for _ in it: time.sleep(0.001)\n"
        result, pids, out = _run_script(body, sig=signal.SIGINT)
        assert result is not None and result.returncode != 0 and "KeyboardInterrupt" in out
    elif how == "normal-exit":
        result, pids, out = _run_script(LOOP + "sys.exit(0)\n")  # no close(): atexit cleans up
        assert result is not None and result.returncode == 0, out
    else:
        body = LOOP + "for _ in it: time.sleep(0.001)\n"
        result, pids, out = _run_script(body, sig=signal.SIGKILL)
    assert len(pids) == 2
    deadline = time.monotonic() + 10  # orphaned workers notice within ~1 s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(pids) == [], out
    assert _shm() == shm_before


@pytest.mark.timeout(60)
def test_dropping_a_batch_runs_no_python_code() -> None:
    """Where the loop lets go of a zero-copy batch, nothing runs that a Ctrl-C could
    interrupt. A Python weakref callback there ran wherever the loop dropped a batch; a
    pending SIGINT raised KeyboardInterrupt inside it, and Python reports an exception
    in a weakref callback as "Exception ignored" and goes on: the Ctrl-C was lost."""
    with Loader(Faulty(512), batch_size=16, num_workers=2, device="cpu", zero_copy=True) as loader:
        it = iter(loader)
        kept = [next(it) for _ in range(4)]  # the first is joined from two halves: a copy
        assert loader.stats()["held_batches"] >= 1  # the others are views of the slots
        calls: list[str] = []

        def profile(frame: object, event: str, arg: object) -> None:
            if event == "call":
                calls.append(getattr(frame, "f_code").co_qualname)  # noqa: B009

        seen = [i for _, y in kept for i in y.tolist()]
        sys.setprofile(profile)
        try:
            del kept  # the last views of their slots: the slots can go back to the workers
        finally:
            sys.setprofile(None)
        assert calls == [], calls
        # the loader gets its slots back and delivers the rest of the epoch intact
        for _, y in it:
            seen += y.tolist()
        assert sorted(seen) == list(range(512))
