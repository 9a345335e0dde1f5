"""A rank's stderr stays its stderr, as under mpirun, torchrun and Horovod's launcher.

Before, a rank's stderr reached ringrun's (and horovodrun's) *stdout*, merged with its
stdout: ``ringrun ... 2> err.log`` caught none of the ranks' tracebacks, ``| tee`` and CI
logs that colour stderr saw them as ordinary output. And horovodrun's
``--output-filename DIR`` wrote ``DIR/rank.N.log`` where Horovod's Gloo launcher
(horovod/runner/gloo_run.py) writes ``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr``, N
zero-padded to the width of the largest rank.

Local ranks (ringrun, horovodrun) and a remote host's ranks (its host agent run
directly, as ssh would start it) are checked; the ranks are ``sh`` scripts, so each
job costs tens of milliseconds, not an interpreter start.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts.harness import BIN, RINGRUN, assert_no_orphans, env_for, new_marker

import ringtrain.launch.agent as agent_module
from ringtrain.errors import ConfigError
from ringtrain.launch.cli import build_config
from ringtrain.launch.output import STDERR, STDOUT, OutputSink, padded_rank
from ringtrain.launch.remote import RemoteHost

HOROVODRUN = str(BIN / "horovodrun")
# Each rank: two stdout lines around stderr lines, a progress bar redrawn on stderr
# (`\r`), and a stderr line left without its newline at exit.
SCRIPT = ("echo \"out $R a\"; echo \"err $R 1\" >&2; printf 'bar 1\\rbar 2\\r' >&2; "
          "echo \"err $R 2\" >&2; echo \"out $R b\"; printf 'tail' >&2")
COMMAND = ["sh", "-c", SCRIPT.replace("$R", "${RANK:-$MY_RANK}")]


def _out(rank: int) -> list[bytes]:
    return [f"out {rank} a\n".encode(), f"out {rank} b\n".encode()]


def _err(rank: int) -> list[bytes]:
    # On the terminal the last piece gets its newline, so ranks never share a line.
    return [f"err {rank} 1\n".encode(), b"bar 1\r", b"bar 2\r", f"err {rank} 2\n".encode(), b"tail\n"]


def _pieces(text: bytes, rank: int) -> list[bytes]:
    """Rank ``rank``'s pieces on a terminal stream, in order (each is ``[rank] piece``)."""
    return [piece for r, piece in re.findall(rb"\[(\d+)\] ([^\r\n]*[\r\n])", text) if int(r) == rank]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", ["ringrun", "horovodrun"])
def test_local_ranks_keep_stderr_on_the_launchers_stderr(launcher: str, tmp_path: Path) -> None:
    """ringrun: the two streams on the terminal's two streams; horovodrun with
    ``--output-filename``: Horovod's files, and the terminal's two streams as well."""
    marker = new_marker()
    logs = tmp_path / "logs"
    argv = ([RINGRUN, "-np", "2"] if launcher == "ringrun"
            else [HOROVODRUN, "-np", "2", "--output-filename", str(logs)])
    res = subprocess.run([*argv, *COMMAND], capture_output=True, timeout=45, env=env_for(marker))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert b"err" not in res.stdout, res.stdout
    for rank in (0, 1):
        assert _pieces(res.stdout, rank) == _out(rank), res.stdout
        assert _pieces(res.stderr, rank) == _err(rank), res.stderr
    if launcher == "horovodrun":
        assert sorted(os.listdir(logs)) == ["rank.0", "rank.1"]
        for rank in (0, 1):
            assert sorted(os.listdir(logs / f"rank.{rank}")) == ["stderr", "stdout"]
            assert (logs / f"rank.{rank}" / "stdout").read_bytes() == b"".join(_out(rank))
            # The file has the bytes as written: 'tail' stays without a newline.
            assert (logs / f"rank.{rank}" / "stderr").read_bytes() == b"".join(_err(rank))[:-1]
    assert_no_orphans(marker)


@pytest.mark.timeout(60)
def test_a_remote_hosts_ranks_keep_stderr_apart(tmp_path: Path) -> None:
    """The host agent tags a rank's stderr (``O2``/``P2``) and ringrun's side of the
    connection writes it to the rank's stderr file and ringrun's stderr."""
    marker = new_marker()
    out, err = io.BytesIO(), io.BytesIO()
    sink = OutputSink(str(tmp_path / "logs"), stream=out, err_stream=err, tee=True,
                      layout="horovod", size=2)
    # The agent as ssh runs it: a plain script in a clean environment.
    host = RemoteHost("fake", [sys.executable, str(Path(agent_module.__file__))], (0, 1), sink, 0,
                      {"PATH": os.environ["PATH"]})
    try:
        assert host.wait_ready(time.monotonic() + 20), host.problem()
        host.send_spec({"cwd": os.getcwd(), "command": COMMAND, "listen": None,
                        "ranks": [{"rank": r, "local_size": 2,
                                   "env": {"RINGTEST_MARKER": marker, "MY_RANK": str(r)}} for r in (0, 1)]})
        deadline = time.monotonic() + 20
        while len(host.exits()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert host.exits() == {0: 0, 1: 0}, host.problem()
    finally:
        host.request_stop()
        host.force_kill()
        host.finish_output()
    for rank in (0, 1):
        assert _pieces(out.getvalue(), rank) == _out(rank), out.getvalue()
        assert _pieces(err.getvalue(), rank) == _err(rank), err.getvalue()
        # The bytes as written, a last piece without a newline too (as the local ranks').
        assert (tmp_path / "logs" / f"rank.{rank}" / "stderr").read_bytes() == b"".join(_err(rank))[:-1]
    assert_no_orphans(marker)


@pytest.mark.parametrize("size, names", [
    (1, ["0", "0"]), (2, ["0", "1"]), (10, ["0", "9"]), (11, ["00", "10"]), (101, ["000", "100"]),
])
def test_rank_folders_are_padded_as_horovods(size: int, names: list[str]) -> None:
    # horovod/runner/gloo_run.py's _pad_rank: the width of size - 1.
    assert [padded_rank(0, size), padded_rank(size - 1, size)] == names


def test_horovod_layout_files_start_afresh_and_a_rank_that_never_ran_leaves_none(tmp_path: Path) -> None:
    sink = OutputSink(str(tmp_path), layout="horovod", size=12)
    files = sink.open_for(3, 0)
    sink.write(3, b"old\n", files, stream=STDOUT)
    sink.close(files)
    files = sink.open_for(3, 0)  # a second run in the same DIR: Horovod opens with "w"
    sink.write(3, b"new\n", files, stream=STDOUT)
    sink.write(3, b"oops\n", files, stream=STDERR)
    sink.close(files)
    assert (tmp_path / "rank.03" / "stdout").read_bytes() == b"new\n"
    assert (tmp_path / "rank.03" / "stderr").read_bytes() == b"oops\n"
    sink.discard(sink.open_for(7, 0))
    assert sorted(os.listdir(tmp_path)) == ["rank.03"]


def test_a_closed_stderr_is_one_failure() -> None:
    class Closed(io.BytesIO):
        def write(self, data: bytes) -> int:  # type: ignore[override]
            raise BrokenPipeError(32, "Broken pipe")

    out = io.BytesIO()
    sink = OutputSink(None, stream=out, err_stream=Closed())
    sink.write(0, b"oops\n", None, stream=STDERR)
    sink.write(0, b"fine\n", None, stream=STDOUT)
    assert sink.failure is not None and sink.failure.message.startswith("stderr is closed")
    assert sink.failure.exit_code == 141 and out.getvalue() == b"[0] fine\n"


def test_ringruns_layout_flag_needs_output_filename(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="add --output-filename DIR"):
        build_config(["-np", "1", "--output-layout", "horovod", "true"])
    cfg = build_config(["-np", "1", "--output-filename", str(tmp_path), "--output-layout", "horovod", "true"])
    assert cfg.output_layout == "horovod"
    assert build_config(["-np", "1", "--output-filename", str(tmp_path), "true"]).output_layout == "log"


@pytest.mark.timeout(30)
def test_hvd_run_names_the_launchers_line_not_a_ranks_last_words() -> None:
    """hvd.run's error ends with the launcher's last line; a rank's stderr, which comes on
    the launcher's stderr too, may end after it (a rank answering the stop) and is not
    what the error names. A stand-in for horovodrun prints what it prints then."""
    from ringtrain.horovod import runner

    launcher = ("echo 'ringrun: rank 1 (pid 7 on localhost) exited with code 3; stopping 1 other "
                "rank(s)' >&2; echo '[0] rank 0 says goodbye' >&2; exit 3")
    code, _, last = runner._drive(["sh", "-c", launcher], dict(os.environ), "tok")
    assert (code, last) == (3, "ringrun: rank 1 (pid 7 on localhost) exited with code 3; stopping "
                               "1 other rank(s)")
