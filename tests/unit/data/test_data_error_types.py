"""Errors come out of the loader as DataLoader raises them: torch's collate refusals are
its ``TypeError`` (not a list of the values handed over), and what a dataset raised in
a worker is caught by the same ``except`` as under DataLoader (or ``num_workers=0``)."""

from __future__ import annotations

import collections
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from datahelp import Items
from torch.utils.data import default_collate as torch_collate

from ringtrain.data import Loader, default_collate
from ringtrain.data.collate import StreamCollator, fresh_alloc
from ringtrain.errors import DataError, WorkerError

Pair = collections.namedtuple("Pair", "x y")


class Thing:
    pass


REFUSED = {
    "none": lambda i: None,
    "complex": lambda i: complex(i, 1),
    "object": lambda i: Thing(),
    "set": lambda i: {i},
    "ndarray-str": lambda i: np.array([f"s{i}"]),
    "ndarray-object": lambda i: np.array([i, None], dtype=object),
    "datetime64": lambda i: np.datetime64("2020-01-01"),
    "dict-field": lambda i: {"x": i, "y": None},
    "tuple-field": lambda i: (torch.tensor(i), None),
    "namedtuple-field": lambda i: Pair(i, [i, Thing()]),
}


@pytest.mark.parametrize("make", REFUSED.values(), ids=REFUSED.keys())
def test_default_collate_refuses_what_torch_refuses(make: Any) -> None:
    samples = [make(i) for i in range(3)]
    with pytest.raises(TypeError) as want:
        torch_collate(samples)
    with pytest.raises(TypeError, match="default_collate: batch must contain") as got:
        default_collate(samples)
    assert str(got.value).startswith(str(want.value))  # torch's words, then the fix
    # The streamed path (samples of 16 KiB or more) refuses the same fields.
    big = [(np.zeros(4096, np.float32), s) for s in samples]
    with pytest.raises(TypeError, match="default_collate: batch must contain"):
        StreamCollator(big[0], len(big), fresh_alloc)


class Raises:
    """Sample ``i`` is ``i``, except where ``errors`` has an exception to raise."""

    def __init__(self, errors: dict[int, BaseException]) -> None:
        self.errors = errors

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i in self.errors:
            raise self.errors[i]
        return i


class NeedsTwo(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(a, b)


ERRORS: list[tuple[BaseException, tuple[type, ...]]] = [
    (KeyError("k"), (KeyError,)),
    (FileNotFoundError(2, "no such file"), (FileNotFoundError, OSError)),
    (IndexError("i"), (IndexError,)),
    (NeedsTwo(1, 2), (NeedsTwo,)),
    # Not a StopIteration: that would end the loop's `for` without a word (DataLoader's
    # silent loss of the rest of the epoch).
    (StopIteration(), (WorkerError,)),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error,caught_as", ERRORS, ids=[type(e).__name__ for e, _ in ERRORS])
def test_a_workers_error_is_caught_as_its_type(error: BaseException, caught_as: tuple[type, ...]
                                               ) -> None:
    with Loader(Raises({3: error}), batch_size=2, shuffle=False, num_workers=1, device="cpu",
                rank=0, world_size=1, timeout=30) as loader:
        got = []
        with pytest.raises(WorkerError) as err:
            for batch in loader:
                got += batch.tolist()
        assert got == [0, 1]
        assert all(isinstance(err.value, cls) for cls in caught_as), type(err.value).__mro__
        if type(error) is not StopIteration:
            assert not isinstance(err.value, StopIteration)
        message = str(err.value)  # one line naming the sample, then the worker's traceback
        assert message.startswith("loader worker 0 (pid ") and "sample index 3" in message
        assert f"{type(error).__name__}" in message and "Traceback" in message
        assert str(err.value) == err.value.args[0]  # not KeyError's quoted repr
        # The loader goes on: after a fix (here: state that skips the bad batch) it loads.
        loader.dataset.errors.clear()  # the next pass starts fresh workers
        assert [b.tolist() for b in loader] == [[2, 3], [4, 5], [6, 7]]


@pytest.mark.timeout(60)
def test_collate_refusal_in_a_worker_is_a_type_error() -> None:
    with Loader(Items([{"x": i, "y": None} for i in range(4)]), batch_size=4, shuffle=False,
                num_workers=2, device="cpu", rank=0, world_size=1, timeout=30) as loader:
        with pytest.raises(TypeError, match="found <class 'NoneType'>") as err:
            next(iter(loader))
        assert isinstance(err.value, WorkerError)


def test_worker_error_pickles_and_keeps_its_types() -> None:
    from ringtrain.data.workers import worker_error

    for cause in (KeyError, OSError, NeedsTwo, TypeError):
        err = worker_error("loader worker 0 raised it", cause)
        back = pickle.loads(pickle.dumps(err))
        assert isinstance(back, cause) and isinstance(back, WorkerError)
        assert str(back) == "loader worker 0 raised it"
    # A DataError (the loader's own, e.g. shapes that do not stack) stays a WorkerError;
    # an exception that takes more than a message is a WorkerError only.
    assert type(worker_error("m", DataError)) is WorkerError
    assert type(worker_error("m", UnicodeDecodeError)) is WorkerError
    assert type(worker_error("m", None)) is WorkerError
