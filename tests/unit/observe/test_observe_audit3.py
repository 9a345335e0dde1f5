"""The doctor on what it cannot see, on stragglers, and on its own ending (observe audit 3).

The verdict tests use hand-made reports; the command-line tests replace the script run
with a fake that writes reports, except the SIGTERM test, which needs real processes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ringtrain.observe import doctor
from ringtrain.observe.instrument import batch_size_of
from ringtrain.observe.verdict import diagnose, render


def report(rank: int = 0, size: int = 1, data: float = 0.0, xwait: float = 0.0,
           source: str | None = "Loader", nbytes: float = 0.0, steps: int = 50,
           step: float = 0.1) -> dict[str, Any]:
    update = 0.01
    shares = {"data_wait": data, "h2d_copy": 0.0, "compute": 1.0 - data - xwait - update,
              "exchange_wait": xwait, "update": update}
    busy = 1.0 - data - xwait
    return {
        "rank": rank, "size": size, "local_size": size,
        "summary": {
            "steps": steps, "steps_seen": steps + 5, "warmup": 5,
            "step_s": {"mean": step, "p50": step, "p90": step, "min": step, "max": step},
            "phases_s": {k: v * step for k, v in shares.items()}, "shares": shares,
            "device_busy": {"mean": busy, "p10": busy, "p50": busy, "p90": busy, "source": "host"},
            "samples_per_s": 80.0,
            "exchange": {"bytes_per_step": nbytes, "buckets_per_step": 1.0 if nbytes else 0.0,
                         "tensors_per_step": 2.0 if nbytes else 0.0, "in_flight_s": 0.0,
                         "hidden_share": None},
            "gpu": None,
        },
        "cpu": {"affinity": 2, "quota": None, "per_rank": 2 / size},
        "loader": {"workers": None if source is None else 0, "source": source},
        "settings": {"fusion_mb": 25.0},
    }


def test_a_data_source_nobody_metered_is_not_called_a_busy_device() -> None:
    # A plain torch DataLoader (not wrapped in rt.observe.instrument): the loop waited
    # 57% of each step in next(), which the meter counted as compute. The doctor said
    # "COMPUTE-BOUND ... the device is busy 100%: input and exchange are hidden".
    d = diagnose([report(source=None, data=0.0, xwait=0.002)])
    text = render(d)
    assert "as far as measured" in d.headline and "the data source was not metered" in d.headline
    assert "rt.observe.instrument(loader)" in d.advice[0]
    assert "input: not metered" in text
    assert "input and exchange are hidden" not in text


def test_an_exchange_nobody_metered_on_several_ranks_is_not_compute() -> None:
    # torch DDP on 2 ranks: its all-reduce ran inside backward, counted as compute; the
    # doctor said compute-bound and "adding ranks should scale nearly linearly".
    d = diagnose([report(rank=r, size=2, source="iterable") for r in range(2)])
    text = render(d)
    assert d.verdict == "compute-bound"
    assert "the gradient exchange was not metered" in d.headline
    assert "none metered on 2 ranks" in text and "rt.DistributedOptimizer(opt" in d.advice[0]
    assert "scale nearly linearly" not in text and "are hidden" not in text


def test_one_rank_without_exchange_events_needs_none() -> None:
    d = diagnose([report(source="iterable")])
    assert d.headline.startswith("COMPUTE-BOUND: ") and "not metered" not in render(d)


def test_a_straggler_is_named_and_its_waiting_peer_is_not_called_busy() -> None:
    # Rank 1 computes 3x longer; rank 0 waits 65% of each step at the exchange for it.
    # The advice read "the device is busy 35% of the step: input and exchange are hidden"
    # (rank 0's share) and "adding ranks should scale nearly linearly".
    d = diagnose([report(rank=0, size=2, xwait=0.65, nbytes=272, source="iterable"),
                  report(rank=1, size=2, xwait=0.032, nbytes=272, source="iterable")])
    text = render(d)
    assert d.verdict == "compute-bound" and "on rank 1, the slowest" in d.headline
    assert "rank 0 waits 65% of the step at the exchange against 3.2% on rank 1" in d.advice[0]
    assert "busy 97% of the step on rank 1" in text and "busy 35% of the step" not in text
    assert "scale nearly linearly" not in text


def _fake_run(reports: list[dict[str, Any]], code: int = 0):  # type: ignore[no-untyped-def]
    def run(command: list[str], env: dict[str, str], quiet: bool) -> tuple[int, list[str]]:
        out = Path(env[doctor.DOCTOR_ENV])
        for r in reports:
            (out / f"meter-rank{r['rank']}-1.json").write_text(json.dumps(r))
        return code, []
    return run


def _main(tmp_path: Path, *flags: str) -> int:
    script = tmp_path / "train.py"  # the run is faked, but the doctor checks the script exists
    script.touch()
    return doctor.main(["--out", str(tmp_path / "doc"), "--no-plot", *flags,
                        "--", sys.executable, str(script)])


def test_a_script_that_ends_before_the_steps_asked_is_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(doctor, "_run", _fake_run([report(steps=5)]))
    assert _main(tmp_path, "--steps", "20") == 0
    out = capsys.readouterr().out
    assert "5 steps measured after 5 warm-up (the script ended before the 20 asked)" in out


def test_nothing_measured_names_rt_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    # A script that iterates rt.observe.instrument(...) but never calls rt.init() was
    # asked whether it uses rt.observe.instrument, which it did.
    monkeypatch.setattr(doctor, "_run", _fake_run([]))
    assert _main(tmp_path) == doctor.EXIT_NO_STEPS
    assert "rt.init()" in capsys.readouterr().out


def test_a_script_file_given_as_the_command_names_python(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    assert doctor.main(["--", "train.py", "--lr", "1"]) == doctor.EXIT_USAGE
    err = capsys.readouterr().err
    assert "is a file, not a command" in err and "ringtrain doctor -- python train.py --lr 1" in err
    assert err.count("\n") == 1


@pytest.mark.timeout(30)
def test_sigterm_stops_the_script_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `kill` / `timeout` / a scheduler ending the doctor left the script training on,
    # orphaned, with the doctor gone. The signal is sent to this process only once a
    # handler is in place (with none, it would end pytest): otherwise the script is
    # killed and the test fails on the exit code.
    pid_file = tmp_path / "pid"
    script = tmp_path / "forever.py"
    script.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                      "time.sleep(60)\n")
    child: list[int] = []

    def signal_when_running() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (pid_file.exists() and pid_file.read_text()):
            time.sleep(0.02)
        child.append(int(pid_file.read_text()))
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            os.kill(child[0], signal.SIGKILL)  # nothing would stop the script: end it here
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_when_running, daemon=True)
    sender.start()
    try:
        code = doctor.main(["--out", str(tmp_path / "doc"), "--no-plot", "-q",
                            "--", sys.executable, str(script)])
        sender.join(5)
        assert code == 128 + signal.SIGTERM
        assert "stopped by SIGTERM" in capsys.readouterr().out
        assert child and not _alive(child[0]), "the script outlived the doctor"
    finally:
        if child and _alive(child[0]):
            os.kill(child[0], signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("batch,rows", [
    # collate_fn=lambda b: b: a list of (image, target) samples counted the image's
    # channels (3) as the batch, so samples/s was off by batch / 3.
    ([(torch.zeros(3, 8, 8), {"boxes": torch.zeros(2, 4)}) for _ in range(8)], 8),
    ([{"ids": torch.zeros(5), "label": 1} for _ in range(6)], 6),
    # Collated batches keep counting rows.
    (((torch.zeros(4, 2), torch.zeros(4, 2)), torch.zeros(4)), 4),
    ([{"ids": torch.zeros(5, 9)}, torch.zeros(5)], 5),
])
def test_batch_size_of_a_list_of_samples(batch: Any, rows: int) -> None:
    assert batch_size_of(batch) == rows
