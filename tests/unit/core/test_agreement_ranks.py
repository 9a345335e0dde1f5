"""The one helper behind every "do the ranks agree" check (ringtrain.agreement.ranks)."""

from __future__ import annotations

from ringtrain.agreement import group_ranks, settle


def test_groups_are_in_the_order_of_their_lowest_rank() -> None:
    assert group_ranks(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4], [3]]
    assert group_ranks({3: 1, 0: 2, 1: 1}) == [[0], [1, 3]]
    assert group_ranks([(3,), (4,), (3,)], key=len) == [[0, 1, 2]]  # one group: they agree


def test_settle_names_the_ranks_with_a_problem_alike_everywhere() -> None:
    everyone = ["bad layout", None, "bad layout"]
    assert settle(None, lambda _mine: everyone) == {0: "bad layout", 2: "bad layout"}
    assert settle("no file", lambda mine: [mine]) == {0: "no file"}  # rank 0's verdict
    assert settle(None, lambda mine: [mine, None]) == {}
