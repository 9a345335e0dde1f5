"""Strategy construction, option validation and the tensor helpers (no processes)."""

from __future__ import annotations

import re

import pytest
import torch

from ringtrain import collectives
from ringtrain.agreement.signature import strategy_settings
from ringtrain.collectives import ReduceOp
from ringtrain.errors import ConfigError
from ringtrain.sync import STRATEGIES, Native, ParameterServer, Ring, make_strategy, resolve
from ringtrain.sync._tensors import ScratchPool, aligned_spans, combine_, even_spans, flat_work


def test_one_table_names_every_strategy() -> None:
    assert STRATEGIES == {"native": Native, "ring": Ring, "ps": ParameterServer}
    assert not hasattr(collectives, "register_algorithm"), "the collectives are not filled in on import"


def test_resolve_needs_no_import_side_effect() -> None:
    assert isinstance(resolve("ring"), Ring) and resolve("ring") is resolve("ring")
    fn = Native()
    assert resolve(fn) is fn


@pytest.mark.parametrize("name,options,cls", [
    ("native", {}, Native),
    ("native", {"stall_timeout": 5}, Native),
    ("ring", {"chunks_per_rank": 2}, Ring),
    ("ps", {"ps_servers": 2}, ParameterServer),
])
def test_make_strategy(name: str, options: dict, cls: type) -> None:
    s = make_strategy(name, **options)
    assert isinstance(s, cls)
    if "ps_servers" in options:
        assert s.servers == options["ps_servers"]
        assert s.signature() == {"strategy": "ps", "ps_servers": "2"}
    assert "stall_timeout" not in s.signature()  # may differ between ranks


@pytest.mark.parametrize("name,options,words", [
    ("native", {"ps_servers": 2}, "apply to strategy 'ps', not to strategy='native'"),
    ("ring", {"ps_servers": 2}, "apply to strategy 'ps', not to strategy='ring'"),
    ("native", {"gradient_predivide": 2}, "unknown argument(s) ['gradient_predivide']"),
    ("nope", {}, "unknown strategy 'nope'; choose one of: native, ring, ps"),
    ("ps", {"ps_servers": 0}, "ps_servers must be an integer >= 1"),
    ("ring", {"chunks_per_rank": 0}, "chunks_per_rank must be an integer >= 1"),
    ("native", {"stall_timeout": 0}, "stall_timeout must be a finite number > 0"),
    ("ring", {"stall_timeout": float("inf")}, "stall_timeout must be a finite number > 0"),
])
def test_bad_options_are_config_errors(name: str, options: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        make_strategy(name, **options)


def test_callable_passes_through_but_not_with_options() -> None:
    ring = Ring()
    assert make_strategy(ring) is ring
    with pytest.raises(ConfigError, match="only apply to a strategy given by name"):
        make_strategy(ring, ps_servers=2)


def test_ps_needs_enough_ranks() -> None:
    with pytest.raises(ConfigError, match="ps_servers=3 but the job has only 2"):
        ParameterServer(servers=3).check_world(2)


def test_repr_shows_options() -> None:
    assert repr(ParameterServer(servers=2)) == "ParameterServer(ps_servers=2)"
    assert repr(Ring(chunks_per_rank=3, stall_timeout=4.0)) == "Ring(chunks_per_rank=3, stall_timeout=4.0)"


@pytest.mark.parametrize("length", [0, 1, 5, 97, 1000])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_even_spans_cover_exactly(length: int, parts: int) -> None:
    spans = even_spans(length, parts, start=10)
    assert len(spans) == parts
    assert spans[0][0] == 10 and sum(s for _, s in spans) == length
    assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert max(s for _, s in spans) - min(s for _, s in spans) <= 1


@pytest.mark.parametrize("length,parts,itemsize", [(0, 2, 4), (3, 4, 4), (1000, 3, 2), (10**6, 7, 8)])
def test_aligned_spans(length: int, parts: int, itemsize: int) -> None:
    spans = aligned_spans(length, parts, itemsize)
    assert len(spans) == parts and sum(s for _, s in spans) == length
    assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all(start * itemsize % 64 == 0 for start, size in spans if size)


def test_combine_ops() -> None:
    a, b = torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])
    for op, want in [(ReduceOp.SUM, [4, 7]), (ReduceOp.AVERAGE, [4, 7]), (ReduceOp.MIN, [1, 2]),
                     (ReduceOp.MAX, [3, 5])]:
        x = a.clone()
        combine_(x, b, op)
        assert x.tolist() == want


def test_flat_work_uses_contiguous_tensors_in_place_and_stages_others() -> None:
    t = torch.zeros(3, 4)
    flat, back = flat_work(t)
    assert back is None and flat.data_ptr() == t.data_ptr()
    nc = torch.zeros(4, 3).t()
    flat, back = flat_work(nc)
    assert back is not None
    flat.fill_(2.0)
    back()
    assert bool((nc == 2.0).all())


def test_scratch_pool_reuses_its_buffer() -> None:
    pool = ScratchPool()
    a = pool.get(torch.float32, 100)
    b = pool.get(torch.float32, 50)
    assert b.data_ptr() == a.data_ptr()
    c = pool.get(torch.float32, 200)
    assert c.numel() == 200 and pool.nbytes() == 800


def _my_allreduce(tensor, op, name):  # a user-written algorithm
    raise NotImplementedError


class _MyAlgorithm:
    def __call__(self, tensor, op, name):
        raise NotImplementedError


def test_strategy_settings_are_the_same_in_every_process() -> None:
    assert strategy_settings(Ring(chunks_per_rank=2, stall_timeout=9)) == {
        "strategy": "ring", "chunks_per_rank": "2"}
    assert strategy_settings("native") == {"strategy": "native"}
    # No memory addresses: they differ between processes and would be false mismatches.
    assert strategy_settings(_my_allreduce) == {"strategy": f"{__name__}._my_allreduce"}
    assert strategy_settings(_MyAlgorithm()) == {"strategy": f"{__name__}._MyAlgorithm"}
