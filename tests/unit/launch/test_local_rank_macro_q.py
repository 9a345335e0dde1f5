"""torchrun's ``${local_rank}`` macro under ringrun, and the ``--output-filename`` files'
bytes, without processes.

torchrun's agent replaces ``${local_rank}`` (and ``$local_rank``) in every argument of
the command, the script's path too, with ``string.Template(arg).safe_substitute``
(torch/distributed/elastic/utils/api.py, ``macros.substitute``); the program itself
(its python, or the program of ``--no-python``) is left alone. ringrun does the same
with its command's arguments, on every host and in resizable jobs too. horovodrun runs
the command untouched, as Horovod.
"""

from __future__ import annotations

import io
import string
import time
from types import SimpleNamespace

import pytest

from ringtrain.launch.cli import build_config
from ringtrain.launch.job import _spec
from ringtrain.launch.members import substitute_local_rank
from ringtrain.launch.output import OutputSink, RankFiles
from ringtrain.processes import PIECE_BYTES

# Arguments torchrun changes, and ones it leaves alone (checked against real torchrun).
ARGS = ["train_${local_rank}.py", "${local_rank}", "$local_rank", "--lr=${local_rank}",
        "x${local_rank}y", "$LOCAL_RANK", "$local_ranks", "${local_rank", "$", "$5", "${other}",
        "$$local_rank"]


@pytest.mark.parametrize("local_rank", [0, 3])
def test_arguments_change_as_torchruns_template_changes_them(local_rank: int) -> None:
    got = substitute_local_rank(["python", *ARGS], local_rank)
    torchrun = [string.Template(a).safe_substitute(local_rank=str(local_rank)) for a in ARGS]
    assert got == ("python", *torchrun)
    assert got[1:5] == (f"train_{local_rank}.py", str(local_rank), str(local_rank), f"--lr={local_rank}")


def test_the_program_stays_as_it_is_and_a_double_dollar_is_one_as_under_torchrun() -> None:
    assert substitute_local_rank(["./run_${local_rank}", "${local_rank}"], 1) == ("./run_${local_rank}", "1")
    assert substitute_local_rank(["sh", "-c", "echo $$ $local_rank"], 1) == ("sh", "-c", "echo $ 1")
    assert substitute_local_rank([], 1) == ()


def test_ringrun_replaces_it_on_local_ranks_and_horovodrun_does_not() -> None:
    argv = ["-np", "2", "printf", "%s", "${local_rank}"]
    ringrun = build_config(argv, local_rank_macro=True)
    assert [ringrun.rank_command(r) for r in (0, 1)] == [("printf", "%s", "0"), ("printf", "%s", "1")]
    horovodrun = build_config(argv)  # horovodrun's call: Horovod runs the command as given
    assert horovodrun.rank_command(1) == ("printf", "%s", "${local_rank}")


def test_a_remote_hosts_ranks_get_their_own_command_in_the_agents_spec() -> None:
    # The host agent starts each rank with its spec entry's "command" (agent.py).
    cfg = build_config(["-np", "3", "-H", "localhost:1,ringtrain-nohost-q:2", "printf", "%s", "${local_rank}"],
                       local_rank_macro=True)
    remote = SimpleNamespace(ranks=[1, 2])
    spec = _spec(cfg, remote, "127.0.0.1", 1234, 0, "run", "/", {}, {1: {}, 2: {}}, None)  # type: ignore[arg-type]
    assert [r["command"] for r in spec["ranks"]] == [["printf", "%s", "0"], ["printf", "%s", "1"]]
    plain = build_config(["-np", "3", "-H", "localhost:1,ringtrain-nohost-q:2", "printf", "%s", "${local_rank}"])
    spec = _spec(plain, remote, "127.0.0.1", 1234, 0, "run", "/", {}, {1: {}, 2: {}}, None)  # type: ignore[arg-type]
    assert [r["command"] for r in spec["ranks"]] == [["printf", "%s", "${local_rank}"]] * 2


class _Named(io.BytesIO):
    name = "rank.0.log"


def test_a_last_piece_without_a_newline_is_written_as_it_was() -> None:
    # torchrun's --redirects files and mpirun's --output-filename ones hold the bytes the
    # rank wrote; the file had a newline added after 'tail'.
    log = _Named()
    sink = OutputSink("unused", prefix=True)
    files = RankFiles(log, log)
    for piece, partial in [(b"line\n", False), (b"bar\r", True), (b"tail", False)]:
        sink.write(0, piece, files, partial)
    assert log.getvalue() == b"line\nbar\rtail"


def test_an_unprefixed_terminal_gets_the_bytes_as_written() -> None:
    out = io.BytesIO()
    sink = OutputSink(None, prefix=False, stream=out)
    sink.write(0, b"a\n", None)
    sink.write(0, b"tail", None)
    assert out.getvalue() == b"a\ntail"


def test_time_stamps_start_lines_never_the_middle_of_a_long_one() -> None:
    log = _Named()
    sink = OutputSink("unused", timestamp=True)
    files = RankFiles(log, log)
    long = b"x" * PIECE_BYTES
    for piece, partial in [(long, True), (long, True), (b"end\n", False), (b"tail", False)]:
        sink.write(0, piece, files, partial)
    stamp = len(time.asctime()) + 1
    text = log.getvalue()
    assert text[stamp:stamp + 2 * PIECE_BYTES + 4] == long + long + b"end\n"
    assert text.endswith(b" tail") and len(text) == 2 * (stamp) + 2 * PIECE_BYTES + 8
