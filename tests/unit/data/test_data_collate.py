"""Default collate and the spec a batch travels as (no processes)."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from datahelp import packed_half

from ringtrain.data.collate import (
    STREAM_MIN_BYTES,
    Arena,
    SlotFull,
    StreamCollator,
    default_collate,
    fresh_alloc,
    join_halves,
    pack,
    sample_nbytes,
    spec_nbytes,
    unpack,
)
from ringtrain.data.workers import SampleError, load_batch
from ringtrain.errors import DataError

Pair = namedtuple("Pair", "x y")


@pytest.mark.parametrize("values", [[0, 0.5, 1], [0.5, 0, 1], [True, 2], [1, True],
                                    [True, False], [np.int32(1), 2**40], [1, np.float32(0.5)],
                                    [np.uint8(3), np.uint8(4)], [1, 2], [1.0, 2.0]])
def test_numbers_have_torchs_collate_dtype_and_keep_their_values(values: list[Any]) -> None:
    # An int first and floats later were cut to ints ([0, 0.5, 1] -> [0, 0, 1]).
    want = torch.utils.data.default_collate(values)
    streamed = StreamCollator(values[0], len(values), fresh_alloc)
    for i, v in enumerate(values):
        streamed.put(i, v)
    for got in (default_collate(values), streamed.result()):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_tuple_of_array_and_int() -> None:
    samples = [(np.full(4, i, np.float32), i) for i in range(5)]
    x, y = default_collate(samples)
    assert isinstance(x, torch.Tensor) and x.shape == (5, 4) and x.dtype == torch.float32
    assert torch.equal(x[:, 0], torch.arange(5, dtype=torch.float32))
    assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2, 3, 4]


def test_dict_with_strings_and_numbers() -> None:
    samples = [{"img": torch.ones(2, 3) * i, "name": f"n{i}", "w": 0.5 * i, "ok": i % 2 == 0}
               for i in range(3)]
    batch = default_collate(samples)
    assert batch["img"].shape == (3, 2, 3)
    assert batch["name"] == ["n0", "n1", "n2"]
    assert batch["w"].dtype == torch.float64 and batch["w"].tolist() == [0.0, 0.5, 1.0]
    assert batch["ok"].dtype == torch.bool and batch["ok"].tolist() == [True, False, True]


def test_namedtuple_list_fields_and_none_refused() -> None:
    batch = default_collate([Pair(np.int32(i), [i, f"s{i}"]) for i in range(3)])
    assert isinstance(batch, Pair)
    assert batch.x.dtype == torch.int32
    assert isinstance(batch.y, list) and batch.y[0].tolist() == [0, 1, 2]
    assert batch.y[1] == ("s0", "s1", "s2")
    with pytest.raises(TypeError, match="found <class 'NoneType'>"):  # as torch's collate
        default_collate([Pair(np.int32(i), [i, None]) for i in range(3)])


def test_different_shapes_are_a_clear_error() -> None:
    with pytest.raises(DataError, match="different shapes"):
        default_collate([np.zeros((3, 2)), np.zeros((2, 2))])
    with pytest.raises(DataError, match="different shapes"):
        default_collate([torch.zeros(3), torch.zeros(4)])


def test_different_lengths_are_a_clear_error() -> None:
    with pytest.raises(DataError, match="different lengths"):
        default_collate([(1, 2), (1, 2, 3)])


def test_collate_writes_into_the_given_buffer() -> None:
    arena = Arena(np.zeros(4096, np.uint8))
    x, y = default_collate([(np.ones(8, np.float32), 1)] * 4, arena.alloc)
    assert arena.offset_of(x.data_ptr(), x.numel() * 4) >= 0
    assert arena.offset_of(y.data_ptr(), y.numel() * 8) >= 0


def test_arena_overflow_raises_slot_full() -> None:
    arena = Arena(np.zeros(64, np.uint8))
    with pytest.raises(SlotFull):
        default_collate([np.zeros(100, np.uint8)] * 2, arena.alloc)


def test_pack_unpack_round_trip_of_mixed_batch() -> None:
    batch = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # non-contiguous
        "b": np.arange(6, dtype=np.int16).reshape(2, 3),
        "c": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),  # no numpy equivalent
        "d": [torch.ones(2), torch.zeros(3)],
        "e": ("text", 7),
        "f": Pair(torch.tensor([1]), "y"),
    }
    arena = Arena(np.zeros(spec_nbytes(batch), np.uint8))
    spec = pack(batch, arena)
    for copy in (False, True):
        out = unpack(spec, arena.buf, copy=copy)
        assert torch.equal(out["a"], batch["a"])
        assert isinstance(out["b"], np.ndarray) and np.array_equal(out["b"], batch["b"])
        assert out["c"].dtype == torch.bfloat16 and torch.equal(out["c"], batch["c"])
        assert [t.tolist() for t in out["d"]] == [[1.0, 1.0], [0.0, 0.0, 0.0]]
        assert out["e"] == ("text", 7)
        assert isinstance(out["f"], Pair) and out["f"].y == "y"


def test_unpack_copy_is_independent_of_the_buffer() -> None:
    arena = Arena(np.zeros(1024, np.uint8))
    spec = pack(torch.arange(4), arena)
    view, copied = unpack(spec, arena.buf), unpack(spec, arena.buf, copy=True)
    arena.buf[:] = 0
    assert view.tolist() == [0, 0, 0, 0]
    assert copied.tolist() == [0, 1, 2, 3]


def test_pack_refuses_device_tensors() -> None:
    meta = torch.empty(2, device="meta")
    with pytest.raises(DataError, match="CPU"):
        pack(meta, Arena(np.zeros(64, np.uint8)))


def _big_samples(n: int) -> list[Any]:
    return [({"img": np.full((3, 40, 40), i, np.float32), "name": f"n{i}"},
             torch.full((5000,), i, dtype=torch.int16), i, 0.5 * i) for i in range(n)]


def test_stream_collator_matches_default_collate() -> None:
    samples = _big_samples(6)
    assert sample_nbytes(samples[0]) >= STREAM_MIN_BYTES
    collator = StreamCollator(samples[0], len(samples), fresh_alloc)
    for i, s in enumerate(samples):
        collator.put(i, s)
    got, want = collator.result(), default_collate(samples)
    assert torch.equal(got[0]["img"], want[0]["img"]) and got[0]["name"] == want[0]["name"]
    assert torch.equal(got[1], want[1]) and got[1].dtype == torch.int16
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


def test_stream_collator_rejects_a_different_shape() -> None:
    samples = _big_samples(2)
    collator = StreamCollator(samples[0], 2, fresh_alloc)
    bad = ({"img": np.zeros((3, 40, 41), np.float32), "name": "x"}, *samples[1][1:])
    with pytest.raises(DataError, match=r"sample\[0\]\['img'\] of shape \(3, 40, 41\)"):
        collator.put(1, bad)


def test_load_batch_streams_large_samples_and_names_failing_indices() -> None:
    class Big:
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> Any:
            if i == 7:
                raise OSError("unreadable")
            return np.full(8192, i, np.float32), i

    x, y = load_batch(Big(), np.array([3, 1, 4]), None, fresh_alloc)
    assert x[:, 0].tolist() == [3.0, 1.0, 4.0] and y.tolist() == [3, 1, 4]
    with pytest.raises(SampleError) as info:
        load_batch(Big(), np.array([3, 7]), None, fresh_alloc)
    assert info.value.index == 7 and isinstance(info.value.__cause__, OSError)


# ---- a batch from its two halves -------------------------------------------------------
def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("make", [
    lambda i: (np.full((2, 3), i, np.uint8), i),
    lambda i: {"img": torch.full((3,), float(i)), "name": f"n{i}", "w": 0.5 * i, "ok": i % 2 == 0},
    lambda i: Pair(torch.tensor([i, i]), [np.float32(i), f"s{i}"]),
    lambda i: [f"u{i}".encode(), i],
    lambda i: (f"s{i}", np.int16(i)),
    lambda i: (i % 3 == 0, 0.5 * i if i > 2 else i),  # ints, then floats: float32 as torch
    lambda i: 0.5 if i == 0 else i,  # a float, then ints: float64
    # The batch has its first sample's keys, in its order, as torch's collate gives it;
    # the second half's first sample has more keys, or the same in another order.
    lambda i: {"a": i} if i == 0 else {"b": -i, "a": i},
    lambda i: {"a": i, "b": -i} if i < 2 else {"b": -i, "a": i},
], ids=["tuple", "dict", "namedtuple-list", "bytes", "str", "int-then-float",
        "float-then-int", "dict-first-has-fewer-keys", "dict-keys-reordered"])
@pytest.mark.parametrize("n,cut", [(7, 3), (8, 4), (2, 1)])
@pytest.mark.parametrize("stream", [False, True], ids=["list", "streamed"])
def test_joined_halves_are_the_batch_collated_whole(make: Any, n: int, cut: int,
                                                    stream: bool) -> None:
    samples = [make(i) for i in range(n)]
    whole = default_collate(samples)
    (sa, ba), (sb, bb) = packed_half(samples[:cut], stream), packed_half(samples[cut:], stream)
    spec, buf = join_halves(sa, ba, sb, bb)
    _same(whole, unpack(spec, buf))


def test_joined_numbers_follow_the_whole_batchs_rule() -> None:
    # Every way of cutting mixed bools, ints and floats gives torch's collate of the
    # whole list, dtype and value (a half typed alone would round or widen them).
    rng = np.random.default_rng(1)
    kinds = [lambda: bool(rng.integers(2)), lambda: int(rng.integers(6)), lambda: float(rng.random())]
    for _ in range(300):
        values = [kinds[rng.integers(3)]() for _ in range(int(rng.integers(2, 9)))]
        want = torch.utils.data.default_collate(values)
        cut = len(values) // 2
        spec, buf = join_halves(*packed_half(values[:cut]), *packed_half(values[cut:]))
        got = unpack(spec, buf)
        assert got.dtype == want.dtype and torch.equal(got, want), values


def test_halves_that_could_not_be_one_batch_are_a_clear_error() -> None:
    a = packed_half([(np.zeros(3, np.float32), 0)] * 2)
    b = packed_half([(np.zeros(4, np.float32), 0)] * 2)
    with pytest.raises(DataError, match=r"cannot stack sample\[0\] of shape \(4,\)"):
        join_halves(*a, *b)
    c = packed_half([{"x": 1}] * 2)
    d = packed_half([{"y": 1}] * 2)
    with pytest.raises(DataError, match="differ in structure"):
        join_halves(*c, *d)
