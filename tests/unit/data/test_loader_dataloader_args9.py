"""DataLoader's arguments that rt.data.Loader does not take are one DataError naming what
to use instead (a script moved from DataLoader); any other unknown keyword stays
Python's TypeError. No workers start: the check comes first. pin_memory=True without a CUDA
device warns, as DataLoader does."""

from __future__ import annotations

import warnings

import pytest
import torch

from ringtrain.data import Loader
from ringtrain.errors import DataError

DATA = list(range(8))


@pytest.mark.parametrize("name,value,fix", [
    ("sampler", torch.utils.data.SequentialSampler(DATA), "keep DataLoader for a custom sampler"),
    ("batch_sampler", None, "makes the batches itself"),
    ("generator", torch.Generator(), "pass seed="),
    ("persistent_workers", True, "stay up across epochs already"),
    ("prefetch_factor", 2, "pass prefetch=N"),
    ("multiprocessing_context", "spawn", "pass start_method="),
    ("pin_memory_device", "cuda", "batches go to device="),
    ("in_order", True, "always come in order"),
])
def test_a_dataloader_argument_names_what_to_use(name: str, value: object, fix: str) -> None:
    with pytest.raises(DataError, match=f"rt.data.Loader takes no {name}=: .*{fix}"):
        Loader(DATA, batch_size=2, num_workers=0, **{name: value})


def test_another_unknown_argument_is_pythons_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        Loader(DATA, batch_size=2, num_workers=0, bogus=1)


def test_pin_memory_without_a_cuda_device_warns_as_dataloader_does() -> None:
    with pytest.warns(UserWarning, match="pin_memory=True has no effect: batches go to cpu"):
        loader = Loader(DATA, batch_size=2, num_workers=0, device="cpu", pin_memory=True)
    assert len(list(loader)) == len(loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Loader(DATA, batch_size=2, num_workers=0, device="cpu")  # the default: no warning
