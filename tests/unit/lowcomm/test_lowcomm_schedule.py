"""The periodic modes' pure parts: fragments, their staggered schedule, and the
first-step agreement's message (no processes)."""

from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.lowcomm import checks, fragments


@pytest.mark.parametrize("numels,f,expected", [
    ([10, 10, 10, 10], 1, [[0, 1, 2, 3]]),
    ([10, 10, 10, 10], 2, [[0, 1], [2, 3]]),
    ([10, 10, 10, 10], 4, [[0], [1], [2], [3]]),
    ([64, 16, 32, 2], 2, [[0], [1, 2, 3]]),      # the tests' MLP
    ([1, 1, 1, 100], 2, [[0, 1, 2], [3]]),       # a big last tensor stands alone
    ([100, 1, 1, 1], 3, [[0], [1], [2, 3]]),     # every fragment keeps at least one tensor
    ([5, 5, 5, 5, 5, 5], 3, [[0, 1], [2, 3], [4, 5]]),
])
def test_split_cuts_consecutive_runs_of_even_size(numels: list[int], f: int, expected: list[list[int]]) -> None:
    parts = fragments.split(numels, f)
    assert parts == expected
    assert [i for p in parts for i in p] == list(range(len(numels)))


@pytest.mark.parametrize("f", [0, 5])
def test_split_refuses_more_fragments_than_tensors(f: int) -> None:
    with pytest.raises(ConfigError, match="fragments"):
        fragments.split([1, 2, 3, 4], f)


@pytest.mark.parametrize("h,f,expected", [
    (1, 1, {0: [1, 2, 3, 4, 5, 6]}),
    (3, 1, {0: [3, 6, 9, 12]}),
    (50, 2, {0: [25, 75, 125], 1: [50, 100, 150]}),
    (3, 2, {0: [1, 4, 7, 10], 1: [3, 6, 9, 12]}),
    (4, 4, {0: [1, 5, 9], 1: [2, 6, 10], 2: [3, 7, 11], 3: [4, 8, 12]}),
])
def test_each_fragment_syncs_every_h_steps_at_its_own_phase(h: int, f: int, expected: dict[int, list[int]]) -> None:
    horizon = max(s for steps in expected.values() for s in steps)
    got: dict[int, list[int]] = {}
    for step in range(0, horizon + 1):
        for frag in fragments.due(step, h, f):
            got.setdefault(frag, []).append(step)
    assert got == expected
    # No step carries two fragments: the peak per step is one fragment.
    assert all(len(fragments.due(s, h, f)) <= 1 for s in range(1, 10 * h))


def test_the_same_settings_agree() -> None:
    e = [("w", (2, 2), "float32")]
    s = {"sync_every": "5"}
    assert checks.disagreement("DiLoCo", [e, e, e], [s, s, s]) is None


def test_a_differing_setting_is_named_with_every_value_and_its_ranks() -> None:
    e = [("w", (2, 2), "float32")]
    settings = [{"sync_every": "10", "fragments": "1"}, {"sync_every": "10", "fragments": "2"},
                {"sync_every": "20", "fragments": "2"}]
    msg = checks.disagreement("LocalSGD", [e] * 3, settings)
    assert msg is not None
    assert msg.startswith("rt.LocalSGD: sync_every differs between ranks: 10 on ranks 0, 1; 20 on rank 2.")
    assert "the same sync_every" in msg


def test_a_differing_model_names_the_first_tensor() -> None:
    a = [("w", (2, 2), "float32"), ("b", (2,), "float32")]
    b = [("w", (2, 2), "float32"), ("b", (3,), "float32")]
    msg = checks.disagreement("DiLoCo", [a, b], [{}, {}])
    assert msg is not None and "tensor #1" in msg and "(3,)" in msg and "rank 1" in msg


def test_a_differing_model_names_the_ranks_on_each_side() -> None:
    a = [("w", (2, 2), "float32")]
    b = [("w", (2, 2), "float16")]
    msg = checks.disagreement("LocalSGD", [a, b, a, b], [{}] * 4)
    assert msg is not None and "float32') on ranks 0, 2 but" in msg and "float16') on ranks 1, 3" in msg


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3", None])
def test_counts_must_be_whole_numbers_of_at_least_one(value: object) -> None:
    with pytest.raises(ConfigError, match=r"rt.DiLoCo: sync_every must be a whole number >= 1"):
        checks.check_count("DiLoCo", "sync_every", value)
