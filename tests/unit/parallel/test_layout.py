"""Layouts: degrees, the world they need, rank coordinates, the bubble (no processes)."""

from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.parallel.layout import Coords, Layout


def test_data_degree_is_the_rest_of_the_world() -> None:
    layout = Layout(pipeline=2, tensor=2).resolve(8)
    assert layout.data == 2 and layout.size() == 8
    assert layout.describe() == "pipeline 2 x tensor 2 x data 2 (sharded), 8 micro-batches, 1f1b"


@pytest.mark.parametrize(("layout", "world", "words"), [
    (Layout(pipeline=3), 4, ["pipeline 3 x tensor 1 = 3", "world size 4", "divisors: 1, 2, 4"]),
    (Layout(tensor=2, data=3), 4, ["= 6 ranks", "world has 4"]),
])
def test_a_layout_that_does_not_fit_the_world_says_how_to_fix_it(
        layout: Layout, world: int, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        layout.resolve(world)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("kwargs", "word"), [
    ({"pipeline": 0}, "pipeline must be a whole number >= 1"),
    ({"tensor": True}, "tensor must be a whole number"),
    ({"schedule": "zb"}, "pick 1f1b"),
    ({"microbatches": 4}, "needs a pipeline"),
])
def test_bad_degrees_are_config_errors(kwargs: dict, word: str) -> None:
    with pytest.raises(ConfigError, match=word):
        Layout(**kwargs)


def test_schedule_names_are_normalised() -> None:
    assert Layout(pipeline=2, schedule=" GPipe ").schedule == "gpipe"


def test_tensor_ranks_are_neighbours_and_stages_furthest_apart() -> None:
    layout = Layout(pipeline=2, tensor=2).resolve(8)
    coords = [layout.coords(r) for r in range(8)]
    assert coords[0] == Coords(0, 0, 0) and coords[1] == Coords(0, 0, 1)
    assert coords[2] == Coords(0, 1, 0) and coords[4] == Coords(1, 0, 0)
    assert [layout.rank_of(c) for c in coords] == list(range(8))
    with pytest.raises(ConfigError):
        layout.coords(8)


@pytest.mark.parametrize(("p", "m", "bubble"), [(1, 1, 0.0), (2, 8, 1 / 9), (4, 4, 3 / 7)])
def test_bubble_is_p_minus_one_over_m_plus_p_minus_one(p: int, m: int, bubble: float) -> None:
    assert Layout(pipeline=p, microbatches=m if p > 1 else None).bubble == pytest.approx(bubble)


def test_default_microbatches_are_four_per_stage() -> None:
    assert Layout(pipeline=3).m == 12 and Layout().m == 1


def test_the_batch_must_split_into_microbatches() -> None:
    layout = Layout(pipeline=2, microbatches=4).resolve(2)
    layout.check_batch(8)
    with pytest.raises(ConfigError, match="multiple of 4"):
        layout.check_batch(6)
    Layout().resolve(1).check_batch(3)  # no pipeline: any batch


def test_sharding_one_replica_shards_nothing() -> None:
    assert not Layout(shard=True).resolve(1).sharded
    assert Layout(shard=True).resolve(2).sharded
    assert not Layout(shard=False).resolve(2).sharded


@pytest.mark.parametrize(("kwargs", "ok"), [
    ({"pipeline": 2, "microbatches": 1}, False),
    ({"pipeline": 3, "microbatches": 2, "schedule": "1F1B"}, False),
    ({"pipeline": 2, "microbatches": 2}, True),
    ({"pipeline": 2, "microbatches": 1, "schedule": "gpipe"}, True),  # GPipe has no such limit
])
def test_1f1b_needs_as_many_microbatches_as_stages(kwargs: dict, ok: bool) -> None:
    # Before: accepted here, then torch's Schedule1F1B raised a bare ValueError on every
    # rank from inside parallelize(), after the mesh was built.
    if ok:
        Layout(**kwargs)
        return
    with pytest.raises(ConfigError, match=r"1f1b needs at least as many micro-batches.*gpipe"):
        Layout(**kwargs)
