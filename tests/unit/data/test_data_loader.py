"""The loader in-process (num_workers=0): arguments, order, epochs, resume, hooks."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from ringtrain.data import Loader
from ringtrain.errors import DataError


class Indexed:
    """Sample i is (x[i], i): every batch says which samples it holds."""

    def __init__(self, n: int) -> None:
        self.x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i], i


class Batched(Indexed):
    calls = 0

    def __getitems__(self, indices: list[int]) -> list[tuple[np.ndarray, int]]:
        Batched.calls += 1
        return [(self.x[i], -i) for i in indices]


def indices_of(loader: Loader, limit: int | None = None) -> list[list[int]]:
    """Sample indices of each batch, taking at most ``limit`` batches from the loader."""
    it = iter(loader)
    out = []
    while limit is None or len(out) < limit:
        try:
            _, i = next(it)
        except StopIteration:
            break
        out.append(i.tolist())
    return out


def make(n: int = 1000, **kw: Any) -> Loader:
    kw.setdefault("batch_size", 32)
    kw.setdefault("num_workers", 0)
    kw.setdefault("device", "cpu")
    return Loader(Indexed(n), **kw)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=0), "batch_size"), (dict(batch_size=-3), "batch_size"),
    (dict(batch_size=2.5), "batch_size"), (dict(num_workers=-1), "num_workers"),
    (dict(num_workers="many"), "num_workers"), (dict(rank=1), "together"),
    (dict(rank=3, world_size=2), "outside"), (dict(seed=-1), "seed"),
    (dict(prefetch=0), "prefetch"), (dict(keep=0), "keep"),
    # Before: a rank from os.environ raised TypeError "'<=' not supported between
    # instances of 'int' and 'str'", a float rank was accepted (float sample positions),
    # and max_workers=0 meant the default, a negative one was taken as the bound.
    (dict(rank="0", world_size="2"), "rank must be an int"),
    (dict(rank=0, world_size=2.0), "world_size must be an int"),
    (dict(rank=1.0, world_size=2), "rank must be an int"),
    (dict(num_workers="auto", max_workers=0), "max_workers"),
    (dict(num_workers="auto", max_workers=-3), "max_workers"),
    (dict(num_workers="auto", max_workers=2.5), "max_workers"),
])
def test_bad_arguments_are_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(DataError, match=match):
        make(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(DataError, match="CUDA is not available"):
        make(device="cuda")


def test_empty_and_non_map_datasets_are_clear_errors() -> None:
    with pytest.raises(DataError, match="empty"):
        Loader([], num_workers=0)
    with pytest.raises(DataError, match="map-style"):
        Loader(iter(range(3)), num_workers=0)
    with pytest.raises(DataError, match="drop_last"):
        iter(make(10, batch_size=32, drop_last=True))


def test_same_seed_same_order_each_epoch_differs() -> None:
    a, b = make(seed=3), make(seed=3)
    assert indices_of(a) == indices_of(b)
    first, second = indices_of(a), indices_of(a)  # epochs 1 and 2 (auto-advanced)
    assert first != second
    assert sorted(sum(first, [])) == list(range(1000))
    assert indices_of(make(seed=4)) != indices_of(make(seed=3))
    plain = make(shuffle=False)
    assert sum(indices_of(plain), []) == list(range(1000))


def test_set_epoch_selects_the_order() -> None:
    a, b = make(), make()
    a.set_epoch(5)
    for _ in range(5):
        indices_of(b)
    assert b.epoch == 5 and indices_of(a) == indices_of(b)


def test_len_and_last_batch() -> None:
    loader = make(1000, batch_size=32)
    batches = indices_of(loader)
    assert len(loader) == len(batches) == 32 and len(batches[-1]) == 1000 - 31 * 32
    assert len(make(1000, batch_size=32, drop_last=True)) == 31


@pytest.mark.parametrize("stop_after", [0, 1, 13, 31])
def test_resume_mid_epoch_is_exact(stop_after: int) -> None:
    ref = make()
    ref.set_epoch(2)
    expected = indices_of(ref) + indices_of(ref)  # epochs 2 and 3
    run = make()
    run.set_epoch(2)
    got = indices_of(run, limit=stop_after)
    state = run.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(2 if stop_after < 32 else 3)  # the usual loop calls set_epoch again
    got += indices_of(resumed)
    got += indices_of(resumed)  # and the next epoch goes on normally
    assert got == expected


def test_state_after_a_full_epoch_points_at_the_next() -> None:
    loader = make()
    indices_of(loader)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)
    assert loader.state_dict()["epoch"] == 2  # last batch handed out: epoch 1 is done


@pytest.mark.parametrize("where", ["last batch", "after the loop"])
@pytest.mark.parametrize("resume_at", ["saved epoch", "next epoch"])
def test_a_checkpoint_at_an_epochs_end_resumes_without_running_it_again(
        where: str, resume_at: str) -> None:
    # The loop saves {"epoch": e, "loader": state} at its last batch (or after it) and
    # resumes with set_epoch(e): epoch e has nothing left (it ran again before), as a
    # loop that resumes with set_epoch(e + 1) sees too.
    ref = make(100)
    expected = [indices_of(ref) for _ in range(2)][1]  # epoch 1
    run = make(100)
    it = iter(run)
    for _ in range(len(run)):
        next(it)
    if where == "after the loop":
        assert next(it, None) is None
    saved_epoch, state = 0, run.state_dict()
    resumed = make(100)
    resumed.load_state_dict(state)
    got = []
    for epoch in range(saved_epoch if resume_at == "saved epoch" else saved_epoch + 1, 2):
        resumed.set_epoch(epoch)
        got.append(indices_of(resumed))
    assert got[-1] == expected and sum(len(g) for g in got) == len(expected)


def test_set_epoch_again_in_the_same_loader_runs_the_whole_epoch() -> None:
    # Only a restored state skips its finished epoch: a loop that evaluates with
    # set_epoch(0) each time gets every batch each time.
    loader = make(100)
    first = indices_of(loader)
    loader.set_epoch(0)
    assert indices_of(loader) == first


def test_resume_with_another_world_size_covers_the_rest() -> None:
    olds = [make(999, rank=r, world_size=3) for r in range(3)]
    seen = []
    for loader in olds:
        seen += sum(indices_of(loader, limit=4), [])
    state = olds[0].state_dict()
    news = [make(999, rank=r, world_size=2) for r in range(2)]
    rest = []
    for loader in news:
        loader.load_state_dict(state)
        rest += sum(indices_of(loader), [])
    assert set(seen + rest) == set(range(999))
    assert len(seen + rest) - 999 < 2  # at most one padding sample per new rank


def test_state_from_another_dataset_or_seed_is_refused() -> None:
    state = make().state_dict()
    with pytest.raises(DataError, match="num_samples"):
        make(500).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        make(seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="not a Loader state"):
        make().load_state_dict({"epoch": 1})


def test_getitems_is_used_when_present() -> None:
    Batched.calls = 0
    loader = Loader(Batched(100), batch_size=10, num_workers=0, device="cpu")
    batches = list(loader)
    assert Batched.calls == 10 and all((b[1] <= 0).all() for b in batches)


def test_custom_collate_and_dict_samples() -> None:
    class Dicts:
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"v": torch.full((2,), i), "name": f"s{i}"}

    loader = Loader(Dicts(), batch_size=4, num_workers=0, device="cpu", shuffle=False)
    first = next(iter(loader))
    assert first["name"] == ["s0", "s1", "s2", "s3"] and first["v"].shape == (4, 2)
    custom = Loader(Dicts(), batch_size=4, num_workers=0, device="cpu", shuffle=False,
                    collate_fn=lambda s: len(s))
    assert list(custom) == [4, 4, 2]


def test_dataset_error_in_process_keeps_its_type_and_names_the_index() -> None:
    class Bad(Indexed):
        def __getitem__(self, i: int) -> Any:
            if i == 7:
                raise KeyError("boom")
            return super().__getitem__(i)

    loader = Loader(Bad(50), batch_size=8, num_workers=0, device="cpu", shuffle=False)
    with pytest.raises(KeyError) as info:
        list(loader)
    assert any("sample index 7" in note for note in getattr(info.value, "__notes__", []))


def test_timing_hooks() -> None:
    loader = make()
    for _ in loader:
        assert loader.last_wait_s >= 0
    stats = loader.stats()
    assert stats["batches"] == len(loader) and stats["total_wait_s"] > 0
    assert loader.last_h2d_s == 0.0


def test_auto_workers_are_visible(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ringtrain.data"):
        loader = Loader(Indexed(10), num_workers="auto", device="cpu")
    assert isinstance(loader.num_workers, int) and loader.num_workers >= 1
    assert loader.cpu_budget is not None
    assert any("num_workers=auto ->" in r.getMessage() for r in caplog.records)
    loader.close()


def test_max_workers_bounds_the_first_auto_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: on a budget of 2 CPUs, num_workers="auto" with max_workers=1 started 2
    # workers (max_workers bounded only the tuner's growth).
    import ringtrain.data.loader as loader_mod
    from ringtrain.cpus import CpuBudget

    monkeypatch.setattr(loader_mod, "cpu_budget",
                        lambda share=1: CpuBudget(affinity=4, quota=None, share=1))
    loader = Loader(Indexed(10), num_workers="auto", max_workers=1, device="cpu")
    assert loader.num_workers == 1
    loader.close()


def test_max_workers_without_auto_is_a_warning() -> None:
    # Before: accepted and silently ignored.
    with pytest.warns(UserWarning, match="max_workers=1 has no effect with num_workers=0"):
        make(num_workers=0, max_workers=1).close()
