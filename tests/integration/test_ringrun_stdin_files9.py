"""What reaches a rank and what leaves it, beside the terminal (the workers import no torch).

- Rank 0 reads ringrun's stdin (``cat data | ringrun -np 2 python prep.py``), as mpirun
  gives its stdin to rank 0 and torchrun / horovodrun to every local rank; the other
  ranks read an empty stdin. Before, every rank read /dev/null, so a script that reads
  its input from stdin silently got none under ringrun.
- ``hvd.run``'s result lines (its marker in RINGTRAIN_RUN_TOKEN) stay out of the
  ``--output-filename`` files, which hold the ranks' own output as Horovod's do; before,
  each file also held the function's pickled value in base64.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hosts.harness import BIN, RINGRUN, assert_no_orphans, env_for, new_marker

PY = sys.executable
READ = "import os, sys\nprint(f'rank {os.environ[\"RANK\"]} read {sys.stdin.read()!r}', flush=True)"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", [RINGRUN, str(BIN / "horovodrun")])
def test_rank_0_reads_the_launchers_stdin_and_the_others_read_nothing(launcher: str) -> None:
    marker = new_marker()
    res = subprocess.run([launcher, "-np", "2", PY, "-c", READ], input="line 1\nline 2\n",
                         capture_output=True, text=True, timeout=50, env=env_for(marker))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = sorted(res.stdout.splitlines())
    assert lines == ["[0] rank 0 read 'line 1\\nline 2\\n'", "[1] rank 1 read ''"], res.stdout
    assert_no_orphans(marker)


# A rank's own line, then what hvd.run's task prints: an unended print and a result line.
RESULT = ("import sys\nprint('own line', flush=True)\n"
          "sys.stdout.write('head' + 'tok9' + '0:0:1:QUJD\\n'); sys.stdout.flush()")


@pytest.mark.timeout(60)
def test_result_lines_go_to_the_terminal_but_not_to_the_files(tmp_path: Path) -> None:
    marker = new_marker()
    logs = tmp_path / "logs"
    res = subprocess.run([RINGRUN, "-np", "1", "--output-filename", str(logs), "--output-tee",
                          PY, "-c", RESULT], capture_output=True, text=True, timeout=50,
                         env=env_for(marker, RINGTRAIN_RUN_TOKEN="tok9"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[0] headtok90:0:1:QUJD" in res.stdout.splitlines(), res.stdout  # hvd.run reads it here
    assert (logs / "rank.0.log").read_text() == "own line\nhead\n"
    assert_no_orphans(marker)
