"""BackwardOverlap: buckets launched during backward, in plan order, with a fake exchange.

The module is loaded from its file: importing the ``ringtrain.keras`` package would
import Keras, which the pytest process must not do (Keras picks its backend once per
process). It needs only torch and ``ringtrain.fusion``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import ringtrain
from ringtrain.collectives import Average, Handle
from ringtrain.compression import Compression
from ringtrain.fusion import FusedExchange

_PATH = Path(ringtrain.__file__).parent / "keras" / "overlap.py"
_spec = importlib.util.spec_from_file_location("ringtrain_keras_overlap_under_test", _PATH)
assert _spec is not None and _spec.loader is not None
overlap_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overlap_mod)
BackwardOverlap = overlap_mod.BackwardOverlap


class Recorder:
    """A fake exchange: records each launch (bucket name, whether backward was running)
    and adds 1 to every element when waited for, so results are checkable."""

    def __init__(self) -> None:
        self.launched: list[tuple[str, bool]] = []
        self.in_backward = False
        self.waits = 0

    def __call__(self, flat: torch.Tensor, op: Any, name: str | None) -> Handle:
        self.launched.append((str(name), self.in_backward))

        def wait() -> None:
            self.waits += 1
            flat.add_(1.0)

        return Handle(flat, wait, name)


def _setup(bucket_bytes: int = 1) -> tuple[torch.nn.Module, list[torch.Tensor], FusedExchange, Recorder]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    params = list(model.parameters())
    rec = Recorder()
    # Size 1: Average's pre-scale is 1, so results are gradient + 1.
    fusion = FusedExchange([f"p{i}" for i in range(len(params))], params, rec, Compression.none,
                           Average, 1, bucket_bytes)
    return model, params, fusion, rec


def _backward(model: torch.nn.Module, rec: Recorder) -> None:
    model.zero_grad(set_to_none=True)
    rec.in_backward = True
    try:
        model(torch.randn(5, 4)).square().sum().backward()
    finally:
        rec.in_backward = False


def _results(fusion: FusedExchange) -> list[torch.Tensor]:
    out = [torch.empty(0)] * len(fusion.numels)
    for bucket in fusion.buckets:
        fusion.wait(bucket)
        for position, index in enumerate(bucket.spec.params):
            out[index] = fusion.result(bucket, position)
    return out


def test_every_bucket_starts_during_backward_in_plan_order() -> None:
    model, params, fusion, rec = _setup()
    ov = BackwardOverlap(fusion, params, lambda: True, lambda i, g: g)
    ov.attach()
    _backward(model, rec)
    assert [name for name, _ in rec.launched] == [b.name for b in fusion.buckets]
    assert all(during for _, during in rec.launched)  # none waited for apply
    grads = [p.grad for p in params]
    assert ov.started() and ov.matches(grads)
    ov.finish(grads)  # nothing left to launch
    assert len(rec.launched) == len(fusion.buckets)
    for p, r in zip(params, _results(fusion), strict=True):
        torch.testing.assert_close(r, p.grad + 1)
    ov.done()
    assert not ov.started()


def test_a_bucket_waits_for_its_last_gradient_and_missing_ones_go_at_finish() -> None:
    model, params, fusion, rec = _setup(bucket_bytes=1 << 20)  # one bucket for all
    ov = BackwardOverlap(fusion, params, lambda: True, lambda i, g: g)
    ov.attach()
    model[0].weight.requires_grad_(False)  # never gets a gradient: its bucket cannot start
    _backward(model, rec)
    assert rec.launched == []
    grads = [p.grad for p in params]
    ov.finish(grads)  # apply's turn: the missing gradient contributes zeros
    assert [during for _, during in rec.launched] == [False]
    results = _results(fusion)
    torch.testing.assert_close(results[0], torch.ones_like(params[0]))


def test_not_due_passes_hand_over_nothing() -> None:
    model, params, fusion, rec = _setup()
    ov = BackwardOverlap(fusion, params, lambda: False, lambda i, g: g)
    ov.attach()
    _backward(model, rec)
    assert rec.launched == [] and not ov.started()


def test_other_gradients_than_backward_left_do_not_match() -> None:
    model, params, fusion, rec = _setup()
    ov = BackwardOverlap(fusion, params, lambda: True, lambda i, g: g)
    ov.attach()
    _backward(model, rec)
    assert not ov.matches([p.grad * 1 for p in params])
    ov.drain()  # what was launched is finished and discarded
    assert rec.waits == len(fusion.buckets) and not ov.started()


def test_a_second_backward_before_apply_finishes_the_first_and_starts_over() -> None:
    model, params, fusion, rec = _setup()
    ov = BackwardOverlap(fusion, params, lambda: True, lambda i, g: g)
    ov.attach()
    _backward(model, rec)
    _backward(model, rec)
    n = len(fusion.buckets)
    assert rec.waits == n and len(rec.launched) == 2 * n
    assert ov.matches([p.grad for p in params])


def test_a_newer_overlap_on_the_same_variables_detaches_the_older() -> None:
    model, params, fusion, rec = _setup()
    old = BackwardOverlap(fusion, params, lambda: True, lambda i, g: g)
    old.attach()
    _, _, fusion2, rec2 = _setup()
    new = BackwardOverlap(FusedExchange([f"p{i}" for i in range(len(params))], params, rec2,
                                        Compression.none, Average, 1, 1), params, lambda: True,
                          lambda i, g: g)
    new.attach()
    assert not old.attached and new.attached
    _backward(model, rec)
    assert rec.launched == [] and len(rec2.launched) == len(fusion.buckets)
    new.detach()
    assert not any(hasattr(p, "_ringtrain_keras_overlap") for p in params)


@pytest.mark.parametrize("passes", [2, 3])
def test_the_due_pass_exchanges_the_local_sum(passes: int) -> None:
    model, params, fusion, rec = _setup()
    sums: list[torch.Tensor | None] = [None] * len(params)
    count = {"passes": 0}

    def source(i: int, g: torch.Tensor) -> torch.Tensor:
        acc = sums[i]
        return g if acc is None else acc + g

    ov = BackwardOverlap(fusion, params, lambda: count["passes"] + 1 == passes, source)
    ov.attach()
    total = [torch.zeros_like(p) for p in params]
    for _ in range(passes):
        _backward(model, rec)
        for i, p in enumerate(params):
            total[i] += p.grad
            if count["passes"] + 1 < passes:
                sums[i] = p.grad.clone() if sums[i] is None else sums[i] + p.grad
        count["passes"] += 1
    assert len(rec.launched) == len(fusion.buckets)
    for t, r in zip(total, _results(fusion), strict=True):
        torch.testing.assert_close(r, t + 1)
