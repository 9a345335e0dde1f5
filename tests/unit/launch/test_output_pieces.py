"""How a worker's output is cut into pieces (``ringtrain.processes.pieces``) and shown:
a piece ends at a newline or at a carriage return, so a progress bar (tqdm redraws its
line after ``\\r``, with no newline until it is done) shows as it goes under ringrun, as
under Horovod's launcher, instead of all at once at its end; ``\\r\\n`` is one newline;
a line longer than PIECE_BYTES goes in bounded pieces."""

from __future__ import annotations

import io
import os
import threading

from ringtrain.launch.output import OutputSink
from ringtrain.processes import PIECE_BYTES, pieces


def _cut(data: bytes) -> list[tuple[bytes, bool]]:
    return list(pieces(io.BufferedReader(io.BytesIO(data))))  # type: ignore[arg-type]


def test_lines_and_carriage_returns_end_pieces() -> None:
    assert _cut(b"a\nb\n") == [(b"a\n", False), (b"b\n", False)]
    assert _cut(b"\r 10%\r 20%\r100%\n") == [(b"\r", True), (b" 10%\r", True), (b" 20%\r", True),
                                             (b"100%\n", False)]
    assert _cut(b"x\r\ny\n") == [(b"x\r\n", False), (b"y\n", False)]
    assert _cut(b"no newline at the end") == [(b"no newline at the end", False)]


def test_a_long_line_goes_in_bounded_pieces() -> None:
    got = _cut(b"x" * (2 * PIECE_BYTES + 10) + b"\n")
    assert [len(p) for p, _ in got] == [PIECE_BYTES, PIECE_BYTES, 11]
    assert [partial for _, partial in got] == [True, True, False]


def test_no_piece_is_longer_than_piece_bytes_whatever_the_reads_return() -> None:
    class Chunks:
        def __init__(self, *chunks: bytes) -> None:
            self.chunks = list(chunks)

        def read1(self, n: int) -> bytes:
            return self.chunks.pop(0) if self.chunks else b""

    got = list(pieces(Chunks(b"x" * 100, b"y" * PIECE_BYTES + b"\n")))  # type: ignore[arg-type]
    assert [len(p) for p, _ in got] == [PIECE_BYTES, 101] and got[0][1] and not got[1][1]


def test_a_progress_update_is_passed_on_before_the_line_ends() -> None:
    """Through a real pipe that stays open: the update arrives without the newline."""
    r, w = os.pipe()
    got: list[bytes] = []
    arrived = threading.Event()

    def read() -> None:
        with os.fdopen(r, "rb") as stream:
            for piece, _ in pieces(stream):
                got.append(piece)
                arrived.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    os.write(w, b" 50%|#####     |\r")
    try:
        assert arrived.wait(10), "the update waited for a newline"
        assert got == [b" 50%|#####     |\r"]
    finally:
        os.close(w)
        reader.join(10)


def test_the_terminal_gets_a_redrawn_line_without_an_added_newline() -> None:
    out = io.BytesIO()
    sink = OutputSink(None, True, stream=out)
    sink.write(0, b" 10%\r", None, partial=True)
    sink.write(0, b"100%\n", None)
    sink.write(0, b"x" * 5, None, partial=True)  # a line that goes on: shown, left open
    assert out.getvalue() == b"[0]  10%\r[0] 100%\n[0] xxxxx"
    sink.write(0, b"yy\n", None)  # the same rank goes on in the same line
    sink.write(0, b"name? ", None, partial=True)  # a prompt, then another rank's line
    sink.write(1, b"other\n", None)
    sink.write(0, b"tail", None)  # a last piece without a newline ends its line
    assert out.getvalue() == b"[0]  10%\r[0] 100%\n[0] xxxxxyy\n[0] name? \n[1] other\n[0] tail\n"


def test_a_prompt_without_a_newline_arrives_at_once() -> None:
    # input("name? ") or pdb's "(Pdb) " wait for an answer after it: shown as torchrun
    # and mpirun show it, not with the answer after Enter.
    r, w = os.pipe()
    got: list[tuple[bytes, bool]] = []
    arrived = threading.Event()

    def read() -> None:
        with os.fdopen(r, "rb") as stream:
            for item in pieces(stream):
                got.append(item)
                arrived.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    os.write(w, b"name? ")
    try:
        assert arrived.wait(10), "the prompt waited for its newline"
        assert got == [(b"name? ", True)]
    finally:
        os.close(w)
        reader.join(10)
