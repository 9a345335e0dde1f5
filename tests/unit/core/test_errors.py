"""The two message helpers every error message uses: an exception's first line and a
list of ranks (pure)."""

from __future__ import annotations

import pytest

from ringtrain.errors import first_line, rank_list, ranks_phrase


@pytest.mark.parametrize("exc,limit,want", [
    (RuntimeError("Connection closed by peer\nException raised from recvBytes"), 200, "Connection closed by peer"),
    (RuntimeError("\n  wait timeout after 500ms  \nframe #0"), 200, "wait timeout after 500ms"),
    (KeyError(), 200, "KeyError"),                      # nothing to quote: the type says it
    (RuntimeError("x" * 300), 200, "x" * 197 + "..."),
    # cut at a word, never inside one ("caused by a remote wo" read as another word)
    (RuntimeError("a peer was lost, " * 20), 40, "a peer was lost, a peer was lost, a..."),
    (RuntimeError("x" * 300), None, "x" * 300),
])
def test_first_line(exc: BaseException, limit: int | None, want: str) -> None:
    assert first_line(exc, limit) == want


def test_rank_lists_are_sorted_and_shortened_the_same_way_everywhere() -> None:
    assert rank_list([2, 0]) == "0, 2"
    assert rank_list(range(20)) == "0, 1, 2, 3, 4, 5, 6, 7, ... (20 ranks)"
    assert ranks_phrase([3]) == "rank 3"
    assert ranks_phrase([1, 0]) == "ranks 0, 1"
