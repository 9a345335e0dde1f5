"""A ``\\r\\n`` cut between two reads of a rank's pipe is one newline
(``ringtrain.processes.pieces``): the ``\\r`` at the end of a read waits for the next
byte. Before, the ``\\r`` ended a piece of its own (a progress bar's redraw) and the
``\\n`` came as a second piece, which ringrun's terminal showed as an extra ``[rank] ``
line. A lone ``\\r`` at the end of a read is still passed on soon, without its next byte."""

from __future__ import annotations

import io
import os
import threading

import pytest

from ringtrain import processes
from ringtrain.launch.output import OutputSink
from ringtrain.processes import pieces


class _Reads:
    """A stream whose reads return the given chunks, one each (no descriptor)."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    def read1(self, n: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


def test_a_crlf_cut_between_two_reads_is_one_newline() -> None:
    got = list(pieces(_Reads(b"epoch 1\r", b"\nepoch 2\r", b"\n")))  # type: ignore[arg-type]
    assert got == [(b"epoch 1\r\n", False), (b"epoch 2\r\n", False)]
    out = io.BytesIO()
    sink = OutputSink(None, True, stream=out)
    for piece, partial in got:
        sink.write(0, piece, None, partial)
    assert out.getvalue() == b"[0] epoch 1\r\n[0] epoch 2\r\n"  # no "[0] \n" line


def test_a_carriage_return_at_the_end_of_the_output_stays_a_redraw() -> None:
    assert list(pieces(_Reads(b"50%\r", b"100%\r"))) == [(b"50%\r", True), (b"100%\r", True)]  # type: ignore[arg-type]


@pytest.mark.timeout(20)
def test_through_a_pipe_the_newline_after_a_waiting_carriage_return_joins_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``\\n`` is written only once the reader has taken the ``\\r`` (its first read
    returned), so the two are two reads; the wait is long here so that a busy machine
    cannot make the ``\\n`` late."""
    monkeypatch.setattr(processes, "CR_WAIT_S", 30.0, raising=False)
    r, w = os.pipe()
    first_read = threading.Event()
    got: list[tuple[bytes, bool]] = []

    class Pipe:
        def fileno(self) -> int:
            return r

        def read1(self, n: int) -> bytes:
            data = os.read(r, n)
            first_read.set()
            return data

    reader = threading.Thread(target=lambda: got.extend(pieces(Pipe())), daemon=True)  # type: ignore[arg-type]
    os.write(w, b"done\r")
    reader.start()
    try:
        assert first_read.wait(10)
        os.write(w, b"\n")
    finally:
        os.close(w)
        reader.join(10)
        os.close(r)
    assert got == [(b"done\r\n", False)]


@pytest.mark.timeout(20)
def test_a_lone_carriage_return_is_passed_on_without_the_next_byte() -> None:
    r, w = os.pipe()
    arrived = threading.Event()
    got: list[tuple[bytes, bool]] = []

    def read() -> None:
        with os.fdopen(r, "rb") as stream:
            for piece in pieces(stream):
                got.append(piece)
                arrived.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    os.write(w, b"step 3/10\r")
    try:
        assert arrived.wait(10), "the redraw waited for the next write"
        assert got == [(b"step 3/10\r", True)]
    finally:
        os.close(w)
        reader.join(10)

