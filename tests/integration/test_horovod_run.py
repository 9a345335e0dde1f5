"""``hvd.run``: Horovod's Python launcher returns each rank's value, in rank order."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hosts.harness import assert_no_orphans, new_marker

import ringtrain.horovod as hvd


@pytest.fixture
def marked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    marker = new_marker()
    monkeypatch.setenv("RINGTEST_MARKER", marker)  # the job's processes carry it
    monkeypatch.chdir(tmp_path)
    return marker


@pytest.mark.timeout(120)
def test_values_come_back_in_rank_order(marked: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    weights = bytes(range(256)) * 800  # 200 KiB: too big for the environment, goes by file

    def train(scale: float, offset: float = 0.0) -> dict[str, Any]:
        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
        print(f"trained on rank {hvd.rank()}", end="")  # no newline: the value's line is its own
        # a value longer than one output line (32 KiB pieces)
        return {"rank": hvd.rank(), "size": hvd.size(), "sum": total.item() * scale + offset,
                "echo": weights[hvd.rank():]}

    got = hvd.run(train, args=(2.0,), kwargs={"offset": 1.0}, num_proc=2)
    assert [g["rank"] for g in got] == [0, 1]
    assert all(g["size"] == 2 and g["sum"] == 7.0 for g in got)
    assert [g["echo"] for g in got] == [weights, weights[1:]]
    out = capsys.readouterr().out
    assert "[0] trained on rank 0" in out and "[1] trained on rank 1" in out
    assert "\n[0] \n" not in out and "\n[1] \n" not in out  # the task's own line breaks
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ringtrain-run")]
    assert_no_orphans(marked)


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_the_call(marked: str) -> None:
    def train() -> int:
        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("bad batch")
        hvd.barrier()
        return hvd.rank()

    with pytest.raises(RuntimeError, match=r"hvd\.run job failed \(horovodrun exited with 1\)"):
        hvd.run(train, np=2)  # Horovod's deprecated spelling of num_proc
    assert_no_orphans(marked)


@pytest.mark.timeout(120)
def test_values_come_back_with_output_in_rank_files(marked: str, tmp_path: Path) -> None:
    def rank() -> int:
        hvd.init()
        return hvd.rank() * 10

    # --output-filename: the ranks' output goes to rank.N/stdout and stderr and, as in
    # Horovod, to the terminal, where the values come back
    assert hvd.run(rank, num_proc=2, output_filename=str(tmp_path / "logs")) == [0, 10]
    assert sorted(os.listdir(tmp_path / "logs")) == ["rank.0", "rank.1"]
    assert sorted(os.listdir(tmp_path / "logs" / "rank.0")) == ["stderr", "stdout"]
    assert_no_orphans(marked)


@pytest.mark.parametrize("kwargs, message", [
    ({"hosts": "localhost:2", "hostfile": "hosts.txt"}, "hosts or hostfile, not both"),
    ({"use_gloo": True, "use_mpi": True}, "use_gloo or use_mpi, not both"),
])
def test_contradictory_arguments_are_refused_before_a_launch(kwargs: dict[str, Any],
                                                             message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hvd.run(print, num_proc=2, **kwargs)
