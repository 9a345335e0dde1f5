"""Bad layouts: the same one-line error, naming the fix, on every rank; nobody hangs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hosts.harness import RINGRUN, assert_no_orphans, env_for, new_marker
from ringtest import run_world
from test_parallel_common import EXAMPLE, ROOT, build

RANKS = 2
#: (layout, model, words the message must contain); the model None is a one-unit model.
BAD = [
    ({"pipeline": 3}, {"block": 16, "layers": 1, "width": 32, "heads": 4},
     ["does not divide the world size 2", "divisors: 1, 2"]),
    ({"pipeline": 2}, None, ["2 pipeline stages", "only 1 unit(s) (0)", "use pipeline <= 1"]),
    ({"tensor": 2}, {"block": 16, "layers": 1, "width": 27, "heads": 3},
     ["blocks.0.attn.q (colwise) has 27 output features", "tensor=2 does not divide",
      "choose tensor from [3, 9, 27]"]),
    ({"tensor": 2}, {"block": 16, "layers": 1, "width": 30, "heads": 3},
     ["blocks.0.attn has 3 heads", "tensor=2 does not divide", "choose tensor from [3]"]),
]


def try_all() -> list[str]:
    import torch

    from ringtrain.errors import ConfigError
    from ringtrain.parallel import parallelize

    messages = []
    for layout, model, _ in BAD:
        try:
            if model is None:
                parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                            torch.nn.functional.mse_loss, **layout)
            else:
                build(layout, model)
        except ConfigError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    return messages


@pytest.mark.timeout(180)
def test_every_rank_gets_the_same_one_line_error() -> None:
    ranks = run_world(try_all, RANKS, timeout=150)
    for messages in ranks:
        assert messages == ranks[0]
    for message, (_, _, words) in zip(ranks[0], BAD, strict=True):
        assert "\n" not in message
        for word in words:
            assert word in message, message


@pytest.mark.timeout(180)
def test_the_example_exits_with_one_line_per_rank(tmp_path: Path) -> None:
    marker = new_marker()
    run = subprocess.run(
        [RINGRUN, "-np", "4", "--oversubscribe", sys.executable, str(EXAMPLE), "--pipeline", "3", "--steps", "1"],
        cwd=ROOT, env=env_for(marker), capture_output=True, text=True, timeout=150)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in (run.stdout + run.stderr).splitlines()
             if "gpt_parallel: error:" in line]
    assert sorted(line.split()[0] for line in lines) == ["[0]", "[1]", "[2]", "[3]"], lines
    assert all("does not divide the world size 4" in line for line in lines)
    assert "Traceback" not in run.stdout + run.stderr
    assert_no_orphans(marker)
