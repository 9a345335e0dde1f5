"""The loader's batches are DataLoader's: the same types, dtypes and values as
``torch.utils.data.default_collate`` (DataLoader with ``num_workers=0``) gives, for
every ``num_workers`` (in-process, two workers, whose first batch is loaded in halves,
and "auto"), on the list path and the streamed one (samples of 16 KiB or more)."""

from __future__ import annotations

import re
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from datahelp import Items, packed_half
from torch.utils.data import DataLoader
from torch.utils.data import default_collate as torch_collate

from ringtrain.data import Loader
from ringtrain.data.collate import (
    STREAM_MIN_BYTES,
    StreamCollator,
    default_collate,
    fresh_alloc,
    join_halves,
    unpack,
)
from ringtrain.data.prefetch import tree_map

Point = namedtuple("Point", "x y")
WORKERS = [0, 2, "auto"]


class Tagged(list):  # type: ignore[type-arg]
    """A list subclass: torch's collate keeps it (a copy of the first sample)."""


def _f(first: Any, later: Any, i: int, cut: int = 1) -> Any:
    return first if i < cut else later


def sample(i: int, big: bool = False) -> dict[str, Any]:
    """One sample with a field for each case (batch of 4: halves of 2 under workers)."""
    s: dict[str, Any] = {
        "tuple": (np.float32(i), i, f"p{i}"),  # -> a list; its strings a tuple
        "namedtuple": Point(i, [float(i), b"b"]),
        "ordered": OrderedDict(a=i, b=[i, "s"]),
        "list_subclass": Tagged([i, 2 * i]),
        "nested": {"a": [i, i + 1], "b": {"c": f"t{i}"}},
        "t_f32_f64": torch.full((3,), i + 0.1, dtype=_f(torch.float32, torch.float64, i)),
        "t_f64_f32": torch.full((3,), i + 0.1, dtype=_f(torch.float64, torch.float32, i, 2)),
        "t_int_float": _f(torch.tensor([i]), torch.tensor([i + 0.5]), i, 2),
        "t_bool_int": _f(torch.tensor([True]), torch.tensor([i]), i),
        "a_f32_f64": np.full(3, i + 0.1, _f(np.float32, np.float64, i, 2)),
        "a_i32_f32": np.full(2, i + 0.5, _f(np.int32, np.float32, i)),
        "a_u8_i8": np.full(2, i, _f(np.uint8, np.int8, i, 3)),
        "a0d_f32_f64": np.array(i + 0.1, _f(np.float32, np.float64, i)),
        "a0d_i16": np.array(i, np.int16),
        "n_float_int": _f(i + 0.5, i, i),
        "n_int_float": _f(i, i + 0.25, i, 2),
        "n_py_npf32": _f(0.1, np.float32(i + 0.1), i),
        "n_npf32_py": _f(np.float32(0.1), i + 0.1, i),
        "n_bool_int": _f(True, i, i),
        "n_i32_i64": _f(np.int32(i), np.int64(2**40 + i), i, 2),
        "n_f16": np.float16(i + 0.5),
        "n_c64": np.complex64(i + 1j),
        "str": f"s{i}",
        "bytes": bytes([i]),
    }
    if big:  # the sample is streamed; float64 rows then float32 ones widen the batch
        s["big"] = np.full(STREAM_MIN_BYTES // 8, i + 0.1, _f(np.float64, np.float32, i, 2))
        s["big_f32_f64"] = torch.full((STREAM_MIN_BYTES // 4,), i + 0.1,
                                      dtype=_f(torch.float32, torch.float64, i))
    return s


def same(got: Any, want: Any, where: str = "batch") -> None:
    """Equal types all the way down (list is not tuple, OrderedDict is not dict), equal
    dtypes and values."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{where}: {got.dtype} != {want.dtype}"
        assert torch.equal(got, want), f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for j, (x, y) in enumerate(zip(got, want, strict=True)):
            same(x, y, f"{where}[{j}]")
    else:
        assert got == want, where


def first_batch(items: list[Any], num_workers: int | str) -> Any:
    with Loader(Items(items), batch_size=len(items), shuffle=False, num_workers=num_workers,
                max_workers=2 if num_workers == "auto" else None, device="cpu", rank=0,
                world_size=1, timeout=30) as loader:
        return next(iter(loader))


def dataloader_batch(items: list[Any]) -> Any:
    return next(iter(DataLoader(Items(items), batch_size=len(items), shuffle=False)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("big", [False, True], ids=["list", "streamed"])
@pytest.mark.parametrize("num_workers", WORKERS)
def test_loader_batch_is_dataloaders(num_workers: int | str, big: bool) -> None:
    items = [sample(i, big) for i in range(4)]
    same(first_batch(items, num_workers), dataloader_batch(items))


@pytest.mark.parametrize("stream", [False, True], ids=["list", "streamed"])
def test_collate_paths_are_torchs(stream: bool) -> None:
    # The collate functions alone: whole, streamed and in halves (no processes).
    items = [sample(i, big=stream) for i in range(4)]
    want = torch_collate(items)
    same(default_collate(items), want)
    collator = StreamCollator(items[0], 4, fresh_alloc)
    for i, s in enumerate(items):
        collator.put(i, s)
    same(collator.result(), want)
    same(unpack(*join_halves(*packed_half(items[:2], stream), *packed_half(items[2:], stream))), want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", WORKERS)
def test_a_tuple_sample_gives_a_list_and_a_namedtuple_stays_one(num_workers: int | str) -> None:
    # The ringtrain batch was a tuple (DataLoader: a list), and the strings of a tuple
    # sample a list (DataLoader: the tuple zip made of them).
    items = [(torch.full((2,), float(i)), i, f"n{i}") for i in range(4)]
    got = first_batch(items, num_workers)
    same(got, dataloader_batch(items))
    assert type(got) is list and type(got[2]) is tuple
    points = [Point(i, f"y{i}") for i in range(4)]
    same(first_batch(points, num_workers), dataloader_batch(points))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", WORKERS)
def test_a_mapping_sample_keeps_its_type(num_workers: int | str) -> None:
    # The ringtrain batch of OrderedDict samples was a dict (DataLoader: an OrderedDict).
    items = [OrderedDict([("y", i), ("x", torch.ones(2) * i)]) for i in range(4)]
    got = first_batch(items, num_workers)
    same(got, dataloader_batch(items))
    assert type(got) is OrderedDict and list(got) == ["y", "x"]
    counts = []
    for i in range(4):
        d: defaultdict[str, Any] = defaultdict(list)
        d["v"] = i
        counts.append(d)
    got = first_batch(counts, num_workers)
    same(got, dataloader_batch(counts))
    assert got.default_factory is list


@pytest.mark.parametrize("first,later", [
    (torch.float32, torch.float64), (torch.float64, torch.float32),
    (torch.int64, torch.float32), (torch.bool, torch.int64), (torch.uint8, torch.int8),
    (torch.int32, torch.float16), (torch.float32, torch.complex64),
])
@pytest.mark.parametrize("kind", ["tensor", "array", "array0d"])
def test_mixed_dtypes_are_promoted_as_torch_stack(first: torch.dtype, later: torch.dtype,
                                                   kind: str) -> None:
    # A float32 sample first, float64 later: the batch was float32 (values rounded),
    # DataLoader's default_collate promotes to float64; ints then floats were refused.
    def make(i: int, n: int) -> Any:
        t = torch.full((n,) if kind != "array0d" else (), i + 0.7).to(first if i < 2 else later)
        return t if kind == "tensor" else t.numpy()
    for n in (3, STREAM_MIN_BYTES):  # list path, streamed
        items = [make(i, n) for i in range(4)]
        want = torch_collate(items)
        assert want.dtype == torch.promote_types(first, later)
        same(default_collate(items), want)
        if kind != "array0d":
            collator = StreamCollator(items[0], 4, fresh_alloc)
            for i, s in enumerate(items):
                collator.put(i, s)
            same(collator.result(), want)
            same(unpack(*join_halves(*packed_half(items[:2], n > 3), *packed_half(items[2:], n > 3))), want)


def test_the_device_copy_keeps_the_batch_types() -> None:
    # On CUDA every tensor of a batch is copied by tree_map: an OrderedDict batch came
    # out a dict, a list subclass a list.
    items = [OrderedDict(x=torch.ones(2) * i, tags=Tagged([i, "t"]), p=Point(i, (f"a{i}",)))
             for i in range(3)]
    want = torch_collate(items)
    same(tree_map(lambda t: t.clone(), want), want)


def test_halves_widened_past_their_buffers_join() -> None:
    # float64 rows then float32 ones: the joined batch (all float64) is larger than the
    # two halves' buffers together; joining them raised SlotFull out of the loader.
    items = [np.full(STREAM_MIN_BYTES // 8, i + 0.1, np.float64 if i < 2 else np.float32)
             for i in range(4)]
    a, b = packed_half(items[:2], True), packed_half(items[2:], True)
    a = (a[0], a[1][:2 * STREAM_MIN_BYTES])  # the buffers as tight as a worker's
    b = (b[0], b[1][:STREAM_MIN_BYTES])
    same(unpack(*join_halves(*a, *b)), torch_collate(items))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_what_dataloader_refuses_is_its_type_error(num_workers: int) -> None:
    # torch's collate raises TypeError for None, other objects and ndarrays of strings or
    # objects; so does the loader, with torch's words, for every num_workers.
    items = [{"none": None, "obj": np.array([f"u{i}", i], dtype=object),
              "ustr": np.array([f"s{i}"]), "x": i} for i in range(4)]
    for field in ("none", "obj", "ustr"):
        with pytest.raises(TypeError) as want:
            torch_collate([s[field] for s in items])
        with pytest.raises(TypeError, match=re.escape(str(want.value))):
            first_batch([{field: s[field], "x": s["x"]} for s in items], num_workers)


class WorkerInfos:
    """Each sample: what torch's get_worker_info() says in the worker that loads it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> list[int]:
        import os

        info = torch.utils.data.get_worker_info()
        assert info is not None
        return [info.id, info.num_workers, info.seed, os.getpid()]


def _infos(loader: Loader) -> list[list[int]]:
    return [row for b in loader for row in torch.stack(b, 1).tolist()]


@pytest.mark.timeout(60)
def test_worker_ids_stay_in_range_when_auto_changes_the_worker_count() -> None:
    # num_workers="auto" retires and starts workers as it tunes. Ids were numbered by
    # starts: after 2 -> 1 -> 2 workers, the new one said id 2 of num_workers 2.
    with Loader(WorkerInfos(), batch_size=1, shuffle=False, num_workers="auto", max_workers=2,
                device="cpu", rank=0, world_size=1, timeout=30) as loader:
        rows = _infos(loader)
        for n in (1, 2, 1, 2):  # as the autotuner changes it, between batches
            loader._set_workers(n)
            rows += _infos(loader)
        last = _infos(loader)
    for wid, num, _, _ in rows + last:
        assert 0 <= wid < num, rows
    ids = {pid: wid for wid, _, _, pid in last}
    assert len(set(ids.values())) == len(ids)  # workers running together: ids apart
    seeds = {pid: seed for _, _, seed, pid in rows + last}
    assert len(set(seeds.values())) == len(seeds)  # and every worker its own seed
