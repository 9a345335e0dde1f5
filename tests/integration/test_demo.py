"""The README's demo: the article's CNN on 2 ranks reaches >= 97% held-out accuracy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_mnist_demo_on_two_ranks_reaches_97_percent(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    res = subprocess.run(
        [str(Path(sys.executable).parent / "ringrun"), "-np", "2", "python",
         str(ROOT / "examples" / "mnist_cnn.py"), "--checkpoint-dir", str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    epochs = re.findall(r"^\[0\] epoch (\d+)/(\d+) .* test accuracy ([\d.]+)\s+([\d,]+) samples/s",
                        res.stdout, re.M)
    assert epochs and epochs[-1][0] == epochs[-1][1], res.stdout[-2000:]
    assert not re.search(r"^\[1\] epoch", res.stdout, re.M)  # only rank 0 reports
    final = float(re.search(r"final test accuracy ([\d.]+)", res.stdout).group(1))  # type: ignore[union-attr]
    assert final >= 0.97
    # Rank 0 wrote one checkpoint per epoch and nothing else.
    assert len(list((tmp_path / "ck").glob("epoch-*.ckpt"))) == int(epochs[-1][1])
